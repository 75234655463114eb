"""Machine-translation scoring with the conventions of the Admin / very-deep-Transformer papers.

The Admin papers (Liu et al. 2020, "Understanding the Difficulty of Training Transformers";
Liu et al. 2020, "Very Deep Transformers for Neural Machine Translation") follow the fairseq
tradition of reporting two BLEU numbers that are *not* interchangeable:

* **sacreBLEU** (Post 2018, "A Call for Clarity in Reporting BLEU Scores") on detokenized text,
  always together with its signature (``nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:...``)
  so that the number can be reproduced.
* **Tokenized BLEU** with ``multi-bleu.perl`` semantics (corpus BLEU-4, case-sensitive,
  whitespace tokens, no smoothing) on Moses-tokenized hypothesis and reference.  For a German
  target both sides additionally get the compound splitting of fairseq's
  ``scripts/compound_split_bleu.sh``, i.e. ``perl -ple 's{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g'``,
  which makes the numbers comparable with Vaswani et al. (2017) and later WMT14 en-de work.

chrF (Popović 2015) and TER (Snover et al. 2006) are computed with sacreBLEU's defaults, which
are the defaults of the ``sacrebleu`` command-line tool, so every number here can be checked
with ``sacrebleu REF -i HYP -l SRC-TGT -m bleu chrf ter``.

This module is a library: it never reads ``sys.argv``.  The command-line entry point is
``launch/evaluate.py``.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from importlib.metadata import version as _package_version
from os import PathLike
from typing import Any, BinaryIO

from sacrebleu.metrics import BLEU, CHRF, TER
from sacrebleu.metrics.bleu import BLEUScore
from sacremoses import MosesTokenizer

__all__ = [
    "check_same_length",
    "compound_split",
    "format_table",
    "moses_tokenize",
    "parse_lang_pair",
    "read_lines",
    "score",
]

# Two- or three-letter ISO 639 codes, as used by WMT, sacreBLEU (``-l en-de``) and Moses.
_LANG_PAIR_RE = re.compile(r"^([a-z]{2,3})-([a-z]{2,3})$")

# fairseq's compound_split_bleu.sh runs ``perl -ple 's{(\S)-(\S)}{$1 ##AT##-##AT## $2}g'``
# without -C/``use utf8``, so perl sees UTF-8 *bytes* and ``\s`` is only ASCII whitespace
# (space, \t, \n, \x0B since perl 5.18, \f, \r).  Matching on bytes is not a detail: in
# ``a-ä-b`` perl's first match consumes only the first byte of ``ä``, so the second hyphen is
# still preceded by a non-space byte and is split too, whereas a str-level regex would leave
# ``ä-b`` alone.  Replaying the regex on the UTF-8 bytes reproduces perl exactly; the result is
# always valid UTF-8 because only ASCII is inserted, and only next to the ASCII hyphen.
_PERL_NONSPACE = rb"[^ \t\n\x0b\f\r]"
_COMPOUND_RE = re.compile(rb"(" + _PERL_NONSPACE + rb")-(" + _PERL_NONSPACE + rb")")
_COMPOUND_REPL = rb"\1 ##AT##-##AT## \2"

# Target languages whose tokenized BLEU gets compound splitting (fairseq applies the script to
# WMT14 en-de only; it is a German-specific convention).
_COMPOUND_SPLIT_LANGS = frozenset({"de"})


# --------------------------------------------------------------------------------------------
# Input
# --------------------------------------------------------------------------------------------


def read_lines(path: str | PathLike[str]) -> list[str]:
    """Read a UTF-8 text file as a list of lines, one segment per line.

    Only the trailing ``\\n`` of each line is removed, and a UTF-8 byte order mark at the start of
    the file (an editor's signature, not text: kept, it would make the first segment differ from a
    reference without one); everything else (``\\r``, other trailing whitespace) is kept, because
    splitting on anything but ``\\n`` -- as Python's universal-newline mode or ``str.splitlines``
    would do for ``\\r``, ``\\x1c`` or ``\\u2028`` -- silently changes the line count and misaligns
    hypotheses with references.  sacreBLEU's command-line tool reads files the same way
    (``newline="\\n"``).

    ``"-"`` reads standard input.  Invalid UTF-8 raises ``ValueError`` naming the file, the
    1-based line number and the offending byte offset within that line; so does a line longer than
    ``admin_ds.files.MAX_LINE_BYTES`` (the file is read in bounded chunks).
    """
    name = str(path)
    if name == "-":
        return _decode_lines(sys.stdin.buffer, "<stdin>")
    with open(path, "rb") as stream:
        return _decode_lines(stream, name)


def _decode_lines(stream: BinaryIO, name: str) -> list[str]:
    from admin_ds.files import bounded_lines

    lines = []
    for lineno, raw in enumerate(bounded_lines(stream, name), start=1):
        if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]
        try:
            lines.append(raw.decode("utf-8"))
        except UnicodeDecodeError as err:
            raise ValueError(
                f"{name}: line {lineno}: invalid UTF-8 ({err.reason} at byte {err.start} "
                f"of the line: {raw[err.start:err.start + 4]!r})"
            ) from err
    return lines


def parse_lang_pair(lang_pair: str) -> tuple[str, str]:
    """Split ``"en-de"`` into ``("en", "de")``; raise ``ValueError`` for anything else."""
    match = _LANG_PAIR_RE.match(lang_pair) if isinstance(lang_pair, str) else None
    if match is None:
        raise ValueError(
            f"language pair must be two lowercase ISO 639 codes joined by '-' "
            f"(source-target, e.g. 'en-de'), got {lang_pair!r}"
        )
    return match.group(1), match.group(2)


def check_same_length(named: Mapping[str, Sequence[str] | None]) -> int:
    """Check that all given line lists (``None`` entries are skipped) have the same length.

    ``named`` maps a description used in the error message (``"hypotheses"``, or a file name)
    to its lines.  Returns the common length; raises ``ValueError`` naming every count.
    """
    counts = {name: len(lines) for name, lines in named.items() if lines is not None}
    if len(set(counts.values())) > 1:
        detail = ", ".join(f"{name} has {n} lines" for name, n in counts.items())
        raise ValueError(f"line counts differ: {detail}")
    return next(iter(counts.values()), 0)


# --------------------------------------------------------------------------------------------
# Tokenized-BLEU preprocessing
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _moses_tokenizer(lang: str) -> MosesTokenizer:
    # Building a tokenizer loads the nonbreaking-prefix list, so reuse one per language.
    return MosesTokenizer(lang=lang)


def moses_tokenize(lines: Iterable[str], lang: str) -> list[str]:
    """Moses-tokenize ``lines`` like ``tokenizer.perl -l LANG -no-escape`` (without ``-a``).

    No XML escaping (``&`` stays ``&``, not ``&amp;``), because escaping is a storage format for
    Moses training data, not something hypotheses and references should be compared in; and no
    aggressive hyphen splitting, so that hyphenated compounds stay single tokens unless the
    German compound split (:func:`compound_split`) is applied afterwards.  The tokenizer also
    collapses every run of (Unicode) whitespace to one space, so whitespace splitting of its
    output is unambiguous.
    """
    tokenizer = _moses_tokenizer(lang)
    return [
        tokenizer.tokenize(line, escape=False, aggressive_dash_splits=False, return_str=True)
        for line in lines
    ]


def compound_split(line: str) -> str:
    """Apply fairseq's compound_split_bleu.sh regex, with perl's byte-level semantics.

    ``Jean-Claude`` becomes ``Jean ##AT##-##AT## Claude``.  Like perl's ``s///g``, matches do not
    overlap, so ``a-b-c`` becomes ``a ##AT##-##AT## b-c``: the ``b`` was consumed by the first
    match.  See the comment on ``_COMPOUND_RE`` for why this runs on UTF-8 bytes.
    """
    return _COMPOUND_RE.sub(_COMPOUND_REPL, line.encode("utf-8")).decode("utf-8")


# --------------------------------------------------------------------------------------------
# Scoring
# --------------------------------------------------------------------------------------------


def _format_multi_bleu(bleu_score: BLEUScore) -> str:
    """Render a sacreBLEU BLEUScore in multi-bleu.perl's output format, for familiarity."""
    sys_len, ref_len = bleu_score.sys_len, bleu_score.ref_len
    ratio = sys_len / ref_len if ref_len else 0.0
    precisions = "/".join(f"{p:.1f}" for p in bleu_score.precisions)
    return (
        f"BLEU = {bleu_score.score:.2f}, {precisions} (BP={bleu_score.bp:.3f}, "
        f"ratio={ratio:.3f}, hyp_len={sys_len}, ref_len={ref_len})"
    )


