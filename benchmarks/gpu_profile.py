"""Nsight Compute profile of the default CUDA path: every kernel of ours that one call launches, for
the forward without statistics, the forward with them and the backward of the latter, with the
counters that say where the time goes. Runs ``ncu`` on itself (a child process makes the calls:
warm-up outside the profiled range, one call of each inside it) and writes a Markdown report::

    python3 benchmarks/gpu_profile.py                              # bf16, B 4, H 16, L 4096, D 128, causal
    python3 benchmarks/gpu_profile.py --seq 1024 --head-dim 64 --out results/gpu/profile_d64.md
    python3 benchmarks/gpu_profile.py --causal no --calls fwd fwd_stats   # what the statistics cost

Per kernel: duration, SM and memory throughput, issue slots busy, the tensor pipe's active cycles,
the SFU (exponentials), FMA and ALU pipes', warp cycles per issued instruction, achieved occupancy,
the SM clock it ran at, and the stall reasons: the average number
of warps stalled for each reason per issued instruction (hardware counters, so no PC sampling,
which the lent GPUs' profiler could not read: results/gpu/profile_h200.md). Clocks are left to the
GPU (``--clock-control none``), so durations differ from the benchmark's. The raw CSV goes next to
the report (``.csv``). Without ``ncu`` or a GPU: says so, writes nothing, exits 1.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import shlex
import shutil
import subprocess
import sys
from typing import Dict, List, Optional, Sequence, Tuple

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO_ROOT, "results", "gpu", "profile.md")
#: The calls profiled, in order: ncu runs once per call (its range is the call alone).
CALLS = ("fwd", "fwd_stats", "bwd")
#: Kernels of ours: the tensor-core families' and the fallback's (the guard after each call).
KERNEL_FILTER = r"regex:^(forward_kernel|main_kernel|preprocess_kernel|postprocess_kernel|dq_kernel|split_combine_kernel|attention_fwd_kernel|attention_bwd_kernel|attention_bwd_compact_kernel)$"  # noqa: E501
#: (column, metric) of the summary table.
SUMMARY: Tuple[Tuple[str, str], ...] = (
    ("duration (µs)", "gpu__time_duration.sum"),
    ("SM throughput", "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("memory throughput", "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed"),
    ("issue slots busy", "sm__inst_issued.avg.pct_of_peak_sustained_active"),
    ("tensor pipe (wgmma)", "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"),
    ("tensor pipe (mma.sync)", "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"),
    ("SFU pipe (exp)", "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active"),
    ("FMA pipe", "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active"),
    ("ALU pipe", "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active"),
    ("warp cycles per issue", "smsp__average_warp_latency_per_inst_issued.ratio"),
    ("occupancy", "sm__warps_active.avg.pct_of_peak_sustained_active"),
    # The clock the kernel ran at (left to the GPU): a power-capped GPU lowers it under load, so that
    # work a kernel adds beside the tensor cores can cost time without holding any pipe up.
    ("SM clock (GHz)", "sm__cycles_elapsed.avg.per_second"),
)
#: Divisors of the metrics shown in other units: ns -> µs, Hz -> GHz.
SCALE = {"gpu__time_duration.sum": 1e3, "sm__cycles_elapsed.avg.per_second": 1e9}
#: Metrics asked for by pattern (below), not by name: a chip may lack them.
PATTERNED = ("tensor_op", "pipe_xu", "pipe_fma", "pipe_alu")
STALL_PREFIX = "smsp__average_warps_issue_stalled_"
STALL_SUFFIX = "_per_issue_active.ratio"
#: What ncu collects: the summary's metrics by name, the tensor pipes (wgmma exists on sm_90 only) and
#: the stall reasons by pattern, which names no metric a chip lacks.
METRICS = ",".join(
    [m for _, m in SUMMARY if not any(p in m for p in PATTERNED)]
    + [r"regex:^sm__pipe_tensor_op_(gmma|hmma)_cycles_active\.avg\.pct_of_peak_sustained_active$",
       r"regex:^sm__(inst_executed_pipe_xu|pipe_(fma|alu)_cycles_active)\.avg\.pct_of_peak_sustained_active$",
       rf"regex:^{STALL_PREFIX}.*_per_issue_active\.ratio$"]
)
#: Stall reasons shown per kernel (the largest).
TOP_STALLS = 6


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Command-line arguments."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, help="default: --heads")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--causal", choices=("yes", "no"), default="yes")
    p.add_argument("--calls", nargs="+", choices=CALLS, default=list(CALLS),
                   help="the calls to profile (default: all three)")
    p.add_argument("--ncu", default="ncu", help="the Nsight Compute command")
    p.add_argument("--out", default=DEFAULT_OUT, help="Markdown report ('' to print only)")
    p.add_argument("--child", choices=CALLS, help=argparse.SUPPRESS)  # the profiled process
    args = p.parse_args(argv)
    args.kv_heads = args.kv_heads or args.heads
    return args


def shape_flags(args: argparse.Namespace) -> List[str]:
    """The options that fix the call, as the child gets them."""
    return ["--dtype", args.dtype, "--batch", str(args.batch), "--heads", str(args.heads), "--kv-heads",
            str(args.kv_heads), "--seq", str(args.seq), "--head-dim", str(args.head_dim), "--causal", args.causal]  # fmt: skip


def run_child(args: argparse.Namespace) -> int:
    """Make the call `args.child` under the profiler: two warm-up calls first (module loading, the
    allocator), then one inside cudaProfilerStart / Stop (ncu --profile-from-start off)."""
    import torch

    import torch_ext

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(heads: int) -> torch.Tensor:
        size = (args.batch, heads, args.seq, args.head_dim)
        return torch.randn(size, device="cuda", dtype=dtype, generator=gen)

    q, k, v, dout = rand(args.heads), rand(args.kv_heads), rand(args.kv_heads), rand(args.heads)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    kw = dict(is_causal=args.causal == "yes", enable_gqa=args.kv_heads != args.heads)

    def call(profiled: bool) -> None:
        start = torch.cuda.cudart().cudaProfilerStart if profiled else lambda: None
        if args.child == "bwd":  # the forward outside the range
            out = torch_ext.attention(q, k, v, return_stats=True, **kw)[0]
            torch.cuda.synchronize()
            start()
            torch.autograd.grad(out, (q, k, v), dout)
        else:
            with torch.no_grad():
                start()
                torch_ext.attention(q, k, v, return_stats=args.child == "fwd_stats", **kw)
        torch.cuda.synchronize()
        if profiled:
            torch.cuda.cudart().cudaProfilerStop()

    for profiled in (False, False, True):
        call(profiled)
    return 0


def read_csv(text: str) -> List[Dict[str, str]]:
    """Rows of ncu's CSV output, as {column: value}, one per (kernel, metric): the long form of the
    details page ("Metric Name", "Metric Value") as it is, the wide form of the raw page (a column
    per metric, a row of units after the header) turned into it. Lines that are not CSV (ncu's
    "==PROF==" messages, the program's output) are left out."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
    if not rows or "Metric Name" in rows[0]:
        return rows
    keys = {"ID", "Kernel Name", "Function Name", "Process ID", "Process Name", "Host Name", "Context", "Stream",
            "Block Size", "Grid Size", "Device", "CC"}  # fmt: skip
    long_rows = []
    for row in rows:
        if not row.get("ID"):  # the units row
            continue
        for name, value in row.items():
            if name not in keys:
                long_rows.append({"ID": row["ID"], "Kernel Name": row.get("Kernel Name") or row.get("Function Name", ""),
                                  "Metric Name": name, "Metric Value": value})  # fmt: skip
    return long_rows


def number(text: str) -> Optional[float]:
    """A metric value as a number (ncu may group digits with commas); None if it is not one."""
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return None


def short_name(kernel: str) -> str:
    """A kernel's name without its template arguments and namespace, with its family."""
    base = kernel.split("(")[0]
    family = next((f for f in ("sm90", "sm80", "fallback") if f"::{f}::" in kernel or f"{f}::" in kernel), "")
    name = base.split("<")[0].split("::")[-1].replace("void ", "").strip()
    return f"{name} ({family})" if family else name


def kernels_of(rows: List[Dict[str, str]]) -> List[Tuple[str, Dict[str, float]]]:
    """(kernel name, {metric: value}) per profiled kernel, in launch order."""
    by_id: Dict[str, Tuple[str, Dict[str, float]]] = {}
    for row in rows:
        value = number(row.get("Metric Value", ""))
        name = row.get("Kernel Name") or row.get("Function Name", "")
        entry = by_id.setdefault(row.get("ID", ""), (name, {}))
        if value is not None:
            entry[1][row["Metric Name"]] = value
    return [by_id[i] for i in sorted(by_id, key=lambda s: int(s) if s.isdigit() else 0)]


def stalls(metrics: Dict[str, float]) -> List[Tuple[str, float]]:
    """The stall reasons of a kernel, largest first: (reason, warps stalled per issued instruction)."""
    found = [(m[len(STALL_PREFIX) : -len(STALL_SUFFIX)], v) for m, v in metrics.items()
             if m.startswith(STALL_PREFIX) and m.endswith(STALL_SUFFIX)]  # fmt: skip
    return sorted(found, key=lambda rv: -rv[1])


def fmt(value: Optional[float], unit: str = "") -> str:
    """A table cell."""
    if value is None:
        return "n/a"
    return f"{value:.1f}{unit}" if unit == "%" else f"{value:.3g}"


def markdown(profiled: List[Tuple[str, List[Tuple[str, Dict[str, float]]]]], header: str) -> str:
    """The report: a summary row and the largest stall reasons per kernel, per call."""
    lines = [header, "", "| call | kernel | " + " | ".join(c for c, _ in SUMMARY) + " | largest stall reasons (warps per issue) |",
             "|" + "---|" * (len(SUMMARY) + 3)]  # fmt: skip
    for call, kernels in profiled:
        for name, metrics in kernels:
            cells = []
            for column, metric in SUMMARY:
                value = metrics.get(metric)
                if value is not None:
                    value /= SCALE.get(metric, 1.0)
                cells.append(fmt(value, "%" if ".pct_of_peak_" in metric else ""))
            top = ", ".join(f"{r} {v:.2f}" for r, v in stalls(metrics)[:TOP_STALLS]) or "n/a"
            lines.append(f"| {call} | `{short_name(name)}` | " + " | ".join(cells) + f" | {top} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Profile each call under ncu and write the report; or, as the child, make the call."""
    args = parse_args(argv)
    if args.child:
        return run_child(args)
    ncu = shutil.which(args.ncu)
    if ncu is None:
        print(f"gpu_profile: '{args.ncu}' (Nsight Compute) is not on the PATH: nothing profiled, nothing written")
        return 1
    profiled, raw = [], []
    for call in args.calls:
        cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--csv", "--page", "raw",
               "-k", KERNEL_FILTER, "--metrics", METRICS,
               sys.executable, os.path.abspath(__file__), "--child", call, *shape_flags(args)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        raw.append(f"# {call}: {shlex.join(cmd)}\n{done.stdout}")
        if done.returncode != 0:
            print(done.stdout[-4000:], done.stderr[-4000:], sep="\n")
            print(f"gpu_profile: ncu failed for {call} (exit {done.returncode})")
            return 1
        profiled.append((call, kernels_of(read_csv(done.stdout))))
    import torch

    props = torch.cuda.get_device_properties(0)
    header = (f"# Nsight Compute profile: {props.name}\n\ntorch {torch.__version__}, "
              f"`python3 benchmarks/gpu_profile.py {shlex.join(shape_flags(args) + ['--calls', *args.calls])}`: "
              "one call of each after two "
              "warm-up calls, `ncu --clock-control none --page raw --metrics ...` (the raw CSV beside this "
              "file); percentages of the peak sustained; stall reasons: the average number of warps stalled "
              "for the reason per issued instruction.")  # fmt: skip
    text = markdown(profiled, header)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
        with open(os.path.splitext(args.out)[0] + ".csv", "w") as f:
            f.write("\n".join(raw))
        print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
