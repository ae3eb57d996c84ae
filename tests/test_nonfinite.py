"""Non-finite inputs reach only the rows (and keys) that see them.

A NaN or infinity in a key or value that row i cannot see (masked, causally hidden, outside its
window or document) must not reach row i's output, statistics or gradients; one that row i sees
reaches it as the math says. SDPA does not give this (0 * NaN in P V turns every row NaN,
pytorch#101967); the kernels here do, on CPU (the CUDA kernels: see test_cuda.py).

Two independent checks per case:
* the rows and keys that cannot see the bad entry give exactly what they give when it is replaced
  by 0 (their math does not involve it at all);
* everything equals a float64 reference written so that hidden entries never enter a product
  (each row's keys and values are selected with torch.where before any arithmetic), NaN where the
  reference has NaN.
"""

from __future__ import annotations

import math

import pytest
import torch

import torch_ext
from reference import allowed_mask

NAN, INF = float("nan"), float("inf")


def safe_reference(q, k, v, allowed, lam, additive=None):
    """Output and lse in float64 with hidden keys selected away before any product.

    q (B, H, Lq, D), k (B, H, Lk, D), v (B, H, Lk, Dv), allowed (B, H, Lq, Lk) bool, lam (B, H, Lq).
    Every (row, key) pair gets its own copy of q_i, k_j, v_j (zeros where hidden), so that neither
    0 * NaN nor NaN + -inf can occur outside what a row sees; rows with no key give 0.
    """
    q, k, v = (t.to(torch.float64) for t in (q, k, v))
    vis = allowed.unsqueeze(-1)
    qb = torch.where(vis, q.unsqueeze(-2), 0.0)  # (B, H, Lq, Lk, D)
    kb = torch.where(vis, k.unsqueeze(-3), 0.0)
    vb = torch.where(vis, v.unsqueeze(-3), 0.0)
    s = lam.to(torch.float64).unsqueeze(-1) * (qb * kb).sum(-1)
    if additive is not None:
        s = s + torch.where(allowed, additive.to(torch.float64).expand_as(s), 0.0)
    has = allowed.any(-1, keepdim=True)
    s = torch.where(allowed, s, -INF)
    s = torch.where(has, s, 0.0)  # an empty row: finite logits, zeroed below
    p = torch.where(allowed, torch.softmax(s, -1), 0.0)
    out = (p.unsqueeze(-1) * vb).sum(-2)
    lse = torch.where(has.squeeze(-1), torch.logsumexp(s, -1), 0.0)
    return out, lse


