"""Training on DeepSpeed with real ranks (CPU, gloo): ZeRO equivalence, layout-independent
gradients, distributed profiling, omega in the fp32 masters, resume, refusals, the main job."""

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from distributed import REPO, spawn

from conftest import NO_DROPOUT, ZERO, overrides
from shared_data import DATA, needs_data


def rel(a, b):
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-12)))


def test_zero_stages_on_two_ranks_reproduce_single_process(tmp_path, data_dir, fixed_profile):
    common = [*NO_DROPOUT, f"--admin.profile={fixed_profile}"]
    ref = spawn(1, "train_updates", tmp_path / "ref", run_overrides=overrides(tmp_path / "r", data_dir, *common),
                ds={**ZERO[0], "gradient_accumulation_steps": 2}, tmp=str(tmp_path), updates=5)[0]
    for stage in (1, 2, 3):
        res = spawn(2, "train_updates", tmp_path / f"z{stage}",
                    run_overrides=overrides(tmp_path / f"r{stage}", data_dir, *common), ds=ZERO[stage],
                    tmp=str(tmp_path), updates=5)
        assert rel(res[0]["losses"], ref["losses"]) <= 1e-4, (stage, res[0]["losses"], ref["losses"])
        assert rel(res[0]["grad_norms"], ref["grad_norms"]) <= 1e-4, stage


def test_gradients_do_not_depend_on_the_layout(tmp_path, data_dir, fixed_profile):
    """1 rank x 4 micro-batches, 2 x 2 and 4 x 1 see the same tokens per update: same gradients."""
    common = [*NO_DROPOUT, f"--admin.profile={fixed_profile}"]
    runs = {}
    for world, gas in ((1, 4), (2, 2), (4, 1)):
        res = spawn(world, "train_updates", tmp_path / f"w{world}", ds={**ZERO[2], "gradient_accumulation_steps": gas},
                    run_overrides=overrides(tmp_path / f"r{world}", data_dir, *common), tmp=str(tmp_path), updates=2)
        runs[(world, gas)] = res[0]
    ref = runs[(1, 4)]
    for key, res in runs.items():
        assert rel(res["grad_norms"], ref["grad_norms"]) <= 1e-5, key
        assert rel(res["losses"], ref["losses"]) <= 1e-5, key
        names = sorted(ref["params"])
        np.testing.assert_allclose([res["params"][n] for n in names], [ref["params"][n] for n in names],
                                   rtol=1e-4, atol=1e-7, err_msg=str(key))


def test_distributed_profile_equals_single_process_profile(tmp_path, data_dir):
    """Two ranks, each profiling its own micro-batch, give the omega one process computes on the
    concatenated batch (dropout off; padding masked, since the two layouts pad differently)."""
    from admin_ds.model import build_model
    from admin_ds.profiling import profile_omega
    from admin_ds.train.run_config import load_run_config

    ov = overrides(tmp_path / "run", data_dir, *NO_DROPOUT, "--admin.mask_padding=true")
    res = spawn(2, "profile_only", tmp_path / "out", run_overrides=ov, ds=ZERO[1], tmp=str(tmp_path))
    assert res[0]["profile"] == res[1]["profile"]  # identical on every rank
    width_s = max(len(r["src"][0]) for r in res)
    width_t = max(len(r["tgt"][0]) for r in res)
    pad = lambda rows, w: [row + [1] * (w - len(row)) for row in rows]
    src = torch.tensor(pad(res[0]["src"], width_s) + pad(res[1]["src"], width_s))
    tgt = torch.tensor(pad(res[0]["tgt"], width_t) + pad(res[1]["tgt"], width_t))
    run = load_run_config(None, ov)
    manifest = json.loads((data_dir / "manifest.json").read_text())
    model = build_model(run.model.build(vocab_size=manifest["vocab_size"]), seed=run.train.seed)
    single = profile_omega(model, (src, tgt), mask_padding=True)
    for stack in ("encoder", "decoder"):
        assert rel(res[0]["profile"][stack], single.omega(stack)) <= 1e-6, stack
    assert max(single.omega("encoder")) > 1.2
    assert res[0]["tokens"] == single.tokens


