"""``torch_ext.attention``: a drop-in for ``F.scaled_dot_product_attention`` with per-row scale
policies and fused per-row statistics."""

import math
import numbers
from typing import NamedTuple

import torch
from torch._subclasses.fake_tensor import FakeTensor

from torch_ext import _functorch
from torch_ext import nested as _nested

__all__ = ["AttentionStats", "attention", "attention_sparsity", "length_factor"]

_SCALE_MODES = ("logn", "logn_sharpen")
_MIN_SOFTCAP = torch.finfo(torch.float32).tiny  # the ops' bound (csrc/attention_inputs.cpp: check_pattern_options)
# attention's default window_size, which _plain_call recognizes by identity: a tuple the caller
# built is checked element by element (its -1.0s are not ints).
_NO_WINDOW = (-1, -1)


def _schema_defaults(packet: torch._ops.OpOverloadPacket) -> dict[str, object]:
    """The keyword-only arguments' defaults of an op, read from its schema (csrc/ops.cpp)."""
    return {a.name: a.default_value for a in packet.default._schema.arguments if a.kwarg_only and a.has_default_value()}


def _explicit(options: dict[str, object], defaults: dict[str, object]) -> dict[str, object]:
    """``options`` without the entries that equal the op's defaults.

    torch.ops converts every keyword argument it is given against the schema, about 0.3 us each:
    with a dozen, more than a short call's kernel (a decoding step). While torch.compile traces
    (once, so the cost does not matter) they are all kept: a value may be a SymInt or SymFloat
    that Dynamo reports as an int or a float, and comparing it would add a guard, or fail on the
    unbacked dropout seed. Otherwise only values of the default's own type are compared (a SymInt
    never equals an int default here).
    """
    if torch.compiler.is_compiling():
        return options
    return {k: v for k, v in options.items() if type(v) is not type(d := defaults[k]) or v != d}


def _is_int(x: object) -> bool:
    """Whether ``x`` is an integer and not a bool (an int first: numbers' ABC check is slow)."""
    return type(x) is int or (not isinstance(x, bool) and isinstance(x, numbers.Integral))


def _is_real(x: object) -> bool:
    """Whether ``x`` is a real number and not a bool (a float or an int first, as _is_int).

    A float computed from a size is a ``torch.SymFloat`` under ``torch.export`` with dynamic
    dims, which is no ``numbers.Real``: it is a number, and the schema's ``float`` specializes it
    (export then names the dim it ties to a value), rather than a TypeError saying it is none.
    """
    return (
        type(x) in (float, int)
        or (not isinstance(x, bool) and isinstance(x, numbers.Real))
        or isinstance(x, (torch.SymFloat, torch.SymInt))
    )


class AttentionStats(NamedTuple):
    """Per-row statistics of the attention weights, each of shape (B, H, Lq) ((T, H) from
    :func:`varlen_attention`).

    Float32 (float64 for float64 inputs); ``n_keys`` is int64. Rows with no allowed key give 0
    (``scale`` still holds their lambda_i). With ``sinks`` the distribution has n_i + 1 entries
    (the keys and the sink): read n_i + 1 for n_i in the ranges below (``n_keys`` counts keys), and
    a row with no key puts its whole weight on the sink (lse the sink logit, entropy 0, sparsity,
    effective keys and max weight 1). The ranges hold exactly, rounding included.
    """

    lse: torch.Tensor
    """log-sum-exp of the scaled logits."""
    entropy: torch.Tensor
    """Shannon entropy H_i of the row, in [0, ln n_i]."""
    normalized_entropy: torch.Tensor
    """H_i / ln n_i in [0, 1]; 0 where n_i < 2."""
    sparsity: torch.Tensor
    """l1/l2 sparsity 1 / sqrt(n_i * sum_j p_ij^2), in (0, 1] (0 for a row without keys)."""
    effective_keys: torch.Tensor
    """1 / sum_j p_ij^2, in [1, n_i]."""
    max_weight: torch.Tensor
    """max_j p_ij (not differentiable)."""
    n_keys: torch.Tensor
    """Number of keys n_i the row may attend to (int64)."""
    scale: torch.Tensor
    """The logit scale lambda_i used (after temperature; not differentiable)."""


