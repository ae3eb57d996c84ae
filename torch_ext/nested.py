"""Nested (jagged) tensors in :func:`torch_ext.attention` and the SDPA drop-in.

``torch.nested`` tensors of the jagged layout, shape (B, H, j, D) and ragged in the sequence dim
(dim 2: a (B, j, H, D) projection transposed, as SDPA takes them), hold sequences of different
lengths without padding. They run as the op's packed documents: the jagged tensor's buffer
viewed as (H, T, D) is the dense call's (1, H, T, D) query (key, value), with no copy, and its
offsets are ``cu_seq_q`` (``cu_seq_k``). So no padding is computed, each sequence attends only to
its own keys, and n_i (the "logn" scales, the statistics) counts them. The output is a jagged
tensor with the query's offsets, and each statistic one of shape (B, H, j). Jagged tensors with
holes (``torch.nested.narrow``) have their sequences gathered first, and the output is put back
in the query's layout. GQA decoding goes through ``varlen_attention`` (:meth:`JaggedCall.run`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nested._internal.nested_tensor import NestedTensor, nested_view_from_values_offsets_lengths

__all__ = ["JaggedCall", "is_jagged", "monitor_view", "pack", "refuse_strided"]


def is_jagged(x: object) -> bool:
    """Whether ``x`` is a nested tensor of the jagged layout (the Python subclass that implements
    it: an isinstance check, where reading ``layout`` dispatches through it, about 20 us)."""
    return isinstance(x, NestedTensor)


def refuse_strided(**named: object) -> None:
    """NotImplementedError naming the first argument that is a nested tensor of the strided layout,
    and saying which layout :func:`torch_ext.attention` takes."""
    for name, x in named.items():
        if isinstance(x, torch.Tensor) and x.is_nested and x.layout == torch.strided:
            raise NotImplementedError(
                f"{name} is a nested tensor of layout torch.strided, which the ops do not take: pass query, key and "
                "value as nested tensors of layout torch.jagged, (B, H, j, D), or pack the sequences for "
                "torch_ext.varlen_attention"
            )


def _check_shape(name: str, x: torch.Tensor) -> None:
    """A ValueError unless ``x`` is (B, H, j, D), ragged in dim 2."""
    ragged = x._ragged_idx  # type: ignore[attr-defined]
    if x.dim() != 4 or ragged != 2:
        hint = " (a (B, j, H, D) tensor: pass x.transpose(1, 2))" if x.dim() == 4 and ragged == 1 else ""
        raise ValueError(
            f"{name} must be a jagged tensor of shape (B, H, j, D), ragged in dim 2 (the sequences), got "
            f"{x.dim()} dims ragged in dim {ragged}{hint}"
        )


def _sequences(
    x: torch.Tensor, like: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The packed (H, T, D) view of a jagged (B, H, j, D) tensor, its int32 offsets (B + 1), and,
    for a tensor with holes (its sequences do not fill its buffer), the rows of the buffer its
    sequences hold (the packed tensor is then gathered from them). ``like``: the result for a
    tensor of the same offsets and lengths, whose rows serve (value's, from key's: one gather
    size, which torch.compile then knows to be key's)."""
    values, offsets, lengths = x.values(), x.offsets(), x.lengths()
    if lengths is None:
        return values, offsets.to(torch.int32), None
    if like is not None:
        return values.index_select(1, like[2]), like[1], like[2]
    starts = offsets[:-1]
    lengths = lengths.to(offsets.dtype)
    total = int(lengths.sum())
    ends = torch.cumsum(lengths, 0)
    first = torch.repeat_interleave(starts - (ends - lengths), lengths, output_size=total)
    rows = first + torch.arange(total, device=offsets.device, dtype=offsets.dtype)
    packed_offsets = torch.cat([ends.new_zeros(1), ends]).to(torch.int32)
    return values.index_select(1, rows), packed_offsets, rows


