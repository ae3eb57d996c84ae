"""benchmarks/batch_invariance.py: its quick run prints a table of both points, each checked first
(the two calls agree; num_splits=1 gives a sequence the bits it gets alone), and a point whose
num_splits=1 output depends on the batch fails its check."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import check_quick_table, load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "batch_invariance.py"
bench = load_script(SCRIPT, "batch_invariance")


def test_quick_run_prints_the_table() -> None:
    check_quick_table(SCRIPT, ("| mixed", "| prefill"), 2)


def test_a_batch_dependent_output_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    real = bench.torch_ext.varlen_attention

    def splits_ignored(*args: object, num_splits: int | None = None, **kw: object) -> object:
        return real(*args, num_splits=None, **kw)  # one call over every sequence

    monkeypatch.setattr(bench.torch_ext, "varlen_attention", splits_ignored)
    with pytest.raises(AssertionError, match="differs from its call alone"):
        bench.check(bench.QUICK[0])
