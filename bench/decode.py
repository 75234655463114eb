"""Decoding speed on CPU: admin_ds.inference.decode vs transformers' generate vs CTranslate2, same weights.

    python bench/decode.py --threads 2 1 --repeats 5 --profile     # writes bench/decode_results.md
    python bench/decode.py --batch 32 --length 48 --out /tmp/decode.md

The model is a randomly initialised base-6L-6L (Transformer-base, 512/2048/8 heads, 6+6 layers) over
a joint SentencePiece vocabulary of --vocab pieces trained on the fly on WMT newstest2013/2014
en+de (../shared/data/wmt14/en-de beside the repository; the benchmark skips when it is absent).
Sources are the first --batch sentences of newstest2014.en. The model goes through
launch/export.py's path (folded, exported to a MarianMTModel directory, converted to CTranslate2
float32), so the three decoders run the same weights.

Every decoder is forced to the same work: exactly --length tokens plus EOS per sentence (ours:
min_len = max_len_b = L with EOS forced at step L; transformers: min_new_tokens = max_new_tokens =
L + 1 with forced_eos_token_id; CTranslate2: min_decoding_length = max_decoding_length = L + 1),
i.e. L + 1 decoder steps over the whole batch (random weights would otherwise end hypotheses at
arbitrary lengths). Throughput = batch x (L + 1) target tokens / wall time; best of --repeats
interleaved rounds after one warm-up each. CPU, the same intra-op thread count for all three
(torch.set_num_threads; CTranslate2 intra_threads, inter_threads=1), for each of --threads.
--profile adds a torch.profiler breakdown of beam search (ours and transformers').
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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="base-6L-6L")
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--batch", type=int, default=16, help="sentences per batch")
    p.add_argument("--length", type=int, default=32, help="target tokens per sentence (plus EOS)")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--threads", type=int, nargs="+", default=[2], help="intra-op thread counts to measure")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="torch.profiler breakdown of beam search (ours, HF)")
    p.add_argument("--out", default=str(REPO / "bench/decode_results.md"))
    return p.parse_args(argv)


def hardware() -> str:
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} logical CPUs visible, {platform.system()} {platform.release()}"


def build(args, tmp: Path):
    """(our model as translate.py prepares it, the same without packed weights, subword model, src
    batch, Marian dir, CTranslate2 dir), all with the same weights."""
    import torch

    from admin_ds.data.subword import train_subword_model
    from admin_ds.inference import export
    from admin_ds.inference.model_file import ModelFile, build_from_model_file
    from admin_ds.inference.packed import optimize_for_decoding
    from admin_ds.model import build_model
    from admin_ds.model.config import ModelConfig
    from admin_ds.model.presets import get_preset

    files = [DATA / f"newstest{y}.{lang}" for y in (2013, 2014) for lang in ("en", "de")]
    spm = train_subword_model(files, tmp / "spm", vocab_size=args.vocab, seed=1, num_threads=2)
    torch.manual_seed(1)
    cfg: ModelConfig = get_preset(args.preset, vocab_size=args.vocab, dropout_p=0.0, attention_dropout_p=0.0,
                                  activation_dropout_p=0.0)
    mf = ModelFile(cfg, build_model(cfg).state_dict(), None, None, spm.read_bytes(), {"source": "bench"})
    export.export_hf_marian(mf, tmp / "hf")
    export.convert_ct2(tmp / "hf", tmp / "ct2")
    model, subword = build_from_model_file(mf)
    plain, _ = build_from_model_file(mf)  # the same weights, decoded with F.linear

    lines = (DATA / "newstest2014.en").read_text(encoding="utf-8").splitlines()[:args.batch]
    ids = [x + [cfg.eos_idx] for x in subword.encode(lines)]
    src = torch.full((len(ids), max(map(len, ids))), cfg.pad_idx, dtype=torch.long)
    for i, x in enumerate(ids):
        src[i, :len(x)] = torch.tensor(x)
    return optimize_for_decoding(model), plain.eval(), subword, src, tmp / "hf", tmp / "ct2"


def decoders(args, threads, model, plain, subword, src, hf_dir, ct2_dir):
    """{(engine, beam): run() -> output token ids per sentence (the final EOS included)}."""
    import ctranslate2
    import torch
    from transformers import MarianMTModel

    from admin_ds.inference.decode import beam_search, greedy

    L, K = args.length, args.beam
    hf = MarianMTModel.from_pretrained(str(hf_dir)).eval()
    ct2 = ctranslate2.Translator(str(ct2_dir), device="cpu", compute_type="float32", inter_threads=1,
                                 intra_threads=threads)
    pieces = [[subword.piece(i) for i in row if i != model.cfg.pad_idx] for row in src.tolist()]
    mask = src.ne(model.cfg.pad_idx)

    eos, pad = model.cfg.eos_idx, model.cfg.pad_idx

    def ours(m, beam):
        if beam == 1:
            return [h + [eos] for h in greedy(m, src, max_len_a=0, max_len_b=L, min_len=L)]
        return [h[0].tokens + [eos] for h in beam_search(m, src, beam=beam, max_len_a=0, max_len_b=L, min_len=L)]

    def transformers_(beam):
        with torch.inference_mode():
            out = hf.generate(input_ids=src, attention_mask=mask, num_beams=beam, do_sample=False,
                              min_new_tokens=L + 1, max_new_tokens=L + 1)
        return [[t for t in row[1:] if t != pad] for row in out.tolist()]  # minus the start token

    def ctranslate2_(beam):
        res = ct2.translate_batch(pieces, beam_size=beam, min_decoding_length=L + 1,
                                  max_decoding_length=L + 1, return_end_token=True)
        return [[subword.id_of(p) for p in r.hypotheses[0]] for r in res]

    engines = (("admin_ds", lambda beam: ours(model, beam)), ("admin_ds_plain", lambda beam: ours(plain, beam)),
               ("transformers", transformers_), ("ctranslate2", ctranslate2_))
    return {(name, beam): (lambda fn=fn, beam=beam: fn(beam)) for name, fn in engines for beam in (1, K)}


# torch.profiler operator names -> what they are in a decoder step
_CATEGORIES = [
    ("matrix products (Linear, output projection)", ("aten::addmm", "aten::mm", "mkldnn::_linear_pointwise")),
    ("attention products (queries against cached keys and values)", ("aten::bmm",)),
    ("attention kernel (fused; softmax)", ("aten::_scaled_dot_product", "aten::scaled_dot_product", "aten::_softmax",
                                          "aten::baddbmm")),
    ("LayerNorm", ("aten::native_layer_norm",)),
    ("KV cache growth and beam reorder (cat, index_select, copies)", ("aten::cat", "aten::index_select", "aten::copy_",
                                                                      "aten::index", "aten::gather")),
    ("log-softmax, top-k, search bookkeeping", ("aten::_log_softmax", "aten::topk", "aten::sort", "aten::argmax")),
]


def profile_search(fn) -> tuple[str, dict]:
    """(top-operator table, {category: share of self CPU time}) of one call of ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    shares = {name: sum(e.self_cpu_time_total for e in events if e.key.startswith(prefixes)) / total
              for name, prefixes in _CATEGORIES}
    shares["everything else (elementwise ops, views, Python and dispatch)"] = 1.0 - sum(shares.values())
    return events.table(sort_by="self_cpu_time_total", row_limit=12), shares


