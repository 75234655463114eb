"""Model core: equivalences and exactness against independent references (CPU, tiny preset)."""

import math

import pytest
import torch

from admin_ds.model.config import ConfigError, admin_constant_omega, deepnorm_constants, tfixup_constants
from admin_ds.fold import fold_omega
from admin_ds.model import build_model
from admin_ds.model.layers import IncrementalState
from admin_ds.presets import PRESET_NAMES, get_preset, parameter_count
from admin_ds.profiling import Profile, profile_omega

PAD, EOS = 1, 2
NO_DROPOUT = dict(dropout_p=0.0, attention_dropout_p=0.0, activation_dropout_p=0.0)


def tiny(**kw):
    return get_preset("debug-tiny", **kw)


def batch(seed=0, b=4, s=9, t=7, vocab=1000, pad_src=True, pad_tgt=True):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, vocab, (b, s), generator=g)
    tgt = torch.randint(4, vocab, (b, t), generator=g)
    tgt[:, 0] = EOS
    if pad_src:
        src[0, s - 3:] = PAD
    if pad_tgt:
        tgt[1, t - 2:] = PAD
    return src, tgt


def seeded_model(cfg, seed=0):
    torch.manual_seed(seed)
    return build_model(cfg)


# ---- profiling (against an independent computation: tests/test_profile_reference.py) -------------


def test_profile_runs_in_train_mode_with_dropout_and_restores_mode():
    model = seeded_model(tiny())
    model.eval()
    src, tgt = batch()
    p1 = profile_omega(model, (src, tgt), seed=3)
    p2 = profile_omega(model, (src, tgt), seed=4)
    assert not model.training
    assert p1.omega("encoder") != p2.omega("encoder")  # different dropout masks were drawn
    assert profile_omega(model, (src, tgt), seed=3).omega("encoder") == p1.omega("encoder")


def test_profile_mask_padding_uses_real_tokens_only():
    cfg = tiny(dropout_p=0.0, attention_dropout_p=0.0, activation_dropout_p=0.0)
    model = seeded_model(cfg)
    src, tgt = batch()
    masked = profile_omega(model, (src, tgt), mask_padding=True)
    assert masked.sublayers[0].count == int(src.ne(PAD).sum()) * cfg.model_dim
    plain = profile_omega(model, (src, tgt), mask_padding=False)
    assert plain.sublayers[0].count == src.numel() * cfg.model_dim
    assert masked.omega("encoder") != plain.omega("encoder")


def test_profile_files_roundtrip(tmp_path):
    model = seeded_model(tiny())
    prof = profile_omega(model, batch(), seed=1)
    prof.save(tmp_path / "admin_profile.json")
    again = Profile.load(tmp_path / "admin_profile.json")
    assert again == prof
    (tmp_path / "profile.ratio.init").write_text(prof.to_ratio_init())
    text = (tmp_path / "profile.ratio.init").read_text().splitlines()
    assert text[0] == "1 1.0" and text[4].startswith("1 ")  # 2N=4 encoder lines, then decoder restarts
    imported = Profile.load(tmp_path / "profile.ratio.init")
    assert imported.omega("encoder") == prof.omega("encoder")
    assert imported.omega("decoder") == prof.omega("decoder")
    (tmp_path / "bad.init").write_text("1 1.0\n3 1.2\n")
    with pytest.raises(ValueError, match=r"bad.init:2: expected index 2"):
        Profile.load(tmp_path / "bad.init")
    deeper = seeded_model(tiny(num_encoder_layers=3))
    with pytest.raises(ValueError, match="has 4 encoder and 6 decoder sub-layers; the model has 6 and 6"):
        imported.check_matches(deeper)


def test_profile_refuses_non_admin_model():
    with pytest.raises(TypeError, match="needs Admin residuals"):
        profile_omega(seeded_model(tiny(init="default")), batch())


# ---- Admin with omega = 1 is Post-LN --------------------------------------------------------------


def test_admin_with_unit_omega_equals_default_post_ln_exactly():
    admin = seeded_model(tiny(init="admin"))
    default = seeded_model(tiny(init="default"))
    sd = {k: v for k, v in admin.state_dict().items() if not k.endswith("omega")}
    assert all(torch.equal(sd[k], v) for k, v in default.state_dict().items())  # same draws
    src, tgt = batch()
    admin.eval(), default.eval()
    assert torch.equal(admin(src, tgt), default(src, tgt))
    admin.train(), default.train()
    torch.manual_seed(5)
    a = admin(src, tgt)
    torch.manual_seed(5)
    assert torch.equal(a, default(src, tgt))


# ---- folding --------------------------------------------------------------------------------------


