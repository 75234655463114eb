"""One incremental decoder step in few operators: the inner loop of greedy, beam search and sampling.

``model.decode(tokens, enc, src_pad, state)`` runs a step through the modules: per decoder layer
some sixteen module calls, closures, dropout calls that do nothing in eval mode, and views. When
one or a few sentences are decoded, every product has one or a few rows and runs for tens of
microseconds, so that bookkeeping took as long as the products themselves (bench/decode.py
--profile, and side by side: about half of a base-6L-6L greedy step at batch 1). ``DecoderStep``
runs the same computation from the same tensors as one flat loop: per layer, its six products
(eight where Q, K and V are separate) through their modules (a Linear, or decoding's PackedLinear /
Int8Linear), attention of the new position over the cached keys as two batched products, and each
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

``CompiledDecoderStep`` (translate.py --compile) runs the same loop as graphs compiled by
torch.compile: what is left of a step in eager PyTorch besides streaming the weights, ~35 operator
calls a layer and oneDNN's ~15 us fixed cost per product, goes, and the products run as C++
kernels generated for their shapes. It also compiles the encoder with every layer's encoder keys
and values, those as one product (``encode``, which the searches call in place of
``model.encode``). A minute or more of compilation per process buys ~2x at one sentence
(BENCHMARKS.md). In int8 the products stay the int8 model's own, called from the graphs.

This file imports torch and model.py only.
"""

from __future__ import annotations

import contextlib
import sys
import types
import warnings
from typing import TYPE_CHECKING, Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from admin_ds.model.layers import DecoderLayer, IncrementalState, Unpadded
from admin_ds.model.residual import OmegaResidual, PlainResidual, ScaledResidual
from admin_ds.model.transformer import EncoderDecoder

if TYPE_CHECKING:
    from admin_ds.inference.packages import GraphPackages

__all__ = ["CompiledDecoderStep", "DecoderStep", "compilation_seconds", "compile_decoder_step", "decoder_step"]

Product = Callable[[torch.Tensor], torch.Tensor]
ProductFactory = Callable[[torch.Tensor, Optional[torch.Tensor]], nn.Module]  # (weight, bias) -> product
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
    # The products: Linear, PackedLinear or Int8Linear (packed.py), each (N, in) -> (N, out).
    qkv: Optional[Product]  # one product for Q, K and V (packed.py), or None: three
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
    keys (L, b, H, Dh, S) and values (L, b, H, S, Dh) stacked, the layer first. Kept in place
    (IncrementalState.keep_in_place): the buffers have P >= R rows, and ``origins`` (R, capacity)
    holds the buffer row of each position of each row."""
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    encoder_keys: torch.Tensor
    encoder_values: torch.Tensor
    length: int
    origins: Optional[torch.Tensor] = None

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The new position's k, v (R, H, 1, Dh) written after the filled ones (at buffer rows
        0 .. R - 1); all keys and values of ``layer`` so far, (P, H, length + 1, Dh)."""
        n, keys, values = self.length, self.keys[layer], self.values[layer]
        keys.narrow(0, 0, k.size(0)).narrow(2, n, 1).copy_(k)
        values.narrow(0, 0, v.size(0)).narrow(2, n, 1).copy_(v)
        return keys.narrow(2, 0, n + 1), values.narrow(2, 0, n + 1)


