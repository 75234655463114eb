"""Inference-only rewrite of a model for fast decoding on CPU.

Decoding multiplies a handful of rows (the batch's hypotheses) by every weight matrix at every
step. At those shapes the matrix products dominate, and ``F.linear``'s default path reaches a
fraction of what the CPU can do (~27 GFLOP/s at 16 rows x 512 x 2048 on a 2-thread AVX-512 Xeon):
oneDNN, given the weight once in its blocked layout, runs the same product 3-4x faster at 16 rows
and 1.2-1.5x at 64 (bench/decode.py, BENCHMARKS.md). ``optimize_for_decoding`` does that once per
model: every ``nn.Linear`` (and the tied output projection) becomes a ``PackedLinear`` that holds
the reordered weight, with the FFN's ReLU/GELU fused into its first product.

The results are the same products in another summation order: logits agree with the plain model to
float32 rounding (~1e-6 relative; tests/test_decode.py checks them and the translations). The
rewrite is in place and makes the model inference-only (its Linear weights are no longer
parameters): use it for translation, not on a model that is still training.

Only float32 on a CPU with PyTorch's oneDNN backend is rewritten; anything else (a GPU, bf16, a
build without oneDNN) returns the model unchanged. ``ADMIN_DS_PACKED_LINEAR=0`` turns it off.

``precision="int8"`` (translate.py --int8) makes every linear layer an ``Int8Linear`` instead:
dynamic int8 quantization, as CTranslate2's int8 does it. Weights are int8 with one scale per
output row, fixed once; each product quantizes its input to uint8 with one scale and zero point
from the input's range, multiplies in int32 and rescales to float32. A decoder step streams a
quarter of the bytes, and VNNI/AMX CPUs multiply int8 several times faster than float32
(bench/decode.py). Output is no longer exact: the rounding changes logits by ~1% and may flip a
near-tie between hypotheses (tests/test_decode.py states the tolerance; BENCHMARKS.md the BLEU).

This file imports torch and model.py only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from admin_ds.model.layers import FeedForward
from admin_ds.model.transformer import EncoderDecoder

log = logging.getLogger(__name__)

# oneDNN's weight layout is chosen for a typical row count; any other count is still exact
# (measured: the hint barely matters between 16 and 1024 rows).
_ROWS_HINT = 64
_FUSED = {F.relu: ("relu", ""), F.gelu: ("gelu", "none")}  # activation -> (oneDNN post-op, algorithm)


def packed_linear_available() -> bool:
    """True when this PyTorch build can run oneDNN linear products on packed weights."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """``activation(x @ weight.T + bias)`` with ``weight`` stored in oneDNN's blocked layout.

    Inference only: the packed weight is a constant (no gradient, not in ``state_dict``).
    ``activation`` is "none", "relu" or "gelu" (exact), fused into the product.
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], activation: str = "none") -> None:
        super().__init__()
        if activation not in ("none", "relu", "gelu"):
            raise ValueError(f"PackedLinear: unsupported activation {activation!r}")
        self.out_features, self.in_features = weight.shape
        self.activation = activation
        self._algorithm = "none" if activation == "gelu" else ""
        with torch.no_grad():
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach().float().contiguous(),
                                                                         _ROWS_HINT)
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.packed_weight,
                                               self.bias, self.activation, [], self._algorithm)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, activation={self.activation}"


def _int8_engine() -> Optional[str]:
    """PyTorch's quantized backend for Int8Linear: oneDNN where built in (AMX/VNNI kernels, the
    fastest at decoding's row counts: bench/decode.py), else x86/FBGEMM; None: no int8 backend."""
    engines = torch.backends.quantized.supported_engines
    return next((e for e in ("onednn", "x86", "fbgemm") if e in engines), None)


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
                 engine: Optional[str] = None) -> None:
        super().__init__()
        if activation not in ("none", "relu", "gelu"):
            raise ValueError(f"Int8Linear: unsupported activation {activation!r}")
        engine = engine or _int8_engine()
        if engine is None:
            raise NotImplementedError("this PyTorch build has no quantized CPU backend for int8 decoding")
        self.out_features, self.in_features = weight.shape
        self.activation, self.engine = activation, engine
        # FBGEMM without VNNI can saturate 16-bit sums of products of full-range uint8 and int8:
        # it wants activations in 7 bits (PyTorch's reduce_range); oneDNN does not.
        self._reduce_range = engine != "onednn"
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
                f"activation={self.activation}, engine={self.engine}")


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _computes_linear(make, atol: float) -> bool:
    """One product through ``make`` (a PackedLinear or Int8Linear factory) against F.linear: a
    build where the private oneDNN or quantized ops misbehave falls back (fp32) or refuses (int8)
    instead of translating wrongly."""
    try:
        g = torch.Generator().manual_seed(0)
        w, b, x = (torch.randn(*shape, generator=g) for shape in ((96, 80), (96,), (5, 80)))
        got = make(w, b, "relu")(x)
        return torch.allclose(got, F.relu(F.linear(x, w, b)), rtol=1e-4, atol=atol)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


PRECISIONS = ("fp32", "int8")


def optimize_for_decoding(model: EncoderDecoder, precision: str = "fp32") -> EncoderDecoder:
    """Rewrite ``model`` in place for decoding and return it (in eval mode).

    CPU and float32: every Linear becomes a PackedLinear (``precision="fp32"``) or an Int8Linear
    (``"int8"``), FFN activations fused into the first product, each decoder self-attention gets
    one product for a step's Q, K and V, and a tied output projection gets its own copy of the
    embedding matrix. fp32 elsewhere (a GPU, bf16): unchanged; int8 elsewhere: refused.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"unknown decoding precision {precision!r}; use one of {', '.join(PRECISIONS)}")
    model.eval()
    param = next(model.parameters())
    cpu_fp32 = param.device.type == "cpu" and param.dtype == torch.float32
    if precision == "int8":
        if not cpu_fp32:
            raise ValueError(f"int8 decoding runs on the CPU from a float32 model, not {param.device.type} "
                             f"{str(param.dtype).replace('torch.', '')}")
        # Loose: the input's int8 rounding alone moves these outputs (std ~9) by up to ~0.3.
        if _int8_engine() is None or not _computes_linear(Int8Linear, atol=1.0):
            raise NotImplementedError("int8 decoding: this PyTorch build has no working quantized CPU backend")
        make = Int8Linear
    else:
        if not cpu_fp32 or os.environ.get("ADMIN_DS_PACKED_LINEAR", "1") == "0":
            return model
        if not packed_linear_available() or not _computes_linear(PackedLinear, atol=1e-5):
            log.warning("oneDNN packed linear products unavailable in this PyTorch build; decoding with F.linear")
            return model
        make = PackedLinear
    for layer in model.decoder_layers:  # a step's Q, K and V in one product: one wider GEMM, not three
        attn = layer.self_attn
        projs = (attn.q_proj, attn.k_proj, attn.v_proj)
        attn.qkv_proj = make(torch.cat([p.weight for p in projs]), torch.cat([p.bias for p in projs]))
    for module in list(model.modules()):
        if isinstance(module, FeedForward) and module.activation in _FUSED and isinstance(module.fc1, nn.Linear):
            module.fc1 = make(module.fc1.weight, module.fc1.bias, _FUSED[module.activation][0])
            module.activation = _identity
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, make(child.weight, child.bias))
    if model.output_proj is None:  # tied: the embedding matrix also projects to the vocabulary
        model.output_proj = make(model.target_embedding.weight, None)
    return model