def _perturb_omega_by_training(model, steps=3):
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for i in range(steps):
        src, tgt = batch(seed=10 + i)
        loss = model(src, tgt).logsumexp(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float64, 1e-9)])
@pytest.mark.parametrize("trained", [False, True])
def test_fold_omega_keeps_outputs(dtype, tol, trained):
    model = seeded_model(tiny(num_encoder_layers=6, num_decoder_layers=3)).to(dtype)
    profile_omega(model, batch(seed=1), seed=0)
    assert max(profile_omega(model, batch(seed=1), seed=0).omega("encoder")) > 2.0  # far from 1
    if trained:
        _perturb_omega_by_training(model)
        omega = model.encoder_layers[2].ffn_residual.omega
        assert omega.std() > 1e-3  # non-uniform across dimensions
        assert model.encoder_layers[0].self_attn_residual.omega.sub(1).abs().max() > 1e-3
    model.eval()
    folded = fold_omega(model)
    assert not any(k.endswith("omega") for k in folded.state_dict())
    assert folded.cfg.init == "default"
    assert folded.cfg.embedding_output_scale == trained  # only when omega_1 moved off 1
    for seed in range(3):
        src, tgt = batch(seed=100 + seed)
        diff = (model(src, tgt) - folded(src, tgt)).abs().max().item()
        assert diff <= tol, diff
    # the shared embedding stays one matrix
    assert folded.tgt_embed is None


def test_fold_deepnorm_alpha():
    model = seeded_model(tiny(init="deepnorm")).double().eval()
    folded = fold_omega(model)
    src, tgt = batch()
    assert (model(src, tgt) - folded(src, tgt)).abs().max() < 1e-9


# ---- decoding-related exactness -----------------------------------------------------------------


@pytest.mark.parametrize("norm_order,init", [("post", "admin"), ("pre", "default"), ("post", "t-fixup")])
def test_incremental_decoding_equals_full_forward(norm_order, init):
    model = seeded_model(tiny(norm_order=norm_order, init=init)).eval()
    profile_omega(model, batch(), seed=0) if init == "admin" else None
    src, tgt = batch(pad_tgt=False)
    full = model(src, tgt)
    enc, src_pad = model.encode(src)
    state = IncrementalState()
    steps = [model.decode(tgt[:, t:t + 1], enc, src_pad, state) for t in range(tgt.size(1))]
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5)
    # reordering the cache follows beam search's choice of hypotheses
    order = torch.tensor([2, 0, 0, 1])
    enc, src_pad = model.encode(src)
    state = IncrementalState()
    for t in range(3):
        model.decode(tgt[:, t:t + 1], enc, src_pad, state)
    state.reorder(order)
    state.reorder_encoder(order)  # here every row is its own sentence
    step = model.decode(tgt[order, 3:4], enc[order], src_pad[order], state)
    assert torch.allclose(step, model(src[order], tgt[order, :4])[:, 3:4], atol=1e-5)


def test_a_reorder_that_moves_few_rows_copies_them_in_place():
    """IncrementalState.reorder copies only the rows that change when most stay (a row that takes
    another's positions while its own are taken by a third: the read must come first). Each step
    the caches hold what plain indexing of the whole history gives, across reorders that move
    none, one, a cycle of three, or most of the rows (the spare-buffer path), and a shrink."""
    torch.manual_seed(0)
    state, key, rows = IncrementalState(capacity=2), 3, 12
    history = torch.empty(2, rows, 2, 0, 3)  # keys and values, (rows, H, n, Dh) each
    same = list(range(12))
    orders = [same, same[:11] + [10], [1, 2, 0] + same[3:], same[::-1], [0, 0] + same[2:],
              [5, 1, 2, 3], [0, 1, 2, 3]]
    for order in [None, *map(torch.tensor, orders)]:
        if order is not None:
            state.reorder(order)
            history = history[:, order]
        new = torch.randn(2, history.size(1), 2, 1, 3)
        history = torch.cat([history, new], dim=3)
        got = state.append(key, *new.unbind(0))
        state.length += 1
        assert torch.equal(torch.stack(got), history)
    assert history.size(3) == len(orders) + 1


