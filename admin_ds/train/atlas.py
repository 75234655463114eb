"""The stability atlas: at this depth and learning rate, which residual form trains?

    atlas = Atlas(AtlasGrid(...), data_dir, out_dir, train_command=[python, "launch/train.py"])
    atlas.run(jobs=1)        # every cell a normal run directory; finished cells are skipped
    report = atlas.collect() # outcomes, curves, omega, output change -> atlas_report.write_report

The Admin paper's protocol (Liu et al. 2020, section 3): identical data, hyper-parameters and
seeds in every cell; only the residual form and initialisation change (``INIT_VARIANTS``: post,
pre, admin, admin-constant, deepnorm, t-fixup). A cell is one (init, depth, learning rate,
warmup, seed) run of the ordinary training command in its own run directory under
``OUT/cells/<name>/``, so it resumes like any run; a cell whose ``summary.json`` exists is done
and skipped. Cells run as separate processes, ``jobs`` at a time: one per GPU (pinned with
``CUDA_VISIBLE_DEVICES``), or on a CPU sequentially unless asked otherwise. A cell of
``pipeline_from`` layers or more (encoder + decoder) runs as 2 pipeline stages on 2 ranks
(``torch.distributed.run``), so the deep cells exercise pipeline parallelism and distributed
profiling; its batches and updates are those of a one-rank cell. The divergence guard
is off in every cell (``guard.spike_factor=0``, ``guard.max_consecutive_nonfinite=0``): its
rollbacks lower the learning rate, which would change the hyper-parameters of the cell that
needs it most. BLEU is measured on the validation split (``data.test_split=valid``).

A cell's outcome (``classify``), from its metrics.jsonl:

    diverged   a non-finite loss or gradient, or the training loss at the end above its value
               at the end of warmup: the mean over the last ``window`` updates against the mean
               over the first ``window`` updates from the end of warmup on (``window`` = 5% of
               the run, at least 3 updates: one update's loss varies with its batch)
    stalled    finite, but the best validation nll no better than the unigram model's
               cross-entropy minus ``STALL_MARGIN_BITS``: the model has learnt word frequencies
               and little else
    trained    otherwise
    failed     the run ended with an error (its error line is kept)
    unfinished the run stopped before its last update without an error (killed, or still
               running); rerunning the command resumes it

A run that resumed or rolled back logs some updates twice; the curves keep one value per update,
the last written.

The unigram cross-entropy is the target side of the validation split scored with the training
split's target token frequencies (add-one smoothed), EOS included, in bits: the same units as the
logged nll.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from admin_ds.errors import ConfigError, UserError
from admin_ds.model.analysis import INIT_VARIANTS

STALL_MARGIN_BITS = 0.5
# What each cell sets after the extra settings (AtlasGrid.overrides): an extra setting of one of
# these would be silently replaced.
CELL_KEYS = ("data.path", "train.run_dir", "model.init", "model.norm_order", "model.num_encoder_layers",
             "model.num_decoder_layers", "optim.lr", "optim.warmup_updates", "train.seed", "engine.pipeline_stages")
OUTCOMES = ("trained", "stalled", "diverged", "failed", "unfinished")
CELLS_DIR = "cells"

# The defaults of a grid: the narrow one two CPU cores can afford, and the deep atlas's grid at the
# papers' width for GPU machines (Transformer-base 512/2048/8; the very deep paper's 60L-12L and
# 100L-12L, En-De's lr 1e-3 with warmup 4000, and the CPU atlas's 3e-3; two seeds). Engine JSONs
# are named relative to the repository root.
SCALES: dict[str, dict] = {
    "cpu": dict(inits=["post", "pre", "admin"], depths=["6", "18"], lrs=[1e-3, 3e-3, 1e-2], warmups=[100],
                preset="debug-tiny", model_dim=64, ffn_inner_dim=256, num_heads=4, max_updates=300,
                max_tokens=2048, valid_interval=100, bleu_sentences=200, bleu_beam=1,
                deepspeed_config="ds_configs/zero1.json", pipeline_from=60),
    "gpu": dict(inits=["post", "pre", "admin", "admin-constant", "deepnorm"], depths=["6", "18", "60-12", "100-12"],
                lrs=[1e-3, 3e-3], warmups=[4000], seeds=[1, 2],
                preset="base-6L-6L", model_dim=512, ffn_inner_dim=2048, num_heads=8, max_updates=20000,
                max_tokens=4096, valid_interval=1000, bleu_sentences=0, bleu_beam=4,
                deepspeed_config="ds_configs/zero1_bf16.json", pipeline_from=0),
}


def parse_depth(text: str) -> tuple[int, int]:
    """``"18"`` -> (18, 18); ``"60-12"`` -> (60, 12): encoder and decoder layers."""
    parts = str(text).split("-")
    try:
        enc, dec = (int(parts[0]), int(parts[0])) if len(parts) == 1 else (int(parts[0]), int(parts[1]))
    except ValueError:
        enc = dec = 0
    if len(parts) > 2 or enc < 1 or dec < 1:
        raise ConfigError(f"--depths: expected N or N-M with positive integers (e.g. 18, 60-12), got {text!r}")
    return enc, dec


@dataclass(frozen=True)
class Cell:
    init: str
    encoder_layers: int
    decoder_layers: int
    lr: float
    warmup: int
    seed: int = 1
    stages: int = 1  # pipeline stages, one rank each

    @property
    def depth(self) -> str:
        return f"{self.encoder_layers}L-{self.decoder_layers}L"

    @property
    def name(self) -> str:
        return f"{self.init}_{self.depth}_lr{self.lr:g}_wu{self.warmup}" + (f"_s{self.seed}" if self.seed != 1 else "")


@dataclass
class AtlasGrid:
    """What every cell shares, and the axes that vary (``for_scale`` fills in the defaults)."""

    inits: list[str]
    depths: list[str]  # "18" or "60-12"
    lrs: list[float]
    warmups: list[int]
    preset: str
    model_dim: int
    ffn_inner_dim: int
    num_heads: int
    max_updates: int
    max_tokens: int
    valid_interval: int  # validation and checkpoint every N updates
    bleu_sentences: int  # validation sentences decoded for BLEU; 0: all
    bleu_beam: int
    deepspeed_config: str
    seeds: list[int] = field(default_factory=lambda: [1])  # run seeds: one cell per seed
    pipeline_from: int = 0  # cells with this many layers or more run as 2 pipeline stages; 0: never
    extra: list[str] = field(default_factory=list)  # more --section.key=value for every cell

    @classmethod
    def for_scale(cls, scale: str = "cpu", **given) -> "AtlasGrid":
        """``SCALES[scale]`` with the values in ``given`` that are not None."""
        if scale not in SCALES:
            raise ConfigError(f"--scale: expected one of {', '.join(SCALES)}, got {scale!r}")
        return cls(**{**SCALES[scale], **{k: v for k, v in given.items() if v is not None}}).validate()

    def validate(self) -> "AtlasGrid":
        unknown = [i for i in self.inits if i not in INIT_VARIANTS]
        if unknown:
            raise ConfigError(f"--inits: unknown {', '.join(unknown)}; known: {', '.join(INIT_VARIANTS)}")
        for name in ("inits", "depths", "lrs", "warmups", "seeds"):
            if not getattr(self, name):
                raise ConfigError(f"--{name}: give at least one value")
        for d in self.depths:
            parse_depth(d)
        if any(not (math.isfinite(lr) and lr > 0) for lr in self.lrs):
            raise ConfigError(f"--lrs: learning rates must be positive and finite, got {self.lrs}")
        if any(w < 0 for w in self.warmups):
            raise ConfigError(f"--warmups: must be >= 0, got {self.warmups}")
        if len(set(self.seeds)) != len(self.seeds):
            raise ConfigError(f"--seeds: each seed once, got {self.seeds}")
        if self.pipeline_from < 0:
            raise ConfigError(f"--pipeline-from: must be >= 0 (0: no pipeline cells), got {self.pipeline_from}")
        if self.max_updates < 1:
            raise ConfigError(f"--updates: must be positive, got {self.max_updates}")
        if self.num_heads < 1 or self.model_dim % self.num_heads:
            raise ConfigError(f"--heads {self.num_heads} does not divide --model-dim {self.model_dim}")
        names = [c.name for c in self.cells()]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:  # two processes would train into one run directory
            raise ConfigError(f"the grid names cell {twice[0]} more than once: a value is repeated in --inits, "
                              "--depths, --lrs or --warmups (1e-3 and 0.001 are the same rate)")
        return self

    def check_settings(self) -> None:
        """Before any work: no extra setting names what a cell sets, every cell's command line
        passes the training's own checks, and the engine JSON reads. A mistake here would
        otherwise fail every cell, one by one, after the data preparation."""
        from admin_ds.train import ds_config
        from admin_ds.train.run_config import load_run_config

        for arg in self.extra:
            key = arg[2:].split("=", 1)[0]
            if key in CELL_KEYS:
                raise ConfigError(f"{arg}: the atlas sets {key} in each cell (--inits, --depths, --lrs, --warmups, "
                                  "--seeds, --pipeline-from, --out, --data); use those options")
        for cell in {c.stages: c for c in self.cells()}.values():  # a one-rank and a pipeline cell
            load_run_config(None, self.overrides(cell, Path("data"), Path("cell"))[2:])
        ds_config.check_types(ds_config.read(self.deepspeed_config), self.deepspeed_config)

    def cells(self) -> list[Cell]:
        """Every combination, shallow to deep, each init at each setting and seed in turn."""
        cells = []
        for d in self.depths:
            enc, dec = parse_depth(d)
            stages = 2 if self.pipeline_from and enc + dec >= self.pipeline_from else 1
            cells += [Cell(init, enc, dec, float(lr), int(w), int(seed), stages)
                      for seed in self.seeds for lr in self.lrs for w in self.warmups for init in self.inits]
        return cells

    def overrides(self, cell: Cell, data_dir: Path, run_dir: Path) -> list[str]:
        """The cell's training command line: the shared settings, then what the cell varies."""
        bleu_n = [f"--train.bleu_max_sentences={self.bleu_sentences}"] if self.bleu_sentences else []
        variant = INIT_VARIANTS[cell.init]
        return [
            "--deepspeed_config", self.deepspeed_config,
            f"--data.path={data_dir}", f"--train.run_dir={run_dir}",
            f"--model.preset={self.preset}", f"--model.model_dim={self.model_dim}",
            f"--model.ffn_inner_dim={self.ffn_inner_dim}", f"--model.num_heads={self.num_heads}",
            f"--data.max_tokens={self.max_tokens}", f"--train.max_updates={self.max_updates}",
            f"--train.valid_interval_updates={self.valid_interval}",
            f"--train.save_interval_updates={self.valid_interval}", "--train.keep_last=1",
            "--train.log_interval=1",  # every update's loss: the outcome rules average windows of them
            "--data.test_split=valid", f"--train.bleu_beam={self.bleu_beam}", *bleu_n,
            "--guard.spike_factor=0", "--guard.max_consecutive_nonfinite=0",
            *self.extra,
            f"--model.init={variant['init']}", f"--model.norm_order={variant['norm_order']}",
            f"--model.num_encoder_layers={cell.encoder_layers}", f"--model.num_decoder_layers={cell.decoder_layers}",
            f"--optim.lr={cell.lr}", f"--optim.warmup_updates={cell.warmup}", f"--train.seed={cell.seed}",
            f"--engine.pipeline_stages={cell.stages}",
        ]


