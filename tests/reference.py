"""Independent float64 reference for entropy_attn, written with the plain n x n formula.

Nothing here uses the extension. Every quantity is computed with ordinary, differentiable
torch ops in float64 so that gradients of the extension can be compared with autograd
through this reference. Fully masked rows (n_i = 0, including L_k = 0) give zero output,
zero statistics and zero gradients, with no NaN anywhere (forward or backward).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional, Tuple, Union

import numpy as np
import torch
from torch import Tensor

ScaleArg = Union[None, float, str, Tensor]


class RefResult(NamedTuple):
    """Everything the op and the Python API return, computed in float64."""

    output: Tensor  # (B, H, Lq, Dv)
    lse: Tensor  # (B, H, Lq)
    entropy: Tensor
    sum_p2: Tensor
    max_weight: Tensor
    n_keys: Tensor  # int64
    row_scale: Tensor  # lambda_i, after temperature
    length_factor: Tensor  # g(n_i) / temperature, so that row_scale = c_i * length_factor
    normalized_entropy: Tensor
    sparsity: Tensor
    effective_keys: Tensor
    probs: Tensor  # (B, H, Lq, Lk) attention weights


def window_allowed(
    Lq: int,
    Lk: int,
    is_causal: bool,
    window_size: Tuple[int, int] = (-1, -1),
    causal_alignment: str = "top_left",
    device: Union[str, torch.device] = "cpu",
) -> Tensor:
    """Bool (Lq, Lk): key j is within query i's window: diag - left <= j <= diag + right, with
    diag = i (top-left) or i + Lk - Lq (bottom-right); -1 unbounded; causal means right = 0."""
    left, right = window_size
    if is_causal:
        right = 0
    i = torch.arange(Lq, device=device).view(Lq, 1)
    j = torch.arange(Lk, device=device).view(1, Lk)
    diag = i + (Lk - Lq if causal_alignment == "bottom_right" else 0)
    ok = torch.ones(Lq, Lk, dtype=torch.bool, device=device)
    if left >= 0:
        ok = ok & (j >= diag - left)
    if right >= 0:
        ok = ok & (j <= diag + right)
    return ok


def _mulhilo(a: np.ndarray, b: int) -> Tuple[np.ndarray, np.ndarray]:
    prod = a.astype(np.uint64) * np.uint64(b)
    return (prod >> np.uint64(32)).astype(np.uint32), (prod & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def philox_dropout_factors(seed: int, p: float, B: int, H: int, Lq: int, Lk: int) -> Tensor:
    """(B, H, Lq, Lk) float64 dropout factors, 0 or 1 / (1 - t / 2^16) with t = round(p * 2^16)
    clamped to [1, 2^16 - 1]: weight (b, h, i, j) is kept when its 16-bit draw is >= t. Its draw is
    half s % 2 (0: low, 1: high) of word s // 2 of Philox4x32-10 at counter
    (4 (j // 16) + (j // 2) % 4, 8 (i // 16) + i % 8, b * H + h, 0) under key (seed low 32 bits,
    seed high 32 bits), with s = 4 ((i // 8) % 2) + 2 ((j // 8) % 2) + j % 2 (Salmon et al. 2011,
    written here from the paper's definition with numpy, one generator call per weight,
    independently of the extension's C++)."""
    bh, i, j = np.meshgrid(np.arange(B * H), np.arange(Lq), np.arange(Lk), indexing="ij")
    c0 = 4 * (j // 16) + (j // 2) % 4
    c1 = 8 * (i // 16) + i % 8
    c = [c0.astype(np.uint32), c1.astype(np.uint32), bh.astype(np.uint32), np.zeros_like(j, dtype=np.uint32)]
    k0, k1 = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
    for _ in range(10):
        hi0, lo0 = _mulhilo(c[0], 0xD2511F53)
        hi1, lo1 = _mulhilo(c[2], 0xCD9E8D57)
        c = [hi1 ^ c[1] ^ np.uint32(k0), lo1, hi0 ^ c[3] ^ np.uint32(k1), lo0]
        k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
    s = 4 * ((i // 8) % 2) + 2 * ((j // 8) % 2) + j % 2
    words = np.stack(c, axis=-1)
    word = np.take_along_axis(words, (s // 2)[..., None], axis=-1)[..., 0]
    draw = (word >> (16 * (s % 2)).astype(np.uint32)) & np.uint32(0xFFFF)
    threshold = min(max(int(p * 2**16 + 0.5), 1), 2**16 - 1)
    keep = torch.from_numpy((draw >= threshold).astype(np.float64))
    return (keep / (1.0 - threshold / 2**16)).view(B, H, Lq, Lk)


def allowed_mask(
    B: int,
    H: int,
    Lq: int,
    Lk: int,
    attn_mask: Optional[Tensor],
    is_causal: bool,
    device: Union[str, torch.device] = "cpu",
    window_size: Tuple[int, int] = (-1, -1),
    causal_alignment: str = "top_left",
) -> Tensor:
    """Bool (B, H, Lq, Lk): True where query i may attend key j (mask AND window/causality)."""
    allowed = torch.ones(B, H, Lq, Lk, dtype=torch.bool, device=device)
    if attn_mask is not None:
        m = attn_mask.to(device)
        if m.dtype == torch.bool:
            allowed = allowed & m
        else:
            allowed = allowed & (m.to(torch.float64) != float("-inf"))
    return allowed & window_allowed(Lq, Lk, is_causal, window_size, causal_alignment, device)


def reference_attention_raw(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    scale: Optional[Tensor] = None,
    *,
    is_causal: bool = False,
    scale_factor: Optional[float] = None,
    scale_mode: str = "fixed",
    temperature: float = 1.0,
    log_base: float = 512.0,
    enable_gqa: bool = False,
    return_stats: bool = True,
    window_size: Tuple[int, int] = (-1, -1),
    causal_alignment: str = "top_left",
    softcap: float = 0.0,
    sinks: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    dropout_seed: int = 0,
) -> RefResult:
    """Reference with the signature of ``torch.ops.entropy_attn.attention``.

    Inputs of any float dtype are promoted to float64 (keeping the autograd graph, so
    gradients flow back to the caller's tensors in their own dtype). With ``sinks`` the softmax
    runs over the keys and one extra entry per row, the head's sink logit, whose value is 0; the
    statistics describe that whole distribution (n_i + 1 entries).
    """
    del return_stats  # the reference always computes every statistic
    q = query.to(torch.float64)
    k = key.to(torch.float64)
    v = value.to(torch.float64)
    dev = q.device
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    Dv = v.shape[-1]
    if H != Hkv:
        assert enable_gqa and H % Hkv == 0, "reference: GQA needs enable_gqa and H % Hkv == 0"
        k = k.repeat_interleave(H // Hkv, dim=1)
        v = v.repeat_interleave(H // Hkv, dim=1)

    allowed = allowed_mask(B, H, Lq, Lk, attn_mask, is_causal, dev, window_size, causal_alignment)
    n = allowed.sum(-1)  # int64 (B, H, Lq)
    nf = n.to(torch.float64)
    has = n > 0

    # ---- per-row scale lambda_i --------------------------------------------------
    if scale is not None:
        c = scale.to(torch.float64).expand(B, H, Lq)
    elif scale_factor is not None:
        c = torch.full((B, H, Lq), float(scale_factor), dtype=torch.float64, device=dev)
    else:
        c = torch.full((B, H, Lq), 1.0 / math.sqrt(D), dtype=torch.float64, device=dev)
    ln_b = math.log(log_base)
    logn = torch.log(torch.where(has, nf, torch.ones_like(nf)))  # ln n_i, 0 for empty rows
    if scale_mode == "fixed":
        g = torch.ones_like(nf)
    elif scale_mode == "logn":
        g = logn / ln_b  # n_i = 0 -> 0
    elif scale_mode == "logn_sharpen":
        g = torch.clamp(logn / ln_b, min=1.0)
    else:
        raise ValueError(f"reference: unknown scale_mode {scale_mode!r}")
    length_factor = g / temperature
    lam = c * length_factor

    # ---- logits and softmax --------------------------------------------------------
    raw = q @ k.transpose(-1, -2)  # (B, H, Lq, Lk)
    s = lam.unsqueeze(-1) * raw
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        add = attn_mask.to(device=dev, dtype=torch.float64).expand(B, H, Lq, Lk)
        s = s + torch.where(allowed, add, torch.zeros_like(add))
    if sinks is not None:
        # One more column: the sink logit, whose value is 0, allowed unless it is -inf (no sink).
        sink_col = sinks.to(torch.float64).to(dev).view(1, H, 1, 1).expand(B, H, Lq, 1)
        s = torch.cat([s, sink_col], dim=-1)
        allowed = torch.cat([allowed, ~torch.isneginf(sink_col)], dim=-1)
        v = torch.cat([v, torch.zeros(B, H, 1, Dv, dtype=torch.float64, device=dev)], dim=-2)
    support = allowed.sum(-1)  # entries of the distribution: n_i (+ 1 with a sink entry)
    has_support = support > 0
    # Empty rows: let every entry through (finite logits) so softmax never sees an
    # all -inf row; the row is zeroed afterwards. Keeps forward and backward NaN-free.
    through = allowed | (~has_support).unsqueeze(-1)
    neg_inf = torch.full_like(s, float("-inf"))
    s_in = torch.where(through, s, neg_inf)
    logp_full = torch.log_softmax(s_in, dim=-1)
    keep = allowed  # (non-empty rows only: allowed is all False in empty rows)
    zero = torch.zeros_like(s)
    logp = torch.where(keep, logp_full, zero)
    p = torch.where(keep, torch.exp(logp), zero)

    p_out = p
    if dropout_p > 0:
        factors = philox_dropout_factors(dropout_seed, dropout_p, B, H, Lq, Lk).to(dev)
        if sinks is not None:
            factors = torch.cat([factors, torch.ones(B, H, Lq, 1, dtype=torch.float64, device=dev)], dim=-1)
        p_out = p * factors
    out = p_out @ v  # (B, H, Lq, Dv)
    if s.shape[-1] > 0:
        lse_all = torch.logsumexp(s_in, dim=-1)
    else:
        lse_all = torch.zeros(B, H, Lq, dtype=torch.float64, device=dev)
    zrow = torch.zeros(B, H, Lq, dtype=torch.float64, device=dev)
    lse = torch.where(has_support, lse_all, zrow)
    entropy = -torch.where(p > 0, p * logp, zero).sum(-1)  # a weight of 0 (a sink of -inf) adds 0
    sum_p2 = (p * p).sum(-1)
    max_weight = torch.cat([p, zrow.unsqueeze(-1)], dim=-1).amax(-1)

    # ---- derived statistics (over the distribution's support) ----------------------------
    sf = support.to(torch.float64)
    big = support >= 2
    safe_logs = torch.log(torch.where(big, sf, torch.full_like(sf, 2.0)))
    normalized_entropy = torch.where(big, entropy / safe_logs, zrow)
    safe_sp2 = torch.where(has_support, sum_p2, torch.ones_like(sum_p2))
    safe_n = torch.where(has_support, sf, torch.ones_like(sf))
    sparsity = torch.where(has_support, 1.0 / torch.sqrt(safe_n * safe_sp2), zrow)
    effective_keys = torch.where(has_support, 1.0 / safe_sp2, zrow)
    if sinks is not None:
        p = p[..., :Lk]

    return RefResult(
        output=out,
        lse=lse,
        entropy=entropy,
        sum_p2=sum_p2,
        max_weight=max_weight,
        n_keys=n,
        row_scale=lam.detach().clone(),
        length_factor=length_factor.detach().clone(),
        normalized_entropy=normalized_entropy,
        sparsity=sparsity,
        effective_keys=effective_keys,
        probs=p,
    )


def reference_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    *,
    is_causal: bool = False,
    scale: ScaleArg = None,
    temperature: float = 1.0,
    enable_gqa: bool = False,
    train_length: float = 512,
    **pattern: Any,
) -> RefResult:
    """Reference with the semantics of ``torch_ext.attention`` (Python API); ``pattern`` takes the
    op's window_size, causal_alignment, softcap, sinks, dropout_p and dropout_seed."""
    kwargs = dict(
        is_causal=is_causal,
        temperature=temperature,
        log_base=float(train_length),
        enable_gqa=enable_gqa,
        **pattern,
    )
    if scale is None:
        return reference_attention_raw(query, key, value, attn_mask, None, **kwargs)
    if isinstance(scale, str):
        return reference_attention_raw(query, key, value, attn_mask, None, scale_mode=scale, **kwargs)
    if isinstance(scale, Tensor):
        return reference_attention_raw(query, key, value, attn_mask, scale, **kwargs)
    return reference_attention_raw(query, key, value, attn_mask, None, scale_factor=float(scale), **kwargs)


def reference_entropy(p: Tensor, dim: int = -1) -> Tensor:
    """-sum p ln p along dim in float64, with 0 ln 0 = 0."""
    x = p.to(torch.float64)
    pos = x > 0
    safe = torch.where(pos, x, torch.ones_like(x))
    return -torch.where(pos, x * torch.log(safe), torch.zeros_like(x)).sum(dim)


def reference_sparsity(a: Tensor, dim: int = -1) -> Tensor:
    """mean|a| / sqrt(mean a^2) along dim in float64; 0 for an all-zero row."""
    x = a.to(torch.float64)
    m1 = x.abs().mean(dim)
    m2 = (x * x).mean(dim)
    nz = m2 > 0
    return torch.where(nz, m1 / torch.sqrt(torch.where(nz, m2, torch.ones_like(m2))), torch.zeros_like(m1))
