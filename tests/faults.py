"""Real faults for tests, injected through the run's hooks (admin_ds/train/hooks.py): the
production loop carries no fault code.

A spec is a comma-separated list; each fault fires at most once per process:
    kill_during_profile         SIGKILL after profiling, before omega is written
    kill_during_update:U[:R]    SIGKILL during update U (after its first forward), on rank R
                                (default: every rank)
    stop_during_update:U:R      SIGSTOP there, on rank R: the process hangs, its sockets stay open
    kill_during_save:U          SIGKILL while checkpoint U is written (after DeepSpeed's first file)
    enospc_during_save:U        OSError(ENOSPC) there instead: the run stops, the previous
                                complete checkpoint stays the one to resume from
    signal_during_save:SIG:R    rank R sends itself signal SIG (TERM, USR1, INT) while any
                                checkpoint is written (after DeepSpeed's first file)
    nan_loss:U[-V][:R]          rank R's (default 0) first micro-batch loss x NaN in updates
                                U..V; may repeat. In a pipeline R must be a last-stage rank
    spike_loss:U:F              every micro-batch loss x F in update U

    hooks = Faults("nan_loss:3,spike_loss:6:30").install(Hooks())
    python tests/fault_train.py kill_during_update:5 --deepspeed_config ... (launch/train.py's arguments)
"""

from __future__ import annotations

import errno
import os
import signal
from typing import Optional

import torch

from admin_ds.train.hooks import Hooks

TAG = "injected by tests/faults.py"


class Faults:
    def __init__(self, spec: str = "") -> None:
        self.spec: dict[str, list[list[str]]] = {}  # a name may repeat: nan_loss:3,nan_loss:9-10
        for item in filter(None, (s.strip() for s in spec.split(","))):
            name, _, arg = item.partition(":")
            self.spec.setdefault(name, []).append(arg.split(":") if arg else [])
        self.fired: set = set()
        self._update = 0
        self._micro = 0
        self._spiking: Optional[float] = None

    def install(self, hooks: Hooks) -> Hooks:
        hooks.on_profiled.append(self.profiled)
        hooks.on_update_start.append(self.update_start)
        hooks.on_loss.append(self.loss)
        hooks.on_checkpoint_write.append(self.checkpoint_write)
        return hooks

    def _once(self, key) -> bool:
        if key in self.fired:
            return False
        self.fired.add(key)
        return True

    def _at(self, name: str, update: int, rank: Optional[int] = None, default_rank: Optional[int] = 0) -> bool:
        """Is ``name`` armed for ``update`` (and ``rank``: the fault's second argument, else
        ``default_rank``; None: every rank)?"""
        for args in self.spec.get(name, []):
            lo, _, hi = args[0].partition("-")
            armed = int(args[1]) if len(args) > 1 else default_rank
            on_rank = rank is None or armed is None or armed == rank
            if int(lo) <= update <= int(hi or lo) and on_rank:
                return self._once((name, update))
        return False

    @staticmethod
    def _kill(where: str) -> None:
        print(f"[fault] SIGKILL {where} ({TAG})", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    # ---- the hooks ---------------------------------------------------------------------------
    def profiled(self) -> None:
        if "kill_during_profile" in self.spec and self._once("kill_during_profile"):
            self._kill("during profiling")

    def update_start(self, update: int) -> None:
        self._update, self._micro = update, 0

    def loss(self, loss: torch.Tensor, rank: int) -> torch.Tensor:
        if not torch.is_grad_enabled():  # validation
            return loss
        u, micro = self._update, self._micro
        self._micro += 1
        if micro == 0 and self._at("kill_during_update", u, rank, default_rank=None):
            self._kill(f"during update {u}")
        if micro == 0 and self._at("stop_during_update", u, rank):
            print(f"[fault] SIGSTOP on rank {rank} during update {u} ({TAG})", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        if micro == 0 and self._at("nan_loss", u, rank):
            loss = loss * float("nan")
        if micro == 0:
            self._spiking = next((float(a[1]) for a in self.spec.get("spike_loss", []) if int(a[0]) == u), None)
            if self._spiking is not None and not self._once(("spike_loss", u)):
                self._spiking = None
        if self._spiking is not None:
            loss = loss * self._spiking
        return loss

    def checkpoint_write(self, update: int, written: int) -> None:
        """Before each DeepSpeed file of checkpoint ``update``; faults fire before the second."""
        if written < 1:
            return
        for sig, rank in self.spec.get("signal_during_save", []):
            if int(rank) == int(os.environ.get("RANK", 0)) and self._once(("signal_during_save", update)):
                print(f"[fault] SIG{sig} to rank {rank} while writing checkpoint {update} ({TAG})", flush=True)
                os.kill(os.getpid(), getattr(signal, f"SIG{sig}"))
        if self._at("kill_during_save", update):
            self._kill(f"while writing checkpoint {update}")
        if self._at("enospc_during_save", update):
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({TAG})")


def unwritable_dir(tmp) -> str:
    """A directory in which nothing can be created: ``tmp/ro`` with mode 555, or, for root (whom
    modes do not stop), ``/proc/self`` (procfs refuses new entries to everyone on Linux). Checked
    here, so that a test built on it fails instead of passing vacuously."""
    path = "/proc/self" if os.geteuid() == 0 else os.path.join(tmp, "ro")
    if path != "/proc/self":
        os.mkdir(path)
        os.chmod(path, 0o555)
    try:
        os.mkdir(os.path.join(path, "admin_ds_probe"))
    except OSError:
        return path
    raise AssertionError(f"{path}: expected a directory nothing can be created in")
