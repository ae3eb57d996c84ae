"""torch_ext.replace_sdpa: F.scaled_dot_product_attention calls inside it run on the fused op."""

from __future__ import annotations

import contextlib
import math
from typing import Any, Dict

import pytest
import torch
import torch.nn.functional as F
from torch.nn.functional import scaled_dot_product_attention as imported_sdpa

import torch_ext
from conftest import DEVICES


class CausalSelfAttention(torch.nn.Module):
    """nanoGPT's attention block, unchanged: it calls F.scaled_dot_product_attention."""

    def __init__(self, n_embd: int = 32, n_head: int = 4) -> None:
        super().__init__()
        self.c_attn = torch.nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = torch.nn.Linear(n_embd, n_embd)
        self.n_head = n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class TinyGPT(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([CausalSelfAttention() for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return x


def qkv(B: int = 2, H: int = 4, Hkv: int = 4, L: int = 7, S: int = 9, D: int = 8, dtype=torch.float64) -> list:
    return [torch.randn(B, h, n, D, dtype=dtype, requires_grad=True) for h, n in ((H, L), (Hkv, S), (Hkv, S))]


CASES: Dict[str, Dict[str, Any]] = {
    "plain": {},
    "causal": {"is_causal": True},
    "bool_mask": {"attn_mask": "bool"},
    "float_mask": {"attn_mask": "float"},
    "scale": {"scale": 0.3},
    "gqa": {"enable_gqa": True, "Hkv": 2},
}


@pytest.mark.parametrize("case", list(CASES))
def test_scale_none_matches_sdpa(case: str) -> None:
    """With scale=None the routed call equals SDPA: outputs and gradients (float64)."""
    torch.manual_seed(0)
    kw = dict(CASES[case])
    q, k, v = qkv(Hkv=kw.pop("Hkv", 4), L=9 if kw.get("is_causal") else 7)
    if kw.get("attn_mask") == "bool":
        kw["attn_mask"] = torch.rand(q.shape[2], k.shape[2]) < 0.7
        kw["attn_mask"][:, 0] = True
    elif kw.get("attn_mask") == "float":
        kw["attn_mask"] = torch.randn(2, 1, q.shape[2], k.shape[2], dtype=torch.float64)
    ref = F.scaled_dot_product_attention(q, k, v, **kw)
    with torch_ext.replace_sdpa():
        out = F.scaled_dot_product_attention(q, k, v, **kw)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, [q, k, v], g), torch.autograd.grad(ref, [q, k, v], g)):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_routes_calls_with_policy() -> None:
    """Inside, the policy applies (however SDPA was imported); outside, SDPA is untouched."""
    torch.manual_seed(0)
    q, k, v = qkv(L=9, S=9)
    std = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    expected = torch_ext.attention(q, k, v, is_causal=True, scale="logn", train_length=4)
    with torch_ext.replace_sdpa(scale="logn", train_length=4):
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        b = imported_sdpa(q, k, v, is_causal=True)
        c = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    for t in (a, b, c):
        torch.testing.assert_close(t, expected, atol=1e-12, rtol=1e-12)
    assert not torch.allclose(a, std)
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, is_causal=True), std)
    # the call's explicit scale is the policy's base scale: c * log_b(n_i)
    with torch_ext.replace_sdpa(scale="logn", train_length=4):
        d = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.2)
    torch.testing.assert_close(
        d, torch_ext.attention(q, k, v, is_causal=True, scale="logn", train_length=4, scale_factor=0.2)
    )
    # nested: the innermost policy applies
    with torch_ext.replace_sdpa(scale="logn", train_length=4), torch_ext.replace_sdpa():
        torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, is_causal=True), std)


