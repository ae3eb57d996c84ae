"""torch_ext.attention against F.scaled_dot_product_attention on a CUDA GPU, in one process.

Each point (dtype x H:Hkv x head dim x causal x L x kernel family) is timed with CUDA events (median
of blocks), ours and SDPA in the same run: ``fwd_stats`` (ours with ``return_stats=True``: output and
every per-row statistic), ``fwd`` (``return_stats=False``), both against SDPA's forward, and
``fwd_bwd`` (forward + backward of the output: grads of q, k, v). SDPA runs per backend by name
(cudnn, flash, efficient; a backend that refuses a point gets null); ratios (ours / SDPA, lower is
better) are against the fastest. Times also come as TFLOP/s (forward 4·B·H·Lq·Lk·D, halved when
causal; forward+backward 3.5x) and as a fraction of the matmul peak measured at startup. ``--family``
sets ENTROPY_ATTN_CUDA_FAMILY before ours runs; a point records the family requested (the extension
may still fall back where it has no kernel). ``--launch-order`` likewise sets
ENTROPY_ATTN_CUDA_LAUNCH_ORDER (the tensor-core kernels' block order, csrc/cuda/launch_order.h:
``auto``, ``heads`` or a number of sections), each family timed under each order, and
``--persistent`` ENTROPY_ATTN_CUDA_PERSISTENT (the Hopper forward's grid, csrc/cuda/family.h:
``default`` leaves it unset, ``on``, ``off`` or a number of blocks), each under each. Points over 70% of the free memory, or out of memory,
are recorded as skipped. ``--dropout-p`` runs both with attention dropout (training: the cost of
drawing the mask; no ``--check``, the masks differ). ``--mask bool additive`` gives both an attention
mask of a padded batch: (B, 1, L, L), batch element b's last b·L/(2B) keys hidden from every
query, and with causality the causal mask folded in (``is_causal`` then off for both), as a Hugging
Face model passes its bool mask to SDPA, so that the masked kernels are timed too (the additive
one holds 0 and -inf, in the inputs' dtype, which ours reads as it is; SDPA converts a bool one
to an additive one inside the timed calls). Writes results/gpu/benchmark.{md,json}. Without a GPU: says so, writes
nothing, exits 0 (1 with --require-gpu). Exits 1, after writing, if a call of ours failed or
--check found a mismatch.

    python3 benchmarks/gpu_vs_sdpa.py                       # full grid (B=4; H:Hkv 16:16 and 32:8)
    python3 benchmarks/gpu_vs_sdpa.py --quick --check       # smoke run, outputs and grads checked first
    python3 benchmarks/gpu_vs_sdpa.py --dtype bf16 --head-dim 128 --seq 4096 --causal yes \\
        --heads-kv 32:8 --family fallback sm80 --no-backward --out-json ''
    python3 benchmarks/gpu_vs_sdpa.py --causal yes --seq 1024 4096 --launch-order auto heads \\
        --out-md results/gpu/launch_order.md --out-json results/gpu/launch_order.json
    python3 benchmarks/gpu_vs_sdpa.py --dtype bf16 --seq 4096 16384 --persistent off on --no-backward \\
        --out-md results/gpu/persistent.md --out-json results/gpu/persistent.json
    python3 benchmarks/gpu_vs_sdpa.py --dtype bf16 --heads-kv 16:16 --head-dim 64 128 --seq 4096 \\
        --mask none bool additive --out-md results/gpu/masks.md --out-json results/gpu/masks.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import subprocess
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm import tqdm

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MD = os.path.join(REPO_ROOT, "results", "gpu", "benchmark.md")
DEFAULT_JSON = os.path.join(REPO_ROOT, "results", "gpu", "benchmark.json")
DTYPES: Dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES: Dict[str, str] = {"bf16": "bfloat16", "fp16": "float16", "bfloat16": "bfloat16", "float16": "float16"}
SDPA_BACKENDS: Dict[str, SDPBackend] = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}
FAMILY_ENV = "ENTROPY_ATTN_CUDA_FAMILY"
FAMILIES = ("auto", "fallback", "sm80", "sm90")
LAUNCH_ORDER_ENV = "ENTROPY_ATTN_CUDA_LAUNCH_ORDER"
PERSISTENT_ENV = "ENTROPY_ATTN_CUDA_PERSISTENT"
KINDS = ("fwd_stats", "fwd", "fwd_bwd")
TFLOPS_KEYS = ("ours_fwd_stats", "ours_fwd", "ours_fwd_bwd", "sdpa_fwd", "sdpa_fwd_bwd")
ERR_KEYS = ("out", "dq", "dk", "dv")
BWD_FACTOR = 3.5  # forward + backward = 3.5 x forward (FlashAttention's convention: backward 2.5x)
MEM_FRACTION = 0.7
MATMUL_N = 8192
#: (atol, rtol) of --check: a point mismatches where max|ours - SDPA| > atol + rtol * max|SDPA|.
CHECK_TOL: Dict[str, Dict[str, Tuple[float, float]]] = {
    "bfloat16": {"out": (2e-2, 2e-2), "grad": (2e-2, 5e-2)},
    "float16": {"out": (3e-3, 3e-3), "grad": (3e-3, 1e-2)},
}
GRID = ("dtype", "batch", "heads_kv", "head_dim", "seq", "min_run_time")
DEFAULTS = dict(zip(GRID, (["bfloat16", "float16"], 4, [(16, 16), (32, 8)], [64, 128, 256], [1024, 4096, 16384], 0.5)))
QUICK = dict(zip(GRID, (["bfloat16"], 2, [(16, 16), (32, 8)], [64, 128], [1024], 0.1)))
Times = Dict[str, Optional[float]]
Timer = Callable[[Callable[[], object], float], float]


@dataclass(frozen=True)
class Shape:
    """One point of the grid, less the kernel family."""

    dtype: str
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    seq_len: int
    causal: bool
    dropout_p: float = 0.0
    layout: str = "bhld"  # LAYOUTS
    mask: str = "none"  # MASKS


    @property
    def gqa(self) -> bool:
        """Whether query heads share key/value heads."""
        return self.heads != self.kv_heads


#: How the timed calls take their inputs and give their output: "bhld", contiguous (B, H, L, D)
#: tensors in and the output as returned; "projection", as a model's attention layer calls it:
#: (B, L, H * D) projections in, split into heads inside the call (transposed views), and the
#: output merged back into (B, L, H * Dv). The merge copies an output that is not laid out as
#: (B, L, H, Dv), and the split's backward a gradient that is not laid out as (B, L, H, D).
LAYOUTS = ("bhld", "projection")
#: The attention mask of the timed calls: none, or a padded batch's (B, 1, L, L) mask (padding_mask)
#: as bool (True: attend) or additive (0 or -inf, in the inputs' dtype).
MASKS = ("none", "bool", "additive")


@dataclass
class Inputs:
    """The tensors of one point: q, k, v (requiring grad) and the output gradient; with the
    "projection" layout, the (B, L, heads * D) projections and the merged output's gradient."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    mask: Optional[torch.Tensor] = None


