"""Data preparation: throughput against a plain SentencePiece loop, scaling with workers, peak
memory against corpus size, and a projection to WMT14 En-Fr on a larger machine.

    python bench/data_prep.py                          # workers 1 and nproc, corpus x1 and x8
    python bench/data_prep.py --workers 1 2 --scale 8 --repeats 3 --write /tmp/data_prep.md

The corpus (x1, ~45k En-De pairs) is real text from ../shared/data: newstest2013+2014, Multi30k
train and the OpenNMT WMT sample; x8 repeats it with a copy number appended to both sides (so that
the duplicate filter keeps every copy). Every configuration runs the whole CLI
(data_prep/prepare_wmt14.sh) in a fresh output folder, under a small launcher process whose
``getrusage(RUSAGE_CHILDREN).ru_maxrss`` is the peak resident memory of the largest process of the
run (the main process or a worker).

Throughput is lines/s (both sides) of the streaming steps, clean + encode + binarize, from the step
records' timings; the baseline is one process encoding the same raw lines with
``SentencePieceProcessor.encode`` one line at a time, nothing else. SentencePiece training is
excluded from both (its sample is capped by --spm-sample-lines, set equal for x1 and x8 so that it
costs the same memory in both). Each configuration runs --repeats times, the worker counts
interleaved; a row is the median run, and the ratios to one worker are given for every repeat.

Projection. The step records hold each phase's wall time and the summed time of the worker tasks
(data_prep/shards.py), wall and CPU. From the largest one-worker run: per pair, the work that
shards (the tasks' CPU seconds: robust to other jobs on the machine), the main process's serial work (indexing the input, concatenating the shards, merging
the binarized shards) and the sha256 checksums of the outputs (timed here on the run's files);
then T(w) = N * (serial + checksums + work / w) for N = --project-pairs (WMT14 En-Fr: 36M pairs
after cleaning), assuming cores as fast as this one, no disk bottleneck, and pairs of the same
average length as this corpus (the table gives the bytes per pair to rescale).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
WRAPPER = ROOT / "data_prep" / "prepare_wmt14.sh"

LAUNCHER = ("import json, resource, subprocess, sys, time\n"
            "t = time.perf_counter()\n"
            "rc = subprocess.call(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
            "print(json.dumps({'rc': rc, 'wall_s': time.perf_counter() - t,\n"
            "                  'maxrss_mib': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))\n")


def base_pairs() -> list[tuple[str, str]]:
    def lines(path: Path) -> list[str]:
        if path.suffix == ".gz":
            import gzip
            with gzip.open(path, "rt", encoding="utf-8") as f:
                return f.read().splitlines()
        return path.read_text(encoding="utf-8").splitlines()

    pairs = []
    for en, de in ((DATA / "wmt14/en-de/newstest2013.en", DATA / "wmt14/en-de/newstest2013.de"),
                   (DATA / "wmt14/en-de/newstest2014.en", DATA / "wmt14/en-de/newstest2014.de"),
                   (DATA / "multi30k/train.en.gz", DATA / "multi30k/train.de.gz"),
                   (DATA / "wmt-ende-10k-tok/src-train.txt", DATA / "wmt-ende-10k-tok/tgt-train.txt")):
        pairs += zip(lines(en), lines(de))
    return pairs


def write_corpus(raw: Path, pairs: list[tuple[str, str]], copies: int) -> int:
    raw.mkdir(parents=True, exist_ok=True)
    with open(raw / "train.en", "w", encoding="utf-8") as fe, open(raw / "train.de", "w", encoding="utf-8") as fd:
        for k in range(copies):
            tag = f" ({k})" if k else ""
            for en, de in pairs:
                fe.write(en + tag + "\n")
                fd.write(de + tag + "\n")
    for name in ("newstest2013", "newstest2014"):
        for lang in ("en", "de"):
            (raw / f"{name}.{lang}").write_bytes((DATA / "wmt14/en-de" / f"{name}.{lang}").read_bytes())
    return copies * len(pairs)


def run_prepare(raw: Path, out: Path, workers: int, vocab: int, sample_lines: int) -> dict:
    cmd = ["bash", str(WRAPPER), "en-de", str(out), "--raw-dir", str(raw), "--vocab-size", str(vocab),
           "--workers", str(workers), "--spm-sample-lines", str(sample_lines), "--quiet"]
    res = json.loads(subprocess.run([sys.executable, "-c", LAUNCHER, *cmd], capture_output=True, text=True,
                                    check=True).stdout)
    if res["rc"]:
        raise SystemExit(f"prepare failed ({res['rc']}): {' '.join(cmd)}")
    m = json.loads((out / "manifest.json").read_text())
    clean, train = (json.loads((out / "work" / f"{step}.done.json").read_text())["stats"] for step in ("clean", "train"))
    res.update(pairs=m["filters"]["train"]["read"], clean_s=m["seconds"]["clean"], train_s=m["seconds"]["train"],
               subword_s=m["seconds"]["subword"], phases={**clean["phase_seconds"], **train["phase_seconds"]},
               worker_s={**clean["worker_seconds"], **train["worker_seconds"]},
               worker_cpu_s={**clean["worker_cpu_seconds"], **train["worker_cpu_seconds"]}, shards=len(clean["shards"]),
               input_bytes=sum((raw / f"train.{lang}").stat().st_size for lang in ("en", "de")))
    res["lines_per_s"] = 2 * res["pairs"] / (res["clean_s"] + res["train_s"])
    res["checksum_s"] = checksum_seconds(out)
    return res


def checksum_seconds(out: Path) -> float:
    """The sha256 work of a run on its large files: the cleaned text once (its step record), the
    binarized training split twice (its step record and the manifest)."""
    from admin_ds.files import sha256_file

    t = time.perf_counter()
    for lang in ("en", "de"):
        sha256_file(out / "work" / f"train.clean.{lang}")
        for _ in range(2):
            for ext in ("bin", "idx"):
                sha256_file(out / f"train.{lang}.{ext}")
    return time.perf_counter() - t


def baseline_lines_per_s(raw: Path, spm_model: Path) -> float:
    """One process, one line at a time: read, SentencePiece-encode, discard."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(spm_model))
    n, t = 0, time.perf_counter()
    for lang in ("en", "de"):
        with open(raw / f"train.{lang}", encoding="utf-8") as f:
            for line in f:
                sp.encode(line.rstrip("\n"), out_type=int)
                n += 1
    return n / (time.perf_counter() - t)


