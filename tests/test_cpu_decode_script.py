"""benchmarks/cpu_decode.py: its quick run prints a table of both points, each checked against
SDPA's output first, and a point whose outputs differ fails."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import check_quick_table, load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "cpu_decode.py"
bench = load_script(SCRIPT, "cpu_decode")


def test_quick_run_prints_the_table() -> None:
    check_quick_table(SCRIPT, ("| float", "| bfloat"), 2)


def test_a_wrong_output_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench.torch_ext, "attention", lambda q, k, v, **kw: torch.zeros_like(q))
    with pytest.raises(AssertionError):
        bench.measure(bench.QUICK[0], 1, 0.01)
