"""The ops' autograd as Python functions, for torch.func transforms (grad, vjp, jacrev, vmap of them).

The ops differentiate through C++ ``torch::autograd::Function`` classes (csrc/autograd.cpp), which
LibTorch callers need and torch.compile traces, but which torch.func cannot transform ("cannot use
C++ torch::autograd::Function with functorch transforms"). While a transform is active the Python
wrappers call the ops through the ``torch.autograd.Function`` classes below instead. Their forward
is the op itself and their backward the registered op that the C++ function's backward runs
(``attention_grad``, ``entropy_backward``, ``sparsity_backward``), so both paths give the same
gradients.

vmap (per-sample gradients: ``vmap(grad(f))``): the dense op and its gradient op take a batch dim,
so their vmap rules fold the vmapped dim into it, (V, B, ...) -> (V * B, ...), and make one call
where torch's fallback made V (a mask or scale tensor that broadcasts along the batch stays as it
is; one whose gradient is wanted is repeated, so that each sample gets its own). What folding
would change runs once per sample, as the fallback ran it: dropout (sample v's batch rows would
draw another sample's mask), sinks that are vmapped or whose gradient is wanted (one logit per
head: it has no batch dim), packed documents, and inputs whose per-sample shapes the op refuses
(its message then names them as it would without vmap). Samples that would fold past a batch of
65535 fold in chunks. ``entropy`` and ``sparsity`` move the samples to a leading dim of one call;
``varlen_attention`` runs once per sample (its offsets may differ per sample). The ops the wrappers
call directly under transforms, ``length_factor`` (elementwise) and ``attention_sparsity``
(folded as ``attention``), have vmap rules registered with ``torch.library.register_vmap``.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch
from torch._C._functorch import TransformType
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

_ops = torch.ops.entropy_attn


def transforms_active() -> bool:
    """Whether a torch.func transform (grad, vjp, jacrev, jvp, vmap) is running."""
    return torch._C._are_functorch_transforms_active()


def innermost(x: torch.Tensor) -> torch.Tensor:
    """The tensor a transform's wrappers hold (a jagged nested tensor under grad reports itself
    as strided and not nested: only the tensor it wraps says what it is)."""
    while torch._C._functorch.is_functorch_wrapped_tensor(x):
        x = torch._C._functorch.get_unwrapped(x)
    return x


def _autocast(*tensors: torch.Tensor) -> tuple:
    """query, key and value cast as the ops' autocast kernel (csrc/autocast.cpp) casts them:
    floating point, not float64, to the dtype of an autocast region enabled on their device.

    Before a Function saves them: the cast inside its forward (where the op dispatches) would come
    after the save, and the backward would recompute the weights from the uncast inputs against the
    lse of the cast ones. Done here, autograd records the cast as the C++ path does, and the op's
    own autocast kernel finds nothing left to cast.
    """
    cast = []
    for t in tensors:
        kind = t.device.type
        if (kind in ("cpu", "cuda") and t.is_floating_point() and t.dtype != torch.float64
                and torch.is_autocast_enabled(kind)):
            t = t.to(torch.get_autocast_dtype(kind))
        cast.append(t)
    return tuple(cast)


def vmap_active() -> bool:
    """Whether a torch.func.vmap transform is active (at any level, e.g. vmap(grad(f)))."""
    if not transforms_active():
        return False
    return any(i.key() == TransformType.Vmap for i in retrieve_all_functorch_interpreters())


# The outputs of `attention` (ops.cpp) that are counts or the scale used, not differentiable.
_NON_DIFFERENTIABLE = slice(4, 8)  # max_weight, n_keys, row_scale, length_factor


def _grad_args(grads: tuple) -> tuple:
    """The upstream gradients attention_grad takes: output, lse, entropy, sum_p2, normalized
    entropy, sparsity and effective keys (the outputs 0-3 and 8-10)."""
    return grads[:4] + grads[8:]


# --- vmap: the vmapped dim folded into the batch dim -------------------------------------------
def _sample_shape(x: Optional[torch.Tensor], bdim: Optional[int]) -> Optional[tuple]:
    """The shape ``x`` has in each sample (without its vmapped dim)."""
    if x is None:
        return None
    return tuple(x.shape) if bdim is None else tuple(n for i, n in enumerate(x.shape) if i != bdim)


def _broadcasts(shape: Optional[tuple], target: tuple) -> bool:
    """Whether ``shape`` (None: no tensor) broadcasts to ``target`` (right-aligned, as the op checks)."""
    return shape is None or (
        len(shape) <= len(target) and all(n in (1, t) for n, t in zip(reversed(shape), reversed(target)))
    )


def _front(x: torch.Tensor, bdim: Optional[int], size: int) -> torch.Tensor:
    """``x`` with its vmapped dim first; an unbatched ``x`` repeated (a view) ``size`` times."""
    return x.movedim(bdim, 0) if bdim is not None else x.expand(size, *x.shape)


def _fold(x: Optional[torch.Tensor], bdim: Optional[int], size: int) -> Optional[torch.Tensor]:
    """A per-sample (B, ...) tensor as (size * B, ...); None and the empty statistics of a forward
    without return_stats (shape (0,), unbatched) as they are."""
    if x is None or (bdim is None and x.dim() == 1 and x.numel() == 0):
        return x
    return _front(x, bdim, size).flatten(0, 1)


def _fold_broadcast(x: Optional[torch.Tensor], bdim: Optional[int], size: int, batch: int, ndim: int,
                    per_sample: bool) -> Optional[torch.Tensor]:
    """A per-sample tensor that broadcasts to (batch, ...) of ``ndim`` dims (a mask: 4, a scale:
    3) as one that broadcasts to (size * batch, ...) with each sample's values on its rows. An
    unbatched one that broadcasts along the batch stays as it is, unless ``per_sample`` (its
    gradient is wanted per sample, so it must not be summed over the samples)."""
    if x is None or (bdim is None and not per_sample and (x.dim() < ndim or x.shape[0] == 1)):
        return x
    x = _front(x, bdim, size)
    x = x.reshape(size, *(1,) * (ndim + 1 - x.dim()), *x.shape[1:])
    return x.expand(size, batch, *x.shape[2:]).flatten(0, 1)


def _unfold_broadcast(g: Optional[torch.Tensor], size: int, batch: int,
                      shape: Optional[tuple]) -> Optional[torch.Tensor]:
    """The gradient of a :func:`_fold_broadcast` result, (size * batch, ...), as the samples'
    gradients (size, *shape): summed over the batch where the sample's tensor broadcast along it."""
    if g is None:
        return None
    g = g.unflatten(0, (size, batch))
    if len(shape) < g.dim() - 1 or shape[0] == 1:
        g = g.sum(1, keepdim=True)
    return g.reshape(size, *shape)


