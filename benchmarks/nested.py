"""Jagged nested tensors on the CPU: torch_ext.attention on (B, H, j, D) sequences of different
lengths against SDPA on the same nested tensors and against SDPA on the batch padded to its longest
sequence with a boolean mask (what code without nested tensors does).

Each point holds sequences whose lengths spread evenly from an eighth of the longest to the
longest, self-attention, with or without causality. SDPA's CPU path for nested tensors (its math
kernel, sequence by sequence, materializing each L x L matrix) does not take ``is_causal``; those
points time the padded call alone. Each point first checks that the calls agree on every
sequence's rows; then they are timed interleaved over ``--repeats`` rounds in one process, and it
prints a Markdown table of the medians and the median per-round ratios::

    python benchmarks/nested.py            # the README's points
    python benchmarks/nested.py --quick    # small ones, seconds
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Dict, List, NamedTuple, Tuple

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import timing  # noqa: E402

import torch_ext  # noqa: E402


class Point(NamedTuple):
    """Self-attention over ``sequences`` sequences of up to ``max_len`` tokens."""

    sequences: int
    heads: int
    max_len: int
    head_dim: int
    dtype: torch.dtype
    causal: bool


POINTS = [
    Point(8, 8, 2048, 64, torch.float32, False),
    Point(8, 8, 2048, 64, torch.float32, True),
    Point(8, 8, 2048, 64, torch.bfloat16, False),
    Point(8, 8, 2048, 64, torch.bfloat16, True),
    Point(32, 8, 512, 64, torch.float32, False),
    Point(32, 8, 512, 64, torch.float32, True),
]
QUICK = [Point(4, 2, 200, 64, torch.float32, False), Point(3, 2, 160, 32, torch.bfloat16, True)]


def lengths(p: Point) -> List[int]:
    """Lengths spread evenly from max_len / 8 to max_len."""
    low = max(1, p.max_len // 8)
    if p.sequences == 1:
        return [p.max_len]
    return [low + (p.max_len - low) * i // (p.sequences - 1) for i in range(p.sequences)]


def inputs(p: Point) -> Tuple[List[torch.Tensor], List[torch.Tensor], torch.Tensor]:
    """Query, key and value as nested (B, H, j, D) tensors and padded to the longest sequence
    (B, H, L, D), and the padded call's bool mask (B, 1, L, L): the key is a token of the row's
    sequence (and, when causal, not after the row)."""
    gen = torch.Generator().manual_seed(0)
    nested, padded = [], []
    for _ in range(3):
        seqs = [torch.randn(n, p.heads, p.head_dim, generator=gen).to(p.dtype) for n in lengths(p)]
        nested.append(torch.nested.nested_tensor(seqs, layout=torch.jagged).transpose(1, 2))
        padded.append(torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True).transpose(1, 2).contiguous())
    n = torch.tensor(lengths(p))
    pos = torch.arange(p.max_len)
    mask = (pos[None, None, :] < n[:, None, None]).expand(-1, p.max_len, -1)
    if p.causal:
        mask = mask & (pos[None, None, :] <= pos[None, :, None])
    return nested, padded, mask.unsqueeze(1)


def calls(p: Point) -> Dict[str, Callable[[], torch.Tensor]]:
    """The timed calls: ours on the nested tensors, SDPA on them (not causal), SDPA padded."""
    nested, padded, mask = inputs(p)
    fns: Dict[str, Callable[[], torch.Tensor]] = {
        "ours": lambda: torch_ext.attention(*nested, is_causal=p.causal),
        "padded": lambda: F.scaled_dot_product_attention(*padded, attn_mask=mask),
    }
    if not p.causal:
        fns["nested"] = lambda: F.scaled_dot_product_attention(*nested)
    return fns


def check(p: Point) -> None:
    """Every call gives each sequence's rows the same output (to the dtype's rounding)."""
    tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2}[p.dtype]
    results = {name: fn() for name, fn in calls(p).items()}
    ours = results.pop("ours").unbind()
    for name, out in results.items():
        for b, n in enumerate(lengths(p)):
            other = (out.unbind()[b] if out.is_nested else out[b, :, :n]).float()
            err = ((ours[b].float() - other).abs() / (tol + tol * other.abs())).max().item()
            assert err <= 1, f"{p}: sequence {b} differs from SDPA {name} by {err:.3g} times the tolerance"


def measure(p: Point, repeats: int, min_run_time: float) -> Dict[str, float]:
    """Median ms of each call and the median per-round ratios ours / each SDPA call, after check()."""
    check(p)
    fns = calls(p)
    return timing.interleaved(fns, repeats, min_run_time, ratios=[("ours", name) for name in fns if name != "ours"])


def table(points: List[Point], repeats: int, min_run_time: float) -> str:
    """The Markdown table of the points' measurements."""
    lines = ["| dtype | sequences | lengths | H | D | causal | ours (ms) | SDPA nested (ms) | ratio | SDPA padded (ms) "
             "| ratio |", "|---" * 11 + "|"]
    for p in points:
        m = measure(p, repeats, min_run_time)
        nested = f"{m['nested']:.3g} | {m['ours/nested']:.2f}x" if "nested" in m else "— | —"
        lens = lengths(p)
        lines.append(f"| {str(p.dtype).removeprefix('torch.')} | {p.sequences} | {lens[0]}-{lens[-1]} | {p.heads} "
                     f"| {p.head_dim} | {'yes' if p.causal else 'no'} | {m['ours']:.3g} | {nested} "
                     f"| {m['padded']:.3g} | {m['ours/padded']:.2f}x |")
    return "\n".join(lines)


def main(argv: List[str] | None = None) -> None:
    timing.points_main(__doc__.split("\n\n")[0], table, POINTS, QUICK, argv)


if __name__ == "__main__":
    main()
