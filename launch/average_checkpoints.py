"""Average the last N complete checkpoints of a run (or the N of lowest validation loss) into one
fp32 model file.

    python launch/average_checkpoints.py --run runs/wmt14_en_de --last 10 --out runs/wmt14_en_de/avg10.pt
    python launch/translate.py --checkpoint runs/wmt14_en_de/avg10.pt --input newstest2014.en > out.de
    python launch/average_checkpoints.py --run runs/depth/admin_6L-6L --best 5 --out best5.pt  # train.keep_best=5

Any ZeRO stage, pipeline layout and world size (admin_ds/inference/averaging.py). Refused, with a
message and exit status 2: fewer than N complete checkpoints (with --best: fewer than N that
recorded a validation loss), checkpoints whose model configs or subword models differ; an --out
inside the run's checkpoints (the inputs), or that cannot be written (a read-only directory, a
path under a file or through a loop of links).
"""

import argparse
import sys

from admin_ds import logs
from admin_ds.arguments import existing_path, int_in, output_file


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, type=existing_path, help="run directory (holding checkpoints/)")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--last", type=int_in(1), help="number of newest complete checkpoints")
    which.add_argument("--best", type=int_in(1), help="number of checkpoints of lowest validation loss, among those "
                       "saved at a validation (train.keep_best keeps them)")
    p.add_argument("--out", required=True, type=output_file, help="model file to write")
    p.add_argument("--trust-unverified", action="store_true",
                   help="accept checkpoints written without digests (an older version)")
    args = p.parse_args(argv)
    inputs = (args.run / "checkpoints").resolve()
    if args.out.resolve().is_relative_to(inputs):  # a file there would be taken for part of a checkpoint
        p.error(f"--out {args.out} is inside the checkpoints it averages ({inputs}); write it elsewhere, "
                "e.g. beside them in the run directory")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logs.quiet_known_warnings()
    from admin_ds.errors import UserError
    from admin_ds.inference.averaging import average_checkpoints
    from admin_ds.inference.model_file import save_model_file

    try:
        mf = average_checkpoints(args.run, args.best or args.last, trust_unverified=args.trust_unverified,
                                 best=args.best is not None)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    save_model_file(args.out, mf.model_config, mf.state_dict, mf.profile, mf.run_config,
                    mf.subword_model_bytes, mf.meta)
    print(f"[average] {len(mf.meta['averaged_tags'])} checkpoints -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
