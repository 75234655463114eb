"""What translate.py --compile costs at the start of a process, and after how many sentences it pays.

    python bench/compile_warmup.py --model runs/multi30k_en_de_admin/avg2.pt \
        --src data/multi30k_en_de/test.en --threads 2 --out bench/compile_warmup_results.md

Each row is the real command (launch/translate.py) in a process of its own, one after another:
eager, then compiled in the process (``--compile --no-compiled-dir``) with an empty inductor cache
(``TORCHINDUCTOR_CACHE_DIR`` a new directory), then compiled again with the cache that run left, the
way a second job on the same machine starts (``--int8`` rows too with --int8), and in fp32 with the
graphs kept on disk (``--compiled-dir``, a new directory): built by the first such run, from an
empty inductor cache, and loaded by the next ones. Eager and the second compiled run (and the second
on-disk run) also translate the input repeated ``--repeat`` times: the two sizes give each its time
per sentence and its fixed cost besides compiling (a straight line through the two, each run's
compiling taken out), and the break-even is the input size from which the compiled process is done
first: its compiling and extra fixed cost over what it saves a sentence. For each compiled run: the
time spent compiling (``admin_ds.inference.step.compilation_seconds``: torch.compile's tracing to
generated code, and the builds of graphs kept on disk), the graphs torch.compile compiled, and what
inductor's graph cache on disk did for them (hits, misses, bypasses with the reason inductor logs).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from decode import hardware  # noqa: E402  (bench/ is not a package)

# Runs launch/translate.py in this process and writes, at exit, torch.compile's counters to the
# file named by the first argument.
_PROBE = r"""
import atexit, json, logging, runpy, sys
out, argv = sys.argv[1], sys.argv[2:]
reasons = []
class Keep(logging.Handler):
    def emit(self, record):
        message = record.getMessage()
        if "Bypassing" in message:
            reasons.append(message.split("] ", 1)[-1])
