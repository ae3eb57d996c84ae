#!/usr/bin/env bash
# The one command to run on a GPU machine: checks that a GPU is visible, sets up and builds the
# extension with its CUDA kernels (scripts/setup.sh), runs the whole pytest suite (CPU and CUDA
# tests; a CUDA test skipped for "no CUDA device" is a failure), the ptxas register/spill report
# (scripts/ptxas_report.py, if present) and the GPU benchmark against SDPA
# (benchmarks/gpu_vs_sdpa.py, which writes results/gpu/benchmark.md; with it the windows and packed
# sequences, and the fixed cost of a call). Prints a summary with
# timings; exits non-zero if any step failed (later steps still run, so one run shows everything).
#
#   bash scripts/gpu_suite.sh                    # everything
#   bash scripts/gpu_suite.sh -x --maxfail=5     # extra arguments are pytest options (it runs tests/)
#   SKIP_SETUP=1 bash scripts/gpu_suite.sh       # reuse the current build (no scripts/setup.sh)
#   SKIP_BENCH=1 bash scripts/gpu_suite.sh       # tests only
#   SKIP_TESTS=1 bash scripts/gpu_suite.sh       # no pytest (e.g. the benchmark alone, with SKIP_SETUP)
#   BENCH_ARGS="--seq 1024 4096" bash scripts/gpu_suite.sh   # arguments for the benchmark
#   RUN_CPP=1 bash scripts/gpu_suite.sh          # also the C++ suite (CMake + CTest)
#   SHARDS=1 bash scripts/gpu_suite.sh           # one pytest process (default 3 side by side)
#
# With a .device/ folder (scripts/device_bundle.sh make, run where there is network) nothing is
# installed: the extension comes from the bundle, or is built against the machine's own torch.
#
# Logs go to build/gpu_suite/ (pytest.log, ptxas.log, benchmark.log).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1
# A build here compiles the kernels that wait for a GPU to test them as well, if kernels.toml lists
# any (`on_request`: csrc/cuda/untested_kernels.h; the Hopper kernels at head dim 256 at present):
# the CUDA tests force them, and
# step 3 then fails on a build without them. ENTROPY_ATTN_UNTESTED_KERNELS=0 leaves them out of a
# build (scripts/setup.sh; the device bundle's library has them) and accepts one without them.
export ENTROPY_ATTN_UNTESTED_KERNELS=${ENTROPY_ATTN_UNTESTED_KERNELS:-1}
PYTHON=${PYTHON:-python3}
LOG_DIR=${LOG_DIR:-build/gpu_suite}
mkdir -p "$LOG_DIR"

# --- bookkeeping: per-step status and time, printed at exit --------------------------------------
suite_start=$(date +%s)
declare -a summary=()
overall_rc=0
step_start=$suite_start
begin() {  # begin NAME: announce a step and start its clock
  step_name=$1
  step_start=$(date +%s)
  echo
  echo "=== ${step_name}"
}
finish() {  # finish STATUS: record the current step as ok / FAILED (...) / skipped (...)
  local status=$1
  summary+=("$(printf '%-40s %6ds  %s' "$step_name" $(($(date +%s) - step_start)) "$status")")
  echo "=== ${step_name}: ${status} ($(($(date +%s) - step_start))s)"
  if [[ $status == FAILED* ]]; then overall_rc=1; fi
}
print_summary() {
  local rc=$?
  if ((rc != 0)); then overall_rc=$rc; fi
  echo
  echo "=== gpu_suite summary"
  printf '  %s\n' "${summary[@]}"
  echo "  total $(($(date +%s) - suite_start))s, exit code ${overall_rc}; logs in ${LOG_DIR}/"
  exit "$overall_rc"
}
trap print_summary EXIT

# --- 1. a GPU must be visible -------------------------------------------------------------------
# nvidia-smi first (torch may not be installed yet: setup installs it); the torch check follows
# the setup. A machine without a GPU stops here: this script would only measure skips.
begin "GPU visible (nvidia-smi)"
if ! command -v nvidia-smi >/dev/null; then
  echo "nvidia-smi not found: is this a GPU machine with the NVIDIA driver installed?"
  finish "FAILED (no nvidia-smi)"
  exit 1
fi
if ! nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader; then
  finish "FAILED (nvidia-smi sees no GPU)"
  exit 1
fi
finish ok

