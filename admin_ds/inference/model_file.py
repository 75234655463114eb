"""The self-contained fp32 model file, and fp32 weights out of a training checkpoint.

A *model file* is what leaves a run: one ``torch.save`` of plain data, read back with the safe
loader (admin_ds/safe_load.py: tensors, dicts, lists, str, int, float, None and bytes only, so
opening a file from elsewhere runs no pickled code), and checked against the digest it carries::

    {"format": "admin-ds-model", "version": 2,
     "model_config": ModelConfig.to_dict(), "state_dict": {name: float32 tensor},
     "profile": Profile.to_dict() | None, "run_config": RunConfig.to_dict() | None,
     "subword_model": the SentencePiece model's bytes, "meta": {provenance},
     "sha256": content_digest(the above but meta and run_config)}

It carries everything needed to translate (weights, architecture, the exact subword model) and to
audit where it came from (the run config, the Admin profile, the source checkpoint and update).

``load_run_checkpoint`` turns a DeepSpeed checkpoint of a run into the same ``ModelFile``. The fp32
weights come from DeepSpeed's own consolidation, which knows every layout it writes:

* ZeRO-1/2/3 (data parallel, any world size): ``deepspeed.utils.zero_to_fp32.
  get_fp32_state_dict_from_zero_checkpoint`` merges the fp32 master partitions of all ranks
  (in bf16/fp16 runs too: the masters, not the 16-bit module copy). One exception: bf16 with
  ZeRO-1 trains with DeepSpeed's BF16_Optimizer, whose states that function refuses ("... is not
  a zero checkpoint"; DeepSpeed 0.19.8); ``_zero_weights`` joins its fp32 master partitions by
  their ``param_slice_mappings``.
* ZeRO-0: that function refuses (``TypeError``: the checkpoint has no ``param_shapes``; checked with
  DeepSpeed 0.19.8), because nothing is partitioned: the full model is the ``module`` entry of
  ``mp_rank_00_model_states.pt``. In an fp32 run it *is* the fp32 weights. In a bf16/fp16 run it
  holds 16-bit copies; the fp32 masters are then the optimizer's ``fp32_groups`` (one list of
  tensors per parameter group, in the order the parameters were given to the optimizer:
  ``model.parameters()`` with requires_grad, see engine.initialize), matched by name and shape.
* pipeline checkpoints (``layout.pipeline > 1``) hold per-stage files, which zero_to_fp32 cannot
  read: DeepSpeed's universal converter extracts the fp32 masters, under the model's own names.

DeepSpeed stays out of the training-free path: loading a model file never imports it, and
``load_run_checkpoint`` imports only its checkpoint-reading utilities, inside the function.
(admin_ds/train/engine.py remains the one owner of training-time DeepSpeed; consolidating a
finished checkpoint is reading files, not running an engine.)

Every checkpoint is verified before it is read: its files against the sizes and sha256 digests
in its ``COMPLETE`` marker, and their pickles for anything that would run code (``_locate``).

``load_for_decoding`` is the one way every translating command (translate.py, back-translation,
the decoding benchmark) gets a model: from a model file, a run directory or a checkpoint tag.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import hashlib
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from admin_ds import files, safe_load
from admin_ds.checkpoint_format import COMPLETE, ds_to_universal, is_complete, newest_verified, read_info, verify
from admin_ds.data.binarize import reversed_manifest
from admin_ds.errors import CheckpointError
from admin_ds.model.config import ModelConfig

FORMAT = "admin-ds-model"
VERSION = 2  # 2: a content digest; 1 (no digest) loads only with trust_unverified
PRECISIONS = ("fp32", "int8")  # load_for_decoding's; int8: CPU only (inference/int8.py)

# The file of a DeepSpeed tag that carries the client state: ZeRO-0/1/2 and pipeline runs write
# mp_rank_00_model_states.pt, ZeRO-3 writes one zero_pp_rank_{r}_... file per rank instead.
_CLIENT_STATE_FILES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
_HINT = "; for a DeepSpeed checkpoint pass its run directory or its update_NNNNNN directory"


ModelFileError = CheckpointError  # the name callers knew; a model file is a checkpoint too


@dataclass
class ModelFile:
    model_config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    profile: Optional[dict]
    run_config: Optional[dict]
    subword_model_bytes: bytes
    meta: dict = field(default_factory=dict)

    @property
    def subword_sha256(self) -> str:
        return files.sha256_bytes(self.subword_model_bytes)


# --------------------------------------------------------------------------------------------
# The model file
# --------------------------------------------------------------------------------------------


def save_model_file(path: str | os.PathLike, model_config: ModelConfig, state_dict: dict,
                    profile: Optional[dict], run_config: Optional[dict], subword_model_bytes: bytes,
                    meta: dict) -> Path:
    """Write a model file atomically (a reader sees the old file or the complete new one).
    Floating-point tensors are stored as contiguous float32 clones (fp32 is the interchange
    precision; cast at load time with ``build_from_model_file(..., dtype=...)``)."""
    tensors = {k: (v.detach().to("cpu", torch.float32) if v.is_floating_point() else v.detach().cpu())
               .contiguous().clone() for k, v in state_dict.items()}
    blob = {"format": FORMAT, "version": VERSION, "model_config": model_config.to_dict(),
            "state_dict": tensors, "profile": profile, "run_config": run_config,
            "subword_model": bytes(subword_model_bytes), "meta": dict(meta)}
    blob["sha256"] = content_digest(blob)
    buf = io.BytesIO()
    torch.save(blob, buf)
    return files.write_bytes(path, buf.getvalue())


def content_digest(blob: dict) -> str:
    """sha256 of what a model file says: the architecture, every tensor (name, dtype, shape, bytes),
    the profile and the subword model. A file changed after it was written no longer matches."""
    h = hashlib.sha256()
    h.update(json.dumps([blob["model_config"], blob["profile"]], sort_keys=True).encode())
    for name in sorted(blob["state_dict"]):
        t = blob["state_dict"][name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    h.update(bytes(blob["subword_model"]))
    return h.hexdigest()


def load_model_file(path: str | os.PathLike, trust_unverified: bool = False) -> ModelFile:
    """Read a model file (admin_ds/safe_load.py: no pickled code runs) and check its content digest.
    A file written before digests existed loads only with ``trust_unverified``. Raises
    ``ModelFileError`` naming the file and what is wrong."""
    path = Path(path)
    if path.is_dir():
        raise ModelFileError(f"{path}: a directory, not a model file{_HINT}")
    if not path.is_file():
        raise ModelFileError(f"{path}: no such model file")
    try:
        blob = safe_load.load(path)
    except safe_load.UnsafeFileError:
        raise
    except CheckpointError as e:
        raise ModelFileError(f"{path}: not an admin-ds model file ({str(e).removeprefix(f'{path}: ')}){_HINT}") from None
    if not isinstance(blob, dict) or blob.get("format") != FORMAT:
        raise ModelFileError(f"{path}: not an admin-ds model file (no '{FORMAT}' format marker){_HINT}")
    if blob.get("version") not in (1, VERSION):
        raise ModelFileError(f"{path}: model file version {blob.get('version')!r}; this code reads "
                             f"versions 1 and {VERSION}")
    if "sha256" not in blob:
        if not trust_unverified:
            raise ModelFileError(f"{path}: carries no content digest (written by an older version), so a change "
                                 "made to it since cannot be detected; pass --trust-unverified to use it anyway")
    elif content_digest(blob) != blob["sha256"]:
        raise ModelFileError(f"{path}: its contents do not match the sha256 recorded when it was written "
                             "(modified or corrupt)")
    try:
        config = ModelConfig.from_dict(blob["model_config"])
    except (TypeError, ValueError) as e:
        raise ModelFileError(f"{path}: model_config: {e}") from None
    return ModelFile(model_config=config, state_dict=blob["state_dict"], profile=blob["profile"],
                     run_config=blob["run_config"], subword_model_bytes=blob["subword_model"], meta=blob["meta"])


def build_from_model_file(mf: ModelFile, device: str | torch.device = "cpu",
                          dtype: torch.dtype = torch.float32):
    """``(model, SubwordModel)`` ready to decode: the model in eval mode on ``device`` in
    ``dtype``. The model is built on the CPU in fp32 first (its init is wasted work, but it also
    recomputes the non-persistent sinusoid table exactly as training did), then cast and moved."""
    from admin_ds.model.transformer import build_model
    from admin_ds.data.subword import SubwordModel

    model = build_model(mf.model_config)
    model.load_state_dict(mf.state_dict, strict=True)
    model = model.to(device=device, dtype=dtype).eval()
    # SubwordModel reads the bytes once in its constructor, so the file can go right after.
    with tempfile.TemporaryDirectory(prefix="admin_ds_spm_") as tmp:
        spm_path = Path(tmp, "spm.model")
        spm_path.write_bytes(mf.subword_model_bytes)
        subword = SubwordModel(spm_path)
    return model, subword


# --------------------------------------------------------------------------------------------
# DeepSpeed checkpoints of a run
# --------------------------------------------------------------------------------------------


def _locate(path: Path, tag: Optional[str], trust_unverified: bool) -> tuple[Path, str]:
    """(checkpoints dir, tag) for a run dir, a run's ``checkpoints`` dir or a tag dir, verified:
    the tag's files match the sizes and sha256 in its ``COMPLETE`` marker, and none of them would
    run code when unpickled. Given a run directory, a tag that fails is set aside (``<tag>.corrupt``,
    as a resume does) and the newest intact one is used, with a warning; a tag given explicitly is
    refused, naming the file. A checkpoint without digests (older format) only with
    ``trust_unverified``."""
    if not path.exists():
        raise ModelFileError(f"{path}: no such run directory, checkpoint directory or model file")
    if not path.is_dir():
        raise ModelFileError(f"{path}: not a directory")
    if any((path / f).is_file() for f in _CLIENT_STATE_FILES) or (path / COMPLETE).exists():
        if tag is not None and tag != path.name:
            raise ModelFileError(f"{path}: a tag directory was given together with tag={tag!r}")
        ckpt_dir, tag = path.parent, path.name
        named = False
    else:
        ckpt_dir = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        named = tag is not None
        if tag is None:
            tag = newest_verified(ckpt_dir, log=lambda msg: print(f"warning: {msg}", file=sys.stderr))
            if tag is None:
                raise ModelFileError(f"{path}: no complete, intact checkpoint (update_NNNNNN/ with a valid "
                                     f"{COMPLETE} marker whose files match) under {ckpt_dir}")
    tag_dir = ckpt_dir / tag
    if not tag_dir.is_dir():
        raise ModelFileError(f"{tag_dir}: no such checkpoint")
    if named and tag_dir.resolve().parent != ckpt_dir.resolve():  # a path in the name, or a link out of the run
        raise ModelFileError(f"{tag_dir}: tag {tag!r} leads outside {ckpt_dir} (to {tag_dir.resolve()})")
    if not is_complete(tag_dir):
        raise ModelFileError(f"{tag_dir}: checkpoint is incomplete (no valid {COMPLETE} marker: a save that was "
                             "interrupted, or a damaged marker)")
    problem = verify(tag_dir)
    if problem is not None:
        raise ModelFileError(f"{tag_dir}: corrupt: {problem}")
    if not read_info(tag_dir).get("files") and not trust_unverified:
        raise ModelFileError(f"{tag_dir}: its {COMPLETE} marker records no file digests (an older format), so "
                             "changed files cannot be detected; pass --trust-unverified to use it anyway")
    safe_load.check_tag(tag_dir)  # before DeepSpeed's readers, which run a full unpickle
    return ckpt_dir, tag


@contextlib.contextmanager
def _stdout_to_stderr():
    """Keep stdout for results (translations): zero_to_fp32 reports its progress with print(), and
    DeepSpeed's logger, created at its import, writes to whatever sys.stdout is at that moment."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


