"""``torch_ext.hf``: the fused op as a Hugging Face transformers attention backend.

:func:`register` adds an attention function (and its mask function, transformers' ``sdpa_mask``)
under a name of your choice, so that any model whose attention goes through transformers'
``AttentionInterface`` (Llama, Qwen2/3, Mistral, Gemma, BERT, ...) runs on
:func:`torch_ext.attention` under a scale policy, without edits::

    import torch_ext.hf
    from transformers import AutoModelForCausalLM

    name = torch_ext.hf.register("entropy_invariant", scale="logn", train_length=4096)
    model = AutoModelForCausalLM.from_pretrained("Qwen/Qwen3-0.6B", attn_implementation=name)
    # or, on a model already loaded: model.set_attn_implementation(name)

    monitor = torch_ext.AttentionEntropyMonitor(model, every=100)
    with monitor:                         # per-layer, per-head entropy, named by module path
        out = model(input_ids, attention_mask=attention_mask)
    monitor.latest[0]["layer"]            # "model.layers.0.self_attn"

The backend mirrors transformers' ``sdpa_attention_forward``: with ``scale=None`` a model gives
the outputs and gradients of ``attn_implementation="sdpa"``. The model's own scale (its
``scaling``, e.g. 1/sqrt(head_dim), or a config's ``query_pre_attn_scalar``) is the base scale of
the policy: ``"logn"`` multiplies it by log_b(n_i), b = ``train_length``, where n_i counts the keys
query i may attend to (causality, padding and sliding windows included; in KV-cache decoding the
cached keys plus the new ones, as in a full recompute). Query rows with no allowed key (left
padding) give 0, as "sdpa" gives with boolean masks.

Not supported (they raise, naming the argument): attention dropout (``dropout > 0``: set the
model's attention dropout to 0 or call ``.eval()``), logit soft-capping (``softcap``), additive
``position_bias`` (T5-style relative biases, ALiBi), attention sinks (``s_aux`` / ``sinks``) and
paged KV caches (continuous batching). ``output_attentions=True`` warns and gives ``None``
attention weights, as with "sdpa": the op never forms the L x L matrix (use
:class:`torch_ext.AttentionEntropyMonitor` for per-row statistics, or "eager" for the weights).

Only models that call transformers' ``AttentionInterface`` use the backend (their classes set
``_supports_attention_backend = True``: most decoder and encoder models of transformers 5); a model
with its own attention code ignores ``attn_implementation``.

This module imports transformers; ``import torch_ext`` does not.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Optional

import torch

try:
    import transformers
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "torch_ext.hf needs Hugging Face transformers (pip install transformers); the rest of torch_ext "
        f"works without it ({exc})"
    ) from exc

from torch_ext.policy import AttentionPolicy, attend

__all__ = ["register", "attention_forward"]

# Names transformers treats specially: "eager", hub kernels ("org/repo[@rev][:fn]") and names whose
# substrings select code paths ("flash", "flex_attention", "sdpa", the "paged|" prefix).
_RESERVED = ("eager",)
_SPECIAL_SUBSTRINGS = ("flash", "flex_attention", "sdpa", "paged|", "/")


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    if name in _RESERVED or any(s in name for s in _SPECIAL_SUBSTRINGS):
        raise ValueError(
            f"name={name!r} would replace or be routed like one of transformers' own attention implementations "
            "(names containing 'flash', 'flex_attention', 'sdpa', 'paged|' or '/', and 'eager', are reserved): "
            "choose another name, e.g. 'entropy_invariant'"
        )
    return name


def _is_paged_cache(cache: Any) -> bool:
    """Whether ``cache`` is transformers' ``PagedAttentionCache`` (by class name: its module path is
    an implementation detail of continuous batching)."""
    return cache is not None and any(c.__name__ == "PagedAttentionCache" for c in type(cache).__mro__)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    *,
    policy: AttentionPolicy,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """One attention call of a transformers model on the fused op under ``policy``.

    The function :func:`register` installs is this one with ``policy`` bound. Arguments are those
    of transformers' ``sdpa_attention_forward``:

    Args:
        module: the calling attention module (names the layer for the monitor; its
            ``is_causal`` is the default of ``is_causal``).
        query: (B, H, Lq, D). key, value: (B, Hkv, Lk, D) and (B, Hkv, Lk, Dv), Hkv dividing H.
        attention_mask: ``None``, a bool mask (True = attend, from ``sdpa_mask``) or an additive
            float mask, broadcastable to (B, H, Lq, Lk). Float entries at or below
            ``finfo(dtype).min / 2`` are treated as masked (-inf): they do not count in n_i.
        dropout: must be 0 (the op has no attention dropout).
        scaling: the model's scale, the base of the policy (None: 1/sqrt(D)).
        is_causal: whether the layer is causal (default ``module.is_causal``, else True); applied,
            top-left aligned, only when ``attention_mask`` is None and Lq > 1, as "sdpa" does.
        kwargs: other keyword arguments of the model's call; ``softcap``, ``position_bias``,
            ``s_aux``/``sinks`` (when not None) and a paged ``cache`` raise; ``output_attentions``
            warns; the rest (``position_ids``, ``sliding_window``, ...) are ignored: the mask
            carries them.

    Returns:
        ``(attn_output, None)``, ``attn_output`` of shape (B, Lq, H, Dv), contiguous.
    """
    if dropout:
        raise NotImplementedError(
            f"torch_ext.hf: the fused op has no attention dropout, but the model passed dropout={dropout} "
            "(set the config's attention dropout, e.g. attention_dropout or attention_probs_dropout_prob, to 0, "
            "or call model.eval())"
        )
    if kwargs.get("softcap") is not None:
        raise NotImplementedError(
            f"torch_ext.hf does not support logit soft-capping (softcap={kwargs['softcap']}): the op has no "
            "tanh soft-cap; use attn_implementation='eager' for this model (e.g. set attn_logit_softcapping=None)"
        )
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError(
            "torch_ext.hf does not support position_bias (additive relative-position biases, e.g. T5, ALiBi): "
            "use attn_implementation='sdpa' or 'eager' for this model"
        )
    for sink in ("s_aux", "sinks"):
        if kwargs.get(sink) is not None:
            raise NotImplementedError(
                f"torch_ext.hf does not support attention sinks ({sink}): the softmax denominator of the op has no "
                "sink term; use attn_implementation='eager' for this model"
            )
    if _is_paged_cache(kwargs.get("cache")):
        raise NotImplementedError(
            "torch_ext.hf does not support paged KV caches (cache is a PagedAttentionCache, i.e. continuous "
            "batching): use model.generate() with the default DynamicCache or a StaticCache"
        )
    if kwargs.get("output_attentions", False):
        warnings.warn(
            "torch_ext.hf: output_attentions=True gives no attention weights (None, as with 'sdpa'): the fused op "
            "never forms the L x L matrix. Use torch_ext.AttentionEntropyMonitor for per-row statistics, or "
            "attn_implementation='eager' for the weights.",
            UserWarning,
            stacklevel=2,
        )

    q_length, kv_length = query.shape[2], key.shape[2]
    enable_gqa = query.shape[1] != key.shape[1]  # the op maps query head h to kv head h // (H // Hkv)

    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # As "sdpa": the causal flag only without a mask (a mask already carries causality) and never
    # for one query row (decoding attends to every cached key: bottom-right alignment).
    is_causal = bool(q_length > 1 and attention_mask is None and is_causal)
    if is_causal and kv_length > q_length:
        # Prefill into an empty static cache: the keys past q_length are empty slots, which
        # top-left causality already hides; cropping them makes the call square.
        key, value = key[:, :, :q_length], value[:, :, :q_length]

    # attend() expands a batch of 1 and makes finfo.min float-mask entries -inf (out of n_i).
    out = attend(
        query, key, value, attention_mask, policy=policy, is_causal=is_causal, enable_gqa=enable_gqa,
        base_scale=scaling, module=module,
    )
    return out.transpose(1, 2).contiguous(), None


def register(
    name: str = "entropy_invariant",
    *,
    scale: float | str | None = None,
    temperature: float = 1.0,
    train_length: float = 512,
) -> str:
    """Registers the fused op as transformers attention implementation ``name``; returns ``name``.

    Afterwards ``AutoModel.from_config(cfg, attn_implementation=name)``,
    ``from_pretrained(..., attn_implementation=name)`` and ``model.set_attn_implementation(name)``
    select it. Registering a name again replaces its policy (for models built afterwards and for
    models already using it: the function is looked up at each call).

    Args:
        name: the implementation's name. Names transformers routes specially are refused
            ("eager", names containing "sdpa", "flash", "flex_attention", "paged|" or "/").
        scale: ``None`` keeps the model's own scale (outputs as "sdpa"); a float replaces it;
            ``"logn"`` / ``"logn_sharpen"`` multiply it by log_b(n_i) / max(1, log_b n_i).
        temperature: divides the scale (> 0).
        train_length: the log base b of the "logn" policies (> 1): the context length at which
            "logn" equals the model's own scale.

    The mask function registered with it is transformers' ``sdpa_mask``: boolean masks (True =
    attend), or None where causality alone applies.
    """
    name = _check_name(name)
    policy = AttentionPolicy(scale, temperature, train_length)

    entropy_invariant_attention = functools.partial(attention_forward, policy=policy)
    entropy_invariant_attention.policy = policy  # type: ignore[attr-defined]
    transformers.AttentionInterface.register(name, entropy_invariant_attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
