"""scripts/gpu_session.sh, the checks that fit one command on a GPU lent for minutes: without a GPU
it stops at once, with exit code 2 and a message, before it installs or writes anything."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _has_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None and subprocess.run(
        ["nvidia-smi", "-L"], capture_output=True).returncode == 0


@pytest.mark.skipif(_has_gpu(), reason="a GPU is here: the script would run its checks")
def test_stops_without_a_gpu(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_session.sh")], cwd=ROOT,
                          env={**os.environ, "OUT": str(out)}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "gpu_session: no GPU here" in done.stderr
    assert not any(out.iterdir()), "it wrote results without a GPU"


def test_refuses_a_bundle_of_other_sources(tmp_path: Path) -> None:
    """With a GPU (a stand-in nvidia-smi) but a .device/ made from other sources, it stops before
    installing: the library would be built on the GPU machine, at the lease's expense."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "gpu_session.sh", tmp_path / "scripts")
    (tmp_path / "scripts" / "sources_hash.sh").write_text("echo these-sources\n")
    (tmp_path / "scripts" / "device_bundle.sh").write_text("echo installed > installed.txt\n")
    (tmp_path / ".device").mkdir()
    (tmp_path / ".device" / "sources.sha256").write_text("other-sources\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA H200, 580.159.04, 143771 MiB, 345 MHz'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", str(tmp_path / "scripts" / "gpu_session.sh")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "made from other sources" in done.stderr and not (tmp_path / "installed.txt").exists()
