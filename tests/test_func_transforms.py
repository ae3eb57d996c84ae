"""torch.func transforms (grad, vjp, jacrev, vmap of grad) through the ops, and the tracing paths
that must not freeze or specialize values: torch.compile with dynamic sizes and float arguments,
torch.export with dropout, torch.jit.trace with dropout (refused).

The ops' autograd is a C++ function, which torch.func cannot transform; under a transform the
wrappers use Python autograd functions (torch_ext/_functorch.py) whose backward is the same
registered op. Each gradient here is checked against plain autograd of the same call in float64
(itself checked against the float64 reference in test_attention_backward.py)."""

from __future__ import annotations

import math
import re
import warnings
from collections import Counter
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch._dynamo.testing
from torch import Tensor
from torch.func import functional_call, grad, jacrev, vjp, vmap
from torch.utils._python_dispatch import TorchDispatchMode

import torch_ext

F64 = torch.float64
TOL = dict(rtol=1e-10, atol=1e-10)


def rand(*shape: int, seed: int = 0) -> Tensor:
    return torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(seed))


def loss_of(out: Any) -> Tensor:
    """A loss that reaches every differentiable output: output and, with statistics, lse,
    entropy and the statistics derived from entropy and sum_p2."""
    if isinstance(out, tuple):
        o, s = out
        terms = [o.square().sum(), s.lse.sum(), s.entropy.sum(), s.normalized_entropy.sum(), s.sparsity.sum(),
                 s.effective_keys.sum()]
        return sum(w * t for w, t in zip((1.0, 0.3, 0.7, 0.2, 0.4, -0.1), terms))
    return out.square().sum()


def autograd_grads(f: Callable[..., Tensor], args: Tuple[Tensor, ...]) -> Tuple[Tensor, ...]:
    leaves = [a.detach().clone().requires_grad_() for a in args]
    return torch.autograd.grad(f(*leaves), leaves)


