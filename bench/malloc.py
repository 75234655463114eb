"""translate.py on a whole file with glibc malloc's thresholds set for decoding (the default on a
CPU, admin_ds/inference/allocator.py) and left as they are (ADMIN_DS_TUNE_MALLOC=0), side by side.

    python bench/malloc.py --checkpoint runs/multi30k_en_de_admin/avg2.pt \
        --input data/multi30k_en_de/test.en --methods beam greedy --repeats 3

Each run is the real command (launch/translate.py, CPU, --threads intra-op threads), the two
settings alternating, --repeats rounds. Time: the translate phase as translate.py reports it (model
loading excluded); peak memory: the process's maximum resident set (wait4's ru_maxrss). The
translations must be identical.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from decode import hardware  # noqa: E402  (bench/ is not a package)

SETTINGS = {"left as they are": "0", "set for decoding": "1"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, type=Path, help="run dir or model file")
    p.add_argument("--input", required=True, type=Path, help="source sentences, one per line")
    p.add_argument("--methods", nargs="+", choices=("beam", "greedy"), default=["beam", "greedy"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    return p.parse_args(argv)


def run(args, method: str, tune: str) -> tuple[float, float, str]:
    """(translate seconds, peak RSS MiB, md5 of the output) of one translate.py process."""
    env = dict(os.environ, ADMIN_DS_TUNE_MALLOC=tune, OMP_NUM_THREADS=str(args.threads))
    cmd = [sys.executable, str(REPO / "launch/translate.py"), "--checkpoint", str(args.checkpoint),
           "--input", str(args.input), "--method", method, "--device", "cpu", "--quiet"]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)  # files, not pipes: nothing to drain while waiting
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        output, log = out.read(), err.read().decode(errors="replace")
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{log[-2000:]}")
    m = re.search(r"sentences in ([0-9.]+)s", log)
    if m is None:
        raise RuntimeError(f"no timing in translate.py's output:\n{log[-2000:]}")
    return float(m.group(1)), usage.ru_maxrss / 1024, hashlib.md5(output).hexdigest()


def main(argv=None) -> int:
    args = parse_args(argv)
    lines = sum(1 for _ in args.input.open(encoding="utf-8"))
    print(f"# translate.py with malloc's thresholds set for decoding and left as they are ({datetime.date.today()})")
    print(f"- command: python bench/malloc.py {' '.join(sys.argv[1:])}")
    print(f"- hardware: {hardware()}")
    print(f"- {args.checkpoint}, {args.input} ({lines:,} lines), {args.threads} threads; median of "
          f"{args.repeats} alternating runs; translations identical in every run\n")
    print("| search | malloc's thresholds | translate (s) | peak memory (MiB) | speed vs left as they are |")
    print("|---|---|---:|---:|---:|")
    for method in args.methods:
        times: dict[str, list[float]] = {name: [] for name in SETTINGS}
        rss: dict[str, list[float]] = {name: [] for name in SETTINGS}
        digests = set()
        for _ in range(args.repeats):
            for name, tune in SETTINGS.items():
                t, r, digest = run(args, method, tune)
                times[name].append(t)
                rss[name].append(r)
                digests.add(digest)
        if len(digests) != 1:
            raise AssertionError(f"{method}: the translations differ between runs")
        base = statistics.median(times["left as they are"])
        for name in SETTINGS:
            t = statistics.median(times[name])
            print(f"| {method} | {name} | {t:.2f} | {max(rss[name]):,.0f} | {base / t:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
