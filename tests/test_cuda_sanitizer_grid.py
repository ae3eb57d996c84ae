"""scripts/cuda_sanitizer_grid.py, the reduced grid compute-sanitizer runs on a GPU: its logic on
the CPU (the op on the CPU in place of the CUDA kernels, as tests/test_cuda.py's dry run), and a
wrong gradient makes it fail."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import cuda_sanitizer_grid as grid  # noqa: E402  (scripts/ is not a package)


@pytest.fixture(autouse=True)
def on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The grid's device is the CPU; the family, split and shared-memory settings it writes are
    restored."""
    monkeypatch.setattr(grid, "DEVICE", "cpu")
    monkeypatch.setenv("ENTROPY_ATTN_CUDA_FAMILY", "auto")
    monkeypatch.setenv("ENTROPY_ATTN_SPLIT_KV", "auto")
    monkeypatch.delenv("ENTROPY_ATTN_CUDA_SMEM_PER_BLOCK", raising=False)


def test_every_call_agrees_on_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert grid.main() == 0
    out = capsys.readouterr().out
    assert out.count("variants x D 64, 128, 256, 96 run") == 3
    assert "sm80 at 99 KB per block: 7 variants x D 128 run" in out


def test_a_wrong_gradient_fails_it(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    real = grid.run_call

    def wrong(device: str, dtype: torch.dtype, *args: object) -> list:
        out = real(device, dtype, *args)
        if dtype == torch.bfloat16:
            out[3] = out[3] + 0.5  # dq
        return out

    monkeypatch.setattr(grid, "run_call", wrong)
    monkeypatch.setattr(grid, "VARIANTS", grid.VARIANTS[:1])
    assert grid.main() == 1
    assert "causal: output 3 differs" in capsys.readouterr().out
