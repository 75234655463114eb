"""Dropout, with a choice of where its random masks come from.

    dropout(x, p, training, impl)    # impl: "torch" (F.dropout) or "bulk"

"torch" is ``F.dropout``: on a CPU, ``bernoulli_`` draws one value of the sequential Mersenne
Twister per element on one thread, about a fifth of a CPU training update (BENCHMARKS.md); on a GPU
it is Philox inside a fused kernel and costs little.

"bulk" draws the mask's random bits in bulk: ``random_`` over 64-bit words gives eight uniform
bytes per draw, so the generator runs once per eight elements, and the rest is element-wise work
that runs on every thread. An element is kept when its byte ``u`` exceeds ``floor(256 p)``; the
ties (``u == floor(256 p)``, one element in 256) are kept with probability ``1 - frac(256 p)``,
drawn for them alone in float64 (all kept where 256 p is whole). So

    P(keep) = (255 - floor(256 p)) / 256 + (1 - frac(256 p)) / 256 = 1 - p

exactly, for every p (up to float64's 2^-53 in the ties' own draw), not p rounded to a multiple
of 1/256; the bytes are independent, so neighbouring elements and successive calls are too
(tests/test_dropout.py). The masks are other random numbers than torch's, drawn from torch's
generator: deterministic given its state, so a resumed run repeats an uninterrupted one, and
activation checkpointing (which replays the generator's state) recomputes the same masks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DROPOUT_IMPLS = ("torch", "bulk")


def keep_mask(shape: torch.Size | tuple[int, ...], p: float, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.bool) -> torch.Tensor:
    """A tensor of ``shape``, each element 1 (True) with probability exactly ``1 - p``, else 0."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    n = 1
    for s in shape:
        n *= s
    # The full 64-bit range (from = int64 min, to = None): random_() alone leaves the top bit zero.
    words = torch.empty((n + 7) // 8, dtype=torch.int64, device=device).random_(-2**63, None)
    u = words.view(torch.uint8)  # n rounded up to whole words: the word-wise search below needs them
    q = p * 256.0
    q8 = int(q)
    # Written straight into the mask's dtype: a float mask multiplies at full speed, where a bool
    # one is converted element by element (twice the time, forward and backward).
    keep = torch.ge(u, q8, out=torch.empty(u.shape, dtype=dtype, device=device))
    frac = q - q8
    if frac > 0.0:  # the ties are dropped with probability frac (none where 256 p is whole)
        tie = u == q8
        # One byte in 256 ties: searched for a 64-bit word at a time, 8x fewer elements to scan.
        words_with_ties = _nonzero(tie.view(torch.int64))
        candidates = (words_with_ties[:, None] * 8 + torch.arange(8, device=device)).flatten()
        ties = candidates[tie[candidates]]
        keep[ties] = (torch.rand(ties.numel(), dtype=torch.float64, device=device) >= frac).to(dtype)
    return keep[:n].view(shape)


def _nonzero(x: torch.Tensor) -> torch.Tensor:
    """``x.nonzero().squeeze(1)`` of a 1-d tensor, on one thread on a CPU. torch's CPU nonzero
    splits its two passes over the threads with a barrier between them; on a machine whose cores
    other processes share, the barrier waits for a descheduled thread: 64 ms against 8 ms on one
    thread for 10^6 words (2 threads, load average 7). One thread scans them in a few ms."""
    if x.device.type != "cpu" or torch.get_num_threads() == 1:
        return x.nonzero().squeeze(1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return x.nonzero().squeeze(1)
    finally:
        torch.set_num_threads(threads)


class _Masked(torch.autograd.Function):
    """``x * mask * scale``, the mask (0 or 1 in x's dtype) saved for the backward: torch's own
    CPU dropout arithmetic, so kept elements equal its ``x * (1 / (1 - p))`` bit for bit."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(mask)
        ctx.scale = scale
        return x.mul(mask).mul_(scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (mask,) = ctx.saved_tensors
        return grad.mul(mask).mul_(ctx.scale), None, None


def bulk_dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """Training-mode dropout of ``x`` with a ``keep_mask``."""
    return _Masked.apply(x, _mask_outside_graph(x.shape, p, x.device, x.dtype), 1.0 / (1.0 - p))


@torch.compiler.disable
def _mask_outside_graph(shape, p, device, dtype) -> torch.Tensor:
    # A compiled layer (engine.compile) takes the mask from eager code: the ties' count is data-
    # dependent, which a graph cannot hold without breaking anyway.
    return keep_mask(shape, p, device, dtype)


def dropout(x: torch.Tensor, p: float, training: bool, impl: str = "torch") -> torch.Tensor:
    """``F.dropout(x, p, training)`` with the masks of ``impl`` (this module's docstring)."""
    if impl == "torch" or not training or p == 0.0:
        return F.dropout(x, p, training)
    return bulk_dropout(x, p)
