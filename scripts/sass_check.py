"""Static SASS gate of the tensor-core families: reads the machine code of the built extension.

For every architecture in the built `torch_ext/_C*.so` (cuobjdump -sass), checks that the kernels
of the sm80 family (namespace entropy_attn::cuda::sm80) are built the way the fastest attention
kernels are:
  * forward kernels: tensor-core MMA (HMMA.16816.F32.BF16 for bf16, HMMA.16816.F32 for fp16),
    ldmatrix (LDSM),
    16-byte asynchronous copies (LDGSTS), exp2 on the special-function unit (MUFU.EX2);
  * backward main and dq kernels: HMMA, LDSM, LDGSTS; the main kernel also accumulates dQ with
    reductions (RED or ATOM);
  * every kernel of the family: no local memory (LDL/STL: register spills or stack arrays).
When the Hopper family (entropy_attn::cuda::sm90, built for sm_90a alone) is in the build, each of
its forward kernels must use wgmma (HGMMA, and no HMMA), TMA loads (UTMALDG) completing on
mbarriers (SYNCS), setmaxnreg (USETMAXREG), exp2 on the special-function unit (MUFU.EX2), no
local memory, and wgmma kept asynchronous (at most half of its HGMMA close a wgmma group: where
ptxas serializes wgmma, each closes its own); its masked forward kernels also copy the mask tile with asynchronous copies
(LDGSTS); its backward main kernels use HGMMA, UTMALDG, SYNCS, USETMAXREG, MUFU.EX2 and
accumulate dQ with reductions (RED or ATOM), or, in the kernels for bulk reductions (the unmasked
calls' second main kernel, kBulkDq: sm90/bwd_kernel.cuh), with bulk reductions from shared
memory (UBLKRED).
Each kernel instantiation of csrc/cuda/kernels.toml's [sm80] must be present for each architecture
but the targets of families restricted to one (`gencode`), each of [sm90] for its target. Writes
results/sass/report.md; exits 1 on any violation.

    python3 scripts/sass_check.py                  # the extension built in place (torch_ext/)
    python3 scripts/sass_check.py --lib path/to/_C.so
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_list  # noqa: E402

ROOT = kernel_list.ROOT
FAMILIES = ("sm80", "sm90")  # the families this gate inspects, by namespace entropy_attn::cuda::<family>


def family_of(name: str) -> str | None:
    """The checked family a demangled function belongs to, if any."""
    return next((f for f in FAMILIES if name.startswith(f"entropy_attn::cuda::{f}::")), None)


def tool(name: str) -> str:
    """cuobjdump / nvdisasm / c++filt: on PATH, else from the nvidia-cuda-* wheels."""
    if found := shutil.which(name):
        return found
    spec = importlib.util.find_spec("nvidia")
    for base in spec.submodule_search_locations if spec else []:
        for candidate in Path(base).glob(f"cu*/bin/{name}"):
            return str(candidate)
    raise SystemExit(f"sass_check: {name} not found (scripts/setup.sh installs nvidia-cuda-cuobjdump)")


def library(path: str | None) -> Path:
    """The extension's shared library."""
    if path:
        return Path(path)
    libs = sorted((ROOT / "torch_ext").glob("_C*.so"))
    if not libs:
        raise SystemExit("sass_check: no torch_ext/_C*.so: build the extension first (scripts/setup.sh)")
    return libs[0]


def architectures(lib: Path) -> set[str]:
    """The base architectures (sm_XY) a library has machine code for (sm_90a's counts as sm_90)."""
    elves = subprocess.run([tool("cuobjdump"), "-lelf", str(lib)], capture_output=True, text=True, check=True).stdout
    return {m[1] for m in re.finditer(r"\.(sm_\d+)a?\.cubin", elves)}


def disassemble(lib: Path) -> dict[tuple[str, str], collections.Counter]:
    """(arch, mangled function) -> counts of instruction mnemonics (with their modifiers).

    One cuobjdump per base architecture, run concurrently (`-arch sm_90` also dumps the sm_90a
    code): disassembling the whole library is most of this script's time."""
    env = {"PATH": f"{Path(tool('nvdisasm')).parent}:{Path(tool('cuobjdump')).parent}:/usr/bin:/bin"}
    bases = sorted(architectures(lib))

    def sass(arch: str) -> str:
        return subprocess.run([tool("cuobjdump"), "-sass", "-arch", arch, str(lib)], capture_output=True, text=True,
                              check=True, env=env).stdout

    with concurrent.futures.ThreadPoolExecutor(max(1, len(bases))) as pool:
        out = "\n".join(pool.map(sass, bases))
    functions: dict[tuple[str, str], collections.Counter] = {}
    arch, current = "", None
    for line in out.splitlines():
        if m := re.match(r"\s*arch = (sm_\w+)", line):
            arch = m[1]
        elif m := re.match(r"\s*Function : (\S+)", line):
            current = functions.setdefault((arch, m[1]), collections.Counter())
        elif current is not None and (m := re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)):
            current[m[1]] += 1
            if m[1].startswith("HGMMA") and "gsb0" in line:
                current[GROUP_ENDS] += 1
    return functions


