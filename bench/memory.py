"""Host memory per rank under ZeRO stages 0-3 (fp32 on a CPU), next to DeepSpeed's own estimate.

    DS_ACCELERATOR=cpu python bench/memory.py --vocab-size 32768 --max-tokens 2048        # admin-60L-12L
    DS_ACCELERATOR=cpu python bench/memory.py --preset admin-18L-18L --stages 2 3 --ranks 2 \\
        --markdown runs/memory.md --json runs/memory.jsonl
    ... --ds-dir DIR          # other zero{0,1,2,3}.json files (a stage without a file runs without ZeRO)

For each ZeRO stage (ds_configs/zero<stage>.json; stage 0 is zero1.json with the stage set to 0)
and each rank count, real ranks are started (torch.multiprocessing spawn, gloo, env://: what
``deepspeed --num_gpus N`` starts) and each builds the run exactly as launch/train.py does
(admin_ds.train.loop.Training, as bench/train_throughput.py does), profiles, then runs --updates
updates. Each rank samples its resident memory (VmRSS in /proc/self/status) and its peak so far
(VmHWM, the same as getrusage's ru_maxrss) at each phase:

    start       interpreter, torch and DeepSpeed imported, process group joined
    model       the model built (before deepspeed.initialize)
    engine      deepspeed.initialize returned (ZeRO's partitions and optimizer state built)
    profile     Admin profiling done, omega written
    update1     the first update (gradients and the optimizer's moments now exist)
    updateN     after --updates updates

The estimate is of the model states alone, computed for fp32 by hand (DeepSpeed's estimators
assume 16-bit parameters): bytes per parameter per rank, with N data-parallel ranks,

    ZeRO-0   4 parameters + 4 gradients + 8 Adam moments                  = 16
    ZeRO-1   4 parameters + 4 gradients + (4 fp32 master + 8 moments) / N
    ZeRO-2   4 parameters + (4 gradients + 4 master + 8 moments) / N
    ZeRO-3   (4 parameters + 4 gradients + 4 master + 8 moments) / N      (+ the largest layer, gathered)

DeepSpeed's own estimates (estimate_zero2/3_model_states_mem_needs, no offload; the "GPU"
column is the device's memory, the host here) are printed beside them. Activations, which no
ZeRO stage shards, are measured in the ZeRO-0 one-rank run (so list stage 0 and 1 rank first):
the bytes a training-mode forward pass of the plain module on one --max-tokens micro-batch saves
for the backward pass (autograd's saved-tensor hooks).

Keep a shared machine in mind: 16 bytes per parameter, per rank, before activations (ZeRO-0 at
2 ranks of a 250M-parameter model: ~8 GB).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import tempfile
from pathlib import Path

PHASES = ("start", "model", "engine", "profile", "update1", "updateN")


def proc_status() -> dict:
    """VmRSS and VmHWM of this process, in MB (10^6 bytes)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = round(int(value.split()[0]) * 1024 / 1e6)
    return out


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, ds_path: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    import resource

    import torch

    torch.set_num_threads(1)
    from admin_ds.train import engine as eng
    from admin_ds.train.loop import Training
    from admin_ds.train.run_config import load_run_config

    phases = {}
    build = eng.initialize

    def initialize(model, run, ds):  # the model is built: sample, then build the engine as usual
        phases["model"] = proc_status()
        return build(model, run, ds)

    eng.initialize = initialize
    over = [f"--model.preset={args.preset}", f"--train.run_dir={args.run_dir}/run_{os.getpid()}",
            "--train.resume=false", f"--data.max_tokens={args.max_tokens}", "--train.final_eval=false",
            f"--data.path={args.data}", f"--engine.distributed_port={port}", *args.overrides]
    phases["start"] = proc_status()
    t = Training(load_run_config(None, over), ds_path)
    t.setup()
    phases["engine"] = proc_status()
    t.establish_profile()
    phases["profile"] = proc_status()
    t.train_update()
    phases["update1"] = proc_status()
    for _ in range(args.updates - 1):
        t.train_update()
    phases["updateN"] = proc_status()
    acts = activations(t) if eng.zero_stage(t.ds) == 0 and world == 1 else None
    maxrss_mb = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6)
    from admin_ds.model.transformer import count_parameters

    params = count_parameters(t.runner.model) if eng.zero_stage(t.ds) < 3 else \
        sum(p.ds_numel for p in t.runner.model.parameters())
    largest = max(max(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in m.parameters(recurse=False))
                  for m in t.runner.model.modules() if any(True for _ in m.parameters(recurse=False)))
    zero = t.ds.get("zero_optimization", {})
    Path(out, f"rank{rank}.json").write_text(json.dumps(
        {"phases": phases, "maxrss_mb": maxrss_mb, "params": params, "largest_param": largest, "activations_mb": acts,
         "zero_config": zero}))
    t.close()


