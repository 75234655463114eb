"""Where the parallel text comes from: local files, or the `datasets` library.

A *pair source* is an iterable of ``(src, tgt)`` raw sides (``bytes`` from files, ``str`` from
`datasets`) with a ``describe()`` for messages and a ``fingerprint()`` for the resume keys. Lines
that cannot become a pair are dropped while reading and counted in ``source.dropped``:
``overlong`` (a line over ``max_line_bytes``, skipped without ever being held in memory) and
``malformed`` (a TSV line without exactly two columns, a `datasets` record without both
languages).

Sharding: ``shards(lines)`` splits a source into line-aligned byte ranges of ``lines`` pairs that
``read_shard(range)`` reads in a worker process, so that no single process reads the whole corpus;
it returns None where a source can only be read from its start (gzip, SGML, `datasets`), and the
main process then reads it and hands the raw pairs to the workers.

Local files, found by :func:`find_side` from a prefix and a language:
- plain text, one segment per line; gzip recognised by its magic bytes, whatever the name;
  ``\\r\\n`` line ends and a byte-order mark at the start are stripped;
- SGML (``*.sgm``, WMT's test sets): the text of every ``<seg ...>...</seg>``, stripped;
  entities are unescaped later, with everything else (:func:`data_prep.clean.decode_side`);
- TSV: ``src<TAB>tgt`` per line.

Every problem with a file (missing, unreadable, a truncated gzip, SGML without segments, two
sides with different line counts) raises :class:`~data_prep.PrepError` naming it.
"""

from __future__ import annotations

import gzip
import io
import os
import re
import zlib
from itertools import zip_longest
from pathlib import Path
from typing import Iterator

from admin_ds.files import sha256_file
from data_prep import PrepError

GZIP_MAGIC = b"\x1f\x8b"
SGML_SUFFIXES = (".sgm", ".sgml")
_SEG = re.compile(rb"<seg\b[^>]*>(.*?)</seg\s*>", re.DOTALL | re.IGNORECASE)
_BOM = b"\xef\xbb\xbf"


# ---- files ------------------------------------------------------------------------------------

def check_readable(path: Path) -> None:
    if not path.exists():
        raise PrepError(f"{path}: no such file")
    if not path.is_file():
        raise PrepError(f"{path}: not a regular file")
    if not os.access(path, os.R_OK):
        raise PrepError(f"{path}: not readable (permission denied)")


def open_binary(path: Path) -> io.BufferedIOBase:
    """Open a plain or gzip file (recognised by its magic bytes) for reading bytes."""
    check_readable(path)
    with open(path, "rb") as f:
        magic = f.read(2)
    return gzip.open(path, "rb") if magic == GZIP_MAGIC else open(path, "rb")


def is_sgml(path: Path) -> bool:
    name = path.name[:-3] if path.name.endswith(".gz") else path.name
    return name.endswith(SGML_SUFFIXES)


def read_lines(path: Path, max_bytes: int, start: int = 0, stop: int | None = None) -> Iterator[bytes | None]:
    """The lines of a plain or gzip file without their line ends, or None for a line longer than
    ``max_bytes`` (read past in pieces, never held whole). Bad gzip data raises PrepError.
    ``start`` / ``stop``: only the lines that start in this byte range of a plain file (both
    offsets at line starts, as :func:`line_starts` gives them)."""
    try:
        with open_binary(path) as f:
            if start:
                f.seek(start)
            pos = start
            first = start == 0
            while stop is None or pos < stop:
                line = f.readline(max_bytes + 2)  # + room for \r\n
                if not line:
                    return
                pos += len(line)
                if not line.endswith(b"\n") and len(line) >= max_bytes + 2:
                    while (rest := f.readline(1 << 16)) and not rest.endswith(b"\n"):
                        pos += len(rest)
                    pos += len(rest)
                    first = False
                    yield None
                    continue
                if first:
                    line = line.removeprefix(_BOM)
                    first = False
                line = line.removesuffix(b"\n").removesuffix(b"\r")
                yield None if len(line) > max_bytes else line
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise PrepError(f"{path}: truncated or corrupt gzip file ({e})") from None
    except OSError as e:
        raise PrepError(f"{path}: cannot read: {e.strerror or e}") from None


