"""A rank that dies or hangs: every surviving rank stops with an error that names it.

    watchdog = Watchdog(timeout_s=run.engine.dist_timeout_s)
    watchdog.start()                   # collective: after the process group exists
    watchdog.mark("update 7")          # what this rank is doing (one assignment)
    ...
    watchdog.stop()                    # before leaving the process group

What the backends do on their own. When a rank stops (SIGSTOP, a hung driver, a frozen node) or
dies (the OOM killer, a lost node), every other rank waits in its next collective. gloo raises
after the group's timeout (``engine.dist_timeout_s``) with "Timed out waiting 600000ms for recv
operation to complete", which names no rank; a dead peer's closed socket raises "Connection closed
by peer" at once. NCCL's own watchdog aborts the process after the timeout, naming the operation
(``WorkNCCL(SeqNum=.., OpType=ALLREDUCE)``) but not the missing rank. After a timeout the group is
broken: gloo's ``monitored_barrier``, which would name missing ranks, then fails at once ("Application
timeout caused pair closure"), and running one before every collective would cost a round trip each.

So every rank runs a heartbeat thread that does not depend on the backend. Every ``interval``
seconds it writes a counter and the rank's mark (its current step) into the rendezvous store, the
TCPStore at MASTER_ADDR:MASTER_PORT, through its own connection; a stopped or dead process stops
writing. Rank 0's thread reads every rank's entry and, when one has not changed for ``timeout_s``,
writes a verdict that every other rank's thread reads (one key per interval: O(1) store operations
per rank, O(world) on rank 0). The store lives in rank 0's process: when rank 0 is the one that
stopped, the others' store operations fail, and after ``timeout_s`` of that they name rank 0.

A collective that fails in the main thread (gloo's timeout or a closed connection; loop.train
passes the error here) leads to the same report: the verdict if there is one, otherwise the ranks
whose heartbeats do not move over two intervals. Each surviving rank prints one line on stderr
naming the missing ranks (host, process id, their last step) and what it was itself waiting in,
and exits with ``RANK_LOST_STATUS``. It exits with ``os._exit``: the main thread may be blocked
inside a C++ collective that cannot be unwound (NCCL's watchdog aborts for the same reason). The
checkpoints are atomic, so the next run resumes from the newest complete one, on the remaining
nodes if one is lost (a layout change: checkpoints.py).

On NCCL the heartbeat verdict comes first when the missing rank stopped before the others entered
the collective (its heartbeat is then older than the collective); otherwise NCCL's watchdog may
abort first with its own message. Only gloo is tested here (tests/test_rank_failure.py).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import threading
import time
from typing import Optional

import torch.distributed as dist

from admin_ds import distributed

RANK_LOST_STATUS = 3
_PREFIX = "admin_ds/watchdog/"
_VERDICT = _PREFIX + "verdict"


def looks_like_a_collective_failure(error: BaseException) -> bool:
    """gloo's timeouts and closed connections are plain RuntimeErrors naming a gloo source file."""
    return isinstance(error, dist.DistError) or "gloo" in str(error) or "NCCL" in str(error)


