#!/usr/bin/env bash
# Runs every test of the project: the Python suite (pytest, needs the extension built, e.g.
# `python3 setup.py build_ext --inplace`; without a GPU, tests/test_cuda.py a second time with its
# device set to the CPU, which checks the CUDA tests' own logic), then the C++ suite (CMake +
# LibTorch + GoogleTest, configured and built in build/cmake, run with CTest; it builds the CUDA
# sources too when CMakeLists.txt finds CUDA), then, when nvcc is there, the resource report of
# the CUDA kernels in the built extension (scripts/ptxas_report.py: results/ptxas/, fails on
# forbidden local memory) and the SASS check of the tensor-core family (scripts/sass_check.py).
# All three decide the exit code.
#
# pytest leaves a third of the machine idle (one Python process, with torch's threads in short
# bursts): the C++ suite compiles beside it and the ptxas report and SASS check, which need only
# the built extension, run beside everything, both at a lower priority (nice 10) so that the
# foreground step keeps the cores it can use. Their output is kept in build/run_all/ and printed
# when they are waited for. RUN_BESIDE=0 runs every step in turn, as written below.
#
#   bash tests/run_all.sh               # everything
#   RUN_CPP=0 bash tests/run_all.sh     # no C++ suite      RUN_PY=0: no pytest, RUN_PTXAS=0: no report
#                                       # RUN_CUDA_DRY_RUN=0: not the CUDA tests' logic on the CPU
#   bash tests/run_all.sh -k causal     # extra arguments go to pytest
#   ENTROPY_ATTN_SANITIZE=address,undefined bash tests/run_all.sh
#                                       # the C++ suite built with ASan and UBSan (in build/asan; any
#                                       # report fails its test): what CI runs, so that it compiles
#                                       # the C++ suite once
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
SANITIZE=${ENTROPY_ATTN_SANITIZE:-}
# (tests/cpp/CMakeLists.txt sets the sanitizers' options for CTest.)
[[ -n $SANITIZE ]] && BUILD_DIR=${BUILD_DIR:-build/asan}
BUILD_DIR=${BUILD_DIR:-build/cmake}
JOBS=${JOBS:-$(nproc)}

py_rc=skipped
cpp_rc=skipped
ptxas_rc=skipped
declare -a timings=()
t0=$(date +%s)
step_start=$t0
step_done() {  # step_done NAME: the foreground step since the last one ended
  local now
  now=$(date +%s)
  timings+=("$(printf '%-22s %5ds' "$1" $((now - step_start)))")
  echo ">>> $1: $((now - step_start))s"
  step_start=$now
}

# Steps beside the foreground (RUN_BESIDE=1): beside NAME FUNCTION starts one, beside_wait NAME
# waits for it, prints its output and returns its exit code.
LOGS=build/run_all
declare -A beside_pid=()
beside() {  # beside NAME FUNCTION
  local name=$1 fn=$2
  mkdir -p "$LOGS"
  (
    renice -n 10 -p "$BASHPID" >/dev/null 2>&1
    start=$(date +%s)
    rc=0
    "$fn" >"$LOGS/$name.log" 2>&1 || rc=$?
    echo "$(($(date +%s) - start))" >"$LOGS/$name.seconds"
    exit "$rc"
  ) &
  beside_pid[$name]=$!
}
beside_wait() {  # beside_wait NAME
  local name=$1 rc=0
  wait "${beside_pid[$name]}" || rc=$?
  cat "$LOGS/$name.log"
  local seconds
  seconds=$(cat "$LOGS/$name.seconds" 2>/dev/null || echo "?")
  timings+=("$(printf '%-22s %5ss (beside)' "$name" "$seconds")")
  echo ">>> ${name}: ${seconds}s, beside the other steps (exit code ${rc})"
  return "$rc"
}
BESIDE=1
[[ ${RUN_BESIDE:-1} != 0 ]] || BESIDE=0

