"""The length-generalization demo (examples/length_generalization.py) runs end to end on a tiny
configuration, writes every output, and is reproducible from its seed."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import ModuleType
from typing import Any, Dict, List

import pytest
import torch
from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "length_generalization.py"

TINY: List[str] = [
    "--steps", "24", "--batch", "16", "--warmup", "5",
    "--pairs", "4", "--queries", "4", "--keys", "32", "--values", "8",
    "--d-model", "32", "--heads", "2", "--layers", "2",
    "--factors", "1", "2", "4",
    "--eval-seqs", "12", "--eval-batch", "8",
    "--monitor-every", "8", "--track-every", "12", "--track-seqs", "4",
    "--threads", "1", "--no-progress", "--seed", "3",
]


def _load() -> ModuleType:
    return load_script(SCRIPT, "length_generalization")


@pytest.fixture(scope="module")
def demo() -> ModuleType:
    return _load()


@pytest.fixture(scope="module")
def tiny_run(demo: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    out = tmp_path_factory.mktemp("demo_a")
    return {"out": out, "results": demo.main(TINY + ["--out", str(out)])}


def test_outputs_exist(tiny_run: Dict[str, Any], demo: ModuleType) -> None:
    out: Path = tiny_run["out"]
    for name in ("results.md", "results.json", "accuracy.png", "entropy.png", "training.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    for setting in demo.SETTINGS:
        for policy in demo.POLICIES:
            log = out / f"train_entropy_{setting}_{policy}.jsonl"
            records = [json.loads(line) for line in log.read_text().splitlines()]
            assert {r["step"] for r in records} == {0, 8, 16}  # --monitor-every 8, 24 steps
            assert all(0 <= r["normalized_entropy_mean"] <= 1 for r in records)
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["command"].startswith("python examples/length_generalization.py --steps 24")


def test_table_has_every_cell(tiny_run: Dict[str, Any], demo: ModuleType) -> None:
    results = tiny_run["results"]
    table = (tiny_run["out"] / "results.md").read_text()
    T = 2 * 4 + 4
    for setting in demo.SETTINGS:
        assert demo.SETTING_TITLES[setting] in table
        runs = results["settings"][setting]["policies"]
        assert set(runs) == set(demo.POLICIES)
        for policy, run in runs.items():
            assert [e["factor"] for e in run["eval"]] == [1, 2, 4]
            assert [e["length"] for e in run["eval"]] == [T, 2 * T, 4 * T]
            for e in run["eval"]:
                assert 0.0 <= e["accuracy"] <= 1.0
                assert math.isfinite(e["loss"]) and e["loss"] >= 0
                assert f"{e['accuracy']:.3f}" in table
            assert (run["multipliers"] is not None) == (policy == "learnable")
            assert [t["step"] for t in run["train"]["track"]] == [12, 24]
    # one row per evaluation length in each setting's accuracy table and entropy table
    for f in (1, 2, 4):
        assert table.count(f"| {f * T} | {f} |") == 2 * len(demo.SETTINGS)
    assert "Total wall time" in table and "```bash" in table


def test_entropy_curves_finite(tiny_run: Dict[str, Any], demo: ModuleType) -> None:
    for setting in demo.SETTINGS:
        for run in tiny_run["results"]["settings"][setting]["policies"].values():
            for e in run["eval"]:
                assert set(e["entropy"]) == {"blocks.0.attn", "blocks.1.attn"}
                for layer in e["entropy"].values():
                    curve = layer["per_head_position"]
                    assert len(curve) == 2 and all(len(h) == e["length"] for h in curve)  # (H, L)
                    assert all(math.isfinite(x) and 0 <= x <= 1 + 1e-6 for h in curve for x in h)
                    assert all(x == 0 for h in curve for x in h[:1])  # n_1 = 1: no normalized entropy
                    assert math.isfinite(layer["query_mean"])


def test_same_seed_same_numbers(tiny_run: Dict[str, Any], demo: ModuleType, tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    again = demo.main(TINY + ["--out", str(tmp_path), "--settings", "qknorm"])
    assert torch.get_num_threads() == threads  # main() leaves the thread count as it found it
    first = tiny_run["results"]["settings"]["qknorm"]["policies"]
    for policy, run in again["settings"]["qknorm"]["policies"].items():
        assert run["train"]["losses"] == first[policy]["train"]["losses"]
        assert [e["accuracy"] for e in run["eval"]] == [e["accuracy"] for e in first[policy]["eval"]]
        assert [e["loss"] for e in run["eval"]] == [e["loss"] for e in first[policy]["eval"]]


def test_policies_share_init_and_data(tiny_run: Dict[str, Any], demo: ModuleType) -> None:
    """Paired comparison: before the first update the three policies see the same batch with the
    same weights, so their first training losses agree closely (they differ only by the scale)."""
    for setting in demo.SETTINGS:
        runs = tiny_run["results"]["settings"][setting]["policies"]
        first = [runs[p]["train"]["losses"][0] for p in demo.POLICIES]
        assert max(first) - min(first) < 1e-2
        assert runs["logn"]["train"]["losses"][0] == runs["learnable"]["train"]["losses"][0]


def test_rejects_inconsistent_config(demo: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An inconsistent configuration is a usage error naming it (Config.check's ValueError)."""
    for args, match in ((["--pairs", "8", "--queries", "4", "--keys", "64", "--factors", "1", "16"], "keys (64) must be >= pairs"),
                        (["--pairs", "4", "--queries", "8"], "queries (8) must be <= pairs (4)"),
                        (["--steps", "0"], "steps must be >= 1, got 0")):
        with pytest.raises(SystemExit) as exit_info:
            demo.parse_args([*args, "--out", str(tmp_path)])
        assert exit_info.value.code == 2 and match in capsys.readouterr().err
    with pytest.raises(ValueError, match="queries"):
        demo.Config(pairs=4, queries=8).check()
