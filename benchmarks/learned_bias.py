"""A learned additive bias (T5-style, one (L, L) bias per head, broadcast over the batch): forward and
backward time against torch's attention, in one process.

The op differentiates an additive mask that requires grad (docs/math.md section 3): its backward
then adds the logits' gradient dS into the bias's own (1, H, L, L) entries, summing over the batch
as it goes. Three timings per
length, each a forward and a backward with upstream gradient on the output: ours with the bias
requiring grad, ours with the same bias fixed (what asking for its gradient costs), and SDPA with
the bias requiring grad (the backend torch picks for it). Every timed method's output and
gradients are first checked against SDPA's.

--bias picks the bias's shapes: ``head``, the (1, H, L, L) bias above; ``key``, one learned bias
per key of each sequence, (B, 1, 1, L), whose gradient sums dS over the heads and the rows: the
CUDA backwards sum a warp's rows of each key by shuffles and add each sum by one atomic
(csrc/cuda/logit_grads.cuh), the heads' and row blocks' sums meeting at one address per key, which
this timing prices.

--deterministic adds ours under ``torch.use_deterministic_algorithms(True)``: on CUDA its backward
writes a broadcast bias's gradient at the call's full (B, H, L, L) shape, each entry from one
logit, and sums it over the broadcast dims in a fixed order (csrc/cuda/attention_cuda.cpp), where
the default backward adds into the bias's entries by atomics; its two runs must give the same bits
before it is timed. SDPA keeps the default algorithms.

    python3 benchmarks/learned_bias.py                                   # CPU, float32
    python3 benchmarks/learned_bias.py --device cuda --dtype bfloat16 --lengths 1024 2048 4096
    python3 benchmarks/learned_bias.py --device cuda --dtype bfloat16 --bias head key
    python3 benchmarks/learned_bias.py --device cuda --dtype bfloat16 --deterministic

Writes a Markdown table and JSON to results/learned_bias/<device>.{md,json}.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Dict, List, Sequence

import torch
import torch.nn.functional as F
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout's torch_ext, built in place, when it is not installed

import torch_ext  # noqa: E402
# (benchmarks/timing.py)
from timing import (  # noqa: E402
    available_device, deterministic_algorithms, device_name, median_ms, positive_int, short_commit, write_result)

METHODS = ("ours_bias_grad", "ours_fixed_bias", "sdpa_bias_grad")
DETERMINISTIC = "ours_deterministic"  # --deterministic's method
# The bias shapes --bias names: their sizes for batch B, heads H and length L, and how the table
# writes them.
BIAS_SHAPES = {
    "head": (lambda B, H, L: (1, H, L, L), "(1, H, L, L)"),
    "key": (lambda B, H, L: (B, 1, 1, L), "(B, 1, 1, L)"),
}


def step(method: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
         go: torch.Tensor) -> List[torch.Tensor]:
    """One forward and backward of `method`: the output and the gradients of q, k, v (and the bias)."""
    b = bias.detach() if method == "ours_fixed_bias" else bias
    with deterministic_algorithms(True) if method == DETERMINISTIC else contextlib.nullcontext():
        if method == "sdpa_bias_grad":
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=b)
        else:
            out = torch_ext.attention(q, k, v, b)
        leaves = [q, k, v] + ([b] if b.requires_grad else [])
        return [out.detach(), *torch.autograd.grad(out, leaves, go)]


def check(results: Dict[str, List[torch.Tensor]], dtype: torch.dtype) -> None:
    """Every method's output and gradients agree with SDPA's (relative norm error)."""
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    ref = results["sdpa_bias_grad"]
    for method, got in results.items():
        for name, a, b in zip(("output", "dq", "dk", "dv", "dbias"), got, ref):
            err = ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
            if err > tol:
                raise SystemExit(f"{method}: {name} differs from SDPA's by {err:.3g} (relative)")


def check_bits(first: List[torch.Tensor], again: List[torch.Tensor]) -> None:
    """Two deterministic runs give the same bits of every output and gradient."""
    for name, a, b in zip(("output", "dq", "dk", "dv", "dbias"), first, again):
        if not torch.equal(a, b):
            raise SystemExit(f"{DETERMINISTIC}: {name} differs between two runs")


def run(args: argparse.Namespace) -> Dict[str, object]:
    dtype = getattr(torch, args.dtype)
    methods = METHODS + ((DETERMINISTIC,) if args.deterministic else ())
    B, H, D, dev = args.batch, args.heads, args.head_dim, args.device
    rows: List[Dict[str, object]] = []
    grid = [(shape, L) for shape in args.bias for L in args.lengths]
    for shape, L in tqdm(grid, desc="learned bias"):
        g = torch.Generator().manual_seed(L)
        q, k, v = (torch.randn(B, H, L, D, generator=g).to(dev, dtype).requires_grad_() for _ in range(3))
        size = BIAS_SHAPES[shape][0](B, H, L)
        bias = (0.5 * torch.randn(*size, generator=g)).to(dev, dtype).requires_grad_()
        go = torch.randn(B, H, L, D, generator=g).to(dev, dtype)
        results = {m: step(m, q, k, v, bias, go) for m in methods}
        check(results, dtype)
        if args.deterministic:
            check_bits(results[DETERMINISTIC], step(DETERMINISTIC, q, k, v, bias, go))
        row: Dict[str, object] = {"bias": BIAS_SHAPES[shape][1], "seq_len": L}
        for m in methods:
            row[f"{m}_ms"] = median_ms(lambda m=m: step(m, q, k, v, bias, go), args.min_run_time)
        rows.append(row)
    commit = short_commit(ROOT)
    return {"device": device_name(dev), "torch": torch.__version__, "commit": commit, "dtype": args.dtype,
            "batch": B, "heads": H, "head_dim": D, "methods": list(methods), "rows": rows}


def markdown(result: Dict[str, object]) -> str:
    deterministic = DETERMINISTIC in result["methods"]  # type: ignore[operator]
    extra = " | ours, deterministic algorithms (ms) | deterministic / default (ours)" if deterministic else ""
    lines = [f"# Learned additive bias, forward + backward ({result['device']})", "",
             f"torch {result['torch']}, commit {result['commit']}, {result['dtype']}, B={result['batch']}, "
             f"H={result['heads']}, D={result['head_dim']}; medians of torch.utils.benchmark "
             "in one process; outputs and gradients checked against SDPA's first"
             + (" (and the deterministic runs' bits against a second run's)." if deterministic else "."), "",
             "| bias | L | ours, bias requires grad (ms) | ours, fixed bias (ms) | SDPA, bias requires grad (ms) "
             f"| ours / SDPA (bias requires grad){extra} |",
             "|---|---|---|---|---|---|" + ("---|---|" if deterministic else "")]
    for r in result["rows"]:  # type: ignore[union-attr]
        ratio = r["ours_bias_grad_ms"] / r["sdpa_bias_grad_ms"]
        cells = (f" {r[DETERMINISTIC + '_ms']:.1f} | {r[DETERMINISTIC + '_ms'] / r['ours_bias_grad_ms']:.2f} |"
                 if deterministic else "")
        lines.append(f"| {r['bias']} | {r['seq_len']} | {r['ours_bias_grad_ms']:.1f} | {r['ours_fixed_bias_ms']:.1f} | "
                     f"{r['sdpa_bias_grad_ms']:.1f} | {ratio:.2f} |{cells}")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", type=available_device, default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--lengths", type=positive_int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--bias", nargs="+", choices=list(BIAS_SHAPES), default=["head"],
                   help="the bias's shapes: head (1, H, L, L), key (B, 1, 1, L)")
    p.add_argument("--deterministic", action="store_true",
                   help="also time ours under torch.use_deterministic_algorithms(True), two runs' bits compared first")
    p.add_argument("--min-run-time", type=float, default=1.0)
    p.add_argument("--out", type=Path, default=ROOT / "results" / "learned_bias")
    args = p.parse_args(argv)
    result = run(args)
    write_result(args.out, args.device, result, markdown(result))


if __name__ == "__main__":
    main()
