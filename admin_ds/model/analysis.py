"""Why a configuration will or will not train, measured at initialisation (Liu et al. 2020, sec. 4).

Two measurements, both on freshly initialised models, no training:

* **Output change** (Figure 2, "random perturbation"; Theorem 1, Corollaries 1-2)::

      change(N) = mean over tokens of |F(x, W) - F(x, W + delta)|_2^2,   delta ~ N(0, sigma^2)

  F is the encoder output ``model.encode(src)[0]`` (B, S, D) by default, as in the paper's
  Figure 2 (encoders of N layers, 2 sub-layers each), or the final decoder states (B, T, D,
  before the vocabulary projection) with ``target="model"``. The squared L2 norm is over D and
  averaged over the B*S tokens, so the number does not depend on the batch size.
  ``delta`` is drawn independently per element with an *absolute* sigma (an Adam update has a
  roughly parameter-independent size too). The default 0.001 (about 1% of a xavier weight's std
  at D=64) keeps the measurement in the small-perturbation regime Theorem 1 describes, where the
  change is quadratic in sigma: at D=64 with sigma=0.01 Post-LN's change already bends away from
  linear growth beyond 32 layers (change(64)/change(32) = 1.1-1.7 instead of 2.1 at 0.0025).
  delta is drawn, by default, only on the residual branches -- every parameter (weights and
  biases) of the attention and FFN modules -- because Theorem 1 perturbs W_i of the branch
  G_i(x, W_i) and assumes the dependencies beta_{i,j} stay fixed. LayerNorm, omega and the
  embeddings stay unperturbed; ``scope="all"`` perturbs every parameter instead.
  Corollary 2: Post-LN grows like N; Corollary 1: Pre-LN like log N; Admin follows Pre-LN.
  ``run_analyses`` reports the R^2 of a linear fit against N and against log N for every init.

* **Layer dependency beta_{i,j}** (Figures 7-8): for every encoder sub-layer i, the share of
  residual branch j's output a_j (j = 0 is the embedding output x_0) in the sub-layer's output.
  The stream is kept as a list of components [x_0, a_1, ..., a_i] whose sum *is* the stream:
  a shortcut scale (omega, DeepNorm's alpha) multiplies the old components, the new branch output
  is appended, and a Post-LN LayerNorm ``(b - mean(b)) / std(b) * gamma + nu`` is applied to each
  component linearly: ``(c - mean(c)) / std(b) * gamma``. Mean-centering is linear, so the
  bookkeeping is exact except for the LN bias nu, which is ignored (it is zero at
  initialisation; the tests check that the components sum to the encoder output). The
  Transformer-Clinic reference (``residual_components[ind] * layer_norm.weight``) ignores the
  centering and the 1/std as well. Then, as the reference measures a component,
  ``m_j = c_j.std(dim=-1).mean()`` (std over D, mean over tokens) and
  ``beta_{i,j} = m_j / sum_k m_k``: every row sums to 1 (the paper normalises so that
  sum_j beta_{i,j}^2 = 1 instead; the ordering of the entries is the same). A Pre-LN stream has
  no LayerNorm on it (the final encoder LayerNorm is not a sub-layer and is left out).

Measurement conditions: dropout 0 and eval mode; random source tokens without padding (ids from
the first non-special symbol up); Admin's omega profiled with ``profile_omega`` on another batch
of the same kind (with dropout 0, so the profile is deterministic; the paper profiles with
dropout on). For a given seed, post, pre and admin draw identical weights (the schemes differ in
residual and LayerNorm placement only) and identical perturbations, so the comparison is paired.

Shapes: B batch, S source length, T target length, D model_dim, N encoder layers (2N sub-layers).
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np
import torch
from torch import nn

from admin_ds.model.config import ModelConfig
from admin_ds.model.layers import FeedForward, MultiheadAttention
from admin_ds.model.presets import get_preset
from admin_ds.model.profiling import profile_omega
from admin_ds.model.residual import Residual, attach_recorder
from admin_ds.model.transformer import EncoderDecoder, build_model

# The initialisations one can compare: name -> ModelConfig overrides.
INIT_VARIANTS: dict[str, dict] = {
    "post": dict(init="default", norm_order="post"),
    "pre": dict(init="default", norm_order="pre"),
    "admin": dict(init="admin", norm_order="post"),
    "admin-constant": dict(init="admin-constant", norm_order="post"),
    "deepnorm": dict(init="deepnorm", norm_order="post"),
    "t-fixup": dict(init="t-fixup", norm_order="post"),
}
TARGETS = ("encoder", "model")
SCOPES = ("branches", "all")
RESULT_FILE = "analysis.json"


# ------------------------------------------------------------------------------------------------
# Models and batches
# ------------------------------------------------------------------------------------------------


def analysis_config(init_name: str, depth: int, *, base_preset: str = "debug-tiny", model_dim: int = 64,
                    ffn_inner_dim: Optional[int] = None, num_heads: Optional[int] = None,
                    decoder_layers: Optional[int] = None) -> ModelConfig:
    """The ModelConfig measured for ``init_name`` at encoder depth ``depth``: dropout 0, decoder
    depth ``decoder_layers`` (default: ``depth``, an N-N model as in the paper's tables)."""
    if init_name not in INIT_VARIANTS:
        raise ValueError(f"unknown init {init_name!r}; known: {', '.join(INIT_VARIANTS)}")
    overrides = dict(INIT_VARIANTS[init_name], model_dim=model_dim,
                     ffn_inner_dim=ffn_inner_dim or 4 * model_dim,
                     num_encoder_layers=depth, num_decoder_layers=decoder_layers or depth,
                     dropout_p=0.0, attention_dropout_p=0.0, activation_dropout_p=0.0)
    if num_heads is not None:
        overrides["num_heads"] = num_heads
    return get_preset(base_preset, **overrides)


def make_batch(cfg: ModelConfig, batch_size: int = 8, src_len: int = 16, tgt_len: int = 16,
               seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (src (B, S), tgt_in (B, T)) without padding; tgt_in starts with EOS (fairseq)."""
    g = torch.Generator().manual_seed(seed)
    low = max(cfg.bos_idx, cfg.pad_idx, cfg.eos_idx, cfg.unk_idx) + 1
    src = torch.randint(low, cfg.vocab_size, (batch_size, src_len), generator=g)
    tgt_in = torch.randint(low, cfg.vocab_size, (batch_size, tgt_len), generator=g)
    tgt_in[:, 0] = cfg.eos_idx
    return src, tgt_in


def build_analysis_model(init_name: str, depth: int, seed: int, profile_batch=None,
                         formula: str = "reference", **cfg_kwargs) -> EncoderDecoder:
    """Seeded model in eval mode; ``admin`` is profiled on ``profile_batch`` (drawn from
    ``seed`` when None) so its omega is the one training would start from."""
    cfg = analysis_config(init_name, depth, **cfg_kwargs)
    torch.manual_seed(seed)
    model = build_model(cfg)
    if init_name == "admin":
        batch = profile_batch if profile_batch is not None else make_batch(cfg, seed=seed + 1)
        profile_omega(model, batch, formula=formula, seed=seed)
    return model.eval()


# ------------------------------------------------------------------------------------------------
# Output change
# ------------------------------------------------------------------------------------------------


def perturbed_parameters(model: nn.Module, scope: str = "branches") -> list[nn.Parameter]:
    """The parameters ``perturbation`` touches, in model order: those of every attention and FFN
    module (``branches``) or all of them (``all``)."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    if scope == "all":
        return list(model.parameters())
    chosen = {id(p) for m in model.modules() if isinstance(m, (MultiheadAttention, FeedForward))
              for p in m.parameters()}
    return [p for p in model.parameters() if id(p) in chosen]


class perturbation:
    """Context manager: W* = W + delta in place, delta ~ N(0, sigma^2) i.i.d. per element drawn
    from ``generator``; the exact W is copied back on exit (no deepcopy of a deep model)."""

    def __init__(self, model: nn.Module, sigma: float, generator: torch.Generator,
                 scope: str = "branches") -> None:
        self.params = perturbed_parameters(model, scope)
        self.sigma, self.generator = sigma, generator
        self.saved: list[torch.Tensor] = []

    @torch.no_grad()
    def __enter__(self) -> "perturbation":
        for p in self.params:
            self.saved.append(p.detach().clone())
            noise = torch.randn(p.shape, generator=self.generator, dtype=torch.float32)
            p.add_(noise.to(p) * self.sigma)
        return self

    @torch.no_grad()
    def __exit__(self, *exc) -> None:
        for p, w in zip(self.params, self.saved):
            p.copy_(w)
        self.saved.clear()


@torch.no_grad()
def model_output(model: EncoderDecoder, batch: tuple[torch.Tensor, torch.Tensor],
                 target: str = "encoder") -> torch.Tensor:
    """F(x, W): the encoder output (B, S, D), or the final decoder states (B, T, D) taken before
    the vocabulary projection (the output of the last decoder layer, or of the final Pre-LN
    LayerNorm) with a forward hook, so the model needs no extra entry point."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    src, tgt_in = batch
    if target == "encoder":
        return model.encode(src)[0]
    last = model.decoder_layer_norm if model.decoder_layer_norm is not None else model.decoder_layers[-1]
    seen: list[torch.Tensor] = []
    handle = last.register_forward_hook(lambda mod, inp, out: seen.append(out))
    try:
        model(src, tgt_in)
    finally:
        handle.remove()
    return seen[-1]


def output_change(model: EncoderDecoder, batch, sigma: float = 0.001, seed: int = 0,
                  scope: str = "branches", target: str = "encoder", repeats: int = 1) -> float:
    """mean over tokens of |F(x, W) - F(x, W*)|_2^2 (squared norm over D), averaged over
    ``repeats`` independent deltas (the value is heavy-tailed in delta, Post-LN most of all)."""
    g = torch.Generator().manual_seed(seed)
    ref = model_output(model, batch, target)
    total = 0.0
    for _ in range(repeats):
        with perturbation(model, sigma, g, scope):
            out = model_output(model, batch, target)
        total += float((ref - out).double().square().sum(-1).mean())
    return total / repeats


# ------------------------------------------------------------------------------------------------
# Layer dependency beta_{i,j}
# ------------------------------------------------------------------------------------------------


class DependencyRecorder:
    """Follows the encoder stream as a sum of components [x_0, a_1, ..., a_i] (module docstring).

    Called by every residual (``attach_recorder``); on a Post-LN model the stream LayerNorms are
    hooked too (``ln_hook``) and a row of component sizes is taken after each of them, otherwise
    right after the residual sum. The components live in one float64 tensor (2N+1, B, S, D), of
    which the first ``count`` are in use, so each update is one vectorised operation.
    """

    def __init__(self, num_sublayers: int, rows_after_norm: bool) -> None:
        self.capacity = num_sublayers + 1
        self.rows_after_norm = rows_after_norm
        self.store: Optional[torch.Tensor] = None
        self.count = 0
        self.rows: list[list[float]] = []

    @property
    def components(self) -> torch.Tensor:
        """(count, B, S, D): x_0 and the branch outputs so far, as they sit in the stream now."""
        return self.store[: self.count]

    def __call__(self, residual: Residual, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if residual.stack == "encoder":
            if self.store is None:  # the first sub-layer's shortcut is x_0
                self.store = x.new_zeros((self.capacity, *x.shape), dtype=torch.float64)
                self.store[0] = x
                self.count = 1
            scale = residual.shortcut_scale()
            if scale is not None:
                self.components.mul_(scale.double())
            self.store[self.count] = y
            self.count += 1
            if not self.rows_after_norm:
                self._take_row()
        return residual.combine(x, y)

    def ln_hook(self, norm: nn.LayerNorm, inputs, output) -> None:
        (b,) = inputs
        std = torch.sqrt(b.double().var(-1, unbiased=False, keepdim=True) + norm.eps)
        c = self.components
        c.sub_(c.mean(-1, keepdim=True)).div_(std)
        if norm.weight is not None:
            c.mul_(norm.weight.double())
        self._take_row()

    def _take_row(self) -> None:
        self.rows.append(self.components.std(dim=-1, unbiased=False).mean(dim=(1, 2)).tolist())


@torch.no_grad()
def trace_components(model: EncoderDecoder, src: torch.Tensor) -> DependencyRecorder:
    """One eval-mode encoder pass with a ``DependencyRecorder`` attached; returns it (its
    ``components`` sum over dim 0 to the encoder output, before the final LayerNorm on Pre-LN)."""
    post_ln = model.cfg.norm_order == "post"
    norms = [n for layer in model.encoder_layers
             for n in (layer.self_attn_layer_norm, layer.final_layer_norm)
             if post_ln and isinstance(n, nn.LayerNorm)]
    recorder = DependencyRecorder(2 * len(model.encoder_layers), rows_after_norm=bool(norms))
    handles = [n.register_forward_hook(recorder.ln_hook) for n in norms]
    was_training = model.training
    model.eval()
    try:
        with attach_recorder(model, recorder):
            model.encode(src)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return recorder


def layer_dependency(model: EncoderDecoder, src: torch.Tensor) -> np.ndarray:
    """beta (2N, 2N+1): row i-1 is encoder sub-layer i, column j is x_0 (j = 0) or branch j;
    entries with j > i are 0 and every row sums to 1."""
    rows = trace_components(model, src).rows
    beta = np.zeros((len(rows), len(rows) + 1))
    for i, row in enumerate(rows):
        beta[i, : len(row)] = np.asarray(row) / sum(row)
    return beta


# ------------------------------------------------------------------------------------------------
# Fits and the whole study
# ------------------------------------------------------------------------------------------------


def r_squared(x: Sequence[float], y: Sequence[float]) -> Optional[float]:
    """R^2 of the least-squares line y = a x + b (None with fewer than 3 points)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(x) < 3:
        return None
    a, b = np.polyfit(x, y, 1)
    ss_res = float(np.sum((y - (a * x + b)) ** 2))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    return 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0


@contextmanager
def torch_threads(num_threads: Optional[int]):
    """Run the block with ``num_threads`` torch threads (None: unchanged), then restore."""
    before = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_analyses(depths: Iterable[int] = (1, 2, 4, 8, 16, 32), inits: Iterable[str] = ("post", "pre", "admin"),
                 seeds: Iterable[int] = (0, 1, 2, 3), *, base_preset: str = "debug-tiny", model_dim: int = 64,
                 ffn_inner_dim: Optional[int] = None, num_heads: Optional[int] = None,
                 decoder_layers: Optional[int] = None, sigma: float = 0.001, repeats: int = 4,
                 scope: str = "branches", target: str = "encoder", batch_size: int = 8,
                 src_len: int = 16, tgt_len: int = 16, formula: str = "reference",
                 num_threads: Optional[int] = 1, progress: bool = False) -> dict:
    """Output change and beta for every (init, depth), averaged over ``seeds`` (one model, one
    batch and ``repeats`` perturbations per seed).

    Returns a JSON-ready dict: ``settings``; ``output_change[init]`` with per-depth ``mean``,
    ``std`` and ``per_seed`` values, ``r2_vs_n``, ``r2_vs_log_n`` and ``growth`` (change at the
    deepest over the shallowest depth); ``dependency[init]`` with per-depth ``mean_diagonal``
    (mean over sub-layers of beta_{i,i}) and ``beta`` (seed-averaged matrix) of the deepest model.

    The tensors are tiny (a few hundred tokens by D), so torch runs with ``num_threads`` threads
    (restored afterwards): on a busy machine, more threads than free cores make such small
    matmuls tens of times slower. None keeps torch's setting.
    """
    depths, inits, seeds = sorted(set(int(d) for d in depths)), list(inits), list(seeds)
    for name in inits:
        if name not in INIT_VARIANTS:
            raise ValueError(f"unknown init {name!r}; known: {', '.join(INIT_VARIANTS)}")
    if not depths or min(depths) < 1 or not seeds:
        raise ValueError("need at least one depth >= 1 and one seed")
    cfg_kwargs = dict(base_preset=base_preset, model_dim=model_dim, ffn_inner_dim=ffn_inner_dim,
                      num_heads=num_heads, decoder_layers=decoder_layers)
    cfg0 = analysis_config(inits[0], depths[0], **cfg_kwargs)
    settings = dict(depths=depths, inits=inits, seeds=seeds, base_preset=base_preset,
                    model_dim=cfg0.model_dim, ffn_inner_dim=cfg0.ffn_inner_dim, num_heads=cfg0.num_heads,
                    decoder_layers=decoder_layers or "= depth", sigma=sigma, sigma_kind="absolute",
                    perturbations_per_model=repeats,
                    scope=scope, target=target, batch_size=batch_size, src_len=src_len, tgt_len=tgt_len,
                    admin_formula=formula, measure="mean over tokens of squared L2 norm over D",
                    beta_norm="m_j / sum_k m_k, m_j = component_j.std(-1).mean()")

    jobs = [(name, depth, seed) for name in inits for depth in depths for seed in seeds]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(jobs), desc="models", unit="model")
    changes: dict[str, dict[int, list[float]]] = {n: {d: [] for d in depths} for n in inits}
    diagonals: dict[str, dict[int, list[float]]] = {n: {d: [] for d in depths} for n in inits}
    deepest_beta: dict[str, list[np.ndarray]] = {n: [] for n in inits}
    start = time.perf_counter()
    with torch_threads(num_threads):
        for name, depth, seed in jobs:
            if bar is not None:
                bar.set_postfix_str(f"{name} N={depth} seed={seed}")
            cfg = analysis_config(name, depth, **cfg_kwargs)
            batch = make_batch(cfg, batch_size, src_len, tgt_len, seed=1000 + seed)
            profile_batch = make_batch(cfg, batch_size, src_len, tgt_len, seed=2000 + seed)
            model = build_analysis_model(name, depth, seed, profile_batch, formula, **cfg_kwargs)
            changes[name][depth].append(
                output_change(model, batch, sigma, 3000 + seed, scope, target, repeats))
            beta = layer_dependency(model, batch[0])
            diagonals[name][depth].append(float(np.mean(np.diag(beta[:, 1:]))))
            if depth == depths[-1]:
                deepest_beta[name].append(beta)
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()

    result = {"settings": settings, **_summarise(depths, changes, diagonals, deepest_beta)}
    result["runtime_s"] = time.perf_counter() - start
    return result


def _summarise(depths: list[int], changes: dict, diagonals: dict, deepest_beta: dict) -> dict:
    """``output_change`` and ``dependency`` of ``run_analyses``' result from the per-seed values."""
    result = {"output_change": {}, "dependency": {}}
    for name in changes:
        means = [float(np.mean(changes[name][d])) for d in depths]
        result["output_change"][name] = {
            "depths": depths,
            "mean": means,
            "std": [float(np.std(changes[name][d])) for d in depths],
            "per_seed": [changes[name][d] for d in depths],
            "r2_vs_n": r_squared(depths, means),
            "r2_vs_log_n": r_squared(np.log(depths), means),
            "growth": means[-1] / means[0] if means[0] > 0 else None,
        }
        result["dependency"][name] = {
            "depths": depths,
            "mean_diagonal": [float(np.mean(diagonals[name][d])) for d in depths],
            "deepest_depth": depths[-1],
            "beta": np.mean(deepest_beta[name], axis=0).tolist(),
        }
    return result


# ------------------------------------------------------------------------------------------------
# Report: JSON, plots, table
# ------------------------------------------------------------------------------------------------


def plot_output_change(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, oc in result["output_change"].items():
        for ax in axes:
            ax.errorbar(oc["depths"], oc["mean"], yerr=oc["std"], marker="o", capsize=3, label=name)
    s = result["settings"]
    axes[0].set_title("output change vs N")
    axes[1].set_title("output change vs log N")
    axes[1].set_xscale("log")
    axes[1].set_xticks(s["depths"])
    axes[1].xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    axes[1].xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    for ax in axes:
        ax.set_xlabel(f"encoder layers N (decoder layers {s['decoder_layers']})")
        ax.set_ylabel("|F(x,W) - F(x,W*)|^2 per token")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{s['target']} output, sigma={s['sigma']} ({s['scope']}), D={s['model_dim']}: "
                 f"mean +- std over {len(s['seeds'])} seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_dependency(result: dict, name: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.colors
    import matplotlib.pyplot as plt

    dep = result["dependency"][name]
    beta = np.asarray(dep["beta"])
    shown = np.where(np.tril(np.ones_like(beta, dtype=bool), k=1), beta, np.nan)  # j <= i
    fig, ax = plt.subplots(figsize=(6, 5))
    rows = beta.shape[0]  # the extent puts sub-layer i (1-based) at y = i and branch j at x = j
    # Log colours: in a deep model most entries are ~1/(2N) and the first rows would take the
    # whole linear scale, hiding the diagonal band that separates Post-LN from Admin and Pre-LN.
    positive = beta[beta > 0]
    norm = matplotlib.colors.LogNorm(vmin=max(float(positive.min()), 1e-4), vmax=1.0) if positive.size else None
    im = ax.imshow(shown, cmap="viridis", aspect="auto", interpolation="nearest", norm=norm,
                   extent=(-0.5, rows + 0.5, rows + 0.5, 0.5))
    fig.colorbar(im, ax=ax, label="beta_{i,j} (log scale)")
    ax.set_xlabel("j (0 = embedding x_0, else residual branch j)")
    ax.set_ylabel("encoder sub-layer i")
    ax.set_title(f"{name}: beta at init, N={dep['deepest_depth']} layers")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_report(result: dict, out_dir: str | Path) -> dict[str, Path]:
    """``analysis.json``, ``output_change.png`` and one ``dependency_<init>.png`` per init."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / RESULT_FILE}
    paths["json"].write_text(json.dumps(result, indent=1) + "\n")
    paths["output_change"] = plot_output_change(result, out / "output_change.png")
    for name in result["dependency"]:
        paths[f"dependency_{name}"] = plot_dependency(result, name, out / f"dependency_{name}.png")
    return paths


def format_table(result: dict) -> str:
    """Output change per depth (rows) and init (columns), then R^2, growth and mean beta_{i,i}."""
    names = list(result["output_change"])
    depths = result["settings"]["depths"]
    width = max(12, *(len(n) + 2 for n in names))
    lines = ["output change " + result["settings"]["measure"],
             f"{'N':>6}" + "".join(f"{n:>{width}}" for n in names)]
    for k, d in enumerate(depths):
        lines.append(f"{d:>6}" + "".join(f"{result['output_change'][n]['mean'][k]:>{width}.4g}" for n in names))

    def row(label: str, values) -> str:
        return f"{label:>6}" + "".join(f"{'-' if v is None else format(v, '.3f'):>{width}}" for v in values)

    lines.append(row("R2(N)", [result["output_change"][n]["r2_vs_n"] for n in names]))
    lines.append(row("R2(lnN)", [result["output_change"][n]["r2_vs_log_n"] for n in names]))
    lines.append(row("growth", [result["output_change"][n]["growth"] for n in names]))
    lines.append(row("b_ii", [result["dependency"][n]["mean_diagonal"][-1] for n in names]))
    return "\n".join(lines)
