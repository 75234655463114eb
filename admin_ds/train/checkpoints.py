"""Checkpoints: atomic saves, verified loads, and resuming on the same or another layout.

    manager = CheckpointManager(run_dir / "checkpoints", keep_last=3)
    plan = manager.plan_resume(layout, model_cfg, manifest)   # before the engine is built
    client = manager.load(engine, plan)                        # after
    manager.save(engine, update, client_state)                 # collective

Atomic saves. DeepSpeed's ``save_checkpoint`` is a plain ``torch.save`` per file, and its
``latest`` file is written by rank 0 *before* the final barrier, so a kill in that window leaves
``latest`` pointing at a tag other ranks are still writing (docs/deepspeed.md). So:

1. every rank calls ``engine.save_checkpoint(dir, tag, client_state, save_latest=False)``
   (collective; it ends with a barrier), and writes its own RNG state into the tag;
2. the ranks agree that every write succeeded; then rank 0 writes ``COMPLETE`` (a small JSON)
   into the tag and moves our own pointer ``latest_complete``, both atomically (files.py);
3. afterwards, incomplete leftovers and the complete tags that are neither among the ``keep_last``
   newest nor among the ``keep_best`` with the lowest validation loss are removed.

``COMPLETE`` describes the checkpoint: its layout, model config and subword hash (so every rank
can plan the resume before the engine is built) and the size and sha256 of every file each rank
wrote, so a checkpoint corrupted later is detected and set aside (``<tag>.corrupt``) before it is
loaded. A failed write (disk full, quota) on any rank does not hang the others in DeepSpeed's
barriers: each rank's writes are guarded, the ranks agree on the outcome, the torn tag is removed
and ``CheckpointWriteError`` names the checkpoint that stays the newest.

The client state carries everything needed to continue identically: the run config, the Admin
profile, the train state, the data position, the guard's state. Per-rank RNG states are separate
files because only rank 0's client state is saved; they hold tensors and plain numbers, so they
load with ``weights_only=True``.

Resuming on another layout. ``COMPLETE`` records the layout a checkpoint was saved with (world
size, data-parallel size, pipeline stages, ZeRO stage, precision, accumulation). If the current
layout differs, the engine is built with ``"checkpoint": {"load_universal": true}``, rank 0
converts the tag once with DeepSpeed's universal converter into ``<tag>_universal`` beside it
(built in a temporary folder, renamed when complete; the other ranks wait) and the engine loads
that. The universal folder stores one folder per parameter name (``zero/<name>/fp32.pt``, ...),
and every layout uses the same names (admin_ds/model/transformer.py), so nothing is renamed.
Universal checkpoints hold ZeRO optimizer partitions only: a layout change from or to ZeRO-0 is
refused with the reason (a ZeRO-0 data-parallel size change alone loads directly, its checkpoint
holds the whole optimizer state). Universal loading restores parameters, not buffers: a fixed
(buffer) omega is written again from the checkpoint's profile by the loop.

The file format (tags, the ``COMPLETE`` marker, digests, the newest verified tag, the universal
converter) is admin_ds/checkpoint_format.py, which model files and averaging read without an
engine; this module adds what needs ranks and an engine. DeepSpeed is imported where it runs.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from admin_ds import distributed, files, safe_load
from admin_ds.checkpoint_format import (COMPLETE, CONVERTED, POINTER, TAG_PATTERN, complete_tags, ds_to_universal,
                                        is_complete, newest_complete, newest_verified, read_info, tag_for,
                                        tags_to_keep)
from admin_ds.errors import CheckpointError, ConfigError

LAYOUT_KEYS = ("data_parallel", "pipeline", "zero", "precision")


# ------------------------------------------------------------------------------------------------
# Per-rank RNG states
# ------------------------------------------------------------------------------------------------


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


# ------------------------------------------------------------------------------------------------
# Resume plans
# ------------------------------------------------------------------------------------------------


def describe(layout: dict) -> str:
    return (f"{layout.get('world_size')} rank(s) = data-parallel {layout.get('data_parallel')} x pipeline "
            f"{layout.get('pipeline')}, ZeRO-{layout.get('zero')}, {layout.get('precision')}, accumulation "
            f"{layout.get('gradient_accumulation_steps', '?')}")


# The engine.* choices a resumed run keeps (EngineSection.resolve_auto), as trained before they
# were recorded.
PRE_AUTO_ENGINE = {"skip_padding": False, "dropout": "torch"}


@dataclass
class ResumePlan:
    tag: str
    saved: dict  # the layout the checkpoint was written with
    current: dict
    universal: bool = False  # load through DeepSpeed's universal checkpoint
    notes: list = field(default_factory=list)
    # The choices that decide which random numbers a step draws, as the checkpoint was trained
    # (RunConfig.engine.resolve_auto keeps them); a checkpoint without the record predates the
    # choices' "auto" and was trained with the then defaults.
    engine: dict = field(default_factory=lambda: dict(PRE_AUTO_ENGINE))

    @property
    def layout_changed(self) -> bool:
        return self.saved != self.current


def _normalised(d: dict) -> dict:
    return json.loads(json.dumps(d))


def check_compatible(where: str, info: dict, model_cfg, manifest: dict) -> None:
    """Refuse a checkpoint trained with another architecture, vocabulary or subword model, naming
    the field, before anything is loaded."""
    saved = info.get("model_config")
    if saved is not None:
        now = _normalised(model_cfg.to_dict())
        saved = _normalised(saved)
        diff = [k for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
        if diff:
            detail = ", ".join(f"model.{k} (checkpoint {saved.get(k)!r}, run {now.get(k)!r})" for k in diff)
            hint = " (the vocabulary size comes from data.path's subword model)" if "vocab_size" in diff else ""
            raise ConfigError(f"{where}: the checkpoint's model differs from the run config in {detail}{hint}; "
                              "use a new train.run_dir or the same model")
    if "subword_sha256" in info and info["subword_sha256"] != manifest.get("subword_sha256"):
        raise ConfigError(f"{where}: trained with a different subword model than data.path's "
                          f"{manifest.get('subword_model')} (sha256 {str(info['subword_sha256'])[:12]}.. vs "
                          f"{str(manifest.get('subword_sha256'))[:12]}..); use the checkpoint's data or a new "
                          "train.run_dir")
    saved, now = info.get("direction"), f"{manifest.get('src_lang')}-{manifest.get('tgt_lang')}"
    if saved is not None and saved != now:
        raise ConfigError(f"{where}: the checkpoint translates {saved}, the run config {now} (data.reverse); "
                          "a run keeps its direction: use the same data.reverse or a new train.run_dir")


def plan_resume(where: Path, tag: str, info: dict, current: dict) -> ResumePlan:
    """How to load ``tag`` (whose COMPLETE marker is ``info``) into the ``current`` layout."""
    saved = info.get("layout")
    engine = {**PRE_AUTO_ENGINE, **info.get("engine", {})}
    if saved is None:  # written before layouts were recorded: assume the same layout
        return ResumePlan(tag, dict(current), dict(current), engine=engine)
    plan = ResumePlan(tag, saved, dict(current), engine=engine)
    if all(saved.get(k) == current[k] for k in LAYOUT_KEYS):
        return plan
    zero_only_dp = (saved["zero"] == 0 == current["zero"] and saved["pipeline"] == current["pipeline"]
                    and saved["precision"] == current["precision"])
    if zero_only_dp:
        plan.notes.append("ZeRO-0 checkpoints hold the whole optimizer state: loaded directly")
    elif saved["zero"] >= 1 and current["zero"] >= 1:
        plan.universal = True
    else:
        side = "saved with" if saved["zero"] == 0 else "resumed with"
        raise ConfigError(
            f"{where / tag}: saved as {describe(saved)}, resumed as {describe(current)}. A layout change goes "
            f"through DeepSpeed's universal checkpoint, which is built from ZeRO optimizer partitions and "
            f"loads only into a ZeRO optimizer; this one is {side} ZeRO-0. Resume with the saved layout "
            "(or ZeRO >= 1 on both sides)")
    before = saved.get("data_parallel", 0) * saved.get("gradient_accumulation_steps", 0)
    after = current["data_parallel"] * current["gradient_accumulation_steps"]
    if saved.get("gradient_accumulation_steps") and before != after:
        plan.notes.append(f"data-parallel x accumulation changes from {before} to {after}: the batches of an "
                          "epoch are regrouped, so the data position is resumed approximately "
                          "(EpochBatchIterator.load_state_dict)")
    return plan


# ------------------------------------------------------------------------------------------------
# The manager
# ------------------------------------------------------------------------------------------------


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (on some rank); the previous complete one is kept."""