def _zero0_weights(states: dict, model_config: ModelConfig, source: Path) -> tuple[dict, str]:
    """Full weights of a ZeRO-0 checkpoint: ``module``, with the optimizer's fp32 masters in place
    of 16-bit copies (see the module docstring)."""
    module = states.get("module")
    if not module:
        raise ModelFileError(f"{source}: no 'module' entry: not a ZeRO-0 data-parallel checkpoint")
    weights = {k: v for k, v in module.items()}
    if all(v.dtype == torch.float32 for v in weights.values() if v.is_floating_point()):
        return weights, "module (fp32 run)"
    groups = (states.get("optimizer") or {}).get("fp32_groups")
    if not groups:
        raise ModelFileError(f"{source}: 16-bit module weights and no fp32 master copies "
                             f"(optimizer.fp32_groups) to take fp32 weights from")
    from admin_ds.model.transformer import build_model

    skeleton = build_model(model_config, device="meta")  # names and shapes only
    trainable = [(n, p.shape) for n, p in skeleton.named_parameters() if p.requires_grad]
    masters = [t for group in groups for t in group]
    shapes_ok = len(masters) == len(trainable) and all(
        tuple(m.shape) == tuple(s) for m, (_, s) in zip(masters, trainable))
    if not shapes_ok:
        raise ModelFileError(f"{source}: the optimizer's fp32 master copies do not match the model's "
                             f"parameters ({len(masters)} tensors for {len(trainable)} parameters)")
    for (name, _), master in zip(trainable, masters):
        weights[name] = master.float()
    return weights, "module + optimizer fp32_groups (16-bit run)"


