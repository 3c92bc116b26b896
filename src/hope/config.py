"""One typed configuration for the whole pipeline.

Resolution order: dataclass defaults <- ``configs/presets/<preset>.yaml`` <-
``params.yaml`` <- command-line overrides (``"model.dim=256"``). A ``null`` in
``params.yaml`` means "keep the preset's value", so every knob is listed there
(and ``dvc exp run -S key=value`` works for all of them) while the preset stays
the place where model sizes live.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from hope.errors import ConfigError
from hope.model.config import ModelConfig

PRESET_DIR = Path(__file__).resolve().parents[2] / "configs" / "presets"


@dataclass
class DataConfig:
    source: Literal["builtin", "hf", "local"] = "builtin"
    hf_name: str = "HuggingFaceFW/fineweb-edu"
    hf_config: str | None = "sample-10BT"
    hf_split: str = "train"
    text_column: str = "text"
    streaming: bool = True
    max_documents: int = 0  # 0: no limit
    local_glob: str = ""
    min_chars: int = 64
    max_chars: int = 200_000
    dedup: bool = True
    val_fraction: float = 0.1
    split_seed: int = 0
    seq_len: int = 128


@dataclass
class TokenizerConfig:
    model_type: Literal["unigram", "bpe"] = "unigram"
    vocab_size: int = 4096
    byte_fallback: bool = True
    character_coverage: float = 0.9995
    num_threads: int = 1
    max_sentence_length: int = 16384


@dataclass
class OptimConfig:
    name: Literal["adamw", "muon", "m3"] = "adamw"
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 25
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    # Muon hybrid (name=muon): torch.optim.Muon on 2-D hidden matrices with its own
    # lr and decoupled decay; AdamW (lr above) on the rest (MECHANISMS §6).
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.01
    # M3 hybrid (name=m3; NL-arXiv Alg. 1, MECHANISMS §6). beta1/beta2 above are
    # M3's beta1/beta2; its update O/(sqrt(V)+eps) scales like 1/|g|, hence its own lr.
    m3_lr: float = 1e-3
    m3_weight_decay: float = 0.0  # coupled: added to the gradient
    m3_beta3: float = 0.9
    m3_alpha: float = 1.0
    m3_slow_every: int = 50
    m3_ns_steps: int = 3
    m3_ema_v: bool = False  # V <- beta2 V + (1-beta2) g^2 instead of the literal V += beta2 g^2


@dataclass
class TrainConfig:
    steps: int = 250
    batch_size: int = 16
    # Rows per forward/backward (gradient accumulation; the step's gradient is the
    # whole batch's); None = the whole batch at once.
    micro_batch_size: int | None = None
    # Data parallelism (DDP through torchrun, hope.train.distributed): processes per
    # node and nodes; the global batch (train.batch_size) is split over all of them.
    nproc_per_node: int = 1
    nnodes: int = 1
    seed: int = 0
    # The numerics of a run (train and eval; hope.train.device.configure_numerics).
    # Every one of them changes the numbers, so none is left to the machine:
    # device "auto" is resolved at start and recorded in train.json's "runtime".
    device: str = "cpu"  # cpu | cuda | cuda:N | auto (cuda when available)
    precision: Literal["auto", "fp32", "bf16"] = "fp32"  # fp32 is strict (no TF32)
    # torch intra-op threads: CPU reductions are split per thread, so another count
    # gives (slightly) other numbers. Snakemake rules request this many cores.
    num_threads: int = 2
    # torch.use_deterministic_algorithms (+ cuDNN/cuBLAS determinism on CUDA).
    deterministic: bool = True
    # Memory-write backend (hope.memory.ops.dispatch): "compile" runs the memories'
    # chunk steps through torch.compile (same values); "fla" needs CUDA + fla.
    memory_backend: Literal["torch", "compile", "fla"] = "torch"
    checkpoint_every: int = 100
    # Checkpoints kept (newest first); a corrupt newest one falls back to the next.
    keep_checkpoints: int = 2
    # On a non-finite loss (checked at each log/validation/checkpoint step, before
    # anything is saved): stop with the last good checkpoint intact, or rewind to it
    # with the learning rate times nan_lr_factor, at most nan_max_rewinds times.
    nan_policy: Literal["stop", "rewind"] = "stop"
    nan_lr_factor: float = 0.5
    nan_max_rewinds: int = 3
    log_every: int = 10
    val_every: int = 50
    val_batches: int = 8
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    wandb_project: str = "hope-nl"


@dataclass
class EvalConfig:
    batch_size: int = 16
    max_batches: int = 32
    passkey_lengths: list[int] = field(default_factory=lambda: [64, 128])
    passkey_trials: int = 16
    passkey_candidates: int = 4
    seed: int = 1234


@dataclass
class ReleaseConfig:
    name: str = "hope-tiny"


@dataclass
class BenchConfig:
    """The ``bench`` stage: one training step (forward, backward, AdamW) per variant
    at fixed shapes (``tiny``: the preset's model; ``smoke``: the predecessor's smoke
    shape, docs/ANCHORS.md "Speed"; ``pilot_chunks``: one layer with the pilot
    preset's chunking at T = 1024; ``pilot``, a GPU shape: the pilot preset's dims in two
    layers at T = 4096). See :mod:`hope.bench.run`."""

    variants: list[str] = field(
        default_factory=lambda: ["transformer", "hope_attention", "hope", "titans_mac"]
    )
    shapes: list[Literal["tiny", "smoke", "pilot_chunks", "pilot"]] = field(
        default_factory=lambda: ["tiny", "smoke", "pilot_chunks"]
    )
    batch_size: int = 8  # tiny shape only; smoke is fixed at batch 4, pilot_chunks 1, pilot 4
    warmup: int = 2
    steps: int = 5
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda | cuda:N (recorded in bench.json's machine)
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    num_threads: int = 2  # torch intra-op threads while measuring (as train.num_threads)
    memory_backend: Literal["torch", "compile", "fla"] = "torch"  # as train.memory_backend
    # Presets whose GPU step time is projected from counted launches and FLOPs
    # (hope.bench.projection); each variant costs four launch counts at its chunking:
    # seconds for pilot, up to a minute for hope at mid/target (CMS period 1024).
    project_presets: list[Literal["pilot", "mid", "target"]] = field(
        default_factory=lambda: ["pilot", "mid", "target"]
    )


@dataclass
class RecallConfig:
    """The ``recall`` stage: multi-query associative recall (MQAR, Zoology), a small
    synthetic training + eval per variant (:mod:`hope.eval.recall`). Every model
    knob not set here comes from the ``model`` section (shell, mechanisms, chunking).
    """

    variants: list[str] = field(default_factory=lambda: ["transformer", "hope"])
    steps: int = 200  # hope learns MQAR within this; the transformer needs more (README)
    batch_size: int = 32
    seq_len: int = 64  # input tokens per sequence
    num_pairs: int = 8  # key-value pairs per sequence (chance = 1 / num_pairs)
    vocab_size: int = 128  # keys from the lower half, values from the upper half
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 2
    lr: float = 3e-3
    eval_sequences: int = 256
    eval_every: int = 50
    seed: int = 0
    num_threads: int = 2  # torch intra-op threads (as train.num_threads)


@dataclass
class Config:
    preset: str = "tiny"
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    release: ReleaseConfig = field(default_factory=ReleaseConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    recall: RecallConfig = field(default_factory=RecallConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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


def _rule_knob_errors(name: str, momentum: float, erase: float, width: int = 0) -> list[str]:
    """What is wrong with (cms_rule, cms_momentum, cms_erase, cms_momentum_width): a
    knob the rule ignores must stay 0, so that no setting is silently without effect."""
    errors = []
    if name == "deep_momentum" and width < 1:
        errors.append(
            "model.cms_rule=deep_momentum needs model.cms_momentum_width >= 1 "
            "(the hidden width of its momentum MLP)"
        )
    if name != "deep_momentum" and width:
        errors.append(
            f"model.cms_momentum_width={width} has no effect with model.cms_rule={name} "
            "(it is deep_momentum's MLP width)"
        )
    if not 0.0 <= momentum < 1.0 and not (name == "delta_momentum" and momentum == 1.0):
        errors.append(f"model.cms_momentum={momentum} must be in [0, 1)")
    if name == "gd" and momentum:
        errors.append(
            f"model.cms_momentum={momentum} has no effect with model.cms_rule=gd "
            "(use momentum, dgd, delta_momentum or ortho_momentum)"
        )
    if name == "momentum" and not momentum:
        errors.append("model.cms_rule=momentum needs model.cms_momentum > 0")
    if name == "dgd" and not erase > 0:
        errors.append("model.cms_rule=dgd needs model.cms_erase > 0 (the erase coefficient)")
    if name == "precond_momentum" and not erase > 0:
        errors.append(
            "model.cms_rule=precond_momentum needs model.cms_erase > 0 (the damping ε of "
            "its preconditioner (εI + XᵀX/C)⁻¹)"
        )
    if name in ("gd", "momentum", "ortho_momentum", "deep_momentum") and erase:
        errors.append(
            f"model.cms_erase={erase} has no effect with model.cms_rule={name} "
            "(it is dgd's erase coefficient, delta_momentum's epsilon or "
            "precond_momentum's damping)"
        )
    if erase < 0:
        errors.append(f"model.cms_erase={erase} must be >= 0")
    return errors


def _validate(cfg: Config) -> None:
    m, d = cfg.model, cfg.data
    checks = [
        (m.dim % m.n_heads == 0, "model.dim must be divisible by model.n_heads"),
        (all(p > 0 for p in m.cms_periods), "model.cms_periods must be positive"),
        (
            all(p % m.cms_periods[0] == 0 for p in m.cms_periods) if m.cms_periods else True,
            "model.cms_periods: every period must be a multiple of the first",
        ),
        (m.smt_mem_chunk % m.smt_chunk == 0, "model.smt_mem_chunk must be a multiple of smt_chunk"),
        (
            m.smt_checkpoint_chunks >= 0,
            f"model.smt_checkpoint_chunks={m.smt_checkpoint_chunks} must be >= 0",
        ),
        (
            not (m.cms_adaptive_lr and m.cms_mode == "static"),
            "model.cms_adaptive_lr=true needs a cms_mode that writes in training "
            "(teach_pass or exact_online): a static level never trains its rate gate",
        ),
        (m.titans_depth >= 1, f"model.titans_depth={m.titans_depth} must be >= 1"),
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
            cfg.train.keep_checkpoints >= 1,
            f"train.keep_checkpoints={cfg.train.keep_checkpoints} must be >= 1",
        ),
        (cfg.train.checkpoint_every >= 1, "train.checkpoint_every must be >= 1"),
        (
            0.0 < cfg.train.nan_lr_factor < 1.0,
            f"train.nan_lr_factor={cfg.train.nan_lr_factor} must be in (0, 1)",
        ),
        (cfg.train.nan_max_rewinds >= 0, "train.nan_max_rewinds must be >= 0"),
        (
            cfg.train.micro_batch_size is None
            or 1 <= cfg.train.micro_batch_size <= cfg.train.batch_size,
            f"train.micro_batch_size={cfg.train.micro_batch_size} must be in "
            f"[1, train.batch_size={cfg.train.batch_size}] (or null: the whole batch)",
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
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    rule_errors = _rule_knob_errors(m.cms_rule, m.cms_momentum, m.cms_erase, m.cms_momentum_width)
    if rule_errors:
        raise ConfigError(rule_errors[0])
    if m.vocab_size is None:
        m.vocab_size = cfg.tokenizer.vocab_size
    elif m.vocab_size < cfg.tokenizer.vocab_size:
        raise ConfigError(
            f"model.vocab_size={m.vocab_size} is smaller than tokenizer.vocab_size="
            f"{cfg.tokenizer.vocab_size}; set it to null to follow the tokenizer"
        )


def load_config(path: str | Path | None = "params.yaml", overrides: Iterable[str] = ()) -> Config:
    """Resolve defaults <- preset <- ``path`` <- ``overrides`` into a validated Config."""
    params = _read_yaml(Path(path)) if path is not None else {}
    override_tree: dict[str, Any] = {}
    for text in overrides:
        _merge(override_tree, _parse_override(text))
    preset = override_tree.get("preset") or params.get("preset") or Config.preset
    if not isinstance(preset, str) or preset not in available_presets():
        raise ConfigError(
            f"unknown preset {preset!r}; valid presets: {', '.join(available_presets())}"
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
    _validate(cfg)
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
