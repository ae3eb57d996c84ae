"""Merging attention computed over disjoint key sets of the same query rows, statistics included.

Context parallelism (ring attention), split-KV decoding and cascades over a shared prefix compute a
row's attention in shards, each over part of the keys, and merge the partial outputs through the
log-sum-exp. The statistics of :func:`torch_ext.attention` merge exactly as well (docs/math.md
section 7): with shard lse l_s, L = logsumexp_s l_s and w_s = exp(l_s - L) (the weight mass of shard
s), the merged row has

    output   O = sum_s w_s O_s
    entropy  H = sum_s w_s (H_s + L - l_s)
    sum p^2  U = sum_s w_s^2 U_s
    max      M = max_s w_s M_s
    n_keys   n = sum_s n_s

and the derived statistics follow from (H, U, n). Shards must use the same lambda_i, that of the
whole row (for the log-n policies, from the whole row's n_i: :func:`torch_ext.length_factor`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple, Sequence, Union

import torch

from torch_ext.attention import AttentionStats

__all__ = ["RowState", "derived_stats", "merge_attention_states", "merge_row_states"]


class RowState(NamedTuple):
    """A row's attention over some keys: what merging needs, each (B, H, Lq) but ``output``."""

    output: torch.Tensor  # (B, H, Lq, Dv)
    lse: torch.Tensor
    entropy: torch.Tensor
    sum_p2: torch.Tensor
    max_weight: torch.Tensor
    n_keys: torch.Tensor  # int64


