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

Configuration files. ``read_config_text`` refuses a directory, a missing file, a file over
``MAX_CONFIG_BYTES`` and bytes that are not UTF-8 with one line naming the option and the file (the
run config YAML, the DeepSpeed JSON). ``parse_yaml`` and ``parse_json`` are the one strict reading of
their text: a key given twice in one mapping is refused (both parsers would otherwise keep the last
value silently, so a second ``zero_optimization`` block would change the ZeRO stage unseen), and so
is a number that is not finite (``.inf``, ``.nan``, ``Infinity``, ``NaN``, ``1e999``), naming the
field. YAML anchors are allowed, but a document whose aliases expand to more than
``MAX_CONFIG_NODES`` values (the "billion laughs") or refer to themselves is refused from its node
graph, before anything is built from it or printed.

Text input. ``bounded_lines`` splits a stream into lines reading fixed-size chunks, and refuses a
line longer than ``MAX_LINE_BYTES`` naming the file and the line: a device file, a binary file or
a file without newlines would otherwise be read whole as one line.

This module imports no torch: data preparation's worker processes use it, and launch/train.py
refuses a bad configuration file before importing torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from admin_ds.errors import ConfigError, DataError


# A sentence is a few hundred bytes; the longest lines of WMT's training corpora are ~100 KB of
# markup. A line a thousand times a sentence is not text to translate or score.
MAX_LINE_BYTES = 1 << 20


def bounded_lines(stream: BinaryIO, name: str, limit: int = MAX_LINE_BYTES,
                  chunk: int = 1 << 20) -> Iterator[bytes]:
    """The lines of a binary stream without their ``\\n`` (split on ``\\n`` only, a last line
    without one included), never holding more than ``limit + chunk`` bytes of one line; a
    DataError naming ``name`` and the line number past ``limit``."""
    rest, lineno = b"", 0
    while True:
        block = stream.read(chunk)
        if not block:
            break
        lines = (rest + block).split(b"\n")
        rest = lines.pop()
        for line in lines:
            lineno += 1
            if len(line) > limit:
                break
            yield line
        else:
            if len(rest) <= limit:
                continue
            lineno += 1
        raise DataError(f"{name}: line {lineno} is longer than {limit:,} bytes, the bound on one line of text "
                        "(a binary or device file, or a file without newlines?)")
    if rest:
        yield rest


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


# A config file is a few kilobytes (launch/configs/*.yaml, ds_configs/*.json are under 2 KB); a bound
# a thousand times larger is never met by a real one and keeps a wrong path (a corpus, a device
# file) from being read into memory whole.
MAX_CONFIG_BYTES = 1 << 20
# Values a config document may hold once its YAML aliases are expanded: the largest recipe holds
# ~100, and a billion-laughs document of a few hundred bytes expands to 10^9.
MAX_CONFIG_NODES = 100_000


def read_config_text(path: str | os.PathLike, option: str, kind: str) -> str:
    """The UTF-8 text of the configuration file ``path`` given as ``option`` (``--config``), a
    ``kind`` (``"YAML run config"``); a ConfigError naming the option or the file otherwise."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{option}: {p} is a directory, not a {kind}")
    if not p.exists():
        raise ConfigError(f"{option}: no such file: {p}")
    try:
        with open(p, "rb") as f:  # at most one byte past the bound: a device file has no size to check
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{option}: {describe_os_error(e)}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{option}: {p} is larger than {MAX_CONFIG_BYTES:,} bytes, the bound on a {kind} "
                          "(is it the right file?)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: not a UTF-8 text file (a {kind} is expected)") from None


def check_finite(value: Any, path: str | os.PathLike, where: str = "") -> None:
    """Refuse a non-finite float anywhere in a parsed config, naming its field (``optim.lr``)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{path}: {where or 'the document'}: {value} is not a finite number")
    if isinstance(value, dict):
        for k, v in value.items():
            check_finite(v, path, f"{where}.{k}" if where else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_finite(v, path, f"{where}[{i}]")


def parse_yaml(text: str, path: str | os.PathLike) -> Any:
    """The YAML document in ``text`` (read from ``path``), strictly (module docstring)."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:
                    continue  # an unhashable key: SafeLoader refuses it with its own message
                line = key_node.start_mark.line + 1
                if first is not None:
                    raise ConfigError(f"{path}:{line}: duplicate key {key!r} (first given on line {first}); "
                                      "only one value can apply")
                seen[key] = line
            return super().construct_mapping(node, deep)

    loader = StrictLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node, path)
        data = loader.construct_document(node)
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f":{where.line + 1}" if where is not None else ""
        raise ConfigError(f"{path}{line}: invalid YAML: {getattr(e, 'problem', None) or e}") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to be a config file") from None
    finally:
        loader.dispose()
    check_finite(data, path)
    return data


def _check_expansion(root, path) -> None:
    """Count the values the node graph stands for once every alias is expanded, each shared node
    counted once per reference but visited once (memoised), stopping past the bound."""
    import yaml

    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            raise ConfigError(f"{path}:{node.start_mark.line + 1}: an alias refers to the node that contains it "
                              "(a recursive document)")
        open_nodes.add(key)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            children = []
        for child in children:
            total += size(child)
            if total > MAX_CONFIG_NODES:
                raise ConfigError(f"{path}: its aliases expand to more than {MAX_CONFIG_NODES:,} values, the bound "
                                  "on a config file (a YAML alias bomb?)")
        open_nodes.discard(key)
        sizes[key] = total
        return total

    size(root)


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        self.key, self.line = key, None


def parse_json(text: str, path: str | os.PathLike) -> Any:
    """The JSON document in ``text`` (read from ``path``), strictly (module docstring)."""
    def pairs(items: list) -> dict:
        out: dict = {}
        for k, v in items:
            if k in out:
                raise _DuplicateKey(k)
            out[k] = v
        return out

    decoder = json.JSONDecoder(object_pairs_hook=pairs)

    def parse_object(s_and_end, *args):
        try:
            return json.decoder.JSONObject(s_and_end, *args)
        except _DuplicateKey as e:
            if e.line is None:  # the innermost object: where it opens is where to look
                s, end = s_and_end
                e.line = s.count("\n", 0, end) + 1
            raise

    # The pure-Python scanner calls parse_object, so the object holding a duplicate can be located.
    decoder.parse_object = parse_object
    decoder.scan_once = json.scanner.py_make_scanner(decoder)
    try:
        data = decoder.decode(text)
    except _DuplicateKey as e:
        raise ConfigError(f"{path}:{e.line}: duplicate key {e.key!r} in the object opening on this line; only one "
                          "value can apply") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to be a config file") from None
    check_finite(data, path)
    return data
