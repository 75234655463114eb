"""The encoder-decoder, whole or in part.

    model = build_model(cfg, seed=1)                      # the whole model, on one device
    logits = model(src_tokens, tgt_in_tokens)             # (B, S), (B, T) -> (B, T, V)
    stage = build_model(cfg, seed=1, part=ModelPart(...)) # the layers of one pipeline stage

One class for every layout. A pipeline stage is an ``EncoderDecoder`` that holds only its own
layers (``ModelPart``), and its parameters have the whole model's names
(``encoder_layers.17.self_attn.q_proj.weight``): layers live in a ``LayerStack`` keyed by their
global index, so a checkpoint moves between layouts (DeepSpeed's universal checkpoint) with no
renaming. Each layer draws its initial weights from its own generator, seeded by the run seed and
the layer's key (init.py), so a stage's weights equal the whole model's without ever building it;
and construction happens on the meta device, so a stage allocates nothing but its own layers.

fairseq conventions: shared source, target and output embeddings over a joint vocabulary (the
papers' setting), decoder input starting with EOS, right padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from admin_ds.model.config import ModelConfig
from admin_ds.model.dropout import DROPOUT_IMPLS, dropout
from admin_ds.model.init import get_init_scheme
from admin_ds.model.layers import DecoderLayer, EncoderLayer, IncrementalState, TokenEmbedding, Unpadded


class LayerStack(nn.ModuleDict):
    """Layers keyed by their global index, read like a list: ``stack[3]``, ``for layer in stack``.
    A pipeline stage holds a slice and keeps the global keys; state-dict names are those of an
    ``nn.ModuleList`` over the whole stack (``encoder_layers.3.ffn.fc1.weight``)."""

    def __init__(self, layers: dict[int, nn.Module]) -> None:
        super().__init__({str(i): layer for i, layer in layers.items()})

    def __getitem__(self, idx: int | str) -> nn.Module:
        if isinstance(idx, int) and idx < 0:  # from the end, as in a list
            idx = self.indices()[idx]
        return super().__getitem__(str(idx))

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self.values())

    def indices(self) -> list[int]:
        return [int(k) for k in self.keys()]


@dataclass(frozen=True)
class ModelPart:
    """Which pieces of the model a process holds, in forward order. The whole model on one
    device; a contiguous slice on a pipeline stage (admin_ds/train/pipeline.py)."""

    source_embedding: bool
    encoder_layers: range
    encoder_norm: bool  # Pre-LN's final encoder LayerNorm
    target_embedding: bool
    decoder_layers: range
    decoder_norm: bool  # Pre-LN's final decoder LayerNorm
    output: bool  # the output projection (the tied embedding matrix, unless untied)

    @classmethod
    def whole(cls, cfg: ModelConfig) -> "ModelPart":
        return cls(True, range(cfg.num_encoder_layers), True, True, range(cfg.num_decoder_layers), True, True)

    def is_whole(self, cfg: ModelConfig) -> bool:
        return self == ModelPart.whole(cfg)


class EncoderDecoder(nn.Module):
    """``model(src_tokens (B,S), tgt_in_tokens (B,T)) -> logits (B,T,V)``.

    For decoding: ``enc, src_pad = model.encode(src)``, then repeatedly
    ``model.decode(tokens (B,1), enc, src_pad, state)`` with one ``IncrementalState``.
    A part (a pipeline stage) offers the pieces instead: ``embed_source``, the layers,
    ``embed_target``, ``project``.
    """

    def __init__(self, cfg: ModelConfig, scheme, part: Optional[ModelPart] = None) -> None:
        super().__init__()
        part = part or ModelPart.whole(cfg)
        self.cfg, self.part, self.scheme = cfg, part, scheme
        self.pad_idx = cfg.pad_idx
        shared = cfg.share_all_embeddings
        untied_output = not shared and not cfg.share_decoder_input_output_embed
        # A shared matrix is registered once (src_embed), so every engine sees one parameter; the
        # same module embeds source and target tokens and projects to the vocabulary.
        needs_src = part.source_embedding or (shared and (part.target_embedding or part.output))
        needs_tgt = not shared and (part.target_embedding or (part.output and not untied_output))
        self.src_embed = TokenEmbedding(cfg) if needs_src else None
        self.tgt_embed = TokenEmbedding(cfg) if needs_tgt else None
        self.output_proj = nn.Linear(cfg.model_dim, cfg.vocab_size, bias=False) \
            if untied_output and part.output else None
        if cfg.embedding_output_scale:  # set by fold_omega (fold.py)
            if part.source_embedding:
                self.src_embed_scale = nn.Parameter(torch.ones(cfg.model_dim))
            if part.target_embedding:
                self.tgt_embed_scale = nn.Parameter(torch.ones(cfg.model_dim))
        self.encoder_layers = LayerStack({i: EncoderLayer(cfg, i, scheme) for i in part.encoder_layers})
        self.decoder_layers = LayerStack({i: DecoderLayer(cfg, i, scheme) for i in part.decoder_layers})
        # Pre-LN needs a final LayerNorm per stack; Post-LN already ends in one.
        pre = cfg.norm_order == "pre"
        self.encoder_layer_norm = nn.LayerNorm(cfg.model_dim) if pre and part.encoder_norm else None
        self.decoder_layer_norm = nn.LayerNorm(cfg.model_dim) if pre and part.decoder_norm else None
        # Per-layer activation checkpointing while training: each layer keeps only its input, and
        # the backward recomputes the rest (same dropout masks: the RNG state is replayed), so a
        # 60L-100L model trains in the memory of a few layers' activations for ~1/3 more compute.
        self.activation_checkpointing = False

    dropout_impl: str = "torch"  # where dropout masks come from (dropout.py); ``set_dropout_impl``

    def _run(self, layer: nn.Module, *args) -> torch.Tensor:
        if self.activation_checkpointing and self.training and torch.is_grad_enabled():
            return checkpoint(layer, *args, use_reentrant=False)
        return layer(*args)

    @property
    def target_embedding(self) -> TokenEmbedding:
        return self.src_embed if self.tgt_embed is None else self.tgt_embed

    def init_units(self) -> Iterator[tuple[str, nn.Module]]:
        """The model's pieces with the keys their initial weights are seeded by (init.py). A key
        names the same piece in every layout, so a stage draws what the whole model draws."""
        for key in ("src_embed", "tgt_embed"):
            if getattr(self, key) is not None:
                yield key, getattr(self, key)
        for i, layer in zip(self.encoder_layers.indices(), self.encoder_layers):
            yield f"encoder.{i}", layer
        if self.encoder_layer_norm is not None:
            yield "encoder_norm", self.encoder_layer_norm
        for i, layer in zip(self.decoder_layers.indices(), self.decoder_layers):
            yield f"decoder.{i}", layer
        if self.decoder_layer_norm is not None:
            yield "decoder_norm", self.decoder_layer_norm
        if self.output_proj is not None:
            yield "output_proj", self.output_proj

    # ---- the pieces -------------------------------------------------------------------------
    def embed_source(self, src_tokens: torch.Tensor) -> torch.Tensor:
        """(B, S) -> (B, S, D): scaled token embedding + positions, dropout."""
        x = self.src_embed(src_tokens)
        if self.cfg.embedding_output_scale:
            x = x * self.src_embed_scale
        return dropout(x, self.cfg.dropout_p, self.training, self.dropout_impl)

    def embed_target(self, tgt_in_tokens: torch.Tensor, position_offset: int = 0) -> torch.Tensor:
        """(B, T) -> (B, T, D); positions continue from ``position_offset`` while decoding."""
        y = self.target_embedding(tgt_in_tokens, position_offset=position_offset)
        if self.cfg.embedding_output_scale:
            y = y * self.tgt_embed_scale
        return dropout(y, self.cfg.dropout_p, self.training, self.dropout_impl)

    def project(self, y: torch.Tensor) -> torch.Tensor:
        """(B, T, D) -> (B, T, V)."""
        if self.output_proj is not None:
            return self.output_proj(y)
        return self.target_embedding.project(y)

    # ---- the whole model --------------------------------------------------------------------
    def encode(self, src_tokens: torch.Tensor, skip_padding: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, S) -> encoder output (B, S, D) and the padding mask (B, S), True at padding.

        ``skip_padding`` (decoding): position-wise layers run on the real tokens only, and the
        output is zero at padding (which attention never reads) instead of the values the padded
        computation leaves there. Real positions are the same either way."""
        x, src_pad, unpadded = self._encoder_stack(src_tokens, skip_padding)
        return (x if unpadded is None else unpadded.pad(x)), src_pad

    def decode(self, tgt_in_tokens: torch.Tensor, enc: torch.Tensor, src_pad: torch.Tensor,
               state: Optional[IncrementalState] = None) -> torch.Tensor:
        """(B, T) target-side input -> logits (B, T, V). With ``state``, tgt_in_tokens holds only
        the new position(s); their positions continue from ``state.length``."""
        y = self.embed_target(tgt_in_tokens, 0 if state is None else state.length)
        tgt_pad = None if state is not None else tgt_in_tokens.eq(self.pad_idx)
        y = self._decoder_stack(y, enc, src_pad, state, tgt_pad)
        if state is not None:
            state.length += tgt_in_tokens.size(1)
        return self.project(y)

    def forward(self, src_tokens: torch.Tensor, tgt_in_tokens: torch.Tensor, skip_padding: bool = False) -> torch.Tensor:
        """Logits (B, T, V); with ``skip_padding`` (training), (N_T, V) for the real target positions
        only, in the row-major order of ``tgt_in_tokens != pad``.

        Skipping padding: every position-wise product (projections, FFN, output layer) and norm
        runs on the real tokens; attention alone scatters them into the padded layout. Padded
        positions cost nothing and count for nothing (the loss ignores them, and real positions
        never see them), so the loss and gradients are those of the padded computation
        (tests/test_fast_paths.py), and a batch with 10-20% padding saves up to that share of the
        products (attention still runs padded; MFU counts real tokens only).
        Admin profiling counts padded positions (the reference does) and runs the padded path."""
        if not skip_padding:
            enc, src_pad = self.encode(src_tokens)
            return self.decode(tgt_in_tokens, enc, src_pad)
        enc, src_pad, enc_unpadded = self._encoder_stack(src_tokens, skip_padding=True)
        tgt_pad = tgt_in_tokens.eq(self.pad_idx)
        unpadded = Unpadded(tgt_pad) if bool(tgt_pad.any()) else None
        y = self.embed_target(tgt_in_tokens)
        if unpadded is not None:
            y = unpadded.unpad(y)
        y = self._decoder_stack(y, enc, src_pad, None, tgt_pad, unpadded, enc_unpadded)
        return self.project(y).flatten(0, -2)

    def _encoder_stack(self, src_tokens: torch.Tensor, skip_padding: bool):
        """Embedding and encoder layers: (output, padding mask, Unpadded or None); the output is
        (N_S, D) when padding was skipped, (B, S, D) otherwise."""
        src_pad = src_tokens.eq(self.pad_idx)
        x = self.embed_source(src_tokens)
        unpadded = Unpadded(src_pad) if skip_padding and bool(src_pad.any()) else None
        if unpadded is not None:
            x = unpadded.unpad(x)
        for layer in self.encoder_layers:
            x = self._run(layer, x, src_pad, unpadded)
        if self.encoder_layer_norm is not None:
            x = self.encoder_layer_norm(x)
        return x, src_pad, unpadded

    def _decoder_stack(self, y, enc, src_pad, state=None, tgt_pad=None, unpadded=None, enc_unpadded=None):
        for layer in self.decoder_layers:
            y = self._run(layer, y, enc, src_pad, state, tgt_pad, unpadded, enc_unpadded)
        if self.decoder_layer_norm is not None:
            y = self.decoder_layer_norm(y)
        return y


