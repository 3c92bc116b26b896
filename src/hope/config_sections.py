"""The sections of the pipeline's typed configuration: one dataclass per section of
``params.yaml``, every knob with its one default. Loading, validation and presets live
in ``hope.config``; the model section is ``hope.model.config.ModelConfig``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from hope.model.config import ModelConfig


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
    # ddp: every rank holds the whole model state; fsdp: FSDP2 (fully_shard) shards
    # parameters, gradients and AdamW state over the ranks (hope.train.distributed).
    parallel: Literal["ddp", "fsdp"] = "ddp"
    # Under fsdp: the dtype the blocks' parameters are gathered and computed in
    # (FSDP2's MixedPrecisionPolicy; gradients are reduced and stored in fp32). bf16
    # halves the all-gathers and the gathered bytes and needs train.precision=bf16
    # (autocast meets the bf16 weights); the memories' initial weights and the root
    # stay fp32, so the fast states start and evolve at full precision.
    fsdp_param_dtype: Literal["fp32", "bf16"] = "fp32"
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
    # chunk steps through torch.compile (same values); "fla" needs CUDA + fla; "fused"
    # writes the SMT with one operator per chunk (Triton on CUDA; same values).
    memory_backend: Literal["torch", "compile", "fla", "fused"] = "torch"
    # CUDA only: capture the whole training step (forward, backward, clipping, AdamW)
    # as one CUDA graph after a few eager steps and replay it (hope.train.graphed):
    # the same values without the host cost of each kernel launch. One process,
    # optim.name=adamw.
    cuda_graph: bool = False
    checkpoint_every: int = 100
    # "full": one step_*.pt with whole tensors (gathered on rank 0 under FSDP);
    # "sharded": a step_*/ directory where every rank writes its own shards through
    # torch.distributed.checkpoint (nothing gathered; hope.train.sharded). Either
    # kind resumes on any world size and feeds the release.
    checkpoint_format: Literal["full", "sharded"] = "full"
    # Checkpoints kept (newest first); a corrupt newest one falls back to the next.
    keep_checkpoints: int = 2
    # On a non-finite loss (checked at each log/validation/checkpoint step, before
    # anything is saved): stop with the last good checkpoint intact; rewind to it
    # with the learning rate times nan_lr_factor, at most nan_max_rewinds times; or
    # skip each step whose gradient norm is not finite (no update; decided on the
    # device), at most nan_max_skips steps in the run.
    nan_policy: Literal["stop", "rewind", "skip"] = "stop"
    nan_lr_factor: float = 0.5
    nan_max_rewinds: int = 3
    nan_max_skips: int = 100
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
class ZeroshotConfig:
    """The ``zeroshot`` stage: lm-eval tasks on the trained model (hope.eval.harness).
    The default tasks are built offline from the run's validation texts
    (hope.eval.zeroshot_items; YAMLs in configs/lm_eval); the paper presets name the
    paper's Table 1 tasks by their lm-eval names (their data needs the HuggingFace hub)."""

    tasks: list[str] = field(default_factory=lambda: ["hope_cloze", "hope_choice", "hope_rolling"])
    items: int = 64  # per offline task
    cloze_words: int = 24  # passage length of a hope_cloze item
    choice_words: int = 12  # context and ending length of a hope_choice item
    limit: int | None = None  # lm-eval --limit: documents per task (null: all)
    batch_size: int = 8
    num_fewshot: int = 0
    bootstrap_iters: int = 1000  # lm-eval's stderr of non-mean metrics (perplexities)
    memorize: bool = False  # also the adaptive run (the ``memorize`` section): adaptive_*
    seed: int = 1234

    def checks(self) -> list[tuple[bool, str]]:
        """(holds, message) per range rule; hope.config raises the first failing."""
        return [
            (bool(self.tasks), "zeroshot.tasks is empty: name at least one lm-eval task"),
            (self.items >= 1, "zeroshot.items must be >= 1"),
            (self.cloze_words >= 2, "zeroshot.cloze_words must be >= 2"),
            (self.choice_words >= 1, "zeroshot.choice_words must be >= 1"),
            (
                self.limit is None or self.limit >= 1,
                "zeroshot.limit must be >= 1 (or null: every document)",
            ),
            (self.batch_size >= 1, "zeroshot.batch_size must be >= 1"),
            (self.num_fewshot >= 0, "zeroshot.num_fewshot must be >= 0"),
            (self.bootstrap_iters >= 0, "zeroshot.bootstrap_iters must be >= 0"),
        ]


