"""The kernel harness (benchmarks/harness/kernel_harness.cu, scripts/kernel_harness.sh): it links
from the extension's kernel objects and the static CUDA runtime, answers its usage, and, without a
GPU, says so with exit code 2; on a GPU its checks of every family the device runs pass. (Its core,
the parameters and the float64 reference, is checked on the CPU by the C++ suite:
tests/cpp/test_cuda_emulation.cpp, KernelHarness.) Skipped, saying why, where the extension was
built without its CUDA kernels or nvcc is missing."""

from __future__ import annotations

import glob
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HARNESS = ROOT / "build" / "kernel_harness"
SCRIPT = ROOT / "scripts" / "kernel_harness.sh"


def _has_gpu() -> bool:
    """Whether nvidia-smi lists a GPU (the harness needs no torch to use it)."""
    if shutil.which("nvidia-smi") is None:
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def harness() -> Path:
    """build/kernel_harness, linked once per session from this tree's kernel objects; on a GPU
    machine with the device bundle and no build (scripts/device_bundle.sh install), the one it
    unpacked."""
    built = glob.glob(str(ROOT / "build" / "temp.*" / "csrc" / "cuda" / "sm80" / "instantiations" / "*.o"))
    if not built and HARNESS.exists():
        return HARNESS
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not found: the harness links with it")
    if not built:
        pytest.skip("the extension was built without its CUDA kernels (no objects under build/temp.*)")
    done = subprocess.run(["bash", str(SCRIPT), "build"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return HARNESS


def test_usage(harness: Path) -> None:
    """--help exits 0 with the usage; an unknown argument or family, or an option without its
    value, exits 2 naming it."""
    ok = subprocess.run([str(harness), "--help"], capture_output=True, text=True)
    assert ok.returncode == 0 and "usage: kernel_harness" in ok.stderr
    bad = subprocess.run([str(harness), "--bogus"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown argument '--bogus'" in bad.stderr
    fam = subprocess.run([str(harness), "--families", "sm70"], capture_output=True, text=True)
    assert fam.returncode == 2 and "unknown family 'sm70'" in fam.stderr
    bare = subprocess.run([str(harness), "--json"], capture_output=True, text=True)
    assert bare.returncode == 2 and "--json needs a value" in bare.stderr
    # (dq by bulk reductions is the default now; the switch left is to the atomics.)
    assert "--sm90-atomic-dq" in ok.stderr
    retired = subprocess.run([str(harness), "--sm90-bulk-dq"], capture_output=True, text=True)
    assert retired.returncode == 2 and "unknown argument '--sm90-bulk-dq'" in retired.stderr


def test_without_gpu_says_so(harness: Path) -> None:
    """No device: exit code 2 and a line saying so, not a crash."""
    if _has_gpu():
        pytest.skip("a GPU is visible: test_checks_pass_on_gpu runs instead")
    done = subprocess.run([str(harness), "--checks-only"], capture_output=True, text=True)
    assert done.returncode == 2 and "no CUDA device" in done.stderr, done.stdout + done.stderr
    atomics = subprocess.run([str(harness), "--checks-only", "--sm90-atomic-dq"], capture_output=True, text=True)
    assert atomics.returncode == 2 and "no CUDA device" in atomics.stderr, atomics.stdout + atomics.stderr


@pytest.mark.skipif(not _has_gpu(), reason="no GPU: the harness's checks need one (CUDA test)")
def test_checks_pass_on_gpu(harness: Path, tmp_path: Path) -> None:
    """On a GPU every check of every family it runs passes, and --json writes them."""
    out = tmp_path / "harness.json"
    done = subprocess.run([str(harness), "--checks-only", "--families", "fallback,sm80,sm90", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr
    assert ", 0 failed" in done.stdout and out.exists()
