"""Two hosts for real (tests/netns.py): each node is a network namespace with its own address and
host name, and its own mount of one shared run directory. The ranks rendezvous over the 198.18
network, never over loopback, through the deepspeed launcher (`--no_ssh --node_rank`, one per
node, as without ssh), through mpirun (its rsh agent enters the other node) with mpi4py discovery,
and through Slurm's variables. The losses equal the single-host reference. Then the node that holds
rank 0 is lost: the next run, on the remaining node alone, resumes from the 2-host checkpoint
through DeepSpeed's universal checkpoint and continues the reference run."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

import netns
from conftest import REFERENCE_UPDATES, reference_args
from distributed import REPO
from launching import clean_env, losses

PORT = 29500  # each node has its own network: no other test can hold a port there


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, data_dir):
    reason = netns.unavailable()
    if reason:
        pytest.skip(f"two namespaced hosts: {reason}")
    tmp = tmp_path_factory.mktemp("two_hosts")
    with netns.TwoHosts(tmp) as c:
        shutil.copytree(data_dir, c.storage / "data")  # the data, too, on the shared file system
        yield c
    assert not any(c.shared.iterdir()), "something was written to the mount point outside the nodes"


def _env(**extra):
    env = clean_env(**extra)
    env["PYTHONPATH"] = f"{REPO}:{env.get('PYTHONPATH', '')}"
    return env


def _args(cluster, run, extra=(), ds=REPO / "ds_configs/zero2.json"):
    """launch/train.py's arguments, with every path on the shared mount."""
    return [*reference_args(cluster.shared / run, cluster.shared / "data", PORT, ds=ds),
            "--engine.connect_timeout_s=60", "--engine.dist_timeout_s=120", *extra]


def _wait(procs, logs, what):
    outs = []
    for p, log in zip(procs, logs):
        try:
            p.wait(timeout=600)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"{what}: no exit within 600 s") from None
        outs.append(log.read_text())
    for p, out in zip(procs, outs):
        assert p.returncode == 0, f"{what} failed ({p.returncode}):\n{out[-4000:]}"
    return outs


def _check_two_host_run(cluster, run, out0, reference):
    """What rank 0 printed about the world, the losses, and a checkpoint written from both hosts."""
    assert "[world] 2 node(s): node1 x 1, node2 x 1" in out0, out0[-3000:]
    assert "[world] node1: rank(s) 0, local rank(s) 0; interface cl0 198.18.0.1" in out0, out0[-3000:]
    assert "[world] node2: rank(s) 1, local rank(s) 0; interface cl0 198.18.0.2 (route to the master)" in out0
    assert losses(cluster.storage / run) == pytest.approx(reference, rel=1e-6)
    tag = cluster.storage / run / "checkpoints" / f"update_{REFERENCE_UPDATES:06d}"
    complete = json.loads((tag / "COMPLETE").read_text())
    wrote = set(complete["files"])  # written by rank 0 on node1 and rank 1 on node2, digests checked
    assert {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt",
            "rng_rank0.pt", "rng_rank1.pt"} <= wrote, wrote
    from admin_ds.checkpoint_format import verify

    assert verify(tag) is None
    assert (cluster.storage / run / "checkpoints" / "latest_complete").read_text().strip() == tag.name


