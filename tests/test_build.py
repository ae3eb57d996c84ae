"""How the extension was built, where a wrong flag fails silently rather than loudly."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import torch_ext


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="checks a GNU OpenMP (libgomp) build")
def test_cpu_kernels_compiled_with_openmp() -> None:
    """at::parallel_for is a header template whose `#pragma omp parallel` is compiled into our
    library: built without -fopenmp, every CPU kernel runs on one thread and every result is still
    right. With it, the library calls libgomp's GOMP_parallel."""
    library = Path(torch_ext._C.__file__).read_bytes()
    assert b"GOMP_parallel" in library, "torch_ext._C was built without OpenMP: CPU kernels run on one thread"
