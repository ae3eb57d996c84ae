"""``torch_ext.replace_sdpa``: routes ``F.scaled_dot_product_attention`` calls to the fused op, so that
models calling SDPA (nanoGPT-style code, timm ViTs, transformers' "sdpa" backend) switch without
edits."""

from __future__ import annotations

import sys
import warnings
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.nested._internal.nested_tensor import nested_view_from_values_offsets_lengths
from torch.nn.attention.bias import CausalBias, CausalVariant
from torch.overrides import TorchFunctionMode

from torch_ext import monitor as _monitor
from torch_ext.attention import _check_tensors, _dense_tensors, _gqa_kv_heads
from torch_ext.nested import is_jagged, refuse_strided
from torch_ext.policy import AttentionPolicy, attend

__all__ = ["replace_sdpa"]

_SDPA = F.scaled_dot_product_attention


def _routed_sdpa(
    policy: AttentionPolicy,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    causal_alignment: str = "top_left",
) -> torch.Tensor:
    """SDPA's signature on the fused op: the call's ``scale`` is the base scale of the policy.

    Any layout SDPA takes: (..., L, E) with leading dims that broadcast among query, key, value
    (and the mask), the third from last being the heads (3-D inputs (N, L, E): one head each,
    or, with ``enable_gqa``, N heads, as SDPA groups them; 2-D: one sequence). They are
    flattened to the op's (B, H, L, E), expanded where they broadcast (as SDPA's math does), and
    the output is given the broadcast shape back. Jagged nested tensors: :func:`_jagged_sdpa`.
    ``attn_mask`` may also be one of ``torch.nn.attention.bias``'s causal biases, as SDPA takes them.
    """
    if isinstance(attn_mask, CausalBias):
        # (a tensor subclass that only names a causal variant, whose own __torch_function__ the mode
        # runs before: read as a float mask it gave wrong outputs) The op's causality, aligned as
        # CausalBias._dispatch aligns it: top-left where the variant is, or the bias is square.
        if is_causal:
            raise ValueError("replace_sdpa: CausalBias should not be used with causal=True")
        bottom_right = attn_mask.variant == CausalVariant.LOWER_RIGHT and attn_mask.seq_len_q != attn_mask.seq_len_kv
        return _routed_sdpa(policy, query, key, value, None, dropout_p, True, scale, enable_gqa,
                            causal_alignment="bottom_right" if bottom_right else "top_left")
    if not _dense_tensors(query, key, value, attn_mask):
        if any(is_jagged(x) for x in (query, key, value)):
            return _jagged_sdpa(policy, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                causal_alignment)
        refuse_strided(query=query, key=key, value=value)
        # (before the reshapes below, which fail on a nested tensor with ATen's words)
        _check_tensors(query=query, key=key, value=value, attn_mask=(attn_mask, True))
    if is_causal and attn_mask is not None:
        # As SDPA (with its words): code that ran under the mode must not fail without it.
        raise RuntimeError("replace_sdpa: Explicit attn_mask should not be set when is_causal=True")
    if min(query.dim(), key.dim(), value.dim()) < 2:
        raise ValueError(
            "replace_sdpa: query, key and value must have at least 2 dims (..., L, E), got "
            f"{query.dim()}-D, {key.dim()}-D and {value.dim()}-D"
        )
    nd = max(query.dim(), key.dim(), value.dim())
    if attn_mask is not None and attn_mask.dim() > nd:
        # SDPA's fused CPU kernel takes leading dims of 1 beyond the inputs' (a (1, 1, L, S) mask
        # with (N, L, E) inputs; its math backend refuses them); the output keeps the inputs' shape.
        extra = attn_mask.dim() - nd
        if any(n != 1 for n in attn_mask.shape[:extra]):
            raise ValueError(
                f"replace_sdpa: attn_mask has {attn_mask.dim()} dims, more than query, key and value ({nd}), "
                f"and its leading dims {tuple(attn_mask.shape[:extra])} are not 1: pass a mask broadcastable to "
                "the output (..., L, S)"
            )
        attn_mask = attn_mask.reshape(attn_mask.shape[extra:])
    # One head: a heads dim of 1 in front of (L, E), and in front of a mask's (L, S). (Under GQA,
    # SDPA takes a 3-D input's first dim as the heads it groups: (H, L, E) against (Hkv, S, E).)
    one_head = nd == 2 or (nd == 3 and not enable_gqa)
    if one_head:
        query, key, value = (t.unsqueeze(-3) for t in (query, key, value))
        if attn_mask is not None and attn_mask.dim() >= 3:
            attn_mask = attn_mask.unsqueeze(-3)
    full = max(query.dim(), key.dim(), value.dim())
    # (Inputs of fewer dims than the others broadcast against them: ones in front.)
    tensors = [t.reshape((1,) * (full - t.dim()) + t.shape) for t in (query, key, value)]
    if enable_gqa and tensors[1].shape[-3] != tensors[2].shape[-3]:
        tensors[1], tensors[2] = _gqa_kv_heads(*tensors)  # (SDPA groups key and value heads apart)
    try:
        outer = torch.broadcast_shapes(*(t.shape[:-3] for t in tensors))
        kv_heads = torch.broadcast_shapes(tensors[1].shape[-3:-2], tensors[2].shape[-3:-2])[0]
        q_heads = tensors[0].shape[-3]
        if not (enable_gqa and kv_heads != q_heads):  # without GQA the heads broadcast too
            q_heads = kv_heads = torch.broadcast_shapes((q_heads,), (kv_heads,))[0]
    except RuntimeError:
        raise ValueError(
            "replace_sdpa: the batch sizes and heads (leading dims) of query, key and value, "
            f"{tuple(query.shape[:-2])}, {tuple(key.shape[:-2])} and {tuple(value.shape[:-2])}, do not broadcast"
        ) from None
    batch = 1
    for n in outer:
        batch *= n
    q, k, v = (
        t.expand(*outer, h, *t.shape[-2:]).reshape(batch, h, *t.shape[-2:])
        for t, h in zip(tensors, (q_heads, kv_heads, kv_heads))
    )
    if attn_mask is not None and attn_mask.dim() > 3:
        m = attn_mask.reshape((1,) * (len(outer) + 3 - attn_mask.dim()) + attn_mask.shape)
        if not all(n in (1, o) for n, o in zip(m.shape[:-3], outer)):
            raise ValueError(
                f"replace_sdpa: attn_mask's leading dims {tuple(attn_mask.shape[:-3])} do not broadcast to those "
                f"of query, key and value, {tuple(outer)}"
            )
        if any(n != 1 for n in m.shape[:-3]):
            m = m.expand(*outer, *m.shape[-3:])
        lead = 1  # (not -1: a mask with no keys or no rows has 0 elements, which -1 cannot divide)
        for n in m.shape[:-3]:
            lead *= n
        attn_mask = m.reshape(lead, *m.shape[-3:])
    out = attend(
        q, k, v, attn_mask, policy=policy, is_causal=is_causal, enable_gqa=bool(q_heads != kv_heads), base_scale=scale,
        dropout_p=dropout_p, causal_alignment=causal_alignment,
    )
    out = out.reshape(*outer, *out.shape[1:])
    return out.squeeze(-3) if one_head else out


