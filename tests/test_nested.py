"""Jagged nested tensors (torch_ext/nested.py) in torch_ext.attention and the SDPA drop-in: each
sequence against the float64 reference run on it alone, gradients (and gradcheck through the
nested tensors), holes, torch's own SDPA on nested tensors, the monitor, torch.compile, errors."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd import gradcheck

import torch_ext
from conftest import DEVICES, GRAD_TOL, OUT_TOL, STAT_TOL
from reference import reference_attention

F64 = torch.float64
STATS = ("lse", "entropy", "normalized_entropy", "sparsity", "effective_keys", "max_weight", "n_keys", "scale")


def sequences(lengths: Sequence[int], heads: int, dim: int, gen: torch.Generator) -> List[Tensor]:
    """float64 (L, H, D) sequences."""
    return [torch.randn(n, heads, dim, generator=gen, dtype=F64) for n in lengths]


def jagged(seqs: Sequence[Tensor], dtype: torch.dtype, device: str) -> Tensor:
    """The sequences as one jagged (B, H, j, D) tensor."""
    return leaf(seqs, dtype, device, requires_grad=False).transpose(1, 2)


def leaf(seqs: Sequence[Tensor], dtype: torch.dtype, device: str, requires_grad: bool = True) -> Tensor:
    """The sequences as one jagged (B, j, H, D) leaf tensor."""
    return torch.nested.nested_tensor([s.to(device=device, dtype=dtype) for s in seqs], layout=torch.jagged,
                                      requires_grad=requires_grad)


def dense(seq: Tensor) -> Tensor:
    """A sequence (L, H, D) as a call of its own, (1, H, L, D)."""
    return seq.transpose(0, 1).unsqueeze(0)


# (query lengths, key lengths, H, Hkv, options): self- and cross-attention, an empty sequence, GQA,
# both causal alignments, a window, softcap, sinks, temperature, a per-sequence scale tensor, and
# GQA decoding.
CASES: List[Tuple[List[int], List[int] | None, int, int, Dict[str, Any]]] = [
    ([5, 0, 17, 1], None, 4, 2, dict(is_causal=True, scale="logn", train_length=8, enable_gqa=True)),
    ([3, 8], [10, 2], 2, 2, dict(temperature=0.7)),
    ([6, 9], [9, 4], 2, 1, dict(is_causal=True, causal_alignment="bottom_right", window_size=(3, 0), softcap=4.0,
                                enable_gqa=True)),
    ([4, 12, 7], None, 2, 2, dict(is_causal=True, sinks=True)),
    ([7, 3], [5, 11], 2, 2, dict(scale="scale_tensor")),
    # Decoding with GQA (varlen_attention's query heads packed as rows), a sequence without keys.
    ([1, 1, 1], [7, 0, 12], 4, 2, dict(enable_gqa=True, scale="logn", train_length=4)),
    ([1, 1], [5, 9], 4, 1, dict(enable_gqa=True, is_causal=True, causal_alignment="bottom_right", softcap=3.0)),
]


def call_options(options: Dict[str, Any], batch: int, heads: int, gen: torch.Generator, device: str
                 ) -> Tuple[Dict[str, Any], Tensor | None]:
    """The options with their tensors made: sinks (H,), a scale tensor (B, H, 1). Also returns the
    scale tensor (None without one)."""
    out = dict(options)
    scale = None
    if out.get("sinks"):
        out["sinks"] = torch.randn(heads, generator=gen, dtype=F64).to(device)
    if out.get("scale") == "scale_tensor":
        scale = (0.2 + torch.rand(batch, heads, 1, generator=gen, dtype=F64)).to(device)
        out["scale"] = scale
    return out, scale


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_each_sequence_matches_the_reference(case: int, dtype: torch.dtype, device: str) -> None:
    q_lens, k_lens, H, Hkv, options = CASES[case]
    k_lens = k_lens or q_lens
    gen = torch.Generator().manual_seed(case)
    qs, ks, vs = sequences(q_lens, H, 16, gen), sequences(k_lens, Hkv, 16, gen), sequences(k_lens, Hkv, 16, gen)
    options, scale = call_options(options, len(q_lens), H, gen, device)
    out, stats = torch_ext.attention(jagged(qs, dtype, device), jagged(ks, dtype, device), jagged(vs, dtype, device),
                                     return_stats=True, **options)
    assert out.is_nested and out.shape[:2] == (len(q_lens), H) and out.dtype == dtype
    assert all(s.is_nested and s.shape[:2] == (len(q_lens), H) for s in stats)
    outs, per_stat = out.unbind(), {name: getattr(stats, name).unbind() for name in STATS}
    for b, (q, k, v) in enumerate(zip(qs, ks, vs)):
        ref_options = dict(options, sinks=options["sinks"].cpu()) if "sinks" in options else dict(options)
        if scale is not None:
            ref_options["scale"] = scale[b : b + 1].cpu()
        ref = reference_attention(dense(q.to(dtype)), dense(k.to(dtype)), dense(v.to(dtype)), **ref_options)
        atol, rtol = OUT_TOL[dtype]
        torch.testing.assert_close(outs[b].cpu().double(), ref.output[0], atol=atol, rtol=rtol)
        atol, rtol = STAT_TOL[dtype]
        for name in STATS:
            expected = getattr(ref, {"scale": "row_scale"}.get(name, name))[0]
            got = per_stat[name][b].cpu()
            if name == "n_keys":
                assert torch.equal(got, expected)
            else:
                torch.testing.assert_close(got.double(), expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("alignment,kv_heads", [("top_left", 2), ("bottom_right", 1)])
def test_gradients_match_each_sequence_alone(alignment: str, kv_heads: int, dtype: torch.dtype, device: str) -> None:
    """Gradients of query, key, value, the sinks and a per-sequence scale tensor, through the output
    and the entropy, against each sequence's own call (bottom-right with GQA: through
    varlen_attention)."""
    gen = torch.Generator().manual_seed(7)
    q_lens, k_lens, H = [6, 1, 11], [9, 4, 11], 2
    qs, ks, vs = (sequences(q_lens, H, 8, gen), sequences(k_lens, kv_heads, 8, gen),
                  sequences(k_lens, kv_heads, 8, gen))
    sinks = torch.randn(H, generator=gen, dtype=F64).to(device=device, dtype=dtype).requires_grad_()
    scale = (0.3 + torch.rand(3, H, 1, generator=gen, dtype=F64)).to(device=device, dtype=dtype).requires_grad_()
    nq, nk, nv = (leaf(x, dtype, device) for x in (qs, ks, vs))
    options = dict(is_causal=True, causal_alignment=alignment, enable_gqa=True)
    out, stats = torch_ext.attention(nq.transpose(1, 2), nk.transpose(1, 2), nv.transpose(1, 2), sinks=sinks,
                                     scale=scale, return_stats=True, **options)
    (out.values().square().sum() + stats.entropy.values().sum()).backward()
    for b in range(3):
        q, k, v = (dense(x[b]).to(device=device, dtype=dtype).requires_grad_() for x in (qs, ks, vs))
        s = sinks.detach().clone().requires_grad_()
        c = scale.detach()[b : b + 1].clone().requires_grad_()
        o, st = torch_ext.attention(q, k, v, sinks=s, scale=c, return_stats=True, **options)
        (o.square().sum() + st.entropy.sum()).backward()
        # (the jagged tensors' components are (L, H, D), the dense call's (1, H, L, D))
        for got, expected in ((nq.grad.unbind()[b], q.grad[0].transpose(0, 1)),
                              (nk.grad.unbind()[b], k.grad[0].transpose(0, 1)),
                              (nv.grad.unbind()[b], v.grad[0].transpose(0, 1)), (scale.grad[b : b + 1], c.grad)):
            err = (got - expected).norm() / expected.norm().clamp_min(1e-30)
            assert err < GRAD_TOL[dtype]
        if b == 0:
            sink_grad = s.grad
        else:
            sink_grad = sink_grad + s.grad
    torch.testing.assert_close(sinks.grad, sink_grad, rtol=GRAD_TOL[dtype], atol=GRAD_TOL[dtype])


def test_gradcheck_through_nested_tensors() -> None:
    """float64 gradcheck of the whole path: values -> jagged tensors -> attention -> the output's and
    the statistics' values."""
    gen = torch.Generator().manual_seed(3)
    offsets_q, offsets_k = torch.tensor([0, 3, 4, 8]), torch.tensor([0, 5, 7, 9])
    q = torch.randn(8, 2, 4, generator=gen, dtype=F64, requires_grad=True)
    k = torch.randn(9, 1, 4, generator=gen, dtype=F64, requires_grad=True)
    v = torch.randn(9, 1, 3, generator=gen, dtype=F64, requires_grad=True)

    def f(q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, Tensor]:
        nq = torch.nested.nested_tensor_from_jagged(q, offsets_q).transpose(1, 2)
        nk = torch.nested.nested_tensor_from_jagged(k, offsets_k).transpose(1, 2)
        nv = torch.nested.nested_tensor_from_jagged(v, offsets_k).transpose(1, 2)
        out, stats = torch_ext.attention(nq, nk, nv, is_causal=True, scale="logn", train_length=4, enable_gqa=True,
                                         return_stats=True)
        return out.values(), stats.entropy.values()

    assert gradcheck(f, (q, k, v))


