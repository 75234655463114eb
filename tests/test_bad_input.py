"""Bad and hostile input to every command, through its real command line.

Each case runs one entry point as a process of its own (train, prepare, backtranslate, translate,
average, export, evaluate, analyze, models, cluster_env, atlas) and asserts what a user must get: a
non-zero exit, one ``error:`` line (or argparse's usage error) naming the file, field or argument,
no traceback, and nothing written into the case's folder that a later step could take for complete
(a checkpoint, a model file, an output directory). A hostile checkpoint, a pickle that creates a
folder when it is unpickled, with the digests in ``COMPLETE`` rewritten to match, is given to every
loader: each refuses it and the folder is never created.

The cases share one tiny run (4 updates, a checkpoint every 2) and its averaged model file; they
only read them (checked at the end). Every case gets its own folder for what it changes. The
commands run two at a time, each as ``python SCRIPT ARGS`` runs it, in a process forked from one
that has imported torch already (tests/prefork.py: the import is most of a refused command's time).
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch

from conftest import overrides
from distributed import REPO
from faults import unwritable_dir
from prefork import Prefork
from test_data_prep import synthetic_corpus

from admin_ds import safe_load

ENV = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
SCRIPTS = {"train": "launch/train.py", "translate": "launch/translate.py",
           "average": "launch/average_checkpoints.py", "export": "launch/export.py",
           "evaluate": "launch/evaluate.py", "analyze": "launch/analyze.py", "models": "launch/models.py",
           "cluster_env": "launch/cluster_env.py", "prepare": "data_prep/prepare.py",
           "backtranslate": "data_prep/backtranslate.py", "atlas": "launch/atlas.py"}
ZERO1, ZERO2 = str(REPO / "ds_configs/zero1.json"), str(REPO / "ds_configs/zero2.json")
MAY_CHANGE = {"run_config.json", "ds_config.json", "metrics.jsonl", ".lock", ".prepare.lock", "CORRUPT"}


class Plant:
    """What a hostile checkpoint holds: unpickling it calls ``os.makedirs(marker)``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return os.makedirs, (self.marker,)


@dataclass
class Shared:
    data: Path   # a prepared data directory
    run: Path    # a finished run: checkpoints update_000002 and update_000004
    model: Path  # a model file averaged from that run
    text: Path   # source sentences


class Ctx:
    """One case's folder and the shared inputs; helpers that make bad files in the folder."""

    def __init__(self, shared: Shared, tmp: Path) -> None:
        self.shared, self.tmp = shared, tmp
        self.marker = tmp.parent / f"{tmp.name}.PLANTED"  # outside the folder, so never in its snapshot
        tmp.mkdir(parents=True)

    def __getattr__(self, name):
        return getattr(self.shared, name)

    def file(self, name: str, content: str | bytes) -> Path:
        path = self.tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return path

    def copy_run(self) -> Path:
        return Path(shutil.copytree(self.run, self.tmp / "run"))

    def copy_model(self) -> Path:
        return Path(shutil.copy(self.model, self.tmp / "model.pt"))

    def plant(self, path: Path) -> Path:
        """Add a ``Plant`` to a torch file, keeping what it held, and make the digests of its tag's
        ``COMPLETE`` (if any) match the new bytes."""
        blob = safe_load.load(path)
        if isinstance(blob, dict):
            blob["extra"] = Plant(self.marker)
        else:
            blob = {"data": blob, "extra": Plant(self.marker)}
        torch.save(blob, path)
        rewrite_digest(path)
        return path

    def rewrite_model_file(self, **changes) -> Path:
        """The model file with fields changed (a tampered or an old file), saved again."""
        path = self.copy_model()
        blob = torch.load(path, weights_only=True)
        for key, value in changes.items():
            if value is None:
                blob.pop(key)
            else:
                blob[key] = value(blob) if callable(value) else value
        torch.save(blob, path)
        return path

    def tag(self, run: Path, update: int = 4) -> Path:
        return run / "checkpoints" / f"update_{update:06d}"

    def train(self, *extra, ds=ZERO1, run_dir=None) -> list:
        run_dir = run_dir or self.tmp / "run"
        return ["--deepspeed_config", ds, *overrides(run_dir, self.data, *extra)]


def rewrite_digest(path: Path) -> None:
    complete = path.parent / "COMPLETE"
    if complete.is_file():
        info = json.loads(complete.read_text())
        if path.name in info.get("files", {}):
            info["files"][path.name] = [path.stat().st_size, hashlib.sha256(path.read_bytes()).hexdigest()]
        complete.write_text(json.dumps(info) + "\n")


def flip_byte(path: Path, offset: int = -100) -> Path:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
    return path


def strip_digests(tag: Path) -> Path:
    info = json.loads((tag / "COMPLETE").read_text())
    info.pop("files")
    (tag / "COMPLETE").write_text(json.dumps(info) + "\n")
    return tag


def tear(tag: Path) -> Path:
    (tag / "COMPLETE").write_text('{"update": 4, "files": {')  # a marker whose write was cut short
    return tag


def every_tag(ctx: "Ctx", change: Callable[[Path], object]) -> Path:
    run = ctx.copy_run()
    for update in (2, 4):
        change(ctx.tag(run, update))
    return run


@dataclass
class Case:
    id: str
    command: str
    argv: Callable[[Ctx], list]  # builds the case's files in ctx.tmp and returns the arguments
    expect: tuple[str, ...]      # in the error line
    rc: int = 2
    hostile: bool = False        # the marker must never appear

    @property
    def param(self):
        return pytest.param(self, id=f"{self.command}-{self.id}")


def ds(ctx: Ctx, name: str, content) -> str:
    return str(ctx.file(name, content if isinstance(content, (str, bytes)) else json.dumps(content)))


def raw(ctx: Ctx, **damage) -> Path:
    """A small En-De corpus in ctx.tmp/raw; ``damage``: file name -> callable(path)."""
    directory = synthetic_corpus(ctx.tmp / "raw", n=120)
    for name, change in damage.items():
        change(directory / name.replace("_", "."))
    return directory


def to_dir(path: Path) -> None:
    path.unlink()
    path.mkdir()


def truncate_lines(keep: int) -> Callable[[Path], None]:
    return lambda p: p.write_text("".join(p.read_text().splitlines(True)[:keep]))


