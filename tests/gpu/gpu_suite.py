"""What the GPU suite's tests share (tests/gpu/test_gpu_*.py).

    python -m pytest tests/gpu -m gpu            # on a machine with a CUDA device
    bash bench/device_kit.sh run KIT OUT         # the same, with the benchmark, in one call

Every test carries the ``gpu`` marker and is skipped, with the reason, where torch sees no CUDA
device (CI and CPU machines). Runs use one GPU: one rank on NCCL, started as the CPU tests start
theirs (tests/distributed.py ``spawn``, ``accelerator="cuda"``), on the same small generated corpus
(tests/conftest.py ``data_dir``).
"""

from __future__ import annotations

import json

import pytest
import torch

from distributed import REPO

GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                           reason="no CUDA device: the GPU suite runs where torch sees one "
                                                  "(bench/device_kit.sh run)")]

# The shipped engine configs' precision blocks (ds_configs/zero2_bf16.json, zero2_fp16.json: the
# paper's fp16 recipe), at any ZeRO stage.
PRECISION = {"fp32": {},
             "bf16": json.loads((REPO / "ds_configs/zero2_bf16.json").read_text())["bf16"],
             "fp16": json.loads((REPO / "ds_configs/zero2_fp16.json").read_text())["fp16"]}


def engine_config(stage: int, precision: str, **extra) -> dict:
    ds = {"zero_optimization": {"stage": stage}, "gradient_accumulation_steps": 1, **extra}
    if precision != "fp32":
        ds[precision] = dict(PRECISION[precision])
    return ds


def rel(a, b) -> float:
    """Largest relative difference of two equal-length sequences of numbers."""
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))
