"""benchmarks/nested.py: its quick run prints a table of both points, each checked first (every
call gives each sequence's rows the same output), and a call whose output is wrong fails its check."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import check_quick_table, load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "nested.py"
bench = load_script(SCRIPT, "nested_benchmark")


def test_quick_run_prints_the_table() -> None:
    check_quick_table(SCRIPT, ("| float32", "| bfloat16"), 2)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_a_wrong_output_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    real = bench.torch_ext.attention

    def scaled(*args: object, **kw: object) -> torch.Tensor:
        return real(*args, **kw) * 1.01

    monkeypatch.setattr(bench.torch_ext, "attention", scaled)
    with pytest.raises(AssertionError, match="differs from SDPA"):
        bench.check(bench.QUICK[0])
