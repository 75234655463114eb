"""The preparation steps, in order, each resumable (see :mod:`data_prep.steps`):

    clean     training pairs -> work/train.clean.{SRC,TGT}     decode, normalise, drop empty and
                                                               duplicate pairs (sharded, ordered)
    subword   work/train.clean.* -> spm.model, spm.vocab       joint SentencePiece on a sample
    train     work/train.clean.* -> train.{SRC,TGT}.{bin,idx}  encode, length/ratio filter,
                                                               binarize (sharded, ordered)

The sharded steps' work is :mod:`data_prep.shards`; this module schedules it and concatenates.
    valid     dev pairs  -> valid.{SRC,TGT}.{bin,idx} + valid.{SRC,TGT} text (no filtering)
    test      test pairs -> test.{SRC,TGT}.{bin,idx}  + test.{SRC,TGT} text
    manifest  manifest.json: counts, checksums, filters, sources, options, command, versions

The evaluation text files: ``{split}.{SRC}`` is the *normalised* source (what the binarized
split holds, so that translating it for BLEU feeds the model text like its training data: raw
typographic quotes would otherwise be unknown characters), ``{split}.{TGT}`` the *original*
reference (entities unescaped, nothing else changed: detokenized sacreBLEU scores against it).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
from tqdm import tqdm

from admin_ds.data.binarize import MANIFEST, load_manifest, write_manifest
from admin_ds.files import DirectoryLock, atomic_output
from data_prep import PrepError
from data_prep.clean import decode_side, normalize
from data_prep.shards import (BUCKET_PAIRS, CleanShard, DropDuplicates, DuplicateBucket, EncodeShard,
                              clean_shard, done, drop_duplicates, encode_shard, find_duplicates,
                              punct_normalizer, shard_name)
from data_prep.steps import StepLog, WorkerPool, chunked, make_key

# Bump when a change to the code changes what a step writes: old step records then stop matching.
# 2: the clean step's record lists its shards (the train step encodes the same shards).
PREP_VERSION = 2
# What a worker imports as it starts (the modules of the sharded steps' tasks).
WORKER_MODULES = ("data_prep.shards", "admin_ds.data.subword", "admin_ds.data.indexed")
# The training-pair filters, in the order they apply (clean step: 5, binarize step: 3).
TRAIN_DROPS = ("overlong", "malformed", "invalid_utf8", "empty", "duplicate", "too_short", "too_long", "ratio")


@dataclass(frozen=True)
class SubwordOptions:
    vocab_size: int
    model_type: str = "bpe"
    user_symbols: tuple[str, ...] = ("<BT>",)
    sample_lines: int = 10_000_000
    threads: int = 8  # part of the key: SentencePiece's result depends on its thread count
    seed: int = 1
    character_coverage: float = 1.0


@dataclass(frozen=True)
class FilterOptions:
    min_len: int = 1
    max_len: int = 250
    ratio: float = 1.5
    max_line_bytes: int = 4096


@dataclass
class Plan:
    """Everything resolved from the command line: languages, sources, options."""
    src: str
    tgt: str
    out: Path
    train: list  # pair sources (data_prep.sources), read in order
    evals: dict  # "valid" / "test" -> pair source
    eval_names: dict  # "valid" / "test" -> what the set is, for the manifest
    subword: SubwordOptions
    filters: FilterOptions
    workers: int = 1
    chunk_lines: int = 10_000
    quiet: bool = False
    remove_work: bool = False
    command: str = ""
    expect_test_lines: int | None = None  # --filtered-test: 2737
    log: Callable[[str], None] = field(default=lambda msg: print(msg, file=sys.stderr, flush=True))

    @property
    def work(self) -> Path:
        return self.out / "work"

    def clean_paths(self) -> tuple[str, str]:
        return f"work/train.clean.{self.src}", f"work/train.clean.{self.tgt}"


def prepare(plan: Plan) -> Path:
    """Run (or resume) every step; return the data directory. Idempotent: with the same inputs
    and options a complete directory is only verified."""
    t0 = time.perf_counter()
    log = plan.log
    # One set of workers for both sharded steps, started now: they start up while this process
    # reads and fingerprints the inputs (stopped unused when the output is already complete).
    with WorkerPool(plan.workers, modules=WORKER_MODULES).start() as pool:
        for lang in (plan.src, plan.tgt):
            punct_normalizer(lang)  # built once, here, while the workers start (handed to them)
        eval_pairs = {split: read_eval_pairs(plan, split) for split in ("valid", "test")}
        log(f"[prep] fingerprinting the inputs ({', '.join(s.describe() for s in plan.train)})")
        train_fp = [s.fingerprint() for s in plan.train]
        eval_fp = {split: plan.evals[split].fingerprint() for split in eval_pairs}
        request_key = make_key({"version": PREP_VERSION, "pair": [plan.src, plan.tgt], "train": train_fp,
                                "eval": eval_fp, "subword": asdict(plan.subword),
                                "filters": asdict(plan.filters)})
        # Everything above only read the inputs: a broken input file leaves no output folder behind.
        with open_output_dir(plan.out):
            if _complete(plan.out, request_key):
                log(f"[prep] {plan.out} is already prepared with these inputs and options (manifest verified)")
                return plan.out
            _run_steps(plan, request_key, train_fp, eval_fp, eval_pairs, pool)
    log(f"[prep] done in {time.perf_counter() - t0:.1f}s: {plan.out}")
    return plan.out


def _run_steps(plan: Plan, request_key: str, train_fp: list, eval_fp: dict, eval_pairs: dict,
               pool: WorkerPool) -> None:
    log = plan.log
    # From here on the directory is being changed: it must not look complete until the end.
    (plan.out / MANIFEST).unlink(missing_ok=True)
    plan.work.mkdir(exist_ok=True)
    steps = StepLog(plan.out, plan.work)
    clean = _step(steps, "clean", {"version": PREP_VERSION, "pair": [plan.src, plan.tgt],
                                   "train": train_fp, "max_line_bytes": plan.filters.max_line_bytes},
                  lambda key: run_clean(plan, steps, key, pool), log)
    clean_digests = {k: v["sha256"] for k, v in clean["outputs"].items()}
    subword = _step(steps, "subword", {"version": PREP_VERSION, "clean": clean_digests,
                                       "options": asdict(plan.subword)},
                    lambda key: run_subword(plan, steps, key), log)
    spm_sha = subword["outputs"]["spm.model"]["sha256"]
    train = _step(steps, "train", {"version": PREP_VERSION, "clean": clean_digests, "spm": spm_sha,
                                   "filters": asdict(plan.filters)},
                  lambda key: run_binarize_train(plan, steps, key, clean["stats"], pool), log)
    evals = {split: _step(steps, split, {"version": PREP_VERSION, "pair": [plan.src, plan.tgt],
                                         "source": eval_fp[split], "spm": spm_sha},
                          lambda key, split=split: run_eval_split(plan, steps, key, split,
                                                                  eval_pairs[split]), log)
             for split in ("valid", "test")}
    write_data_manifest(plan, request_key, clean, subword, train, evals)
    if plan.remove_work:
        shutil.rmtree(plan.work, ignore_errors=True)


def open_output_dir(out: Path):
    """Create the output folder, check that it is writable, and lock it against a second
    preparation running in it at the same time. Returns the held lock (admin_ds.files.DirectoryLock)."""
    if out.exists() and not out.is_dir():
        raise PrepError(f"{out}: exists and is not a directory")
    try:
        return DirectoryLock(out, ".prepare.lock")  # creates the folder; removes it again if left empty
    except BlockingIOError as e:
        raise PrepError(f"{out}: another preparation is running in this folder ({e})") from None
    except OSError as e:
        raise PrepError(f"{out}: cannot write to the output folder: {e.strerror or e}") from None


def _step(steps: StepLog, name: str, inputs: dict, run: Callable[[str], dict], log) -> dict:
    key = make_key(inputs)
    record = steps.done(name, key)
    if record is not None:
        log(f"[prep] {name}: already done (outputs verified), skipped")
        return record
    steps.invalidate(name)
    try:
        return run(key)
    except PrepError:
        # Bad input: the step's shards can never be reused (fixing the input changes the key).
        shutil.rmtree(steps.work_dir / f"{name}.shards", ignore_errors=True)
        raise


def _complete(out: Path, request_key: str) -> bool:
    if not (out / MANIFEST).is_file():
        return False
    try:
        return load_manifest(out, verify=True).get("prep_key") == request_key
    except (ValueError, FileNotFoundError, KeyError):
        return False


# ---- reading the evaluation sets --------------------------------------------------------------

def read_eval_pairs(plan: Plan, split: str) -> dict:
    """Read a dev/test set whole (a few thousand lines) before any step runs, so that a broken
    file fails the run before hours of training-data processing. Nothing is filtered: a pair is
    only dropped when a side is not valid UTF-8 (counted and warned about)."""
    source = plan.evals[split]
    src_text, tgt_text, invalid = [], [], 0
    for raw_src, raw_tgt in source:
        s, t = decode_side(raw_src), decode_side(raw_tgt)
        if s is None or t is None:
            invalid += 1
            continue
        src_text.append(s)
        tgt_text.append(t)
    dropped = dict(source.dropped, invalid_utf8=invalid)
    lost = sum(dropped.values())
    if lost:
        plan.log(f"warning: {source.describe()}: {lost} {split} pairs dropped ({_counts(dropped)})")
    if not src_text:
        raise PrepError(f"{source.describe()}: the {split} set is empty")
    if split == "test" and plan.expect_test_lines and len(src_text) != plan.expect_test_lines:
        raise PrepError(f"{source.describe()}: {len(src_text)} test segments, but the filtered "
                        f"En-De newstest2014 (--filtered-test) has {plan.expect_test_lines}")
    return {"src": src_text, "tgt": tgt_text,
            "stats": {"read": len(src_text) + lost, **dropped, "kept": len(src_text),
                      "empty_kept": sum(1 for s, t in zip(src_text, tgt_text) if not s.strip() or not t.strip())}}


def _counts(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items() if v)


# ---- step: clean ------------------------------------------------------------------------------

def run_clean(plan: Plan, steps: StepLog, key: str, pool: WorkerPool) -> dict:
    """Raw training pairs -> normalised, non-empty, deduplicated text, in input order
    (the phases are described in :mod:`data_prep.shards`)."""
    t0 = time.perf_counter()
    src_name, tgt_name = plan.clean_paths()
    # Every range source is indexed first: two sides of different lengths fail before any work.
    ranges = [source.shards(plan.chunk_lines) for source in plan.train]
    phases = {"index": time.perf_counter() - t0}  # seconds of each phase, for the benchmark
    directory = shard_folder(plan, "clean", key, {"chunk_lines": plan.chunk_lines})
    shard_stats: dict[int, dict] = {}
    read_drops = [{} for _ in plan.train]  # counted here for sources read by this process
    owner: list[int] = []  # the source of each shard
    reused: dict[int, dict] = {}

    punct = punct_normalizer(plan.src), punct_normalizer(plan.tgt)

    def clean_tasks():
        for i, source in enumerate(plan.train):
            plan.log(f"[prep] clean: reading {source.describe()}")
            if ranges[i] is not None:  # the largest ranges first: the last tasks, run alone, are short
                first = len(owner)
                owner.extend([i] * len(ranges[i]))
                parts = sorted(((first + k, r, None) for k, r in enumerate(ranges[i])),
                               key=lambda part: -_range_bytes(part[1]))
            else:
                parts = ((len(owner), None, pairs) for pairs in chunked(source, plan.chunk_lines))
            for index, byte_range, pairs in parts:
                if pairs is not None:
                    owner.append(i)
                if (record := done(directory, shard_name(index))) is not None:
                    shard_stats[index] = reused[index] = record
                    continue
                yield CleanShard(directory, index, punct, source, byte_range, pairs)
            if ranges[i] is None:
                read_drops[i] = dict(source.dropped)

    with tqdm(unit=" pairs", desc="clean", disable=plan.quiet or None, mininterval=1) as bar:
        for task, record in _tasks_and_results(pool, clean_shard, clean_tasks()):
            shard_stats[task.index] = record
            bar.update(record["pairs"] + record["invalid_utf8"] + record["empty"]
                       + record.get("overlong", 0) + record.get("malformed", 0))
        phases["clean"] = time.perf_counter() - t0 - sum(phases.values())
        n_shards = len(owner)
        if reused:
            plan.log(f"[prep] clean: {len(reused)} of {n_shards} shards left from an earlier run reused")
        shard_pairs = [shard_stats[i]["pairs"] for i in range(n_shards)]
        buckets = max(1, -(-sum(shard_pairs) // BUCKET_PAIRS))
        dup_stats = [done(directory, f"dup.{b}") for b in range(buckets)]
        for task, record in _tasks_and_results(pool, find_duplicates, [
                DuplicateBucket(directory, b, buckets, shard_pairs) for b in range(buckets) if dup_stats[b] is None]):
            dup_stats[task.bucket] = record
        phases["duplicates"] = time.perf_counter() - t0 - sum(phases.values())
        starts = np.concatenate(([0], np.cumsum(shard_pairs, dtype=np.int64)))
        kept_stats = {i: record for i in range(n_shards) if (record := done(directory, f"{shard_name(i)}.kept"))}
        for task, record in _tasks_and_results(pool, drop_duplicates, [
                DropDuplicates(directory, i, int(starts[i]), buckets) for i in range(n_shards) if i not in kept_stats]):
            kept_stats[task.index] = record
        phases["drop"] = time.perf_counter() - t0 - sum(phases.values())

    stats = {"read": 0, "overlong": 0, "malformed": 0, "invalid_utf8": 0, "empty": 0, "duplicate": 0}
    for i, source in enumerate(plan.train):
        dropped = dict(read_drops[i])
        for index in (k for k in range(n_shards) if owner[k] == i):
            for name in ("overlong", "malformed"):
                dropped[name] = dropped.get(name, 0) + shard_stats[index].get(name, 0)
        for name, n in dropped.items():
            stats[name] += n
            if n:
                plan.log(f"warning: {source.describe()}: {n} pairs dropped ({name})")
    for i in range(n_shards):
        stats["invalid_utf8"] += shard_stats[i]["invalid_utf8"]
        stats["empty"] += shard_stats[i]["empty"]
        stats["duplicate"] += kept_stats[i]["duplicate"]
    kept = stats["kept"] = sum(kept_stats[i]["kept"] for i in range(n_shards))
    stats["read"] = kept + sum(v for k, v in stats.items() if k not in ("read", "kept"))
    if kept == 0:
        raise PrepError(f"no training pairs left after cleaning {', '.join(s.describe() for s in plan.train)} "
                        f"({_counts(stats)})")
    # The shards' kept text, concatenated in order, is the cleaned corpus; the train step
    # encodes the same shards as byte ranges of it.
    with atomic_output(plan.out / src_name) as f_src, atomic_output(plan.out / tgt_name) as f_tgt:
        for i in range(n_shards):
            for f, side in ((f_src, "src"), (f_tgt, "tgt")):
                with open(directory / f"{shard_name(i)}.kept.{side}", "rb") as part:
                    shutil.copyfileobj(part, f, 1 << 20)
    phases["concatenate"] = time.perf_counter() - t0 - sum(phases.values())
    stats["shards"] = [[kept_stats[i][k] for k in ("kept", "src_bytes", "tgt_bytes")] for i in range(n_shards)]
    stats["phase_seconds"] = {k: round(v, 3) for k, v in phases.items()}
    stats["worker_seconds"], stats["worker_cpu_seconds"] = ({
        name: round(sum(r[field] for r in records), 3)
        for name, records in (("clean", shard_stats.values()), ("duplicates", dup_stats), ("drop", kept_stats.values()))}
        for field in ("seconds", "cpu_seconds"))
    dt = stats["seconds"] = round(time.perf_counter() - t0, 3)
    drops = _counts({k: v for k, v in stats.items() if k in TRAIN_DROPS}) or "none dropped"
    plan.log(f"[prep] clean: {stats['read']} pairs read, {kept} kept ({drops}); "
             f"{dt:.1f}s, {stats['read'] / max(dt, 1e-9):.0f} pairs/s with {plan.workers} worker(s), "
             f"{n_shards} shards, {buckets} duplicate bucket(s)")
    record = steps.mark_done("clean", key, [src_name, tgt_name], stats)
    shutil.rmtree(directory, ignore_errors=True)
    return record


def _range_bytes(byte_range: tuple) -> int:
    """The size of a source's shard: (start, stop), or one such range per side."""
    if isinstance(byte_range[0], tuple):
        return sum(stop - start for start, stop in byte_range)
    return byte_range[1] - byte_range[0]


