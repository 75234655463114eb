"""The encoder-decoder as a DeepSpeed pipeline. A stage is the same ``EncoderDecoder`` holding only
its own layers (``ModelPart``), built with the whole model's per-layer seeds, so no rank builds the
whole model and a stage's weights equal the single-device model's.

DeepSpeed's ``PipelineModule`` runs a list of steps, one per entry of the forward pass, and
partitions the list over stages:

    [0]     embed         (src_ids, tgt_ids)              -> (x, src_ids, tgt_ids)
    [1..N]  encoder i     (x, src_ids, tgt_ids)           -> same
    (pre)   encoder_norm
    [..]    embed_tgt     (enc, src_ids, tgt_ids)         -> (enc, src_ids, tgt_ids, y)
    [..]    decoder j     (enc, src_ids, tgt_ids, y)      -> same; the last one -> y
    (pre)   decoder_norm  y -> y
    [last]  project       y -> logits (B, T, V)

The steps are plain callables over the stage's model, not modules, so DeepSpeed registers nothing
for them; the stage model's own modules are registered on the ``PipelineModule`` under their own
names. Parameter names are therefore the single-device model's in every layout
(``encoder_layers.17.ffn.fc1.weight``), and a checkpoint moves between layouts through DeepSpeed's
universal checkpoint with no renaming.

Why the steps look like this (docs/deepspeed.md, docs/design.md decision 2):
* Only token ids cross stages besides activations: DeepSpeed assumes every float tensor that
  arrives needs a gradient, so float masks would break the backward; masks are rebuilt from ids.
* The last decoder step returns ``y`` alone: a stage that receives the encoder output but does not
  use it (the output projection alone) fails DeepSpeed's gradient check.
* The shared embedding matrix lives on every stage that embeds or projects; its gradient is
  all-reduced between those stages (DeepSpeed's tied-weight hooks, given our groups).
* The partition balances estimated cost (FLOPs per token), not step count: a decoder layer is
  ~1.33 encoder layers and the output projection over a 32k vocabulary is several layers' worth.

Admin profiling across stages. Each stage's recorder sees only its own sub-layers; the reference
recursion's running omega must cross stage boundaries. While profiling (``PipelineStage.recorder``
set), every step passes a trailing float64 ``chain`` tensor (encoder, decoder running values)
along with its outputs; it is read into the stage's recorder on entry and written back on exit.
No backward runs while profiling, so this float tensor never needs a gradient.
"""

from __future__ import annotations

import contextlib
import glob
import os

import torch
import torch.distributed as dist
from deepspeed.pipe import PipelineModule
from deepspeed.runtime import utils as ds_utils
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

from admin_ds.errors import ConfigError
from admin_ds.model.config import ModelConfig
from admin_ds.model.transformer import EncoderDecoder, ModelPart, build_model

# ------------------------------------------------------------------------------------------------
# The layer list, its costs and the partition
# ------------------------------------------------------------------------------------------------


def layer_kinds(cfg: ModelConfig) -> list[str]:
    """The kinds of the steps of the forward pass, in order (module docstring)."""
    norm = ["norm"] if cfg.norm_order == "pre" else []
    return (["embed"] + ["encoder"] * cfg.num_encoder_layers + norm + ["embed_tgt"]
            + ["decoder"] * cfg.num_decoder_layers + norm + ["project"])


def layer_costs(cfg: ModelConfig, kinds: list[str]) -> list[float]:
    """Relative cost per token of each step, in units of one encoder layer: weight-matrix FLOPs
    (4D^2 + 2DF per encoder layer, 8D^2 + 2DF per decoder layer, DV for the output projection).
    Embedding look-ups and norms are nearly free."""
    d, f, v = cfg.model_dim, cfg.ffn_inner_dim, cfg.vocab_size
    enc = 4 * d * d + 2 * d * f
    cost = {"embed": 0.02, "embed_tgt": 0.02, "norm": 0.01, "encoder": 1.0,
            "decoder": (8 * d * d + 2 * d * f) / enc, "project": d * v / enc}
    return [cost[k] for k in kinds]


