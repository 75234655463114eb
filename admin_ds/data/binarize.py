"""Text -> subword ids -> indexed dataset, and the data directory's manifest.

A data directory holds, for languages SRC and TGT:

    manifest.json               counts, checksums, subword model hash, provenance
    spm.model                   the joint SentencePiece model (fairseq special ids)
    {split}.{SRC,TGT}.{bin,idx} binarized splits (train, valid, test, ...)
    {split}.{SRC,TGT}           raw text of evaluation splits, for detokenized BLEU

The manifest is written last and atomically: a directory without one is incomplete, and a file
whose checksum differs from the manifest is refused when the directory is opened.
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Iterable, Iterator

from admin_ds import files
from admin_ds.data.indexed import IndexedDataset, IndexedDatasetWriter, ParallelDataset

MANIFEST = "manifest.json"
FORMAT = "admin-ds-data"
VERSION = 1


def binarize_lines(subword, lines: Iterable[str], prefix: str | os.PathLike, chunk_lines: int = 20000) -> dict:
    """Encode ``lines`` with ``subword`` (a SubwordModel) and write ``prefix.{bin,idx}``.
    Streams in chunks: memory does not grow with the corpus."""
    n_lines = n_tokens = n_unk = 0
    lines = iter(lines)
    with IndexedDatasetWriter(prefix, subword.vocab_size) as writer:
        while chunk := list(itertools.islice(lines, chunk_lines)):
            for ids in subword.encode(chunk):
                writer.add(ids)
                n_lines += 1
                n_tokens += len(ids)
                n_unk += sum(1 for i in ids if i == subword.unk_id)
    return {"lines": n_lines, "tokens": n_tokens, "unk": n_unk}


def read_text(path: str | os.PathLike) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield line.rstrip("\n")


def write_manifest(data_dir: str | os.PathLike, manifest: dict) -> Path:
    """Checksum every file the manifest lists and write it atomically, last."""
    data_dir = Path(data_dir)
    manifest = dict(manifest, format=FORMAT, version=VERSION, created=time.strftime("%Y-%m-%dT%H:%M:%S"),
                    versions={"python": platform.python_version(), **_package_versions()})
    manifest["files"] = {name: files.sha256_file(data_dir / name) for name in sorted(manifest["files"])}
    files.write_text(data_dir / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    return data_dir / MANIFEST


def _package_versions() -> dict:
    out = {}
    for name in ("sentencepiece", "numpy", "torch"):
        mod = sys.modules.get(name)
        if mod is not None:
            out[name] = getattr(mod, "__version__", "?")
    return out


def load_manifest(data_dir: str | os.PathLike, verify: bool = True) -> dict:
    """Read and check a data directory: every listed file present and, with ``verify``, its
    checksum equal to the manifest's. Errors name the directory and the file."""
    data_dir = Path(data_dir)
    path = data_dir / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{data_dir}: no {MANIFEST}; the directory is missing or its preparation "
                                "did not finish (re-run the data preparation)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON: {e}") from None
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: not an admin-ds data manifest (format={manifest.get('format')!r})")
    check_listed_files(data_dir, manifest, verify=None if verify else ())
    return manifest


def check_listed_files(data_dir: str | os.PathLike, manifest: dict, verify=None) -> None:
    """Every file the manifest lists is present; those named in ``verify`` (all of them when None)
    match their checksum. Errors name the directory and the file."""
    data_dir = Path(data_dir)
    for name, digest in manifest.get("files", {}).items():
        f = data_dir / name
        if f.exists() and not f.is_file():  # a directory, or a FIFO whose checksum would wait for a writer
            raise ValueError(f"{data_dir}: {name}, listed in {MANIFEST}, is not a regular file")
        if not f.is_file():
            raise FileNotFoundError(f"{data_dir}: {name} is listed in {MANIFEST} but missing")
        if (verify is None or name in verify) and files.sha256_file(f) != digest:
            raise ValueError(f"{data_dir}: {name} does not match its checksum in {MANIFEST} "
                             "(modified or corrupt; re-run the data preparation)")


