"""torch_ext.nn.MultiheadAttention against torch.nn.MultiheadAttention with the same weights, and its
scale policies against a plain float64 formula."""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

import pytest
import torch
import torch.nn.functional as F

import torch_ext
from conftest import DEVICES

E, H = 16, 4
B, L, S = 3, 5, 6


def pair(**kw: Any) -> tuple[torch.nn.MultiheadAttention, torch_ext.nn.MultiheadAttention]:
    """A torch MHA with random weights and ours loaded from its state_dict (float64)."""
    ref = torch.nn.MultiheadAttention(E, H, **kw).double()
    with torch.no_grad():  # nonzero biases, so that a wrongly split in_proj_bias shows
        for name, p in ref.named_parameters():
            if "bias" in name:
                p.normal_()
    ours = torch_ext.nn.MultiheadAttention(E, H, **kw).double()
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def inputs(batch_first: bool, kdim: int = E, vdim: int = E, batched: bool = True) -> list[torch.Tensor]:
    def make(n: int, e: int) -> torch.Tensor:
        shape = ((B, n, e) if batch_first else (n, B, e)) if batched else (n, e)
        return torch.randn(shape, dtype=torch.float64, requires_grad=True)

    return [make(L, E), make(S, kdim), make(S, vdim)]


def masks(kind: str) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    am = torch.rand(L, S, generator=g) < 0.3
    am[:, 0] = False
    kpm = torch.rand(B, S, generator=g) < 0.3
    kpm[:, 1] = False
    return {
        "none": {},
        "attn_bool": {"attn_mask": am},
        "attn_float": {"attn_mask": torch.randn(L, S, generator=g, dtype=torch.float64)},
        "attn_3d": {"attn_mask": torch.rand(B * H, L, S, generator=g) < 0.3},
        "kpm_bool": {"key_padding_mask": kpm},
        "kpm_float": {"key_padding_mask": kpm.double() * -3.0},
        "both_bool": {"attn_mask": am, "key_padding_mask": kpm},
        "mixed": {"attn_mask": torch.randn(L, S, generator=g, dtype=torch.float64), "key_padding_mask": kpm},
    }[kind]


