#!/usr/bin/env bash
# The main job: set up (scripts/setup.sh: packages, build), then run the CPU benchmark suite against
# torch's built-in attention (benchmarks/suite.py --quick: under two minutes; it prints the Markdown
# table and writes it, the JSON and the plots into benchmarks/results/). Extra arguments go to the
# suite, e.g. `bash scripts/main.sh --out /tmp/bench`; `python3 benchmarks/suite.py` is the full grid.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
"${PYTHON:-python3}" benchmarks/suite.py --quick "$@"
