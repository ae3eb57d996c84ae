"""merge_attention_states against the whole-row op: random key splits (empty shards included),
fully masked rows, causality and windows (a shard of keys [a, b) runs with the query rows [a, Lq),
so that both keep their top-left alignment), gradients through the merged statistics, gradcheck in
float64, and the derived statistics against the kernels' epilogue."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import torch_ext
from torch_ext import AttentionStats
from torch_ext.merge import derived_stats, merge_attention_states

F64 = torch.float64
NAMES = ("lse", "entropy", "normalized_entropy", "sparsity", "effective_keys", "max_weight", "n_keys")


def split_points(length: int, shards: int, gen: torch.Generator) -> list[int]:
    """Sorted cut points 0 = c_0 <= ... <= c_shards = length; repeats make empty shards."""
    cuts = torch.randint(0, length + 1, (shards - 1,), generator=gen).sort().values.tolist()
    return [0, *cuts, length]


def shard_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, a: int, b: int,
               lam: torch.Tensor, kw: dict) -> tuple[torch.Tensor, Any]:
    """Keys [a, b) with the whole row's lambda. Under causality or a window the shard runs on the
    query rows [a, Lq) (the rows before a see none of its keys: an empty state), which keeps the
    top-left alignment of the pattern; the mask is sliced to the shard."""
    pattern = kw.get("is_causal") or kw.get("window_size", (-1, -1)) != (-1, -1)
    r0 = a if pattern else 0
    m = None if mask is None else mask[r0:, a:b]
    out, st = torch_ext.attention(q[:, :, r0:], k[:, :, a:b], v[:, :, a:b], m, scale=lam[..., r0:],
                                  return_stats=True, **kw)
    if r0 == 0:
        return out, st
    pad = lambda t: torch.cat([torch.zeros(*t.shape[:2], r0, *t.shape[3:], dtype=t.dtype), t], 2)  # noqa: E731
    return pad(out), torch_ext.AttentionStats(*(pad(t) for t in st[:-1]), scale=lam)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("pattern", ["full", "causal", "window", "mask"])
def test_merge_matches_whole_op(seed: int, pattern: str) -> None:
    """Shards merged = one call over all keys (float64, to 1e-12): output and every statistic, over
    random splits into 1-4 shards (some empty), with a log-n scale from the whole row's n_i."""
    gen = torch.Generator().manual_seed(seed)
    lq, lk = 23, 23
    q, k, v = (torch.randn(2, 2, n, 8, generator=gen, dtype=F64) for n in (lq, lk, lk))
    kw: dict = {}
    mask = None
    if pattern == "causal":
        kw["is_causal"] = True
    elif pattern == "window":
        kw.update(is_causal=True, window_size=(4, 0))
    elif pattern == "mask":
        mask = torch.rand(lq, lk, generator=gen) < 0.5
        mask[3] = False  # a fully masked row
    out, st = torch_ext.attention(q, k, v, mask, scale="logn", train_length=8, return_stats=True, **kw)
    cuts = split_points(lk, 1 + seed, gen)
    parts = [shard_call(q, k, v, mask, a, b, st.scale, kw) for a, b in zip(cuts, cuts[1:])]
    m_out, m_st = merge_attention_states([p[0] for p in parts], [p[1] for p in parts])
    torch.testing.assert_close(m_out, out, rtol=1e-12, atol=1e-12)
    for name in NAMES:
        torch.testing.assert_close(getattr(m_st, name), getattr(st, name), rtol=1e-12, atol=1e-12, msg=name)