def _policy_args(
    scale: object, temperature: object, train_length: object, scale_factor: object = None
) -> tuple[torch.Tensor | None, dict]:
    """Validates the public scale arguments and maps them to the ops' (scale tensor, keyword args)."""
    if not _is_real(temperature):
        raise TypeError(f"temperature must be a number > 0, got {type(temperature).__name__}")
    # (comparisons, not math.isfinite: these are SymFloats under torch.compile(dynamic=True); NaN
    # fails them all)
    if not (0 < temperature < math.inf and 1 / temperature < math.inf):
        raise ValueError(f"temperature must be a finite number > 0 with a finite inverse, got {temperature}")
    if not _is_real(train_length):
        raise TypeError(f"train_length must be a number > 1, got {type(train_length).__name__}")
    if not 1 < train_length < math.inf:
        raise ValueError(f"train_length must be a finite number > 1, got {train_length}")
    kwargs = {
        "scale_factor": None,
        "scale_mode": "fixed",
        "temperature": _as_float(temperature, "temperature", "a finite number > 0"),
        "log_base": 512.0,
    }
    if scale_factor is not None and not (isinstance(scale, str) and scale in _SCALE_MODES):
        raise ValueError(
            f"scale_factor is the base scale of the {_SCALE_MODES} policies; with scale="
            f"{'a tensor' if isinstance(scale, torch.Tensor) else repr(scale)} pass the scale itself as `scale`"
        )
    for name, x in (("scale", scale), ("scale_factor", scale_factor)):
        if isinstance(x, torch.Tensor) and (x.is_nested or x.layout != torch.strided):
            # (a jagged input's scale tensor is dense too: one value per sequence and head)
            raise TypeError(f"{name} must be a dense (strided) tensor, got layout {x.layout}")
    if scale is None or isinstance(scale, torch.Tensor):
        return scale, kwargs
    if isinstance(scale, str):
        if scale not in _SCALE_MODES:
            raise ValueError(f"scale must be None, a float, a Tensor or one of {_SCALE_MODES}, got {scale!r}")
        kwargs = {**kwargs, "scale_mode": scale, "log_base": _as_float(train_length, "train_length", "a finite number > 1")}
        if scale_factor is None or isinstance(scale_factor, torch.Tensor):
            return scale_factor, kwargs
        return None, {**kwargs, "scale_factor": _finite_float(scale_factor, "scale_factor", "None, a float or a Tensor")}
    return None, {
        **kwargs,
        "scale_factor": _finite_float(scale, "scale", f"None, a float, a Tensor or one of {_SCALE_MODES}"),
    }


def _flag(x: object, name: str) -> bool:
    """``x`` if it is a bool (or numpy's), else a TypeError naming ``name``, as SDPA's argument
    parser gives (truthiness would read ``is_causal="False"`` as True)."""
    if isinstance(x, bool):
        return x
    if type(x).__module__ == "numpy" and type(x).__name__ in ("bool", "bool_"):
        return bool(x)
    raise TypeError(f"{name} must be a bool, got {type(x).__name__}")


def _check_tensors(**named: object) -> None:
    """A TypeError naming the first argument that is not a tensor (``None`` where optional:
    pass those as ``name=(value, True)``), or not a dense one (NotImplementedError for a nested
    tensor; :func:`attention` takes jagged ones, torch_ext/nested.py)."""
    for name, x in named.items():
        optional = isinstance(x, tuple)
        if optional:
            x = x[0]
        if not (isinstance(x, torch.Tensor) or (optional and x is None)):
            kind = "a torch.Tensor or None" if optional else "a torch.Tensor"
            raise TypeError(f"{name} must be {kind}, got {type(x).__name__}")
        if x is not None and x.is_nested:
            raise NotImplementedError(
                f"{name} is a nested tensor (layout {x.layout}), which the ops do not take: pack sequences of "
                "different lengths and call torch_ext.varlen_attention (cumulative offsets instead of nesting)"
            )
        if x is not None and x.layout != torch.strided:
            raise TypeError(f"{name} must be a dense (strided) tensor, got layout {x.layout}")


def _dense_tensors(*tensors: object) -> bool:
    """Whether each argument is None or a dense (strided) tensor: the arguments need no closer
    look (``_check_tensors`` names what is wrong otherwise)."""
    return all(t is None or (isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_nested)
               for t in tensors)


