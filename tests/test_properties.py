"""Hypothesis property tests: random shapes / masks / scales vs the reference, plus invariants."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor

import torch_ext
from conftest import DEVICES, STAT_TOL, OUT_TOL, assert_close64
from reference import reference_attention

SETTINGS = settings(
    max_examples=40,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@dataclass
class Case:
    """One randomly drawn attention problem."""

    q: Tensor
    k: Tensor
    v: Tensor
    mask: Optional[Tensor]
    kwargs: Dict[str, Any]

    def __repr__(self) -> str:  # shown by hypothesis on failure
        m = None if self.mask is None else (tuple(self.mask.shape), self.mask.dtype)
        sc = self.kwargs.get("scale")
        sc = tuple(sc.shape) if isinstance(sc, Tensor) else sc
        kw = {**self.kwargs, "scale": sc}
        return f"Case(q={tuple(self.q.shape)}, k={tuple(self.k.shape)}, v={tuple(self.v.shape)}, mask={m}, {kw})"


@st.composite
def cases(
    draw: st.DrawFn, dtype: torch.dtype = torch.float64, max_len: int = 24, device: str = "cpu", hot: bool = True
) -> Case:
    """Draw shapes, a mask, causal flag, scale kind, temperature and train length.

    hot=False keeps logits moderate (for float32 tolerances)."""
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 2))
    H = Hkv * draw(st.integers(1, 3))
    Lq = draw(st.integers(1, max_len))
    Lk = draw(st.integers(0, max_len))
    D = draw(st.integers(1, 12))
    Dv = draw(st.integers(1, 12))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    mag = draw(st.sampled_from([0.5, 1.0, 3.0] if hot else [0.5, 1.0]))

    def rn(*shape: int) -> Tensor:
        return (mag * torch.randn(*shape, generator=g, dtype=torch.float64)).to(device=device, dtype=dtype)

    q, k, v = rn(B, H, Lq, D), rn(B, Hkv, Lk, D), rn(B, Hkv, Lk, Dv)
    mask_kind = draw(st.sampled_from(["none", "bool4d", "bool2d", "keypad", "float"]))
    density = draw(st.sampled_from([0.0, 0.2, 0.6, 0.95]))
    mask: Optional[Tensor]
    if mask_kind == "none":
        mask = None
    elif mask_kind == "bool4d":
        mask = torch.rand(B, H, Lq, Lk, generator=g) < density
    elif mask_kind == "bool2d":
        mask = torch.rand(Lq, Lk, generator=g) < density
    elif mask_kind == "keypad":
        mask = torch.rand(B, 1, 1, Lk, generator=g) < density
    else:
        mask = torch.randn(B, 1, Lq, Lk, generator=g, dtype=torch.float64)
        mask = mask.masked_fill(torch.rand(B, 1, Lq, Lk, generator=g) >= density, float("-inf"))
        mask = mask.to(dtype)
    if mask is not None:
        mask = mask.to(device)
    scale_kind = draw(st.sampled_from(["none", "float", "logn", "logn_sharpen", "t_H1", "t_BHLq", "t_1"]))
    scale: Any
    if scale_kind == "none":
        scale = None
    elif scale_kind == "float":
        scale = draw(st.floats(0.05, 2.0))
    elif scale_kind in ("logn", "logn_sharpen"):
        scale = scale_kind
    else:
        shape = {"t_H1": (H, 1), "t_BHLq": (B, H, Lq), "t_1": (1,)}[scale_kind]
        scale = (0.05 + torch.rand(shape, generator=g, dtype=torch.float64)).to(device=device)
        if dtype != torch.float64:
            scale = scale.float()
    kwargs: Dict[str, Any] = dict(
        is_causal=draw(st.booleans()),
        scale=scale,
        temperature=draw(st.sampled_from([1.0, 0.3, 2.5] if hot else [1.0, 2.5])),
        train_length=draw(st.sampled_from([2, 7, 512])),
        enable_gqa=H != Hkv,
    )
    return Case(q, k, v, mask, kwargs)


def check_invariants(stats: Any, atol: float) -> None:
    """Range invariants of the statistics (per row, using the op's own n_keys)."""
    n = stats.n_keys.double().cpu()
    has = n > 0
    H = stats.entropy.double().cpu()
    eff = stats.effective_keys.double().cpu()
    spars = stats.sparsity.double().cpu()
    pmax = stats.max_weight.double().cpu()
    nent = stats.normalized_entropy.double().cpu()
    for name, t in (("entropy", H), ("effective_keys", eff), ("sparsity", spars), ("max_weight", pmax)):
        assert torch.isfinite(t).all(), name
        assert (t[~has] == 0).all(), f"{name} nonzero on empty rows"
    if not has.any():
        return
    n1, H1, eff1, sp1, pm1, ne1 = n[has], H[has], eff[has], spars[has], pmax[has], nent[has]
    assert (H1 >= -atol).all() and (H1 <= torch.log(n1) + atol).all(), "entropy outside [0, ln n]"
    assert (eff1 >= 1 - atol * n1).all() and (eff1 <= n1 * (1 + atol)).all(), "effective_keys outside [1, n]"
    assert (sp1 > 0).all() and (sp1 <= 1 + atol).all(), "sparsity outside (0, 1]"
    assert (pm1 >= 1 / n1 - atol).all() and (pm1 <= 1 + atol).all(), "max_weight outside [1/n, 1]"
    assert (ne1 >= -atol).all() and (ne1 <= 1 + atol).all(), "normalized_entropy outside [0, 1]"
    # Renyi ordering: H_inf <= H_2 <= H_1  (-ln pmax <= ln n_eff <= H)
    assert (-torch.log(pm1) <= torch.log(eff1) + 10 * atol).all(), "min-entropy > collision entropy"
    assert (torch.log(eff1) <= H1 + 10 * atol).all(), "collision entropy > Shannon entropy"
    # sparsity and effective keys are tied: S = sqrt(n_eff / n)
    torch.testing.assert_close(sp1, torch.sqrt(eff1 / n1), atol=10 * atol, rtol=10 * atol)


def run_and_compare(case: Case, dtype: torch.dtype) -> None:
    """Run op and reference on a case and compare all outputs."""
    out, stats = torch_ext.attention(case.q, case.k, case.v, case.mask, return_stats=True, **case.kwargs)
    ref = reference_attention(case.q, case.k, case.v, case.mask, **case.kwargs)
    oat, ort = OUT_TOL[dtype]
    sat, srt = STAT_TOL[dtype]
    assert out.dtype == dtype
    assert_close64(out, ref.output, oat, ort, "output")
    assert torch.equal(stats.n_keys.cpu(), ref.n_keys.cpu()), "n_keys"
    for f in ("lse", "entropy", "max_weight", "normalized_entropy", "sparsity", "effective_keys"):
        assert_close64(getattr(stats, f), getattr(ref, f), sat, srt, f)
    has = (ref.n_keys > 0).cpu()
    assert_close64(stats.scale.cpu()[has], ref.row_scale.cpu()[has], sat, srt, "scale")
    assert not torch.isnan(out).any()
    check_invariants(stats, atol=1e-9 if dtype == torch.float64 else 1e-5)


@pytest.mark.parametrize("device", DEVICES)
@SETTINGS
@given(data=st.data())
def test_property_float64(device: str, data: st.DataObject) -> None:
    """float64: op == reference to ~1e-9 on random problems; statistics satisfy their ranges."""
    case = data.draw(cases(torch.float64, device=device))
    run_and_compare(case, torch.float64)


@pytest.mark.parametrize("device", DEVICES)
@settings(SETTINGS, max_examples=25)
@given(data=st.data())
def test_property_float32_longer(device: str, data: st.DataObject) -> None:
    """float32 with rows up to 80 keys (crossing typical block sizes)."""
    case = data.draw(cases(torch.float32, max_len=80, device=device, hot=False))
    run_and_compare(case, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@settings(SETTINGS, max_examples=25)
@given(data=st.data())
def test_property_gradients_finite(device: str, data: st.DataObject) -> None:
    """Gradients of output + entropy + lse are finite and match the reference (float64)."""
    case = data.draw(cases(torch.float64, max_len=12, device=device))
    q, k, v = (x.clone().requires_grad_() for x in (case.q, case.k, case.v))
    out, stats = torch_ext.attention(q, k, v, case.mask, return_stats=True, **case.kwargs)
    up = [torch.randn_like(out), torch.randn_like(stats.entropy), torch.randn_like(stats.lse)]
    loss = (out * up[0]).sum() + (stats.entropy * up[1]).sum() + (stats.lse * up[2]).sum()
    g = torch.autograd.grad(loss, [q, k, v], allow_unused=True)
    qr, kr, vr = (x.clone().requires_grad_() for x in (case.q, case.k, case.v))
    ref = reference_attention(qr, kr, vr, case.mask, **case.kwargs)
    lr = (ref.output * up[0]).sum() + (ref.entropy * up[1]).sum() + (ref.lse * up[2]).sum()
    gr = torch.autograd.grad(lr, [qr, kr, vr], allow_unused=True)
    for name, a, e, x in zip(["query", "key", "value"], g, gr, (q, k, v)):
        a = torch.zeros_like(x) if a is None else a
        e = torch.zeros_like(x) if e is None else e
        assert torch.isfinite(a).all(), name
        assert_close64(a, e, 1e-8, 1e-7, f"grad {name}")


def test_property_strategy_is_not_trivial() -> None:
    """Guard: the strategy does produce masked, empty-row and GQA cases (so properties exercise them)."""
    seen = {"empty_row": False, "gqa": False, "lk0": False, "logn": False}

    @settings(max_examples=60, deadline=None, database=None, derandomize=True)
    @given(case=cases())
    def probe(case: Case) -> None:
        ref = reference_attention(case.q, case.k, case.v, case.mask, **case.kwargs)
        seen["empty_row"] |= bool((ref.n_keys == 0).any()) and case.k.shape[2] > 0
        seen["gqa"] |= case.kwargs["enable_gqa"]
        seen["lk0"] |= case.k.shape[2] == 0
        seen["logn"] |= case.kwargs["scale"] == "logn" if isinstance(case.kwargs["scale"], str) else False

    probe()
    assert all(seen.values()), seen
