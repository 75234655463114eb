"""Where a search's time goes, part by part; and one of its parts side by side with what it replaced.

    python bench/decode_parts.py --model runs/multi30k_en_de_admin/avg2.pt \
        --src data/multi30k_en_de/test.en --batches 1 64 --compile

The first --sentences sentences of --src (default 64) are decoded in consecutive batches of each
--batches size, greedy and beam --beam, up to EOS or --max-len tokens, as bench/decode.py decodes
them. Parts, timed around the calls in one process (best of --repeats rounds, after a warm-up
round that compiles): the encoder; the decoder steps by their row count (sentences x beams still
decoding); the self-attention caches' and the encoder keys' and values' reorders when rows finish
or beams move; the rest of the search (log-probabilities, the choice of tokens, bookkeeping).

Then, in interleaved rounds (--repeats each, the order alternating), greedy's choice of each row's
largest constrained logit by torch.max's reduction (now) against argmax's (before), outputs
compared. (The report of 2026-11-27 compared two earlier changes the same way: greedy's choice
from the constrained logits against a log-softmax, and the encoder stacks' rows selected along the
first dimension against the second.)

The report goes to --out (appended), with the command, date and hardware.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
import decode as bench_decode  # noqa: E402  (bench/ is not a package)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_decode.trained_model_arguments(p)
    p.add_argument("--batches", type=bench_decode._positive, nargs="+", default=[1, 64])
    p.add_argument("--sentences", type=bench_decode._positive, default=64)
    p.add_argument("--beam", type=bench_decode._positive, default=4)
    p.add_argument("--max-len", type=bench_decode._positive, default=128)
    p.add_argument("--threads", type=bench_decode._positive, default=2)
    p.add_argument("--repeats", type=bench_decode._positive, default=4)
    p.add_argument("--compile", action="store_true", help="a compiled decoder step (translate.py --compile)")
    p.add_argument("--out", type=Path, default=REPO / "bench/decode_parts_results.md")
    return p.parse_args(argv)


class Timers:
    """Seconds and calls per part, around the functions that ``wrap`` replaces."""

    def __init__(self) -> None:
        self.seconds: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()

    def wrap(self, owner, attr: str, name) -> None:
        fn = getattr(owner, attr)

        def timed(*args, **kwargs):
            part = name(*args) if callable(name) else name
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start
                self.calls[part] += 1

        setattr(owner, attr, timed)

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def _rows(rows: int) -> str:
    return "1 row" if rows == 1 else "2-8 rows" if rows <= 8 else "9-64 rows" if rows <= 64 else "65+ rows"


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from admin_ds.inference import decode
    from admin_ds.inference.allocator import tune_malloc_for_decoding
    from admin_ds.inference.model_file import build_from_model_file, load_any
    from admin_ds.inference.packed import optimize_for_decoding
    from admin_ds.inference.step import decoder_step
    from admin_ds.model.layers import IncrementalState

    torch.set_num_threads(args.threads)
    tune_malloc_for_decoding()
    mf = load_any(args.model)
    model, subword = build_from_model_file(mf)
    model = optimize_for_decoding(model, "fp32", compile_step=args.compile)
    lines = [line for line in args.src.read_text(encoding="utf-8").splitlines() if line.strip()][:args.sentences]
    limits = dict(max_len_a=0, max_len_b=args.max_len, min_len=1)

    timers = Timers()
    step_class = type(decoder_step(model))
    timers.wrap(step_class, "__call__", lambda self, tokens, *rest: "decoder steps, " + _rows(tokens.size(0)))
    if hasattr(step_class, "encode"):
        timers.wrap(step_class, "encode", "encoder")
    timers.wrap(IncrementalState, "reorder", "reorder: self-attention caches")
    timers.wrap(IncrementalState, "reorder_encoder", "reorder: encoder keys and values")

    def search(batches, beam, before=False):
        with _before(before):
            out = []
            for src in batches:
                if beam == 1:
                    out += decode.greedy(model, src, **limits)
                else:
                    out += [h[0].tokens for h in decode.beam_search(model, src, beam=beam, **limits)]
            return out

    report = ["# Where a search's time goes (bench/decode_parts.py)", "",
              f"- command: `python bench/decode_parts.py {' '.join(sys.argv[1:] if argv is None else argv)}`",
              f"- date: {datetime.date.today().isoformat()}; hardware: {bench_decode.hardware()}",
              f"- torch {torch.__version__}, {args.threads} threads; {'compiled' if args.compile else 'eager'} "
              f"decoder step; the first {len(lines)} sentences of {args.src.name}, up to EOS or {args.max_len} "
              f"tokens; best of {args.repeats} rounds, ms per round", ""]
    parts_rows, compare_rows = [], []
    for size in args.batches:
        batches = [bench_decode.source_batch(subword, model.cfg, lines[i:i + size])
                   for i in range(0, len(lines), size)]
        for beam in (1, args.beam):
            label = f"batch {size}, {'greedy' if beam == 1 else f'beam {beam}'}"
            search(batches, beam)  # warm-up (and compilation)
            best = None
            for _ in range(args.repeats):
                timers.clear()
                start = time.perf_counter()
                search(batches, beam)
                total = time.perf_counter() - start
                if best is None or total < best[0]:
                    best = (total, dict(timers.seconds), dict(timers.calls))
            total, seconds, calls = best
            named = sum(seconds.values())  # the timed parts call none of each other
            cells = [f"{k}: {v * 1e3:.1f} ({calls[k]})" for k, v in sorted(seconds.items())]
            cells.append(f"the rest: {(total - named) * 1e3:.1f}")
            parts_rows.append(f"| {label} | {total * 1e3:.1f} | {'; '.join(cells)} |")
            print(parts_rows[-1], flush=True)

            outputs = {before: search(batches, beam, before) for before in (False, True)}
            times = bench_decode.interleaved({b: lambda b=b: search(batches, beam, b) for b in (False, True)}, 1,
                                             args.repeats, warmup=0, alternate=True)
            compare_rows.append(_compared(label, times, outputs[False] == outputs[True]))
            print(compare_rows[-1], flush=True)
    report += ["| search | total ms | parts: ms (calls) |", "|---|---:|---|", *parts_rows, "",
               "Greedy's choice by argmax (before) and by torch.max (now), interleaved rounds (beam search "
               "takes neither: its rows measure the noise):", "", *_COMPARED_HEADER, *compare_rows, "",
               f"The choice alone, on random rows of {model.cfg.vocab_size} logits (us a call, best of 5 rounds):",
               "", "| rows | argmax | torch.max | argmax / torch.max |", "|---:|---:|---:|---:|",
               *_choice_rows(model.cfg.vocab_size), ""]
    bench_decode.append_report(args.out, report)
    return 0


_COMPARED_HEADER = ["| search | before ms | now ms | before / now, best | before / now, median | same outputs |",
                    "|---|---:|---:|---:|---:|---|"]


@contextlib.contextmanager
def _before(before: bool) -> Iterator[None]:
    """``before``: greedy's choice by argmax, while it lasts."""
    from admin_ds.inference import decode

    largest = decode._largest
    if before:
        decode._largest = lambda scores: scores.argmax(dim=-1)
    try:
        yield
    finally:
        decode._largest = largest


