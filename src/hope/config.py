"""One typed configuration for the whole pipeline.

Resolution order: dataclass defaults <- ``configs/presets/<preset>.yaml`` <-
``params.yaml`` <- command-line overrides (``"model.dim=256"``). The repository's
``params.yaml`` is a preset resolved (``hope.params_file``): every value a run uses,
marked with the preset it came from, so asking it for another preset is refused. A
``null`` there means "keep the preset's value".
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import yaml

from hope.config_sections import (
    BenchConfig,
    Config,
    ContinualConfig,
    DataConfig,
    EvalConfig,
    LongctxConfig,
    MemorizeParams,
    NiahConfig,
    OptimConfig,
    RecallConfig,
    ReleaseConfig,
    TokenizerConfig,
    TrainConfig,
    ZeroshotConfig,
)
from hope.errors import ConfigError

__all__ = [
    "BenchConfig",
    "Config",
    "ContinualConfig",
    "DataConfig",
    "EvalConfig",
    "LongctxConfig",
    "MemorizeParams",
    "NiahConfig",
    "OptimConfig",
    "PRESET_DIR",
    "RecallConfig",
    "ZeroshotConfig",
    "ReleaseConfig",
    "TokenizerConfig",
    "TrainConfig",
    "all_keys",
    "available_presets",
    "config_from_dict",
    "load_config",
    "merge_config",
    "save_config",
]

PRESET_DIR = Path(__file__).resolve().parents[2] / "configs" / "presets"


def available_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def all_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted knob name, e.g. ``model.dim``."""
    keys: list[str] = []
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            keys += all_keys(hint, f"{prefix}{f.name}.")  # type: ignore[arg-type]
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    return str(hint).replace("typing.", "") if not isinstance(hint, type) else hint.__name__


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Check ``value`` against ``hint``; return it (ints widen to float)."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    bad = ConfigError(f"{key}: expected {_type_name(hint)}, got {value!r} ({type(value).__name__})")
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(key, value, arg)
            except ConfigError:
                continue
        raise bad
    if origin is Literal:
        if value in args:
            return value
        raise bad
    if origin is list:
        if not isinstance(value, list):
            raise bad
        return [_coerce(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value)]
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                raise bad from None
        raise bad
    if hint is str:
        if isinstance(value, str):
            return value
        raise bad
    raise ConfigError(f"{key}: unsupported config type {hint}")


def _unknown(key: str, valid: Iterable[str]) -> ConfigError:
    near = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    hint = f"; did you mean '{near[0]}'?" if near else ""
    return ConfigError(f"unknown config key '{key}'{hint}")


def _apply(obj: Any, updates: Mapping[str, Any], inherit_null: bool, prefix: str = "") -> None:
    """Merge a nested mapping into dataclass ``obj``.

    With ``inherit_null`` (params.yaml), a ``None`` keeps the current value, so
    params.yaml can list every knob without pinning the preset's sizes.
    """
    hints = typing.get_type_hints(type(obj))
    for name, value in updates.items():
        key = f"{prefix}{name}"
        if name not in hints:
            raise _unknown(key, all_keys()) from None
        hint = hints[name]
        if value is None and (inherit_null or dataclasses.is_dataclass(hint)):
            continue
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, Mapping):
                raise ConfigError(f"{key}: expected a section (mapping), got {value!r}")
            _apply(getattr(obj, name), value, inherit_null, f"{key}.")
        else:
            setattr(obj, name, _coerce(key, value, hint))


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at top level")
    return data


def _parse_override(text: str) -> dict[str, Any]:
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like section.key=value")
    dotted, raw = text.split("=", 1)
    value = yaml.safe_load(raw) if raw.strip() else ""
    nested: dict[str, Any] = {}
    node = nested
    parts = dotted.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    if dotted.strip() not in all_keys():
        raise _unknown(dotted.strip(), all_keys())
    return nested


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value
    return base


