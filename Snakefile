# Cluster mirror of dvc.yaml: same rule names, same commands, same files.
#   snakemake --cores 2                       # local
#   snakemake --profile configs/slurm         # SLURM (snakemake-executor-plugin-slurm)
# params.yaml is the config for both runners; it is validated (unknown keys,
# types, preset) before any job is scheduled.
import sys

configfile: "params.yaml"

sys.path.insert(0, "src")
from hope.config import load_config  # noqa: E402

load_config("params.yaml")
PRESET = f"configs/presets/{config['preset']}.yaml"


rule all:
    input:
        "release",
        "reports/plots/loss.png",
        "reports/plots/passkey.png",
        "reports/plots/lr.png",


rule download:
    input:
        "stages/download.py",
        "src/hope/data/sources.py",
        "src/hope/data/download.py",
        PRESET,
    output:
        directory("data/raw"),
    shell:
        "python stages/download.py"


rule tokenizer:
    input:
        "stages/tokenizer.py",
        "src/hope/data/tokenizer.py",
        "data/raw",
    output:
        directory("data/tokenizer"),
    shell:
        "python stages/tokenizer.py"


rule shard:
    input:
        "stages/shard.py",
        "src/hope/data/shards.py",
        "data/raw",
        "data/tokenizer",
    output:
        directory("data/shards"),
    shell:
        "python stages/shard.py"


rule train:
    input:
        "stages/train.py",
        "data/shards",
        "data/tokenizer",
        PRESET,
    output:
        directory("models/checkpoints"),
        "reports/train.json",
        "reports/train_log.tsv",
    shell:
        "python stages/train.py"


rule eval:
    input:
        "stages/eval.py",
        "models/checkpoints",
        "data/shards",
        "data/tokenizer",
    output:
        "reports/eval.json",
        "reports/eval_config.yaml",
    shell:
        "python stages/eval.py"


rule plot:
    input:
        "stages/plot.py",
        "reports/train_log.tsv",
        "reports/eval.json",
    output:
        "reports/plots/loss.png",
        "reports/plots/passkey.png",
        "reports/plots/lr.png",
    shell:
        "python stages/plot.py"


rule release:
    input:
        "stages/release.py",
        "models/checkpoints",
        "data/tokenizer",
        "reports/train.json",
        "reports/eval.json",
    output:
        directory("release"),
    shell:
        "python stages/release.py"
