"""The CPU benchmark suite (benchmarks/suite.py) runs end to end on a tiny grid and reports what it
measured: its outputs exist, every method it times agrees with ours, and its helpers compute the
quantities the report is built on (FLOPs, the log-n factor, log-log slopes, the target checks)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

import suite  # noqa: E402  (benchmarks/ is not a package)

TINY = [
    "--lengths", "48", "--dtypes", "float32", "bfloat16", "--head-dims", "16", "--shapes", "1x4x2",
    "--causal", "both", "--no-flex", "--no-memory", "--repeats", "1", "--min-run-time", "0.01",
    "--matmul-size", "64", "--threads", "1",
]  # fmt: skip


def run(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("bench")
    proc = run([str(BENCH / "suite.py"), *TINY, "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads((out / "cpu.json").read_text())


def test_writes_table_json_and_plots(tiny_run: tuple[Path, dict]) -> None:
    out, result = tiny_run
    for name in ("cpu.md", "cpu.json", "cpu_time.png", "cpu_ratio.png"):
        assert (out / name).stat().st_size > 0, name
    assert not (out / "cpu_memory.png").exists()  # --no-memory
    text = (out / "cpu.md").read_text()
    assert "| target | result | numbers |" in text and "## Summary over the grid" in text
    header = result["header"]
    assert header["torch"] == torch.__version__ and header["threads"] == 1 and header["date"]
    assert result["grid"].startswith("grid lengths=48")


def test_every_point_timed_and_guarded(tiny_run: tuple[Path, dict]) -> None:
    _, result = tiny_run
    assert len(result["points"]) == 4  # 2 dtypes x causal or not
    for rec in result["points"]:
        methods = rec["methods"]
        # The comparisons the targets are about were all timed, after agreeing with ours.
        for key in ("ours_stats/logn", "ours_fwd/logn", "ours_bwd/logn", "flash_fwd/logn", "flash_bwd/logn",
                    "math_fwd/logn", "eager_fwd/logn"):  # fmt: skip
            assert methods[key]["status"] == "ok", (rec["label"], key, methods[key])
            assert methods[key]["median_s"] > 0 and methods[key]["gflops"] > 0
        for key, guard in rec["guard"].items():
            if isinstance(guard, dict):
                assert guard["allclose"], (rec["label"], key, guard)
        assert not any(key.startswith("flex") for key in methods)  # --no-flex


def test_memory_probe_reports_growth() -> None:
    peaks = {}
    for length in (256, 1024):
        proc = run([str(BENCH / "memory_probe.py"), "--method", "eager_fwd/logn", "--length", str(length),
                    "--heads", "2", "--kv-heads", "2", "--threads", "1"])  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        peaks[length] = json.loads(proc.stdout.strip().splitlines()[-1])["peak_bytes"]
    # Eager monitoring holds float32 B·H·L² tensors: at least one of them at L = 1024 (8 MiB).
    assert peaks[1024] >= 2 * 4 * 1024 * 1024
    assert peaks[1024] > 4 * peaks[256]


def test_flops_and_logn_factor() -> None:
    p = suite.Point("float32", 64, 2, 8, 8, False, 1024)
    assert p.flops_fwd == 4 * 2 * 8 * 1024 * 1024 * 64
    assert suite.Point("float32", 64, 2, 8, 8, True, 1024).flops_fwd == p.flops_fwd / 2
    f = suite.logn_factor(8, causal=True).flatten()
    assert torch.allclose(f, torch.log(torch.arange(1, 9.0)) / math.log(512))
    assert torch.allclose(suite.logn_factor(8, causal=False), torch.full((1, 1, 8, 1), math.log(8) / math.log(512)))


def test_loglog_slope() -> None:
    xs = [1024.0, 2048.0, 4096.0]
    assert suite.loglog_slope(xs, [3 * x for x in xs]) == pytest.approx(1.0)
    assert suite.loglog_slope(xs, [x * x for x in xs]) == pytest.approx(2.0)


def test_ratio_check_fails_above_bound() -> None:
    ok = suite.ratio_check("fwd", {"median": 0.9, "worst": 1.1, "worst_point": "p"}, 1.0, 1.15)
    bad = suite.ratio_check("fwd", {"median": 0.9, "worst": 1.3, "worst_point": "p"}, 1.0, 1.15)
    assert ok["result"] == "met" and bad["result"] == "not met"
