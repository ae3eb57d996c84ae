"""bfloat16 on the CPU: attention with its products in bfloat16 (where the CPU has oneDNN's bfloat16
kernel: AVX512-BF16 or AMX; csrc/cpu/bf16_products.h) against the same kernels with the operands
widened to float32 (ENTROPY_ATTN_CPU_GEMM=brgemm_float, the path before them), each against SDPA in
the same process: the forward with statistics, and for prefill points also forward + backward.
Prints Markdown tables.

    python3 benchmarks/cpu_bf16.py [--reps 5] [--rounds 3] [--quick] [--out FILE]

The product path is read once per process, so every (point, setting) runs in a fresh process;
settings alternate over the rounds, and each cell is the fastest call over all rounds (the
machine is noisy). Each child checks its output against SDPA's before timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import cpu_name, positive_int  # noqa: E402  (benchmarks/timing.py)

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, torch, torch_ext
import torch.nn.functional as F
from timing import fastest_ms
B, H, Hkv, Lq, Lk, D, causal, reps = map(int, sys.argv[1:9])
torch.set_num_threads(int(sys.argv[9]))
g = torch.Generator().manual_seed(0)
q = torch.randn(B, H, Lq, D, generator=g).bfloat16()
k, v = (torch.randn(B, Hkv, Lk, D, generator=g).bfloat16() for _ in range(2))
kw = dict(is_causal=bool(causal), enable_gqa=H != Hkv)
with torch.no_grad():
    ours_out = torch_ext.attention(q, k, v, **kw)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kw)
    err = (ours_out.float() - ref).abs().max().item()
    assert err < 3e-2, f"output differs from SDPA's by {err}"
    ours = fastest_ms(lambda: torch_ext.attention(q, k, v, return_stats=True, **kw), reps)
    sdpa = fastest_ms(lambda: F.scaled_dot_product_attention(q, k, v, **kw), reps)
r = {"ours_ms": ours, "sdpa_ms": sdpa}
if Lq == Lk:  # prefill: also the gradients of q, k, v
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    g_out = torch.randn(q.shape, generator=g).bfloat16()
    grads = lambda attn: torch.autograd.grad(attn(q, k, v, **kw), (q, k, v), g_out)
    r["ours_bwd_ms"] = fastest_ms(lambda: grads(torch_ext.attention), reps)
    r["sdpa_bwd_ms"] = fastest_ms(lambda: grads(F.scaled_dot_product_attention), reps)
print(json.dumps(r))
"""


@dataclasses.dataclass(frozen=True)
class Point:
    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    causal: bool

    def label(self) -> str:
        kind = "prefill" if self.q_len == self.kv_len else f"{self.q_len} token{'s' * (self.q_len > 1)}"
        return (f"| {kind} | {self.batch} | {self.heads}:{self.kv_heads} | {self.q_len} | {self.kv_len} | "
                f"{self.head_dim} | {'yes' if self.causal else 'no'} |")


POINTS = [
    Point(2, 8, 8, 2048, 2048, 64, False),
    Point(2, 8, 8, 2048, 2048, 128, True),
    Point(1, 8, 2, 4096, 4096, 128, True),
    Point(8, 16, 16, 256, 256, 64, True),
    Point(1, 32, 32, 1, 2048, 128, False),
    Point(1, 32, 8, 1, 8192, 128, False),
    Point(1, 32, 32, 4, 2048, 128, False),
    Point(1, 32, 32, 16, 2048, 128, False),
]
QUICK = [Point(1, 2, 2, 300, 300, 64, True), Point(1, 4, 4, 4, 600, 64, False)]
SETTINGS = [("bf16", {}), ("float", {"ENTROPY_ATTN_CPU_GEMM": "brgemm_float"})]


def run_child(p: Point, env: dict, reps: int, threads: int) -> dict:
    args = [p.batch, p.heads, p.kv_heads, p.q_len, p.kv_len, p.head_dim, int(p.causal), reps, threads]
    out = subprocess.run([sys.executable, "-c", CHILD, *map(str, args)], capture_output=True, text=True, check=True,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'benchmarks'}", **env}).stdout
    return json.loads(out.strip().splitlines()[-1])


def measure(points: list, reps: int, rounds: int, threads: int) -> dict:
    """The fastest time of each (point, setting, quantity) over all rounds, SDPA's over both settings."""
    jobs = [(p, r, s) for p in points for r in range(rounds) for s in SETTINGS]
    best: dict = {}
    for p, _, (name, env) in tqdm(jobs, desc="cpu_bf16", unit="run", file=sys.stderr):
        for key, ms in run_child(p, env, reps, threads).items():
            cell = (p, "sdpa" if key.startswith("sdpa") else name, key.replace("sdpa", "ours"))
            best[cell] = min(best.get(cell, float("inf")), ms)
    return best


def table(points: list, best: dict, key: str) -> str:
    """A row per point that has `key` ("ours_ms", the forward, or "ours_bwd_ms", forward + backward)."""
    lines = ["| call | B | H : Hkv | query rows | keys | D | causal | widened to float32 (ms) | bfloat16 products (ms) "
             "| SDPA (ms) | speed-up | widened / SDPA | bfloat16 / SDPA |", "|---" * 13 + "|"]
    for p in points:
        if (p, "bf16", key) not in best:
            continue
        fl, bf, sdpa = (best[(p, name, key)] for name in ("float", "bf16", "sdpa"))
        lines.append(f"{p.label()} {fl:.3g} | {bf:.3g} | {sdpa:.3g} | {fl / bf:.2f}x | {fl / sdpa:.2f}x | "
                     f"{bf / sdpa:.2f}x |")
    return "\n".join(lines)


def machine() -> str:
    """The CPU, its bfloat16 instructions, torch and the commit measured."""
    try:
        flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "").split()
    except OSError:
        flags = []
    has = ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in ("avx512f", "avx512_bf16", "amx_bf16"))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    return (f"{cpu_name()} ({os.cpu_count()} CPUs; {has}), torch {torch.__version__}, "
            f"commit {commit.strip() or 'unknown'}, {time.strftime('%Y-%m-%d')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=positive_int, default=5, help="calls per process (the fastest counts)")
    ap.add_argument("--rounds", type=positive_int, default=3, help="processes per (point, setting), alternated")
    ap.add_argument("--threads", type=positive_int, default=2)
    ap.add_argument("--quick", action="store_true", help="two small points, one round")
    ap.add_argument("--out", type=Path, help="also write the table to this Markdown file")
    args = ap.parse_args()
    points, rounds = (QUICK, 1) if args.quick else (POINTS, args.rounds)
    best = measure(points, args.reps, rounds, args.threads)
    text = (f"{machine()}\n\nbfloat16, {args.threads} threads, fastest of {args.reps} calls x {rounds} processes per setting; SDPA "
            f"in the same processes.\n\nForward with statistics:\n\n{table(points, best, 'ours_ms')}\n\n"
            f"Forward + backward (the gradients of q, k and v; without statistics):\n\n"
            f"{table(points, best, 'ours_bwd_ms')}")
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
