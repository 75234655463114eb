"""Admin profiling against an independent re-implementation of the reference code, on batches with
heavy, uneven padding: one process, two data-parallel ranks, two pipeline stages; and the profile
files of the reference codes (Transformer-Clinic's ``profile.ratio.init``, deepnmt's bare list).

``fairseq_omega`` below is written from the reference's definition (Transformer-Clinic's fairseq
0.8 Post-LN Transformer and its profiling pass, docs/admin_reference.md), with plain torch ops on
the model's weights read by state-dict name: none of the project's modules, recorder or
statistics run in it. It works in float64, so what it checks is the project's float32 pass.
"""

import json
import math

import numpy as np
import pytest
import torch

from admin_ds.errors import ProfileError
from admin_ds.model import build_model
from admin_ds.presets import get_preset
from admin_ds.profiling import Profile, apply_omega, profile_omega

from conftest import NO_DROPOUT, PIPE, ZERO, overrides
from distributed import spawn

PAD, EOS = 1, 2


# ---- the independent computation ----------------------------------------------------------------


def sinusoids(num_positions, dim, pad):
    """fairseq's SinusoidalPositionalEmbedding.get_embedding: sines, then cosines; zero pad row."""
    half = dim // 2
    freq = np.exp(np.arange(half) * -(math.log(10000) / (half - 1)))
    angles = np.arange(num_positions)[:, None] * freq[None, :]
    table = np.concatenate([np.sin(angles), np.cos(angles)], axis=1)
    table[pad] = 0
    return torch.from_numpy(table)


def embed(w, tokens, dim):
    """embed_scale * E[tokens] + positions (fairseq make_positions: pad+1, pad+2, ... over real
    tokens, pad at padding); dropout 0."""
    real = tokens.ne(PAD).long()
    positions = torch.cumsum(real, 1) * real + PAD
    return math.sqrt(dim) * w["src_embed.weight"][tokens] + sinusoids(int(positions.max()) + 1, dim, PAD)[positions]


def attention(w, prefix, query, memory, key_pad, heads, causal=False):
    """fairseq MultiheadAttention: q scaled by head_dim^-0.5, future mask added as -inf, padded
    keys filled with -inf, softmax, out_proj. (B, T, D) batch-first here."""
    lin = lambda x, name: x @ w[f"{prefix}.{name}.weight"].T + w[f"{prefix}.{name}.bias"]
    b, t, d = query.shape
    s, dh = memory.shape[1], d // heads
    split = lambda x, n: x.reshape(b, n, heads, dh).transpose(1, 2)
    q = split(lin(query, "q_proj") * dh ** -0.5, t)
    k, v = split(lin(memory, "k_proj"), s), split(lin(memory, "v_proj"), s)
    scores = q @ k.transpose(-1, -2)
    if causal:
        scores = scores + torch.triu(torch.full((t, s), -math.inf, dtype=scores.dtype), 1)
    scores = scores.masked_fill(key_pad[:, None, None, :], -math.inf)
    out = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, t, d)
    return lin(out, "out_proj")


def ffn(w, prefix, x):
    h = torch.relu(x @ w[f"{prefix}.fc1.weight"].T + w[f"{prefix}.fc1.bias"])
    return h @ w[f"{prefix}.fc2.weight"].T + w[f"{prefix}.fc2.bias"]


def layer_norm(w, prefix, x):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + 1e-5) * w[f"{prefix}.weight"] + w[f"{prefix}.bias"]


def pooled_var(tensors):
    """numpy's population variance over every element of every tensor, padding included: the
    reference's np.var over one batch, here over the union of the ranks' batches."""
    return float(np.var(np.concatenate([t.numpy().ravel() for t in tensors])))


