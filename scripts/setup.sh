#!/usr/bin/env bash
# Sets the project up on a fresh machine (Debian bookworm, Python 3.11, root or sudo, no torch):
# apt packages (compilers, ninja, ccache, cmake, GoogleTest), pinned pip packages, and the Python
# extension built in place. Used by scripts/main.sh (the main job) and .ci/run (the tests). Safe to
# re-run: installed pieces are skipped, and ccache keeps rebuilds short.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
export DEBIAN_FRONTEND=noninteractive
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_PROGRESS_BAR=off PIP_ROOT_USER_ACTION=ignore
export PYTHONUNBUFFERED=1

# Pinned versions (those used in development).
TORCH_VERSION=2.14.1
PY_DEPS=(pytest==9.0.3 hypothesis==6.155.2 numpy==2.4.6 packaging==26.2 tqdm==4.70.1 matplotlib==3.11.2
         transformers==5.23.0 tensorboard==2.21.0 build==1.2.2 ruff==0.17.5 clang-format==23.1.3)
APT_PACKAGES=(googletest libgtest-dev ccache ninja-build cmake g++)
# The CUTLASS/CuTe headers of the tensor-core kernels (one pinned version, read by setup.py and
# CMakeLists.txt too), and cuobjdump/nvdisasm for the SASS check of the CUDA kernels
# (scripts/sass_check.py); header and tool wheels, installed without dependencies.
CUTLASS_VERSION=$(cat csrc/cuda/cutlass_version.txt)
NO_DEPS=("nvidia-cutlass==${CUTLASS_VERSION}" nvidia-cuda-cuobjdump==13.2.86 nvidia-cuda-nvdisasm==13.2.78)

PYTHON=${PYTHON:-python3}
setup_start=$(date +%s)
phase_start=$setup_start
declare -a timings=()
phase() {  # phase NAME: ends the current phase and starts NAME
  local now
  now=$(date +%s)
  if [[ -n ${phase_name:-} ]]; then
    timings+=("$(printf '%-28s %5ds' "$phase_name" $((now - phase_start)))")
    echo "::: ${phase_name} took $((now - phase_start))s"
  fi
  phase_name=${1:-}
  phase_start=$now
  [[ -n $phase_name ]] && echo "::: ${phase_name}" || true
}
summary() {
  local rc=$?
  phase ""
  echo "::: timings"
  printf '  %s\n' "${timings[@]}"
  echo "::: total $(($(date +%s) - setup_start))s, exit code ${rc}"
}
trap summary EXIT

# --- system packages ----------------------------------------------------------------------
phase "apt packages"
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
  SUDO=""
  if [[ $(id -u) -ne 0 ]] && command -v sudo >/dev/null; then SUDO="sudo -n"; fi
  echo "installing: ${missing[*]}"
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  echo "all present: ${APT_PACKAGES[*]}"
fi

# --- Python packages ----------------------------------------------------------------------
phase "pip packages"
"$PYTHON" --version
"$PYTHON" -m pip install -q "torch==${TORCH_VERSION}" "${PY_DEPS[@]}"
"$PYTHON" -m pip install -q --no-deps "${NO_DEPS[@]}"
"$PYTHON" - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "cxx11 abi", torch.compiled_with_cxx11_abi(),
      "threads", torch.get_num_threads())
PY

# --- the Python extension -----------------------------------------------------------------
phase "build extension"
build_env=(MAX_JOBS="${MAX_JOBS:-$(nproc)}")
if command -v ccache >/dev/null; then
  # Debian's ccache masquerade directory (gcc, g++, c++, cc -> ccache), only for this command:
  # torch's BuildExtension resolves the compiler through PATH and accepts these (they report
  # COLLECT_GCC=g++). CMake (tests/run_all.sh) uses ccache as its compiler launcher instead.
  if [[ -d /usr/lib/ccache ]]; then
    build_env+=(PATH="/usr/lib/ccache:$PATH")
  else
    build_env+=(CC="ccache gcc" CXX="ccache g++")
  fi
  # nvcc (the CUDA sources) through ccache as well: torch.utils.cpp_extension runs $PYTORCH_NVCC.
  if command -v nvcc >/dev/null; then build_env+=(PYTORCH_NVCC="ccache nvcc"); fi
  # Paths under the tree enter ccache's hash relative to it, so that another clone of the project
  # hits the same entries (setup.py compiles every build in build/temp.*, which ninja reuses too).
  # Depend mode: ccache hashes the headers the compiler's -MD list names instead of running the
  # preprocessor first, which cost every miss 1.2-1.4 s more than the compile alone for a unit
  # that includes torch (7.1 -> 8.4 s for ops.cpp) and up to 2.8 s for a small .cu: a cold build
  # pays nothing for the cache (the same hits: tests/run_all.sh, scripts/wheel_check.sh and
  # scripts/device_bundle.sh set it as well).
  build_env+=(CCACHE_NOHASHDIR=true CCACHE_BASEDIR="$PWD" CCACHE_DEPEND=true)
  ccache --zero-stats >/dev/null 2>&1 || true
fi
# An editable install: `import torch_ext` works from any directory, and the package is this tree.
# CUDA sources are built when torch is a CUDA build and nvcc is found (setup.py).
# A re-run with nothing changed skips the build: the stamp records what the last successful build
# compiled (the build inputs' hashes, torch, the build switches). A build with warnings as errors
# also serves a later request without them, not the other way round.
stamp_file=build/extension.stamp
werror=${ENTROPY_ATTN_WERROR:-0}
stamp=$( { bash scripts/sources_hash.sh
           "$PYTHON" -c 'import torch; print(torch.__version__)'
           echo "cpu_only=${ENTROPY_ATTN_CPU_ONLY:-0} arch=${TORCH_CUDA_ARCH_LIST:-} nvcc=$(command -v nvcc || true)" \
                "untested=${ENTROPY_ATTN_UNTESTED_KERNELS:-0}"
         } | sha256sum | cut -d' ' -f1)
built=$(cat "$stamp_file" 2>/dev/null || true)
# The installed package must be this tree's: an editable install made from another clone also
# imports here (the current directory comes first on sys.path), so the check runs from /.
installed_here() {
  local tree=$PWD
  (cd / && "$PYTHON" -c 'import os, sys, torch_ext
sys.exit(os.path.dirname(os.path.realpath(torch_ext.__file__)) != os.path.realpath(sys.argv[1]))' \
     "$tree/torch_ext") 2>/dev/null
}
if [[ -n $built && ${built%% *} == "$stamp" && ${built##* } -ge $werror ]] && installed_here; then
  echo "extension up to date (build/extension.stamp): not rebuilt"
else
  build_start=$(date +%s)
  rm -f "$stamp_file"
  env "${build_env[@]}" "$PYTHON" -m pip install --no-build-isolation --no-deps -e .
  mkdir -p build && echo "$stamp $werror" >"$stamp_file"
  echo "extension built in $(($(date +%s) - build_start))s ($(find csrc/cuda -name '*.cu' | wc -l) CUDA" \
       "sources, TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-8.0;9.0+PTX}, ENTROPY_ATTN_CPU_ONLY=${ENTROPY_ATTN_CPU_ONLY:-0}," \
       "ENTROPY_ATTN_UNTESTED_KERNELS=${ENTROPY_ATTN_UNTESTED_KERNELS:-0})"
  if command -v ccache >/dev/null; then ccache --show-stats 2>/dev/null | grep -Ei "hit|miss" || true; fi
fi
