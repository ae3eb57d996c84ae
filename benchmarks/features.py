"""Sliding windows and packed sequences: time and memory against torch's attention, in one process.

Windows: causal attention with a window of W keys at growing L. The op skips the key blocks outside
every window, so its time grows with L * W; full causal attention (ours and SDPA's) grows with L^2,
and SDPA has no window but a dense (L, L) mask.

Packed sequences: N documents of length S packed into one row of T = N * S tokens. varlen_attention
attends within each document in one call, its memory linear in T; SDPA needs either a dense
block-diagonal (T, T) mask or a loop over the documents (and, on CUDA, torch's varlen_attn).

    python3 benchmarks/features.py                          # CPU, float32
    python3 benchmarks/features.py --device cuda --dtype bfloat16 --heads 16

Writes a Markdown table and JSON to results/features/<device>.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import sys

import torch
import torch.nn.functional as F
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout's torch_ext, built in place, when it is not installed

import torch_ext  # noqa: E402
from timing import available_device, device_name, median_ms  # noqa: E402  (benchmarks/timing.py)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def peak_mib(fn: Callable[[], object], device: str) -> Optional[float]:
    """Memory one call of fn() needed beyond what was allocated before it, in MiB: the CUDA
    allocator's peak, or on the CPU the peak resident set (VmHWM, reset through clear_refs)."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    before = _rss()
    fn()
    return max(_hwm() - before, 0) / 2**20


def window_mask(L: int, W: int, device: str) -> torch.Tensor:
    i = torch.arange(L, device=device).view(-1, 1)
    j = torch.arange(L, device=device).view(1, -1)
    return (j <= i) & (j > i - W)


def block_diagonal_mask(n: int, s: int, device: str) -> torch.Tensor:
    doc = torch.arange(n * s, device=device) // s
    i = torch.arange(n * s, device=device)
    return (doc.view(-1, 1) == doc.view(1, -1)) & (i.view(1, -1) <= i.view(-1, 1))


def build(name: str, args: argparse.Namespace, L: int) -> Callable[[], object]:
    """The call of method ``name`` at length L (windows) or on the packed batch (L unused), with
    its inputs created here."""
    dev, dtype, H, D, W = args.device, getattr(torch, args.dtype), args.heads, args.head_dim, args.window
    g = torch.Generator().manual_seed(0)

    def qkv(shape: tuple) -> List[torch.Tensor]:
        return [torch.randn(*shape, generator=g).to(device=dev, dtype=dtype) for _ in range(3)]

    if name.startswith("window/"):
        q, k, v = qkv((1, H, L, D))
        if name == "window/ours_window":
            return lambda: torch_ext.attention(q, k, v, is_causal=True, window_size=(W - 1, 0))
        if name == "window/ours_causal":
            return lambda: torch_ext.attention(q, k, v, is_causal=True)
        if name == "window/sdpa_causal":
            return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
        mask = window_mask(L, W, dev)
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    N, S = args.docs, args.doc_len
    T = N * S
    q, k, v = qkv((T, H, D))
    cu = torch.arange(0, T + 1, S, dtype=torch.int32, device=dev)
    if name == "packed/ours_varlen":
        return lambda: torch_ext.varlen_attention(q, k, v, cu, cu, S, S, is_causal=True)
    if name == "packed/torch_varlen_attn":
        from torch.nn.attention.varlen import varlen_attn

        return lambda: varlen_attn(q, k, v, cu, cu, S, S, window_size=(-1, 0))
    qd, kd, vd = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    if name == "packed/sdpa_loop":
        return lambda: [
            F.scaled_dot_product_attention(*(x[:, :, i * S : (i + 1) * S] for x in (qd, kd, vd)), is_causal=True)
            for i in range(N)
        ]
    mask = block_diagonal_mask(N, S, dev)
    return lambda: F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask)


def probe(args: argparse.Namespace) -> None:
    """--probe NAME: the memory of one call of NAME, measured alone in this fresh process after a
    warm-up call (thread pools, lazy initialization), printed as JSON."""
    fn = build(args.probe, args, args.probe_len)
    fn()
    print(json.dumps({"mib": peak_mib(fn, args.device)}))


def memory(name: str, args: argparse.Namespace, L: int) -> Optional[float]:
    """The memory of one call of ``name``: in-process on CUDA, in a fresh process on the CPU (in
    this one the allocator keeps the pages that the timed calls touched)."""
    if args.device == "cuda":
        return peak_mib(build(name, args, L), "cuda")
    argv = [a for a in sys.argv[1:]]
    out = subprocess.run(
        [sys.executable, __file__, *argv, "--probe", name, "--probe-len", str(L)],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])["mib"]
    except (ValueError, IndexError, KeyError):
        return None


