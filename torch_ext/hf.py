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
padding) give 0, as "sdpa" gives with boolean masks. Where "sdpa" gets a float mask instead (a
``position_bias`` joined to the mask at ``finfo.min``: T5, mT5, UMT5, wav2vec2-conformer,
wav2vec2-BERT, Parakeet and the speech models built on it (Canary, Cohere ASR); Doge's learned
mask), it averages such a row's values uniformly, as "eager" does:
those models differ from "sdpa" on those rows only (keep them out of the loss).

What the model passes goes to the op: attention dropout (``dropout``, training only), logit
soft-capping (``softcap``, Gemma 2), attention sinks (``s_aux`` / ``sinks``, gpt-oss), the
layer's ``sliding_window`` (Mistral, Gemma 2/3, gpt-oss: the op skips the key blocks left of the
window; where a mask is given it still decides, so KV caches of any layout and masks that open
later keys, as Gemma 3's image blocks, stay right) and packed batches: transformers'
``cu_seq_lens_q`` / ``cu_seq_lens_k`` / ``max_length_q`` / ``max_length_k`` keyword arguments
(``DataCollatorWithFlattening``), or, for a batch of one row, ``position_ids`` that restart with
transformers' own packed-batch mask (each row sees its document's keys under causality and the
window; not while torch.compile traces), run as :func:`torch_ext.varlen_attention`, so that each document attends
only to itself and n_i restarts with each document (the monitor's per-position curves too). The
keys an indexer selects (``indices``, DeepSeek-V3.2's sparse attention) restrict the mask, as
transformers does for "sdpa"; query rows sliced from a forward whose causal mask was skipped
(Gemma 4's KV-shared layers with ``logits_to_keep``) attend with bottom-right causality.

An additive ``position_bias`` (T5's learned relative-position biases and the models built on them,
wav2vec2-conformer's and wav2vec2-BERT's relative positions) joins the mask as "sdpa" joins them
(added to a float mask, kept where a bool mask attends, hidden elsewhere), and the op
differentiates it: the bias and learned masks (Doge's) get their gradients, as with "sdpa".

Not supported (they raise, naming the argument): block-sparse ``block_indices`` (MiniMax-M3),
sinks computed per query rather than one logit per head, paged KV caches (continuous batching), and
``position_bias`` with a packed batch.
``output_attentions=True`` warns and gives ``None`` attention weights, as with "sdpa": the op
never forms the L x L matrix (use :class:`torch_ext.AttentionEntropyMonitor` for per-row
statistics, or "eager" for the weights).

Only models that call transformers' ``AttentionInterface`` use the backend (most decoder and
encoder models of transformers 5). A model that picks its attention class from a table of its own
(Falcon, GPT-J, GPT-Neo, Bark, GIT, SuperGlue, SAM's vision encoder and the models built on it,
Data2Vec-Vision) raises transformers' ``KeyError`` when built with the backend's name; after
``set_attn_implementation(name)`` those layers keep their own attention (the monitor records none
of their calls, and warns on a step that records nothing), though the model builds its masks with
the backend's mask function. That function gives what "sdpa" gets (``sdpa_mask``: bool, or None
where causality alone applies) to models that support "sdpa" or run flash attention through the
interface (Gemma 2, gpt-oss), and what "eager" gets (``eager_mask``: additive float masks, never
skipped) to the models that support neither (PEGASUS-X, NLLB-MoE, GIT, TrOCR, BLIP's text decoder,
Splinter, DeepSeek-V4, ...), whose attention code relies on eager's masks. Where such a model
passes no mask, its layers attend to every key whatever their ``is_causal`` says, as "eager" does
(BridgeTower's image stream). Their outputs equal "eager"'s on every row that sees a key (a row
that sees none, such as a left-padding row, gives 0, as with "sdpa", where "eager" averages the
values).

This module imports transformers; ``import torch_ext`` does not.
"""

from __future__ import annotations

import functools
import numbers
import threading
import warnings
import weakref
from typing import Any, Optional

import torch

try:
    import transformers
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "torch_ext.hf needs Hugging Face transformers (pip install transformers); the rest of torch_ext "
        f"works without it ({exc})"
    ) from exc

from torch_ext import monitor as _monitor
from torch_ext.policy import AttentionPolicy, attend, attend_varlen, masked_entries

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
        dropout: attention dropout probability (transformers passes 0 outside training).
        scaling: the model's scale, the base of the policy (None: 1/sqrt(D)).
        is_causal: whether the layer is causal (default ``module.is_causal``, else True); applied,
            top-left aligned, only when ``attention_mask`` is None and Lq > 1, as "sdpa" does, and
            not in models that get "eager"'s masks (eager's attention takes causality from the
            mask alone).
        kwargs: other keyword arguments of the model's call: ``softcap``, ``s_aux``/``sinks``,
            ``sliding_window``, the packed-batch ``cu_seq_lens_q``/``cu_seq_lens_k``/
            ``max_length_q``/``max_length_k``, ``position_ids``, ``indices`` and an additive
            ``position_bias`` (B or 1, H, Lq, Lk) are used (see the module docstring);
            ``block_indices`` and a paged ``cache`` raise; ``output_attentions`` warns; the rest
            are ignored.

    Returns:
        ``(attn_output, None)``, ``attn_output`` of shape (B, Lq, H, Dv), contiguous.
    """
    if kwargs.get("block_indices") is not None:
        raise NotImplementedError(
            "torch_ext.hf does not support block_indices (block-sparse attention selected by an indexer, e.g. "
            "MiniMax-M3): use attn_implementation='sdpa' or 'eager' for this model"
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
    # The op maps query head h to kv head h // (H // Hkv); key and value may have head counts of
    # their own (torch_ext.attention repeats one to the other's, as SDPA takes them).
    enable_gqa = query.shape[1] != key.shape[1] or query.shape[1] != value.shape[1]

    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if attention_mask is None and is_causal and _runs_eager(module):
        # "eager" only adds the mask: a layer marked causal that the model calls without one (the
        # mask function never skips eager's masks) attends to every key there (BridgeTower's image
        # stream, "never padded, so no mask is built for it").
        is_causal = False
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    if isinstance(sinks, torch.Tensor) and sinks.dim() != 1:
        raise NotImplementedError(
            f"torch_ext.hf supports one sink logit per head (sinks of shape (heads,)), got sinks of shape "
            f"{tuple(sinks.shape)} (a sink computed per query, e.g. from the hidden states): use "
            "attn_implementation='eager' for this model"
        )
    # softcap 0 means none in transformers' flash-attention path (the "sdpa" one ignores the argument)
    softcap = kwargs.get("softcap")
    features: dict[str, Any] = {"softcap": softcap if softcap else None, "sinks": sinks, "dropout_p": float(dropout)}
    window = _window(kwargs.get("sliding_window"), bool(is_causal))

    position_bias = kwargs.get("position_bias")
    documents = _documents(query, key, attention_mask, kwargs, bool(is_causal), window)
    if documents is not None and position_bias is not None:
        raise NotImplementedError(
            "torch_ext.hf does not support position_bias with a packed batch (the packed path takes no additive "
            "bias): pass the documents as separate rows of a padded batch, or use attn_implementation='sdpa'"
        )
    if documents is not None:
        # A packed batch: each document attends to itself only (causality and the window within
        # it), whatever mask transformers built for "sdpa".
        cu_q, cu_k, max_q, max_k = documents
        out = attend_varlen(
            query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), cu_q, cu_k, max_q, max_k,
            policy=policy, is_causal=bool(is_causal), enable_gqa=enable_gqa, base_scale=scaling, module=module,
            window_size=window, **features,
        )
        return out.unsqueeze(0), None
    tokens = _forward_tokens(kwargs)
    if attention_mask is None and is_causal and q_length < tokens <= kv_length:
        # Query slicing: the rows are the last q_length of the forward's `tokens` (Gemma 4's
        # KV-shared layers keep only the rows whose logits are kept, after transformers skipped
        # the causal mask of the whole forward, which it does only when no cached key precedes
        # them). Those tokens are keys 0 .. tokens - 1 (later slots: an empty static cache), and
        # the rows are their last ones: bottom-right causality and window over them.
        key, value = key[:, :, :tokens], value[:, :, :tokens]
        features.update(window_size=window, causal_alignment="bottom_right")
        is_causal = True
    else:
        # The window also lets the op skip key blocks, where its alignment is unambiguous (as
        # many queries as keys: training and prefill); the mask carries it in every case and
        # decides: a bound the mask crosses is dropped (Gemma 3's bidirectional image blocks in
        # its sliding layers).
        if q_length == kv_length:
            features["window_size"] = _window_inside_mask(window, attention_mask, bool(is_causal))
        # As "sdpa": the causal flag only without a mask (a mask already carries causality) and
        # never for one query row (decoding attends to every cached key: bottom-right alignment).
        is_causal = bool(q_length > 1 and attention_mask is None and is_causal)
        if is_causal and kv_length > q_length:
            # Prefill into an empty static cache: the keys past q_length are empty slots, which
            # top-left causality already hides; cropping them makes the call square.
            key, value = key[:, :, :q_length], value[:, :, :q_length]
    if position_bias is not None:
        attention_mask = _with_position_bias(attention_mask, position_bias, key.shape[2])
    if isinstance(kwargs.get("indices"), torch.Tensor):
        attention_mask = _with_selected_keys(attention_mask, kwargs["indices"], key.shape[2])

    # attend() expands a batch of 1 and makes finfo.min float-mask entries -inf (out of n_i).
    out = attend(
        query, key, value, attention_mask, policy=policy, is_causal=is_causal, enable_gqa=enable_gqa,
        base_scale=scaling, module=module, **features, **_monitor_rows(module, query, key, attention_mask, kwargs),
    )
    # (no copy when the query was a transposed (B, L, H, D) view, as transformers' layers pass it:
    # the output then follows that layout)
    return out.transpose(1, 2).contiguous(), None


def _forward_tokens(kwargs: dict[str, Any]) -> int:
    """The number of tokens of the model's forward (the columns of ``position_ids``), 0 unknown."""
    pos = kwargs.get("position_ids")
    return pos.shape[-1] if isinstance(pos, torch.Tensor) and pos.dim() in (1, 2) else 0


def _with_position_bias(
    attention_mask: Optional[torch.Tensor], position_bias: torch.Tensor, kv_length: int
) -> torch.Tensor:
    """The additive mask of a call with a ``position_bias`` (B or 1, H, Lq, Lk'), as transformers
    builds it for "sdpa" (``create_position_bias_mask``): the bias alone without a mask (the op's
    causal flag still applies), added to a float mask, and where a bool mask hides a key ``-inf``
    (not "sdpa"'s ``finfo.min``: that key then stays out of n_i). Its columns past ``kv_length``
    (the empty static-cache slots the call dropped) go too. Differentiable in the bias."""
    if not isinstance(position_bias, torch.Tensor) or not position_bias.is_floating_point():
        raise TypeError(f"position_bias must be a float tensor, got {type(position_bias).__name__}")
    bias = position_bias[..., :kv_length]
    if attention_mask is None:
        return bias
    if attention_mask.dtype == torch.bool:
        return torch.where(attention_mask, bias, float("-inf"))
    return bias + attention_mask


def _with_selected_keys(attention_mask: Optional[torch.Tensor], indices: torch.Tensor, kv_length: int) -> torch.Tensor:
    """``attention_mask`` restricted to the keys an indexer selected for each row: ``indices``
    (B, Lq, k) of key positions, as DeepSeek-V3.2's sparse attention (DSA) passes them to backends
    other than "eager" and "sdpa" (for which it builds this very mask itself)."""
    batch, q_length = indices.shape[:2]
    selected = torch.zeros(batch, q_length, kv_length, dtype=torch.bool, device=indices.device)
    selected = selected.scatter(-1, indices.long(), True).unsqueeze(1)  # (B, 1, Lq, Lk)
    if attention_mask is None:
        return selected
    if attention_mask.dtype == torch.bool:
        return attention_mask & selected
    return attention_mask.masked_fill(~selected, float("-inf"))


def _is_cross_attention(module: Any) -> bool:
    """Whether a layer attends to another sequence (an encoder's), as transformers marks it: BERT's
    ``is_cross_attention`` or cross-attention class, or a decoder layer that is not causal (BART,
    T5, Whisper: their decoders' self-attention is causal, their cross-attention not)."""
    if getattr(module, "is_cross_attention", False) or "CrossAttention" in type(module).__name__:
        return True
    return bool(getattr(module, "is_decoder", False)) and getattr(module, "is_causal", True) is False


# The real-token rows of this thread's last self-attention call: (monitor step, (B, Lq), rows or
# None). A decoder layer's cross-attention takes its rows from its own self-attention, which runs
# just before it on the same decoder tokens (BART, T5, Whisper).
_last_self_rows = threading.local()


def _monitor_rows(
    module: Any, query: torch.Tensor, key: torch.Tensor, attention_mask: Optional[torch.Tensor],
    kwargs: dict[str, Any],
) -> dict[str, torch.Tensor]:
    """What the monitor needs to know of a dense call's rows, when it records: their token
    positions (``position_ids``: right under a KV cache, where row i is not position i) and which
    rows are real tokens. For self-attention with a mask, the rows whose own key it allows (a
    padding token's own key is masked; right padding's rows still see the real keys, so n_i >= 1
    does not exclude them). Cross-attention's mask is the encoder's, which says nothing of the
    decoder's padding (and key i is another sequence's token i even when the lengths match): it
    takes the rows of the self-attention call before it in the step, when that call had as many
    rows of the same batch."""
    if not _monitor.is_recording():
        return {}
    found: dict[str, torch.Tensor] = {}
    pos = kwargs.get("position_ids")
    if isinstance(pos, torch.Tensor) and pos.dim() == 2 and pos.shape[-1] == query.shape[2]:
        found["positions"] = pos
    step, rows_shape = _monitor.step_token(), (query.shape[0], query.shape[2])
    if _is_cross_attention(module):
        last = getattr(_last_self_rows, "value", None)
        if last is not None and last[0] is step and last[1] == rows_shape and last[2] is not None:
            found["rows"] = last[2]
        return found
    square = query.shape[2] == key.shape[2]
    if attention_mask is not None and attention_mask.dim() == 4 and square and attention_mask.shape[-2:] == key.shape[2:3] * 2:
        own = _allowed(torch.diagonal(attention_mask, dim1=-2, dim2=-1))  # (B or 1, H or 1, L): row i, key i
        found["rows"] = own.any(dim=1).expand(query.shape[0], -1)
    _last_self_rows.value = (step, rows_shape, found.get("rows"))
    return found


class _ValueChecks:
    """Answers of checks that read tensor values (a device sync each), kept while the tensors they
    read live unchanged (same object, same ``_version``): the layers of one forward share their
    mask and position_ids, so each check runs once per forward and layer type, not per layer."""

    def __init__(self, size: int = 4) -> None:
        self._size = size
        self._entries: list[tuple[tuple[weakref.ref, ...], tuple[Any, ...], Any]] = []

    def get(self, tensors: tuple[torch.Tensor, ...], params: Any, compute: Any) -> Any:
        """``compute()``, or its answer for the same ``tensors`` and ``params`` when kept. Inference
        tensors (``torch.inference_mode``) have no version counter to tell a change by: never kept."""
        if any(t.is_inference() for t in tensors):
            return compute()
        key = (tuple(t._version for t in tensors), params)
        for refs, k, answer in self._entries:
            if k == key and all(r() is t for r, t in zip(refs, tensors)):
                return answer
        answer = compute()
        entry = (tuple(weakref.ref(t) for t in tensors), key, answer)
        self._entries = [entry] + self._entries[: self._size - 1]
        return answer


_checks = _ValueChecks()


def _allowed(mask: torch.Tensor) -> torch.Tensor:
    """Where a bool or additive mask lets the row see the key (the op's reading of it)."""
    return ~masked_entries(mask)


def _window_inside_mask(window: tuple[int, int], attention_mask: Optional[torch.Tensor], causal: bool) -> tuple[int, int]:
    """``window`` without the bounds that a square ``attention_mask`` crosses (it allows some row
    a key beyond them), so that the window only skips key blocks the mask hides. While
    torch.compile traces (no values to read): a causal layer's window without its right bound,
    which only masks that open later keys cross (transformers applies the left bound after opening
    image blocks, and every causal sliding mask sees the W most recent keys); a bidirectional
    layer's, none (models disagree on what its W means: ModernBERT and Gemma 3 pass W for keys at
    distance < W, T5Gemma for <= W)."""
    left, right = window
    if attention_mask is None or (left < 0 and right < 0):
        return window
    if torch.compiler.is_compiling():
        return (left, -1) if causal else (-1, -1)

    def inside() -> tuple[int, int]:
        allowed = _allowed(attention_mask)
        keep_left = left < 0 or not bool(torch.tril(allowed, -left - 1).any())
        keep_right = right < 0 or not bool(torch.triu(allowed, right + 1).any())
        return (left if keep_left else -1, right if keep_right else -1)

    return _checks.get((attention_mask,), ("window", window), inside)


def _window(sliding_window: Any, causal: bool) -> tuple[int, int]:
    """The op's window_size of the ``sliding_window`` W that transformers passes to attention
    functions: a causal layer sees the W most recent keys, itself included (masking_utils:
    kv_idx > q_idx - W), a bidirectional one keys at distance below W (W - 1 on each side, as
    transformers' flash-attention path maps it and the masks of ModernBERT and bidirectional
    Gemma 3 are built)."""
    if sliding_window is None:
        return (-1, -1)
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, numbers.Real) or (
        sliding_window != int(sliding_window)
    ):
        raise TypeError(f"sliding_window must be an int or None, got {sliding_window!r}")
    if sliding_window <= 0:  # (no window, as transformers' masks treat it)
        return (-1, -1)
    w = int(sliding_window)
    return (w - 1, 0) if causal else (w - 1, w - 1)


def _documents(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    kwargs: dict[str, Any],
    causal: bool,
    window: tuple[int, int],
) -> Optional[tuple[torch.Tensor, torch.Tensor, int, int]]:
    """``(cu_seq_q, cu_seq_k, max_q, max_k)`` of a packed batch, or None.

    From transformers' packed-sequence keyword arguments (``cu_seq_lens_q`` / ``cu_seq_lens_k``,
    as ``DataCollatorWithFlattening`` and the flash-attention backends use them), or from
    ``position_ids`` of a one-row batch without a cache whose positions restart (transformers'
    own rule: a new document wherever a position is not the previous one plus 1) when there is
    a mask and it is exactly the packed pattern (each row sees its own document's keys under
    ``causal`` and ``window``): transformers builds such a mask when it detects packing itself,
    while without a mask, or with a mask with a hole (``generate`` repeats a position there),
    padding, a user's all-ones mask or a cache, it attends otherwise, as "sdpa" then does.
    Not while torch.compile traces (the check reads values): the dense path with the mask.
    """
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None:
        if query.shape[0] != 1:
            raise ValueError(f"torch_ext.hf: cu_seq_lens_q needs a packed batch of one row, got batch {query.shape[0]}")
        max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
        lens_q, lens_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
        max_q = int(max_q) if max_q is not None else int(lens_q.max())
        max_k = int(max_k) if max_k is not None else int(lens_k.max())
        return cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k
    pos = kwargs.get("position_ids")
    if pos is None or query.shape[0] != 1 or query.shape[2] != key.shape[2] or pos.dim() != 2 or pos.shape[0] != 1:
        return None
    if pos.shape[-1] != query.shape[2] or torch.compiler.is_compiling():
        return None
    if attention_mask is None:
        return None  # (no mask: transformers saw no packing, and "sdpa" runs causal across them)

    def packed() -> Optional[tuple[torch.Tensor, torch.Tensor, int, int]]:
        starts = torch.nonzero(pos[0, 1:] - pos[0, :-1] != 1).flatten() + 1
        if starts.numel() == 0:
            return None  # one document: the dense path
        total = pos.shape[-1]
        cu = torch.cat([starts.new_zeros(1), starts, starts.new_full((1,), total)])
        if not _is_packed_mask(attention_mask, cu, causal, window):
            return None
        cu = cu.to(torch.int32)
        max_len = int((cu[1:] - cu[:-1]).max())
        return cu, cu, max_len, max_len

    return _checks.get((pos, attention_mask), ("documents", causal, window), packed)


def _is_packed_mask(attention_mask: torch.Tensor, cu: torch.Tensor, causal: bool, window: tuple[int, int]) -> bool:
    """Whether a (1, 1 or H, L, L) bool or additive mask is exactly what the packed path computes
    for the documents of offsets ``cu``: each row sees the keys of its own document that causality
    and ``window`` allow (so a padding row, which sees nothing, or a document's bidirectional
    image block keep the dense path). Each row's expected keys are an interval, compared with the
    mask in slices of rows: no L x L temporary beyond a slice."""
    total = int(cu[-1])
    if attention_mask.dim() != 4 or attention_mask.shape[0] != 1 or attention_mask.shape[-2:] != (total, total):
        return False
    device = attention_mask.device
    cu = cu.to(device)
    i = torch.arange(total, device=device)
    document = torch.bucketize(i, cu[1:-1], right=True)  # row i's document d: cu[d] <= i < cu[d + 1]
    lo, hi = cu[document], cu[document + 1] - 1  # its keys, inclusive
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    if left >= 0:
        lo = torch.maximum(lo, i - left)
    if right >= 0:
        hi = torch.minimum(hi, i + right)
    rows = max(1, (1 << 24) // max(total, 1))
    for r in range(0, total, rows):
        allowed = _allowed(attention_mask[0, :, r : r + rows])
        expected = (i >= lo[r : r + rows, None]) & (i <= hi[r : r + rows, None])
        if not bool((allowed == expected).all()):
            return False
    return True


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

    The mask function registered with it is transformers' ``sdpa_mask`` (boolean masks, True =
    attend, or None where causality alone applies) for models that support "sdpa" or flash
    attention through the interface, and ``eager_mask`` (additive float masks, never None) for
    the others, as "eager" gets (see the module docstring).
    """
    name = _check_name(name)
    policy = AttentionPolicy(scale, temperature, train_length)

    entropy_invariant_attention = functools.partial(attention_forward, policy=policy)
    entropy_invariant_attention.policy = policy  # type: ignore[attr-defined]
    transformers.AttentionInterface.register(name, entropy_invariant_attention)
    AttentionMaskInterface.register(name, _mask)
    return name


def _needs_eager_masks(cls: type) -> bool:
    """Whether model class ``cls`` may rely on eager's masks: it refuses "sdpa", and does not run
    through the attention interface with flash attention either (which hands it no 4-D mask, so its
    layers take causality from ``is_causal`` as sdpa's skipped masks need). Gemma 2 and gpt-oss
    refuse "sdpa" for softcap and sinks only and keep sdpa's masks (None where causal: no L x L
    mask); PEGASUS-X (decoder layers whose ``is_causal`` is False), GIT and TrOCR (masks added to
    scores) and DeepSeek-V4 (additive biases joined to the mask) get eager's."""
    if getattr(cls, "_supports_sdpa", False):
        return False
    return not (getattr(cls, "_supports_attention_backend", False) and getattr(cls, "_supports_flash_attn", False))


def _runs_eager(module: Any) -> bool:
    """Whether ``module`` belongs to a model that gets "eager"'s masks (:func:`_eager_masks` of its
    ``config``), whose only other backend is its own eager attention."""
    config = getattr(module, "config", None)
    return config is not None and _eager_masks(type(config))


def _model_classes() -> list[type]:
    """Every loaded transformers model class (the model being run is loaded: remote code too)."""
    found, todo = [], [transformers.PreTrainedModel]
    while todo:
        for sub in todo.pop().__subclasses__():
            found.append(sub)
            todo.append(sub)
    return found


_EAGER_MASKS: dict[type, bool] = {}


@torch.compiler.assume_constant_result
def _eager_masks(config_type: type) -> bool:
    """Whether a model class built from ``config_type`` needs eager's masks (:func:`_needs_eager_masks`).

    Keyed on the config's class, which the model classes name (``config_class``), so sub-configs
    (BLIP's text decoder, CLVP's) and remote code resolve as well as top-level model types. A
    constant to torch.compile, which calls it once while tracing instead of tracing the walk over
    the model classes (and, were it an ``lru_cache``, warned of that on every compile).
    """
    known = _EAGER_MASKS.get(config_type)
    if known is None:
        known = _EAGER_MASKS[config_type] = any(
            _needs_eager_masks(c) for c in _model_classes() if getattr(c, "config_class", None) is config_type
        )
    return known


def _mask(*args: Any, **kwargs: Any) -> Optional[torch.Tensor]:
    """The backend's mask function: "eager"'s masks for models that need them, else "sdpa"'s.

    transformers' mask builders pass the model's ``config`` (to let a mask function do this).
    """
    config = kwargs.get("config")
    if config is not None and _eager_masks(type(config)):
        kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
        return eager_mask(*args, **kwargs)
    return sdpa_mask(*args, **kwargs)
