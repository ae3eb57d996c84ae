"""Strong scaling of context-parallel attention (torch_ext.distributed) on the CPU with gloo.

One causal log-n attention call with statistics over a sequence of L tokens (default L = 16384),
forward and forward + backward, with the sequence sharded over P = 1, 2, 4 processes of one
thread each (--threads per process), against the plain op in one process with the same threads
(the baseline: P = 1 context parallel differs from it by the chunking and the merge of the
chunks' states). Strong scaling: P processes bring P times the cores, as long as the machine has
them. Also the bytes each rank sends per call and the time spent merging.

    python3 benchmarks/context_parallel.py                 # L = 16384, P = 1 2 4
    python3 benchmarks/context_parallel.py --seq 4096 --procs 1 2

Writes results/distributed/scaling.md and scaling.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torch_ext
from torch_ext import distributed as cp
from torch_ext import merge

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import positive_int  # noqa: E402  (benchmarks/timing.py)

ROOT = Path(__file__).resolve().parent.parent


def inputs(args: argparse.Namespace) -> tuple[torch.Tensor, ...]:
    """The full q, k, v (one seed: every process builds the same)."""
    g = torch.Generator().manual_seed(0)
    shape = lambda h: (1, h, args.seq, args.head_dim)  # noqa: E731
    return (torch.randn(shape(args.heads), generator=g), torch.randn(shape(args.kv_heads), generator=g),
            torch.randn(shape(args.kv_heads), generator=g))


def timed(fn: Any, repeats: int, sync: Any) -> List[float]:
    """Seconds of each of `repeats` calls after one warm-up, each between barriers."""
    fn()
    out = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - start)
    return out


def merge_seconds(q: torch.Tensor, world: int, repeats: int) -> float:
    """Seconds of the merges one rank does per forward: 2 (P per query chunk) merges of two chunk
    states, on states the size of a chunk's rows."""
    rows = q.shape[:2] + (q.shape[2] // 2,)
    def state() -> merge.RowState:
        z = torch.rand(rows)
        return merge.RowState(torch.randn(*rows, q.shape[3]), z, z, z, z, torch.ones(rows, dtype=torch.int64))
    a, b = state(), state()
    merges = 2 * world
    start = time.perf_counter()
    for _ in range(repeats):
        for _ in range(merges):
            merge.merge_row_states([a, b])
    return (time.perf_counter() - start) / repeats


def run_rank(rank: int, world: int, args: argparse.Namespace) -> Dict[str, Any]:
    """This rank's timings (forward, forward + backward) of the sharded call."""
    q, k, v = (cp.shard_sequence(t) for t in inputs(args))
    kw = dict(is_causal=True, scale="logn", train_length=args.seq, return_stats=True,
              enable_gqa=args.heads != args.kv_heads)
    sync = dist.barrier

    def forward() -> None:
        with torch.no_grad():
            cp.context_parallel_attention(q, k, v, **kw)

    def forward_backward() -> None:
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        out, stats = cp.context_parallel_attention(qq, kk, vv, **kw)
        (out.sum() + stats.entropy.sum()).backward()

    result = {"forward": timed(forward, args.repeats, sync)}
    if not args.no_backward:
        result["forward_backward"] = timed(forward_backward, args.repeats, sync)
    result["merge"] = merge_seconds(q, world, args.repeats)
    return result


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=1800))
    try:
        result = run_rank(rank, world, args)
        if rank == 0:
            Path(out).write_text(json.dumps(result))
        dist.barrier()  # (as examples/context_parallel.py: no rank tears down while a peer is in gloo)
    finally:
        dist.destroy_process_group()


def run_world(world: int, args: argparse.Namespace) -> Dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # (rank 0's result through a file of its own: not in the repository, and not shared by two runs)
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / f"cp_scaling_{world}.json"
        mp.spawn(_worker, args=(world, port, args, str(out)), nprocs=world, join=True)
        return json.loads(out.read_text())