def grads(out: torch.Tensor, tensors: list[torch.Tensor]) -> list[Optional[torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return torch.autograd.grad((out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum(), tensors)


def assert_close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-10) -> None:
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)


@pytest.mark.filterwarnings("ignore:Support for mismatched")
@pytest.mark.parametrize("mask", ["none", "attn_bool", "attn_float", "attn_3d", "kpm_bool", "kpm_float", "both_bool", "mixed"])
@pytest.mark.parametrize(
    "config",
    [{}, {"batch_first": True}, {"kdim": 5, "vdim": 7}, {"bias": False}, {"add_bias_kv": True}, {"add_zero_attn": True}],
    ids=["default", "batch_first", "kdim_vdim", "no_bias", "bias_kv", "zero_attn"],
)
@pytest.mark.parametrize("need_weights", [False, True])
def test_matches_torch(config: Dict[str, Any], mask: str, need_weights: bool) -> None:
    """Same outputs, weights and gradients (inputs and every parameter) as torch, float64."""
    torch.manual_seed(0)
    ref, ours = pair(**config)
    q, k, v = inputs(config.get("batch_first", False), config.get("kdim", E), config.get("vdim", E))
    kw = masks(mask)
    r_out, r_w = ref(q, k, v, need_weights=need_weights, **kw)
    o_out, o_w = ours(q, k, v, need_weights=need_weights, **kw)
    assert_close(o_out, r_out)
    if need_weights:
        assert_close(o_w, r_w)
    else:
        assert o_w is None and r_w is None
    params = [p for _, p in sorted(ref.named_parameters())]
    our_params = [p for _, p in sorted(ours.named_parameters())]
    for a, b in zip(grads(o_out, [q, k, v] + our_params), grads(r_out, [q, k, v] + params)):
        assert_close(a, b)


@pytest.mark.parametrize("batch_first", [False, True])
def test_per_head_weights_unbatched_and_causal(batch_first: bool) -> None:
    """average_attn_weights=False, unbatched inputs, and is_causal with its mask."""
    torch.manual_seed(0)
    ref, ours = pair(batch_first=batch_first)
    q, k, v = inputs(batch_first)
    r = ref(q, k, v, average_attn_weights=False)
    o = ours(q, k, v, average_attn_weights=False)
    assert o[1].shape == (B, H, L, S)
    assert_close(o[0], r[0]), assert_close(o[1], r[1])
    x = inputs(batch_first, batched=False)
    assert_close(ours(*x)[0], ref(*x)[0]), assert_close(ours(*x)[1], ref(*x)[1])
    per_head = torch.rand(H, L, S) < 0.3  # unbatched 3-D mask: (num_heads, L, S)
    per_head[..., 0] = False
    assert_close(ours(*x, attn_mask=per_head)[0], ref(*x, attn_mask=per_head)[0])
    causal = torch.ones(L, L, dtype=torch.bool).triu(1)
    x = inputs(batch_first)[0]
    r_out, _ = ref(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)
    o_out, _ = ours(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)
    assert_close(o_out, r_out)
    o_none, _ = ours(x, x, x, is_causal=True, need_weights=False)  # torch requires the mask; we don't
    assert_close(o_none, r_out)


def test_weights_agree_with_output_under_finfo_min_masks() -> None:
    """A float mask filled with finfo.min (how many models pad) hides its keys in the output and
    in the returned weights alike: a row hidden entirely has output 0 and weights 0 (torch: the
    uniform mean of the values, and uniform weights), and every row's output is its weights times
    the values."""
    torch.manual_seed(0)
    _, ours = pair(batch_first=True)
    x = torch.randn(1, L, E, dtype=torch.float64)
    am = torch.zeros(L, L, dtype=torch.float64)
    am[1] = torch.finfo(torch.float64).min
    am[3, :2] = torch.finfo(torch.float64).min
    out, w = ours(x, x, x, attn_mask=am, average_attn_weights=False)
    assert (w[0, :, 1] == 0).all()
    assert (w[0, :, 3, :2] == 0).all() and torch.allclose(w[0, :, 3].sum(-1), torch.ones(H, dtype=torch.float64))
    v = F.linear(x, ours.in_proj_weight[2 * E :], ours.in_proj_bias[2 * E :]).view(1, L, H, E // H).transpose(1, 2)
    expected = ours.out_proj((w @ v).transpose(1, 2).flatten(2))
    assert_close(out, expected)


@pytest.mark.parametrize("mask", ["kpm_float", "attn_inf", "attn_finfo_min", "attn_bool"])
def test_weights_of_hidden_rows_have_zero_gradient(mask: str) -> None:
    """The weights of a row whose keys are all hidden are constant 0, so a loss on the returned
    weights gives finite gradients equal to those of the same loss over the other rows: float
    masks (-inf, finfo.min) gave NaN in the projections' gradients (the softmax's NaN, zeroed after
    it, still reached the backward)."""
    torch.manual_seed(0)
    _, ours = pair(batch_first=True)
    x = torch.randn(2, L, E, dtype=torch.float64)
    hide = torch.zeros(L, L, dtype=torch.bool)
    hide[1] = True
    kw = {
        "kpm_float": dict(key_padding_mask=torch.tensor([[0.0] * L, [-math.inf] * L], dtype=torch.float64)),
        "attn_inf": dict(attn_mask=torch.zeros(L, L, dtype=torch.float64).masked_fill(hide, -math.inf)),
        "attn_finfo_min": dict(attn_mask=torch.zeros(L, L, dtype=torch.float64).masked_fill(hide, -1.7e308)),
        "attn_bool": dict(attn_mask=~hide),
    }[mask]
    _, w = ours(x, x, x, average_attn_weights=False, **kw)
    hidden = w.detach().sum(-1) == 0
    assert hidden.any() and (w.detach()[hidden] == 0).all()
    w.pow(2).sum().backward()
    grads = [p.grad.clone() for p in ours.parameters() if p.grad is not None]
    assert grads and all(g.isfinite().all() for g in grads)
    ours.zero_grad()
    _, w = ours(x, x, x, average_attn_weights=False, **kw)
    w[~hidden].pow(2).sum().backward()  # the same loss without the hidden rows' zeros
    for g, p in zip(grads, (p for p in ours.parameters() if p.grad is not None)):
        assert_close(g, p.grad)


def test_float16_weights_where_the_unscaled_product_overflows() -> None:
    """need_weights=True forms the logits in float32: in float16 the unscaled q . k overflows
    (65504) where lambda q . k does not, and such rows' weights came out 0 instead of one-hot
    (torch scales q first and gets them right; an outside audit's repro: q . k = 8e4, lambda q . k
    = 1e4)."""
    torch.manual_seed(0)
    ref, ours = pair(batch_first=True)
    with torch.no_grad():
        ours.in_proj_weight.mul_(150.0)
        ours.in_proj_bias.zero_()
    x = torch.randn(1, L, E, dtype=torch.float64)
    _, expected = ours(x, x, x, average_attn_weights=False)
    half = ours.half()
    _, w = half(x.half(), x.half(), x.half(), average_attn_weights=False)
    q = F.linear(x.half(), half.in_proj_weight[:E]).view(1, L, H, E // H).transpose(1, 2)
    assert (q.double() @ q.double().transpose(-1, -2)).abs().max() > 65504  # the product overflows
    assert (expected.amax(-1) > 0.99).any()  # rows of one dominant key
    torch.testing.assert_close(w.double(), expected, atol=5e-3, rtol=0)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2), (torch.float16, 3e-3)])