def measure(args, runs, src) -> tuple[dict, dict]:
    """({(engine, beam): [seconds per round]}, {(engine, beam): outputs}): a warm-up (which checks
    the forced length), then --repeats rounds, interleaved so that a busy moment of the machine hits
    every decoder alike."""
    outputs = {}
    for key, run in runs.items():
        outputs[key] = run()
        steps = [len(h) for h in outputs[key]]
        if steps != [args.length + 1] * src.size(0):
            raise RuntimeError(f"{key}: decoder steps {steps}, expected {args.length + 1} each")
    times = {key: [] for key in runs}
    for _ in range(args.repeats):
        for key, run in runs.items():
            t0 = time.perf_counter()
            run()
            times[key].append(time.perf_counter() - t0)
    return times, outputs


ENGINES = ("admin_ds", "admin_ds_plain", "transformers", "ctranslate2")


def table(args, times: dict, tokens: int, threads: int) -> list[str]:
    rows = []
    for beam in (1, args.beam):
        ours, plain, hf, ct2 = (tokens / min(times[(e, beam)]) for e in ENGINES)
        medians = " / ".join(f"{statistics.median(times[(e, beam)]):.2f}" for e in ENGINES)
        rows.append(f"| {threads} | {'greedy' if beam == 1 else f'beam {beam}'} | {ours:,.0f} | {plain:,.0f} | "
                    f"{hf:,.0f} | {ct2:,.0f} | **{ours / hf:.2f}x** | {ours / ct2:.2f}x | {plain / hf:.2f}x | "
                    f"{medians} |")
    return rows


