"""torch_ext.attention_sparsity (fused l1/l2 sparsity of exp / relu^2 / identity attention) against a
plain float64 n x n reference."""

from __future__ import annotations

import math

import pytest
import torch

import torch_ext
from conftest import DEVICES, STAT_TOL, assert_close64

KINDS = ["exp", "relu2", "identity"]


def reference_sparsity(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: torch.Tensor | None,
    kind: str,
    causal: bool,
    lam: torch.Tensor | float,
    group: int = 1,
) -> torch.Tensor:
    """S_i = sum|a| / sqrt(n_i sum a^2) with a = f(lam_i q.k + additive mask) over allowed keys."""
    q, k = q.double(), k.double().repeat_interleave(group, dim=1)
    s = (q @ k.transpose(-1, -2)) * (lam.double().unsqueeze(-1) if isinstance(lam, torch.Tensor) else lam)
    lq, lk = s.shape[-2:]
    allowed = torch.ones_like(s, dtype=torch.bool)
    if causal:
        allowed = allowed & torch.ones(lq, lk, dtype=torch.bool, device=s.device).tril()
    if mask is not None:
        if mask.dtype == torch.bool:
            allowed = allowed & mask
        else:
            allowed = allowed & (mask != -math.inf)
            s = s + torch.where(mask == -math.inf, torch.zeros_like(mask), mask).double()
    if kind == "exp":
        row_max = s.masked_fill(~allowed, -math.inf).amax(-1, keepdim=True)
        a = torch.exp(s - torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max))
    elif kind == "relu2":
        a = torch.relu(s) ** 2
    else:
        a = s
    a = torch.where(allowed, a, torch.zeros_like(a))
    n = allowed.sum(-1).double()
    l1, l2 = a.abs().sum(-1), (a * a).sum(-1)
    return torch.where(l2 > 0, l1 / torch.sqrt(n * l2).clamp_min(1e-300), torch.zeros_like(l1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
@pytest.mark.parametrize("lq,lk", [(1, 1), (7, 33), (130, 600), (40, 17)])
def test_matches_reference(device: str, kind: str, causal: bool, mask_kind: str, lq: int, lk: int) -> None:
    """Every kind, mask and causal setting against the n x n reference in float64 (incl. empty rows)."""
    q = torch.randn(2, 4, lq, 8, dtype=torch.float64, device=device)
    k = torch.randn(2, 2, lk, 8, dtype=torch.float64, device=device)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(lq, lk, device=device) > 0.4
        mask[0] = False  # a fully masked row
    elif mask_kind == "additive":
        mask = torch.randn(2, 1, lq, lk, dtype=torch.float64, device=device)
        mask = mask.masked_fill(torch.rand_like(mask) < 0.3, -math.inf)
    got = torch_ext.attention_sparsity(q, k, mask, kind=kind, is_causal=causal, enable_gqa=True)
    expected = reference_sparsity(q, k, mask, kind, causal, 8**-0.5, group=2)
    assert got.shape == (2, 4, lq) and got.dtype == torch.float64
    assert_close64(got, expected, 1e-10, 1e-10, name=kind)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", KINDS)
def test_low_precision(device: str, dtype: torch.dtype, kind: str) -> None:
    """16/32-bit inputs accumulate in float32 and return float32."""
    q = torch.randn(1, 2, 50, 16).to(device=device, dtype=dtype)
    k = torch.randn(1, 2, 700, 16).to(device=device, dtype=dtype)
    got = torch_ext.attention_sparsity(q, k, kind=kind, is_causal=True)
    assert got.dtype == torch.float32
    assert_close64(got, reference_sparsity(q, k, None, kind, True, 0.25), *STAT_TOL[dtype], name=kind)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale", ["logn", "logn_sharpen", 0.3, "tensor"])
def test_scale_policies(device: str, scale: object) -> None:
    """The per-row scale is the attention op's: compared through its row_scale output."""
    q = torch.randn(1, 2, 20, 8, dtype=torch.float64, device=device)
    k = torch.randn(1, 2, 20, 8, dtype=torch.float64, device=device)
    if scale == "tensor":
        scale = torch.rand(2, 1, dtype=torch.float64, device=device) + 0.5
    _, stats = torch_ext.attention(q, k, k, is_causal=True, scale=scale, train_length=4, return_stats=True)
    for kind in KINDS:
        got = torch_ext.attention_sparsity(q, k, kind=kind, is_causal=True, scale=scale, train_length=4)
        assert_close64(got, reference_sparsity(q, k, None, kind, True, stats.scale), 1e-10, 1e-10, name=kind)


@pytest.mark.parametrize("device", DEVICES)
def test_exp_equals_attention_stats(device: str) -> None:
    """kind="exp" is the softmax attention's own sparsity statistic."""
    q, k = torch.randn(2, 3, 45, 8, device=device), torch.randn(2, 3, 77, 8, device=device)
    mask = torch.rand(45, 77, device=device) > 0.5
    _, stats = torch_ext.attention(q, k, k, mask, scale="logn", return_stats=True)
    got = torch_ext.attention_sparsity(q, k, mask, scale="logn")
    torch.testing.assert_close(got, stats.sparsity, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_limits(device: str) -> None:
    """Uniform weights give 1, one dominant key gives about 1/sqrt(n), identity of a constant row 1."""
    k = torch.randn(1, 1, 64, 4, dtype=torch.float64, device=device)
    zero_q = torch.zeros(1, 1, 1, 4, dtype=torch.float64, device=device)
    assert torch_ext.attention_sparsity(zero_q, k, kind="exp").item() == pytest.approx(1.0)
    hot = torch.zeros(1, 1, 64, 4, dtype=torch.float64, device=device)
    hot[..., 0, 0] = 1.0
    q = torch.zeros(1, 1, 1, 4, dtype=torch.float64, device=device)
    q[..., 0] = 1e3
    assert torch_ext.attention_sparsity(q, hot, kind="relu2").item() == pytest.approx(1 / 8)
    assert torch_ext.attention_sparsity(zero_q, k, kind="relu2").item() == 0.0  # all-zero row


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_opcheck(device: str, kind: str) -> None:
    """Schema, fake tensor and AOT dispatch of the op."""
    q, k = torch.randn(1, 2, 9, 4, device=device), torch.randn(1, 2, 11, 4, device=device)
    for requires_grad in (False, True):  # (not differentiable: its Autograd kernel runs below autograd)
        torch.library.opcheck(
            torch.ops.entropy_attn.attention_sparsity,
            (q.requires_grad_(requires_grad), k, torch.rand(9, 11, device=device) > 0.5, None),
            {"kind": kind, "is_causal": True, "scale_mode": "logn", "log_base": 8.0},
        )


def test_logged_in_a_compiled_training_step() -> None:
    """A compiled training step that logs the sparsity of its activations, which require grad,
    compiles (its backward was traced, and raised, though no loss used it) and gives eager's
    values and gradients."""
    lin = torch.nn.Linear(8, 8, dtype=torch.float64)
    x = torch.randn(2, 5, 8, dtype=torch.float64)

    def step(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = lin(x).view(1, 2, 5, 8)
        loss = torch_ext.attention(h, h, h).square().sum()
        return loss, torch_ext.attention_sparsity(h, h, kind="relu2")

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    (loss, sparsity), (loss_eager, sparsity_eager) = compiled(x), step(x)
    torch.testing.assert_close(sparsity, sparsity_eager)
    assert not sparsity.requires_grad
    (grad,) = torch.autograd.grad(loss, lin.weight)
    (grad_eager,) = torch.autograd.grad(loss_eager, lin.weight)
    torch.testing.assert_close(grad, grad_eager)


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        ({"kind": "cube"}, "kind"),
        ({"scale": "log"}, "scale"),
        ({"temperature": 0.0}, "temperature"),
        ({"train_length": 1}, "train_length"),
    ],
)
@pytest.mark.parametrize("device", DEVICES)
def test_bad_arguments(device: str, kwargs: dict, pattern: str) -> None:
    """Bad arguments raise a ValueError naming them."""
    q, k = torch.randn(1, 2, 3, 4, device=device), torch.randn(1, 2, 5, 4, device=device)
    with pytest.raises(ValueError, match=pattern):
        torch_ext.attention_sparsity(q, k, **kwargs)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_shapes(device: str) -> None:
    """query/key validation is the attention op's."""
    with pytest.raises(ValueError, match="head_dim"):
        torch_ext.attention_sparsity(torch.randn(1, 2, 3, 4, device=device), torch.randn(1, 2, 5, 6, device=device))
    with pytest.raises(ValueError, match="enable_gqa"):
        torch_ext.attention_sparsity(torch.randn(1, 4, 3, 4, device=device), torch.randn(1, 2, 5, 4, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["relu2", "identity"])
@pytest.mark.parametrize("magnitude", [1e9, 1e-12])
def test_float32_extreme_magnitudes(device: str, kind: str, magnitude: float) -> None:
    """S is scale-free: logits of 1e18 or 1e-12 give the float64 answer in float32 (no overflow
    or underflow of sum a^2)."""
    g = torch.Generator().manual_seed(0)
    k = (torch.rand(1, 1, 100, 4, generator=g) * (magnitude if magnitude > 1 else 1.0)).to(device)
    q = torch.full((1, 1, 1, 4), magnitude, device=device)
    got = torch_ext.attention_sparsity(q, k, kind=kind, scale=1.0)
    want = torch_ext.attention_sparsity(q.double(), k.double(), kind=kind, scale=1.0)
    assert torch.isfinite(got).all() and got.item() > 0
    assert got.item() == pytest.approx(want.item(), rel=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["relu2", "identity"])
def test_float32_subnormal_logits(device: str, kind: str) -> None:
    """Logits below float32's smallest normal number (a tiny scale, or tiny q . k) give the float64
    answer: the sums are taken relative to the row's largest |b|, whose reciprocal overflowed when
    it was subnormal (S was NaN)."""
    q = torch.tensor([[[[1.0, 0.0]]]], device=device)
    k = torch.tensor([[[[1.0, 0.0], [2.0, 0.0], [0.5, 0.0]]]], device=device)
    for q_, k_, scale in ((q, k, 1e-39), (q, k, 1e-41), (q * 1e-20, k * 1e-19, None)):
        got = torch_ext.attention_sparsity(q_, k_, kind=kind, scale=scale)
        want = torch_ext.attention_sparsity(q_.double(), k_.double(), kind=kind, scale=scale)
        assert got.item() == pytest.approx(want.item(), rel=1e-3), (scale, got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_nan_propagates(device: str, kind: str) -> None:
    """A NaN key makes every row that sees it NaN, for every kind."""
    k = torch.rand(1, 1, 50, 4)
    k[0, 0, 3, 0] = float("nan")
    got = torch_ext.attention_sparsity(torch.ones(1, 1, 2, 4, device=device), k.to(device), kind=kind)
    assert torch.isnan(got).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_nan_query_row_propagates(device: str, kind: str) -> None:
    """A NaN query entry makes its row NaN (every logit of the row is NaN) and no other row."""
    q = torch.rand(1, 1, 3, 4)
    q[0, 0, 1, 2] = float("nan")
    got = torch_ext.attention_sparsity(q.to(device), torch.rand(1, 1, 50, 4).to(device), kind=kind).cpu()
    assert torch.isnan(got[0, 0, 1])
    assert torch.isfinite(got[0, 0, [0, 2]]).all()


KEY_SOURCE_CASES = {  # B, H, Hkv, Lq, Lk, causal, left window (or None), K stored transposed
    # 9 heads on 2 or 3 threads: a thread's run of tasks starts inside a head and goes on to the
    # next head of the same group, whose first tiles reach keys below those it converted first
    "gqa_window": (1, 9, 3, 700, 700, True, 40, False),
    "batch_of_heads": (3, 4, 4, 130, 1100, False, None, False),
    # one (batch, kv head) pair: K^T converted whole before the tasks on 2 or more threads
    "mqa_causal": (1, 4, 1, 600, 600, True, None, False),
    # K's rows not contiguous: K^T read in place (float32, float64) or converted whole (16-bit)
    "key_stored_transposed": (2, 4, 2, 200, 333, True, None, True),
}  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize("case", list(KEY_SOURCE_CASES))
def test_cpu_key_sources(dtype: torch.dtype, threads: int, case: str) -> None:
    """The CPU kernel's tasks read their query rows as given and K^T from their thread's buffers,
    converted once per run of tasks, where there are at least as many (batch, kv head) pairs as
    threads, and from one whole K^T (read in place where K is stored transposed in the
    accumulation type) where there are fewer (csrc/cpu/attention_sparsity.cpp, thread_keys.h):
    every kind against the reference on 1-4 threads, with a NaN in a key that no row sees, which
    the conversion reads but no row's sums may."""
    B, H, Hkv, Lq, Lk, causal, left, key_transposed = KEY_SOURCE_CASES[case]
    g = torch.Generator().manual_seed(Lq + Lk)
    q = torch.randn(B, H, Lq, 16, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(B, Hkv, Lk, 16, generator=g, dtype=torch.float64).to(dtype)
    if key_transposed:
        k = k.transpose(2, 3).contiguous().transpose(2, 3)
    allowed = torch.ones(Lq, Lk, dtype=torch.bool)
    if left is not None:  # (the window as the reference's mask; causality is passed to both)
        allowed &= torch.ones(Lq, Lk, dtype=torch.bool).triu(-left)
    hidden = 5  # a key no row sees, in the first block
    allowed[:, hidden] = False
    k_bad = k.clone()
    k_bad[:, :, hidden] = float("nan")
    mask = torch.ones(1, 1, 1, Lk, dtype=torch.bool)
    mask[..., hidden] = False
    window = (-1, -1) if left is None else (left, 0)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = {kind: torch_ext.attention_sparsity(q, k_bad, mask, kind=kind, is_causal=causal,
                                                  window_size=window, enable_gqa=True)
               for kind in KINDS}  # fmt: skip
    finally:
        torch.set_num_threads(previous)
    atol, rtol = STAT_TOL[dtype] if dtype != torch.float64 else (1e-10, 1e-10)
    for kind in KINDS:
        want = reference_sparsity(q, k, allowed, kind, causal, 0.25, group=H // Hkv)
        assert_close64(got[kind], want, atol, rtol, name=f"{case} {kind}")
