"""scripts/science_figures.py, as the README runs it, makes what results/science/ holds: the same
claims table (each claim's setting and verdict word for word, the measured numbers to the few
digits printed, within a tolerance for a CPU whose kernels round differently) and the four
figures."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "results" / "science"
NUMBER = re.compile(r"[-−]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def _rows(claims: str) -> list[list[str]]:
    """The table's rows (header and rule left out), as lists of cells."""
    lines = [line for line in claims.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines[1:]]


def _numbers(text: str) -> list[float]:
    return [float(x.replace("−", "-")) for x in NUMBER.findall(text)]


def test_script_reproduces_the_committed_claims(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "science_figures.py"), "--out", str(tmp_path)],
                   cwd=ROOT, check=True, timeout=600, capture_output=True, text=True)
    for figure in COMMITTED.glob("*.png"):
        assert (tmp_path / figure.name).stat().st_size > 0, figure.name
    made, committed = _rows((tmp_path / "claims.md").read_text()), _rows((COMMITTED / "claims.md").read_text())
    assert len(made) == len(committed) > 0
    for new, old in zip(made, committed):
        claim, seed, setting, measured, verdict = new
        assert [claim, seed, setting, verdict] == [old[0], old[1], old[2], old[4]], claim
        got, want = _numbers(measured), _numbers(old[3])
        assert len(got) == len(want), (claim, measured, old[3])
        for g, w in zip(got, want):
            assert math.isclose(g, w, rel_tol=0.02, abs_tol=2e-3), (claim, g, w)
