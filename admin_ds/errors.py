"""Errors a user can fix. Every command catches ``UserError`` and prints its message on one line
(``error: ...``) with exit status 2; anything else is a bug and keeps its traceback.

Each message names what is wrong: the file, the line, the field or the argument, and what was
expected. The subclasses only say which kind of input was at fault.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input: a message for the person who gave it, not a traceback."""


class ConfigError(UserError, ValueError):
    """A configuration value (run config, DeepSpeed JSON, model config) is invalid; the message
    names the field."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint or model file cannot be used; the message names the path and the reason."""


class DataError(UserError, ValueError):
    """A corpus or data directory cannot be used; the message names the file (and line)."""


class ProfileError(UserError, ValueError):
    """An Admin profile file cannot be used; the message names the file (and line)."""
