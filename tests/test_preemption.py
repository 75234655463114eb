"""Preemption and time limits, with real ranks and real signals (CPU, gloo). A signal at a random
moment, on one rank or on all, makes every rank write one checkpoint at the next update boundary
and exit with status 75; the run resumed from that checkpoint equals the uninterrupted run, bit
for bit (dropout on). launch/slurm.sbatch requeues itself exactly on that status: it runs here
with Slurm's variables, an srun that starts the tasks on this machine and a stub scontrol that
records its calls (Slurm itself cannot run here). launch/requeue.sh reruns a plain deepspeed
launch on that status; there a second signal arrives while the checkpoint is written."""

import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from distributed import REPO, free_port
from launching import assert_same_state, clean_env, final_state, records, run_args, wait_for_update

UPDATES = 60
REQUEUE = 75
SLURM = {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "2", "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "localhost"}

SRUN = """#!/usr/bin/env bash
# srun on one machine: SLURM_NTASKS copies of the command, each with its task's variables; the
# status is the highest of the tasks' statuses, as srun's. The tasks' pids go to $SRUN_PIDS.
while [[ "$1" == -* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
    SLURM_PROCID=$i SLURM_LOCALID=$i SLURM_NODEID=0 "$@" &
    pids+=($!)
done
echo "${pids[*]}" > "$SRUN_PIDS"
status=0
for p in "${pids[@]}"; do
    wait "$p"; s=$?
    if (( s > status )); then status=$s; fi
done
exit $status
"""
SCONTROL = """#!/usr/bin/env bash
echo "$*" >> "$SCONTROL_CALLS"
"""


def _script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


class Slurm:
    """launch/slurm.sbatch as a job: submitted from a directory of its own (so its logs/ land
    there), with the stand-in srun and the recording scontrol first on the PATH."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.submit = tmp / "submit"
        self.submit.mkdir()
        (self.submit / "launch").symlink_to(REPO / "launch")
        bin_dir = tmp / "bin"
        bin_dir.mkdir()
        _script(bin_dir / "srun", SRUN)
        _script(bin_dir / "scontrol", SCONTROL)
        self.calls = tmp / "scontrol_calls"
        self.pids = tmp / "srun_pids"
        self.env = clean_env(**SLURM, SLURM_SUBMIT_DIR=str(self.submit), ADMIN_DS_PYTHON=sys.executable,
                             SCONTROL_CALLS=str(self.calls), SRUN_PIDS=str(self.pids))
        self.env["PATH"] = f"{bin_dir}:{self.env['PATH']}"

    def sbatch(self, args: list, restart: int = 0) -> subprocess.Popen:
        self.pids.unlink(missing_ok=True)
        env = dict(self.env, SLURM_RESTART_COUNT=str(restart))
        return subprocess.Popen(["bash", str(REPO / "launch/slurm.sbatch"), *args], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def scontrol_calls(self) -> list:
        return self.calls.read_text().splitlines() if self.calls.exists() else []

    def task_pids(self) -> list:
        return [int(p) for p in self.pids.read_text().split()]


def _finish(proc, limit_s=600):
    out, _ = proc.communicate(timeout=limit_s)
    return proc.returncode, out


@contextlib.contextmanager
def _cleaned_up(proc):
    """Whatever happens in the test, no process of this run outlives it."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
                with contextlib.suppress(psutil.Error):
                    p.kill()
            proc.communicate()


def _signal_at_random(run_dir, proc, pids, sig, rng):
    """At a random moment in the first third of the run (after a random update from 2 to
    UPDATES // 3 is logged, then a random 0-0.2 s), send ``sig`` to ``pids()``. The moment is
    chosen by update, not by time, so that the signal lands before the run ends on a machine of
    any speed. Returns the last update logged before the signal (read just before sending it) and
    a description for failure messages."""
    after = rng.randint(2, UPDATES // 3)
    wait_for_update(run_dir, after, proc)
    delay = rng.uniform(0, 0.2)
    time.sleep(delay)
    pids = pids()
    done = [r["update"] for r in records(run_dir, "train")]
    for pid in pids:
        os.kill(pid, sig)
    return done[-1], f"{sig.name} to pid(s) {pids} {delay:.2f} s after update {after}, update {done[-1]} logged"


def _stop_checks(run_dir, logged_before, what, out):
    """One checkpoint, at the first update boundary after the signal, and nothing trained after it."""
    stops = records(run_dir, "stop")
    assert len(stops) == 1, (what, out[-3000:])
    k = stops[0]["update"]
    assert logged_before <= k <= logged_before + 2, (what, k)
    assert [r["update"] for r in records(run_dir, "train")][-1] == k, what
    tags = sorted(p.name for p in (Path(run_dir) / "checkpoints").iterdir() if p.is_dir())
    assert tags == [f"update_{k:06d}"], (what, tags)
    assert (Path(run_dir) / "checkpoints" / tags[0] / "COMPLETE").is_file(), what
    return k


def _stop_line(out, sig, ranks="[12]"):
    """The '[stop]' line's count of ranks that had received ``sig``: when the signal reaches the
    ranks one by one, the update boundary can fall between them, and then fewer ranks have it
    there (all of them still stop at that boundary, as _stop_checks asserts)."""
    found = re.search(rf"\[stop\] {sig.name} on {ranks} rank\(s\): saved (\S+) at update (\d+); exit status 75", out)
    assert found, out[-3000:]
    return found


def _same_as_reference(run_dir, ref_dir, what):
    want = {r["update"]: r["loss"] for r in records(ref_dir, "train")}
    got = [(r["update"], r["loss"]) for r in records(run_dir, "train")]
    assert sorted(u for u, _ in got) == list(range(1, UPDATES + 1)), (what, got)
    assert all(loss == want[u] for u, loss in got), (what, got, want)
    tag = f"update_{UPDATES:06d}"
    assert_same_state(final_state(run_dir, tag, 2), final_state(ref_dir, tag, 2))


@pytest.fixture(scope="module")
def slurm_reference(tmp_path_factory, data_dir):
    """The uninterrupted run, through launch/slurm.sbatch: it ends with status 0 and does not
    requeue itself."""
    tmp = tmp_path_factory.mktemp("slurm_ref")
    slurm = Slurm(tmp)
    rc, out = _finish(slurm.sbatch(run_args(tmp / "run", data_dir, free_port(), UPDATES)))
    assert rc == 0, out[-3000:]
    assert "[slurm] job 4242 on localhost, start 1" in out
    assert slurm.scontrol_calls() == []
    return tmp / "run"


def test_sbatch_requeues_itself_when_a_signal_stopped_the_run(tmp_path, data_dir, slurm_reference):
    """Slurm's --signal=USR1@180: SIGUSR1 to every task at a random moment. The ranks save at
    the next update boundary and exit with 75; the script calls `scontrol requeue 4242`. The
    requeued job (SLURM_RESTART_COUNT=1) resumes, finishes with 0 and does not requeue again."""
    assert "#SBATCH --signal=USR1@" in (REPO / "launch/slurm.sbatch").read_text()
    assert "#SBATCH --requeue" in (REPO / "launch/slurm.sbatch").read_text()
    rng = random.Random()
    slurm = Slurm(tmp_path)
    run = tmp_path / "run"
    args = run_args(run, data_dir, free_port(), UPDATES)
    with _cleaned_up(slurm.sbatch(args)) as job:
        logged, what = _signal_at_random(run, job, slurm.task_pids, signal.SIGUSR1, rng)
        rc, out = _finish(job)
    assert rc == 0, (what, out[-3000:])
    k = _stop_checks(run, logged, what, out)
    assert _stop_line(out, signal.SIGUSR1).groups() == (f"{run / 'checkpoints'}/update_{k:06d}", str(k)), what
    assert slurm.scontrol_calls() == ["requeue 4242"], what

    rc, out = _finish(slurm.sbatch(args, restart=1))
    assert rc == 0, out[-3000:]
    assert "start 2" in out and f"[resume] from {run / 'checkpoints'}/update_{k:06d}: update {k}" in out
    assert slurm.scontrol_calls() == ["requeue 4242"], "requeued again after finishing"
    _same_as_reference(run, slurm_reference, what)


def test_sbatch_does_not_requeue_a_run_that_failed(tmp_path, data_dir):
    slurm = Slurm(tmp_path)
    rc, out = _finish(slurm.sbatch([*run_args(tmp_path / "run", data_dir, free_port(), UPDATES),
                                    "--optim.lr=-1"]))
    assert rc == 2, out[-3000:]
    assert "error: optim.lr: must be positive" in out
    assert slurm.scontrol_calls() == []


def test_requeue_wrapper_reruns_a_deepspeed_launch_stopped_by_a_signal(tmp_path, data_dir, slurm_reference):
    """`launch/requeue.sh deepspeed --num_gpus 2 ...`: SIGTERM to rank 1 alone at a random moment;
    rank 0 sends itself SIGINT while the checkpoint is written (tests/faults.py). The checkpoint
    is complete, the launcher exits with 75, the wrapper starts the command again, which resumes
    and finishes (the same fault fires during its final save), and the wrapper exits with 0."""
    rng = random.Random()
    run = tmp_path / "run"
    cmd = ["bash", str(REPO / "launch/requeue.sh"), "deepspeed", "--num_gpus", "2", "--master_port", str(free_port()),
           str(REPO / "tests/fault_train.py"), "signal_during_save:INT:0", *run_args(run, data_dir, free_port(), UPDATES)]
    def rank1():
        found = [p.pid for p in psutil.Process(wrapper.pid).children(recursive=True)
                 if "fault_train.py" in " ".join(p.cmdline()) and "--local_rank=1" in p.cmdline()]
        assert len(found) == 1, found
        return found

    with _cleaned_up(subprocess.Popen(cmd, env=clean_env(), text=True, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT)) as wrapper:
        logged, what = _signal_at_random(run, wrapper, rank1, signal.SIGTERM, rng)
        rc, out = _finish(wrapper)
    assert rc == 0, (what, out[-3000:])
    first, second = out.split("[requeue] status 75", 1)
    k = [r["update"] for r in records(run, "stop")][0]
    assert f"SIGINT to rank 0 while writing checkpoint {k}" in first, (what, first[-3000:])
    assert _stop_line(first, signal.SIGTERM, ranks="1").group(2) == str(k), what
    assert f"[resume] from {run / 'checkpoints'}/update_{k:06d}: update {k}" in second
    assert f"SIGINT to rank 0 while writing checkpoint {UPDATES}" in second  # ignored: the save completes
    assert "[requeue]" not in second
    tags = sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir())
    assert tags == [f"update_{k:06d}", f"update_{UPDATES:06d}"], tags
    _same_as_reference(run, slurm_reference, what)


def test_requeue_wrapper_checks_max_requeues_before_running_anything(tmp_path):
    """--max-requeues that is not a non-negative integer is refused before the first attempt (it
    used to be compared only after it, where `[` failed and the requeues went on unbounded); a
    valid cap ends the loop with 75."""
    runs = tmp_path / "runs"
    cmd = ["bash", "-c", f'echo x >> "{runs}"; exit {REQUEUE}']
    for bad in ("abc", "-1", "1e3", "", "1234567890"):
        r = subprocess.run(["bash", str(REPO / "launch/requeue.sh"), "--max-requeues", bad, *cmd],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 2 and not runs.exists(), (bad, r.returncode, r.stderr)
        assert r.stderr == f"error: --max-requeues: expected a non-negative integer (at most 9 digits), got '{bad}'\n"
    r = subprocess.run(["bash", str(REPO / "launch/requeue.sh"), "--max-requeues", "1", *cmd],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == REQUEUE and runs.read_text() == "x\nx\n", r.stderr
    assert "giving up (--max-requeues 1)" in r.stderr


def test_a_signal_to_the_requeue_wrapper_stops_the_run_after_a_checkpoint(tmp_path, data_dir):
    """SIGTERM to launch/requeue.sh itself (its caller wants the run to end): every process of the
    attempt gets SIGTERM, the ranks save at the next update boundary, the wrapper waits until the
    launcher and the ranks have ended and does not start the command again."""
    run = tmp_path / "run"
    cmd = ["bash", str(REPO / "launch/requeue.sh"), "deepspeed", "--num_gpus", "2", "--master_port", str(free_port()),
           str(REPO / "launch/train.py"), *run_args(run, data_dir, free_port(), UPDATES)]
    with _cleaned_up(subprocess.Popen(cmd, env=clean_env(), text=True, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT)) as wrapper:
        processes = []

        def wrapper_only():
            processes.extend(psutil.Process(wrapper.pid).children(recursive=True))
            return [wrapper.pid]

        logged, what = _signal_at_random(run, wrapper, wrapper_only, signal.SIGTERM, random.Random())
        rc, out = _finish(wrapper)
    assert rc not in (0, REQUEUE), (what, rc, out[-3000:])
    assert "[requeue]" not in out
    _stop_line(out, signal.SIGTERM)
    _stop_checks(run, logged, what, out)
    assert len(processes) >= 4 and not [p for p in processes if p.is_running()], processes  # runner, launcher, ranks