def baseline(args: argparse.Namespace) -> Dict[str, Any]:
    """The plain op in this process, with one process's threads."""
    torch.set_num_threads(args.threads)
    q, k, v = inputs(args)
    kw = dict(is_causal=True, scale="logn", train_length=args.seq, return_stats=True,
              enable_gqa=args.heads != args.kv_heads)

    def forward() -> None:
        with torch.no_grad():
            torch_ext.attention(q, k, v, **kw)

    def forward_backward() -> None:
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        out, stats = torch_ext.attention(qq, kk, vv, **kw)
        (out.sum() + stats.entropy.sum()).backward()

    result = {"forward": timed(forward, args.repeats, lambda: None)}
    if not args.no_backward:
        result["forward_backward"] = timed(forward_backward, args.repeats, lambda: None)
    return result


def sent_bytes(world: int, args: argparse.Namespace) -> Dict[str, int]:
    """Bytes one rank sends per call: K and V blocks P - 1 times forward; backward, K and V P - 1
    times and the fp32 dK and dV accumulators P times."""
    block = args.kv_heads * (args.seq // world) * args.head_dim  # elements of one K (or V) block
    forward = 2 * block * 4 * (world - 1)
    backward = forward + 2 * block * 4 * world if world > 1 else 0
    return {"forward": forward, "backward": backward}


def markdown(args: argparse.Namespace, base: Dict[str, Any], results: Dict[int, Dict[str, Any]]) -> str:
    med = statistics.median
    lines = [
        "# Context-parallel attention: strong scaling on the CPU",
        "",
        f"`python3 benchmarks/context_parallel.py --seq {args.seq} --procs {' '.join(map(str, sorted(results)))}`: "
        f"one causal log-n attention call with statistics, B = 1, H = {args.heads}, Hkv = {args.kv_heads}, "
        f"D = {args.head_dim}, L = {args.seq}, float32; torch {torch.__version__}, gloo; {args.threads} thread(s) per "
        f"process on this machine ({os.cpu_count()} cores, {_cpu_name()}). Medians of {args.repeats} calls after a "
        "warm-up; the plain op runs in one process with the same threads.",
        "",
        "| P | forward (s) | speed-up | forward + backward (s) | speed-up | sent per rank: forward | backward | merge (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    fb_base = med(base["forward_backward"]) if "forward_backward" in base else None
    lines.append(f"| plain op | {med(base['forward']):.3f} | 1.00 | "
                 + (f"{fb_base:.3f} | 1.00" if fb_base else "– | –") + " | – | – | – |")
    for world, r in sorted(results.items()):
        f = med(r["forward"])
        fb = med(r["forward_backward"]) if "forward_backward" in r else None
        sent = sent_bytes(world, args)
        lines.append(f"| {world} | {f:.3f} | {med(base['forward']) / f:.2f} | "
                     + (f"{fb:.3f} | {fb_base / fb:.2f}" if fb and fb_base else "– | –")
                     + f" | {sent['forward'] / 2**20:.1f} MiB | {sent['backward'] / 2**20:.1f} MiB | {r['merge']:.4f} |")
    cores = os.cpu_count() or 1
    lines += ["", f"The speed-up is against the plain op in one process. Ideal is P while P x threads <= {cores} "
              f"(the cores of this machine); beyond that the processes share cores and the speed-up cannot grow. "
              "The gap to ideal is the ring's transfers (here through the loopback; a GPU interconnect replaces "
              "it), waiting for them where they do not overlap the compute, the causal chunking and the merges."]
    return "\n".join(lines) + "\n"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=positive_int, default=16384)
    p.add_argument("--procs", type=positive_int, nargs="+", default=[1, 2, 4])
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--kv-heads", type=positive_int, help="key/value heads (default: --heads)")
    p.add_argument("--head-dim", type=positive_int, default=64)
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads per process")
    p.add_argument("--no-backward", action="store_true")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "distributed")
    args = p.parse_args(argv)
    args.kv_heads = args.heads if args.kv_heads is None else args.kv_heads
    if args.heads % args.kv_heads:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    if any(args.seq % (2 * w) for w in args.procs):
        p.error(f"--seq must be a multiple of 2 * P for every P in {args.procs}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    print("plain op", flush=True)
    base = baseline(args)
    results = {}
    for world in args.procs:
        print(f"P = {world}", flush=True)
        results[world] = run_world(world, args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scaling.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                      "baseline": base, "results": results}, indent=1))
    report = markdown(args, base, results)
    (args.out / "scaling.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
