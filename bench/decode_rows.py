"""Which path a decoder step's products should take at few rows: oneDNN's packed weights, MKL's
packed GEMM (PackedLinear's two backends) and F.linear (MKL) on the plain weight, per weight shape
and row count.

    python bench/decode_rows.py --threads 2
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 python bench/decode_rows.py

For each width D (--widths) the four product shapes of a layer, (out, in): Q/K/V in one (3D, D),
the attention projections (D, D), the FFN's (4D, D) and (4D -> D). --copies copies of each weight
are multiplied in turn, as a decoder's layers are, so that none stays in the CPU's nearest caches.
The tables are each packed path's time / F.linear's time, median of --repeats interleaved rounds:
above 1 where F.linear is faster. PackedLinear(few_rows=True) packs for MKL on Intel CPUs (F.linear
for one row) and for oneDNN elsewhere (F.linear for one row, and for up to 8 rows when the weight
has at most 1 MiB) (admin_ds/inference/packed.py); this is the measurement behind it. The last
table is F.linear's product with the weight stored transposed ((in, out) contiguous, which MKL reads
along the outputs), which PackedLinear takes for one row on AMD CPUs without AVX-512 where the
weight has more outputs than inputs and at most 1 MiB.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from decode import hardware, interleaved  # noqa: E402  (bench/ is not a package)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--widths", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--copies", type=int, default=6, help="copies of each weight, used in turn")
    p.add_argument("--calls", type=int, default=10, help="passes over the copies per timing")
    p.add_argument("--repeats", type=int, default=5)
    return p.parse_args(argv)


def ratios(weight_shape, rows, copies, calls, repeats, mkl: bool) -> dict[str, list[float]]:
    """{packed path: [its time / F.linear's time, per row count]}."""
    import torch
    import torch.nn.functional as F

    from admin_ds.inference.packed import PackedLinear

    out_f, in_f = weight_shape
    plain = [(torch.randn(out_f, in_f), torch.randn(out_f)) for _ in range(copies)]
    # few_rows=False: always the packed path (MKL's also keeps the weight, for its shape).
    packed = {"oneDNN": [PackedLinear(w, b, backend="onednn") for w, b in plain]}
    if mkl:
        packed["MKL"] = [PackedLinear(w, b, backend="mkl") for w, b in plain]
    # The weight stored transposed, (in, out) contiguous: MKL's product reads it along its outputs.
    transposed = [(w.t().contiguous(), b) for w, b in plain]
    names = [*packed, "transposed weight"]
    result: dict[str, list[float]] = {name: [] for name in names}
    for n in rows:
        x = torch.randn(n, in_f)
        paths = {"F.linear": lambda: [F.linear(x, w, b) for w, b in plain],
                 "transposed weight": lambda: [torch.addmm(b, x, wt) for wt, b in transposed]}
        paths.update({name: (lambda ps=ps: [p(x) for p in ps]) for name, ps in packed.items()})
        with torch.inference_mode():
            times = interleaved(paths, calls, repeats)
        for name in names:
            result[name].append(statistics.median(times[name]) / statistics.median(times["F.linear"]))
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from admin_ds.inference.packed import packed_linear_available

    if not packed_linear_available():
        print("this PyTorch build has no oneDNN packed linear products; nothing to compare", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    from admin_ds.inference.packed import _mkl_packed_works

    mkl = _mkl_packed_works()
    print(f"# packed / F.linear time per product ({datetime.date.today()}, {args.threads} threads)")
    print(f"- command: python bench/decode_rows.py {' '.join(sys.argv[1:])}")
    print(f"- hardware: {hardware()}")
    print(f"- torch {torch.__version__}; {args.copies} copies of each weight; median of {args.repeats} rounds"
          + ("" if mkl else "; no MKL packed GEMM in this build"))
    shapes = [(s, d) for d in args.widths for s in ((3 * d, d), (d, d), (4 * d, d), (d, 4 * d))]
    results = [ratios(shape, args.rows, args.copies, args.calls, args.repeats, mkl) for shape, _ in shapes]
    for name in results[0]:
        print(f"\n{name if name.startswith('transposed') else name + ' packed'} / F.linear:\n")
        print("| weight (out, in) | MiB | " + " | ".join(f"{n} rows" for n in args.rows) + " |")
        print("|---|---:|" + "---:|" * len(args.rows))
        for ((o, i), _), r in zip(shapes, results):
            print(f"| ({o}, {i}) | {o * i * 4 / 2 ** 20:.2f} | " + " | ".join(f"{v:.2f}" for v in r[name]) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
