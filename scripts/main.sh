#!/usr/bin/env bash
# The main job: set up (scripts/setup.sh: packages, build), then run the forward benchmark of
# torch_ext.attention against F.scaled_dot_product_attention and print its Markdown table.
# Extra arguments go to the benchmark, e.g. `bash scripts/main.sh --seq 1024 4096 --causal`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
"${PYTHON:-python3}" benchmarks/forward_vs_sdpa.py "$@"
