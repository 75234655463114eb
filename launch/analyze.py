#!/usr/bin/env python
"""Why a configuration will or will not train: output change and layer dependency at initialisation.

    python launch/analyze.py --depths 1 2 4 8 16 32 --inits post pre admin --out runs/analysis
    python launch/analyze.py --depths 6 18 60 --inits post admin deepnorm t-fixup --model-dim 128 \\
        --target model --out runs/analysis_full

Writes DIR/analysis.json, DIR/output_change.png and DIR/dependency_<init>.png (beta of the deepest
model), and prints a table. Definitions and the choices behind them: ``admin_ds/model/analysis.py``.
"""

from __future__ import annotations

import argparse
import sys

from admin_ds.arguments import float_in, int_in
from admin_ds.errors import UserError
from admin_ds.files import describe_os_error
from admin_ds.model.analysis import INIT_VARIANTS, SCOPES, TARGETS, format_table, run_analyses, write_report
from admin_ds.model.presets import PRESET_NAMES
from admin_ds.model.profiling import FORMULAS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depths", type=int_in(1), nargs="+", default=[1, 2, 4, 8, 16, 32],
                   help="encoder layers N (each 2 sub-layers)")
    p.add_argument("--inits", nargs="+", default=["post", "pre", "admin"], choices=list(INIT_VARIANTS))
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--seeds", type=int_in(1), default=4, help="models per (init, depth): seeds 0..K-1")
    p.add_argument("--repeats", type=int_in(1), default=4, help="perturbations per model")
    p.add_argument("--sigma", type=float_in(0, low_open=True), default=0.001, help="absolute std of the perturbation")
    p.add_argument("--scope", choices=SCOPES, default="branches",
                   help="perturb attention/FFN parameters only, or every parameter")
    p.add_argument("--target", choices=TARGETS, default="encoder",
                   help="F = encoder output, or the final decoder states of the whole model")
    p.add_argument("--base-preset", choices=PRESET_NAMES, default="debug-tiny")
    p.add_argument("--model-dim", type=int_in(2), default=64)
    p.add_argument("--ffn-dim", type=int_in(1), default=None, help="default 4 * model-dim")
    p.add_argument("--heads", type=int_in(1), default=None, help="default: the preset's")
    p.add_argument("--decoder-layers", type=int_in(1), default=None, help="default: = depth")
    p.add_argument("--batch-size", type=int_in(1), default=8)
    p.add_argument("--src-len", type=int_in(1), default=16)
    p.add_argument("--tgt-len", type=int_in(1), default=16)
    p.add_argument("--formula", choices=FORMULAS, default="reference", help="Admin profiling formula")
    p.add_argument("--threads", type=int_in(0), default=1, help="torch threads (0: leave torch's default)")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = run_analyses(
            args.depths, args.inits, range(args.seeds), base_preset=args.base_preset, model_dim=args.model_dim,
            ffn_inner_dim=args.ffn_dim, num_heads=args.heads, decoder_layers=args.decoder_layers,
            sigma=args.sigma, repeats=args.repeats, scope=args.scope, target=args.target,
            batch_size=args.batch_size, src_len=args.src_len, tgt_len=args.tgt_len, formula=args.formula,
            num_threads=args.threads or None, progress=not args.no_progress)
        paths = write_report(result, args.out)
    except UserError as e:  # a model the options do not describe (e.g. heads that do not divide the width)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: --out: {describe_os_error(e)}", file=sys.stderr)
        return 2
    print(format_table(result))
    print(f"runtime {result['runtime_s']:.1f} s; wrote {', '.join(str(p) for p in paths.values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