def parse_heads_kv(text: str) -> Tuple[int, int]:
    """'H:Hkv' -> (H, Hkv); both positive, H a multiple of Hkv."""
    try:
        heads, kv_heads = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--heads-kv wants 'H:Hkv' pairs such as 32:8, got {text!r}") from None
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        raise argparse.ArgumentTypeError(f"--heads-kv {text!r}: H and Hkv must be positive, H a multiple of Hkv")
    return heads, kv_heads


def parse_launch_order(text: str) -> str:
    """A value of ENTROPY_ATTN_CUDA_LAUNCH_ORDER: 'auto', 'heads' or a positive number of sections."""
    if text in ("auto", "heads") or (text.isdigit() and int(text) >= 1):
        return text
    raise argparse.ArgumentTypeError(f"expected auto, heads or a number of sections >= 1, got {text!r}")


def parse_persistent(text: str) -> str:
    """A value for ENTROPY_ATTN_CUDA_PERSISTENT: 'on', 'off', a number of blocks >= 1, or
    'default' (the variable unset: the extension's default)."""
    if text in ("default", "on", "off") or (text.isdigit() and int(text) >= 1):
        return text
    raise argparse.ArgumentTypeError(f"expected default, on, off or a number of blocks >= 1, got {text!r}")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Command-line arguments; grid flags left out take --quick's or the full grid's values."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke grid: bf16, B=2, D 64 128, L 1024")
    p.add_argument("--dtype", nargs="+", choices=sorted(DTYPE_NAMES), help="default bf16 fp16")
    p.add_argument("--batch", type=int, help="B (default 4)")
    p.add_argument("--heads-kv", nargs="+", type=parse_heads_kv, metavar="H:Hkv", help="default 16:16 32:8")
    p.add_argument("--head-dim", nargs="+", type=int, help="default 64 128 256")
    p.add_argument("--seq", nargs="+", type=int, help="Lq = Lk (default 1024 4096 16384)")
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    p.add_argument("--family", nargs="+", choices=FAMILIES, default=["auto"], help=f"sets {FAMILY_ENV}")
    p.add_argument("--launch-order", nargs="+", type=parse_launch_order, default=["auto"], metavar="ORDER",
                   help=f"sets {LAUNCH_ORDER_ENV}: auto, heads or a number of sections (default auto)")
    p.add_argument("--persistent", nargs="+", type=parse_persistent, default=["default"], metavar="SETTING",
                   help=f"sets {PERSISTENT_ENV}: on, off or a number of blocks; default: unset")
    p.add_argument("--no-backward", dest="backward", action="store_false", help="skip fwd_bwd")
    p.add_argument("--dropout-p", type=float, default=0.0, help="attention dropout of both (default 0)")
    p.add_argument("--layout", nargs="+", choices=LAYOUTS, default=["bhld"],
                   help="inputs and output: contiguous (B, H, L, D), or split from and merged into projections")
    p.add_argument("--mask", nargs="+", choices=MASKS, default=["none"],
                   help="attention masks of a padded batch, each a variant of every point (default none)")
    p.add_argument("--check", action="store_true", help="compare output (and grads) with SDPA's first")
    p.add_argument("--min-run-time", type=float, help="seconds per measurement (default 0.5, --quick 0.1)")
    p.add_argument("--out-md", default=DEFAULT_MD, help="Markdown file ('' to skip)")
    p.add_argument("--out-json", default=DEFAULT_JSON, help="JSON file ('' to skip)")
    p.add_argument("--require-gpu", action="store_true", help="exit 1 (not 0) without a CUDA device")
    args = p.parse_args(argv)
    if not 0.0 <= args.dropout_p < 1.0:
        p.error(f"--dropout-p must be in [0, 1), got {args.dropout_p}")
    if args.check and args.dropout_p > 0:
        p.error("--check compares with SDPA, whose dropout mask differs: not with --dropout-p")
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.dtype = list(dict.fromkeys(DTYPE_NAMES[d] for d in args.dtype))
    return args


