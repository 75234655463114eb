"""The Transformer's building blocks, in the order data flows through them: embeddings with
sinusoidal positions, attention (with the incremental state decoding keeps), the feed-forward
block, and the encoder and decoder layers. transformer.py assembles them into the model.

fairseq-compatible: scaled token embeddings plus sinusoidal positions, Post-LN (or Pre-LN) layers,
ReLU FFN. Residual connections and LayerNorm placement come from an ``InitScheme`` (init.py),
because they are the experiment: Post-LN, Pre-LN, Admin, DeepNorm and T-Fixup differ there and
nowhere else. Weights are drawn by the scheme, not here: every module is built on the meta device
first (transformer.py), so construction draws no random numbers and allocates nothing.

Shapes:  B batch, S source length, T target length, D model_dim, H heads, Dh = D / H,
         F ffn_inner_dim, V vocabulary, N real (non-pad) tokens. Activations are batch-first.

This file imports torch, config.py, dropout.py and residual.py only: no deepspeed, no
torch.distributed. Every module that drops out has a ``dropout_impl`` attribute (dropout.py), a
runtime choice like ``mask_padded_keys``, not part of the architecture.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from admin_ds.model.config import ModelConfig
from admin_ds.model.dropout import dropout
from admin_ds.model.residual import Residual

NEG_INF = -math.inf

# --------------------------------------------------------------------------------------------
# Embeddings
# --------------------------------------------------------------------------------------------


def sinusoidal_table(num_positions: int, dim: int, pad_idx: int) -> torch.Tensor:
    """fairseq's SinusoidalPositionalEmbedding table: sin half then cos half (not interleaved);
    the row at pad_idx is zero so padding gets no position."""
    half = dim // 2
    freq = torch.exp(torch.arange(half, dtype=torch.float32) * -(math.log(10000.0) / (half - 1)))
    angles = torch.arange(num_positions, dtype=torch.float32)[:, None] * freq[None, :]
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    table[pad_idx] = 0.0
    return table


def make_positions(tokens: torch.Tensor, pad_idx: int, offset: int = 0) -> torch.Tensor:
    """Position ids pad_idx+1, pad_idx+2, ... for real tokens, pad_idx for padding (fairseq).
    Counting only real tokens makes positions independent of how much padding a batch has."""
    real = tokens.ne(pad_idx).long()
    return (torch.cumsum(real, dim=1) + offset) * real + pad_idx


class TokenEmbedding(nn.Module):
    """Token embedding scaled by sqrt(D), plus sinusoidal positions.

    The same module also projects decoder states back to the vocabulary when embeddings are tied,
    so under ZeRO-3 and in the pipeline the shared weight has a single owner.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.pad_idx = cfg.pad_idx
        self.scale = math.sqrt(cfg.model_dim)
        self.weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.model_dim))
        # Not persistent: a pure function of the config, so checkpoints stay small and a table
        # computed in float32 is never saved in bf16.
        self.register_buffer(
            "positions", sinusoidal_table(cfg.max_positions + cfg.pad_idx + 1, cfg.model_dim, cfg.pad_idx),
            persistent=False)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The position table again (a module built on the meta device has none); the weight is
        drawn by the initialisation scheme."""
        n, d = self.positions.shape
        self.positions.copy_(sinusoidal_table(n, d, self.pad_idx))

    def forward(self, tokens: torch.Tensor, position_offset: int = 0) -> torch.Tensor:
        """(B, L) int64 -> (B, L, D). position_offset > 0 during incremental decoding."""
        max_positions = self.positions.size(0) - self.pad_idx - 1
        if position_offset + tokens.size(1) > max_positions:  # a shape check: no device sync
            raise ValueError(f"sequence of length {position_offset + tokens.size(1)} exceeds "
                             f"model.max_positions={max_positions}")
        pos = make_positions(tokens, self.pad_idx, position_offset)
        x = F.embedding(tokens, self.weight, self.pad_idx) * self.scale
        # The table is a float32 constant: cast it, or a bf16 engine fails on the add (DS notes 6).
        return x + self.positions[pos].to(x.dtype)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, D) -> (B, T, V) with the tied weight."""
        return F.linear(x, self.weight)


# --------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------