CASES: Dict[str, Dict[str, Any]] = {
    "plain": {},
    "causal_stats": dict(is_causal=True, return_stats=True),
    "gqa_window_softcap": dict(enable_gqa=True, window_size=(2, 1), softcap=3.0, return_stats=True),
    "logn_sinks": dict(scale="logn", train_length=4, sinks=True, return_stats=True),
    "float_mask": dict(mask=True, return_stats=True),
    "scale_tensor": dict(scale_tensor=True, return_stats=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_grad_equals_autograd(case: str) -> None:
    """torch.func.grad with respect to every tensor argument (query, key, value, and the float
    mask, scale tensor or sinks where the case has one) equals torch.autograd.grad."""
    kw = dict(CASES[case])
    H, Hkv = 4, (2 if kw.get("enable_gqa") else 4)
    args: List[Tensor] = [rand(2, H, 5, 8, seed=1), rand(2, Hkv, 6, 8, seed=2), rand(2, Hkv, 6, 3, seed=3)]
    names = ["query", "key", "value"]
    optional = (("mask", "attn_mask", rand(1, H, 5, 6, seed=4)), ("scale_tensor", "scale", rand(H, 1, seed=5).abs()),
                ("sinks", "sinks", rand(H, seed=6)))
    for flag, name, t in optional:
        if kw.pop(flag, False):
            args.append(t)
            names.append(name)

    def f(*xs: Tensor) -> Tensor:
        return loss_of(torch_ext.attention(**dict(kw, **dict(zip(names, xs)))))

    got = grad(f, argnums=tuple(range(len(args))))(*args)
    for name, g, ref in zip(names, got, autograd_grads(f, tuple(args))):
        torch.testing.assert_close(g, ref, **TOL, msg=lambda m, name=name: f"{name}: {m}")


def test_vjp_and_jacrev() -> None:
    """vjp with cotangents for the output and the statistics, and jacrev of a small call, equal
    plain autograd's vector-Jacobian products."""
    q, k, v = rand(1, 2, 3, 4, seed=1), rand(1, 2, 4, 4, seed=2), rand(1, 2, 4, 2, seed=3)

    def f(q: Tensor) -> Tuple[Tensor, Tensor]:
        out, stats = torch_ext.attention(q, k, v, is_causal=True, return_stats=True)
        return out, stats.entropy

    outs, pullback = vjp(f, q)
    cot = (rand(*outs[0].shape, seed=7), rand(*outs[1].shape, seed=8))
    (got,) = pullback(cot)
    leaf = q.clone().requires_grad_()
    ref_out, ref_ent = f(leaf)
    (ref,) = torch.autograd.grad((ref_out, ref_ent), leaf, cot)
    torch.testing.assert_close(got, ref, **TOL)

    jac = jacrev(lambda q: torch_ext.attention(q, k, v))(q)
    ref_jac = torch.autograd.functional.jacobian(lambda q: torch_ext.attention(q, k, v), q)
    torch.testing.assert_close(jac, ref_jac, **TOL)


def test_per_sample_grads_of_the_module() -> None:
    """vmap(grad(...)) over a batch (per-sample gradients, as with torch.nn.MultiheadAttention)
    equals one autograd call per sample."""
    torch.manual_seed(0)
    mha = torch_ext.nn.MultiheadAttention(8, 2, batch_first=True, scale="logn", train_length=4, dtype=F64)
    params = {n: p.detach() for n, p in mha.named_parameters()}
    x = rand(3, 5, 8, seed=1)

    def loss(p: Dict[str, Tensor], xi: Tensor) -> Tensor:
        out = functional_call(mha, p, (xi[None], xi[None], xi[None]), {"need_weights": False, "is_causal": False})
        return out[0].square().sum()

    per_sample = vmap(grad(loss), in_dims=(None, 0))(params, x)
    for i in range(x.shape[0]):
        mha.zero_grad()
        loss(dict(mha.named_parameters()), x[i]).backward()
        for n, p in mha.named_parameters():
            torch.testing.assert_close(per_sample[n][i], p.grad, **TOL, msg=lambda m, n=n: f"sample {i}, {n}: {m}")


#: name -> (the wrapper's keyword arguments, the tensors: name -> (per-sample tensor, vmapped?)).
#: Per sample: query (2, 4, 5, 8), key and value (2, Hkv, 6, 8 / 3); a batch of 2 inside each
#: sample, so that folding the samples into it is exercised with B > 1.
VMAP_CASES: Dict[str, Tuple[Dict[str, Any], Dict[str, Tuple[Tensor, bool]]]] = {
    "all_vmapped": (dict(is_causal=True, scale="logn", train_length=4, return_stats=True), {}),
    "shared_kv": (dict(return_stats=True), dict(key=(rand(2, 4, 6, 8, seed=12), False),
                                                value=(rand(2, 4, 6, 3, seed=13), False))),
    "gqa_window_softcap": (dict(enable_gqa=True, window_size=(2, 1), softcap=3.0, return_stats=True),
                           dict(key=(rand(2, 2, 6, 8, seed=12), True), value=(rand(2, 2, 6, 3, seed=13), True))),
    "shared_mask_2d": (dict(return_stats=True), dict(attn_mask=(rand(5, 6, seed=14), False))),
    "shared_mask_batch": (dict(), dict(attn_mask=(rand(2, 1, 5, 6, seed=14), False))),
    "vmapped_mask_batch_1": (dict(return_stats=True), dict(attn_mask=(rand(1, 4, 5, 6, seed=14), True))),
    "vmapped_bool_mask": (dict(is_causal=True), dict(attn_mask=(rand(2, 1, 5, 6, seed=14) > -0.5, True))),
    "shared_scale": (dict(return_stats=True), dict(scale=(rand(4, 1, seed=15).abs(), False))),
    "vmapped_scale": (dict(scale="logn", train_length=4), dict(scale=(rand(2, 4, 1, seed=15).abs(), True))),
    "shared_sinks": (dict(return_stats=True), dict(sinks=(rand(4, seed=16), False))),  # (its gradient: per sample)
    "vmapped_sinks": (dict(), dict(sinks=(rand(4, seed=16), True))),
}


def _vmap_case(case: str, samples: int = 3) -> Tuple[Dict[str, Any], List[str], List[Tensor], List[bool]]:
    """The case's keyword arguments, tensor names, tensors (vmapped ones with the samples first)
    and whether each is vmapped."""
    kw, extra = VMAP_CASES[case]
    tensors = {"query": (rand(2, 4, 5, 8, seed=1), True), "key": (rand(2, 4, 6, 8, seed=2), True),
               "value": (rand(2, 4, 6, 3, seed=3), True), **extra}
    names, values, vmapped = [], [], []
    for i, (name, (t, batched)) in enumerate(tensors.items()):
        if batched:  # each sample its own values (a bool mask: its own pattern)
            g = torch.Generator().manual_seed(100 + i)
            noise = torch.randn(samples, *t.shape, dtype=F64, generator=g)
            t = (noise > -0.5) if t.dtype == torch.bool else t + 0.5 * noise
            if name == "scale":
                t = t.abs()
        names.append(name)
        values.append(t)
        vmapped.append(batched)
    return kw, names, values, vmapped


class _OpCalls(TorchDispatchMode):
    """Counts the calls of the entropy_attn ops that reach the kernels (below every transform)."""

    def __enter__(self) -> Counter:
        self.counts: Counter = Counter()
        super().__enter__()
        return self.counts

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "entropy_attn":
            self.counts[func._opname] += 1
        return func(*args, **(kwargs or {}))


def _attention_loss(kw: Dict[str, Any], names: List[str]) -> Callable[..., Tensor]:
    return lambda *xs: loss_of(torch_ext.attention(**dict(kw, **dict(zip(names, xs)))))


@pytest.mark.parametrize("case", list(VMAP_CASES))
def test_vmap_equals_one_call_per_sample(case: str) -> None:
    """vmap of the op (every output and statistic) and vmap(grad) with respect to every float
    tensor equal one plain autograd call per sample, each tensor vmapped or shared, the vmapped dim
    first or last; the dense cases make one call (no torch fallback, which warns)."""
    kw, names, values, vmapped = _vmap_case(case)
    in_dims = tuple(0 if b else None for b in vmapped)
    argnums = tuple(i for i, t in enumerate(values) if t.is_floating_point())
    loss = _attention_loss(kw, names)

    def sample(i: int) -> List[Tensor]:
        return [t[i] if b else t for t, b in zip(values, vmapped)]

    with warnings.catch_warnings(), _OpCalls() as calls:
        warnings.simplefilter("error", UserWarning)  # torch's fallback warns "There is a performance drop"
        outs = vmap(lambda *xs: torch_ext.attention(**dict(kw, **dict(zip(names, xs)))), in_dims=in_dims)(*values)
        forward_calls = calls.pop("attention")
        grads = vmap(grad(loss, argnums=argnums), in_dims=in_dims)(*values)
        # One call of each op for the samples together; per sample where sinks are vmapped (the
        # forward) or their gradient is wanted (the backward).
        assert (forward_calls, calls.pop("attention"), calls.pop("attention_backward")) == (
            (3, 3, 3) if case == "vmapped_sinks" else (1, 1, 3) if "sinks" in case else (1, 1, 1)), case
        last = [t.movedim(0, -1) if b else t for t, b in zip(values, vmapped)]
        grads_last = vmap(grad(loss, argnums=argnums), in_dims=tuple(-1 if b else None for b in vmapped))(*last)
    outs = outs if isinstance(outs, tuple) else (outs,)
    for i in range(3):
        ref = torch_ext.attention(**dict(kw, **dict(zip(names, sample(i)))))
        ref = ref if isinstance(ref, tuple) else (ref,)
        torch.testing.assert_close(outs[0][i], ref[0], **TOL)
        if len(ref) > 1:
            for field in ("lse", "entropy", "normalized_entropy", "sparsity", "effective_keys", "max_weight", "n_keys",
                          "scale"):
                torch.testing.assert_close(getattr(outs[1], field)[i], getattr(ref[1], field), **TOL,
                                           msg=lambda m, field=field: f"sample {i}, {field}: {m}")
        leaves = [t.detach().clone().requires_grad_(j in argnums) for j, t in enumerate(sample(i))]
        refs = torch.autograd.grad(loss(*leaves), [leaves[j] for j in argnums])
        for j, got, got_last, r in zip(argnums, grads, grads_last, refs):
            torch.testing.assert_close(got[i], r, **TOL, msg=lambda m, j=j: f"sample {i}, {names[j]}: {m}")
            torch.testing.assert_close(got_last[i], r, **TOL, msg=lambda m, j=j: f"sample {i}, {names[j]} (last): {m}")


def test_grad_of_vmap_and_nested_vmap() -> None:
    """grad of a vmapped loss (the folded call differentiated once) and vmap of vmap (each level
    folds into the batch) equal plain autograd over the stacked samples."""
    kw, names, values, vmapped = _vmap_case("gqa_window_softcap")
    loss = _attention_loss(kw, names)
    per_sample = vmap(lambda *xs: torch_ext.attention(**dict(kw, **dict(zip(names, xs))))[0])

    def total(*xs: Tensor) -> Tensor:
        return per_sample(*xs).square().sum()

    got = grad(total, argnums=(0, 1, 2))(*values)
    leaves = [t.detach().clone().requires_grad_() for t in values]
    ref = sum(torch_ext.attention(**dict(kw, **dict(zip(names, (t[i] for t in leaves)))))[0].square().sum()
              for i in range(3))
    refs = torch.autograd.grad(ref, leaves)
    for name, g, r in zip(names, got, refs):
        torch.testing.assert_close(g, r, **TOL, msg=lambda m, name=name: f"{name}: {m}")
    nested = vmap(vmap(grad(loss, argnums=0)))(*(t.unflatten(0, (3, 1)).expand(3, 2, *t.shape[1:]) for t in values))
    flat = vmap(grad(loss, argnums=0))(*values)
    torch.testing.assert_close(nested, flat[:, None].expand_as(nested), **TOL)


def test_vmap_folds_in_chunks_past_the_largest_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Samples that would fold past the largest batch (65535, the CUDA tensor-core kernels' limit;
    4 here) fold in chunks: 5 samples of batch 2 make 3 calls of each op, with the per-sample
    results (attention, its gradient with a shared learned mask, attention_sparsity)."""
    from torch_ext import _functorch

    monkeypatch.setattr(_functorch, "_MAX_FOLDED_BATCH", 4)
    q, k, v, mask = rand(5, 2, 3, 4, 8, seed=1), rand(5, 2, 3, 6, 8, seed=2), rand(5, 2, 3, 6, 4, seed=3), rand(1, 3, 4, 6)
    loss = _attention_loss(dict(is_causal=True, scale="logn", train_length=4), ["query", "key", "value", "attn_mask"])
    with _OpCalls() as calls:
        out = vmap(lambda q, k, v: torch_ext.attention(q, k, v, mask))(q, k, v)
        grads = vmap(grad(loss, argnums=(0, 1, 2, 3)), in_dims=(0, 0, 0, None))(q, k, v, mask)
        sparsity = vmap(lambda q, k: torch_ext.attention_sparsity(q, k, mask))(q, k)
    assert dict(calls) == {"attention": 6, "attention_backward": 3, "attention_sparsity": 3}
    for i in range(5):
        torch.testing.assert_close(out[i], torch_ext.attention(q[i], k[i], v[i], mask), **TOL)
        torch.testing.assert_close(sparsity[i], torch_ext.attention_sparsity(q[i], k[i], mask), **TOL)
        for got, ref in zip(grads, autograd_grads(loss, (q[i], k[i], v[i], mask))):
            torch.testing.assert_close(got[i], ref, **TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_vmap_gradient_of_a_shared_16_bit_bias_rounds_once(dtype: torch.dtype) -> None:
    """A 16-bit learned bias and scale shared by the samples: their per-sample gradients under
    vmap equal one call per sample exactly (the folded call returned one rounded gradient per batch
    row, whose sum over the batch of 64 was 1.6% off in bfloat16)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 64, 2, 5, 8, generator=g).to(dtype) for _ in range(3))
    bias, scale = torch.randn(5, 5, generator=g).to(dtype), torch.rand(2, 1, generator=g).to(dtype) + 0.5
    loss = _attention_loss(dict(is_causal=True), ["query", "key", "value", "attn_mask", "scale"])
    got = vmap(grad(lambda *xs: loss(*xs).float(), argnums=(3, 4)), in_dims=(0, 0, 0, None, None))(q, k, v, bias, scale)
    for i in range(2):
        leaves = [t.clone().requires_grad_(j >= 3) for j, t in enumerate((q[i], k[i], v[i], bias, scale))]
        ref = torch.autograd.grad(loss(*leaves).float(), leaves[3:])
        for a, b in zip(got, ref):
            assert a.dtype == dtype and torch.equal(a[i], b), (a[i] - b).abs().max()