def reversed_manifest(manifest: dict) -> dict:
    """The manifest of the same directory read in the other direction: source and target swapped
    (languages and per-split token counts); the files and the subword model are the same."""
    out = dict(manifest, src_lang=manifest["tgt_lang"], tgt_lang=manifest["src_lang"])
    out["splits"] = {name: dict(split, src_tokens=split.get("tgt_tokens"), tgt_tokens=split.get("src_tokens"))
                     for name, split in manifest.get("splits", {}).items()}
    return out


def direction(manifest: dict) -> str:
    return f"{manifest['src_lang']}-{manifest['tgt_lang']}"


def open_split(data_dir: str | os.PathLike, split: str, manifest: dict) -> ParallelDataset:
    data_dir = Path(data_dir)
    if split not in manifest["splits"]:
        raise KeyError(f"{data_dir}: no split {split!r}; available: {', '.join(manifest['splits'])}")
    s, t = manifest["src_lang"], manifest["tgt_lang"]
    return ParallelDataset(IndexedDataset(data_dir / f"{split}.{s}"), IndexedDataset(data_dir / f"{split}.{t}"))


def prepare_default_data(out_dir: str | os.PathLike, n_pairs: int = 30000, vocab_size: int = 1000,
                         seed: int = 1234, log=print) -> Path:
    """The embedded default: a generated corpus (corpus.py), a joint SentencePiece model trained on
    its training split, binarized splits and a manifest. Skipped when already complete."""
    from admin_ds.data.corpus import SRC_LANG, TGT_LANG, write_default_corpus
    from admin_ds.data.subword import SubwordModel, train_subword_model

    out = Path(out_dir)
    if (out / MANIFEST).is_file():
        try:
            m = load_manifest(out)
            if m.get("generator") == {"n_pairs": n_pairs, "vocab_size": vocab_size, "seed": seed}:
                log(f"[data] embedded default corpus already prepared in {out}")
                return out
        except (ValueError, FileNotFoundError) as e:
            log(f"[data] rebuilding {out}: {e}")
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)
    t0 = time.perf_counter()
    n_eval = max(200, min(1000, n_pairs // 30))
    corpus = write_default_corpus(out, n_train=n_pairs, n_valid=n_eval, n_test=n_eval, seed=seed)
    texts = corpus["files"]
    train_subword_model([texts["train"][SRC_LANG], texts["train"][TGT_LANG]], out / "spm", vocab_size, seed=seed)
    spm = SubwordModel(out / "spm.model")
    splits, listed = {}, ["spm.model"]
    for split in ("train", "valid", "test"):
        stats = {}
        for lang in (SRC_LANG, TGT_LANG):
            stats[lang] = binarize_lines(spm, read_text(texts[split][lang]), out / f"{split}.{lang}")
            listed += [f"{split}.{lang}.bin", f"{split}.{lang}.idx"]
        splits[split] = {"lines": stats[SRC_LANG]["lines"], "src_tokens": stats[SRC_LANG]["tokens"],
                         "tgt_tokens": stats[TGT_LANG]["tokens"]}
        if split != "train":
            listed += [f"{split}.{SRC_LANG}", f"{split}.{TGT_LANG}"]
    write_manifest(out, {
        "src_lang": SRC_LANG, "tgt_lang": TGT_LANG, "subword_model": "spm.model",
        "subword_sha256": spm.sha256, "vocab_size": spm.vocab_size, "splits": splits, "files": listed,
        "generator": {"n_pairs": n_pairs, "vocab_size": vocab_size, "seed": seed},
        "command": "admin_ds.data.binarize.prepare_default_data"})
    log(f"[data] embedded default corpus: {n_pairs} training pairs, vocabulary {spm.vocab_size}, "
        f"prepared in {out} ({time.perf_counter() - t0:.1f}s)")
    return out
