"""What the encoder-decoder is: ``ModelConfig``, and the constants of the initialisations that
depend only on depth (admin-torch's omega, DeepNorm's alpha/beta, T-Fixup's scales).

The training run's configuration tree (admin_ds/train/run_config.py) holds a preset name plus
overrides of these fields; the model package never sees the rest of that tree.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, fields

from admin_ds.errors import ConfigError

NORM_ORDERS = ("post", "pre")
INITS = ("default", "admin", "admin-constant", "deepnorm", "t-fixup")
ACTIVATIONS = ("relu", "gelu")


@dataclass
class ModelConfig:
    """What the encoder-decoder is. Field names are part of the stable surface (DESIGN.md)."""

    vocab_size: int = 32768
    model_dim: int = 512
    ffn_inner_dim: int = 2048
    num_heads: int = 8
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    norm_order: str = "post"  # "post" | "pre"
    init: str = "admin"  # one of INITS
    dropout_p: float = 0.1
    attention_dropout_p: float = 0.1
    activation_dropout_p: float = 0.1
    activation: str = "relu"
    # Source, target and output embeddings share one matrix over a joint vocabulary (the paper's
    # setting). With False, source and target get their own matrices; the output projection stays
    # tied to the target embedding unless share_decoder_input_output_embed is False as well.
    share_all_embeddings: bool = True
    share_decoder_input_output_embed: bool = True
    max_positions: int = 1024
    # Admin: omega is a trainable D-vector per sub-layer (the reference); False keeps it a buffer.
    omega_trainable: bool = True
    # Set by fold_omega when the first sub-layer of a stack had omega != 1: a per-stack D-vector
    # that scales the embedding output (tokens and positions), see fold.py.
    embedding_output_scale: bool = False
    # fairseq dictionary conventions, also used by our SentencePiece models.
    bos_idx: int = 0
    pad_idx: int = 1
    eos_idx: int = 2
    unk_idx: int = 3

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def need(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ConfigError(f"model.{name}: {msg} (got {getattr(self, name)!r})")

        need(self.vocab_size > max(self.bos_idx, self.pad_idx, self.eos_idx, self.unk_idx),
             "vocab_size", "must exceed the special-symbol ids")
        need(self.model_dim > 0 and self.model_dim % 2 == 0, "model_dim", "must be a positive even number")
        need(self.num_heads > 0 and self.model_dim % self.num_heads == 0, "num_heads",
             f"must divide model_dim={self.model_dim}")
        need(self.ffn_inner_dim > 0, "ffn_inner_dim", "must be positive")
        need(self.num_encoder_layers >= 1, "num_encoder_layers", "must be >= 1")
        need(self.num_decoder_layers >= 1, "num_decoder_layers", "must be >= 1")
        need(self.norm_order in NORM_ORDERS, "norm_order", f"must be one of {NORM_ORDERS}")
        need(self.init in INITS, "init", f"must be one of {INITS}")
        need(self.activation in ACTIVATIONS, "activation", f"must be one of {ACTIVATIONS}")
        for name in ("dropout_p", "attention_dropout_p", "activation_dropout_p"):
            need(0.0 <= getattr(self, name) < 1.0, name, "must be in [0, 1)")
        need(self.max_positions >= 8, "max_positions", "must be >= 8")
        # Admin, its constant variant and DeepNorm rescale the shortcut of a Post-LN sub-layer;
        # on a Pre-LN model they have no meaning (the reference code asserts the same).
        if self.init in ("admin", "admin-constant", "deepnorm"):
            need(self.norm_order == "post", "norm_order", f"init={self.init!r} needs a Post-LN model")

    # ---- derived -------------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.model_dim // self.num_heads

    @property
    def num_encoder_sublayers(self) -> int:
        return 2 * self.num_encoder_layers

    @property
    def num_decoder_sublayers(self) -> int:
        return 3 * self.num_decoder_layers

    def replace(self, **overrides) -> "ModelConfig":
        return dataclasses.replace(self, **overrides)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"model: unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**d)

    def config_hash(self) -> str:
        """A short, stable digest of the architecture (for profiles and checkpoints)."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def admin_constant_omega(num_sublayers: int) -> float:
    """admin-torch's profiling-free omega for a stack of N residual sub-layers, its default
    "O(log n)" form: sqrt((N+1)/ln(N+1) - 1). 60L encoder (N=120): 4.92; 12L decoder (N=36): 3.04."""
    n = num_sublayers
    return math.sqrt((n + 1) / math.log(n + 1) - 1)


def deepnorm_constants(num_encoder_layers: int, num_decoder_layers: int) -> dict[str, float]:
    """DeepNet's encoder-decoder alpha (shortcut scale) and beta (xavier gain), Wang et al. 2022."""
    n, m = num_encoder_layers, num_decoder_layers
    return {
        "encoder_alpha": 0.81 * (n**4 * m) ** (1 / 16),
        "encoder_beta": 0.87 * (n**4 * m) ** (-1 / 16),
        "decoder_alpha": (3 * m) ** (1 / 4),
        "decoder_beta": (12 * m) ** (-1 / 4),
    }


def tfixup_constants(num_encoder_layers: int, num_decoder_layers: int) -> dict[str, float]:
    """T-Fixup scales (Huang et al. 2020, appendix; layer6ai-labs/T-Fixup)."""
    n, m = num_encoder_layers, num_decoder_layers
    return {
        "encoder_scale": 0.67 * n ** (-1 / 4),  # encoder fc1, fc2, out_proj (v_proj * sqrt 2)
        "decoder_scale": (9 * m) ** (-1 / 4),  # decoder fc1, fc2, self/cross out_proj (v_proj * sqrt 2)
        "encoder_embed_scale": (9 * n) ** (-1 / 4),
        "decoder_embed_scale": (9 * m) ** (-1 / 4),
    }

