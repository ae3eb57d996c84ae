"""varlen_attention's ``num_splits=1`` (varlen_attn's batch invariance): a sequence's output and
statistics are bitwise those it gets packed alone, whatever else is packed before or after it
(long documents, decoding rows, empty sequences), for every dtype, key pattern, GQA decoding, a
paged KV cache and seqused_k; its gradients; and the errors of what it does not take."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import pytest
import torch
from torch import Tensor

import torch_ext
from conftest import DEVICES
from test_paged_kv import paged_cache
from test_varlen import offsets

H, D = 4, 32

# (rows, keys) of the sequences packed around the one under test: none, short ones, long ones
# (whose size changes the kernels' choices for the whole call), decoding rows, empty sequences.
COMPANIONS: List[Tuple[List[Tuple[int, int]], List[Tuple[int, int]]]] = [
    ([(3, 3)], []),
    ([], [(600, 600)]),
    ([(1, 900), (1, 5), (0, 7)], [(2, 2)]),
    ([(700, 1500), (0, 0)], [(1, 1), (5, 40)]),
]


def _tokens(n: int, heads: int, dim: int, dtype: torch.dtype, device: str, g: torch.Generator) -> Tensor:
    return torch.randn(n, heads, dim, generator=g).to(device=device, dtype=dtype)


def _packed_call(
    target: Tuple[Tensor, Tensor, Tensor, Tensor | None],
    before: Sequence[Tuple[int, int]],
    after: Sequence[Tuple[int, int]],
    kv_heads: int,
    seed: int,
    **kwargs: Any,
) -> Tuple[Tensor, Any]:
    """The target sequence (q, k, v, its (rows, H) scale or None) packed between companions of
    random tokens; returns its rows of the output and of each statistic."""
    q, k, v, scale = target
    g = torch.Generator().manual_seed(seed)
    dtype, device = q.dtype, q.device
    shapes = list(before) + [(q.shape[0], k.shape[0])] + list(after)
    qs, ks, vs, scales = [], [], [], []
    for i, (rows, keys) in enumerate(shapes):
        if i == len(before):
            qs.append(q), ks.append(k), vs.append(v), scales.append(scale)
            continue
        qs.append(_tokens(rows, H, D, dtype, device, g))
        ks.append(_tokens(keys, kv_heads, D, dtype, device, g))
        vs.append(_tokens(keys, kv_heads, D, dtype, device, g))
        scales.append(None if scale is None else torch.rand(rows, H, generator=g, dtype=scale.dtype).to(device) + 0.5)
    cu_q, cu_k = offsets([r for r, _ in shapes], device), offsets([c for _, c in shapes], device)
    if scale is not None:
        kwargs["scale"] = torch.cat(scales)
    out, stats = torch_ext.varlen_attention(
        torch.cat(qs), torch.cat(ks), torch.cat(vs), cu_q, cu_k, max(r for r, _ in shapes),
        max(c for _, c in shapes), enable_gqa=kv_heads != H, return_stats=True, num_splits=1, **kwargs)
    first = sum(r for r, _ in before)
    rows = slice(first, first + q.shape[0])
    return out[rows], type(stats)(*(s[rows] for s in stats))


def _assert_bitwise(got: Tuple[Tensor, Any], alone: Tuple[Tensor, Any], where: str) -> None:
    (out, stats), (out_alone, stats_alone) = got, alone
    assert torch.equal(out, out_alone), f"{where}: output differs by {(out.double() - out_alone.double()).abs().max()}"
    for name, s, a in zip(type(stats)._fields, stats, stats_alone):
        assert torch.equal(s, a), f"{where}: {name} differs by {(s.double() - a.double()).abs().max()}"


CASES: Dict[str, Dict[str, Any]] = {
    "full": dict(),
    "causal_logn": dict(is_causal=True, scale="logn", train_length=64),
    "window": dict(window_size=(24, 0)),
    "two_sided_window_softcap": dict(window_size=(9, 5), softcap=20.0),
    "sinks_sharpen": dict(is_causal=True, scale="logn_sharpen", train_length=16),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("rows,keys", [(1, 700), (37, 37), (300, 513)])
def test_sequence_is_bitwise_the_same_in_any_batch(device: str, dtype: torch.dtype, case: str, rows: int,
                                                   keys: int) -> None:
    """The sequence's rows of every output are bitwise equal, alone and among companions of every
    kind, with the kernels' choices (key source, products, tiles) following different whole calls."""
    g = torch.Generator().manual_seed(rows * 7 + keys)
    q, k, v = (_tokens(n, H, D, dtype, device, g) for n in (rows, keys, keys))
    kwargs = dict(CASES[case])
    if case == "sinks_sharpen":
        kwargs["sinks"] = torch.randn(H, generator=g).to(device)
    alone = _packed_call((q, k, v, None), [], [], H, seed=0, **kwargs)
    for i, (before, after) in enumerate(COMPANIONS):
        _assert_bitwise(_packed_call((q, k, v, None), before, after, H, seed=i, **kwargs), alone,
                        f"companions {before} / {after}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 6])
def test_gqa_and_scale_tensor(device: str, dtype: torch.dtype, rows: int) -> None:
    """GQA (one decoding row, whose query heads the call packs as rows of their key/value head, and
    several rows) with a per-row scale tensor sliced with its sequence."""
    g = torch.Generator().manual_seed(rows)
    q = _tokens(rows, H, D, dtype, device, g)
    k, v = _tokens(333, 1, D, dtype, device, g), _tokens(333, 1, D, dtype, device, g)
    scale = (torch.rand(rows, H, generator=g, dtype=torch.float32) + 0.5).to(device)
    alone = _packed_call((q, k, v, scale), [], [], 1, seed=0, is_causal=True)
    for i, (before, after) in enumerate(COMPANIONS):
        _assert_bitwise(_packed_call((q, k, v, scale), before, after, 1, seed=i, is_causal=True), alone,
                        f"companions {before} / {after}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("strided", [False, True])
def test_any_offset_and_layout(device: str, dtype: torch.dtype, strided: bool) -> None:
    """Rows of 16 bytes (one key/value head of 8 bfloat16 values), so that a sequence packed after 1,
    3 or 5 keys starts at an address no kernel would choose, and key and value as strided views of
    wider rows (whose slices would otherwise be copied at some offsets and not at others): the
    sequence's bits are those of its call alone, as the kernels' choices depend on layout."""
    g = torch.Generator().manual_seed(11)
    rows, keys, dim = 3, 45, 8
    q = torch.randn(rows, 2, dim, generator=g).to(device, dtype)

    def tokens(n: int) -> Tensor:
        wide = torch.randn(n, 1, dim + 1 if strided else dim, generator=g).to(device, dtype)
        return wide[..., :dim]

    k, v = tokens(keys), tokens(keys)

    def call(before: int) -> Tensor:
        pad_k, pad_v = tokens(before), tokens(before)
        qs = torch.cat([torch.randn(1, 2, dim, generator=g).to(device, dtype), q])
        ks, vs = torch.cat([pad_k, k]), torch.cat([pad_v, v])
        if strided:  # (cat gives contiguous rows: views of wider ones again)
            ks, vs = (torch.cat([t, t[..., :1]], -1)[..., :dim] for t in (ks, vs))
        out = torch_ext.varlen_attention(qs, ks, vs, offsets([1, rows], device), offsets([before, keys], device),
                                         rows, max(before, keys), is_causal=True, enable_gqa=True, num_splits=1)
        return out[1:]

    alone = torch_ext.varlen_attention(q, k, v, offsets([rows], device), offsets([keys], device), rows, keys,
                                       is_causal=True, enable_gqa=True, num_splits=1)
    for before in (1, 3, 5, 32, 64):
        assert torch.equal(call(before), alone), f"{before} keys before the sequence"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_cache_and_seqused_k(device: str, dtype: torch.dtype) -> None:
    """A paged KV cache: sequence 1 decoding over its pages gives the bits it gets in a table of its
    own, with sequences of other lengths around it; and the same for seqused_k over packed slots."""
    k_lens = [900, 77, 3, 250]
    k_pool, v_pool, table, used = paged_cache(k_lens, 16, 2, D, dtype, device, seed=3)
    q = torch.randn(len(k_lens), H, D).to(device=device, dtype=dtype)
    cu_q = offsets([1] * len(k_lens), device)
    common = dict(seqused_k=used, block_table=table, is_causal=True, enable_gqa=True, num_splits=1)
    out = torch_ext.varlen_attention(q, k_pool, v_pool, cu_q, None, 1, max(k_lens), **common)
    for d in range(len(k_lens)):
        alone = torch_ext.varlen_attention(
            q[d:d + 1], k_pool, v_pool, offsets([1], device), None, 1, k_lens[d], is_causal=True, enable_gqa=True,
            seqused_k=used[d:d + 1], block_table=table[d:d + 1], num_splits=1)
        assert torch.equal(out[d:d + 1], alone), f"sequence {d}"
    # seqused_k over packed slots larger than their content.
    slots = [k + 5 for k in k_lens]
    k, v = (torch.randn(sum(slots), 2, D).to(device=device, dtype=dtype) for _ in range(2))
    cu_k = offsets(slots, device)
    out = torch_ext.varlen_attention(q, k, v, cu_q, cu_k, 1, max(slots), seqused_k=used, enable_gqa=True,
                                     num_splits=1)
    for d in range(len(k_lens)):
        lo = int(cu_k[d])
        alone = torch_ext.varlen_attention(q[d:d + 1], k[lo:lo + slots[d]], v[lo:lo + slots[d]], offsets([1], device),
                                           offsets([slots[d]], device), 1, slots[d], seqused_k=used[d:d + 1],
                                           enable_gqa=True, num_splits=1)
        assert torch.equal(out[d:d + 1], alone), f"seqused_k, sequence {d}"


@pytest.mark.parametrize("device", DEVICES)
def test_agrees_with_the_packed_call(device: str) -> None:
    """num_splits=1 computes what num_splits=None does (to rounding), output, statistics, lse of
    return_aux and the gradients of query, key, value, the scale tensor and the sinks."""
    lens = [5, 0, 40, 1, 17]
    g = torch.Generator().manual_seed(5)
    T = sum(lens)
    q = torch.randn(T, H, D, generator=g, dtype=torch.float64).to(device).requires_grad_()
    k = torch.randn(T, 2, D, generator=g, dtype=torch.float64).to(device).requires_grad_()
    v = torch.randn(T, 2, D, generator=g, dtype=torch.float64).to(device).requires_grad_()
    scale = torch.rand(1, H, generator=g, dtype=torch.float64).to(device).requires_grad_()
    sinks = torch.randn(H, generator=g, dtype=torch.float64).to(device).requires_grad_()
    cu = offsets(lens, device)
    results = []
    for splits in (None, 1):
        out, stats = torch_ext.varlen_attention(q, k, v, cu, cu, 40, 40, is_causal=True, enable_gqa=True,
                                                scale=scale, sinks=sinks, return_stats=True, num_splits=splits)
        loss = out.square().sum() + stats.entropy.sum()
        results.append((out, stats, torch.autograd.grad(loss, (q, k, v, scale, sinks))))
    (out0, stats0, grads0), (out1, stats1, grads1) = results
    torch.testing.assert_close(out1, out0, rtol=1e-12, atol=1e-12)
    for s1, s0 in zip(stats1, stats0):
        torch.testing.assert_close(s1, s0, rtol=1e-12, atol=1e-12)
    for g1, g0 in zip(grads1, grads0):
        torch.testing.assert_close(g1, g0, rtol=1e-10, atol=1e-10)
    from torch.nn.attention.varlen import AuxRequest

    _, lse = torch_ext.varlen_attention(q, k, v, cu, cu, 40, 40, is_causal=True, enable_gqa=True, scale=scale,
                                        sinks=sinks, return_aux=AuxRequest(lse=True), num_splits=1)
    torch.testing.assert_close(lse, stats0.lse.t(), rtol=1e-12, atol=1e-12)


def test_gradcheck() -> None:
    """Gradients in float64 through the per-sequence calls (their slices and concatenation)."""
    cu = offsets([3, 0, 4])
    q, k, v = (torch.randn(7, 2, 3, dtype=torch.float64, requires_grad=True) for _ in range(3))

    def f(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return torch_ext.varlen_attention(q, k, v, cu, cu, 4, 4, is_causal=True, scale="logn", train_length=3,
                                          num_splits=1)

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_no_sequences() -> None:
    """No sequence at all (cu_seq_q = [0]): empty results, as with num_splits=None."""
    q, k = torch.randn(0, H, D), torch.randn(0, 1, D)
    cu = offsets([])
    out, stats = torch_ext.varlen_attention(q, k, k, cu, cu, 0, 0, enable_gqa=True, return_stats=True, num_splits=1)
    assert out.shape == (0, H, D) and stats.lse.shape == (0, H)


def _args() -> Dict[str, Any]:
    cu = offsets([2, 3])
    return dict(query=torch.randn(5, 2, 8), key=torch.randn(5, 2, 8), value=torch.randn(5, 2, 8), cu_seq_q=cu,
                cu_seq_k=cu, max_q=3, max_k=3, num_splits=1)


@pytest.mark.parametrize(
    "change,error,match",
    [
        (dict(num_splits=2), ValueError, "num_splits must be None .* or 1 .*got 2"),
        (dict(num_splits=0), ValueError, "num_splits must be None .* or 1 .*got 0"),
        (dict(num_splits=-1), ValueError, "num_splits must be None .* or 1 .*got -1"),
        (dict(num_splits=True), TypeError, "num_splits must be None or an int, got bool"),
        (dict(num_splits=1.0), TypeError, "num_splits must be None or an int, got float"),
        (dict(dropout_p=0.1), ValueError, "num_splits=1 does not take dropout"),
        # The whole call's checks, naming its offsets, before any sequence runs alone.
        (dict(cu_seq_q=torch.tensor([0, 2, 4], dtype=torch.int32)), ValueError, "cu_seq_q"),
        (dict(max_k=2), ValueError, "max_k = 2 is smaller than sequence 1"),
        (dict(cu_seq_k=torch.tensor([0, 6, 5], dtype=torch.int32), max_k=9), ValueError,
         "cu_seq_k must be non-decreasing"),
        # Offsets that do not partition the tokens are reported as such, whatever the max (a
        # decreasing offset made a longer sequence than max_q and was reported as that).
        (dict(cu_seq_q=torch.tensor([0, -2, 5], dtype=torch.int32)), ValueError,
         r"cu_seq_q must be non-decreasing, but cu_seq_q\[1\] = -2"),
        (dict(cu_seq_k=torch.tensor([0, 2**31 - 1, 5], dtype=torch.int32)), ValueError,
         r"cu_seq_k must be non-decreasing, but cu_seq_k\[2\] = 5"),
        (dict(cu_seq_q=torch.tensor([0, 2, 9], dtype=torch.int32)), ValueError,
         r"cu_seq_q\[-1\] must equal the number of query tokens \(5\), got 9"),
        (dict(cu_seq_k=torch.tensor([1, 2, 5], dtype=torch.int32)), ValueError, "cu_seq_k must start at 0, got 1"),
    ],
)
def test_bad_arguments(change: Dict[str, Any], error: type, match: str) -> None:
    args = _args()
    args.update(change)
    with pytest.raises(error, match=match):
        torch_ext.varlen_attention(**args)


def test_meta_device_raises() -> None:
    """The offsets must be read on the host: on the Meta device the call raises rather than
    computing the batch-dependent result."""
    args = {k: v.to("meta") if isinstance(v, Tensor) else v for k, v in _args().items()}
    with pytest.raises(NotImplementedError, match="num_splits=1 reads cu_seq_q and cu_seq_k on the host"):
        torch_ext.varlen_attention(**args)


def test_compile_runs_the_call_between_graphs() -> None:
    """Under torch.compile the call breaks the graph and runs eagerly: the bits of eager calls for
    every set of offsets, gradients included; with fullgraph=True the break raises, saying why.
    The op itself raises while it is traced."""
    torch.manual_seed(0)
    q = torch.randn(10, 4, 16, requires_grad=True)
    k, v = torch.randn(12, 2, 16), torch.randn(12, 2, 16)

    def step(q: Tensor, cu_q: Tensor, cu_k: Tensor) -> Tensor:
        out = torch_ext.varlen_attention(q * 2, k, v, cu_q, cu_k, 12, 12, is_causal=True, enable_gqa=True,
                                         num_splits=1)
        return out.sin()

    compiled = torch.compile(step, backend="aot_eager")
    for split_q, split_k in ((3, 5), (6, 2), (1, 9)):
        cu_q, cu_k = offsets([split_q, 10 - split_q]), offsets([split_k, 12 - split_k])
        want = step(q, cu_q, cu_k)
        (want_grad,) = torch.autograd.grad(want.sum(), q)
        got = compiled(q, cu_q, cu_k)
        (got_grad,) = torch.autograd.grad(got.sum(), q)
        assert torch.equal(got, want)
        torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=1e-6)
    whole = torch.compile(torch_ext.varlen_attention, fullgraph=True, backend="eager")
    # (the break's own reason, not a failure of the op under fake tensors)
    with pytest.raises(Exception, match="(?s)torch.compiler.disable.*num_splits=1 reads cu_seq_q and cu_seq_k "
                                        "on the host.*runs eagerly, between graphs"):
        whole(**_args())
    traced_op = torch.compile(torch.ops.entropy_attn.varlen_attention, fullgraph=True, backend="eager")
    args = _args()
    with pytest.raises(Exception, match="num_splits=1 reads cu_seq_q and cu_seq_k on the host"):
        traced_op(args["query"], args["key"], args["value"], args["cu_seq_q"], args["cu_seq_k"], 3, 3, None,
                  num_splits=1)