def run_op(q, k, v, loss_weight, **kw):
    """Output, lse, entropy and the gradients of sum(w * out) + sum(lse)."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out, st = torch_ext.attention(q, k, v, return_stats=True, **kw)
    ((out * loss_weight).sum() + st.lse.sum()).backward()
    return out.detach(), st, (q.grad, k.grad, v.grad)


def run_reference(q, k, v, loss_weight, allowed, lam, additive=None):
    q, k, v = (t.detach().to(torch.float64).requires_grad_(True) for t in (q, k, v))
    out, lse = safe_reference(q, k, v, allowed, lam, additive)
    ((out * loss_weight.to(torch.float64)).sum() + lse.sum()).backward()
    return out.detach(), lse.detach(), (q.grad, k.grad, v.grad)


def case_inputs(dtype, B=1, H=2, Lq=9, Lk=9, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Lq, D, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(B, H, Lk, D, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(B, H, Lk, D, generator=g, dtype=torch.float64).to(dtype)
    w = torch.randn(B, H, Lq, D, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v, w


def assert_matches(name, actual, expected, tol):
    """Non-finite exactly where the reference is non-finite (an infinite logit may give inf or NaN:
    lse = +inf, or e^(inf - inf)), and close elsewhere."""
    actual = actual.to(torch.float64)
    bad = ~torch.isfinite(expected)
    assert torch.equal(~torch.isfinite(actual), bad), f"{name}: non-finite at {(~torch.isfinite(actual)).nonzero().tolist()}, expected at {bad.nonzero().tolist()}"
    torch.testing.assert_close(actual[~bad], expected[~bad], msg=lambda m: f"{name}: {m}", **tol)


def check_against_reference(q, k, v, w, allowed, additive=None, **kw):
    out, st, grads = run_op(q, k, v, w, **kw)
    lam = st.scale.to(torch.float64)
    r_out, r_lse, r_grads = run_reference(q, k, v, w, allowed, lam, additive)
    tol = dict(rtol=1e-5, atol=1e-5) if q.dtype != torch.float64 else dict(rtol=1e-9, atol=1e-9)
    assert_matches("output", out, r_out, tol)
    assert_matches("lse", st.lse, r_lse, tol)
    for name, a, b in zip(("dq", "dk", "dv"), grads, r_grads):
        assert_matches(name, a, b, tol)
    return out, st, grads


DTYPES = [torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("which", ["key", "value"])
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_causally_hidden_key_or_value(dtype, which, bad):
    """The issue's case: key/value row 3 non-finite under is_causal; rows 0-2 never see it."""
    q, k, v, w = case_inputs(dtype)
    (k if which == "key" else v)[0, 1, 3, 2] = bad
    allowed = allowed_mask(1, 2, 9, 9, None, True)
    out, st, (dq, dk, dv) = check_against_reference(q, k, v, w, allowed, is_causal=True)
    # Rows 0-2 of head 1 and all of head 0 are finite and equal the call with the entry zeroed.
    k0, v0 = k.clone(), v.clone()
    (k0 if which == "key" else v0)[0, 1, 3, 2] = 0
    out0, st0, (dq0, dk0, dv0) = run_op(q, k0, v0, w, is_causal=True)
    assert torch.isfinite(out[0, 1, :3]).all() and torch.isfinite(dq[0, 1, :3]).all()
    torch.testing.assert_close(out[0, :, :3], out0[0, :, :3], rtol=0, atol=0)
    torch.testing.assert_close(out[0, 0], out0[0, 0], rtol=0, atol=0)
    torch.testing.assert_close(st.lse[0, 1, :3], st0.lse[0, 1, :3], rtol=0, atol=0)
    torch.testing.assert_close(st.entropy[0, 1, :3], st0.entropy[0, 1, :3], rtol=0, atol=0)
    torch.testing.assert_close(dq[0, 1, :3], dq0[0, 1, :3], rtol=0, atol=0)
    torch.testing.assert_close(dq[0, 0], dq0[0, 0], rtol=0, atol=0)
    # Row 3 and later see it: a NaN value makes their output NaN in that column.
    if which == "value" and bad != bad:
        assert torch.isnan(out[0, 1, 3:, 2]).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
