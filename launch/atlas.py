#!/usr/bin/env python
"""The stability atlas: which residual form trains at which depth and learning rate, on real text.

    python launch/atlas.py --raw-dir ../shared/data/multi30k --out runs/atlas          # Multi30k en-de
    python launch/atlas.py --data data/m30k --out runs/atlas --inits post pre admin deepnorm \\
        --depths 6 18 60-12 100-12 --lrs 1e-3 3e-3 --seeds 1 2 --updates 400   # 60+ layers: 2 pipeline stages
    python launch/atlas.py --scale gpu --data data/wmt14_en_de --out runs/atlas_gpu    # 512/2048/8, 6L to 100L-12L
    python launch/atlas.py ... --model.dropout_p=0.3      # any --section.key=value goes to every cell

Every cell is an ordinary run of launch/train.py in OUT/cells/<init>_<depth>_lr<lr>_wu<warmup>[_s<seed>]/
with the same data, hyper-parameters and seeds; only the initialisation / residual form changes.
Rerunning the command skips finished cells and resumes unfinished ones. Writes OUT/atlas.json,
OUT/atlas.md and the plots. The grid, the outcome rules and the report:
admin_ds/train/atlas.py and atlas_report.py.

--raw-dir takes Multi30k's files as multi30k/dataset ships them (data/task1/raw:
train.{en,de}.gz, val.*, test_2016_flickr.*) and prepares them once into OUT/data with
data_prep (joint SentencePiece, --vocab-size pieces).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

import admin_ds
from admin_ds.arguments import float_in, int_in, output_dir

HERE = Path(__file__).resolve().parent


def check_checkout() -> None:
    """An atlas pinned to a commit (a second checkout) must train that commit, not the admin_ds an
    environment installs from another checkout."""
    own, imported = HERE.parent / "admin_ds", Path(admin_ds.__file__).resolve().parent
    if own.is_dir() and own.resolve() != imported:
        print(f"error: {HERE / 'atlas.py'} would run the admin_ds of {imported.parent}; install this checkout "
              f"(bash launch/setup_env.sh) or run with PYTHONPATH={HERE.parent}", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    from admin_ds.model.analysis import INIT_VARIANTS
    from admin_ds.train.atlas import SCALES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", required=True, type=output_dir, help="atlas directory (cells, report)")
    data = p.add_mutually_exclusive_group(required=True)
    data.add_argument("--data", help="a prepared data directory (manifest.json)")
    data.add_argument("--raw-dir", help="Multi30k raw files (train/val/test_2016_flickr .gz); prepared into OUT/data")
    p.add_argument("--pair", default="en-de", help="with --raw-dir: SRC-TGT")
    p.add_argument("--vocab-size", type=int_in(8), default=8000, help="with --raw-dir: joint SentencePiece pieces")
    p.add_argument("--scale", choices=sorted(SCALES), default="cpu",
                   help="defaults of the grid: narrow (cpu) or the papers' width (gpu)")
    p.add_argument("--inits", nargs="+", choices=list(INIT_VARIANTS), help="default: post pre admin")
    p.add_argument("--depths", nargs="+", help="N (N-N) or N-M encoder-decoder layers")
    p.add_argument("--lrs", nargs="+", type=float_in(0, low_open=True), help="peak learning rates")
    p.add_argument("--warmups", nargs="+", type=int_in(0), help="warmup updates")
    p.add_argument("--updates", type=int_in(1), help="updates per cell")
    p.add_argument("--model-dim", type=int_in(2))
    p.add_argument("--ffn-dim", type=int_in(1))
    p.add_argument("--heads", type=int_in(1))
    p.add_argument("--max-tokens", type=int_in(1), help="padded tokens per micro-batch")
    p.add_argument("--valid-interval", type=int_in(1), help="validation (and checkpoint) every N updates")
    p.add_argument("--bleu-sentences", type=int_in(0), help="validation sentences decoded for BLEU (0: all)")
    p.add_argument("--bleu-beam", type=int_in(1))
    p.add_argument("--seeds", nargs="+", type=int_in(0), help="run seeds: every cell once per seed (default 1)")
    p.add_argument("--pipeline-from", type=int_in(0), help="cells of this many layers or more (encoder + decoder) "
                                                          "run as 2 pipeline stages on 2 ranks (default 60 with "
                                                          "--scale cpu; 0: never)")
    p.add_argument("--deepspeed_config", help="engine JSON for every cell (default ds_configs/zero1.json; "
                                              "zero1_bf16.json with --scale gpu)")
    p.add_argument("--jobs", type=int_in(1), help="cells at a time (default: one per GPU, else 1)")
    p.add_argument("--output-change-seeds", type=int_in(0), default=2, help="models per (init, depth) for the "
                                                                      "Theorem 2 curve; 0 skips it")
    p.add_argument("--report-only", action="store_true", help="write the report from the cells there are")
    return p


def main(argv=None) -> int:
    check_checkout()
    argv = sys.argv[1:] if argv is None else list(argv)
    args, extra = build_parser().parse_known_args(argv)
    from admin_ds.errors import UserError
    from admin_ds.train.atlas import Atlas, AtlasGrid, output_change_curve
    from admin_ds.train.atlas_report import write_report

    try:
        bad = [a for a in extra if not (a.startswith("--") and "." in a.split("=")[0] and "=" in a)]
        if bad:
            raise UserError(f"unrecognised argument(s) {' '.join(bad)}; cell settings are --section.key=value")
        grid = AtlasGrid.for_scale(
            args.scale, inits=args.inits, depths=args.depths, lrs=args.lrs, warmups=args.warmups,
            model_dim=args.model_dim, ffn_inner_dim=args.ffn_dim, num_heads=args.heads, max_updates=args.updates,
            max_tokens=args.max_tokens, valid_interval=args.valid_interval, bleu_sentences=args.bleu_sentences,
            bleu_beam=args.bleu_beam, seeds=args.seeds, pipeline_from=args.pipeline_from, extra=extra, deepspeed_config=args.deepspeed_config)
        if args.deepspeed_config is None:  # the scale's engine JSON, from wherever the command runs
            grid.deepspeed_config = os.path.relpath(HERE.parent / grid.deepspeed_config)
        grid.check_settings()
        out = Path(args.out)
        data = Path(args.data) if args.data else out / "data"
        if args.raw_dir:
            from data_prep.prepare import main as prepare

            rc = prepare([args.pair, str(data), "--raw-dir", args.raw_dir, "--train-prefix", "train",
                          "--valid-prefix", "val", "--test-prefix", "test_2016_flickr",
                          "--vocab-size", str(args.vocab_size), "--quiet"])
            if rc:
                return rc
        atlas = Atlas(grid, data, out, train_command=[sys.executable, str(HERE / "train.py")])
        if not args.report_only:
            atlas.run(args.jobs)
        curve = output_change_curve(grid, seeds=args.output_change_seeds) if args.output_change_seeds else None
        report = atlas.collect(curve)
        paths = write_report(report, out, "python launch/atlas.py " + shlex.join(argv))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print((out / "atlas.md").read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    failed = [c["name"] for c in report["cells"] if c["outcome"] == "failed"]
    if failed:  # an error, not an outcome: the report says which and why
        print(f"error: {len(failed)} cell(s) failed with an error ({', '.join(failed)}); see their train.log",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