def _map_vmapped(arg: Any, bdim: Any, fn: Callable[[torch.Tensor, int], torch.Tensor]) -> Any:
    """``arg`` with ``fn(tensor, its vmapped dim)`` applied to each vmapped tensor in it: in_dims
    hold an int for a vmapped tensor, None for anything else, and a dict or list of those for a dict
    or list argument (the options, whose offsets may be vmapped)."""
    if isinstance(bdim, int):
        return fn(arg, bdim)
    if isinstance(bdim, dict):
        return {k: _map_vmapped(v, bdim[k], fn) for k, v in arg.items()}
    if isinstance(bdim, (list, tuple)):
        return type(arg)(_map_vmapped(v, d, fn) for v, d in zip(arg, bdim))
    return arg


def _select(arg: Any, bdim: Any, i: int) -> Any:
    """Sample ``i`` of ``arg``; with ``i = -1``, zeros of a sample's shape (a vmap over no sample)."""
    return _map_vmapped(arg, bdim, lambda t, d: t.new_zeros(_sample_shape(t, d)) if i < 0 else t.select(d, i))


def _per_sample(apply: Callable[..., tuple], size: int, in_dims: Sequence[Any], args: Sequence[Any]) -> tuple:
    """A vmap rule's result by one call per sample, as torch's fallback runs an op (outputs that
    are None in every sample stay None). With no sample, one call on zeros of a sample's shapes
    gives the outputs' shapes (and the op's checks)."""
    results = [apply(*(_select(a, d, i if size else -1) for a, d in zip(args, in_dims))) for i in range(max(size, 1))]
    outputs = tuple(None if r[0] is None else torch.stack(r)[:size] for r in zip(*results))
    return outputs, tuple(None if o is None else 0 for o in outputs)


