"""What a command prints while it works: progress of a long loop, on a terminal or into a log file,
and nothing that is known to be harmless.

    logs.quiet_known_warnings()              # at start-up, before torch and DeepSpeed speak
    with logs.progress(len(lines), "translate", disable=rank != 0) as bar:
        ...; bar.update(n)
    with logs.without_known_prints():         # around a call that prints known lines
        module = StagePipelineModule(...)

On a terminal, a tqdm bar on stderr. Into a file or a pipe (a batch job's log, a launcher that
collects the ranks' output), a bar's carriage-return redraws pile up as one unreadable line, so
the same call prints ``[translate] 250/1,000 sentences`` lines instead, one at each tenth of the
total.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import sys
import warnings
from typing import Iterator

# Each message below is known, and why it is harmless is said beside it. Everything else is kept:
# the patterns match one message each, from its start.
#
# DeepSpeed logs this (logger "DeepSpeed", rank 0) for any client optimizer outside its short list,
# here RAdam, which admin_ds/train/engine.py allows (zero_allow_untested_optimizer). ZeRO shards an
# optimizer as a black box over flat fp32 partitions; RAdam's update is element-wise (no norm
# across parameters), so each partition updates exactly as the whole would.
DEEPSPEED_LOGS = [r"\*+ You are using ZeRO with an untested optimizer"]
# PyTorch warns, under pipeline parallelism, when DeepSpeed's PipelineModule broadcasts the shared
# embedding from the first stage to the others that hold it (_synchronize_tied_weights, at set-up
# and after a load): a parameter, which requires grad, given to an op without an autograd kernel.
# The broadcast is a copy outside any graph; the shared embedding's gradients are summed by an
# explicit all-reduce (StagePipelineModule.allreduce_tied_weight_gradients), never through it.
PYTORCH_WARNINGS = [r"c10d::broadcast_: an autograd kernel was not registered"]
# Prints (stdout, rank 0): PipelineModule's seeding settings (off: each layer draws its weights
# from its own generator, admin_ds/model/init.py) and the process grid it made (the run prints its
# own layout line); the universal converter's parsed command line, which is ours
# (checkpoint_format.ds_to_universal).
PRINTS = [r"SEED_LAYERS=", r"Using topology:", r"args = Namespace\("]


class _Drop(logging.Filter):
    def __init__(self, patterns: list[str]) -> None:
        super().__init__()
        self.pattern = re.compile("|".join(patterns))

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


def quiet_known_warnings() -> None:
    """Drop the known, harmless warnings (the lists above) from DeepSpeed's logger and Python's
    warnings; idempotent."""
    for pattern in PYTORCH_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=UserWarning)
    logger = logging.getLogger("DeepSpeed")  # the object DeepSpeed's LoggerFactory configures later
    if not any(isinstance(f, _Drop) for f in logger.filters):
        logger.addFilter(_Drop(DEEPSPEED_LOGS))


@contextlib.contextmanager
def without_known_prints() -> Iterator[None]:
    """Around a call that prints known lines (PRINTS): they are dropped, every other line is
    printed after the call, to where stdout pointed before it."""
    out, buffer = sys.stdout, io.StringIO()
    pattern = re.compile("|".join(PRINTS))
    try:
        with contextlib.redirect_stdout(buffer):
            yield
    finally:
        kept = [line for line in buffer.getvalue().splitlines() if not pattern.match(line)]
        if kept:
            print("\n".join(kept), file=out, flush=True)


class _Lines:
    """tqdm's ``update`` as a line at each tenth of ``total``."""

    def __init__(self, total: int, desc: str, unit: str, out) -> None:
        self.total, self.desc, self.unit, self.out = total, desc, unit, out
        self.n, self.shown = 0, 0

    def update(self, n: int = 1) -> None:
        self.n += n
        tenth = 10 * self.n // max(self.total, 1)
        if tenth > self.shown:
            self.shown = tenth
            print(f"[{self.desc}] {self.n:,}/{self.total:,} {self.unit}", file=self.out, flush=True)


@contextlib.contextmanager
def progress(total: int, desc: str, unit: str = "sentences", disable: bool = False) -> Iterator:
    """An object with ``update(n)``: a tqdm bar on stderr when it is a terminal, else ``[desc] n/total``
    lines (module docstring); nothing at all when ``disable``."""
    if disable:
        yield _Silent()
    elif sys.stderr.isatty():
        from tqdm import tqdm

        with tqdm(total=total, unit=unit.rstrip("s"), desc=desc, file=sys.stderr, dynamic_ncols=True) as bar:
            yield bar
    else:
        yield _Lines(total, desc, unit, sys.stderr)


class _Silent:
    def update(self, n: int = 1) -> None:
        pass
