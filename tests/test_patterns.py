"""Sliding windows and their alignment, logit softcapping, attention sinks and dropout on the dense
op, against the plain float64 reference (tests/reference.py), on every device."""

from __future__ import annotations

import itertools
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
from torch import Tensor
from torch.autograd import gradcheck

import torch_ext
from conftest import DEVICES, GRAD_TOL, OUT_TOL, STAT_TOL, nondet_tol
from reference import philox_dropout_factors, reference_attention_raw

ops = torch.ops.entropy_attn
F64 = torch.float64
STATS = ("lse", "entropy", "sum_p2", "max_weight", "normalized_entropy", "sparsity", "effective_keys")
#: The op's outputs by name, in schema order.
OUT_NAMES = (
    "output", "lse", "entropy", "sum_p2", "max_weight", "n_keys", "row_scale", "length_factor",
    "normalized_entropy", "sparsity", "effective_keys",
)


def rand(*shape: int, dtype: torch.dtype = F64, device: str = "cpu", gen: Optional[torch.Generator] = None) -> Tensor:
    return torch.randn(*shape, dtype=dtype, generator=gen).to(device)


def check_forward(res: Tuple[Tensor, ...], ref: Any, dtype: torch.dtype, what: str) -> None:
    """Every output of the op against the reference (n_keys exactly)."""
    out_tol, stat_tol = OUT_TOL[dtype], STAT_TOL[dtype]
    for name, got in zip(OUT_NAMES, res):
        want = getattr(ref, name)
        if name == "n_keys":
            assert torch.equal(got.cpu(), want.cpu()), f"{what}: n_keys"
            continue
        atol, rtol = out_tol if name == "output" else stat_tol
        torch.testing.assert_close(got.cpu().to(F64), want.detach().cpu(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {name}: {m}")


WINDOW_CASES: List[Tuple[int, int, bool, Tuple[int, int], str]] = [
    # (Lq, Lk, is_causal, window_size, causal_alignment)
    (37, 37, False, (5, 3), "top_left"),
    (37, 37, True, (7, -1), "top_left"),
    (37, 37, True, (0, -1), "top_left"),  # each row sees only its diagonal key
    (19, 53, True, (-1, -1), "bottom_right"),  # a cache: Lq < Lk
    (53, 19, True, (-1, -1), "bottom_right"),  # Lq > Lk: the first rows see nothing
    (19, 53, False, (6, 2), "bottom_right"),
    (53, 19, False, (4, 4), "top_left"),  # the last rows' windows lie past the keys
    (600, 1100, True, (130, -1), "bottom_right"),  # several CPU key blocks, most skipped
    (700, 700, False, (-1, 40), "top_left"),  # a right window only
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", WINDOW_CASES, ids=lambda c: f"{c[0]}x{c[1]}_c{int(c[2])}_w{c[3][0]}_{c[3][1]}_{c[4]}")
@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.bfloat16])
def test_window_forward(device: str, case: Tuple[int, int, bool, Tuple[int, int], str], dtype: torch.dtype) -> None:
    """Output and every statistic, n_i counting only the window's keys (with a mask on top)."""
    Lq, Lk, causal, window, align = case
    g = torch.Generator().manual_seed(Lq * 1000 + Lk)
    q, k, v = (rand(2, 3, L, 16, gen=g) for L in (Lq, Lk, Lk))
    mask = torch.rand(Lq, Lk, generator=g) < 0.8
    kw: Dict[str, Any] = dict(is_causal=causal, window_size=list(window), causal_alignment=align, scale_mode="logn", log_base=64.0)
    cast = [x.to(device=device, dtype=dtype) for x in (q, k, v)]
    ref = reference_attention_raw(*(x.cpu() for x in cast), mask, **kw)  # the inputs as rounded
    res = ops.attention(*cast, mask.to(device), **kw)
    check_forward(res, ref, dtype, f"{case}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", WINDOW_CASES[:7], ids=lambda c: f"{c[0]}x{c[1]}_c{int(c[2])}_w{c[3][0]}_{c[3][1]}_{c[4]}")
def test_window_backward(device: str, case: Tuple[int, int, bool, Tuple[int, int], str]) -> None:
    """Gradients of q, k, v and a scale tensor through output and the statistics."""
    Lq, Lk, causal, window, align = case
    g = torch.Generator().manual_seed(7 + Lq)
    q, k, v = (rand(1, 2, L, 8, gen=g).requires_grad_() for L in (Lq, Lk, Lk))
    scale = (0.2 + torch.rand(2, 1, dtype=F64, generator=g)).requires_grad_()
    kw: Dict[str, Any] = dict(is_causal=causal, window_size=window, causal_alignment=align, scale_mode="logn", log_base=8.0)
    ref = reference_attention_raw(q, k, v, None, scale, **kw)
    qd, kd, vd, sd = (x.detach().to(device).requires_grad_() for x in (q, k, v, scale))
    res = ops.attention(qd, kd, vd, None, sd, **kw)
    ups = [rand(*ref.output.shape, gen=g), rand(*ref.lse.shape, gen=g), rand(*ref.lse.shape, gen=g), rand(*ref.lse.shape, gen=g)]
    loss_ref = sum((o * u).sum() for o, u in zip((ref.output, ref.lse, ref.entropy, ref.sum_p2), ups))
    loss = sum((o * u.to(device)).sum() for o, u in zip((res[0], res[1], res[2], res[3]), ups))
    want = torch.autograd.grad(loss_ref, (q, k, v, scale))
    got = torch.autograd.grad(loss, (qd, kd, vd, sd))
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a.cpu(), b, atol=1e-9, rtol=1e-8, msg=lambda m: f"d{name}: {m}")
    torch.testing.assert_close(got[3].cpu(), want[3], atol=1e-9, rtol=1e-8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.float16])
