"""benchmarks/call_overhead.py: its quick run prints one row per device and mode, each with a
time for ours, with and without statistics, and SDPA's (and the ratio) where it has a kernel."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "call_overhead.py"


def test_quick_run_prints_the_table() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True, check=True,
                         timeout=300).stdout
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| meta") or line.startswith("| c")]
    devices = ["meta", "cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    assert [r[0].strip() for r in rows] == [d for d in devices for _ in range(3)], out
    for device, mode, ours, stats, sdpa, ratio in rows:
        assert float(ours) > 0 and float(stats) > 0, out
        if device.strip() == "meta":
            assert sdpa.strip() == ratio.strip() == "-", out
        else:
            assert float(sdpa) > 0 and ratio.strip().endswith("x"), out
