"""A static model of the sm90 forward's key loop on one SMSP: both consumer warpgroups, their
ping-pong and the tensor cores, from the machine code.

scripts/softmax_issue_model.py replays one warp's softmax alone. What a key block costs also depends
on what it leaves out: the two consumer warpgroups share each SMSP (one warp of each), its issue
slot and its pipes (the SFU above all), and the SM's tensor cores, which run the warpgroups'
products in the order they were issued; the scheduler barriers hand the tensor cores from one
warpgroup to the other (csrc/cuda/sm90/fwd_kernel.cuh), and each warpgroup waits for its own
products (`WARPGROUP.DEPBAR`). This script replays the loop's path for an interior key block (the
shortest path through the loop body: no per-score check, O's rescale skipped, no barrier retry)
for two warps on one SMSP, many blocks in a row, under these rules:

  - one instruction issued per cycle by the SMSP, from the warp that issued least recently among
    those ready; a warp issues in order, each instruction once its operands are ready and its pipe
    is free (the latencies and pipes of softmax_issue_model.py, shared by the two warps);
  - HGMMA m64nNk16 holds the tensor cores N / 2 cycles (4,096 bf16 FLOP per cycle per SM, the
    dense peak) times --tensor-factor, in issue order across the warpgroups; a group (up to the
    HGMMA marked gsb0) completes --wgmma-latency cycles after its last HGMMA left the tensor cores;
    `WARPGROUP.DEPBAR.LE gsb0, k` waits until at most k of the warp's groups are incomplete, and
    `WARPGROUP.ARRIVE` until the warp's pending register results are written;
  - the scheduler barriers: a warp's k-th `BAR.SYNC` passes --barrier-latency cycles after the other
    warp's k-th `BAR.ARV` (warpgroup 1 arrives once before the loop, so that warpgroup 0 goes first);
  - the mbarrier waits for K and V (`SYNCS.PHASECHK`) find their data loaded (the producer is ahead)
    and set their predicate after --mbarrier-latency cycles.

It prints the period of a key block (cycles between the two warpgroups' passes, in steady state)
and how busy the tensor cores, the SFU and the issue slot were. Like the one-warp model, it is a
model, not a measurement: the latencies are estimates, the tensor cores' factor is a free parameter
(fit it to a measured kernel, then compare the others), and the producer warp, TMA and the memory
system are left out.

    python3 scripts/pingpong_model.py torch_ext/_C.abi3.so
    python3 scripts/pingpong_model.py --tensor-factor 1.3 build/kernel_harness torch_ext/_C.abi3.so
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sass_check import tool  # noqa: E402
from softmax_issue_model import (  # noqa: E402
    KERNEL,
    Instruction,
    main_loop,
    opcode,
    parse_functions,
    pipe_of,
    registers,
    shortest_path,
)


@dataclass
class Settings:
    tensor_factor: float = 1.0  # tensor-core time of an HGMMA over its dense-peak time
    wgmma_latency: int = 30  # cycles from a group's last HGMMA leaving the tensor cores to its results
    barrier_latency: int = 20  # a named barrier's release after its last arrival
    mbarrier_latency: int = 20  # an mbarrier try-wait whose phase has completed


@dataclass
class Op:
    """One instruction of the path, decoded once."""

    text: str
    op: str
    pipe: str
    latency: int
    occupancy: int
    dst: list[str]
    src: list[str]
    kind: str = ""  # hgmma, depbar, wg_arrive, bar_sync, bar_arv, mbar_wait or ""
    tensor_cycles: float = 0.0  # at the dense peak
    closes_group: bool = False
    depbar_k: int = 0


def decode(text: str) -> Op | None:
    """The instruction as the replay needs it; None for branches and the like (the path is given)."""
    op = opcode(text)
    if op in ("BRA", "BSSY", "BSYNC", "NOP") or op.startswith("EXIT"):
        return None
    guard = re.match(r"^@!?(P\d)", text)
    body = re.sub(r"^@!?U?P\w+\s+", "", text)[len(op):]
    operands = [o.strip() for o in body.split(",")] if body.strip() else []
    writes = 2 if op.startswith(("FSETP", "ISETP", "SHFL", "SYNCS.PHASECHK")) else 1
    if op.startswith(("STG", "STS", "SYNCS.ARRIVE", "BAR", "WARPGROUP", "HGMMA", "RED", "ATOM")):
        writes = 0
    dst = [r for o in operands[:writes] for r in registers(o)]
    src = [r for o in operands[writes:] for r in registers(o)] + ([guard[1]] if guard else [])
    pipe, latency, occupancy = pipe_of(op)
    decoded = Op(text, op, pipe, latency, occupancy, dst, src)
    if op.startswith("HGMMA"):
        n = int(re.match(r"HGMMA\.64x(\d+)x16", op)[1])
        decoded.kind, decoded.tensor_cycles = "hgmma", n / 2
        decoded.closes_group = "gsb0" in text
        decoded.src = [r for r in registers(operands[1]) if r.startswith("R")] if "gdesc" not in operands[1] else []
    elif op.startswith("WARPGROUP.DEPBAR"):
        decoded.kind, decoded.depbar_k = "depbar", int(operands[-1], 0)
    elif op.startswith("WARPGROUP.ARRIVE"):
        decoded.kind = "wg_arrive"
    elif op.startswith("BAR.SYNC"):
        decoded.kind = "bar_sync"
    elif op.startswith("BAR.ARV"):
        decoded.kind = "bar_arv"
    elif op.startswith("SYNCS.PHASECHK"):
        decoded.kind, decoded.pipe = "mbar_wait", "other"
    return decoded


@dataclass
class Warp:
    index: int  # the consumer warpgroup, 0 or 1
    pc: int = 0
    iteration: int = 0
    ready: dict = field(default_factory=lambda: collections.defaultdict(int))
    groups: list = field(default_factory=list)  # completion cycles of the warp's wgmma groups
    open_group: float | None = None  # the end of the group being issued
    syncs: int = 0
    arrivals: list = field(default_factory=list)  # cycles of the warp's BAR.ARV
    starts: list = field(default_factory=list)  # cycle at which each iteration began
    last_issue: int = -1


@dataclass
class Result:
    period: float  # cycles per key block, both warpgroups
    tensor_busy: float
    sfu_busy: float
    issue_busy: float


def simulate(path: list[Op], settings: Settings, blocks: int = 24, warmup: int = 8) -> Result:
    """Replays `blocks` key blocks of both warpgroups; the period is over the blocks after `warmup`."""
    warps = [Warp(0), Warp(1, arrivals=[])]
    # Warpgroup 1 arrived on warpgroup 0's barrier before the loop: warpgroup 0 goes first.
    warps[1].arrivals.append(0)
    pipe_free: dict[str, int] = collections.defaultdict(int)
    tensor_free = 0.0
    cycle = 0
    while any(w.iteration < blocks for w in warps):
        order = sorted(warps, key=lambda w: w.last_issue)
        issued = False
        for w in order:
            if w.iteration >= blocks:
                continue
            o = path[w.pc]
            if not can_issue(w, warps, o, cycle, pipe_free, settings):
                continue
            if w.pc == 0:
                w.starts.append(cycle)
            if o.kind == "hgmma":
                start = max(float(cycle + 1), tensor_free)
                tensor_free = start + o.tensor_cycles * settings.tensor_factor
                w.open_group = tensor_free
                if o.closes_group:
                    w.groups.append(tensor_free + settings.wgmma_latency)
                    w.open_group = None
            elif o.kind == "bar_sync":
                w.syncs += 1
            elif o.kind == "bar_arv":
                w.arrivals.append(cycle)
            pipe_free[o.pipe] = cycle + o.occupancy
            latency = settings.mbarrier_latency if o.kind == "mbar_wait" else o.latency
            for r in o.dst:
                w.ready[r] = cycle + latency
            w.last_issue = cycle
            w.pc += 1
            if w.pc == len(path):
                w.pc, w.iteration = 0, w.iteration + 1
            issued = True
            break
        cycle += 1
        if not issued and cycle > 10_000_000:
            raise RuntimeError("the replay made no progress (a barrier that never passes?)")
    period = (warps[0].starts[blocks - 1] - warps[0].starts[warmup]) / (blocks - 1 - warmup)
    # What a block asks of each resource, over the period: both warps run the path once a block.
    tensor = 2 * sum(o.tensor_cycles for o in path) * settings.tensor_factor
    sfu = 2 * sum(o.occupancy for o in path if o.pipe == "mufu")
    return Result(period, tensor / period, sfu / period, 2 * len(path) / period)


def can_issue(w: Warp, warps: list[Warp], o: Op, cycle: int, pipe_free: dict, settings: Settings) -> bool:
    if any(w.ready[r] > cycle for r in o.src) or pipe_free[o.pipe] > cycle:
        return False
    if o.kind == "depbar":
        return sum(c > cycle for c in w.groups) <= o.depbar_k
    if o.kind == "wg_arrive":
        return all(t <= cycle for t in w.ready.values())
    if o.kind == "bar_sync":
        other = warps[1 - w.index]
        k = w.syncs  # this is the warp's (k + 1)-th sync: it needs the other's (k + 1)-th arrival
        return len(other.arrivals) > k and other.arrivals[k] + settings.barrier_latency <= cycle
    return True


def loop_path(code: list[Instruction]) -> list[Op]:
    """The decoded shortest path through the forward's key loop."""
    loop = main_loop(code)
    path = shortest_path(loop, 0, len(loop) - 1)
    return [d for _, text in path if (d := decode(text)) is not None]