# --- 2. setup and build (the CUDA kernels are compiled when torch is a CUDA build) ---------------
# A machine with its own torch and no network gets the extension from .device/ instead
# (scripts/device_bundle.sh: made elsewhere, copied along; a build there if it does not match).
if [[ -d .device ]]; then begin "setup + build (scripts/device_bundle.sh install)"; else
  begin "setup + build (scripts/setup.sh)"
fi
if [[ ${SKIP_SETUP:-0} != 0 ]]; then
  finish "skipped (SKIP_SETUP)"
elif [[ -d .device ]]; then
  if bash scripts/device_bundle.sh install; then finish ok; else
    finish "FAILED (scripts/device_bundle.sh install)"
    exit 1
  fi
else
  if bash scripts/setup.sh; then finish ok; else
    finish "FAILED (scripts/setup.sh)"
    exit 1
  fi
fi

# --- 3. torch sees the GPU and the extension has CUDA kernels ------------------------------------
begin "torch.cuda + CUDA kernels registered"
if "$PYTHON" - <<'PY'
import sys

import torch

if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} (CUDA {torch.version.cuda}): torch.cuda.is_available() is False")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i}: {p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}")
try:
    import torch_ext
except ImportError:  # not installed: use this checkout (built in place)
    sys.path.insert(0, ".")
    import torch_ext
print("torch_ext from", torch_ext.__file__)
ops = ("attention", "attention_backward", "entropy", "sparsity", "attention_sparsity")
missing = [op for op in ops if not torch._C._dispatch_has_kernel_for_dispatch_key(f"entropy_attn::{op}", "CUDA")]
if missing:
    sys.exit(f"no CUDA kernel registered for: {', '.join(missing)} (was the extension built with CUDA?)")
print("CUDA kernels registered for", ", ".join(ops))
# The kernels that wait for this machine's tests (csrc/cuda/untested_kernels.h), where kernels.toml
# lists any, must be in the build it tests, or their tests skip and this suite would pass without
# running them.
import os

sys.path.insert(0, "scripts")
import kernel_list
from torch_ext import _build_info

built = getattr(_build_info, "UNTESTED_KERNELS", False)
wanted = os.environ.get("ENTROPY_ATTN_UNTESTED_KERNELS") == "1" and kernel_list.on_request_units()
if wanted and not built:
    sys.exit("the build lacks the kernels compiled on request (torch_ext/_build_info.py: UNTESTED_KERNELS); "
             "rebuild with ENTROPY_ATTN_UNTESTED_KERNELS=1, or run with ENTROPY_ATTN_UNTESTED_KERNELS=0")
print("kernels compiled on request:", "in" if built else "not built")
PY
then finish ok; else
  finish "FAILED"
  exit 1
fi

# --- 4. the whole pytest suite, CPU and CUDA -----------------------------------------------------
# ENTROPY_ATTN_REQUIRE_CUDA makes tests/conftest.py refuse to run without a GPU; -rs lists every
# skip with its reason, and any skip for "no CUDA device" fails this step (the CUDA tests must
# run here). Other skips (e.g. "needs 2 CUDA devices" on a one-GPU machine) are reported only.
#
# SHARDS pytest processes run side by side (ENTROPY_ATTN_TEST_SHARD=k/n in tests/conftest.py:
# each takes every n-th test), each with nproc/n threads: the tests' float64 CPU references keep
# one process busy while the GPU waits, and the suite runs four times here (steps 4 and 4b).
SHARDS=${SHARDS:-3}
threads=$(($(nproc) / SHARDS))
((threads >= 1)) || threads=1

# run_pytest LOG ARGS...: pytest ARGS in $SHARDS processes; their output concatenated in LOG (each
# shard's also in LOG.K); the exit status is the first failing shard's (5, "nothing collected",
# counts as success: a shard of a small selection may be empty).
run_pytest() {
  local log=$1 k rc=0 shard_rc
  shift
  local pids=()
  for ((k = 0; k < SHARDS; k++)); do
    ENTROPY_ATTN_TEST_SHARD=$k/$SHARDS OMP_NUM_THREADS=$threads ENTROPY_ATTN_REQUIRE_CUDA=1 \
      "$PYTHON" -m pytest "$@" >"$log.$k" 2>&1 &
    pids+=($!)
  done
  for ((k = 0; k < SHARDS; k++)); do
    shard_rc=0
    wait "${pids[$k]}" || shard_rc=$?
    if ((shard_rc != 0 && shard_rc != 5 && rc == 0)); then rc=$shard_rc; fi
  done
  for ((k = 0; k < SHARDS; k++)); do cat "$log.$k"; done | tee "$log"
  return "$rc"
}