def test_three_dim_inputs() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, n, 8, dtype=torch.float64) for n in (5, 6, 6))
    mask = torch.rand(3, 5, 6) < 0.7
    mask[..., 0] = True
    with torch_ext.replace_sdpa():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def test_nanogpt_model_and_monitor() -> None:
    """A model that calls SDPA switches without edits; the monitor names layers by module path and
    its entropy equals the one computed from the materialized probabilities."""
    torch.manual_seed(0)
    model = TinyGPT().double()
    x = torch.randn(2, 11, 32, dtype=torch.float64)
    ref = model(x)
    monitor = torch_ext.AttentionEntropyMonitor(model)
    with torch_ext.replace_sdpa(), monitor:
        out = model(x)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    assert sorted({r["layer"] for r in monitor.latest}) == ["blocks.0", "blocks.1"]
    # entropy of block 0 from the materialized matrix
    blk = model.blocks[0]
    q, k, _ = blk.c_attn(x).split(32, dim=2)
    q, k = (t.view(2, 11, 4, 8).transpose(1, 2) for t in (q, k))
    logits = (q @ k.transpose(-1, -2) / math.sqrt(8)).masked_fill(torch.ones(11, 11, dtype=torch.bool).triu(1), -math.inf)
    p = logits.softmax(-1)
    ent = -(p * p.clamp_min(1e-300).log()).sum(-1)  # (B, H, L)
    got = [r for r in monitor.latest if r["layer"] == "blocks.0"]
    for h, r in enumerate(got):
        assert r["entropy_mean"] == pytest.approx(ent[:, h].mean().item(), rel=1e-9)
        assert r["entropy_max"] == pytest.approx(ent[:, h].max().item(), rel=1e-9)


def test_errors() -> None:
    q, k, v = qkv()
    with torch_ext.replace_sdpa():
        with pytest.raises(ValueError, match="at least 2 dims"):
            F.scaled_dot_product_attention(q[0, 0, 0], k[0, 0, 0], v[0, 0, 0])
        # Head dim 0: the op's error, not a ZeroDivisionError from the default scale 1/sqrt(E).
        with pytest.raises(ValueError, match="head_dim must be positive"):
            F.scaled_dot_product_attention(q[..., :0], k[..., :0], v)
    with pytest.raises(ValueError, match="scale"):
        torch_ext.replace_sdpa(scale="bad")


