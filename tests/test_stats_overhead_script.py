"""benchmarks/stats_overhead.py (what the statistics cost: issue 12's measurement of the kernel
epilogue against the chain of small ATen ops it replaced) runs on a short grid and writes its
table and JSON, one point per length with every time measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "stats_overhead.py"


def test_short_run_writes_table_and_json(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(SCRIPT), "--seq", "64", "128", "--min-run-time", "0.01", "--out",
                    str(tmp_path)], capture_output=True, text=True, check=True, timeout=300)
    result = json.loads((tmp_path / "cpu.json").read_text())
    assert [p["seq_len"] for p in result["points"]] == [64, 128]
    for point in result["points"]:
        for key in ("no_stats_ms", "stats_epilogue_ms", "stats_epilogue_plus_aten_chain_ms"):
            assert point[key] > 0, (key, point)
        # (differences of timings: their sign is noise at these sizes)
        assert point["aten_chain_ms"] == point["stats_epilogue_plus_aten_chain_ms"] - point["stats_epilogue_ms"]
    table = (tmp_path / "cpu.md").read_text()
    assert "| 64 |" in table and "| 128 |" in table, table
