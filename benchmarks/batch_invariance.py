"""What batch invariance costs on the CPU: varlen_attention with ``num_splits=1`` (each sequence
computed as a call of its own, so that its results do not depend on what else is packed) against
the same packed call with ``num_splits=None`` (one call over every sequence).

Three kinds of point: decoding (one query token per sequence over its cached keys, GQA, lengths
spread from half the longest to the longest); the same with the last sequence's prompt instead, a
causal chunk of ``CHUNK`` tokens (continuous batching, which packs prefills with decoding steps);
and packed prefill (causal documents of mixed lengths, as a training batch packs them). Each
point first checks that both agree and that the first sequence's output is bitwise the one it gets
packed alone under ``num_splits=1``; then the two calls are timed interleaved over ``--repeats``
rounds in one process, and it prints a Markdown table of the medians and of the median per-round
ratio::

    python benchmarks/batch_invariance.py            # the README's points
    python benchmarks/batch_invariance.py --quick    # small ones, seconds
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Dict, List, NamedTuple, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import timing  # noqa: E402

import torch_ext  # noqa: E402


class Point(NamedTuple):
    """A packed call: "decode" (one row per sequence), "mixed" (the last sequence a prefill chunk)
    or "prefill" (causal documents)."""

    kind: str
    sequences: int
    heads: int
    kv_heads: int
    max_len: int
    head_dim: int
    dtype: torch.dtype


CHUNK = 512
POINTS = [
    Point("decode", 8, 32, 8, 2048, 128, torch.float32),
    Point("decode", 32, 32, 8, 1024, 128, torch.float32),
    Point("decode", 8, 32, 8, 2048, 128, torch.bfloat16),
    Point("mixed", 8, 32, 8, 2048, 128, torch.float32),
    Point("mixed", 8, 32, 8, 2048, 128, torch.bfloat16),
    Point("prefill", 8, 16, 4, 1024, 64, torch.float32),
    Point("prefill", 32, 16, 4, 256, 64, torch.float32),
    Point("prefill", 8, 16, 4, 1024, 64, torch.bfloat16),
]
QUICK = [Point("mixed", 4, 4, 2, 600, 64, torch.float32), Point("prefill", 3, 4, 2, 200, 64, torch.bfloat16)]


def _offsets(lengths: List[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def inputs(p: Point) -> Tuple[List[int], List[int], Tuple[torch.Tensor, ...], bool]:
    """Rows and keys of each sequence, (q, k, v) packed, and whether the call is causal."""
    g = torch.Generator().manual_seed(0)
    lengths = [p.max_len // 2 + (p.max_len - p.max_len // 2) * (i + 1) // p.sequences for i in range(p.sequences)]
    rows = lengths if p.kind == "prefill" else [1] * p.sequences
    if p.kind == "mixed":
        rows[-1] = CHUNK  # (causal, bottom-right: the chunk's last rows see the sequence's last keys)
    q = torch.randn(sum(rows), p.heads, p.head_dim, generator=g).to(p.dtype)
    k, v = (torch.randn(sum(lengths), p.kv_heads, p.head_dim, generator=g).to(p.dtype) for _ in range(2))
    return rows, lengths, (q, k, v), p.kind != "decode"


def calls(p: Point) -> Dict[str, Callable[[], torch.Tensor]]:
    """The two calls of a point: "packed" (num_splits=None) and "invariant" (num_splits=1)."""
    rows, lengths, (q, k, v), causal = inputs(p)
    cu_q, cu_k = _offsets(rows), _offsets(lengths)

    def call(splits: int | None) -> Callable[[], torch.Tensor]:
        return lambda: torch_ext.varlen_attention(q, k, v, cu_q, cu_k, max(rows), max(lengths), is_causal=causal,
                                                  enable_gqa=True, num_splits=splits)

    return {"packed": call(None), "invariant": call(1)}


def check(p: Point) -> None:
    """Both calls agree, and the first sequence's rows under num_splits=1 are bitwise those of a call
    over it alone."""
    fns = calls(p)
    tol = 1e-5 if p.dtype == torch.float32 else 2e-2
    packed, invariant = fns["packed"]().float(), fns["invariant"]().float()
    torch.testing.assert_close(invariant, packed, atol=tol, rtol=tol)
    rows, lengths, (q, k, v), causal = inputs(p)
    alone = torch_ext.varlen_attention(q[: rows[0]], k[: lengths[0]], v[: lengths[0]], _offsets(rows[:1]),
                                       _offsets(lengths[:1]), rows[0], lengths[0], is_causal=causal,
                                       enable_gqa=True, num_splits=1)
    assert torch.equal(invariant[: rows[0]], alone.float()), "num_splits=1: the first sequence differs from its call alone"


def measure(p: Point, repeats: int, min_run_time: float) -> Dict[str, float]:
    """Median ms of each call and the median per-round ratio invariant / packed, after check()."""
    check(p)
    return timing.interleaved(calls(p), repeats, min_run_time, ratios=[("invariant", "packed")])


def table(points: List[Point], repeats: int, min_run_time: float) -> str:
    """The Markdown table of the points' measurements."""
    lines = ["| call | dtype | sequences | H : Hkv | keys (longest) | D | num_splits=None (ms) | num_splits=1 (ms) "
             "| ratio |", "|---" * 9 + "|"]
    for p in points:
        m = measure(p, repeats, min_run_time)
        lines.append(f"| {p.kind} | {str(p.dtype).removeprefix('torch.')} | {p.sequences} | {p.heads} : {p.kv_heads} "
                     f"| {p.max_len} | {p.head_dim} | {m['packed']:.3g} | {m['invariant']:.3g} | {m['invariant/packed']:.2f}x |")
    return "\n".join(lines)


def main(argv: List[str] | None = None) -> None:
    timing.points_main(__doc__.split("\n\n")[0], table, POINTS, QUICK, argv)


if __name__ == "__main__":
    main()