def shard_folder(plan: Plan, step: str, key: str, layout) -> Path:
    """work/STEP.shards, kept when it holds shards of this step key and layout (a resumed run),
    else emptied."""
    directory = plan.work / f"{step}.shards"
    ident = make_key({"step": key, "layout": layout})
    stamp = directory / "KEY"
    if not (stamp.is_file() and stamp.read_text() == ident):
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        stamp.write_text(ident)
    return directory


def _tasks_and_results(pool: WorkerPool, func: Callable, tasks):
    """(task, func(task)) pairs, in task order."""
    sent: deque = deque()

    def remember():
        for task in tasks:
            sent.append(task)
            yield task

    for result in pool.map(func, remember()):
        yield sent.popleft(), result


# ---- step: subword model ----------------------------------------------------------------------

def _uniform_sample(total: int, k: int, rng: np.random.Generator, chunk: int = 1 << 20) -> np.ndarray:
    """``k`` distinct numbers from ``range(total)``, every subset equally likely, ascending: chunk
    by chunk, the chunk's share drawn from the hypergeometric distribution, so that memory is the
    result plus one chunk (``rng.choice(total, k, replace=False)`` can permute all of ``total``)."""
    parts = []
    for start in range(0, total, chunk):
        n = min(chunk, total - start)
        take = int(rng.hypergeometric(n, total - start - n, k)) if total - start > n else k
        parts.append(start + np.sort(rng.choice(n, take, replace=False)))
        k -= take
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def sample_lines(root: Path, paths: list[str], out: str, lines: int, seed: int, block: int = 1 << 24) -> bool:
    """When ``paths`` (relative to ``root``) hold more than ``lines`` lines together, write a
    uniform sample of exactly ``lines`` of them, in file order, to ``out`` and return True. The
    sample depends only on the files' contents, ``lines`` and ``seed``. Two passes over the files
    (counting, then copying the chosen lines a block at a time); memory: the chosen line numbers."""
    counts = []
    for path in paths:
        n = 0
        with open(root / path, "rb") as f:
            while data := f.read(block):
                n += data.count(b"\n")
        counts.append(n)
    if sum(counts) <= lines:
        return False
    chosen = _uniform_sample(sum(counts), lines, np.random.default_rng(seed))
    with atomic_output(root / out) as dst:
        first = 0  # number of the first line of `rest` + the current block, counted over all files
        for path in paths:
            rest = b""
            with open(root / path, "rb") as f:
                while data := f.read(block):
                    whole = (rest + data).split(b"\n")
                    rest = whole.pop()  # an unfinished line waits for the next block
                    lo, hi = np.searchsorted(chosen, [first, first + len(whole)])
                    dst.write(b"".join(whole[i] + b"\n" for i in (chosen[lo:hi] - first).tolist()))
                    first += len(whole)
    return True


