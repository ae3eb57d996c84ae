"""Peak memory of one attention method, measured alone in this (fresh) process; run by suite.py.

Creates the inputs, runs the method once at a tiny length (so that one-time initialization, such
as thread pools, the autograd engine's threads and lazily built kernels, is not counted;
FlexAttention, compiled for each shape, runs once at the measured shape instead), resets the
kernel's peak-RSS counter, runs the method once, and prints one JSON line: the peak RSS minus the
RSS before that call (inputs included), i.e. what the call itself needed (outputs, saved tensors,
gradients, workspaces).

The peak is VmHWM of /proc/self/status, not resource.getrusage's ru_maxrss: Linux folds into
ru_maxrss the peak of the image before exec (here the parent suite.py, whose RSS is larger than
any call at small L) and of exited threads, and that part cannot be reset. VmHWM is this process's
own high-water mark, and clear_refs resets it.

    python3 benchmarks/memory_probe.py --method eager_fwd/logn --length 4096
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from suite import DTYPES, METHODS_BY_KEY, Point, make_inputs

WARMUP_LENGTH = 16


def rss_bytes() -> int:
    """The current resident set size."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> bool:
    """Reset the peak RSS to the current RSS (Linux >= 4.0), so that what importing torch or
    compiling FlexAttention took does not count; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """Peak RSS since the start or the last reset_peak (VmHWM is in kB)."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def main() -> None:
    """Measure one method at one shape and print the JSON record."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", required=True, choices=list(METHODS_BY_KEY))
    p.add_argument("--length", type=int, required=True)
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    for name in ("length", "head_dim", "batch", "heads", "kv_heads", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.heads % args.kv_heads:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    torch.set_num_threads(args.threads)
    point = Point(args.dtype, args.head_dim, args.batch, args.heads, args.kv_heads, args.causal, args.length)
    method = METHODS_BY_KEY[args.method]
    fn = method.build(point, make_inputs(point))
    if method.family == "flex":
        fn()  # compiled for each shape, so warm up at this one: the compiler's memory is not the kernel's
    else:
        tiny = Point(args.dtype, args.head_dim, args.batch, args.heads, args.kv_heads, args.causal, WARMUP_LENGTH)
        method.build(tiny, make_inputs(tiny))()
    reset = reset_peak()
    base = rss_bytes()
    result = fn()
    peak = peak_rss_bytes()
    del result
    print(json.dumps({"peak_bytes": peak - base, "base_rss_bytes": base, "peak_rss_bytes": peak, "peak_reset": reset}))


if __name__ == "__main__":
    main()