def test_merged_gradients_match_whole_op() -> None:
    """A loss on the merged output, entropy and effective keys gives q, k, v the whole op's gradients."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 17, 8, generator=gen, dtype=F64).requires_grad_() for _ in range(3))
    g_out, g_ent, g_eff = (torch.randn(*s, generator=gen, dtype=F64) for s in ((1, 2, 17, 8), (1, 2, 17), (1, 2, 17)))

    def loss(o: torch.Tensor, s: Any) -> torch.Tensor:
        return (o * g_out).sum() + (s.entropy * g_ent).sum() + (s.effective_keys * g_eff).sum()

    out, st = torch_ext.attention(q, k, v, is_causal=True, scale="logn", train_length=4, return_stats=True)
    whole = torch.autograd.grad(loss(out, st), (q, k, v))
    parts = [shard_call(q, k, v, None, a, b, st.scale.detach(), {"is_causal": True}) for a, b in ((0, 6), (6, 17))]
    merged = torch.autograd.grad(loss(*merge_attention_states([p[0] for p in parts], [p[1] for p in parts])),
                                 (q, k, v))
    for a, b, name in zip(merged, whole, ("dq", "dk", "dv")):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


def test_merged_max_weight_is_not_differentiable() -> None:
    """The merged max_weight, like a single call's, records no gradient: it had one through the
    shards' weights alone (each shard's maximum taken as a constant), which is not the maximum's."""
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 1, 2, 4, generator=gen, dtype=F64) for _ in range(3))
    k, v = (torch.randn(1, 1, 6, 4, generator=gen, dtype=F64) for _ in range(2))
    q.requires_grad_()
    out, st = torch_ext.attention(q, k, v, return_stats=True)
    assert not st.max_weight.requires_grad
    parts = [torch_ext.attention(q, k[:, :, a:b], v[:, :, a:b], return_stats=True) for a, b in ((0, 3), (3, 6))]
    m_out, m_st = merge_attention_states([p[0] for p in parts], [p[1] for p in parts])
    assert m_out.requires_grad and m_st.entropy.requires_grad and not m_st.max_weight.requires_grad
    torch.testing.assert_close(m_st.max_weight, st.max_weight.detach(), rtol=1e-12, atol=1e-12)


def test_merge_gradcheck() -> None:
    """gradcheck (float64) of the merge with respect to every shard's output, lse, entropy and
    effective keys (through which sum p^2 enters), one shard empty for some rows."""
    gen = torch.Generator().manual_seed(3)
    n = torch.tensor([[[3, 0, 5]]]), torch.tensor([[[2, 4, 0]]])

    def run(o1, l1, h1, e1, o2, l2, h2, e2):  # noqa: ANN001, ANN202
        stats = [torch_ext.AttentionStats(lse=l, entropy=h, normalized_entropy=h * 0, sparsity=h * 0,
                                          effective_keys=e, max_weight=h * 0 + 0.5, n_keys=nk,
                                          scale=h.detach() * 0 + 1)
                 for l, h, e, nk in ((l1, h1, e1, n[0]), (l2, h2, e2, n[1]))]
        out, st = merge_attention_states([o1, o2], stats)
        return out, st.lse, st.entropy, st.normalized_entropy, st.sparsity, st.effective_keys

    args = []
    for _ in range(2):
        args += [torch.randn(1, 1, 3, 4, generator=gen, dtype=F64), torch.randn(1, 1, 3, generator=gen, dtype=F64),
                 torch.rand(1, 1, 3, generator=gen, dtype=F64) + 0.5, torch.rand(1, 1, 3, generator=gen, dtype=F64) + 1.2]
    assert torch.autograd.gradcheck(run, [a.requires_grad_() for a in args])


def test_negative_infinite_lse_weighs_nothing() -> None:
    """A shard whose lse is -inf (no mass) is ignored even if it claims keys; rows empty everywhere
    give zeros, as the op gives a row without keys."""
    z = torch.zeros(1, 1, 2, dtype=F64)
    good = torch_ext.AttentionStats(lse=torch.tensor([[[1.0, 0.0]]], dtype=F64), entropy=z + 0.3,
                                    normalized_entropy=z, sparsity=z, effective_keys=z + 2, max_weight=z + 0.6,
                                    n_keys=torch.tensor([[[3, 0]]]), scale=z + 1)
    dead = good._replace(lse=torch.full_like(z, -torch.inf), entropy=torch.full_like(z, torch.nan),
                         n_keys=torch.tensor([[[5, 0]]]))
    o = torch.randn(1, 1, 2, 4, dtype=F64, requires_grad=True)
    lse = good.lse.clone().requires_grad_()
    out, st = merge_attention_states([o, torch.full_like(o, torch.nan)], [good._replace(lse=lse), dead])
    # The dead shard's NaNs reach no gradient either (no 0 * NaN in the product's backward).
    grads = torch.autograd.grad(out.sum() + st.entropy.sum() + st.effective_keys.sum(), (o, lse))
    assert all(torch.isfinite(g).all() for g in grads), grads
    o = o.detach()
    torch.testing.assert_close(out[..., 0, :], o[..., 0, :])
    assert torch.equal(out[0, 0, 1], torch.zeros(4, dtype=F64))
    assert st.entropy[0, 0, 0].item() == pytest.approx(0.3) and st.entropy[0, 0, 1].item() == 0
    assert st.n_keys.tolist() == [[[8, 0]]]


