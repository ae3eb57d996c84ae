"""CPU benchmark suite: torch_ext.attention against SDPA (flash, math), FlexAttention and eager monitoring.

For every grid point (dtype, head dim D, batch B, heads H, kv heads Hkv, causal, L = Lq = Lk) it
times, in this process and interleaved (each repeat loops over all methods, so machine noise hits
all alike), with ``torch.utils.benchmark.Timer.blocked_autorange``:

  * ours: ``torch_ext.attention`` forward with statistics, forward without, forward+backward, for
    scale None and "logn" (train length 512);
  * SDPA with the CPU flash backend and with the math backend on q multiplied by the per-row log-n
    factor (what Qwen / Llama 4 / SSMax ports do today), forward and forward+backward, and plain
    SDPA flash (scale None) as the baseline;
  * FlexAttention compiled with a log-n ``score_mod`` (forward; the backward is tried and reported);
  * eager monitoring: the L x L scores, softmax in float32, entropy, P @ V.

Before timing a point it checks that ours and each competitor compute the same output. It also
measures a ``torch.mm`` reference (to express GFLOP/s as a fraction of what this machine's matmul
reaches) and, each in a fresh subprocess (``memory_probe.py``), the peak memory of the methods
against L. Writes ``cpu.md`` (tables, medians, target checks), ``cpu.json`` (every raw
measurement) and ``cpu_time.png``, ``cpu_ratio.png``, ``cpu_memory.png`` into ``--out``.

    python3 benchmarks/suite.py --quick                        # small grid, < 2 minutes on 2 cores (results/quick/)
    python3 benchmarks/suite.py                                # full grid (hours on 2 cores)
    python3 benchmarks/suite.py --lengths 1024 4096 --dtypes float32 --head-dims 128 --no-flex
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
import torch.utils.benchmark as benchmark
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm import tqdm

import torch_ext

HERE = Path(__file__).resolve().parent
TRAIN_LENGTH = 512
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# allclose tolerances of the correctness guard: 16-bit types round q * factor and the output.
TOLERANCES: dict[str, tuple[float, float]] = {
    "float32": (1e-3, 1e-4),
    "bfloat16": (2e-2, 2e-2),
    "float16": (5e-3, 5e-3),
}
# FLOPs of forward+backward relative to the forward, as FlashAttention counts them (backward = 2.5x).
FWD_BWD_FLOP_FACTOR = 3.5
# Points whose forward would take longer than this at matmul speed get fewer repeats.
SLOW_CALL_S = 0.5
SLOW_REPEATS = 2
# The longest torch.mm call of the matmul reference (a dtype slower than this gets a smaller size: matmul_sizes).
SLOW_MM_S = 0.5

# The grids: (B, H, Hkv) shapes are written "BxHxHkv".
FULL_GRID: dict[str, Any] = {
    "lengths": [256, 512, 1024, 2048, 4096, 8192],
    "dtypes": ["float32", "bfloat16"],
    "head_dims": [64, 128],
    "shapes": ["2x8x8", "1x8x8", "1x8x2"],
    "memory_lengths": [1024, 2048, 4096, 8192],
    "min_run_time": 0.2,
}
QUICK_GRID: dict[str, Any] = {
    "lengths": [256, 1024],
    "dtypes": ["float32", "bfloat16"],
    "head_dims": [64],
    "shapes": ["1x8x8"],
    "memory_lengths": [1024, 4096],
    "min_run_time": 0.05,
}


@dataclass(frozen=True)
class Point:
    """One grid point: q is (batch, heads, length, head_dim), k and v (batch, kv_heads, length, head_dim)."""

    dtype: str
    head_dim: int
    batch: int
    heads: int
    kv_heads: int
    causal: bool
    length: int

    @property
    def gqa(self) -> bool:
        """Whether query heads share key/value heads."""
        return self.kv_heads != self.heads

    @property
    def flops_fwd(self) -> float:
        """Forward FLOPs 4·B·H·Lq·Lk·D, halved for causal (the convention of FlashAttention's benchmarks)."""
        flops = 4.0 * self.batch * self.heads * self.length * self.length * self.head_dim
        return flops / 2 if self.causal else flops

    @property
    def scores(self) -> int:
        """Number of entries of the B·H·Lq·Lk score tensor that eager code materializes."""
        return self.batch * self.heads * self.length * self.length

    @property
    def label(self) -> str:
        """Short human-readable name."""
        heads = f"{self.heads}" if not self.gqa else f"{self.heads}:{self.kv_heads}"
        return (
            f"{self.dtype} D={self.head_dim} B={self.batch} H={heads}"
            f"{' causal' if self.causal else ''} L={self.length}"
        )


@dataclass
class Inputs:
    """Tensors of one grid point; the *_g ones require grad (for the backward), the others do not."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_g: torch.Tensor
    k_g: torch.Tensor
    v_g: torch.Tensor
    grad_out: torch.Tensor
    factor: torch.Tensor  # (1, 1, L, 1) log_512(n_i) in the inputs' dtype: what models multiply q by
    row_scale: torch.Tensor  # (1, 1, L, 1) float32 log_512(n_i) / sqrt(D): eager's logit scale
    causal_mask: torch.Tensor | None  # (L, L) bool, True above the diagonal (masked), for eager


@dataclass(frozen=True)
class Method:
    """A timed computation. `quadratic` is how many float32 B·H·L² tensors it holds at its peak
    (0: memory linear in L); it decides "skipped (memory)" before anything is allocated."""

    key: str
    label: str
    family: str  # ours, flash, math, flex or eager (--no-flex drops the flex family)
    backward: bool
    scale: str  # "logn" or "none"
    quadratic: float
    build: Callable[[Point, Inputs], Callable[[], Any]]


def logn_factor(length: int, causal: bool) -> torch.Tensor:
    """(1, 1, L, 1) float32 log_512(n_i), n_i the keys row i sees: i + 1 if causal, else L."""
    if causal:
        n = torch.arange(1, length + 1, dtype=torch.float32)
    else:
        n = torch.full((length,), float(length))
    return (torch.log(n) / math.log(TRAIN_LENGTH)).view(1, 1, length, 1)


def make_inputs(point: Point, seed: int = 0) -> Inputs:
    """Random inputs of a grid point (seeded, so every method and every run sees the same data)."""
    gen = torch.Generator().manual_seed(seed)
    dtype = DTYPES[point.dtype]
    q_shape = (point.batch, point.heads, point.length, point.head_dim)
    kv_shape = (point.batch, point.kv_heads, point.length, point.head_dim)
    q = torch.randn(q_shape, generator=gen, dtype=dtype)
    k = torch.randn(kv_shape, generator=gen, dtype=dtype)
    v = torch.randn(kv_shape, generator=gen, dtype=dtype)
    factor = logn_factor(point.length, point.causal)
    mask = torch.ones(point.length, point.length, dtype=torch.bool).triu(1) if point.causal else None
    return Inputs(
        q=q,
        k=k,
        v=v,
        q_g=q.clone().requires_grad_(),
        k_g=k.clone().requires_grad_(),
        v_g=v.clone().requires_grad_(),
        grad_out=torch.randn(q_shape, generator=gen, dtype=dtype),
        factor=factor.to(dtype),
        row_scale=factor / math.sqrt(point.head_dim),
        causal_mask=mask,
    )


# --- the methods ----------------------------------------------------------------------------------


def ours(scale: str, stats: bool, backward: bool) -> Callable[[Point, Inputs], Callable[[], Any]]:
    """torch_ext.attention: forward (with or without statistics) or forward+backward (with statistics,
    gradients of the output w.r.t. q, k, v)."""
    scale_arg = "logn" if scale == "logn" else None

    def build(p: Point, x: Inputs) -> Callable[[], Any]:
        def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
            return torch_ext.attention(
                q, k, v, is_causal=p.causal, scale=scale_arg, enable_gqa=p.gqa,
                train_length=TRAIN_LENGTH, return_stats=stats,
            )  # fmt: skip

        if not backward:
            return lambda: forward(x.q, x.k, x.v)
        return lambda: torch.autograd.grad(forward(x.q_g, x.k_g, x.v_g)[0], (x.q_g, x.k_g, x.v_g), x.grad_out)

    return build


def sdpa(backend: SDPBackend, scale: str, backward: bool) -> Callable[[Point, Inputs], Callable[[], Any]]:
    """F.scaled_dot_product_attention restricted to one backend; for "logn" on q * factor, the
    multiply inside the timed call (models do it on every step)."""

    def build(p: Point, x: Inputs) -> Callable[[], Any]:
        def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if scale == "logn":
                q = q * x.factor
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=p.causal, enable_gqa=p.gqa)

        if not backward:
            return lambda: forward(x.q, x.k, x.v)
        return lambda: torch.autograd.grad(forward(x.q_g, x.k_g, x.v_g), (x.q_g, x.k_g, x.v_g), x.grad_out)

    return build


@functools.cache
def compiled_flex() -> Callable[..., torch.Tensor]:
    """flex_attention under torch.compile, compiled for every new shape (dynamic=False). Dynamo's
    recompile limit (8) would otherwise make later grid points fall back to the eager flex
    implementation, which materializes the L x L scores; fail loudly instead of silently."""
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.config.recompile_limit = 1 << 16
    torch._dynamo.config.accumulated_recompile_limit = 1 << 16
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    return torch.compile(flex_attention, dynamic=False)


def causal_mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    """FlexAttention mask_mod of causal attention aligned top-left."""
    return q_idx >= kv_idx


def flex(backward: bool) -> Callable[[Point, Inputs], Callable[[], Any]]:
    """Compiled FlexAttention with a log-n score_mod (and a causal block mask where causal)."""

    def build(p: Point, x: Inputs) -> Callable[[], Any]:
        from torch.nn.attention.flex_attention import create_block_mask

        fn = compiled_flex()
        inv_log_base = 1.0 / math.log(TRAIN_LENGTH)
        if p.causal:
            block_mask = create_block_mask(causal_mask_mod, None, None, p.length, p.length, device="cpu")

            def score_mod(score: torch.Tensor, b: Any, h: Any, q_idx: torch.Tensor, kv_idx: Any) -> torch.Tensor:
                return score * (torch.log((q_idx + 1).to(torch.float32)) * inv_log_base)

        else:
            block_mask = None
            factor = math.log(p.length) * inv_log_base

            def score_mod(score: torch.Tensor, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> torch.Tensor:
                return score * factor

        def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return fn(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=p.gqa)

        if not backward:
            return lambda: forward(x.q, x.k, x.v)
        return lambda: torch.autograd.grad(forward(x.q_g, x.k_g, x.v_g), (x.q_g, x.k_g, x.v_g), x.grad_out)

    return build


def eager(backward: bool) -> Callable[[Point, Inputs], Callable[[], Any]]:
    """Attention entropy monitoring as done today: materialize the scaled scores, mask, softmax in
    float32, entropy of the probabilities (detached: it is logged, not trained), then P @ V."""

    def build(p: Point, x: Inputs) -> Callable[[], Any]:
        groups = p.heads // p.kv_heads

        def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if groups > 1:  # GQA: repeat the kv heads, as Hugging Face's repeat_kv
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            scores = (q @ k.transpose(-2, -1)).float() * x.row_scale
            if x.causal_mask is not None:
                scores = scores.masked_fill(x.causal_mask, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            entropy = torch.special.entr(probs.detach()).sum(-1)
            return probs.to(v.dtype) @ v, entropy

        if not backward:
            return lambda: forward(x.q, x.k, x.v)
        return lambda: torch.autograd.grad(forward(x.q_g, x.k_g, x.v_g)[0], (x.q_g, x.k_g, x.v_g), x.grad_out)

    return build


FLASH, MATH = SDPBackend.FLASH_ATTENTION, SDPBackend.MATH
# The quadratic counts were measured with memory_probe.py (peak RSS / (B·H·L²·4 bytes)) and rounded up.
METHODS: list[Method] = [
    Method("ours_stats/logn", "ours fwd+stats", "ours", False, "logn", 0, ours("logn", True, False)),
    Method("ours_fwd/logn", "ours fwd", "ours", False, "logn", 0, ours("logn", False, False)),
    Method("ours_bwd/logn", "ours fwd+bwd", "ours", True, "logn", 0, ours("logn", True, True)),
    Method("ours_stats/none", "ours fwd+stats", "ours", False, "none", 0, ours("none", True, False)),
    Method("ours_fwd/none", "ours fwd", "ours", False, "none", 0, ours("none", False, False)),
    Method("ours_bwd/none", "ours fwd+bwd", "ours", True, "none", 0, ours("none", True, True)),
    Method("flash_fwd/logn", "SDPA flash (q·f)", "flash", False, "logn", 0, sdpa(FLASH, "logn", False)),
    Method("flash_bwd/logn", "SDPA flash (q·f) fwd+bwd", "flash", True, "logn", 0, sdpa(FLASH, "logn", True)),
    Method("flash_fwd/none", "SDPA flash", "flash", False, "none", 0, sdpa(FLASH, "none", False)),
    Method("flash_bwd/none", "SDPA flash fwd+bwd", "flash", True, "none", 0, sdpa(FLASH, "none", True)),
    Method("math_fwd/logn", "SDPA math (q·f)", "math", False, "logn", 3, sdpa(MATH, "logn", False)),
    Method("math_bwd/logn", "SDPA math (q·f) fwd+bwd", "math", True, "logn", 5, sdpa(MATH, "logn", True)),
    Method("flex_fwd/logn", "FlexAttention", "flex", False, "logn", 0, flex(False)),
    Method("flex_bwd/logn", "FlexAttention fwd+bwd", "flex", True, "logn", 0, flex(True)),
    Method("eager_fwd/logn", "eager monitoring", "eager", False, "logn", 3.5, eager(False)),
    Method("eager_bwd/logn", "eager monitoring fwd+bwd", "eager", True, "logn", 5, eager(True)),
]
METHODS_BY_KEY: dict[str, Method] = {m.key: m for m in METHODS}
# The reference of the correctness guard for each scale, and the comparison that must hold.
REFERENCE = {"logn": "ours_stats/logn", "none": "ours_stats/none"}
REQUIRED_MATCH = "flash_fwd/logn"


def estimated_bytes(method: Method, point: Point) -> float:
    """Peak bytes of the L² tensors the method materializes (0 for linear-memory methods)."""
    return method.quadratic * point.scores * 4.0


def first_line(exc: BaseException) -> str:
    """The exception's type and the first line of its message, for the report."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:300] if lines else ''}"


# --- machine and matmul reference -----------------------------------------------------------------


def machine_header(threads: int) -> dict[str, Any]:
    """CPU model, ISA flags, torch version, thread count and date, for the report's header."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:  # not Linux: the model from platform, flags unknown
        pass
    isa = {name: name in flags for name in ("avx2", "avx512f", "avx512_bf16")}
    isa["amx"] = any(f.startswith("amx") for f in flags)
    return {
        "cpu": model or platform.processor() or platform.machine(),
        "isa": isa,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "logical_cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "threads": threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": "python3 " + shlex.join(sys.argv),
    }


def summarize_times(measurements: list[benchmark.Measurement]) -> dict[str, Any]:
    """Median and IQR (seconds per call) over the blocks of all repeats, and how many runs."""
    times = [t for m in measurements for t in m.times]
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else (times[0],) * 3
    return {
        "median_s": statistics.median(times),
        "iqr_s": q3 - q1,
        "blocks": len(times),
        "calls": sum(len(m.times) * m.number_per_run for m in measurements),
        "block_times_s": times,
        "calls_per_block": [m.number_per_run for m in measurements],
        "repeat_medians_s": [m.median for m in measurements],
    }


def timer(fn: Callable[[], Any], threads: int) -> benchmark.Timer:
    """A Timer of `fn()` with all threads (Timer's own default is 1 thread)."""
    return benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads)


def matmul_sizes(dtypes: list[str], size: int, threads: int) -> dict[str, int]:
    """The N of each dtype's N x N torch.mm reference: ``size``, or for a dtype whose product of that
    size would take longer than SLOW_MM_S the largest power-of-2 fraction of it (at least 256) that
    would not, predicted from a 256^2 product by N^3. bfloat16 on a CPU without bfloat16
    instructions ran at about 1 GFLOP/s, 17 s per 2048^2 call: the reference alone outlasted
    --quick's minutes. Chosen once, so that the references before and after the grid are of one
    size."""
    gen = torch.Generator().manual_seed(0)
    sizes = {}
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)  # (the threads the reference is timed with)
    try:
        for name in dtypes:
            a, b = (torch.randn(256, 256, generator=gen, dtype=DTYPES[name]) for _ in range(2))
            torch.mm(a, b)  # (a first call's set-up is not the product's time)
            start = time.perf_counter()
            torch.mm(a, b)
            per_unit = (time.perf_counter() - start) / 256**3
            n = size
            while n > 256 and per_unit * n**3 > SLOW_MM_S:
                n //= 2
            sizes[name] = n
    finally:
        torch.set_num_threads(threads_before)
    return sizes


