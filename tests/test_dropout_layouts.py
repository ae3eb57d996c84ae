"""The tensor-core kernels' dropout decisions, checked on the CPU: tests/cpp/dropout_layouts.cu
(host code built by nvcc, no GPU) walks every thread of each accumulator tile that draws dropout
(sm80 and sm90, forward and backward) through the kernels' own grouping of Philox calls
(csrc/cuda/cute_utils.cuh: for_each_dropout_decision) and compares each decision with the op's
generator (csrc/dropout.h: Dropout::factor), which the CPU kernel and tests/reference.py share.
The kernels have not all run on a GPU; this pins the part of them that depends on the
accumulator layouts. Skipped, saying why, without nvcc or the pinned CUTLASS headers."""

from __future__ import annotations

import atexit
import functools
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import tempfile
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


@functools.cache
def _built(compiler: str, include: str) -> dict[Path, tuple[Path, int, str]]:
    """Every host check (tests/cpp/*.cu) built at once, one nvcc process each, into a directory
    removed at exit: source -> (executable, nvcc's exit code, its command and output). Each build
    takes about 20 s on one core, mostly nvcc's front ends; side by side they take the time of one."""
    out_dir = Path(tempfile.mkdtemp(prefix="entropy_attn_host_checks_"))
    atexit.register(shutil.rmtree, out_dir, ignore_errors=True)
    builds = []
    for source in sorted((ROOT / "tests" / "cpp").glob("*.cu")):
        exe, log = out_dir / source.stem, out_dir / f"{source.stem}.log"
        cmd = [compiler, *NVCC_FLAGS, f"-I{ROOT / 'csrc'}", "-isystem", include, str(source), "-o", str(exe)]
        with open(log, "w") as f:  # a file, not a pipe: a long error output cannot block nvcc
            builds.append((source, exe, log, cmd, subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)))
    return {source: (exe, proc.wait(), " ".join(cmd) + "\n" + log.read_text())
            for source, exe, log, cmd, proc in builds}


def run_host_program(source: Path) -> str:
    """Builds a host-only check of the kernel headers (tests/cpp/*.cu) with nvcc and the pinned
    CUTLASS headers (with the others, the first time: _built), runs it and returns what it printed;
    fails the test if either step fails, and skips it, saying why, without the toolchain."""
    compiler, include = nvcc(), cutlass_include()
    if compiler is None or include is None:
        pytest.skip("needs nvcc and the pinned nvidia-cutlass headers (the CUDA build's toolchain)")
    exe, returncode, output = _built(compiler, str(include))[source]
    assert returncode == 0, f"failed:\n{output}"
    run = subprocess.run([str(exe)], capture_output=True, text=True, check=False, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def test_tensor_core_dropout_decisions_match_the_generator() -> None:
    out = run_host_program(SOURCE)
    assert out.count(" ok") == 16 and "MISMATCH" not in out, out
