"""Gradients w.r.t. an additive ``attn_mask``: learned biases (T5's relative positions, learned
ALiBi slopes, Doge's learned mask) train through the op as through SDPA. The mask adds to the
logits after the scale and the softcap, so its gradient is dS, the logits' gradient, summed over
the dims the mask broadcasts along (docs/math.md section 3).

Checked against autograd through the plain float64 reference over mask shapes, key patterns,
softcap, sinks, dropout, GQA and the statistics' gradients; gradcheck in float64; opcheck of the
backward with ``grad_mask``; the errors; torch.compile; a tiny T5 and Doge under the Hugging Face
backend against "sdpa".
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import pytest
import torch
from torch import Tensor
from torch.autograd import gradcheck

import torch_ext  # noqa: F401  (registers torch.ops.entropy_attn)
from conftest import GRAD_TOL, rel_err, requires_cuda
from reference import reference_attention_raw

F64 = torch.float64
B, H, LQ, LK, D = 2, 3, 7, 9, 8


def OP(*args: Any, **kwargs: Any) -> Tuple[Tensor, ...]:
    """torch.ops.entropy_attn.attention."""
    return torch.ops.entropy_attn.attention(*args, **kwargs)


def additive_mask(shape: Tuple[int, ...], masked: float = 0.25, seed: int = 3) -> Tensor:
    """N(0, 0.5^2) values with a fraction of -inf entries (float64, CPU)."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(*shape, generator=g, dtype=F64) * 0.5
    hidden = torch.rand(*shape, generator=g, dtype=F64) < masked
    return values.masked_fill(hidden, float("-inf"))


#: name -> (mask shape, query heads, kv heads, Lq, Lk, op keyword arguments); the mask shapes are
#: those of real models: per head (T5, (1, H, Lq, Lk)), shared ((Lq, Lk)), per key (padding with a
#: learned offset), full.
CASES: Dict[str, Tuple[Tuple[int, ...], int, int, int, int, Dict[str, Any]]] = {
    "full": ((B, H, LQ, LK), H, H, LQ, LK, {}),
    "shared_qk": ((LQ, LK), H, H, LQ, LK, {}),
    "per_key": ((B, 1, 1, LK), H, H, LQ, LK, {}),
    "per_head_t5": ((1, H, LQ, LK), H, H, LQ, LK, {}),
    "causal_logn": ((1, H, LQ, LQ), H, H, LQ, LQ, dict(is_causal=True, scale_mode="logn", log_base=4.0)),
    "window_softcap": ((H, LQ, LK), H, H, LQ, LK, dict(window_size=[2, 1], softcap=2.0)),
    "bottom_right": ((LQ - 3, LK), H, H, LQ - 3, LK, dict(is_causal=True, causal_alignment="bottom_right")),
    "gqa_sinks": ((1, 4, LQ, LK), 4, 2, LQ, LK, dict(enable_gqa=True)),
    "dropout": ((B, H, LQ, LK), H, H, LQ, LK, dict(dropout_p=0.3, dropout_seed=11)),
    # Broadcast along dims that separate the CPU backward's tasks (batch, key/value heads, keys):
    # their entries are summed by one task (csrc/cpu/attention_bwd.cpp, TaskSplit).
    "per_row": ((B, H, LQ, 1), H, H, LQ, LK, dict(is_causal=True)),
    "shared_gqa": ((1, 1, LQ, LK), 4, 2, LQ, LK, dict(enable_gqa=True)),
    "per_batch_gqa": ((B, 1, LQ, LK), 4, 2, LQ, LK, dict(enable_gqa=True, window_size=[3, 2])),
}


def inputs(h: int, hkv: int, lq: int, lk: int, dtype: torch.dtype, device: str) -> Tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, n, length, D, generator=g, dtype=F64) for n, length in ((h, lq), (hkv, lk), (hkv, lk)))
    return tuple(x.to(device=device, dtype=dtype) for x in (q, k, v))  # type: ignore[return-value]


def loss_of(outs: Tuple[Tensor, ...], upstream: Tuple[Tensor, ...]) -> Tensor:
    """<output, g0> + <lse, g1> + <entropy, g2> + <sum_p2, g3>: every differentiable output."""
    return sum((o.to(F64) * u).sum() for o, u in zip(outs[:4], upstream))  # type: ignore[return-value]


