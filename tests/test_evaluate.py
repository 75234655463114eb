"""Tests for admin_ds.inference.scoring and launch/evaluate.py against independent references.

The numbers are checked against tools the field actually reports with, not against ourselves:

* sacreBLEU / chrF / TER and the BLEU signature against the ``sacrebleu`` command-line tool run
  on the same files (``sacrebleu REF -i HYP -l en-de -m bleu chrf ter -w 4 --format json``);
* tokenized BLEU against a hand-written Python multi-bleu.perl and a minimal perl port of
  multi-bleu.perl, both fed text that is Moses-tokenized here and, for German, compound-split
  by real ``perl -pe 's{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g'`` (fairseq's compound_split_bleu.sh);
* the compound split itself against that perl one-liner on real hyphenated lines.

Real text comes from ``../shared/data`` beside the repository; tests that need it skip when that
directory is absent (e.g. in a user's clone) and fail when a file in it is missing
(tests/shared_data.py); the others always run.
"""

from __future__ import annotations

import json
import math
import random
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from sacremoses import MosesTokenizer
from shared_data import data_file

REPO = Path(__file__).resolve().parents[1]
CLI = REPO / "launch" / "evaluate.py"


from admin_ds.inference.scoring import (
    compound_split,
    format_table,
    moses_tokenize,
    read_lines,
    score,
)

COMPOUND_SPLIT_PERL = r"s{(\S)-(\S)}{$1 ##AT##-##AT## $2}g"

# The test sets (newstest2014, 3003 lines) per language pair, as "src-tgt": (src, ref).
TEST_SETS = {
    "en-de": ("wmt14/en-de/newstest2014.en", "wmt14/en-de/newstest2014.de"),
    "en-fr": ("wmt14/en-fr/newstest2014.en", "wmt14/en-fr/newstest2014.fr"),
}

# Scoring the full 3003 lines costs ~6 CPU-seconds per tool run (chrF and TER dominate), and the
# comparison below needs four runs; the first 1000 segments keep the suite under a minute on a
# small shared machine while still covering ~20k reference words per language.
N_SEGMENTS = 1000


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def require_perl() -> str:
    # perl is the reference for multi-bleu.perl and the compound split; Debian's git depends on it,
    # so its absence means a broken test machine, not a reason to pass silently.
    perl = shutil.which("perl")
    assert perl is not None, "perl is not installed; it is the reference for multi-bleu/compound split"
    return perl


def sacrebleu_cli() -> str:
    # sacrebleu is a pinned dependency: its CLI must be there. Prefer the one beside the running
    # interpreter, so library and CLI versions match.
    beside = Path(sys.executable).parent / "sacrebleu"
    found = str(beside) if beside.exists() else shutil.which("sacrebleu")
    assert found is not None, "the sacrebleu command-line tool is missing: re-run launch/setup_env.sh"
    return found


def perturb(lines: list[str], seed: int = 1234) -> list[str]:
    """A deterministic, realistic-looking degradation of the reference.

    Drops every 7th word, swaps two random words in every 5th line and empties every 97th line
    (systems do emit empty lines), so all four n-gram orders, the brevity penalty and TER shifts
    are exercised.
    """
    rng = random.Random(seed)
    out = []
    for i, line in enumerate(lines):
        words = [w for j, w in enumerate(line.split()) if j % 7 != 6]
        if i % 5 == 0 and len(words) >= 2:
            a, b = rng.sample(range(len(words)), 2)
            words[a], words[b] = words[b], words[a]
        out.append("" if i % 97 == 0 else " ".join(words))
    return out


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    return path


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(CLI), *args],
        cwd=REPO, input=stdin, capture_output=True, text=True, timeout=120,
    )


def perl_compound_split(lines: list[str]) -> list[str]:
    """Run fairseq's compound-split one-liner through real perl (byte semantics, as fairseq)."""
    proc = subprocess.run(
        [require_perl(), "-pe", COMPOUND_SPLIT_PERL],
        input="".join(f"{line}\n" for line in lines).encode("utf-8"),
        capture_output=True, check=True,
    )
    return proc.stdout.decode("utf-8").split("\n")[:-1]