# tally LOG: the shards' final counts added up ("1221 passed, 5 skipped, ..."; not "deselected",
# which counts the other shards' tests too).
tally() {
  grep -hE '^[=]* ?[0-9]+ (passed|failed|error|skipped|deselected)' "$1" | tr -d '=' |
    grep -oE '[0-9]+ (passed|failed|errors?|skipped|deselected|xfailed|xpassed|warnings?)' |
    awk '{sub(/s$/, "", $2); if ($2 == "warning") next; n[$2] += $1} END {
      first = 1; split("passed failed error skipped xfailed xpassed", order, " ")
      for (i = 1; i <= 6; i++) if (order[i] in n) { printf "%s%d %s", first ? "" : ", ", n[order[i]], order[i]; first = 0 }
    }' || true
}

families=""
begin "pytest (CPU + CUDA, ${SHARDS} shards)"
if [[ ${SKIP_TESTS:-0} != 0 ]]; then
  finish "skipped (SKIP_TESTS)"
else
  pytest_log=$LOG_DIR/pytest.log
  py_rc=0
  run_pytest "$pytest_log" tests -q -rs -p no:cacheprovider --durations=15 "$@" || py_rc=$?
  # (grep exits 1 when nothing matches: `|| true` keeps set -e/pipefail from ending the script.)
  no_cuda_skips=$( (grep -E '^SKIPPED \[[0-9]+\].*no CUDA device' "$pytest_log" || true) |
    sed -E 's/^SKIPPED \[([0-9]+)\].*/\1/' | awk '{s += $1} END {print s + 0}')
  other_skips=$( (grep -E '^SKIPPED \[[0-9]+\]' "$pytest_log" || true) | (grep -v 'no CUDA device' || true) |
    sed -E 's/^SKIPPED \[([0-9]+)\].*/\1/' | awk '{s += $1} END {print s + 0}')
  if ((py_rc != 0)); then
    finish "FAILED (pytest exit ${py_rc}; $(tally "$pytest_log"))"
  elif ((no_cuda_skips > 0)); then
    finish "FAILED (${no_cuda_skips} tests skipped for 'no CUDA device'; $(tally "$pytest_log"))"
  else
    finish "ok ($(tally "$pytest_log"); ${other_skips} other skips)"
  fi
  families=${CUDA_FAMILIES:-fallback sm80 sm90}
fi

# --- 4b. the CUDA tests once more with each kernel family forced (csrc/cuda/family.h) -------------
# The run above uses the default choice (on an H100 the Hopper family, then the tensor-core family,
# then the fallback); here every CUDA test runs with ENTROPY_ATTN_CUDA_FAMILY set to each family (a
# specialized family where it applies, the others elsewhere; sm90 runs only on compute capability
# 9.0, its tests skip visibly elsewhere).
for family in $families; do
  begin "pytest -k cuda, ENTROPY_ATTN_CUDA_FAMILY=${family}"
  family_log=$LOG_DIR/pytest_${family}.log
  fam_rc=0
  ENTROPY_ATTN_CUDA_FAMILY=$family run_pytest "$family_log" tests -q -k "cuda or CUDA" -p no:cacheprovider "$@" ||
    fam_rc=$?
  if ((fam_rc != 0)); then finish "FAILED ($(tally "$family_log"))"; else finish "ok ($(tally "$family_log"))"; fi
done

# --- 5. optional: the C++ suite ------------------------------------------------------------------
if [[ ${RUN_CPP:-0} != 0 ]]; then
  begin "C++ suite (CMake + CTest)"
  if RUN_PY=0 bash tests/run_all.sh; then finish ok; else finish "FAILED"; fi
fi

# --- 6. ptxas report and SASS check (registers, spills, shared memory; tensor-core instructions) --
begin "ptxas report + SASS check"
if "$PYTHON" scripts/ptxas_report.py 2>&1 | tee "$LOG_DIR/ptxas.log" &&
   "$PYTHON" scripts/sass_check.py 2>&1 | tee "$LOG_DIR/sass.log"; then finish ok; else finish "FAILED"; fi

# --- 6a. the kernel harness: every family's kernels checked (the fallback included) and the
# tensor-core families timed, without torch (results/gpu/harness.md and .json;
# scripts/kernel_harness.sh; the fallback's timings would spend device time on known figures) ----
begin "kernel harness (scripts/kernel_harness.sh)"
if [[ ${SKIP_BENCH:-0} != 0 ]]; then
  finish "skipped (SKIP_BENCH)"
