"""Per-sample gradients (``torch.func.vmap(grad(loss))``, as DP-SGD and influence functions use
them) through one attention layer: ours, SDPA's in the same process, and ours one autograd call
per sample.

Each sample is one causal sequence, (1, H, L, D); the gradient is taken w.r.t. query, key and
value, and every method's gradients are checked against SDPA's before it is timed. Prints a
Markdown table of the median time per step in ms and writes it to ``<out>/<device>.md``::

    python benchmarks/per_sample_grads.py                      # the README's numbers
    python benchmarks/per_sample_grads.py --grid 8x64 --min-run-time 0.05   # seconds
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch.func import grad, vmap
from tqdm import tqdm

import torch_ext
from timing import available_device, device_name, median_ms

Grads = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Sequence[torch.Tensor]]
ROOT = Path(__file__).resolve().parents[1]


def ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch_ext.attention(q, k, v, is_causal=True)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def vmapped(attention: Callable[..., torch.Tensor]) -> Grads:
    """Per-sample gradients of sum(out^2) w.r.t. query, key and value, samples stacked on dim 0."""
    return vmap(grad(lambda q, k, v: attention(q[None], k[None], v[None]).square().sum(), argnums=(0, 1, 2)))


def looped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> List[torch.Tensor]:
    """The same gradients by one plain autograd call of ours per sample."""
    per_sample = []
    for i in range(q.shape[0]):
        leaves = [t[i : i + 1].detach().requires_grad_() for t in (q, k, v)]
        per_sample.append(torch.autograd.grad(ours(*leaves).square().sum(), leaves))
    return [torch.cat(g) for g in zip(*per_sample)]


METHODS = {"ours vmap(grad)": lambda: vmapped(ours), "SDPA vmap(grad)": lambda: vmapped(sdpa),
           "ours, a loop of autograd calls": lambda: looped}


def grid_point(text: str) -> Tuple[int, int]:
    """``"SxL"``: S samples of L tokens."""
    samples, length = (int(n) for n in text.lower().split("x"))
    return samples, length


def main(argv: Optional[Sequence[str]] = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grid", nargs="+", type=grid_point, default=["8x128", "32x128", "128x128", "32x512"],
                        help="samples x sequence length")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"])
    parser.add_argument("--device", type=available_device, default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--min-run-time", type=float, default=2.0, help="seconds per timing (the 2-core "
                        "development machine is noisy at 0.5)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "per_sample_grads")
    args = parser.parse_args(argv)
    grid = [grid_point(g) if isinstance(g, str) else g for g in args.grid]
    dtype = getattr(torch, args.dtype)
    tol = {torch.float32: 1e-4, torch.float64: 1e-10}.get(dtype, 3e-2)
    rows = []
    for samples, length in tqdm(grid, desc="per-sample grads", disable=None):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(samples, args.heads, length, args.head_dim, generator=g).to(args.device, dtype)
                   for _ in range(3))
        reference = vmapped(sdpa)(q, k, v)
        times = []
        for name, make in METHODS.items():
            fn = make()
            for which, got, ref in zip("qkv", fn(q, k, v), reference):
                if not torch.allclose(got.float(), ref.float(), rtol=tol, atol=tol):
                    raise SystemExit(f"{name}: d{which} differs from SDPA's (samples {samples}, L {length}): "
                                     f"max error {(got.float() - ref.float()).abs().max().item():.3g}")
            times.append(median_ms(lambda: fn(q, k, v), args.min_run_time))
        rows.append((samples, length, *times))
    lines = [
        f"Per-sample gradients of one causal attention layer, H = {args.heads}, D = {args.head_dim}, {args.dtype}, "
        f"on {device_name(args.device)}, torch {torch.__version__}: median ms per step.",
        "",
        "| samples | L | " + " | ".join(f"{m} (ms)" for m in METHODS) + " | ours / SDPA (vmap) |",
        "|---:|---:|" + "---:|" * (len(METHODS) + 1),
    ]
    for samples, length, t_ours, t_sdpa, t_loop in rows:
        lines.append(f"| {samples} | {length} | {t_ours:.2f} | {t_sdpa:.2f} | {t_loop:.2f} | {t_ours / t_sdpa:.2f} |")
    table = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{'cuda' if args.device.startswith('cuda') else 'cpu'}.md").write_text(table)
    print(table)
    return table


if __name__ == "__main__":
    main()
