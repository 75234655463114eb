"""One product of a compiled decoder step, as inductor generates it, against the libraries'
products, at 1 to 256 rows: why CompiledDecoderStep runs few rows and many in graphs of their own.

    python bench/compiled_products.py --hint 4

For each weight shape (out x in) of --shapes (default: a 256-wide step's, vocabulary 8,000), a
Linear layer is compiled as the step compiles its graphs, with the row count symbolic:
- "autotuned": step.COMPILE_OPTIONS, first called with --hint rows. Autotuning times inductor's C++
  kernel for the shape against ATen's at those rows, and its choice serves every row count after.
- "ATen": the same options without autotuning (the graphs of many rows).
(A step's graph of few rows compiled at up to ``template_rows`` rows takes the generated kernel
without this benchmark, wherever inductor's template applies: step._templates_first.)
Both include the compiled function's own call (guards and wrapper, tens of microseconds) that a
step's graph pays once for its ~40 products, so the two compare with each other, and with F.linear
(MKL) and oneDNN's packed product (decoding's PackedLinear) only from a few rows up. Best of
--repeats interleaved rounds, microseconds per call and GFLOP/s.

With --model and --src, then whole searches: the first --sentences sentences of --src decoded
greedily and with beam --beam (up to EOS or --max-len tokens) in batches of each --batches size,
after a first batch of --first sentences, by two compiled models in one process: one whose every
row count and source length runs in the autotuned graphs (``few_rows`` and ``few_tokens``
unbounded, as CompiledDecoderStep compiled before) and one as translate.py --compile decodes now,
with CTranslate2 (float32) on the same weights in the same interleaved rounds; outputs compared.

The report is appended to --out with the command, date and hardware.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
import decode as bench_decode  # noqa: E402  (bench/ is not a package)

from admin_ds.arguments import existing_path, input_file  # noqa: E402


def _shape(text: str) -> tuple[int, int]:
    try:
        out, inp = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not OUTxIN, e.g. 1024x256") from None
    if out < 1 or inp < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: both sizes must be positive")
    return out, inp


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=_shape, nargs="+",
                   default=[(8000, 256), (768, 256), (256, 256), (1024, 256), (256, 1024)])
    p.add_argument("--rows", type=bench_decode._positive, nargs="+", default=[1, 4, 16, 64, 256])
    p.add_argument("--hint", type=bench_decode._positive, default=4,
                   help="rows of the call that compiles (and autotunes) the graph")
    p.add_argument("--threads", type=bench_decode._positive, default=2)
    p.add_argument("--repeats", type=bench_decode._positive, default=5)
    p.add_argument("--model", type=existing_path, help="run directory or model file: also whole searches")
    p.add_argument("--src", type=input_file, help="with --model: source sentences, one per line")
    p.add_argument("--first", type=bench_decode._positive, default=2, help="sentences of the first batch")
    p.add_argument("--batches", type=bench_decode._positive, nargs="+", default=[64])
    p.add_argument("--sentences", type=bench_decode._positive, default=64)
    p.add_argument("--beam", type=bench_decode._positive, default=4)
    p.add_argument("--max-len", type=bench_decode._positive, default=128)
    p.add_argument("--out", type=Path, default=REPO / "bench/compiled_products_results.md")
    args = p.parse_args(argv)
    if (args.model is None) != (args.src is None):
        p.error("--model and --src go together")
    return args


def searches(args) -> list[str]:
    """Report lines of the whole searches (see the module's docstring)."""
    import tempfile
    import types

    import torch

    from admin_ds.inference.model_file import build_from_model_file
    from admin_ds.inference.packed import optimize_for_decoding

    lines = []
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        run = types.SimpleNamespace(model=args.model, src=args.src, beam=args.beam, length=0,
                                    max_len=args.max_len, transformers=False)
        mf, sentences = bench_decode.build(run, tmp)
        sentences = sentences[:args.sentences]
        one, subword = build_from_model_file(mf)
        ours = {"one kind of graph": optimize_for_decoding(one, "fp32", compile_step=True),
                "few rows and many": optimize_for_decoding(build_from_model_file(mf)[0], "fp32", compile_step=True)}
        before = ours["one kind of graph"].compiled_decoder_step
        before.few_rows = before.few_tokens = sys.maxsize
        step = ours["few rows and many"].compiled_decoder_step
        lines += [f"Whole searches, {len(sentences)} sentences of {args.src.name} up to EOS or {args.max_len} "
                  f"tokens, after a first batch of {args.first}; few_rows {step.few_rows}, few_tokens "
                  f"{step.few_tokens}; seconds a round, best (median); ours / CTranslate2 as speed ratios:", "",
                  "| batch | search | one kind of graph | few rows and many | CTranslate2 | speed-up | "
                  "one kind / CT2 | few and many / CT2 | same outputs |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---|"]
        for batch in (args.first, *args.batches):
            srcs = [bench_decode.source_batch(subword, one.cfg, sentences[i:i + batch])
                    for i in range(0, len(sentences), batch)]
            if batch == args.first:
                srcs = srcs[:1]
            runs = bench_decode.decoders(run, args.threads, "fp32", ours, subword, srcs, tmp / "hf", tmp / "ct2")
            with torch.inference_mode():
                outputs = {}
                for key, call in runs.items():  # compiles
                    start = time.perf_counter()
                    outputs[key] = call()
                    print(f"batch {batch} {key}: first call {time.perf_counter() - start:.0f} s", flush=True)
                if batch == args.first:
                    continue
                times = bench_decode.interleaved(runs, 1, args.repeats, warmup=0, alternate=True)
            for beam in (1, args.beam):
                a, b, c = (times[name, beam] for name in (*ours, "ctranslate2"))
                same = sum(x == y for x, y in zip(outputs["one kind of graph", beam], outputs["few rows and many", beam]))
                best, median = min, statistics.median
                lines.append(f"| {batch} | {'greedy' if beam == 1 else f'beam {beam}'} | {best(a):.3f} ({median(a):.3f}) | "
                             f"{best(b):.3f} ({median(b):.3f}) | {best(c):.3f} ({median(c):.3f}) | "
                             f"{best(a) / best(b):.2f}x ({median(a) / median(b):.2f}x) | "
                             f"{best(c) / best(a):.2f}x ({median(c) / median(a):.2f}x) | "
                             f"{best(c) / best(b):.2f}x ({median(c) / median(b):.2f}x) | {same}/{len(sentences)} |")
                print(lines[-1], flush=True)
    return lines + [""]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.model is not None:
        import ctranslate2  # noqa: F401  (before torch: one OpenMP runtime for both, bench/decode.py)
    import torch
    from torch import nn

    from admin_ds.inference.allocator import tune_malloc_for_decoding
    from admin_ds.inference.packed import PackedLinear, packed_linear_available
    from admin_ds.inference.step import COMPILE_OPTIONS, _frozen

    torch.set_num_threads(args.threads)
    tune_malloc_for_decoding()  # as translate.py decodes
    torch.manual_seed(0)
    lines = []
    for out_features, in_features in args.shapes:
        linear = nn.Linear(in_features, out_features).requires_grad_(False).eval()
        paths = {"autotuned": torch.compile(lambda x, f=linear: f(x), options=dict(COMPILE_OPTIONS)),
                 "ATen": torch.compile(lambda x, f=linear: f(x), options=dict(COMPILE_OPTIONS, max_autotune=False))}
        calls = {name: (lambda x, c=c: _frozen(c, x)) for name, c in paths.items()}
        calls["F.linear"] = linear
        if packed_linear_available():
            calls["oneDNN packed"] = PackedLinear(linear.weight, linear.bias)
        times: dict[tuple[int, str], list[float]] = {}
        with torch.inference_mode():
            inputs = {m: torch.randn(m, in_features) for m in args.rows}
            for m in (args.hint, *args.rows):  # compile at --hint rows first
                x = torch.randn(m, in_features)
                for name in paths:
                    torch._dynamo.maybe_mark_dynamic(x, 0)
                    want = linear(x)
                    assert torch.allclose(calls[name](x), want, atol=1e-4), f"{name} computes another product"
            for _ in range(args.repeats):
                for m in args.rows:
                    n = max(20, 3000 // m)
                    for name, call in calls.items():
                        x = inputs[m]
                        if name in paths:
                            torch._dynamo.maybe_mark_dynamic(x, 0)
                        start = time.perf_counter()
                        for _ in range(n):
                            call(x)
                        times.setdefault((m, name), []).append((time.perf_counter() - start) / n)
        names = list(calls)
        lines += [f"Weight {out_features} x {in_features}: best us a call (GFLOP/s); median us in brackets", "",
                  "| rows | " + " | ".join(names) + " | autotuned / ATen |",
                  "|---:|" + "---:|" * (len(names) + 1)]
        for m in args.rows:
            flops = 2 * m * out_features * in_features
            cells = [f"{min(times[m, n]) * 1e6:.1f} ({flops / min(times[m, n]) / 1e9:.0f}) "
                     f"[{statistics.median(times[m, n]) * 1e6:.1f}]" for n in names]
            ratio = min(times[m, "autotuned"]) / min(times[m, "ATen"])
            lines.append(f"| {m} | " + " | ".join(cells) + f" | {ratio:.2f}x |")
        lines.append("")
        print("\n".join(lines[-len(args.rows) - 5:]), flush=True)
    if args.model is not None:
        lines += searches(args)
    report = ["# A compiled step's products at 1 to 256 rows (bench/compiled_products.py)", "",
              f"- command: `python bench/compiled_products.py {' '.join(sys.argv[1:] if argv is None else argv)}`",
              f"- date: {datetime.date.today().isoformat()}; hardware: {bench_decode.hardware()}",
              f"- torch {torch.__version__}, {args.threads} threads; compiled first at {args.hint} rows; "
              f"{args.repeats} interleaved rounds", "", *lines]
    bench_decode.append_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
