"""Records ptxas resource use (registers, shared memory, stack, spills) of every CUDA kernel.

Compiles the device code of each CUDA translation unit (those csrc/cuda/kernels.toml generates, via
scripts/kernel_list.py, and the hand-written csrc/cuda/**/*.cu) for each architecture of TORCH_CUDA_ARCH_LIST
(default "8.0;9.0") with `nvcc -cubin -Xptxas -v` and the flags of the real build (setup.py,
CMakeLists.txt), in parallel and through ccache when available, then writes
results/ptxas/report.md (a table per architecture) and results/ptxas/report.json.

Exits non-zero when a compile fails or warns, or when a kernel that must not spill does: one
whose head-dim bucket (its first integer template argument) is <= 128, or that has none.

    python3 scripts/ptxas_report.py            # --out results/ptxas, -j $(nproc)
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_list  # noqa: E402

ROOT = kernel_list.ROOT
SPILL_FREE_MAX_BUCKET = 128  # kernels for head dims up to this one must not spill
# The nvcc flags of the real build (setup.py's NVCC_FLAGS and what torch.utils.cpp_extension
# adds; CMakeLists.txt's CUDA options), with every warning an error.
NVCC_FLAGS = [
    "-std=c++20", "-O3", "--expt-relaxed-constexpr", "-lineinfo",
    "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__",
    "-Werror=all-warnings", "-Icsrc", "-DNDEBUG",
]


@dataclasses.dataclass
class Kernel:
    """ptxas's numbers for one function (a kernel, or a device function it did not inline)."""

    file: str
    arch: str
    mangled: str
    name: str = ""
    bucket: int | None = None
    entry: bool = False
    registers: int = 0
    smem: int = 0
    stack: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    dynamic_smem: int | None = None  # bytes per block requested at launch (scripts/kernel_smem.cu)

    @property
    def must_not_spill(self) -> bool:
        """True when this function's head-dim bucket is <= 128 or it has none."""
        return self.bucket is None or self.bucket <= SPILL_FREE_MAX_BUCKET

    @property
    def spills(self) -> bool:
        """True when ptxas spilled registers to local memory."""
        return self.spill_stores > 0 or self.spill_loads > 0


def sm_archs(arch_list: str) -> list[str]:
    """'8.0;9.0+PTX' (TORCH_CUDA_ARCH_LIST syntax, ';' or ' ' separated) -> ['sm_80', 'sm_90']."""
    archs = []
    for item in re.split(r"[;\s]+", arch_list.strip()):
        match = re.fullmatch(r"(\d+)\.(\d+)([a-z]?)(\+PTX)?", item)
        if not match:
            raise SystemExit(f"ptxas_report: unknown architecture {item!r} in {arch_list!r}")
        archs.append(f"sm_{match[1]}{match[2]}{match[3]}")
    return list(dict.fromkeys(archs))


def compile_cubin(nvcc: list[str], source: Path, arch: str, out_dir: Path) -> subprocess.CompletedProcess:
    """Compiles the device code of `source` for `arch` in the project root (-Icsrc); ptxas -v
    reports on stderr, which ccache replays on a hit (`-c` keeps the command cacheable)."""
    cubin = out_dir / f"{source.stem}.{arch}.cubin"
    cmd = [*nvcc, *NVCC_FLAGS, f"-arch={arch}", "-c", "-cubin", "-Xptxas", "-v", str(source), "-o", str(cubin)]
    return subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT)


def parse_ptxas(output: str, file: str, arch: str) -> list[Kernel]:
    """Parses `ptxas -v` output: 'Function properties for X' opens a function, 'N bytes stack
    frame, N bytes spill stores, N bytes spill loads' follows, and for kernels
    ('Compiling entry function') 'Used N registers, ..., N bytes smem, ...'."""
    functions: dict[str, Kernel] = {}
    current: Kernel | None = None
    for line in output.splitlines():
        if match := re.search(r"Compiling entry function '([^']+)' for '(\w+)'", line):
            current = functions.setdefault(match[1], Kernel(file, arch, match[1]))
            current.entry = True
        elif match := re.search(r"Function properties for (\S+)", line):
            current = functions.setdefault(match[1], Kernel(file, arch, match[1]))
        elif current is None:
            continue
        elif match := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line):
            current.stack, current.spill_stores, current.spill_loads = map(int, match.groups())
        elif match := re.search(r"Used (\d+) registers", line):
            current.registers = int(match[1])
            smem = re.search(r"(\d+) bytes smem", line)
            current.smem = int(smem[1]) if smem else 0
    return list(functions.values())


