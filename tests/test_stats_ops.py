"""torch_ext.entropy / torch_ext.sparsity vs plain formulas, and gradcheck."""

from __future__ import annotations

import math
from typing import Tuple

import pytest
import torch
from torch import Tensor
from torch.autograd import gradcheck

import torch_ext
from conftest import nondet_tol
from reference import reference_entropy, reference_sparsity

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}

SHAPE_DIMS = [((7,), -1), ((7,), 0), ((4, 9), -1), ((4, 9), 0), ((3, 5, 6), 1), ((3, 5, 6), -2), ((3, 5, 6), 2), ((2, 1, 33), -1)]


def reduced_shape(shape: Tuple[int, ...], dim: int) -> Tuple[int, ...]:
    """Shape after reducing `dim` without keepdim."""
    d = dim % len(shape)
    return tuple(s for i, s in enumerate(shape) if i != d)


def check(actual: Tensor, expected: Tensor, dtype: torch.dtype, name: str) -> None:
    """Compare in float64 with a dtype tolerance; NaN is a failure."""
    assert actual.is_floating_point(), f"{name}: dtype {actual.dtype}"
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    t = TOL[dtype]
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), atol=t, rtol=t, msg=lambda m: f"{name}: {m}")


# ----------------------------------------------------------------------------------------
# entropy
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,dim", SHAPE_DIMS)
def test_entropy_matches_formula(device: str, dtype: torch.dtype, shape: Tuple[int, ...], dim: int) -> None:
    """entropy(p, dim) = -sum p ln p for probability vectors (softmax along dim)."""
    p = torch.softmax(2 * torch.randn(shape, dtype=torch.float64), dim=dim).to(device=device, dtype=dtype)
    h = torch_ext.entropy(p, dim=dim)
    assert h.shape == reduced_shape(shape, dim)
    check(h, reference_entropy(p, dim), dtype, "entropy")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_entropy_with_zeros(device: str, dtype: torch.dtype) -> None:
    """0 ln 0 = 0: zeros contribute nothing and produce no NaN; one-hot rows have entropy 0."""
    p = torch.softmax(torch.randn(6, 10, dtype=torch.float64), -1)
    p[:, ::3] = 0
    p[2] = 0
    p[2, 4] = 1.0  # one-hot
    p[3] = 0  # all-zero row
    p = p.to(device=device, dtype=dtype)
    h = torch_ext.entropy(p)
    assert not torch.isnan(h).any()
    check(h, reference_entropy(p), dtype, "entropy")
    assert h[2].item() == 0.0 and h[3].item() == 0.0


def test_entropy_known_values(device: str) -> None:
    """Uniform over n gives ln n; unnormalized input follows -sum p ln p literally."""
    for n in (1, 2, 7, 64):
        u = torch.full((n,), 1.0 / n, dtype=torch.float64, device=device)
        assert abs(torch_ext.entropy(u).item() - math.log(n)) < 1e-12
    x = torch.tensor([2.0, 0.5, 0.0], dtype=torch.float64, device=device)
    expected = -(2.0 * math.log(2.0) + 0.5 * math.log(0.5))
    assert abs(torch_ext.entropy(x).item() - expected) < 1e-12


def test_entropy_noncontiguous(device: str) -> None:
    """Non-contiguous (transposed, sliced) inputs give the same results as contiguous ones."""
    base = torch.softmax(torch.randn(8, 12, dtype=torch.float64), 0).to(device)
    pt = base.t()  # rows of pt are columns of base: each sums to 1
    assert not pt.is_contiguous()
    check(torch_ext.entropy(pt, -1), reference_entropy(pt, -1), torch.float64, "entropy(transposed)")
    ps = base[:, ::2]
    check(torch_ext.entropy(ps, 0), reference_entropy(ps, 0), torch.float64, "entropy(sliced)")


def test_entropy_gradcheck(device: str) -> None:
    """gradcheck entropy on strictly positive inputs (float64) along several dims."""
    p = (0.05 + torch.rand(3, 4, 5, dtype=torch.float64, device=device)).requires_grad_()
    for dim in (-1, 0, 1):
        assert gradcheck(
            lambda x: torch_ext.entropy(x, dim=dim), (p,), eps=1e-6, atol=1e-7, rtol=1e-5, nondet_tol=nondet_tol(device)
        )