@pytest.mark.parametrize("stage,precision", [(1, "bf16"), (3, "fp32")])
def test_omega_still_in_force_after_first_step(tmp_path, data_dir, stage, precision):
    """Omega written after deepspeed.initialize reaches the fp32 masters: after an update at a
    tiny learning rate it is still the profiled value, not the 1.0 a module-only write reverts to."""
    ds = dict(ZERO[stage])
    if precision == "bf16":
        ds["bf16"] = {"enabled": True}
        ds["data_types"] = {"grad_accum_dtype": "fp32"}
    ov = overrides(tmp_path / "run", data_dir, "--optim.warmup_updates=100", "--optim.warmup_init_lr=1e-9")
    res = spawn(2, "train_updates", tmp_path / "out", run_overrides=ov, ds=ds, tmp=str(tmp_path), updates=1,
                read_omega=True)
    profile = res[0]["profile"]
    last = "encoder_layers.1.ffn_residual.omega"
    want = profile["encoder"][3]
    assert want > 1.2
    lp, hp = res[0]["omega"][last]
    tol = 1e-2 if precision == "bf16" else 1e-5
    assert rel(lp, [want] * len(lp)) <= tol
    assert hp is not None and rel(hp, [want] * len(hp)) <= 1e-5
    assert res[0]["omega"] == res[1]["omega"]


# ---- resume --------------------------------------------------------------------------------------


def _train_cli(run_dir, data_dir, updates, extra=(), wait=True):
    cmd = [sys.executable, str(REPO / "launch/train.py"), "--deepspeed_config", str(REPO / "ds_configs/zero2.json"),
           *overrides(run_dir, data_dir, f"--train.max_updates={updates}", "--train.log_interval=1",
                      "--train.save_interval_updates=3", *extra)]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", MASTER_PORT=str(_port()))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    if wait:
        proc.out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, proc.out[-3000:]
    return proc


def _port():
    from distributed import free_port
    return free_port()


def _train_losses(run_dir):
    rows = [json.loads(l) for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["update"]: r["loss"] for r in rows if r["kind"] == "train"}


@pytest.mark.parametrize("dropout", ["torch", "bulk"])
def test_kill_and_resume_continues_identically(tmp_path, data_dir, dropout):
    """With dropout on (either mask generator): an uninterrupted run vs. one SIGKILLed after its
    update-3 checkpoint and resumed by the same command. The resumed updates equal the
    uninterrupted ones."""
    impl = [f"--engine.dropout={dropout}"]
    _train_cli(tmp_path / "a", data_dir, 6, extra=impl)
    ref = _train_losses(tmp_path / "a")
    proc = _train_cli(tmp_path / "b", data_dir, 6, extra=["--train.save_interval_updates=3", *impl], wait=False)
    marker = tmp_path / "b/checkpoints/update_000003/COMPLETE"
    deadline = time.time() + 300
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert marker.exists()
    _train_cli(tmp_path / "b", data_dir, 6, extra=impl)
    resumed = _train_losses(tmp_path / "b")
    for u in (4, 5, 6):
        assert resumed[u] == pytest.approx(ref[u], rel=1e-6), (u, resumed[u], ref[u])


