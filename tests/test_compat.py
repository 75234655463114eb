"""A run directory written before the package redesign (tests/fixtures/run_v1, see its README)
resumes and translates exactly as the version that wrote it did: the losses and gradient norms
of the resumed updates, and the beam and greedy translations, equal what that version recorded
(tests/fixtures/run_v1_expected.json)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from distributed import REPO

FIXTURE = REPO / "tests/fixtures/run_v1"
EXPECTED = json.loads((REPO / "tests/fixtures/run_v1_expected.json").read_text(encoding="utf-8"))
ENV = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
# The command that wrote the fixture (its run_config.json), with more updates.
TRAIN = ["--deepspeed_config", str(REPO / "ds_configs/zero2.json"), "--data.default_pairs=600",
         "--data.default_vocab_size=250", "--data.max_tokens=512", "--model.model_dim=32", "--model.ffn_inner_dim=64",
         "--model.num_heads=2", "--optim.warmup_updates=2", "--optim.lr=3e-3", "--train.max_updates=7",
         "--train.save_interval_updates=100", "--train.keep_last=1", "--train.final_eval=false",
         "--train.log_interval=1"]


def run(*args):
    out = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, env=ENV, timeout=600, cwd=REPO)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    return out


def test_old_run_directory_resumes_identically(tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(FIXTURE, run_dir)
    out = run(REPO / "launch/train.py", *TRAIN, f"--train.run_dir={run_dir}")
    assert "[resume] from" in out.stdout and "update_000004: update 4" in out.stdout, out.stdout[-2000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = {str(r["update"]): r for r in rows if r["kind"] == "train"}
    assert sorted(train) == sorted(EXPECTED["resumed_losses"])
    for u, loss in EXPECTED["resumed_losses"].items():
        assert train[u]["loss"] == pytest.approx(loss, abs=1e-4), u
        assert train[u]["grad_norm"] == pytest.approx(EXPECTED["resumed_grad_norms"][u], abs=1e-4), u


@pytest.mark.parametrize("method", ["beam4", "greedy"])
def test_old_run_directory_translates_identically(tmp_path, method):
    src = tmp_path / "src.txt"
    lines = (FIXTURE / "data/test.en").read_text(encoding="utf-8").splitlines()[:EXPECTED["translate_input_lines"]]
    src.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    search = ["--beam", "4"] if method == "beam4" else ["--method", "greedy"]
    shutil.copytree(FIXTURE, tmp_path / "run")  # a loader may set a corrupt tag aside: not in the repository
    out = run(REPO / "launch/translate.py", "--checkpoint", tmp_path / "run", "--input", src, "--quiet", *search)
    assert out.stdout.splitlines() == EXPECTED[method]
