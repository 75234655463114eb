"""Admin profiling: measure residual-branch variances, derive omega, keep the result as an artifact.

Two formulas (ADMIN_NOTES.md section 2), both over one forward pass in train mode (dropout on):

* ``reference`` -- the recursion of the code behind the published numbers (Transformer-Clinic,
  deepnmt). Walking the sub-layers of a stack in forward order, omega is filled *before* each
  sub-layer runs::

      omega_1 = 1;   omega_{i+1} = sqrt( Var[omega_i * x_{i-1}] + Var[f_i(x_{i-1})] )

  Var is one population variance over the whole flattened (B, T, D) tensor (padding included
  unless ``mask_padding``); f_i's output is taken after dropout; encoder and decoder are two chains
  that each start at 1; encoder-attention is a sub-layer like any other.
* ``paper`` -- omega_i = sqrt(sum_{j<i} Var[f_j(x_{j-1})]) from one pass with omega = 1 (empty
  sum: 1).

Statistics are kept as (sum, sum of squares, count) in float64. That makes them exactly
reducible across ranks: with a ``reduce_fn`` that all-reduces a float64 vector over the
data-parallel group, every rank gets the pooled statistics of all ranks' micro-batches and so the
same omega. That omega equals one process profiling the same micro-batches only where dropout
draws the same masks (dropout off): each micro-batch padded to its own length when padding is
counted (the default, as the reference does), their concatenation with ``mask_padding``. Because omega_{i+1} depends on omega_i, the reduction
happens sub-layer by sub-layer inside the pass (one small all-reduce per sub-layer).

The result is a ``Profile``: per-sub-layer variances and omega with provenance (formula, tokens,
seed, config hash, world layout), saved as ``admin_profile.json`` and convertible to and from the
reference ``profile.ratio.init`` text format.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from admin_ds import files
from admin_ds.errors import ProfileError
from admin_ds.model.layers import padded_target_keys_masked
from admin_ds.model.residual import OmegaResidual, Residual, attach_recorder, iter_residuals

FORMULAS = ("reference", "paper")
PROFILE_FILE = "admin_profile.json"
PROFILE_VERSION = 1

ReduceFn = Callable[[torch.Tensor], torch.Tensor]  # float64 vector -> its sum over ranks


@dataclass
class SublayerProfile:
    stack: str  # "encoder" | "decoder"
    index: int  # 1-based within the stack, forward order (profile.ratio.init numbering)
    omega: float
    var_branch: Optional[float] = None  # Var[f_i(x_{i-1})]
    var_shortcut: Optional[float] = None  # Var[omega_i * x_{i-1}] with the omega used in the pass
    count: Optional[int] = None  # elements per statistic, summed over ranks


@dataclass
class Profile:
    formula: str
    sublayers: list[SublayerProfile]
    tokens: dict = field(default_factory=dict)  # {"src": n, "tgt": n} non-pad tokens profiled
    seed: Optional[int] = None
    config_hash: Optional[str] = None
    world: dict = field(default_factory=lambda: {"data_parallel": 1, "pipeline": 1})
    mask_padding: bool = False
    source: str = "profiled"  # or the path it was imported from
    version: int = PROFILE_VERSION

    def omega(self, stack: str) -> list[float]:
        return [s.omega for s in self.sublayers if s.stack == stack]

    # ---- files ---------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Profile":
        d = dict(d)
        d["sublayers"] = [SublayerProfile(**s) for s in d["sublayers"]]
        return cls(**d)

    def save(self, path: str | os.PathLike) -> Path:
        """Write JSON atomically (temp file in the same folder, then rename)."""
        return files.write_text(path, json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike, cfg=None) -> "Profile":
        """Read a profile in any of the three formats, told apart by content (docs/admin_reference.md):
        ``admin_profile.json``; Transformer-Clinic's ``profile.ratio.init`` (``<index> <omega>``
        lines); deepnmt's profile (one bare omega per line, the encoder's 2N then the decoder's
        3M, mapped by position: needs the model config ``cfg`` for N and M)."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ProfileError(f"{path}: not a text file (an admin profile is JSON or lines of numbers)") from None
        if text.lstrip().startswith("{"):
            try:
                return cls.from_dict(json.loads(text))
            except (json.JSONDecodeError, TypeError, KeyError) as e:
                raise ProfileError(f"{path}: not a valid admin profile: {e}") from None
        first = next((line.split() for line in text.splitlines() if line.strip()), None)
        if first is not None and len(first) == 1:
            return cls.from_omega_list(text, cfg, source=str(path))
        return cls.from_ratio_init(text, source=str(path))

    def to_ratio_init(self) -> str:
        """Transformer-Clinic's format: one ``"<index> <omega>"`` line per sub-layer, encoder 1..2N
        first, then decoder 1..3M (the index restarts at 1)."""
        lines = [f"{s.index} {s.omega!r}" for stack in ("encoder", "decoder")
                 for s in self.sublayers if s.stack == stack]
        return "\n".join(lines) + "\n"

    @classmethod
    def from_ratio_init(cls, text: str, source: str = "<text>") -> "Profile":
        """Parse ``profile.ratio.init``; the restart of the index at 1 marks the decoder."""
        subs: list[SublayerProfile] = []
        stack, expected = "encoder", 1
        for lineno, (index, omega) in _profile_lines(text, source, 2, "'<index> <omega>'"):
            if index == 1 and subs:
                if stack == "decoder":
                    raise ProfileError(f"{source}:{lineno}: index restarts a third time")
                stack, expected = "decoder", 1
            if index != expected:
                raise ProfileError(f"{source}:{lineno}: expected index {expected}, got {index:g}")
            subs.append(SublayerProfile(stack, expected, omega))
            expected += 1
        if not subs:
            raise ProfileError(f"{source}: empty profile")
        return cls(formula="imported", sublayers=subs, source=source)

    @classmethod
    def from_omega_list(cls, text: str, cfg, source: str = "<text>") -> "Profile":
        """Parse deepnmt's profile: one omega per line, the encoder's 2N sub-layers, then the
        decoder's 3M, in forward order. Nothing in the file marks the boundary, so the counts come
        from ``cfg``, and a file of another length is refused."""
        values = [v[0] for _, v in _profile_lines(text, source, 1, "one omega per line (deepnmt's format)")]
        if cfg is None:
            raise ProfileError(f"{source}: a profile of bare omega values (deepnmt's format) is mapped to "
                               "sub-layers by position: give the model config")
        n_enc, n_dec = cfg.num_encoder_sublayers, cfg.num_decoder_sublayers
        if len(values) != n_enc + n_dec:
            raise ProfileError(f"{source}: {len(values)} omega values; the model has {n_enc} encoder + {n_dec} "
                               f"decoder = {n_enc + n_dec} sub-layers ({cfg.num_encoder_layers}L-"
                               f"{cfg.num_decoder_layers}L)")
        subs = [SublayerProfile("encoder", i + 1, v) for i, v in enumerate(values[:n_enc])]
        subs += [SublayerProfile("decoder", i + 1, v) for i, v in enumerate(values[n_enc:])]
        return cls(formula="imported", sublayers=subs, source=source)

    def check_matches(self, target) -> None:
        """Refuse a profile whose sub-layer counts differ from the architecture's (a ModelConfig, or a
        model with ``.cfg``; a pipeline stage holds only part of the sub-layers), naming both."""
        cfg = getattr(target, "cfg", target)
        want = {"encoder": cfg.num_encoder_sublayers, "decoder": cfg.num_decoder_sublayers}
        have = {st: len(self.omega(st)) for st in ("encoder", "decoder")}
        if want != have:
            raise ProfileError(f"profile ({self.source}) has {have['encoder']} encoder and "
                             f"{have['decoder']} decoder sub-layers; the model has "
                             f"{want['encoder']} and {want['decoder']}")