@pytest.mark.parametrize(
    "q_shape,kv_shape,mask_shape,kwargs",
    [
        ((5, 8), (6, 8), None, {}),  # one sequence
        ((5, 8), (6, 8), (5, 6), {}),
        ((5, 8), (3, 6, 8), None, {}),  # the query broadcast over key's leading dim
        ((3, 5, 8), (3, 6, 8), (3, 5, 6), {}),
        ((3, 5, 8), (3, 6, 8), None, {"is_causal": True}),
        ((2, 1, 5, 8), (2, 2, 6, 8), None, {}),  # one query head broadcast to two key heads
        ((2, 3, 4, 5, 8), (2, 3, 4, 6, 8), (3, 1, 5, 6), {}),  # 5-D: two leading dims
        ((2, 3, 4, 5, 8), (1, 3, 2, 6, 8), (2, 1, 1, 5, 6), {"enable_gqa": True}),
        ((2, 3, 4, 5, 8), (2, 3, 4, 6, 8), None, {"is_causal": True}),
        ((5, 8), (2, 4, 6, 8), None, {}),  # a query of fewer dims than key and value
        ((4, 5, 8), (2, 4, 6, 8), (5, 6), {}),
        ((2, 4, 5, 8), (6, 8), None, {"is_causal": True}),  # key and value of fewer dims
        ((2, 4, 5, 8), (4, 6, 8), None, {}),
        ((3, 5, 8), (3, 6, 8), (1, 1, 5, 6), {}),  # a mask of more dims than the inputs, leading 1s
        ((3, 5, 8), (3, 6, 8), (1, 3, 5, 6), {}),
        # 3-D under GQA: the first dim is the heads SDPA groups (6 query heads on 3; was refused)
        ((6, 5, 8), (3, 6, 8), None, {"enable_gqa": True}),
        ((6, 5, 8), (3, 6, 8), (6, 5, 6), {"enable_gqa": True}),
        ((6, 5, 8), (3, 6, 8), (5, 6), {"enable_gqa": True, "scale": 0.3}),
        ((6, 5, 8), (3, 6, 8), None, {"enable_gqa": True, "is_causal": True}),
    ],
)
def test_sdpa_layouts(q_shape: tuple, kv_shape: tuple, mask_shape: tuple | None, kwargs: Dict[str, Any]) -> None:
    """Every layout SDPA takes, (..., L, E) with broadcasting leading dims, gives SDPA's output
    (shape and values, float64): 2-D, 3-D and 5-D inputs and a broadcast head were refused, a
    query of fewer dims than key and value raised IndexError, and a mask of more dims than the
    inputs (its extra leading dims 1, which SDPA takes) raised ValueError."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(q_shape, dtype=torch.float64, generator=g)
    k, v = (torch.randn(kv_shape, dtype=torch.float64, generator=g) for _ in range(2))
    mask = None if mask_shape is None else torch.randn(mask_shape, dtype=torch.float64, generator=g)
    # A mask of more dims than the inputs: SDPA's answer with its extra leading 1s dropped (its
    # fused CPU kernel takes the mask as it is, its math backend refuses it).
    extra = 0 if mask is None else max(0, mask.dim() - max(q.dim(), k.dim()))
    want = F.scaled_dot_product_attention(q, k, v, None if mask is None else mask.reshape(mask.shape[extra:]), **kwargs)
    with torch_ext.replace_sdpa():
        got = F.scaled_dot_product_attention(q, k, v, mask, **kwargs)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("heads", [(4, 2, 4), (4, 4, 2), (6, 2, 3), (8, 1, 4), (6, 3, 2), (4, 4, 1)])
@pytest.mark.parametrize("route", ["replace_sdpa", "attention"])
def test_gqa_key_and_value_head_counts_may_differ(heads: tuple, route: str) -> None:
    """Under enable_gqa SDPA repeats key and value to the query's heads each on its own, so their
    head counts may differ (each dividing the query's): an audio encoder whose value projection
    ignores num_key_value_heads ran on "sdpa" and raised "key and value must have the same number
    of heads" here. Outputs and gradients equal SDPA's (float64), causal, 3 and 4 key heads' worth."""
    hq, hk, hv = heads
    g = torch.Generator().manual_seed(9)
    q = torch.randn(2, hq, 5, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(2, hk, 7, 8, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(2, hv, 7, 6, dtype=torch.float64, generator=g, requires_grad=True)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    if route == "attention":
        got = torch_ext.attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        with torch_ext.replace_sdpa():
            got = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    dout = torch.randn(want.shape, dtype=torch.float64, generator=g)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_gqa_head_counts_that_do_not_divide_raise() -> None:
    """Key or value heads that do not divide the query's still raise the op's error, naming them."""
    q = torch.randn(1, 6, 4, 8)
    with pytest.raises(ValueError, match="key and value must have the same number of heads, got 4 and 3"):
        torch_ext.attention(q, torch.randn(1, 4, 4, 8), torch.randn(1, 3, 4, 8), enable_gqa=True)
    with pytest.raises(ValueError, match="same number of heads, got 2 and 3"):  # (no GQA: no repeat)
        torch_ext.attention(q, torch.randn(1, 2, 4, 8), torch.randn(1, 3, 4, 8))


def test_torch_compile_fullgraph() -> None:
    """A model compiled with fullgraph=True inside replace_sdpa matches eager."""
    torch.manual_seed(0)
    model = TinyGPT()
    x = torch.randn(2, 11, 32)
    with torch_ext.replace_sdpa(scale="logn", train_length=8):
        eager = model(x)
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(eager, model(x), atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast(dtype: torch.dtype, device: str) -> None:
    """Under torch.autocast the drop-in behaves as SDPA, which autocast runs in its dtype: query and
    key rotated with float32 position tables next to a 16-bit value (a Llama-style block under
    autocast) are cast, and the output has the autocast dtype; the additive mask keeps its own.
    The same values as SDPA's under the same autocast."""
    g = torch.Generator().manual_seed(5)
    q, k = (torch.randn(2, 4, 9, 16, generator=g).to(device) for _ in range(2))
    v = torch.randn(2, 4, 9, 16, generator=g).to(device, dtype)
    mask = torch.randn(9, 9, generator=g).to(device)
    device_type = torch.device(device).type
    with torch.autocast(device_type, dtype=dtype):
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        with torch_ext.replace_sdpa():
            got = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        same = torch_ext.attention(q.float(), k.float(), v.float())
    assert got.dtype == want.dtype == dtype and same.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with torch.autocast(device_type, dtype=dtype):
        out = torch_ext.attention(*leaves, mask)
    out.float().sum().backward()
    assert [t.grad.dtype for t in leaves] == [torch.float32, torch.float32, dtype]


def test_sdpa_conventions_batch_broadcast_and_finfo_min_mask() -> None:
    """SDPA broadcasts a batch of 1; a finfo.min-filled float mask counts as masked (out of n_i),
    so that "logn" sees the same n_i as with the equivalent bool mask."""
    torch.manual_seed(0)
    q = torch.randn(1, 2, 5, 8, dtype=torch.float64)  # shared queries
    k, v = torch.randn(3, 2, 6, 8, dtype=torch.float64), torch.randn(3, 2, 6, 8, dtype=torch.float64)
    allowed = torch.rand(3, 1, 5, 6) < 0.6
    allowed[..., 0] = True
    additive = torch.zeros(3, 1, 5, 6, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    with torch_ext.replace_sdpa():
        torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed), sdpa)
    ref = torch_ext.attention(q.expand(3, -1, -1, -1), k, v, allowed, scale="logn", train_length=3)
    with torch_ext.replace_sdpa(scale="logn", train_length=3):
        torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, attn_mask=additive), ref)
        torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed), ref)
        with pytest.raises(ValueError, match="batch sizes"):
            F.scaled_dot_product_attention(q.expand(2, -1, -1, -1), k, v)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
