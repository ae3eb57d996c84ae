"""benchmarks/paged_decode.py: its quick run prints a table of both points, each checked against
SDPA's output first, and a point whose paged output differs fails."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import check_quick_table, load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "paged_decode.py"
bench = load_script(SCRIPT, "paged_decode")


def test_quick_run_prints_the_table() -> None:
    check_quick_table(SCRIPT, ("| float", "| bfloat"), 2)


def test_a_wrong_paged_output_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    real = bench.torch_ext.varlen_attention

    def pages_misread(*args: object, block_table: torch.Tensor | None = None, **kw: object) -> torch.Tensor:
        if block_table is not None:
            block_table = block_table.flip(1)  # each sequence's pages in reverse order
        return real(*args, block_table=block_table, **kw)

    monkeypatch.setattr(bench.torch_ext, "varlen_attention", pages_misread)
    with pytest.raises(AssertionError, match="paged"):
        bench.measure(bench.QUICK[0], 1, 0.01)
