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
separate files because only rank 0's client state is saved. They are stored as tensors and plain
numbers, so they load with ``weights_only=True``.

``COMPLETE`` also describes the checkpoint: its layout, model config and subword hash (so every
rank can plan the resume before the engine is built, reliability.py), and the size and sha256 of
every file each rank wrote (so a checkpoint corrupted later is detected and set aside before it
is loaded, ``newest_verified``). A failed write (disk full, quota) on any rank does not hang the
others in DeepSpeed's barriers: each rank's DeepSpeed file writes are guarded, the ranks agree on
the outcome afterwards, the torn tag is removed and ``CheckpointWriteError`` names the checkpoint
that stays the newest.

Layout under ``RUN_DIR/checkpoints``::

    update_000500/            DeepSpeed files + COMPLETE + rng_rank{r}.pt
    update_000500_universal/  its universal conversion, made when a run resumes on another layout
    update_000250.corrupt/    a checkpoint whose files no longer match their digests (kept aside)
    latest_complete           "update_000500"
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
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
    """This process's RNG states in types ``torch.load(weights_only=True)`` accepts."""
    name, key, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": {"name": name, "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["name"], n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (on some rank); the previous complete one is kept."""


def read_info(tag_dir: Path) -> dict:
    """The ``COMPLETE`` marker's description of a complete checkpoint."""
    try:
        return json.loads((tag_dir / COMPLETE).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


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


def save(engine, ckpt_dir: str | os.PathLike, update: int, client_state: dict, keep_last: int,
         write_hook=None) -> str:
    """Collective: every rank must call it. Returns the tag. ``write_hook(files_written)`` runs
    before each of DeepSpeed's file writes on this rank (fault injection in tests)."""
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
    with _GuardedWrites(engine, write_hook) as guard:
        engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=state, save_latest=False)
        if guard.error is None:
            try:
                rng_file = tag_dir / f"rng_rank{eng.rank()}.pt"
                torch.save(rng_state(), rng_file)
                guard.files[rng_file.name] = file_digest(rng_file)
            except (OSError, RuntimeError) as e:
                guard.error = e
    files = _agree_or_fail(ckpt_dir, tag, guard.error, guard.files)
    error = None
    if eng.rank() == 0:
        ours = client_state.get("admin_ds", {})
        info = {"update": update, "time": time.time(), "world_size": eng.world_size(),
                **{k: ours[k] for k in ("layout", "model_config", "subword_sha256") if k in ours},
                "files": files}
        try:
            atomic.write_text(tag_dir / COMPLETE, json.dumps(info) + "\n")
            atomic.write_text(ckpt_dir / POINTER, tag + "\n")
        except OSError as e:
            error = e
        else:
            _prune(ckpt_dir, keep_last, keep=tag)
    _agree_or_fail(ckpt_dir, tag, error, {})
    return tag


class _GuardedWrites:
    """Wrap ``engine.checkpoint_engine.save`` for one checkpoint: a failed write is recorded, and
    this rank writes nothing more, instead of leaving DeepSpeed's collective save early (the
    other ranks would wait in its barriers until the timeout). ``torch.save`` reports a full
    disk as ``RuntimeError`` (PytorchStreamWriter failed writing file), the OS as ``OSError``."""

    def __init__(self, engine, hook) -> None:
        self.target, self.hook = engine.checkpoint_engine, hook
        self.error: Optional[Exception] = None
        self.written = 0
        self.files: dict[str, list] = {}  # name in the tag -> [size, sha256] of what this rank wrote
        # A decoupled (asynchronous) checkpoint engine may still be writing when save returns.
        self.digests = not (hasattr(self.target, "is_decoupled") and self.target.is_decoupled())

    def __enter__(self):
        self.own = "save" in vars(self.target)  # an instance attribute already (another wrapper)
        self.inner = self.target.save

        def save(*args, **kwargs):
            if self.error is not None:
                return None
            try:
                if self.hook is not None:
                    self.hook(self.written)
                result = self.inner(*args, **kwargs)
                if self.digests:
                    path = Path(kwargs["path"] if "path" in kwargs else args[1])
                    self.files[path.name] = file_digest(path)
            except (OSError, RuntimeError) as e:
                self.error = e
                return None
            self.written += 1
            return result

        self.target.save = save
        return self

    def __exit__(self, *exc):
        if self.own:
            self.target.save = self.inner
        else:
            del self.target.save  # the class's method again
        return None


