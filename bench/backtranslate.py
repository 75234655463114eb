"""Back-translation throughput, 1 rank vs N ranks side by side (data_prep/backtranslate.sh).

    python bench/backtranslate.py --model runs/de-en --bitext data/wmt14_en_de \
        --mono ../shared/data/mono/newstest2012.de --lines 3000 --ranks 1 2
    python bench/backtranslate.py ... --int8 --method sampling

Each run is the real command: one rank through the shell entry point, several through torchrun
(``torch.distributed.run``), every rank pinned to its own share of the cores by the command itself
(admin_ds/distributed.py ``pin_to_cores``). The figures come from the output manifest's
``throughput`` record: sentences/s over the translate phase, the end-to-end rate, and the share of
the wall time spent decoding. The goal: 2 ranks >= 1.8x one rank on the same cores.
--one-core-baseline adds, as the first row (the one "vs the first row" divides by), one rank
restricted to one core: the per-rank scaling, beside the single rank that uses every core through
its intra-op threads.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
from decode import hardware  # noqa: E402  (the script's own directory, bench/, comes first on sys.path)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, type=Path, help="reverse model: run dir or model file")
    p.add_argument("--bitext", required=True, type=Path, help="prepared data directory of the forward direction")
    p.add_argument("--mono", type=Path, default=REPO.parent / "shared/data/mono/newstest2012.de")
    p.add_argument("--lines", type=int, default=2000, help="the first N mono lines")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--method", default="beam", choices=("beam", "sampling", "topk", "noised-beam"))
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--int8", action="store_true")
    p.add_argument("--one-core-baseline", action="store_true",
                   help="also 1 rank on one core (the first of this process's cores): the per-rank scaling")
    return p.parse_args(argv)


def run(args, ranks: int, mono: Path, out: Path, cores=None) -> dict:
    """One run of the real command; ``cores``: the CPU cores it may use (default: all of ours)."""
    # --any-direction: the throughput is the same whichever direction the model translates, so the
    # model at hand serves (BENCHMARKS.md measured with the en-de model on an en-de bitext)
    opts = ["--model", args.model, "--mono", mono, "--bitext", args.bitext, "--out", out, "--method", args.method,
            "--beam", args.beam, "--max-tokens", args.max_tokens, "--shards", 4 * ranks, "--any-direction",
            *(["--int8"] if args.int8 else [])]
    if ranks == 1:
        cmd = ["bash", str(REPO / "data_prep/backtranslate.sh")]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port", "29531",
               "-m", "data_prep.backtranslate"]
    env = dict(os.environ, PYTHONPATH=str(REPO), DS_ACCELERATOR="cpu")
    env.pop("OMP_NUM_THREADS", None)  # each rank sets its threads from its cores
    r = subprocess.run([*cmd, *map(str, opts)], cwd=REPO, env=env, capture_output=True, text=True,
                       preexec_fn=None if cores is None else (lambda: os.sched_setaffinity(0, cores)))
    if r.returncode != 0:
        raise SystemExit(f"{ranks} rank(s) failed:\n{r.stderr[-3000:]}")
    print(r.stderr.strip().splitlines()[-1], flush=True)
    t = json.loads((out / "manifest.json").read_text())["throughput"]
    t["translations"] = [line for shard in sorted((out / "shards").glob("*.src"))
                         for line in shard.read_text(encoding="utf-8").splitlines()]
    if len(t["translations"]) != t["sentences_translated"]:
        raise SystemExit(f"{out}/shards: {len(t['translations'])} translations for {t['sentences_translated']} sentences")
    return t


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.mono.is_file():
        print(f"skipped: {args.mono} not found")
        return 0
    rows, base = [], None
    with tempfile.TemporaryDirectory(prefix="bench_bt_") as tmp:
        mono = Path(tmp) / "mono.txt"
        with open(args.mono, encoding="utf-8") as f:
            mono.write_text("".join(line for _, line in zip(range(args.lines), f)), encoding="utf-8")
        runs = [(1, [min(os.sched_getaffinity(0))])] if args.one_core_baseline else []
        runs += [(r, None) for r in args.ranks]
        for ranks, cores in runs:
            t = run(args, ranks, mono, Path(tmp) / f"out{ranks}{'_1core' if cores else ''}", cores)
            base = base or t["sentences_per_s"]
            rows.append(f"| {ranks} | {t['threads_per_rank']} | {t['cores_per_rank']} | {t['sentences_translated']} "
                        f"| {t['sentences_per_s']:.1f} | {t['sentences_per_s'] / base:.2f}x "
                        f"| {t['sentences_per_s_end_to_end']:.1f} | {t['share']['decoding']:.0%} |")
    print("\n".join([
        f"# Back-translation throughput ({datetime.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')})",
        "",
        f"- command: `python bench/backtranslate.py {' '.join(sys.argv[1:])}`",
        f"- hardware: {hardware()}; load average {os.getloadavg()[0]:.1f} at the end",
        f"- {args.lines} lines of {args.mono.name}, {args.method} (beam {args.beam}), "
        f"{'int8' if args.int8 else 'fp32'}, --max-tokens {args.max_tokens}, 4 shards per rank",
        "",
        "| ranks | threads per rank | cores per rank | sentences | sentences/s | vs the first row "
        "| end to end /s | decoding share of wall time |",
        "|---:|---:|---|---:|---:|---:|---:|---:|",
        *rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