def expand_grid(args: argparse.Namespace) -> List[Shape]:
    """The shapes of the grid (families apart), in table order."""
    causal = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    return [
        Shape(dt, args.batch, h, hkv, d, seq, c, args.dropout_p, layout, mask)
        for dt in args.dtype for h, hkv in args.heads_kv for d in args.head_dim for c in causal for seq in args.seq
        for layout in args.layout for mask in args.mask
    ]  # fmt: skip


def attention_flops(shape: Shape, backward: bool = False) -> float:
    """4·B·H·Lq·Lk·D (two matmuls; query heads H, not Hkv), halved when causal; x3.5 with backward."""
    flops = 4.0 * shape.batch * shape.heads * shape.seq_len * shape.seq_len * shape.head_dim
    flops = flops / 2 if shape.causal else flops
    return flops * BWD_FACTOR if backward else flops


def ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    """num / den; None when either is missing or den is not positive."""
    return None if num is None or den is None or den <= 0 else num / den


def tflops(flops: float, ms: Optional[float]) -> Optional[float]:
    """TFLOP/s of `flops` done in `ms` milliseconds; None without a time."""
    return None if ms is None or ms <= 0 else flops / (ms * 1e-3) / 1e12


def fastest(by_backend: Dict[str, Times], kind: str) -> Tuple[Optional[str], Optional[float]]:
    """(name, ms) of the fastest SDPA backend for `kind` ("fwd" or "fwd_bwd"); (None, None) if none ran."""
    timed = [(t[kind], name) for name, t in by_backend.items() if t.get(kind) is not None]
    return (min(timed)[1], min(timed)[0]) if timed else (None, None)