def _profile_lines(text: str, source: str, width: int, form: str):
    """(line number, numbers) for each non-empty line of a text profile: ``width`` numbers, the last
    an omega (positive, finite). ``form`` describes the line in the error naming a bad one."""
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != width:
                raise ValueError
            numbers = [float(p) for p in parts]
        except ValueError:
            raise ProfileError(f"{source}:{lineno}: expected {form}, got {line!r}") from None
        if not (math.isfinite(numbers[-1]) and numbers[-1] > 0):
            raise ProfileError(f"{source}:{lineno}: omega must be positive and finite, got {numbers[-1]}")
        yield lineno, numbers


def _omega_counts(model: nn.Module) -> dict[str, int]:
    counts = {"encoder": 0, "decoder": 0}
    for r in iter_residuals(model):
        if isinstance(r, OmegaResidual):
            counts[r.stack] += 1
    return counts


# ------------------------------------------------------------------------------------------------
# The recorder: runs inside the forward pass, one call per residual sub-layer
# ------------------------------------------------------------------------------------------------


def moments(t: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(sum, sum of squares, count) of ``t`` (B, T, D) in float64, over positions where ``mask``
    (B, T) is True, or over every element."""
    t = t.detach().to(torch.float64)
    if mask is not None:
        t = t[mask]
    return torch.stack([t.sum(), t.square().sum(), torch.tensor(float(t.numel()), dtype=torch.float64,
                                                                   device=t.device)])


def variance(m: torch.Tensor) -> float:
    """Population variance from reduced (sum, sumsq, count), as numpy.var computes it."""
    s, ss, n = (float(v) for v in m)
    return max(ss / n - (s / n) ** 2, 0.0)


class OmegaRecorder:
    """Measures each residual sub-layer and decides the omega the pass itself uses.

    ``chain`` holds, per stack, the omega the next sub-layer will use (the reference recursion's
    running value). A pipeline stage that starts mid-stack sets it from the previous stage.
    """

    def __init__(self, formula: str, reduce_fn: Optional[ReduceFn] = None,
                 masks: Optional[dict[str, torch.Tensor]] = None,
                 start_index: Optional[dict[str, int]] = None) -> None:
        if formula not in FORMULAS:
            raise ValueError(f"formula must be one of {FORMULAS}, got {formula!r}")
        self.formula = formula
        self.reduce_fn = reduce_fn
        self.masks = masks if masks is not None else {}
        self.chain = {"encoder": 1.0, "decoder": 1.0}
        # A pipeline stage starts mid-stack: its first sub-layers are not number 1.
        self.next_index = {"encoder": 1, "decoder": 1, **(start_index or {})}
        self.results: dict[tuple[str, int], SublayerProfile] = {}

    def __call__(self, residual: Residual, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not isinstance(residual, OmegaResidual):
            raise TypeError(f"profiling needs Admin residuals, found {type(residual).__name__} at "
                            f"{residual.stack} sub-layer {residual.index}")
        stack, index = residual.stack, residual.index
        if index != self.next_index[stack]:
            raise RuntimeError(f"{stack} sub-layer {index} ran out of order (expected "
                               f"{self.next_index[stack]}): profile with one full forward pass")
        self.next_index[stack] = index + 1
        omega = self.chain[stack] if self.formula == "reference" else 1.0
        shortcut = x * omega
        mask = self.masks.get(stack)
        stats = torch.cat([moments(shortcut, mask), moments(y, mask)])
        if self.reduce_fn is not None:
            stats = self.reduce_fn(stats)
        var_shortcut, var_branch = variance(stats[:3]), variance(stats[3:])
        self.results[(stack, index)] = SublayerProfile(
            stack, index, omega, var_branch=var_branch, var_shortcut=var_shortcut, count=int(stats[2]))
        if self.formula == "reference":
            self.chain[stack] = math.sqrt(var_shortcut + var_branch)
        return shortcut + y

    def sublayers(self) -> list[SublayerProfile]:
        """Per-sub-layer results with the formula's final omega."""
        return finalize_omega(self.formula, list(self.results.values()))


def finalize_omega(formula: str, subs: list[SublayerProfile]) -> list[SublayerProfile]:
    """Sort by stack and index and set each sub-layer's final omega. The reference recursion already
    recorded the omega it used; the paper formula needs every earlier branch variance of the stack,
    so it is computed here, from the complete list (also when stages measured parts of it)."""
    out = []
    for stack in ("encoder", "decoder"):
        chain = sorted((s for s in subs if s.stack == stack), key=lambda s: s.index)
        if formula == "paper":
            running = 0.0
            for s in chain:  # omega_i = sqrt(sum_{j<i} Var f_j); the empty sum gives 1
                s.omega = math.sqrt(running) if running > 0 else 1.0
                running += s.var_branch
        out.extend(chain)
    return out


# ------------------------------------------------------------------------------------------------
# Entry points
# ------------------------------------------------------------------------------------------------


@torch.no_grad()
def profile_residuals(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], formula: str = "reference",
                      mask_padding: bool = False, reduce_fn: Optional[ReduceFn] = None,
                      pad_idx: Optional[int] = None) -> list[SublayerProfile]:
    """One forward pass in train mode with every residual routed through an ``OmegaRecorder``;
    returns per-sub-layer statistics and omega. Does not change the model's omega."""
    src, tgt_in = batch
    pad = pad_idx if pad_idx is not None else model.cfg.pad_idx
    masks = {"encoder": src.ne(pad), "decoder": tgt_in.ne(pad)} if mask_padding else None
    recorder = OmegaRecorder(formula, reduce_fn, masks)
    was_training = model.training
    model.train()  # the reference profiles with dropout on
    try:
        # Eager even where the layers are compiled (the recorder's statistics and reductions are
        # side effects a graph cannot hold); padded target keys masked, as the reference does.
        with attach_recorder(model, recorder), torch.compiler.set_stance("force_eager"), \
                padded_target_keys_masked(model):
            model(src, tgt_in)
    finally:
        model.train(was_training)
    subs = recorder.sublayers()
    missing = {st: n - sum(s.stack == st for s in subs) for st, n in _omega_counts(model).items()}
    if any(missing.values()):
        raise RuntimeError(f"profiling pass missed sub-layers: {missing}")
    return subs


