"""After training (CPU): model files, checkpoint averaging, launch/translate.py on one and two
ranks, and the export to transformers' MarianMTModel and CTranslate2, each against an independent
reference (DeepSpeed's own consolidation, admin_ds.decode called directly, transformers and
CTranslate2 running the exported weights).

One tiny run is trained once for the module with launch/train.py (40 updates, a checkpoint every
10). Its translations are degenerate (40 updates), so decoding comparisons also use a debug-tiny
Admin model trained in-process to copy its input (~10 s): its outputs end at varied lengths.
"""

import importlib.util
import os
import random
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from distributed import REPO, free_port

from admin_ds.inference.decode import greedy
from admin_ds.inference.translate import translate
from admin_ds.model import build_model
from admin_ds.inference.model_file import (ModelFile, build_from_model_file, load_model_file, load_run_checkpoint,
                                 save_model_file)
from admin_ds.presets import get_preset

PAD, EOS = 1, 2
ENV = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
NO_DROPOUT = dict(dropout_p=0.0, attention_dropout_p=0.0, activation_dropout_p=0.0)


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
def single_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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
    """A debug-tiny Admin model trained to copy ids 4..39, saved as a model file with the run's
    subword model (its vocabulary size). Trained omega leaves the first sub-layers' omega != 1."""
    torch.manual_seed(0)
    vocab = load_run_checkpoint(run_dir).model_config.vocab_size
    cfg = get_preset("debug-tiny", vocab_size=vocab, max_positions=64, **NO_DROPOUT)
    model = build_model(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=5e-3, betas=(0.9, 0.98))
    g = random.Random(0)
    for step in range(150):
        for group in opt.param_groups:
            group["lr"] = 5e-3 * min((step + 1) / 20, 1.0 - 0.9 * step / 150)
        seqs = [[g.randrange(4, 40) for _ in range(g.randint(3, 8))] for _ in range(48)]
        w = max(map(len, seqs)) + 1
        src, tin, tout = (torch.full((48, w), PAD) for _ in range(3))
        for i, s in enumerate(seqs):
            src[i, :len(s) + 1] = torch.tensor(s + [EOS])
            tin[i, :len(s) + 1] = torch.tensor([EOS] + s)
            tout[i, :len(s) + 1] = torch.tensor(s + [EOS])
        loss = F.cross_entropy(model(src, tin).view(-1, vocab), tout.view(-1), ignore_index=PAD)
        opt.zero_grad()
        loss.backward()
        opt.step()
    path = tmp_path_factory.mktemp("copy") / "copy.pt"
    spm = (run_dir / "data/spm.model").read_bytes()
    save_model_file(path, cfg, model.state_dict(), None, None, spm, {"source": "copy task"})
    return path


def copy_sources(n=12, seed=1):
    g = random.Random(seed)
    seqs = [[g.randrange(4, 40) for _ in range(g.randint(1, 8))] + [EOS] for _ in range(n)]
    src = torch.full((n, max(map(len, seqs))), PAD)
    for i, s in enumerate(seqs):
        src[i, :len(s)] = torch.tensor(s)
    return src


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


# ---- (d) export to transformers' MarianMTModel ---------------------------------------------------


def _hf_greedy(hf, src, max_len):
    """transformers' greedy search with our constraints: no pad, no EOS at the first step, EOS
    forced after max_len tokens (forced_eos_token_id in the exported config)."""
    out = hf.generate(input_ids=src, attention_mask=src.ne(PAD), num_beams=1, do_sample=False,
                      max_new_tokens=max_len + 1, min_new_tokens=1, suppress_tokens=[PAD])
    hyps = []
    for row in out[:, 1:].tolist():  # the first token is decoder_start_token_id
        hyps.append(row[:row.index(EOS)] if EOS in row else row)
    return hyps


def _export(source, out_dir):
    from admin_ds.inference.export import export_hf_marian

    from admin_ds.inference.model_file import load_any

    return export_hf_marian(load_any(source), out_dir)


@pytest.fixture(scope="module")
def exports(run_dir, copy_model, tmp_path_factory):
    base = tmp_path_factory.mktemp("export")
    return {"run": (run_dir, _export(run_dir, base / "run"), base / "run"),
            "copy": (copy_model, _export(copy_model, base / "copy"), base / "copy")}


