"""scripts/harness_ab.py, the comparison of two kernel-harness runs made in one GPU lease: the
ratios per point and column (the backward alone derived), points timed by one run only, the
geometric means and the failed checks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict

import pytest
from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
ab = load_script(ROOT / "scripts" / "harness_ab.py", "harness_ab")


def point(seq_len: int, fwd: float, fwd_stats: float, fwd_bwd: float, causal: bool = False) -> Dict[str, Any]:
    return {"family": "sm90", "dtype": "bf16", "batch": 4, "heads": 16, "kv_heads": 16, "head_dim": 128,
            "seq_len": seq_len, "causal": causal, "fwd_ms": fwd, "fwd_stats_ms": fwd_stats, "fwd_bwd_ms": fwd_bwd}


def run(commit: str, *points: Dict[str, Any], failed: int = 0) -> Dict[str, Any]:
    checks = [{"family": "sm90", "dtype": "bf16", "call": f"call {i}", "what": "backward: dq", "ok": i >= failed}
              for i in range(3)]
    return {"device": "NVIDIA H200", "commit": commit, "checks": checks, "points": list(points)}


def row_of(text: str, seq_len: int, causal: str = "no") -> str:
    return next(line for line in text.splitlines() if f"| {seq_len} | {causal} |" in line)


def test_ratios_per_column_with_the_backward_alone() -> None:
    base = run("aaa", point(4096, 1.0, 1.2, 4.2))
    current = run("bbb", point(4096, 0.9, 1.1, 3.8))
    text = ab.compare(base, current)
    assert "bbb against aaa" in text.splitlines()[0]
    row = row_of(text, 4096)
    # fwd 0.9, fwd+stats 1.1/1.2, bwd (3.8 - 1.1) / (4.2 - 1.2) = 0.9, total 3.8/4.2.
    assert "1 → 0.9 (0.900)" in row and "1.2 → 1.1 (0.917)" in row
    assert "3 → 2.7 (0.900)" in row and "4.2 → 3.8 (0.905)" in row
    assert "Checks of the baseline run: 3, none failed." in text


def test_the_regularized_backward_against_a_baseline_without_it() -> None:
    """The backward of an entropy regularizer's loss (fwd_bwd_reg_ms, less the forward with
    statistics): a ratio where both runs timed it, "—" against a harness built before the column,
    and never a difference with an untimed 0."""
    with_reg = dict(point(4096, 1.0, 1.2, 4.2), fwd_bwd_reg_ms=5.2)
    text = ab.compare(run("aaa", with_reg), run("bbb", dict(point(4096, 1.0, 1.1, 4.0), fwd_bwd_reg_ms=4.1)))
    assert row_of(text, 4096).endswith("| 4 → 3 (0.750) |")  # (4.1 - 1.1) / (5.2 - 1.2)
    assert "bwd reg 0.750." in text
    text = ab.compare(run("aaa", point(4096, 1.0, 1.2, 4.2)), run("bbb", with_reg))
    assert row_of(text, 4096).endswith("| — → 4 (—) |")
    untimed = dict(point(4096, 1.0, 1.2, 0.0), fwd_bwd_reg_ms=0.0)  # a backward the harness skipped
    assert ab.compare(run("aaa", untimed), run("bbb", untimed)).count("— → — (—)") == 2


def test_points_of_one_run_and_geometric_means() -> None:
    base = run("aaa", point(1024, 1.0, 1.0, 2.0), point(4096, 2.0, 2.0, 4.0))
    current = run("bbb", point(1024, 0.5, 1.0, 2.0), point(4096, 4.0, 2.0, 4.0), point(16384, 1.0, 1.0, 1.0, True))
    text = ab.compare(base, current)
    assert "— → 1 (—)" in row_of(text, 16384, "yes")  # timed by the current run only
    # fwd ratios 0.5 and 2: geometric mean 1; the lone point does not count.
    assert "fwd 1.000, fwd+stats 1.000, bwd 1.000" in text


def test_failed_checks_are_listed() -> None:
    text = ab.compare(run("aaa", failed=0), run("bbb", failed=2))
    assert "Checks failed in the current run (2 of 3):" in text
    assert "- sm90 bf16 call 0: backward: dq" in text and "call 2" not in text


def test_main_writes_the_report_and_refuses_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base, current, out = tmp_path / "base.json", tmp_path / "current.json", tmp_path / "ab.md"
    base.write_text(json.dumps(run("aaa", point(4096, 1.0, 1.2, 4.2))))
    current.write_text(json.dumps(run("bbb", point(4096, 1.0, 1.2, 4.2))))
    assert ab.main(["--baseline", str(base), "--current", str(current), "--out-md", str(out)]) == 0
    assert "(1.000)" in row_of(out.read_text(), 4096)
    current.write_text("{not json")
    assert ab.main(["--baseline", str(base), "--current", str(current)]) == 1
    assert "harness_ab:" in capsys.readouterr().err


def test_several_runs_take_each_points_least_time() -> None:
    """Two runs of a side: each timing of a point is the least of the two (the noise of a lease only
    adds time); a point of one run counts; checks of both runs are reported."""
    first = run("aaa", point(4096, 1.0, 1.3, 4.0), point(1024, 0.5, 0.6, 2.0), failed=1)
    second = run("aaa", point(4096, 1.1, 1.2, 4.4))
    merged = ab.least_times([first, second])
    by_len = {p["seq_len"]: p for p in merged["points"]}
    assert (by_len[4096]["fwd_ms"], by_len[4096]["fwd_stats_ms"], by_len[4096]["fwd_bwd_ms"]) == (1.0, 1.2, 4.0)
    assert by_len[1024]["fwd_ms"] == 0.5 and merged["runs"] == 2 and len(merged["checks"]) == 6
    text = ab.compare(merged, run("bbb", point(4096, 1.0, 1.2, 4.0)))
    assert "2 run(s)" in text and "Checks failed in the baseline run (1 of 6):" in text
    # fwd 1.0 / 1.1 and fwd+stats+bwd 4.0 / 4.4 differ by 10% between the runs: marked, and the
    # backward alone with them; fwd+stats (1.3 / 1.2) too; the lone point of one run is not.
    cells = row_of(text, 4096).split(" | ")[7:]
    assert cells[0] == "1 → 1 (1.000) ~" and all(c.endswith("~") for c in cells[1:3])
    assert "~" not in row_of(text, 1024)


def test_runs_that_agree_are_not_marked() -> None:
    same = ab.least_times([run("aaa", point(4096, 1.0, 1.2, 4.0)), run("aaa", point(4096, 1.01, 1.2, 4.02))])
    assert "~" not in row_of(ab.compare(same, run("bbb", point(4096, 1.0, 1.2, 4.0))), 4096)


def test_steps_say_what_each_step_bought(tmp_path: Path) -> None:
    """With the commits between (--steps, runs told apart by commit): each step's geometric mean
    ratio to the commit before it per column, and each point's milliseconds along the chain; a
    point a step did not time stays out of that step's means. One run of every other commit: s1's
    second run does not count."""
    base = run("aaa", point(4096, 1.0, 1.2, 4.2), point(1024, 0.2, 0.25, 1.0))
    step_1 = run("s1", point(4096, 1.0, 1.1, 4.0), point(1024, 0.1, 0.25, 1.0))
    step_1_again = run("s1", point(4096, 0.5, 0.5, 2.0))
    step_2 = run("s2", point(4096, 1.0, 1.1, 3.0), failed=1)
    current = run("bbb", point(4096, 0.9, 1.1, 2.7), point(1024, 0.1, 0.25, 1.0))
    files = {}
    for name, data in (("base", base), ("s1", step_1), ("s1b", step_1_again), ("s2", step_2), ("cur", current)):
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(json.dumps(data))
    out = tmp_path / "ab.md"
    assert ab.main(["--baseline", str(files["base"]), "--current", str(files["cur"]), "--steps", str(files["s1"]),
                    str(files["s2"]), str(files["s1b"]), "--out-md", str(out)]) == 0
    text = out.read_text()
    assert "aaa → s1 → s2 → bbb" in text
    # fwd: aaa → s1 at 4096 (1.0) and 1024 (0.5): geometric mean 0.707; s1 → s2 at 4096 only (1.0);
    # bwd (fwd+stats+bwd less fwd+stats): (4.0 - 1.1) / 3.0 = 0.967 and 1; s2 → bbb 1.8 / 1.9.
    assert "| aaa → s1 | 0.707 | 0.957 | 0.983 | 0.976 | — | 0 |" in text
    assert "| s1 → s2 | 1.000 | 1.000 | 0.655 | 0.750 | — | 1 |" in text
    assert "| s2 → bbb | 0.900 | 1.000 | 0.842 | 0.900 | — | 0 |" in text
    bwd = text[text.index("### bwd"):text.index("### fwd+stats+bwd")]
    assert "| 3 | 2.9 (0.967) | 1.9 (0.655) | 1.6 (0.842) |" in row_of(bwd, 4096)
    assert "| 0.75 | 0.75 (1.000) | — (—) | 0.75 (—) |" in row_of(bwd, 1024)


def test_without_steps_the_report_has_no_steps_section(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base, current = tmp_path / "base.json", tmp_path / "current.json"
    base.write_text(json.dumps(run("aaa", point(4096, 1.0, 1.2, 4.2))))
    current.write_text(json.dumps(run("bbb", point(4096, 1.0, 1.2, 4.2))))
    assert ab.main(["--baseline", str(base), "--current", str(current), "--steps"]) == 0
    assert "What each step bought" not in capsys.readouterr().out


def test_the_chain_takes_as_many_runs_of_each_commit() -> None:
    """Two runs of the baseline and of the current kernels, one of a step, all the same kernels: the
    chain takes the first run of each, so that the least time over two runs does not make the step
    look slower than the baseline and the current kernels faster than the step."""
    first, second = point(4096, 1.04, 1.04, 4.16), point(4096, 1.0, 1.0, 4.0)
    chain = ab.chain_of([run("aaa", first), run("aaa", second)], [run("s1", first)],
                        [run("bbb", first), run("bbb", second)])
    assert [c["commit"] for c in chain] == ["aaa", "s1", "bbb"] and all(c["runs"] == 1 for c in chain)
    text = ab.steps(chain)
    assert "| aaa → s1 | 1.000 | 1.000 | 1.000 | 1.000 | — | 0 |" in text
    assert "| s1 → bbb | 1.000 | 1.000 | 1.000 | 1.000 | — | 0 |" in text
    # With two runs of the step too, each commit takes its least time over both.
    chain = ab.chain_of([run("aaa", first), run("aaa", second)], [run("s1", second), run("s1", first)],
                        [run("bbb", first), run("bbb", second)])
    assert all(c["runs"] == 2 and c["points"][0]["fwd_ms"] == 1.0 for c in chain)
