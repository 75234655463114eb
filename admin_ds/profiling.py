"""Stable import path: ``from admin_ds.profiling import profile_omega`` (the code is
admin_ds/model/profiling.py)."""

from admin_ds.model.profiling import Profile, apply_omega, omega_values, profile_omega  # noqa: F401
