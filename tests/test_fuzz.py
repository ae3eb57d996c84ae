"""Hypothesis fuzzing of torch_ext.attention, each case run in a worker process (fuzz_worker.py).

Cases: any shape (zero sizes included), GQA, four dtypes, strided / transposed / expanded /
non-contiguous-last-dim layouts, masks of every broadcastable shape (bool and additive, with
fully masked rows), causality, windows, scale policies, NaN and infinities; and calls that break
one rule (wrong type for each argument, wrong mask shape or dtype, mixed dtypes or devices, ...).
A valid case must match the float64 reference (non-finite entries: reach exactly the rows that see
them); an invalid one must raise a clear exception. A crash of the worker fails the case that
caused it, which is reported, and the worker is restarted.

FUZZ_EXAMPLES sets the number of cases (default 150, the short profile CI runs); the long run is
``FUZZ_EXAMPLES=10000 python -m pytest tests/test_fuzz.py -q``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Optional

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

TESTS = Path(__file__).resolve().parent
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "150"))

INVALID_KINDS = [
    "query_type", "key_type", "value_type", "mask_type", "mask_shape", "mask_dtype", "mixed_dtype",
    "mixed_device", "head_dim", "gqa", "rank", "integer_input", "scale_type", "scale_value",
    "temperature", "window", "softcap", "dropout", "sinks", "batch",
]
LAYOUTS = ["contiguous", "transposed", "strided", "last_dim_stride2", "expanded"]


class Worker:
    """A fuzz_worker.py process; restarted after a crash."""

    def __init__(self) -> None:
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen(
            [sys.executable, str(TESTS / "fuzz_worker.py")], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env=env, cwd=str(TESTS.parent),
        )

    def run(self, case: Dict[str, Any]) -> Dict[str, Any]:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        assert self.proc is not None and self.proc.stdin and self.proc.stdout
        try:
            self.proc.stdin.write(json.dumps(case) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:  # the process died on this case
            code = self.proc.wait()
            err = self.proc.stderr.read()[-2000:] if self.proc.stderr else ""
            self.proc = None
            return {"ok": False, "why": f"worker crashed (exit code {code}): {err}"}
        return json.loads(line)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()  # type: ignore[union-attr]
            self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    yield w
    w.stop()


@st.composite
def valid_case(draw) -> Dict[str, Any]:
    Hkv = draw(st.integers(1, 3))
    D = draw(st.integers(1, 40))
    bad = None
    if draw(st.integers(0, 4)) == 0:
        bad = [draw(st.sampled_from("qkv")), draw(st.floats(0, 1)), draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))]
    mask = None
    if draw(st.booleans()):
        ndim = draw(st.integers(2, 4))
        mask = {
            "kind": draw(st.sampled_from(["bool", "additive"])),
            "ndim": ndim,
            # which of (B, H, Lq, Lk) the mask spans (the others broadcast); leading dims beyond
            # ndim are absent
            "dims": [draw(st.booleans()) if d >= 4 - ndim else False for d in range(4)],
            "density": draw(st.sampled_from([0.0, 0.3, 0.8, 1.0])),
        }
    window = [-1, -1]
    is_causal = draw(st.booleans())
    if draw(st.integers(0, 3)) == 0:  # with is_causal the right edge is the diagonal (or unset)
        window = [draw(st.integers(-1, 20)), draw(st.sampled_from([-1, 0]) if is_causal else st.integers(-1, 20))]
    return {
        "kind": "valid",
        "seed": draw(st.integers(0, 2**31 - 1)),
        "B": draw(st.integers(0, 3)),
        "Hkv": Hkv,
        "H": Hkv * draw(st.integers(1, 3)),
        "Lq": draw(st.integers(0, 70)),
        "Lk": draw(st.integers(0, 70)),
        "D": D,
        "Dv": draw(st.sampled_from([D, draw(st.integers(1, 40))])),
        "dtype": draw(st.sampled_from(["float32", "float64", "bfloat16", "float16"])),
        "layout": {n: draw(st.sampled_from(LAYOUTS)) for n in "qkv"},
        "magnitude": draw(st.sampled_from([1.0, 1.0, 10.0, 1e-3])),
        "mask": mask,
        "is_causal": is_causal,
        "window": window,
        "scale": draw(st.sampled_from([None, 0.3, "logn", "logn_sharpen"])),
        "bad": bad,
        "softcap": draw(st.sampled_from([None, None, None, 5.0])),
        "sinks": draw(st.integers(0, 3)) == 0,
    }


@st.composite
def invalid_case(draw) -> Dict[str, Any]:
    return {
        "kind": draw(st.sampled_from(INVALID_KINDS)),
        "seed": draw(st.integers(0, 2**31 - 1)),
        "number": draw(st.sampled_from([0.0, -1.0, float("nan"), float("inf")])),
        "int": draw(st.integers(-5, 5)),
    }


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=EXAMPLES <= 500)
@given(case=st.one_of(valid_case(), valid_case(), valid_case(), invalid_case()))
def test_fuzz_attention(worker: Worker, case: Dict[str, Any]) -> None:
    verdict = worker.run(case)
    assert verdict["ok"], f"{verdict['why']}\ncase: {json.dumps(case)}"
