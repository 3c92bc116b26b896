#!/usr/bin/env bash
# One-shot GPU check: scripts/gpu_check.sh OUT_DIR
#
# For anyone with one CUDA GPU for a quarter of an hour: from a fresh checkout it
# installs what it needs, then runs, unattended and within about 8 minutes,
#   1. the CUDA sync-debug test (a training step of four variants under
#      torch.cuda.set_sync_debug_mode("error"): no host syncs), and the CUDA-graph
#      tests (a captured and replayed training step and run equal the eager ones),
#   2. compile parity (the torch.compile'd memory chunk steps equal eager ones;
#      memory_backend=compile tests), the fused backend's Triton kernels against
#      their PyTorch forms (tests/test_fused_ops.py) and FLA parity where
#      flash-linear-attention is installed,
#   3. the bench of every variant at the pilot_chunks shape (launches per step) and
#      at the pilot shape (the pilot preset's dims, 2 layers, T = 4096, batch 4),
#      eager and with memory_backend=compile: tokens/s, MFU, peak memory, launches;
#      HOPE's frozen-base reads compiled at the pilot_frozen shape, and hope and
#      titans_mac with memory_backend=fused at pilot_chunks and pilot, and at pilot
#      with the step captured as one CUDA graph (bench.cuda_graph),
#   4. the projection of the pilot shape (hope.bench.projection: launches counted on
#      this machine's CPU) beside its measured step (measured/eager and
#      measured/graph = the error),
#   5. with two GPUs or more, DDP and FSDP2 over NCCL: every variant on 2 ranks equals
#      one process (tests/dist_variants_worker.py on CUDA),
# and writes every log and report under OUT_DIR (summary.txt first). A failing part
# is recorded and the next one still runs; the exit code is that of the first
# failing part.
#
# Install: a torch already importable (a CUDA image, a conda env) is reused through
# a --system-site-packages venv; otherwise pip installs the default torch wheel from
# PyPI, which is the CUDA build on Linux. Without a CUDA device it stops there. The project itself is
# installed without resolving its dependencies again (--no-deps) when offline.
set -uo pipefail

