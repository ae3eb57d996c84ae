"""The context-parallel scripts the README points to run end to end on a tiny problem: the
training example (examples/context_parallel.py: 1 and 2 processes give the same loss curve and
the same monitored entropy) and the strong-scaling benchmark (benchmarks/context_parallel.py),
each as a user runs it, a subprocess writing its report where --out says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 300  # seconds; both take ~10-20 s here


def _run(script: str, *args: str) -> None:
    subprocess.run([sys.executable, str(ROOT / script), *args], cwd=ROOT, check=True, timeout=TIMEOUT,
                   capture_output=True, text=True)


def test_training_example_agrees_across_process_counts(tmp_path: Path) -> None:
    """float64 training with the sequence on 1 process (the single-device op) and sharded over 2:
    the loss curves agree to rounding, the monitor logs the same entropies, and the report and
    its JSON are written."""
    _run("examples/context_parallel.py", "--procs", "1", "2", "--steps", "3", "--seq", "16", "--batch", "2",
         "--d-model", "16", "--monitor-every", "1", "--dtype", "float64", "--out", str(tmp_path))
    results = json.loads((tmp_path / "training.json").read_text())["results"]
    one, two = results["1"], results["2"]
    assert len(one["losses"]) == len(two["losses"]) == 3
    assert max(abs(a - b) for a, b in zip(one["losses"], two["losses"])) < 1e-10
    assert one["entropy"] and len(one["entropy"]) == len(two["entropy"])
    for a, b in zip(one["entropy"], two["entropy"]):
        assert (a["step"], a["layer"], a["head"]) == (b["step"], b["layer"], b["head"])
        assert abs(a["normalized_entropy"] - b["normalized_entropy"]) < 1e-10
    assert "| 2 |" in (tmp_path / "training.md").read_text()


def test_scaling_benchmark_runs(tmp_path: Path) -> None:
    """The benchmark on a short sequence with 1 and 2 processes writes its table and JSON."""
    _run("benchmarks/context_parallel.py", "--seq", "64", "--procs", "1", "2", "--repeats", "1", "--out",
         str(tmp_path))
    scaling = json.loads((tmp_path / "scaling.json").read_text())
    assert set(scaling["results"]) == {"1", "2"}
    assert "| 2 |" in (tmp_path / "scaling.md").read_text()