def _residual(x: torch.Tensor, y: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
    """scale * x + y, as Residual.combine computes it; the plain sum is added into y, a product's
    fresh output."""
    return y.add_(x) if scale is None else torch.addcmul(y, scale, x)


def _layer_norm(x: torch.Tensor, norm: Optional[_Norm]) -> torch.Tensor:
    return x if norm is None else F.layer_norm(x, norm.shape, norm.weight, norm.bias, norm.eps)


class DecoderStep:
    """``step(tokens (R, 1), enc, src_pad, state) -> logits (R, V)`` for one new position of every
    row: the computation of ``model.decode(...)[:, -1]`` with far fewer operators."""

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
            encoder = self._cache_encoder(enc, src_pad, state)
        if src_pad is not self._pad_seen:  # (b * H, 1, S) for the 3-D products; no padding: no mask
            b, s = src_pad.shape
            self._pad_seen = src_pad
            self._mask = (src_pad[:, None, :].expand(b, self.heads, s).reshape(b * self.heads, 1, s)
                          if self.always_mask or bool(src_pad.any()) else None)
        logits = self._layers(tokens, self._caches(state, tokens.size(0), encoder), self._mask)
        state.length += 1
        return logits

    always_mask = False  # a mask also where the source has no padding
    room = 1  # positions the self-attention caches hold beyond the filled ones before a step

    def encode(self, src_tokens: torch.Tensor, state: IncrementalState) -> tuple[torch.Tensor, torch.Tensor]:
        """The encoder's output (B, S, D) and padding mask (B, S) of ``src_tokens`` (B, S), padding
        skipped (``model.encode``); the first step caches the encoder keys and values."""
        return self.model.encode(src_tokens, skip_padding=True)

    def _caches(self, state: IncrementalState, rows: int, encoder: tuple[torch.Tensor, torch.Tensor]) -> _Caches:
        """What this step of ``rows`` rows reads and writes of ``state``."""
        weight = self.model.target_embedding.weight
        like = weight.new_empty(rows, self.heads, 0, weight.size(1) // self.heads)
        return _Caches(*state.buffers(self.self_keys, like, state.length + self.room), *encoder, state.length)

    def _cache_encoder(self, enc: torch.Tensor, src_pad: torch.Tensor,
                       state: IncrementalState) -> tuple[torch.Tensor, torch.Tensor]:
        """Each layer's encoder keys and values of ``enc`` into ``state``, stacked."""
        for attention in self.encoder_attentions:
            attention.cache_encoder_kv(enc, src_pad, state)
        return state.encoder_stack(self.cross_keys)

    def _layers(self, tokens: torch.Tensor, caches: _Caches, mask: Optional[torch.Tensor]) -> torch.Tensor:
        return self._decoder(tokens, caches, mask)

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
        return layer.self_out(self._attend(q, *caches.append(layer.index, k, v), caches))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, caches: _Caches) -> torch.Tensor:
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


# torch.compile's inductor options for CompiledDecoderStep: the weights folded in as constants
# (freezing), and each product of a graph of few rows (CompiledDecoderStep.few_rows) or of the
# encoder of a short source (few_tokens) a C++ matrix-product kernel generated for its shape
# (inductor's CPP GEMM template, over the weight packed at compile time) or the library call
# (ATen's). The encoder's graph benchmarks the two once, at the sizes of the call that compiles it.
# A step's graph of few rows compiled at up to 8 rows (CompiledDecoderStep.template_rows) takes the
# generated kernel wherever the template applies, with no benchmark (``_templates_first``): at 1-8
# rows it took 0.57-1.02x ATen's time on the Intel Xeon and 0.20-0.95x at 4 rows on the AMD EPYC
# (Zen 4), while a benchmark on a busy machine can pick ATen, and inductor's autotuning cache on
# disk would keep that choice for every later process: a 256-wide beam search's step at up to
# twice the time (BENCHMARKS.md). The template alone fails on some shapes (no valid choice), hence
# ATen beside it.
# The benchmark's tables and statistics are not printed. A call's own cost counts at one sentence,
# so the generated code does not check the size and alignment of each kernel's result (~0.1 ms a
# step, 4-5% of a small model's), and the guards check the arguments alone (``_argument_guards``;
# BENCHMARKS.md).
COMPILE_OPTIONS = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
                   "autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False,
                   "size_asserts": False, "alignment_asserts": False}
_RECOMPILE_LIMIT = 32


