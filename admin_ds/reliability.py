"""What keeps a long run alive: the divergence guard, resuming on a different layout, fault hooks.

The trainer calls this module through a few named hooks; docs/guarantees.md lists what each
failure costs and the test that injects it.

Divergence guard (``DivergenceGuard``, config section ``guard``)
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

Resuming on a different layout (``plan_resume``, ``ensure_universal``)
    Every checkpoint's ``COMPLETE`` marker records the layout it was saved with (world size,
    data-parallel size, pipeline stages, ZeRO stage, precision, accumulation steps). Before the
    engine is built, every rank reads it for the newest complete tag; if the layout differs,
    the engine is built with ``"checkpoint": {"load_universal": true}``, rank 0 converts the tag
    with DeepSpeed's universal converter into ``<tag>_universal`` beside it (into a temporary
    folder, renamed when complete; the other ranks wait), and the engine loads that. Pipeline
    parameters are named ``"<layer index>.<sub>"`` and ``tied_modules.embed.weight``, the
    data-parallel model's ``encoder_layers.<j>.<sub>`` and ``src_embed.weight``; the universal
    folder stores one folder per parameter name (``zero/<name>/fp32.pt, exp_avg.pt, ...``), so a
    change between the two renames those folders (``pipeline.model_state_from_pipeline`` and its
    inverse). Universal checkpoints hold only ZeRO optimizer partitions: a layout change from or to
    ZeRO-0 is refused with the reason (a ZeRO-0 data-parallel size change alone loads directly,
    its checkpoint holds the whole optimizer state). Universal loading restores parameters, not
    buffers: a fixed (buffer) omega is written again from the checkpoint's profile.

Fault hooks (test hooks; inert unless ``ADMIN_DS_FAULT`` is set)
    ``ADMIN_DS_FAULT`` is a comma-separated list; each fault fires at most once per process:
        kill_during_profile         SIGKILL after profiling, before omega is written
        kill_during_update:U        SIGKILL during update U (after its first forward)
        kill_during_save:U          SIGKILL while checkpoint U is written (after DeepSpeed's first file)
        enospc_during_save:U        OSError(ENOSPC) there instead: the run stops, the previous
                                    complete checkpoint stays the one to resume from
        nan_loss:U[-V][:R]          rank R's (default 0) first micro-batch loss x NaN in updates
                                    U..V; may repeat. In a pipeline R must be a last-stage rank
        spike_loss:U:F              every micro-batch loss x F in update U
    They are real faults of the real process (a SIGKILL is not catchable), used by
    tests/test_reliability.py.
"""

from __future__ import annotations

import errno
import functools
import json
import math
import os
import shutil
import signal
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from admin_ds import atomic
from admin_ds.config import ConfigError

FAULT_ENV = "ADMIN_DS_FAULT"
CONVERTED = "CONVERTED"  # marker of a complete universal conversion
LAYOUT_KEYS = ("data_parallel", "pipeline", "zero", "precision")


# ------------------------------------------------------------------------------------------------
# Fault hooks (tests only)
# ------------------------------------------------------------------------------------------------


