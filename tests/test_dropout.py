"""Dropout masks drawn in bulk (``engine.dropout=bulk``, admin_ds/model/dropout.py) against the
Bernoulli distribution they claim, and against torch's dropout in a model and in a short training.

The bounds are binomial: with n draws of probability q, the mean's standard deviation is
sqrt(q (1 - q) / n), and every check allows 5 of them (a false failure once in ~1.7 million runs;
the seeds are fixed, so a run repeats exactly). Each case is chosen so that a plausible mistake
lands far outside: p = 0.1 is 25.6/256, so ignoring the ties' fraction moves the mean by 0.0016,
over 10 deviations at n = 2^22.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from admin_ds.model import build_model
from admin_ds.model.dropout import dropout, keep_mask
from admin_ds.model.transformer import set_dropout_impl
from admin_ds.presets import get_preset

N = 1 << 22
TINY = dict(vocab_size=300, num_encoder_layers=2, num_decoder_layers=2)


def within(mean: float, q: float, n: int, sigmas: float = 5.0) -> bool:
    return abs(mean - q) <= sigmas * math.sqrt(q * (1 - q) / n)


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5, 25 / 256, 0.0123, 0.9])
def test_keep_rate_is_one_minus_p(p):
    torch.manual_seed(0)
    n = N + 5  # not a whole number of 64-bit words
    keep = keep_mask((n,), p)
    assert keep.dtype == torch.bool and keep.shape == (n,)
    assert within(keep.double().mean().item(), 1 - p, n)
    as_float = keep_mask((n,), p, dtype=torch.float32)  # what the model multiplies by
    assert set(as_float.unique().tolist()) == {0.0, 1.0} and within(as_float.double().mean().item(), 1 - p, n)


def test_ties_are_resolved_not_rounded():
    """p = 0.1: rounding 256 p down or up instead of resolving the ties would give 1 - 25/256 or
    1 - 26/256, both more than 10 deviations from 0.9."""
    torch.manual_seed(1)
    mean = keep_mask((N,), 0.1).double().mean().item()
    assert within(mean, 0.9, N)
    assert not within(mean, 1 - 25 / 256, N) and not within(mean, 1 - 26 / 256, N)


def correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    return (a * b).mean().item() / math.sqrt((a * a).mean().item() * (b * b).mean().item())


@pytest.mark.parametrize("lag", [1, 7, 8, 9, 64])  # within a 64-bit word, across words
def test_no_correlation_between_neighbours(lag):
    torch.manual_seed(2)
    keep = keep_mask((N,), 0.3)
    # Under independence the sample correlation of n pairs has standard deviation 1/sqrt(n).
    assert abs(correlation(keep[:-lag], keep[lag:])) < 5 / math.sqrt(N - lag)


def test_no_correlation_across_calls():
    torch.manual_seed(3)
    a, b = keep_mask((N,), 0.3), keep_mask((N,), 0.3)
    assert abs(correlation(a, b)) < 5 / math.sqrt(N)
    # The pair frequencies of (a, b) are those of independent draws: P(both kept) = 0.49.
    assert within((a & b).double().mean().item(), 0.49, N)


def test_deterministic_given_torch_generator():
    torch.manual_seed(4)
    state = torch.get_rng_state()
    a = keep_mask((1000, 37), 0.1)
    torch.set_rng_state(state)
    assert torch.equal(keep_mask((1000, 37), 0.1), a)
    assert not torch.equal(keep_mask((1000, 37), 0.1), a)  # the generator moved on


def test_scaling_and_gradient():
    """Kept elements are x / (1 - p), dropped ones 0; the gradient is the same mask and scale."""
    torch.manual_seed(5)
    p = 0.25
    x = torch.randn(512, 300, dtype=torch.float64, requires_grad=True)
    y = dropout(x, p, True, "bulk")
    kept = y != 0
    assert within(kept.double().mean().item(), 1 - p, x.numel())
    scale = 1.0 / (1 - p)  # multiplied, as torch's dropout does
    torch.testing.assert_close(y[kept], x.detach()[kept] * scale, rtol=0, atol=0)
    g = torch.randn_like(x)
    y.backward(g)
    torch.testing.assert_close(x.grad, torch.where(kept, g * scale, 0.0), rtol=0, atol=0)


@pytest.mark.parametrize("impl", ["torch", "bulk"])
def test_identity_at_p0_and_in_eval(impl):
    x = torch.randn(64, 32)
    assert torch.equal(dropout(x, 0.0, True, impl), x)
    assert torch.equal(dropout(x, 0.3, False, impl), x)


def test_model_in_eval_mode_does_not_depend_on_the_implementation():
    cfg = get_preset("debug-tiny", **TINY)
    src, tgt = torch.randint(4, 300, (3, 9)), torch.randint(4, 300, (3, 7))
    a, b = build_model(cfg, seed=1).eval(), build_model(cfg, seed=1).eval()
    set_dropout_impl(b, "bulk")
    with torch.no_grad():
        assert torch.equal(a(src, tgt), b(src, tgt))


def test_model_uses_bulk_masks_everywhere():
    """Switched to bulk, a training forward pass calls no bernoulli (torch's mask generator),
    attention's dropout included; with torch's it does."""
    from torch.profiler import profile

    cfg = get_preset("debug-tiny", **TINY)
    model = build_model(cfg, seed=1)
    src, tgt = torch.randint(4, 300, (3, 9)), torch.randint(4, 300, (3, 7))

    def bernoullis() -> int:
        with profile() as prof:
            model(src, tgt).sum().backward()
        return sum("bernoulli" in e.name for e in prof.events())

    assert bernoullis() > 0
    set_dropout_impl(model, "bulk")
    assert bernoullis() == 0
    with pytest.raises(ValueError, match="dropout implementation 'fast'"):
        set_dropout_impl(model, "fast")


def test_activation_checkpointing_recomputes_the_same_masks():
    cfg = get_preset("debug-tiny", **TINY)
    model = build_model(cfg, seed=1)
    set_dropout_impl(model, "bulk")
    src, tgt = torch.randint(4, 300, (4, 9)), torch.randint(4, 300, (4, 7))

    def grads():
        torch.manual_seed(6)
        model.zero_grad()
        model(src, tgt).pow(2).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    plain = grads()
    model.activation_checkpointing = True
    for a, b in zip(grads(), plain):
        assert torch.equal(a, b)


def test_compiled_layers_draw_the_same_masks_as_eager():
    """Under engine.compile the masks are drawn by eager code between the compiled pieces, in the
    eager order: the same loss and gradients (``aot_eager``: dynamo's graphs without generating
    C++, as tests/test_fast_paths.py does)."""
    import torch._dynamo

    from admin_ds.model.transformer import compile_layers

    cfg = get_preset("debug-tiny", **TINY)
    eager, compiled = build_model(cfg, seed=1), build_model(cfg, seed=1)
    torch._dynamo.reset()
    compile_layers(compiled, backend="aot_eager")
    src, tgt = torch.randint(4, 300, (4, 9)), torch.randint(4, 300, (4, 7))
    results = []
    for model in (eager, compiled):
        set_dropout_impl(model, "bulk")
        torch.manual_seed(9)
        loss = model(src, tgt).pow(2).mean()
        loss.backward()
        results.append((loss.item(), [p.grad for p in model.parameters()]))
    torch._dynamo.reset()
    assert results[1][0] == pytest.approx(results[0][0], rel=1e-6)
    for a, b in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def train_copy_task(impl: str, steps: int = 120) -> list[float]:
    """A tiny model learns to copy random sentences (dropout 0.1 everywhere): the losses."""
    cfg = get_preset("debug-tiny", **TINY, dropout_p=0.1, attention_dropout_p=0.1, activation_dropout_p=0.1)
    model = build_model(cfg, seed=1)
    set_dropout_impl(model, impl)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    data = torch.Generator().manual_seed(7)
    torch.manual_seed(8)
    losses = []
    for _ in range(steps):
        src = torch.randint(4, 40, (16, 8), generator=data)
        tgt_in = torch.cat([torch.full((16, 1), 2), src[:, :-1]], dim=1)
        loss = F.cross_entropy(model(src, tgt_in).flatten(0, 1), src.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_training_converges_as_with_torch_dropout():
    """Other masks, the same distribution: the same learning curve up to the noise of the masks
    (the last 20 steps' mean loss within 15% of each other), and both far below the start."""
    torch_losses, bulk_losses = train_copy_task("torch"), train_copy_task("bulk")
    end_t, end_b = sum(torch_losses[-20:]) / 20, sum(bulk_losses[-20:]) / 20
    assert end_t < 0.5 * torch_losses[0] and end_b < 0.5 * bulk_losses[0]
    assert abs(end_b - end_t) < 0.15 * end_t
