"""benchmarks/deterministic_backward.py runs end to end on a tiny grid (the CPU op: its dry run):
it writes its table and JSON, times both settings, and stops when a deterministic run's bits do not
repeat."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import deterministic_backward  # noqa: E402  (benchmarks/ is not a package)

TINY = ["--lengths", "16", "40", "--batch", "1", "--heads", "2", "--head-dims", "8", "--min-run-time", "0.01"]


def test_writes_table_and_json(tmp_path: Path) -> None:
    deterministic_backward.main([*TINY, "--out", str(tmp_path)])
    result = json.loads((tmp_path / "cpu.json").read_text())
    assert [(r["seq_len"], r["causal"]) for r in result["rows"]] == [(16, False), (16, True), (40, False), (40, True)]
    assert all(r["default_ms"] > 0 and r["deterministic_ms"] > 0 for r in result["rows"])
    assert not torch.are_deterministic_algorithms_enabled()  # restored after each run
    text = (tmp_path / "cpu.md").read_text()
    assert "| family | ran | D | L | causal | mask | default (ms) | deterministic (ms) |" in text
    assert text.count("\n| cpu | cpu | 8 | 40 |") == 2


def test_a_bool_mask(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """--masks none bool times each point without a mask and with a bool mask, which the op gets."""
    seen: list = []
    real = deterministic_backward.torch_ext.attention

    def recording(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: object, **kw: object) -> torch.Tensor:
        seen.append(None if mask is None else (mask.dtype, tuple(mask.shape)))  # type: ignore[union-attr]
        return real(q, k, v, mask, **kw)

    monkeypatch.setattr(deterministic_backward.torch_ext, "attention", recording)
    deterministic_backward.main([*TINY, "--lengths", "16", "--causal", "yes", "--masks", "none", "bool",
                                 "--out", str(tmp_path)])
    result = json.loads((tmp_path / "cpu.json").read_text())
    assert [(r["seq_len"], r["causal"], r["mask"]) for r in result["rows"]] == [(16, True, "none"), (16, True, "bool")]
    assert {None, (torch.bool, (16, 16))} == set(seen)
    assert "| cpu | cpu | 8 | 16 | yes | bool |" in (tmp_path / "cpu.md").read_text()


def test_bits_that_do_not_repeat_stop_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The check can fail: a deterministic backward whose second run differs is reported, not timed."""
    real = deterministic_backward.deterministic_step
    calls = {"n": 0}

    def drifting(*args: object) -> list:
        grads = real(*args)  # type: ignore[arg-type]
        calls["n"] += 1
        if calls["n"] % 2 == 0:
            grads[0] = grads[0] + 1e-3
        return grads

    monkeypatch.setattr(deterministic_backward, "deterministic_step", drifting)
    with pytest.raises(SystemExit, match="dq differs between two deterministic runs"):
        deterministic_backward.main([*TINY, "--out", str(tmp_path)])


def test_the_family_that_ran() -> None:
    """A tensor-core backward counts as its family though its fallback guard launches too; the
    fallback's kernels alone, as the fallback; none of the main kernels, as none."""
    guard = "void entropy_attn::cuda::fallback::attention_bwd_kernel<__nv_bfloat16, 64, true>(...)"
    sm80 = "void entropy_attn::cuda::sm80::main_kernel<...>(...)"
    fallback = "void entropy_attn::cuda::fallback::attention_bwd_kernel<float, 64, false>(...)"
    assert deterministic_backward.family_of([guard, sm80]) == "sm80"
    assert deterministic_backward.family_of(["entropy_attn::cuda::fallback::attention_bwd_preprocess_kernel<float>",
                                             fallback]) == "fallback"
    assert deterministic_backward.family_of(["at::native::reduce_kernel<...>"]) == ""
