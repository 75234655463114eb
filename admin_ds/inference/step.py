"""One incremental decoder step in few operators: the inner loop of greedy, beam search and sampling.

``model.decode(tokens, enc, src_pad, state)`` runs a step through the modules: per decoder layer
some sixteen module calls, closures, dropout calls that do nothing in eval mode, and views. When
one or a few sentences are decoded, every product has one or a few rows and runs for tens of
microseconds, so that bookkeeping took as long as the products themselves (bench/decode.py
--profile, and side by side: about half of a base-6L-6L greedy step at batch 1). ``DecoderStep``
runs the same computation from the same tensors as one flat loop: per layer, its eight products
(six where Q, K and V are one, as int8.py makes them) through their modules (a Linear, or int8
decoding's Int8Linear), attention of the new position over the cached keys as two batched products, and each
residual with its LayerNorm in two operators.

Shapes: R decoder rows (sentences x beams), b sentences (encoder rows), S source length, D model
dim, H heads, Dh = D / H, V vocabulary; n target positions decoded so far, this one included.

    x (R, D) ─┬─ qkv ─ [k, v -> state] ─ softmax(q k^T / sqrt(Dh)) v ─ out ─┐
              └───────────────────── scale * x ─────────────────────────(+)── LN ──> (Post-LN)

The first step of a batch also computes each layer's encoder keys and values into ``state``
(``MultiheadAttention.cache_encoder_kv``, as ``model.decode`` does), which the step reads stacked,
the layer first (``IncrementalState.set_encoder_stack``). ``model.decode`` stays the
reference: several new positions at once, a model in training mode, a residual with a profiling
recorder attached, a residual other than ``scale * x + y``, a norm other than LayerNorm, and a
model whose ``decode`` was replaced on the instance all go through it. tests/test_decode.py checks
that the two compute the same logits and translations.

This file imports torch and model.py only.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from admin_ds.model.layers import DecoderLayer, IncrementalState
from admin_ds.model.residual import OmegaResidual, PlainResidual, ScaledResidual
from admin_ds.model.transformer import EncoderDecoder

__all__ = ["DecoderStep", "decoder_step"]

Product = Callable[[torch.Tensor], torch.Tensor]
Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, IncrementalState], torch.Tensor]


class _Unsupported(Exception):
    """Something the flat step does not compute: decoding goes through model.decode."""


class _Norm(NamedTuple):
    shape: tuple[int, ...]
    weight: Optional[torch.Tensor]
    bias: Optional[torch.Tensor]
    eps: float


class _Layer(NamedTuple):
    """What one decoder layer's step reads: its modules and tensors, in forward order."""
    index: int  # its layer in the caches' stacks
    # The products: Linear or Int8Linear (int8.py), each (N, in) -> (N, out).
    qkv: Optional[Product]  # one product for Q, K and V (int8.py), or None: three
    q: Product
    k: Product
    v: Product
    self_out: Product
    cross_q: Product
    cross_out: Product
    fc1: Product
    activation: Product  # identity when fused into fc1
    fc2: Product
    norms: tuple[Optional[_Norm], Optional[_Norm], Optional[_Norm]]  # None: no norm (T-Fixup)
    scales: tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]  # None: 1


def _norm_of(module: nn.Module) -> Optional[_Norm]:
    if isinstance(module, nn.Identity):
        return None
    if isinstance(module, nn.LayerNorm):
        return _Norm(tuple(module.normalized_shape), module.weight, module.bias, module.eps)
    raise _Unsupported(f"norm {type(module).__name__}")


def _direct(module: Optional[nn.Module]):
    """The module's forward without nn.Module's call machinery (~3 us a call, 37 calls a step of a
    base decoder), or the module itself where hooks are registered on it."""
    if module is None or module._forward_hooks or module._forward_pre_hooks:
        return module
    return module.forward


def _layer_of(index: int, layer: DecoderLayer) -> _Layer:
    sa, ca, ffn = layer.self_attn, layer.encoder_attn, layer.ffn
    residuals = (layer.self_attn_residual, layer.encoder_attn_residual, layer.ffn_residual)
    if any(r.recorder is not None for r in residuals):
        raise _Unsupported("a residual recorder is attached")
    if not all(isinstance(r, (PlainResidual, OmegaResidual, ScaledResidual)) for r in residuals):
        raise _Unsupported("a residual other than scale * x + y")
    products = (sa.qkv_proj, sa.q_proj, sa.k_proj, sa.v_proj, sa.out_proj, ca.q_proj, ca.out_proj, ffn.fc1)
    return _Layer(index, *map(_direct, products), ffn.activation, _direct(ffn.fc2),
                  tuple(_norm_of(n) for n in (layer.self_attn_layer_norm, layer.encoder_attn_layer_norm,
                                              layer.final_layer_norm)),
                  tuple(r.shortcut_scale() for r in residuals))


