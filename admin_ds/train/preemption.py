"""Preemption and time limits: a signal asks the run to save and leave, and the ranks agree on it.

    stop = StopSignals()
    stop.install()                       # SIGTERM, SIGUSR1, SIGINT now only set a flag
    for update in ...:
        train_update()
        if stop.agreed(device):          # every rank, every update: one tiny all-reduce
            break                        # then save, and exit with REQUEUE_STATUS
    stop.restore()                       # after the save

A cluster says "your time is up" with a signal: Slurm sends SIGTERM at the time limit or on
preemption (then SIGKILL after KillWait), and SIGUSR1 ahead of time with ``--signal=USR1@120``;
Kubernetes sends SIGTERM; a person presses Ctrl-C (SIGINT). Any of them, on any rank, makes every
rank write a checkpoint at the next update boundary and exit with ``REQUEUE_STATUS``, which
launch/slurm.sbatch and launch/requeue.sh take as "saved, run me again".

Why a flag and an agreement. A signal arrives on one rank (or on all, at different moments) in the
middle of anything: a collective, a checkpoint write. Saving inside the handler would start a
collective save on one rank alone, and every other rank would wait for it forever. So the handler
only records the signal; at the update boundary every rank contributes its flags to one all-reduce
of three integers, so all of them see the same answer and save together. The all-reduce runs at
every update, signalled or not: a collective that only signalled ranks entered would hang. A
second signal while the checkpoint is being written only sets the flag again: the save is not
interrupted, and the checkpoint is atomic anyway (checkpoints.py) should SIGKILL follow.

75 is EX_TEMPFAIL of sysexits.h, "temporary failure, the user is invited to retry".
"""

from __future__ import annotations

import signal
import threading
from typing import Optional

import torch

from admin_ds import distributed

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
REQUEUE_STATUS = 75


class StopSignals:
    """Installs flag-only handlers for ``SIGNALS`` (in the main thread; elsewhere it records
    nothing, as signals are delivered to the main thread only) and restores the previous ones."""

    def __init__(self) -> None:
        self.received = [0] * len(SIGNALS)  # how many of each arrived on this rank
        self._previous: dict = {}

    def _handler(self, signum, frame) -> None:
        self.received[SIGNALS.index(signum)] += 1

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread() and not self._previous:
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handler)

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def agreed(self, device: torch.device) -> Optional[str]:
        """Collective: None if no rank received a signal, else e.g. "SIGUSR1 on 1 rank(s)"."""
        counts = torch.tensor([min(n, 1) for n in self.received], dtype=torch.int64, device=device)
        counts = distributed.all_reduce_sum(counts).tolist()
        if not any(counts):
            return None
        return ", ".join(f"{sig.name} on {n} rank(s)" for sig, n in zip(SIGNALS, counts) if n)