class CompiledDecoderStep(DecoderStep):
    """A ``DecoderStep`` whose layers and output projection run as one graph compiled by
    ``torch.compile`` (inductor): the step's products become C++ kernels over the weights packed
    once, and the operators between them fused, so a step costs little beyond streaming the
    weights. The encoder, with every decoder layer's encoder keys and values, is a graph too
    (``encode``). CPU, float32, inference only: the weights are compiled in as constants. An int8
    model's products (packed.Int8Linear, translate.py --int8 --compile) are called from the graphs
    as they are, through an operator of their own, and only the operators between them compiled.

    Beam search's caches are kept in place (IncrementalState.keep_in_place): its reorder at every
    step copies no key or value, and the attention gathers each row's positions from the buffer
    rows that hold them. Its choices between two steps run compiled too while one sentence is left
    (``compiled``). Greedy decoding, which reorders only when sentences finish, reads its rows in
    place, with the products of ``DecoderStep``.

    The first calls compile (about a minute per kind of search for a base model on two cores), in
    every process: inductor's cache on disk keeps the generated C++ kernels and, in int8, the
    graphs, but no float32 graph, which holds oneDNN's packed weights (inductor cannot store those);
    a second process compiled a 256-wide model's float32 graphs in 0.6x the first one's time, its
    int8 graphs in 0.5x (``compilation_seconds``; bench/compile_warmup.py). With ``packages``
    (packages.py, translate.py --compiled-dir) the float32 step's, the encoder's and a search's
    choices' graphs are instead exported and compiled ahead of time into packages on disk, which
    later processes load in seconds; calls no package covers run the graphs below. Sizes that vary
    (rows as sentences finish, cached and source positions, sentences) are symbolic from the first
    graph; torch.compile makes a size or count of 0 or 1 a constant. So the position count, a Python
    int, makes three graphs of a step (the first position, with nothing cached; the second; every
    later one), and one sentence and several make two of the encoder. Few rows and many (``few_rows``,
    ``few_tokens``) have graphs of their own, with generated products and with ATen's. A greedy and
    a beam search, one sentence or many, then make one to two dozen graphs, not one per shape.
    Measured against DecoderStep and CTranslate2: BENCHMARKS.md."""

    # One graph for every batch, with or without source padding alike (a mask of zeros is free
    # inside the graph).
    always_mask = True

    def __init__(self, model: EncoderDecoder, product: Optional[ProductFactory] = None) -> None:
        import torch._inductor.config  # noqa: F401  (read by _frozen; imported here, not by every decode)
        import torch.fx.experimental._config  # noqa: F401

        super().__init__(model)
        _register_templates_first()
        self.encoder_kv = _stacked_encoder_kv(self.encoder_attentions, product)
        def options(**changes) -> dict:
            """A dict of its own for each graph: torch.compile takes guard_filter_fn out of the one it
            is given (a shared dict left the encoder's graphs with every guard on the model)."""
            return dict(COMPILE_OPTIONS, guard_filter_fn=_argument_guards, **changes)

        # No autotuning results on disk for the graphs of few rows; the option also keys them
        # apart, in inductor's graph cache on disk, from graphs benchmarked at every row count.
        few = options(autotune_local_cache=False)
        self._compiled = torch.compile(_own_code(self._decoder_of), options=few)
        self._compiled_many = torch.compile(_own_code(self._decoder_of), options=options(max_autotune=False))
        self._compiled_encoder = torch.compile(_own_code(self._encoder), options=options())
        self._compiled_encoder_many = torch.compile(_own_code(self._encoder), options=options(max_autotune=False))
        # Inductor's own use of a deprecated storage API, once per benchmarked product.
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated", module=r"torch\._inductor\.")
        # Greedy and beam search, one sentence or several, one row or many: a handful of graphs.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, _RECOMPILE_LIMIT)
        self._searches: dict[Callable, Callable] = {}  # what ``compiled`` made

    def compiled(self, fn: Callable) -> Callable:
        """``fn``, a search's tensor code between two steps (``decode._beam_choices``), compiled for
        this step's searches: its operators fused into a few generated kernels, one call instead of
        dozens. Sizes that vary become symbolic after their first change (torch.compile's automatic
        dynamic shapes), with duck sizing off as for the step's graphs (``_frozen``). With
        ``packages``, from a package on disk where one covers the call (``GraphPackages.search``)."""
        def run(*args):
            if self.packages is not None and (out := self.packages.search(fn, args)) is not None:
                return out
            compiled = self._searches.get(fn)
            if compiled is None:
                compiled = self._searches[fn] = torch.compile(_own_code(fn), options=dict(COMPILE_OPTIONS))
            return _frozen(compiled, *args)

        return run

    # Up to how many rows a step runs in the graphs whose products are inductor's generated kernels
    # (chosen as ``template_rows`` says), and up to how many real source tokens the encoder runs in
    # the autotuned graph (COMPILE_OPTIONS); above, in graphs whose products are ATen's (oneDNN's,
    # not autotuned). A graph's kernels serve every size of that symbolic graph: inductor's C++ kernels
    # multiplied 64 rows by a step's larger weights at ~100 GFLOP/s against ~175-220 for ATen's in
    # the same graph (bench/compiled_products.py). Up to 8 rows they took 0.57-1.02x ATen's time, at
    # 16 rows 0.77-1.44x (about level over a step's products), and greedy decoding 16 sentences at a
    # time was slower with ATen's products from 9 rows. So few rows and many have graphs of their
    # own, and a process's first batch does not decide how fast its later ones run (BENCHMARKS.md).
    # The encoder of one ~15-token sentence: 2.52 ms autotuned against 3.19 ms with ATen's products.
    few_rows = 16
    few_tokens = 32
    # A graph of few rows compiled at up to this many rows takes the generated kernels without a
    # benchmark (``_templates_first``); compiled at more, it benchmarks them against ATen's, which
    # multiplied 16 rows by the larger weights faster on the Intel Xeon
    # (bench/compiled_products.py).
    template_rows = 8

    # Room for this position and one more: the cache never grows inside the graph, and the filled
    # prefix never spans a whole buffer (a view of all of it would be another graph).
    room = 2

    # The graphs kept on disk as AOTInductor packages (packages.open_packages), or None.
    packages: Optional["GraphPackages"] = None

    def encode(self, src_tokens: torch.Tensor, state: IncrementalState) -> tuple[torch.Tensor, torch.Tensor]:
        """The encoder and every decoder layer's encoder keys and values (into ``state``) as one
        compiled graph: padding skipped as ``model.encode`` skips it, with or without padding
        alike (no padding: every position is real)."""
        src_pad = src_tokens.eq(self.model.pad_idx)
        index = (~src_pad).reshape(-1).nonzero().squeeze(1)
        packaged = None if self.packages is None else self.packages.encoder(src_tokens, src_pad, index)
        if packaged is not None:
            enc, k, v = packaged
        else:
            torch._dynamo.maybe_mark_dynamic(src_tokens, [0, 1])
            torch._dynamo.maybe_mark_dynamic(src_pad, [0, 1])
            torch._dynamo.maybe_mark_dynamic(index, 0)
            compiled = self._compiled_encoder if index.size(0) <= self.few_tokens else self._compiled_encoder_many
            enc, k, v = _frozen(compiled, src_tokens, src_pad, index)
        state.set_encoder_stack(self.cross_keys, k, v)
        return enc, src_pad

    def _encoder(self, src_tokens: torch.Tensor, src_pad: torch.Tensor,
                 index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        model, real = self.model, Unpadded(src_pad, index)
        x = real.unpad(model.embed_source(src_tokens))
        for layer in model.encoder_layers:
            x = layer(x, src_pad, real)
        if model.encoder_layer_norm is not None:
            x = model.encoder_layer_norm(x)
        return (real.pad(x), *self._encoder_stack(x, real))

    def _encoder_stack(self, x: torch.Tensor, real: Unpadded) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's encoder keys (L, b, H, Dh, S) and values (L, b, H, S, Dh) of the real
        encoder positions x (N, D), as one product; zero at padding (as cache_encoder_kv)."""
        (b, s), d = real.pad_mask.shape, x.size(1)
        kv = real.pad(self.encoder_kv(x)).view(b, s, len(self.layers), 2, self.heads, d // self.heads)
        return kv[:, :, :, 0].permute(2, 0, 3, 4, 1).contiguous(), kv[:, :, :, 1].permute(2, 0, 3, 1, 4).contiguous()

    def _cache_encoder(self, enc: torch.Tensor, src_pad: torch.Tensor,
                       state: IncrementalState) -> tuple[torch.Tensor, torch.Tensor]:
        """Where a batch did not begin with ``encode`` (eager: one product)."""
        real = Unpadded(src_pad)
        state.set_encoder_stack(self.cross_keys, *self._encoder_stack(real.unpad(enc), real))
        return state.encoder_stack(self.cross_keys)

    def _caches(self, state: IncrementalState, rows: int, encoder: tuple[torch.Tensor, torch.Tensor]) -> _Caches:
        """The caches kept in place where the search reorders them at every step (beam search): a
        reorder copies none."""
        if state.reorders_every_step and not state.in_place and state.length == 0:
            state.keep_in_place()
        caches = super()._caches(state, rows, encoder)
        if not state.in_place:
            return caches
        return caches._replace(origins=state.step_origins(rows, caches.encoder_keys.device))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, caches: _Caches) -> torch.Tensor:
        """Each row's query against its own positions, gathered from the buffer rows that hold them
        (``origins``; k, v are (P, H, n, Dh), every buffer row) by the kernels that multiply them:
        nothing is copied. One buffer row (one sentence, greedy) holds every position: the products
        of ``DecoderStep``, which inductor fuses for one row (~0.2 ms a step less on a base model)."""
        if caches.origins is None or k.size(0) == 1:
            return super()._attend(q, k, v, caches)
        rows, h, _, dh = q.shape
        n = k.size(2)
        at, positions = caches.origins[:, :n], torch.arange(n, device=q.device)
        k, v = k[at, :, positions], v[at, :, positions]  # (R, n, H, Dh)
        scores = (q.view(rows, 1, h, dh) * k).sum(-1) * self.query_scale  # (R, n, H)
        out = (scores.softmax(dim=1).unsqueeze(-1) * v).sum(1)  # (R, H, Dh)
        return out.view(rows, h * dh)

    def _layers(self, tokens: torch.Tensor, caches: _Caches, mask: Optional[torch.Tensor]) -> torch.Tensor:
        # Sizes that vary (rows, cached and source positions, sentences) are symbolic in the first
        # graph already, not constants that a later batch recompiles for (~0.3 us a tensor).
        # (R,) with unit stride: the searches pass a column of their (R, T) tokens, whose stride
        # would change at every step (a guard that fails, another graph).
        tokens = tokens.reshape(-1).clone(memory_format=torch.contiguous_format)
        if self.packages is not None:  # a package's sizes are symbolic already
            logits = self.packages.decoder(tokens, caches, mask)
            if logits is not None:
                return logits
        _symbolic(tokens, 0)
        _symbolic(mask, [0, 2])
        for t in (*caches.keys, *caches.values):
            _symbolic(t, [0, 2])
        _symbolic(caches.encoder_keys, [1, 4])
        _symbolic(caches.encoder_values, [1, 3])
        _symbolic(caches.origins, [0, 1])
        if tokens.size(0) <= self.few_rows:
            templates_first = tokens.size(0) <= self.template_rows
            return _frozen(self._compiled, tokens, *caches, mask, templates_first=templates_first)
        return _frozen(self._compiled_many, tokens, *caches, mask)

    def _decoder_of(self, tokens: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                    encoder_keys: torch.Tensor, encoder_values: torch.Tensor, length: int,
                    origins: Optional[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
        """``_decoder`` with the caches as arguments, which the graph's guards check: lists of
        tensors, an int and a tensor, not the IncrementalState's dictionaries."""
        return self._decoder(tokens, _Caches(keys, values, encoder_keys, encoder_values, length, origins), mask)


def _symbolic(t: Optional[torch.Tensor], dims) -> None:
    """``torch._dynamo.maybe_mark_dynamic(t, dims)`` where ``t`` is not marked yet: the caches, 15 of
    the 17 tensors a step passes, are the same from step to step, and marking takes ~0.9 us a
    tensor. (Where torch keeps the marks elsewhere, every call marks: the same graphs.)"""
    if t is not None and not hasattr(t, "_dynamo_weak_dynamic_indices"):
        torch._dynamo.maybe_mark_dynamic(t, dims)


def _stacked_encoder_kv(attentions: list[nn.Module], product: Optional[ProductFactory] = None) -> nn.Module:
    """One product for the encoder keys and values of every layer: (N, D) -> (N, L * 2 * D), layer
    by layer keys then values. The layers' own K and V weights become views of its weight; with
    ``product``, it and the layers' own are ``product(weight, bias)`` instead."""
    projections = [p for a in attentions for p in (a.k_proj, a.v_proj)]
    if not all(type(p) is nn.Linear and p.bias is not None for p in projections):
        raise _Unsupported("encoder keys and values not computed by Linear layers with a bias")
    d = projections[0].in_features
    fused = nn.Linear(d, len(projections) * d).requires_grad_(False)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in projections]))
        fused.bias.copy_(torch.cat([p.bias for p in projections]))
    if product is not None:
        for a in attentions:
            a.k_proj, a.v_proj = (product(p.weight, p.bias) for p in (a.k_proj, a.v_proj))
        return product(fused.weight, fused.bias)
    for i, p in enumerate(projections):
        p.weight = nn.Parameter(fused.weight[i * d:(i + 1) * d], requires_grad=False)
        p.bias = nn.Parameter(fused.bias[i * d:(i + 1) * d], requires_grad=False)
    return fused