# ------------------------------------------------------------------------------------------------
# Outcomes
# ------------------------------------------------------------------------------------------------


def read_metrics(run_dir: Path) -> list[dict]:
    """A run's metrics records; none for a run that has not logged yet. A last line without its
    newline is a record being written and is left out; any other line that is not a JSON object
    is refused with its file and line number."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")  # the last item is "" when the file ends with a newline
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines):
                break
            raise UserError(f"{path}, line {number}: not a JSON record ({e.msg})") from None
        if not isinstance(record, dict) or "kind" not in record:
            raise UserError(f"{path}, line {number}: not a metrics record (a JSON object with a 'kind')")
        records.append(record)
    return records


def classify(records: list[dict], warmup: int, unigram_bits: float, finished: bool = True) -> dict:
    """A cell's outcome and the numbers behind it (module docstring), from its metrics records."""
    train = sorted(last_per_update(records, "train", ("loss", "nll")).items())
    train = [(u, loss, nll) for u, (loss, nll) in train]
    valid = [(u, nll) for u, (nll,) in sorted(last_per_update(records, "valid", ("nll",)).items())]
    skipped = sum(1 for r in records if r["kind"] == "skip")
    bleu = next((r for r in reversed(records) if r["kind"] == "test"), None)
    result = {"curve": [[u, loss, nll] for u, loss, nll in train], "valid_curve": [[u, nll] for u, nll in valid],
              "best_valid_nll": min((n for _, n in valid if math.isfinite(n)), default=None),
              "bleu": None if bleu is None else bleu["bleu"], "skipped_nonfinite": skipped,
              "unigram_bits": unigram_bits}
    losses = [loss for _, loss, _ in train]
    window = max(3, len(losses) // 20)
    after = [loss for u, loss, _ in train if u >= warmup][:window] or losses[-window:]
    result["warmup_loss"] = float(np.mean(after)) if after else None
    result["final_loss"] = float(np.mean(losses[-window:])) if losses else None
    if not finished:
        result["outcome"], result["reason"] = "failed", "the run ended with an error"
    elif skipped or not all(math.isfinite(x) for x in losses + [n for _, n in valid]):
        result["outcome"], result["reason"] = "diverged", f"non-finite loss or gradient ({skipped} updates skipped)"
    elif result["final_loss"] is not None and result["final_loss"] > result["warmup_loss"]:
        result["outcome"] = "diverged"
        result["reason"] = (f"loss {result['final_loss']:.2f} at the end above {result['warmup_loss']:.2f} "
                            f"at the end of warmup")
    elif result["best_valid_nll"] is None or result["best_valid_nll"] > unigram_bits - STALL_MARGIN_BITS:
        best = result["best_valid_nll"]
        result["outcome"] = "stalled"
        result["reason"] = (f"best validation nll {'-' if best is None else format(best, '.2f')} bits, "
                            f"unigram model {unigram_bits:.2f} bits")
    else:
        result["outcome"], result["reason"] = "trained", ""
    return result


def last_per_update(records: list[dict], kind: str, keys: tuple[str, ...]) -> dict[int, tuple]:
    """One value per update, the last written: a resumed or rolled-back run repeats updates."""
    return {r["update"]: tuple(r[k] for k in keys) for r in records if r["kind"] == kind}


def unigram_bits(data_dir: Path) -> float:
    """Cross-entropy (bits per token, EOS included) of the validation targets under the training
    targets' add-one smoothed unigram distribution."""
    from admin_ds.data.binarize import load_manifest
    from admin_ds.data.indexed import IndexedDataset

    manifest = load_manifest(data_dir)
    tgt, vocab, eos = manifest["tgt_lang"], manifest["vocab_size"], 2

    def counts(split: str) -> np.ndarray:
        ds = IndexedDataset(data_dir / f"{split}.{tgt}")
        c = np.zeros(vocab, dtype=np.float64)
        for i in range(len(ds)):
            c += np.bincount(ds[i], minlength=vocab)
        c[eos] += len(ds)
        return c

    train, valid = counts("train"), counts("valid")
    p = (train + 1) / (train.sum() + vocab)
    return float(-(valid * np.log2(p)).sum() / valid.sum())


# ------------------------------------------------------------------------------------------------
# Running the cells
# ------------------------------------------------------------------------------------------------


CODE_ROOT = Path(__file__).resolve().parents[2]  # the checkout whose admin_ds is running


def is_done(run_dir: Path) -> bool:
    return (run_dir / "summary.json").is_file()


def default_jobs() -> int:
    """One cell per GPU; one at a time on a CPU (cells would share the same cores)."""
    try:
        import torch

        return max(1, torch.cuda.device_count())
    except ImportError:
        return 1


class Atlas:
    """The grid's cells under ``out_dir/cells``, run with ``train_command`` (the training entry
    point as an argument list, e.g. ``[sys.executable, "launch/train.py"]``)."""

    def __init__(self, grid: AtlasGrid, data_dir: Path, out_dir: Path, train_command: Sequence[str],
                 log: Callable[[str], None] = print) -> None:
        self.grid, self.data_dir, self.out = grid.validate(), Path(data_dir).resolve(), Path(out_dir)
        if not (self.data_dir / "manifest.json").is_file():
            raise ConfigError(f"--data: {data_dir} has no manifest.json (prepare it with data_prep, or give "
                              "--raw-dir)")
        self.train_command, self.log = list(train_command), log
        self.cells = grid.cells()

    def cell_dir(self, cell: Cell) -> Path:
        return self.out / CELLS_DIR / cell.name

    def command(self, cell: Cell) -> list[str]:
        """One process, or for a pipeline cell one rank per stage under torch.distributed.run
        (``--standalone`` picks a free port, so cells can run side by side)."""
        launch = self.train_command
        if cell.stages > 1:
            launch = [launch[0], "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cell.stages}",
                      *launch[1:]]
        return launch + self.grid.overrides(cell, self.data_dir, self.cell_dir(cell).resolve())

    def run(self, jobs: Optional[int] = None, poll_s: float = 1.0) -> dict[str, int]:
        """Run every unfinished cell, ``jobs`` processes at a time; returns the cells' exit status
        (finished cells skipped are not listed). A failing cell does not stop the others."""
        jobs = jobs or default_jobs()
        todo = [c for c in self.cells if not is_done(self.cell_dir(c))]
        skipped = len(self.cells) - len(todo)
        self.log(f"[atlas] {len(self.cells)} cells: {skipped} finished (skipped), {len(todo)} to run, "
                 f"{jobs} at a time")
        gpus = self._gpus()
        free = list(range(jobs))
        running: dict[int, tuple[Cell, subprocess.Popen, float, object]] = {}
        status: dict[str, int] = {}
        while todo or running:
            while todo and free:
                slot, cell = free.pop(0), todo.pop(0)
                d = self.cell_dir(cell)
                d.mkdir(parents=True, exist_ok=True)
                env = dict(os.environ)
                # The cells run the code this atlas imported, not whatever `admin_ds` the environment
                # installs (an editable install of another checkout would otherwise win).
                env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CODE_ROOT), env.get("PYTHONPATH")) if p)
                if gpus:
                    env["CUDA_VISIBLE_DEVICES"] = str(gpus[slot % len(gpus)])
                elif (jobs > 1 or cell.stages > 1) and "OMP_NUM_THREADS" not in os.environ:
                    env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // (jobs * cell.stages)))
                logf = open(d / "train.log", "a")
                proc = subprocess.Popen(self.command(cell), stdout=logf, stderr=subprocess.STDOUT, env=env)
                running[slot] = (cell, proc, time.time(), logf)
                self.log(f"[atlas] start {cell.name}")
            time.sleep(poll_s)
            for slot, (cell, proc, t0, logf) in list(running.items()):
                rc = proc.poll()
                if rc is None:
                    continue
                logf.close()
                del running[slot]
                free.append(slot)
                status[cell.name] = rc
                how = "done" if rc == 0 else f"failed (exit {rc}; see {self.cell_dir(cell) / 'train.log'})"
                self.log(f"[atlas] {cell.name}: {how} in {time.time() - t0:.0f}s")
        return status

    def _gpus(self) -> list[int]:
        try:
            import torch

            return list(range(torch.cuda.device_count()))
        except ImportError:
            return []

    # ---- results ---------------------------------------------------------------------------------
    def collect(self, output_change: Optional[dict] = None) -> dict:
        """Every cell's outcome, curves, validation BLEU and (Admin) omega, as one JSON-ready dict."""
        bits = unigram_bits(self.data_dir)
        cells = []
        for cell in self.cells:
            d = self.cell_dir(cell)
            row = {**asdict(cell), "name": cell.name, "depth": cell.depth, "run_dir": str(d)}
            if not d.exists():
                row.update(outcome="missing", reason="not run")
            else:
                row.update(classify(read_metrics(d), cell.warmup, bits, finished=is_done(d)))
                if row["outcome"] == "failed":
                    error = _last_error(d / "train.log")
                    if error is None:
                        last = row["curve"][-1][0] if row["curve"] else 0
                        row.update(outcome="unfinished", reason=f"stopped at update {last} of {self.grid.max_updates} "
                                                                 "without an error; rerun the command to resume it")
                    else:
                        row["reason"] = error
                profile = d / "admin_profile.json"
                if profile.is_file():
                    p = json.loads(profile.read_text())
                    row["omega"] = {st: [s["omega"] for s in p["sublayers"] if s["stack"] == st]
                                    for st in ("encoder", "decoder")}
            cells.append(row)
        return {"grid": asdict(self.grid), "data_dir": str(self.data_dir), "unigram_bits": bits,
                "stall_margin_bits": STALL_MARGIN_BITS, "cells": cells, "output_change": output_change}


