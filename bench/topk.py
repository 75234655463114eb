"""Beam search's top-k over beam x vocabulary: torch.topk against decode._topk (blocks of 64
elements compared by their maxima first), per sentence count, beam and vocabulary size.

    python bench/topk.py --threads 2
    python bench/topk.py --threads 2 --end-to-end --vocab 8000 24000 32000

Each step of beam search takes, per sentence, the top 2 x beam candidates of a (beam x vocabulary)
row of cumulative log-probabilities (decode._beam_search); sampling with --topk takes the top k of
each (vocabulary) row. Inputs are log-softmax rows plus a per-row offset, as in a search. Times are
the median of --repeats interleaved rounds of --calls calls; the table gives both and torch / ours.
Every call's values are checked equal to torch.topk's first.

--end-to-end times whole beam searches instead (decode.beam_search, beam --beams[0]) of a randomly
initialised base-6L-6L with each --vocab, packed as translate.py decodes, over --sentences random
sources of 24 tokens, every hypothesis forced to 32 tokens plus EOS (as bench/decode.py --length
32): as it is, and with its top-k replaced by torch.topk, interleaved; the outputs must be equal.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from decode import hardware, interleaved  # noqa: E402  (bench/ is not a package)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sentences", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--beams", type=int, nargs="+", default=[4, 5])
    p.add_argument("--vocab", type=int, nargs="+", default=[8000, 10000, 32000, 40000])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--end-to-end", action="store_true", help="whole beam searches with either top-k")
    return p.parse_args(argv)


def times(sentences: int, beam: int, vocab: int, calls: int, repeats: int) -> tuple[float, float]:
    """(torch.topk, decode._topk) microseconds per call."""
    import torch

    from admin_ds.inference.decode import _topk

    g = torch.Generator().manual_seed(0)
    lp = torch.randn(sentences * beam, vocab, generator=g).log_softmax(-1) - torch.rand(sentences * beam, 1, generator=g)
    flat = lp.view(sentences, beam * vocab)
    k = 2 * beam
    if not torch.equal(_topk(flat, k)[0], flat.topk(k, dim=1).values):
        raise AssertionError(f"values differ at {sentences} x {beam} x {vocab}")
    paths = {"torch": lambda: flat.topk(k, dim=1), "ours": lambda: _topk(flat, k)}
    with torch.inference_mode():
        measured = interleaved(paths, calls, repeats)
    return statistics.median(measured["torch"]) * 1e6, statistics.median(measured["ours"]) * 1e6


def searches(vocab: int, sentences: list[int], beam: int, repeats: int) -> list[tuple[int, float, float]]:
    """[(sentences, seconds with torch.topk, seconds with decode._topk)]: medians of interleaved
    whole beam searches."""
    from unittest import mock

    import torch

    from admin_ds.inference import decode
    from admin_ds.inference.packed import optimize_for_decoding
    from admin_ds.model import build_model
    from admin_ds.model.presets import get_preset

    torch.manual_seed(1)
    cfg = get_preset("base-6L-6L", vocab_size=vocab, dropout_p=0.0, attention_dropout_p=0.0,
                     activation_dropout_p=0.0)
    model = optimize_for_decoding(build_model(cfg), "fp32")
    g = torch.Generator().manual_seed(0)
    rows = []
    for n in sentences:
        src = torch.randint(4, vocab, (n, 24), generator=g)
        src[:, -1] = cfg.eos_idx
        paths = {"torch": lambda x, k: x.topk(k, dim=1), "ours": decode._topk}
        measured: dict[str, list[float]] = {name: [] for name in paths}
        outputs = {}
        for _ in range(repeats):
            for name, topk in paths.items():
                with mock.patch.object(decode, "_topk", topk):
                    t = time.perf_counter()
                    out = decode.beam_search(model, src, beam=beam, max_len_a=0, max_len_b=32, min_len=32)
                    measured[name].append(time.perf_counter() - t)
                outputs[name] = [h[0].tokens for h in out]
        if outputs["torch"] != outputs["ours"]:
            raise AssertionError(f"outputs differ at vocabulary {vocab}, {n} sentences")
        rows.append((n, statistics.median(measured["torch"]), statistics.median(measured["ours"])))
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    if args.end_to_end:
        print(f"# beam search with torch.topk / with decode._topk ({datetime.date.today()}, {args.threads} threads)")
        print(f"- command: python bench/topk.py {' '.join(sys.argv[1:])}")
        print(f"- hardware: {hardware()}")
        print(f"- torch {torch.__version__}; random base-6L-6L, beam {args.beams[0]}, 32 tokens + EOS per "
              f"sentence; median of {args.repeats} interleaved rounds; outputs equal\n")
        print("| vocabulary | sentences | torch.topk (s) | _topk (s) | torch / ours |")
        print("|---:|---:|---:|---:|---:|")
        for v in args.vocab:
            for n, t, o in searches(v, args.sentences, args.beams[0], args.repeats):
                print(f"| {v:,} | {n} | {t:.3f} | {o:.3f} | {t / o:.2f}x |", flush=True)
        return 0
    print(f"# beam search's top-k: torch.topk / decode._topk ({datetime.date.today()}, {args.threads} threads)")
    print(f"- command: python bench/topk.py {' '.join(sys.argv[1:])}")
    print(f"- hardware: {hardware()}")
    print(f"- torch {torch.__version__}; median of {args.repeats} rounds of {args.calls} calls; "
          "top 2 x beam of (sentences, beam x vocabulary)\n")
    print("| sentences | beam | vocabulary | torch.topk (us) | _topk (us) | torch / ours |")
    print("|---:|---:|---:|---:|---:|---:|")
    for s in args.sentences:
        for b in args.beams:
            for v in args.vocab:
                t, o = times(s, b, v, args.calls, args.repeats)
                print(f"| {s} | {b} | {v:,} | {t:,.1f} | {o:,.1f} | {t / o:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
