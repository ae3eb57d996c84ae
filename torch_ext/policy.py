"""The scale policy shared by the model-facing wrappers (``torch_ext.nn``, ``torch_ext.replace_sdpa``,
``torch_ext.hf``), and :func:`attend`, the one call they all make: it runs the fused op and hands
its statistics to an active :class:`~torch_ext.AttentionEntropyMonitor`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from torch_ext import monitor as _monitor
from torch_ext import nested as _nested
from torch_ext.attention import _SCALE_MODES, AttentionStats, _is_real, _policy_args, attention
from torch_ext.varlen import varlen_attention

__all__ = ["AttentionPolicy", "attend"]


@dataclass(frozen=True)
class AttentionPolicy:
    """How the logits are scaled: the ``scale``, ``temperature`` and ``train_length`` arguments of
    :func:`torch_ext.attention`, checked once at construction.

    ``scale``: ``None`` keeps the caller's scale (the model's own, e.g. a transformers module's
    ``scaling``, else 1/sqrt(D)); a float replaces it; ``"logn"`` / ``"logn_sharpen"`` multiply the
    caller's scale by log_b(n_i) (resp. max(1, log_b n_i)), b = ``train_length``.
    """

    scale: float | str | None = None
    temperature: float = 1.0
    train_length: float = 512

    def __post_init__(self) -> None:
        # (its own message: :func:`torch_ext.attention`'s scale also takes a Tensor, a policy's not)
        accepted = f"None, a float or one of {_SCALE_MODES}"
        if isinstance(self.scale, str) and self.scale not in _SCALE_MODES:
            raise ValueError(f"AttentionPolicy.scale must be {accepted}, got {self.scale!r}")
        if not (self.scale is None or isinstance(self.scale, str) or _is_real(self.scale)):
            raise TypeError(f"AttentionPolicy.scale must be {accepted}, got {type(self.scale).__name__}")
        _policy_args(self.scale, self.temperature, self.train_length)
        if self.scale is not None and not isinstance(self.scale, str):
            # A real number of another type (numpy, Fraction) as the float it stands for, so that
            # attention_kwargs takes it as the scale (it fell back to the caller's scale).
            object.__setattr__(self, "scale", float(self.scale))

    @property
    def uses_length(self) -> bool:
        """Whether the scale depends on n_i (the "logn" policies)."""
        return isinstance(self.scale, str)

    def attention_kwargs(
        self, head_dim: int, base_scale: float | None = None, multiplier: torch.Tensor | None = None
    ) -> dict[str, Any]:
        """Keyword arguments of :func:`torch_ext.attention` for a call site whose own scale is
        ``base_scale`` (None: 1/sqrt(head_dim)), times an optional learnable ``multiplier``
        broadcastable to (B, H, Lq)."""
        base = self.scale if isinstance(self.scale, float) else base_scale
        if base is None and head_dim > 0:  # (head dim 0: the op refuses the call, naming it)
            base = 1.0 / math.sqrt(head_dim)
        c: float | torch.Tensor | None = base if multiplier is None or base is None else multiplier * base
        kwargs: dict[str, Any] = {"temperature": self.temperature, "train_length": self.train_length}
        if self.uses_length:
            return {**kwargs, "scale": self.scale, "scale_factor": c}
        return {**kwargs, "scale": c}


def masked_entries(attn_mask: torch.Tensor) -> torch.Tensor:
    """Where a bool or additive mask hides the key: ``False`` entries of a bool mask, float entries
    at or below ``finfo(dtype).min / 2`` (``-inf`` included; transformers and many models fill
    padding with ``finfo.min``)."""
    if attn_mask.dtype == torch.bool:
        return ~attn_mask
    return attn_mask <= torch.finfo(attn_mask.dtype).min / 2


def hide_masked(attn_mask: torch.Tensor) -> torch.Tensor:
    """A float mask with its masked entries (:func:`masked_entries`) set to ``-inf``, as the op reads
    it; a bool mask as it is."""
    if not attn_mask.is_floating_point():
        return attn_mask
    return attn_mask.masked_fill(masked_entries(attn_mask), float("-inf"))


def sdpa_conventions(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Adapts SDPA-style call arguments to the op: a batch of 1 is expanded to the others' batch
    (SDPA broadcasts it, e.g. learned queries shared by the batch), and a float mask's "masked"
    entries (``finfo(dtype).min``, or anything at or below half of it, as transformers and many
    models fill padding) become ``-inf``, so that those keys do not count in n_i nor in the
    monitor's statistics. Other additive values are kept."""
    # (Compared one by one, not as a set: under torch.jit.trace the sizes are traced values, which
    # a set does not deduplicate.)
    sizes = (query.shape[0], key.shape[0], value.shape[0])
    if not sizes[0] == sizes[1] == sizes[2]:  # (the common case skips the loops)
        b = max(sizes)
        if any(n != 1 and n != b for n in sizes):
            raise ValueError(
                f"query, key and value batch sizes {sizes[0]}, {sizes[1]} and {sizes[2]} do not broadcast"
            )
        query, key, value = (t.expand(b, *t.shape[1:]) if t.shape[0] != b else t for t in (query, key, value))
    return query, key, value, None if attn_mask is None else hide_masked(attn_mask)


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    policy: AttentionPolicy,
    is_causal: bool = False,
    enable_gqa: bool = False,
    base_scale: float | None = None,
    multiplier: torch.Tensor | None = None,
    module: torch.nn.Module | None = None,
    return_stats: bool = False,
    positions: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    **features: Any,
) -> torch.Tensor | tuple[torch.Tensor, AttentionStats]:
    """:func:`torch_ext.attention` under ``policy``, with SDPA's conventions
    (:func:`sdpa_conventions`); reports the statistics to the active monitor.

    ``module`` names the layer for the monitor (its path in the monitored model); without it the
    monitor uses the innermost module running. ``positions`` (Lq,) or (B, Lq) and ``rows`` (B, Lq)
    bool tell the monitor each row's token position (default: the row index) and which rows are
    real tokens (default: those that see a key). ``return_stats`` also returns the statistics.
    ``features`` go to :func:`torch_ext.attention` as they are: ``window_size``,
    ``causal_alignment``, ``softcap``, ``sinks``, ``dropout_p``. Jagged nested query, key and
    value (torch_ext/nested.py) report each row's position in its own sequence.
    """
    jagged = _nested.is_jagged(query)
    if not jagged:  # (jagged tensors take neither a mask nor a batch to broadcast)
        query, key, value, attn_mask = sdpa_conventions(query, key, value, attn_mask)
    kwargs = {**policy.attention_kwargs(query.shape[-1], base_scale, multiplier), **features}
    if not (return_stats or _monitor.is_recording()):
        return attention(query, key, value, attn_mask, is_causal=is_causal, enable_gqa=enable_gqa, **kwargs)
    out, stats = attention(
        query, key, value, attn_mask, is_causal=is_causal, enable_gqa=enable_gqa, return_stats=True, **kwargs
    )
    if jagged:  # each row's position in its own sequence, as for packed documents
        packed, positions, rows = _nested.monitor_view(stats)
        _monitor.record(AttentionStats(*packed), module, positions, rows, features.get("sinks"))
    else:
        _monitor.record(stats, module, positions, rows, features.get("sinks"))
    return (out, stats) if return_stats else out


