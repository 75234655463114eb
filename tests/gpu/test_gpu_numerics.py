"""The GPU computes what the CPU computes: Admin profiling against a float64 CPU profile, greedy
decoding against the CPU's tokens, and attention through SDPA's fused kernels (which one runs,
and that padded positions stay finite in bf16 and fp16)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import NO_DROPOUT, overrides
from distributed import REPO, spawn
from gpu_suite import GPU, engine_config, rel

pytestmark = GPU


def test_profile_on_gpu_equals_the_float64_cpu_profile(tmp_path, data_dir):
    """The training engine's profiling pass on the GPU (fp32, dropout off) gives the omega that a
    float64 model on the CPU computes from the same batch, to 1e-6 (fp32 on a CPU: ~4e-8)."""
    from admin_ds.data.binarize import load_manifest
    from admin_ds.model import build_model
    from admin_ds.profiling import profile_omega
    from admin_ds.train.run_config import load_run_config

    ov = overrides(tmp_path / "run", data_dir, *NO_DROPOUT)
    res = spawn(1, "profile_only", tmp_path / "out", accelerator="cuda", ds=engine_config(0, "fp32"),
                tmp=str(tmp_path), run_overrides=ov)[0]
    run = load_run_config(None, ov)
    cfg = run.model.build(vocab_size=load_manifest(data_dir)["vocab_size"])
    model = build_model(cfg, seed=run.train.seed).double()
    cpu = profile_omega(model, (torch.tensor(res["src"]), torch.tensor(res["tgt"])))
    for stack in ("encoder", "decoder"):
        assert rel(res["profile"][stack], cpu.omega(stack)) <= 1e-6, stack
    assert max(cpu.omega("encoder")) > 1.2


FIXTURE = REPO / "tests/fixtures/run_v1"
EXPECTED = json.loads((REPO / "tests/fixtures/run_v1_expected.json").read_text(encoding="utf-8"))


def test_greedy_decoding_on_gpu_gives_the_cpu_tokens(tmp_path):
    """The fixture run's model (tests/fixtures) decodes on the GPU to the sentences the CPU
    produced (tests/test_compat.py checks the CPU against the same record)."""
    lines = (FIXTURE / "data/test.en").read_text(encoding="utf-8").splitlines()[:EXPECTED["translate_input_lines"]]
    src = tmp_path / "src.txt"
    src.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    shutil.copytree(FIXTURE, tmp_path / "run")
    out = subprocess.run([sys.executable, str(REPO / "launch/translate.py"), "--checkpoint", str(tmp_path / "run"),
                          "--input", str(src), "--quiet", "--method", "greedy", "--device", "cuda"],
                         capture_output=True, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"), cwd=REPO,
                         timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert out.stdout.splitlines() == EXPECTED["greedy"]


def attention_ops(model, src, tgt) -> set:
    """Names of the attention operators a training forward and backward dispatch."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        logits = model(src, tgt)
        F.cross_entropy(logits.flatten(0, 1).float(), tgt.flatten(), ignore_index=1).backward()
    torch.cuda.synchronize()
    assert torch.isfinite(logits).all(), "non-finite logits (padded positions included)"
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    return {e.name for e in prof.events() if "scaled_dot_product" in e.name or "attention" in e.name}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_runs_fused_kernels_with_padding_masks(dtype):
    """Training attention in bf16/fp16 (dropout on) never falls back to SDPA's math path: the key
    padding masks of encoder self-attention and encoder-attention go to the memory-efficient (or
    cuDNN) kernel, the causal-only decoder self-attention to flash attention. Every position of a
    heavily padded batch, padded ones included, stays finite."""
    from admin_ds.model import build_model
    from admin_ds.presets import get_preset

    cfg = get_preset("debug-tiny", vocab_size=512, model_dim=128, num_heads=4)  # head_dim 32
    model = build_model(cfg, seed=1).to("cuda", dtype).train()
    g = torch.Generator().manual_seed(0)
    src, tgt = torch.randint(4, 512, (8, 40), generator=g), torch.randint(4, 512, (8, 33), generator=g)
    for i, (s, t) in enumerate([(40, 33), (7, 5), (1, 1), (23, 30), (40, 2), (12, 33), (3, 9), (31, 17)]):
        src[i, s:], tgt[i, t:] = 1, 1
    src, tgt = src.cuda(), tgt.cuda()
    for layer in model.decoder_layers:
        layer.mask_padded_keys = False
    ops = attention_ops(model, src, tgt)
    print(f"{dtype}, causal-only decoder: {sorted(ops)}")
    assert not any("math" in name for name in ops), ops
    assert any("flash" in name or "cudnn" in name for name in ops), ops
    assert any("efficient" in name or "cudnn" in name for name in ops), ops
    for layer in model.decoder_layers:
        layer.mask_padded_keys = True  # fairseq's mask: a (B, T, T) mask, still a fused kernel
    model.zero_grad()
    ops = attention_ops(model, src, tgt)
    print(f"{dtype}, padded keys masked: {sorted(ops)}")
    assert not any("math" in name for name in ops), ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bulk_dropout_masks_on_gpu(dtype):
    """engine.dropout=bulk on the GPU: the keep rate within 5 binomial deviations of 1 - p (p = 0.1,
    the ties of 256 p resolved), kept elements scaled as torch's dropout scales them in ``dtype``."""
    from admin_ds.model.dropout import dropout, keep_mask

    torch.manual_seed(0)
    n, p = 1 << 24, 0.1
    keep = keep_mask((n,), p, device="cuda")
    assert abs(keep.double().mean().item() - (1 - p)) <= 5 * (p * (1 - p) / n) ** 0.5
    x = torch.randn(4096, 1024, device="cuda", dtype=dtype, requires_grad=True)
    y = dropout(x, p, True, "bulk")
    kept = y != 0
    torch.testing.assert_close(y[kept], x.detach()[kept].mul(1 / (1 - p)), rtol=0, atol=0)
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad, kept.to(dtype).mul(1 / (1 - p)), rtol=0, atol=0)
