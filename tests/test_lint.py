"""Lint gates. The Python sources hold no dead or broken names: pyflakes' checks (ruff's F rules)
over every tracked Python file — unused imports and variables, undefined names, redefinitions,
f-strings without placeholders; Python style (line length, names) is left to review. The C++ and
CUDA sources are formatted as clang-format (the version scripts/setup.sh pins, with .clang-format)
formats them, except the generated kernel instantiations (.clang-format-ignore)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


#: The clang-format release the C++ sources are formatted with (another formats some lines
#: differently); scripts/setup.sh installs it.
CLANG_FORMAT_VERSION = "23.1.3"


def tracked_files(*patterns: str) -> list[str]:
    """The tracked files matching ``patterns`` (git ls-files), else every such file outside build
    outputs."""
    try:
        out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True)
        files = out.stdout.split()
    except (OSError, subprocess.CalledProcessError):  # a source tree without git
        files = [str(p.relative_to(ROOT)) for pattern in patterns for p in ROOT.rglob(pattern)
                 if "build" not in p.parts]
    return sorted(files)


def python_files() -> list[str]:
    """The tracked Python files."""
    return tracked_files("*.py")


def clang_format() -> str | None:
    """The pinned clang-format (the pip package's binary, else one on PATH of that version)."""
    candidates = []
    if importlib.util.find_spec("clang_format") is not None:
        import clang_format as package

        candidates.append(package.get_executable("clang-format"))
    candidates.append(shutil.which("clang-format"))
    for exe in filter(None, candidates):
        version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
        if f"version {CLANG_FORMAT_VERSION}" in version:
            return exe
    return None


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is not installed (scripts/setup.sh pins it)")
def test_python_sources_pass_pyflakes_checks() -> None:
    """Fails naming each finding (file:line: code message)."""
    files = python_files()
    assert len(files) > 50, files  # the test must see the tree it guards
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--isolated", "--select", "F",
                          "--output-format", "concise", *files], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.skipif(clang_format() is None, reason=f"clang-format {CLANG_FORMAT_VERSION} is not installed "
                    "(scripts/setup.sh pins it)")
def test_cpp_sources_are_clang_formatted() -> None:
    """Fails naming each file and line clang-format would change (format a file with
    ``clang-format -i <file>`` from the repository root)."""
    files = tracked_files("*.cpp", "*.h", "*.cu", "*.cuh")
    assert len(files) > 50, files  # the test must see the tree it guards
    run = subprocess.run([clang_format(), "--dry-run", "--Werror", "--style=file", *files], cwd=ROOT,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-20000:]
