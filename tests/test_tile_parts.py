"""The sm80 backward's products run in parts, checked on the CPU: tests/cpp/tile_parts.cu (host
code built by nvcc, no GPU) walks every thread of dP = dO V^T's key parts (D = 128) and of
G = dS K's head-dim parts (D = 256) through the kernels' own partitions of the swizzled shared
tiles, and checks that each element read is the one at the part's place in the whole tile, and
that G's accumulator coordinates (the dq atomics' targets) are the part's columns. The D = 256
kernels have not run on a GPU; this pins the indexing their parts depend on. Skipped, saying why,
without nvcc or the pinned CUTLASS headers."""

from __future__ import annotations

from pathlib import Path

from test_dropout_layouts import run_host_program

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "tests" / "cpp" / "tile_parts.cu"


def test_backward_parts_read_their_places_of_the_tiles() -> None:
    """Every part of every head dim checks out: 12 lines, no mismatch."""
    out = run_host_program(SOURCE)
    assert out.count(" ok") == 12 and "MISMATCH" not in out, out