def test_low_precision(dtype: torch.dtype, tol: float) -> None:
    torch.manual_seed(0)
    ref, ours = pair(batch_first=True)
    ref, ours = ref.to(dtype), ours.to(dtype)
    q = torch.randn(B, L, E, dtype=dtype)
    kpm = masks("kpm_bool")["key_padding_mask"][:, :L]
    r, _ = ref.double()(q.double(), q.double(), q.double(), key_padding_mask=kpm, need_weights=False)
    o, _ = ours(q, q, q, key_padding_mask=kpm, need_weights=False)
    assert o.dtype == dtype
    torch.testing.assert_close(o.double(), r, atol=tol * 4, rtol=tol)


def test_state_dict_compatible() -> None:
    """Same keys as torch; torch's state_dict loads strictly, also into a learnable-scale module."""
    for kw in ({}, {"kdim": 5, "vdim": 7}, {"add_bias_kv": True}, {"bias": False}):
        ref = torch.nn.MultiheadAttention(E, H, **kw)
        ours = torch_ext.nn.MultiheadAttention(E, H, **kw)
        assert list(ours.state_dict()) == list(ref.state_dict())
        ref.load_state_dict(ours.state_dict())
        learn = torch_ext.nn.MultiheadAttention(E, H, learnable_scale=True, **kw)
        assert set(learn.state_dict()) == set(ref.state_dict()) | {"head_scale"}
        learn.load_state_dict(ref.state_dict())  # strict: head_scale keeps its initial 1
        assert torch.equal(learn.head_scale, torch.ones(H))
        learn.load_state_dict({**ref.state_dict(), "head_scale": torch.full((H,), 2.0)})
        assert torch.equal(learn.head_scale, torch.full((H,), 2.0))
    assert isinstance(torch_ext.nn.MultiheadAttention(E, H), torch.nn.MultiheadAttention)


def test_head_scale_from_the_meta_device() -> None:
    """Built on the meta device, a learnable-scale module gets head_scale = 1 from a strict
    ``load_state_dict(torch's, assign=True)`` (it stayed on the meta device, and the forward raised)
    and from ``to_empty()`` + ``_reset_parameters()`` (it held whatever memory to_empty gave)."""
    for kw in ({}, {"kdim": 5, "vdim": 7}):
        ref = torch.nn.MultiheadAttention(E, H, batch_first=True, **kw)
        with torch.device("meta"):
            ours = torch_ext.nn.MultiheadAttention(E, H, batch_first=True, learnable_scale=True, **kw)
        ours.load_state_dict(ref.state_dict(), strict=True, assign=True)
        assert all(not p.is_meta for p in ours.parameters())
        assert torch.equal(ours.head_scale, torch.ones(H))
        x, kv = torch.randn(2, 3, E), torch.randn(2, 4, kw.get("kdim", E))
        v = torch.randn(2, 4, kw.get("vdim", E))
        torch.testing.assert_close(ours(x, kv, v, need_weights=False)[0], ref(x, kv, v, need_weights=False)[0])
    with torch.device("meta"):
        ours = torch_ext.nn.MultiheadAttention(E, H, learnable_scale=True, dtype=torch.float64)
    ours.to_empty(device="cpu")
    ours._reset_parameters()
    assert torch.equal(ours.head_scale, torch.ones(H, dtype=torch.float64))


