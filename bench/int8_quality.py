"""What int8 decoding costs in quality and gains in speed: one trained model, one real test set,
fp32 and int8 (translate.py --int8), beam search; sacreBLEU of both, the change, and how many
sentences come out identical.

    python bench/int8_quality.py --model runs/de-en --src test.de --ref test.en --lang-pair de-en
    python bench/int8_quality.py --model avg.pt --src newstest2014.en --ref newstest2014.de \
        --lang-pair en-de --ct2      # CTranslate2 fp32 and int8 on the same weights too

The goal it checks: int8 loses at most 0.3 BLEU. Timings are wall seconds of translate() over the
whole set (encoding and subword included) with --threads torch threads, glibc malloc's thresholds
set as translate.py sets them (admin_ds/inference/allocator.py) for every decoder. --compile adds
fp32 and int8 with a compiled decoder step (translate.py --compile, --int8 --compile), each timed
on a second pass over the set; the first pass, which compiles, is reported beside it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, type=Path, help="run directory or model file")
    p.add_argument("--src", required=True, type=Path)
    p.add_argument("--ref", required=True, type=Path)
    p.add_argument("--lang-pair", required=True, help="SRC-TGT, for sacreBLEU's tokenizer")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--lenpen", type=float, default=0.6)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ct2", action="store_true", help="also CTranslate2 fp32 and int8 (same weights)")
    p.add_argument("--compile", action="store_true", help="also fp32 and int8 with a compiled decoder step")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.ct2:
        # ctranslate2 before torch, as bench/decode.py imports them: the two then share one OpenMP
        # runtime. Imported after torch, CTranslate2 brings its own, and torch's idle threads slow it.
        import ctranslate2
    import torch

    from admin_ds.inference.allocator import tune_malloc_for_decoding
    from admin_ds.inference.model_file import load_for_decoding
    from admin_ds.inference.scoring import read_lines, score
    from admin_ds.inference.translate import translate

    torch.set_num_threads(args.threads)
    tune_malloc_for_decoding()  # as translate.py does; for every decoder in this process
    src, ref = read_lines(args.src), read_lines(args.ref)
    outputs, rows = {}, []
    for precision in ("fp32", "int8"):
        model, subword, mf = load_for_decoding(args.model, precision=precision)
        t0 = time.perf_counter()
        outputs[precision] = translate(model, subword, src, beam=args.beam, lenpen=args.lenpen)
        rows.append((f"admin_ds {precision}", time.perf_counter() - t0, outputs[precision]))
    for precision in ("fp32", "int8") if args.compile else ():
        compiled, _, _ = load_for_decoding(args.model, precision=precision, compile_step=True)
        t0 = time.perf_counter()
        translate(compiled, subword, src, beam=args.beam, lenpen=args.lenpen)
        warm_up = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = translate(compiled, subword, src, beam=args.beam, lenpen=args.lenpen)
        rows.append((f"admin_ds {precision}, compiled step (first pass {warm_up:.0f} s)", time.perf_counter() - t0, out))
    if args.ct2:
        from admin_ds.inference import export

        with tempfile.TemporaryDirectory(prefix="int8_quality_") as tmp:
            export.export_hf_marian(mf, Path(tmp) / "hf")
            export.convert_ct2(Path(tmp) / "hf", Path(tmp) / "ct2")
            eos = subword.piece(model.cfg.eos_idx)  # our sources end in EOS, as in training
            pieces = [[subword.piece(i) for i in ids] + [eos] for ids in subword.encode(src)]
            for compute_type in ("float32", "int8"):
                ct2 = ctranslate2.Translator(str(Path(tmp) / "ct2"), device="cpu", compute_type=compute_type,
                                             inter_threads=1, intra_threads=args.threads)
                t0 = time.perf_counter()
                res = ct2.translate_batch(pieces, beam_size=args.beam, length_penalty=args.lenpen,
                                          max_batch_size=4096, batch_type="tokens")
                out = subword.decode([[subword.id_of(p) for p in r.hypotheses[0]] for r in res])
                rows.append((f"CTranslate2 {compute_type}", time.perf_counter() - t0, out))
    print(f"| decoder | BLEU ({args.lang_pair}, {len(src)} sentences, beam {args.beam}) | seconds | "
          f"sentences/s | identical to admin_ds fp32 |\n|---|---:|---:|---:|---:|")
    bleu = {}
    for name, seconds, out in rows:
        bleu[name] = score(out, ref, args.lang_pair)["bleu"]
        same = sum(a == b for a, b in zip(out, outputs["fp32"]))
        print(f"| {name} | {bleu[name]:.2f} | {seconds:.1f} | {len(src) / seconds:.1f} | {same}/{len(src)} |")
    change = bleu["admin_ds int8"] - bleu["admin_ds fp32"]
    print(f"\nint8 BLEU change: {change:+.2f} ({'within' if change >= -0.3 else 'beyond'} the 0.3 budget)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
