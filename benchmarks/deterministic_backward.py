"""The backward under ``torch.use_deterministic_algorithms(True)`` against the default one, per CUDA
family, in one process.

A deterministic backward adds dq's partial sums in a fixed order: the sm80 family in a dq kernel of
its own (one block per query block forms P and dS again), the Hopper family, when forced
(``--families sm90``; csrc/cuda/family.h: kHopperDeterministicByDefault, off until it has run on a
GPU), by bulk reductions that take turns in the key blocks' order (csrc/cuda/sm90/bwd_kernel.cuh:
write_dq), the fallback kernels (float32/float64, or forced: ``--families fallback``) by atomics
that take turns in the key tiles' order (csrc/cuda/fallback/turns.cuh). For each family, head dim,
length, causality and mask (--masks: none, or a bool mask of (L, L), whose calls the Hopper
family's masked kernels take, their consumers adding dq by atomics in the turns that a warp of the
producer warpgroup keeps: bwd_kernel.cuh, keep_turns): a forward and a backward (upstream gradient
on the output) with the default algorithms and with deterministic ones. Before timing, the
deterministic run is repeated and must give the same bits of dq, dk and dv, must agree with the
default run's gradients (relative error), and must launch the named family's backward kernel;
a point that fails stops the script.

    python3 benchmarks/deterministic_backward.py                                   # CPU dry run
    python3 benchmarks/deterministic_backward.py --device cuda --families sm80 sm90 \\
        --head-dims 64 128 --lengths 4096 --masks none bool
    python3 benchmarks/deterministic_backward.py --device cuda --families fallback --dtype float32 \\
        --head-dims 64 --lengths 1024

Writes a Markdown table and JSON to results/deterministic/<device>.{md,json}. On the CPU (whose
kernels are deterministic anyway) ``--families`` is ignored: the script's dry run.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout's torch_ext, built in place, when it is not installed

import torch_ext  # noqa: E402
# (benchmarks/timing.py)
from timing import (  # noqa: E402
    available_device, deterministic_algorithms, device_name, median_ms, positive_int, short_commit, write_result)

FAMILY_ENV = "ENTROPY_ATTN_CUDA_FAMILY"


def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, go: torch.Tensor, causal: bool,
         mask: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    """One forward and backward: dq, dk and dv."""
    out = torch_ext.attention(q, k, v, mask, is_causal=causal)
    return list(torch.autograd.grad(out, (q, k, v), go))


def deterministic_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, go: torch.Tensor,
                       causal: bool, mask: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    """step() under deterministic algorithms, the previous setting (and its warn_only) restored
    after."""
    with deterministic_algorithms(True):
        return step(q, k, v, go, causal, mask)


def check(default: List[torch.Tensor], first: List[torch.Tensor], again: List[torch.Tensor],
          dtype: torch.dtype, where: str) -> None:
    """The deterministic run repeats its bits and agrees with the default run (relative norm error)."""
    tol = {torch.float64: 1e-10, torch.float32: 1e-4}.get(dtype, 2e-2)
    for name, a, b, d in zip(("dq", "dk", "dv"), first, again, default):
        if not torch.equal(a, b):
            raise SystemExit(f"{where}: {name} differs between two deterministic runs")
        err = ((a.float() - d.float()).norm() / d.float().norm().clamp_min(1e-30)).item()
        if err > tol:
            raise SystemExit(f"{where}: deterministic {name} differs from the default's by {err:.3g} (relative)")


#: Each family's backward main kernel, as its CUDA kernel's name contains it. The tensor-core
#: families first: their backward also launches the fallback's as its guard (which returns at once
#: where no gradient came out non-finite).
MAIN_KERNELS = {"sm90": "main_kernel", "sm80": "main_kernel", "fallback": "attention_bwd"}


def family_of(names: Sequence[str]) -> str:
    """The family whose backward main kernel is among the CUDA kernels `names` ("" for none)."""
    return next((f for f, kernel in MAIN_KERNELS.items() if any(f"{f}::" in n and kernel in n for n in names)), "")


def backward_family(fn: Callable[[], object]) -> str:
    """The family whose backward main kernel fn launches on CUDA (family_of), from the CUDA
    kernels' names (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return family_of([e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA])