def build_point(shape: Shape, family: str, ours: Times, sdpa: Dict[str, Times], peak: Optional[float], *,
                skipped: Optional[str] = None, errors: Sequence[str] = (), max_abs_err: Optional[Times] = None,
                mismatch: Optional[bool] = None, launch_order: str = "auto",
                persistent: str = "default") -> Dict[str, Any]:  # fmt: skip
    """The JSON record of one point from ours' times by kind and SDPA's by backend then kind (missing
    ones None). "sdpa_backend" is the fastest backend in the forward; each measurement also names the
    backend it is compared with. "launch_order" is the ENTROPY_ATTN_CUDA_LAUNCH_ORDER it ran under,
    "persistent" the ENTROPY_ATTN_CUDA_PERSISTENT ("default": unset)."""
    by_backend = {name: {k: sdpa.get(name, {}).get(k) for k in ("fwd", "fwd_bwd")} for name in SDPA_BACKENDS}
    fwd_name, fwd_ms = fastest(by_backend, "fwd")
    bwd_name, bwd_ms = fastest(by_backend, "fwd_bwd")
    point: Dict[str, Any] = {k: getattr(shape, k) for k in ("dtype", "head_dim", "seq_len", "batch", "heads")}
    point.update(kv_heads=shape.kv_heads, causal=shape.causal, dropout_p=shape.dropout_p, layout=shape.layout, mask=shape.mask,
                 family=family, launch_order=launch_order, persistent=persistent, sdpa_backend=fwd_name)  # fmt: skip
    against = {"fwd_stats": (fwd_name, fwd_ms), "fwd": (fwd_name, fwd_ms), "fwd_bwd": (bwd_name, bwd_ms)}
    for kind, (name, ms) in against.items():
        point[kind] = {"ours_ms": ours.get(kind), "sdpa_ms": ms, "ratio": ratio(ours.get(kind), ms), "sdpa_backend": name}
    point["sdpa_ms_by_backend"] = by_backend
    times = [ours.get("fwd_stats"), ours.get("fwd"), ours.get("fwd_bwd"), fwd_ms, bwd_ms]
    point["tflops"] = {k: tflops(attention_flops(shape, k.endswith("bwd")), t) for k, t in zip(TFLOPS_KEYS, times)}
    point["peak_fraction"] = {k: ratio(v, peak) for k, v in point["tflops"].items()}
    point.update(max_abs_err=max_abs_err, mismatch=mismatch, skipped=skipped, errors=list(errors))
    return point


def is_mismatch(errs: Times, scales: Dict[str, float], dtype: str) -> bool:
    """Whether an error is beyond CHECK_TOL (relative to max|reference| in `scales`); NaN is one."""
    for key in ERR_KEYS:
        atol, rtol = CHECK_TOL[dtype]["out" if key == "out" else "grad"]
        err = errs.get(key)
        if err is not None and not err <= atol + rtol * scales.get(key, 0.0):
            return True
    return False


def estimate_bytes(shape: Shape, backward: bool, check: bool) -> int:
    """Memory of a point: q, k, v, output and statistics; with backward dout, grads and a float32 dQ
    workspace; with --check the reference's output and grads (and k, v expanded for GQA)."""
    nq = shape.batch * shape.heads * shape.seq_len * shape.head_dim
    nkv = shape.batch * shape.kv_heads * shape.seq_len * shape.head_dim
    elems = (2 * nq + 2 * nkv) * (2 if backward else 1)
    if check:
        elems += (2 * nq + 2 * nkv if backward else nq) + (2 * nq * (2 if backward else 1) if shape.gqa else 0)
    if shape.layout == "projection":  # a merge that copies the output, a split's backward each gradient
        elems += nq + ((nq + 2 * nkv) if backward else 0)
    workspace = 12 * shape.batch * shape.heads * shape.seq_len * 4 + (4 * nq if backward else 0)
    # The mask, and the copy SDPA makes of a bool one per call (an additive mask in the inputs'
    # dtype; ours reads either kind, and an additive mask of the inputs' dtype, in place).
    item = DTYPES[shape.dtype].itemsize
    mask = shape.batch * shape.seq_len**2 * {"none": 0, "bool": 1 + item, "additive": item}[shape.mask]
    return elems * item + workspace + mask


def memory_skip_reason(need: int, free: int) -> Optional[str]:
    """Why a point needing `need` bytes is skipped with `free` bytes free, or None if it fits."""
    if need <= MEM_FRACTION * free:
        return None
    return f"needs ~{need / 2**30:.1f} GiB, over {MEM_FRACTION:.0%} of the {free / 2**30:.1f} GiB free"