def derived_stats(entropy: torch.Tensor, sum_p2: torch.Tensor, n_keys: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(normalized entropy, sparsity, effective keys) from (H, sum p^2, n), differentiable: the
    definitions of ``derive`` in csrc/online_stats.h (the kernels' epilogue), which
    tests/test_merge.py checks these against. Rows with n = 0 give 0; normalized entropy is 0 for
    n < 2. Like ``derive``, the values are clamped at their uniform-row bounds (1, 1, n), which
    rounding can cross by an ulp, and the gradients are the unclamped formulas'."""
    nonempty = n_keys > 0
    n = n_keys.clamp_min(1).to(sum_p2.dtype)
    # A row with keys but sum p^2 = 0 (every logit -inf: no weight anywhere) takes derive's clamped
    # values of 1 / 0, sparsity 1 and n effective keys, with no infinity formed (nor its gradient).
    weightless = nonempty & (sum_p2 == 0)
    u = torch.where(nonempty & ~weightless, sum_p2, torch.ones_like(sum_p2))
    zero = torch.zeros_like(sum_p2)
    normalized = torch.where(n_keys >= 2, _at_most(entropy / torch.log(n.clamp_min(2)), 1), zero)
    sparsity = torch.where(nonempty, _at_most(torch.rsqrt(n * u), 1), zero)
    effective = torch.where(nonempty, _at_most(1 / u, n), zero)
    sparsity = torch.where(weightless, torch.ones_like(sparsity), sparsity)
    effective = torch.where(weightless, n, effective)
    return normalized, sparsity, effective


def _at_most(x: torch.Tensor, hi: Union[torch.Tensor, float]) -> torch.Tensor:
    """min(x, hi) in value (NaN kept) with the gradient of x: the clamp only removes rounding."""
    return x - (x - hi).clamp_min(0).detach()


def merge_row_states(states: Sequence[RowState]) -> RowState:
    """The exact merge of row states over disjoint key sets (module docstring), differentiable in
    every shard's output, lse, entropy and sum p^2. A shard with no key for a row (n = 0, or an lse of
    -inf) has weight 0; a row with no key in any shard gets output 0 and statistics 0, as the op
    gives such a row. NaN in a shard's row makes the merged row NaN.

    Computed relative to the largest lse m: d_s = l_s - m, z = sum_s e^{d_s}, w_s = e^{d_s} / z
    and L - l_s = ln z - d_s >= 0. The weights sum to 1 also where L rounds to m (rows whose every
    key carries a large additive mask: -1e9 or finfo.min, where exp(l_s - L) gave 1 for every
    shard), and the entropy is a sum of non-negative terms: L - sum_s w_s (l_s - H_s) cancels, off
    by the weights' rounding times |L| (negative entropies of float32 rows with an lse of 46)."""
    if not states:
        raise ValueError("merge needs at least one shard")
    # Empty shards (n = 0: the op reports lse 0 for them) weigh nothing: lse -inf.
    lses = torch.stack([torch.where(s.n_keys > 0, s.lse, torch.full_like(s.lse, -torch.inf)) for s in states])
    top = lses.amax(0)
    empty = torch.isneginf(top)
    top_safe = torch.where(empty, torch.zeros_like(top), top)
    mass = torch.exp(lses - top_safe)  # 0 for empty shards, 1 for the largest
    z = mass.sum(0)
    z_safe = torch.where(empty, torch.ones_like(z), z)
    w = mass / z_safe  # rows empty everywhere: all 0
    log_z = torch.log(z_safe)
    # Terms of empty shards are replaced by 0 before the product, not multiplied by w = 0: their
    # values may be anything (NaN, inf), which would reach the gradient of w through 0 * NaN. (A NaN
    # weight keeps its term: NaN.)

    def weighted(values: list[torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
        stacked = torch.stack(values)
        return (weights * torch.where(weights != 0, stacked, torch.zeros_like(stacked))).sum(0)

    out_dtype = states[0].output.dtype
    output = weighted([s.output.to(w.dtype) for s in states], w[..., None])
    entropy = weighted([s.entropy + (log_z - (l - top_safe)) for s, l in zip(states, lses)], w)
    sum_p2 = weighted([s.sum_p2 for s in states], w * w)
    # Not differentiable, as a single call's max_weight (the op marks it so): detached, where the
    # product's gradient through w alone, each shard's maximum taken as a constant, was wrong.
    maxima = torch.stack([s.max_weight for s in states]).detach()
    max_weight = torch.where(w != 0, w * maxima, torch.zeros_like(maxima)).amax(0).detach()
    n_keys = torch.stack([s.n_keys for s in states]).sum(0)
    zero = torch.zeros_like(top)
    return RowState(
        output=output.to(out_dtype),
        lse=torch.where(empty, zero, top_safe + log_z),
        entropy=torch.where(empty, zero, entropy),
        sum_p2=torch.where(empty, zero, sum_p2),
        max_weight=torch.where(empty, zero, max_weight),
        n_keys=n_keys,
    )


def merge_attention_states(
    outputs: Iterable[torch.Tensor], stats: Iterable[AttentionStats]
) -> tuple[torch.Tensor, AttentionStats]:
    """Merges :func:`torch_ext.attention` results over disjoint key sets of the same query rows.

    Args:
        outputs: the shards' outputs, each (B, H, Lq, Dv) (a list, tuple or other iterable).
        stats: their :class:`AttentionStats` (``return_stats=True``), computed with the same
            lambda_i (pass the whole row's scale as a tensor, e.g. from
            :func:`torch_ext.length_factor` for the log-n policies: each shard's own "logn"
            would count only its keys). Shards whose ``scale`` differs in a row that both have
            keys for raise ValueError (in eager mode: a comparison of values, one synchronization
            on CUDA).
            Shards without sinks (nothing in the statistics tells a sink; the derived statistics
            would count one entry too few).

    Returns:
        ``(output, stats)`` as one call over the union of the keys would give them (to rounding):
        the output in the shards' dtype, the statistics in float32 (float64 for float64 shards),
        differentiable with respect to every shard's output and statistics. ``scale`` is, in
        each row, the scale of the first shard with keys for it (the first shard's in rows that
        no shard has keys for).
    """
    outputs, stats = _as_list(outputs, "outputs"), _as_list(stats, "stats")  # (generators too)
    if len(outputs) != len(stats):
        raise ValueError(f"outputs and stats must have the same length, got {len(outputs)} and {len(stats)}")
    if not outputs:
        raise ValueError("merge_attention_states needs at least one shard")
    _check_shards(outputs, stats)
    _check_same_scale(stats)
    states = [
        RowState(o, s.lse, s.entropy, _sum_p2(s), s.max_weight, s.n_keys) for o, s in zip(outputs, stats)
    ]
    m = merge_row_states(states)
    normalized, sparsity, effective = derived_stats(m.entropy, m.sum_p2, m.n_keys)
    return m.output, AttentionStats(
        lse=m.lse,
        entropy=m.entropy,
        normalized_entropy=normalized,
        sparsity=sparsity,
        effective_keys=effective,
        max_weight=m.max_weight,
        n_keys=m.n_keys,
        scale=_row_scale(stats),
    )


# The per-row fields of AttentionStats that the merge reads (scale is checked apart).
_ROW_FIELDS = ("lse", "entropy", "effective_keys", "max_weight", "n_keys")


def _as_list(shards: Iterable, name: str) -> list:
    """The shards of ``name`` as a list: any iterable but a single tensor or AttentionStats (whose
    iteration would give its rows or fields, not shards)."""
    if isinstance(shards, (torch.Tensor, AttentionStats)) or not isinstance(shards, Iterable):
        raise TypeError(f"{name} must be a list of the shards' results, got {type(shards).__name__}")
    return list(shards)


def _check_shards(outputs: Sequence[torch.Tensor], stats: Sequence[AttentionStats]) -> None:
    """TypeError / ValueError naming the argument for shards that are not one row set's results:
    every output of one shape, dtype and device; every per-row statistic of the rows' shape (a
    broadcastable one would merge silently wrong), floating in one dtype, n_keys integer."""
    first = outputs[0]
    if not isinstance(first, torch.Tensor):
        raise TypeError(f"outputs[0] must be a Tensor, got {type(first).__name__}")
    shape, rows = tuple(first.shape), tuple(first.shape[:-1])
    stat_dtype = None
    for i, (o, s) in enumerate(zip(outputs, stats)):
        if not isinstance(o, torch.Tensor):
            raise TypeError(f"outputs[{i}] must be a Tensor, got {type(o).__name__}")
        if not isinstance(s, AttentionStats):
            raise TypeError(f"stats[{i}] must be an AttentionStats, got {type(s).__name__}")
        if tuple(o.shape) != shape:
            raise ValueError(f"outputs[{i}] has shape {tuple(o.shape)}, outputs[0] {shape}")
        if not o.is_floating_point():
            raise TypeError(f"outputs[{i}] must be a floating-point tensor, got {o.dtype}")
        if o.dtype != first.dtype or o.device != first.device:
            raise ValueError(f"outputs[{i}] is {o.dtype} on {o.device}, outputs[0] {first.dtype} on {first.device}")
        for field in _ROW_FIELDS:
            t = getattr(s, field)
            name = f"stats[{i}].{field}"
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
            if tuple(t.shape) != rows:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {rows} (outputs' rows)")
            if t.device != first.device:
                raise ValueError(f"{name} is on {t.device}, outputs[0] on {first.device}")
            if field == "n_keys":
                if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
                    raise TypeError(f"{name} must be an integer tensor (key counts), got {t.dtype}")
            elif not t.is_floating_point():
                raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
            elif stat_dtype is None:
                stat_dtype = t.dtype
            elif t.dtype != stat_dtype:
                raise ValueError(f"{name} is {t.dtype}, stats[0].lse {stat_dtype}: shards of one call share a dtype")


def _row_scale(stats: Sequence[AttentionStats]) -> torch.Tensor:
    """Per row, the scale of the first shard with keys for it (the one lambda_i of the row, which
    _check_same_scale holds the others to), else stats[0]'s: a shard without keys for a row may
    report any scale there (0, or its own "logn" of no keys)."""
    scale, found = stats[0].scale, stats[0].n_keys > 0
    for s in stats[1:]:
        take = ~found & (s.n_keys > 0)
        scale = torch.where(take, s.scale.to(scale.dtype), scale)
        found = found | take
    return scale


def _check_same_scale(stats: Sequence[AttentionStats]) -> None:
    """ValueError where two shards used different lambda_i for a row that both have keys for (a
    row without keys in a shard takes no part in the merge, whatever its scale): with each shard's
    own "logn" policy, say, the merge would be silently wrong (its weights e^{lse} are of different
    logits). Each shard is compared, row by row, with the first shard that has keys for the row,
    so an empty shard or one without keys for some rows leaves no row unchecked. Equal to rounding:
    the same value computed alike gives the same bits. Eager mode only: under torch.compile or a
    torch.func transform a value cannot decide a branch."""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return
    rows = tuple(stats[0].lse.shape)
    for i, s in enumerate(stats):
        if not isinstance(s.scale, torch.Tensor) or tuple(s.scale.shape) != rows:
            raise ValueError(f"stats[{i}].scale must be a tensor of the rows' shape {rows}")
    # The scale of the first shard with keys for each row, and that shard's index (-1: none yet).
    ref = stats[0].scale
    owner = torch.where(stats[0].n_keys > 0, 0, -1)
    for i, s in enumerate(stats[1:], start=1):
        has = s.n_keys > 0
        same = torch.isclose(s.scale, ref.to(s.scale.dtype), rtol=8 * torch.finfo(s.scale.dtype).eps, atol=0,
                             equal_nan=True)
        bad = has & (owner >= 0) & ~same
        if bool(bad.any()):
            j = int(owner[bad][0])
            raise ValueError(
                f"stats[{i}].scale differs from stats[{j}].scale in rows that both shards have keys for: "
                "every shard must use the whole row's lambda_i (pass it as a scale tensor, e.g. from "
                "torch_ext.length_factor of the whole row's n_i for the log-n policies)"
            )
        take = has & (owner < 0)
        ref = torch.where(take, s.scale.to(ref.dtype), ref)
        owner = torch.where(take, i, owner)


def _sum_p2(s: AttentionStats) -> torch.Tensor:
    """sum_j p_ij^2 of a shard: 1 / effective keys (0 for a row without keys), differentiable."""
    nonempty = s.n_keys > 0
    eff = torch.where(nonempty, s.effective_keys, torch.ones_like(s.effective_keys))
    return torch.where(nonempty, 1 / eff, torch.zeros_like(eff))
