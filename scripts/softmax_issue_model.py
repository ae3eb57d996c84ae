"""A static model of how long one warp takes to issue the sm90 forward's softmax of one key block.

The Hopper forward hides one consumer warpgroup's softmax behind the other's matrix products
(csrc/cuda/sm90/fwd_kernel.cuh): where the softmax takes longer than the products, the tensor cores
wait. A warp issues its instructions in order, one per cycle at most, each once its operands are
ready and its pipe is free. This script replays the machine code of the softmax of a block with
no hidden key (the path of every interior block) under that rule, for one warp alone on its
SMSP, with these numbers (cycles; Hopper, from the CUDA programming guide's throughput table and
published microbenchmarks):

    pipe   instructions                           latency   one warp instruction occupies it
    fma    FFMA FADD FMUL                          4         1 (32 FP32 lanes per SMSP)
    fmah   IMAD MOV                                4         2
    alu    FMNMX FSEL FSETP ISETP LOP3 IADD3 ...   4         2 (16 lanes per SMSP)
    alu    F2FP                                    5         2
    mufu   MUFU.EX2                                18        8 (16 results per cycle per SM)
    shfl   SHFL                                    24        2

It is a model, not a measurement: other warps on the SMSP use the cycles this one waits, and the
latencies are estimates. What it shows is where the code makes a warp wait, and how a change of
the source moves that; a GPU says what the time does.

    python3 scripts/softmax_issue_model.py torch_ext/_C.abi3.so             # one build
    python3 scripts/softmax_issue_model.py /tmp/before.so torch_ext/_C.abi3.so   # two builds

prints a Markdown table: per bf16 forward instantiation without a mask (head dim, causal,
statistics), the instructions of that softmax path, its MUFU.EX2 and the modelled cycles.

With --backward it replays the sm90 backward instead (bf16, no mask, dq by bulk reductions): per
head dim, causal, and loop (a loss of the output alone, or with the statistics' gradients, whose
loop keeps the logits: the one with more FFMA), one query block along its shortest path, which is
a block that needs no per-score check (the longer alternatives check each score against its row's
keys, or search packed documents). The replay counts the warp's own issue only: the waits for the
tensor cores and the barriers are not in it.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sass_check import tool  # noqa: E402

Instruction = tuple[int, str]  # (address, text without the trailing ';')

# pipe, latency, cycles a warp instruction occupies the pipe
ALU_OPS = {"FMNMX", "FSEL", "FSETP", "ISETP", "LOP3", "IADD3", "SEL", "PLOP3", "SHF", "LEA", "PRMT",
           "VIADD", "P2R", "R2P"}


def pipe_of(opcode: str) -> tuple[str, int, int]:
    """The pipe, latency and occupancy of an opcode (see the module's table)."""
    base = opcode.split(".")[0]
    if base == "MUFU":
        return "mufu", 18, 8
    if base == "SHFL":
        return "shfl", 24, 2
    if base in ("FFMA", "FADD", "FMUL"):
        return "fma", 4, 1
    if base in ("IMAD", "MOV"):
        return "fmah", 4, 2
    if base == "F2FP":
        return "alu", 5, 2
    if base in ALU_OPS:
        return "alu", 4, 2
    if base.startswith("U") or base in ("R2UR", "S2UR"):
        return "uniform", 2, 1
    return "other", 4, 1


def opcode(text: str) -> str:
    """The opcode of an instruction, without its predicate guard."""
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]


def parse_functions(sass: str) -> dict[str, list[Instruction]]:
    """Mangled function -> its instructions with their addresses, from cuobjdump -sass output
    (sass_diff.parse drops the addresses, which the branches here are followed by)."""
    found: dict[str, list[Instruction]] = {}
    current: list[Instruction] | None = None
    for line in sass.splitlines():
        if m := re.match(r"\s*Function : (\S+)", line):
            current = found.setdefault(m[1], [])
        elif current is not None and (m := re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)):
            current.append((int(m[1], 16), m[2].strip()))
    return found


def branch_target(text: str) -> int | None:
    m = re.search(r"BRA\s+(?:\S+\s+)?0x([0-9a-f]+)", text)
    return int(m[1], 16) if m else None


def main_loop(code: list[Instruction]) -> list[Instruction]:
    """The smallest loop that holds both products of a key block: S = Q K^T (wgmma, both operands
    in shared memory) and P V (P from registers, V^T transposed: `.tnspB`)."""
    index = {a: i for i, (a, _) in enumerate(code)}
    best: list[Instruction] | None = None
    for i, (a, text) in enumerate(code):
        target = branch_target(text)
        if target is None or target >= a or target not in index:
            continue
        body = code[index[target]:i + 1]
        ss = any("HGMMA" in t and "tnspB" not in t for _, t in body)
        rs = any("HGMMA" in t and "tnspB" in t for _, t in body)
        if ss and rs and (best is None or len(body) < len(best)):
            best = body
    if best is None:
        raise ValueError("no loop with both products")
    return best


