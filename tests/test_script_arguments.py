"""The scripts' bad arguments end in argparse's usage error (exit status 2, naming the argument),
not in a traceback from the work they would have started (a division by 0 repeats, the median of
no timing, a CUDA call on a machine without a GPU), and their help keeps its whole description."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

BAD = [
    ("benchmarks/batch_invariance.py", ["--repeats", "0"], "--repeats: must be >= 1, got 0"),
    ("benchmarks/cpu_isa.py", ["--reps", "0"], "--reps: must be >= 1, got 0"),
    ("benchmarks/cpu_bf16.py", ["--threads", "0"], "--threads: must be >= 1, got 0"),
    ("benchmarks/suite.py", ["--repeats", "0"], "--repeats must be >= 1"),
    ("benchmarks/suite.py", ["--lengths", "0"], "--lengths must be >= 1"),
    ("benchmarks/memory_probe.py", ["--method", "ours_fwd/none", "--length", "64", "--heads", "4", "--kv-heads", "3"],
     "--heads (4) must be a multiple of --kv-heads (3)"),
    ("benchmarks/context_parallel.py", ["--procs", "0"], "--procs: must be >= 1, got 0"),
    ("examples/context_parallel.py", ["--d-model", "30", "--heads", "4"], "--d-model (30) must be a multiple of --heads (4)"),
    ("examples/length_generalization.py", ["--factors", "0"], "factors must be ints >= 1"),
    ("examples/length_generalization.py", ["--steps", "0"], "steps must be >= 1, got 0"),
]
if not torch.cuda.is_available():
    BAD.append(("benchmarks/stats_overhead.py", ["--device", "cuda"], "CUDA is not available on this machine"))


@pytest.mark.parametrize("script,args,message", BAD, ids=[f"{s}:{' '.join(a)}" for s, a, _ in BAD])
def test_bad_arguments_are_usage_errors(script: str, args: list[str], message: str) -> None:
    run = subprocess.run([sys.executable, str(ROOT / script), *args], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert run.returncode == 2, (run.returncode, run.stderr[-2000:])
    assert "Traceback" not in run.stderr and message in run.stderr, run.stderr[-2000:]


def test_context_parallel_key_value_heads_default_to_the_heads() -> None:
    """--heads alone runs (--kv-heads defaulted to 4 and the op refused 2 query heads of 4)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import context_parallel
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    args = context_parallel.parse_args(["--heads", "2", "--seq", "64", "--procs", "1"])
    assert (args.heads, args.kv_heads) == (2, 2)


@pytest.mark.parametrize("script", ["batch_invariance.py", "nested.py", "paged_decode.py", "cpu_decode.py"])
def test_help_has_the_whole_first_paragraph(script: str) -> None:
    """--help describes the script with its docstring's first paragraph (its first line alone
    stopped mid-sentence)."""
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--help"], capture_output=True,
                         text=True, cwd=ROOT, timeout=120, check=True)
    doc = (ROOT / "benchmarks" / script).read_text().split('"""')[1].split("\n\n")[0]
    last_word = doc.split()[-1]
    assert last_word in run.stdout, run.stdout
