"""Decoding speed on CPU: admin_ds.inference.decode vs CTranslate2 (and optionally transformers'
generate), same weights, fp32 and int8, at several batch sizes.

    python bench/decode.py --batches 1 16 64 --threads 2 --precisions fp32 int8 --repeats 5 --profile
    python bench/decode.py --model runs/de-en --src ../shared/data/wmt14/en-de/newstest2014.de --length 0
    python bench/decode.py --batches 16 --length 32 --transformers --out /tmp/decode.md
    python bench/decode.py --model runs/de-en --src test.de --ref test.en --lang-pair de-en --length 0 \
        --batches 64 --sentences 1000      # and the BLEU of each decoder: what int8 costs

The model is --model (a run directory or model file: real output lengths, --length 0) or, by
default, a randomly initialised base-6L-6L (Transformer-base, 512/2048/8 heads, 6+6 layers) over a
joint SentencePiece vocabulary of --vocab pieces trained on the fly on WMT newstest2013/2014 en+de
(../shared/data/wmt14/en-de beside the repository; the benchmark skips when it is absent). Sources
are the first --sentences sentences of --src (newstest2014.en), decoded in consecutive batches of each
of --batches (each batch padded on its own): the same sentences at every batch size. The model goes
through launch/export.py's path (folded, exported to a MarianMTModel directory, converted to
CTranslate2), so the decoders run the same weights; int8 is ours (translate.py --int8) against
CTranslate2's compute_type int8, both quantizing the same float32 weights at load.

--length L > 0 forces every decoder to the same work: exactly L tokens plus EOS per sentence (ours:
min_len = max_len_b = L with EOS forced at step L; transformers: min_new_tokens = max_new_tokens =
L + 1; CTranslate2: min_decoding_length = max_decoding_length = L + 1): random weights would
otherwise end hypotheses at arbitrary lengths. --length 0: every decoder stops at EOS or at
--max-len tokens (a trained --model). Throughput: sentences/s and target tokens/s (each decoder's own
output tokens, EOS included); best of --repeats interleaved rounds after one warm-up. CPU, the same
intra-op thread count for all (torch.set_num_threads; CTranslate2 intra_threads, inter_threads=1),
for each of --threads. The report records the CPU's instruction-set flags: the ratio to CTranslate2
moves with them (its backend: MKL/oneDNN on Intel, others elsewhere). --profile adds a
torch.profiler breakdown of our beam search. --save-model PATH writes the random model as a model
file and stops: launch/translate.py then runs the benchmark's model end to end. --ref (with a
trained --model and --length 0) adds the sacreBLEU of every decoder's beam output at the first of
--batches, and the change int8 makes to ours (the goal: at most 0.3 BLEU lost).

A CPU with fewer instructions can be stood in for on this one by limiting both libraries (recorded
in the report), e.g. an AVX2-only CPU (AMD EPYC before Zen 4), with CTranslate2 off MKL as on AMD:

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
    CT2_FORCE_CPU_ISA=AVX2 CT2_USE_MKL=0 python bench/decode.py ...

It is the instruction set, not the other CPU (caches, clocks, memory differ).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared/data/wmt14/en-de"
# The instruction-set extensions that decide which kernels either library runs.
_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
# Environment variables that make each library use less of the CPU than it has (to stand in for a
# CPU without those instructions): torch's own kernels, oneDNN (in torch and in CTranslate2), MKL,
# CTranslate2's kernels and its choice of MKL (it uses MKL only on Intel CPUs by default).
_ISA_LIMITS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "CT2_FORCE_CPU_ISA",
               "CT2_USE_MKL")


def _dims(text: str) -> dict:
    try:
        d, f, h = (int(v) for v in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give width/FFN width/heads, e.g. 256/1024/4") from None
    return dict(model_dim=d, ffn_inner_dim=f, num_heads=h)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of at least 1")
    return int(text)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="run directory or model file (default: a random --preset)")
    p.add_argument("--src", type=Path, default=DATA / "newstest2014.en", help="source sentences, one per line")
    p.add_argument("--preset", default="base-6L-6L")
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--dims", type=_dims, help="the random model's width/FFN width/heads instead of the "
                   "--preset's, e.g. 256/1024/4 (the Multi30k recipe's)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64], help="sentences per batch")
    p.add_argument("--sentences", type=_positive, help="sentences decoded per round at every batch size, in "
                   "consecutive batches (default: the largest of --batches), so that each batch size times "
                   "the same sentences and a one-sentence batch is not timed on a single sentence")
    p.add_argument("--length", type=int, default=32, help="target tokens per sentence (plus EOS); 0: up to EOS")
    p.add_argument("--max-len", type=int, default=128, help="--length 0: the most tokens per sentence")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--threads", type=int, nargs="+", default=[2], help="intra-op thread counts to measure")
    p.add_argument("--precisions", nargs="+", choices=("fp32", "int8"), default=["fp32", "int8"])
    p.add_argument("--transformers", action="store_true", help="also transformers' generate (fp32)")
    p.add_argument("--ref", type=Path, help="references of --src: also each decoder's BLEU (needs --length 0)")
    p.add_argument("--lang-pair", default="en-de", help="SRC-TGT, for sacreBLEU's tokenizer (with --ref)")
    p.add_argument("--save-model", type=Path, metavar="PATH",
                   help="write the random model (--preset, --dims, --vocab) to PATH as a model file for "
                        "launch/translate.py, and stop")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="torch.profiler breakdown of our beam search")
    p.add_argument("--out", default="decode_results.md", help="the report (markdown)")
    p.add_argument("--append", action="store_true", help="add the report after those already in --out "
                   "(default: replace the file)")
    args = p.parse_args(argv)
    if args.save_model and args.model:
        p.error("--save-model writes the random model: drop --model")
    if args.ref and args.length != 0:
        p.error("--ref scores real translations: add --length 0 (and a trained --model)")
    return args


def hardware() -> str:
    model = platform.processor() or "unknown CPU"
    flags: list[str] = []
    family_model: list[str] = []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == (platform.processor() or "unknown CPU"):
                model = line.split(":", 1)[1].strip()
            if line.startswith(("cpu family", "model\t")) and not flags:  # AMD names no generation
                family_model.append(line.split(":", 1)[1].strip())
            if line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1].split()
    except OSError:
        pass
    have = " ".join(f for f in _FLAGS if f in flags) or "none of " + " ".join(_FLAGS)
    if len(family_model) == 2:
        model += f" (family {family_model[0]}, model {family_model[1]})"
    text = (f"{model}, {os.cpu_count()} logical CPUs visible, {platform.system()} {platform.release()}; "
            f"flags: {have}")
    if limits := {k: os.environ[k] for k in _ISA_LIMITS if os.environ.get(k)}:
        import torch

        text += (f"; backend and instruction-set settings: {', '.join(f'{k}={v}' for k, v in limits.items())} "
                 f"(torch's kernels: {torch.backends.cpu.get_cpu_capability()})")
    return text


def random_model(args, tmp: Path):
    """The randomly initialised --preset (or --dims) model with a --vocab SentencePiece vocabulary
    trained on WMT newstest2013/2014 en+de (in ``tmp``), both seeded: the same model every time."""
    import torch

    from admin_ds.data.subword import train_subword_model
    from admin_ds.inference.model_file import ModelFile
    from admin_ds.model import build_model
    from admin_ds.model.presets import get_preset

    files = [DATA / f"newstest{y}.{lang}" for y in (2013, 2014) for lang in ("en", "de")]
    spm = train_subword_model(files, tmp / "spm", vocab_size=args.vocab, seed=1, num_threads=2)
    torch.manual_seed(1)
    cfg = get_preset(args.preset, vocab_size=args.vocab, dropout_p=0.0, attention_dropout_p=0.0,
                     activation_dropout_p=0.0, **(args.dims or {}))
    return ModelFile(cfg, build_model(cfg).state_dict(), None, None, spm.read_bytes(), {"source": "bench"})


def build(args, tmp: Path):
    """(ModelFile, src lines) with the model exported to tmp/hf and tmp/ct2 (float32)."""
    from admin_ds.inference import export
    from admin_ds.inference.model_file import load_any

    mf = load_any(args.model) if args.model is not None else random_model(args, tmp)
    export.export_hf_marian(mf, tmp / "hf")
    export.convert_ct2(tmp / "hf", tmp / "ct2")
    lines = [l for l in args.src.read_text(encoding="utf-8").splitlines() if l.strip()]
    return mf, lines


def models(mf, precision: str):
    """{"admin_ds": model} decoding as translate.py does in ``precision``."""
    from admin_ds.inference.int8 import quantize_for_decoding
    from admin_ds.inference.model_file import build_from_model_file

    model = build_from_model_file(mf)[0].eval()
    return {"admin_ds": quantize_for_decoding(model) if precision == "int8" else model}


def source_batch(subword, cfg, lines: list[str]):
    import torch

    ids = [x[:cfg.max_positions - 1] + [cfg.eos_idx] for x in subword.encode(lines)]
    src = torch.full((len(ids), max(map(len, ids))), cfg.pad_idx, dtype=torch.long)
    for i, x in enumerate(ids):
        src[i, :len(x)] = torch.tensor(x)
    return src


def decoders(args, threads: int, precision: str, ours: dict, subword, srcs: list, hf_dir: Path, ct2_dir: Path):
    """{(engine, beam): run() -> output token ids per sentence (the final EOS included)}: each run
    decodes the batches ``srcs`` one after another."""
    import ctranslate2
    import torch

    from admin_ds.inference.decode import beam_search, greedy

    cfg = next(iter(ours.values())).cfg
    eos, pad, K = cfg.eos_idx, cfg.pad_idx, args.beam
    forced = args.length > 0
    L = args.length if forced else args.max_len
    limits = dict(max_len_a=0, max_len_b=L, min_len=L if forced else 1)
    ct2 = ctranslate2.Translator(str(ct2_dir), device="cpu", compute_type={"fp32": "float32"}.get(precision, precision), inter_threads=1,
                                 intra_threads=threads)
    pieces = [[[subword.piece(i) for i in row if i != pad] for row in src.tolist()] for src in srcs]

    def admin_ds(m, beam):
        if beam == 1:
            return [h + [eos] for src in srcs for h in greedy(m, src, **limits)]
        return [h[0].tokens + [eos] for src in srcs for h in beam_search(m, src, beam=beam, **limits)]

    def ctranslate2_(beam):
        res = [r for batch in pieces
               for r in ct2.translate_batch(batch, beam_size=beam, min_decoding_length=L + 1 if forced else 0,
                                            max_decoding_length=L + 1, return_end_token=True, max_batch_size=0)]
        return [[subword.id_of(p) for p in r.hypotheses[0]] for r in res]

    engines = [(name, lambda beam, m=m: admin_ds(m, beam)) for name, m in ours.items()]
    engines.append(("ctranslate2", ctranslate2_))
    if args.transformers and precision == "fp32":
        from transformers import MarianMTModel

        hf = MarianMTModel.from_pretrained(str(hf_dir)).eval()

        def transformers_(beam):
            rows = []
            for src in srcs:
                with torch.inference_mode():
                    out = hf.generate(input_ids=src, attention_mask=src.ne(pad), num_beams=beam, do_sample=False,
                                      min_new_tokens=L + 1 if forced else 0, max_new_tokens=L + 1)
                rows += [[t for t in row[1:] if t != pad] for row in out.tolist()]  # minus the start token
            return rows

        engines.append(("transformers", transformers_))
    return {(name, beam): (lambda fn=fn, beam=beam: fn(beam)) for name, fn in engines for beam in (1, K)}


def interleaved(paths: dict, calls: int, repeats: int, warmup: int = 1,
                alternate: bool = False) -> dict[str, list[float]]:
    """{name: seconds per call, one entry per round} of each zero-argument callable in ``paths``:
    ``warmup`` calls each, then ``repeats`` rounds in which every path runs ``calls`` times in turn
    (``alternate``: in reverse order every other round, so that neither always runs first)."""
    times: dict[str, list[float]] = {name: [] for name in paths}
    for f in paths.values():
        for _ in range(warmup):
            f()
    names = list(paths)
    for r in range(repeats):
        for name in (names[::-1] if alternate and r % 2 else names):
            t = time.perf_counter()
            for _ in range(calls):
                paths[name]()
            times[name].append((time.perf_counter() - t) / calls)
    return times


# torch.profiler operator names -> what they are in a decoder step
_CATEGORIES = [
    ("matrix products (Linear, output projection)", ("aten::addmm", "aten::mm", "mkldnn::_linear_pointwise",
                                                     "mkl::_mkl_linear", "quantized::linear_dynamic")),
    ("attention products (queries against cached keys and values)", ("aten::bmm",)),
    ("attention kernel (fused; softmax)", ("aten::_scaled_dot_product", "aten::scaled_dot_product", "aten::_softmax",
                                          "aten::baddbmm")),
    ("LayerNorm", ("aten::native_layer_norm",)),
    ("KV cache growth and beam reorder (cat, index_select, copies)", ("aten::cat", "aten::index_select", "aten::copy_",
                                                                      "aten::index", "aten::gather")),
    ("log-softmax, top-k, search bookkeeping", ("aten::_log_softmax", "aten::topk", "aten::sort", "aten::argmax",
                                                "aten::max")),
]


def profile_search(fn) -> tuple[str, dict, float]:
    """(top-operator table, {category: share of wall time}, wall seconds) of one call of ``fn``.
    The operators' self CPU time over the wall time; what is left is Python and dispatch between
    operators (and, with several threads, the time operators run in parallel counts once)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        fn()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    total = wall * 1e6
    shares = {name: sum(e.self_cpu_time_total for e in events if e.key.startswith(prefixes)) / total
              for name, prefixes in _CATEGORIES}
    ops = sum(e.self_cpu_time_total for e in events) / total
    shares["other operators (elementwise, views, LayerNorm-free glue)"] = ops - sum(shares.values())
    shares["between operators (Python, dispatch)"] = 1.0 - ops
    return events.table(sort_by="self_cpu_time_total", row_limit=12), shares, wall


