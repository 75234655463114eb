"""launch/depth_pays.sh, the "does depth pay?" comparison, end to end on Multi30k with tiny
budgets: two depths trained, averaged, decoded and compared by the paired bootstrap, with each
model's cost (parameters, updates, CPU hours) and the runs' curves; the same
command again redoes nothing that is finished; a bad depth is refused before any work."""

import json
import os
import subprocess

import pytest

from distributed import REPO
from shared_data import DATA, needs_data

TINY = {"MAX_UPDATES": "6", "VALID_EVERY": "2", "AVERAGE": "2", "PATIENCE": "2"}


def depth_pays(out, *depths):
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", **TINY)
    return subprocess.run(["bash", "launch/depth_pays.sh", str(DATA / "multi30k"), str(out), *depths], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=900)


@needs_data
def test_two_depths_compared_and_a_rerun_redoes_nothing(tmp_path):
    out = tmp_path / "depth"
    first = depth_pays(out, "1-1", "2-2")
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    hyps = [out / f"admin_{d}/test.best2.hyp.de" for d in ("1L-1L", "2L-2L")]
    test_lines = (out / "data/test.en").read_text(encoding="utf-8").count("\n")
    for hyp in hyps:
        assert hyp.read_text(encoding="utf-8").count("\n") == test_lines == 1000
        tags = sorted(p.name for p in (hyp.parent / "checkpoints").glob("update_*"))
        # keep_best = AVERAGE: the two validated at updates 2 and 4, and the newest (6, never validated)
        assert tags == ["update_000002", "update_000004", "update_000006"]
        assert "[average] + update_000002" in first.stderr and "[average] + update_000006" not in first.stderr
        summary = json.loads((hyp.parent / "summary.json").read_text())
        assert summary["updates"] == 6 and summary["cpu_hours"] > 0
        assert f"{hyp.parent / 'summary.json'}: {summary['parameters'] / 1e6:.1f}M parameters, 6 updates" in first.stdout
    assert (out / "curves.png").read_bytes().startswith(b"\x89PNG")
    assert f"| {hyps[1].parent} | 6 |" in first.stdout  # plot_runs's table: the run and its updates
    table = first.stdout[first.stdout.index("paired bootstrap"):]
    assert str(hyps[0]) in table and str(hyps[1]) in table  # the deeper run against the shallowest

    again = depth_pays(out, "1-1", "2-2")
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert "[translate]" not in again.stdout + again.stderr  # the decodes are newer than the checkpoints
    assert "paired bootstrap" in again.stdout


def test_a_bad_depth_is_refused_before_any_work(tmp_path):
    proc = subprocess.run(["bash", "launch/depth_pays.sh", str(tmp_path / "raw"), str(tmp_path / "out"), "6x6"],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, DS_ACCELERATOR="cpu"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == ("depth_pays.sh: a depth is E-D with positive integers "
                                                    "(e.g. 60-12), got '6x6'")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("setting, message", [
    ({"AVERAGE": "0"}, "AVERAGE must be a positive integer, got '0'"),
    # a run that stops after 3 validations, or reaches update 800 after 3, cannot average 5
    ({"PATIENCE": "2"}, "AVERAGE=5 checkpoints of lowest validation loss need PATIENCE >= 4 and MAX_UPDATES > 800"),
    ({"MAX_UPDATES": "800"}, "need PATIENCE >= 4 and MAX_UPDATES > 800 (validations every VALID_EVERY=160 updates)"),
])
def test_a_bad_setting_is_refused_before_any_work(tmp_path, setting, message):
    proc = subprocess.run(["bash", "launch/depth_pays.sh", str(tmp_path / "raw"), str(tmp_path / "out"), "1-1"],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, DS_ACCELERATOR="cpu", **setting))
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()
