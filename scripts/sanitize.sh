#!/usr/bin/env bash
# The C++ code under AddressSanitizer and UndefinedBehaviorSanitizer.
#
#   bash scripts/sanitize.sh            # the GoogleTest suite (CTest), library and tests instrumented
#   bash scripts/sanitize.sh --pytest   # also the pytest suite's CPU kernels: the extension is built
#                                       # instrumented (CPU only) in a copy of the tree, and pytest
#                                       # runs against it with the sanitizer runtimes preloaded
#
# The C++ suite is configured in build/asan (-DENTROPY_ATTN_SANITIZE=address,undefined; the CUDA
# host code and the CPU emulation of the CUDA kernels are included when CUDA is found, device code
# is not instrumented). Any report aborts the test that made it, so the exit code is non-zero.
# libtorch and Python are not instrumented; leak checking is off (libtorch keeps its registries
# alive until exit).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
SANITIZERS=${SANITIZERS:-address,undefined}
BUILD_DIR=${BUILD_DIR:-build/asan}
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:abort_on_error=1:strict_string_checks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

torch_prefix=$("$PYTHON" -c 'import torch; print(torch.utils.cmake_prefix_path)')
gen=()
if [[ ! -f $BUILD_DIR/CMakeCache.txt ]] && command -v ninja >/dev/null; then gen=(-G Ninja); fi
# Device code is not instrumented: without a GPU it is compiled for one architecture only (it
# cannot run here; the Python build compiles it for all); with one, for CMakeLists.txt's list.
arch=(-DTORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-8.0}")
if [[ -z ${TORCH_CUDA_ARCH_LIST:-} ]] && command -v nvidia-smi >/dev/null &&
  nvidia-smi -L >/dev/null 2>&1; then
  arch=(-UTORCH_CUDA_ARCH_LIST)
fi
echo ">>> sanitized C++ suite (${SANITIZERS}) in ${BUILD_DIR}"
cmake -S . -B "$BUILD_DIR" "${gen[@]}" "${arch[@]}" -DENTROPY_ATTN_SANITIZE="$SANITIZERS" \
  -DENTROPY_ATTN_TENSOR_CORE_FAMILY=OFF -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$torch_prefix" -DENTROPY_ATTN_PYTHON="$(command -v "$PYTHON")" >/dev/null
cmake --build "$BUILD_DIR" --parallel "${JOBS:-$(nproc)}"
ctest --test-dir "$BUILD_DIR" --output-on-failure

if [[ ${1:-} == --pytest ]]; then
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
