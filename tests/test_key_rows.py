"""`attention`'s key_rows: packed key j read from row key_rows[j] of key's and value's dim 2 (a
paged KV cache's pool of tokens, read where it lies; varlen_attention's block_table passes it on
the CPU). The CPU kernels read the rows through it where their tasks convert keys (a block, or a
thread's keys, at a time) and gather them first where the keys are converted whole; the CUDA
kernels get them gathered (attention_kernel)."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import pytest
import torch
from torch import Tensor

from conftest import DEVICES
from test_varlen import assert_outputs_match, offsets, per_document_reference

F64 = torch.float64
ops = torch.ops.entropy_attn

# (name, query rows per document, keys per document, query heads, key/value heads, options). On
# the CPU: "decode" and "short_documents" read their keys a block at a time (no GQA group, tiles
# mostly of one document: decode's rows as dot products with the keys as stored, the others' by a
# product with the block transposed), the others a thread's keys at a time with one thread and,
# with more threads than key/value heads, from keys converted whole (so the rows are gathered
# first): test_matches_reference runs each at 1 and 4 threads.
CASES: List[Tuple[str, List[int], List[int], int, int, Dict[str, Any]]] = [
    ("decode", [1, 1, 1, 0], [300, 40, 700, 5], 2, 2, {"is_causal": True, "scale_mode": "logn"}),
    ("short_documents", [12] * 20, [30] * 20, 2, 2, {"is_causal": True}),
    ("prefill", [40, 300], [40, 300], 2, 2, {"is_causal": True}),
    ("gqa_prefill", [9, 130, 1], [20, 130, 600], 4, 2, {"window_size": [50, 0], "softcap": 3.0}),
]


def mapped_inputs(
    case: Tuple[str, List[int], List[int], int, int, Dict[str, Any]], dtype: torch.dtype, device: str
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(query (T, H, D), key pool, value pool (P, Hkv, D), key_rows, packed keys, packed values):
    the rows drawn with repeats (shared prefixes) from a pool larger than the keys, whose rows no
    key names hold NaN and infinities (never read)."""
    name, q_lens, k_lens, H, Hkv, _ = case
    g = torch.Generator().manual_seed(len(name))
    keys, D = sum(k_lens), 16
    pool = keys + 97
    rows = torch.randint(0, pool, (keys,), generator=g)
    q = torch.randn(sum(q_lens), H, D, generator=g, dtype=F64)
    k_pool = torch.randn(pool, Hkv, D, generator=g, dtype=F64)
    v_pool = torch.randn(pool, Hkv, D, generator=g, dtype=F64)
    unread = torch.ones(pool, dtype=torch.bool)
    unread[rows] = False
    k_pool[unread] = float("nan")
    v_pool[unread] = float("inf")
    k, v = k_pool[rows], v_pool[rows]
    q, k_pool, v_pool = (x.to(device, dtype) for x in (q, k_pool, v_pool))
    return q, k_pool, v_pool, rows.to(device), k, v


def dense(x: Tensor) -> Tensor:
    """(T, H, D) -> the op's (1, H, T, D) view."""
    return x.transpose(0, 1).unsqueeze(0)


def packed(outputs: Tuple[Tensor, ...]) -> List[Tensor]:
    """The op's (1, H, T, ...) outputs as (T, H, ...)."""
    return [t.squeeze(0).transpose(0, 1) if t.dim() >= 3 else t for t in outputs]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.bfloat16, torch.float16])
def test_matches_reference(device: str, threads: int, case: Tuple[Any, ...], dtype: torch.dtype) -> None:
    """Every output equals the float64 reference on the keys the rows name (gathered by hand),
    whichever way the kernels take the keys; the pool's other rows, NaN and infinities, are never
    read."""
    name, q_lens, k_lens, H, Hkv, kw = case
    q, k_pool, v_pool, rows, k, v = mapped_inputs(case, dtype, device)
    want = per_document_reference(q.cpu(), k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1),
                                  q_lens, k_lens, **kw)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = ops.attention(dense(q), dense(k_pool), dense(v_pool), cu_seq_q=offsets(q_lens, device),
                            cu_seq_k=offsets(k_lens, device), key_rows=rows, enable_gqa=H != Hkv,
                            causal_alignment="bottom_right", **kw)
    finally:
        torch.set_num_threads(previous)
    assert_outputs_match(packed(got), want, dtype)