def _pipeline_weights(tag_dir: Path, model_config: ModelConfig, profile: Optional[dict]) -> tuple[dict, str]:
    """fp32 weights of a pipeline checkpoint. zero_to_fp32 cannot read pipeline checkpoints, so
    DeepSpeed's universal converter extracts every parameter's fp32 master into
    ``zero/<name>/fp32.pt``; a stage's parameters have the whole model's names
    (admin_ds/model/transformer.py), so they are used as they are. Buffers (a fixed omega,
    DeepNorm's alpha) are not in it: omega comes from the profile, the rest from the config."""
    from admin_ds.model.profiling import Profile, omega_values
    from admin_ds.model.transformer import build_model

    with tempfile.TemporaryDirectory(prefix="admin_ds_universal_") as tmp:
        with _stdout_to_stderr():
            ds_to_universal(tag_dir, Path(tmp))
        named = {d.name: safe_load.load(d / "fp32.pt")["param"]
                 for d in (Path(tmp) / "zero").iterdir() if (d / "fp32.pt").is_file()}
    model = build_model(model_config, seed=0)  # buffers fixed by the config; parameters replaced below
    if profile:
        named.update({k: v for k, v in omega_values(Profile.from_dict(profile), model).items() if k not in named})
    reference = model.state_dict()
    unknown = sorted(set(named) - set(reference))
    if unknown:
        raise CheckpointError(f"{tag_dir}: parameters {unknown[:3]} are not the model's; a pipeline checkpoint "
                              "written before admin-ds used one set of parameter names in every layout")
    weights = {name: named[name].view(value.shape) if name in named else value for name, value in reference.items()}
    return weights, "deepspeed universal checkpoint (pipeline)"