def _own_code(method: Callable) -> Callable:
    """``method`` (or a function) with a code object of its own. torch.compile keeps a function's
    graphs, and the guards that choose among them, on its code object: one per instance here, so
    one step's graphs (its model's weights are constants in them) are never another's, without a
    guard that tells the instances apart."""
    f = getattr(method, "__func__", method)
    own = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    return own if f is method else types.MethodType(own, method.__self__)


def _argument_guards(entries: list) -> list[bool]:
    """torch.compile's guard filter for CompiledDecoderStep's graphs: only the guards on the
    arguments (shapes, strides, dtypes, the position count) and on global state are checked at each
    call. What the graphs read of ``self`` (its layers, their modules and norms) is fixed when the
    step is made, and the graphs belong to this instance alone (``_own_code``). A step of a base
    decoder kept ~50 of its ~300 guards (BENCHMARKS.md)."""
    return [not (e.name == "self" or e.name.startswith(("self.", "self["))) for e in entries]


def _frozen(compiled: Callable, *args, templates_first: bool = False):
    """``compiled(*args)`` with the settings of ``compile_settings`` while it runs (~10 us a call)."""
    with compile_settings(templates_first):
        return compiled(*args)


@contextlib.contextmanager
def compile_settings(templates_first: bool = False):
    """Settings that torch.compile (and torch.export with AOTInductor, packages.py) read when they
    trace and compile (so not from ``options``), set for the block and put back after for any other
    compiled code in the process: inductor's freezing (the weights become constants only then), no
    duck sizing (sizes that happen to be equal, 4 sentences and 4 heads, would be made one symbol,
    and another graph compiled when they differ), and with ``templates_first`` the generated product
    kernels chosen without a benchmark (``_templates_first``)."""
    global _TEMPLATES_FIRST
    inductor, shapes = torch._inductor.config, torch.fx.experimental._config
    before = inductor.freezing, shapes.use_duck_shape, _TEMPLATES_FIRST
    inductor.freezing, shapes.use_duck_shape, _TEMPLATES_FIRST = True, False, templates_first
    try:
        yield
    finally:
        inductor.freezing, shapes.use_duck_shape, _TEMPLATES_FIRST = before