def hardware() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor() or "?")
    mem = next((line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal")), "0")
    return f"{os.cpu_count()} CPUs (nproc {len(os.sched_getaffinity(0))}), {model}, {int(mem) / 2**20:.0f} GiB RAM"


PHASES = ("index", "clean", "duplicates", "drop", "concatenate", "encode", "merge")
WORKER = ("clean", "duplicates", "drop", "encode")


def projection(rows: list[dict], args) -> list[str]:
    """T(w) for --project-pairs pairs, from the per-pair costs of the largest one-worker run."""
    r = max((r for r in rows if r["workers"] == min(args.workers)), key=lambda r: r["pairs"])
    n = args.project_pairs
    work = sum(r["worker_cpu_s"].values()) / r["pairs"]
    serial = sum(r["phases"][k] for k in ("index", "concatenate", "merge")) / r["pairs"]
    checks = r["checksum_s"] / r["pairs"]
    shard_s = work * (r["pairs"] / r["shards"])
    out = [f"Projection to {n / 1e6:.0f}M pairs (WMT14 En-Fr after cleaning), from the x{r['scale']} run with "
           f"{r['workers']} worker: per pair {work * 1e6:.1f} us of sharded work ({shard_s:.2f} s per shard of "
           f"{r['pairs'] // r['shards']} pairs), {serial * 1e6:.2f} us serial in the main process (index, "
           f"concatenate, merge), {checks * 1e6:.2f} us of sha256 checksums (serial); "
           f"{r['input_bytes'] / r['pairs']:.0f} input bytes per pair. SentencePiece training (a fixed "
           "sample) is not included.", "",
           "| workers | projected clean+encode+binarize | speed-up vs 1 worker |", "|---:|---:|---:|"]
    t1 = n * (serial + checks + work)
    for w in args.project_workers:
        t = n * (serial + checks + work / w)
        out.append(f"| {w} | {t / 60:.1f} min | {t1 / t:.1f}x |")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, nargs="+", default=sorted({1, len(os.sched_getaffinity(0))}))
    p.add_argument("--scale", type=int, default=8, help="the large corpus is this many copies of the base")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--project-pairs", type=int, default=36_000_000, help="corpus size of the projection")
    p.add_argument("--project-workers", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--repeats", type=int, default=3,
                   help="runs of each configuration (interleaved); the table shows the median run")
    p.add_argument("--write", type=Path, help="write the results as markdown to this file")
    args = p.parse_args()
    if not DATA.is_dir():
        raise SystemExit(f"needs the shared test data at {DATA}")

    pairs = base_pairs()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_data_prep_") as tmp:
        tmp = Path(tmp)
        raws = {1: tmp / "raw_x1", args.scale: tmp / f"raw_x{args.scale}"}
        sizes = {scale: write_corpus(raw, pairs, scale) for scale, raw in raws.items()}
        sample = 2 * sizes[1]  # the same SentencePiece sample at every scale
        runs: dict[tuple[int, int], list[dict]] = {}
        for scale, raw in raws.items():
            for repeat in range(args.repeats):  # interleaved, so that a slow spell hits every worker count
                for w in args.workers:
                    out = tmp / f"out_x{scale}_w{w}"
                    shutil.rmtree(out, ignore_errors=True)
                    res = dict(scale=scale, workers=w, repeat=repeat,
                               **run_prepare(raw, out, w, args.vocab_size, sample))
                    runs.setdefault((scale, w), []).append(res)
                    print(json.dumps(res), flush=True)
        for (scale, w), group in runs.items():  # the median run by throughput; the largest peak memory
            row = sorted(group, key=lambda r: r["lines_per_s"])[len(group) // 2]
            rows.append(dict(row, maxrss_mib=max(r["maxrss_mib"] for r in group),
                             each_lines_per_s=[r["lines_per_s"] for r in group]))
        big = raws[args.scale]
        base = baseline_lines_per_s(big, tmp / f"out_x{args.scale}_w{args.workers[0]}" / "spm.model")
        print(json.dumps({"baseline_lines_per_s": base}), flush=True)

    lines = ["# Data preparation benchmark\n",
             f"Command: `python bench/data_prep.py {' '.join(sys.argv[1:])}`  ",
             f"Date: {time.strftime('%Y-%m-%d %H:%M %Z')}  ",
             f"Hardware: {hardware()}  ",
             f"Corpus: x1 = {sizes[1]} En-De pairs of real text (newstest2013/2014, Multi30k train, OpenNMT "
             f"WMT sample), x{args.scale} = {sizes[args.scale]} pairs; vocabulary {args.vocab_size} (BPE); "
             f"SentencePiece sample {sample} lines at both scales.\n",
             f"Baseline, one process encoding the x{args.scale} raw lines one at a time with SentencePiece: "
             f"**{base:,.0f} lines/s**.\n",
             "| corpus | pairs | workers | shards | clean s | encode+binarize s | lines/s (clean+encode+binarize) | "
             "vs baseline | vs 1 worker | subword training s | wall s | peak RSS MiB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        one = next(o for o in rows if o["scale"] == r["scale"] and o["workers"] == min(args.workers))
        lines.append(f"| x{r['scale']} | {r['pairs']} | {r['workers']} | {r['shards']} | {r['clean_s']:.1f} | "
                     f"{r['train_s']:.1f} | {r['lines_per_s']:,.0f} | {r['lines_per_s'] / base:.2f} | "
                     f"{r['lines_per_s'] / one['lines_per_s']:.2f} | {r['subword_s']:.1f} | "
                     f"{r['wall_s']:.1f} | {r['maxrss_mib']:.0f} |")
    lines.append("")
    if args.repeats > 1:
        lines.append(f"Each row is the median of {args.repeats} runs, interleaved across worker counts; "
                     "the ratio to one worker in each repeat (runs side by side):  ")
        for scale in raws:
            one = next(r for r in rows if r["scale"] == scale and r["workers"] == min(args.workers))
            for r in (r for r in rows if r["scale"] == scale and r["workers"] != min(args.workers)):
                ratios = ", ".join(f"{a / b:.2f}" for a, b in zip(r["each_lines_per_s"], one["each_lines_per_s"]))
                lines.append(f"x{scale}, {r['workers']} workers: {ratios}  ")
        lines.append("")
    for w in args.workers:
        small = next(r for r in rows if r["scale"] == 1 and r["workers"] == w)
        large = next(r for r in rows if r["scale"] == args.scale and r["workers"] == w)
        lines.append(f"Peak RSS x{args.scale} / x1 with {w} worker(s): "
                     f"**{large['maxrss_mib'] / small['maxrss_mib']:.2f}** "
                     f"({large['maxrss_mib']:.0f} / {small['maxrss_mib']:.0f} MiB).  ")
    lines += ["", "Where the time goes (seconds; phases are wall time; worker = the tasks' summed CPU time, "
              "with their summed wall time in brackets: more wall than CPU means the workers waited for a core):", "",
              "| corpus | workers | " + " | ".join(PHASES) + " | worker: " + " | worker: ".join(WORKER) + " | checksums |",
              "|---|---:|" + "---:|" * (len(PHASES) + len(WORKER) + 1)]
    for r in rows:
        lines.append(f"| x{r['scale']} | {r['workers']} | " + " | ".join(f"{r['phases'][k]:.2f}" for k in PHASES)
                     + " | " + " | ".join(f"{r['worker_cpu_s'][k]:.2f} ({r['worker_s'][k]:.2f})" for k in WORKER)
                     + f" | {r['checksum_s']:.2f} |")
    lines += ["", *projection(rows, args)]
    lines += ["",
              "How to read it: the baseline only encodes; the pipeline also reads, decodes, normalises "
              "(Moses punctuation, non-printing characters), deduplicates and writes the cleaned text, "
              "then encodes, filters and binarizes. Each worker reads its own byte range of the input, "
              "cleans it, and later encodes its shard of the cleaned text; duplicates are found per hash "
              "bucket; the main process only indexes the input (newline counting), schedules, and "
              "concatenates the shards (file copies). The peak RSS is the largest process; nothing in "
              "it grows with the corpus except the duplicate buckets, whose size is capped."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        args.write.write_text(text)


if __name__ == "__main__":
    main()
