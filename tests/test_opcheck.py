"""torch.library.opcheck on every registered op (schema, autograd registration, fake tensor, AOT),
on every device (the CUDA variants skip with "no CUDA device" where there is none)."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import pytest
import torch
from torch import Tensor

import torch_ext  # noqa: F401  (registers torch.ops.entropy_attn)
from conftest import to_device

ops = torch.ops.entropy_attn
F64 = torch.float64


def _r(*shape: int, dtype: torch.dtype = torch.float32, rg: bool = False) -> Tensor:
    return torch.randn(*shape, dtype=dtype).requires_grad_(rg)


def attention_samples() -> List[Tuple[str, Tuple[Any, ...], Dict[str, Any]]]:
    """(id, args, kwargs) samples for entropy_attn.attention."""
    torch.manual_seed(0)
    out: List[Tuple[str, Tuple[Any, ...], Dict[str, Any]]] = []
    for rg in (False, True):
        sfx = "_grad" if rg else ""
        out.append(("plain" + sfx, (_r(2, 2, 5, 8, rg=rg), _r(2, 2, 7, 8, rg=rg), _r(2, 2, 7, 4, rg=rg)), {}))
        m = torch.rand(5, 7) < 0.6
        m[2] = False
        out.append(
            (
                "bool_mask_causal" + sfx,
                (_r(1, 2, 5, 8, rg=rg), _r(1, 2, 7, 8, rg=rg), _r(1, 2, 7, 8, rg=rg), m),
                {"is_causal": True},
            )
        )
        fm = torch.randn(1, 1, 5, 7, dtype=F64).masked_fill(torch.rand(1, 1, 5, 7) < 0.3, float("-inf"))
        out.append(
            (
                "float_mask_f64" + sfx,
                (_r(1, 2, 5, 4, dtype=F64, rg=rg), _r(1, 2, 7, 4, dtype=F64, rg=rg), _r(1, 2, 7, 3, dtype=F64, rg=rg), fm),
                {"scale_factor": 0.3, "temperature": 2.0},
            )
        )
        out.append(
            (
                "gqa_logn" + sfx,
                (_r(1, 4, 6, 8, rg=rg), _r(1, 2, 9, 8, rg=rg), _r(1, 2, 9, 8, rg=rg)),
                {"enable_gqa": True, "scale_mode": "logn", "log_base": 16.0},
            )
        )
        out.append(
            (
                "scale_tensor_sharpen" + sfx,
                (_r(2, 2, 5, 8, rg=rg), _r(2, 2, 7, 8, rg=rg), _r(2, 2, 7, 8, rg=rg), None, (torch.rand(2, 1) + 0.1).requires_grad_(rg)),
                {"scale_mode": "logn_sharpen", "log_base": 2.0, "is_causal": True},
            )
        )
        out.append(
            (
                "no_stats_mask_causal" + sfx,
                (_r(1, 2, 5, 8, rg=rg), _r(1, 2, 7, 8, rg=rg), _r(1, 2, 7, 8, rg=rg), m),
                {"is_causal": True, "return_stats": False},
            )
        )
        out.append(
            (
                "window_softcap_sinks" + sfx,
                (_r(1, 2, 5, 8, rg=rg), _r(1, 2, 9, 8, rg=rg), _r(1, 2, 9, 4, rg=rg)),
                {
                    "is_causal": True,
                    "window_size": [3, -1],
                    "causal_alignment": "bottom_right",
                    "softcap": 2.0,
                    "sinks": _r(2, rg=rg),
                },
            )
        )
        out.append(
            (
                "dropout" + sfx,
                (_r(2, 2, 5, 8, rg=rg), _r(2, 2, 7, 8, rg=rg), _r(2, 2, 7, 8, rg=rg)),
                {"dropout_p": 0.2, "dropout_seed": 42, "window_size": [2, 2]},
            )
        )
        # a query split from a (B, L, H * D) projection: the output in its layout
        out.append(
            (
                "query_heads_inside_rows" + sfx,
                (_r(2, 5, 3, 8).transpose(1, 2).requires_grad_(rg), _r(2, 3, 7, 8, rg=rg), _r(2, 3, 7, 4, rg=rg)),
                {"is_causal": True},
            )
        )
        out.append(
            (
                "lk_zero" + sfx,
                (_r(1, 2, 3, 8, rg=rg), _r(1, 2, 0, 8, rg=rg), _r(1, 2, 0, 8, rg=rg)),
                {},
            )
        )
    out.append(
        (
            "bf16",
            (_r(1, 2, 5, 8).bfloat16(), _r(1, 2, 7, 8).bfloat16(), _r(1, 2, 7, 8).bfloat16()),
            {"is_causal": True},
        )
    )
    out.append(("fp16_grad", tuple(x.half().requires_grad_() for x in (_r(1, 1, 4, 8), _r(1, 1, 6, 8), _r(1, 1, 6, 8))), {}))
    return out


ATT_SAMPLES = attention_samples()


@pytest.mark.parametrize("sample", ATT_SAMPLES, ids=[s[0] for s in ATT_SAMPLES])
def test_opcheck_attention(device: str, sample: Tuple[str, Tuple[Any, ...], Dict[str, Any]]) -> None:
    """opcheck entropy_attn.attention (schema, autograd registration, fake tensors, AOT dispatch)."""
    _, args, kwargs = sample
    torch.library.opcheck(ops.attention.default, to_device(args, device), to_device(kwargs, device))


BW_CONFIGS: List[Tuple[str, Tuple[int, ...], str, bool, Dict[str, Any]]] = [
    ("plain", (2, 2, 2, 5, 7), "none", False, {}),
    ("mask_causal_stats", (1, 2, 2, 6, 6), "bool", True, {"stats": True}),
    ("gqa_f64_stats", (1, 4, 2, 5, 8), "none", False, {"stats": True, "dtype": F64, "gqa": True}),
    ("float_mask_scale", (1, 2, 2, 5, 7), "float", True, {"scale": True}),
    ("lk_zero", (1, 2, 2, 3, 0), "none", False, {"stats": True}),
]


def backward_args(
    config: Tuple[str, Tuple[int, ...], str, bool, Dict[str, Any]], device: str = "cpu"
) -> Tuple[Any, ...]:
    """Arguments for entropy_attn.attention_backward built from a real forward call on `device`."""
    _, (B, H, Hkv, Lq, Lk), mask_kind, causal, opt = config
    dt = opt.get("dtype", torch.float32)
    q, k, v = _r(B, H, Lq, 8, dtype=dt), _r(B, Hkv, Lk, 8, dtype=dt), _r(B, Hkv, Lk, 4, dtype=dt)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(Lq, Lk) < 0.6
        mask[1] = False
    elif mask_kind == "float":
        mask = torch.zeros(Lq, Lk, dtype=dt).masked_fill(torch.rand(Lq, Lk) < 0.3, float("-inf"))
    scale = (torch.rand(B, H, Lq, dtype=dt) + 0.1) if opt.get("scale") else None
    q, k, v, mask, scale = to_device((q, k, v, mask, scale), device)
    o, lse, ent, sp2, _, _, rs = ops.attention(q, k, v, mask, scale, is_causal=causal, enable_gqa=opt.get("gqa", False))[:7]
    go = torch.randn_like(o)
    if opt.get("stats"):
        gl, ge, gp = torch.randn_like(lse), torch.randn_like(ent), torch.randn_like(sp2)
    else:
        gl = ge = gp = None
    return (go, gl, ge, gp, q, k, v, mask, o, lse, ent, sp2, rs, causal)


@pytest.mark.parametrize("config", BW_CONFIGS, ids=[c[0] for c in BW_CONFIGS])
def test_opcheck_attention_backward(device: str, config: Tuple[str, Tuple[int, ...], str, bool, Dict[str, Any]]) -> None:
    """opcheck entropy_attn.attention_backward on inputs from real forward calls."""
    torch.library.opcheck(ops.attention_backward.default, backward_args(config, device))


@pytest.mark.parametrize("config", BW_CONFIGS[:2], ids=[c[0] for c in BW_CONFIGS[:2]])
def test_opcheck_attention_backward_without_grad_scale(device: str, config: Tuple[str, Tuple[int, ...], str, bool, Dict[str, Any]]) -> None:
    """opcheck entropy_attn.attention_backward with grad_scale=False (grad_row_scale empty)."""
    torch.library.opcheck(ops.attention_backward.default, backward_args(config, device), {"grad_scale": False})


@pytest.mark.parametrize("config", BW_CONFIGS, ids=[c[0] for c in BW_CONFIGS])
def test_opcheck_attention_grad(device: str, config: Tuple[str, Tuple[int, ...], str, bool, Dict[str, Any]]) -> None:
    """opcheck entropy_attn.attention_grad (the autograd functions' backward) on a real forward's
    outputs, with upstream gradients of every differentiable output and every input gradient asked."""
    go, gl, ge, gp, q, k, v, mask, o, lse, ent, sp2, rs, causal = backward_args(config, device)
    _, (B, H, _, Lq, _), _, _, opt = config
    scale = (torch.rand(B, H, Lq, dtype=q.dtype, device=device) + 0.1) if opt.get("scale") else None
    res = ops.attention(q, k, v, mask, scale, is_causal=causal, enable_gqa=opt.get("gqa", False))
    stats = opt.get("stats", False)
    derived = tuple(torch.randn_like(t) if stats else None for t in res[8:])
    args = (go, gl, ge, gp, *derived, q, k, v, mask, scale, None, *res[:4], res[5], res[6], res[7], causal, True)
    torch.library.opcheck(ops.attention_grad.default, args, {"output_mask": [True, True, True]})


@pytest.mark.parametrize("name", ["entropy_backward", "sparsity_backward"])
def test_opcheck_row_reduction_backward(device: str, name: str) -> None:
    """opcheck the row reductions' backward ops."""
    x = to_device(torch.softmax(torch.randn(3, 5, 6, dtype=F64), 1), device)
    torch.library.opcheck(getattr(ops, name).default, (torch.randn_like(x[:, 0]), x, 1))


def stats_samples() -> List[Tuple[str, Tuple[Any, ...]]]:
    """Samples for entropy / sparsity (positive probabilities; signed values for sparsity)."""
    torch.manual_seed(2)
    s: List[Tuple[str, Tuple[Any, ...]]] = []
    for rg in (False, True):
        sfx = "_grad" if rg else ""
        s.append(("2d" + sfx, (torch.softmax(torch.randn(4, 9), -1).requires_grad_(rg),)))
        s.append(("3d_dim1" + sfx, (torch.softmax(torch.randn(3, 5, 6, dtype=F64), 1).requires_grad_(rg), 1)))
        s.append(("dim0" + sfx, (torch.rand(7, 3).add(0.01).requires_grad_(rg), 0)))
    s.append(("bf16", (torch.softmax(torch.randn(4, 9), -1).bfloat16(),)))
    s.append(("fp16_neg_dim", (torch.rand(2, 3, 4).half(), -2)))
    return s


ST_SAMPLES = stats_samples()


@pytest.mark.parametrize("sample", ST_SAMPLES, ids=[s[0] for s in ST_SAMPLES])
def test_opcheck_entropy(device: str, sample: Tuple[str, Tuple[Any, ...]]) -> None:
    """opcheck entropy_attn.entropy."""
    torch.library.opcheck(ops.entropy.default, to_device(sample[1], device))


@pytest.mark.parametrize("sample", ST_SAMPLES, ids=[s[0] for s in ST_SAMPLES])
def test_opcheck_sparsity(device: str, sample: Tuple[str, Tuple[Any, ...]]) -> None:
    """opcheck entropy_attn.sparsity (inputs made signed)."""
    args = list(to_device(sample[1], device))
    x = args[0].detach()
    signed = (x - x.mean()).requires_grad_(args[0].requires_grad)
    args[0] = signed
    torch.library.opcheck(ops.sparsity.default, tuple(args))


@pytest.mark.parametrize("mode", ["fixed", "logn", "logn_sharpen"])
def test_opcheck_length_factor(device: str, mode: str) -> None:
    """length_factor: schema, fake tensor (Meta) and dispatch checks on int64 and int32 counts."""
    for n, dtype in ((torch.tensor([0, 1, 7, 512, 4096]), torch.float32), (torch.arange(6, dtype=torch.int32), torch.float64)):
        torch.library.opcheck(ops.length_factor.default, (to_device(n, device), mode, 2.0, 64.0), {"dtype": dtype})


ALL_OPS = ("attention", "attention_backward", "entropy", "sparsity", "attention_sparsity", "length_factor")
# Composites of those (CompositeImplicitAutograd: one kernel for every device and for Meta).
COMPOSITE_OPS = ("attention_grad", "entropy_backward", "sparsity_backward", "varlen_attention")


def test_all_ops_registered(device: str) -> None:
    """The ops exist with a kernel for the device and a Meta kernel (needed for fake tensors).

    (attention_sparsity's opcheck is in test_attention_sparsity.py.)"""
    key = "CUDA" if device == "cuda" else "CPU"
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    for name in ALL_OPS:
        op = getattr(ops, name).default
        # length_factor has one device-independent kernel (CompositeExplicitAutograd) for all keys.
        composite = has(op.name(), "CompositeExplicitAutograd")
        assert composite or has(op.name(), key), f"{name}: no {key} kernel"
        assert composite or has(op.name(), "Meta"), name
    for name in COMPOSITE_OPS:
        assert has(getattr(ops, name).default.name(), "CompositeImplicitAutograd"), name


def test_import_standalone() -> None:
    """`import torch_ext` works in a fresh interpreter without importing torch first."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-c", "import torch_ext; print(torch_ext.attention)"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
