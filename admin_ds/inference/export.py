"""Export a trained model to Hugging Face Marian (transformers) or CTranslate2
(command line: launch/export.py).

Omega is folded into the weights first (admin_ds/fold.py): a folded Admin model is a vanilla Post-LN Transformer, which
``MarianMTModel`` is (BART-style Post-LN layers, ReLU/GELU FFN, sinusoidal positions, sqrt(D)
embedding scale). Our conventions, mapped exactly:

* ids: bos 0, pad 1, eos 2, unk 3 (fairseq's, = our SentencePiece ids); the decoder starts with
  EOS (``decoder_start_token_id=2``); ``vocab.json`` maps every piece to OUR id, so
  ``MarianTokenizer`` (source.spm = target.spm = our joint model) encodes to our ids.
* positions: our table is fairseq's (sin half then cos half, frequency
  exp(-k ln(10000) / (D/2 - 1)), real tokens at rows 2, 3, ... since rows start after pad_idx=1).
  Marian's own table divides by D/2 instead of D/2 - 1 and starts at row 0, so we write OUR rows
  2.. into ``embed_positions.weight`` (Marian position p = our row p + 2). transformers drops that
  table when it saves (``_keys_to_ignore_on_save``) and rebuilds it from its formula when a
  checkpoint lacks it, but it loads the table when the file has it: we write model.safetensors
  ourselves, and the export reloads the directory and checks the table and the logits.
* ``final_logits_bias`` zeros; right padding only (Marian positions count padding, ours do not).
* the embedding output scale. Folding puts the first sub-layer's omega of each stack on the
  embedding output (``embedding_output_scale``: a per-stack D-vector s, fold.py). Admin trains
  omega (``omega_trainable``, the reference's default), so in a trained model omega_1 has moved away
  from its profiled 1 and practically every trained Admin model needs s. Marian has no such vector,
  and s cannot go into one shared token matrix (s_enc != s_dec, and the output projection must see
  the unscaled matrix E). But (E[t] sqrt(D) + pos) * s = (E * s)[t] sqrt(D) + pos * s, and Marian can
  hold three matrices: then the export writes an *untied* Marian model
  (``share_encoder_decoder_embeddings=False, tie_word_embeddings=False``): encoder embedding
  E * s_enc, decoder embedding E * s_dec, lm_head E, position tables pos * s_enc and pos * s_dec.
  Exact, at the price of storing the embedding three times. Without s (omega_1 == 1, e.g. a
  default-init or fixed-omega model) the standard tied layout is written.

Decoding like translate.py. Both exports carry translate.py's defaults (``TRANSLATE_DEFAULTS``:
beam 4, length penalty 0.6, at least one token, at most ``int(1.2 * src_len + 10)``), in
``generation_config.json`` (what ``generate`` uses unless told otherwise) and in
``decoding_defaults.json`` (the ``generate`` and ``translate_batch`` keyword arguments, and the
rule for the length limit). What each library can express:

* transformers: everything that does not depend on the source. Its beam search with
  ``early_stopping=True`` is fairseq's (the top 2 x beam candidates, EOS among the first beam
  finalized, done at beam finished hypotheses; where one step finishes more than fit, fairseq
  keeps the first, transformers the best, and the best of all is the same), and it divides by the
  number of generated tokens, EOS included, as we do. ``min_new_tokens=1`` blocks EOS at the first step (``min_len=1``),
  ``suppress_tokens=[pad]`` the pad, and ``max_length`` is the model's limit. The per-sentence
  limit is not a generation-config field, and transformers' forced EOS at a limit scores 0 where
  ours scores EOS's log-probability (this can change which hypothesis wins when beams reach the
  limit): ``hf_length_limit`` is a logits processor that does what translate.py does, per
  sentence of the batch, so ``generate(**inputs, logits_processor=[hf_length_limit(...)],
  forced_eos_token_id=None)`` gives translate.py's tokens, greedy and beam.
* CTranslate2: beam size, length penalty (``return_end_token=True``: it divides by the
  hypothesis's length, which then counts the EOS as ours does), ``min_decoding_length=1``, no pad.
  Its stopping rule with a nonzero length penalty and ``patience=1`` is fairseq's. The limit
  ``max_decoding_length`` is one number per call and has no forced EOS: at the limit CTranslate2
  keeps the beams as they are, so greedy search gives translate.py's tokens with
  ``max_decoding_length`` set to the sentence's limit, beam search wherever no beam reaches it.

Not expressible in Marian (refused with the reason): Pre-LN models (Marian has no pre-norm
option), T-Fixup (no LayerNorm), separate source/target embeddings in our model.

``--format ct2`` writes the Marian directory into a temporary directory and converts it with
CTranslate2's ``TransformersConverter`` into ``OUT`` (float32; the SentencePiece model, the
export report and decoding_defaults.json are copied along). Either format is written into a new
directory beside ``OUT`` and renamed to it when complete (``export``). CTranslate2's stock Marian loader assumes
OPUS-MT conventions that are not ours: it starts the decoder from a zero embedding (OPUS-MT starts
with the pad token, whose embedding is zero; ours starts with EOS) and removes the last vocabulary
row (the pad token transformers appends to OPUS-MT vocabularies; ours is a real piece), so
``ct2-transformers-converter --model DIR`` on our export stops with "Source vocabulary 0 has size V
but the model expected a vocabulary of size V-1" (and, were the row count fixed, its first decoder
step would differ). We convert with the loader of the same architecture minus these two
assumptions (``OurMarianLoader``). As with any converted Marian model, CTranslate2 takes source
pieces with the EOS appended (``MarianTokenizer`` appends it; ``add_source_eos`` is false).
"""

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Optional