def plain_mha(
    m: torch.nn.MultiheadAttention, x: torch.Tensor, allowed: torch.Tensor, scale_of_n: Any, head_scale: Any = None
) -> torch.Tensor:
    """Batch-first self-attention written out: lambda_i = scale_of_n(n_i) * head_scale_h, with n_i the
    number of allowed keys of row i (allowed: (B, 1, L, S) bool)."""
    w, b = m.in_proj_weight, m.in_proj_bias
    q, k, v = (F.linear(x, w[i * E : (i + 1) * E], b[i * E : (i + 1) * E]) for i in range(3))
    q, k, v = (t.unflatten(-1, (H, E // H)).transpose(1, 2) for t in (q, k, v))
    nonempty = allowed.any(-1, keepdim=True)  # rows with no allowed key: output 0, no NaN gradient
    n = allowed.sum(-1, keepdim=True).double().clamp_min(1)  # (B, 1, L, 1)
    lam = scale_of_n(n)
    if head_scale is not None:
        lam = lam * head_scale.view(1, H, 1, 1)
    logits = (lam * (q @ k.transpose(-1, -2))).masked_fill(~(allowed | ~nonempty), float("-inf"))
    out = (torch.softmax(logits, -1) * nonempty) @ v
    return m.out_proj(out.transpose(1, 2).flatten(2))


@pytest.mark.parametrize("policy", ["logn", "logn_sharpen", "float", "temperature"])
@pytest.mark.parametrize("learnable", [False, True])
def test_policies_match_plain_formula(policy: str, learnable: bool) -> None:
    """Scale policies (and the learnable per-head scale, with its gradient) against the formula,
    with causal + key padding so that n_i varies per row and batch."""
    torch.manual_seed(0)
    d = E // H
    b = 3.0
    kw, scale_of_n = {
        "logn": ({"scale": "logn", "train_length": b}, lambda n: torch.log(n) / math.log(b) / math.sqrt(d)),
        "logn_sharpen": (
            {"scale": "logn_sharpen", "train_length": b},
            lambda n: torch.clamp(torch.log(n) / math.log(b), min=1) / math.sqrt(d),
        ),
        "float": ({"scale": 0.7}, lambda n: torch.full_like(n, 0.7)),
        "temperature": ({"temperature": 2.5}, lambda n: torch.full_like(n, 1 / math.sqrt(d) / 2.5)),
    }[policy]
    ours = torch_ext.nn.MultiheadAttention(E, H, batch_first=True, learnable_scale=learnable, **kw).double()
    if learnable:
        with torch.no_grad():
            ours.head_scale.copy_(torch.tensor([0.5, 1.0, 1.5, 2.0]))
    x = torch.randn(B, L, E, dtype=torch.float64, requires_grad=True)
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[1, 3:] = True
    kpm[2, :2] = True
    out, _ = ours(x, x, x, key_padding_mask=kpm, is_causal=True, need_weights=False)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    allowed = causal.view(1, 1, L, L) & ~kpm.view(B, 1, 1, L)
    ref = plain_mha(ours, x, allowed, scale_of_n, ours.head_scale)
    assert_close(out, ref)
    if learnable:
        (g_ours,) = torch.autograd.grad(out.sum(), [ours.head_scale])
        (g_ref,) = torch.autograd.grad(ref.sum(), [ours.head_scale])
        assert_close(g_ours, g_ref)
        _, w = ours(x, x, x, key_padding_mask=kpm, is_causal=True)  # the weights carry its gradient too
        (g_w,) = torch.autograd.grad((w * torch.randn_like(w)).sum(), [ours.head_scale])
        assert g_w.abs().sum() > 0
    if policy == "logn":  # a test that can fail: logn differs from the standard scale
        std = torch_ext.nn.MultiheadAttention(E, H, batch_first=True).double()
        std.load_state_dict(ours.state_dict(), strict=False)
        assert not torch.allclose(std(x, x, x, need_weights=False)[0], ours(x, x, x, need_weights=False)[0])


def test_inside_transformer_encoder_layer_eval() -> None:
    """nn.TransformerEncoderLayer's inference fast path would bypass self_attn.forward: it must not."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(E, H, dim_feedforward=32, dropout=0.0, batch_first=True)
    ref_out_layer = torch.nn.TransformerEncoderLayer(E, H, dim_feedforward=32, dropout=0.0, batch_first=True)
    ref_out_layer.load_state_dict(layer.state_dict())
    ours = torch_ext.nn.MultiheadAttention(E, H, batch_first=True, scale="logn", train_length=2)
    ours.load_state_dict(layer.self_attn.state_dict())
    layer.self_attn = ours
    layer.eval(), ref_out_layer.eval()
    x = torch.randn(B, L, E)
    with torch.no_grad():
        got = layer(x)
        std = ref_out_layer(x)
    assert not torch.allclose(got, std, atol=1e-4)  # our forward ran (logn differs from 1/sqrt(d))
    ours.policy = torch_ext.AttentionPolicy()
    with torch.no_grad():
        torch.testing.assert_close(layer(x), std, atol=2e-5, rtol=2e-5)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_errors() -> None:
    m = torch_ext.nn.MultiheadAttention(E, H, dropout=0.1, batch_first=True)
    x = torch.randn(B, L, E)
    with pytest.raises(ValueError, match="attn_mask"):
        m(x, x, x, attn_mask=torch.zeros(L, L + 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_padding_mask"):
        m(x, x, x, key_padding_mask=torch.zeros(B, L + 1, dtype=torch.bool))
    # integer masks (the legacy "1 = padding" uint8 convention was added as a +1 logit offset)
    for dtype in (torch.uint8, torch.int64):
        with pytest.raises(TypeError, match="attn_mask"):
            m(x, x, x, attn_mask=torch.zeros(L, L, dtype=dtype))
        with pytest.raises(TypeError, match="key_padding_mask"):
            m(x, x, x, key_padding_mask=torch.zeros(B, L, dtype=dtype))
    with pytest.raises(ValueError, match="scale"):
        torch_ext.nn.MultiheadAttention(E, H, scale="log")
    with pytest.raises(ValueError, match="temperature"):
        torch_ext.nn.MultiheadAttention(E, H, temperature=0.0)
    with pytest.raises(ValueError, match="nested"):
        nt = torch.nested.nested_tensor([torch.randn(2, E), torch.randn(3, E)])
        m(nt, nt, nt)
    # (torch raises too: no broadcasting of a batch of 1, as SDPA would do; attend() does it)
    for q, kv in ((x, x[:1]), (x[:1], x)):
        with pytest.raises(ValueError, match="same batch size"):
            m(q, kv, kv)
    with pytest.raises(ValueError, match="same sequence length"):
        m(x, x, x[:, :-1])
    with pytest.raises(ValueError, match="kdim=16 and vdim=16"):
        m(x, torch.randn(B, L, E + 1), x)
    with pytest.raises(ValueError, match="unbatched inputs must be 1-D"):
        m(x[0], x[0], x[0], key_padding_mask=torch.zeros(1, L, dtype=torch.bool))
    # (truthiness read is_causal="False" as True and applied causality)
    for flag in ("False", 0.0, None):
        with pytest.raises(TypeError, match="^is_causal must be a bool"):
            m(x, x, x, is_causal=flag)


@pytest.mark.parametrize("extra", [{}, {"add_bias_kv": True}, {"add_zero_attn": True}])
@pytest.mark.parametrize("need_weights", [False, True])
def test_is_causal_keeps_what_the_mask_adds(extra: Dict[str, Any], need_weights: bool) -> None:
    """is_causal applies causality on top of attn_mask: with a causal mask that also carries a bias
    (ALiBi-like) or hides more keys, and with a padding mask, the output is torch's from the same
    mask (its need_weights=True path, which reads the mask: its other path would drop the bias);
    the keys add_bias_kv and add_zero_attn append stay visible to every row. (It discarded the mask
    before: the bias was lost.)"""
    torch.manual_seed(3)
    ref, ours = pair(batch_first=True, **extra)
    x = torch.randn(B, L, E, dtype=torch.float64)
    causal = torch.ones(L, L, dtype=torch.bool).triu(1)
    bias = torch.randn(L, L, dtype=torch.float64).masked_fill(causal, float("-inf"))
    more = causal.clone()
    more[2:, 1] = True  # also hides key 1 from rows 2 and later
    padding = torch.zeros(B, L, dtype=torch.bool)
    padding[1, -1] = True
    for mask in (causal, bias, more):
        for kpm in (None, padding):
            r_out, _ = ref(x, x, x, attn_mask=mask, key_padding_mask=kpm, is_causal=True)
            o_out, _ = ours(x, x, x, attn_mask=mask, key_padding_mask=kpm, is_causal=True, need_weights=need_weights)
            assert_close(o_out, r_out)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_matches_torch_on_device(device: str, dtype: torch.dtype, tol: float) -> None:
    """On each device: outputs and input gradients against torch's float64 result, with masks."""
    torch.manual_seed(0)
    ref, ours = pair(batch_first=True)
    ours = ours.to(device, dtype)
    x = torch.randn(B, L, E, dtype=torch.float64, requires_grad=True)
    kw = {"key_padding_mask": masks("kpm_bool")["key_padding_mask"][:, :L], "attn_mask": masks("attn_bool")["attn_mask"][:, :L]}
    r, _ = ref(x, x, x, need_weights=False, **kw)
    xd = x.detach().to(device, dtype).requires_grad_()
    o, _ = ours(xd, xd, xd, need_weights=False, **{k: v.to(device) for k, v in kw.items()})
    torch.testing.assert_close(o.double().cpu(), r, atol=4 * tol, rtol=tol)
    g = torch.randn_like(r)
    (gr,) = torch.autograd.grad(r, x, g)
    (go,) = torch.autograd.grad(o, xd, g.to(device, dtype))
    assert (go.double().cpu() - gr).norm() <= 4 * tol * gr.norm()


def test_dropout_in_training_only() -> None:
    """Attention dropout runs in training mode (reproducible under torch.manual_seed, gradients
    flow), and eval mode is the plain op."""
    m = torch_ext.nn.MultiheadAttention(E, H, dropout=0.3, batch_first=True)
    x = torch.randn(B, L, E, requires_grad=True)
    torch.manual_seed(5)
    a, _ = m(x, x, x, need_weights=False)
    torch.manual_seed(5)
    b, _ = m(x, x, x, need_weights=False)
    c, _ = m(x, x, x, need_weights=False)
    assert torch.equal(a, b) and not torch.equal(a, c)
    a.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    m.eval()
    torch.testing.assert_close(m(x, x, x, need_weights=False)[0], torch_ext.nn.MultiheadAttention.forward(m, x, x, x, need_weights=False)[0])
    ref = torch.nn.MultiheadAttention(E, H, dropout=0.3, batch_first=True).eval()
    ref.load_state_dict(m.state_dict(), strict=False)
    torch.testing.assert_close(m(x, x, x, need_weights=False)[0], ref(x, x, x, need_weights=False)[0], atol=2e-5, rtol=2e-5)


def test_dropout_one_drops_every_weight() -> None:
    """dropout=1.0 in training drops every weight, as in torch's module (the output is out_proj's
    bias; the op takes p < 1, and the module raised naming its "dropout_p"), with and without
    weights and on jagged inputs; eval mode is the plain op. Outside [0, 1] it raises naming
    `dropout`."""
    ref, ours = pair(dropout=1.0, batch_first=True)
    x = torch.randn(B, L, E, dtype=torch.float64, requires_grad=True)
    for need_weights in (False, True):
        want, got = ref(x, x, x, need_weights=need_weights)[0], ours(x, x, x, need_weights=need_weights)[0]
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got, ours.out_proj.bias.expand_as(got))
    got.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    jagged = torch.nested.nested_tensor([torch.randn(3, E), torch.randn(5, E)], layout=torch.jagged,
                                        dtype=torch.float64)
    out, _ = ours(jagged, jagged, jagged, need_weights=False)
    for row in out.unbind():
        torch.testing.assert_close(row, ours.out_proj.bias.expand_as(row))
    ref.eval(), ours.eval()
    torch.testing.assert_close(ours(x, x, x)[0], ref(x, x, x)[0], atol=2e-5, rtol=2e-5)
    bad = torch_ext.nn.MultiheadAttention(E, H, dropout=1.5, batch_first=True).double()
    with pytest.raises(ValueError, match=r"^dropout must be in \[0, 1\], got 1.5"):
        bad(x, x, x)


@pytest.mark.parametrize("policy", [None, "logn"])
def test_weights_gradient_reaches_a_zero_head_scale(policy: Optional[str]) -> None:
    """The returned weights' gradient w.r.t. a learnable head scale equals the plain formula's,
    also where the scale is exactly 0 (the weights rebuilt lambda as lambda / m * m, which loses
    the gradient at m = 0)."""
    torch.manual_seed(0)
    E, H, L = 8, 2, 5
    mha = torch_ext.nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64, scale=policy, train_length=3,
                                          learnable_scale=True)
    with torch.no_grad():
        mha.head_scale.copy_(torch.tensor([0.0, 1.5], dtype=torch.float64))
    x = torch.randn(1, L, E, dtype=torch.float64)
    _, w = mha(x, x, x, average_attn_weights=False)
    upstream = torch.linspace(0, 1, w.numel(), dtype=torch.float64).view(w.shape)
    (got,) = torch.autograd.grad((w * upstream).sum(), mha.head_scale)

    s = mha.head_scale.detach().clone().requires_grad_()
    q, k = (F.linear(x, mha.in_proj_weight[i * E : (i + 1) * E], mha.in_proj_bias[i * E : (i + 1) * E]) for i in (0, 1))
    q, k = (t.view(1, L, H, E // H).transpose(1, 2) for t in (q, k))
    factor = math.log(L) / math.log(3) if policy == "logn" else 1.0  # n_i = L: no mask
    lam = s.view(H, 1, 1) * factor / math.sqrt(E // H)
    want_w = (lam * (q @ k.transpose(-1, -2))).softmax(-1)
    (want,) = torch.autograd.grad((want_w * upstream).sum(), s)
    torch.testing.assert_close(w, want_w.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    assert want[0] != 0


def test_jit_trace() -> None:
    """torch.jit.trace of the module (as torch's MultiheadAttention traces) runs the op and gives the
    eager output on new inputs of the traced shape (the batch-broadcast check compared traced sizes
    as a set, which does not deduplicate them, and raised)."""
    import warnings

    torch.manual_seed(0)
    _, ours = pair(batch_first=True)
    x = torch.randn(2, 5, E, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TracerWarnings of the shape checks
        traced = torch.jit.trace(ours, (x, x, x), check_trace=False)
    y = torch.randn(2, 5, E, dtype=torch.float64)
    assert_close(traced(y, y, y)[0], ours(y, y, y)[0])

    # A model that calls SDPA, traced under replace_sdpa: the trace records the op, so the traced
    # model runs it (with the policy) outside the context too.
    class Plain(torch.nn.Module):
        def forward(self, q: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)

    q = torch.randn(2, 3, 5, 4, dtype=torch.float64)
    with warnings.catch_warnings(), torch_ext.replace_sdpa(scale="logn", train_length=4):
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(Plain(), (q,), check_trace=False)
    assert "entropy_attn::attention" in str(traced.graph)
    r = torch.randn(2, 3, 5, 4, dtype=torch.float64)
    assert_close(traced(r), torch_ext.attention(r, r, r, is_causal=True, scale="logn", train_length=4))


def test_jit_script_says_what_works() -> None:
    """torch.jit.script of a model holding the module raises a RuntimeError that names the
    alternatives (it failed deep inside TorchScript's type checks of the Python wrappers), while a
    scripted function calling the op itself runs and gives the eager result."""
    import warnings

    _, ours = pair(batch_first=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.script's deprecation
        with pytest.raises(RuntimeError, match="torch.jit.trace, torch.compile or torch.export"):
            torch.jit.script(torch.nn.Sequential(ours))

        def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return torch.ops.entropy_attn.attention(q, k, v, None, None, is_causal=True)[0]

        scripted = torch.jit.script(f)
    q = torch.randn(1, 2, 5, 4, dtype=torch.float64)
    assert_close(scripted(q, q, q), torch_ext.attention(q, q, q, is_causal=True))
