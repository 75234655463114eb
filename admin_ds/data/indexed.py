"""Memory-mapped, binarized corpora and the collater that turns them into batches.

On-disk format
--------------
One side of a corpus (e.g. the English half of an En-De training set) lives in
two files sharing a prefix:

``PREFIX.bin``
    The token ids of every sentence, concatenated with no separators, stored
    little-endian as ``uint16`` when ``vocab_size <= 65536`` and as ``int32``
    otherwise. Sentences are stored *without* EOS: :func:`collate` appends it,
    so the convention lives in one place instead of being baked into the data.

``PREFIX.idx``
    A 21-byte packed little-endian header followed by two arrays::

        offset  size     field
        0       8        magic  b"ADMINIDX"
        8       4        uint32 format version (= 1)
        12      1        uint8  dtype code (1 = uint16, 2 = int32)
        13      8        uint64 number of sentences n
        21      4*n      int32  lengths[n]
        21+4n   8*(n+1)  int64  offsets[n+1], in tokens; offsets[0] == 0 and
                                offsets[-1] == total number of tokens

Why this layout: a training corpus can hold tens of millions of sentences and
billions of tokens, so nothing may require loading the data into RAM. Both
files are memory-mapped; reading sentence ``i`` costs two offset lookups and a
slice, and every data-loader process shares the same page cache. The lengths
are duplicated next to the offsets because batching needs all of them at once
as a plain array; they are the only thing :class:`IndexedDataset` copies into
memory (4 bytes per sentence).

Crash safety: :class:`IndexedDatasetWriter` writes to ``*.tmp`` files, fsyncs
and renames them into place with the ``.idx`` last. A reader requires the
``.idx`` and checks the ``.bin`` size against it, so an interrupted
binarization never produces a pair of files that a reader would accept.
"""

from __future__ import annotations

import errno
import mmap
import operator
import os
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "FORMAT_VERSION",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "ParallelDataset",
    "collate",
    "dtype_for_vocab",
]

MAGIC = b"ADMINIDX"
FORMAT_VERSION = 1
# "<" = little-endian with no padding, so the header is exactly 21 bytes.
_HEADER = struct.Struct("<8sIBQ")
HEADER_SIZE = _HEADER.size

_DTYPE_BY_CODE = {1: np.dtype("<u2"), 2: np.dtype("<i4")}
_CODE_BY_DTYPE = {dtype: code for code, dtype in _DTYPE_BY_CODE.items()}

# Tokens buffered in memory before being appended to the .bin file; bounds the
# writer's memory use independently of corpus size.
_FLUSH_TOKENS = 1 << 20
# Sentences per chunk when writing offsets or appending a dataset, for the same reason.
_OFFSET_CHUNK = 1 << 20


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The on-disk token dtype for a vocabulary: uint16 if it fits, else int32."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if vocab_size > np.iinfo(np.int32).max + 1:
        raise ValueError(f"vocab_size {vocab_size} does not fit in int32 token ids")
    return _DTYPE_BY_CODE[1] if vocab_size <= 1 << 16 else _DTYPE_BY_CODE[2]


def _paths(prefix: str | os.PathLike) -> tuple[str, str]:
    prefix = os.fspath(prefix)
    return prefix + ".idx", prefix + ".bin"