def run_subword(plan: Plan, steps: StepLog, key: str) -> dict:
    """A joint SentencePiece model on (a sample of) both cleaned sides."""
    from admin_ds.data.subword import VocabSizeError, train_subword_model

    t0 = time.perf_counter()
    opt = plan.subword
    plan.log(f"[prep] subword: training a joint {opt.model_type} SentencePiece model, vocabulary "
             f"{opt.vocab_size}, on up to {opt.sample_lines} sampled lines")
    # SentencePiece records the input paths inside the model: train from inside the output folder
    # with relative names, so that the model's bytes (and sha256) do not depend on where it lives.
    # The sample is drawn here, not by SentencePiece: its own sampling (input_sentence_size) gives
    # a different model in every process even with a fixed seed, so a rerun or a resume would not
    # reproduce the vocabulary.
    inputs = list(plan.clean_paths())
    if sample_lines(plan.out, inputs, "work/spm.sample", opt.sample_lines, opt.seed):
        inputs = ["work/spm.sample"]
    cwd, out = os.getcwd(), plan.out.resolve()  # resolved before the chdir: plan.out may be relative
    os.chdir(out)
    try:
        train_subword_model(inputs, out / "spm", opt.vocab_size,
                            model_type=opt.model_type, character_coverage=opt.character_coverage,
                            input_sentence_size=0, user_defined_symbols=opt.user_symbols,
                            seed=opt.seed, num_threads=opt.threads)
    except VocabSizeError as e:
        raise PrepError(f"--vocab-size: {e}") from None
    finally:
        os.chdir(cwd)
        (plan.out / "work/spm.sample").unlink(missing_ok=True)
    dt = round(time.perf_counter() - t0, 3)
    plan.log(f"[prep] subword: {dt:.1f}s")
    return steps.mark_done("subword", key, ["spm.model", "spm.vocab"], {"seconds": dt})


