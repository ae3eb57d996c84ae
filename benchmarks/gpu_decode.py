"""Decoding on a CUDA GPU: a few query rows against a long KV cache, torch_ext.attention against
F.scaled_dot_product_attention, forward only, in one process.

A decoding step has one query tile per (batch, head): the unsplit kernels run it on that many SMs.
Split-KV (csrc/cuda/sm80/split_kv.cuh) cuts each tile's keys into parts; this script times ours
with it off, on its rule (``auto``) and with forced part counts (ENTROPY_ATTN_SPLIT_KV), each with
and without statistics, against SDPA's fastest backend (cudnn, flash, efficient by name), the
causal alignment bottom-right as in a cache (the last query row sees every key; with one query row
that is full attention). Every setting is first checked against SDPA's output. Times are medians of
CUDA-event blocks (benchmarks/gpu_vs_sdpa.py's timer). Writes results/gpu/decode.{md,json}.
Without a GPU: says so, writes nothing, exits 0 (1 with --require-gpu). Exits 1, after writing, if
a call failed or an output disagreed with SDPA's.

    python3 benchmarks/gpu_decode.py                                 # B 1 8, 32:8, D 128, 1k-64k
    python3 benchmarks/gpu_decode.py --batch 1 --cache 8192 --split off auto 4 16 --out-json ''
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_vs_sdpa as base  # noqa: E402  (the timer, the environment header, SDPA's backends)

DEFAULT_MD = os.path.join(base.REPO_ROOT, "results", "gpu", "decode.md")
DEFAULT_JSON = os.path.join(base.REPO_ROOT, "results", "gpu", "decode.json")
SPLIT_ENV = "ENTROPY_ATTN_SPLIT_KV"
#: bfloat16 tolerance of an output against SDPA's (both round to bf16 once; values are O(1)).
ATOL = {"bfloat16": 3e-2, "float16": 5e-3}


@dataclass(frozen=True)
class Shape:
    """One decoding point."""

    dtype: str
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    q_len: int
    cache: int


def split_setting(text: str) -> str:
    """An ENTROPY_ATTN_SPLIT_KV value the extension accepts (argparse type)."""
    if text in ("off", "auto") or (text.isdigit() and 1 <= int(text) <= 128):
        return text
    raise argparse.ArgumentTypeError(f"expected off, auto or a part count from 1 to 128, got {text!r}")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", nargs="+", default=["bf16"], choices=sorted(base.DTYPE_NAMES))
    p.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    p.add_argument("--heads-kv", nargs="+", type=base.parse_heads_kv, default=[(32, 8)], metavar="H:Hkv")
    p.add_argument("--head-dim", nargs="+", type=int, default=[128])
    p.add_argument("--q-len", type=int, default=1, help="query rows per step (default 1)")
    p.add_argument("--cache", nargs="+", type=int, default=[1024, 4096, 16384, 65536], help="keys in the cache")
    p.add_argument("--split", nargs="+", type=split_setting, default=["off", "auto"],
                   help=f"{SPLIT_ENV} settings: off, auto, or a part count 1-128 (default off auto)")
    p.add_argument("--family", default="auto", choices=base.FAMILIES, help=f"sets {base.FAMILY_ENV}")
    p.add_argument("--min-run-time", type=float, default=0.2, help="seconds per measurement")
    p.add_argument("--out-md", default=DEFAULT_MD, help="Markdown file ('' to skip)")
    p.add_argument("--out-json", default=DEFAULT_JSON, help="JSON file ('' to skip)")
    p.add_argument("--require-gpu", action="store_true", help="exit 1 (not 0) without a CUDA device")
    args = p.parse_args(argv)
    args.dtype = list(dict.fromkeys(base.DTYPE_NAMES[d] for d in args.dtype))
    return args


def expand_grid(args: argparse.Namespace) -> List[Shape]:
    """Every point of the flags' grid."""
    return [
        Shape(dt, b, h, hkv, d, args.q_len, n)
        for dt in args.dtype for b in args.batch for h, hkv in args.heads_kv for d in args.head_dim
        for n in args.cache
    ]  # fmt: skip


def make_inputs(s: Shape, device: str) -> List[torch.Tensor]:
    """Seeded standard-normal q (B, H, Lq, D), k and v (B, Hkv, cache, D)."""
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = base.DTYPES[s.dtype]
    q = torch.randn(s.batch, s.heads, s.q_len, s.head_dim, device=device, dtype=dtype, generator=gen)
    k, v = (torch.randn(s.batch, s.kv_heads, s.cache, s.head_dim, device=device, dtype=dtype, generator=gen)
            for _ in range(2))  # fmt: skip
    return [q, k, v]