def _as_float(x: object, name: str, requirement: str) -> float:
    """``float(x)`` of a real number, or a ValueError naming ``name`` where it overflows (an int
    beyond float's range: OverflowError otherwise)."""
    try:
        return float(x)  # type: ignore[arg-type]
    except OverflowError:
        raise ValueError(f"{name} must be {requirement}, got an int beyond float's range") from None


def _finite_float(x: object, name: str, accepted: str) -> float:
    """``x`` as a float, or a TypeError/ValueError naming ``name`` (and what it ``accepted``)."""
    if _is_real(x):
        value = _as_float(x, name, "finite")
        if not -math.inf < value < math.inf:  # (not math.isfinite: a SymFloat under torch.compile)
            raise ValueError(f"{name} must be finite, got {x}")
        return value
    raise TypeError(f"{name} must be {accepted}, got {type(x).__name__}")


def _pattern_args(
    window_size: object,
    causal_alignment: object,
    softcap: object,
    dropout_p: object,
    generator: torch.Generator | None,
) -> dict:
    """Validates the key-pattern, softcap and dropout arguments and maps them to the ops' keywords.

    With ``dropout_p > 0`` a fresh Philox seed is drawn from ``generator`` (on its device: a CUDA
    generator draws on its GPU; without one, from torch's default CPU generator), so that
    ``torch.manual_seed`` makes dropout reproducible and each call drops different weights; the
    backward regenerates the same mask from the seed. Under ``torch.compile`` the draw is part of
    the graph (the seed is an unbacked SymInt while traced; the schema takes a SymInt), so a
    compiled step draws a fresh mask each call too.
    """
    try:
        left, right = window_size  # type: ignore[misc]
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}") from None
    for name, w in (("window_size[0]", left), ("window_size[1]", right)):
        # (a SymInt where torch.export traces a window computed from a dynamic dim: the schema's
        # int specializes it, and export names the dim, as it does for a float tied to one)
        if not (_is_int(w) or isinstance(w, torch.SymInt)) or w < -1:
            raise ValueError(f"{name} must be an int >= -1 (-1: unbounded), got {w!r}")
    # A bound of 2^62 or more covers every key of any tensor: unbounded (as the op maps it).
    left, right = (-1 if w >= 2**62 else int(w) for w in (left, right))
    if causal_alignment not in ("top_left", "bottom_right"):
        raise ValueError(f"causal_alignment must be 'top_left' or 'bottom_right', got {causal_alignment!r}")
    cap = 0.0
    if softcap is not None:
        if not _is_real(softcap):
            raise TypeError(f"softcap must be None or a number > 0, got {type(softcap).__name__}")
        cap = _as_float(softcap, "softcap", "a finite number > 0")
        if not _MIN_SOFTCAP <= cap < math.inf:  # (NaN fails it; a SymFloat under torch.compile)
            raise ValueError(
                f"softcap must be None (no cap) or a finite number >= {_MIN_SOFTCAP:.7g} (the smallest normal "
                f"float32, in which every kernel computes at least), got {softcap}"
            )
    if not _is_real(dropout_p):
        raise TypeError(f"dropout_p must be a number in [0, 1), got {type(dropout_p).__name__}")
    if not 0 <= dropout_p < 1:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    seed = 0
    if dropout_p > 0:
        if torch.jit.is_tracing():
            # A traced graph would keep this call's seed as a constant: the same dropout mask on
            # every call of the trace.
            raise RuntimeError(
                "torch.jit.trace cannot trace attention dropout (the seed drawn per call would be frozen into "
                "the trace): trace with dropout_p=0 (the module in eval mode), or use torch.compile / torch.export, "
                "which draw a fresh seed per call"
            )
        if not torch.compiler.is_compiling() and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            # Likewise a CUDA graph: every replay would drop the same weights.
            raise RuntimeError(
                "attention dropout cannot be captured in a CUDA graph (the seed drawn per call would be frozen into "
                "the graph: every replay would drop the same weights): capture with dropout_p=0 (the module in eval "
                "mode), or run the training step uncaptured"
            )
        # .item(), not int(): under torch.export the draw is data-dependent (an unbacked SymInt the
        # schema takes), which int() would have to specialize. Without a generator the draw names
        # none: AOTInductor compiles randint's generator overload, passed None, to a call that fails
        # when the package runs (an exported plain nn.Module calling torch.randint(...,
        # generator=None) fails the same way: a PyTorch issue).
        if generator is None:
            drawn = torch.randint(0, 2**62, (), dtype=torch.int64, device="cpu")
        else:
            drawn = torch.randint(0, 2**62, (), generator=generator, dtype=torch.int64, device=generator.device)
        if not torch.compiler.is_compiling() and torch._C._functorch.is_batchedtensor(drawn):
            # vmap(randomness="different") draws a seed per sample; the op takes one per call, which
            # would give every sample the same mask.
            raise RuntimeError(
                "attention dropout (dropout_p > 0) under torch.func.vmap(randomness='different') is not supported: "
                "the op draws one seed per call, so the samples cannot get masks of their own; use "
                "randomness='same' (one mask for every sample) or dropout_p=0"
            )
        # A FakeTensorMode without a ShapeEnv (shape inference, memory estimation) cannot give a
        # data-dependent value, and no output's shape, dtype or stride depends on the seed.
        fake = isinstance(drawn, FakeTensor) and drawn.fake_mode.shape_env is None
        seed = 0 if fake else drawn.item()
    return {
        "window_size": [int(left), int(right)],
        "causal_alignment": causal_alignment,
        "softcap": cap,
        "dropout_p": float(dropout_p),
        "dropout_seed": seed,
    }


