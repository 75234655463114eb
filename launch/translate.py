"""Translate raw text with a trained model; detokenized translations on stdout, in input order.

    python launch/translate.py --checkpoint runs/x --input newstest2014.en > out.de
    python launch/translate.py --checkpoint runs/x/checkpoints/update_001000 --input - < src.txt
    python launch/translate.py --checkpoint avg.pt --input src.txt --beam 5 --lenpen 1.0 --nbest 5
    python launch/translate.py --checkpoint avg.pt --input src.txt --method sample --topk 10
    python launch/translate.py --checkpoint avg.pt --input src.txt --fold --dtype bf16 --device cuda
    torchrun --nproc_per_node 8 launch/translate.py --checkpoint avg.pt --input src.txt > out.de

--checkpoint is a run directory (its newest complete checkpoint), one checkpoint tag directory
(``checkpoints/update_NNNNNN``) or a model file (launch/average_checkpoints.py). --fold decodes with
omega folded away (admin_ds/model/fold.py): the same translations from a vanilla Post-LN model.
--int8 (CPU) decodes with int8 linear layers (admin_ds/inference/int8.py): weights quantized per
output row, activations per product (dynamic quantization, as CTranslate2's int8); faster, and no
longer bit-exact (BENCHMARKS.md: the BLEU change). For serving, export the model to
CTranslate2 (launch/export.py).

Output: one line per input line (an empty line gives an empty line). With --nbest N > 1: N lines
``i<TAB>score<TAB>text`` per input line, i the 0-based input line, best first, score fairseq's
length-normalized log-probability (an empty input line gives one line with score 0 and no text).

Several ranks (WORLD_SIZE > 1, from torchrun or the deepspeed launcher): each rank translates a
contiguous shard of the input, and rank 0 gathers the shards and writes everything in input order.
Sampling seeds rank r with --seed + r.
"""

import argparse
import sys
import time

from admin_ds import logs
from admin_ds.arguments import checkpoint_tag, existing_path, float_in, input_file, int_in
from admin_ds.inference.limits import add_limit_arguments, check_decoding_arguments


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, type=existing_path, help="run dir, checkpoint tag dir or model file")
    p.add_argument("--tag", type=checkpoint_tag,
                   help="checkpoint tag in a run dir (default: the newest complete one)")
    p.add_argument("--input", required=True, type=input_file, help="raw text file, one sentence per line; - for stdin")
    p.add_argument("--method", choices=("beam", "greedy", "sample"), default="beam")
    p.add_argument("--beam", type=int_in(1), default=4)
    p.add_argument("--lenpen", type=float_in(), default=0.6)
    p.add_argument("--nbest", type=int_in(1), default=1, help="hypotheses per sentence (beam only)")
    p.add_argument("--max-len-a", type=float_in(0), default=1.2, help="max output length a * src_len + b")
    p.add_argument("--max-len-b", type=int_in(0), default=10)
    p.add_argument("--min-len", type=int_in(0), default=1)
    p.add_argument("--unk-penalty", type=float_in(), default=0.0)
    p.add_argument("--topk", type=int_in(0), default=0, help="sampling: the k most likely tokens (0: all)")
    p.add_argument("--topp", type=float_in(0, 1, low_open=True), default=1.0,
                   help="sampling: the nucleus of this probability mass, in (0, 1] (1: all)")
    p.add_argument("--temperature", type=float_in(0, low_open=True), default=1.0)
    p.add_argument("--seed", type=int, default=1, help="sampling seed (rank r uses seed + r)")
    p.add_argument("--max-tokens", type=int_in(1), default=4096, help="source tokens per batch (n x longest)")
    add_limit_arguments(p)
    p.add_argument("--fold", action="store_true", help="fold omega into the weights first")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available")
    p.add_argument("--int8", action="store_true",
                   help="CPU: dynamic int8 linear layers (admin_ds/inference/int8.py); needs --dtype fp32")
    p.add_argument("--quiet", action="store_true", help="no progress (a bar on a terminal, else a line per tenth)")
    p.add_argument("--trust-unverified", action="store_true",
                   help="accept a checkpoint or model file written without digests (an older version)")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    args = p.parse_args(argv)
    if args.nbest > 1 and args.method != "beam":
        p.error("--nbest > 1 needs --method beam")
    if args.nbest > args.beam:
        p.error(f"--nbest {args.nbest} exceeds --beam {args.beam}")
    if args.int8 and (args.dtype != "fp32" or args.device == "cuda"):
        p.error("--int8 decodes on the CPU from fp32 weights: drop --dtype and --device cuda")
    check_decoding_arguments(p, args)
    return args