def _agree_or_fail(ckpt_dir: Path, tag: str, error: Optional[Exception], files: dict) -> dict:
    """Collective: if any rank failed to write, remove the torn tag and raise on every rank.
    Otherwise returns every rank's written files (name -> [size, sha256]) on rank 0."""
    mine = (None if error is None else f"rank {eng.rank()}: {error}", files)
    parts = [None] * eng.world_size()
    if eng.world_size() > 1:
        torch.distributed.all_gather_object(parts, mine)
    else:
        parts = [mine]
    errors = [e for e, _ in parts if e]
    if not errors:
        merged = {}
        for _, f in parts:
            merged.update(f)
        return merged
    if eng.rank() == 0:
        shutil.rmtree(ckpt_dir / tag, ignore_errors=True)  # torn; frees the space it took
    keep = newest_complete(ckpt_dir)
    raise CheckpointWriteError(
        f"writing checkpoint {ckpt_dir / tag} failed ({'; '.join(errors)}). The run stops here; "
        + (f"the newest complete checkpoint is still {ckpt_dir / keep}, and rerunning the same command "
           "resumes from it" if keep else "there is no complete checkpoint yet")
        + ". Free space (or lower train.keep_last) first.")


def file_digest(path: Path) -> list:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return [path.stat().st_size, h.hexdigest()]


def verify(tag_dir: Path) -> Optional[str]:
    """What is wrong with a complete checkpoint's files (size or sha256 against the digests in
    ``COMPLETE``), or None. Checkpoints written before digests were recorded pass."""
    for name, (size, digest) in sorted(read_info(tag_dir).get("files", {}).items()):
        f = tag_dir / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, {size} were written"
        if file_digest(f)[1] != digest:
            return f"{name} does not match its sha256"
    return None


def newest_verified(ckpt_dir: str | os.PathLike, log=print) -> Optional[str]:
    """Rank 0: the newest complete checkpoint whose files are intact. A corrupt one is moved
    aside to ``<tag>.corrupt`` (kept for inspection, never loaded, never pruned) with the reason
    in it, and the next older one is tried."""
    ckpt_dir = Path(ckpt_dir)
    while (tag := newest_complete(ckpt_dir)) is not None:
        problem = verify(ckpt_dir / tag)
        if problem is None:
            return tag
        log(f"[resume] {ckpt_dir / tag} is corrupt ({problem}): moved to {tag}.corrupt; "
            "trying the previous checkpoint")
        aside = ckpt_dir / f"{tag}.corrupt"
        shutil.rmtree(aside, ignore_errors=True)
        (ckpt_dir / tag / "CORRUPT").write_text(problem + "\n")
        os.replace(ckpt_dir / tag, aside)
    return None


def _prune(ckpt_dir: Path, keep_last: int, keep: str) -> None:
    complete = complete_tags(ckpt_dir)
    for old in complete[:-keep_last]:
        if old != keep:
            shutil.rmtree(ckpt_dir / old, ignore_errors=True)
    newest = complete[-1] if complete else keep
    for p in ckpt_dir.iterdir():  # torn tags older than the newest complete one are dead weight
        if p.is_dir() and _TAG.match(p.name) and not is_complete(p) and p.name < newest:
            shutil.rmtree(p, ignore_errors=True)
    for p in ckpt_dir.glob("*_universal"):  # conversions of tags that are gone
        if p.is_dir() and not (ckpt_dir / p.name[: -len("_universal")]).is_dir():
            shutil.rmtree(p, ignore_errors=True)


def remove_torn(ckpt_dir: str | os.PathLike) -> list[str]:
    """Rank 0 at resume: remove tags without ``COMPLETE`` and interrupted conversions."""
    ckpt_dir = Path(ckpt_dir)
    removed = []
    if not ckpt_dir.is_dir():
        return removed
    for p in ckpt_dir.iterdir():
        torn = p.is_dir() and ((_TAG.match(p.name) and not is_complete(p))
                               or (p.name.startswith(".") and p.name.endswith("_universal.tmp")))
        if torn:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p.name)
    return removed


def load(engine, ckpt_dir: str | os.PathLike, tag: str, load_optimizer_states: bool = True,
         universal: Optional[Path] = None) -> dict:
    """Load ``tag`` into the engine (from its universal conversion ``universal`` if given; the
    engine must then load universally), restore this rank's RNG state, return our client state."""
    ckpt_dir = Path(ckpt_dir)
    if not is_complete(ckpt_dir / tag):
        raise RuntimeError(f"{ckpt_dir / tag}: checkpoint is incomplete (no {COMPLETE} marker)")
    source = tag if universal is None else universal.name
    path, client = engine.load_checkpoint(str(ckpt_dir), tag=source, load_optimizer_states=load_optimizer_states,
                                          load_lr_scheduler_states=load_optimizer_states)
    if path is None:
        raise RuntimeError(f"{ckpt_dir / source}: DeepSpeed could not load the checkpoint")
    rng_file = ckpt_dir / tag / f"rng_rank{eng.rank()}.pt"
    if rng_file.is_file():
        try:
            set_rng_state(torch.load(rng_file, weights_only=True))
        except pickle.UnpicklingError:  # written before RNG states were stored as tensors
            print(f"[resume] warning: {rng_file} is in an old pickled format and is not loaded; "
                  "dropout masks will differ from the uninterrupted run", flush=True)
    return client
