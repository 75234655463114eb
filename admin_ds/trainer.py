"""The training run: data, engine, profiling stage, update loop, validation, checkpoints.

    train(run, ds_config_path)   # called by launch/train.py on every rank

Order of work (each step refuses bad input before the next one starts):
  1. resolve the DeepSpeed JSON against the run config; print the derived batch numbers
  2. the data directory (rank 0 prepares the embedded default if no data is given)
  3. the model, the engine, the resumable batch iterator
  4. resume from the newest complete checkpoint (another layout: through a universal conversion,
     decided before the engine is built), or profile omega (distributed) / load a profile
  5. updates, with logs, validation and atomic checkpoints at their intervals; the divergence
     guard skips non-finite updates and rolls back on divergence (reliability.py)
  6. final checkpoint, validation loss, BLEU on the test split, summary

Loss normalisation (DESIGN.md decision 5). The update's gradient is
    g = d/dtheta [ sum over all target tokens of the update (every micro-batch, every rank) of
                   the token loss ] / N_update,
where N_update is the number of non-pad target tokens of the whole update. Each rank counts its
micro-batches' tokens first and all-reduces the count; then each micro-batch's summed loss is
multiplied by dp / N_update before ``engine.backward(..., scale_wrt_gas=False)``: DeepSpeed's
data-parallel reduction averages over the dp ranks (divides by dp) and we switched off its
division by the accumulation steps. The result does not depend on how the same tokens are split
into micro-batches and ranks, which a test checks (1x4, 2x2, 4x1).
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
import torch.nn.functional as F

from admin_ds import checkpoint as ckpt
from admin_ds import engine as eng
from admin_ds import reliability
from admin_ds.config import ConfigError, ModelConfig
from admin_ds.data import EpochBatchIterator
from admin_ds.data.binarize import load_manifest, open_split, prepare_default_data
from admin_ds.model import build_model, count_parameters
from admin_ds.profiling import Profile, omega_table, profile_omega
from admin_ds.residual import OmegaResidual
from admin_ds.run_config import RunConfig, dump_run_config

LN2 = math.log(2)


def label_smoothed_nll(logits: torch.Tensor, target: torch.Tensor, eps: float, pad_idx: int):
    """fairseq's label_smoothed_cross_entropy, summed over non-pad tokens, in float32:
    loss = (1 - eps - eps/(V-1)) * nll + eps/(V-1) * sum_v -log p_v."""
    lprobs = F.log_softmax(logits.float(), dim=-1).view(-1, logits.size(-1))
    target = target.reshape(-1)
    keep = target.ne(pad_idx)
    lprobs, target = lprobs[keep], target[keep]
    nll = -lprobs.gather(1, target[:, None]).squeeze(1)
    smooth = -lprobs.sum(dim=-1)
    eps_i = eps / (lprobs.size(-1) - 1)
    loss = (1.0 - eps - eps_i) * nll + eps_i * smooth
    return loss.sum(), nll.sum()


@dataclass
class TrainState:
    update: int = 0
    epoch: int = 1
    tokens_seen: int = 0
    sentences_seen: int = 0


class RunLog:
    """Rank 0 prints and appends to RUN_DIR/metrics.jsonl (and TensorBoard if asked)."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool) -> None:
        self.enabled = enabled
        self.metrics = None
        self.tb = None
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            self.metrics = open(run_dir / "metrics.jsonl", "a")
            if tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter
                    self.tb = SummaryWriter(str(run_dir / "tensorboard"))
                except ImportError:
                    self.info("[log] tensorboard is not installed; `pip install tensorboard` to enable it")

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None

    def info(self, msg: str) -> None:
        if self.enabled:
            print(msg, flush=True)

    def record(self, kind: str, **values) -> None:
        if not self.enabled:
            return
        self.metrics.write(json.dumps({"kind": kind, "time": round(time.time(), 3), **values}) + "\n")
        self.metrics.flush()
        if self.tb is not None:
            step = values.get("update", 0)
            for k, v in values.items():
                if isinstance(v, (int, float)) and k != "update":
                    self.tb.add_scalar(f"{kind}/{k}", v, step)


# ------------------------------------------------------------------------------------------------