def read_input(path: str, rank: int) -> list[str]:
    """Rank 0 reads the input (stdin reaches only one process) and shares it, or the error, with
    every rank, so that all of them stop on a bad input instead of waiting for rank 0."""
    from admin_ds import distributed
    from admin_ds.inference.scoring import read_lines

    lines = error = None
    if rank == 0:
        try:
            lines = read_lines(path)
        except (OSError, ValueError) as e:
            error = str(e)
    lines, error = distributed.broadcast_object((lines, error))
    if error:
        raise ValueError(error)
    return lines


def translate_shard(model, subword, lines: list[str], args, seed: int, progress, first: int = 0) -> list[str]:
    """Output lines (formatted for stdout) for ``lines``, in their order; ``first`` is the input
    line number of ``lines[0]`` (a rank's shard starts mid-input)."""
    from admin_ds.inference.translate import translate, translate_nbest

    search = dict(max_len_a=args.max_len_a, max_len_b=args.max_len_b, unk_penalty=args.unk_penalty,
                  min_len=args.min_len)
    if args.nbest > 1:
        nbest = translate_nbest(model, subword, lines, beam=args.beam, nbest=args.nbest, lenpen=args.lenpen,
                                max_tokens=args.max_tokens, progress=progress.update, **search)
        return [f"{first + i}\t{score:.6g}\t{text}" for i, hyps in enumerate(nbest) for score, text in hyps]
    if args.method == "sample":
        search.update(topk=args.topk, topp=args.topp, temperature=args.temperature, seed=seed)
    return translate(model, subword, lines, method=args.method, beam=args.beam, lenpen=args.lenpen,
                     max_tokens=args.max_tokens, progress=progress.update, **search)


def main(argv=None) -> int:
    # Translations go to the real stdout; everything else (DeepSpeed's logger binds sys.stdout when
    # it is first imported, zero_to_fp32 prints) is sent to stderr.
    results = sys.stdout
    sys.stdout = sys.stderr
    args = parse_args(argv)
    logs.quiet_known_warnings()
    import torch

    from admin_ds import distributed
    from admin_ds.errors import UserError
    from admin_ds.inference.model_file import load_for_decoding

    device = args.device or ("cuda" if torch.cuda.is_available() and not args.int8 else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda: no CUDA device is available", file=sys.stderr)
        return 2
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    with distributed.session(device) as (rank, world):
        try:
            if device == "cuda":
                device = f"cuda:{torch.cuda.current_device()}"
            lines = read_input(str(args.input), rank)
            model, subword, _ = load_for_decoding(args.checkpoint, args.tag, device, dtype, fold=args.fold,
                                                  trust_unverified=args.trust_unverified,
                                                  precision="int8" if args.int8 else "fp32")
        except (UserError, NotImplementedError, ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

        start, end = len(lines) * rank // world, len(lines) * (rank + 1) // world
        t0 = time.perf_counter()
        with logs.progress(end - start, "translate", disable=args.quiet or rank != 0) as progress:
            outputs = translate_shard(model, subword, lines[start:end], args, args.seed + rank, progress, start)
        parts = distributed.gather_object(outputs)
        if rank == 0:
            results.buffer.write("".join(f"{line}\n" for part in parts for line in part).encode("utf-8"))
            results.flush()
            print(f"[translate] {len(lines)} sentences in {time.perf_counter() - t0:.2f}s on {world} rank(s), "
                  f"{args.method}{f' {args.beam}' if args.method == 'beam' else ''}, {'int8' if args.int8 else args.dtype}"
                  f"{', folded' if args.fold else ''}; model {args.checkpoint}",
                  file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
