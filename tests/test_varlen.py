"""varlen_attention (packed sequences): against the dense op run on each document, against the
float64 reference, against torch's varlen_attn on CUDA, gradients, gradcheck, opcheck, errors."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import pytest
import torch
from torch import Tensor
from torch.autograd import gradcheck

import torch_ext
from conftest import DEVICES, OUT_TOL, STAT_TOL, nondet_tol, requires_cuda
from reference import reference_attention_raw

ops = torch.ops.entropy_attn
F64 = torch.float64
NAMES = ("output", "lse", "entropy", "sum_p2", "max_weight", "n_keys", "row_scale", "length_factor",
         "normalized_entropy", "sparsity", "effective_keys")


def offsets(lengths: Sequence[int], device: str = "cpu") -> Tensor:
    """int32 cumulative offsets of `lengths`, starting at 0."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return cu.to(device)


def packed_inputs(
    q_lens: Sequence[int], k_lens: Sequence[int], H: int, Hkv: int, D: int, dtype: torch.dtype, device: str, seed: int
) -> Tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), H, D, generator=g, dtype=F64)
    k = torch.randn(sum(k_lens), Hkv, D, generator=g, dtype=F64)
    v = torch.randn(sum(k_lens), Hkv, D, generator=g, dtype=F64)
    return tuple(x.to(device=device, dtype=dtype) for x in (q, k, v))  # type: ignore[return-value]


def per_document_reference(
    q: Tensor, k: Tensor, v: Tensor, q_lens: Sequence[int], k_lens: Sequence[int], **kw: Any
) -> List[Tensor]:
    """The float64 reference run on each document separately, bottom-right aligned, re-packed:
    every output as (T, H, ...)."""
    cq, ck = offsets(q_lens).tolist(), offsets(k_lens).tolist()
    per_doc = []
    for d in range(len(q_lens)):
        qd = q[cq[d] : cq[d + 1]].transpose(0, 1)[None].to(F64)
        kd = k[ck[d] : ck[d + 1]].transpose(0, 1)[None].to(F64)
        vd = v[ck[d] : ck[d + 1]].transpose(0, 1)[None].to(F64)
        r = reference_attention_raw(qd, kd, vd, causal_alignment="bottom_right", **kw)
        per_doc.append([getattr(r, n)[0].transpose(0, 1) for n in NAMES])
    return [torch.cat([doc[i] for doc in per_doc]) for i in range(len(NAMES))]


def assert_outputs_match(got: Sequence[Tensor], want: Sequence[Tensor], dtype: torch.dtype) -> None:
    """The op's 11 outputs against the reference's: n_keys exactly, the output and the statistics
    within the tolerances of `dtype` (conftest)."""
    for n, a, b in zip(NAMES, got, want):
        if n == "n_keys":
            assert torch.equal(a.cpu(), b), "n_keys"
            continue
        atol, rtol = OUT_TOL[dtype] if n == "output" else STAT_TOL[dtype]
        torch.testing.assert_close(a.cpu().to(F64), b.detach(), atol=atol, rtol=rtol, msg=lambda m: f"{n}: {m}")


