"""Runners: a training step, a validation loss, a profiling pass and the model's state, for one
layout. The loop (loop.py) talks to this interface only; the two implementations are the only
code that knows whether the run is data-parallel or pipelined.

    runner = make_runner(run, ds, cfg, hooks)
    stats = runner.train_step(batches)        # one optimizer update over this rank's micro-batches
    sums = runner.eval_loss(batches)          # summed loss, nll, tokens over the whole world
    profile = runner.profile(batch)           # distributed Admin profiling, identical everywhere
    state = runner.state_dict()               # the whole model's state on rank 0 (collective)

Loss normalisation (docs/design.md decision 5). The update's gradient is
    g = d/dtheta [ sum over all target tokens of the update (every micro-batch, every rank) of
                   the token loss ] / N_update,
where N_update is the number of non-pad target tokens of the whole update. Each rank counts its
micro-batches' tokens first and all-reduces the count; then each micro-batch's summed loss is
multiplied by dp / N_update: DeepSpeed's data-parallel reduction averages over the dp ranks
(divides by dp) and we switch off its division by the accumulation steps (``scale_wrt_gas=False``;
the pipeline engine divides by the accumulation steps itself, so its scale also multiplies them
back). The result does not depend on how the same tokens are split into micro-batches and ranks,
which a test checks (1x4, 2x2, 4x1).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from admin_ds import distributed, logs
from admin_ds.model.config import ModelConfig
from admin_ds.model.flops import token_counts
from admin_ds.model.profiling import OmegaRecorder, Profile, SublayerProfile, finalize_omega, measure_profile
from admin_ds.model.residual import iter_residuals
from admin_ds.model.transformer import build_model, compile_layers, set_dropout_impl
from admin_ds.train import engine as eng
from admin_ds.train.guard import install_skip
from admin_ds.train.hooks import Hooks

LN2 = math.log(2)


def label_smoothed_nll(logits: torch.Tensor, target: torch.Tensor, eps: float, pad_idx: int):
    """fairseq's label_smoothed_cross_entropy, summed over non-pad tokens, in float32:
    loss = (1 - eps - eps/(V-1)) * nll + eps/(V-1) * sum_v -log p_v.
    ``logits`` (B, T, V) for every position of ``target`` (B, T), or (N, V) for its real positions
    only (the model's ``skip_padding`` output)."""
    target = target.reshape(-1)
    keep = target.ne(pad_idx)
    logits = logits.reshape(-1, logits.size(-1))
    if logits.size(0) == target.numel():
        logits = logits[keep]  # before the softmax: padded rows cost nothing
    lprobs, target = F.log_softmax(logits.float(), dim=-1), target[keep]
    nll = -lprobs.gather(1, target[:, None]).squeeze(1)
    smooth = -lprobs.sum(dim=-1)
    eps_i = eps / (lprobs.size(-1) - 1)
    loss = (1.0 - eps - eps_i) * nll + eps_i * smooth
    return loss.sum(), nll.sum()


def _float(x) -> Optional[float]:
    if x is None:
        return None
    x = float(x)
    return round(x, 4) if math.isfinite(x) else x


class Runner:
    """What the loop needs from a layout. Attributes: ``engine`` (the DeepSpeed engine, for
    checkpoints and the learning rate), ``dp`` / ``dp_rank`` / ``dp_group`` (the data-parallel
    world the batches are sharded over), ``device``."""

    engine = None
    dp: int
    dp_rank: int
    dp_group = None

    def __init__(self, run, ds: dict, cfg: ModelConfig, hooks: Optional[Hooks] = None) -> None:
        self.run, self.ds, self.cfg = run, ds, cfg
        self.hooks = hooks or Hooks()
        self.gas = ds["gradient_accumulation_steps"]
        self.device = eng.device()
        self.rank = distributed.rank()
        self.eps = run.optim.label_smoothing

    # ---- the interface ------------------------------------------------------------------------
    def train_step(self, batches: list[dict]) -> dict:
        """One optimizer update over this rank's ``gas`` micro-batches. Returns the update's mean
        loss and nll in bits, its tokens and sentences (whole world), the gradient norm, and
        whether the optimizer skipped the step."""
        raise NotImplementedError

    def eval_loss(self, batches: list[dict]) -> torch.Tensor:
        """(summed loss, summed nll, target tokens) over this rank's batches, reduced over the world."""
        raise NotImplementedError

    def profile(self, batch: dict) -> Profile:
        """Admin profiling on each data-parallel rank's ``batch``, statistics reduced so that every
        rank gets the same omega (with dropout off: one process's on the pooled micro-batches,
        or on their concatenation with admin.mask_padding; model/profiling.py)."""
        raise NotImplementedError

    def state_dict(self) -> Optional[dict]:
        """The whole model's state dict (training precision) on rank 0, None elsewhere. Collective."""
        raise NotImplementedError

    def describe(self) -> list[str]:
        return []

    # ---- shared -------------------------------------------------------------------------------
    def _set_runtime_choices(self, model) -> None:
        for layer in model.decoder_layers:
            layer.mask_padded_keys = self.run.engine.mask_padded_target_keys
        set_dropout_impl(model, self.run.engine.dropout)

    def _counts(self, batches: list[dict]) -> dict:
        """Target tokens, sentences and the padding fraction of the whole update (every pipeline
        stage draws the same batches, so reducing over the data-parallel group suffices)."""
        real, positions = token_counts(batches, self.cfg.pad_idx)
        local = torch.tensor([sum(b["ntokens"] for b in batches), sum(b["nsentences"] for b in batches),
                              real, positions], dtype=torch.float64)
        ntokens, nsentences, real, positions = distributed.all_reduce_sum(local, self.dp_group).tolist()
        return {"ntokens": int(ntokens), "nsentences": int(nsentences), "padding": round(1 - real / positions, 4)}

    def _result(self, sums: torch.Tensor, counts: dict, grad_norm, skipped: bool) -> dict:
        n = counts["ntokens"]
        return {"loss": float(sums[0]) / n / LN2, "nll": float(sums[1]) / n / LN2, **counts,
                "grad_norm": grad_norm, "skipped": skipped}

    def _on_device(self, b: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return b["src_tokens"].to(self.device), b["tgt_in_tokens"].to(self.device), b["target"].to(self.device)

    def _world(self) -> dict:
        return {"data_parallel": self.dp, "pipeline": self.run.engine.pipeline_stages,
                "world_size": distributed.world_size()}

    def close(self) -> None:
        """Release the engine: DeepSpeed's gradient hooks hold the optimizer, the model and,
        through the parameters, its process groups in a cycle the garbage collector cannot see;
        without ``destroy`` the groups' threads outlive the run (admin_ds/distributed.py). The
        pipeline engine's output-backward hooks also keep the engine object alive from C++ (a
        cycle destroy() leaves in place); emptied, it holds no module, optimizer or group."""
        if self.engine is not None:
            self.engine.destroy()
            vars(self.engine).clear()
        vars(self).clear()  # the model, the stage and the groups go with it: the runner is done


class DataParallelRunner(Runner):
    """The whole model on every rank; ZeRO 0-3 partitions its optimizer state, gradients and
    parameters."""

    def __init__(self, run, ds: dict, cfg: ModelConfig, hooks: Optional[Hooks] = None) -> None:
        super().__init__(run, ds, cfg, hooks)
        self.dp, self.dp_rank, self.dp_group = distributed.world_size(), self.rank, None
        model = build_model(cfg, seed=run.train.seed)  # per-layer generators: the same on every rank
        self._set_runtime_choices(model)
        self.skip_padding = run.engine.skip_padding
        model.activation_checkpointing = run.engine.activation_checkpointing
        if run.engine.compile:
            compile_layers(model)
        self.engine = eng.initialize(model, run, ds)
        self.model = self.engine.module
        if self.dp == 1 and eng.zero_stage(ds) == 0:
            # Without ZeRO DeepSpeed all-reduces the gradients after each backward, copying every
            # one into flat buckets first; over a group of one rank that is an identity (divided
            # by 1), and the copies were ~3% of a CPU update (BENCHMARKS.md): skipped.
            self.engine.enable_backward_allreduce = False
        install_skip(self.engine)  # non-finite updates are skipped under every ZeRO stage

    def train_step(self, batches: list[dict]) -> dict:
        counts = self._counts(batches)
        ntokens = counts["ntokens"]
        before = self.engine.skipped_steps
        sums = torch.zeros(2, dtype=torch.float64)
        grad_norm = None
        for i, b in enumerate(batches):
            src, tgt_in, target = self._on_device(b)
            loss, nll = label_smoothed_nll(self.engine(src, tgt_in, skip_padding=self.skip_padding), target,
                                           self.eps, self.cfg.pad_idx)
            loss = self.hooks.loss(loss, self.rank)
            self.engine.backward(loss * (self.dp / ntokens), scale_wrt_gas=False)
            if i == len(batches) - 1 and eng.zero_stage(self.ds) == 0:
                grad_norm = _grad_norm(self.model)  # without ZeRO, DeepSpeed only measures it to clip
            self.engine.step()
            sums += torch.tensor([loss.item(), nll.item()], dtype=torch.float64)
        if grad_norm is None:
            grad_norm = _float(self.engine.get_global_grad_norm())
        return self._result(distributed.all_reduce_sum(sums), counts, grad_norm, self.engine.skipped_steps > before)

    @torch.no_grad()
    def eval_loss(self, batches: list[dict]) -> torch.Tensor:
        sums = torch.zeros(3, dtype=torch.float64)
        self.engine.eval()
        for b in batches:
            src, tgt_in, target = self._on_device(b)
            loss, nll = label_smoothed_nll(self.engine(src, tgt_in, skip_padding=self.skip_padding), target,
                                           self.eps, self.cfg.pad_idx)
            sums += torch.tensor([loss.item(), nll.item(), b["ntokens"]], dtype=torch.float64)
        self.engine.train()
        return distributed.all_reduce_sum(sums)

    def profile(self, batch: dict) -> Profile:
        a = self.run.admin
        src, tgt_in, _ = self._on_device(batch)
        return measure_profile(self.model, (src, tgt_in), formula=a.formula, mask_padding=a.mask_padding,
                             reduce_fn=distributed.all_reduce_sum, seed=self.run.train.seed, world=self._world())

    def state_dict(self) -> Optional[dict]:
        return eng.consolidated_state_dict(self.engine)


class PipelineRunner(Runner):
    """One stage of the model per rank (pipeline.py), data-parallel replicas of each stage;
    DeepSpeed's pipeline engine schedules the micro-batches. ZeRO 0-1."""

    def __init__(self, run, ds: dict, cfg: ModelConfig, hooks: Optional[Hooks] = None) -> None:
        super().__init__(run, ds, cfg, hooks)
        from admin_ds.train.pipeline import PipelineStage, StagePipelineModule, stage_of_rank

        stages = run.engine.pipeline_stages
        world = distributed.world_size()
        self.stage = PipelineStage(cfg, run.train.seed, stages, stage_of_rank(self.rank, world, stages))
        self._set_runtime_choices(self.stage.model)
        with logs.without_known_prints():
            module = StagePipelineModule(self.stage, loss_fn=self._loss,
                                         activation_checkpointing=run.engine.activation_checkpointing)
        self.engine = eng.initialize(module, run, ds)
        self.model = self.engine.module
        install_skip(self.engine)
        grid = self.engine.grid
        self.dp, self.dp_rank, self.dp_group = world // stages, grid.get_data_parallel_id(), grid.get_data_parallel_group()
        self._sums = torch.zeros(3, dtype=torch.float64)
        self._scale = 1.0

    def describe(self) -> list[str]:
        return [f"[pipeline] {self.run.engine.pipeline_stages} stages, cost-balanced partition:\n" + self.stage.describe()]

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The last stage's loss_fn. DeepSpeed divides the loss by the accumulation steps and
        averages over data-parallel ranks; the scale set per update undoes both and divides by
        the update's target tokens, as in the data-parallel path. Sums are kept for logging."""
        loss, nll = label_smoothed_nll(logits, target, self.eps, self.cfg.pad_idx)
        loss = self.hooks.loss(loss, self.rank)
        self._sums += torch.tensor([loss.item(), nll.item(), float(target.ne(self.cfg.pad_idx).sum())],
                                   dtype=torch.float64)
        return loss * self._scale

    def _batches(self, batches):
        """DeepSpeed's (inputs, labels) pairs: the first stage reads the inputs, the last the labels."""
        return iter([((src, tgt_in), target) for src, tgt_in, target in map(self._on_device, batches)])

    def train_step(self, batches: list[dict]) -> dict:
        counts = self._counts(batches)
        before = self.engine.skipped_steps
        self._scale = self.dp * self.gas / counts["ntokens"]
        self._sums.zero_()
        self.engine.train_batch(data_iter=self._batches(batches))
        sums = distributed.all_reduce_sum(self._sums.clone())[:2]  # only last stages contributed
        return self._result(sums, counts, _float(self.engine.get_global_grad_norm()), self.engine.skipped_steps > before)

    @torch.no_grad()
    def eval_loss(self, batches: list[dict]) -> torch.Tensor:
        self._scale = 1.0
        self._sums.zero_()
        self.engine.eval_batch(self._batches(batches), num_micro_batches=len(batches))
        return distributed.all_reduce_sum(self._sums.clone())

    def profile(self, batch: dict) -> Profile:
        """Each stage profiles its sub-layers in one eval_batch (dropout kept on), statistics reduced
        over the stage's data-parallel group, the running omega carried across stage boundaries;
        then every stage's rows are combined over the world."""
        from admin_ds.train.pipeline import profiling

        a, cfg = self.run.admin, self.cfg
        local = list(iter_residuals(self.stage.model))
        start = {st: min((r.index for r in local if r.stack == st), default=1) for st in ("encoder", "decoder")}
        recorder = OmegaRecorder(a.formula, start_index=start,
                                 reduce_fn=lambda t: distributed.all_reduce_sum(t, self.dp_group))
        torch.manual_seed(self.run.train.seed)
        with profiling(self.model, recorder, mask_padding=a.mask_padding):
            self.engine.eval_batch(self._batches([batch]), num_micro_batches=1)
        # Each stage fills its own rows (stage boundaries split the rows disjointly).
        keys = [("encoder", i) for i in range(1, cfg.num_encoder_sublayers + 1)] + \
               [("decoder", i) for i in range(1, cfg.num_decoder_sublayers + 1)]
        rows = torch.zeros(len(keys), 4, dtype=torch.float64)
        if self.dp_rank == 0:  # the dp replicas of a stage hold identical, already reduced rows
            for k, key in enumerate(keys):
                sub = recorder.results.get(key)
                if sub is not None:
                    rows[k] = torch.tensor([sub.var_shortcut, sub.var_branch, sub.count, sub.omega], dtype=torch.float64)
        distributed.all_reduce_sum(rows)  # over the whole world: exactly one rank contributes each row
        subs = [SublayerProfile(st, i, float(r[3]), var_branch=float(r[1]), var_shortcut=float(r[0]), count=int(r[2]))
                for (st, i), r in zip(keys, rows)]
        tokens = torch.tensor([batch["src_tokens"].ne(cfg.pad_idx).sum(), batch["tgt_in_tokens"].ne(cfg.pad_idx).sum()],
                              dtype=torch.float64)
        distributed.all_reduce_sum(tokens, self.dp_group)
        return Profile(formula=a.formula, sublayers=finalize_omega(a.formula, subs),
                       tokens={"src": int(tokens[0]), "tgt": int(tokens[1])}, seed=self.run.train.seed,
                       config_hash=cfg.config_hash(), mask_padding=a.mask_padding, world=self._world())

    def state_dict(self) -> Optional[dict]:
        """Every stage's parameters already carry the whole model's names: gather and merge."""
        mine = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()} if self.dp_rank == 0 else {}
        parts = [None] * distributed.world_size()
        torch.distributed.all_gather_object(parts, mine)
        if self.rank != 0:
            return None
        merged = {}
        for part in parts:
            merged.update(part)
        return merged


def make_runner(run, ds: dict, cfg: ModelConfig, hooks: Optional[Hooks] = None) -> Runner:
    cls = PipelineRunner if run.engine.pipeline_stages > 1 else DataParallelRunner
    return cls(run, ds, cfg, hooks)


@torch.no_grad()
def _grad_norm(model) -> Optional[float]:
    grads = [p.grad.float() for p in model.parameters() if p.grad is not None]
    return _float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
