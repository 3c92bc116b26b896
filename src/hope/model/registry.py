"""Variant registry: ``@register_variant(name)`` builders and ``build_model(cfg)``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hope.config import ConfigError
from hope.model.config import ModelConfig
from hope.model.lm import LanguageModel

Builder = Callable[[ModelConfig], LanguageModel]
_BUILDERS: dict[str, Builder] = {}


def register_variant(name: str) -> Callable[[Builder], Builder]:
    def decorate(builder: Builder) -> Builder:
        if name in _BUILDERS:
            raise ValueError(f"model variant {name!r} registered twice")
        _BUILDERS[name] = builder
        return builder

    return decorate


def build_model(model_cfg: ModelConfig) -> LanguageModel:
    builder = _BUILDERS.get(model_cfg.variant)
    if builder is None:
        raise ConfigError(
            f"model.variant {model_cfg.variant!r} is not available in this build; "
            f"available: {', '.join(_BUILDERS)}"
        )
    return builder(model_cfg)


# Variant modules register themselves on import; add new variants here.
from hope.model import hope, titans, transformer  # noqa: E402, F401


def __getattr__(name: str) -> Any:
    # VARIANTS is computed on access so it is complete whichever module was imported first.
    if name == "VARIANTS":
        return tuple(_BUILDERS)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
