"""How much Q/K/V projection biases move Admin's profiled omega (docs/admin_reference.md).

    python bench/qkv_bias_omega.py --data DATA_DIR                      # a prepared data directory
    python bench/qkv_bias_omega.py --data DATA_DIR --dims 64 512 --depths 6 18 --seeds 5

The reference (Transformer-Clinic) zeroes the Q/K/V biases; fairseq 0.9's separate projections
keep PyTorch's default U(-1/sqrt(D), 1/sqrt(D)). For each width, depth and seed: build the Admin
model (zero biases, as admin-ds initialises it), profile omega (reference formula, dropout 0.1 on,
as the reference profiles) on the first training micro-batch of DATA_DIR, then draw the Q/K/V
biases of every attention module from U(-1/sqrt(D), 1/sqrt(D)) and profile again with the same
torch seed (identical dropout masks). Printed per configuration: the largest and the mean relative
change |omega_uniform - omega_zero| / omega_zero over all sub-layers and seeds, per stack.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys

import numpy as np
import torch


def first_batch(data_dir: str, max_tokens: int, pad: int, eos: int, seed: int):
    from admin_ds.data import EpochBatchIterator
    from admin_ds.data.binarize import load_manifest, open_split

    manifest = load_manifest(data_dir)
    it = EpochBatchIterator(open_split(data_dir, "train", manifest), max_tokens, pad, eos, seed=seed, shuffle=True)
    b = it.next_batch()
    return manifest["vocab_size"], (b["src_tokens"], b["tgt_in_tokens"])


def changes(dim: int, depth: int, seed: int, vocab: int, batch) -> dict[str, np.ndarray]:
    from admin_ds.model import build_model, get_preset
    from admin_ds.model.layers import MultiheadAttention
    from admin_ds.profiling import profile_omega

    cfg = get_preset("base-6L-6L", init="admin", vocab_size=vocab, model_dim=dim, ffn_inner_dim=4 * dim,
                     num_heads=max(4, dim // 64), num_encoder_layers=depth, num_decoder_layers=depth)
    model = build_model(cfg, seed=seed)
    zero = profile_omega(model, batch, seed=seed)
    g = torch.Generator().manual_seed(10_000 + seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, MultiheadAttention):
                for proj in (m.q_proj, m.k_proj, m.v_proj):
                    proj.bias.uniform_(-dim ** -0.5, dim ** -0.5, generator=g)
    uniform = profile_omega(model, batch, seed=seed)
    return {st: np.abs(np.array(uniform.omega(st)) / np.array(zero.omega(st)) - 1) for st in ("encoder", "decoder")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="a prepared data directory (manifest.json, train split)")
    p.add_argument("--dims", type=int, nargs="+", default=[64, 512])
    p.add_argument("--depths", type=int, nargs="+", default=[6, 18])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=4096, help="the profiling micro-batch, in padded tokens")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    vocab, batch = first_batch(args.data, args.max_tokens, pad=1, eos=2, seed=1)
    pad_share = float(torch.cat([batch[0].eq(1).flatten(), batch[1].eq(1).flatten()]).float().mean())
    print(f"# {datetime.date.today()}, torch {torch.__version__}, {platform.machine()}; batch {tuple(batch[0].shape)} "
          f"src, {tuple(batch[1].shape)} tgt, {pad_share:.0%} padding; {args.seeds} seeds")
    print("| D | layers | encoder max | encoder mean | decoder max | decoder mean |")
    print("|---|---|---|---|---|---|")
    for dim in args.dims:
        for depth in args.depths:
            runs = [changes(dim, depth, s, vocab, batch) for s in range(args.seeds)]
            cells = []
            for st in ("encoder", "decoder"):
                allc = np.concatenate([r[st] for r in runs])
                cells += [f"{allc.max():.2%}", f"{allc.mean():.2%}"]
            print(f"| {dim} | {depth}L-{depth}L | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