def test_bfloat16_prefill_gathers_the_rows() -> None:
    """Where the keys packed would be multiplied as bfloat16 pairs other than block by block (a
    prefill read by many rows, one thread converting its keys), the rows are gathered first, so the
    call gives the bits of the gathered keys; reading them in place would multiply them widened to
    float (on CPUs without the bfloat16 kernel both calls widen them)."""
    case = CASES[2]  # prefill
    _, q_lens, k_lens, H, Hkv, kw = case
    q, k_pool, v_pool, rows, _, _ = mapped_inputs(case, torch.bfloat16, "cpu")
    common: Dict[str, Any] = dict(cu_seq_q=offsets(q_lens), cu_seq_k=offsets(k_lens), causal_alignment="bottom_right",
                                  **kw)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        got = ops.attention(dense(q), dense(k_pool), dense(v_pool), key_rows=rows, **common)
        want = ops.attention(dense(q), dense(k_pool[rows]), dense(v_pool[rows]), **common)
    finally:
        torch.set_num_threads(previous)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_nonfinite_values_reach_the_rows_that_see_them(device: str) -> None:
    """A named row holding an infinity in V (or a NaN in K) gives what the same keys gathered give:
    the rows that see it get a non-finite output, the others are untouched."""
    case = CASES[0]
    _, q_lens, k_lens, H, Hkv, kw = case
    q, k_pool, v_pool, rows, _, _ = mapped_inputs(case, torch.float32, device)
    v_pool[rows[320]] = float("inf")  # a key of the second document
    k_pool[rows[3]] = float("nan")  # the first's
    cu_q, cu_k = offsets(q_lens, device), offsets(k_lens, device)
    common: Dict[str, Any] = dict(cu_seq_q=cu_q, cu_seq_k=cu_k, causal_alignment="bottom_right", **kw)
    got = ops.attention(dense(q), dense(k_pool), dense(v_pool), key_rows=rows, **common)
    want = ops.attention(dense(q), dense(k_pool[rows]), dense(v_pool[rows]), **common)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, equal_nan=True)
    out = got[0][0]
    assert out[:, 0].isnan().all() and out[:, 1].isinf().any() and out[:, 2].isfinite().all()


@pytest.mark.parametrize("device", DEVICES)
def test_nonfinite_value_with_a_weight_of_zero(device: str) -> None:
    """An infinite value whose key's weight underflows to 0 still reaches the row that sees it
    (0 * inf = NaN), as the block products of the same keys gathered give it; the other rows stay
    finite."""
    case = CASES[0]
    _, q_lens, k_lens, H, Hkv, kw = case
    q, k_pool, v_pool, rows, _, _ = mapped_inputs(case, torch.float32, device)
    spare = int(torch.isnan(k_pool[:, 0, 0]).nonzero()[0])  # a pool row no key names
    rows = rows.clone()
    rows[500] = spare  # a key of the third document (query row 2)
    k_pool[spare] = -100 * q[2]  # a logit far below the row's others: weight 0 in float32
    v_pool[spare] = float("inf")
    cu_q, cu_k = offsets(q_lens, device), offsets(k_lens, device)
    common: Dict[str, Any] = dict(cu_seq_q=cu_q, cu_seq_k=cu_k, causal_alignment="bottom_right", **kw)
    got = ops.attention(dense(q), dense(k_pool), dense(v_pool), key_rows=rows, **common)
    want = ops.attention(dense(q), dense(k_pool[rows]), dense(v_pool[rows]), **common)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6, equal_nan=True)
    out = got[0][0]
    assert out[:, 2].isnan().all() and out[:, :2].isfinite().all()


def _args() -> Dict[str, Any]:
    q, k_pool, v_pool, rows, _, _ = mapped_inputs(CASES[0], torch.float32, "cpu")
    return dict(query=dense(q), key=dense(k_pool), value=dense(v_pool), cu_seq_q=offsets(CASES[0][1]),
                cu_seq_k=offsets(CASES[0][2]), key_rows=rows)


