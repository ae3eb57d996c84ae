#!/usr/bin/env bash
# The kernel harness (benchmarks/harness/kernel_harness.cu): the CUDA kernels checked and timed
# without torch or Python, on any GPU machine whatever its torch.
#
#   bash scripts/kernel_harness.sh build   # here: links build/kernel_harness from the kernel
#                                          # objects of the extension's build (scripts/setup.sh;
#                                          # nothing is compiled again but the harness's own file)
#                                          # and the static CUDA runtime
#   bash scripts/kernel_harness.sh run [ARGS]   # link it again where there is a build, then run
#                                          # it (ARGS: --quick, --checks-only, --families ...,
#                                          # --json F, --commit C)
#
# The executable depends on nothing but the driver: copy build/kernel_harness to the GPU machine
# (the device tool's `carry`) and run it there. It holds the architectures the extension was built
# for (TORCH_CUDA_ARCH_LIST; default 8.0;9.0+PTX, and sm_90a for the Hopper family).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=build/kernel_harness

build() {
  local objects=() cuda_home nvcc temp defines=()
  # The object of every instantiation unit kernels.toml lists (csrc/cuda/<family>/instantiations/
  # *.cu), as setup.py compiled it, all from one build directory (the newest build/temp.*): a
  # missing one (no build, or a partial one) stops the build here rather than linking an
  # executable without its launchers. Those compiled on request only if that build has them
  # (torch_ext/_build_info.py: UNTESTED_KERNELS; csrc/cuda/untested_kernels.h), and then the
  # harness with them too.
  temp=$(ls -dt build/temp.* 2>/dev/null | head -1)
  if [[ -z $temp ]]; then
    echo "kernel_harness: no build/temp.* (run scripts/setup.sh first)" >&2
    exit 1
  fi
  mapfile -t objects < <(python3 - "$temp" <<'PY' || echo "FAILED"
import sys
from pathlib import Path
sys.path.insert(0, "scripts")
import kernel_list
untested = kernel_list.built_with_untested_kernels(Path("torch_ext/_build_info.py"))
if untested:
    print(f"-D{kernel_list.UNTESTED_MACRO}")
for unit in kernel_list.translation_units(untested):
    obj = Path(sys.argv[1]) / unit.relative_to(kernel_list.ROOT).with_suffix(".o")
    print(obj if obj.exists() else f"MISSING {obj}")
PY
  )
  if [[ ${objects[0]:-} == -D* ]]; then
    defines=("${objects[0]}")
    objects=("${objects[@]:1}")
  fi
  if ((${#objects[@]} == 0)) || printf '%s\n' "${objects[@]}" | grep -q '^MISSING\|^FAILED'; then
    printf '%s\n' "${objects[@]}" | grep '^MISSING\|^FAILED' | head -3 >&2
    echo "kernel_harness: kernel objects missing under ${temp} (run scripts/setup.sh first)" >&2
    exit 1
  fi
  cuda_home=$(python3 scripts/cuda_home.py 2>/dev/null || dirname "$(dirname "$(command -v nvcc)")")
  nvcc="${cuda_home}/bin/nvcc"
  [[ -x $nvcc ]] || nvcc=nvcc
  mkdir -p build
  "$nvcc" -std=c++17 -O2 -Icsrc -Ibenchmarks/harness -I"${cuda_home}/include" \
    -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ \
    -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__ \
    -Werror=all-warnings -Xcompiler=-Wall,-Wextra,-Werror "${defines[@]}" \
    benchmarks/harness/kernel_harness.cu "${objects[@]}" -cudart static -o "$OUT"
  echo "kernel_harness: built ${OUT} from ${#objects[@]} kernel objects (${temp})"
}

case "${1:-}" in
  build)
    build
    ;;
  run)
    shift
    # Linked again from this tree's build where there is one (seconds); else the one there is (the
    # GPU machine's, unpacked from the device bundle).
    if compgen -G "build/temp.*" >/dev/null || [[ ! -x $OUT ]]; then build >&2; fi
    exec "$OUT" "$@"
    ;;
  *)
    echo "usage: bash scripts/kernel_harness.sh build | run [ARGS]" >&2
    exit 2
    ;;
esac
