"""Independent float64 reference for entropy_attn, written with the plain n x n formula.

Nothing here uses the extension. Every quantity is computed with ordinary, differentiable
torch ops in float64 so that gradients of the extension can be compared with autograd
through this reference. Fully masked rows (n_i = 0, including L_k = 0) give zero output,
zero statistics and zero gradients, with no NaN anywhere (forward or backward).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Union

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


def allowed_mask(
    B: int,
    H: int,
    Lq: int,
    Lk: int,
    attn_mask: Optional[Tensor],
    is_causal: bool,
    device: Union[str, torch.device] = "cpu",
) -> Tensor:
    """Bool (B, H, Lq, Lk): True where query i may attend key j (mask AND top-left causal)."""
    allowed = torch.ones(B, H, Lq, Lk, dtype=torch.bool, device=device)
    if attn_mask is not None:
        m = attn_mask.to(device)
        if m.dtype == torch.bool:
            allowed = allowed & m
        else:
            allowed = allowed & (m.to(torch.float64) != float("-inf"))
    if is_causal:
        i = torch.arange(Lq, device=device).view(Lq, 1)
        j = torch.arange(Lk, device=device).view(1, Lk)
        allowed = allowed & (j <= i)
    return allowed


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
) -> RefResult:
    """Reference with the signature of ``torch.ops.entropy_attn.attention``.

    Inputs of any float dtype are promoted to float64 (keeping the autograd graph, so
    gradients flow back to the caller's tensors in their own dtype).
    """
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

    allowed = allowed_mask(B, H, Lq, Lk, attn_mask, is_causal, dev)
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
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        add = attn_mask.to(device=dev, dtype=torch.float64).expand(B, H, Lq, Lk)
        s = s + torch.where(allowed, add, torch.zeros_like(add))
    # Empty rows: let every entry through (finite logits) so softmax never sees an
    # all -inf row; the row is zeroed afterwards. Keeps forward and backward NaN-free.
    through = allowed | (~has).unsqueeze(-1)
    neg_inf = torch.full_like(s, float("-inf"))
    s_in = torch.where(through, s, neg_inf)
    logp_full = torch.log_softmax(s_in, dim=-1)
    keep = allowed  # (has rows only: allowed is all False in empty rows)
    zero = torch.zeros_like(s)
    logp = torch.where(keep, logp_full, zero)
    p = torch.where(keep, torch.exp(logp), zero)

    out = p @ v  # (B, H, Lq, Dv)
    if Lk > 0:
        lse_all = torch.logsumexp(s_in, dim=-1)
    else:
        lse_all = torch.zeros(B, H, Lq, dtype=torch.float64, device=dev)
    zrow = torch.zeros(B, H, Lq, dtype=torch.float64, device=dev)
    lse = torch.where(has, lse_all, zrow)
    entropy = -(p * logp).sum(-1)
    sum_p2 = (p * p).sum(-1)
    max_weight = torch.cat([p, zrow.unsqueeze(-1)], dim=-1).amax(-1)

    # ---- derived statistics ----------------------------------------------------------
    big = nf >= 2
    safe_logn = torch.where(big, logn, torch.ones_like(logn))
    normalized_entropy = torch.where(big, entropy / safe_logn, zrow)
    safe_sp2 = torch.where(has, sum_p2, torch.ones_like(sum_p2))
    safe_n = torch.where(has, nf, torch.ones_like(nf))
    sparsity = torch.where(has, 1.0 / torch.sqrt(safe_n * safe_sp2), zrow)
    effective_keys = torch.where(has, 1.0 / safe_sp2, zrow)

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
) -> RefResult:
    """Reference with the semantics of ``torch_ext.attention`` (Python API)."""
    kwargs = dict(
        is_causal=is_causal,
        temperature=temperature,
        log_base=float(train_length),
        enable_gqa=enable_gqa,
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
