"""Keep the README and docs/ true: every command in their bash blocks is run by a test
or by CI, and the README stays a front door (at most 200 lines)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Command of README.md or docs/*.md (regex) -> where it is exercised. A new command
# fails this test until a test (or CI) runs it and is named here.
E2E = "tests/test_pipeline_e2e.py"
COVERED = {
    r"make repro": f"{E2E} (dvc_repo fixture runs `make repro`)",
    r"make test": ".ci/run (CI)",
    r"dvc repro train": f"{E2E}::test_second_repro_does_nothing",
    r"dvc repro bench": f"{E2E}::test_second_repro_does_nothing",
    r"dvc exp run -S \S+=\S+": f"{E2E}::test_experiment_changes_metric_and_diff_shows_it",
    r"dvc exp show --md": f"{E2E}::test_experiment_changes_metric_and_diff_shows_it",
    r"dvc metrics diff --md": f"{E2E}::test_experiment_changes_metric_and_diff_shows_it",
    r"dvc plots show --json": f"{E2E}::test_plots_render_as_json",
    r"snakemake --cores 2": f"{E2E}::test_snakemake_mirror_reproduces_dvc_bit_for_bit",
    r"snakemake --profile configs/slurm": "tests/test_slurm_profile.py",
    r"snakemake --profile configs/slurm reports/train\.json": (
        "tests/test_slurm_profile.py::test_slurm_profile_runs_pipeline_through_sbatch"
    ),
    r"python stages/release.py --verify release": E2E,
    r"python stages/train.py --set train.nproc_per_node=2 --set (train.micro_batch_size=4|"
    r"train.parallel=fsdp)": f"{E2E}::test_docs_data_parallel_command_trains_on_two_ranks",
    r"python -m hope\.train\.plan .*": "tests/test_plan.py::test_the_readme_plan_command_runs",
    r"python stages/zeroshot\.py --set .*|python -m hope\.eval\.harness .*": (
        f"{E2E}::test_docs_zeroshot_commands_run_on_the_release"
    ),
    r"python stages/niah\.py --set niah\.tasks=\[s_niah_1,mk_niah\] .*": (
        f"{E2E}::test_docs_niah_command_runs"
    ),
    r"python stages/niah\.py --set .* --set niah\.memorize=true .*": (
        f"{E2E}::test_docs_memorisation_command_runs"
    ),
    r"python -m hope\.report\.tables .*": f"{E2E}::test_docs_tables_command_runs",
    r"python stages/longctx\.py --set .*": f"{E2E}::test_docs_longctx_command_runs",
    r"python stages/continual\.py --set .*": f"{E2E}::test_docs_continual_command_runs",
    r"hope (generate|score|memorize) .*|hope params --preset \w+|hope doctor": (
        f"{E2E}::test_docs_hope_commands_use_the_release"
    ),
    r"hope params --preset pilot --write params\.yaml": (
        "tests/test_config.py::test_the_readme_preset_switch_command_writes_that_preset"
    ),
}


def bash_commands(path: Path) -> list[str]:
    """Every command line of the file's ```bash blocks, without trailing comments."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S):
        for line in block.splitlines():
            command = line.split(" #")[0].strip()
            if command and not command.startswith("#"):
                commands.append(command)
    return commands


def test_every_readme_and_docs_command_is_exercised() -> None:
    assert {"make repro", "make test"} <= set(bash_commands(ROOT / "README.md"))
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for command in bash_commands(path):
            assert any(re.fullmatch(p, command) for p in COVERED), (
                f"{path.relative_to(ROOT)}: command not covered: {command}"
            )


def test_the_readme_is_a_front_door() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for doc in re.findall(r"\bdocs/([A-Z_]+\.md)", readme):
        assert (ROOT / "docs" / doc).is_file(), doc


def test_ci_runs_the_readme_test_command() -> None:
    assert "make test" in (ROOT / ".ci/run").read_text()


def test_named_tests_exist() -> None:
    for where in COVERED.values():
        path = where.split("::")[0].split(" ")[0]
        assert (ROOT / path).exists(), where