from admin_ds.errors import UserError

FORMATS = ("hf-marian", "ct2")
DECODING_FILE = "decoding_defaults.json"
CT2_COPY_FILES = ("source.spm", "target.spm", "admin_ds_export.json", DECODING_FILE)

# launch/translate.py's defaults (tests/test_export.py holds the two together). The output limit of
# a sentence is int(max_len_a * src_len + max_len_b) tokens, EOS excluded, src_len counting the
# source's EOS, capped at max_positions - 1 (admin_ds/inference/decode.py).
TRANSLATE_DEFAULTS = {"beam": 4, "lenpen": 0.6, "max_len_a": 1.2, "max_len_b": 10, "min_len": 1}


class ExportError(UserError, ValueError):
    """The model cannot be exported as asked; the message says why."""


# ------------------------------------------------------------------------------------------------
# Our model -> MarianMTModel
# ------------------------------------------------------------------------------------------------

# Our parameter names -> Marian's; the attention and LayerNorm names are already the same.
_RENAMES = [
    (re.compile(r"^src_embed\.weight$"), "model.shared.weight"),
    (re.compile(r"^(encoder|decoder)_layers\.(\d+)\.ffn\.(fc[12])\.(weight|bias)$"), r"model.\1.layers.\2.\3.\4"),
    (re.compile(r"^(encoder|decoder)_layers\.(\d+)\.((?:self_attn|encoder_attn)(?:_layer_norm)?(?:\.\w+_proj)?"
                r"|final_layer_norm)\.(weight|bias)$"), r"model.\1.layers.\2.\3.\4"),
]


def check_exportable(cfg) -> None:
    """Refuse architectures Marian cannot express (see the module docstring)."""
    if cfg.norm_order != "post":
        raise ExportError("a Pre-LN model cannot be expressed as MarianMTModel: Marian's layers are "
                          "Post-LN only (MarianConfig has no pre-norm option)")
    if cfg.init == "t-fixup":
        raise ExportError("a T-Fixup model has no LayerNorm; MarianMTModel always normalizes")
    if not cfg.share_all_embeddings:
        raise ExportError("separate source/target embeddings: the export supports the joint "
                          "vocabulary with one shared embedding matrix (share_all_embeddings)")