@pytest.mark.parametrize("with_mask", [False, True])
def test_softcap_and_sinks_forward(device: str, dtype: torch.dtype, with_mask: bool) -> None:
    """Softcap (with large logits, where it matters) and sinks, alone and together, with rows that
    see no key (a sink then holds the whole weight: lse = sink, output 0)."""
    g = torch.Generator().manual_seed(11)
    q, k, v = rand(2, 4, 9, 16, gen=g) * 3, rand(2, 4, 13, 16, gen=g) * 3, rand(2, 4, 13, 8, gen=g)
    mask = None
    if with_mask:
        mask = torch.rand(9, 13, generator=g) < 0.6
        mask[4] = False
    sinks = rand(4, gen=g)
    for softcap, use_sinks in ((5.0, False), (0.0, True), (2.5, True)):
        kw: Dict[str, Any] = dict(softcap=softcap, is_causal=True, causal_alignment="bottom_right")
        cast = [x.to(device=device, dtype=dtype) for x in (q, k, v)]
        ref = reference_attention_raw(*(x.cpu() for x in cast), mask, sinks=sinks if use_sinks else None, **kw)
        res = ops.attention(
            *cast, None if mask is None else mask.to(device), sinks=sinks.to(device) if use_sinks else None, **kw
        )
        check_forward(res, ref, dtype, f"softcap={softcap} sinks={use_sinks}")