CASES: List[Tuple[str, List[int], List[int], Dict[str, Any]]] = [
    ("plain", [5, 9, 3], [5, 9, 3], {}),
    ("causal_logn", [7, 1, 12, 4], [7, 1, 12, 4], {"is_causal": True, "scale_mode": "logn", "log_base": 8.0}),
    ("cache_lq_lt_lk", [1, 3, 2], [9, 4, 11], {"is_causal": True}),  # decoding / chunked prefill
    ("lq_gt_lk", [6, 8], [2, 5], {"is_causal": True}),  # early rows see nothing
    ("empty_docs", [0, 6, 0, 5], [3, 6, 0, 0], {"is_causal": True}),
    ("window", [30, 17], [30, 25], {"window_size": [4, 0], "scale_mode": "logn", "log_base": 4.0}),
    ("window_both_sides", [13, 20], [13, 20], {"window_size": [3, 2]}),
    ("softcap_sinks", [9, 4], [11, 4], {"is_causal": True, "softcap": 2.0}),
    ("long", [700, 300, 5], [700, 300, 5], {"is_causal": True}),  # several CPU key blocks
    # Short documents, some over a tile (of 32 rows here): on the CPU each tile transposes its own
    # document's keys, or for up to 8 rows reads them as stored.
    ("short_docs", [20, 3, 40, 8, 33, 1], [20, 3, 40, 8, 33, 1], {"is_causal": True}),
    # One query row per document (decoding): with GQA its query heads become rows of their key/value
    # head (test_gqa_query_heads_become_rows), causal or not, with a right bound, empty documents.
    ("decode", [1, 1, 0, 1], [9, 1, 3, 20], {"is_causal": True, "scale_mode": "logn", "log_base": 4.0}),
    ("decode_right_bound_softcap", [1, 1], [17, 6], {"window_size": [-1, 2], "softcap": 3.0}),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gqa", [False, True])
def test_varlen_forward_matches_per_document_reference(
    device: str, case: Tuple[str, List[int], List[int], Dict[str, Any]], dtype: torch.dtype, gqa: bool
) -> None:
    """Every output equals the reference run on each document alone: nothing leaks between
    documents, and n_i (hence the logn scale and the statistics) restarts with each."""
    name, q_lens, k_lens, kw = case
    H, Hkv = (4, 2) if gqa else (2, 2)
    q, k, v = packed_inputs(q_lens, k_lens, H, Hkv, 8, dtype, device, seed=len(name))
    sinks = torch.randn(H, dtype=F64) if "sinks" in name else None
    ref_k, ref_v = (x.repeat_interleave(H // Hkv, dim=1) for x in (k, v))
    want = per_document_reference(q.cpu(), ref_k.cpu(), ref_v.cpu(), q_lens, k_lens, sinks=sinks, **kw)
    got = ops.varlen_attention(
        q, k, v, offsets(q_lens, device), offsets(k_lens, device), max(q_lens), max(k_lens),
        enable_gqa=gqa, sinks=None if sinks is None else sinks.to(device), **kw,
    )
    assert_outputs_match(got, want, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES[:8], ids=[c[0] for c in CASES[:8]])
def test_varlen_backward_matches_dense_per_document(device: str, case: Tuple[str, List[int], List[int], Dict[str, Any]]) -> None:
    """Gradients of q, k, v (and sinks) through output and statistics equal those of the dense op
    run on each document (bottom-right aligned) with the same upstream gradients."""
    name, q_lens, k_lens, kw = case
    q, k, v = (x.requires_grad_() for x in packed_inputs(q_lens, k_lens, 2, 2, 8, F64, device, seed=3))
    sinks = torch.randn(2, dtype=F64, device=device).requires_grad_() if "sinks" in name else None
    res = ops.varlen_attention(q, k, v, offsets(q_lens, device), offsets(k_lens, device), max(q_lens), max(k_lens), sinks=sinks, **kw)
    g = torch.Generator().manual_seed(1)
    ups = [torch.randn(res[i].shape, generator=g, dtype=F64).to(device) for i in (0, 1, 2, 3)]
    leaves = [q, k, v] + ([sinks] if sinks is not None else [])
    got = torch.autograd.grad(sum((res[i] * u).sum() for i, u in zip((0, 1, 2, 3), ups)), leaves)

    cq, ck = offsets(q_lens).tolist(), offsets(k_lens).tolist()
    loss = 0
    for d in range(len(q_lens)):
        qd, kd, vd = (x[a:b].transpose(0, 1)[None] for x, a, b in ((q, cq[d], cq[d + 1]), (k, ck[d], ck[d + 1]), (v, ck[d], ck[d + 1])))
        r = ops.attention(qd, kd, vd, causal_alignment="bottom_right", sinks=sinks, **kw)
        for i, u in zip((0, 1, 2, 3), ups):
            loss = loss + (r[i][0].transpose(0, 1) * u[cq[d] : cq[d + 1]]).sum()
    want = torch.autograd.grad(loss, leaves)
    for n, a, b in zip(("q", "k", "v", "sinks"), got, want):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9, msg=lambda m: f"d{n}: {m}")


class _AttentionCalls(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the shape of the query (or the key) of every call of the dense ``attention`` op."""

    def __init__(self, record: str = "query") -> None:
        super().__init__()
        self.argument = ("query", "key").index(record)
        self.shapes: List[Tuple[int, ...]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is ops.attention.default:
            self.shapes.append(tuple(args[self.argument].shape))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "q_lens,kw,packs",
    [
        ([1, 1, 0, 1], {"is_causal": True}, True),  # decoding: each row is its document's last
        ([1, 1, 0, 1], {"window_size": [-1, 0], "scale_mode": "logn"}, True),
        ([3, 2, 1, 4], {}, True),  # no causality or window: every row sees its document's keys
        ([3, 2, 1, 4], {"softcap": 2.0, "return_stats": False}, True),
        ([3, 2, 1, 4], {"is_causal": True}, False),  # rows see different keys
        ([1, 1, 0, 1], {"window_size": [4, 0]}, False),  # a left bound
        ([1, 1, 0, 1], {"sinks": "per head"}, False),  # one sink per query head
        ([1, 1, 0, 1], {"dropout_p": 0.3}, False),  # dropout streams per query head
    ],
)
def test_gqa_query_heads_become_rows(q_lens: List[int], kw: Dict[str, Any], packs: bool) -> None:
    """With GQA, where every row sees all of its document's keys and nothing is per query head, the
    G query heads of a group run as G rows of their key/value head (one read of each key/value
    head per group): the dense op sees Hkv heads of G * T rows. Every output equals the float64
    reference on each document, and the gradients (float64) equal those of the call with the
    key/value heads repeated, which does not pack."""
    H, Hkv, k_lens = 6, 2, [9, 4, 3, 20]
    q, k, v = packed_inputs(q_lens, k_lens, H, Hkv, 8, F64, "cpu", seed=4)
    sinks = torch.randn(H, dtype=F64) if kw.pop("sinks", None) else None
    args = (offsets(q_lens), offsets(k_lens), max(q_lens), max(k_lens))
    calls = _AttentionCalls()
    with calls:
        got = ops.varlen_attention(q, k, v, *args, enable_gqa=True, sinks=sinks, dropout_seed=5, **kw)
    T = sum(q_lens)
    assert calls.shapes == [(1, Hkv, 3 * T, 8) if packs else (1, H, T, 8)]
    if kw.get("dropout_p"):
        return
    ref_k, ref_v = (x.repeat_interleave(H // Hkv, dim=1) for x in (k, v))
    ref_kw = {n: kw[n] for n in ("is_causal", "window_size", "softcap", "scale_mode") if n in kw}
    want = per_document_reference(q, ref_k, ref_v, q_lens, k_lens, sinks=sinks, **ref_kw)
    names = NAMES if kw.get("return_stats", True) else ("output", "lse", None, None, None, "n_keys", "row_scale")
    for n, a, b in zip(names, got, want):
        if n is not None:
            torch.testing.assert_close(a, b.to(a.dtype), atol=1e-12, rtol=1e-10, msg=lambda m: f"{n}: {m}")
    # Gradients through the packed layout: against the unpacked call (H == Hkv).
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    res = ops.varlen_attention(*leaves, *args, enable_gqa=True, sinks=sinks, **kw)
    ups = [torch.randn_like(res[i]) for i in (0, 1)]
    grads = torch.autograd.grad(sum((res[i] * u).sum() for i, u in zip((0, 1), ups)), leaves)
    plain = [leaves[0]] + [x.repeat_interleave(H // Hkv, dim=1) for x in leaves[1:]]
    res = ops.varlen_attention(*plain, *args, sinks=sinks, **kw)
    want_grads = torch.autograd.grad(sum((res[i] * u).sum() for i, u in zip((0, 1), ups)), leaves)
    for n, a, b in zip("qkv", grads, want_grads):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10, msg=lambda m: f"d{n}: {m}")


@pytest.mark.parametrize("window", [[-2, -1], [-1, -7], [-5, -5]])
def test_gqa_query_heads_as_rows_check_the_window_first(window: List[int]) -> None:
    """An invalid window raises where packing would apply (packing rewrote the window to
    unbounded before the op checked it, and the call ran with no window)."""
    q, k, v = packed_inputs([1, 1], [5, 9], 4, 2, 8, F64, "cpu", seed=4)
    with pytest.raises(ValueError, match="window_size"):
        ops.varlen_attention(q, k, v, offsets([1, 1]), offsets([5, 9]), 1, 9, enable_gqa=True, window_size=window)


@pytest.mark.parametrize("paged", [False, True])
def test_gqa_with_no_query_heads(paged: bool) -> None:
    """H = 0 query heads on Hkv = 2 gives an empty output, as the dense op (the group size 0 was a
    division by zero: SIGFPE)."""
    q, k, v = packed_inputs([2], [5], 2, 2, 8, F64, "cpu", seed=4)
    q = q[:, :0]
    kw: Dict[str, Any] = {}
    if paged:
        k, v = k[:4].unflatten(0, (1, 4)), v[:4].unflatten(0, (1, 4))
        kw = dict(seqused_k=torch.tensor([4], dtype=torch.int32), block_table=torch.zeros(1, 1, dtype=torch.int32))
    for device in ("cpu", "meta"):
        out = torch_ext.varlen_attention(q.to(device), k.to(device), v.to(device), offsets([2]).to(device),
                                         None if paged else offsets([5]).to(device), 2, 5, enable_gqa=True,
                                         **{n: t.to(device) for n, t in kw.items()})
        assert out.shape == (2, 0, 8)


@pytest.mark.parametrize("enable_gqa", [False, True])
def test_compile_no_recompile_between_decoding_and_prefill(enable_gqa: bool) -> None:
    """max_q is compared with 1 only where it decides the packing of query heads (GQA, eager):
    a compiled call switching between decoding (max_q = 1) and prefill does not recompile (it
    guarded on max_q <= 1 for every call)."""
    H = 4 if enable_gqa else 2

    def f(q: Tensor, k: Tensor, v: Tensor, cq: Tensor, ck: Tensor, mq: int, mk: int) -> Tensor:
        return torch_ext.varlen_attention(q, k, v, cq, ck, mq, mk, is_causal=True, enable_gqa=enable_gqa)

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=True)
    try:
        for i, q_lens in enumerate(([1, 1, 1], [2, 3, 1], [1, 1, 1], [4, 2, 5])):
            if i == 1:
                torch.compiler.set_stance("fail_on_recompile")
            k_lens = [6, 7, 5]
            q, k, v = packed_inputs(q_lens, k_lens, H, 2, 8, F64, "cpu", seed=i)
            args = (q, k, v, offsets(q_lens), offsets(k_lens), max(q_lens), max(k_lens))
            torch.testing.assert_close(compiled(*args), f(*args))
    finally:
        torch.compiler.set_stance("default")


def test_gqa_query_heads_as_rows_name_the_offsets_as_given() -> None:
    """Offsets that would pack are checked before they are scaled to rows: the error shows the
    values the caller passed."""
    q, k, v = packed_inputs([1, 1], [4, 5], 4, 2, 8, F64, "cpu", seed=4)
    with pytest.raises(ValueError, match="cu_seq_q must start at 0, got 1"):
        ops.varlen_attention(q, k, v, torch.tensor([1, 1, 2], dtype=torch.int32), offsets([4, 5]), 1, 5,
                             enable_gqa=True)


def test_gqa_query_heads_as_rows_under_compile() -> None:
    """While torch.compile traces, max_q cannot be checked against the offsets, so a causal call
    does not pack (a wrong max_q would make rows see keys past their diagonal): the compiled call
    equals the eager one, which packs."""
    q_lens, k_lens = [1, 1], [6, 3]
    q, k, v = packed_inputs(q_lens, k_lens, 4, 2, 8, F64, "cpu", seed=2)

    def f(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return torch_ext.varlen_attention(q, k, v, offsets(q_lens), offsets(k_lens), 1, 6, is_causal=True,
                                          enable_gqa=True)

    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v), f(q, k, v))


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_gradcheck(device: str) -> None:
    """gradcheck (float64) of varlen_attention with a window, a scale tensor and sinks."""
    g = torch.Generator().manual_seed(6)
    lens = [3, 0, 4]
    cu = offsets(lens, device)
    q = torch.randn(7, 2, 3, dtype=F64, generator=g).to(device).requires_grad_()
    k = torch.randn(7, 2, 3, dtype=F64, generator=g).to(device).requires_grad_()
    v = torch.randn(7, 2, 2, dtype=F64, generator=g).to(device).requires_grad_()
    scale = (0.3 + torch.rand(1, 2, dtype=F64, generator=g)).to(device).requires_grad_()
    sinks = torch.randn(2, dtype=F64, generator=g).to(device).requires_grad_()

    def f(q: Tensor, k: Tensor, v: Tensor, scale: Tensor, sinks: Tensor) -> Tuple[Tensor, ...]:
        r = ops.varlen_attention(q, k, v, cu, cu, 4, 4, scale, window_size=[2, 0], sinks=sinks, scale_mode="logn", log_base=3.0)
        return r[0], r[1], r[2]

    assert gradcheck(f, (q, k, v, scale, sinks), eps=1e-6, atol=1e-7, rtol=1e-5, nondet_tol=nondet_tol(device))


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_python_api_and_seqused_k(device: str) -> None:
    """torch_ext.varlen_attention returns (T, H) statistics; seqused_k equals truncating each
    document's keys, and refuses to run with inputs that need gradients or carry forward-mode tangents."""
    q_lens, k_lens = [3, 4], [8, 6]
    q, k, v = packed_inputs(q_lens, k_lens, 2, 2, 8, F64, device, seed=9)
    cq, ck = offsets(q_lens, device), offsets(k_lens, device)
    used = torch.tensor([5, 2], dtype=torch.int32, device=device)
    out, stats = torch_ext.varlen_attention(q, k, v, cq, ck, 4, 8, is_causal=True, seqused_k=used, return_stats=True)
    assert out.shape == (7, 2, 8) and stats.entropy.shape == (7, 2)
    keep = torch.cat([torch.arange(0, 5), torch.arange(8, 10)]).to(device)
    want = torch_ext.varlen_attention(q, k[keep], v[keep], cq, offsets([5, 2], device), 4, 5, is_causal=True)
    torch.testing.assert_close(out, want)
    with pytest.raises(ValueError, match="seqused_k"):
        torch_ext.varlen_attention(q.requires_grad_(), k, v, cq, ck, 4, 8, seqused_k=used)
    # Nor forward-mode AD, under no_grad too (whose advice the first error gives).
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level(), torch.no_grad(), pytest.raises(ValueError, match="no forward-mode derivative"):
        torch_ext.varlen_attention(fwAD.make_dual(q.detach(), torch.ones_like(q)), k, v, cq, ck, 4, 8, seqused_k=used)


@pytest.mark.parametrize("heads", [(8, 4, 2), (8, 2, 4), (6, 2, 3)])
def test_varlen_gqa_key_and_value_head_counts_may_differ(heads: Tuple[int, int, int]) -> None:
    """Under enable_gqa, key and value with different head counts, each dividing H, run as in
    torch_ext.attention (SDPA's rule: query head h reads key head h // (H // Hk) and value head
    h // (H // Hv)), with gradients (they raised 'key and value must have the same number of heads');
    a paged cache's pools still raise that (their repetition would copy every page)."""
    H, Hk, Hv = heads
    q_lens, k_lens = [3, 5], [4, 7]
    g = torch.Generator().manual_seed(3)
    q = torch.randn(sum(q_lens), H, 8, generator=g, dtype=F64, requires_grad=True)
    k = torch.randn(sum(k_lens), Hk, 8, generator=g, dtype=F64, requires_grad=True)
    v = torch.randn(sum(k_lens), Hv, 5, generator=g, dtype=F64, requires_grad=True)
    cq, ck = offsets(q_lens), offsets(k_lens)
    out, stats = torch_ext.varlen_attention(q, k, v, cq, ck, 5, 7, is_causal=True, enable_gqa=True, scale="logn",
                                            return_stats=True)
    # The dense op per document, with the head counts SDPA takes.
    want, want_entropy = [], []
    for d in range(2):
        qd, kd, vd = (x[c[d] : c[d + 1]].transpose(0, 1)[None] for x, c in ((q, cq), (k, ck), (v, ck)))
        o, st = torch_ext.attention(qd, kd, vd, is_causal=True, causal_alignment="bottom_right", enable_gqa=True,
                                    scale="logn", return_stats=True)
        want.append(o[0].transpose(0, 1))
        want_entropy.append(st.entropy[0].t())
    want, want_entropy = torch.cat(want), torch.cat(want_entropy)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(stats.entropy, want_entropy, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad((out * out).sum() + stats.entropy.sum(), (q, k, v))
    want_grads = torch.autograd.grad((want * want).sum() + want_entropy.sum(), (q, k, v))
    for name, a, b in zip("qkv", grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m, name=name: f"d{name}: {m}")
    # A paged cache takes one head count (repeating a pool's heads would copy every page).
    table = torch.arange(max(k_lens), dtype=torch.int32).repeat(2, 1)
    table[1, :] += max(k_lens)
    pool_k, pool_v = (torch.zeros(2 * max(k_lens), 1, x.shape[1], x.shape[2], dtype=F64) for x in (k, v))
    for d in range(2):
        n = k_lens[d]
        pool_k[table[d, :n].long(), 0] = k.detach()[ck[d] : ck[d] + n]
        pool_v[table[d, :n].long(), 0] = v.detach()[ck[d] : ck[d] + n]
    with torch.no_grad(), pytest.raises(ValueError, match="key and value must have the same number of heads"):
        torch_ext.varlen_attention(q.detach(), pool_k, pool_v, cq, None, 5, 7, is_causal=True, enable_gqa=True,
                                   scale="logn", seqused_k=torch.tensor(k_lens, dtype=torch.int32), block_table=table)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (16, 0)])
def test_varlen_matches_torch_varlen_attn(dtype: torch.dtype, window: Tuple[int, int]) -> None:
    """On CUDA, the output and lse equal torch.nn.attention.varlen.varlen_attn's (standard scale)."""
    from torch.nn.attention.varlen import AuxRequest, varlen_attn

    lens = [100, 37, 256, 1]
    q, k, v = packed_inputs(lens, lens, 4, 4, 64, dtype, "cuda", seed=12)
    cu = offsets(lens, "cuda")
    want, lse = varlen_attn(q, k, v, cu, cu, max(lens), max(lens), window_size=window, return_aux=AuxRequest(lse=True))
    out, stats = torch_ext.varlen_attention(q, k, v, cu, cu, max(lens), max(lens), window_size=window, return_stats=True)
    torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(stats.lse, lse.t().float(), atol=2e-2, rtol=2e-2)


def test_opcheck_varlen() -> None:
    """opcheck of the composite op (schema, autograd through `attention`, fake tensors, AOT)."""
    lens = [3, 5]
    q, k, v = (x.requires_grad_() for x in packed_inputs(lens, lens, 2, 2, 4, torch.float32, "cpu", seed=1))
    cu = offsets(lens)
    torch.library.opcheck(ops.varlen_attention.default, (q, k, v, cu, cu, 5, 5), {"is_causal": True, "window_size": [2, 0]})
    torch.library.opcheck(ops.varlen_attention.default, (q.detach(), k.detach(), v.detach(), cu, cu, 5, 5), {"softcap": 3.0})


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(cu_seq_q=torch.tensor([0, 9, 8], dtype=torch.int32), max_q=9), "non-decreasing"),
        (dict(cu_seq_q=torch.tensor([0, 3, 8], dtype=torch.int64)), "int32"),
        (dict(cu_seq_q=torch.tensor([0, 3, 7], dtype=torch.int32)), "cu_seq_q\\[-1\\]"),
        (dict(cu_seq_k=torch.tensor([1, 3, 8], dtype=torch.int32)), "start at 0"),
        (dict(cu_seq_k=torch.tensor([0, 8], dtype=torch.int32), max_k=8), "same length"),
        (dict(max_q=4), "max_q"),
        (dict(max_k=-1), "max_k"),
        (dict(window_size=(-3, 0)), "window_size"),
        (dict(dropout_p=1.5), "dropout_p"),
        (dict(softcap=0.0), "softcap"),
        (dict(sinks=torch.zeros(3)), "sinks"),
        (dict(query=torch.randn(1, 8, 2, 4)), "query"),
        (dict(seqused_k=torch.tensor([4, 9], dtype=torch.int32)), "seqused_k"),
        (dict(cu_seq_q=None), "cu_seq_q"),
        (dict(cu_seq_k=[0, 3, 8]), "cu_seq_k"),
        (dict(is_causal="yes"), "is_causal"),
        # strided views: their own values are checked (the checks read memory past a view's
        # elements, accepted these, and the kernels read out of bounds: a segfault)
        (dict(cu_seq_k=torch.tensor([0, 3, 8, 1000, 1008, 0], dtype=torch.int32)[::2], max_k=1000), "cu_seq_k"),
        (dict(seqused_k=torch.tensor([2, 4, 500, 0], dtype=torch.int32)[::2]), "seqused_k"),
    ],
)
def test_varlen_bad_arguments(change: Dict[str, Any], match: str) -> None:
    """Bad packed input raises a clear error naming the argument."""
    lens = [3, 5]
    q, k, v = packed_inputs(lens, lens, 2, 2, 4, torch.float32, "cpu", seed=2)
    args: Dict[str, Any] = dict(query=q, key=k, value=v, cu_seq_q=offsets(lens), cu_seq_k=offsets(lens), max_q=5, max_k=5)
    args.update(change)
    with pytest.raises((ValueError, TypeError), match=match):
        torch_ext.varlen_attention(**args)


