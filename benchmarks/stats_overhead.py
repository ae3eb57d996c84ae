"""What the statistics cost: the forward without statistics, with them (written by the kernel's
epilogue), and with them derived afterwards by a chain of small ATen ops (as the Python wrapper
did before the kernels wrote them), measured side by side in one process.

    python3 benchmarks/stats_overhead.py                      # CPU, small shapes
    python3 benchmarks/stats_overhead.py --device cuda --batch 4 --heads 16 --seq 1024 4096

Writes a Markdown table and JSON to results/stats_overhead/<device>.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import torch
from tqdm import tqdm

import torch_ext  # noqa: F401  (registers torch.ops.entropy_attn)
from timing import available_device, cpu_name, median_ms  # benchmarks/timing.py

ROOT = Path(__file__).resolve().parent.parent


def derive_with_aten(lse: torch.Tensor, entropy: torch.Tensor, sum_p2: torch.Tensor, n_keys: torch.Tensor) -> tuple:
    """The derived statistics as the wrapper used to compute them: ~10 small ATen kernels."""
    n = n_keys.to(lse.dtype)
    nonempty = n_keys > 0
    safe_p2 = torch.where(nonempty, sum_p2, torch.ones_like(sum_p2))
    log_n = torch.where(n_keys >= 2, torch.log(n.clamp_min(2)), torch.ones_like(n))
    return (
        torch.where(n_keys >= 2, entropy / log_n, torch.zeros_like(entropy)),
        torch.where(nonempty, torch.rsqrt(n.clamp_min(1) * safe_p2), torch.zeros_like(sum_p2)),
        torch.where(nonempty, 1.0 / safe_p2, torch.zeros_like(sum_p2)),
    )


def main() -> None:
    """Runs the grid and writes the results."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", type=available_device, default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--seq", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--min-run-time", type=float, default=0.3)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "stats_overhead")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    rows = []
    for L in tqdm(args.seq, desc="seq", unit="len"):
        q, k, v = (torch.randn(args.batch, args.heads, L, args.head_dim, device=args.device, dtype=dtype) for _ in range(3))
        op = torch.ops.entropy_attn.attention

        def lean() -> object:
            return op(q, k, v, None, None, is_causal=True, return_stats=False)

        def epilogue() -> object:
            return op(q, k, v, None, None, is_causal=True)

        def aten_chain() -> object:
            r = op(q, k, v, None, None, is_causal=True)
            return derive_with_aten(r[1], r[2], r[3], r[5])

        t = {name: median_ms(fn, args.min_run_time) for name, fn in
             (("no_stats", lean), ("stats_epilogue", epilogue), ("stats_epilogue_plus_aten_chain", aten_chain))}
        rows.append({"seq_len": L, **{f"{k}_ms": v for k, v in t.items()},
                     "stats_overhead": t["stats_epilogue"] / t["no_stats"] - 1,
                     "aten_chain_ms": t["stats_epilogue_plus_aten_chain"] - t["stats_epilogue"]})
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else cpu_name()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    meta = {"device": device_name, "torch": torch.__version__, "commit": commit, "threads": torch.get_num_threads(),
            "dtype": args.dtype, "batch": args.batch, "heads": args.heads, "head_dim": args.head_dim, "causal": True}
    args.out.mkdir(parents=True, exist_ok=True)
    tag = "cpu" if args.device == "cpu" else "cuda"
    (args.out / f"{tag}.json").write_text(json.dumps({**meta, "points": rows}, indent=1) + "\n")
    lines = [f"{device_name}, torch {torch.__version__}, commit {commit}, {torch.get_num_threads()} threads; "
             f"{args.dtype}, B={args.batch}, H={args.heads}, D={args.head_dim}, causal; medians.", "",
             "| L | no statistics (ms) | statistics, kernel epilogue (ms) | overhead | + former ATen chain (ms) |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['seq_len']} | {r['no_stats_ms']:.3f} | {r['stats_epilogue_ms']:.3f} | "
                     f"{100 * r['stats_overhead']:+.1f}% | {r['aten_chain_ms']:+.3f} |")
    (args.out / f"{tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
