"""The work of the two streaming steps, cut into shards that worker processes do on their own.

    clean step: S shards of --chunk-lines input pairs, B hash buckets
      clean_shard      x S   raw pairs -> NNNNNN.{src,tgt}: normalised, non-empty pairs, in
                             order, duplicates included; NNNNNN.digest: a 64-bit digest each
      find_duplicates  x B   the digests d with d % B == b, from every shard in input order ->
                             dup.b: the global positions of the pairs seen before
      drop_duplicates  x S   NNNNNN.{src,tgt} minus its positions in every dup.b ->
                             NNNNNN.kept.{src,tgt}
      main process           concatenates the kept shards -> work/train.clean.{src,tgt}
    train step: the same S shards, as line ranges of work/train.clean.*
      encode_shard     x S   SentencePiece, length and ratio filter -> NNNNNN.{src,tgt}.{bin,idx}
      main process           concatenates them -> train.{src,tgt}.{bin,idx}

Deduplication stays exact and keeps the first occurrence: all copies of a pair have its digest,
so they fall in one bucket, and a bucket reads the shards in input order. The output is therefore
the one a single process reading the corpus in order writes (the cleaned text and the binarized
split are byte-identical), for any number of workers, shards or buckets. The main process only
schedules, concatenates (at the speed of a file copy) and, for sources that can only be read
from their start (gzip, SGML, `datasets`), reads the raw pairs and hands them over.

Resuming inside a step: every task writes its files under temporary names, renames them, and
writes ``NAME.json`` (its counts and the sizes of its files) last, without fsync: the step record
written at the end checksums what matters. A task whose json exists with matching file sizes is
done, and a resumed step skips it. The shard folder is named by the step's key and layout, so a
change of input or options never reuses a shard, and is removed when the step is complete.
"""

from __future__ import annotations

import functools
import io
import json
import os
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_prep.clean import PunctNormalizer, decode_side, length_filter, normalize_lines, pair_digest

# Seconds a worker sleeps after encoding each shard when set: lets a test kill a run in the
# middle of the train step.
SLOW_ENV = "DATA_PREP_TEST_SLOW_BINARIZE"
# Pairs per hash bucket (at most, on average): bounds find_duplicates' memory (~40 bytes a pair).
BUCKET_PAIRS = 1 << 21


def shard_name(index: int) -> str:
    return f"{index:06d}"


# ---- completion records ------------------------------------------------------------------------

def clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def finish(directory: Path, name: str, stats: dict, outputs: list[str], started: tuple[float, float]) -> dict:
    """Record task ``name`` as done: its stats (with ``seconds`` and ``cpu_seconds``, the task's
    wall and CPU time since ``started`` = ``clock()``, which the benchmark adds up) and the sizes
    of its output files."""
    stats["seconds"] = round(time.perf_counter() - started[0], 4)
    stats["cpu_seconds"] = round(time.process_time() - started[1], 4)
    sizes = {f: (directory / f).stat().st_size for f in outputs}
    _write(directory / f"{name}.json", json.dumps({"stats": stats, "sizes": sizes}).encode())
    return stats


