#!/usr/bin/env bash
# The extension for a GPU machine that has its own torch and no network (a lent or air-gapped
# node): there scripts/setup.sh cannot install the pinned torch, and the build must compile against
# the torch that is installed (torch 2.11, the GPU machines' own, builds extensions as C++17; the
# pinned 2.14 as C++20).
#
#   bash scripts/device_bundle.sh make      # here, with network: build against DEVICE_TORCH and
#                                           # pack .device/ (library, build info, wheels)
#   bash scripts/device_bundle.sh install   # there (scripts/gpu_suite.sh does it when .device/
#                                           # exists): the packed library if it was built from
#                                           # these sources for this torch, else a build there;
#                                           # and build/kernel_harness, which needs no torch
#   bash scripts/device_bundle.sh check     # CI: the sources still build against DEVICE_TORCH
#   bash scripts/device_bundle.sh copy      # only check's copy of the working tree: CI copies it,
#                                           # then runs `DEVICE_CHECK_COPIED=1 ... check` beside
#                                           # the tests, which write in the tree
#   bash scripts/device_bundle.sh venv      # only the virtual environment of make and check (CI
#                                           # makes it while setup compiles)
#   bash scripts/device_bundle.sh baseline  # only the harnesses of BASELINE and STEPS (below),
#                                           # packed again into .device/ with make's own
#   bash scripts/device_bundle.sh history   # the baseline and the steps `make` would build
#
# `make` builds a copy of the working tree (uncommitted edits included) in build/device/ with a
# virtual environment holding DEVICE_TORCH (default 2.11.0), for the architectures of DEVICE_ARCH
# (default 9.0: an H100/H200; "8.0;9.0" for an A100 too), with the kernels that are compiled on
# request where kernels.toml lists any (ENTROPY_ATTN_UNTESTED_KERNELS=1: a GPU session tests them;
# so does a build there). It packs the stripped library, the
# kernel harness (scripts/kernel_harness.sh), the sources' hash and the wheels a build there needs
# (nvidia-cutlass's headers, a setuptools that reads pyproject.toml). .device/ is ignored by git:
# copy it along. DEVICE_VENV names an existing virtual environment with DEVICE_TORCH to build in
# instead of build/device/venv.
#
# `make` also packs the kernel harness of BASELINE (default: the kernels last timed on a GPU, see
# below; BASELINE=none: not), built the same way from that commit's tree, so that a GPU session
# times the kernels changed since against them in the same lease (scripts/gpu_session.sh,
# harness_ab.md): a GPU lent for minutes, on another machine each time, cannot compare with the
# figures of an earlier lease to a few percent. And the harnesses of STEPS, commits between the
# two, so that harness_ab.md also says what each group of changes made since bought (several
# sessions without a GPU may have changed the kernels, each by a modelled gain); each commit's is
# built once (build/device/harness_cache), so that a `make` after an edit builds only the current
# one again. The harnesses go
# into one archive, compressed as one stream with a window wider than a harness: the kernels that
# did not change between the commits are the same bytes, stored once (five harnesses of 69 MB for
# sm_90: 19.5 MiB together, 47 MB compressed one by one, where everything carried must fit 64 MiB).
#
# `check` is the cheap half of `make`, for every CI run: a CPU-only build of the copy against
# DEVICE_TORCH with warnings as errors, the host sources of the CUDA kernels (which only a CUDA
# build compiles) compiled against its headers as C++17, and the tests a GPU session runs first
# (tests/test_cuda.py, on the CPU) under that torch. The kernels themselves include no torch
# header; `make` compiles them.
set -euo pipefail
T0=$(date +%s)
note() {  # note TEXT: a step, with the seconds since the script started
  echo "::: $* [$(($(date +%s) - T0))s]"
}

cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_PROGRESS_BAR=off PIP_ROOT_USER_ACTION=ignore
BUNDLE=.device
DEVICE_TORCH=${DEVICE_TORCH:-2.11.0}
DEVICE_ARCH=${DEVICE_ARCH:-9.0}
SETUPTOOLS=setuptools==80.9.0
CUTLASS=nvidia-cutlass==$(cat csrc/cuda/cutlass_version.txt)
# The GPU machines' versions where they matter to the tests (transformers: the HF backend).
TEST_DEPS=(pytest==9.0.3 hypothesis==6.155.2 numpy==2.4.6 packaging==26.2 tqdm==4.70.1 transformers==5.17.0)
SRC=build/device/src
HARNESSES=build/device/harnesses
HARNESS_CACHE=build/device/harness_cache
# The last kernels timed on a GPU: 818c147's (results/gpu/benchmark.md, 2026-12-04) with the Hopper
# backward's dq by bulk reductions, their default since d499297, which changed nothing else in
# the kernels. Move it when a GPU session has timed newer kernels and kept them.
BASELINE=${BASELINE:-d499297}
# The commits between BASELINE and these sources whose kernels a GPU session times as well, oldest
# first (STEPS="": none). Each ends a group of kernel changes compiled and emulated, not timed:
#   7ae3efb  the forward's row max and sums in partial chains (f258482); the backward's dV issued
#            early, dK left in flight, lambda folded into the exponent (31a8340, 141de3e, 08e41de);
#   73fc850  the backward's query blocks without a per-score check (9881e58, af02a2a) and the causal
#            launch order's sections of 1.5 waves (e5b3e31);
#   0f6cce5  the backward's S and dP as whole 64 x 64 slices at D = 128;
#   eaf5345  one dS tile where no d lambda is asked for (c0437a2; the harnesses from here on time
#            the backward without d lambda, those of the commits before with it);
#   948b773  the dS loop of the blocks off every edge without the select, lambda dS in one FFMA and
#            an FMUL;
#   40e6e8e  the products' operands sliced by the warpgroup, in the backward and the forward (their
#            descriptors in uniform registers);
# the current sources then give the backward of full attention at D = 64 what the other kernels
# without a mask have (the warpgroup's slice, the checks' own branch, one dS tile: e5868d1), and
# let each consumer warpgroup wait for its own P where S is one slice (kOwnP; at D = 128 the only
# change after 40e6e8e). Move them with BASELINE.
STEPS=${STEPS-7ae3efb 73fc850 0f6cce5 eaf5345 948b773 40e6e8e}
venv=${DEVICE_VENV:-build/device/venv}

# A failed build's first errors, and the end of the script.
build_failed() {
  grep -E "error|Error" build/device/build.log | head -20
  echo "build failed: build/device/build.log" >&2
  exit 1
}

# $venv with DEVICE_TORCH and the build and test dependencies; an absolute path afterwards. The
# one made here is complete once it holds its stamp (the packages it was made with): one whose
# making was cut short (torch installed, not yet CUTLASS's headers) or that other pins made is made
# again. A given DEVICE_VENV is checked for its torch only.
device_venv() {
  local pins="torch==${DEVICE_TORCH} ${SETUPTOOLS} ninja ${TEST_DEPS[*]} ${CUTLASS}"
  if [[ ! -x $venv/bin/python ]] || ! "$venv/bin/python" -c "import torch, sys
sys.exit(torch.__version__.split('+')[0] != '$DEVICE_TORCH')" 2>/dev/null ||
     [[ -z ${DEVICE_VENV:-} && $(cat "$venv/device_venv.pins" 2>/dev/null) != "$pins" ]]; then
    if [[ -n ${DEVICE_VENV:-} ]]; then
      echo "DEVICE_VENV=${DEVICE_VENV} has no torch ${DEVICE_TORCH}" >&2
      exit 1
    fi
    note "virtual environment with torch ${DEVICE_TORCH} (${venv})"
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q "torch==${DEVICE_TORCH}" "$SETUPTOOLS" ninja "${TEST_DEPS[@]}"
    "$venv/bin/pip" install -q --no-deps "$CUTLASS"
    echo "$pins" >"$venv/device_venv.pins"
  fi
  venv=$(cd "$venv" && pwd)
}

