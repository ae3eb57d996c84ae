"""Statistics of a given (materialized) attention matrix."""

import torch

from torch_ext import _functorch
from torch_ext.attention import _check_tensors

__all__ = ["entropy", "sparsity"]


def _check_args(name: str, x: object, dim: object) -> None:
    """A TypeError naming the argument for a non-tensor input or a dim that is not an int (the
    op's parser raises a RuntimeError)."""
    _check_tensors(**{name: x})
    if isinstance(dim, (bool, torch.Tensor)) or not hasattr(type(dim), "__index__"):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")


def entropy(p: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Shannon entropy ``-sum(p * ln p)`` of normalized weights along ``dim`` (0 ln 0 = 0).

    Differentiable; the gradient at entries with ``p == 0`` is taken as 0.
    """
    _check_args("p", p, dim)
    if _functorch.transforms_active():
        return _functorch.row_reduction("entropy", p, dim)
    return torch.ops.entropy_attn.entropy(p, dim)


def sparsity(a: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """l1/l2 sparsity ``mean|a| / sqrt(mean a^2)`` along ``dim``, in [0, 1] (seed 003).

    1 for a uniform row, ``1/sqrt(n)`` for a one-hot row; any attention matrix, signed or not.
    An all-zero slice gives 0. Differentiable.
    """
    _check_args("a", a, dim)
    if _functorch.transforms_active():
        return _functorch.row_reduction("sparsity", a, dim)
    return torch.ops.entropy_attn.sparsity(a, dim)
