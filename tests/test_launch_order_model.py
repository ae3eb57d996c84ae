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