# The C++ suite: configure and build (CMake + LibTorch + GoogleTest) in $BUILD_DIR.
cpp_build() {
  local rc=0 torch_prefix gen=() tc_family=OFF arch=()
  echo ">>> cmake configure (${BUILD_DIR}${SANITIZE:+, sanitizers ${SANITIZE}})"
  torch_prefix=$("$PYTHON" -c 'import torch; print(torch.utils.cmake_prefix_path)') || return 1
  # Choose the generator only for a new build directory (CMake refuses to switch).
  if [[ ! -f $BUILD_DIR/CMakeCache.txt ]] && command -v ninja >/dev/null; then gen=(-G Ninja); fi
  # Without a GPU nothing can run the tensor-core family's kernels here, and the Python build
  # (scripts/setup.sh) compiled them already, with warnings as errors, and scripts/ptxas_report.py
  # and scripts/sass_check.py check them (those compiled on request: scripts/device_bundle.sh make):
  # the C++ library leaves their device code out, so that CI compiles it once. With a GPU (nvidia-smi answers) it builds them too. For the same reason
  # the fallback's device code is compiled here for one architecture only (sm_80: the Python
  # build covers every architecture), unless TORCH_CUDA_ARCH_LIST says otherwise.
  arch=(-DTORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-8.0}")
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    tc_family=ON
    [[ -n ${TORCH_CUDA_ARCH_LIST:-} ]] || arch=(-UTORCH_CUDA_ARCH_LIST)  # CMakeLists.txt's default
  fi
  # The library with the kernels that wait for a GPU's tests (csrc/cuda/untested_kernels.h): the
  # emulation tests run them, some through the library's selection; without a GPU (the tensor-core
  # family off here) that compiles nothing more.
  cmake -S . -B "$BUILD_DIR" "${gen[@]}" "${arch[@]}" -DENTROPY_ATTN_UNTESTED_KERNELS=ON \
    -DENTROPY_ATTN_TENSOR_CORE_FAMILY="${ENTROPY_ATTN_TENSOR_CORE_FAMILY:-$tc_family}" \
    -DENTROPY_ATTN_SANITIZE="$SANITIZE" -DCMAKE_BUILD_TYPE="${CMAKE_BUILD_TYPE:-Release}" \
    -DCMAKE_PREFIX_PATH="$torch_prefix" \
    -DENTROPY_ATTN_PYTHON="$(command -v "$PYTHON")" || return 1
  echo ">>> cmake build"
  # (CMake runs ccache as the compiler launcher: paths under the tree enter its hash relative to
  # it, so that another clone of the project, CI's, hits the same entries; depend mode as
  # scripts/setup.sh explains.)
  CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=true CCACHE_DEPEND=true cmake --build "$BUILD_DIR" --parallel "$JOBS" ||
    rc=$?
  return "$rc"
}

# The resource report of the CUDA kernels and the SASS check of the built extension.
ptxas_and_sass() {
  local rc=0
  echo ">>> ptxas report"
  "$PYTHON" scripts/ptxas_report.py || rc=$?
  if git rev-parse --git-dir >/dev/null 2>&1 && ! git diff --quiet -- results/ptxas 2>/dev/null; then
    echo ">>> note: results/ptxas/ differs from the committed report: commit it"
  fi
  # The machine code of the built extension: the tensor-core family uses HMMA, LDSM, LDGSTS, ...
  echo ">>> SASS check"
  "$PYTHON" scripts/sass_check.py || rc=$?
  return "$rc"
}

run_ptxas=0
if [[ ${RUN_PTXAS:-1} != 0 && ${ENTROPY_ATTN_CPU_ONLY:-0} != 1 ]] && command -v nvcc >/dev/null; then
  run_ptxas=1
  ptxas_rc=0
  ((BESIDE)) && beside "ptxas report + SASS" ptxas_and_sass
fi
cpp_beside=0
if [[ ${RUN_CPP:-1} != 0 && ${RUN_PY:-1} != 0 ]] && ((BESIDE)); then
  cpp_beside=1
  beside "C++ configure and build" cpp_build
fi

if [[ ${RUN_PY:-1} != 0 ]]; then
  echo ">>> pytest"
  "$PYTHON" -m pytest tests -q "$@"
  py_rc=$?
  step_done "pytest"
  # Without a GPU the CUDA tests skip; their logic (shapes, references, tolerances, what each test
  # expects of the op) still runs, on the CPU op, so that a change of the op's interface cannot
  # leave them broken until a GPU session.
  # (.ci/run leaves this run out: scripts/device_bundle.sh check runs it under the GPU machines'
  # torch, where these tests will run.)
  if [[ ${RUN_CUDA_DRY_RUN:-1} != 0 ]] && ! { command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; }; then
    echo ">>> pytest: the CUDA tests' logic on the CPU (ENTROPY_ATTN_CUDA_TEST_DEVICE=cpu)"
    ENTROPY_ATTN_CUDA_TEST_DEVICE=cpu "$PYTHON" -m pytest tests/test_cuda.py -q "$@" || py_rc=1
    step_done "pytest CUDA dry run"
  fi
fi

if [[ ${RUN_CPP:-1} != 0 ]]; then
  cpp_rc=0
  if ((cpp_beside)); then
    beside_wait "C++ configure and build" || cpp_rc=$?
    step_start=$(date +%s)
  else
    cpp_build || cpp_rc=$?
    step_done "C++ configure and build"
  fi
  if ((cpp_rc == 0)); then
    echo ">>> ctest"
    ctest --test-dir "$BUILD_DIR" --output-on-failure --parallel "$JOBS" || cpp_rc=$?
    step_done "ctest"
  fi
fi

if ((run_ptxas)); then
  if ((BESIDE)); then
    beside_wait "ptxas report + SASS" || ptxas_rc=$?
  else
    ptxas_and_sass || ptxas_rc=$?
    step_done "ptxas report + SASS"
  fi
fi

echo ">>> timings"
printf '    %s\n' "${timings[@]}"
echo ">>> pytest: ${py_rc}, C++ (cmake/ctest): ${cpp_rc}, ptxas report + SASS check: ${ptxas_rc}, total $(($(date +%s) - t0))s"
for rc in "$py_rc" "$cpp_rc" "$ptxas_rc"; do
  if [[ $rc != skipped && $rc != 0 ]]; then exit 1; fi
done
exit 0