def folded_softmax(loop: list[Instruction]) -> list[Instruction]:
    """The softmax of a block with no hidden key: the straight-line run of the loop (across short
    forward branches, such as the skip of the row state's rescale while it is empty) with the
    most exponentials and no per-column range checks."""
    index = {a: i for i, (a, _) in enumerate(loop)}
    runs: list[list[Instruction]] = [[]]
    for i, (a, text) in enumerate(loop):
        runs[-1].append((a, text))
        target = branch_target(text)
        if target is not None:
            short = text.startswith("@") and target in index and 0 < index[target] - i <= 40
            if not short:
                runs.append([])

    def rank(run: list[Instruction]) -> tuple[bool, int]:
        ops = collections.Counter(opcode(t) for _, t in run)
        checks = sum(n for op, n in ops.items() if op.startswith("ISETP"))
        return ops["MUFU.EX2"] >= 60 and checks < 8, ops["MUFU.EX2"]

    return max(runs, key=rank)


def registers(operand: str) -> list[str]:
    return re.findall(r"\b(R\d+|P\d+)\b", operand)


@dataclass
class Replay:
    cycles: int
    waits: collections.Counter  # cycles without an issue, by reason ("dep:MUFU", "pipe:mufu", ...)


def writes(op: str) -> int:
    """How many of an instruction's leading operands it writes."""
    if op.startswith(("STG", "STS", "SYNCS", "BAR", "WARPGROUP", "HGMMA", "RED", "ATOM")):
        return 0
    return 2 if op.startswith(("FSETP", "ISETP", "SHFL")) else 1


def decode_operands(text: str, writes_of=writes) -> tuple[str, list[str], list[str], list[str]]:
    """An instruction's opcode, its operands, the registers it writes (its first writes_of(opcode)
    operands) and those it reads (the rest, and its guard predicate)."""
    op = opcode(text)
    guard = re.match(r"^@!?(P\d)", text)
    body = re.sub(r"^@!?U?P\w+\s+", "", text)[len(op):]
    operands = [o.strip() for o in body.split(",")] if body.strip() else []
    n = writes_of(op)
    dst = [r for o in operands[:n] for r in registers(o)]
    src = [r for o in operands[n:] for r in registers(o)] + ([guard[1]] if guard else [])
    return op, operands, dst, src


def sass_functions(binary: Path) -> dict[str, list[Instruction]]:
    """The sm_90 functions of a built library, kernel harness or object file (cuobjdump)."""
    sass = subprocess.run([tool("cuobjdump"), "-sass", "-arch", "sm_90", str(binary)], capture_output=True,
                          text=True, check=True).stdout
    return parse_functions(sass)


def replay(code: list[Instruction]) -> Replay:
    """Issues `code` in order under the model: the cycle after the last result is ready. Branches
    fall through (an interior block runs the row state's rescale)."""
    ready: dict[str, int] = collections.defaultdict(int)
    producer: dict[str, str] = {}
    pipe_free: dict[str, int] = collections.defaultdict(int)
    waits: collections.Counter = collections.Counter()
    last = -1
    for _, text in code:
        op = opcode(text)
        if op in ("BRA", "BSSY", "BSYNC", "NOP"):
            continue
        _, _, dst, src = decode_operands(text, writes)
        pipe, latency, occupancy = pipe_of(op)
        dep = max(src, key=lambda r: ready[r], default=None)
        operands_ready = ready[dep] if dep else 0
        start = max(last + 1, operands_ready, pipe_free[pipe])
        if start > last + 1:
            reason = f"dep:{producer.get(dep, '?')}" if start == operands_ready else f"pipe:{pipe}"
            waits[reason] += start - last - 1
        last = start
        pipe_free[pipe] = start + occupancy
        for r in dst:
            ready[r] = start + latency
            producer[r] = op.split(".")[0]
    return Replay(max([last + 1, *ready.values()]), waits)


KERNEL = re.compile(r"sm908fwd_impl14forward_kernelI13__nv_bfloat16.*?Li(\d+)ELNS_8MaskKindE0E.*?ELb([01])ELS\w+?_0ELb([01])E")


def forward_kernels(library: Path) -> dict[tuple[int, bool, bool], list[Instruction]]:
    """(head dim, causal, statistics) -> the sm90 bf16 forward without a mask, from a built library."""
    found = {}
    for name, code in sass_functions(library).items():
        if m := KERNEL.search(name):
            found[(int(m[1]), m[2] == "1", m[3] == "1")] = code
    return found


def row(code: list[Instruction]) -> tuple[int, int, int, str]:
    """Instructions, exponentials, modelled cycles and the two largest waits of the folded softmax."""
    run = folded_softmax(main_loop(code))
    ops = collections.Counter(opcode(t) for _, t in run)
    result = replay(run)
    waits = ", ".join(f"{why} {n}" for why, n in result.waits.most_common(2))
    return len(run), ops["MUFU.EX2"], result.cycles, waits


