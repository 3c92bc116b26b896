"""The model zoo: one builder per variant name, and ``build_model(cfg)``.

A plain table: ``model.variant`` is a closed ``Literal`` (``model/config.py``), and a
test checks the table has exactly its names. A new variant is a module with a builder
and one row here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import get_args

from hope.errors import ConfigError
from hope.model.config import ModelConfig, Variant
from hope.model.hope import build_hope, build_hope_attention
from hope.model.lm import LanguageModel
from hope.model.titans import build_titans_lmm, build_titans_mac, build_titans_mag, build_titans_mal
from hope.model.transformer import build_transformer

Builder = Callable[[ModelConfig], LanguageModel]

BUILDERS: dict[str, Builder] = {
    "transformer": build_transformer,
    "hope_attention": build_hope_attention,
    "hope": build_hope,
    "titans_lmm": build_titans_lmm,
    "titans_mac": build_titans_mac,
    "titans_mag": build_titans_mag,
    "titans_mal": build_titans_mal,
}
VARIANTS: tuple[str, ...] = get_args(Variant)


def build_model(model_cfg: ModelConfig) -> LanguageModel:
    builder = BUILDERS.get(model_cfg.variant)
    if builder is None:
        raise ConfigError(
            f"model.variant {model_cfg.variant!r} is not a variant; "
            f"available: {', '.join(BUILDERS)}"
        )
    return builder(model_cfg)