#: The largest batch a folded call makes: the CUDA tensor-core kernels take batches up to 65535
#: (a grid dim; csrc/cuda/family.cpp), and a larger one would run on the simple kernels where each
#: sample alone did not. A vmap over more samples folds them in chunks.
_MAX_FOLDED_BATCH = 65535


class _Info(NamedTuple):
    """What a vmap rule reads of torch's ``info``, for a chunk of the samples."""

    batch_size: int
    randomness: str


def _narrow(arg: Any, bdim: Any, start: int, length: int) -> Any:
    """Samples ``start .. start + length`` of ``arg``."""
    return _map_vmapped(arg, bdim, lambda t, d: t.narrow(d, start, length))


def _in_chunks(rule: Callable[..., tuple], info: Any, in_dims: Sequence[Any], args: Sequence[Any],
               batch: int) -> Optional[tuple]:
    """``rule``'s result by chunks of samples that fold to at most _MAX_FOLDED_BATCH, concatenated;
    None when the samples fold in one call."""
    chunk = max(1, _MAX_FOLDED_BATCH // max(batch, 1))
    if info.batch_size <= chunk:
        return None
    parts = [rule(_Info(min(chunk, info.batch_size - start), info.randomness), in_dims,
                  *(_narrow(a, d, start, min(chunk, info.batch_size - start)) for a, d in zip(args, in_dims)))
             for start in range(0, info.batch_size, chunk)]
    out_dims = parts[0][1]
    outputs = tuple(o if d is None else torch.cat([p[0][i] for p in parts], d)
                    for i, (o, d) in enumerate(zip(parts[0][0], out_dims)))
    return outputs, out_dims


class _Attention(torch.autograd.Function):
    """``entropy_attn::attention`` (dense layout), differentiable under torch.func."""

    @staticmethod
    def forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Optional[torch.Tensor],
                scale: Optional[torch.Tensor], sinks: Optional[torch.Tensor], options: dict) -> tuple:
        # (autograd is off in here: the op's C++ function records nothing)
        return tuple(_ops.attention(query, key, value, attn_mask, scale, sinks=sinks, **options))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        query, key, value, attn_mask, scale, sinks, options = inputs
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*output[_NON_DIFFERENTIABLE])
        out, lse, entropy, sum_p2, _, n_keys, row_scale, length_factor = output[:8]
        ctx.save_for_backward(query, key, value, attn_mask, scale, sinks, out, lse, entropy, sum_p2, n_keys,
                              row_scale, length_factor)
        ctx.options = options

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> tuple:
        query, key, value, attn_mask, scale, sinks, out, lse, entropy, sum_p2, n_keys, row_scale, factor = (
            ctx.saved_tensors
        )
        o = ctx.options
        # which of the mask, scale and sinks (inputs 3-5) want a gradient
        output_mask = [t is not None and ctx.needs_input_grad[i] for i, t in ((3, attn_mask), (4, scale), (5, sinks))]
        options = dict(is_causal=o["is_causal"], return_stats=o["return_stats"], window_size=o["window_size"],
                       causal_alignment=o["causal_alignment"], softcap=o["softcap"], dropout_p=o["dropout_p"],
                       dropout_seed=o["dropout_seed"], cu_seq_q=None, cu_seq_k=None, output_mask=output_mask)
        dq, dk, dv, dmask, dscale, dsinks = _attention_grad(
            *_grad_args(grads), query, key, value, attn_mask, scale, sinks, out, lse, entropy, sum_p2, n_keys,
            row_scale, factor, options)
        return dq, dk, dv, dmask, dscale, dsinks, None

    @staticmethod
    def vmap(info: Any, in_dims: tuple, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             attn_mask: Optional[torch.Tensor], scale: Optional[torch.Tensor], sinks: Optional[torch.Tensor],
             options: dict) -> tuple:
        args = (query, key, value, attn_mask, scale, sinks, options)
        size, dims = info.batch_size, in_dims[:6]
        shapes = [_sample_shape(t, d) for t, d in zip(args, dims)]
        if options["dropout_p"] > 0 or dims[5] is not None or not _dense_shapes(*shapes[:5]):
            return _per_sample(_Attention.apply, size, in_dims, args)
        batch = shapes[0][0]
        chunked = _in_chunks(_Attention.vmap, info, in_dims, args, batch)
        if chunked is not None:
            return chunked
        outputs = _Attention.apply(
            _fold(query, dims[0], size), _fold(key, dims[1], size), _fold(value, dims[2], size),
            _fold_broadcast(attn_mask, dims[3], size, batch, 4, False),
            _fold_broadcast(scale, dims[4], size, batch, 3, False), sinks, options)
        # (the statistics a forward without return_stats leaves empty are the same in every sample)
        return (tuple(o if o.dim() == 1 else o.unflatten(0, (size, batch)) for o in outputs),
                tuple(None if o.dim() == 1 else 0 for o in outputs))