def test_incremental_state_grows_and_takes_several_positions_per_step():
    """A capacity of 1 forces the cache to grow (1 -> 2 -> 4 -> 8); steps of 3, 1 and 3 new
    positions (causal within the step) still equal the full forward; a reorder that drops rows
    (finished sentences) keeps the survivors' caches."""
    model = seeded_model(tiny(init="admin", **NO_DROPOUT)).eval()
    src, tgt = batch(pad_tgt=False)
    full = model(src, tgt)
    with torch.no_grad():
        enc, src_pad = model.encode(src)
        state = IncrementalState(capacity=1)
        chunks = [model.decode(tgt[:, a:b], enc, src_pad, state) for a, b in ((0, 3), (3, 4), (4, 7))]
        assert torch.allclose(torch.cat(chunks, dim=1), full, atol=1e-5)
        assert state.length == 7

        keep = torch.tensor([3, 1])
        state = IncrementalState(capacity=2)
        for t in range(4):
            model.decode(tgt[:, t:t + 1], enc, src_pad, state)
        state.reorder(keep)
        state.reorder_encoder(keep)
        step = model.decode(tgt[keep, 4:5], enc[keep], src_pad[keep], state)
    assert torch.allclose(step, full[keep, 4:5], atol=1e-5)


@pytest.mark.parametrize("norm_order,init", [("post", "admin"), ("pre", "default"), ("post", "t-fixup"),
                                             ("post", "deepnorm")])
def test_encoder_skipping_padding_equals_padded_encoder(norm_order, init):
    """encode(skip_padding=True) runs position-wise layers on real tokens only: the same encoder
    output at real positions, zeros at padding; decoding from either gives the same logits."""
    model = seeded_model(tiny(norm_order=norm_order, init=init, **NO_DROPOUT)).eval()
    if init == "admin":
        profile_omega(model, batch(), seed=0)
    src, tgt = batch(b=5, s=11)
    src[2, 4:] = PAD
    src[4, 9:] = PAD
    with torch.no_grad():
        enc, pad = model.encode(src)
        skip, pad2 = model.encode(src, skip_padding=True)
        assert torch.equal(pad, pad2)
        assert torch.allclose(skip[~pad], enc[~pad], atol=1e-5)
        assert skip[pad].abs().max() == 0
        assert torch.allclose(model.decode(tgt, skip, pad), model.decode(tgt, enc, pad), atol=1e-5)
        no_pad = src[:, :4]  # no padding at all: the ordinary path
        assert torch.equal(model.encode(no_pad, skip_padding=True)[0], model.encode(no_pad)[0])


def test_future_target_tokens_do_not_change_earlier_logits():
    model = seeded_model(tiny()).eval()
    src, tgt = batch(pad_tgt=False)
    other = tgt.clone()
    other[:, 4:] = torch.randint(4, 1000, other[:, 4:].shape)
    a, b = model(src, tgt), model(src, other)
    assert torch.allclose(a[:, :4], b[:, :4], atol=1e-6)
    assert not torch.allclose(a[:, 4:], b[:, 4:])


def test_padding_does_not_change_other_positions():
    model = seeded_model(tiny()).eval()
    src, tgt = batch(pad_src=False, pad_tgt=False)
    ref = model(src, tgt)
    src_p = torch.cat([src, torch.full((src.size(0), 5), PAD)], dim=1)
    tgt_p = torch.cat([tgt, torch.full((tgt.size(0), 3), PAD)], dim=1)
    out = model(src_p, tgt_p)
    assert torch.allclose(out[:, :tgt.size(1)], ref, atol=1e-5)
    # and a short sentence batched with a long one equals itself alone
    short = model(src[:1, :4], tgt[:1, :3])
    mixed_src = src.clone()
    mixed_src[0, 4:] = PAD
    assert torch.allclose(model(mixed_src, tgt)[:1, :3], short, atol=1e-5)


# ---- presets and constants -----------------------------------------------------------------------


@pytest.mark.parametrize("preset,vocab,millions", [
    ("base-6L-6L", 44512, 67), ("admin-60L-12L", 44512, 262),
    ("base-6L-6L", 32768, 61), ("admin-60L-12L", 32768, 256)])
def test_parameter_counts_reproduce_table_1(preset, vocab, millions):
    n = parameter_count(get_preset(preset, vocab_size=vocab))
    assert abs(n / 1e6 - millions) / millions < 0.01, n


def hand_count(cfg) -> int:
    """Parameters of a preset counted by hand from the architecture: a shared embedding matrix;
    per encoder layer 4 attention projections with biases, the FFN, 2 LayerNorms and 2 omega
    vectors; per decoder layer two attentions, 3 LayerNorms, 3 omegas; Pre-LN adds 2 final norms."""
    d, f = cfg.model_dim, cfg.ffn_inner_dim
    attn, ffn, norm = 4 * (d * d + d), d * f + f + f * d + d, 2 * d
    omega = d if cfg.init in ("admin", "admin-constant") else 0
    enc = attn + ffn + 2 * norm + 2 * omega
    dec = 2 * attn + ffn + 3 * norm + 3 * omega
    final = 2 * norm if cfg.norm_order == "pre" else 0
    return cfg.vocab_size * d + cfg.num_encoder_layers * enc + cfg.num_decoder_layers * dec + final