def read_range(path: Path, max_bytes: int, start: int, stop: int, whole_below: int = 1 << 26) -> list[bytes | None]:
    """``read_lines(path, max_bytes, start, stop)`` as a list. A range smaller than
    ``whole_below`` bytes is read in one call and split (a shard: ~5x faster than line by line);
    a larger one, which only a huge line makes, is read line by line to bound memory."""
    if stop - start >= whole_below:
        return list(read_lines(path, max_bytes, start, stop))
    try:
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read(stop - start)
    except OSError as e:
        raise PrepError(f"{path}: cannot read: {e.strerror or e}") from None
    lines = data.split(b"\n")
    if data.endswith(b"\n") or not data:
        lines.pop()
    if start == 0 and lines:
        lines[0] = lines[0].removeprefix(_BOM)
    return [None if len(line) > max_bytes else line
            for line in (line.removesuffix(b"\r") for line in lines)]


def is_gzip(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == GZIP_MAGIC


def line_starts(path: Path, every: int, piece: int = 1 << 18) -> tuple[list[int], int]:
    """Byte offsets of lines 0, ``every``, 2 * ``every``, ... of a plain file (those before its
    end), and its number of lines as :func:`read_lines` counts them. One pass at the speed of
    ``bytes.count`` (GB/s): newlines are only located one by one inside the pieces where a
    boundary falls."""
    check_readable(path)
    starts, lines, pos, boundary, last = [0], 0, 0, every, b"\n"
    try:
        with open(path, "rb") as f:
            while block := f.read(piece):
                found = block.count(b"\n")
                at, located = -1, 0  # the last newline located in this block, and how many so far
                while lines + found >= boundary:
                    for _ in range(boundary - lines - located):
                        at = block.index(b"\n", at + 1)
                    located = boundary - lines
                    starts.append(pos + at + 1)
                    boundary += every
                lines += found
                pos += len(block)
                last = block[-1:]
    except OSError as e:
        raise PrepError(f"{path}: cannot read: {e.strerror or e}") from None
    return [x for x in starts if x < pos] or [0], lines + (last != b"\n")


def byte_ranges(starts: list[int], size: int) -> list[tuple[int, int]]:
    return list(zip(starts, starts[1:] + [size]))


def read_sgml(path: Path) -> list[bytes]:
    """The segments of a WMT SGML file, in file order. The file is read whole: these are test
    sets (a few thousand segments), not training corpora."""
    try:
        with open_binary(path) as f:
            data = f.read()
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise PrepError(f"{path}: truncated or corrupt gzip file ({e})") from None
    segs = [m.group(1).strip() for m in _SEG.finditer(data.removeprefix(_BOM))]
    if not segs:
        raise PrepError(f"{path}: no <seg> elements found (not a WMT SGML file?)")
    return [s.replace(b"\r", b" ").replace(b"\n", b" ") for s in segs]


def read_side(path: Path, max_bytes: int) -> Iterator[bytes | None]:
    return iter(read_sgml(path)) if is_sgml(path) else read_lines(path, max_bytes)


def find_side(directory: Path, prefix: str, lang: str, pair: tuple[str, str]) -> Path:
    """The file holding language ``lang`` of corpus ``prefix`` in ``directory``:
    ``PREFIX.LANG``, ``PREFIX.LANG.gz``, ``PREFIX.LANG.sgm``, or WMT's SGML naming
    ``PREFIX-*.LANG.sgm`` (``newstest2014-deen-src.en.sgm``, ``test-ref.en.sgm``); among several
    of the last kind, the one naming the language pair (``deen``/``ende``). ``prefix`` may
    itself be a path (absolute, or relative to ``directory``)."""
    base = directory / prefix
    for name in (f"{base.name}.{lang}", f"{base.name}.{lang}.gz", f"{base.name}.{lang}.sgm"):
        if (base.parent / name).is_file():
            return base.parent / name
    found = sorted(p for p in base.parent.glob(f"{glob_escape(base.name)}-*.{lang}.sgm") if p.is_file())
    if len(found) > 1:
        codes = ("".join(pair), "".join(pair[::-1]))
        found = [p for p in found if any(c in p.name for c in codes)] or found
    if len(found) == 1:
        return found[0]
    if found:
        raise PrepError(f"{directory}: several files could be the {lang} side of {prefix!r}: "
                        f"{', '.join(p.name for p in found)}; name one with a longer prefix")
    raise PrepError(f"{base.parent / (base.name + '.' + lang)}: no such file (looked for "
                    f"{base.name}.{lang}, .{lang}.gz, .{lang}.sgm and {base.name}-*.{lang}.sgm "
                    f"in {base.parent})")


def glob_escape(s: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", s)


# ---- pair sources -----------------------------------------------------------------------------

class FilePairs:
    """Two aligned files, one per language."""

    def __init__(self, src: Path, tgt: Path, max_line_bytes: int):
        self.src, self.tgt, self.max_line_bytes = src, tgt, max_line_bytes
        self.dropped = {"overlong": 0}
        for p in (src, tgt):
            check_readable(p)

    def describe(self) -> str:
        return f"{self.src} + {self.tgt}"

    def fingerprint(self) -> dict:
        return {"kind": "files", "src": _file_fingerprint(self.src), "tgt": _file_fingerprint(self.tgt)}

    def shards(self, lines: int) -> list[tuple] | None:
        """The byte ranges of both sides holding ``lines`` pairs each, when both sides are plain
        files (a worker then reads its own range); None for gzip and SGML, read in order by one
        process. Sides with different numbers of lines raise PrepError here, before any work."""
        if any(is_sgml(p) or is_gzip(p) for p in (self.src, self.tgt)):
            return None
        (src_starts, n_src), (tgt_starts, n_tgt) = line_starts(self.src, lines), line_starts(self.tgt, lines)
        if n_src != n_tgt:
            raise PrepError(f"the two sides have different numbers of lines: {self.src} has "
                            f"{n_src}, {self.tgt} has {n_tgt}")
        return list(zip(byte_ranges(src_starts, self.src.stat().st_size),
                        byte_ranges(tgt_starts, self.tgt.stat().st_size)))

    def read_shard(self, shard: tuple) -> Iterator[tuple[bytes, bytes]]:
        """The pairs of one range from :meth:`shards`; overlong ones are counted in ``dropped``."""
        (src_start, src_stop), (tgt_start, tgt_stop) = shard
        self.dropped = {"overlong": 0}
        for s, t in zip(read_range(self.src, self.max_line_bytes, src_start, src_stop),
                        read_range(self.tgt, self.max_line_bytes, tgt_start, tgt_stop)):
            if s is None or t is None:
                self.dropped["overlong"] += 1
                continue
            yield s, t

    def __iter__(self) -> Iterator[tuple[bytes, bytes]]:
        self.dropped = {"overlong": 0}
        src_lines = read_side(self.src, self.max_line_bytes)
        tgt_lines = read_side(self.tgt, self.max_line_bytes)
        n = 0
        for s, t in zip_longest(src_lines, tgt_lines, fillvalue=_END):
            if s is _END or t is _END:
                # Count the rest of the longer side so that the message gives both totals.
                rest = sum(1 for _ in (tgt_lines if s is _END else src_lines))
                n_src, n_tgt = (n, n + 1 + rest) if s is _END else (n + 1 + rest, n)
                raise PrepError(f"the two sides have different numbers of lines: {self.src} has "
                                f"{n_src}, {self.tgt} has {n_tgt}")
            n += 1
            if s is None or t is None:
                self.dropped["overlong"] += 1
                continue
            yield s, t


_END = object()


class TsvPairs:
    """``src<TAB>tgt`` lines (plain or gzip)."""

    def __init__(self, path: Path, max_line_bytes: int):
        self.path, self.max_line_bytes = path, max_line_bytes
        self.dropped = {"overlong": 0, "malformed": 0}
        check_readable(path)

    def describe(self) -> str:
        return str(self.path)

    def fingerprint(self) -> dict:
        return {"kind": "tsv", "file": _file_fingerprint(self.path)}

    def shards(self, lines: int) -> list[tuple] | None:
        """Byte ranges of ``lines`` lines each (see FilePairs.shards); None for gzip."""
        if is_gzip(self.path):
            return None
        return byte_ranges(line_starts(self.path, lines)[0], self.path.stat().st_size)

    def read_shard(self, shard: tuple) -> Iterator[tuple[bytes, bytes]]:
        return self._pairs(read_range(self.path, 2 * self.max_line_bytes + 1, *shard))

    def __iter__(self) -> Iterator[tuple[bytes, bytes]]:
        return self._pairs(read_lines(self.path, 2 * self.max_line_bytes + 1))

    def _pairs(self, lines: Iterator[bytes | None]) -> Iterator[tuple[bytes, bytes]]:
        self.dropped = {"overlong": 0, "malformed": 0}
        for line in lines:
            if line is None:
                self.dropped["overlong"] += 1
                continue
            cols = line.split(b"\t")
            if len(cols) != 2:
                self.dropped["malformed"] += 1
                continue
            if len(cols[0]) > self.max_line_bytes or len(cols[1]) > self.max_line_bytes:
                self.dropped["overlong"] += 1
                continue
            yield cols[0], cols[1]


class DatasetPairs:
    """A `datasets` split of ``{'translation': {lang: text, ...}}`` records."""

    def __init__(self, dataset, src_lang: str, tgt_lang: str, label: str, fingerprint: dict):
        self.dataset, self.src_lang, self.tgt_lang = dataset, src_lang, tgt_lang
        self.label, self._fingerprint = label, fingerprint
        self.dropped = {"malformed": 0}
        if "translation" not in dataset.column_names:
            raise PrepError(f"{label}: records have no 'translation' field (columns: "
                            f"{', '.join(dataset.column_names)}); expected "
                            f"{{'translation': {{'{src_lang}': ..., '{tgt_lang}': ...}}}}")

    def __len__(self) -> int:
        return len(self.dataset)

    def shards(self, lines: int) -> None:
        return None  # read in order by the main process (an Arrow table is not shipped to workers)

    def describe(self) -> str:
        return self.label

    def fingerprint(self) -> dict:
        return self._fingerprint

    def __iter__(self) -> Iterator[tuple[str, str]]:
        self.dropped = {"malformed": 0}
        for batch in self.dataset.iter(batch_size=10_000):  # columnar batches: fast, bounded
            for record in batch["translation"]:
                s = record.get(self.src_lang) if isinstance(record, dict) else None
                t = record.get(self.tgt_lang) if isinstance(record, dict) else None
                if not isinstance(s, str) or not isinstance(t, str):
                    self.dropped["malformed"] += 1
                    continue
                yield s, t


def _file_fingerprint(path: Path) -> dict:
    return {"name": path.name, "sha256": sha256_file(path)}


# ---- datasets ---------------------------------------------------------------------------------

HUB_HELP = ("Without the hub, point at local files instead: --raw-dir DIR (train.SRC/train.TGT "
            "or --train-prefix NAME..., plain, gzip or SGML, plus newstest2013.* and "
            "newstest2014.*), --tsv FILE with --raw-dir for dev/test, or --json-dir DIR holding "
            "train/validation/test .jsonl files of {'translation': {...}} records. A dataset "
            "already in the datasets cache is used offline with HF_DATASETS_OFFLINE=1.")


def load_hub_split(name: str, config: str, split: str, src_lang: str, tgt_lang: str,
                   cache_dir: str | None) -> DatasetPairs:
    """A split of the WMT14 builder (downloaded once into the datasets cache)."""
    try:
        import datasets
    except ImportError as e:
        raise PrepError(f"the datasets library is not installed ({e}). {HUB_HELP}") from None
    try:
        ds = datasets.load_dataset(name, config, split=split, cache_dir=cache_dir)
    except Exception as e:  # network, offline mode, missing config: all mean "not available"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PrepError(f"cannot load {name!r} ({config}, {split}) through datasets: "
                        f"{type(e).__name__}: {first}. {HUB_HELP}") from None
    return DatasetPairs(ds, src_lang, tgt_lang, f"datasets {name}/{config}[{split}]",
                        {"kind": "datasets", "name": name, "config": config, "split": split,
                         "fingerprint": getattr(ds, "_fingerprint", None), "rows": len(ds)})


def load_json_split(files: list[Path], split: str, src_lang: str, tgt_lang: str,
                    cache_dir: str | None) -> DatasetPairs:
    """Local JSON-lines files of `datasets`-shaped records, through ``load_dataset("json")``:
    the same loader code path as the hub."""
    for f in files:
        check_readable(f)
    try:
        import datasets
    except ImportError as e:
        raise PrepError(f"the datasets library is not installed ({e})") from None
    try:
        ds = datasets.load_dataset("json", data_files={split: [str(f) for f in files]}, split=split,
                                   cache_dir=cache_dir)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PrepError(f"{', '.join(map(str, files))}: cannot be read as JSON lines by datasets: "
                        f"{type(e).__name__}: {first}") from None
    label = ", ".join(str(f) for f in files)
    return DatasetPairs(ds, src_lang, tgt_lang, label,
                        {"kind": "json", "files": [_file_fingerprint(f) for f in files]})


def find_json_split(directory: Path, split: str) -> list[Path]:
    """``SPLIT.jsonl``, ``SPLIT.json`` (optionally ``.gz``), or ``SPLIT-*.jsonl`` shards."""
    found = sorted(p for pattern in (f"{split}.json", f"{split}.jsonl", f"{split}.json.gz",
                                     f"{split}.jsonl.gz", f"{split}-*.jsonl", f"{split}-*.jsonl.gz")
                   for p in directory.glob(pattern) if p.is_file())
    if not found:
        raise PrepError(f"{directory / (split + '.jsonl')}: no such file (--json-dir needs "
                        f"{split}.jsonl, {split}.json or {split}-*.jsonl shards)")
    return found