@pytest.mark.parametrize(
    "change,error,match",
    [
        (dict(key_rows=torch.zeros(1045, dtype=torch.int32)), TypeError, "key_rows must be int64, got Int"),
        (dict(key_rows=torch.zeros(1045, 1, dtype=torch.int64)), ValueError, "key_rows must be 1-D"),
        (dict(cu_seq_q=None, cu_seq_k=None), ValueError, "key_rows needs packed documents"),
        (dict(attn_mask=torch.ones(1, 1, 3, 1045, dtype=torch.bool)), ValueError, "key_rows does not take attn_mask"),
        (dict(key_rows=torch.full((1045,), 1142)), ValueError, r"key_rows\[0\] = 1142 is not a row of key \(its dim 2 has 1142\)"),
        (dict(key_rows=torch.full((1045,), -1)), ValueError, r"key_rows\[0\] = -1 is not a row of key"),
        (dict(key_rows=torch.zeros(1044, dtype=torch.int64)), ValueError, r"cu_seq_k\[-1\] must equal the number of keys key_rows names \(1044\)"),
    ],
)
def test_bad_arguments(change: Dict[str, Any], error: type, match: str) -> None:
    args = _args()
    args.update(change)
    with pytest.raises(error, match=match):
        ops.attention(**args)


class KeyArguments(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the key's shape and dtype and the number of key_rows (None: absent) of every call of
    ``attention`` that reaches the kernels."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: List[Tuple[Tuple[int, ...], torch.dtype, Any]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is ops.attention.default:
            rows = (kwargs or {}).get("key_rows")
            self.calls.append((tuple(args[1].shape), args[1].dtype, None if rows is None else rows.numel()))
        return func(*args, **(kwargs or {}))


def test_autocast_casts_the_named_rows() -> None:
    """Under torch.autocast a float32 pool's named rows are gathered before the cast, which would
    otherwise copy the whole pool on every call; the result is that of the gathered keys. A pool
    autocast leaves as it is (float64 here) stays in place."""
    args = _args()  # a pool of 1142 rows, 1045 of them named
    rows = args["key_rows"]
    gathered = dict(args, key=args["key"][:, :, rows], value=args["value"][:, :, rows], key_rows=None)
    calls = KeyArguments()
    with torch.autocast("cpu", dtype=torch.bfloat16), calls:
        got = ops.attention(**args)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = ops.attention(**gathered)
    assert calls.calls == [((1, 2, 1045, 16), torch.bfloat16, None)]
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    f64 = {k: v.double() if isinstance(v, Tensor) and v.is_floating_point() else v for k, v in args.items()}
    with torch.autocast("cpu", dtype=torch.bfloat16), calls:
        ops.attention(**f64)
    assert calls.calls[1] == ((1, 2, 1142, 16), torch.float64, 1045)


@pytest.mark.parametrize("autocast", [False, True], ids=["plain", "autocast"])
def test_inference_only(autocast: bool) -> None:
    """No gradient flows into a pool through key_rows: a call that would record one raises, and
    so does one with an attn_mask; under torch.autocast too (its gather of the named rows ran
    them as calls without key_rows, which took both)."""
    args = _args()
    args["query"].requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        with pytest.raises(ValueError, match="key_rows is inference-only"):
            ops.attention(**args)
        with torch.no_grad():
            ops.attention(**args)
            with pytest.raises(ValueError, match="key_rows does not take attn_mask"):
                ops.attention(**dict(args, attn_mask=torch.ones(args["query"].shape[2], 3, dtype=torch.bool)))


def test_meta_and_opcheck() -> None:
    """The Meta kernel gives the outputs' shapes (the keys counted by key_rows); opcheck passes."""
    args = _args()
    out = ops.attention(**{k: v.to("meta") if isinstance(v, Tensor) else v for k, v in args.items()})
    assert out[0].shape == (1, 2, 3, 16) and out[5].shape == (1, 2, 3)
    small = dict(args, key_rows=args["key_rows"].clone())
    torch.library.opcheck(ops.attention.default, (), small,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
