"""benchmarks/launch_order_model.py: its launch order is a permutation that keeps the grid's own
order with one entry per section, its makespan replay can fail, and its table holds the committed
rows (results/gpu/launch_order_model.md is what the script writes)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "launch_order_model.py"
model = load_script(SCRIPT, "launch_order_model")


@pytest.mark.parametrize("x_dim,entries", [(1, 1), (4, 9), (7, 16), (32, 5)])
@pytest.mark.parametrize("sections", [0, 1, 2, 3, 4, 100])
def test_launch_tile_is_a_permutation(x_dim: int, entries: int, sections: int) -> None:
    tiles = [model.launch_tile(b, x_dim, entries, sections) for b in range(x_dim * entries)]
    assert sorted(tiles) == [(x, e) for x in range(x_dim) for e in range(entries)]
    if sections == 0 or sections >= entries:  # the grid's own order: x fastest
        assert tiles == [(b % x_dim, b // x_dim) for b in range(x_dim * entries)]


def test_makespan_replays_the_launch_order() -> None:
    # Two SMs: the heavy block last waits for the first two.
    assert model.makespan([1, 1, 4], 2) == 5
    assert model.makespan([4, 1, 1], 2) == 4


def test_sectioned_order_is_never_worse_on_the_benchmark_grid() -> None:
    points = [model.Point(4, h, hkv, d, seq) for d in (64, 128) for h, hkv in ((16, 16), (32, 8)) for seq in (1024, 4096)]
    for p in points:
        row = model.model_row(p, 132, 50 * 2**20, 1.0)
        for name in ("fwd", "bwd"):
            assert row[name]["sectioned"] <= row[name]["grid_order"] + 1e-9, (p, name, row[name])


def test_committed_table_is_the_scripts(tmp_path: Path) -> None:
    out = tmp_path / "model.md"
    model.main(["--out", str(out)])
    assert out.read_text() == (ROOT / "results" / "gpu" / "launch_order_model.md").read_text()


def test_sections_hold_a_wave_and_a_half() -> None:
    # The benchmark's GQA backward at L = 4096 (32 KV-head entries of 32 key blocks, 17 MB each):
    # sections of 7 entries (224 blocks on 132 SMs) at least, evened out to 4 of 8; sections of a
    # wave (5 entries, then 4) left the SMs waiting at the end (1.099x a perfect balance).
    assert model.launch_sections(32, 32, 17 * 2**20, 50 * 2**20, 132) == 4
    p = model.Point(4, 32, 8, 128, 4096)
    assert model.sections(p, 50 * 2**20, 132)[1] == 4
    assert model.model_row(p, 132, 50 * 2**20, 1.0)["bwd"]["sectioned"] < 1.01
    # Whatever the budget and the grid, every section holds 1.5 waves unless one holds the grid.
    for x_dim in (1, 3, 8, 32, 100, 128, 500):
        for nbytes in (2**17, 2**20, 2**24, 2**28):
            k = model.launch_sections(256, x_dim, nbytes, 50 * 2**20, 264)
            assert 0 <= k < 256
            if k > 1:
                assert 256 // k * x_dim * 2 >= 3 * 264, (x_dim, nbytes, k)


def test_sweep_summarizes_both_orders() -> None:
    points = [model.Point(4, 32, 8, 128, 4096), model.Point(1, 8, 8, 64, 1024)]
    row = model.sweep_row(points, 132, 50 * 2**20, 1.0)
    # The second call's grids hold fewer than two waves of blocks (8 x 8 and 8 x 8 tiles): left out.
    assert row["grids"] == 2
    geo, worst, above = row["sectioned"]
    assert 1.0 <= geo <= worst < 1.01 and above == 0
    assert row["grid_order"][1] > 1.05


def test_committed_sweep_is_the_scripts(tmp_path: Path) -> None:
    out = tmp_path / "sweep.md"
    model.main(["--sweep", "--out", str(out)])
    assert out.read_text() == (ROOT / "results" / "gpu" / "launch_order_sweep.md").read_text()


def test_grids_of_2_32_blocks_keep_their_order() -> None:
    # As launch_order.h's launch_tile_fits: the kernels' block indices are 32-bit.
    assert model.launch_sections(2**17, 2**16, 1, 50 * 2**20, 132) == 0
    assert model.launch_sections(2**15, 2**16, 1, 50 * 2**20, 132) > 0


def test_sweep_without_a_grid_of_two_waves() -> None:
    row = model.sweep_row([model.Point(1, 8, 8, 64, 1024)], 132, 50 * 2**20, 1.0)
    assert row["grids"] == 0 and row["sectioned"][2] == 0
