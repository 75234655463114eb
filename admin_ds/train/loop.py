"""The training run on one rank: the same loop for every layout.

    train(run, ds_config_path, hooks=None, bleu_tools=None)   # called by launch/train.py on every rank

Order of work (each step refuses bad input before the next one starts):
  1. resolve the DeepSpeed JSON against the run config; print the layout and the batch numbers
  2. the data directory (rank 0 prepares the embedded default if no data is given)
  3. plan the resume from the newest verified checkpoint (another layout: a universal load,
     decided before the engine is built), then the runner: model, engine (runners.py)
  4. resume, or establish the profile (distributed profiling, or a given profile) and write omega
  5. updates, with the log, validation and checkpoints at their intervals; the divergence guard
     skips non-finite updates and rolls back on divergence (guard.py); after each update the ranks
     agree whether a signal asked them to stop (preemption.py): then a checkpoint, and the summary
     says ``requeue`` (launch/train.py exits with status 75)
  6. final checkpoint, validation loss, BLEU on the test split, summary

The pieces know nothing of the layout: the runner does the steps (runners.py), the checkpoint
manager the files (checkpoints.py), the evaluator the validation loss and BLEU (evaluator.py,
with decoding and scoring handed in by the entry point), the run log the metrics. Extension
points for tests and tools are the ``Hooks`` (hooks.py).
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from admin_ds import distributed, files
from admin_ds.data.binarize import direction, load_manifest, prepare_default_data, reversed_manifest
from admin_ds.errors import ConfigError
from admin_ds.model.config import ModelConfig
from admin_ds.model.profiling import Profile, omega_table
from admin_ds.model.transformer import count_parameters
from admin_ds.train import engine as eng
from admin_ds.train.checkpoints import (PRE_AUTO_ENGINE, CheckpointManager, ResumePlan, configure_loading, describe,
                                        tag_for)
from admin_ds.train.evaluator import BleuTools, Evaluator
from admin_ds.train.guard import DivergenceGuard, apply_lr_scale
from admin_ds.train.hooks import Hooks
from admin_ds.train.preemption import REQUEUE_STATUS, StopSignals
from admin_ds.train.run_config import RunConfig, dump_run_config
from admin_ds.train.runners import Runner, make_runner
from admin_ds.train.watchdog import Watchdog


@dataclass
class TrainState:
    update: int = 0
    epoch: int = 1
    tokens_seen: int = 0
    sentences_seen: int = 0
    best_valid_loss: Optional[float] = None  # train.patience: the best validation loss so far
    valids_since_best: int = 0               # and the validations since it
    cpu_s: float = 0.0   # the run's cost: CPU time of every rank's process, summed over resumes
    wall_s: float = 0.0  # and its wall-clock time from each trainer's start (mean over ranks), summed over resumes

    def charge(self, since: tuple[float, float]) -> tuple[float, float]:
        """Add the time after the mark ``since``, ``(time.process_time(), time.monotonic())``, to
        ``cpu_s`` (every rank's, summed) and ``wall_s`` (the ranks' mean); returns the new mark.
        Collective."""
        now = (time.process_time(), time.monotonic())
        spent = torch.tensor([now[0] - since[0], now[1] - since[1]], dtype=torch.float64)
        cpu, wall = distributed.all_reduce_sum(spent).tolist()
        self.cpu_s += cpu
        self.wall_s += wall / distributed.world_size()
        return now

    def note_validation(self, loss: float) -> None:
        if self.best_valid_loss is None or loss < self.best_valid_loss:
            self.best_valid_loss, self.valids_since_best = loss, 0
        else:
            self.valids_since_best += 1

    def converged(self, patience: Optional[int]) -> bool:
        """No improvement for ``patience`` validations in a row (never with None)."""
        return patience is not None and self.valids_since_best >= patience


class RunLog:
    """Rank 0 prints and appends to RUN_DIR/metrics.jsonl (and TensorBoard if asked)."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool) -> None:
        self.enabled, self.path = enabled, run_dir / "metrics.jsonl"
        self.metrics = None
        self.tb = None
        if enabled:
            if tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter
                    self.tb = SummaryWriter(str(run_dir / "tensorboard"))
                except ImportError:
                    self.info("[log] tensorboard is not installed; `pip install tensorboard` to enable it")

    def info(self, msg: str) -> None:
        if self.enabled:
            print(msg, flush=True)

    def record(self, kind: str, **values) -> None:
        if not self.enabled:
            return
        if self.metrics is None:  # opened at the first record: a run refused at start-up writes nothing
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.metrics = open(self.path, "a")
        self.metrics.write(json.dumps({"kind": kind, "time": round(time.time(), 3), **values}) + "\n")
        self.metrics.flush()
        if self.tb is not None:
            step = values.get("update", 0)
            for k, v in values.items():
                if isinstance(v, (int, float)) and k != "update":
                    self.tb.add_scalar(f"{kind}/{k}", v, step)

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None


