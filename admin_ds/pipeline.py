"""The encoder-decoder as a DeepSpeed pipeline: the same layer classes, arranged as a layer list.

    [0]     embed (tied, no forward_fn)   (src_ids, tgt_ids)                -> (x, src_ids, tgt_ids)
    [1..N]  EncoderLayerPipe              (x, src_ids, tgt_ids)             -> same
    (pre)   EncoderNormPipe
    [..]    embed.embed_tgt  (forward_fn) (enc, src_ids, tgt_ids)           -> (enc, src_ids, tgt_ids, y)
    [..]    DecoderLayerPipe              (enc, src_ids, tgt_ids, y)        -> same; the last -> y
    (pre)   DecoderNormPipe               y -> y
    [last]  embed.project    (forward_fn) y -> logits (B, T, V)

Why this shape (DEEPSPEED_NOTES.md sections 1-2, DESIGN.md decision 2):
* Only token ids cross stages besides activations: a float tensor that arrives is assumed to need
  a gradient, so float masks would break the backward; masks are rebuilt from ids on each stage.
* The first occurrence of the tied embedding has no forward_fn: an occurrence with one is never
  saved in checkpoints, and a resume would then silently use a random embedding.
* The last decoder layer returns ``y`` alone: a stage that receives the encoder output but does not
  use it (the output projection alone) fails DeepSpeed's gradient check.
* The partition balances estimated cost (FLOPs per token), not layer count: a decoder layer is
  ~1.33 encoder layers and the output projection over a 32k vocabulary is several layers' worth.
* Every layer is copied from a full single-device model built with the same seed, so the pipeline
  starts from exactly the weights of the data-parallel path (and a test can compare the two).

Admin profiling across stages. Each stage's recorder sees only its own sub-layers; the reference
recursion's running omega must cross stage boundaries. While profiling, every layer passes a
trailing float64 ``chain`` tensor (encoder, decoder running values) along with its outputs; it is
read into the stage's recorder on entry and written back on exit. No backward runs while
profiling, so this float tensor never needs a gradient.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from admin_ds.config import ConfigError, ModelConfig
from admin_ds.model import DecoderLayer, EncoderDecoder, EncoderLayer, TokenEmbedding

# The recorder of the profiling pass on this rank, or None (set by pipeline_profiling()).
_PROFILING: dict = {"recorder": None, "mask_padding": False}


def _mask(stack: str, ids: torch.Tensor, pad_idx: int) -> None:
    """While profiling with padding masked, the recorder needs this stack's real-token mask."""
    rec = _PROFILING["recorder"]
    if rec is not None and _PROFILING["mask_padding"]:
        rec.masks[stack] = ids.ne(pad_idx)


def _enter(inputs: tuple) -> tuple:
    """Strip and load the chain tensor while profiling."""
    rec = _PROFILING["recorder"]
    if rec is None:
        return inputs
    *inputs, chain = inputs
    rec.chain = {"encoder": float(chain[0]), "decoder": float(chain[1])}
    return tuple(inputs)


def _leave(outputs):
    rec = _PROFILING["recorder"]
    if rec is None:
        return outputs
    chain = torch.tensor([rec.chain["encoder"], rec.chain["decoder"]], dtype=torch.float64,
                         device=(outputs[0] if isinstance(outputs, tuple) else outputs).device)
    return (*outputs, chain) if isinstance(outputs, tuple) else (outputs, chain)


class EmbeddingPipe(TokenEmbedding):
    """The shared embedding: source embedding as its forward, target embedding and output
    projection as forward_fns of the tied spec."""

    def __init__(self, cfg: ModelConfig, init_weight: torch.Tensor) -> None:
        super().__init__(cfg)
        self.dropout_p = cfg.dropout_p
        with torch.no_grad():
            self.weight.copy_(init_weight)

    def forward(self, inputs):
        src_ids, tgt_ids = inputs
        x = F.dropout(super().forward(src_ids), self.dropout_p, self.training)
        return _leave((x, src_ids, tgt_ids)) if _PROFILING["recorder"] is not None else (x, src_ids, tgt_ids)


def embed_tgt(module: EmbeddingPipe, inputs):
    enc, src_ids, tgt_ids = _enter(inputs)
    y = F.dropout(TokenEmbedding.forward(module, tgt_ids), module.dropout_p, module.training)
    return _leave((enc, src_ids, tgt_ids, y))


def project(module: EmbeddingPipe, inputs):
    if _PROFILING["recorder"] is not None:
        inputs = _enter(inputs)[0]
    return module.project(inputs)