@pytest.mark.parametrize("which", ["run", "copy"])
def test_marian_export_same_logits_and_greedy(exports, which, lines):
    from transformers import MarianMTModel, MarianTokenizer

    from admin_ds.fold import fold_omega
    from admin_ds.inference.model_file import load_any

    source, report, hf_dir = exports[which]
    model, subword = build_from_model_file(load_any(source))
    hf = MarianMTModel.from_pretrained(str(hf_dir)).eval()
    # A trained Admin model folds with an embedding-output scale: the untied Marian layout.
    assert report["embeddings"] == "untied (embedding output scale)"
    assert fold_omega(model).cfg.embedding_output_scale

    g = torch.Generator().manual_seed(0)
    V = model.cfg.vocab_size
    src = torch.randint(4, V, (3, 9), generator=g)
    src[:, -1] = EOS
    src[1, 5:] = PAD  # right padding
    src[1, 4] = EOS
    tgt = torch.randint(4, V, (3, 6), generator=g)
    tgt[:, 0] = EOS
    with torch.no_grad():
        ours = model(src, tgt)
        theirs = hf(input_ids=src, attention_mask=src.ne(PAD), decoder_input_ids=tgt).logits
    diff = float((ours - theirs).abs().max())
    print(f"[{which}] logits max abs diff {diff:.2e}")
    assert diff <= 1e-4

    if which == "copy":
        src = copy_sources()
        ours = greedy(model, src, max_len_a=0, max_len_b=src.size(1) + 3)
        assert len({len(h) for h in ours}) >= 4  # hypotheses end at varied lengths
        with torch.no_grad():
            assert _hf_greedy(hf, src, max_len=src.size(1) + 3) == ours
    else:
        text = [line for line in lines if line.strip()][:6]
        tok = MarianTokenizer.from_pretrained(str(hf_dir))
        batch = tok(text, return_tensors="pt", padding=True)
        ids = subword.encode(text)
        assert [row[:len(i) + 1] for row, i in zip(batch.input_ids.tolist(), ids)] == [i + [EOS] for i in ids]
        assert tok.decode(batch.input_ids[0], skip_special_tokens=True) == subword.decode([ids[0]])[0]
        with torch.no_grad():
            assert _hf_greedy(hf, batch.input_ids, max_len=12) == greedy(model, batch.input_ids, max_len_a=0, max_len_b=12)


def test_marian_export_tied_layout_and_refusals(tmp_path, run_dir):
    """Without an embedding-output scale (default init) the standard tied layout; Pre-LN refused."""
    from transformers import MarianMTModel

    from admin_ds.inference.export import ExportError, export_hf_marian

    spm = (run_dir / "data/spm.model").read_bytes()
    torch.manual_seed(1)
    cfg = get_preset("debug-tiny", init="default", vocab_size=400, max_positions=32, **NO_DROPOUT)
    model = build_model(cfg).eval()
    mf = ModelFile(cfg, model.state_dict(), None, None, spm, {})
    report = export_hf_marian(mf, tmp_path / "tied")
    assert report["embeddings"] == "tied" and report["logits_max_abs_diff"] <= 1e-4
    hf = MarianMTModel.from_pretrained(str(tmp_path / "tied"))
    assert hf.lm_head.weight.data_ptr() == hf.model.shared.weight.data_ptr()
    pre = cfg.replace(norm_order="pre")
    with pytest.raises(ExportError, match="Pre-LN model cannot be expressed as MarianMTModel"):
        export_hf_marian(ModelFile(pre, build_model(pre).state_dict(), None, None, spm, {}), tmp_path / "pre")


# ---- (e) CTranslate2 -----------------------------------------------------------------------------


def _ct2_greedy(model_dir, subword, src, max_len):
    import ctranslate2

    translator = ctranslate2.Translator(str(model_dir), device="cpu", intra_threads=1)
    tokens = [[subword.piece(i) for i in row if i != PAD] for row in src.tolist()]  # EOS included
    res = translator.translate_batch(tokens, beam_size=1, max_decoding_length=max_len,
                                     suppress_sequences=[["<pad>"]])
    return [[subword.id_of(p) for p in r.hypotheses[0]] for r in res]


def test_ctranslate2_conversion_greedy_equals_ours(exports, run_dir, tmp_path):
    from admin_ds.inference.export import convert_ct2

    source, _, hf_dir = exports["copy"]
    convert_ct2(hf_dir, tmp_path / "ct2")
    model, subword = build_from_model_file(load_model_file(source))
    src = copy_sources()
    ours = greedy(model, src, max_len_a=0, max_len_b=src.size(1) + 3)
    assert _ct2_greedy(tmp_path / "ct2", subword, src, src.size(1) + 3) == ours

    # The command line on the trained run: export, convert, decode. Its degenerate hypotheses run
    # to the length limit, where CTranslate2 stops without the EOS ours forces: same tokens.
    ok(cli("export.py", "--checkpoint", run_dir, "--format", "ct2", "--out", tmp_path / "run-ct2"))
    model, subword = build_from_model_file(load_run_checkpoint(run_dir))
    text = (run_dir / "data/test.en").read_text(encoding="utf-8").splitlines()[:6]
    ids = subword.encode(text)
    src = torch.full((len(ids), max(map(len, ids)) + 1), PAD)
    for i, x in enumerate(ids):
        src[i, :len(x) + 1] = torch.tensor(x + [EOS])
    assert _ct2_greedy(tmp_path / "run-ct2", subword, src, 12) == greedy(model, src, max_len_a=0, max_len_b=12)


# ---- (f) bad input -------------------------------------------------------------------------------


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