def test_masked_nan_key_and_value(dtype, mask_kind):
    """Key/value 1 NaN and masked for every row; row 2 fully masked: all finite, row 2 zero."""
    q, k, v, w = case_inputs(dtype)
    k[0, :, 1] = NAN
    v[0, :, 1] = NAN
    allow = torch.ones(9, 9, dtype=torch.bool)
    allow[:, 1] = False
    allow[2, :] = False
    mask = allow if mask_kind == "bool" else torch.zeros(9, 9, dtype=dtype).masked_fill(~allow, -INF)
    allowed = allowed_mask(1, 2, 9, 9, mask, False)
    additive = None if mask_kind == "bool" else mask.masked_fill(~allow, 0)
    out, st, grads = check_against_reference(q, k, v, w, allowed, additive, attn_mask=mask)
    for t in (out, st.lse, st.entropy, st.sparsity, st.effective_keys, *grads):
        assert torch.isfinite(t).all()
    assert (out[0, :, 2] == 0).all() and (st.lse[0, :, 2] == 0).all()
    assert (grads[0][0, :, 2] == 0).all()  # the fully masked row's dq
    assert (grads[1][0, :, 1] == 0).all() and (grads[2][0, :, 1] == 0).all()  # the unseen key


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_query_and_upstream_gradient_reach_only_seen_keys(dtype):
    """dK and dV sum over rows: a NaN query row or dO row must reach only the keys it sees."""
    q, k, v, w = case_inputs(dtype)
    q[0, 0, 0, 3] = NAN  # row 0 sees key 0 only (causal)
    w[0, 1, 1, 0] = NAN  # dO of row 1 of head 1: keys 0 and 1
    allowed = allowed_mask(1, 2, 9, 9, None, True)
    _, _, (dq, dk, dv) = check_against_reference(q, k, v, w, allowed, is_causal=True)
    assert torch.isfinite(dk[0, 0, 1:]).all() and torch.isnan(dk[0, 0, 0]).any()
    assert torch.isfinite(dv[0, 1, 2:]).all() and torch.isnan(dv[0, 1, :2]).any()
    assert torch.isfinite(dq[0, 0, 1:]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_across_blocks_window_and_gqa(dtype):
    """Long enough for several key and query blocks (512 keys, 64 rows), a sliding window and
    GQA: the NaN value of key 600 reaches only rows 600 .. 600 + 100 (window (100, 0))."""
    q, k, v, w = case_inputs(torch.float32, B=1, H=4, Lq=900, Lk=900, D=16)
    k, v = k[:, :2].contiguous(), v[:, :2].contiguous()
    q, k, v, w = (t.to(dtype) for t in (q, k, v, w))
    v[0, 1, 600] = NAN
    k[0, 0, 100] = NAN
    out, _, (dq, dk, dv) = run_op(q, k, v, w, window_size=(100, 0), enable_gqa=True)
    seen_v = torch.zeros(900, dtype=torch.bool)
    seen_v[600:701] = True
    seen_k = torch.zeros(900, dtype=torch.bool)
    seen_k[100:201] = True
    # Query heads 2, 3 use kv head 1 (the NaN value), heads 0, 1 kv head 0 (the NaN key).
    assert torch.isnan(out[0, 2:, seen_v]).all() and torch.isfinite(out[0, 2:, ~seen_v]).all()
    assert torch.isnan(out[0, :2, seen_k]).all() and torch.isfinite(out[0, :2, ~seen_k]).all()
    assert torch.isfinite(dq[0, :2, ~seen_k]).all() and torch.isfinite(dq[0, 2:, ~seen_v]).all()
    # The poisoned rows (NaN output, so NaN dS) give NaN to the keys they see and no other.
    assert torch.isnan(dk[0, 0, :201]).all() and torch.isfinite(dk[0, 0, 201:]).all()
    assert torch.isnan(dk[0, 1, 500:701]).all()
    assert torch.isfinite(dk[0, 1, :500]).all() and torch.isfinite(dk[0, 1, 701:]).all()
    assert torch.isfinite(dv[0, 1]).all()  # dV = P^T dO involves no value


def test_documents_of_a_packed_batch():
    """A NaN in one document's values stays in that document (varlen attention)."""
    g = torch.Generator().manual_seed(1)
    cu = torch.tensor([0, 5, 12, 20], dtype=torch.int32)
    q, k, v = (torch.randn(20, 2, 8, generator=g) for _ in range(3))
    v[7, 1] = NAN  # document 1, head 1
    out = torch_ext.varlen_attention(q, k, v, cu, cu, 8, 8, is_causal=True)
    bad = torch.isnan(out).any(-1)  # (tokens, heads)
    expected = torch.zeros(20, 2, dtype=torch.bool)
    expected[7:12, 1] = True  # causal rows 7 .. 11 of document 1 see token 7
    assert torch.equal(bad, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softcap_keeps_a_hidden_nan_key_out(dtype):
    """With logit softcapping the backward takes the cap's derivative at each score, NaN for a NaN key:
    rows that do not see the key must keep dS = 0 for it (0 * NaN), so their dq equals the call's
    with the key zeroed (it was NaN on the CPU before)."""
    q, k, v, w = case_inputs(dtype)
    k[0, 1, 3, 2] = NAN
    k0 = k.clone()
    k0[0, 1, 3, 2] = 0
    out, _, (dq, _, _) = run_op(q, k, v, w, is_causal=True, softcap=5.0)
    out0, _, (dq0, _, _) = run_op(q, k0, v, w, is_causal=True, softcap=5.0)
    assert torch.isfinite(dq[0, 1, :3]).all() and torch.isfinite(dq[0, 0]).all()
    torch.testing.assert_close(out[0, 1, :3], out0[0, 1, :3], rtol=0, atol=0)
    torch.testing.assert_close(dq[0, 1, :3], dq0[0, 1, :3], rtol=0, atol=0)
    torch.testing.assert_close(dq[0, 0], dq0[0, 0], rtol=0, atol=0)
    assert torch.isnan(dq[0, 1, 3:]).all()  # the rows that see it


def test_dropout_keeps_hidden_values_out():
    q, k, v, w = case_inputs(torch.float32, Lq=40, Lk=40)
    v[0, :, 30] = NAN
    out, _, (dq, dk, dv) = run_op(q, k, v, w, is_causal=True, dropout_p=0.3,
                                  generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(out[0, :, :30]).all() and torch.isfinite(dq[0, :, :30]).all()


def test_sdpa_drop_in_hidden_nan():
    """Through the SDPA-compatible path (as a model calls it)."""
    q, k, v = (torch.randn(1, 1, 4, 8) for _ in range(3))
    v[0, 0, 3] = NAN
    with torch_ext.replace_sdpa():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.isfinite(out[0, 0, :3]).all() and torch.isnan(out[0, 0, 3]).all()
    assert math.isfinite(float(out[0, 0, :3].sum()))


def test_nan_row_scale_reaches_only_seen_keys():
    """A NaN in a per-row scale tensor poisons its row, and dK only of the keys that row sees:
    lambda_i enters dK through (lambda dS)^T Q, where the row's hidden keys have dS = 0."""
    q, k, v, w = case_inputs(torch.float64)
    scale = torch.full((1, 2, 9), 0.3, dtype=torch.float64)
    scale[0, 0, 0] = NAN  # row 0 sees key 0 only (causal)
    allowed = allowed_mask(1, 2, 9, 9, None, True)
    out, _, (dq, dk, dv) = check_against_reference(q, k, v, w, allowed, is_causal=True, scale=scale)
    assert torch.isnan(out[0, 0, 0]).all() and torch.isfinite(out[0, 0, 1:]).all()
    assert torch.isnan(dk[0, 0, 0]).any() and torch.isfinite(dk[0, 0, 1:]).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_decoding_blocks_keep_hidden_values_out(dtype, heads):
    """One token against a cache of 1100 keys (three key blocks, converted and transposed block by
    block as the forward streams them: csrc/cpu/attention_fwd.cpp, transposes_key_blocks): a NaN
    value at a masked key in the second block reaches no output, and at an allowed key exactly the
    output columns of the rows that see it; the rest matches the float64 reference."""
    H, Hkv = heads
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, H, 1, 16, generator=g).to(dtype)
    cache = torch.randn(2, Hkv, 1200, 16, generator=g).to(dtype)
    k, v = cache[:, :, :1100], torch.randn(2, Hkv, 1100, 8, generator=g).to(dtype)
    allow = torch.rand(2, 1, 1, 1100, generator=g) < 0.9
    allow[0, ..., 700] = False
    v = v.clone()
    v[0, 0, 700, 3] = NAN
    out = torch_ext.attention(q, k, v, allow, enable_gqa=True)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double().nan_to_num(0), allow, enable_gqa=True)
    assert torch.isfinite(out).all()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    allow[0, ..., 700] = True
    out = torch_ext.attention(q, k, v, allow, enable_gqa=True)
    seeing = torch.zeros(2, H, dtype=torch.bool)
    seeing[0, : H // Hkv] = True  # the query heads of key/value head 0 in batch 0
    assert torch.isnan(out[..., 0, 3])[seeing].all() and not torch.isnan(out[..., 0, 3])[~seeing].any()
    assert not torch.isnan(out[..., [0, 1, 2, 4, 5, 6, 7]]).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("q_len", [1, 300])
def test_strided_values_flagged_block_by_block(dtype, q_len):
    """Float values are read as given and their rows flagged a block at a time, just before the
    block's product (csrc/cpu/row_kernels.cpp: flag_nonfinite_rows, all rows at once in 16 lanes,
    then row by row where a lane is NaN): with V a transposed (B, L, H, Dv) view (rows H * Dv apart)
    and Dv = 40 (two whole lanes and a remainder), an infinity in the remainder of a masked key's row
    reaches no output, and at an allowed key exactly that output column."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, q_len, 16, generator=g, dtype=dtype)
    k = torch.randn(1, 2, 1100, 16, generator=g, dtype=dtype)
    v = torch.randn(1, 1100, 2, 40, generator=g, dtype=dtype)
    v[0, 900, 1, 37] = float("inf")
    v = v.transpose(1, 2)
    allow = torch.ones(1, 1, 1, 1100, dtype=torch.bool)
    allow[..., 900] = False
    out = torch_ext.attention(q, k, v, allow)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v.nan_to_num(0, 0, 0), allow)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref)
    allow[..., 900] = True
    out = torch_ext.attention(q, k, v, allow)
    assert not torch.isfinite(out[0, 1, :, 37]).any() and torch.isfinite(out[0, 0]).all()
    assert torch.isfinite(out[0, 1, :, :37]).all() and torch.isfinite(out[0, 1, :, 38:]).all()