def omega_values(profile: Profile, model: nn.Module) -> dict[str, torch.Tensor]:
    """Omega of every Admin sub-layer ``model`` holds (the whole model or a pipeline stage), by
    state-dict name: the one mapping from a profile to tensors. ``apply_omega`` writes them into a
    plain module; ``admin_ds.train.engine.write_omega`` into an engine (the parameters and the
    optimizer's fp32 master copies)."""
    profile.check_matches(model)
    values = {(s.stack, s.index): s.omega for s in profile.sublayers}
    # (dim,), not omega.shape: under ZeRO-3 this rank's tensor may hold only a partition
    return {f"{name}.omega": torch.full((m.dim,), values[(m.stack, m.index)], dtype=torch.float32)
            for name, m in model.named_modules() if isinstance(m, OmegaResidual)}


@torch.no_grad()
def apply_omega(model: nn.Module, profile: Profile) -> None:
    """Write a profile's omega into a plain module's omega tensors."""
    for name, value in omega_values(profile, model).items():
        model.get_submodule(name.removesuffix(".omega")).set_omega(value)


def measure_profile(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], formula: str = "reference",
                    mask_padding: bool = False, reduce_fn: Optional[ReduceFn] = None,
                    seed: Optional[int] = None, world: Optional[dict] = None) -> Profile:
    """Profile ``model`` on ``batch = (src_tokens, tgt_in_tokens)`` and return the ``Profile``,
    leaving the model's omega as it was (training writes it through the engine, which knows the
    optimizer's copies). ``seed`` (if given) seeds torch first so the dropout masks repeat."""
    if seed is not None:
        torch.manual_seed(seed)
    subs = profile_residuals(model, batch, formula, mask_padding, reduce_fn)
    src, tgt_in = batch
    pad = model.cfg.pad_idx
    tokens = torch.stack([src.ne(pad).sum(), tgt_in.ne(pad).sum()]).to(torch.float64)
    if reduce_fn is not None:
        tokens = reduce_fn(tokens)
    return Profile(formula=formula, sublayers=subs, tokens={"src": int(tokens[0]), "tgt": int(tokens[1])},
                   seed=seed, config_hash=model.cfg.config_hash(), mask_padding=mask_padding,
                   world=world or {"data_parallel": 1, "pipeline": 1})


def profile_omega(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], formula: str = "reference",
                  mask_padding: bool = False, reduce_fn: Optional[ReduceFn] = None,
                  seed: Optional[int] = None, world: Optional[dict] = None) -> Profile:
    """``measure_profile``, then set the model's omega in place (a plain module on one device)."""
    profile = measure_profile(model, batch, formula, mask_padding, reduce_fn, seed, world)
    apply_omega(model, profile)
    return profile


def omega_table(profile: Profile) -> str:
    """A printable table of the profile: one row per sub-layer."""
    kinds = {"encoder": ("self_attn", "ffn"), "decoder": ("self_attn", "encoder_attn", "ffn")}
    rows = [f"{'stack':8} {'layer':>5} {'sub-layer':13} {'Var[f]':>10} {'omega':>9}"]
    for s in profile.sublayers:
        k = kinds[s.stack]
        layer, kind = (s.index - 1) // len(k), k[(s.index - 1) % len(k)]
        var = "" if s.var_branch is None else f"{s.var_branch:10.4f}"
        rows.append(f"{s.stack:8} {layer:5d} {kind:13} {var:>10} {s.omega:9.4f}")
    return "\n".join(rows)
