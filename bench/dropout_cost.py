"""What dropout's masks cost in a training step: ``engine.dropout`` torch against bulk.

    python bench/dropout_cost.py --preset base-6L-6L --tokens 4096 --repeats 3

One thread, and CPU time of this process (``time.process_time``) rather than wall time, so that
other work on the machine changes the figures little: a shared 2-core machine moves wall-clock
benchmarks by tens of percent from run to run. For each implementation: dropout alone on a
(tokens x ffn_inner_dim) tensor, forward and backward, and a whole forward and backward pass of
the model (no optimizer, no DeepSpeed) on one batch of ``--tokens`` target tokens (sentences of
``--length`` tokens). The median of ``--repeats`` after one warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def cpu_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return statistics.median(times)


def main() -> None:
    from admin_ds.model import build_model
    from admin_ds.model.dropout import dropout
    from admin_ds.model.transformer import set_dropout_impl
    from admin_ds.presets import get_preset

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="base-6L-6L")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--length", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="append the result as one JSON object")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = get_preset(args.preset)
    model = build_model(cfg, seed=1)
    rows = args.tokens // args.length
    src = torch.randint(4, cfg.vocab_size, (rows, args.length))
    tgt = torch.randint(4, cfg.vocab_size, (rows, args.length))
    x = torch.randn(args.tokens, cfg.ffn_inner_dim, requires_grad=True)
    g = torch.ones_like(x)

    def step():
        model.zero_grad(set_to_none=True)
        model(src, tgt).logsumexp(-1).mean().backward()

    out = {"preset": args.preset, "tokens": args.tokens, "threads": 1}
    for impl in ("torch", "bulk"):
        set_dropout_impl(model, impl)
        out[f"{impl}_dropout_ffn_s"] = round(cpu_seconds(
            lambda: dropout(x, cfg.activation_dropout_p, True, impl).backward(g), args.repeats), 4)
        out[f"{impl}_step_s"] = round(cpu_seconds(step, args.repeats), 3)
    out["step_speedup"] = round(out["torch_step_s"] / out["bulk_step_s"], 3)
    print(json.dumps(out))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