def fairseq_omega(state, cfg, batches, formula):
    """Omega of every sub-layer, encoder then decoder, from one pass over ``batches`` (a list of
    (src, tgt_in) pairs, one per data-parallel rank) walked in lockstep, the variances pooled.

    reference: omega_1 = 1, omega_{i+1} = sqrt(Var[omega_i * x] + Var[f_i(x)]), and the pass uses
    omega_i in b_i = omega_i * x + f_i(x), x_i = LN(b_i); paper: a pass with omega = 1, then
    omega_i = sqrt(sum_{j<i} Var[f_j(x)]), omega_1 = 1."""
    w = {k: v.double() for k, v in state.items()}
    d, h = cfg.model_dim, cfg.num_heads

    def chain(xs, steps):
        omega, used, var_f = 1.0, [], []
        for branch, norm in steps:
            use = omega if formula == "reference" else 1.0
            shortcuts = [use * x for x in xs]
            fs = [branch(i, x) for i, x in enumerate(xs)]
            used.append(use)
            var_f.append(pooled_var(fs))
            omega = math.sqrt(pooled_var(shortcuts) + var_f[-1])
            xs = [layer_norm(w, norm, s + f) for s, f in zip(shortcuts, fs)]
        if formula == "paper":
            used = [1.0] + [math.sqrt(sum(var_f[:i])) for i in range(1, len(var_f))]
        return xs, used

    srcs, tgts = [b[0] for b in batches], [b[1] for b in batches]
    steps = []
    for l in range(cfg.num_encoder_layers):
        p = f"encoder_layers.{l}"
        steps += [(lambda i, x, p=p: attention(w, f"{p}.self_attn", x, x, srcs[i].eq(PAD), h), f"{p}.self_attn_layer_norm"),
                  (lambda i, x, p=p: ffn(w, f"{p}.ffn", x), f"{p}.final_layer_norm")]
    encs, enc_omega = chain([embed(w, s, d) for s in srcs], steps)
    steps = []
    for l in range(cfg.num_decoder_layers):
        p = f"decoder_layers.{l}"
        # fairseq's decoder: the causal mask and self_attn_padding_mask (target padding)
        steps += [(lambda i, y, p=p: attention(w, f"{p}.self_attn", y, y, tgts[i].eq(PAD), h, causal=True),
                   f"{p}.self_attn_layer_norm"),
                  (lambda i, y, p=p: attention(w, f"{p}.encoder_attn", y, encs[i], srcs[i].eq(PAD), h),
                   f"{p}.encoder_attn_layer_norm"),
                  (lambda i, y, p=p: ffn(w, f"{p}.ffn", y), f"{p}.final_layer_norm")]
    _, dec_omega = chain([embed(w, t, d) for t in tgts], steps)
    return enc_omega, dec_omega


def padded_batch(src_lengths, tgt_lengths, vocab, seed):
    """Right-padded (src, tgt_in) with the given real lengths; tgt_in starts with EOS."""
    g = torch.Generator().manual_seed(seed)
    src = torch.full((len(src_lengths), max(src_lengths)), PAD)
    tgt = torch.full((len(tgt_lengths), max(tgt_lengths)), PAD)
    for row, (ls, lt) in enumerate(zip(src_lengths, tgt_lengths)):
        src[row, :ls] = torch.randint(4, vocab, (ls,), generator=g)
        tgt[row, :lt] = torch.randint(4, vocab, (lt,), generator=g)
        tgt[row, 0] = EOS
    return src, tgt


# Heavy and uneven: 58% of the source and 50% of the target positions are padding on rank 0;
# rank 1 has other lengths, so the two ranks' tensors have different shapes.
RANK_LENGTHS = [([3, 24, 9, 5, 17, 2], [21, 4, 12, 3, 7, 16]), ([11, 2, 6, 14], [3, 18, 9, 5])]


def rel(a, b):
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    return float(np.max(np.abs(a - b) / np.abs(b)))


# ---- one process ------------------------------------------------------------------------------


