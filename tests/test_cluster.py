"""Cluster launch paths, really launched on this machine (CPU, gloo): the deepspeed launcher,
plain mpirun with mpi4py discovery, Slurm's variables, and deepspeed's openmpi launcher with a
hostfile and a .deepspeed_env. Each run's losses must equal the reference launch's."""

import json
import shutil
import subprocess
import sys
import time

import pytest

from conftest import reference_args as run_args
from distributed import REPO, SMALL_DATA, free_port, spawn
from launching import check, clean_env, losses

needs_mpi = pytest.mark.skipif(shutil.which("mpirun") is None,
                               reason="OpenMPI (mpirun) is not installed; launch/setup_env.sh installs it as root")




@needs_mpi
def test_mpirun_with_mpi4py_discovery_matches_the_deepspeed_launcher(tmp_path, data_dir, two_rank_reference):
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "DS_ACCELERATOR", "-x",
           "OMP_NUM_THREADS", "-x", "PATH", sys.executable, str(REPO / "launch/train.py"),
           *run_args(tmp_path / "run", data_dir, free_port())]
    out = check(subprocess.run(cmd, capture_output=True, text=True, env=clean_env(), timeout=600), "mpirun")
    assert "[world] 2 rank(s)" in out
    assert losses(tmp_path / "run") == pytest.approx(two_rank_reference, rel=1e-6)


def test_two_processes_given_only_slurm_variables_form_the_world_and_train(tmp_path, data_dir, two_rank_reference):
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(REPO / "launch/train.py"), *run_args(tmp_path / "run", data_dir, port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=clean_env(SLURM_PROCID=str(r), SLURM_LOCALID=str(r), SLURM_NTASKS="2",
                                            SLURM_NNODES="1", SLURM_JOB_NODELIST="localhost"))
             for r in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][-2000:] + outs[1][-2000:]
    assert "[world] 2 rank(s): data-parallel 2 x pipeline 1" in outs[0]
    assert losses(tmp_path / "run") == pytest.approx(two_rank_reference, rel=1e-6)


@needs_mpi
def test_deepspeed_hostfile_with_openmpi_launcher_and_deepspeed_env(tmp_path, data_dir, two_rank_reference):
    """As the README says: write .deepspeed_env in the launch directory, then launch with a
    hostfile. DS_ACCELERATOR reaches the ranks only through that file."""
    (tmp_path / "hostfile").write_text("localhost slots=2\n")
    env = clean_env()
    check(subprocess.run([sys.executable, str(REPO / "launch/cluster_env.py")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60), "cluster_env.py")
    assert "DS_ACCELERATOR=cpu" in (tmp_path / ".deepspeed_env").read_text()
    cmd = ["deepspeed", "--hostfile", "hostfile", "--force_multi", "--no_ssh_check", "--master_addr", "127.0.0.1",
           "--launcher", "openmpi", "--launcher_args", "--allow-run-as-root --oversubscribe",
           str(REPO / "launch/train.py"), *run_args(tmp_path / "run", data_dir, free_port())]
    out = check(subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600),
                "deepspeed --launcher openmpi")
    assert "mpirun -n 2 -hostfile hostfile" in out and "-x DS_ACCELERATOR=cpu" in out
    assert losses(tmp_path / "run") == pytest.approx(two_rank_reference, rel=1e-6)


def test_a_rank_that_cannot_reach_the_master_fails_fast_naming_it(tmp_path, data_dir):
    port = free_port()  # nothing listens there
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, str(REPO / "launch/train.py"), *run_args(tmp_path / "run", data_dir, port),
                          "--engine.connect_timeout_s=3"], capture_output=True, text=True, timeout=120,
                         env=clean_env(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=str(port)))
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"cannot reach the master at 127.0.0.1:{port} within 3s" in out.stderr
    assert "Traceback" not in out.stderr
    assert time.monotonic() - t0 < 60


def test_layout_is_checked_against_the_config(tmp_path, data_dir):
    out = subprocess.run([sys.executable, str(REPO / "launch/train.py"), *run_args(tmp_path / "run", data_dir, free_port()),
                          "--engine.expect_world_size=8"], capture_output=True, text=True, timeout=120, env=clean_env())
    assert out.returncode == 2
    assert "engine.expect_world_size=8, but this launch has 1" in out.stderr


def test_ranks_of_one_node_with_the_same_local_rank_are_refused():
    """A launcher that gives two ranks of a node one LOCAL_RANK would put them on one GPU."""
    from admin_ds.distributed import describe_ranks
    from admin_ds.errors import ConfigError

    net = {"interface": "cl0", "address": "198.18.0.1", "chosen_by": "route to the master"}
    ranks = [dict(net, host="n1", local_rank=0), dict(net, host="n2", local_rank=0), dict(net, host="n1", local_rank=1)]
    assert describe_ranks(ranks)[0] == "n1: rank(s) 0, 2, local rank(s) 0, 1; interface cl0 198.18.0.1 (route to the master)"
    ranks[2]["local_rank"] = 0
    with pytest.raises(ConfigError, match=r"ranks 0, 2 on n1 have the local ranks \[0, 0\]"):
        describe_ranks(ranks)


def test_slurm_nodelist_expansion():
    from admin_ds.distributed import expand_nodelist

    assert expand_nodelist("gpu[01-03,07],cpu5") == ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]
    assert expand_nodelist("node1") == ["node1"]
    assert expand_nodelist("a[8-11],b[009-010]") == ["a8", "a9", "a10", "a11", "b009", "b010"]


# ---- leaving the process group -------------------------------------------------------------------


@pytest.mark.parametrize("stages", [1, 2])
def test_training_leaves_no_backend_thread_behind(tmp_path, data_dir, stages):
    """A gloo worker thread alive at interpreter exit can abort the process (SIGABRT after the
    work is done; admin_ds/distributed.py): after train.py's main returns, none may be left."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 1 if stages > 1 else 2}}))
    argv = ["--deepspeed_config", str(ds), f"--train.run_dir={tmp_path / 'run'}", f"--data.path={data_dir}",
            f"--data.max_tokens={SMALL_DATA['max_tokens']}", "--train.max_updates=1", "--train.final_eval=false",
            f"--engine.pipeline_stages={stages}"]
    for r in spawn(2, "command_then_threads", tmp_path / "out", command="train", argv=argv):
        assert r["status"] == 0
        assert r["after"] == [], f"process-group threads survived the teardown: {r['after']}"


def test_translation_on_two_ranks_leaves_no_backend_thread_behind(tmp_path, data_dir):
    """The same for translate.py, given a run directory: reading it imports DeepSpeed's
    checkpoint code after the group exists, which pinned the group (the old SIGABRT at exit)."""
    run = tmp_path / "run"
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    spawn(1, "command_then_threads", tmp_path / "train", command="train",
          argv=["--deepspeed_config", str(ds), f"--train.run_dir={run}", f"--data.path={data_dir}",
                f"--data.max_tokens={SMALL_DATA['max_tokens']}", "--train.max_updates=1", "--train.final_eval=false"])
    src = tmp_path / "src.txt"
    src.write_text("".join(f"{line}\n" for line in (data_dir / "test.en").read_text().splitlines()[:4]))
    out = spawn(2, "command_then_threads", tmp_path / "out", command="translate",
                argv=["--checkpoint", str(run), "--input", str(src), "--quiet", "--max-len-b", "3"])
    for r in out:
        assert r["status"] == 0
        assert r["after"] == [], f"process-group threads survived the teardown: {r['after']}"
