"""Reliability with real processes and real faults (CPU, gloo): SIGKILL at several moments and a
full disk during a checkpoint write, resume on another layout through DeepSpeed's universal
checkpoint, the divergence guard under ZeRO-2 on two ranks, and refusals of mismatched inputs.
docs/guarantees.md maps each failure to the test here that injects it."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import NO_DROPOUT, overrides
from distributed import REPO, free_port, spawn

from admin_ds import safe_load


def rel(a, b):
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-12)))


def _cli(run_dir, data_dir, updates, fault=None, extra=(), ds=REPO / "ds_configs/zero2.json"):
    """`python launch/train.py` (one process, ZeRO-2, dropout on), started; returns the Popen. With
    a ``fault``, the same through tests/fault_train.py, which installs tests/faults.py's hooks."""
    script = [str(REPO / "tests/fault_train.py"), fault] if fault else [str(REPO / "launch/train.py")]
    cmd = [sys.executable, *script, "--deepspeed_config", str(ds),
           *overrides(run_dir, data_dir, f"--train.max_updates={updates}", "--train.log_interval=1",
                      "--train.save_interval_updates=2", *extra)]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()))
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)


def _finish(proc):
    out, _ = proc.communicate(timeout=600)
    return proc.returncode, out


def _metrics(run_dir, kind):
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == kind]


def _tags(run_dir):
    d = Path(run_dir) / "checkpoints"
    return {p.name: (p / "COMPLETE").is_file() for p in d.iterdir() if p.is_dir()} if d.is_dir() else {}