def cuda_time_ms(fn: Callable[[], object], min_run_time: float, blocks: int = 5) -> float:
    """Median time of one call of `fn` in ms: `blocks` blocks of n calls between CUDA events, n
    chosen so that the blocks take about `min_run_time` seconds together (after a warm-up)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    n = max(1, int(min_run_time * 1e3 / blocks / max(start.elapsed_time(end), 1e-3)))
    per_call = []
    for _ in range(blocks):
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) / n)
    return sorted(per_call)[len(per_call) // 2]


@dataclass
class Run:
    """What the points of one run share: the extension module, the options and the timer."""

    ext: Any
    backward: bool = True
    check: bool = False
    min_run_time: float = 0.5
    device: str = "cuda"
    timer: Timer = cuda_time_ms


def describe(e: BaseException) -> str:
    """An exception in one line."""
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"


def try_time(fn: Callable[[], object], run: Run, errors: Optional[List[str]], label: str) -> Optional[float]:
    """run.timer(fn), or None if a call is refused (noted in `errors` unless None); OOM propagates."""
    try:
        return run.timer(fn, run.min_run_time)
    except torch.cuda.OutOfMemoryError:
        raise
    except (RuntimeError, ValueError) as e:
        if errors is not None:
            errors.append(f"{label}: {describe(e)}")
        return None


def make_inputs(shape: Shape, device: str) -> Inputs:
    """Seeded standard-normal q (B, H, L, D), k and v (B, Hkv, L, D) and dout (B, H, L, D); with
    the "projection" layout the same values as (B, L, heads * D) projections (in_layout splits
    them)."""
    gen = torch.Generator(device=device).manual_seed(0)
    projection = shape.layout == "projection"

    def rand(heads: int, grad: bool = True) -> torch.Tensor:
        b, l, d = shape.batch, shape.seq_len, shape.head_dim
        size = (b, l, heads * d) if projection else (b, heads, l, d)
        return torch.randn(size, device=device, dtype=DTYPES[shape.dtype], generator=gen).requires_grad_(grad)

    return Inputs(rand(shape.heads), rand(shape.kv_heads), rand(shape.kv_heads), rand(shape.heads, False),
                  padding_mask(shape, device))


def padding_mask(shape: Shape, device: str) -> Optional[torch.Tensor]:
    """The (B, 1, L, L) mask of a padded batch (None for mask "none"): batch element b's last
    b·L // (2B) keys hidden from every query (so at least half of them seen), and with causality
    key j hidden from query i < j too; bool (True: attend) or additive (0 or -inf)."""
    if shape.mask == "none":
        return None
    b, l = shape.batch, shape.seq_len
    lengths = torch.tensor([l - i * l // (2 * b) for i in range(b)], device=device)
    keys = torch.arange(l, device=device)
    allowed = (keys < lengths[:, None])[:, None, None, :].expand(b, 1, l, l)
    if shape.causal:
        allowed = allowed & (keys[None, :] <= keys[:, None])
    allowed = allowed.contiguous()
    if shape.mask == "bool":
        return allowed
    zero = torch.zeros((), device=device, dtype=DTYPES[shape.dtype])
    return torch.where(allowed, zero, zero - math.inf)


def attention_kwargs(shape: Shape, x: Inputs) -> Dict[str, Any]:
    """The mask arguments of both calls: is_causal alone, or the mask with the causal one folded in."""
    if x.mask is None:
        return {"is_causal": shape.causal}
    return {"attn_mask": x.mask, "is_causal": False}


def merged_heads(out: torch.Tensor) -> torch.Tensor:
    """(B, H, L, Dv) -> (B, L, H * Dv), as a model's attention layer hands it to its output projection."""
    return out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)


def split_heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(B, L, heads * D) -> (B, heads, L, D), a view, as a model's attention layer splits a projection."""
    return x.unflatten(-1, (-1, head_dim)).transpose(1, 2)


def in_layout(shape: Shape, attn: Callable[..., Any]) -> Callable[..., Any]:
    """attn(q, k, v); with the "projection" layout, called on projections that it splits into heads,
    its output (or the output of an (output, stats) pair) merged into (B, L, H * Dv)."""
    if shape.layout == "bhld":
        return attn

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
        res = attn(*(split_heads(t, shape.head_dim) for t in (q, k, v)))
        return (merged_heads(res[0]), *res[1:]) if isinstance(res, tuple) else merged_heads(res)

    return call


def timed_calls(attn: Callable[..., Any], x: Inputs) -> Tuple[Callable[[], object], Callable[[], object]]:
    """The two timed calls of `attn(q, k, v)`: forward (no grad) and forward + backward of the output."""

    def fwd() -> object:
        with torch.no_grad():
            return attn(x.q, x.k, x.v)

    def fwd_bwd() -> object:
        return torch.autograd.grad(attn(x.q, x.k, x.v), (x.q, x.k, x.v), x.dout)

    return fwd, fwd_bwd


def ours_fn(ext: Any, shape: Shape, x: Inputs, stats: bool = False) -> Callable[..., Any]:
    """ours(q, k, v) for a shape (in_layout), with x's mask."""
    masks = attention_kwargs(shape, x)
    return in_layout(shape, lambda q, k, v: ext.attention(
        q, k, v, enable_gqa=shape.gqa, return_stats=stats, dropout_p=shape.dropout_p, **masks
    ))  # fmt: skip


