"""benchmarks/learned_bias.py runs end to end on a tiny grid: it writes its table and JSON, times
every method, and stops when a method's gradients disagree with SDPA's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import learned_bias  # noqa: E402  (benchmarks/ is not a package)

TINY = ["--lengths", "16", "24", "--batch", "2", "--heads", "2", "--head-dim", "8", "--min-run-time", "0.01"]


def test_writes_table_and_json(tmp_path: Path) -> None:
    learned_bias.main([*TINY, "--out", str(tmp_path)])
    result = json.loads((tmp_path / "cpu.json").read_text())
    assert [r["seq_len"] for r in result["rows"]] == [16, 24]
    for row in result["rows"]:
        assert all(row[f"{m}_ms"] > 0 for m in learned_bias.METHODS)
    text = (tmp_path / "cpu.md").read_text()
    assert "| bias | L | ours, bias requires grad (ms)" in text
    assert text.count("\n| (1, H, L, L) | 16 |") + text.count("\n| (1, H, L, L) | 24 |") == 2


def test_a_bias_per_key(tmp_path: Path) -> None:
    """--bias head key times both shapes, each checked against SDPA (its gradient summed over the
    heads and rows)."""
    learned_bias.main([*TINY, "--bias", "head", "key", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "cpu.json").read_text())
    assert [(r["bias"], r["seq_len"]) for r in result["rows"]] == [
        ("(1, H, L, L)", 16), ("(1, H, L, L)", 24), ("(B, 1, 1, L)", 16), ("(B, 1, 1, L)", 24)]


def test_deterministic_algorithms(tmp_path: Path) -> None:
    """--deterministic adds ours under deterministic algorithms, checked against SDPA and against a
    second run's bits, to the table and the JSON."""
    learned_bias.main([*TINY, "--bias", "head", "key", "--deterministic", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "cpu.json").read_text())
    assert result["methods"] == [*learned_bias.METHODS, learned_bias.DETERMINISTIC]
    assert all(row[f"{learned_bias.DETERMINISTIC}_ms"] > 0 for row in result["rows"])
    assert "| ours, deterministic algorithms (ms) | deterministic / default (ours) |" in (tmp_path / "cpu.md").read_text()
    assert not torch.are_deterministic_algorithms_enabled(), "the setting is restored"


def test_deterministic_runs_that_differ_stop_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The bits check can fail: a deterministic method whose second run differs is reported."""
    real = learned_bias.step
    calls = {"n": 0}

    def drifting(method: str, *args: torch.Tensor) -> list:
        out = real(method, *args)
        if method == learned_bias.DETERMINISTIC:
            calls["n"] += 1
            if calls["n"] == 2:
                out[1] = out[1] + 1e-6 * out[1].abs().max()
        return out

    monkeypatch.setattr(learned_bias, "step", drifting)
    with pytest.raises(SystemExit, match="ours_deterministic: dq differs between two runs"):
        learned_bias.main([*TINY, "--deterministic", "--out", str(tmp_path)])


@pytest.mark.parametrize("bias", ["head", "key"])
def test_a_wrong_gradient_stops_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, bias: str) -> None:
    """The check can fail: a method whose bias gradient is off is reported, not timed."""
    real = learned_bias.step

    def wrong(method: str, *args: torch.Tensor) -> list:
        out = real(method, *args)
        if method == "ours_bias_grad":
            out[-1] = out[-1] * 1.01
        return out

    monkeypatch.setattr(learned_bias, "step", wrong)
    with pytest.raises(SystemExit, match="ours_bias_grad: dbias differs"):
        learned_bias.main([*TINY, "--bias", bias, "--out", str(tmp_path)])
