#!/usr/bin/env bash
# The kernel harness (benchmarks/harness/kernel_harness.cu): the CUDA kernels checked and timed
# without torch or Python, on any GPU machine whatever its torch.
#
#   bash scripts/kernel_harness.sh build   # here: links build/kernel_harness from the kernel
#                                          # objects of the extension's build (scripts/setup.sh;
#                                          # nothing is compiled again but the harness's own file)
#                                          # and the static CUDA runtime
#   bash scripts/kernel_harness.sh run [ARGS]   # build if needed, then run it (ARGS: --quick,
#                                          # --checks-only, --families ..., --json F, --commit C)
#
# The executable depends on nothing but the driver: copy build/kernel_harness to the GPU machine
# (the device tool's `carry`) and run it there. It holds the architectures the extension was built
# for (TORCH_CUDA_ARCH_LIST; default 8.0;9.0+PTX, and sm_90a for the Hopper family).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=build/kernel_harness

build() {
  local objects=() cuda_home
  # The object of every instantiation unit kernels.toml lists (csrc/cuda/<family>/instantiations/
  # *.cu), as setup.py compiled it into build/temp.*: a missing one (no build, or a partial one)
  # stops the build here rather than linking an executable without its launchers.
  mapfile -t objects < <(python3 - <<'PY'
import glob, sys
sys.path.insert(0, "scripts")
import kernel_list
for unit in kernel_list.translation_units():
    rel = unit.relative_to(kernel_list.ROOT).with_suffix(".o")
    found = sorted(glob.glob(f"build/temp.*/{rel}"))
    print(found[-1] if found else f"MISSING {rel}")
PY
  )
  if printf '%s\n' "${objects[@]}" | grep -q '^MISSING'; then
    printf '%s\n' "${objects[@]}" | grep '^MISSING' | head -3 >&2
    echo "kernel_harness: kernel objects missing under build/temp.* (run scripts/setup.sh first)" >&2
    exit 1
  fi
  cuda_home=$(python3 scripts/cuda_home.py 2>/dev/null || dirname "$(dirname "$(command -v nvcc)")")
  mkdir -p build
  nvcc -std=c++17 -O2 -Icsrc -Ibenchmarks/harness -I"${cuda_home}/include" \
    -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ \
    -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__ \
    -Werror=all-warnings -Xcompiler=-Wall,-Wextra,-Werror \
    benchmarks/harness/kernel_harness.cu "${objects[@]}" -cudart static -o "$OUT"
  echo "kernel_harness: built ${OUT} from ${#objects[@]} kernel objects"
}

case "${1:-}" in
  build)
    build
    ;;
  run)
    shift
    [[ -x $OUT ]] || build
    exec "$OUT" "$@"
    ;;
  *)
    echo "usage: bash scripts/kernel_harness.sh build | run [ARGS]" >&2
    exit 2
    ;;
esac
