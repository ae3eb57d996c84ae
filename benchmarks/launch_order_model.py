"""A model of the Hopper kernels' launch order on causal calls: how long the SMs wait at the end of
a grid when the heaviest tiles start late (csrc/cuda/launch_order.h). No GPU: it replays the grid's
blocks in launch order onto the SMs (each block to the SM that frees first, as the GPU's block
scheduler does), with a block's time given by the key blocks (forward) or query blocks (backward)
it walks, plus a fixed cost per block. Prints, or writes, a Markdown table of the makespan of the
grid's own order (each head's tiles in a row) and of the sectioned order, over a perfect balance::

    python benchmarks/launch_order_model.py --out results/gpu/launch_order_model.md

A model, not a measurement: what it leaves out (L2 misses, the diagonal blocks' predicates, the
block scheduler's own latency) a GPU run of benchmarks/gpu_vs_sdpa.py with and without
ENTROPY_ATTN_CUDA_LAUNCH_ORDER=heads measures.
"""

from __future__ import annotations

import argparse
import heapq
import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

# The Hopper family's tiles (csrc/cuda/sm90): forward 128 query rows x 128 keys per block;
# backward 128 keys per thread block, walking query blocks of 64 rows.
FWD_M, FWD_N = 128, 128
BWD_M, BWD_N = 64, 128
BYTES = 2  # bf16 / fp16


@dataclass(frozen=True)
class Point:
    """One causal call of the GPU benchmark's grid."""

    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    seq_len: int


