"""scripts/pingpong_model.py: its replay of two consumer warps on one SMSP keeps the tensor cores in
issue order across the warpgroups, lets a warpgroup issue only after the other's arrival on the
scheduler barrier, waits for wgmma groups where the code does, and shares the SFU and the issue
slot (synthetic instruction paths: no GPU, no build needed)."""

from __future__ import annotations

from pathlib import Path

from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
model = load_script(ROOT / "scripts" / "pingpong_model.py", "pingpong_model")


def path(*lines: str) -> list:
    return [d for text in lines if (d := model.decode(text)) is not None]


def test_products_alone_keep_the_tensor_cores_busy() -> None:
    # Each warpgroup issues two 64x128x16 (64 cycles each) per block and keeps one block's in
    # flight (DEPBAR 1): the tensor cores run both warpgroups' products back to back, 256 cycles a
    # block. Without the wait the warps would issue ahead of the tensor cores without bound.
    loop = path("BAR.SYNC.DEFER_BLOCKING R1, 0x100", "WARPGROUP.ARRIVE",
                "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT",
                "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24, gsb0", "BAR.ARV R2, 0x100",
                "WARPGROUP.DEPBAR.LE gsb0, 0x1")
    result = model.simulate(loop, model.Settings())
    assert result.period == 256 and result.tensor_busy == 1.0
    slower = model.simulate(loop, model.Settings(tensor_factor=1.5))
    assert slower.period == 384


def test_a_warpgroup_waits_for_its_products_before_its_softmax() -> None:
    # After its products, each warpgroup waits for them (DEPBAR 0), then issues 64 exponentials:
    # 8 cycles each on the SFU of the SMSP, which the other warp shares. The ping-pong overlaps one
    # warpgroup's exponentials with the other's products, so a block takes the larger of the two
    # shares (512 cycles of SFU per warp, 128 of tensor cores per warpgroup) plus the latencies.
    body = ["BAR.SYNC.DEFER_BLOCKING R1, 0x100", "WARPGROUP.ARRIVE",
            "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT",
            "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24, gsb0", "BAR.ARV R2, 0x100",
            "WARPGROUP.DEPBAR.LE gsb0, 0x0"] + [f"MUFU.EX2 R{30 + i}, R{100 + i}" for i in range(64)]
    result = model.simulate(path(*body), model.Settings())
    assert 2 * 512 <= result.period < 2 * 512 + 300
    assert result.sfu_busy > 0.75
    # Without the wait (the exponentials not depending on the products) the two warps' SFU work
    # alone bounds it: 2 x 512 cycles.
    free = model.simulate(path(*[t for t in body if "DEPBAR" not in t]), model.Settings())
    assert free.period == 1024


def test_the_scheduler_barrier_orders_the_warpgroups() -> None:
    # Warpgroup 0 holds its issue for 200 dependent FFMAs (4 cycles each) between its sync and its
    # arrival; warpgroup 1 cannot pass its sync before that arrival: the blocks serialize (two
    # chains of ~800 cycles a block). Without the barriers the two chains overlap.
    chain = ["FFMA R10, R10, R11, R12"] * 200
    ordered = model.simulate(path("BAR.SYNC.DEFER_BLOCKING R1, 0x100", *chain, "BAR.ARV R2, 0x100"),
                             model.Settings(barrier_latency=0))
    free = model.simulate(path(*chain), model.Settings())
    assert ordered.period >= 2 * 790 and free.period < 900


def test_decode_reads_the_forwards_instructions() -> None:
    (rs,) = path("HGMMA.64x64x16.F32.BF16 R88, R152, gdesc[UR12].tnspB, R88, gsb0")
    assert rs.kind == "hgmma" and rs.tensor_cycles == 32 and rs.closes_group and rs.src == ["R152"]
    (wait,) = path("WARPGROUP.DEPBAR.LE gsb0, 0x1")
    assert wait.kind == "depbar" and wait.depbar_k == 1
    (mbar,) = path("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR46+0x28608], R17")
    assert mbar.kind == "mbar_wait" and mbar.dst == ["P0"] and mbar.src == ["R17"]
    assert path("BRA 0x10", "@!P0 BRA 0xe8e0") == []


def test_shared_memory_is_shared_by_the_products_and_the_producer() -> None:
    # One SS 64x64x16 per warpgroup and block: 32 cycles of tensor cores and 4 KB of operands (32
    # cycles at 128 bytes per cycle) each. The producer's 16 KB a block take the shared memory
    # 128 cycles more: the block takes 2 x 32 + 128 cycles, where unlimited bandwidth leaves 64.
    loop = path("BAR.SYNC.DEFER_BLOCKING R1, 0x100", "WARPGROUP.ARRIVE",
                "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT, gsb0", "BAR.ARV R2, 0x100",
                "WARPGROUP.DEPBAR.LE gsb0, 0x1")
    assert loop[2].shared_bytes == 2 * 16 * (64 + 64)
    assert model.simulate(loop, model.Settings(), tma_bytes=16384).period == 192
    assert model.simulate(loop, model.Settings(shared_bandwidth=0), tma_bytes=16384).period == 64
    # A (P) from registers: B alone is read.
    (rs,) = path("HGMMA.64x128x16.F32.BF16 R88, R152, gdesc[UR12].tnspB, R88, gsb0")
    assert rs.shared_bytes == 2 * 16 * 128


def test_a_fence_waits_for_the_warps_stores() -> None:
    # A store of 8 bytes a lane (1 KB from the SM's four SMSPs: 8 cycles of shared memory), then
    # MEMBAR: each block the warp waits for its store to complete (30 cycles after its turn) and
    # the fence (20). Without the fence the two warps' stores go back to back, 16 cycles a block.
    store = "STS.64 [R20+0x100], R40"
    settings = model.Settings(shared_latency=30, fence_latency=20)
    assert path(store)[0].shared_bytes == 4 * 32 * 8
    assert model.simulate(path(store), settings, pre_arrivals=()).period == 16
    assert model.simulate(path(store, "MEMBAR.ALL.CTA"), settings, pre_arrivals=()).period >= 8 + 30 + 20


def test_named_barriers_of_the_backward() -> None:
    both, own, with_producer = path("BAR.SYNC.DEFER_BLOCKING 0x8, 0x100", "BAR.SYNC.DEFER_BLOCKING R210, 0x80",
                                    "BAR.ARV 0xc, 0x120")
    assert (both.barrier, both.barrier_warps) == ("8", 2)
    assert (own.barrier, own.barrier_warps) == ("reg", 1)
    assert (with_producer.kind, with_producer.barrier, with_producer.barrier_warps) == ("bar_arv", "12", 2)
    # A chain of 100 dependent FFMAs before a barrier of both warpgroups: the two warps run their
    # chains side by side and meet there, ~400 cycles a block; the barrier's release adds its
    # latency once per block.
    chain = ["FFMA R10, R10, R11, R12"] * 100
    met = model.simulate(path(*chain, "BAR.SYNC.DEFER_BLOCKING 0x8, 0x100"), model.Settings(barrier_latency=50),
                         pre_arrivals=())
    alone = model.simulate(path(*chain), model.Settings(), pre_arrivals=())
    assert alone.period < 410 and met.period >= alone.period + 50
