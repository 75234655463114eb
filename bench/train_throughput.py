"""Training throughput and model-FLOPs utilisation (MFU) against the machine's own measured peak.

    DS_ACCELERATOR=cpu python bench/train_throughput.py --presets base-6L-6L admin-18L-18L \\
        --ds ds_configs/zero2.json --max-tokens 4096 --breakdown            # CPU
    python bench/train_throughput.py --presets base-6L-6L big-6L-6L admin-60L-12L \\
        --ds ds_configs/zero2_bf16.json --max-tokens 16384 --json runs/bench.jsonl   # one GPU
    ... --engine.compile=true --optim.implementation=fused    # any run-config override: a feature on/off

One process (one rank), on the embedded default data (or --data DIR). With --vocab-size V the
embedded corpus's sentences keep their lengths but their tokens are drawn at random over a
V-word vocabulary: the shapes, and so the cost, of a run with a real joint vocabulary (WMT14:
32-44k; the generated corpus has 1,000 pieces), for throughput only (the loss means nothing).
For each preset: build the run exactly as launch/train.py does (admin_ds.train.loop.Training),
time the profiling stage, run --warmup updates, then time --updates updates. FLOPs come from admin_ds/model/flops.py
(checked against torch's FlopCounterMode by tests/test_flops.py): real tokens only, as MFU
counts them; the padded computation is reported beside them.

The peak is measured, not typed: in the same process, on the same device, dense matrix products
in the training dtype (a large square one, and one of the layers' own shape: tokens x D x F) are
timed; on a GPU the vendor's dense spec for that dtype is printed beside it. MFU is reported
against both; ``mfu_vs_square`` (= ``mfu_measured``) and ``mfu_vs_layer`` divide the achieved
rate by the square product's and by the layer-shaped product's. --breakdown adds a torch.profiler
table of where an update's time goes (bench/breakdown.py). Results: a table on stdout, --json FILE appends one JSON object per run,
--markdown FILE writes the table as Markdown.

Profiling cost: ``profile_s`` is the whole stage as training pays it, cold (the process's first
forward pass), split into ``profile_batch_s`` (drawing the profiling batch: the first epoch's
token buckets, which the training iterator then reuses) and ``profile_pass_s`` (the forward pass
with one float64 all-reduce per sub-layer, omega written into every copy, the profile files);
``profile_warm_s`` repeats the pass after the timed updates, to separate first-call costs.
``profile_over_update`` = profile_s / one timed update.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from breakdown import breakdown, labelled, table

# Dense (no sparsity) tensor-core TFLOP/s from NVIDIA's datasheets, by device-name fragment, most
# specific first: (bf16, fp16, fp32). fp32 is the plain (non-TF32) rate torch uses by default.
VENDOR_PEAK = (
    ("H200", (989.4, 989.4, 66.9)),
    ("H100 NVL", (835.5, 835.5, 60.0)),
    ("H100 PCIe", (756.5, 756.5, 51.2)),
    ("H100", (989.4, 989.4, 66.9)),  # SXM
    ("A100", (312.0, 312.0, 19.5)),
    ("L40S", (362.1, 362.1, 91.6)),
)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def significant(x: float, digits: int = 4) -> float:
    """``x`` to ``digits`` significant figures: a loaded or small CPU measures rates of 0.001
    TFLOP/s, which four decimals would round by several percent."""
    return float(f"{x:.{digits}g}")


def gemm_tflops(device: torch.device, dtype: torch.dtype, m: int, k: int, n: int, repeats: int) -> float:
    """Median rate of an (m x k) @ (k x n) product on random data (never zeros: they run faster),
    alternating between two input pairs, after two warm-up products."""
    pairs = [(torch.randn(m, k, device=device).to(dtype), torch.randn(k, n, device=device).to(dtype)) for _ in range(2)]
    for a, b in pairs:
        a @ b
    times = []
    for i in range(repeats):
        a, b = pairs[i % 2]
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            a @ b
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
    return 2 * m * k * n / statistics.median(times) / 1e12


def measured_peak(device: torch.device, precision: str, cfg, max_tokens: int, size: int = 0) -> dict:
    """The device's dense matrix-product rate in the training dtype: a large square product
    (the peak MFU is measured against; ``size`` x ``size``, default 8192 on a GPU, 4096 on a CPU)
    and the feed-forward layer's own shape."""
    dtype = DTYPES[precision]
    n, repeats = (size or 8192, 20) if device.type == "cuda" else (size or 4096, 3)
    out = {"peak_tflops": significant(gemm_tflops(device, dtype, n, n, n, repeats)),
           "layer_gemm_tflops": significant(gemm_tflops(device, dtype, max_tokens, cfg.model_dim, cfg.ffn_inner_dim,
                                                        repeats * 3))}
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        spec = next((peaks for frag, peaks in VENDOR_PEAK if frag in name), None)
        out["device_name"] = name
        out["vendor_tflops"] = None if spec is None else spec[list(DTYPES).index(precision)]
    else:
        out["device_name"] = platform.processor() or platform.machine()
        out["vendor_tflops"] = None
    return out