# ---- step: binarize the training split --------------------------------------------------------

def run_binarize_train(plan: Plan, steps: StepLog, key: str, clean_stats: dict, pool: WorkerPool) -> dict:
    """Encode the cleaned pairs shard by shard in worker processes, drop those outside the
    length and ratio limits, and concatenate the shards into train.{SRC,TGT}.{bin,idx}."""
    from admin_ds.data.indexed import IndexedDataset, IndexedDatasetWriter
    from admin_ds.data.subword import SubwordModel

    t0 = time.perf_counter()
    vocab = SubwordModel(plan.out / "spm.model").vocab_size
    layout = clean_stats["shards"]  # [lines, src bytes, tgt bytes] of each shard, in order
    directory = shard_folder(plan, "train", key, layout)
    clean_files = tuple(str(plan.out / name) for name in plan.clean_paths())
    offsets = np.cumsum([[0, 0]] + [[s, t] for _, s, t in layout], axis=0)
    f = plan.filters
    shard_stats = {i: record for i in range(len(layout)) if (record := done(directory, shard_name(i)))}
    if shard_stats:
        plan.log(f"[prep] train: {len(shard_stats)} of {len(layout)} shards left from an earlier run reused")
    tasks = [EncodeShard(directory, i, clean_files, (int(offsets[i, 0]), int(offsets[i + 1, 0])),
                         (int(offsets[i, 1]), int(offsets[i + 1, 1])), str(plan.out / "spm.model"),
                         f.min_len, f.max_len, f.ratio, share_words=plan.workers > 1)
             for i in range(len(layout)) if i not in shard_stats]
    with tqdm(total=clean_stats["kept"], unit=" pairs", desc="binarize", disable=plan.quiet or None,
              mininterval=1) as bar:
        for task, record in _tasks_and_results(pool, encode_shard, tasks):
            shard_stats[task.index] = record
            bar.update(layout[task.index][0])
    phases = {"encode": time.perf_counter() - t0}
    stats = {k: sum(shard_stats[i][k] for i in range(len(layout)))
             for k in ("too_short", "too_long", "ratio", "kept", "src_tokens", "tgt_tokens", "src_unk", "tgt_unk")}
    if stats["kept"] == 0:
        raise PrepError(f"no training pairs left after the length filters "
                        f"({f.min_len}..{f.max_len} subwords, ratio {f.ratio}): {_counts(stats)}")
    with IndexedDatasetWriter(plan.out / f"train.{plan.src}", vocab) as w_src, \
            IndexedDatasetWriter(plan.out / f"train.{plan.tgt}", vocab) as w_tgt:
        for i in range(len(layout)):
            w_src.append(IndexedDataset(directory / f"{shard_name(i)}.src"))
            w_tgt.append(IndexedDataset(directory / f"{shard_name(i)}.tgt"))
    phases["merge"] = time.perf_counter() - t0 - phases["encode"]
    stats["phase_seconds"] = {k: round(v, 3) for k, v in phases.items()}
    stats["worker_seconds"], stats["worker_cpu_seconds"] = (
        {"encode": round(sum(shard_stats[i][field] for i in range(len(layout))), 3)} for field in ("seconds", "cpu_seconds"))
    dt = stats["seconds"] = round(time.perf_counter() - t0, 3)
    total = clean_stats["kept"]
    plan.log(f"[prep] train: {stats['kept']} pairs binarized (dropped: too_short {stats['too_short']}, "
             f"too_long {stats['too_long']}, ratio {stats['ratio']}); {dt:.1f}s, {total / max(dt, 1e-9):.0f} pairs/s "
             f"with {plan.workers} worker(s)")
    outputs = [f"train.{lang}.{ext}" for lang in (plan.src, plan.tgt) for ext in ("bin", "idx")]
    record = steps.mark_done("train", key, outputs, stats)
    shutil.rmtree(directory, ignore_errors=True)
    return record