def matmul_reference(dtypes: list[str], sizes: dict[str, int], threads: int, min_run_time: float,
                     repeats: int) -> dict[str, Any]:
    """torch.mm of N x N matrices per dtype (N: ``sizes``), interleaved: GFLOP/s the machine's matmul
    reaches."""
    gen = torch.Generator().manual_seed(0)
    fns = {}
    for name in dtypes:
        a, b = (torch.randn(sizes[name], sizes[name], generator=gen, dtype=DTYPES[name]) for _ in range(2))
        fns[name] = functools.partial(torch.mm, a, b)
    runs: dict[str, list[benchmark.Measurement]] = {name: [] for name in dtypes}
    for _ in range(repeats):
        for name, fn in fns.items():
            runs[name].append(timer(fn, threads).blocked_autorange(min_run_time=min_run_time))
    out = {}
    for name, ms in runs.items():
        stats = summarize_times(ms)
        out[name] = {**stats, "size": sizes[name], "gflops": 2.0 * sizes[name] ** 3 / stats["median_s"] / 1e9}
    return out


# --- one grid point -------------------------------------------------------------------------------


def build_cases(point: Point, inputs: Inputs, methods: list[Method], max_bytes: float) -> tuple[dict, dict]:
    """The callables to time, and the status of the methods that will not be timed."""
    cases: dict[str, Callable[[], Any]] = {}
    status: dict[str, dict[str, Any]] = {}
    for m in methods:
        need = estimated_bytes(m, point)
        if need > max_bytes:
            status[m.key] = {"status": "skipped (memory)", "estimated_gib": need / 2**30}
            continue
        try:
            cases[m.key] = m.build(point, inputs)
        except Exception as exc:  # a competitor that cannot even be set up is reported, not fatal
            status[m.key] = {"status": "unsupported", "error": first_line(exc)}
    return cases, status


