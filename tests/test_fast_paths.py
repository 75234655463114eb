"""The fast training paths against the plain ones: each must compute what the plain path computes.

Causal-only decoder self-attention (padded keys left visible to padded queries), per-layer
activation checkpointing, compiled layers, the optimizer implementations (foreach, fused, loop)
and what a padded batch leaves at its masked positions. On CPU; tests/gpu/ repeats the
kernel-specific parts on a GPU.
"""

import contextlib
import ctypes
import os

import pytest
import torch
import torch.nn.functional as F

from admin_ds.model import build_model
from admin_ds.model.transformer import compile_layers
from admin_ds.presets import get_preset

from conftest import NO_DROPOUT, ZERO, overrides
from distributed import spawn

TINY = dict(vocab_size=300, num_encoder_layers=3, num_decoder_layers=3)
NO_DROP = dict(dropout_p=0.0, attention_dropout_p=0.0, activation_dropout_p=0.0)


def padded_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded source and target sentences of mixed lengths (rows 1 and 2 padded)."""
    g = torch.Generator().manual_seed(seed)
    src, tgt = torch.randint(4, 300, (4, 9), generator=g), torch.randint(4, 300, (4, 7), generator=g)
    src[1, 5:] = 1
    tgt[2, 3:] = 1
    tgt[1, 6:] = 1
    return src, tgt


def loss_and_grads(model, src, tgt, seed: int = 5):
    """Summed cross-entropy over real target tokens (the decoder input doubles as the target:
    the shift does not matter here), its gradients, and the logits."""
    torch.manual_seed(seed)  # the same dropout masks for both paths
    model.zero_grad()
    logits = model(src, tgt)
    loss = F.cross_entropy(logits.flatten(0, 1).double(), tgt.flatten(), ignore_index=1, reduction="sum")
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, logits.detach()


def set_decoder_masking(model, on: bool) -> None:
    for layer in model.decoder_layers:
        layer.mask_padded_keys = on


# ---- decoder self-attention: causal only ---------------------------------------------------------


@pytest.mark.parametrize("dropout", [False, True])
def test_causal_only_decoder_attention_keeps_loss_and_gradients(dropout):
    """float64: the loss and every gradient are bit for bit those of fairseq's padded-key mask;
    only the outputs at padded target positions differ (so the switch does act)."""
    cfg = get_preset("debug-tiny", **TINY, **({} if dropout else NO_DROP))
    model = build_model(cfg, seed=1).double()
    src, tgt = padded_batch()
    loss_m, grads_m, out_m = loss_and_grads(model, src, tgt)
    set_decoder_masking(model, False)
    loss_c, grads_c, out_c = loss_and_grads(model, src, tgt)
    assert loss_c == loss_m
    assert grads_c.keys() == grads_m.keys()
    for name in grads_m:
        assert torch.equal(grads_c[name], grads_m[name]), name
    real = tgt.ne(cfg.pad_idx)
    assert torch.equal(out_c[real], out_m[real])
    assert (out_c[~real] - out_m[~real]).abs().max() > 1e-3


def test_profiling_masks_padded_target_keys_either_way(monkeypatch):
    """Admin profiling counts padded positions, as the reference does: the profile is the same
    whether training masks padded keys or not, and it would differ without the mask."""
    from admin_ds.model import profiling

    cfg = get_preset("debug-tiny", **TINY, **NO_DROP)
    src, tgt = padded_batch()
    model = build_model(cfg, seed=1)
    masked = profiling.measure_profile(model, (src, tgt)).omega("decoder")
    set_decoder_masking(model, False)
    assert profiling.measure_profile(model, (src, tgt)).omega("decoder") == masked
    assert all(layer.mask_padded_keys is False for layer in model.decoder_layers)  # restored afterwards
    monkeypatch.setattr(profiling, "padded_target_keys_masked", lambda m: contextlib.nullcontext())
    unmasked = profiling.measure_profile(model, (src, tgt)).omega("decoder")
    assert unmasked[0] == masked[0] == 1.0  # the chain starts at 1 either way
    assert max(abs(a - b) for a, b in zip(unmasked, masked)) > 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask_keys", [True, False])
def test_padded_positions_stay_finite_in_half_precision(dtype, mask_keys):
    """Every position of a heavily padded batch, padded ones included, stays finite forward and
    backward in bf16/fp16 (a masked score is -inf; no row of these masks is all -inf)."""
    cfg = get_preset("debug-tiny", **TINY)
    model = build_model(cfg, seed=1).to(dtype)
    set_decoder_masking(model, mask_keys)
    src, tgt = padded_batch()
    src[3, 1:] = 1  # a one-token source sentence beside longer ones
    tgt[3, 1:] = 1
    _, grads, logits = loss_and_grads(model, src, tgt)
    assert torch.isfinite(logits).all()
    assert all(torch.isfinite(g).all() for g in grads.values())


# ---- skipping padding ------------------------------------------------------------------------------


def test_skipping_padding_keeps_loss_and_gradients():
    """float64, dropout off (the padded path draws dropout masks for padded positions too, so with
    dropout the two differ in which numbers they draw): the real positions' logits, the loss and
    every gradient equal the padded computation's, for padded and unpadded batches, with either
    decoder masking."""
    from admin_ds.train.runners import label_smoothed_nll

    cfg = get_preset("debug-tiny", **TINY, **NO_DROP)
    model = build_model(cfg, seed=1).double()
    src, tgt = padded_batch()
    for s, t in ((src, tgt), (src[[0, 2]], tgt[[0, 3]])):  # the second: no source padding
        for mask_keys in (True, False):
            set_decoder_masking(model, mask_keys)
            results = []
            for skip in (False, True):
                model.zero_grad()
                logits = model(s, t, skip_padding=skip)
                loss, _ = label_smoothed_nll(logits, t, 0.1, cfg.pad_idx)
                loss.backward()
                real = logits.reshape(-1, logits.size(-1))[t.ne(cfg.pad_idx).flatten()] if not skip else logits
                results.append((loss.item(), real.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
            (loss_p, real_p, grads_p), (loss_s, real_s, grads_s) = results
            assert real_s.shape == (int(t.ne(cfg.pad_idx).sum()), cfg.vocab_size)
            torch.testing.assert_close(real_s, real_p, rtol=1e-12, atol=1e-12)
            assert loss_s == pytest.approx(loss_p, rel=1e-12)
            for name in grads_p:
                torch.testing.assert_close(grads_s[name], grads_p[name], rtol=1e-10, atol=1e-12, msg=name)


def test_skipping_padding_runs_fewer_products():
    """What the switch is for: the projections and feed-forward layers see only the real tokens
    (FLOPs counted by FlopCounterMode, attention on SDPA's math path)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from admin_ds.model.flops import training_flops

    cfg = get_preset("debug-tiny", **TINY)
    model = build_model(cfg, seed=1)
    src, tgt = padded_batch()
    counted = {}
    for skip in (False, True):
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            model(src, tgt, skip_padding=skip).sum().backward()
        counted[skip] = counter.get_total_flops()
    batch = dict(src_tokens=src, target=tgt)
    real, padded = training_flops(cfg, batch), training_flops(cfg, batch, padded=True)
    assert counted[False] == pytest.approx(padded, rel=0.02)
    assert counted[True] < counted[False] - 0.5 * (padded - real)


# ---- activation checkpointing --------------------------------------------------------------------


def saved_bytes(model, src, tgt) -> int:
    """Bytes the autograd graph keeps for the backward outside checkpointed regions (inside one,
    the checkpoint's own hooks take the tensors, and only the layer's inputs are kept)."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(src, tgt).sum()
    return total


def test_activation_checkpointing_same_gradients_less_memory():
    cfg = get_preset("debug-tiny", **TINY)  # dropout on: the recomputation replays its masks
    model = build_model(cfg, seed=1)
    src, tgt = padded_batch()
    loss, grads, _ = loss_and_grads(model, src, tgt)
    plain_bytes = saved_bytes(model, src, tgt)
    model.activation_checkpointing = True
    loss_ckpt, grads_ckpt, _ = loss_and_grads(model, src, tgt)
    assert loss_ckpt == loss
    for name in grads:
        assert torch.equal(grads_ckpt[name], grads[name]), name
    assert saved_bytes(model, src, tgt) < 0.5 * plain_bytes
    model.eval()
    with torch.no_grad():  # not training: no checkpoint, nothing recomputed
        assert torch.equal(model(src, tgt), build_model(cfg, seed=1).eval()(src, tgt))


# ---- compiled layers ------------------------------------------------------------------------------


def test_compiled_layers_match_eager():
    """compile_layers traced through dynamo and AOT autograd (the ``aot_eager`` backend: the same
    graphs without generating C++, which costs a minute per test on a CPU; tests/gpu runs
    inductor): equal losses and gradients, one graph per layer kind, reused by every layer and
    by batches of other shapes, parameter names unchanged."""
    import torch._dynamo

    cfg = get_preset("debug-tiny", **TINY, **NO_DROP)
    eager, compiled = build_model(cfg, seed=1), build_model(cfg, seed=1)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compile_layers(compiled, backend="aot_eager")
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]
    for seed in range(3):
        src, tgt = padded_batch(seed)
        if seed == 2:
            src, tgt = src[:3, :6].contiguous(), tgt[:3, :5].contiguous()
        loss_e, grads_e, _ = loss_and_grads(eager, src, tgt)
        loss_c, grads_c, _ = loss_and_grads(compiled, src, tgt)
        assert loss_c == pytest.approx(loss_e, rel=1e-6)
        for name in grads_e:
            torch.testing.assert_close(grads_c[name], grads_e[name], rtol=1e-5, atol=1e-6)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 4  # (encoder, decoder) x (first, dynamic)
    for model in (eager, compiled):  # with padding skipped: (N, D) rows, Unpadded objects crossing into the graphs
        model.zero_grad()
        model(*padded_batch(5), skip_padding=True).sum().backward()
    scale = max(float(q.grad.abs().max()) for q in eager.parameters())  # a sum of logits: gradients ~100
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6 * scale, msg=name)
    torch._dynamo.reset()


# ---- optimizers -----------------------------------------------------------------------------------


def run_optimizer(optimizer: str, implementation: str, layers: int = 2, steps: int = 4):
    """``steps`` steps of the run config's optimizer on a small model; its parameters after them."""
    from admin_ds.train.engine import make_optimizer
    from admin_ds.train.run_config import load_run_config

    optim = load_run_config(None, [f"--optim.optimizer={optimizer}", f"--optim.implementation={implementation}",
                                   "--optim.weight_decay=0.01"]).optim
    model = build_model(get_preset("debug-tiny", **{**TINY, "num_encoder_layers": layers}), seed=1)
    opt = make_optimizer(optim)(model.parameters())
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return opt, model


@pytest.mark.parametrize("optimizer,implementation", [
    ("adam", "foreach"), ("adam", "fused"), ("adamw", "foreach"), ("adamw", "fused"), ("radam", "foreach")])
def test_optimizer_implementations_agree_with_the_loop(optimizer, implementation):
    _, ref = run_optimizer(optimizer, "loop")
    _, fast = run_optimizer(optimizer, implementation)
    for (name, a), b in zip(fast.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=name)
        assert not torch.equal(a, build_model(fast.cfg, seed=1).get_parameter(name))  # they moved


def step_kernels(optimizer: str, implementation: str, layers: int) -> int:
    """Tensor operators one optimizer step calls from Python (not those they call themselves,
    nor ``item``: torch's foreach Adam and RAdam still read each tensor's step count as a Python
    number on a CPU, scalar work without a kernel)."""
    from torch.profiler import profile

    opt, model = run_optimizer(optimizer, implementation, layers, steps=1)
    with profile() as prof:
        opt.step()
    return sum(1 for e in prof.events() if e.name.startswith("aten::") and e.name != "aten::item"
               and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))


