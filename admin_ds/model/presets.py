"""Named model presets with the papers' sizes, derived from one base.

    debug-tiny             the test model (2L-2L, D=64)
    base-6L-6L             Transformer-base 512/2048/8, default Post-LN (the papers' baseline)
    big-6L-6L              Transformer-big 1024/4096/16
    admin-18L-18L          Admin paper, Table 1
    admin-60L-12L          very deep paper, Table 1 (67M -> 262M with a 44,512 vocabulary)
    admin-36L-12L-768D     very deep paper, BERT-base widths 768/3072/12 (back-translation runs)
    admin-60L-12L-1024D    Transformer-big widths 1024/4096/16
    admin-100L-12L         the deepest configuration

Each is Post-LN Admin unless named otherwise; its Pre-LN or default twin is one override away:
``get_preset("admin-60L-12L", init="default", norm_order="pre")``.
"""

from __future__ import annotations

from admin_ds.model.config import ModelConfig

BASE = ModelConfig()  # Transformer-base 512/2048/8, 6L-6L, Admin, shared embeddings

_PRESETS: dict[str, dict] = {
    "debug-tiny": dict(vocab_size=1000, model_dim=64, ffn_inner_dim=128, num_heads=4,
                       num_encoder_layers=2, num_decoder_layers=2, max_positions=256),
    "base-6L-6L": dict(init="default"),
    "big-6L-6L": dict(init="default", model_dim=1024, ffn_inner_dim=4096, num_heads=16, dropout_p=0.3),
    "admin-6L-6L": dict(),
    "admin-18L-18L": dict(num_encoder_layers=18, num_decoder_layers=18),
    "admin-60L-12L": dict(num_encoder_layers=60, num_decoder_layers=12),
    "admin-36L-12L-768D": dict(num_encoder_layers=36, num_decoder_layers=12,
                               model_dim=768, ffn_inner_dim=3072, num_heads=12),
    "admin-60L-12L-1024D": dict(num_encoder_layers=60, num_decoder_layers=12,
                                model_dim=1024, ffn_inner_dim=4096, num_heads=16),
    "admin-100L-12L": dict(num_encoder_layers=100, num_decoder_layers=12),
}

PRESET_NAMES = tuple(_PRESETS)


def get_preset(name: str, **overrides) -> ModelConfig:
    """The named preset's ModelConfig, with ``overrides`` applied (and validated)."""
    if name not in _PRESETS:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(PRESET_NAMES)}")
    return BASE.replace(**{**_PRESETS[name], **overrides})


def parameter_count(cfg: ModelConfig) -> int:
    """Parameter count of the model ``cfg`` describes, built on the meta device (no memory, no
    time), each tied matrix counted once. Omega vectors are included (2N + 3M D-vectors)."""
    from admin_ds.model.transformer import build_model, count_parameters

    return count_parameters(build_model(cfg, device="meta"))


def preset_table(vocab_sizes=(32768, 44512)) -> list[dict]:
    rows = []
    for name in PRESET_NAMES:
        cfg = get_preset(name)
        row = {"preset": name, "layers": f"{cfg.num_encoder_layers}L-{cfg.num_decoder_layers}L",
               "dims": f"{cfg.model_dim}/{cfg.ffn_inner_dim}/{cfg.num_heads}", "init": cfg.init}
        for v in vocab_sizes:
            row[f"params@{v}"] = parameter_count(cfg.replace(vocab_size=v))
        rows.append(row)
    return rows