def marian_config(cfg):
    """Tied (one embedding matrix) unless the folded model scales its embedding output."""
    from transformers import MarianConfig

    tied = not cfg.embedding_output_scale
    return MarianConfig(
        vocab_size=cfg.vocab_size, decoder_vocab_size=cfg.vocab_size, d_model=cfg.model_dim,
        encoder_layers=cfg.num_encoder_layers, decoder_layers=cfg.num_decoder_layers,
        encoder_attention_heads=cfg.num_heads, decoder_attention_heads=cfg.num_heads,
        encoder_ffn_dim=cfg.ffn_inner_dim, decoder_ffn_dim=cfg.ffn_inner_dim,
        activation_function=cfg.activation, max_position_embeddings=cfg.max_positions,
        dropout=cfg.dropout_p, attention_dropout=cfg.attention_dropout_p,
        activation_dropout=cfg.activation_dropout_p, scale_embedding=True,
        bos_token_id=cfg.bos_idx, pad_token_id=cfg.pad_idx, eos_token_id=cfg.eos_idx,
        decoder_start_token_id=cfg.eos_idx, forced_eos_token_id=cfg.eos_idx,
        share_encoder_decoder_embeddings=tied, tie_word_embeddings=tied,
        architectures=["MarianMTModel"])


def marian_state_dict(model) -> dict:
    """Our folded model's weights under Marian's names, plus our position table and a zero
    final_logits_bias. Every parameter must find a place (no silent drops). Tied matrices are
    stored once, as transformers stores them (model.shared.weight)."""
    import torch

    cfg = model.cfg
    out = {}
    scales = {"src_embed_scale", "tgt_embed_scale"}
    for name, tensor in model.state_dict().items():
        if name in scales:
            continue
        for pattern, repl in _RENAMES:
            if pattern.match(name):
                out[pattern.sub(repl, name)] = tensor.detach().float().contiguous()
                break
        else:
            raise ExportError(f"parameter {name!r} has no counterpart in MarianMTModel")
    # Our row pad_idx + 1 + p is the position of the p-th real token (0-based), Marian's row p.
    first = cfg.pad_idx + 1
    table = model.src_embed.positions[first:first + cfg.max_positions].detach().float()
    enc_scale = dec_scale = torch.ones(cfg.model_dim)
    if cfg.embedding_output_scale:  # the untied layout (module docstring)
        enc_scale, dec_scale = model.src_embed_scale.detach().float(), model.tgt_embed_scale.detach().float()
        emb = out.pop("model.shared.weight")
        out["model.encoder.embed_tokens.weight"] = (emb * enc_scale).contiguous()
        out["model.decoder.embed_tokens.weight"] = (emb * dec_scale).contiguous()
        out["lm_head.weight"] = emb
    out["model.encoder.embed_positions.weight"] = (table * enc_scale).contiguous()
    out["model.decoder.embed_positions.weight"] = (table * dec_scale).contiguous()
    out["final_logits_bias"] = torch.zeros(1, cfg.vocab_size)
    return out


def write_tokenizer(out_dir: Path, subword, spm_bytes: bytes, src_lang, tgt_lang, max_len: int) -> None:
    """MarianTokenizer files: source.spm = target.spm = our joint model, vocab.json = our ids."""
    from transformers import MarianTokenizer

    (out_dir / "source.spm").write_bytes(spm_bytes)
    (out_dir / "target.spm").write_bytes(spm_bytes)
    vocab = {subword.piece(i): i for i in range(subword.vocab_size)}
    (out_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False, indent=0) + "\n", encoding="utf-8")
    tok = MarianTokenizer(str(out_dir / "source.spm"), str(out_dir / "target.spm"), str(out_dir / "vocab.json"),
                          source_lang=src_lang, target_lang=tgt_lang, model_max_length=max_len)
    tok.save_pretrained(str(out_dir))


# ------------------------------------------------------------------------------------------------
# Decoding as translate.py does (module docstring)
# ------------------------------------------------------------------------------------------------


def max_output_length(src_len: int, max_positions: int, max_len_a: float = TRANSLATE_DEFAULTS["max_len_a"],
                      max_len_b: int = TRANSLATE_DEFAULTS["max_len_b"]) -> int:
    """translate.py's output limit, in tokens without the EOS, for a source of ``src_len`` ids
    (its EOS included, no padding); decode.py's ``_max_lens`` for one sentence."""
    return max(0, min(int(max_len_a * src_len + max_len_b), max_positions - 1))


