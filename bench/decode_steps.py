"""What a decoder step costs, and what a batch costs once, ours against CTranslate2, by batch size.

    CT2_USE_MKL=0 python bench/decode_steps.py --model runs/multi30k_en_de_admin/avg2.pt \
        --src data/multi30k_en_de/test.en

bench/decode.py times whole searches, whose sentences end at different lengths: its ratio to
CTranslate2 mixes what a step costs at the batch's row count with what the batch costs once (the
encoder, the first step, setting the search up) and with the steps of few rows left when most
sentences have ended. Here both decoders are forced to the same number of tokens (as
bench/decode.py --length does), twice: the two --lengths, short and long. The difference between
the two runs is what (long - short) steps cost at the batch's full row count (sentences x beams);
the short run less its short + 1 steps (EOS included) at that cost is the batch's fixed cost: the
encoder, the set-up, and whatever the first step costs beyond a later one. The split assumes a
step costs the same at every position, and it does not: a step's figure is the mean over the
positions between the two lengths, and where steps grow dearer with the position, the fixed cost
comes out too low, even below zero (CTranslate2's with beam 4, BENCHMARKS.md).

Ours is translate.py --compile's model (with --eager, the uncompiled one as well), CTranslate2
float32 on the same weights (exported as bench/decode.py exports them), one padded batch of the
first B sentences of --src for each of --batches, greedy and beam --beam; best of --repeats
interleaved rounds after a warm-up (which compiles), the median in brackets. The long runs'
outputs are compared with CTranslate2's, their first --lengths LONG tokens (CTranslate2 stops at
LONG + 1 tokens without forcing the last to be EOS, as in bench/decode.py). The report is appended to --out with the command, date
and hardware.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
import decode as bench_decode  # noqa: E402  (bench/ is not a package)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_decode.trained_model_arguments(p)
    p.add_argument("--batches", type=bench_decode._positive, nargs="+", default=[1, 16, 64])
    p.add_argument("--lengths", type=bench_decode._positive, nargs=2, default=[8, 32], metavar=("SHORT", "LONG"),
                   help="target tokens per sentence (plus EOS) of the short and the long run")
    p.add_argument("--beam", type=bench_decode._positive, default=4)
    p.add_argument("--threads", type=bench_decode._positive, default=2)
    p.add_argument("--repeats", type=bench_decode._positive, default=5)
    p.add_argument("--eager", action="store_true", help="also the uncompiled model (translate.py without --compile)")
    p.add_argument("--out", type=Path, default=REPO / "bench/decode_steps_results.md")
    args = p.parse_args(argv)
    if args.lengths[0] >= args.lengths[1]:
        p.error(f"--lengths {args.lengths[0]} {args.lengths[1]}: the short run's length must be below the long run's")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import ctranslate2  # before torch: one OpenMP runtime for both (bench/decode.py)
    import torch

    from admin_ds.inference.allocator import tune_malloc_for_decoding
    from admin_ds.inference.model_file import build_from_model_file

    torch.set_num_threads(args.threads)
    tune_malloc_for_decoding()  # as translate.py decodes
    short, long = args.lengths
    rows = []
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        mf, lines = bench_decode.build(args, Path(tmp))
        ours = bench_decode.models(mf, "fp32", plain=False, onednn=False, compiled=True)
        if not args.eager:
            ours.pop("admin_ds")
        subword = build_from_model_file(mf)[1]
        cfg = next(iter(ours.values())).cfg
        for b in args.batches:
            src = bench_decode.source_batch(subword, cfg, lines[:b])
            paths = {}
            for length in (short, long):
                forced = types.SimpleNamespace(length=length, max_len=length, beam=args.beam, transformers=False)
                runs = bench_decode.decoders(forced, args.threads, "fp32", ours, subword, [src],
                                             Path(tmp) / "hf", Path(tmp) / "ct2")
                paths.update({(engine, beam, length): run for (engine, beam), run in runs.items()})
            outputs = {key: run() for key, run in paths.items() if key[2] == long}  # also a warm-up
            times = bench_decode.interleaved(paths, calls=1, repeats=args.repeats, alternate=True)
            for beam in (1, args.beam):
                want = outputs["ctranslate2", beam, long]
                for engine in [*ours, "ctranslate2"]:
                    cost = {}
                    for stat in (min, statistics.median):
                        t_short, t_long = stat(times[engine, beam, short]), stat(times[engine, beam, long])
                        step = (t_long - t_short) / (long - short)
                        cost[stat] = step, t_short - (short + 1) * step
                    same = sum(a[:long] == w[:long] for a, w in zip(outputs[engine, beam, long], want))
                    rows.append((b, beam, engine, cost, f"{same}/{len(want)}"))
                    print(b, beam, engine, cost[min], flush=True)
    names = {"admin_ds_compiled": "ours, compiled", "admin_ds": "ours, eager", "ctranslate2": "CTranslate2"}
    table = [("| sentences | search | rows | decoder | ms a step | ms once a batch | CTranslate2's step / ours | "
              "outputs equal to CTranslate2's |"), "|---:|---|---:|---|---:|---:|---:|---|"]
    ct2 = {(b, beam): cost for b, beam, engine, cost, _ in rows if engine == "ctranslate2"}
    for b, beam, engine, cost, same in rows:
        (step, fixed), (step_med, fixed_med) = cost[min], cost[statistics.median]
        ratio = ct2[b, beam][min][0] / step
        ratio_med = ct2[b, beam][statistics.median][0] / step_med
        table.append(f"| {b} | {'greedy' if beam == 1 else f'beam {beam}'} | {b * beam} | {names[engine]} | "
                     f"{step * 1e3:.2f} [{step_med * 1e3:.2f}] | {fixed * 1e3:.1f} [{fixed_med * 1e3:.1f}] | "
                     f"{ratio:.2f}x [{ratio_med:.2f}x] | {same if engine != 'ctranslate2' else ''} |")
    report = ["# A decoder step and a batch's fixed cost against CTranslate2 (bench/decode_steps.py)", "",
              f"- command: `python bench/decode_steps.py {' '.join(sys.argv[1:] if argv is None else argv)}`",
              f"- date: {datetime.date.today().isoformat()}; hardware: {bench_decode.hardware()}",
              (f"- torch {torch.__version__}, ctranslate2 {ctranslate2.__version__}, {args.threads} threads; "
               f"every decoder forced to {short} and to {long} tokens plus EOS; best of {args.repeats} "
               "interleaved rounds, the median's figure in brackets"),
              ("- ms a step: (long run - short run) / (long - short), at the batch's full row count; ms once a "
               f"batch: the short run less {short + 1} such steps"), "", *table, ""]
    print("\n".join(report))
    bench_decode.append_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
