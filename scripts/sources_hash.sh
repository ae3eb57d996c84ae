#!/usr/bin/env bash
# Prints one hash of what the extension is built from: the files setup.py compiles or reads.
# scripts/setup.sh stamps its build with it; scripts/device_bundle.sh uses a packed library only
# when it was built from the sources that hash the same.
#   --harness: instead, the hash of the kernel harness's own sources (benchmarks/harness, linked
#   with the kernels by scripts/kernel_harness.sh), which a GPU session checks as well: a harness
#   packed before its source changed would time without what the change added.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
files=(csrc setup.py pyproject.toml scripts/kernel_list.py scripts/cuda_home.py)
[[ ${1:-} == --harness ]] && files=(benchmarks/harness scripts/kernel_harness.sh)
find "${files[@]}" -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1