def partition(costs: list[float], num_stages: int) -> list[int]:
    """Stage boundaries (len num_stages + 1) minimising the most expensive stage (DeepSpeed's own
    balanced partitioner over our costs)."""
    if num_stages > len(costs):
        raise ConfigError(f"engine.pipeline_stages={num_stages} exceeds the {len(costs)} steps of the "
                          "forward pass; use fewer stages")
    parts = [int(p) for p in ds_utils.partition_balanced(weights=costs, num_parts=num_stages)]
    if any(b <= a for a, b in zip(parts, parts[1:])):
        raise ConfigError(f"engine.pipeline_stages={num_stages}: some stage would hold no layer")
    return parts


def stage_part(kinds: list[str], start: int, stop: int) -> ModelPart:
    """The ``ModelPart`` holding steps ``start..stop-1`` of the forward pass."""
    enc = [i for i, k in enumerate(kinds) if k == "encoder"]
    dec = [i for i, k in enumerate(kinds) if k == "decoder"]
    norms = [i for i, k in enumerate(kinds) if k == "norm"]  # Pre-LN: the encoder's, then the decoder's
    mine = range(start, stop)
    own = [j for j, i in enumerate(enc) if i in mine]
    own_dec = [j for j, i in enumerate(dec) if i in mine]
    return ModelPart(
        source_embedding=kinds.index("embed") in mine,
        encoder_layers=range(own[0], own[-1] + 1) if own else range(0),
        encoder_norm=bool(norms) and norms[0] in mine,
        target_embedding=kinds.index("embed_tgt") in mine,
        decoder_layers=range(own_dec[0], own_dec[-1] + 1) if own_dec else range(0),
        decoder_norm=bool(norms) and norms[1] in mine,
        output=kinds.index("project") in mine)


# ------------------------------------------------------------------------------------------------
# The steps
# ------------------------------------------------------------------------------------------------


class PipelineStage:
    """One stage: its model part, its steps, and (while profiling) the recorder its residuals
    report to."""

    def __init__(self, cfg: ModelConfig, seed: int, num_stages: int, stage_id: int) -> None:
        if not cfg.share_all_embeddings:
            raise ConfigError("model.share_all_embeddings=false: the pipeline layout ties source, target and "
                              "output embeddings; train separate embeddings data-parallel")
        if cfg.embedding_output_scale:
            raise ConfigError("model.embedding_output_scale: folded models are for inference, not training")
        self.cfg, self.stage_id, self.num_stages = cfg, stage_id, num_stages
        self.kinds = layer_kinds(cfg)
        self.costs = layer_costs(cfg, self.kinds)
        self.parts = partition(self.costs, num_stages)
        self.model: EncoderDecoder = build_model(cfg, seed=seed, part=self.part_of(stage_id))
        self.recorder = None  # an OmegaRecorder while profiling
        self.mask_padding = False
        self.steps = self._steps()

    def part_of(self, stage: int) -> ModelPart:
        return stage_part(self.kinds, self.parts[stage], self.parts[stage + 1])

    def _steps(self) -> list:
        steps, enc, dec = [], 0, 0
        norm_seen = 0
        last_dec = self.kinds.count("decoder") - 1
        for kind in self.kinds:
            if kind == "encoder":
                steps.append(EncoderLayerStep(self, enc))
                enc += 1
            elif kind == "decoder":
                steps.append(DecoderLayerStep(self, dec, last=dec == last_dec))
                dec += 1
            elif kind == "norm":
                steps.append(EncoderNormStep(self) if norm_seen == 0 else DecoderNormStep(self))
                norm_seen += 1
            else:
                other = {"embed": EmbedSourceStep, "embed_tgt": EmbedTargetStep, "project": ProjectStep}
                steps.append(other[kind](self))
        return steps

    def describe(self) -> str:
        lines = []
        for stage, (a, b) in enumerate(zip(self.parts, self.parts[1:])):
            kinds = self.kinds[a:b]
            enc, dec = kinds.count("encoder"), kinds.count("decoder")
            extra = [k for k in kinds if k not in ("encoder", "decoder")]
            lines.append(f"  stage {stage}: steps {a}..{b - 1} ({enc} encoder, {dec} decoder"
                         f"{', ' + ', '.join(extra) if extra else ''}), cost {sum(self.costs[a:b]):.2f}")
        return "\n".join(lines)

    def embedding_stages(self) -> list[int]:
        """The stages whose part holds the shared embedding matrix."""
        return [s for s in range(self.num_stages)
                if (p := self.part_of(s)).source_embedding or p.target_embedding or p.output]

    # ---- profiling: the running omega crosses stage boundaries ------------------------------
    def enter(self, inputs: tuple) -> tuple:
        """Strip and load the chain tensor while profiling."""
        if self.recorder is None:
            return inputs
        *inputs, chain = inputs
        self.recorder.chain = {"encoder": float(chain[0]), "decoder": float(chain[1])}
        return tuple(inputs)

    def leave(self, outputs):
        if self.recorder is None:
            return outputs
        ref = outputs[0] if isinstance(outputs, tuple) else outputs
        chain = torch.tensor([self.recorder.chain["encoder"], self.recorder.chain["decoder"]],
                             dtype=torch.float64, device=ref.device)
        return (*outputs, chain) if isinstance(outputs, tuple) else (outputs, chain)

    def mask(self, stack: str, ids: torch.Tensor) -> None:
        """While profiling with padding masked, the recorder needs this stack's real-token mask."""
        if self.recorder is not None and self.mask_padding:
            self.recorder.masks[stack] = ids.ne(self.cfg.pad_idx)


