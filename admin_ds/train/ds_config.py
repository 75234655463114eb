"""The DeepSpeed JSON, checked against what the installed DeepSpeed accepts, before any work.

DeepSpeed reads its configuration key by key and ignores what it does not read: a misspelt
section (``"zero_optimisation"``) trains without it, silently. Some sections are pydantic models
that refuse unknown keys, but with a traceback. So ``check`` asks DeepSpeed itself: it parses the
configuration with DeepSpeed's own ``DeepSpeedConfig`` while recording every key DeepSpeed looks up,
section by section, and then refuses

* a key nobody read (at the top level, and in the sections DeepSpeed reads key by key), naming
  the closest key it does read ("did you mean zero_optimization?");
* whatever DeepSpeed's own validation rejects (pydantic models, assertions), as one line naming
  the key path and what is expected;
* values whose type the run depends on: a ZeRO stage, precision switches, batch numbers.

Keys are learnt from the installed DeepSpeed, not from a list written here, so a DeepSpeed upgrade
that adds or removes a key is followed. Two kinds of section cannot be checked this way: those
DeepSpeed copies wholesale (``pipeline`` is merged over its defaults, so its known keys are those
defaults plus the keys the pipeline engine reads) and those a pydantic model validates itself
(they refuse unknown keys on their own).
"""

from __future__ import annotations

import difflib
import os
from typing import Any

from admin_ds.errors import ConfigError
from admin_ds.files import parse_json, read_config_text

# Keys DeepSpeed's pipeline engine reads from the "pipeline" section (runtime/pipe/engine.py), and
# the defaults DeepSpeed merges it into (runtime/config.py get_pipeline_config); "stages" is
# also ours (engine.pipeline_stages), taken out before DeepSpeed sees the section.
_PIPELINE_KEYS = {"stages", "partition", "seed_layers", "activation_checkpoint_interval", "pipe_partitioned",
                  "grad_partitioned", "use_reentrant"}
_ITERATED = "*"  # marks a section DeepSpeed iterated as a whole (pydantic, or merged over defaults)


