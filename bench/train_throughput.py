"""Training throughput: target tokens/s, model-FLOPs utilisation, and the cost of Admin profiling.

    DS_ACCELERATOR=cpu python bench/train_throughput.py --presets debug-tiny --ds ds_configs/zero2.json
    python bench/train_throughput.py --presets base-6L-6L admin-18L-18L admin-60L-12L \
        --ds ds_configs/zero2_bf16.json --max-tokens 8192 --peak-tflops 989     # one H200

One process (one rank), on the embedded default data (or --data DIR). For each preset: build the
engine exactly as launch/train.py does, time the profiling stage, run --warmup updates, then time
--updates updates. Prints a table and, with --json, one JSON line per preset.

Profiling cost: ``profile_s`` is the whole stage as training pays it, cold (the process's first
forward pass), split into ``profile_batch_s`` (drawing the profiling batch: the first epoch's
token buckets, which the training iterator then reuses) and ``profile_pass_s`` (the forward pass
with one float64 all-reduce per sub-layer, omega written into every copy, the profile files);
``profile_warm_s`` repeats the pass after the timed updates, to separate first-call costs.
``profile_over_update`` = profile_s / one timed update.

FLOPs per update (forward x 3 for forward + backward), counted on the real, unpadded tokens:
    forward = 2 * (P_enc * S_tok + (P_dec + V * D) * T_tok)            matrix products with weights
            + 4 * D * (L_enc * sum S^2 + L_dec * sum (T^2 + T * S))     attention scores and values
where P_enc / P_dec are the encoder / decoder layer parameters, S_tok / T_tok the source / target
tokens, and the sums run over sentences. MFU = FLOPs per second / the device's peak.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def update_flops(cfg, batches) -> float:
    d, v = cfg.model_dim, cfg.vocab_size
    f = cfg.ffn_inner_dim
    p_enc = cfg.num_encoder_layers * (4 * d * d + 2 * d * f)
    p_dec = cfg.num_decoder_layers * (8 * d * d + 2 * d * f)
    total = 0.0
    for b in batches:
        s_len = b["src_tokens"].ne(cfg.pad_idx).sum(1).double()
        t_len = b["target"].ne(cfg.pad_idx).sum(1).double()
        fwd = 2 * (p_enc * s_len.sum() + (p_dec + v * d) * t_len.sum())
        fwd += 4 * d * (cfg.num_encoder_layers * (s_len ** 2).sum()
                        + cfg.num_decoder_layers * ((t_len ** 2).sum() + (t_len * s_len).sum()))
        total += 3 * float(fwd)
    return total


def bench_preset(args, preset: str) -> dict:
    import torch

    from admin_ds.train.loop import Training
    from admin_ds.train.run_config import load_run_config

    over = [f"--model.preset={preset}", f"--train.run_dir={args.run_dir}/{preset}", "--train.resume=false",
            f"--data.max_tokens={args.max_tokens}", "--train.final_eval=false"]
    if args.data:
        over.append(f"--data.path={args.data}")
    run = load_run_config(None, over)
    t = Training(run, args.ds)
    t.setup()
    device = t.runner.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    # The profiling stage, cold (the first forward pass of the process), in two parts: the
    # profiling batch (the first epoch's token buckets, shared with training) and the rest
    # (forward pass with its all-reduces, omega written into the engine, profile files).
    t0 = time.perf_counter()
    first = t.profiling_batch()
    batch_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    t.establish_profile()
    sync()
    profile_s = time.perf_counter() - t0
    for _ in range(args.warmup):
        t.train_update()
    sync()
    # FLOPs of exactly the batches the timed updates will draw (the iterator is deterministic).
    gas = t.ds["gradient_accumulation_steps"]
    probe = t.evaluator.iterator("train", shuffle=True, gas=gas)
    probe.load_state_dict(t.iterator.state_dict())
    batches = [probe.next_batch() for _ in range(args.updates * gas)]
    flops = update_flops(t.cfg, batches)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    tokens = 0
    for _ in range(args.updates):
        tokens += t.train_update()["ntokens"]
    sync()
    dt = time.perf_counter() - t0
    t0 = time.perf_counter()
    t.runner.profile(first)  # the forward pass and all-reduces alone, warm
    sync()
    profile_warm_s = time.perf_counter() - t0
    total_profile_s = batch_s + profile_s
    row = {"preset": preset, "ds_config": args.ds, "device": device.type, "max_tokens": args.max_tokens,
           "tokens_per_s": round(tokens / dt), "update_s": round(dt / args.updates, 4),
           "profile_s": round(total_profile_s, 3), "profile_batch_s": round(batch_s, 3),
           "profile_pass_s": round(profile_s, 3), "profile_warm_s": round(profile_warm_s, 3),
           "profile_over_update": round(total_profile_s / (dt / args.updates), 2),
           "tflops": round(flops / dt / 1e12, 3), "threads": torch.get_num_threads()}
    if args.peak_tflops:
        row["mfu"] = round(flops / dt / 1e12 / args.peak_tflops, 4)
    if device.type == "cuda":
        row["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    t.close()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["debug-tiny"])
    p.add_argument("--ds", default="ds_configs/zero2.json")
    p.add_argument("--data", default=None, help="binarized data dir (default: the embedded default corpus)")
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--updates", type=int, default=10)
    p.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU (H200 bf16: 989)")
    p.add_argument("--run-dir", default="runs/bench")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    os.environ.setdefault("MASTER_PORT", "29511")
    rows = [bench_preset(args, name) for name in args.presets]
    keys = list(rows[0])
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r.get(k, "")) for k in keys))
        if args.json:
            print(json.dumps(r))


if __name__ == "__main__":
    main()
