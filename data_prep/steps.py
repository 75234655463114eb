"""Resumable steps and the worker pool.

Resuming (the fairseq2 ``step_N.tmp`` idea applied to data): every output is written to a
temporary sibling and renamed when complete (admin_ds.files.atomic_output), and a step that has
renamed all its outputs records ``work/STEP.done.json``::

    {"step": "clean", "key": "<sha256 of the step's inputs and options>",
     "outputs": {"work/train.clean.en": {"size": ..., "sha256": ...}, ...}, "stats": {...}}

A re-run skips a step when its record exists, its key equals the key computed now, and every
output still has the recorded size and checksum; otherwise the step runs again from scratch and
overwrites its outputs (a killed step leaves only ``.*.tmp`` files and no record). Keys chain on
content: a step's key includes the checksums of the previous step's outputs, so identical
intermediate files keep the later steps valid even when an earlier step was re-run.
"""

from __future__ import annotations

import hashlib
import importlib
import itertools
import json
import multiprocessing as mp
from collections import deque
from pathlib import Path
from typing import Callable, Iterable, Iterator

from admin_ds import files
from admin_ds.files import sha256_file

STEP_FORMAT = 1


def make_key(obj) -> str:
    """sha256 of an object's canonical JSON (sorted keys): the identity of a step's inputs."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class StepLog:
    """The ``work/STEP.done.json`` records of one output directory."""

    def __init__(self, out_dir: Path, work_dir: Path):
        self.out_dir, self.work_dir = out_dir, work_dir

    def _record_path(self, step: str) -> Path:
        return self.work_dir / f"{step}.done.json"

    def done(self, step: str, key: str) -> dict | None:
        """The step's record if it is complete and valid for ``key``, else None."""
        path = self._record_path(step)
        try:
            record = json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
            return None
        if record.get("format") != STEP_FORMAT or record.get("key") != key:
            return None
        for name, meta in record.get("outputs", {}).items():
            f = self.out_dir / name
            if not f.is_file() or f.stat().st_size != meta["size"] or sha256_file(f) != meta["sha256"]:
                return None
        return record

    def invalidate(self, step: str) -> None:
        self._record_path(step).unlink(missing_ok=True)

    def mark_done(self, step: str, key: str, outputs: Iterable[str], stats: dict) -> dict:
        """Checksum ``outputs`` (paths relative to the output directory) and write the record,
        atomically, last."""
        record = {"format": STEP_FORMAT, "step": step, "key": key,
                  "outputs": {name: {"size": (self.out_dir / name).stat().st_size,
                                     "sha256": sha256_file(self.out_dir / name)}
                              for name in outputs},
                  "stats": stats}
        files.write_text(self._record_path(step), json.dumps(record, indent=1) + "\n")
        return record


def _import(modules: tuple[str, ...]) -> None:
    for name in modules:
        importlib.import_module(name)


class WorkerPool:
    """Worker processes for the sharded steps: ``map`` runs a function over tasks, results in
    task order. With one worker everything runs in this process.

    Unlike ``Pool.imap``, whose feeder thread reads the whole input ahead of slow workers, at
    most ``workers * in_flight_per_worker`` tasks are taken from the input ahead of the results:
    tasks that carry their data (raw pairs read by this process) keep memory bounded by the
    shard size, whatever the corpus size. Processes are started with "spawn" (no fork of a
    process that holds threads), so functions must be importable module-level functions. One
    pool serves every phase of every step, so each worker starts once.

    A worker's start costs ~0.15 s of CPU (the interpreter, numpy, SentencePiece: ``modules``
    are imported as it starts). ``start()`` lets that happen while this process still reads and
    fingerprints the inputs; without it the first ``map`` starts the workers. A pool that never
    ran a task is terminated at exit rather than waited for.
    """

    def __init__(self, workers: int, in_flight_per_worker: int = 2, modules: tuple[str, ...] = ()):
        self.workers, self.in_flight = workers, workers * in_flight_per_worker
        self.modules = modules
        self._pool, self._used = None, False

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._pool is not None:
            if exc_type is None and self._used:
                self._pool.close()
            else:
                self._pool.terminate()
            self._pool.join()

    def start(self) -> "WorkerPool":
        """Start the worker processes now (they import ``modules``); returns at once."""
        if self.workers > 1 and self._pool is None:
            self._pool = mp.get_context("spawn").Pool(self.workers, initializer=_import, initargs=(self.modules,))
        return self

    def map(self, func: Callable, tasks: Iterable) -> Iterator:
        if self.workers <= 1:
            yield from map(func, tasks)
            return
        self.start()
        self._used = True
        pending: deque = deque()
        for task in tasks:
            pending.append(self._pool.apply_async(func, (task,)))
            if len(pending) >= self.in_flight:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def chunked(items: Iterable, n: int) -> Iterator[list]:
    """Lists of n consecutive items, the last one shorter (itertools.batched from Python 3.12)."""
    items = iter(items)
    while chunk := list(itertools.islice(items, n)):
        yield chunk
