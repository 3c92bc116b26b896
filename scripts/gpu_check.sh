#!/usr/bin/env bash
# One-shot GPU check: scripts/gpu_check.sh OUT_DIR
#
# For anyone with one CUDA GPU for a quarter of an hour: from a fresh checkout it
# installs what it needs, then runs, unattended and within GPU_CHECK_BUDGET seconds
# (default 480; a part that would start with under 30 s left is skipped, saying so):
#   1. side by side, as none of them is timed: the projection of the bench's pilot
#      shape (hope.bench.projection: launches counted on this machine's CPU); the
#      CUDA sync-debug test (a training step of four variants under
#      torch.cuda.set_sync_debug_mode("error"): no host syncs); the CUDA-graph tests
#      (a captured and replayed training step and run equal the eager ones); compile
#      parity (the torch.compile'd memory chunk steps equal eager ones, through
#      inductor); the fused backend's Triton kernels against their PyTorch forms
#      (tests/test_fused_ops.py); every Triton specialisation the parity tests launch
#      compiled for sm_90 with TF32 products (CI compiles one per kernel); FLA parity
#      where flash-linear-attention is installed; an untimed fused bench of the pilot rows that compiles their Triton kernels,
#   2. with two GPUs or more, DDP and FSDP2 over NCCL: every variant on 2 ranks equals
#      one process (tests/dist_variants_worker.py on CUDA),
#   3. alone on the GPU, the bench (tokens/s, MFU, peak memory, launches, host syncs)
#      at the pilot shape (the pilot preset's dims, 2 layers, T = 4096, batch 4) of
#      hope and titans_mac with memory_backend=fused, and with the step captured as
#      one CUDA graph (bench.cuda_graph); every other variant there eager (hope apart,
#      in one timed step: ~13 s eager on an H200); every variant
#      at pilot_chunks (launches per layer-step); the pilot shape with
#      memory_backend=compile; HOPE's frozen-base reads compiled at pilot_frozen,
#   4. the projection beside the measured pilot step (measured/eager and
#      measured/graph: the projection's error),
# and writes every log and report under OUT_DIR (summary.txt first). A failing part
# is recorded and the next one still runs; the exit code is that of the first
# failing part in that order.
#
# Install: a torch already importable (a CUDA image, a conda env) is reused through
# a --system-site-packages venv; otherwise pip installs the default torch wheel from
# PyPI, which is the CUDA build on Linux. Without a CUDA device it stops there. With
# network the project is installed with its dev extras; offline it runs from src/ on
# the packages already there (the bench and these tests need torch, triton, pyyaml,
# numpy, psutil, safetensors, pytest).
set -uo pipefail

