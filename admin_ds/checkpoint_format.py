"""The checkpoint file format: what a complete, intact checkpoint of a run is, for the code that
writes checkpoints (train/checkpoints.py) and the code that reads them without an engine
(inference/model_file.py, inference/averaging.py). It sits below both, so neither imports the other.

    RUN_DIR/checkpoints/
      update_000500/            DeepSpeed's files + COMPLETE + rng_rank{r}.pt
      update_000500_universal/  its universal conversion (CONVERTED inside when complete)
      update_000250.corrupt/    a checkpoint whose files no longer match their digests (CORRUPT inside)
      latest_complete           "update_000500"

``COMPLETE`` is a small JSON written last, atomically: the layout, model config and subword hash of
the run, the size and sha256 of every file each rank wrote, and the validation loss when the
checkpoint was saved at a validation's update (``valid_loss``: what ``train.keep_best`` and
``average_checkpoints.py --best`` rank by). A tag without a ``COMPLETE`` that parses is a torn
write; a tag whose files differ from its digests is corrupt and is set aside, never loaded.
DeepSpeed is imported only by ``ds_to_universal``, where it runs.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Optional

from admin_ds import files, logs

COMPLETE = "COMPLETE"
POINTER = "latest_complete"
CONVERTED = "CONVERTED"  # marker of a complete universal conversion
TAG_PATTERN = re.compile(r"^update_(\d+)$")


def tag_for(update: int) -> str:
    return f"update_{update:06d}"


def read_info(tag_dir: Path) -> dict:
    """The ``COMPLETE`` marker's description of a complete checkpoint ({} if it does not parse)."""
    try:
        info = json.loads((tag_dir / COMPLETE).read_text())
    except (OSError, ValueError):  # ValueError: invalid JSON or invalid UTF-8
        return {}
    return info if isinstance(info, dict) else {}


def is_complete(tag_dir: Path) -> bool:
    """A ``COMPLETE`` marker that parses: one that does not (a torn or damaged write) counts as
    incomplete, so the previous checkpoint is chosen instead of failing every rerun."""
    return (tag_dir / COMPLETE).is_file() and isinstance(read_info(tag_dir), dict) and bool(read_info(tag_dir))


def complete_tags(ckpt_dir: Path) -> list[str]:
    """Complete tags, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    tags = [(int(m.group(1)), p.name) for p in ckpt_dir.iterdir()
            if p.is_dir() and (m := TAG_PATTERN.match(p.name)) and is_complete(p)]
    return [name for _, name in sorted(tags)]


def newest_complete(ckpt_dir: str | os.PathLike) -> Optional[str]:
    ckpt_dir = Path(ckpt_dir)
    pointer = ckpt_dir / POINTER
    if pointer.is_file():
        tag = pointer.read_text().strip()
        if tag and is_complete(ckpt_dir / tag):
            newer = [t for t in complete_tags(ckpt_dir) if t > tag]
            return newer[-1] if newer else tag
    tags = complete_tags(ckpt_dir)
    return tags[-1] if tags else None


def verify(tag_dir: Path) -> Optional[str]:
    """What is wrong with a complete checkpoint's files (size or sha256 against the digests in
    ``COMPLETE``), or None. Checkpoints written before digests were recorded pass."""
    for name, (size, digest) in sorted(read_info(tag_dir).get("files", {}).items()):
        f = tag_dir / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, {size} were written"
        if files.sha256_file(f) != digest:
            return f"{name} does not match its sha256"
    return None


def newest_verified(ckpt_dir: str | os.PathLike, log=print) -> Optional[str]:
    """The newest complete checkpoint whose files are intact. A corrupt one is moved aside to
    ``<tag>.corrupt`` (kept for inspection, never loaded, never pruned) with the reason in it,
    and the next older one is tried. One process only (rank 0)."""
    ckpt_dir = Path(ckpt_dir)
    while (tag := newest_complete(ckpt_dir)) is not None:
        problem = verify(ckpt_dir / tag)
        if problem is None:
            return tag
        _set_aside(ckpt_dir, tag, problem, log)
    return None


def newest_verified_tags(ckpt_dir: str | os.PathLike, count: int, log=print) -> list[str]:
    """The ``count`` newest complete checkpoints whose files are intact (fewer if there are not
    so many), oldest first; corrupt ones met on the way are set aside as by ``newest_verified``."""
    ckpt_dir = Path(ckpt_dir)
    return _first_intact(ckpt_dir, reversed(complete_tags(ckpt_dir)), count, log)[::-1]


def _first_intact(ckpt_dir: Path, candidates, count: int, log) -> list[str]:
    """The first ``count`` of ``candidates`` whose files are intact, in their order; the corrupt
    ones met on the way are set aside."""
    found = []
    for tag in candidates:
        if len(found) == count:
            break
        problem = verify(ckpt_dir / tag)
        if problem is None:
            found.append(tag)
        else:
            _set_aside(ckpt_dir, tag, problem, log)
    return found


def valid_loss(tag_dir: Path) -> Optional[float]:
    """The validation loss recorded with a complete checkpoint, or None (saved between
    validations, or by a version that did not record it)."""
    loss = read_info(tag_dir).get("valid_loss")
    return float(loss) if isinstance(loss, (int, float)) and math.isfinite(loss) else None


def tags_to_keep(ckpt_dir: Path, keep_last: int, keep_best: int = 0) -> set[str]:
    """The complete tags a prune keeps: the ``keep_last`` newest and the ``keep_best`` with the
    lowest recorded validation loss (the older one first among equals)."""
    tags = complete_tags(ckpt_dir)
    return set(tags[-keep_last:]) | set(_best_first(ckpt_dir, tags)[:keep_best])


def _best_first(ckpt_dir: Path, tags: list[str]) -> list[str]:
    """``tags`` (oldest first) that recorded a validation loss, lowest loss first."""
    scored = [(loss, i, t) for i, t in enumerate(tags) if (loss := valid_loss(ckpt_dir / t)) is not None]
    return [t for _, _, t in sorted(scored)]


def best_verified_tags(ckpt_dir: str | os.PathLike, count: int, log=print) -> list[str]:
    """The ``count`` intact checkpoints with the lowest recorded validation loss (fewer if there are
    not so many), oldest first; corrupt ones met on the way are set aside as by ``newest_verified``."""
    ckpt_dir = Path(ckpt_dir)
    tags = complete_tags(ckpt_dir)
    return sorted(_first_intact(ckpt_dir, _best_first(ckpt_dir, tags), count, log), key=tags.index)


def _set_aside(ckpt_dir: Path, tag: str, problem: str, log) -> None:
    log(f"[resume] {ckpt_dir / tag} is corrupt ({problem}): moved to {tag}.corrupt; "
        "trying the previous checkpoint")
    aside = ckpt_dir / f"{tag}.corrupt"
    shutil.rmtree(aside, ignore_errors=True)
    (ckpt_dir / tag / "CORRUPT").write_text(problem + "\n")
    os.replace(ckpt_dir / tag, aside)


def ds_to_universal(tag_dir: Path, out_dir: Path, num_workers: int = 1) -> None:
    """DeepSpeed's own converter to the universal (layout-free) checkpoint format."""
    from deepspeed.checkpoint import ds_to_universal as conv

    argv = ["--input_folder", str(tag_dir), "--output_folder", str(out_dir),
            "--num_extract_workers", str(num_workers), "--num_merge_workers", str(num_workers)]
    saved = sys.argv
    try:
        sys.argv = ["ds_to_universal"] + argv
        with logs.without_known_prints():
            args = conv.parse_arguments()
        conv.main(args)
    finally:
        sys.argv = saved