class Faults:
    """The faults named in ``ADMIN_DS_FAULT`` (see the module docstring). Without the variable
    every method is a no-op returning the neutral value."""

    def __init__(self, spec: str = "") -> None:
        self.spec: dict[str, list[list[str]]] = {}  # a name may repeat: nan_loss:3,nan_loss:9-10
        for item in filter(None, (s.strip() for s in spec.split(","))):
            name, _, arg = item.partition(":")
            self.spec.setdefault(name, []).append(arg.split(":") if arg else [])
        self.fired: set = set()
        self._update = 0
        self._micro = 0
        self._spiking: Optional[float] = None

    @classmethod
    def from_env(cls) -> "Faults":
        return cls(os.environ.get(FAULT_ENV, ""))

    def _once(self, key) -> bool:
        if key in self.fired:
            return False
        self.fired.add(key)
        return True

    def _at(self, name: str, update: int, rank: Optional[int] = None) -> bool:
        """Is ``name`` armed for ``update`` (and ``rank``, when given: the fault's second
        argument, default 0)?"""
        for args in self.spec.get(name, []):
            lo, _, hi = args[0].partition("-")
            on_rank = rank is None or int(args[1] if len(args) > 1 else 0) == rank
            if int(lo) <= update <= int(hi or lo) and on_rank:
                return self._once((name, update))
        return False

    @staticmethod
    def _kill(where: str) -> None:
        print(f"[fault] {FAULT_ENV}: SIGKILL {where}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def profile_point(self) -> None:
        if "kill_during_profile" in self.spec and self._once("kill_during_profile"):
            self._kill("during profiling")

    def begin_update(self, update: int) -> None:
        """``update`` is the number of the update about to run (1-based)."""
        self._update, self._micro = update, 0

    def loss(self, loss: torch.Tensor, rank: int) -> torch.Tensor:
        """Called on every micro-batch loss right after the forward."""
        if not self.spec or not torch.is_grad_enabled():  # not in validation
            return loss
        u, micro = self._update, self._micro
        self._micro += 1
        if micro == 0 and self._at("kill_during_update", u):
            self._kill(f"during update {u}")
        if micro == 0 and self._at("nan_loss", u, rank):
            loss = loss * float("nan")
        if micro == 0:
            self._spiking = next((float(a[1]) for a in self.spec.get("spike_loss", []) if int(a[0]) == u), None)
            if self._spiking is not None and not self._once(("spike_loss", u)):
                self._spiking = None
        if self._spiking is not None:
            loss = loss * self._spiking
        return loss

    def save_hook(self, update: int) -> Optional[Callable[[int], None]]:
        """For ``checkpoint.save``: called before each DeepSpeed file write with the number of
        files this rank has written so far; faults fire before the second one."""
        kill, full = self._at("kill_during_save", update), self._at("enospc_during_save", update)
        if not (kill or full):
            return None

        def hook(written: int) -> None:
            if written < 1:
                return
            if kill:
                self._kill(f"while writing checkpoint {update}")
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected by {FAULT_ENV})")

        return hook


FAULTS = Faults.from_env()


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
            bad = torch.stack([torch.isfinite(g).all() for g in grads]).logical_not().any().float().reshape(1)
        else:
            bad = torch.zeros(1)
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


class DivergenceError(RuntimeError):
    """The run diverged and the guard cannot recover (no checkpoint, or too many rollbacks)."""


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


# ------------------------------------------------------------------------------------------------
# Resume: compatibility and layout
# ------------------------------------------------------------------------------------------------


def _normalised(d: dict) -> dict:
    return json.loads(json.dumps(d))


