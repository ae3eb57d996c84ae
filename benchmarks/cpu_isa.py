"""How the CPU headline point depends on the instruction set: runs it in fresh processes with
oneDNN (our block products, via ATen's brgemm) and ATen's own kernels (SDPA's flash kernel) capped
at AVX2 or not, and prints a Markdown table.

    python3 benchmarks/cpu_isa.py [--reps 5]

The caps are oneDNN's ONEDNN_MAX_CPU_ISA and ATen's ATEN_CPU_CAPABILITY, read once at start-up,
hence one process per setting. MKL (SDPA's matrix products, and ours where oneDNN lacks AVX-512) is
left as it is: on AMD CPUs it runs its AVX2 code either way. Our per-row loops pick their ISA by GCC function multiversioning and are
not capped, so the AVX2 rows measure the products' share of the difference.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS))
from timing import cpu_name, positive_int  # noqa: E402  (benchmarks/timing.py; the children import its fastest_ms)

POINT = dict(B=2, H=8, L=4096, D=64)

CHILD = r"""
import json, sys, torch, torch_ext
import torch.nn.functional as F
from timing import fastest_ms
reps = int(sys.argv[1])
torch.manual_seed(0)
B, H, L, D = 2, 8, 4096, 64
q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
ours = fastest_ms(lambda: torch_ext.attention(q, k, v), reps)
sdpa = fastest_ms(lambda: F.scaled_dot_product_attention(q, k, v), reps)
print(json.dumps({"ours_ms": ours, "sdpa_ms": sdpa, "aten_isa": torch.backends.cpu.get_cpu_capability()}))
"""

# Without AVX-512 for oneDNN the float products go through MKL (csrc/cpu/block_gemm.cpp); the last
# row forces brgemm there, the choice the kernels made before.
SETTINGS = [
    ("native (brgemm, AVX-512)", {}),
    ("oneDNN capped at AVX2 (MKL chosen)", {"ONEDNN_MAX_CPU_ISA": "AVX2"}),
    ("oneDNN and ATen capped at AVX2 (MKL chosen)", {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}),
    ("oneDNN capped at AVX2, brgemm forced", {"ONEDNN_MAX_CPU_ISA": "AVX2", "ENTROPY_ATTN_CPU_GEMM": "brgemm"}),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=positive_int, default=5)
    args = ap.parse_args()
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    print(f"{cpu_name()}, avx512f: {'avx512f' in flags}, {os.cpu_count()} CPUs; float32 "
          f"B={POINT['B']} H={POINT['H']} L={POINT['L']} D={POINT['D']}, best of {args.reps}\n")
    print("| setting | ATen ISA | ours (ms) | SDPA (ms) | ours / SDPA |")
    print("|---|---|---:|---:|---:|")
    for name, env in SETTINGS:
        path = os.pathsep.join(filter(None, [str(BENCHMARKS), os.environ.get("PYTHONPATH")]))
        out = subprocess.run([sys.executable, "-c", CHILD, str(args.reps)], env={**os.environ, "PYTHONPATH": path, **env},
                             capture_output=True, text=True, check=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(f"| {name} | {r['aten_isa']} | {r['ours_ms']:.0f} | {r['sdpa_ms']:.0f} | "
              f"{r['ours_ms'] / r['sdpa_ms']:.2f} |")


if __name__ == "__main__":
    main()