@dataclass
class NiahConfig:
    """The ``niah`` stage (hope.eval.niah): RULER-style needle-in-a-haystack accuracy
    over context lengths x needle depths, haystacks from the run's validation text."""

    tasks: list[str] = field(
        default_factory=lambda: ["s_niah_1", "s_niah_2", "s_niah_3", "mk_niah"]
    )
    # tiny: beyond the training context (128); the paper presets: 2K..16K.
    lengths: list[int] = field(default_factory=lambda: [160, 320])  # prompt tokens
    depths: list[float] = field(default_factory=lambda: [0.0, 0.5, 1.0])  # needle position
    trials: int = 4  # per (task, length, depth) cell
    candidates: int = 4  # values ranked per trial (chance 1/candidates)
    needles: int = 3  # mk_niah's needles (<= candidates)
    batch_size: int = 32
    memorize: bool = False  # also the adaptive run (the ``memorize`` section): adaptive_acc
    seed: int = 1234

    def checks(self) -> list[tuple[bool, str]]:
        """(holds, message) per range rule; hope.config raises the first failing."""
        return [
            (bool(self.tasks), "niah.tasks is empty"),
            (bool(self.lengths) and min(self.lengths) > 0, "niah.lengths: positive lengths"),
            (
                bool(self.depths) and all(0.0 <= d <= 1.0 for d in self.depths),
                "niah.depths must be fractions in [0, 1]",
            ),
            (self.trials >= 1, "niah.trials must be >= 1"),
            (self.candidates >= 2, "niah.candidates must be >= 2"),
            (
                1 <= self.needles <= self.candidates,
                f"niah.needles={self.needles} must be in [1, niah.candidates]",
            ),
            (self.batch_size >= 1, "niah.batch_size must be >= 1"),
        ]


@dataclass
class LongctxConfig:
    """The ``longctx`` stage (hope.eval.longctx): loss by position over long texts read
    through the model's state, beyond the training context."""

    source: Literal["val", "hf"] = "val"  # the run's validation text, or hf_name
    hf_name: str = "emozilla/pg19-test"  # PG-19's test books (or a local data folder)
    hf_split: str = "test"
    text_field: str = "text"
    max_documents: int = 64  # read at most this many documents from hf_name
    length: int = 1024  # tokens per sequence (tiny: 8x its training context)
    sequences: int = 4
    bucket: int = 128  # position bucket width
    window: int | None = None  # tokens per forward, state carried (null: data.seq_len)
    batch_size: int = 4
    memorize: bool = False  # also the adaptive run (the ``memorize`` section): adaptive_*

    def checks(self) -> list[tuple[bool, str]]:
        """(holds, message) per range rule; hope.config raises the first failing."""
        return [
            (self.length >= 2, "longctx.length must be >= 2"),
            (self.sequences >= 1, "longctx.sequences must be >= 1"),
            (1 <= self.bucket <= self.length, "longctx.bucket must be in [1, longctx.length]"),
            (self.window is None or self.window >= 1, "longctx.window must be >= 1 (or null)"),
            (self.batch_size >= 1, "longctx.batch_size must be >= 1"),
            (self.max_documents >= 1, "longctx.max_documents must be >= 1"),
        ]


@dataclass
class ContinualConfig:
    """The ``continual`` stage (hope.eval.continual): segments memorised in order into the
    fast state, every segment's held-out loss after each; forgetting and BWT."""

    segments: list[str] = field(default_factory=lambda: ["json", "email", "unittest", "asyncio"])
    write_tokens: int = 512  # per segment, memorised
    probe_tokens: int = 128  # per segment, held out and scored
    # Training checkpoints (their steps) the same protocol also runs on, oldest first:
    # forgetting across training (null: only the latest; needs train.keep_checkpoints).
    checkpoints: list[int] | None = None

    def checks(self) -> list[tuple[bool, str]]:
        """(holds, message) per range rule; hope.config raises the first failing."""
        return [
            (bool(self.segments), "continual.segments is empty: name at least one segment"),
            (len(set(self.segments)) == len(self.segments), "continual.segments repeats a name"),
            (self.write_tokens >= 1, "continual.write_tokens must be >= 1"),
            (self.probe_tokens >= 2, "continual.probe_tokens must be >= 2"),
            (
                self.checkpoints is None or (bool(self.checkpoints) and min(self.checkpoints) >= 0),
                "continual.checkpoints: a list of checkpoint steps >= 0 (or null: the latest)",
            ),
        ]