def done(directory: Path, name: str) -> dict | None:
    """The stats of a finished task, or None when it must run (again)."""
    try:
        record = json.loads((directory / f"{name}.json").read_bytes())
        if all((directory / f).stat().st_size == n for f, n in record["sizes"].items()):
            return record["stats"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _text(lines: list[bytes]) -> bytes:
    return b"".join(line + b"\n" for line in lines)


# ---- clean step --------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def punct_normalizer(lang: str) -> PunctNormalizer:
    return PunctNormalizer(lang)


@dataclass
class CleanShard:
    """One shard of raw pairs: a byte range that the worker reads from ``source``
    (``source.read_shard(byte_range)``), or the raw pairs themselves. ``punct``: the two sides'
    normalisers, built once by the main process (small, a few kB pickled)."""
    directory: Path
    index: int
    punct: tuple[PunctNormalizer, PunctNormalizer]
    source: object = None
    byte_range: tuple | None = None
    pairs: list | None = None


def clean_shard(task: CleanShard) -> dict:
    """Decode and normalise; drop invalid UTF-8 and empty pairs; write the rest and their digests.
    Returns the counts: ``pairs`` written, and the pairs dropped by name."""
    started = clock()
    name = shard_name(task.index)
    punct_src, punct_tgt = task.punct
    raw = task.pairs if task.pairs is not None else list(task.source.read_shard(task.byte_range))
    src, tgt = [decode_side(s) for s, _ in raw], [decode_side(t) for _, t in raw]
    if None in src or None in tgt:
        valid = [(s, t) for s, t in zip(src, tgt) if s is not None and t is not None]
        src, tgt = [s for s, _ in valid], [t for _, t in valid]
    stats = {"invalid_utf8": len(raw) - len(src), "empty": 0}
    src_out, tgt_out, digests = [], [], []
    for s, t in zip(normalize_lines(src, punct_src), normalize_lines(tgt, punct_tgt)):
        if not s or not t:
            stats["empty"] += 1
            continue
        src_out.append(s.encode("utf-8"))
        tgt_out.append(t.encode("utf-8"))
        digests.append(pair_digest(src_out[-1], tgt_out[-1]))
    if task.pairs is None:
        stats.update(task.source.dropped)  # what reading the range dropped (overlong, malformed)
    stats["pairs"] = len(src_out)
    d = task.directory
    _write(d / f"{name}.src", _text(src_out))
    _write(d / f"{name}.tgt", _text(tgt_out))
    _write(d / f"{name}.digest", np.array(digests, dtype="<u8").tobytes())
    return finish(d, name, stats, [f"{name}.src", f"{name}.tgt", f"{name}.digest"], started)


@dataclass
class DuplicateBucket:
    directory: Path
    bucket: int
    buckets: int
    shard_pairs: list[int]  # pairs written by each clean_shard, in order


def find_duplicates(task: DuplicateBucket) -> dict:
    """The pairs of this bucket whose digest occurred earlier in the corpus -> dup.B, their
    global positions (int64, ascending)."""
    started = clock()
    name = f"dup.{task.bucket}"
    keys, positions, start = [], [], 0
    for index, n in enumerate(task.shard_pairs):
        d = np.fromfile(task.directory / f"{shard_name(index)}.digest", dtype="<u8")
        mine = np.flatnonzero(d % np.uint64(task.buckets) == task.bucket)
        keys.append(d[mine])
        positions.append(mine + start)
        start += n
    keys, positions = np.concatenate(keys), np.concatenate(positions)
    _, first = np.unique(keys, return_index=True)  # the first occurrence of each digest
    duplicates = np.delete(positions, first)
    _write(task.directory / name, duplicates.astype("<i8").tobytes())
    return finish(task.directory, name, {"duplicates": int(duplicates.size)}, [name], started)


@dataclass
class DropDuplicates:
    directory: Path
    index: int
    start: int  # global position of the shard's first pair
    buckets: int


def drop_duplicates(task: DropDuplicates) -> dict:
    """NNNNNN.{src,tgt} without the pairs that some dup.B lists -> NNNNNN.kept.{src,tgt}."""
    started = clock()
    name = shard_name(task.index)
    d = task.directory
    src = (d / f"{name}.src").read_bytes().split(b"\n")[:-1]
    tgt = (d / f"{name}.tgt").read_bytes().split(b"\n")[:-1]
    keep = np.ones(len(src), dtype=bool)
    for bucket in range(task.buckets):
        path = d / f"dup.{bucket}"
        if path.stat().st_size == 0:
            continue
        dup = np.memmap(path, dtype="<i8", mode="r")  # sorted: only the shard's range is read
        lo, hi = np.searchsorted(dup, [task.start, task.start + len(src)])
        keep[np.asarray(dup[lo:hi]) - task.start] = False
    kept = np.flatnonzero(keep)
    _write(d / f"{name}.kept.src", _text([src[i] for i in kept]))
    _write(d / f"{name}.kept.tgt", _text([tgt[i] for i in kept]))
    outputs = [f"{name}.kept.src", f"{name}.kept.tgt"]
    stats = {"kept": int(kept.size), "duplicate": int(len(src) - kept.size),
             "src_bytes": (d / outputs[0]).stat().st_size, "tgt_bytes": (d / outputs[1]).stat().st_size}
    return finish(d, f"{name}.kept", stats, outputs, started)


# ---- train step --------------------------------------------------------------------------------

def _encoder(path: str):
    """One per worker process and model file, kept across shards: its word cache is what makes
    encoding fast (admin_ds.data.subword.WordCachedEncoder). A model rewritten at the same path
    (a rerun in this process with other options) gets a new one."""
    stat = os.stat(path)
    return _encoder_for(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _encoder_for(path: str, mtime_ns: int, size: int):
    from admin_ds.data.subword import SubwordModel, WordCachedEncoder

    return WordCachedEncoder(SubwordModel(path, num_threads=1))  # one process per core already


# The word tables each process has taken in or written, by encoder (see take_in_words).
_tables_seen: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def take_in_words(directory: Path, encoder) -> None:
    """Workers encoding with the same model share the words they learn (:func:`pass_on_words`
    after a task, this before the next): a few dictionary inserts a word against a SentencePiece
    encode. Without it every worker learns the corpus's vocabulary for itself: with two workers
    ~20% more CPU for the whole encode step of a small corpus. The cache is exact whatever it
    holds, so which tables a worker has seen changes its speed, never its output."""
    seen = _tables_seen.setdefault(encoder, set())
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if entry.name.endswith(".words.npz") and entry.name not in seen:
            seen.add(entry.name)
            with np.load(entry.path, allow_pickle=False) as table:
                encoder.add(table["words"].tobytes().decode("utf-8").split("\n"), table["lengths"], table["ids"])


def pass_on_words(directory: Path, name: str, encoder) -> None:
    """The words ``encoder`` learned in task ``name`` -> NAME.words.npz, for the other workers."""
    words, lengths, ids = encoder.learned()
    if words:
        buffer = io.BytesIO()
        np.savez(buffer, words=np.frombuffer("\n".join(words).encode("utf-8"), np.uint8),
                 lengths=lengths.astype(np.int32), ids=ids.astype(np.int32))
        _write(directory / f"{name}.words.npz", buffer.getvalue())
        _tables_seen.setdefault(encoder, set()).add(f"{name}.words.npz")


@dataclass
class EncodeShard:
    """Lines ``[first, first + lines)`` of the cleaned text: ``src_range`` / ``tgt_range`` are
    their byte ranges in the two files. ``share_words``: exchange the learned words with the
    other workers (:func:`take_in_words`)."""
    directory: Path
    index: int
    clean_files: tuple[str, str]
    src_range: tuple[int, int]
    tgt_range: tuple[int, int]
    spm_model: str
    min_len: int
    max_len: int
    ratio: float
    share_words: bool = False


def _read_range(path: str, byte_range: tuple[int, int]) -> str:
    start, stop = byte_range
    with open(path, "rb") as f:
        f.seek(start)
        return f.read(stop - start).decode("utf-8")


def encode_shard(task: EncodeShard) -> dict:
    """Encode both sides, drop the pairs outside the length and ratio limits, and write the rest
    as NNNNNN.{src,tgt}.{bin,idx} (indexed datasets, concatenated later)."""
    from admin_ds.data.indexed import IndexedDatasetWriter
    from admin_ds.data.subword import UNK

    started = clock()
    name = shard_name(task.index)
    encoder = _encoder(task.spm_model)
    if task.share_words:
        take_in_words(task.directory, encoder)
        encoder.learned()  # from here on: what this task learns, for pass_on_words
    src = encoder.encode_text(_read_range(task.clean_files[0], task.src_range))
    tgt = encoder.encode_text(_read_range(task.clean_files[1], task.tgt_range))
    if task.share_words:
        pass_on_words(task.directory, name, encoder)
    reasons = length_filter(src[1], tgt[1], task.min_len, task.max_len, task.ratio)
    stats = {name: int(np.count_nonzero(reasons == name)) for name in ("too_short", "too_long", "ratio")}
    keep = reasons == ""
    stats["kept"] = int(np.count_nonzero(keep))
    outputs = []
    for side, (all_ids, all_lengths) in (("src", src), ("tgt", tgt)):
        ids, lengths = all_ids[np.repeat(keep, all_lengths)], all_lengths[keep]
        with IndexedDatasetWriter(task.directory / f"{name}.{side}", encoder.model.vocab_size, sync=False) as w:
            w.add_batch(ids, lengths)
        stats[f"{side}_tokens"] = int(ids.size)
        stats[f"{side}_unk"] = int(np.count_nonzero(ids == UNK))
        outputs += [f"{name}.{side}.bin", f"{name}.{side}.idx"]
    if slow := float(os.environ.get(SLOW_ENV, "0") or 0):
        time.sleep(slow)
    return finish(task.directory, name, stats, outputs, started)
