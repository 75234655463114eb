"""WMT14 data preparation (data_prep/): real text from ../shared/data, every source kind, the
filters and their counts, determinism, kill-and-resume, and each bad input's message.

Most runs call ``data_prep.prepare.main`` in this process (no interpreter start-up or torch
import per run); the wrapper script, the kill test and the offline-hub test start subprocesses.
Tests that read the shared data skip when ../shared/data is absent and fail when a file in it is
missing (tests/shared_data.py).
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from shared_data import DATA, needs_data

ROOT = Path(__file__).resolve().parents[1]
WMT_ENDE = DATA / "wmt14" / "en-de"
NC = DATA / "newscommentary-enfr-5k"
MULTI30K = DATA / "multi30k"
WRAPPER = ROOT / "data_prep" / "prepare_wmt14.sh"

from data_prep.clean import (PunctNormalizer, decode_side, length_filter, normalize, normalize_lines,
                             remove_non_printing)
from data_prep.prepare import main


# newstest2013 as training text, a small vocabulary: the reference run most tests compare with.
ENDE_ARGS = ["--raw-dir", str(WMT_ENDE), "--train-prefix", "newstest2013", "--vocab-size", "1000",
             "--chunk-lines", "500", "--quiet"]


def run_prepare(capsys, *argv) -> tuple[int, str]:
    rc = main([str(a) for a in argv])
    return rc, capsys.readouterr().err


def manifest_of(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def subprocess_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "DATA_PREP_TEST_SLOW_BINARIZE"}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


@pytest.fixture(scope="module")
def ende(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ende") / "data"
    assert main(["en-de", str(out), *ENDE_ARGS, "--workers", "1"]) == 0
    return out


# ---- cleaning components, against independent references --------------------------------------

@needs_data
def test_punct_normalizer_equals_sacremoses_on_real_text():
    from sacremoses import MosesPunctNormalizer

    files = {"en": [WMT_ENDE / "newstest2014.en", NC / "nc-5k.en"],
             "de": [WMT_ENDE / "newstest2014.de"],
             "fr": [DATA / "wmt14" / "en-fr" / "newstest2014.fr", NC / "nc-5k.fr"]}
    extra = ["a  ( b )  ,  c  ''d''  e`f", "«\u00a0x\u00a0» 3\u00a0000 nº\u00a05 l’été ‚x‘ „y“ …",
             '"quoted", he said.  ', "x ; y : z %  ( 1 ) .", "", " ", "(", ")", '"', "'", "''", "  x  ",
             "5 %", "%", "a’", "’b", "1\u00a02", '..."', "...\" <", '"...', "\u00a0", "x\u00a0", "— – ’’ ´´ \t\u200b"]
    for lang, paths in files.items():
        lines = [line for p in paths for line in p.read_text(encoding="utf-8").split("\n")] + extra
        moses, fast = MosesPunctNormalizer(lang=lang), PunctNormalizer(lang)
        changed = 0
        expected = [moses.normalize(line) for line in lines]
        for line, want in zip(lines, expected):
            assert fast(line) == want, (lang, line)
            changed += want != line
        assert changed > 10  # the rules did fire on this text
        # All lines at once (the shards' path), and in small groups where fewer rules apply.
        assert fast.lines(lines) == expected, lang
        assert sum((fast.lines(lines[i:i + 7]) for i in range(0, len(lines), 7)), []) == expected, lang
        assert normalize_lines(lines, fast) == [normalize(line, fast) for line in lines]


def test_remove_non_printing_and_decode_side():
    # \p{C} (control, format, private use, unassigned) -> space; other characters untouched
    assert remove_non_printing("a\u200bb\tc\ufeffd\u00a0e\ue000f\U000e0001g") == "a b c d\u00a0e f g"
    assert remove_non_printing("plain text, ok") == "plain text, ok"
    assert decode_side(b"caf\xe9") is None  # Latin-1, not UTF-8
    assert decode_side(b"&quot;x&quot; &amp; &lt;b&gt; &#233;&#x20AC; &copy") == '"x" & <b> é€ &copy'
    # every character str.splitlines() breaks on becomes a space: one segment per written line
    assert decode_side("a\u2028b\x85c\x0bd&#10;e".encode()) == "a b c d e"


def test_sharded_deduplication_keeps_first_occurrences(tmp_path):
    """find_duplicates / drop_duplicates over shards and hash buckets against a Python set read
    in order: the same pairs kept, whatever the number of buckets."""
    from data_prep.shards import (DropDuplicates, DuplicateBucket, drop_duplicates, find_duplicates,
                                  shard_name)

    rng = np.random.default_rng(0)
    shards = [rng.integers(0, 300, size=n).astype(np.uint64) for n in (0, 50, 200, 1, 120, 80)]
    seen, expected = set(), []
    for shard in shards:
        kept = []
        for d in shard.tolist():
            if d not in seen:
                kept.append(d)
            seen.add(d)
        expected.append(kept)
    for buckets in (1, 3, 7):
        directory = tmp_path / f"b{buckets}"
        directory.mkdir()
        for i, shard in enumerate(shards):  # the text of pair k is its digest, to read back what was kept
            (directory / f"{shard_name(i)}.src").write_bytes(b"".join(b"%d\n" % d for d in shard.tolist()))
            (directory / f"{shard_name(i)}.tgt").write_bytes((directory / f"{shard_name(i)}.src").read_bytes())
            (directory / f"{shard_name(i)}.digest").write_bytes(shard.astype("<u8").tobytes())
        sizes = [len(s) for s in shards]
        for b in range(buckets):
            find_duplicates(DuplicateBucket(directory, b, buckets, sizes))
        start = 0
        for i, shard in enumerate(shards):
            record = drop_duplicates(DropDuplicates(directory, i, start, buckets))
            start += len(shard)
            kept = [int(x) for x in (directory / f"{shard_name(i)}.kept.src").read_text().split()]
            assert kept == expected[i], (buckets, i)
            assert record["duplicate"] == len(shard) - len(expected[i])


def test_shards_of_a_file_read_like_the_whole_file(tmp_path):
    """line_starts + read_lines (or read_range) over each byte range == read_lines over the file, with a BOM,
    CRLF, overlong and empty lines, with and without a final newline."""
    from data_prep.sources import byte_ranges, line_starts, read_lines, read_range

    rng = np.random.default_rng(1)
    path = tmp_path / "f"
    for _ in range(200):
        lines = [b"x" * int(rng.choice([0, 1, 5, 30, 200])) + (b"\r" if rng.random() < 0.2 else b"")
                 for _ in range(rng.integers(0, 60))]
        data = (b"\xef\xbb\xbf" if rng.random() < 0.3 else b"") + b"\n".join(lines) \
            + (b"\n" if rng.random() < 0.5 else b"")
        path.write_bytes(data)
        starts, count = line_starts(path, int(rng.integers(1, 10)), piece=int(rng.choice([1, 3, 64, 1 << 18])))
        whole = list(read_lines(path, 100))
        assert count == len(whole)
        ranges = byte_ranges(starts, len(data))
        assert [x for a, b in ranges for x in read_lines(path, 100, a, b)] == whole
        assert [x for a, b in ranges for x in read_range(path, 100, a, b)] == whole
        assert [x for a, b in ranges for x in read_range(path, 100, a, b, whole_below=50)] == whole
        assert all(b > a for a, b in ranges) or not data


def test_read_lines_edge_cases(tmp_path):
    from data_prep.sources import read_lines

    body = b"\xef\xbb\xbfbom\r\n" + b"x" * 10 + b"\n" + b"y" * 11 + b"\r\n" + b"z" * 12 + b"\n\nlast"
    (tmp_path / "a.txt").write_bytes(body)
    (tmp_path / "a.gz").write_bytes(gzip.compress(body))  # any name: gzip is found by its magic bytes
    for name in ("a.txt", "a.gz"):
        assert list(read_lines(tmp_path / name, 11)) == [b"bom", b"x" * 10, b"y" * 11, None, b"", b"last"]


def test_length_filter_is_clean_corpus_n():
    assert length_filter(10, 15, 1, 250, 1.5) == ""
    assert length_filter(10, 16, 1, 250, 1.5) == "ratio"
    assert length_filter(0, 1, 1, 250, 1.5) == "too_short"
    assert length_filter(251, 250, 1, 250, 1.5) == "too_long"
    assert length_filter(0, 400, 1, 250, 1.5) == "too_short"  # the first rule that applies names it
    assert length_filter(np.array([10, 10, 0, 251, 0]), np.array([15, 16, 1, 250, 400]), 1, 250, 1.5).tolist() \
        == ["", "ratio", "too_short", "too_long", "too_short"]


# ---- encoding with a word cache, against SentencePiece itself -----------------------------------

# Lines built to break a word-by-word encoding: empty lines and irregular spaces, characters that
# nmt_nfkc rewrites (ligatures, fractions, full-width letters, compatibility characters that
# become a space plus a combining mark), combining marks at a word start, SentencePiece's own
# "▁", the reserved symbol inside a word, and words never seen in training.
EDGE_LINES = ["", "  leading and trailing  ", "a\tb\u00a0c", "ﬁne ½ x¨y ¨ ＡＢＣ ㍱", "\u0308a \u0301 e\u0301",
              "▁ a▁b ▁▁", "x<BT>y <BT>", "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich.",
              "qzxv kwyj 1234567 3,14 ... -- !!!"]


def _spm(tmp_path: Path, model_type: str, **options):
    import sentencepiece as spm

    from admin_ds.data.subword import SubwordModel, train_subword_model

    files = [WMT_ENDE / "newstest2013.en", WMT_ENDE / "newstest2013.de"]
    prefix = tmp_path / f"{model_type}{len(options)}"
    if not options:
        return SubwordModel(train_subword_model(files, prefix, 2000, model_type=model_type, seed=1))
    spm.SentencePieceTrainer.train(input=[str(f) for f in files], model_prefix=str(prefix), vocab_size=2000,
                                   model_type=model_type, bos_id=0, pad_id=1, eos_id=2, unk_id=3,
                                   minloglevel=2, **options)
    return SubwordModel(f"{prefix}.model")


@needs_data
def test_word_cached_encoding_equals_sentencepiece(tmp_path):
    """WordCachedEncoder.encode_text gives SentencePiece's own ids on unseen real text (raw and
    cleaned, several chunks sharing one cache, and a cache small enough to be emptied on the
    way) and on lines built to break it."""
    from admin_ds.data.subword import WordCachedEncoder

    model = _spm(tmp_path, "bpe")
    punct = {lang: PunctNormalizer(lang) for lang in ("en", "de")}
    texts = []
    for lang in ("en", "de"):
        raw = (WMT_ENDE / f"newstest2014.{lang}").read_text(encoding="utf-8").split("\n")[:-1]
        texts += [raw[:1500], [normalize(line, punct[lang]) for line in raw[1500:]]]
    texts.append(EDGE_LINES)
    for max_words in (1 << 20, 3000):
        encoder = WordCachedEncoder(model, max_words=max_words)
        assert encoder.exact
        for lines in texts:
            ids, lengths = encoder.encode_text("".join(line + "\n" for line in lines))
            expected = model.encode(lines)
            assert lengths.tolist() == [len(e) for e in expected]
            assert ids.tolist() == [i for e in expected for i in e]
        assert len(encoder._code) > 1000 or max_words < 1 << 20  # the cache was used, not bypassed
    assert encoder.encode_text("")[1].size == 0
    with pytest.raises(ValueError, match="ended by a newline"):
        encoder.encode_text("no newline")


@needs_data
def test_words_passed_between_encoders_give_sentencepiece_ids(tmp_path):
    """Workers share learned words through files (data_prep.shards.pass_on_words /
    take_in_words): an encoder that took in another's words encodes new text, and the text those
    words came from, with SentencePiece's own ids, and learns nothing new on the latter (the words
    were taken, not learned again); a cache too small for them takes none."""
    from admin_ds.data.subword import WordCachedEncoder
    from data_prep.shards import pass_on_words, take_in_words

    model = _spm(tmp_path, "bpe")
    lines = (WMT_ENDE / "newstest2014.de").read_text(encoding="utf-8").split("\n")[:-1]
    first, second = lines[:1500] + EDGE_LINES, lines[1500:]
    text = {id(part): "".join(line + "\n" for line in part) for part in (first, second)}
    shards = tmp_path / "shards"
    shards.mkdir()
    a = WordCachedEncoder(model)
    assert a.learned()[0] == []  # starts the record: an encoder that never shares keeps none
    a.encode_text(text[id(first)])
    pass_on_words(shards, "000000", a)
    assert (shards / "000000.words.npz").is_file() and a.learned()[0] == []

    b = WordCachedEncoder(model)
    b.encode_text("".join(line + "\n" for line in lines[2000:2100]))  # words of its own first
    b.learned()
    take_in_words(shards, b)
    assert b.learned()[0] == []  # taken-in words are not passed on again
    for part in (second, first):
        ids, lengths = b.encode_text(text[id(part)])
        expected = model.encode(part)
        assert lengths.tolist() == [len(e) for e in expected]
        assert ids.tolist() == [i for e in expected for i in e]
    assert not set(b.learned()[0]) & set(first[0].split())  # the first text's words were known

    small = WordCachedEncoder(model, max_words=100)
    take_in_words(shards, small)
    assert len(small._code) == 2


@needs_data
@pytest.mark.parametrize("model_type, options", [("unigram", {}), ("bpe", {"split_by_whitespace": False})])
def test_word_cache_is_refused_where_words_are_not_independent(model_type, options, tmp_path):
    """A unigram model (float ties broken by the line's prefix) and a BPE model whose pieces may
    hold "▁" inside (split_by_whitespace=false) cannot be encoded word by word: the encoder says
    so and falls back to SentencePiece; forcing the cache gives other ids, which is what the
    check guards against."""
    from admin_ds.data.subword import WordCachedEncoder

    model = _spm(tmp_path, model_type, **options)
    assert model.model_type == model_type
    lines = [normalize(line, PunctNormalizer("de"))
             for line in (WMT_ENDE / "newstest2014.de").read_text(encoding="utf-8").split("\n")[:1500]]
    text = "".join(line + "\n" for line in lines)
    expected = [i for e in model.encode(lines) for i in e]
    encoder = WordCachedEncoder(model)
    assert not encoder.exact
    assert encoder.encode_text(text)[0].tolist() == expected
    encoder.exact = True
    assert encoder.encode_text(text)[0].tolist() != expected


@needs_data
def test_subword_sample_is_the_same_in_every_process(tmp_path):
    """SentencePiece is trained on a sample drawn by the pipeline: two separate runs (processes)
    with a sample smaller than the corpus give the same model. (SentencePiece's own sampling gives
    a different vocabulary in every process, whatever its seed.)"""
    from data_prep.pipeline import _uniform_sample, sample_lines

    models = []
    for run in ("a", "b"):
        out = tmp_path / run
        cmd = ["bash", str(WRAPPER), "en-de", str(out), *ENDE_ARGS, "--spm-sample-lines", "1500"]
        done = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        models.append((out / "spm.model").read_bytes())
        assert not (out / "work" / "spm.sample").exists()
    assert models[0] == models[1]

    # The sample itself: exactly k distinct lines of the inputs, in file order, the same for any
    # block size, another one for another seed.
    root = tmp_path / "a"
    paths = [f"work/train.clean.{lang}" for lang in ("en", "de")]
    lines = [line for p in paths for line in (root / p).read_bytes().split(b"\n")[:-1]]
    samples = {}
    for seed, block in ((1, 1 << 20), (1, 97), (2, 1 << 20)):
        assert sample_lines(root, paths, f"s{seed}_{block}", 1500, seed, block=block)
        samples[seed, block] = (root / f"s{seed}_{block}").read_bytes().split(b"\n")[:-1]
    assert samples[1, 1 << 20] == samples[1, 97] != samples[2, 1 << 20]
    sample = samples[1, 1 << 20]
    assert len(sample) == 1500
    positions = iter(range(len(lines)))
    assert all(any(lines[i] == line for i in positions) for line in sample)  # a subsequence
    assert not sample_lines(root, paths, "all", len(lines), 1)  # nothing to sample
    # Every line equally likely, across chunk boundaries (4 of 10 numbers, chunks of 3).
    rng, counts = np.random.default_rng(5), np.zeros(10)
    for _ in range(20000):
        drawn = _uniform_sample(10, 4, rng, chunk=3)
        assert len(set(drawn.tolist())) == 4
        counts[drawn] += 1
    assert np.abs(counts / 20000 - 0.4).max() < 0.015


# ---- the en-de run on newstest: training can read it -------------------------------------------

@needs_data
def test_output_opens_for_training_and_round_trips(ende):
    from admin_ds.data.binarize import load_manifest, open_split
    from admin_ds.data.subword import SubwordModel

    m = load_manifest(ende)  # verifies every checksum
    assert (m["src_lang"], m["tgt_lang"]) == ("en", "de")
    assert m["vocab_size"] == 1000 and m["subword_model"] == "spm.model"
    sp = SubwordModel(ende / "spm.model")
    assert sp.sha256 == m["subword_sha256"] and sp.id_of("<BT>") == 4

    # The training split is exactly: the cleaned text, encoded, minus the length/ratio filter.
    train = open_split(ende, "train", m)
    clean = {lang: (ende / "work" / f"train.clean.{lang}").read_text(encoding="utf-8").splitlines()
             for lang in ("en", "de")}
    expected = [(s, t, i) for i, (s, t) in enumerate(zip(sp.encode(clean["en"]), sp.encode(clean["de"])))
                if 1 <= len(s) <= 250 and 1 <= len(t) <= 250 and len(s) <= 1.5 * len(t) and len(t) <= 1.5 * len(s)]
    assert len(train) == len(expected) == m["splits"]["train"]["lines"]
    for k, (s, t, _) in enumerate(expected):
        assert train[k][0].tolist() == s and train[k][1].tolist() == t
    assert train.src.dtype == np.uint16
    # Decoding gives the sentences back (SentencePiece's NFKC normalisation aside).
    decoded = sp.decode([train[k][0] for k in range(len(train))])
    same = sum(d == clean["en"][i] for d, (_, _, i) in zip(decoded, expected))
    assert same >= 0.98 * len(expected)

    f = m["filters"]["train"]
    assert f["read"] == 3000 and f["kept"] == len(train)
    dropped = sum(v for k, v in f.items() if k not in ("read", "kept"))
    assert f["read"] == f["kept"] + dropped
    assert f["duplicate"] == 4 and f["ratio"] > 0

    # Eval splits: full sets, unfiltered; the reference text is the original file.
    for split, name, n in (("valid", "newstest2013", 3000), ("test", "newstest2014", 3003)):
        assert len(open_split(ende, split, m)) == m["splits"][split]["lines"] == n
        assert (ende / f"{split}.de").read_text(encoding="utf-8") == (WMT_ENDE / f"{name}.de").read_text(encoding="utf-8")
        assert len((ende / f"{split}.en").read_text(encoding="utf-8").splitlines()) == n
    assert "„" not in (ende / "test.en").read_text(encoding="utf-8")  # the source side is normalised
    assert m["command"].endswith("--workers 1") and m["tool_versions"]["sacremoses"]


@needs_data
def test_rerun_is_verified_and_skipped(ende, capsys):
    before = (ende / "manifest.json").read_bytes()
    rc, err = run_prepare(capsys, "en-de", ende, *ENDE_ARGS, "--workers", "1")
    assert rc == 0 and "already prepared" in err
    assert (ende / "manifest.json").read_bytes() == before


def same_output(a: Path, b: Path) -> bool:
    """The same data directory: every file the manifest checksums, and the cleaned text."""
    return manifest_of(a)["files"] == manifest_of(b)["files"] and all(
        (a / "work" / f"train.clean.{lang}").read_bytes() == (b / "work" / f"train.clean.{lang}").read_bytes()
        for lang in ("en", "de"))


@needs_data
def test_byte_identical_for_1_2_3_workers_and_any_shard_size(ende, tmp_path, capsys):
    """Workers clean, deduplicate and encode their own shards: the output is the single-process
    one whatever the number of workers and shards, for files read in ranges by the workers and
    for gzip files read by the main process."""
    for workers, chunk in ((2, "500"), (3, "77"), (2, "5000")):
        out = tmp_path / f"w{workers}_{chunk}"
        rc, err = run_prepare(capsys, "en-de", out, *ENDE_ARGS, "--workers", workers, "--chunk-lines", chunk)
        assert rc == 0, err
        assert same_output(out, ende), (workers, chunk)
    raw = tmp_path / "gz"
    raw.mkdir()
    for name in ("newstest2013", "newstest2014"):
        for lang in ("en", "de"):
            (raw / f"{name}.{lang}.gz").write_bytes(gzip.compress((WMT_ENDE / f"{name}.{lang}").read_bytes()))
    args = [a if a != str(WMT_ENDE) else str(raw) for a in ENDE_ARGS]
    rc, err = run_prepare(capsys, "en-de", tmp_path / "gz_out", *args, "--workers", "2", "--chunk-lines", "300")
    assert rc == 0, err
    assert same_output(tmp_path / "gz_out", ende)


@needs_data
def test_datasets_json_loader_gives_the_same_data(ende, tmp_path, capsys):
    """{'translation': {...}} records through load_dataset("json"): the hub's code path."""
    jdir = tmp_path / "json"
    jdir.mkdir()
    for split, name in (("train", "newstest2013"), ("validation", "newstest2013"), ("test", "newstest2014")):
        en = (WMT_ENDE / f"{name}.en").read_text(encoding="utf-8").splitlines()
        de = (WMT_ENDE / f"{name}.de").read_text(encoding="utf-8").splitlines()
        with open(jdir / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for e, d in zip(en, de):
                f.write(json.dumps({"translation": {"de": d, "en": e}}, ensure_ascii=False) + "\n")
    rc, err = run_prepare(capsys, "en-de", tmp_path / "out", "--json-dir", jdir, "--hf-cache-dir",
                          tmp_path / "hf", "--vocab-size", "1000", "--workers", "1", "--quiet")
    assert rc == 0, err
    assert manifest_of(tmp_path / "out")["files"] == manifest_of(ende)["files"]


@needs_data
def test_tsv_source_and_malformed_lines(ende, tmp_path, capsys):
    en = (WMT_ENDE / "newstest2013.en").read_text(encoding="utf-8").splitlines()
    de = (WMT_ENDE / "newstest2013.de").read_text(encoding="utf-8").splitlines()
    rows = [f"{e}\t{d}" for e, d in zip(en, de)]
    rows.insert(7, "one column only")
    (tmp_path / "train.tsv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    args = [a for a in ENDE_ARGS if a not in ("--train-prefix", "newstest2013")]
    rc, err = run_prepare(capsys, "en-de", tmp_path / "out", *args, "--tsv", tmp_path / "train.tsv",
                          "--workers", "1")
    assert rc == 0, err
    m = manifest_of(tmp_path / "out")
    assert m["filters"]["train"]["malformed"] == 1 and m["filters"]["train"]["read"] == 3001
    assert m["files"] == manifest_of(ende)["files"]


@needs_data
def test_killed_while_binarizing_resumes_to_the_same_output(ende, tmp_path):
    """SIGKILL in the middle of the train step (workers slowed by a test hook), then the same
    command: the finished shards are reused and the output is byte-identical to a run that
    was never interrupted."""
    out = tmp_path / "out"
    cmd = ["bash", str(WRAPPER), "en-de", str(out), *ENDE_ARGS, "--workers", "2", "--chunk-lines", "100"]
    env = subprocess_env(DATA_PREP_TEST_SLOW_BINARIZE="0.5")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    deadline = time.monotonic() + 300
    while len(list((out / "work" / "train.shards").glob("*.json"))) < 4:
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "binarizing never started"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    assert not (out / "manifest.json").exists() and not (out / "train.en.idx").exists()

    done = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "clean: already done" in done.stderr and "subword: already done" in done.stderr
    assert "shards left from an earlier run reused" in done.stderr
    assert same_output(out, ende)
    assert not list(out.glob("*.tmp")) and not (out / "work" / "train.shards").exists()


# ---- other real corpora ------------------------------------------------------------------------

@needs_data
def test_news_commentary_noise_and_sgml(tmp_path, capsys):
    out = tmp_path / "nc"
    rc, err = run_prepare(capsys, "en-fr", out, "--raw-dir", NC, "--train-prefix", "nc-5k",
                          "--valid-prefix", "test", "--test-prefix", "test", "--vocab-size", "2000",
                          "--workers", "1", "--quiet")
    assert rc == 0, err
    m = manifest_of(out)
    f = m["filters"]["train"]
    assert f["read"] == 5000 and f["empty"] == 13  # the 13 pairs with one side empty
    assert f["read"] == f["kept"] + sum(v for k, v in f.items() if k not in ("read", "kept"))
    assert "&quot;" not in (out / "work" / "train.clean.fr").read_text(encoding="utf-8")
    # SGML test files: 85 segments, entities unescaped, tags gone
    ref = (out / "test.en").read_text(encoding="utf-8").splitlines()
    assert len(ref) == m["splits"]["test"]["lines"] == 85
    assert "Standard & Poor's" in "\n".join(ref) and not any("<seg" in r for r in ref)
    assert "test-src.fr.sgm" in m["sources"]["test"]


@needs_data
def test_multi30k_gzip(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = Path("data") / "m30k"  # relative, as the README's commands give it
    rc, err = run_prepare(capsys, "en-de", out, "--raw-dir", MULTI30K, "--train-prefix", "val",
                          "--valid-prefix", "val", "--test-prefix", "test_2016_flickr", "--vocab-size", "1000",
                          "--workers", "1", "--quiet")
    assert rc == 0, err
    m = manifest_of(out)
    assert m["filters"]["train"]["read"] == 1014 and m["splits"]["test"]["lines"] == 1000
    with gzip.open(MULTI30K / "test_2016_flickr.de.gz", "rt", encoding="utf-8") as f:
        assert (out / "test.de").read_text(encoding="utf-8") == f.read()


# ---- bad input ---------------------------------------------------------------------------------

def synthetic_corpus(directory: Path, n: int = 400) -> Path:
    """A small clean corpus (train, newstest2013, newstest2014) that needs no shared data."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    words = {"en": "the a house cat dog sees small big red runs quickly today tree".split(),
             "de": "das ein Haus Katze Hund sieht klein groß rot läuft schnell heute Baum".split()}
    for prefix in ("train", "newstest2013", "newstest2014"):
        rows = [rng.integers(0, len(words["en"]), size=rng.integers(3, 12)) for _ in range(n)]
        for lang in ("en", "de"):
            text = "\n".join(" ".join(words[lang][i] for i in r).capitalize() + "." for r in rows)
            (directory / f"{prefix}.{lang}").write_text(text + "\n", encoding="utf-8")
    return directory


def test_dirty_lines_are_dropped_and_counted(tmp_path, capsys):
    raw = synthetic_corpus(tmp_path / "raw")
    en = (raw / "train.en").read_bytes().split(b"\n")[:-1]
    de = (raw / "train.de").read_bytes().split(b"\n")[:-1]
    en[0] = b"\xef\xbb\xbf" + en[0]     # byte-order mark: stripped
    en[1] = b"caf\xe9 au lait"          # Latin-1: invalid UTF-8
    de[2] = b"   \t "                    # whitespace only
    en[3] = b""                          # empty
    en[4] = b"word " * 2000              # overlong (> --max-line-bytes)
    (raw / "train.en").write_bytes(b"\r\n".join(en) + b"\r\n")  # CRLF line ends: stripped
    (raw / "train.de").write_bytes(b"\n".join(de) + b"\n")
    out = tmp_path / "out"
    rc, err = run_prepare(capsys, "en-de", out, "--raw-dir", raw, "--vocab-size", "100", "--workers", "1",
                          "--quiet", "--max-line-bytes", "1000")
    assert rc == 0, err
    f = manifest_of(out)["filters"]["train"]
    assert (f["invalid_utf8"], f["empty"], f["overlong"]) == (1, 2, 1)
    assert f["read"] == 400 and f["read"] == f["kept"] + sum(v for k, v in f.items() if k not in ("read", "kept"))
    clean = (out / "work" / "train.clean.en").read_bytes()
    assert b"\r" not in clean and b"\xef\xbb\xbf" not in clean
    assert clean.startswith(en[0][3:13])


def _assert_failed(rc: int, err: str, out: Path, *names: str) -> None:
    assert rc == 2, err
    line = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert line, err
    for name in names:
        assert name in line[0], (name, err)
    assert "Traceback" not in err
    if out.is_dir():
        assert not (out / "manifest.json").exists() and not list(out.glob("train.*"))


def test_sides_with_different_line_counts(tmp_path, capsys):
    raw = synthetic_corpus(tmp_path / "raw")
    (raw / "train.de").write_text("".join((raw / "train.de").read_text().splitlines(True)[:390]))
    out = tmp_path / "out"
    rc, err = run_prepare(capsys, "en-de", out, "--raw-dir", raw, "--vocab-size", "100", "--workers", "1")
    _assert_failed(rc, err, out, "train.en has 400", "train.de has 390")
    assert not (out / "spm.model").exists()
    # the same in a test set: found before anything is written
    raw2 = synthetic_corpus(tmp_path / "raw2")
    (raw2 / "newstest2014.en").write_text("".join((raw2 / "newstest2014.en").read_text().splitlines(True)[:-1]))
    rc, err = run_prepare(capsys, "en-de", tmp_path / "out2", "--raw-dir", raw2, "--vocab-size", "100")
    _assert_failed(rc, err, tmp_path / "out2", "newstest2014.en has 399", "newstest2014.de has 400")
    assert not (tmp_path / "out2").exists()


def test_sgml_without_segments(tmp_path, capsys):
    raw = synthetic_corpus(tmp_path / "raw")
    for lang in ("en", "de"):
        (raw / f"newstest2013.{lang}").unlink()
        (raw / f"newstest2013-src.{lang}.sgm").write_text('<srcset setid="x">\n<doc docid="1">\n</doc>\n</srcset>\n')
    rc, err = run_prepare(capsys, "en-de", tmp_path / "out", "--raw-dir", raw, "--vocab-size", "100")
    _assert_failed(rc, err, tmp_path / "out", "newstest2013-src.en.sgm", "no <seg>")


def test_truncated_gzip(tmp_path, capsys):
    raw = synthetic_corpus(tmp_path / "raw", n=3000)
    for lang in ("en", "de"):
        data = gzip.compress((raw / f"train.{lang}").read_bytes())
        (raw / f"train.{lang}").unlink()
        (raw / f"train.{lang}.gz").write_bytes(data[: len(data) // 2] if lang == "de" else data)
    out = tmp_path / "out"
    rc, err = run_prepare(capsys, "en-de", out, "--raw-dir", raw, "--vocab-size", "100", "--workers", "1")
    _assert_failed(rc, err, out, "train.de.gz", "truncated or corrupt gzip")
    assert not list((out / "work").glob("train.clean.*"))


def test_missing_file(tmp_path, capsys):
    raw = synthetic_corpus(tmp_path / "raw")
    (raw / "newstest2014.de").unlink()
    rc, err = run_prepare(capsys, "en-de", tmp_path / "out", "--raw-dir", raw, "--vocab-size", "100")
    _assert_failed(rc, err, tmp_path / "out", "newstest2014.de", "no such file")
    assert not (tmp_path / "out").exists()


def test_unwritable_output_folder(tmp_path, capsys):
    raw = synthetic_corpus(tmp_path / "raw")
    (tmp_path / "a_file").write_text("x")
    rc, err = run_prepare(capsys, "en-de", tmp_path / "a_file" / "out", "--raw-dir", raw, "--vocab-size", "100")
    _assert_failed(rc, err, tmp_path / "a_file", "a_file/out", "cannot write")
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        rc, err = run_prepare(capsys, "en-de", ro / "out", "--raw-dir", raw, "--vocab-size", "100")
        _assert_failed(rc, err, ro, "ro/out", "cannot write")


def test_hub_unreachable_says_how_to_use_local_files(tmp_path):
    env = subprocess_env(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "hf"),
                         HF_HOME=str(tmp_path / "hfhome"))
    r = subprocess.run(["bash", str(WRAPPER), "en-de", str(tmp_path / "out")], env=env,
                       capture_output=True, text=True, timeout=300)
    _assert_failed(r.returncode, r.stderr, tmp_path / "out", "wmt14", "--raw-dir", "--json-dir")
    assert not (tmp_path / "out").exists()


def test_filtered_test_set_must_have_2737_lines(tmp_path, capsys):
    raw = synthetic_corpus(tmp_path / "raw")
    for lang in ("en", "de"):
        (raw / f"newstest2014.{lang}").rename(raw / f"newstest2014-filtered.{lang}")
    rc, err = run_prepare(capsys, "en-de", tmp_path / "out", "--raw-dir", raw, "--filtered-test")
    _assert_failed(rc, err, tmp_path / "out", "newstest2014-filtered.en", "400 test segments", "2737")
    rc, err = run_prepare(capsys, "en-de", tmp_path / "out", "--filtered-test")  # the hub has the full set only
    _assert_failed(rc, err, tmp_path / "out", "--filtered-test needs local files")


def test_seed_and_user_symbols_are_checked_before_any_work(tmp_path, capsys):
    """A seed SentencePiece cannot take and user symbols its trainer refuses used to fail in the
    subword step, after the cleaning, with a traceback."""
    raw = synthetic_corpus(tmp_path / "raw", n=20)
    out = tmp_path / "out"
    common = ["en-de", out, "--raw-dir", raw, "--vocab-size", "100", "--workers", "1", "--quiet"]
    for seed in ("-1", str(2**32)):
        with pytest.raises(SystemExit) as e:
            run_prepare(capsys, *common, "--seed", seed)
        err = capsys.readouterr().err
        assert e.value.code == 2 and "Traceback" not in err, err
        assert f"error: argument --seed: must be an integer in 0..4294967295, got {seed}" in err, err
        assert not out.exists()
    for symbols, msg in ((["<BT>", "<BT>"], "--user-symbols: <BT> is given twice"),
                         (["<BT>", ""], "--user-symbols: an empty symbol"),
                         (["</s>"], "--user-symbols: </s> is a special piece")):
        rc, err = run_prepare(capsys, *common, "--user-symbols", *symbols)
        _assert_failed(rc, err, out, msg)
        assert len(err.splitlines()) == 1 and not out.exists(), err


def test_second_preparation_in_the_same_folder_is_refused(tmp_path, capsys):
    import fcntl

    raw = synthetic_corpus(tmp_path / "raw")
    out = tmp_path / "out"
    out.mkdir()
    with open(out / ".prepare.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running preparation holds it
        rc, err = run_prepare(capsys, "en-de", out, "--raw-dir", raw, "--vocab-size", "100")
    _assert_failed(rc, err, out, "another preparation is running")


def test_wrapper_reports_errors_without_traceback(tmp_path):
    raw = synthetic_corpus(tmp_path / "raw")
    r = subprocess.run(["bash", str(WRAPPER), "en-de", str(tmp_path / "out"), "--raw-dir", str(raw),
                        "--train-prefix", "nope"], env=subprocess_env(), capture_output=True, text=True)
    _assert_failed(r.returncode, r.stderr, tmp_path / "out", "nope.en", "no such file")
    assert r.stderr.startswith("error: ")
