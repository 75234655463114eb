"""Joint SentencePiece subword model with fairseq-compatible special ids.

The source and target languages share one model (and hence one vocabulary), which is
what allows tied embeddings across encoder, decoder and output projection.

Special ids follow fairseq's ``Dictionary`` layout so that binarised data, checkpoints and
decoding agree without a remapping table::

    0 <s>    BOS
    1 <pad>  PAD
    2 </s>   EOS
    3 <unk>  UNK
    4...     reserved user-defined symbols, in the order given (e.g. ``<BT>`` for tagged
             back-translation), then the learned pieces.

SentencePiece itself assigns these ids (``bos_id``/``pad_id``/``eos_id``/``unk_id`` trainer
options), so the ``.model`` file alone defines the mapping; :class:`SubwordModel`
re-checks it on load because a model trained elsewhere with SentencePiece's defaults
(``<unk>=0, <s>=1, </s>=2``, no pad) would otherwise silently scramble every sequence.

Public API: :func:`train_subword_model`, :class:`SubwordModel`, :class:`WordCachedEncoder`,
:class:`VocabSizeError`.
"""

from __future__ import annotations

import io
import itertools
import os
import re
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import sentencepiece as spm

from admin_ds import files

__all__ = [
    "BOS", "PAD", "EOS", "UNK",
    "BOS_PIECE", "PAD_PIECE", "EOS_PIECE", "UNK_PIECE",
    "SPECIAL_PIECES",
    "VocabSizeError",
    "train_subword_model",
    "SubwordModel",
    "WordCachedEncoder",
]

BOS, PAD, EOS, UNK = 0, 1, 2, 3
BOS_PIECE, PAD_PIECE, EOS_PIECE, UNK_PIECE = "<s>", "<pad>", "</s>", "<unk>"
SPECIAL_PIECES: dict[int, str] = {BOS: BOS_PIECE, PAD: PAD_PIECE, EOS: EOS_PIECE, UNK: UNK_PIECE}

MODEL_TYPES = ("unigram", "bpe")

# SentencePiece reports vocabulary-size problems only as text inside a RuntimeError.
_TOO_HIGH = re.compile(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)")
_TOO_LOW = re.compile(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)")


class VocabSizeError(ValueError):
    """The requested vocabulary size cannot be met on this corpus.

    ``suggested`` is the largest (too high) or smallest (too low) size SentencePiece
    would accept, when it said so.
    """

    def __init__(self, message: str, suggested: int | None = None) -> None:
        super().__init__(message)
        self.suggested = suggested


def _default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))  # respects taskset/cgroup CPU limits
    except AttributeError:  # not available on macOS
        return os.cpu_count() or 1


