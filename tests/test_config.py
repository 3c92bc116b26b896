"""Config resolution: defaults <- preset <- params.yaml <- overrides, and its errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hope.config import Config, all_keys, available_presets, load_config
from hope.errors import ConfigError
from hope.params_file import params_text, write_params

ROOT = Path(__file__).resolve().parents[1]
PARAMS = ROOT / "params.yaml"


def _flatten(tree: dict, prefix: str = "") -> set[str]:
    keys: set[str] = set()
    for name, value in tree.items():
        if isinstance(value, dict):
            keys |= _flatten(value, f"{prefix}{name}.")
        else:
            keys.add(f"{prefix}{name}")
    return keys


def test_params_yaml_lists_every_knob_exactly() -> None:
    # Freezes the set of options: a new knob is a visible change to params.yaml.
    listed = _flatten(yaml.safe_load(PARAMS.read_text()))
    assert listed == {*all_keys(), "resolved_preset"}


def test_params_yaml_is_the_tiny_preset_resolved() -> None:
    """The repository's params.yaml is generated: the values a run uses, each default
    still written once (dataclasses, presets). After changing a default, regenerate it."""
    tree = yaml.safe_load(PARAMS.read_text())
    assert tree == yaml.safe_load(params_text("tiny")), (
        "params.yaml is stale: run `hope params --preset tiny --write params.yaml`"
    )
    assert PARAMS.read_text().startswith(params_text("tiny").split("\npreset:")[0])
    assert tree["model"]["dim"] == Config().model.dim and tree["train"]["steps"] > 0
    assert tree["model"]["vocab_size"] is None  # follows the tokenizer
    assert load_config(PARAMS) == load_config(None, ["preset=tiny"])


@pytest.mark.parametrize("preset", ["pilot", "mid"])
def test_a_written_preset_file_runs_that_preset(tmp_path: Path, preset: str) -> None:
    path = tmp_path / "params.yaml"
    write_params(path, preset, ["train.steps=7"])
    tree = yaml.safe_load(path.read_text())
    assert (tree["preset"], tree["resolved_preset"], tree["train"]["steps"]) == (preset, preset, 7)
    cfg = load_config(path)
    assert cfg == load_config(None, [f"preset={preset}", "train.steps=7"])
    # A value edited in the file (dvc exp run -S) is what runs.
    path.write_text(path.read_text().replace("  steps: 7\n", "  steps: 9\n"))
    assert load_config(path).train.steps == 9


def test_asking_a_resolved_file_for_another_preset_is_refused(tmp_path: Path) -> None:
    """`dvc exp run -S preset=pilot` edits only the preset line: the file still holds
    tiny's values, so the run would be tiny under pilot's name. Refused, naming the fix."""
    edited = tmp_path / "params.yaml"
    edited.write_text(PARAMS.read_text().replace("\npreset: tiny\n", "\npreset: pilot\n"))
    for path, overrides in ((edited, []), (PARAMS, ["preset=mid"])):
        with pytest.raises(ConfigError) as info:
            load_config(path, overrides)
        message = str(info.value)
        assert "holds the values of preset 'tiny'" in message, message
        assert "hope params --preset" in message and "--write" in message


def test_default_params_resolve_to_tiny_preset() -> None:
    cfg = load_config(PARAMS)
    assert cfg.preset == "tiny"
    assert cfg.model.dim == Config().model.dim
    # vocab follows the tokenizer unless set explicitly
    assert cfg.model.vocab_size == cfg.tokenizer.vocab_size


def test_preset_then_params_then_overrides(tmp_path: Path) -> None:
    params = tmp_path / "params.yaml"
    params.write_text("preset: mid\nmodel:\n  n_layers: 3\n  dim: null\n")
    cfg = load_config(params, ["train.steps=7", "optim.lr=1e-3"])
    assert cfg.model.dim == 1536  # from the mid preset (null inherits)
    assert cfg.model.n_layers == 3  # params.yaml beats the preset
    assert cfg.train.steps == 7 and cfg.optim.lr == pytest.approx(1e-3)
    assert cfg.data.seq_len == 4096


@pytest.mark.parametrize("preset", available_presets())
def test_every_preset_loads(preset: str) -> None:
    cfg = load_config(None, [f"preset={preset}"])
    assert cfg.preset == preset
    assert cfg.model.dim % cfg.model.n_heads == 0


def test_unknown_key_names_key_and_nearest() -> None:
    with pytest.raises(ConfigError, match=r"model\.dimm.*did you mean 'model\.dim'"):
        load_config(PARAMS, ["model.dimm=3"])


def test_unknown_key_in_params_file_names_file(tmp_path: Path) -> None:
    params = tmp_path / "params.yaml"
    params.write_text("train:\n  stpes: 3\n")
    with pytest.raises(ConfigError) as err:
        load_config(params)
    assert "train.stpes" in str(err.value) and "train.steps" in str(err.value)
    assert str(params) in str(err.value)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("model.dim=abc", "model.dim: expected int"),
        ("train.batch_size=1.5", "train.batch_size: expected int"),
        ("model.qk_norm=3", "model.qk_norm: expected bool"),
        ("model.variant=gpt", "model.variant: expected one of"),
        ("model.cms_periods=[4, x]", r"model.cms_periods\[1\]: expected int"),
    ],
)
def test_wrong_type_names_key_and_type(override: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        load_config(PARAMS, [override])


def test_unknown_preset_lists_valid_names() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(PARAMS, ["preset=huge"])
    for name in ("tiny", "pilot", "mid", "target"):
        assert name in str(err.value)


def test_config_error_is_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


def test_semantic_checks() -> None:
    with pytest.raises(ConfigError, match="cms_periods"):
        load_config(PARAMS, ["model.cms_periods=[4, 6]"])
    with pytest.raises(ConfigError, match="divisible"):
        load_config(PARAMS, ["model.dim=130"])


def test_float_field_accepts_int() -> None:
    assert load_config(PARAMS, ["optim.lr=1"]).optim.lr == 1.0


def test_stage_cli_reports_bad_key_without_traceback() -> None:
    proc = subprocess.run(
        [sys.executable, "stages/train.py", "--set", "model.dimm=3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "model.dimm" in proc.stderr and "model.dim'" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("preset", "nominal"), [("pilot", 160e6), ("mid", 760e6), ("target", 1.3e9)]
)
@pytest.mark.parametrize("variant", ["hope", "transformer"])
def test_paper_presets_match_the_papers_model_sizes(
    preset: str, nominal: float, variant: str
) -> None:
    import torch

    import hope

    cfg = load_config(None, [f"preset={preset}", f"model.variant={variant}"])
    with torch.device("meta"):  # sizes only: no memory is allocated
        params = hope.build_model(cfg.model).num_parameters()
    assert 0.75 * nominal < params < 1.3 * nominal, params


def test_exact_online_hope_takes_smt_chunks_off_the_cms_grid() -> None:
    coarse = ["model.smt_mem_chunk=32", "model.smt_chunk=16", "model.cms_mode=exact_online"]
    assert load_config(PARAMS, coarse).model.smt_mem_chunk == 32  # the SMT streams any split


@pytest.mark.parametrize("key", all_keys())
def test_every_knob_refuses_a_value_of_the_wrong_type_naming_itself(key: str) -> None:
    """A mapping fits no knob (every knob is a scalar, a list or a literal)."""
    with pytest.raises(ConfigError) as info:
        load_config(PARAMS, [f"{key}={{bad: 1}}"])
    assert key in str(info.value) and "\n" not in str(info.value)


# (override, what the one-line error must name): ranges and cross-field conflicts.
BAD_VALUES = [
    ("model.dim=0", "model.dim"),
    ("model.n_heads=3", "divisible"),
    ("model.cms_periods=[]", "cms_periods"),
    ("model.cms_periods=[16, 24]", "cms_periods"),
    ("model.smt_chunk=0", "smt_chunk"),
    ("model.smt_mem_chunk=24", "smt_mem_chunk"),
    ("model.titans_depth=0", "titans_depth"),
    ("model.cms_read_block=-1", "model.cms_read_block"),
    ("model.variant=titan", "model.variant"),
    ("model.cms_rule=adam", "model.cms_rule"),
    ("optim.lr=-1", "optim.lr"),
    ("data.seq_len=0", "data.seq_len"),
    ("data.val_fraction=1.5", "data.val_fraction"),
    ("train.batch_size=0", "train.batch_size"),
    ("train.micro_batch_size=64", "train.micro_batch_size"),
    ("train.keep_checkpoints=0", "train.keep_checkpoints"),
    ("train.checkpoint_every=0", "train.checkpoint_every"),
    ("train.nan_lr_factor=1.5", "train.nan_lr_factor"),
    ("train.nan_max_skips=-1", "train.nan_max_skips"),
    ("train.nan_policy=ignore", "train.nan_policy"),
    ("train.nproc_per_node=0", "train.nproc_per_node"),
    ("zeroshot.tasks=[]", "zeroshot.tasks"),
    ("zeroshot.items=0", "zeroshot.items"),
    ("zeroshot.limit=0", "zeroshot.limit"),
    ("niah.depths=[1.5]", "niah.depths"),
    ("niah.needles=9", "niah.needles"),
    ("longctx.bucket=0", "longctx.bucket"),
    ("longctx.source=web", "longctx.source"),
    ("continual.segments=[]", "continual.segments"),
    ("continual.segments=[json,json]", "continual.segments"),
    ("preset=huge", "unknown preset"),
]


@pytest.mark.parametrize(("override", "named"), BAD_VALUES, ids=[o for o, _ in BAD_VALUES])
def test_bad_values_and_conflicts_are_one_line_naming_the_knob(override: str, named: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(PARAMS, [override])
    assert named in str(info.value) and "\n" not in str(info.value)


def test_the_readme_preset_switch_command_writes_that_preset(tmp_path: Path) -> None:
    """docs/PIPELINE.md's `hope params --preset pilot --write params.yaml`, verbatim, in a copy."""
    readme = (ROOT / "docs/PIPELINE.md").read_text().split("### Configuration")[1]
    command = readme.split("```bash")[1].split("```")[0].split(" #")[0].strip()
    assert command == "hope params --preset pilot --write params.yaml"
    (tmp_path / "params.yaml").write_text(PARAMS.read_text())
    hope_bin = Path(sys.executable).parent / "hope"
    argv = [str(hope_bin), *command.split()[1:]]
    subprocess.run(argv, cwd=tmp_path, check=True, capture_output=True, text=True)
    assert load_config(tmp_path / "params.yaml") == load_config(None, ["preset=pilot"])