# A copy of the working tree (uncommitted edits included, ignored files not) in $SRC.
copy_tree() {
  note "copy of the working tree (${SRC})"
  rm -rf "$SRC"
  mkdir -p "$SRC"
  # (--ignore-failed-read: a tracked file deleted in the working tree is left out, as it is there.)
  git ls-files -co --exclude-standard -z | tar -c --null -T - --ignore-failed-read -f - 2>/dev/null |
    tar -x -C "$SRC"
}

# Builds $SRC in place with the environment's python; extra VAR=value settings as arguments.
build_copy() {
  local build_env=(PATH="$venv/bin:$PATH" MAX_JOBS="${MAX_JOBS:-$(nproc)}" ENTROPY_ATTN_WERROR=1 "$@")
  if command -v ccache >/dev/null; then
    [[ -d /usr/lib/ccache ]] && build_env[0]=PATH="$venv/bin:/usr/lib/ccache:$PATH"
    build_env+=(PYTORCH_NVCC="ccache nvcc" CCACHE_NOHASHDIR=true CCACHE_BASEDIR="$PWD/$SRC" CCACHE_DEPEND=true)
  fi
  (cd "$SRC" && env "${build_env[@]}" python setup.py build_ext --inplace >../build.log 2>&1) || build_failed
}

make_bundle() {
  local start
  start=$(date +%s)
  device_venv
  copy_tree
  note "build against torch ${DEVICE_TORCH}, TORCH_CUDA_ARCH_LIST=${DEVICE_ARCH}, with any kernels on request"
  build_copy TORCH_CUDA_ARCH_LIST="$DEVICE_ARCH" ENTROPY_ATTN_UNTESTED_KERNELS=1
  # The resource report and the SASS check of these kernels (scripts/ptxas_report.py,
  # scripts/sass_check.py), which CI runs on its build, without the kernels compiled on request:
  # here with them, so that a spill or a missing tensor-core instruction in those shows before a
  # GPU session (reports in build/device/ptxas and build/device/sass).
  note "ptxas report and SASS check of this build"
  (cd "$SRC" && python3 scripts/ptxas_report.py --out ../ptxas && python3 scripts/sass_check.py --out ../sass) ||
    { echo "the ptxas report or the SASS check failed on the device build" >&2; exit 1; }
  note "pack ${BUNDLE}/"
  rm -rf "$BUNDLE"
  mkdir -p "$BUNDLE/wheels"
  # Without its debug sections (Python's -g; -lineinfo lives in the fatbin and stays), and
  # compressed: the machine code of ~450 kernels shrinks about tenfold, under what can be copied.
  strip --strip-debug -o build/device/_C.abi3.so "$SRC/torch_ext/_C.abi3.so"
  xz -T0 -c build/device/_C.abi3.so >"$BUNDLE/_C.abi3.so.xz"
  cp "$SRC/torch_ext/_build_info.py" "$BUNDLE/"
  # The kernel harness (scripts/kernel_harness.sh), linked from the same kernel objects: the
  # kernels checked and timed without torch, whatever the machine's torch accepts.
  (cd "$SRC" && bash scripts/kernel_harness.sh build) >build/device/harness.log 2>&1 ||
    { tail -5 build/device/harness.log >&2; exit 1; }
  rm -rf "$HARNESSES"
  mkdir -p "$HARNESSES"
  cp "$SRC/build/kernel_harness" "$HARNESSES/kernel_harness"
  bash "$SRC/scripts/sources_hash.sh" >"$BUNDLE/sources.sha256"
  bash "$SRC/scripts/sources_hash.sh" --harness >"$BUNDLE/harness.sha256"
  echo "$DEVICE_ARCH" >"$BUNDLE/arch"
  "$venv/bin/pip" download -q --no-deps -d "$BUNDLE/wheels" "$CUTLASS" "$SETUPTOOLS" 2> >(grep -v "is ignored" >&2)
  make_history
  ls -l "$BUNDLE" "$BUNDLE/wheels"
  note "${BUNDLE}/ made in $(($(date +%s) - start))s (torch ${DEVICE_TORCH}, arch ${DEVICE_ARCH})"
}