def test_varlen_strided_offsets_are_read_as_values() -> None:
    """Offsets and seqused_k given as strided views mean the values the view shows (they were read
    as if contiguous: valid views were refused and invalid ones accepted)."""
    lens = [3, 5]
    q, k, v = packed_inputs(lens, lens, 2, 2, 4, torch.float64, "cpu", seed=3)
    cu = offsets(lens)
    strided = torch.stack([cu, torch.full_like(cu, -1)], 1).flatten()[::2]  # [0, -1, 3, -1, 8, -1][::2]
    used = torch.tensor([2, 4], dtype=torch.int32)
    used_strided = torch.stack([used, torch.full_like(used, 99)], 1).flatten()[::2]
    assert not strided.is_contiguous() and not used_strided.is_contiguous()
    for kw in ({}, {"is_causal": True, "window_size": (1, 0)}):
        want = torch_ext.varlen_attention(q, k, v, cu, cu, 5, 5, seqused_k=used, **kw)
        got = torch_ext.varlen_attention(q, k, v, strided, strided, 5, 5, seqused_k=used_strided, **kw)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_compile_one_graph_for_every_packing() -> None:
    """varlen_attention under torch.compile(fullgraph=True): the number of documents (cu_seq_q's
    size), the token count and max_q / max_k (SymInt in the schema) stay symbolic, so after each
    kind has changed once no packing recompiles, where every packing did and the ninth raised past
    the recompile limit. Forward and backward equal the eager op's."""
    def f(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int) -> Tensor:
        return torch_ext.varlen_attention(q, k, v, cu, cu, max_len, max_len, is_causal=True)

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    g = torch.Generator().manual_seed(8)
    packings = [(5, 7, 3, 6), (4, 9, 8), (6, 6, 6, 6, 2), (2, 3), (9, 9), (3, 4, 5), (7, 2, 3),
                (8, 8, 8), (2, 2, 2, 2, 2, 2), (5, 4), (11, 3, 6, 2)]
    for i, lens in enumerate(packings):
        if i >= 4:
            torch.compiler.set_stance("fail_on_recompile")
        total = sum(lens)
        q, k, v = (torch.randn(total, 2, 8, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(3))
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        try:
            got = compiled(q, k, v, cu, max(lens))
        finally:
            torch.compiler.set_stance("default")
        want = f(q, k, v, cu, max(lens))
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        for a, b in zip(torch.autograd.grad(got.sum(), (q, k, v)), torch.autograd.grad(want.sum(), (q, k, v))):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
