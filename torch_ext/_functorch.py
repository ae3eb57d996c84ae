"""The ops' autograd as Python functions, for torch.func transforms (grad, vjp, jacrev, vmap of them).

The ops differentiate through C++ ``torch::autograd::Function`` classes (csrc/autograd.cpp), which
LibTorch callers need and torch.compile traces, but which torch.func cannot transform ("cannot use
C++ torch::autograd::Function with functorch transforms"). While a transform is active the Python
wrappers call the ops through the ``torch.autograd.Function`` classes below instead. Their forward
is the op itself and their backward the registered op that the C++ function's backward runs
(``attention_grad``, ``entropy_backward``, ``sparsity_backward``), so both paths give the same
gradients. ``generate_vmap_rule`` lets vmap batch them (per-sample gradients: ``vmap(grad(f))``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

_ops = torch.ops.entropy_attn


def transforms_active() -> bool:
    """Whether a torch.func transform (grad, vjp, jacrev, jvp, vmap) is running."""
    return torch._C._are_functorch_transforms_active()


# The outputs of `attention` (ops.cpp) that are counts or the scale used, not differentiable.
_NON_DIFFERENTIABLE = slice(4, 8)  # max_weight, n_keys, row_scale, length_factor


def _grad_args(grads: tuple) -> tuple:
    """The upstream gradients attention_grad takes: output, lse, entropy, sum_p2, normalized
    entropy, sparsity and effective keys (the outputs 0-3 and 8-10)."""
    return grads[:4] + grads[8:]


class _Attention(torch.autograd.Function):
    """``entropy_attn::attention`` (dense layout), differentiable under torch.func."""

    generate_vmap_rule = True

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
        dq, dk, dv, dmask, dscale, dsinks = _ops.attention_grad(
            *_grad_args(grads), query, key, value, attn_mask, scale, sinks, out, lse, entropy, sum_p2, n_keys,
            row_scale, factor, o["is_causal"], o["return_stats"], window_size=o["window_size"],
            causal_alignment=o["causal_alignment"], softcap=o["softcap"], dropout_p=o["dropout_p"],
            dropout_seed=o["dropout_seed"], output_mask=output_mask,
        )
        return dq, dk, dv, dmask, dscale, dsinks, None


def _dense(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A packed (T, H, ...) tensor as the dense op's (1, H, T, ...) view (csrc/varlen.cpp)."""
    return None if x is None else x.transpose(0, 1).unsqueeze(0)


def _packed(x: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_dense`."""
    return x.squeeze(0).transpose(0, 1)


class _Varlen(torch.autograd.Function):
    """``entropy_attn::varlen_attention`` (packed layout), differentiable under torch.func: the
    dense op's backward on the dense views of the packed tensors, as the C++ composite runs it."""

    generate_vmap_rule = True

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
        dq, dk, dv, _, dscale, dsinks = _ops.attention_grad(
            *(_dense(g) for g in _grad_args(grads)), _dense(query), _dense(key), _dense(value), None, dense_scale,
            sinks, _dense(out), *rows, o["is_causal"], o["return_stats"], window_size=o["window_size"],
            causal_alignment="bottom_right", softcap=o["softcap"], dropout_p=o["dropout_p"],
            dropout_seed=o["dropout_seed"], cu_seq_q=cu_q, cu_seq_k=cu_k, output_mask=output_mask,
        )
        if dscale is not None:
            dscale = _packed(dscale).sum_to_size(scale.shape)
        return _packed(dq), _packed(dk), _packed(dv), dscale, dsinks, None, None, None, None, None


class _RowReduction(torch.autograd.Function):
    """``entropy_attn::entropy`` or ``sparsity``, differentiable under torch.func."""

    generate_vmap_rule = True

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


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Optional[torch.Tensor],
              scale: Optional[torch.Tensor], sinks: Optional[torch.Tensor], options: dict) -> tuple:
    """``entropy_attn::attention(query, key, value, attn_mask, scale, sinks=sinks, **options)``."""
    return _Attention.apply(query, key, value, attn_mask, scale, sinks, options)


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
                     cu_seq_k: torch.Tensor, max_q: Any, max_k: Any, scale: Optional[torch.Tensor],
                     sinks: Optional[torch.Tensor], options: dict) -> tuple:
    """``entropy_attn::varlen_attention`` with the same arguments (``seqused_k`` among the options:
    inference-only, its backward raises as the op's does)."""
    return _Varlen.apply(query, key, value, scale, sinks, cu_seq_q, cu_seq_k, max_q, max_k, options)


def row_reduction(name: str, x: torch.Tensor, dim: int) -> torch.Tensor:
    """``entropy_attn.<name>(x, dim)``, name "entropy" or "sparsity"."""
    return _RowReduction.apply(x, dim, name)
