"""The encoder-decoder as a 2-stage DeepSpeed pipeline, with real ranks (CPU, gloo)."""

import json

import numpy as np
import pytest
import torch

from conftest import NO_DROPOUT, PIPE, overrides
from distributed import spawn

DP_REF = {"zero_optimization": {"stage": 0}, "gradient_accumulation_steps": 2}


def rel(a, b):
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-12)))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_two_stage_pipeline_reproduces_data_parallel(tmp_path, data_dir, fixed_profile, checkpointing):
    """Loss trajectory and every parameter after 5 updates (the encoder layers on stage 0, the tied
    embedding that sums the gradients of its three uses across both stages) equal one process,
    with and without activation checkpointing of the transformer layers. Token buckets give every
    micro-batch its own shape: variable-length batches do not hang."""
    common = [*NO_DROPOUT, f"--admin.profile={fixed_profile}", f"--engine.activation_checkpointing={checkpointing}"]
    ref = spawn(1, "train_updates", tmp_path / "ref", run_overrides=overrides(tmp_path / "r", data_dir, *common),
                ds=DP_REF, tmp=str(tmp_path), updates=5)[0]
    pipe = spawn(2, "train_updates", tmp_path / "pipe", run_overrides=overrides(tmp_path / "p", data_dir, *common),
                 ds=PIPE, tmp=str(tmp_path), updates=5)
    assert pipe[0]["losses"] == pipe[1]["losses"]
    assert rel(pipe[0]["losses"], ref["losses"]) <= 1e-4, (pipe[0]["losses"], ref["losses"])
    names = sorted(ref["params"])
    assert sorted(pipe[0]["params"]) == names  # every parameter came back from the stages
    np.testing.assert_allclose([pipe[0]["params"][n] for n in names], [ref["params"][n] for n in names],
                               rtol=1e-4, atol=1e-6)
    moved = [n for n in names if n.startswith("encoder_layers.0.") or n == "src_embed.weight"]
    assert moved and all(abs(pipe[0]["params"][n] - ref["params"][n]) <= 1e-4 * max(1, abs(ref["params"][n]))
                         for n in moved)


def test_pipeline_by_data_parallel_grid_profiles_like_one_process(tmp_path, data_dir):
    """2 stages x 2 data-parallel ranks: omega identical on all four ranks and equal to one process
    profiling the two micro-batches concatenated (dropout off, padding masked)."""
    from admin_ds.model import build_model
    from admin_ds.profiling import profile_omega
    from admin_ds.train.run_config import load_run_config

    ov = overrides(tmp_path / "run", data_dir, *NO_DROPOUT, "--admin.mask_padding=true")
    res = spawn(4, "profile_only", tmp_path / "out", run_overrides=ov, ds={**PIPE, "gradient_accumulation_steps": 1},
                tmp=str(tmp_path))
    assert all(r["profile"] == res[0]["profile"] for r in res)
    # ranks 0, 1: stage 0 with data-parallel ids 0, 1 (data is the inner axis of the grid)
    ws, wt = max(len(r["src"][0]) for r in res[:2]), max(len(r["tgt"][0]) for r in res[:2])
    pad = lambda rows, w: [row + [1] * (w - len(row)) for row in rows]
    src = torch.tensor(pad(res[0]["src"], ws) + pad(res[1]["src"], ws))
    tgt = torch.tensor(pad(res[0]["tgt"], wt) + pad(res[1]["tgt"], wt))
    run = load_run_config(None, ov)
    vocab = json.loads((data_dir / "manifest.json").read_text())["vocab_size"]
    single = profile_omega(build_model(run.model.build(vocab_size=vocab), seed=run.train.seed), (src, tgt),
                           mask_padding=True)
    for stack in ("encoder", "decoder"):
        assert rel(res[0]["profile"][stack], single.omega(stack)) <= 1e-6, stack
    assert res[0]["tokens"] == single.tokens


@pytest.mark.parametrize("formula", ["reference", "paper"])
def test_pipeline_profile_crosses_stage_boundaries(tmp_path, data_dir, formula):
    """The running omega crosses the stage boundary: a 2-stage profile equals the 1-stage one."""
    ov = overrides(tmp_path / "run", data_dir, *NO_DROPOUT, f"--admin.formula={formula}")
    one = spawn(1, "profile_only", tmp_path / "one", run_overrides=ov, ds=DP_REF, tmp=str(tmp_path))[0]
    two = spawn(2, "profile_only", tmp_path / "two", run_overrides=ov, ds=PIPE, tmp=str(tmp_path))
    for stack in ("encoder", "decoder"):
        assert rel(two[0]["profile"][stack], one["profile"][stack]) <= 1e-6
    assert len(set(one["profile"]["decoder"])) > 3  # a real, non-uniform profile


