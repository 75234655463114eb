"""Pipeline vs data parallelism on the same model, data and ranks: target tokens/s as a ratio.

    DS_ACCELERATOR=cpu python bench/pipeline_vs_dp.py --ranks 2 --updates 20 \
        --model "--model.num_encoder_layers=6 --model.num_decoder_layers=6 --model.model_dim=128"

Both runs use `deepspeed --num_gpus R launch/train.py` with the same micro-batch token budget and
the same tokens per update: data-parallel (ZeRO-1, R ranks x A micro-batches) against an R-stage
pipeline (ZeRO-1, 1 data-parallel rank x R*A micro-batches). Tokens/s is averaged over the logged
updates after the first (which includes start-up). The ideal pipeline bubble with m micro-batches
and p stages is (p-1)/(m+p-1); on a GPU node the measured bubble is 1 - (pipeline tokens/s) /
(data-parallel tokens/s) when both are compute-bound with the same per-rank work. On CPU ranks that
share cores the stages' idle time is filled by the other stage, so the CPU ratio measures the
overheads (p2p sends, schedule), not the bubble.
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def launch(run_dir: Path, ds: dict, args, extra: list[str]) -> float:
    ds_path = run_dir.parent / f"{run_dir.name}.json"
    ds_path.write_text(json.dumps(ds))
    cmd = ["deepspeed", "--num_gpus", str(args.ranks), "--master_port", str(args.port),
           str(REPO / "launch/train.py"), "--deepspeed_config", str(ds_path), f"--train.run_dir={run_dir}",
           f"--train.max_updates={args.updates}", "--train.log_interval=1", "--train.final_eval=false",
           f"--data.max_tokens={args.max_tokens}", f"--data.default_pairs={args.pairs}", *extra]
    if args.data:
        cmd.append(f"--data.path={args.data}")
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in rows if r["kind"] == "train"][1:]
    return sum(rates) / len(rates)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--accumulation", type=int, default=2, help="micro-batches per rank per update (data-parallel)")
    p.add_argument("--updates", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--pairs", type=int, default=6000)
    p.add_argument("--data", default=None)
    p.add_argument("--model", default="--model.num_encoder_layers=6 --model.num_decoder_layers=6 --model.model_dim=128")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--port", type=int, default=29561)
    args = p.parse_args()
    extra = shlex.split(args.model)
    prec = {"bf16": {"enabled": True}} if args.precision == "bf16" else {}
    r, a = args.ranks, args.accumulation
    dp = {"zero_optimization": {"stage": 1}, "gradient_accumulation_steps": a, **({"bf16": prec["bf16"]} if prec else {})}
    pp = {"zero_optimization": {"stage": 1}, "gradient_accumulation_steps": r * a, "pipeline": {"stages": r},
          **({"bf16": prec["bf16"], "data_types": {"grad_accum_dtype": "fp32"}} if prec else {})}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        t0 = time.time()
        dp_rate = launch(tmp / "dp", dp, args, extra)
        pp_rate = launch(tmp / "pp", pp, args, extra)
    m = r * a
    print(f"# {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, {args.precision}, {r} ranks, model: {args.model}")
    print(f"data-parallel ({r} ranks x {a} micro-batches): {dp_rate:,.0f} target tokens/s")
    print(f"pipeline ({r} stages x {m} micro-batches):   {pp_rate:,.0f} target tokens/s")
    print(f"pipeline / data-parallel: {pp_rate / dp_rate:.2f}; ideal bubble (p-1)/(m+p-1) = {(r - 1) / (m + r - 1):.2f}; "
          f"measured 1 - ratio = {1 - pp_rate / dp_rate:.2f}   ({time.time() - t0:.0f} s)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