def build_model(cfg: ModelConfig, seed: Optional[int] = None, part: Optional[ModelPart] = None,
                device: str | torch.device = "cpu") -> EncoderDecoder:
    """The model of ``cfg`` (or the ``part`` of it one pipeline stage holds), initialised by its
    scheme (init.py) with per-layer generators seeded by ``seed``. ``seed=None`` takes one from
    torch's global generator, so ``torch.manual_seed(s); build_model(cfg)`` is reproducible.
    ``device="meta"``: names and shapes only, no memory, no initialisation."""
    if seed is None:
        seed = int(torch.randint(0, 2**62, ()).item())
    scheme = get_init_scheme(cfg)
    with torch.device("meta"):
        model = EncoderDecoder(cfg, scheme, part)
    if torch.device(device).type == "meta":
        return model
    model.to_empty(device=device)
    scheme.initialize(model, seed)
    return model


def compile_layers(model: nn.Module, **options) -> None:
    """``torch.compile`` each encoder and decoder layer in place (``nn.Module.compile``), so
    parameter names, hooks and checkpoints stay those of the eager model. Layer by layer rather
    than the whole model: every layer of a stack has the same graph, compiled once and reused,
    and the embedding, loss and engine code around them stay eager. Token buckets change shapes
    from batch to batch, hence ``dynamic=True`` by default."""
    options.setdefault("dynamic", True)
    for stack in (model.encoder_layers, model.decoder_layers):
        for layer in stack:
            layer.compile(**options)


def set_dropout_impl(model: nn.Module, impl: str) -> None:
    """Every module of ``model`` that drops out draws its masks with ``impl`` (dropout.py)."""
    if impl not in DROPOUT_IMPLS:
        raise ValueError(f"dropout implementation {impl!r}: must be one of {', '.join(DROPOUT_IMPLS)}")
    for m in model.modules():
        if hasattr(m, "dropout_impl"):
            m.dropout_impl = impl


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Parameters counted once each (a tied embedding is one matrix)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
