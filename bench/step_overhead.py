"""One compiled decoder step of one row, called again and again: what it costs around its kernels,
and the same step compiled ahead of time.

    python bench/step_overhead.py --model runs/multi30k_en_de_admin/avg2.pt \
        --src data/multi30k_en_de/test.en --aoti

The first sentence of --src is decoded greedily with the compiled step (translate.py --compile)
up to its 10th position; what the step was given there (its tokens, caches and encoder output) is
kept, and then, in interleaved rounds of --calls calls (the order alternating; the caches' 11th
position is written again at each call):
- the step (``CompiledDecoderStep.__call__``: the search's call);
- its compiled graph alone, with the arguments the step passes it (torch.compile's guards and
  wrapper, and the kernels);
- with --aoti, the same computation exported (torch.export, the cache capacity, the cached
  positions and the source length symbolic) and compiled ahead of time by AOTInductor with the
  step's inductor options: no guards and no Python between the kernels. Its logits are compared
  with the step's.
The steps' logits must agree: the largest difference is reported. With --greedy N, the first N
sentences are then decoded greedily one at a time, with the compiled step and with the ahead-of-time
build in its graph's place wherever it computes that graph (one row, from the third position on),
in interleaved rounds, outputs compared. Best and median of --repeats rounds, appended to --out
with the command, date and hardware.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
import decode as bench_decode  # noqa: E402  (bench/ is not a package)

from admin_ds.arguments import int_in  # noqa: E402

POSITION = 10


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_decode.trained_model_arguments(p)
    p.add_argument("--threads", type=bench_decode._positive, default=2)
    p.add_argument("--calls", type=bench_decode._positive, default=300)
    p.add_argument("--repeats", type=bench_decode._positive, default=8)
    p.add_argument("--aoti", action="store_true", help="also the step compiled ahead of time (AOTInductor)")
    p.add_argument("--greedy", type=int_in(0), default=0, metavar="N",
                   help="with --aoti: also greedy decoding of the first N sentences one at a time, both ways")
    p.add_argument("--out", type=Path, default=REPO / "bench/step_overhead_results.md")
    args = p.parse_args(argv)
    if args.greedy and not args.aoti:
        p.error("--greedy compares with the ahead-of-time step: add --aoti")
    return args


def captured_step(model, src):
    """(step, its arguments at POSITION: tokens, enc, src_pad, state) of greedy decoding ``src``."""
    from admin_ds.inference import decode
    from admin_ds.inference.step import decoder_step

    step = decoder_step(model)
    seen = {}
    call = type(step).__call__

    def capture(self, tokens, enc, src_pad, state):
        if state.length == POSITION and not seen:
            seen.update(tokens=tokens.clone(), enc=enc, src_pad=src_pad, state=state)
        return call(self, tokens, enc, src_pad, state)

    type(step).__call__ = capture
    try:
        decode.greedy(model, src, max_len_a=0, max_len_b=POSITION + 2, min_len=POSITION + 2)
    finally:
        type(step).__call__ = call
    return step, seen


def graph_arguments(step, seen):
    """What the step passes its compiled graph at POSITION: (tokens (R,), *caches, mask)."""
    captured = {}
    layers = type(step)._layers

    def keep(self, tokens, caches, mask):
        captured.update(tokens=tokens.reshape(-1).clone(), caches=caches, mask=mask)
        return layers(self, tokens, caches, mask)

    type(step)._layers = keep
    try:
        seen["state"].length = POSITION
        step(seen["tokens"], seen["enc"], seen["src_pad"], seen["state"])
    finally:
        type(step)._layers = layers
    return captured


def ahead_of_time(step, captured, options: dict, folder: Path):
    """The step's graph exported with symbolic sizes and compiled by AOTInductor: (runner, its
    arguments). The cached positions become the size of an argument ``filled`` (n,)."""
    import torch
    from torch import nn
    from torch.export import Dim

    from admin_ds.inference.step import _Caches

    class Step(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = step.model

        def forward(self, tokens, keys, values, encoder_keys, encoder_values, filled, mask):
            caches = _Caches(list(keys), list(values), encoder_keys, encoder_values, filled.size(0), None)
            return step._decoder(tokens, caches, mask)

    c = captured["caches"]
    # The mask contiguous: the step's is expanded over the heads (stride 0 for one sentence), and
    # the ahead-of-time build checks no strides, it takes those it was exported with.
    args = (captured["tokens"], tuple(c.keys), tuple(c.values), c.encoder_keys, c.encoder_values,
            torch.zeros(c.length), captured["mask"].contiguous())
    capacity, source = Dim("capacity", min=4, max=2048), Dim("source", min=2, max=1024)
    filled = Dim("n", min=2, max=step.model.cfg.max_positions - 1)  # a position past them has no embedding
    per_layer = tuple({2: capacity} for _ in c.keys)
    shapes = (None, per_layer, per_layer, {4: source}, {3: source}, {0: filled}, {2: source})
    # Exported and compiled from copies made outside inference mode (the caches are inference tensors).
    example = [tuple(t.clone() for t in a) if isinstance(a, tuple) else a.clone() for a in args]
    program = torch.export.export(Step().eval(), tuple(example), dynamic_shapes=shapes, strict=False)
    options = {k: v for k, v in options.items() if k != "guard_filter_fn"}
    path = torch._inductor.aoti_compile_and_package(program, package_path=str(folder / "step.pt2"),
                                                    inductor_configs=options)
    return torch._inductor.aoti_load_package(path), args


def in_place_of_graph(step, runner) -> None:
    """``step`` runs ``runner`` (``ahead_of_time``) where it would run the graph that was exported:
    one row, no cache reordered in place, from the third position on."""
    import torch

    graph = step._layers
    contiguous = {}

    def layers(tokens, caches, mask):
        if caches.origins is not None or tokens.size(0) != 1 or caches.length < 2:
            return graph(tokens, caches, mask)
        if contiguous.get("of") is not mask:  # the same mask all through a sentence
            contiguous.update(of=mask, mask=mask.contiguous())
        out = runner(tokens.reshape(-1).clone(), tuple(caches.keys), tuple(caches.values), caches.encoder_keys,
                     caches.encoder_values, torch.empty(caches.length), contiguous["mask"])
        return out[0] if isinstance(out, (list, tuple)) else out

    step._layers = layers


def greedy_rounds(model, step, runner, srcs: list, repeats: int) -> tuple[dict[str, list[float]], bool]:
    """Seconds per round of greedy decoding ``srcs`` one after another, with the compiled step and
    with ``runner`` in place of its graph; whether both gave the same outputs."""
    from admin_ds.inference import decode

    def search(ahead: bool):
        def run():
            if ahead:
                in_place_of_graph(step, runner)
            try:
                return [h for src in srcs for h in decode.greedy(model, src, max_len_a=0, max_len_b=128)]
            finally:
                vars(step).pop("_layers", None)
        return run

    runs = {"greedy, the compiled step": search(False), "greedy, ahead of time from the third position": search(True)}
    same = runs["greedy, the compiled step"]() == runs["greedy, ahead of time from the third position"]()
    return bench_decode.interleaved(runs, 1, repeats, alternate=True), same


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from admin_ds.inference.allocator import tune_malloc_for_decoding
    from admin_ds.inference.model_file import build_from_model_file, load_any
    from admin_ds.inference.packed import optimize_for_decoding
    from admin_ds.inference.step import COMPILE_OPTIONS, _frozen

    torch.set_num_threads(args.threads)
    tune_malloc_for_decoding()
    model, subword = build_from_model_file(load_any(args.model))
    model = optimize_for_decoding(model, "fp32", compile_step=True)
    line = next(line for line in args.src.read_text(encoding="utf-8").splitlines() if line.strip())
    step, seen = captured_step(model, bench_decode.source_batch(subword, model.cfg, [line]))
    if not seen:
        raise SystemExit(f"the step never reached position {POSITION}")
    captured = graph_arguments(step, seen)
    graph_args = (captured["tokens"], *captured["caches"], captured["mask"])

    def whole_step():
        seen["state"].length = POSITION
        return step(seen["tokens"], seen["enc"], seen["src_pad"], seen["state"])

    runs = {"the step (the search's call)": whole_step,
            "its compiled graph alone": lambda: _frozen(step._compiled, *graph_args)}
    with torch.inference_mode():
        want = whole_step().clone()
    differences = {name: 0.0 for name in runs}
    if args.aoti:
        with tempfile.TemporaryDirectory() as folder:
            start = time.perf_counter()
            runner, aoti_args = ahead_of_time(step, captured, COMPILE_OPTIONS, Path(folder))
            print(f"compiled ahead of time in {time.perf_counter() - start:.0f} s", flush=True)
            runs["compiled ahead of time (AOTInductor)"] = lambda: runner(*aoti_args)
    with torch.inference_mode():
        for name, run in runs.items():
            got = run()
            got = got[0] if isinstance(got, (list, tuple)) else got
            differences[name] = float((got.reshape(want.shape) - want).abs().max())
        times = bench_decode.interleaved(runs, args.calls, args.repeats, warmup=20, alternate=True)

    searches = []
    if args.aoti and args.greedy > 0:
        lines = [line for line in args.src.read_text(encoding="utf-8").splitlines() if line.strip()][:args.greedy]
        srcs = [bench_decode.source_batch(subword, model.cfg, [line]) for line in lines]
        greedy_times, same = greedy_rounds(model, step, runner, srcs, args.repeats)
        searches = [f"Greedy decoding of the first {len(srcs)} sentences one at a time, ms per round:", "",
                    "| search | best ms | median ms | same outputs |", "|---|---:|---:|---|",
                    *(f"| {name} | {min(t) * 1e3:.0f} | {statistics.median(t) * 1e3:.0f} | {'yes' if same else 'NO'} |"
                      for name, t in greedy_times.items()), ""]
    rows = [f"| {name} | {min(t) * 1e6:.0f} | {statistics.median(t) * 1e6:.0f} | {differences[name]:.2g} |"
            for name, t in times.items()]
    report = ["# One compiled decoder step, called again and again (bench/step_overhead.py)", "",
              f"- command: `python bench/step_overhead.py {' '.join(sys.argv[1:] if argv is None else argv)}`",
              f"- date: {datetime.date.today().isoformat()}; hardware: {bench_decode.hardware()}",
              f"- torch {torch.__version__}, {args.threads} threads; one row at position {POSITION} of the first "
              f"sentence of {args.src.name}; {args.repeats} interleaved rounds of {args.calls} calls", "",
              "| call | best us | median us | largest logit difference from the step's |", "|---|---:|---:|---:|",
              *rows, "", *searches]
    print("\n".join(report), flush=True)
    bench_decode.append_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
