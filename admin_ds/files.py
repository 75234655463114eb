"""Files: atomic writes and digests, the two things every step that leaves a file behind needs.

Atomic writes. A reader sees the old file or the complete new one, never a torn one: write to a
uniquely named temporary sibling, fsync it, ``os.replace`` it over the target, then fsync the
directory so the rename itself survives a crash. A crash leaves at most a stray ``.*.tmp`` file,
which nothing takes for complete. ``write_bytes`` / ``write_text`` for small files,
``atomic_output`` for streams (binarized corpora, back-translated shards).

Digests. ``sha256_file`` is the one content hash of the project (data manifests, checkpoint
``COMPLETE`` markers, model files, data-preparation step records); ``file_digest`` pairs it with
the size, which is checked first because it is free.

This module imports no torch: data preparation's worker processes use it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Iterator


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make a rename (or creation) inside ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, buffering: int = 1 << 20) -> Iterator[BinaryIO]:
    """``with atomic_output(path) as f: f.write(...)``: the file appears at ``path`` complete, when
    the block ends without an exception, or not at all."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb", buffering=buffering) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    with atomic_output(path) as f:
        f.write(data)
    return Path(path)


def write_text(path: str | os.PathLike, text: str) -> Path:
    return write_bytes(path, text.encode("utf-8"))


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_digest(path: str | os.PathLike) -> list:
    """``[size in bytes, sha256]`` of a file, as recorded in checkpoint markers and model files."""
    return [Path(path).stat().st_size, sha256_file(path)]
