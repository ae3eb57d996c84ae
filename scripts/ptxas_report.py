"""Records the resource use (registers, shared memory, stack, local memory) of every CUDA kernel
of the built extension, as ptxas assigned it.

Reads `cuobjdump -res-usage` of `torch_ext/_C*.so` (the machine code the build produced, for each
architecture of TORCH_CUDA_ARCH_LIST, with the build's flags: nothing is compiled again, so CI
compiles every configuration once) and writes results/ptxas/report.md (a table per architecture)
and results/ptxas/report.json. The dynamic shared memory per block comes from
scripts/kernel_smem.cu (host-only). The build itself fails on any ptxas warning (-Xptxas -Werror
with ENTROPY_ATTN_WERROR=1).

Exits non-zero when a kernel that must not spill uses local memory (spilled registers or stack
arrays): one of the tensor-core families (sm80, sm90), or one whose head-dim bucket (its first
integer template argument) is <= 128, or that has none; or when a translation unit csrc/cuda/kernels.toml generates (scripts/kernel_list.py) is
missing from the library.

    python3 scripts/ptxas_report.py            # --out results/ptxas
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_list  # noqa: E402

ROOT = kernel_list.ROOT
SPILL_FREE_MAX_BUCKET = 128  # the fallback's kernels for head dims up to this one must not spill
# The tensor-core families (every family kernels.toml lists but the fallback): their kernels must not
# spill at any head dim.
TENSOR_CORE_FAMILIES = tuple(family for family in kernel_list.load() if family != "fallback")
# The nvcc flags of the real build (setup.py's NVCC_FLAGS and what torch.utils.cpp_extension
# adds; CMakeLists.txt's CUDA options), for the host-only scripts/kernel_smem.cu.
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
    local: int = 0  # bytes of local memory per thread: spilled registers or stack arrays
    dynamic_smem: int | None = None  # bytes per block requested at launch (scripts/kernel_smem.cu)

    @property
    def must_not_spill(self) -> bool:
        """True when this function is a tensor-core family's (sm80, sm90: every head dim), or its
        head-dim bucket is <= 128, or it has none."""
        tensor_core = any(f"::{family}::" in self.name for family in TENSOR_CORE_FAMILIES)
        return tensor_core or self.bucket is None or self.bucket <= SPILL_FREE_MAX_BUCKET

    @property
    def spills(self) -> bool:
        """True when the kernel uses local memory: a stack frame (where ptxas spills registers) or
        local arrays."""
        return self.stack > 0 or self.local > 0


def resource_usage(cuobjdump: str, lib: Path) -> list[Kernel]:
    """Parses `cuobjdump -res-usage`: 'arch = sm_80' and 'identifier = <source>' open a cubin,
    ' Function <mangled>:' a function, whose next line holds 'REG:n STACK:n SHARED:n LOCAL:n'."""
    out = subprocess.run([cuobjdump, "-res-usage", str(lib)], capture_output=True, text=True, check=True).stdout
    kernels: list[Kernel] = []
    arch, file, current = "", "", None
    for line in out.splitlines():
        if match := re.match(r"\s*arch = (sm_\w+)", line):
            arch = match[1]
        elif match := re.match(r"\s*identifier = (\S+)", line):
            # The source path as the build passed it (relative or absolute): from csrc/ on.
            file = re.sub(r"^.*?(?=csrc/)", "", match[1])
        elif match := re.match(r"\s*Function (\S+):", line):
            current = Kernel(file, arch, match[1], entry=True)
            kernels.append(current)
        elif current is not None and (match := re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", line)):
            current.registers, current.stack, current.smem, current.local = map(int, match.groups())
            current = None
    return kernels


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
    # A traits type as the first argument (the tensor-core family): its first integer argument.
    match = re.search(r"<[^<>]*?,\s*(\d+)\s*[,>]", name)
    return int(match[1]) if match else None


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


def write_report(kernels: list[Kernel], archs: list[str], source: str, out: Path) -> None:
    """Writes report.md (a table per architecture, worst cases) and report.json."""
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Resource use of the CUDA kernels",
        "",
        f"Generated by `python3 scripts/ptxas_report.py` from `cuobjdump -res-usage` of {source}: what ptxas "
        "assigned in the build itself. "
        "The tensor-core families' kernels (sm80, sm90), and the others whose head-dim bucket (first integer "
        f"template argument) is ≤ {SPILL_FREE_MAX_BUCKET} or that have none, must not use local memory (spilled registers or stack arrays); CI fails if they "
        "do. Stack and local memory are bytes per thread, static and dynamic shared memory bytes per block "
        "(the dynamic size is what the launch requests, known for the fallback's kernels; above 48 KB it "
        "needs the opt-in of sm_80 and newer: 163 KB on an A100, 227 KB on an H100, 99 KB on sm_86/sm_89).",
    ]
    if not kernels:
        lines += ["", "No kernels: the library has no CUDA code."]
    for arch in archs:
        rows = [k for k in kernels if k.arch == arch]
        if not rows:
            continue
        lines += ["", f"## {arch}", "",
                  "| kernel | file | head dim | registers | static smem | dynamic smem | stack | local |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]
        for k in rows:
            flag = " **(must not use local memory)**" if k.spills and k.must_not_spill else ""
            bucket = "–" if k.bucket is None else k.bucket
            dyn = "–" if k.dynamic_smem is None else k.dynamic_smem
            lines.append(f"| `{k.name}`{flag} | {k.file} | {bucket} | {k.registers} | {k.smem} | {dyn} "
                         f"| {k.stack} | {k.local} |")
        worst_reg = max(rows, key=lambda k: k.registers)
        worst_local = max(rows, key=lambda k: k.stack + k.local)
        local = (f"{worst_local.stack} B stack + {worst_local.local} B local (`{worst_local.name}`)"
                 if worst_local.spills else "none")
        worst_smem = max(rows, key=lambda k: k.smem + (k.dynamic_smem or 0))
        lines += ["", f"Worst case on {arch}: max registers {worst_reg.registers} (`{worst_reg.name}`), "
                      f"max shared memory {worst_smem.smem + (worst_smem.dynamic_smem or 0)} B per block "
                      f"(`{worst_smem.name}`), max local memory {local}."]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    data = {"source": source, "spill_free_max_bucket": SPILL_FREE_MAX_BUCKET,
            "archs": {arch: [dataclasses.asdict(k) for k in kernels if k.arch == arch] for arch in archs}}
    (out / "report.json").write_text(json.dumps(data, indent=1) + "\n")


def cuobjdump() -> str:
    """cuobjdump: on PATH, else from the nvidia-cuda-cuobjdump wheel (scripts/setup.sh installs it)."""
    if found := shutil.which("cuobjdump"):
        return found
    spec = importlib.util.find_spec("nvidia")
    for base in spec.submodule_search_locations if spec else []:
        for candidate in Path(base).glob("cu*/bin/cuobjdump"):
            return str(candidate)
    raise SystemExit("ptxas_report: cuobjdump not found (scripts/setup.sh installs nvidia-cuda-cuobjdump)")


def main() -> int:
    """Reads the library's resource use, writes the report; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lib", type=Path, help="the extension library (default: torch_ext/_C*.so)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "ptxas", help="output directory")
    parser.add_argument("--nvcc", default=os.environ.get("NVCC", "nvcc"), help="nvcc for scripts/kernel_smem.cu")
    args = parser.parse_args()
    lib = args.lib or next(iter(sorted((ROOT / "torch_ext").glob("_C*.so"))), None)
    if lib is None or not lib.exists():
        print("ptxas_report: no torch_ext/_C*.so: build the extension first (scripts/setup.sh)", file=sys.stderr)
        return 1
    kernels = resource_usage(cuobjdump(), lib)
    demangle(kernels)
    archs = sorted({k.arch for k in kernels})
    files = {k.file for k in kernels}
    # (The units of instantiations compiled on request only where the build has them: its
    # _build_info.py, beside the library.)
    untested = kernel_list.built_with_untested_kernels(lib.parent / "_build_info.py")
    missing = [p.relative_to(ROOT).as_posix() for p in kernel_list.translation_units(untested)
               if p.relative_to(ROOT).as_posix() not in files]
    for rel in missing:
        print(f"ptxas_report: {rel} (csrc/cuda/kernels.toml) has no code in {lib.name}", file=sys.stderr)
    if shutil.which(args.nvcc) and kernels:
        with tempfile.TemporaryDirectory() as tmp:
            smem = dynamic_smem([args.nvcc], Path(tmp))
        for k in kernels:
            k.dynamic_smem = smem.get(k.name)
    kernels.sort(key=lambda k: (k.arch, k.file, k.name))
    source = f"`torch_ext/{lib.name}`" if lib.parent == ROOT / "torch_ext" else f"`{lib}`"
    source += f" ({'with' if untested else 'without'} the kernels compiled on request: csrc/cuda/untested_kernels.h)"
    write_report(kernels, archs, source, args.out)
    spilling = [k for k in kernels if k.spills and k.must_not_spill]
    for k in spilling:
        print(f"ptxas_report: {k.name} ({k.file}, {k.arch}) uses {k.stack} B of stack and {k.local} B of "
              "local memory per thread; "
              f"head-dim bucket {k.bucket} must not", file=sys.stderr)
    print(f"ptxas_report: {len(files)} translation units x {len(archs)} archs, {len(kernels)} kernels, "
          f"{len(missing)} missing units, {len(spilling)} kernels using local memory that must not; "
          f"wrote {args.out}/report.md and report.json")
    return 1 if missing or spilling else 0


if __name__ == "__main__":
    sys.exit(main())