def attend_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    policy: AttentionPolicy,
    is_causal: bool = False,
    enable_gqa: bool = False,
    base_scale: float | None = None,
    module: torch.nn.Module | None = None,
    **features: Any,
) -> torch.Tensor:
    """:func:`torch_ext.varlen_attention` on packed (T, H, D) tensors under ``policy``; reports the
    statistics to the active monitor with each row's position inside its own document, so that
    per-position curves and n_i are per document. ``features``: ``window_size``, ``softcap``,
    ``sinks``, ``dropout_p``."""
    kwargs = {**policy.attention_kwargs(query.shape[-1], base_scale), **features}
    args = (query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)
    if not _monitor.is_recording():
        return varlen_attention(*args, is_causal=is_causal, enable_gqa=enable_gqa, **kwargs)
    out, stats = varlen_attention(*args, is_causal=is_causal, enable_gqa=enable_gqa, return_stats=True, **kwargs)
    # (T, H) -> (1, H, T), the layout of a dense call, and the in-document position of each row.
    dense = AttentionStats(*(x.t().unsqueeze(0) for x in stats))
    starts = torch.repeat_interleave(cu_seq_q[:-1].long(), (cu_seq_q[1:] - cu_seq_q[:-1]).long())
    _monitor.record(dense, module, positions=torch.arange(query.shape[0], device=query.device) - starts,
                    sinks=features.get("sinks"))
    return out
