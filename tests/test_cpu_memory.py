"""The CPU kernels' peak memory, measured by benchmarks/memory_probe.py in fresh processes, stays
near SDPA's CPU flash kernels' on the same inputs: the kernels read 16-bit inputs a block (or a
task's keys) at a time instead of widening whole copies, write their outputs and gradients in the
inputs' types, and convert each thread's keys into its own buffers (csrc/cpu/attention_fwd.cpp,
attention_bwd.cpp). Before that, at L = 4096 on 2 threads, the forward peaked at 1.9x SDPA's in
float32, 2.0x in bfloat16 and 3.1x in float16 (a transposed float copy of the whole of K, and of V
for float16); at L = 8192 the bfloat16 backward at 3.7x SDPA's, float16 at 4.0x and float32 at
1.6x. The sparsity op copied Q (widened, for 16-bit inputs) and K^T whole: 8.6 MiB above its
inputs in float32 and 16.6 in 16 bits at L = 4096 (now 2.9 and 1.7)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "benchmarks" / "memory_probe.py"


def peak_bytes(method: str, dtype: str) -> int:
    """Peak RSS of one call of `method` (a forward, or forward+backward) above its inputs, in a
    fresh process on 2 threads."""
    args = [sys.executable, str(PROBE), "--method", method, "--dtype", dtype, "--length", "4096",
            "--heads", "8", "--kv-heads", "8", "--threads", "2"]  # fmt: skip
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["peak_bytes"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_backward_peak_memory_near_sdpa_flash(dtype: str) -> None:
    """Forward+backward (B=1, H=8, L=4096, D=64, 2 threads) within 1.5x SDPA flash's."""
    ours, sdpa = peak_bytes("ours_bwd/none", dtype), peak_bytes("flash_bwd/none", dtype)
    # (measured 1.09-1.31x; the inputs are 16 MiB in float32)
    assert ours <= 1.5 * sdpa, f"ours {ours / 2**20:.1f} MiB, SDPA flash {sdpa / 2**20:.1f} MiB"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_forward_peak_memory_near_sdpa_flash(dtype: str) -> None:
    """The forward alone (same inputs) within 1.5x SDPA flash's."""
    ours, sdpa = peak_bytes("ours_fwd/none", dtype), peak_bytes("flash_fwd/none", dtype)
    # (measured 1.17-1.29x; the output is 8 MiB in float32)
    assert ours <= 1.5 * sdpa, f"ours {ours / 2**20:.1f} MiB, SDPA flash {sdpa / 2**20:.1f} MiB"


SPARSITY_PROBE = """
import json, sys
import torch
import torch_ext
from memory_probe import peak_rss_bytes, reset_peak, rss_bytes
torch.set_num_threads(2)
dtype = getattr(torch, sys.argv[1])
q, k = (torch.randn(1, 8, 4096, 64).to(dtype) for _ in range(2))
torch_ext.attention_sparsity(q[:, :, :16], k[:, :, :16], kind="relu2")  # (one-time initialization)
assert reset_peak(), "the kernel does not let /proc/self/clear_refs reset the peak RSS"
base = rss_bytes()
torch_ext.attention_sparsity(q, k, kind="relu2")
print(json.dumps({"peak_bytes": peak_rss_bytes() - base}))
"""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_sparsity_peak_memory_under_a_copy_of_key(dtype: str) -> None:
    """attention_sparsity (B=1, H=8, L=4096, D=64, 2 threads) takes less than half a float copy of K
    above its inputs: each task converts its query rows and each thread the keys it reads, instead
    of whole copies of Q and K^T (measured 2.9 MiB in float32, 1.7 in 16 bits, against 8.6 and
    16.6 before)."""
    proc = subprocess.run([sys.executable, "-c", SPARSITY_PROBE, dtype], capture_output=True, text=True,
                          timeout=300, cwd=ROOT / "benchmarks", env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    peak = json.loads(proc.stdout.strip().splitlines()[-1])["peak_bytes"]
    key_float_bytes = 8 * 4096 * 64 * 4  # (K's size in float32)
    assert peak < key_float_bytes / 2, f"{peak / 2**20:.1f} MiB, K in float32 {key_float_bytes / 2**20:.1f} MiB"
