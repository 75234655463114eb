"""Initialisation schemes as explicit, swappable objects.

A scheme decides three things and nothing else: which residual each sub-layer gets, whether a
sub-layer has a LayerNorm, and how the weights are drawn. ``get_init_scheme(cfg)`` picks one from
``cfg.init``; with ``cfg.norm_order == "pre"``, ``default`` is the Pre-LN baseline.

    default         fairseq init, plain residual            (Post-LN or Pre-LN)
    admin           fairseq init, omega residual, omega=1 until profiled   (Liu et al. 2020)
    admin-constant  fairseq init, omega = sqrt((N+1)/ln(N+1) - 1) per stack (admin-torch)
    deepnorm        alpha shortcut, xavier_normal gain beta  (Wang et al. 2022)
    t-fixup         no LayerNorm, scaled weights and embeddings (Huang et al. 2020)

Every piece of the model (each embedding, each layer, each final norm; ``EncoderDecoder.
init_units``) draws from its own generator, seeded by the run seed and the piece's key
(``encoder.17``). The weights of a layer therefore do not depend on which other layers a process
builds: a pipeline stage draws exactly what the whole model draws for its layers.

The fairseq 0.9 initialisation the reference Admin code (Transformer-Clinic) runs, and what we
do (docs/admin_reference.md has the comparison with sources):
    token embedding     N(0, D^-1/2), padding row 0                 same
    Q, K, V weights     xavier_uniform, gain 1/sqrt(2) (one fused in_proj for Q, K, V)   same
    Q, K, V biases      0 (MultiheadAttention.reset_parameters)      same
    out_proj            xavier_uniform, bias 0                       same
    FFN fc1, fc2        xavier_uniform, bias 0                       same
    LayerNorm           weight 1, bias 0                             same
    untied output proj  N(0, D^-1/2)                                 same
Formulas and constants of the other schemes: ../shared/reference/ADMIN_NOTES.md sections 2 and 4.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from admin_ds.model.config import ModelConfig, admin_constant_omega, deepnorm_constants, tfixup_constants
from admin_ds.model.layers import FeedForward, MultiheadAttention, TokenEmbedding
from admin_ds.model.residual import OmegaResidual, PlainResidual, Residual, ScaledResidual


def unit_generator(seed: int, key: str) -> torch.Generator:
    """The generator of one piece of the model: a function of (seed, key) only."""
    digest = hashlib.sha256(f"{int(seed)}/{key}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


class InitScheme:
    """fairseq's default Transformer initialisation with plain residuals and LayerNorm."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg

    def make_residual(self, dim: int, stack: str, index: int) -> Residual:
        return PlainResidual(stack, index)

    def make_norm(self, dim: int) -> nn.Module:
        return nn.LayerNorm(dim)

    @torch.no_grad()
    def initialize(self, model: nn.Module, seed: int) -> None:
        """Draw every weight of ``model`` (a whole model or a pipeline stage's part of it)."""
        for key, unit in model.init_units():
            g = unit_generator(seed, key)
            for m in unit.modules():
                self.init_module(m, g)
            self.adjust_unit(key, unit, g)
        for name in ("src_embed_scale", "tgt_embed_scale"):  # folded models (fold.py)
            if hasattr(model, name):
                getattr(model, name).fill_(1.0)

    def init_module(self, m: nn.Module, g: torch.Generator) -> None:
        d = self.cfg.model_dim
        if isinstance(m, TokenEmbedding):
            nn.init.normal_(m.weight, mean=0.0, std=d ** -0.5, generator=g)
            m.weight[self.cfg.pad_idx].zero_()
            m.reset_parameters()
        elif isinstance(m, MultiheadAttention):
            for proj in (m.q_proj, m.k_proj, m.v_proj):
                nn.init.xavier_uniform_(proj.weight, gain=1 / math.sqrt(2), generator=g)
                nn.init.zeros_(proj.bias)
            nn.init.xavier_uniform_(m.out_proj.weight, generator=g)
            nn.init.zeros_(m.out_proj.bias)
        elif isinstance(m, FeedForward):
            for fc in (m.fc1, m.fc2):
                nn.init.xavier_uniform_(fc.weight, generator=g)
                nn.init.zeros_(fc.bias)
        elif isinstance(m, (nn.LayerNorm, Residual)):
            m.reset_parameters()
        elif isinstance(m, nn.Linear) and m.bias is None:  # the untied output projection
            nn.init.normal_(m.weight, mean=0.0, std=d ** -0.5, generator=g)

    def adjust_unit(self, key: str, unit: nn.Module, g: torch.Generator) -> None:
        """What a scheme changes after the default draw of one piece (DeepNorm, T-Fixup)."""