# ---- steps: valid and test --------------------------------------------------------------------

def run_eval_split(plan: Plan, steps: StepLog, key: str, split: str, pairs: dict) -> dict:
    """Binarize a dev/test set unfiltered and keep its text for BLEU (see the module docstring)."""
    from admin_ds.data.indexed import IndexedDatasetWriter
    from admin_ds.data.subword import UNK, SubwordModel

    sp = SubwordModel(plan.out / "spm.model")
    punct = {lang: punct_normalizer(lang) for lang in (plan.src, plan.tgt)}
    normalized = {plan.src: [normalize(s, punct[plan.src]) for s in pairs["src"]],
                  plan.tgt: [normalize(t, punct[plan.tgt]) for t in pairs["tgt"]]}
    text = {plan.src: normalized[plan.src], plan.tgt: pairs["tgt"]}
    stats = dict(pairs["stats"])
    for side, lang in (("src", plan.src), ("tgt", plan.tgt)):
        ids = sp.encode(normalized[lang])
        with IndexedDatasetWriter(plan.out / f"{split}.{lang}", sp.vocab_size) as writer:
            for seq in ids:
                writer.add(np.asarray(seq, dtype=np.int64))
        stats[f"{side}_tokens"] = sum(len(x) for x in ids)
        stats[f"{side}_unk"] = sum(x.count(UNK) for x in ids)
        with atomic_output(plan.out / f"{split}.{lang}") as f:
            f.write("".join(line + "\n" for line in text[lang]).encode("utf-8"))
    plan.log(f"[prep] {split}: {stats['kept']} pairs from {plan.evals[split].describe()} ({plan.eval_names[split]})")
    outputs = [f"{split}.{lang}{ext}" for lang in (plan.src, plan.tgt) for ext in (".bin", ".idx", "")]
    return steps.mark_done(split, key, outputs, stats)