def test_a_resumed_run_keeps_the_random_numbers_its_checkpoint_was_trained_with(tmp_path, data_dir):
    """engine.dropout and engine.skip_padding left to the system: a new run takes bulk masks on
    real tokens only (on a CPU), but a run trained with torch's masks on the padded path and
    resumed by a command that leaves both open continues as its uninterrupted run, both from a
    checkpoint that records the choices and from one written before they were recorded. The
    control resumes with the new run's choices and differs, so the choice is what keeps it."""
    old = ["--engine.dropout=torch", "--engine.skip_padding=false"]
    _train_cli(tmp_path / "a", data_dir, 5, extra=old)
    ref = _train_losses(tmp_path / "a")
    _train_cli(tmp_path / "b", data_dir, 3, extra=old)  # checkpoint at update 3, then resumed to 5
    complete = tmp_path / "b/checkpoints/update_000003/COMPLETE"
    assert json.loads(complete.read_text())["engine"] == {"skip_padding": False, "dropout": "torch"}
    for name, edit in (("legacy", lambda info: info.pop("engine")), ("control", None)):
        shutil.copytree(tmp_path / "b", tmp_path / name)
        if edit:
            info = json.loads((tmp_path / name / complete.relative_to(tmp_path / "b")).read_text())
            edit(info)
            (tmp_path / name / complete.relative_to(tmp_path / "b")).write_text(json.dumps(info))
    out = _train_cli(tmp_path / "b", data_dir, 5).out
    assert '[resume] engine.dropout="torch", as the checkpoint was trained' in out, out[-2000:]
    _train_cli(tmp_path / "legacy", data_dir, 5)
    _train_cli(tmp_path / "control", data_dir, 5, extra=["--engine.dropout=bulk", "--engine.skip_padding=true"])
    for name in ("b", "legacy"):
        resumed = _train_losses(tmp_path / name)
        for u in (4, 5):
            assert resumed[u] == pytest.approx(ref[u], rel=1e-6), (name, u, resumed[u], ref[u])
    control = _train_losses(tmp_path / "control")
    assert control[3] == pytest.approx(ref[3], rel=1e-6) and control[4] != pytest.approx(ref[4], rel=1e-4)


def test_the_run_cost_counts_the_process_time_across_a_resume(tmp_path, data_dir):
    """summary.json's cpu_hours is the run's CPU time: for a fresh run, what the OS charged the
    training process (resource.getrusage of the finished child); for a resumed one, that plus the
    checkpoint's total, so a run's cost survives its interruptions. wall_hours likewise: what a
    resume adds lies between that invocation's training loop (its train_s) and the child's life."""
    def child_s(run_dir, updates):
        before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
        _train_cli(run_dir, data_dir, updates)
        wall = time.monotonic() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, wall

    def cost_s(run_dir):
        summary = json.loads((run_dir / "summary.json").read_text())
        return summary["cpu_hours"] * 3600, summary["wall_hours"] * 3600, summary["train_s"]

    run = tmp_path / "run"
    first, first_wall = child_s(run, 3)
    charged, charged_wall, first_train = cost_s(run)
    after_summary = first - charged  # the process's teardown and exit, after its summary
    assert 0 <= after_summary < 0.5 * first
    assert first_train <= charged_wall + 0.1 and charged_wall < first_wall
    second, second_wall = child_s(run, 5)  # resumes from update 3
    cpu, wall, second_train = cost_s(run)
    added = cpu - charged  # without the checkpoint's total, this would be short by `charged`
    assert added == pytest.approx(second - after_summary, abs=0.4 * charged)
    assert second_train - 0.1 <= wall - charged_wall < second_wall


def test_the_engine_choices_left_to_the_system():
    """A new run: bulk masks on a CPU, torch's on a GPU, real tokens only where the data-parallel
    path can skip padding; a given value is never replaced, a checkpoint's record wins over the
    device's choice."""
    from admin_ds.train.run_config import EngineSection

    def choose(device, saved=None, **given):
        e = EngineSection(**given)
        notes = e.resolve_auto(device, saved)
        return e.dropout, e.skip_padding, len(notes)

    assert choose("cpu") == ("bulk", True, 0) and choose("cuda") == ("torch", True, 0)
    assert choose("cpu", pipeline_stages=2) == ("bulk", False, 0)
    assert choose("cpu", dropout="torch", skip_padding=False) == ("torch", False, 0)
    assert choose("cpu", {"dropout": "torch", "skip_padding": False}) == ("torch", False, 2)
    assert choose("cuda", {"dropout": "bulk", "skip_padding": True}, dropout="torch") == ("torch", True, 0)


