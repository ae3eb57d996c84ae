"""Entropy-invariant softmax attention with fused per-row statistics.

The operators live in ``torch.ops.entropy_attn`` (registered by the compiled ``torch_ext._C``);
this package wraps them with a ``scaled_dot_product_attention``-like interface.
"""

import torch  # noqa: F401  (loads libtorch, which the compiled library links against)

from torch_ext import _C  # noqa: F401  (loading it registers the operators)
from torch_ext.attention import AttentionStats, attention, attention_sparsity
from torch_ext.reductions import entropy, sparsity

__all__ = ["AttentionStats", "attention", "attention_sparsity", "entropy", "sparsity"]
