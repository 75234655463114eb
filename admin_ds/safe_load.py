"""Opening files that came from elsewhere without running their code.

Run directories and model files are downloaded and shared; a pickle can execute anything when it
is unpickled. So every ``torch.load`` in the project goes through ``load`` (``weights_only=True``
with exactly the DeepSpeed classes its checkpoint files hold allowed), and before DeepSpeed opens
a checkpoint itself (it runs a full unpickle: resume, its ZeRO consolidation, its universal
converter) ``check_tag`` reads the pickles of every file first, without executing them or loading
a tensor, and refuses any file that asks for more, naming the file and the global.

The allowed classes, found by scanning the checkpoints DeepSpeed 0.19.8 writes for ZeRO-0/1/2/3 in
fp32 and bf16, for the pipeline in fp32 and bf16, and for their universal conversions
(``torch.serialization.get_unsafe_globals_in_checkpoint``): plain data, reconstructed without
calling anything but their own constructors. fp16 runs store ``DynamicLossScaler`` (read in
DeepSpeed's source; fp16 does not run on a CPU).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import zipfile
from pathlib import Path
from typing import Iterable

import torch

from admin_ds.errors import CheckpointError

class UnsafeFileError(CheckpointError):
    """A file whose pickle would call something a checkpoint never needs: refused unopened."""


ALLOWED = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",          # optimizer states (fp32, bf16)
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",   # optimizer states (fp16)
    "deepspeed.runtime.zero.config.ZeroStageEnum",            # optimizer states (ZeRO-1/2)
    "deepspeed.utils.tensor_fragment.fragment_address",       # optimizer states (ZeRO-1/2, bf16)
)


def _allowed_classes() -> list:
    """The allowed classes themselves (``safe_globals`` takes objects, not names); imported only
    when a file needs them, so loading a model file never imports DeepSpeed."""
    import importlib

    out = []
    for name in ALLOWED:
        module, _, attr = name.rpartition(".")
        out.append(getattr(importlib.import_module(module), attr))
    return out


def _globals(path: str | os.PathLike) -> list[str]:
    """Every global a file's pickle names beyond what a weights-only load allows by itself."""
    try:
        return torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except (RuntimeError, ValueError, zipfile.BadZipFile, pickle.UnpicklingError, EOFError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable torch file ({type(e).__name__}: {e})") from None


def _refuse(path, found: list[str]) -> None:
    bad = sorted(g for g in found if g not in ALLOWED)
    if bad:
        raise UnsafeFileError(f"{path}: refused: unpickling it would call {', '.join(bad)}, which a checkpoint "
                              "never needs (a file that runs code when opened)")


def check_files(paths: Iterable[str | os.PathLike]) -> None:
    """Refuse the first file that would run code when unpickled (or is not a torch file). Reads
    the pickles, runs nothing, loads no tensor."""
    for path in paths:
        _refuse(path, _globals(path))


def check_tag(tag_dir: str | os.PathLike) -> None:
    """``check_files`` on every torch file of a DeepSpeed checkpoint tag (or universal folder)."""
    check_files(sorted(p for p in Path(tag_dir).rglob("*.pt") if p.is_file()))


def load(path: str | os.PathLike, map_location="cpu"):
    """``torch.load`` that runs no code from the file: weights only, plus the ``ALLOWED`` DeepSpeed
    classes. A file that asks for anything else is refused, naming the file and the global."""
    found = _globals(path)
    _refuse(path, found)
    allowed = torch.serialization.safe_globals(_allowed_classes()) if found else contextlib.nullcontext()
    try:
        with allowed:
            return torch.load(path, map_location=map_location, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, zipfile.BadZipFile, EOFError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot be read ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
