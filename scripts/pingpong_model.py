"""A static model of the sm90 kernels' loops on one SMSP: both consumer warpgroups, the tensor
cores and shared memory, from the machine code.

scripts/softmax_issue_model.py replays one warp alone. What a block costs also depends on what that
leaves out: the two consumer warpgroups share each SMSP (one warp of each), its issue slot and its
pipes (the SFU above all); the SM's tensor cores run both warpgroups' products in the order they
were issued; the products read their shared-memory operands through the same 128 bytes per cycle
as the warps' loads and stores and the producer's TMA writes; and the warpgroups wait for each
other at named barriers (the forward's ping-pong, the backward's P, dS and dq tiles) and for their
own products (`WARPGROUP.DEPBAR`). This script replays a loop's path for an interior block (the
shortest path through its body: no per-score check, no rescale of O, no barrier retry) for the
two warps of an SMSP, many blocks in a row, under these rules:

  - one instruction issued per cycle by the SMSP, from the warp that issued least recently among
    those ready; a warp issues in order, each instruction once its operands are ready and its pipe
    is free (the latencies and pipes of softmax_issue_model.py, shared by the two warps);
  - HGMMA m64nNk16 holds the tensor cores N / 2 cycles (4,096 bf16 FLOP per cycle per SM, the
    dense peak) times --tensor-factor, in issue order across the warpgroups, and reads its
    operands from shared memory meanwhile (B, and A unless it comes from registers): it takes the
    longer of the two. A group (up to the HGMMA marked gsb0) completes --wgmma-latency cycles after
    its last HGMMA; `WARPGROUP.DEPBAR.LE gsb0, k` waits until at most k of the warp's groups are
    incomplete, `WARPGROUP.ARRIVE` until the warp's register results are written;
  - shared memory moves 128 bytes per cycle per SM (--shared-bandwidth; 0: unlimited): the
    products' operands, the loads and stores of the SM's four SMSPs (each issues what this one
    does), and per block what the producer's TMA writes (the forward's K and V, the backward's Q
    and dO, and the backward's dq tile that the bulk reduction reads); loads return and stores
    complete --shared-latency cycles after their turn, and wait to issue while more than
    --shared-queue cycles of traffic are ahead of them; MEMBAR and FENCE wait for the warp's
    stores, then hold it --fence-latency cycles;
  - a named barrier's generation completes --barrier-latency cycles after the last arrival of the
    warps that take part: both consumer warps for 256 threads and more (the producer's warp, where
    it takes part, taken as on time), the warp alone for its own warpgroup's 128; a barrier named
    by a register is the forward's scheduler barrier (warpgroup w waits on its own and arrives on
    the other's; warpgroup 1 arrives once before the loop, so that warpgroup 0 goes first);
  - the mbarrier waits for the producer's loads (`SYNCS.PHASECHK`) find them done and set their
    predicate after --mbarrier-latency cycles; cp.async waits find their copies landed.

It prints the period of a block (a key block of the forward, a query block of the backward: the
cycles between two of warpgroup 0's passes, in steady state) and how busy the tensor cores, the
SFU, the issue slot and shared memory are over it. Like the one-warp model, it is a model, not a
measurement: the latencies are estimates, and the memory system beyond shared memory, the
producer's issue and the clock are left out (results/sass/pingpong_model.md compares it with the
kernels an H200 timed).

    python3 scripts/pingpong_model.py torch_ext/_C.abi3.so                          # the forward
    python3 scripts/pingpong_model.py --backward before/kernel_harness torch_ext/_C.abi3.so
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from softmax_issue_model import (  # noqa: E402
    BACKWARD,
    KERNEL,
    Instruction,
    decode_operands,
    main_loop,
    opcode,
    pipe_of,
    registers,
    sass_functions,
    shortest_path,
    step_loop,
)
from softmax_issue_model import writes as one_warp_writes  # noqa: E402


@dataclass
class Settings:
    tensor_factor: float = 1.0  # tensor-core time of an HGMMA over its dense-peak time
    wgmma_latency: int = 30  # cycles from a group's last HGMMA leaving the tensor cores to its results
    barrier_latency: int = 20  # a named barrier's release after its last arrival
    mbarrier_latency: int = 20  # an mbarrier try-wait whose phase has completed
    shared_latency: int = 30  # a shared-memory load's result, a store's completion
    fence_latency: int = 20  # MEMBAR / FENCE: the warp's next issue after its stores completed
    shared_bandwidth: float = 128.0  # bytes per cycle per SM of shared memory (0: unlimited)
    shared_queue: int = 16  # cycles of shared-memory backlog past which a warp's load or store waits


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
    # hgmma, depbar, wg_arrive, bar_sync, bar_arv, mbar_wait, shared (LDS/STS), fence or ""
    kind: str = ""
    tensor_cycles: float = 0.0  # at the dense peak
    shared_bytes: int = 0  # of shared memory it reads or writes, its SM's four SMSPs together
    closes_group: bool = False
    depbar_k: int = 0
    barrier: str = ""  # the named barrier's id: a number, or "reg" (in a register)
    barrier_warps: int = 2  # the consumer warps of an SMSP that take part: 1 (own warpgroup) or 2


def decode(text: str) -> Op | None:
    """The instruction as the replay needs it; None for branches, never-executed instructions
    (guarded by !PT) and the like (the path is given)."""
    op = opcode(text)
    if op in ("BRA", "BSSY", "BSYNC", "NOP") or op.startswith("EXIT") or text.startswith("@!PT"):
        return None
    op, operands, dst, src = decode_operands(text, writes)
    pipe, latency, occupancy = pipe_of(op)
    decoded = Op(text, op, pipe, latency, occupancy, dst, src)
    if op.startswith("HGMMA"):
        n = int(re.match(r"HGMMA\.64x(\d+)x16", op)[1])
        decoded.kind, decoded.tensor_cycles = "hgmma", n / 2
        decoded.closes_group = "gsb0" in text
        from_shared = "gdesc" in operands[1]  # A in shared memory (SS) or in registers (RS)
        decoded.src = [] if from_shared else [r for r in registers(operands[1]) if r.startswith("R")]
        # The operands it reads from shared memory: B (N x 16) and, SS, A (64 x 16), 16-bit.
        decoded.shared_bytes = 2 * 16 * (n + (64 if from_shared else 0))
    elif op.startswith("WARPGROUP.DEPBAR"):
        decoded.kind, decoded.depbar_k = "depbar", int(operands[-1], 0)
    elif op.startswith("WARPGROUP.ARRIVE"):
        decoded.kind = "wg_arrive"
    elif op.startswith(("BAR.SYNC", "BAR.ARV")):
        decoded.kind = "bar_sync" if op.startswith("BAR.SYNC") else "bar_arv"
        decoded.barrier = "reg" if operands[0].startswith("R") else str(int(operands[0], 0))
        # (A barrier of all the block's threads names no count.)
        decoded.barrier_warps = 1 if len(operands) > 1 and int(operands[1], 0) <= 128 else 2
    elif op.startswith("SYNCS.PHASECHK"):
        decoded.kind, decoded.pipe = "mbar_wait", "other"
    elif op.startswith(("LDS", "STS")):
        # Bytes per lane; the SM's four SMSPs each issue the same access (one warp of each
        # warpgroup per SMSP): their bandwidth is shared memory's (simulate).
        width = {"64": 8, "128": 16}.get(op.split(".")[-1], 4)
        decoded.kind, decoded.pipe, decoded.occupancy = "shared", "shared", 1
        decoded.shared_bytes = 4 * 32 * width
    elif op.startswith(("MEMBAR", "FENCE")):
        decoded.kind, decoded.pipe = "fence", "other"
    elif op.startswith(("LDGDEPBAR", "DEPBAR")):  # cp.async groups: taken as landed
        decoded.pipe = "other"
    return decoded


def writes(op: str) -> int:
    """softmax_issue_model.writes, but for the mbarrier waits, whose predicate the replay waits on,
    and the fences, which write nothing."""
    if op.startswith("SYNCS.PHASECHK"):
        return 2
    if op.startswith(("MEMBAR", "FENCE", "LDGDEPBAR", "DEPBAR")):
        return 0
    return one_warp_writes(op)


@dataclass
class Warp:
    index: int  # the consumer warpgroup, 0 or 1
    pc: int = 0
    iteration: int = 0
    ready: dict = field(default_factory=lambda: collections.defaultdict(int))
    groups: list = field(default_factory=list)  # completion cycles of the warp's wgmma groups
    arrived: dict = field(default_factory=lambda: collections.defaultdict(int))  # arrivals by barrier
    waiting: tuple | None = None  # (barrier, generation) of the BAR.SYNC it has arrived at
    stores_done: int = 0  # when the warp's shared-memory stores so far have completed
    fenced_until: int = 0  # no issue before (after a fence)
    starts: list = field(default_factory=list)  # cycle at which each iteration began
    last_issue: int = -1


@dataclass
class Result:
    period: float  # cycles per block (a key block of the forward, a query block of the backward)
    tensor_busy: float
    sfu_busy: float
    issue_busy: float
    shared_busy: float


class Barriers:
    """Named barriers in the SMSP's view: a generation completes when the warps that take part (one
    or both consumer warps; the producer's, where it takes part, is taken as on time) have arrived.
    A barrier whose id is in a register is the ping-pong's: warpgroup w waits on its own and arrives
    on the other's."""

    def __init__(self) -> None:
        self.count: dict = collections.defaultdict(int)  # (barrier, generation) -> arrivals
        self.last: dict = collections.defaultdict(int)  # (barrier, generation) -> last arrival's cycle

    @staticmethod
    def key(w: Warp, o: Op) -> str:
        if o.barrier != "reg":
            return o.barrier
        return f"pingpong{w.index if o.kind == 'bar_sync' else 1 - w.index}"

    def arrive(self, w: Warp, o: Op, cycle: int) -> tuple:
        b = self.key(w, o)
        generation = w.arrived[b]
        w.arrived[b] += 1
        self.count[b, generation] += 1
        self.last[b, generation] = max(self.last[b, generation], cycle)
        return b, generation

    def passed(self, at: tuple, warps_needed: int, cycle: int, settings: Settings) -> bool:
        return self.count[at] >= warps_needed and self.last[at] + settings.barrier_latency <= cycle


