"""scripts/cuda_sanitizer_grid.py, the reduced grid compute-sanitizer runs on a GPU: its logic on
the CPU (the op on the CPU in place of the CUDA kernels, as tests/test_cuda.py's dry run), and a
wrong gradient makes it fail."""

from __future__ import annotations

import os
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
    for name in ("ENTROPY_ATTN_CUDA_SMEM_PER_BLOCK", "ENTROPY_ATTN_CUDA_PERSISTENT"):
        monkeypatch.setenv(name, "")  # (recorded, so that a value the grid leaves is undone)
        monkeypatch.delenv(name)


def test_every_call_agrees_on_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert grid.main([]) == 0
    out = capsys.readouterr().out
    assert out.count("variants x D 64, 128, 256, 96 run") == 3
    assert "sm80-99KB: 8 variants x D 128 run" in out
    assert "sm90-persistent: 8 variants x D 64, 128 run" in out


def test_passes_select_by_name(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """--passes runs the passes it names, each with its settings, and no other: sm90 is not the
    persistent grid's pass too; a name of no pass is a usage error."""
    seen: list = []
    monkeypatch.setattr(grid, "run_call", lambda device, *a: seen.append(
        (os.environ["ENTROPY_ATTN_CUDA_FAMILY"], os.environ.get("ENTROPY_ATTN_CUDA_PERSISTENT"))) or [torch.zeros(1)])
    assert grid.main(["--passes", "sm90-persistent"]) == 0
    assert set(seen) == {("sm90", "1")}
    assert capsys.readouterr().out.splitlines() == ["sm90-persistent: 8 variants x D 64, 128 run"]
    assert "ENTROPY_ATTN_CUDA_PERSISTENT" not in os.environ  # the pass's setting undone
    seen.clear()
    assert grid.main(["--passes", "sm90"]) == 0
    assert set(seen) == {("sm90", None)}
    assert capsys.readouterr().out.splitlines() == ["sm90: 8 variants x D 64, 128, 256, 96 run"]
    with pytest.raises(SystemExit) as exit_:
        grid.main(["--passes", "persistent"])
    assert exit_.value.code == 2
    assert "invalid choice: 'persistent'" in capsys.readouterr().err


def test_a_wrong_gradient_fails_it(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    real = grid.run_call

    def wrong(device: str, dtype: torch.dtype, *args: object) -> list:
        out = real(device, dtype, *args)
        if dtype == torch.bfloat16:
            out[3] = out[3] + 0.5  # dq
        return out

    monkeypatch.setattr(grid, "run_call", wrong)
    monkeypatch.setattr(grid, "VARIANTS", grid.VARIANTS[:1])
    assert grid.main(["--passes", "sm80-99KB"]) == 1
    assert "causal: output 3 differs" in capsys.readouterr().out
