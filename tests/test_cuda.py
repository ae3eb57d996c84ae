"""CUDA kernels against the CPU kernels and the float64 reference, plus what only a GPU has.

Every test here needs a CUDA device and skips with "no CUDA device" without one (module-level
``pytestmark``). The rest of the suite also runs its device-parametrized tests on CUDA; this file
adds what those do not cover:

* CPU-vs-CUDA agreement of all 8 outputs of ``entropy_attn.attention`` and the 4 gradients of
  ``entropy_attn.attention_backward`` (with upstream gradients of lse / entropy / sum_p2), each
  also checked against the float64 reference (``reference.py``), over dtypes, head dims up to 256,
  Dv != D, lengths that are not multiples of any tile size, causal with Lq < Lk and Lq > Lk,
  bool / additive / broadcast masks with fully masked rows, GQA, scale tensors, the log-n scale
  modes and temperature;
* the row reductions ``entropy`` / ``sparsity`` and the fused ``attention_sparsity``;
* non-contiguous and misaligned inputs, a second GPU (device guard), a non-default stream, the
  CUDA-only limits (head_dim > 256; float64 with a head dim > 128), mixed devices, grids with
  B*H > 65535, a long sequence against SDPA (and without an L x L buffer), NaN propagation.

Inputs are drawn on the CPU (same values on both devices); the CPU op and the reference run on
the CPU copies. 16-bit CUDA kernels round P to the input dtype before P.V (as FlashAttention
does), so they are held to the same per-dtype tolerances as the CPU kernels (conftest), which
leave room for that rounding.

Dry run of this file's logic without a GPU (CPU kernels compared with themselves; the tests that
need real CUDA features still skip): ``ENTROPY_ATTN_CUDA_TEST_DEVICE=cpu pytest tests/test_cuda.py``.
"""

from __future__ import annotations

import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import torch_ext
from torch_ext import _build_info
from conftest import GRAD_TOL, HAS_CUDA, NO_CUDA_REASON, OUT_TOL, STAT_TOL, assert_close64, rel_err, stat_dtype
from reference import reference_attention_raw, reference_entropy, reference_sparsity
from test_attention_forward import MASK_KINDS, make_mask, make_scale
from test_attention_sparsity import reference_sparsity as reference_attention_sparsity

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
# torch.use_deterministic_algorithms(on) for a block, the setting and its warn_only restored after
from timing import deterministic_algorithms as torch_deterministic  # noqa: E402  (benchmarks/timing.py)

#: The device under test: "cuda", or "cpu" for a dry run of the test logic (see the docstring).
DEV = torch.device(os.environ.get("ENTROPY_ATTN_CUDA_TEST_DEVICE", "cuda"))
DRY_RUN = DEV.type != "cuda"

pytestmark = [
    pytest.mark.skipif(not HAS_CUDA and not DRY_RUN, reason=NO_CUDA_REASON),
    pytest.mark.cuda,
]
#: For tests that exercise CUDA itself (streams, devices, CUDA-only limits, memory).
real_cuda = pytest.mark.skipif(DRY_RUN or not HAS_CUDA, reason=NO_CUDA_REASON)

F64 = torch.float64
ALL_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
HALF_DTYPES = [torch.bfloat16, torch.float16]
OUT_NAMES = (
    "output", "lse", "entropy", "sum_p2", "max_weight", "n_keys", "row_scale", "length_factor",
    "normalized_entropy", "sparsity", "effective_keys",
)
GRAD_NAMES = ("grad_query", "grad_key", "grad_value", "grad_row_scale")


#: The CUDA kernels' documented limits.
CUDA_MAX_HEAD_DIM = 256
CUDA_MAX_HEAD_DIM_F64 = 128


def OP(*args: Any, **kwargs: Any) -> Tuple[Tensor, ...]:
    """torch.ops.entropy_attn.attention."""
    return torch.ops.entropy_attn.attention(*args, **kwargs)


def BW(*args: Any) -> Tuple[Tensor, ...]:
    """torch.ops.entropy_attn.attention_backward."""
    return torch.ops.entropy_attn.attention_backward(*args)


def dtype_id(dtype: torch.dtype) -> str:
    """Short test id of a dtype."""
    return str(dtype).replace("torch.", "")


def supported(dtype: torch.dtype, D: int, Dv: Optional[int] = None) -> bool:
    """Whether the CUDA kernels accept this dtype and head dims."""
    m = max(D, D if Dv is None else Dv)
    return m <= (CUDA_MAX_HEAD_DIM_F64 if dtype == F64 else CUDA_MAX_HEAD_DIM)


def cuda(x: Any) -> Any:
    """The tensor on the device under test (None and non-tensors are kept)."""
    return x.to(DEV) if isinstance(x, Tensor) else x


def randn(*shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> Tensor:
    """N(0, scale^2) on the CPU, drawn in float64 then cast (same values for every dtype)."""
    return (scale * torch.randn(*shape, dtype=F64)).to(dtype)


def make_qkv(
    B: int, H: int, Hkv: int, Lq: int, Lk: int, D: int, Dv: Optional[int] = None, dtype: torch.dtype = torch.float32
) -> Tuple[Tensor, Tensor, Tensor]:
    """CPU query/key/value in the op's layout."""
    Dv = D if Dv is None else Dv
    return randn(B, H, Lq, D, dtype=dtype), randn(B, Hkv, Lk, D, dtype=dtype), randn(B, Hkv, Lk, Dv, dtype=dtype)


def leaf64(x: Tensor) -> Tensor:
    """Detached float64 CPU leaf that requires grad."""
    return x.detach().to("cpu", F64).requires_grad_()


def grads_of(outputs: Sequence[Tensor], upstream: Sequence[Optional[Tensor]], inputs: Sequence[Tensor]) -> List[Tensor]:
    """d/d inputs of sum_i <outputs_i, upstream_i> (None upstream: unused); zeros for unused inputs."""
    loss = sum((o * u.to(o.dtype)).sum() for o, u in zip(outputs, upstream) if u is not None)
    gs = torch.autograd.grad(loss, list(inputs), allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(gs, inputs)]


# ----------------------------------------------------------------------------------------
# forward: all 11 outputs on both devices and the reference
# ----------------------------------------------------------------------------------------
def compare_forward(
    cu: Sequence[Tensor],
    cpu: Sequence[Tensor],
    ref: Any,
    dtype: torch.dtype,
    *,
    sharpen: bool = False,
    tol_scale: float = 1.0,
) -> None:
    """All 11 outputs: device, dtype and shape as on the CPU; n_keys exact; values against the
    reference (the dtype's tolerance) and against the CPU kernel (twice that: both may err)."""
    assert len(cu) == 11, f"attention returned {len(cu)} outputs"
    for name, a, b in zip(OUT_NAMES, cu, cpu):
        assert a.device.type == DEV.type, f"{name} on {a.device}"
        assert a.dtype == b.dtype, f"{name}: dtype {a.dtype} (CPU: {b.dtype})"
        assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)} (CPU: {tuple(b.shape)})"
        if a.is_floating_point():
            assert not torch.isnan(a).any(), f"{name}: NaN"
    assert torch.equal(cpu[5], ref.n_keys), "n_keys (CPU) != reference"
    assert torch.equal(cu[5].cpu(), cpu[5]), "n_keys (CUDA) != CPU"

    oat, ort = (t * tol_scale for t in OUT_TOL[dtype])
    sat, srt = (t * tol_scale for t in STAT_TOL[dtype])
    assert_close64(cu[0], ref.output, oat, ort, "output vs reference")
    assert_close64(cu[0], cpu[0], 2 * oat, 2 * ort, "output vs CPU")
    for i, refv in ((1, ref.lse), (2, ref.entropy), (3, ref.sum_p2), (4, ref.max_weight)):
        assert_close64(cu[i], refv, sat, srt, f"{OUT_NAMES[i]} vs reference")
        assert_close64(cu[i], cpu[i], 2 * sat, 2 * srt, f"{OUT_NAMES[i]} vs CPU")
    # row_scale / length_factor: the same closed form on both devices (float32 or float64).
    has = ref.n_keys > 0
    ftol = 1e-12 if dtype == F64 else 2e-6
    for i, refv in ((6, ref.row_scale), (7, ref.length_factor)):
        a = cu[i].cpu()
        if sharpen:  # the reference's empty-row convention differs under logn_sharpen
            assert_close64(a[has], refv[has], sat, srt, f"{OUT_NAMES[i]} vs reference")
        else:
            assert_close64(a, refv, sat, srt, f"{OUT_NAMES[i]} vs reference")
        assert_close64(a, cpu[i], ftol, ftol, f"{OUT_NAMES[i]} vs CPU")
    # rows with no key: output 0 and statistics 0 (exactly, as on the CPU)
    empty = ~has
    if empty.any():
        e = empty.to(cu[0].device)
        assert (cu[0][e] == 0).all(), "output nonzero on a fully masked row"
        for i in (1, 2, 3, 4, 8, 9, 10):
            assert (cu[i][e] == 0).all(), f"{OUT_NAMES[i]} nonzero on a fully masked row"
    # The derived statistics: as the CPU kernel's epilogue writes them (the same formulas).
    for i in (8, 9, 10):
        scale_i = cpu[i].abs().clamp_min(1.0) if i == 10 else 1.0  # effective keys reach n
        assert_close64(cu[i].cpu() / scale_i, cpu[i] / scale_i, 2 * sat, 2 * srt, f"{OUT_NAMES[i]} vs CPU")


def check_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Optional[Tensor] = None,
    scale: Optional[Tensor] = None,
    *,
    tol_scale: float = 1.0,
    **kw: Any,
) -> Tuple[Tuple[Tensor, ...], Tuple[Tensor, ...], Any]:
    """Run the raw op on CPU inputs and on their device copies; compare with each other and the
    reference. Returns (device outputs, CPU outputs, reference)."""
    cpu = OP(q, k, v, mask, scale, **kw)
    cu = OP(cuda(q), cuda(k), cuda(v), cuda(mask), cuda(scale), **kw)
    ref = reference_attention_raw(q, k, v, mask, scale, **kw)
    compare_forward(cu, cpu, ref, q.dtype, sharpen=kw.get("scale_mode") == "logn_sharpen", tol_scale=tol_scale)
    return cu, cpu, ref


HEAD_DIMS = [8, 16, 40, 64, 80, 96, 128, 160, 256]
HEAD_DIM_CASES = [(dt, D) for dt in ALL_DTYPES for D in HEAD_DIMS if supported(dt, D)]


@pytest.mark.parametrize("dtype,D", HEAD_DIM_CASES, ids=[f"{dtype_id(dt)}-D{D}" for dt, D in HEAD_DIM_CASES])
@pytest.mark.parametrize("variant", ["plain", "causal_mask"])
def test_forward_head_dims(dtype: torch.dtype, D: int, variant: str) -> None:
    """Every supported head dim and dtype: plain (Lq < Lk) and causal with a key-padding mask
    (Lq > Lk, fully masked rows)."""
    if variant == "plain":
        q, k, v = make_qkv(2, 3, 3, 63, 257, D, dtype=dtype)
        check_forward(q, k, v)
    else:
        q, k, v = make_qkv(2, 3, 3, 130, 65, D, dtype=dtype)
        mask = make_mask("bool_rows_masked", 2, 3, 130, 65)
        check_forward(q, k, v, mask, is_causal=True)


DV_PAIRS = [(64, 128), (128, 64), (40, 80), (16, 256), (256, 16), (96, 8), (8, 160), (80, 40), (1, 1), (3, 5)]
DV_CASES = [(dt, D, Dv) for dt in ALL_DTYPES for D, Dv in DV_PAIRS if supported(dt, D, Dv)]


@pytest.mark.parametrize(
    "dtype,D,Dv", DV_CASES, ids=[f"{dtype_id(dt)}-D{D}-Dv{Dv}" for dt, D, Dv in DV_CASES]
)
def test_forward_dv_ne_d(dtype: torch.dtype, D: int, Dv: int) -> None:
    """Value head dim different from the query/key head dim (incl. tiny and odd dims), causal, GQA."""
    q, k, v = make_qkv(2, 4, 2, 65, 130, D, Dv, dtype=dtype)
    check_forward(q, k, v, is_causal=True, enable_gqa=True)


LENGTHS = [1, 17, 63, 65, 130, 257, 1000]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("Lk", LENGTHS)
@pytest.mark.parametrize("Lq", LENGTHS)
def test_forward_lengths(dtype: torch.dtype, causal: bool, Lq: int, Lk: int) -> None:
    """Every (Lq, Lk) pair of lengths that are not multiples of tile sizes, causal (Lq < Lk and
    Lq > Lk) and not, D = 64."""
    q, k, v = make_qkv(1, 2, 2, Lq, Lk, 64, dtype=dtype)
    check_forward(q, k, v, is_causal=causal)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64], ids=dtype_id)
@pytest.mark.parametrize("Lq,Lk", [(1, 1000), (1000, 1), (17, 1000), (1000, 1000), (257, 63), (5, 0), (0, 5)])
def test_forward_lengths_more_dtypes(dtype: torch.dtype, Lq: int, Lk: int) -> None:
    """Long / degenerate lengths in float16 and float64 (Lk = 0: zero output; Lq = 0: empty)."""
    q, k, v = make_qkv(1, 2, 2, Lq, Lk, 128, 64, dtype=dtype)
    check_forward(q, k, v, is_causal=True)
    check_forward(q, k, v)




@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_forward_masks(dtype: torch.dtype, causal: bool, kind: str) -> None:
    """Bool / additive masks of every rank, broadcast, with fully masked rows, alone and with causal."""
    B, H, Lq, Lk = 2, 4, 130, 257
    q, k, v = make_qkv(B, H, H, Lq, Lk, 64, dtype=dtype)
    mask = make_mask(kind, B, H, Lq, Lk, dtype=dtype)
    check_forward(q, k, v, mask, is_causal=causal)


def test_forward_all_masked_and_lk_zero() -> None:
    """A mask hiding every key, and Lk = 0: all outputs zero on both devices."""
    q, k, v = make_qkv(2, 2, 2, 17, 33, 64, dtype=torch.bfloat16)
    cu, _, _ = check_forward(q, k, v, torch.zeros(17, 33, dtype=torch.bool))
    assert (cu[0] == 0).all() and (cu[5] == 0).all()
    q, k, v = make_qkv(2, 2, 2, 17, 0, 64, 32, dtype=torch.float32)
    cu, _, _ = check_forward(q, k, v, is_causal=True)
    assert cu[0].shape == (2, 2, 17, 32) and (cu[0] == 0).all()