def simulate(path: list[Op], settings: Settings, blocks: int = 24, warmup: int = 8,
             pre_arrivals: tuple[tuple[int, str], ...] = ((1, "pingpong0"),), tma_bytes: int = 0) -> Result:
    """Replays `blocks` blocks of both warpgroups; the period is over the blocks after `warmup`.
    pre_arrivals: (warp, barrier) arrivals before the loop (the forward's warpgroup 1 arrives on
    warpgroup 0's scheduler barrier, so that 0 goes first). tma_bytes: what the producer's loads
    write into shared memory per block, taken from its bandwidth as each block starts.

    Shared memory is one resource of the SM: an HGMMA reads its operands from it while it holds the
    tensor cores (it takes the longer of the two), the warps' loads and stores queue for it."""
    bandwidth = settings.shared_bandwidth or float("inf")
    shared_free = 0.0  # when shared memory has moved what it was asked so far
    warps = [Warp(0), Warp(1)]
    barriers = Barriers()
    for index, b in pre_arrivals:
        barriers.count[b, warps[index].arrived[b]] += 1
        warps[index].arrived[b] += 1
    pipe_free: dict[str, int] = collections.defaultdict(int)
    tensor_free = 0.0
    cycle = 0
    while any(w.iteration < blocks for w in warps):
        issued = False
        for w in sorted(warps, key=lambda w: w.last_issue):
            if w.iteration >= blocks or issued:
                continue
            o = path[w.pc]
            if not can_issue(w, o, cycle, pipe_free, barriers, settings):
                continue
            if o.kind == "shared" and shared_free > cycle + settings.shared_queue:
                continue  # the warp's access waits in a full queue
            if w.pc == 0:
                w.starts.append(cycle)
                if w.index == 0:
                    shared_free = max(shared_free, cycle) + tma_bytes / bandwidth
            done_at = None  # when a shared-memory access completes
            if o.kind == "hgmma":
                start = max(float(cycle + 1), tensor_free)
                reads = max(start, shared_free)
                shared_free = reads + o.shared_bytes / bandwidth
                tensor_free = max(start + o.tensor_cycles * settings.tensor_factor, shared_free)
                if o.closes_group:
                    w.groups.append(tensor_free + settings.wgmma_latency)
            elif o.kind == "shared":
                shared_free = max(shared_free, cycle) + o.shared_bytes / bandwidth
                done_at = int(shared_free) + settings.shared_latency
                if o.op.startswith("STS"):
                    w.stores_done = max(w.stores_done, done_at)
            elif o.kind == "bar_sync":
                w.waiting = None
            elif o.kind == "bar_arv":
                barriers.arrive(w, o, cycle)
            elif o.kind == "fence":
                w.fenced_until = cycle + settings.fence_latency
            pipe_free[o.pipe] = cycle + o.occupancy
            ready = {"mbar_wait": cycle + settings.mbarrier_latency, "shared": done_at}.get(o.kind, cycle + o.latency)
            for r in o.dst:
                w.ready[r] = ready
            w.last_issue = cycle
            w.pc += 1
            if w.pc == len(path):
                w.pc, w.iteration = 0, w.iteration + 1
            issued = True
        cycle += 1
        if cycle > 10_000_000:
            raise RuntimeError("the replay made no progress (a barrier that never passes?)")
    period = (warps[0].starts[blocks - 1] - warps[0].starts[warmup]) / (blocks - 1 - warmup)
    # What a block asks of each resource, over the period: both warps run the path once a block.
    tensor = 2 * sum(o.tensor_cycles for o in path) * settings.tensor_factor
    sfu = 2 * sum(o.occupancy for o in path if o.pipe == "mufu")
    shared = (2 * sum(o.shared_bytes for o in path) + tma_bytes) / bandwidth
    return Result(period, tensor / period, sfu / period, 2 * len(path) / period, shared / period)