def test_varlen_under_vmap() -> None:
    """varlen_attention under vmap runs once per sample: offsets that differ per sample (their
    gradients failed: the offsets reached the gradient op unsliced), no sample (torch's fallback
    failed), and a refused call after a valid one raises the op's ValueError (after the fallback's
    warning it was a SystemError)."""
    q, k, v = (rand(3, 5, 2, 4, seed=s) for s in range(3))
    cu = torch.tensor([[0, 2, 5], [0, 1, 5], [0, 4, 5]], dtype=torch.int32)

    def loss(q: Tensor, k: Tensor, v: Tensor, c: Tensor) -> Tensor:
        return torch_ext.varlen_attention(q, k, v, c, c, 4, 4, is_causal=True).square().sum()

    refs = [autograd_grads(lambda q, k, v: loss(q, k, v, cu[i]), (q[i], k[i], v[i])) for i in range(3)]
    for got in (vmap(grad(loss, argnums=(0, 1, 2)))(q, k, v, cu),
                grad(lambda q, k, v: vmap(loss)(q, k, v, cu).sum(), argnums=(0, 1, 2))(q, k, v)):
        for g, ref in zip(got, zip(*refs)):
            torch.testing.assert_close(g, torch.stack(ref), **TOL)
    none = vmap(grad(loss), in_dims=(0, 0, 0, None))(q[:0], k[:0], v[:0], cu[0])
    assert none.shape == (0, 5, 2, 4)
    three_heads = rand(5, 3, 4)
    with pytest.raises(ValueError, match="must be a multiple of the number of key/value heads"):
        vmap(lambda q: torch_ext.varlen_attention(q, three_heads, three_heads, cu[0], cu[0], 4, 4,
                                                  enable_gqa=True))(q)