def hf_generate_defaults(cfg) -> dict:
    """``generation_config.json``: translate.py's search in transformers' terms. ``max_length``
    counts the decoder's start token, so the model's limit (max_positions - 1 tokens and the EOS)
    is max_positions + 1; the per-sentence limit below it is ``hf_length_limit``'s."""
    d = TRANSLATE_DEFAULTS
    return {"bos_token_id": cfg.bos_idx, "pad_token_id": cfg.pad_idx, "eos_token_id": cfg.eos_idx,
            "decoder_start_token_id": cfg.eos_idx, "forced_eos_token_id": cfg.eos_idx,
            "num_beams": d["beam"], "length_penalty": d["lenpen"], "early_stopping": True, "do_sample": False,
            "min_new_tokens": d["min_len"], "suppress_tokens": [cfg.pad_idx], "max_length": cfg.max_positions + 1}


def ct2_translate_defaults(cfg) -> dict:
    """``translate_batch`` keyword arguments for translate.py's search, but the per-sentence
    ``max_decoding_length`` (``max_output_length``). ``return_end_token``: CTranslate2 divides a
    score by the hypothesis's length, which counts the EOS only when it is returned; the caller
    drops the final ``</s>``. ``max_input_length``: translate.py keeps max_positions ids (the
    first max_positions - 1 pieces and the EOS)."""
    d = TRANSLATE_DEFAULTS
    return {"beam_size": d["beam"], "length_penalty": d["lenpen"], "patience": 1.0,
            "min_decoding_length": d["min_len"], "suppress_sequences": [["<pad>"]], "return_end_token": True,
            "max_input_length": cfg.max_positions}


def decoding_defaults(cfg) -> dict:
    """``decoding_defaults.json``, written into both exports: translate.py's settings, the rule of
    its length limit, and each library's arguments."""
    d = TRANSLATE_DEFAULTS
    limit = (f"min(int({d['max_len_a']} * src_len + {d['max_len_b']}), {cfg.max_positions - 1}) tokens, EOS "
             f"excluded; src_len = the source's ids with their EOS, without padding")
    return {"translate.py": {**d, "max_positions": cfg.max_positions},
            "max_output_length": limit,
            "transformers": {"generate": hf_generate_defaults(cfg),
                             "per_sentence": "logits_processor=[admin_ds.inference.export.hf_length_limit("
                                             "attention_mask.sum(1), max_positions)], forced_eos_token_id=None; "
                                             "or, one sentence per call, max_new_tokens = limit + 1 (greedy: "
                                             "exact; beam: a forced EOS scores 0, not its log-probability)"},
            "ctranslate2": {"translate_batch": ct2_translate_defaults(cfg),
                            "per_sentence": "max_decoding_length = limit (greedy: exact; beam: exact unless a "
                                            "beam reaches the limit, where CTranslate2 forces no EOS)"}}


def hf_length_limit(src_lengths, max_positions: int, max_len_a: float = TRANSLATE_DEFAULTS["max_len_a"],
                    max_len_b: int = TRANSLATE_DEFAULTS["max_len_b"], eos: int = 2):
    """A transformers ``LogitsProcessor`` ending each sentence of a batch where translate.py does:
    at its limit (``max_output_length`` of its ``src_lengths`` entry, the ids of its source with
    their EOS) only EOS remains, with the score the model gives it (decode.py's ``_lprobs``).
    Pass ``forced_eos_token_id=None`` beside it: transformers' own forced EOS scores 0."""
    import math

    import torch
    from transformers import LogitsProcessor

    limits = torch.tensor([max_output_length(int(n), max_positions, max_len_a, max_len_b) for n in src_lengths])

    class TranslateLengthLimit(LogitsProcessor):
        def __call__(self, input_ids, scores):
            # generate() holds a sentence's beams in adjacent rows; input_ids start with the
            # decoder's start token, so a row has input_ids.size(1) - 1 tokens so far.
            per_sentence = scores.size(0) // limits.numel()
            at_limit = limits.to(scores.device).repeat_interleave(per_sentence).eq(input_ids.size(1) - 1)
            if not bool(at_limit.any()):
                return scores
            eos_scores = scores[:, eos].clone()
            scores = scores.masked_fill(at_limit[:, None], -math.inf)
            scores[:, eos] = torch.where(at_limit, eos_scores, scores[:, eos])
            return scores

    return TranslateLengthLimit()


