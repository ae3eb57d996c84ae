"""benchmarks/per_sample_grads.py runs end to end on a tiny grid: it writes its table, times every
method, and stops when a method's per-sample gradients disagree with SDPA's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import per_sample_grads  # noqa: E402  (benchmarks/ is not a package)

TINY = ["--grid", "3x8", "2x12", "--heads", "2", "--head-dim", "8", "--min-run-time", "0.01", "--device", "cpu"]


def test_writes_the_table(tmp_path: Path) -> None:
    table = per_sample_grads.main([*TINY, "--out", str(tmp_path)])
    assert (tmp_path / "cpu.md").read_text() == table
    rows = [line for line in table.splitlines() if line.startswith(("| 3 |", "| 2 |"))]
    assert len(rows) == 2
    for row in rows:
        times = [float(x) for x in row.strip("|").split("|")[2:]]
        assert len(times) == len(per_sample_grads.METHODS) + 1 and all(t > 0 for t in times)


def test_a_wrong_gradient_stops_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The check can fail: ours with a gradient off by 1% is reported, not timed."""
    real = per_sample_grads.ours
    monkeypatch.setattr(per_sample_grads, "ours", lambda q, k, v: real(q, k, v) * 1.005)
    with pytest.raises(SystemExit, match="ours vmap\\(grad\\): dq differs from SDPA's"):
        per_sample_grads.main([*TINY, "--out", str(tmp_path)])