def test_length_factor_and_sparsity_under_vmap() -> None:
    """length_factor (elementwise) and attention_sparsity (folded) make one call under vmap, with the
    per-sample values, also for no sample; so do per-sample gradients of the module with
    need_weights=True and a learnable scale, which calls length_factor."""
    n = torch.randint(0, 50, (3, 4))
    with warnings.catch_warnings(), _OpCalls() as calls:
        warnings.simplefilter("error", UserWarning)
        factors = vmap(lambda n: torch_ext.length_factor(n, "logn"), in_dims=1)(n)
        torch.testing.assert_close(factors, torch_ext.length_factor(n.T, "logn"), rtol=0, atol=0)
        q, k = rand(3, 1, 2, 4, 8, seed=1), rand(1, 2, 6, 8, seed=2)
        sparsity = vmap(lambda q: torch_ext.attention_sparsity(q, k, kind="relu2", is_causal=True))(q)
        assert vmap(lambda q: torch_ext.attention_sparsity(q, k))(q[:0]).shape == (0, 1, 2, 4)
        assert vmap(lambda n: torch_ext.length_factor(n))(n[:0]).shape == (0, 4)
        mha = torch_ext.nn.MultiheadAttention(8, 2, batch_first=True, scale="logn", learnable_scale=True, dtype=F64)
        params = {name: p.detach() for name, p in mha.named_parameters()}
        x = rand(3, 5, 8, seed=3)
        per_sample = vmap(grad(lambda p, xi: functional_call(mha, p, (xi[None],) * 3)[0].square().sum()),
                          in_dims=(None, 0))(params, x)
    assert calls["attention_sparsity"] == 2 and calls["length_factor"] >= 1  # (3 samples, then none)
    for i in range(3):
        torch.testing.assert_close(sparsity[i], torch_ext.attention_sparsity(q[i], k, kind="relu2", is_causal=True),
                                   **TOL)
        mha.zero_grad()
        mha(x[i : i + 1], x[i : i + 1], x[i : i + 1])[0].square().sum().backward()
        torch.testing.assert_close(per_sample["head_scale"][i], mha.head_scale.grad, **TOL)


