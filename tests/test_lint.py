"""The Python sources hold no dead or broken names: pyflakes' checks (ruff's F rules) over every
tracked Python file — unused imports and variables, undefined names, redefinitions, f-strings
without placeholders. Style (line length, names) is left to review."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def python_files() -> list[str]:
    """The tracked Python files (git ls-files), else every .py outside build outputs."""
    try:
        out = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
        files = out.stdout.split()
    except (OSError, subprocess.CalledProcessError):  # a source tree without git
        files = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if "build" not in p.parts]
    return sorted(files)


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is not installed (scripts/setup.sh pins it)")
def test_python_sources_pass_pyflakes_checks() -> None:
    """Fails naming each finding (file:line: code message)."""
    files = python_files()
    assert len(files) > 50, files  # the test must see the tree it guards
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--isolated", "--select", "F",
                          "--output-format", "concise", *files], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