def bench_preset(args, preset: str, overrides: list[str]) -> dict:
    from admin_ds.model.flops import padding_fraction, update_flops
    from admin_ds.train import engine as eng
    from admin_ds.train.loop import Training
    from admin_ds.train.run_config import load_run_config

    over = [f"--model.preset={preset}", f"--train.run_dir={args.run_dir}/{preset}", "--train.resume=false",
            f"--data.max_tokens={args.max_tokens}", "--train.final_eval=false", f"--data.path={args.data}",
            *overrides]
    t = Training(load_run_config(None, over), args.ds)
    t.setup()
    device = t.runner.device
    # The profiling stage, cold (the first forward pass of the process), in two parts: the
    # profiling batch (the first epoch's token buckets, shared with training) and the rest
    # (forward pass with its all-reduces, omega written into the engine, profile files).
    admin = t.cfg.init == "admin"  # only Admin profiles; other presets have no profiling stage
    t0 = time.perf_counter()
    first = t.profiling_batch() if admin else None
    batch_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    t.establish_profile()
    synchronize(device)
    pass_s = time.perf_counter() - t0
    profile_s = batch_s + pass_s
    for _ in range(args.warmup):
        t.train_update()
    synchronize(device)
    # The batches the timed updates will draw (the iterator is deterministic): their FLOPs.
    gas = t.ds["gradient_accumulation_steps"]
    probe = t.evaluator.iterator("train", shuffle=True, gas=gas)
    probe.load_state_dict(t.iterator.state_dict())
    batches = [probe.next_batch() for _ in range(args.updates * gas)]
    flops, padded_flops = update_flops(t.cfg, batches), update_flops(t.cfg, batches, padded=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    tokens = 0
    for _ in range(args.updates):
        tokens += t.train_update()["ntokens"]
    synchronize(device)
    dt = time.perf_counter() - t0
    t0 = time.perf_counter()
    if admin:
        t.runner.profile(first)  # the forward pass and all-reduces alone, warm
    synchronize(device)
    profile_warm_s = time.perf_counter() - t0
    precision = eng.precision(t.ds)
    peak = measured_peak(device, precision, t.cfg, args.max_tokens, args.peak_size)
    achieved = flops / dt / 1e12
    row = {"preset": preset, "ds_config": args.ds, "precision": precision, "zero": eng.zero_stage(t.ds),
           "vocab_size": t.cfg.vocab_size,
           "overrides": overrides, "device": device.type, "device_name": peak.pop("device_name"),
           "threads": torch.get_num_threads(), "max_tokens": args.max_tokens, "updates": args.updates,
           "tokens_per_s": round(tokens / dt), "update_s": round(dt / args.updates, 4),
           "padding": round(padding_fraction(batches, t.cfg.pad_idx), 4),
           "tflops": significant(achieved), "padded_tflops": significant(padded_flops / dt / 1e12), **peak,
           "mfu_measured": round(achieved / peak["peak_tflops"], 4),
           "mfu_vs_square": round(achieved / peak["peak_tflops"], 4),
           "mfu_vs_layer": round(achieved / peak["layer_gemm_tflops"], 4),
           "mfu_vendor": None if peak["vendor_tflops"] is None else round(achieved / peak["vendor_tflops"], 4),
           **({"profile_s": round(profile_s, 3), "profile_batch_s": round(batch_s, 3),
              "profile_pass_s": round(pass_s, 3), "profile_warm_s": round(profile_warm_s, 3),
              "profile_over_update": round(profile_s / (dt / args.updates), 2)} if admin else
           {"profile_s": None, "profile_over_update": None}),
           "date": datetime.date.today().isoformat()}
    if device.type == "cuda":
        row["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    if args.breakdown:
        row["breakdown_s"], row["top_operators"] = profile_updates(t, args.breakdown_updates)
    t.close()
    return row


def parse_with_overrides(p: argparse.ArgumentParser) -> tuple[argparse.Namespace, list[str]]:
    """The benchmark's own arguments (with --json and --markdown added), and the run-config
    overrides (--section.key=value) that every measured run takes."""
    p.add_argument("--json", default=None, help="append one JSON object per run to this file")
    p.add_argument("--markdown", default=None, help="write the results table to this file")
    args, overrides = p.parse_known_args()
    bad = [o for o in overrides if not (o.startswith("--") and "=" in o and "." in o.split("=")[0])]
    if bad:
        p.error(f"unrecognised arguments: {' '.join(bad)} (run-config overrides are --section.key=value)")
    return args, overrides


def prepare_data(args, overrides: list[str]) -> str:
    """The data directory every preset reads: --data, or the embedded default corpus prepared once
    (with --vocab-size, its sentence lengths with random tokens over that vocabulary)."""
    from admin_ds.data.binarize import prepare_default_data
    from admin_ds.train.run_config import load_run_config

    if args.data:
        return args.data
    d = load_run_config(None, overrides).data
    out = prepare_default_data(Path(args.run_dir) / "data", n_pairs=d.default_pairs, vocab_size=d.default_vocab_size,
                               seed=1, log=print)
    if not args.vocab_size:
        return str(out)
    return str(random_tokens(out, Path(args.run_dir) / f"data_v{args.vocab_size}", args.vocab_size))


def random_tokens(source: Path, out: Path, vocab_size: int) -> Path:
    """A data directory with ``source``'s splits, sentence for sentence of the same lengths, whose
    tokens are drawn uniformly over the ordinary ids of a ``vocab_size`` vocabulary."""
    import numpy as np

    from admin_ds.data.binarize import load_manifest, write_manifest
    from admin_ds.data.indexed import IndexedDataset, IndexedDatasetWriter

    manifest = load_manifest(source)
    if (out / "manifest.json").is_file() and load_manifest(out)["vocab_size"] == vocab_size:
        return out
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    listed = []
    for split in manifest["splits"]:
        for lang in (manifest["src_lang"], manifest["tgt_lang"]):
            prefix = f"{split}.{lang}"
            with IndexedDatasetWriter(out / prefix, vocab_size) as w:
                for n in IndexedDataset(source / prefix).sizes:
                    w.add(rng.integers(4, vocab_size, int(n)))  # 0-3: bos, pad, eos, unk
            listed += [f"{prefix}.bin", f"{prefix}.idx"]
    keep = ("src_lang", "tgt_lang", "splits")  # no subword model: these ids decode to nothing
    write_manifest(out, {**{k: manifest[k] for k in keep},
                         "vocab_size": vocab_size, "files": listed,
                         "command": f"bench/train_throughput.py --vocab-size {vocab_size} (random tokens)"})
    return out


def profile_updates(t, updates: int) -> tuple[dict, dict]:
    """Seconds per category (bench/breakdown.py) over ``updates`` updates under torch.profiler,
    and each category's costliest operators."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = t.runner.device.type == "cuda"
    engine = t.runner.engine
    t.iterator.next_batch = labelled(t.iterator.next_batch, "data")
    engine.step = labelled(engine.step, "engine.step")
    engine.backward = labelled(engine.backward, "engine.backward")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(updates):
            t.train_update()
        synchronize(t.runner.device)
        wall = time.perf_counter() - t0
    seconds, ops = breakdown(prof, wall, on_gpu)
    return {k: round(v, 4) for k, v in seconds.items()}, ops


COLUMNS = ("preset", "precision", "zero", "overrides", "tokens_per_s", "update_s", "padding", "tflops", "peak_tflops",
           "mfu_vs_square", "layer_gemm_tflops", "mfu_vs_layer", "vendor_tflops", "mfu_vendor", "peak_mem_gib", "profile_over_update")


def markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    cell = lambda v: "" if v is None else " ".join(v) if isinstance(v, list) else str(v)
    lines += ["| " + " | ".join(cell(r.get(c)) for c in COLUMNS) + " |" for r in rows]
    breakdowns = {" ".join([r["preset"], r["precision"], f"ZeRO-{r['zero']}", *r["overrides"]]): r["breakdown_s"]
                  for r in rows if "breakdown_s" in r}
    if breakdowns:
        lines += ["", "Where an update's time goes (share of the profiled wall time):", "", table(breakdowns)]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["debug-tiny"])
    p.add_argument("--ds", default="ds_configs/zero2.json")
    p.add_argument("--data", default=None, help="binarized data dir (default: the embedded default corpus)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="random tokens over this vocabulary, the embedded corpus's sentence lengths")
    p.add_argument("--peak-size", type=int, default=0, help="square matrix product for the peak (0: 8192 GPU, 4096 CPU)")
    p.add_argument("--max-tokens", type=int, default=4096, help="padded tokens per micro-batch")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--updates", type=int, default=10)
    p.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    p.add_argument("--breakdown", action="store_true", help="also profile updates with torch.profiler")
    p.add_argument("--breakdown-updates", type=int, default=2)
    p.add_argument("--run-dir", default="runs/bench")
    args, overrides = parse_with_overrides(p)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("MASTER_PORT", "29511")
    args.data = prepare_data(args, overrides)
    rows = []
    for name in args.presets:
        rows.append(bench_preset(args, name, overrides))
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(rows[-1]) + "\n")
    text = markdown(rows)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")


if __name__ == "__main__":
    from admin_ds.errors import UserError

    try:
        main()
    except UserError as e:  # a bad preset, override or config: one line, as launch/train.py says it
        sys.exit(f"error: {e}")