def score(
    hyps: list[str],
    refs: list[str],
    lang_pair: str,
    srcs: list[str] | None = None,
) -> dict[str, Any]:
    """Score detokenized hypotheses against one reference per segment.

    Args:
        hyps: detokenized system output, one segment per entry.
        refs: detokenized references, aligned with ``hyps``.
        lang_pair: ``"src-tgt"`` such as ``"en-de"``; the target language selects sacreBLEU's
            tokenizer exactly as ``sacrebleu -l`` does, the Moses tokenizer, and whether the
            German compound split applies.
        srcs: optional source segments.  None of the metrics here uses them; they are only
            checked for alignment, which catches a shifted or truncated test set early.

    Returns:
        A JSON-serializable dict.  Scores are on sacreBLEU's 0-100 scale (TER: lower is better).

        ``bleu``/``signature``/``bleu_detail``: sacreBLEU on detokenized text; ``tok_bleu``/
        ``tok_bleu_detail``/``tok_bleu_signature``/``tok_bleu_compound_split``: multi-bleu.perl
        BLEU on Moses-tokenized text; ``chrf``/``chrf_signature``; ``ter``/``ter_signature``;
        ``lang_pair``, ``src_lang``, ``tgt_lang``, ``n_lines``.

    Raises:
        ValueError: invalid ``lang_pair``, mismatched line counts, no lines, or a target
            language whose sacreBLEU tokenizer needs optional packages that are missing.
    """
    src_lang, tgt_lang = parse_lang_pair(lang_pair)
    n_lines = check_same_length({"hypotheses": hyps, "references": refs, "sources": srcs})
    if n_lines == 0:
        raise ValueError("nothing to score: hypotheses and references are empty")

    # sacreBLEU expects one list per reference *stream*, each aligned with the hypotheses.
    ref_streams = [refs]

    try:
        # trg_lang picks the tokenizer `sacrebleu -l SRC-TGT` would pick (13a, or zh/ja-mecab/
        # ko-mecab for CJK targets), so our signature matches the command-line tool's.
        bleu_metric = BLEU(trg_lang=tgt_lang)
    except RuntimeError as err:  # sacreBLEU's way of reporting a missing optional tokenizer
        raise ValueError(
            f"cannot compute sacreBLEU for target language {tgt_lang!r}: {err}"
        ) from err
    bleu = bleu_metric.corpus_score(hyps, ref_streams)

    chrf_metric = CHRF()
    chrf = chrf_metric.corpus_score(hyps, ref_streams)
    ter_metric = TER()
    ter = ter_metric.corpus_score(hyps, ref_streams)

    tok_bleu, tok_signature, do_split = _tokenized_bleu(hyps, refs, tgt_lang)

    return {
        "lang_pair": lang_pair,
        "src_lang": src_lang,
        "tgt_lang": tgt_lang,
        "n_lines": n_lines,
        "bleu": bleu.score,
        "signature": str(bleu_metric.get_signature()),
        "bleu_detail": str(bleu),
        "tok_bleu": tok_bleu.score,
        "tok_bleu_detail": _format_multi_bleu(tok_bleu),
        "tok_bleu_signature": tok_signature,
        "tok_bleu_compound_split": do_split,
        "chrf": chrf.score,
        "chrf_signature": str(chrf_metric.get_signature()),
        "ter": ter.score,
        "ter_signature": str(ter_metric.get_signature()),
    }