def train_subword_model(
    input_files: Sequence[str | os.PathLike],
    model_prefix: str | os.PathLike,
    vocab_size: int,
    model_type: str = "unigram",
    character_coverage: float = 1.0,
    input_sentence_size: int = 10_000_000,
    user_defined_symbols: Iterable[str] = (),
    seed: int | None = None,
    num_threads: int | None = None,
    normalization_rule_name: str = "nmt_nfkc",
    verbose: bool = False,
) -> Path:
    """Train a joint SentencePiece model on the concatenation of ``input_files``.

    Writes ``{model_prefix}.model`` and ``{model_prefix}.vocab`` atomically and returns
    the path of the ``.model`` file.

    Args:
        input_files: Plain-text files, one sentence per line (typically the source and
            target sides of the training set).
        model_prefix: Output path without extension; parent directories are created.
        vocab_size: Exact vocabulary size, specials and ``user_defined_symbols``
            included.  It is a hard limit (a model of a different size would silently
            break configs that size embeddings from it); when the corpus cannot support
            it a :class:`VocabSizeError` says which size would work.
        model_type: ``"unigram"`` or ``"bpe"``.
        character_coverage: Fraction of characters covered by the alphabet; 1.0 suits
            languages with small alphabets, ~0.9995 is usual for CJK.
        input_sentence_size: At most this many sentences are used; for bigger inputs
            SentencePiece samples them uniformly (``shuffle_input_sentence``), which keeps
            memory and time bounded on large corpora.
        user_defined_symbols: Strings that are always a single piece, given ids 4, 5, ...
            in order (e.g. ``["<BT>"]``).
        seed: Seed for SentencePiece's sampling; set it for reproducible models.  Note
            that it sets a process-wide SentencePiece seed.
        num_threads: Trainer threads (default: the CPUs available to this process).
        normalization_rule_name: SentencePiece normaliser; ``"nmt_nfkc"`` (the default)
            is standard for MT, ``"identity"`` guarantees byte-exact round trips.
        verbose: Show SentencePiece's progress log (otherwise warnings and errors only).

    Raises:
        FileNotFoundError: an input file is missing.
        ValueError: bad arguments; :class:`VocabSizeError` for an unattainable size.
    """
    inputs, symbols = _checked_training_args(input_files, vocab_size, model_type, user_defined_symbols)
    final_prefix = Path(model_prefix)
    final_prefix.parent.mkdir(parents=True, exist_ok=True)
    if seed is not None:
        spm.set_random_generator_seed(seed)

    # Train in memory (``model_writer``) rather than into ``model_prefix``: SentencePiece
    # would record the output path in the model, so identical training runs written to
    # different (e.g. temporary) paths would get different bytes and sha256s.  We then
    # write the files ourselves, atomically.
    proto = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            input=[str(f) for f in inputs],
            model_writer=proto,
            vocab_size=vocab_size,
            model_type=model_type,
            character_coverage=character_coverage,
            input_sentence_size=input_sentence_size,
            shuffle_input_sentence=True,
            normalization_rule_name=normalization_rule_name,
            bos_id=BOS, pad_id=PAD, eos_id=EOS, unk_id=UNK,
            bos_piece=BOS_PIECE, pad_piece=PAD_PIECE, eos_piece=EOS_PIECE, unk_piece=UNK_PIECE,
            user_defined_symbols=symbols,
            hard_vocab_limit=True,
            num_threads=num_threads or _default_threads(),
            minloglevel=0 if verbose else 1,
        )
    except RuntimeError as e:
        raise _explain_training_error(e, vocab_size, inputs) from e
    return _write_model(final_prefix, proto.getvalue())


def _checked_training_args(input_files, vocab_size: int, model_type: str,
                           user_defined_symbols: Iterable[str]) -> tuple[list[Path], list[str]]:
    """The input paths and user-defined symbols of ``train_subword_model``, refused as it says."""
    if isinstance(input_files, (str, os.PathLike)):
        input_files = [input_files]  # a lone path, not an iterable of characters
    inputs = [Path(f) for f in input_files]
    if not inputs:
        raise ValueError("input_files is empty")
    for f in inputs:
        if not f.is_file():
            raise FileNotFoundError(f"subword training input not found: {f}")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type must be one of {MODEL_TYPES}, got {model_type!r}")
    symbols = list(user_defined_symbols)
    clashes = set(symbols) & set(SPECIAL_PIECES.values())
    if clashes or len(set(symbols)) != len(symbols) or any(not s for s in symbols):
        raise ValueError(f"user_defined_symbols must be distinct, non-empty and not "
                         f"specials {sorted(SPECIAL_PIECES.values())}: {symbols}")
    min_size = len(SPECIAL_PIECES) + len(symbols) + 1
    if vocab_size < min_size:
        raise VocabSizeError(f"vocab_size={vocab_size} cannot even hold the {min_size - 1} "
                             f"special and user-defined symbols", suggested=None)
    return inputs, symbols