def can_issue(w: Warp, o: Op, cycle: int, pipe_free: dict, barriers: Barriers, settings: Settings) -> bool:
    if cycle < w.fenced_until or any(w.ready[r] > cycle for r in o.src) or pipe_free[o.pipe] > cycle:
        return False
    if o.kind == "depbar":
        return sum(c > cycle for c in w.groups) <= o.depbar_k
    if o.kind == "wg_arrive":
        return all(t <= cycle for t in w.ready.values())
    if o.kind == "fence":
        return w.stores_done <= cycle
    if o.kind == "bar_sync":
        if w.waiting is None:  # arrives now, then waits for the generation
            w.waiting = barriers.arrive(w, o, cycle)
        return barriers.passed(w.waiting, o.barrier_warps, cycle, settings)
    return True


def loop_path(code: list[Instruction]) -> list[Op]:
    """The decoded shortest path through the forward's key loop."""
    loop = main_loop(code)
    return decoded(shortest_path(loop, 0, len(loop) - 1))


def backward_path(code: list[Instruction], gradients: bool = False) -> list[Op]:
    """The decoded shortest path through the backward's loop over query blocks, without the
    statistics' gradients or with them (softmax_issue_model.py: step_loop)."""
    return decoded(shortest_path(code, *step_loop(code, gradients)))