def test_derived_stats_match_kernel_epilogue() -> None:
    """derived_stats (Python, differentiable) gives the op's own derived statistics."""
    gen = torch.Generator().manual_seed(1)
    q, k = (torch.randn(2, 3, 19, 8, generator=gen) for _ in range(2))
    mask = torch.rand(19, 19, generator=gen) < 0.6
    mask[0] = False
    res = torch.ops.entropy_attn.attention(q, k, k, mask, None, is_causal=True)
    normalized, sparsity, effective = derived_stats(res[2], res[3], res[5])
    torch.testing.assert_close(normalized, res[8])
    torch.testing.assert_close(sparsity, res[9])
    torch.testing.assert_close(effective, res[10])


def test_derived_stats_clamped_like_the_kernel() -> None:
    """Past their uniform-row bounds by rounding (sum_p2 an ulp under 1 / n), the derived
    statistics stop at 1, 1 and n, as the kernel epilogue's; the gradient is the unclamped one."""
    n = torch.tensor([3, 7, 300])
    u = (1 / n.float()) * (1 - 2 ** -23)
    u.requires_grad_(True)
    h = torch.log(n.float()) * (1 + 2 ** -23)
    normalized, sparsity, effective = derived_stats(h, u, n)
    assert (normalized == 1).all() and (sparsity == 1).all() and (effective == n).all()
    effective.sum().backward()
    torch.testing.assert_close(u.grad, -1 / u.detach() ** 2)


def test_merge_rejects_malformed_arguments() -> None:
    """Clear errors naming the argument."""
    o = torch.zeros(1, 1, 2, 4)
    z = torch.zeros(1, 1, 2)
    st = torch_ext.AttentionStats(z, z, z, z, z, z, z.long(), z)
    with pytest.raises(ValueError, match="at least one"):
        merge_attention_states([], [])
    with pytest.raises(ValueError, match="same length"):
        merge_attention_states([o, o], [st])
    with pytest.raises(TypeError, match=r"stats\[0\]"):
        merge_attention_states([o], [(z,)])
    with pytest.raises(ValueError, match=r"outputs\[1\]"):
        merge_attention_states([o, torch.zeros(1, 1, 3, 4)], [st, st])
    with pytest.raises(TypeError, match="outputs must be a list"):
        merge_attention_states(o, [st])  # one tensor, not a list of shards
    with pytest.raises(TypeError, match="stats must be a list"):
        merge_attention_states([o], st)
    # Any iterable of shards: generators (len() failed on them) give what lists give.
    out, merged = merge_attention_states((x for x in [o, o]), (s for s in [st, st]))
    assert torch.equal(out, merge_attention_states([o, o], [st, st])[0]) and merged.n_keys.shape == (1, 1, 2)


def test_merge_rejects_statistics_that_are_not_the_rows() -> None:
    """Every per-row statistic must have the rows' shape: a broadcastable one (an entropy of
    (B, 1, Lq) for (B, H, Lq) rows) merged silently wrong; n_keys must count, shards share a dtype."""
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4)
    o1, s1 = torch_ext.attention(q, k[:, :, :3], v[:, :, :3], return_stats=True)
    o2, s2 = torch_ext.attention(q, k[:, :, 3:], v[:, :, 3:], return_stats=True)
    merge_attention_states([o1, o2], [s1, s2])  # well-formed
    cases = [
        (ValueError, r"stats\[1\]\.entropy has shape \(1, 1, 3\)", [o1, o2], [s1, s2._replace(entropy=s2.entropy[:, :1])]),
        (ValueError, r"stats\[1\]\.effective_keys", [o1, o2], [s1, s2._replace(effective_keys=s2.effective_keys[0])]),
        (TypeError, r"stats\[0\]\.n_keys must be an integer", [o1, o2], [s1._replace(n_keys=s1.n_keys.float()), s2]),
        (ValueError, r"stats\[1\]\.lse is torch\.float64", [o1, o2],
         [s1, s2._replace(lse=s2.lse.double(), entropy=s2.entropy.double())]),
        (ValueError, r"outputs\[1\] is torch\.float64", [o1, o2.double()], [s1, s2]),
        (TypeError, r"outputs\[1\] must be a Tensor", [o1, o2.tolist()], [s1, s2]),
        (TypeError, r"outputs\[0\] must be a floating-point tensor", [o1.long(), o2.long()], [s1, s2]),
    ]
    for error, message, outputs, stats in cases:
        with pytest.raises(error, match=message):
            merge_attention_states(outputs, stats)


