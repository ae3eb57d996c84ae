#!/usr/bin/env bash
# Builds the wheel as a user would (python -m build --wheel --no-isolation: it compiles against the
# installed torch), checks its torch pin, installs it into a new virtual environment and runs a
# smoke test from outside the source tree: the op forward and backward, the HF backend import, the
# monitor. Run by .ci/run after setup: setup.py compiles every build in build/temp.*, so the wheel
# build links the editable install's objects (ninja finds nothing to recompile) and only a source
# changed since then is compiled again.
#
# The environment sees the system's site-packages, for torch (its CUDA wheels are gigabytes; a
# fresh download per run is not affordable) and transformers; torch_ext itself comes from the wheel
# (the smoke test checks where it was imported from and that the wheel's requirements are met).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
OUT=build/wheel
start=$(date +%s)

build_env=(MAX_JOBS="${MAX_JOBS:-$(nproc)}")
if command -v ccache >/dev/null; then
  [[ -d /usr/lib/ccache ]] && build_env+=(PATH="/usr/lib/ccache:$PATH") || build_env+=(CC="ccache gcc" CXX="ccache g++")
  command -v nvcc >/dev/null && build_env+=(PYTORCH_NVCC="ccache nvcc")
  build_env+=(CCACHE_NOHASHDIR=true CCACHE_BASEDIR="$PWD" CCACHE_DEPEND=true)  # (as scripts/setup.sh)
fi
rm -rf "$OUT"
env "${build_env[@]}" "$PYTHON" -m build --wheel --no-isolation --outdir "$OUT" >"$OUT.log" 2>&1 ||
  { tail -40 "$OUT.log"; echo "wheel_check: the wheel build failed (log: $OUT.log)"; exit 1; }
wheel=$(ls "$OUT"/torch_ext-*.whl)
# ninja prints "[k/n] <command>" per compiled unit: 0 when setup's objects were all reused.
compiled=$(grep -cE '^\[[0-9]+/[0-9]+\] ' "$OUT.log" || true)
echo "wheel_check: built $(basename "$wheel") ($(du -h "$wheel" | cut -f1)) in $(($(date +%s) - start))s," \
     "${compiled} translation units compiled (the rest reused from build/temp.*)"
# .ci/run sets WHEEL_CHECK_REUSE=1: right after setup's build nothing may compile again.
if [[ ${WHEEL_CHECK_REUSE:-0} == 1 && $compiled != 0 ]]; then
  echo "wheel_check: the wheel build compiled ${compiled} units that setup had built (log: $OUT.log):" \
       "its build commands or build directory differ from setup.sh's" >&2
  exit 1
fi

# The wheel pins the torch it was compiled against (major.minor).
"$PYTHON" - "$wheel" <<'PY'
import sys, zipfile, torch
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    requires = [l for l in z.read(meta).decode().splitlines() if l.startswith("Requires-Dist: torch")]
major, minor = torch.__version__.split("+")[0].split(".")[:2]
assert requires == [f"Requires-Dist: torch=={major}.{minor}.*"], requires
print("wheel_check:", requires[0])
PY

venv=$PWD/$OUT/venv
"$PYTHON" -m venv --system-site-packages "$venv"
"$venv/bin/python" -m pip install -q --no-deps "$wheel"
cd /tmp
"$venv/bin/python" - "$venv" <<'PY'
import importlib.metadata as md, os, sys, torch
from packaging.requirements import Requirement
for req in map(Requirement, md.requires("torch_ext") or []):  # the wheel's requirements are met
    if req.marker is None or req.marker.evaluate():
        assert req.specifier.contains(md.version(req.name), prereleases=True), f"{req} but {md.version(req.name)}"
import torch_ext
venv = os.path.realpath(sys.argv[1])
assert os.path.realpath(torch_ext.__file__).startswith(venv), f"torch_ext imported from {torch_ext.__file__}"
q, k, v = (torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(3))
out, stats = torch_ext.attention(q, k, v, is_causal=True, scale="logn", return_stats=True)
(out.sum() + stats.entropy.sum()).backward()
assert q.grad is not None and torch.isfinite(q.grad).all()
import torch_ext.hf  # noqa: F401  (the transformers backend)
model = torch.nn.Module()
monitor = torch_ext.AttentionEntropyMonitor(model, every=1)
with monitor.step(0):
    torch_ext.policy.attend(q, k, v, policy=torch_ext.AttentionPolicy("logn"), is_causal=True)
assert monitor.latest, "the monitor recorded nothing"
print(f"wheel_check: torch_ext {torch_ext.__version__} from {os.path.dirname(torch_ext.__file__)}: op, backward, "
      "hf import and monitor ok")
PY
echo "wheel_check: ok in $(($(date +%s) - start))s"