class Trainer:
    def __init__(self, run: RunConfig, ds_config_path: str) -> None:
        self.run = run
        self.ds_path = ds_config_path
        self.run_dir = Path(run.train.run_dir)
        self.ckpt_dir = self.run_dir / "checkpoints"

    # ---- set-up ----------------------------------------------------------------------------------
    def setup(self) -> None:
        run = self.run
        raw_ds = eng.load_ds_config(self.ds_path)
        eng.init_distributed(run.engine.distributed_port, run.engine.dist_timeout_s, run.engine.connect_timeout_s)
        self.rank, self.world = eng.rank(), eng.world_size()
        self.log = RunLog(self.run_dir, self.rank == 0, run.train.tensorboard)
        layout = eng.world_layout()
        self.log.info(f"[world] {layout['nodes']} node(s): " + ", ".join(
            f"{host} x {n}" for host, n in layout["ranks_per_node"].items()))
        for name, want, have in (("engine.expect_world_size", run.engine.expect_world_size, layout["world_size"]),
                                 ("engine.expect_nodes", run.engine.expect_nodes, layout["nodes"])):
            if want is not None and want != have:
                raise ConfigError(f"{name}={want}, but this launch has {have}; check the hostfile / "
                                  "allocation (nothing was started)")
        self.ds = eng.resolve_ds_config(raw_ds, run, self.world, source=self.ds_path)
        self.pipeline = run.engine.pipeline_stages > 1
        self.dp = self.world // run.engine.pipeline_stages
        self.gas = self.ds["gradient_accumulation_steps"]
        self.zero = eng.zero_stage(self.ds)
        self.device = eng.device()
        self.log.info(f"[world] {self.world} rank(s): data-parallel {self.dp} x pipeline "
                      f"{run.engine.pipeline_stages}; ZeRO-{eng.zero_stage(self.ds)}, {eng.precision(self.ds)}, "
                      f"device {self.device.type}")
        self.log.info(f"[batch] micro-batch <= {run.data.max_tokens} padded tokens x accumulation {self.gas} "
                      f"x data-parallel {self.dp} = up to {run.data.max_tokens * self.gas * self.dp} tokens per update")

        self.data_dir = self._data_dir()
        self.manifest = self._manifest()
        cfg = run.model.build(vocab_size=self.manifest["vocab_size"])
        self.model_cfg = cfg
        self.resume_plan = self._plan_resume()  # before the engine: a layout change needs load_universal
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "run_config.json").write_text(dump_run_config(run) + "\n")
            (self.run_dir / "ds_config.json").write_text(json.dumps(self.ds, indent=1) + "\n")

        torch.manual_seed(run.train.seed)  # identical initial weights on every rank
        model = build_model(cfg)
        self.log.info(f"[model] {run.model.preset} {cfg.num_encoder_layers}L-{cfg.num_decoder_layers}L "
                      f"{cfg.model_dim}/{cfg.ffn_inner_dim}/{cfg.num_heads}, init={cfg.init}, "
                      f"norm={cfg.norm_order}, vocabulary {cfg.vocab_size}: "
                      f"{count_parameters(model) / 1e6:.2f}M parameters")
        if self.pipeline:
            from admin_ds.pipeline import build_pipeline, describe_partition

            model = build_pipeline(cfg, model, run.engine.pipeline_stages, loss_fn=self._pipe_loss,
                                   activation_checkpointing=run.engine.activation_checkpointing)
            self.log.info(f"[pipeline] {run.engine.pipeline_stages} stages, cost-balanced partition:\n"
                          + describe_partition(model))
        self.engine = eng.initialize(model, run, self.ds)
        self.model = self.engine.module
        reliability.install_skip(self.engine)  # non-finite updates are skipped under every ZeRO stage
        self.guard = reliability.DivergenceGuard(run.guard)
        if self.pipeline:
            grid = self.engine.grid
            self.dp_rank, self.dp_group = grid.get_data_parallel_id(), grid.get_data_parallel_group()
            self.pipe_group = grid.get_pipe_parallel_group()
        else:
            self.dp_rank, self.dp_group, self.pipe_group = self.rank, None, None
        self._pipe_sums = torch.zeros(3, dtype=torch.float64)
        self._pipe_scale = 1.0

        self.train_data = open_split(self.data_dir, "train", self.manifest)
        self.iterator = self._iterator(self.train_data, shuffle=True)
        if self.iterator.dropped:
            self.log.info(f"[data] dropped {self.iterator.dropped} training pairs longer than "
                          f"{self._max_positions()} tokens")
        self.state = TrainState()
        self.saved_update: Optional[int] = None
        self.profile: Optional[Profile] = None

    def _max_positions(self) -> int:
        return min(self.run.data.max_positions, self.model_cfg.max_positions)

    def _iterator(self, dataset, shuffle: bool, seed: Optional[int] = None) -> EpochBatchIterator:
        return EpochBatchIterator(dataset, self.run.data.max_tokens, self.model_cfg.pad_idx, self.model_cfg.eos_idx,
                                  seed=self.run.train.seed if seed is None else seed, num_replicas=self.dp,
                                  rank=self.dp_rank, shuffle=shuffle, max_positions=self._max_positions(),
                                  required_multiple=self.dp * self.gas if shuffle else self.dp)

    def _data_dir(self) -> Path:
        data = self.run.data
        if data.path:
            return Path(data.path)
        out = self.run_dir / "data"
        err = None
        if self.rank == 0:
            try:
                prepare_default_data(out, n_pairs=data.default_pairs, vocab_size=data.default_vocab_size,
                                     seed=self.run.train.seed, log=self.log.info)
            except Exception as e:  # every rank must learn of it, not hang at the barrier
                err = f"{type(e).__name__}: {e}"
        err = eng.broadcast_object(err)
        if err:
            raise RuntimeError(f"preparing the embedded default data failed on rank 0: {err}")
        return out

    def _manifest(self) -> dict:
        result = None
        if self.rank == 0:  # checksum once; other ranks read the same directory
            try:
                result = load_manifest(self.data_dir)
            except (FileNotFoundError, ValueError) as e:
                result = {"error": str(e)}
        result = eng.broadcast_object(result)
        if "error" in result:
            raise ConfigError(f"data.path: {result['error']}")
        return result

    # ---- profiling ---------------------------------------------------------------------------------
    def omega_names(self) -> list[str]:
        return [n for n, _ in self.model.named_parameters() if n.endswith("omega")]

    def establish_profile(self) -> None:
        """Reuse a given profile, or profile on each rank's first micro-batch and reduce."""
        run, cfg = self.run, self.model_cfg
        if cfg.init != "admin":
            return
        if run.admin.profile:
            profile = Profile.load(run.admin.profile)
            profile.check_matches(self.model_cfg)
            self.log.info(f"[admin] using the profile {run.admin.profile} ({profile.formula})")
        elif self.pipeline:
            t0 = time.perf_counter()
            profile = self._profile_pipeline()
            self.log.info(f"[admin] profiled omega across {run.engine.pipeline_stages} pipeline stages x "
                          f"{self.dp} data-parallel ranks in {time.perf_counter() - t0:.2f}s ({run.admin.formula} formula)")
        else:
            t0 = time.perf_counter()
            first = self._iterator(self.train_data, shuffle=True).next_batch()
            batch = (first["src_tokens"].to(self.device), first["tgt_in_tokens"].to(self.device))
            profile = profile_omega(
                self.model, batch, formula=run.admin.formula, mask_padding=run.admin.mask_padding,
                reduce_fn=eng.all_reduce_sum, seed=run.train.seed,
                world={"data_parallel": self.dp, "pipeline": run.engine.pipeline_stages, "world_size": self.world})
            self.log.info(f"[admin] profiled omega on {profile.tokens['src']} source / {profile.tokens['tgt']} "
                          f"target tokens over {self.dp} rank(s) in {time.perf_counter() - t0:.2f}s "
                          f"({run.admin.formula} formula)")
        self.profile = profile
        reliability.FAULTS.profile_point()
        self.write_omega(profile)
        if self.rank == 0:
            profile.save(self.run_dir / "admin_profile.json")
            (self.run_dir / "profile.ratio.init").write_text(profile.to_ratio_init())
        enc, dec = profile.omega("encoder"), profile.omega("decoder")
        self.log.info(f"[admin] omega: encoder {enc[0]:.3f} .. {enc[-1]:.3f}, decoder {dec[0]:.3f} .. {dec[-1]:.3f}")

    def _profile_pipeline(self) -> Profile:
        """Each stage profiles its sub-layers in one eval_batch (dropout kept on), statistics reduced
        over the stage's data-parallel group, the running omega carried across stage boundaries;
        then every stage's rows are combined over the pipeline group."""
        from admin_ds.pipeline import pipeline_profiling
        from admin_ds.profiling import OmegaRecorder, SublayerProfile, finalize_omega
        from admin_ds.residual import iter_residuals

        run, cfg = self.run, self.model_cfg
        first = self._iterator(self.train_data, shuffle=True).next_batch()
        local = [r for r in iter_residuals(self.model)]
        start = {st: min((r.index for r in local if r.stack == st), default=1) for st in ("encoder", "decoder")}
        recorder = OmegaRecorder(run.admin.formula, reduce_fn=lambda t: eng.all_reduce_sum(t, self.dp_group),
                                 start_index=start)
        torch.manual_seed(run.train.seed)
        data = iter([((first["src_tokens"].to(self.device), first["tgt_in_tokens"].to(self.device)),
                      first["target"].to(self.device))])
        with pipeline_profiling(self.engine, recorder, mask_padding=run.admin.mask_padding):
            self.engine.eval_batch(data, num_micro_batches=1)
        # Combine: each stage fills its own rows (stage boundaries split the rows disjointly).
        keys = [("encoder", i) for i in range(1, cfg.num_encoder_sublayers + 1)] + \
               [("decoder", i) for i in range(1, cfg.num_decoder_sublayers + 1)]
        rows = torch.zeros(len(keys), 4, dtype=torch.float64)
        in_first_dp = self.dp_rank == 0  # the dp replicas of a stage hold identical, already reduced rows
        for k, key in enumerate(keys):
            sub = recorder.results.get(key)
            if sub is not None and in_first_dp:
                rows[k] = torch.tensor([sub.var_shortcut, sub.var_branch, sub.count, sub.omega], dtype=torch.float64)
        eng.all_reduce_sum(rows)  # over the whole world: exactly one rank contributes each row
        subs = [SublayerProfile(st, i, float(r[3]), var_branch=float(r[1]), var_shortcut=float(r[0]), count=int(r[2]))
                for (st, i), r in zip(keys, rows)]
        tokens = torch.tensor([first["src_tokens"].ne(cfg.pad_idx).sum(), first["tgt_in_tokens"].ne(cfg.pad_idx).sum()],
                              dtype=torch.float64)
        eng.all_reduce_sum(tokens, self.dp_group)
        return Profile(formula=run.admin.formula, sublayers=finalize_omega(run.admin.formula, subs),
                       tokens={"src": int(tokens[0]), "tgt": int(tokens[1])}, seed=run.train.seed,
                       config_hash=cfg.config_hash(), mask_padding=run.admin.mask_padding,
                       world={"data_parallel": self.dp, "pipeline": run.engine.pipeline_stages,
                              "world_size": self.world})

    def write_omega(self, profile: Profile) -> None:
        values = {(s.stack, s.index): s.omega for s in profile.sublayers}
        full = {}
        for name, module in self.model.named_modules():
            if isinstance(module, OmegaResidual):
                full[f"{name}.omega"] = torch.full((self.model_cfg.model_dim,), values[(module.stack, module.index)],
                                                   dtype=torch.float32)
        eng.write_params(self.engine, full)
        # Identical on every rank: gather a digest of the whole profile and compare.
        digest = torch.tensor([sum(s.omega * (i + 1) for i, s in enumerate(profile.sublayers))], dtype=torch.float64)
        if self.world > 1:
            gathered = [torch.zeros_like(digest) for _ in range(self.world)]
            torch.distributed.all_gather(gathered, digest)
            if any(not torch.equal(g, gathered[0]) for g in gathered):
                raise RuntimeError("omega differs between ranks after profiling")

    # ---- the update --------------------------------------------------------------------------------
    def _pipe_loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The pipeline's loss_fn (last stage). DeepSpeed divides the loss by the accumulation steps
        and averages over data-parallel ranks; the scale set per update undoes both and divides by
        the update's target tokens, as in the data-parallel path. Sums are kept for logging."""
        loss, nll = label_smoothed_nll(logits, target, self.run.optim.label_smoothing, self.model_cfg.pad_idx)
        loss = reliability.FAULTS.loss(loss, self.rank)
        self._pipe_sums += torch.tensor([loss.item(), nll.item(), float(target.ne(self.model_cfg.pad_idx).sum())],
                                        dtype=torch.float64)
        return loss * self._pipe_scale

    def _pipe_batches(self, batches):
        return iter([((b["src_tokens"].to(self.device), b["tgt_in_tokens"].to(self.device)), b["target"].to(self.device))
                     for b in batches])

    def train_update(self) -> dict:
        """One optimizer update: GAS micro-batches on each rank (see the module docstring)."""
        reliability.FAULTS.begin_update(self.state.update + 1)
        self._skipped_before = self.engine.skipped_steps
        mbs = [self.iterator.next_batch() for _ in range(self.gas)]
        local = torch.tensor([sum(b["ntokens"] for b in mbs), sum(b["nsentences"] for b in mbs)], dtype=torch.float64)
        # Every pipeline stage draws the same batches, so reducing over data-parallel ranks suffices.
        ntokens, nsentences = (int(v) for v in eng.all_reduce_sum(local, self.dp_group))
        if self.pipeline:
            self._pipe_scale = self.dp * self.gas / ntokens
            self._pipe_sums.zero_()
            self.engine.train_batch(data_iter=self._pipe_batches(mbs))
            sums = eng.all_reduce_sum(self._pipe_sums.clone())[:2]  # only last stages contributed
            return self._finish_update(sums, ntokens, nsentences, _float(self.engine.get_global_grad_norm()))
        sums = torch.zeros(2, dtype=torch.float64)
        eps, pad = self.run.optim.label_smoothing, self.model_cfg.pad_idx
        grad_norm = None
        for i, b in enumerate(mbs):
            logits = self.engine(b["src_tokens"].to(self.device), b["tgt_in_tokens"].to(self.device))
            loss, nll = label_smoothed_nll(logits, b["target"].to(self.device), eps, pad)
            loss = reliability.FAULTS.loss(loss, self.rank)
            self.engine.backward(loss * (self.dp / ntokens), scale_wrt_gas=False)
            if i == len(mbs) - 1 and self.zero == 0:
                grad_norm = _grad_norm(self.model)  # without ZeRO, DeepSpeed only measures it to clip
            self.engine.step()
            sums += torch.tensor([loss.item(), nll.item()], dtype=torch.float64)
        if grad_norm is None:
            grad_norm = _float(self.engine.get_global_grad_norm())
        return self._finish_update(eng.all_reduce_sum(sums), ntokens, nsentences, grad_norm)

    def _finish_update(self, sums, ntokens: int, nsentences: int, grad_norm) -> dict:
        self.state.update += 1
        self.state.epoch = self.iterator.epoch
        self.state.tokens_seen += ntokens
        self.state.sentences_seen += nsentences
        loss = float(sums[0]) / ntokens / LN2
        # DeepSpeed skipped the step (reliability.py); in fp16 a skip with a finite loss is the
        # loss scaler's overflow, which is routine and left to it.
        skipped = self.engine.skipped_steps > self._skipped_before
        nonfinite = not math.isfinite(loss) or (skipped and eng.precision(self.ds) != "fp16")
        return {"loss": loss, "nll": float(sums[1]) / ntokens / LN2, "ntokens": ntokens, "nsentences": nsentences,
                "grad_norm": grad_norm, "nonfinite": nonfinite}

    @torch.no_grad()
    def validate(self, split: str) -> dict:
        dataset = open_split(self.data_dir, split, self.manifest)
        it = self._iterator(dataset, shuffle=False)
        if self.pipeline:
            self._pipe_scale = 1.0
            self._pipe_sums.zero_()
            batches = [it.next_batch() for _ in range(it.batches_per_epoch)]
            self.engine.eval_batch(self._pipe_batches(batches), num_micro_batches=len(batches))
            sums = eng.all_reduce_sum(self._pipe_sums.clone())
            nll = float(sums[1] / sums[2] / LN2)
            return {"loss": float(sums[0] / sums[2] / LN2), "nll": nll, "ppl": 2 ** nll, "ntokens": int(sums[2])}
        sums = torch.zeros(3, dtype=torch.float64)
        self.engine.eval()
        for _ in range(it.batches_per_epoch):
            b = it.next_batch()
            logits = self.engine(b["src_tokens"].to(self.device), b["tgt_in_tokens"].to(self.device))
            loss, nll = label_smoothed_nll(logits, b["target"].to(self.device), self.run.optim.label_smoothing,
                                           self.model_cfg.pad_idx)
            sums += torch.tensor([loss.item(), nll.item(), b["ntokens"]], dtype=torch.float64)
        self.engine.train()
        eng.all_reduce_sum(sums)
        nll = float(sums[1] / sums[2] / LN2)
        return {"loss": float(sums[0] / sums[2] / LN2), "nll": nll, "ppl": 2 ** nll, "ntokens": int(sums[2])}

    def bleu(self, split: str) -> Optional[dict]:
        """Beam search on the raw source text of ``split`` with a consolidated fp32 copy of the model
        on rank 0, scored with sacreBLEU and tokenized BLEU. Collective (ZeRO-3 gathers)."""
        state = self._consolidated_state()
        if self.rank != 0:
            return None
        from admin_ds.decode import translate
        from admin_ds.evaluate import score
        from admin_ds.subword import SubwordModel

        s, t = self.manifest["src_lang"], self.manifest["tgt_lang"]
        src_path, ref_path = self.data_dir / f"{split}.{s}", self.data_dir / f"{split}.{t}"
        srcs = src_path.read_text(encoding="utf-8").splitlines()
        refs = ref_path.read_text(encoding="utf-8").splitlines()
        n = self.run.train.bleu_max_sentences
        if n:
            srcs, refs = srcs[:n], refs[:n]
        model = build_model(self.model_cfg).to(self.device)
        model.load_state_dict({k: v.float() for k, v in state.items()})
        t0 = time.perf_counter()
        hyps = translate(model, SubwordModel(self.data_dir / self.manifest["subword_model"]), srcs,
                         beam=self.run.train.bleu_beam, lenpen=self.run.train.bleu_lenpen,
                         max_tokens=self.run.data.max_tokens)
        elapsed = time.perf_counter() - t0
        if self.rank == 0:
            (self.run_dir / f"{split}.hyp.{t}").write_text("\n".join(hyps) + "\n", encoding="utf-8")
        result = score(hyps, refs, f"{s}-{t}")
        copy = score(srcs, refs, f"{s}-{t}")  # the trivial baseline: output = input
        return {"bleu": result["bleu"], "tok_bleu": result["tok_bleu"], "chrf": result["chrf"],
                "signature": result["signature"], "copy_bleu": copy["bleu"], "sentences": len(hyps),
                "decode_s": round(elapsed, 2)}

    def _consolidated_state(self) -> Optional[dict]:
        """The single-device model's state dict on rank 0 (None elsewhere). Collective."""
        if not self.pipeline:
            return eng.consolidated_state_dict(self.engine)
        from admin_ds.pipeline import model_state_from_pipeline

        local = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        mine = model_state_from_pipeline(self.model.layer_kinds, local) if self.dp_rank == 0 else {}
        parts = [None] * self.world
        torch.distributed.all_gather_object(parts, mine)
        if self.rank != 0:
            return None
        merged = {}
        for part in parts:
            merged.update(part)
        return merged

    # ---- checkpoints -------------------------------------------------------------------------------
    def client_state(self) -> dict:
        return {"admin_ds": {
            "run_config": self.run.to_dict(), "model_config": self.model_cfg.to_dict(),
            "profile": None if self.profile is None else self.profile.to_dict(),
            "train_state": vars(self.state).copy(), "data_state": self.iterator.state_dict(),
            "subword_sha256": self.manifest.get("subword_sha256"),
            "layout": self.layout(), "guard": self.guard.state_dict()}}

    def layout(self) -> dict:
        return {"world_size": self.world, "data_parallel": self.dp, "pipeline": self.run.engine.pipeline_stages,
                "zero": eng.zero_stage(self.ds), "precision": eng.precision(self.ds),
                "gradient_accumulation_steps": self.gas}

    def save(self) -> None:
        t0 = time.perf_counter()
        tag = ckpt.save(self.engine, self.ckpt_dir, self.state.update, self.client_state(), self.run.train.keep_last,
                        write_hook=reliability.FAULTS.save_hook(self.state.update))
        self.saved_update = self.state.update
        self.log.info(f"[checkpoint] saved {self.ckpt_dir / tag} in {time.perf_counter() - t0:.1f}s")

    def _plan_resume(self) -> Optional[reliability.ResumePlan]:
        """Every rank reads the newest complete checkpoint's COMPLETE marker: a different model,
        vocabulary or subword model is refused before anything is built, and a different layout
        builds the engine for DeepSpeed's universal checkpoint (reliability.py)."""
        if not self.run.train.resume:
            return None
        tag = self._newest_checkpoint()
        if tag is None:
            return None
        info = ckpt.read_info(self.ckpt_dir / tag)
        reliability.check_compatible(str(self.ckpt_dir / tag), info, self.model_cfg, self.manifest)
        plan = reliability.plan_resume(self.ckpt_dir, tag, info, self.layout())
        reliability.configure_loading(self.ds, plan)
        return plan

    def _newest_checkpoint(self) -> Optional[str]:
        """The newest complete checkpoint with intact files (rank 0 checks their digests and sets
        corrupt ones aside), the same on every rank."""
        found = {}
        if self.rank == 0:
            try:
                found["tag"] = ckpt.newest_verified(self.ckpt_dir, self.log.info)
            except OSError as e:  # every rank must learn of it, not hang
                found["error"] = f"{type(e).__name__}: {e}"
        found = eng.broadcast_object(found)
        if "error" in found:
            raise RuntimeError(f"reading the checkpoints in {self.ckpt_dir} failed on rank 0: {found['error']}")
        return found["tag"]

    def _universal(self, plan: reliability.ResumePlan) -> Path:
        """Rank 0 converts the tag once (the others wait); every rank then checks its names."""
        kinds = reliability.pipeline_layer_kinds(self.model_cfg)
        if self.pipeline and kinds != self.model.layer_kinds:
            raise RuntimeError(f"reliability.pipeline_layer_kinds {kinds} != the pipeline's {self.model.layer_kinds}")
        err = None
        if self.rank == 0:
            try:
                reliability.ensure_universal(self.ckpt_dir, plan, kinds, self.log.info)
            except Exception as e:  # every rank must learn of it, not hang
                err = f"{type(e).__name__}: {e}"
        err = eng.broadcast_object(err)
        if err:
            raise RuntimeError(f"converting {self.ckpt_dir / plan.tag} to a universal checkpoint failed on rank 0: {err}")
        udir = reliability.universal_dir(self.ckpt_dir, plan.tag)
        reliability.check_universal_names(udir, self.engine)
        return udir

    def _restore(self, tag: str, universal: Optional[Path] = None, rollback: bool = False) -> None:
        """Load ``tag`` and our state from it. A rollback keeps the data position (the guard
        continues after the divergence) and the guard's learning-rate multiplier."""
        with reliability.universal_loading(self.engine, universal is not None):
            client = ckpt.load(self.engine, self.ckpt_dir, tag, universal=universal)["admin_ds"]
        saved = ModelConfig.from_dict(client["model_config"])
        if saved != self.model_cfg:
            diff = [k for k in saved.to_dict() if saved.to_dict()[k] != self.model_cfg.to_dict()[k]]
            raise ConfigError(f"{self.ckpt_dir / tag}: the checkpoint's model differs from the run config in "
                              f"model.{', model.'.join(diff)}; use a new train.run_dir or the same model")
        if client.get("subword_sha256") != self.manifest.get("subword_sha256"):
            raise ConfigError(f"{self.ckpt_dir / tag}: trained with a different subword model than "
                              f"{self.data_dir}/{self.manifest['subword_model']}")
        self.state = TrainState(**client["train_state"])
        self.saved_update = self.state.update
        if not rollback:
            self.iterator.load_state_dict(client["data_state"])
        if client.get("profile"):
            self.profile = Profile.from_dict(client["profile"])
        if universal is not None:
            reliability.restore_buffer_omegas(self.engine, self.profile)
        self.guard.load_state_dict(client.get("guard"), rollback=rollback)
        if self.guard.state.lr_scale != 1.0:
            reliability.apply_lr_scale(self.engine, self.run.optim.lr, self.guard.state.lr_scale)

    def try_resume(self) -> bool:
        plan = self.resume_plan
        if plan is None:
            return False
        if self.rank == 0:
            removed = ckpt.remove_torn(self.ckpt_dir)
            if removed:
                self.log.info(f"[resume] removed incomplete checkpoint(s): {', '.join(sorted(removed))}")
        for note in plan.notes:
            self.log.info(f"[resume] {note}")
        self._restore(plan.tag, self._universal(plan) if plan.universal else None)
        change = f"; layout {reliability.describe(plan.saved)} -> {reliability.describe(plan.current)}" \
            if plan.saved != plan.current else ""
        self.log.info(f"[resume] from {self.ckpt_dir / plan.tag}: update {self.state.update}, "
                      f"epoch {self.state.epoch}{change}")
        return True

    def rollback(self, reason: str) -> None:
        """The divergence guard's remedy (reliability.py): the newest complete checkpoint, the
        learning rate x guard.lr_factor, the data after the divergence. Collective."""
        at = self.state.update
        tag = self._newest_checkpoint()
        scale = self.guard.begin_rollback(reason, tag)
        self.guard.state.lr_scale, self.guard.state.rollbacks = scale, self.guard.state.rollbacks + 1
        plan = reliability.plan_resume(self.ckpt_dir, tag, ckpt.read_info(self.ckpt_dir / tag), self.layout())
        self._restore(tag, self._universal(plan) if plan.universal else None, rollback=True)
        self.log.record("rollback", update=at, to_update=self.state.update, reason=reason, lr_scale=scale,
                        lr=self.engine.get_lr()[0], rollbacks=self.guard.state.rollbacks)
        self.log.info(f"[guard] {reason} at update {at}: rolled back to {self.ckpt_dir / tag}, "
                      f"learning rate x{scale:g} from here on")

    def close(self) -> None:
        """Release the engine: DeepSpeed's gradient hooks hold the optimizer, the model and, through
        the parameters, its process groups in a cycle the garbage collector cannot see; without
        ``destroy`` the groups' threads outlive the run (admin_ds/distributed.py)."""
        import gc

        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.destroy()
            # The pipeline engine's output-backward hooks keep the engine itself alive from C++ (a
            # cycle destroy() leaves in place); emptied, it holds no module, optimizer or group.
            vars(engine).clear()
        if getattr(self, "log", None) is not None:
            self.log.close()
        self.engine = self.model = None
        gc.collect()

    # ---- the run ---------------------------------------------------------------------------------
    def fit(self) -> dict:
        run = self.run
        if not self.try_resume():
            self.establish_profile()
            if self.profile is not None:
                self.log.info(omega_table(self.profile) if self.model_cfg.num_encoder_layers <= 6 else
                              "[admin] omega table written to admin_profile.json")
        if run.admin.profile_only:
            self.log.info(f"[admin] --profile-only: profile written to {self.run_dir / 'admin_profile.json'}")
            return {}
        from tqdm import tqdm

        bar = tqdm(total=run.train.max_updates, initial=self.state.update, disable=self.rank != 0,
                   desc="train", unit="upd", mininterval=2.0, file=sys.stderr, dynamic_ncols=True)
        t_start = time.perf_counter()
        window_tokens, window_t0 = 0, time.perf_counter()
        last = {}
        while self.state.update < run.train.max_updates:
            if run.train.max_epochs and self.iterator.epoch > run.train.max_epochs:
                break
            stats = self.train_update()
            window_tokens += stats["ntokens"]
            bar.update(1)
            u = self.state.update
            reason = self.guard.observe(stats)
            if stats["nonfinite"]:
                self.log.record("skip", update=u, loss=stats["loss"], skipped_nonfinite=self.guard.state.skipped_nonfinite)
                self.log.info(f"[guard] update {u}: non-finite loss or gradient, update skipped "
                              f"({self.guard.state.skipped_nonfinite} so far)")
            if reason:
                self.rollback(reason)
                bar.n = self.state.update
                bar.refresh()
                continue
            if u % run.train.log_interval == 0 or u == run.train.max_updates:
                dt = time.perf_counter() - window_t0
                fp16 = eng.precision(self.ds) == "fp16"
                last = {"update": u, "epoch": self.state.epoch, "loss": round(stats["loss"], 4),
                        "nll": round(stats["nll"], 4), "ppl": round(2 ** stats["nll"], 2),
                        "lr": self.engine.get_lr()[0], "grad_norm": stats["grad_norm"],
                        "loss_scale": self.engine.optimizer.cur_scale if fp16 else None,
                        "tokens_per_s": round(window_tokens / max(dt, 1e-9)), "tokens_per_update": stats["ntokens"],
                        "skipped_nonfinite": self.guard.state.skipped_nonfinite}
                self.log.record("train", **last)
                if self.rank == 0:
                    bar.write(" | ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                         for k, v in last.items() if v is not None))
                window_tokens, window_t0 = 0, time.perf_counter()
            if u % run.train.valid_interval_updates == 0 and u < run.train.max_updates:
                v = self.validate(run.data.valid_split)
                self.log.record("valid", update=u, **v)
                self.log.info(f"[valid] update {u}: loss {v['loss']:.3f} nll {v['nll']:.3f} ppl {v['ppl']:.2f}")
            every = run.train.bleu_interval_updates
            if every and u % every == 0 and u < run.train.max_updates:
                b = self.bleu(run.data.valid_split)
                if b is not None:
                    self.log.record("valid_bleu", update=u, **b)
                    self.log.info(f"[valid] update {u}: BLEU {b['bleu']:.2f} ({b['signature']})")
            if u % run.train.save_interval_updates == 0 and u < run.train.max_updates:
                self.save()
        bar.close()
        train_s = time.perf_counter() - t_start
        if self.saved_update != self.state.update:  # decided locally: every rank agrees without I/O
            self.save()
        summary = {"updates": self.state.update, "epoch": self.state.epoch, "tokens_seen": self.state.tokens_seen,
                   "train_s": round(train_s, 1), "last_train_loss": last.get("loss")}
        bleu = None
        if run.train.final_eval:
            v = self.validate(run.data.valid_split)
            self.log.record("valid", update=self.state.update, **v)
            summary.update(valid_loss=round(v["loss"], 4), valid_ppl=round(v["ppl"], 2))
            bleu = self.bleu(run.data.test_split)
        if bleu is not None:
            summary.update({f"test_{k}": (round(x, 2) if isinstance(x, float) else x) for k, x in bleu.items()})
            self.log.record("test", update=self.state.update, **bleu)
        self.log.record("summary", **summary)
        if self.rank == 0:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        self.log.info("[summary] " + json.dumps(summary))
        eng.barrier()
        return summary


@torch.no_grad()
def _grad_norm(model) -> float:
    grads = [p.grad.float() for p in model.parameters() if p.grad is not None]
    return _float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))


def _float(x) -> Optional[float]:
    if x is None:
        return None
    x = float(x)
    return round(x, 4) if math.isfinite(x) else x


def train(run: RunConfig, ds_config_path: str) -> dict:
    """The whole run on this rank; leaves the process group (distributed.shutdown) on every path."""
    from admin_ds import distributed

    clean, trainer = False, None
    try:
        trainer = Trainer(run, ds_config_path)
        trainer.setup()
        summary = trainer.fit()
        clean = True
        return summary
    finally:
        if trainer is not None:
            trainer.close()
        trainer = None
        distributed.shutdown(clean)
