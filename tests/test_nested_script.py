"""benchmarks/nested.py: its quick run prints a table of both points, each checked first (every
call gives each sequence's rows the same output), and a call whose output is wrong fails its check."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "nested.py"
bench = load_script(SCRIPT, "nested_benchmark")


def test_quick_run_prints_the_table() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True, check=True,
                         timeout=300).stdout
    rows = [line for line in out.splitlines() if line.startswith(("| float32", "| bfloat16"))]
    assert len(rows) == 2 and all(line.rstrip().endswith("x |") for line in rows), out


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_a_wrong_output_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    real = bench.torch_ext.attention

    def scaled(*args: object, **kw: object) -> torch.Tensor:
        return real(*args, **kw) * 1.01

    monkeypatch.setattr(bench.torch_ext, "attention", scaled)
    with pytest.raises(AssertionError, match="differs from SDPA"):
        bench.check(bench.QUICK[0])
