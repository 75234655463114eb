"""Prepare WMT14 En-De / En-Fr (or any pair from local files) for training.

    bash data_prep/prepare_wmt14.sh en-de data/wmt14_en_de                      # datasets hub
    bash data_prep/prepare_wmt14.sh en-fr data/wmt14_en_fr --workers 16
    bash data_prep/prepare_wmt14.sh en-de out --raw-dir ~/wmt14 \\
        --train-prefix europarl-v7.de-en commoncrawl.de-en news-commentary-v9.de-en
    python -m data_prep.prepare en-fr out --raw-dir ../shared/data/newscommentary-enfr-5k \\
        --train-prefix nc-5k --valid-prefix test --test-prefix test --vocab-size 2000

Reads the sources, runs the steps of :mod:`data_prep.pipeline` (each skipped when already done
with the same inputs and options) and writes a data directory that
``admin_ds.data.binarize.load_manifest`` / ``open_split`` read. Problems with the input or the
output folder end the run with ``error: ...`` on stderr and exit status 2, without a traceback
and without a manifest. The full description is data_prep/README.md.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from admin_ds.arguments import corpus_pair, existing_path, float_in, input_file, int_in
from admin_ds.files import describe_os_error
from data_prep import PrepError
from data_prep.pipeline import FilterOptions, Plan, SubwordOptions, prepare
from data_prep.sources import (FilePairs, TsvPairs, find_json_split, find_side,
                               load_hub_split, load_json_split)

DEFAULT_VOCAB = {frozenset(("en", "de")): 32_000, frozenset(("en", "fr")): 40_000}
WMT14_LANGS = ("cs", "de", "fr", "hi", "ru")  # the `datasets` builder's configs: XX-en
FILTERED_TEST_LINES = 2737
EVAL_MAX_LINE_BYTES = 1 << 20  # dev/test lines are never dropped for length; this only bounds memory


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=os.environ.get("DATA_PREP_ARGV0", "python -m data_prep.prepare"), description="WMT14 (or local parallel text) -> binarized data directory.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("pair", type=corpus_pair, help="language pair SRC-TGT: en-de or en-fr (any pair with local files); "
                                "the first language is the source")
    p.add_argument("out_dir", type=Path, help="output data directory (created; re-runs resume in it)")
    src = p.add_argument_group("sources (default: the datasets library's wmt14 builder)")
    src.add_argument("--raw-dir", type=existing_path, help="local files: training, dev and test text")
    src.add_argument("--train-prefix", nargs="+", metavar="NAME",
                     help="training corpora in --raw-dir: NAME.SRC / NAME.TGT (plain, .gz or .sgm); "
                          "default 'train' unless --tsv is given")
    src.add_argument("--valid-prefix", default="newstest2013", metavar="NAME", help="dev set in --raw-dir")
    src.add_argument("--test-prefix", metavar="NAME",
                     help="test set in --raw-dir (default newstest2014, or newstest2014-filtered "
                          "with --filtered-test)")
    src.add_argument("--tsv", nargs="+", type=input_file, metavar="FILE",
                     help="training pairs as SRC<TAB>TGT lines (plain or gzip); needs --raw-dir for dev/test")
    src.add_argument("--json-dir", type=Path,
                     help="train/validation/test .jsonl files of {'translation': {SRC: ..., TGT: ...}} "
                          "records, read with datasets' json loader")
    src.add_argument("--hf-dataset", default="wmt14", help="datasets hub name of the WMT14 builder")
    src.add_argument("--hf-cache-dir", help="datasets cache (default: HF_DATASETS_CACHE or ~/.cache)")
    src.add_argument("--filtered-test", action="store_true",
                     help=f"En-De only: use the filtered {FILTERED_TEST_LINES}-line newstest2014 "
                          "(local files: --raw-dir with newstest2014-filtered.{en,de} or .sgm)")
    sw = p.add_argument_group("subword model")
    sw.add_argument("--vocab-size", type=int_in(8), help="joint vocabulary (default 32000 En-De, 40000 En-Fr)")
    sw.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe")
    sw.add_argument("--user-symbols", nargs="*", default=["<BT>"], metavar="SYM",
                    help="reserved pieces (ids 4, 5, ...); '<BT>' tags back-translated sources")
    sw.add_argument("--spm-sample-lines", type=int_in(1), default=10_000_000,
                    help="lines sampled from both cleaned sides to train SentencePiece")
    sw.add_argument("--spm-threads", type=int_in(1), default=8,
                    help="SentencePiece trainer threads (the model depends on it: kept fixed by default)")
    sw.add_argument("--character-coverage", type=float_in(0, 1, low_open=True), default=1.0)
    sw.add_argument("--seed", type=int_in(0, 2**32 - 1), default=1,
                    help="subword sample and SentencePiece (whose seed is an unsigned 32-bit integer)")
    fl = p.add_argument_group("training-pair filters")
    fl.add_argument("--min-len", type=int_in(0), default=1, help="minimum subwords per side")
    fl.add_argument("--max-len", type=int_in(1), default=250, help="maximum subwords per side")
    fl.add_argument("--ratio", type=float_in(1), default=1.5, help="maximum length ratio between the sides")
    fl.add_argument("--max-line-bytes", type=int_in(16), default=4096,
                    help="training lines longer than this (in UTF-8 bytes) are dropped while reading")
    run = p.add_argument_group("running")
    run.add_argument("--workers", type=int_in(1), default=_cpus(),
                     help="worker processes: each cleans, deduplicates and encodes its own shards")
    run.add_argument("--chunk-lines", type=int_in(1), default=10_000,
                     help="pairs per shard (the output does not depend on it)")
    run.add_argument("--remove-work", action="store_true",
                     help="delete OUT/work (cleaned text, step records) at the end")
    run.add_argument("--quiet", action="store_true", help="no progress bars")
    return p.parse_args(argv)


def _cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return os.cpu_count() or 1


def check_user_symbols(symbols: list[str]) -> None:
    """What the subword step refuses (admin_ds/data/subword.py), refused before the cleaning."""
    from admin_ds.data.subword import SPECIAL_PIECES

    for i, sym in enumerate(symbols):
        if not sym:
            raise PrepError("--user-symbols: an empty symbol")
        if sym in SPECIAL_PIECES.values():
            raise PrepError(f"--user-symbols: {sym} is a special piece (ids 0-3: "
                            f"{' '.join(SPECIAL_PIECES[k] for k in sorted(SPECIAL_PIECES))})")
        if sym in symbols[:i]:
            raise PrepError(f"--user-symbols: {sym} is given twice")


def build_plan(args: argparse.Namespace, argv: list[str]) -> Plan:
    """Check the options and find every input; raises PrepError naming what is wrong."""
    s, t = args.pair.split("-")  # checked by argparse (admin_ds.arguments.corpus_pair)
    vocab = args.vocab_size or DEFAULT_VOCAB.get(frozenset((s, t)))
    if vocab is None:
        raise PrepError(f"no default vocabulary size for {s}-{t}: give --vocab-size")
    if args.max_len < args.min_len:
        raise PrepError(f"--max-len {args.max_len} is below --min-len {args.min_len}")
    check_user_symbols(args.user_symbols)
    if args.json_dir and (args.raw_dir or args.tsv):
        raise PrepError("--json-dir cannot be combined with --raw-dir or --tsv: choose one source")
    if args.tsv and not args.raw_dir:
        raise PrepError("--tsv gives the training pairs only: the dev and test files come from --raw-dir DIR")
    if args.filtered_test:
        if {s, t} != {"en", "de"}:
            raise PrepError("--filtered-test exists for En-De only (the 2,737-line newstest2014)")
        if not args.raw_dir:
            raise PrepError("--filtered-test needs local files: the datasets builder and this folder's "
                            "defaults have the full 3,003-line newstest2014 only. Give --raw-dir with "
                            "newstest2014-filtered.en/.de (e.g. sacrebleu -t wmt14 -l en-de --echo src/ref), "
                            "or the SGML newstest2014-deen-{src,ref}.*.sgm of WMT14's test/ folder "
                            "with --test-prefix")

    filters = FilterOptions(args.min_len, args.max_len, args.ratio, args.max_line_bytes)
    test_prefix = args.test_prefix or ("newstest2014-filtered" if args.filtered_test else "newstest2014")
    if args.raw_dir:
        if not args.raw_dir.is_dir():
            raise PrepError(f"{args.raw_dir}: --raw-dir is not a directory")
        prefixes = args.train_prefix if args.train_prefix is not None else ([] if args.tsv else ["train"])
        train = [FilePairs(find_side(args.raw_dir, pre, s, (s, t)), find_side(args.raw_dir, pre, t, (s, t)),
                           args.max_line_bytes) for pre in prefixes]
        train += [TsvPairs(path, args.max_line_bytes) for path in args.tsv or []]
        evals = {split: FilePairs(find_side(args.raw_dir, pre, s, (s, t)), find_side(args.raw_dir, pre, t, (s, t)),
                                  EVAL_MAX_LINE_BYTES)
                 for split, pre in (("valid", args.valid_prefix), ("test", test_prefix))}
        names = {"valid": args.valid_prefix, "test": test_prefix}
    elif args.json_dir:
        if not args.json_dir.is_dir():
            raise PrepError(f"{args.json_dir}: --json-dir is not a directory")
        load = {split: load_json_split(find_json_split(args.json_dir, split), split, s, t, args.hf_cache_dir)
                for split in ("train", "validation", "test")}
        train, evals = [load["train"]], {"valid": load["validation"], "test": load["test"]}
        names = {"valid": "validation split of --json-dir", "test": "test split of --json-dir"}
    else:
        other = t if s == "en" else s
        if "en" not in (s, t) or other not in WMT14_LANGS:
            raise PrepError(f"the wmt14 builder has {', '.join(l + '-en' for l in WMT14_LANGS)} (either "
                            f"direction); for {s}-{t} give local files with --raw-dir, --tsv or --json-dir")
        config = f"{other}-en"
        load = {split: load_hub_split(args.hf_dataset, config, split, s, t, args.hf_cache_dir)
                for split in ("train", "validation", "test")}
        train, evals = [load["train"]], {"valid": load["validation"], "test": load["test"]}
        names = {"valid": "newstest2013 (wmt14 validation)", "test": "newstest2014 full, 3003 lines (wmt14 test)"}

    argv0 = os.environ.get("DATA_PREP_ARGV0", "python -m data_prep.prepare")
    return Plan(src=s, tgt=t, out=args.out_dir, train=train, evals=evals, eval_names=names,
                subword=SubwordOptions(vocab, args.model_type, tuple(args.user_symbols), args.spm_sample_lines,
                                       args.spm_threads, args.seed, args.character_coverage),
                filters=filters, workers=args.workers, chunk_lines=args.chunk_lines, quiet=args.quiet,
                remove_work=args.remove_work, command=" ".join([argv0, shlex.join(argv)]),
                expect_test_lines=FILTERED_TEST_LINES if args.filtered_test else None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    try:
        prepare(build_plan(args, argv))
    except PrepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. disk full, or the output folder removed while running
        print(f"error: {describe_os_error(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