@pytest.mark.parametrize("device", DEVICES)
def test_softcap_and_sinks_backward(device: str) -> None:
    """Gradients of q, k, v, the scale tensor and the sinks through output and statistics."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (rand(2, 3, L, 8, gen=g) * 2 for L in (7, 11, 11))
    mask = torch.rand(7, 11, generator=g) < 0.7
    mask[2] = False
    leaves = [x.requires_grad_() for x in (q, k, v)]
    scale = (0.3 + torch.rand(3, 1, dtype=F64, generator=g)).requires_grad_()
    sinks = rand(3, gen=g).requires_grad_()
    kw: Dict[str, Any] = dict(softcap=1.5, window_size=(4, 2))
    ref = reference_attention_raw(*leaves, mask, scale, sinks=sinks, **kw)
    dev = [x.detach().to(device).requires_grad_() for x in (*leaves, scale, sinks)]
    res = ops.attention(dev[0], dev[1], dev[2], mask.to(device), dev[3], sinks=dev[4], **kw)
    ups = [rand(*ref.output.shape, gen=g)] + [rand(*ref.lse.shape, gen=g) for _ in range(6)]
    idx = (0, 1, 2, 3, 8, 9, 10)  # output, lse, entropy, sum_p2 and the derived statistics
    loss_ref = sum((ref[i] * u).sum() for i, u in zip(idx, ups))
    loss = sum((res[i] * u.to(device)).sum() for i, u in zip(idx, ups))
    want = torch.autograd.grad(loss_ref, (*leaves, scale, sinks))
    got = torch.autograd.grad(loss, dev)
    for name, a, b in zip(("q", "k", "v", "scale", "sinks"), got, want):
        torch.testing.assert_close(a.cpu(), b, atol=1e-9, rtol=1e-8, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck_patterns(device: str) -> None:
    """gradcheck (float64) with a window, bottom-right alignment, softcap, sinks and a fixed
    dropout mask (the seed makes the op deterministic)."""
    g = torch.Generator().manual_seed(2)
    inputs = [rand(1, 2, 5, 4, gen=g, device=device).requires_grad_(), rand(1, 2, 8, 4, gen=g, device=device).requires_grad_()]
    inputs += [rand(1, 2, 8, 3, gen=g, device=device).requires_grad_(), rand(2, gen=g, device=device).requires_grad_()]

    def f(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor) -> Tuple[Tensor, ...]:
        r = ops.attention(
            q, k, v, is_causal=True, window_size=[3, -1], causal_alignment="bottom_right", softcap=2.0, sinks=sinks,
            dropout_p=0.25, dropout_seed=1234,
        )
        return r[0], r[1], r[2], r[3]

    assert gradcheck(f, tuple(inputs), eps=1e-6, atol=1e-7, rtol=1e-5, nondet_tol=nondet_tol(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.bfloat16])
def test_dropout_matches_reference(device: str, dtype: torch.dtype) -> None:
    """With a given seed the op drops exactly the weights of the independent Philox reference; the
    statistics are those of the weights before dropout; gradients match."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (rand(2, 2, L, 8, gen=g).to(dtype).to(F64).requires_grad_() for L in (33, 70, 70))
    kw: Dict[str, Any] = dict(dropout_p=0.3, dropout_seed=(7 << 33) + 12345, is_causal=True, causal_alignment="bottom_right")
    ref = reference_attention_raw(q, k, v, **kw)
    dev = [x.detach().to(device=device, dtype=dtype).requires_grad_() for x in (q, k, v)]
    res = ops.attention(*dev, **kw)
    check_forward(res, ref, dtype, "dropout")
    # The statistics do not see dropout.
    plain = reference_attention_raw(q, k, v, is_causal=True, causal_alignment="bottom_right")
    torch.testing.assert_close(ref.entropy, plain.entropy)
    up = rand(*ref.output.shape, gen=g)
    want = torch.autograd.grad((ref.output * up).sum(), (q, k, v))
    got = torch.autograd.grad((res[0] * up.to(device=device, dtype=dtype)).sum(), dev)
    for name, a, b in zip("qkv", got, want):
        err = (a.cpu().to(F64) - b).norm() / b.norm()
        assert err < GRAD_TOL[dtype], f"d{name}: relative error {err:.3g}"


def test_dropout_reference_statistics() -> None:
    """The reference generator itself: the kept fraction is 1 - p within binomial noise, and the
    mask changes with the seed and the indices (so that the comparison above can fail)."""
    f = philox_dropout_factors(99, 0.25, 2, 3, 64, 64)
    keep = (f > 0).double().mean().item()
    assert abs(keep - 0.75) < 4 * (0.25 * 0.75 / f.numel()) ** 0.5
    assert not torch.equal(f, philox_dropout_factors(100, 0.25, 2, 3, 64, 64))
    assert not torch.equal(f[0, 0], f[0, 1]) and not torch.equal(f[0, 0, 0], f[0, 0, 1])


