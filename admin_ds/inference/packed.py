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

This file imports torch and model.py only.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

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


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _packs_correctly() -> bool:
    """One product through the packed path against F.linear: a build where the private oneDNN ops
    misbehave falls back to the plain model instead of translating wrongly."""
    try:
        g = torch.Generator().manual_seed(0)
        w, b, x = (torch.randn(*shape, generator=g) for shape in ((96, 80), (96,), (5, 80)))
        got = PackedLinear(w, b, "relu")(x)
        return torch.allclose(got, F.relu(F.linear(x, w, b)), rtol=1e-4, atol=1e-5)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def optimize_for_decoding(model: EncoderDecoder) -> EncoderDecoder:
    """Rewrite ``model`` in place for decoding and return it (in eval mode).

    CPU and float32: every Linear becomes a PackedLinear (FFN activations fused), each decoder
    self-attention gets one product for a step's Q, K and V, and a tied output projection gets its
    own packed copy of the embedding matrix. Otherwise: unchanged.
    """
    model.eval()
    param = next(model.parameters())
    if (param.device.type != "cpu" or param.dtype != torch.float32
            or os.environ.get("ADMIN_DS_PACKED_LINEAR", "1") == "0"):
        return model
    if not packed_linear_available() or not _packs_correctly():
        log.warning("oneDNN packed linear products unavailable in this PyTorch build; decoding with F.linear")
        return model
    for layer in model.decoder_layers:  # a step's Q, K and V in one product: one wider GEMM, not three
        attn = layer.self_attn
        projs = (attn.q_proj, attn.k_proj, attn.v_proj)
        attn.qkv_proj = PackedLinear(torch.cat([p.weight for p in projs]), torch.cat([p.bias for p in projs]))
    for module in list(model.modules()):
        if isinstance(module, FeedForward) and module.activation in _FUSED and isinstance(module.fc1, nn.Linear):
            module.fc1 = PackedLinear(module.fc1.weight, module.fc1.bias, _FUSED[module.activation][0])
            module.activation = _identity
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, PackedLinear(child.weight, child.bias))
    if model.output_proj is None:  # tied: the embedding matrix also projects to the vocabulary
        model.output_proj = PackedLinear(model.target_embedding.weight, None)
    return model