def _subword_bytes(run_dir: Path, run_config: Optional[dict], expected_sha: Optional[str]) -> tuple[bytes, dict]:
    """The run's SentencePiece model (bytes) and its data manifest, checked against the sha256
    the checkpoint recorded."""
    data_path = (run_config or {}).get("data", {}).get("path")
    data_dir = Path(data_path) if data_path else run_dir / "data"
    manifest_path = data_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    if manifest and (run_config or {}).get("data", {}).get("reverse"):
        manifest = reversed_manifest(manifest)
    spm_path = data_dir / manifest.get("subword_model", "spm.model")
    if not spm_path.is_file():
        raise ModelFileError(f"{spm_path}: the run's subword model is missing (data.path="
                             f"{data_path!r}; run {run_dir})")
    data = spm_path.read_bytes()
    sha = files.sha256_bytes(data)
    if expected_sha and sha != expected_sha:
        raise ModelFileError(f"{spm_path}: sha256 {sha[:12]}... differs from the {expected_sha[:12]}... "
                             f"the checkpoint was trained with; the data directory was changed")
    return data, manifest


def load_run_checkpoint(run_dir_or_tag_dir: str | os.PathLike, tag: Optional[str] = None,
                        trust_unverified: bool = False) -> ModelFile:
    """fp32 weights, configs, profile and subword model of one complete checkpoint.

    ``run_dir_or_tag_dir``: a run directory (``tag`` or else its newest complete checkpoint), its
    ``checkpoints`` directory, or one ``update_NNNNNN`` tag directory."""
    with _stdout_to_stderr():
        return _load_run_checkpoint(Path(run_dir_or_tag_dir), tag, trust_unverified)