def agreement(args, outputs: dict) -> list[str]:
    """How many sentences each decoder outputs exactly as admin_ds does, over the forced L tokens
    (same weights; float32 rounding in another summation order may flip a near-tie of the random
    model)."""
    rows = []
    for beam in (1, args.beam):
        ref = outputs[("admin_ds", beam)]
        # The first L tokens: CTranslate2 stops at L + 1 tokens without forcing the last to be EOS.
        same = [sum(a[:args.length] == b[:args.length] for a, b in zip(ref, outputs[(e, beam)]))
                for e in ENGINES[1:]]
        rows.append(f"| {'greedy' if beam == 1 else f'beam {beam}'} | " +
                    " | ".join(f"{n}/{len(ref)}" for n in same) + " |")
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if not (DATA / "newstest2014.en").is_file():
        print(f"skipped: {DATA}/newstest2014.en not found (the benchmark decodes real WMT sentences)")
        return 0
    import ctranslate2
    import torch
    import transformers

    transformers.logging.set_verbosity_error()  # generate's notes on max_length vs max_new_tokens
    load_before = os.getloadavg()
    rows, profiles, agree = [], {}, []
    with tempfile.TemporaryDirectory(prefix="bench_decode_") as tmp:
        torch.set_num_threads(args.threads[0])
        model, plain, subword, src, hf_dir, ct2_dir = build(args, Path(tmp))
        tokens = src.size(0) * (args.length + 1)
        for threads in args.threads:
            torch.set_num_threads(threads)
            runs = decoders(args, threads, model, plain, subword, src, hf_dir, ct2_dir)
            times, outputs = measure(args, runs, src)
            rows += table(args, times, tokens, threads)
            agree = agree or agreement(args, outputs)
            if args.profile and not profiles:
                profiles = {e: profile_search(runs[(e, args.beam)]) for e in ("admin_ds", "transformers")}
    load_after = os.getloadavg()

    script = Path(sys.argv[0]).resolve()
    command = " ".join(["python", str(script.relative_to(REPO) if script.is_relative_to(REPO) else script),
                        *sys.argv[1:]])
    src_len = src.ne(model.cfg.pad_idx).sum(1).float()
    report = "\n".join([
        "# Decoding speed: admin_ds.inference.decode vs transformers vs CTranslate2 (CPU)",
        "",
        f"- command: `{command}`",
        f"- date: {datetime.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}",
        f"- hardware: {hardware()}; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after "
        f"(a shared machine: other jobs were running)",
        f"- software: torch {torch.__version__}, transformers {transformers.__version__}, "
        f"ctranslate2 {ctranslate2.__version__} (float32), Python {platform.python_version()}",
        f"- model: {args.preset} randomly initialised, vocabulary {args.vocab} (SentencePiece unigram "
        f"trained on newstest2013/2014 en+de), the same weights in all three (exported with launch/export.py)",
        f"- batch: the first {src.size(0)} sentences of newstest2014.en ({int(src_len.min())}-"
        f"{int(src_len.max())} source tokens, mean {float(src_len.mean()):.1f}), one padded batch; every "
        f"decoder forced to {args.length} tokens + EOS per sentence; target tokens/s (encoding included), "
        f"best of {args.repeats} interleaved rounds",
        "",
        "admin_ds decodes as launch/translate.py does (weights packed for oneDNN by "
        "admin_ds/inference/packed.py); admin_ds_plain is the same model with F.linear (translate.py --plain-linear).",
        "",
        "| threads | search | admin_ds tok/s | admin_ds_plain tok/s | transformers tok/s | CTranslate2 tok/s "
        "| admin_ds / transformers | admin_ds / CTranslate2 | admin_ds_plain / transformers "
        "| median s (ours / plain / HF / CT2) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
        *rows,
        "",
        "Outputs identical to admin_ds's, sentence by sentence (first thread count):",
        "",
        "| search | admin_ds_plain | transformers | CTranslate2 |",
        "|---|---:|---:|---:|",
        *agree,
        "",
    ])
    if profiles:
        report += (f"\n## Where beam {args.beam} spends its time ({args.threads[0]} threads; torch.profiler, "
                   f"share of self CPU time)\n\n| | admin_ds | transformers |\n|---|---:|---:|\n")
        for name in profiles["admin_ds"][1]:
            report += f"| {name} | {profiles['admin_ds'][1][name]:.0%} | {profiles['transformers'][1][name]:.0%} |\n"
        report += "\nadmin_ds, top operators:\n\n```\n" + profiles["admin_ds"][0] + "\n```\n"
    print(report)
    Path(args.out).write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