def test_varlen_grad_equals_autograd() -> None:
    """torch.func.grad through varlen_attention (packed documents, GQA, a (T, H) scale tensor, sinks,
    statistics) equals torch.autograd.grad; with seqused_k (inference-only) it raises."""
    lengths = [3, 5, 2]
    cu = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
    T, H, Hkv = sum(lengths), 4, 2
    args = (rand(T, H, 8, seed=1), rand(T, Hkv, 8, seed=2), rand(T, Hkv, 3, seed=3), rand(T, 1, seed=4).abs(),
            rand(H, seed=5))

    def f(q: Tensor, k: Tensor, v: Tensor, scale: Tensor, sinks: Tensor) -> Tensor:
        return loss_of(torch_ext.varlen_attention(q, k, v, cu, cu, 5, 5, scale=scale, sinks=sinks, is_causal=True,
                                                  enable_gqa=True, return_stats=True))

    got = grad(f, argnums=(0, 1, 2, 3, 4))(*args)
    for name, g, ref in zip(("query", "key", "value", "scale", "sinks"), got, autograd_grads(f, args)):
        torch.testing.assert_close(g, ref, **TOL, msg=lambda m, name=name: f"{name}: {m}")

    used = torch.tensor([2, 5, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="seqused_k is inference-only"):
        grad(lambda q: torch_ext.varlen_attention(q, args[1], args[2], cu, cu, 5, 5, seqused_k=used,
                                                  enable_gqa=True).sum())(args[0])


@pytest.mark.parametrize("op", ["attention", "varlen_attention"])
def test_grad_under_autocast_equals_autograd(op: str) -> None:
    """Under torch.autocast, float32 inputs reach the op in the region's dtype on both paths, so
    torch.func.grad equals torch.autograd.grad bit for bit (the Python Function saved the float32
    inputs and recomputed the weights from them against the bfloat16 call's lse: dq 0.6 off)."""
    g = torch.Generator().manual_seed(0)
    shape = (2, 4, 16, 8) if op == "attention" else (16, 4, 8)
    q = 6.0 * torch.randn(*shape, generator=g)
    k, v = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
    cu = torch.tensor([0, 7, 16], dtype=torch.int32)

    def f(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if op == "attention":
                out, stats = torch_ext.attention(q, k, v, is_causal=True, return_stats=True)
            else:
                out, stats = torch_ext.varlen_attention(q, k, v, cu, cu, 9, 9, is_causal=True, return_stats=True)
        assert out.dtype == torch.bfloat16
        return out.float().square().sum() + stats.entropy.sum()

    got = grad(f, argnums=(0, 1, 2))(q, k, v)
    for name, a, b in zip("qkv", got, autograd_grads(f, (q, k, v))):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, name=name: f"d{name}: {m}")


def test_transforms_of_jagged_attention_raise_naming_them() -> None:
    """torch.func.grad and vjp of attention on jagged nested tensors (which torch's own SDPA does
    not take under transforms either) raise naming the transforms and the argument, not the op's
    internal name (under a transform the jagged tensor is wrapped and passed for a dense one)."""
    x = torch.nested.nested_tensor([rand(3, 2, 4, seed=1), rand(5, 2, 4, seed=2)], layout=torch.jagged)

    def f(x: Tensor) -> Tensor:
        return torch_ext.attention(x.transpose(1, 2), x.transpose(1, 2), x.transpose(1, 2), is_causal=True,
                                   return_stats=True)[0]

    match = "torch.func transforms .* jagged nested tensors are not supported \\(query is one\\)"
    with pytest.raises(NotImplementedError, match=match):
        grad(lambda x: f(x).values().sum())(x)
    with pytest.raises(NotImplementedError, match=match):
        vjp(f, x)
    # Jagged inputs the transform does not wrap (closed over, the scale or the query transformed);
    # a wrapped dense query against closed-over jagged keys said the query was dense.
    q = x.transpose(1, 2)
    with pytest.raises(NotImplementedError, match=match):
        grad(lambda s: torch_ext.attention(q, q, q, scale=s).values().sum())(torch.tensor(0.5, dtype=F64))
    with pytest.raises(NotImplementedError, match=match.replace("query", "key")):
        grad(lambda d: torch_ext.attention(d, q, q).sum())(rand(2, 2, 3, 4, seed=3))


@pytest.mark.parametrize("name", ["entropy", "sparsity"])
def test_row_reductions_under_transforms(name: str) -> None:
    """grad and vmap(grad) through torch_ext.entropy / sparsity equal plain autograd."""
    fn = getattr(torch_ext, name)
    x = rand(3, 6, seed=1).softmax(-1)
    ref = autograd_grads(lambda x: fn(x, 0).square().sum(), (x,))[0]
    torch.testing.assert_close(grad(lambda x: fn(x, 0).square().sum())(x), ref, **TOL)
    rows = vmap(grad(lambda r: fn(r).square().sum()))(x)
    for i in range(x.shape[0]):
        torch.testing.assert_close(rows[i], autograd_grads(lambda r: fn(r).square().sum(), (x[i],))[0], **TOL)


@pytest.mark.parametrize("name", ["entropy", "sparsity"])
def test_row_reductions_vmap_in_one_call(name: str) -> None:
    """vmap of entropy / sparsity over any dim of the samples, reducing any dim of each, equals
    one call per sample, in one call (torch's fallback, which warns, made one per sample); a dim
    out of a sample's range raises the message a sample's call gives (-3 of a 2-D sample would
    otherwise reduce over the samples)."""
    fn = getattr(torch_ext, name)
    x = rand(3, 4, 5, seed=2).softmax(-1)
    for vmapped_dim in (0, 1):
        for dim in (0, 1, -1, -2):
            with warnings.catch_warnings(), _OpCalls() as calls:
                warnings.simplefilter("error", UserWarning)
                got = vmap(lambda t: fn(t, dim), in_dims=vmapped_dim)(x)
            assert calls[name] == 1
            ref = torch.stack([fn(s, dim) for s in x.unbind(vmapped_dim)])
            torch.testing.assert_close(got, ref, rtol=0, atol=0)
    for dim in (2, -3):
        with pytest.raises(ValueError) as plain:
            fn(x[0], dim)
        with pytest.raises(ValueError, match=re.escape(str(plain.value))):
            vmap(lambda t: fn(t, dim))(x)
    # jacrev (vmap over a vjp: the backward op under vmap, which fell back to a call per cotangent)
    # and its second order equal autograd's, without torch's fallback.
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        for dim in (0, -1):
            ref = torch.autograd.functional.jacobian(lambda t: fn(t, dim), x[0])
            torch.testing.assert_close(jacrev(lambda t: fn(t, dim))(x[0]), ref, **TOL)
        ref = torch.autograd.functional.hessian(lambda t: fn(t).sum(), x[0, 0])
        torch.testing.assert_close(jacrev(grad(lambda t: fn(t).sum()))(x[0, 0]), ref, **TOL)


# --- tracing that must not freeze or specialize values ------------------------------------------
@pytest.mark.parametrize("name", ["entropy", "sparsity"])
def test_row_reductions_compile_dynamic_sizes(name: str) -> None:
    """The row reductions' Meta kernel keeps sizes symbolic: torch.compile(dynamic=True) compiles
    once for every size, and torch.export takes a dynamic dim (the sizes were constants)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    fn = getattr(torch_ext, name)
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    compiled = torch.compile(lambda p: fn(p), fullgraph=True, dynamic=True, backend=counter)
    for n in (5, 9, 12):
        p = torch.rand(3, n).softmax(-1).requires_grad_()
        out = compiled(p)
        torch.testing.assert_close(out, fn(p))
        out.sum().backward()
    assert counter.frame_count == 1

    class M(torch.nn.Module):
        def forward(self, p: Tensor) -> Tensor:
            return fn(p)

    ep = torch.export.export(M(), (torch.rand(3, 5),), dynamic_shapes={"p": {1: torch.export.Dim("n", min=2)}})
    p = torch.rand(3, 11).softmax(-1)
    torch.testing.assert_close(ep.module()(p), fn(p))


def test_length_factor_and_head_dim_stay_symbolic() -> None:
    """length_factor's Meta kernel keeps its size symbolic (it fixed it: a graph per sequence
    length for code that builds a whole row's lambda, e.g. the module's need_weights path), and
    float32 inputs do not specialize the head dim (the float32 range check of the base scale read
    it even with scale_factor given)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    lf = torch.compile(lambda n: torch_ext.length_factor(n, "logn", train_length=8), fullgraph=True,
                       dynamic=True, backend=counter)
    frames = []
    for length in (5, 9, 12):
        n = torch.arange(1, length + 1)
        torch.testing.assert_close(lf(n), torch_ext.length_factor(n, "logn", train_length=8))
        frames.append(counter.frame_count)
    assert frames[0] == frames[-1], frames  # (the first call may count 2: dynamo restarts once)

    class M(torch.nn.Module):
        def forward(self, q: Tensor, n: Tensor) -> Tensor:
            lam = torch_ext.length_factor(n, "logn", train_length=8)[None, None]  # (a per-row scale)
            return torch_ext.attention(q, q, q, scale=lam, is_causal=True)

    q32, n = torch.randn(1, 2, 7, 8), torch.arange(1, 8)
    L, D = torch.export.Dim("L", min=2, max=64), torch.export.Dim("D", min=2, max=64)
    ep = torch.export.export(M(), (q32, n), dynamic_shapes=({2: L, 3: D}, {0: L}))
    q, n = torch.randn(1, 2, 11, 16), torch.arange(1, 12)
    torch.testing.assert_close(ep.module()(q, n), M()(q, n))