def forward_kernels(binary: Path) -> dict[tuple[int, bool, bool], list[Instruction]]:
    """(head dim, causal, statistics) -> the sm90 bf16 forward without a mask."""
    sass = subprocess.run([tool("cuobjdump"), "-sass", "-arch", "sm_90", str(binary)], capture_output=True,
                          text=True, check=True).stdout
    found = {}
    for name, code in parse_functions(sass).items():
        if m := KERNEL.search(name):
            found[(int(m[1]), m[2] == "1", m[3] == "1")] = code
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("binaries", nargs="+", type=Path, help="built extension(s) or kernel harnesses")
    parser.add_argument("--tensor-factor", type=float, default=Settings.tensor_factor)
    parser.add_argument("--wgmma-latency", type=int, default=Settings.wgmma_latency)
    parser.add_argument("--barrier-latency", type=int, default=Settings.barrier_latency)
    parser.add_argument("--mbarrier-latency", type=int, default=Settings.mbarrier_latency)
    args = parser.parse_args()
    settings = Settings(args.tensor_factor, args.wgmma_latency, args.barrier_latency, args.mbarrier_latency)
    builds = [forward_kernels(b) for b in args.binaries]
    print("| D | causal | statistics |" + "".join(
        f" {b.name}: cycles per block | tensor | SFU | issue |" for b in args.binaries))
    print("|---|---|---|" + "---|---|---|---|" * len(builds))
    for key in sorted(builds[0]):
        cells = ""
        for build in builds:
            if key not in build:
                cells += " – | – | – | – |"
                continue
            r = simulate(loop_path(build[key]), settings)
            cells += f" {r.period:.0f} | {r.tensor_busy:.0%} | {r.sfu_busy:.0%} | {r.issue_busy:.0%} |"
        d, causal, stats = key
        print(f"| {d} | {'yes' if causal else 'no'} | {'yes' if stats else 'no'} |{cells}")


if __name__ == "__main__":
    main()
