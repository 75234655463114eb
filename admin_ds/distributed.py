"""Ranks: joining the process group, the few collectives every layer uses, and leaving cleanly.

Every multi-rank command (training, translation, back-translation) joins and leaves through here:

    with distributed.session(device_type="cpu") as (rank, world):
        ...                                     # collectives; the group is torn down on exit

Joining covers every launcher: env:// from ``deepspeed`` / ``torchrun`` (RANK, WORLD_SIZE, ...),
our mapping of Slurm's variables (DeepSpeed reads none of them), and mpi4py discovery under a plain
``mpirun`` (DeepSpeed's ``mpi_discovery``, called here so that the master address is known before
the group is made). A rank that cannot reach the master gives up after ``connect_timeout_s`` with
the address and port instead of hanging in the rendezvous.

The interface. gloo binds each rank to the address its host name resolves to, unless
GLOO_SOCKET_IFNAME names an interface. On hosts whose /etc/hosts maps the host name to 127.0.1.1
(Debian and Ubuntu do), that is loopback: one host works, two hosts cannot connect. So, unless the
user set it, GLOO_SOCKET_IFNAME becomes the interface holding the address this host uses to reach
the master (a route lookup; nothing is sent); on the master's own host, where that can be loopback
while the job spans several nodes, the first interface that is up with an IPv4 address. NCCL picks
its own interface (it skips loopback); NCCL_SOCKET_IFNAME is left to the user. ``world_layout``
reports every rank's host, local rank, interface and address, and the loop prints them.

Leaving. A gloo process group runs its collectives on C++ worker threads (``pt_gloo_runloop``).
A worker that releases the last reference to a tensor Python also knew must take the GIL; if the
interpreter is already finalizing, CPython ends that thread with ``pthread_exit``, whose forced
unwind through a ``noexcept`` C++ frame calls ``std::terminate``: the process dies with SIGABRT
("terminate called without an active exception") after all its work is done, and the launcher
then kills the other ranks and fails the job. Destroying the group before the interpreter exits
joins those threads, but only if nothing else still holds the group. Two things do (torch 2.13,
DeepSpeed 0.19.8): default arguments evaluated at import (``group=group.WORLD`` in
``torch.distributed.nn.functional``, ``process_group=dist.group.WORLD`` in FSDP's
``ShardedGradScaler``, which DeepSpeed, ``torch._dynamo`` and DeepSpeed's checkpoint readers
import), so importing them while a group exists pins it; and DeepSpeed's own module globals of the
groups it made. Hence ``init`` imports those modules *before* creating the group, and ``shutdown``
ends with a barrier (no collective in flight on any rank), the destroy, and DeepSpeed's group
handles dropped. tests/test_cluster.py checks that no gloo thread survives a command.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import importlib
import os
import socket
import sys
import time
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from admin_ds.errors import ConfigError


# ------------------------------------------------------------------------------------------------
# Joining
# ------------------------------------------------------------------------------------------------


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compact host list ("gpu[01-03,07],cpu5") as host names, in order, as
    ``scontrol show hostnames`` prints them (used when scontrol is not on the compute node)."""
    hosts, i, n = [], 0, len(nodelist)
    while i < n:
        j = i
        while j < n and nodelist[j] not in ",[":
            j += 1
        prefix = nodelist[i:j]
        if j < n and nodelist[j] == "[":
            k = nodelist.index("]", j)
            for part in nodelist[j + 1:k].split(","):
                lo, _, hi = part.partition("-")
                width = len(lo)
                for v in range(int(lo), int(hi or lo) + 1):
                    hosts.append(f"{prefix}{v:0{width}d}")
            j = k + 1
        elif prefix:
            hosts.append(prefix)
        i = j + 1 if j < n and nodelist[j] == "," else j
    return hosts


def _env_from_slurm(port: int) -> None:
    """Slurm without PMI: map SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS and the first host of
    SLURM_JOB_NODELIST to RANK, LOCAL_RANK, WORLD_SIZE and MASTER_ADDR."""
    env = os.environ
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise ConnectionError("SLURM_PROCID is set but SLURM_JOB_NODELIST is not: cannot find the master host")
    env.update(RANK=env["SLURM_PROCID"], LOCAL_RANK=env.get("SLURM_LOCALID", "0"),
               WORLD_SIZE=env.get("SLURM_NTASKS", env.get("SLURM_NPROCS", "1")))
    env.setdefault("MASTER_ADDR", expand_nodelist(nodelist)[0])
    env.setdefault("MASTER_PORT", str(port))


