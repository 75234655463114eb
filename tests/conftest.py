"""Shared fixtures: a small generated corpus, prepared once per session, and one Admin profile
shared by runs whose layouts must not change omega."""

import os
import shutil
import subprocess
import tempfile

import pytest

from distributed import REPO, SMALL_DATA, free_port, spawn
from launching import check, clean_env, losses, run_args

NO_DROPOUT = ["--model.dropout_p=0", "--model.attention_dropout_p=0", "--model.activation_dropout_p=0"]
ZERO = {s: {"zero_optimization": {"stage": s}, "gradient_accumulation_steps": 1} for s in (0, 1, 2, 3)}
PIPE = {"pipeline": {"stages": 2}, "zero_optimization": {"stage": 1}, "gradient_accumulation_steps": 2}


# The test files that take longest, longest first (seconds with two workers on a 2-core AMD EPYC,
# Zen 4: `bash tests/run.sh --durations=0`, setup, call and teardown summed per file). Under
# pytest-xdist they are handed out first, and the short files fill in around them: a long file
# handed out last would leave the other worker idle until it ends. Files not named follow in
# collection order.
LONGEST_FIRST = (
    "test_training.py",        # 266 s
    "test_export.py",          # 145 (alone, not under two workers)
    "test_pipeline.py",        # 125
    "test_preemption.py",      # 91
    "test_cluster.py",         # 87
    "test_rank_failure.py",    # 87
    "test_reliability.py",     # 85
    "test_decode.py",          # 84
    "test_backtranslate.py",   # 67
    "test_translate.py",       # 67
    "test_atlas.py",           # 64
    "test_fast_paths.py",      # 58
    "test_bad_input.py",       # 56
    "test_two_hosts.py",       # 44
    "test_data_prep.py",       # 36
)


def pytest_collection_modifyitems(config, items):
    """The files of LONGEST_FIRST first, in its order; the tests of a file keep theirs (a sort by a
    key is stable)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_configure(config):
    """pytest-xdist hands the files out in the collection's order (pytest_collection_modifyitems),
    not sorted by how many tests each holds (its default for --dist loadfile).

    torch.compile's on-disk caches (compiled graphs, generated kernels, autotuning results) in
    a folder of this session, removed at its end, unless TORCHINDUCTOR_CACHE_DIR is set: every
    test that compiles compiles, as on a fresh machine, instead of loading what an earlier run
    left in the system's temporary folder. Subprocesses inherit the variable."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        config.inductor_cache = os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="admin-ds-inductor-")


def pytest_unconfigure(config):
    folder = getattr(config, "inductor_cache", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)


def overrides(tmp, data_dir, *extra) -> list:
    return [f"--data.path={data_dir}", f"--data.max_tokens={SMALL_DATA['max_tokens']}", f"--train.run_dir={tmp}",
            "--optim.warmup_updates=4", "--optim.lr=2e-3", "--train.final_eval=false", *extra]


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    from admin_ds.data.binarize import prepare_default_data

    out = tmp_path_factory.mktemp("data") / "default"
    prepare_default_data(out, n_pairs=SMALL_DATA["default_pairs"], vocab_size=SMALL_DATA["default_vocab_size"],
                         seed=1, log=lambda *_: None)
    return out


@pytest.fixture(scope="session")
def fixed_profile(tmp_path_factory, data_dir):
    tmp = tmp_path_factory.mktemp("profile")
    spawn(1, "profile_only", tmp / "out", run_overrides=overrides(tmp / "run", data_dir, *NO_DROPOUT),
          ds=ZERO[0], tmp=str(tmp))
    return tmp / "run" / "admin_profile.json"


REFERENCE_UPDATES = 4


def reference_args(run_dir, data_dir, port, ds=REPO / "ds_configs/zero2.json") -> list:
    """launch/train.py's arguments for runs compared with ``two_rank_reference``: dropout off, so
    that a run resumed on another layout (other ranks, other dropout streams) continues it exactly."""
    return [*run_args(run_dir, data_dir, port, REFERENCE_UPDATES, ds=ds), *NO_DROPOUT]


@pytest.fixture(scope="session")
def two_rank_reference(tmp_path_factory, data_dir):
    """Losses of `deepspeed --num_gpus 2 launch/train.py` (ZeRO-2, REFERENCE_UPDATES updates) on
    this machine: every other launch path, one host or two, must reproduce them."""
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), str(REPO / "launch/train.py"),
           *reference_args(run_dir, data_dir, free_port())]
    out = check(subprocess.run(cmd, capture_output=True, text=True, env=clean_env(), timeout=600), "deepspeed")
    assert "[world] 2 rank(s)" in out
    return losses(run_dir)


@pytest.fixture(scope="module")
def single_thread():
    """One torch thread for a module's in-process decoding (what its expected outputs assume)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
