"""Release bundle: build, verify, tamper detection, pickle-free reload of a real model."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

import hope
from hope.cli import run_stage
from hope.config import Config, load_config
from hope.errors import StageError
from hope.report.bundle import (
    build_bundle,
    load_released_model,
    load_weights,
    save_weights,
    split_shared,
    verify_bundle,
)
from hope.report.environment import collect_environment
from hope.train.checkpoint import save_checkpoint

ROOT = Path(__file__).resolve().parents[1]
STEP = 7
TINY = ["model.dim=32", "model.n_layers=1", "model.n_heads=2", "tokenizer.vocab_size=64"]


def tiny_cfg() -> Config:
    return load_config(ROOT / "params.yaml", [*TINY, "release.name=hope-test", "train.device=cpu"])


@pytest.fixture
def sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Config, nn.Module]:
    """A checkpoint, tokenizer and reports laid out as the pipeline leaves them, cwd = tmp_path."""
    monkeypatch.chdir(tmp_path)
    cfg = tiny_cfg()
    torch.manual_seed(0)
    model = hope.build_model(cfg.model)
    save_checkpoint(
        Path("models/checkpoints"),
        STEP,
        {"model": model.state_dict(), "config": cfg.to_dict(), "step": STEP},
    )
    Path("data/tokenizer").mkdir(parents=True)
    Path("data/tokenizer/spm.model").write_bytes(b"\x0a\x03spm-bytes")
    Path("reports").mkdir()
    Path("reports/train.json").write_text(json.dumps({"steps": STEP, "val_subset_loss": 3.25}))
    Path("reports/train_meta.json").write_text(json.dumps({"runtime": {"device": "cpu"}}))
    evaluation = {
        "val": {"loss": 3.3, "ppl": 27.1, "tokens": 4096},
        "passkey": {"len_64": {"acc": 0.5, "chance": 0.25, "true_logprob": -9.5}},
        "step": STEP,
    }
    Path("reports/eval.json").write_text(json.dumps(evaluation))
    records = {"variant": cfg.model.variant, "runtime": {"device": "cpu"}}
    Path("reports/eval_meta.json").write_text(json.dumps(records))
    Path("dvc.lock").write_text("schema: '2.0'\nstages: {}\n")
    return cfg, model


def build(cfg: Config) -> Path:
    return build_bundle(cfg, "models/checkpoints", "data/tokenizer", "reports", "release")


def release_stage(argv: list[str]) -> int:
    spec = importlib.util.spec_from_file_location("release_stage", ROOT / "stages" / "release.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = [*argv, "--params", str(ROOT / "params.yaml"), *(f"--set={o}" for o in TINY)]
    return run_stage(module.__doc__, module.body, argv=argv, extra_args=module.add_args)


def test_round_trip_gives_identical_logits(sources: tuple[Config, nn.Module]) -> None:
    cfg, model = sources
    out = build(cfg)
    assert verify_bundle(out) == []
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert files == sorted(
        [
            "MANIFEST",
            "README.md",
            "config.yaml",
            "dvc.lock",
            "environment.json",
            "metrics/eval.json",
            "metrics/eval_meta.json",
            "metrics/train.json",
            "metrics/train_meta.json",
            "model.safetensors",
            "tokenizer.model",
        ]
    )
    listed = [line.split("  ")[1] for line in (out / "MANIFEST").read_text().splitlines()]
    assert listed == sorted(f for f in files if f != "MANIFEST")
    assert (out / "tokenizer.model").read_bytes() == b"\x0a\x03spm-bytes"

    released = load_released_model(out)
    tokens = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, _ = model.eval()(tokens)
        got, _ = released(tokens)
    assert torch.equal(got, expected)

    card = (out / "README.md").read_text()
    n_params = sum(p.numel() for p in model.parameters())
    assert "# hope-test" in card and f"{n_params:,}" in card and f"`{model.cfg.variant}`" in card
    assert "acc 0.5 (chance 0.25)" in card
    env = json.loads((out / "environment.json").read_text())
    assert env["torch"] == torch.__version__ and env["device"] == "cpu"


def test_stage_verify_reports_ok_and_tampering(
    sources: tuple[Config, nn.Module], capsys: pytest.CaptureFixture[str]
) -> None:
    out = build(sources[0])
    assert release_stage(["--verify", str(out)]) == 0
    assert "ok: 10 files verified" in capsys.readouterr().out

    weights = out / "model.safetensors"
    blob = bytearray(weights.read_bytes())
    blob[-1] ^= 0x01  # one bit of one weight
    weights.write_bytes(bytes(blob))
    assert verify_bundle(out) == ["changed: model.safetensors"]
    assert release_stage(["--verify", str(out)]) == 2
    assert "changed: model.safetensors" in capsys.readouterr().out
    with pytest.raises(StageError, match="changed: model.safetensors"):
        load_released_model(out)


def test_missing_and_unlisted_files_are_named(sources: tuple[Config, nn.Module]) -> None:
    out = build(sources[0])
    (out / "tokenizer.model").unlink()
    (out / "extra.bin").write_bytes(b"\x00")
    assert verify_bundle(out) == ["missing: tokenizer.model", "unlisted: extra.bin"]
    (out / "MANIFEST").unlink()
    assert verify_bundle(out) == ["missing: MANIFEST"]


def test_manifest_cannot_drop_a_required_file(sources: tuple[Config, nn.Module]) -> None:
    out = build(sources[0])
    (out / "config.yaml").unlink()
    manifest = out / "MANIFEST"
    kept = [ln for ln in manifest.read_text().splitlines() if not ln.endswith("  config.yaml")]
    manifest.write_text("\n".join(kept) + "\nnot a manifest line\n")
    assert verify_bundle(out) == ["malformed: MANIFEST line 10", "missing: config.yaml"]


def test_rebuild_replaces_old_bundle_atomically(sources: tuple[Config, nn.Module]) -> None:
    cfg, _ = sources
    out = build(cfg)
    (out / "stale.txt").write_text("from an older release")
    build(cfg)
    assert not (out / "stale.txt").exists() and verify_bundle(out) == []
    assert [p.name for p in Path(".").iterdir() if p.name.startswith(".release")] == []


def test_missing_input_fails_cleanly_and_keeps_old_bundle(
    sources: tuple[Config, nn.Module],
) -> None:
    cfg, _ = sources
    out = build(cfg)
    Path("reports/train.json").unlink()
    with pytest.raises(StageError, match="reports/train.json not found"):
        build(cfg)
    assert verify_bundle(out) == []  # the previous bundle is untouched
    assert [p.name for p in Path(".").iterdir() if p.name.startswith(".release")] == []


def test_stale_eval_report_is_refused(sources: tuple[Config, nn.Module]) -> None:
    cfg, _ = sources
    data = json.loads(Path("reports/eval.json").read_text())
    Path("reports/eval.json").write_text(json.dumps({**data, "step": STEP - 1}))
    with pytest.raises(StageError, match="step 6 but the latest checkpoint is step 7"):
        build(cfg)


def test_eval_records_of_another_variant_or_missing_are_refused(
    sources: tuple[Config, nn.Module],
) -> None:
    cfg, _ = sources
    meta = Path("reports/eval_meta.json")
    meta.write_text(json.dumps({"variant": "titans_mac", "runtime": {}}))
    with pytest.raises(StageError, match="eval_meta.json is for variant 'titans_mac'"):
        build(cfg)
    meta.unlink()
    with pytest.raises(StageError, match="eval_meta.json not found; run `python stages/eval.py`"):
        build(cfg)


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied: one tensor, two state_dict names
        window = torch.arange(12.0)
        self.register_buffer("window", window)
        self.register_buffer("upper", window[6:])  # overlaps part of another storage


def test_tied_weights_are_stored_once_and_restored(tmp_path: Path) -> None:
    torch.manual_seed(0)
    source = TiedLM()
    tensors, aliases = split_shared(source.state_dict())
    assert aliases == {"head.weight": "embed.weight"}
    assert set(tensors) == {"embed.weight", "window", "upper"}
    path = tmp_path / "w.safetensors"
    save_weights(source, path)
    with safe_open(str(path), framework="pt") as handle:
        assert sorted(handle.keys()) == ["embed.weight", "upper", "window"]
    target = TiedLM()
    load_weights(target, path)
    assert torch.equal(target.embed.weight, source.embed.weight)
    assert target.head.weight is target.embed.weight  # the tie survives loading
    assert torch.equal(target.get_buffer("upper"), torch.arange(6.0, 12.0))


def test_environment_record_has_no_volatile_fields() -> None:
    env = collect_environment("cpu", cwd=ROOT)
    assert env == collect_environment("cpu", cwd=ROOT)
    for key in ("python", "torch", "platform", "cpu", "device", "git_commit"):
        assert key in env


def test_saved_weights_are_byte_identical_across_saves(
    sources: tuple[Config, nn.Module], tmp_path: Path
) -> None:
    """The safetensors writer orders ``__metadata__`` from a hash map that changes per
    save (13 orders in 20 saves of one 4-key header): the header is made canonical, so
    identical weights and metadata give identical bytes, and they still load."""
    _, model = sources
    meta = {"hope.step": "7", "hope.variant": "hope", "z": "1", "a": "2"}
    blobs = set()
    for i in range(8):
        save_weights(model, tmp_path / f"w{i}.safetensors", meta)
        blobs.add((tmp_path / f"w{i}.safetensors").read_bytes())
    assert len(blobs) == 1
    blob = blobs.pop()
    size = int.from_bytes(blob[:8], "little")
    assert size % 8 == 0 and list(json.loads(blob[8 : 8 + size])["__metadata__"]) == sorted(
        {**meta, "format": "pt", "hope.aliases": ""}
    )
    clone = copy.deepcopy(model)
    for param in clone.parameters():
        param.data.zero_()
    load_weights(clone, tmp_path / "w0.safetensors")
    for a, b in zip(model.state_dict().values(), clone.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_zeroshot_reports_are_carried_with_the_card_line(
    sources: tuple[Config, nn.Module],
) -> None:
    cfg, _ = sources
    row = {"acc": 0.375, "acc_stderr": 0.06, "n": 64}
    Path("reports/zeroshot.json").write_text(json.dumps({"hope_choice": row, "step": STEP}))
    Path("reports/zeroshot_meta.json").write_text(json.dumps({"lm_eval": "0.4.13"}))
    out = build(cfg)
    assert verify_bundle(out) == []
    assert json.loads((out / "metrics/zeroshot.json").read_text())["hope_choice"] == row
    assert (out / "metrics/zeroshot_meta.json").is_file()
    assert "- zero-shot `hope_choice` (lm-eval): acc 0.375, n 64" in (out / "README.md").read_text()
    niah = {"s_niah_1": {"len_160": {"acc": 0.5, "chance": 0.25}}, "step": STEP}
    Path("reports/niah.json").write_text(json.dumps(niah))
    out = build(cfg)
    assert json.loads((out / "metrics/niah.json").read_text()) == niah
    assert "- needle in a haystack `s_niah_1`: 160 tokens 0.5" in (out / "README.md").read_text()
