"""Cleaning one shard: ``normalize`` line by line against ``normalize_lines`` (the punctuation
rules over the whole shard at once, data_prep/clean.py), on the data-preparation benchmark's raw
text (bench/data_prep.py's corpus, 8 copies: 360k lines per side), outputs compared.

    python bench/cleaning.py

One thread, shards of 9,730 lines as data preparation's workers clean them, best of 3.
"""

from __future__ import annotations

import importlib.util
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data_prep.clean import PunctNormalizer, decode_side, normalize, normalize_lines  # noqa: E402

SHARD = 9730


def best_of(n: int, fn) -> tuple[float, list]:
    times, out = [], None
    for _ in range(n):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


def main() -> None:
    spec = importlib.util.spec_from_file_location("data_prep_bench", ROOT / "bench" / "data_prep.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    pairs = bench.base_pairs()
    print(f"{platform.processor() or platform.machine()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| side | lines | line by line us/line | whole shard us/line | speed-up | outputs equal |")
    print("|---|---:|---:|---:|---:|---|")
    for side, lang in ((0, "en"), (1, "de")):
        lines = [decode_side(p[side] + (f" ({k})" if k else "")) for k in range(8) for p in pairs]
        punct = PunctNormalizer(lang)
        shards = [lines[i:i + SHARD] for i in range(0, len(lines), SHARD)]
        t_line, a = best_of(3, lambda: [[normalize(x, punct) for x in s] for s in shards])
        t_block, b = best_of(3, lambda: [normalize_lines(s, punct) for s in shards])
        n = len(lines)
        print(f"| {lang} | {n:,} | {t_line / n * 1e6:.2f} | {t_block / n * 1e6:.2f} | {t_line / t_block:.2f}x | {a == b} |")


if __name__ == "__main__":
    main()
