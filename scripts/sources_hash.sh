#!/usr/bin/env bash
# Prints one hash of what the extension is built from: the files setup.py compiles or reads.
# scripts/setup.sh stamps its build with it; scripts/device_bundle.sh uses a packed library only
# when it was built from the sources that hash the same.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
find csrc setup.py pyproject.toml scripts/kernel_list.py scripts/cuda_home.py -type f -print0 |
  LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1