@pytest.mark.parametrize("formula", ["reference", "paper"])
def test_profile_on_padded_batch_equals_independent_computation(formula):
    cfg = get_preset("debug-tiny", num_encoder_layers=4, num_decoder_layers=3, **{k: 0.0 for k in (
        "dropout_p", "attention_dropout_p", "activation_dropout_p")})
    model = build_model(cfg, seed=3)
    src, tgt = padded_batch(*RANK_LENGTHS[0], cfg.vocab_size, seed=0)
    assert src.eq(PAD).float().mean() > 0.55 and tgt.eq(PAD).float().mean() >= 0.5
    want_enc, want_dec = fairseq_omega(model.state_dict(), cfg, [(src, tgt)], formula)
    prof = profile_omega(model, (src, tgt), formula=formula)
    assert rel(prof.omega("encoder"), want_enc) <= 1e-6
    assert rel(prof.omega("decoder"), want_dec) <= 1e-6
    assert len(want_enc) == 8 and len(want_dec) == 9
    # omega grows along each chain (the point of Admin), and profile_omega wrote it into the model
    assert want_enc[-1] > max(want_enc[1], 1.0) and want_dec[-1] > max(want_dec[1], 1.0)
    omega = model.encoder_layers[1].ffn_residual.omega
    assert torch.allclose(omega, torch.full_like(omega, prof.omega("encoder")[3]))


def test_independent_computation_sees_the_decoder_padding_mask_and_the_padding():
    """The comparison above can fail: without the target padding mask in the decoder's
    self-attention, or with padding left out of the variances, omega moves well beyond 1e-6."""
    cfg = get_preset("debug-tiny", num_encoder_layers=2, num_decoder_layers=3, **{k: 0.0 for k in (
        "dropout_p", "attention_dropout_p", "activation_dropout_p")})
    model = build_model(cfg, seed=3)
    src, tgt = padded_batch(*RANK_LENGTHS[0], cfg.vocab_size, seed=0)
    _, want_dec = fairseq_omega(model.state_dict(), cfg, [(src, tgt)], "reference")
    no_tgt_pad = tgt.clone()
    no_tgt_pad[no_tgt_pad.eq(PAD)] = 5  # same real tokens, padded positions now unmasked keys
    _, unmasked = fairseq_omega(model.state_dict(), cfg, [(src, no_tgt_pad)], "reference")
    assert rel(unmasked[1:], want_dec[1:]) > 1e-3
    masked = profile_omega(model, (src, tgt), mask_padding=True)
    assert rel(masked.omega("decoder")[1:], want_dec[1:]) > 1e-3


# ---- two data-parallel ranks, two pipeline stages --------------------------------------------------


def _rank_batches(vocab):
    out = []
    for seed, lengths in enumerate(RANK_LENGTHS):
        src, tgt = padded_batch(*lengths, vocab, seed)
        out.append({"src": src.tolist(), "tgt": tgt.tolist()})
    return out


def _vocab(data_dir):
    return json.loads((data_dir / "manifest.json").read_text())["vocab_size"]


def _expected(data_dir, ov, batches, formula):
    """The independent computation with the weights the ranks build (same config, same seed)."""
    from admin_ds.train.run_config import load_run_config

    run = load_run_config(None, ov)
    cfg = run.model.build(vocab_size=_vocab(data_dir))
    state = build_model(cfg, seed=run.train.seed).state_dict()
    pairs = [(torch.tensor(b["src"]), torch.tensor(b["tgt"])) for b in batches]
    return fairseq_omega(state, cfg, pairs, formula)


def test_two_ranks_profile_padded_batches_like_the_independent_computation(tmp_path, data_dir):
    """Each rank profiles its own padded batch (different shapes); the reduced omega equals the
    independent computation with the variances pooled over both batches' elements, padding
    included (mask_padding off, as in the reference), for both formulas."""
    ov = overrides(tmp_path / "run", data_dir, *NO_DROPOUT, "--model.num_encoder_layers=3",
                   "--model.num_decoder_layers=3")
    batches = _rank_batches(_vocab(data_dir))
    res = spawn(2, "profile_batches", tmp_path / "out", run_overrides=ov, ds=ZERO[1], tmp=str(tmp_path),
                batches=batches)
    assert res[0] == res[1]  # identical on every rank (both hold the whole model)
    for formula in ("reference", "paper"):
        enc, dec = _expected(data_dir, ov, batches, formula)
        got = res[0][formula]
        assert rel(got["encoder"], enc) <= 1e-6 and rel(got["decoder"], dec) <= 1e-6, formula
        # and not what either rank's batch alone gives: the statistics were reduced
        alone = _expected(data_dir, ov, batches[:1], formula)
        assert rel(got["decoder"][1:], alone[1][1:]) > 1e-4, formula