def demangle(kernels: list[Kernel]) -> None:
    """Fills in `name` (demangled, without the return type and parameters; cu++filt or
    c++filt) and `bucket` (the first integer template argument) of every kernel."""
    tool = shutil.which("cu++filt") or shutil.which("c++filt")
    mangled = [k.mangled for k in kernels]
    if tool and mangled:
        names = subprocess.run([tool], input="\n".join(mangled), capture_output=True, text=True,
                               check=True).stdout.splitlines()
    else:
        names = mangled
    for kernel, name in zip(kernels, names, strict=True):
        kernel.name = short_name(name)
        kernel.bucket = first_int_template_arg(kernel.name)


def short_name(signature: str) -> str:
    """'void ns::k<__half, 64>(ns::Params)' -> 'ns::k<__half, 64>'."""
    name = signature.removeprefix("void ")
    if name.endswith(")"):
        depth = 0
        for i in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[i], 0)
            if depth == 0:
                return name[:i]
    return name


def first_int_template_arg(name: str) -> int | None:
    """The first integer argument of the outermost template argument list of `name`, if any."""
    start = name.find("<")
    if start < 0:
        return None
    args, depth, arg = [], 0, ""
    for ch in name[start + 1:]:
        if ch in "<([":
            depth += 1
        elif ch in ">)]":
            if depth == 0:
                break
            depth -= 1
        if ch == "," and depth == 0:
            args.append(arg.strip())
            arg = ""
        else:
            arg += ch
    args.append(arg.strip())
    for arg in args:
        if match := re.fullmatch(r"(?:\(\w+\))?(-?\d+)[uUlL]*", arg):
            return int(match[1])
    return None


def dynamic_smem(nvcc: list[str], tmp: Path) -> dict[str, int]:
    """Kernel name -> dynamic shared memory per block, from scripts/kernel_smem.cu (built for the
    host and run: the layouts are constexpr, no GPU is involved)."""
    exe = tmp / "kernel_smem"
    build = subprocess.run([*nvcc, *NVCC_FLAGS, "scripts/kernel_smem.cu", "-o", str(exe)],
                           capture_output=True, text=True, check=False, cwd=ROOT)
    if build.returncode != 0:
        raise SystemExit(f"ptxas_report: scripts/kernel_smem.cu failed:\n{build.stdout}{build.stderr}")
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    return {name: int(size) for name, size in (line.rsplit(" ", 1) for line in out.splitlines())}


