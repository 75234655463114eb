"""The exports to transformers' MarianMTModel and CTranslate2 (launch/export.py): the same logits,
and the same tokens as translate.py's decoder, greedy and beam 4, when decoded with the defaults
the export carries; the export directory appears whole or not at all, and an output it cannot
write is refused in one line naming it.

Two models: tests/fixtures/run_v1 (4 updates: its hypotheses loop until translate.py's length
limit, so the limit's rule is what decides them) and a model trained in-process to copy its input
(copy_task.py: its hypotheses end at varied lengths, before the limit). The decoder they are
checked against is admin_ds.inference.decode's with launch/translate.py's own defaults.
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from copy_task import EOS, NO_DROPOUT, PAD, copy_sources, train_copy_model
from distributed import REPO
from faults import unwritable_dir

from admin_ds.inference.decode import beam_search, greedy
from admin_ds.inference.model_file import ModelFile, build_from_model_file, load_any
from admin_ds.model import build_model
from admin_ds.presets import get_preset

FIXTURE = REPO / "tests/fixtures/run_v1"
ENV = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def export_cli(*args):
    return subprocess.run([sys.executable, str(REPO / "launch/export.py"), *map(str, args)], capture_output=True,
                          text=True, env=ENV, timeout=300, cwd=REPO)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(single_thread):
    yield


def translate_py_search() -> dict:
    """launch/translate.py's decoding defaults, from its own argument parser."""
    spec = importlib.util.spec_from_file_location("launch_translate", REPO / "launch/translate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = module.parse_args(["--checkpoint", str(FIXTURE), "--input", str(FIXTURE / "data/test.en")])
    assert args.method == "beam" and args.unk_penalty == 0.0  # no unknown-token penalty to export
    return {"beam": args.beam, "lenpen": args.lenpen, "max_len_a": args.max_len_a, "max_len_b": args.max_len_b,
            "min_len": args.min_len}


SEARCH = translate_py_search()


def ours(model, src, method):
    """translate.py's tokens for the batch ``src`` (its search with its defaults)."""
    limits = dict(max_len_a=SEARCH["max_len_a"], max_len_b=SEARCH["max_len_b"], min_len=SEARCH["min_len"])
    if method == "greedy":
        return greedy(model, src, **limits)
    return [h[0].tokens for h in beam_search(model, src, beam=SEARCH["beam"], lenpen=SEARCH["lenpen"], **limits)]


def limits_of(model, src):
    """translate.py's output limit of each sentence (decode.py's rule, written out again here)."""
    a, b = SEARCH["max_len_a"], SEARCH["max_len_b"]
    return [min(int(a * int(n) + b), model.cfg.max_positions - 1) for n in src.ne(PAD).sum(1)]


def until_eos(row):
    return row[:row.index(EOS)] if EOS in row else row


class Case:
    """A model, its exports and test sources (right-padded ids with their EOS)."""

    def __init__(self, model, subword, hf_dir, ct2_dir, src):
        self.model, self.subword, self.hf_dir, self.ct2_dir, self.src = model, subword, hf_dir, ct2_dir, src


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    from admin_ds.inference.export import export

    base = tmp_path_factory.mktemp("export")
    run = base / "run_v1"
    shutil.copytree(FIXTURE, run)  # a loader may set a corrupt tag aside: not in the repository
    for fmt in ("hf-marian", "ct2"):  # the command line, as a user exports
        out = export_cli("--checkpoint", run, "--format", fmt, "--out", base / f"run-{fmt}")
        assert out.returncode == 0, out.stderr[-3000:]
    model, subword = build_from_model_file(load_any(run))
    lines = (run / "data/test.en").read_text(encoding="utf-8").splitlines()[:12]
    ids = [x + [EOS] for x in subword.encode(lines)]
    src = torch.full((len(ids), max(map(len, ids))), PAD)
    for i, x in enumerate(ids):
        src[i, :len(x)] = torch.tensor(x)
    result = {"run_v1": Case(model, subword, base / "run-hf-marian", base / "run-ct2", src)}

    copy = train_copy_model(base / "copy.pt", model.cfg.vocab_size, (run / "data/spm.model").read_bytes())
    mf = load_any(copy)
    for fmt in ("hf-marian", "ct2"):
        export(mf, fmt, base / f"copy-{fmt}")
    copy_model, _ = build_from_model_file(mf)
    result["copy"] = Case(copy_model, subword, base / "copy-hf-marian", base / "copy-ct2", copy_sources())
    result["copy"].model_file = copy
    return result


def test_the_exports_carry_translate_py_defaults(cases):
    """decoding_defaults.json is translate.py's, in both exports; generation_config.json is what
    transformers loads as the model's defaults."""
    from transformers import GenerationConfig

    from admin_ds.inference.export import TRANSLATE_DEFAULTS

    assert TRANSLATE_DEFAULTS == SEARCH
    case = cases["run_v1"]
    hf = json.loads((case.hf_dir / "decoding_defaults.json").read_text())
    assert hf == json.loads((case.ct2_dir / "decoding_defaults.json").read_text())
    assert hf["translate.py"] == {**SEARCH, "max_positions": case.model.cfg.max_positions}
    gen = GenerationConfig.from_pretrained(str(case.hf_dir))
    assert {k: getattr(gen, k) for k in hf["transformers"]["generate"]} == hf["transformers"]["generate"]
    assert (gen.num_beams, gen.length_penalty, gen.min_new_tokens) == (SEARCH["beam"], SEARCH["lenpen"], SEARCH["min_len"])


@pytest.mark.parametrize("which", ["run_v1", "copy"])
@pytest.mark.parametrize("method", ["greedy", "beam"])
def test_transformers_generate_gives_translate_py_tokens(cases, which, method):
    """With the exported defaults, one sentence a call with ``max_new_tokens`` = its limit + 1:
    translate.py's tokens, greedy, and beam where no beam reaches the limit (there transformers'
    forced EOS scores 0: run_v1's hypotheses that differ are at it). The whole batch in one
    ``generate`` with ``hf_length_limit`` (translate.py's per-sentence limit): translate.py's
    tokens for every sentence, greedy and beam."""
    from transformers import MarianMTModel

    case = cases[which]
    hf = MarianMTModel.from_pretrained(str(case.hf_dir)).eval()
    expected = ours(case.model, case.src, method)
    limits = limits_of(case.model, case.src)
    reached = sum(len(h) == n for h, n in zip(expected, limits))
    assert reached == (len(expected) if which == "run_v1" else 0)  # each model on its side of the limit
    if which == "copy":
        assert len({len(h) for h in expected}) >= 4
    num_beams = {"greedy": 1, "beam": hf.generation_config.num_beams}[method]
    for row, limit, hyp in zip(case.src, limits, expected):
        row = row[row.ne(PAD)][None]
        with torch.no_grad():
            one = until_eos(hf.generate(input_ids=row, num_beams=num_beams, max_new_tokens=limit + 1)[0, 1:].tolist())
        if method == "beam" and which == "run_v1" and one != hyp:  # a forced EOS scores 0 (serving.md)
            assert len(hyp) == limit and len(one) == limit
        else:
            assert one == hyp  # the first token generate returns is the decoder's start

    from admin_ds.inference.export import hf_length_limit

    with torch.no_grad():
        out = hf.generate(input_ids=case.src, attention_mask=case.src.ne(PAD), num_beams=num_beams,
                          logits_processor=[hf_length_limit(case.src.ne(PAD).sum(1), case.model.cfg.max_positions)],
                          forced_eos_token_id=None)
    assert [until_eos(row) for row in out[:, 1:].tolist()] == expected


@pytest.mark.parametrize("which", ["run_v1", "copy"])
@pytest.mark.parametrize("method", ["greedy", "beam"])
def test_ctranslate2_translate_batch_gives_translate_py_tokens(cases, which, method):
    """``translate_batch`` with decoding_defaults.json's options and ``max_decoding_length`` = the
    sentence's limit: translate.py's tokens for every sentence, greedy, and beam where no beam
    reaches the limit (the copy model's). At the limit CTranslate2 forces no EOS (the module
    docstring of admin_ds/inference/export.py): run_v1's beam hypotheses that differ are at it."""
    import ctranslate2

    case = cases[which]
    options = json.loads((case.ct2_dir / "decoding_defaults.json").read_text())["ctranslate2"]["translate_batch"]
    if method == "greedy":
        options["beam_size"] = 1
    translator = ctranslate2.Translator(str(case.ct2_dir), device="cpu", intra_threads=1)
    expected = ours(case.model, case.src, method)
    limits = limits_of(case.model, case.src)
    for row, limit, hyp in zip(case.src.tolist(), limits, expected):
        pieces = [case.subword.piece(i) for i in row if i != PAD]  # the EOS included
        res = translator.translate_batch([pieces], max_decoding_length=limit, **options)[0]
        got = until_eos([case.subword.id_of(p) for p in res.hypotheses[0]])
        if method == "beam" and which == "run_v1" and got != hyp:
            assert len(hyp) == limit and len(got) == limit
        else:
            assert got == hyp


def test_logits_equal_and_the_tied_layout(cases, tmp_path):
    """The trained models fold with an embedding-output scale (the untied Marian layout) and their
    logits are ours; a default-init model is written in the standard tied layout; Pre-LN refused."""
    from transformers import MarianMTModel

    from admin_ds.fold import fold_omega
    from admin_ds.inference.export import ExportError, export_hf_marian

    for which, case in cases.items():
        report = json.loads((case.hf_dir / "admin_ds_export.json").read_text())
        assert report["embeddings"] == "untied (embedding output scale)", which
        assert fold_omega(case.model).cfg.embedding_output_scale
        hf = MarianMTModel.from_pretrained(str(case.hf_dir)).eval()
        g = torch.Generator().manual_seed(0)
        V = case.model.cfg.vocab_size
        src = torch.randint(4, V, (3, 9), generator=g)
        src[:, -1] = EOS
        src[1, 5:] = PAD  # right padding
        src[1, 4] = EOS
        tgt = torch.randint(4, V, (3, 6), generator=g)
        tgt[:, 0] = EOS
        with torch.no_grad():
            diff = float((case.model(src, tgt) - hf(input_ids=src, attention_mask=src.ne(PAD),
                                                    decoder_input_ids=tgt).logits).abs().max())
        assert diff <= 1e-4, (which, diff)

    spm = (FIXTURE / "data/spm.model").read_bytes()
    torch.manual_seed(1)
    cfg = get_preset("debug-tiny", init="default", vocab_size=cases["copy"].model.cfg.vocab_size, max_positions=32,
                     **NO_DROPOUT)
    mf = ModelFile(cfg, build_model(cfg).state_dict(), None, None, spm, {})
    report = export_hf_marian(mf, tmp_path / "tied")
    assert report["embeddings"] == "tied" and report["logits_max_abs_diff"] <= 1e-4
    hf = MarianMTModel.from_pretrained(str(tmp_path / "tied"))
    assert hf.lm_head.weight.data_ptr() == hf.model.shared.weight.data_ptr()
    pre = cfg.replace(norm_order="pre")
    with pytest.raises(ExportError, match="Pre-LN model cannot be expressed as MarianMTModel"):
        export_hf_marian(ModelFile(pre, build_model(pre).state_dict(), None, None, spm, {}), tmp_path / "pre")


def test_tokenizer_encodes_to_our_ids(cases):
    from transformers import MarianTokenizer

    case = cases["run_v1"]
    text = (FIXTURE / "data/test.en").read_text(encoding="utf-8").splitlines()[:6]
    tok = MarianTokenizer.from_pretrained(str(case.hf_dir))
    batch = tok(text, return_tensors="pt", padding=True)
    ids = case.subword.encode(text)
    assert [row[:len(i) + 1] for row, i in zip(batch.input_ids.tolist(), ids)] == [i + [EOS] for i in ids]
    assert tok.decode(batch.input_ids[0], skip_special_tokens=True) == case.subword.decode([ids[0]])[0]


# ---- the output directory ------------------------------------------------------------------------


def bad_outputs(tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    return {"under-a-file": tmp_path / "file" / "out",
            "symlink-loop": tmp_path / "loop",
            "under-a-symlink-loop": tmp_path / "loop" / "out",
            "read-only": os.path.join(unwritable_dir(tmp_path), "out")}


@pytest.mark.parametrize("case", ["under-a-file", "symlink-loop", "under-a-symlink-loop", "read-only"])
def test_an_output_it_cannot_write_is_refused_in_one_line(cases, tmp_path, case):
    out = bad_outputs(tmp_path)[case]
    parent = os.path.dirname(out)
    before = sorted(os.listdir(parent)) if os.path.isdir(parent) else None
    res = export_cli("--checkpoint", cases["copy"].model_file, "--out", out)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, res.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(out) in lines[0], res.stderr
    if before is not None:
        assert sorted(os.listdir(parent)) == before  # nothing half-written beside it


def test_the_export_appears_whole_and_replaces_only_with_force(cases, tmp_path):
    """A non-empty output is refused and left as it was; --force replaces it; an empty directory
    is taken; no temporary directory is left beside the output."""
    model_file = cases["copy"].model_file
    out = tmp_path / "exports" / "x"
    out.mkdir(parents=True)
    (out / "keep.txt").write_text("mine")
    res = export_cli("--checkpoint", model_file, "--out", out)
    assert res.returncode == 2 and "--force" in res.stderr and str(out) in res.stderr, res.stderr
    assert os.listdir(out) == ["keep.txt"]
    res = export_cli("--checkpoint", model_file, "--out", out, "--force")
    assert res.returncode == 0, res.stderr[-3000:]
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    empty = tmp_path / "exports" / "empty"
    empty.mkdir()
    res = export_cli("--checkpoint", model_file, "--format", "ct2", "--out", empty)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (empty / "model.bin").is_file() and (empty / "decoding_defaults.json").is_file()
    assert sorted(os.listdir(tmp_path / "exports")) == ["empty", "x"]
