"""HOPE / Nested Learning: library package."""

from typing import Any

from hope.config import Config, load_config
from hope.errors import ConfigError

__all__ = [
    "VARIANTS",
    "Config",
    "ConfigError",
    "MemorizeConfig",
    "build_model",
    "load_config",
    "memorize",
    "memorize_sequence",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Lazy so that `import hope` (config, data stages) does not pay for importing torch.
    if name in ("build_model", "VARIANTS"):
        from hope.model import zoo

        return getattr(zoo, name)
    if name in ("memorize", "memorize_sequence", "MemorizeConfig"):
        from hope.model import memorize

        return getattr(memorize, name)
    raise AttributeError(f"module 'hope' has no attribute {name!r}")