def decoded(path: list[Instruction]) -> list[Op]:
    return [d for _, text in path if (d := decode(text)) is not None]


def kernels(binary: Path, pattern: re.Pattern) -> dict[tuple, list[Instruction]]:
    """The groups of `pattern` (converted: the head dim to int, flags to bool) -> the kernel's code."""
    found = {}
    for name, code in sass_functions(binary).items():
        if m := pattern.search(name):
            found[(int(m[1]), *(g == "1" for g in m.groups()[1:]))] = code
    return found


def forward_row(code: list[Instruction], key: tuple, settings: Settings) -> Result:
    # The producer's TMA writes K and V of each 128-key block (kernels without a mask).
    return simulate(loop_path(code), settings, tma_bytes=2 * 128 * key[0] * 2)


def backward_row(code: list[Instruction], key: tuple, settings: Settings, gradients: bool) -> Result:
    # Q and dO of each 64-row query block, and the fp32 dq tile the bulk reduction reads.
    d = key[0]
    return simulate(backward_path(code, gradients), settings, pre_arrivals=(),
                    tma_bytes=2 * 64 * d * 2 + 64 * d * 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("binaries", nargs="+", type=Path, help="built extension(s) or kernel harnesses")
    parser.add_argument("--backward", action="store_true",
                        help="the backward's loop over query blocks (bf16, no mask, dq by bulk reductions)")
    defaults = Settings()
    for name in Settings.__dataclass_fields__:
        default = getattr(defaults, name)
        parser.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    args = parser.parse_args()
    settings = Settings(**{name: getattr(args, name) for name in Settings.__dataclass_fields__})
    pattern = BACKWARD if args.backward else KERNEL
    builds = [kernels(b, pattern) for b in args.binaries]
    flag = "statistics' gradients" if args.backward else "statistics"
    print(f"| D | causal | {flag} |" + "".join(
        f" {b.name}: cycles per block | tensor | SFU | issue | shared |" for b in args.binaries))
    print("|---|---|---|" + "---|---|---|---|---|" * len(builds))
    rows = [(key, g) for key in sorted(builds[0]) for g in (False, True)] if args.backward else \
        [(key, key[2]) for key in sorted(builds[0])]
    for key, flagged in rows:
        cells = ""
        for build in builds:
            if key not in build:
                cells += " – | – | – | – | – |"
                continue
            r = (backward_row(build[key], key, settings, flagged) if args.backward
                 else forward_row(build[key], key, settings))
            cells += (f" {r.period:.0f} | {r.tensor_busy:.0%} | {r.sfu_busy:.0%} | {r.issue_busy:.0%} |"
                      f" {r.shared_busy:.0%} |")
        print(f"| {key[0]} | {'yes' if key[1] else 'no'} | {'yes' if flagged else 'no'} |{cells}")


if __name__ == "__main__":
    main()