def test_dropout_group_draws_are_independent() -> None:
    """One Philox call decides 8 weights (rows i, i + 8 x keys j, j + 1, j + 8, j + 9): each of the
    8 slots keeps 1 - p' of its weights, and the decisions of weights sharing a call are
    uncorrelated (|corr| within binomial noise); the kept weights' factor is 1 / (1 - p') with
    p' = round(p 2^16) / 2^16, which makes the factor's mean exactly 1."""
    p = 0.3
    f = philox_dropout_factors(2024, p, 1, 4, 256, 256)
    keep = (f > 0).double()
    p_used = round(p * 2**16) / 2**16
    assert torch.allclose(f[f > 0], torch.tensor(1 / (1 - p_used), dtype=F64))
    n = keep.numel() / 8
    tol = 5 * (p_used * (1 - p_used) / n) ** 0.5
    slots = keep.view(1, 4, 16, 2, 8, 16, 2, 8)  # (b, h, i // 16, i // 8 % 2, i % 8, j // 16, j // 8 % 2, j % 8)
    for a in range(2):
        for c in range(2):
            for e in range(2):
                frac = slots[:, :, :, a, :, :, c, e::2].mean().item()
                assert abs(frac - (1 - p_used)) < tol, (a, c, e, frac)
    z = keep - keep.mean()
    for di, dj in ((8, 0), (0, 1), (0, 8), (8, 9)):  # partners within a group
        a = z[..., : 256 - di, : 256 - dj].reshape(-1)
        b = z[..., di:, dj:].reshape(-1)
        corr = (a * b).mean() / (a.std() * b.std())
        assert abs(corr.item()) < 5 / a.numel() ** 0.5, (di, dj, corr.item())


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_python_api(device: str) -> None:
    """torch_ext.attention draws the seed from torch's generator: reproducible under manual_seed,
    different between calls, unbiased on average, and dropout_p=0 is the plain op."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (rand(1, 2, 16, 8, gen=g, device=device) for _ in range(3))
    torch.manual_seed(0)
    a = torch_ext.attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(0)
    b = torch_ext.attention(q, k, v, dropout_p=0.5)
    c = torch_ext.attention(q, k, v, dropout_p=0.5)
    assert torch.equal(a, b) and not torch.equal(a, c)
    plain = torch_ext.attention(q, k, v)
    torch.testing.assert_close(torch_ext.attention(q, k, v, dropout_p=0.0), plain)
    mean = torch.stack([torch_ext.attention(q, k, v, dropout_p=0.5) for _ in range(400)]).mean(0)
    assert (mean - plain).abs().max() < 0.2  # E[dropout(P)] V = P V; 400 draws: noise ~0.05


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_dropout_compiles_fullgraph(backend: str) -> None:
    """Dropout under torch.compile(fullgraph=True), forward and backward: the seed drawn in the
    graph is symbolic while it is traced (the schema's SymInt dropout_seed; an int made the trace
    fail), the backward regenerates the forward's mask, and each call draws a new one. With
    aot_eager the graph draws the seed from torch's generator as eager does, so under the same
    manual_seed the compiled call equals the eager one, gradients included."""
    g = torch.Generator().manual_seed(12)
    q0, k0, v0 = (rand(2, 2, 24, 8, gen=g) for _ in range(3))

    def f(q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, Tensor]:
        out, stats = torch_ext.attention(q, k, v, is_causal=True, dropout_p=0.3, return_stats=True)
        return out, stats.entropy

    def run(fn: Any) -> List[Tensor]:
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        out, entropy = fn(q, k, v)
        (out.square().sum() + entropy.sum()).backward()
        return [out.detach(), q.grad, k.grad, v.grad]

    torch._dynamo.reset()
    compiled = torch.compile(f, backend=backend, fullgraph=True)
    torch.manual_seed(3)
    got = run(compiled)
    assert not torch.equal(got[0], run(compiled)[0])  # a new seed per call
    if backend == "aot_eager":
        torch.manual_seed(3)
        for a, b in zip(got, run(f)):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    else:
        # Inductor draws the seed with its own generator: the output must still be one of the op's
        # dropout draws, so it differs from the plain op and stays finite, and the gradients are
        # those of that draw (checked above under aot_eager); here they must exist and be finite.
        assert not torch.allclose(got[0], torch_ext.attention(q0, k0, v0, is_causal=True))
        assert all(t is not None and torch.isfinite(t).all() for t in got)


@pytest.mark.parametrize("device", DEVICES)
def test_sparsity_with_window_and_softcap(device: str) -> None:
    """attention_sparsity("exp") equals the attention op's sparsity under the same pattern."""
    g = torch.Generator().manual_seed(8)
    q, k = rand(1, 2, 40, 8, gen=g, device=device) * 2, rand(1, 2, 60, 8, gen=g, device=device) * 2
    kw: Dict[str, Any] = dict(is_causal=True, window_size=[10, -1], causal_alignment="bottom_right", softcap=3.0)
    s = ops.attention_sparsity(q, k, kind="exp", **kw)
    ref = reference_attention_raw(q.cpu(), k.cpu(), k.cpu(), **kw)
    torch.testing.assert_close(s.cpu(), ref.sparsity, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(window_size=[-2, 0]), "window_size"),
        (dict(window_size=[3, 2], is_causal=True), "is_causal"),
        (dict(causal_alignment="middle"), "causal_alignment"),
        (dict(softcap=-1.0), "softcap"),
        (dict(softcap=float("inf")), "softcap"),
        (dict(softcap=1e-40), "softcap"),  # below float32's normal range: the kernels could not apply it
        (dict(softcap=1e39), "softcap"),  # above 2^126 for float32 inputs: 1 / cap is not a normal float32
        (dict(dropout_p=1.0), "dropout_p"),
        (dict(dropout_p=-0.1), "dropout_p"),
        (dict(sinks=torch.zeros(3)), "sinks"),
        (dict(sinks=torch.zeros(2, 1)), "sinks"),
        (dict(sinks=torch.zeros(2, dtype=torch.int64)), "sinks"),
    ],
)
def test_bad_pattern_arguments(kwargs: Dict[str, Any], match: str) -> None:
    """Each bad argument raises a clear error naming it, from the op and from the Python API."""
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises((ValueError, TypeError), match=match):
        ops.attention(q, q, q, **kwargs)
    api = dict(kwargs)
    if "window_size" in api:
        api["window_size"] = tuple(api["window_size"])
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
        torch_ext.attention(q, q, q, **api)


