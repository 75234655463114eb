"""Stable import path: ``from admin_ds.presets import get_preset`` (the code is admin_ds/model/presets.py)."""

from admin_ds.model.presets import PRESET_NAMES, get_preset, parameter_count, preset_table  # noqa: F401
