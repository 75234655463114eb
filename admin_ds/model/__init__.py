"""The model: one device, no deepspeed, no torch.distributed.

    config.py       ModelConfig and the depth-dependent constants of the initialisations
    presets.py      named presets with the papers' sizes, derived from one base
    residual.py     residual connections: plain, Admin omega, DeepNorm alpha (the experiment's seam)
    layers.py       embeddings, attention with its decoding state, FFN, encoder and decoder layers
    transformer.py  EncoderDecoder, whole or as a pipeline stage's part; build_model
    init.py         initialisation schemes, per-layer generators
    profiling.py    residual statistics, both omega formulas, the profile artifact in every format
    fold.py         fold omega into a vanilla Post-LN model with equal outputs
    analysis.py     the Admin paper's analyses at initialisation

The configuration and the presets need no torch; the modules are imported when a name from
transformer.py is first used, so a command that refuses a bad run config does so before importing
torch.
"""

from admin_ds.model.config import ModelConfig
from admin_ds.model.presets import get_preset

_FROM_TRANSFORMER = ("EncoderDecoder", "LayerStack", "ModelPart", "build_model", "count_parameters")

__all__ = ["EncoderDecoder", "LayerStack", "ModelConfig", "ModelPart", "build_model", "count_parameters",
           "get_preset"]


def __getattr__(name: str):
    if name in _FROM_TRANSFORMER:
        from admin_ds.model import transformer

        return getattr(transformer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