def output_of(result: Any) -> torch.Tensor:
    """The attention output of a forward method's result (ours and eager return tuples)."""
    return result[0] if isinstance(result, tuple) else result


def correctness_guard(point: Point, cases: dict, status: dict) -> dict[str, Any]:
    """Run each forward once (this also compiles FlexAttention, outside any timing) and compare its
    output with ours of the same scale. Methods that raise become "unsupported", those that
    disagree "mismatch"; both are removed from `cases`."""
    rtol, atol = TOLERANCES[point.dtype]
    refs = {scale: output_of(cases[key]()).float() for scale, key in REFERENCE.items()}
    diffs: dict[str, Any] = {"rtol": rtol, "atol": atol}
    for key in [k for k in cases if not METHODS_BY_KEY[k].backward and k not in REFERENCE.values()]:
        ref = refs[METHODS_BY_KEY[key].scale]
        try:
            out = output_of(cases[key]()).float()
        except Exception as exc:  # e.g. FlexAttention without a CPU kernel for this dtype
            status[key] = {"status": "unsupported", "error": first_line(exc)}
            del cases[key]
            continue
        diff = (out - ref).abs().max().item()
        ok = bool(torch.allclose(out, ref, rtol=rtol, atol=atol))
        diffs[key] = {"max_abs_diff": diff, "allclose": ok}
        if not ok:
            status[key] = {"status": "mismatch", "max_abs_diff": diff}
            del cases[key]
    return diffs


