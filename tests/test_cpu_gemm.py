"""The CPU kernels' two product back ends (csrc/cpu/block_gemm.cpp): oneDNN's brgemm where it can
use AVX-512, MKL (ATen mm) elsewhere; ENTROPY_ATTN_CPU_GEMM forces one. The choice is read once per
process, so each setting runs in its own process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CHILD = r"""
import sys, torch, torch_ext
torch.manual_seed(0)
q, k, v = (torch.randn(2, 4, 300, 64, requires_grad=True) for _ in range(3))
out, st = torch_ext.attention(q, k, v, is_causal=True, return_stats=True)
(out.sum() + st.entropy.sum()).backward()
torch.save([out.detach(), st.entropy, q.grad, k.grad, v.grad], sys.argv[1])
"""


def run(tmp_path: Path, env: dict, name: str) -> subprocess.CompletedProcess:
    path = tmp_path / f"{name}.pt"
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
    )


def test_back_ends_agree(tmp_path: Path) -> None:
    results = {}
    for name, env in [("brgemm", {"ENTROPY_ATTN_CPU_GEMM": "brgemm"}), ("blas", {"ENTROPY_ATTN_CPU_GEMM": "blas"}),
                      ("capped", {"ONEDNN_MAX_CPU_ISA": "AVX2"})]:
        r = run(tmp_path, env, name)
        assert r.returncode == 0, r.stderr[-2000:]
        results[name] = torch.load(tmp_path / f"{name}.pt")
    for other in ("blas", "capped"):
        for a, b in zip(results["brgemm"], results[other]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_unknown_back_end_is_a_clear_error(tmp_path: Path) -> None:
    r = run(tmp_path, {"ENTROPY_ATTN_CPU_GEMM": "fastest"}, "bad")
    assert r.returncode != 0
    assert "ValueError" in r.stderr and "ENTROPY_ATTN_CPU_GEMM must be brgemm or blas" in r.stderr
