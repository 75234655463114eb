"""Encoding with the word cache (admin_ds.data.subword.WordCachedEncoder) against SentencePiece's
batched encode, on the same cleaned real text, with the ids compared.

    python bench/word_cache.py

The text is the data-preparation benchmark's corpus (bench/data_prep.py: ~45k En-De pairs of
newstest2013/2014, Multi30k train and the OpenNMT WMT sample), cleaned as data preparation cleans
it, per side: once as it is (x1: every word new to the cache) and as 8 copies with a copy number
appended (x8: the words repeat, as a large corpus's do). Both encoders run one thread, in shards
of 9,730 lines as data preparation's workers do; the model is a joint BPE model (vocabulary
8,000) trained on the cleaned text.
"""

from __future__ import annotations

import importlib.util
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from admin_ds.data.subword import SubwordModel, WordCachedEncoder, train_subword_model  # noqa: E402
from data_prep.clean import PunctNormalizer, decode_side, normalize_lines  # noqa: E402

SHARD = 9730


def corpus() -> dict[str, list[str]]:
    spec = importlib.util.spec_from_file_location("data_prep_bench", ROOT / "bench" / "data_prep.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    pairs = bench.base_pairs()
    sides = {"en": [en for en, _ in pairs], "de": [de for _, de in pairs]}
    return {lang: [line for line in normalize_lines([decode_side(x) for x in lines], PunctNormalizer(lang)) if line]
            for lang, lines in sides.items()}


def timed(encode, shards: list[list[str]]) -> tuple[float, np.ndarray, np.ndarray]:
    t = time.perf_counter()
    out = [encode(shard) for shard in shards]
    seconds = time.perf_counter() - t
    return seconds, np.concatenate([o[0] for o in out]), np.concatenate([o[1] for o in out])


def main() -> None:
    text = corpus()
    with tempfile.TemporaryDirectory() as tmp:
        files = []
        for lang, lines in text.items():
            files.append(Path(tmp) / f"train.{lang}")
            files[-1].write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        model = SubwordModel(train_subword_model(files, Path(tmp) / "spm", 8000, model_type="bpe",
                                                 input_sentence_size=0, seed=1), num_threads=1)

    def plain(lines):
        encoded = model.encode(lines)
        lengths = np.fromiter(map(len, encoded), np.int64, len(encoded))
        return np.fromiter((i for e in encoded for i in e), np.int64, int(lengths.sum())), lengths

    print(f"{platform.processor() or platform.machine()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| text | lines | SentencePiece us/line | word cache us/line | speed-up | ids equal |")
    print("|---|---:|---:|---:|---:|---|")
    for lang, lines in text.items():
        for copies in (1, 8):
            all_lines = [line + (f" ({k})" if k else "") for k in range(copies) for line in lines]
            shards = [all_lines[i:i + SHARD] for i in range(0, len(all_lines), SHARD)]
            cached = WordCachedEncoder(model)
            t_plain, ids_a, len_a = timed(plain, shards)
            t_cache, ids_b, len_b = timed(lambda s: cached.encode_text("".join(x + "\n" for x in s)), shards)
            equal = np.array_equal(ids_a, ids_b) and np.array_equal(len_a, len_b)
            n = len(all_lines)
            print(f"| {lang} x{copies} | {n:,} | {t_plain / n * 1e6:.2f} | {t_cache / n * 1e6:.2f} | "
                  f"{t_plain / t_cache:.2f}x | {equal} |")


if __name__ == "__main__":
    main()
