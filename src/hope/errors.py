"""The project's expected errors, raised anywhere and turned into one line (exit 2) by
``hope.cli.run_stage``. Imports nothing, so every layer may raise them."""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad configuration: unknown key, wrong type, unknown preset, bad value."""


class StageError(RuntimeError):
    """An expected failure (bad input file, no network, corrupt shard): one line, no traceback."""
