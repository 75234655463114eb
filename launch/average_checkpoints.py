"""Average the last N complete checkpoints of a run into one fp32 model file.

    python launch/average_checkpoints.py --run runs/wmt14_en_de --last 10 --out runs/wmt14_en_de/avg10.pt
    python launch/translate.py --checkpoint runs/wmt14_en_de/avg10.pt --input newstest2014.en > out.de

The papers evaluate the average of the last 10 checkpoints (ADMIN_NOTES.md section 5). Each
checkpoint's fp32 weights come from DeepSpeed's consolidation (admin_ds/model_file.py), whatever its
ZeRO stage and world size; every parameter is averaged in float64 and cast back to float32. The
model config, Admin profile and run config of the newest checkpoint, and the run's subword model,
travel with the result. Refused, with a message and exit code 2: fewer than N complete checkpoints,
checkpoints whose model configs or subword models differ.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="run directory (holding checkpoints/)")
    p.add_argument("--last", type=int, required=True, help="number of newest complete checkpoints")
    p.add_argument("--out", required=True, help="model file to write")
    args = p.parse_args(argv)
    if args.last < 1:
        p.error("--last must be >= 1")
    return args


def average_checkpoints(run_dir: Path, last: int):
    """The ModelFile averaging the ``last`` newest complete checkpoints of ``run_dir``."""
    import torch

    from admin_ds.checkpoint import complete_tags
    from admin_ds.model_file import ModelFile, ModelFileError, load_run_checkpoint

    if not run_dir.is_dir():
        raise ModelFileError(f"{run_dir}: no such run directory")
    tags = complete_tags(run_dir / "checkpoints")
    if len(tags) < last:
        raise ModelFileError(f"{run_dir}: {len(tags)} complete checkpoint(s) "
                             f"({', '.join(tags) or 'none'}), fewer than --last {last}")
    tags = tags[-last:]

    sums: dict[str, torch.Tensor] = {}
    first = newest = None
    for tag in tags:
        mf = load_run_checkpoint(run_dir, tag)
        if first is None:
            first = mf
            sums = {k: v.double() for k, v in mf.state_dict.items()}
        else:
            if mf.model_config != first.model_config:
                a, b = first.model_config.to_dict(), mf.model_config.to_dict()
                diff = ", ".join(f"model.{k}: {a[k]!r} vs {b[k]!r}" for k in a if a[k] != b[k])
                raise ModelFileError(f"{run_dir}: {tags[0]} and {tag} have different model configs ({diff})")
            if mf.subword_sha256 != first.subword_sha256 or mf.state_dict.keys() != sums.keys():
                raise ModelFileError(f"{run_dir}: {tags[0]} and {tag} differ in their subword model or "
                                     f"parameter names")
            for k, v in mf.state_dict.items():
                sums[k] += v.double()
        newest = mf
        print(f"[average] + {tag} (update {mf.meta.get('update')})", file=sys.stderr)

    state = {k: (v / len(tags)).to(newest.state_dict[k].dtype) for k, v in sums.items()}
    meta = {**newest.meta, "source": str(run_dir.resolve()), "averaged_tags": tags,
            "weights_from": f"mean of {len(tags)} checkpoints ({newest.meta.get('weights_from')})"}
    return ModelFile(model_config=newest.model_config, state_dict=state, profile=newest.profile,
                     run_config=newest.run_config, subword_model_bytes=newest.subword_model_bytes, meta=meta)


def main(argv=None) -> int:
    args = parse_args(argv)
    from admin_ds.model_file import ModelFileError, save_model_file

    try:
        mf = average_checkpoints(Path(args.run), args.last)
    except (ModelFileError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    save_model_file(args.out, mf.model_config, mf.state_dict, mf.profile, mf.run_config,
                    mf.subword_model_bytes, mf.meta)
    print(f"[average] {len(mf.meta['averaged_tags'])} checkpoints -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
