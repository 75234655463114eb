"""Stable import path: ``from admin_ds.fold import fold_omega`` (the code is admin_ds/model/fold.py)."""

from admin_ds.model.fold import fold_omega  # noqa: F401
