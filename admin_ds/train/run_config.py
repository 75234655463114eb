"""The run configuration: what to train. Defaults < YAML file < ``--section.key=value``.

    model:   a preset name plus ModelConfig overrides (vocab_size comes from the data if unset)
    data:    binarized data directory (or the embedded default), token budget per micro-batch
    admin:   profiling: formula, a profile to reuse, padding handling
    optim:   optimizer, learning-rate schedule, clipping, label smoothing
    train:   run directory, length of the run, checkpoint/validation/log cadence, seed
    engine:  pipeline stages and the distributed port (the rest of *how* is the DeepSpeed JSON)
    guard:   the divergence guard: skip non-finite updates, roll back on divergence

The tree is validated once, written into the run directory and every checkpoint, and each
module receives only its section. The defaults below are the embedded default run (a tiny model
on the generated corpus, minutes on a CPU); launch/configs/*.yaml hold the papers' recipes.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from admin_ds.errors import ConfigError
from admin_ds.files import parse_yaml, read_config_text
from admin_ds.model.config import ModelConfig
from admin_ds.model.dropout import DROPOUT_IMPLS
from admin_ds.model.presets import PRESET_NAMES, get_preset


@dataclass
class ModelSection:
    preset: str = "debug-tiny"
    overrides: dict = field(default_factory=dict)  # any ModelConfig field, e.g. num_encoder_layers

    def build(self, vocab_size: Optional[int] = None) -> ModelConfig:
        if self.preset not in PRESET_NAMES:
            raise ConfigError(f"model.preset: unknown preset {self.preset!r}; known: {', '.join(PRESET_NAMES)}")
        over = dict(self.overrides)
        if vocab_size is not None:
            if "vocab_size" in over and over["vocab_size"] != vocab_size:
                raise ConfigError(f"model.vocab_size={over['vocab_size']} differs from the data's "
                                  f"subword vocabulary ({vocab_size}); leave it unset")
            over["vocab_size"] = vocab_size
        return get_preset(self.preset, **over)


@dataclass
class DataSection:
    path: Optional[str] = None  # binarized data dir with manifest.json; None: the embedded default
    max_tokens: int = 4096  # padded tokens per micro-batch (token bucket)
    max_positions: int = 256  # longer training pairs are dropped (and counted)
    pad_to_multiple: int = 1  # pad batch lengths to a multiple (8 on GPUs: whole tensor-core tiles)
    valid_split: str = "valid"
    # Train TGT->SRC on the same data directory (its binarized files and joint subword model): the
    # reverse model that back-translation needs. A run keeps its direction for life.
    reverse: bool = False
    test_split: str = "test"
    default_pairs: int = 30000  # size of the embedded default corpus
    default_vocab_size: int = 1000


@dataclass
class AdminSection:
    formula: str = "reference"  # "reference" | "paper"
    profile: Optional[str] = None  # reuse admin_profile.json or profile.ratio.init; skips profiling
    mask_padding: bool = False  # the reference includes padding in the variances
    profile_only: bool = False  # write the profile and exit


@dataclass
class OptimSection:
    optimizer: str = "radam"  # "radam" | "adam" | "adamw"
    lr: float = 3e-3
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_updates: int = 100
    warmup_init_lr: float = 1e-7
    clip_norm: float = 0.0  # 0 disables; always passed to DeepSpeed explicitly (its default is 1.0)
    label_smoothing: float = 0.1
    # How a step runs over the tensors (engine.py make_optimizer): "foreach" (multi-tensor kernels),
    # "fused" (one kernel; adam/adamw), "deepspeed" (DeepSpeed's FusedAdam; adam/adamw), "loop".
    implementation: str = "foreach"


@dataclass
class TrainSection:
    run_dir: str = "runs/default"
    max_updates: int = 500
    max_epochs: Optional[int] = None
    save_interval_updates: int = 500
    keep_last: int = 3
    # Also keep the N checkpoints with the lowest validation loss, for `average_checkpoints.py
    # --best N` (Joey NMT's keep_best_ckpts); needs saves at validations (a multiple of the interval).
    keep_best: int = 0
    log_interval: int = 10
    valid_interval_updates: int = 250
    # Stop once the validation loss has not improved on its best for this many validations in a row
    # (fairseq's --patience); None: train to max_updates / max_epochs.
    patience: Optional[int] = None
    final_eval: bool = True  # validation loss and test BLEU after the last update
    bleu_interval_updates: Optional[int] = None  # also BLEU on the validation split every N updates
    bleu_beam: int = 4
    bleu_lenpen: float = 0.6
    bleu_max_sentences: Optional[int] = None  # evaluate BLEU on the first N test sentences
    # Output length bound a x source length + b, as launch/translate.py's --max-len-a/-b: without
    # it, an early model that rarely emits EOS decodes every sentence to the model's limit.
    bleu_max_len_a: float = 1.2
    bleu_max_len_b: int = 10
    # Beam x data.max_tokens x (a + b + 1) above this is refused at start-up (admin_ds/inference/
    # limits.py, translate.py's --max-decode-cells); None: that module's default.
    bleu_max_decode_cells: Optional[int] = None
    seed: int = 1
    tensorboard: bool = False
    resume: bool = True  # continue from the newest complete checkpoint in run_dir


@dataclass
class EngineSection:
    pipeline_stages: int = 1
    distributed_port: int = 29500  # rendezvous port for mpirun (mpi4py discovery) and Slurm mappings
    dist_timeout_s: int = 600  # collective operations
    connect_timeout_s: int = 120  # a rank that cannot reach the master gives up after this
    expect_world_size: Optional[int] = None  # refuse to start on any other number of ranks
    expect_nodes: Optional[int] = None  # refuse to start on any other number of nodes
    # Speed and memory; none of these changes what is computed (tests/test_fast_paths.py).
    # Position-wise work on real tokens only (data-parallel path). With dropout it draws other
    # random numbers than the padded computation (none for padding): the same training in
    # distribution, not number for number. None: on (see resolve_auto).
    skip_padding: Optional[bool] = None
    activation_checkpointing: bool = False  # recompute each layer's activations in the backward
    compile: bool = False  # torch.compile each encoder and decoder layer (data-parallel path)
    # Where dropout masks come from (admin_ds/model/dropout.py): "torch" (F.dropout), "bulk"
    # (random bytes drawn in bulk; the same distribution, other numbers, far cheaper on a CPU),
    # or "auto": bulk on a CPU, torch on a GPU (already Philox in one fused kernel there).
    dropout: str = "auto"
    # Training's decoder self-attention also masks padded target keys, as fairseq does. Off, it is
    # causal only (flash attention on a GPU); the loss and gradients are the same. Profiling
    # always masks them.
    mask_padded_target_keys: bool = False

    def resolve_auto(self, device_type: str, saved: Optional[dict] = None) -> list[str]:
        """Fill in the choices left to the system (``skip_padding`` None, ``dropout`` "auto"), in
        place: a resumed run keeps what its checkpoint was trained with (``saved``: the
        checkpoint's ``engine`` record), so its dropout masks do not change under it; a new run
        takes the fastest exact path on ``device_type``. Returns a note for each choice a
        resumed run kept from its checkpoint."""
        notes = []
        fastest = {"skip_padding": self.pipeline_stages == 1, "dropout": "bulk" if device_type == "cpu" else "torch"}
        for key, auto in (("skip_padding", None), ("dropout", "auto")):
            if getattr(self, key) != auto:
                continue
            if saved is not None and key in saved:
                setattr(self, key, saved[key])
                if saved[key] != fastest[key]:
                    notes.append(f"engine.{key}={json.dumps(saved[key])}, as the checkpoint was trained "
                                 "(the same random numbers as before the interruption)")
            else:
                setattr(self, key, fastest[key])
        return notes


@dataclass
class GuardSection:
    """The divergence guard (admin_ds/train/guard.py): non-finite updates are skipped and
    counted; too many in a row, or a loss spike, roll back to the newest complete checkpoint
    with the learning rate lowered."""
    max_consecutive_nonfinite: int = 5  # roll back after this many skipped updates in a row; 0: never
    spike_factor: float = 3.0  # roll back when the loss exceeds this x its running average; 0: never
    ema_beta: float = 0.98  # running average: ema = beta * ema + (1 - beta) * loss
    warmup_updates: int = 100  # finite updates before spikes are looked for
    lr_factor: float = 0.5  # each rollback multiplies the learning rate by this
    max_rollbacks: int = 3  # then the run stops with an error


SECTIONS = {"model": ModelSection, "data": DataSection, "admin": AdminSection, "optim": OptimSection,
            "train": TrainSection, "engine": EngineSection, "guard": GuardSection}


@dataclass
class RunConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    admin: AdminSection = field(default_factory=AdminSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    engine: EngineSection = field(default_factory=EngineSection)
    guard: GuardSection = field(default_factory=GuardSection)

    def validate(self) -> "RunConfig":
        def need(ok, name, msg):
            if not ok:
                raise ConfigError(f"{name}: {msg}")

        need(self.admin.formula in ("reference", "paper"), "admin.formula", "must be 'reference' or 'paper'")
        need(self.optim.optimizer in ("radam", "adam", "adamw"), "optim.optimizer",
             "must be one of radam, adam, adamw")
        need(self.optim.implementation in ("foreach", "fused", "deepspeed", "loop"), "optim.implementation",
             "must be one of foreach, fused, deepspeed, loop")
        need(self.optim.implementation in ("foreach", "loop") or self.optim.optimizer != "radam",
             "optim.implementation", f"{self.optim.implementation!r} has Adam and AdamW only; RAdam runs "
             "'foreach' (multi-tensor kernels) or 'loop'")
        need(self.optim.lr > 0, "optim.lr", "must be positive")
        need(self.optim.warmup_updates >= 0, "optim.warmup_updates", "must be >= 0")
        need(self.optim.warmup_init_lr >= 0, "optim.warmup_init_lr", "must be >= 0")
        need(self.optim.clip_norm >= 0, "optim.clip_norm", "must be >= 0 (0 disables clipping)")
        need(0 <= self.optim.label_smoothing < 1, "optim.label_smoothing", "must be in [0, 1)")
        need(len(self.optim.betas) == 2, "optim.betas", "needs two values")
        need(self.data.max_tokens > 0, "data.max_tokens", "must be positive")
        need(self.train.max_updates > 0, "train.max_updates", "must be positive")
        need(self.train.max_epochs is None or self.train.max_epochs > 0, "train.max_epochs",
             "must be positive, or null for no limit")
        need(self.train.save_interval_updates > 0, "train.save_interval_updates", "must be positive")
        need(self.train.valid_interval_updates > 0, "train.valid_interval_updates", "must be positive")
        need(self.train.log_interval > 0, "train.log_interval", "must be positive")
        need(self.train.keep_last >= 1, "train.keep_last", "must be >= 1")
        need(self.train.keep_best >= 0, "train.keep_best", "must be >= 0")
        need(self.train.keep_best == 0 or self.train.save_interval_updates % self.train.valid_interval_updates == 0,
             "train.keep_best", f"ranks checkpoints by their validation loss, so train.save_interval_updates "
             f"({self.train.save_interval_updates}) must be a multiple of train.valid_interval_updates "
             f"({self.train.valid_interval_updates})")
        need(self.train.patience is None or self.train.patience >= 1, "train.patience",
             "must be >= 1 (validations without improvement), or null to train to max_updates")
        t = self.train
        need(t.bleu_beam >= 1, "train.bleu_beam", "must be >= 1")
        need(t.bleu_max_sentences is None or t.bleu_max_sentences >= 1, "train.bleu_max_sentences",
             "must be >= 1 (leave it out for the whole split)")
        need(t.bleu_max_len_a >= 0, "train.bleu_max_len_a", "must be >= 0")
        need(t.bleu_max_len_b >= 0, "train.bleu_max_len_b", "must be >= 0")
        need(t.bleu_max_decode_cells is None or t.bleu_max_decode_cells >= 1, "train.bleu_max_decode_cells",
             "must be >= 1")
        need(self.engine.pipeline_stages >= 1, "engine.pipeline_stages", "must be >= 1")
        need(not (self.engine.compile and self.engine.pipeline_stages > 1), "engine.compile",
             "compiles the data-parallel path's layers; pipeline stages run eagerly")
        need(self.engine.dropout in ("auto", *DROPOUT_IMPLS), "engine.dropout",
             f"must be one of auto, {', '.join(DROPOUT_IMPLS)}")
        need(self.data.pad_to_multiple >= 1, "data.pad_to_multiple", "must be >= 1")
        g = self.guard
        need(g.max_consecutive_nonfinite >= 0, "guard.max_consecutive_nonfinite", "must be >= 0 (0: never roll back)")
        need(g.spike_factor == 0 or g.spike_factor > 1, "guard.spike_factor", "must be > 1 (0: off)")
        need(0 <= g.ema_beta < 1, "guard.ema_beta", "must be in [0, 1)")
        need(g.warmup_updates >= 0, "guard.warmup_updates", "must be >= 0")
        need(0 < g.lr_factor <= 1, "guard.lr_factor", "must be in (0, 1]")
        need(g.max_rollbacks >= 0, "guard.max_rollbacks", "must be >= 0")
        self.model.build()  # validates the preset and overrides
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict, origin: str = "config") -> "RunConfig":
        cfg = cls()
        merge_into(cfg, json.loads(json.dumps(d)), origin)  # tuples saved as lists
        return cfg


def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _suggest(key: str, known) -> str:
    match = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    return f" (did you mean {match[0]}?)" if match else f" (known: {', '.join(sorted(known))})"


def _coerce(value: Any, hint, name: str, origin: str, from_text: bool) -> Any:
    """``value`` as the field's annotated type, or a ConfigError naming the field and what is
    expected. ``from_text``: a command-line string, read as YAML (numbers, true/false, lists)."""
    if from_text and hint is not str:
        try:
            value = float(value) if hint is float else yaml.safe_load(value)  # YAML 1.1 reads "2e-3" as text
        except ValueError:
            raise ConfigError(f"{origin}: {name}: got {value!r} (expected a number)") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{origin}: {name}: cannot parse {value!r}: {e}") from None
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        if value is None:
            return None
        hint = next(a for a in args if a is not type(None))
        args = typing.get_args(hint)

    def fail(expected: str):
        raise ConfigError(f"{origin}: {name}: got {value!r} (expected {expected})")

    if hint is bool:
        return value if isinstance(value, bool) else fail("true or false")
    if hint is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else fail("an integer")
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        return float(value) if ok else fail("a finite number")
    if hint is str:
        return value if isinstance(value, str) else fail("a string")
    if typing.get_origin(hint) is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            fail(f"a list of {len(args)} numbers")
        return tuple(_coerce(v, a, f"{name}[{i}]", origin, False) for i, (v, a) in enumerate(zip(value, args)))
    if hint is dict:
        return value if isinstance(value, dict) else fail("a mapping")
    return value


def merge_into(cfg: RunConfig, d: dict, origin: str, from_text: bool = False) -> None:
    """Merge a nested dict (from YAML or the command line) into ``cfg``, naming unknown sections and
    keys with the closest known one, and every value that is not of its field's type."""
    if not isinstance(d, dict):
        raise ConfigError(f"{origin}: expected a mapping of sections ({', '.join(SECTIONS)}), got {type(d).__name__}")
    for section, values in d.items():
        if section not in SECTIONS:
            raise ConfigError(f"{origin}: {section}: unknown section{_suggest(str(section), SECTIONS)}")
        target = getattr(cfg, section)
        if not isinstance(values, dict):
            raise ConfigError(f"{origin}: {section}: got {values!r} (expected a mapping of keys)")
        hints = _hints(type(target))
        for key, value in values.items():
            name = f"{section}.{key}"
            if section == "model" and key not in hints:
                # model fields other than the preset name are ModelConfig overrides
                model_hints = _hints(ModelConfig)
                if key not in model_hints:
                    raise ConfigError(f"{origin}: {name}: unknown key{_suggest(str(key), set(model_hints) | set(hints))}")
                target.overrides[key] = _coerce(value, model_hints[key], name, origin, from_text)
                continue
            if key not in hints:
                raise ConfigError(f"{origin}: {name}: unknown key{_suggest(str(key), hints)}")
            setattr(target, key, _coerce(value, hints[key], name, origin, from_text))


def load_run_config(path: Optional[str], overrides: list[str]) -> RunConfig:
    """Defaults, then the YAML file, then ``--section.key=value`` overrides; validated."""
    cfg = RunConfig()
    if path:
        p = Path(path)
        data = parse_yaml(read_config_text(p, "--config", "YAML run config"), p)
        merge_into(cfg, data or {}, str(p))
    cli: dict = {}
    for item in overrides:
        if not item.startswith("--") or "=" not in item or "." not in item.split("=", 1)[0]:
            raise ConfigError(f"command line: expected --section.key=value, got {item!r}")
        key, value = item[2:].split("=", 1)
        section, field_name = key.split(".", 1)
        cli.setdefault(section, {})[field_name] = value
    merge_into(cfg, cli, "command line", from_text=True)
    return cfg.validate()


def dump_run_config(cfg: RunConfig) -> str:
    return json.dumps(cfg.to_dict(), indent=1, default=list)