def markdown(result: Dict[str, Any]) -> str:
    """The Markdown tables of a result (what main writes to <tag>.json)."""
    windows, packed = result["windows"], result["packed"]

    def f(x: Any, fmt: str = "") -> str:  # milliseconds by default: 3 significant digits, no exponent
        if x is None:
            return "—"
        return fmt.format(x) if fmt else f"{x:.0f}" if x >= 100 else f"{x:.3g}"

    mib = "{:.1f}"
    lines = [f"# Windows and packed sequences ({result['device']})", "",
             f"torch {result['torch']}, commit {result['commit']}, {result['dtype']}, batch 1, H={result['heads']}, "
             f"D={result['head_dim']}; medians of torch.utils.benchmark in one process; memory: what one forward call "
             "needed beyond its inputs (CUDA allocator peak; on the CPU the peak resident set of the call alone, in a "
             "fresh process).", "",
             f"## Causal sliding window of W = {windows[0]['window']} keys", "",
             "| L | ours, window (ms) | ours, full causal (ms) | SDPA, full causal (ms) | SDPA, dense window mask (ms) "
             "| ours window / SDPA causal | ours, window (MiB) | SDPA, mask (MiB) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in windows:
        lines.append(
            f"| {r['seq_len']} | {f(r['ours_window_ms'])} | {f(r['ours_causal_ms'])} | {f(r['sdpa_causal_ms'])} | "
            f"{f(r.get('sdpa_window_mask_ms'))} | {f(r['ours_window_ms'] / r['sdpa_causal_ms'], '{:.2f}')} | "
            f"{f(r.get('ours_window_mib'), mib)} | {f(r.get('sdpa_window_mask_mib'), mib)} |"
        )
    labels = {"ours_varlen": "ours, varlen_attention", "sdpa_loop": "SDPA, loop over documents",
              "sdpa_block_mask": "SDPA, block-diagonal (T, T) mask", "torch_varlen_attn": "torch varlen_attn"}
    N, S = packed["docs"], packed["doc_len"]
    lines += ["", f"## {N} documents of {S} tokens packed in one row (T = {N * S}), causal", "",
              "| method | time (ms) | memory (MiB) |", "|---|---|---|"]
    lines += [f"| {label} | {f(packed[n + '_ms'])} | {f(packed[n + '_mib'], mib)} |"
              for n, label in labels.items() if n + "_ms" in packed]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", type=available_device, default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--seq", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    p.add_argument("--dense-mask-max", type=int, default=8192, help="largest L for SDPA with a dense mask")
    p.add_argument("--docs", type=int, default=8)
    p.add_argument("--doc-len", type=int, default=2048)
    p.add_argument("--min-run-time", type=float, default=0.5)
    p.add_argument("--out", type=Path, default=ROOT / "results" / "features")
    p.add_argument("--probe", help=argparse.SUPPRESS)
    p.add_argument("--probe-len", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.probe:
        probe(args)
        return
    dev, H, D, W = args.device, args.heads, args.head_dim, args.window

    windows: List[Dict[str, object]] = []
    for L in tqdm(args.seq, desc="windows"):
        row: Dict[str, object] = {"seq_len": L, "window": W}
        names = ["ours_window", "ours_causal", "sdpa_causal"] + (["sdpa_window_mask"] if L <= args.dense_mask_max else [])
        for n in names:
            row[f"{n}_ms"] = median_ms(build(f"window/{n}", args, L), args.min_run_time)
        for n in ("ours_window", "sdpa_window_mask"):
            if n in names:
                row[f"{n}_mib"] = memory(f"window/{n}", args, L)
        windows.append(row)

    N, S = args.docs, args.doc_len
    packed: Dict[str, object] = {"docs": N, "doc_len": S, "tokens": N * S}
    methods = ["ours_varlen", "sdpa_loop", "sdpa_block_mask"] + (["torch_varlen_attn"] if dev == "cuda" else [])
    for n in tqdm(methods, desc="packed"):
        packed[f"{n}_ms"] = median_ms(build(f"packed/{n}", args, 0), args.min_run_time)
        packed[f"{n}_mib"] = memory(f"packed/{n}", args, 0)

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    meta = {"device": device_name(dev), "torch": torch.__version__, "commit": commit, "dtype": args.dtype, "heads": H, "head_dim": D}
    args.out.mkdir(parents=True, exist_ok=True)
    tag = "cuda" if dev == "cuda" else "cpu"
    (args.out / f"{tag}.json").write_text(json.dumps({**meta, "windows": windows, "packed": packed}, indent=2) + "\n")

    text = markdown({**meta, "windows": windows, "packed": packed})
    (args.out / f"{tag}.md").write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