def _choice_rows(vocab: int) -> list[str]:
    """argmax against torch.max's positions of each row's largest value, at 1, 16 and 64 rows."""
    import torch

    rows = []
    for n in (1, 16, 64):
        x = torch.randn(n, vocab, generator=torch.Generator().manual_seed(n))
        assert torch.equal(x.argmax(dim=-1), x.max(dim=-1).indices)
        us = [_best_call(f, x) * 1e6 for f in (lambda x: x.argmax(dim=-1), lambda x: x.max(dim=-1).indices)]
        rows.append(f"| {n} | {us[0]:.1f} | {us[1]:.1f} | {us[0] / us[1]:.2f}x |")
    return rows


def _best_call(f: Callable, x, calls: int = 200) -> float:
    """Seconds of one ``f(x)``, the best of 5 rounds of ``calls`` calls."""
    best = float("inf")
    for r in range(6):  # the first round warms up
        start = time.perf_counter()
        for _ in range(calls):
            f(x)
        if r:
            best = min(best, (time.perf_counter() - start) / calls)
    return best


def _compared(label: str, times: dict[bool, list[float]], same: bool) -> str:
    old, new = min(times[True]), min(times[False])
    median = statistics.median(times[True]) / statistics.median(times[False])
    return (f"| {label} | {old * 1e3:.1f} | {new * 1e3:.1f} | {old / new:.3f}x | {median:.3f}x | "
            f"{'yes' if same else 'NO'} |")


if __name__ == "__main__":
    sys.exit(main())
