"""DeepSpeed, applied from outside: where engines are built and their internals touched.

It turns a plain ``nn.Module`` (or a pipeline stage's module, pipeline.py) and our run config plus
a DeepSpeed JSON into an engine, and owns the few operations that must know DeepSpeed's internals:

* ``resolve_ds_config`` -- the JSON says how to run (ZeRO stage, precision, accumulation), our
  config says what to train (optimizer, schedule, clipping, tokens per micro-batch). A value set in
  both places, an unresolved "auto", or a batch triplet that does not multiply out is refused
  before any work, naming the field.
* ``write_omega`` -- the one writer of omega into an engine. Omega written after
  ``deepspeed.initialize`` must reach every copy: the module's (possibly bf16) tensor, and the
  optimizer's fp32 master copy. Writing only the module tensor is silently undone at the first
  step, when ZeRO copies the masters back (docs/design.md, decision 3; docs/deepspeed.md).
* reading parameters back, and the consolidated state dict (ZeRO-3 keeps only partitions).

Elsewhere DeepSpeed is used only where its own piece is the point: ``init_distributed`` in
distributed.py, ``PipelineModule`` in pipeline.py, the universal converter in checkpoints.py and
the ZeRO checkpoint readers in admin_ds/inference/model_file.py.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
from typing import Callable, Optional

import torch
import torch.distributed as dist

import deepspeed
from deepspeed.accelerator import get_accelerator

from admin_ds.distributed import init, rank
from admin_ds.errors import ConfigError

# Keys of the DeepSpeed JSON that belong to the run config: refusing them keeps one owner per value.
_OWNED_BY_RUN_CONFIG = {
    "optimizer": "optim.optimizer / optim.lr / optim.betas",
    "scheduler": "optim.warmup_updates / optim.lr",
    "gradient_clipping": "optim.clip_norm",
}


# ------------------------------------------------------------------------------------------------
# Distributed start-up
# ------------------------------------------------------------------------------------------------


def on_cpu() -> bool:
    return get_accelerator().device_name() == "cpu"


def device() -> torch.device:
    if on_cpu():
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", 0))
    get_accelerator().set_device(local)
    return torch.device(get_accelerator().device_name(local))


def heap_trimmer(precision: str) -> Callable[[], object]:
    """What returns the C heap's free pages to the OS after an update: glibc's ``malloc_trim(0)``
    for a bf16 or fp16 run on a CPU, nothing otherwise.

    Each update's activations are sized by its batch, and oneDNN's low-precision kernels (AMX)
    allocate working memory by shape; glibc serves such blocks from its heap, which fragments and
    keeps what a run frees. A bf16 run of the Multi30k recipe on the 2-core Xeon grew from 2.2 to
    7.3 GB over 1,000 updates; trimming after each update kept the peak of 60 updates at 2.6 GB
    (3.9 without) for 18% of its speed (bf16 still trains at 1.6-2x fp32's speed; BENCHMARKS.md).
    fp32 runs do not grow so and are left alone. ``MALLOC_TRIM_THRESHOLD_`` or
    ``MALLOC_MMAP_THRESHOLD_`` also bound the heap, at a third of the speed. Faster still is to
    preload tcmalloc, which neither fragments nor hands pages back (docs/training.md); the trim
    then finds glibc's heap unused."""
    if on_cpu() and precision in ("bf16", "fp16"):
        trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc only
        if trim is not None:
            return lambda: trim(0)
    return lambda: None


def init_distributed(port: int = 29500, timeout_s: int = 600, connect_timeout_s: float = 120) -> None:
    """Join the process group (admin_ds/distributed.py), a world of one without a launcher."""
    init("cpu" if on_cpu() else "cuda", port, timeout_s, connect_timeout_s, standalone=True)


# ------------------------------------------------------------------------------------------------
# The DeepSpeed JSON
# ------------------------------------------------------------------------------------------------


def load_ds_config(path: str | os.PathLike) -> dict:
    """The DeepSpeed JSON at ``path``, read (ds_config.read) and checked against DeepSpeed."""
    from admin_ds.train import ds_config

    ds = ds_config.read(path)
    _check(ds, str(path))
    return ds


def _check(ds: dict, source: str) -> None:
    """The whole file against the installed DeepSpeed (admin_ds/train/ds_config.py), before any
    process group or engine exists; batch numbers and the pipeline's stage count are ours to
    resolve later, so the probe holds neutral ones."""
    from admin_ds.train import ds_config

    if list(_find_auto(ds)):
        return  # refused with its own message by resolve_ds_config
    ds_config.check_types(ds, source)
    probe = json.loads(json.dumps(ds))
    probe.get("pipeline", {}).pop("stages", None)
    probe.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1, train_batch_size=1)
    for key in _OWNED_BY_RUN_CONFIG:
        probe.pop(key, None)  # refused by resolve_ds_config, naming where the value belongs
    ds_config.check(probe, source)