def test_fake_mode_without_shape_env_and_dropout() -> None:
    """A plain FakeTensorMode (shape inference, memory estimation: no ShapeEnv) runs a call with
    dropout as it runs SDPA's; drawing the seed's value raised DataDependentOutputException."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.randn(2, 4, 9, 16, requires_grad=True)
        out, stats = torch_ext.attention(q, q, q, dropout_p=0.2, return_stats=True)
        out.sum().backward()
    assert out.shape == (2, 4, 9, 16) and stats.entropy.shape == (2, 4, 9) and q.grad.shape == q.shape


def test_compile_float_arguments_from_sizes_and_attributes() -> None:
    """A float scale or softcap computed from a size or read from a module attribute (a SymFloat
    under dynamic=True) compiles with fullgraph=True, as SDPA's scale does (math.isfinite refused
    SymFloats)."""
    q, k, v = rand(1, 2, 5, 8, seed=1), rand(1, 2, 5, 8, seed=2), rand(1, 2, 5, 8, seed=3)

    def f(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return torch_ext.attention(q, k, v, scale=1 / math.sqrt(q.size(-1)), softcap=4.0 * math.sqrt(q.size(-1)))

    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(f, fullgraph=True, dynamic=True)(q, k, v), f(q, k, v), **TOL)
    mha = torch_ext.nn.MultiheadAttention(8, 2, batch_first=True, scale=0.3, dtype=F64)
    x = rand(2, 5, 8, seed=4)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: mha(x, x, x, need_weights=False)[0], fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(x), mha(x, x, x, need_weights=False)[0], **TOL)


@pytest.mark.parametrize("argument", ["softcap", "window_size"])
def test_export_names_the_dim_a_number_argument_ties(argument: str) -> None:
    """A float (softcap) or int (window_size) argument computed from a dynamic dim is specialized
    by the schema's float or int, which torch.export reports as a violated constraint on that dim
    (the wrapper said the SymFloat was no number, and the SymInt no int: a TypeError, a
    ValueError)."""

    class M(torch.nn.Module):
        def forward(self, q: Tensor) -> Tensor:
            tied = dict(softcap=q.shape[2] / 2) if argument == "softcap" else dict(window_size=(q.shape[2] // 2, 0))
            return torch_ext.attention(q, q, q, **tied)

    for strict in (False, True):
        with pytest.raises(torch._dynamo.exc.UserError, match=r"Constraints violated \(L\)"):
            torch.export.export(M(), (rand(1, 2, 6, 4),), dynamic_shapes=({2: torch.export.Dim("L", min=2, max=64)},),
                                strict=strict)


def test_compile_of_a_transform() -> None:
    """torch.compile of grad and vmap(grad) through the op gives the eager gradients (the ops'
    Python autograd functions run eagerly there, a graph break); with fullgraph=True Dynamo raises
    (the op's C++ autograd refuses the transform's tensors inside its trace), as the README says.
    vmap alone compiles in one graph."""
    q = rand(3, 1, 2, 5, 4, seed=1)

    def f(x: Tensor) -> Tensor:
        return loss_of(torch_ext.attention(x, x, x, is_causal=True, scale="logn", return_stats=True))

    per_sample = vmap(grad(f))
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(grad(f), backend="aot_eager")(q[0]), grad(f)(q[0]), **TOL)
    torch.testing.assert_close(torch.compile(per_sample, backend="aot_eager")(q), per_sample(q), **TOL)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(vmap(lambda x: torch_ext.attention(x, x, x)), backend="aot_eager",
                                             fullgraph=True)(q), vmap(lambda x: torch_ext.attention(x, x, x))(q),
                               **TOL)
    torch._dynamo.reset()
    with pytest.raises((torch._dynamo.exc.Unsupported, torch._dynamo.exc.TorchRuntimeError),
                       match=r"cannot use C\+\+ torch::autograd::Function"):
        torch.compile(grad(f), backend="aot_eager", fullgraph=True)(q[0])


def test_compile_lengths_from_data() -> None:
    """Query rows selected by a boolean mask (unpadding: x[keep], a length unbacked while traced)
    compile with fullgraph=True under Inductor, dense and packed, forward and backward, and one
    graph serves every count, 0 and 1 included. The layout rule took an unbacked length for 0
    (the guard `SymInt > 1` failed), and the Meta kernel's strides must then match the
    transposed output the kernels return."""
    H, D = 2, 8

    def dense(x: Tensor, keep: Tensor) -> Tensor:
        t = x[keep].view(-1, H, D).transpose(0, 1).unsqueeze(0)  # (1, H, T, D), heads inside rows
        out, stats = torch_ext.attention(t, t, t, is_causal=True, return_stats=True)
        return out.transpose(1, 2).flatten(2) * stats.entropy.sum(1)[..., None]

    def packed(x: Tensor, keep: Tensor, cu: Tensor) -> Tensor:
        t = x[keep].view(-1, H, D)
        return torch_ext.varlen_attention(t, t, t, cu, cu, 12, 12, is_causal=True).flatten(1)

    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        torch._dynamo.reset()
        counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
        compiled_dense = torch.compile(dense, backend=counter, fullgraph=True)
        compiled_packed = torch.compile(packed, backend=counter, fullgraph=True)
        for kept in (10, 1, 0):
            x = rand(12, H * D, seed=kept).requires_grad_()
            keep = torch.zeros(12, dtype=torch.bool)
            keep[torch.randperm(12, generator=torch.Generator().manual_seed(kept))[:kept]] = True
            cu = torch.tensor([0, kept // 2, kept], dtype=torch.int32)
            for fn, compiled, args in ((dense, compiled_dense, (x, keep)), (packed, compiled_packed, (x, keep, cu))):
                got, want = compiled(*args), fn(*args)
                torch.testing.assert_close(got, want, **TOL)
                torch.testing.assert_close(torch.autograd.grad(got.square().sum(), x),
                                           torch.autograd.grad(want.square().sum(), x), **TOL)
        assert counter.frame_count == 2
    torch._dynamo.reset()


def _compiled_autograd_graph_ops(backward: Callable[[], None]) -> List[str]:
    """Runs `backward` under compiled autograd (aot_eager) and returns the targets of the call
    nodes of every graph it compiled (Dynamo's and AOTAutograd's)."""
    targets: List[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: List[Tensor]) -> Callable[..., Any]:
        def record(inner: torch.fx.GraphModule, inner_inputs: List[Tensor]) -> Callable[..., Any]:
            targets.extend(str(n.target) for n in inner.graph.nodes if n.op == "call_function")
            return inner.forward

        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return torch._dynamo.backends.common.aot_autograd(fw_compiler=record)(gm, example_inputs)

    with torch._dynamo.compiled_autograd._enable(torch.compile(backend=backend)):
        backward()
    return targets


def test_compiled_autograd() -> None:
    """Compiled autograd (which FSDP2 with torch.compile uses) puts the op's C++ backward in its
    graph (the autograd functions are traceable: no eager call between two graphs) and gives
    eager's gradients, through the output, a statistic, and the entropy and sparsity ops. It first
    stopped at an internal assert (the function marked its non-differentiable outputs), then ran
    the backward eagerly, a break in the compiled backward graph."""
    q, k, v = (rand(1, 2, L, 8, seed=s).requires_grad_() for s, L in ((1, 6), (2, 9), (3, 9)))

    def loss() -> Tensor:
        out, stats = torch_ext.attention(q, k, v, is_causal=True, scale="logn", window_size=(4, -1),
                                         softcap=5.0, return_stats=True)
        assert not stats.max_weight.requires_grad and not stats.scale.requires_grad
        return (out.square().sum() + stats.entropy.sum() + torch_ext.entropy(out.softmax(-1)).sum()
                + torch_ext.sparsity(out, dim=2).sum())

    eager = torch.autograd.grad(loss(), (q, k, v))
    torch._dynamo.reset()
    ops = _compiled_autograd_graph_ops(lambda: loss().backward())
    for x, g in zip((q, k, v), eager):
        torch.testing.assert_close(x.grad, g, **TOL)
    assert not any("run_non_traceable" in t for t in ops), ops
    # The three C++ nodes in Dynamo's graph, and the attention backward op in AOTAutograd's (the
    # row reductions' backward ops are composite: ATen ops there).
    nodes = {t for t in ops if "CppNode" in t}
    for name in ("AttentionFunction", "entropy_backward", "sparsity_backward"):
        assert sum(name in t for t in nodes) == 1, (name, nodes)
    assert "entropy_attn.attention_backward.default" in ops, ops


def test_compiled_autograd_one_graph_for_every_dropout_mask() -> None:
    """Under compiled autograd the backward's dropout seed is a graph input, not a constant: steps
    with fresh masks (and new lengths) reuse the compiled graphs, dynamic after the first change,
    and each gives the gradients of its own mask (those of an eager step drawing the same seed)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    for step, L in enumerate((6, 9, 9, 12, 12)):
        q, k, v = (rand(2, 2, L, 8, seed=s).requires_grad_() for s in (1, 2, 3))

        def loss() -> Tensor:
            out = torch_ext.attention(q, k, v, is_causal=True, dropout_p=0.3)
            return out.square().sum()

        torch.manual_seed(step)
        eager = torch.autograd.grad(loss(), (q, k, v))
        torch.manual_seed(step)
        with torch._dynamo.compiled_autograd._enable(torch.compile(backend="aot_eager")):
            loss().backward()
        for x, g in zip((q, k, v), eager):
            torch.testing.assert_close(x.grad, g, **TOL)
    # One capture by compiled autograd; Dynamo compiles its graph once more when a lifted value
    # (the seed, the length) first changes, and then takes it as dynamic: two graphs, not one per
    # seed (a seed baked in as a constant would give five).
    assert counters["compiled_autograd"]["captures"] == 1
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])


