"""The download stage: sources (builtin, local, hf), filters, dedup, the split, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from hope.config import Config, load_config
from hope.data.download import is_val_document, iter_jsonl_texts, run_download
from hope.data.sources import (
    SKIP_DIRS,
    builtin_documents,
    local_documents,
    module_docstrings,
    stdlib_sources,
)
from hope.errors import StageError
from hope.io import sha256_file

REPO = Path(__file__).resolve().parents[1]


def make_cfg(**data: object) -> Config:
    cfg = Config()
    for key, value in data.items():
        setattr(cfg.data, key, value)
    return cfg


def split_texts(raw_dir: Path) -> tuple[list[str], list[str]]:
    return list(iter_jsonl_texts(raw_dir / "train.jsonl")), list(
        iter_jsonl_texts(raw_dir / "val.jsonl")
    )


def words(i: int, n: int = 20) -> str:
    """A distinct, readable document number ``i`` of ``n`` words."""
    return " ".join(f"w{i}x{j}" for j in range(n))


# ---------------------------------------------------------------- builtin


def test_builtin_corpus_is_deterministic_and_over_a_megabyte(tmp_path: Path) -> None:
    first = run_download(make_cfg(), tmp_path / "a")
    second = run_download(make_cfg(), tmp_path / "b")
    assert first == second
    for split in ("train", "val"):
        assert sha256_file(tmp_path / "a" / f"{split}.jsonl") == first["splits"][split]["sha256"]
        assert (tmp_path / "a" / f"{split}.jsonl").read_bytes() == (
            tmp_path / "b" / f"{split}.jsonl"
        ).read_bytes()
    total = first["splits"]["train"]["bytes"] + first["splits"]["val"]["bytes"]
    assert total >= 1_000_000
    assert first["splits"]["train"]["documents"] > 300
    counts = first["counts"]
    kept = first["splits"]["train"]["documents"] + first["splits"]["val"]["documents"]
    dropped = counts["dropped_short"] + counts["dropped_long"] + counts["dropped_duplicate"]
    assert counts["read"] == kept + dropped
    assert yaml_keys(tmp_path / "a" / "config.yaml") >= {"data", "tokenizer", "model"}


def yaml_keys(path: Path) -> set[str]:
    import yaml

    return set(yaml.safe_load(path.read_text()))


def test_stdlib_walk_skips_tests_and_is_sorted() -> None:
    paths = stdlib_sources()
    root = Path(__import__("sysconfig").get_paths()["stdlib"])
    rel = [p.relative_to(root).as_posix() for p in paths]
    assert rel == sorted(rel)
    assert "json/__init__.py" in rel and "os.py" in rel
    assert not any(set(Path(r).parts) & SKIP_DIRS for r in rel)
    assert not any(r.startswith("idlelib/idle_test") for r in rel)


def test_module_docstrings_parses_without_running_code() -> None:
    source = b'''"""Module doc."""
raise SystemExit("executing this file is a bug")


class Thing:
    """Class doc."""

    def method(self):
        """Method doc."""


async def fetch():
    """Async doc."""
'''
    assert module_docstrings(source) == "Module doc.\n\nClass doc.\n\nMethod doc.\n\nAsync doc."


def test_builtin_starts_with_pydoc_topics() -> None:
    from pydoc_data.topics import topics

    first = next(builtin_documents())
    assert first == topics[sorted(topics)[0]]


# ---------------------------------------------------------------- filters and split


def test_filters_and_dedup_are_counted(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    docs = {
        "a_short.txt": "too short",
        "b_long.txt": "x" * 500,
        "c_ok.txt": words(1),
        "d_dup.txt": "  \n" + words(1) + "\n\n",  # same text once stripped
        "e_ok.txt": words(2),
        "f_dup.txt": words(2),
        "g_ok.txt": words(3),
    }
    for name, text in docs.items():
        (corpus / name).write_text(text)
    cfg = make_cfg(source="local", local_glob=str(corpus / "*.txt"), min_chars=20, max_chars=400)
    cfg.data.val_fraction = 0.0
    manifest = run_download(cfg, tmp_path / "raw")
    assert manifest["counts"] == {
        "read": 7,
        "dropped_short": 1,
        "dropped_long": 1,
        "dropped_duplicate": 2,
    }
    train, val = split_texts(tmp_path / "raw")
    assert train == [words(1), words(2), words(3)] and val == []
    assert manifest["splits"]["train"]["chars"] == sum(len(t) for t in train)

    cfg.data.dedup = False
    manifest = run_download(cfg, tmp_path / "raw2")
    assert manifest["counts"]["dropped_duplicate"] == 0
    assert manifest["splits"]["train"]["documents"] == 5


def test_max_chars_zero_means_no_limit(tmp_path: Path) -> None:
    (tmp_path / "big.txt").write_text("y " * 5000)
    cfg = make_cfg(source="local", local_glob=str(tmp_path / "*.txt"), max_chars=0)
    cfg.data.val_fraction = 0.0
    assert run_download(cfg, tmp_path / "raw")["splits"]["train"]["documents"] == 1


def test_split_is_deterministic_disjoint_and_order_free(tmp_path: Path) -> None:
    texts = [words(i) for i in range(2000)]
    for name, order in (("fwd", texts), ("rev", texts[::-1])):
        (tmp_path / f"{name}.jsonl").write_text(
            "".join(json.dumps({"text": t}) + "\n" for t in order)
        )
    results = {}
    for name in ("fwd", "rev"):
        cfg = make_cfg(source="local", local_glob=str(tmp_path / f"{name}.jsonl"), min_chars=1)
        cfg.data.val_fraction = 0.2
        run_download(cfg, tmp_path / name)
        results[name] = tuple(set(s) for s in split_texts(tmp_path / name))
    train, val = results["fwd"]
    assert results["rev"] == (train, val)
    assert not train & val and len(train | val) == 2000
    # Binomial(2000, 0.2): mean 400, sd ~18; the hash split should land near it.
    assert 320 < len(val) < 480
    assert val == {t for t in texts if is_val_document(t, 0, 0.2)}
    other_seed = {t for t in texts if is_val_document(t, 1, 0.2)}
    assert other_seed != val


def test_empty_validation_split_is_an_error(tmp_path: Path) -> None:
    text = next(words(i) for i in range(100) if not is_val_document(words(i), 0, 0.05))
    (tmp_path / "one.txt").write_text(text)
    cfg = make_cfg(source="local", local_glob=str(tmp_path / "*.txt"), min_chars=1)
    with pytest.raises(StageError, match="data.val_fraction"):
        run_download(cfg, tmp_path / "raw")
    assert not (tmp_path / "raw" / "train.jsonl").exists()
    assert not list((tmp_path / "raw").glob(".*.tmp"))


# ---------------------------------------------------------------- local


def test_local_reads_txt_jsonl_and_parquet_in_sorted_order(tmp_path: Path) -> None:
    (tmp_path / "c.txt").write_text("from text file\n")
    (tmp_path / "a.jsonl").write_text(
        json.dumps({"body": "jsonl one"}) + "\n\n" + json.dumps({"body": "jsonl two"}) + "\n"
    )
    pd.DataFrame({"body": ["parquet one", "parquet two", None]}).to_parquet(tmp_path / "b.parquet")
    docs = list(local_documents(str(tmp_path / "*"), column="body"))
    # A null parquet cell becomes "", which the download stage drops as too short.
    assert docs == ["jsonl one", "jsonl two", "parquet one", "parquet two", "", "from text file\n"]


def test_local_errors_name_the_glob_or_file(tmp_path: Path) -> None:
    with pytest.raises(StageError, match="matches no files"):
        list(local_documents(str(tmp_path / "none*.txt")))
    with pytest.raises(StageError, match="local_glob"):
        list(local_documents(""))
    (tmp_path / "doc.csv").write_text("a,b\n")
    with pytest.raises(StageError, match=r"doc\.csv.*unknown file type"):
        list(local_documents(str(tmp_path / "*.csv")))
    (tmp_path / "bad.jsonl").write_text(json.dumps({"content": "x"}) + "\n")
    with pytest.raises(StageError, match=r"bad\.jsonl:1.*'text'"):
        list(local_documents(str(tmp_path / "bad.jsonl")))
    pd.DataFrame({"content": ["x"]}).to_parquet(tmp_path / "bad.parquet")
    with pytest.raises(StageError, match=r"bad\.parquet.*no column 'text'"):
        list(local_documents(str(tmp_path / "bad.parquet")))


# ---------------------------------------------------------------- hf


@pytest.fixture
def hf_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Small parquet/jsonl data; datasets' cache (and its lock files) kept in tmp_path."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    texts = [words(i) for i in range(30)]
    folder = tmp_path / "hfdata"
    folder.mkdir()
    pd.DataFrame({"text": texts, "id": range(30)}).to_parquet(folder / "part.parquet")
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return tmp_path


@pytest.mark.parametrize("target", ["hfdata/part.parquet", "rows.jsonl", "hfdata"])
def test_hf_source_loads_local_data_with_max_documents(hf_files: Path, target: str) -> None:
    streaming = target != "rows.jsonl"  # cover the non-streaming path once
    cfg = make_cfg(
        source="hf", hf_name=str(hf_files / target), streaming=streaming, max_documents=12
    )
    cfg.data.min_chars = 1
    cfg.data.val_fraction = 0.5
    manifest = run_download(cfg, hf_files / "raw")
    assert manifest["counts"]["read"] == 12
    train, val = split_texts(hf_files / "raw")
    assert sorted(train + val) == sorted(words(i) for i in range(12))
    assert manifest["source"]["kind"] == "hf"


def test_a_streamed_hf_download_resumes_from_the_dataset_state(
    hf_files: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A streamed dataset that fails after 23 rows (resume points every 10): the rerun
    hands the recorded ``state_dict()`` back to the dataset, which yields row 20 next —
    the 20 rows already read are not read again — and the result is the uninterrupted
    run's, byte for byte (max_documents counted across the break)."""
    import hope.data.download as download
    from hope.data.sources import StreamedTexts

    monkeypatch.setattr(download, "PROGRESS_EVERY", 10)
    cfg = make_cfg(source="hf", hf_name=str(hf_files / "hfdata"), streaming=True)
    cfg.data.min_chars, cfg.data.val_fraction, cfg.data.max_documents = 1, 0.3, 27
    whole = run_download(cfg, hf_files / "whole")

    original = StreamedTexts.__next__
    rows: list[str] = []

    def counted(self: StreamedTexts) -> str:
        text = original(self)
        rows.append(text)
        return text

    def failing(self: StreamedTexts) -> str:
        if len(rows) == 23:
            raise ConnectionError("the hub went away")
        return counted(self)

    monkeypatch.setattr(StreamedTexts, "__next__", failing)
    with pytest.raises(ConnectionError):
        run_download(cfg, hf_files / "raw")
    progress = json.loads((hf_files / "raw/.progress.json").read_text())
    assert progress["counts"]["read"] == 20 and progress["source_state"] is not None

    rows.clear()
    monkeypatch.setattr(StreamedTexts, "__next__", counted)
    resumed = run_download(cfg, hf_files / "raw")
    assert rows[0] == words(20) and len(rows) == 7  # rows 20..26, nothing twice
    for split in ("train", "val"):
        assert sha256_file(hf_files / f"raw/{split}.jsonl") == sha256_file(
            hf_files / f"whole/{split}.jsonl"
        )
    assert resumed["counts"] == whole["counts"] and resumed["counts"]["read"] == 27