def _find_auto(d, prefix=""):
    for k, v in d.items():
        name = f"{prefix}{k}"
        if v == "auto":
            yield name
        elif isinstance(v, dict):
            yield from _find_auto(v, name + ".")


def resolve_ds_config(ds: dict, run, world: int, source: str = "ds_config") -> dict:
    """Validate the DeepSpeed JSON against the run config and fill in what we own.

    A micro-batch is one token bucket of ``data.max_tokens`` padded tokens, so DeepSpeed's
    ``train_micro_batch_size_per_gpu`` is 1 and ``train_batch_size`` = accumulation x data-parallel
    size. Returns a new dict; ``ds`` is not modified.
    """
    from admin_ds.train import ds_config

    ds = json.loads(json.dumps(ds))
    auto = list(_find_auto(ds))
    if auto:
        raise ConfigError(f"{source}: unresolved \"auto\" at {', '.join(auto)}; set explicit values")
    ds_config.check_types(ds, source)
    for key, ours in _OWNED_BY_RUN_CONFIG.items():
        if key in ds:
            raise ConfigError(f"{source}: '{key}' is set in the DeepSpeed JSON; it belongs to the run "
                              f"config ({ours}). Remove it from the JSON.")
    json_stages = ds.get("pipeline", {}).pop("stages", None)
    if json_stages is not None:
        if run.engine.pipeline_stages not in (1, json_stages):
            raise ConfigError(f"{source}: pipeline.stages={json_stages} but engine.pipeline_stages="
                              f"{run.engine.pipeline_stages}; set the number of stages in one place")
        run.engine.pipeline_stages = int(json_stages)
    stages = run.engine.pipeline_stages
    if stages > 1 and world < stages:
        raise ConfigError(f"pipeline with {stages} stages needs at least {stages} ranks; the world has {world}")
    if world % stages:
        raise ConfigError(f"engine.pipeline_stages={stages} does not divide the world size {world}")
    dp = world // stages
    zero = int(ds.get("zero_optimization", {}).get("stage", 0))
    if stages > 1 and zero >= 2:
        raise ConfigError(f"{source}: zero_optimization.stage={zero} with engine.pipeline_stages={stages}: "
                          "DeepSpeed supports ZeRO-0/1 only with pipeline parallelism")
    if zero == 3 and run.engine.compile:
        raise ConfigError(f"{source}: zero_optimization.stage=3 with engine.compile: ZeRO-3 gathers each "
                          "layer's parameters in module hooks a compiled layer cannot hold; use ZeRO-1/2")
    if ds.get("bf16", {}).get("enabled") and ds.get("fp16", {}).get("enabled"):
        raise ConfigError(f"{source}: bf16.enabled and fp16.enabled are both true")
    micro = ds.setdefault("train_micro_batch_size_per_gpu", 1)
    if micro != 1:
        raise ConfigError(f"{source}: train_micro_batch_size_per_gpu={micro}: a micro-batch is one token "
                          "bucket here; set it to 1 and size batches with data.max_tokens")
    gas = ds.get("gradient_accumulation_steps")
    if "train_batch_size" in ds:
        tbs = ds["train_batch_size"]
        if gas is None:
            if tbs % dp:
                raise ConfigError(f"{source}: train_batch_size={tbs} is not a multiple of the "
                                  f"data-parallel size {dp}")
            gas = tbs // dp
        elif tbs != micro * gas * dp:
            raise ConfigError(f"{source}: train_batch_size={tbs} != train_micro_batch_size_per_gpu "
                              f"({micro}) x gradient_accumulation_steps ({gas}) x data-parallel size ({dp})")
    gas = 1 if gas is None else gas
    ds["gradient_accumulation_steps"] = gas
    ds["train_batch_size"] = micro * gas * dp
    if stages > 1 and run.engine.activation_checkpointing:
        # DeepSpeed's reentrant checkpoint loses its saved tensors in the pipeline backward here;
        # the non-reentrant one recomputes exactly (tested against the unchecked run).
        ds.setdefault("pipeline", {})["use_reentrant"] = False
    ds["gradient_clipping"] = float(run.optim.clip_norm)  # always explicit: DeepSpeed's default is 1.0
    ds.setdefault("steps_per_print", 10**9)  # we log ourselves
    ds.setdefault("wall_clock_breakdown", False)
    if zero >= 1 and run.optim.optimizer == "radam":
        ds["zero_allow_untested_optimizer"] = True  # RAdam is a plain torch optimizer; ZeRO shards it fine
    return ds


