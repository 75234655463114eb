"""The atlas's outputs: ``atlas.json``, ``atlas.md`` and the plots (matplotlib, Agg).

    paths = write_report(result, out_dir, command="python launch/atlas.py ...")

``result`` is ``Atlas.collect()`` (atlas.py). Plots:

    loss_curves.png     training nll per depth (columns) and learning-rate/warmup setting (rows),
                        one line per init
    valid_vs_depth.png  best validation nll and validation BLEU vs depth, one line per init and setting
                        (the mean over seeds; bars: their range)
    omega_admin.png     Admin's profiled omega per sub-layer, encoder and decoder, one line per depth
    output_change.png   Theorem 2's output change at initialisation vs depth, next to the share of
                        the grid's learning rates at which each init trained

``plot_runs`` draws any runs' training and validation curves side by side (launch/plot_runs.py).
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


def _cells(result: dict, init: str, depth: str, lr: float, warmup: int) -> list[dict]:
    """The cell's runs, one per seed (those that exist)."""
    return [c for c in result["cells"] if c["init"] == init and c["depth"] == depth and c["lr"] == lr
            and c["warmup"] == warmup and c["outcome"] != "missing"]


def _spread(values: list, digits: int) -> str:
    """The mean, and with several seeds their range: ``4.12 (4.10-4.15)``."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    mean = f"{sum(values) / len(values):.{digits}f}"
    return mean if len(values) == 1 else f"{mean} ({min(values):.{digits}f}-{max(values):.{digits}f})"


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
        f"{g['max_updates']} updates of <= {g['max_tokens']} tokens, seed(s) {', '.join(map(str, g['seeds']))}, "
        f"engine `{g['deepspeed_config']}`" + (f", `{' '.join(g['extra'])}`" if g["extra"] else "")
        + (f"; cells of {g['pipeline_from']} layers or more as 2 pipeline stages on 2 ranks"
           if g.get("pipeline_from") else ""),
        f"- outcome: {MARKS['trained']} trained, {MARKS['stalled']} stalled (best validation nll within "
        f"{result['stall_margin_bits']} bits of the unigram model or above), {MARKS['diverged']} diverged "
        f"(non-finite, or final loss above the end-of-warmup loss), {MARKS['failed']} failed (error), "
        f"{MARKS['unfinished']} unfinished (stopped without an error; a rerun resumes it). "
        "Each cell: the outcome of every seed, best validation nll (bits), validation BLEU "
        f"({g['bleu_sentences'] or 'all'} sentences, beam {g['bleu_beam']}); with several seeds the mean "
        "and, in brackets, the range over seeds",
        "",
    ]
    for lr, warmup in _settings(result):
        lines += [f"## learning rate {lr:g}, warmup {warmup}", "",
                  "| depth | " + " | ".join(inits) + " |", "|---|" + "---|" * len(inits)]
        for depth in depths:
            row = []
            for init in inits:
                runs = _cells(result, init, depth, lr, warmup)
                if not runs:
                    row.append("")
                    continue
                marks = "".join(MARKS[c["outcome"]] for c in runs)
                nll = _spread([c.get("best_valid_nll") for c in runs], 2)
                bleu = _spread([c.get("bleu") for c in runs], 1)
                row.append(f"{marks} {nll} / {bleu}")
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
            if not any(c.get("curve") for init in result["grid"]["inits"] for c in _cells(result, init, depth, lr, warmup)):
                ax.text(0.5, 0.5, "not run yet", ha="center", va="center", transform=ax.transAxes, color="grey")
            for init in result["grid"]["inits"]:
                runs = [c for c in _cells(result, init, depth, lr, warmup) if c.get("curve")]
                for k_seed, c in enumerate(runs):  # one line per seed, the init's colour
                    u, nll = smoothed([r[0] for r in c["curve"]], [r[2] for r in c["curve"]])
                    label = f"{init} " + "".join(MARKS[r["outcome"]] for r in runs) if k_seed == 0 else None
                    ax.plot(u, nll, color=COLORS.get(init), alpha=1.0 if k_seed == 0 else 0.6, label=label)
            ax.axhline(result["unigram_bits"], color="grey", ls=":", lw=1)
            ax.set_title(f"{depth}, lr {lr:g}, warmup {warmup}", fontsize=9)
            _style(ax, "update", "training nll (bits)" if k == 0 else None,
                   legend=bool(ax.get_legend_handles_labels()[0]))
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
            per_depth = [_cells(result, init, d, lr, warmup) for d in depths]
            for ax, key in zip(axes, ("best_valid_nll", "bleu")):
                values = [[c[key] for c in runs if c.get(key) is not None] for runs in per_depth]
                y = [sum(v) / len(v) if v else float("nan") for v in values]
                low = [y_ - min(v) if v else 0.0 for y_, v in zip(y, values)]  # the seeds' range
                high = [max(v) - y_ if v else 0.0 for y_, v in zip(y, values)]
                ax.errorbar(x, y, yerr=[low, high], marker="o", ls=styles[s % len(styles)], capsize=3,
                            color=COLORS.get(init), label=f"{init}, lr {lr:g}/wu {warmup}")
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


def trained_share(result: dict, init: str, depth: str, settings: list) -> float:
    """The share of ``init``'s finished runs at ``depth`` (over ``settings`` and the seeds) that
    trained; NaN (a gap in the plot, not 0) where none has finished: not run, or still running."""
    runs = [c for lr, w in settings for c in _cells(result, init, depth, lr, w) if c["outcome"] != "unfinished"]
    return sum(1 for c in runs if c["outcome"] == "trained") / len(runs) if runs else float("nan")


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
        axes[1].plot(x, [trained_share(result, init, d, settings) for d in depths], marker="o",
                     color=COLORS.get(init), label=init)
    axes[0].set_yscale("log")
    axes[0].set_title(f"Theorem 2: |F(W) - F(W + delta)|^2, sigma {oc['sigma']}", fontsize=9)
    _style(axes[0], "depth", "output change at init (per token)", depths)
    axes[1].set_ylim(-0.05, 1.05)
    axes[1].set_title(f"training outcome over {len(settings)} lr/warmup setting(s) and the seeds", fontsize=9)
    _style(axes[1], "depth", "share of runs that trained", depths)
    return _save(fig, path)


def run_curves(run_dir: Path) -> dict:
    """A run's training and validation nll (bits), one value per update (the last written), and
    its best validation."""
    from admin_ds.train.atlas import last_per_update, read_metrics

    records = read_metrics(run_dir)
    train = sorted((u, nll) for u, (nll,) in last_per_update(records, "train", ("nll",)).items())
    valid = sorted((u, nll) for u, (nll,) in last_per_update(records, "valid", ("nll",)).items())
    best = min(valid, key=lambda r: r[1]) if valid else None
    return {"run": str(run_dir), "train": train, "valid": valid, "best": best,
            "updates": max((u for u, _ in train), default=0)}


def plot_runs(curves: list[dict], path: Path) -> Path:
    """Training nll (window means) and validation nll against updates, one colour per run."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for c in curves:
        label = Path(c["run"]).name
        line, = axes[0].plot(*smoothed([u for u, _ in c["train"]], [n for _, n in c["train"]], points=30), label=label)
        if c["valid"]:
            axes[1].plot([u for u, _ in c["valid"]], [n for _, n in c["valid"]], marker=".", color=line.get_color(),
                         label=f"{label}: best {c['best'][1]:.2f} at {c['best'][0]}")
    _style(axes[0], "update", "training nll (bits, window means)")
    _style(axes[1], "update", "validation nll (bits)")
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