class Watchdog:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = float(timeout_s)
        self.interval = max(1.0, min(10.0, self.timeout_s / 6))
        self.rank, self.world = distributed.rank(), distributed.world_size()
        self.host = socket.gethostname()
        self._mark = "setup"
        self._beat = 0
        self._store = None
        self._store_lock = threading.Lock()  # the beat thread's, and the verdict's publisher
        self._failing = threading.Lock()  # the first report wins; the process then exits
        self._stopped = threading.Event()
        self._marked = threading.Event()
        self._answered = time.monotonic()  # when the store last answered a round
        self._suspect: Optional[str] = None  # the main thread's collective failed with this
        self._cleared = threading.Event()  # every rank's heartbeat moved since the collective failed
        self._threads: list[threading.Thread] = []

    # ---- the main thread -----------------------------------------------------------------------
    def start(self) -> None:
        """Collective. Every rank writes its first heartbeat before any rank starts judging."""
        if self.world == 1:
            return
        self._store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                    timeout=datetime.timedelta(seconds=2 * self.interval), wait_for_workers=False)
        self._beat_once()
        distributed.barrier()
        self._answered = time.monotonic()
        for target, name in ((self._beats, "admin-ds-heartbeat"), (self._alarm, "admin-ds-alarm")):
            self._threads.append(threading.Thread(target=target, name=name, daemon=True))
            self._threads[-1].start()

    def mark(self, step: str) -> None:
        """The beat thread writes the new mark at once, so a rank that stops is reported at its step."""
        self._mark = step
        self._marked.set()

    def stop(self) -> None:
        self._stopped.set()
        self._marked.set()
        for t in self._threads:
            t.join()
        self._threads.clear()
        self._store = None

    def collective_failed(self, error: BaseException) -> None:
        """The main thread's collective raised. Now two silent intervals are evidence enough: if a
        rank (or the store) is silent that long, the threads report it and exit; otherwise this
        returns once the beat thread has seen every rank's heartbeat move since the failure, and the
        caller re-raises the error. The beat thread decides, not a clock here: on a loaded machine
        its rounds come late, and a fixed sleep could end before the round that names the rank."""
        if not self._threads or not looks_like_a_collective_failure(error):
            return
        # gloo: "[.../pair.cc:534] Read error ...: Connection reset by peer. This is typically ..."
        cause = str(error).splitlines()[0].split("] ", 1)[-1].split(". ")[0]
        self._cleared.clear()
        self._suspect = cause
        self._marked.set()
        self._cleared.wait(self.timeout_s + 10 * self.interval)  # bounded: the alarm covers a silent store
        self._suspect = None

    # ---- the threads ---------------------------------------------------------------------------
    def _record(self) -> str:
        return json.dumps({"beat": self._beat, "mark": self._mark, "host": self.host, "pid": os.getpid()})

    def _beat_once(self) -> None:
        self._beat += 1
        with self._store_lock:
            self._store.set(f"{_PREFIX}{self.rank}", self._record())

    def _beats(self) -> None:
        """Every interval (and at each new mark): write this rank's entry, read the verdict; rank 0,
        and any rank whose collective failed, read every entry and judge. A store operation can
        block for good when rank 0 is stopped (the client's timeout covers waiting for keys, not a
        silent server): the alarm thread watches this one."""
        seen: dict[int, tuple[str, float]] = {}  # the entry, and when it last changed
        suspected_at: Optional[float] = None  # the first judged round after the collective failed
        due = time.monotonic() + self.interval
        while True:
            self._marked.wait(max(0.0, due - time.monotonic()))
            self._marked.clear()
            if self._stopped.is_set():
                return
            try:
                self._beat_once()
                if time.monotonic() < due and self._suspect is None:
                    continue  # a new mark: written, judged at the next beat
                due = time.monotonic() + self.interval
                with self._store_lock:
                    verdict = self._store.get(_VERDICT).decode() if self._store.check([_VERDICT]) else None
                    judge = self.rank == 0 or self._suspect is not None
                    entries = [v.decode() for v in self._store.multi_get(
                        [f"{_PREFIX}{r}" for r in range(self.world)])] if judge else None
                self._answered = time.monotonic()
            except Exception:  # the store refused: rank 0's process is gone; the alarm decides
                continue
            if verdict:
                self._fail(verdict)
            if entries is None:
                continue
            now, limit, suspect = time.monotonic(), self._limit(), self._suspect is not None
            for r, entry in enumerate(entries):
                if seen.get(r, (None,))[0] != entry:
                    seen[r] = (entry, now)
            missing = {r: e for r, e in enumerate(entries) if now - seen[r][1] >= limit}
            if missing:
                self._fail(self._describe(missing, max(now - seen[r][1] for r in missing)))
            suspected_at = (suspected_at or now) if suspect else None
            if suspect and now - suspected_at >= limit:
                self._cleared.set()  # every entry changed within the last two beats: nobody is missing

    def _alarm(self) -> None:
        """The store in rank 0's process has not answered a round for too long: rank 0 is missing."""
        while not self._stopped.wait(self.interval / 4):
            silent = time.monotonic() - self._answered
            if silent >= self._limit():
                self._fail(f"rank 0 did not arrive: the rendezvous store in its process has not answered for "
                           f"{silent:.0f} s (engine.dist_timeout_s={self.timeout_s:.0f})")

    def _limit(self) -> float:
        """Silence that counts as missing: dist_timeout_s, or two beats once a collective failed."""
        return self.timeout_s if self._suspect is None else 2 * self.interval

    # ---- the report ----------------------------------------------------------------------------
    def _describe(self, missing: dict[int, str], silent: float) -> str:
        parts = []
        for r, entry in sorted(missing.items()):
            e = json.loads(entry)
            parts.append(f"rank {r} ({e['host']}, pid {e['pid']}, last seen in {e['mark']})")
        return (f"{', '.join(parts)} did not arrive: no heartbeat for {silent:.0f} s "
                f"(engine.dist_timeout_s={self.timeout_s:.0f})")

    def _fail(self, verdict: str) -> None:
        """Print the report, share the verdict (if the store answers soon), exit. Never returns."""
        self._failing.acquire()  # a second caller waits here for the exit

        def publish():
            with self._store_lock:
                self._store.set(_VERDICT, verdict)

        publisher = threading.Thread(target=publish, daemon=True)
        publisher.start()
        publisher.join(self.interval)
        cause = f" ({dist.get_backend()}: {self._suspect})" if self._suspect else ""
        # A newline first: rank 0's progress bar may hold the current line.
        print(f"\nerror: rank {self.rank} ({self.host}) stops in {self._mark}{cause}: {verdict}. Rerun the same "
              "command to resume from the newest complete checkpoint, on the remaining nodes if one is lost "
              f"(exit status {RANK_LOST_STATUS})", file=sys.stderr, flush=True)
        sys.stdout.flush()
        if self.rank == 0:
            time.sleep(2 * self.interval)  # the store lives here: let the others read the verdict
        os._exit(RANK_LOST_STATUS)