def precision(ds: dict) -> str:
    if ds.get("bf16", {}).get("enabled"):
        return "bf16"
    if ds.get("fp16", {}).get("enabled"):
        return "fp16"
    return "fp32"


def zero_stage(ds: dict) -> int:
    return int(ds.get("zero_optimization", {}).get("stage", 0))


def layout(ds: dict, pipeline_stages: int, world: int) -> dict:
    """The run's layout, as checkpoints record it (known before the engine is built)."""
    return {"world_size": world, "data_parallel": world // pipeline_stages, "pipeline": pipeline_stages,
            "zero": zero_stage(ds), "precision": precision(ds),
            "gradient_accumulation_steps": ds["gradient_accumulation_steps"]}


# ------------------------------------------------------------------------------------------------
# Optimizer and schedule (client objects: DeepSpeed has no RAdam preset nor inverse-sqrt schedule)
# ------------------------------------------------------------------------------------------------


def inverse_sqrt_factor(optim):
    """fairseq's inverse_sqrt: linear warmup from warmup_init_lr to lr over warmup_updates, then
    lr * sqrt(warmup_updates / update). Returned as a LambdaLR factor of the peak lr."""
    peak, init, warm = optim.lr, optim.warmup_init_lr, optim.warmup_updates

    def factor(step: int) -> float:
        if warm > 0 and step < warm:
            return (init + step * (peak - init) / warm) / peak
        return math.sqrt(max(warm, 1) / max(step, 1))

    return factor


def make_optimizer(optim):
    """A builder of the run's optimizer over given parameters (DeepSpeed passes its own: the flat
    fp32 partitions under ZeRO-1/2, the parameters themselves without ZeRO).

    ``optim.implementation`` says how one step runs over many tensors; the arithmetic is the same
    (tests/test_fast_paths.py): "foreach" updates all tensors with a few multi-tensor kernels,
    "fused" with one kernel per step (torch's fused Adam/AdamW, CPU or GPU), "deepspeed" with
    DeepSpeed's FusedAdam (built on first use), "loop" one tensor at a time in Python (torch's
    reference, and its default on a CPU)."""
    impl = optim.implementation

    def build(params):
        kw = dict(lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps, weight_decay=optim.weight_decay)
        if impl == "deepspeed":
            return _deepspeed_fused_adam(params, optim.optimizer == "adamw", kw)
        if impl == "fused":
            kw["fused"] = True
        else:
            kw["foreach"] = impl == "foreach"
        cls = {"radam": torch.optim.RAdam, "adamw": torch.optim.AdamW, "adam": torch.optim.Adam}[optim.optimizer]
        return cls(params, **kw)

    return build


