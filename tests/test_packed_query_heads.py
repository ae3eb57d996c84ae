"""Decoding with grouped-query attention: a call with one query row per head, whose row sees every
key, runs with the query heads of each group packed as the rows of one head
(csrc/attention_call.cpp: pack_query_heads). The packed call must give every output, statistic and
gradient of the unpacked one, in the call's own shapes; calls it does not apply to (a window, top-left
causality, sinks, dropout, more than one row) must stay exact. Against the float64 reference and
against the same call with the key/value heads repeated (H == Hkv: never packed)."""

from __future__ import annotations

from typing import Any, Dict, Optional

import pytest
import torch
from torch import Tensor

import torch_ext  # noqa: F401  (registers the ops)
from conftest import GRAD_TOL, OUT_TOL, STAT_TOL, assert_close64, rel_err
from reference import reference_attention_raw

OP = torch.ops.entropy_attn.attention
B, H, HKV, LK, D = 2, 8, 2, 37, 16

#: Calls that pack: (keyword arguments, mask kind, scale tensor).
PACKED: Dict[str, Dict[str, Any]] = {
    "plain": {},
    "bottom_right_causal": {"is_causal": True, "causal_alignment": "bottom_right"},
    "bottom_right_right_bound": {"window_size": [-1, 3], "causal_alignment": "bottom_right"},
    "logn_temperature": {"scale_mode": "logn", "temperature": 0.7},
    "softcap_no_stats": {"softcap": 5.0, "return_stats": False},
    "bool_mask_per_batch": {"mask": "bool_batch"},
    "additive_mask_per_head": {"mask": "additive_head"},
    "scale_tensor_per_head": {"scale": "per_head"},
}
#: Calls with one row and GQA that must not pack (the row's keys depend on its position, or the
#: sinks and the dropout mask are per query head).
UNPACKED: Dict[str, Dict[str, Any]] = {
    "top_left_causal": {"is_causal": True},
    "bottom_right_window": {"is_causal": True, "causal_alignment": "bottom_right", "window_size": [5, 0]},
    "top_left_window": {"window_size": [-1, 4]},
    "sinks": {"sinks": True},
    "dropout": {"dropout_p": 0.3, "dropout_seed": 5},
}


