"""Forward correctness of torch_ext.attention (and the raw op) against the float64 reference."""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import torch_ext
from conftest import OUT_TOL, STAT_TOL, assert_close64, stat_dtype
from reference import RefResult, reference_attention, reference_attention_raw

ALL_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
STAT_FIELDS = (
    "lse",
    "entropy",
    "normalized_entropy",
    "sparsity",
    "effective_keys",
    "max_weight",
    "n_keys",
    "scale",
)


# ----------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------
def make_qkv(
    B: int,
    H: int,
    Hkv: int,
    Lq: int,
    Lk: int,
    D: int,
    Dv: Optional[int] = None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    requires_grad: bool = False,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Random N(0, 1) query/key/value in the op's layout."""
    Dv = D if Dv is None else Dv
    q = torch.randn(B, H, Lq, D, dtype=torch.float64).to(device=device, dtype=dtype)
    k = torch.randn(B, Hkv, Lk, D, dtype=torch.float64).to(device=device, dtype=dtype)
    v = torch.randn(B, Hkv, Lk, Dv, dtype=torch.float64).to(device=device, dtype=dtype)
    return q.requires_grad_(requires_grad), k.requires_grad_(requires_grad), v.requires_grad_(requires_grad)


def make_mask(
    kind: str, B: int, H: int, Lq: int, Lk: int, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> Optional[Tensor]:
    """Build a mask of the given kind (bool or additive float in the query dtype)."""
    g = torch.Generator().manual_seed(1234)

    def rb(*shape: int, p: float = 0.7) -> Tensor:
        return torch.rand(*shape, generator=g) < p

    if kind == "none":
        m = None
    elif kind == "bool2d":
        m = rb(Lq, Lk)
    elif kind == "bool4d":
        m = rb(B, H, Lq, Lk)
    elif kind == "bool3d":
        m = rb(H, Lq, Lk)
    elif kind == "bool1d":
        m = rb(Lk)
    elif kind == "bool_keypad":
        m = rb(B, 1, 1, Lk, p=0.8)
    elif kind == "bool_head":
        m = rb(1, H, Lq, 1, p=0.8).expand(1, H, Lq, Lk).clone()
        m |= rb(1, H, Lq, Lk)
    elif kind == "bool_rows_masked":
        m = rb(B, H, Lq, Lk)
        m[:, :, ::3, :] = False  # every third row fully masked
    elif kind == "float2d":
        m = torch.randn(Lq, Lk, generator=g, dtype=torch.float64)
    elif kind == "float_inf":
        m = torch.randn(B, 1, Lq, Lk, generator=g, dtype=torch.float64)
        m = m.masked_fill(rb(B, 1, Lq, Lk, p=0.3), float("-inf"))
    elif kind == "float_rows_masked":
        m = torch.randn(B, H, Lq, Lk, generator=g, dtype=torch.float64)
        m = m.masked_fill(rb(B, H, Lq, Lk, p=0.3), float("-inf"))
        m[:, :, 1::2, :] = float("-inf")  # odd rows fully masked
    else:
        raise ValueError(kind)
    if m is None:
        return None
    if m.dtype != torch.bool:
        m = m.to(dtype)
    return m.to(device)


def run_api(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None, **kw: Any) -> Tuple[Tensor, Any]:
    """Call torch_ext.attention with return_stats=True and check the basic contract."""
    res = torch_ext.attention(q, k, v, mask, return_stats=True, **kw)
    assert isinstance(res, tuple) and len(res) == 2, "return_stats=True must return (output, stats)"
    out, stats = res
    assert isinstance(stats, torch_ext.AttentionStats)
    return out, stats


def check_against_reference(
    out: Tensor,
    stats: Any,
    ref: RefResult,
    dtype: torch.dtype,
    *,
    tol_scale: float = 1.0,
    skip_empty_row_scale: bool = False,
) -> None:
    """Compare the output and every stats field with the reference."""
    B, H, Lq, Dv = ref.output.shape
    assert out.dtype == dtype, f"output dtype {out.dtype} != {dtype}"
    assert out.shape == (B, H, Lq, Dv)
    oat, ort = OUT_TOL[dtype]
    sat, srt = STAT_TOL[dtype]
    oat, ort, sat, srt = oat * tol_scale, ort * tol_scale, sat * tol_scale, srt * tol_scale
    assert_close64(out, ref.output, oat, ort, "output")

    sd = stat_dtype(dtype)
    for name in ("lse", "entropy", "max_weight", "scale", "normalized_entropy", "sparsity", "effective_keys"):
        t = getattr(stats, name)
        assert t.shape == (B, H, Lq), f"{name} shape {tuple(t.shape)}"
        assert t.device == out.device, f"{name} on {t.device}"
        assert t.dtype.is_floating_point, f"{name} dtype {t.dtype}"
    for name in ("lse", "entropy", "max_weight", "scale"):
        assert getattr(stats, name).dtype == sd, f"{name} dtype {getattr(stats, name).dtype} != {sd}"
    assert stats.n_keys.dtype == torch.int64
    assert torch.equal(stats.n_keys.cpu(), ref.n_keys.cpu()), "n_keys mismatch"

    assert_close64(stats.lse, ref.lse, sat, srt, "lse")
    assert_close64(stats.entropy, ref.entropy, sat, srt, "entropy")
    assert_close64(stats.max_weight, ref.max_weight, sat, srt, "max_weight")
    assert_close64(stats.normalized_entropy, ref.normalized_entropy, sat, srt, "normalized_entropy")
    assert_close64(stats.sparsity, ref.sparsity, sat, srt, "sparsity")
    assert_close64(stats.effective_keys, ref.effective_keys, sat, srt, "effective_keys")
    if skip_empty_row_scale:
        has = (ref.n_keys > 0).cpu()
        assert_close64(stats.scale.cpu()[has], ref.row_scale.cpu()[has], sat, srt, "scale")
    else:
        assert_close64(stats.scale, ref.row_scale, sat, srt, "scale")


def compare(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Optional[Tensor] = None,
    tol_scale: float = 1.0,
    **kw: Any,
) -> Tuple[Tensor, Any, RefResult]:
    """Run the op and the reference with the same arguments and compare everything."""
    out, stats = run_api(q, k, v, mask, **kw)
    ref = reference_attention(q, k, v, mask, **kw)
    check_against_reference(
        out,
        stats,
        ref,
        q.dtype,
        tol_scale=tol_scale,
        skip_empty_row_scale=(isinstance(kw.get("scale"), str) and kw["scale"] == "logn_sharpen"),
    )
    return out, stats, ref


# ----------------------------------------------------------------------------------------
# the reference itself
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Lq,Lk", [(7, 7), (5, 9), (9, 5)])
def test_reference_matches_sdpa(causal: bool, Lq: int, Lk: int) -> None:
    """Sanity check of the test oracle: output and lse agree with F.scaled_dot_product_attention."""
    q, k, v = make_qkv(2, 4, 2, Lq, Lk, 8, 6, dtype=torch.float64)
    mask = make_mask("bool4d", 2, 4, Lq, Lk)
    mask[..., 0] = True  # no empty rows (SDPA's math path gives NaN/garbage there)
    ref = reference_attention(q, k, v, mask, is_causal=False, enable_gqa=True, scale=0.7)
    exp = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.7, enable_gqa=True)
    torch.testing.assert_close(ref.output, exp, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(ref.lse, torch.logsumexp((0.7 * q @ k.repeat_interleave(2, 1).transpose(-1, -2)).masked_fill(~mask, float("-inf")), -1))
    if causal:
        ref = reference_attention(q, k, v, is_causal=True, enable_gqa=True)
        exp = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.testing.assert_close(ref.output, exp, atol=1e-12, rtol=1e-12)
    # entropy of a uniform row is ln n
    qz = torch.zeros_like(q)
    refz = reference_attention(qz, k, v, enable_gqa=True)
    torch.testing.assert_close(refz.entropy, torch.full_like(refz.entropy, math.log(Lk)))
    torch.testing.assert_close(refz.effective_keys, torch.full_like(refz.entropy, float(Lk)))


# ----------------------------------------------------------------------------------------
# shapes
# ----------------------------------------------------------------------------------------
SHAPES = [
    # B, H, Hkv, Lq, Lk, D, Dv
    (1, 1, 1, 1, 1, 8, 8),
    (2, 3, 3, 7, 7, 16, 16),
    (1, 2, 2, 1, 33, 16, 16),
    (1, 2, 2, 33, 1, 16, 16),
    (1, 2, 2, 33, 130, 32, 32),
    (1, 2, 2, 130, 33, 16, 24),
    (1, 1, 1, 257, 257, 64, 64),
    (1, 2, 2, 600, 600, 32, 32),
    (2, 2, 2, 1, 600, 16, 8),
    (1, 2, 2, 600, 7, 16, 16),
    (1, 2, 2, 7, 33, 1, 1),
    (1, 2, 2, 5, 9, 3, 40),
    (3, 1, 1, 130, 257, 7, 5),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_shapes(device: str, shape: Tuple[int, ...], dtype: torch.dtype) -> None:
    """Plain attention (no mask, default scale) over many shapes incl. L=1, Lq != Lk, odd sizes."""
    B, H, Hkv, Lq, Lk, D, Dv = shape
    q, k, v = make_qkv(B, H, Hkv, Lq, Lk, D, Dv, dtype=dtype, device=device)
    compare(q, k, v)


def test_return_stats_false_returns_tensor(device: str) -> None:
    """Without return_stats the API returns just the output tensor, equal to the stats variant."""
    q, k, v = make_qkv(2, 2, 2, 9, 11, 8, device=device)
    out = torch_ext.attention(q, k, v)
    assert isinstance(out, Tensor)
    out2, _ = run_api(q, k, v)
    torch.testing.assert_close(out, out2, atol=1e-6, rtol=1e-6)
    ref = reference_attention(q, k, v)
    assert_close64(out, ref.output, *OUT_TOL[torch.float32], name="output")


def test_attention_stats_fields() -> None:
    """AttentionStats is a NamedTuple with the fields the spec lists."""
    assert set(STAT_FIELDS) <= set(torch_ext.AttentionStats._fields)
    q, k, v = make_qkv(1, 2, 2, 4, 5, 8)
    _, stats = run_api(q, k, v)
    for f in STAT_FIELDS:
        assert isinstance(getattr(stats, f), Tensor), f


# ----------------------------------------------------------------------------------------
# masks
# ----------------------------------------------------------------------------------------
MASK_KINDS = [
    "bool2d",
    "bool4d",
    "bool3d",
    "bool1d",
    "bool_keypad",
    "bool_head",
    "bool_rows_masked",
    "float2d",
    "float_inf",
    "float_rows_masked",
]


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("shape", [(2, 2, 2, 7, 33, 16), (1, 2, 2, 130, 257, 16)], ids=["small", "large"])
def test_masks(device: str, kind: str, shape: Tuple[int, ...]) -> None:
    """Bool / additive masks of several ranks, broadcast, incl. fully masked rows."""
    B, H, Hkv, Lq, Lk, D = shape
    q, k, v = make_qkv(B, H, Hkv, Lq, Lk, D, dtype=torch.float32, device=device)
    mask = make_mask(kind, B, H, Lq, Lk, dtype=torch.float32, device=device)
    out, stats, ref = compare(q, k, v, mask)
    if "rows_masked" in kind:
        empty = ref.n_keys == 0
        assert empty.any()
        assert (out[empty.to(out.device)] == 0).all()


@pytest.mark.parametrize("kind", ["bool4d", "float_inf", "float_rows_masked"])
def test_masks_float64(device: str, kind: str) -> None:
    """Masks in float64 with tight tolerances."""
    q, k, v = make_qkv(2, 3, 3, 17, 29, 8, 5, dtype=torch.float64, device=device)
    mask = make_mask(kind, 2, 3, 17, 29, dtype=torch.float64, device=device)
    compare(q, k, v, mask)


def test_bool_mask_equals_additive_inf_mask(device: str) -> None:
    """A bool mask and the equivalent -inf/0 additive mask give the same results."""
    q, k, v = make_qkv(1, 2, 2, 19, 23, 8, device=device)
    mb = make_mask("bool_rows_masked", 1, 2, 19, 23, device=device)
    mf = torch.zeros(mb.shape, device=device).masked_fill(~mb, float("-inf"))
    o1, s1 = run_api(q, k, v, mb)
    o2, s2 = run_api(q, k, v, mf)
    torch.testing.assert_close(o1, o2, atol=1e-6, rtol=1e-6)
    for f in STAT_FIELDS:
        torch.testing.assert_close(getattr(s1, f), getattr(s2, f), atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------------------
# causal
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("Lq,Lk", [(1, 1), (7, 7), (33, 33), (33, 7), (7, 33), (130, 257), (257, 130), (1, 600), (5, 0)])
def test_causal(device: str, Lq: int, Lk: int) -> None:
    """Top-left causal masking, incl. Lq > Lk and Lq < Lk."""
    q, k, v = make_qkv(2, 2, 2, Lq, Lk, 16, 12, device=device)
    _, stats, _ = compare(q, k, v, is_causal=True)
    expected_n = torch.clamp(torch.arange(Lq) + 1, max=Lk).view(1, 1, Lq).expand(2, 2, Lq)
    assert torch.equal(stats.n_keys.cpu(), expected_n)


@pytest.mark.parametrize("kind", ["bool2d", "bool_keypad", "float_inf", "bool_rows_masked"])
@pytest.mark.parametrize("Lq,Lk", [(33, 33), (40, 17), (17, 40)])
def test_causal_and_mask(device: str, kind: str, Lq: int, Lk: int) -> None:
    """Causal and an explicit mask combine as an intersection."""
    q, k, v = make_qkv(2, 2, 2, Lq, Lk, 16, device=device)
    mask = make_mask(kind, 2, 2, Lq, Lk, device=device)
    compare(q, k, v, mask, is_causal=True)


def test_causal_mask_empties_first_row(device: str) -> None:
    """Causal + a mask that hides key 0 leaves row 0 with no keys: zero output, no NaN."""
    q, k, v = make_qkv(1, 2, 2, 6, 6, 8, device=device)
    mask = torch.ones(6, 6, dtype=torch.bool, device=device)
    mask[:, 0] = False
    out, stats, ref = compare(q, k, v, mask, is_causal=True)
    assert stats.n_keys[0, 0, 0].item() == 0
    assert (out[:, :, 0] == 0).all()
    assert torch.isfinite(out).all()


# ----------------------------------------------------------------------------------------
# GQA
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("H,Hkv", [(4, 2), (6, 1), (6, 3), (8, 2)])
@pytest.mark.parametrize("variant", ["plain", "mask", "causal", "logn"])
def test_gqa(device: str, H: int, Hkv: int, variant: str) -> None:
    """Grouped-query attention: query head h uses kv head h // (H // Hkv)."""
    B, Lq, Lk = 2, 13, 37
    q, k, v = make_qkv(B, H, Hkv, Lq, Lk, 8, 6, device=device)
    kw: Dict[str, Any] = {"enable_gqa": True}
    mask = None
    if variant == "mask":
        mask = make_mask("bool4d", B, H, Lq, Lk, device=device)
    elif variant == "causal":
        kw["is_causal"] = True
    elif variant == "logn":
        mask = make_mask("bool_keypad", B, H, Lq, Lk, device=device)
        kw["scale"] = "logn"
    compare(q, k, v, mask, **kw)


def test_gqa_equals_repeated_kv(device: str) -> None:
    """GQA result equals the result with kv heads explicitly repeated (checks the head mapping)."""
    q, k, v = make_qkv(1, 6, 2, 9, 11, 8, device=device)
    o1, s1 = run_api(q, k, v, enable_gqa=True)
    o2, s2 = run_api(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1))
    torch.testing.assert_close(o1, o2, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(s1.entropy, s2.entropy, atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------------------
# scale policies, temperature, train_length
# ----------------------------------------------------------------------------------------
SCALE_KINDS = [
    "none",
    "float",
    "logn",
    "logn_sharpen",
    "t_H1",
    "t_BHLq",
    "t_1",
    "t_0d",
    "t_Lq",
    "t_B11",
]


def make_scale(kind: str, B: int, H: int, Lq: int, device: str, dtype: torch.dtype = torch.float32) -> Any:
    """Build a scale argument of the given kind (tensor scales are positive, around 0.3)."""
    if kind == "none":
        return None
    if kind == "float":
        return 0.37
    if kind in ("logn", "logn_sharpen"):
        return kind
    shapes = {
        "t_H1": (H, 1),
        "t_BHLq": (B, H, Lq),
        "t_1": (1,),
        "t_0d": (),
        "t_Lq": (Lq,),
        "t_B11": (B, 1, 1),
    }
    return (0.1 + 0.5 * torch.rand(shapes[kind], dtype=torch.float64)).to(device=device, dtype=dtype)


@pytest.mark.parametrize("scale_kind", SCALE_KINDS)
@pytest.mark.parametrize("temperature", [1.0, 0.5, 3.0])
@pytest.mark.parametrize("mask_kind", ["bool_rows_masked", "causal"])
def test_scale_kinds(device: str, scale_kind: str, temperature: float, mask_kind: str) -> None:
    """Every scale kind x temperature, with per-row n_i varying (mask or causal)."""
    B, H, Lq, Lk = 2, 3, 21, 45
    q, k, v = make_qkv(B, H, H, Lq, Lk, 16, device=device)
    if mask_kind == "causal":
        mask, causal = None, True
    else:
        mask, causal = make_mask(mask_kind, B, H, Lq, Lk, device=device), False
    scale = make_scale(scale_kind, B, H, Lq, device)
    compare(q, k, v, mask, is_causal=causal, scale=scale, temperature=temperature)


@pytest.mark.parametrize("scale_kind", ["logn", "logn_sharpen"])
@pytest.mark.parametrize("train_length", [2, 16, 100.0, 512, 4096])
def test_train_length(device: str, scale_kind: str, train_length: float) -> None:
    """log base = train_length; with small bases the sharpen clamp is inactive for long rows."""
    B, H, Lq, Lk = 1, 2, 70, 70
    q, k, v = make_qkv(B, H, H, Lq, Lk, 16, device=device)
    _, stats, ref = compare(q, k, v, is_causal=True, scale=scale_kind, train_length=train_length, temperature=0.8)
    # explicit formula check for the scale field
    n = ref.n_keys.to(torch.float64)
    g = torch.log(n) / math.log(train_length)
    if scale_kind == "logn_sharpen":
        g = torch.clamp(g, min=1.0)
    lam = g / math.sqrt(16) / 0.8
    assert_close64(stats.scale, lam, 1e-6, 1e-5, "scale formula")


def test_logn_scale_equals_standard_at_train_length(device: str) -> None:
    """With n_i = train_length, 'logn' equals the standard 1/sqrt(D) scale."""
    q, k, v = make_qkv(1, 2, 2, 8, 64, 16, device=device)
    o1, s1 = run_api(q, k, v, scale="logn", train_length=64)
    o2, s2 = run_api(q, k, v)
    torch.testing.assert_close(o1, o2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s1.scale, torch.full_like(s1.scale, 0.25), atol=1e-6, rtol=1e-6)


def test_logn_empty_rows_have_zero_scale(device: str) -> None:
    """'logn' with n_i = 0 gives lambda 0 (and n_i = 1 gives lambda 0 too: ln 1 = 0)."""
    q, k, v = make_qkv(1, 1, 1, 4, 5, 8, device=device)
    mask = torch.ones(4, 5, dtype=torch.bool, device=device)
    mask[1] = False
    mask[2, 1:] = False
    _, stats, _ = compare(q, k, v, mask, scale="logn")
    assert stats.scale[0, 0, 1].item() == 0.0
    assert stats.scale[0, 0, 2].item() == 0.0
    assert stats.scale[0, 0, 0].item() > 0.0


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_scale_tensor_dtypes(device: str, scale_dtype: torch.dtype) -> None:
    """A float scale tensor of any float dtype is accepted (its values define lambda)."""
    q, k, v = make_qkv(1, 2, 2, 6, 9, 8, dtype=torch.bfloat16, device=device)
    scale = make_scale("t_H1", 1, 2, 6, device, dtype=scale_dtype)
    compare(q, k, v, scale=scale)


def test_scale_tensor_equals_float_scale(device: str) -> None:
    """A constant tensor scale equals the same float scale."""
    q, k, v = make_qkv(2, 2, 2, 11, 13, 8, device=device)
    o1, s1 = run_api(q, k, v, scale=0.4, temperature=2.0)
    o2, s2 = run_api(q, k, v, scale=torch.full((1,), 0.4, device=device), temperature=2.0)
    torch.testing.assert_close(o1, o2, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(s1.scale, torch.full_like(s1.scale, 0.2), atol=1e-7, rtol=1e-6)


# ----------------------------------------------------------------------------------------
# raw op (scale_mode combinations not reachable from the Python API)
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("scale_mode", ["fixed", "logn", "logn_sharpen"])
@pytest.mark.parametrize("scale_src", ["none", "factor", "tensor"])
def test_raw_op_matches_reference(device: str, scale_mode: str, scale_src: str) -> None:
    """torch.ops.entropy_attn.attention: all eleven outputs vs the reference."""
    B, H, Hkv, Lq, Lk = 2, 4, 2, 19, 31
    q, k, v = make_qkv(B, H, Hkv, Lq, Lk, 8, 5, dtype=torch.float64, device=device)
    mask = make_mask("bool_rows_masked", B, H, Lq, Lk, device=device)
    scale = make_scale("t_BHLq", B, H, Lq, device, dtype=torch.float64) if scale_src == "tensor" else None
    factor = 0.45 if scale_src == "factor" else None
    kw = dict(
        is_causal=True, scale_factor=factor, scale_mode=scale_mode, temperature=1.7, log_base=10.0, enable_gqa=True
    )
    res = torch.ops.entropy_attn.attention(q, k, v, mask, scale, **kw)
    assert len(res) == 11
    out, lse, ent, sp2, mw, nk, rs, lf, ne, spars, eff = res
    ref = reference_attention_raw(q, k, v, mask, scale, **kw)
    tol = (1e-9, 1e-9)
    assert_close64(out, ref.output, *tol, name="output")
    assert_close64(lse, ref.lse, *tol, name="lse")
    assert_close64(ent, ref.entropy, *tol, name="entropy")
    assert_close64(sp2, ref.sum_p2, *tol, name="sum_p2")
    assert_close64(mw, ref.max_weight, *tol, name="max_weight")
    assert nk.dtype == torch.int64 and torch.equal(nk.cpu(), ref.n_keys.cpu())
    has = (ref.n_keys > 0).cpu()
    if scale_mode == "logn_sharpen":
        assert_close64(rs.cpu()[has], ref.row_scale.cpu()[has], *tol, name="row_scale")
        assert_close64(lf.cpu()[has], ref.length_factor.cpu()[has], *tol, name="length_factor")
    else:
        assert_close64(rs, ref.row_scale, *tol, name="row_scale")
        assert_close64(lf, ref.length_factor, *tol, name="length_factor")
    assert lf.shape == (B, H, Lq) and not lf.requires_grad
    # The statistics derived in the kernel's epilogue, from their definitions on the reference.
    n = ref.n_keys.double()
    zero = torch.zeros_like(n)
    log_n = torch.log(torch.where(n >= 2, n, torch.full_like(n, 2.0)))
    assert_close64(ne, torch.where(n >= 2, ref.entropy / log_n, zero), *tol, name="normalized_entropy")
    p2 = torch.where(n > 0, ref.sum_p2, torch.ones_like(n))
    assert_close64(spars, torch.where(n > 0, torch.rsqrt(n.clamp_min(1) * p2), zero), *tol, name="sparsity")
    assert_close64(eff, torch.where(n > 0, 1 / p2, zero), *tol, name="effective_keys")
    for t in (lse, ent, sp2, mw, rs, lf, ne, spars, eff):
        assert t.dtype == torch.float64
    # Without statistics: output, lse, n_keys and lambda as before; the statistics empty.
    lean = torch.ops.entropy_attn.attention(q, k, v, mask, scale, return_stats=False, **kw)
    assert torch.equal(lean[0], out) and torch.equal(lean[1], lse) and torch.equal(lean[5], nk)
    assert torch.equal(lean[6], rs)
    assert all(lean[i].numel() == 0 for i in (2, 3, 4, 8, 9, 10))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_raw_op_length_factor(device: str, dtype: torch.dtype) -> None:
    """length_factor = g(n_i)/temperature and row_scale = c_i * length_factor (float32 stats)."""
    B, H, Lq, Lk = 1, 2, 9, 12
    q, k, v = make_qkv(B, H, H, Lq, Lk, 8, dtype=dtype, device=device)
    c = make_scale("t_BHLq", B, H, Lq, device)
    res = torch.ops.entropy_attn.attention(q, k, v, None, c, is_causal=True, scale_mode="logn", temperature=2.0, log_base=4.0)
    assert len(res) == 11
    rs, lf = res[6], res[7]
    assert lf.dtype == torch.float32 and rs.dtype == torch.float32
    n = torch.clamp(torch.arange(Lq, device=device) + 1, max=Lk).double()
    assert_close64(lf, (torch.log(n) / math.log(4.0) / 2.0).expand(B, H, Lq), 1e-6, 1e-5, "length_factor")
    assert_close64(rs, c.double() * lf.double(), 1e-6, 1e-5, "row_scale = c * length_factor")


@pytest.mark.parametrize("scale", ["fixed", "logn", "logn_sharpen"])
def test_public_length_factor(device: str, scale: str) -> None:
    """torch_ext.length_factor = g(n)/temperature for every count, a count <= 0 (no key) giving 0
    for the log-n policies as its docstring says (negative counts are not checked)."""
    n = torch.tensor([-3, 0, 1, 2, 7, 64, 1000], device=device)
    got = torch_ext.length_factor(n, scale, temperature=2.0, train_length=64, dtype=torch.float64)
    log_b = torch.log(n.clamp_min(1).double()) / math.log(64.0)
    g = {"fixed": torch.ones_like(log_b), "logn": log_b, "logn_sharpen": log_b.clamp_min(1.0)}[scale]
    if scale != "fixed":
        g = torch.where(n > 0, g, torch.zeros_like(g))
    assert_close64(got, g / 2.0, 1e-15, 1e-15, "length_factor")


# ----------------------------------------------------------------------------------------
# dtypes
# ----------------------------------------------------------------------------------------
DTYPE_CASES = ["plain", "mask_causal", "gqa_logn", "rows_masked", "tensor_scale", "long"]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("case", DTYPE_CASES)
def test_dtypes(device: str, dtype: torch.dtype, case: str) -> None:
    """All four dtypes with dtype-appropriate tolerances (reference uses the same rounded inputs)."""
    B, H, Hkv, Lq, Lk, D = 2, 4, 4, 33, 47, 16
    kw: Dict[str, Any] = {}
    mask = None
    if case == "mask_causal":
        mask = make_mask("float_inf", B, H, Lq, Lk, dtype=dtype, device=device)
        kw["is_causal"] = True
    elif case == "gqa_logn":
        Hkv = 2
        kw.update(enable_gqa=True, scale="logn_sharpen", train_length=8)
    elif case == "rows_masked":
        mask = make_mask("bool_rows_masked", B, H, Lq, Lk, device=device)
    elif case == "tensor_scale":
        kw.update(scale=make_scale("t_BHLq", B, H, Lq, device), temperature=0.7)
    elif case == "long":
        Lq, Lk = 130, 600
    q, k, v = make_qkv(B, H, Hkv, Lq, Lk, D, dtype=dtype, device=device)
    out, stats, ref = compare(q, k, v, mask, **kw)
    assert torch.isfinite(out).all()


# ----------------------------------------------------------------------------------------
# layouts
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_strided_inputs(device: str, dtype: torch.dtype) -> None:
    """Non-contiguous inputs: (B, L, H, D) tensors transposed, expanded batch, sliced D, transposed mask."""
    B, H, Lq, Lk, D = 2, 3, 17, 29, 16
    q = torch.randn(B, Lq, H, D, device=device).to(dtype).transpose(1, 2)
    k = torch.randn(B, Lk, H, D, device=device).to(dtype).transpose(1, 2)
    v_big = torch.randn(B, H, Lk, 2 * D, device=device).to(dtype)
    v = v_big[..., ::2]  # stride 2 in the last dim
    assert not q.is_contiguous() and not k.is_contiguous() and not v.is_contiguous()
    mask = (torch.rand(Lk, Lq, device=device) < 0.7).t()
    assert not mask.is_contiguous()
    compare(q, k, v, mask, is_causal=True)
    # expanded (stride-0) batch dimension for key/value
    k1 = torch.randn(1, H, Lk, D, device=device).to(dtype).expand(B, H, Lk, D)
    v1 = torch.randn(1, H, Lk, D, device=device).to(dtype).expand(B, H, Lk, D)
    compare(q, k1, v1, mask)


@pytest.mark.parametrize("layout", ["projection", "contiguous", "one_row", "one_head", "expanded_heads"])
def test_output_follows_the_query_layout(device: str, layout: str) -> None:
    """The output is allocated in the query's layout, as SDPA's cuDNN backend allocates it: a
    query split from a (B, L, H * D) projection gives an output whose heads merge back by a view
    (no copy of the output), any other query a contiguous output; the values, statistics and
    gradients are those of contiguous inputs."""
    B, H, L, Lk, D, Dv = 2, 3, 9, 11, 8, 5
    g = torch.Generator().manual_seed(7)
    if layout == "projection":
        q = torch.randn(B, L, H * D, generator=g).unflatten(-1, (H, D)).transpose(1, 2)
    elif layout == "one_row":
        q = torch.randn(B, 1, H, D, generator=g).transpose(1, 2)
    elif layout == "one_head":
        q = torch.randn(B, L, 1, D, generator=g).transpose(1, 2)
    elif layout == "expanded_heads":  # stride 0 over the heads (expanded below, on the device)
        q = torch.randn(B, 1, L, D, generator=g)
    else:
        q = torch.randn(B, H, L, D, generator=g)
    H = H if layout == "expanded_heads" else q.shape[1]
    k, v = torch.randn(B, H, Lk, D, generator=g), torch.randn(B, H, Lk, Dv, generator=g)
    q, k, v = (t.to(device).requires_grad_() for t in (q, k, v))
    if layout == "expanded_heads":  # inside the rows, by the strides (a copy to the GPU is contiguous)
        q = q.expand(B, H, L, D)
    out, stats = torch_ext.attention(q, k, v, is_causal=True, return_stats=True)
    heads_inside = layout in ("projection", "expanded_heads")
    assert out.shape == (B, H, q.shape[2], Dv)
    assert out.transpose(1, 2).is_contiguous() if heads_inside else out.is_contiguous(), out.stride()
    if layout == "projection":
        merged = out.transpose(1, 2).reshape(B, L, H * Dv)
        assert merged.data_ptr() == out.data_ptr() and merged._base is not None, "merging the heads copied"
    qc, kc, vc = (t.detach().contiguous().requires_grad_() for t in (q, k, v))
    ref_out, ref_stats = torch_ext.attention(qc, kc, vc, is_causal=True, return_stats=True)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(stats.entropy, ref_stats.entropy, rtol=0, atol=0)
    go = torch.randn(out.shape, generator=g).to(device)
    grads = torch.autograd.grad((out * go).sum() + stats.entropy.sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref_out * go).sum() + ref_stats.entropy.sum(), (qc, kc, vc))
    for name, a, e in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6, msg=f"grad {name}")


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("Lq", [1, 3, 8, 9, 17, 32])
def test_short_query_blocks_against_a_cache(device: str, dtype: torch.dtype, Lq: int) -> None:
    """A few query rows per head against the first keys of a preallocated cache (key rows 48
    elements apart, heads 1280 rows apart), as a decoding step or a chunked prefill passes them:
    three key blocks, the last one ragged, a padding mask and statistics. On the CPU, up to 8 rows
    take their scores from the key rows as stored and more rows a transposed copy of each block,
    16-bit blocks converted as they stream: each path against the reference."""
    B, H, Lk, D = 2, 3, 1100, 40
    g = torch.Generator().manual_seed(Lq)
    cache_k = torch.randn(B, H, 1280, 48, generator=g).to(dtype)
    cache_v = torch.randn(B, H, 1280, 48, generator=g).to(dtype)
    k, v = cache_k[:, :, :Lk, :D].to(device), cache_v[:, :, :Lk, :D].to(device)
    q = torch.randn(B, H, Lq, D, generator=g).to(dtype).to(device)
    mask = (torch.rand(B, 1, 1, Lk, generator=g) < 0.9).to(device)
    compare(q, k, v, mask, causal_alignment="bottom_right", is_causal=True)


KEY_SOURCE_CASES = {  # B, H, Hkv, Lq, Lk, keyword arguments, K stored transposed
    # 9 heads on 2 or 4 threads: a thread's run of tasks starts inside a head and goes on to the
    # next head of the same group, whose first tiles reach keys below those it converted first
    "gqa_window": (1, 9, 3, 700, 700, {"is_causal": True, "window_size": (40, 0)}, False),
    "gqa_window_bottom_right": (
        2, 6, 3, 300, 521, {"window_size": (60, 30), "causal_alignment": "bottom_right"}, False),
    # one (batch, kv head) pair: K and V converted whole before the tasks on 2 or more threads
    "mqa_causal": (1, 4, 1, 600, 600, {"is_causal": True}, False),
    "batch_of_heads": (3, 4, 4, 130, 1100, {}, False),
    # K's rows not contiguous: K^T read in place (float32, float64), or converted whole from K as
    # given (16-bit; bfloat16 products: copied to rows)
    "key_stored_transposed": (2, 4, 2, 200, 333, {"is_causal": True}, True),
}  # fmt: skip


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize("case", list(KEY_SOURCE_CASES))
def test_cpu_forward_key_sources(dtype: torch.dtype, threads: int, case: str) -> None:
    """The CPU forward's tasks read K transposed (and 16-bit K and V converted, or packed in bfloat16
    pairs) from their thread's buffers, converted once per run of tasks, where there are at least as
    many (batch, kv head) pairs as threads, and from whole copies where there are fewer
    (csrc/cpu/attention_fwd.cpp, KeySource): both against the reference on 1-4 threads, with a
    value row of NaN and one of infinity in keys that no row sees (their flags are found as the
    keys are converted), an odd key count and ragged tiles."""
    B, H, Hkv, Lq, Lk, kw, key_transposed = KEY_SOURCE_CASES[case]
    q, k, v = make_qkv(B, H, Hkv, Lq, Lk, 16, dtype=dtype, device="cpu")
    if key_transposed:
        k = k.transpose(2, 3).contiguous().transpose(2, 3)
    mask = torch.ones(1, 1, 1, Lk, dtype=torch.bool)
    hidden = [3, Lk - 2]  # keys no row sees: in the first block and the last
    mask[..., hidden] = False
    v_bad = v.clone()
    v_bad[:, :, hidden[0]] = float("nan")
    v_bad[:, :, hidden[1]] = float("inf")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, stats = run_api(q, k, v_bad, mask, enable_gqa=True, **kw)
    finally:
        torch.set_num_threads(previous)
    # (the reference with those values at 0: a key that no row sees takes no part in any row)
    v_ref = v.clone()
    v_ref[:, :, hidden] = 0
    check_against_reference(out, stats, reference_attention(q, k, v_ref, mask, enable_gqa=True, **kw), dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_forward_nan_value_seen_by_later_tiles(dtype: torch.dtype, threads: int) -> None:
    """A NaN value of the key just past the first query tile's last (bottom-right causal, 221 more
    keys than queries: rows 0-63 see keys 0-284, the NaN is key 285), which bfloat16 products pair
    with key 284 in the first tile's product: the first tile's rows stay finite and equal the
    reference without it, and every later row, which sees it, is NaN."""
    B, H, Hkv, Lq, Lk, nan_key = 1, 4, 2, 300, 521, 285
    q, k, v = make_qkv(B, H, Hkv, Lq, Lk, 16, dtype=dtype, device="cpu")
    kw: Dict[str, Any] = {"is_causal": True, "causal_alignment": "bottom_right", "enable_gqa": True}
    v_bad = v.clone()
    v_bad[:, :, nan_key] = float("nan")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, _ = run_api(q, k, v_bad, **kw)
    finally:
        torch.set_num_threads(previous)
    v_ref = v.clone()
    v_ref[:, :, nan_key] = 0
    ref = reference_attention(q, k, v_ref, **kw)
    first = nan_key - (Lk - Lq)  # the rows that do not see the key
    assert first == 64
    oat, ort = OUT_TOL[dtype]
    assert_close64(out[:, :, :first], ref.output[:, :, :first], oat, ort, "rows before the NaN key")
    assert out[:, :, first:].isnan().all(), "a row that sees a NaN value has a NaN output"


# ----------------------------------------------------------------------------------------
# edge cases: empty rows, Lk = 0, huge logits, NaN
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("scale_kind", ["none", "logn", "logn_sharpen", "t_BHLq"])
def test_fully_masked_rows_no_nan(device: str, dtype: torch.dtype, scale_kind: str) -> None:
    """Fully masked rows: output and every statistic 0 (n_keys 0), nothing NaN anywhere."""
    B, H, Lq, Lk = 2, 2, 9, 12
    q, k, v = make_qkv(B, H, H, Lq, Lk, 8, dtype=dtype, device=device)
    mask = make_mask("float_rows_masked", B, H, Lq, Lk, dtype=dtype, device=device)
    scale = make_scale(scale_kind, B, H, Lq, device)
    out, stats, ref = compare(q, k, v, mask, scale=scale)
    empty = (ref.n_keys == 0).to(device)
    assert empty.any()
    assert not torch.isnan(out).any()
    assert (out[empty] == 0).all()
    for f in STAT_FIELDS:
        t = getattr(stats, f)
        assert not torch.isnan(t.double()).any(), f
        if f != "scale":
            assert (t[empty] == 0).all(), f"{f} nonzero on empty rows"


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_all_rows_masked(device: str, dtype: torch.dtype) -> None:
    """A mask with every entry False: everything zero, no NaN."""
    q, k, v = make_qkv(1, 2, 2, 5, 7, 8, dtype=dtype, device=device)
    mask = torch.zeros(5, 7, dtype=torch.bool, device=device)
    out, stats, _ = compare(q, k, v, mask)
    assert (out == 0).all()
    for f in ("lse", "entropy", "max_weight", "n_keys", "effective_keys", "sparsity", "normalized_entropy"):
        assert (getattr(stats, f) == 0).all(), f


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_lk_zero(device: str, causal: bool, dtype: torch.dtype) -> None:
    """Lk = 0: output zeros of shape (B, H, Lq, Dv), statistics 0, no NaN."""
    q, k, v = make_qkv(2, 2, 2, 5, 0, 8, 6, dtype=dtype, device=device)
    out, stats, _ = compare(q, k, v, is_causal=causal)
    assert out.shape == (2, 2, 5, 6)
    assert (out == 0).all()
    assert (stats.n_keys == 0).all()
    assert (stats.lse == 0).all() and (stats.entropy == 0).all() and (stats.max_weight == 0).all()


def test_zero_heads(device: str) -> None:
    """H = Hkv = 0, as SDPA: empty outputs and statistics, forward and backward (the query heads per
    key/value head, H / Hkv, divided by zero and killed the process), dense and packed."""
    q, k, v = make_qkv(2, 0, 0, 5, 7, 8, 6, dtype=torch.float64, device=device)
    for t in (q, k, v):
        t.requires_grad_(True)
    out, stats = torch_ext.attention(q, k, v, is_causal=True, return_stats=True)
    assert out.shape == F.scaled_dot_product_attention(q, k, v, is_causal=True).shape == (2, 0, 5, 6)
    assert stats.entropy.shape == (2, 0, 5)
    (out.sum() + stats.entropy.sum()).backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    cu = torch.tensor([0, 2, 5], dtype=torch.int32, device=device)
    packed = torch_ext.varlen_attention(q[0].transpose(0, 1), k[0, :, :5].transpose(0, 1),
                                        v[0, :, :5].transpose(0, 1), cu, cu, 3, 3, is_causal=True)
    assert packed.shape == (5, 0, 6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_bool_mask_of_nonzero_bytes(device: str, dtype: torch.dtype) -> None:
    """A uint8 tensor viewed as bool may hold any nonzero byte for True, as torch's own ops read it
    (SDPA among them): every statistic, n_i and the "logn" scale that depends on it, and the
    gradients equal those of the 0/1 mask. n_i summed the bytes (6 keys for 3) and a byte read as
    a C++ bool may be taken for its lowest bit."""
    B, H, Lq, Lk, D = 2, 2, 5, 9, 8
    q, k, v = make_qkv(B, H, H, Lq, Lk, D, dtype=dtype, device=device)
    g = torch.Generator().manual_seed(11)
    raw = torch.randint(0, 4, (B, 1, Lq, Lk), dtype=torch.uint8, generator=g) * 85  # 0, 85, 170, 255
    raw[..., 0] = 2  # every row sees a key
    wide, plain = raw.to(device).view(torch.bool), (raw != 0).to(device)
    for kw in ({}, {"scale": "logn", "train_length": 4}, {"is_causal": True}):
        got = torch_ext.attention(q, k, v, wide, return_stats=True, **kw)
        want = torch_ext.attention(q, k, v, plain, return_stats=True, **kw)
        assert torch.equal(got[0], want[0]), kw
        for name in ("lse", "entropy", "normalized_entropy", "effective_keys", "n_keys", "scale"):
            assert torch.equal(getattr(got[1], name), getattr(want[1], name)), (kw, name)
    sparsity = torch_ext.attention_sparsity(q, k, wide, kind="relu2")
    torch.testing.assert_close(sparsity, torch_ext.attention_sparsity(q, k, plain, kind="relu2"), rtol=0, atol=0)
    grads = []
    for m in (wide, plain):
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        out, stats = torch_ext.attention(*leaves, m, scale="logn", return_stats=True)
        grads.append(torch.autograd.grad(out.float().square().sum() + stats.entropy.sum(), leaves))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("variant", ["plain", "mask_causal", "negative"])
def test_huge_logits(device: str, dtype: torch.dtype, variant: str) -> None:
    """|s| ~ 1e4: everything stays finite and matches the reference."""
    B, H, Lq, Lk, D = 1, 2, 33, 65, 16
    q, k, v = make_qkv(B, H, H, Lq, Lk, D, dtype=dtype, device=device)
    q = q * 50
    k = k * 50
    kw: Dict[str, Any] = {"scale": 1.0 / 4}
    mask = None
    if variant == "mask_causal":
        mask = make_mask("bool_rows_masked", B, H, Lq, Lk, device=device)
        kw["is_causal"] = True
    elif variant == "negative":
        # all logits hugely negative: -1e4 - |...|
        mask = torch.full((Lq, Lk), -1e4, dtype=dtype, device=device)
    out, stats, ref = compare(q, k, v, mask, **kw)
    assert ref.lse.abs().max() > 3e3, "test does not reach large logits"
    assert torch.isfinite(out).all()
    for f in STAT_FIELDS:
        assert torch.isfinite(getattr(stats, f).double()).all(), f


def test_nan_query_propagates(device: str) -> None:
    """A NaN in one query row gives NaN output in that row, no crash, other rows unaffected."""
    q, k, v = make_qkv(1, 2, 2, 6, 9, 8, device=device)
    q = q.clone()
    q[0, 1, 3, 2] = float("nan")
    out, stats = run_api(q, k, v)
    assert torch.isnan(out[0, 1, 3]).any()
    ref = reference_attention(q, k, v)
    ok = torch.ones(1, 2, 6, dtype=torch.bool)
    ok[0, 1, 3] = False
    okd = ok.to(device)
    assert_close64(out[okd], ref.output[ok], *OUT_TOL[torch.float32], name="output (finite rows)")
    assert_close64(stats.entropy[okd], ref.entropy[ok], *STAT_TOL[torch.float32], name="entropy (finite rows)")


def test_uniform_rows_statistics(device: str) -> None:
    """q = 0 makes every allowed key equally likely: H = ln n, n_eff = n, sparsity = 1, p_max = 1/n."""
    B, H, Lq, Lk = 1, 2, 8, 10
    q = torch.zeros(B, H, Lq, 4, device=device)
    k = torch.randn(B, H, Lk, 4, device=device)
    v = torch.randn(B, H, Lk, 4, device=device)
    out, stats = run_api(q, k, v, is_causal=True)
    n = torch.clamp(torch.arange(Lq, device=device) + 1, max=Lk).double().expand(B, H, Lq)
    torch.testing.assert_close(stats.entropy.double(), torch.log(n), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats.effective_keys.double(), n, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(stats.max_weight.double(), 1 / n, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(stats.sparsity.double(), torch.ones_like(n), atol=1e-5, rtol=1e-5)
    ne = stats.normalized_entropy.double()
    torch.testing.assert_close(ne[..., 1:], torch.ones_like(ne[..., 1:]), atol=1e-5, rtol=1e-5)
    assert (ne[..., 0] == 0).all()  # n = 1 -> 0 by convention


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_uniform_rows_stay_in_range(device: str, dtype: torch.dtype) -> None:
    """A uniform row is where entropy, normalized entropy, sparsity and effective keys reach their
    bounds (ln n, 1, 1, n); rounding must not carry them past (sum_p2 one ulp under 1/n gave
    n_eff > n, ln l - t/l gave up to 7 ulps over ln n in float64). Every n from 1 to 300 (causal
    rows), with and without a sink, and identical keys at n = 1100. ln n is the device's own
    (CUDA's log may be an ulp off the correctly rounded one)."""
    L = 300
    q = torch.zeros(1, 2, L, 8, device=device, dtype=dtype)
    k = torch.randn(1, 2, L, 8, device=device, dtype=dtype)
    v = torch.randn(1, 2, L, 8, device=device, dtype=dtype)
    calls = [(q, k, v, dict(is_causal=True, sinks=sinks)) for sinks in (None, torch.zeros(2, device=device, dtype=dtype))]
    gen = torch.Generator().manual_seed(0)
    q1 = (torch.randn(1, 1, 64, 8, generator=gen, dtype=torch.float64) * 4).to(device, dtype)
    k1 = (torch.randn(1, 1, 1, 8, generator=gen, dtype=torch.float64) * 4).to(device, dtype).expand(1, 1, 1100, 8)
    calls.append((q1, k1, torch.randn(1, 1, 1100, 4, device=device, dtype=dtype), dict(sinks=None)))
    ulps = 0 if device == "cpu" else 1
    for qc, kc, vc, kw in calls:
        _, stats = torch_ext.attention(qc, kc, vc, return_stats=True, **kw)
        n = stats.n_keys.to(stats.effective_keys.dtype) + (0 if kw["sinks"] is None else 1)
        ln_n = torch.log(n.double()).to(n.dtype)
        for _ in range(ulps):
            ln_n = torch.nextafter(ln_n, torch.full_like(ln_n, torch.inf))
        assert (stats.entropy <= ln_n).all(), (stats.entropy - ln_n).max()
        assert (stats.effective_keys <= n).all(), (stats.effective_keys - n).max()
        assert (stats.sparsity <= 1).all(), stats.sparsity.max()
        assert (stats.normalized_entropy <= 1).all(), stats.normalized_entropy.max()
        torch.testing.assert_close(stats.effective_keys, n, atol=0, rtol=1e-5)
    a = torch.full((3, 257), 0.1, device=device, dtype=dtype)
    assert (torch_ext.sparsity(a, dim=-1) <= 1).all()


@pytest.mark.parametrize("dynamic", [True, None], ids=["dynamic", "automatic"])
@pytest.mark.parametrize("return_stats", [False, True])
def test_compile_one_graph_for_every_length(return_stats: bool, dynamic: Optional[bool]) -> None:
    """Under torch.compile the op's checks and output shapes are symbolic (the Meta kernel guards on
    the sizes instead of fixing them), so a graph traced with dynamic sizes serves every length,
    batch and number of heads: with dynamic=True the 10 shapes below compile once; left to dynamo
    (automatic dynamic shapes) once more per kind of size as it first changes (lengths, batch,
    heads), where fixing the sizes recompiled per shape and raised past the recompile limit (8)
    under fullgraph=True. Forward and backward, a mask, GQA and the log-n scale (whose n_i follows
    the length), each result equal to the eager op's."""
    def f(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Any:
        return torch_ext.attention(q, k, v, mask, is_causal=True, enable_gqa=True, scale="logn",
                                   train_length=8, return_stats=return_stats)

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    # Recompiling raises from the shape after which none is expected: the second with dynamic=True,
    # the fifth when each kind of size has changed once.
    settled = 1 if dynamic else 4
    g = torch.Generator().manual_seed(2)
    # (dynamo itself specializes sizes of 0 and 1, and ties sizes equal in the first trace: every
    # size here is at least 2, and the first shape's are all different.)
    for i, (b, h, lq, lk) in enumerate([(2, 6, 5, 7), (2, 4, 7, 9), (3, 4, 12, 12), (2, 6, 9, 17), (4, 4, 20, 30),
                                        (2, 4, 33, 31), (3, 8, 40, 41), (2, 4, 50, 50), (2, 4, 64, 70),
                                        (2, 4, 3, 90)]):
        if i >= settled:
            torch.compiler.set_stance("fail_on_recompile")
        q = torch.randn(b, h, lq, 8, dtype=torch.float64, generator=g, requires_grad=True)
        k, v = (torch.randn(b, h // 2, lk, 8, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(2))
        mask = torch.randn(lq, lk, dtype=torch.float64, generator=g)
        try:
            got = compiled(q, k, v, mask)
        finally:
            torch.compiler.set_stance("default")
        want = f(q, k, v, mask)
        got_out, want_out = (got[0], want[0]) if return_stats else (got, want)
        torch.testing.assert_close(got_out, want_out, rtol=1e-12, atol=1e-12)
        if return_stats:
            torch.testing.assert_close(got[1].entropy, want[1].entropy, rtol=1e-12, atol=1e-12)
        grads = torch.autograd.grad(got_out.sum(), (q, k, v))
        for a, e in zip(grads, torch.autograd.grad(want_out.sum(), (q, k, v))):
            torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


def test_export_with_dynamic_lengths() -> None:
    """torch.export with the sequence lengths dynamic (Dim): one program that runs other lengths."""
    class Attn(torch.nn.Module):
        def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return torch_ext.attention(q, k, v, is_causal=True, causal_alignment="bottom_right")

    lq, lk = torch.export.Dim("lq", min=2, max=4096), torch.export.Dim("lk", min=2, max=4096)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g) for n in (6, 10, 10))
    program = torch.export.export(Attn(), (q, k, v), dynamic_shapes=({2: lq}, {2: lk}, {2: lk}))
    q, k, v = (torch.randn(1, 2, n, 8, generator=g) for n in (13, 29, 29))
    torch.testing.assert_close(program.module()(q, k, v), Attn()(q, k, v), rtol=1e-6, atol=1e-6)


def test_compile_dynamic_fullgraph() -> None:
    """torch.compile(dynamic=True, fullgraph=True) traces the Python wrapper (its argument checks
    used math.isfinite, which dynamo cannot trace on the symbolic floats of dynamic=True)."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64, generator=g) for _ in range(3))

    def f(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return torch_ext.attention(q, k, v, is_causal=True, scale="logn", temperature=0.8, train_length=4)

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(q, k, v), f(q, k, v), rtol=0, atol=0)