@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_mask_grad_matches_reference(device: str, case: str, dtype: torch.dtype) -> None:
    """d loss / d attn_mask of the op against autograd through the float64 reference, with the
    statistics' gradients in the loss; -inf entries (and keys outside the pattern) get 0."""
    shape, h, hkv, lq, lk, kw = CASES[case]
    kw = dict(kw)
    sinks = None
    if case == "gqa_sinks":
        sinks = torch.tensor([0.5, -1.0, 2.0, float("-inf")], dtype=F64)
    q, k, v = inputs(h, hkv, lq, lk, dtype, device)
    mask64 = additive_mask(shape)
    mask = mask64.to(device=device, dtype=dtype).requires_grad_()
    outs = OP(q, k, v, mask, None, sinks=None if sinks is None else sinks.to(device, dtype), **kw)
    g = torch.Generator().manual_seed(5)
    upstream = tuple(torch.randn(o.shape, generator=g, dtype=F64).to(device) for o in outs[:4])
    (dmask,) = torch.autograd.grad(loss_of(outs, upstream), [mask])

    ref_mask = mask.detach().to(F64).cpu().requires_grad_()
    rkw = {key: val for key, val in kw.items()}
    ref = reference_attention_raw(
        q.detach().cpu().to(F64), k.detach().cpu().to(F64), v.detach().cpu().to(F64), ref_mask, None,
        sinks=None if sinks is None else sinks.to(dtype).to(F64), **rkw,
    )
    ref_outs = (ref.output, ref.lse, ref.entropy, ref.sum_p2)
    (expected,) = torch.autograd.grad(loss_of(ref_outs, tuple(u.cpu() for u in upstream)), [ref_mask])

    assert dmask.shape == mask.shape and dmask.dtype == mask.dtype and dmask.device == mask.device
    assert expected.abs().max() > 1e-3, "the case must give the mask a gradient"
    assert rel_err(dmask.cpu(), expected) < GRAD_TOL[dtype], f"{rel_err(dmask.cpu(), expected):.3g}"
    assert (dmask.cpu()[torch.isneginf(mask64)] == 0).all(), "a hidden key's mask entry has no gradient"


@pytest.mark.parametrize("shape", [(1, 2, 9, 1), (9, 1100), (1, 2, 1, 1100)], ids=["per_row", "shared", "per_key"])
def test_mask_grad_with_key_chunks(shape: Tuple[int, ...]) -> None:
    """With fewer (batch, key/value head) pairs than threads the CPU backward splits the keys into
    chunks run by separate tasks (more than one block of 512 keys here): a mask broadcast along
    the keys then has its entries summed by one task walking every chunk, the others by the task
    of their chunk. Against the float64 reference, with MQA (two query heads on one key head)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        g = torch.Generator().manual_seed(9)
        q = torch.randn(1, 2, 9, D, generator=g, dtype=F64)
        k, v = (torch.randn(1, 1, 1100, D, generator=g, dtype=F64) for _ in range(2))
        mask = (torch.randn(*shape, generator=g, dtype=F64) * 0.5).requires_grad_()
        out = OP(q, k, v, mask, None, enable_gqa=True, is_causal=True, causal_alignment="bottom_right")
        w = torch.randn(out[0].shape, generator=g, dtype=F64)
        ((out[0] * w).sum() + out[1].sum() + out[2].sum()).backward()  # lse: a per-row mask's gradient
        ref_mask = mask.detach().clone().requires_grad_()
        ref = reference_attention_raw(q, k, v, ref_mask, None, enable_gqa=True, is_causal=True, causal_alignment="bottom_right")
        ((ref.output * w).sum() + ref.lse.sum() + ref.entropy.sum()).backward()
    finally:
        torch.set_num_threads(threads)
    assert mask.grad.shape == mask.shape and ref_mask.grad.abs().max() > 1e-3
    assert rel_err(mask.grad, ref_mask.grad) < 1e-10, f"{rel_err(mask.grad, ref_mask.grad):.3g}"


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (4, 1, 1), (1, 1, 1, 1024)], ids=["scalar", "per_head", "per_key"])
def test_shared_float32_mask_grad_sums_in_float64(shape: Tuple[int, ...]) -> None:
    """A float32 mask whose every entry is shared by thousands of logits (a learned scalar, per-head
    or per-key bias) has their dS summed in float64 by the CPU backward: a float32 running sum of
    B Lq Lk nearly cancelling terms was 36x (scalar) and 11x (per head, per key) further from the
    float64 reference than float32 autograd through the n x n formula, which sums the full
    gradient pairwise. Held within 4x of that formula's error, whose own dS rounding remains."""
    b, h, length, d = 2, 4, 1024, 64
    g = torch.Generator().manual_seed(1)
    q, k, v, w = (torch.randn(b, h, length, d, generator=g, dtype=F64) for _ in range(4))
    mask64 = torch.randn(shape, generator=g, dtype=F64)

    def grad(dtype: torch.dtype, ours: bool) -> Tensor:
        mask = mask64.to(dtype).detach().requires_grad_()
        qc, kc, vc = (x.to(dtype) for x in (q, k, v))
        if ours:
            out = torch_ext.attention(qc, kc, vc, attn_mask=mask)
        else:
            out = torch.softmax(qc @ kc.transpose(-1, -2) / d**0.5 + mask, dim=-1) @ vc
        (out.to(F64) * w).sum().backward()
        return mask.grad.to(F64)

    expected = grad(F64, ours=False)
    ours_err = (grad(torch.float32, ours=True) - expected).abs().max().item()
    formula_err = (grad(torch.float32, ours=False) - expected).abs().max().item()
    assert ours_err <= 4 * formula_err, f"{ours_err:.3g} against the formula's {formula_err:.3g}"


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_shared_mask_grad_memory_cuda(dtype: torch.dtype) -> None:
    """A bias shared across the batch (T5's (1, H, L, L)) gets its gradient without a (B, H, L, L)
    buffer: the backward's peak memory stays far below that buffer's 256 MiB here (float32: the
    fallback kernels; bf16: the sm80 family's backward, the Hopper family's where it is forced (a
    loss of the output alone), or the fallback where that is forced)."""
    B_, H_, L_, D_ = 16, 4, 1024, 64
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(B_, H_, L_, D_, generator=g).to("cuda", dtype).requires_grad_() for _ in range(3))
    bias = (torch.randn(1, H_, L_, L_, generator=g) * 0.5).to("cuda", dtype).requires_grad_()
    out = OP(q, k, v, bias, None)[0]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out.sum().backward()
    torch.cuda.synchronize()
    full_buffer = B_ * H_ * L_ * L_ * 4
    # (Beyond the gradients themselves: those of q, k, v and the bias alone are 64 MiB here.)
    gradients = sum(t.numel() * t.element_size() for t in (q, k, v, bias))
    grown = torch.cuda.max_memory_allocated() - before - gradients
    assert grown < full_buffer / 4, f"the backward took {grown / 2**20:.0f} MiB beyond the gradients"
    assert bias.grad.shape == bias.shape and torch.isfinite(bias.grad).all()


