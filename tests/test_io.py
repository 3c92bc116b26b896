"""Metrics files for DVC: numbers only, records beside them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hope.io import meta_path, non_numbers, split_non_numbers, split_records, write_metrics


def test_non_numbers_names_every_leaf_a_metrics_table_cannot_hold() -> None:
    report = {
        "val": {"loss": 3.5, "tokens": 4096, "bpb": None},
        "variant": "hope",
        "curve": [[1, 0.5]],
        "ok": True,
        "passkey": {"len_64": {"acc": 0.25, "note": "x"}},
    }
    assert non_numbers(report) == ["variant", "curve", "ok", "passkey.len_64.note"]
    assert non_numbers({"a": {"b": 1, "c": 2.5}}) == []
    assert non_numbers("text") == ["<root>"]


def test_write_metrics_splits_records_and_refuses_non_numbers(tmp_path: Path) -> None:
    report = {"step": 7, "val": {"loss": 3.5}, "variant": "hope", "runtime": {"device": "cpu"}}
    metrics, records = split_records(report, ("variant", "runtime"))
    path = tmp_path / "eval.json"
    write_metrics(path, metrics, records)
    assert meta_path(path) == tmp_path / "eval_meta.json"
    assert json.loads(path.read_text()) == {"step": 7, "val": {"loss": 3.5}}
    assert json.loads(meta_path(path).read_text()) == {
        "variant": "hope",
        "runtime": {"device": "cpu"},
    }

    with pytest.raises(ValueError, match=r"eval\.json: metrics must be numbers only; move variant"):
        write_metrics(path, report, {})
    assert json.loads(path.read_text()) == {"step": 7, "val": {"loss": 3.5}}  # untouched


def test_split_non_numbers_keeps_the_nesting_on_both_sides() -> None:
    tree = {"fit": {"slope": 2.0, "lengths": [256, 512]}, "name": "x", "n": 3, "empty": {}}
    numbers, rest = split_non_numbers(tree)
    assert numbers == {"fit": {"slope": 2.0}, "n": 3, "empty": {}}
    assert rest == {"fit": {"lengths": [256, 512]}, "name": "x"}
