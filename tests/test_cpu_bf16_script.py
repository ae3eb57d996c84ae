"""benchmarks/cpu_bf16.py: its quick run prints a row per point and quantity with both product paths and
SDPA, and a child whose output differs from SDPA's fails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "cpu_bf16.py"
bench = load_script(SCRIPT, "cpu_bf16")


def test_quick_run_prints_the_table() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--reps", "1"], capture_output=True, text=True,
                         check=True, timeout=600).stdout
    rows = [line for line in out.splitlines() if line.startswith("| prefill") or line.startswith("| 4 tokens")]
    # the forward's table has both points, forward + backward's the prefill one
    assert len(rows) == 3 and all(line.rstrip().endswith("x |") for line in rows), out


def test_a_wrong_output_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    child = bench.CHILD.replace("ours_out = torch_ext.attention(q, k, v, **kw)",
                                "ours_out = torch.zeros_like(q)")
    assert child != bench.CHILD
    monkeypatch.setattr(bench, "CHILD", child)
    with pytest.raises(subprocess.CalledProcessError):
        bench.run_child(bench.QUICK[0], {}, 1, 1)
