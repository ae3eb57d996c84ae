"""The tensor-core kernels' dropout decisions, checked on the CPU: tests/cpp/dropout_layouts.cu
(host code built by nvcc, no GPU) walks every thread of each accumulator tile that draws dropout
(sm80 and sm90, forward and backward) through the kernels' own grouping of Philox calls
(csrc/cuda/cute_utils.cuh: for_each_dropout_decision) and compares each decision with the op's
generator (csrc/dropout.h: Dropout::factor), which the CPU kernel and tests/reference.py share.
The kernels have not all run on a GPU; this pins the part of them that depends on the
accumulator layouts. Skipped, saying why, without nvcc or the pinned CUTLASS headers."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "tests" / "cpp" / "dropout_layouts.cu"
# The defines of the real build (setup.py): the kernel headers assume them.
NVCC_FLAGS = [
    "-std=c++20", "-O1", "--expt-relaxed-constexpr", "-Werror=all-warnings",
    "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__",
]  # fmt: skip


def cutlass_include() -> Path | None:
    """The headers of the installed nvidia-cutlass at the pinned version, or None."""
    pinned = (ROOT / "csrc" / "cuda" / "cutlass_version.txt").read_text().strip()
    spec = importlib.util.find_spec("cutlass_library")
    try:
        installed = importlib.metadata.version("nvidia-cutlass")
    except importlib.metadata.PackageNotFoundError:
        return None
    if spec is None or installed != pinned:
        return None
    return Path(spec.submodule_search_locations[0]) / "source" / "include"


def nvcc() -> str | None:
    """nvcc on PATH or under CUDA_HOME, or None."""
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    return shutil.which("nvcc") or shutil.which("nvcc", path=os.path.join(home, "bin"))


def run_host_program(source: Path, tmp_path: Path) -> str:
    """Builds a host-only check of the kernel headers (tests/cpp/*.cu) with nvcc and the pinned
    CUTLASS headers, runs it and returns what it printed; fails the test if either step fails, and
    skips it, saying why, without the toolchain."""
    compiler, include = nvcc(), cutlass_include()
    if compiler is None or include is None:
        pytest.skip("needs nvcc and the pinned nvidia-cutlass headers (the CUDA build's toolchain)")
    exe = tmp_path / source.stem
    cmd = [compiler, *NVCC_FLAGS, f"-I{ROOT / 'csrc'}", "-isystem", str(include), str(source), "-o", str(exe)]
    build = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert build.returncode == 0, f"{' '.join(cmd)} failed:\n{build.stdout}{build.stderr}"
    run = subprocess.run([str(exe)], capture_output=True, text=True, check=False, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def test_tensor_core_dropout_decisions_match_the_generator(tmp_path: Path) -> None:
    out = run_host_program(SOURCE, tmp_path)
    assert out.count(" ok") == 13 and "MISMATCH" not in out, out