def _last_error(log: Path) -> Optional[str]:
    if not log.is_file():
        return None
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:") or "Error" in line]
    return errors[-1] if errors else None


# ------------------------------------------------------------------------------------------------
# Theorem 2 at the grid's width
# ------------------------------------------------------------------------------------------------


def output_change_curve(grid: AtlasGrid, seeds: int = 2, sigma: float = 0.001) -> dict:
    """The Admin paper's output change at initialisation (analysis.output_change: final decoder
    states, branch parameters perturbed) for every init and depth of the grid, at its width."""
    from admin_ds.model.analysis import build_analysis_model, make_batch, output_change, torch_threads

    result: dict = {"sigma": sigma, "seeds": seeds, "target": "model", "inits": {}}
    with torch_threads(1):
        for init in grid.inits:
            rows = []
            for text in grid.depths:
                enc, dec = parse_depth(text)
                kw = dict(base_preset=grid.preset, model_dim=grid.model_dim, ffn_inner_dim=grid.ffn_inner_dim,
                          num_heads=grid.num_heads, decoder_layers=dec)
                values = []
                for seed in range(seeds):
                    model = build_analysis_model(init, enc, seed, **kw)
                    batch = make_batch(model.cfg, seed=1000 + seed)
                    values.append(output_change(model, batch, sigma, 3000 + seed, "branches", "model", 2))
                rows.append({"depth": f"{enc}L-{dec}L", "encoder_layers": enc, "mean": float(np.mean(values)),
                             "std": float(np.std(values))})
            result["inits"][init] = rows
    return result