# short_name REV: the short name of commit REV, or a message and exit.
short_name() {
  git rev-parse --short "$1^{commit}" 2>/dev/null || {
    echo "device_bundle: ${1} names no commit (BASELINE, STEPS)" >&2
    exit 1
  }
}

# What a commit's harness is built with besides its tree: the architectures, the virtual
# environment's pins (torch and CUTLASS's headers) and nvcc, as one short hash.
harness_toolchain() {
  {
    echo "$DEVICE_ARCH"
    cat "$venv/device_venv.pins" 2>/dev/null || echo "$DEVICE_TORCH"
    nvcc --version 2>/dev/null || echo "no nvcc"
  } | sha256sum | cut -c1-16
}

# harness_of REV FILE: the kernel harness of commit REV, for DEVICE_ARCH, as FILE: that commit's
# tree (git archive) built with its own setup.py and scripts/kernel_harness.sh in build/device/at
# (ccache makes the kernels that no commit since changed cheap). Kept in $HARNESS_CACHE under the
# commit and harness_toolchain: a commit's tree never changes, so a `make` after an edit builds the
# current harness again, not those of the baseline and the steps (each minutes on 2 cores).
harness_of() {
  local rev=$1 file=$2 dir=build/device/at saved_src=$SRC cached
  cached=$HARNESS_CACHE/$(git rev-parse "${rev}^{commit}")_$(harness_toolchain)
  if [[ -x $cached ]]; then
    note "the harness of ${rev}, built before (${cached})"
    cp "$cached" "$file"
    return
  fi
  note "the harness of ${rev}"
  rm -rf "$dir"
  mkdir -p "$dir"
  git archive "$rev" | tar -x -C "$dir"
  SRC=$dir
  build_copy TORCH_CUDA_ARCH_LIST="$DEVICE_ARCH"
  SRC=$saved_src
  (cd "$dir" && bash scripts/kernel_harness.sh build) >"build/device/harness_${rev}.log" 2>&1 ||
    { tail -5 "build/device/harness_${rev}.log" >&2; exit 1; }
  cp "$dir/build/kernel_harness" "$file"
  mkdir -p "$HARNESS_CACHE"
  cp "$file" "$cached.part" && mv "$cached.part" "$cached"
}

# kept_steps BASE: the short names of the commits of STEPS that make a chain from commit BASE to
# HEAD, on one line: each after the one before it (BASE first) and before HEAD, HEAD itself not
# (its kernels are the current ones); the others left out with a line on stderr (a step out of
# that order would say nothing of the changes between). A name that is no commit fails it.
kept_steps() {
  local prev=$1 rev head kept=()
  head=$(git rev-parse --short HEAD)
  for rev in $STEPS; do
    # (Explicitly: errexit does not reach into a command substitution.)
    rev=$(short_name "$rev") || exit 1
    if [[ $rev == "$prev" || $rev == "$head" ]] || ! git merge-base --is-ancestor "$prev" "$rev" ||
       ! git merge-base --is-ancestor "$rev" HEAD; then
      echo "device_bundle: step ${rev} left out: not after ${prev} and before HEAD" >&2
      continue
    fi
    kept+=("$rev")
    prev=$rev
  done
  echo "${kept[*]}"
}