_ATTENTION = torch.ops.entropy_attn.attention.default
_ATTENTION_DEFAULTS = _schema_defaults(torch.ops.entropy_attn.attention)


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    is_causal: bool = False,
    scale: float | str | torch.Tensor | None = None,
    temperature: float = 1.0,
    enable_gqa: bool = False,
    train_length: float = 512,
    scale_factor: float | torch.Tensor | None = None,
    return_stats: bool = False,
    window_size: tuple[int, int] = _NO_WINDOW,
    causal_alignment: str = "top_left",
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor | tuple[torch.Tensor, AttentionStats]:
    """Softmax attention with a per-row logit scale and, optionally, per-row statistics.

    Computes ``softmax(lambda_i * q_i . K^T + mask) V`` without materializing the L_q x L_k
    matrix; the statistics come from the same pass.

    Args:
        query: (B, H, Lq, D). key: (B, Hkv, Lk, D). value: (B, Hkv, Lk, Dv). float32, float64,
            bfloat16 or float16, one dtype and device; any strides. Or, as SDPA takes them, all
            three nested tensors of layout ``torch.jagged``, (B, H, j, D) ragged in the sequences
            (sequences of different lengths, query's and key's apart, without padding): each
            attends to its own keys, and n_i counts them; no ``attn_mask``, and a scale tensor
            broadcasts to (B, H, 1). The output and the statistics are then jagged too,
            (B, H, j, Dv) with query's offsets and (B, H, j).
        attn_mask: bool (True = attend) or additive float mask, broadcastable to (B, H, Lq, Lk).
            An additive mask that requires grad (a learned bias) gets its gradient.
        is_causal: causal masking aligned top-left, as ``scaled_dot_product_attention``; combines
            with ``attn_mask``.
        scale: ``None`` (1/sqrt(D)); a float; ``"logn"``: log_b(n_i)/sqrt(D) with b =
            ``train_length`` (equals the standard scale at n_i = b); ``"logn_sharpen"``:
            max(1, log_b n_i)/sqrt(D); or a tensor broadcastable to (B, H, Lq) giving the scale c_i
            per row, lambda_i = c_i / temperature (differentiable, e.g. a learnable per-head
            scale). n_i counts the keys row i may attend to under the mask and causality.
        temperature: tau > 0; the scale is divided by it.
        enable_gqa: allow H to be a multiple of Hkv (query head h uses kv head h // (H // Hkv)).
            As SDPA, key and value may then have different head counts, each dividing H (the one
            with fewer heads is repeated to the other's, or both to H: a copy).
        train_length: the log base b of the "logn" policies (> 1).
        scale_factor: with ``scale="logn"`` or ``"logn_sharpen"``, the base scale c that replaces
            1/sqrt(D): a float, or a tensor broadcastable to (B, H, Lq), differentiable (e.g. a
            learnable per-head s_h / sqrt(D) of shape (H, 1): the SSMax form s_h log n_i / sqrt(D)
            up to the constant ln b). Not allowed with the other policies.
        return_stats: also return an :class:`AttentionStats`.
        window_size: ``(left, right)``: query i sees keys diag - left .. diag + right around its
            diagonal (-1: unbounded), as FlashAttention and ``varlen_attn``; ``(W, 0)`` is causal
            sliding-window attention over the W + 1 most recent keys. n_i counts the window's keys
            (that the mask allows), and key blocks outside every window are skipped, so the cost
            grows with L * W.
        causal_alignment: where row i's diagonal is: ``"top_left"`` (key i, SDPA's is_causal) or
            ``"bottom_right"`` (key i + Lk - Lq: the last query sees the last key, as a decoding
            cache or chunked prefill needs). Applies to ``is_causal`` and ``window_size``.
        softcap: logit soft-capping (Gemma 2): scaled scores x become softcap * tanh(x / softcap)
            before the mask.
        sinks: (H,) attention sinks (gpt-oss): one learnable logit per head added to each row's
            softmax denominator, with no value; differentiable. The statistics then describe the
            distribution over the n_i keys and the sink (``n_keys`` still counts keys only).
        dropout_p: attention dropout probability (apply it in training only, as SDPA's callers
            do). The statistics describe the weights before dropout.
        generator: the generator dropout's seed is drawn from, on any device (default: torch's CPU
            generator).

    Returns:
        The output (B, H, Lq, Dv) in query's dtype, or ``(output, stats)``. Rows that can attend
        to no key give output 0 and statistics 0 (with sinks: the whole weight on the sink).
    """
    jagged = None
    if not (query is not None and key is not None and value is not None
            and _dense_tensors(query, key, value, attn_mask, sinks)):
        if any(_nested.is_jagged(x) for x in (query, key, value)):
            if _functorch.transforms_active():
                _refuse_jagged_under_transforms(query, key, value)
            # Sequences without padding: the op's packed documents (torch_ext/nested.py).
            jagged = _nested.pack(query, key, value, attn_mask)
            query, key, value = jagged.query, jagged.key, jagged.value
        _nested.refuse_strided(query=query, key=key, value=value)
        _check_tensors(query=query, key=key, value=value, attn_mask=(attn_mask, True), sinks=(sinks, True))
    return_stats = _flag(return_stats, "return_stats")
    is_causal, enable_gqa = _flag(is_causal, "is_causal"), _flag(enable_gqa, "enable_gqa")
    if enable_gqa and key.dim() >= 3 and value.dim() >= 3 and key.shape[-3] != value.shape[-3]:
        key, value = _gqa_kv_heads(query, key, value)
    if jagged is None and _plain_call(scale, temperature, train_length, scale_factor, window_size, causal_alignment,
                                      softcap, dropout_p, generator):
        options = _plain_options(scale, scale_factor, train_length, is_causal, enable_gqa, return_stats, sinks)
        res = _ATTENTION(query, key, value, attn_mask, None, **options)
    else:
        scale_tensor, policy = _policy_args(scale, temperature, train_length, scale_factor)
        pattern = _pattern_args(window_size, causal_alignment, softcap, dropout_p, generator)
        # Without return_stats the kernels skip the statistics (only lse and lambda, for the backward).
        options = dict(is_causal=is_causal, enable_gqa=enable_gqa, return_stats=return_stats, **policy, **pattern)
        if jagged is not None:
            res = jagged.run(query, key, value, scale_tensor, sinks, options)
        elif _functorch.transforms_active():
            # (a jagged tensor under a transform is wrapped, and passes for a dense one above)
            _refuse_jagged_under_transforms(query, key, value)
            res = _functorch.attention(query, key, value, attn_mask, scale_tensor, sinks, options)
        else:
            options = _explicit(options, _ATTENTION_DEFAULTS)
            res = _ATTENTION(query, key, value, attn_mask, scale_tensor, sinks=sinks, **options)
    if not return_stats:
        return res[0]
    return res[0], _stats(res)