def test_mask_grad_alone_and_with_qkv(device: str) -> None:
    """A mask that is the only input requiring grad gets its gradient; with q, k, v as well the
    mask's gradient is the same and theirs are unchanged by asking for it."""
    q, k, v = inputs(H, H, LQ, LK, F64, device)
    mask = additive_mask((1, H, LQ, LK), masked=0.0).to(device)
    alone = mask.clone().requires_grad_()
    OP(q, k, v, alone, None)[0].sum().backward()
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    both = mask.clone().requires_grad_()
    OP(*leaves, both, None)[0].sum().backward()
    torch.testing.assert_close(both.grad, alone.grad, rtol=1e-12, atol=1e-12)
    plain = [x.clone().requires_grad_() for x in (q, k, v)]
    OP(*plain, mask, None)[0].sum().backward()
    for a, b in zip(leaves, plain):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)


def test_entropy_regularizer_reaches_the_mask(device: str) -> None:
    """An entropy penalty alone (no output loss) trains a learned bias: d(sum H)/d mask against the
    reference (the statistic is the op's, not recomputed from weights)."""
    q, k, v = inputs(H, H, LQ, LK, F64, device)
    mask = additive_mask((1, H, LQ, LK), masked=0.0).to(device).requires_grad_()
    OP(q, k, v, mask, None, return_stats=True)[2].sum().backward()
    ref_mask = mask.detach().cpu().requires_grad_()
    reference_attention_raw(q.cpu(), k.cpu(), v.cpu(), ref_mask, None).entropy.sum().backward()
    assert rel_err(mask.grad.cpu(), ref_mask.grad) < 1e-10


GC_CASES: Dict[str, Tuple[Tuple[int, ...], Dict[str, Any]]] = {
    "per_head": ((1, 2, 4, 5), {}),
    "shared_causal_logn": ((4, 5), dict(is_causal=True, scale_mode="logn", log_base=3.0)),
    "per_key_softcap_window": ((2, 1, 1, 5), dict(softcap=1.5, window_size=[1, 2])),
}


