"""A debug-tiny Admin model trained in-process (~10 s) to copy its input, ids 4..39: unlike a model
trained for a few updates, its translations end at varied lengths. Trained omega leaves the first
sub-layers' omega != 1 (an embedding-output scale once folded). Used by test_translate.py and
test_export.py."""

import random

import torch
import torch.nn.functional as F

from admin_ds.inference.model_file import save_model_file
from admin_ds.model import build_model
from admin_ds.presets import get_preset

PAD, EOS = 1, 2
NO_DROPOUT = dict(dropout_p=0.0, attention_dropout_p=0.0, activation_dropout_p=0.0)


def train_copy_model(path, vocab_size: int, subword_model_bytes: bytes, updates: int = 150):
    """Train the copy model and save it as a model file at ``path`` with the given subword model
    (whose vocabulary size it takes); returns ``path``."""
    torch.manual_seed(0)
    cfg = get_preset("debug-tiny", vocab_size=vocab_size, max_positions=64, **NO_DROPOUT)
    model = build_model(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=5e-3, betas=(0.9, 0.98))
    g = random.Random(0)
    for step in range(updates):
        for group in opt.param_groups:
            group["lr"] = 5e-3 * min((step + 1) / 20, 1.0 - 0.9 * step / updates)
        seqs = [[g.randrange(4, 40) for _ in range(g.randint(3, 8))] for _ in range(48)]
        w = max(map(len, seqs)) + 1
        src, tin, tout = (torch.full((48, w), PAD) for _ in range(3))
        for i, s in enumerate(seqs):
            src[i, :len(s) + 1] = torch.tensor(s + [EOS])
            tin[i, :len(s) + 1] = torch.tensor([EOS] + s)
            tout[i, :len(s) + 1] = torch.tensor(s + [EOS])
        loss = F.cross_entropy(model(src, tin).view(-1, vocab_size), tout.view(-1), ignore_index=PAD)
        opt.zero_grad()
        loss.backward()
        opt.step()
    save_model_file(path, cfg, model.state_dict(), None, None, subword_model_bytes, {"source": "copy task"})
    return path


def copy_sources(n: int = 12, seed: int = 1) -> torch.Tensor:
    """(n, S) right-padded EOS-terminated sources of 1-8 ids in 4..39."""
    g = random.Random(seed)
    seqs = [[g.randrange(4, 40) for _ in range(g.randint(1, 8))] + [EOS] for _ in range(n)]
    src = torch.full((n, max(map(len, seqs))), PAD)
    for i, s in enumerate(seqs):
        src[i, :len(s)] = torch.tensor(s)
    return src