def test_pipeline_save_and_resume_continue_identically(tmp_path, data_dir):
    """With dropout on: 4 updates straight vs. 2, save, resume in new processes, 2 more. The
    shared embedding (saved through its first, forward_fn-less occurrence) is restored."""
    ov = lambda d: overrides(d, data_dir)
    straight = spawn(2, "train_updates", tmp_path / "a", run_overrides=ov(tmp_path / "a"), ds=PIPE,
                     tmp=str(tmp_path), updates=4)[0]
    spawn(2, "train_updates", tmp_path / "b1", run_overrides=ov(tmp_path / "b"), ds=PIPE, tmp=str(tmp_path),
          updates=2, save=True)
    resumed = spawn(2, "train_updates", tmp_path / "b2", run_overrides=ov(tmp_path / "b"), ds=PIPE,
                    tmp=str(tmp_path), updates=2)[0]
    assert resumed["resumed"] and resumed["update"] == 4
    assert resumed["losses"] == pytest.approx(straight["losses"][2:], rel=1e-6)
    assert resumed["params"]["src_embed.weight"] == pytest.approx(straight["params"]["src_embed.weight"], rel=1e-6)


def test_pipeline_refusals():
    from admin_ds.model.config import ConfigError
    from admin_ds.train.engine import resolve_ds_config
    from admin_ds.train.pipeline import layer_costs, partition
    from admin_ds.presets import get_preset
    from admin_ds.train.run_config import load_run_config

    run = load_run_config(None, [])
    with pytest.raises(ConfigError, match="zero_optimization.stage=2 with engine.pipeline_stages=2"):
        resolve_ds_config({"pipeline": {"stages": 2}, "zero_optimization": {"stage": 2}}, run, world=2)
    run = load_run_config(None, [])
    with pytest.raises(ConfigError, match="engine.pipeline_stages=3 does not divide the world size 4"):
        resolve_ds_config({"pipeline": {"stages": 3}}, run, world=4)
    run = load_run_config(None, ["--engine.pipeline_stages=4"])
    with pytest.raises(ConfigError, match="pipeline.stages=2 but engine.pipeline_stages=4"):
        resolve_ds_config({"pipeline": {"stages": 2}}, run, world=4)
    cfg = get_preset("debug-tiny")
    kinds = ["embed"] + ["encoder"] * 2 + ["embed_tgt"] + ["decoder"] * 2 + ["project"]
    with pytest.raises(ConfigError, match="exceeds the 7 steps of the forward pass"):
        partition(layer_costs(cfg, kinds), 8)