def _refuse_jagged_under_transforms(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """NotImplementedError naming the first of query, key and value that is, or that a torch.func
    transform's wrapper holds, a jagged nested tensor: the packed call they become runs the op's C++
    autograd, which the transforms cannot take (torch's SDPA fails there too, naming its internal
    op). A wrapped tensor reports itself as strided and not nested; Dynamo cannot trace the
    unwrapping (and a compiled transform of a jagged call fails in torch), so it is skipped there."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if _nested.is_jagged(x) or (not torch.compiler.is_compiling() and _nested.is_jagged(_functorch.innermost(x))):
            raise NotImplementedError(
                f"torch.func transforms (grad, vjp, vmap, ...) of attention on jagged nested tensors are not "
                f"supported ({name} is one): differentiate with torch.autograd, or pack the sequences for "
                f"torch_ext.varlen_attention, which the transforms take")


def _gqa_kv_heads(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dim: int = -3
) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value with one head count under GQA, where SDPA takes counts that differ: SDPA repeats
    each to the query's H, so query head h reads key head h // (H // Hk) and value head
    h // (H // Hv). Repeating the one with fewer heads to the other's count (when it divides it,
    else both to H) keeps that mapping with one kv head count, as the op needs. Counts that do not
    divide H are returned as they are, for the op's error to name them. Heads are dim ``dim``: -3
    in the dense layout, -2 in the packed one (and in a paged cache's pools)."""
    hq, hk, hv = query.shape[dim], key.shape[dim], value.shape[dim]
    if hk == 0 or hv == 0 or hq % hk != 0 or hq % hv != 0:
        return key, value
    heads = hk if hk % hv == 0 else hv if hv % hk == 0 else hq
    if heads != hk:
        key = key.repeat_interleave(heads // hk, dim=dim)
    if heads != hv:
        value = value.repeat_interleave(heads // hv, dim=dim)
    return key, value


def _plain_call(
    scale: object,
    temperature: object,
    train_length: object,
    scale_factor: object,
    window_size: object,
    causal_alignment: object,
    softcap: object,
    dropout_p: object,
    generator: object,
) -> bool:
    """Whether a call of :func:`attention` may skip _policy_args, _pattern_args and _explicit: in
    eager mode outside torch.func transforms, with a scale that is None, a finite float or a "logn"
    policy (with no scale_factor or a finite float one), an int train_length that is valid, and
    every other policy and pattern argument at its default (exact types, so that nothing the checks
    would refuse passes, and window_size by identity). _plain_options then gives the op what the
    general path would, and a short call (a decoding step) saves most of that path's Python time:
    the wrapper took 9 us of a tiny call, now 2 (README: The fixed cost of a call).
    tests/test_call_mapping.py checks the mapping and the refusals."""
    return (
        (
            scale is None
            or (type(scale) is float and -math.inf < scale < math.inf)
            or (type(scale) is str and scale in _SCALE_MODES)
        )
        and (
            scale_factor is None
            or (type(scale_factor) is float and -math.inf < scale_factor < math.inf and type(scale) is str)
        )
        and type(temperature) is float
        and temperature == 1.0
        and type(train_length) is int
        and 1 < train_length < 2**53
        and window_size is _NO_WINDOW
        and type(causal_alignment) is str
        and causal_alignment == "top_left"
        and softcap is None
        and type(dropout_p) is float
        and dropout_p == 0.0
        and generator is None
        and not torch.compiler.is_compiling()
        and not _functorch.transforms_active()
    )


def _plain_options(
    scale: float | str | None,
    scale_factor: float | None,
    train_length: float,
    is_causal: bool,
    enable_gqa: bool,
    return_stats: bool,
    sinks: torch.Tensor | None,
) -> dict[str, object]:
    """The op's keyword arguments of a call _plain_call accepts, as _explicit leaves them: those
    that differ from the schema's defaults (which have return_stats on)."""
    options: dict[str, object] = {} if return_stats else {"return_stats": False}
    if isinstance(scale, str):  # a "logn" policy: its base and its base scale
        options["scale_mode"] = scale
        if train_length != 512:
            options["log_base"] = float(train_length)
        if scale_factor is not None:
            options["scale_factor"] = scale_factor
    elif scale is not None:
        options["scale_factor"] = scale
    if is_causal:
        options["is_causal"] = True
    if enable_gqa:
        options["enable_gqa"] = True
    if sinks is not None:
        options["sinks"] = sinks
    return options


def length_factor(
    n_keys: torch.Tensor,
    scale: str = "logn",
    *,
    temperature: float = 1.0,
    train_length: float = 512,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The length factor g(n_i) / temperature of a scale policy for given key counts.

    :func:`attention` uses lambda_i = c * length_factor(n_i) with c the base scale (``scale_factor``,
    else 1/sqrt(D)), n_i counting the keys row i may see. A caller that splits a row's keys into
    shards (context parallelism, split-KV: :func:`merge_attention_states`) passes every shard the
    whole row's lambda_i, computed from the whole row's n_i with this function (the op's own
    policy code, bit for bit the kernels' value in ``dtype``).

    Args:
        n_keys: integer tensor of key counts (a count <= 0, a row without keys, gives 0 for the
            log-n policies; the values are not checked, which would cost a device sync).
        scale: ``"fixed"`` (g = 1), ``"logn"`` (log_b n) or ``"logn_sharpen"`` (max(1, log_b n)).
        temperature: tau > 0. train_length: the log base b > 1.
        dtype: torch.float32 (the float32 / 16-bit kernels') or torch.float64.
    """
    _check_tensors(n_keys=n_keys)
    policy = _policy_args(None, temperature, train_length)[1]  # (checks both, naming them)
    if not isinstance(scale, str):
        raise TypeError(f"scale must be 'fixed', 'logn' or 'logn_sharpen', got {type(scale).__name__}")
    if scale not in ("fixed", *_SCALE_MODES):  # (the op's own message names its scale_mode)
        raise ValueError(f"scale must be 'fixed', 'logn' or 'logn_sharpen', got {scale!r}")
    log_base = _as_float(train_length, "train_length", "a finite number > 1")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be torch.float32 or torch.float64, got {type(dtype).__name__}")
    return torch.ops.entropy_attn.length_factor(n_keys, scale, policy["temperature"], log_base, dtype=dtype)


def _stats(res: tuple[torch.Tensor, ...]) -> AttentionStats:
    """The AttentionStats of the op's outputs (schema order)."""
    _, lse, ent, _, max_weight, n_keys, row_scale, _, norm_ent, sparsity, eff_keys = res
    return AttentionStats(
        lse=lse,
        entropy=ent,
        normalized_entropy=norm_ent,
        sparsity=sparsity,
        effective_keys=eff_keys,
        max_weight=max_weight,
        n_keys=n_keys,
        scale=row_scale,
    )


def attention_sparsity(
    query: torch.Tensor,
    key: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    kind: str = "exp",
    is_causal: bool = False,
    scale: float | str | torch.Tensor | None = None,
    temperature: float = 1.0,
    enable_gqa: bool = False,
    train_length: float = 512,
    scale_factor: float | torch.Tensor | None = None,
    window_size: tuple[int, int] = (-1, -1),
    causal_alignment: str = "top_left",
    softcap: float | None = None,
) -> torch.Tensor:
    """Per-row l1/l2 sparsity of general attention, fused: no L_q x L_k matrix is formed.

    For weights a_ij = f(s_ij) with the logits s_ij = lambda_i q_i . k_j (+ a finite additive mask)
    of :func:`attention` (same ``attn_mask``, ``is_causal``, ``scale``, ``temperature``,
    ``enable_gqa``, ``train_length``, ``scale_factor``, ``window_size``, ``causal_alignment`` and
    ``softcap``), returns S_i = sum_j |a_ij| / sqrt(n_i sum_j a_ij^2) of
    shape (B, H, Lq), in [0, 1]: 1 for uniform weights, 1/sqrt(n_i) for one-hot (seed 003).

    Args:
        kind: f: ``"exp"`` (softmax attention; equals ``stats.sparsity`` of :func:`attention`),
            ``"relu2"`` (relu(s)^2, as GAU) or ``"identity"`` (plain linear attention, signed).

    Rows with no allowed key, or all-zero weights, give 0. Not differentiable.
    """
    _check_tensors(query=query, key=key, attn_mask=(attn_mask, True))
    if not isinstance(kind, str):
        raise TypeError(f"kind must be one of 'exp', 'relu2', 'identity', got {type(kind).__name__}")
    scale_tensor, policy = _policy_args(scale, temperature, train_length, scale_factor)
    pattern = _pattern_args(window_size, causal_alignment, softcap, 0.0, None)
    del pattern["dropout_p"], pattern["dropout_seed"]
    return torch.ops.entropy_attn.attention_sparsity(
        query,
        key,
        attn_mask,
        scale_tensor,
        kind=kind,
        is_causal=_flag(is_causal, "is_causal"),
        enable_gqa=_flag(enable_gqa, "enable_gqa"),
        **policy,
        **pattern,
    )
