"""Cleaning as in fairseq's WMT14 recipe: one sentence pair at a time (the shards that workers
process are :mod:`data_prep.shards`).

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

import numpy as np

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
    if text.isprintable():  # every line-break character is a non-printable one
        return text
    return _LINE_BREAKS.sub(" ", text)


# ---- normalisation ---------------------------------------------------------------------------

def _required(pattern: str) -> tuple[frozenset[str], str]:
    """What every match of ``pattern`` must contain: the literal characters of its top-level
    sequence (also inside groups and repeats of at least one), and the longest run of adjacent
    top-level literals as a substring. Used only to skip a substitution that cannot apply, so
    missing something required is safe; reporting what is not required would not be, hence the
    conservative walk."""
    from re import _parser  # CPython's regex parser (sre_parse)

    chars: set[str] = set()

    def walk(items) -> None:
        for op, av in items:
            name = str(op)
            if name == "LITERAL":
                chars.add(chr(av))
            elif name == "SUBPATTERN":
                walk(av[-1])
            elif name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT") and av[0] >= 1:
                walk(av[2])
            # IN, BRANCH, AT, ANY, ...: nothing certain, nothing added

    def edges(op, av) -> tuple[str, str, bool]:
        """The first and last character of every match of one item ("" if not fixed), and
        whether the item is exactly that one character."""
        name = str(op)
        if name == "LITERAL":
            return chr(av), chr(av), True
        body = (av[-1] if name == "SUBPATTERN" else
                av[2] if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT") and av[0] >= 1 else None)
        if body is not None and len(body) == 1:
            first, last, exact = edges(*body[0])
            return first, last, exact and name == "SUBPATTERN"
        return "", "", False

    items = list(_parser.parse(pattern))
    walk(items)
    # Runs of adjacent characters every match holds: literals, extended by the fixed first and
    # last characters of the neighbouring items (r'(\.+)"' -> '."').
    runs, run = [], ""
    for op, av in items:
        first, last, exact = edges(op, av)
        if exact:
            run += first
        else:
            runs.append(run + first)
            run = last
    runs.append(run)
    return frozenset(chars), max(runs, key=len, default="")


class PunctNormalizer:
    """sacremoses' ``MosesPunctNormalizer(lang)`` with identical output, several times faster.

    sacremoses runs ~45 ``re.sub`` calls per line (4-8k lines/s, the slowest stage of the whole
    preparation); a line needs ~0.3 of them on average. The same substitutions run here in the
    same order, precompiled, and each is skipped when it cannot change the text:

    - which rules can apply at all is decided once per set of *key characters* present in the
      line and cached (a few hundred sets cover a corpus). A rule's key character is one that
      every match needs and that is not an ASCII letter, digit or space (most rules need one of
      „“”–—´‘’‚…«»\\xa0); a rule whose key character is neither in the line nor written by an
      earlier rule's replacement cannot match;
    - a remaining rule runs only when the line holds the longest literal substring every match
      needs (``" :"``, ``"''"``, ...); for the three ``" +" -> " "`` rules that is a run of two
      spaces, since they are the identity otherwise;
    - a line with no key character and no two spaces in a row (most lines) is returned at once:
      every rule needs one or the other, and the first rule to change a line needs it there.

    The equivalence is checked against sacremoses on real text in tests/test_data_prep.py.
    """

    def __init__(self, lang: str):
        from sacremoses import MosesPunctNormalizer  # (here: a worker given a built one skips the ~0.2 s import)

        moses = MosesPunctNormalizer(lang=lang)
        if moses.pre_replace_unicode_punct or moses.post_remove_control_chars:
            raise AssertionError("unexpected sacremoses defaults")  # normalize() would differ
        self.lang = lang
        self._subs = []  # (compiled pattern, replacement, key character or "", required substring)
        for pattern, repl in moses.substitutions:
            needs, run = _required(pattern)
            if (pattern, repl) == (r" +", r" "):
                run = "  "
            keys = sorted((c for c in needs if not (c == " " or c.isascii() and c.isalnum())),
                          key=lambda c: (c.isascii(), c))  # non-ASCII first: the rarest
            self._subs.append((re.compile(pattern), repl, keys[0] if keys else "", run))
        self._key_chars = re.compile("[" + re.escape("".join(sorted({k for _, _, k, _ in self._subs if k}))) + "]")
        self._rules_for: dict[frozenset, list] = {}
        self._block_rules = [_block_rule(pattern, repl, key, run) for pattern, repl, key, run in self._subs]

    def _rules(self, present: frozenset) -> list:
        rules, possible = [], set(present)
        for pattern, repl, key, run in self._subs:
            if not key or key in possible:
                rules.append((pattern, repl, run))
                possible |= _literal_chars(repl)
        return rules

    def __call__(self, text: str) -> str:
        if "  " not in text and not self._key_chars.search(text):
            return text.strip()  # most lines: no rule can change them (see above)
        present = frozenset(self._key_chars.findall(text))
        rules = self._rules_for.get(present)
        if rules is None:
            rules = self._rules_for[present] = self._rules(present)
        for pattern, repl, run in rules:
            if run in text:
                text = pattern.sub(repl, text)
        return text.strip()

    def lines(self, lines: list[str]) -> list[str]:
        """``[self(line) for line in lines]`` for lines without a "\\n", the rules applied to all of
        them at once: 1.5-2.5x faster on real text, where most lines hold some rule's key character.
        Each rule runs once over the lines joined by "\\n": a literal one as ``str.replace``; a
        regular expression that cannot match a "\\n" and starts with a literal as one ``re.sub``
        (both act within lines only, so the result is each line's own); any other only on the
        lines holding its required substring, one at a time. tests/test_data_prep.py checks the
        equivalence on real text and on lines built for it."""
        text = "\n".join(lines)
        present = set(self._key_chars.findall(text))  # one scan, instead of one per rule
        single = False  # True while no two spaces in a row can be in the text
        for kind, pattern, repl, key, run in self._block_rules:
            if key and key not in present or kind == "spaces" and single or run not in text:
                continue
            if kind == "literal":
                text = text.replace(run, repl)
            elif kind == "spaces":
                while "  " in text:
                    text = text.replace("  ", " ")
            elif kind == "block":
                text = pattern.sub(repl, text)
            else:
                text = _sub_lines(pattern, repl, text, run)
            present.update(_literal_chars(repl))
            # Replacing a string by a non-empty one without spaces cannot put two spaces together
            # (there were none): only then does a later " +" rule stay unnecessary.
            single = kind == "spaces" or single and kind == "literal" and repl != "" and " " not in repl
        return [line.strip() for line in text.split("\n")]


def _block_rule(pattern: re.Pattern, repl: str, key: str, run: str) -> tuple:
    """How :meth:`PunctNormalizer.lines` applies one rule: ("literal", ...) when the pattern is a
    plain string and the replacement too; ("spaces", ...) for " +" -> " "; ("block", ...) for a
    pattern that matches within lines only and starts with a literal (re's fast prefix search);
    ("lines", ...) otherwise."""
    from re import _parser

    parsed = _parser.parse(pattern.pattern, pattern.flags)
    ops = [(str(op), av) for op, av in parsed]
    if "\n" in repl:
        raise AssertionError(f"a replacement with a newline cannot be applied to joined lines: {repl!r}")
    if all(op == "LITERAL" for op, _ in ops) and "\\" not in repl:
        return "literal", None, repl, key, "".join(chr(av) for _, av in ops)
    if pattern.pattern == " +" and repl == " ":
        return "spaces", None, repl, key, "  "
    if ops and ops[0][0] == "LITERAL" and parsed.getwidth()[0] > 0 and _within_lines(parsed, pattern.flags):
        return "block", pattern, repl, key, run
    return "lines", pattern, repl, key, run


def _within_lines(items, flags: int) -> bool:
    """Whether no match of the parsed pattern can contain or look past a "\\n" (conservative:
    anything not understood here counts as crossing)."""
    newline = ord("\n")
    for op, av in items:
        op = str(op)
        if op == "LITERAL":
            ok = av != newline
        elif op == "ANY":
            ok = not flags & re.DOTALL
        elif op == "IN":
            ok = all(str(o) == "LITERAL" and a != newline
                     or str(o) == "RANGE" and not a[0] <= newline <= a[1]
                     or str(o) == "CATEGORY" and str(a) in ("CATEGORY_DIGIT", "CATEGORY_WORD", "CATEGORY_NOT_SPACE")
                     for o, a in av)
        elif op in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            ok = _within_lines(av[2], flags)
        elif op == "SUBPATTERN":
            ok = _within_lines(av[-1], flags)
        elif op == "BRANCH":
            ok = all(_within_lines(branch, flags) for branch in av[1])
        elif op == "AT":
            ok = str(av) in ("AT_BOUNDARY", "AT_NON_BOUNDARY")  # a newline is a non-word character
        else:
            ok = op == "GROUPREF"  # repeats text already matched, within the line
        if not ok:
            return False
    return True


def _sub_lines(pattern: re.Pattern, repl: str, text: str, run: str) -> str:
    """``pattern.sub(repl, line)`` for each "\\n"-separated line of ``text`` that holds ``run``."""
    out, last, pos = [], 0, text.find(run)
    while pos >= 0:
        start, end = text.rfind("\n", 0, pos) + 1, text.find("\n", pos)
        end = len(text) if end < 0 else end
        out += [text[last:start], pattern.sub(repl, text[start:end])]
        last, pos = end, text.find(run, end)
    out.append(text[last:])
    return "".join(out)


def _literal_chars(repl: str) -> set[str]:
    """The characters a replacement string writes itself (group references copy text that was
    already there)."""
    return set(re.sub(r"\\g<\w+>|\\\d+", "", repl))


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


def normalize(text: str, punct: PunctNormalizer) -> str:
    """fairseq's order: Moses punctuation normalisation, then non-printing characters; then
    whitespace runs squeezed and stripped (SentencePiece would squeeze them anyway, and it makes
    "whitespace-only" mean "empty"). ``str.split()`` splits on exactly the characters of the
    regular expression ``\\s`` (both use Python's Unicode whitespace test), at a fraction of its cost."""
    return " ".join(remove_non_printing(punct(text)).split())


def normalize_lines(lines: list[str], punct: PunctNormalizer) -> list[str]:
    """``[normalize(line, punct) for line in lines]``, with the punctuation rules applied to all
    lines at once (:meth:`PunctNormalizer.lines`); the lines hold no "\\n" (decode_side's output)."""
    return [" ".join(remove_non_printing(line).split()) for line in punct.lines(lines)]


# ---- deduplication and length filter ---------------------------------------------------------

def pair_digest(src: bytes, tgt: bytes) -> int:
    """64-bit digest of a normalised pair (UTF-8). With n pairs the chance of any collision (a
    unique pair dropped as a duplicate) is about n^2 / 2^65: 4e-5 for WMT14 En-Fr's 40.8M pairs."""
    h = hashlib.blake2b(src + b"\x00" + tgt, digest_size=8)
    return int.from_bytes(h.digest(), "little")


def length_filter(n_src, n_tgt, min_len: int, max_len: int, ratio: float):
    """clean-corpus-n.perl's rule on subword counts: the name of the filter that drops the pair,
    or "" to keep it. On arrays of counts (numpy), an array of names."""
    n_src, n_tgt = np.asarray(n_src), np.asarray(n_tgt)
    return np.select([(n_src < min_len) | (n_tgt < min_len), (n_src > max_len) | (n_tgt > max_len),
                      (n_src > ratio * n_tgt) | (n_tgt > ratio * n_src)],
                     ["too_short", "too_long", "ratio"], default="")[()]
