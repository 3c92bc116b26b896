# Cluster mirror of dvc.yaml: same rule names, same commands, same files.
# Outputs are named files rather than directory() outputs, because Snakemake
# drops a .snakemake_timestamp into directory outputs (and the release bundle's
# MANIFEST must list every file it holds).
#   snakemake --cores 2                       # local
#   snakemake --profile configs/slurm         # SLURM (snakemake-executor-plugin-slurm)
# params.yaml is the config for both runners; it is validated (unknown keys,
# types, preset) before any job is scheduled. Each rule that computes with
# several threads declares `threads:` from the resolved params (the stage itself
# pins torch/sentencepiece to the same count), so `snakemake --cores N`, SLURM
# (--cpus-per-task) and `dvc repro` run the same numerics.
import sys

configfile: "params.yaml"

sys.path.insert(0, "src")
from hope.config import load_config  # noqa: E402
from hope.train.launch import eval_resources, slurm_resources, srun_prefix  # noqa: E402

CFG = load_config("params.yaml")
PRESET = f"configs/presets/{config['preset']}.yaml"


rule all:
    input:
        "release/MANIFEST",
        "reports/plots/loss.png",
        "reports/plots/passkey.png",
        "reports/plots/lr.png",
        "reports/bench.json",
        "reports/recall.json",
        "reports/zeroshot.json",
        "reports/niah.json",
        "reports/longctx.json",
        "reports/continual.json",


rule download:
    input:
        "stages/download.py",
        "src/hope/data/sources.py",
        "src/hope/data/download.py",
        PRESET,
    output:
        "data/raw/train.jsonl",
        "data/raw/val.jsonl",
        "data/raw/manifest.json",
    shell:
        "python stages/download.py"


rule tokenizer:
    input:
        "stages/tokenizer.py",
        "src/hope/data/tokenizer.py",
        "data/raw/manifest.json",
    output:
        "data/tokenizer/spm.model",
        "data/tokenizer/coverage.json",
    threads: CFG.tokenizer.num_threads
    shell:
        "python stages/tokenizer.py"


rule shard:
    input:
        "stages/shard.py",
        "src/hope/data/shards.py",
        "data/raw/manifest.json",
        "data/tokenizer/spm.model",
    output:
        "data/shards/manifest.json",
    threads: CFG.tokenizer.num_threads
    shell:
        "python stages/shard.py"


rule train:
    input:
        "stages/train.py",
        "data/shards/manifest.json",
        "data/tokenizer/spm.model",
        PRESET,
    output:
        directory("models/checkpoints"),
        "reports/train.json",
        "reports/metrics/train.json",
        "reports/train_meta.json",
        "reports/train_log.tsv",
    # Every local rank pins torch to train.num_threads.
    threads: CFG.train.num_threads * CFG.train.nproc_per_node
    # GPUs and nodes from params (hope.train.launch.slurm_resources): nproc_per_node
    # GPUs on each of train.nnodes nodes; several nodes run one task per node, each
    # starting torchrun, meeting at a rendezvous on the first node.
    resources:
        **slurm_resources(CFG),
    params:
        launch=srun_prefix(CFG),
    shell:
        "{params.launch}python stages/train.py"


rule eval:
    input:
        "stages/eval.py",
        "models/checkpoints",
        "data/shards/manifest.json",
        "data/tokenizer/spm.model",
    output:
        "reports/eval.json",
        "reports/metrics/eval.json",
        "reports/eval_meta.json",
        "reports/eval_config.yaml",
    threads: CFG.train.num_threads
    resources:
        **eval_resources(CFG),
    shell:
        "python stages/eval.py"


rule zeroshot:
    input:
        "stages/zeroshot.py",
        "models/checkpoints",
        "data/raw/val.jsonl",
        "data/tokenizer/spm.model",
        "configs/lm_eval",
    output:
        directory("data/zeroshot"),
        "reports/zeroshot.json",
        "reports/metrics/zeroshot.json",
        "reports/zeroshot_meta.json",
    threads: CFG.train.num_threads
    resources:
        **eval_resources(CFG),
    shell:
        "python stages/zeroshot.py"


rule niah:
    input:
        "stages/niah.py",
        "models/checkpoints",
        "data/raw/val.jsonl",
        "data/tokenizer/spm.model",
    output:
        "reports/niah.json",
        "reports/metrics/niah.json",
        "reports/niah_meta.json",
        "reports/niah_heatmap.png",
    threads: CFG.train.num_threads
    resources:
        **eval_resources(CFG),
    shell:
        "python stages/niah.py"


rule longctx:
    input:
        "stages/longctx.py",
        "models/checkpoints",
        "data/raw/val.jsonl",
        "data/tokenizer/spm.model",
    output:
        "reports/longctx.json",
        "reports/metrics/longctx.json",
        "reports/longctx_meta.json",
        "reports/longctx.png",
    threads: CFG.train.num_threads
    resources:
        **eval_resources(CFG),
    shell:
        "python stages/longctx.py"


rule continual:
    input:
        "stages/continual.py",
        "models/checkpoints",
        "data/tokenizer/spm.model",
    output:
        "reports/continual.json",
        "reports/metrics/continual.json",
        "reports/continual_meta.json",
        "reports/continual.png",
    threads: CFG.train.num_threads
    resources:
        **eval_resources(CFG),
    shell:
        "python stages/continual.py"


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
        "data/tokenizer/spm.model",
        "reports/train.json",
        "reports/train_meta.json",
        "reports/eval.json",
        "reports/eval_meta.json",
        "reports/zeroshot.json",
        "reports/zeroshot_meta.json",
        "reports/niah.json",
        "reports/niah_meta.json",
        "reports/longctx.json",
        "reports/longctx_meta.json",
        "reports/continual.json",
        "reports/continual_meta.json",
    output:
        "release/MANIFEST",
    shell:
        "python stages/release.py"


rule bench:
    input:
        "stages/bench.py",
        "src/hope",
        PRESET,
    output:
        "reports/bench.json",
        "reports/metrics/bench.json",
        "reports/bench_meta.json",
        "reports/bench_step_ms.tsv",
    threads: CFG.bench.num_threads
    shell:
        "python stages/bench.py"


rule recall:
    input:
        "stages/recall.py",
        "src/hope/eval/recall.py",
        "src/hope/model",
        "src/hope/memory",
        "src/hope/optim",
        "src/hope/train",
        PRESET,
    output:
        "reports/recall.json",
        "reports/metrics/recall.json",
        "reports/recall_meta.json",
    threads: CFG.recall.num_threads
    resources:
        **eval_resources(CFG),
    shell:
        "python stages/recall.py"