def time_cases(cases: dict, status: dict, repeats: int, min_run_time: float, threads: int) -> None:
    """Time every case `repeats` times, interleaved; a case that raises is dropped as unsupported."""
    runs: dict[str, list[benchmark.Measurement]] = {key: [] for key in cases}
    for _ in range(repeats):
        for key in list(cases):
            try:
                runs[key].append(timer(cases[key], threads).blocked_autorange(min_run_time=min_run_time))
            except Exception as exc:  # e.g. FlexAttention's backward on CPU: report it, keep going
                status[key] = {"status": "unsupported", "error": first_line(exc)}
                del cases[key], runs[key]
    for key, ms in runs.items():
        status[key] = {"status": "ok", **summarize_times(ms)}


def measure_point(point: Point, methods: list[Method], args: argparse.Namespace, matmul: dict) -> dict[str, Any]:
    """Guard and time one grid point; returns its JSON record. `matmul` (a first measurement of the
    reference) only decides whether the point is slow enough for fewer repeats."""
    inputs = make_inputs(point)
    cases, status = build_cases(point, inputs, methods, args.max_memory_gib * 2**30)
    guard = correctness_guard(point, cases, status)
    if REQUIRED_MATCH in status and status[REQUIRED_MATCH]["status"] == "mismatch":
        # ours and SDPA disagree: any timing would compare different computations
        for key in cases:
            status[key] = {"status": "not timed (guard failed)"}
        cases = {}
    rate = matmul[point.dtype]["gflops"] * 1e9
    repeats = SLOW_REPEATS if point.flops_fwd / rate > SLOW_CALL_S else args.repeats
    time_cases(cases, status, min(repeats, args.repeats), args.min_run_time, args.threads)
    for key, st in status.items():
        if st["status"] == "ok":
            flops = point.flops_fwd * (FWD_BWD_FLOP_FACTOR if METHODS_BY_KEY[key].backward else 1.0)
            st["gflops"] = flops / st["median_s"] / 1e9
    return {
        "point": asdict(point),
        "label": point.label,
        "flops_fwd": point.flops_fwd,
        "guard": guard,
        "methods": status,
    }


# --- memory ---------------------------------------------------------------------------------------

MEMORY_METHODS = [
    "ours_stats/logn", "ours_bwd/logn", "flash_fwd/logn", "math_fwd/logn", "flex_fwd/logn", "eager_fwd/logn",
]  # fmt: skip


def memory_probe(method: str, point: Point, threads: int) -> dict[str, Any]:
    """Peak memory of one method in a fresh subprocess (memory_probe.py), so that nothing allocated
    before (other methods, the allocator's caches) hides or inflates it."""
    cmd = [
        sys.executable, str(HERE / "memory_probe.py"), "--method", method, "--dtype", point.dtype,
        "--length", str(point.length), "--head-dim", str(point.head_dim), "--batch", str(point.batch),
        "--heads", str(point.heads), "--kv-heads", str(point.kv_heads), "--threads", str(threads),
    ]  # fmt: skip
    if point.causal:
        cmd.append("--causal")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        err = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        return {"status": "unsupported", "error": err[:300]}
    return {"status": "ok", **json.loads(lines[-1])}