def test_export_with_dropout_draws_a_seed_per_call() -> None:
    """torch.export (non-strict, its default) of a module with attention dropout works, as with
    SDPA and torch.nn.MultiheadAttention (int() of the drawn seed was a data-dependent guard),
    and the exported program draws a fresh mask per call."""
    mha = torch_ext.nn.MultiheadAttention(16, 2, dropout=0.5, batch_first=True).train()
    x = torch.randn(2, 5, 16)
    ep = torch.export.export(mha, (x, x, x), {"need_weights": False})
    first, second = ep.module()(x, x, x, need_weights=False)[0], ep.module()(x, x, x, need_weights=False)[0]
    assert first.shape == (2, 5, 16) and not torch.equal(first, second)


def test_jit_trace_refuses_dropout() -> None:
    """torch.jit.trace would freeze the drawn dropout seed into the trace (the same mask on every
    call): it raises, naming the ways that work; without dropout tracing works."""
    class SelfAttention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mha = torch_ext.nn.MultiheadAttention(16, 2, dropout=0.5, batch_first=True)

        def forward(self, x: Tensor) -> Tensor:
            return self.mha(x, x, x, need_weights=False)[0]

    model, x = SelfAttention(), torch.randn(2, 5, 16)
    with pytest.raises(RuntimeError, match="torch.jit.trace cannot trace attention dropout"):
        torch.jit.trace(model.train(), (x,))
    traced = torch.jit.trace(model.eval(), (x,))
    torch.testing.assert_close(traced(x), model(x))


def test_vmap_randomness_of_dropout() -> None:
    """vmap's randomness modes with attention dropout, as SDPA: "error" raises vmap's error,
    "same" gives every sample the same mask, and "different" (a seed per sample, which the op's
    one seed per call cannot carry) raises naming dropout_p instead of failing inside .item()."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64, generator=g).expand(3, 1, 2, 4, 8).clone()
    k, v = (torch.randn(1, 2, 7, 8, dtype=torch.float64, generator=g) for _ in range(2))

    def f(x: Tensor) -> Tensor:
        return torch_ext.attention(x, k, v, dropout_p=0.5)

    with pytest.raises(RuntimeError, match="randomness error mode"):
        vmap(f)(q)
    out = vmap(f, randomness="same")(q)
    assert torch.equal(out[0], out[1]) and torch.equal(out[1], out[2])
    assert not torch.equal(out[0], torch_ext.attention(q[0], k, v))  # (some weight was dropped)
    with pytest.raises(RuntimeError, match=r"dropout_p.*randomness='different'"):
        vmap(f, randomness="different")(q)
