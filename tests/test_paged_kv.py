"""varlen_attention over a paged KV cache (block_table, the layout of torch's varlen_attn and
vLLM): against the float64 reference on each sequence's keys read token by token from its pages,
against the same keys packed, varlen_attn's return_aux, errors naming the argument, the Meta
device, opcheck, torch.compile and vmap."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import pytest
import torch
from torch import Tensor

import torch_ext
from conftest import DEVICES
from test_varlen import assert_outputs_match, offsets, per_document_reference

ops = torch.ops.entropy_attn
F64 = torch.float64


def paged_cache(
    k_lens: Sequence[int], page_size: int, Hkv: int, D: int, dtype: torch.dtype, device: str, seed: int,
    *, spare_pages: int = 3, extra_columns: int = 2, share_prefix: int = 0,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(key pool, value pool, block_table, seqused_k): pages in a shuffled order, unused pages in
    the pool, entries past each sequence's pages holding -1 or a page of another sequence, and with
    ``share_prefix`` the first pages of sequence 0 shared by every sequence that long (prefix
    caching)."""
    g = torch.Generator().manual_seed(seed)
    needed = [-(-k // page_size) for k in k_lens]
    shared = min(share_prefix, *(n for n in needed)) if share_prefix else 0
    own = [n - shared if d else n for d, n in enumerate(needed)]
    num_pages = sum(own) + spare_pages
    order = torch.randperm(num_pages, generator=g).tolist()
    columns = max(needed, default=0) + extra_columns
    table = torch.full((len(k_lens), columns), -1, dtype=torch.int32)
    taken = 0
    for d, n in enumerate(needed):
        if d and shared:
            table[d, :shared] = table[0, :shared]
        start = shared if d else 0
        table[d, start:n] = torch.tensor(order[taken : taken + n - start], dtype=torch.int32)
        taken += n - start
        if n < columns and d % 2:  # a stale page, never read: seqused_k leaves its keys out
            table[d, n] = order[-1]
    k_pool = torch.randn(num_pages, page_size, Hkv, D, generator=g, dtype=F64)
    v_pool = torch.randn(num_pages, page_size, Hkv, D, generator=g, dtype=F64)
    used = torch.tensor(list(k_lens), dtype=torch.int32)
    return (k_pool.to(device, dtype), v_pool.to(device, dtype), table.to(device), used.to(device))


def read_pages(pool: Tensor, table: Tensor, used: Tensor) -> Tensor:
    """The packed keys (or values) of each sequence, read token by token from its pages: token j of
    sequence d is slot j % page_size of page table[d, j // page_size]."""
    page_size = pool.shape[1]
    rows = []
    for d, n in enumerate(used.tolist()):
        for j in range(n):
            rows.append(pool[int(table[d, j // page_size]), j % page_size])
    return torch.stack(rows) if rows else pool.new_zeros(0, *pool.shape[2:])


CASES: List[Tuple[str, List[int], List[int], int, Dict[str, Any]]] = [
    # (name, query tokens per sequence, keys per sequence, page size, options)
    ("decode", [1, 1, 1, 1], [37, 5, 64, 16], 16, {"is_causal": True}),
    ("chunked_prefill", [6, 3, 9], [20, 3, 33], 8, {"is_causal": True, "scale_mode": "logn", "log_base": 8.0}),
    ("page_of_one_token", [2, 4], [7, 4], 1, {"is_causal": True}),
    ("odd_page", [5, 5, 2], [11, 5, 9], 3, {}),
    ("window", [4, 7], [30, 25], 4, {"window_size": [5, 0]}),
    ("empty_sequences", [0, 3, 2, 0], [4, 0, 6, 0], 4, {"is_causal": True}),
    ("softcap_sinks", [3, 2], [13, 9], 4, {"is_causal": True, "softcap": 2.0}),
    ("long", [3, 1], [700, 300], 64, {"is_causal": True}),  # several CPU key blocks
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gqa", [False, True])
def test_paged_matches_per_sequence_reference(
    device: str, case: Tuple[str, List[int], List[int], int, Dict[str, Any]], dtype: torch.dtype, gqa: bool
) -> None:
    """Every output equals the float64 reference run on each sequence's keys, read token by token
    from its pages (shuffled, some shared, stale entries after them): the pages are read in the
    table's order, only up to seqused_k, and n_i counts those keys."""
    name, q_lens, k_lens, page_size, kw = case
    H, Hkv, D = (4, 2, 8) if gqa else (2, 2, 8)
    g = torch.Generator().manual_seed(len(name))
    q = torch.randn(sum(q_lens), H, D, generator=g, dtype=F64).to(device, dtype)
    k_pool, v_pool, table, used = paged_cache(k_lens, page_size, Hkv, D, dtype, device, seed=len(name),
                                              share_prefix=1 if gqa else 0)
    sinks = torch.randn(H, dtype=F64) if "sinks" in name else None
    k, v = (read_pages(p.cpu(), table.cpu(), used.cpu()).repeat_interleave(H // Hkv, dim=1) for p in (k_pool, v_pool))
    want = per_document_reference(q.cpu(), k, v, q_lens, k_lens, sinks=sinks, **kw)
    got = ops.varlen_attention(
        q, k_pool, v_pool, offsets(q_lens, device), None, max(q_lens), max(k_lens), seqused_k=used,
        block_table=table, enable_gqa=gqa, sinks=None if sinks is None else sinks.to(device), **kw,
    )
    assert_outputs_match(got, want, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_paged_equals_the_same_keys_packed(device: str) -> None:
    """A paged call gives the call on the same keys packed (cu_seq_k), statistics included, and a
    cu_seq_k given with the table (slots that hold seqused_k) changes nothing."""
    q_lens, k_lens = [2, 1, 4], [19, 1, 40]
    q = torch.randn(sum(q_lens), 4, 16, dtype=torch.float32, device=device)
    k_pool, v_pool, table, used = paged_cache(k_lens, 8, 2, 16, torch.float32, device, seed=5)
    k, v = (read_pages(p, table, used) for p in (k_pool, v_pool))
    kw: Dict[str, Any] = dict(is_causal=True, enable_gqa=True, scale="logn", train_length=16, return_stats=True)
    want, want_stats = torch_ext.varlen_attention(q, k, v, offsets(q_lens, device), offsets(k_lens, device), 4, 40, **kw)
    for cu_k in (None, offsets([20, 1, 48], device)):
        out, stats = torch_ext.varlen_attention(q, k_pool, v_pool, offsets(q_lens, device), cu_k, 4, 40,
                                                seqused_k=used, block_table=table, **kw)
        torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)
        for a, b in zip(stats, want_stats):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("view", ["tokens_of_longer_pages", "heads_of_wider_pages", "page_major_transpose"])
def test_paged_pools_as_strided_views(device: str, view: str) -> None:
    """Pools that are views of other storage give the bits of their contiguous copies: pages that
    are the first tokens of longer pages (pages and tokens do not merge into one dimension: gathered
    by (page, row) pairs), a slice of wider pages' heads, and a transposed layout (gathered by
    token rows where they merge)."""
    q_lens, k_lens = [2, 1, 3], [19, 1, 40]
    q = torch.randn(sum(q_lens), 4, 16, device=device)
    k_pool, v_pool, table, used = paged_cache(k_lens, 8, 2, 16, torch.float32, device, seed=9)

    def strided(pool: Tensor) -> Tensor:
        P, ps, Hkv, D = pool.shape
        if view == "tokens_of_longer_pages":
            wide = torch.randn(P, 2 * ps, Hkv, D, device=device)
            wide[:, :ps] = pool
            return wide[:, :ps]
        if view == "heads_of_wider_pages":
            wide = torch.randn(P, ps, 2 * Hkv, D, device=device)
            wide[:, :, :Hkv] = pool
            return wide[:, :, :Hkv]
        return pool.transpose(2, 3).contiguous().transpose(2, 3)

    got = [strided(p) for p in (k_pool, v_pool)]
    assert not got[0].is_contiguous()
    args = (offsets(q_lens, device), None, 3, 40)
    kw: Dict[str, Any] = dict(seqused_k=used, block_table=table, is_causal=True, enable_gqa=True)
    assert torch.equal(torch_ext.varlen_attention(q, *got, *args, **kw),
                       torch_ext.varlen_attention(q, k_pool, v_pool, *args, **kw))


def test_paged_reads_only_the_columns_max_k_needs() -> None:
    """A table with more columns than max_k needs (sized for the longest context a server admits)
    gives the same result: the columns past ceil(max_k / page_size) hold pages that are not read
    (out of range here) and are not gathered."""
    q_lens, k_lens = [1, 1], [5, 9]
    q = torch.randn(2, 2, 8, dtype=F64)
    k_pool, v_pool, table, used = paged_cache(k_lens, 4, 2, 8, F64, "cpu", seed=6, extra_columns=0)
    wide = torch.cat([table, torch.full((2, 1000), 10**6, dtype=torch.int32)], 1)
    want = torch_ext.varlen_attention(q, k_pool, v_pool, offsets(q_lens), None, 1, 9, seqused_k=used, block_table=table)
    got = torch_ext.varlen_attention(q, k_pool, v_pool, offsets(q_lens), None, 1, 9, seqused_k=used, block_table=wide)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_paged_reads_the_keys_used() -> None:
    """An eager call reads exactly the keys each sequence uses (the dense op sees sum(seqused_k)
    keys): on the CPU in the pool, named by key_rows (a pool whose pages do not merge with their
    tokens, a strided view, has them gathered), so that a batch of short sequences with a large
    max_k reads their keys, not one slot of max_k per sequence. Traced calls (the Meta device here,
    as under torch.compile) take slots of ceil(max_k / page_size) pages, whose shapes do not depend
    on the values. num_splits=1 gathers each sequence's keys."""
    args = _paged_args()  # sequences of 5 and 9 keys in pages of 4
    args.update(max_k=4096, block_table=torch.cat([args["block_table"], torch.zeros(2, 2000, dtype=torch.int32)], 1))
    pool_tokens = args["key"].shape[0] * args["key"].shape[1]
    from test_key_rows import KeyArguments

    calls = KeyArguments()
    with calls:
        out = torch_ext.varlen_attention(**args)
    assert calls.calls == [((1, 2, pool_tokens, 8), torch.float32, 14)]
    # The same pool as the first halves of pages twice as large: pages and tokens do not merge.
    strided = dict(args, key=torch.cat([args["key"], args["key"]], 1)[:, :4],
                   value=torch.cat([args["value"], args["value"]], 1)[:, :4])
    with calls:
        # (in place, a few rows' P V sums its terms in another order than the block product's)
        torch.testing.assert_close(torch_ext.varlen_attention(**strided), out, rtol=1e-6, atol=1e-6)
    assert calls.calls[1] == ((1, 2, 14, 8), torch.float32, None)
    with calls:
        meta = torch_ext.varlen_attention(**{k: v.to("meta") if isinstance(v, Tensor) else v for k, v in args.items()})
    assert calls.calls[2] == ((1, 2, 2 * 1024 * 4, 8), torch.float32, None) and meta.shape == out.shape
    with calls:
        torch_ext.varlen_attention(**args, num_splits=1)
    assert calls.calls[3:] == [((1, 2, 5, 8), torch.float32, None), ((1, 2, 9, 8), torch.float32, None)]


def test_return_aux_lse() -> None:
    """varlen_attn's return_aux: AuxRequest(lse=True) gives (output, lse) with lse (H, T), the
    statistics' lse transposed; lse=False gives the output alone; with return_stats it raises."""
    from torch.nn.attention.varlen import AuxRequest

    lens = [3, 6]
    q, k, v = (torch.randn(9, 2, 8, dtype=F64) for _ in range(3))
    cu = offsets(lens)
    out, lse = torch_ext.varlen_attention(q, k, v, cu, cu, 6, 6, is_causal=True, return_aux=AuxRequest(lse=True))
    want, stats = torch_ext.varlen_attention(q, k, v, cu, cu, 6, 6, is_causal=True, return_stats=True)
    assert lse.shape == (2, 9) and lse.is_contiguous()
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(lse, stats.lse.t(), rtol=0, atol=0)
    alone = torch_ext.varlen_attention(q, k, v, cu, cu, 6, 6, return_aux=AuxRequest(lse=False))
    assert isinstance(alone, Tensor) and alone.shape == (9, 2, 8)
    with pytest.raises(ValueError, match="return_stats"):
        torch_ext.varlen_attention(q, k, v, cu, cu, 6, 6, return_aux=AuxRequest(lse=True), return_stats=True)
    with pytest.raises(TypeError, match="return_aux"):
        torch_ext.varlen_attention(q, k, v, cu, cu, 6, 6, return_aux=True)


def _paged_args() -> Dict[str, Any]:
    q_lens, k_lens = [2, 3], [5, 9]
    k_pool, v_pool, table, used = paged_cache(k_lens, 4, 2, 8, torch.float32, "cpu", seed=7)
    return dict(query=torch.randn(5, 2, 8), key=k_pool, value=v_pool, cu_seq_q=offsets(q_lens), cu_seq_k=None,
                max_q=3, max_k=9, seqused_k=used, block_table=table)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(seqused_k=None), "block_table needs seqused_k"),
        (dict(block_table=torch.zeros(2, 3, dtype=torch.int64)), "block_table must be int32"),
        (dict(block_table=torch.zeros(6, dtype=torch.int32)), "block_table must be 2-D"),
        (dict(block_table=torch.zeros(3, 3, dtype=torch.int32)), "a row per sequence"),
        (dict(block_table=torch.zeros(2, 2, dtype=torch.int32)), "seqused_k\\[1\\] = 9 needs 3 pages"),
        (dict(block_table=torch.tensor([[0, 1, 0], [2, 99, 3]], dtype=torch.int32)), "block_table\\[1, 1\\] = 99"),
        (dict(block_table=torch.tensor([[0, -1, 0], [2, 3, 4]], dtype=torch.int32)), "block_table\\[0, 1\\] = -1"),
        (dict(block_table=[[0, 1], [2, 3]]), "block_table must be a torch.Tensor or None"),
        (dict(max_k=8), "max_k = 8 is smaller"),
        (dict(seqused_k=torch.tensor([5, -1], dtype=torch.int32)), "seqused_k\\[1\\] = -1"),
        (dict(seqused_k=torch.tensor([5], dtype=torch.int32)), "seqused_k must have shape"),
        (dict(key=torch.randn(20, 2, 8)), "key must be a 4-D pool of pages"),
        (dict(value=torch.randn(7, 4, 2, 8)), "value must have key's pages"),
        (dict(key=torch.randn(7, 0, 2, 8), value=torch.randn(7, 0, 2, 8)), "at least one token"),
        (dict(cu_seq_k=offsets([5, 8])), "seqused_k\\[1\\] = 9 must be in \\[0, 8\\]"),
        (dict(cu_seq_k=torch.tensor([0, 5], dtype=torch.int32)), "same length"),
        (dict(cu_seq_k=torch.tensor([2, 5, 20], dtype=torch.int32)), "cu_seq_k must start at 0"),
        (dict(block_table=None), "cu_seq_k must be an int32 tensor, got None"),
        (dict(num_splits=2), "num_splits must be None"),
    ],
)
def test_paged_bad_arguments(change: Dict[str, Any], match: str) -> None:
    """Bad paged input raises a clear error naming the argument (never an out-of-range read)."""
    args = _paged_args()
    args.update(change)
    with pytest.raises((ValueError, TypeError), match=match):
        torch_ext.varlen_attention(**args)


def test_paged_checks_run_under_compile() -> None:
    """The pages are checked by an op of their own (entropy_attn::_gather_pages), which torch.compile
    keeps in its graph: a bad table raises the eager error when the compiled call runs (the checks
    of the composite's own code see no values while it is traced: a bad page was index_select's
    IndexError, and would be a device-side assert on CUDA)."""
    args = _paged_args()
    bad = args["block_table"].clone()
    bad[1, 2] = 99

    def f(q: Tensor, table: Tensor) -> Tensor:
        return torch_ext.varlen_attention(q, args["key"], args["value"], args["cu_seq_q"], None, 3, 9,
                                          seqused_k=args["seqused_k"], block_table=table)

    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        compiled = torch.compile(f, backend=backend, fullgraph=True)
        torch.testing.assert_close(compiled(args["query"], args["block_table"]), f(args["query"], args["block_table"]))
        with pytest.raises(ValueError, match="block_table\\[1, 2\\] = 99"):
            compiled(args["query"], bad)


def test_paged_max_k_near_the_int64_limit() -> None:
    """A max_k far past every sequence, up to 2^63 - 1 (which the Python API accepts), gives the
    result of a tight one: the slot's page count is a ceiling that does not overflow."""
    args = _paged_args()
    want = torch_ext.varlen_attention(**args)
    for max_k in (2**40, 2**63 - 2, 2**63 - 1):
        torch.testing.assert_close(torch_ext.varlen_attention(**{**args, "max_k": max_k}), want, rtol=0, atol=0)


def test_paged_slots_past_int32_only_where_they_are_built() -> None:
    """A table padded to 2^20 columns of pages of 2048 tokens with a max_k of 2^31 (a hint: slots of
    2 x 2^31 keys) runs eagerly, which reads the 15 keys used, as with a tight max_k (it raised 'exceed int32 offsets'
    for the slots only traced calls build); the op that builds the slots (_gather_pages, which a
    traced call runs) still refuses them, and an eager call whose keys used pass int32 too."""
    g = torch.Generator().manual_seed(11)
    pool_k, pool_v = (torch.randn(4, 2048, 2, 8, generator=g) for _ in range(2))  # pages of 2048 tokens
    table = torch.zeros(2, 2**20, dtype=torch.int32)
    table[:, 0] = torch.tensor([3, 1], dtype=torch.int32)
    args = dict(query=torch.randn(2, 2, 8, generator=g), key=pool_k, value=pool_v,
                cu_seq_q=torch.tensor([0, 1, 2], dtype=torch.int32), cu_seq_k=None, max_q=1,
                seqused_k=torch.tensor([10, 5], dtype=torch.int32))
    want = torch_ext.varlen_attention(**args, max_k=10, block_table=table[:, :1].contiguous())
    torch.testing.assert_close(torch_ext.varlen_attention(**args, max_k=2**31, block_table=table), want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="2 sequences of 1048576 pages of 2048 tokens, exceed int32 offsets"):
        torch.ops.entropy_attn._gather_pages(args["query"], pool_k, pool_v, args["cu_seq_q"], None, table,
                                             args["seqused_k"], 2**31)
    # 2^31 keys used: more pages than a test can hold, so pages of 2^30 tokens, as a stride-0 view.
    pool = torch.zeros(1, 1, 2, 8).expand(1, 2**30, 2, 8)
    used = torch.tensor([2**30, 2**30], dtype=torch.int32)
    with pytest.raises(ValueError, match="2147483648 used by 2 sequences \\(seqused_k\\), exceed int32 offsets"):
        torch_ext.varlen_attention(args["query"], pool, pool, args["cu_seq_q"], None, 1, 2**30, seqused_k=used,
                                   block_table=torch.zeros(2, 1, dtype=torch.int32))


def test_paged_offsets_errors_name_the_callers_argument() -> None:
    """cu_seq_q that does not start at 0 is named alone (cu_seq_k, None here, was named with it)."""
    args = _paged_args()
    with pytest.raises(ValueError, match="^cu_seq_q must start at 0, got 1$"):
        torch_ext.varlen_attention(**{**args, "cu_seq_q": torch.tensor([1, 2, 5], dtype=torch.int32)})


def test_paged_is_inference_only() -> None:
    """As varlen_attn's block_table (with seqused_k, which it needs): no backward."""
    args = _paged_args()
    args["query"].requires_grad_()
    with pytest.raises(ValueError, match="inference-only"):
        torch_ext.varlen_attention(**args)


def test_paged_with_no_pages() -> None:
    """An empty pool (every sequence without keys): each row sees no key and gives 0."""
    args = _paged_args()
    args.update(key=torch.randn(0, 4, 2, 8), value=torch.randn(0, 4, 2, 8), max_k=0,
                seqused_k=torch.zeros(2, dtype=torch.int32), block_table=torch.zeros(2, 0, dtype=torch.int32))
    out, stats = torch_ext.varlen_attention(**args, return_stats=True)
    assert out.shape == (5, 2, 8) and not out.any() and not stats.n_keys.any()


def test_paged_meta_opcheck_compile_and_vmap() -> None:
    """The Meta device gives the shapes; opcheck passes; torch.compile (fullgraph, aot_eager and
    inductor) and vmap over the queries equal the eager call."""
    args = _paged_args()
    meta = torch_ext.varlen_attention(**{k: v.to("meta") if isinstance(v, Tensor) else v for k, v in args.items()})
    assert meta.shape == (5, 2, 8) and meta.device.type == "meta"
    positional = [args[k] for k in ("query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k")]
    torch.library.opcheck(ops.varlen_attention.default, tuple(positional),
                          {"is_causal": True, "seqused_k": args["seqused_k"], "block_table": args["block_table"]})
    torch.library.opcheck(ops._gather_pages.default, (args["query"], args["key"], args["value"], args["cu_seq_q"],
                                                      None, args["block_table"], args["seqused_k"], 9))

    def f(q: Tensor, k_pool: Tensor, v_pool: Tensor, table: Tensor) -> Tensor:
        return torch_ext.varlen_attention(q, k_pool, v_pool, args["cu_seq_q"], None, 3, 9, is_causal=True,
                                          seqused_k=args["seqused_k"], block_table=table)

    want = f(args["query"], args["key"], args["value"], args["block_table"])
    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        got = torch.compile(f, backend=backend, fullgraph=True)(args["query"], args["key"], args["value"],
                                                                args["block_table"])
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    queries = torch.stack([args["query"], 2 * args["query"]])
    batched = torch.func.vmap(f, in_dims=(0, None, None, None))(queries, args["key"], args["value"], args["block_table"])
    torch.testing.assert_close(batched[1], f(queries[1], args["key"], args["value"], args["block_table"]))
