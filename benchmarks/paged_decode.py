"""Decoding over a paged KV cache on the CPU: varlen_attention with block_table, against the same
keys packed and against SDPA on a padded batch.

A batch of sequences of different lengths (from half the longest to the longest), one query token
each, their keys in pages of a shared pool in a shuffled order, as a serving engine keeps them.
Three calls on the same keys: ours on the pages (``block_table``: the CPU kernels read the pool's
tokens where they lie, through ``key_rows``), ours on the keys already packed (``cu_seq_k``: what
reading them from pages costs is the difference), and SDPA on a padded (B, Hkv, longest, D) cache with a boolean mask of each sequence's
keys (what a user without a paged kernel runs). All three are checked to agree, then timed
interleaved over ``--repeats`` rounds in one process; it prints a Markdown table of the medians
and of the median per-round ratios::

    python benchmarks/paged_decode.py            # the README's points
    python benchmarks/paged_decode.py --quick    # small ones, seconds
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Dict, List, NamedTuple

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import timing  # noqa: E402

import torch_ext  # noqa: E402


class Point(NamedTuple):
    """A decoding step: sequences, query heads, key/value heads, longest sequence, page size, head dim."""

    batch: int
    heads: int
    kv_heads: int
    max_len: int
    page_size: int
    head_dim: int
    dtype: torch.dtype


POINTS = [
    Point(8, 32, 8, 2048, 16, 128, torch.float32),
    Point(8, 32, 8, 8192, 16, 128, torch.float32),
    Point(8, 32, 8, 8192, 256, 128, torch.float32),
    Point(32, 32, 8, 1024, 16, 128, torch.float32),
    Point(8, 32, 8, 2048, 16, 128, torch.bfloat16),
]
QUICK = [Point(2, 4, 2, 300, 16, 64, torch.float32), Point(3, 4, 2, 200, 8, 64, torch.bfloat16)]


def calls(p: Point) -> Dict[str, Callable[[], torch.Tensor]]:
    """The three calls of a point (outputs (B, H, D)): "paged", "packed" and "sdpa"."""
    g = torch.Generator().manual_seed(0)
    lengths = [p.max_len // 2 + (p.max_len - p.max_len // 2) * (i + 1) // p.batch for i in range(p.batch)]
    pages_of = [-(-n // p.page_size) for n in lengths]
    num_pages = sum(pages_of) + 8
    order = torch.randperm(num_pages, generator=g)
    table = torch.zeros(p.batch, max(pages_of), dtype=torch.int32)
    taken = 0
    for d, n in enumerate(pages_of):
        table[d, :n] = order[taken : taken + n].int()
        taken += n
    k_pool, v_pool = (torch.randn(num_pages, p.page_size, p.kv_heads, p.head_dim, generator=g).to(p.dtype)
                      for _ in range(2))
    q = torch.randn(p.batch, p.heads, p.head_dim, generator=g).to(p.dtype)
    used = torch.tensor(lengths, dtype=torch.int32)
    cu_q = torch.arange(p.batch + 1, dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)

    def sequence(pool: torch.Tensor, d: int) -> torch.Tensor:  # (length, Hkv, D)
        return pool[table[d, : pages_of[d]].long()].flatten(0, 1)[: lengths[d]]

    k_packed, v_packed = (torch.cat([sequence(pool, d) for d in range(p.batch)]) for pool in (k_pool, v_pool))
    padded = [torch.zeros(p.batch, p.kv_heads, p.max_len, p.head_dim, dtype=p.dtype) for _ in range(2)]
    for d in range(p.batch):
        padded[0][d, :, : lengths[d]] = sequence(k_pool, d).transpose(0, 1)
        padded[1][d, :, : lengths[d]] = sequence(v_pool, d).transpose(0, 1)
    mask = torch.arange(p.max_len)[None, :] < used[:, None]
    return {
        "paged": lambda: torch_ext.varlen_attention(q, k_pool, v_pool, cu_q, None, 1, p.max_len, seqused_k=used,
                                                    block_table=table, enable_gqa=True),
        "packed": lambda: torch_ext.varlen_attention(q, k_packed, v_packed, cu_q, cu_k, 1, p.max_len,
                                                     enable_gqa=True),
        "sdpa": lambda: F.scaled_dot_product_attention(q[:, :, None], *padded, attn_mask=mask[:, None, None],
                                                       enable_gqa=True)[:, :, 0],
    }


def measure(p: Point, repeats: int, min_run_time: float) -> Dict[str, float]:
    """Median ms of each call and the median per-round ratios paged/packed and paged/sdpa, after
    checking the three agree."""
    fns = calls(p)
    tol = 1e-4 if p.dtype == torch.float32 else 2e-2
    want = fns["sdpa"]().float()
    for name in ("paged", "packed"):
        torch.testing.assert_close(fns[name]().float(), want, atol=tol, rtol=tol, msg=lambda m: f"{name}: {m}")
    return timing.interleaved(fns, repeats, min_run_time, ratios=[("paged", "packed"), ("paged", "sdpa")])


def table(points: List[Point], repeats: int, min_run_time: float) -> str:
    """The Markdown table of the points' measurements."""
    lines = ["| dtype | sequences | H : Hkv | keys (longest) | page | D | paged (ms) | packed (ms) | SDPA padded (ms) "
             "| paged / packed | paged / SDPA |", "|---" * 11 + "|"]
    for p in points:
        m = measure(p, repeats, min_run_time)
        lines.append(f"| {str(p.dtype).removeprefix('torch.')} | {p.batch} | {p.heads} : {p.kv_heads} | {p.max_len} | "
                     f"{p.page_size} | {p.head_dim} | {m['paged']:.3g} | {m['packed']:.3g} | {m['sdpa']:.3g} | "
                     f"{m['paged/packed']:.2f}x | {m['paged/sdpa']:.2f}x |")
    return "\n".join(lines)


def main(argv: List[str] | None = None) -> None:
    timing.points_main(__doc__.split("\n\n")[0], table, POINTS, QUICK, argv)


if __name__ == "__main__":
    main()