def _load_run_checkpoint(path: Path, tag: Optional[str], trust_unverified: bool) -> ModelFile:
    ckpt_dir, tag = _locate(path, tag, trust_unverified)
    tag_dir = ckpt_dir / tag
    states_file = next((tag_dir / f for f in _CLIENT_STATE_FILES if (tag_dir / f).is_file()), None)
    if states_file is None:
        raise ModelFileError(f"{tag_dir}: no DeepSpeed model-states file ({' or '.join(_CLIENT_STATE_FILES)})")
    states = safe_load.load(states_file)
    client = states.get("admin_ds")
    if not client:
        raise ModelFileError(f"{states_file}: no 'admin_ds' client state: not a checkpoint of this code")
    layout = client.get("layout", {})
    model_config = ModelConfig.from_dict(client["model_config"])

    if layout.get("pipeline", 1) > 1:
        weights, how = _pipeline_weights(tag_dir, model_config, client.get("profile"))
    elif layout.get("zero", 0) >= 1:
        weights, how = _zero_weights(ckpt_dir, tag, states)
    else:
        weights, how = _zero0_weights(states, model_config, states_file)
    del states  # the optimizer state of a ZeRO-0 checkpoint can be large

    run_dir = ckpt_dir.parent
    run_config = client.get("run_config")
    spm_bytes, manifest = _subword_bytes(run_dir, run_config, client.get("subword_sha256"))
    meta = {"source": str(tag_dir.resolve()), "tag": tag,
            "update": client.get("train_state", {}).get("update"), "layout": layout,
            "weights_from": how, "src_lang": manifest.get("src_lang"),
            "tgt_lang": manifest.get("tgt_lang"), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    return ModelFile(model_config=model_config,
                     state_dict={k: v.float() if v.is_floating_point() else v for k, v in weights.items()},
                     profile=client.get("profile"), run_config=run_config,
                     subword_model_bytes=spm_bytes, meta=meta)


def _zero_weights(ckpt_dir: Path, tag: str, states: dict) -> tuple[dict, str]:
    """fp32 weights of a ZeRO checkpoint: DeepSpeed's zero_to_fp32, except for bf16 with ZeRO-1.
    That pairing trains with DeepSpeed's BF16_Optimizer, whose states zero_to_fp32 refuses ("... is
    not a zero checkpoint"); its fp32 master partitions are put back together here, each parameter
    from its slice on every data-parallel rank (``param_slice_mappings``)."""
    files = sorted((ckpt_dir / tag).glob("bf16_zero_pp_rank_*_mp_rank_00_optim_states.pt"),
                   key=lambda f: int(f.name.split("_")[4]))  # bf16_zero_pp_rank_{R}_mp_rank_00_...
    optim = [safe_load.load(f)["optimizer_state_dict"] for f in files[:1]]
    if not optim or "zero_stage" in optim[0] or "param_slice_mappings" not in optim[0]:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag), "deepspeed zero_to_fp32"
    optim += [safe_load.load(f)["optimizer_state_dict"] for f in files[1:]]
    shapes = {name: shape for group in states["param_shapes"] for name, shape in group.items()}
    pieces: dict[str, list] = {name: [] for name in shapes}
    for rank in optim:  # in rank order, so that a parameter's slices concatenate in order
        for flat, mapping in zip(rank["single_partition_of_fp32_groups"], rank["param_slice_mappings"]):
            for name, where in mapping.items():
                pieces[name].append(flat.narrow(0, where.start, where.numel))
    weights = {}
    for name, shape in shapes.items():
        flat = torch.cat(pieces[name]) if pieces[name] else torch.empty(0)
        if flat.numel() != torch.Size(shape).numel():
            raise ModelFileError(f"{ckpt_dir / tag}: parameter {name} has {flat.numel()} of its "
                                 f"{torch.Size(shape).numel()} values in {len(files)} bf16 optimizer-state "
                                 "file(s): a rank's file is missing")
        weights[name] = flat.view(shape).clone()
    module = states["module"]
    weights.update({name: module[name] for name in states.get("buffer_names", []) if name in module})
    weights.update({name: weights[source] for name, source in states.get("shared_params", {}).items()
                    if source in weights})
    return weights, "bf16 optimizer fp32 partitions"


def load_any(path: str | os.PathLike, tag: Optional[str] = None, trust_unverified: bool = False) -> ModelFile:
    """A model file, a run directory or a checkpoint tag directory, whichever ``path`` is, verified
    (``load_model_file``, ``load_run_checkpoint``)."""
    path = Path(path)
    if path.is_file():
        return load_model_file(path, trust_unverified)
    return load_run_checkpoint(path, tag, trust_unverified)


def load_for_decoding(path: str | os.PathLike, tag: Optional[str] = None, device: str | torch.device = "cpu",
                      dtype: torch.dtype = torch.float32, fold: bool = False, trust_unverified: bool = False,
                      precision: str = "fp32"):
    """``(model, subword model, ModelFile)`` ready to translate: in eval mode on ``device`` in
    ``dtype``; omega folded away first if ``fold`` (fold.py: the same translations from a vanilla
    Post-LN model); with ``precision="int8"``, every linear layer quantized to int8 (CPU fp32 only;
    admin_ds/inference/int8.py)."""
    from admin_ds.inference.int8 import quantize_for_decoding
    from admin_ds.model.fold import fold_omega

    if precision not in PRECISIONS:
        raise ValueError(f"unknown decoding precision {precision!r}; use one of {', '.join(PRECISIONS)}")
    mf = load_any(path, tag, trust_unverified)
    model, subword = build_from_model_file(mf, "cpu", torch.float32)
    if fold:
        model = fold_omega(model)  # in fp32, before any cast
    model = model.to(device=device, dtype=dtype).eval()
    if precision == "int8":
        model = quantize_for_decoding(model)
    return model, subword, mf