def demangle(names: list[str]) -> dict[str, str]:
    """Mangled -> demangled names (c++filt)."""
    out = subprocess.run([tool("c++filt")], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    return {m: d.removeprefix("void ") for m, d in zip(names, out.splitlines())}


def has(counts: collections.Counter, prefix: str) -> int:
    """Instructions whose mnemonic starts with prefix."""
    return sum(n for op, n in counts.items() if op.startswith(prefix))


def kernel_kind(name: str) -> str:
    """'forward', 'backward' (the main kernel over key blocks), 'dq' or 'other', from the name."""
    for kind, pattern in (("forward", r"::forward_kernel<"), ("backward", r"::main_kernel<"), ("dq", r"::dq_kernel<")):
        if re.search(pattern, name):
            return kind
    return "other"


# The sm90 backward main kernels' last template argument, kBulkDq (sm90/bwd_kernel.cuh: kernel_for):
# dQ by bulk reductions from shared memory rather than atomics.
SM90_BULK_DQ = re.compile(r"main_kernel<.*, (true|false), \(entropy_attn::MaskKind\)\d, true>")
SM90_BULK_FLAG = re.compile(r"(main_kernel<.*\(entropy_attn::MaskKind\)\d), (?:true|false)>")


# The HGMMA that close a wgmma group (`gsb0` in their operands: the last of a batch, which a
# WARPGROUP.DEPBAR waits for), counted under this key beside the mnemonics. Where ptxas serializes
# wgmma (its "Potential Performance Loss: wgmma.mma_async instructions are serialized" note, C7510-
# C7515: accumulators it cannot keep in flight, a call inside the batch), every HGMMA closes a group
# of its own and is waited for at once: the tensor cores then idle between the k-steps of every
# product. A note, not a warning: -Xptxas -Werror lets it pass. In these kernels a batch is 4 to 8
# k-steps (12-21% of the HGMMA close a group).
GROUP_ENDS = "gsb0 HGMMA"


def wgmma_serialized(counts: collections.Counter) -> str | None:
    """A violation where more than half of a function's HGMMA close a wgmma group of their own."""
    hgmma, ends = has(counts, "HGMMA"), counts.get(GROUP_ENDS, 0)
    if hgmma and 2 * ends > hgmma:
        return f"wgmma serialized: {ends} of {hgmma} HGMMA close a group of their own"
    return None


def check_sm90(name: str, counts: collections.Counter) -> list[str]:
    """Violations of one sm90-family function (local memory already counted)."""
    kind = kernel_kind(name)
    if kind not in ("forward", "backward"):
        return []
    serialized = wgmma_serialized(counts)
    needs = ["HGMMA", "UTMALDG", "SYNCS", "USETMAXREG", "MUFU.EX2"]
    if kind == "forward" and re.search(r"\(entropy_attn::MaskKind\)[12]", name):  # the mask tile
        needs.append("LDGSTS")
    problems = [f"no {op}" for op in needs if not has(counts, op)]
    if kind == "backward" and SM90_BULK_DQ.search(name):
        if not has(counts, "UBLKRED"):
            problems.append("no UBLKRED for the dQ bulk reductions")
    elif kind == "backward" and not (has(counts, "RED") or has(counts, "ATOM")):
        problems.append("no RED/ATOM for the dQ accumulation")
    problems += [serialized] if serialized else []
    return problems + ([f"HMMA ({has(counts, 'HMMA')})"] if has(counts, "HMMA") else [])


def check(name: str, counts: collections.Counter) -> list[str]:
    """Violations of one function of a checked family."""
    problems = [f"{op} ({has(counts, op)})" for op in ("LDL", "STL") if has(counts, op)]
    if family_of(name) == "sm90":
        return problems + check_sm90(name, counts)
    # The MMA of the input type: HMMA.16816.F32.BF16 for bf16; fp16 is the default input type,
    # spelled HMMA.16816.F32 with no suffix.
    bf16 = "bfloat16" in name
    mma = "HMMA.16816.F32.BF16" if bf16 else "HMMA.16816.F32"
    needs: list[str] = []
    kind = kernel_kind(name)
    if kind in ("forward", "backward", "dq") and not counts.get(mma):
        problems.append(f"no {mma}")
    if kind == "forward":
        needs = ["LDSM", "LDGSTS", "MUFU.EX2"]
    elif kind in ("backward", "dq"):
        needs = ["LDSM", "LDGSTS"]
        if kind == "backward" and not (has(counts, "RED") or has(counts, "ATOM")):
            problems.append("no RED/ATOM for the dQ accumulation")
    problems += [f"no {op}" for op in needs if not has(counts, op)]
    return problems


def main() -> int:
    """Disassembles, checks, writes the report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lib", help="the extension library (default: torch_ext/_C*.so)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "sass", help="output directory")
    args = parser.parse_args()
    lib = library(args.lib)
    functions = disassemble(lib)
    names = demangle(sorted({name for _, name in functions}))
    family = {key: counts for key, counts in functions.items() if family_of(names[key[1]])}
    archs = sorted({arch for arch, _ in functions})
    failures: list[str] = []
    rows = []
    for (arch, mangled), counts in sorted(family.items(), key=lambda kv: (kv[0][0], names[kv[0][1]])):
        name = names[mangled]
        problems = check(name, counts)
        failures += [f"{arch} {name}: {p}" for p in problems]
        rows.append((arch, name, counts, problems))
    # Every listed instantiation is there, for every architecture it is built for: a family
    # restricted to one target (kernels.toml `gencode`) for that one, the others for the rest; those
    # compiled on request where the build has them (its _build_info.py, beside the library).
    untested = kernel_list.built_with_untested_kernels(lib.parent / "_build_info.py")
    listed = {fam: [i for i in insts if untested or not i.on_request] for fam, insts in kernel_list.load().items()}
    targets = {f: re.search(r"code=(sm_\w+)", g)[1] for f, g in kernel_list.gencodes().items()}
    for fam in FAMILIES:
        expected = listed.get(fam, [])
        if not expected:
            continue
        fam_archs = [targets[fam]] if fam in targets else [a for a in archs if a not in targets.values()]
        for arch in fam_archs:
            kernels = [names[m] for a, m in family if a == arch and family_of(names[m]) == fam]
            fwd = [k for k in kernels if kernel_kind(k) == "forward"]
            # One instantiation may launch main kernels of several tiles: the sm80 backward's full and
            # compact ones (BwdTraits<T, D, kCompact, Ops>; sm80/launch.h: backward_compact), and the
            # sm90 backward's with and without bulk reductions (kBulkDq).
            main_kernels = {SM90_BULK_FLAG.sub(r"\1>", re.sub(r"(BwdTraits<[^,<>]+, \d+), (?:true|false)\b", r"\1", k))
                            for k in kernels if kernel_kind(k) == "backward"}
            n_fwd = sum(i.direction == "forward" for i in expected)
            n_bwd = sum(i.direction == "backward" for i in expected)
            if len(fwd) != n_fwd or len(main_kernels) != n_bwd:
                failures.append(f"{arch}: {len(fwd)} {fam} forward and {len(main_kernels)} backward main kernels, "
                                f"kernels.toml lists {n_fwd} and {n_bwd}")
    args.out.mkdir(parents=True, exist_ok=True)
    cols = ["HMMA", "LDSM", "LDGSTS", "HGMMA", "UTMALDG", "SYNCS", "USETMAXREG", "MUFU.EX2", "RED", "ATOM",
            "UBLKRED", "LDL", "STL"]
    lines = [f"SASS of the tensor-core families in `{lib.relative_to(ROOT) if lib.is_relative_to(ROOT) else lib}` "
             f"({', '.join(archs)}; {'with' if untested else 'without'} the kernels compiled on request: "
             "csrc/cuda/untested_kernels.h): instruction counts per kernel (`scripts/sass_check.py`).", "",
             "| arch | kernel | " + " | ".join(cols) + " | verdict |", "|---" * (len(cols) + 3) + "|"]
    for arch, name, counts, problems in rows:
        short = re.sub(r"cute::|entropy_attn::cuda::(sm[89]0::)?", "", name)
        lines.append(f"| {arch} | `{short}` | " + " | ".join(str(has(counts, c)) for c in cols)
                     + f" | {'; '.join(problems) or 'ok'} |")
    if not rows:
        lines.append("| – | no kernel of a tensor-core family in this build | " + " | ".join("–" for _ in cols) + " | – |")
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
    for f in failures:
        print(f"sass_check: {f}", file=sys.stderr)
    print(f"sass_check: {len(rows)} tensor-core-family kernels over {len(archs)} architectures, {len(failures)} "
          f"violations; wrote {args.out}/report.md")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
