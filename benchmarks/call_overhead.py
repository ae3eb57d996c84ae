"""The fixed cost of a call: a tiny attention (4 heads, one query row, 16 keys, D = 64) called back
to back, in microseconds per call, ours and SDPA in the same process.

On the ``meta`` device the op runs everything but a kernel (the Python wrapper, the autograd
layer, the dispatcher, the checks and the output allocation): the host cost every device pays,
a GPU included, where a decoding step's kernels take tens of microseconds. On the CPU it adds
the kernel; on CUDA (when there is a GPU) the launches, timed to a synchronization after the last
call. Prints a Markdown table::

    python benchmarks/call_overhead.py           # the README's numbers
    python benchmarks/call_overhead.py --quick   # fewer calls, seconds
"""

from __future__ import annotations

import argparse
import time
from typing import Callable, List

import torch
import torch.nn.functional as F

import torch_ext


def per_call_us(fn: Callable[[], object], calls: int, rounds: int, device: str) -> float:
    """The fastest round's time per call, in µs, of `calls` calls back to back."""
    for _ in range(min(calls, 200)):
        fn()
    best = float("inf")
    for _ in range(rounds):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def rows(devices: List[str], calls: int, rounds: int) -> List[str]:
    """One table row per (device, mode): ours without and with statistics, and SDPA's."""
    lines = []
    modes = (("no_grad", False, False), ("grad mode, inputs without grad", True, False),
             ("inputs that require grad (forward only)", True, True))
    for device in devices:
        for mode, grad, leaves in modes:
            q, k, v = (torch.randn(1, 4, n, 64, device=device, requires_grad=leaves) for n in (1, 16, 16))
            ours = lambda: torch_ext.attention(q, k, v)  # noqa: E731
            stats = lambda: torch_ext.attention(q, k, v, return_stats=True)  # noqa: E731
            sdpa = lambda: F.scaled_dot_product_attention(q, k, v)  # noqa: E731
            with torch.set_grad_enabled(grad):
                a, b = per_call_us(ours, calls, rounds, device), per_call_us(stats, calls, rounds, device)
                # (SDPA has no meta kernel of its own worth timing: it decomposes there.)
                c = per_call_us(sdpa, calls, rounds, device) if device != "meta" else None
            sdpa_cell = "-" if c is None else f"{c:.1f}"
            ratio = "-" if c is None else f"{a / c:.2f}x"
            lines.append(f"| {device} | {mode} | {a:.1f} | {b:.1f} | {sdpa_cell} | {ratio} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls and rounds")
    args = parser.parse_args()
    torch.set_num_threads(1)  # (a tiny call: threads would only add their wake-up)
    devices = ["meta", "cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    calls, rounds = (500, 2) if args.quick else (20000, 5)
    print(f"torch {torch.__version__}, 1 thread" + (f", {torch.cuda.get_device_name()}" if "cuda" in devices else ""))
    print()
    print("| device | mode | ours (µs) | ours with statistics (µs) | SDPA (µs) | ours / SDPA |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows(devices, calls, rounds)))


if __name__ == "__main__":
    main()
