"""Forward and forward+backward time of torch_ext.attention against F.scaled_dot_product_attention
on a CUDA GPU, in one process.

For each (dtype, head dim, causal, sequence length), times with CUDA events (median of blocks):
  * SDPA with PyTorch's default backend selection (no statistics); the backend it picks is
    reported (``torch._fused_sdp_choice``), and ``--sdpa-backends`` times chosen ones explicitly;
  * ours: ``torch_ext.attention(..., return_stats=True)`` (output and every per-row statistic);
  * forward+backward of both (gradients w.r.t. q, k, v from the output), and ours with a loss on
    the entropy as well (entropy regularization, which SDPA cannot do without the L x L matrix).
Prints a Markdown table with the ratios ours / SDPA (lower is better) and writes it to
``results/gpu/benchmark.md``. Without a GPU it says so and exits 0.

    python3 benchmarks/gpu_vs_sdpa.py                                   # full table (B=4, H=16)
    python3 benchmarks/gpu_vs_sdpa.py --dtype bfloat16 --head-dim 128 --seq 4096 8192 --causal yes
    python3 benchmarks/gpu_vs_sdpa.py --sdpa-backends flash efficient cudnn --no-backward
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm import tqdm

DTYPES: Dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
BACKENDS: Dict[str, SDPBackend] = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}
BACKEND_NAMES: Dict[int, str] = {int(b.value): name for name, b in BACKENDS.items()}
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO_ROOT, "results", "gpu", "benchmark.md")


def import_torch_ext() -> Any:
    """The extension package: the installed one, else the one in this checkout (built in place)."""
    try:
        import torch_ext
    except ImportError:
        sys.path.insert(0, REPO_ROOT)
        import torch_ext
    return torch_ext


@dataclass
class Config:
    """One row of the table."""

    dtype: str
    head_dim: int
    causal: bool
    seq: int


@dataclass
class Row:
    """Measured times (ms) of one configuration; None where not measured, `errors` where a call failed."""

    config: Config
    backend: str = "?"
    times: Dict[str, Optional[float]] = field(default_factory=dict)
    errors: List[str] = field(default_factory=list)


def cuda_time_ms(fn: Callable[[], object], min_run_time: float, blocks: int = 5) -> float:
    """Median time of one call of `fn` in ms: `blocks` blocks of n calls between CUDA events, with n
    chosen so that the blocks take about `min_run_time` seconds together (after a warm-up)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    one = max(start.elapsed_time(end), 1e-3)  # ms
    n = max(1, int(min_run_time * 1e3 / blocks / one))
    per_call = []
    for _ in range(blocks):
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) / n)
    return sorted(per_call)[len(per_call) // 2]


def sdpa_backend_name(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> str:
    """Which fused SDPA backend the default selection picks for these inputs."""
    try:
        choice = int(torch._fused_sdp_choice(q, k, v, None, 0.0, causal))
    except (AttributeError, RuntimeError, TypeError):
        return "default"
    return BACKEND_NAMES.get(choice, f"backend {choice}")


def measure_config(
    cfg: Config, batch: int, heads: int, backward: bool, explicit: Sequence[str], min_run_time: float
) -> Row:
    """Time SDPA (default selection and the `explicit` backends) and ours for one configuration."""
    torch_ext = import_torch_ext()
    row = Row(cfg)
    dtype = DTYPES[cfg.dtype]
    shape = (batch, heads, cfg.seq, cfg.head_dim)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype, generator=gen).requires_grad_() for _ in range(3))
    dout = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
    dent = torch.randn((batch, heads, cfg.seq), device="cuda", dtype=torch.float32, generator=gen)
    causal = cfg.causal
    with torch.no_grad():  # the choice may depend on whether gradients are needed
        fwd_backend = sdpa_backend_name(q, k, v, causal)
    train_backend = sdpa_backend_name(q, k, v, causal)
    row.backend = fwd_backend if fwd_backend == train_backend or not backward else f"{fwd_backend} / {train_backend}"

    def sdpa_fwd() -> object:
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def sdpa_fwd_bwd() -> object:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return torch.autograd.grad(out, (q, k, v), dout)

    def ours_fwd() -> object:
        with torch.no_grad():
            return torch_ext.attention(q, k, v, is_causal=causal, return_stats=True)

    def ours_fwd_bwd() -> object:
        out, _ = torch_ext.attention(q, k, v, is_causal=causal, return_stats=True)
        return torch.autograd.grad(out, (q, k, v), dout)

    def ours_fwd_bwd_entropy() -> object:
        out, st = torch_ext.attention(q, k, v, is_causal=causal, return_stats=True)
        return torch.autograd.grad((out, st.entropy), (q, k, v), (dout, dent))

    cases: Dict[str, Callable[[], object]] = {"sdpa_fwd": sdpa_fwd, "ours_fwd": ours_fwd}
    if backward:
        cases.update(sdpa_fwd_bwd=sdpa_fwd_bwd, ours_fwd_bwd=ours_fwd_bwd, ours_fwd_bwd_ent=ours_fwd_bwd_entropy)
    for name, fn in cases.items():
        row.times[name] = timed(fn, min_run_time, row, name)
    for bname in explicit:
        with sdpa_kernel(BACKENDS[bname]):
            row.times[f"sdpa_{bname}_fwd"] = timed(sdpa_fwd, min_run_time, row, f"sdpa {bname} fwd", expected=True)
            if backward:
                row.times[f"sdpa_{bname}_fwd_bwd"] = timed(
                    sdpa_fwd_bwd, min_run_time, row, f"sdpa {bname} fwd+bwd", expected=True
                )
    del q, k, v, dout, dent
    torch.cuda.empty_cache()
    return row