@pytest.mark.parametrize("case", list(GC_CASES))
def test_gradcheck_with_mask(device: str, case: str) -> None:
    """gradcheck (float64) of output, lse, entropy and sum_p2 w.r.t. q, k, v and a finite mask."""
    shape, kw = GC_CASES[case]
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 2, n, 3, generator=g, dtype=F64).to(device).requires_grad_() for n in (4, 5, 5))
    mask = (torch.randn(*shape, generator=g, dtype=F64) * 0.5).to(device).requires_grad_()

    def f(q: Tensor, k: Tensor, v: Tensor, m: Tensor) -> Tuple[Tensor, ...]:
        return OP(q, k, v, m, None, **kw)[:4]

    assert gradcheck(f, (q, k, v, mask), eps=1e-6, atol=1e-6, rtol=1e-5)


def backward_args(device: str, grad_mask: bool, mask_dtype: torch.dtype = F64) -> Tuple[Any, ...]:
    """attention_backward's arguments from a real forward with an additive (1, H, Lq, Lk) mask."""
    q, k, v = inputs(H, H, LQ, LK, F64, device)
    mask = additive_mask((1, H, LQ, LK)).to(device=device, dtype=mask_dtype)
    out, lse, ent, sp2, _, _, rs = OP(q, k, v, mask, None, is_causal=True)[:7]
    go = torch.randn_like(out)
    return (go, torch.randn_like(lse), None, None, q, k, v, mask, out, lse, ent, sp2, rs, True)


def test_backward_op_grad_mask(device: str) -> None:
    """attention_backward: grad_attn_mask has the mask's shape and dtype with grad_mask=True, is
    empty without it, and the other gradients do not depend on it."""
    args = backward_args(device, True, torch.float32)
    with_mask = torch.ops.entropy_attn.attention_backward(*args, grad_mask=True)
    without = torch.ops.entropy_attn.attention_backward(*args)
    assert with_mask[5].shape == args[7].shape and with_mask[5].dtype == torch.float32
    assert without[5].numel() == 0
    for a, b in zip(with_mask[:4], without[:4]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_opcheck_backward_grad_mask(device: str) -> None:
    torch.library.opcheck(
        torch.ops.entropy_attn.attention_backward.default, backward_args(device, True), {"grad_mask": True}
    )


def test_opcheck_forward_mask_requires_grad(device: str) -> None:
    """opcheck of the forward with a mask that requires grad (its autograd registration)."""
    q, k, v = (x.requires_grad_() for x in inputs(H, H, LQ, LK, F64, device))
    mask = additive_mask((1, H, LQ, LK), masked=0.0).to(device).requires_grad_()
    torch.library.opcheck(torch.ops.entropy_attn.attention.default, (q, k, v, mask, None))


@pytest.mark.parametrize(
    "mask, match",
    [(torch.ones(LQ, LK, dtype=torch.bool), "bool mask"), (None, "none")],
    ids=["bool_mask", "no_mask"],
)
def test_grad_mask_needs_an_additive_mask(mask: Optional[Tensor], match: str) -> None:
    args = list(backward_args("cpu", True))
    args[7] = mask
    with pytest.raises(ValueError, match=f"grad_mask=True needs an additive.*{match}"):
        torch.ops.entropy_attn.attention_backward(*args, grad_mask=True)


def test_bool_mask_has_no_gradient() -> None:
    """A bool mask is not differentiable: q, k, v still get gradients (the mask's slot is None)."""
    q, k, v = (x.requires_grad_() for x in inputs(H, H, LQ, LK, F64, "cpu"))
    OP(q, k, v, torch.rand(LQ, LK) < 0.7, None)[0].sum().backward()
    assert all(x.grad is not None for x in (q, k, v))


def test_compiled_learned_bias_matches_eager() -> None:
    """torch.compile traces a learned bias's forward and backward (the Meta kernel's grad_attn_mask)."""
    q, k, v = inputs(H, H, LQ, LK, torch.float32, "cpu")
    bias = torch.nn.Parameter(torch.randn(1, H, LQ, LK) * 0.3)

    def step(bias: Tensor) -> Tensor:
        return torch_ext.attention(q, k, v, bias, is_causal=True).square().sum()

    step(bias).backward()
    eager = bias.grad.clone()
    bias.grad = None
    torch.compile(step, backend="aot_eager", fullgraph=True)(bias).backward()
    torch.testing.assert_close(bias.grad, eager, rtol=1e-6, atol=1e-6)


def test_replace_sdpa_learned_bias_matches_torch() -> None:
    """SDPA calls routed to the op (torch_ext.replace_sdpa) with a learned float bias: output and
    every gradient, the bias's included, as torch's SDPA."""
    q, k, v = (x.float().requires_grad_() for x in inputs(H, H, LQ, LK, F64, "cpu"))
    bias = (torch.randn(1, H, LQ, LK) * 0.5).requires_grad_()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    results = []
    for routed in (True, False):
        with torch_ext.replace_sdpa() if routed else torch.autograd.set_grad_enabled(True):
            out = sdpa(q, k, v, attn_mask=bias)
        results.append((out, *torch.autograd.grad(out.square().sum(), [q, k, v, bias])))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# --- Hugging Face models with learned biases --------------------------------------------------------
BACKEND = "torch_ext_test_mask_grad"


def assert_matches_sdpa(model: torch.nn.Module, names: Tuple[str, ...], **inputs: Any) -> None:
    """Output and every parameter gradient under the backend equal "sdpa"'s (test_hf.assert_same),
    and ``names`` (the learned bias's parameters) are among those with a gradient."""
    import torch_ext.hf as hf
    from test_hf import assert_same, logits_and_grads

    hf.register(BACKEND)
    assert_same(model, BACKEND, **inputs)
    grads = logits_and_grads(model, BACKEND, **inputs)[1]
    for name in names:
        assert any(name in n for n in grads), name


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_t5_relative_bias_trains_as_with_sdpa(padded: bool) -> None:
    """A tiny T5 (encoder with padding, causal decoder, cross-attention): the relative-position
    bias joins the mask and its embedding (relative_attention_bias) gets the gradient "sdpa" gives."""
    pytest.importorskip("transformers")
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0,
    )
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(cfg).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 64, (2, 10), generator=g)
    labels = torch.randint(3, 64, (2, 6), generator=g)
    mask = torch.ones(2, 10, dtype=torch.long)
    if padded:
        mask[1, -4:] = 0
    assert_matches_sdpa(model, ("relative_attention_bias",), input_ids=ids, attention_mask=mask, labels=labels)


