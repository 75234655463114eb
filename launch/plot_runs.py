#!/usr/bin/env python
"""Compare runs: their training and validation nll against updates in one plot, and a table.

    python launch/plot_runs.py runs/depth/admin_6L-6L runs/depth/admin_18L-18L --out runs/depth/curves.png

Reads each run directory's metrics.jsonl while it trains or after (a resumed or rolled-back run
logs some updates twice: each keeps its last value). Prints, per run, the updates logged and the
best validation nll with its update. A run without metrics, a malformed record (named by file and
line) or an --out that is not .png, .pdf or .svg is refused with exit status 2.
"""

import argparse
import sys

from admin_ds.arguments import existing_path, output_file

FORMATS = (".png", ".pdf", ".svg")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=existing_path, help="run directories (holding metrics.jsonl)")
    p.add_argument("--out", required=True, type=output_file, help=f"figure to write ({', '.join(FORMATS)})")
    args = p.parse_args(argv)
    if args.out.suffix.lower() not in FORMATS:
        p.error(f"--out {args.out}: the figure's format comes from its suffix, one of {', '.join(FORMATS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from admin_ds.errors import UserError
    from admin_ds.train.atlas_report import plot_runs, run_curves

    try:
        curves = [run_curves(run) for run in args.runs]
        for c in curves:
            if not c["train"] and not c["valid"]:
                raise UserError(f"{c['run']}: no training or validation records in metrics.jsonl "
                                "(not a run directory, or it has not logged an update yet)")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    plot_runs(curves, args.out)
    print("| run | updates | best validation nll (bits) | at update |\n|---|---:|---:|---:|")
    for c in curves:
        update, nll = c["best"] or ("-", None)
        print(f"| {c['run']} | {c['updates']} | {'-' if nll is None else format(nll, '.3f')} | {update} |")
    print(f"[plot] {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