WriteHook = Callable[[int, int], None]  # (update, files this rank has written) before each DeepSpeed file write


class CheckpointManager:
    """Saves, verifies, plans and loads the checkpoints of one run directory. Methods that take
    an engine are collective: every rank calls them."""

    def __init__(self, ckpt_dir: str | os.PathLike, keep_last: int = 3, log: Callable[[str], None] = print,
                 write_hooks: Optional[list[WriteHook]] = None, keep_best: int = 0) -> None:
        self.dir = Path(ckpt_dir)
        self.keep_last, self.keep_best = keep_last, keep_best
        self.log = log
        self.write_hooks = write_hooks if write_hooks is not None else []  # hooks.Hooks.on_checkpoint_write

    # ---- choosing ------------------------------------------------------------------------------
    def newest_verified(self) -> Optional[str]:
        """The newest complete checkpoint with intact files, the same on every rank (rank 0 checks
        the digests and sets corrupt ones aside). Collective."""
        found = {}
        if distributed.rank() == 0:
            try:
                found["tag"] = newest_verified(self.dir, self.log)
            except OSError as e:  # every rank must learn of it, not hang
                found["error"] = f"{type(e).__name__}: {e}"
        found = distributed.broadcast_object(found)
        if "error" in found:
            raise CheckpointError(f"reading the checkpoints in {self.dir} failed on rank 0: {found['error']}")
        return found["tag"]

    def plan_resume(self, current: dict, model_cfg, manifest: dict, tag: Optional[str] = None) -> Optional[ResumePlan]:
        """Before the engine is built: the newest verified checkpoint (or ``tag``), refused if it
        is of another model, vocabulary or subword model; its plan for the ``current`` layout.
        None when there is nothing to resume. Collective."""
        tag = tag or self.newest_verified()
        if tag is None:
            return None
        info = read_info(self.dir / tag)
        check_compatible(str(self.dir / tag), info, model_cfg, manifest)
        return plan_resume(self.dir, tag, info, current)

    def remove_torn(self) -> list[str]:
        """Rank 0 at resume: remove tags without ``COMPLETE`` and interrupted conversions."""
        removed = []
        if distributed.rank() != 0 or not self.dir.is_dir():
            return removed
        for p in self.dir.iterdir():
            torn = p.is_dir() and ((TAG_PATTERN.match(p.name) and not is_complete(p))
                                   or (p.name.startswith(".") and p.name.endswith("_universal.tmp")))
            if torn:
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p.name)
        return removed

    # ---- loading -------------------------------------------------------------------------------
    def load(self, engine, plan: ResumePlan) -> dict:
        """Load ``plan.tag`` into the engine (through its universal conversion if the plan says so;
        the engine must then have been built with ``configure_loading``), restore this rank's RNG
        state, return our client state. Collective."""
        tag = plan.tag
        if not is_complete(self.dir / tag):
            raise CheckpointError(f"{self.dir / tag}: checkpoint is incomplete (no {COMPLETE} marker)")
        source = tag
        if plan.universal:
            source = self._universal(engine, plan).name
        safe_load.check_tag(self.dir / source)  # DeepSpeed's own load runs a full unpickle
        with _universal_loading(engine, plan.universal):
            path, client = engine.load_checkpoint(str(self.dir), tag=source, load_optimizer_states=True,
                                                  load_lr_scheduler_states=True)
        if path is None:
            raise CheckpointError(f"{self.dir / source}: DeepSpeed could not load the checkpoint")
        rng_file = self.dir / tag / f"rng_rank{distributed.rank()}.pt"
        if rng_file.is_file():
            try:
                set_rng_state(safe_load.load(rng_file))
            except CheckpointError:  # written before RNG states were stored as tensors
                self.log(f"[resume] warning: {rng_file} is in an old pickled format and is not loaded; "
                         "dropout masks will differ from the uninterrupted run")
        return client

    def _universal(self, engine, plan: ResumePlan) -> Path:
        """Rank 0 converts the tag once (the others wait, for as long as a large checkpoint takes,
        outside any collective: distributed.rank0_alone); every rank then checks its names."""
        err = None
        with distributed.rank0_alone():
            if distributed.rank() == 0:
                try:
                    self._ensure_universal(plan)
                except Exception as e:  # every rank must learn of it, not hang
                    err = f"{type(e).__name__}: {e}"
        err = distributed.broadcast_object(err)
        if err:
            raise CheckpointError(f"converting {self.dir / plan.tag} to a universal checkpoint failed on rank 0: {err}")
        udir = self.dir / f"{plan.tag}_universal"
        missing = [n for n, _ in engine.module.named_parameters() if not (udir / "zero" / n).is_dir()]
        if missing:
            raise CheckpointError(f"{udir}: no universal state for {len(missing)} parameter(s) of this rank, "
                                  f"e.g. {missing[:3]}")
        return udir

    def _ensure_universal(self, plan: ResumePlan) -> Path:
        """``<tag>_universal`` beside the tag, converted once. Built in a temporary folder and
        renamed when complete, so a kill leaves either nothing usable or the complete folder."""
        final = self.dir / f"{plan.tag}_universal"
        if (final / CONVERTED).is_file():
            return final
        if final.exists():
            shutil.rmtree(final)  # torn: convert again
        tmp = self.dir / f".{plan.tag}_universal.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        self.log(f"[resume] converting {self.dir / plan.tag} to a universal checkpoint ({describe(plan.saved)} -> "
                 f"{describe(plan.current)})")
        # The converter's worker processes pay off on large checkpoints only (each imports torch).
        size = sum(f.stat().st_size for f in (self.dir / plan.tag).iterdir() if f.is_file())
        workers = 1 if size < 2**30 else max(1, min(8, (os.cpu_count() or 2) // 2))
        safe_load.check_tag(self.dir / plan.tag)  # the converter runs a full unpickle
        ds_to_universal(self.dir / plan.tag, tmp, num_workers=workers)
        (self.dir / "latest_universal").unlink(missing_ok=True)  # the converter's pointer; we name tags
        _alias_model_states(tmp)
        _harmonise_optimizer_state(tmp / "zero")
        files.write_text(tmp / CONVERTED, json.dumps({"source": plan.tag, "saved_layout": plan.saved}) + "\n")
        os.replace(tmp, final)
        files.fsync_dir(self.dir)
        return final

    # ---- saving --------------------------------------------------------------------------------
    def save(self, engine, update: int, client_state: dict, valid_loss: Optional[float] = None) -> str:
        """Save ``update``, with the validation loss measured at this update if there was one;
        returns the tag. Collective."""
        tag = tag_for(update)
        tag_dir = self.dir / tag
        if distributed.rank() == 0 and tag_dir.exists():
            shutil.rmtree(tag_dir)  # a torn attempt at the same update from an earlier, killed run
        distributed.barrier()
        state = dict(client_state)
        # Lets DeepSpeed's universal converter run on ZeRO<=2 checkpoints, so a run can later resume
        # on a different layout (docs/deepspeed.md).
        state["universal_checkpoint_info"] = {"universal_checkpoint_version": 0.4}
        with _GuardedWrites(engine, self.write_hooks, update) as guard:
            engine.save_checkpoint(str(self.dir), tag=tag, client_state=state, save_latest=False)
            if guard.error is None:
                rng_file = tag_dir / f"rng_rank{distributed.rank()}.pt"
                try:
                    torch.save(rng_state(), rng_file)
                    guard.files[rng_file.name] = files.file_digest(rng_file)
                except (OSError, RuntimeError) as e:
                    guard.error = _write_error(e, rng_file)
        written = self._agree_or_fail(tag, guard.error, guard.files)
        error = None
        if distributed.rank() == 0:
            ours = client_state.get("admin_ds", {})
            info = {"update": update, "time": time.time(), "world_size": distributed.world_size(),
                    **{k: ours[k] for k in ("layout", "model_config", "subword_sha256", "direction", "engine")
                       if k in ours},
                    **({"valid_loss": valid_loss} if valid_loss is not None else {}),
                    "files": written}
            try:
                files.write_text(tag_dir / COMPLETE, json.dumps(info) + "\n")
                files.write_text(self.dir / POINTER, tag + "\n")
            except OSError as e:
                error = _write_error(e, tag_dir / COMPLETE)
            else:
                self._prune(keep=tag)
        self._agree_or_fail(tag, error, {})
        return tag

    def _agree_or_fail(self, tag: str, error: Optional[Exception], written: dict) -> dict:
        """Collective: if any rank failed to write, remove the torn tag and raise on every rank.
        Otherwise returns every rank's written files (name -> [size, sha256]) on rank 0."""
        mine = (None if error is None else f"rank {distributed.rank()}: {files.describe_os_error(error)}", written)
        parts = [None] * distributed.world_size()
        if distributed.world_size() > 1:
            torch.distributed.all_gather_object(parts, mine)
        else:
            parts = [mine]
        errors = [e for e, _ in parts if e]
        if not errors:
            merged = {}
            for _, f in parts:
                merged.update(f)
            return merged
        if distributed.rank() == 0:
            shutil.rmtree(self.dir / tag, ignore_errors=True)  # torn; frees the space it took
        keep = newest_complete(self.dir)
        raise CheckpointWriteError(
            f"writing checkpoint {self.dir / tag} failed ({'; '.join(errors)}). The run stops here; "
            + (f"the newest complete checkpoint is still {self.dir / keep}, and rerunning the same command "
               "resumes from it" if keep else "there is no complete checkpoint yet")
            + ". Free space (or lower train.keep_last) first.")

    def _prune(self, keep: str) -> None:
        complete = complete_tags(self.dir)
        kept = tags_to_keep(self.dir, self.keep_last, self.keep_best) | {keep}
        for old in complete:
            if old not in kept:
                shutil.rmtree(self.dir / old, ignore_errors=True)
        newest = complete[-1] if complete else keep
        for p in self.dir.iterdir():  # torn tags older than the newest complete one are dead weight
            if p.is_dir() and TAG_PATTERN.match(p.name) and not is_complete(p) and p.name < newest:
                shutil.rmtree(p, ignore_errors=True)
        for p in self.dir.glob("*_universal"):  # conversions of tags that are gone
            if p.is_dir() and not (self.dir / p.name[: -len("_universal")]).is_dir():
                shutil.rmtree(p, ignore_errors=True)


def configure_loading(ds: dict, plan: Optional[ResumePlan]) -> None:
    """Before deepspeed.initialize: the engine loads universal checkpoints only if built so."""
    if plan is not None and plan.universal:
        ds.setdefault("checkpoint", {})["load_universal"] = True


class _universal_loading:
    """Context: switch the engine's universal-loading flag for one load. DeepSpeed 0.19.8 reads
    ``engine._config.load_universal_checkpoint`` only inside load_checkpoint (engine.py, read),
    so a run resumed through a universal checkpoint can still roll back to a checkpoint it wrote
    itself in its own layout."""

    def __init__(self, engine, on: bool) -> None:
        self.cfg, self.on = engine._config, on

    def __enter__(self):
        self.was = self.cfg.load_universal_checkpoint
        self.cfg.load_universal_checkpoint = self.on

    def __exit__(self, *exc):
        self.cfg.load_universal_checkpoint = self.was


class _GuardedWrites:
    """Wrap ``engine.checkpoint_engine.save`` for one checkpoint: a failed write is recorded, and
    this rank writes nothing more, instead of leaving DeepSpeed's collective save early (the
    other ranks would wait in its barriers until the timeout). ``torch.save`` reports a full
    disk as ``RuntimeError`` (PytorchStreamWriter failed writing file), the OS as ``OSError``.
    ``hooks`` run before each write with the update and the number of files this rank has written."""

    def __init__(self, engine, hooks: list[WriteHook], update: int) -> None:
        self.target, self.hooks, self.update = engine.checkpoint_engine, hooks, update
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
            path = Path(kwargs["path"] if "path" in kwargs else args[1])
            try:
                for hook in self.hooks:
                    hook(self.update, self.written)
                result = self.inner(*args, **kwargs)
                if self.digests:
                    self.files[path.name] = files.file_digest(path)
            except (OSError, RuntimeError) as e:
                self.error = _write_error(e, path)
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


def _write_error(e: Exception, path: Path) -> OSError:
    """A failed checkpoint write as an OSError naming the file (``torch.save`` reports a full disk
    as a RuntimeError without a path) and, when the disk is full, the free space."""
    import errno

    if not isinstance(e, OSError):
        full = "write" in str(e).lower() or "space" in str(e).lower()
        e = OSError(errno.ENOSPC if full else errno.EIO, str(e).splitlines()[0][:200])
    if not e.filename:
        e = OSError(e.errno, e.strerror or str(e), str(path))
    return e


def _alias_model_states(udir: Path) -> None:
    """The engine finds the (metadata-only, under universal loading) model-states file by its
    own ZeRO stage's name: ``mp_rank_XX_model_states.pt`` for ZeRO-0/1/2 and the pipeline,
    ``zero_pp_rank_0_mp_rank_XX_model_states.pt`` for ZeRO-3 (engine.py ``_get_ckpt_name``),
    while the converter copies the source's. Give the folder both names."""
    for f in sorted(udir.glob("*model_states.pt")):
        if f.name.startswith("mp_rank_"):
            alias = udir / f"zero_pp_rank_0_{f.name}"
        elif f.name.startswith("zero_pp_rank_0_mp_rank_"):
            alias = udir / f.name[len("zero_pp_rank_0_"):]
        else:
            continue
        if not alias.exists():
            try:
                os.link(f, alias)
            except OSError:
                shutil.copy2(f, alias)


def _harmonise_optimizer_state(zero_dir: Path) -> None:
    """``zero/optimizer_state.pt`` as both loaders read it. DeepSpeed 0.19.8 writes it in the
    source's format, and the loaders differ (read, not assumed): ZeRO-1/2/bf16
    (base_optimizer.py ``load_hp_checkpoint_state_from_checkpoint_dir``) need ``ds_version``,
    ``param_groups`` and a ``step.pt`` per parameter; ZeRO-3 (stage3.py
    ``load_hp_checkpoint_state_from_checkpoint_dir_stage3``) needs the base optimizer's
    ``optimizer_state_dict`` with ``state[0]['step']``. Each side gets what it lacks."""
    import deepspeed

    path = zero_dir / "optimizer_state.pt"
    sd = safe_load.load(path)
    params = sorted(p for p in zero_dir.iterdir() if p.is_dir())
    inner = sd.get("optimizer_state_dict")
    if inner is None:  # converted from ZeRO-1/2: the step lives in each parameter's step.pt
        step = next((safe_load.load(p / "step.pt") for p in params if (p / "step.pt").is_file()), None)
        sd["optimizer_state_dict"] = {"state": {} if step is None else {0: {"step": step}},
                                      "param_groups": sd["param_groups"]}
    else:  # converted from ZeRO-3: flat tensors, no shapes, no per-parameter step
        shapes = {}
        for f in sorted(zero_dir.parent.glob("zero_pp_rank_0_mp_rank_*_model_states.pt")):
            for group in safe_load.load(f)["param_shapes"]:
                shapes.update(group)
        step = inner.get("state", {}).get(0, {}).get("step")
        for p in params:
            for key in ("fp32", "exp_avg", "exp_avg_sq"):
                t = safe_load.load(p / f"{key}.pt")
                if torch.is_tensor(t):  # ZeRO-1/2 read {"param": tensor of the parameter's shape}
                    torch.save({"param": t.reshape(shapes[p.name])}, p / f"{key}.pt")
            if step is not None and not (p / "step.pt").exists():
                torch.save(step, p / "step.pt")
    sd.setdefault("ds_version", deepspeed.__version__)
    torch.save(sd, path)
