"""The papers' tables from several runs (hope.report.tables)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from hope.report.tables import main


def _run(root: Path, sub: str, zeroshot: dict, niah: dict) -> Path:
    (root / sub).mkdir(parents=True)
    (root / sub / "zeroshot.json").write_text(json.dumps(zeroshot))
    (root / sub / "niah.json").write_text(json.dumps(niah))
    return root


def test_table1_and_table2_from_a_checkout_and_a_bundle(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paper = _run(
        tmp_path / "hope", "reports",
        {"wikitext": {"word_perplexity": 26.05},
         "lambada_openai": {"perplexity": 29.38, "acc": 0.35},
         "hellaswag": {"acc_norm": 0.45, "acc": 0.40}, "piqa": {"acc": 0.65}, "step": 100},
        {"s_niah_1": {"len_2048": {"acc": 1.0}, "len_1024": {"acc": 0.5}}},
    )  # fmt: skip
    offline = _run(
        tmp_path / "release", "metrics",
        {"hope_rolling": {"word_perplexity": 900.0}, "hope_cloze": {"perplexity": 50.0, "acc": 0.1},
         "hope_choice": {"acc_norm": 0.3}},
        {"mk_niah": {"len_160": {"acc": 0.25}}},
    )  # fmt: skip
    out = tmp_path / "tables"
    assert main([str(paper), str(offline), "--names", "hope,tiny", "--out", str(out)]) == 0
    md = (out / "table1.md").read_text().splitlines()
    assert md[0].startswith("| model | Wiki. ppl | LMB. ppl | LMB. acc | PIQA | Hella. |")
    assert md[2] == "| hope | 26.05 | 29.38 | 35.0 | 65.0 | 45.0 |  |  |  |  |  | 48.3 |"
    assert md[3] == "| tiny | 900.00 | 50.00 | 10.0 |  | 30.0 |  |  |  |  |  | 20.0 |"  # stand-ins
    rows = list(csv.DictReader((out / "table1.csv").open()))
    assert rows[0]["Avg. acc"] == str((0.35 + 0.65 + 0.45) / 3) and rows[1]["PIQA"] == ""
    table2 = list(csv.DictReader((out / "table2.csv").open()))
    assert list(table2[0])[:3] == ["model", "S-NIAH-1 1024", "S-NIAH-1 2048"]
    assert table2[0]["S-NIAH-1 2048"] == "1.0" and table2[1]["MK-NIAH 160"] == "0.25"
    assert table2[1]["S-NIAH-1 2048"] == ""
    assert main([str(tmp_path / "nothing")]) == 2
    assert "no reports/" in capsys.readouterr().err