def _fsync_directory(path: str) -> None:
    # Makes the renames themselves durable. Not every platform/file system
    # allows opening a directory, and the data files are already synced, so
    # failure here is not worth aborting over.
    try:
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class IndexedDatasetWriter:
    """Streams sentences into ``PREFIX.bin`` / ``PREFIX.idx``.

    Token ids and sentence lengths are buffered in small chunks and appended to
    ``PREFIX.bin.tmp`` and ``PREFIX.idx.tmp`` as they arrive, so memory use is
    bounded by the chunk size whatever the corpus size; the offsets are computed
    from the lengths read back when finalizing. Nothing is visible under the
    final names until :meth:`finalize` succeeds.

    Typical use::

        with IndexedDatasetWriter("data/train.en", vocab_size=32000) as w:
            for ids in encoded_sentences:
                w.add(ids)
        # finalized on a clean exit; on an exception the temp files are removed

    :meth:`add_batch` takes many sentences as one flat array and their lengths
    (a few vectorised operations instead of a Python call per sentence), and
    :meth:`append` copies a whole finished dataset: data preparation writes one
    dataset per shard in worker processes and concatenates them with it.

    Args:
        prefix: path prefix of the two output files.
        vocab_size: every id must lie in ``[0, vocab_size)``; also picks the
            on-disk dtype (see :func:`dtype_for_vocab`).
        sync: fsync the files and the folder when finalizing. False for
            intermediate files that a later completion record checks anyway
            (data preparation's shards): the renames stay atomic.
    """

    def __init__(self, prefix: str | os.PathLike, vocab_size: int, sync: bool = True):
        self.prefix = os.fspath(prefix)
        self.sync = sync
        self.vocab_size = int(vocab_size)
        self.dtype = dtype_for_vocab(self.vocab_size)
        self._idx_path, self._bin_path = _paths(self.prefix)
        self._idx_tmp = self._idx_path + ".tmp"
        self._bin_tmp = self._bin_path + ".tmp"

        self._bin_file = open(self._bin_tmp, "wb")
        self._idx_file = open(self._idx_tmp, "w+b")
        self._idx_file.write(bytes(HEADER_SIZE))  # the real header once n is known
        self._pending: list[np.ndarray] = []
        self._pending_lengths: list[np.ndarray] = []
        self._pending_tokens = 0
        self._num_sentences = 0
        self._num_tokens = 0
        self._state = "open"

    def __len__(self) -> int:
        return self._num_sentences

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def add(self, ids: Sequence[int] | np.ndarray) -> None:
        """Append one sentence (a 1-D sequence of token ids, without EOS)."""
        self._require_open("add")
        arr = np.asarray(ids)
        if arr.ndim != 1:
            raise ValueError(
                f"{self.prefix}: sentence {self._num_sentences} must be a 1-D sequence of ids, "
                f"got shape {arr.shape}"
            )
        self._check_ids(arr, np.array([arr.size]))
        self._push(arr, np.array([arr.size], dtype=np.int32))

    def add_batch(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        """Append ``len(lengths)`` sentences whose ids are concatenated in ``ids``."""
        self._require_open("add")
        ids, lengths = np.asarray(ids), np.asarray(lengths)
        if ids.ndim != 1 or lengths.ndim != 1:
            raise ValueError(f"{self.prefix}: add_batch takes 1-D ids and lengths, got shapes "
                             f"{ids.shape} and {lengths.shape}")
        if lengths.size and (int(lengths.min()) < 0 or int(lengths.sum()) != ids.size):
            raise ValueError(f"{self.prefix}: lengths (sum {int(lengths.sum())}) do not describe "
                             f"the {ids.size} ids given")
        self._check_ids(ids, lengths)
        self._push(ids, lengths.astype(np.int32))

    def append(self, dataset: IndexedDataset, sentences_per_chunk: int = _OFFSET_CHUNK) -> None:
        """Append every sentence of ``dataset``, in order, a chunk at a time."""
        sizes = dataset.sizes
        offsets = dataset._offsets
        for start in range(0, len(sizes), sentences_per_chunk):
            stop = min(start + sentences_per_chunk, len(sizes))
            tokens = dataset._tokens[int(offsets[start]) : int(offsets[stop])]
            self.add_batch(tokens, sizes[start:stop])

    def _check_ids(self, arr: np.ndarray, lengths: np.ndarray) -> None:
        if not arr.size:
            return
        if not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"{self.prefix}: sentence {self._num_sentences} has non-integer ids "
                            f"(dtype {arr.dtype})")
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            where = int(np.flatnonzero(arr == bad)[0])
            sentence = self._num_sentences + int(np.searchsorted(np.cumsum(lengths), where, side="right"))
            raise ValueError(
                f"{self.prefix}: sentence {sentence} contains token id {bad}, "
                f"outside [0, {self.vocab_size})"
            )

    def _push(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        # astype copies, so a caller reusing its buffer cannot corrupt pending data.
        self._pending.append(ids.astype(self.dtype))
        self._pending_lengths.append(lengths.astype("<i4"))
        self._pending_tokens += ids.size
        self._num_sentences += lengths.size
        self._num_tokens += ids.size
        if self._pending_tokens >= _FLUSH_TOKENS:
            self._flush()

    def finalize(self) -> None:
        """Write the index, fsync both files and move them to their final names."""
        self._require_open("finalize")
        try:
            self._flush()
            self._bin_file.flush()
            if self.sync:
                os.fsync(self._bin_file.fileno())
            self._bin_file.close()
            self._write_index()
            # A stale .idx from an earlier run would otherwise pair with the
            # new .bin if we crashed between the two renames below.
            try:
                os.remove(self._idx_path)
            except FileNotFoundError:
                pass
            os.replace(self._bin_tmp, self._bin_path)
            os.replace(self._idx_tmp, self._idx_path)
            if self.sync:
                _fsync_directory(self._idx_path)
        except BaseException:
            self.abort()
            raise
        self._state = "finalized"

    def abort(self) -> None:
        """Discard everything written so far; the final files are not touched."""
        if self._state != "open":
            return
        self._state = "aborted"
        self._bin_file.close()
        self._idx_file.close()
        for path in (self._bin_tmp, self._idx_tmp):
            try:
                os.remove(path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif self._state == "open":
            self.finalize()

    def _require_open(self, action: str) -> None:
        if self._state != "open":
            raise RuntimeError(f"cannot {action}: writer for {self.prefix} is {self._state}")

    def _flush(self) -> None:
        if self._pending:
            self._bin_file.write(np.concatenate(self._pending).tobytes())
            self._idx_file.write(np.concatenate(self._pending_lengths).tobytes())
            self._pending.clear()
            self._pending_lengths.clear()
            self._pending_tokens = 0

    def _write_index(self) -> None:
        # The lengths are already in the file after the header; the offsets follow them,
        # computed chunk by chunk from the lengths read back, so that finalizing needs no
        # memory proportional to the number of sentences.
        n = self._num_sentences
        f = self._idx_file
        f.seek(0, os.SEEK_END)
        f.write(np.zeros(1, dtype="<i8").tobytes())
        carry = 0
        for start in range(0, n, _OFFSET_CHUNK):
            count = min(_OFFSET_CHUNK, n - start)
            f.seek(HEADER_SIZE + 4 * start)
            lengths = np.frombuffer(f.read(4 * count), dtype="<i4")
            chunk = np.cumsum(lengths, dtype="<i8")
            chunk += carry
            f.seek(0, os.SEEK_END)
            f.write(chunk.tobytes())
            carry = int(chunk[-1])
        f.seek(0)
        f.write(_HEADER.pack(MAGIC, FORMAT_VERSION, _CODE_BY_DTYPE[self.dtype], n))
        f.flush()
        if self.sync:
            os.fsync(f.fileno())
        f.close()


class IndexedDataset:
    """Read-only, memory-mapped view of ``PREFIX.bin`` / ``PREFIX.idx``.

    ``ds[i]`` returns sentence ``i`` (without EOS) as an int64 array copied out
    of the mapping; ``ds.sizes`` holds all sentence lengths as an int32 array.

    The file pair is validated on open (magic, version, dtype, index size, and
    ``.bin`` size against the offsets), so a truncated or mismatched file fails
    loudly here instead of producing garbage batches hours into training.

    Instances pickle by prefix and re-map the files when unpickled, so they can
    be handed to data-loader worker processes cheaply.
    """

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = os.fspath(prefix)
        self.idx_path, self.bin_path = _paths(self.prefix)
        for path in (self.idx_path, self.bin_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    errno.ENOENT, f"indexed dataset file not found: {path}", path
                )

        n, self._dtype = self._read_header()
        idx_size = os.path.getsize(self.idx_path)
        expected_idx = HEADER_SIZE + 4 * n + 8 * (n + 1)
        if idx_size != expected_idx:
            raise ValueError(
                f"{self.idx_path}: index is {idx_size} bytes but a header announcing "
                f"{n} sentences requires {expected_idx} bytes (truncated or corrupt)"
            )

        with open(self.idx_path, "rb") as f:
            self._idx_map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        # The 21-byte header leaves both arrays unaligned. Lengths are copied
        # into an aligned native array because batching runs vectorised code
        # over all of them; offsets stay mapped and are only read two at a time.
        self._sizes = np.frombuffer(self._idx_map, "<i4", n, HEADER_SIZE).astype(np.int32)
        self._offsets = np.frombuffer(self._idx_map, "<i8", n + 1, HEADER_SIZE + 4 * n)

        num_tokens = int(self._offsets[-1])
        if int(self._offsets[0]) != 0 or num_tokens != int(self._sizes.sum(dtype=np.int64)):
            raise ValueError(
                f"{self.idx_path}: offsets (first {int(self._offsets[0])}, last "
                f"{num_tokens}) are inconsistent with the sentence lengths"
            )
        bin_size = os.path.getsize(self.bin_path)
        expected_bin = num_tokens * self._dtype.itemsize
        if bin_size != expected_bin:
            raise ValueError(
                f"{self.bin_path}: data file is {bin_size} bytes but {self.idx_path} "
                f"describes {num_tokens} {self._dtype.name} tokens = {expected_bin} bytes "
                f"(truncated, or .bin/.idx from different runs)"
            )

        if num_tokens == 0:
            # mmap refuses empty files; an empty corpus is still a valid one.
            self._bin_map = None
            self._tokens = np.empty(0, dtype=self._dtype)
        else:
            with open(self.bin_path, "rb") as f:
                self._bin_map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._tokens = np.frombuffer(self._bin_map, self._dtype, num_tokens)

    def _read_header(self) -> tuple[int, np.dtype]:
        with open(self.idx_path, "rb") as f:
            header = f.read(HEADER_SIZE)
        if len(header) < HEADER_SIZE:
            raise ValueError(
                f"{self.idx_path}: truncated header ({len(header)} of {HEADER_SIZE} bytes)"
            )
        magic, version, code, n = _HEADER.unpack(header)
        if magic != MAGIC:
            raise ValueError(
                f"{self.idx_path}: bad magic {magic!r}, expected {MAGIC!r} "
                f"(not an admin-ds index file)"
            )
        if version != FORMAT_VERSION:
            raise ValueError(
                f"{self.idx_path}: unsupported format version {version} "
                f"(this code reads version {FORMAT_VERSION})"
            )
        if code not in _DTYPE_BY_CODE:
            raise ValueError(f"{self.idx_path}: unknown dtype code {code}")
        return n, _DTYPE_BY_CODE[code]

    @staticmethod
    def exists(prefix: str | os.PathLike) -> bool:
        """Whether both files of the pair exist (they are not validated)."""
        return all(os.path.isfile(p) for p in _paths(prefix))

    def __len__(self) -> int:
        return len(self._sizes)

    def __getitem__(self, i: int) -> np.ndarray:
        n = len(self._sizes)
        i = operator.index(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sentence index {i} out of range for {n} sentences")
        start, end = int(self._offsets[i]), int(self._offsets[i + 1])
        return self._tokens[start:end].astype(np.int64)

    @property
    def sizes(self) -> np.ndarray:
        """Sentence lengths (without EOS), int32[len(self)]."""
        return self._sizes

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    @property
    def dtype(self) -> np.dtype:
        """On-disk token dtype."""
        return self._dtype

    def __getstate__(self) -> dict[str, Any]:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["prefix"])

    def __repr__(self) -> str:
        return (
            f"IndexedDataset({self.prefix!r}, sentences={len(self)}, "
            f"tokens={self.num_tokens}, dtype={self._dtype.name})"
        )


class ParallelDataset:
    """Pairs a source and a target :class:`IndexedDataset` line by line."""

    def __init__(self, src: IndexedDataset, tgt: IndexedDataset):
        if len(src) != len(tgt):
            raise ValueError(
                f"source and target have different sentence counts: "
                f"{src.idx_path} has {len(src)}, {tgt.idx_path} has {len(tgt)}"
            )
        self.src = src
        self.tgt = tgt

    def __len__(self) -> int:
        return len(self.src)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.src[i], self.tgt[i]

    @property
    def src_sizes(self) -> np.ndarray:
        return self.src.sizes

    @property
    def tgt_sizes(self) -> np.ndarray:
        return self.tgt.sizes

    def __repr__(self) -> str:
        return f"ParallelDataset(src={self.src!r}, tgt={self.tgt!r})"


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def collate(
    samples: Sequence[tuple[int, Sequence[int], Sequence[int]]],
    pad_idx: int,
    eos_idx: int,
    pad_to_multiple: int = 1,
) -> dict[str, Any]:
    """Build a right-padded batch from ``(index, src_ids, tgt_ids)`` samples.

    Follows the fairseq convention for teacher forcing: the decoder input is
    the target shifted right with EOS as the start symbol, and the prediction
    target ends with EOS::

        src_tokens     = src + [eos]
        tgt_in_tokens  = [eos] + tgt
        target         = tgt + [eos]

    Returns a dict with int64 tensors ``src_tokens`` (B, S), ``tgt_in_tokens``
    and ``target`` (B, T), and ``ids`` (B,) holding the dataset indices, plus
    ints ``ntokens`` (non-pad target tokens, the loss normaliser) and
    ``nsentences``. ``pad_to_multiple`` rounds S and T up, e.g. to 8 for
    tensor-core friendly shapes.
    """
    import torch  # here, not at the top: data preparation writes and reads indexed files without torch

    if not samples:
        raise ValueError("cannot collate an empty list of samples")
    if pad_to_multiple < 1:
        raise ValueError(f"pad_to_multiple must be >= 1, got {pad_to_multiple}")
    bsz = len(samples)
    src_lens = np.array([len(src) for _, src, _ in samples], dtype=np.int64)
    tgt_lens = np.array([len(tgt) for _, _, tgt in samples], dtype=np.int64)
    src_width = _round_up(int(src_lens.max()) + 1, pad_to_multiple)
    tgt_width = _round_up(int(tgt_lens.max()) + 1, pad_to_multiple)

    src_tokens = np.full((bsz, src_width), pad_idx, dtype=np.int64)
    tgt_in_tokens = np.full((bsz, tgt_width), pad_idx, dtype=np.int64)
    target = np.full((bsz, tgt_width), pad_idx, dtype=np.int64)
    for row, (_, src, tgt) in enumerate(samples):
        ns, nt = len(src), len(tgt)
        src_tokens[row, :ns] = src
        src_tokens[row, ns] = eos_idx
        tgt_in_tokens[row, 0] = eos_idx
        tgt_in_tokens[row, 1 : nt + 1] = tgt
        target[row, :nt] = tgt
        target[row, nt] = eos_idx

    return {
        "ids": torch.tensor([int(index) for index, _, _ in samples], dtype=torch.int64),
        "src_tokens": torch.from_numpy(src_tokens),
        "tgt_in_tokens": torch.from_numpy(tgt_in_tokens),
        "target": torch.from_numpy(target),
        "ntokens": int(tgt_lens.sum() + bsz),
        "nsentences": bsz,
    }