def gzip_half(path: Path) -> None:
    import gzip

    data = gzip.compress(path.read_bytes())
    path.unlink()
    path.with_name(path.name + ".gz").write_bytes(data[: len(data) // 2])


PREP = ("--vocab-size", "60", "--workers", "1", "--quiet")


def bt(ctx: Ctx, *extra, model=None) -> list:
    mono = ctx.file("mono.de", "Das Haus ist klein.\nDer Hund läuft.\n")
    # The shared model translates the bitext's direction, not the reverse one back-translation
    # wants: these cases are about other inputs (the direction's is tests/test_backtranslate.py's).
    return ["--model", model or ctx.model, "--mono", mono, "--bitext", ctx.data, "--out", ctx.tmp / "bt",
            "--method", "beam", "--beam", "1", "--any-direction", *extra]


# Billion laughs: nine levels of nine aliases, 9^9 values once expanded, 400 bytes on disk.
ALIAS_BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi"))
LINE_BOUND = 1 << 20  # admin_ds.files.MAX_LINE_BYTES
CONFIG_BOUND = 1 << 20  # admin_ds.files.MAX_CONFIG_BYTES


def long_line(ctx: Ctx, name: str, before: str = "") -> Path:
    """A text file whose line after ``before`` has no newline within the line bound."""
    return ctx.file(name, before.encode() + b"x" * (LINE_BOUND + 1))


def unwritable(ctx: Ctx) -> Path:
    return Path(unwritable_dir(ctx.tmp))


def link_loop(ctx: Ctx) -> Path:
    loop = ctx.tmp / "loop"
    loop.symlink_to(loop)
    return loop


def link(ctx: Ctx, name: str, target: Path) -> Path:
    path = ctx.tmp / name
    path.symlink_to(target)
    return path


def swap_subword_model(ctx: Ctx) -> Path:
    """A copy of the data directory whose spm.model is another file than the one its manifest records."""
    data = Path(shutil.copytree(ctx.data, ctx.tmp / "d"))
    flip_byte(data / "spm.model", -10)
    return data


def fifo_in_data(ctx: Ctx, name: str) -> Path:
    """A copy of the data directory in which ``name`` is a FIFO: reading it for its checksum would
    wait for a writer that never comes."""
    data = Path(shutil.copytree(ctx.data, ctx.tmp / "d"))
    (data / name).unlink()
    os.mkfifo(data / name)
    return data


def unlist_subword_model(ctx: Ctx) -> Path:
    data = Path(shutil.copytree(ctx.data, ctx.tmp / "d"))
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["files"].pop("spm.model")
    (data / "manifest.json").write_text(json.dumps(manifest))
    return data


def tag_link_out(ctx: Ctx) -> list:
    """A run copy whose checkpoints/ holds a link to a tag of another run."""
    run = ctx.copy_run()
    (run / "checkpoints" / "elsewhere").symlink_to(ctx.tag(ctx.run))
    return ["--checkpoint", run, "--tag", "elsewhere", "--input", ctx.text]


def atlas(ctx: Ctx, *extra) -> list:
    return ["--data", ctx.data, "--out", ctx.tmp / "atlas", "--updates", "2", *extra]


def tr(ctx: Ctx, *extra) -> list:
    return ["--checkpoint", ctx.model, "--input", ctx.text, *extra]


def avg(ctx: Ctx, out) -> list:
    return ["--run", ctx.run, "--last", "2", "--out", out]


def avg_copy(ctx: Ctx, out: Callable[[Path], Path]) -> list:
    run = ctx.copy_run()
    return ["--run", run, "--last", "2", "--out", out(run)]


CASES = [
    # ---- train: the run config -------------------------------------------------------------
    Case("config-missing", "train", lambda c: [*c.train(), "--config", c.tmp / "nope.yaml"], ("nope.yaml",)),
    Case("config-directory", "train", lambda c: [*c.train(), "--config", c.tmp], ("directory",)),
    Case("config-invalid-yaml", "train", lambda c: [*c.train(), "--config", c.file("r.yaml", "train:\n  a: [1,\n")],
         ("r.yaml:3", "invalid YAML")),
    Case("config-binary", "train", lambda c: [*c.train(), "--config", c.file("r.yaml", b"\xff\xfe\x00\x81garbage")],
         ("r.yaml", "UTF-8")),
    Case("config-unknown-section", "train",
         lambda c: [*c.train(), "--config", c.file("r.yaml", "trian:\n  max_updates: 2\n")],
         ("r.yaml", "trian", "did you mean train")),
    Case("config-list-for-section", "train", lambda c: [*c.train(), "--config", c.file("r.yaml", "optim: [1, 2]\n")],
         ("r.yaml", "optim")),
    Case("override-unknown-key", "train", lambda c: c.train("--optim.lrr=1"), ("optim.lrr", "did you mean")),
    Case("override-unknown-section", "train", lambda c: c.train("--optimiser.lr=1"), ("optimiser",)),
    Case("override-decimal-for-int", "train", lambda c: c.train("--train.max_updates=2.5"),
         ("train.max_updates", "2.5")),
    Case("override-scalar-for-pair", "train", lambda c: c.train("--optim.betas=0.9"), ("optim.betas",)),
    Case("override-word-for-float", "train", lambda c: c.train("--optim.lr=fast"), ("optim.lr", "fast")),
    Case("override-bad-choice", "train", lambda c: c.train("--model.init=magic"), ("model.init", "magic")),
    Case("valid-interval-0", "train", lambda c: c.train("--train.valid_interval_updates=0"),
         ("train.valid_interval_updates", "positive")),
    Case("max-epochs-0", "train", lambda c: c.train("--train.max_epochs=0"), ("train.max_epochs", "positive")),
    Case("warmup-init-lr-negative", "train", lambda c: c.train("--optim.warmup_init_lr=-1e-7"),
         ("optim.warmup_init_lr", ">= 0")),
    # found at set-up, not at the first validation or after the whole run
    Case("valid-split-unknown", "train", lambda c: c.train("--data.valid_split=newstest2013"),
         ("data.valid_split", "no split 'newstest2013'", "valid")),
    Case("test-split-unknown", "train", lambda c: c.train("--data.test_split=newstest2014", "--train.final_eval=true"),
         ("data.test_split", "no split 'newstest2014'")),
    Case("keep-best-between-validations", "train",
         lambda c: c.train("--train.keep_best=2", "--train.valid_interval_updates=4", "--train.save_interval_updates=6"),
         ("train.keep_best", "multiple", "(6)", "(4)")),
    # ---- train: the DeepSpeed JSON ----------------------------------------------------------
    Case("ds-missing", "train", lambda c: c.train(ds=str(c.tmp / "none.json")), ("none.json",)),
    Case("ds-directory", "train", lambda c: c.train(ds=str(c.tmp)), ("directory",)),
    Case("ds-invalid-json", "train", lambda c: c.train(ds=ds(c, "d.json", '{"zero_optimization": {\n')),
         ("d.json:2", "invalid JSON")),
    Case("ds-binary", "train", lambda c: c.train(ds=ds(c, "d.json", b"\xff\xfe{}")), ("d.json",)),
    Case("ds-list", "train", lambda c: c.train(ds=ds(c, "d.json", [1, 2])), ("d.json", "object")),
    Case("ds-misspelt-section", "train",
         lambda c: c.train(ds=ds(c, "d.json", {"zero_optimisation": {"stage": 2}})),
         ("d.json", "zero_optimisation", "did you mean zero_optimization")),
    Case("ds-nested-unknown-key", "train", lambda c: c.train(ds=ds(c, "d.json", {"zero_optimization": {"stag": 1}})),
         ("d.json", "stag")),
    Case("ds-stage-7", "train", lambda c: c.train(ds=ds(c, "d.json", {"zero_optimization": {"stage": 7}})),
         ("d.json", "zero_optimization.stage", "7")),
    Case("ds-accumulation-0", "train", lambda c: c.train(ds=ds(c, "d.json", {"gradient_accumulation_steps": 0})),
         ("d.json", "gradient_accumulation_steps")),
    Case("ds-list-for-section", "train", lambda c: c.train(ds=ds(c, "d.json", {"zero_optimization": [1]})),
         ("d.json", "zero_optimization")),
    Case("ds-string-for-bool", "train", lambda c: c.train(ds=ds(c, "d.json", {"bf16": {"enabled": "yes"}})),
         ("d.json", "bf16.enabled")),
    # ---- train: data, profile, run directory ------------------------------------------------
    Case("data-missing", "train", lambda c: c.train(f"--data.path={c.tmp / 'nodata'}"), ("data.path", "nodata")),
    Case("data-changed", "train",
         lambda c: c.train(f"--data.path={flip_byte(Path(shutil.copytree(c.data, c.tmp / 'd')) / 'train.en.bin').parent}"),
         ("data.path", "train.en.bin")),
    Case("sentence-longer-than-batch", "train", lambda c: c.train("--data.max_tokens=8"),
         ("data.max_tokens", "train", "line")),
    Case("profile-missing", "train", lambda c: [*c.train(), "--profile", c.tmp / "p.json"], ("--profile", "p.json")),
    Case("profile-garbage", "train", lambda c: [*c.train(), "--profile", c.file("p.json", "{not json")], ("p.json",)),
    Case("profile-binary", "train", lambda c: [*c.train(), "--profile", c.file("p.json", b"\x80\x81\x82")], ("p.json",)),
    Case("run-dir-is-file", "train", lambda c: c.train(run_dir=c.file("runfile", "x")), ("train.run_dir", "runfile")),
    Case("other-model-checkpoint", "train", lambda c: [*c.train("--model.num_encoder_layers=3", run_dir=c.copy_run())],
         ("model.num_encoder_layers",)),
    # ---- train: hostile checkpoints (resume, and resume on another layout: universal conversion)
    Case("resume-hostile-model-states", "train",
         lambda c: c.train(run_dir=c.plant(c.tag(c.copy_run()) / "mp_rank_00_model_states.pt").parents[2]),
         ("mp_rank_00_model_states.pt", "refused", "makedirs"), hostile=True),
    Case("resume-hostile-optimizer", "train",
         lambda c: c.train(run_dir=c.plant(c.tag(c.copy_run()) / "zero_pp_rank_0_mp_rank_00_optim_states.pt").parents[2]),
         ("optim_states.pt", "refused", "makedirs"), hostile=True),
    Case("resume-hostile-rng", "train",
         lambda c: c.train(run_dir=c.plant(c.tag(c.copy_run()) / "rng_rank0.pt").parents[2]),
         ("rng_rank0.pt", "refused", "makedirs"), hostile=True),
    Case("universal-conversion-hostile", "train",
         lambda c: c.train(ds=ZERO2, run_dir=c.plant(c.tag(c.copy_run()) / "zero_pp_rank_0_mp_rank_00_optim_states.pt").parents[2]),
         ("optim_states.pt", "refused", "makedirs"), hostile=True),
    # ---- prepare ----------------------------------------------------------------------------
    Case("bad-language-code", "prepare", lambda c: ["en-German", c.tmp / "out", "--raw-dir", raw(c)], ("German",)),
    Case("pair-without-dash", "prepare", lambda c: ["ende", c.tmp / "out", "--raw-dir", raw(c)], ("ende",)),
    Case("raw-dir-missing", "prepare", lambda c: ["en-de", c.tmp / "out", "--raw-dir", c.tmp / "nowhere"],
         ("--raw-dir", "nowhere")),
    Case("vocab-size-3", "prepare", lambda c: ["en-de", c.tmp / "out", "--raw-dir", raw(c), "--vocab-size", "3"],
         ("--vocab-size",)),
    Case("ratio-below-1", "prepare", lambda c: ["en-de", c.tmp / "out", "--raw-dir", raw(c), "--ratio", "0.5"],
         ("--ratio",)),
    Case("workers-0", "prepare", lambda c: ["en-de", c.tmp / "out", "--raw-dir", raw(c), "--workers", "0"],
         ("--workers",)),
    Case("coverage-0", "prepare",
         lambda c: ["en-de", c.tmp / "out", "--raw-dir", raw(c), "--character-coverage", "0"],
         ("--character-coverage",)),
    Case("train-side-is-directory", "prepare",
         lambda c: ["en-de", c.tmp / "out", "--raw-dir", raw(c, train_en=to_dir), *PREP], ("train.en", "directory")),
    Case("sides-differ-in-length", "prepare",
         lambda c: ["en-de", c.tmp / "out", "--raw-dir", raw(c, train_de=truncate_lines(100)), *PREP],
         ("train.en has 120", "train.de has 100")),
    Case("truncated-gzip", "prepare",
         lambda c: ["en-de", c.tmp / "out", "--raw-dir", raw(c, train_de=gzip_half), *PREP], ("train.de.gz",)),
    Case("test-side-missing", "prepare",
         lambda c: ["en-de", c.tmp / "out", "--raw-dir", raw(c, newstest2014_de=Path.unlink), *PREP],
         ("newstest2014.de",)),
    Case("tsv-missing", "prepare", lambda c: ["en-de", c.tmp / "out", "--raw-dir", raw(c), "--tsv", c.tmp / "t.tsv"],
         ("--tsv", "t.tsv")),
    Case("out-dir-is-file", "prepare", lambda c: ["en-de", c.file("out", "x"), "--raw-dir", raw(c), *PREP], ("out",)),
    # ---- backtranslate ----------------------------------------------------------------------
    Case("model-missing", "backtranslate", lambda c: bt(c, model=c.tmp / "nomodel"), ("--model", "nomodel")),
    Case("mono-missing", "backtranslate", lambda c: [*bt(c), "--mono", c.tmp / "nomono"], ("--mono", "nomono")),
    Case("mono-empty", "backtranslate", lambda c: [*bt(c), "--mono", c.file("e.de", "")], ("--mono", "e.de", "empty")),
    Case("bitext-missing", "backtranslate", lambda c: [*bt(c), "--bitext", c.tmp / "nobitext"], ("--bitext", "nobitext")),
    Case("bitext-without-manifest", "backtranslate", lambda c: [*bt(c), "--bitext", c.file("b/x", "").parent],
         ("--bitext", "manifest.json")),
    Case("out-is-bitext", "backtranslate", lambda c: [*bt(c), "--out", c.data], ("--out", "--bitext")),
    Case("beam-0", "backtranslate", lambda c: [*bt(c), "--beam", "0"], ("--beam",)),
    Case("hostile-run", "backtranslate",
         lambda c: bt(c, model=c.plant(c.tag(c.copy_run()) / "mp_rank_00_model_states.pt").parents[2]),
         ("mp_rank_00_model_states.pt", "refused", "makedirs"), hostile=True),
    Case("hostile-model-file", "backtranslate", lambda c: bt(c, model=c.plant(c.copy_model())),
         ("model.pt", "refused", "makedirs"), hostile=True),
    Case("model-file-without-digest", "backtranslate",
         lambda c: bt(c, model=c.rewrite_model_file(sha256=None, version=1)), ("model.pt", "--trust-unverified")),
    # ---- translate --------------------------------------------------------------------------
    Case("checkpoint-missing", "translate", lambda c: ["--checkpoint", c.tmp / "x", "--input", c.text], ("--checkpoint",)),
    Case("input-missing", "translate", lambda c: ["--checkpoint", c.model, "--input", c.tmp / "x.txt"], ("--input", "x.txt")),
    Case("input-directory", "translate", lambda c: ["--checkpoint", c.model, "--input", c.tmp], ("--input", "directory")),
    Case("beam-0", "translate", lambda c: ["--checkpoint", c.model, "--input", c.text, "--beam", "0"], ("--beam",)),
    Case("lenpen-nan", "translate", lambda c: ["--checkpoint", c.model, "--input", c.text, "--lenpen", "nan"],
         ("--lenpen", "must be a finite number, got nan")),
    Case("temperature-0", "translate", lambda c: ["--checkpoint", c.model, "--input", c.text, "--method", "sample",
                                                 "--temperature", "0"], ("--temperature",)),
    Case("topp-2", "translate", lambda c: ["--checkpoint", c.model, "--input", c.text, "--topp", "2"], ("--topp",)),
    Case("max-len-b-negative", "translate", lambda c: ["--checkpoint", c.model, "--input", c.text, "--max-len-b", "-1"],
         ("--max-len-b",)),
    Case("max-tokens-0", "translate", lambda c: ["--checkpoint", c.model, "--input", c.text, "--max-tokens", "0"],
         ("--max-tokens",)),
    Case("unknown-tag", "translate", lambda c: ["--checkpoint", c.run, "--tag", "update_000777", "--input", c.text],
         ("update_000777",)),
    Case("text-file-as-checkpoint", "translate", lambda c: ["--checkpoint", c.text, "--input", c.text],
         ("test.en", "not an admin-ds model file")),
    Case("truncated-model-file", "translate",
         lambda c: ["--checkpoint", c.file("m.pt", c.model.read_bytes()[:5000]), "--input", c.text], ("m.pt",)),
    Case("tampered-model-file", "translate",
         lambda c: ["--checkpoint", c.rewrite_model_file(state_dict=lambda b: {k: v + 1 for k, v in b["state_dict"].items()}),
                    "--input", c.text], ("model.pt", "sha256")),
    Case("model-file-without-digest", "translate",
         lambda c: ["--checkpoint", c.rewrite_model_file(sha256=None, version=1), "--input", c.text],
         ("model.pt", "--trust-unverified")),
    Case("tampered-tag", "translate",
         lambda c: ["--checkpoint", flip_byte(c.tag(c.copy_run()) / "mp_rank_00_model_states.pt", 0).parent,
                    "--input", c.text], ("update_000004", "mp_rank_00_model_states.pt", "sha256")),
    Case("tag-without-digests", "translate",
         lambda c: ["--checkpoint", strip_digests(c.tag(c.copy_run())), "--input", c.text],
         ("update_000004", "--trust-unverified")),
    Case("incomplete-tag", "translate",
         lambda c: ["--checkpoint", tear(c.tag(c.copy_run())), "--input", c.text], ("update_000004", "incomplete")),
    Case("hostile-run", "translate",
         lambda c: ["--checkpoint", c.plant(c.tag(c.copy_run()) / "mp_rank_00_model_states.pt").parents[2],
                    "--input", c.text], ("mp_rank_00_model_states.pt", "refused", "makedirs"), hostile=True),
    Case("hostile-tag", "translate",
         lambda c: ["--checkpoint", c.plant(c.tag(c.copy_run()) / "zero_pp_rank_0_mp_rank_00_optim_states.pt").parent,
                    "--input", c.text], ("optim_states.pt", "refused", "makedirs"), hostile=True),
    Case("hostile-model-file", "translate", lambda c: ["--checkpoint", c.plant(c.copy_model()), "--input", c.text],
         ("model.pt", "refused", "makedirs"), hostile=True),
    # ---- average_checkpoints ----------------------------------------------------------------
    Case("run-missing", "average", lambda c: ["--run", c.tmp / "norun", "--last", "2", "--out", c.tmp / "a.pt"],
         ("--run", "norun")),
    Case("last-0", "average", lambda c: ["--run", c.run, "--last", "0", "--out", c.tmp / "a.pt"], ("--last",)),
    Case("out-is-directory", "average", lambda c: ["--run", c.run, "--last", "2", "--out", c.tmp], ("--out", "directory")),
    Case("more-than-saved", "average", lambda c: ["--run", c.run, "--last", "5", "--out", c.tmp / "a.pt"], ("5", "2")),
    Case("best-and-last", "average", lambda c: ["--run", c.run, "--last", "1", "--best", "1", "--out", c.tmp / "a.pt"],
         ("--best", "--last")),
    Case("best-never-recorded", "average", lambda c: ["--run", c.run, "--best", "1", "--out", c.tmp / "a.pt"],
         ("0 intact checkpoint(s) with a recorded validation loss", "train.keep_best", "fewer than --best 1")),
    Case("hostile-run", "average",
         lambda c: ["--run", c.plant(c.tag(c.copy_run(), 2) / "mp_rank_00_model_states.pt").parents[2], "--last", "2",
                    "--out", c.tmp / "a.pt"], ("mp_rank_00_model_states.pt", "refused", "makedirs"), hostile=True),
    Case("every-tag-corrupt", "average",
         lambda c: ["--run", every_tag(c, lambda t: flip_byte(t / "mp_rank_00_model_states.pt", 0)), "--last", "1",
                    "--out", c.tmp / "a.pt"],
         ("fewer than --last 1",)),
    Case("tags-without-digests", "average",
         lambda c: ["--run", every_tag(c, strip_digests), "--last", "2", "--out", c.tmp / "a.pt"],
         ("--trust-unverified",)),
    # ---- export -----------------------------------------------------------------------------
    Case("checkpoint-missing", "export", lambda c: ["--checkpoint", c.tmp / "x", "--out", c.tmp / "e"], ("--checkpoint",)),
    Case("unknown-format", "export", lambda c: ["--checkpoint", c.model, "--format", "onnx", "--out", c.tmp / "e"],
         ("--format", "onnx")),
    Case("out-not-empty", "export", lambda c: ["--checkpoint", c.model, "--out", c.file("e/keep.txt", "x").parent],
         ("e", "empty")),
    Case("out-is-file", "export", lambda c: ["--checkpoint", c.model, "--out", c.file("e", "x")], ("e",)),
    Case("hostile-model-file", "export", lambda c: ["--checkpoint", c.plant(c.copy_model()), "--out", c.tmp / "e"],
         ("model.pt", "refused", "makedirs"), hostile=True),
    Case("hostile-tag", "export",
         lambda c: ["--checkpoint", c.plant(c.tag(c.copy_run()) / "mp_rank_00_model_states.pt").parent,
                    "--out", c.tmp / "e"], ("mp_rank_00_model_states.pt", "refused", "makedirs"), hostile=True),
    # ---- evaluate ---------------------------------------------------------------------------
    Case("ref-missing", "evaluate", lambda c: ["--hyp", c.text, "--ref", c.tmp / "r", "--lang", "en-de"], ("--ref",)),
    Case("unknown-language", "evaluate", lambda c: ["--hyp", c.text, "--ref", c.text, "--lang", "xx-yy"], ("--lang", "xx")),
    Case("one-language", "evaluate", lambda c: ["--hyp", c.text, "--ref", c.text, "--lang", "en"], ("--lang",)),
    Case("line-counts-differ", "evaluate",
         lambda c: ["--hyp", c.file("h.txt", "a\nb\n"), "--ref", c.file("r.txt", "a\n"), "--lang", "en-de"],
         ("h.txt", "r.txt")),
    Case("ref-not-utf8", "evaluate",
         lambda c: ["--hyp", c.file("h.txt", "a\nb\n"), "--ref", c.file("r.txt", b"a\n\xff\xfe\n"), "--lang", "en-de"],
         ("r.txt",)),
    Case("src-misaligned", "evaluate",
         lambda c: ["--hyp", c.file("h.txt", "a\n"), "--ref", c.file("r.txt", "a\n"), "--src", c.file("s.txt", "a\nb\n"),
                    "--lang", "en-de"], ("s.txt",)),
    # ---- analyze ----------------------------------------------------------------------------
    Case("depth-0", "analyze", lambda c: ["--depths", "0", "--out", c.tmp / "a"], ("--depths",)),
    Case("sigma-0", "analyze", lambda c: ["--sigma", "0", "--out", c.tmp / "a"], ("--sigma",)),
    Case("unknown-init", "analyze", lambda c: ["--inits", "magic", "--out", c.tmp / "a"], ("--inits", "magic")),
    Case("model-dim-1", "analyze", lambda c: ["--model-dim", "1", "--out", c.tmp / "a"], ("--model-dim",)),
    Case("heads-do-not-divide", "analyze", lambda c: ["--model-dim", "10", "--heads", "3", "--depths", "1",
                                                     "--seeds", "1", "--repeats", "1", "--out", c.tmp / "a"],
         ("heads",)),
    # ---- models -----------------------------------------------------------------------------
    Case("unknown-preset", "models", lambda c: ["demo", "--preset", "admin-7L"], ("--preset", "admin-7L")),
    Case("vocab-2", "models", lambda c: ["list", "--vocab", "2"], ("--vocab",)),
    Case("length-1", "models", lambda c: ["demo", "--length", "1"], ("--length",)),
    # ---- cluster_env ------------------------------------------------------------------------
    Case("set-without-value", "cluster_env", lambda c: ["--set", "NCCL_DEBUG", "--out", c.tmp / "env"], ("NCCL_DEBUG",)),
    Case("out-is-directory", "cluster_env", lambda c: ["--out", c.tmp], ("--out", "directory")),
    # ---- strict configs: the run config YAML ------------------------------------------------
    Case("config-duplicate-key", "train",
         lambda c: [*c.train(), "--config", c.file("r.yaml", "optim:\n  lr: 1.0e-3\n  lr: 2.0e-3\n")],
         ("r.yaml:3", "duplicate key 'lr'", "line 2")),
    Case("config-duplicate-section", "train",
         lambda c: [*c.train(), "--config", c.file("r.yaml", "train:\n  seed: 2\nmodel:\n  preset: debug-tiny\n"
                                                          "train:\n  seed: 3\n")],
         ("r.yaml:5", "duplicate key 'train'")),
    Case("config-inf", "train", lambda c: [*c.train(), "--config", c.file("r.yaml", "optim:\n  lr: .inf\n")],
         ("r.yaml", "optim.lr", "not a finite number")),
    Case("config-nan-in-pair", "train",
         lambda c: [*c.train(), "--config", c.file("r.yaml", "optim:\n  betas: [0.9, .nan]\n")],
         ("r.yaml", "optim.betas[1]", "not a finite number")),
    Case("config-alias-bomb", "train", lambda c: [*c.train(), "--config", c.file("r.yaml", ALIAS_BOMB)],
         ("r.yaml", "100,000", "alias")),
    Case("config-recursive-alias", "train", lambda c: [*c.train(), "--config", c.file("r.yaml", "a: &a [1, *a]\n")],
         ("r.yaml:1", "recursive")),
    Case("config-over-bound", "train",
         lambda c: [*c.train(), "--config", c.file("r.yaml", "# " + "x" * CONFIG_BOUND + "\n")],
         ("--config", "r.yaml", f"{CONFIG_BOUND:,} bytes")),
    Case("config-device-file", "train", lambda c: [*c.train(), "--config", "/dev/zero"],
         ("--config", "/dev/zero", f"{CONFIG_BOUND:,} bytes")),
    Case("override-inf", "train", lambda c: c.train("--optim.lr=inf"), ("optim.lr", "finite")),
    Case("override-nan", "train", lambda c: c.train("--optim.clip_norm=nan"), ("optim.clip_norm", "finite")),
    # ---- strict configs: the DeepSpeed JSON ---------------------------------------------------
    Case("ds-duplicate-zero-section", "train",
         lambda c: c.train(ds=ds(c, "d.json", '{"zero_optimization": {"stage": 1},\n "zero_optimization": {"stage": 3}}')),
         ("d.json:1", "duplicate key 'zero_optimization'")),
    Case("ds-duplicate-nested-key", "train",
         lambda c: c.train(ds=ds(c, "d.json", '{"train_micro_batch_size_per_gpu": 1,\n "bf16": {"enabled": false,\n'
                                               '   "enabled": true}}')),
         ("d.json:2", "duplicate key 'enabled'")),
    Case("ds-infinity", "train", lambda c: c.train(ds=ds(c, "d.json", '{"gradient_clipping": Infinity}')),
         ("d.json", "gradient_clipping", "not a finite number")),
    Case("ds-nan-nested", "train",
         lambda c: c.train(ds=ds(c, "d.json", '{"zero_optimization": {"stage": 1, "reduce_bucket_size": NaN}}')),
         ("d.json", "zero_optimization.reduce_bucket_size", "not a finite number")),
    Case("ds-number-overflows", "train", lambda c: c.train(ds=ds(c, "d.json", '{"gradient_clipping": 1e999}')),
         ("d.json", "gradient_clipping", "not a finite number")),
    Case("ds-over-bound", "train", lambda c: c.train(ds=ds(c, "d.json", '{"a": "' + "x" * CONFIG_BOUND + '"}')),
         ("--deepspeed_config", "d.json", f"{CONFIG_BOUND:,} bytes")),
    Case("ds-nested-too-deeply", "train", lambda c: c.train(ds=ds(c, "d.json", "[" * 100000)),
         ("d.json", "nested too deeply")),
    # ---- translate: contradictory and unbounded decoding options, long lines, tags -----------
    Case("max-length-0", "translate", lambda c: tr(c, "--max-len-a", "0", "--max-len-b", "0"),
         ("--max-len-a 0", "--max-len-b 0")),
    Case("min-len-above-max-len", "translate", lambda c: tr(c, "--max-len-a", "0", "--max-len-b", "5", "--min-len", "6"),
         ("--min-len 6", "--max-len-b 5")),
    Case("beam-unbounded", "translate", lambda c: tr(c, "--beam", "100000"),
         ("--beam 100000", "33,554,432", "--max-decode-cells")),
    Case("max-tokens-unbounded", "translate", lambda c: tr(c, "--max-tokens", "1000000000"),
         ("--max-tokens 1000000000", "--max-decode-cells")),
    Case("max-len-b-unbounded", "translate", lambda c: tr(c, "--max-len-b", "100000000", "--method", "greedy"),
         ("--max-len-b 100000000", "--max-decode-cells")),
    Case("max-decode-cells-0", "translate", lambda c: tr(c, "--max-decode-cells", "0"), ("--max-decode-cells",)),
    Case("line-over-bound", "translate", lambda c: ["--checkpoint", c.model, "--input", long_line(c, "long.txt")],
         ("long.txt", "line 1", f"{LINE_BOUND:,} bytes")),
    Case("later-line-over-bound", "translate",
         lambda c: ["--checkpoint", c.model, "--input", long_line(c, "long.txt", "a\nb\n")],
         ("long.txt", "line 3", f"{LINE_BOUND:,} bytes")),
    Case("input-device-file", "translate", lambda c: ["--checkpoint", c.model, "--input", "/dev/zero"],
         ("/dev/zero", "line 1", f"{LINE_BOUND:,} bytes")),
    Case("tag-parent", "translate", lambda c: ["--checkpoint", c.run, "--tag", "../checkpoints", "--input", c.text],
         ("--tag", "../checkpoints")),
    Case("tag-absolute", "translate",
         lambda c: ["--checkpoint", c.run, "--tag", str(c.tag(c.run)), "--input", c.text], ("--tag", "update_000004")),
    Case("tag-link-out-of-run", "translate", tag_link_out, ("elsewhere", "outside")),
    # ---- evaluate: lines over the bound ------------------------------------------------------
    Case("hyp-line-over-bound", "evaluate",
         lambda c: ["--hyp", long_line(c, "h.txt"), "--ref", c.file("r.txt", "a\n"), "--lang", "en-de"],
         ("h.txt", "line 1", f"{LINE_BOUND:,} bytes")),
    Case("ref-device-file", "evaluate", lambda c: ["--hyp", c.file("h.txt", "a\n"), "--ref", "/dev/zero", "--lang", "en-de"],
         ("/dev/zero", "line 1")),
    Case("src-line-over-bound", "evaluate",
         lambda c: ["--hyp", c.file("h.txt", "a\nb\n"), "--ref", c.file("r.txt", "a\nb\n"),
                    "--src", long_line(c, "s.txt", "a\n"), "--lang", "en-de"], ("s.txt", "line 2")),
    # ---- backtranslate: decoding options, long lines, the bitext's subword model -------------
    Case("max-length-0", "backtranslate", lambda c: [*bt(c), "--max-len-a", "0", "--max-len-b", "0"],
         ("--max-len-a 0", "--max-len-b 0")),
    Case("beam-unbounded", "backtranslate", lambda c: [*bt(c), "--beam", "100000"],
         ("--beam 100000", "--max-decode-cells")),
    Case("max-tokens-unbounded", "backtranslate", lambda c: [*bt(c), "--method", "sampling", "--max-tokens", "1000000000"],
         ("--max-tokens 1000000000", "--max-decode-cells")),
    Case("mono-line-over-bound", "backtranslate", lambda c: [*bt(c), "--mono", long_line(c, "m.de", "Hallo.\n")],
         ("--mono", "m.de", "line 2", f"{LINE_BOUND:,} bytes")),
    Case("subword-model-swapped", "backtranslate", lambda c: [*bt(c), "--bitext", swap_subword_model(c)],
         ("--bitext", "spm.model", "checksum")),
    Case("subword-model-unrecorded", "backtranslate", lambda c: [*bt(c), "--bitext", unlist_subword_model(c)],
         ("--bitext", "spm.model", "checksum")),
    # ---- average_checkpoints: outputs that would destroy inputs or cannot be written ---------
    Case("out-inside-a-tag", "average", lambda c: avg_copy(c, lambda run: c.tag(run) / "avg.pt"),
         ("--out", "inside the checkpoints")),
    Case("out-in-checkpoints", "average", lambda c: avg_copy(c, lambda run: run / "checkpoints" / "avg.pt"),
         ("--out", "inside the checkpoints")),
    Case("out-links-to-a-checkpoint-file", "average",
         lambda c: avg_copy(c, lambda run: link(c, "avg.pt", c.tag(run) / "mp_rank_00_model_states.pt")),
         ("--out", "inside the checkpoints")),
    Case("out-under-a-file", "average", lambda c: avg(c, c.file("f", "x") / "avg.pt"), ("--out", "is a file")),
    Case("out-link-loop", "average", lambda c: avg(c, link_loop(c) / "avg.pt"), ("--out", "loop", "cannot be resolved")),
    Case("out-unwritable", "average", lambda c: avg(c, unwritable(c) / "avg.pt"), ("--out", "cannot write in")),
    # ---- atlas: the grid and the output directory --------------------------------------------
    Case("lr-negative", "atlas", lambda c: atlas(c, "--lrs", "-0.001"), ("--lrs", "-0.001")),
    Case("lr-zero", "atlas", lambda c: atlas(c, "--lrs", "0"), ("--lrs", "0")),
    Case("lr-nan", "atlas", lambda c: atlas(c, "--lrs", "nan"), ("--lrs", "nan")),
    Case("lr-repeated", "atlas", lambda c: atlas(c, "--lrs", "1e-3", "0.001"), ("more than once", "--lrs")),
    Case("warmup-negative", "atlas", lambda c: atlas(c, "--warmups", "-5"), ("--warmups", "-5")),
    Case("updates-0", "atlas", lambda c: atlas(c, "--updates", "0"), ("--updates", "0")),
    Case("heads-do-not-divide", "atlas", lambda c: atlas(c, "--model-dim", "64", "--heads", "5"),
         ("--heads 5", "--model-dim 64")),
    Case("depth-0", "atlas", lambda c: atlas(c, "--depths", "0"), ("--depths", "'0'")),
    Case("jobs-0", "atlas", lambda c: atlas(c, "--jobs", "0"), ("--jobs",)),
    Case("out-is-file", "atlas", lambda c: ["--data", c.data, "--out", c.file("a", "x")], ("--out", "not a directory")),
    Case("out-under-a-file", "atlas", lambda c: ["--data", c.data, "--out", c.file("f", "x") / "atlas"],
         ("--out", "is a file")),
    Case("out-link-loop", "atlas", lambda c: ["--data", c.data, "--out", link_loop(c) / "atlas"],
         ("--out", "cannot be resolved")),
    Case("out-unwritable", "atlas", lambda c: ["--data", c.data, "--out", unwritable(c) / "atlas"],
         ("--out", "cannot write in")),
    # ---- train: the BLEU evaluation's decoding, bounded before any work ----------------------
    Case("bleu-max-sentences-negative", "train", lambda c: c.train("--train.bleu_max_sentences=-5"),
         ("train.bleu_max_sentences", ">= 1")),
    Case("bleu-beam-unbounded", "train", lambda c: c.train("--train.bleu_beam=100000"),
         ("train.bleu_beam 100000", "train.bleu_max_decode_cells")),
    Case("bleu-max-length-0", "train", lambda c: c.train("--train.bleu_max_len_a=0", "--train.bleu_max_len_b=0"),
         ("train.bleu_max_len_a 0", "no output token")),
    # ---- a data directory whose listed file is no regular file -------------------------------
    Case("split-file-is-a-fifo", "train", lambda c: c.train(f"--data.path={fifo_in_data(c, 'valid.en.bin')}"),
         ("data.path", "valid.en.bin", "not a regular file")),
    # ---- export --force onto its own input --------------------------------------------------
    Case("force-out-is-the-run", "export", lambda c: ["--checkpoint", (run := c.copy_run()), "--out", run, "--force"],
         ("--checkpoint", "run", "--force", "elsewhere")),
    Case("force-out-holds-the-model-file", "export",
         lambda c: ["--checkpoint", c.copy_model(), "--out", c.tmp, "--force"],
         ("--checkpoint", "model.pt", "--force", "elsewhere")),
]


def run_case(case: Case, shared: Shared, base: Path, run: Prefork) -> dict:
    ctx = Ctx(shared, base / f"{case.command}-{case.id}")
    argv = [str(a) for a in case.argv(ctx)]
    before = snapshot(ctx.tmp)
    proc = run(REPO / SCRIPTS[case.command], argv, cwd=ctx.tmp, timeout=600)
    return {"proc": proc, "before": before, "after": snapshot(ctx.tmp), "marker": ctx.marker}


def snapshot(root: Path) -> dict:
    """Every file under ``root``: its sha256. Excepted: the files a refused attempt may log into,
    and a corrupt checkpoint set aside (``<tag>.corrupt``) counts as where it was."""
    return {str(p.relative_to(root)).replace(".corrupt/", "/"): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name not in MAY_CHANGE}


@pytest.fixture(scope="module")
def shared(tmp_path_factory, data_dir) -> Shared:
    base = tmp_path_factory.mktemp("bad_input")
    run = base / "run"
    out = subprocess.run([sys.executable, str(REPO / "launch/train.py"), "--deepspeed_config", ZERO1,
                          *overrides(run, data_dir, "--train.max_updates=4", "--train.save_interval_updates=2",
                                     "--train.keep_last=5")],
                         capture_output=True, text=True, env=ENV, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    model = base / "model.pt"
    out = subprocess.run([sys.executable, str(REPO / SCRIPTS["average"]), "--run", run, "--last", "2", "--out", model],
                         capture_output=True, text=True, env=ENV, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    text = data_dir / "test.en"
    return Shared(data=data_dir, run=run, model=model, text=text)


@pytest.fixture(scope="module")
def results(request, shared, tmp_path_factory):
    """Every selected case, run two at a time (they are independent processes), each forked from a
    process that has imported torch (tests/prefork.py)."""
    selected = [item.callspec.params["case"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec") and "case" in item.callspec.params]
    base = tmp_path_factory.mktemp("cases")
    before = {name: snapshot(path) for name, path in (("run", shared.run), ("data", shared.data))}
    before["model"] = hashlib.sha256(shared.model.read_bytes()).hexdigest()
    with Prefork(ENV) as first, Prefork(ENV) as second:
        servers = queue.SimpleQueue()
        servers.put(first)
        servers.put(second)

        def run(case):
            server = servers.get()
            try:
                return run_case(case, shared, base, server)
            finally:
                servers.put(server)

        with ThreadPoolExecutor(max_workers=2) as pool:
            done = dict(zip((c.param.id for c in selected), pool.map(run, selected)))
    after = {name: snapshot(path) for name, path in (("run", shared.run), ("data", shared.data))}
    after["model"] = hashlib.sha256(shared.model.read_bytes()).hexdigest()
    done["shared unchanged"] = before == after
    done["base"] = base
    return done


def test_prefork_runs_a_script_as_the_interpreter_does(tmp_path):
    """What the cases are judged on (exit status, stdout, stderr), from tests/prefork.py and from
    ``python SCRIPT ARGS`` itself: a script that finishes (its atexit function included), exits with
    a message, raises, reads stdin, and is killed by a signal."""
    scripts = {  # name: (code, exit status)
        "ends": ("import atexit, os, sys\natexit.register(print, 'atexit')\n"
                 "print(sys.argv, os.getcwd(), sys.path[0])", 0),
        "exits": ("import sys\nprint('before')\nsys.exit('error: --flag: bad')", 1),
        "raises": ("import torch\nraise ValueError(f'boom {torch.__name__}')", 1),
        "reads": ("import sys\nprint(repr(sys.stdin.read()))\nsys.exit(3)", 3),
        "killed": ("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)", -15),
    }
    with Prefork(ENV) as run:
        for name, (code, status) in scripts.items():
            script = tmp_path / name / f"{name}.py"
            script.parent.mkdir()
            script.write_text(code + "\n")
            forked = run(script, ["a", 1], cwd=tmp_path)
            real = subprocess.run([sys.executable, str(script), "a", "1"], capture_output=True, text=True, env=ENV,
                                  cwd=tmp_path, stdin=subprocess.DEVNULL, timeout=120)
            assert forked.returncode == real.returncode == status, name
            assert forked.stdout == real.stdout, name
            # A traceback has runpy's frames on top; its last lines are the same.
            assert forked.stderr.splitlines()[-3:] == real.stderr.splitlines()[-3:], name


def test_case_ids_are_unique_and_cover_every_command():
    ids = [c.param.id for c in CASES]
    assert len(ids) == len(set(ids)) and len(ids) >= 160
    assert {c.command for c in CASES} == set(SCRIPTS)
    assert any(c.hostile for c in CASES if c.command == "train")


@pytest.mark.parametrize("case", [c.param for c in CASES])
def test_refused_with_a_message_naming_it(case, results):
    r = results[case.param.id]
    proc = r["proc"]
    err = proc.stderr
    assert proc.returncode == case.rc, f"rc {proc.returncode}\n{err[-3000:]}"
    assert "Traceback" not in err, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ") or ": error: " in ln]
    assert lines, err[-3000:]
    for want in case.expect:
        assert want in lines[-1], f"{want!r} not in {lines[-1]!r}"
    assert len(lines[-1]) < 1000, f"not a one-line message: {lines[-1][:300]!r}..."
    assert not r["marker"].exists(), "the hostile pickle ran"
    changed = sorted(k for k in r["before"].keys() | r["after"].keys() if r["before"].get(k) != r["after"].get(k))
    assert not changed, f"files written or changed: {changed[:5]}"


def test_shared_inputs_were_only_read(results):
    assert results["shared unchanged"]
    assert not list(results["base"].glob("*.PLANTED"))


# ---- what is accepted: the fallbacks and the explicit override ---------------------------------

@pytest.fixture(scope="module")
def cli():
    """``cli(command, *argv, cwd=...)``: one command, as the cases run them (tests/prefork.py)."""
    with Prefork(ENV) as run:
        yield lambda command, *argv, cwd: run(REPO / SCRIPTS[command], argv, cwd=cwd, timeout=600)


def test_run_dir_falls_back_past_a_corrupt_or_torn_checkpoint(shared, cli, tmp_path):
    """Given a run directory, a tag whose files do not match its digests is set aside with a
    warning and the previous one is used; so is a tag whose COMPLETE does not parse."""
    ctx = Ctx(shared, tmp_path / "c")
    run = ctx.copy_run()
    flip_byte(ctx.tag(run) / "mp_rank_00_model_states.pt", 0)
    out = cli("translate", "--checkpoint", run, "--input", shared.text, "--method", "greedy", "--quiet", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "update_000004 is corrupt (mp_rank_00_model_states.pt does not match its sha256)" in out.stderr
    assert (run / "checkpoints/update_000004.corrupt/CORRUPT").is_file()
    reference = cli("translate", "--checkpoint", ctx.tag(shared.run, 2), "--input", shared.text, "--method",
                    "greedy", "--quiet", cwd=tmp_path)
    assert out.stdout == reference.stdout and out.stdout

    torn = Ctx(shared, tmp_path / "t")
    run = torn.copy_run()
    (torn.tag(run) / "COMPLETE").write_text('{"update": 4, "files": {')
    out = cli("translate", "--checkpoint", run, "--input", shared.text, "--method", "greedy", "--quiet", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout == reference.stdout


def test_trust_unverified_opens_an_old_model_file(shared, cli, tmp_path):
    ctx = Ctx(shared, tmp_path / "c")
    old = ctx.rewrite_model_file(sha256=None, version=1)
    out = cli("translate", "--checkpoint", old, "--input", shared.text, "--method", "greedy", "--quiet",
              "--trust-unverified", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    same = cli("translate", "--checkpoint", shared.model, "--input", shared.text, "--method", "greedy", "--quiet",
               cwd=tmp_path)
    assert out.stdout == same.stdout and out.stdout


def test_evaluate_ignores_a_byte_order_mark(shared, cli, tmp_path):
    """A UTF-8 BOM at the start of the hypothesis or the reference file is an editor's signature, not
    text: identical text scores 100 BLEU with it on either side, as without it."""
    text = "Das Haus ist klein.\nDer Hund läuft schnell nach Hause.\n"
    plain = tmp_path / "plain.de"
    plain.write_text(text, encoding="utf-8")
    bom = tmp_path / "bom.de"
    bom.write_bytes(b"\xef\xbb\xbf" + text.encode())
    for hyp, ref in ((bom, plain), (plain, bom), (bom, bom)):
        out = cli("evaluate", "--hyp", hyp, "--ref", ref, "--lang", "en-de", "--json", cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        result = json.loads(out.stdout)
        assert (result["bleu"], result["chrf"]) == pytest.approx((100, 100)), (hyp.name, ref.name, result)
    # Only the file's first bytes are a signature: the same bytes inside a line are text and count.
    inner = tmp_path / "inner.de"
    inner.write_bytes(text.replace("Hund", "\ufeffHund").encode())
    out = cli("evaluate", "--hyp", inner, "--ref", plain, "--lang", "en-de", "--json", cwd=tmp_path)
    assert out.returncode == 0 and json.loads(out.stdout)["bleu"] < 99


def test_train_names_a_taken_port(shared, tmp_path):
    """A rendezvous port another process holds (a second run on the machine) is refused in one
    line naming the port and how to choose another, not with a traceback; nothing is trained."""
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        out = subprocess.run([sys.executable, str(REPO / SCRIPTS["train"]), "--deepspeed_config", ZERO1,
                              *overrides(tmp_path / "run", shared.data)], capture_output=True, text=True,
                             env=dict(ENV, MASTER_PORT=str(port)), cwd=tmp_path, timeout=600)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert f"error: port {port} on 127.0.0.1 is taken" in out.stderr and "--master_port" in out.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_bounded_lines_splits_as_bytes_split(tmp_path):
    """The chunked reader against bytes.split (the independent reference), with chunks smaller
    than, equal to and larger than the lines, and a line exactly at the bound."""
    import io
    import random

    from admin_ds.errors import DataError
    from admin_ds.files import bounded_lines

    rng = random.Random(0)
    for trial in range(200):
        data = bytes(rng.choice(b"ab\n") for _ in range(rng.randrange(0, 60)))
        want = data.split(b"\n")
        if want[-1] == b"":
            want.pop()  # a final newline ends the last line; it does not start another
        limit = max((len(x) for x in want), default=0)
        got = list(bounded_lines(io.BytesIO(data), "f", limit=limit, chunk=rng.choice([1, 3, 7, 64])))
        assert got == want, (trial, data)
        if limit:
            long_at = next(i for i, x in enumerate(want) if len(x) == limit) + 1
            with pytest.raises(DataError, match=f"^f: line {long_at} is longer than {limit - 1:,} bytes"):
                list(bounded_lines(io.BytesIO(data), "f", limit=limit - 1, chunk=rng.choice([1, 3, 7, 64])))
