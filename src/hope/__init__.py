"""HOPE / Nested Learning: library package."""

from hope.config import Config, ConfigError, load_config

__all__ = ["Config", "ConfigError", "load_config"]
__version__ = "0.1.0"
