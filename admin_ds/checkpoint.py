"""Atomic checkpoints: a torn checkpoint is never chosen for resume.

DeepSpeed's ``save_checkpoint`` is a plain ``torch.save`` per file, and its ``latest`` file is
written by rank 0 *before* the final barrier, so a kill in that window leaves ``latest`` pointing
at a tag other ranks are still writing (DEEPSPEED_NOTES.md section 4). So:

1. every rank calls ``engine.save_checkpoint(dir, tag, client_state, save_latest=False)``
   (collective; it ends with a barrier), and writes its own RNG state into the tag;
2. after a barrier, rank 0 writes ``COMPLETE`` (a small JSON) into the tag, fsyncs it, and moves
   our own pointer ``latest_complete`` with ``os.replace``;
3. old complete tags beyond ``keep_last`` and incomplete leftovers are removed afterwards.

Resume takes the tag named by ``latest_complete`` if it is complete, else the newest tag with a
``COMPLETE`` marker. The client state carries everything needed to continue identically: the run
config, the Admin profile, the train state, the data iterator position; per-rank RNG states are
separate files because only rank 0's client state is saved.

Layout under ``RUN_DIR/checkpoints``::

    update_000500/            DeepSpeed files + COMPLETE + rng_rank{r}.pt
    latest_complete           "update_000500"
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from admin_ds import atomic
from admin_ds import engine as eng

COMPLETE = "COMPLETE"
POINTER = "latest_complete"
_TAG = re.compile(r"^update_(\d+)$")


def tag_for(update: int) -> str:
    return f"update_{update:06d}"


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def is_complete(tag_dir: Path) -> bool:
    return (tag_dir / COMPLETE).is_file()


def complete_tags(ckpt_dir: Path) -> list[str]:
    """Complete tags, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    tags = [(int(m.group(1)), p.name) for p in ckpt_dir.iterdir()
            if p.is_dir() and (m := _TAG.match(p.name)) and is_complete(p)]
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


def save(engine, ckpt_dir: str | os.PathLike, update: int, client_state: dict, keep_last: int) -> str:
    """Collective: every rank must call it. Returns the tag."""
    ckpt_dir = Path(ckpt_dir)
    tag = tag_for(update)
    tag_dir = ckpt_dir / tag
    if eng.rank() == 0 and tag_dir.exists():
        shutil.rmtree(tag_dir)  # a torn attempt at the same update from an earlier, killed run
    eng.barrier()
    state = dict(client_state)
    # Lets DeepSpeed's universal converter run on ZeRO<=2 checkpoints, so a run can later resume
    # on a different layout (DEEPSPEED_NOTES.md section 4).
    state["universal_checkpoint_info"] = {"universal_checkpoint_version": 0.4}
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=state, save_latest=False)
    torch.save(rng_state(), tag_dir / f"rng_rank{eng.rank()}.pt")
    eng.barrier()
    if eng.rank() == 0:
        atomic.write_text(tag_dir / COMPLETE, json.dumps({"update": update, "time": time.time(),
                                                     "world_size": eng.world_size()}) + "\n")
        atomic.write_text(ckpt_dir / POINTER, tag + "\n")
        _prune(ckpt_dir, keep_last, keep=tag)
    eng.barrier()
    return tag


def _prune(ckpt_dir: Path, keep_last: int, keep: str) -> None:
    complete = complete_tags(ckpt_dir)
    for old in complete[:-keep_last]:
        if old != keep:
            shutil.rmtree(ckpt_dir / old, ignore_errors=True)
    newest = complete[-1] if complete else keep
    for p in ckpt_dir.iterdir():  # torn tags older than the newest complete one are dead weight
        if p.is_dir() and _TAG.match(p.name) and not is_complete(p) and p.name < newest:
            shutil.rmtree(p, ignore_errors=True)


def load(engine, ckpt_dir: str | os.PathLike, tag: str, load_optimizer_states: bool = True) -> dict:
    """Load ``tag`` into the engine, restore this rank's RNG state, and return our client state."""
    ckpt_dir = Path(ckpt_dir)
    if not is_complete(ckpt_dir / tag):
        raise RuntimeError(f"{ckpt_dir / tag}: checkpoint is incomplete (no {COMPLETE} marker)")
    path, client = engine.load_checkpoint(str(ckpt_dir), tag=tag, load_optimizer_states=load_optimizer_states,
                                          load_lr_scheduler_states=load_optimizer_states)
    if path is None:
        raise RuntimeError(f"{ckpt_dir / tag}: DeepSpeed could not load the checkpoint")
    rng_file = ckpt_dir / tag / f"rng_rank{eng.rank()}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return client
