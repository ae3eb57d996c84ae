"""benchmarks/gpu_profile.py without a GPU: it reads both forms of ncu's CSV (the raw page's wide
form, the details page's long one) into the same kernels and metrics, ranks the stall reasons, writes
the report's rows, and without ncu writes nothing and exits 1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_profile.py"
prof = load_script(SCRIPT, "gpu_profile")

KERNEL = "void entropy_attn::cuda::sm90::fwd_impl::forward_kernel<__nv_bfloat16, Traits, true, (MaskKind)0, true>(KernelArgs)"
STALL = prof.STALL_PREFIX + "{}" + prof.STALL_SUFFIX

WIDE = "\n".join([
    "==PROF== Connected to process 1234 (python3)",
    '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device",'
    f'"CC","gpu__time_duration.sum","sm__inst_issued.avg.pct_of_peak_sustained_active","{STALL.format("barrier")}",'
    f'"{STALL.format("long_scoreboard")}","{STALL.format("wait")}","sm__cycles_elapsed.avg.per_second"',
    '"","","","","","","","","","","","nsecond","%","","","","hertz"',
    f'"0","1234","python3","host","{KERNEL}","1","7","(384, 1, 1)","(32, 16, 4)","0","9.0","541,000","36.4","0.5","2.25","1.1",'
    '"1,620,000,000"',
    '"1","1234","python3","host","void entropy_attn::cuda::fallback::attention_fwd_kernel<float>(FwdParams)","1","7",'
    '"(128, 1, 1)","(128, 16, 4)","0","9.0","5500","2.9","","0.1","",""',
    "==PROF== Disconnected from process 1234",
])  # fmt: skip


def long_form(text: str) -> str:
    """The details page's long form of the same numbers."""
    rows = ['"ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"']
    for row in prof.read_csv(text):
        rows.append(f'"{row["ID"]}","{row["Kernel Name"]}","Command line profiler metrics","{row["Metric Name"]}","",'
                    f'"{row["Metric Value"]}"')  # fmt: skip
    return "\n".join(rows)


def test_both_csv_forms_read_the_same() -> None:
    wide = prof.kernels_of(prof.read_csv(WIDE))
    assert [prof.short_name(name) for name, _ in wide] == ["forward_kernel (sm90)", "attention_fwd_kernel (fallback)"]
    metrics = wide[0][1]
    assert metrics["gpu__time_duration.sum"] == 541000.0  # digits grouped by ncu
    assert metrics["sm__inst_issued.avg.pct_of_peak_sustained_active"] == 36.4
    assert "Grid Size" not in metrics  # launch columns are not metrics
    assert STALL.format("barrier") not in wide[1][1]  # an empty cell is no value
    assert prof.kernels_of(prof.read_csv(long_form(WIDE))) == wide


def test_stall_reasons_largest_first_and_the_report() -> None:
    kernels = prof.kernels_of(prof.read_csv(WIDE))
    assert prof.stalls(kernels[0][1]) == [("long_scoreboard", 2.25), ("wait", 1.1), ("barrier", 0.5)]
    text = prof.markdown([("fwd_stats", kernels)], "# header")
    rows = [line for line in text.splitlines() if line.startswith("| fwd_stats")]
    assert len(rows) == 2
    assert "| 541 |" in rows[0] and "| 36.4% |" in rows[0] and "long_scoreboard 2.25, wait 1.10, barrier 0.50" in rows[0]
    assert "| 1.62 |" in rows[0]  # the SM clock in GHz
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells.count("n/a") == len(prof.SUMMARY) - 3  # the metrics not in the CSV


def test_metrics_name_no_chip_specific_counter_by_name() -> None:
    names = prof.METRICS.split(",")
    assert not [m for m in names if any(p in m for p in ("gmma", "pipe_xu", "pipe_fma", "pipe_alu"))
                and not m.startswith("regex:")]
    assert "sm__cycles_elapsed.avg.per_second" in names
    assert any(m.startswith("regex:^" + prof.STALL_PREFIX) for m in names)


def test_without_ncu_nothing_is_written(tmp_path: Path) -> None:
    out = tmp_path / "profile.md"
    done = subprocess.run([sys.executable, str(SCRIPT), "--ncu", "no-such-ncu-here", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 1 and "not on the PATH" in done.stdout
    assert not out.exists()


def test_calls_chosen() -> None:
    assert prof.parse_args([]).calls == list(prof.CALLS)
    assert prof.parse_args(["--causal", "no", "--calls", "fwd", "fwd_stats"]).calls == ["fwd", "fwd_stats"]


def test_units_of_the_cells() -> None:
    # Percentages of either peak (active or elapsed) carry %, durations in µs, the clock in GHz, the
    # ratios plain.
    metrics = {"gpu__time_duration.sum": 541000.0, "sm__throughput.avg.pct_of_peak_sustained_elapsed": 55.2,
               "sm__inst_issued.avg.pct_of_peak_sustained_active": 36.4,
               "smsp__average_warp_latency_per_inst_issued.ratio": 5.75,
               "sm__cycles_elapsed.avg.per_second": 1.62e9}
    row = prof.markdown([("fwd", [(KERNEL, metrics)])], "#").splitlines()[-1]
    cells = [c.strip() for c in row.strip("|").split("|")]
    columns = ["call", "kernel"] + [c for c, _ in prof.SUMMARY]
    got = dict(zip(columns, cells))
    assert (got["duration (µs)"], got["SM throughput"], got["issue slots busy"]) == ("541", "55.2%", "36.4%")
    assert (got["warp cycles per issue"], got["SM clock (GHz)"]) == ("5.75", "1.62")
