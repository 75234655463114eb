"""Initialisation schemes as explicit, swappable objects.

A scheme decides three things and nothing else: which residual each sub-layer gets, whether a
sub-layer has a LayerNorm, and how the weights are drawn. ``get_init_scheme(cfg)`` picks one from
``cfg.init``; with ``cfg.norm_order == "pre"``, ``default`` is the Pre-LN baseline.

    default         fairseq init, plain residual            (Post-LN or Pre-LN)
    admin           fairseq init, omega residual, omega=1 until profiled   (Liu et al. 2020)
    admin-constant  fairseq init, omega = sqrt((N+1)/ln(N+1) - 1) per stack (admin-torch)
    deepnorm        alpha shortcut, xavier_normal gain beta  (Wang et al. 2022)
    t-fixup         no LayerNorm, scaled weights and embeddings (Huang et al. 2020)

Formulas and constants: ../shared/reference/ADMIN_NOTES.md sections 2 and 4, config.py.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from admin_ds.config import ModelConfig, admin_constant_omega, deepnorm_constants, tfixup_constants
from admin_ds.residual import OmegaResidual, PlainResidual, Residual, ScaledResidual


class InitScheme:
    """fairseq's default Transformer initialisation with plain residuals and LayerNorm."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg

    def make_residual(self, dim: int, stack: str, index: int) -> Residual:
        return PlainResidual(stack, index)

    def make_norm(self, dim: int) -> nn.Module:
        return nn.LayerNorm(dim)

    @torch.no_grad()
    def initialize(self, model: nn.Module) -> None:
        """fairseq: embeddings N(0, D^-1/2) with a zero pad row; FFN and output Linear
        xavier_uniform with zero bias; attention Q/K/V xavier_uniform with gain 1/sqrt(2) (the
        fused in-projection's gain), out_proj xavier_uniform with zero bias."""
        from admin_ds.model import FeedForward, MultiheadAttention, TokenEmbedding

        d = self.cfg.model_dim
        for m in model.modules():
            if isinstance(m, TokenEmbedding):
                nn.init.normal_(m.weight, mean=0.0, std=d ** -0.5)
                m.weight[self.cfg.pad_idx].zero_()
            elif isinstance(m, MultiheadAttention):
                for proj in (m.q_proj, m.k_proj, m.v_proj):
                    nn.init.xavier_uniform_(proj.weight, gain=1 / math.sqrt(2))
                nn.init.xavier_uniform_(m.out_proj.weight)
                nn.init.zeros_(m.out_proj.bias)
            elif isinstance(m, FeedForward):
                for fc in (m.fc1, m.fc2):
                    nn.init.xavier_uniform_(fc.weight)
                    nn.init.zeros_(fc.bias)
        if getattr(model, "output_proj", None) is not None:
            nn.init.normal_(model.output_proj.weight, mean=0.0, std=d ** -0.5)


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


class DeepNormInit(InitScheme):
    """x = LN(alpha * x + G(x)); xavier_normal with gain beta on fc1, fc2, v_proj, out_proj and
    gain 1 on q_proj, k_proj, separately for encoder and decoder (the reference code's choice)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.constants = deepnorm_constants(cfg.num_encoder_layers, cfg.num_decoder_layers)

    def make_residual(self, dim: int, stack: str, index: int) -> Residual:
        return ScaledResidual(dim, stack, index, self.constants[f"{stack}_alpha"])

    @torch.no_grad()
    def initialize(self, model: nn.Module) -> None:
        super().initialize(model)
        for stack, layers in (("encoder", model.encoder_layers), ("decoder", model.decoder_layers)):
            beta = self.constants[f"{stack}_beta"]
            for layer in layers:
                attns = [layer.self_attn] + ([layer.encoder_attn] if stack == "decoder" else [])
                for attn in attns:
                    nn.init.xavier_normal_(attn.q_proj.weight, gain=1.0)
                    nn.init.xavier_normal_(attn.k_proj.weight, gain=1.0)
                    nn.init.xavier_normal_(attn.v_proj.weight, gain=beta)
                    nn.init.xavier_normal_(attn.out_proj.weight, gain=beta)
                nn.init.xavier_normal_(layer.ffn.fc1.weight, gain=beta)
                nn.init.xavier_normal_(layer.ffn.fc2.weight, gain=beta)


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

    @torch.no_grad()
    def initialize(self, model: nn.Module) -> None:
        super().initialize(model)
        c = self.constants
        for stack, layers in (("encoder", model.encoder_layers), ("decoder", model.decoder_layers)):
            s = c[f"{stack}_scale"]
            for layer in layers:
                attns = [layer.self_attn] + ([layer.encoder_attn] if stack == "decoder" else [])
                for attn in attns:
                    attn.out_proj.weight.mul_(s)
                    attn.v_proj.weight.mul_(s * math.sqrt(2))
                layer.ffn.fc1.weight.mul_(s)
                layer.ffn.fc2.weight.mul_(s)
        model.src_embed.weight.mul_(c["encoder_embed_scale"])
        if model.tgt_embed is not None:
            model.tgt_embed.weight.mul_(c["decoder_embed_scale"])


SCHEMES = {
    "default": InitScheme,
    "admin": AdminInit,
    "admin-constant": AdminConstantInit,
    "deepnorm": DeepNormInit,
    "t-fixup": TFixupInit,
}


def get_init_scheme(cfg: ModelConfig) -> InitScheme:
    return SCHEMES[cfg.init](cfg)