def test_hf_source_missing_column_is_named(hf_files: Path) -> None:
    cfg = make_cfg(source="hf", hf_name=str(hf_files / "hfdata/part.parquet"), text_column="body")
    with pytest.raises(StageError, match="data.text_column='body'.*columns: text, id"):
        run_download(cfg, hf_files / "raw")


def assert_fails_fast_offline(cfg: Config, tmp_path: Path) -> str:
    started = time.perf_counter()
    with pytest.raises(StageError) as err:
        run_download(cfg, tmp_path / "raw")
    assert time.perf_counter() - started < 15
    message = str(err.value)
    assert "no network access to the Hugging Face hub" in message
    assert "data.source=local" in message and "data.source=builtin" in message
    return message


def test_hf_offline_env_fails_fast(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    message = assert_fails_fast_offline(make_cfg(source="hf"), tmp_path)
    assert "HF_HUB_OFFLINE=1" in message


def test_hf_unreachable_endpoint_fails_fast(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    message = assert_fails_fast_offline(make_cfg(source="hf"), tmp_path)
    assert "127.0.0.1:9" in message


# ---------------------------------------------------------------- stage CLI


def run_stage_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPO / "stages" / "download.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_stage_bad_key_exits_2_with_one_line(tmp_path: Path) -> None:
    result = run_stage_cli(
        "--params", str(REPO / "params.yaml"), "--set", "data.sorce=hf", cwd=tmp_path
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "data.sorce" in lines[0]
    assert not (tmp_path / "data").exists()


def test_stage_writes_raw_outputs(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    for i in range(40):
        (tmp_path / "docs" / f"{i:02d}.txt").write_text(words(i, 30))
    result = run_stage_cli(
        "--params",
        str(REPO / "params.yaml"),
        "--set",
        "data.source=local",
        "--set",
        "data.local_glob=docs/*.txt",
        "--set",
        "data.val_fraction=0.25",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    raw = tmp_path / "data" / "raw"
    manifest = json.loads((raw / "manifest.json").read_text())
    assert manifest["counts"]["read"] == 40
    assert sum(manifest["splits"][s]["documents"] for s in ("train", "val")) == 40
    assert load_config(raw / "config.yaml").data.local_glob == "docs/*.txt"


# ---------------------------------------------------------------- resume


def test_an_interrupted_download_resumes_to_the_uninterrupted_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A source that fails after 47 documents (resume points every 10): the rerun cuts
    the partial files back to the 40-document point, skips what was read and ends
    byte for byte as a run that was never interrupted; dedup keys survive the resume."""
    import hope.data.download as download

    texts = [words(i % 60) for i in range(90)]  # 30 duplicates, some after the break
    cfg = make_cfg(source="builtin", min_chars=1, val_fraction=0.3)
    monkeypatch.setattr(download, "PROGRESS_EVERY", 10)
    monkeypatch.setattr(download, "iter_documents", lambda _cfg, _state=None: iter(texts))
    whole = run_download(cfg, tmp_path / "whole")

    def failing(_cfg: object, _state: object = None) -> object:
        for i, text in enumerate(texts):
            if i == 47:
                raise ConnectionError("the source went away")
            yield text

    monkeypatch.setattr(download, "iter_documents", failing)
    with pytest.raises(ConnectionError):
        run_download(cfg, tmp_path / "raw")
    progress = json.loads((tmp_path / "raw/.progress.json").read_text())
    assert progress["counts"]["read"] == 40
    partial = tmp_path / "raw/.train.jsonl.partial"
    assert partial.stat().st_size > progress["splits"]["train"]["offset"]  # 7 rows past it

    monkeypatch.setattr(download, "iter_documents", lambda _cfg, _state=None: iter(texts))
    resumed = run_download(cfg, tmp_path / "raw")
    for split in ("train", "val"):
        assert sha256_file(tmp_path / f"raw/{split}.jsonl") == sha256_file(
            tmp_path / f"whole/{split}.jsonl"
        )
    assert resumed["counts"] == whole["counts"] and resumed["splits"] == whole["splits"]
    assert resumed["counts"]["dropped_duplicate"] == 30
    assert sorted(p.name for p in (tmp_path / "raw").iterdir()) == sorted(
        p.name for p in (tmp_path / "whole").iterdir()
    )  # no progress or partial file left


def test_a_changed_filter_starts_the_download_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hope.data.download as download

    texts = [words(i) for i in range(30)]
    monkeypatch.setattr(download, "PROGRESS_EVERY", 10)

    def failing(_cfg: object, _state: object = None) -> object:
        yield from texts[:25]
        raise ConnectionError("gone")

    monkeypatch.setattr(download, "iter_documents", failing)
    with pytest.raises(ConnectionError):
        run_download(make_cfg(source="builtin", min_chars=1, val_fraction=0.3), tmp_path / "raw")
    monkeypatch.setattr(download, "iter_documents", lambda _cfg, _state=None: iter(texts))
    other = make_cfg(source="builtin", min_chars=1, val_fraction=0.5)
    manifest = run_download(other, tmp_path / "raw")
    assert manifest["counts"]["read"] == 30
    assert manifest == run_download(other, tmp_path / "fresh") | {"source": manifest["source"]}
