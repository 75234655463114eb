"""The divergence guard: what keeps a long run alive when its loss goes bad.

Config section ``guard``; the loop (loop.py) asks the guard after every update and carries out
its decision; docs/guarantees.md lists what each failure costs and the test that injects it.

    * An update whose loss or gradients are not finite is skipped (the weights, the optimizer
      state and the learning-rate schedule stay as they were) and counted (``skipped_nonfinite``
      in metrics.jsonl). The skip itself is DeepSpeed's own overflow path, see ``install_skip``.
    * ``guard.max_consecutive_nonfinite`` skipped updates in a row, or a finite loss above
      ``guard.spike_factor`` x its running average (an exponential moving average with
      ``guard.ema_beta``, checked after ``guard.warmup_updates`` finite updates), roll the run back
      to the newest complete checkpoint with the learning rate multiplied by ``guard.lr_factor``.
      The multiplier is part of the client state, so a later resume keeps it.
    * After a rollback the run continues with the data *after* the divergence, not the data
      between the checkpoint and the divergence again: the loss that triggered a spike is measured
      before that update's step, on weights the rollback restores exactly, so replaying the same
      batches would reproduce the same spike (PaLM, section 5.1, skips the batches around a spike
      for the same reason).

How an update is skipped under DeepSpeed 0.19.8 (runtime/engine.py ``_take_model_step``; read,
not assumed). The engine calls ``optimizer.step()``, then looks at ``optimizer.overflow``: when it
is set, the engine counts ``skipped_steps``, does not step the learning-rate scheduler, and the
gradients are cleared by the ``zero_grad`` that follows every step; ``micro_steps`` and
``global_steps`` advance as usual, so the accumulation boundary stays where it was. Every
optimizer DeepSpeed wraps already sets ``overflow`` for a non-finite global gradient norm: ZeRO-1/2
(``stage_1_and_2.py`` step: ``is_invalid_grad_norm`` -> overflow; fp32 and fp16 always, bf16 with
``bf16.check_grad_overflow``, on by default), ZeRO-3 (``stage3.py`` step), the bf16 optimizer
(``bf16_optimizer.py`` step), and fp16's loss scaler (whose overflows we leave to it). The norm is
all-reduced over the data-parallel group and, in a pipeline, over the stages (the grid's
model-parallel group), so all ranks skip together. The one path without it is ZeRO-0 in fp32, where the
engine's optimizer is our plain torch optimizer: ``install_skip`` gives that optimizer the same
behaviour (a global all-reduced non-finite check, then ``overflow``), so one mechanism covers
every configuration. Deciding before backward was rejected: the loss of the last micro-batch is
only known after the earlier micro-batches' gradients are accumulated, and computing every
micro-batch's forward first would hold all their activations at once.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from admin_ds.errors import UserError

# ------------------------------------------------------------------------------------------------
# Skipping non-finite updates
# ------------------------------------------------------------------------------------------------


def install_skip(engine) -> bool:
    """Give a plain torch optimizer (ZeRO-0, fp32: the only configuration whose optimizer DeepSpeed
    does not wrap) DeepSpeed's overflow behaviour: a non-finite gradient on any rank skips the
    step on every rank. Returns whether it was installed. See the module docstring."""
    opt = engine.optimizer
    if not isinstance(opt, torch.optim.Optimizer):
        return False  # a DeepSpeed optimizer: it checks the gradient norm itself
    import torch.distributed as dist

    inner = opt.step

    @functools.wraps(inner)  # keeps the LR scheduler's marker on the step it wrapped
    def step(*args, **kwargs):
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        if grads:  # one device sync for the whole check, at .item() below
            # Each gradient's sum is non-finite where the gradient has an inf or a NaN (inf - inf
            # is NaN), as DeepSpeed's own overflow check reads it: one pass over the gradients,
            # where isfinite(g).all() took four (abs, ne, eq, all; 12% of a CPU update at 18L-18L).
            # Summed in fp32: an fp16 gradient's finite values can add up past fp16's range.
            sums = torch.stack([g.sum(dtype=torch.float32) for g in grads])
            bad = torch.isfinite(sums).logical_not().any().float().reshape(1)
        else:  # on the parameters' device: NCCL reduces GPU tensors only
            bad = torch.zeros(1, device=opt.param_groups[0]["params"][0].device)
        # Every rank steps exactly once per update (data-parallel and pipeline), so this
        # collective is matched; gradients differ between pipeline stages, so it must be global.
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        opt.overflow = bool(bad.item())
        return None if opt.overflow else inner(*args, **kwargs)

    opt.overflow = False
    opt.step = step
    return True


# ------------------------------------------------------------------------------------------------
# The divergence guard
# ------------------------------------------------------------------------------------------------


class DivergenceError(UserError, RuntimeError):
    """The run diverged and the guard cannot recover (no checkpoint, or too many rollbacks); the
    message says what to change."""


@dataclass
class GuardState:
    lr_scale: float = 1.0  # product of the lr_factor of every rollback so far
    rollbacks: int = 0
    skipped_nonfinite: int = 0  # all skipped non-finite updates of the run
    consecutive_nonfinite: int = 0
    ema: Optional[float] = None  # running average of the finite update losses
    finite_updates: int = 0


class DivergenceGuard:
    """Decides after each update: continue, or roll back (and why). Every input it sees (the
    global loss, DeepSpeed's skip counter) is identical on all ranks, so all ranks decide alike."""

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.state = GuardState()

    def observe(self, stats: dict) -> Optional[str]:
        """``stats``: the update's ``loss`` (global) and ``nonfinite``. Returns a rollback reason or None."""
        c, s = self.cfg, self.state
        loss = stats["loss"]
        if stats["nonfinite"] or not math.isfinite(loss):
            s.skipped_nonfinite += 1
            s.consecutive_nonfinite += 1
            if c.max_consecutive_nonfinite and s.consecutive_nonfinite >= c.max_consecutive_nonfinite:
                return f"{s.consecutive_nonfinite} consecutive updates with a non-finite loss or gradient"
            return None
        s.consecutive_nonfinite = 0
        if (c.spike_factor and s.ema is not None and s.finite_updates >= c.warmup_updates
                and loss > c.spike_factor * s.ema):
            return f"loss spike: {loss:.4g} > {c.spike_factor:g} x running average {s.ema:.4g}"
        s.ema = loss if s.ema is None else c.ema_beta * s.ema + (1.0 - c.ema_beta) * loss
        s.finite_updates += 1
        return None

    def begin_rollback(self, reason: str, tag: Optional[str]) -> float:
        """Account for a rollback; returns the new learning-rate multiplier."""
        s = self.state
        if tag is None:
            raise DivergenceError(f"{reason}, and there is no complete checkpoint to roll back to; "
                                  "lower optim.lr or save earlier (train.save_interval_updates)")
        if s.rollbacks >= self.cfg.max_rollbacks:
            raise DivergenceError(f"{reason}, after {s.rollbacks} rollback(s) already (guard.max_rollbacks="
                                  f"{self.cfg.max_rollbacks}); stopping. The learning rate is at "
                                  f"{s.lr_scale:g} x optim.lr")
        return s.lr_scale * self.cfg.lr_factor

    def state_dict(self) -> dict:
        return asdict(self.state)

    def load_state_dict(self, d: Optional[dict], rollback: bool = False) -> None:
        """From a checkpoint. On a rollback the run-wide counters and the multiplier stay."""
        if d is None:
            return
        keep = (self.state.lr_scale, self.state.rollbacks, self.state.skipped_nonfinite)
        self.state = GuardState(**d)
        if rollback:
            self.state.lr_scale, self.state.rollbacks, self.state.skipped_nonfinite = keep
            self.state.consecutive_nonfinite = 0


def apply_lr_scale(engine, peak_lr: float, scale: float) -> None:
    """Make the schedule run at ``scale`` x its configured peak: LambdaLR's lr is base_lr x
    factor(step), so set base_lr and the lr the next step uses (not multiplicative, so applying
    it again after a resume changes nothing)."""
    sched = engine.lr_scheduler
    if sched is None:
        return
    sched.base_lrs = [peak_lr * scale for _ in sched.base_lrs]
    factors = [fn(sched.last_epoch) for fn in sched.lr_lambdas]
    for group, base, f in zip(sched.optimizer.param_groups, sched.base_lrs, factors):
        group["initial_lr"] = base
        group["lr"] = base * f
    sched._last_lr = [g["lr"] for g in sched.optimizer.param_groups]
