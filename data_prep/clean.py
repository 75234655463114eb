"""Cleaning as in fairseq's WMT14 recipe, and the per-chunk work done in worker processes.

fairseq's ``prepare-wmt14en2de.sh`` runs, per language, ``normalize-punctuation.perl $lang |
remove-non-printing-char.perl | tokenizer.perl`` and, after BPE, ``clean-corpus-n.perl -ratio 1.5
... 1 250``. Here SentencePiece works on detokenized text, so the Moses tokenizer is left out and
the rest becomes, for one sentence pair:

    raw bytes --decode_side--> text --normalize--> cleaned text        (clean step, before the
        utf-8, &quot; -> ", line     Moses punctuation, non-printing  subword model exists)
        breaks -> space              chars -> space, spaces squeezed
    cleaned text --SentencePiece--> ids --length 1..250, ratio 1.5--> kept  (binarize step)

Drops, each counted under its name, in this order (a pair counts under the first that removes
it): ``invalid_utf8``, ``empty`` (a side empty or whitespace-only after normalisation),
``duplicate`` (the exact normalised pair seen before), ``too_short`` / ``too_long`` (a side
outside ``min_len..max_len`` subwords), ``ratio`` (one side more than ``ratio`` times longer than
the other, in subwords: clean-corpus-n's rule). Lines longer than ``--max-line-bytes`` and
malformed TSV lines are dropped while reading (:mod:`data_prep.sources`).
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
from sacremoses import MosesPunctNormalizer

# ---- reading one side ------------------------------------------------------------------------

# The five XML entities and numeric references: WMT's SGML files escape text this way, and so do
# some plain-text corpora (News Commentary's ``&quot;``). Deliberately not html.unescape, which
# would also turn "&copy" or "&para" (no semicolon) inside ordinary text into symbols.
_ENTITY = re.compile(r"&(?:(quot|amp|lt|gt|apos)|#([0-9]{1,7})|#[xX]([0-9a-fA-F]{1,6}));")
_NAMED = {"quot": '"', "amp": "&", "lt": "<", "gt": ">", "apos": "'"}

# Every character that Python's str.splitlines() treats as a line end. They are replaced by a space
# so that each written line is one segment for any reader (train.py splits the eval text with
# splitlines(), SentencePiece splits on \n only); a \r left over from CRLF line ends is stripped
# before this by the readers.
_LINE_BREAKS = re.compile("[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]")


def _entity(m: re.Match) -> str:
    if m.group(1):
        return _NAMED[m.group(1)]
    code = int(m.group(2)) if m.group(2) else int(m.group(3), 16)
    if code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
        return m.group(0)  # not a character: keep the text as it was
    return chr(code)


def decode_side(raw: bytes | str) -> str | None:
    """One side of a pair as read (bytes from files, str from `datasets`) -> text, or None when it
    is not valid UTF-8. Entities are unescaped and line-break characters become spaces; nothing
    else changes, so this is also the "raw text" kept for the evaluation references."""
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            return None
    else:
        text = raw
    if "&" in text:
        text = _ENTITY.sub(_entity, text)
    return _LINE_BREAKS.sub(" ", text)


# ---- normalisation ---------------------------------------------------------------------------

def _required_chars(pattern: str) -> frozenset[str]:
    """Characters every match of ``pattern`` must contain: the literals of the top-level sequence
    (also inside groups and repeats of at least one). Used only to skip a substitution that
    cannot apply, so missing some required characters is safe; reporting one that is not
    required would not be, hence the conservative walk."""
    from re import _parser  # CPython's regex parser (sre_parse)

    out: set[str] = set()

    def walk(items) -> None:
        for op, av in items:
            name = str(op)
            if name == "LITERAL":
                out.add(chr(av))
            elif name == "SUBPATTERN":
                walk(av[-1])
            elif name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT") and av[0] >= 1:
                walk(av[2])
            # IN, BRANCH, AT, ANY, ...: nothing certain, nothing added

    walk(_parser.parse(pattern))
    return frozenset(out)


class PunctNormalizer:
    """sacremoses' ``MosesPunctNormalizer(lang)`` with identical output, several times faster.

    sacremoses runs ~45 ``re.sub`` calls per line (4-8k lines/s, the slowest stage of the whole
    preparation). The same substitutions run here in the same order, precompiled, and each is
    skipped when it cannot change the text: when a character that every match needs is absent
    (most rules need one of „“”–—´‘’‚…«»\\xa0), or, for the three ``" +" -> " "`` rules, when
    there is no run of two spaces. The equivalence is checked against sacremoses on real text in
    tests/test_data_prep.py.
    """

    def __init__(self, lang: str):
        moses = MosesPunctNormalizer(lang=lang)
        if moses.pre_replace_unicode_punct or moses.post_remove_control_chars:
            raise AssertionError("unexpected sacremoses defaults")  # normalize() would differ
        self.lang = lang
        self._subs = []
        for pattern, repl in moses.substitutions:
            # " +" -> " " maps every run of spaces to one space: the identity unless a run is longer
            needs_substring = "  " if (pattern, repl) == (r" +", r" ") else ""
            self._subs.append((re.compile(pattern), repl, _required_chars(pattern), needs_substring))

    def __call__(self, text: str) -> str:
        chars = set(text)
        for pattern, repl, needs, needs_substring in self._subs:
            if needs <= chars and needs_substring in text:
                new = pattern.sub(repl, text)
                if new != text:
                    text, chars = new, set(new)
        return text.strip()


class _NonPrintingTable(dict):
    """A ``str.translate`` table mapping each character of Unicode category C (Cc, Cf, Cs, Co, Cn:
    Perl's ``\\p{C}``) to a space and every other character to itself, filled in as characters
    are met (a few thousand distinct ones in practice)."""

    def __missing__(self, code: int) -> str:
        c = chr(code)
        value = self[code] = " " if unicodedata.category(c)[0] == "C" else c
        return value


_NON_PRINTING = _NonPrintingTable()


def remove_non_printing(text: str) -> str:
    """remove-non-printing-char.perl: ``s/\\p{C}/ /g`` (each such character becomes a space)."""
    if text.isprintable():  # no character of category C (isprintable is stricter still)
        return text
    return text.translate(_NON_PRINTING)


_SPACES = re.compile(r"\s+")


def normalize(text: str, punct: PunctNormalizer) -> str:
    """fairseq's order: Moses punctuation normalisation, then non-printing characters; then
    whitespace runs squeezed and stripped (SentencePiece would squeeze them anyway, and it makes
    "whitespace-only" mean "empty")."""
    text = remove_non_printing(punct(text))
    return _SPACES.sub(" ", text).strip()


# ---- deduplication ---------------------------------------------------------------------------

def pair_digest(src: str, tgt: str) -> int:
    """64-bit digest of a normalised pair. With n pairs the chance of any collision (a unique
    pair dropped as a duplicate) is about n^2 / 2^65: 4e-5 for WMT14 En-Fr's 40.8M pairs."""
    h = hashlib.blake2b(src.encode("utf-8") + b"\x00" + tgt.encode("utf-8"), digest_size=8)
    return int.from_bytes(h.digest(), "little")


class DigestSet:
    """A set of 64-bit digests in one numpy open-addressing table (linear probing).

    Memory is 8 bytes per slot at a load factor between 0.35 and 0.7, i.e. 11-23 bytes per
    distinct pair (~0.5-1 GB for WMT14 En-Fr), against ~60 bytes for a Python set of ints.
    This is the one structure of the preparation that grows with the corpus (with the
    indexed-dataset writer's 4 bytes per sentence): the exact-duplicate filter needs to remember
    every pair it has kept. Insertion is vectorised per chunk of digests.
    """

    _MAX_LOAD = 0.7

    def __init__(self, capacity: int = 1 << 16):
        self._table = np.zeros(1 << max(4, (capacity - 1).bit_length()), dtype=np.uint64)
        self._size = 0

    def __len__(self) -> int:
        return self._size

    @property
    def nbytes(self) -> int:
        return self._table.nbytes

    def add_new(self, digests: np.ndarray) -> np.ndarray:
        """Insert ``digests`` in order and return a bool mask, True where a digest was seen for
        the first time (neither in the set before nor earlier in ``digests``)."""
        keys = np.asarray(digests, dtype=np.uint64).copy()
        keys[keys == 0] = 1  # 0 marks an empty slot
        if keys.size == 0:
            return np.zeros(0, dtype=bool)
        unique, first = np.unique(keys, return_index=True)
        self._reserve(self._size + unique.size)
        fresh = self._insert(self._table, unique)
        self._size += int(fresh.sum())
        mask = np.zeros(keys.size, dtype=bool)
        mask[first[fresh]] = True
        return mask

    @staticmethod
    def _insert(table: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """Insert distinct ``keys``; return a mask of those that were absent. Each round, every
        pending key looks at its slot: its own key -> present; empty -> the first pending key
        aiming at that slot claims it; another key -> probe the next slot."""
        mask = np.uint64(table.size - 1)
        pos = keys & mask  # digests are uniform: their low bits are a good slot number
        fresh = np.zeros(keys.size, dtype=bool)
        todo = np.arange(keys.size)
        while todo.size:
            slot = table[pos[todo]]
            found = slot == keys[todo]
            empty = slot == 0
            done = found.copy()
            empty_at = np.flatnonzero(empty)
            if empty_at.size:
                _, first = np.unique(pos[todo[empty_at]], return_index=True)
                winners = todo[empty_at[first]]
                table[pos[winners]] = keys[winners]
                fresh[winners] = True
                done[empty_at[first]] = True
            move = todo[~found & ~empty]
            pos[move] = (pos[move] + np.uint64(1)) & mask
            todo = todo[~done]
        return fresh

    def _reserve(self, n: int) -> None:
        if n <= self._MAX_LOAD * self._table.size:
            return
        size = self._table.size
        while n > self._MAX_LOAD / 2 * size:
            size *= 2
        old = self._table[self._table != 0]
        self._table = np.zeros(size, dtype=np.uint64)
        self._insert(self._table, old)


# ---- worker side: clean step ------------------------------------------------------------------

@dataclass
class CleanedChunk:
    """What a worker returns for one chunk of raw pairs: the surviving normalised pairs in input
    order, their digests (deduplication happens in the main process, which sees every chunk), and
    the pairs it dropped."""
    src: list[str]
    tgt: list[str]
    digests: np.ndarray
    dropped: dict[str, int] = field(default_factory=dict)


_clean_state: dict = {}


def init_clean_worker(src_lang: str, tgt_lang: str) -> None:
    _clean_state["punct"] = (PunctNormalizer(src_lang), PunctNormalizer(tgt_lang))


def clean_chunk(pairs: list[tuple[bytes | str, bytes | str]]) -> CleanedChunk:
    punct_src, punct_tgt = _clean_state["punct"]
    out = CleanedChunk([], [], np.empty(0, np.uint64), {"invalid_utf8": 0, "empty": 0})
    digests = []
    for raw_src, raw_tgt in pairs:
        src, tgt = decode_side(raw_src), decode_side(raw_tgt)
        if src is None or tgt is None:
            out.dropped["invalid_utf8"] += 1
            continue
        src, tgt = normalize(src, punct_src), normalize(tgt, punct_tgt)
        if not src or not tgt:
            out.dropped["empty"] += 1
            continue
        out.src.append(src)
        out.tgt.append(tgt)
        digests.append(pair_digest(src, tgt))
    out.digests = np.array(digests, dtype=np.uint64)
    return out


# ---- worker side: binarize step ---------------------------------------------------------------

@dataclass
class EncodedChunk:
    """The kept pairs of one chunk as two flat id arrays with per-sentence lengths (compact to
    send between processes), plus the pairs the length filters dropped."""
    src_ids: np.ndarray
    src_lens: np.ndarray
    tgt_ids: np.ndarray
    tgt_lens: np.ndarray
    dropped: dict[str, int]


_encode_state: dict = {}


def init_encode_worker(spm_path: str, min_len: int, max_len: int, ratio: float) -> None:
    from admin_ds.data.subword import SubwordModel

    sp = SubwordModel(spm_path, num_threads=1)  # one process per core already
    _encode_state.update(sp=sp, min_len=min_len, max_len=max_len, ratio=ratio,
                         dtype=np.uint16 if sp.vocab_size <= 1 << 16 else np.int32)


def length_filter(n_src: int, n_tgt: int, min_len: int, max_len: int, ratio: float) -> str | None:
    """clean-corpus-n.perl's rule on subword counts: the name of the filter that drops the pair,
    or None to keep it."""
    if n_src < min_len or n_tgt < min_len:
        return "too_short"
    if n_src > max_len or n_tgt > max_len:
        return "too_long"
    if n_src > ratio * n_tgt or n_tgt > ratio * n_src:
        return "ratio"
    return None


def encode_chunk(pairs: list[tuple[bytes, bytes]]) -> EncodedChunk:
    st = _encode_state
    src = st["sp"].encode([s.decode("utf-8") for s, _ in pairs])
    tgt = st["sp"].encode([t.decode("utf-8") for _, t in pairs])
    dropped = {"too_short": 0, "too_long": 0, "ratio": 0}
    keep_src, keep_tgt = [], []
    for s, t in zip(src, tgt):
        reason = length_filter(len(s), len(t), st["min_len"], st["max_len"], st["ratio"])
        if reason:
            dropped[reason] += 1
        else:
            keep_src.append(s)
            keep_tgt.append(t)
    return EncodedChunk(*_flatten(keep_src, st["dtype"]), *_flatten(keep_tgt, st["dtype"]), dropped)


def _flatten(seqs: list[list[int]], dtype) -> tuple[np.ndarray, np.ndarray]:
    lens = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
    flat = np.fromiter(chain.from_iterable(seqs), dtype=dtype, count=int(lens.sum()))
    return flat, lens
