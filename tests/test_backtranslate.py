"""Back-translation (data_prep/backtranslate.sh) end to end with a tiny reverse model, plus the
noising functions.

Plumbing test only: the embedded default corpus is en->xx, and the tiny model trained on it is
used as the "reverse" model on German news, with a bitext prepared from the same default corpus
(data_prep.prepare, which reserves <BT>). The directions are not linguistically right, and the
15-update model's output is junk; what is checked is the data flow, counts, tags, seeds, resuming
and errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data_prep.noise import BLANK, encode_with_blanks, noise_words

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
MONO = SHARED_DATA / "mono" / "newstest2012.de"
ENV = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
FAST = ["--beam", "2", "--max-len-a", "0", "--max-len-b", "24", "--max-tokens", "2000"]


# ---- noising ----------------------------------------------------------------------------------

def test_noise_rates_and_local_shuffle():
    rng = np.random.default_rng(0)
    n_words = n_kept = n_blank = 0
    for _ in range(400):
        words = [f"w{i}" for i in range(30)]
        out = noise_words(words, rng, drop=0.1, blank=0.0, shuffle_k=3)
        n_words += len(words)
        n_kept += len(out)
        # shuffle: each kept word is within 3 positions of its rank among the kept words
        kept_order = sorted(out, key=lambda w: int(w[1:]))
        for pos, w in enumerate(out):
            assert abs(pos - kept_order.index(w)) < 3
    assert 0.08 < 1 - n_kept / n_words < 0.12
    rng = np.random.default_rng(1)
    total = 0
    for _ in range(400):
        out = noise_words([f"w{i}" for i in range(30)], rng, drop=0.0, blank=0.1, shuffle_k=0)
        assert len(out) == 30
        n_blank += out.count(BLANK)
        total += 30
        assert [w for w in out if w != BLANK] == [f"w{i}" for i in range(30) if out[i] != BLANK]
    assert 0.08 < n_blank / total < 0.12
    # seeded: reproducible; never empty
    a = noise_words("a b c d e f".split(), np.random.default_rng(5))
    assert a == noise_words("a b c d e f".split(), np.random.default_rng(5))
    assert noise_words(["x"], np.random.default_rng(2), drop=1.0) == ["x"]


class _FakeSp:
    unk_id = 3

    def encode(self, lines):
        return [[len(w) + 10 for w in line.split()] for line in lines]


def test_blanks_encode_to_unk():
    assert encode_with_blanks(_FakeSp(), ["ab <unk> c", "abc d"]) == [[12, 3, 11], [13, 11]]


# ---- end to end -------------------------------------------------------------------------------

def _run(args, check=True):
    r = subprocess.run(["bash", str(ROOT / "data_prep" / "backtranslate.sh"), *map(str, args)],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    if check:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    if not MONO.is_file():
        pytest.skip(f"{MONO} not found (../shared/data)")
    tmp = tmp_path_factory.mktemp("bt")
    run = tmp / "run"
    subprocess.run([sys.executable, "launch/train.py", "--deepspeed_config", "ds_configs/zero2.json",
                    f"--train.run_dir={run}", "--data.default_pairs=1500", "--data.default_vocab_size=400",
                    "--train.max_updates=15", "--train.final_eval=false", "--data.max_tokens=600"],
                   cwd=ROOT, env=ENV, check=True, capture_output=True, timeout=300)
    bitext = tmp / "bitext"
    d = run / "data"
    subprocess.run([sys.executable, "-m", "data_prep.prepare", "en-xx", str(bitext), "--raw-dir", str(d),
                    "--train-prefix", "train", "--valid-prefix", "valid", "--test-prefix", "test",
                    "--vocab-size", "400", "--workers", "1", "--quiet"],
                   cwd=ROOT, env=ENV, check=True, capture_output=True, timeout=120)
    mono = tmp / "mono.de"
    mono.write_text("".join(MONO.read_text(encoding="utf-8").splitlines(keepends=True)[:60]), encoding="utf-8")
    return {"tmp": tmp, "run": run, "bitext": bitext, "mono": mono}


def _check_dir(out: Path, bitext: Path, upsample: int, tagged: bool):
    from admin_ds.data.binarize import load_manifest, open_split
    from admin_ds.subword import SubwordModel

    m = load_manifest(out)
    bt = m["backtranslation"]
    real = load_manifest(bitext)["splits"]["train"]["lines"]
    syn = bt["counts"]["synthetic"]
    assert syn["read"] == 60
    assert syn["read"] == syn["kept"] + sum(syn[k] for k in ("empty", "too_short", "too_long", "ratio"))
    train = open_split(out, "train", m)
    assert len(train) == m["splits"]["train"]["lines"] == upsample * real + syn["kept"]
    assert bt["counts"]["real_upsampled"] == upsample * real
    assert open_split(out, "valid", m) and (out / "test.en").is_file()
    tag = SubwordModel(bitext / "spm.model").id_of("<BT>")
    firsts = [int(train.src[i][0]) for i in range(upsample * real, len(train))]
    if tagged:
        assert firsts and all(t == tag for t in firsts)
        assert bt["tag"] == "<BT>"
    assert all(int(train.src[i][0]) != tag for i in range(real))
    return m


def test_backtranslate_methods_seed_resume(setup):
    tmp, run, bitext, mono = setup["tmp"], setup["run"], setup["bitext"], setup["mono"]
    common = ["--model", run, "--mono", mono, "--bitext", bitext, "--shards", "3", "--seed", "3", *FAST]
    a, b = tmp / "topk_a", tmp / "topk_b"
    _run([*common, "--out", a, "--method", "topk", "--tag", "--upsample", "2"])
    _run([*common, "--out", b, "--method", "topk", "--tag", "--upsample", "2"])
    ma = _check_dir(a, bitext, 2, True)
    mb = _check_dir(b, bitext, 2, True)
    assert ma["files"] == mb["files"]  # same seed: identical binarized outputs
    assert ma["backtranslation"]["method"] == "topk" and ma["backtranslation"]["seed"] == 3
    for i in range(3):
        rec = json.loads((a / "shards" / f"{i:03d}.done.json").read_text())
        assert rec["seed"] == 3 + i and len(rec["input_sha256"]) == 64

    # resume: delete shard 1's output, only that shard is redone, same result
    before = {i: (a / "shards" / f"{i:03d}.done.json").stat().st_mtime_ns for i in range(3)}
    (a / "shards" / "001.src").unlink()
    r = _run([*common, "--out", a, "--method", "topk", "--tag", "--upsample", "2"])
    assert "shard 0: already done" in r.stderr and "shard 2: already done" in r.stderr
    assert "shard 1: 20 lines translated" in r.stderr
    after = {i: (a / "shards" / f"{i:03d}.done.json").stat().st_mtime_ns for i in range(3)}
    assert after[0] == before[0] and after[2] == before[2] and after[1] != before[1]
    assert _check_dir(a, bitext, 2, True)["files"] == ma["files"]

    # the output directory is a training data directory as it stands
    subprocess.run([sys.executable, "launch/train.py", "--deepspeed_config", "ds_configs/zero2.json",
                    f"--train.run_dir={tmp / 'fwd'}", f"--data.path={a}", "--train.max_updates=2",
                    "--train.final_eval=false", "--data.max_tokens=600"],
                   cwd=ROOT, env=ENV, check=True, capture_output=True, timeout=300)

    for method, tag in (("noised-beam", True), ("beam", False)):
        out = tmp / method
        _run([*common, "--out", out, "--method", method, *(["--tag"] if tag else [])])
        m = _check_dir(out, bitext, 1, tag)
        assert m["backtranslation"]["method"] == method
        if method == "noised-beam":
            assert m["backtranslation"]["noise"]["word_dropout"] == 0.1


def test_bad_inputs(setup, capsys):
    from data_prep.backtranslate import main

    tmp, run, bitext, mono = setup["tmp"], setup["run"], setup["bitext"], setup["mono"]
    empty = tmp / "empty.de"
    empty.write_text("")
    out = tmp / "bad"
    base = {"--model": run, "--mono": mono, "--bitext": bitext, "--out": out}
    cases = [({"--model": tmp / "nope"}, [], "--model"),
             ({"--mono": tmp / "nope.de"}, [], "nope.de: no such file"),
             ({"--mono": empty}, [], "empty.de: empty file"),
             ({"--bitext": tmp / "nodir"}, [], "nodir"),
             # the run's own data dir (prepare_default_data) reserves no <BT>
             ({"--bitext": run / "data"}, ["--tag"], "<BT> is not a single piece")]
    for override, extra, msg in cases:
        args = dict(base, **override)
        argv = [str(x) for kv in args.items() for x in kv] + extra
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and msg in err, err
        assert not (out / "manifest.json").exists()