def test_holes_are_read_where_the_sequences_are() -> None:
    """A jagged tensor with holes (torch.nested.narrow): the sequences are its narrowed rows, and the
    output has query's offsets and lengths."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 10, 2, 8, generator=gen, dtype=F64, requires_grad=True)
    starts, lengths = torch.tensor([0, 4, 2]), torch.tensor([6, 3, 8])
    nx = torch.nested.narrow(x, 1, starts, lengths, layout=torch.jagged).transpose(1, 2)
    out, stats = torch_ext.attention(nx, nx, nx, is_causal=True, scale="logn", return_stats=True)
    assert torch.equal(out.lengths(), lengths) and torch.equal(out.offsets(), nx.offsets())
    out.unbind()[1].sum().backward()
    for b in range(3):
        s = x.detach()[b, starts[b] : starts[b] + lengths[b]].transpose(0, 1).unsqueeze(0).requires_grad_()
        ref, ref_stats = torch_ext.attention(s, s, s, is_causal=True, scale="logn", return_stats=True)
        torch.testing.assert_close(out.unbind()[b], ref[0], atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(stats.entropy.unbind()[b], ref_stats.entropy[0], atol=1e-12, rtol=1e-12)
        if b == 1:
            ref.sum().backward()
            expected = torch.zeros_like(x)
            expected[1, 4:7] = s.grad[0].transpose(0, 1)
            torch.testing.assert_close(x.grad, expected, atol=1e-12, rtol=1e-12)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("device", DEVICES)
def test_sdpa_drop_in_gives_torchs_result(device: str) -> None:
    """Under replace_sdpa, F.scaled_dot_product_attention on jagged tensors equals torch's own:
    ragged sequences (self- and cross-attention) and a ragged batch dim in front of dense sequences."""
    gen = torch.Generator().manual_seed(11)
    q = jagged(sequences([5, 12, 1], 3, 16, gen), torch.float32, device)
    k = jagged(sequences([7, 4, 9], 3, 16, gen), torch.float32, device)
    v = jagged(sequences([7, 4, 9], 3, 16, gen), torch.float32, device)
    sam = torch.nested.nested_tensor(
        [torch.randn(n, 2, 10, 16, generator=gen).to(device) for n in (3, 1)], layout=torch.jagged
    )
    for args, kwargs in (((q, k, v), {}), ((q, q, q), {"scale": 0.3}), ((sam, sam, sam), {"is_causal": True})):
        expected = F.scaled_dot_product_attention(*args, **kwargs)
        with torch_ext.replace_sdpa():
            got = F.scaled_dot_product_attention(*args, **kwargs)
        assert got.is_nested and got.shape == expected.shape
        torch.testing.assert_close(got.values(), expected.values(), atol=2e-5, rtol=2e-5)


def test_sdpa_drop_in_causal_matches_each_sequence() -> None:
    """is_causal on ragged sequences (torch's CPU path refuses it): top-left within each sequence, as
    SDPA's is_causal, under the policy's scale."""
    gen = torch.Generator().manual_seed(13)
    qs, ks = sequences([6, 2], 2, 8, gen), sequences([4, 9], 2, 8, gen)
    with torch_ext.replace_sdpa(scale="logn", train_length=4):
        got = F.scaled_dot_product_attention(jagged(qs, F64, "cpu"), jagged(ks, F64, "cpu"), jagged(ks, F64, "cpu"),
                                             is_causal=True)
    for b in range(2):
        ref = reference_attention(dense(qs[b]), dense(ks[b]), dense(ks[b]), is_causal=True, scale="logn",
                                  train_length=4)
        torch.testing.assert_close(got.unbind()[b], ref.output[0], atol=1e-12, rtol=1e-12)


class _JaggedAttention(torch.nn.Module):
    """Self-attention over jagged (B, j, E) inputs through F.scaled_dot_product_attention; or over
    padded (B, L, E) inputs whose sequences are narrowed to jagged tensors with holes."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 24, dtype=F64)

    def forward(self, x: Tensor, starts: Tensor | None = None, lengths: Tensor | None = None) -> Tensor:
        qkv = self.proj(x).chunk(3, dim=-1)
        if starts is not None:
            qkv = tuple(torch.nested.narrow(t, 1, starts, lengths, layout=torch.jagged) for t in qkv)
        q, k, v = (t.unflatten(-1, (2, 4)).transpose(1, 2) for t in qkv)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_monitor_records_each_sequence_by_its_positions() -> None:
    gen = torch.Generator().manual_seed(17)
    lengths = [5, 1, 8]
    x = torch.nested.nested_tensor([torch.randn(n, 8, generator=gen, dtype=F64) for n in lengths],
                                   layout=torch.jagged)
    model = _JaggedAttention()
    monitor = torch_ext.AttentionEntropyMonitor(model, positions=True)
    with monitor, torch_ext.replace_sdpa():
        model(x)
    # The same rows, as separate calls: entropy per row, normalized where n >= 2.
    entropies, normalized = [], torch.zeros(2, max(lengths), dtype=F64)
    counts = torch.zeros(max(lengths), dtype=F64)
    for seq in x.unbind():
        q, k, _ = (t.unflatten(-1, (2, 4)).transpose(0, 1).unsqueeze(0) for t in model.proj(seq).chunk(3, dim=-1))
        _, stats = torch_ext.attention(q, k, k, is_causal=True, return_stats=True)
        entropies.append(stats.entropy[0, 0].detach())
        n = seq.shape[0]
        normalized[:, :n] += stats.normalized_entropy[0].detach() * (torch.arange(n) >= 1)
        counts[:n] += torch.arange(n) >= 1
    head0 = next(r for r in monitor.latest if r["head"] == 0)
    assert head0["rows"] == sum(lengths)
    assert head0["entropy_mean"] == pytest.approx(torch.cat(entropies).mean().item(), rel=1e-9)
    profile = monitor.latest_positions[next(iter(monitor.latest_positions))]
    torch.testing.assert_close(profile, normalized / counts.clamp_min(1))

    # The same sequences with holes around them: the same records, positions within each sequence.
    padded = torch.zeros(3, 12, 8, dtype=F64)
    starts = torch.tensor([2, 0, 3])
    for b, seq in enumerate(x.unbind()):
        padded[b, starts[b] : starts[b] + lengths[b]] = seq
    with monitor, torch_ext.replace_sdpa():
        model(padded, starts, torch.tensor(lengths))
    head0_holes = next(r for r in monitor.latest if r["head"] == 0)
    assert head0_holes["rows"] == sum(lengths)
    assert head0_holes["entropy_mean"] == pytest.approx(head0["entropy_mean"], rel=1e-9)
    torch.testing.assert_close(monitor.latest_positions[next(iter(monitor.latest_positions))], profile)


@pytest.mark.filterwarnings("ignore:NestedTensor does not implement _stable_hash_for_caching")
def test_torch_compile_fullgraph() -> None:
    gen = torch.Generator().manual_seed(19)
    q = jagged(sequences([5, 7], 2, 8, gen), torch.float32, "cpu")
    k = jagged(sequences([6, 9], 2, 8, gen), torch.float32, "cpu")

    def f(q: Tensor, k: Tensor) -> Tuple[Tensor, Tensor]:
        out, stats = torch_ext.attention(q, k, k, is_causal=True, scale="logn", return_stats=True)
        return out * 2, stats.entropy

    got, expected = torch.compile(f, fullgraph=True)(q, k), f(q, k)
    for a, b in zip(got, expected):
        assert torch.equal(a.values(), b.values())
    # Holes in one tensor that is query, key and value: value's gather is key's.
    x = torch.randn(3, 10, 2, 8, generator=gen)
    nx = torch.nested.narrow(x, 1, torch.tensor([1, 4, 0]), torch.tensor([6, 3, 8]), layout=torch.jagged)
    nx = nx.transpose(1, 2)
    got, expected = torch.compile(f, fullgraph=True)(nx, nx), f(nx, nx)
    for a, b in zip(got, expected):
        assert torch.equal(a.values(), b.values())


@pytest.mark.filterwarnings("ignore:NestedTensor does not implement _stable_hash_for_caching")
def test_torch_compile_of_key_and_value_built_apart() -> None:
    """Key and value with offsets of their own: a graph cannot check that their lengths agree, so
    fullgraph raises, saying so; otherwise the graph breaks and the call checks them eagerly."""
    gen = torch.Generator().manual_seed(29)
    q = jagged(sequences([4, 6], 2, 8, gen), torch.float32, "cpu")
    k = jagged(sequences([5, 3], 2, 8, gen), torch.float32, "cpu")
    v_same = jagged(sequences([5, 3], 2, 8, gen), torch.float32, "cpu")
    v_other = jagged(sequences([3, 5], 2, 8, gen), torch.float32, "cpu")

    def f(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return torch_ext.attention(q, k, v)

    torch._dynamo.reset()
    with pytest.raises(Exception, match="offsets of their own"):
        torch.compile(f, fullgraph=True)(q, k, v_same)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(f)(q, k, v_same).values(), f(q, k, v_same).values())
    with pytest.raises(ValueError, match="key and value must have the same sequence lengths"):
        torch.compile(f)(q, k, v_other)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_errors() -> None:
    gen = torch.Generator().manual_seed(23)
    q = jagged(sequences([5, 7], 2, 8, gen), F64, "cpu")
    k = jagged(sequences([6, 9], 2, 8, gen), F64, "cpu")
    v_other = jagged(sequences([6, 8], 2, 8, gen), F64, "cpu")
    three = jagged(sequences([6, 9, 1], 2, 8, gen), F64, "cpu")
    cases = [
        ((q, k, torch.zeros(2, 2, 6, 8, dtype=F64)), {}, ValueError, "value is a dense tensor"),
        ((q.transpose(1, 2), k, k), {}, ValueError, r"query must be a jagged tensor of shape \(B, H, j, D\)"),
        ((q, k, k), {"attn_mask": torch.ones(2, 2, 5, 6, dtype=torch.bool)}, ValueError, "attn_mask is not supported"),
        ((q, three, three), {}, ValueError, "the same number of sequences"),
        ((q, k, v_other), {}, ValueError, "key and value must have the same sequence lengths"),
        ((q, k, k), {"scale": torch.ones(2, 2, 5, dtype=F64)}, ValueError, r"broadcast to \(B, H, 1\)"),
        ((q, k, k), {"scale": torch.ones(3, 2, 1, dtype=F64)}, ValueError, r"broadcast to \(B, H, 1\)"),
        ((q, k, k), {"scale": "logn", "scale_factor": torch.ones(5, 1, dtype=F64)}, ValueError,
         r"broadcast to \(B, H, 1\)"),
        ((torch.nested.nested_tensor_from_jagged(torch.zeros(14, 2, 8, dtype=F64), torch.tensor([2, 7, 14]))
          .transpose(1, 2), k, k), {}, ValueError, "cu_seq_q must start at 0.*the jagged query's and key's offsets"),
    ]
    for args, kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            torch_ext.attention(*args, **kwargs)
    strided = torch.nested.nested_tensor([torch.zeros(2, 3, 8), torch.zeros(2, 4, 8)])
    with pytest.raises(NotImplementedError, match="layout torch.strided"):
        torch_ext.attention(strided, strided, strided)
    with pytest.raises(ValueError, match="attn_mask is not supported"), torch_ext.replace_sdpa():
        F.scaled_dot_product_attention(q, k, k, attn_mask=torch.ones(1, dtype=torch.bool))
    # Ragged in a batch dim (SAM's): SDPA refuses a mask there too.
    sam = torch.nested.nested_tensor([torch.zeros(n, 2, 10, 8) for n in (3, 1)], layout=torch.jagged)
    with pytest.raises(ValueError, match="attn_mask is not supported"), torch_ext.replace_sdpa():
        F.scaled_dot_product_attention(sam, sam, sam, attn_mask=torch.ones(10, 10, dtype=torch.bool))


def test_gqa_decoding_goes_through_varlen_attention() -> None:
    """GQA calls whose alignment does not matter or is bottom-right run as varlen_attention (which
    packs a group's query heads as rows when decoding); top-left causal ones as attention."""
    gen = torch.Generator().manual_seed(37)
    q = jagged(sequences([1, 1, 1], 8, 16, gen), torch.float32, "cpu")
    k = jagged(sequences([5, 7, 9], 2, 16, gen), torch.float32, "cpu")

    def ops(**options: Any) -> set:
        with torch.profiler.profile() as prof:
            torch_ext.attention(q, k, k, enable_gqa=True, **options)
        return {e.name for e in prof.events() if e.name.startswith("entropy_attn::")}

    assert "entropy_attn::varlen_attention" in ops()
    assert "entropy_attn::varlen_attention" in ops(is_causal=True, causal_alignment="bottom_right")
    assert "entropy_attn::varlen_attention" not in ops(is_causal=True)


@pytest.mark.parametrize("device", DEVICES)
def test_multihead_attention_module(device: str) -> None:
    """torch_ext.nn.MultiheadAttention on jagged (B, j, E) inputs: each sequence as torch's own module
    computes it alone (scale=None), and as our module does alone under "logn" with a learnable
    per-head scale; cross-attention with kdim/vdim; gradients of the weights; what it refuses."""
    gen = torch.Generator().manual_seed(31)
    lengths, k_lengths = [5, 1, 9], [7, 3, 4]
    x = [torch.randn(n, 16, generator=gen, dtype=F64).to(device) for n in lengths]
    mem = [torch.randn(n, 12, generator=gen, dtype=F64).to(device) for n in k_lengths]
    nx = torch.nested.nested_tensor(x, layout=torch.jagged)
    nmem = torch.nested.nested_tensor(mem, layout=torch.jagged)

    torch.manual_seed(0)
    ours = torch_ext.nn.MultiheadAttention(16, 4, batch_first=True, dtype=F64, device=device)
    theirs = torch.nn.MultiheadAttention(16, 4, batch_first=True, dtype=F64, device=device)
    theirs.load_state_dict(ours.state_dict())
    out, weights = ours(nx, nx, nx, need_weights=False, is_causal=True)
    assert weights is None and out.is_nested and out.shape[0] == 3
    causal = [torch.ones(n, n, dtype=torch.bool, device=device).triu(1) for n in lengths]
    for seq, o, c in zip(x, out.unbind(), causal):
        expected = theirs(seq[None], seq[None], seq[None], need_weights=False, attn_mask=c)[0][0]
        torch.testing.assert_close(o, expected, atol=1e-12, rtol=1e-12)

    torch.manual_seed(1)
    cross = torch_ext.nn.MultiheadAttention(16, 2, kdim=12, vdim=12, batch_first=True, dtype=F64, device=device,
                                            scale="logn", train_length=4, learnable_scale=True)
    with torch.no_grad():
        cross.head_scale.copy_(torch.tensor([0.5, 2.0]))
    out, _ = cross(nx, nmem, nmem, need_weights=False)
    out.values().square().sum().backward()
    grads = [p.grad.clone() for p in cross.parameters()]
    cross.zero_grad()
    total = 0
    for seq, m, o in zip(x, mem, out.unbind()):
        expected = cross(seq[None], m[None], m[None], need_weights=False)[0][0]
        torch.testing.assert_close(o, expected, atol=1e-12, rtol=1e-12)
        total = total + expected.square().sum()
    total.backward()
    for got, p in zip(grads, cross.parameters()):
        torch.testing.assert_close(got, p.grad, atol=1e-10, rtol=1e-10)

    refused = [
        (dict(need_weights=True), "need_weights=True"),
        (dict(need_weights=False, key_padding_mask=torch.zeros(3, 9, dtype=torch.bool)), "key_padding_mask"),
    ]
    for kwargs, match in refused:
        with pytest.raises(ValueError, match=match):
            ours(nx, nx, nx, **kwargs)
    with pytest.raises(ValueError, match="batch_first=False"):
        torch_ext.nn.MultiheadAttention(16, 4, dtype=F64, device=device)(nx, nx, nx, need_weights=False)
    with pytest.raises(ValueError, match="value is not a jagged nested tensor"):
        ours(nx, nx, torch.zeros(3, 9, 16, dtype=F64, device=device), need_weights=False)
    with pytest.raises(ValueError, match="key's and value's embedding dims must be kdim=12 and vdim=12, got 16"):
        cross(nx, nx, nx, need_weights=False)
    holes = torch.nested.narrow(torch.zeros(3, 9, 16, dtype=F64, device=device), 1,
                                torch.tensor([0, 1, 2], device=device), torch.tensor([4, 5, 6], device=device),
                                layout=torch.jagged)
    with pytest.raises(ValueError, match=r"key is a jagged tensor with holes .* pass key.contiguous\(\)"):
        ours(nx, holes, holes, need_weights=False)