def timed(fn: Callable[[], object], min_run_time: float, row: Row, name: str, expected: bool = False) -> Optional[float]:
    """cuda_time_ms, or None (recorded in row.errors unless `expected`) if the call fails (e.g. an
    explicitly chosen SDPA backend that does not support the inputs, or out of memory)."""
    try:
        return cuda_time_ms(fn, min_run_time)
    except (RuntimeError, ValueError, torch.cuda.OutOfMemoryError) as e:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        if not expected:
            row.errors.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        return None


def fmt_ms(t: Optional[float]) -> str:
    """A time in ms, or n/a."""
    return "n/a" if t is None else (f"{t:.3f}" if t < 1 else f"{t:.2f}")


def fmt_ratio(a: Optional[float], b: Optional[float]) -> str:
    """a / b as '1.23x', or n/a."""
    return "n/a" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def markdown(rows: Sequence[Row], header: str, backward: bool, explicit: Sequence[str]) -> str:
    """The results as a Markdown document (header paragraph and one table)."""
    cols = ["dtype", "D", "causal", "L", "SDPA backend", "SDPA fwd (ms)", "ours fwd + stats (ms)", "fwd ratio"]
    if backward:
        cols += ["SDPA fwd+bwd (ms)", "ours fwd+bwd (ms)", "fwd+bwd ratio", "ours fwd+bwd, entropy loss too (ms)"]
    for b in explicit:
        cols += [f"SDPA {b} fwd (ms)"] + ([f"SDPA {b} fwd+bwd (ms)"] if backward else [])
    lines = [header, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        c, t = r.config, r.times
        cells = [c.dtype, str(c.head_dim), "yes" if c.causal else "no", str(c.seq), r.backend,
                 fmt_ms(t.get("sdpa_fwd")), fmt_ms(t.get("ours_fwd")), fmt_ratio(t.get("ours_fwd"), t.get("sdpa_fwd"))]  # fmt: skip
        if backward:
            cells += [
                fmt_ms(t.get("sdpa_fwd_bwd")),
                fmt_ms(t.get("ours_fwd_bwd")),
                fmt_ratio(t.get("ours_fwd_bwd"), t.get("sdpa_fwd_bwd")),
                fmt_ms(t.get("ours_fwd_bwd_ent")),
            ]
        for b in explicit:
            cells += [fmt_ms(t.get(f"sdpa_{b}_fwd"))] + ([fmt_ms(t.get(f"sdpa_{b}_fwd_bwd"))] if backward else [])
        lines.append("| " + " | ".join(cells) + " |")
    errors = [f"- {r.config.dtype} D={r.config.head_dim} causal={r.config.causal} L={r.config.seq}: {e}"
              for r in rows for e in r.errors]  # fmt: skip
    if errors:
        lines += ["", "Failures:", ""] + errors
    return "\n".join(lines) + "\n"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Command-line arguments."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    p.add_argument("--seq", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    p.add_argument("--dtype", choices=["bfloat16", "float16"], nargs="+", default=["bfloat16", "float16"])
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument(
        "--fp32-seq", type=int, nargs="*", default=[2048],
        help="sequence lengths of the float32 rows (first head dim, not causal); none to skip",
    )  # fmt: skip
    p.add_argument("--no-backward", dest="backward", action="store_false", help="time the forward only")
    p.add_argument(
        "--sdpa-backends", nargs="*", choices=sorted(BACKENDS), default=[],
        help="SDPA backends to also time explicitly (sdpa_kernel); n/a where one does not support the inputs",
    )  # fmt: skip
    p.add_argument("--min-run-time", type=float, default=0.5, help="seconds per measurement (all blocks)")
    p.add_argument("--out", default=DEFAULT_OUT, help="Markdown file to write ('' to skip)")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the benchmark; returns the exit code."""
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "gpu_vs_sdpa: no CUDA device is visible (torch.cuda.is_available() is False): nothing to "
            "benchmark. Run it on a GPU machine (bash scripts/gpu_suite.sh runs it after the tests)."
        )
        return 0
    import_torch_ext()  # registers the operators
    if not torch._C._dispatch_has_kernel_for_dispatch_key("entropy_attn::attention", "CUDA"):
        print("gpu_vs_sdpa: torch_ext has no CUDA kernel for entropy_attn::attention (built without CUDA?)")
        return 1

    causal_opts = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    configs = [Config(dt, d, c, s) for dt in args.dtype for d in args.head_dim for c in causal_opts for s in args.seq]
    configs += [Config("float32", args.head_dim[0], False, s) for s in args.fp32_seq]
    rows = [
        measure_config(cfg, args.batch, args.heads, args.backward, args.sdpa_backends, args.min_run_time)
        for cfg in tqdm(configs, desc="configurations", file=sys.stderr)
    ]

    props = torch.cuda.get_device_properties(0)
    header = (
        f"{props.name} (sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB), torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}, {platform.node()}, {datetime.date.today().isoformat()}; "
        f"B={args.batch}, H={args.heads}; times are medians of CUDA-event blocks; ratio = ours / SDPA "
        f"(lower is better); ours returns the output and every per-row statistic, SDPA the output only; "
        f"fwd+bwd = gradients of q, k, v from the output; 'SDPA backend' is the default selection "
        f"(forward / forward+backward where they differ).\n\n"
        f"Command: `python3 benchmarks/gpu_vs_sdpa.py {shlex.join(argv if argv is not None else sys.argv[1:])}`"
    )
    text = markdown(rows, header, args.backward, args.sdpa_backends)
    print("\n" + text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
        print(f"written to {args.out}")
    failed = [r for r in rows if r.errors]
    if failed:
        print(f"gpu_vs_sdpa: {sum(len(r.errors) for r in failed)} measurement(s) failed (see 'Failures')")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