def test_merge_stays_exact_where_the_lse_is_large() -> None:
    """float32 rows with lses of 40-200 and nearly one-hot weights: the merged entropy is as close
    to the float64 truth as the single call's and never negative (L - sum w (l - H) cancelled to
    -7.6e-6 and off by 7.7e-5); rows whose every key carries a large finite mask (-1e9) merge to the
    single call's output and statistics (the weights summed to 2: a doubled output). (Halves of
    equal size: at -1e9 a float32 lse cannot tell ln 7 from ln 9, so unequal shards of a uniform
    row merge as equal ones: docs/math.md section 7.)"""
    torch.manual_seed(4)
    halves = [slice(0, 8), slice(8, 16)]
    keys, values = torch.randn(1, 2, 16, 16) * 4, torch.randn(1, 2, 16, 16)
    # (At -1e9 the logits' own rounding (float32's ulp there is 64) decides the row where they
    # spread by more than 32: small queries, so that every key rounds to the same logit.)
    for mask_value, q_std in ((0.0, 4.0), (-1e9, 0.1)):
        q = torch.randn(1, 2, 6, 16) * q_std
        mask = torch.full((6, 16), mask_value)
        single = torch_ext.attention(q, keys, values, mask, return_stats=True)
        exact = torch_ext.attention(q.double(), keys.double(), values.double(), mask.double(), return_stats=True)
        shards = [torch_ext.attention(q, keys[:, :, h], values[:, :, h], mask[:, h], scale=single[1].scale,
                                      return_stats=True) for h in halves]
        out, stats = torch_ext.merge_attention_states([o for o, _ in shards], [st for _, st in shards])
        torch.testing.assert_close(out, single[0], rtol=1e-5, atol=1e-5)
        assert (stats.entropy >= 0).all()
        err_merged = (stats.entropy.double() - exact[1].entropy).abs().max()
        err_single = (single[1].entropy.double() - exact[1].entropy).abs().max()
        assert err_merged <= 4 * err_single + 1e-6, (mask_value, float(err_merged), float(err_single))
        torch.testing.assert_close(stats.effective_keys, single[1].effective_keys, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(stats.max_weight, single[1].max_weight, rtol=1e-4, atol=1e-4)


def test_merge_keeps_nan_in_the_max_weight() -> None:
    """A NaN row merges to NaN in every statistic, max_weight included (a `w > 0` filter gave 0)."""
    stats = AttentionStats(*(torch.full((1, 1, 1), float("nan")) for _ in range(6)),
                           n_keys=torch.full((1, 1, 1), 3), scale=torch.ones(1, 1, 1))
    out = torch.full((1, 1, 1, 2), float("nan"))
    merged_out, merged = torch_ext.merge_attention_states([out, out], [stats, stats])
    assert merged_out.isnan().all() and merged.max_weight.isnan().all() and merged.entropy.isnan().all()


def test_merge_rejects_shards_of_different_scales() -> None:
    """Shards that each took their own "logn" scale (from their own key counts, not the whole
    row's) merged silently wrong (output off by 0.17 in an outside audit's repro): the merge
    compares the shards' scale where both have keys, and raises naming it. A scale that differs
    only in rows a shard has no key for (it takes no part there) is accepted."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 40, 8, generator=gen, dtype=F64) for _ in range(3))
    shards = [torch_ext.attention(q, k[:, :, s], v[:, :, s], scale="logn", return_stats=True)
              for s in (slice(0, 15), slice(15, 40))]  # fmt: skip
    with pytest.raises(ValueError, match=r"stats\[1\]\.scale differs"):
        merge_attention_states([o for o, _ in shards], [st for _, st in shards])
    z = torch.zeros(1, 1, 2, dtype=F64)
    a = torch_ext.AttentionStats(lse=z, entropy=z, normalized_entropy=z, sparsity=z, effective_keys=z + 1,
                                 max_weight=z + 1, n_keys=torch.tensor([[[1, 1]]]), scale=z + 0.5)
    b = a._replace(n_keys=torch.tensor([[[1, 0]]]), scale=torch.tensor([[[0.5, 9.0]]], dtype=F64))
    o = torch.randn(1, 1, 2, 4, dtype=F64)
    merge_attention_states([o, o], [a, b])  # (row 1: shard b has no key)
    with pytest.raises(ValueError, match="scale"):
        merge_attention_states([o, o], [a, b._replace(n_keys=torch.tensor([[[1, 1]]]))])
    # (a scale not of the rows' shape cannot be compared row by row: named, not broadcast)
    with pytest.raises(ValueError, match=r"^stats\[1\]\.scale must be a tensor of the rows' shape"):
        merge_attention_states([o, o], [a, a._replace(scale=torch.ones(1, dtype=F64))])
    with pytest.raises(ValueError, match=r"^stats\[0\]\.scale must be a tensor"):
        merge_attention_states([o, o], [a._replace(scale=None), a])


def test_merge_compares_scales_where_the_first_shard_has_no_keys() -> None:
    """Each shard's scale is compared with the first shard that has keys for the row, not with
    stats[0] alone: with an empty first shard, or one without keys for some rows, two later shards
    of different "logn" scales merged silently wrong (output off by 0.47 in an outside audit's
    repro), in one shard order and not another. The merged scale is that of a shard with keys for
    the row (the one lambda_i), not stats[0]'s 0 there."""
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=gen, dtype=F64) for _ in range(3))
    lam = torch_ext.length_factor(torch.full((1, 2, 6), 6), "logn", train_length=4) / 8**0.5
    cuts = (slice(0, 0), slice(0, 2), slice(2, 6))  # an empty first shard
    own = [torch_ext.attention(q, k[:, :, c], v[:, :, c], scale="logn", train_length=4, return_stats=True)
           for c in cuts]  # fmt: skip
    for order in ((0, 1, 2), (1, 0, 2), (1, 2, 0)):
        with pytest.raises(ValueError, match=r"stats\[\d\]\.scale differs from stats\[\d\]\.scale"):
            merge_attention_states([own[i][0] for i in order], [own[i][1] for i in order])
    whole = torch_ext.attention(q, k, v, scale=lam, return_stats=True)
    shared = [torch_ext.attention(q, k[:, :, c], v[:, :, c], scale=lam, return_stats=True) for c in cuts]
    out, st = merge_attention_states([o for o, _ in shared], [s for _, s in shared])
    torch.testing.assert_close(out, whole[0])
    torch.testing.assert_close(st.scale, whole[1].scale)
    # Rows no shard has keys for keep stats[0]'s scale; in the others, a later shard's.
    z = torch.zeros(1, 1, 2, dtype=F64)
    a = torch_ext.AttentionStats(lse=z - torch.inf, entropy=z, normalized_entropy=z, sparsity=z,
                                 effective_keys=z, max_weight=z, n_keys=torch.tensor([[[0, 0]]]), scale=z)
    b = a._replace(lse=z, effective_keys=z + 1, max_weight=z + 1, n_keys=torch.tensor([[[1, 0]]]), scale=z + 0.5)
    o = torch.randn(1, 1, 2, 4, dtype=F64)
    assert merge_attention_states([o * 0, o], [a, b])[1].scale.tolist() == [[[0.5, 0.0]]]


