"""Entropy-invariant softmax attention with fused per-row statistics.

The operators live in ``torch.ops.entropy_attn`` (registered by the compiled ``torch_ext._C``);
this package wraps them with a ``scaled_dot_product_attention``-like interface
(:func:`attention`; :func:`varlen_attention` for packed sequences), a drop-in ``torch.nn.MultiheadAttention`` (:mod:`torch_ext.nn`), an SDPA router
(:class:`replace_sdpa`), a Hugging Face transformers backend (:mod:`torch_ext.hf`, imported on
demand), a training monitor (:class:`AttentionEntropyMonitor`), the exact merge of attention
computed over key shards (:func:`merge_attention_states`) and context-parallel attention over a
process group (:mod:`torch_ext.distributed`, imported on demand). Beside them: the scale policies'
length factor (:func:`length_factor`, :class:`AttentionPolicy`), the statistics of a given
attention matrix (:func:`entropy`, :func:`sparsity`), the fused sparsity of non-softmax attention
(:func:`attention_sparsity`) and the closed forms of the theory (:mod:`torch_ext.theory`).
"""

import torch  # noqa: F401  (loads libtorch, which the compiled library links against)

from torch_ext._version import __version__


def _check_torch() -> None:
    """Raises ImportError naming both versions when the running torch is not the major.minor the
    extension was compiled against (whose libtorch symbols it needs), instead of an undefined-symbol
    error from loading it. A tree without build info (never built by setup.py) is not checked."""
    try:
        from torch_ext._build_info import TORCH_VERSION
    except ImportError:
        return
    built, running = TORCH_VERSION.split(".")[:2], torch.__version__.split("+")[0].split(".")[:2]
    if built != running:
        raise ImportError(
            f"torch_ext {__version__} was compiled against torch {TORCH_VERSION}, but torch {torch.__version__} is "
            f"installed: install torch {'.'.join(built)}, or rebuild torch_ext for this torch "
            "(pip install --no-build-isolation .)"
        )


_check_torch()

from torch_ext import _C  # noqa: E402, F401  (loading it registers the operators)


def _tag_compile_caches() -> None:
    """Adds this build's source hash to ``torch.compiler.config.cache_key_tag``, which every
    torch.compile cache (Inductor's FX graph cache, AOTAutograd's) puts in its keys. Those caches
    key a graph by its own code and by torch's, not by the extensions whose operators it calls,
    and the graph Dynamo traces holds only the forward operator: a backward compiled against
    another build of torch_ext would replay that build's Meta kernels (the layouts of its
    gradients, for one) and fail Inductor's stride checks, or worse. The tag keeps graphs compiled
    with different builds apart; a tag the user set stays in front of it."""
    try:
        from torch_ext._build_info import SOURCES_SHA256
    except ImportError:  # a tree setup.py never built (no build info): nothing to tell apart
        return
    config = getattr(torch.compiler, "config", None)
    tag = f"torch_ext-{SOURCES_SHA256[:16]}"
    if config is None or not hasattr(config, "cache_key_tag") or tag in config.cache_key_tag:
        return
    config.cache_key_tag = f"{config.cache_key_tag}+{tag}" if config.cache_key_tag else tag


_tag_compile_caches()
from torch_ext import nn, theory  # noqa: E402
from torch_ext.attention import AttentionStats, attention, attention_sparsity, length_factor
from torch_ext.merge import merge_attention_states
from torch_ext.monitor import AttentionEntropyMonitor
from torch_ext.policy import AttentionPolicy
from torch_ext.reductions import entropy, sparsity
from torch_ext.sdpa import replace_sdpa
from torch_ext.varlen import varlen_attention

__all__ = [
    "__version__",
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
    "theory",
    "varlen_attention",
]