# The harnesses of BASELINE and STEPS beside make's own in $HARNESSES (kernel_harness_baseline,
# kernel_harness_<commit>; their names in .device/baseline and .device/steps, oldest first), then
# all of them packed as .device/harnesses.tar.xz: one xz stream, in the order of their commits,
# whose 256 MiB window spans more than a harness, so that what one shares with the one before it
# is stored once (install unpacks it).
make_history() {
  local name kept names=() members=()
  [[ -x $HARNESSES/kernel_harness ]] || {
    echo "device_bundle: no ${HARNESSES}/kernel_harness (run make first)" >&2
    exit 1
  }
  device_venv
  rm -f "$HARNESSES"/kernel_harness_* "$BUNDLE/baseline" "$BUNDLE/steps"
  mkdir -p "$BUNDLE"
  if [[ $BASELINE != none ]]; then
    name=$(short_name "$BASELINE")
    kept=$(kept_steps "$name")
    read -ra names <<<"$kept"
    harness_of "$name" "$HARNESSES/kernel_harness_baseline"
    echo "$name" >"$BUNDLE/baseline"
    members+=(kernel_harness_baseline)
    for rev in "${names[@]}"; do
      harness_of "$rev" "$HARNESSES/kernel_harness_${rev}"
      members+=("kernel_harness_${rev}")
    done
    echo "${names[*]}" >"$BUNDLE/steps"
  fi
  members+=(kernel_harness)
  note "pack the harnesses (one xz stream)"
  # (-T1: one block, so that a later harness finds the earlier ones in the window; the window takes
  # about 2.7 GiB to compress, 2 minutes for five harnesses, and 256 MiB to unpack.)
  tar -C "$HARNESSES" -cf - "${members[@]}" | xz -T1 --lzma2=preset=9,dict=256MiB >"$BUNDLE/harnesses.tar.xz"
}

# What make_history would build: the baseline and the steps kept (kept_steps), on one line.
list_history() {
  local name kept
  if [[ $BASELINE == none ]]; then
    echo "no baseline"
    return
  fi
  name=$(short_name "$BASELINE")
  kept=$(kept_steps "$name")
  echo "baseline ${name}, steps: ${kept}"
}