def test_two_pipeline_stages_profile_a_padded_batch_like_the_independent_computation(tmp_path, data_dir):
    """Stage 0 holds the encoder and decoder layers 0-1, stage 1 layers 2-3: the running omega
    and the target padding mask (rebuilt from token ids on the second stage) cross the boundary."""
    ov = overrides(tmp_path / "run", data_dir, *NO_DROPOUT, "--model.num_encoder_layers=2",
                   "--model.num_decoder_layers=4")
    batches = _rank_batches(_vocab(data_dir))[:1]
    res = spawn(2, "profile_batches", tmp_path / "out", run_overrides=ov, ds=PIPE, tmp=str(tmp_path),
                batches=batches)
    assert res[0]["stage_decoder_layers"] == [0, 1] and res[1]["stage_decoder_layers"] == [2, 3]
    for formula in ("reference", "paper"):
        assert res[0][formula] == res[1][formula]
        enc, dec = _expected(data_dir, ov, batches, formula)
        got = res[0][formula]
        assert rel(got["encoder"], enc) <= 1e-6 and rel(got["decoder"], dec) <= 1e-6, formula


# ---- the reference codes' profile files ------------------------------------------------------------


def test_deepnmt_profile_maps_by_position(tmp_path):
    """deepnmt's --admin-init-path file: one omega per line, the encoder's 2N sub-layers then the
    decoder's 3M, nothing marking the boundary (its TransformerEncoderLayer/DecoderLayer read
    the values in build order)."""
    cfg = get_preset("debug-tiny", num_encoder_layers=2, num_decoder_layers=1)
    values = [1.0, 1.25, 1.5, 1.75, 1.0, 2.5, 3.0]  # 4 encoder + 3 decoder
    path = tmp_path / "profile.init"
    path.write_text("".join(f"{v}\n" for v in values))
    prof = Profile.load(path, cfg)
    assert prof.omega("encoder") == values[:4] and prof.omega("decoder") == values[4:]
    assert [(s.stack, s.index) for s in prof.sublayers][3:5] == [("encoder", 4), ("decoder", 1)]
    prof.check_matches(cfg)
    model = build_model(cfg, seed=0)
    apply_omega(model, prof)
    assert model.encoder_layers[1].self_attn_residual.omega[0].item() == 1.5
    assert model.decoder_layers[0].encoder_attn_residual.omega[0].item() == 2.5


@pytest.mark.parametrize("text,cfg_kw,message", [
    ("1.0\n1.2\n1.3\n", dict(num_encoder_layers=2, num_decoder_layers=1),
     r"profile.init: 3 omega values; the model has 4 encoder \+ 3 decoder = 7 sub-layers \(2L-1L\)"),
    ("1.0\n1.2\nabc\n", dict(num_encoder_layers=2, num_decoder_layers=1),
     r"profile.init:3: expected one omega per line \(deepnmt's format\), got 'abc'"),
    ("1.0\n-1.2\n", dict(), r"profile.init:2: omega must be positive and finite, got -1.2"),
    ("1.0\nnan\n", dict(), r"profile.init:2: omega must be positive and finite, got nan"),
])
def test_deepnmt_profile_errors_name_the_file_and_line(tmp_path, text, cfg_kw, message):
    path = tmp_path / "profile.init"
    path.write_text(text)
    with pytest.raises(ProfileError, match=message):
        Profile.load(path, get_preset("debug-tiny", **cfg_kw))


def test_deepnmt_profile_needs_the_model_config(tmp_path):
    path = tmp_path / "profile.init"
    path.write_text("1.0\n1.1\n")
    with pytest.raises(ProfileError, match="mapped to sub-layers by position: give the model config"):
        Profile.load(path)