MEMORY_PATHS = ("smt", "titans", "cms")  # and "cms:<level index>"


@dataclass
class MemorizeParams:
    """The ``memorize`` section: test-time memorisation in the evaluators (zero-shot,
    NIAH and long-context when their ``memorize`` switch is on; continual always), via
    hope.model.memorize. Each evaluator reports its plain (baseline) numbers and the
    adaptive ones beside them, with their delta; docs/EVALUATION.md "Test-time memorisation"."""

    paths: list[str] | None = None  # memories written: smt, titans, cms, cms:<i> (null: all)
    layers: list[int] | None = None  # blocks written (null: all)
    steps: int = 1  # passes over each text (> 1: re-read from the starting context)
    surprise_threshold: float | None = None  # CMS gate τ while memorising (null: the model's)
    # reset_per_sample: every sample from a fresh state; carry_across_samples: one stream.
    # null: each evaluator's own (continual carries, the others reset).
    reset: Literal["reset_per_sample", "carry_across_samples"] | None = None
    # zeroshot, carry: after a document is scored, write its context and its correct
    # answer into the carried state (else the context only).
    use_correct_answer: bool = False

    def checks(self) -> list[tuple[bool, str]]:
        """(holds, message) per range rule; hope.config raises the first failing."""
        bad_path = next(
            (
                p
                for p in self.paths or []
                if p not in MEMORY_PATHS and not (p.startswith("cms:") and p[4:].isdigit())
            ),
            None,
        )
        return [
            (
                bad_path is None,
                f"memorize.paths: unknown memory {bad_path!r} "
                "(smt, titans, cms or cms:<level index>)",
            ),
            (self.paths is None or bool(self.paths), "memorize.paths is empty (null: all)"),
            (
                self.layers is None or (bool(self.layers) and min(self.layers) >= 0),
                "memorize.layers: block indices >= 0 (null: all)",
            ),
            (self.steps >= 1, "memorize.steps must be >= 1"),
        ]


@dataclass
class ReleaseConfig:
    name: str = "hope-tiny"


@dataclass
class BenchConfig:
    """The ``bench`` stage: one training step (forward, backward, AdamW) per variant
    at fixed shapes (``tiny``: the preset's model; ``smoke``: the predecessor's smoke
    shape, docs/ANCHORS.md "Speed"; ``pilot_chunks``: one layer with the pilot
    preset's chunking at T = 1024; ``pilot_frozen``: the same with HOPE's frozen-base
    reads; ``pilot``, a GPU shape: the pilot preset's dims in two layers at T = 4096).
    See :mod:`hope.bench.run`."""

    variants: list[str] = field(
        default_factory=lambda: ["transformer", "hope_attention", "hope", "titans_mac"]
    )
    shapes: list[Literal["tiny", "smoke", "pilot_chunks", "pilot_frozen", "pilot"]] = field(
        default_factory=lambda: ["tiny", "smoke", "pilot_chunks", "pilot_frozen"]
    )
    batch_size: int = 8  # tiny only; smoke is fixed at batch 4, pilot_chunks/_frozen 1, pilot 4
    warmup: int = 2
    steps: int = 5
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda | cuda:N (recorded in bench.json's machine)
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    num_threads: int = 2  # torch intra-op threads while measuring (as train.num_threads)
    memory_backend: Literal["torch", "compile", "fla", "fused"] = "torch"  # as train.memory_backend
    # CUDA only: time the step captured as a CUDA graph and replayed (train.cuda_graph);
    # its first bench.warmup steps include the eager warm-up and the capture.
    cuda_graph: bool = False
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
    # hope learns MQAR within this; the transformer needs more (docs/EVALUATION.md)
    steps: int = 200
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
    zeroshot: ZeroshotConfig = field(default_factory=ZeroshotConfig)
    niah: NiahConfig = field(default_factory=NiahConfig)
    longctx: LongctxConfig = field(default_factory=LongctxConfig)
    continual: ContinualConfig = field(default_factory=ContinualConfig)
    memorize: MemorizeParams = field(default_factory=MemorizeParams)
    release: ReleaseConfig = field(default_factory=ReleaseConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    recall: RecallConfig = field(default_factory=RecallConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
