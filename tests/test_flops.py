"""The FLOP count MFU divides by (admin_ds/model/flops.py) against an independent count: PyTorch's
``FlopCounterMode``, which adds up the matrix products the model actually dispatches (forward and
backward), on encoder-decoders of several depths and widths, with tied and untied output layers.

The counter knows the FLOPs of the CUDA attention kernels but not of the CPU one, so attention runs
on SDPA's math path here (the same products, spelled as batched matrix multiplications). Large
presets run on the meta device: shapes only, so the count is exact and costs no arithmetic.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from admin_ds.data import EpochBatchIterator
from admin_ds.data.binarize import open_split
from admin_ds.model import build_model
from admin_ds.model.flops import padding_fraction, training_flops
from admin_ds.presets import get_preset


def counted_flops(model, batch) -> int:
    """FLOPs of one forward and backward pass as FlopCounterMode counts them."""
    pad = model.cfg.pad_idx
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        logits = model(batch["src_tokens"], batch["tgt_in_tokens"])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["target"].flatten(), ignore_index=pad,
                               reduction="sum")
        loss.backward()
    return counter.get_total_flops()


def unpadded_batch(cfg, sentences: int, src_len: int, tgt_len: int) -> dict:
    g = torch.Generator().manual_seed(0)
    src = torch.randint(4, cfg.vocab_size, (sentences, src_len), generator=g)
    tgt = torch.randint(4, cfg.vocab_size, (sentences, tgt_len), generator=g)
    tgt_in = torch.cat([torch.full((sentences, 1), cfg.eos_idx), tgt[:, :-1]], dim=1)
    return dict(src_tokens=src, tgt_in_tokens=tgt_in, target=tgt)


def padded_batch(cfg, src_lengths, tgt_lengths) -> dict:
    """Right-padded sentences of the given lengths (each ends in EOS, as collate makes them)."""
    b = unpadded_batch(cfg, len(src_lengths), max(src_lengths), max(tgt_lengths))
    for i, (s, t) in enumerate(zip(src_lengths, tgt_lengths)):
        b["src_tokens"][i, s:] = cfg.pad_idx
        b["target"][i, t - 1] = cfg.eos_idx
        b["target"][i, t:] = cfg.pad_idx
        b["tgt_in_tokens"][i, t:] = cfg.pad_idx
    return b


TINY = dict(vocab_size=300, max_positions=128)
SHAPES = [  # (layers, widths, embeddings): depths, widths, tied and untied outputs
    dict(num_encoder_layers=1, num_decoder_layers=1, model_dim=32, ffn_inner_dim=64, num_heads=2),
    dict(num_encoder_layers=3, num_decoder_layers=2, model_dim=64, ffn_inner_dim=256, num_heads=4),
    dict(num_encoder_layers=2, num_decoder_layers=4, model_dim=48, ffn_inner_dim=96, num_heads=3,
         share_all_embeddings=False),  # separate source and target matrices, output tied to the target's
    dict(num_encoder_layers=2, num_decoder_layers=2, model_dim=64, ffn_inner_dim=128, num_heads=4,
         share_all_embeddings=False, share_decoder_input_output_embed=False),  # untied output projection
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "{num_encoder_layers}L-{num_decoder_layers}L-{model_dim}D".format(**s)
                         + ("" if s.get("share_all_embeddings", True) else "-separate")
                         + ("-untied" if s.get("share_decoder_input_output_embed", True) is False else ""))
def test_formula_equals_the_flop_counter_on_unpadded_batches(shape):
    cfg = get_preset("debug-tiny", **TINY, **shape)
    model = build_model(cfg, seed=1)
    for sentences, src_len, tgt_len in ((3, 7, 5), (2, 4, 11)):
        batch = unpadded_batch(cfg, sentences, src_len, tgt_len)
        ours, counted = training_flops(cfg, batch), counted_flops(model, batch)
        assert counted > 0
        assert abs(ours / counted - 1) < 0.02, (shape, sentences, src_len, tgt_len, ours, counted)
        assert training_flops(cfg, batch, padded=True) == ours  # nothing to pad


def test_padded_batches_count_the_padded_computation():
    """On padded batches the counter sees every position; the real-token formula counts less, by
    the padding overhead, and the padded formula matches the counter."""
    cfg = get_preset("debug-tiny", **TINY, **SHAPES[1])
    model = build_model(cfg, seed=1)
    batch = padded_batch(cfg, src_lengths=[9, 6, 4, 9], tgt_lengths=[7, 8, 3, 5])
    counted = counted_flops(model, batch)
    padded, real = training_flops(cfg, batch, padded=True), training_flops(cfg, batch)
    assert abs(padded / counted - 1) < 0.02, (padded, counted)
    assert real / counted < 0.8
    # by hand: source 28 of 4 x 9 positions real, target 23 of 4 x 8
    assert padding_fraction([batch], cfg.pad_idx) == pytest.approx(1 - (28 + 23) / (36 + 32))


@pytest.mark.parametrize("preset,tied", [("base-6L-6L", True), ("big-6L-6L", True), ("admin-60L-12L", True),
                                         ("admin-18L-18L", False)])
def test_presets_on_the_meta_device(preset, tied):
    """The papers' sizes at a 32k vocabulary (shapes only: no arithmetic)."""
    over = {} if tied else dict(share_all_embeddings=False, share_decoder_input_output_embed=False)
    cfg = get_preset(preset, vocab_size=32768, **over)
    batch = unpadded_batch(cfg, 16, 31, 29)
    counted = counted_flops(build_model(cfg, device="meta"), {k: v.to("meta") for k, v in batch.items()})
    assert abs(training_flops(cfg, batch) / counted - 1) < 0.02, (preset, training_flops(cfg, batch), counted)


def test_padding_overhead_of_real_token_buckets(data_dir):
    """Token buckets of the generated corpus at 4,096 tokens, base-6L-6L: the padded formula
    matches the counter, and the real-token count is below it by the padding (printed)."""
    from admin_ds.data.binarize import load_manifest

    manifest = load_manifest(data_dir)
    cfg = get_preset("base-6L-6L", vocab_size=manifest["vocab_size"])
    it = EpochBatchIterator(open_split(data_dir, "train", manifest), 4096, cfg.pad_idx, cfg.eos_idx, seed=1)
    model = build_model(cfg, device="meta")
    for _ in range(3):
        batch = it.next_batch()
        meta = {k: batch[k].to("meta") for k in ("src_tokens", "tgt_in_tokens", "target")}
        counted = counted_flops(model, meta)
        padded, real = training_flops(cfg, batch, padded=True), training_flops(cfg, batch)
        assert abs(padded / counted - 1) < 0.02, (padded, counted)
        print(f"padding {padding_fraction([batch], cfg.pad_idx):.3f}: real-token FLOPs / counted "
              f"{real / counted:.3f}")
        assert real < padded