def measure_sdpa(x: Inputs, shape: Shape, run: Run) -> Dict[str, Times]:
    """SDPA's times by backend name and kind; None where the backend refuses the point."""
    masks = attention_kwargs(shape, x)
    fwd, fwd_bwd = timed_calls(
        in_layout(shape, lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, enable_gqa=shape.gqa, dropout_p=shape.dropout_p, **masks
        )),
        x,
    )  # fmt: skip
    times: Dict[str, Times] = {}
    for name, backend in SDPA_BACKENDS.items():
        with warnings.catch_warnings(), sdpa_kernel(backend):
            warnings.simplefilter("ignore")  # a refusing backend warns why before it raises
            times[name] = {"fwd": try_time(fwd, run, None, name)}
            times[name]["fwd_bwd"] = try_time(fwd_bwd, run, None, name) if run.backward else None
    return times


def measure_ours(x: Inputs, shape: Shape, run: Run, errors: List[str]) -> Times:
    """Ours' times by kind; None where a call failed (noted in `errors`)."""
    fwd, fwd_bwd = timed_calls(ours_fn(run.ext, shape, x), x)
    return {
        "fwd_stats": try_time(timed_calls(ours_fn(run.ext, shape, x, True), x)[0], run, errors, "fwd_stats"),
        "fwd": try_time(fwd, run, errors, "fwd"),
        "fwd_bwd": try_time(fwd_bwd, run, errors, "fwd_bwd") if run.backward else None,
    }


def check_point(x: Inputs, shape: Shape, run: Run) -> Tuple[Times, bool]:
    """Max abs errors of ours against SDPA (fused backends only: the math one would hold L x L; k
    and v expanded for GQA) and whether one is beyond CHECK_TOL."""
    rep = shape.heads // shape.kv_heads

    def outputs_and_grads(attn: Callable[..., torch.Tensor]) -> List[Optional[torch.Tensor]]:
        if not run.backward:  # [out, dq, dk, dv]
            with torch.no_grad():
                return [attn(x.q, x.k, x.v), None, None, None]
        out = attn(x.q, x.k, x.v)
        return [out.detach(), *torch.autograd.grad(out, (x.q, x.k, x.v), x.dout)]

    def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k, v = (k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)) if shape.gqa else (k, v)
        with sdpa_kernel(list(SDPA_BACKENDS.values())):
            return F.scaled_dot_product_attention(q, k, v, **attention_kwargs(shape, x))

    ref = outputs_and_grads(in_layout(shape, reference))
    ours = outputs_and_grads(ours_fn(run.ext, shape, x))
    errs = {k: None if a is None else (a.float() - b.float()).abs().max().item() for k, a, b in zip(ERR_KEYS, ours, ref)}
    scales = {k: 0.0 if b is None else b.float().abs().max().item() for k, b in zip(ERR_KEYS, ref)}
    bad = is_mismatch(errs, scales, shape.dtype)
    return {k: e if e is None or math.isfinite(e) else None for k, e in errs.items()}, bad  # JSON has no NaN


def measure_family(x: Inputs, shape: Shape, family: str, sdpa: Dict[str, Times], run: Run, peak: Optional[float],
                   launch_order: str = "auto", persistent: str = "default") -> Dict[str, Any]:  # fmt: skip
    """One point: set the family, the launch order and the persistent grid, check against SDPA
    (with --check), time ours, build the record."""
    os.environ[FAMILY_ENV] = family
    os.environ[LAUNCH_ORDER_ENV] = launch_order
    if persistent == "default":
        os.environ.pop(PERSISTENT_ENV, None)
    else:
        os.environ[PERSISTENT_ENV] = persistent
    errors: List[str] = []
    errs, bad = None, None
    if run.check:
        try:
            errs, bad = check_point(x, shape, run)
        except torch.cuda.OutOfMemoryError:
            raise
        except (RuntimeError, ValueError) as e:
            errors.append(f"check: {describe(e)}")
    ours = measure_ours(x, shape, run, errors)
    return build_point(shape, family, ours, sdpa, peak, errors=errors, max_abs_err=errs, mismatch=bad,
                       launch_order=launch_order, persistent=persistent)  # fmt: skip


def measure_shape(shape: Shape, families: Sequence[str], run: Run, peak: Optional[float], free: Optional[int],
                  launch_orders: Sequence[str] = ("auto",),
                  persistents: Sequence[str] = ("default",)) -> List[Dict[str, Any]]:  # fmt: skip
    """The points of one shape, one per family, launch order and persistent setting (SDPA timed once
    for all); skipped ones when the memory guard says so (`free` bytes free; None: no guard) or on
    out of memory."""
    variants = [(f, o, g) for f in families for o in launch_orders for g in persistents]
    reason = None if free is None else memory_skip_reason(estimate_bytes(shape, run.backward, run.check), free)
    points: List[Dict[str, Any]] = []
    if reason is None:
        try:
            x = make_inputs(shape, run.device)
            sdpa = measure_sdpa(x, shape, run)
            for family, order, grid in variants:
                points.append(measure_family(x, shape, family, sdpa, run, peak, order, grid))
        except torch.cuda.OutOfMemoryError:
            reason = "out of memory"
        x = sdpa = None  # type: ignore[assignment]  # freed (the exception and its frames are gone here)
        if run.device == "cuda":
            torch.cuda.empty_cache()
    return points + [build_point(shape, f, {}, {}, peak, skipped=reason, launch_order=o, persistent=g)
                     for f, o, g in variants[len(points) :]]  # fmt: skip