def hand_multi_bleu(hyps: list[str], refs: list[str]) -> dict:
    """multi-bleu.perl written out by hand: corpus BLEU-4 over whitespace tokens.

    Case-sensitive, clipped n-gram counts summed over the corpus, no smoothing (a zero
    precision makes BLEU 0), brevity penalty exp(1 - r/c) when c < r.
    """
    correct, total = [0] * 4, [0] * 4
    hyp_len = ref_len = 0
    for hyp, ref in zip(hyps, refs, strict=True):
        h, r = hyp.split(), ref.split()
        hyp_len += len(h)
        ref_len += len(r)
        for n in range(1, 5):
            h_ngrams = Counter(tuple(h[i:i + n]) for i in range(len(h) - n + 1))
            r_ngrams = Counter(tuple(r[i:i + n]) for i in range(len(r) - n + 1))
            total[n - 1] += sum(h_ngrams.values())
            correct[n - 1] += sum(min(c, r_ngrams[g]) for g, c in h_ngrams.items())
    precisions = [c / t if t else 0.0 for c, t in zip(correct, total)]
    if min(precisions) == 0.0:
        bleu = 0.0
    else:
        bp = 1.0 if hyp_len >= ref_len else math.exp(1 - ref_len / hyp_len)
        bleu = bp * math.exp(sum(math.log(p) for p in precisions) / 4)
    return {"bleu": 100 * bleu, "hyp_len": hyp_len, "ref_len": ref_len}


# A minimal port of Moses' multi-bleu.perl (single reference), run by real perl so that perl's
# own `split`, hashing and printf are the reference.  It prints multi-bleu.perl's summary line
# and then the score with full precision.
MULTI_BLEU_PERL = r"""
use strict; use warnings;
my ($hyp_file, $ref_file) = @ARGV;
open(my $H, '<', $hyp_file) or die; open(my $R, '<', $ref_file) or die;
my (@correct, @total); my ($len_hyp, $len_ref) = (0, 0);
while (defined(my $hyp = <$H>)) {
    my $ref = <$R>; chomp $hyp; chomp $ref;
    my @h = split ' ', $hyp; my @r = split ' ', $ref;
    $len_hyp += @h; $len_ref += @r;
    for my $n (1 .. 4) {
        my (%hc, %rc);
        $hc{join(' ', @h[$_ .. $_ + $n - 1])}++ for 0 .. $#h - $n + 1;
        $rc{join(' ', @r[$_ .. $_ + $n - 1])}++ for 0 .. $#r - $n + 1;
        for my $g (keys %hc) {
            $total[$n] += $hc{$g};
            $correct[$n] += ($rc{$g} // 0) < $hc{$g} ? ($rc{$g} // 0) : $hc{$g};
        }
    }
}
my @p = map { $total[$_] ? ($correct[$_] // 0) / $total[$_] : 0 } 1 .. 4;
my $bp = $len_hyp < $len_ref ? exp(1 - $len_ref / $len_hyp) : 1;
sub my_log { return -9999999999 unless $_[0]; return log($_[0]); }
my $bleu = $bp * exp((my_log($p[0]) + my_log($p[1]) + my_log($p[2]) + my_log($p[3])) / 4);
printf "BLEU = %.2f, %.1f/%.1f/%.1f/%.1f (BP=%.3f, ratio=%.3f, hyp_len=%d, ref_len=%d)\n",
    100 * $bleu, 100 * $p[0], 100 * $p[1], 100 * $p[2], 100 * $p[3], $bp,
    $len_hyp / $len_ref, $len_hyp, $len_ref;
printf "%.12f\n", 100 * $bleu;
"""