def memory_points(lengths: list[int]) -> list[Point]:
    """The memory grid: B=1, H=8, D=64, float32, not causal (the full L x L for eager)."""
    return [Point("float32", 64, 1, 8, 8, False, length) for length in lengths]


def loglog_slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of log y against log x (1: linear growth, 2: quadratic)."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if y > 0]
    if len(pts) < 2:
        return None
    mx, my = statistics.fmean(p[0] for p in pts), statistics.fmean(p[1] for p in pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / den if den else None


def memory_slopes(memory: list[dict]) -> dict[str, float | None]:
    """Per method, the log-log slope of peak memory against L."""
    slopes = {}
    for method in dict.fromkeys(r["method"] for r in memory):
        ok = [r for r in memory if r["method"] == method and r["status"] == "ok"]
        slopes[method] = loglog_slope([r["length"] for r in ok], [r["peak_bytes"] for r in ok])
    return slopes


# --- summary and checks ---------------------------------------------------------------------------


def median_of(key: str, st: dict) -> float | None:
    """The median seconds of a method at a point, or None if it was not timed."""
    s = st.get(key)
    return s["median_s"] if s and s["status"] == "ok" else None


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None where either is missing."""
    return a / b if a is not None and b is not None and b > 0 else None


# The ratios shown per grid point and summarized over the grid: name -> (numerator, denominator).
RATIOS: dict[str, tuple[str, str]] = {
    "fwd ours/flash (logn)": ("ours_stats/logn", "flash_fwd/logn"),
    "fwd ours/flash (none)": ("ours_stats/none", "flash_fwd/none"),
    "fwd+bwd ours/flash (logn)": ("ours_bwd/logn", "flash_bwd/logn"),
    "fwd+bwd ours/flash (none)": ("ours_bwd/none", "flash_bwd/none"),
    "fwd eager/ours": ("eager_fwd/logn", "ours_stats/logn"),
    "fwd+bwd eager/ours": ("eager_bwd/logn", "ours_bwd/logn"),
}


def point_ratios(record: dict) -> dict[str, float | None]:
    """The RATIOS of one grid point."""
    st = record["methods"]
    return {name: ratio(median_of(a, st), median_of(b, st)) for name, (a, b) in RATIOS.items()}


def pct_matmul(record: dict, key: str) -> float | None:
    """A method's GFLOP/s as a percentage of the same dtype's matmul, or None."""
    st = record["methods"].get(key)
    return st["pct_matmul"] if st and st["status"] == "ok" else None


def grid_summary(records: list[dict]) -> dict[str, Any]:
    """Median and worst grid point of each ratio and of the % of matmul, overall and per dtype."""
    series: dict[str, list[tuple[float, str, str]]] = {}
    for r in records:
        values = {**point_ratios(r), "fwd % of matmul": pct_matmul(r, "ours_stats/logn"),
                  "fwd+bwd % of matmul": pct_matmul(r, "ours_bwd/logn")}  # fmt: skip
        for name, value in values.items():
            if value is not None:
                series.setdefault(name, []).append((value, r["label"], r["point"]["dtype"]))
    summary = {}
    for name, vals in series.items():
        # a ratio ours/flash is worst when highest; a speedup over eager or a % of matmul when lowest
        worst = max(vals) if "ours/flash" in name else min(vals)
        per_dtype = {d: statistics.median(v for v, _, dd in vals if dd == d) for d in dict.fromkeys(x[2] for x in vals)}
        summary[name] = {"median": statistics.median(v for v, _, _ in vals), "per_dtype_median": per_dtype,
                         "worst": worst[0], "worst_point": worst[1], "points": len(vals)}  # fmt: skip
    return summary


def check(name: str, met: bool | None, detail: str) -> dict[str, Any]:
    """One target check: met, not met, or not evaluated (None: the grid has no data for it)."""
    result = "not evaluated" if met is None else ("met" if met else "not met")
    return {"check": name, "result": result, "detail": detail}


def ratio_check(name: str, stat: dict | None, median_max: float, worst_max: float | None = None) -> dict[str, Any]:
    """A check on a summarized ratio ours/flash: its median, and optionally its worst point, bounded."""
    if stat is None:
        return check(name, None, "no grid point with both timed")
    met = stat["median"] <= median_max and (worst_max is None or stat["worst"] <= worst_max)
    return check(name, met, f"median {stat['median']:.2f}x, worst {stat['worst']:.2f}x ({stat['worst_point']})")


def min_check(name: str, values: list[tuple[float, str]], bound: float, unit: str) -> dict[str, Any]:
    """A check that every (value, point label) reaches `bound`."""
    if not values:
        return check(name, None, "no such grid point timed")
    low, label = min(values)
    detail = f"min {low:.1f}{unit} ({label}), median {statistics.median(v for v, _ in values):.1f}{unit}"
    return check(name, low >= bound, detail)


def target_checks(records: list[dict], summary: dict, slopes: dict) -> list[dict]:
    """The issue's targets (a)-(d), each with the numbers it was decided on."""
    eager_4096 = [(x, r["label"]) for r in records if r["point"]["length"] == 4096
                  for x in [point_ratios(r)["fwd eager/ours"]] if x is not None]  # fmt: skip
    big_fp32 = [(x, r["label"]) for r in records
                if r["point"]["length"] >= 1024 and r["point"]["head_dim"] == 128 and r["point"]["dtype"] == "float32"
                for x in [pct_matmul(r, "ours_stats/logn")] if x is not None]  # fmt: skip
    s_ours, s_eager = slopes.get("ours_stats/logn"), slopes.get("eager_fwd/logn")
    memory_name = "(c) memory: ours linear in L, eager quadratic (log-log slopes)"
    return [
        ratio_check("(a) fwd+stats <= 1.0x SDPA flash on q·f (median), no point > 1.15x",
                    summary.get("fwd ours/flash (logn)"), 1.0, 1.15),
        ratio_check("(b) fwd+bwd <= 1.2x SDPA flash fwd+bwd on q·f (median)",
                    summary.get("fwd+bwd ours/flash (logn)"), 1.2),
        min_check("(c) >= 5x faster than eager monitoring (fwd) at L = 4096", eager_4096, 5.0, "x"),
        check(memory_name, None, "not measured") if s_ours is None or s_eager is None else check(
            memory_name, s_ours <= 1.3 and s_eager >= 1.7,
            f"ours fwd+stats {s_ours:.2f}, eager {s_eager:.2f} (1 = linear, 2 = L²)"),
        min_check("(d) fwd+stats at L >= 1024, D = 128, float32 >= 50% of matmul GFLOP/s", big_fp32, 50.0, "%"),
    ]  # fmt: skip


# --- Markdown -------------------------------------------------------------------------------------


def cell_ms(record: dict, key: str) -> str:
    """A method's median in ms, or its status where it was not timed."""
    st = record["methods"].get(key)
    if st is None:
        return "off"
    if st["status"] != "ok":
        return st["status"]
    ms = st["median_s"] * 1e3
    return f"{ms:.3f}" if ms < 1 else (f"{ms:.2f}" if ms < 100 else f"{ms:.0f}")


def fmt(value: float | None, spec: str, suffix: str = "") -> str:
    """A number with a format spec, or a dash."""
    return "—" if value is None else f"{value:{spec}}{suffix}"


def noise(record: dict) -> float | None:
    """The largest IQR / median over the point's timed methods (how noisy the point was)."""
    rel = [st["iqr_s"] / st["median_s"] for st in record["methods"].values() if st["status"] == "ok"]
    return 100 * max(rel) if rel else None


def point_cells(record: dict) -> list[str]:
    """The columns that name a grid point."""
    p = record["point"]
    heads = f"{p['batch']}×{p['heads']}" + (f":{p['kv_heads']}" if p["kv_heads"] != p["heads"] else "")
    return [p["dtype"], str(p["head_dim"]), heads, "yes" if p["causal"] else "no", str(p["length"])]


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


POINT_HEADER = ["dtype", "D", "B×H(:Hkv)", "causal", "L"]


def ms_column(key: str) -> Callable[[dict], str]:
    """A table column: the median ms of one method."""
    return lambda r: cell_ms(r, key)


def ratio_column(name: str, spec: str) -> Callable[[dict], str]:
    """A table column: one of the RATIOS."""
    return lambda r: fmt(point_ratios(r)[name], spec, "x")


def rate_column(key: str, field: str, spec: str, suffix: str = "") -> Callable[[dict], str]:
    """A table column: a method's GFLOP/s or % of matmul."""
    return lambda r: fmt(r["methods"].get(key, {}).get(field), spec, suffix)


FORWARD_COLUMNS: list[tuple[str, Callable[[dict], str]]] = [
    ("ours fwd+stats", ms_column("ours_stats/logn")),
    ("ours fwd", ms_column("ours_fwd/logn")),
    ("SDPA flash q·f", ms_column("flash_fwd/logn")),
    ("SDPA math q·f", ms_column("math_fwd/logn")),
    ("flex", ms_column("flex_fwd/logn")),
    ("eager monitor", ms_column("eager_fwd/logn")),
    ("**ours/flash**", ratio_column("fwd ours/flash (logn)", ".2f")),
    ("eager/ours", ratio_column("fwd eager/ours", ".1f")),
    ("ours+stats, scale None", ms_column("ours_stats/none")),
    ("SDPA flash", ms_column("flash_fwd/none")),
    ("ours/flash (None)", ratio_column("fwd ours/flash (none)", ".2f")),
    ("GFLOP/s", rate_column("ours_stats/logn", "gflops", ".0f")),
    ("% mm", rate_column("ours_stats/logn", "pct_matmul", ".0f", "%")),
    ("max abs diff vs flash", lambda r: fmt(r["guard"].get(REQUIRED_MATCH, {}).get("max_abs_diff"), ".1e")),
    ("noise", lambda r: fmt(noise(r), ".0f", "%")),
]
BACKWARD_COLUMNS: list[tuple[str, Callable[[dict], str]]] = [
    ("ours", ms_column("ours_bwd/logn")),
    ("SDPA flash q·f", ms_column("flash_bwd/logn")),
    ("SDPA math q·f", ms_column("math_bwd/logn")),
    ("flex", ms_column("flex_bwd/logn")),
    ("eager monitor", ms_column("eager_bwd/logn")),
    ("**ours/flash**", ratio_column("fwd+bwd ours/flash (logn)", ".2f")),
    ("eager/ours", ratio_column("fwd+bwd eager/ours", ".1f")),
    ("ours, scale None", ms_column("ours_bwd/none")),
    ("SDPA flash", ms_column("flash_bwd/none")),
    ("ours/flash (None)", ratio_column("fwd+bwd ours/flash (none)", ".2f")),
    ("GFLOP/s", rate_column("ours_bwd/logn", "gflops", ".0f")),
    ("% mm", rate_column("ours_bwd/logn", "pct_matmul", ".0f", "%")),
]


def point_table(records: list[dict], columns: list[tuple[str, Callable[[dict], str]]]) -> list[str]:
    """One row per grid point: the point's columns, then `columns`."""
    rows = [point_cells(r) + [cell(r) for _, cell in columns] for r in records]
    return table(POINT_HEADER + [name for name, _ in columns], rows)


def memory_table(memory: list[dict], slopes: dict) -> list[str]:
    """Peak memory (MiB above the inputs) per method and L, and the log-log slope."""
    lengths = sorted({r["length"] for r in memory})
    rows = []
    for method, slope in slopes.items():
        cells = []
        for length in lengths:
            r = next((x for x in memory if x["method"] == method and x["length"] == length), None)
            if r is None:
                cells.append("—")
            else:
                cells.append(f"{r['peak_bytes'] / 2**20:.1f}" if r["status"] == "ok" else r["status"])
        rows.append([METHODS_BY_KEY[method].label] + cells + [fmt(slope, ".2f")])
    return table(["method"] + [f"L={n} (MiB)" for n in lengths] + ["log-log slope"], rows)


def summary_table(summary: dict) -> list[str]:
    """Median over the grid (overall and per dtype) and worst point of each ratio."""
    dtypes = list(dict.fromkeys(d for s in summary.values() for d in s["per_dtype_median"]))
    rows = []
    for name, s in summary.items():
        spec, suffix = (".0f", "%") if "%" in name else ((".2f", "x") if "ours/flash" in name else (".1f", "x"))
        per_dtype = [fmt(s["per_dtype_median"].get(d), spec, suffix) for d in dtypes]
        worst = f"{fmt(s['worst'], spec, suffix)} ({s['worst_point']})"
        rows.append([name, fmt(s["median"], spec, suffix), *per_dtype, worst, str(s["points"])])
    return table(["quantity", "median"] + [f"median {d}" for d in dtypes] + ["worst point", "points"], rows)


def unsupported_list(records: list[dict], memory: list[dict]) -> list[str]:
    """Every distinct failure message, with the methods and how many points it hit."""
    seen: dict[tuple[str, str], int] = {}
    for r in records:
        for key, st in r["methods"].items():
            if "error" in st:
                seen[(key, st["error"])] = seen.get((key, st["error"]), 0) + 1
    for r in memory:
        if "error" in r:
            seen[(f"memory {r['method']}", r["error"])] = seen.get((f"memory {r['method']}", r["error"]), 0) + 1
    return [f"- `{key}` ({n} points): {err}" for (key, err), n in seen.items()]


def markdown(result: dict) -> str:
    """The whole report."""
    h, mm = result["header"], result["matmul"]
    isa = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in h["isa"].items())
    lines = [
        "# CPU benchmark: torch_ext.attention vs SDPA, FlexAttention and eager monitoring", "",
        f"- machine: {h['cpu']} ({h['logical_cpus']} logical CPUs; {isa}; torch CPU capability "
        f"{h['torch_cpu_capability']})",
        f"- torch {h['torch']}, Python {h['python']}, {h['threads']} threads, {h['date']}",
        f"- command: `{h['command']}` ({result['grid']}; {result['elapsed_s'] / 60:.1f} min)",
        "- matmul reference (torch.mm): " + ", ".join(
            f"{d} {v['size']}² {v['gflops']:.0f} GFLOP/s" for d, v in mm.items()),
        f"- each method: {result['repeats']} interleaved repeats of `blocked_autorange(min_run_time="
        f"{result['min_run_time']})` ({SLOW_REPEATS} where the forward takes > {SLOW_CALL_S} s at matmul speed); "
        "times are medians over all blocks in ms, IQR and run counts in the JSON",
        f"- scale \"logn\" = log_{TRAIN_LENGTH}(n_i)/√D; SDPA and eager get q multiplied by log_{TRAIN_LENGTH}(n_i) "
        "inside the timed call; ratio ours/flash < 1 means ours is faster",
        f"- FLOPs: forward 4·B·H·L²·D (halved for causal), forward+backward {FWD_BWD_FLOP_FACTOR}× forward "
        "(FlashAttention's count); % mm = GFLOP/s / the same dtype's matmul GFLOP/s",
        "- noise = largest IQR/median of the point's methods; max abs diff = correctness guard (ours vs SDPA flash "
        "on q·f, outputs)",
        f"- load average (1 min) at start and end: {h['load_average'][0]:.2f}, {result['load_average_end']:.2f} "
        "(other processes on the machine slow some measurements and not others)",
        "", "## Target checks", "",
    ]  # fmt: skip
    lines += table(["target", "result", "numbers"], [[c["check"], c["result"], c["detail"]] for c in result["checks"]])
    lines += ["", "## Summary over the grid", ""] + summary_table(result["summary"])
    lines += ["", "## Forward (ms; scale \"logn\" unless marked)", ""]
    lines += point_table(result["points"], FORWARD_COLUMNS)
    lines += ["", "## Forward + backward (ms; gradients w.r.t. q, k, v)", ""]
    lines += point_table(result["points"], BACKWARD_COLUMNS)
    if result["memory"]:
        lines += ["", "## Peak memory (B=1, H=8, D=64, float32, not causal; RSS above the inputs, fresh process)", ""]
        lines += memory_table(result["memory"], result["memory_slopes"])
    failures = unsupported_list(result["points"], result["memory"])
    if failures:
        lines += ["", "## Unsupported", ""] + failures
    return "\n".join(lines) + "\n"


