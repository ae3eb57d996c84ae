"""The README's self-contained Python snippets run as written, in order, and print what their
comments say (two of them once failed as written: the packed-sequence and the shard-merge blocks
used tensors that no earlier block defined). The snippets that need a model (nn, replace_sdpa, the
Hugging Face backend, the monitor, AOTInductor) are checked by their own test files."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Dict

import torch

import torch_ext

README = Path(__file__).resolve().parents[1] / "README.md"


def _block(marker: str) -> str:
    """The README's Python code block that contains ``marker`` (exactly one)."""
    blocks = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), re.S) if marker in b]
    assert len(blocks) == 1, f"expected one README block with {marker!r}, found {len(blocks)}"
    return blocks[0]


def test_readme_usage_varlen_and_merge_snippets_run() -> None:
    """Usage, packed sequences and the shard merge, executed in one namespace as a reader would."""
    torch.manual_seed(0)
    ns: Dict[str, Any] = {}
    exec(_block("stats.normalized_entropy.mean()"), ns)  # the Usage block (imports torch, torch_ext)
    out, stats = ns["out"], ns["stats"]
    assert out.shape == (2, 8, 4096, 64) and stats.n_keys[0, 0, :3].tolist() == [1, 2, 3]
    same_as_sdpa = torch.nn.functional.scaled_dot_product_attention(
        ns["q"], ns["k"], ns["v"], is_causal=True, enable_gqa=True)
    fixed = torch_ext.attention(ns["q"], ns["k"], ns["v"], is_causal=True, enable_gqa=True)
    torch.testing.assert_close(fixed, same_as_sdpa, atol=2e-5, rtol=1e-4)  # "same as SDPA"

    exec(_block("torch_ext.varlen_attention(q, k, v, cu"), ns)
    assert ns["stats"].n_keys[:, 0].tolist() == [*range(1, 6), *range(1, 8), *range(1, 4)]  # per document

    exec(_block("block_table=table"), ns)  # the paged KV cache
    pages = [ns["table"][0], ns["table"][1, :2]]
    for d, n in enumerate(ns["used"].tolist()):
        k, v = (ns[p][pages[d].long()].flatten(0, 1)[:n].transpose(0, 1)[None] for p in ("k_pool", "v_pool"))
        want = torch_ext.attention(ns["q"][d : d + 1].transpose(0, 1)[None], k, v, is_causal=True,
                                   causal_alignment="bottom_right")
        torch.testing.assert_close(ns["out"][d], want[0, :, 0], atol=1e-6, rtol=1e-6)

    exec(_block("torch_ext.merge_attention_states([out_a, out_b]"), ns)
    whole, whole_stats = torch_ext.attention(ns["q"], ns["k"], ns["v"], scale=ns["lam"], return_stats=True)
    torch.testing.assert_close(ns["out"], whole, atol=1e-5, rtol=1e-5)  # "= one call, to rounding"
    torch.testing.assert_close(ns["stats"].entropy, whole_stats.entropy, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ns["stats"].effective_keys, whole_stats.effective_keys, atol=1e-3, rtol=1e-5)

    exec(_block("torch_ext.attention(q.transpose(1, 2)"), ns)  # nested (jagged) tensors
    out, stats = ns["out"], ns["stats"]
    assert out.shape[:2] == (2, 8) and stats.entropy.shape[:2] == (2, 8)
    for seq, o, n in zip(ns["q"].unbind(), out.unbind(), stats.n_keys.unbind()):
        x = seq.transpose(0, 1)[None]
        torch.testing.assert_close(o, torch_ext.attention(x, x, x, is_causal=True, scale="logn")[0])
        assert n[0].tolist() == list(range(1, seq.shape[0] + 1))  # n_i per sequence
