"""admin_ds.model.analysis: output change and layer dependency at initialisation (Admin paper, sec. 4).

The qualitative claims are checked on D=64 encoders of 2..24 layers, 4 seeds x 8 perturbations of
sigma 0.001, with margins chosen from 6 disjoint seed groups (smallest observed: Post-LN's growth
2.3x Pre-LN's and Admin's, Post-LN's change at 24 layers 3x theirs, mean beta_{i,i} 2.5x).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from admin_ds.model.analysis import (
    analysis_config,
    build_analysis_model,
    layer_dependency,
    make_batch,
    model_output,
    output_change,
    perturbation,
    perturbed_parameters,
    r_squared,
    run_analyses,
    torch_threads,
    trace_components,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _one_thread():
    """The tensors are tiny: one thread is fastest, and much faster on a busy machine."""
    with torch_threads(1):
        yield


def _model(init: str, depth: int = 3, seed: int = 0, **kw):
    return build_analysis_model(init, depth, seed, decoder_layers=kw.pop("decoder_layers", 1), **kw)


@pytest.fixture(scope="module")
def study() -> dict:
    return run_analyses(depths=[2, 8, 24], inits=["post", "pre", "admin"], seeds=range(4),
                        decoder_layers=1, repeats=8)


# ---- the paper's qualitative results ---------------------------------------------------------


def test_post_ln_output_change_grows_faster_than_pre_ln_and_admin(study):
    oc = study["output_change"]
    for other in ("pre", "admin"):
        assert oc["post"]["growth"] > 1.5 * oc[other]["growth"], (other, oc)
        assert oc["post"]["mean"][-1] > 2.0 * oc[other]["mean"][-1], (other, oc)
    for name in oc:  # every init's change grows with depth from 2 to 24 layers
        assert oc[name]["mean"][-1] > oc[name]["mean"][0]


def test_post_ln_depends_more_on_its_newest_branch(study):
    dep = study["dependency"]
    for other in ("pre", "admin"):
        assert dep["post"]["mean_diagonal"][-1] > 1.5 * dep[other]["mean_diagonal"][-1]
    beta = np.asarray(dep["post"]["beta"])
    assert beta.shape == (48, 49)
    np.testing.assert_allclose(beta.sum(1), 1.0, rtol=1e-9)
    assert np.all(beta[np.triu_indices(48, k=2)] == 0)  # j > i: branch j does not exist yet


def test_result_is_json_ready(study):
    text = json.dumps(study, allow_nan=False)
    assert json.loads(text)["settings"]["depths"] == [2, 8, 24]
    for oc in study["output_change"].values():
        assert set(oc) >= {"depths", "mean", "std", "per_seed", "r2_vs_n", "r2_vs_log_n", "growth"}
        assert len(oc["per_seed"][0]) == 4


# ---- the bookkeeping behind beta -------------------------------------------------------------


@pytest.mark.parametrize("init", ["post", "admin", "admin-constant", "deepnorm", "t-fixup", "pre"])
def test_components_sum_to_the_encoder_stream(init):
    """The components are exact (the LN bias is zero at init): their sum is the encoder output
    (for Pre-LN: the stream under the final LayerNorm)."""
    model = _model(init)
    src = make_batch(model.cfg, batch_size=3, src_len=7, seed=5)[0]
    rec = trace_components(model, src)
    assert rec.count == 2 * 3 + 1 and len(rec.rows) == 2 * 3
    total = rec.components.sum(0)
    with torch.no_grad():
        enc = model.encode(src)[0].double()
    if init == "pre":
        total = torch.nn.functional.layer_norm(total, (model.cfg.model_dim,), eps=model.encoder_layer_norm.eps)
        enc = (enc - model.encoder_layer_norm.bias.double()) / model.encoder_layer_norm.weight.double()
    torch.testing.assert_close(total, enc, rtol=1e-4, atol=1e-4)


def test_one_pre_ln_layer_by_hand():
    """Pre-LN, one layer: beta_{1,.} = (|x0|, |a1|) and beta_{2,.} = (|x0|, |a1|, |a2|), normalised,
    with |.| = std over D averaged over tokens and a_i the branch outputs taken with hooks."""
    model = _model("pre", depth=1)
    src = make_batch(model.cfg, batch_size=2, src_len=5, seed=1)[0]
    layer = model.encoder_layers[0]
    seen = {}
    hooks = [layer.self_attn.register_forward_hook(lambda m, i, o: seen.__setitem__("a1", o)),
             layer.ffn.register_forward_hook(lambda m, i, o: seen.__setitem__("a2", o)),
             layer.self_attn_layer_norm.register_forward_hook(lambda m, i, o: seen.setdefault("x0", i[0]))]
    beta = layer_dependency(model, src)
    for h in hooks:
        h.remove()
    m = [seen[k].double().std(-1, unbiased=False).mean().item() for k in ("x0", "a1", "a2")]
    np.testing.assert_allclose(beta[0], [m[0] / (m[0] + m[1]), m[1] / (m[0] + m[1]), 0.0], rtol=1e-6)
    np.testing.assert_allclose(beta[1], np.asarray(m) / sum(m), rtol=1e-6)


# ---- output change ---------------------------------------------------------------------------


def test_perturbation_restores_the_weights_exactly():
    model = _model("admin")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with perturbation(model, 0.1, torch.Generator().manual_seed(0)):
        changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed and all(("attn" in k or "ffn" in k) for k in changed)  # branches only
    assert not any(k.endswith("omega") or "norm" in k or "embed" in k for k in changed)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_scope_all_includes_every_parameter():
    model = _model("admin")
    assert len(perturbed_parameters(model, "all")) == len(list(model.parameters()))
    assert len(perturbed_parameters(model, "branches")) < len(list(model.parameters()))


def test_output_change_is_zero_without_perturbation_and_grows_with_sigma():
    model = _model("post")
    batch = make_batch(model.cfg, seed=0)
    assert output_change(model, batch, sigma=0.0) == 0.0
    small, large = (output_change(model, batch, sigma=s, seed=1) for s in (0.001, 0.01))
    assert 0 < small < large
    assert large / small == pytest.approx(100, rel=0.2)  # quadratic in sigma for small sigma


def test_decoder_target_returns_final_states():
    for init in ("post", "pre"):
        model = _model(init, depth=2, decoder_layers=2)
        batch = make_batch(model.cfg, batch_size=2, src_len=5, tgt_len=4, seed=0)
        out = model_output(model, batch, "model")
        assert out.shape == (2, 4, model.cfg.model_dim)
        with torch.no_grad():  # projecting the states gives the model's logits
            torch.testing.assert_close(model.target_embedding.project(out), model(*batch))
        assert output_change(model, batch, target="model", seed=0) > 0


def test_admin_is_profiled_and_post_pre_admin_share_weights():
    post, admin = _model("post", depth=2), _model("admin", depth=2)
    omega = [r.omega for r in admin.modules() if hasattr(r, "omega")]
    assert omega and omega[-1].min() > 1.0  # the reference recursion grows omega with depth
    assert torch.equal(post.encoder_layers[1].ffn.fc1.weight, admin.encoder_layers[1].ffn.fc1.weight)


def test_config_and_helpers():
    cfg = analysis_config("pre", 5, model_dim=32, decoder_layers=2)
    assert (cfg.norm_order, cfg.init, cfg.num_encoder_layers, cfg.num_decoder_layers) == ("pre", "default", 5, 2)
    assert cfg.dropout_p == cfg.attention_dropout_p == cfg.activation_dropout_p == 0.0
    assert cfg.ffn_inner_dim == 128
    with pytest.raises(ValueError, match="unknown init"):
        analysis_config("rezero", 2)
    assert r_squared([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert r_squared([1, 2], [1, 2]) is None
    before = torch.get_num_threads()
    with torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


# ---- command line ----------------------------------------------------------------------------


def test_cli_writes_json_and_plots(tmp_path):
    out = tmp_path / "an"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch" / "analyze.py"), "--depths", "1", "2", "--inits", "post", "admin",
         "--seeds", "1", "--repeats", "1", "--decoder-layers", "1", "--out", str(out), "--no-progress"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "R2(N)" in proc.stdout and "post" in proc.stdout
    result = json.loads((out / "analysis.json").read_text())
    assert set(result) >= {"settings", "output_change", "dependency", "runtime_s"}
    assert set(result["output_change"]) == set(result["dependency"]) == {"post", "admin"}
    assert np.asarray(result["dependency"]["admin"]["beta"]).shape == (4, 5)
    for name in ("output_change.png", "dependency_post.png", "dependency_admin.png"):
        data = (out / name).read_bytes()
        assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"