elif bash scripts/kernel_harness.sh run --quick --families sm80,sm90 \
    --json results/gpu/harness.json --commit "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)" \
    >results/gpu/harness.md 2>"$LOG_DIR/harness.log"; then
  finish "ok (results/gpu/harness.md)"
else
  finish "FAILED (results/gpu/harness.md, $LOG_DIR/harness.log)"
fi

# --- 6a'. the sm80 backward's compact tiles (GPUs of 99 KB per block, which this GPU is not): the
# harness's checks with the shared memory per block capped as on such a GPU ------------------------
begin "kernel harness, 99 KB per block (compact sm80 backward)"
if ENTROPY_ATTN_CUDA_SMEM_PER_BLOCK=101376 bash scripts/kernel_harness.sh run --checks-only \
    --families sm80 >results/gpu/harness_checks_99KB.md 2>"$LOG_DIR/harness_99KB.log"; then
  finish "ok (results/gpu/harness_checks_99KB.md)"
else
  finish "FAILED (results/gpu/harness_checks_99KB.md, $LOG_DIR/harness_99KB.log)"
fi

# --- 6a''. the Hopper backward with dq by atomics in every call (the masked calls' way; the others
# take bulk reductions: csrc/cuda/family.h, kHopperBulkDqByDefault): its checks and timings, to set
# beside 6a's ------------------------------------------------------------------------------------
begin "kernel harness, sm90 dq by atomics"
if [[ ${SKIP_BENCH:-0} != 0 ]]; then
  finish "skipped (SKIP_BENCH)"
elif bash scripts/kernel_harness.sh run --quick --families sm90 --sm90-atomic-dq \
    --json results/gpu/harness_atomic_dq.json \
    --commit "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)" \
    >results/gpu/harness_atomic_dq.md 2>"$LOG_DIR/harness_atomic_dq.log"; then
  finish "ok (results/gpu/harness_atomic_dq.md)"
else
  finish "FAILED (results/gpu/harness_atomic_dq.md, $LOG_DIR/harness_atomic_dq.log)"
fi

# --- 6b. Nsight Compute profile of the default path (results/gpu/profile.md: throughput, tensor pipe,
# stall reasons per kernel); skipped where ncu is missing -------------------------------------------
begin "profile (benchmarks/gpu_profile.py)"
if [[ ${SKIP_BENCH:-0} != 0 ]]; then
  finish "skipped (SKIP_BENCH)"
elif ! command -v "${NCU:-ncu}" >/dev/null; then
  finish "skipped (no ncu)"
elif "$PYTHON" benchmarks/gpu_profile.py --ncu "${NCU:-ncu}" 2>&1 | tee "$LOG_DIR/profile.log"; then
  finish "ok (results/gpu/profile.md)"
else
  finish "FAILED"
fi

# --- 7. GPU benchmarks against SDPA (results/gpu/benchmark.md; windows and packed sequences:
# results/features/cuda.md; the fixed cost of a call: results/gpu/call_overhead.md; the causal calls
# under both launch orders, csrc/cuda/launch_order.h: results/gpu/launch_order.md) ----------------
begin "benchmark (benchmarks/gpu_vs_sdpa.py)"
if [[ ${SKIP_BENCH:-0} != 0 ]]; then
  finish "skipped (SKIP_BENCH)"
else
  # BENCH_ARGS is split on spaces on purpose (a list of options).
  # shellcheck disable=SC2086
  if "$PYTHON" benchmarks/gpu_vs_sdpa.py ${BENCH_ARGS:-} 2>&1 | tee "$LOG_DIR/benchmark.log" &&
     "$PYTHON" benchmarks/features.py --device cuda --dtype bfloat16 --heads 16 2>&1 |
       tee "$LOG_DIR/features.log" &&
     "$PYTHON" benchmarks/call_overhead.py | tee results/gpu/call_overhead.md &&
     "$PYTHON" benchmarks/gpu_vs_sdpa.py --dtype bf16 --head-dim 64 128 --seq 1024 4096 --causal yes \
       --launch-order auto heads --out-md results/gpu/launch_order.md \
       --out-json results/gpu/launch_order.json 2>&1 | tee "$LOG_DIR/launch_order.log"; then
    finish "ok (results/gpu/benchmark.md, results/features/cuda.md, results/gpu/call_overhead.md, results/gpu/launch_order.md)"
  else
    finish "FAILED"
  fi
fi