def _wait_for_master(timeout_s: float) -> None:
    """Non-zero ranks: fail with the address and port after ``timeout_s`` if the master's
    rendezvous port never accepts a connection, instead of hanging in init_process_group."""
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((addr, port), timeout=2):
                return
        except OSError as e:
            last = e
            time.sleep(0.5)
    raise ConnectionError(f"rank {os.environ.get('RANK')}: cannot reach the master at {addr}:{port} within "
                          f"{timeout_s:.0f}s ({last}); check MASTER_ADDR/MASTER_PORT, that rank 0 is running, "
                          "and that the port is open between the nodes (engine.connect_timeout_s)")


def _spans_nodes() -> bool:
    """Do the launcher's variables say that the job spans several nodes? (Known before the group
    exists; a launcher that says nothing counts as one node.)"""
    env = os.environ
    if "SLURM_PROCID" in env:
        return int(env.get("SLURM_NNODES", env.get("SLURM_JOB_NUM_NODES", "1"))) > 1
    if "CROSS_SIZE" in env:  # deepspeed's per-node launcher: the number of nodes
        return int(env["CROSS_SIZE"]) > 1
    for local, world in (("OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_SIZE"), ("LOCAL_WORLD_SIZE", "WORLD_SIZE")):
        if local in env and world in env:
            return int(env[local]) < int(env[world])
    return False


def _local_address_towards(host: str) -> Optional[str]:
    """The local IPv4 address the kernel would use to reach ``host``. A UDP ``connect`` only looks
    the route up; no packet is sent."""
    try:
        ip = socket.gethostbyname(host)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def _ipv4_interfaces() -> dict[str, str]:
    """Interfaces that are up, with their first IPv4 address, in the kernel's order."""
    import psutil  # a DeepSpeed dependency

    up = {name for name, st in psutil.net_if_stats().items() if st.isup}
    return {name: next(a.address for a in addrs if a.family == socket.AF_INET)
            for name, addrs in psutil.net_if_addrs().items()
            if name in up and any(a.family == socket.AF_INET for a in addrs)}


def _choose_interface(device_type: str) -> None:
    """Record (and for gloo, set) the interface this rank's collectives use (module docstring)."""
    var = "GLOO_SOCKET_IFNAME" if device_type == "cpu" else "NCCL_SOCKET_IFNAME"
    interfaces = _ipv4_interfaces()
    if os.environ.get(var):
        name = os.environ[var].split(",")[0]
        _SOCKET.update(interface=name, address=interfaces.get(name), chosen_by=var)
        return
    address = _local_address_towards(os.environ["MASTER_ADDR"])
    name = next((n for n, a in interfaces.items() if a == address), None)
    chosen_by = "route to the master"
    if (address is None or address.startswith("127.")) and _spans_nodes():
        # The master's own host can resolve its name to loopback; the others must reach us.
        name, address = next(((n, a) for n, a in interfaces.items() if not a.startswith("127.")), (None, None))
        chosen_by = "first interface that is up (the master's name is loopback here)"
    if device_type != "cpu":
        _SOCKET.update(interface=None, address=address, chosen_by=f"NCCL's choice ({var} unset)")
        return
    if name is not None:
        os.environ[var] = name
    _SOCKET.update(interface=name, address=address, chosen_by=chosen_by if name else "gloo's default")


_SOCKET: dict = {"interface": None, "address": None, "chosen_by": None}  # this rank's choice, reported by world_layout


def launched() -> bool:
    """Was this process started as one rank of several (a launcher's or Slurm's variables)?"""
    env = os.environ
    if "OMPI_COMM_WORLD_SIZE" in env or "PMI_SIZE" in env:
        return int(env.get("OMPI_COMM_WORLD_SIZE", env.get("PMI_SIZE", "1"))) > 1
    if "WORLD_SIZE" in env:
        return int(env["WORLD_SIZE"]) > 1
    return int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env


def _skip_cpu_shm_build() -> None:
    """DeepSpeed JIT-compiles a CPU shared-memory comm op in every TorchBackend (98 s cold on two
    cores), used only by inference all-reduce. Replace the builder before init_distributed.
    ``import deepspeed.comm.torch as m`` would bind torch itself (deepspeed.comm re-exports it)."""
    importlib.import_module("deepspeed.comm.torch")
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None