class _Caches(NamedTuple):
    """What a step reads of its IncrementalState: each layer's self-attention key and value buffers
    (R, H, capacity, Dh) with ``length`` positions filled and room for one more, and the encoder
    keys (L, b, H, Dh, S) and values (L, b, H, S, Dh) stacked, the layer first."""
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    encoder_keys: torch.Tensor
    encoder_values: torch.Tensor
    length: int

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The new position's k, v (R, H, 1, Dh) written after the filled ones; all keys and values
        of ``layer`` so far, (R, H, length + 1, Dh)."""
        n, keys, values = self.length, self.keys[layer], self.values[layer]
        keys.narrow(2, n, 1).copy_(k)
        values.narrow(2, n, 1).copy_(v)
        return keys.narrow(2, 0, n + 1), values.narrow(2, 0, n + 1)


def _residual(x: torch.Tensor, y: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
    """scale * x + y, as Residual.combine computes it; the plain sum is added into y, a product's
    fresh output."""
    return y.add_(x) if scale is None else torch.addcmul(y, scale, x)


def _layer_norm(x: torch.Tensor, norm: Optional[_Norm]) -> torch.Tensor:
    return x if norm is None else F.layer_norm(x, norm.shape, norm.weight, norm.bias, norm.eps)


class DecoderStep:
    """``step(tokens (R, 1), enc, src_pad, state) -> logits (R, V)`` for one new position of every
    row: the computation of ``model.decode(...)[:, -1]`` with far fewer operators. The first step
    of a batch caches every layer's encoder keys and values in ``state``."""

    def __init__(self, model: EncoderDecoder) -> None:
        self.model = model
        self.post = model.cfg.norm_order == "post"
        self.heads = model.cfg.num_heads
        # 1 / sqrt(Dh) as a tensor made once: a Python number is made into a new tensor at every
        # call (1.7 against 0.65 us a scaling, 12 a step of a 6-layer decoder); the same products.
        self.query_scale = torch.tensor((model.cfg.model_dim // self.heads) ** -0.5)
        if not len(model.decoder_layers):
            raise _Unsupported("no decoder layers")
        self.layers = [_layer_of(i, layer) for i, layer in enumerate(model.decoder_layers)]
        self.encoder_attentions = [layer.encoder_attn for layer in model.decoder_layers]
        # The IncrementalState keys of each layer's two attentions, in layer order.
        self.self_keys = tuple(id(layer.self_attn) for layer in model.decoder_layers)
        self.cross_keys = tuple(id(attention) for attention in self.encoder_attentions)
        self.final_norm = None if model.decoder_layer_norm is None else _norm_of(model.decoder_layer_norm)
        self._pad_seen: Optional[torch.Tensor] = None  # the last src_pad, and the mask made of it
        self._mask: Optional[torch.Tensor] = None

    def __call__(self, tokens: torch.Tensor, enc: torch.Tensor, src_pad: torch.Tensor,
                 state: IncrementalState) -> torch.Tensor:
        if tokens.size(1) != 1 or self.model.training:
            return self.model.decode(tokens, enc, src_pad, state)[:, -1]
        encoder = state.encoder_stack(self.cross_keys)
        if encoder is None:  # a new batch
            for attention in self.encoder_attentions:
                attention.cache_encoder_kv(enc, src_pad, state)
            encoder = state.encoder_stack(self.cross_keys)
        if src_pad is not self._pad_seen:  # (b * H, 1, S) for the 3-D products; no padding: no mask
            b, s = src_pad.shape
            self._pad_seen = src_pad
            self._mask = (src_pad[:, None, :].expand(b, self.heads, s).reshape(b * self.heads, 1, s)
                          if bool(src_pad.any()) else None)
        logits = self._decoder(tokens, self._caches(state, tokens.size(0), encoder), self._mask)
        state.length += 1
        return logits

    def _caches(self, state: IncrementalState, rows: int, encoder: tuple[torch.Tensor, torch.Tensor]) -> _Caches:
        """What this step of ``rows`` rows reads and writes of ``state``."""
        weight = self.model.target_embedding.weight
        like = weight.new_empty(rows, self.heads, 0, weight.size(1) // self.heads)
        return _Caches(*state.buffers(self.self_keys, like, state.length + 1), *encoder, state.length)

    def _decoder(self, tokens: torch.Tensor, caches: _Caches, mask: Optional[torch.Tensor]) -> torch.Tensor:
        """The embedding of ``tokens`` (R, 1) at the new position, every decoder layer on it, and the
        output projection."""
        x = self.model.embed_target(tokens.view(-1, 1), caches.length).view(tokens.size(0), -1)
        for layer in self.layers:
            (n1, n2, n3), (s1, s2, s3) = layer.norms, layer.scales
            if self.post:  # LN(scale * x + f(x)), layers._SubLayers
                x = _layer_norm(_residual(x, self._self_attention(layer, x, caches), s1), n1)
                x = _layer_norm(_residual(x, self._encoder_attention(layer, x, caches, mask), s2), n2)
                x = _layer_norm(_residual(x, layer.fc2(layer.activation(layer.fc1(x))), s3), n3)
            else:  # scale * x + f(LN(x))
                x = _residual(x, self._self_attention(layer, _layer_norm(x, n1), caches), s1)
                x = _residual(x, self._encoder_attention(layer, _layer_norm(x, n2), caches, mask), s2)
                h = _layer_norm(x, n3)
                x = _residual(x, layer.fc2(layer.activation(layer.fc1(h))), s3)
        return self.model.project(_layer_norm(x, self.final_norm))

    def _qkv(self, layer: _Layer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The new position's queries, keys and values, each (R, H, 1, Dh)."""
        rows, d = x.shape
        h, dh = self.heads, d // self.heads
        if layer.qkv is not None:
            return layer.qkv(x).view(rows, 3, h, 1, dh).unbind(1)
        return tuple(proj(x).view(rows, h, 1, dh) for proj in (layer.q, layer.k, layer.v))

    def _self_attention(self, layer: _Layer, x: torch.Tensor, caches: _Caches) -> torch.Tensor:
        q, k, v = self._qkv(layer, x)
        return layer.self_out(self._attend(q, *caches.append(layer.index, k, v)))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """(R, D): the queries q (R, H, 1, Dh) against the cached keys and values k, v (R, H, n, Dh)."""
        rows, h, _, dh = q.shape
        n = k.size(2)
        # R * H products of one query with n keys (R and H merge without a copy in the cache).
        scores = torch.bmm(q.reshape(rows * h, 1, dh), k.reshape(rows * h, n, dh).transpose(1, 2))
        out = torch.bmm(self._softmax(scores.mul_(self.query_scale)), v.reshape(rows * h, n, dh))
        return out.view(rows, h * dh)

    def _encoder_attention(self, layer: _Layer, x: torch.Tensor, caches: _Caches,
                           mask: Optional[torch.Tensor]) -> torch.Tensor:
        # (b, H, Dh, S), (b, H, S, Dh): one row per sentence
        k_t, v = caches.encoder_keys[layer.index], caches.encoder_values[layer.index]
        rows, d = x.shape
        (b, h, dh, s), per = k_t.shape, rows // k_t.size(0)
        # A sentence's rows (its beams) are queries of that sentence: its keys are read once.
        q = layer.cross_q(x).view(b, per, h, dh).transpose(1, 2).reshape(b * h, per, dh)
        scores = torch.bmm(q, k_t.view(b * h, dh, s)).mul_(self.query_scale)
        if mask is not None:
            scores.masked_fill_(mask, float("-inf"))
        out = torch.bmm(self._softmax(scores), v.view(b * h, s, dh))
        return layer.cross_out(out.view(b, h, per, dh).transpose(1, 2).reshape(rows, d))

    def _softmax(self, scores: torch.Tensor) -> torch.Tensor:
        """Over the keys, in float32 whatever the model's dtype (layers.MultiheadAttention._attend)."""
        if scores.dtype == torch.float32:
            return scores.softmax(dim=-1)
        return scores.softmax(dim=-1, dtype=torch.float32).to(scores.dtype)


def decoder_step(model: nn.Module) -> Step:
    """The step function decoding runs: a ``DecoderStep`` where it computes what ``model.decode``
    does, else ``model.decode`` itself (the last position's logits)."""
    try:
        if not isinstance(model, EncoderDecoder) or "decode" in vars(model):
            raise _Unsupported("not the model's own decode")
        return DecoderStep(model)
    except _Unsupported:
        return lambda tokens, enc, src_pad, state: model.decode(tokens, enc, src_pad, state)[:, -1]