def activations(t) -> int:
    """Bytes, in MB, of the tensors one training-mode forward pass on a --max-tokens micro-batch
    saves for the backward pass (parameters excluded, each storage counted once): the part of a
    rank's memory no ZeRO stage shards. Counted through autograd's saved-tensor hooks, not read
    off the resident size, which the allocator's reuse of freed memory hides."""
    import torch

    model = t.runner.model
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(x):
        storage = x.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return x

    src, tgt_in, _ = t.runner._on_device(t.profiling_batch())
    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        logits = model(src, tgt_in, skip_padding=t.runner.skip_padding)
    del logits
    return round(sum(saved.values()) / 1e6)


def model_states_mb(params: int, largest: int, stage: int, world: int) -> dict:
    """fp32 model-states bytes per rank by hand, and DeepSpeed's (16-bit) estimators', in MB."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    by_hand = {0: 16 * params, 1: 8 * params + 12 * params / world, 2: 4 * params + 12 * params / world,
               3: 20 * params / world + 4 * largest}[stage]
    if stage == 3:
        _, ds_bytes, _ = estimate_zero3_model_states_mem_needs(params, largest, num_gpus_per_node=world,
                                                               cpu_offload=False, cpu_offload_params=False)
    else:
        _, ds_bytes = estimate_zero2_model_states_mem_needs(params, num_gpus_per_node=world, cpu_offload=False)
    return {"states_fp32_mb": round(by_hand / 1e6), "deepspeed_estimate_mb": round(ds_bytes / 1e6)}


def stage_config(args, stage: int, tmp: Path) -> str:
    """The DeepSpeed JSON of ``stage``: ds_configs/zero<stage>.json, or zero1.json with the stage
    set to 0 (there is no zero0.json: ZeRO-0 is DeepSpeed without ZeRO)."""
    path = Path(args.ds_dir, f"zero{stage}.json")
    if path.is_file():
        return str(path)
    ds = json.loads(Path(args.ds_dir, "zero1.json").read_text())
    ds["zero_optimization"] = {"stage": stage}
    out = tmp / f"zero{stage}.json"
    out.write_text(json.dumps(ds))
    return str(out)


def run_ranks(args, stage: int, world: int, tmp: Path) -> list[dict]:
    import torch.multiprocessing as mp

    out = tmp / f"z{stage}_w{world}"
    out.mkdir(parents=True, exist_ok=True)
    port = args.port + 10 * stage + world
    mp.start_processes(rank_main, args=(world, port, args, stage_config(args, stage, tmp), str(out)), nprocs=world,
                       join=True, start_method="spawn")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def cpu_name() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


COLUMNS = ("preset", "params_M", "zero", "ranks", "peak_rss_mb", *(f"rss_{p}_mb" for p in PHASES), "states_fp32_mb",
           "deepspeed_estimate_mb", "activations_mb", "max_tokens")


def markdown(rows: list[dict], head: dict) -> str:
    lines = [f"{head['date']}, {head['cpu']}, {head['command']}", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join("" if r.get(c) is None else str(r.get(c)) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="admin-60L-12L")
    p.add_argument("--stages", nargs="+", type=int, default=[0, 1, 2, 3], choices=[0, 1, 2, 3])
    p.add_argument("--ranks", nargs="+", type=int, default=[1, 2])
    p.add_argument("--ds-dir", default="ds_configs", help="where zero<stage>.json are read")
    p.add_argument("--data", default=None, help="binarized data dir (default: the embedded default corpus)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="random tokens over this vocabulary, the embedded corpus's sentence lengths")
    p.add_argument("--max-tokens", type=int, default=2048, help="padded tokens per micro-batch")
    p.add_argument("--updates", type=int, default=3)
    p.add_argument("--port", type=int, default=29611)
    p.add_argument("--run-dir", default="runs/bench_memory")
    from train_throughput import parse_with_overrides, prepare_data  # bench/ is the script's directory

    args, overrides = parse_with_overrides(p)
    if args.updates < 1:
        p.error(f"--updates {args.updates}: at least one update")
    args.overrides = overrides

    args.data = prepare_data(args, overrides)
    head = {"date": datetime.date.today().isoformat(), "cpu": cpu_name(),
            "command": "DS_ACCELERATOR=cpu python bench/memory.py " + " ".join(os.sys.argv[1:])}
    rows, acts = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for stage in args.stages:
            for world in args.ranks:
                ranks = run_ranks(args, stage, world, Path(tmp))
                worst = max(ranks, key=lambda r: r["maxrss_mb"])
                acts = ranks[0]["activations_mb"] if ranks[0]["activations_mb"] is not None else acts
                row = {"preset": args.preset, "params_M": round(worst["params"] / 1e6, 1), "zero": stage,
                       "ranks": world, "peak_rss_mb": worst["maxrss_mb"],
                       **{f"rss_{ph}_mb": worst["phases"][ph]["VmRSS"] for ph in PHASES},
                       **model_states_mb(worst["params"], worst["largest_param"], stage, world),
                       "activations_mb": acts, "max_tokens": args.max_tokens, "zero_config": worst["zero_config"],
                       "per_rank_peak_mb": [r["maxrss_mb"] for r in ranks], **head}
                print(json.dumps(row), flush=True)
                rows.append(row)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(row) + "\n")
    text = markdown(rows, head)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")


if __name__ == "__main__":
    main()
