"""Entropy-invariant softmax attention with fused per-row statistics.

The operators live in ``torch.ops.entropy_attn`` (registered by the compiled ``torch_ext._C``);
this package wraps them with a ``scaled_dot_product_attention``-like interface
(:func:`attention`; :func:`varlen_attention` for packed sequences), a drop-in ``torch.nn.MultiheadAttention`` (:mod:`torch_ext.nn`), an SDPA router
(:class:`replace_sdpa`), a Hugging Face transformers backend (:mod:`torch_ext.hf`, imported on
demand), a training monitor (:class:`AttentionEntropyMonitor`), the exact merge of attention
computed over key shards (:func:`merge_attention_states`) and context-parallel attention over a
process group (:mod:`torch_ext.distributed`, imported on demand).
"""

import torch  # noqa: F401  (loads libtorch, which the compiled library links against)

from torch_ext import _C  # noqa: F401  (loading it registers the operators)
from torch_ext import nn
from torch_ext.attention import AttentionStats, attention, attention_sparsity, length_factor
from torch_ext.merge import merge_attention_states
from torch_ext.monitor import AttentionEntropyMonitor
from torch_ext.policy import AttentionPolicy
from torch_ext.reductions import entropy, sparsity
from torch_ext.sdpa import replace_sdpa
from torch_ext.varlen import varlen_attention

__all__ = [
    "AttentionEntropyMonitor",
    "AttentionPolicy",
    "AttentionStats",
    "attention",
    "attention_sparsity",
    "entropy",
    "length_factor",
    "merge_attention_states",
    "nn",
    "replace_sdpa",
    "sparsity",
    "varlen_attention",
]
