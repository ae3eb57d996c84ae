"""Ahead-of-time compilation: a model calling the ops, exported (torch.export) with a dynamic
length and compiled by AOTInductor into a `.pt2` package, loads and runs without retracing, with
the outputs and statistics of eager calls at lengths other than the traced one. The package calls
the ops by name, so the process that runs it must have loaded them (`import torch_ext` in Python;
linking the C++ library in LibTorch: tests/cpp/test_aoti.cpp runs the package that
tests/cpp/make_aoti_package.py writes)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import torch_ext

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "cpp"))
from make_aoti_package import Statistics, inputs, package  # noqa: E402  (what the C++ test runs)
# (Inductor generates Triton kernels for CUDA packages.)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("triton") is None, reason="needs CUDA and Triton"))]


def _load(path: str | Path) -> object:
    """The package's runner, once its model library is known to be safe to load in this process.

    A g++ that finds libstdc++.a before libstdc++.so (one GPU machine's relocated toolchain, which
    setup.py's shared_libstdcxx_flags keeps out of our own library) links a private copy of
    libstdc++ into the model library Inductor compiles. That copy runs on the data of the process's
    libstdc++.so.6, and loading the package segfaulted there (in std::regex, parsing the model's
    device string, for any CUDA package): a fault of that toolchain, not of the ops. Such a package
    is recognized by its wrapper library not linking libstdc++.so.6, and the test skips visibly."""
    with zipfile.ZipFile(path) as archive:
        wrappers = [archive.read(n) for n in archive.namelist() if n.endswith("wrapper.so")]
    if any(b"libstdc++.so.6" not in library for library in wrappers):
        pytest.skip("Inductor's C++ compiler linked a static copy of libstdc++ into the package's model "
                    "library (a toolchain that finds libstdc++.a first): loading it would crash this process")
    return torch._inductor.aoti_load_package(str(path))


def _compile(model: torch.nn.Module, example: tuple, dynamic: tuple, path: Path) -> str:
    exported = torch.export.export(model, example, dynamic_shapes=dynamic)
    return torch._inductor.aoti_compile_and_package(exported, package_path=str(path))


@pytest.mark.parametrize("device", DEVICES)
def test_multihead_attention_package_matches_eager(device: str, tmp_path: Path) -> None:
    """torch_ext.nn.MultiheadAttention (causal, log-n scale: lambda_i from each row's n_i inside
    the op) in a package compiled for one length runs at others, as eager does (float32)."""
    torch.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = torch_ext.nn.MultiheadAttention(32, 4, batch_first=True, scale="logn", train_length=8)
            self.ff = torch.nn.Linear(32, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y, _ = self.attn(x, x, x, need_weights=False, is_causal=True)
            return self.ff(y)

    model = Block().to(device).eval()
    length = torch.export.Dim("L", min=2, max=4096)
    path = _compile(model, (torch.randn(2, 10, 32, device=device),), ({1: length},), tmp_path / "block.pt2")
    runner = _load(path)
    with torch.no_grad():
        for L in (10, 37, 3):
            x = torch.randn(2, L, 32, device=device)
            torch.testing.assert_close(runner(x), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_statistics_package_matches_eager(device: str, tmp_path: Path) -> None:
    """The op's outputs and statistics through a package (GQA, causal, log-n), float64, at lengths
    of queries and keys other than the traced ones, equal the op's."""
    runner = _load(package(str(tmp_path / "stats.pt2"), device))
    for shape in ((9, 12), (5, 40), (33, 7)):
        args = inputs(*shape, device=device, seed=1)
        got, want = runner(*args), Statistics()(*args)
        assert len(got) == len(want) == 4
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_dropout_package_draws_a_fresh_mask_per_call(tmp_path: Path) -> None:
    """A package of a call with attention dropout draws each call's seed as the exported program
    does: a fresh mask per call, the same one after the same torch.manual_seed, each a mask of the
    weights (kept rows averaging the undropped output). It failed when run: the draw passed
    `generator=None`, which AOTInductor compiles to a call of randint's generator overload that
    raises."""

    class Drop(torch.nn.Module):
        def forward(self, q: torch.Tensor) -> torch.Tensor:
            return torch_ext.attention(q, q, q, dropout_p=0.5)

    q = torch.randn(2, 2, 16, 8, generator=torch.Generator().manual_seed(0))
    runner = _load(_compile(Drop(), (q,), None, tmp_path / "drop.pt2"))
    torch.manual_seed(3)
    first = runner(q)
    torch.manual_seed(3)
    assert torch.equal(runner(q), first)
    draws = torch.stack([first] + [runner(q) for _ in range(199)])
    assert not torch.equal(draws[1], first)
    # The mean of 200 draws is within 5.5 standard errors of the undropped output at every element
    # (eager draws reach about 3-4).
    z = (draws.mean(0) - torch_ext.attention(q, q, q)).abs() / (draws.std(0) / len(draws) ** 0.5)
    assert z.max() < 5.5, z.max()


def test_package_generator_for_the_cpp_test(tmp_path: Path) -> None:
    """tests/cpp/make_aoti_package.py (CTest's fixture for test_aoti.cpp) writes a package that
    loads here and runs Statistics at a new length."""
    path = tmp_path / "model.pt2"
    # (This checkout's torch_ext, as CTest runs it: the source tree first on the path.)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(HERE.parent), os.environ.get("PYTHONPATH"))))}
    subprocess.run([sys.executable, str(HERE / "cpp" / "make_aoti_package.py"), str(path)], check=True, env=env)
    runner = _load(str(path))
    q, k, v = inputs(6, 21, seed=2)
    for a, b in zip(runner(q, k, v), Statistics()(q, k, v)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_packed_documents_package_matches_eager(tmp_path: Path) -> None:
    """varlen_attention in a package: the token count, the number of documents and the longest
    document (given by a tensor's length, as max_q/max_k must be sizes to stay symbolic) are
    dynamic, so packings other than the traced one run, n_i restarting with each document."""

    class Packed(torch.nn.Module):
        def forward(self, q: torch.Tensor, cu: torch.Tensor, longest: torch.Tensor) -> torch.Tensor:
            n = longest.shape[0]
            return torch_ext.varlen_attention(q, q, q, cu, cu, n, n, is_causal=True, scale="logn", train_length=8)

    def packing(bounds: list) -> tuple:
        cu = torch.tensor(bounds, dtype=torch.int32)
        q = torch.randn(bounds[-1], 2, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(len(bounds)))
        return q, cu, torch.empty(int((cu[1:] - cu[:-1]).max()))

    dims = ({0: torch.export.Dim("T", min=2, max=4096)}, {0: torch.export.Dim("N", min=2, max=64)},
            {0: torch.export.Dim("longest", min=2, max=4096)})
    path = _compile(Packed(), packing([0, 5, 12, 15]), dims, tmp_path / "packed.pt2")
    runner = _load(path)
    for bounds in ([0, 5, 12, 15], [0, 3, 4, 20, 30], [0, 9]):
        args = packing(bounds)
        torch.testing.assert_close(runner(*args), Packed()(*args), rtol=1e-12, atol=1e-12)
