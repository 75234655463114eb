"""Files: atomic writes and digests, the two things every step that leaves a file behind needs,
and the text of a configuration file.

Atomic writes. A reader sees the old file or the complete new one, never a torn one: write to a
uniquely named temporary sibling, fsync it, ``os.replace`` it over the target, then fsync the
directory so the rename itself survives a crash. A crash leaves at most a stray ``.*.tmp`` file,
which nothing takes for complete. ``write_bytes`` / ``write_text`` for small files,
``atomic_output`` for streams (binarized corpora, back-translated shards).

Digests. ``sha256_file`` is the one content hash of the project (data manifests, checkpoint
``COMPLETE`` markers, model files, data-preparation step records); ``file_digest`` pairs it with
the size, which is checked first because it is free.

Configuration files. ``read_config_text`` refuses a directory, a missing file and bytes that are
not UTF-8 with one line naming the option and the file (the run config YAML, the DeepSpeed JSON).

This module imports no torch: data preparation's worker processes use it, and launch/train.py
refuses a bad configuration file before importing torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Iterator

from admin_ds.errors import ConfigError


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


class DirectoryLock:
    """An exclusive ``flock`` on ``DIR/NAME`` for as long as the object lives (or ``release``):
    one writer per directory. The kernel releases it when the process dies, so a killed run never
    blocks its own resume. The holder's host and pid are written into the lock file, so a refused
    second writer can say who holds it. A directory the lock created is removed again on release
    if nothing else was written into it (a run refused at start-up leaves nothing behind)."""

    def __init__(self, directory: str | os.PathLike, name: str = ".lock") -> None:
        import fcntl
        import socket

        self.path = Path(directory) / name
        self.created = not self.path.parent.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "a+")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.file.seek(0)
            holder = self.file.read().strip() or "another process"
            self.file.close()
            raise BlockingIOError(f"{Path(directory)} is in use by {holder} (lock {self.path})") from None
        self.file.seek(0)
        self.file.truncate()
        self.file.write(f"host {socket.gethostname()}, pid {os.getpid()}\n")
        self.file.flush()

    def release(self) -> None:
        if self.file.closed:
            return
        if self.created and [p.name for p in self.path.parent.iterdir()] == [self.path.name]:
            self.path.unlink()  # still holding the lock, so no other writer is between these steps
            self.path.parent.rmdir()
        self.file.close()  # closing the descriptor releases the flock

    def __enter__(self) -> "DirectoryLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def describe_os_error(e: OSError) -> str:
    """An OSError in one line naming the path, and the free space left when the disk is full."""
    import errno
    import shutil

    path = getattr(e, "filename", None)
    text = f"{path}: {e.strerror or e}" if path else str(e.strerror or e)
    if e.errno in (errno.ENOSPC, errno.EDQUOT) and path:
        probe = Path(path)
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        try:
            text += f" ({shutil.disk_usage(probe).free / 2**20:.1f} MiB free on the file system of {probe})"
        except OSError:
            pass
    return text


def read_config_text(path: str | os.PathLike, option: str, kind: str) -> str:
    """The UTF-8 text of the configuration file ``path`` given as ``option`` (``--config``), a
    ``kind`` (``"YAML run config"``); a ConfigError naming the option or the file otherwise."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{option}: {p} is a directory, not a {kind}")
    if not p.is_file():
        raise ConfigError(f"{option}: no such file: {p}")
    try:
        return p.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: not a UTF-8 text file (a {kind} is expected)") from None
