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

A decoder step's products (a few rows each) are packed for MKL's packed GEMM instead on Intel
CPUs with PyTorch's MKL: faster than oneDNN's packed path at 2-64 rows (bench/decode_rows.py), about
level at several hundred. The encoder's (many rows) stay with oneDNN.

Only float32 on a CPU with PyTorch's oneDNN backend is rewritten; anything else (a GPU, bf16, a
build without oneDNN) returns the model unchanged. ``ADMIN_DS_PACKED_LINEAR``: ``0`` turns the
rewrite off; ``onednn`` packs every product for oneDNN; ``mkl`` packs a step's products for MKL on
any CPU (the default does so on Intel only: on an AMD EPYC it was slower than oneDNN's).

``precision="int8"`` (translate.py --int8) makes every linear layer an ``Int8Linear`` instead:
dynamic int8 quantization, as CTranslate2's int8 does it. Weights are int8 with one scale per
output row, fixed once; each product quantizes its input to uint8 with one scale and zero point
from the input's range, multiplies in int32 and rescales to float32. A decoder step streams a
quarter of the bytes, and VNNI/AMX CPUs multiply int8 several times faster than float32
(bench/decode.py). Output is no longer exact: the rounding changes logits by ~1% and may flip a
near-tie between hypotheses (tests/test_decode.py states the tolerance; BENCHMARKS.md the BLEU).
With a compiled step (translate.py --int8 --compile) the graphs call the same products
(``_int8_linear``) and compile the operators between them.

This file imports torch, model.py and step.py only.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import platform
import warnings
import weakref
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from admin_ds.inference.step import compile_decoder_step
from admin_ds.model.layers import FeedForward
from admin_ds.model.transformer import EncoderDecoder

log = logging.getLogger(__name__)

# oneDNN's weight layout is chosen for a typical row count; any other count is still exact
# (measured: the hint barely matters between 16 and 1024 rows).
_ROWS_HINT = 64
# MKL packs for a row count too, and its speed depends on it: 128 was the best measured compromise
# between a step's 16-64 rows and the several hundred of a first step over a whole file's batch (the
# product is exact for any row count: _mkl_packed_works checks 2 to 130 rows).
_MKL_ROWS_HINT = 128
# PackedLinear(few_rows=True) on oneDNN multiplies up to _FEW_ROWS rows by a weight of at most
# _SMALL_WEIGHT bytes with F.linear (MKL), and a single row by any weight; more rows go to oneDNN.
# On AMD CPUs with AVX-512 (Zen 4), where F.linear's matrix-vector product is 2-5x slower than
# oneDNN's packed one, only weights of at most _AMD_SMALL_WEIGHT bytes take F.linear (up to _FEW_ROWS
# rows); on AMD CPUs without it (Zen 1), a single row by a weight of at most _SMALL_WEIGHT bytes too.
# On MKL's packed GEMM only a single row takes F.linear. (_plain_rows; the measurements: PackedLinear's
# docstring.)
_FEW_ROWS = 8
_SMALL_WEIGHT = 1 << 20
_AMD_SMALL_WEIGHT = 1 << 18
_FUSED = {F.relu: ("relu", ""), F.gelu: ("gelu", "none")}  # activation -> (oneDNN post-op, algorithm)


def packed_linear_available() -> bool:
    """True when this PyTorch build can run oneDNN linear products on packed weights."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


@functools.lru_cache(maxsize=None)
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo ({} where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def _cpu_vendor() -> str:
    return _cpuinfo().get("vendor_id") or platform.processor()


def _cpu_has_avx512() -> bool:
    return "avx512f" in _cpuinfo().get("flags", "").split()


def _amd_without_avx512() -> bool:
    """An AMD CPU before Zen 4 (AVX2 at most), where oneDNN has no wider instructions than MKL."""
    return "amd" in _cpu_vendor().lower() and not _cpu_has_avx512()


_CHOICES = ("", "0", "1", "onednn", "mkl")


def _packed_choice() -> str:
    """ADMIN_DS_PACKED_LINEAR, checked: "" / "1" (the default), "0", "onednn" or "mkl"."""
    choice = os.environ.get("ADMIN_DS_PACKED_LINEAR", "").strip().lower()
    if choice not in _CHOICES:
        raise ValueError(f"ADMIN_DS_PACKED_LINEAR={choice!r}: use 0 (off), 1 (the default), onednn or mkl")
    return choice


def _step_backend() -> str:
    """Where PackedLinear(few_rows=True) packs its weight: "mkl" (MKL's packed GEMM) or "onednn".

    MKL where ADMIN_DS_PACKED_LINEAR=mkl, or by default on an Intel CPU, when this PyTorch build
    has MKL's packed ops and they compute a product right at several row counts; else oneDNN."""
    choice = _packed_choice()
    if choice == "onednn" or (choice != "mkl" and "intel" not in _cpu_vendor().lower()):
        return "onednn"
    if _mkl_packed_works():
        return "mkl"
    if choice == "mkl":
        log.warning("ADMIN_DS_PACKED_LINEAR=mkl: this PyTorch build has no working MKL packed GEMM; using oneDNN")
    return "onednn"


def _plain_rows(weight_bytes: int, backend: str) -> int:
    """Up to how many rows PackedLinear(few_rows=True) multiplies by its plain weight (F.linear)
    rather than by the packed one: the measured rule of PackedLinear's docstring."""
    if backend == "mkl":
        return 1
    if "amd" in _cpu_vendor().lower():
        if weight_bytes <= _AMD_SMALL_WEIGHT:
            return _FEW_ROWS
        return 1 if weight_bytes <= _SMALL_WEIGHT and _amd_without_avx512() else 0
    return _FEW_ROWS if weight_bytes <= _SMALL_WEIGHT else 1


def _transposed_one_row(shape: tuple[int, int], backend: str) -> bool:
    """Whether PackedLinear(few_rows=True) multiplies one row by a copy of its weight stored
    transposed, (in, out) contiguous, rather than by the weight itself: on AMD CPUs without
    AVX-512, for weights of at most _SMALL_WEIGHT bytes with more outputs than inputs (a 256-wide
    model's Q/K/V and FFN input products). MKL's product of one row reads such a weight along its
    outputs ~1.5x as fast as along its inputs there (PackedLinear's docstring)."""
    out_features, in_features = shape
    return (backend == "onednn" and out_features > in_features and out_features * in_features * 4 <= _SMALL_WEIGHT
            and _amd_without_avx512())


def mkl_packed_available() -> bool:
    """True when this PyTorch build has MKL's packed GEMM ops (x86 builds; not ARM's)."""
    return (torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")
            and hasattr(torch.ops.mkl, "_mkl_linear"))


@functools.lru_cache(maxsize=None)
def _mkl_packed_works() -> bool:
    """MKL's packed GEMM is available and PackedLinear computes F.linear's result with it."""
    if not mkl_packed_available():
        return False
    make = functools.partial(PackedLinear, few_rows=True, backend="mkl")
    return all(_computes_linear(make, atol=1e-5, rows=n) for n in (2, 5, 64, 130))


class PackedLinear(nn.Module):
    """``activation(x @ weight.T + bias)`` with ``weight`` stored in a blocked layout that a
    matrix-product library reads fast: oneDNN's, or, for a decoder step's products on Intel CPUs,
    MKL's packed GEMM (``backend``; default: ``_step_backend()`` for few_rows, oneDNN otherwise).

    Inference only: the packed weight is a constant (no gradient, not in ``state_dict``).
    ``activation`` is "none", "relu" or "gelu" (exact): fused into oneDNN's product, applied in
    place after MKL's.

    ``few_rows``: also keep the weight as it is, for products of few rows (a decoder step of one
    or a few hypotheses), which ``F.linear`` runs faster than oneDNN's packed path on Intel CPUs:
    that path has ~15-20 us of fixed cost per call and streams a weight slower there. On oneDNN,
    ``F.linear`` is used for one row, and for up to ``_FEW_ROWS`` rows when the weight is at most
    ``_SMALL_WEIGHT`` bytes (a 256- or 512-wide model's attention products, a 256-wide one's FFN);
    on MKL for one row only. On AMD CPUs the reverse holds: ``F.linear``'s matrix-vector product
    (MKL's, on a CPU it does not tune for) is the slow one, and only weights of at most
    ``_AMD_SMALL_WEIGHT`` bytes (a 256-wide model's attention outputs) take it, for up to
    ``_FEW_ROWS`` rows; on an AMD CPU without AVX-512, where oneDNN has no wider instructions than
    MKL, one row by a weight of at most ``_SMALL_WEIGHT`` bytes takes it too. Costs a second copy
    of those weights (MKL's product also takes it, for its shape).

    Measured (bench/decode_rows.py, bench/decode_rows_results.md: packed time / F.linear time, above
    1 where F.linear is faster; six copies of each weight so that none stays in cache, 2 threads),
    on the AVX-512 Xeon and, in brackets, limited to AVX2. oneDNN: one row 1.14-3.50 (1.40-3.61)
    for every shape; weights of at most 1 MiB at 8 rows 1.28-2.18 (1.08-1.64), at 16 rows
    0.74-1.72; larger weights at 2 rows 1.20-1.46 (0.84-1.12), at 4 rows 0.73-1.00 (0.92-1.13).
    MKL's packed GEMM: at 2-64 rows 0.94-2.69x the speed of oneDNN's (1.02-2.41x under AVX2),
    against F.linear 0.55-1.32 (0.66-1.01); one row 0.94-1.52 (1.06-1.57): F.linear keeps it.
    On a 2-core AMD EPYC (Zen 4, AVX-512), oneDNN: one row 0.27-0.88 for weights over 256 KiB
    (1.18 for (256, 1024)), 2-64 rows 0.17-0.84; the (256, 256) weight 1.33-2.25 at 1-8 rows.
    MKL's packed GEMM there: 0.51-2.42 at 1-2 rows, 0.82-1.24 from 4 rows: slower than oneDNN's
    for every weight over 256 KiB but (768, 256) at one row, so oneDNN stays the default there.
    On a 2-core AMD EPYC without AVX-512 (Zen 1, AVX2), oneDNN: one row 1.39-3.65 for weights of
    at most 1 MiB, 0.71-1.09 for larger ones; 2 rows 0.90-2.44 and 0.43-0.73; from 4 rows
    0.27-0.96 but the (256, 256) weight (1.25-1.82). There, one row by the weight stored
    transposed (``x @ W^T`` with W^T contiguous: MKL reads the weight along its outputs) takes
    0.52-0.80x F.linear's time for the (768, 256) and (1024, 256) weights, about the same for
    square weights and 1.08-1.54x for those with fewer outputs than inputs (bench/decode_rows.py's
    last table). For larger weights with more outputs than inputs it is about as fast as oneDNN's
    packed path, ahead or behind depending on how many copies the measurement cycles through: the
    weights of at most 1 MiB with more outputs than inputs take it for one row
    (``_transposed_one_row``).
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], activation: str = "none",
                 few_rows: bool = False, backend: Optional[str] = None) -> None:
        super().__init__()
        if activation not in ("none", "relu", "gelu"):
            raise ValueError(f"PackedLinear: unsupported activation {activation!r}")
        backend = backend or (_step_backend() if few_rows else "onednn")
        if backend not in ("onednn", "mkl"):
            raise ValueError(f"PackedLinear: unknown backend {backend!r}")
        self.out_features, self.in_features = weight.shape
        self.activation, self.backend = activation, backend
        self._algorithm = "none" if activation == "gelu" else ""
        with torch.no_grad():
            w = weight.detach().float().contiguous()
            if backend == "mkl":
                self.packed_weight = torch.ops.mkl._mkl_reorder_linear_weight(w, _MKL_ROWS_HINT)
            else:
                self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(w, _ROWS_HINT)
        # Up to this many rows go through F.linear (0: none); one row, where weight_t is kept,
        # through a product with the weight stored transposed.
        self.plain_rows = _plain_rows(w.numel() * 4, backend) if few_rows else 0
        self.weight_t = w.t().contiguous() if few_rows and _transposed_one_row(w.shape, backend) else None
        self.weight = w if self.plain_rows > (self.weight_t is not None) or backend == "mkl" else None
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        rows = x2.shape[0]
        if rows == 1 and self.weight_t is not None:
            y = self._activate(x2 @ self.weight_t if self.bias is None else torch.addmm(self.bias, x2, self.weight_t))
        elif 0 < rows <= self.plain_rows:
            y = self._activate(F.linear(x2, self.weight, self.bias))
        elif self.backend == "mkl":  # the packed product runs when its last argument is the row count
            y = self._activate(torch.ops.mkl._mkl_linear(x2, self.packed_weight, self.weight, self.bias, rows))
        else:  # the activation fused
            y = torch.ops.mkldnn._linear_pointwise(x2, self.packed_weight, self.bias, self.activation, [],
                                                   self._algorithm)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def _activate(self, y: torch.Tensor) -> torch.Tensor:
        if self.activation == "relu":
            return F.relu_(y)
        return F.gelu(y) if self.activation == "gelu" else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, activation={self.activation}, "
                f"backend={self.backend}")


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


@functools.lru_cache(maxsize=None)
def _int8_engine() -> Optional[tuple[str, bool]]:
    """(engine, reduce_range) for Int8Linear on this CPU and build; None: no int8 backend works."""
    engines = torch.backends.quantized.supported_engines
    return next(((engine, reduce) for engine, reduce in _INT8_CANDIDATES
                 if engine in engines and _int8_works(engine, reduce)), None)


def _int8_works(engine: str, reduce_range: bool) -> bool:
    """A random product and one built to overflow 16-bit pair sums (all activations at the top of
    the uint8 range, all weights 127: each pair adds to 64,770) against F.linear."""
    def make(w, b, activation):
        return Int8Linear(w, b, activation, engine=engine, reduce_range=reduce_range)

    try:
        worst = make(torch.ones(8, 64), None, "none")(torch.full((2, 64), 3.0))
        # Loose for the random case: the input's int8 rounding alone moves these outputs (std ~9)
        # by up to ~0.3; the saturated case is off by thousands.
        return torch.allclose(worst, torch.full_like(worst, 192.0), rtol=0.02) and _computes_linear(make, atol=1.0)
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


# Int8Linear's product as an operator that torch.compile keeps in a graph as it is (a compiled int8
# step: translate.py --int8 --compile). The packed weight is an object torch.compile cannot trace,
# so it stays outside the graph, which names it by a number (Int8Linear._key).
_INT8_WEIGHTS: dict[int, torch.ScriptObject] = {}
_int8_keys = itertools.count()


@torch.library.custom_op("admin_ds::int8_linear", mutates_args=())
def _int8_linear(x: torch.Tensor, key: int, out_features: int, reduce_range: bool) -> torch.Tensor:
    return torch.ops.quantized.linear_dynamic(x, _INT8_WEIGHTS[key], reduce_range)


@_int8_linear.register_fake
def _(x: torch.Tensor, key: int, out_features: int, reduce_range: bool) -> torch.Tensor:
    return x.new_empty(x.size(0), out_features)


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
        self._register()

    def _register(self) -> None:
        """The packed weight under a key of this module's own, for compiled graphs; dropped with it."""
        self._key = next(_int8_keys)
        _INT8_WEIGHTS[self._key] = self._packed
        weakref.finalize(self, _INT8_WEIGHTS.pop, self._key, None)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._register()  # a copy (copy.deepcopy, pickle) has a packed weight of its own

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if torch.compiler.is_compiling():
            y = _int8_linear(rows, self._key, self.out_features, self._reduce_range)
        else:
            y = torch.ops.quantized.linear_dynamic(rows, self._packed, self._reduce_range)
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


def _computes_linear(make, atol: float, rows: int = 5) -> bool:
    """One product of ``rows`` rows through ``make`` (a PackedLinear or Int8Linear factory) against
    F.linear: a build where the private oneDNN, MKL or quantized ops misbehave falls back (fp32)
    or refuses (int8) instead of translating wrongly."""
    try:
        g = torch.Generator().manual_seed(0)
        w, b, x = (torch.randn(*shape, generator=g) for shape in ((96, 80), (96,), (rows, 80)))
        got = make(w, b, "relu")(x)
        return torch.allclose(got, F.relu(F.linear(x, w, b)), rtol=1e-4, atol=atol)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


PRECISIONS = ("fp32", "int8")


def optimize_for_decoding(model: EncoderDecoder, precision: str = "fp32", compile_step: bool = False,
                          compiled_dir: Optional[str] = None) -> EncoderDecoder:
    """Rewrite ``model`` in place for decoding and return it (in eval mode).

    CPU and float32: every Linear becomes a PackedLinear (``precision="fp32"``; a decoder step's
    products packed for ``_step_backend()``, the others for oneDNN) or an Int8Linear (``"int8"``),
    FFN activations fused into the first product, each decoder self-attention gets one product for
    a step's Q, K and V, and a tied output projection gets its own copy of the embedding matrix.
    fp32 elsewhere (a GPU, bf16): unchanged; int8 elsewhere: refused.

    ``compile_step`` (CPU, from float32; translate.py --compile): the model gets a compiled decoder
    step and encoder (step.compile_decoder_step). In fp32 every product stays a Linear layer (a
    step's Q, K and V in one), for which they generate their own kernels; in int8 every product is
    an Int8Linear, which they call as it is, and the operators between the products are compiled.
    ``compiled_dir`` (fp32, with ``compile_step``; translate.py --compiled-dir): the compiled graphs
    are kept there and loaded by later processes (packages.py).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"unknown decoding precision {precision!r}; use one of {', '.join(PRECISIONS)}")
    model.eval()
    param = next(model.parameters())
    cpu_fp32 = param.device.type == "cpu" and param.dtype == torch.float32
    where = f"{param.device.type} {str(param.dtype).replace('torch.', '')}"
    if compile_step and not cpu_fp32:
        raise ValueError(f"a compiled decoder step decodes on the CPU from a float32 model, not {where}")
    if compiled_dir is not None and (not compile_step or precision != "fp32"):
        raise ValueError("compiled graphs are kept on disk for a compiled fp32 step only "
                         "(inductor's own cache keeps the int8 graphs)")
    if precision == "int8":
        if not cpu_fp32:
            raise ValueError(f"int8 decoding runs on the CPU from a float32 model, not {where}")
        if _int8_engine() is None:
            raise NotImplementedError("int8 decoding: this PyTorch build has no working quantized CPU backend")
        make = Int8Linear
    elif compile_step:
        make = None
    else:
        if not cpu_fp32 or not _packing_works():
            return model
        make = PackedLinear
    if compile_step:  # the weights must not require gradients to be compiled in as constants
        _pack(model.requires_grad_(False), make, compile_step=True)
        compile_decoder_step(model, product=make, compiled_dir=compiled_dir)
        return model
    return _pack(model, make)


def _packing_works() -> bool:
    """PackedLinear is on (ADMIN_DS_PACKED_LINEAR) and computes F.linear's products in this build."""
    if _packed_choice() == "0":
        return False
    if not packed_linear_available() or not _computes_linear(PackedLinear, atol=1e-5):
        log.warning("oneDNN packed linear products unavailable in this PyTorch build; decoding with F.linear")
        return False
    return True


def _pack(model: EncoderDecoder, make, compile_step: bool = False) -> EncoderDecoder:
    """optimize_for_decoding's rewrite with ``make`` (PackedLinear, Int8Linear, or None: no Linear
    replaced, a step's Q, K and V made one Linear); ``compile_step``: the decoder's encoder keys and
    values stay Linear layers, which the compiled step stacks into one product."""
    # The products of a decoder step, which run on one or a few rows when few hypotheses are decoded.
    step = {id(m) for layer in model.decoder_layers
            for m in (layer.self_attn.out_proj, layer.encoder_attn.q_proj, layer.encoder_attn.out_proj,
                      layer.ffn.fc1, layer.ffn.fc2)} | {id(model.output_proj)}

    step_backend = _step_backend() if make is PackedLinear else None

    def convert(weight: torch.Tensor, bias, activation: str = "none", few_rows: bool = False) -> nn.Module:
        if make is None:
            return _linear(weight, bias)
        if make is PackedLinear:
            return PackedLinear(weight, bias, activation, few_rows=few_rows,
                                backend=step_backend if few_rows else "onednn")
        return make(weight, bias, activation)

    for layer in model.decoder_layers:  # a step's Q, K and V in one product: one wider GEMM, not three
        attn = layer.self_attn
        projs = (attn.q_proj, attn.k_proj, attn.v_proj)
        attn.qkv_proj = convert(torch.cat([p.weight for p in projs]), torch.cat([p.bias for p in projs]),
                                few_rows=True)
        step.add(id(attn.qkv_proj))

    stacked = {id(p) for layer in model.decoder_layers for p in (layer.encoder_attn.k_proj, layer.encoder_attn.v_proj)
               } if compile_step else set()

    def replaced(linear: nn.Module) -> bool:
        return isinstance(linear, nn.Linear) and make is not None and id(linear) not in stacked

    for module in list(model.modules()):
        if isinstance(module, FeedForward) and module.activation in _FUSED and replaced(module.fc1):
            module.fc1 = convert(module.fc1.weight, module.fc1.bias, _FUSED[module.activation][0],
                                 few_rows=id(module.fc1) in step)
            module.activation = _identity
        for name, child in list(module.named_children()):
            if replaced(child):
                setattr(module, name, convert(child.weight, child.bias, few_rows=id(child) in step))
    if model.output_proj is None and make is not None:  # tied: the embedding matrix also projects
        model.output_proj = convert(model.target_embedding.weight, None, few_rows=True)
    return model


def _linear(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> nn.Linear:
    """An nn.Linear holding ``weight`` and ``bias`` (inference: no gradient)."""
    linear = nn.Linear(weight.size(1), weight.size(0), bias=bias is not None)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)
    return linear.requires_grad_(False)
