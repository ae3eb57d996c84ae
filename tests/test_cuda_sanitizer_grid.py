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
    assert "sm80-99KB: 10 variants x D 128 run" in out
    assert "sm90-persistent: 10 variants x D 64, 128 run" in out
    assert "sm90-deterministic: 10 variants x D 64, 128 run" in out


def test_the_deterministic_pass(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """sm90-deterministic runs its calls (device and CPU) with the Hopper family forced under
    torch.use_deterministic_algorithms(True), the other passes without it, and the setting and its
    warn_only are restored after."""
    seen: list = []
    monkeypatch.setattr(grid, "run_call", lambda device, *a: seen.append(
        (os.environ["ENTROPY_ATTN_CUDA_FAMILY"], torch.are_deterministic_algorithms_enabled())) or [torch.zeros(1)])
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(False, warn_only=True)
    try:
        assert grid.main(["--passes", "sm90-deterministic", "sm80", "--head-dims", "64"]) == 0
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        assert not torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    assert set(seen) == {("sm80", False), ("sm90", True)}
    assert capsys.readouterr().out.splitlines() == ["sm80: 10 variants x D 64 run",
                                                    "sm90-deterministic: 10 variants x D 64 run"]


def test_passes_select_by_name(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """--passes runs the passes it names, each with its settings, and no other: sm90 is not the
    persistent grid's pass too; a name of no pass is a usage error."""
    seen: list = []
    monkeypatch.setattr(grid, "run_call", lambda device, *a: seen.append(
        (os.environ["ENTROPY_ATTN_CUDA_FAMILY"], os.environ.get("ENTROPY_ATTN_CUDA_PERSISTENT"))) or [torch.zeros(1)])
    assert grid.main(["--passes", "sm90-persistent"]) == 0
    assert set(seen) == {("sm90", "1")}
    assert capsys.readouterr().out.splitlines() == ["sm90-persistent: 10 variants x D 64, 128 run"]
    assert "ENTROPY_ATTN_CUDA_PERSISTENT" not in os.environ  # the pass's setting undone
    seen.clear()
    assert grid.main(["--passes", "sm90"]) == 0
    assert set(seen) == {("sm90", None)}
    assert capsys.readouterr().out.splitlines() == ["sm90: 10 variants x D 64, 128, 256, 96 run"]
    with pytest.raises(SystemExit) as exit_:
        grid.main(["--passes", "persistent"])
    assert exit_.value.code == 2
    assert "invalid choice: 'persistent'" in capsys.readouterr().err


def test_variants_select_by_name(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """--variants runs the variants it names and no other (dropout only where named), --head-dims
    the head dims it names; the tight masks' entries start one entry into storage one entry longer
    than they are, so that the last ends within the 4-byte word of the storage's last byte (1 byte
    into it for a bool mask, 2 for a bf16 one)."""
    real = grid.torch_ext.attention
    masks: list[torch.Tensor] = []
    dropouts: list[float] = []

    def recording(*args: object, **kw: object) -> object:
        if kw.get("attn_mask") is not None:
            masks.append(kw["attn_mask"])
        dropouts.append(kw.get("dropout_p", 0.0))
        return real(*args, **kw)

    monkeypatch.setattr(grid.torch_ext, "attention", recording)
    assert grid.main(["--passes", "sm80-99KB", "--variants", "bool_mask_tight", "additive_mask_tight"]) == 0
    assert capsys.readouterr().out.splitlines() == ["sm80-99KB: 2 variants x D 128 run"]
    assert not any(dropouts)
    # Each variant on the device and on the CPU: bool twice, then the bf16 mask and its float32 reference.
    assert [m.dtype for m in masks] == [torch.bool, torch.bool, torch.bfloat16, torch.float32]
    for m in masks[:3]:
        assert m.storage_offset() == 1
        assert m.untyped_storage().nbytes() == (m.numel() + 1) * m.element_size()
        assert m.untyped_storage().nbytes() % 4 == m.element_size()
    assert torch.equal(masks[0], masks[1]) and torch.equal(masks[2], masks[3].bfloat16())
    masks.clear()
    assert grid.main(["--passes", "sm80-99KB", "--variants", "dropout"]) == 0
    assert capsys.readouterr().out.splitlines() == ["sm80-99KB: 1 variants x D 128 run"]
    assert dropouts[-1] == 0.2 and not masks
    # --head-dims keeps those of a pass's head dims.
    assert grid.main(["--passes", "sm90", "--head-dims", "64", "96", "--variants", "dropout"]) == 0
    assert capsys.readouterr().out.splitlines() == ["sm90: 1 variants x D 64, 96 run"]


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