def _jagged_sdpa(
    policy: AttentionPolicy,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    dropout_p: float,
    is_causal: bool,
    scale: Optional[float],
    enable_gqa: bool,
    causal_alignment: str,
) -> torch.Tensor:
    """SDPA's two kinds of jagged nested inputs. Ragged in a batch dim in front of dense sequences
    ((B, j, ..., L, E), SAM's): the dense call on their buffers, its output given query's offsets.
    Otherwise (B, H, j, E), ragged in the sequences: packed documents (torch_ext/nested.py), whose
    :func:`torch_ext.attention` raises what it does not take, naming it (as SDPA, an ``attn_mask``
    with either kind)."""
    if attn_mask is None and all(is_jagged(x) and x.dim() > 3 and x._ragged_idx == 1 for x in (query, key, value)):
        out = _routed_sdpa(
            policy, query.values(), key.values(), value.values(), None, dropout_p, is_causal, scale, enable_gqa,
            causal_alignment=causal_alignment,
        )
        return nested_view_from_values_offsets_lengths(
            out,
            query.offsets(),
            query.lengths(),
            min_seqlen=query._maybe_min_seqlen,
            max_seqlen=query._maybe_max_seqlen,
        )
    return attend(
        query, key, value, attn_mask, policy=policy, is_causal=is_causal, enable_gqa=enable_gqa, base_scale=scale,
        dropout_p=dropout_p, causal_alignment=causal_alignment,
    )


def _packed_query_heads(
    query: Any,
    key: Any,
    value: Any = None,
    attn_mask: Any = None,
    dropout_p: Any = 0.0,
    is_causal: Any = False,
    scale: Any = None,
    enable_gqa: Any = False,
) -> int:
    """The group size G where this SDPA call is transformers' ``sdpa_attention_forward`` decoding one
    token of a GQA model with its query heads packed (``pack_gqa``: (B, H, 1, E) as (B, Hkv, G, E),
    the G query heads of a group as G rows, and a per-head mask likewise), else 1. The output is
    the same either way; only a recording monitor, which would see Hkv heads of G rows (and refuse
    a step that also ran the prefill's H heads), needs the heads back."""
    module = sys.modules.get("transformers.integrations.sdpa_attention")
    forward = getattr(module, "sdpa_attention_forward", None)
    if forward is None or enable_gqa or not (isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor)):
        return 1
    frame = sys._getframe(1)
    for _ in range(4):  # (the caller, past the torch-function machinery's frames)
        if frame is None or frame.f_code is forward.__code__:
            break
        frame = frame.f_back
    if frame is None or frame.f_code is not forward.__code__:
        return 1
    groups = getattr(frame.f_locals.get("module"), "num_key_value_groups", 1)
    packed = (
        frame.f_locals.get("q_length") == 1 and isinstance(groups, int) and groups > 1 and query.dim() == 4
        and key.dim() == 4 and query.shape[2] == groups and query.shape[1] == key.shape[1]
    )
    return groups if packed else 1