out=${1:?usage: scripts/gpu_check.sh OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
summary="$out/summary.txt"
: >"$summary"
status=0

note() { echo "$*" | tee -a "$summary"; }

part() {  # part NAME LIMIT_SECONDS COMMAND...: run one part with a time limit, log it
  local name=$1 limit=$2
  shift 2
  local started=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  note "$name: exit $rc in $((SECONDS - started)) s (log: $name.log)"
  if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
}

venv=.venv-gpu
python3 -m venv --system-site-packages "$venv" || exit 1
# shellcheck disable=SC1091
source "$venv/bin/activate"
if ! python -c 'import torch' 2>/dev/null; then
  pip install -q torch || { note "install: torch could not be installed"; exit 1; }
fi
pip install -q -e ".[dev]" 2>"$out/install.log" || pip install -q --no-deps -e . 2>>"$out/install.log"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

python - <<'PY' | tee -a "$summary"
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, device {torch.cuda.get_device_name(0)}")
PY
[ "${PIPESTATUS[0]}" -eq 0 ] || { note "no CUDA device visible to torch"; exit 1; }
nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || true
# The bench stage writes reports/bench{,_meta}.json: keep the checkout's own and restore them.
kept=$(mktemp)
kept_meta=$(mktemp)
cp reports/bench.json "$kept" 2>/dev/null || true
cp reports/bench_meta.json "$kept_meta" 2>/dev/null || true

part cuda_syncs 120 python -m pytest -q -p no:cacheprovider tests/test_cuda_syncs.py
# A captured and replayed training step and run (train.cuda_graph) equal the eager
# ones; the file's CPU checks (meta-device audit, step traces) already ran in CI.
part graph_capture 150 python -m pytest -q -p no:cacheprovider -rs tests/test_graph_capture.py \
  -k "captured or bench_refuses or pinned"
# HOPE_TEST_INDUCTOR=1: every compile test through inductor's kernels (CI traces some
# without code generation, which takes minutes per graph set on its 2 cores).
part compile_parity 180 env HOPE_TEST_INDUCTOR=1 python -m pytest -q -p no:cacheprovider \
  tests/test_memory_compile.py tests/test_smt.py tests/test_titans_memory.py -k compile
# The interpreter and sm_90-compile checks ran on CPU in CI: here, the kernels on CUDA.
part fused_parity 240 python -m pytest -q -p no:cacheprovider -rs tests/test_fused_ops.py \
  -m "not slow" -k "not interpreter"
# FLA parity needs the fla package, which the project does not depend on (and the GPU
# machine may have no network to fetch it): run it where it imports, say so where not.
if python -c 'import fla' 2>/dev/null; then
  part fla_parity 180 python -m pytest -q -p no:cacheprovider -rs tests/test_memory_fla.py
else
  note "fla_parity: skipped (flash-linear-attention is not installed here)"
fi

# DDP and FSDP2 over NCCL (every variant, float64, 2 ranks == 1 process to 1e-10, the
# FSDP units one per block): needs two GPUs; one GPU cannot hold two NCCL ranks.
gpus=$(python -c 'import torch; print(torch.cuda.device_count())')
if [ "$gpus" -ge 2 ]; then
  part dist_nccl 300 env HOPE_DIST_DEVICE=cuda OMP_NUM_THREADS=1 PYTHONPATH="$PWD/tests:$PYTHONPATH" \
    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/dist_variants_worker.py \
    "$out/dist_nccl.json"
  part dist_nccl_check 30 python - "$out/dist_nccl.json" <<'PY'
import json, sys
report = json.loads(open(sys.argv[1]).read())
worst = {run: max(row["loss"], row["params"]) for run, row in report.items()}
for run, diff in worst.items():
    print(f"{run:28s} max difference from one process {diff:.2e}")
sys.exit(0 if max(worst.values()) <= 1e-10 else 1)
PY
else
  note "dist_nccl: skipped (DDP/FSDP2 over NCCL needs 2 GPUs; $gpus visible)"
fi

bench() {  # bench NAME OVERRIDES...: stages/bench.py into OUT_DIR/bench_NAME.json
  local name=$1
  shift
  part "bench_$name" 150 python stages/bench.py \
    --set 'bench.variants=[transformer,hope_attention,hope,titans_lmm,titans_mac,titans_mag,titans_mal]' \
    --set bench.device=cuda --set bench.precision=bf16 --set bench.warmup=1 --set bench.steps=3 \
    --set 'bench.project_presets=[]' "$@"
  [ -f reports/bench.json ] && cp reports/bench.json "$out/bench_$name.json"
  [ -f reports/bench_meta.json ] && cp reports/bench_meta.json "$out/bench_${name}_meta.json"
}
bench pilot_chunks --set 'bench.shapes=[pilot_chunks]'
bench pilot_frozen --set 'bench.shapes=[pilot_frozen]' --set 'bench.variants=[transformer,hope]' \
  --set bench.memory_backend=compile
bench pilot --set 'bench.shapes=[pilot]'
bench pilot_compile --set 'bench.shapes=[pilot]' --set bench.memory_backend=compile
bench pilot_fused --set 'bench.shapes=[pilot_chunks,pilot]' \
  --set 'bench.variants=[transformer,hope,titans_mac]' \
  --set bench.memory_backend=fused
# The whole step captured as one CUDA graph and replayed (train.cuda_graph), with the
# fused writes: what the projection's graph figure predicts.
bench pilot_graph --set 'bench.shapes=[pilot]' --set 'bench.variants=[transformer,hope,titans_mac]' \
  --set bench.memory_backend=fused --set bench.cuda_graph=true --set bench.warmup=4

# The projection of the pilot preset (launch counts on this machine's CPU) for the
# bench's pilot shape, compared below with its measured step.
part projection 300 python - "$out" <<'PY'
import json, sys
from pathlib import Path
from hope.bench import projection
variants = ["transformer", "hope_attention", "hope", "titans_lmm", "titans_mac", "titans_mag",
            "titans_mal"]
rows = {v: projection.project_variant("pilot", v) for v in variants}
Path(sys.argv[1], "projection.json").write_text(json.dumps(rows, indent=1))
from hope.memory.ops.dispatch import set_default_backend
set_default_backend("fused")  # the memories' writes as one kernel each way
fused = {v: projection.project_variant("pilot", v) for v in ("hope", "titans_mac")}
Path(sys.argv[1], "projection_fused.json").write_text(json.dumps(fused, indent=1))
PY

python - "$out" <<'PY' | tee -a "$summary"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for name in ("pilot_chunks", "pilot", "pilot_compile", "pilot_fused", "pilot_graph"):
    path = out / f"bench_{name}.json"
    if not path.exists():
        print(f"{name}: no report")
        continue
    report = json.loads(path.read_text())
    for shape, rows in report.items():
        if not isinstance(rows, dict) or shape in ("machine", "skipped", "config", "projection"):
            continue
        for variant, row in rows.items():
            mfu = row["mfu"]
            print(
                f"{name:13s} {variant:15s} {row['tokens_per_s']:>10.0f} tok/s "
                f"{row['step_ms']:>9.1f} ms  MFU {'-' if mfu is None else f'{mfu:.3f}'}  "
                f"peak {row['peak_mem_mb']:>8.0f} MB  launches {row['launches_per_step']}  "
                f"syncs {row['host_syncs_per_step']}"
            )
    meta_path = out / f"bench_{name}_meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    for shape, skipped in meta.get("skipped", {}).items():
        for variant, reason in skipped.items():
            print(f"{name:13s} {variant:15s} skipped: {reason}")
for suffix, bench, mode in (("", "", "eager"), ("_fused", "_fused", "eager"),
                            ("_fused", "_graph", "graph")):
    projected = out / f"projection{suffix}.json"
    measured = out / f"bench_pilot{bench}.json"
    if not (projected.exists() and measured.exists()):
        continue
    rows, pilot = json.loads(projected.read_text()), json.loads(measured.read_text())["pilot"]
    for variant, row in rows.items():
        shape = row["bench_pilot_shape"]
        h200 = shape["devices"]["H200"]
        got = pilot.get(variant, {}).get("step_ms")
        ratio = "-" if got is None else f"{got / h200[f'{mode}_ms']:.2f}"
        print(f"projection{suffix} {variant:15s} launches {shape['launches']:>9d} H200 eager "
              f"{h200['eager_ms']:>9.1f} ms graph {h200['graph_ms']:>8.1f} ms floor "
              f"{h200['floor_ms']:>7.1f} ms measured ({bench or 'eager'}) {got} ms  "
              f"measured/{mode} {ratio}")
PY
[ -s "$kept" ] && cp "$kept" reports/bench.json
[ -s "$kept_meta" ] && cp "$kept_meta" reports/bench_meta.json
rm -f "$kept" "$kept_meta"
note "gpu_check: exit $status"
exit "$status"