class _Step:
    """One step of the forward pass over the stage's model. Not an ``nn.Module``: DeepSpeed
    registers nothing for it (the module docstring)."""

    def __init__(self, stage: PipelineStage, index: int = 0) -> None:
        self.stage, self.index = stage, index

    @property
    def model(self) -> EncoderDecoder:
        return self.stage.model


class EmbedSourceStep(_Step):
    def __call__(self, inputs):
        src_ids, tgt_ids = inputs
        return self.stage.leave((self.model.embed_source(src_ids), src_ids, tgt_ids))


class EncoderLayerStep(_Step):
    def __call__(self, inputs):
        x, src_ids, tgt_ids = self.stage.enter(inputs)
        self.stage.mask("encoder", src_ids)
        x = self.model.encoder_layers[self.index](x, src_ids.eq(self.model.pad_idx))
        return self.stage.leave((x, src_ids, tgt_ids))


class EncoderNormStep(_Step):
    def __call__(self, inputs):
        x, src_ids, tgt_ids = self.stage.enter(inputs)
        return self.stage.leave((self.model.encoder_layer_norm(x), src_ids, tgt_ids))


class EmbedTargetStep(_Step):
    def __call__(self, inputs):
        enc, src_ids, tgt_ids = self.stage.enter(inputs)
        return self.stage.leave((enc, src_ids, tgt_ids, self.model.embed_target(tgt_ids)))


class DecoderLayerStep(_Step):
    def __init__(self, stage: PipelineStage, index: int, last: bool) -> None:
        super().__init__(stage, index)
        self.last = last

    def __call__(self, inputs):
        enc, src_ids, tgt_ids, y = self.stage.enter(inputs)
        self.stage.mask("decoder", tgt_ids)
        pad = self.model.pad_idx
        y = self.model.decoder_layers[self.index](y, enc, src_ids.eq(pad), None, tgt_ids.eq(pad))
        return self.stage.leave(y if self.last else (enc, src_ids, tgt_ids, y))


class DecoderNormStep(_Step):
    def __call__(self, inputs):
        y = self.stage.enter(inputs)[0] if self.stage.recorder is not None else inputs
        return self.stage.leave(self.model.decoder_layer_norm(y))


class ProjectStep(_Step):
    def __call__(self, inputs):
        y = self.stage.enter(inputs)[0] if self.stage.recorder is not None else inputs
        return self.model.project(y)


# ------------------------------------------------------------------------------------------------
# The PipelineModule around a stage
# ------------------------------------------------------------------------------------------------


