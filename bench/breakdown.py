"""Where a training update's time goes, from a ``torch.profiler`` trace (bench/train_throughput.py).

Every profiled operator's *self* time (CPU time on a CPU; the time of the kernels it launched on a
GPU) goes to one category:

    matmul             products with weight matrices (forward and backward)
    attention          scaled dot-product attention, its softmax and dropout, any backend (computed
                       outside SDPA: its products and softmax)
    layer norm         LayerNorm forward and backward
    other compute      dropout, activations, residual sums, embeddings, the loss
    optimizer          torch's ``Optimizer.step`` (inside DeepSpeed's step)
    DeepSpeed          the engine's own work: gradient hooks and reductions at each parameter's
                       gradient accumulation, the step outside the optimizer, communication
    data               drawing and collating the batch
    outside operators  the wall time no operator accounts for: Python, the framework between
                       operators; on a GPU, the time the GPU is idle

A backward operator counts where its forward operator counts: autograd links them by sequence
number (the forward ``aten::bmm`` of an attention and its ``BmmBackward0`` are both attention).
The benchmark marks the regions it knows with ``record_function``: ``data`` around the batch
iterator, ``engine.step`` and ``engine.backward`` around the engine's calls.
"""

from __future__ import annotations

import functools

from torch.autograd.profiler import record_function

CATEGORIES = ("matmul", "attention", "layer norm", "other compute", "optimizer", "DeepSpeed", "data",
              "outside operators")
MATMUL = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
          "aten::addmv", "aten::mv"}
ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")
# Attention computed outside SDPA (engine.dropout=bulk, layers.py ``_attend_dropout``): its
# batched products and softmax. Nothing else in a training step runs these (the linear layers
# are mm/addmm, the loss a log-softmax); its masking and dropout count as other compute.
ATTENTION_OPS = {"aten::bmm", "aten::softmax", "aten::_softmax"}
COMMUNICATION = ("c10d::", "nccl:", "gloo:", "record_param_comms")
EVALUATE = "autograd::engine::evaluate_function: "


def labelled(fn, name: str):
    """``fn`` inside a profiler range called ``name``."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)

    return run


def _ancestors(e):
    while e is not None:
        yield e
        e = e.cpu_parent


def _op_category(chain) -> str:
    names = [e.name for e in chain]
    if any(k in n for n in names for k in ATTENTION) or any(n in ATTENTION_OPS for n in names):
        return "attention"
    if any("layer_norm" in n for n in names):
        return "layer norm"
    if any(n in MATMUL for n in names):
        return "matmul"
    return "other compute"


def categorise(events) -> dict:
    """FunctionEvent -> category, for every event of a profile."""
    forward = {}  # (thread, sequence number) -> the deepest forward op that recorded it
    depth = {}
    for e in events:
        chain = list(_ancestors(e))
        if e.sequence_nr >= 0 and not any(x.name.startswith(EVALUATE) for x in chain):
            key = (e.thread, e.sequence_nr)
            if len(chain) >= depth.get(key, -1):
                forward[key], depth[key] = e, len(chain)
    out = {}
    for e in events:
        chain = list(_ancestors(e))
        names = [x.name for x in chain]
        if "data" in names:
            out[e] = "data"
        elif any(n.startswith("Optimizer.step#") for n in names):
            out[e] = "optimizer"
        elif any(n.startswith(COMMUNICATION) for n in names):
            out[e] = "DeepSpeed"
        else:
            node = next((x for x in chain if x.name.startswith(EVALUATE)), None)
            if node is not None:
                fwd = forward.get((getattr(node, "fwd_thread", node.thread), node.sequence_nr))
                if node.name.endswith("AccumulateGrad") or fwd is None:
                    out[e] = "DeepSpeed"  # gradient accumulation and the hooks ZeRO runs there
                else:
                    out[e] = _op_category(list(_ancestors(fwd)))
            elif "engine.step" in names or "engine.backward" in names:
                out[e] = "DeepSpeed"
            else:
                out[e] = _op_category(chain)
    return out


def breakdown(prof, wall_s: float, on_gpu: bool, top: int = 4) -> tuple[dict[str, float], dict[str, list]]:
    """Seconds per category (CATEGORIES, in order) of a profile that took ``wall_s``, and each
    category's ``top`` operators by self time: [(name, seconds), ...]."""
    from torch.autograd import DeviceType

    # Operators only: a kernel's time is already its launching operator's self device time.
    events = [e for e in prof.events() if e.device_type == DeviceType.CPU and not e.is_async]
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    by_op: dict[str, dict[str, float]] = {c: {} for c in CATEGORIES}
    for e, cat in categorise(events).items():
        s = (e.self_device_time_total if on_gpu else e.self_cpu_time_total) / 1e6
        seconds[cat] += s
        by_op[cat][e.name] = by_op[cat].get(e.name, 0.0) + s
    seconds["outside operators"] = max(wall_s - sum(seconds.values()), 0.0)
    ops = {c: sorted(((n, round(s, 4)) for n, s in d.items()), key=lambda x: -x[1])[:top] for c, d in by_op.items() if d}
    return seconds, ops


def table(rows: dict[str, dict[str, float]]) -> str:
    """A Markdown table: one column per run (its share of the wall time), one row per category."""
    names = list(rows)
    lines = ["| category | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for cat in CATEGORIES:
        cells = []
        for n in names:
            total = sum(rows[n].values())
            cells.append(f"{100 * rows[n][cat] / total:.1f}%")
        lines.append(f"| {cat} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