def test_entropy_grad_matches_formula(device: str) -> None:
    """d/dp (-sum p ln p) = -(ln p + 1) (float32 too)."""
    p = (0.05 + torch.rand(4, 7, device=device)).requires_grad_()
    g = torch.randn(4, device=device)
    (grad,) = torch.autograd.grad((torch_ext.entropy(p) * g).sum(), [p])
    expected = -(torch.log(p.detach()) + 1) * g[:, None]
    torch.testing.assert_close(grad, expected, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------
# sparsity
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,dim", SHAPE_DIMS)
def test_sparsity_matches_formula(device: str, dtype: torch.dtype, shape: Tuple[int, ...], dim: int) -> None:
    """sparsity(a, dim) = mean|a| / sqrt(mean a^2) on signed inputs."""
    a = torch.randn(shape, dtype=torch.float64).to(device=device, dtype=dtype)
    s = torch_ext.sparsity(a, dim=dim)
    assert s.shape == reduced_shape(shape, dim)
    check(s, reference_sparsity(a, dim), dtype, "sparsity")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sparsity_special_rows(device: str, dtype: torch.dtype) -> None:
    """All-zero row -> 0; constant row -> 1; one-hot of length n -> 1/sqrt(n); zeros in a signed row."""
    a = torch.randn(5, 16, dtype=torch.float64)
    a[0] = 0
    a[1] = -3.0
    a[2] = 0
    a[2, 7] = 2.5
    a[3, ::2] = 0
    a = a.to(device=device, dtype=dtype)
    s = torch_ext.sparsity(a)
    assert not torch.isnan(s).any()
    check(s, reference_sparsity(a), dtype, "sparsity")
    t = TOL[dtype]
    assert s[0].item() == 0.0
    assert abs(s[1].item() - 1.0) < t
    assert abs(s[2].item() - 0.25) < t


def test_sparsity_scale_invariant(device: str) -> None:
    """S(c a) = S(a) for c != 0 (incl. negative c), and S lies in (0, 1]."""
    a = torch.randn(6, 20, dtype=torch.float64, device=device)
    s = torch_ext.sparsity(a)
    for c in (-3.0, 0.01, 1e3):
        torch.testing.assert_close(torch_ext.sparsity(c * a), s, atol=1e-12, rtol=1e-12)
    assert (s > 0).all() and (s <= 1 + 1e-12).all()


@pytest.mark.parametrize("dtype,magnitudes", [(torch.float32, (1e-30, 1e-21, 1e20, 1e30)), (torch.float64, (1e-300, 1e-170, 1e160, 1e300))], ids=str)
def test_sparsity_extreme_magnitudes(device: str, dtype: torch.dtype, magnitudes: Tuple[float, ...]) -> None:
    """S is scale-free: rows of tiny or huge entries (whose sum of squares under- or overflows the
    dtype) give S of the same row at unit scale, and the gradient scales as 1/c (it was 0, 1e-21
    gave 0.9997 in float32, and huge rows 0)."""
    base = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0], [0.5, -2.0, 1.0, 0.25]], dtype=torch.float64)
    want = reference_sparsity(base, -1)
    g = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    leaf = base.clone().requires_grad_()
    (want_grad,) = torch.autograd.grad((reference_sparsity(leaf, -1) * g).sum(), [leaf])
    for c in magnitudes:
        a = (c * base).to(dtype).to(device).requires_grad_()
        s = torch_ext.sparsity(a)
        torch.testing.assert_close(s.double().cpu(), want, atol=1e-6, rtol=1e-6, msg=lambda m: f"c = {c}: {m}")
        (grad,) = torch.autograd.grad((s * g.to(dtype).to(device)).sum(), [a])
        torch.testing.assert_close((grad.double().cpu() * c), want_grad, atol=1e-5, rtol=1e-5, msg=lambda m: f"grad, c = {c}: {m}")


def test_sparsity_noncontiguous(device: str) -> None:
    """Transposed input along both dims."""
    a = torch.randn(9, 13, dtype=torch.float64, device=device).t()
    check(torch_ext.sparsity(a, -1), reference_sparsity(a, -1), torch.float64, "sparsity(transposed)")
    check(torch_ext.sparsity(a, 0), reference_sparsity(a, 0), torch.float64, "sparsity(transposed, dim 0)")


def test_sparsity_gradcheck(device: str) -> None:
    """gradcheck sparsity on signed inputs bounded away from 0 (|a| is not differentiable at 0)."""
    x = torch.rand(3, 4, 6, dtype=torch.float64, device=device) + 0.1
    sign = torch.where(torch.rand(3, 4, 6, device=device) < 0.5, -1.0, 1.0).double()
    a = (x * sign).requires_grad_()
    for dim in (-1, 0, 1):
        assert gradcheck(
            lambda t: torch_ext.sparsity(t, dim=dim), (a,), eps=1e-6, atol=1e-7, rtol=1e-5, nondet_tol=nondet_tol(device)
        )


def test_sparsity_grad_matches_reference(device: str) -> None:
    """float32 gradient of sparsity equals autograd through the formula."""
    a = (torch.rand(5, 11, device=device) + 0.1) * torch.where(torch.rand(5, 11, device=device) < 0.5, -1.0, 1.0)
    a.requires_grad_()
    g = torch.randn(5, device=device)
    (grad,) = torch.autograd.grad((torch_ext.sparsity(a) * g).sum(), [a])
    a64 = a.detach().double().requires_grad_()
    (grad64,) = torch.autograd.grad((reference_sparsity(a64) * g.double()).sum(), [a64])
    torch.testing.assert_close(grad.double(), grad64, atol=1e-5, rtol=1e-4)


def test_stats_ops_match_raw_ops(device: str) -> None:
    """The Python functions agree with torch.ops.entropy_attn.* ."""
    p = torch.softmax(torch.randn(3, 8, device=device), -1)
    torch.testing.assert_close(torch_ext.entropy(p, dim=0), torch.ops.entropy_attn.entropy(p, 0))
    torch.testing.assert_close(torch_ext.sparsity(p - 0.1), torch.ops.entropy_attn.sparsity(p - 0.1, -1))


def test_long_rows_and_empty_rows(device: str) -> None:
    """float32 rows of 2^20 entries sum in double (a running float32 sum put a uniform row's entropy
    0.6% above its maximum ln n on the CPU, a lane's sum of 2^15 terms 0.03% on CUDA), and an empty
    row's sparsity has a zero gradient (its backward reduced over the empty dim and raised)."""
    n = 2**20
    p = torch.full((1, n), 1.0 / n, device=device)
    torch.testing.assert_close(torch_ext.entropy(p).cpu(), torch.tensor([math.log(n)]), rtol=1e-6, atol=0)
    a = torch.rand(1, n, generator=torch.Generator().manual_seed(0)).to(device)
    exact = a.double().sum() / math.sqrt(n * a.double().square().sum())
    torch.testing.assert_close(torch_ext.sparsity(a).double(), exact.view(1), rtol=1e-6, atol=0)
    empty = torch.zeros(3, 0, device=device, requires_grad=True)
    (g,) = torch.autograd.grad(torch_ext.sparsity(empty).sum(), empty)
    assert g.shape == (3, 0)