# ---- the manifest -----------------------------------------------------------------------------

def write_data_manifest(plan: Plan, request_key: str, clean: dict, subword: dict, train: dict,
                        evals: dict) -> Path:
    """The manifest of admin_ds.data.binarize (what training reads: languages, subword model,
    splits, checksummed files), extended with what this preparation did."""
    from admin_ds.data.subword import SubwordModel

    sp = SubwordModel(plan.out / "spm.model")
    s, t = plan.src, plan.tgt
    ts = train["stats"]
    splits = {"train": {"lines": ts["kept"], "src_tokens": ts["src_tokens"], "tgt_tokens": ts["tgt_tokens"],
                        "src_unk": ts["src_unk"], "tgt_unk": ts["tgt_unk"]}}
    cs = clean["stats"]
    # Every pair read is either kept or counted under exactly one filter, in the order they apply.
    filters = {"train": {"read": cs["read"], **{k: cs[k] for k in TRAIN_DROPS[:5]},
                         **{k: ts[k] for k in TRAIN_DROPS[5:]}, "kept": ts["kept"]}}
    for split, record in evals.items():
        st = record["stats"]
        splits[split] = {"lines": st["kept"], "src_tokens": st["src_tokens"], "tgt_tokens": st["tgt_tokens"],
                         "src_unk": st["src_unk"], "tgt_unk": st["tgt_unk"]}
        filters[split] = {k: v for k, v in st.items() if not k.endswith(("_tokens", "_unk"))}
    files = ["spm.model", "spm.vocab"]
    for split in ("train", "valid", "test"):
        files += [f"{split}.{lang}.{ext}" for lang in (s, t) for ext in ("bin", "idx")]
        if split != "train":
            files += [f"{split}.{s}", f"{split}.{t}"]
    path = write_manifest(plan.out, {
        "src_lang": s, "tgt_lang": t, "subword_model": "spm.model", "subword_sha256": sp.sha256,
        "vocab_size": sp.vocab_size, "splits": splits, "files": files,
        "filters": filters,
        "seconds": {"clean": cs.get("seconds"), "subword": subword["stats"].get("seconds"),
                    "train": ts.get("seconds")},
        "sources": {"train": [src.describe() for src in plan.train],
                    **{split: plan.evals[split].describe() for split in evals}},
        "eval_sets": dict(plan.eval_names),
        "eval_text": {s: "normalised source (Moses punctuation, non-printing characters), as binarized",
                      t: "original reference (entities unescaped), for detokenized BLEU"},
        "subword": asdict(plan.subword),
        "length_filter": asdict(plan.filters),
        "dedup": "exact normalised pairs, 64-bit blake2b digests",
        "prep_version": PREP_VERSION, "prep_key": request_key,
        "command": plan.command, "tool_versions": _tool_versions(),
    })
    plan.log(f"[prep] manifest: {path}")
    return path


def _tool_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("sacremoses", "sentencepiece", "numpy", "tqdm", "datasets"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out