class IncrementalState:
    """Cached keys/values for step-by-step decoding, one entry per attention module.

    Self-attention keys/values live in preallocated buffers (rows, H, capacity, Dh): a step writes
    its position in place and attends to the filled prefix, so no step copies the past. The
    capacity starts at ``min(capacity, 64)`` positions and doubles when full (a hint of the final
    length, never a limit). Encoder-attention keys/values are computed once, with one row per
    *sentence*: beam search keeps the ``rows / sentences`` hypotheses of a sentence in adjacent
    rows, and they all attend to the same copy.

    A decoder step (inference/step.py) reads all layers' encoder keys and values as two stacks
    with the layer first (``set_encoder_stack``; each module's entry is a view of its layer), so
    ``reorder_encoder`` is two index_selects.

    ``reorder`` follows the search's choice of hypotheses (self-attention caches);
    ``reorder_encoder`` follows a change of the sentences in the batch (encoder-attention caches).
    Decoding is inference: gradients do not flow through a reorder.
    """

    def __init__(self, capacity: int = 64) -> None:
        self.length = 0  # target positions already decoded
        self.capacity = max(1, int(capacity))
        self._self: dict[int, list[torch.Tensor]] = {}  # id(module) -> [k, v, spare k, spare v]
        self._encoder: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._encoder_stack: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._encoder_stack_keys: tuple[int, ...] = ()

    def append(self, key: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new positions k, v (rows, H, T, Dh) after ``self.length`` cached ones; returns
        views of all keys and values so far, (rows, H, length + T, Dh)."""
        start, end = self.length, self.length + k.size(2)
        bufs = self._self.get(key)
        if bufs is None:
            bufs = self.allocate(key, k, end)
        elif end > bufs[0].size(2):
            self._grow(bufs, end)
        bufs[0].narrow(2, start, end - start).copy_(k)  # narrow + copy_: ~3x less overhead than
        bufs[1].narrow(2, start, end - start).copy_(v)  # slice assignment, at every decoding step
        return bufs[0].narrow(2, 0, end), bufs[1].narrow(2, 0, end)

    def allocate(self, key: int, like: torch.Tensor, end: int) -> list:
        """Empty buffers for ``key``'s self-attention cache, before its first ``append``: keys and
        values shaped as ``like`` (rows, H, T, Dh), with room for ``end`` positions or more."""
        cap = max(end, min(self.capacity, 64))
        bufs = self._self[key] = [like.new_empty(like.size(0), like.size(1), cap, like.size(3))
                                  for _ in range(2)] + [None, None]
        return bufs

    def buffers(self, keys: tuple[int, ...], like: torch.Tensor,
                end: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The self-attention key and value buffers of ``keys`` (rows, H, capacity, Dh), each with
        room for ``end`` positions: allocated shaped as ``like`` (rows, H, T, Dh) where missing."""
        for key in keys:
            if key not in self._self:
                self.allocate(key, like, end)
        self.reserve(end)
        return [self._self[key][0] for key in keys], [self._self[key][1] for key in keys]

    def reserve(self, end: int) -> None:
        """Room for ``end`` positions in every self-attention cache, grown now rather than in a
        later ``append``: decoding's flat step (inference/step.py) writes into the buffers directly."""
        for bufs in self._self.values():
            if end > bufs[0].size(2):
                self._grow(bufs, end)

    def _grow(self, bufs: list, end: int) -> None:
        """A cache's buffers (in place in ``bufs``) at least doubled, to hold ``end`` positions;
        the filled prefix copied over."""
        cap, n = max(end, 2 * bufs[0].size(2)), self.length
        grown = [b.new_empty(*b.shape[:2], cap, b.size(3)) for b in bufs[:2]]
        grown[0][:, :, :n] = bufs[0][:, :, :n]
        grown[1][:, :, :n] = bufs[1][:, :, :n]
        bufs[:] = grown + [None, None]

    def encoder_kv(self, key: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        return self._encoder.get(key)

    def set_encoder_kv(self, key: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._encoder[key] = (k, v)

    def set_encoder_stack(self, keys: tuple[int, ...], k: torch.Tensor, v: torch.Tensor) -> None:
        """The encoder-attention keys and values of ``keys`` (one module per decoder layer), stacked:
        (layers, b, H, Dh, S) and (layers, b, H, S, Dh)."""
        self._encoder_stack, self._encoder_stack_keys = (k, v), keys
        for i, key in enumerate(keys):
            self._encoder[key] = (k[i], v[i])

    def encoder_stack(self, keys: tuple[int, ...]) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The stacked encoder keys and values of ``keys`` (``set_encoder_stack``), stacked now if
        each module cached its own; None if they are not cached yet."""
        if self._encoder_stack_keys != keys:
            if not all(key in self._encoder for key in keys):
                return None
            self.set_encoder_stack(keys, *(torch.stack([self._encoder[key][j] for key in keys]) for j in (0, 1)))
        return self._encoder_stack

    def reorder(self, order: torch.Tensor) -> None:
        """Row i of every self-attention cache becomes row ``order[i]``; only the filled prefix is
        copied, into the spare buffer when the row count stays (no allocation). Where most rows
        keep their own (a beam that continues itself stays in its row), only the rows that change
        are copied, in place (``_moved_rows``)."""
        n = self.length
        moved = _moved_rows(order, self._rows()) if n else None
        if moved is not None:
            targets, sources = moved
            with torch.no_grad():
                for bufs in self._self.values():
                    for cur in bufs[:2]:
                        filled = cur.narrow(2, 0, n)
                        filled.index_copy_(0, targets, filled.index_select(0, sources))
            return
        for bufs in self._self.values():
            for i in (0, 1):
                cur, spare = bufs[i], bufs[2 + i]
                if order.numel() != cur.size(0):  # the batch grows (first beam step) or shrinks
                    spare = cur.new_empty(order.numel(), *cur.shape[1:])
                elif spare is None:
                    spare = torch.empty_like(cur)
                with torch.no_grad():
                    torch.index_select(cur[:, :, :n], 0, order, out=spare[:, :, :n])
                bufs[i], bufs[2 + i] = spare, (cur if order.numel() == cur.size(0) else None)

    def _rows(self) -> int:
        """The self-attention caches' row count (0 before the first step)."""
        return next(iter(self._self.values()))[0].size(0) if self._self else 0

    def reorder_encoder(self, order: torch.Tensor) -> None:
        """Row i of every encoder-attention cache becomes row ``order[i]`` (a sentence index)."""
        if self._encoder_stack is not None:
            self.set_encoder_stack(self._encoder_stack_keys, *(_select_rows(t, order) for t in self._encoder_stack))
        stacked = set(self._encoder_stack_keys)
        for key, (k, v) in self._encoder.items():
            if key not in stacked:
                self._encoder[key] = (k.index_select(0, order), v.index_select(0, order))


def _moved_rows(order: torch.Tensor, rows: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(rows that change, the rows they take) where a reorder of ``rows`` rows by ``order`` leaves
    most rows where they are; None where the row count changes or at least a third of the rows
    move: then copying every row once into the spare buffer moves fewer bytes than reading and
    writing the moved ones (each twice, the read into a temporary first, since a row can be both
    read and overwritten)."""
    if order.numel() != rows:
        return None
    targets = order.ne(torch.arange(rows, device=order.device)).nonzero().squeeze(1)
    if 3 * targets.numel() >= rows:
        return None
    return targets, order.index_select(0, targets)


def _select_rows(stack: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``stack.index_select(1, order)`` of a stack (L, B, ...), layer by layer: a selection along
    the first dimension copies whole rows, and took ~0.7 ms against ~1.2-1.8 ms along the second
    for a 6-layer stack of 64 sentences (2 threads)."""
    out = stack.new_empty(stack.size(0), order.numel(), *stack.shape[2:])
    with torch.no_grad():
        for layer, selected in zip(stack, out):
            torch.index_select(layer, 0, order, out=selected)
    return out


class Unpadded:
    """The real tokens of a padded (B, S) batch, flattened to (N, D) rows: position-wise work (the
    linear layers, LayerNorm, residuals, the output projection) runs on N rows instead of B * S;
    attention scatters back into the padded layout. Decoding skips a mixed-length batch's source
    padding; training skips all of it (``EncoderDecoder.forward(..., skip_padding=True)``).

    Sizes are read from the mask's shape, not kept as Python numbers, so a compiled layer that
    receives one sees symbolic sizes rather than a constant to recompile for at every shape."""

    def __init__(self, pad_mask: torch.Tensor, index: Optional[torch.Tensor] = None) -> None:
        self.pad_mask = pad_mask
        # (N,) into the flattened B * S; given, where it was found outside a compiled graph
        self.index = (~pad_mask).reshape(-1).nonzero().squeeze(1) if index is None else index

    def unpad(self, x: torch.Tensor) -> torch.Tensor:  # (B, S, ...) -> (N, ...)
        return x.flatten(0, 1).index_select(0, self.index)

    def pad(self, x: torch.Tensor) -> torch.Tensor:  # (N, ...) -> (B, S, ...), zeros at padding
        b, s = self.pad_mask.shape
        out = x.new_zeros(b * s, *x.shape[1:])
        return out.index_copy_(0, self.index, x).view(b, s, *x.shape[1:])


class MultiheadAttention(nn.Module):
    """Scaled dot-product attention with separate Q, K, V projections (fairseq names, so input-side
    weights can be rescaled one by one when omega is folded: encoder-attention divides Q only).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.model_dim
        self.num_heads = cfg.num_heads
        self.dropout_p = cfg.attention_dropout_p
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)
        # Decoding may install one product for Q, K and V of a self-attention step (inference.py).
        self.qkv_proj: Optional[nn.Module] = None

    dropout_impl: str = "torch"

    def _heads(self, x: torch.Tensor) -> torch.Tensor:  # (B, L, D) -> (B, H, L, Dh)
        b, l, d = x.shape
        return x.view(b, l, self.num_heads, d // self.num_heads).transpose(1, 2)

    def forward(self, query: torch.Tensor, memory: Optional[torch.Tensor] = None,
                key_padding_mask: Optional[torch.Tensor] = None, causal: bool = False,
                state: Optional[IncrementalState] = None, unpadded: Optional[Unpadded] = None,
                memory_unpadded: Optional[Unpadded] = None) -> torch.Tensor:
        """query (B, T, D); memory (B, S, D) for encoder-attention, None for self-attention;
        key_padding_mask (B, S) bool, True at padding. With ``state``, ``query`` holds only the
        newest target position(s) and keys/values come from (and go to) the cache. With
        ``unpadded``, ``query`` is (N, D): the real tokens of the batch (and so are self-attention's
        keys); with ``memory_unpadded``, ``memory`` is (N_S, D) likewise."""
        if state is None:
            src = query if memory is None else memory
            q, k, v = (proj(x) for proj, x in ((self.q_proj, query), (self.k_proj, src), (self.v_proj, src)))
            keys_unpadded = unpadded if memory is None else memory_unpadded
            if unpadded is not None:
                q = unpadded.pad(q)
            if keys_unpadded is not None:
                k, v = keys_unpadded.pad(k), keys_unpadded.pad(v)
            mask = None if key_padding_mask is None else ~key_padding_mask[:, None, None, :]
            if causal and mask is not None:  # SDPA takes a mask or is_causal, not both
                t = q.size(-2)
                mask = mask & torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
                causal = False
            if self.training and self.dropout_p > 0 and self.dropout_impl != "torch":
                out = self._attend_dropout(self._heads(q), self._heads(k), self._heads(v), mask, causal)
            else:
                out = F.scaled_dot_product_attention(
                    self._heads(q), self._heads(k), self._heads(v), attn_mask=mask, is_causal=causal,
                    dropout_p=self.dropout_p if self.training else 0.0)
            b, h, t, dh = out.shape
            out = out.transpose(1, 2).reshape(b, t, h * dh)
            return self.out_proj(out if unpadded is None else unpadded.unpad(out))
        if memory is None:
            return self._self_attention_step(query, state)
        return self._encoder_attention_step(query, memory, key_padding_mask, state)

    def _attend_dropout(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        mask: Optional[torch.Tensor], causal: bool) -> torch.Tensor:
        """Attention with ``dropout_impl``'s masks on its weights, (B, H, T, Dh) in and out. SDPA
        draws its masks inside the kernel from torch's generator, so the weights are computed here
        as SDPA's math path computes them (the path it takes on a CPU with dropout anyway)."""
        scores = torch.matmul(q, k.transpose(-1, -2)).mul_(q.size(-1) ** -0.5)
        if causal:
            t, s = scores.shape[-2:]
            mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril()
        if mask is not None:  # True where a query may look
            scores = scores.masked_fill(~mask, NEG_INF)
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(v.dtype)
        return torch.matmul(dropout(probs, self.dropout_p, True, self.dropout_impl), v)

    def _self_attention_step(self, query: torch.Tensor, state: IncrementalState) -> torch.Tensor:
        rows, t, d = query.shape
        if self.qkv_proj is not None:
            q, k_new, v_new = (self._heads(x) for x in self.qkv_proj(query).split(d, dim=-1))
        else:
            q, k_new, v_new = (self._heads(proj(query)) for proj in (self.q_proj, self.k_proj, self.v_proj))
        k, v = state.append(id(self), k_new, v_new)  # (rows, H, length + t, Dh)
        hidden = None
        if t > 1:  # several new positions: each sees the cache and the new ones up to itself
            pos = torch.arange(k.size(2), device=query.device)
            hidden = pos[None, :] > pos[-t:, None]
        out = self._attend(q, k.transpose(-1, -2), v, hidden)
        return self.out_proj(out.transpose(1, 2).reshape(rows, t, d))

    def cache_encoder_kv(self, memory: torch.Tensor, key_padding_mask: Optional[torch.Tensor],
                         state: IncrementalState) -> tuple[torch.Tensor, torch.Tensor]:
        """This encoder-attention's keys and values of ``memory`` (B, S, D), computed once per batch
        and stored in ``state``: (B, H, Dh, S) and (B, H, S, Dh), one row per sentence, contiguous
        so that every step's products read them in place."""
        if key_padding_mask is not None and bool(key_padding_mask.any()):
            real = Unpadded(key_padding_mask)  # padding keys are masked: skip their products
            k, v = (real.pad(proj(real.unpad(memory))) for proj in (self.k_proj, self.v_proj))
        else:
            k, v = self.k_proj(memory), self.v_proj(memory)
        # Keys stored transposed: a batched product with contiguous (Dh, S) matrices is ~2x
        # faster than one that reads (S, Dh) matrices transposed.
        cached = self._heads(k).transpose(2, 3).contiguous(), self._heads(v).contiguous()
        state.set_encoder_kv(id(self), *cached)
        return cached

    def _encoder_attention_step(self, query: torch.Tensor, memory: torch.Tensor,
                                key_padding_mask: Optional[torch.Tensor],
                                state: IncrementalState) -> torch.Tensor:
        cached = state.encoder_kv(id(self))
        k_t, v = self.cache_encoder_kv(memory, key_padding_mask, state) if cached is None else cached
        rows, t, d = query.shape
        b = k_t.size(0)
        if rows % b:
            raise ValueError(f"encoder-attention step: {rows} decoder rows for {b} encoder rows; each "
                             f"sentence needs the same number of adjacent rows (its beams)")
        # The rows of one sentence (its beams) are adjacent: they become query positions of that
        # sentence, so its keys and values are read once, not once per beam.
        q = self._heads(self.q_proj(query).view(b, rows // b * t, d))
        hidden = None if key_padding_mask is None else key_padding_mask[:, None, None, :]
        out = self._attend(q, k_t, v, hidden)
        return self.out_proj(out.transpose(1, 2).reshape(rows, t, d))

    def _attend(self, q: torch.Tensor, k_t: torch.Tensor, v: torch.Tensor,
                hidden: Optional[torch.Tensor]) -> torch.Tensor:
        """softmax(q k^T / sqrt(Dh)) v for decoding steps (``k_t`` = k^T), where few queries meet
        cached keys that are views into larger buffers (explicit products beat the fused kernel on
        those shapes)."""
        scores = torch.matmul(q, k_t).mul_(q.size(-1) ** -0.5)  # in place: one allocation fewer
        if hidden is not None:  # True where a query must not look (padding, future positions)
            scores.masked_fill_(hidden, NEG_INF)
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(v.dtype)  # bf16/fp16: fp32 softmax
        probs = dropout(probs, self.dropout_p, self.training, self.dropout_impl)
        return torch.matmul(probs, v)


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.model_dim, cfg.ffn_inner_dim)
        self.fc2 = nn.Linear(cfg.ffn_inner_dim, cfg.model_dim)
        self.activation = F.relu if cfg.activation == "relu" else F.gelu
        self.activation_dropout_p = cfg.activation_dropout_p

    dropout_impl: str = "torch"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = dropout(self.activation(self.fc1(x)), self.activation_dropout_p, self.training, self.dropout_impl)
        return self.fc2(h)


# --------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------


class _SubLayers(nn.Module):
    """What encoder and decoder layers share: one ``sublayer`` step for either norm order."""

    norm_order: str
    dropout_p: float
    dropout_impl: str = "torch"

    def sublayer(self, x: torch.Tensor, branch, norm: nn.Module, residual: Residual) -> torch.Tensor:
        """Post-LN:  x_i = LN(res(x, drop(f(x))))     Pre-LN:  x_i = res(x, drop(f(LN(x))))"""
        if self.norm_order == "post":
            return norm(residual(x, dropout(branch(x), self.dropout_p, self.training, self.dropout_impl)))
        return residual(x, dropout(branch(norm(x)), self.dropout_p, self.training, self.dropout_impl))


class EncoderLayer(_SubLayers):
    """Two sub-layers: self-attention, FFN. Post-LN residual path (the LN follows the sum)::

        x ──┬── self_attn ── dropout ──┐             ──┬── fc1 ─ act ─ fc2 ── dropout ──┐
            └──── omega * x ──────────(+)── LN ──...   └──── omega * x ────────────────(+)── LN ──>
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int, scheme) -> None:
        super().__init__()
        d, base = cfg.model_dim, 2 * layer_idx
        self.norm_order, self.dropout_p = cfg.norm_order, cfg.dropout_p
        self.self_attn = MultiheadAttention(cfg)
        self.self_attn_layer_norm = scheme.make_norm(d)
        self.self_attn_residual = scheme.make_residual(d, "encoder", base + 1)
        self.ffn = FeedForward(cfg)
        self.final_layer_norm = scheme.make_norm(d)
        self.ffn_residual = scheme.make_residual(d, "encoder", base + 2)

    def forward(self, x: torch.Tensor, src_pad: Optional[torch.Tensor],
                unpadded: Optional[Unpadded] = None) -> torch.Tensor:
        """x (B, S, D), or (N, D) real tokens only with ``unpadded``."""
        x = self.sublayer(x, lambda h: self.self_attn(h, key_padding_mask=src_pad, unpadded=unpadded),
                          self.self_attn_layer_norm, self.self_attn_residual)
        return self.sublayer(x, self.ffn, self.final_layer_norm, self.ffn_residual)


class DecoderLayer(_SubLayers):
    """Three sub-layers: causal self-attention, encoder-attention, FFN. The encoder-attention's
    shortcut is the decoder stream; keys and values read the encoder output ``enc``."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, scheme) -> None:
        super().__init__()
        d, base = cfg.model_dim, 3 * layer_idx
        self.norm_order, self.dropout_p = cfg.norm_order, cfg.dropout_p
        self.self_attn = MultiheadAttention(cfg)
        self.self_attn_layer_norm = scheme.make_norm(d)
        self.self_attn_residual = scheme.make_residual(d, "decoder", base + 1)
        self.encoder_attn = MultiheadAttention(cfg)
        self.encoder_attn_layer_norm = scheme.make_norm(d)
        self.encoder_attn_residual = scheme.make_residual(d, "decoder", base + 2)
        self.ffn = FeedForward(cfg)
        self.final_layer_norm = scheme.make_norm(d)
        self.ffn_residual = scheme.make_residual(d, "decoder", base + 3)

    # fairseq's decoder masks padded target keys in self-attention as well as future ones. Real
    # positions never see a padded key (right padding, causal), so the mask changes only the
    # outputs at padded positions, which the loss ignores: training may drop it (False) and let
    # SDPA run its causal kernels (flash attention on a GPU) instead of reading a (B, T, T) mask.
    # Admin's reference profiling counts padded positions, so profiling always masks
    # (``padded_target_keys_masked``); tests/test_fast_paths.py shows the loss and gradients unchanged.
    mask_padded_keys: bool = True

    def forward(self, y: torch.Tensor, enc: torch.Tensor, src_pad: Optional[torch.Tensor],
                state: Optional[IncrementalState] = None, tgt_pad: Optional[torch.Tensor] = None,
                unpadded: Optional[Unpadded] = None, enc_unpadded: Optional[Unpadded] = None) -> torch.Tensor:
        """y (B, T, D), or (N_T, D) real tokens only with ``unpadded``; ``enc`` (B, S, D), or
        (N_S, D) with ``enc_unpadded``; ``tgt_pad`` (B, T) True at target padding (see
        ``mask_padded_keys``)."""
        self_pad = tgt_pad if self.mask_padded_keys else None
        y = self.sublayer(y, lambda h: self.self_attn(h, key_padding_mask=self_pad, causal=True, state=state,
                                                      unpadded=unpadded),
                          self.self_attn_layer_norm, self.self_attn_residual)
        y = self.sublayer(y, lambda h: self.encoder_attn(h, enc, key_padding_mask=src_pad, state=state,
                                                         unpadded=unpadded, memory_unpadded=enc_unpadded),
                          self.encoder_attn_layer_norm, self.encoder_attn_residual)
        return self.sublayer(y, self.ffn, self.final_layer_norm, self.ffn_residual)


@contextlib.contextmanager
def padded_target_keys_masked(model: nn.Module):
    """Every decoder layer of ``model`` masks padded target keys while the block runs (profiling)."""
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    saved = [layer.mask_padded_keys for layer in layers]
    for layer in layers:
        layer.mask_padded_keys = True
    try:
        yield
    finally:
        for layer, value in zip(layers, saved):
            layer.mask_padded_keys = value
