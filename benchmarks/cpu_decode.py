"""KV-cache decoding on the CPU: one query token (or a few) against a cache, ours against SDPA.

Each point runs both on the same inputs (keys and values a slice of a larger preallocated cache,
as transformers' static cache passes them), interleaved over ``--repeats`` rounds in one process;
it prints a Markdown table of the medians and of the median per-round ratio (ours / SDPA)::

    python benchmarks/cpu_decode.py            # the README's points
    python benchmarks/cpu_decode.py --quick    # small ones, seconds
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, NamedTuple

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import timing  # noqa: E402

import torch_ext  # noqa: E402


class Point(NamedTuple):
    """One decoding call: batch, query heads, key/value heads, query tokens, cached keys, head dim."""

    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    dtype: torch.dtype


POINTS = [
    Point(1, 32, 32, 1, 2048, 128, torch.float32),
    Point(8, 32, 32, 1, 1024, 128, torch.float32),
    Point(1, 32, 8, 1, 2048, 128, torch.float32),
    Point(1, 32, 8, 1, 8192, 128, torch.float32),
    Point(1, 32, 32, 1, 2048, 128, torch.bfloat16),
    # A few query tokens per step (speculative decoding, chunked prefill; no causality here).
    Point(1, 32, 32, 4, 2048, 128, torch.float32),
    Point(1, 32, 32, 16, 2048, 128, torch.float32),
    Point(1, 32, 32, 4, 2048, 128, torch.bfloat16),
]
QUICK = [Point(1, 4, 4, 1, 600, 64, torch.float32), Point(1, 4, 2, 1, 600, 64, torch.bfloat16)]


def measure(p: Point, repeats: int, min_run_time: float) -> tuple[float, float, float]:
    """(ours ms, SDPA ms, median ratio) of one point, after checking both give the same output."""
    g = torch.Generator().manual_seed(0)
    cache = [torch.randn(p.batch, p.kv_heads, p.kv_len + 512, p.head_dim, generator=g).to(p.dtype) for _ in range(2)]
    k, v = (c[:, :, : p.kv_len] for c in cache)
    q = torch.randn(p.batch, p.heads, p.q_len, p.head_dim, generator=g).to(p.dtype)
    ours = lambda: torch_ext.attention(q, k, v, enable_gqa=True)  # noqa: E731
    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
    tol = 1e-4 if p.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours().float(), sdpa().float(), atol=tol, rtol=tol)
    m = timing.interleaved({"ours": ours, "sdpa": sdpa}, repeats, min_run_time, ratios=[("ours", "sdpa")])
    return m["ours"], m["sdpa"], m["ours/sdpa"]


def table(points: List[Point], repeats: int, min_run_time: float) -> str:
    """The Markdown table of the points' measurements."""
    lines = ["| dtype | B | H : Hkv | Lq | keys | D | ours (ms) | SDPA (ms) | ours / SDPA |", "|---" * 9 + "|"]
    for p in points:
        ours, sdpa, ratio = measure(p, repeats, min_run_time)
        lines.append(f"| {str(p.dtype).removeprefix('torch.')} | {p.batch} | {p.heads} : {p.kv_heads} | {p.q_len} | "
                     f"{p.kv_len} | {p.head_dim} | {ours:.3g} | {sdpa:.3g} | {ratio:.2f}x |")
    return "\n".join(lines)


def main(argv: List[str] | None = None) -> None:
    timing.points_main(__doc__.split("\n\n")[0], table, POINTS, QUICK, argv)


if __name__ == "__main__":
    main()
