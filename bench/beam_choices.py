"""Beam search's choices between two steps (admin_ds/inference/decode.py, ``_beam_choices``), run
compiled against run eagerly, both after the same compiled decoder step, at several batch sizes.

    python bench/beam_choices.py --threads 2

A random base-6L-6L model at --dims (default 256/1024/4, vocabulary --vocab), its decoder step
compiled as translate.py --compile compiles it; each batch is --batches sentences of 10-39 random
subwords, decoded with beam --beam to exactly --length tokens. The two paths differ only in where
the choices run: compiled (at every batch size here, where beam search itself compiles them only
while one sentence is left) or eagerly. Median and best milliseconds per batch of --repeats
interleaved rounds, after two warm-up searches each (the first compiles); the ratio is compiled
/ eager, below 1 where compiling them pays.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from decode import _dims, hardware, interleaved  # noqa: E402  (bench/ is not a package)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", type=_dims, default=_dims("256/1024/4"), help="width/FFN width/heads")
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64])
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--length", type=int, default=32, help="target tokens per sentence (plus EOS)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=9)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from admin_ds.inference import decode
    from admin_ds.inference.packed import optimize_for_decoding
    from admin_ds.model import build_model
    from admin_ds.model.presets import get_preset

    torch.set_num_threads(args.threads)
    cfg = get_preset("base-6L-6L", vocab_size=args.vocab, dropout_p=0.0, attention_dropout_p=0.0,
                     activation_dropout_p=0.0, **args.dims)
    model = optimize_for_decoding(build_model(cfg, seed=1).eval(), "fp32", compile_step=True)
    step = model.compiled_decoder_step
    eager = decode._beam_choices
    compiled = step.compiled(eager)
    limits = dict(beam=args.beam, max_len_a=0.0, max_len_b=args.length, min_len=args.length)

    print(f"# Beam search's choices, compiled / eager ({datetime.date.today()}, {args.threads} threads)\n")
    print(f"- command: python bench/beam_choices.py {' '.join(sys.argv[1:])}")
    print(f"- hardware: {hardware()}")
    print(f"- torch {torch.__version__}; base-6L-6L at {args.dims['model_dim']}/{args.dims['ffn_inner_dim']}/"
          f"{args.dims['num_heads']}, vocabulary {args.vocab}, random weights; beam {args.beam}, "
          f"{args.length} tokens + EOS a sentence; {args.repeats} interleaved rounds\n")
    print("| sentences | compiled ms (median / best) | eager ms (median / best) | compiled / eager (median) |")
    print("|---:|---:|---:|---:|")
    for batch in args.batches:
        g = torch.Generator().manual_seed(batch)
        lens = torch.randint(10, 40, (batch,), generator=g).tolist()
        src = torch.full((batch, max(lens)), cfg.pad_idx, dtype=torch.long)
        for i, n in enumerate(lens):
            src[i, :n] = torch.randint(4, args.vocab, (n,), generator=g)
            src[i, n - 1] = cfg.eos_idx

        def search(choices):
            """Beam search with ``choices`` in place of both of its own (eager and compiled)."""
            saved = decode._beam_choices, decode._compiled
            decode._beam_choices, decode._compiled = choices, (lambda _step, fn: fn)
            try:
                return decode.beam_search(model, src, **limits)
            finally:
                decode._beam_choices, decode._compiled = saved

        paths = {"compiled": lambda: search(compiled), "eager": lambda: search(eager)}
        times = interleaved(paths, calls=1, repeats=args.repeats, warmup=2, alternate=True)
        c, e = (sorted(times[k]) for k in ("compiled", "eager"))
        print(f"| {batch} | {statistics.median(c) * 1e3:.1f} / {c[0] * 1e3:.1f} | "
              f"{statistics.median(e) * 1e3:.1f} / {e[0] * 1e3:.1f} | "
              f"{statistics.median(c) / statistics.median(e):.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