logging.getLogger("torch._inductor.codecache").addHandler(Keep())
logging.getLogger("torch._inductor.codecache").setLevel(logging.INFO)
def report():
    from torch._dynamo.utils import counters
    from admin_ds.inference.step import compilation_seconds
    json.dump({"compile_s": compilation_seconds(),
               "graphs": counters["stats"]["unique_graphs"],
               "inductor": {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")},
               "bypass": sorted(set(reasons))}, open(out, "w"))
atexit.register(report)
sys.argv = ["launch/translate.py", *argv]
runpy.run_path("launch/translate.py", run_name="__main__")
"""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, type=Path, help="run directory or model file")
    p.add_argument("--src", required=True, type=Path, help="raw source text, one sentence per line")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--method", default="beam", choices=("beam", "greedy"))
    p.add_argument("--int8", action="store_true", help="also the --int8 rows")
    p.add_argument("--repeat", type=int, default=3, help="the longer runs translate the input this many times")
    p.add_argument("--out", type=Path, help="append the report (markdown) to this file")
    args = p.parse_args(argv)
    if args.repeat < 2:
        p.error(f"--repeat {args.repeat}: at least 2 (two input sizes make the line)")
    return args


def run(args, options: list[str], cache: Path, src: Path) -> dict:
    """One translate.py process: its wall seconds and compile counters."""
    with tempfile.NamedTemporaryFile(suffix=".json") as report:
        cmd = [sys.executable, "-c", _PROBE, report.name, "--checkpoint", str(args.model), "--input", str(src),
               "--method", args.method, "--quiet", *options]
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=str(args.threads),
                   TORCHINDUCTOR_CACHE_DIR=str(cache))
        t0 = time.perf_counter()
        done = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        wall = time.perf_counter() - t0
        if done.returncode:
            raise SystemExit(f"translate.py {' '.join(options)} failed:\n{done.stderr[-3000:]}")
        return {"wall": wall, **json.loads(Path(report.name).read_text())}


def line(one: dict, many: dict, n: int, k: int) -> tuple[float, float]:
    """(fixed seconds, seconds a sentence) of everything but compiling: the straight line through a
    run of n sentences and one of k * n, each less its compiling (which differs between the two:
    the longer input's batches can need a graph more)."""
    per = ((many["wall"] - many["compile_s"]) - (one["wall"] - one["compile_s"])) / ((k - 1) * n)
    return one["wall"] - one["compile_s"] - n * per, per


def main(argv=None) -> int:
    args = parse_args(argv)
    text = args.src.read_text(encoding="utf-8")
    n = text.count("\n") + (not text.endswith("\n"))
    rows, lines = [], []
    with tempfile.TemporaryDirectory() as tmp:
        repeated = Path(tmp) / "repeated.txt"
        repeated.write_text((text if text.endswith("\n") else text + "\n") * args.repeat, encoding="utf-8")
        for precision in ["fp32"] + (["int8"] if args.int8 else []):
            flags = ["--int8"] if precision == "int8" else []
            cache = Path(tmp) / f"inductor_{precision}"  # empty: a cold start
            compiled = [*flags, "--compile", "--no-compiled-dir"]  # torch.compile's graphs, in the process
            plan = [("eager", flags, args.src), ("eager, repeated", flags, repeated),
                    ("compiled, empty cache", compiled, args.src),
                    ("compiled, its cache again", compiled, args.src),
                    ("compiled, its cache, repeated", compiled, repeated)]
            if precision == "fp32":  # graphs on disk (--compiled-dir), from an inductor cache of their own
                on_disk = ["--compile", "--compiled-dir", str(Path(tmp) / "graphs")]
                plan += [("graphs on disk, empty cache: built", on_disk, args.src),
                         ("graphs on disk: loaded", on_disk, args.src),
                         ("graphs on disk: loaded, repeated", on_disk, repeated)]
            runs = {}
            for name, options, src in plan:
                runs[name] = run(args, options, cache if "on disk" not in name else Path(tmp) / "inductor_disk", src)
                print(f"{precision} {name}: {runs[name]['wall']:.1f} s", file=sys.stderr, flush=True)
            eager = line(runs["eager"], runs["eager, repeated"], n, args.repeat)
            fits = {"compiled": line(runs["compiled, its cache again"], runs["compiled, its cache, repeated"], n, args.repeat)}
            if "graphs on disk: loaded" in runs:
                fits["graphs on disk"] = line(runs["graphs on disk: loaded"], runs["graphs on disk: loaded, repeated"],
                                              n, args.repeat)
            for name, r in runs.items():
                sentences = n * args.repeat if "repeated" in name else n
                even = "-"
                if "repeated" not in name and name != "eager":
                    fit = fits["graphs on disk" if "on disk" in name else "compiled"]
                    saved = eager[1] - fit[1]
                    even = f"{(r['compile_s'] + fit[0] - eager[0]) / saved:,.0f}" if saved > 0 else "never"
                cache_use = ", ".join(f"{k.removeprefix('fxgraph_cache_')} {v}"
                                      for k, v in sorted(r["inductor"].items()))
                rows.append(f"| {precision} | {name} | {sentences} | {r['wall']:.1f} | {r['compile_s']:.1f} | "
                            f"{r['graphs']} | {cache_use or '-'} | {even} |")
            lines.append(f"- {precision}: eager {eager[0]:.1f} s fixed + {1000 * eager[1]:.2f} ms a sentence "
                         f"({1 / eager[1]:.1f} sentences/s); " + "; ".join(
                             f"{name}, {fixed:.1f} s fixed besides compiling + {1000 * per:.2f} ms a sentence "
                             f"({1 / per:.1f} sentences/s)" for name, (fixed, per) in fits.items()))
            reasons = sorted({reason for r in runs.values() for reason in r["bypass"]})
            if reasons:
                lines.append(f"- {precision}: inductor's graph cache bypassed: " + "; ".join(reasons))
    report = "\n".join([
        "# translate.py --compile: its start-up cost\n",
        f"- command: `python bench/compile_warmup.py {' '.join(sys.argv[1:])}`",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- hardware: {hardware()}",
        f"- input: {args.src} ({n} sentences; repeated: {args.repeat} times), {args.method}, {args.threads} threads; "
        "every row a process of its own, one after another\n",
        "| precision | run | sentences | process wall s | of which compiling s | torch.compile graphs | inductor graph cache | "
        "break-even (sentences) |", "|---|---|---:|---:|---:|---:|---|---:|", *rows, "", *lines]) + "\n"
    print(report)
    if args.out:
        separator = "\n---\n\n" if args.out.exists() and args.out.stat().st_size else ""
        with args.out.open("a", encoding="utf-8") as f:
            f.write(separator + report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