def check_compatible(where: str, info: dict, model_cfg, manifest: dict) -> None:
    """Refuse a checkpoint trained with another architecture, vocabulary or subword model, naming
    the field, before anything is loaded."""
    saved = info.get("model_config")
    if saved is not None:
        now = _normalised(model_cfg.to_dict())
        saved = _normalised(saved)
        diff = [k for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
        if diff:
            detail = ", ".join(f"model.{k} (checkpoint {saved.get(k)!r}, run {now.get(k)!r})" for k in diff)
            hint = " (the vocabulary size comes from data.path's subword model)" if "vocab_size" in diff else ""
            raise ConfigError(f"{where}: the checkpoint's model differs from the run config in {detail}{hint}; "
                              "use a new train.run_dir or the same model")
    if "subword_sha256" in info and info["subword_sha256"] != manifest.get("subword_sha256"):
        raise ConfigError(f"{where}: trained with a different subword model than data.path's "
                          f"{manifest.get('subword_model')} (sha256 {str(info['subword_sha256'])[:12]}.. vs "
                          f"{str(manifest.get('subword_sha256'))[:12]}..); use the checkpoint's data or a new "
                          "train.run_dir")


@dataclass
class ResumePlan:
    tag: str
    saved: dict  # the layout the checkpoint was written with (None values: unknown)
    current: dict
    universal: bool = False  # load through DeepSpeed's universal checkpoint
    notes: list = field(default_factory=list)

    @property
    def naming(self) -> str:
        return "pipeline" if self.current["pipeline"] > 1 else "data_parallel"

    @property
    def saved_naming(self) -> str:
        return "pipeline" if self.saved["pipeline"] > 1 else "data_parallel"


def describe(layout: dict) -> str:
    return (f"{layout.get('world_size')} rank(s) = data-parallel {layout.get('data_parallel')} x pipeline "
            f"{layout.get('pipeline')}, ZeRO-{layout.get('zero')}, {layout.get('precision')}, accumulation "
            f"{layout.get('gradient_accumulation_steps', '?')}")


def plan_resume(ckpt_dir: Path, tag: Optional[str], info: dict, current: dict) -> Optional[ResumePlan]:
    """How to load ``tag`` (whose COMPLETE marker is ``info``) into the ``current`` layout."""
    if tag is None:
        return None
    saved = info.get("layout")
    if saved is None:  # written before layouts were recorded: assume the same layout
        return ResumePlan(tag, dict(current), dict(current))
    plan = ResumePlan(tag, saved, dict(current))
    if all(saved.get(k) == current[k] for k in LAYOUT_KEYS):
        return plan
    where = f"{ckpt_dir / tag}"
    zero_only_dp = (saved["zero"] == 0 == current["zero"] and saved["pipeline"] == current["pipeline"]
                    and saved["precision"] == current["precision"])
    if zero_only_dp:
        plan.notes.append("ZeRO-0 checkpoints hold the whole optimizer state: loaded directly")
    elif saved["zero"] >= 1 and current["zero"] >= 1:
        plan.universal = True
    else:
        side = "saved with" if saved["zero"] == 0 else "resumed with"
        raise ConfigError(
            f"{where}: saved as {describe(saved)}, resumed as {describe(current)}. A layout change goes "
            f"through DeepSpeed's universal checkpoint, which is built from ZeRO optimizer partitions and "
            f"loads only into a ZeRO optimizer; this one is {side} ZeRO-0. Resume with the saved layout "
            "(or ZeRO >= 1 on both sides)")
    before, after = saved.get("data_parallel", 0) * saved.get("gradient_accumulation_steps", 0), \
        current["data_parallel"] * current["gradient_accumulation_steps"]
    if saved.get("gradient_accumulation_steps") and before != after:
        plan.notes.append(f"data-parallel x accumulation changes from {before} to {after}: the batches of an "
                          "epoch are regrouped, so the data position is resumed approximately "
                          "(EpochBatchIterator.load_state_dict)")
    return plan


def configure_loading(ds: dict, plan: Optional[ResumePlan]) -> None:
    """Before deepspeed.initialize: the engine loads universal checkpoints only if built so."""
    if plan is not None and plan.universal:
        ds.setdefault("checkpoint", {})["load_universal"] = True


class universal_loading:
    """Context: switch the engine's universal-loading flag for one load. DeepSpeed 0.19.8 reads
    ``engine._config.load_universal_checkpoint`` only inside load_checkpoint (engine.py, read),
    so a run resumed through a universal checkpoint can still roll back to a checkpoint it wrote
    itself in its own layout."""

    def __init__(self, engine, on: bool) -> None:
        self.cfg, self.on = engine._config, on

    def __enter__(self):
        self.was = self.cfg.load_universal_checkpoint
        self.cfg.load_universal_checkpoint = self.on

    def __exit__(self, *exc):
        self.cfg.load_universal_checkpoint = self.was


# ------------------------------------------------------------------------------------------------
# Universal conversion and parameter names
# ------------------------------------------------------------------------------------------------


def pipeline_layer_kinds(cfg) -> list[str]:
    """The kinds of pipeline.build_pipeline's layer list, from the model config alone (checked
    against the built pipeline's ``layer_kinds`` whenever a pipeline is built)."""
    norm = ["norm"] if cfg.norm_order == "pre" else []
    return (["embed"] + ["encoder"] * cfg.num_encoder_layers + norm + ["embed_tgt"]
            + ["decoder"] * cfg.num_decoder_layers + norm + ["project"])


def pipeline_names(kinds: list[str], names: list[str]) -> dict[str, str]:
    """data-parallel parameter name -> pipeline name, for ``names`` (data-parallel). The inverse
    of pipeline.model_state_from_pipeline, which it is checked against."""
    from admin_ds.pipeline import model_state_from_pipeline

    idx = {k: [i for i, x in enumerate(kinds) if x == k] for k in ("encoder", "decoder", "norm")}
    prefix = {f"encoder_layers.{j}": str(i) for j, i in enumerate(idx["encoder"])}
    prefix.update({f"decoder_layers.{j}": str(i) for j, i in enumerate(idx["decoder"])})
    if idx["norm"]:
        prefix.update(encoder_layer_norm=str(idx["norm"][0]), decoder_layer_norm=str(idx["norm"][1]))
    out = {}
    for name in names:
        if name == "src_embed.weight":
            out[name] = "tied_modules.embed.weight"
            continue
        for p in (name.split(".")[0], ".".join(name.split(".")[:2])):
            if p in prefix:
                out[name] = prefix[p] + name[len(p):]
                break
        else:
            raise ConfigError(f"parameter {name!r} has no place in the pipeline layout")
    back = model_state_from_pipeline(kinds, {v: v for v in out.values()})
    if {k: back.get(k) for k in out} != out:
        raise RuntimeError("pipeline_names is not the inverse of pipeline.model_state_from_pipeline")
    return out


def data_parallel_names(kinds: list[str], names: list[str]) -> dict[str, str]:
    """pipeline parameter name -> data-parallel name (pipeline.model_state_from_pipeline)."""
    from admin_ds.pipeline import model_state_from_pipeline

    canon = model_state_from_pipeline(kinds, {n: n for n in names})  # data-parallel name -> pipeline name
    out = {pipe: dp for dp, pipe in canon.items()}
    for n in names:  # the tied embedding is stored once; every pipeline name must be placed
        if n not in out:
            if n.startswith("tied_modules.embed."):
                out[n] = "src_embed." + n.rsplit(".", 1)[1]
            else:
                raise ConfigError(f"pipeline parameter {n!r} has no data-parallel name")
    return out


def rename_universal(zero_dir: Path, saved_naming: str, naming: str, kinds: list[str]) -> int:
    """Rename the per-parameter folders of a universal checkpoint between the pipeline and the
    data-parallel names. Returns the number of folders renamed."""
    if saved_naming == naming:
        return 0
    names = sorted(p.name for p in zero_dir.iterdir() if p.is_dir())
    mapping = (data_parallel_names(kinds, names) if saved_naming == "pipeline" else pipeline_names(kinds, names))
    if len(set(mapping.values())) != len(mapping):
        raise RuntimeError(f"renaming {zero_dir} would merge parameter folders: {mapping}")
    staging = zero_dir / ".renaming"
    staging.mkdir()
    for old in names:  # two passes: no new name can collide with an old one midway
        os.rename(zero_dir / old, staging / old)
    for old in names:
        os.rename(staging / old, zero_dir / mapping[old])
    staging.rmdir()
    return len(names)


def universal_dir(ckpt_dir: Path, tag: str) -> Path:
    return ckpt_dir / f"{tag}_universal"


def ensure_universal(ckpt_dir: Path, plan: ResumePlan, kinds: list[str], log=print) -> Path:
    """Rank 0: ``<tag>_universal`` beside the tag, in the current layout's parameter names,
    converted once. Built in a temporary folder and renamed when complete, so a kill leaves
    either nothing usable (converted again next time) or the complete folder."""
    from admin_ds import engine as eng

    final = universal_dir(ckpt_dir, plan.tag)
    marker = final / CONVERTED
    if marker.is_file():
        done = json.loads(marker.read_text())
        if done.get("naming") == plan.naming:
            return final
    if final.exists():
        shutil.rmtree(final)  # torn, or named for another layout: convert again
    tmp = ckpt_dir / f".{plan.tag}_universal.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    log(f"[resume] converting {ckpt_dir / plan.tag} to a universal checkpoint ({describe(plan.saved)} -> "
        f"{describe(plan.current)})")
    # The converter's worker processes pay off on large checkpoints only (each imports torch).
    size = sum(f.stat().st_size for f in (ckpt_dir / plan.tag).iterdir() if f.is_file())
    workers = 1 if size < 2**30 else max(1, min(8, (os.cpu_count() or 2) // 2))
    eng.ds_to_universal(str(ckpt_dir / plan.tag), str(tmp), num_workers=workers)
    (ckpt_dir / "latest_universal").unlink(missing_ok=True)  # the converter's pointer; we name tags
    _alias_model_states(tmp)
    _harmonise_optimizer_state(tmp / "zero")
    renamed = rename_universal(tmp / "zero", plan.saved_naming, plan.naming, kinds)
    if renamed:
        log(f"[resume] renamed {renamed} parameter folders from {plan.saved_naming} to {plan.naming} names")
    atomic.write_text(tmp / CONVERTED, json.dumps({"source": plan.tag, "naming": plan.naming,
                                                   "saved_layout": plan.saved}) + "\n")
    os.replace(tmp, final)
    dir_fd = os.open(ckpt_dir, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return final


def _alias_model_states(udir: Path) -> None:
    """The engine finds the (metadata-only, under universal loading) model-states file by its
    own ZeRO stage's name: ``mp_rank_XX_model_states.pt`` for ZeRO-0/1/2 and the pipeline,
    ``zero_pp_rank_0_mp_rank_XX_model_states.pt`` for ZeRO-3 (engine.py ``_get_ckpt_name``),
    while the converter copies the source's. Give the folder both names."""
    for f in sorted(udir.glob("*model_states.pt")):
        if f.name.startswith("mp_rank_"):
            alias = udir / f"zero_pp_rank_0_{f.name}"
        elif f.name.startswith("zero_pp_rank_0_mp_rank_"):
            alias = udir / f.name[len("zero_pp_rank_0_"):]
        else:
            continue
        if not alias.exists():
            try:
                os.link(f, alias)
            except OSError:
                shutil.copy2(f, alias)


def _harmonise_optimizer_state(zero_dir: Path) -> None:
    """``zero/optimizer_state.pt`` as both loaders read it. DeepSpeed 0.19.8 writes it in the
    source's format, and the loaders differ (read, not assumed): ZeRO-1/2/bf16
    (base_optimizer.py ``load_hp_checkpoint_state_from_checkpoint_dir``) need ``ds_version``,
    ``param_groups`` and a ``step.pt`` per parameter; ZeRO-3 (stage3.py
    ``load_hp_checkpoint_state_from_checkpoint_dir_stage3``) needs the base optimizer's
    ``optimizer_state_dict`` with ``state[0]['step']``. Each side gets what it lacks."""
    import deepspeed

    path = zero_dir / "optimizer_state.pt"
    sd = torch.load(path, weights_only=False)  # DeepSpeed's file, written by its converter just now
    params = sorted(p for p in zero_dir.iterdir() if p.is_dir())
    inner = sd.get("optimizer_state_dict")
    if inner is None:  # converted from ZeRO-1/2: the step lives in each parameter's step.pt
        step = next((torch.load(p / "step.pt", weights_only=False) for p in params if (p / "step.pt").is_file()), None)
        sd["optimizer_state_dict"] = {"state": {} if step is None else {0: {"step": step}},
                                      "param_groups": sd["param_groups"]}
    else:  # converted from ZeRO-3: flat tensors, no shapes, no per-parameter step
        shapes = {}
        for f in sorted(zero_dir.parent.glob("zero_pp_rank_0_mp_rank_*_model_states.pt")):
            for group in torch.load(f, map_location="cpu", weights_only=False)["param_shapes"]:
                shapes.update(group)
        step = inner.get("state", {}).get(0, {}).get("step")
        for p in params:
            for key in ("fp32", "exp_avg", "exp_avg_sq"):
                t = torch.load(p / f"{key}.pt", weights_only=False)
                if torch.is_tensor(t):  # ZeRO-1/2 read {"param": tensor of the parameter's shape}
                    torch.save({"param": t.reshape(shapes[p.name])}, p / f"{key}.pt")
            if step is not None and not (p / "step.pt").exists():
                torch.save(step, p / "step.pt")
    sd.setdefault("ds_version", deepspeed.__version__)
    torch.save(sd, path)


def check_universal_names(udir: Path, engine) -> None:
    """Every rank: each parameter of this rank's module has its folder (a clear error instead of
    DeepSpeed's file-not-found deep inside the optimizer)."""
    missing = [n for n, _ in engine.module.named_parameters() if not (udir / "zero" / n).is_dir()]
    if missing:
        raise RuntimeError(f"{udir}: no universal state for {len(missing)} parameter(s) of this rank, "
                           f"e.g. {missing[:3]}")


def restore_buffer_omegas(engine, profile) -> int:
    """Universal loading restores parameters only: write fixed (buffer) omegas from the profile."""
    from admin_ds import engine as eng
    from admin_ds.residual import OmegaResidual

    if profile is None:
        return 0
    values = {(s.stack, s.index): s.omega for s in profile.sublayers}
    buffers = dict(engine.module.named_buffers())
    todo = {}
    for name, module in engine.module.named_modules():
        full = f"{name}.omega" if name else "omega"
        if isinstance(module, OmegaResidual) and full in buffers:
            todo[full] = torch.full(module.omega.shape, values[(module.stack, module.index)], dtype=torch.float32)
    if todo:
        eng.write_params(engine, todo)
    return len(todo)
