"""After training (CPU): model files, checkpoint averaging, launch/translate.py on one and two
ranks, each against an independent reference (DeepSpeed's own consolidation, admin_ds.decode
called directly). The exports are tests/test_export.py's.

One tiny run is trained once for the module with launch/train.py (40 updates, a checkpoint every
10); the model files also use a debug-tiny model trained in-process to copy its input (copy_task.py).
"""

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest
import torch

from copy_task import train_copy_model
from distributed import REPO, free_port

from admin_ds.inference.translate import translate
from admin_ds.inference.model_file import (build_from_model_file, load_model_file, load_run_checkpoint,
                                           save_model_file)

ENV = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def cli(script, *args, stdin=None, timeout=300, launcher=(sys.executable,)):
    return subprocess.run([*launcher, str(REPO / "launch" / script), *map(str, args)], input=stdin,
                          capture_output=True, text=True, env=ENV, timeout=timeout, cwd=REPO)


def launch_module(name):
    """A launch/ script as a module, loaded from its file (launch/ is not a package, and putting
    it on sys.path would let its evaluate.py shadow other modules of that name)."""
    spec = importlib.util.spec_from_file_location(f"launch_{name}", REPO / "launch" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ok(out):
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def refused(out, message):
    assert out.returncode != 0, out.stdout + out.stderr
    assert message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr, out.stderr


@pytest.fixture(scope="module", autouse=True)
def _one_thread(single_thread):
    yield


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("run") / "run"
    ok(cli("train.py", "--deepspeed_config", REPO / "ds_configs/zero2.json", f"--train.run_dir={run}",
           "--data.default_pairs=1500", "--data.default_vocab_size=400", "--data.max_tokens=2048",
           "--optim.warmup_updates=10", "--optim.lr=3e-3", "--train.max_updates=40",
           "--train.save_interval_updates=10", "--train.keep_last=5", "--train.final_eval=false"))
    return run


@pytest.fixture(scope="module")
def lines(run_dir):
    """Test sentences with an empty and a blank line among them."""
    src = (run_dir / "data/test.en").read_text(encoding="utf-8").splitlines()[:14]
    return src[:5] + [""] + src[5:10] + ["   "] + src[10:]


@pytest.fixture(scope="module")
def input_file(lines, tmp_path_factory):
    path = tmp_path_factory.mktemp("input") / "src.txt"
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def single_rank_output(run_dir, input_file):
    return ok(cli("translate.py", "--checkpoint", run_dir, "--input", input_file, "--quiet")).splitlines()


@pytest.fixture(scope="module")
def copy_model(run_dir, tmp_path_factory):
    vocab = load_run_checkpoint(run_dir).model_config.vocab_size
    return train_copy_model(tmp_path_factory.mktemp("copy") / "copy.pt", vocab, (run_dir / "data/spm.model").read_bytes())


# ---- (a) model files and averaging ---------------------------------------------------------------


def test_model_file_round_trip(copy_model, tmp_path):
    mf = load_model_file(copy_model)  # weights_only=True inside
    assert isinstance(mf.subword_model_bytes, bytes) and mf.meta == {"source": "copy task"}
    again = tmp_path / "again.pt"
    save_model_file(again, mf.model_config, mf.state_dict, mf.profile, mf.run_config, mf.subword_model_bytes, mf.meta)
    mf2 = load_model_file(again)
    assert mf2.model_config == mf.model_config and mf2.subword_sha256 == mf.subword_sha256
    assert all(torch.equal(mf.state_dict[k], v) for k, v in mf2.state_dict.items())
    model, subword = build_from_model_file(mf2)
    assert subword.vocab_size == mf.model_config.vocab_size and not model.training


def test_average_equals_hand_average(run_dir, tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    out = tmp_path / "avg.pt"
    ok(cli("average_checkpoints.py", "--run", run_dir, "--last", 3, "--out", out))
    avg = load_model_file(out)
    tags = ["update_000020", "update_000030", "update_000040"]
    assert avg.meta["averaged_tags"] == tags
    states = [get_fp32_state_dict_from_zero_checkpoint(str(run_dir / "checkpoints"), tag=t) for t in tags]
    assert set(avg.state_dict) == set(states[0])
    for name, value in avg.state_dict.items():
        hand = (sum(s[name].double() for s in states) / 3).float()
        assert value.dtype == torch.float32
        assert torch.allclose(value, hand, rtol=0, atol=1e-7), name
    assert not torch.equal(avg.state_dict["src_embed.weight"], states[-1]["src_embed.weight"])
    newest = load_run_checkpoint(run_dir)  # config, profile and subword model travel along
    assert avg.model_config == newest.model_config and avg.profile == newest.profile
    assert avg.subword_model_bytes == (run_dir / "data/spm.model").read_bytes()


def test_keep_best_keeps_and_averages_the_checkpoints_of_lowest_validation_loss(tmp_path):
    """A run whose validation loss turns up (a high learning rate): train.keep_best keeps the two
    checkpoints of lowest validation loss, as metrics.jsonl records them, beside the newest, and
    --best 2 averages exactly those."""
    import json

    run = tmp_path / "run"
    ok(cli("train.py", "--deepspeed_config", REPO / "ds_configs/zero1.json", f"--train.run_dir={run}",
           "--data.default_pairs=1500", "--data.default_vocab_size=400", "--data.max_tokens=2048",
           "--optim.warmup_updates=2", "--optim.lr=5e-2", "--train.max_updates=24", "--train.valid_interval_updates=2",
           "--train.save_interval_updates=2", "--train.keep_last=1", "--train.keep_best=2", "--train.final_eval=false"))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    valid = {r["update"]: r["loss"] for r in records if r["kind"] == "valid"}
    best = sorted(sorted(valid, key=valid.get)[:2])
    assert best != sorted(valid)[-2:], valid  # the loss turned up: the best are not the newest
    kept = sorted(p.name for p in (run / "checkpoints").glob("update_*"))
    assert kept == [f"update_{u:06d}" for u in best] + ["update_000024"]
    out = tmp_path / "best2.pt"
    ok(cli("average_checkpoints.py", "--run", run, "--best", 2, "--out", out))
    assert load_model_file(out).meta["averaged_tags"] == [f"update_{u:06d}" for u in best]


def test_bf16_zero1_checkpoint_gives_its_fp32_master_weights(tmp_path):
    """bf16 with ZeRO-1 (ds_configs/zero1_bf16.json) trains with DeepSpeed's BF16_Optimizer, whose
    checkpoints DeepSpeed's zero_to_fp32 refuses. Trained on 2 data-parallel ranks (each holds half
    of the fp32 master weights), the checkpoint loads whole, its weights are fp32 values that round
    to exactly the module's bf16 copy DeepSpeed saved beside them (an independent record), and
    averaging and translating it work."""
    from admin_ds import safe_load

    run = tmp_path / "run"
    launcher = (sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()))
    ok(cli("train.py", "--deepspeed_config", REPO / "ds_configs/zero1_bf16.json", f"--train.run_dir={run}",
           "--data.default_pairs=600", "--data.default_vocab_size=400", "--data.max_tokens=1024",
           "--optim.warmup_updates=2", "--optim.lr=3e-3", "--train.max_updates=6",
           "--train.save_interval_updates=3", "--train.final_eval=false", launcher=launcher))
    tag = run / "checkpoints" / "update_000006"
    assert len(list(tag.glob("bf16_zero_pp_rank_*_optim_states.pt"))) == 2
    mf = load_run_checkpoint(run)
    module = safe_load.load(tag / "mp_rank_00_model_states.pt")["module"]
    assert mf.meta["update"] == 6 and set(mf.state_dict) == set(module)
    for name, saved in module.items():
        assert mf.state_dict[name].dtype == torch.float32
        assert torch.equal(mf.state_dict[name].to(saved.dtype), saved), name
    # fp32 values, not the bf16 copy: most differ from it
    differ = sum((mf.state_dict[n] != module[n].float()).sum().item() for n in module)
    assert differ > sum(t.numel() for t in module.values()) // 2
    out = tmp_path / "last2.pt"
    ok(cli("average_checkpoints.py", "--run", run, "--last", 2, "--out", out))
    src = tmp_path / "src.txt"
    src.write_text("a b c\nd e\n")
    assert len(ok(cli("translate.py", "--checkpoint", out, "--input", src, "--quiet")).splitlines()) == 2


# ---- (b) translate.py ----------------------------------------------------------------------------


def test_translate_matches_direct_call_and_fold(run_dir, input_file, lines, single_rank_output):
    out = single_rank_output
    assert len(out) == len(lines)
    assert all(o == "" for o, line in zip(out, lines) if not line.strip())  # empty lines stay in place
    assert len(set(out)) > 5  # outputs differ between sentences, so their order is checked
    folded = ok(cli("translate.py", "--checkpoint", run_dir / "checkpoints/update_000040", "--input",
                    input_file, "--fold", "--quiet")).splitlines()
    assert folded == out  # folded vs as trained
    model, subword = build_from_model_file(load_run_checkpoint(run_dir))
    direct = translate(model, subword, lines, beam=4, lenpen=0.6, max_len_a=1.2, max_len_b=10)
    assert direct == out


def test_translate_int8(run_dir, input_file, lines, single_rank_output):
    """--int8: one line per input line, empty lines kept empty, most lines as fp32 translates them
    (int8 rounding may flip near-ties of this 40-update model), and the summary says int8;
    combinations that cannot be int8 are refused with a one-line error."""
    out = cli("translate.py", "--checkpoint", run_dir, "--input", input_file, "--quiet", "--int8")
    int8 = ok(out).splitlines()
    assert len(int8) == len(lines) and ", int8;" in out.stderr
    assert all(o == "" for o, line in zip(int8, lines) if not line.strip())
    same = sum(a == b for a, b in zip(int8, single_rank_output) if a)
    assert same >= 0.5 * sum(1 for line in lines if line.strip()), (same, len(lines))
    refused(cli("translate.py", "--checkpoint", run_dir, "--input", input_file, "--int8", "--dtype", "bf16"),
            "--int8")


def test_translate_nbest_from_stdin(run_dir, lines, single_rank_output):
    text = "".join(f"{line}\n" for line in lines)
    rows = [r.split("\t") for r in ok(cli("translate.py", "--checkpoint", run_dir, "--input", "-",
                                          "--nbest", 3, "--quiet", stdin=text)).splitlines()]
    by_index = {}
    for i, score, hyp in rows:
        by_index.setdefault(int(i), []).append((float(score), hyp))
    assert sorted(by_index) == list(range(len(lines)))
    for i, hyps in by_index.items():
        assert hyps[0][1] == single_rank_output[i]
        assert len(hyps) == (3 if lines[i].strip() else 1)
        assert [s for s, _ in hyps] == sorted((s for s, _ in hyps), reverse=True)


# ---- (c) two ranks -------------------------------------------------------------------------------


def test_two_ranks_equal_one(run_dir, input_file, single_rank_output):
    launcher = (sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", str(free_port()))
    out = ok(cli("translate.py", "--checkpoint", run_dir, "--input", input_file, "--quiet", launcher=launcher))
    assert out.splitlines() == single_rank_output


# ---- (d) bad input -------------------------------------------------------------------------------


def test_bad_input_gives_clear_messages(run_dir, input_file, tmp_path):
    from admin_ds.inference.model_file import ModelFileError, load_any

    refused(cli("translate.py", "--checkpoint", tmp_path / "missing", "--input", input_file),
            "argument --checkpoint: no such file or directory")
    torn = tmp_path / "torn_run"
    shutil.copytree(run_dir / "checkpoints/update_000010", torn / "checkpoints/update_000010")
    (torn / "checkpoints/update_000010/COMPLETE").unlink()
    refused(cli("translate.py", "--checkpoint", torn, "--input", input_file), "no complete, intact checkpoint")
    with pytest.raises(ModelFileError, match="missing: no such run directory, checkpoint directory or model file"):
        load_any(tmp_path / "missing")
    with pytest.raises(ModelFileError, match="checkpoint is incomplete"):
        load_any(torn / "checkpoints/update_000010")
    with pytest.raises(ModelFileError, match="not an admin-ds model file"):
        load_any(run_dir / "run_config.json")

    two = tmp_path / "two_run"
    for tag in ("update_000030", "update_000040"):
        shutil.copytree(run_dir / "checkpoints" / tag, two / "checkpoints" / tag)
    refused(cli("average_checkpoints.py", "--run", two, "--last", 5, "--out", tmp_path / "avg.pt"),
            "2 complete, intact checkpoint(s) (update_000030, update_000040), fewer than --last 5")
    assert not (tmp_path / "avg.pt").exists()