def _write_model(final_prefix: Path, model_bytes: bytes) -> Path:
    """``{prefix}.vocab`` (the same "piece<TAB>score" listing SentencePiece writes, for humans
    and tools), then ``{prefix}.model``, each atomically; returns the .model path."""
    sp = spm.SentencePieceProcessor(model_proto=model_bytes)
    vocab_text = "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in range(sp.get_piece_size()))

    # .vocab first: once the .model (the file consumers look for) exists, both are
    # complete.  (String concatenation, not with_suffix: "spm.joint" contains a dot.)
    model_path = Path(f"{final_prefix}.model")
    files.write_bytes(f"{final_prefix}.vocab", vocab_text.encode("utf-8"))
    files.write_bytes(model_path, model_bytes)
    return model_path


def _explain_training_error(err: RuntimeError, vocab_size: int, inputs: list[Path]) -> Exception:
    """Turn SentencePiece's terse vocabulary-size failures into actionable errors."""
    msg = str(err)
    corpus = ", ".join(str(f) for f in inputs)
    if m := _TOO_HIGH.search(msg):
        limit = int(m.group(2))
        return VocabSizeError(
            f"vocab_size={vocab_size} is too large for the training text ({corpus}): "
            f"it only supports up to {limit} pieces. Use a smaller vocab_size "
            f"(<= {limit}) or train on more text.", suggested=limit)
    if m := _TOO_LOW.search(msg):
        needed = int(m.group(2))
        return VocabSizeError(
            f"vocab_size={vocab_size} is smaller than the {needed} characters and specials "
            f"the model must contain ({corpus}). Use vocab_size >= {needed}, or lower "
            f"character_coverage.", suggested=needed)
    return err


class SubwordModel:
    """A trained SentencePiece model with fairseq special ids, for batched encode/decode.

    ``SubwordModel(path)`` validates the special-id layout and raises ``ValueError``
    naming the file when it is not the fairseq one.  :attr:`sha256` identifies the
    exact model bytes (e.g. to check a checkpoint and a binarised dataset agree).
    """

    def __init__(self, path: str | os.PathLike, num_threads: int = -1) -> None:
        """``num_threads``: threads for batched encode/decode (-1: SentencePiece picks)."""
        self.path = Path(path)
        # Load from the same bytes we hash, so the hash is the hash of what is loaded
        # even if the file is replaced concurrently.
        data = self.path.read_bytes()
        self.sha256: str = files.sha256_bytes(data)
        self.num_threads = num_threads
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(data)
        except RuntimeError as e:
            raise ValueError(f"{self.path}: not a valid SentencePiece model ({e})") from e
        self._check_specials()
        self._drop = frozenset({BOS, PAD})
        self.model_type: str = _model_type(data)

    def _check_specials(self) -> None:
        sp = self._sp
        actual = {"bos": sp.bos_id(), "pad": sp.pad_id(), "eos": sp.eos_id(), "unk": sp.unk_id()}
        expected = {"bos": BOS, "pad": PAD, "eos": EOS, "unk": UNK}
        pieces_ok = all(0 <= i < sp.get_piece_size() and sp.id_to_piece(i) == p
                        for i, p in SPECIAL_PIECES.items())
        if actual != expected or not pieces_ok:
            found = {i: sp.id_to_piece(i) for i in range(min(4, sp.get_piece_size()))}
            raise ValueError(
                f"{self.path}: special ids {actual} (pieces {found}) are not the fairseq "
                f"layout {expected} / {SPECIAL_PIECES}; retrain it with train_subword_model")

    # -- properties ---------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def __len__(self) -> int:
        return self.vocab_size

    bos_id = property(lambda self: BOS, doc="Id of ``<s>`` (0).")
    pad_id = property(lambda self: PAD, doc="Id of ``<pad>`` (1).")
    eos_id = property(lambda self: EOS, doc="Id of ``</s>`` (2).")
    unk_id = property(lambda self: UNK, doc="Id of ``<unk>`` (3).")

    def piece(self, id: int) -> str:
        """The piece string for ``id``."""
        self._check_range(id)
        return self._sp.id_to_piece(id)

    def id_of(self, piece: str) -> int:
        """The id of ``piece``; ``KeyError`` if it is not in the vocabulary.

        (SentencePiece itself returns the UNK id for unknown pieces, which would make a
        typo such as ``id_of("<bt>")`` look like a valid lookup.)
        """
        i = self._sp.piece_to_id(piece)
        if i == UNK and piece != UNK_PIECE:
            raise KeyError(f"piece {piece!r} not in {self.path}")
        return i

    # -- encode / decode ----------------------------------------------------------------

    def encode(self, lines: Sequence[str], add_eos: bool = False) -> list[list[int]]:
        """Encode a batch of lines to ids (no BOS; EOS appended only if ``add_eos``)."""
        if isinstance(lines, str):
            # A bare string would be encoded as one sentence with a different return
            # shape; make the mistake loud instead.
            raise TypeError("encode() takes a list of lines, not a str")
        lines = list(lines)
        if not lines:
            return []
        return self._sp.encode(lines, out_type=int, add_eos=add_eos, num_threads=self.num_threads)

    def decode(self, ids_lists: Iterable[Iterable[int]]) -> list[str]:
        """Decode a batch of id sequences to text.

        Each sequence is cut at its first EOS (what follows is padding or garbage from a
        batched decoder); BOS and PAD are dropped.  UNK is kept and rendered as
        SentencePiece's `` ⁇ `` so that coverage problems stay visible in the output.
        Accepts lists, tuples, numpy arrays or 1-d tensors.
        """
        cleaned: list[list[int]] = []
        size, drop = self.vocab_size, self._drop
        for ids in ids_lists:
            out = []
            for i in ids:
                i = int(i)
                if i == EOS:
                    break
                if i in drop:
                    continue
                if not 0 <= i < size:
                    raise ValueError(f"id {i} out of range for vocabulary of size {size}")
                out.append(i)
            cleaned.append(out)
        if not cleaned:
            return []
        return self._sp.decode(cleaned, num_threads=self.num_threads)

    def _check_range(self, id: int) -> None:
        if not 0 <= id < self.vocab_size:
            raise IndexError(f"id {id} out of range for vocabulary of size {self.vocab_size}")

    def __repr__(self) -> str:
        return f"SubwordModel({str(self.path)!r}, vocab_size={self.vocab_size}, sha256={self.sha256[:12]})"


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if byte < 0x80:
            return value, pos