def _tokenized_bleu(hyps: list[str], refs: list[str], tgt_lang: str) -> tuple[BLEUScore, str, bool]:
    """multi-bleu.perl BLEU on Moses-tokenized text (German targets compound-split): the score,
    its signature, and whether the compound split applied.

    BLEU(tokenize='none', smooth_method='none') is multi-bleu.perl: corpus BLEU-4 over whitespace
    tokens, case-sensitive, unsmoothed (0 if any n-gram order has no match) and BP = exp(1 - r/c)
    for c < r.  force=True only silences sacreBLEU's warning that the input looks tokenized --
    here it is tokenized on purpose."""
    do_split = tgt_lang in _COMPOUND_SPLIT_LANGS
    tok_hyps = moses_tokenize(hyps, tgt_lang)
    tok_refs = moses_tokenize(refs, tgt_lang)
    if do_split:
        tok_hyps = [compound_split(line) for line in tok_hyps]
        tok_refs = [compound_split(line) for line in tok_refs]
    tok_bleu = BLEU(tokenize="none", smooth_method="none", force=True).corpus_score(
        tok_hyps, [tok_refs]
    )
    tok_signature = (
        f"multi-bleu.perl|tok:moses-{tgt_lang}(no-escape,no-a)"
        f"|compound_split:{'yes' if do_split else 'no'}"
        f"|sacremoses:{_package_version('sacremoses')}"
    )
    return tok_bleu, tok_signature, do_split