def test_derived_stats_of_a_row_without_weight() -> None:
    """A row with keys but sum p^2 = 0 (every logit -inf, or merged shards whose lse are all -inf)
    gets the kernel epilogue's clamped 1 / 0: sparsity 1 and n effective keys, as the op gives that
    row; the merge's own clamp formed inf - inf there (NaN), and its gradient stays finite."""
    q = torch.ones(1, 1, 2, 4, dtype=F64)
    k = torch.zeros(1, 1, 3, 4, dtype=F64)
    k[..., 0] = -torch.inf  # q . k = -inf for every key
    _, st = torch_ext.attention(q, k, torch.randn(1, 1, 3, 4, dtype=F64), return_stats=True)
    u = torch.zeros(1, 1, 2, dtype=F64, requires_grad=True)
    normalized, sparsity, effective = derived_stats(st.entropy, u, st.n_keys)
    torch.testing.assert_close(sparsity, st.sparsity)
    torch.testing.assert_close(effective, st.effective_keys)
    (grad,) = torch.autograd.grad((sparsity + effective).sum(), u)
    assert torch.isfinite(grad).all()
    dead = st._replace(lse=torch.full_like(st.lse, -torch.inf))
    _, merged = merge_attention_states([torch.zeros(1, 1, 2, 4, dtype=F64)], [dead])
    assert torch.equal(merged.sparsity, torch.ones_like(merged.sparsity))
    assert torch.equal(merged.effective_keys, torch.full_like(merged.effective_keys, 3))