def matmul_peak_tflops(dtype: str, min_run_time: float, n: int = MATMUL_N) -> Optional[float]:
    """TFLOP/s of an n x n x n torch.matmul in `dtype` (median of blocks); None on out of memory."""
    try:
        a, b = (torch.randn(n, n, device="cuda", dtype=DTYPES[dtype]) for _ in range(2))
        ms: Optional[float] = cuda_time_ms(lambda: torch.matmul(a, b), min_run_time)
    except torch.cuda.OutOfMemoryError:
        ms = None
    a = b = None  # type: ignore[assignment]
    torch.cuda.empty_cache()
    return tflops(2.0 * n**3, ms)


def environment(command: str) -> Dict[str, Any]:
    """The header of the JSON: device, driver, versions, the checkout's commit, the hash of the
    sources the library was built from (the kernels measured), date."""

    def run_quiet(cmd: List[str]) -> str:  # a read-only command's stdout, '' if it fails
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=REPO_ROOT).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    props = torch.cuda.get_device_properties(0)
    driver = run_quiet(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]).splitlines()
    try:  # the hash of the sources the measured library was built from (setup.py writes it)
        from torch_ext import _build_info

        sources = getattr(_build_info, "SOURCES_SHA256", "unknown")
        untested = bool(getattr(_build_info, "UNTESTED_KERNELS", False))
    except ImportError:
        sources, untested = "unknown", False
    return {
        "device": f"{props.name} (sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB)",
        "driver": driver[0] if driver else "unknown",
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "commit": run_quiet(["git", "rev-parse", "HEAD"]) or "unknown",
        "dirty": bool(run_quiet(["git", "--no-optional-locks", "status", "--porcelain", "--", "csrc/"])),
        # The kernels measured, exactly: scripts/sources_hash.sh gives the same at their commit.
        "sources_sha256": sources,
        # Whether the kernels compiled on request were in (csrc/cuda/untested_kernels.h): without
        # them "auto" runs as it does, and a forced family falls back where they would run.
        "untested_kernels": untested,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
    }


def fmt(value: Optional[float], spec: str = ".3g", suffix: str = "") -> str:
    """A number for the tables, or n/a."""
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def note(p: Dict[str, Any]) -> str:
    """The note cell of a point: skipped, the check's result and largest error, failures."""
    parts = [f"skipped: {p['skipped']}"] if p["skipped"] else []
    if p["max_abs_err"] is not None:
        worst = max((e for e in p["max_abs_err"].values() if e is not None), default=None)
        parts.append(f"{'MISMATCH' if p['mismatch'] else 'checked'}, max err {fmt(worst, '.2g')}")
    return "; ".join(parts + ([f"{len(p['errors'])} failure(s)"] if p["errors"] else []))