def test_reverse_trains_the_other_direction_and_keeps_it_on_resume(tmp_path, data_dir):
    """data.reverse=true: the same directory read target -> source. The model's first batch is the
    forward batch with its sides swapped, the end-of-run decode writes source-language text, and a
    resume that flips the direction is refused."""
    from admin_ds.data.binarize import load_manifest, open_split, reversed_manifest

    manifest = load_manifest(data_dir)
    forward, backward = open_split(data_dir, "valid", manifest), open_split(data_dir, "valid", reversed_manifest(manifest))
    for i in (0, len(forward) // 2, len(forward) - 1):
        assert [t.tolist() for t in backward[i]] == [t.tolist() for t in reversed(forward[i])]
    run = tmp_path / "rev"
    _train_cli(run, data_dir, 3, extra=["--data.reverse=true", "--train.final_eval=true",
                                        "--train.bleu_max_sentences=4", "--train.bleu_beam=1"])
    src, tgt = manifest["src_lang"], manifest["tgt_lang"]
    assert (run / f"test.hyp.{src}").is_file() and not (run / f"test.hyp.{tgt}").exists()
    assert len((run / f"test.hyp.{src}").read_text(encoding="utf-8").splitlines()) == 4
    out = _train_cli(run, data_dir, 4, extra=["--data.reverse=false"], wait=False)
    text, _ = out.communicate(timeout=600)
    assert out.returncode == 2, text[-2000:]
    assert "data.reverse" in text and f"{tgt}-{src}" in text and "Traceback" not in text


def test_patience_stops_where_the_validation_losses_say_and_stays_stopped(tmp_path, data_dir):
    """train.patience=2 with a learning rate too small to move an fp32 weight: the validation loss
    stops improving after the first validation, so the run must stop two validations later (the
    rule applied by hand to the recorded losses), save there, and a resume with more updates must
    not train on."""
    run = tmp_path / "p"
    extra = ["--train.patience=2", "--train.valid_interval_updates=1", "--optim.lr=1e-12"]
    _train_cli(run, data_dir, 20, extra=extra)
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    valids = [(r["update"], r["loss"]) for r in rows if r["kind"] == "valid"]
    best, since, expected = None, 0, None
    for update, loss in valids:
        best, since = (loss, 0) if best is None or loss < best else (best, since + 1)
        if since == 2:
            expected = update
            break
    assert expected is not None and expected < 20, valids
    summary = json.loads((run / "summary.json").read_text())
    assert summary["updates"] == expected and summary["converged"] is True, summary
    assert (run / f"checkpoints/update_{expected:06d}/COMPLETE").is_file()
    again = _train_cli(run, data_dir, 30, extra=extra)
    assert max(_train_losses(run)) == expected, again.out[-2000:]


def test_a_bleu_evaluation_longer_than_the_collective_timeout_leaves_the_run_whole(tmp_path, data_dir):
    """Rank 0 decodes BLEU alone while rank 1 waits for it. With the decoding started 40 s late, past
    engine.dist_timeout_s=30 (how long a collective may wait), the run still ends with its BLEU."""
    run = tmp_path / "run"
    summary = spawn(2, "train_with_slow_bleu", tmp_path / "out", ds=ZERO[1], tmp=str(tmp_path), delay_s=40,
                    run_overrides=overrides(run, data_dir, "--train.max_updates=2", "--train.final_eval=true",
                                            "--train.bleu_max_sentences=4", "--train.bleu_beam=1",
                                            "--engine.dist_timeout_s=30"))[0]
    assert summary["updates"] == 2 and summary["test_sentences"] == 4 and "test_bleu" in summary


# ---- refusals ------------------------------------------------------------------------------------


def _refused(*args, ds=None, tmp=None):
    cmd = [sys.executable, str(REPO / "launch/train.py"), *args]
    if ds is not None:
        p = Path(tmp) / "ds.json"
        p.write_text(json.dumps(ds) if isinstance(ds, dict) else ds)
        cmd += ["--deepspeed_config", str(p)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, DS_ACCELERATOR="cpu"), timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    return out.stderr


@pytest.mark.parametrize("ds,extra,message", [
    ({"zero_optimization": {"stage": 2}}, ["--engine.pipeline_stages=2"],
     "pipeline with 2 stages needs at least 2 ranks; the world has 1"),
    ({"train_batch_size": 8, "gradient_accumulation_steps": 2}, [],
     "train_batch_size=8 != train_micro_batch_size_per_gpu (1) x gradient_accumulation_steps (2) x data-parallel size (1)"),
    ({"gradient_clipping": 1.0}, [], "'gradient_clipping' is set in the DeepSpeed JSON; it belongs to the run config (optim.clip_norm)"),
    ({"optimizer": {"type": "Adam"}}, [], "'optimizer' is set in the DeepSpeed JSON"),
    ({"bf16": {"enabled": "auto"}}, [], 'unresolved "auto" at bf16.enabled'),
    ({"train_micro_batch_size_per_gpu": 8}, [], "train_micro_batch_size_per_gpu=8: a micro-batch is one token bucket"),
    ({}, ["--optim.lr=-1"], "optim.lr: must be positive"),
    ({}, ["--model.num_heads=5"], "model.num_heads: must divide model_dim=64"),
    ({}, ["--train.nope=1"], "command line: train.nope: unknown key"),
    ({}, ["--model.preset=admin-7L"], "model.preset: unknown preset 'admin-7L'"),
    ({}, ["--data.path=/nonexistent/dir"], "data.path: /nonexistent/dir: no manifest.json"),
    ({"zero_optimization": {"stage": 3}}, ["--engine.compile=true"], "zero_optimization.stage=3 with engine.compile"),
    ({}, ["--optim.implementation=fused"], "optim.implementation: 'fused' has Adam and AdamW only"),
    ({}, ["--engine.dropout=philox"], "engine.dropout: must be one of auto, torch, bulk"),
    ("{ not json", [], "invalid JSON"),
])
def test_refused_configurations(tmp_path, ds, extra, message):
    err = _refused(*extra, f"--train.run_dir={tmp_path}/run", ds=ds, tmp=tmp_path)
    assert message in err, err
    assert "Traceback" not in err


def test_zero2_with_pipeline_is_refused():
    from admin_ds.model.config import ConfigError
    from admin_ds.train.engine import resolve_ds_config
    from admin_ds.train.run_config import load_run_config

    run = load_run_config(None, ["--engine.pipeline_stages=2"])
    with pytest.raises(ConfigError, match="zero_optimization.stage=2 with engine.pipeline_stages=2"):
        resolve_ds_config({"zero_optimization": {"stage": 2}}, run, world=4)
    ds = resolve_ds_config({"zero_optimization": {"stage": 1}, "gradient_accumulation_steps": 3}, run, world=4)
    assert ds["train_batch_size"] == 6 and ds["gradient_clipping"] == 0.0


@pytest.mark.parametrize("path", sorted((REPO / "ds_configs").glob("*.json")), ids=lambda p: p.name)
def test_every_shipped_engine_config_passes_deepspeeds_validation(path):
    """DeepSpeed's own config model accepts every engine JSON we ship, resolved against the
    default run config (it is stricter than JSON: fp16.min_loss_scale must be an integer, say)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from admin_ds.train.engine import resolve_ds_config
    from admin_ds.train.run_config import load_run_config

    raw = json.loads(path.read_text())
    ds = resolve_ds_config(raw, load_run_config(None, []), world=raw.get("pipeline", {}).get("stages", 1))
    DeepSpeedConfig(ds)


# ---- the main job --------------------------------------------------------------------------------


def test_default_main_job_under_the_deepspeed_launcher(tmp_path):
    """`deepspeed launch/train.py --deepspeed_config ds_configs/zero2.json` on the embedded default,
    shortened: it prepares data, profiles, trains on 2 ranks, checkpoints, and its BLEU beats the
    copy baseline."""
    run_dir = tmp_path / "run"
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", str(_port()), str(REPO / "launch/train.py"),
           "--deepspeed_config", str(REPO / "ds_configs/zero2.json"), f"--train.run_dir={run_dir}",
           "--data.default_pairs=6000", "--data.max_tokens=2048", "--train.max_updates=300",
           "--train.log_interval=25", "--train.bleu_max_sentences=200", "--optim.warmup_updates=50"]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=REPO)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["updates"] == 300
    assert summary["test_bleu"] > summary["test_copy_bleu"] + 1.0, summary
    assert (run_dir / "admin_profile.json").is_file() and (run_dir / "profile.ratio.init").is_file()
    assert (run_dir / "checkpoints/update_000300/COMPLETE").is_file()
    assert "[world] 2 rank(s)" in out.stdout


# The papers' recipes (Liu et al. 2020, very deep Transformers, section 4 and deepnmt's scripts; the
# Admin paper, section 5): an independent table to check every shipped run config against.
PAPER = {  # config -> (layers, width, lr, warmup)
    "wmt14_en_de_admin_6L6L": ((6, 6), 512, 1e-3, 4000), "wmt14_en_de_admin_18L18L": ((18, 18), 512, 1e-3, 4000),
    "wmt14_en_de_admin_60L12L": ((60, 12), 512, 1e-3, 4000), "wmt14_en_de_admin_100L12L": ((100, 12), 512, 1e-3, 4000),
    "wmt14_en_de_base_6L6L": ((6, 6), 512, 1e-3, 4000), "wmt14_en_fr_base_6L6L": ((6, 6), 512, 7e-4, 8000),
    "wmt14_en_fr_admin_60L12L": ((60, 12), 512, 7e-4, 8000), "wmt14_en_fr_admin_36L12L_768D": ((36, 12), 768, 7e-4, 8000),
}


def test_paper_run_configs_follow_the_papers():
    from admin_ds.train.run_config import load_run_config

    configs = {p.stem: p for p in (REPO / "launch/configs").glob("wmt14_*.yaml")}
    assert set(configs) == set(PAPER)
    for name, path in configs.items():
        run = load_run_config(str(path), [])
        cfg = run.model.build(vocab_size=44512 if "en_fr" in name else 32768)
        layers, width, lr, warmup = PAPER[name]
        assert (cfg.num_encoder_layers, cfg.num_decoder_layers, cfg.model_dim) == (*layers, width), name
        assert (run.optim.lr, run.optim.warmup_updates, run.optim.warmup_init_lr) == (lr, warmup, 1e-7), name
        assert (run.optim.optimizer, tuple(run.optim.betas), run.optim.clip_norm) == ("radam", (0.9, 0.98), 0.0), name
        assert (run.optim.label_smoothing, cfg.dropout_p, cfg.share_all_embeddings) == (0.1, 0.1, True), name
        assert cfg.init == ("default" if "_base_" in name else "admin") and cfg.norm_order == "post", name
        assert run.train.keep_last >= 10 and run.admin.formula == "reference", name  # the average of the last 10


def test_profile_only_then_reuse_reference_format(tmp_path, data_dir):
    """--profile-only writes the profile and exits; --profile reuses it (here in the reference
    code's profile.ratio.init format) and skips profiling."""
    _train_cli(tmp_path / "p", data_dir, 2, extra=["--profile-only"])
    prof = json.loads((tmp_path / "p/admin_profile.json").read_text())
    assert not (tmp_path / "p/checkpoints").exists()
    ratio = tmp_path / "p/profile.ratio.init"
    lines = ratio.read_text().splitlines()
    assert len(lines) == 4 + 6 and lines[4].startswith("1 ")
    out = _train_cli(tmp_path / "q", data_dir, 2, extra=[f"--profile={ratio}"]).out
    assert f"[admin] using the profile {ratio}" in out and "profiled omega" not in out, out[-2000:]
    reused = json.loads((tmp_path / "q/admin_profile.json").read_text())
    assert reused["formula"] == "imported"
    assert [s["omega"] for s in reused["sublayers"]] == pytest.approx([s["omega"] for s in prof["sublayers"]], rel=1e-12)


def test_train_command_reuses_a_deepnmt_profile_and_refuses_a_wrong_count(tmp_path, data_dir):
    """deepnmt's profile (bare omega values, mapped by position): one of the right length is used
    and profiling skipped; one of the wrong length ends the command before any work with one
    'error:' line naming the file and both counts, status 2, nothing written."""
    n = 2 * 2 + 3 * 2  # debug-tiny: 2L-2L
    good, bad = tmp_path / "good.init", tmp_path / "bad.init"
    good.write_text("".join(f"{1 + i / 10}\n" for i in range(n)))
    bad.write_text("".join(f"{1 + i / 10}\n" for i in range(n - 1)))
    out = _train_cli(tmp_path / "ok", data_dir, 1, extra=[f"--profile={good}"]).out
    assert f"[admin] using the profile {good}" in out and "profiled omega" not in out, out[-2000:]
    used = json.loads((tmp_path / "ok/admin_profile.json").read_text())
    assert [s["omega"] for s in used["sublayers"]] == pytest.approx([1 + i / 10 for i in range(n)])
    proc = _train_cli(tmp_path / "no", data_dir, 1, extra=[f"--profile={bad}"], wait=False)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 2, out[-2000:]
    errors = [line for line in out.splitlines() if line.startswith("error:") or "Traceback" in line]
    assert errors == [f"error: {bad}: 9 omega values; the model has 4 encoder + 6 decoder = 10 sub-layers (2L-2L)"]
    assert not any((tmp_path / "no" / name).exists() for name in ("run_config.json", "admin_profile.json", "checkpoints"))


@needs_data
def test_multi30k_recipe_trains_on_the_real_corpus(tmp_path):
    """launch/configs/multi30k_en_de.yaml, two updates on Multi30k prepared as the README says: the
    config is valid, profiles omega on real text and trains; its recipe keeps the checkpoints the
    README averages."""
    from data_prep.prepare import main as prepare

    from admin_ds.train.run_config import load_run_config

    data = tmp_path / "m30k"
    assert prepare(["en-de", str(data), "--raw-dir", str(DATA / "multi30k"), "--valid-prefix", "val",
                    "--test-prefix", "test_2016_flickr", "--vocab-size", "8000", "--quiet"]) == 0
    config = REPO / "launch/configs/multi30k_en_de.yaml"
    run = load_run_config(str(config), [])
    assert (run.model.build().init, run.model.build().norm_order) == ("admin", "post")
    assert run.train.keep_last * run.train.save_interval_updates <= run.train.max_updates
    cmd = [sys.executable, "launch/train.py", "--deepspeed_config", "ds_configs/zero1.json", "--config", str(config),
           f"--data.path={data}", f"--train.run_dir={tmp_path / 'run'}", "--train.max_updates=2",
           "--train.log_interval=1", "--train.final_eval=false"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "6L-6L 256/1024/4, init=admin, norm=post, vocabulary 8000" in proc.stdout
    profile = json.loads((tmp_path / "run/admin_profile.json").read_text())
    assert profile["tokens"]["src"] > 1000 and max(s["omega"] for s in profile["sublayers"]) > 1.5
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if r["kind"] == "train"]
    assert len(losses) == 2 and all(np.isfinite(losses))