class EncoderLayerPipe(EncoderLayer):
    def __init__(self, cfg: ModelConfig, layer_idx: int, source: EncoderLayer, scheme) -> None:
        super().__init__(cfg, layer_idx, scheme)
        self.pad_idx = cfg.pad_idx
        self.load_state_dict(source.state_dict())

    def forward(self, inputs):
        x, src_ids, tgt_ids = _enter(inputs)
        _mask("encoder", src_ids, self.pad_idx)
        return _leave((super().forward(x, src_ids.eq(self.pad_idx)), src_ids, tgt_ids))


class EncoderNormPipe(nn.LayerNorm):
    def __init__(self, source: nn.LayerNorm) -> None:
        super().__init__(source.normalized_shape)
        self.load_state_dict(source.state_dict())

    def forward(self, inputs):
        x, src_ids, tgt_ids = _enter(inputs)
        return _leave((super().forward(x), src_ids, tgt_ids))


class DecoderLayerPipe(DecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_idx: int, source: DecoderLayer, scheme, last: bool) -> None:
        super().__init__(cfg, layer_idx, scheme)
        self.pad_idx = cfg.pad_idx
        self.last = last
        self.load_state_dict(source.state_dict())

    def forward(self, inputs):
        enc, src_ids, tgt_ids, y = _enter(inputs)
        _mask("decoder", tgt_ids, self.pad_idx)
        y = super().forward(y, enc, src_ids.eq(self.pad_idx))
        return _leave(y if self.last else (enc, src_ids, tgt_ids, y))


class DecoderNormPipe(nn.LayerNorm):
    def __init__(self, source: nn.LayerNorm) -> None:
        super().__init__(source.normalized_shape)
        self.load_state_dict(source.state_dict())

    def forward(self, inputs):
        return _leave(super().forward(_enter(inputs)[0] if _PROFILING["recorder"] is not None else inputs))


# ------------------------------------------------------------------------------------------------
# Costs and the partition
# ------------------------------------------------------------------------------------------------


def layer_costs(cfg: ModelConfig, kinds: list[str]) -> list[float]:
    """Relative cost per token of each entry of the layer list, in units of one encoder layer:
    weight-matrix FLOPs (4D^2 + 2DF per encoder layer, 8D^2 + 2DF per decoder layer, DV for the
    output projection). Embedding look-ups and norms are nearly free."""
    d, f, v = cfg.model_dim, cfg.ffn_inner_dim, cfg.vocab_size
    enc = 4 * d * d + 2 * d * f
    cost = {"embed": 0.02, "embed_tgt": 0.02, "norm": 0.01, "encoder": 1.0,
            "decoder": (8 * d * d + 2 * d * f) / enc, "project": d * v / enc}
    return [cost[k] for k in kinds]


def partition(costs: list[float], num_stages: int) -> list[int]:
    """Stage boundaries (len num_stages + 1) minimising the most expensive stage (DeepSpeed's own
    balanced partitioner over our costs)."""
    from deepspeed.runtime import utils as ds_utils

    if num_stages > len(costs):
        raise ConfigError(f"engine.pipeline_stages={num_stages} exceeds the {len(costs)} entries of the "
                          "layer list; use fewer stages")
    parts = [int(p) for p in ds_utils.partition_balanced(weights=costs, num_parts=num_stages)]
    if any(b <= a for a, b in zip(parts, parts[1:])):
        raise ConfigError(f"engine.pipeline_stages={num_stages}: some stage would hold no layer")
    return parts