def _validate(cfg: Config) -> None:
    m, d = cfg.model, cfg.data
    sizes = {"dim": m.dim, "n_heads": m.n_heads, "n_layers": m.n_layers,
             "smt_chunk": m.smt_chunk, "titans_chunk": m.titans_chunk}  # fmt: skip
    checks = [
        *((value >= 1, f"model.{name}={value} must be >= 1") for name, value in sizes.items()),
        (m.n_heads < 1 or m.dim % m.n_heads == 0, "model.dim must be divisible by model.n_heads"),
        (all(p > 0 for p in m.cms_periods), "model.cms_periods must be positive"),
        (
            bool(m.cms_periods) or m.variant not in ("hope", "hope_attention"),
            f"model.cms_periods is empty: variant {m.variant!r} needs at least one CMS level",
        ),
        (cfg.optim.lr > 0, f"optim.lr={cfg.optim.lr} must be > 0"),
        (
            all(p % m.cms_periods[0] == 0 for p in m.cms_periods) if m.cms_periods else True,
            "model.cms_periods: every period must be a multiple of the first",
        ),
        (
            m.smt_chunk < 1 or m.smt_mem_chunk % m.smt_chunk == 0,
            "model.smt_mem_chunk must be a multiple of smt_chunk",
        ),
        (
            m.smt_checkpoint_chunks >= 0,
            f"model.smt_checkpoint_chunks={m.smt_checkpoint_chunks} must be >= 0",
        ),
        (
            m.titans_checkpoint_chunks >= 0,
            f"model.titans_checkpoint_chunks={m.titans_checkpoint_chunks} must be >= 0",
        ),
        (
            not (m.cms_adaptive_lr and m.cms_mode == "static"),
            "model.cms_adaptive_lr=true needs a cms_mode that writes in training "
            "(teach_pass or exact_online): a static level never trains its rate gate",
        ),
        (m.titans_depth >= 1, f"model.titans_depth={m.titans_depth} must be >= 1"),
        (
            m.cms_read_block >= 0,
            f"model.cms_read_block={m.cms_read_block} must be >= 0 (0: one block per call)",
        ),
        (
            cfg.optim.name != "m3" or m.final_norm,
            "optim.name=m3 needs model.final_norm=true: M3's step scales like 1/|g| and "
            "without the final norm it diverges (tiny transformer: val loss 65 vs 5.8; "
            "docs/FAITHFULNESS.md 'LM shell'); set model.final_norm=true "
            "(and model.embed_init_std=null for the classic shell)",
        ),
        (
            m.embed_init_std is None or m.embed_init_std > 0,
            f"model.embed_init_std={m.embed_init_std} must be > 0 (or null: model.init_std)",
        ),
        (0.0 <= d.val_fraction < 1.0, "data.val_fraction must be in [0, 1)"),
        (d.seq_len > 0, "data.seq_len must be positive"),
        (cfg.train.batch_size > 0, "train.batch_size must be positive"),
        (cfg.train.nproc_per_node >= 1, "train.nproc_per_node must be >= 1"),
        (cfg.train.nnodes >= 1, "train.nnodes must be >= 1"),
        (
            cfg.train.parallel == "ddp" or cfg.optim.name == "adamw",
            f"train.parallel=fsdp shards every matrix; optim.name={cfg.optim.name} "
            "orthogonalises whole matrices (use optim.name=adamw or train.parallel=ddp)",
        ),
        (
            cfg.train.checkpoint_format == "full" or cfg.optim.name == "adamw",
            f"train.checkpoint_format=sharded is built for optim.name=adamw, not "
            f"{cfg.optim.name} (use train.checkpoint_format=full)",
        ),
        (
            cfg.train.fsdp_param_dtype == "fp32"
            or (cfg.train.parallel == "fsdp" and cfg.train.precision == "bf16"),
            "train.fsdp_param_dtype=bf16 gathers FSDP2 blocks in bf16: it needs "
            f"train.parallel=fsdp (got {cfg.train.parallel}) and train.precision=bf16 "
            f"(got {cfg.train.precision}; autocast meets the bf16 weights)",
        ),
        (
            cfg.train.parallel == "ddp" or cfg.train.nan_policy != "skip",
            "train.nan_policy=skip restores unsharded optimizer state; with "
            "train.parallel=fsdp use nan_policy stop or rewind",
        ),
        (
            cfg.train.keep_checkpoints >= 1,
            f"train.keep_checkpoints={cfg.train.keep_checkpoints} must be >= 1",
        ),
        (cfg.train.checkpoint_every >= 1, "train.checkpoint_every must be >= 1"),
        (
            0.0 < cfg.train.nan_lr_factor < 1.0,
            f"train.nan_lr_factor={cfg.train.nan_lr_factor} must be in (0, 1)",
        ),
        (cfg.train.nan_max_rewinds >= 0, "train.nan_max_rewinds must be >= 0"),
        (cfg.train.nan_max_skips >= 0, "train.nan_max_skips must be >= 0"),
        (
            cfg.train.micro_batch_size is None
            or 1 <= cfg.train.micro_batch_size <= cfg.train.batch_size,
            f"train.micro_batch_size={cfg.train.micro_batch_size} must be in "
            f"[1, train.batch_size={cfg.train.batch_size}] (or null: the whole batch)",
        ),
        (
            not cfg.train.cuda_graph or cfg.optim.name == "adamw",
            f"train.cuda_graph=true replays the fused AdamW's step; optim.name="
            f"{cfg.optim.name} keeps host-side state per step (use optim.name=adamw)",
        ),
        (
            not cfg.train.cuda_graph or cfg.train.nproc_per_node * cfg.train.nnodes == 1,
            f"train.cuda_graph=true captures one process's step; train.nproc_per_node="
            f"{cfg.train.nproc_per_node} x train.nnodes={cfg.train.nnodes} ranks would "
            "capture collectives (set train.cuda_graph=false)",
        ),
        (cfg.train.steps >= 0, "train.steps must be >= 0"),
        (
            cfg.train.num_threads >= 1,
            f"train.num_threads={cfg.train.num_threads} must be >= 1 (results depend on it)",
        ),
        (
            cfg.bench.num_threads >= 1,
            f"bench.num_threads={cfg.bench.num_threads} must be >= 1",
        ),
        (cfg.tokenizer.vocab_size >= 64, "tokenizer.vocab_size must be >= 64"),
        *cfg.zeroshot.checks(),
        *cfg.niah.checks(),
        *cfg.longctx.checks(),
        *cfg.continual.checks(),
        *cfg.memorize.checks(),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    rule_errors = m.cms_rule_errors()
    if rule_errors:
        raise ConfigError(rule_errors[0])
    if m.vocab_size is None:
        m.vocab_size = cfg.tokenizer.vocab_size
    elif m.vocab_size < cfg.tokenizer.vocab_size:
        raise ConfigError(
            f"model.vocab_size={m.vocab_size} is smaller than tokenizer.vocab_size="
            f"{cfg.tokenizer.vocab_size}; set it to null to follow the tokenizer"
        )


# The key of a params file that holds a preset's resolved values (``hope.params_file``).
RESOLVED_MARK = "resolved_preset"


def load_config(path: str | Path | None = "params.yaml", overrides: Iterable[str] = ()) -> Config:
    """Resolve defaults <- preset <- ``path`` <- ``overrides`` into a validated Config."""
    cfg = merge_config(path, overrides)
    _validate(cfg)
    return cfg


def merge_config(path: str | Path | None, overrides: Iterable[str] = ()) -> Config:
    """``load_config`` before validation fills derived values (model.vocab_size)."""
    params = _read_yaml(Path(path)) if path is not None else {}
    resolved_from = params.pop(RESOLVED_MARK, None)
    override_tree: dict[str, Any] = {}
    for text in overrides:
        _merge(override_tree, _parse_override(text))
    preset = override_tree.get("preset") or params.get("preset") or Config.preset
    if not isinstance(preset, str) or preset not in available_presets():
        raise ConfigError(
            f"unknown preset {preset!r}; valid presets: {', '.join(available_presets())}"
        )
    if resolved_from is not None and resolved_from != preset:
        raise ConfigError(
            f"{path} holds the values of preset {resolved_from!r}, not of preset {preset!r}: "
            f"write that preset's with `hope params --preset {preset} --write {path}`"
        )
    cfg = Config()
    preset_path = PRESET_DIR / f"{preset}.yaml"
    for source, tree, inherit_null in (
        (str(preset_path), _read_yaml(preset_path), False),
        (str(path), params, True),
        ("overrides", override_tree, False),
    ):
        try:
            _apply(cfg, tree, inherit_null)
        except ConfigError as err:
            raise ConfigError(f"{source}: {err}") from None
    cfg.preset = preset
    return cfg


def save_config(cfg: Config, path: str | Path) -> None:
    """Write the fully resolved config as YAML (atomically)."""
    from hope.io import atomic_write_text

    atomic_write_text(Path(path), yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def config_from_dict(data: Mapping[str, Any]) -> Config:
    """Rebuild a resolved Config (e.g. the one stored in a checkpoint)."""
    cfg = Config()
    _apply(cfg, data, inherit_null=False)
    _validate(cfg)
    return cfg