class _Recording(dict):
    """A configuration section that remembers which keys were looked up (and whether the whole
    section was iterated), with nested sections wrapped the same way."""

    def __init__(self, d: dict, path: str, reads: dict) -> None:
        super().__init__({k: _Recording(v, f"{path}{k}.", reads) if isinstance(v, dict) else v for k, v in d.items()})
        self.path, self.reads = path, reads
        reads.setdefault(path, set())

    def _read(self, key) -> None:
        self.reads[self.path].add(key)

    def __getitem__(self, key):
        self._read(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self._read(key)
        return super().get(key, default)

    def __contains__(self, key) -> bool:
        self._read(key)
        return super().__contains__(key)

    def pop(self, key, *default):
        self._read(key)
        return super().pop(key, *default)

    def setdefault(self, key, default=None):
        self._read(key)
        return super().setdefault(key, default)

    def keys(self):
        return _RecordingKeys(self)

    def items(self):
        self._read(_ITERATED)
        return super().items()

    def __iter__(self):
        self._read(_ITERATED)
        return super().__iter__()


class _RecordingKeys:
    """``d.keys()``: ``key in d.keys()`` is a lookup of that key; iterating it reads them all."""

    def __init__(self, d: _Recording) -> None:
        self.d = d

    def __contains__(self, key) -> bool:
        return key in self.d

    def __iter__(self):
        self.d._read(_ITERATED)
        return iter(dict.keys(self.d))

    def __len__(self) -> int:
        return dict.__len__(self.d)


def _closest(key: str, known) -> str:
    match = difflib.get_close_matches(str(key), sorted(str(k) for k in known if k != _ITERATED), n=1, cutoff=0.6)
    return f" (did you mean {match[0]}?)" if match else ""


def _type_name(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "true/false", type(None): "null"}.get(
        type(value), "a number" if isinstance(value, (int, float)) else type(value).__name__)


def read(path: str | os.PathLike) -> dict:
    """The JSON object in ``path``; a missing file, a directory, bytes that are not UTF-8, invalid
    JSON, a key given twice, a number that is not finite or another top level are refused, naming
    the file (and the line). Needs neither torch nor DeepSpeed, so launch/train.py refuses such a
    file before importing them."""
    ds = parse_json(read_config_text(path, "--deepspeed_config", "DeepSpeed JSON file"), path)
    if not isinstance(ds, dict):
        raise ConfigError(f"{path}: the top level must be a JSON object, got {type(ds).__name__}")
    return ds


def check_types(ds: dict, source: str) -> None:
    """The values the run's layout depends on, checked strictly (DeepSpeed's own parsing would
    take "yes" for true, or fail with a TypeError deep inside)."""
    def need(path: str, ok: bool, expected: str) -> None:
        if not ok:
            node: Any = ds
            for part in path.split("."):
                node = node.get(part) if isinstance(node, dict) else None
            raise ConfigError(f"{source}: {path}: got {node!r} ({expected})")

    def is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    for section in ("zero_optimization", "bf16", "fp16", "pipeline", "checkpoint", "data_types",
                    "activation_checkpointing", "optimizer", "scheduler"):
        if section in ds:
            need(section, isinstance(ds[section], dict), f"expected an object, got {_type_name(ds[section])}")
    zero = ds.get("zero_optimization", {})
    if "stage" in zero:
        need("zero_optimization.stage", is_int(zero["stage"]) and 0 <= zero["stage"] <= 3,
             "expected one of 0, 1, 2, 3")
    for section in ("bf16", "fp16"):
        if "enabled" in ds.get(section, {}):
            need(f"{section}.enabled", isinstance(ds[section]["enabled"], bool), "expected true or false")
    for key in ("gradient_accumulation_steps", "train_batch_size", "train_micro_batch_size_per_gpu"):
        if key in ds:
            need(key, is_int(ds[key]) and ds[key] >= 1, "expected an integer >= 1")
    if "stages" in ds.get("pipeline", {}):
        need("pipeline.stages", is_int(ds["pipeline"]["stages"]) and ds["pipeline"]["stages"] >= 1,
             "expected an integer >= 1")


def check(ds: dict, source: str) -> None:
    """Refuse what the installed DeepSpeed would not use as written (module docstring). ``ds`` is
    the resolved configuration, whose batch arithmetic engine.resolve_ds_config has checked."""
    import pydantic
    from deepspeed.runtime.config import DeepSpeedConfig

    # DeepSpeed checks the batch numbers against the world it sees (one process, without a
    # process group): give it numbers consistent with that, the real ones are checked already.
    probe = dict(ds, train_batch_size=ds.get("train_micro_batch_size_per_gpu", 1) * ds.get("gradient_accumulation_steps", 1))
    reads: dict[str, set] = {}
    try:
        DeepSpeedConfig(_Recording(probe, "", reads))
    except pydantic.ValidationError as e:
        raise ConfigError(_pydantic_message(e, source)) from None
    except (AssertionError, TypeError, ValueError, KeyError) as e:  # DeepSpeedConfigError is a ValueError
        raise ConfigError(f"{source}: {e}") from None
    _refuse_unread(ds, "", reads, source)


def _refuse_unread(section: dict, path: str, reads: dict, source: str) -> None:
    read = reads.get(path, set())
    if path == "pipeline.":
        known = _PIPELINE_KEYS
    elif _ITERATED in read and path:
        return  # validated as a whole by a pydantic model (which refuses unknown keys itself)
    else:
        known = read
    for key, value in section.items():
        if key not in known:
            raise ConfigError(f"{source}: {path}{key}: unknown key for DeepSpeed{_closest(key, known)}")
        if isinstance(value, dict):
            _refuse_unread(value, f"{path}{key}.", reads, source)


# DeepSpeed's pydantic models and the section each one validates (the error's location is relative
# to it).
_MODEL_SECTIONS = {"DeepSpeedZeroConfig": "zero_optimization", "DeepSpeedBF16Config": "bf16",
                   "DeepSpeedFP16Config": "fp16", "DeepSpeedMonitorConfig": "", "HybridEngineConfig": "hybrid_engine",
                   "TPTrainingConfig": "tensor_parallel", "DeepSpeedZeroOffloadOptimizerConfig":
                   "zero_optimization.offload_optimizer", "DeepSpeedZeroOffloadParamConfig": "zero_optimization.offload_param"}


def _pydantic_message(e, source: str) -> str:
    """The first error of a pydantic validation, as ``source: key.path: what (expected)``."""
    err = e.errors()[0]
    prefix = _MODEL_SECTIONS.get(e.title, e.title)
    path = ".".join(str(p) for p in ((prefix,) if prefix else ()) + tuple(err["loc"]))
    if err["type"] == "extra_forbidden":
        model = next((c for c in _pydantic_models() if c.__name__ == e.title), None)
        return f"{source}: {path}: unknown key for DeepSpeed{_closest(err['loc'][-1], _fields_at(model, err['loc'][:-1]))}"
    return f"{source}: {path}: {err['msg']} (got {err.get('input')!r})"


def _fields_at(model, loc: tuple) -> list[str]:
    """The field names (and aliases) of the pydantic model found by following ``loc`` from ``model``."""
    import typing

    for part in loc:
        if model is None or part not in getattr(model, "model_fields", {}):
            return []
        annotation = model.model_fields[part].annotation
        candidates = [annotation, *typing.get_args(annotation)]
        model = next((c for c in candidates if isinstance(c, type) and hasattr(c, "model_fields")), None)
    if model is None:
        return []
    return [name for n, f in model.model_fields.items() for name in (n, f.alias) if name]


def _pydantic_models() -> list:
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    out, todo = [], [DeepSpeedConfigModel]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return out