def write_report(kernels: list[Kernel], archs: list[str], nvcc_version: str, out: Path) -> None:
    """Writes report.md (a table per architecture, worst cases) and report.json."""
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        "# ptxas resource use of the CUDA kernels",
        "",
        f"Generated by `python3 scripts/ptxas_report.py` ({nvcc_version}; flags: `{' '.join(NVCC_FLAGS)}`).",
        f"Kernels whose head-dim bucket (first integer template argument) is ≤ {SPILL_FREE_MAX_BUCKET}, "
        "or that have none, must not spill; CI fails if they do. Stack and spills are bytes per thread, "
        "static and dynamic shared memory bytes per block (the dynamic size is what the launch requests; "
        "above 48 KB it needs the opt-in of sm_80 and newer: 163 KB on an A100, 227 KB on an H100, "
        "99 KB on sm_86/sm_89).",
    ]
    if not kernels:
        lines += ["", "No kernels: csrc/cuda/ holds no .cu file."]
    for arch in archs:
        rows = [k for k in kernels if k.arch == arch]
        if not rows:
            continue
        lines += ["", f"## {arch}", "",
                  "| kernel | file | head dim | registers | static smem | dynamic smem | stack | spill stores "
                  "| spill loads |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for k in rows:
            flag = " **(must not spill)**" if k.spills and k.must_not_spill else ""
            kind = "" if k.entry else " (device function)"
            bucket = "–" if k.bucket is None else k.bucket
            dyn = "–" if k.dynamic_smem is None else k.dynamic_smem
            lines.append(f"| `{k.name}`{kind}{flag} | {k.file} | {bucket} | {k.registers} | {k.smem} | {dyn} "
                         f"| {k.stack} | {k.spill_stores} | {k.spill_loads} |")
        worst_reg = max(rows, key=lambda k: k.registers)
        worst_spill = max(rows, key=lambda k: k.spill_stores + k.spill_loads)
        spill = (f"{worst_spill.spill_stores} B stores / {worst_spill.spill_loads} B loads (`{worst_spill.name}`)"
                 if worst_spill.spills else "none")
        worst_smem = max(rows, key=lambda k: k.smem + (k.dynamic_smem or 0))
        lines += ["", f"Worst case on {arch}: max registers {worst_reg.registers} (`{worst_reg.name}`), "
                      f"max shared memory {worst_smem.smem + (worst_smem.dynamic_smem or 0)} B per block "
                      f"(`{worst_smem.name}`), max spill {spill}."]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    data = {"nvcc": nvcc_version, "flags": NVCC_FLAGS, "spill_free_max_bucket": SPILL_FREE_MAX_BUCKET,
            "archs": {arch: [dataclasses.asdict(k) for k in kernels if k.arch == arch] for arch in archs}}
    (out / "report.json").write_text(json.dumps(data, indent=1) + "\n")


def cutlass_include() -> str:
    """The CUTLASS/CuTe headers of the installed nvidia-cutlass package (as setup.py finds them)."""
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None:
        raise SystemExit("ptxas_report: nvidia-cutlass is not installed (scripts/setup.sh installs it)")
    return str(Path(spec.submodule_search_locations[0]) / "source" / "include")


def main() -> int:
    """Compiles, parses, writes the report; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch-list", default=os.environ.get("TORCH_CUDA_ARCH_LIST") or "8.0;9.0",
                        help="architectures, TORCH_CUDA_ARCH_LIST syntax (default: $TORCH_CUDA_ARCH_LIST or 8.0;9.0)")
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiles (default: nproc)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "ptxas", help="output directory")
    parser.add_argument("--nvcc", default=os.environ.get("NVCC", "nvcc"), help="nvcc to use (default: $NVCC or nvcc)")
    parser.add_argument("--no-ccache", action="store_true", help="do not compile through ccache")
    args = parser.parse_args()

    archs = sm_archs(args.arch_list)
    if shutil.which(args.nvcc) is None:
        print(f"ptxas_report: {args.nvcc} not found", file=sys.stderr)
        return 1
    nvcc = [args.nvcc]
    if not args.no_ccache and (ccache := shutil.which("ccache")):
        nvcc.insert(0, ccache)
    nvcc_version = subprocess.run([args.nvcc, "--version"], capture_output=True, text=True,
                                  check=True).stdout.strip().splitlines()[-2].strip()
    generated = kernel_list.translation_units()
    sources = sorted(set(generated) | set((ROOT / "csrc" / "cuda").rglob("*.cu")))
    if stray := [p for p in sources if p.parent.name == "instantiations" and p not in generated]:
        print(f"ptxas_report: not generated from csrc/cuda/kernels.toml: {stray}", file=sys.stderr)
        return 1
    NVCC_FLAGS.extend(["-isystem", cutlass_include()])
    jobs = [(source, arch) for source in sources for arch in archs]

    failed, kernels = [], []
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max(1, args.jobs)) as pool:
        results = pool.map(lambda job: (*job, compile_cubin(nvcc, *job, Path(tmp))), jobs)
        smem = dynamic_smem(nvcc, Path(tmp)) if sources else {}
        for source, arch, proc in tqdm(results, total=len(jobs), desc="ptxas", unit="compile", disable=None):
            rel = source.relative_to(ROOT).as_posix()
            # -Werror=all-warnings turns nvcc's warnings into errors; ptxas's are caught here.
            warnings = [line for line in proc.stderr.splitlines() if re.search(r"\bwarning\b", line, re.IGNORECASE)]
            if proc.returncode != 0 or warnings:
                failed.append(rel)
                tqdm.write(f"ptxas_report: {rel} ({arch}) failed (exit code {proc.returncode}):\n"
                           f"{proc.stdout}{proc.stderr}", file=sys.stderr)
            kernels += parse_ptxas(proc.stderr, rel, arch)
    demangle(kernels)
    for k in kernels:
        k.dynamic_smem = smem.get(k.name)
    kernels.sort(key=lambda k: (k.arch, k.file, not k.entry, k.name))
    write_report(kernels, archs, nvcc_version, args.out)

    spilling = [k for k in kernels if k.spills and k.must_not_spill]
    for k in spilling:
        print(f"ptxas_report: {k.name} ({k.file}, {k.arch}) spills {k.spill_stores} B stores / "
              f"{k.spill_loads} B loads; head-dim bucket {k.bucket} must not spill", file=sys.stderr)
    print(f"ptxas_report: {len(sources)} files x {len(archs)} archs, {sum(k.entry for k in kernels)} kernels, "
          f"{len(failed)} failed compiles, {len(spilling)} spilling kernels that must not; "
          f"wrote {args.out}/report.md and report.json")
    return 1 if failed or spilling else 0


if __name__ == "__main__":
    sys.exit(main())