def measure(args, runs) -> tuple[dict, dict]:
    """({(engine, beam): [seconds per round]}, {(engine, beam): outputs}): a warm-up (which checks
    the forced length), then --repeats rounds, interleaved so that a busy moment of the machine hits
    every decoder alike."""
    outputs = {}
    for key, run in runs.items():
        outputs[key] = run()
        if args.length > 0:
            steps = [len(h) for h in outputs[key]]
            if set(steps) != {args.length + 1}:
                raise RuntimeError(f"{key}: decoder steps {steps}, expected {args.length + 1} each")
    times = {key: [] for key in runs}
    for _ in range(args.repeats):
        for key, run in runs.items():
            t0 = time.perf_counter()
            run()
            times[key].append(time.perf_counter() - t0)
    return times, outputs


def rows_for(args, label: str, times: dict, outputs: dict, n: int) -> list[str]:
    """One table row per search: sentences/s and tokens/s of every engine, ours / CTranslate2, and
    how many sentences each other engine outputs exactly as ours does (first L tokens when forced:
    CTranslate2 stops at L + 1 tokens without forcing the last to be EOS)."""
    rows = []
    engines = sorted({e for e, _ in times}, key=lambda e: (e != "admin_ds", e))
    for beam in (1, args.beam):
        cells = []
        for e in engines:
            best = min(times[(e, beam)])
            toks = sum(map(len, outputs[(e, beam)]))
            cells.append(f"{e} {n / best:,.1f} sent/s, {toks / best:,.0f} tok/s")
        ours, ct2 = min(times[("admin_ds", beam)]), min(times[("ctranslate2", beam)])
        cut = args.length if args.length > 0 else None
        ref = outputs[("admin_ds", beam)]
        agree = [f"{e} {sum(a[:cut] == b[:cut] for a, b in zip(ref, outputs[(e, beam)]))}/{n}"
                 for e in engines if e != "admin_ds"]
        ratio = f"**{ct2 / ours:.2f}x**"
        rows.append(f"| {label} | {'greedy' if beam == 1 else f'beam {beam}'} | {ratio} | "
                    f"{'; '.join(cells)} | {'; '.join(agree)} | "
                    f"{' / '.join(f'{statistics.median(times[(e, beam)]):.3f}' for e in engines)} |")
    return rows