def _dense_shapes(query: Optional[tuple], key: Optional[tuple], value: Optional[tuple], attn_mask: Optional[tuple],
                  scale: Optional[tuple]) -> bool:
    """Whether the per-sample shapes are ones the dense op takes (4-D query, key and value of one
    batch size; a mask and a scale that broadcast), so that folding the samples into the batch
    changes nothing the op checks."""
    if not (len(query) == len(key) == len(value) == 4 and query[0] == key[0] == value[0]):
        return False
    batch, heads, q_len, kv_len = query[0], query[1], query[2], key[2]
    return _broadcasts(attn_mask, (batch, heads, q_len, kv_len)) and _broadcasts(scale, (batch, heads, q_len))


class _AttentionGrad(torch.autograd.Function):
    """``entropy_attn::attention_grad`` (the backward of :class:`_Attention` and :class:`_Varlen`)
    as a function with a vmap rule; it has no derivative, as the op has none."""

    @staticmethod
    def forward(grad_output: Optional[torch.Tensor], grad_lse: Optional[torch.Tensor],
                grad_entropy: Optional[torch.Tensor], grad_sum_p2: Optional[torch.Tensor],
                grad_normalized_entropy: Optional[torch.Tensor], grad_sparsity: Optional[torch.Tensor],
                grad_effective_keys: Optional[torch.Tensor], query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, attn_mask: Optional[torch.Tensor], scale: Optional[torch.Tensor],
                sinks: Optional[torch.Tensor], output: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
                sum_p2: torch.Tensor, n_keys: torch.Tensor, row_scale: torch.Tensor, length_factor: torch.Tensor,
                options: dict) -> tuple:
        return tuple(_ops.attention_grad(
            grad_output, grad_lse, grad_entropy, grad_sum_p2, grad_normalized_entropy, grad_sparsity,
            grad_effective_keys, query, key, value, attn_mask, scale, sinks, output, lse, entropy, sum_p2, n_keys,
            row_scale, length_factor, **options))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple:
        raise RuntimeError("derivative for entropy_attn::attention_backward is not implemented")

    @staticmethod
    def vmap(info: Any, in_dims: tuple, *args: Any) -> tuple:
        # args: 7 upstream gradients; query, key, value, attn_mask, scale, sinks; output, lse,
        # entropy, sum_p2, n_keys, row_scale, length_factor; the options.
        size, options = info.batch_size, args[-1]
        grad_mask, grad_scale, grad_sinks = options["output_mask"]
        shapes = [_sample_shape(t, d) for t, d in zip(args[7:12], in_dims[7:12])]
        if (options["dropout_p"] > 0 or options["cu_seq_q"] is not None or in_dims[12] is not None
                or (args[12] is not None and grad_sinks) or not _dense_shapes(*shapes)):
            return _per_sample(_attention_grad, size, in_dims, args)
        batch = shapes[0][0]
        chunked = _in_chunks(_AttentionGrad.vmap, info, in_dims, args, batch)
        if chunked is not None:
            return chunked
        folded = [_fold(t, d, size) for t, d in zip(args[:10], in_dims[:10])]
        # A 16-bit mask or scale whose gradient is wanted is widened (exactly) to float32: the op
        # rounds each gradient it returns to the tensor's dtype, and the sum over the batch below
        # must round once, as the op's own sum does.
        mask, scale = (t.float() if want and t is not None and t.dtype in (torch.float16, torch.bfloat16) else t
                       for t, want in ((args[10], grad_mask), (args[11], grad_scale)))
        folded += [_fold_broadcast(mask, in_dims[10], size, batch, 4, grad_mask),
                   _fold_broadcast(scale, in_dims[11], size, batch, 3, grad_scale), args[12]]
        folded += [_fold(t, d, size) for t, d in zip(args[13:20], in_dims[13:20])]
        dq, dk, dv, dmask, dscale, dsinks = _attention_grad(*folded, options)
        dmask, dscale = (None if g is None else _unfold_broadcast(g, size, batch, shape).to(t.dtype)
                         for g, shape, t in ((dmask, shapes[3], args[10]), (dscale, shapes[4], args[11])))
        outputs = (*(g.unflatten(0, (size, batch)) for g in (dq, dk, dv)), dmask, dscale, None)
        return outputs, (0, 0, 0, None if dmask is None else 0, None if dscale is None else 0, None)