BACKWARD = re.compile(r"sm908bwd_impl11main_kernelI13__nv_bfloat16NS2_9BwdTraitsIS4_Li(\d+)E.*?ELb([01])ELNS_8MaskKindE0ELb1E")


def shortest_path(code: list[Instruction], first: int, last: int) -> list[Instruction]:
    """The fewest instructions from code[first] to code[last] (indices), following the branches (a
    guarded branch may fall through or jump; others jump), also to the pieces of a loop that ptxas
    placed after its last instruction, but not back before its first or through `last`."""
    index = {a: i for i, (a, _) in enumerate(code)}
    came: dict[int, int | None] = {first: None}
    queue = collections.deque([first])
    while queue and last not in came:  # unit weights: breadth first
        i = queue.popleft()
        text = code[i][1]
        target = branch_target(text)
        nexts = []
        if target is not None and target in index and index[target] >= first:
            nexts.append(index[target])
        if target is None or text.startswith("@") or re.search(r"BRA\s+!?U?P\d,", text):
            nexts.append(i + 1)
        for j in nexts:
            if j < len(code) and j not in came and not opcode(code[j][1]).startswith("EXIT"):
                came[j] = i
                queue.append(j)
    if last not in came:
        raise ValueError("no path")
    path, i = [], last
    while i is not None:
        path.append(code[i])
        i = came[i]
    return path[::-1]


def step_loops(code: list[Instruction]) -> list[tuple[int, int]]:
    """(first, last) indices of the loops over query blocks: the two smallest bodies that issue
    wgmma under a guarded backward branch (the unguarded ones return from the out-of-line retries
    of a barrier's wait into a loop's middle)."""
    index = {a: i for i, (a, _) in enumerate(code)}
    found = []
    for i, (a, text) in enumerate(code):
        target = branch_target(text)
        if target is not None and target < a and target in index and text.startswith("@"):
            if any("HGMMA" in t for _, t in code[index[target]:i + 1]):
                found.append((index[target], i))
    return sorted(found, key=lambda r: r[1] - r[0])[:2]


def step_loop(code: list[Instruction], gradients: bool) -> tuple[int, int]:
    """(first, last) of the loop over query blocks without the statistics' gradients (a loss of the
    output alone) or with them: of step_loops' two, the one with fewer FFMA or more."""
    def ffma(loop: tuple[int, int]) -> int:
        return sum(opcode(t).startswith("FFMA") for _, t in code[loop[0]:loop[1] + 1])

    return (max if gradients else min)(step_loops(code), key=ffma)


def backward_row(code: list[Instruction], gradients: bool = False) -> tuple[int, int, int, str]:
    """Instructions, exponentials, modelled cycles and the two largest waits of a query block of
    the backward's loop without the statistics' gradients (or with them), along its shortest path."""
    path = shortest_path(code, *step_loop(code, gradients))
    ops = collections.Counter(opcode(t) for _, t in path)
    result = replay(path)
    waits = ", ".join(f"{why} {n}" for why, n in result.waits.most_common(2))
    return len(path), ops["MUFU.EX2"], result.cycles, waits


def backward_main(libraries: list[Path]) -> None:
    builds = []
    for lib in libraries:
        builds.append({(int(m[1]), m[2] == "1"): code for name, code in sass_functions(lib).items()
                       if (m := BACKWARD.search(name))})
    print("| D | causal | statistics' gradients |" + "".join(
        f" {lib.name}: instructions | MUFU | cycles | largest waits |" for lib in libraries))
    print("|---|---|---|" + "---|---|---|---|" * len(builds))
    for key in sorted(builds[0]):
        for gradients in (False, True):
            cells = "".join(" {} | {} | {} | {} |".format(*backward_row(b[key], gradients))
                            for b in builds if key in b)
            print(f"| {key[0]} | {'yes' if key[1] else 'no'} | {'yes' if gradients else 'no'} |{cells}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("libraries", nargs="+", type=Path, help="built extension(s): torch_ext/_C*.so")
    parser.add_argument("--backward", action="store_true", help="the sm90 backward's loop instead")
    args = parser.parse_args()
    if args.backward:
        backward_main(args.libraries)
        return
    builds = [forward_kernels(lib) for lib in args.libraries]
    header = "| D | causal | statistics |" + "".join(
        f" {lib.name}: instructions | MUFU | cycles | largest waits |" for lib in args.libraries)
    print(header)
    print("|---|---|---|" + "---|---|---|---|" * len(builds))
    for key in sorted(builds[0]):
        d, causal, stats = key
        cells = "".join(" {} | {} | {} | {} |".format(*row(b[key])) for b in builds if key in b)
        print(f"| {d} | {'yes' if causal else 'no'} | {'yes' if stats else 'no'} |{cells}")


if __name__ == "__main__":
    main()