def test_tiny_softcap_message_speaks_python() -> None:
    """From Python "no cap" is None (0 itself is refused), so the message for a cap below float32's
    normal range says None, not the op's 0."""
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"softcap must be None \(no cap\) or a finite number >= 1.175494e-38"):
        torch_ext.attention(q, q, q, softcap=1e-40)


def test_huge_softcap_in_float64() -> None:
    """float64 inputs compute in float64: a cap beyond float32's range is allowed there, and one
    that large changes no logit of these inputs."""
    q = torch.randn(1, 2, 4, 8, dtype=F64)
    capped = ops.attention(q, q, q, softcap=1e300)
    for a, b in zip(capped[:3], ops.attention(q, q, q)[:3]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_window_cost_skips_blocks(device: str) -> None:
    """A window's rows never touch keys outside it: NaN keys outside every window leave the
    output finite (the kernels skip those blocks, or at least never mix them in)."""
    L, W = 1500, 100
    g = torch.Generator().manual_seed(9)
    q, k, v = (rand(1, 1, L, 8, gen=g, device=device) for _ in range(3))
    k[:, :, 1000:1100] = float("nan")  # keys no row in [0, 900) sees with a causal window of 100
    out = ops.attention(q, k, v, is_causal=True, window_size=[W, -1])[0]
    assert torch.isfinite(out[:, :, :900]).all()
    assert torch.isnan(out[:, :, 1000:1100]).any()


def test_window_equals_mask() -> None:
    """A window is the same as the equivalent bool mask (n_i and all outputs), over every
    combination of the shapes, windows and alignments below."""
    g = torch.Generator().manual_seed(10)
    for Lq, Lk, left, right, align in itertools.product(
        (1, 7, 20), (1, 9, 20), (-1, 0, 3), (-1, 0, 2), ("top_left", "bottom_right")
    ):
        q, k, v = rand(1, 1, Lq, 4, gen=g), rand(1, 1, Lk, 4, gen=g), rand(1, 1, Lk, 4, gen=g)
        i = torch.arange(Lq).view(-1, 1)
        j = torch.arange(Lk).view(1, -1)
        diag = i + (Lk - Lq if align == "bottom_right" else 0)
        m = torch.ones(Lq, Lk, dtype=torch.bool)
        if left >= 0:
            m &= j >= diag - left
        if right >= 0:
            m &= j <= diag + right
        a = ops.attention(q, k, v, window_size=[left, right], causal_alignment=align)
        b = ops.attention(q, k, v, m)
        for name, x, y in zip(OUT_NAMES, a, b):
            torch.testing.assert_close(x, y, atol=1e-12, rtol=1e-12, msg=lambda s: f"{(Lq, Lk, left, right, align)} {name}: {s}")


@pytest.mark.parametrize("device", DEVICES)
def test_sink_of_minus_infinity_is_no_sink(device: str) -> None:
    """A sink of -inf carries no weight and is no sink: every output of its head, the derived
    statistics included (which counted it as an outcome: n_i + 1, and inf sparsity and effective
    keys in a row that sees no key), equals the call without sinks, with no NaN, forward and
    backward (a head may switch its sink off that way)."""
    g = torch.Generator().manual_seed(13)
    q, k, v = (rand(1, 2, L, 8, gen=g, device=device).requires_grad_() for L in (6, 9, 9))
    mask = torch.ones(6, 9, dtype=torch.bool, device=device)
    mask[2] = False  # row 2 sees no key
    sinks = torch.tensor([float("-inf"), 0.5], dtype=F64, device=device)
    with_sink = ops.attention(q, k, v, mask, sinks=sinks, is_causal=True, return_stats=True)
    plain = ops.attention(q, k, v, mask, is_causal=True, return_stats=True)
    for i, name in enumerate(OUT_NAMES):
        assert torch.isfinite(with_sink[i]).all(), name
        torch.testing.assert_close(with_sink[i][:, 0], plain[i][:, 0], msg=lambda s: f"{name}: {s}")
    derived = sum(with_sink[i].sum() for i in (0, 2, 8, 9, 10))
    grads = torch.autograd.grad(derived, (q, k, v))
    plain_grads = torch.autograd.grad(sum(plain[i].sum() for i in (0, 2, 8, 9, 10)), (q, k, v))
    assert all(torch.isfinite(gr).all() for gr in grads)
    ref = reference_attention_raw(q.detach().cpu(), k.detach().cpu(), v.detach().cpu(), mask.cpu(), sinks=sinks.cpu(), is_causal=True)
    for i, name in ((2, "entropy"), (8, "normalized_entropy"), (9, "sparsity"), (10, "effective_keys")):
        torch.testing.assert_close(with_sink[i].detach().cpu(), getattr(ref, name), atol=1e-12, rtol=1e-10)
    for gr, plain_gr in zip(grads, plain_grads):  # head 0's (head 1's sink changes head 1's)
        torch.testing.assert_close(gr[:, 0], plain_gr[:, 0])


@pytest.mark.parametrize("device", DEVICES)
def test_nan_sink_reaches_its_head(device: str) -> None:
    """A NaN sink is a NaN entry of its head's softmax denominator: that head's output, lse,
    entropy and the sink's gradient are NaN (it was taken for "no sink", hiding a diverged
    parameter), while the other head is untouched."""
    g = torch.Generator().manual_seed(14)
    q, k, v = (rand(1, 2, L, 8, gen=g, device=device).requires_grad_() for L in (5, 7, 7))
    sinks = torch.tensor([float("nan"), 0.5], dtype=F64, device=device, requires_grad=True)
    res = ops.attention(q, k, v, sinks=sinks, is_causal=True)
    plain = ops.attention(q, k, v, sinks=torch.tensor([0.0, 0.5], dtype=F64, device=device), is_causal=True)
    for i in (0, 1, 2, 3):
        assert torch.isnan(res[i][:, 0]).all(), OUT_NAMES[i]
        torch.testing.assert_close(res[i][:, 1], plain[i][:, 1])
    (g_sinks,) = torch.autograd.grad(res[0][:, 1].sum() + res[1][:, 0].sum(), (sinks,))
    assert torch.isnan(g_sinks[0]) and torch.isfinite(g_sinks[1])


@pytest.mark.parametrize("device", DEVICES)
def test_nan_sink_reaches_rows_that_see_no_key(device: str) -> None:
    """A row that sees no key is NaN under a NaN sink too, as the n×n formula's softmax over its
    masked keys and the NaN entry is, whether a mask hides its keys, a window leaves it none (Lq >
    Lk, bottom-right) or there are no keys at all: its state is the sink's lone entry, which gave
    output 0 and entropy 0 when the row skipped every key and NaN when it saw masked ones."""
    g = torch.Generator().manual_seed(15)
    q, k, v = (rand(1, 2, L, 8, gen=g, device=device) for L in (5, 3, 3))
    sinks = torch.tensor([float("nan"), 0.5], dtype=F64, device=device)
    mask = torch.ones(5, 3, dtype=torch.bool, device=device)
    mask[1] = False
    calls = {
        "masked row": dict(key=k, value=v, attn_mask=mask),
        "window": dict(key=k, value=v, is_causal=True, causal_alignment="bottom_right"),
        "no keys": dict(key=k[:, :, :0], value=v[:, :, :0]),
    }
    for name, kw in calls.items():
        res = ops.attention(q, sinks=sinks, return_stats=True, **kw)
        for i in (0, 1, 2, 3, 4, 9, 10):  # output, lse, entropy, sum_p2, max_weight, the derived
            assert torch.isnan(res[i][:, 0]).all(), f"{name}: {OUT_NAMES[i]}"
            assert not torch.isnan(res[i][:, 1]).any(), f"{name}: {OUT_NAMES[i]}"
        # (normalized entropy is 0 by definition on a row of one entry, the sink alone)
        empty = res[5][:, 0] == 0
        assert empty.any() and (res[8][:, 0][empty] == 0).all(), name


@pytest.mark.parametrize("device", DEVICES)
def test_huge_window_bounds_are_unbounded(device: str) -> None:
    """Window bounds of 2^62 or more (sys.maxsize) mean unbounded: they overflowed the range
    arithmetic and left rows with no key (output 0) where they see every key."""
    g = torch.Generator().manual_seed(15)
    q, k, v = rand(1, 1, 9, 8, gen=g, device=device), rand(1, 1, 6, 8, gen=g, device=device), rand(1, 1, 6, 8, gen=g, device=device)
    full = torch_ext.attention(q, k, v, return_stats=True)
    for window, align in (((-1, 2**63 - 1), "top_left"), ((2**63 - 1, -1), "bottom_right"), ((2**62, 2**62), "top_left")):
        for attend in (torch_ext.attention, None):
            if attend is None:  # the raw op, as LibTorch callers reach it
                res = ops.attention(q, k, v, window_size=list(window), causal_alignment=align)
                out, n = res[0], res[5]
            else:
                out, stats = attend(q, k, v, window_size=window, causal_alignment=align, return_stats=True)
                n = stats.n_keys
            assert (n == 6).all(), (window, align)
            torch.testing.assert_close(out, full[0], msg=lambda s: f"{window} {align}: {s}")


@pytest.mark.parametrize("device", DEVICES)
def test_sink_of_plus_infinity_takes_every_weight(device: str) -> None:
    """A sink of +inf holds the whole weight: output 0, and no gradient reaches the sink or the keys
    (its gradient was exp(inf - inf) = NaN)."""
    g = torch.Generator().manual_seed(14)
    q, k, v = (rand(1, 2, L, 8, gen=g, device=device).requires_grad_() for L in (4, 6, 6))
    sinks = torch.tensor([float("inf"), 0.5], dtype=F64, device=device, requires_grad=True)
    res = ops.attention(q, k, v, sinks=sinks, return_stats=True)
    assert torch.isfinite(res[0]).all() and (res[0][:, 0] == 0).all()
    grads = torch.autograd.grad(res[0].square().sum() + res[2].sum(), (q, k, v, sinks))
    assert all(torch.isfinite(gr).all() for gr in grads)
    assert grads[3][0] == 0 and (grads[0][:, 0] == 0).all() and grads[3][1] != 0
