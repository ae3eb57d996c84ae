"""Entropy-invariant softmax attention with fused per-row statistics.

The operators live in ``torch.ops.entropy_attn`` (registered by the compiled ``torch_ext._C``);
this package wraps them with a ``scaled_dot_product_attention``-like interface.
"""

from torch_ext import _C  # noqa: F401  (loads the library, which registers the operators)
from torch_ext.attention import AttentionStats, attention
from torch_ext.reductions import entropy, sparsity

__all__ = ["AttentionStats", "attention", "entropy", "sparsity"]