def test_routed_on_device(device: str, dtype: torch.dtype, tol: float) -> None:
    """Routed calls on each device and dtype: scale None equals SDPA, "logn" equals torch_ext.attention."""
    torch.manual_seed(0)
    q, k, v = (t.detach().to(device, dtype) for t in qkv(H=4, Hkv=2, L=33, S=33, D=16))
    mask = (torch.rand(2, 1, 33, 33) < 0.8).to(device)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True)
    with torch_ext.replace_sdpa():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert out.dtype == dtype and out.device.type == device
    torch.testing.assert_close(out.double(), ref, atol=4 * tol, rtol=tol)
    with torch_ext.replace_sdpa(scale="logn", train_length=8):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    expected = torch_ext.attention(q, k, v, is_causal=True, enable_gqa=True, scale="logn", train_length=8)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_dropout_p_runs_in_the_op() -> None:
    """dropout_p is applied by the op: reproducible under torch.manual_seed, unbiased on average."""
    q, k, v = qkv()
    with torch_ext.replace_sdpa():
        torch.manual_seed(1)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
        torch.manual_seed(1)
        b = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
        plain = F.scaled_dot_product_attention(q, k, v)
        mean = torch.stack([F.scaled_dot_product_attention(q, k, v, dropout_p=0.5) for _ in range(300)]).mean(0)
    assert torch.equal(a, b) and not torch.equal(a, plain)
    assert (mean - plain).abs().max() < 0.25


def test_multihead_attention_warns_it_is_not_routed() -> None:
    """torch.nn.MultiheadAttention runs SDPA inside its functional form with the mode disabled: the
    mode says so once (a warning naming torch_ext.nn.MultiheadAttention) instead of silently
    leaving it on torch's attention."""
    mha = torch.nn.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(2, 5, 16)
    with torch_ext.replace_sdpa(scale="logn"):
        with pytest.warns(UserWarning, match="torch_ext.nn.MultiheadAttention"):
            mha(x, x, x, need_weights=False)