# --- driver ---------------------------------------------------------------------------------------


def parse_shape(text: str) -> tuple[int, int, int]:
    """'BxHxHkv' (or 'BxH') -> (B, H, Hkv)."""
    parts = [int(x) for x in text.lower().split("x")]
    if len(parts) == 2:
        parts.append(parts[1])
    if len(parts) != 3 or parts[1] % parts[2]:
        raise argparse.ArgumentTypeError(f"shape {text!r}: expected BxHxHkv with H a multiple of Hkv")
    return parts[0], parts[1], parts[2]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line arguments; grid options left unset take the --quick or the full grid's values."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small grid (L 256, 1024; D 64; 1x8x8; no flex), < 2 min")
    p.add_argument("--out", type=Path, help="output folder (default benchmarks/results, with --quick its quick/)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--min-run-time", type=float, help="seconds of each blocked_autorange (0.2; 0.05 with --quick)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats per method and point")
    p.add_argument("--lengths", type=int, nargs="+", help="L = Lq = Lk")
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES))
    p.add_argument("--head-dims", type=int, nargs="+")
    p.add_argument("--shapes", type=parse_shape, nargs="+", help="BxHxHkv, e.g. 2x8x8 1x8x2 (GQA)")
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument("--memory-lengths", type=int, nargs="+", help="L of the peak memory probes")
    p.add_argument("--max-memory-gib", type=float, default=8.0, help="skip methods estimated to need more")
    p.add_argument("--matmul-size", type=int, default=2048, help="N of the N x N torch.mm reference")
    p.add_argument("--no-memory", action="store_true", help="skip the peak memory subprocesses")
    p.add_argument("--no-flex", action="store_true", help="skip FlexAttention (compiles for every point)")
    p.add_argument("--no-backward", action="store_true", help="time the forward methods only")
    args = p.parse_args(argv)
    for name in ("threads", "repeats", "matmul_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("lengths", "head_dims", "memory_lengths"):
        if getattr(args, name) is not None and min(getattr(args, name)) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    grid = QUICK_GRID if args.quick else FULL_GRID
    for name, value in grid.items():
        if getattr(args, name) is None:
            setattr(args, name, value if name != "shapes" else [parse_shape(s) for s in value])
    args.no_flex = args.no_flex or args.quick  # a compilation per point does not fit in two minutes
    if args.out is None:  # a quick run must not overwrite the results of a full one
        args.out = HERE / "results" / "quick" if args.quick else HERE / "results"
    return args


def grid_name(args: argparse.Namespace) -> str:
    """"quick grid", "full grid", or, when flags changed either, the grid's values."""
    if args.quick:
        return "quick grid"
    values = {name: getattr(args, name) for name in ("lengths", "dtypes", "head_dims", "memory_lengths")}
    values["shapes"] = ["x".join(map(str, s)) for s in args.shapes]
    if args.causal == "both" and all(values[k] == FULL_GRID[k] for k in values):
        return "full grid"
    return "grid " + ", ".join(f"{k}={' '.join(map(str, v))}" for k, v in values.items()) + f", causal={args.causal}"


def grid_points(args: argparse.Namespace) -> list[Point]:
    """The grid, ordered so that the cheap points come first (early results, early failures)."""
    causal = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    return [
        Point(dtype, d, b, h, hkv, c, length)
        for length in sorted(args.lengths) for dtype in args.dtypes for d in args.head_dims
        for b, h, hkv in args.shapes for c in causal
    ]  # fmt: skip


def selected_methods(args: argparse.Namespace) -> list[Method]:
    """METHODS minus those switched off by flags."""
    return [
        m for m in METHODS
        if not (args.no_flex and m.family == "flex") and not (args.no_backward and m.backward)
    ]  # fmt: skip


def run_memory(args: argparse.Namespace, bar: tqdm) -> list[dict]:
    """Peak memory of MEMORY_METHODS at each memory length, one subprocess each."""
    records = []
    for point in memory_points(args.memory_lengths):
        for key in MEMORY_METHODS:
            method = METHODS_BY_KEY[key]
            bar.set_postfix_str(f"memory {key} L={point.length}")
            rec: dict[str, Any] = {"method": key, "length": point.length, "point": asdict(point)}
            if args.no_flex and method.family == "flex":
                rec["status"] = "off"
            elif estimated_bytes(method, point) > args.max_memory_gib * 2**30:
                rec["status"] = "skipped (memory)"
            else:
                rec.update(memory_probe(key, point, args.threads))
            records.append(rec)
            bar.update()
    return records


def add_matmul_fractions(records: list[dict], matmul: dict) -> None:
    """Each timed method's GFLOP/s as a percentage of the matmul reference of its dtype."""
    for rec in records:
        rate = matmul[rec["point"]["dtype"]]["gflops"]
        for st in rec["methods"].values():
            if st["status"] == "ok":
                st["pct_matmul"] = 100.0 * st["gflops"] / rate


def main(argv: list[str] | None = None) -> None:
    """Run the suite and write cpu.md, cpu.json and the plots."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    header = machine_header(args.threads)
    points, methods = grid_points(args), selected_methods(args)
    n_memory = 0 if args.no_memory else len(args.memory_lengths) * len(MEMORY_METHODS)
    with tqdm(total=len(points) + n_memory, unit="step", desc="benchmark") as bar:
        bar.set_postfix_str("matmul reference")
        mm_sizes = matmul_sizes(args.dtypes, args.matmul_size, args.threads)
        matmul_before = matmul_reference(args.dtypes, mm_sizes, args.threads, args.min_run_time, args.repeats)
        records = []
        for point in points:
            bar.set_postfix_str(point.label)
            records.append(measure_point(point, methods, args, matmul_before))
            bar.update()
        bar.set_postfix_str("matmul reference")
        matmul_after = matmul_reference(args.dtypes, mm_sizes, args.threads, args.min_run_time, args.repeats)
        memory = [] if args.no_memory else run_memory(args, bar)
    # What the machine's matmul reaches is the better of the two measurements (noise only slows it).
    matmul = {d: max(matmul_before[d], matmul_after[d], key=lambda m: m["gflops"]) for d in args.dtypes}
    add_matmul_fractions(records, matmul)
    slopes = memory_slopes(memory)
    summary = grid_summary(records)
    result = {
        "header": header,
        "grid": grid_name(args),
        "min_run_time": args.min_run_time,
        "repeats": args.repeats,
        "matmul": matmul,
        "matmul_runs": {"before": matmul_before, "after": matmul_after},
        "points": records,
        "memory": memory,
        "memory_slopes": slopes,
        "summary": summary,
        "checks": target_checks(records, summary, slopes),
        "load_average_end": os.getloadavg()[0],
        "elapsed_s": time.perf_counter() - started,
    }
    write_outputs(result, args.out)


def write_outputs(result: dict, out: Path) -> None:
    """cpu.json, cpu.md and the plots; the Markdown is printed too."""
    from plots import write_plots  # matplotlib is only needed here

    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu.json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    (out / "cpu.md").write_text(text)
    pngs = write_plots(result, out, "cpu")
    print("\n" + text)
    print("wrote " + ", ".join(str(p) for p in [out / "cpu.md", out / "cpu.json", *pngs]))


if __name__ == "__main__":
    main()