_TEMPLATES_FIRST = False  # set by compile_settings while a graph that takes them may compile


def _templates_first(choices: list) -> list:
    """Inductor's candidates for one product, the library calls (ATen's) left out where a generated
    kernel is among them, while ``_TEMPLATES_FIRST``; with one candidate left inductor benchmarks
    nothing. Registered once per process with inductor's algorithm selection
    (``_register_templates_first``)."""
    if not _TEMPLATES_FIRST:
        return choices
    from torch._inductor.select_algorithm import ExternKernelCaller

    generated = [c for c in choices if not isinstance(c, ExternKernelCaller)]
    return generated or choices


def _register_templates_first() -> None:
    from torch._inductor.select_algorithm import get_algorithm_selector_cache

    selector = get_algorithm_selector_cache()
    if _templates_first not in selector.preprocessing_fns:
        selector.add_preprocessing_fn(_templates_first)


def compile_decoder_step(model: EncoderDecoder, product: Optional[ProductFactory] = None,
                         compiled_dir: Optional[str] = None) -> CompiledDecoderStep:
    """Give ``model`` a compiled decoder step, which ``decoder_step(model)`` returns from now on.
    ``product`` makes the stacked encoder keys' and values' product from the decoder's Linear layers
    (their weights, bias) where the model's other products are not Linear layers either (int8).
    ``compiled_dir``: the step's graphs are kept there as AOTInductor packages (packages.py), which
    later processes load instead of compiling. Raises ValueError for a model the flat step does not
    compute (see DecoderStep), and for a ``compiled_dir`` that is not safe to load code from."""
    try:
        if "decode" in vars(model):
            raise _Unsupported("not the model's own decode")
        step = CompiledDecoderStep(model, product)
    except _Unsupported as e:
        raise ValueError(f"a compiled decoder step cannot run this model: {e}") from None
    if compiled_dir is not None:
        from admin_ds.inference.packages import open_packages

        open_packages(step, compiled_dir)
    model.compiled_decoder_step = step
    return step


