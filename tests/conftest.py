"""Shared pytest configuration: seeding, device parametrization, tolerances and helpers."""

from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Dict, Iterator, List, Tuple

import pytest
import torch

# Make `import reference` work regardless of pytest's import mode.
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

HAS_CUDA: bool = torch.cuda.is_available()

#: Skip marker for tests that need a GPU: the reason is what scripts/gpu_suite.sh looks for to
#: make sure that no CUDA test was skipped on a GPU machine.
NO_CUDA_REASON = "no CUDA device"
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA_REASON)

#: Set ENTROPY_ATTN_REQUIRE_CUDA=1 (scripts/gpu_suite.sh does) to make a missing GPU an error
#: instead of a skip.
REQUIRE_CUDA: bool = os.environ.get("ENTROPY_ATTN_REQUIRE_CUDA", "0") not in ("", "0")

#: Devices to parametrize device-aware tests over. CUDA is always listed so that a
#: missing GPU shows up as a visible skip rather than a silently absent test.
DEVICES: List[Any] = [
    "cpu",
    pytest.param("cuda", marks=[requires_cuda, pytest.mark.cuda]),
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


#: ``nondet_tol`` for ``torch.autograd.gradcheck`` per device type. A CUDA backward may accumulate
#: dQ/dK/dV with atomics, whose summation order (hence the last bits) changes between two calls;
#: gradcheck's reentrancy check would then fail with a tolerance of 0. 1e-10 is far below the
#: float64 gradcheck tolerances (atol 1e-7) and far above float64 rounding noise.
GRADCHECK_NONDET_TOL: Dict[str, float] = {"cpu": 0.0, "cuda": 1e-10}


def pytest_report_header(config: pytest.Config) -> str:
    """Which CUDA kernel family the run asks for (csrc/cuda/family.h)."""
    return f"ENTROPY_ATTN_CUDA_FAMILY={os.environ.get('ENTROPY_ATTN_CUDA_FAMILY', 'auto')}"


def shard_spec() -> Tuple[int, int]:
    """(k, n) from ENTROPY_ATTN_TEST_SHARD="k/n" (0 <= k < n): this process runs every n-th test
    from the k-th on, so that n processes side by side run the suite once (scripts/gpu_suite.sh
    does, on a GPU machine whose many cores one pytest process leaves idle). (0, 1) when unset."""
    spec = os.environ.get("ENTROPY_ATTN_TEST_SHARD", "")
    if not spec:
        return 0, 1
    try:
        k, n = (int(x) for x in spec.split("/"))
    except ValueError:
        k, n = -1, 0
    if not 0 <= k < n:
        raise pytest.UsageError(f"ENTROPY_ATTN_TEST_SHARD must be k/n with 0 <= k < n, got {spec!r}")
    return k, n


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    """Keep this process's shard of the collected tests (ENTROPY_ATTN_TEST_SHARD); the others are
    deselected, so the shards' tallies add up to the whole run."""
    k, n = shard_spec()
    if n == 1:
        return
    keep = [item for i, item in enumerate(items) if i % n == k]
    config.hook.pytest_deselected(items=[item for i, item in enumerate(items) if i % n != k])
    items[:] = keep


def pytest_configure(config: pytest.Config) -> None:
    """Register custom markers; refuse to run without a GPU when one is required."""
    config.addinivalue_line("markers", "cuda: test runs on a CUDA device")
    config.addinivalue_line(
        "markers",
        "hopper_turns: runs the Hopper backward's deterministic dq (in turns: a wrong turn would spin), "
        "which scripts/gpu_session.sh runs in a bounded pass of its own",
    )
    config.addinivalue_line(
        "markers",
        "hopper_256: can run the Hopper kernels at head dim 256 (written without a GPU, compiled on "
        "request), which scripts/gpu_session.sh runs in that bounded pass too",
    )
    if REQUIRE_CUDA and not HAS_CUDA:
        raise pytest.UsageError(
            "ENTROPY_ATTN_REQUIRE_CUDA is set but torch.cuda.is_available() is False: "
            "the CUDA tests would all be skipped"
        )


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


def nondet_tol(device: Any) -> float:
    """gradcheck's ``nondet_tol`` for a device (0 on CPU, whose backward is deterministic)."""
    return GRADCHECK_NONDET_TOL[torch.device(device).type]


def to_device(obj: Any, device: Any) -> Any:
    """Copy every tensor in a (nested) tuple/list/dict to `device`, keeping dtype and requires_grad.

    Tensors that required grad come back as new leaves that require grad; other objects are kept.
    """
    if isinstance(obj, torch.Tensor):
        out = obj.detach().to(device)
        return out.requires_grad_(obj.requires_grad)
    if isinstance(obj, tuple):
        return tuple(to_device(x, device) for x in obj)
    if isinstance(obj, list):
        return [to_device(x, device) for x in obj]
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


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


def check_quick_table(script: Path, prefixes: Tuple[str, ...], rows: int) -> None:
    """A benchmark script's ``--quick`` run exits 0 and prints a Markdown table of ``rows`` rows
    (those starting with one of ``prefixes``), each ending with a ratio ("x |")."""
    out = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True, text=True, check=True,
                         timeout=300).stdout
    table = [line for line in out.splitlines() if line.startswith(prefixes)]
    assert len(table) == rows and all(line.rstrip().endswith("x |") for line in table), out


def load_script(path: Path, name: str) -> ModuleType:
    """A script of the repository (benchmarks/, examples/: not packages) imported as module `name`,
    registered in sys.modules (its dataclasses look their module up by name)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