@dataclass
class JaggedCall:
    """A call on jagged query, key and value as the op's packed documents (:func:`pack`)."""

    query: torch.Tensor
    """(1, H, T, D): the query's sequences, packed."""
    key: torch.Tensor
    """(1, Hkv, Tk, D)."""
    value: torch.Tensor
    """(1, Hkv, Tk, Dv)."""
    cu_seq_q: torch.Tensor
    """int32 (B + 1,): the query's sequences in ``query``."""
    cu_seq_k: torch.Tensor
    """int32 (B + 1,): the key's sequences in ``key`` and ``value``."""
    jagged_query: torch.Tensor
    """The query as given (its offsets, lengths and sizes shape the results)."""
    query_rows: torch.Tensor | None
    """With holes in the query: the rows of its buffer that ``query`` holds."""

    def per_row(self, x: torch.Tensor) -> torch.Tensor:
        """A per-sequence-and-head tensor (broadcastable to (B, H, 1), as a scale tensor) as the op's
        (1, H, T): each row takes its sequence's value."""
        batch, heads = self.jagged_query.shape[0], self.jagged_query.shape[1]
        if x.dim() > 3 or any(n not in (1, full) for n, full in zip(reversed(x.shape), (1, heads, batch))):
            raise ValueError(
                f"a scale tensor with jagged query, key and value must broadcast to (B, H, 1) = ({batch}, {heads}, 1) "
                f"(one value per sequence and head: the sequences' lengths differ), got shape {tuple(x.shape)}"
            )
        per_sequence = x.reshape((1,) * (3 - x.dim()) + tuple(x.shape)).expand(batch, heads, 1)[:, :, 0]
        rows = self.query.shape[2]
        lengths = self.cu_seq_q[1:] - self.cu_seq_q[:-1]
        sequence = torch.repeat_interleave(torch.arange(batch, device=x.device), lengths.to(x.device), output_size=rows)
        return per_sequence[sequence].t().unsqueeze(0)

    def run(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: torch.Tensor | None,
        sinks: torch.Tensor | None,
        options: dict[str, Any],
    ) -> tuple[torch.Tensor, ...]:
        """The call on the packed (1, H, T, D) ``query``, ``key`` and ``value`` (as attention()
        passes them: GQA's head counts made one) with all of ``attention``'s keyword ``options``;
        its results as jagged tensors (the output, and each statistic with return_stats).

        With GQA, a call whose alignment does not matter (no causality or window) or is
        bottom-right goes to ``varlen_attention``: the same call, which packs a group's query heads
        as the rows of one head where every row sees all of its sequence's keys (decoding;
        csrc/varlen.cpp: query_head_rows). It takes the longest lengths, read on the host: not
        while torch.compile traces. A ValueError about the offsets says whose they are (the caller
        passed no cu_seq_q or cu_seq_k)."""
        if scale is not None:
            scale = self.per_row(scale)
        unbounded = not options["is_causal"] and tuple(options["window_size"]) == (-1, -1)
        try:
            if (
                options["enable_gqa"]
                and query.shape[1] != key.shape[1]
                and (unbounded or options["causal_alignment"] == "bottom_right")
                and not torch.compiler.is_compiling()
            ):
                varlen_options = {k: v for k, v in options.items() if k != "causal_alignment"}
                res = torch.ops.entropy_attn.varlen_attention(
                    *(x[0].transpose(0, 1) for x in (query, key, value)),
                    self.cu_seq_q,
                    self.cu_seq_k,
                    _longest(self.cu_seq_q),
                    _longest(self.cu_seq_k),
                    None if scale is None else scale[0].t(),
                    sinks=sinks,
                    **varlen_options,
                )
                # (T, H, ...) as the dense call's (1, H, T, ...); empty statistics stay.
                res = tuple(x.transpose(0, 1).unsqueeze(0) if x.dim() >= 2 else x for x in res)
            else:
                res = torch.ops.entropy_attn.attention(
                    query, key, value, None, scale, sinks=sinks, cu_seq_q=self.cu_seq_q, cu_seq_k=self.cu_seq_k,
                    **options,
                )
        except ValueError as e:
            if "cu_seq_" not in str(e):
                raise
            raise ValueError(f"{e} (cu_seq_q and cu_seq_k: the jagged query's and key's offsets)") from None
        return (self.jagged(res[0]), *(self.jagged(x) if options["return_stats"] else x for x in res[1:]))

    def jagged(self, x: torch.Tensor) -> torch.Tensor:
        """The op's (1, H, T, ...) result as a jagged (B, H, j, ...) tensor in the query's layout:
        its (H, T, ...) view, ragged in dim 2 as given (no transpose of a jagged tensor, each of
        which dispatches in Python)."""
        values = x[0]
        q = self.jagged_query
        if self.query_rows is not None:
            buffer = values.new_zeros((values.shape[0], q.values().shape[1], *values.shape[2:]))
            values = buffer.index_copy(1, self.query_rows, values)
        return nested_view_from_values_offsets_lengths(
            values,
            q.offsets(),
            q.lengths(),
            ragged_idx=2,
            min_seqlen=q._maybe_min_seqlen,  # type: ignore[attr-defined]
            max_seqlen=q._maybe_max_seqlen,  # type: ignore[attr-defined]
        )


