"""Callbacks at fixed points of a run, registered from outside; a production run has none.

    hooks = Hooks()
    hooks.on_loss.append(lambda loss, rank: loss * 2)     # every micro-batch loss, after the forward
    train(run, ds_path, hooks=hooks)

The loop and the runners call them at four points: after profiling, before each update, on each
micro-batch loss (a callback may return a changed loss), and before each file DeepSpeed writes
into a checkpoint. Tests inject real faults through them (tests/faults.py: SIGKILL, SIGSTOP, a
signal during a checkpoint write, a full disk, NaN or spiking losses); the production loop itself
carries no fault code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class Hooks:
    on_profiled: list[Callable[[], None]] = field(default_factory=list)
    on_update_start: list[Callable[[int], None]] = field(default_factory=list)  # the update about to run, 1-based
    on_loss: list[Callable[[torch.Tensor, int], torch.Tensor]] = field(default_factory=list)  # (loss, rank)
    on_checkpoint_write: list[Callable[[int, int], None]] = field(default_factory=list)  # (update, files written)

    def profiled(self) -> None:
        for fn in self.on_profiled:
            fn()

    def update_start(self, update: int) -> None:
        for fn in self.on_update_start:
            fn(update)

    def loss(self, loss: torch.Tensor, rank: int) -> torch.Tensor:
        for fn in self.on_loss:
            loss = fn(loss, rank)
        return loss