def sdpa_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA of a decoding step: bottom-right causality as an explicit mask when Lq > 1."""
    mask = None
    if q.shape[2] > 1:
        lq, lk = q.shape[2], k.shape[2]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def ours_call(ext: Any, stats: bool) -> Callable[..., Any]:
    """Ours for a decoding step (bottom-right causality: a cache)."""
    return lambda q, k, v: ext.attention(q, k, v, is_causal=q.shape[2] > 1, causal_alignment="bottom_right",
                                         enable_gqa=q.shape[1] != k.shape[1], return_stats=stats)


def measure(s: Shape, ext: Any, splits: Sequence[str], min_run_time: float,
            timer: base.Timer = base.cuda_time_ms, device: str = "cuda") -> Dict[str, Any]:
    """One point: SDPA by backend, then ours per split setting (after a check against SDPA)."""
    x = make_inputs(s, device)
    point: Dict[str, Any] = {**s.__dict__, "sdpa_ms_by_backend": {}, "ours": {}, "errors": []}
    with torch.no_grad():
        want = sdpa_call(*x).float()
        for name, backend in base.SDPA_BACKENDS.items():
            with warnings.catch_warnings(), sdpa_kernel(backend):
                warnings.simplefilter("ignore")
                try:
                    point["sdpa_ms_by_backend"][name] = timer(lambda: sdpa_call(*x), min_run_time)
                except RuntimeError:
                    point["sdpa_ms_by_backend"][name] = None
        timed = {n: t for n, t in point["sdpa_ms_by_backend"].items() if t is not None}
        point["sdpa_backend"] = min(timed, key=timed.get) if timed else None
        point["sdpa_ms"] = timed.get(point["sdpa_backend"]) if timed else None
        saved = os.environ.get(SPLIT_ENV)
        try:
            for split in splits:
                os.environ[SPLIT_ENV] = split
                row: Dict[str, Any] = {}
                for kind, stats in (("fwd", False), ("fwd_stats", True)):
                    call = ours_call(ext, stats)
                    try:
                        out = call(*x)[0] if stats else call(*x)
                        err = (out.float() - want).abs().max().item()
                        if not err <= ATOL[s.dtype]:
                            point["errors"].append(f"split {split} {kind}: max error {err:.3g} against SDPA")
                        row[kind] = timer(lambda: call(*x), min_run_time)
                    except (RuntimeError, ValueError) as e:
                        point["errors"].append(f"split {split} {kind}: {base.describe(e)}")
                        row[kind] = None
                    row[f"{kind}_ratio"] = base.ratio(row[kind], point["sdpa_ms"])
                point["ours"][split] = row
        finally:
            if saved is None:
                os.environ.pop(SPLIT_ENV, None)
            else:
                os.environ[SPLIT_ENV] = saved
    return point


def markdown(result: Dict[str, Any]) -> str:
    """The report: a header line and one table (ours per split setting against SDPA's fastest)."""
    splits = result["splits"]
    lines = [
        f"{result['device']}, driver {result['driver']}, torch {result['torch']}, CUDA {result['cuda']}, commit "
        f"{result['commit'][:12]}{' (csrc/ modified)' if result['dirty'] else ''}, built from sources "
        f"{str(result.get('sources_sha256', 'unknown'))[:12]}, {result['date']}; family {result['family']}; "
        f"command: `{result['command']}`",
        "",
        "Forward times (ms, medians of CUDA-event blocks) of one decoding step; ratio = ours / SDPA's fastest "
        f"backend; columns: {SPLIT_ENV} settings, without / with statistics.",
        "",
        "| dtype | B | H:Hkv | D | Lq | cache | SDPA (backend) | "
        + " | ".join(f"split {sp}" for sp in splits) + " | note |",
        "|" + "---|" * (8 + len(splits)),
    ]
    for p in result["points"]:
        cells = [p["dtype"], p["batch"], f"{p['heads']}:{p['kv_heads']}", p["head_dim"], p["q_len"], p["cache"],
                 f"{base.fmt(p['sdpa_ms'])} ({p['sdpa_backend'] or 'n/a'})"]  # fmt: skip
        for sp in splits:
            o = p["ours"].get(sp, {})
            cells.append(f"{base.fmt(o.get('fwd'))} ({base.fmt(o.get('fwd_ratio'), '.2f', 'x')}) / "
                         f"{base.fmt(o.get('fwd_stats'))} ({base.fmt(o.get('fwd_stats_ratio'), '.2f', 'x')})")
        cells.append("; ".join(p["errors"]))
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the benchmark; returns the exit code."""
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_decode: no CUDA device is visible: nothing benchmarked, nothing written"
              f"{' (--require-gpu: failing)' if args.require_gpu else ''}.")
        return 1 if args.require_gpu else 0
    try:
        import torch_ext as ext
    except ImportError:  # not installed: the one built in place in this checkout
        sys.path.insert(0, base.REPO_ROOT)
        import torch_ext as ext
    command = "python3 benchmarks/gpu_decode.py " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    result = base.environment(command.strip())
    result.update(family=args.family, splits=list(args.split))
    saved = os.environ.get(base.FAMILY_ENV)
    os.environ[base.FAMILY_ENV] = args.family
    try:
        result["points"] = [measure(s, ext, args.split, args.min_run_time)
                            for s in tqdm(expand_grid(args), desc="gpu_decode", unit="point", file=sys.stderr)]
    finally:
        if saved is None:
            os.environ.pop(base.FAMILY_ENV, None)
        else:
            os.environ[base.FAMILY_ENV] = saved
    text = markdown(result)
    print("\n" + text)
    for path, content in ((args.out_md, text), (args.out_json, json.dumps(result, indent=1) + "\n")):
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w") as f:
                f.write(content)
            print(f"written to {path}")
    failed = [p for p in result["points"] if p["errors"]]
    if failed:
        print(f"gpu_decode: {len(failed)} point(s) with failures or mismatches (see the notes)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
