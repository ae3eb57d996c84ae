"""Element offsets beyond 2^31: the kernels index with 64-bit arithmetic (int64 strides and
products throughout csrc/cpu, csrc/kernel_args.h's MaskArg, the Strided4 views), so inputs whose
strides put elements past 2^31 of their storage give the results of the same values stored
compactly.

The storages are allocated with torch.empty and only the viewed elements are written: the
untouched pages of the 8 GiB (float32) and 2 GiB (bool) buffers are never backed by memory, so
the test costs a few MiB of RAM (it needs virtual-memory overcommit, Linux's default).
"""

from __future__ import annotations

import pytest
import torch

import torch_ext

BIG = 2**31 + 64  # an element offset past 2^31


def spread(x: torch.Tensor, strides: tuple) -> torch.Tensor:
    """x's values in a view with the given (element) strides over a fresh, mostly untouched storage."""
    extent = 1 + sum((s - 1) * st for s, st in zip(x.shape, strides))
    try:
        storage = torch.empty(extent, dtype=x.dtype)
    except RuntimeError as e:  # no overcommit: the storage cannot even be reserved
        pytest.skip(f"cannot reserve {extent} elements: {e}")
    view = storage.as_strided(x.shape, strides)
    view.copy_(x)
    return view


@pytest.mark.parametrize("where", ["batch", "sequence", "mask"])
def test_offsets_past_2_31(where: str) -> None:
    g = torch.Generator().manual_seed(0)
    B, H, L, D = 2, 2, 24, 16
    q, k, v = (torch.randn(B, H, L, D, generator=g) for _ in range(3))
    mask = torch.rand(B, 1, L, L, generator=g) < 0.7
    args = dict(q=q, k=k, v=v, mask=mask)
    if where == "batch":  # K's second batch entry starts past 2^31
        args["k"] = spread(k, (BIG, L * D, D, 1))
    elif where == "sequence":  # V's rows 2^27 elements apart: row 23 is past 2^31 (and lda > 2^31)
        args["v"] = spread(v, (H * L * D, L * D, 2**27, 1))
    else:  # a bool mask whose second batch entry is past 2^31 bytes
        args["mask"] = spread(mask, (BIG, L * L, L, 1))
    leaves = [args[n].requires_grad_(True) if n != "mask" else args[n] for n in ("q", "k", "v")]
    out, st = torch_ext.attention(*leaves, args["mask"], is_causal=True, return_stats=True)
    out.sum().backward()
    ref_leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    ref, ref_st = torch_ext.attention(*ref_leaves, mask.clone(), is_causal=True, return_stats=True)
    ref.sum().backward()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(st.entropy, ref_st.entropy, rtol=0, atol=0)
    for a, b in zip(leaves, ref_leaves):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kv_heads", [2, 1])  # (on 2 threads: keys converted by each thread, or whole)
def test_sparsity_offsets_past_2_31(kv_heads: int) -> None:
    """attention_sparsity reads query rows 2^27 elements apart (rows past 2^31) and keys whose second
    batch entry starts past 2^31 as it reads them stored compactly."""
    g = torch.Generator().manual_seed(1)
    B, H, L, D = 2, 2, 24, 16
    q, k = torch.randn(B, H, L, D, generator=g), torch.randn(B, kv_heads, L, D, generator=g)
    q_far = spread(q, (H * L * D, L * D, 2**27, 1))
    k_far = spread(k, (BIG, L * D, D, 1))
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for kind in ("exp", "relu2", "identity"):
            got = torch_ext.attention_sparsity(q_far, k_far, kind=kind, is_causal=True, enable_gqa=True)
            want = torch_ext.attention_sparsity(q, k, kind=kind, is_causal=True, enable_gqa=True)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    finally:
        torch.set_num_threads(previous)