def run(args: argparse.Namespace) -> Dict[str, object]:
    dtype = getattr(torch, args.dtype)
    B, H, dev = args.batch, args.heads, args.device
    families = args.families if dev == "cuda" else ["cpu"]
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    grid = [(f, D, L, c, m) for f in families for D in args.head_dims for L in args.lengths for c in causals
            for m in args.masks]
    rows: List[Dict[str, object]] = []
    saved = os.environ.get(FAMILY_ENV)
    try:
        for family, D, L, causal, mask_kind in tqdm(grid, desc="deterministic backward"):
            if dev == "cuda":
                os.environ[FAMILY_ENV] = family
            g = torch.Generator().manual_seed(L + D)
            q, k, v = (torch.randn(B, H, L, D, generator=g).to(dev, dtype).requires_grad_() for _ in range(3))
            go = torch.randn(B, H, L, D, generator=g).to(dev, dtype)
            mask = None
            if mask_kind == "bool":  # a tenth of the keys hidden, key 0 seen by every row
                mask = torch.rand(L, L, generator=g) < 0.9
                mask[:, 0] = True
                mask = mask.to(dev)
            where = f"{family}, D={D}, L={L}{', causal' if causal else ''}{', bool mask' if mask is not None else ''}"
            check(step(q, k, v, go, causal, mask), deterministic_step(q, k, v, go, causal, mask),
                  deterministic_step(q, k, v, go, causal, mask), dtype, where)
            ran = backward_family(lambda: deterministic_step(q, k, v, go, causal, mask)) if dev == "cuda" else ""
            if family != "auto" and dev == "cuda" and ran != family:
                raise SystemExit(f"{where}: the deterministic backward ran in {ran or 'no family'}")
            default_ms = median_ms(lambda: step(q, k, v, go, causal, mask), args.min_run_time)
            det_ms = median_ms(lambda: deterministic_step(q, k, v, go, causal, mask), args.min_run_time)
            rows.append({"family": family, "ran": ran or family, "head_dim": D, "seq_len": L, "causal": causal,
                         "mask": mask_kind, "default_ms": default_ms, "deterministic_ms": det_ms})
    finally:
        if saved is None:
            os.environ.pop(FAMILY_ENV, None)
        else:
            os.environ[FAMILY_ENV] = saved
    commit = short_commit(ROOT)
    return {"device": device_name(dev), "torch": torch.__version__, "commit": commit, "dtype": args.dtype,
            "batch": B, "heads": H, "rows": rows}


def markdown(result: Dict[str, object]) -> str:
    lines = [f"# Forward + backward under deterministic algorithms ({result['device']})", "",
             f"torch {result['torch']}, commit {result['commit']}, {result['dtype']}, B={result['batch']}, "
             f"H={result['heads']}; medians of torch.utils.benchmark in one process; each deterministic "
             "run repeated first (same bits of dq, dk, dv) and checked against the default run; \"ran\": the family "
             "whose backward kernel the deterministic run launched (torch.profiler).", "",
             "| family | ran | D | L | causal | mask | default (ms) | deterministic (ms) | deterministic / default |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:  # type: ignore[union-attr]
        ratio = r["deterministic_ms"] / r["default_ms"]
        lines.append(f"| {r['family']} | {r['ran']} | {r['head_dim']} | {r['seq_len']} | {'yes' if r['causal'] else 'no'} | "
                     f"{r['mask']} | {r['default_ms']:.3g} | {r['deterministic_ms']:.3g} | {ratio:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", type=available_device, default="cpu")
    p.add_argument("--dtype", default=None, choices=["float64", "float32", "bfloat16", "float16"],
                   help="default bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--families", nargs="+", choices=["auto", "sm80", "sm90", "fallback"], default=["sm80", "sm90"],
                   help=f"the CUDA families to time (sets {FAMILY_ENV})")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--lengths", type=positive_int, nargs="+", default=[4096])
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument("--masks", nargs="+", choices=["none", "bool"], default=["none"],
                   help="the masks: none, or a bool mask of (L, L) (the Hopper family's masked kernels)")
    p.add_argument("--min-run-time", type=float, default=0.5)
    p.add_argument("--out", type=Path, default=ROOT / "results" / "deterministic")
    args = p.parse_args(argv)
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    result = run(args)
    write_result(args.out, args.device, result, markdown(result))


if __name__ == "__main__":
    main()
