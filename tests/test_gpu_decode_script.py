"""benchmarks/gpu_decode.py without a GPU: the grid from the flags, a point measured on the CPU with
a wall-clock timer (every split setting checked against SDPA's output), the report, and that it
exits 0 writing nothing when no CUDA device is visible."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import torch
from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_decode.py"
bench = load_script(SCRIPT, "gpu_decode")


def wall_ms(fn: Callable[[], object], min_run_time: float) -> float:
    """A CPU stand-in for the CUDA-event timer: one call, wall clock."""
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def test_grid_from_flags() -> None:
    args = bench.parse_args(["--batch", "1", "2", "--heads-kv", "8:2", "--head-dim", "64", "--cache", "100", "200",
                             "--dtype", "bf16", "fp16", "--q-len", "3", "--split", "off", "7"])
    shapes = bench.expand_grid(args)
    assert len(shapes) == 8 and args.split == ["off", "7"]
    assert shapes[0] == bench.Shape("bfloat16", 1, 8, 2, 64, 3, 100)


@pytest.mark.parametrize("bad", ["0", "129", "two"])
def test_bad_split_setting_is_refused(bad: str) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(["--split", bad])


@pytest.mark.parametrize("q_len", [1, 3])
def test_point_on_cpu_checks_every_setting(q_len: int) -> None:
    import torch_ext

    shape = bench.Shape("bfloat16", 2, 4, 2, 32, q_len, 300)
    point = bench.measure(shape, torch_ext, ["off", "auto", "5"], 0.0, timer=wall_ms, device="cpu")
    assert point["errors"] == [], point["errors"]
    assert set(point["ours"]) == {"off", "auto", "5"}
    assert all(row["fwd"] is not None and row["fwd_stats"] is not None for row in point["ours"].values())
    result = {"device": "cpu", "driver": "-", "torch": torch.__version__, "cuda": "-", "commit": "0" * 40,
              "dirty": False, "date": "now", "family": "auto", "command": "test", "splits": ["off", "auto", "5"],
              "points": [point]}
    text = bench.markdown(result)
    assert "split 5" in text and text.count("\n| bfloat16 |") == 1


def test_a_wrong_output_is_reported() -> None:
    """The check against SDPA can fail: ours with a wrong scale disagrees."""
    import torch_ext

    class Wrong:
        @staticmethod
        def attention(q, k, v, **kw):  # type: ignore[no-untyped-def]
            return torch_ext.attention(q, k, v, scale=1.0, **kw)

    point = bench.measure(bench.Shape("bfloat16", 1, 2, 2, 32, 1, 200), Wrong, ["off"], 0.0, timer=wall_ms,
                          device="cpu")
    assert any("against SDPA" in e for e in point["errors"]), point["errors"]


def test_without_gpu_exits_0_and_writes_nothing(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    md, js = tmp_path / "d.md", tmp_path / "d.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--out-md", str(md), "--out-json", str(js)],
                          capture_output=True, text=True, check=False, timeout=120)
    assert done.returncode == 0 and "no CUDA device" in done.stdout
    assert not md.exists() and not js.exists()
    done = subprocess.run([sys.executable, str(SCRIPT), "--require-gpu"], capture_output=True, text=True,
                          check=False, timeout=120)
    assert done.returncode == 1
