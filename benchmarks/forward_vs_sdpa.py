"""Forward time of torch_ext.attention against F.scaled_dot_product_attention, same process.

Measures, interleaved and with torch.utils.benchmark (median of blocked runs):
  * SDPA's CPU flash backend (no statistics) and ours with all per-row statistics, scale None;
  * SDPA on q pre-multiplied by the per-row log-n factor (what models do today) and ours "logn".
Prints a Markdown table with the ratio ours / SDPA (lower is better).

    python benchmarks/forward_vs_sdpa.py                # B=1, H=8, L=2048, D=64, float32
    python benchmarks/forward_vs_sdpa.py --seq 1024 4096 --dtype bfloat16 --causal
"""

import argparse
import math
import platform

import torch
import torch.nn.functional as F
import torch.utils.benchmark as benchmark
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm import tqdm

import torch_ext


def logn_factor(seq: int, causal: bool, train_length: int) -> torch.Tensor:
    """Per-row factor log_b(n_i) that models multiply q by before a stock kernel."""
    n = torch.arange(1, seq + 1, dtype=torch.float32) if causal else torch.full((seq,), float(seq))
    return (torch.log(n) / math.log(train_length)).view(1, 1, seq, 1)


def measure(stmt: str, env: dict, min_run_time: float) -> float:
    """Median seconds of `stmt` over blocked runs."""
    return benchmark.Timer(stmt=stmt, globals=env).blocked_autorange(min_run_time=min_run_time).median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, nargs="+", default=[2048])
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--min-run-time", type=float, default=1.0, help="seconds per measurement")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    rows = []
    for seq in tqdm(args.seq, desc="sequence lengths"):
        shape = (args.batch, args.heads, seq, args.head_dim)
        q, k, v = (torch.randn(shape, dtype=dtype) for _ in range(3))
        factor = logn_factor(seq, args.causal, 512).to(dtype)
        env = {"F": F, "torch_ext": torch_ext, "q": q, "k": k, "v": v, "factor": factor, "causal": args.causal}
        cases = {
            "sdpa": "F.scaled_dot_product_attention(q, k, v, is_causal=causal)",
            "ours": "torch_ext.attention(q, k, v, is_causal=causal, return_stats=True)",
            "sdpa_logn": "F.scaled_dot_product_attention(q * factor, k, v, is_causal=causal)",
            "ours_logn": "torch_ext.attention(q, k, v, is_causal=causal, scale='logn', return_stats=True)",
        }
        times = {name: [] for name in cases}
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            for _ in range(3):  # interleave the methods so that machine noise hits all alike
                for name, stmt in cases.items():
                    times[name].append(measure(stmt, env, args.min_run_time / 3))
        med = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
        rows.append((seq, med))

    print(
        f"\n{platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, B={args.batch} H={args.heads} D={args.head_dim} "
        f"{args.dtype}{' causal' if args.causal else ''}\n"
    )
    print("| L | SDPA flash (ms) | ours + stats (ms) | ratio | SDPA q*log-n (ms) | ours logn + stats (ms) | ratio |")
    print("|---|---|---|---|---|---|---|")
    for seq, m in rows:
        print(
            f"| {seq} | {m['sdpa'] * 1e3:.1f} | {m['ours'] * 1e3:.1f} | {m['ours'] / m['sdpa']:.2f}x "
            f"| {m['sdpa_logn'] * 1e3:.1f} | {m['ours_logn'] * 1e3:.1f} | {m['ours_logn'] / m['sdpa_logn']:.2f}x |"
        )


if __name__ == "__main__":
    main()