def bleu_table(args, quality: dict, subword, sentences: list[str], eos: int) -> str:
    """Markdown: sacreBLEU of each decoder's beam output against the first len(sentences) lines of
    --ref, how many outputs equal ours in fp32, and the change int8 makes to ours."""
    from admin_ds.inference.scoring import read_lines, score

    ref = read_lines(args.ref)[:len(sentences)]
    text = {key: subword.decode([[t for t in ids if t != eos] for ids in out]) for key, out in quality.items()}
    bleu = {key: score(out, ref, args.lang_pair)["bleu"] for key, out in text.items()}
    base = text.get(("admin_ds", "fp32"))
    lines = [f"\n## Quality (beam {args.beam}, {len(ref)} sentences, {args.lang_pair})\n",
             "| decoder | precision | BLEU | identical to ours in fp32 |", "|---|---|---:|---:|"]
    for (engine, precision), value in bleu.items():
        same = "" if base is None else f"{sum(a == b for a, b in zip(text[(engine, precision)], base))}/{len(ref)}"
        lines.append(f"| {engine} | {precision} | {value:.2f} | {same} |")
    if ("admin_ds", "fp32") in bleu and ("admin_ds", "int8") in bleu:
        change = bleu[("admin_ds", "int8")] - bleu[("admin_ds", "fp32")]
        lines.append(f"\nint8 BLEU change: {change:+.2f} ({'within' if change >= -0.3 else 'beyond'} the 0.3 budget)")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.src.is_file() or (args.model is None and not (DATA / "newstest2014.en").is_file()):
        print(f"skipped: {args.src} or {DATA} not found (the benchmark decodes real WMT sentences)")
        return 0
    if args.save_model:
        from admin_ds.inference.model_file import save_model_file

        with tempfile.TemporaryDirectory(prefix="bench_decode_") as tmp:
            mf = random_model(args, Path(tmp))
            save_model_file(args.save_model, mf.model_config, mf.state_dict, None, None, mf.subword_model_bytes, mf.meta)
        print(f"wrote {args.save_model}")
        return 0
    # ctranslate2 before torch: the two then share one OpenMP runtime. Imported the other way round
    # each brings its own, whose idle threads spin while the other library runs: on the 2-core Xeon
    # both decoders ran ~3x slower (batch 1 greedy: CTranslate2 0.28 s against 0.09 s).
    import ctranslate2
    import torch
    import transformers

    from admin_ds.inference.model_file import build_from_model_file

    transformers.logging.set_verbosity_error()  # generate's notes on max_length vs max_new_tokens
    load_before = os.getloadavg()
    rows, profile, quality = [], None, {}
    with tempfile.TemporaryDirectory(prefix="bench_decode_") as tmp:
        torch.set_num_threads(args.threads[0])
        mf, lines = build(args, Path(tmp))
        sentences = lines[:args.sentences or max(args.batches)]
        _, subword = build_from_model_file(mf)
        for precision in args.precisions:
            ours = models(mf, precision)
            cfg = ours["admin_ds"].cfg
            for threads in args.threads:
                torch.set_num_threads(threads)
                for n in args.batches:
                    srcs = [source_batch(subword, cfg, sentences[i:i + n]) for i in range(0, len(sentences), n)]
                    runs = decoders(args, threads, precision, ours, subword, srcs, Path(tmp) / "hf", Path(tmp) / "ct2")
                    times, outputs = measure(args, runs)
                    rows += rows_for(args, f"{precision} | {threads} | {min(n, len(sentences))}", times, outputs,
                                     len(sentences))
                    print(rows[-2] + "\n" + rows[-1], flush=True)
                    for engine in ("admin_ds", "ctranslate2"):  # beam outputs at the first batch size, for --ref
                        quality.setdefault((engine, precision), outputs[(engine, args.beam)])
                    if args.profile and profile is None and precision == "fp32":
                        profile = (n, threads, profile_search(runs[("admin_ds", args.beam)]))
    load_after = os.getloadavg()
    script = Path(sys.argv[0]).resolve()
    command = " ".join(["python", str(script.relative_to(REPO) if script.is_relative_to(REPO) else script),
                        *sys.argv[1:]])
    dims = "" if args.dims is None else " at {model_dim}/{ffn_inner_dim}/{num_heads}".format(**args.dims)
    described = args.model or (f"{args.preset}{dims} randomly initialised, vocabulary {args.vocab} (SentencePiece "
                               f"unigram on newstest2013/2014 en+de)")
    work = (f"every decoder forced to {args.length} tokens + EOS per sentence" if args.length > 0 else
            f"every decoder up to EOS or {args.max_len} tokens")
    report = "\n".join([
        "# Decoding speed: admin_ds.inference.decode vs CTranslate2 (CPU)",
        "",
        f"- command: `{command}`",
        f"- date: {datetime.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}",
        f"- hardware: {hardware()}; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after",
        f"- software: torch {torch.__version__}, transformers {transformers.__version__}, "
        f"ctranslate2 {ctranslate2.__version__}, Python {platform.python_version()}",
        f"- model: {described}; the same weights in every decoder "
        f"(exported with launch/export.py); int8: each library quantizes them at load",
        f"- sources: the first {len(sentences)} sentences of {args.src.name} in consecutive batches of the "
        f"table's batch size, each padded on its own; {work}; best of "
        f"{args.repeats} interleaved rounds, encoding included",
        "",
        "ours = admin_ds as translate.py decodes (fp32: the model as it is, eager PyTorch; int8: --int8).",
        "",
        "| precision | threads | batch | search | ours / CTranslate2 (speed) | sentences/s, target tokens/s "
        "| outputs identical to ours | median s (same order) |",
        "|---|---:|---:|---|---:|---|---|---|",
        *rows,
        "",
    ])
    if args.ref:
        report += bleu_table(args, quality, subword, sentences, cfg.eos_idx)
    if profile:
        n, threads, (table, shares, wall) = profile
        report += (f"\n## Where our beam {args.beam} spends its time (fp32, batch {n}, {threads} threads, "
                   f"{wall:.2f} s; torch.profiler self time as a share of wall time)\n\n| | share |\n|---|---:|\n")
        report += "".join(f"| {name} | {v:.0%} |\n" for name, v in shares.items())
        report += "\nTop operators:\n\n```\n" + table + "\n```\n"
    print(report)
    out = Path(args.out)
    if args.append and out.is_file() and out.stat().st_size:
        report = out.read_text(encoding="utf-8").rstrip("\n") + "\n\n---\n\n" + report
    out.write_text(report, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