@pytest.mark.parametrize("optimizer,implementation", [("adamw", "fused"), ("adamw", "foreach"), ("radam", "foreach")])
def test_optimizer_step_has_no_per_parameter_loop(optimizer, implementation):
    """Three times the layers (three times the parameter tensors) cost the same operators per
    step with multi-tensor kernels, and hundreds more with the loop."""
    assert step_kernels(optimizer, implementation, 2) == step_kernels(optimizer, implementation, 6) < 20
    assert step_kernels(optimizer, "loop", 6) > step_kernels(optimizer, "loop", 2) + 100


# ---- through the engine ---------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [2, 3])
def test_engine_with_the_fast_paths_trains_identically(tmp_path, data_dir, fixed_profile, stage):
    """The fast paths switched on in a DeepSpeed run give the plain run's losses and gradient
    norms; ZeRO-3 re-gathers the parameters of each recomputed layer. Dropout off: skipping
    padding draws fewer dropout numbers (checkpointing with dropout is shown exact above)."""
    common = [f"--admin.profile={fixed_profile}", *NO_DROPOUT]
    runs = {}
    plain = ["--engine.mask_padded_target_keys=true", "--engine.skip_padding=false", "--optim.implementation=loop"]
    for name, extra in (("plain", plain),
                        ("fast", ["--engine.activation_checkpointing=true", "--optim.implementation=foreach"])):
        runs[name] = spawn(1, "train_updates", tmp_path / name, ds=ZERO[stage], tmp=str(tmp_path), updates=3,
                           run_overrides=overrides(tmp_path / f"r{name}", data_dir, *common, *extra))[0]
    assert runs["fast"]["losses"] == pytest.approx(runs["plain"]["losses"], rel=1e-6)
    assert runs["fast"]["grad_norms"] == pytest.approx(runs["plain"]["grad_norms"], rel=1e-5)


