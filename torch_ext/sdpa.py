"""``torch_ext.replace_sdpa``: routes ``F.scaled_dot_product_attention`` calls to the fused op, so that
models calling SDPA (nanoGPT-style code, timm ViTs, transformers' "sdpa" backend) switch without
edits."""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from torch_ext.policy import AttentionPolicy, attend

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
) -> torch.Tensor:
    """SDPA's signature on the fused op: the call's ``scale`` is the base scale of the policy."""
    if query.dim() == 3 and key.dim() == 3 and value.dim() == 3:  # (N, L, E): one head
        if attn_mask is not None and attn_mask.dim() == 3:
            attn_mask = attn_mask.unsqueeze(1)
        out = attend(
            query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1), attn_mask, policy=policy,
            is_causal=is_causal, base_scale=scale, dropout_p=dropout_p,
        )
        return out.squeeze(1)
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(
            "replace_sdpa: query, key and value must be 4-D (B, H, L, E) or 3-D (N, L, E), got "
            f"{query.dim()}-D, {key.dim()}-D and {value.dim()}-D"
        )
    return attend(
        query, key, value, attn_mask, policy=policy, is_causal=is_causal, enable_gqa=enable_gqa, base_scale=scale,
        dropout_p=dropout_p,
    )


class replace_sdpa(TorchFunctionMode):
    """Context manager: inside it, every ``torch.nn.functional.scaled_dot_product_attention`` call
    (however it was imported) runs on the fused op under the given policy.

    Args are those of :func:`torch_ext.attention`: ``scale`` (``None`` keeps each call's own scale;
    a float replaces it; ``"logn"``/``"logn_sharpen"`` multiply the call's scale, default
    1/sqrt(E), by log_b(n_i) or max(1, log_b n_i)), ``temperature`` and ``train_length`` (b).

    A :class:`~torch_ext.AttentionEntropyMonitor` that records sees these calls, named by the
    innermost module running. It is a ``TorchFunctionMode``: thread-local, nestable (the innermost
    applies), and traced by ``torch.compile`` when active around the compiled call. Calls with
    ``dropout_p > 0`` raise (the op has no attention dropout). Float-mask entries at or below
    ``finfo.min / 2`` count as masked (out of n_i); a row with every key masked gives 0 (SDPA:
    the mean of the values for a ``finfo.min`` mask, NaN for ``-inf``).

    Example::

        with torch_ext.replace_sdpa(scale="logn", train_length=1024):
            logits = gpt(idx)
    """

    def __init__(self, scale: float | str | None = None, temperature: float = 1.0, train_length: float = 512) -> None:
        super().__init__()
        self.policy = AttentionPolicy(scale, temperature, train_length)

    def __torch_function__(
        self, func: Callable, types: Tuple[type, ...], args: Tuple[Any, ...] = (), kwargs: Optional[Dict[str, Any]] = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is _SDPA:
            return _routed_sdpa(self.policy, *args, **kwargs)
        return func(*args, **kwargs)