def markdown(result: Dict[str, Any], backward: bool) -> str:
    """The report: a header line and three tables (times and ratios, throughput, SDPA by backend)."""
    peaks = ", ".join(f"{k} {fmt(v, '.0f')}" for k, v in result["matmul_peak_tflops"].items())
    lines = [
        f"{result['device']}, driver {result['driver']}, torch {result['torch']}, CUDA {result['cuda']}, commit "
        f"{result['commit'][:12]}{' (csrc/ modified)' if result['dirty'] else ''}, built from sources "
        f"{str(result.get('sources_sha256', 'unknown'))[:12]} (scripts/sources_hash.sh), {result['date']}; "
        f"command: `{result['command']}`",
        "",
        "Times: medians of CUDA-event blocks (ms); ratio = ours / fastest SDPA backend (lower is better); "
        "TFLOP/s count 4·B·H·L²·D per forward (halved when causal), 3.5x that for forward+backward; "
        f"matmul peak (TFLOP/s, 8192³): {peaks}."
        + (f" Both with attention dropout p = {result['dropout_p']}." if result.get("dropout_p") else ""),
    ]
    keys = ["dtype", "B", "H:Hkv", "D", "L", "causal", "family"]

    def table(title: str, cols: List[str], cells: Callable[[Dict[str, Any]], List[str]]) -> None:
        lines.extend(["", f"## {title}", "", "| " + " | ".join(keys + cols) + " |", "|" + "---|" * (len(keys) + len(cols))])  # fmt: skip
        for p in result["points"]:
            order, layout = p.get("launch_order", "auto"), p.get("layout", "bhld")
            family = p["family"] if order == "auto" else f"{p['family']}, order {order}"
            family += "" if layout == "bhld" else f", {layout} layout"
            family += "" if p.get("mask", "none") == "none" else f", {p['mask']} mask"
            grid = p.get("persistent", "default")
            family += "" if grid == "default" else f", persistent {grid}"
            key = [p["dtype"], p["batch"], f"{p['heads']}:{p['kv_heads']}", p["head_dim"], p["seq_len"], "yes" if p["causal"] else "no", family]  # fmt: skip
            lines.append("| " + " | ".join(str(c) for c in key + cells(p)) + " |")

    kinds = KINDS if backward else KINDS[:2]
    table("Times (ms): ours / SDPA / ratio", ["SDPA backend"] + list(kinds) + ["note"], lambda p: [p["sdpa_backend"] or "n/a"]
          + [f"{fmt(p[k]['ours_ms'])} / {fmt(p[k]['sdpa_ms'])} / {fmt(p[k]['ratio'], '.2f', 'x')}" for k in kinds] + [note(p)])  # fmt: skip
    tkeys = [k for k in TFLOPS_KEYS if backward or not k.endswith("bwd")]
    table("TFLOP/s (fraction of the matmul peak)", tkeys, lambda p: [f"{fmt(p['tflops'][k], '.1f')} ({fmt(p['peak_fraction'][k], '.0%')})" for k in tkeys])  # fmt: skip
    sdpa_kinds = ("fwd", "fwd_bwd") if backward else ("fwd",)
    table("SDPA by backend (ms; n/a: refused)", [f"{b} {k}" for b in SDPA_BACKENDS for k in sdpa_kinds],
          lambda p: [fmt(p["sdpa_ms_by_backend"][b][k]) for b in SDPA_BACKENDS for k in sdpa_kinds])  # fmt: skip
    errors = [f"- {p['dtype']} {p['heads']}:{p['kv_heads']} D={p['head_dim']} L={p['seq_len']} causal={p['causal']} "
              f"{p['family']} ({p.get('layout', 'bhld')} layout, mask {p.get('mask', 'none')}): {e}"
              for p in result["points"] for e in p["errors"]]  # fmt: skip
    return "\n".join(lines + (["", "## Failures", ""] + errors if errors else [])) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the benchmark; returns the exit code."""
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "gpu_vs_sdpa: no CUDA device is visible (torch.cuda.is_available() is False): nothing "
            f"benchmarked, nothing written{' (--require-gpu: failing)' if args.require_gpu else ''}."
        )
        return 1 if args.require_gpu else 0
    try:
        import torch_ext as ext
    except ImportError:  # not installed: the one built in place in this checkout
        sys.path.insert(0, REPO_ROOT)
        import torch_ext as ext
    if not torch._C._dispatch_has_kernel_for_dispatch_key("entropy_attn::attention", "CUDA"):
        print("gpu_vs_sdpa: torch_ext has no CUDA kernel for entropy_attn::attention (built without CUDA?)")
        return 1
    run = Run(ext, backward=args.backward, check=args.check, min_run_time=args.min_run_time)
    command = "python3 benchmarks/gpu_vs_sdpa.py " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    result = environment(command.strip())
    result["dropout_p"] = args.dropout_p
    result["matmul_peak_tflops"] = peaks = {dt: matmul_peak_tflops(dt, args.min_run_time) for dt in args.dtype}
    saved, points = {k: os.environ.get(k) for k in (FAMILY_ENV, LAUNCH_ORDER_ENV, PERSISTENT_ENV)}, []
    try:
        for shape in tqdm(expand_grid(args), desc="gpu_vs_sdpa", unit="shape", file=sys.stderr):
            points += measure_shape(shape, args.family, run, peaks[shape.dtype], torch.cuda.mem_get_info()[0],
                                    args.launch_order, args.persistent)  # fmt: skip
    finally:  # the variables as they were
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    result["points"] = points
    text = markdown(result, args.backward)
    print("\n" + text)
    for path, content in ((args.out_md, text), (args.out_json, json.dumps(result, indent=1) + "\n")):
        if path:  # '' skips
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w") as f:
                f.write(content)
            print(f"written to {path}")
    failed = [p for p in points if p["errors"] or p["mismatch"]]
    if failed:
        print(f"gpu_vs_sdpa: {len(failed)} point(s) with failures or mismatches (see the notes)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