def test_one_rank_without_zero_skips_the_identity_all_reduce(tmp_path, data_dir, fixed_profile):
    """ZeRO-0 on one rank leaves out DeepSpeed's gradient all-reduce (a flattening copy of every
    gradient for a sum over one rank): the same losses, gradient norms and weights as ZeRO-1 on
    one rank, which reduces its own way."""
    runs = {}
    for stage in (0, 1):
        runs[stage] = spawn(1, "train_updates", tmp_path / f"z{stage}", ds=ZERO[stage], tmp=str(tmp_path), updates=3,
                            run_overrides=overrides(tmp_path / f"r{stage}", data_dir,
                                                    f"--admin.profile={fixed_profile}", *NO_DROPOUT))[0]
    assert runs[0]["losses"] == pytest.approx(runs[1]["losses"], rel=1e-6)
    assert runs[0]["grad_norms"] == pytest.approx(runs[1]["grad_norms"], rel=1e-5)
    for name, value in runs[1]["params"].items():
        assert runs[0]["params"][name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


def _resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm") or not hasattr(ctypes.CDLL(None), "malloc_trim"),
                    reason="glibc on Linux")
def test_a_low_precision_cpu_run_hands_the_heaps_free_pages_back():
    """The heap a bf16 CPU run frees into stays resident until trimmed (engine.heap_trimmer): 300 MB
    of 100 KB blocks (below glibc's mmap threshold, so on the heap), every 50th kept to pin the
    heap, the rest freed: the bf16 trimmer returns most of them, the fp32 one leaves them."""
    from admin_ds.train.engine import heap_trimmer

    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size, count = 100 * 1024, 3000
    blocks = [libc.malloc(size) for _ in range(count)]
    for b in blocks:
        ctypes.memset(b, 1, size)  # resident
    for i, b in enumerate(blocks):
        if i % 50:
            libc.free(b)
    freed_mb = size * (count - count // 50) / 2**20
    before = _resident_mb()
    heap_trimmer("fp32")()
    untrimmed = _resident_mb()
    heap_trimmer("bf16")()
    after = _resident_mb()
    for i in range(0, count, 50):
        libc.free(blocks[i])
    assert before - untrimmed < 0.1 * freed_mb
    assert before - after > 0.8 * freed_mb, (before, after, freed_mb)
