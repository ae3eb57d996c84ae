"""scripts/softmax_issue_model.py: its in-order issue replay charges latencies and pipe occupancy
as its table says, and it finds the main loop and the folded softmax path in machine code laid out
as the sm90 forward's is (synthetic cuobjdump text: no GPU, no build needed)."""

from __future__ import annotations

from pathlib import Path

from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
model = load_script(ROOT / "scripts" / "softmax_issue_model.py", "softmax_issue_model")


def code(*lines: str) -> list[tuple[int, str]]:
    return [(16 * i, text) for i, text in enumerate(lines)]


def test_dependent_ffma_waits_for_the_latency() -> None:
    independent = model.replay(code("FFMA R1, R2, R3, R4", "FFMA R5, R6, R3, R4"))
    dependent = model.replay(code("FFMA R1, R2, R3, R4", "FFMA R5, R1, R3, R4"))
    assert independent.cycles == 1 + 4  # issued at 0 and 1, the second result at 5
    assert dependent.cycles == 4 + 4
    assert dependent.waits == {"dep:FFMA": 3}


def test_exponentials_queue_on_the_sfu() -> None:
    # Two independent MUFU.EX2: the second waits 8 cycles for the pipe, an FFMA between does not.
    result = model.replay(code("MUFU.EX2 R1, R2", "FFMA R9, R8, R8, R8", "MUFU.EX2 R3, R4"))
    assert result.cycles == 8 + 18
    assert result.waits == {"pipe:mufu": 6}


def test_predicates_and_guards_are_dependencies() -> None:
    result = model.replay(code("FSETP.NEU.AND P0, PT, R1, RZ, PT", "@P0 FMUL R2, R2, R3"))
    assert result.cycles == 4 + 4


SASS = """
        Function : _ZN12entropy_attn4cuda4sm908fwd_impl14forward_kernelI13__nv_bfloat16NS2_9FwdTraitsIS4_Li64ELNS_8MaskKindE0ENS1_7Sm90OpsEEELb0ELS6_0ELb1EEEvNS2_10KernelArgsIT0_EE
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR24], RZ, !UPT ;
        /*0020*/              @P0 BRA 0x90 ;
        /*0030*/                   FMNMX R0, R24, -INF , !PT ;
        /*0040*/                   FFMA R2, R3, R24, -R0 ;
        /*0050*/                   MUFU.EX2 R24, R2 ;
        /*0060*/                   FADD R14, R24, R14 ;
        /*0070*/                   HGMMA.64x64x16.F32.BF16 R88, R120, gdesc[UR20].tnspB, R88 ;
        /*0080*/              @P1 BRA 0x10 ;
        /*0090*/                   EXIT ;
"""


def test_main_loop_and_kernel_key() -> None:
    functions = model.parse_functions(SASS)
    ((name, instructions),) = functions.items()
    m = model.KERNEL.search(name)
    assert m is not None and (int(m[1]), m[2], m[3]) == (64, "0", "1")
    loop = model.main_loop(instructions)
    assert [a for a, _ in loop] == list(range(0x10, 0x90, 0x10))


BACKWARD_SASS = """
        Function : _ZN12entropy_attn4cuda4sm908bwd_impl11main_kernelI13__nv_bfloat16NS2_9BwdTraitsIS4_Li128ENS1_7Sm90OpsEEELb1ELNS_8MaskKindE0ELb1EEEvNS2_10KernelArgsIT0_EE
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   HGMMA.64x32x16.F32.BF16 R24, gdesc[UR24], RZ, !UPT ;
        /*0020*/              @P0 BRA 0x60 ;
        /*0030*/                   FFMA R2, R24, R3, R4 ;
        /*0040*/                   MUFU.EX2 R24, R2 ;
        /*0050*/                   BRA 0xa0 ;
        /*0060*/                   ISETP.GE.AND P2, PT, R5, R6, PT ;
        /*0070*/                   ISETP.LT.AND P2, PT, R5, R7, P2 ;
        /*0080*/                   FSEL R24, R24, -INF , P2 ;
        /*0090*/                   MUFU.EX2 R24, R24 ;
        /*00a0*/              @P1 BRA 0x10 ;
        /*00b0*/                   EXIT ;
"""


def test_backward_block_takes_the_shortest_path() -> None:
    # A block inside the causal bounds skips the per-score check (the branch to 0x60).
    ((name, instructions),) = model.parse_functions(BACKWARD_SASS).items()
    m = model.BACKWARD.search(name)
    assert m is not None and (int(m[1]), m[2]) == (128, "1")
    ((first, last),) = model.step_loops(instructions)
    assert (instructions[first][0], instructions[last][0]) == (0x10, 0xA0)
    path = model.shortest_path(instructions, first, last)
    assert [a for a, _ in path] == [0x10, 0x20, 0x30, 0x40, 0x50, 0xA0]
    count, exps, _, _ = model.backward_row(instructions)
    assert (count, exps) == (6, 1)
