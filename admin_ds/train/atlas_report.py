"""The atlas's outputs: ``atlas.json``, ``atlas.md`` and the plots (matplotlib, Agg).

    paths = write_report(result, out_dir, command="python launch/atlas.py ...")

``result`` is ``Atlas.collect()`` (atlas.py). Plots:

    loss_curves.png     training nll per depth (columns) and learning-rate/warmup setting (rows),
                        one line per init
    valid_vs_depth.png  best validation nll and validation BLEU vs depth, one line per init and setting
    omega_admin.png     Admin's profiled omega per sub-layer, encoder and decoder, one line per depth
    output_change.png   Theorem 2's output change at initialisation vs depth, next to the share of
                        the grid's learning rates at which each init trained
"""

from __future__ import annotations

import datetime
import json
import platform
from pathlib import Path
from typing import Optional

MARKS = {"trained": "✓", "stalled": "~", "diverged": "✗", "failed": "!", "unfinished": "…", "missing": " "}
COLORS = {"post": "tab:red", "pre": "tab:blue", "admin": "tab:green", "admin-constant": "tab:olive",
          "deepnorm": "tab:purple", "t-fixup": "tab:orange"}


def hardware() -> str:
    """CPU model name (as lscpu prints it), core count, and the GPU when there is one."""
    cpu = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import os

    text = f"{cpu}, {os.cpu_count()} cores"
    try:
        import torch

        if torch.cuda.is_available():
            text += f", {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
        text += f"; torch {torch.__version__}"
    except ImportError:
        pass
    return text


def _settings(result: dict) -> list[tuple[float, int]]:
    g = result["grid"]
    return [(float(lr), int(w)) for lr in g["lrs"] for w in g["warmups"]]


def _depths(result: dict) -> list[str]:
    seen = []
    for c in result["cells"]:
        if c["depth"] not in seen:
            seen.append(c["depth"])
    return seen


def _cell(result: dict, init: str, depth: str, lr: float, warmup: int) -> Optional[dict]:
    return next((c for c in result["cells"] if c["init"] == init and c["depth"] == depth
                 and c["lr"] == lr and c["warmup"] == warmup), None)


# ------------------------------------------------------------------------------------------------
# Markdown
# ------------------------------------------------------------------------------------------------


def format_markdown(result: dict, command: str, plots: dict[str, Path]) -> str:
    g = result["grid"]
    inits, depths = g["inits"], _depths(result)
    lines = [
        "# Stability atlas", "",
        f"- command: `{command}`",
        f"- date: {result.get('date', datetime.date.today().isoformat())}",
        f"- hardware: {result.get('hardware') or hardware()}",
        f"- data: `{result['data_dir']}`; unigram cross-entropy of the validation targets "
        f"{result['unigram_bits']:.2f} bits",
        f"- every cell: preset {g['preset']} width {g['model_dim']}/{g['ffn_inner_dim']}/{g['num_heads']}, "
        f"{g['max_updates']} updates of <= {g['max_tokens']} tokens, seed {g['seed']}, engine "
        f"`{g['deepspeed_config']}`" + (f", `{' '.join(g['extra'])}`" if g["extra"] else ""),
        f"- outcome: {MARKS['trained']} trained, {MARKS['stalled']} stalled (best validation nll within "
        f"{result['stall_margin_bits']} bits of the unigram model or above), {MARKS['diverged']} diverged "
        f"(non-finite, or final loss above the end-of-warmup loss), {MARKS['failed']} failed (error), "
        f"{MARKS['unfinished']} unfinished (stopped without an error; a rerun resumes it). "
        "Each cell: outcome, best validation nll (bits), validation BLEU "
        f"({g['bleu_sentences'] or 'all'} sentences, beam {g['bleu_beam']})",
        "",
    ]
    for lr, warmup in _settings(result):
        lines += [f"## learning rate {lr:g}, warmup {warmup}", "",
                  "| depth | " + " | ".join(inits) + " |", "|---|" + "---|" * len(inits)]
        for depth in depths:
            row = []
            for init in inits:
                c = _cell(result, init, depth, lr, warmup)
                if c is None or c["outcome"] == "missing":
                    row.append("")
                    continue
                nll = "-" if c.get("best_valid_nll") is None else f"{c['best_valid_nll']:.2f}"
                bleu = "-" if c.get("bleu") is None else f"{c['bleu']:.1f}"
                row.append(f"{MARKS[c['outcome']]} {nll} / {bleu}")
            lines.append(f"| {depth} | " + " | ".join(row) + " |")
        lines.append("")
    oc = result.get("output_change")
    if oc:
        lines += [f"## Output change at initialisation (Theorem 2; sigma {oc['sigma']}, {oc['seeds']} seeds, "
                  "final decoder states)", "", "| depth | " + " | ".join(oc["inits"]) + " |",
                  "|---|" + "---|" * len(oc["inits"])]
        for k, depth in enumerate(depths):
            vals = [oc["inits"][i][k]["mean"] for i in oc["inits"]]
            lines.append(f"| {depth} | " + " | ".join(f"{v:.3g}" for v in vals) + " |")
        lines.append("")
    notes = [c for c in result["cells"] if c["outcome"] in ("diverged", "failed", "unfinished")]
    if notes:
        lines += ["## Why cells diverged, failed or are unfinished", ""]
        lines += [f"- {c['name']}: {c['reason']}" for c in notes]
        lines.append("")
    if plots:
        lines += ["## Plots", ""] + [f"![{name}]({path.name})" for name, path in plots.items()] + [""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Plots
# ------------------------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    """Small PNGs (dpi 80): they are committed with the docs."""
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    _pyplot().close(fig)
    return path


def _style(ax, xlabel: str, ylabel: Optional[str] = None, depths: Optional[list] = None,
           legend: bool = True) -> None:
    if depths is not None:
        ax.set_xticks(range(len(depths)), depths)
    ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize=7)


