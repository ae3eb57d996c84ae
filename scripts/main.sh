#!/usr/bin/env bash
# The main job: set up (scripts/setup.sh: packages, build), then run the length-generalization demo
# (examples/length_generalization.py: a small causal transformer trained on multi-query associative
# recall at one length and evaluated at 1x-16x, under the standard, "logn" and learnable scales,
# with the attention-entropy monitor on; about 10 minutes on 2 cores). It prints the Markdown table
# and writes it, the JSON and the plots into results/length_generalization/. Extra arguments go to
# the demo: `bash scripts/main.sh --quick` (about a minute, into results/length_generalization/quick/
# unless --out is given). The CPU benchmark suite is `python3 benchmarks/suite.py --quick`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
"${PYTHON:-python3}" examples/length_generalization.py "$@"