def compilation_seconds() -> float:
    """Seconds this process has spent compiling so far: in torch.compile, tracing to generated code
    (dynamo's ``_compile.compile_inner``, as ``torch._dynamo.utils.compile_times`` reports it; 0.0
    where this torch keeps no such record), and building graphs kept on disk (packages.py). Without
    those, a compiled step's start-up cost is paid again in every process: inductor keeps no graph
    on disk that holds oneDNN's packed weights (BENCHMARKS.md)."""
    packages = sys.modules.get("admin_ds.inference.packages")
    built = packages.build_seconds() if packages is not None else 0.0
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return built
    return built + float(sum(compilation_time_metrics.get("_compile.compile_inner", ())))


def decoder_step(model: nn.Module) -> Step:
    """The step function decoding runs: the model's compiled step if it has one
    (``compile_decoder_step``), a ``DecoderStep`` where it computes what ``model.decode`` does,
    else ``model.decode`` itself (the last position's logits)."""
    compiled = getattr(model, "compiled_decoder_step", None)
    if compiled is not None:
        return compiled
    try:
        if not isinstance(model, EncoderDecoder) or "decode" in vars(model):
            raise _Unsupported("not the model's own decode")
        return DecoderStep(model)
    except _Unsupported:
        return lambda tokens, enc, src_pad, state: model.decode(tokens, enc, src_pad, state)[:, -1]