def stage_of_rank(rank: int, world: int, num_stages: int) -> int:
    """This rank's stage in DeepSpeed's pipe x data topology (before any module is built)."""
    return PipeDataParallelTopology(num_pp=num_stages, num_dp=world // num_stages).get_coord(rank).pipe


class StagePipelineModule(PipelineModule):
    """DeepSpeed's pipeline module around one stage of our model (module docstring). Needs
    torch.distributed initialised."""

    def __init__(self, stage: PipelineStage, loss_fn, activation_checkpointing: bool = False) -> None:
        # Set before nn.Module's __init__ (it does not clear __dict__): _build needs them.
        object.__setattr__(self, "_stage", stage)
        object.__setattr__(self, "cfg", stage.cfg)  # the whole model's config, as on EncoderDecoder
        object.__setattr__(self, "_keep_training", False)
        kwargs = {}
        if activation_checkpointing:  # DeepSpeed matches the steps by class name
            kwargs = dict(activation_checkpoint_interval=1,
                          checkpointable_layers=[EncoderLayerStep.__name__, DecoderLayerStep.__name__])
        world = dist.get_world_size()
        super().__init__(layers=stage.steps, loss_fn=loss_fn, dynamic_shape=True,
                         topology=PipeDataParallelTopology(num_pp=stage.num_stages,
                                                           num_dp=world // stage.num_stages), **kwargs)

    def _partition_layers(self, method="uniform"):
        self.parts = list(self._stage.parts)
        self._set_bounds(start=self.parts[self._stage.stage_id], stop=self.parts[self._stage.stage_id + 1])

    def _build(self):
        super()._build()  # the steps are plain callables: nothing is registered
        for name, child in self._stage.model.named_children():
            self.add_module(name, child)
        for p in self.parameters():
            p.ds_pipe_replicated = False

    def train(self, mode: bool = True):
        mode = mode or self._keep_training
        super().train(mode)
        self._stage.model.training = mode  # the steps read the stage model's flag (dropout)
        return self

    # ---- the shared embedding ------------------------------------------------------------------
    def _index_tied_modules(self):
        owners = self._stage.embedding_stages()
        comms = {}
        if len(owners) < 2:
            return comms
        for dp in range(self._grid.data_parallel_size):  # every rank creates every group
            ranks = [self._grid.stage_to_global(stage_id=s, data=dp) for s in owners]
            group = dist.new_group(ranks=ranks)
            if self.global_rank in ranks:
                emb = self._stage.model.src_embed
                comms["embed"] = {"ranks": ranks, "group": group, "weight_attr": ["weight"], "module": emb}
                if self.global_rank != ranks[0]:  # counted once by the fp16 optimizer
                    for p in emb.parameters():
                        p.ds_pipe_replicated = True
        return comms

    def allreduce_tied_weight_gradients(self):
        for comm in self.tied_comms.values():
            dist.all_reduce(comm["module"].weight.grad, group=comm["group"])

    def get_tied_weights_and_groups(self):
        return [(comm["module"].weight, comm["group"]) for comm in self.tied_comms.values()]

    # ---- checkpoints: one file per stage, the model's own names --------------------------------
    def save_state_dict(self, save_dir, checkpoint_engine, exclude_frozen_params=False):
        if self._grid.data_parallel_id != 0:
            return  # the data-parallel replicas of a stage hold the same weights
        checkpoint_engine.makedirs(save_dir, exist_ok=True)
        state = {k: v.detach().clone() for k, v in self.state_dict().items()}
        path = os.path.join(save_dir, f"stage_{self._stage.stage_id:02d}-model_states.pt")
        checkpoint_engine.save(state_dict=state, path=path)

    def load_state_dir(self, load_dir, checkpoint_engine, strict=True):
        paths = sorted(glob.glob(os.path.join(load_dir, "stage_*-model_states.pt")))
        if not paths:
            return  # a universal checkpoint: the weights come from its fp32 masters
        merged = {}
        for path in paths:
            merged.update(checkpoint_engine.load(path, map_location="cpu"))
        self.load_state_dict(merged, strict=strict)
        self._synchronize_tied_weights()

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """From the whole model's state dict (any layout's): this stage's names only."""
        own = set(super().state_dict())
        missing = sorted(own - set(state_dict))
        if strict and missing:
            raise KeyError(f"pipeline stage {self._stage.stage_id}: the checkpoint lacks {missing[:3]}")
        return super().load_state_dict({k: v for k, v in state_dict.items() if k in own}, strict=strict,
                                       assign=assign)


@contextlib.contextmanager
def profiling(module, recorder, mask_padding: bool = False):
    """Route the stage's residuals through ``recorder`` and keep dropout on although
    ``eval_batch`` switches the module to eval mode (the reference profiles in train mode)."""
    from admin_ds.model.layers import padded_target_keys_masked
    from admin_ds.model.residual import attach_recorder

    stage: PipelineStage = module._stage
    was_training = module.training
    object.__setattr__(module, "_keep_training", True)
    module.train()
    stage.recorder, stage.mask_padding = recorder, mask_padding
    try:
        with attach_recorder(stage.model, recorder), padded_target_keys_masked(stage.model):
            yield
    finally:
        stage.recorder, stage.mask_padding = None, False
        object.__setattr__(module, "_keep_training", False)
        module.train(was_training)

