"""int8 CPU decoding (translate.py --int8): every linear layer of a model becomes an ``Int8Linear``.

Dynamic int8 quantization, as CTranslate2's int8 does it. Weights are int8 with one scale per
output row, fixed once; each product quantizes its input to uint8 with one scale and zero point
from the input's range, multiplies in int32 and rescales to float32. A decoder step streams a
quarter of the bytes, and VNNI/AMX CPUs multiply int8 several times faster than float32
(bench/decode.py). Output is no longer exact: the rounding changes logits by ~1% and may flip a
near-tie between hypotheses (tests/test_decode.py states the tolerance; BENCHMARKS.md the BLEU).

The rewrite is in place and makes the model inference-only (its Linear weights are no longer
parameters). float32 decoding needs no rewrite: the model decodes as it is.

This file imports torch and model.py only.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from admin_ds.model.layers import FeedForward
from admin_ds.model.transformer import EncoderDecoder

__all__ = ["Int8Linear", "quantize_for_decoding"]

# PyTorch's quantized engines for Int8Linear, each with or without 7-bit activations (PyTorch's
# reduce_range), in order of preference: oneDNN with full-range activations (its VNNI/AMX kernels
# are exact and the fastest at decoding's row counts: bench/decode.py), then the others. On a CPU
# without VNNI (AVX2 only: AMD EPYC before Zen 4, Intel before Cascade Lake) the u8 x s8 kernels
# add pairs of products in 16 bits, which full-range activations overflow: the first candidate
# that computes a product exactly enough (_int8_works) is used. With 7-bit activations, FBGEMM
# (the x86 engine) comes first: on an AMD EPYC without AVX-512 (Zen 1) its products of a base
# model's shapes took 0.24-0.69x oneDNN's time at 1-16 rows and 0.42-0.99x at 64-512 (oneDNN's were
# no faster than float32's there).
_INT8_CANDIDATES = (("onednn", False), ("x86", False), ("x86", True), ("onednn", True), ("fbgemm", True))
_ACTIVATIONS = {F.relu: "relu", F.gelu: "gelu"}  # FeedForward.activation -> Int8Linear's


@functools.lru_cache(maxsize=None)
def _int8_engine() -> Optional[tuple[str, bool]]:
    """(engine, reduce_range) for Int8Linear on this CPU and build; None: no int8 backend works."""
    engines = torch.backends.quantized.supported_engines
    return next(((engine, reduce) for engine, reduce in _INT8_CANDIDATES
                 if engine in engines and _int8_works(engine, reduce)), None)


def _int8_works(engine: str, reduce_range: bool) -> bool:
    """A random product and one built to overflow 16-bit pair sums (all activations at the top of
    the uint8 range, all weights 127: each pair adds to 64,770) against F.linear: a build where the
    quantized ops misbehave is refused instead of translating wrongly."""
    def make(w, b, activation="none"):
        return Int8Linear(w, b, activation, engine=engine, reduce_range=reduce_range)

    try:
        worst = make(torch.ones(8, 64), None)(torch.full((2, 64), 3.0))
        g = torch.Generator().manual_seed(0)
        w, b, x = (torch.randn(*shape, generator=g) for shape in ((96, 80), (96,), (5, 80)))
        # Loose for the random case: the input's int8 rounding alone moves these outputs (std ~9)
        # by up to ~0.3; the saturated case is off by thousands.
        return (torch.allclose(worst, torch.full_like(worst, 192.0), rtol=0.02)
                and torch.allclose(make(w, b, "relu")(x), F.relu(F.linear(x, w, b)), rtol=1e-4, atol=1.0))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


@contextlib.contextmanager
def _quantized_engine(engine: str) -> Iterator[None]:
    """The packed weight records the engine it was packed for and every later product dispatches
    on it, so the process-wide setting is only needed while packing, and is restored after."""
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = engine
    try:
        with warnings.catch_warnings():  # PyTorch's notice that quantized dtypes are deprecated
            warnings.simplefilter("ignore")
            yield
    finally:
        torch.backends.quantized.engine = before


class Int8Linear(nn.Module):
    """``activation(x @ weight.T + bias)`` in int8: weight rows quantized symmetrically (scale =
    max |row| / 127), the input quantized per call over its range (uint8, one scale per product).

    Inference only, CPU only, float32 in and out. ``activation`` "relu" runs after the product:
    oneDNN's fused ``linear_relu_dynamic`` returned wrong values in PyTorch 2.13.
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], activation: str = "none",
                 engine: Optional[str] = None, reduce_range: Optional[bool] = None) -> None:
        super().__init__()
        if activation not in ("none", "relu", "gelu"):
            raise ValueError(f"Int8Linear: unsupported activation {activation!r}")
        if engine is None:
            if (choice := _int8_engine()) is None:
                raise NotImplementedError("this PyTorch build has no working quantized CPU backend for int8 decoding")
            engine, reduce_range = choice
        self.out_features, self.in_features = weight.shape
        self.activation, self.engine = activation, engine
        # 7-bit activations where 16-bit pair sums could overflow (see _INT8_CANDIDATES).
        self._reduce_range = engine != "onednn" if reduce_range is None else reduce_range
        w = weight.detach().float().contiguous()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12).double()
        with _quantized_engine(engine):
            wq = torch.quantize_per_channel(w, scale, torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8)
            b = None if bias is None else bias.detach().float().contiguous()
            self._packed = torch.ops.quantized.linear_prepack(wq, b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.quantized.linear_dynamic(x.reshape(-1, self.in_features), self._packed, self._reduce_range)
        if self.activation == "relu":
            y = F.relu_(y)
        elif self.activation == "gelu":
            y = F.gelu(y)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"activation={self.activation}, engine={self.engine}, reduce_range={self._reduce_range}")


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def quantize_for_decoding(model: EncoderDecoder) -> EncoderDecoder:
    """Rewrite ``model`` (CPU, float32) in place for int8 decoding and return it, in eval mode:
    every Linear becomes an Int8Linear, the FFN's activation applied by its first product, each
    decoder self-attention gets one product for a step's Q, K and V (one wider product, not
    three), and a tied output projection gets its own quantized copy of the embedding matrix.
    Raises ValueError for a model elsewhere or in another dtype, NotImplementedError where this
    PyTorch build has no working quantized CPU backend."""
    model.eval()
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype != torch.float32:
        where = f"{param.device.type} {str(param.dtype).replace('torch.', '')}"
        raise ValueError(f"int8 decoding runs on the CPU from a float32 model, not {where}")
    if _int8_engine() is None:
        raise NotImplementedError("int8 decoding: this PyTorch build has no working quantized CPU backend")
    for layer in model.decoder_layers:
        attn = layer.self_attn
        projs = (attn.q_proj, attn.k_proj, attn.v_proj)
        attn.qkv_proj = Int8Linear(torch.cat([p.weight for p in projs]), torch.cat([p.bias for p in projs]))
    for module in list(model.modules()):
        if isinstance(module, FeedForward) and module.activation in _ACTIVATIONS and isinstance(module.fc1, nn.Linear):
            module.fc1 = Int8Linear(module.fc1.weight, module.fc1.bias, _ACTIVATIONS[module.activation])
            module.activation = _identity
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, Int8Linear(child.weight, child.bias))
    if model.output_proj is None:  # tied: the embedding matrix also projects
        model.output_proj = Int8Linear(model.target_embedding.weight, None)
    return model
