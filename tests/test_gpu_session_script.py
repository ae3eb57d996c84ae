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
