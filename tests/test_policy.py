"""torch_ext.attention's scale_factor (the base scale of the "logn" policies) and AttentionPolicy."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

import torch_ext
from torch_ext.policy import AttentionPolicy


def plain_logn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: torch.Tensor, b: float) -> torch.Tensor:
    """Causal attention with lambda_i = c * log_b(n_i), n_i = i + 1, written out in float64."""
    L = q.shape[2]
    n = torch.arange(1, L + 1, dtype=torch.float64).view(L, 1)
    lam = c * torch.log(n) / math.log(b)
    logits = (lam * (q @ k.transpose(-1, -2))).masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), -math.inf)
    return logits.softmax(-1) @ v


def test_scale_factor_tensor_matches_formula_and_gradcheck() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 6, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    c = torch.tensor([[0.3], [0.5], [0.9]], dtype=torch.float64, requires_grad=True)  # (H, 1)
    out = torch_ext.attention(q, k, v, is_causal=True, scale="logn", train_length=3, scale_factor=c)
    torch.testing.assert_close(out, plain_logn(q, k, v, c.view(1, 3, 1, 1), 3.0))
    torch.autograd.gradcheck(
        lambda q, k, v, c: torch_ext.attention(q, k, v, is_causal=True, scale="logn", train_length=3, scale_factor=c),
        (q, k, v, c),
    )
    f = torch_ext.attention(q, k, v, is_causal=True, scale="logn", train_length=3, scale_factor=0.5)
    torch.testing.assert_close(f, plain_logn(q, k, v, torch.tensor(0.5, dtype=torch.float64), 3.0))


def test_scale_factor_errors() -> None:
    q = torch.randn(1, 1, 3, 4)
    for scale in (None, 0.5, torch.ones(1)):
        with pytest.raises(ValueError, match="scale_factor"):
            torch_ext.attention(q, q, q, scale=scale, scale_factor=0.5)
    with pytest.raises(ValueError, match="scale_factor"):
        torch_ext.attention(q, q, q, scale="logn", scale_factor=math.inf)
    with pytest.raises(TypeError, match="scale_factor"):
        torch_ext.attention(q, q, q, scale="logn", scale_factor="x")


def test_policy_kwargs() -> None:
    """The caller's scale is the base of the logn policies; a float policy replaces it."""
    assert AttentionPolicy().attention_kwargs(16) == {"temperature": 1.0, "train_length": 512, "scale": 0.25}
    assert AttentionPolicy().attention_kwargs(16, base_scale=0.1)["scale"] == 0.1
    assert AttentionPolicy(scale=0.7).attention_kwargs(16, base_scale=0.1)["scale"] == 0.7
    kw = AttentionPolicy(scale="logn", train_length=64).attention_kwargs(16, base_scale=0.1)
    assert kw == {"temperature": 1.0, "train_length": 64, "scale": "logn", "scale_factor": 0.1}
    m = torch.ones(2, 1)
    assert torch.equal(AttentionPolicy().attention_kwargs(4, multiplier=m)["scale"], m * 0.5)
    with pytest.raises(ValueError, match="temperature"):
        AttentionPolicy(temperature=-1.0)
    with pytest.raises(ValueError, match="train_length"):
        AttentionPolicy(scale="logn", train_length=1)
    # A policy's scale takes no Tensor (attention's does): its messages say what it takes.
    accepted = r"^AttentionPolicy.scale must be None, a float or one of \('logn', 'logn_sharpen'\), got "
    with pytest.raises(TypeError, match=accepted + "Tensor$"):
        AttentionPolicy(scale=torch.ones(1))
    with pytest.raises(ValueError, match=accepted + "'log'$"):
        AttentionPolicy(scale="log")
    with pytest.raises(TypeError, match=accepted + "list$"):
        AttentionPolicy(scale=[0.5])
    # Any real number is the float it stands for (a numpy or Fraction scale fell back to the
    # caller's scale, 1/sqrt(D) here), in the wrappers that take a policy too.
    for scale in (np.float32(0.75), np.int64(2), Fraction(3, 4), 2):
        policy = AttentionPolicy(scale=scale)
        assert type(policy.scale) is float and policy.attention_kwargs(16, base_scale=0.1)["scale"] == float(scale)
    ref = torch_ext.nn.MultiheadAttention(8, 2, batch_first=True, scale=0.75)
    mha = torch_ext.nn.MultiheadAttention(8, 2, batch_first=True, scale=np.float32(0.75))
    mha.load_state_dict(ref.state_dict())
    x = torch.randn(1, 3, 8)
    assert torch.equal(mha(x, x, x)[0], ref(x, x, x)[0])