def _deepspeed_fused_adam(params, adam_w_mode: bool, kw: dict):
    try:
        from deepspeed.ops.adam import FusedAdam

        return FusedAdam(params, adam_w_mode=adam_w_mode, **kw)
    except Exception as e:  # the op is compiled on first use: no compiler, no CUDA headers, ...
        raise ConfigError(f"optim.implementation=deepspeed: DeepSpeed's FusedAdam does not build here "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); use "
                          "'fused' or 'foreach'") from None


def initialize(model: torch.nn.Module, run, ds: dict):
    """``deepspeed.initialize`` with our optimizer and schedule; returns the engine."""
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=ds,
        optimizer=make_optimizer(run.optim),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, inverse_sqrt_factor(run.optim)))
    return engine


# ------------------------------------------------------------------------------------------------
# Writing omega into every copy
# ------------------------------------------------------------------------------------------------


def _is_zero3_param(p: torch.Tensor) -> bool:
    return hasattr(p, "ds_id") and hasattr(p, "ds_shape")


@torch.no_grad()
def write_params(engine, values: dict[str, torch.Tensor]) -> None:
    """Set named parameters of ``engine.module`` to full-size fp32 ``values`` in the module tensor
    and in the optimizer's fp32 master, under any ZeRO stage and precision. Collective under ZeRO."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_set_full_fp32_param

    params = dict(engine.module.named_parameters())
    buffers = dict(engine.module.named_buffers())
    missing = sorted(set(values) - set(params) - set(buffers))
    if missing:
        raise KeyError(f"no such parameters: {missing[:5]}")
    has_masters = engine.optimizer is not None and not isinstance(engine.optimizer, torch.optim.Optimizer)
    refresh = False
    for name in sorted(values):
        value = values[name]
        if name in buffers:
            buffers[name].copy_(value.to(buffers[name].dtype))
            continue
        p = params[name]
        if _is_zero3_param(p):
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                if rank() == 0:
                    p.data.copy_(value.to(p.dtype).view(p.ds_shape))
        else:
            p.data.copy_(value.to(p.dtype))
        if has_masters:
            if safe_get_full_fp32_param(p) is not None:
                safe_set_full_fp32_param(p, value.to(torch.float32).to(p.device).view(p.ds_shape if _is_zero3_param(p) else p.shape))
            else:
                refresh = True  # optimizers without an hp mapping (FP16_Optimizer): copy lp -> fp32
    if refresh and hasattr(engine.optimizer, "refresh_fp32_params"):
        engine.optimizer.refresh_fp32_params()


def consolidated_state_dict(engine) -> Optional[dict]:
    """The full model state dict (training precision) on rank 0, None elsewhere. Collective."""
    if zero_stage(engine.config) == 3:
        sd = engine._zero3_consolidated_16bit_state_dict()
        return {k: v.clone() for k, v in sd.items()} if rank() == 0 else None
    if rank() != 0:
        return None
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def write_omega(engine, profile, buffers_only: bool = False) -> None:
    """Write ``profile``'s omega into the engine's module (any ZeRO stage, any layout: the module is
    the whole model or a pipeline stage) and the optimizer's fp32 masters, then check that every
    rank holds the same profile. Collective. ``buffers_only``: a fixed (buffer) omega only, after
    a universal load, which restores parameters (trained omega included) but not buffers."""
    from admin_ds.model.profiling import omega_values

    values = omega_values(profile, engine.module)
    if buffers_only:
        buffers = dict(engine.module.named_buffers())
        values = {k: v for k, v in values.items() if k in buffers}
    write_params(engine, values)
    # Identical on every rank: gather a digest of the whole profile and compare.
    digest = sum(s.omega * (i + 1) for i, s in enumerate(profile.sublayers))
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, digest)  # objects: any backend (NCCL takes GPU tensors only)
        if any(g != gathered[0] for g in gathered):
            raise RuntimeError("omega differs between ranks after profiling")
