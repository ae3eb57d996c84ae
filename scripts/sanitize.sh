#!/usr/bin/env bash
# The C++ code under AddressSanitizer and UndefinedBehaviorSanitizer.
#
#   bash scripts/sanitize.sh            # the GoogleTest suite (CTest), library and tests instrumented
#   bash scripts/sanitize.sh --pytest   # also the pytest suite's CPU kernels: the extension is built
#                                       # instrumented (CPU only) in a copy of the tree, and pytest
#                                       # runs against it with the sanitizer runtimes preloaded
#
# The C++ suite is configured in build/asan by tests/run_all.sh (-DENTROPY_ATTN_SANITIZE=
# address,undefined; the CPU emulation of the CUDA kernels is included when CUDA is found; CUDA
# sources are not instrumented). Any report aborts the test that made it, so the exit code is
# non-zero. CI runs the same build through `ENTROPY_ATTN_SANITIZE=address,undefined bash
# tests/run_all.sh`, so that the C++ suite is compiled once.
# libtorch and Python are not instrumented; leak checking is off (libtorch keeps its registries
# alive until exit).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
SANITIZERS=${SANITIZERS:-address,undefined}
BUILD_DIR=${BUILD_DIR:-build/asan}

echo ">>> sanitized C++ suite (${SANITIZERS}) in ${BUILD_DIR}"
# tests/run_all.sh configures, builds and runs it (the same CMake options as the plain suite).
ENTROPY_ATTN_SANITIZE="$SANITIZERS" BUILD_DIR="$BUILD_DIR" RUN_PY=0 RUN_PTXAS=0 bash tests/run_all.sh

if [[ ${1:-} == --pytest ]]; then
  export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:abort_on_error=1:strict_string_checks=1}
  export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
  copy=$(mktemp -d)/tree
  echo ">>> sanitized extension (CPU kernels) in ${copy}"
  git ls-files -z | xargs -0 cp --parents -t "$(mkdir -p "$copy" && echo "$copy")"
  flags="-fsanitize=${SANITIZERS} -fno-sanitize-recover=all -fno-omit-frame-pointer"
  (cd "$copy" && CFLAGS="$flags" LDFLAGS="-fsanitize=${SANITIZERS}" ENTROPY_ATTN_CPU_ONLY=1 \
    MAX_JOBS=${JOBS:-$(nproc)} "$PYTHON" setup.py build_ext --inplace >build.log 2>&1) ||
    { tail -30 "$copy/build.log"; exit 1; }
  preload="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)"
  echo ">>> pytest with ${preload} preloaded"
  (cd "$copy" && LD_PRELOAD="$preload" "$PYTHON" -m pytest tests -q -x -p no:cacheprovider \
    --deselect tests/test_packaging.py --deselect tests/test_build.py "${@:2}")
fi