# --------------------------------------------------------------------------------------------
# 1. sacreBLEU / chrF / TER agree with the sacrebleu command-line tool
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory) -> dict:
    """Run our CLI and the sacrebleu CLI on perturbed newstest2014 for every pair, in parallel.

    The four processes run concurrently and every test below reuses their output.
    """
    sacrebleu = sacrebleu_cli()
    runs, procs = {}, []
    for pair, (src_rel, ref_rel) in TEST_SETS.items():
        workdir = tmp_path_factory.mktemp(pair)
        src_lines = read_lines(data_file(src_rel))[:N_SEGMENTS]
        ref_lines = read_lines(data_file(ref_rel))[:N_SEGMENTS]
        src = write_lines(workdir / "src.txt", src_lines)
        ref = write_lines(workdir / "ref.txt", ref_lines)
        hyp = write_lines(workdir / "hyp.txt", perturb(ref_lines))
        ours = subprocess.Popen(
            [sys.executable, str(CLI), "--hyp", str(hyp), "--ref", str(ref), "--src", str(src),
             "--lang", pair, "--json"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        # -l gives sacrebleu the target language (tokenizer choice); -w 4 prints 4 decimals.
        theirs = subprocess.Popen(
            [sacrebleu, str(ref), "-i", str(hyp), "-l", pair, "-m", "bleu", "chrf", "ter",
             "-w", "4", "--format", "json"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        runs[pair] = {"hyp": hyp, "ref": ref}
        procs.append((pair, ours, theirs))
    for pair, ours, theirs in procs:
        out, err = ours.communicate(timeout=300)
        assert ours.returncode == 0, err
        runs[pair]["ours"] = json.loads(out)  # json.loads rejects anything beyond one object
        out, err = theirs.communicate(timeout=300)
        assert theirs.returncode == 0, err
        runs[pair]["sacrebleu"] = {m["name"]: m for m in json.loads(out)}
    return runs


@pytest.mark.parametrize("pair", sorted(TEST_SETS))
def test_scores_match_sacrebleu_cli(cli_runs, pair):
    ours, theirs = cli_runs[pair]["ours"], cli_runs[pair]["sacrebleu"]
    bleu, chrf, ter = theirs["BLEU"], theirs["chrF2"], theirs["TER"]

    assert ours["n_lines"] == N_SEGMENTS
    assert f"{ours['bleu']:.4f}" == f"{bleu['score']:.4f}"
    assert ours["signature"] == bleu["signature"]
    assert ours["signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:")
    assert ours["bleu_detail"].endswith(bleu["verbose_score"])
    assert f"{ours['chrf']:.4f}" == f"{chrf['score']:.4f}"
    assert ours["chrf_signature"] == chrf["signature"]
    assert f"{ours['ter']:.4f}" == f"{ter['score']:.4f}"
    assert ours["ter_signature"] == ter["signature"]
    # The perturbation must actually hurt, or the comparison above proves little.
    assert 20 < ours["bleu"] < 90 and ours["ter"] > 5


# --------------------------------------------------------------------------------------------
# 2. tokenized BLEU == multi-bleu.perl on Moses-tokenized (+ compound-split) text
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pair", sorted(TEST_SETS))
def test_tokenized_bleu_matches_multi_bleu(cli_runs, pair, tmp_path):
    perl = require_perl()
    tgt = pair.split("-")[1]
    ours = cli_runs[pair]["ours"]

    # Tokenize independently of the library (sacremoses directly, as tokenizer.perl
    # -no-escape without -a), then compound-split for German with real perl.
    tokenizer = MosesTokenizer(lang=tgt)
    sides = []
    for path in (cli_runs[pair]["hyp"], cli_runs[pair]["ref"]):
        lines = [
            tokenizer.tokenize(line, escape=False, aggressive_dash_splits=False, return_str=True)
            for line in read_lines(path)
        ]
        sides.append(perl_compound_split(lines) if tgt == "de" else lines)
    tok_hyps, tok_refs = sides
    assert ours["tok_bleu_compound_split"] is (tgt == "de")
    if tgt == "de":
        assert any("##AT##-##AT##" in line for line in tok_refs)

    expected = hand_multi_bleu(tok_hyps, tok_refs)
    assert ours["tok_bleu"] == pytest.approx(expected["bleu"], abs=1e-9)
    lengths = f"hyp_len={expected['hyp_len']}, ref_len={expected['ref_len']}"
    assert lengths in ours["tok_bleu_detail"]

    hyp_file = write_lines(tmp_path / "hyp.tok", tok_hyps)
    ref_file = write_lines(tmp_path / "ref.tok", tok_refs)
    proc = subprocess.run(
        [perl, "-e", MULTI_BLEU_PERL, str(hyp_file), str(ref_file)],
        capture_output=True, text=True, check=True,
    )
    summary, full = proc.stdout.splitlines()
    assert ours["tok_bleu_detail"] == summary
    assert ours["tok_bleu"] == pytest.approx(float(full), abs=1e-9)
    # Tokenized BLEU differs from sacreBLEU (that is why both are reported), but not wildly.
    assert abs(ours["tok_bleu"] - ours["bleu"]) < 5


def test_compound_split_matches_perl_on_real_lines():
    lines = [line for line in read_lines(data_file("wmt14/en-de/newstest2014.de")) if "-" in line]
    tokenized = moses_tokenize(lines, "de")
    # Edge cases of perl's byte-level, non-overlapping /g matching.
    tricky = [
        "a-b-c", "a-ä-b", "ü-ö-ß-x", "x--y", "--", "-a-", "a - b", "a -b", "a- b",
        "a\u00a0-b", "a-\u00a0b", "a\t-b", "a-\x0bb", "a-\rb", "€-€-€", "日本-語-テ", "",
    ]
    for sample in (lines, tokenized, tricky):
        assert [compound_split(line) for line in sample] == perl_compound_split(sample)
    assert len(lines) > 100
    assert compound_split("a-b-c") == "a ##AT##-##AT## b-c"
    # perl consumed only the first byte of "ä", so the second hyphen is split as well.
    assert compound_split("a-ä-b") == "a ##AT##-##AT## ä ##AT##-##AT## b"


def test_moses_tokenize_conventions():
    # No escaping, no aggressive hyphen splitting, language-specific apostrophes.
    assert moses_tokenize(["AT&T's e-mail <x>."], "en") == ["AT & T 's e-mail < x > ."]
    assert moses_tokenize(["l'homme, c'est ça."], "fr") == ["l' homme , c' est ça ."]


# --------------------------------------------------------------------------------------------
# 3. errors: clear message on stderr, exit status 2, no traceback
# --------------------------------------------------------------------------------------------


def assert_usage_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    for fragment in fragments:
        assert fragment in proc.stderr


def test_cli_line_count_mismatch(tmp_path):
    hyp = write_lines(tmp_path / "hyp.txt", ["a b", "c d", "e f"])
    ref = write_lines(tmp_path / "ref.txt", ["a b", "c d"])
    assert_usage_error(run_cli("--hyp", str(hyp), "--ref", str(ref), "--lang", "en-de"),
                       "3 lines", "2 lines", str(hyp), str(ref))
    src = write_lines(tmp_path / "src.txt", ["x"])
    proc = run_cli("--hyp", str(ref), "--ref", str(ref), "--src", str(src), "--lang", "en-de")
    assert_usage_error(proc, "2 lines", "1 lines", str(src))
    with pytest.raises(ValueError, match=r"hypotheses has 3 lines.*references has 2 lines"):
        score(["a", "b", "c"], ["a", "b"], "en-de")


def test_cli_missing_file(tmp_path):
    ref = write_lines(tmp_path / "ref.txt", ["a b"])
    missing = tmp_path / "does-not-exist.txt"
    assert_usage_error(run_cli("--hyp", str(missing), "--ref", str(ref), "--lang", "en-de"),
                       "--hyp", str(missing))


def test_cli_bad_lang(tmp_path):
    ref = write_lines(tmp_path / "ref.txt", ["a b"])
    proc = run_cli("--hyp", str(ref), "--ref", str(ref), "--lang", "en_de")
    assert_usage_error(proc, "--lang", "'en_de'")
    # The CLI and score() share one validator; the other spellings are checked in-process
    # (each CLI start costs about a second of imports).
    for lang in ["ende", "EN-DE", "en-", "en-de-fr", "english-german", ""]:
        with pytest.raises(ValueError, match="language pair"):
            score(["a"], ["a"], lang)


def test_cli_invalid_utf8(tmp_path):
    ref = write_lines(tmp_path / "ref.txt", ["one", "two", "three"])
    bad = tmp_path / "bad.txt"
    bad.write_bytes("one\ntwo\nthr\u00e9e\n".encode("latin-1"))
    assert_usage_error(run_cli("--hyp", str(bad), "--ref", str(ref), "--lang", "en-fr"),
                       str(bad), "line 3", "UTF-8")


def test_read_lines_keeps_everything_but_the_newline(tmp_path):
    path = tmp_path / "t.txt"
    # \r, trailing blanks and U+2028 are content; only \n ends a line; no final newline is fine.
    path.write_bytes("a\r\n b \n\nx\u2028y\nlast".encode("utf-8"))
    assert read_lines(path) == ["a\r", " b ", "", "x\u2028y", "last"]
    path.write_bytes(b"")
    assert read_lines(path) == []


def test_cli_reads_stdin(tmp_path):
    ref = write_lines(tmp_path / "ref.txt", ["the cat sat on the mat", "a b c d e"])
    proc = run_cli("--hyp", "-", "--ref", str(ref), "--lang", "en-fr", "--json",
                   stdin="the cat sat on the mat\na b c d e\n")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["bleu"] == pytest.approx(100)


# --------------------------------------------------------------------------------------------
# 4. sanity: perfect output scores 100, near-empty output scores near 0
# --------------------------------------------------------------------------------------------


def test_perfect_and_degenerate_hypotheses():
    refs = read_lines(data_file("wmt14/en-de/newstest2014.de"))[:300]

    perfect = score(refs, refs, "en-de")
    assert perfect["bleu"] == pytest.approx(100)
    assert perfect["tok_bleu"] == pytest.approx(100)
    assert perfect["chrf"] == pytest.approx(100)
    assert perfect["ter"] == pytest.approx(0)
    assert perfect["n_lines"] == 300

    poor = score(["die"] * len(refs), refs, "en-de")
    assert poor["bleu"] < 1 and poor["tok_bleu"] < 1
    assert poor["chrf"] < 10 and poor["ter"] > 90


def test_small_inline_example_without_data():
    refs = ["Das Haus ist klein.", "Der Zug kommt um 9-Uhr an."]
    result = score(refs, refs, "en-de", srcs=["The house is small.", "The train arrives at 9."])
    assert result["bleu"] == pytest.approx(100) and result["tok_bleu"] == pytest.approx(100)
    assert result["tok_bleu_compound_split"] is True
    # One shared unigram only: multi-bleu semantics give exactly 0, sacreBLEU smoothing does not.
    result = score(["Das ist alles."], ["Das Haus ist klein."], "en-fr")
    assert result["tok_bleu"] == 0.0 and result["tok_bleu_compound_split"] is False

    table = format_table(result)
    expected = ("BLEU", "tok BLEU", "chrF", "TER", f"{result['bleu']:.2f}", result["signature"],
                result["chrf_signature"], result["ter_signature"])
    for fragment in expected:
        assert fragment in table


def test_paired_bootstrap_matches_the_sacrebleu_cli(tmp_path):
    """--compare against sacreBLEU's own command line (`sacrebleu REF -i BASE SYS --paired-bs`) on
    the same files: each system's score, bootstrap mean, 95% interval and p-value, BLEU and chrF."""
    sacrebleu_cli = shutil.which("sacrebleu") or str(Path(sys.executable).parent / "sacrebleu")
    rng = random.Random(3)
    refs = [f"Ein {w} sieht {v} den {o} an ." for w in ("Hund", "Mann", "Kind", "Vogel") for v in ("heute", "oft", "nie")
            for o in ("Ball", "Baum", "Fluss", "Berg", "Himmel")] * 3
    base = [r if rng.random() < 0.5 else "Ein Hund ." for r in refs]
    better = [r if rng.random() < 0.8 else "Ein Mann sieht den Berg ." for r in refs]
    paths = {n: write_lines(tmp_path / f"{n}.de", lines) for n, lines in
             (("ref", refs), ("base", base), ("better", better), ("same", base))}
    out = run_cli("--hyp", str(paths["base"]), "--ref", str(paths["ref"]), "--lang", "en-de", "--json",
                  "--compare", str(paths["better"]), str(paths["same"]), "--bootstrap-samples", "200")
    assert out.returncode == 0, out.stderr
    ours = json.loads(out.stdout)["paired_bootstrap"]["systems"]
    theirs = subprocess.run([sacrebleu_cli, str(paths["ref"]), "-i", str(paths["base"]), str(paths["better"]),
                             "-m", "bleu", "chrf", "--paired-bs", "--paired-bs-n", "200", "-f", "text"],
                            capture_output=True, text=True, timeout=120, check=True).stdout
    cells = re.findall(r"([\d.]+) \(([\d.]+) ± ([\d.]+)\)", theirs)
    p_values = re.findall(r"\(p = ([\d.]+)\)", theirs)
    assert len(cells) == 4 and len(p_values) == 2, theirs
    for k, (system, metric) in enumerate((s, m) for s in (0, 1) for m in ("bleu", "chrf")):
        got = ours[system][metric]
        assert [f"{got[key]:.1f}" for key in ("score", "mean", "ci95")] == list(cells[k])
    assert [f"{ours[1][m]['p_value']:.4f}" for m in ("bleu", "chrf")] == p_values
    assert ours[1]["bleu"]["p_value"] < 0.05
    assert ours[2]["bleu"]["score"] == ours[0]["bleu"]["score"]  # a copy of the baseline scores as the baseline
    assert ours[0]["name"] == str(paths["base"]) and ours[0]["bleu"]["p_value"] is None