def pack(query: object, key: object, value: object, attn_mask: object) -> JaggedCall:
    """The packed documents of a call on jagged tensors, or the error that names what is wrong: as
    SDPA, query, key and value must all be jagged, of one batch size, and take no ``attn_mask``;
    each (B, H, j, D), ragged in the sequences; key and value of the same lengths."""
    named = {"query": query, "key": key, "value": value}
    for name, x in named.items():
        if not is_jagged(x):
            kind = f"a {type(x).__name__}" if not isinstance(x, torch.Tensor) else (
                f"a nested tensor of layout {x.layout}" if x.is_nested else "a dense tensor"
            )
            raise ValueError(
                f"{name} is {kind} while another of query, key and value is a jagged nested tensor: pass all three "
                "as nested tensors of layout torch.jagged, or none"
            )
    if attn_mask is not None:  # (SDPA refuses it first too, whatever the jagged tensors' shapes)
        raise ValueError(
            "attn_mask is not supported with jagged query, key and value (as SDPA): each sequence attends to its own "
            "keys; use is_causal or window_size for more"
        )
    for name, x in named.items():
        _check_shape(name, x)  # type: ignore[arg-type]
    q, k, v = query, key, value
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        raise ValueError(
            f"query, key and value must hold the same number of sequences, got {q.shape[0]}, {k.shape[0]} and "
            f"{v.shape[0]}"
        )
    same = k.offsets() is v.offsets() and k.lengths() is v.lengths()
    if not same and not _same_lengths(k, v):
        raise ValueError("key and value must have the same sequence lengths (their offsets differ)")
    q_values, cu_seq_q, query_rows = _sequences(q)
    keys = _sequences(k)
    k_values, cu_seq_k, _ = keys
    v_values, _, _ = _sequences(v, keys if same and keys[2] is not None else None)
    return JaggedCall(
        query=q_values.unsqueeze(0),
        key=k_values.unsqueeze(0),
        value=v_values.unsqueeze(0),
        cu_seq_q=cu_seq_q,
        cu_seq_k=cu_seq_k,
        jagged_query=q,
        query_rows=query_rows,
    )


def _longest(offsets: torch.Tensor) -> int:
    """The longest sequence of int32 offsets (read on the host)."""
    return int((offsets[1:] - offsets[:-1]).max()) if offsets.numel() > 1 else 0


def _same_lengths(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two jagged tensors whose offsets are different tensors (built apart) hold sequences
    of the same lengths: read on the host. A traced graph cannot check that at run time, so while
    torch.compile traces such tensors raise: value read with key's offsets would be silently
    wrong where they differ."""
    if torch.compiler.is_compiling():
        raise ValueError(
            "key and value are jagged tensors with offsets of their own (built apart), whose lengths a compiled "
            "graph cannot check: under torch.compile build them with one offsets tensor (e.g. "
            "torch.nested.nested_tensor_from_jagged(values, key.offsets())), or from one projection"
        )
    la = a.offsets().diff() if a.lengths() is None else a.lengths()
    lb = b.offsets().diff() if b.lengths() is None else b.lengths()
    return la.shape == lb.shape and bool(torch.equal(la.to(lb.device), lb))


def monitor_view(
    stats: tuple[torch.Tensor, ...],
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor | None]:
    """Jagged statistics (B, H, j) as a dense call's (1, H, T) over their buffer's rows, for the
    monitor: each row's position in its own sequence, and, with holes, which rows are the
    sequences' ((1, T) bool; else None)."""
    first = stats[0]
    offsets, lengths = first.offsets(), first.lengths()
    rows = first.values().shape[-1]
    index = torch.arange(rows, device=offsets.device, dtype=offsets.dtype)
    sequence = torch.searchsorted(offsets[1:], index, right=True).clamp_(max=offsets.numel() - 2)
    positions = index - offsets[sequence]
    real = None
    if lengths is not None:
        real = positions < lengths.to(offsets.dtype)[sequence]
        positions = positions.where(real, 0)  # (holes: no position past their sequence's end)
        real = real.unsqueeze(0)
    return tuple(s.values().unsqueeze(0) for s in stats), positions, real
