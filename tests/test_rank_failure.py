"""A rank that hangs or dies in the middle of an update, for real (CPU, gloo, three ranks started
with env:// variables, as a launcher starts them). Every surviving rank must end with one error
line naming the missing rank, its host and its step, and what it was itself waiting in, exit with
status 3, and leave no traceback: no rank may wait until the allocation ends. engine.dist_timeout_s
is 20 s here; the waits are bounded."""

import contextlib
import subprocess
import sys

import psutil
import pytest

from distributed import REPO, free_port
from launching import clean_env, run_args

WORLD = 3
RANK_LOST = 3


def _ranks(tmp_path, data_dir, fault):
    port = free_port()
    env = clean_env()
    args = [*run_args(tmp_path / "run", data_dir, free_port(), 20), "--engine.dist_timeout_s=20"]
    procs = []
    for r in range(WORLD):
        # Output to files: a rank blocked on a full pipe the test is not reading would hang for real.
        with open(tmp_path / f"rank{r}.out", "w") as out, open(tmp_path / f"rank{r}.err", "w") as err:
            procs.append(subprocess.Popen([sys.executable, str(REPO / "tests/fault_train.py"), fault, *args],
                                          env=dict(env, RANK=str(r), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(r),
                                                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
                                          stdout=out, stderr=err))
    return procs


@contextlib.contextmanager
def _cleaned_up(procs):
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # SIGKILL ends a stopped process too
            p.wait()


@pytest.mark.parametrize("fault, lost", [("stop_during_update:3:1", 1),   # hangs: SIGSTOP, sockets stay open
                                          ("stop_during_update:3:0", 0),   # the rank whose process holds the store
                                          ("kill_during_update:3:1", 1)])  # dies: SIGKILL
def test_survivors_name_the_rank_that_hangs_or_dies(tmp_path, data_dir, fault, lost):
    with _cleaned_up(_ranks(tmp_path, data_dir, fault)) as procs:
        errs = {}
        for r, p in enumerate(procs):
            if r != lost:
                p.wait(timeout=600)
                errs[r] = (tmp_path / f"rank{r}.err").read_text()
                assert p.returncode == RANK_LOST, (r, errs[r][-3000:])
        if fault.startswith("stop"):
            assert psutil.Process(procs[lost].pid).status() == psutil.STATUS_STOPPED  # hung, not gone
    for r, err in errs.items():
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
        line = errors[0]
        assert line.startswith(f"error: rank {r} (") and " stops in update 3" in line, line
        if lost == 0:
            assert "rank 0 did not arrive: the rendezvous store in its process has not answered" in line, line
        else:
            assert f"rank {lost} (" in line and "last seen in update " in line and "did not arrive" in line, line
        assert "engine.dist_timeout_s=20" in line and "(exit status 3)" in line, line