class Progress:
    """The progress bar (rank 0, stderr, on a terminal) and the train records: loss, learning rate, and the
    throughput over the updates since the previous record."""

    def __init__(self, log: RunLog, total: int, initial: int, enabled: bool) -> None:
        from tqdm import tqdm

        self.log, self.enabled = log, enabled
        # A bar on a terminal only: into a log file its redraws pile up as one unreadable line, and
        # the record lines below say the same every train.log_interval updates.
        self.bar = tqdm(total=total, initial=initial, disable=not (enabled and sys.stderr.isatty()),
                        desc="train", unit="upd", mininterval=2.0, file=sys.stderr, dynamic_ncols=True)
        self.tokens, self.t0 = 0, time.perf_counter()

    def update(self, ntokens: int) -> None:
        self.tokens += ntokens
        self.bar.update(1)

    def rolled_back(self, update: int) -> None:
        self.bar.n = update
        self.bar.refresh()

    def record(self, state: TrainState, stats: dict, engine, precision: str, skipped_nonfinite: int) -> dict:
        """Log the update just made; returns the record."""
        record = {"update": state.update, "epoch": state.epoch, "loss": round(stats["loss"], 4),
                  "nll": round(stats["nll"], 4), "ppl": round(2 ** stats["nll"], 2),
                  "lr": engine.get_lr()[0], "grad_norm": stats["grad_norm"],
                  "loss_scale": engine.optimizer.loss_scale if precision == "fp16" else None,
                  "tokens_per_s": round(self.tokens / max(time.perf_counter() - self.t0, 1e-9)),
                  "tokens_per_update": stats["ntokens"], "padding": stats["padding"],
                  "skipped_nonfinite": skipped_nonfinite}
        self.log.record("train", **record)
        if self.enabled:
            self.bar.write(" | ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                      for k, v in record.items() if v is not None))
        self.tokens, self.t0 = 0, time.perf_counter()
        return record

    def close(self) -> None:
        self.bar.close()


# ------------------------------------------------------------------------------------------------
# Start-up: what every rank must agree on before a model is built
# ------------------------------------------------------------------------------------------------


def lock_run_dir(run_dir: Path, rank: int) -> Optional[files.DirectoryLock]:
    """One training per run directory: rank 0 holds ``RUN_DIR/.lock`` for the whole run (the
    kernel releases it if the process dies, so a killed run never blocks its resume); a second
    training on the same directory stops at once, naming the host and pid that hold it, on
    every rank. Translating from a run directory does not lock it. Collective."""
    err, lock = None, None
    if rank == 0:
        try:
            lock = files.DirectoryLock(run_dir)
        except BlockingIOError as e:
            err = f"train.run_dir: {e}: another training is running there; wait for it, or choose another run directory"
        except OSError as e:
            err = f"train.run_dir: {run_dir}: cannot be written ({e.strerror or e})"
    err = distributed.broadcast_object(err)
    if err:
        raise ConfigError(err)
    return lock


def check_world(engine_cfg, log: RunLog) -> None:
    """Print the ranks per node; refuse a launch of another size than ``engine.expect_*``."""
    layout = distributed.world_layout()
    log.info(f"[world] {layout['nodes']} node(s): " + ", ".join(
        f"{host} x {n}" for host, n in layout["ranks_per_node"].items()))
    for line in distributed.describe_ranks(layout["ranks"]):
        log.info(f"[world] {line}")
    for name, want, have in (("engine.expect_world_size", engine_cfg.expect_world_size, layout["world_size"]),
                             ("engine.expect_nodes", engine_cfg.expect_nodes, layout["nodes"])):
        if want is not None and want != have:
            raise ConfigError(f"{name}={want}, but this launch has {have}; check the hostfile / "
                              "allocation (nothing was started)")


def data_directory(run: RunConfig, run_dir: Path, rank: int, log: RunLog) -> Path:
    """``data.path``, or the embedded default, prepared by rank 0 into RUN_DIR/data. Collective."""
    data = run.data
    if data.path:
        return Path(data.path)
    out = run_dir / "data"
    err = None
    if rank == 0:
        try:
            prepare_default_data(out, n_pairs=data.default_pairs, vocab_size=data.default_vocab_size,
                                 seed=run.train.seed, log=log.info)
        except Exception as e:  # every rank must learn of it, not hang at the barrier
            err = f"{type(e).__name__}: {e}"
    err = distributed.broadcast_object(err)
    if err:
        raise RuntimeError(f"preparing the embedded default data failed on rank 0: {err}")
    return out


def read_manifest(data_dir: Path, rank: int, reverse: bool = False) -> dict:
    """The data directory's manifest, checksummed once by rank 0 (the others read the same
    directory), read target -> source with ``reverse`` (data.reverse). Collective."""
    result = None
    if rank == 0:
        try:
            result = load_manifest(data_dir)
        except (FileNotFoundError, ValueError) as e:
            result = {"error": str(e)}
    result = distributed.broadcast_object(result)
    if "error" in result:
        raise ConfigError(f"data.path: {result['error']}")
    return reversed_manifest(result) if reverse else result


def check_splits(run: RunConfig, data_dir: Path, manifest: dict, bleu: bool) -> None:
    """``data.valid_split`` (and ``data.test_split``, if the final evaluation decodes it) name
    splits of the data directory, with text files where BLEU decodes them: otherwise the first
    validation, or the final evaluation after the whole run, would be the first to find out."""
    wanted = [("data.valid_split", run.data.valid_split, bleu and bool(run.train.bleu_interval_updates))]
    if bleu and run.train.final_eval:
        wanted.append(("data.test_split", run.data.test_split, True))
    for name, split, decoded in wanted:
        if split not in manifest["splits"]:
            raise ConfigError(f"{name}: {data_dir} has no split {split!r}; it has {', '.join(manifest['splits'])}")
        missing = [data_dir / f"{split}.{lang}" for lang in (manifest["src_lang"], manifest["tgt_lang"])
                   if not (data_dir / f"{split}.{lang}").is_file()]
        if decoded and missing:
            raise ConfigError(f"{name}: BLEU on {split!r} reads the text {missing[0]}, which does not exist")


def write_configs(run_dir: Path, run: RunConfig, ds: dict) -> None:
    """The resolved run config and engine config, as the run uses them (rank 0)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run_config.json").write_text(dump_run_config(run) + "\n")
    (run_dir / "ds_config.json").write_text(json.dumps(ds, indent=1) + "\n")


def given_profile(path: Optional[str], cfg: ModelConfig) -> Optional[Profile]:
    """``admin.profile``, read and checked against the model before any work: a file of another
    architecture (or a deepnmt list of another length) is refused with nothing written."""
    if not path or cfg.init != "admin":
        return None
    profile = Profile.load(path, cfg)
    profile.check_matches(cfg)
    return profile


# ------------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------------


class Training:
    """One run on this rank. ``setup()`` builds everything, ``fit()`` trains, ``close()``
    releases the engine (collective teardown is distributed.shutdown)."""

    def __init__(self, run: RunConfig, ds_config_path: str, hooks: Optional[Hooks] = None,
                 bleu_tools: Optional[BleuTools] = None) -> None:
        self.run, self.ds_path = run, ds_config_path
        self.hooks = hooks or Hooks()
        self.bleu_tools = bleu_tools
        self.run_dir = Path(run.train.run_dir)
        self.runner: Optional[Runner] = None
        self.log: Optional[RunLog] = None
        self.lock: Optional[files.DirectoryLock] = None
        self.stop = StopSignals()
        self.watchdog: Optional[Watchdog] = None

    # ---- set-up --------------------------------------------------------------------------------
    def setup(self) -> None:
        run = self.run
        raw_ds = eng.load_ds_config(self.ds_path)
        eng.init_distributed(run.engine.distributed_port, run.engine.dist_timeout_s, run.engine.connect_timeout_s)
        self.rank, self.world = distributed.rank(), distributed.world_size()
        self.lock = lock_run_dir(self.run_dir, self.rank)
        self.watchdog = Watchdog(run.engine.dist_timeout_s)  # a rank that stops or dies is named
        self.watchdog.start()
        self.log = RunLog(self.run_dir, self.rank == 0, run.train.tensorboard)
        check_world(run.engine, self.log)
        self.ds = eng.resolve_ds_config(raw_ds, run, self.world, source=self.ds_path)
        self.layout = eng.layout(self.ds, run.engine.pipeline_stages, self.world)
        self.trim_heap = eng.heap_trimmer(self.layout["precision"])
        dp, gas = self.layout["data_parallel"], self.ds["gradient_accumulation_steps"]
        self.log.info(f"[world] {self.world} rank(s): data-parallel {dp} x pipeline {run.engine.pipeline_stages}; "
                      f"ZeRO-{self.layout['zero']}, {self.layout['precision']}, device {eng.device().type}")
        self.log.info(f"[batch] micro-batch <= {run.data.max_tokens} padded tokens x accumulation {gas} "
                      f"x data-parallel {dp} = up to {run.data.max_tokens * gas * dp} tokens per update")

        self.data_dir = data_directory(run, self.run_dir, self.rank, self.log)
        self.manifest = read_manifest(self.data_dir, self.rank, run.data.reverse)
        check_splits(run, self.data_dir, self.manifest, bleu=self.bleu_tools is not None)
        self.cfg = run.model.build(vocab_size=self.manifest["vocab_size"])
        self.given_profile = given_profile(run.admin.profile, self.cfg)
        self.checkpoints = CheckpointManager(self.run_dir / "checkpoints", run.train.keep_last, self.log.info,
                                             self.hooks.on_checkpoint_write, keep_best=run.train.keep_best)
        # Before the engine: a layout change needs an engine built for universal loading.
        self.resume_plan = self.checkpoints.plan_resume(self.layout, self.cfg, self.manifest) if run.train.resume else None
        configure_loading(self.ds, self.resume_plan)
        for note in run.engine.resolve_auto(eng.device().type, self.resume_plan.engine if self.resume_plan else None):
            self.log.info(f"[resume] {note}")
        if self.rank == 0:
            write_configs(self.run_dir, run, self.ds)

        cfg = self.cfg
        self.runner = make_runner(run, self.ds, cfg, self.hooks)
        self.log.info(f"[model] {run.model.preset} {cfg.num_encoder_layers}L-{cfg.num_decoder_layers}L "
                      f"{cfg.model_dim}/{cfg.ffn_inner_dim}/{cfg.num_heads}, init={cfg.init}, norm={cfg.norm_order}, "
                      f"vocabulary {cfg.vocab_size}: {_whole_model_parameters(cfg) / 1e6:.2f}M parameters")
        for line in self.runner.describe():
            self.log.info(line)
        self.guard = DivergenceGuard(run.guard)
        self.evaluator = Evaluator(run, self.runner, self.data_dir, self.manifest, cfg, self.run_dir, self.bleu_tools)
        self.iterator = self.evaluator.iterator("train", shuffle=True, gas=self.ds["gradient_accumulation_steps"])
        if self.iterator.dropped:
            self.log.info(f"[data] dropped {self.iterator.dropped} training pairs longer than "
                          f"{min(run.data.max_positions, cfg.max_positions)} tokens")
        self.state = TrainState()
        # The process's CPU time (from its start) and the wall-clock time (from here) charged to the
        # run so far (TrainState.charge).
        self.cost_mark = (0.0, time.monotonic())
        self.saved_update: Optional[int] = None
        self.last_valid: tuple[int, float] = (-1, math.nan)  # (update, loss) of the last validation
        self.profile: Optional[Profile] = None
        # Dropout masks repeat from run to run, also when no profiling pass seeds them (a reused
        # profile); a resumed run restores the checkpoint's RNG states instead.
        torch.manual_seed(run.train.seed)

    # ---- profiling -----------------------------------------------------------------------------
    def profiling_batch(self) -> dict:
        """This rank's first micro-batch of the first epoch (batches split for the data-parallel
        size only): the batch the reference profiles on. When the training iterator has exactly
        those batches and has not started (no gradient accumulation, a fresh run), its first batch
        is read without being consumed, so that the epoch's token buckets are built once: at
        WMT14 En-Fr's 36M pairs that costs ~13 s on a CPU core (make_token_batches), far more
        than the profiling forward pass itself."""
        it = self.iterator
        if it.required_multiple == it.num_replicas and it.epoch == 1 and it.position == 0:
            return it.peek_batch()
        return self.evaluator.iterator("train", shuffle=True).next_batch()

    def establish_profile(self) -> None:
        """Reuse a given profile, or profile on each rank's first micro-batch and reduce; then
        omega goes into the engine (every copy) and the profile into the run directory."""
        run, cfg = self.run, self.cfg
        if cfg.init != "admin":
            return
        self.watchdog.mark("profiling")
        if self.given_profile is not None:
            profile = self.given_profile
            self.log.info(f"[admin] using the profile {run.admin.profile} ({profile.formula})")
        else:
            t0 = time.perf_counter()
            profile = self.runner.profile(self.profiling_batch())
            self.log.info(f"[admin] profiled omega on {profile.tokens['src']} source / {profile.tokens['tgt']} "
                          f"target tokens over {self.layout['data_parallel']} data-parallel x "
                          f"{run.engine.pipeline_stages} pipeline rank(s) in {time.perf_counter() - t0:.2f}s "
                          f"({run.admin.formula} formula)")
        self.profile = profile
        self.hooks.profiled()
        eng.write_omega(self.runner.engine, profile)
        if self.rank == 0:
            profile.save(self.run_dir / "admin_profile.json")
            (self.run_dir / "profile.ratio.init").write_text(profile.to_ratio_init())
        enc, dec = profile.omega("encoder"), profile.omega("decoder")
        self.log.info(f"[admin] omega: encoder {enc[0]:.3f} .. {enc[-1]:.3f}, decoder {dec[0]:.3f} .. {dec[-1]:.3f}")

    # ---- checkpoints ---------------------------------------------------------------------------
    def client_state(self) -> dict:
        return {"admin_ds": {
            "run_config": self.run.to_dict(), "model_config": self.cfg.to_dict(),
            "profile": None if self.profile is None else self.profile.to_dict(),
            "train_state": vars(self.state).copy(), "data_state": self.iterator.state_dict(),
            "subword_sha256": self.manifest.get("subword_sha256"), "direction": direction(self.manifest),
            "layout": self.layout, "engine": {k: getattr(self.run.engine, k) for k in PRE_AUTO_ENGINE},
            "guard": self.guard.state_dict()}}

    def save(self) -> None:
        t0 = time.perf_counter()
        self.watchdog.mark(f"checkpoint {self.state.update}")
        self.cost_mark = self.state.charge(self.cost_mark)
        at, loss = self.last_valid
        tag = self.checkpoints.save(self.runner.engine, self.state.update, self.client_state(),
                                    valid_loss=loss if at == self.state.update else None)
        self.saved_update = self.state.update
        self.log.info(f"[checkpoint] saved {self.checkpoints.dir / tag} in {time.perf_counter() - t0:.1f}s")

    def restore(self, plan: ResumePlan, rollback: bool = False) -> None:
        """Load ``plan.tag`` and our state from it. A rollback keeps the data position (the guard
        continues after the divergence) and the guard's learning-rate multiplier."""
        client = self.checkpoints.load(self.runner.engine, plan)["admin_ds"]
        saved = ModelConfig.from_dict(client["model_config"])
        if saved != self.cfg:
            diff = [k for k in saved.to_dict() if saved.to_dict()[k] != self.cfg.to_dict()[k]]
            raise ConfigError(f"{self.checkpoints.dir / plan.tag}: the checkpoint's model differs from the run "
                              f"config in model.{', model.'.join(diff)}; use a new train.run_dir or the same model")
        spent = self.state.cpu_s, self.state.wall_s  # a rollback still paid for the updates it discards
        self.state = TrainState(**client["train_state"])
        if rollback:
            self.state.cpu_s, self.state.wall_s = spent
        self.saved_update = self.state.update
        if not rollback:
            self.iterator.load_state_dict(client["data_state"])
        if client.get("profile"):
            self.profile = Profile.from_dict(client["profile"])
            if plan.universal:  # universal loading restores parameters, not buffers
                eng.write_omega(self.runner.engine, self.profile, buffers_only=True)
        self.guard.load_state_dict(client.get("guard"), rollback=rollback)
        if self.guard.state.lr_scale != 1.0:
            apply_lr_scale(self.runner.engine, self.run.optim.lr, self.guard.state.lr_scale)

    def try_resume(self) -> bool:
        plan = self.resume_plan
        if plan is None:
            return False
        removed = self.checkpoints.remove_torn()
        if removed:
            self.log.info(f"[resume] removed incomplete checkpoint(s): {', '.join(sorted(removed))}")
        for note in plan.notes:
            self.log.info(f"[resume] {note}")
        self.restore(plan)
        change = f"; layout {describe(plan.saved)} -> {describe(plan.current)}" if plan.layout_changed else ""
        self.log.info(f"[resume] from {self.checkpoints.dir / plan.tag}: update {self.state.update}, "
                      f"epoch {self.state.epoch}{change}")
        return True

    def rollback(self, reason: str) -> None:
        """The divergence guard's remedy (guard.py): the newest complete checkpoint, the learning
        rate x guard.lr_factor, the data after the divergence. Collective."""
        at = self.state.update
        tag = self.checkpoints.newest_verified()
        scale = self.guard.begin_rollback(reason, tag)
        self.guard.state.lr_scale, self.guard.state.rollbacks = scale, self.guard.state.rollbacks + 1
        self.restore(self.checkpoints.plan_resume(self.layout, self.cfg, self.manifest, tag=tag), rollback=True)
        self.log.record("rollback", update=at, to_update=self.state.update, reason=reason, lr_scale=scale,
                        lr=self.runner.engine.get_lr()[0], rollbacks=self.guard.state.rollbacks)
        self.log.info(f"[guard] {reason} at update {at}: rolled back to {self.checkpoints.dir / tag}, "
                      f"learning rate x{scale:g} from here on")

    # ---- the run -------------------------------------------------------------------------------
    def train_update(self) -> dict:
        """One optimizer update; the train state advances."""
        self.hooks.update_start(self.state.update + 1)
        self.watchdog.mark(f"update {self.state.update + 1}")
        stats = self.runner.train_step([self.iterator.next_batch() for _ in range(self.ds["gradient_accumulation_steps"])])
        self.trim_heap()
        s = self.state
        s.update, s.epoch = s.update + 1, self.iterator.epoch
        s.tokens_seen, s.sentences_seen = s.tokens_seen + stats["ntokens"], s.sentences_seen + stats["nsentences"]
        # DeepSpeed skipped the step (guard.py); in fp16 a skip with a finite loss is the loss
        # scaler's overflow, which is routine and left to it.
        stats["nonfinite"] = not math.isfinite(stats["loss"]) or (stats["skipped"] and self.layout["precision"] != "fp16")
        return stats

    def fit(self) -> dict:
        """Resume or profile, then updates until ``train.max_updates`` (or ``train.max_epochs``, or
        a signal the ranks agreed on), then the final checkpoint and evaluation."""
        run = self.run
        if not self.try_resume():
            self.establish_profile()
            if self.profile is not None:
                self.log.info(omega_table(self.profile) if self.cfg.num_encoder_layers <= 6 else
                              "[admin] omega table written to admin_profile.json")
        if run.admin.profile_only:
            self.log.info(f"[admin] --profile-only: profile written to {self.run_dir / 'admin_profile.json'}")
            return {}
        progress = Progress(self.log, run.train.max_updates, self.state.update, self.rank == 0)
        t_start = time.perf_counter()
        last, stopped = {}, None
        self.stop.install()
        while self.state.update < run.train.max_updates and not self.state.converged(run.train.patience):
            if run.train.max_epochs and self.iterator.epoch > run.train.max_epochs:
                break
            stats = self.train_update()
            progress.update(stats["ntokens"])
            if self.guard_update(stats):  # rolled back: the update count went back
                progress.rolled_back(self.state.update)
                continue
            u = self.state.update
            if u % run.train.log_interval == 0 or u == run.train.max_updates:
                last = progress.record(self.state, stats, self.runner.engine, self.layout["precision"],
                                       self.guard.state.skipped_nonfinite)
            # After the last update: the final checkpoint and evaluation; a signal then changes nothing.
            if u < run.train.max_updates:
                self.at_intervals(u)
                stopped = self.stop.agreed(self.runner.device)
                if stopped:
                    break
        progress.close()
        train_s = time.perf_counter() - t_start
        if self.saved_update != self.state.update:  # decided locally: every rank agrees without I/O
            self.save()
        self.stop.restore()  # only now: a second signal must not interrupt the save
        if stopped:
            return self._stopped(stopped)
        return self._finish(train_s, last)

    def guard_update(self, stats: dict) -> bool:
        """The divergence guard's view of the update just made: a non-finite one is logged (it was
        skipped), a divergence rolls back. True if it rolled back."""
        reason = self.guard.observe(stats)
        if stats["nonfinite"]:
            u = self.state.update
            self.log.record("skip", update=u, loss=stats["loss"], skipped_nonfinite=self.guard.state.skipped_nonfinite)
            self.log.info(f"[guard] update {u}: non-finite loss or gradient, update skipped "
                          f"({self.guard.state.skipped_nonfinite} so far)")
        if reason:
            self.rollback(reason)
        return bool(reason)

    def at_intervals(self, u: int) -> None:
        """Validation loss, BLEU and checkpoints due after update ``u`` (not the last)."""
        run = self.run
        if u % run.train.valid_interval_updates == 0:
            self.watchdog.mark(f"validation after update {u}")
            v = self.evaluator.valid_loss(run.data.valid_split)
            self.log.record("valid", update=u, **v)
            self.log.info(f"[valid] update {u}: loss {v['loss']:.3f} nll {v['nll']:.3f} ppl {v['ppl']:.2f}")
            self.state.note_validation(v["loss"])
            self.last_valid = (u, v["loss"])
            if self.state.converged(run.train.patience):
                self.log.info(f"[valid] no improvement for {run.train.patience} validations: stopping (train.patience)")
        every = run.train.bleu_interval_updates
        if every and u % every == 0:
            b = self.evaluator.bleu(run.data.valid_split)
            if b is not None:
                self.log.record("valid_bleu", update=u, **b)
                self.log.info(f"[valid] update {u}: BLEU {b['bleu']:.2f} ({b['signature']})")
        if u % run.train.save_interval_updates == 0:
            self.save()

    def _stopped(self, signals) -> dict:
        u = self.state.update
        self.log.record("stop", update=u, signals=signals)
        self.log.info(f"[stop] {signals}: saved {self.checkpoints.dir / tag_for(u)} at update {u}; exit "
                      f"status {REQUEUE_STATUS} (saved for requeue): the same command resumes from there")
        return {"updates": u, "stopped_by": signals, "requeue": True}

    def _finish(self, train_s: float, last: dict) -> dict:
        self.cost_mark = self.state.charge(self.cost_mark)
        summary = {"updates": self.state.update, "epoch": self.state.epoch, "tokens_seen": self.state.tokens_seen,
                   "train_s": round(train_s, 1), "wall_hours": round(self.state.wall_s / 3600, 6),
                   "cpu_hours": round(self.state.cpu_s / 3600, 6),
                   "parameters": _whole_model_parameters(self.cfg),
                   "last_train_loss": last.get("loss")}
        if self.run.train.patience is not None:
            summary.update(converged=self.state.converged(self.run.train.patience), best_valid_loss=self.state.best_valid_loss)
        bleu = None
        self.watchdog.mark("final evaluation")
        if self.run.train.final_eval:
            v = self.evaluator.valid_loss(self.run.data.valid_split)
            self.log.record("valid", update=self.state.update, **v)
            summary.update(valid_loss=round(v["loss"], 4), valid_ppl=round(v["ppl"], 2))
            bleu = self.evaluator.bleu(self.run.data.test_split)
        if bleu is not None:
            summary.update({f"test_{k}": (round(x, 2) if isinstance(x, float) else x) for k, x in bleu.items()})
            self.log.record("test", update=self.state.update, **bleu)
        self.log.record("summary", **summary)
        if self.rank == 0:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        self.log.info("[summary] " + json.dumps(summary))
        distributed.barrier()
        return summary

    def close(self) -> None:
        import gc

        for release in (self.watchdog and self.watchdog.stop, self.runner and self.runner.close,
                        self.log and self.log.close, self.lock and self.lock.release):
            if release:
                release()
        self.runner = None
        gc.collect()


def _whole_model_parameters(cfg: ModelConfig) -> int:
    from admin_ds.model.transformer import build_model

    return count_parameters(build_model(cfg, device="meta"))


def train(run: RunConfig, ds_config_path: str, hooks: Optional[Hooks] = None,
          bleu_tools: Optional[BleuTools] = None) -> dict:
    """The whole run on this rank; leaves the process group (distributed.shutdown) on every path.
    ``bleu_tools``: decoding and scoring for BLEU (evaluator.py); without them, validation loss only."""
    clean, training = False, Training(run, ds_config_path, hooks, bleu_tools)
    try:
        training.setup()
        summary = training.fit()
        clean = True
        return summary
    except RuntimeError as e:
        if training.watchdog is not None:
            training.watchdog.collective_failed(e)  # a rank missing: reports it and exits (status 3)
        raise
    finally:
        training.stop.restore()
        training.close()
        distributed.shutdown(clean)