def test_cost_balanced_partition_of_60L_12L():
    """The chosen boundaries for the paper's 60L-12L (vocabulary 32k) on 2 and 4 stages: stage
    costs within one layer of each other, decoder layers and the projection weighed by cost."""
    from admin_ds.train.pipeline import layer_costs, partition
    from admin_ds.presets import get_preset

    cfg = get_preset("admin-60L-12L", vocab_size=32768)
    kinds = ["embed"] + ["encoder"] * 60 + ["embed_tgt"] + ["decoder"] * 12 + ["project"]
    costs = layer_costs(cfg, kinds)
    assert costs[kinds.index("decoder")] == pytest.approx(4 / 3)
    assert costs[-1] == pytest.approx(32768 * 512 / (4 * 512 * 512 + 2 * 512 * 2048))
    for stages in (2, 4):
        parts = partition(costs, stages)
        stage_costs = [sum(costs[a:b]) for a, b in zip(parts, parts[1:])]
        assert max(stage_costs) - min(stage_costs) <= max(costs[1:-1]) + 1e-9 or max(stage_costs) == costs[-1]
        assert parts[0] == 0 and parts[-1] == len(kinds)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_pipeline_checkpoint_averages_and_exports_like_data_parallel(tmp_path, data_dir, precision):
    """A pipeline checkpoint is read through DeepSpeed's universal converter into the single-device
    model's names: its weights equal the ones gathered from the stages at save time (in bf16, the
    fp32 masters those bf16 weights round from), and average_checkpoints.py / translate.py work
    from the run directory."""
    import subprocess
    import sys

    from admin_ds.inference.model_file import load_run_checkpoint
    from distributed import REPO

    run = tmp_path / "run"
    ds = dict(PIPE, bf16={"enabled": True}) if precision == "bf16" else PIPE
    saved = spawn(2, "train_updates", tmp_path / "out", run_overrides=overrides(run, data_dir), ds=ds,
                  tmp=str(tmp_path), updates=2, save=True)[0]
    mf = load_run_checkpoint(run)
    assert mf.meta["weights_from"] == "deepspeed universal checkpoint (pipeline)"
    assert mf.meta["layout"]["precision"] == precision
    assert set(mf.state_dict) == set(saved["params"])
    # bf16 keeps 8 significant bits: each weight is within 2^-8 of its own size of its fp32 master
    rel = 2.0 ** -8 if precision == "bf16" else 1e-6
    for name, checksum in saved["params"].items():
        loaded = mf.state_dict[name]
        assert loaded.dtype == torch.float32, name
        assert abs(loaded.double().sum().item() - checksum) <= rel * saved["magnitudes"][name] + 1e-9, name
    out = subprocess.run([sys.executable, str(REPO / "launch/average_checkpoints.py"), "--run", str(run), "--last", "1",
                          "--out", str(tmp_path / "avg.pt")], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "DS_ACCELERATOR": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    src = tmp_path / "in.txt"
    src.write_text("The black sailor eats.\nHugo did not say that Sara closed this king.\n")
    out = subprocess.run([sys.executable, str(REPO / "launch/translate.py"), "--checkpoint", str(tmp_path / "avg.pt"),
                          "--input", str(src), "--beam", "2", "--quiet"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert len(out.stdout.splitlines()) == 2


# ---- one model for every layout -------------------------------------------------------------------


class Allocations(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the elements of every real (not meta) tensor created by an ``empty*`` operation: the
    storage of parameters and buffers, whether built directly or materialised from the meta device."""

    EMPTY = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
             torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default,
             torch.ops.aten.new_empty_strided.default}

    def __init__(self):
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.EMPTY and isinstance(out, torch.Tensor) and out.device.type != "meta":
            self.elements += out.numel()
        return out


def test_a_stage_holds_only_its_layers_with_the_whole_models_names_and_weights():
    """A 4-stage 24L-24L pipeline: each stage allocates its share of the layers plus the embedding
    (and the small position table), never the whole model; its parameters have the single-device
    model's names and values (per-layer generators); together the stages hold every parameter once,
    except the tied embedding, which every stage that embeds or projects holds."""
    from admin_ds.model import build_model, count_parameters, get_preset
    from admin_ds.train.pipeline import PipelineStage

    cfg = get_preset("debug-tiny", num_encoder_layers=24, num_decoder_layers=24)
    whole = build_model(cfg, seed=7).state_dict()
    embedding = whole["src_embed.weight"].numel()
    table = (cfg.max_positions + cfg.pad_idx + 1) * cfg.model_dim
    layers = count_parameters(build_model(cfg, device="meta")) - embedding
    decoder_layer = sum(v.numel() for k, v in whole.items() if k.startswith("decoder_layers.0."))
    seen = set()
    for stage_id in range(4):
        counter = Allocations()
        with counter:
            stage = PipelineStage(cfg, seed=7, num_stages=4, stage_id=stage_id)
        state = stage.model.state_dict()
        mine = sum(v.numel() for k, v in state.items() if k != "src_embed.weight")
        assert mine <= layers / 4 + decoder_layer, (stage_id, mine, layers / 4)
        assert counter.elements <= mine + embedding + table, (stage_id, counter.elements, mine)
        assert counter.elements < sum(v.numel() for v in whole.values()) / 2
        for name, value in state.items():
            assert torch.equal(value, whole[name]), (stage_id, name)
        seen |= set(state)
    assert seen == set(whole)


def test_four_ranks_build_their_stages_from_the_same_names(tmp_path, data_dir):
    """Real ranks and DeepSpeed's pipeline engine: every rank's module parameters are its stage's
    slice of the single-device model, by name and value, and no rank holds more than its share."""
    from admin_ds.model import build_model
    from admin_ds.train.run_config import load_run_config

    ov = overrides(tmp_path / "run", data_dir, "--model.num_encoder_layers=24", "--model.num_decoder_layers=24")
    res = spawn(4, "stage_parameters", tmp_path / "out", run_overrides=ov,
                ds={"pipeline": {"stages": 4}, "zero_optimization": {"stage": 1}, "gradient_accumulation_steps": 4},
                tmp=str(tmp_path))
    run = load_run_config(None, ov)
    vocab = json.loads((data_dir / "manifest.json").read_text())["vocab_size"]
    whole = {k: v.double().sum().item() for k, v in
             build_model(run.model.build(vocab_size=vocab), seed=run.train.seed).named_parameters()}
    held = {}
    for r in res:
        for name, checksum in r["params"].items():
            assert checksum == pytest.approx(whole[name], rel=1e-12, abs=1e-12), name
            held[name] = held.get(name, 0) + 1
    assert set(held) == set(whole)
    assert all(n == 1 for name, n in held.items() if name != "src_embed.weight")
    assert max(r["numel"] for r in res) < sum(r["numel"] for r in res) / 2
