"""The stability atlas (launch/atlas.py): a 2x2 grid on Multi30k through the real command, its
outcome rules on hand-made loss curves, and its refusals."""

import json
import math
import subprocess
import sys

import pytest

from admin_ds.train.atlas import OUTCOMES, AtlasGrid, Cell, classify, parse_depth, unigram_bits
from distributed import REPO
from shared_data import DATA, needs_data

PNG = b"\x89PNG\r\n\x1a\n"


def atlas(*args, timeout=600):
    return subprocess.run([sys.executable, "launch/atlas.py", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


@needs_data
def test_two_by_two_grid_through_the_command(tmp_path):
    """post and admin x 1L-1L and 2L-2L, 3 updates each: every cell a complete run directory with
    the same settings but its init and depth; atlas.json, atlas.md and the plots; a rerun skips
    the finished cells and resumes the unfinished one."""
    out = tmp_path / "atlas"
    args = ["--raw-dir", DATA / "multi30k", "--vocab-size", 1000, "--out", out, "--inits", "post", "admin",
            "--depths", 1, 2, "--lrs", 1e-3, "--updates", 3, "--valid-interval", 3, "--bleu-sentences", 5, "--max-tokens", 512,
            "--jobs", 2, "--output-change-seeds", 1, "--model.dropout_p=0.2"]
    first = atlas(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    result = json.loads((out / "atlas.json").read_text())
    cells = {c["name"]: c for c in result["cells"]}
    assert sorted(cells) == sorted(f"{i}_{d}_lr0.001_wu100" for i in ("post", "admin") for d in ("1L-1L", "2L-2L"))
    configs = {}
    for name, c in cells.items():
        run_dir = out / "cells" / name
        assert (run_dir / "summary.json").is_file() and (run_dir / "checkpoints" / "latest_complete").is_file()
        assert c["outcome"] in OUTCOMES and [u for u, *_ in c["curve"]] == [1, 2, 3]
        assert c["best_valid_nll"] is not None and c["bleu"] is not None  # validation BLEU, 5 sentences
        run = json.loads((run_dir / "run_config.json").read_text())
        over = run["model"].pop("overrides")
        assert (over["init"], over["norm_order"]) == {"post": ("default", "post"), "admin": ("admin", "post")}[c["init"]]
        assert over["num_encoder_layers"] == over["num_decoder_layers"] == int(c["depth"][0])
        assert over["dropout_p"] == 0.2  # the extra setting reached every cell
        for key in ("init", "norm_order", "num_encoder_layers", "num_decoder_layers"):
            over.pop(key)
        run["train"].pop("run_dir")
        configs[name] = (run, over)
        if c["init"] == "admin":  # its profile, per sub-layer
            assert len(c["omega"]["encoder"]) == 2 * int(c["depth"][0])
            assert len(c["omega"]["decoder"]) == 3 * int(c["depth"][0])
        else:
            assert "omega" not in c
    assert all(v == next(iter(configs.values())) for v in configs.values())  # one protocol for every cell
    assert result["output_change"]["inits"]["post"][0]["mean"] > 0
    md = (out / "atlas.md").read_text()
    assert "| depth | post | admin |" in md and "| 2L-2L |" in md and "python launch/atlas.py" in md
    for png in ("loss_curves", "valid_vs_depth", "omega_admin", "output_change"):
        data = (out / f"{png}.png").read_bytes()
        assert data.startswith(PNG) and len(data) < 300_000
        assert f"({png}.png)" in md

    # rerun: nothing to do; then with one cell unfinished (its summary removed): that one resumes
    summaries = {n: (out / "cells" / n / "summary.json").stat().st_mtime_ns for n in cells}
    again = atlas(*args)
    assert again.returncode == 0 and "4 cells: 4 finished (skipped), 0 to run" in again.stdout
    (out / "cells" / "admin_2L-2L_lr0.001_wu100" / "summary.json").unlink()
    report = atlas(*args, "--report-only")  # stopped without an error: unfinished, not failed
    assert report.returncode == 0, report.stderr[-3000:]
    cell = {c["name"]: c for c in json.loads((out / "atlas.json").read_text())["cells"]}["admin_2L-2L_lr0.001_wu100"]
    assert (cell["outcome"], cell["reason"]) == (
        "unfinished", "stopped at update 3 of 3 without an error; rerun the command to resume it")
    resumed = atlas(*args)
    assert "4 cells: 3 finished (skipped), 1 to run" in resumed.stdout
    log = (out / "cells" / "admin_2L-2L_lr0.001_wu100" / "train.log").read_text()
    assert "[resume] from" in log and "update 3" in log
    for n, t in summaries.items():
        if n != "admin_2L-2L_lr0.001_wu100":
            assert (out / "cells" / n / "summary.json").stat().st_mtime_ns == t


def _records(losses, warmup_nll=None, valid=(), skips=0):
    recs = [{"kind": "train", "update": u, "loss": loss, "nll": loss - 0.3} for u, loss in losses]
    recs += [{"kind": "valid", "update": u, "nll": nll} for u, nll in valid]
    recs += [{"kind": "skip", "update": 1}] * skips
    return recs


@pytest.mark.parametrize("records,outcome", [
    # loss falls well below the unigram model's 9 bits
    (_records([(u, 12 - u / 20) for u in range(10, 110, 10)], valid=[(50, 8.0), (100, 7.2)]), "trained"),
    # finite and falling a little, but the validation nll stays within 0.5 bits of the unigram model
    (_records([(u, 10 - u / 500) for u in range(10, 110, 10)], valid=[(100, 8.7)]), "stalled"),
    # at the end the loss is back above its value at the end of warmup (update 50)
    (_records([(10, 12), (30, 10), (50, 8), (60, 8.1), (70, 7.9), (90, 9), (100, 9.5), (110, 9.6)],
              valid=[(100, 8.0)]), "diverged"),
    (_records([(10, 12), (50, 8), (100, math.nan)], valid=[(100, 7.0)]), "diverged"),
    (_records([(10, 12), (50, 8), (100, 7)], valid=[(100, 7.0)], skips=2), "diverged"),
])
def test_outcome_rules(records, outcome):
    got = classify(records, warmup=50, unigram_bits=9.0)
    assert got["outcome"] == outcome, got
    assert classify(records, warmup=50, unigram_bits=9.0, finished=False)["outcome"] == "failed"


@needs_data
def test_unigram_cross_entropy_by_hand(tmp_path):
    """The stall threshold on a corpus small enough to count by hand: Multi30k's validation set
    prepared as both training and validation split."""
    from data_prep.prepare import main as prepare

    out = tmp_path / "m30k"
    assert prepare(["en-de", str(out), "--raw-dir", str(DATA / "multi30k"), "--train-prefix", "val",
                    "--valid-prefix", "val", "--test-prefix", "test_2016_flickr", "--vocab-size", "500",
                    "--workers", "1", "--quiet"]) == 0
    from admin_ds.data.binarize import load_manifest, open_split

    m = load_manifest(out)
    counts = {}
    train = open_split(out, "train", m)
    for i in range(len(train)):
        for t in list(train[i][1]) + [2]:
            counts[t] = counts.get(t, 0) + 1
    total, vocab = sum(counts.values()), m["vocab_size"]
    valid = open_split(out, "valid", m)
    bits = [-math.log2((counts.get(t, 0) + 1) / (total + vocab)) for i in range(len(valid))
            for t in list(valid[i][1]) + [2]]
    assert unigram_bits(out) == pytest.approx(sum(bits) / len(bits), rel=1e-9)


def test_grid_cells_and_depths():
    grid = AtlasGrid.for_scale("cpu", inits=["post", "admin"], depths=["6", "60-12"], lrs=[1e-3, 2e-3])
    cells = grid.cells()
    assert len(cells) == 8 and cells[0] == Cell("post", 6, 6, 1e-3, 100)
    assert cells[-1].name == "admin_60L-12L_lr0.002_wu100"
    assert [c.stages for c in cells] == [1] * 4 + [2] * 4  # 72 layers >= the CPU grid's pipeline_from (60)
    assert parse_depth("60-12") == (60, 12) and parse_depth("18") == (18, 18)
    gpu = AtlasGrid.for_scale("gpu")
    assert (gpu.model_dim, gpu.ffn_inner_dim, gpu.num_heads, gpu.depths) == (512, 2048, 8, ["6", "18", "60-12", "100-12"])
    assert len(gpu.cells()) == 5 * 4 * 2 * 2  # inits x depths x rates x seeds, as the CPU's deep atlas
    args = gpu.overrides(Cell("admin", 60, 12, 1e-3, 4000), data_dir="D", run_dir="R")
    assert "--model.num_encoder_layers=60" in args and "--model.num_decoder_layers=12" in args
    assert "--model.model_dim=512" in args and not any(a.startswith("--train.bleu_max_sentences") for a in args)


def test_seeds_and_pipeline_cells():
    """Every cell once per seed (the seed in its name and command); cells of pipeline_from layers
    or more on 2 ranks under torch.distributed.run, the others one process."""
    from admin_ds.train.atlas import Atlas

    grid = AtlasGrid.for_scale("cpu", inits=["admin"], depths=["2", "6-4"], lrs=[1e-3], seeds=[1, 7], pipeline_from=10)
    names = [c.name for c in grid.cells()]
    assert names == ["admin_2L-2L_lr0.001_wu100", "admin_2L-2L_lr0.001_wu100_s7",
                     "admin_6L-4L_lr0.001_wu100", "admin_6L-4L_lr0.001_wu100_s7"]
    atlas = Atlas.__new__(Atlas)
    atlas.grid, atlas.data_dir, atlas.out, atlas.train_command = grid, REPO, REPO / "x", ["py", "train.py"]
    shallow, deep = grid.cells()[1], grid.cells()[3]
    assert atlas.command(shallow)[:2] == ["py", "train.py"]
    assert "--train.seed=7" in atlas.command(shallow) and "--engine.pipeline_stages=1" in atlas.command(shallow)
    assert atlas.command(deep)[:6] == ["py", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                       "train.py"]
    assert "--engine.pipeline_stages=2" in atlas.command(deep)


def test_the_atlas_and_its_cells_run_this_checkouts_code(tmp_path, monkeypatch):
    """The command in a second checkout (a worktree pinned to a commit, say) refuses to run the
    environment's admin_ds from another checkout, and runs its own when told to; its cells run the
    code it imported, even with another admin_ds first on PYTHONPATH: an atlas pinned to a commit
    trains that commit."""
    import os
    import shutil

    import admin_ds
    from admin_ds.train.atlas import Atlas

    other = tmp_path / "other_checkout"
    shutil.copytree(REPO / "admin_ds", other / "admin_ds", ignore=shutil.ignore_patterns("__pycache__"))
    (other / "launch").mkdir()
    shutil.copy(REPO / "launch" / "atlas.py", other / "launch")
    with open(other / "admin_ds" / "arguments.py", "a") as f:
        f.write("\nprint('the other checkout')\n")
    command = [sys.executable, str(other / "launch" / "atlas.py"), "--out", tmp_path / "o", "--data", tmp_path]
    refused = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and f"PYTHONPATH={other}" in refused.stderr, refused.stderr
    assert not (tmp_path / "o").exists()
    pinned = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(other)})
    assert pinned.stdout.startswith("the other checkout") and "would run the admin_ds" not in pinned.stderr

    decoy = tmp_path / "decoy"
    (decoy / "admin_ds").mkdir(parents=True)
    (decoy / "admin_ds" / "__init__.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", str(decoy))
    cell_script = tmp_path / "cell.py"  # stands in for train.py: says which admin_ds a cell imports
    cell_script.write_text("import json, pathlib, sys, admin_ds\n"
                           "run = next(a.split('=', 1)[1] for a in sys.argv if a.startswith('--train.run_dir='))\n"
                           "pathlib.Path(run, 'summary.json').write_text(json.dumps(admin_ds.__file__))\n")
    grid = AtlasGrid.for_scale("cpu", inits=["admin"], depths=["2"], lrs=[1e-3])
    atlas = Atlas.__new__(Atlas)
    atlas.grid, atlas.data_dir, atlas.out, atlas.log = grid, tmp_path, tmp_path / "atlas", lambda _: None
    atlas.train_command, atlas.cells = [sys.executable, str(cell_script)], grid.cells()
    assert atlas.run(poll_s=0.05) == {"admin_2L-2L_lr0.001_wu100": 0}
    imported = json.loads((atlas.cell_dir(grid.cells()[0]) / "summary.json").read_text())
    assert imported == admin_ds.__file__


def test_curves_keep_the_last_value_of_a_repeated_update():
    """A run resumed from its update-2 checkpoint logs updates 3 and 4 again: one value each, the
    later one; the outcome is read from that curve."""
    first = _records([(1, 12.0), (2, 11.0), (3, 50.0), (4, 60.0)], valid=[(4, 80.0)])
    resumed = _records([(3, 10.0), (4, 9.0)], valid=[(4, 7.0)])
    got = classify(first + resumed, warmup=1, unigram_bits=9.0)
    assert [u for u, *_ in got["curve"]] == [1, 2, 3, 4]
    assert [loss for _, loss, _ in got["curve"]] == [12.0, 11.0, 10.0, 9.0]
    assert got["valid_curve"] == [[4, 7.0]] and got["outcome"] == "trained"


@needs_data
def test_a_pipeline_cell_with_two_seeds_through_the_command(tmp_path):
    """A 2L-2L cell with --pipeline-from 4 runs as 2 pipeline stages on 2 ranks, once per seed;
    the report gives the seeds' range."""
    out = tmp_path / "atlas"
    proc = atlas("--raw-dir", DATA / "multi30k", "--vocab-size", 1000, "--out", out, "--inits", "admin",
                 "--depths", 2, "--lrs", 1e-3, "--updates", 2, "--valid-interval", 2, "--bleu-sentences", 3,
                 "--max-tokens", 512, "--output-change-seeds", 0, "--pipeline-from", 4, "--seeds", 1, 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name, seed in (("admin_2L-2L_lr0.001_wu100", 1), ("admin_2L-2L_lr0.001_wu100_s2", 2)):
        run = json.loads((out / "cells" / name / "run_config.json").read_text())
        assert (run["train"]["seed"], run["engine"]["pipeline_stages"]) == (seed, 2)
        assert "data-parallel 1 x pipeline 2" in (out / "cells" / name / "train.log").read_text()
    cells = json.loads((out / "atlas.json").read_text())["cells"]
    assert len(cells) == 2 and cells[0]["best_valid_nll"] != cells[1]["best_valid_nll"]  # the seeds differ
    row = next(line for line in (out / "atlas.md").read_text().splitlines() if line.startswith("| 2L-2L |"))
    assert "-" in row.split("/")[0] and "(" in row  # mean (min-max) over the two seeds


@pytest.mark.parametrize("args,message", [
    (["--seeds", "1", "1"], "error: --seeds: each seed once, got [1, 1]"),
    (["--depths", "6-x"], "error: --depths: expected N or N-M with positive integers (e.g. 18, 60-12), got '6-x'"),
    (["--data", "/nonexistent"], "error: --data: /nonexistent has no manifest.json"),
    (["--train.max_updates"], "error: unrecognised argument(s) --train.max_updates; cell settings are"),
    (["--model.dropuot=0.3"], "error: command line: model.dropuot: unknown key (did you mean dropout_p?)"),
    (["--model.dropout_p=2"], "error: model.dropout_p: "),
    (["--optim.lr=1"], "error: --optim.lr=1: the atlas sets optim.lr in each cell (--inits, --depths, --lrs,"),
    (["--deepspeed_config", "/nonexistent.json"], "error: --deepspeed_config: no such file: /nonexistent.json"),
])
def test_bad_arguments_are_one_line_errors(tmp_path, args, message):
    if "--data" not in args:
        args = ["--data", str(tmp_path), *args]
    proc = atlas("--out", tmp_path / "out", *args)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith(message) and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "out").exists()


@needs_data
def test_a_cell_that_fails_with_an_error_fails_the_command(tmp_path):
    """A cell's error (here: a validation split the data does not have, found by the training at
    set-up) is no outcome of the grid: the report names it and the command exits 1."""
    from data_prep.prepare import main as prepare

    data, out = tmp_path / "m30k", tmp_path / "atlas"  # Multi30k's validation set as a small corpus
    assert prepare(["en-de", str(data), "--raw-dir", str(DATA / "multi30k"), "--train-prefix", "val",
                    "--valid-prefix", "val", "--test-prefix", "test_2016_flickr", "--vocab-size", "500",
                    "--workers", "1", "--quiet"]) == 0
    proc = atlas("--data", data, "--out", out, "--inits", "post", "--depths", 1, "--lrs", 1e-3, "--updates", 1,
                 "--output-change-seeds", 0, "--data.valid_split=nope")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == ("error: 1 cell(s) failed with an error (post_1L-1L_lr0.001_wu100); "
                                                    "see their train.log")
    cell = json.loads((out / "atlas.json").read_text())["cells"][0]
    assert cell["outcome"] == "failed" and "data.valid_split" in cell["reason"] and "'nope'" in cell["reason"]


def test_trained_share_counts_finished_runs_only():
    """The outcome plot's share: cells not run or unfinished are no evidence either way."""
    from admin_ds.train.atlas_report import trained_share

    def cell(init, depth, outcome, lr=1e-3):
        return {"init": init, "depth": depth, "lr": lr, "warmup": 100, "outcome": outcome}

    result = {"cells": [cell("admin", "60-12", "trained"), cell("admin", "60-12", "unfinished", lr=3e-3),
                        cell("post", "60-12", "stalled"), cell("post", "60-12", "trained", lr=3e-3),
                        cell("pre", "60-12", "unfinished"), cell("pre", "60-12", "missing", lr=3e-3)]}
    settings = [(1e-3, 100), (3e-3, 100)]
    assert trained_share(result, "admin", "60-12", settings) == 1.0
    assert trained_share(result, "post", "60-12", settings) == 0.5
    assert math.isnan(trained_share(result, "pre", "60-12", settings))
    assert math.isnan(trained_share(result, "deepnorm", "60-12", settings))


def plot_runs(*args):
    return subprocess.run([sys.executable, "launch/plot_runs.py", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def _metrics(run, lines, tail=""):
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + tail)
    return run


def test_plot_runs_reads_a_resumed_run_and_one_still_writing(tmp_path):
    """launch/plot_runs.py: a run resumed from update 2 logs updates 3-4 again (its best validation
    is the resumed one, not the first 3.0 it wrote for update 4); a run killed mid-write ends in a
    partial line, which is left out."""
    resumed = _metrics(tmp_path / "deep", [
        {"kind": "train", "update": u, "nll": 9.0 - u} for u in range(1, 5)] + [
        {"kind": "valid", "update": 2, "nll": 6.5}, {"kind": "valid", "update": 4, "nll": 3.0},
        {"kind": "stop", "update": 4, "signals": "SIGTERM"}] + [
        {"kind": "train", "update": u, "nll": 8.0 - u} for u in (3, 4)] + [
        {"kind": "valid", "update": 4, "nll": 5.25}, {"kind": "summary", "updates": 4}])
    writing = _metrics(tmp_path / "shallow", [{"kind": "train", "update": 1, "nll": 7.0}],
                       tail='{"kind": "valid", "upda')
    proc = plot_runs(resumed, writing, "--out", tmp_path / "curves.png")
    assert proc.returncode == 0, proc.stderr
    assert f"| {resumed} | 4 | 5.250 | 4 |" in proc.stdout.splitlines()
    assert f"| {writing} | 1 | - | - |" in proc.stdout.splitlines()
    assert (tmp_path / "curves.png").read_bytes().startswith(PNG)


@pytest.mark.parametrize("lines,tail,message", [
    ([{"kind": "train", "update": 1, "nll": 7.0}], 'not json\n{"kind": "train", "update": 2, "nll": 6.0}\n',
     "metrics.jsonl, line 2: not a JSON record"),
    ([[1, 2]], "", "metrics.jsonl, line 1: not a metrics record (a JSON object with a 'kind')"),
    ([{"kind": "stop", "update": 3}], "", "no training or validation records in metrics.jsonl"),
])
def test_plot_runs_refuses_what_is_not_a_run(tmp_path, lines, tail, message):
    run = _metrics(tmp_path / "run", lines, tail)
    proc = plot_runs(run, "--out", tmp_path / "curves.png")
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "curves.png").exists()