out=${1:?usage: scripts/gpu_check.sh OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
summary="$out/summary.txt"
: >"$summary"
status=0

note() { echo "$*" | tee -a "$summary"; }

# GPU_CHECK_BUDGET (seconds, default 480): the parts share it, in the order below
# (most telling first); a part never runs past it and one that would start with
# under 30 s left is skipped and says so, so the check fits a short lease.
budget=${GPU_CHECK_BUDGET:-480}
deadline=$((SECONDS + budget))
parts=()

part() {  # part NAME LIMIT_SECONDS COMMAND...: run one part with a time limit, log it
  local name=$1 limit=$2
  shift 2
  local left=$((deadline - SECONDS))
  if [ "$left" -lt 30 ]; then
    note "$name: skipped (GPU_CHECK_BUDGET of $budget s spent)"
    echo skipped >"$out/$name.rc"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local started=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "$rc" >"$out/$name.rc"
  note "$name: exit $rc in $((SECONDS - started)) s (limit $limit s; log: $name.log)"
}

run_part() { parts+=("$1"); part "$@"; }
# Parts that need no timing run side by side (each its own CUDA context); wait_parts
# joins them before anything is timed.
start_part() { parts+=("$1"); part "$@" & }
wait_parts() { wait; }

venv=.venv-gpu
python3 -m venv --system-site-packages "$venv" || exit 1
# The packages of the python3 that made the venv, where that python3 is itself a
# virtual environment (a CUDA image's torch often lives in one, which
# --system-site-packages alone does not reach): a .pth file lists its folders.
python3 -c 'import site; print("\n".join(site.getsitepackages()))' \
  >"$("$venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')/outer_env.pth"
# shellcheck disable=SC1091
source "$venv/bin/activate"
# Offline (a lent machine often reaches nothing), pip would spend minutes retrying:
# the project then runs from src/ on the packages already there.
online=0
python - 2>/dev/null <<'PY' && online=1
import socket
socket.create_connection(("pypi.org", 443), timeout=3).close()
PY
if ! python -c 'import torch' 2>/dev/null; then
  [ "$online" -eq 1 ] || { note "install: no torch here and no network to fetch it"; exit 1; }
  pip install -q torch || { note "install: torch could not be installed"; exit 1; }
fi
if [ "$online" -eq 1 ]; then
  pip install -q -e ".[dev]" 2>"$out/install.log" || pip install -q --no-deps -e . 2>>"$out/install.log"
else
  note "install: offline; the project runs from src/ on the installed packages"
fi
xdist=()  # a worker per test file where pytest-xdist is installed
python -c 'import xdist' 2>/dev/null && xdist=(-n 4 --dist loadfile)
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

python - <<'PY' | tee -a "$summary"
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, device {torch.cuda.get_device_name(0)}")
PY
[ "${PIPESTATUS[0]}" -eq 0 ] || { note "no CUDA device visible to torch"; exit 1; }
nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || true
# The bench stage writes reports/bench{,_meta}.json, reports/metrics/bench.json and
# reports/bench_step_ms.tsv: keep the checkout's own and put them back (or remove
# the ones it did not have) at the end.
bench_outputs="reports/bench.json reports/bench_meta.json reports/metrics/bench.json reports/bench_step_ms.tsv"
kept=$(mktemp -d)
for f in $bench_outputs; do
  if [ -f "$f" ]; then mkdir -p "$kept/$(dirname "$f")"; cp "$f" "$kept/$f"; fi
done

# The projection (launch counts on the CPU) and the correctness parts time nothing:
# they run side by side, then the benches run alone on the GPU.
# The projection of the pilot preset (launch counts on this machine's CPU) for the
# bench's pilot shape, compared at the end with its measured step.
# (a background job reads no here-document: the program goes through a file)
projection_py=$(mktemp --suffix=.py)
cat >"$projection_py" <<'PY'
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
start_part projection 150 python "$projection_py" "$out"
start_part cuda_syncs 120 python -m pytest -v --tb=short -p no:cacheprovider tests/test_cuda_syncs.py
# A captured and replayed training step and run (train.cuda_graph) equal the eager
# ones; the file's CPU checks (meta-device audit, step traces) already ran in CI.
start_part graph_capture 120 python -m pytest -v --tb=short -p no:cacheprovider -rs \
  tests/test_graph_capture.py -k "captured or bench_refuses or pinned"
# HOPE_TEST_INDUCTOR=1: every compile test through inductor's kernels (CI traces some
# without code generation, which takes minutes per graph set on its 2 cores).
start_part compile_parity 120 env HOPE_TEST_INDUCTOR=1 python -m pytest -v --tb=short \
  -p no:cacheprovider \
  "${xdist[@]}" tests/test_memory_compile.py tests/test_smt.py tests/test_titans_memory.py -k compile
# The interpreter and sm_90-compile checks and the CPU tests ran in CI: here, the
# kernels on CUDA (one test, every kernel against its PyTorch form).
# (240 s: it compiles every fused kernel, the SMT walks' included, in float32 first.)
start_part fused_parity 240 python -m pytest -v --tb=short -p no:cacheprovider -rs \
  tests/test_fused_ops.py -k "on_cuda"
# CI compiles one specialisation of each kernel for sm_90 (the one with the most
# constexpr branches on); here every one the parity tests launch (126, TF32
# products as a bf16 run makes them), one process per core, beside the GPU parts.
start_part triton_compile_all 300 python -m pytest -q --tb=short -p no:cacheprovider -rs \
  -m triton_full tests/test_fused_ops.py
# Triton compiles a kernel on its first call and keeps it in its on-disk cache: one
# untimed bench of the fused pilot rows here (bf16, the benches' own sizes and flags)
# compiles what the timed fused benches below run, beside the parts above, so their
# limits are spent measuring (the SMT walk's kernels took minutes to compile for sm_90
# on a 2-core CPU). Its report (compile included in the warm-up step) is kept too.
warm_py=$(mktemp --suffix=.py)
cat >"$warm_py" <<'PY'
import sys
from pathlib import Path
from hope.bench.run import run_bench
from hope.config import load_config
sets = ["bench.device=cuda", "bench.precision=bf16", "bench.warmup=1", "bench.steps=1",
        "bench.project_presets=[]", "bench.shapes=[pilot]", "bench.memory_backend=fused",
        "bench.variants=[hope,titans_mac]"]
run_bench(load_config("params.yaml", sets), Path(sys.argv[1], "bench_warm_fused.json"))
PY
start_part warm_fused 240 python "$warm_py" "$out"
# FLA parity needs the fla package, which the project does not depend on (and the GPU
# machine may have no network to fetch it): run it where it imports, say so where not.
if python -c 'import fla' 2>/dev/null; then
  start_part fla_parity 150 python -m pytest -q -p no:cacheprovider -rs tests/test_memory_fla.py
else
  note "fla_parity: skipped (flash-linear-attention is not installed here)"
fi
wait_parts
rm -f "$projection_py" "$warm_py"

# DDP and FSDP2 over NCCL (every variant, float64, 2 ranks == 1 process to 1e-10, the
# FSDP units one per block): needs two GPUs; one GPU cannot hold two NCCL ranks.
gpus=$(python -c 'import torch; print(torch.cuda.device_count())')
if [ "$gpus" -ge 2 ]; then
  run_part dist_nccl 300 env HOPE_DIST_DEVICE=cuda OMP_NUM_THREADS=1 PYTHONPATH="$PWD/tests:$PYTHONPATH" \
    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/dist_variants_worker.py \
    "$out/dist_nccl.json"
  run_part dist_nccl_check 30 python - "$out/dist_nccl.json" <<'PY'
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

bench() {  # bench NAME LIMIT OVERRIDES...: stages/bench.py into OUT_DIR/bench_NAME.json
  local name=$1 limit=$2
  shift 2
  rm -f reports/bench.json reports/bench_meta.json  # a failed part must not pass on another's
  run_part "bench_$name" "$limit" python stages/bench.py \
    --set 'bench.variants=[transformer,hope_attention,hope,titans_lmm,titans_mac,titans_mag,titans_mal]' \
    --set bench.device=cuda --set bench.precision=bf16 --set bench.warmup=1 --set bench.steps=3 \
    --set 'bench.project_presets=[]' "$@"
  [ -f reports/bench.json ] && cp reports/bench.json "$out/bench_$name.json"
  [ -f reports/bench_meta.json ] && cp reports/bench_meta.json "$out/bench_${name}_meta.json"
}
# Most telling first: hope and titans_mac at the pilot shape with the fused writes
# (never run on a GPU yet), and captured as one CUDA graph (train.cuda_graph, fused
# writes: the projection's graph figure); the pilot shape eager for all but hope, whose
# eager step takes ~13 s there (both measured on an H200, 2026-12-04); launches at
# pilot_chunks; hope eager in one timed step (measured once already); compile; frozen
# reads.
bench pilot_fused 120 --set 'bench.shapes=[pilot]' \
  --set 'bench.variants=[transformer,hope,titans_mac]' --set bench.memory_backend=fused
bench pilot_graph 120 --set 'bench.shapes=[pilot]' \
  --set 'bench.variants=[transformer,hope,titans_mac]' \
  --set bench.memory_backend=fused --set bench.cuda_graph=true --set bench.warmup=4
bench pilot 120 --set 'bench.shapes=[pilot]' \
  --set 'bench.variants=[transformer,hope_attention,titans_lmm,titans_mac,titans_mag,titans_mal]'
bench pilot_chunks 150 --set 'bench.shapes=[pilot_chunks]'
bench pilot_hope 150 --set 'bench.shapes=[pilot]' --set 'bench.variants=[hope]' \
  --set bench.steps=1
bench pilot_compile 150 --set 'bench.shapes=[pilot]' --set bench.memory_backend=compile \
  --set 'bench.variants=[transformer,hope,titans_mac]' --set bench.steps=1
bench pilot_frozen 120 --set 'bench.shapes=[pilot_frozen]' --set 'bench.variants=[transformer,hope]' \
  --set bench.memory_backend=compile

python - "$out" <<'PY' | tee -a "$summary"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for name in ("warm_fused", "pilot_fused", "pilot_graph", "pilot", "pilot_hope",
             "pilot_chunks", "pilot_compile", "pilot_frozen"):
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
    hope_eager = out / "bench_pilot_hope.json"  # hope's eager row is measured apart
    if not bench and hope_eager.exists():
        pilot = {**pilot, **json.loads(hope_eager.read_text())["pilot"]}
    for variant, row in rows.items():
        shape = row["bench_pilot_shape"]
        h200 = shape["devices"]["H200"]
        got = pilot.get(variant, {}).get("step_ms")
        ratio = "-" if got is None else f"{got / h200[f'{mode}_ms']:.2f}"
        print(f"projection{suffix} {variant:15s} launches {shape['launches']:>9d} H200 eager "
              f"{h200['eager_ms']:>9.1f} ms graph {h200['graph_ms']:>8.1f} ms floor "
              f"{h200['floor_ms']:>7.1f} ms work {h200['work_ms']:>7.1f} ms (occupancy "
              f"{h200['occupancy']:.2f}, fp32 products {shape.get('recurrent_dot') or '-'}) "
              f"measured ({bench or 'eager'}) {got} ms  "
              f"measured/{mode} {ratio}")
PY
for f in $bench_outputs; do
  if [ -f "$kept/$f" ]; then cp "$kept/$f" "$f"; else rm -f "$f"; fi
done
rm -rf "$kept"
for name in "${parts[@]}"; do
  rc=$(cat "$out/$name.rc" 2>/dev/null || echo missing)
  if [ "$rc" != 0 ] && [ "$rc" != skipped ] && [ "$status" -eq 0 ]; then
    status=$rc
    [ "$rc" = missing ] && status=1
  fi
done
note "gpu_check: exit $status"
exit "$status"
