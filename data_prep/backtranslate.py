"""Back-translation: a reverse model (TGT -> SRC) translates target-language monolingual text,
the synthetic (source, target) pairs are filtered like preparation's training pairs, optionally
tagged with the reserved ``<BT>`` piece, and combined with the (upsampled) real bitext into a data
directory that training reads directly (``--data.path``). Entry point:
``bash data_prep/backtranslate.sh`` (``python -m data_prep.backtranslate``); see data_prep/README.md.

Steps:
    read      the mono files, decoded and normalised as preparation normalises (empty lines and
              invalid UTF-8 dropped, counted), split into K contiguous shards
    translate each shard -> OUT/shards/NNN.{src,tgt} + NNN.done.json (skipped when its record
              matches: same input checksum, options, model; outputs unchanged). With WORLD_SIZE > 1
              rank r translates shards r, r+W, ...; shard i is seeded with seed + i.
    combine   real train pairs x --upsample, then the synthetic pairs that pass the length filters
              (1..250 subwords, ratio 1.5, non-empty), binarized with the bitext's spm.model;
              valid/test and the subword model copied; manifest.json written last.

Throughput: the command ends with sentences/s and where the time went (decoding vs reading,
loading, writing and combining), also recorded under ``throughput`` in the manifest. Each rank is
pinned to its own share of the node's cores (admin_ds/distributed.py ``pin_to_cores``) and runs
that many torch threads unless --workers says otherwise. --int8 decodes with int8 linear layers
(CPU; admin_ds/inference/int8.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

from admin_ds import files
from admin_ds.arguments import existing_path, float_in, input_file, int_in, output_dir
from admin_ds.errors import UserError
from admin_ds.inference.limits import add_limit_arguments, check_decoding_arguments
from admin_ds.files import atomic_output, bounded_lines, sha256_file
from data_prep import PrepError
from data_prep.clean import PunctNormalizer, decode_side, length_filter, normalize
from data_prep.noise import encode_with_blanks, noise_line
from data_prep.pipeline import FilterOptions, _counts, open_output_dir
from data_prep.steps import make_key

BT_VERSION = 1
METHODS = ("beam", "sampling", "topk", "noised-beam")
DEFAULT_TOPK = 10
TAG = "<BT>"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog=os.environ.get("DATA_PREP_ARGV0"), description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, type=existing_path, help="reverse model: run dir, checkpoint tag dir or model file")
    p.add_argument("--mono", required=True, nargs="+", type=input_file, help="target-language monolingual text")
    p.add_argument("--out", required=True, type=output_dir, help="output data directory")
    p.add_argument("--bitext", required=True, type=Path, help="prepared real data directory (manifest.json, spm.model)")
    p.add_argument("--method", choices=METHODS, default="sampling")
    p.add_argument("--tag", action="store_true", help=f"prefix synthetic sources with {TAG}")
    p.add_argument("--upsample", type=int_in(1), default=1, help="copies of the real bitext")
    p.add_argument("--shards", type=int_in(1), default=1)
    # numpy's generators (noise, --shuffle) refuse a negative seed; the bound is preparation's
    p.add_argument("--seed", type=int_in(0, 2**32 - 1), default=1, help="shard i uses seed + i")
    p.add_argument("--beam", type=int_in(1), default=5)
    p.add_argument("--lenpen", type=float_in(), default=1.0)
    p.add_argument("--topk", type=int_in(1), default=None, help=f"--method topk only (default {DEFAULT_TOPK})")
    p.add_argument("--max-tokens", type=int_in(1), default=4096)
    p.add_argument("--max-len-a", type=float_in(0), default=1.2)
    p.add_argument("--max-len-b", type=int_in(0), default=10)
    add_limit_arguments(p)
    p.add_argument("--shuffle", action="store_true", help="shuffle the combined pairs with the seed "
                   "(default: real x upsample, then synthetic, in order)")
    p.add_argument("--workers", type=int_in(1), default=None,
                   help="torch threads per rank for decoding (default: the rank's share of the cores)")
    p.add_argument("--int8", action="store_true", help="CPU: decode with dynamic int8 linear layers")
    p.add_argument("--min-len", type=int_in(0), default=1)
    p.add_argument("--max-len", type=int_in(1), default=250)
    p.add_argument("--ratio", type=float_in(1), default=1.5)
    p.add_argument("--trust-unverified", action="store_true",
                   help="accept a reverse model written without digests (an older version)")
    p.add_argument("--any-direction", action="store_true",
                   help="accept a reverse model whose recorded languages are not the bitext's reversed, with a "
                        "warning (a throughput benchmark with the model at hand; data labelled otherwise)")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.min_len > a.max_len:
        p.error(f"--min-len {a.min_len} exceeds --max-len {a.max_len}")
    if a.topk is not None and a.method != "topk":
        p.error(f"--topk applies to --method topk only, not --method {a.method}")
    if a.method == "topk" and a.topk is None:
        a.topk = DEFAULT_TOPK
    check_decoding_arguments(p, a, min_len=False)  # --min-len here is the length filter's
    return a


# ---- checks -----------------------------------------------------------------------------------

def check_inputs(a) -> tuple[dict, object]:
    """Everything checked before any output is written. Returns the bitext manifest and the
    forward SubwordModel."""
    from admin_ds.data.binarize import check_listed_files, load_manifest
    from admin_ds.data.subword import SubwordModel

    if not a.model.exists():
        raise PrepError(f"--model {a.model}: no such file or directory")
    for f in a.mono:
        if not f.is_file():
            raise PrepError(f"--mono {f}: no such file")
        if f.stat().st_size == 0:
            raise PrepError(f"--mono {f}: empty file")
    if not a.bitext.is_dir():
        raise PrepError(f"--bitext {a.bitext}: no such directory")
    subword_file = "spm.model"
    try:
        manifest = load_manifest(a.bitext, verify=False)
        # The subword model is the one file read here rather than copied: checked as training
        # checks it, so a swapped spm.model cannot encode the synthetic pairs unseen.
        subword_file = manifest.get("subword_model", subword_file)
        check_listed_files(a.bitext, manifest, verify=(subword_file,))
    except (FileNotFoundError, ValueError) as e:
        raise PrepError(f"--bitext {e}") from None
    if "train" not in manifest.get("splits", {}):
        raise PrepError(f"--bitext {a.bitext}: no train split in its manifest")
    if subword_file not in manifest.get("files", {}):
        raise PrepError(f"--bitext {a.bitext}: its manifest records no checksum of {subword_file}")
    try:
        sp = SubwordModel(a.bitext / subword_file)
    except (OSError, ValueError) as e:
        raise PrepError(f"--bitext {a.bitext}: {e}") from None
    if a.tag:
        try:
            tag_id = sp.id_of(TAG)
        except KeyError:
            tag_id = None
        if tag_id is None or sp.piece(tag_id) != TAG:
            raise PrepError(f"--tag: {TAG} is not a single piece of {sp.path} (the forward vocabulary); "
                            f"prepare the bitext with --user-symbols {TAG} (data_prep/prepare_wmt14.sh "
                            "reserves it by default) or back-translate without --tag")
    if a.out.resolve() == a.bitext.resolve():
        raise PrepError(f"--out {a.out}: must differ from --bitext")
    return manifest, sp


def read_mono(files: list[Path], lang: str) -> tuple[list[str], dict]:
    """Decoded, normalised non-empty lines (preparation's reading and normalisation)."""
    punct = PunctNormalizer(lang)
    lines, stats = [], {"read": 0, "invalid_utf8": 0, "empty": 0}
    for f in files:
        with open(f, "rb") as fh:
            for raw in bounded_lines(fh, f"--mono {f}"):
                stats["read"] += 1
                text = decode_side(raw)
                if text is None:
                    stats["invalid_utf8"] += 1
                    continue
                text = normalize(text, punct)
                if not text.strip():
                    stats["empty"] += 1
                    continue
                lines.append(text)
    if not lines:
        raise PrepError(f"--mono {' '.join(map(str, files))}: no non-empty lines")
    stats["kept"] = len(lines)
    return lines, stats


# ---- translation of the shards ----------------------------------------------------------------

def shard_bounds(n: int, k: int) -> list[tuple[int, int]]:
    return [(n * i // k, n * (i + 1) // k) for i in range(k)]


def text_sha(lines: list[str]) -> str:
    return files.sha256_bytes("".join(l + "\n" for l in lines).encode("utf-8"))


def shard_done(out: Path, i: int, key: str) -> bool:
    base = out / "shards" / f"{i:03d}"
    try:
        rec = json.loads(Path(f"{base}.done.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    if rec.get("key") != key:
        return False
    return all(Path(f"{base}.{s}").is_file() and sha256_file(Path(f"{base}.{s}")) == rec["outputs"][s]
               for s in ("src", "tgt"))


def translate_shard(model, subword, lines: list[str], a, seed: int) -> list[str]:
    import torch

    from admin_ds.inference.translate import translate

    torch.manual_seed(seed)
    kw = dict(max_len_a=a.max_len_a, max_len_b=a.max_len_b)
    if a.method in ("beam", "noised-beam"):
        out = translate(model, subword, lines, beam=a.beam, lenpen=a.lenpen, max_tokens=a.max_tokens,
                        method="beam", **kw)
    else:
        out = translate(model, subword, lines, max_tokens=a.max_tokens, method="sample",
                        topk=a.topk if a.method == "topk" else 0, temperature=1.0,
                        generator=torch.Generator().manual_seed(seed), **kw)
    if a.method == "noised-beam":
        rng = np.random.default_rng(seed)
        out = [noise_line(line, rng) for line in out]
    return out


def run_shards(a, lines: list[str], model_id: dict, rank: int, world: int) -> tuple[list[dict], dict]:
    """(every shard's key, this rank's {"lines", "decode_s", "write_s"} for the shards it translated)."""
    (a.out / "shards").mkdir(parents=True, exist_ok=True)
    bounds = shard_bounds(len(lines), a.shards)
    opts = {"method": a.method, "beam": a.beam, "lenpen": a.lenpen, "topk": a.topk,
            "max_len_a": a.max_len_a, "max_len_b": a.max_len_b, "max_tokens": a.max_tokens}
    keys = []
    for i, (s, e) in enumerate(bounds):
        keys.append({"version": BT_VERSION, "shard": i, "input_sha256": text_sha(lines[s:e]),
                     "lines": e - s, "options": opts, "seed": a.seed + i, "model": model_id})
    model = subword = None
    done = {"lines": 0, "decode_s": 0.0, "write_s": 0.0}
    for i in range(rank, a.shards, world):
        key = make_key(keys[i])
        base = a.out / "shards" / f"{i:03d}"
        if shard_done(a.out, i, key):
            log(f"[bt] shard {i}: already done, skipped")
            continue
        if model is None:
            model, subword, _ = load_model(a.model, a.trust_unverified, a.int8)
        t0 = time.perf_counter()
        s, e = bounds[i]
        src = translate_shard(model, subword, lines[s:e], a, a.seed + i)
        t1 = time.perf_counter()
        outputs = {}
        for side, text in (("src", src), ("tgt", lines[s:e])):
            with atomic_output(Path(f"{base}.{side}")) as f:
                f.write("".join(t.replace("\n", " ") + "\n" for t in text).encode("utf-8"))
            outputs[side] = sha256_file(Path(f"{base}.{side}"))
        dt = round(time.perf_counter() - t0, 3)
        files.write_text(Path(f"{base}.done.json"), json.dumps(
            dict(keys[i], key=key, outputs=outputs, seconds=dt, decode_seconds=round(t1 - t0, 3)), indent=1) + "\n")
        done["lines"] += e - s
        done["decode_s"] += t1 - t0
        done["write_s"] += time.perf_counter() - t1
        log(f"[bt] shard {i}: {e - s} lines translated ({a.method}) in {dt:.1f}s")
    return keys, done


_MODEL_CACHE: dict = {}


def load_model(path: Path, trust_unverified: bool = False, int8: bool = False):
    """The reverse model and its subword model, loaded once per process (admin_ds/inference/
    model_file.py ``load_for_decoding``): on this rank's GPU when there are GPUs (LOCAL_RANK from
    torchrun or deepspeed), else on the CPU (in fp32, or int8)."""
    if "model" not in _MODEL_CACHE:
        import torch

        from admin_ds.errors import UserError
        from admin_ds.inference.model_file import load_for_decoding

        if torch.cuda.is_available() and not int8:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        else:
            device = torch.device("cpu")
        try:
            _MODEL_CACHE["model"] = load_for_decoding(path, device=device, trust_unverified=trust_unverified,
                                                      precision="int8" if int8 else "fp32")
        except (UserError, NotImplementedError, ValueError, OSError) as e:
            raise PrepError(f"--model {path}: {e}") from None
    return _MODEL_CACHE["model"]


def model_identity(path: Path, trust_unverified: bool = False, int8: bool = False) -> dict:
    """What identifies the reverse model: the model file's checksum, or the run checkpoint's
    source/tag/update and subword checksum; and the precision it decodes in."""
    _, _, mf = load_model(path, trust_unverified, int8)
    ident = {"path": str(path.resolve()), "subword_sha256": mf.subword_sha256,
             "src_lang": mf.meta.get("src_lang"), "tgt_lang": mf.meta.get("tgt_lang"),
             "precision": "int8" if int8 else "fp32"}
    if path.is_file():
        ident["sha256"] = sha256_file(path)
    else:
        ident.update(tag=mf.meta.get("tag"), update=mf.meta.get("update"))
    return ident


def check_direction(a, model_id: dict, manifest: dict) -> None:
    """The reverse model must translate the bitext's target into its source: checked after the model
    load (the languages are in the model), before the mono text is read. The languages a model
    records are those of the data manifest it was trained on (model_file.py); a model that records
    none (an older one) passes."""
    want = (manifest["tgt_lang"], manifest["src_lang"])
    got = (model_id.get("src_lang"), model_id.get("tgt_lang"))
    if any(g is not None and g != w for g, w in zip(got, want)):
        problem = (f"--model {a.model}: translates {got[0]}->{got[1]}, but --bitext {a.bitext} is "
                   f"{want[1]}->{want[0]}: back-translation needs a {want[0]}->{want[1]} model")
        if not a.any_direction:
            raise PrepError(f"{problem} (--any-direction to go on regardless)")
        log(f"warning: {problem}; going on (--any-direction)")


# ---- combine ----------------------------------------------------------------------------------

def combine(a, manifest: dict, sp, keys: list[dict], mono_stats: dict, model_id: dict, t_start: float,
            throughput: Callable[[], dict]) -> tuple[Path, dict]:
    """The combined data directory; ``throughput()`` is asked for its report just before the
    manifest is written, so the report covers all of combining but the manifest itself."""
    from admin_ds.data.binarize import MANIFEST, open_split, write_manifest
    from admin_ds.data.indexed import IndexedDatasetWriter
    from admin_ds.data.subword import UNK

    out, bt = a.out, a.bitext
    s_lang, t_lang = manifest["src_lang"], manifest["tgt_lang"]
    f = FilterOptions(min_len=a.min_len, max_len=a.max_len, ratio=a.ratio)
    tag_id = sp.id_of(TAG) if a.tag else None
    syn_src, syn_tgt = [], []
    for i in range(a.shards):
        base = out / "shards" / f"{i:03d}"
        syn_src += Path(f"{base}.src").read_text(encoding="utf-8").splitlines()
        syn_tgt += Path(f"{base}.tgt").read_text(encoding="utf-8").splitlines()
    stats = {"read": len(syn_src), "empty": 0, "too_short": 0, "too_long": 0, "ratio": 0, "kept": 0}
    pairs = []
    enc_src, enc_tgt = encode_with_blanks(sp, syn_src), sp.encode(syn_tgt)
    reasons = length_filter([len(x) for x in enc_src], [len(x) for x in enc_tgt], f.min_len, f.max_len, f.ratio)
    for s_text, t_text, s_ids, t_ids, reason in zip(syn_src, syn_tgt, enc_src, enc_tgt, reasons.tolist()):
        if not s_text.strip() or not t_text.strip():
            stats["empty"] += 1
            continue
        if reason:
            stats[reason] += 1
            continue
        pairs.append(([tag_id] + list(s_ids) if a.tag else list(s_ids), list(t_ids)))
    stats["kept"] = len(pairs)
    real = open_split(bt, "train", manifest)
    n_real = len(real)
    order = [("r", j) for _ in range(a.upsample) for j in range(n_real)] + [("s", j) for j in range(len(pairs))]
    if a.shuffle:
        perm = np.random.default_rng(a.seed).permutation(len(order))
        order = [order[j] for j in perm]
    tok = {"src_tokens": 0, "tgt_tokens": 0, "src_unk": 0, "tgt_unk": 0}
    with IndexedDatasetWriter(out / f"train.{s_lang}", sp.vocab_size) as ws, \
            IndexedDatasetWriter(out / f"train.{t_lang}", sp.vocab_size) as wt:
        for kind, j in order:
            src_ids, tgt_ids = (real.src[j], real.tgt[j]) if kind == "r" else pairs[j]
            src_ids, tgt_ids = np.asarray(src_ids, dtype=np.int64), np.asarray(tgt_ids, dtype=np.int64)
            ws.add(src_ids)
            wt.add(tgt_ids)
            tok["src_tokens"] += int(src_ids.size)
            tok["tgt_tokens"] += int(tgt_ids.size)
            tok["src_unk"] += int(np.count_nonzero(src_ids == UNK))
            tok["tgt_unk"] += int(np.count_nonzero(tgt_ids == UNK))
    listed = [f"train.{l}.{e}" for l in (s_lang, t_lang) for e in ("bin", "idx")]
    for name in [manifest.get("subword_model", "spm.model"), "spm.vocab"] + [
            n for n in manifest.get("files", {}) if not n.startswith("train.")]:
        if (bt / name).is_file() and name not in listed:
            files.write_bytes(out / name, (bt / name).read_bytes())
            listed.append(name)
    splits = {k: v for k, v in manifest["splits"].items() if k != "train"}
    splits["train"] = {"lines": len(order), **tok}
    filters = {k: v for k, v in manifest.get("filters", {}).items() if k != "train"}
    filters["synthetic"] = stats
    report = throughput()
    path = write_manifest(out, {
        "src_lang": s_lang, "tgt_lang": t_lang, "subword_model": manifest.get("subword_model", "spm.model"),
        "subword_sha256": sp.sha256, "vocab_size": sp.vocab_size, "splits": splits, "files": listed,
        "filters": filters,
        "backtranslation": {
            "counts": {"real": n_real, "real_upsampled": n_real * a.upsample, "upsample": a.upsample,
                       "mono": mono_stats, "synthetic": stats, "train": len(order)},
            "method": a.method, "tag": TAG if a.tag else None, "tag_id": tag_id, "seed": a.seed,
            "shards": a.shards, "shuffle": a.shuffle, "beam": a.beam, "lenpen": a.lenpen,
            "topk": a.topk,
            "noise": ({"word_dropout": 0.1, "blank": 0.1, "blank_token": "<unk> (unknown id)",
                       "shuffle_k": 3} if a.method == "noised-beam" else None),
            "length_filter": {"min_len": f.min_len, "max_len": f.max_len, "ratio": f.ratio},
            "reverse_model": model_id, "mono_files": {str(p): sha256_file(p) for p in a.mono},
            "shard_inputs": [k["input_sha256"] for k in keys],
            "bitext": {"path": str(bt.resolve()), "manifest_sha256": sha256_file(bt / MANIFEST)},
        },
        "seconds": {"total": round(time.perf_counter() - t_start, 3)},
        "throughput": report,
        "command": " ".join([os.environ.get("DATA_PREP_ARGV0", "python -m data_prep.backtranslate")]
                            + sys.argv[1:]),
    })
    log(f"[bt] synthetic: {stats['read']} pairs, {stats['kept']} kept ({_counts({k: v for k, v in stats.items() if k not in ('read', 'kept')}) or 'none dropped'}); "
        f"train = {n_real} real x {a.upsample} + {stats['kept']} synthetic = {len(order)}")
    log(f"[bt] manifest: {path}")
    return path, report


def throughput_report(timings: dict, per_rank: list[dict], cores: list[list[int]], threads: int) -> dict:
    """Sentences/s and the share of the wall time in decoding vs the rest, from rank 0's clock
    (``timings``: seconds of each phase) and every rank's shard work (``per_rank``). Decoding is
    the ranks' mean decode time (they decode at the same time); "waiting" is the translate phase's
    wall time that no rank spent decoding or writing on average (imbalance between ranks)."""
    total = sum(timings.values())
    n = sum(r["lines"] for r in per_rank)
    world = len(per_rank)
    decode = sum(r["decode_s"] for r in per_rank) / world
    write = sum(r["write_s"] for r in per_rank) / world
    split = {"decoding": decode,
             "start-up and reading mono": timings["read"], "loading model": timings["load"],
             "writing shards": write, "waiting for other ranks": max(timings["translate"] - decode - write, 0.0),
             "combining": timings["combine"]}
    return {"sentences_translated": n, "ranks": world, "threads_per_rank": threads, "cores_per_rank": cores,
            "translate_wall_s": round(timings["translate"], 3), "total_s": round(total, 3),
            "sentences_per_s": round(n / timings["translate"], 2) if timings["translate"] > 0 else None,
            "sentences_per_s_end_to_end": round(n / total, 2) if total > 0 else None,
            "decode_sentences_per_s_per_rank": [round(r["lines"] / r["decode_s"], 2) if r["decode_s"] else None
                                                for r in per_rank],
            "seconds": {k: round(v, 3) for k, v in split.items()},
            "share": {k: round(v / total, 4) for k, v in split.items()} if total > 0 else {}}


# ---- main -------------------------------------------------------------------------------------

def run(a) -> int:
    t0 = time.perf_counter()
    import torch

    from admin_ds import distributed

    with distributed.session("cpu") as (rank, world):
        cores = distributed.pin_to_cores()
        threads = a.workers or len(cores)
        torch.set_num_threads(threads)
        manifest, sp = check_inputs(a)
        # Locked before the model load, so that a second run into the same --out is refused
        # before any work; a folder the lock made is removed again if the run stops before writing.
        lock = open_output_dir(a.out) if rank == 0 else None
        try:
            t_load = time.perf_counter()
            model_id = model_identity(a.model, a.trust_unverified, a.int8)
            t_read = time.perf_counter()
            check_direction(a, model_id, manifest)
            lines, mono_stats = read_mono(a.mono, manifest["tgt_lang"])
            timings = {"load": t_read - t_load, "read": time.perf_counter() - t_read}
            if a.shards > len(lines):
                raise PrepError(f"--shards {a.shards}: more shards than the {len(lines)} non-empty mono lines")
            distributed.barrier()
            from admin_ds.data.binarize import MANIFEST

            if rank == 0:
                (a.out / MANIFEST).unlink(missing_ok=True)
            t_translate = time.perf_counter()
            keys, done = run_shards(a, lines, model_id, rank, world)
            per_rank = distributed.gather_object(done)
            every_core = distributed.gather_object(cores)
            if rank == 0:
                t_combine = time.perf_counter()
                timings["translate"] = t_combine - t_translate
                timings["read"] += t_load - t0  # the start-up and checks before the model load

                def throughput() -> dict:
                    return throughput_report(dict(timings, combine=time.perf_counter() - t_combine),
                                             per_rank, every_core, threads)

                _, report = combine(a, manifest, sp, keys, mono_stats, model_id, t0, throughput)
                shares = ", ".join(f"{k} {v:.0%}" for k, v in report["share"].items() if v >= 0.005)
                log(f"[bt] {report['sentences_translated']} sentences translated in {report['translate_wall_s']:.1f}s on "
                    f"{world} rank(s) x {threads} thread(s): {report['sentences_per_s'] or 0:.1f} sentences/s "
                    f"({report['sentences_per_s_end_to_end'] or 0:.1f}/s end to end, {report['total_s']:.1f}s); "
                    f"time: {shares}")
        finally:
            if lock is not None:
                lock.release()
    return 0


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        return run(a)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {files.describe_os_error(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