# --------------------------------------------------------------------------------------------
# Presentation
# --------------------------------------------------------------------------------------------


def format_table(result: Mapping[str, Any]) -> str:
    """Render a :func:`score` result as a plain-text table (scores with 2 decimals)."""
    split_note = " + compound split" if result["tok_bleu_compound_split"] else ""
    rows = [
        ("BLEU", result["bleu"], "sacreBLEU, detokenized", result["signature"]),
        (
            "tok BLEU",
            result["tok_bleu"],
            f"multi-bleu.perl, Moses-tokenized{split_note}",
            result["tok_bleu_signature"],
        ),
        ("chrF", result["chrf"], "sacreBLEU", result["chrf_signature"]),
        ("TER", result["ter"], "sacreBLEU, lower is better", result["ter_signature"]),
    ]
    name_w = max(len("metric"), *(len(r[0]) for r in rows))
    score_w = max(len("score"), *(len(f"{r[1]:.2f}") for r in rows))
    desc_w = max(len(r[2]) for r in rows)

    def line(cells: Sequence[str]) -> str:
        return (
            f"{cells[0]:<{name_w}}  {cells[1]:>{score_w}}  {cells[2]:<{desc_w}}  {cells[3]}"
        ).rstrip()

    out = [
        f"{result['lang_pair']}, {result['n_lines']} segments",
        line(("metric", "score", "method", "signature")),
        line(("-" * name_w, "-" * score_w, "-" * desc_w, "-" * len("signature"))),
    ]
    out += [line((name, f"{value:.2f}", desc, sig)) for name, value, desc, sig in rows]
    out += [
        "",
        result["bleu_detail"],
        f"tok {result['tok_bleu_detail']}",
    ]
    return "\n".join(out)


def paired_bootstrap(baseline: Sequence[str], systems: Mapping[str, Sequence[str]], refs: Sequence[str],
                     samples: int = 1000, baseline_name: str = "baseline") -> dict[str, Any]:
    """sacreBLEU's paired bootstrap resampling (Koehn 2004), BLEU and chrF: every system against
    ``baseline`` on the same resampled segments. Returns, per system (the baseline first), each
    metric's score, the bootstrap mean and 95% confidence half-width, and the p-value of the
    difference from the baseline (None for the baseline), with sacreBLEU's signatures."""
    from sacrebleu.significance import PairedTest

    named = [("baseline", list(baseline)), *((name, list(hyps)) for name, hyps in systems.items())]
    test = PairedTest(named, {"BLEU": BLEU(), "chrF": CHRF()}, references=[list(refs)], test_type="bs",
                      n_samples=samples)
    signatures, results = test()
    out = {"samples": samples, "signatures": {k: str(v) for k, v in signatures.items()}, "systems": []}
    for k, name in enumerate(results["System"]):
        row = {"name": baseline_name if k == 0 else name}
        for metric in ("BLEU", "chrF2"):
            r = results[metric][k]
            row[metric.rstrip("2").lower()] = {"score": float(r.score), "mean": float(r.mean), "ci95": float(r.ci),
                                               "p_value": None if r.p_value is None else float(r.p_value)}
        out["systems"].append(row)
    return out


def format_paired(result: Mapping[str, Any]) -> str:
    """A :func:`paired_bootstrap` result as a table: score, bootstrap mean +- 95% interval, p-value."""
    width = max(len("system"), *(len(row["name"]) for row in result["systems"]))  # names in full
    lines = [f"paired bootstrap, {result['samples']} samples; p: the difference from the baseline",
             f"{'system':<{width}} {'BLEU':>7} {'mean +- 95%':>15} {'p':>7}   {'chrF':>7} {'mean +- 95%':>15} {'p':>7}"]
    for row in result["systems"]:
        cells = []
        for metric in ("bleu", "chrf"):
            m = row[metric]
            p = "-" if m["p_value"] is None else f"{m['p_value']:.4f}"
            cells.append(f"{m['score']:>7.2f} {m['mean']:>7.2f} +- {m['ci95']:<5.2f} {p:>7}")
        lines.append(f"{row['name']:<{width}} " + "   ".join(cells))
    lines += [f"{k}: {v}" for k, v in result["signatures"].items()]
    return "\n".join(lines)