def _unpacked_sdpa(
    policy: AttentionPolicy,
    groups: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    *args: Any,
    **kwargs: Any,
) -> torch.Tensor:
    """A call packed by ``pack_gqa`` (:func:`_packed_query_heads`) with its query heads unpacked:
    (B, Hkv, G, E) -> (B, Hkv G, 1, E) under GQA, the output packed back."""
    b, kv_heads, _, e = query.shape
    q = query.reshape(b, kv_heads * groups, 1, e)
    # A per-head mask (or position bias) was packed alike, (B, H, 1, L) -> (B, Hkv, G, L): its rows
    # are the G heads (with one key/value head too, where its heads dim is 1). A mask shared by the
    # heads ((B, 1, 1, L): pack_gqa leaves it) has one row.
    if attn_mask is not None and attn_mask.dim() == 4 and attn_mask.shape[-2] == groups:
        attn_mask = attn_mask.reshape(attn_mask.shape[0], attn_mask.shape[1] * groups, 1, attn_mask.shape[-1])
    kwargs["enable_gqa"] = True
    out = _routed_sdpa(policy, q, key, value, attn_mask, *args, **kwargs)
    # (the output's batch: a query of batch 1 broadcasts against the keys', as in SDPA)
    return out.reshape(out.shape[0], kv_heads, groups, out.shape[-1])


class replace_sdpa(TorchFunctionMode):
    """Context manager: inside it, every ``torch.nn.functional.scaled_dot_product_attention`` call
    (however it was imported) runs on the fused op under the given policy.

    Args are those of :func:`torch_ext.attention`: ``scale`` (``None`` keeps each call's own scale;
    a float replaces it; ``"logn"``/``"logn_sharpen"`` multiply the call's scale, default
    1/sqrt(E), by log_b(n_i) or max(1, log_b n_i)), ``temperature`` and ``train_length`` (b).

    A :class:`~torch_ext.AttentionEntropyMonitor` that records sees these calls, named by the
    innermost module running. It is a ``TorchFunctionMode``: thread-local, nestable (the innermost
    applies), and traced by ``torch.compile`` when active around the compiled call. Inputs of any
    layout SDPA takes: (..., L, E), broadcasting leading dims, and nested tensors of the jagged
    layout (sequences of different lengths, (B, H, j, E), run without padding; or ragged in a
    batch dim, SAM's); nested tensors of the strided layout raise ``NotImplementedError``;
    ``torch.nn.attention.bias``'s causal biases as ``attn_mask`` run as the op's causality.
    ``dropout_p`` applies the op's attention dropout (pass it in training only, as SDPA's callers
    do). Float-mask entries at or below ``finfo.min / 2`` count as masked (out of n_i); a row with
    every key masked gives 0, as SDPA gives for ``-inf`` and bool masks (SDPA gives the mean of the
    values for a ``finfo.min`` mask).

    Not with activation checkpointing (``torch.utils.checkpoint``, transformers'
    ``gradient_checkpointing_enable()``): the backward re-runs the forward outside the mode (the
    mode is popped while a backward call is dispatched, and gone after the ``with``), so the
    re-run uses torch's SDPA: wrong gradients with ``use_reentrant=True``, a ``CheckpointError``
    otherwise. Use the Hugging Face backend (:mod:`torch_ext.hf`) or :mod:`torch_ext.nn` there,
    which the re-run reaches. Nor does it reach ``torch.nn.MultiheadAttention`` (its functional
    form runs SDPA with the mode disabled; it warns once): use :class:`torch_ext.nn.MultiheadAttention`.

    Example::

        with torch_ext.replace_sdpa(scale="logn", train_length=1024):
            logits = gpt(idx)
    """

    def __init__(self, scale: float | str | None = None, temperature: float = 1.0, train_length: float = 512) -> None:
        super().__init__()
        self.policy = AttentionPolicy(scale, temperature, train_length)
        self._warned_mha = False

    def __torch_function__(
        self, func: Callable, types: Tuple[type, ...], args: Tuple[Any, ...] = (), kwargs: Optional[Dict[str, Any]] = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is _SDPA:
            if _monitor.is_recording():
                n_rep = _packed_query_heads(*args, **kwargs)
                if n_rep > 1:
                    return _unpacked_sdpa(self.policy, n_rep, *args, **kwargs)
            return _routed_sdpa(self.policy, *args, **kwargs)
        if func is F.multi_head_attention_forward and not self._warned_mha:
            self._warned_mha = True
            warnings.warn(
                "replace_sdpa does not reach torch.nn.MultiheadAttention (its functional form runs "
                "SDPA with torch-function modes disabled): use torch_ext.nn.MultiheadAttention",
                stacklevel=2,
            )
        return func(*args, **kwargs)