def make_call(spec: Dict[str, Any], dtype: torch.dtype, lq: int = 1) -> Dict[str, Any]:
    """The op's arguments for a spec: q, k, v, mask, scale and keyword arguments."""
    g = torch.Generator().manual_seed(11)
    q = torch.randn(B, H, lq, D, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(B, HKV, LK, D, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(B, HKV, LK, D, generator=g, dtype=torch.float64).to(dtype)
    kw = {k_: v_ for k_, v_ in spec.items() if k_ not in ("mask", "scale", "sinks")}
    mask: Optional[Tensor] = None
    if spec.get("mask") == "bool_batch":
        mask = torch.rand(B, 1, 1, LK, generator=g) < 0.7
        mask[..., 0] = True
    elif spec.get("mask") == "additive_head":
        mask = torch.randn(1, H, lq, LK, generator=g, dtype=torch.float64).to(dtype)
    scale = torch.rand(B, H, lq, generator=g, dtype=torch.float64) + 0.5 if spec.get("scale") else None
    if spec.get("sinks"):
        kw["sinks"] = torch.randn(H, generator=g)
    return {"q": q, "k": k, "v": v, "mask": mask, "scale": scale, "kw": kw}


def run(c: Dict[str, Any], q: Tensor, k: Tensor, v: Tensor, gqa: bool = True) -> tuple:
    return OP(q, k, v, c["mask"], c["scale"], enable_gqa=gqa, **c["kw"])


def repeated(t: Tensor) -> Tensor:
    """Key/value heads repeated to the query heads (the call without GQA, never packed)."""
    return t.repeat_interleave(H // HKV, dim=1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(PACKED) + list(UNPACKED))
def test_outputs_match_reference_and_unpacked(case: str, dtype: torch.dtype) -> None:
    spec = {**PACKED, **UNPACKED}[case]
    c = make_call(spec, dtype)
    out = run(c, c["q"], c["k"], c["v"])
    same = run(c, c["q"], repeated(c["k"]), repeated(c["v"]), gqa=False)
    kw = {k_: v_ for k_, v_ in c["kw"].items() if k_ != "return_stats"}
    ref = reference_attention_raw(c["q"], c["k"], c["v"], c["mask"], c["scale"], enable_gqa=True, **kw)
    stats = c["kw"].get("return_stats", True)
    oat, ort = OUT_TOL[dtype]
    sat, srt = STAT_TOL[dtype]
    for i, name in enumerate(ref._fields[:11]):
        if not stats and name in ("entropy", "sum_p2", "max_weight", "normalized_entropy", "sparsity",
                                  "effective_keys"):
            assert out[i].numel() == 0, name
            continue
        assert out[i].shape == same[i].shape and out[i].is_contiguous(), name
        if name == "n_keys":
            assert torch.equal(out[i], ref.n_keys) and torch.equal(out[i], same[i]), name
            continue
        at, rt = (oat, ort) if name == "output" else (sat, srt)
        assert_close64(out[i], getattr(ref, name), at, rt, f"{name} vs reference")
        assert_close64(out[i], same[i], at, rt, f"{name} vs the call without GQA")


@pytest.mark.parametrize("case", ["plain", "bottom_right_causal", "additive_mask_per_head", "scale_tensor_per_head"])
def test_gradients_match_reference(case: str) -> None:
    c = make_call(PACKED[case], torch.float64)
    q, k, v = (t.clone().requires_grad_() for t in (c["q"], c["k"], c["v"]))
    out = run(c, q, k, v)
    upstream = [torch.randn_like(out[i]) for i in (0, 1, 2, 3)]
    got = torch.autograd.grad([out[i] for i in (0, 1, 2, 3)], (q, k, v), upstream)
    rq, rk, rv = (t.clone().requires_grad_() for t in (c["q"], c["k"], c["v"]))
    ref = reference_attention_raw(rq, rk, rv, c["mask"], c["scale"], enable_gqa=True, **c["kw"])
    want = torch.autograd.grad([ref.output, ref.lse, ref.entropy, ref.sum_p2], (rq, rk, rv), upstream)
    for a, e, name in zip(got, want, ("dq", "dk", "dv")):
        assert rel_err(a, e) < GRAD_TOL[torch.float64], name


def test_strided_query_views() -> None:
    """A query seen through the (B, L, H, D) layout of the models (transposed, row stride H * D) and
    a head-sliced one pack as views of their own memory."""
    c = make_call({}, torch.float32)
    g = torch.Generator().manual_seed(3)
    blhd = torch.randn(B, 1, 2 * H, D, generator=g)[:, :, ::2].transpose(1, 2)  # (B, H, 1, D), strided
    out = run(c, blhd, c["k"], c["v"])[0]
    ref = reference_attention_raw(blhd, c["k"], c["v"], enable_gqa=True).output
    assert_close64(out, ref, *OUT_TOL[torch.float32], "output")


def test_opcheck_packed_call() -> None:
    c = make_call(PACKED["additive_mask_per_head"], torch.float64)
    q, k, v = (t.clone().requires_grad_() for t in (c["q"], c["k"], c["v"]))
    torch.library.opcheck(OP, (q, k, v, c["mask"], c["scale"]), {"enable_gqa": True, **c["kw"]})


def test_empty_batch_and_keys() -> None:
    """Zero batch entries and zero keys keep the unpacked shapes (rows without keys are zeros)."""
    for b, lk in ((0, 5), (2, 0)):
        q, k, v = torch.randn(b, H, 1, D), torch.randn(b, HKV, lk, D), torch.randn(b, HKV, lk, D)
        out = OP(q, k, v, None, None, enable_gqa=True)
        assert out[0].shape == (b, H, 1, D) and out[1].shape == (b, H, 1)
        assert not out[0].isnan().any()