def smoothed(updates: list, values: list, points: int = 60) -> tuple[list, list]:
    """Means over consecutive windows (about ``points`` of them; a partial last window is left
    out): one update's loss varies with its batch more than the curves differ."""
    w = max(1, len(values) // points)
    starts = range(0, len(values) - w + 1, w)
    return [updates[i + w - 1] for i in starts], [sum(values[i:i + w]) / w for i in starts]


def plot_loss_curves(result: dict, path: Path) -> Path:
    plt = _pyplot()
    depths, settings = _depths(result), _settings(result)
    fig, axes = plt.subplots(len(settings), len(depths), figsize=(4 * len(depths), 3 * len(settings)),
                             squeeze=False, sharey=True)
    for r, (lr, warmup) in enumerate(settings):
        for k, depth in enumerate(depths):
            ax = axes[r][k]
            for init in result["grid"]["inits"]:
                c = _cell(result, init, depth, lr, warmup)
                if c and c.get("curve"):
                    u, nll = smoothed([r[0] for r in c["curve"]], [r[2] for r in c["curve"]])
                    ax.plot(u, nll, color=COLORS.get(init), label=f"{init} {MARKS[c['outcome']]}")
            ax.axhline(result["unigram_bits"], color="grey", ls=":", lw=1)
            ax.set_title(f"{depth}, lr {lr:g}, warmup {warmup}", fontsize=9)
            _style(ax, "update", "training nll (bits)" if k == 0 else None)
    fig.suptitle("training nll (window means); dotted: the unigram model's validation cross-entropy",
                 fontsize=10)
    return _save(fig, path)


def plot_valid_vs_depth(result: dict, path: Path) -> Path:
    plt = _pyplot()
    depths = _depths(result)
    x = list(range(len(depths)))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    styles = ["-", "--", ":", "-."]
    for s, (lr, warmup) in enumerate(_settings(result)):
        for init in result["grid"]["inits"]:
            cells = [_cell(result, init, d, lr, warmup) for d in depths]
            for ax, key in zip(axes, ("best_valid_nll", "bleu")):
                y = [float("nan") if c is None or c.get(key) is None else c[key] for c in cells]
                ax.plot(x, y, marker="o", ls=styles[s % len(styles)], color=COLORS.get(init),
                        label=f"{init}, lr {lr:g}/wu {warmup}")
    for ax, label in zip(axes, ("best validation nll (bits)", "validation BLEU")):
        _style(ax, "depth", label, depths, legend=ax is axes[1])
    axes[0].axhline(result["unigram_bits"], color="grey", ls=":", lw=1)
    return _save(fig, path)


def plot_omega(result: dict, path: Path) -> Optional[Path]:
    profiled = {}
    for c in result["cells"]:
        if c.get("omega") and c["depth"] not in profiled:  # same seed and batch: one per depth
            profiled[c["depth"]] = c["omega"]
    if not profiled:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    for depth, omega in profiled.items():
        for ax, stack in zip(axes, ("encoder", "decoder")):
            ax.plot(range(1, len(omega[stack]) + 1), omega[stack], marker=".", label=depth)
    for ax, stack in zip(axes, ("encoder", "decoder")):
        ax.set_title(f"Admin omega, {stack}")
        _style(ax, "sub-layer (forward order)", "omega")
    return _save(fig, path)


def plot_output_change(result: dict, path: Path) -> Optional[Path]:
    oc = result.get("output_change")
    if not oc:
        return None
    plt = _pyplot()
    depths, settings = _depths(result), _settings(result)
    x = list(range(len(depths)))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for init, rows in oc["inits"].items():
        axes[0].errorbar(x, [r["mean"] for r in rows], yerr=[r["std"] for r in rows], marker="o", capsize=3,
                         color=COLORS.get(init), label=init)
        share = []
        for d in depths:
            cells = [_cell(result, init, d, lr, w) for lr, w in settings]
            share.append(sum(1 for c in cells if c and c["outcome"] == "trained") / len(settings))
        axes[1].plot(x, share, marker="o", color=COLORS.get(init), label=init)
    axes[0].set_yscale("log")
    axes[0].set_title(f"Theorem 2: |F(W) - F(W + delta)|^2, sigma {oc['sigma']}", fontsize=9)
    _style(axes[0], "depth", "output change at init (per token)", depths)
    axes[1].set_ylim(-0.05, 1.05)
    axes[1].set_title(f"training outcome over {len(settings)} lr/warmup setting(s)", fontsize=9)
    _style(axes[1], "depth", "share of learning rates that trained", depths)
    return _save(fig, path)


def write_report(result: dict, out_dir: str | Path, command: str) -> dict[str, Path]:
    """Plots first, then ``atlas.md`` (which links them) and ``atlas.json``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result.setdefault("date", datetime.date.today().isoformat())
    result.setdefault("hardware", hardware())
    result["command"] = command
    plots = {"loss curves": plot_loss_curves(result, out / "loss_curves.png"),
             "validation vs depth": plot_valid_vs_depth(result, out / "valid_vs_depth.png"),
             "Admin omega": plot_omega(result, out / "omega_admin.png"),
             "output change and outcome": plot_output_change(result, out / "output_change.png")}
    plots = {k: v for k, v in plots.items() if v is not None}
    from admin_ds import files

    paths = {"json": files.write_text(out / "atlas.json", json.dumps(result, indent=1) + "\n"),
             "markdown": files.write_text(out / "atlas.md", format_markdown(result, command, plots) + "\n")}
    return {**paths, **plots}