def verify_export(out_dir: Path, model, state: dict) -> dict:
    """Reload the directory with transformers: our position table must be the one in use, and the
    logits on random ids must match ours. Returns the measured differences."""
    import torch
    from transformers import MarianMTModel

    hf = MarianMTModel.from_pretrained(str(out_dir)).eval()
    for key in ("model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight"):
        if not torch.equal(hf.state_dict()[key], state[key]):
            raise ExportError(f"{out_dir}: transformers replaced {key} at load time; the export is "
                              f"not usable with this transformers version")
    cfg = model.cfg
    g = torch.Generator().manual_seed(0)
    src = torch.randint(4, cfg.vocab_size, (2, 7), generator=g)
    src[:, -1] = cfg.eos_idx
    tgt = torch.randint(4, cfg.vocab_size, (2, 5), generator=g)
    tgt[:, 0] = cfg.eos_idx
    with torch.no_grad():
        ours = model.float().eval()(src, tgt)
        theirs = hf(input_ids=src, attention_mask=torch.ones_like(src), decoder_input_ids=tgt).logits
    diff = float((ours - theirs).abs().max())
    if diff > 1e-3:
        raise ExportError(f"{out_dir}: logits differ from ours by {diff:.3g} after reloading")
    return {"logits_max_abs_diff": diff}


