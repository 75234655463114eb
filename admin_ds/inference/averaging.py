"""Checkpoint averaging: the papers evaluate the mean of the last 10 checkpoints' weights
(ADMIN_NOTES.md section 5). Command line: launch/average_checkpoints.py. A run that stops on
``train.patience`` can instead average its checkpoints of lowest validation loss (``best``, those
``train.keep_best`` kept): its last ones come after its best.

Each checkpoint's fp32 weights come from DeepSpeed's consolidation (model_file.py), whatever its
ZeRO stage, pipeline layout and world size; every parameter is averaged in float64 and cast back.
The model config, Admin profile and run config of the newest checkpoint, and the run's subword
model, travel with the result. Checkpoints whose model configs, subword models or parameter names
differ are refused, naming the two checkpoints and the fields.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from admin_ds.checkpoint_format import best_verified_tags, newest_verified_tags
from admin_ds.errors import CheckpointError
from admin_ds.inference.model_file import ModelFile, load_run_checkpoint


def average_checkpoints(run_dir: Path, last: int, log=lambda msg: print(msg, file=sys.stderr),
                        trust_unverified: bool = False, best: bool = False) -> ModelFile:
    """The ModelFile averaging the ``last`` newest complete, intact checkpoints of ``run_dir``
    (with ``best``: the ``last`` of lowest recorded validation loss). A checkpoint whose files no
    longer match their digests is set aside (``<tag>.corrupt``, as a resume does), with a warning,
    and another takes its place."""
    if not run_dir.is_dir():
        raise CheckpointError(f"{run_dir}: no such run directory")
    choose = best_verified_tags if best else newest_verified_tags
    tags = choose(run_dir / "checkpoints", last, log=lambda msg: log(f"warning: {msg}"))
    if len(tags) < last:
        which = ("intact checkpoint(s) with a recorded validation loss (train.keep_best keeps them)" if best
                 else "complete, intact checkpoint(s)")
        raise CheckpointError(f"{run_dir}: {len(tags)} {which} ({', '.join(tags) or 'none'}), "
                              f"fewer than --{'best' if best else 'last'} {last}")
    sums: dict[str, torch.Tensor] = {}
    first = newest = None
    for tag in tags:
        mf = load_run_checkpoint(run_dir, tag, trust_unverified)
        if first is None:
            first = mf
            sums = {k: v.double() for k, v in mf.state_dict.items()}
        else:
            if mf.model_config != first.model_config:
                a, b = first.model_config.to_dict(), mf.model_config.to_dict()
                diff = ", ".join(f"model.{k}: {a[k]!r} vs {b[k]!r}" for k in a if a[k] != b[k])
                raise CheckpointError(f"{run_dir}: {tags[0]} and {tag} have different model configs ({diff})")
            if mf.subword_sha256 != first.subword_sha256 or mf.state_dict.keys() != sums.keys():
                raise CheckpointError(f"{run_dir}: {tags[0]} and {tag} differ in their subword model or "
                                      f"parameter names")
            for k, v in mf.state_dict.items():
                sums[k] += v.double()
        newest = mf
        log(f"[average] + {tag} (update {mf.meta.get('update')})")
    state = {k: (v / len(tags)).to(newest.state_dict[k].dtype) for k, v in sums.items()}
    meta = {**newest.meta, "source": str(run_dir.resolve()), "averaged_tags": tags,
            "weights_from": f"mean of {len(tags)} checkpoints ({newest.meta.get('weights_from')})"}
    return ModelFile(model_config=newest.model_config, state_dict=state, profile=newest.profile,
                     run_config=newest.run_config, subword_model_bytes=newest.subword_model_bytes, meta=meta)
