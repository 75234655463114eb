"""Fold omega away: an Admin model becomes a vanilla Post-LN model with the same outputs.

Appendix C of the Admin paper. Sub-layer i computes ``b_i = omega_i * x_{i-1} + f_i(x_{i-1})``,
where x_{i-1} = gamma * norm(b_{i-1}) + nu is the previous LayerNorm's output. Multiplying that
LayerNorm's gamma and nu by omega_i makes it emit omega_i * x_{i-1} directly, and dividing the
input-side weights of f_i by omega_i (column-wise: W[:, d] / omega_i[d]) lets f_i still see
x_{i-1}. Then b_i is unchanged:

    FFN                  fc1 / omega_i
    self-attention       q_proj, k_proj, v_proj / omega_i
    encoder-attention    q_proj / omega_i only (K and V read the encoder output, unchanged)

The first sub-layer of each stack has no LayerNorm before it: its input is the embedding output
(tokens * sqrt(D) + sinusoidal positions). There we scale the embedding *output* by omega_1 with a
per-stack D-vector (``embedding_output_scale``), which keeps a shared embedding matrix shared (the
encoder and decoder scales differ) and scales the fixed positions too. It is only added when some
omega_1 differs from 1; the reference recursion starts each chain at exactly 1, so a freshly
profiled model folds into a model with no extra parameter at all.

DeepNorm's fixed alpha is the same kind of shortcut scale and folds the same way.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from admin_ds.model.residual import OmegaResidual, ScaledResidual
from admin_ds.model.transformer import EncoderDecoder, build_model


def _scale_of(residual: nn.Module) -> torch.Tensor:
    return residual.shortcut_scale().detach()


@torch.no_grad()
def fold_omega(model: EncoderDecoder) -> EncoderDecoder:
    """A new Post-LN model (``init="default"``, no omega) whose outputs equal ``model``'s.

    The input model is left untouched. Works in any float dtype; the folded model has the input's
    dtype and device.
    """
    cfg = model.cfg
    if cfg.norm_order != "post":
        raise ValueError("fold_omega: only Post-LN models carry a foldable shortcut scale")
    residuals = [m for m in model.modules() if isinstance(m, (OmegaResidual, ScaledResidual))]
    if not residuals:
        return copy.deepcopy(model)

    src = copy.deepcopy(model)
    enc_scale = _scale_of(src.encoder_layers[0].self_attn_residual)
    dec_scale = _scale_of(src.decoder_layers[0].self_attn_residual)
    needs_embed_scale = cfg.embedding_output_scale or not (
        torch.all(enc_scale == 1) and torch.all(dec_scale == 1))

    # Walk each stack as a chain of (previous LayerNorm, sub-layer input weights, residual).
    def chain(layers, kinds):
        prev_norm = None
        for layer in layers:
            for residual_name, norm_name, weights in kinds(layer):
                yield prev_norm, weights, getattr(layer, residual_name)
                prev_norm = getattr(layer, norm_name)

    def enc_kinds(layer):
        return [("self_attn_residual", "self_attn_layer_norm",
                 [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]),
                ("ffn_residual", "final_layer_norm", [layer.ffn.fc1])]

    def dec_kinds(layer):
        return [("self_attn_residual", "self_attn_layer_norm",
                 [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]),
                ("encoder_attn_residual", "encoder_attn_layer_norm", [layer.encoder_attn.q_proj]),
                ("ffn_residual", "final_layer_norm", [layer.ffn.fc1])]

    for layers, kinds in ((src.encoder_layers, enc_kinds), (src.decoder_layers, dec_kinds)):
        for prev_norm, weights, residual in chain(layers, kinds):
            omega = _scale_of(residual)
            for lin in weights:
                lin.weight.div_(omega[None, :])  # f_i must still see x_{i-1}
            if prev_norm is not None:  # the LayerNorm now emits omega_i * x_{i-1}
                prev_norm.weight.mul_(omega)
                prev_norm.bias.mul_(omega)

    folded_cfg = cfg.replace(init="default", embedding_output_scale=needs_embed_scale)
    p = next(model.parameters())
    folded = build_model(folded_cfg, device="meta")
    state = {k: v for k, v in src.state_dict().items() if not k.endswith(("omega", "alpha"))}
    if needs_embed_scale:
        old = getattr(src, "src_embed_scale", None)
        state["src_embed_scale"] = enc_scale * (1 if old is None else old.detach())
        old = getattr(src, "tgt_embed_scale", None)
        state["tgt_embed_scale"] = dec_scale * (1 if old is None else old.detach())
    folded = folded.to_empty(device=p.device).to(p.dtype)
    folded.load_state_dict(state, strict=True)
    # Non-persistent buffers (the sinusoid table) were lost on the meta device: take them over.
    for name, buf in folded.named_buffers():
        buf.copy_(src.get_buffer(name))
    folded.train(model.training)
    return folded