@pytest.mark.parametrize(
    "q_shape,kv_shape,mask_shape",
    [
        ((1, 2, 3, 4), (1, 2, 0, 4), (1, 1, 3, 0)),  # an empty cache with a padding mask
        ((2, 2, 0, 4), (2, 2, 5, 4), (2, 1, 0, 5)),  # no query rows
        ((2, 3, 4), (2, 0, 4), (2, 3, 0)),  # 3-D inputs
        ((2, 1, 2, 3, 4), (2, 1, 2, 0, 4), (2, 1, 1, 3, 0)),  # 5-D inputs
    ],
)
def test_empty_rows_or_keys_with_a_mask(q_shape: tuple, kv_shape: tuple, mask_shape: tuple) -> None:
    """Lq = 0 or Lk = 0 with a mask of 3 or more dims gives SDPA's zeros (the mask's reshape to the
    op's batch divided 0 elements by -1 and raised), and zero gradients."""
    q = torch.randn(q_shape, dtype=torch.float64, requires_grad=True)
    k = torch.randn(kv_shape, dtype=torch.float64, requires_grad=True)
    v = torch.randn(kv_shape, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(mask_shape, dtype=torch.float64)
    expected = F.scaled_dot_product_attention(q, k, v, mask)
    with torch_ext.replace_sdpa():
        out = F.scaled_dot_product_attention(q, k, v, mask)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    assert q.grad is not None and not q.grad.any()


def test_mask_with_is_causal_raises_as_sdpa() -> None:
    """SDPA refuses an explicit mask with is_causal=True: so does the mode, with SDPA's words."""
    q = torch.randn(1, 2, 3, 4)
    mask = torch.ones(3, 3, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="Explicit attn_mask should not be set when is_causal=True"):
        F.scaled_dot_product_attention(q, q, q, mask, is_causal=True)
    with torch_ext.replace_sdpa(), pytest.raises(RuntimeError, match="Explicit attn_mask should not be set"):
        F.scaled_dot_product_attention(q, q, q, mask, is_causal=True)


@pytest.mark.parametrize("lengths", [(3, 6), (6, 6), (6, 3)], ids=["lq<lk", "square", "lq>lk"])
@pytest.mark.parametrize("variant", ["upper_left", "lower_right"])
def test_causal_bias_masks(variant: str, lengths: tuple) -> None:
    """torch.nn.attention.bias's causal biases, which SDPA takes as attn_mask (a tensor subclass
    naming the variant; the mode ran before its __torch_function__ and read it as a float mask:
    outputs off by 3.3, or a broadcast error), run as the op's causality, aligned as SDPA aligns
    them; with GQA too. Rows that see no key (lower right with Lq > Lk: SDPA warns of NaN there)
    give 0, as the mode gives for any such row."""
    from torch.nn.attention.bias import causal_lower_right, causal_upper_left

    make = causal_upper_left if variant == "upper_left" else causal_lower_right
    lq, lk = lengths
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, lq, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, lk, 8, generator=g, dtype=torch.float64) for _ in range(2))
    with pytest.warns(UserWarning) if variant == "lower_right" and lq > lk else contextlib.nullcontext():
        bias = make(lq, lk)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
    with torch_ext.replace_sdpa():
        out = F.scaled_dot_product_attention(q, k, v, bias, enable_gqa=True)
        with pytest.raises(ValueError, match="CausalBias should not be used with causal=True"):
            F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=True, enable_gqa=True)
    seen = ~ref.isnan().any(-1)
    torch.testing.assert_close(out[seen], ref[seen], rtol=1e-12, atol=1e-12)
    assert torch.equal(out[~seen], torch.zeros_like(out[~seen]))
