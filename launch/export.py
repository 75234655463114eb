"""Export a trained model to Hugging Face Marian (transformers) or CTranslate2.

    python launch/export.py --checkpoint runs/x --format hf-marian --out export/x-hf
    python launch/export.py --checkpoint runs/x/avg10.pt --format ct2 --out export/x-ct2

--checkpoint is a run directory, a checkpoint tag directory or a model file. Omega is folded away
first, so the export is a vanilla Post-LN Transformer; the export reloads what it wrote and checks
the logits, and carries translate.py's decoding defaults (generation_config.json,
decoding_defaults.json). The directory appears complete or not at all; an existing non-empty one
is replaced only with --force. docs/recipes/serving.md: loading and decoding an export;
admin_ds/inference/export.py: the details, and what cannot be exported.
"""

import argparse
import sys
from pathlib import Path

from admin_ds import logs
from admin_ds.arguments import existing_path
from admin_ds.inference.export import FORMATS


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, type=existing_path, help="run dir, checkpoint tag dir or model file")
    p.add_argument("--tag", help="checkpoint tag in a run dir (default: the newest complete one)")
    p.add_argument("--format", choices=FORMATS, default="hf-marian")
    p.add_argument("--out", required=True, type=Path, help="output directory (created; must be empty if it exists)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists and is not empty")
    p.add_argument("--trust-unverified", action="store_true",
                   help="accept a checkpoint or model file written without digests (an older version)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logs.quiet_known_warnings()
    from admin_ds.errors import UserError
    from admin_ds.files import describe_os_error
    from admin_ds.inference.export import check_destination, export
    from admin_ds.inference.model_file import load_any

    try:
        check_destination(args.out, args.force, args.checkpoint)  # before the model is loaded: a bad --out fails fast
        report = export(load_any(args.checkpoint, args.tag, args.trust_unverified), args.format, args.out, args.force)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, say: nothing is left at --out
        print(f"error: {describe_os_error(e)}", file=sys.stderr)
        return 2
    print(f"[export] {args.format} -> {args.out} (logits max abs diff vs ours after reload: "
          f"{report['logits_max_abs_diff']:.2e})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
