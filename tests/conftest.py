"""Shared pytest configuration: seeding, device parametrization, tolerances and helpers."""

from __future__ import annotations

import os
import random
import sys
from typing import Any, Dict, Iterator, List, Tuple

import pytest
import torch

# Make `import reference` work regardless of pytest's import mode.
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

HAS_CUDA: bool = torch.cuda.is_available()

#: Devices to parametrize device-aware tests over. CUDA is always listed so that a
#: missing GPU shows up as a visible skip rather than a silently absent test.
DEVICES: List[Any] = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")),
]

#: (atol, rtol) for the attention output (in the query's dtype) per input dtype.
OUT_TOL: Dict[torch.dtype, Tuple[float, float]] = {
    torch.float64: (1e-9, 1e-9),
    torch.float32: (5e-5, 5e-5),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (3e-3, 3e-3),
}
#: (atol, rtol) for the float32/float64 statistics per input dtype.
STAT_TOL: Dict[torch.dtype, Tuple[float, float]] = {
    torch.float64: (1e-9, 1e-9),
    torch.float32: (5e-5, 5e-5),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (3e-3, 3e-3),
}
#: relative-norm tolerance for gradients per input dtype.
GRAD_TOL: Dict[torch.dtype, float] = {
    torch.float64: 1e-8,
    torch.float32: 2e-4,
    torch.bfloat16: 4e-2,
    torch.float16: 6e-3,
}


def pytest_configure(config: pytest.Config) -> None:
    """Register custom markers."""
    config.addinivalue_line("markers", "cuda: test runs on a CUDA device")


@pytest.fixture(autouse=True)
def _seed() -> Iterator[None]:
    """Seed every RNG before each test so failures are reproducible."""
    random.seed(0)
    torch.manual_seed(0)
    yield


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """Device a comparison test runs on: 'cpu', plus 'cuda' (skipped without a GPU)."""
    return request.param


@pytest.fixture(scope="session")
def torch_ext_module() -> Any:
    """The imported extension package (fails loudly if it cannot be imported)."""
    import torch_ext

    return torch_ext


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype the spec prescribes for lse/entropy/... given the query dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def assert_close64(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, name: str = "") -> None:
    """Compare in float64 with NaN treated as a mismatch, reporting the worst entry."""
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    torch.testing.assert_close(a, e, atol=atol, rtol=rtol, equal_nan=False, msg=lambda m: f"{name}: {m}")


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / max(||expected||, 1e-12) in float64."""
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    return float((a - e).norm() / max(float(e.norm()), 1e-12))