def _attention_grad(*args: Any) -> tuple:
    """``attention_grad(*tensors, **options)``: through :class:`_AttentionGrad`, for its vmap rule,
    where a vmap is active; else the op itself (a function applied under grad costs a generated
    autograd class per call, about 0.8 ms of a 1.7 ms grad of a small call on the CPU)."""
    return _AttentionGrad.apply(*args) if vmap_active() else _AttentionGrad.forward(*args)


def _dense(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A packed (T, H, ...) tensor as the dense op's (1, H, T, ...) view (csrc/varlen.cpp)."""
    return None if x is None else x.transpose(0, 1).unsqueeze(0)


def _packed(x: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_dense`."""
    return x.squeeze(0).transpose(0, 1)


class _Varlen(torch.autograd.Function):
    """``entropy_attn::varlen_attention`` (packed layout), differentiable under torch.func: the
    dense op's backward on the dense views of the packed tensors, as the C++ composite runs it."""

    @staticmethod
    def forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: Optional[torch.Tensor],
                sinks: Optional[torch.Tensor], cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor, max_q: Any,
                max_k: Any, options: dict) -> tuple:
        return tuple(_ops.varlen_attention(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, sinks=sinks,
                                           **options))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        query, key, value, scale, sinks, cu_seq_q, cu_seq_k, _, _, options = inputs
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*output[_NON_DIFFERENTIABLE])
        out, lse, entropy, sum_p2, _, n_keys, row_scale, length_factor = output[:8]
        ctx.save_for_backward(query, key, value, scale, sinks, cu_seq_q, cu_seq_k, out, lse, entropy, sum_p2,
                              n_keys, row_scale, length_factor)
        ctx.options = options

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> tuple:
        query, key, value, scale, sinks, cu_q, cu_k, out, lse, entropy, sum_p2, n_keys, row_scale, factor = (
            ctx.saved_tensors
        )
        o = ctx.options
        if o["seqused_k"] is not None:  # (the op's own message)
            raise ValueError(
                "seqused_k is inference-only (no backward, as in varlen_attn): call it under torch.no_grad() or "
                "with inputs that do not require grad"
            )
        # The scale broadcast to (T, H) and seen as (1, H, T), as the composite passes it.
        dense_scale = None if scale is None else _dense(scale.expand(query.shape[:2]))
        # needs_input_grad: (query, key, value, scale, sinks, ...); attention_grad's mask slot is empty.
        output_mask = [False, scale is not None and ctx.needs_input_grad[3],
                       sinks is not None and ctx.needs_input_grad[4]]
        # (empty statistics of a forward without return_stats stay empty)
        rows = [_dense(t) if t.dim() >= 2 else t for t in (lse, entropy, sum_p2, n_keys, row_scale, factor)]
        options = dict(is_causal=o["is_causal"], return_stats=o["return_stats"], window_size=o["window_size"],
                       causal_alignment="bottom_right", softcap=o["softcap"], dropout_p=o["dropout_p"],
                       dropout_seed=o["dropout_seed"], cu_seq_q=cu_q, cu_seq_k=cu_k, output_mask=output_mask)
        dq, dk, dv, _, dscale, dsinks = _attention_grad(
            *(_dense(g) for g in _grad_args(grads)), _dense(query), _dense(key), _dense(value), None, dense_scale,
            sinks, _dense(out), *rows, options)
        if dscale is not None:
            dscale = _packed(dscale).sum_to_size(scale.shape)
        return _packed(dq), _packed(dk), _packed(dv), dscale, dsinks, None, None, None, None, None

    @staticmethod
    def vmap(info: Any, in_dims: tuple, *args: Any) -> tuple:
        # One call per sample (folding would shift every document offset), as torch's fallback
        # ran it; the fallback also warned, failed on a vmap over no sample, and after its warning
        # turned the op's errors into SystemError (a PyTorch issue).
        return _per_sample(_Varlen.apply, info.batch_size, in_dims, args)


class _RowReduction(torch.autograd.Function):
    """``entropy_attn::entropy`` or ``sparsity``, differentiable under torch.func (their backward
    ops are ATen composites, with vmap rules of their own below)."""

    @staticmethod
    def forward(x: torch.Tensor, dim: int, name: str) -> torch.Tensor:
        return getattr(_ops, name)(x, dim)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        x, dim, name = inputs
        ctx.save_for_backward(x)
        ctx.dim, ctx.name = dim, name

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (x,) = ctx.saved_tensors
        return getattr(_ops, f"{ctx.name}_backward")(grad, x, ctx.dim), None, None

    @staticmethod
    def vmap(info: Any, in_dims: tuple, x: torch.Tensor, dim: int, name: str) -> tuple:
        # The samples become a leading dim of one call; a dim out of a sample's range runs per
        # sample, so that the op's message names the sample's shape (-ndim - 1 would otherwise
        # reduce over the samples).
        ndim = x.dim() - 1
        if not -ndim <= dim < ndim:
            return _per_sample(lambda t, d, n: (_RowReduction.apply(t, d, n),), info.batch_size, in_dims,
                               (x, dim, name))[0][0], 0
        return _RowReduction.apply(x.movedim(in_dims[0], 0), dim + 1 if dim >= 0 else dim, name), 0


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Optional[torch.Tensor],
              scale: Optional[torch.Tensor], sinks: Optional[torch.Tensor], options: dict) -> tuple:
    """``entropy_attn::attention(query, key, value, attn_mask, scale, sinks=sinks, **options)``."""
    return _Attention.apply(*_autocast(query, key, value), attn_mask, scale, sinks, options)


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
                     cu_seq_k: torch.Tensor, max_q: Any, max_k: Any, scale: Optional[torch.Tensor],
                     sinks: Optional[torch.Tensor], options: dict) -> tuple:
    """``entropy_attn::varlen_attention`` with the same arguments (``seqused_k`` among the options:
    inference-only, its backward raises as the op's does)."""
    # (a paged cache's pools are left to the op's autocast kernel, which casts only the keys the
    # call reads; such a call is inference-only, so its Function saves nothing a backward reads)
    tensors = (query, key, value) if options["block_table"] is not None else _autocast(query, key, value)
    return _Varlen.apply(*tensors, scale, sinks, cu_seq_q, cu_seq_k, max_q, max_k, options)


def row_reduction(name: str, x: torch.Tensor, dim: int) -> torch.Tensor:
    """``entropy_attn.<name>(x, dim)``, name "entropy" or "sparsity"."""
    return _RowReduction.apply(x, dim, name)


# --- ops called directly under transforms (not differentiable: no autograd function) -----------
def _length_factor_vmap(info: Any, in_dims: tuple, n_keys: torch.Tensor, *args: Any, **kwargs: Any) -> tuple:
    # Elementwise in the key counts: one call on the batched counts, the samples where they were.
    return _ops.length_factor(n_keys, *args, **kwargs), in_dims[0]


def _attention_sparsity_vmap(info: Any, in_dims: tuple, query: torch.Tensor, key: torch.Tensor,
                             attn_mask: Optional[torch.Tensor] = None, scale: Optional[torch.Tensor] = None,
                             **kwargs: Any) -> tuple:
    # The samples folded into the batch, as attention's forward rule does.
    size, args = info.batch_size, (query, key, attn_mask, scale)
    dims = tuple(in_dims) + (None,) * (4 - len(in_dims))
    shapes = [_sample_shape(t, d) for t, d in zip(args, dims)]
    if not _dense_shapes(shapes[0], shapes[1], shapes[1], shapes[2], shapes[3]):
        outputs, out_dims = _per_sample(lambda *a: (_ops.attention_sparsity(*a, **kwargs),), size, dims, args)
        return outputs[0], out_dims[0]
    batch = shapes[0][0]
    def as_tuples(chunk_info: Any, chunk_dims: tuple, *chunk_args: Any) -> tuple:
        out, out_dim = _attention_sparsity_vmap(chunk_info, chunk_dims, *chunk_args, **kwargs)
        return (out,), (out_dim,)

    chunked = _in_chunks(as_tuples, info, dims, args, batch)
    if chunked is not None:
        return chunked[0][0], chunked[1][0]
    sparsity = _ops.attention_sparsity(
        _fold(query, dims[0], size), _fold(key, dims[1], size),
        _fold_broadcast(attn_mask, dims[2], size, batch, 4, False),
        _fold_broadcast(scale, dims[3], size, batch, 3, False), **kwargs)
    return sparsity.unflatten(0, (size, batch)), 0


def _row_reduction_backward_vmap(name: str) -> Callable[..., tuple]:
    """The vmap rule of ``<name>_backward(grad, p, dim)``: an ATen composite, which vmap batches
    itself only where a level of autograd runs above it (jacrev's vmap over a vjp reached torch's
    fallback). The samples become a leading dim of one call, as in :class:`_RowReduction`."""
    op = getattr(_ops, f"{name}_backward")

    def rule(info: Any, in_dims: tuple, grad: torch.Tensor, p: torch.Tensor, dim: int) -> tuple:
        ndim = p.dim() - (in_dims[1] is not None)
        if not -ndim <= dim < ndim:  # (per sample: the op's message names the sample's shape)
            outputs, out_dims = _per_sample(lambda *a: (op(*a),), info.batch_size, in_dims, (grad, p, dim))
            return outputs[0], out_dims[0]
        size = info.batch_size
        return op(_front(grad, in_dims[0], size), _front(p, in_dims[1], size), dim + 1 if dim >= 0 else dim), 0

    return rule


torch.library.register_vmap("entropy_attn::entropy_backward", _row_reduction_backward_vmap("entropy"))
torch.library.register_vmap("entropy_attn::sparsity_backward", _row_reduction_backward_vmap("sparsity"))
torch.library.register_vmap("entropy_attn::length_factor", _length_factor_vmap)
torch.library.register_vmap("entropy_attn::attention_sparsity", _attention_sparsity_vmap)
