"""``torch_ext.varlen_attention``: attention over packed sequences, in the layout of
``torch.nn.attention.varlen.varlen_attn``, with per-document scale policies and statistics."""

from __future__ import annotations

import numbers
from typing import Any

import torch

from torch_ext import _functorch
from torch_ext.attention import (
    AttentionStats,
    _check_tensors,
    _explicit,
    _flag,
    _gqa_kv_heads,
    _pattern_args,
    _policy_args,
    _schema_defaults,
    _stats,
)

__all__ = ["varlen_attention"]

_VARLEN_DEFAULTS = _schema_defaults(torch.ops.entropy_attn.varlen_attention)


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    *,
    is_causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    seqused_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    return_aux: Any = None,
    num_splits: int | None = None,
    scale: float | str | torch.Tensor | None = None,
    temperature: float = 1.0,
    train_length: float = 512,
    scale_factor: float | torch.Tensor | None = None,
    return_stats: bool = False,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor | tuple[torch.Tensor, AttentionStats] | tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over a batch of packed sequences (documents), each attending only to itself.

    The layout and semantics of ``torch.nn.attention.varlen.varlen_attn``: the sequences are
    concatenated along the first dimension and ``cu_seq_q`` / ``cu_seq_k`` (int32, N + 1 entries,
    starting at 0) give their boundaries. Causality and windows are aligned bottom-right within each
    sequence (its last query sees its last key), as in varlen_attn and FlashAttention; ``(W, 0)``
    is causal sliding-window attention. n_i, the number of keys row i sees, counts only its own
    sequence's keys inside its window and causal limit, so the ``"logn"`` scales and the statistics
    are per document, whatever else is packed in the batch.

    Args:
        query: (T, H, D). key: (Tk, Hkv, D). value: (Tk, Hkv, Dv); one dtype and device.
        cu_seq_q, cu_seq_k: int32 (N + 1,) cumulative sequence offsets.
        max_q, max_k: the longest query / key sequence (checked against the offsets).
        is_causal: causal masking, bottom-right aligned (the same as ``window_size[1] = 0``).
        window_size: ``(left, right)`` keys around each row's diagonal (-1: unbounded).
        enable_gqa: allow H to be a multiple of Hkv.
        seqused_k: int32 (N,): only the first ``seqused_k[d]`` keys of sequence d take part
            (a KV cache larger than its content). Inference only: no backward.
        block_table: int32 (N, pages per sequence): a paged KV cache, as varlen_attn's. key and
            value are then pools of pages (num_pages, page_size, Hkv, D / Dv), and sequence d's
            keys are the first ``seqused_k[d]`` (required) tokens of pages ``block_table[d, 0]``,
            ``block_table[d, 1]``, ...; entries past the pages it uses are not read, and pages
            may be shared. ``cu_seq_k`` may be None (given, its lengths must hold seqused_k). On
            the CPU the kernels read the keys in the pool; on CUDA, and while torch.compile
            traces, the pages a call uses are gathered into a packed copy first.
        return_aux: varlen_attn's ``AuxRequest``: with ``lse=True`` the result is
            ``(output, lse)``, lse of shape (H, T) (``stats.lse`` transposed); not with
            ``return_stats``, whose ``stats.lse`` it is.
        num_splits: varlen_attn's split-KV count: None (the kernels choose; a sequence's result
            may then differ in its last bits with what else is packed in the call) or 1,
            batch-invariant output: each sequence runs as a call of its own, so that its results
            are bitwise those it gets packed alone, whatever else is packed with it (one kernel
            call per sequence; the offsets are read on the host, so torch.compile breaks its graph
            there and runs the call eagerly; not with dropout).
        scale, temperature, train_length, scale_factor, return_stats, softcap, sinks, dropout_p,
            generator: as :func:`torch_ext.attention`; a scale tensor broadcasts to (T, H).

    Returns:
        The output (T, H, Dv); ``(output, stats)`` with statistics of shape (T, H); or
        ``(output, lse)`` with ``return_aux``.
    """
    for name, m in (("max_q", max_q), ("max_k", max_k)):
        # (a SymInt while torch.compile traces dynamic lengths: passed on as it is, not fixed)
        if isinstance(m, bool) or not isinstance(m, (numbers.Integral, torch.SymInt)):
            raise TypeError(f"{name} must be an int, got {type(m).__name__}")
        if not 0 <= m < 2**63:
            raise ValueError(f"{name} must be an int in [0, 2^63), got {m}")
    _check_tensors(query=query, key=key, value=value, cu_seq_q=cu_seq_q, cu_seq_k=(cu_seq_k, True),
                   seqused_k=(seqused_k, True), sinks=(sinks, True), block_table=(block_table, True))
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral)):
        raise TypeError(f"num_splits must be None or an int, got {type(num_splits).__name__}")
    scale_tensor, policy = _policy_args(scale, temperature, train_length, scale_factor)
    pattern = _pattern_args(window_size, "bottom_right", softcap, dropout_p, generator)
    return_stats = _flag(return_stats, "return_stats")
    return_lse = _aux_lse(return_aux)
    if return_lse and return_stats:
        raise ValueError("pass return_stats=True or return_aux=AuxRequest(lse=True), not both (stats.lse is the lse)")
    del pattern["causal_alignment"]  # always bottom-right within each sequence
    enable_gqa = _flag(enable_gqa, "enable_gqa")
    # (as attention takes them; not a paged cache's pools, whose repetition would copy every page)
    if (enable_gqa and block_table is None and min(query.dim(), key.dim(), value.dim()) >= 2
            and key.shape[-2] != value.shape[-2]):
        key, value = _gqa_kv_heads(query, key, value, dim=-2)
    options = dict(is_causal=_flag(is_causal, "is_causal"), enable_gqa=enable_gqa,
                   return_stats=return_stats, **policy, **pattern)
    options["seqused_k"] = seqused_k
    options["block_table"] = block_table
    options["num_splits"] = num_splits
    if _functorch.transforms_active():
        res = _functorch.varlen_attention(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale_tensor, sinks,
                                          options)
    else:
        options = _explicit(options, _VARLEN_DEFAULTS)
        # num_splits=1 reads the offsets on the host, which a traced graph cannot: torch.compile
        # breaks the graph there and runs the call eagerly (fullgraph=True raises, naming why).
        op = _per_sequence_op if num_splits == 1 and torch.compiler.is_compiling() else _op
        res = op(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale_tensor, sinks=sinks, **options)
    if return_lse:
        return res[0], res[1].t().contiguous()
    if not return_stats:
        return res[0]
    return res[0], _stats(res)


def _op(*args: Any, **kwargs: Any) -> tuple:
    """``entropy_attn::varlen_attention``."""
    return torch.ops.entropy_attn.varlen_attention(*args, **kwargs)


_per_sequence_op = torch.compiler.disable(
    _op,
    reason="varlen_attention with num_splits=1 reads cu_seq_q and cu_seq_k on the host to run each "
    "sequence alone, which a traced graph cannot: it runs eagerly, between graphs",
)


def _aux_lse(return_aux: Any) -> bool:
    """Whether varlen_attn's ``return_aux`` (None, or an ``AuxRequest``) asks for the lse."""
    if return_aux is None:
        return False
    if not hasattr(return_aux, "lse"):
        raise TypeError(
            f"return_aux must be None or torch.nn.attention.varlen.AuxRequest, got {type(return_aux).__name__}"
        )
    return _flag(return_aux.lse, "return_aux.lse")