class AdminInit(InitScheme):
    """Admin: the default init plus omega per sub-layer, 1 until ``profile_omega`` sets it.
    Drawing the weights exactly as ``default`` does makes omega = 1 reproduce Post-LN bit for bit."""

    def make_residual(self, dim: int, stack: str, index: int) -> Residual:
        return OmegaResidual(dim, stack, index, init_value=1.0, trainable=self.cfg.omega_trainable)


class AdminConstantInit(InitScheme):
    """admin-torch's profiling-free variant: one omega for every sub-layer of a stack."""

    def make_residual(self, dim: int, stack: str, index: int) -> Residual:
        n = self.cfg.num_encoder_sublayers if stack == "encoder" else self.cfg.num_decoder_sublayers
        return OmegaResidual(dim, stack, index, init_value=admin_constant_omega(n),
                             trainable=self.cfg.omega_trainable)


def _attentions(key: str, layer: nn.Module) -> list[MultiheadAttention]:
    return [layer.self_attn] + ([layer.encoder_attn] if key.startswith("decoder.") else [])


def _stack_of(key: str) -> str | None:
    return key.split(".")[0] if key.startswith(("encoder.", "decoder.")) else None


class DeepNormInit(InitScheme):
    """x = LN(alpha * x + G(x)); xavier_normal with gain beta on fc1, fc2, v_proj, out_proj and
    gain 1 on q_proj, k_proj, separately for encoder and decoder (the reference code's choice)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.constants = deepnorm_constants(cfg.num_encoder_layers, cfg.num_decoder_layers)

    def make_residual(self, dim: int, stack: str, index: int) -> Residual:
        return ScaledResidual(dim, stack, index, self.constants[f"{stack}_alpha"])

    def adjust_unit(self, key: str, unit: nn.Module, g: torch.Generator) -> None:
        stack = _stack_of(key)
        if stack is None:
            return
        beta = self.constants[f"{stack}_beta"]
        for attn in _attentions(key, unit):
            nn.init.xavier_normal_(attn.q_proj.weight, gain=1.0, generator=g)
            nn.init.xavier_normal_(attn.k_proj.weight, gain=1.0, generator=g)
            nn.init.xavier_normal_(attn.v_proj.weight, gain=beta, generator=g)
            nn.init.xavier_normal_(attn.out_proj.weight, gain=beta, generator=g)
        nn.init.xavier_normal_(unit.ffn.fc1.weight, gain=beta, generator=g)
        nn.init.xavier_normal_(unit.ffn.fc2.weight, gain=beta, generator=g)


class TFixupInit(InitScheme):
    """T-Fixup: no LayerNorm anywhere; the default init, then encoder fc1/fc2/out_proj scaled by
    0.67 N^-1/4 and decoder fc1/fc2/out_proj (self and encoder attention) by (9M)^-1/4, v_proj by
    the same times sqrt(2) (undoing the 1/sqrt(2) xavier gain of the default init); embeddings
    N(0, D^-1/2) scaled by (9N)^-1/4 (encoder, and the shared matrix) and (9M)^-1/4 (separate
    decoder embedding)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.constants = tfixup_constants(cfg.num_encoder_layers, cfg.num_decoder_layers)

    def make_norm(self, dim: int) -> nn.Module:
        return nn.Identity()

    def adjust_unit(self, key: str, unit: nn.Module, g: torch.Generator) -> None:
        c = self.constants
        if key == "src_embed":
            unit.weight.mul_(c["encoder_embed_scale"])
        elif key == "tgt_embed":
            unit.weight.mul_(c["decoder_embed_scale"])
        elif (stack := _stack_of(key)) is not None:
            s = c[f"{stack}_scale"]
            for attn in _attentions(key, unit):
                attn.out_proj.weight.mul_(s)
                attn.v_proj.weight.mul_(s * math.sqrt(2))
            unit.ffn.fc1.weight.mul_(s)
            unit.ffn.fc2.weight.mul_(s)


SCHEMES = {
    "default": InitScheme,
    "admin": AdminInit,
    "admin-constant": AdminConstantInit,
    "deepnorm": DeepNormInit,
    "t-fixup": TFixupInit,
}


def get_init_scheme(cfg: ModelConfig) -> InitScheme:
    return SCHEMES[cfg.init](cfg)