def build_pipeline(cfg: ModelConfig, full: EncoderDecoder, num_stages: int, loss_fn,
                   activation_checkpointing: bool = False):
    """The PipelineModule for ``cfg``, with weights copied from ``full`` (built on every rank with
    the same seed). Needs torch.distributed initialised (DeepSpeed builds its topology)."""
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    if not cfg.share_all_embeddings:
        raise ConfigError("model.share_all_embeddings=false: the pipeline layout ties source, target and "
                          "output embeddings; train separate embeddings data-parallel")
    if cfg.embedding_output_scale:
        raise ConfigError("model.embedding_output_scale: folded models are for inference, not training")
    scheme = full.scheme
    specs, kinds = [], []

    def add(spec, kind):
        specs.append(spec)
        kinds.append(kind)

    add(TiedLayerSpec("embed", EmbeddingPipe, cfg, full.src_embed.weight.detach()), "embed")
    for i, layer in enumerate(full.encoder_layers):
        add(LayerSpec(EncoderLayerPipe, cfg, i, layer, scheme), "encoder")
    if full.encoder_layer_norm is not None:
        add(LayerSpec(EncoderNormPipe, full.encoder_layer_norm), "norm")
    add(TiedLayerSpec("embed", EmbeddingPipe, cfg, full.src_embed.weight.detach(), forward_fn=embed_tgt), "embed_tgt")
    n_dec = len(full.decoder_layers)
    for i, layer in enumerate(full.decoder_layers):
        add(LayerSpec(DecoderLayerPipe, cfg, i, layer, scheme, i == n_dec - 1), "decoder")
    if full.decoder_layer_norm is not None:
        add(LayerSpec(DecoderNormPipe, full.decoder_layer_norm), "norm")
    add(TiedLayerSpec("embed", EmbeddingPipe, cfg, full.src_embed.weight.detach(), forward_fn=project), "project")

    parts = partition(layer_costs(cfg, kinds), num_stages)

    class EncDecPipelineModule(PipelineModule):
        """PipelineModule with the cost-balanced partition (DeepSpeed offers parameter counts, which
        count a tied embedding at each of its three uses, or layer types, which ignore cost)."""

        def _partition_layers(self, method="uniform"):
            self.parts = list(parts)
            stage_id = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])

    kwargs = {}
    if activation_checkpointing:
        kwargs = dict(activation_checkpoint_interval=1,
                      checkpointable_layers=["EncoderLayerPipe", "DecoderLayerPipe"])
    module = EncDecPipelineModule(layers=specs, num_stages=num_stages, loss_fn=loss_fn, partition_method="cost",
                                  dynamic_shape=True, **kwargs)
    module.layer_kinds = kinds
    module.stage_costs = [sum(layer_costs(cfg, kinds)[a:b]) for a, b in zip(parts, parts[1:])]
    return module


def describe_partition(module) -> str:
    lines = []
    for stage, (a, b) in enumerate(zip(module.parts, module.parts[1:])):
        kinds = module.layer_kinds[a:b]
        enc, dec = kinds.count("encoder"), kinds.count("decoder")
        extra = [k for k in kinds if k not in ("encoder", "decoder")]
        lines.append(f"  stage {stage}: layers {a}..{b - 1} ({enc} encoder, {dec} decoder"
                     f"{', ' + ', '.join(extra) if extra else ''}), cost {module.stage_costs[stage]:.2f}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Names: pipeline parameters <-> the single-device model's state dict
# ------------------------------------------------------------------------------------------------


def model_state_from_pipeline(kinds: list[str], named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map pipeline names (``"<layer idx>.<sub>"`` and ``tied_modules.embed.weight``) to the
    ``EncoderDecoder`` state dict names."""
    enc_idx = [i for i, k in enumerate(kinds) if k == "encoder"]
    dec_idx = [i for i, k in enumerate(kinds) if k == "decoder"]
    norms = [i for i, k in enumerate(kinds) if k == "norm"]
    rename = {}
    for j, i in enumerate(enc_idx):
        rename[str(i)] = f"encoder_layers.{j}"
    for j, i in enumerate(dec_idx):
        rename[str(i)] = f"decoder_layers.{j}"
    if norms:  # Pre-LN: the first norm closes the encoder, the second the decoder
        rename[str(norms[0])] = "encoder_layer_norm"
        rename[str(norms[1])] = "decoder_layer_norm"
    out = {}
    for name, value in named.items():
        if name.startswith("tied_modules.embed.") or name.startswith("0."):
            if name.endswith("weight"):
                out["src_embed.weight"] = value
            continue
        head, rest = name.split(".", 1)
        if head in rename:
            out[f"{rename[head]}.{rest}"] = value
    return out


class pipeline_profiling:
    """Context: route this stage's residuals through ``recorder`` and keep dropout on even though
    ``eval_batch`` switches the module to eval mode (the reference profiles in train mode)."""

    def __init__(self, engine, recorder, mask_padding: bool = False) -> None:
        self.engine, self.recorder, self.mask_padding = engine, recorder, mask_padding
        from admin_ds.residual import attach_recorder

        self.attached = attach_recorder(engine.module, recorder)

    def __enter__(self):
        module = self.engine.module
        self._was_training = module.training
        module.eval = lambda: module  # eval_batch calls module.eval(); keep train mode (dropout on)
        module.train()
        self.attached.__enter__()
        _PROFILING.update(recorder=self.recorder, mask_padding=self.mask_padding)
        return self

    def __exit__(self, *exc) -> Optional[bool]:
        _PROFILING.update(recorder=None, mask_padding=False)
        self.attached.__exit__(*exc)
        module = self.engine.module
        del module.eval
        module.train(self._was_training)
        return None
