"""Floating-point operations of a training step: what model-FLOPs utilisation (MFU) divides by.

    flops = training_flops(cfg, batch)                 # forward + backward, real tokens only
    padded = training_flops(cfg, batch, padded=True)   # what the padded tensors actually compute

Counted are the matrix products, as MFU counts them (PaLM, appendix B; Megatron-LM): LayerNorm,
softmax, dropout, biases and the loss are left out. For one sentence pair with S source and T
target tokens, the forward pass costs

    2 * ((P_enc + P_kv) * S + (P_dec - P_kv + V * D) * T)   products with weight matrices
    + 4 * D * (L_enc * S^2 + L_dec * (T^2 + T * S))         attention scores and weighted values

where P_enc = L_enc (4 D^2 + 2 D F) and P_dec = L_dec (8 D^2 + 2 D F) are the weight-matrix
parameters of the layers, P_kv = L_dec 2 D^2 those of the encoder-attention's key and value
projections, which read the encoder output and so run once per *source* token, and V * D the
output projection. Causal self-attention is counted as the full T x T product, because that is
what the kernels compute. Backward costs twice the
forward (a gradient for the input and one for the weight of every product), so a training step
is 3x the forward pass.

``padded=False`` counts the real tokens of each sentence (MFU should not credit padding);
``padded=True`` counts every position of the padded (B, S) and (B, T) tensors, which is what the
model runs and what ``torch.utils.flop_counter.FlopCounterMode`` measures (tests/test_flops.py).
Their ratio is the padding overhead of the batch.
"""

from __future__ import annotations

from typing import Iterable

import torch

from admin_ds.model.config import ModelConfig


def weights_per_token(cfg: ModelConfig) -> tuple[int, int]:
    """Weight-matrix parameters each source token and each target token passes through (biases,
    norms and omega excluded: they cost no matrix product)."""
    d, f = cfg.model_dim, cfg.ffn_inner_dim
    p_enc = cfg.num_encoder_layers * (4 * d * d + 2 * d * f)
    p_dec = cfg.num_decoder_layers * (8 * d * d + 2 * d * f)
    p_kv = cfg.num_decoder_layers * 2 * d * d  # encoder-attention keys and values: source tokens
    return p_enc + p_kv, p_dec - p_kv + cfg.vocab_size * d


def forward_flops(cfg: ModelConfig, src_lengths: torch.Tensor, tgt_lengths: torch.Tensor) -> float:
    """Forward-pass FLOPs of sentence pairs with these source and target lengths (1-D tensors)."""
    s, t = src_lengths.double(), tgt_lengths.double()
    per_src, per_tgt = weights_per_token(cfg)
    d = cfg.model_dim
    weights = 2 * (per_src * s.sum() + per_tgt * t.sum())
    attention = 4 * d * (cfg.num_encoder_layers * (s * s).sum()
                         + cfg.num_decoder_layers * ((t * t).sum() + (t * s).sum()))
    return float(weights + attention)


def training_flops(cfg: ModelConfig, batch: dict, padded: bool = False) -> float:
    """Forward + backward FLOPs of one collated batch (``src_tokens`` (B, S), ``target`` (B, T))."""
    src, tgt = batch["src_tokens"], batch["target"]
    if padded:
        s = torch.full((src.size(0),), src.size(1))
        t = torch.full((tgt.size(0),), tgt.size(1))
    else:
        s, t = src.ne(cfg.pad_idx).sum(1), tgt.ne(cfg.pad_idx).sum(1)
    return 3 * forward_flops(cfg, s, t)


def update_flops(cfg: ModelConfig, batches: Iterable[dict], padded: bool = False) -> float:
    """Forward + backward FLOPs of the micro-batches of an update (or of several updates)."""
    return sum(training_flops(cfg, b, padded) for b in batches)


def token_counts(batches: Iterable[dict], pad_idx: int) -> tuple[int, int]:
    """(real tokens, positions) of the source and target tensors of ``batches``."""
    real = total = 0
    for b in batches:
        for key in ("src_tokens", "target"):
            real += int(b[key].ne(pad_idx).sum())
            total += b[key].numel()
    return real, total


def padding_fraction(batches: Iterable[dict], pad_idx: int) -> float:
    """Share of the source and target positions of ``batches`` that are padding."""
    real, total = token_counts(batches, pad_idx)
    return 1.0 - real / max(total, 1)
