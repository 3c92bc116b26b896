"""Tokenizer training (deterministic, lossless, coverage) and token shards (round trip, checks)."""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hope.config import Config, TokenizerConfig
from hope.data import shards as shards_module
from hope.data.download import iter_jsonl_texts, run_download
from hope.data.shards import ShardedTokens, load_split, token_dtype, write_shards
from hope.data.tokenizer import SPECIAL_IDS, load_tokenizer, measure_coverage, train_tokenizer
from hope.errors import StageError
from hope.io import sha256_file

REPO = Path(__file__).resolve().parents[1]
SMALL_BPE = TokenizerConfig(model_type="bpe", vocab_size=512)
SMALL_UNIGRAM = TokenizerConfig(model_type="unigram", vocab_size=512)


@pytest.fixture(scope="module")
def raw_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~200 KB of the builtin corpus: the first 40 pydoc topics."""
    cfg = Config()
    cfg.data.max_documents = 40
    cfg.data.val_fraction = 0.2
    out = tmp_path_factory.mktemp("raw")
    run_download(cfg, out)
    return out


@pytest.fixture(scope="module")
def tok_dir(raw_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(SMALL_BPE, raw_dir / "train.jsonl", out, val_jsonl=raw_dir / "val.jsonl")
    return out


@pytest.fixture(scope="module")
def shard_dir(raw_dir: Path, tok_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("shards")
    write_shards(tok_dir / "spm.model", raw_dir, out, shard_tokens=5000)
    return out


def texts(raw_dir: Path, split: str) -> list[str]:
    return list(iter_jsonl_texts(raw_dir / f"{split}.jsonl"))


# ---------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("tok_cfg", [SMALL_BPE, SMALL_UNIGRAM], ids=["bpe", "unigram"])
def test_tokenizer_is_byte_identical_across_runs(
    raw_dir: Path, tmp_path: Path, tok_cfg: TokenizerConfig
) -> None:
    first = train_tokenizer(tok_cfg, raw_dir / "train.jsonl", tmp_path / "a")
    second = train_tokenizer(tok_cfg, raw_dir / "train.jsonl", tmp_path / "b")
    for name in ("spm.model", "spm.vocab"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert first["model_sha256"] == second["model_sha256"]
    assert first["model_sha256"] == sha256_file(tmp_path / "a" / "spm.model")
    assert first["vocab_size"] == 512
    assert str(tmp_path) not in (tmp_path / "a" / "spm.model").read_bytes().decode("latin-1")


def test_tokenizer_ids_and_lossless_round_trip(raw_dir: Path, tok_dir: Path) -> None:
    sp = load_tokenizer(tok_dir / "spm.model")
    ids = {
        "unk_id": sp.unk_id(),
        "bos_id": sp.bos_id(),
        "eos_id": sp.eos_id(),
        "pad_id": sp.pad_id(),
    }
    assert ids == SPECIAL_IDS
    samples = texts(raw_dir, "train")[:10] + texts(raw_dir, "val") + ["  x\n\tý 漢字 2024\n"]
    for text in samples:
        assert sp.decode(sp.encode(text)) == text
    assert sp.vocab_size() == 512
    # Newlines are learned pieces, not byte fallback: docstrings are full of them.
    assert sp.piece_to_id("\n") not in (sp.unk_id(), *range(4, 260))


def test_coverage_report(raw_dir: Path, tok_dir: Path) -> None:
    coverage = json.loads((tok_dir / "coverage.json").read_text())
    val = texts(raw_dir, "val")
    assert coverage["documents"] == len(val)
    assert coverage["chars"] == sum(len(t) for t in val)
    sp = load_tokenizer(tok_dir / "spm.model")
    tokens = sum(len(sp.encode(t)) for t in val)
    assert coverage["tokens"] == tokens
    assert coverage["tokens_per_char"] == pytest.approx(tokens / coverage["chars"])
    assert 0.99 < coverage["char_coverage"] <= 1.0
    assert coverage["unk_rate"] == 0.0  # byte fallback on: nothing is unknown
    assert coverage["bytes_per_token"] > 1.5


@pytest.mark.parametrize("byte_fallback", [True, False])
def test_coverage_counts_unseen_characters_exactly(
    raw_dir: Path, tmp_path: Path, byte_fallback: bool
) -> None:
    cfg = TokenizerConfig(model_type="bpe", vocab_size=512 if byte_fallback else 300)
    cfg.byte_fallback = byte_fallback
    train_tokenizer(cfg, raw_dir / "train.jsonl", tmp_path)
    sp = load_tokenizer(tmp_path / "spm.model")
    text = "the value is 漢字漢字 here"  # 漢, 字 never occur in the pydoc topics
    report = measure_coverage(sp, [text])
    assert report["char_coverage"] == pytest.approx(1 - 4 / len(text))
    assert (report["unk_rate"] > 0) is (not byte_fallback)
    assert (report["byte_fallback_rate"] > 0) is byte_fallback


def test_tokenizer_vocab_too_large_names_the_knob(raw_dir: Path, tmp_path: Path) -> None:
    cfg = TokenizerConfig(model_type="unigram", vocab_size=60_000)
    with pytest.raises(StageError, match=r"tokenizer\.vocab_size=60000.*too high"):
        train_tokenizer(cfg, raw_dir / "train.jsonl", tmp_path)
    assert not (tmp_path / "spm.model").exists()


def test_load_tokenizer_missing_or_corrupt(tmp_path: Path) -> None:
    with pytest.raises(StageError, match=r"nope\.model not found"):
        load_tokenizer(tmp_path / "nope.model")
    (tmp_path / "bad.model").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(StageError, match=r"bad\.model is corrupt"):
        load_tokenizer(tmp_path / "bad.model")


# ---------------------------------------------------------------- shards


def test_token_dtype_follows_vocab_size() -> None:
    assert token_dtype(4096) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32


def test_shards_round_trip_to_the_documents(raw_dir: Path, tok_dir: Path, shard_dir: Path) -> None:
    sp = load_tokenizer(tok_dir / "spm.model")
    for split in ("train", "val"):
        tokens = load_split(shard_dir, split, tok_dir / "spm.model")
        stream = tokens.window(0, tokens.num_tokens)
        ends = np.flatnonzero(stream == sp.eos_id())
        assert ends[-1] == stream.size - 1  # every document, the last too, ends with EOS
        docs = np.split(stream, ends + 1)[:-1]
        assert [sp.decode(d[:-1].tolist()) for d in docs] == texts(raw_dir, split)


def test_shard_manifest_numbers(raw_dir: Path, tok_dir: Path, shard_dir: Path) -> None:
    manifest = json.loads((shard_dir / "manifest.json").read_text())
    sp = load_tokenizer(tok_dir / "spm.model")
    assert manifest["tokenizer_sha256"] == sha256_file(tok_dir / "spm.model")
    assert (manifest["vocab_size"], manifest["dtype"], manifest["eos_id"]) == (512, "uint16", 2)
    for split in ("train", "val"):
        docs = texts(raw_dir, split)
        entry = manifest["splits"][split]
        assert entry["documents"] == len(docs)
        assert entry["tokens"] == sum(len(sp.encode(t)) + 1 for t in docs)
        assert entry["raw_sha256"] == sha256_file(raw_dir / f"{split}.jsonl")
        names = [s["file"] for s in entry["shards"]]
        assert names == [f"{split}_{i:05d}.bin" for i in range(len(names))]
        assert all(s["tokens"] == 5000 for s in entry["shards"][:-1])
        assert 0 < entry["shards"][-1]["tokens"] <= 5000
        assert sum(s["tokens"] for s in entry["shards"]) == entry["tokens"]
        for shard in entry["shards"]:
            path = shard_dir / shard["file"]
            assert path.stat().st_size == 2 * shard["tokens"]
            assert sha256_file(path) == shard["sha256"]
    assert len(manifest["splits"]["train"]["shards"]) > 3


def test_shard_size_does_not_change_the_stream(
    raw_dir: Path, tok_dir: Path, shard_dir: Path, tmp_path: Path
) -> None:
    write_shards(tok_dir / "spm.model", raw_dir, tmp_path, shard_tokens=1 << 20)
    whole, cut = load_split(tmp_path, "train"), load_split(shard_dir, "train")
    assert len(whole.arrays) == 1 and len(cut.arrays) > 3
    assert np.array_equal(whole.window(0, whole.num_tokens), cut.window(0, cut.num_tokens))
    assert np.array_equal(cut.window(4990, 20), whole.window(4990, 20))  # crosses a file edge
    # Rewriting with bigger shards removes the stale extra files.
    write_shards(tok_dir / "spm.model", raw_dir, shard_dir, shard_tokens=1 << 20)
    assert sorted(p.name for p in shard_dir.glob("*.bin")) == ["train_00000.bin", "val_00000.bin"]
    write_shards(tok_dir / "spm.model", raw_dir, shard_dir, shard_tokens=5000)


@pytest.fixture
def shard_copy(shard_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "shards"
    shutil.copytree(shard_dir, copy)
    return copy


def test_disk_full_during_sharding_leaves_no_partial_file(
    raw_dir: Path, tok_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real, calls = shards_module._ShardWriter.write, [0]

    def write(self, tokens):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 2:  # one batch is on disk, then the disk fills
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, tokens)

    monkeypatch.setattr(shards_module._ShardWriter, "write", write)
    with pytest.raises(StageError, match=r"(train|val)_\*\.bin: no space left on the device"):
        write_shards(tok_dir / "spm.model", raw_dir, tmp_path, shard_tokens=5000)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert not [n for n in left if n.endswith(".tmp")] and "manifest.json" not in left
    with pytest.raises(StageError, match="manifest"):  # nothing half-written is readable
        load_split(tmp_path, "train")


def test_corrupt_shard_is_named(shard_copy: Path) -> None:
    path = shard_copy / "train_00001.bin"
    blob = bytearray(path.read_bytes())
    blob[101] ^= 0x01
    path.write_bytes(bytes(blob))
    with pytest.raises(StageError, match=r"train_00001\.bin is corrupt: sha256 mismatch"):
        load_split(shard_copy, "train")
    assert load_split(shard_copy, "train", verify_hash=False).num_tokens > 0
    load_split(shard_copy, "val")  # the other split is untouched


def test_truncated_and_missing_shards_are_named(shard_copy: Path) -> None:
    path = shard_copy / "train_00002.bin"
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(StageError, match=r"train_00002\.bin is corrupt: 9998 bytes"):
        load_split(shard_copy, "train", verify_hash=False)
    path.unlink()
    with pytest.raises(StageError, match=r"train_00002\.bin is missing"):
        load_split(shard_copy, "train")
    (shard_copy / "manifest.json").unlink()
    with pytest.raises(StageError, match=r"manifest\.json not found"):
        load_split(shard_copy, "train")


def test_wrong_tokenizer_is_refused(
    raw_dir: Path, shard_dir: Path, tok_dir: Path, tmp_path: Path
) -> None:
    other = TokenizerConfig(model_type="bpe", vocab_size=400)
    train_tokenizer(other, raw_dir / "train.jsonl", tmp_path)
    with pytest.raises(StageError, match=r"another tokenizer than .*tmp.*spm\.model"):
        load_split(shard_dir, "val", tmp_path / "spm.model")
    assert load_split(shard_dir, "val", tok_dir / "spm.model").num_tokens > 0


def test_sharded_tokens_window_bounds() -> None:
    tokens = ShardedTokens([np.arange(3, dtype=np.uint16), np.arange(3, 7, dtype=np.uint16)])
    assert tokens.num_tokens == 7
    assert tokens.window(1, 5).tolist() == [1, 2, 3, 4, 5]
    assert tokens.window(1, 5).dtype == np.int64
    with pytest.raises(IndexError):
        tokens.window(3, 5)


# ---------------------------------------------------------------- stages


def test_tokenizer_and_shard_stages(raw_dir: Path, tmp_path: Path) -> None:
    shutil.copytree(raw_dir, tmp_path / "data" / "raw")
    overrides = ["--set", "tokenizer.model_type=bpe", "--set", "tokenizer.vocab_size=512"]
    for stage in ("tokenizer", "shard"):
        result = subprocess.run(
            [
                sys.executable,
                str(REPO / "stages" / f"{stage}.py"),
                "--params",
                str(REPO / "params.yaml"),
                *overrides,
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
    data = tmp_path / "data"
    assert {p.name for p in (data / "tokenizer").iterdir()} == {
        "spm.model",
        "spm.vocab",
        "coverage.json",
        "config.yaml",
    }
    tokens = load_split(data / "shards", "train", data / "tokenizer" / "spm.model")
    assert tokens.num_tokens > 10_000
    assert (data / "shards" / "config.yaml").is_file()


def test_shard_stage_without_tokenizer_exits_2(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "stages" / "shard.py"), "--params", str(REPO / "params.yaml")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: tokenizer data/tokenizer/spm.model not found; run `python stages/tokenizer.py`"
    ]


def test_tokenizer_without_raw_data_says_which_stage_to_run(tmp_path: Path) -> None:
    with pytest.raises(StageError, match=r"train\.jsonl not found; run `python stages/download"):
        train_tokenizer(SMALL_BPE, tmp_path / "train.jsonl", tmp_path / "tok")