def _final_state(run_dir, tag):
    """The model and the fp32 master partition of a ZeRO-2 single-process checkpoint."""
    d = Path(run_dir) / "checkpoints" / tag
    module = safe_load.load(d / "mp_rank_00_model_states.pt")["module"]
    optim = safe_load.load(d / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    masters = optim["optimizer_state_dict"]["single_partition_of_fp32_groups"]
    return module, masters


# ---- 1. killed at any moment, lose nothing finished ----------------------------------------------


def test_killed_anywhere_resumes_to_the_uninterrupted_model(tmp_path, data_dir):
    """One run directory, the same command each time, with dropout on. Faults in turn: SIGKILL
    during profiling; disk full while checkpoint 4 is written (the run stops with a clear message,
    checkpoint 2 stays the newest); SIGKILL while checkpoint 4 is written (torn: not chosen, and
    removed at the next start); SIGKILL in the middle of update 5. The final model equals the
    uninterrupted run's, bit for bit."""
    ref = _cli(tmp_path / "ref", data_dir, 6)  # runs alongside the faulted chain
    run = tmp_path / "run"

    rc, out = _finish(_cli(run, data_dir, 6, fault="kill_during_profile"))
    assert rc == -9 and "SIGKILL during profiling" in out, out[-2000:]
    assert not (run / "admin_profile.json").exists() and _tags(run) == {}

    rc, out = _finish(_cli(run, data_dir, 6, fault="enospc_during_save:4"))
    assert rc != 0
    assert "No space left on device (injected by tests/faults.py)" in out, out[-3000:]
    assert "the newest complete checkpoint is still" in out and "update_000002" in out.split("CheckpointWriteError")[-1]
    assert _tags(run) == {"update_000002": True}  # the torn update_000004 was removed

    rc, out = _finish(_cli(run, data_dir, 6, fault="kill_during_save:4"))
    assert rc == -9 and "while writing checkpoint 4" in out, out[-2000:]
    assert _tags(run) == {"update_000002": True, "update_000004": False}
    torn = sorted(p.name for p in (run / "checkpoints/update_000004").iterdir())
    assert "mp_rank_00_model_states.pt" in torn and "zero_pp_rank_0_mp_rank_00_optim_states.pt" not in torn

    rc, out = _finish(_cli(run, data_dir, 6, fault="kill_during_update:5"))
    assert rc == -9 and "during update 5" in out, out[-2000:]
    assert "removed incomplete checkpoint(s): update_000004" in out
    assert "[resume] from" in out and "update_000002: update 2" in out

    rc, out = _finish(_cli(run, data_dir, 6))
    assert rc == 0, out[-3000:]
    assert "update_000004: update 4" in out
    rc, ref_out = _finish(ref)
    assert rc == 0, ref_out[-3000:]

    want = {r["update"]: r["loss"] for r in _metrics(tmp_path / "ref", "train")}
    got = [(r["update"], r["loss"]) for r in _metrics(run, "train")]  # updates 1-4 ran three times
    assert sorted({u for u, _ in got}) == sorted(want) and all(loss == want[u] for u, loss in got), (got, want)
    module, masters = _final_state(run, "update_000006")
    ref_module, ref_masters = _final_state(tmp_path / "ref", "update_000006")
    assert module.keys() == ref_module.keys()
    worst = max(rel(module[k].numpy(), ref_module[k].numpy()) for k in module)
    assert worst == 0.0, worst  # bitwise
    assert all(torch.equal(a, b) for a, b in zip(masters, ref_masters))


# ---- 2. resume on a different layout ---------------------------------------------------------------

PIPE = {"pipeline": {"stages": 2}, "zero_optimization": {"stage": 1}, "gradient_accumulation_steps": 2}
DP1_Z3 = {"zero_optimization": {"stage": 3}, "gradient_accumulation_steps": 2}


def _copy_tag(src_run, tag, dst_run):
    (dst_run / "checkpoints").mkdir(parents=True)
    shutil.copytree(src_run / "checkpoints" / tag, dst_run / "checkpoints" / tag)


def test_resume_on_other_layouts_through_universal_checkpoints(tmp_path, data_dir):
    """Data-parallel x accumulation stays 2, so every layout sees the same batches. The
    reference trains 6 updates as a 2-stage pipeline on 2 ranks (ZeRO-1). Its update-2
    checkpoint resumes on 1 rank with ZeRO-3 (pipeline -> data-parallel, 2 ranks -> 1, ZeRO-1 ->
    ZeRO-3), and that run's update-4 checkpoint as the 2-stage pipeline again (ZeRO-3 -> ZeRO-1).
    The parameter names are the same in every layout, so nothing is renamed. The next losses, the
    parameters (omega included) and the profile match the uninterrupted run."""
    ov = lambda d: overrides(d, data_dir, *NO_DROPOUT)
    ref = spawn(2, "train_and_save", tmp_path / "o_ref", run_overrides=ov(tmp_path / "ref"), ds=PIPE,
                tmp=str(tmp_path), updates=6, save_at=[2], report_at=[4, 6])[0]
    chain = [("ref", "update_000002", "dp1", 1, DP1_Z3), ("dp1", "update_000004", "pipe", 2, PIPE)]
    diffs = {}
    for src, tag, dst, world, ds in chain:
        _copy_tag(tmp_path / src, tag, tmp_path / dst)
        start = int(tag[-6:])
        res = spawn(world, "train_and_save", tmp_path / f"o_{dst}", run_overrides=ov(tmp_path / dst), ds=ds,
                    tmp=str(tmp_path), updates=2, save_at=[start + 2], report_at=[start + 2])[0]
        assert res["resumed"] and res["start"] == start, dst
        assert (tmp_path / dst / "checkpoints" / f"{tag}_universal" / "CONVERTED").is_file()
        got = [res["losses"][str(u)] for u in (start + 1, start + 2)]
        want = [ref["losses"][str(u)] for u in (start + 1, start + 2)]
        diffs[dst] = rel(got, want)
        assert diffs[dst] <= 1e-5, (dst, got, want)
        assert res["profile"] == ref["profile"], dst
        p, q = res["params"][str(start + 2)], ref["params"][str(start + 2)]
        assert sorted(p) == sorted(q)
        omegas = [n for n in q if n.endswith("omega")]
        assert len(omegas) == 10 and rel([p[n] for n in omegas], [q[n] for n in omegas]) <= 1e-5, dst
        # per-parameter sums of ~10^3 entries: differences of summation order only
        np.testing.assert_allclose([p[n] for n in sorted(q)], [q[n] for n in sorted(q)], rtol=1e-4, atol=1e-5,
                                   err_msg=dst)
    print("relative loss differences after each layout change:", diffs)
    # One set of names in every layout: the universal folders of both conversions hold the same ones.
    names = [sorted(p.name for p in (tmp_path / run / "checkpoints" / f"{tag}_universal/zero").iterdir() if p.is_dir())
             for run, tag in (("dp1", "update_000002"), ("pipe", "update_000004"))]
    assert names[0] == names[1] and "encoder_layers.0.self_attn.q_proj.weight" in names[0] and "src_embed.weight" in names[0]


def test_layout_changes_that_cannot_work_are_refused(tmp_path):
    from admin_ds.model.config import ConfigError
    from admin_ds.train.checkpoints import plan_resume

    def layout(dp=1, pp=1, zero=1, precision="fp32", gas=1):
        return {"world_size": dp * pp, "data_parallel": dp, "pipeline": pp, "zero": zero, "precision": precision,
                "gradient_accumulation_steps": gas}

    assert not plan_resume(tmp_path, "t", {"layout": layout(2)}, layout(2)).universal
    assert plan_resume(tmp_path, "t", {"layout": layout(2, zero=1)}, layout(1, zero=3, gas=2)).universal
    assert not plan_resume(tmp_path, "t", {"layout": layout(2, zero=0)}, layout(1, zero=0, gas=2)).universal
    with pytest.raises(ConfigError, match="universal checkpoint.*this one is saved with ZeRO-0"):
        plan_resume(tmp_path, "t", {"layout": layout(1, pp=2, zero=0)}, layout(2, zero=1))
    with pytest.raises(ConfigError, match="this one is resumed with ZeRO-0"):
        plan_resume(tmp_path, "t", {"layout": layout(2, zero=2)}, layout(2, zero=0))
    note = plan_resume(tmp_path, "t", {"layout": layout(2, zero=2)}, layout(1, zero=2)).notes
    assert "data position is resumed approximately" in note[0]


# ---- 3. the divergence guard ------------------------------------------------------------------------


def test_guard_skips_nonfinite_updates_and_rolls_back_on_divergence(tmp_path, data_dir):
    """ZeRO-2 on 2 ranks, 12 updates, checkpoints every 2. Injected: NaN in rank 0's loss at
    update 3 (skipped on both ranks, counted, weights untouched); a 30x loss spike at update 6
    (rollback to checkpoint 4, learning rate x0.5); NaN at updates 9 and 10 (2 consecutive:
    rollback to checkpoint 8, x0.25). The run finishes, and the multiplier comes back from the
    checkpoint."""
    run = tmp_path / "run"
    ov = overrides(run, data_dir, "--train.max_updates=12", "--train.save_interval_updates=2",
                   "--train.log_interval=1", "--guard.max_consecutive_nonfinite=2", "--guard.warmup_updates=2",
                   "--guard.ema_beta=0.5")
    res = spawn(2, "fit_with_faults", tmp_path / "out", run_overrides=ov,
                ds={"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 1}, tmp=str(tmp_path),
                fault="nan_loss:3,spike_loss:6:30,nan_loss:9-10")
    assert res[0]["digests"] == res[1]["digests"]  # the ranks stay identical
    d = res[0]["digests"]
    assert d["3"][0] == d["2"][0] and d["4"][0] != d["3"][0]  # the skipped update left the weights as they were

    skips = _metrics(run, "skip")
    assert [s["update"] for s in skips] == [3, 9, 10]
    rollbacks = _metrics(run, "rollback")
    assert [(r["update"], r["to_update"], r["lr_scale"]) for r in rollbacks] == [(6, 4, 0.5), (10, 8, 0.25)]
    assert rollbacks[0]["reason"].startswith("loss spike: ") and "x running average" in rollbacks[0]["reason"]
    assert rollbacks[1]["reason"] == "2 consecutive updates with a non-finite loss or gradient"
    train = _metrics(run, "train")
    assert train[-1]["update"] == 12 and train[-1]["skipped_nonfinite"] == 3
    # the learning rate at update 5, before and after the first rollback: halved; right after
    # each rollback: half what the checkpoint's update ran at
    at5 = [r["lr"] for r in train if r["update"] == 5]
    assert len(at5) == 2 and at5[1] == pytest.approx(0.5 * at5[0], rel=1e-9)
    lr_at = {r["update"]: r["lr"] for r in train}  # the last pass of each update
    first_at4 = next(r["lr"] for r in train if r["update"] == 4)
    assert rollbacks[0]["lr"] == pytest.approx(0.5 * first_at4, rel=1e-9)
    assert rollbacks[1]["lr"] == pytest.approx(0.5 * lr_at[8], rel=1e-9)
    assert res[0]["summary"]["updates"] == 12
    assert res[0]["reloaded_update"] == 12 and res[0]["reloaded_guard"]["lr_scale"] == 0.25
    assert res[0]["reloaded_guard"]["rollbacks"] == 2 and res[0]["reloaded_lr"] == pytest.approx(train[-1]["lr"])


def test_plain_optimizer_skips_nonfinite_gradients():
    """ZeRO-0 fp32 (the one configuration whose optimizer DeepSpeed does not wrap): the installed
    check sets ``overflow`` for DeepSpeed's engine and leaves parameters and state untouched."""
    from admin_ds.train.guard import install_skip

    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.RAdam([p], lr=0.1)
    engine = type("E", (), {"optimizer": opt})()
    assert install_skip(engine)
    for bad in ([1.0, float("nan"), 0.0], [float("inf"), 1.0, 0.0], [float("inf"), float("-inf"), 0.0]):
        p.grad = torch.tensor(bad)
        opt.step()
        assert opt.overflow and torch.equal(p.detach(), torch.ones(3)) and not opt.state, bad
    p.grad = torch.tensor([1.0, 1.0, 1.0])
    opt.step()
    assert not opt.overflow and not torch.equal(p.detach(), torch.ones(3))


# ---- 4. loading safely ------------------------------------------------------------------------------


def test_rng_states_load_with_weights_only(tmp_path):
    import random

    from admin_ds.train.checkpoints import rng_state, set_rng_state

    torch.save(rng_state(), tmp_path / "rng.pt")
    want = (random.random(), np.random.rand(), torch.rand(1).item())
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == want


def test_corrupt_checkpoints_and_mismatched_inputs(tmp_path, data_dir):
    """Through the real start-up, three runs side by side on copies of one run directory: a
    checkpoint with one flipped byte is set aside (its digest in COMPLETE no longer matches) and
    the run resumes from the previous one, repeating the same updates; a checkpoint of another
    architecture is refused naming the field; a data directory with one flipped byte in a .bin
    is refused (data.path). A different vocabulary or subword model is refused by the same check
    as the architecture, shown on the checkpoint's own COMPLETE description."""
    from admin_ds.checkpoint_format import read_info
    from admin_ds.model.config import ConfigError
    from admin_ds.train.checkpoints import check_compatible
    from admin_ds.train.run_config import load_run_config

    def flip_byte(path):
        blob = bytearray(path.read_bytes())
        blob[len(blob) // 2] ^= 0xFF
        path.write_bytes(bytes(blob))

    run = tmp_path / "run"
    rc, out = _finish(_cli(run, data_dir, 4))
    assert rc == 0, out[-3000:]
    for copy in ("corrupt", "arch"):
        shutil.copytree(run, tmp_path / copy)
    flip_byte(tmp_path / "corrupt/checkpoints/update_000004/zero_pp_rank_0_mp_rank_00_optim_states.pt")
    bad = tmp_path / "data"
    shutil.copytree(data_dir, bad)
    flip_byte(sorted(bad.glob("*.bin"))[0])

    corrupt = _cli(tmp_path / "corrupt", data_dir, 4)
    arch = _cli(tmp_path / "arch", data_dir, 4, extra=["--model.num_encoder_layers=3"])
    data = _cli(tmp_path / "run2", bad, 2)
    rc, out = _finish(corrupt)
    assert rc == 0, out[-3000:]
    assert ("update_000004 is corrupt (zero_pp_rank_0_mp_rank_00_optim_states.pt does not match its sha256): "
            "moved to update_000004.corrupt") in out
    assert "update_000002: update 2" in out
    assert (tmp_path / "corrupt/checkpoints/update_000004.corrupt/CORRUPT").is_file()
    assert _tags(tmp_path / "corrupt")["update_000004"]  # written again
    losses = [(r["update"], r["loss"]) for r in _metrics(tmp_path / "corrupt", "train")]
    assert losses[4:] == losses[2:4]  # updates 3 and 4 again, identical
    rc, out = _finish(arch)
    assert rc == 2 and "error:" in out and "Traceback" not in out, out[-3000:]
    assert "the checkpoint's model differs from the run config in model.num_encoder_layers (checkpoint 2, run 3)" in out
    rc, out = _finish(data)
    assert rc == 2 and "error: data.path: " in out and "Traceback" not in out, out[-3000:]

    info = read_info(run / "checkpoints/update_000004")
    manifest = json.loads((data_dir / "manifest.json").read_text())
    cfg = load_run_config(None, overrides(run, data_dir)).model.build(vocab_size=manifest["vocab_size"])
    check_compatible("ckpt", info, cfg, manifest)  # the same data and model: accepted
    other_vocab = load_run_config(None, []).model.build(vocab_size=manifest["vocab_size"] + 8)
    with pytest.raises(ConfigError, match=r"model\.vocab_size \(checkpoint 400, run 408\) \(the vocabulary size"):
        check_compatible("ckpt", info, other_vocab, manifest)
    with pytest.raises(ConfigError, match="trained with a different subword model than data.path's spm.model"):
        check_compatible("ckpt", info, cfg, {**manifest, "subword_sha256": "0" * 64})