def init(device_type: str = "cpu", port: int = 29500, timeout_s: float = 600,
         connect_timeout_s: float = 120, standalone: bool = True) -> tuple[int, int]:
    """Join the process group; returns ``(rank, world_size)``.

    ``standalone``: a process started without a launcher joins a world of one on a free local port
    (DeepSpeed needs a group even then). Without it, such a process stays out of torch.distributed
    and gets ``(0, 1)`` (translation on one process). gloo on CPU, NCCL on GPUs."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if not launched() and not standalone:
        return 0, 1
    # Before the group exists: these evaluate `group.WORLD` into default arguments at import and
    # would pin the group (module docstring). DeepSpeed imports FSDP and torch._dynamo.
    import deepspeed
    import torch.distributed.nn  # noqa: F401

    if device_type == "cpu":
        _skip_cpu_shm_build()
    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" in env and "OMPI_COMM_WORLD_SIZE" not in env:
        _env_from_slurm(port)
    if "RANK" not in env and "OMPI_COMM_WORLD_SIZE" in env:
        # DeepSpeed would run this inside init_distributed; here, so the interface can be chosen
        # before the group exists. It sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.
        from deepspeed.comm.comm import mpi_discovery

        mpi_discovery(distributed_port=port, verbose=False)
    if not launched() and "RANK" not in env:
        # A plain `python launch/train.py`: a world of one on a free local port. (DeepSpeed would
        # otherwise run MPI discovery, which pins the port to distributed_port, so two standalone
        # runs on one machine would collide.)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            free = sock.getsockname()[1]
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=env.get("MASTER_PORT", str(free)))
    env.setdefault("LOCAL_RANK", env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"))
    if "MASTER_ADDR" in env:
        _choose_interface(device_type)
    if int(env["RANK"]) > 0 and "MASTER_ADDR" in env:
        _wait_for_master(connect_timeout_s)
    if device_type == "cuda":
        torch.cuda.set_device(int(env["LOCAL_RANK"]))
    try:
        deepspeed.init_distributed(dist_backend="gloo" if device_type == "cpu" else "nccl", distributed_port=port,
                                   timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:  # torch's DistNetworkError: rank 0 could not listen on the rendezvous port
        if "EADDRINUSE" not in str(e):
            raise
        taken = env.get("MASTER_PORT", port)
        raise ConnectionError(f"port {taken} on {env.get('MASTER_ADDR', 'this host')} is taken (another run on this "
                              "machine?): choose another with `deepspeed --master_port N ...` or MASTER_PORT=N; "
                              "a single process without MASTER_PORT picks a free one") from None
    return dist.get_rank(), dist.get_world_size()


def shutdown(clean: bool = True) -> None:
    """Leave the process group (see the module docstring). ``clean``: every rank got here on its
    normal path, so a barrier first makes sure no collective is still in flight anywhere; after an
    error the barrier is skipped (a failed rank would never arrive)."""
    if not dist.is_initialized():
        return
    try:
        if clean and dist.get_world_size() > 1:
            dist.barrier()
    finally:
        dist.destroy_process_group()
        _forget_deepspeed_groups()
        gc.collect()  # groups still referenced from collectable cycles go now, joining their threads


def _forget_deepspeed_groups() -> None:
    """DeepSpeed keeps the groups it made in module globals and offers no reset: the world,
    data-parallel and model-parallel groups and the pipeline grid (``mpu``) in
    ``deepspeed.utils.groups``, the pipeline's
    point-to-point groups and grid in ``deepspeed.runtime.pipe.p2p``. After the destroy they are
    dead handles that keep the backends (and their threads) alive: drop them."""
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None:
        for name, value in list(vars(groups).items()):
            if name.startswith("_") and name.endswith("_GROUP"):
                if isinstance(value, dict):
                    value.clear()
                else:
                    setattr(groups, name, None)
        groups.mpu = None  # the pipeline engine's grid, which holds its groups
    p2p = sys.modules.get("deepspeed.runtime.pipe.p2p")
    if p2p is not None:
        p2p._groups = p2p._grid = None


@contextlib.contextmanager
def session(device_type: str = "cpu", standalone: bool = False, **kwargs) -> Iterator[tuple[int, int]]:
    """``init`` on entry, ``shutdown`` on exit (without the barrier when leaving with an error)."""
    ranks = init(device_type, standalone=standalone, **kwargs)
    clean = False
    try:
        yield ranks
        clean = True
    finally:
        shutdown(clean)


# ------------------------------------------------------------------------------------------------
# Where am I, and the small collectives
# ------------------------------------------------------------------------------------------------


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def world_layout() -> dict:
    """Every rank's host, local rank, interface and address; nodes and ranks per node, in rank
    order of first appearance (collective)."""
    mine = {"host": socket.gethostname(), "local_rank": int(os.environ.get("LOCAL_RANK", 0)), **_SOCKET}
    ranks = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
    per_node: dict[str, int] = {}
    for r in ranks:
        per_node[r["host"]] = per_node.get(r["host"], 0) + 1
    return {"world_size": len(ranks), "nodes": len(per_node), "ranks_per_node": per_node, "ranks": ranks}


def describe_ranks(ranks: list[dict]) -> list[str]:
    """One line per node: its ranks, their local ranks, the interface and address they talk over.
    Two ranks of one node with the same local rank would share a GPU: refused."""
    lines = []
    for host in dict.fromkeys(r["host"] for r in ranks):
        mine = [(i, r) for i, r in enumerate(ranks) if r["host"] == host]
        local = [r["local_rank"] for _, r in mine]
        if len(set(local)) != len(local):
            raise ConfigError(f"ranks {', '.join(str(i) for i, _ in mine)} on {host} have the local ranks {local}: "
                              "each rank of a node needs its own; check the launcher's LOCAL_RANK / SLURM_LOCALID")
        nets = sorted({f"{r['interface'] or '?'} {r['address'] or '?'} ({r['chosen_by']})" for _, r in mine})
        lines.append(f"{host}: rank(s) {', '.join(str(i) for i, _ in mine)}, local rank(s) "
                     f"{', '.join(map(str, local))}; interface {'; '.join(nets)}")
    return lines


def pin_to_cores() -> list[int]:
    """Bind this rank to its own share of its node's CPU cores and return them (collective).

    Ranks on one node that all start with the same cores (torchrun, the deepspeed launcher) split
    them into contiguous, disjoint blocks in local-rank order: unpinned, every rank's intra-op
    threads roam over all cores, and two ranks' OpenMP teams then preempt each other's
    spin-waiting threads, which costs more than the second rank gains. Ranks a launcher already
    bound to different cores (mpirun --bind-to) keep them. With more ranks than cores, ranks
    share cores round-robin."""
    cores = sorted(os.sched_getaffinity(0))
    mine = (socket.gethostname(), cores)
    everyone = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    local = [c for h, c in everyone if h == mine[0]]
    if any(c != cores for c in local):
        return cores
    i, n = [r for r, (h, _) in enumerate(everyone) if h == mine[0]].index(rank()), len(local)
    share = [cores[i % len(cores)]] if n > len(cores) else cores[len(cores) * i // n:len(cores) * (i + 1) // n]
    os.sched_setaffinity(0, share)
    return share


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


_alone = 0  # how many rank0_alone blocks this rank has entered: the same count on every rank


@contextlib.contextmanager
def rank0_alone(poll_s: float = 0.5) -> Iterator[None]:
    """Around work rank 0 does alone for as long as it takes (BLEU decoding, a checkpoint
    conversion), on every rank: the others wait for its end in the rendezvous store, polling, not
    in the next collective, which would fail after the group's timeout (engine.dist_timeout_s)
    however healthy rank 0 is. A rank 0 that dies meanwhile is named by the training's watchdog."""
    global _alone
    if not dist.is_initialized() or dist.get_world_size() == 1:
        yield
        return
    _alone += 1
    key = f"admin_ds/rank0_alone/{_alone}"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    if dist.get_rank() == 0:
        try:
            yield
        finally:
            store.set(key, "done")
    else:
        yield
        while not store.check([key]):
            time.sleep(poll_s)


def all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    """Sum over ranks (in place, returned); float64 statistics stay float64 on gloo and NCCL.
    NCCL reduces GPU tensors only: a CPU tensor (token counts, loss sums) goes through the GPU."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        if t.device.type == "cpu" and dist.get_backend(group) == "nccl":
            on_gpu = t.to(torch.cuda.current_device())
            dist.all_reduce(on_gpu, op=dist.ReduceOp.SUM, group=group)
            t.copy_(on_gpu)
        else:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def broadcast_object(obj, src: int = 0):
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_object(obj, dst: int = 0) -> Optional[list]:
    """Every rank's ``obj`` on ``dst`` in rank order, None elsewhere."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    parts = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(obj, parts, dst=dst)
    return parts