def test_every_preset_and_twin_has_its_hand_counted_size():
    for name in PRESET_NAMES:
        for cfg in (get_preset(name), get_preset(name, init="default", norm_order="pre")):
            assert parameter_count(cfg) == hand_count(cfg), (name, cfg.init, cfg.norm_order)
    with pytest.raises(KeyError, match="unknown preset"):
        get_preset("nope")
    with pytest.raises(ConfigError, match="model.norm_order: init='admin' needs a Post-LN model"):
        get_preset("admin-60L-12L", norm_order="pre")
    with pytest.raises(ConfigError, match="model.num_heads"):
        tiny(num_heads=3)


def test_deepnorm_tfixup_admin_constant_constants():
    c = deepnorm_constants(60, 12)
    assert (round(c["encoder_alpha"], 3), round(c["encoder_beta"], 3)) == (2.633, 0.268)
    assert (round(c["decoder_alpha"], 3), round(c["decoder_beta"], 3)) == (2.449, 0.289)
    t = tfixup_constants(60, 12)
    assert (round(t["encoder_scale"], 3), round(t["decoder_scale"], 3), round(t["encoder_embed_scale"], 3)) \
        == (0.241, 0.310, 0.207)
    assert round(admin_constant_omega(120), 2) == 4.92 and round(admin_constant_omega(36), 2) == 3.04


def test_deepnorm_and_tfixup_weights_follow_their_formulas():
    n, m = 4, 3
    cfg = tiny(num_encoder_layers=n, num_decoder_layers=m)
    dn = seeded_model(cfg.replace(init="deepnorm"))
    c = deepnorm_constants(n, m)
    assert torch.all(dn.encoder_layers[0].ffn_residual.alpha == c["encoder_alpha"])
    assert torch.all(dn.decoder_layers[2].encoder_attn_residual.alpha == c["decoder_alpha"])
    # xavier_normal with gain beta: std = beta * sqrt(2 / (fan_in + fan_out)); 8k samples -> ~2%
    w = torch.cat([L.ffn.fc1.weight.flatten() for L in dn.encoder_layers])
    want = c["encoder_beta"] * math.sqrt(2 / (64 + 128))
    assert w.std().item() == pytest.approx(want, rel=0.05)
    # T-Fixup: the default draws, scaled; no LayerNorm anywhere
    tf, default = seeded_model(cfg.replace(init="t-fixup")), seeded_model(cfg.replace(init="default"))
    t = tfixup_constants(n, m)
    assert not any(isinstance(mod, torch.nn.LayerNorm) for mod in tf.modules())
    L, D = tf.encoder_layers[1], default.encoder_layers[1]
    assert torch.allclose(L.ffn.fc2.weight, D.ffn.fc2.weight * t["encoder_scale"])
    assert torch.allclose(L.self_attn.v_proj.weight, D.self_attn.v_proj.weight * t["encoder_scale"] * math.sqrt(2))
    assert torch.equal(L.self_attn.q_proj.weight, D.self_attn.q_proj.weight)
    Ld, Dd = tf.decoder_layers[0], default.decoder_layers[0]
    assert torch.allclose(Ld.encoder_attn.out_proj.weight, Dd.encoder_attn.out_proj.weight * t["decoder_scale"])
    assert torch.allclose(tf.src_embed.weight, default.src_embed.weight * t["encoder_embed_scale"])


def test_admin_constant_sets_omega_per_stack():
    model = seeded_model(tiny(init="admin-constant", num_encoder_layers=3, num_decoder_layers=2))
    assert torch.allclose(model.encoder_layers[2].ffn_residual.omega, torch.tensor(admin_constant_omega(6)))
    assert torch.allclose(model.decoder_layers[0].self_attn_residual.omega, torch.tensor(admin_constant_omega(6)))


def test_fixed_omega_is_a_buffer():
    model = seeded_model(tiny(omega_trainable=False))
    assert not any(n.endswith("omega") for n, _ in model.named_parameters())
    assert any(n.endswith("omega") for n in model.state_dict())
    profile_omega(model, batch(), seed=0)
    assert model.encoder_layers[1].ffn_residual.omega[0] > 1.0


def test_separate_embeddings():
    model = seeded_model(tiny(share_all_embeddings=False, share_decoder_input_output_embed=False))
    assert model.tgt_embed is not None and model.output_proj is not None
    src, tgt = batch()
    assert model(src, tgt).shape == (4, 7, 1000)
    folded = fold_omega(model.eval())
    assert torch.allclose(folded(src, tgt), model(src, tgt), atol=1e-5)


def test_bf16_forward():
    model = seeded_model(tiny()).to(torch.bfloat16).eval()
    src, tgt = batch()
    out = model(src, tgt)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