def test_t5_rows_that_see_no_key_give_zero_where_sdpa_averages() -> None:
    """The one difference from "sdpa" under its float masks (README, torch_ext/hf.py): the encoder
    rows of a T5 sample that is all padding see no key and give 0 under the backend, as "sdpa"
    gives with bool masks; "sdpa", whose T5 mask is the position bias joined at finfo.min, averages
    the values uniformly there (every logit is finfo.min). The other sample's rows agree."""
    pytest.importorskip("transformers")
    import torch_ext.hf as hf
    from transformers import T5Config, T5EncoderModel

    cfg = T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
    )
    torch.manual_seed(0)
    model = T5EncoderModel(cfg).double().eval()
    hf.register(BACKEND)
    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1] = 0
    attn = model.encoder.block[0].layer[0].SelfAttention
    values: Dict[str, Tensor] = {}
    contexts: Dict[str, Tensor] = {}
    for impl in ("sdpa", BACKEND):
        model.set_attn_implementation(impl)
        hooks = (
            attn.v.register_forward_hook(lambda m, i, o, impl=impl: values.__setitem__(impl, o)),
            attn.o.register_forward_pre_hook(lambda m, i, impl=impl: contexts.__setitem__(impl, i[0])),
        )
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
        for h in hooks:
            h.remove()
    ours, sdpa = contexts[BACKEND], contexts["sdpa"]  # (B, L, H * d): the heads' outputs
    torch.testing.assert_close(ours[0], sdpa[0], rtol=1e-12, atol=1e-12)
    assert (ours[1] == 0).all()
    torch.testing.assert_close(sdpa[1], values["sdpa"][1].mean(0).expand(6, -1), rtol=1e-12, atol=1e-12)


def test_doge_learned_mask_trains_as_with_sdpa() -> None:
    """Doge's dynamic mask (computed from the values by learned parameters, so it requires grad)."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, DogeConfig

    cfg = DogeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, keep_window_size=4, is_moe=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).eval()
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    assert_matches_sdpa(model, ("dt_proj", "A"), input_ids=ids)


@pytest.mark.parametrize("bias", ["relative", torch.zeros(1, H, LQ, LK, dtype=torch.long)], ids=["str", "int"])
def test_position_bias_must_be_a_float_tensor(bias: Any) -> None:
    """A position_bias that is not a float tensor is a TypeError naming it (not a failure inside the op)."""
    transformers = pytest.importorskip("transformers")
    import torch_ext.hf as hf

    hf.register(BACKEND)
    fn = transformers.AttentionInterface()[BACKEND]
    q, k, v = inputs(H, H, LQ, LK, torch.float32, "cpu")
    with pytest.raises(TypeError, match="position_bias must be a float tensor"):
        fn(torch.nn.Module(), q, k, v, None, position_bias=bias)
