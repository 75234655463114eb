"""Training on a GPU: bf16 and fp16 engines under ZeRO-1/2/3 against fp32, fp16 loss-scale
overflow, omega in the fp32 masters under bf16, the fast paths (fused optimizers, activation
checkpointing on a deep model, compiled layers) against the plain ones."""

import pytest

from conftest import NO_DROPOUT, overrides
from distributed import spawn
from gpu_suite import GPU, engine_config, rel

pytestmark = GPU

UPDATES = 100
# bf16 keeps 8 significant bits, fp16 11: over 100 updates their loss curves drift from fp32's by
# rounding, not by trend. Each 10-update window's mean loss must stay within this fraction of
# fp32's (dropout off, the same batches and profile).
CURVE_TOLERANCE = {"bf16": 0.03, "fp16": 0.03}


def windows(losses: list[float], size: int = 10) -> list[float]:
    return [sum(losses[i:i + size]) / size for i in range(0, len(losses), size)]


@pytest.fixture(scope="module")
def fp32_curve(tmp_path_factory, data_dir, fixed_profile):
    tmp = tmp_path_factory.mktemp("fp32")
    return spawn(1, "train_updates", tmp / "out", accelerator="cuda", ds=engine_config(0, "fp32"), tmp=str(tmp),
                 updates=UPDATES, run_overrides=overrides(tmp / "run", data_dir, *NO_DROPOUT,
                                                          f"--admin.profile={fixed_profile}"))[0]


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_loss_curve_matches_fp32(tmp_path, data_dir, fixed_profile, fp32_curve, precision, stage):
    res = spawn(1, "train_updates", tmp_path / "out", accelerator="cuda", ds=engine_config(stage, precision),
                tmp=str(tmp_path), updates=UPDATES,
                run_overrides=overrides(tmp_path / "run", data_dir, *NO_DROPOUT, f"--admin.profile={fixed_profile}"))[0]
    ours, ref = windows(res["losses"]), windows(fp32_curve["losses"])
    assert rel(ours, ref) <= CURVE_TOLERANCE[precision], (precision, stage, ours, ref)
    assert ref[-1] < 0.8 * ref[0]  # the curve is one of learning, not a flat line
    assert not any(res["nonfinite"])


def test_fp16_overflow_skips_the_update_and_lowers_the_scale(tmp_path, data_dir, fixed_profile):
    """A loss scale of 2^24 overflows fp16 gradients: DeepSpeed skips those updates, halves the
    scale at each (hysteresis 1), then trains normally; the guard does not count these routine
    skips as divergence."""
    ds = engine_config(2, "fp16")
    ds["fp16"]["initial_scale_power"] = 24
    res = spawn(1, "train_updates", tmp_path / "out", accelerator="cuda", ds=ds, tmp=str(tmp_path), updates=30,
                run_overrides=overrides(tmp_path / "run", data_dir, *NO_DROPOUT, f"--admin.profile={fixed_profile}"))[0]
    skipped, scales = res["skipped"], res["loss_scales"]
    assert skipped[0] and False in skipped, (skipped, scales)
    scale = 2.0**24
    for skip, after in zip(skipped, scales):
        assert after == (scale / 2 if skip else scale), (skipped, scales)
        scale = after
    first_ok = skipped.index(False)
    assert sum(skipped[first_ok:]) <= 2, skipped  # the scale fits from there on (bar a rare spike)
    assert not any(res["nonfinite"])
    assert res["losses"][-1] < res["losses"][first_ok]


@pytest.mark.parametrize("stage", [1, 2])
def test_omega_in_the_fp32_masters_under_bf16(tmp_path, data_dir, stage):
    """Omega written after deepspeed.initialize reaches the bf16 engine's fp32 masters: after an
    update at a tiny learning rate the master holds the profiled value, not the 1.0 a
    module-only write reverts to; the bf16 module copy holds it to bf16 precision."""
    ds = engine_config(stage, "bf16", data_types={"grad_accum_dtype": "fp32"})
    ov = overrides(tmp_path / "run", data_dir, "--optim.warmup_updates=100", "--optim.warmup_init_lr=1e-9")
    res = spawn(1, "train_updates", tmp_path / "out", accelerator="cuda", ds=ds, tmp=str(tmp_path), updates=1,
                run_overrides=ov, read_omega=True)[0]
    want = res["profile"]["encoder"][3]
    assert want > 1.2
    lp, hp = res["omega"]["encoder_layers.1.ffn_residual.omega"]
    assert hp is not None and rel(hp, [want] * len(hp)) <= 1e-5
    assert rel(lp, [want] * len(lp)) <= 1e-2


@pytest.mark.parametrize("implementation", ["foreach", "fused", "deepspeed"])
def test_fast_optimizers_match_the_loop(tmp_path, data_dir, fixed_profile, implementation):
    """torch's foreach and fused AdamW and DeepSpeed's FusedAdam (compiled here on first use)
    take the steps the per-tensor loop takes."""
    runs = {}
    for impl in ("loop", implementation):
        runs[impl] = spawn(1, "train_updates", tmp_path / impl, accelerator="cuda", ds=engine_config(0, "fp32"),
                           tmp=str(tmp_path), updates=8,
                           run_overrides=overrides(tmp_path / f"run_{impl}", data_dir, *NO_DROPOUT,
                                                   f"--admin.profile={fixed_profile}", "--optim.optimizer=adamw",
                                                   f"--optim.implementation={impl}"))[0]
    assert rel(runs[implementation]["losses"], runs["loop"]["losses"]) <= 1e-4


DEEP = ["--model.num_encoder_layers=60", "--model.num_decoder_layers=12"]


def test_activation_checkpointing_on_a_60L_12L_model(tmp_path, data_dir):
    """Per-layer checkpointing on 60L-12L (dropout on: the recomputation replays its masks): the
    same losses, and less peak memory."""
    runs = {}
    for ckpt in (False, True):
        runs[ckpt] = spawn(1, "train_updates", tmp_path / str(ckpt), accelerator="cuda", ds=engine_config(2, "bf16"),
                           tmp=str(tmp_path), updates=3,
                           run_overrides=overrides(tmp_path / f"run{ckpt}", data_dir, *DEEP,
                                                   f"--engine.activation_checkpointing={str(ckpt).lower()}"))[0]
    assert rel(runs[True]["losses"], runs[False]["losses"]) <= 1e-3
    assert runs[True]["peak_mem"] < 0.8 * runs[False]["peak_mem"], (runs[True]["peak_mem"], runs[False]["peak_mem"])


def test_compiled_layers_train_like_eager(tmp_path, data_dir, fixed_profile):
    """engine.compile=true (inductor) under bf16 ZeRO-2: the losses of the eager run."""
    runs = {}
    for compiled in (False, True):
        runs[compiled] = spawn(1, "train_updates", tmp_path / str(compiled), accelerator="cuda",
                               ds=engine_config(2, "bf16"), tmp=str(tmp_path), updates=6,
                               run_overrides=overrides(tmp_path / f"run{compiled}", data_dir, *NO_DROPOUT,
                                                       f"--admin.profile={fixed_profile}",
                                                       f"--engine.compile={str(compiled).lower()}"))[0]
    assert rel(runs[True]["losses"], runs[False]["losses"]) <= 2e-2
