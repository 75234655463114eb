"""Launching launch/train.py as a user would, for the launcher, preemption and multi-host tests:
its arguments, an environment without the variables of whoever runs the tests, and what a run
leaves behind (per-update losses, final model and optimizer state)."""

import json
import os
import sys
import time
from pathlib import Path

import torch

from distributed import REPO, SMALL_DATA


def run_args(run_dir, data_dir, port, updates, ds=REPO / "ds_configs/zero2.json"):
    return ["--deepspeed_config", str(ds), f"--train.run_dir={run_dir}", f"--data.path={data_dir}",
            f"--data.max_tokens={SMALL_DATA['max_tokens']}", f"--train.max_updates={updates}",
            "--train.log_interval=1", "--train.final_eval=false", f"--engine.distributed_port={port}"]


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME")
           and not k.startswith(("SLURM_", "OMPI_", "PMI"))}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PATH=f"{Path(sys.executable).parent}:{env['PATH']}")
    env.update(extra)
    return env


def records(run_dir, kind):
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return [r for r in rows if r["kind"] == kind]


def losses(run_dir):
    return [r["loss"] for r in records(run_dir, "train")]


def check(proc_or_result, what):
    out = proc_or_result.stdout + (proc_or_result.stderr or "")
    assert proc_or_result.returncode == 0, f"{what} failed:\n{out[-3000:]}"
    return out


def wait_for_update(run_dir, update, proc, limit_s=600):
    """Poll the run log until ``update`` is logged; fails if the run ends first (or after
    ``limit_s``, a bound for a stuck run, not a performance limit)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        done = [r["update"] for r in records(run_dir, "train")]
        if done and done[-1] >= update:
            return done[-1]
        assert proc.poll() is None, f"the run ended before update {update}:\n{proc.communicate()[0][-3000:]}"
        time.sleep(0.05)
    raise AssertionError(f"update {update} not reached within {limit_s} s")


def final_state(run_dir, tag, world):
    """The whole module (rank 0's model file) and every rank's fp32 master partition of a
    data-parallel ZeRO-1/2 checkpoint."""
    d = Path(run_dir) / "checkpoints" / tag
    module = torch.load(d / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    masters = [torch.load(d / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt", weights_only=False)
               ["optimizer_state_dict"]["single_partition_of_fp32_groups"] for r in range(world)]
    return module, masters


def assert_same_state(a, b):
    (module_a, masters_a), (module_b, masters_b) = a, b
    assert module_a.keys() == module_b.keys()
    differ = [k for k in module_a if not torch.equal(module_a[k], module_b[k])]
    assert not differ, f"parameters differ: {differ[:5]}"
    assert all(torch.equal(x, y) for pa, pb in zip(masters_a, masters_b) for x, y in zip(pa, pb))