def test_deepspeed_launcher_without_ssh_on_each_node_then_resume_on_the_remaining_node(cluster, two_rank_reference):
    """`deepspeed --hostfile H --no_ssh --node_rank=N --master_addr node1` on each node. The
    master's name resolves to 127.0.1.1 on node1 itself: its ranks must still be reachable."""
    (cluster.storage / "hostfile").write_text("node1 slots=1\nnode2 slots=1\n")
    logs = [cluster.storage.parent / f"ds_{node}.log" for node in netns.NODES]
    procs = [cluster.popen(node, ["deepspeed", "--hostfile", cluster.shared / "hostfile", "--no_ssh",
                                  f"--node_rank={i}", "--master_addr", "node1", "--master_port", PORT + 1,
                                  REPO / "launch/train.py", *_args(cluster, "ds", extra=["--train.save_interval_updates=2"])],
                           _env(), log)
             for i, (node, log) in enumerate(zip(netns.NODES, logs))]
    out0, _ = _wait(procs, logs, "deepspeed --no_ssh on two hosts")
    _check_two_host_run(cluster, "ds", out0, two_rank_reference)
    assert "first interface that is up (the master's name is loopback here)" in out0

    # node1 is lost. The next run has node2 alone: one rank, accumulation 2 (the same batches),
    # from the 2-host checkpoint of update 2, converted to a universal checkpoint on the way.
    (cluster.storage / "one_host" / "checkpoints").mkdir(parents=True)
    shutil.copytree(cluster.storage / "ds/checkpoints/update_000002", cluster.storage / "one_host/checkpoints/update_000002")
    ds = cluster.storage / "gas2.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 2}))
    log = cluster.storage.parent / "one_host.log"
    out, = _wait([cluster.popen("node2", [sys.executable, REPO / "launch/train.py",
                                           *_args(cluster, "one_host", ds=cluster.shared / "gas2.json")],
                                _env(), log)], [log], "one host")
    assert ("update 2, epoch 1; layout 2 rank(s) = data-parallel 2 x pipeline 1, ZeRO-2, fp32, accumulation 1 -> "
            "1 rank(s) = data-parallel 1 x pipeline 1, ZeRO-2, fp32, accumulation 2") in out, out[-3000:]
    assert (cluster.storage / "one_host/checkpoints/update_000002_universal/CONVERTED").is_file()
    got = losses(cluster.storage / "one_host")
    assert np.allclose(got, two_rank_reference[2:], rtol=1e-5), (got, two_rank_reference)


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="OpenMPI (mpirun) is not installed")
def test_mpirun_across_two_hosts_with_mpi4py_discovery(cluster, two_rank_reference):
    """mpirun on node1 starts node2's daemon through an rsh agent (as through ssh); DeepSpeed's
    mpi4py discovery takes the master address from `hostname -I` of node1."""
    log = cluster.storage.parent / "mpirun.log"
    cmd = ["mpirun", "--allow-run-as-root", "-np", "2", "--host", "node1:1,node2:1",
           "--mca", "plm_rsh_agent", cluster.agent(), "--mca", "btl", "self,tcp",
           "--mca", "btl_tcp_if_include", netns.INTERFACE, "--mca", "oob_tcp_if_include", netns.INTERFACE,
           "-x", "DS_ACCELERATOR", "-x", "OMP_NUM_THREADS", "-x", "PATH", "-x", "PYTHONPATH",
           sys.executable, REPO / "launch/train.py", *_args(cluster, "mpi")]
    out, = _wait([cluster.popen("node1", cmd, _env(), log)], [log], "mpirun on two hosts")
    _check_two_host_run(cluster, "mpi", out, two_rank_reference)
    assert "interface cl0 198.18.0.1 (route to the master)" in out


def test_slurm_variables_on_two_hosts(cluster, two_rank_reference):
    """What srun gives each task: SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, SLURM_NNODES and
    the node list, whose first host (node1) becomes the master."""
    logs = [cluster.storage.parent / f"slurm_{node}.log" for node in netns.NODES]
    slurm = dict(SLURM_NTASKS="2", SLURM_NNODES="2", SLURM_JOB_NODELIST="node[1-2]", SLURM_LOCALID="0")
    procs = [cluster.popen(node, [sys.executable, REPO / "launch/train.py", *_args(cluster, "slurm")],
                           _env(**slurm, SLURM_PROCID=str(i), SLURM_NODEID=str(i)), log)
             for i, (node, log) in enumerate(zip(netns.NODES, logs))]
    out0, _ = _wait(procs, logs, "Slurm's variables on two hosts")
    _check_two_host_run(cluster, "slurm", out0, two_rank_reference)
