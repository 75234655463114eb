"""Model presets and a model-level Admin demo.

    python launch/models.py list                      # presets with parameter counts
    python launch/models.py demo --preset admin-18L-18L --formula reference
        # build, profile omega on a random batch, fold it, print the omega table and fold error
"""

from __future__ import annotations

import argparse
import time


import torch

from admin_ds.arguments import int_in
from admin_ds.model import build_model, count_parameters
from admin_ds.model.fold import fold_omega
from admin_ds.model.presets import PRESET_NAMES, get_preset, preset_table
from admin_ds.model.profiling import omega_table, profile_omega


def cmd_list(args: argparse.Namespace) -> None:
    rows = preset_table(tuple(args.vocab))
    head = f"{'preset':22} {'layers':9} {'D/F/H':14} {'init':8}" + "".join(f" {'params@' + str(v):>14}" for v in args.vocab)
    print(head)
    for r in rows:
        counts = "".join(f" {r[f'params@{v}'] / 1e6:13.1f}M" for v in args.vocab)
        print(f"{r['preset']:22} {r['layers']:9} {r['dims']:14} {r['init']:8}{counts}")


def cmd_demo(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    cfg = get_preset(args.preset, vocab_size=args.vocab_size)
    model = build_model(cfg)
    print(f"{args.preset}: {count_parameters(model) / 1e6:.1f}M parameters, "
          f"{cfg.num_encoder_sublayers} encoder + {cfg.num_decoder_sublayers} decoder sub-layers")
    g = torch.Generator().manual_seed(args.seed)
    src = torch.randint(4, cfg.vocab_size, (args.batch, args.length), generator=g)
    tgt = torch.randint(4, cfg.vocab_size, (args.batch, args.length), generator=g)
    t0 = time.perf_counter()
    profile = profile_omega(model, (src, tgt), formula=args.formula, seed=args.seed)
    print(f"profiled {profile.tokens} tokens with the {args.formula} formula in {time.perf_counter() - t0:.2f}s")
    print(omega_table(profile))
    model.eval()
    folded = fold_omega(model)
    with torch.no_grad():
        err = (model(src, tgt) - folded(src, tgt)).abs().max().item()
    print(f"folded into a vanilla Post-LN model: max |logit difference| = {err:.2e}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("list", help="presets with parameter counts")
    ls.add_argument("--vocab", type=int_in(5), nargs="+", default=[32768, 44512])
    ls.set_defaults(fn=cmd_list)
    demo = sub.add_parser("demo", help="build, profile, fold")
    demo.add_argument("--preset", default="admin-18L-18L", choices=PRESET_NAMES)
    demo.add_argument("--formula", default="reference", choices=["reference", "paper"])
    demo.add_argument("--vocab-size", type=int_in(5), default=8000)
    demo.add_argument("--batch", type=int_in(1), default=8)
    demo.add_argument("--length", type=int_in(2), default=24)
    demo.add_argument("--seed", type=int, default=1)
    demo.set_defaults(fn=cmd_demo)
    args = p.parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main()