def ceil_div(a: int, b: int) -> int:
    """The ceiling of a / b for positive b."""
    return -(-a // b)


def launch_tile(block: int, x_dim: int, entries: int, sections: int) -> Tuple[int, int]:
    """(x, entry) of the block with linear index `block`: csrc/cuda/launch_order.h's launch_tile
    with the (y, z) entries flattened (sections < 1: the grid's own order)."""
    k = entries if sections < 1 else min(sections, entries)
    base, wide = divmod(entries, k)
    wide_blocks = wide * (base + 1) * x_dim
    if block < wide_blocks:
        width = base + 1
        first = block // (width * x_dim) * width
    else:
        width = base
        first = wide * (base + 1) + (block - wide_blocks) // (width * x_dim) * width
    in_section = block - first * x_dim
    return in_section // width, first + in_section % width


def launch_sections(entries: int, x_dim: int, nbytes: int, l2_bytes: int, resident_blocks: int) -> int:
    """csrc/cuda/launch_order.h's launch_sections (0: the grid's own order): sections whose entries'
    operands fit in 5/8 of L2, but each, once the widths are evened out, at least one and a half
    waves of blocks."""
    if entries <= 1 or x_dim < 1 or nbytes <= 0 or l2_bytes <= 0:
        return 0
    if entries >= 2**32 // x_dim:  # launch_tile_fits: 32-bit block indices
        return 0
    fit = max(1, l2_bytes // 8 * 5 // nbytes)
    min_width = max(1, ceil_div(3 * max(resident_blocks, 1), 2 * x_dim))
    sections = max(1, min(ceil_div(entries, fit), entries // min_width))
    return 0 if sections >= entries else sections


def makespan(times: Sequence[float], sms: int) -> float:
    """When the last SM finishes, the blocks given in launch order to whichever SM frees first."""
    free = [0.0] * sms
    for t in times:
        heapq.heappush(free, heapq.heappop(free) + t)
    return max(free)


def forward_times(p: Point, section: int, overhead: float) -> List[float]:
    """Block times in launch order: query tile m (x reversed: the heaviest first) walks the key
    blocks up to its last row's diagonal."""
    tiles = ceil_div(p.seq_len, FWD_M)
    entries = p.batch * p.heads
    out = []
    for block in range(tiles * entries):
        x, _ = launch_tile(block, tiles, entries, section)
        m = tiles - 1 - x
        out.append(overhead + ceil_div(min(p.seq_len, (m + 1) * FWD_M), FWD_N))
    return out


def backward_times(p: Point, section: int, overhead: float) -> List[float]:
    """Block times in launch order: key block n walks the query blocks of its GQA group's heads
    from row n * 128 on."""
    blocks = ceil_div(p.seq_len, BWD_N)
    entries = p.batch * p.kv_heads
    group = p.heads // p.kv_heads
    out = []
    for block in range(blocks * entries):
        n, _ = launch_tile(block, blocks, entries, section)
        out.append(overhead + group * ceil_div(p.seq_len - n * BWD_N, BWD_M))
    return out


def sections(p: Point, l2_bytes: int, sms: int) -> Tuple[int, int]:
    """The auto rule's section counts of the forward and the backward (csrc/cuda/family.cpp)."""
    group = p.heads // p.kv_heads
    kv_bytes = p.seq_len * 2 * p.head_dim * BYTES
    fwd = launch_sections(p.batch * p.heads, ceil_div(p.seq_len, FWD_M), max(1, kv_bytes // group), l2_bytes, sms)
    per_row = 2 * p.head_dim * BYTES + (p.head_dim + 5) * 4
    bwd = launch_sections(p.batch * p.kv_heads, ceil_div(p.seq_len, BWD_N), group * p.seq_len * per_row, l2_bytes, sms)
    return fwd, bwd


def model_row(p: Point, sms: int, l2_bytes: int, overhead: float) -> dict:
    """The makespans over a perfect balance (total work / SMs) of both orders, both directions."""
    row = {"point": p}
    for name, times_of, section in zip(("fwd", "bwd"), (forward_times, backward_times), sections(p, l2_bytes, sms)):
        grid_order = times_of(p, 0, overhead)
        ideal = sum(grid_order) / sms
        row[name] = {
            "sections": section,
            "grid_order": makespan(grid_order, sms) / ideal,
            "sectioned": makespan(times_of(p, section, overhead), sms) / ideal,
        }
    return row


def markdown(rows: List[dict], sms: int, l2_mb: float, overhead: float) -> str:
    """The table of the model's rows."""
    lines = [
        "# The launch order of causal calls: a model (no GPU)",
        "",
        f"`python benchmarks/launch_order_model.py --sms {sms} --l2-mb {l2_mb:g} --overhead {overhead:g}`: "
        f"{sms} SMs, one block each (the Hopper kernels'), {l2_mb:g} MB of L2 (5/8 for the sections), "
        f"a block's time = {overhead:g} + the key blocks (forward) or query blocks x GQA group (backward) it "
        "walks. Makespan over a perfect balance (1.00 = no SM waits); *grid order*: each head's tiles in "
        "a row, the heaviest first (before csrc/cuda/launch_order.h); *sectioned*: every head's "
        "heaviest tile before any head's second, within the number of sections given (0: the grid "
        "order, which the rule keeps where one section would hold a single head). A model, not a "
        "measurement: a GPU run compares the two with `ENTROPY_ATTN_CUDA_LAUNCH_ORDER=heads`.",
        "",
        "| B | H:Hkv | D | L | fwd sections | fwd grid order | fwd sectioned | bwd sections | bwd grid order | bwd sectioned |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p, f, b = r["point"], r["fwd"], r["bwd"]
        lines.append(
            f"| {p.batch} | {p.heads}:{p.kv_heads} | {p.head_dim} | {p.seq_len} | {f['sections']} | "
            f"{f['grid_order']:.3f} | {f['sectioned']:.3f} | {b['sections']} | {b['grid_order']:.3f} | "
            f"{b['sectioned']:.3f} |"
        )
    return "\n".join(lines) + "\n"


SWEEP_BATCHES = (1, 2, 4, 8)
SWEEP_HEADS = ((8, 8), (16, 16), (32, 32), (16, 2), (32, 8), (64, 8))
SWEEP_DIMS = (64, 128)
SWEEP_SEQS = (1024, 2048, 4096, 8192, 16384)


def sweep_row(points: Sequence[Point], sms: int, l2_bytes: int, overhead: float) -> dict:
    """Geometric mean and maximum of both orders' makespans over a perfect balance, over the
    directions of `points` whose grids hold two waves of blocks or more (a smaller grid's time is
    set by its heaviest tile, whatever the order)."""
    grid, sectioned = [], []
    for p in points:
        for times_of, section in zip((forward_times, backward_times), sections(p, l2_bytes, sms)):
            own = times_of(p, 0, overhead)
            if len(own) < 2 * sms:
                continue
            ideal = sum(own) / sms
            grid.append(makespan(own, sms) / ideal)
            sectioned.append(makespan(times_of(p, section, overhead), sms) / ideal)

    def summary(values: List[float]) -> Tuple[float, float, int]:
        if not values:  # no grid of two waves on this GPU size
            return math.nan, math.nan, 0
        return math.exp(sum(map(math.log, values)) / len(values)), max(values), sum(v > 1.05 for v in values)

    return {"sms": sms, "grids": len(grid), "grid_order": summary(grid), "sectioned": summary(sectioned)}


def sweep_markdown(rows: List[dict], l2_mb: float, overhead: float, points: int) -> str:
    """The table of the sweep's rows, one per GPU size."""
    lines = [
        "# The launch order of causal calls over a wider grid: a model (no GPU)",
        "",
        f"`python benchmarks/launch_order_model.py --sweep --l2-mb {l2_mb:g} --overhead {overhead:g} "
        f"--sweep-sms {' '.join(str(r['sms']) for r in rows)}`: {points} causal calls (B in "
        f"{', '.join(map(str, SWEEP_BATCHES))}; H:Hkv in {', '.join(f'{h}:{k}' for h, k in SWEEP_HEADS)}; "
        f"D in {', '.join(map(str, SWEEP_DIMS))}; L in {', '.join(map(str, SWEEP_SEQS))}), forward and "
        "backward, of which the grids of two waves of blocks or more count. Makespan over a perfect "
        "balance as in launch_order_model.md: its geometric mean, its maximum and the grids above "
        "1.05x, in the grid's own order and in the rule's sections.",
        "",
        "| blocks at once | grids | grid order: geo mean | max | > 1.05x | sectioned: geo mean | max | > 1.05x |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        g, s = r["grid_order"], r["sectioned"]
        lines.append(
            f"| {r['sms']} | {r['grids']} | {g[0]:.4f} | {g[1]:.3f} | {g[2]} | {s[0]:.4f} | {s[1]:.3f} | {s[2]} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Model the benchmark's causal grid and print or write the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sms", type=int, default=132, help="SMs (132: H100 SXM, H200)")
    ap.add_argument("--l2-mb", type=float, default=50.0, help="L2 in MB (50: H100, H200)")
    ap.add_argument("--overhead", type=float, default=1.0, help="fixed time of a block, in block steps")
    ap.add_argument("--seq", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--sweep", action="store_true", help="summarize the wider grid instead (about 10 s)")
    ap.add_argument("--sweep-sms", type=int, nargs="+", default=[108, 114, 132, 264], help="GPU sizes of --sweep, in resident blocks")
    ap.add_argument("--out", help="write the Markdown table here instead of printing it")
    args = ap.parse_args(argv)
    l2 = int(args.l2_mb * 2**20)
    if args.sweep:
        points = [
            Point(b, h, hkv, d, seq)
            for b in SWEEP_BATCHES
            for h, hkv in SWEEP_HEADS
            for d in SWEEP_DIMS
            for seq in SWEEP_SEQS
        ]
        rows = [sweep_row(points, sms, l2, args.overhead) for sms in args.sweep_sms]
        text = sweep_markdown(rows, args.l2_mb, args.overhead, len(points))
    else:
        points = [
            Point(4, h, hkv, d, seq) for d in (64, 128) for h, hkv in ((16, 16), (32, 8)) for seq in args.seq
        ]
        text = markdown([model_row(p, args.sms, l2, args.overhead) for p in points], args.sms, args.l2_mb, args.overhead)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