GQA_CASES = [(4, 2), (6, 1), (8, 2), (16, 4), (12, 3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("H,Hkv", GQA_CASES)
@pytest.mark.parametrize("variant", ["plain", "mask", "causal_logn"])
def test_forward_gqa(dtype: torch.dtype, H: int, Hkv: int, variant: str) -> None:
    """Grouped-query attention (query head h uses kv head h // (H // Hkv))."""
    B, Lq, Lk = 2, 65, 130
    q, k, v = make_qkv(B, H, Hkv, Lq, Lk, 64, 32, dtype=dtype)
    kw: Dict[str, Any] = {"enable_gqa": True}
    mask = None
    if variant == "mask":
        mask = make_mask("bool4d", B, H, Lq, Lk)
    elif variant == "causal_logn":
        kw.update(is_causal=True, scale_mode="logn", log_base=64.0)
    check_forward(q, k, v, mask, **kw)


SCALE_KINDS = ["none", "float", "t_H1", "t_BHLq", "t_1", "t_0d", "t_Lq", "t_B11"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("scale_mode", ["fixed", "logn", "logn_sharpen"])
@pytest.mark.parametrize("scale_kind", SCALE_KINDS)
@pytest.mark.parametrize("temperature", [1.0, 0.5, 3.0])
def test_forward_scales(dtype: torch.dtype, scale_mode: str, scale_kind: str, temperature: float) -> None:
    """Scale tensor (every broadcast shape) or factor x scale mode x temperature, with per-row n_i
    varying (mask with empty rows, causal)."""
    B, H, Lq, Lk = 2, 3, 70, 90
    q, k, v = make_qkv(B, H, H, Lq, Lk, 32, dtype=dtype)
    mask = make_mask("bool_rows_masked", B, H, Lq, Lk)
    factor = 0.37 if scale_kind == "float" else None
    scale = None
    if scale_kind.startswith("t_"):
        scale = make_scale(scale_kind, B, H, Lq, "cpu", dtype=F64 if dtype == F64 else torch.float32)
    check_forward(
        q,
        k,
        v,
        mask,
        scale,
        is_causal=True,
        scale_factor=factor,
        scale_mode=scale_mode,
        temperature=temperature,
        log_base=16.0,
    )


@pytest.mark.parametrize("scale_dtype", [torch.float64, torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_forward_scale_tensor_other_dtype(dtype: torch.dtype, scale_dtype: torch.dtype) -> None:
    """A scale tensor whose dtype differs from the inputs' is accepted and gives the same result."""
    q, k, v = make_qkv(2, 4, 4, 33, 65, 64, dtype=dtype)
    scale = make_scale("t_H1", 2, 4, 33, "cpu", dtype=scale_dtype)
    check_forward(q, k, v, None, scale, scale_mode="logn_sharpen", log_base=8.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=dtype_id)
def test_forward_huge_logits(dtype: torch.dtype) -> None:
    """|s| ~ 1e4: finite and equal to the reference (online softmax relative to the running max)."""
    q, k, v = make_qkv(1, 2, 2, 65, 257, 64, dtype=dtype)
    q, k = q * 25, k * 25
    mask = make_mask("bool_rows_masked", 1, 2, 65, 257)
    _, _, ref = check_forward(q, k, v, mask, is_causal=True, scale_factor=0.25)
    assert ref.lse.abs().max() > 3e3, "test does not reach large logits"


# ----------------------------------------------------------------------------------------
# backward: the attention_backward op and autograd, against CPU and the reference
# ----------------------------------------------------------------------------------------
def check_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Optional[Tensor] = None,
    scale: Optional[Tensor] = None,
    *,
    stats_grads: bool = True,
    tol_scale: float = 1.0,
    **kw: Any,
) -> Tuple[Tensor, ...]:
    """attention_backward on each device's own forward outputs, with upstream gradients of the
    output and (stats_grads) of lse, entropy and sum_p2; the 4 gradients against the CPU op's and
    the reference's autograd (relative norm). Returns the device gradients."""
    dtype = q.dtype
    causal = bool(kw.get("is_causal", False))
    cpu = OP(q, k, v, mask, scale, **kw)
    cu = OP(cuda(q), cuda(k), cuda(v), cuda(mask), cuda(scale), **kw)
    go = randn(*cpu[0].shape, dtype=dtype)
    sd = cpu[1].dtype
    gl, ge, gp = (randn(*cpu[i].shape, dtype=sd) if stats_grads else None for i in (1, 2, 3))
    g_cpu = BW(go, gl, ge, gp, q, k, v, mask, cpu[0], cpu[1], cpu[2], cpu[3], cpu[6], causal)
    g_cu = BW(
        cuda(go), cuda(gl), cuda(ge), cuda(gp), cuda(q), cuda(k), cuda(v), cuda(mask),
        cu[0], cu[1], cu[2], cu[3], cu[6], causal,
    )  # fmt: skip
    # grad_sinks and grad_attn_mask: empty without sinks and grad_mask
    assert len(g_cu) == 6 and g_cu[4].numel() == 0 and g_cu[5].numel() == 0
    g_cu, g_cpu = g_cu[:4], g_cpu[:4]

    # reference: lambda_i given directly (the row_scale the CPU op used), scale_mode "fixed"
    rin = [leaf64(q), leaf64(k), leaf64(v), leaf64(cpu[6])]
    r = reference_attention_raw(
        rin[0], rin[1], rin[2], mask, rin[3], is_causal=causal, enable_gqa=bool(kw.get("enable_gqa", False))
    )
    g_ref = grads_of([r.output, r.lse, r.entropy, r.sum_p2], [go, gl, ge, gp], rin)

    tol = GRAD_TOL[dtype] * tol_scale
    for name, a, b, e, x in zip(GRAD_NAMES, g_cu, g_cpu, g_ref, (q, k, v, cpu[6])):
        assert a.device.type == DEV.type, f"{name} on {a.device}"
        assert a.shape == x.shape, f"{name}: shape {tuple(a.shape)} != {tuple(x.shape)}"
        assert a.dtype == b.dtype, f"{name}: dtype {a.dtype} (CPU: {b.dtype})"
        assert torch.isfinite(a).all(), f"{name} not finite"
        err = rel_err(a, e)
        assert err < tol, f"{name}: relative error {err:.3g} vs reference (tol {tol:.3g})"
        err = rel_err(a, b)
        assert err < 2 * tol, f"{name}: relative error {err:.3g} vs CPU (tol {2 * tol:.3g})"
    # fully masked rows: zero query and row-scale gradients
    empty = (r.n_keys == 0).to(g_cu[0].device)
    if empty.any():
        assert (g_cu[0][empty] == 0).all(), "grad_query nonzero on a fully masked row"
        assert (g_cu[3][empty] == 0).all(), "grad_row_scale nonzero on a fully masked row"
    return g_cu


BW_HEAD_DIM_CASES = [(dt, D) for dt in ALL_DTYPES for D in (16, 40, 64, 96, 128, 160, 256) if supported(dt, D)]


@pytest.mark.parametrize("dtype,D", BW_HEAD_DIM_CASES, ids=[f"{dtype_id(dt)}-D{D}" for dt, D in BW_HEAD_DIM_CASES])
@pytest.mark.parametrize("stats_grads", [True, False], ids=["all_grads", "output_grad"])
def test_backward_head_dims(dtype: torch.dtype, D: int, stats_grads: bool) -> None:
    """Every supported head dim and dtype, causal Lq > Lk with a mask (empty rows), a per-row scale."""
    B, H, Lq, Lk = 2, 3, 130, 65
    q, k, v = make_qkv(B, H, H, Lq, Lk, D, dtype=dtype)
    mask = make_mask("bool_rows_masked", B, H, Lq, Lk)
    scale = make_scale("t_BHLq", B, H, Lq, "cpu", dtype=stat_dtype(dtype))
    check_backward(q, k, v, mask, scale, stats_grads=stats_grads, is_causal=True)


BW_DV_CASES = [(dt, D, Dv) for dt in ALL_DTYPES for D, Dv in DV_PAIRS if supported(dt, D, Dv)]


@pytest.mark.parametrize(
    "dtype,D,Dv", BW_DV_CASES, ids=[f"{dtype_id(dt)}-D{D}-Dv{Dv}" for dt, D, Dv in BW_DV_CASES]
)
def test_backward_dv_ne_d(dtype: torch.dtype, D: int, Dv: int) -> None:
    """Dv != D with GQA (dK / dV summed over the query heads of a group) and causal."""
    q, k, v = make_qkv(2, 4, 2, 65, 130, D, Dv, dtype=dtype)
    check_backward(q, k, v, is_causal=True, enable_gqa=True)


BW_LENGTHS = [(1, 1), (1, 1000), (1000, 1), (17, 63), (63, 17), (65, 130), (130, 65), (257, 1000), (1000, 257), (1000, 1000)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("Lq,Lk", BW_LENGTHS)
def test_backward_lengths(dtype: torch.dtype, causal: bool, Lq: int, Lk: int) -> None:
    """Lengths that are not multiples of tile sizes; causal with Lq < Lk and Lq > Lk."""
    q, k, v = make_qkv(1, 2, 2, Lq, Lk, 64, dtype=dtype)
    check_backward(q, k, v, is_causal=causal)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("kind", ["bool_rows_masked", "bool_keypad", "bool1d", "float_inf", "float_rows_masked", "float2d"])
def test_backward_masks(dtype: torch.dtype, kind: str) -> None:
    """Bool / additive broadcast masks with fully masked rows, causal, GQA."""
    B, H, Hkv, Lq, Lk = 2, 4, 2, 130, 257
    q, k, v = make_qkv(B, H, Hkv, Lq, Lk, 64, dtype=dtype)
    mask = make_mask(kind, B, H, Lq, Lk, dtype=dtype)
    check_backward(q, k, v, mask, is_causal=True, enable_gqa=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("H,Hkv", GQA_CASES)
def test_backward_gqa(dtype: torch.dtype, H: int, Hkv: int) -> None:
    """GQA gradients of K / V (reduced over each group of query heads)."""
    q, k, v = make_qkv(2, H, Hkv, 65, 130, 64, 32, dtype=dtype)
    check_backward(q, k, v, make_mask("bool_keypad", 2, H, 65, 130), enable_gqa=True)


AUTOGRAD_CASES: Dict[str, Dict[str, Any]] = {
    "plain": dict(),
    "logn_causal": dict(kw=dict(is_causal=True, scale_mode="logn", log_base=32.0)),
    "sharpen_mask": dict(mask="bool_rows_masked", kw=dict(scale_mode="logn_sharpen", log_base=4.0, temperature=0.7)),
    "scale_H1": dict(scale=(4, 1), kw=dict(is_causal=True, temperature=2.0)),
    "scale_BHLq_logn": dict(scale="BHLq", mask="float_inf", kw=dict(scale_mode="logn", log_base=16.0)),
    "scale_0d_gqa": dict(scale=(), Hkv=2, kw=dict(enable_gqa=True, is_causal=True)),
    "factor_temp": dict(kw=dict(scale_factor=0.2, temperature=0.5)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("name", list(AUTOGRAD_CASES))
def test_autograd_through_op(dtype: torch.dtype, name: str) -> None:
    """Autograd through the raw op (loss on output, lse, entropy, sum_p2) w.r.t. q, k, v and a
    broadcast scale tensor: CUDA vs CPU vs the reference's autograd."""
    case = AUTOGRAD_CASES[name]
    B, H, Lq, Lk, D = 2, 4, 65, 130, 64
    Hkv = case.get("Hkv", H)
    q, k, v = make_qkv(B, H, Hkv, Lq, Lk, D, 48, dtype=dtype)
    mask = make_mask(case["mask"], B, H, Lq, Lk, dtype=dtype) if "mask" in case else None
    kw = dict(case.get("kw", {}))
    scale = None
    if "scale" in case:
        shape = (B, H, Lq) if case["scale"] == "BHLq" else case["scale"]
        scale = (0.05 + 0.2 * torch.rand(shape, dtype=F64)).to(stat_dtype(dtype))
    inputs = [q, k, v] + ([scale] if scale is not None else [])
    upstream: List[Tensor] = []

    def run(xs: List[Tensor], mask_: Optional[Tensor]) -> List[Tensor]:
        s = xs[3] if len(xs) > 3 else None
        outs = OP(xs[0], xs[1], xs[2], mask_, s, **kw)[:4]
        if not upstream:
            upstream.extend(randn(*o.shape, dtype=F64) for o in outs)
        return grads_of(outs, [u.to(o.device) for u, o in zip(upstream, outs)], xs)

    g_cpu = run([x.clone().requires_grad_() for x in inputs], mask)
    g_cu = run([cuda(x).requires_grad_() for x in inputs], cuda(mask))
    rin = [leaf64(x) for x in inputs]
    r = reference_attention_raw(rin[0], rin[1], rin[2], mask, rin[3] if scale is not None else None, **kw)
    g_ref = grads_of([r.output, r.lse, r.entropy, r.sum_p2], upstream, rin)
    tol = GRAD_TOL[dtype]
    for gname, a, b, e, x in zip(("query", "key", "value", "scale"), g_cu, g_cpu, g_ref, inputs):
        assert a.shape == x.shape and a.dtype == x.dtype and a.device.type == DEV.type, gname
        assert torch.isfinite(a).all(), gname
        assert rel_err(a, e) < tol, f"grad {gname}: {rel_err(a, e):.3g} vs reference (tol {tol:.3g})"
        assert rel_err(a, b) < 2 * tol, f"grad {gname}: {rel_err(a, b):.3g} vs CPU (tol {2 * tol:.3g})"


@pytest.mark.parametrize(
    "name",
    ["plain", "bool_mask_empty_rows", "causal_lq_gt_lk", "causal_lq_lt_lk", "gqa_scale", "logn_sharpen", "dv_ne_d"],
)
def test_gradcheck_float64(name: str) -> None:
    """gradcheck (float64) on the device, w.r.t. q, k, v and a scale tensor, of output, lse,
    entropy and sum_p2; lengths beyond one tile of the CUDA kernels (nondet_tol: atomics)."""
    B, H, Hkv, Lq, Lk, D, Dv = 1, 2, 2, 9, 70, 4, 3
    kw: Dict[str, Any] = {}
    mask = None
    with_scale = False
    if name == "bool_mask_empty_rows":
        mask = make_mask("bool_rows_masked", B, H, Lq, Lk)
    elif name == "causal_lq_gt_lk":
        Lq, Lk = 70, 9
        kw["is_causal"] = True
    elif name == "causal_lq_lt_lk":
        kw["is_causal"] = True
    elif name == "gqa_scale":
        H, Hkv, with_scale = 4, 2, True
        kw.update(enable_gqa=True, temperature=0.7)
    elif name == "logn_sharpen":
        with_scale = True
        kw.update(scale_mode="logn_sharpen", log_base=4.0, is_causal=True)
        mask = make_mask("float_rows_masked", B, H, Lq, Lk, dtype=F64)
    elif name == "dv_ne_d":
        D, Dv = 7, 12
    inputs = [cuda(x).requires_grad_() for x in make_qkv(B, H, Hkv, Lq, Lk, D, Dv, dtype=F64)]
    if with_scale:
        inputs.append(cuda(0.3 + torch.rand(H, 1, dtype=F64)).requires_grad_())
    m = cuda(mask)

    def f(*xs: Tensor) -> Tuple[Tensor, ...]:
        return tuple(OP(xs[0], xs[1], xs[2], m, xs[3] if len(xs) > 3 else None, **kw)[:4])

    assert torch.autograd.gradcheck(f, tuple(inputs), eps=1e-6, atol=1e-7, rtol=1e-5, nondet_tol=1e-10)


# ----------------------------------------------------------------------------------------
# row reductions and the fused attention_sparsity
# ----------------------------------------------------------------------------------------
RED_SHAPES = [((1,), -1), ((17,), 0), ((3, 1000), -1), ((1000, 3), 0), ((2, 70000), -1), ((70000, 5), -1),
              ((70000, 5), 0), ((4, 257, 33), 1), ((4, 257, 33), -1), ((2, 0, 5), -1), ((2, 0, 5), 1)]  # fmt: skip
RED_TOL = {F64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape,dim", RED_SHAPES, ids=[f"{'x'.join(map(str, s))}-dim{d}" for s, d in RED_SHAPES])
@pytest.mark.parametrize("op", ["entropy", "sparsity"])
def test_reductions(op: str, dtype: torch.dtype, shape: Tuple[int, ...], dim: int) -> None:
    """entropy / sparsity on the device vs the CPU op and the float64 formula (zeros included)."""
    if op == "entropy":
        x = torch.softmax(2 * torch.randn(shape, dtype=F64), dim=dim) if 0 not in shape else torch.rand(shape, dtype=F64)
        x = x * (torch.rand(shape, dtype=F64) > 0.2)  # exact zeros: 0 ln 0 = 0
        fn, ref = torch_ext.entropy, reference_entropy
    else:
        x = torch.randn(shape, dtype=F64) * (torch.rand(shape, dtype=F64) > 0.2)
        fn, ref = torch_ext.sparsity, reference_sparsity
    x = x.to(dtype)
    got, cpu = fn(cuda(x), dim=dim), fn(x, dim=dim)
    assert got.device.type == DEV.type and got.dtype == cpu.dtype and got.shape == cpu.shape
    t = RED_TOL[dtype]
    assert_close64(got, ref(x, dim), t, t, f"{op} vs formula")
    assert_close64(got, cpu, 2 * t, 2 * t, f"{op} vs CPU")


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=dtype_id)
@pytest.mark.parametrize("op", ["entropy", "sparsity"])
def test_reductions_grad_and_strides(op: str, dtype: torch.dtype) -> None:
    """Gradients and non-contiguous inputs (transposed, sliced) of the row reductions."""
    base = (0.05 + torch.rand(300, 70, dtype=F64)) * torch.where(torch.rand(300, 70) < 0.5, -1.0, 1.0).double()
    if op == "entropy":
        base = base.abs()
    fn = torch_ext.entropy if op == "entropy" else torch_ext.sparsity
    for view in (lambda t: t, lambda t: t.t(), lambda t: t[::3, 1::2]):
        for dim in (0, -1):
            x = view(base.to(dtype))
            xc = view(cuda(base.to(dtype))).requires_grad_()
            xr = view(base.to(dtype)).detach().requires_grad_()
            g = randn(*reduced(x.shape, dim), dtype=dtype)
            (gc,) = torch.autograd.grad((fn(xc, dim=dim) * cuda(g)).sum(), [xc])
            (gr,) = torch.autograd.grad((fn(xr, dim=dim) * g).sum(), [xr])
            assert_close64(fn(xc.detach(), dim=dim), fn(x, dim=dim), 1e-5, 1e-5, f"{op} value")
            assert gc.shape == xc.shape
            assert rel_err(gc, gr) < GRAD_TOL[dtype], f"{op} grad: {rel_err(gc, gr):.3g}"


def reduced(shape: Sequence[int], dim: int) -> Tuple[int, ...]:
    """Shape after reducing `dim`."""
    d = dim % len(shape)
    return tuple(s for i, s in enumerate(shape) if i != d)


SPARSITY_KINDS = ["exp", "relu2", "identity"]


SPARSITY_CASES = [(dt, D) for dt in ALL_DTYPES for D in (8, 64, 128, 256) if supported(dt, D)]


@pytest.mark.parametrize("dtype,D", SPARSITY_CASES, ids=[f"{dtype_id(dt)}-D{D}" for dt, D in SPARSITY_CASES])
@pytest.mark.parametrize("kind", SPARSITY_KINDS)
@pytest.mark.parametrize("variant", ["causal_mask", "additive_gqa_logn"])
def test_attention_sparsity(dtype: torch.dtype, kind: str, D: int, variant: str) -> None:
    """The fused l1/l2 sparsity op: device vs CPU vs the n x n reference."""
    B, H, Lq, Lk = 2, 4, 130, 257
    q = randn(B, H, Lq, D, dtype=dtype, scale=0.5)
    if variant == "causal_mask":
        k = randn(B, H, Lk, D, dtype=dtype, scale=0.5)
        mask = make_mask("bool_rows_masked", B, H, Lq, Lk)
        kw: Dict[str, Any] = dict(is_causal=True, temperature=0.8)
        group = 1
    else:
        k = randn(B, 2, Lk, D, dtype=dtype, scale=0.5)
        mask = make_mask("float_inf", B, H, Lq, Lk, dtype=dtype)
        kw = dict(enable_gqa=True, scale="logn", train_length=64)
        group = 2
    got = torch_ext.attention_sparsity(cuda(q), cuda(k), cuda(mask), kind=kind, **kw)
    cpu = torch_ext.attention_sparsity(q, k, mask, kind=kind, **kw)
    # the op's per-row scale, through the attention op's row_scale output
    _, st = torch_ext.attention(q, k, k, mask, return_stats=True, **kw)
    ref = reference_attention_sparsity(q, k, mask, kind, bool(kw.get("is_causal")), st.scale, group=group)
    assert got.device.type == DEV.type and got.dtype == cpu.dtype and got.shape == (B, H, Lq)
    t = (1e-10, 1e-10) if dtype == F64 else STAT_TOL[dtype]
    assert_close64(got, ref, *t, name=f"{kind} vs reference")
    assert_close64(got, cpu, 2 * t[0], 2 * t[1], name=f"{kind} vs CPU")


# ----------------------------------------------------------------------------------------
# layouts: non-contiguous, broadcast, misaligned
# ----------------------------------------------------------------------------------------
#: The array-interface type strings of the dtypes ``misaligned`` hands over.
_TYPESTR = {torch.float16: "<f2", torch.float32: "<f4", torch.int32: "<i4"}


def misaligned(values: Tensor) -> Tensor:
    """`values` (float16, float32 or int32) in memory half an entry past a multiple of their size on
    their device, as from_blob or a DLPack / __cuda_array_interface__ producer can hand them over
    (torch's own allocations are aligned). The returned tensor keeps its buffer alive."""
    import numpy as np

    n, size = values.numel(), values.element_size()
    shift = size // 2
    raw = torch.zeros(size * n + 2 * size, dtype=torch.uint8, device=values.device)
    raw[shift : shift + size * n] = values.detach().contiguous().view(-1).view(torch.uint8)
    typestr = _TYPESTR[values.dtype]
    if raw.is_cuda:
        interface = {"data": (raw.data_ptr() + shift, False), "shape": tuple(values.shape), "typestr": typestr,
                     "version": 2, "strides": None}
        out = torch.as_tensor(type("Interface", (), {"__cuda_array_interface__": interface})(), device=raw.device)
    else:
        array = np.frombuffer(raw.numpy(), dtype=np.dtype(typestr), count=n, offset=shift)
        out = torch.from_numpy(array.reshape(values.shape))
    out.keep_alive = raw  # type: ignore[attr-defined]
    assert out.data_ptr() % size == shift and torch.equal(out, values.detach())
    return out


def assert_same_under_each_mask(q: Tensor, k: Tensor, v: Tensor, masks: Sequence[Tensor],
                                **kw: Any) -> List[Tensor]:
    """The forward with statistics and the backward of an entropy-regularized loss under each of
    `masks` (the same entries in other memory) give bitwise the same results and gradients; returns
    the first mask's (output, lse, entropy, dq, dk, dv)."""
    runs = []
    for mask in masks:
        xs = [x.detach().requires_grad_() for x in (q, k, v)]
        out, stats = torch_ext.attention(*xs, attn_mask=mask, return_stats=True, **kw)
        (out.float().sum() + stats.entropy.sum()).backward()
        runs.append([out, stats.lse, stats.entropy, *(x.grad for x in xs)])
    for run in runs[1:]:
        for got, want in zip(run, runs[0]):
            assert torch.equal(got, want)
    return runs[0]


@pytest.mark.parametrize("dtype,mask_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                                              (torch.float16, torch.float16)], ids=["bf16", "fp32", "fp16"])
def test_mask_at_a_misaligned_address(dtype: torch.dtype, mask_dtype: torch.dtype) -> None:
    """An additive mask whose entries sit half an entry past a multiple of their size (memory from
    from_blob or another library: a float32 mask 2 bytes past, an fp16 one of fp16 inputs, which the
    kernels read in its own dtype, 1 byte past) is read through an aligned copy (attention_inputs.cpp:
    element_aligned, from expand_mask): the results and gradients equal those of the same mask in
    torch's own memory, where a misaligned read would fault."""
    B, H, Lq, Lk, D = 2, 2, 70, 150, 64
    g = torch.Generator().manual_seed(31)
    q, k, v = (torch.randn(B, H, n, D, generator=g).to(DEV, dtype) for n in (Lq, Lk, Lk))
    bias = torch.randn(1, 1, Lq, Lk, generator=g).to(mask_dtype)
    bias[..., :5] = -math.inf
    aligned = bias.to(DEV)
    assert_same_under_each_mask(q, k, v, [aligned, misaligned(aligned)], is_causal=True)


@pytest.mark.parametrize("dtype,mask_dtype", [(torch.bfloat16, torch.bool), (torch.float16, torch.bool),
                                              (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)],
                         ids=["bf16-bool", "fp16-bool", "bf16-bf16", "fp16-fp16"])
def test_mask_in_tight_storage(dtype: torch.dtype, mask_dtype: torch.dtype) -> None:
    """A bool mask, or a 16-bit one of the inputs' dtype, whose storage ends 1 or 2 bytes into the
    4-byte word of its last entry (its entries one entry into storage one entry longer), which the
    tensor-core forwards would copy whole, is read through a copy in storage of whole words
    (attention_inputs.cpp: word_readable, from expand_mask): the results and gradients equal those
    of the same mask in storage of its own size, and the output and entropy match the float64
    reference. (That no read leaves the storage, compute-sanitizer's memcheck checks:
    scripts/cuda_sanitizer_grid.py, the *_tight variants.)"""
    B, H, Lq, Lk, D = 2, 2, 70, 150, 64
    g = torch.Generator().manual_seed(41)
    q, k, v = (torch.randn(B, H, n, D, generator=g).to(DEV, dtype) for n in (Lq, Lk, Lk))
    keep = torch.rand(1, 1, Lq, Lk, generator=g) > 0.3
    keep[..., -1] = True
    plain = (keep if mask_dtype == torch.bool else torch.where(keep, 0.0, -math.inf).to(mask_dtype)).to(DEV)
    tight = torch.empty(plain.numel() + 1, dtype=mask_dtype, device=DEV)[1:].view_as(plain).copy_(plain)
    assert tight.untyped_storage().nbytes() % 4 == tight.element_size()
    out, _, entropy, *_ = assert_same_under_each_mask(q, k, v, [plain, tight])
    ref = reference_attention_raw(q.cpu(), k.cpu(), v.cpu(), keep)
    assert_close64(out, ref.output, *OUT_TOL[dtype], name="output")
    assert_close64(entropy, ref.entropy, *STAT_TOL[dtype], name="entropy")


@pytest.mark.parametrize("which", ["query_key_value", "scale", "sinks", "cu_seqlens", "row_reduction"])
def test_tensors_at_a_misaligned_address(which: str) -> None:
    """Each other tensor whose entries the kernels read, handed over half an entry past a multiple
    of its size (fp16 query, key and value 1 byte past; a float32 scale tensor, float32 sinks and
    int32 cu_seqlens 2 bytes past; a float32 input of the row reductions), is read through an
    aligned copy (attention_inputs.cpp: element_aligned): the results and gradients equal those of
    the same tensors in torch's own memory, where a misaligned load would fault, and the dense
    calls' output and entropy match the float64 reference."""
    B, H, Lq, Lk, D = 2, 2, 70, 150, 64
    g = torch.Generator().manual_seed(37)
    dtype = torch.float16 if which == "query_key_value" else torch.float32
    q, k, v = (torch.randn(B, H, n, D, generator=g).to(DEV, dtype) for n in (Lq, Lk, Lk))
    scale = (torch.rand(B, H, Lq, generator=g) * 0.2 + 0.05).to(DEV)
    sinks = torch.randn(H, generator=g).to(DEV)
    lengths = torch.tensor([0, 30, 70], dtype=torch.int32, device=DEV)
    key_lengths = torch.tensor([0, 100, 150], dtype=torch.int32, device=DEV)

    def run(given: Callable[[Tensor], Tensor]) -> List[Tensor]:
        if which == "row_reduction":
            p = torch.softmax(q.float().reshape(-1, D), dim=-1)
            return [torch_ext.entropy(given(p)), torch_ext.sparsity(given(p))]
        if which == "query_key_value":
            xs = [given(x).requires_grad_() for x in (q, k, v)]
        else:
            xs = [x.detach().requires_grad_() for x in (q, k, v)]
        if which == "cu_seqlens":  # packed: (total, H, D)
            packed = [x[0].transpose(0, 1).detach().requires_grad_() for x in xs]
            out, stats = torch_ext.varlen_attention(*packed, given(lengths), given(key_lengths), 40, 100,
                                                    is_causal=True, return_stats=True)
            leaves = packed
        else:
            extra: Dict[str, Any] = {}
            if which == "scale":
                extra["scale"] = given(scale).requires_grad_()
            if which == "sinks":
                extra["sinks"] = given(sinks).requires_grad_()
            out, stats = torch_ext.attention(*xs, is_causal=True, return_stats=True, **extra)
            leaves = xs + list(extra.values())
        (out.float().sum() + stats.entropy.sum()).backward()
        return [out, stats.lse, stats.entropy, *(x.grad for x in leaves)]

    want, got = run(lambda x: x), run(misaligned)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    if which in ("query_key_value", "scale", "sinks"):  # and the dense calls against float64
        ref = reference_attention_raw(q.cpu(), k.cpu(), v.cpu(), None, scale.cpu() if which == "scale" else None,
                                      is_causal=True, sinks=sinks.cpu() if which == "sinks" else None)
        assert_close64(got[0], ref.output, *OUT_TOL[dtype], name="output")
        assert_close64(got[2], ref.entropy, *STAT_TOL[dtype], name="entropy")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.parametrize(
    "layout", ["blhd", "blhd_d80", "sliced_last_dim", "expanded_kv", "odd_row_stride", "offset_by_one"]
)
def test_strided_inputs(dtype: torch.dtype, layout: str) -> None:
    """Non-contiguous inputs give the contiguous inputs' result (forward and gradients), the
    output in the query's layout and each gradient in its input's: (B, L, H, D) transposed,
    stride-2 last dim, stride-0 batch, rows of odd stride, storage offset of one element (rows
    not aligned to 16 bytes), with a transposed / expanded mask and scale. blhd_d80: a head dim
    no kernel compiles, which the tensor-core families pad to 128 (the padded gradients cut back
    into the inputs' layouts)."""
    B, H, Lq, Lk, D = 2, 3, 65, 130, 80 if layout == "blhd_d80" else 64
    blhd = layout.startswith("blhd")

    def build(shape: Tuple[int, ...], device: Any, seed: int) -> Tensor:
        """The same values on every device, in the layout under test (made in `dtype` first:
        casting would make a copy with the default strides)."""
        g = torch.Generator().manual_seed(seed)
        b_, h_, l_, d_ = shape
        if blhd:
            base = torch.randn(b_, l_, h_, d_, generator=g, dtype=F64).to(device=device, dtype=dtype)
            return base.transpose(1, 2)
        if layout == "sliced_last_dim":
            base = torch.randn(b_, h_, l_, 2 * d_, generator=g, dtype=F64).to(device=device, dtype=dtype)
            return base[..., ::2]
        if layout == "expanded_kv":
            base = torch.randn(1, h_, l_, d_, generator=g, dtype=F64).to(device=device, dtype=dtype)
            return base.expand(b_, h_, l_, d_)
        if layout == "odd_row_stride":
            base = torch.randn(b_, h_, l_, d_ + 1, generator=g, dtype=F64).to(device=device, dtype=dtype)
            return base[..., :d_]
        base = torch.randn(b_ * h_ * l_ * d_ + 1, generator=g, dtype=F64).to(device=device, dtype=dtype)
        view = base[1:].view(b_, h_, l_, d_)  # rows start one element past a 16-byte boundary
        assert view.storage_offset() == 1
        return view

    results = []
    upstream: List[Tensor] = []
    for dev in ("cpu", DEV):
        q = build((B, H, Lq, D), dev, 1)
        k = build((B, H, Lk, D), dev, 2)
        v = build((B, H, Lk, D), dev, 3)
        if layout == "offset_by_one":
            assert q.is_contiguous() and q.storage_offset() == 1
        else:
            assert not q.is_contiguous() and not k.is_contiguous(), "layout is contiguous"
        mask = (torch.rand(Lk, Lq, generator=torch.Generator().manual_seed(4)) < 0.8).t().to(dev)
        mask = mask.view(1, 1, Lq, Lk).expand(B, H, Lq, Lk)  # stride-0 batch / heads, transposed rows
        scale = (0.1 + torch.rand(Lq, H, generator=torch.Generator().manual_seed(5), dtype=F64)).t()
        scale = scale.to(device=dev, dtype=stat_dtype(dtype))  # (H, Lq), non-contiguous
        assert not scale.is_contiguous() and not mask.is_contiguous()
        xs = [t.detach().requires_grad_() for t in (q, k, v)]
        res = OP(xs[0], xs[1], xs[2], mask, scale, is_causal=True)
        if not upstream:
            upstream.extend(randn(*o.shape, dtype=F64) for o in res[:4])
        grads = grads_of(res[:4], [u.to(dev) for u in upstream], xs)
        results.append((q, k, v, mask, scale, res, grads))

    (q, k, v, mask, scale, cpu, g_cpu), (qc, kc, vc, maskc, scalec, cu, g_cu) = results
    # the same values through contiguous copies on the device
    contig = OP(qc.contiguous(), kc.contiguous(), vc.contiguous(), maskc.contiguous(), scalec.contiguous(), is_causal=True)
    ref = reference_attention_raw(q, k, v, mask, scale.unsqueeze(0), is_causal=True)
    compare_forward(cu, cpu, ref, dtype)
    # the output follows the query's layout on both devices (contiguous for the other layouts)
    for out in (cpu[0], cu[0]):
        assert (out.transpose(1, 2) if blhd else out).is_contiguous(), out.stride()
    for i, (name, a, b) in enumerate(zip(OUT_NAMES, cu, contig)):
        tol = OUT_TOL[dtype] if i == 0 else STAT_TOL[dtype]
        assert_close64(a, b, *tol, f"{name}: strided vs contiguous")
    rin = [leaf64(t) for t in (q, k, v)]
    r = reference_attention_raw(rin[0], rin[1], rin[2], mask, scale.unsqueeze(0), is_causal=True)
    g_ref = grads_of([r.output, r.lse, r.entropy, r.sum_p2], upstream, rin)
    for name, a, b, e, x in zip(("query", "key", "value"), g_cu, g_cpu, g_ref, (qc, kc, vc)):
        assert a.shape == x.shape, name
        for grad in (a, b):  # each gradient in its input's layout, on both devices
            assert (grad.transpose(1, 2) if blhd else grad).is_contiguous(), (name, grad.stride())
        assert rel_err(a, e) < GRAD_TOL[dtype], f"grad {name}: {rel_err(a, e):.3g} vs reference"
        assert rel_err(a, b) < 2 * GRAD_TOL[dtype], f"grad {name}: {rel_err(a, b):.3g} vs CPU"


# ----------------------------------------------------------------------------------------
# CUDA specifics: device guard, streams, limits, mixed devices, grid size, long rows, NaN
# ----------------------------------------------------------------------------------------
@real_cuda
@pytest.mark.skipif(HAS_CUDA and torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_second_device() -> None:
    """Tensors on cuda:1 while cuda:0 is current: results on cuda:1 and correct (device guard)."""
    torch.cuda.set_device(0)
    dev1 = torch.device("cuda", 1)
    q, k, v = make_qkv(2, 4, 2, 65, 130, 64, dtype=torch.bfloat16)
    mask = make_mask("bool_rows_masked", 2, 4, 65, 130)
    kw = dict(is_causal=True, enable_gqa=True, scale_mode="logn", log_base=32.0)
    res = OP(q.to(dev1), k.to(dev1), v.to(dev1), mask.to(dev1), None, **kw)
    assert torch.cuda.current_device() == 0
    cpu = OP(q, k, v, mask, None, **kw)
    ref = reference_attention_raw(q, k, v, mask, None, **kw)
    for name, t in zip(OUT_NAMES, res):
        assert t.device == dev1, f"{name} on {t.device}"
    compare_forward([t.to(DEV) for t in res], cpu, ref, torch.bfloat16)
    # backward on cuda:1
    go = randn(*res[0].shape, dtype=torch.bfloat16).to(dev1)
    gl = torch.randn_like(res[1])
    grads = BW(go, gl, None, None, q.to(dev1), k.to(dev1), v.to(dev1), mask.to(dev1), res[0], res[1], res[2], res[3], res[6], True)
    g_cpu = BW(go.cpu(), gl.cpu(), None, None, q, k, v, mask, cpu[0], cpu[1], cpu[2], cpu[3], cpu[6], True)
    for name, a, b in zip(GRAD_NAMES, grads, g_cpu):
        assert a.device == dev1, name
        assert rel_err(a, b) < 2 * GRAD_TOL[torch.bfloat16], name
    # the other ops
    x = torch.softmax(torch.randn(33, 1000), -1)
    assert_close64(torch_ext.entropy(x.to(dev1)), reference_entropy(x), 1e-5, 1e-5, "entropy on cuda:1")
    assert_close64(torch_ext.sparsity(x.to(dev1), 0), reference_sparsity(x, 0), 1e-5, 1e-5, "sparsity on cuda:1")
    sp = torch_ext.attention_sparsity(q.to(dev1), k.to(dev1), mask.to(dev1), kind="relu2", is_causal=True, enable_gqa=True)
    assert sp.device == dev1
    assert_close64(sp, torch_ext.attention_sparsity(q, k, mask, kind="relu2", is_causal=True, enable_gqa=True), 4e-2, 4e-2)
    assert torch.cuda.current_device() == 0
    # cuda:0 and cuda:1 mixed
    with pytest.raises((ValueError, TypeError), match="key"):
        OP(q.cuda(0), k.to(dev1), v.cuda(0), None, None, enable_gqa=True)


@real_cuda
def test_non_default_stream() -> None:
    """Kernels run on the current stream: inputs written on a side stream just before the call
    (behind a long sleep) are seen, and results are ready for that stream's next kernels."""
    dtype = torch.bfloat16
    B, H, Lq, Lk, D = 2, 4, 257, 257, 64
    q, k, v = make_qkv(B, H, H, Lq, Lk, D, dtype=dtype)
    mask = make_mask("bool_rows_masked", B, H, Lq, Lk)
    go = randn(B, H, Lq, D, dtype=dtype)
    cpu = OP(q, k, v, mask, None, is_causal=True)
    g_cpu = BW(go, None, None, None, q, k, v, mask, cpu[0], cpu[1], cpu[2], cpu[3], cpu[6], True)
    p = torch.softmax(torch.randn(64, 5000), -1)

    # Buffers filled with zeros on the default stream; the real values arrive on stream s only
    # after ~0.1 s of GPU sleep. A kernel launched on another stream would read the zeros.
    bufs = [torch.zeros(t.shape, dtype=t.dtype, device="cuda") for t in (q, k, v, go)]
    pbuf = torch.zeros(p.shape, device="cuda")
    srcs = [t.to("cuda") for t in (q, k, v, go)] + [p.to("cuda")]
    mask_c = mask.cuda()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(200_000_000)
        for b, src in zip(bufs + [pbuf], srcs):
            b.copy_(src, non_blocking=True)
        qb, kb, vb, gob = bufs
        res = OP(qb, kb, vb, mask_c, None, is_causal=True)
        grads = BW(gob, None, None, None, qb, kb, vb, mask_c, res[0], res[1], res[2], res[3], res[6], True)
        ent = torch_ext.entropy(pbuf)
        spars = torch_ext.attention_sparsity(qb, kb, mask_c, kind="exp", is_causal=True)
        # consumers on s: copies made after the kernels on the same stream
        res_copy = [t.clone() for t in res]
        grads_copy = [t.clone() for t in grads]
        ent_copy, spars_copy = ent.clone(), spars.clone()
    s.synchronize()
    ref = reference_attention_raw(q, k, v, mask, None, is_causal=True)
    compare_forward(res_copy, cpu, ref, dtype)
    for name, a, b in zip(GRAD_NAMES, grads_copy, g_cpu):
        assert rel_err(a, b) < 2 * GRAD_TOL[dtype], f"{name} under a side stream: {rel_err(a, b):.3g}"
    assert_close64(ent_copy, reference_entropy(p), 1e-5, 1e-5, "entropy under a side stream")
    cpu_sparsity = torch_ext.attention_sparsity(q, k, mask, kind="exp", is_causal=True)
    assert_close64(spars_copy, cpu_sparsity, 4e-2, 4e-2, "attention_sparsity under a side stream")


@real_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("which", ["head_dim", "v_head_dim"])
def test_cuda_head_dim_limits(dtype: torch.dtype, which: str) -> None:
    """A head dim of 257 raises ValueError naming head_dim on CUDA (forward, backward op,
    attention_sparsity for the query/key dim); 256 works; the CPU has no such limit."""
    D, Dv = (257, 64) if which == "head_dim" else (64, 257)
    q, k, v = make_qkv(1, 2, 2, 9, 17, D, Dv, dtype=dtype)
    out = OP(q, k, v)  # CPU: fine
    with pytest.raises(ValueError, match="head_dim"):
        OP(cuda(q), cuda(k), cuda(v))
    with pytest.raises(ValueError, match="head_dim"):
        torch_ext.attention(cuda(q), cuda(k), cuda(v), return_stats=True)
    # The backward op called directly and attention_sparsity (no value): a ValueError naming
    # head_dim, or (if that kernel has no such limit) the CPU's result; never a crash.
    bw_args = (out[0], None, None, None, q, k, v, None, out[0], out[1], out[2], out[3], out[6], False)
    raises_head_dim_or_matches(lambda: BW(*(cuda(a) for a in bw_args)), BW(*bw_args), GRAD_TOL[dtype], "attention_backward")
    if which == "head_dim":
        raises_head_dim_or_matches(
            lambda: (torch_ext.attention_sparsity(cuda(q), cuda(k)),),
            (torch_ext.attention_sparsity(q, k),),
            GRAD_TOL[dtype],
            "attention_sparsity",
        )
    # the largest supported size works
    q, k, v = make_qkv(1, 2, 2, 9, 17, 256, 256, dtype=dtype)
    check_forward(q, k, v)


def raises_head_dim_or_matches(fn: Any, expected: Sequence[Tensor], tol: float, name: str) -> None:
    """`fn()` raises a ValueError naming head_dim, or returns tensors close to `expected`."""
    try:
        got = fn()
    except ValueError as e:
        assert "head_dim" in str(e), f"{name}: ValueError does not name head_dim: {e}"
        return
    for a, b in zip(got, expected):
        assert a.device.type == DEV.type and a.shape == b.shape, name
        assert rel_err(a, b) < tol, f"{name}: no error raised, and the result differs from the CPU's"
    torch.cuda.synchronize()  # a kernel fault shows up here rather than in a later test


@real_cuda
@pytest.mark.parametrize("D,Dv", [(129, 64), (64, 129), (256, 256), (129, 129)])
def test_cuda_float64_head_dim_limit(D: int, Dv: int) -> None:
    """float64 with max(head_dim, v_head_dim) > 128 raises ValueError naming head_dim on CUDA;
    128 works; float32 with the same dims works."""
    q, k, v = make_qkv(1, 2, 2, 9, 17, D, Dv, dtype=F64)
    OP(q, k, v)  # CPU: fine
    with pytest.raises(ValueError, match="head_dim"):
        OP(cuda(q), cuda(k), cuda(v), is_causal=True)
    check_forward(q.float(), k.float(), v.float())
    q, k, v = make_qkv(1, 2, 2, 9, 17, 128, 128, dtype=F64)
    check_forward(q, k, v)


@real_cuda
@pytest.mark.parametrize("which", ["key", "value", "attn_mask", "scale"])
def test_mixed_devices(which: str) -> None:
    """One input on the CPU, the others on CUDA: ValueError/TypeError naming the argument, for
    the attention API and attention_sparsity."""
    t = {
        "query": torch.randn(2, 4, 5, 8, device="cuda"),
        "key": torch.randn(2, 4, 6, 8, device="cuda"),
        "value": torch.randn(2, 4, 6, 8, device="cuda"),
        "attn_mask": torch.ones(5, 6, dtype=torch.bool, device="cuda"),
        "scale": torch.ones(4, 1, device="cuda"),
    }
    t[which] = t[which].cpu()
    with pytest.raises((ValueError, TypeError), match=which):
        torch_ext.attention(t["query"], t["key"], t["value"], t["attn_mask"], scale=t["scale"], return_stats=True)
    if which != "value":
        with pytest.raises((ValueError, TypeError), match=which):
            torch_ext.attention_sparsity(t["query"], t["key"], t["attn_mask"], scale=t["scale"])
    # query on the CPU, the rest on CUDA
    with pytest.raises((ValueError, TypeError), match="query|key|value"):
        torch_ext.attention(t["query"].cpu(), t["key"].cuda(), t["value"].cuda())


@real_cuda
def test_mixed_devices_backward() -> None:
    """attention_backward with a CPU grad_output and CUDA tensors raises (no kernel is launched)."""
    q, k, v = (torch.randn(1, 2, 5, 8, device="cuda") for _ in range(3))
    o, lse, ent, sp2, _, _, rs, *_ = OP(q, k, v)
    with pytest.raises((ValueError, TypeError)):
        BW(o.cpu(), None, None, None, q, k, v, None, o, lse, ent, sp2, rs, False)
    with pytest.raises((ValueError, TypeError)):
        BW(o, lse.cpu(), None, None, q, k, v, None, o, lse, ent, sp2, rs, False)


GRID_CASES = {
    "B70000": (70000, 1, 1, 2, 3, 8),
    "H70000_gqa": (2, 35000, 7000, 1, 5, 16),
    "BH70000_Lq65": (7, 10000, 10000, 65, 9, 8),
}


@pytest.mark.parametrize("name", list(GRID_CASES))
def test_large_grid(name: str) -> None:
    """B*H >= 70000 (above the 65535 limit of gridDim.y/z): forward and backward correct, also the
    rows of the last heads (a wrapped or truncated grid would leave them zero or wrong)."""
    B, H, Hkv, Lq, Lk, D = GRID_CASES[name]
    q, k, v = make_qkv(B, H, Hkv, Lq, Lk, D, dtype=torch.float32)
    kw: Dict[str, Any] = dict(is_causal=True, enable_gqa=H != Hkv)
    check_forward(q, k, v, **kw)
    check_backward(q, k, v, **kw)
    sp = torch_ext.attention_sparsity(cuda(q), cuda(k), kind="relu2", **kw)
    assert_close64(sp, torch_ext.attention_sparsity(q, k, kind="relu2", **kw), 1e-5, 1e-5, "attention_sparsity")


@real_cuda
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_long_sequence_vs_sdpa(causal: bool) -> None:
    """L = 8192, D = 128, bfloat16: output as close to the exact result (SDPA in float64) as SDPA's
    own bfloat16 output is, and within bfloat16 resolution of it; no L x L buffer (peak memory)."""
    B, H, L, D = 1, 4, 8192, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, device="cuda", generator=g).bfloat16() for _ in range(3))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out, st = torch_ext.attention(q, k, v, is_causal=causal, return_stats=True)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    lxl = B * H * L * L * 2  # one bfloat16 L x L matrix
    assert extra < lxl / 4, f"forward used {extra / 2**20:.0f} MiB extra (an L x L bf16 matrix is {lxl / 2**20:.0f} MiB)"
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
    err_ours, err_sdpa = rel_err(out, exact), rel_err(sdpa, exact)
    assert err_ours <= 1.5 * err_sdpa + 1e-3, f"relative error {err_ours:.3g} vs SDPA's {err_sdpa:.3g}"
    assert rel_err(out, sdpa) < 2 * err_sdpa + 2e-3, f"ours vs SDPA: {rel_err(out, sdpa):.3g}"
    assert torch.isfinite(out).all()
    for name in ("lse", "entropy", "effective_keys"):
        assert torch.isfinite(getattr(st, name)).all(), name
    n = torch.clamp(torch.arange(L, device="cuda") + 1, max=L) if causal else torch.full((L,), L, device="cuda")
    assert torch.equal(st.n_keys[0, 0], n)
    # backward: gradients finite, no L x L buffer either
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    o2, st2 = torch_ext.attention(qg, kg, vg, is_causal=causal, return_stats=True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    (o2.float().sum() + st2.entropy.sum()).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < lxl / 2, f"backward used {extra / 2**20:.0f} MiB extra"
    for t in (qg, kg, vg):
        assert torch.isfinite(t.grad).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=dtype_id)
def test_nan_propagation(dtype: torch.dtype) -> None:
    """NaN in a query row: that row's output is NaN, other rows are exact. NaN in key j (causal):
    rows i >= j are NaN, rows i < j exact. NaN in value j: rows that see j are NaN. The NaN rows
    are the CPU kernel's."""
    B, H, Lq, Lk, D = 1, 2, 130, 130, 64
    q, k, v = make_qkv(B, H, H, Lq, Lk, D, dtype=dtype)
    j = 70
    cases = {"query": (q.clone(), k, v), "key": (q, k.clone(), v), "value": (q, k, v.clone())}
    cases["query"][0][0, 1, 40, 3] = float("nan")
    cases["key"][1][0, 1, j, 5] = float("nan")
    cases["value"][2][0, 1, j, 7] = float("nan")
    for which, (qq, kk, vv) in cases.items():
        cu = OP(cuda(qq), cuda(kk), cuda(vv), None, None, is_causal=True)
        cpu = OP(qq, kk, vv, None, None, is_causal=True)
        nan_rows = torch.isnan(cu[0].cpu()).any(-1)
        nan_rows_cpu = torch.isnan(cpu[0]).any(-1)
        if which == "query":
            expect = torch.zeros(B, H, Lq, dtype=torch.bool)
            expect[0, 1, 40] = True
        else:
            expect = torch.zeros(B, H, Lq, dtype=torch.bool)
            expect[0, 1, j:] = True
        assert torch.equal(nan_rows, expect), f"{which} NaN: NaN rows {nan_rows.nonzero().tolist()[:8]}..."
        assert torch.equal(nan_rows, nan_rows_cpu), f"{which} NaN: NaN rows differ from the CPU kernel's"
        ok = ~expect
        # Rows that do not see the NaN are what they are with it replaced by 0 (docs/math.md
        # section 8); the plain n x n reference would form 0 * NaN there.
        ref = reference_attention_raw(*(t.nan_to_num(0.0) for t in (qq, kk, vv)), None, None,
                                      is_causal=True)
        oat, ort = OUT_TOL[dtype]
        sat, srt = STAT_TOL[dtype]
        assert_close64(cu[0].cpu()[ok], ref.output[ok], oat, ort, f"{which} NaN: output of clean rows")
        assert_close64(cu[1].cpu()[ok], ref.lse[ok], sat, srt, f"{which} NaN: lse of clean rows")
        assert_close64(cu[2].cpu()[ok], ref.entropy[ok], sat, srt, f"{which} NaN: entropy of clean rows")
        assert torch.equal(torch.isnan(cu[1].cpu()), torch.isnan(cpu[1])), f"{which} NaN: lse NaN rows differ from the CPU's"


def is_hopper() -> bool:
    """Whether the CUDA device is compute capability 9.0, the one target of the sm90 family."""
    return HAS_CUDA and not DRY_RUN and torch.cuda.get_device_capability(DEV) == (9, 0)


#: The sm90 family's code is sm_90a: it runs on compute capability 9.0 (H100, H200) alone.
needs_hopper = pytest.mark.skipif(not is_hopper(), reason="the sm90 family needs a compute capability 9.0 GPU")
FAMILY_PARAMS = ["sm80", pytest.param("sm90", marks=needs_hopper)]


@real_cuda
@pytest.mark.parametrize("entropy_in_loss", [True, False], ids=["with_entropy", "output_alone"])
@pytest.mark.parametrize("mask_grad", [False, True], ids=["fixed_mask", "learned_mask"])
@pytest.mark.parametrize("family", ["fallback", *FAMILY_PARAMS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_nan_key_hidden_by_additive_mask(monkeypatch: pytest.MonkeyPatch, family: str, dtype: torch.dtype,
                                         mask_grad: bool, entropy_in_loss: bool) -> None:
    """A NaN key masked by an additive -inf is hidden from the logits in every family (-inf, not
    NaN + -inf = NaN), and from dQ = dS K (the fallback keeps non-finite rows out of its products;
    the tensor-core families' 0 * NaN there sends the call to the fallback, their guard): outputs,
    statistics and the three gradients stay finite. Where the mask requires grad (a learned bias),
    the tensor-core backward has added into its gradient before the guard recomputes the call,
    which zeroes it first, so that it equals the CPU op's, not twice it: the sm80 family's, or
    with the Hopper family forced and a loss of the output alone, the Hopper family's (with the
    entropy in the loss it leaves the call to sm80)."""
    if family != "fallback" and dtype == torch.float32:
        pytest.skip("the tensor-core families take 16-bit inputs")
    monkeypatch.setenv("ENTROPY_ATTN_CUDA_FAMILY", family)
    B, H, L, D = 1, 2, 200, 64
    q, k, v = make_qkv(B, H, H, L, L, D, dtype=dtype)
    k[0, :, 37] = float("nan")
    mask = randn(L, L, scale=0.5).to(dtype)
    mask[:, 37] = float("-inf")
    leaves = [cuda(t).requires_grad_(True) for t in (q, k, v)] + [cuda(mask).requires_grad_(mask_grad)]
    out, st = torch_ext.attention(*leaves, return_stats=True)
    (out.float().sum() + (st.entropy.sum() if entropy_in_loss else 0)).backward()
    q, k, v, m = leaves
    checks = [("output", out), ("lse", st.lse), ("entropy", st.entropy), ("dq", q.grad),
              ("dk", k.grad), ("dv", v.grad)] + ([("dmask", m.grad)] if mask_grad else [])
    for name, t in checks:
        assert torch.isfinite(t).all(), f"{family}: {name} is not finite"
    if not mask_grad:
        return
    cpu = [t.detach().cpu().requires_grad_(True) for t in leaves]
    out_cpu, st_cpu = torch_ext.attention(*cpu, return_stats=True)
    (out_cpu.float().sum() + (st_cpu.entropy.sum() if entropy_in_loss else 0)).backward()
    assert rel_err(m.grad.cpu(), cpu[3].grad) < GRAD_TOL[dtype], f"{family}: dmask vs the CPU op"


def _same_nonfinite_then_close(got: Tensor, want: Tensor, tol: Tuple[float, float] | float,
                               what: str) -> None:
    """Equal NaN positions and infinities, then the finite entries within tolerance: (atol, rtol)
    entrywise, or a relative error (a gradient's GRAD_TOL)."""
    got, want = got.detach().to("cpu", F64), want.detach().to("cpu", F64)
    assert torch.equal(got.isnan(), want.isnan()), (
        f"{what}: NaN at {int(got.isnan().sum())} entries, the CPU op's at {int(want.isnan().sum())}")
    assert torch.equal(got.isinf(), want.isinf()) and torch.equal(got[got.isinf()], want[want.isinf()]), (
        f"{what}: infinities differ from the CPU op's")
    fin = torch.isfinite(want)
    if isinstance(tol, tuple):
        assert_close64(got[fin], want[fin], tol[0], tol[1], what)
    else:
        assert rel_err(got[fin], want[fin]) < tol, f"{what}: {rel_err(got[fin], want[fin]):.3g}"


#: (family, dtype) of test_hidden_nonfinite_matches_cpu.
HIDDEN_NONFINITE_FAMILIES = [("fallback", torch.float32), ("fallback", torch.bfloat16), ("fallback", torch.float64),
                             ("sm80", torch.bfloat16), ("sm80", torch.float16), ("sm90", torch.bfloat16)]


@pytest.mark.parametrize("family,dtype,deterministic", [
    pytest.param(f, d, det, marks=[needs_hopper] + ([pytest.mark.hopper_turns] if det else []) if f == "sm90" else [])
    for det in (False, True) for f, d in HIDDEN_NONFINITE_FAMILIES], ids=str)
def test_hidden_nonfinite_matches_cpu(monkeypatch: pytest.MonkeyPatch, family: str,
                                      dtype: torch.dtype, deterministic: bool) -> None:
    """Every family keeps NaN and infinities in K, V, Q and dO to the rows (keys) that see them, as
    the CPU op does (docs/math.md section 8): causal with a bool mask (no row sees every key, one
    key no row sees), GQA, several query and key tiles, NaN and infinite entries in each operand
    and in a group's second head; outputs, lse, entropy and the three gradients match the CPU
    op's, NaN positions and infinities included. The fallback keeps such rows out of its products;
    a tensor-core family's kernels flag the call and the fallback recomputes it (their guard). Under
    deterministic algorithms the fallback, as a plain call or as the guard, adds dq in turns
    (fallback/turns.cuh): a second backward gives the same bits, NaN included. (tests/cpp/test_cuda_emulation.cpp runs the fallback
    under CPU emulation: its *hidden_nonfinite* and EmulatedGuard cases.)"""
    monkeypatch.setenv("ENTROPY_ATTN_CUDA_FAMILY", family)
    B, H, Hkv, L, D = 1, 4, 2, 150, 64
    q, k, v = make_qkv(B, H, Hkv, L, L, D, dtype=dtype)
    k[0, 0, L - 1] = float("nan")
    k[0, 0, L // 2, 0] = float("inf")  # logit +inf (a NaN row) or -inf (dS k = 0 * inf) by q's sign
    v[0, 0, L - 2, 1] = float("nan")
    q[0, 0, 0, 2] = float("nan")
    q[0, 0, L // 2, 1] = float("inf")
    q[0, 3, 20, 4] = float("nan")  # the second query head of a GQA group
    v[0, 1, 90, 3] = float("nan")
    dout = randn(B, H, L, D, dtype=dtype)
    dout[0, 0, 1, 0] = float("nan")
    dout[0, 0, 5, 1] = float("inf")
    dout[0, 1, 40, 2] = float("nan")
    mask = torch.rand(L, L, generator=torch.Generator().manual_seed(3)) > 0.2
    # A key no row sees, with a NaN entry: only dq = dS K could form 0 * NaN from it.
    mask[:, 37] = False
    k[0, 1, 37, 6] = float("nan")
    results = []
    for place in (lambda t: t, cuda, cuda):
        # (detach: fresh leaves on both devices, so .grad is populated on each.)
        qq, kk, vv = (place(t).detach().requires_grad_(True) for t in (q, k, v))
        with torch_deterministic(deterministic):
            out, st = torch_ext.attention(qq, kk, vv, place(mask), is_causal=True, enable_gqa=True,
                                          return_stats=True)
            out.backward(place(dout))
        results.append((out, st.lse, st.entropy, qq.grad, kk.grad, vv.grad))
    if deterministic:
        for name, first, again in zip(("dq", "dk", "dv"), results[1][3:], results[2][3:]):
            assert same_bits(first, again), f"{family}: {name} differs between two deterministic backwards"
    results.pop()
    tols = [OUT_TOL[dtype], STAT_TOL[dtype], STAT_TOL[dtype]] + [GRAD_TOL[dtype]] * 3
    for name, want, got, tol in zip(["output", "lse", "entropy", "dq", "dk", "dv"], *results, tols):
        _same_nonfinite_then_close(got, want, tol, f"{family}: {name}")


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("family,dtype", [
    ("fallback", torch.bfloat16), ("sm80", torch.bfloat16), ("sm80", torch.float16),
    pytest.param("sm90", torch.bfloat16, marks=needs_hopper)], ids=str)
def test_infinite_logits_without_mask_match_cpu(monkeypatch: pytest.MonkeyPatch, family: str,
                                                dtype: torch.dtype, is_causal: bool) -> None:
    """Without a mask the tensor-core forwards leave the statistics' t unclamped in the blocks
    whose keys every row sees (a finite score gives a finite term there); an infinite key entry
    gives some rows a logit of -inf (weight 0, a finite entropy) and others +inf (NaN rows): the
    epilogue's guard sees the NaN entropy and the fallback recomputes the call, so outputs, lse and
    the statistics match the CPU op's, the rows with a -inf logit finite."""
    monkeypatch.setenv("ENTROPY_ATTN_CUDA_FAMILY", family)
    B, H, L, D = 1, 2, 300, 64
    q, k, v = make_qkv(B, H, H, L, L, D, dtype=dtype)
    k[0, 0, 5, 0] = float("inf")  # rows with q[..., 0] < 0 give key 5 the logit -inf
    results = []
    for place in (lambda t: t, cuda):
        out, st = torch_ext.attention(place(q), place(k), place(v), is_causal=is_causal,
                                      return_stats=True)
        results.append((out, st.lse, st.entropy, st.effective_keys, st.max_weight))
    # The case is there: on the CPU, rows that see key 5 with a -inf logit are finite, with +inf NaN.
    entropy, sees = results[0][2][0, 0], torch.arange(L) >= (5 if is_causal else 0)
    assert torch.isfinite(entropy[sees & (q[0, 0, :, 0] < 0)]).all()
    assert entropy[sees & (q[0, 0, :, 0] > 0)].isnan().all()
    tols = [OUT_TOL[dtype]] + [STAT_TOL[dtype]] * 4
    names = ["output", "lse", "entropy", "effective_keys", "max_weight"]
    for name, want, got, tol in zip(names, *results, tols):
        _same_nonfinite_then_close(got, want, tol, f"{family}: {name}")


@pytest.mark.parametrize("family,dtype", [
    ("fallback", torch.bfloat16), ("sm80", torch.bfloat16), ("sm80", torch.float16),
    pytest.param("sm90", torch.bfloat16, marks=needs_hopper)], ids=str)
def test_extreme_finite_additive_mask_matches_cpu(monkeypatch: pytest.MonkeyPatch, family: str,
                                                  dtype: torch.dtype) -> None:
    """A finite additive mask value hides no key, however negative (docs/math.md section 8): rows
    whose every key carries finfo(float32).min attend to those keys uniformly, as on the CPU, and
    other rows give such keys no weight. The tensor-core families work in log2 units, where that
    value times log2(e) overflows to -inf: their kernels flag a row that has keys to see and no
    weight, and the fallback recomputes the call (their guard). Output and statistics against the
    CPU op, with a row whose keys are all -inf (no key: output 0)."""
    monkeypatch.setenv("ENTROPY_ATTN_CUDA_FAMILY", family)
    B, H, L, D = 1, 2, 150, 64
    q, k, v = make_qkv(B, H, H, L, L, D, dtype=dtype)
    lowest = torch.finfo(torch.float32).min
    gen = torch.Generator().manual_seed(5)
    mask = torch.where(torch.rand(L, L, generator=gen) < 0.3, lowest, 0.0)
    mask[torch.rand(L, L, generator=gen) < 0.1] = float("-inf")
    mask[:20] = lowest  # rows that see only finfo.min keys
    mask[20] = float("-inf")  # a row that sees no key
    names = ["lse", "entropy", "max_weight", "n_keys", "normalized_entropy", "sparsity", "effective_keys"]
    results = []
    for place in (lambda t: t, cuda):
        out, st = torch_ext.attention(place(q), place(k), place(v), place(mask), return_stats=True)
        results.append([out] + [getattr(st, n) for n in names])
    for name, want, got in zip(["output"] + names, *results):
        tol = OUT_TOL[dtype] if name == "output" else STAT_TOL[dtype]
        _same_nonfinite_then_close(got, want, tol, f"{family}: {name}")


@real_cuda
@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_tensor_core_guard_idle_on_finite_inputs(monkeypatch: pytest.MonkeyPatch,
                                                 family: str) -> None:
    """The guard of a tensor-core family recomputes a call only when its kernels wrote a non-finite
    value: with finite inputs the tensor-core results stand. They round differently from the
    fallback's, so a spurious recomputation would show as lse, output and dq bitwise equal to a
    fallback call's; they are not, and they match the float64 reference."""
    B, H, L, D = 1, 4, 512, 128
    q, k, v = make_qkv(B, H, H, L, L, D, dtype=torch.bfloat16)
    results = {}
    for fam in (family, "fallback"):
        monkeypatch.setenv("ENTROPY_ATTN_CUDA_FAMILY", fam)
        qq = cuda(q).requires_grad_(True)
        out, st = torch_ext.attention(qq, cuda(k), cuda(v), is_causal=True, return_stats=True)
        out.float().sum().backward()
        results[fam] = (out, st.lse, qq.grad)
    for name, got, other in zip(["output", "lse", "dq"], results[family], results["fallback"]):
        assert not torch.equal(got, other), f"{family}: {name} is the fallback's (the guard ran)"
    ref = reference_attention_raw(q, k, v, None, None, is_causal=True)
    assert_close64(results[family][0].cpu(), ref.output, *OUT_TOL[torch.bfloat16], "output")
    assert_close64(results[family][1].cpu(), ref.lse, *STAT_TOL[torch.bfloat16], "lse")


SLOW = os.environ.get("ENTROPY_ATTN_SLOW_TESTS", "") not in ("", "0")


@real_cuda
@pytest.mark.skipif(not SLOW, reason="slow: about 7 minutes per case on an H100 (one block scans "
                    "2^31 keys); ENTROPY_ATTN_SLOW_TESTS=1 runs it")
@pytest.mark.parametrize("family", ["sm80", "fallback"])
def test_keys_past_2_31_rows(monkeypatch: pytest.MonkeyPatch, family: str) -> None:
    """2^31 + 5 keys, expanded from one row (no memory): the tensor-core families keep lengths in
    32 bits, so such a call goes to the fallback (64-bit) instead of running over 5 keys. Every row
    sees every key, so one block scans all of them (12.9 s per 2^26 keys measured on an H100):
    test_window_past_2_31_keys checks the fallback's key indexing there at the cost of a window."""
    monkeypatch.setenv("ENTROPY_ATTN_CUDA_FAMILY", family)
    Lk = 2**31 + 5
    q = torch.randn(1, 1, 2, 64, device=DEV, dtype=torch.bfloat16)
    k = torch.zeros(1, 1, 1, 64, device=DEV, dtype=torch.bfloat16).expand(1, 1, Lk, 64)
    v = torch.randn(1, 1, 1, 64, device=DEV, dtype=torch.bfloat16).expand(1, 1, Lk, 64)
    out, st = torch_ext.attention(q, k, v, return_stats=True)
    assert (st.n_keys == Lk).all()
    torch.testing.assert_close(out, v[:, :, :1].expand(1, 1, 2, 64), atol=2e-2, rtol=2e-2)


@real_cuda
def test_window_past_2_31_keys() -> None:
    """2^31 + 5 keys under a bottom-right causal window of 4: each row sees its 5 keys past key
    2^31, and the kernel skips the key tiles before them, so this checks the 64-bit key indexing
    (the window's bounds, the tile's start, the loads) in seconds. Keys are one expanded zero row
    (uniform weights); values overlap in one 4 GiB storage, v[j, d] = storage[j + d] (strides
    (1, 1): the last stride is 1, so the op reads the view in place), zero but near the end, so the
    output is the mean of the row's own 5 value rows, which a 32-bit index (reading keys near 0)
    would miss."""
    Lk, D = 2**31 + 5, 64
    q = torch.randn(1, 1, 2, D, device=DEV, dtype=torch.bfloat16)
    k = torch.zeros(1, 1, 1, D, device=DEV, dtype=torch.bfloat16).expand(1, 1, Lk, D)
    storage = torch.zeros(Lk + D - 1, device=DEV, dtype=torch.bfloat16)
    tail = torch.randint(1, 9, (16 + D - 1,), generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    storage[-tail.numel():] = tail.to(DEV)
    v = storage.as_strided((1, 1, Lk, D), (0, 0, 1, 1))
    out, st = torch_ext.attention(q, k, v, is_causal=True, window_size=[4, 0],
                                  causal_alignment="bottom_right", return_stats=True)
    assert st.n_keys.flatten().tolist() == [5, 5]
    # Row r sees keys Lk-6+r .. Lk-2+r; key j's values are storage[j : j + D], i.e. in `tail`
    # (which starts at key Lk-16) from index j - (Lk-16).
    rows = tail.double().unfold(0, D, 1)  # rows[t] = the values of key Lk-16+t
    want = torch.stack([rows[10 + r:15 + r].mean(0) for r in range(2)])
    assert_close64(out[0, 0].cpu(), want, 2e-2, 1e-2, "output")
    torch.testing.assert_close(st.entropy.flatten().double().cpu(), torch.full((2,), math.log(5.0), dtype=F64),
                               atol=2e-2, rtol=0)


# ----------------------------------------------------------------------------------------
# kernel families (csrc/cuda/family.h): the switch, and agreement of the families
# ----------------------------------------------------------------------------------------
@real_cuda
def test_family_switch_rejects_unknown_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """ENTROPY_ATTN_CUDA_FAMILY takes auto, fallback, sm80 or sm90; anything else is a clear error."""
    q = torch.randn(1, 1, 4, 64, device=DEV, dtype=torch.bfloat16)
    monkeypatch.setenv("ENTROPY_ATTN_CUDA_FAMILY", "fastest")
    with pytest.raises(ValueError, match="ENTROPY_ATTN_CUDA_FAMILY"):
        OP(q, q, q)



def cuda_kernel_names(fn: Callable[[], Any]) -> List[str]:
    """The names of the CUDA kernels `fn` launches (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(DEV)
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@real_cuda
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
@pytest.mark.parametrize("stats", [False, True], ids=["lean", "stats"])
@pytest.mark.parametrize("family, D", [
    pytest.param(f, d, id=f"{f}-{d}",
                 marks=([needs_hopper] + ([pytest.mark.hopper_256] if d == 256 else [])) if f == "sm90" else [])
    for f in ("sm80", "sm90") for d in (64, 128, 256)])
def test_families_agree(
    monkeypatch: pytest.MonkeyPatch, family: str, dtype: torch.dtype, D: int, causal: bool, mask_kind: str,
    stats: bool,
) -> None:
    """A specialized family (forced) and the fallback give the same outputs and gradients within the
    dtype's tolerance, over the flags each instantiation fixes at compile time (at D = 256 the forced
    sm90 family runs its kernels where it has them, hopper_runs_256, and passes the rest to the sm80
    family's); GQA, lengths that are no multiple of a tile (two query tiles and three key
    blocks of the sm90 forward, five query blocks of its backward), a logn scale, and with
    statistics an entropy and sum p^2 term in the loss."""
    torch.manual_seed(0)
    Lq, Lk = 177, 293
    q, k, v = (cuda(t).requires_grad_() for t in make_qkv(2, 4, 2, Lq, Lk, D, dtype=dtype))
    mask = None
    if mask_kind == "bool":
        mask = cuda(torch.rand(Lq, Lk) < 0.8)
    elif mask_kind == "additive":
        mask = cuda(torch.randn(Lq, Lk).masked_fill(torch.rand(Lq, Lk) < 0.2, float("-inf")))
    kw = dict(is_causal=causal, enable_gqa=True, scale_mode="logn", log_base=64.0, return_stats=stats)
    go = torch.randn(2, 4, Lq, D, device=DEV, dtype=dtype)
    # With statistics the loss also weighs the entropy and sum p^2 of each row (the kernels' entropy
    # gradient terms).
    g_ent, g_p2 = torch.randn(2, 2, 4, Lq, device=DEV).unbind(0)
    results = {}
    for fam in ("fallback", family):
        monkeypatch.setenv("ENTROPY_ATTN_CUDA_FAMILY", fam)
        res = OP(q, k, v, mask, None, **kw)
        loss = (res[0].float() * go.float()).sum()
        if stats:
            loss = loss + (torch.nan_to_num(res[2]) * g_ent).sum() + (res[3] * g_p2).sum()
        grads = torch.autograd.grad(loss, (q, k, v))
        results[fam] = (res, grads)
    (fb, fb_g), (tc, tc_g) = results["fallback"], results[family]
    oat, ort = OUT_TOL[dtype]
    sat, srt = STAT_TOL[dtype]
    assert_close64(tc[0], fb[0], 2 * oat, 2 * ort, "output")
    for i in (1, 6, 7) + ((2, 3, 4, 8, 9) if stats else ()):
        assert_close64(tc[i], fb[i], 2 * sat, 2 * srt, OUT_NAMES[i])
    assert torch.equal(tc[5], fb[5]), "n_keys"
    for a, b, name in zip(tc_g, fb_g, ("dq", "dk", "dv")):
        assert rel_err(a, b) < 2 * GRAD_TOL[dtype], name


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("pattern", ["full", "causal", "causal_bottom_right"])
@pytest.mark.parametrize("family", ["fallback", *FAMILY_PARAMS])
def test_signed_row_scales(monkeypatch: pytest.MonkeyPatch, family: str, dtype: torch.dtype, D: int,
                           pattern: str) -> None:
    """Per-row scales of either sign and zero (a learned scale tensor may hold them) give the float64
    reference's outputs and statistics in every family, with and without statistics. The sm90
    softmax folds a non-negative lambda_i into the exponent where no key is hidden (the row max
    taken over the raw scores) and sends a warp holding a negative lambda through its general path
    instead. Here warps of positive rows only, a warp of zeros (rows 144..159), a batch of negative
    rows, and row 70 with lambda = -10 / sqrt(D) among positive rows: its logits span 65-90 log2
    units in a key block, so a max taken as for a positive lambda (the smallest logit) would make
    sum e^2, hence sum_p2, overflow. Lk = 512 (four whole key blocks) leaves no predicated block
    in full attention; bottom-right causality gives rows 0..127 two unpredicated blocks."""
    torch.manual_seed(0)
    B, H, Lq, Lk = 2, 2, 200, 512
    q, k, v = make_qkv(B, H, H, Lq, Lk, D, dtype=dtype)
    scale = (0.2 + 0.6 * torch.rand(B, H, Lq, dtype=F64)) / math.sqrt(D)
    scale[0, :, 70] = -10.0 / math.sqrt(D)
    scale[0, :, 144:160] = 0.0
    scale[1] = -scale[1]
    scale = scale.float()
    kw: Dict[str, Any] = dict(is_causal=pattern != "full")
    if pattern == "causal_bottom_right":
        kw["causal_alignment"] = "bottom_right"
    monkeypatch.setenv("ENTROPY_ATTN_CUDA_FAMILY", family)
    monkeypatch.setenv("ENTROPY_ATTN_SPLIT_KV", "off")
    _, _, ref = check_forward(q, k, v, None, scale, return_stats=True, **kw)
    lean = OP(cuda(q), cuda(k), cuda(v), None, cuda(scale), return_stats=False, **kw)
    oat, ort = OUT_TOL[dtype]
    sat, srt = STAT_TOL[dtype]
    assert_close64(lean[0], ref.output, oat, ort, "output without statistics vs reference")
    assert_close64(lean[1], ref.lse, sat, srt, "lse without statistics vs reference")


@real_cuda
@needs_hopper
@pytest.mark.parametrize("mask_kind", ["none", "bool"])
def test_hopper_family_runs_where_forced(monkeypatch: pytest.MonkeyPatch, mask_kind: str) -> None:
    """With ENTROPY_ATTN_CUDA_FAMILY=sm90 on an H100/H200, a call it covers runs the sm90 forward and
    backward kernels (named in the profile), and the forward matches the float64 reference; at
    L = 1000 (eight query tiles, eight key blocks, a partial last one) with a broadcast mask."""
    torch.manual_seed(1)
    q, k, v = (cuda(t).requires_grad_() for t in make_qkv(1, 2, 2, 1000, 1000, 128, dtype=torch.bfloat16))
    mask = cuda(torch.rand(1000, 1000) < 0.9) if mask_kind == "bool" else None
    monkeypatch.setenv("ENTROPY_ATTN_CUDA_FAMILY", "sm90")
    monkeypatch.setenv("ENTROPY_ATTN_SPLIT_KV", "off")  # (split-KV would take the forward to sm80)
    res: list = []
    names = cuda_kernel_names(lambda: res.append(OP(q, k, v, mask, None, is_causal=True, return_stats=True)))
    assert any("sm90::" in n and "forward_kernel" in n for n in names), names
    go = torch.randn_like(q)
    names = cuda_kernel_names(lambda: torch.autograd.grad(res[0][0], (q, k, v), go))
    assert any("sm90::" in n and "main_kernel" in n for n in names), names
    ref = reference_attention_raw(q.detach().cpu(), k.detach().cpu(), v.detach().cpu(),
                                  mask.cpu() if mask is not None else None, None, is_causal=True)
    oat, ort = OUT_TOL[torch.bfloat16]
    sat, srt = STAT_TOL[torch.bfloat16]
    out = res[0]
    assert_close64(out[0].detach().cpu(), ref.output, oat, ort, "output")
    assert_close64(out[1].cpu(), ref.lse, sat, srt, "lse")
    assert_close64(out[2].cpu(), ref.entropy, sat, srt, "entropy")


def tensor_core_family_runs(family: str) -> bool:
    """Whether the tests of a tensor-core family's extended features run here: sm80 on a GPU of
    compute capability 8.0 or newer, sm90 on 9.0, and the dry run (the CPU op in place of the
    kernels, no profile) once, under sm90, to check the tests' own logic."""
    if DRY_RUN:
        return family == "sm90"
    if not HAS_CUDA:
        return False
    return is_hopper() if family == "sm90" else torch.cuda.get_device_capability(DEV) >= (8, 0)


TC_FAMILIES = [
    pytest.param(f, marks=pytest.mark.skipif(not tensor_core_family_runs(f),
                                             reason=f"the {f} family does not run on this device"))
    for f in ("sm80", "sm90")
]


# Banded patterns for the tensor-core kernels: (Lq, Lk, is_causal, window_size, causal_alignment). They
# cover a window's two edges inside a tile and across tiles, a left bound alone, bottom-right
# alignment as a cache (Lq < Lk) and with more queries than keys (whole tiles of rows that see no
# key), and a top-left window whose last rows see none.
TC_BANDS: Dict[str, Tuple[int, int, bool, Tuple[int, int], str]] = {
    "causal_window": (300, 300, True, (63, 0), "top_left"),
    "two_sided_window": (300, 300, False, (40, 17), "top_left"),
    "left_bound_only": (300, 300, False, (100, -1), "top_left"),
    "bottom_right_cache": (200, 700, True, (-1, -1), "bottom_right"),
    "bottom_right_more_queries": (400, 150, True, (-1, -1), "bottom_right"),
    "bottom_right_window": (200, 700, True, (128, 0), "bottom_right"),
    "top_left_window_past_keys": (500, 200, True, (30, 0), "top_left"),
}


@pytest.mark.parametrize("stats", [False, True], ids=["lean", "stats"])
@pytest.mark.parametrize("mask_kind", ["none", "bool"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("band", list(TC_BANDS))
@pytest.mark.parametrize("family", TC_FAMILIES)
def test_tensor_core_bands_match_reference(monkeypatch: pytest.MonkeyPatch, family: str, band: str,
                                           D: int, mask_kind: str, stats: bool) -> None:
    """ENTROPY_ATTN_CUDA_FAMILY=<family> runs sliding windows and bottom-right alignment in that
    family's kernels, forward and backward (both in the profile), and matches the float64
    reference: output, lse and n_i, with statistics the entropy and sum p^2 (rows that see no key
    come out as zeros, as on the CPU), and the gradients of q, k, v (also against the fallback's).
    (Dry run: the CPU op against the same reference, no profile.)"""
    Lq, Lk, causal, window, alignment = TC_BANDS[band]
    torch.manual_seed(3)
    q, k, v = (cuda(t).requires_grad_() for t in make_qkv(1, 4, 2, Lq, Lk, D, dtype=torch.bfloat16))
    mask = cuda(torch.rand(Lq, Lk, generator=torch.Generator().manual_seed(4)) < 0.85) if mask_kind == "bool" else None
    kw: Dict[str, Any] = dict(is_causal=causal, window_size=list(window), causal_alignment=alignment,
                              enable_gqa=True, return_stats=stats)
    monkeypatch.setenv("ENTROPY_ATTN_CUDA_FAMILY", family)
    monkeypatch.setenv("ENTROPY_ATTN_SPLIT_KV", "off")  # (split-KV's own test covers its kernels)
    res: list = []
    ran = family_kernels(lambda: res.append(OP(q, k, v, mask, None, **kw)), family, "forward_kernel")
    assert DRY_RUN or ran, f"the {family} forward did not run"
    out = res[0]
    rin = [leaf64(t) for t in (q, k, v)]
    ref = reference_attention_raw(*rin, mask.cpu() if mask is not None else None, None,
                                  **{**kw, "window_size": window})
    oat, ort = OUT_TOL[torch.bfloat16]
    sat, srt = STAT_TOL[torch.bfloat16]
    assert_close64(out[0].detach().cpu(), ref.output, oat, ort, "output")
    assert_close64(out[1].cpu(), ref.lse, sat, srt, "lse")
    assert torch.equal(out[5].cpu(), ref.n_keys), "n_keys"
    if stats:
        assert_close64(out[2].cpu(), ref.entropy, sat, srt, "entropy")
        assert_close64(out[3].cpu(), ref.sum_p2, sat, srt, "sum_p2")
    go = torch.randn_like(out[0])
    grads: list = []
    ran = family_kernels(lambda: grads.extend(torch.autograd.grad(out[0], (q, k, v), go)), family,
                         "main_kernel")
    assert DRY_RUN or ran, f"the {family} backward did not run"
    ref_grads = grads_of([ref.output], [go.cpu()], rin)
    for a, e, name in zip(grads, ref_grads, ("dq", "dk", "dv")):
        assert rel_err(a, e) < GRAD_TOL[torch.bfloat16], f"{name} vs reference"
    monkeypatch.setenv("ENTROPY_ATTN_CUDA_FAMILY", "fallback")
    fb = OP(q, k, v, mask, None, **kw)
    fb_grads = torch.autograd.grad(fb[0], (q, k, v), go)
    for a, b_, name in zip(grads, fb_grads, ("dq", "dk", "dv")):
        assert rel_err(a, b_) < 2 * GRAD_TOL[torch.bfloat16], name


def assert_matches_reference(out: Sequence[Tensor], ref: Any, dtype: torch.dtype, stats: bool) -> None:
    """An op result against the float64 reference (reference_attention_raw) at the dtype's
    tolerances: output, lse and n_i, and with statistics the entropy, sum p^2, max weight and the
    derived statistics."""
    oat, ort = OUT_TOL[dtype]
    sat, srt = STAT_TOL[dtype]
    assert_close64(out[0].detach().cpu(), ref.output, oat, ort, "output")
    assert_close64(out[1].detach().cpu(), ref.lse, sat, srt, "lse")
    assert torch.equal(out[5].cpu(), ref.n_keys), "n_keys"
    if stats:
        for i, name in ((2, "entropy"), (3, "sum_p2"), (4, "max_weight"), (8, "normalized_entropy"),
                        (9, "sparsity"), (10, "effective_keys")):
            assert_close64(out[i].detach().cpu(), getattr(ref, name), sat, srt, name)


def family_kernels(fn: Callable[[], Any], family: str, kernel: str) -> List[str]:
    """Runs fn; on a GPU, the names of the kernels called `kernel` of `family` that it launched
    (none in the dry run)."""
    if DRY_RUN:
        fn()
        return []
    return [n for n in cuda_kernel_names(fn) if f"{family}::" in n and kernel in n]


#: Calls of the features the tensor-core kernels take besides bands: packed documents (varlen, which
#: aligns bottom-right within each document), attention sinks, logit softcapping and dropout, alone
#: and as gpt-oss (sinks + window) and Gemma 2 (softcap + window) combine them. Each is (Lq, Lk) of a
#: dense call or (q_lens, k_lens) of a packed one, and the op's keyword arguments ("sinks": one
#: logit per head; "mask": a bool or additive (Lq, Lk) mask). The documents straddle query tiles
#: (128 rows) and key blocks, include one of a single token, and, as a cache, hold fewer queries
#: than keys; "rows_without_keys" puts all of some rows' weight on the sink.
TC_FEATURES: Dict[str, Tuple[Any, Any, Dict[str, Any]]] = {
    "documents": ([1, 130, 200, 57, 300], [1, 130, 200, 57, 300], {}),
    "documents_causal_window": ([1, 130, 200, 57, 300], [1, 130, 200, 57, 300],
                                {"is_causal": True, "window_size": (40, 0)}),
    "documents_cache": ([10, 1, 150], [300, 40, 200], {"is_causal": True}),
    # Empty documents, and a 130-row document with no keys: a whole tile of rows that see none.
    "documents_empty": ([0, 6, 0, 130, 9], [3, 6, 0, 0, 200], {"is_causal": True}),
    "documents_softcap_sinks_window": ([1, 130, 200, 57, 300], [1, 130, 200, 57, 300],
                                       {"is_causal": True, "window_size": (63, 0), "softcap": 2.0,
                                        "sinks": True}),
    "sinks_causal": (300, 300, {"is_causal": True, "sinks": True}),
    "sinks_rows_without_keys": (400, 150, {"is_causal": True, "causal_alignment": "bottom_right",
                                           "sinks": True}),
    "softcap_bool_mask": (300, 300, {"is_causal": True, "softcap": 2.0, "mask": "bool"}),
    "softcap_sinks_window": (300, 300, {"is_causal": True, "window_size": (63, 0), "softcap": 2.0,
                                        "sinks": True}),
    # The backward of softcap with an additive mask is no tensor-core family's: routed.
    "softcap_additive_mask": (300, 300, {"softcap": 2.0, "mask": "additive"}),
    # Dropout, with the op's seed so that the reference draws the same Philox mask; full attention
    # takes the general kernels too.
    "dropout_causal": (300, 300, {"is_causal": True, "dropout_p": 0.2, "dropout_seed": 11}),
    "dropout_bool_mask": (300, 260, {"dropout_p": 0.3, "dropout_seed": 3, "mask": "bool"}),
    "dropout_additive_mask": (200, 300, {"dropout_p": 0.1, "dropout_seed": 2**40 + 5,
                                         "mask": "additive"}),
    "dropout_sinks_window": (300, 300, {"is_causal": True, "window_size": (63, 0), "sinks": True,
                                        "dropout_p": 0.25, "dropout_seed": 17}),
}


def feature_leaves(spec: Dict[str, Any], q: Tensor, k: Tensor, v: Tensor, Lq: Any,
                   Lk: Any) -> Tuple[Optional[Tensor], Optional[Tensor], List[Tensor]]:
    """A feature spec's (TC_FEATURES) sinks (one logit per query head) and (Lq, Lk) bool or
    additive mask on the CPU, and the differentiable CUDA leaves q, k, v (and the sinks)."""
    sinks = randn(q.shape[-2] if q.dim() == 3 else q.shape[1]) if spec.get("sinks") else None
    mask = None
    if spec.get("mask") is not None:
        keep = torch.rand(Lq, Lk, generator=torch.Generator().manual_seed(6)) < 0.85
        mask = keep if spec["mask"] == "bool" else torch.where(keep, randn(Lq, Lk), torch.tensor(-math.inf))
    leaves = [cuda(t).requires_grad_() for t in (q, k, v)]
    if sinks is not None:
        leaves.append(cuda(sinks).requires_grad_())
    return sinks, mask, leaves


@pytest.mark.parametrize("stats", [False, True], ids=["lean", "stats"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("case", list(TC_FEATURES))
@pytest.mark.parametrize("family", TC_FAMILIES)
def test_tensor_core_features_match_reference(monkeypatch: pytest.MonkeyPatch, family: str, case: str, D: int,
                                              stats: bool) -> None:
    """ENTROPY_ATTN_CUDA_FAMILY=<family> runs packed documents, sinks, softcapping and dropout in
    that family's kernels (forward and backward in the profile, the backward of softcap with an
    additive mask routed elsewhere) and matches the float64 reference (dropout: the reference's
    independent Philox mask, weight for weight): output, lse and n_i, with
    statistics the entropy, sum p^2, max weight and derived statistics, and the gradients of q, k,
    v (and of the sinks) through the output and, with statistics, the entropy. (Dry run: the CPU op
    against the same reference, no profile.)"""
    from test_varlen import offsets, per_document_reference

    first, second, spec = TC_FEATURES[case]
    kw = {key: val for key, val in spec.items() if key not in ("sinks", "mask")}
    H, Hkv = 4, 2
    torch.manual_seed(5)
    packed = isinstance(first, list)
    if packed:
        T, Tk = sum(first), sum(second)
        q = randn(T, H, D, dtype=torch.bfloat16)
        k, v = randn(Tk, Hkv, D, dtype=torch.bfloat16), randn(Tk, Hkv, D, dtype=torch.bfloat16)
    else:
        q, k, v = make_qkv(1, H, Hkv, first, second, D, dtype=torch.bfloat16)
    sinks, mask, leaves = feature_leaves(spec, q, k, v, first, second)
    sink_leaf = leaves[3] if sinks is not None else None

    def run() -> Tuple[Tensor, ...]:
        if packed:
            return torch.ops.entropy_attn.varlen_attention(
                *leaves[:3], offsets(first, DEV.type), offsets(second, DEV.type), max(first), max(second),
                enable_gqa=True, sinks=sink_leaf, return_stats=stats, **kw)
        return OP(*leaves[:3], cuda(mask), None, enable_gqa=True, sinks=sink_leaf, return_stats=stats, **kw)

    monkeypatch.setenv("ENTROPY_ATTN_CUDA_FAMILY", family)
    monkeypatch.setenv("ENTROPY_ATTN_SPLIT_KV", "off")  # (split-KV's own test covers its kernels)
    res: list = []
    ran = family_kernels(lambda: res.append(run()), family, "forward_kernel")
    assert DRY_RUN or ran, f"the {family} forward did not run"
    out = res[0]
    rin = [leaf64(t) for t in leaves]
    rkw = {**kw, "sinks": rin[3] if sinks is not None else None}
    if packed:
        rk, rv = (x.repeat_interleave(H // Hkv, dim=1) for x in rin[1:3])
        want = dict(zip(OUT_NAMES, per_document_reference(rin[0], rk, rv, first, second, **rkw)))
    else:
        r = reference_attention_raw(*rin[:3], mask, None, enable_gqa=True, **rkw)
        want = {name: getattr(r, name) for name in OUT_NAMES}
    oat, ort = OUT_TOL[torch.bfloat16]
    sat, srt = STAT_TOL[torch.bfloat16]
    assert_close64(out[0].detach().cpu(), want["output"], oat, ort, "output")
    assert_close64(out[1].detach().cpu(), want["lse"], sat, srt, "lse")
    assert torch.equal(out[5].cpu(), want["n_keys"]), "n_keys"
    if stats:  # (with a sink the derived statistics count it: n_i + 1 outcomes)
        for i, name in ((2, "entropy"), (3, "sum_p2"), (4, "max_weight"), (8, "normalized_entropy"),
                        (9, "sparsity"), (10, "effective_keys")):
            assert_close64(out[i].detach().cpu(), want[name], sat, srt, name)

    # Gradients through the output and, with statistics, the entropy (the kernels' other branch).
    go = torch.randn_like(out[0])
    ge = torch.randn_like(out[2]) if stats else None
    grads: list = []
    # The backward of softcap with a mask is routed: with an additive one to the fallback, with a
    # bool one from sm90 to sm80 (their kernels have no registers for it); so is that of dropout
    # with a mask from sm90 to sm80.
    routed = case == "softcap_bool_mask" or ("dropout_p" in spec and mask is not None)
    bwd_family = "sm80" if routed else family
    ran = family_kernels(lambda: grads.extend(grads_of([out[0], out[2]], [go, ge], leaves)), bwd_family,
                         "main_kernel")
    if case == "softcap_additive_mask":
        assert not ran, f"the {family} backward ran softcap with an additive mask"
    else:
        assert DRY_RUN or ran, f"the {bwd_family} backward did not run"
    ref_grads = grads_of([want["output"], want["entropy"]], [go.cpu(), None if ge is None else ge.cpu()], rin)
    for a, e, name in zip(grads, ref_grads, ("dq", "dk", "dv", "dsinks")):
        assert rel_err(a, e) < GRAD_TOL[torch.bfloat16], f"{name} vs reference"


def sm80_backward_fits_head_dim_256() -> bool:
    """Whether the GPU offers a block the 209 KB of shared memory of the sm80 backward at D = 256
    (csrc/cuda/sm80/launch.h: an H100 or H200 does, an A100 does not)."""
    props = torch.cuda.get_device_properties(DEV)
    optin = getattr(props, "shared_memory_per_block_optin", None)
    return optin >= 214272 if optin is not None else torch.cuda.get_device_capability(DEV) >= (9, 0)


#: Head dim 256 on the tensor-core family (Gemma's head dim): (Lq, Lk, the op's keyword arguments,
#: as TC_FEATURES). Lengths that are no multiple of its tiles (64 x 32 forward, 64 x 64 backward),
#: GQA, and the features Gemma 2 and 3 use (softcap with a sliding window), a cache (bottom-right),
#: sinks and dropout in the general kernels, and a decoding step that split-KV cuts into parts.
HEAD_DIM_256_CASES: Dict[str, Tuple[int, int, Dict[str, Any]]] = {
    "full": (177, 293, {}),
    "causal": (293, 293, {"is_causal": True}),
    "bool_mask": (177, 293, {"mask": "bool"}),
    "additive_mask_causal": (177, 293, {"is_causal": True, "mask": "additive"}),
    "gemma2_softcap_window": (300, 300, {"is_causal": True, "window_size": (63, 0), "softcap": 2.0}),
    "cache_bottom_right": (70, 333, {"is_causal": True, "causal_alignment": "bottom_right"}),
    "sinks_dropout": (150, 150, {"is_causal": True, "sinks": True, "dropout_p": 0.2, "dropout_seed": 5}),
    "decode_split": (1, 1500, {"split": "5"}),
}


#: Whether this build has the Hopper kernels at head dim 256 (compiled on request, kernels.toml).
HOPPER_256_BUILT = getattr(_build_info, "UNTESTED_KERNELS", False)


def hopper_runs_256(spec: Dict[str, Any], direction: str = "forward") -> bool:
    """Whether the forced Hopper family runs a head-dim-256 call with the keyword arguments `spec` in
    its own kernels of `direction` ("forward" or "backward"): where the build has them
    (HOPPER_256_BUILT); the forward where split-KV (the sm80 family's) does not cut it, the
    backward but with softcap or dropout beside a mask (sm90/launch.h: backward_covers); else the
    sm80 family's kernels run it."""
    if direction == "forward":
        return HOPPER_256_BUILT and spec.get("split", "off") == "off"
    return HOPPER_256_BUILT and not ("mask" in spec and (spec.get("softcap") or spec.get("dropout_p")))


def check_head_dim_256(monkeypatch: pytest.MonkeyPatch, case: str, dtype: torch.dtype, stats: bool,
                       family: str, forward_family: str, backward_family: str) -> None:
    """A call of HEAD_DIM_256_CASES with ENTROPY_ATTN_CUDA_FAMILY=`family`: its forward runs in
    `forward_family`'s kernels and the backward in `backward_family`'s (sm80's where the GPU has its
    shared memory, the fallback's elsewhere), and they match the float64 reference: output, lse and n_i,
    with statistics the entropy, sum p^2, max weight and derived statistics, and the gradients of q,
    k, v (and the sinks) through the output and, with statistics, the entropy. (Dry run: the CPU op
    against the same reference.)"""
    Lq, Lk, spec = HEAD_DIM_256_CASES[case]
    kw = {key: val for key, val in spec.items() if key not in ("sinks", "mask", "split")}
    H, Hkv, D = 4, 2, 256
    torch.manual_seed(7)
    q, k, v = make_qkv(2, H, Hkv, Lq, Lk, D, dtype=dtype)
    sinks, mask, leaves = feature_leaves(spec, q, k, v, Lq, Lk)
    sink_leaf = leaves[3] if sinks is not None else None
    monkeypatch.setenv("ENTROPY_ATTN_CUDA_FAMILY", family)
    monkeypatch.setenv("ENTROPY_ATTN_SPLIT_KV", spec.get("split", "off"))
    res: list = []
    run = lambda: res.append(OP(*leaves[:3], cuda(mask), None, enable_gqa=True, sinks=sink_leaf,  # noqa: E731
                                return_stats=stats, **kw))
    ran = family_kernels(run, forward_family, "forward_kernel")
    assert DRY_RUN or ran, f"the {forward_family} forward did not run at D = 256"
    out = res[0]
    rin = [leaf64(t) for t in leaves]
    r = reference_attention_raw(*rin[:3], mask, None, enable_gqa=True,
                                sinks=rin[3] if sinks is not None else None, **kw)
    assert_matches_reference(out, r, dtype, stats)

    go = torch.randn_like(out[0])
    ge = torch.randn_like(out[2]) if stats else None
    grads: list = []
    ran = family_kernels(lambda: grads.extend(grads_of([out[0], out[2]], [go, ge], leaves)),
                         backward_family, "main_kernel")
    if not DRY_RUN and (backward_family == "sm90" or sm80_backward_fits_head_dim_256()):
        assert ran, f"the {backward_family} backward did not run at D = 256"
    elif not DRY_RUN:
        assert not ran, "the sm80 backward ran without the shared memory it needs"
    ref_grads = grads_of([r.output, r.entropy], [go.cpu(), None if ge is None else ge.cpu()], rin)
    for a, e, name in zip(grads, ref_grads, ("dq", "dk", "dv", "dsinks")):
        assert rel_err(a, e) < GRAD_TOL[dtype], f"{name} vs reference"


@pytest.mark.skipif(not DRY_RUN and not (HAS_CUDA and torch.cuda.get_device_capability(DEV) >= (8, 0)),
                    reason="the sm80 family needs a GPU of compute capability 8.0 or newer")
@pytest.mark.parametrize("stats", [False, True], ids=["lean", "stats"])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", list(HEAD_DIM_256_CASES))
def test_head_dim_256_matches_reference(monkeypatch: pytest.MonkeyPatch, case: str, dtype: torch.dtype,
                                        stats: bool) -> None:
    """The default choice ("auto": family.h, kTensorCoreHeadDim256ByDefault, and
    kHopperHeadDim256ByDefault and kHopperBackwardHeadDim256ByDefault off) runs head dim 256 in the
    sm80 family's kernels, forward and backward (check_head_dim_256)."""
    check_head_dim_256(monkeypatch, case, dtype, stats, "auto", "sm80", "sm80")


@pytest.mark.hopper_256
@pytest.mark.skipif(not DRY_RUN and not is_hopper(), reason="the sm90 family needs a compute capability 9.0 GPU")
@pytest.mark.skipif(not DRY_RUN and not HOPPER_256_BUILT,
                    reason="the Hopper kernels at head dim 256 are compiled on request "
                           "(ENTROPY_ATTN_UNTESTED_KERNELS=1)")
@pytest.mark.parametrize("stats", [False, True], ids=["lean", "stats"])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", list(HEAD_DIM_256_CASES))
def test_hopper_head_dim_256_matches_reference(monkeypatch: pytest.MonkeyPatch, case: str, dtype: torch.dtype,
                                               stats: bool) -> None:
    """With the Hopper family forced, head dim 256 runs in its kernels (64-key blocks,
    sm90/fwd_kernel.cuh and bwd_kernel.cuh; off by default until this passes on a GPU: family.h,
    kHopperHeadDim256ByDefault, kHopperBackwardHeadDim256ByDefault) wherever kernels.toml has them:
    every case but the forward of split-KV decoding, the sm80 family's (check_head_dim_256)."""
    spec = HEAD_DIM_256_CASES[case][2]
    families = ["sm90" if hopper_runs_256(spec, d) else "sm80" for d in ("forward", "backward")]
    check_head_dim_256(monkeypatch, case, dtype, stats, "sm90", *families)


@real_cuda
def test_cuda_graph_capture() -> None:
    """A dense call captured in a CUDA graph replays as the eager call (no host synchronization in
    it), with statistics; with dropout the capture raises instead of freezing one call's seed into
    the graph (every replay would drop the same weights)."""
    q, k, v = (cuda(t) for t in make_qkv(2, 4, 2, 200, 300, 64, dtype=torch.bfloat16))
    call = lambda: torch_ext.attention(q, k, v, is_causal=True, enable_gqa=True, scale="logn",  # noqa: E731
                                       return_stats=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture, as torch.cuda.graphs asks
        eager = call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    q.copy_(q * 0.5)
    eager = call()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1].entropy, eager[1].entropy)
    with pytest.raises(RuntimeError, match="attention dropout cannot be captured in a CUDA graph"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            torch_ext.attention(q, k, v, enable_gqa=True, dropout_p=0.1)


#: The shared memory per block of sm_86/89/120 (RTX 30-50 series, A10, L4, L40): 99 KB.
SMALL_GPU_SMEM = 101376
#: Calls as such a GPU runs them with the sm80 family forced (dtype, head_dim, v_head_dim, Lq, Lk,
#: the op's keyword arguments as TC_FEATURES): the 16-bit backward at head dims 129-256 in the
#: fallback's compact tiles (Gemma's 256 with softcap + window, DeepSeek's 192 / 128), at 128 in the
#: sm80 backward's compact tiles (its full ones' 161 KB do not fit: test_compact_backward_...), at 64
#: in the sm80 backward (97 KB).
SMALL_GPU_CASES: Dict[str, Tuple[torch.dtype, int, int, int, int, Dict[str, Any]]] = {
    "bf16_d256_softcap_window": (torch.bfloat16, 256, 256, 150, 150,
                                 {"is_causal": True, "softcap": 30.0, "window_size": (60, 0)}),
    "f16_d192_dv128_mask": (torch.float16, 192, 128, 70, 90, {"mask": "additive"}),
    "bf16_d128_causal": (torch.bfloat16, 128, 128, 150, 150, {"is_causal": True}),
    "bf16_d64_sinks": (torch.bfloat16, 64, 64, 100, 130, {"sinks": True}),
}


@pytest.mark.parametrize("case", list(SMALL_GPU_CASES))
def test_gpu_of_99KB_per_block(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """Run as a GPU of 99 KB per block runs them (ENTROPY_ATTN_CUDA_SMEM_PER_BLOCK, on any larger
    GPU), forward and backward match the float64 reference, the backward of head dims 129-256 in the
    fallback's compact kernel (its tiles of 32 rows need 156 KB); the float32 backward at 256, which
    needs 107 KB in any tiles, raises naming the shared memory. (Dry run: the CPU op.)"""
    dtype, D, Dv, Lq, Lk, spec = SMALL_GPU_CASES[case]
    kw = {key: val for key, val in spec.items() if key not in ("sinks", "mask")}
    monkeypatch.setenv("ENTROPY_ATTN_CUDA_SMEM_PER_BLOCK", str(SMALL_GPU_SMEM))
    monkeypatch.setenv("ENTROPY_ATTN_CUDA_FAMILY", "sm80")
    torch.manual_seed(11)
    q, k, v = make_qkv(1, 4, 2, Lq, Lk, D, dtype=dtype, Dv=Dv)
    sinks, mask, leaves = feature_leaves(spec, q, k, v, Lq, Lk)
    out = OP(*leaves[:3], cuda(mask), None, enable_gqa=True, sinks=leaves[3] if sinks is not None else None,
             return_stats=True, **kw)
    rin = [leaf64(t) for t in leaves]
    r = reference_attention_raw(*rin[:3], mask, None, enable_gqa=True,
                                sinks=rin[3] if sinks is not None else None, **kw)
    assert_matches_reference(out, r, dtype, True)
    go, ge = torch.randn_like(out[0]), torch.randn_like(out[2])
    grads: list = []
    compact = family_kernels(lambda: grads.extend(grads_of([out[0], out[2]], [go, ge], leaves)), "fallback",
                             "attention_bwd_compact_kernel")
    assert DRY_RUN or bool(compact) == (max(D, Dv) > 128), compact
    ref_grads = grads_of([r.output, r.entropy], [go.cpu(), ge.cpu()], rin)
    for a, e, name in zip(grads, ref_grads, ("dq", "dk", "dv", "dsinks")):
        assert rel_err(a, e) < GRAD_TOL[dtype], f"{name} vs reference"
    if not DRY_RUN and case == "bf16_d256_softcap_window":
        q32 = cuda(q.float()).requires_grad_()
        o = OP(q32, cuda(k.float()), cuda(v.float()), None, None, enable_gqa=True, **kw)[0]
        with pytest.raises(RuntimeError, match="shared memory per block, but CUDA device .* allows 101376"):
            o.sum().backward()


#: Values of the CUDA path's environment variables that are no setting: (variable, value).
BAD_CUDA_SETTINGS = [
    ("ENTROPY_ATTN_CUDA_FAMILY", "sm70"),
    ("ENTROPY_ATTN_SPLIT_KV", "many"),
    ("ENTROPY_ATTN_SPLIT_KV", "0"),
    ("ENTROPY_ATTN_CUDA_LAUNCH_ORDER", "-3"),
    ("ENTROPY_ATTN_CUDA_SMEM_PER_BLOCK", "0"),
    ("ENTROPY_ATTN_CUDA_SMEM_PER_BLOCK", " +4096"),
    ("ENTROPY_ATTN_CUDA_SMEM_PER_BLOCK", "99999999999999999999"),  # (strtol: LONG_MAX, no cap)
    ("ENTROPY_ATTN_CUDA_SMEM_PER_BLOCK", "96KB"),
]


@real_cuda
@pytest.mark.parametrize("name,value", BAD_CUDA_SETTINGS, ids=[f"{n}={v!r}" for n, v in BAD_CUDA_SETTINGS])
def test_bad_environment_settings_raise(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    """A CUDA call under a malformed setting raises a ValueError naming the variable, rather than
    running as if it were unset or something else (the CPU op reads none of them)."""
    tensor_core_only = name in ("ENTROPY_ATTN_SPLIT_KV", "ENTROPY_ATTN_CUDA_LAUNCH_ORDER")
    if tensor_core_only and torch.cuda.get_device_capability(DEV) < (8, 0):
        pytest.skip(f"{name} is read by the tensor-core families (sm_80 and newer) only")
    monkeypatch.setenv(name, value)
    q, k, v = make_qkv(1, 4, 4, 3, 300, 64, dtype=torch.bfloat16)  # (a call split-KV would split)
    with pytest.raises(ValueError, match=name):
        OP(cuda(q), cuda(k), cuda(v), None, None, is_causal=True)


#: Calls at head dim 128 as a GPU of 99 KB per block runs their backward in the sm80 family's compact
#: tiles (64 x 64, one dO buffer): (dtype, Hkv, Lq, Lk, the op's keyword arguments as TC_FEATURES,
#: deterministic). Partial key blocks, GQA groups whose key blocks walk several query heads' blocks
#: (the one dO buffer reloaded at each), the masked and the general instantiations, the
#: deterministic dq kernel.
COMPACT_BACKWARD_CASES: Dict[str, Tuple[torch.dtype, int, int, int, Dict[str, Any], bool]] = {
    "bf16_full_gqa": (torch.bfloat16, 2, 150, 230, {}, False),
    "f16_causal_logn": (torch.float16, 4, 200, 200, {"is_causal": True, "scale_mode": "logn"}, False),
    "bf16_bool_mask": (torch.bfloat16, 2, 130, 170, {"mask": "bool"}, False),
    "f16_additive_mask_causal": (torch.float16, 2, 140, 140, {"mask": "additive", "is_causal": True}, False),
    "bf16_window_sinks": (torch.bfloat16, 2, 180, 180, {"is_causal": True, "window_size": (50, 0), "sinks": True},
                          False),
    "bf16_causal_deterministic": (torch.bfloat16, 2, 150, 150, {"is_causal": True}, True),
}


@pytest.mark.parametrize("case", list(COMPACT_BACKWARD_CASES))
def test_compact_backward_matches_reference(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """With the shared memory per block of sm_86/89/120 (ENTROPY_ATTN_CUDA_SMEM_PER_BLOCK, on any
    larger GPU) and ENTROPY_ATTN_CUDA_FAMILY=sm80, the backward at head dim 128 runs the sm80 main
    kernel with its compact tiles, and the gradients of q, k, v (and the sinks) through the output
    and the entropy match the float64 reference; "auto" takes them too (family.h:
    kTensorCoreCompactBackwardByDefault) where the Hopper family does not take the call. (Dry run:
    the CPU op against the same reference.)"""
    dtype, Hkv, Lq, Lk, spec, deterministic = COMPACT_BACKWARD_CASES[case]
    kw = {key: val for key, val in spec.items() if key not in ("sinks", "mask")}
    monkeypatch.setenv("ENTROPY_ATTN_CUDA_SMEM_PER_BLOCK", str(SMALL_GPU_SMEM))
    torch.manual_seed(13)
    q, k, v = make_qkv(2, 4, Hkv, Lq, Lk, 128, dtype=dtype)
    sinks, mask, leaves = feature_leaves(spec, q, k, v, Lq, Lk)
    extra = {"sinks": leaves[3]} if sinks is not None else {}
    go = randn(2, 4, Lq, 128).to(dtype)
    ge = randn(2, 4, Lq)
    rin = [leaf64(t) for t in leaves]
    r = reference_attention_raw(*rin[:3], mask, None, enable_gqa=True,
                                sinks=rin[3] if sinks is not None else None, **kw)
    ref_grads = grads_of([r.output, r.entropy], [go, ge], rin)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        for family in ("sm80", "auto"):
            monkeypatch.setenv("ENTROPY_ATTN_CUDA_FAMILY", family)
            out = OP(*leaves[:3], cuda(mask), None, enable_gqa=True, return_stats=True, **extra, **kw)
            grads: list = []
            names = family_kernels(lambda: grads.extend(grads_of([out[0], out[2]], [cuda(go), cuda(ge)], leaves)),
                                   "sm80", "main_kernel")
            # (BwdTraits<T, 128, kCompact, Ops>: the demangled name spells every argument.)
            compact = [n for n in names if re.search(r"BwdTraits<[^<>,]+, 128, true", n)]
            # (Under "auto" an H100 runs the Hopper backward, but for a deterministic one.)
            if family == "sm80" or deterministic or not is_hopper():
                assert DRY_RUN or compact, f"{family}: the sm80 backward's compact tiles did not run"
            for a, e, name in zip(grads, ref_grads, ("dq", "dk", "dv", "dsinks")):
                assert rel_err(a, e) < GRAD_TOL[dtype], f"{family}: {name} vs reference"
    finally:
        torch.use_deterministic_algorithms(previous)


#: Additive masks whose gradient a call asks for (learned biases), as (mask shape, the fraction of
#: -inf entries, the op's keyword arguments) over B = 2, H = 4, Hkv = 2, Lq = 200, Lk = 260: T5's
#: per-head bias under causality with logn row scales, a per-key offset (padding) and one per head
#: and key under causality (both summed over a warp's rows before their atomics: logit_grads.cuh),
#: a per-row one (whose gradient is lse's alone: a row's softmax does not move with it; none
#: hidden, a hidden row has no lse to differentiate), and the call's full shape (each entry from
#: one logit).
MASK_GRAD_CASES: Dict[str, Tuple[Tuple[int, ...], float, Dict[str, Any]]] = {
    "per_head_t5_causal_logn": ((1, 4, 200, 260), 0.2, {"is_causal": True, "scale_mode": "logn", "log_base": 64.0}),
    "per_key": ((2, 1, 1, 260), 0.2, {}),
    "per_head_key_causal": ((1, 4, 1, 260), 0.2, {"is_causal": True}),
    "per_row_causal": ((2, 4, 200, 1), 0.0, {"is_causal": True}),
    "full": ((2, 4, 200, 260), 0.2, {}),
}


@pytest.mark.parametrize("loss", ["with_entropy", "output_alone"])
@pytest.mark.parametrize("family", ["auto", *FAMILY_PARAMS])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", list(MASK_GRAD_CASES))
def test_mask_grad_runs_in_the_tensor_core_backward(monkeypatch: pytest.MonkeyPatch, case: str, dtype: torch.dtype,
                                                    head_dim: int, family: str, loss: str) -> None:
    """A 16-bit call that asks for its additive mask's gradient runs its backward in a tensor-core
    family (fp32 atomics from the tiles' dS into the mask's entries: logit_grads.cuh), over several
    query and key tiles with partial edges and GQA; the gradients of q, k, v and the mask through
    the output, lse and (with_entropy) the entropy match the float64 reference, and hidden entries
    get 0. The sm80 family's backward runs it, but with the Hopper family forced and a loss of the
    output and lse alone (T5 trained as usual), where the Hopper backward writes it itself
    (sm90/bwd_kernel.cuh: kLogitGrads; its step that keeps the logits for the entropy's gradient
    has no registers for the atomics); "auto" leaves that call to the sm80 family too until it has
    passed here (family.h: kHopperMaskGradByDefault). (Dry run: the CPU op against the same
    reference.)"""
    shape, fraction, kw = MASK_GRAD_CASES[case]
    monkeypatch.setenv("ENTROPY_ATTN_CUDA_FAMILY", family)
    torch.manual_seed(17)
    q, k, v = make_qkv(2, 4, 2, 200, 260, head_dim, dtype=dtype)
    hidden = torch.rand(shape, generator=torch.Generator().manual_seed(7)) < fraction
    mask = randn(*shape, scale=0.5).masked_fill(hidden, -math.inf).to(dtype)
    go, gl, ge = randn(2, 4, 200, head_dim).to(dtype), randn(2, 4, 200), randn(2, 4, 200)
    upstream = [go, gl, ge] if loss == "with_entropy" else [go, gl]
    leaves = [cuda(t).requires_grad_() for t in (q, k, v, mask)]
    grads: List[Tensor] = []

    def run() -> None:
        out = OP(*leaves[:3], leaves[3], None, enable_gqa=True, **kw)
        grads.extend(grads_of(out[:len(upstream)], [cuda(u) for u in upstream], leaves))

    ran = "sm90" if family == "sm90" and loss == "output_alone" else "sm80"
    names = family_kernels(run, ran, "main_kernel")
    assert DRY_RUN or names, f"{family}: the {ran} backward did not run"
    rin = [leaf64(t) for t in leaves]
    r = reference_attention_raw(*rin, None, enable_gqa=True, **kw)
    ref_grads = grads_of([r.output, r.lse, r.entropy][:len(upstream)], upstream, rin)
    assert ref_grads[3].abs().max() > 1e-3, "the case gives the mask a gradient"
    for a, e, name in zip(grads, ref_grads, ("dq", "dk", "dv", "dmask")):
        assert a.shape == e.shape and a.dtype == dtype, name
        assert rel_err(a, e) < GRAD_TOL[dtype], f"{family}: {name} vs reference: {rel_err(a, e):.3g}"
    assert (grads[3].cpu()[hidden] == 0).all(), "a hidden key's mask entry has no gradient"


@pytest.mark.parametrize("family", ["auto", pytest.param("sm90", marks=[needs_hopper, pytest.mark.hopper_turns])])
@pytest.mark.parametrize("case", list(MASK_GRAD_CASES))
def test_mask_grad_under_deterministic_algorithms(monkeypatch: pytest.MonkeyPatch, case: str, family: str) -> None:
    """Under torch.use_deterministic_algorithms(True) a bf16 call's additive mask gets its gradient
    from a tensor-core backward whatever the mask broadcasts along: a mask of the call's full shape
    gets each entry from one logit, a broadcast one is written at the full shape and summed over
    its broadcast dims by one reduction, in a fixed order (attention_cuda.cpp: run_backward), not by
    atomics. Two deterministic runs agree bit for bit (dq: sm80's dq kernel, or the Hopper
    backward's turns where sm90 is forced), their backward launches that one reduction more than
    the default one (none more for the full mask), and the gradients match the float64 reference.
    "auto" takes a loss with the entropy's gradient (the sm80 family's backward); the forced Hopper
    family a loss of the output and lse, which its backward takes with a mask's gradient. (Dry run:
    the CPU op.)"""
    shape, fraction, kw = MASK_GRAD_CASES[case]
    monkeypatch.setenv("ENTROPY_ATTN_CUDA_FAMILY", family)
    torch.manual_seed(18)
    q, k, v = make_qkv(2, 4, 2, 200, 260, 64, dtype=torch.bfloat16)
    hidden = torch.rand(shape, generator=torch.Generator().manual_seed(8)) < fraction
    mask = randn(*shape, scale=0.5).masked_fill(hidden, -math.inf).to(torch.bfloat16)
    go, gl, ge = randn(2, 4, 200, 64).to(torch.bfloat16), randn(2, 4, 200), randn(2, 4, 200)
    upstream = [go, gl, ge] if family == "auto" else [go, gl]
    leaves = [cuda(t).requires_grad_() for t in (q, k, v, mask)]

    def backward(deterministic: bool) -> Tuple[List[Tensor], List[str]]:
        """The gradients, and the names of the CUDA kernels their backward launched."""
        with torch_deterministic(deterministic):
            out = OP(*leaves[:3], leaves[3], None, enable_gqa=True, **kw)[:len(upstream)]
            if DRY_RUN:
                return grads_of(out, [cuda(u) for u in upstream], leaves), []
            grads: List[Tensor] = []
            names = cuda_kernel_names(lambda: grads.extend(grads_of(out, [cuda(u) for u in upstream], leaves)))
            return grads, names

    _, default_names = backward(False)
    (first, names), (second, _) = backward(True), backward(True)
    if not DRY_RUN:
        ran = [f for f in ("sm80", "sm90") if any(f"{f}::" in n and "main_kernel" in n for n in names)]
        assert ran, f"no tensor-core backward ran: {names}"
        assert family != "sm90" or ran == ["sm90"], f"the backward ran in {ran}"
        extra = sum("reduce_kernel" in n for n in names) - sum("reduce_kernel" in n for n in default_names)
        assert extra == (0 if case == "full" else 1), f"{extra} reductions more than the default backward's"
    for a, b, name in zip(first, second, ("dq", "dk", "dv", "dmask")):
        assert torch.equal(a, b), f"{name} differs between two runs"
    rin = [leaf64(t) for t in leaves]
    r = reference_attention_raw(*rin, None, enable_gqa=True, **kw)
    ref_grads = grads_of([r.output, r.lse, r.entropy][:len(upstream)], upstream, rin)
    assert ref_grads[3].abs().max() > 1e-3, "the case gives the mask a gradient"
    for a, e, name in zip(first, ref_grads, ("dq", "dk", "dv", "dmask")):
        assert a.shape == e.shape and a.dtype == torch.bfloat16, name
        assert rel_err(a, e) < GRAD_TOL[torch.bfloat16], f"{name} vs reference: {rel_err(a, e):.3g}"
    assert (first[3].cpu()[hidden] == 0).all(), "a hidden key's mask entry has no gradient"


#: Layouts of a 16-bit additive mask: (its shape over B = 2, H = 4, Lq = 150, Lk = 201, how it is
#: viewed, whether it is learned) as a model passes it: a padded batch's fixed mask folded with
#: causality (B, 1, L, L), T5's learned per-head bias (1, H, L, L), a learned per-key offset, and a
#: fixed transposed view at an odd storage offset (a slice of a larger tensor: a key stride of
#: Lq + 1, odd, so that a row's entries lie at either half of their 4-byte words, as its start
#: does). The fixed ones keep the Hopper backward, which leaves learned masks to the sm80 family
#: when the loss has the entropy's gradient, as here.
MASK16_LAYOUTS: Dict[str, Tuple[Tuple[int, ...], str, bool]] = {
    "batch_causal": ((2, 1, 150, 201), "plain", False),
    "per_head_learned": ((1, 4, 150, 201), "plain", True),
    "per_key_learned": ((2, 1, 1, 201), "plain", True),
    "transposed_odd_offset": ((2, 4, 150, 201), "transposed_slice", False),
}


def mask16(shape: Tuple[int, ...], view: str, dtype: torch.dtype) -> Tensor:
    """A 16-bit additive mask of `shape` (a fifth -inf) on the device under test, viewed as named."""
    g = torch.Generator().manual_seed(29)
    values = (torch.randn(shape, generator=g, dtype=F64) * 0.5).masked_fill(torch.rand(shape, generator=g) < 0.2,
                                                                              -math.inf)
    if view == "transposed_slice":
        # (B, H, Lk, Lq + 1) storage from its element 1 of each row, transposed: strides (.., 1, Lq + 1).
        store = torch.zeros(*shape[:2], shape[3], shape[2] + 1, dtype=F64)
        store[..., 1:] = values.transpose(-1, -2)
        mask = cuda(store.to(dtype))[..., 1:].transpose(-1, -2)
        assert mask.storage_offset() % 2 == 1 and mask.stride(-1) % 2 == 1
        return mask
    return cuda(values.to(dtype))


@pytest.mark.parametrize("family", ["auto", "fallback", *FAMILY_PARAMS])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("layout", list(MASK16_LAYOUTS))
def test_16bit_mask_read_as_it_is(monkeypatch: pytest.MonkeyPatch, layout: str, dtype: torch.dtype, head_dim: int,
                                  family: str) -> None:
    """A bf16 or fp16 additive mask of the inputs' dtype reaches the kernels as it is
    (kernel_args.h: MaskElem; no float32 copy of it per call). Every value of either type is a
    float32, so the forward gives bit for bit what the same mask converted to float32 gives, and the
    gradients (a learned mask's included) agree within rounding (atomics add them in any order),
    in every family, for each layout a model passes, the view's strides kept. (Dry run: the CPU
    op, which converts both, so it cannot fail there.)"""
    shape, view, learned = MASK16_LAYOUTS[layout]
    monkeypatch.setenv("ENTROPY_ATTN_CUDA_FAMILY", family)
    torch.manual_seed(31)
    q, k, v = (cuda(t) for t in make_qkv(2, 4, 2, 150, 201, head_dim, dtype=dtype))
    m16 = mask16(shape, view, dtype)
    kw: Dict[str, Any] = {"enable_gqa": True, "return_stats": True, "scale_mode": "logn", "log_base": 64.0,
                          "is_causal": layout == "batch_causal"}
    go, ge = cuda(randn(2, 4, 150, head_dim).to(dtype)), cuda(randn(2, 4, 150))
    results = []
    for mask in (m16, m16.float()):
        # (detach, not clone: a clone of the transposed slice would be a plain contiguous tensor)
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        leaves.append(mask.detach().requires_grad_(learned))
        out = OP(*leaves, None, **kw)
        results.append((out, grads_of([out[0], out[2]], [go, ge], leaves if learned else leaves[:3])))
    (out16, g16), (out32, g32) = results
    for a, b, name in zip(out16, out32, OUT_NAMES):
        assert torch.equal(a, b), f"{family}: {name} differs between the bf16/fp16 mask and its float32 copy"
    names = ("dq", "dk", "dv", "dmask") if learned else ("dq", "dk", "dv")
    if learned:
        assert g16[3].dtype == dtype and g32[3].dtype == torch.float32
    for a, b, name in zip(g16, g32, names):
        assert rel_err(a.float(), b.float()) < GRAD_TOL[dtype] / 4, f"{family}: {name}: {rel_err(a.float(), b.float()):.3g}"


@real_cuda
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
def test_16bit_mask_not_copied_cuda(dtype: torch.dtype) -> None:
    """A (B, H, L, L) bias in the inputs' 16-bit dtype is read in place: the forward and the
    backward grow the allocated memory by much less than the float32 copy of it (twice its
    128 MiB) that a conversion per call made."""
    B_, H_, L_, D_ = 2, 8, 2048, 64
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B_, H_, L_, D_, generator=g).to("cuda", dtype).requires_grad_() for _ in range(3))
    bias = (torch.randn(B_, H_, L_, L_, generator=g) * 0.5).to("cuda", dtype)
    mask_bytes = bias.numel() * bias.element_size()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = OP(q, k, v, bias, None)
    torch.cuda.synchronize()
    outputs = sum(t.numel() * t.element_size() for t in out)
    grown = torch.cuda.max_memory_allocated() - before - outputs
    assert grown < mask_bytes / 4, f"the forward took {grown / 2**20:.0f} MiB beyond its outputs"
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out[0].sum().backward()
    torch.cuda.synchronize()
    gradients = sum(t.numel() * t.element_size() for t in (q, k, v))
    grown = torch.cuda.max_memory_allocated() - before - gradients
    assert grown < mask_bytes / 4, f"the backward took {grown / 2**20:.0f} MiB beyond the gradients"


#: Head dims the tensor-core families do not compile, which they run on zero-padded inputs
#: (csrc/head_dim_padding.h): (head_dim, v_head_dim, Lq, Lk, the op's keyword arguments, as
#: TC_FEATURES). Phi-2's 80 and Phi-3's 96 (padded to 128), 32 (to 64), head_dim != v_head_dim (to
#: the larger one's), DeepSeek's 192 / 128 (to 256: the sm80 family's, or with the Hopper family
#: forced its kernels where the build has them), with masks, causality, a window, the log-n scale and
#: GQA.
PADDED_HEAD_DIM_CASES: Dict[str, Tuple[int, int, int, int, Dict[str, Any]]] = {
    "d80_causal": (80, 80, 177, 177, {"is_causal": True}),
    "d96_bool_mask_logn": (96, 96, 150, 293, {"mask": "bool", "scale_mode": "logn", "log_base": 64.0}),
    "d32_window": (32, 32, 200, 200, {"is_causal": True, "window_size": (40, 0)}),
    "d64_dv128_additive_mask": (64, 128, 130, 170, {"mask": "additive"}),
    "d192_dv128_causal": (192, 128, 140, 140, {"is_causal": True}),
}


@pytest.mark.parametrize("stats", [False, True], ids=["lean", "stats"])
@pytest.mark.parametrize("family, case", [
    pytest.param(f, c, id=f"{f}-{c}",
                 marks=[pytest.mark.skipif(not tensor_core_family_runs(run),
                                           reason=f"the {run} family does not run on this device")]
                 + ([pytest.mark.hopper_256] if f == "sm90" and max(PADDED_HEAD_DIM_CASES[c][:2]) > 128 else []))
    for f, run in (("sm80", "sm80"), ("sm90", "sm90"), ("auto", "sm80")) for c in PADDED_HEAD_DIM_CASES])
def test_padded_head_dims_match_reference(monkeypatch: pytest.MonkeyPatch, family: str, case: str,
                                          stats: bool) -> None:
    """ENTROPY_ATTN_CUDA_FAMILY=<family> runs head dims it does not compile in its kernels on
    zero-padded inputs, as "auto" does (family.h: kTensorCorePaddedHeadDimsByDefault; the Hopper
    family on an H100) (the forward and backward kernels in the profile; a head dim padded to 256
    in the sm80 family's but for the Hopper kernels forced where the build has them, the sm80
    backward where the GPU has the shared memory) and matches the float64 reference: output, lse, n_i and, with statistics, every
    statistic, and the gradients of q, k, v through the output and the entropy. (Dry run: the CPU
    op against the same reference.)"""
    D, Dv, Lq, Lk, spec = PADDED_HEAD_DIM_CASES[case]
    kw = {key: val for key, val in spec.items() if key != "mask"}
    torch.manual_seed(9)
    q, k, v = make_qkv(2, 4, 2, Lq, Lk, D, Dv, dtype=torch.bfloat16)
    _, mask, leaves = feature_leaves(spec, q, k, v, Lq, Lk)
    monkeypatch.setenv("ENTROPY_ATTN_CUDA_FAMILY", family)
    monkeypatch.setenv("ENTROPY_ATTN_SPLIT_KV", "off")
    padded_to_256 = max(D, Dv) > 128
    chosen = ("sm90" if is_hopper() else "sm80") if family == "auto" else family
    # At 256 the forced Hopper family runs its kernels where it has them (hopper_runs_256), the
    # sm80 family the rest.
    at_256 = {d: "sm90" if family == "sm90" and hopper_runs_256(spec, d) else "sm80"
              for d in ("forward", "backward")}
    fwd_family = at_256["forward"] if padded_to_256 else chosen
    bwd_family = at_256["backward"] if padded_to_256 else chosen
    res: list = []
    ran = family_kernels(lambda: res.append(OP(*leaves, cuda(mask), None, enable_gqa=True,
                                               return_stats=stats, **kw)), fwd_family, "forward_kernel")
    assert DRY_RUN or ran, f"the {fwd_family} forward did not run on the padded call"
    out = res[0]
    assert out[0].shape == (2, 4, Lq, Dv) and out[0].is_contiguous()
    rin = [leaf64(t) for t in leaves]
    r = reference_attention_raw(*rin, mask, None, enable_gqa=True, **kw)
    assert_matches_reference(out, r, torch.bfloat16, stats)
    go = torch.randn_like(out[0])
    ge = torch.randn_like(out[2]) if stats else None
    grads: list = []
    ran = family_kernels(lambda: grads.extend(grads_of([out[0], out[2]], [go, ge], leaves)), bwd_family,
                         "main_kernel")
    if not DRY_RUN and (not padded_to_256 or bwd_family == "sm90" or sm80_backward_fits_head_dim_256()):
        assert ran, f"the {bwd_family} backward did not run on the padded call"
    assert all(g.shape == x.shape and g.is_contiguous() for g, x in zip(grads, leaves))
    ref_grads = grads_of([r.output, r.entropy], [go.cpu(), None if ge is None else ge.cpu()], rin)
    for a, e, name in zip(grads, ref_grads, ("dq", "dk", "dv")):
        assert rel_err(a, e) < GRAD_TOL[torch.bfloat16], f"{name} vs reference"


@real_cuda
@pytest.mark.parametrize(
    "case",
    ["float32", "softcap", "sinks", "dropout", "unaligned_rows", "head_dim_96",
     pytest.param("deterministic", marks=pytest.mark.hopper_turns)],
)
def test_forced_hopper_family_routes_what_it_lacks(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """ENTROPY_ATTN_CUDA_FAMILY=sm90 on calls the Hopper family does not cover (float32, unaligned
    rows; on any GPU) gives the fallback's outputs and gradients: the selection point routes them,
    never a wrong answer; head dim 96, which it runs on inputs padded to 128, gives them too. A deterministic backward
    runs its dq in turns (test_hopper_deterministic_backward). Softcap, sinks and dropout, which the forced tensor-core families take
    (sm90, or sm80 on other GPUs), agree with the fallback too (dropout: the same Philox mask)."""
    torch.manual_seed(2)
    dtype = torch.float32 if case == "float32" else torch.bfloat16
    D = 96 if case == "head_dim_96" else 64
    q, k, v = (cuda(t) for t in make_qkv(1, 2, 2, 150, 150, D, dtype=dtype))
    if case == "unaligned_rows":  # a row stride of 68 elements: not a multiple of 16 bytes
        q = cuda(torch.randn(1, 2, 150, 68, dtype=dtype))[..., :64]
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    kw: Dict[str, Any] = dict(is_causal=True, return_stats=True)
    if case == "softcap":
        kw["softcap"] = 5.0
    elif case == "sinks":
        kw["sinks"] = cuda(torch.randn(2))
    elif case == "dropout":  # the op's seed: both families draw the same Philox stream
        kw.update(dropout_p=0.2, dropout_seed=7)
    go = torch.randn(1, 2, 150, D, device=DEV, dtype=dtype)
    results = {}
    for fam in ("fallback", "sm90"):
        monkeypatch.setenv("ENTROPY_ATTN_CUDA_FAMILY", fam)
        # The fallback gives the reference from its default backward (dq by atomics in any order).
        with torch_deterministic(case == "deterministic" and fam == "sm90"):
            res = OP(q, k, v, None, None, **kw)
            grads = torch.autograd.grad(res[0], (q, k, v), go)
        results[fam] = (res, grads)
    (fb, fb_g), (h, h_g) = results["fallback"], results["sm90"]
    oat, ort = OUT_TOL[dtype]
    sat, srt = STAT_TOL[dtype]
    assert_close64(h[0], fb[0], 2 * oat, 2 * ort, "output")
    assert_close64(h[2], fb[2], 2 * sat, 2 * srt, "entropy")
    for a, b, name in zip(h_g, fb_g, ("dq", "dk", "dv")):
        assert rel_err(a, b) < 2 * GRAD_TOL[dtype], name


#: Deterministic backwards (torch.use_deterministic_algorithms(True)) with the Hopper family forced:
#: (Hkv, Lq, Lk, D, the op's keyword arguments); Lq and Lk lists of document lengths for a packed
#: call (varlen_attention). Up to six key blocks of 128 add into each query block's dq
#: (sm90/bwd_kernel.cuh: write_dq, in their order); causality either way (bottom-right with more
#: keys than queries, as a cache), GQA, full attention with logn row scales and sinks, a causal
#: window over five key blocks (query blocks whose first walker is past key block 0), a two-sided
#: band, and packed documents: key blocks that walk nothing between two that walk the same query
#: block (the keys of a document without queries; keys no row of a window sees), and documents that
#: straddle query and key blocks; and bool masks, whose kernels add dq by atomics, in the same turns
#: (sm90/bwd_kernel.cuh: keep_turns), as every kernel at head dim 256 does (64-key blocks; in builds
#: with the kernels compiled on request, HOPPER_256_BUILT).
HOPPER_DETERMINISTIC_CASES: Dict[str, Tuple[int, Any, Any, int, Dict[str, Any]]] = {
    "causal_gqa_d128": (2, 600, 600, 128, {"is_causal": True}),
    "bottom_right_d64": (4, 200, 700, 64, {"is_causal": True, "causal_alignment": "bottom_right"}),
    "full_logn_sinks_d64": (4, 300, 650, 64, {"scale_mode": "logn", "sinks": True}),
    "window_d128": (4, 600, 600, 128, {"is_causal": True, "window_size": [150, 0]}),
    "band_d64": (2, 500, 500, 64, {"window_size": [130, 70]}),
    "documents_without_queries_d64": (2, [100, 0, 100], [40, 260, 120], 64, {"is_causal": True}),
    "documents_window_d128": (2, [70, 50], [100, 400], 128, {"is_causal": True, "window_size": [30, 0]}),
    "documents_d128": (4, [1, 130, 200, 57, 300], [1, 130, 200, 57, 300], 128, {"is_causal": True}),
    "bool_mask_d64": (4, 300, 400, 64, {"is_causal": True, "mask": "bool"}),
    "bool_mask_d128": (2, 290, 600, 128, {"mask": "bool"}),
    "causal_gqa_d256": (2, 300, 400, 256, {"is_causal": True}),
    "full_logn_d256": (2, 190, 330, 256, {"scale_mode": "logn"}),
}


def packed_reference(rin: List[Tensor], q_lens: List[int], k_lens: List[int], groups: int,
                     **kw: Any) -> Tuple[Tensor, Tensor]:
    """The float64 output and entropy of a packed call, (T, H, Dv) and (T, H), from the leaves `rin`
    (q: (T, H, D); k, v: (Tk, Hkv, D)), the kv heads repeated `groups` times."""
    from test_varlen import per_document_reference

    rk, rv = (x.repeat_interleave(groups, dim=1) for x in rin[1:3])
    res = dict(zip(OUT_NAMES, per_document_reference(rin[0], rk, rv, q_lens, k_lens, **kw)))
    return res["output"], res["entropy"]


def check_deterministic_backward(monkeypatch: pytest.MonkeyPatch, family: str, kernel: str, dtype: torch.dtype,
                                 Hkv: int, Lq: Any, Lk: Any, D: int, spec: Dict[str, Any]) -> None:
    """With ENTROPY_ATTN_CUDA_FAMILY=family and deterministic algorithms, three backwards of one call
    (HOPPER_DETERMINISTIC_CASES' form; "mask": "bool" a bool (Lq, Lk) mask, "bias" a learned additive
    (1, 1, Lq, Lk) one shared by the heads, "key_bias" a learned (1, H, 1, Lk) one: both broadcast,
    so that their gradient is written at the call's full shape and summed) launch the family's
    backward `kernel` and no other family's main kernel, give the same bits of dq, dk, dv (and the
    bias's gradient), and match the float64 reference's gradients of the output and the entropy.
    (Dry run: the CPU op.)"""
    from test_varlen import offsets

    kw = {key: val for key, val in spec.items() if key not in ("sinks", "mask")}
    packed = isinstance(Lq, list)
    torch.manual_seed(5)
    if packed:
        q = randn(sum(Lq), 4, D, dtype=dtype)
        k, v = (randn(sum(Lk), Hkv, D, dtype=dtype) for _ in range(2))
    else:
        q, k, v = make_qkv(1, 4, Hkv, Lq, Lk, D, dtype=dtype)
    mask = None
    if spec.get("mask") == "bool":
        mask = torch.rand(Lq, Lk) < 0.9
    elif spec.get("mask") == "bias":
        mask = randn(1, 1, Lq, Lk, dtype=dtype, scale=0.5)
    elif spec.get("mask") == "key_bias":
        mask = randn(1, 4, 1, Lk, dtype=dtype, scale=0.5)
    leaves = [cuda(t).requires_grad_() for t in (q, k, v)]
    if spec.get("mask") in ("bias", "key_bias"):
        leaves.append(cuda(mask).requires_grad_())
    sinks = randn(4) if spec.get("sinks") else None
    extra = {"sinks": cuda(sinks)} if sinks is not None else {}
    go = cuda(randn(*q.shape[:-1], D).to(dtype))
    ge = cuda(randn(*q.shape[:-1]))
    names = ("dq", "dk", "dv", "dbias")

    def call() -> Tuple[Tensor, ...]:
        if packed:
            return torch.ops.entropy_attn.varlen_attention(
                *leaves, offsets(Lq, DEV.type), offsets(Lk, DEV.type), max(Lq), max(Lk), enable_gqa=True,
                return_stats=True, **kw)
        m = leaves[3] if len(leaves) > 3 else cuda(mask)
        return OP(*leaves[:3], m, None, enable_gqa=True, return_stats=True, **extra, **kw)

    monkeypatch.setenv("ENTROPY_ATTN_CUDA_FAMILY", family)
    runs: List[List[Tensor]] = []
    with torch_deterministic(True):
        for _ in range(3):
            out = call()
            grads: list = []

            def backward() -> None:
                grads.extend(grads_of([out[0], out[2]], [go, ge], leaves))

            if DRY_RUN:
                backward()
            else:
                launched = cuda_kernel_names(backward)
                assert any(f"{family}::" in n and kernel in n for n in launched), f"the {family} backward did not run"
                others = [f for f in ("sm80", "sm90") if f != family]
                assert not any(f"{f}::" in n and "main_kernel" in n for f in others for n in launched), launched
            runs.append(grads)
    for again in runs[1:]:
        for a, b, name in zip(again, runs[0], names):
            assert torch.equal(a, b), f"{name} differs between runs"
    rin = [leaf64(t) for t in leaves]
    if packed:
        r_out, r_ent = packed_reference(rin, Lq, Lk, 4 // Hkv, **kw)
    else:
        r = reference_attention_raw(*rin[:3], rin[3] if len(rin) > 3 else mask, None, enable_gqa=True,
                                    sinks=sinks.double() if sinks is not None else None, **kw)
        r_out, r_ent = r.output, r.entropy
    ref_grads = grads_of([r_out, r_ent], [go.cpu(), ge.cpu()], rin)
    for a, e, name in zip(runs[0], ref_grads, names):
        assert a.dtype == dtype, name
        assert rel_err(a, e) < GRAD_TOL[dtype], f"{name} vs reference: {rel_err(a, e):.3g}"


@needs_hopper
@pytest.mark.hopper_turns
@pytest.mark.parametrize("case", [
    pytest.param(c, marks=pytest.mark.skipif(
        not DRY_RUN and not HOPPER_256_BUILT and HOPPER_DETERMINISTIC_CASES[c][3] == 256,
        reason="the Hopper kernels at head dim 256 are compiled on request (ENTROPY_ATTN_UNTESTED_KERNELS=1)"))
    for c in HOPPER_DETERMINISTIC_CASES])
def test_hopper_deterministic_backward(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """Under deterministic algorithms with ENTROPY_ATTN_CUDA_FAMILY=sm90 the Hopper backward runs
    (family.h: kHopperDeterministicByDefault decides "auto"), its dq taking turns: three backwards
    of the same call give the same bits (dq's partial sums added in the key blocks' order, not as
    they finish), and the gradients of the output and the entropy match the float64 reference
    (check_deterministic_backward)."""
    check_deterministic_backward(monkeypatch, "sm90", "main_kernel", torch.bfloat16,
                                 *HOPPER_DETERMINISTIC_CASES[case])


@needs_hopper
@pytest.mark.hopper_turns
def test_hopper_deterministic_backward_in_a_cuda_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """The deterministic Hopper backward captured in a CUDA graph: its preprocess starts the turn
    counters on the device (sm90/bwd_kernel.cuh: preprocess_kernel), so that every replay takes its
    turns from the start (counters left where the last run ended would leave a replay waiting), and
    each replay gives the eager backward's bits."""
    monkeypatch.setenv("ENTROPY_ATTN_CUDA_FAMILY", "sm90")
    torch.manual_seed(5)
    leaves = [cuda(t).requires_grad_() for t in make_qkv(1, 4, 2, 600, 600, 128, dtype=torch.bfloat16)]
    go = cuda(randn(1, 4, 600, 128).to(torch.bfloat16))

    def step() -> List[Tensor]:
        out = torch_ext.attention(*leaves, is_causal=True, enable_gqa=True, scale="logn")
        return list(torch.autograd.grad(out, leaves, go))

    with torch_deterministic(True):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the capture, as torch.cuda.graphs asks
            eager = step()
        torch.cuda.current_stream().wait_stream(stream)
        assert family_kernels(step, "sm90", "main_kernel"), "the sm90 backward did not run"
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        replays = []
        for _ in range(2):
            graph.replay()
            torch.cuda.synchronize()
            replays.append([g.clone() for g in captured])
    for replay in replays:
        for a, b, name in zip(replay, eager, ("dq", "dk", "dv")):
            assert torch.equal(a, b), f"{name}: a replay differs from the eager backward"


#: Deterministic backwards of the fallback kernels (torch.use_deterministic_algorithms(True)):
#: (dtype, Hkv, Lq, Lk, D, the op's keyword arguments); Lq and Lk lists of document lengths for a
#: packed call. Each key tile adds into a query tile's G in its turn (fallback/turns.cuh): causality
#: either way, GQA, a causal window with logn row scales and sinks, a two-sided band, packed
#: documents (the keys of a document without queries between key tiles that walk one query tile),
#: a bool mask, learned biases shared by the heads or per key (their gradient written at the call's
#: full shape and summed in a fixed order), float64, a bf16 call with the fallback forced
#: (ENTROPY_ATTN_CUDA_FAMILY), and full attention over 32 key tiles per query tile (where atomics in
#: any order would most likely differ between runs).
FALLBACK_DETERMINISTIC_CASES: Dict[str, Tuple[torch.dtype, int, Any, Any, int, Dict[str, Any]]] = {
    "f32_causal_gqa_d64": (torch.float32, 2, 300, 300, 64, {"is_causal": True}),
    "f64_bottom_right_d128": (F64, 4, 100, 350, 128, {"is_causal": True, "causal_alignment": "bottom_right"}),
    "f32_window_logn_sinks_d128": (torch.float32, 4, 300, 300, 128,
                                   {"is_causal": True, "window_size": [70, 0], "scale_mode": "logn", "sinks": True}),
    "f32_band_d64": (torch.float32, 2, 250, 250, 64, {"window_size": [60, 30]}),
    "f32_documents_d64": (torch.float32, 2, [100, 0, 100], [40, 260, 120], 64, {"is_causal": True}),
    "f32_bool_mask_d64": (torch.float32, 4, 200, 250, 64, {"mask": "bool"}),
    "f32_learned_bias_d64": (torch.float32, 4, 200, 250, 64, {"is_causal": True, "mask": "bias"}),
    "f64_key_bias_d64": (F64, 2, 150, 200, 64, {"mask": "key_bias"}),
    "f32_full_1024_d64": (torch.float32, 4, 1024, 1024, 64, {}),
    "bf16_forced_fallback_d64": (torch.bfloat16, 2, 300, 300, 64, {"is_causal": True}),
}


@pytest.mark.parametrize("case", list(FALLBACK_DETERMINISTIC_CASES))
def test_fallback_deterministic_backward(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """Under deterministic algorithms the fallback's backward (float32, float64, or a call it is
    forced on) runs, with no error: three backwards of the same call give the same bits (G's partial
    sums added in the key tiles' order, a learned bias's gradient summed from the full shape), and
    the gradients of the output and the entropy match the float64 reference
    (check_deterministic_backward)."""
    check_deterministic_backward(monkeypatch, "fallback", "attention_bwd_kernel", *FALLBACK_DETERMINISTIC_CASES[case])


def same_bits(a: Tensor, b: Tensor) -> bool:
    """Whether two tensors of one dtype and shape hold the same bits (NaN included)."""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


#: Calls for split-KV (family.h: ENTROPY_ATTN_SPLIT_KV): (Lq, Lk, the op's keyword arguments, as
#: TC_FEATURES). Decoding shapes (a few query rows, a long cache; GQA), masks, bottom-right causality
#: and a window with a sink (the general instantiations, the sink in the first part only), softcap
#: with dropout, two query tiles, and a cache shorter than the parts (empty parts).
SPLIT_KV_CASES: Dict[str, Tuple[int, int, Dict[str, Any]]] = {
    "decode": (1, 1000, {}),
    "decode_bottom_right": (3, 777, {"is_causal": True, "causal_alignment": "bottom_right"}),
    "decode_bool_mask": (2, 900, {"mask": "bool"}),
    "decode_additive_mask": (1, 640, {"mask": "additive"}),
    "two_tiles_causal": (200, 300, {"is_causal": True}),
    "window_sink": (150, 600, {"is_causal": True, "causal_alignment": "bottom_right",
                               "window_size": (200, 0), "sinks": True}),
    "softcap_dropout": (1, 700, {"softcap": 5.0, "dropout_p": 0.2, "dropout_seed": 9}),
    "short_cache": (1, 50, {}),
}


@pytest.mark.parametrize("stats", [False, True], ids=["lean", "stats"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("case", list(SPLIT_KV_CASES))
@pytest.mark.parametrize("family", TC_FAMILIES)
def test_split_kv_matches_reference(monkeypatch: pytest.MonkeyPatch, family: str, case: str, D: int,
                                    stats: bool) -> None:
    """ENTROPY_ATTN_SPLIT_KV=5 cuts each query tile's keys into 5 parts (sm80/split_kv.cuh; from
    sm90 the call goes to sm80) and the combine kernel merges them: output, lse, n_i and the
    statistics match the float64 reference (dropout: its Philox mask), and the gradients through
    the output, from the split forward's output and lse, match the reference's. (Dry run: the CPU
    op against the same reference.)"""
    Lq, Lk, spec = SPLIT_KV_CASES[case]
    kw = {key: val for key, val in spec.items() if key not in ("sinks", "mask")}
    torch.manual_seed(8)
    H, Hkv = 4, 2
    q, k, v = make_qkv(2, H, Hkv, Lq, Lk, D, dtype=torch.bfloat16)
    sinks, mask, leaves = feature_leaves(spec, q, k, v, Lq, Lk)
    monkeypatch.setenv("ENTROPY_ATTN_CUDA_FAMILY", family)
    monkeypatch.setenv("ENTROPY_ATTN_SPLIT_KV", "5")
    sink_leaf = leaves[3] if sinks is not None else None
    res: list = []
    ran = family_kernels(lambda: res.append(OP(*leaves[:3], cuda(mask), None, enable_gqa=True, sinks=sink_leaf,
                                               return_stats=stats, **kw)), "sm80", "split_combine_kernel")
    assert DRY_RUN or ran, "the split-KV combine kernel did not run"
    out = res[0]
    rin = [leaf64(t) for t in leaves]
    r = reference_attention_raw(*rin[:3], mask, None, enable_gqa=True,
                                sinks=rin[3] if sinks is not None else None, **kw)
    assert_matches_reference(out, r, torch.bfloat16, stats)
    go = torch.randn_like(out[0])
    grads = grads_of([out[0]], [go], leaves)
    ref_grads = grads_of([r.output], [go.cpu()], rin)
    for a, e, name in zip(grads, ref_grads, ("dq", "dk", "dv", "dsinks")):
        assert rel_err(a, e) < GRAD_TOL[torch.bfloat16], f"{name} vs reference"


#: ENTROPY_ATTN_CUDA_LAUNCH_ORDER settings (family.h): the grid's own order, the rule, one section
#: (every entry's first tile before any entry's second) and 3 sections of unequal width.
LAUNCH_ORDERS = ("heads", "auto", "1", "3")


@pytest.mark.parametrize("split_kv", ["off", "3"])
@pytest.mark.parametrize("pattern", ["full", "causal", "window"])
@pytest.mark.parametrize("family", TC_FAMILIES)
def test_launch_order_only_renames_blocks(monkeypatch: pytest.MonkeyPatch, family: str, pattern: str,
                                          split_kv: str) -> None:
    """The launch order (csrc/cuda/launch_order.h) renames blocks and changes nothing else: under
    every setting the forward's outputs and statistics and the gradients of k and v (each written
    by one block) are the bits of the grid's own order, dq (float32 atomics, added in the order
    the blocks run) equal within rounding, and the result matches the float64 reference. GQA
    with 5 batch entries (10 KV-head and 20 query-head entries: sections of unequal width) and
    tiles that are not full; causal and a window run in the general instantiations, which read
    the order, full attention in the plain ones, which keep the grid's, unless split-KV (3 parts,
    sm80's: the forward of an sm90 call goes there) sends it to the general ones too, whose grid
    x is then split-major; the family's kernels in the profile. (Dry run: the CPU op, which reads
    no launch order, against the same reference.)"""
    B, H, Hkv, L, D = 5, 4, 2, 300, 64
    torch.manual_seed(12)
    q, k, v = make_qkv(B, H, Hkv, L, L, D, dtype=torch.bfloat16)
    go = cuda(randn(B, H, L, D, dtype=torch.bfloat16))
    kw: Dict[str, Any] = dict(is_causal=pattern != "full", enable_gqa=True, return_stats=True)
    if pattern == "window":
        kw["window_size"] = [100, 0]
    monkeypatch.setenv("ENTROPY_ATTN_CUDA_FAMILY", family)
    monkeypatch.setenv("ENTROPY_ATTN_SPLIT_KV", split_kv)
    forward_family = family if split_kv == "off" else "sm80"
    runs: Dict[str, Tuple[Tuple[Tensor, ...], Tuple[Tensor, ...]]] = {}
    for order in LAUNCH_ORDERS:
        monkeypatch.setenv("ENTROPY_ATTN_CUDA_LAUNCH_ORDER", order)
        leaves = [cuda(t).requires_grad_() for t in (q, k, v)]
        res: list = []
        ran = family_kernels(lambda: res.append(OP(*leaves, None, None, **kw)), forward_family, "forward_kernel")
        assert DRY_RUN or ran, f"the {forward_family} forward did not run"
        grads: list = []
        ran = family_kernels(lambda: grads.extend(torch.autograd.grad(res[0][0], leaves, go)), family,
                             "main_kernel")
        assert DRY_RUN or ran, f"the {family} backward did not run"
        runs[order] = (tuple(t.detach() for t in res[0]), tuple(grads))
    base_out, base_grads = runs["heads"]
    for order, (out, grads) in runs.items():
        for a, e, name in zip(out, base_out, OUT_NAMES):
            assert torch.equal(a, e), f"{name} under ENTROPY_ATTN_CUDA_LAUNCH_ORDER={order}"
        for i, name in ((1, "dk"), (2, "dv")):
            assert torch.equal(grads[i], base_grads[i]), f"{name} under ENTROPY_ATTN_CUDA_LAUNCH_ORDER={order}"
        assert rel_err(grads[0], base_grads[0]) < 1e-2, f"dq under ENTROPY_ATTN_CUDA_LAUNCH_ORDER={order}"
    rin = [leaf64(t) for t in (q, k, v)]
    ref = reference_attention_raw(*rin, None, None, **{**kw, "window_size": tuple(kw.get("window_size", (-1, -1)))})
    assert_matches_reference(base_out, ref, torch.bfloat16, True)
    ref_grads = grads_of([ref.output], [go.cpu()], rin)
    for a, e, name in zip(base_grads, ref_grads, ("dq", "dk", "dv")):
        assert rel_err(a, e) < GRAD_TOL[torch.bfloat16], f"{name} vs reference"


#: ENTROPY_ATTN_CUDA_PERSISTENT settings (family.h): a block per tile, a block per SM, and grids of 1
#: and 7 blocks (every tile on one block; blocks that walk tiles of several heads and batch entries).
PERSISTENT_SETTINGS = ("off", "on", "1", "7")


@pytest.mark.skipif(not tensor_core_family_runs("sm90"), reason="the sm90 family does not run on this device")
@pytest.mark.parametrize("stats", [True, False], ids=["stats", "no_stats"])
@pytest.mark.parametrize("pattern", ["full", "causal", "window", "bool_mask", "bottom_right"])
def test_persistent_grid_only_moves_tiles(monkeypatch: pytest.MonkeyPatch, pattern: str, stats: bool) -> None:
    """The Hopper forward on a persistent grid (csrc/cuda/sm90/fwd_kernel.cuh: blocks that walk
    several tiles) computes every tile as a grid of one block per tile does: under each setting its
    outputs and statistics are the bits of "off", which match the float64 reference. GQA, 3 batch
    entries, partial tiles; causal tiles in launch order; a window; a bool mask (the masked
    instantiations); bottom-right alignment with more queries than keys, whose first tile sees no
    key. 240 tiles of 128 rows: more than an H100's or H200's 132 SMs, so that under "on" blocks
    walk two tiles. (Dry run: the CPU op, which has no grid, against the same reference.)"""
    B, H, Hkv, Lq, D = 5, 16, 8, 300, 128
    Lk = 120 if pattern == "bottom_right" else 300
    torch.manual_seed(13)
    q, k, v = make_qkv(B, H, Hkv, Lq, Lk, D, dtype=torch.bfloat16)
    mask = torch.rand(B, 1, Lq, Lk) > 0.3 if pattern == "bool_mask" else None
    kw: Dict[str, Any] = dict(enable_gqa=True, return_stats=stats, scale_mode="logn",
                              is_causal=pattern in ("causal", "window", "bottom_right"))
    if pattern == "window":
        kw["window_size"] = [100, 0]
    if pattern == "bottom_right":
        kw["causal_alignment"] = "bottom_right"
    monkeypatch.setenv("ENTROPY_ATTN_CUDA_FAMILY", "sm90")
    monkeypatch.setenv("ENTROPY_ATTN_SPLIT_KV", "off")
    runs: Dict[str, Tuple[Tensor, ...]] = {}
    for setting in PERSISTENT_SETTINGS:
        monkeypatch.setenv("ENTROPY_ATTN_CUDA_PERSISTENT", setting)
        res: list = []
        ran = family_kernels(lambda: res.append(OP(cuda(q), cuda(k), cuda(v), cuda(mask), None, **kw)), "sm90",
                             "forward_kernel")
        assert DRY_RUN or ran, "the sm90 forward did not run"
        runs[setting] = tuple(t.cpu() for t in res[0])
    for setting, out in runs.items():
        for a, e, name in zip(out, runs["off"], OUT_NAMES):
            assert torch.equal(a, e), f"{name} under ENTROPY_ATTN_CUDA_PERSISTENT={setting}"
    ref = reference_attention_raw(q, k, v, mask, None, **{**kw, "window_size": tuple(kw.get("window_size", (-1, -1)))})
    assert_matches_reference(runs["off"], ref, torch.bfloat16, stats)


#: Each tuning variable of the tensor-core families (family.h): the family that reads it, values it
#: refuses, the documented values it accepts, and a call that reads it (query and key lengths,
#: causality): split-KV is for decoding, the launch order for causal calls.
TUNING_SETTINGS = [
    pytest.param("ENTROPY_ATTN_SPLIT_KV", "sm80", ("0", "129", "two", "-1"), ("off", "auto", "1", "128"), (1, 300, False),
                 id="split_kv", marks=pytest.mark.skipif(not tensor_core_family_runs("sm80"),
                                                         reason="split-KV is the sm80 family's")),
    pytest.param("ENTROPY_ATTN_CUDA_LAUNCH_ORDER", "sm80", ("0", "-2", "lpt", "1.5"), ("auto", "heads", "1", "1000"),
                 (100, 100, True), id="launch_order",
                 marks=pytest.mark.skipif(not tensor_core_family_runs("sm80"),
                                          reason="the tensor-core families read it")),
    pytest.param("ENTROPY_ATTN_CUDA_PERSISTENT", "sm90", ("0", "-2", "all", "1.5"), ("on", "off", "1", "1000"),
                 (100, 100, False), id="persistent",
                 marks=pytest.mark.skipif(not tensor_core_family_runs("sm90"), reason="the Hopper forward reads it")),
]  # fmt: skip


@real_cuda
@pytest.mark.parametrize("variable, family, bad_values, good_values, call", TUNING_SETTINGS)
def test_tuning_setting_is_checked(monkeypatch: pytest.MonkeyPatch, variable: str, family: str,
                                   bad_values: Tuple[str, ...], good_values: Tuple[str, ...],
                                   call: Tuple[int, int, bool]) -> None:
    """A bad value of a tuning variable is a ValueError naming the variable; the documented values
    are accepted."""
    lq, lk, causal = call
    monkeypatch.setenv("ENTROPY_ATTN_CUDA_FAMILY", family)
    q = cuda(torch.randn(1, 2, lq, 64, dtype=torch.bfloat16))
    k = cuda(torch.randn(1, 2, lk, 64, dtype=torch.bfloat16))
    for bad in bad_values:
        monkeypatch.setenv(variable, bad)
        with pytest.raises(ValueError, match=variable):
            OP(q, k, k, is_causal=causal)
    for good in good_values:
        monkeypatch.setenv(variable, good)
        OP(q, k, k, is_causal=causal)


@pytest.mark.parametrize("family", ["auto", "fallback", *TC_FAMILIES])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_learned_mask_grad_matches_reference(monkeypatch: pytest.MonkeyPatch, family: str,
                                             dtype: torch.dtype) -> None:
    """The gradient of an additive mask that requires grad (a T5-style per-head bias, (1, H, Lq,
    Lk), with -inf entries), under every family setting: D = 64, L = 80 (two key tiles, a partial
    one), causal, with the statistics' gradients; against the CPU op and the float64 reference.
    On a GPU the backward's main kernel is the sm80 family's for 16-bit inputs whatever the
    tensor-core family asked for (the Hopper family leaves a mask's gradient beside the statistics'
    gradients to it), the fallback's for float32 and float64 or when the fallback is forced."""
    monkeypatch.setenv("ENTROPY_ATTN_CUDA_FAMILY", family)
    B, H, L, D = 2, 2, 80, 64
    q, k, v = make_qkv(B, H, H, L, L, D, dtype=dtype)
    bias = randn(1, H, L, L, scale=0.5)
    bias[torch.rand(1, H, L, L) < 0.2] = float("-inf")
    bias = bias.to(dtype)
    upstream: List[Tensor] = []

    def mask_grad(device: torch.device) -> Tensor:
        m = bias.to(device).requires_grad_()
        outs = OP(q.to(device), k.to(device), v.to(device), m, None, is_causal=True)[:4]
        if not upstream:
            upstream.extend(randn(*o.shape, dtype=F64) for o in outs)
        loss = sum((o.to(F64) * u.to(o.device)).sum() for o, u in zip(outs, upstream))
        return torch.autograd.grad(loss, [m])[0]

    g_cpu = mask_grad(torch.device("cpu"))
    names: List[str] = []
    if DRY_RUN:
        g_dev = mask_grad(DEV)
    else:
        box: List[Tensor] = []
        names = cuda_kernel_names(lambda: box.append(mask_grad(DEV)))
        g_dev = box[0]
        main = [n for n in names if "bwd" in n and "main_kernel" in n]  # the tensor-core families'
        if dtype in HALF_DTYPES and family != "fallback":
            assert any("sm80::" in n for n in main) and not any("sm90::" in n for n in main), names
        else:
            assert any("fallback::attention_bwd_kernel" in n for n in names) and not main, names
    ref_mask = bias.to(F64).requires_grad_()
    r = reference_attention_raw(q.to(F64), k.to(F64), v.to(F64), ref_mask, None, is_causal=True)
    g_ref = grads_of([r.output, r.lse, r.entropy, r.sum_p2], upstream, [ref_mask])[0]
    tol = GRAD_TOL[dtype]
    assert g_dev.shape == bias.shape and g_dev.dtype == dtype and g_dev.device.type == DEV.type
    assert rel_err(g_dev, g_ref) < tol, f"{family}: {rel_err(g_dev, g_ref):.3g} vs reference (tol {tol:.3g})"
    assert rel_err(g_dev, g_cpu) < 2 * tol, f"{family}: {rel_err(g_dev, g_cpu):.3g} vs CPU"
    assert (g_dev.cpu()[torch.isneginf(bias)] == 0).all()


def test_dropout_generator_on_the_device() -> None:
    """A generator on the inputs' device (``torch.Generator("cuda")``, what SDPA users pass) seeds
    dropout: the same seed gives the same output, another seed another. (It raised "Expected a
    'cpu' device type for generator" before the seed was drawn on the generator's device.)"""
    q, k, v = (cuda(t) for t in make_qkv(1, 2, 2, 96, 96, 64, dtype=torch.bfloat16))

    def run(seed: int) -> Tensor:
        return torch_ext.attention(q, k, v, is_causal=True, dropout_p=0.3,
                                   generator=torch.Generator(DEV.type).manual_seed(seed))

    first, again, other = run(1), run(1), run(2)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


@pytest.mark.parametrize("split", ["off", "auto"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "bottom_right_causal"])
@pytest.mark.parametrize("family", ["fallback", "sm80", "sm90"])
def test_decode_packs_query_heads(monkeypatch: pytest.MonkeyPatch, family: str, causal: bool, D: int,
                                  split: str) -> None:
    """One decoding step with GQA (one query row, 32 query heads on 8 key/value heads) runs with each
    group's query heads packed as the rows of one head (attention_call.cpp: pack_query_heads), on each
    family, split or not: every output against the float64 reference and the gradients too, with a
    per-batch bool mask (a cache with padding). The family and split settings are forced
    (sm90 on other GPUs runs as sm80)."""
    torch.manual_seed(12)
    q, k, v = make_qkv(2, 32, 8, 1, 3000, D, dtype=torch.bfloat16)
    mask = torch.rand(2, 1, 1, 3000, generator=torch.Generator().manual_seed(2)) < 0.9
    kw: Dict[str, Any] = dict(is_causal=causal, causal_alignment="bottom_right", enable_gqa=True)
    monkeypatch.setenv("ENTROPY_ATTN_CUDA_FAMILY", family)
    monkeypatch.setenv("ENTROPY_ATTN_SPLIT_KV", split)
    leaves = [cuda(t).requires_grad_() for t in (q, k, v)]
    out = OP(*leaves, cuda(mask), None, **kw)
    rin = [leaf64(t) for t in (q, k, v)]
    r = reference_attention_raw(*rin, mask, None, **kw)
    oat, ort = OUT_TOL[torch.bfloat16]
    sat, srt = STAT_TOL[torch.bfloat16]
    assert out[0].shape == (2, 32, 1, D) and out[0].is_contiguous()
    assert_close64(out[0].detach().cpu(), r.output, oat, ort, "output")
    for i, name in enumerate(OUT_NAMES[1:], start=1):
        if name == "n_keys":
            assert torch.equal(out[i].cpu(), r.n_keys), "n_keys"
        else:
            assert_close64(out[i].detach().cpu(), getattr(r, name), sat, srt, name)
    go = torch.randn_like(out[0])
    grads = grads_of([out[0]], [go], leaves)
    ref_grads = grads_of([r.output], [go.cpu()], rin)
    for a, e, name in zip(grads, ref_grads, ("dq", "dk", "dv")):
        assert rel_err(a, e) < GRAD_TOL[torch.bfloat16], f"{name} vs reference"