def export_hf_marian(mf, out_dir: Path) -> dict:
    """Write ``out_dir`` as a MarianMTModel directory (config, generation config, safetensors,
    tokenizer, decoding_defaults.json) from a ModelFile; returns a report (what was written,
    verified differences). ``export`` is the atomic, checked way to call it."""
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig, MarianMTModel

    from admin_ds.inference.model_file import build_from_model_file
    from admin_ds.model.fold import fold_omega

    check_exportable(mf.model_config)
    model, subword = build_from_model_file(mf, "cpu", torch.float32)
    folded = fold_omega(model)
    check_exportable(folded.cfg)
    config = marian_config(folded.cfg)
    state = marian_state_dict(folded)

    # Our names must be exactly Marian's: every key of MarianMTModel filled, none left over.
    expected = set(MarianMTModel(config).state_dict())
    if config.tie_word_embeddings:
        expected -= {"model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight", "lm_head.weight"}
    if expected != set(state):
        raise ExportError(f"weights do not fit MarianMTModel: missing {sorted(expected - set(state))}, "
                          f"unexpected {sorted(set(state) - expected)}")

    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out_dir))
    GenerationConfig(**hf_generate_defaults(folded.cfg)).save_pretrained(str(out_dir))
    (out_dir / DECODING_FILE).write_text(json.dumps(decoding_defaults(folded.cfg), indent=1) + "\n")
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    meta = mf.meta
    write_tokenizer(out_dir, subword, mf.subword_model_bytes, meta.get("src_lang"), meta.get("tgt_lang"),
                    folded.cfg.max_positions)
    report = {"format": "hf-marian", "source": meta.get("source"), "update": meta.get("update"),
              "folded_omega": model.cfg.init, "model_config": folded.cfg.to_dict(),
              "embeddings": "tied" if config.tie_word_embeddings else "untied (embedding output scale)",
              "positions": "fairseq sinusoids, our rows pad_idx+1.. written into embed_positions.weight",
              **verify_export(out_dir, folded, state)}
    (out_dir / "admin_ds_export.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


# ------------------------------------------------------------------------------------------------
# MarianMTModel directory -> CTranslate2
# ------------------------------------------------------------------------------------------------


def convert_ct2(hf_dir: Path, out_dir: Path) -> None:
    """CTranslate2 model (float32) from an exported Marian directory, with ``OurMarianLoader``
    in place of the stock Marian loader for the duration of the conversion."""
    import ctranslate2.converters.transformers as ct2t

    class OurMarianLoader(ct2t.MarianMTLoader):
        """The stock Marian loader minus its two OPUS-MT assumptions (module docstring)."""

        def get_model_spec(self, model):
            model.config.normalize_before = False
            model.config.normalize_embedding = False
            return ct2t.BartLoader.get_model_spec(self, model)  # keeps every vocabulary row

        def set_decoder(self, spec, decoder):
            ct2t.BartLoader.set_decoder(self, spec, decoder)  # the decoder starts from EOS's embedding

        def get_vocabulary(self, model, tokenizer):
            return ct2t.BartLoader.get_vocabulary(self, model, tokenizer)

    stock = ct2t._MODEL_LOADERS["MarianConfig"]  # a private registry: the converter has no hook
    ct2t._MODEL_LOADERS["MarianConfig"] = OurMarianLoader()
    try:
        ct2t.TransformersConverter(str(hf_dir), copy_files=list(CT2_COPY_FILES)).convert(str(out_dir), force=True)
    finally:
        ct2t._MODEL_LOADERS["MarianConfig"] = stock


# ------------------------------------------------------------------------------------------------


def check_destination(out: Path, force: bool = False, source: Optional[Path] = None) -> None:
    """Refuse, before any work, an output directory the export cannot write or may not replace
    (with ``force``, one that is or holds ``source``, the checkpoint or model file read: replacing
    it would delete the input); the message names the path. Missing parent directories are made."""
    if out.is_symlink() and not out.exists():
        raise ExportError(f"{out}: a symbolic link that leads nowhere (a loop, or a missing target)")
    if out.exists():
        if not out.is_dir():
            raise ExportError(f"{out}: exists and is not a directory")
        if any(out.iterdir()) and not force:
            raise ExportError(f"{out}: exists and is not empty (--force replaces it)")
        if source is not None and Path(source).resolve().is_relative_to(out.resolve()):
            raise ExportError(f"{out}: is or holds the --checkpoint it exports ({source}); --force would delete "
                              "it with the rest of the directory: write the export elsewhere")
    ancestor = out.parent
    while not os.path.lexists(ancestor) and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if ancestor.exists() and not ancestor.is_dir():
        raise ExportError(f"{out}: {ancestor} is not a directory")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ExportError(f"{out}: cannot make its parent directory {out.parent} ({e.strerror or e})") from None


def export(mf, fmt: str, out: Path, force: bool = False) -> dict:
    """Write ``mf`` (a ModelFile) as ``fmt`` ("hf-marian" or "ct2") to the directory ``out``, which
    must be new or empty unless ``force``; returns the export report.

    The export is written into a new sibling directory and renamed to ``out`` when complete, so
    ``out`` holds a whole export or none: a failure (a full disk, an interrupt) leaves what was
    there before. ``force`` replaces a non-empty ``out`` the same way, the old one set aside first."""
    import secrets

    from admin_ds.files import fsync_dir

    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
    out = Path(os.path.abspath(out))
    check_destination(out, force)
    out = out.resolve() if out.is_symlink() else out  # a link to a directory: export into the directory
    tmp = out.with_name(f".{out.name}.{secrets.token_hex(4)}.tmp")
    try:
        tmp.mkdir()
    except OSError as e:
        raise ExportError(f"{out}: cannot write beside it in {out.parent} ({e.strerror or e})") from None
    try:
        if fmt == "hf-marian":
            report = export_hf_marian(mf, tmp)
        else:
            with tempfile.TemporaryDirectory(prefix="admin_ds_marian_") as hf_dir:  # the converter empties its output
                report = export_hf_marian(mf, Path(hf_dir))
                convert_ct2(Path(hf_dir), tmp)
        if out.exists() and any(out.iterdir()):  # force
            old = tmp.with_suffix(".old")
            os.rename(out, old)
            try:
                os.rename(tmp, out)
            except BaseException:
                os.rename(old, out)  # the user's directory back where it was
                raise
            shutil.rmtree(old)
        else:
            os.replace(tmp, out)  # a new name, or onto an empty directory
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(out.parent)
    return report