check_build() {
  local start unit include_flags
  start=$(date +%s)
  device_venv
  [[ ${DEVICE_CHECK_COPIED:-0} == 1 && -d $SRC ]] || copy_tree
  note "CPU-only build against torch ${DEVICE_TORCH}"
  build_copy ENTROPY_ATTN_CPU_ONLY=1
  note "the CUDA host sources against torch ${DEVICE_TORCH}'s headers, C++17"
  # The flags of setup.py's CUDA build for these files (torch's include paths as system headers,
  # CUDA's headers, warnings as errors, the untested kernels as `make` builds them), without code
  # generation; the toolkit root as setup.py finds it.
  CUDA_HOME=$(python3 scripts/cuda_home.py) || {
    echo "no CUDA toolkit: the CUDA host sources cannot be checked" >&2
    exit 1
  }
  export CUDA_HOME
  mapfile -t include_flags < <("$venv/bin/python" - <<'PY'
from torch.utils import cpp_extension

for path in cpp_extension.include_paths(device_type="cuda"):
    print("-isystem"); print(path)
PY
  )
  # (As one translation unit, as setup.py compiles them: setup.py's unity_sources.)
  for unit in "$SRC"/csrc/cuda/*.cpp; do echo "#include \"${unit#"$SRC"/csrc/}\""; done |
    g++ -std=c++17 -fsyntax-only -fopenmp -Wall -Wextra -Werror -I"$SRC/csrc" "${include_flags[@]}" \
      -DTORCH_API_INCLUDE_EXTENSION_H -DPy_LIMITED_API=0x030A0000 -DTORCH_EXTENSION_NAME=_C \
      -DAT_PER_OPERATOR_HEADERS -DTORCH_ASSERT_ONLY_METHOD_OPERATORS -DENTROPY_ATTN_UNTESTED_KERNELS -x c++ -
  echo "  ok $(cd "$SRC" && echo csrc/cuda/*.cpp)"
  note "tests under torch ${DEVICE_TORCH} (the CUDA tests' logic on the CPU)"
  # (Less test_large_grid: on the CPU its 70,000 heads only time the CPU op against the reference,
  # 21 of these tests' 90 s, under this torch as under any.)
  (cd "$SRC" && ENTROPY_ATTN_CUDA_TEST_DEVICE=cpu "$venv/bin/python" -m pytest -q -p no:cacheprovider \
     tests/test_build.py tests/test_cuda.py tests/test_gpu_benchmark_script.py tests/test_hf.py \
     -k "not test_large_grid")
  note "the build against torch ${DEVICE_TORCH} checked in $(($(date +%s) - start))s"
}

install_bundle() {
  local python=${PYTHON:-python3} torch_version
  # The kernel harnesses first: they need no torch (scripts/kernel_harness.sh run).
  if [[ -f $BUNDLE/harnesses.tar.xz && -f $BUNDLE/sources.sha256 &&
        $(cat "$BUNDLE/sources.sha256") == "$(bash scripts/sources_hash.sh)" ]]; then
    mkdir -p build
    "$python" -c "import sys, tarfile
with tarfile.open(sys.argv[1], 'r:xz') as tar: tar.extractall(sys.argv[2], filter='tar')" \
      "$BUNDLE/harnesses.tar.xz" build
    note "build/kernel_harness unpacked (the kernels checked and timed without torch)" \
      "$([[ -f $BUNDLE/baseline ]] && echo "with those of $(cat "$BUNDLE/baseline") and of: $(cat "$BUNDLE/steps")")"
  fi
  torch_version=$("$python" -c "import torch; print(torch.__version__.split('+')[0])")
  if [[ -f $BUNDLE/sources.sha256 && $(cat "$BUNDLE/sources.sha256") == "$(bash scripts/sources_hash.sh)" ]] &&
     grep -q "TORCH_VERSION = '${torch_version}'" "$BUNDLE/_build_info.py"; then
    note "the packed library (built from these sources for torch ${torch_version}, arch $(cat "$BUNDLE/arch"))"
    "$python" -c "import lzma, shutil, sys
with lzma.open(sys.argv[1]) as src, open(sys.argv[2], 'wb') as dst: shutil.copyfileobj(src, dst)" \
      "$BUNDLE/_C.abi3.so.xz" torch_ext/_C.abi3.so
    cp "$BUNDLE/_build_info.py" torch_ext/
  else
    note "no packed library for these sources and torch ${torch_version}: building here"
    mkdir -p build/device
    # The carried wheels into a private directory: nothing is fetched, the system is unchanged.
    "$python" -m pip install -q --no-index --no-deps --no-compile --target build/device/site "$BUNDLE"/wheels/*.whl
    local start
    start=$(date +%s)
    PYTHONPATH="$PWD/build/device/site${PYTHONPATH:+:$PYTHONPATH}" MAX_JOBS="${MAX_JOBS:-$(nproc)}" \
      TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$(cat "$BUNDLE/arch" 2>/dev/null || echo 9.0)}" \
      ENTROPY_ATTN_UNTESTED_KERNELS="${ENTROPY_ATTN_UNTESTED_KERNELS:-1}" \
      "$python" setup.py build_ext --inplace >build/device/build.log 2>&1 || build_failed
    note "built in $(($(date +%s) - start))s"
  fi
  "$python" -c "import torch_ext, torch; print('torch_ext', torch_ext.__version__, 'on torch', torch.__version__)"
}

case ${1:-} in
  make) make_bundle ;;
  check) check_build ;;
  copy) copy_tree ;;
  install) install_bundle ;;
  venv) device_venv ;;
  baseline) make_history ;;
  history) list_history ;;
  *)
    echo "usage: $0 make|check|copy|install|venv|baseline|history" >&2
    exit 2
    ;;
esac