def _fields(data: bytes):
    """(field number, value) of a protobuf message: ints for varints, bytes for the rest."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        kind = key & 7
        if kind == 0:
            value, pos = _varint(data, pos)
        elif kind == 2:
            size, pos = _varint(data, pos)
            value, pos = data[pos:pos + size], pos + size
        elif kind in (1, 5):
            value, pos = data[pos:pos + (8 if kind == 1 else 4)], pos + (8 if kind == 1 else 4)
        else:
            raise ValueError(f"unsupported protobuf wire type {kind}")
        yield key >> 3, value


def _model_type(proto: bytes) -> str:
    """The algorithm a SentencePiece model was trained with: ModelProto.trainer_spec (field 2)
    .model_type (field 3; UNIGRAM = 1, the default when absent). Read from the bytes, as
    SentencePiece's Python API does not expose it and its protobuf module needs another package."""
    names = {1: "unigram", 2: "bpe", 3: "word", 4: "char"}
    try:
        for number, value in _fields(proto):
            if number == 2:
                return names.get(dict(_fields(value)).get(3, 1), "unknown")
    except (ValueError, IndexError):  # not readable here: then nothing relies on the type
        return "unknown"
    return "unigram"


class WordCachedEncoder:
    """``SubwordModel.encode`` for text encoded by the million (data preparation), with each
    distinct word encoded once: the ids of a line are the concatenation of its words' ids.

    Why that is exact, for BPE models. SentencePiece turns the spaces of a line into "▁" and
    segments the result; when no piece of the vocabulary holds "▁" anywhere but at its start, no
    piece can span the start of a word, and BPE's merges (only ever into vocabulary pieces, the
    best-scored pair first, ties to the left) inside one word do not interact with another's, so
    each "▁word" is segmented as it would be alone. Not for unigram models: their best path is a
    running sum of float scores from the start of the line, and rounding breaks ties between
    equal-scored segmentations ("▁15" "0" "00" against "▁15" "00" "0") differently after
    different prefixes; those are always encoded whole (:attr:`exact` False). The normaliser is
    the other place where context could matter, so a word is only taken from the cache when
    normalising it alone changes nothing but the "▁" in front (``normalize(w) == "▁" + w``; under
    nmt_nfkc, words such as "ﬁne" or "½" are not); a line with any other word, an empty line, or
    spaces that are not single separators is encoded whole by SentencePiece. A model that is not
    BPE, or breaks the vocabulary or the "▁a▁b" condition, is never cached at all.
    ``tests/test_data_prep.py`` checks the output against SentencePiece's on real text and on
    lines built to break it, and that a unigram model and one whose pieces span words are refused.

    Per line that replaces SentencePiece's work (~10 us for a 15-word news sentence) by a few
    dictionary lookups per word; new words are encoded in one batched call. The cache holds at
    most ``max_words`` words (emptied when full), so memory stays bounded on any corpus.

    Encoders of the same model in several processes can share what they learn: :meth:`learned`
    gives the words learned since its last call, :meth:`add` takes them in another encoder
    (~0.3 us a word against ~3 us to learn one).
    """

    _NEWLINE, _WHOLE_LINE = 0, 1  # codes of the "\n" token and of words that force the line whole

    def __init__(self, model: SubwordModel, max_words: int = 1 << 20):
        self.model, self.max_words = model, max_words
        sp = model._sp
        self.exact = (model.model_type == "bpe" and sp.normalize("a b") == "\u2581a\u2581b"
                      and not any("\u2581" in sp.id_to_piece(i)[1:] for i in range(sp.get_piece_size())))
        self._new: list[str] | None = None  # words learned since the last learned(), once it was called
        self._clear()

    def _clear(self) -> None:
        self._code = {"\n": self._NEWLINE, "": self._WHOLE_LINE}  # word -> code
        self._start = np.zeros(2, np.int64)  # code -> first id in self._ids
        self._length = np.zeros(2, np.int64)  # code -> number of ids
        self._ids = np.zeros(0, np.int64)
        if self._new is not None:
            self._new = []

    def _learn(self, words: list[str]) -> None:
        """Give each new word a code; plain ones get their ids, the others code _WHOLE_LINE."""
        sp = self.model._sp
        plain = [w for w, n in zip(words, sp.normalize(words)) if n == "\u2581" + w]
        if self._new is not None:
            self._new += words
        for w in words:
            self._code[w] = self._WHOLE_LINE
        if plain:
            encoded = self.model.encode(plain)
            lengths = np.fromiter(map(len, encoded), np.int64, len(encoded))
            self._append(plain, lengths, np.fromiter(itertools.chain.from_iterable(encoded), np.int64,
                                                     int(lengths.sum())))

    def _append(self, words: list[str], lengths: np.ndarray, ids: np.ndarray) -> None:
        """Codes for ``words``, whose ids are ``ids`` in runs of ``lengths``."""
        first = len(self._start)
        self._start = np.concatenate([self._start, self._ids.size + np.cumsum(lengths) - lengths])
        self._length = np.concatenate([self._length, lengths])
        self._ids = np.concatenate([self._ids, ids])
        self._code.update(zip(words, range(first, first + len(words))))

    def learned(self) -> tuple[list[str], np.ndarray, np.ndarray]:
        """The words this encoder learned since the last call, for :meth:`add`: ``(words,
        lengths, ids)``, the ids of ``words[i]`` being the next ``lengths[i]`` of ``ids``; length
        -1 for a word whose lines are encoded whole. The first call starts the record (an encoder
        that never shares keeps none)."""
        words, self._new = self._new or [], []
        codes = np.fromiter(map(self._code.__getitem__, words), np.int64, len(words))
        plain = codes != self._WHOLE_LINE
        lengths = np.where(plain, self._length[codes], -1)
        return words, lengths, self._gather(codes[plain])

    def _gather(self, codes: np.ndarray) -> np.ndarray:
        """The ids of the words with these codes, one after another."""
        lengths = self._length[codes]
        ends = np.cumsum(lengths)
        return self._ids[np.arange(int(ends[-1]) if ends.size else 0)
                         + np.repeat(self._start[codes] - (ends - lengths), lengths)]

    def add(self, words: list[str], lengths: np.ndarray, ids: np.ndarray) -> None:
        """Take what :meth:`learned` gave in an encoder of the same model (and therefore the same
        ids); words already known are skipped, and nothing is taken into a cache that would
        overflow."""
        if not self.exact or len(self._code) + len(words) > self.max_words:
            return
        lengths = np.asarray(lengths, np.int64)
        starts = np.cumsum(np.maximum(lengths, 0)) - np.maximum(lengths, 0)
        new = np.fromiter((w not in self._code for w in words), bool, len(words))
        plain = np.flatnonzero(new & (lengths >= 0))
        for i in np.flatnonzero(new & (lengths < 0)).tolist():
            self._code[words[i]] = self._WHOLE_LINE
        if plain.size:
            run = lengths[plain]
            ends = np.cumsum(run)
            taken = np.asarray(ids, np.int64)[np.arange(int(ends[-1])) + np.repeat(starts[plain] - (ends - run), run)]
            self._append([words[i] for i in plain.tolist()], run, taken)

    def encode_text(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """Lines each ended by "\\n" (a text file's contents) -> (all ids in one int64 array, the
        number of ids of each line): the same ids as ``model.encode(text.split("\\n")[:-1])``."""
        if text and not text.endswith("\n"):
            raise ValueError("encode_text takes lines each ended by a newline")
        if not self.exact:
            encoded = self.model.encode(text.split("\n")[:-1])
            lengths = np.fromiter(map(len, encoded), np.int64, len(encoded))
            return np.fromiter(itertools.chain.from_iterable(encoded), np.int64, int(lengths.sum())), lengths
        words = text.replace("\n", " \n ").split(" ")
        words.pop()  # the "" after the last newline
        codes = np.fromiter(map(self._code.get, words, itertools.repeat(-1)), np.int64, len(words))
        if (missing := np.flatnonzero(codes < 0)).size:
            new = list(dict.fromkeys(words[i] for i in missing))
            if len(self._code) + len(new) <= self.max_words:
                self._learn(new)
                codes[missing] = [self._code[words[i]] for i in missing]
            else:  # full: start again from this text's words
                self._clear()
                self._learn([w for w in dict.fromkeys(words) if w not in self._code])
                codes = np.fromiter(map(self._code.__getitem__, words), np.int64, len(words))
        ends = np.cumsum(self._length[codes])
        newline = np.flatnonzero(codes == self._NEWLINE)
        line_lengths = np.diff(ends[newline], prepend=0)
        ids = self._gather(codes)
        whole = np.flatnonzero(codes == self._WHOLE_LINE)
        if whole.size:
            ids, line_lengths = self._splice(text, ids, line_lengths, np.searchsorted(newline, whole))
        return ids, line_lengths

    def _splice(self, text: str, ids: np.ndarray, line_lengths: np.ndarray, lines: np.ndarray):
        """Replace the ids of ``lines`` (line numbers, repeats allowed) by SentencePiece's own."""
        lines = np.unique(lines)
        all_lines = text.split("\n")
        encoded = self.model.encode([all_lines[i] for i in lines])
        bounds = np.concatenate([[0], np.cumsum(line_lengths)])
        parts, previous = [], 0
        for line, new in zip(lines.tolist(), encoded):
            parts += [ids[bounds[previous]:bounds[line]], np.asarray(new, np.int64)]
            previous = line + 1
        parts.append(ids[bounds[previous]:])
        line_lengths = line_lengths.copy()
        line_lengths[lines] = [len(new) for new in encoded]
        return np.concatenate(parts), line_lengths
