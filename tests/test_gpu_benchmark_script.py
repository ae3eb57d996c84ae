"""benchmarks/gpu_vs_sdpa.py without a GPU: its pure parts (FLOPs, ratios, the JSON point, the grid
from the flags, the --check tolerance, the memory guard), its measuring plumbing on the CPU with a
wall-clock timer, and that it exits 0 writing nothing when no CUDA device is visible."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, List, Optional

import pytest
import torch
from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_vs_sdpa.py"
bench = load_script(SCRIPT, "gpu_vs_sdpa")


@pytest.fixture(autouse=True)
def unset_kernel_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starts each test with the kernel settings the script writes to os.environ unset, and puts
    back what they were after it. (monkeypatch.delenv of an unset variable records nothing, so the
    script's own writes would outlive the test: each is set first, then deleted.)"""
    for name in (bench.FAMILY_ENV, bench.LAUNCH_ORDER_ENV, bench.PERSISTENT_ENV):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
POINT_KEYS = {
    "dtype", "head_dim", "seq_len", "batch", "heads", "kv_heads", "causal", "family", "sdpa_backend",
    "fwd_stats", "fwd", "fwd_bwd", "sdpa_ms_by_backend", "tflops", "peak_fraction",
}  # fmt: skip
TFLOPS_KEYS = {"ours_fwd_stats", "ours_fwd", "ours_fwd_bwd", "sdpa_fwd", "sdpa_fwd_bwd"}


def shape(**kw: Any) -> Any:
    base = dict(dtype="bfloat16", batch=2, heads=4, kv_heads=4, head_dim=16, seq_len=8, causal=False)
    return bench.Shape(**{**base, **kw})


def wall_ms(fn: Callable[[], object], min_run_time: float) -> float:
    """A CPU stand-in for cuda_time_ms: one call, wall clock."""
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def test_flops_causal_halves_gqa_counts_query_heads() -> None:
    s = shape(batch=4, heads=32, kv_heads=8, head_dim=128, seq_len=1024)
    assert bench.attention_flops(s) == 4 * 4 * 32 * 1024 * 1024 * 128
    assert bench.attention_flops(s) == bench.attention_flops(shape(batch=4, heads=32, kv_heads=32, head_dim=128, seq_len=1024))  # fmt: skip
    causal = shape(batch=4, heads=32, kv_heads=8, head_dim=128, seq_len=1024, causal=True)
    assert bench.attention_flops(causal) == bench.attention_flops(s) / 2
    assert bench.attention_flops(causal, backward=True) == 3.5 * bench.attention_flops(causal)
    assert bench.tflops(2e12, 1000.0) == pytest.approx(2.0)
    assert bench.tflops(2e12, None) is None and bench.tflops(2e12, 0.0) is None


def test_ratio_with_missing_values() -> None:
    assert bench.ratio(3.0, 1.5) == pytest.approx(2.0)
    assert bench.ratio(None, 1.0) is None
    assert bench.ratio(1.0, None) is None
    assert bench.ratio(None, None) is None
    assert bench.ratio(1.0, 0.0) is None


def test_point_schema_fastest_backend_and_nulls() -> None:
    s = shape(causal=True)
    ours = {"fwd_stats": 4.0, "fwd": 3.0, "fwd_bwd": 12.0}
    sdpa = {"cudnn": {"fwd": None, "fwd_bwd": None}, "flash": {"fwd": 2.0, "fwd_bwd": 6.0}, "efficient": {"fwd": 1.0, "fwd_bwd": 8.0}}  # fmt: skip
    p = bench.build_point(s, "sm80", ours, sdpa, peak=100.0)
    assert POINT_KEYS <= set(p)
    assert (p["dtype"], p["heads"], p["kv_heads"], p["causal"], p["family"]) == ("bfloat16", 4, 4, True, "sm80")
    assert p["sdpa_backend"] == "efficient"  # fastest forward
    assert p["fwd"] == {"ours_ms": 3.0, "sdpa_ms": 1.0, "ratio": 3.0, "sdpa_backend": "efficient"}
    assert p["fwd_stats"]["ratio"] == pytest.approx(4.0)
    assert p["fwd_bwd"]["sdpa_ms"] == 6.0 and p["fwd_bwd"]["ratio"] == pytest.approx(2.0)  # against flash
    assert p["sdpa_ms_by_backend"]["cudnn"] == {"fwd": None, "fwd_bwd": None}
    assert set(p["sdpa_ms_by_backend"]) == {"cudnn", "flash", "efficient"}
    assert set(p["tflops"]) == TFLOPS_KEYS and set(p["peak_fraction"]) == TFLOPS_KEYS
    fwd_flops = bench.attention_flops(s)
    assert p["tflops"]["ours_fwd"] == pytest.approx(fwd_flops / 3e-3 / 1e12)
    assert p["tflops"]["sdpa_fwd_bwd"] == pytest.approx(3.5 * fwd_flops / 6e-3 / 1e12)
    assert p["peak_fraction"]["ours_fwd"] == pytest.approx(p["tflops"]["ours_fwd"] / 100.0)

    # Missing: no backward, a backend absent from the dict, no peak.
    q = bench.build_point(s, "auto", {"fwd_stats": 4.0, "fwd": None}, {"flash": {"fwd": 2.0}}, peak=None)
    assert POINT_KEYS <= set(q) and q["sdpa_backend"] == "flash"
    assert q["fwd"]["ratio"] is None and q["fwd_bwd"] == {"ours_ms": None, "sdpa_ms": None, "ratio": None, "sdpa_backend": None}  # fmt: skip
    assert q["sdpa_ms_by_backend"]["efficient"] == {"fwd": None, "fwd_bwd": None}
    assert q["tflops"]["ours_fwd"] is None and q["tflops"]["ours_fwd_stats"] is not None
    assert all(v is None for v in q["peak_fraction"].values())
    skipped = bench.build_point(s, "auto", {}, {}, 100.0, skipped="too big")
    assert skipped["skipped"] == "too big" and skipped["sdpa_backend"] is None
    assert all(v is None for v in skipped["tflops"].values())


def test_grid_defaults_and_quick() -> None:
    grid = bench.expand_grid(bench.parse_args([]))
    assert len(grid) == 2 * 2 * 3 * 3 * 2
    assert {s.dtype for s in grid} == {"bfloat16", "float16"}
    assert {(s.heads, s.kv_heads) for s in grid} == {(16, 16), (32, 8)}
    assert {s.head_dim for s in grid} == {64, 128, 256} and {s.seq_len for s in grid} == {1024, 4096, 16384}
    assert {s.batch for s in grid} == {4} and {s.causal for s in grid} == {False, True}
    quick = bench.expand_grid(bench.parse_args(["--quick"]))
    assert len({s.dtype for s in quick}) == 1 and {s.batch for s in quick} == {2}
    assert {s.head_dim for s in quick} == {64, 128} and {s.seq_len for s in quick} == {1024}
    assert bench.parse_args(["--quick"]).min_run_time < bench.parse_args([]).min_run_time
    # Flags override --quick and the defaults.
    args = bench.parse_args(["--quick", "--dtype", "fp16", "--seq", "2048", "--heads-kv", "8:2", "--causal", "yes", "--family", "fallback", "sm80"])  # fmt: skip
    grid = bench.expand_grid(args)
    assert {(s.dtype, s.seq_len, s.heads, s.kv_heads, s.causal) for s in grid} == {("float16", 2048, 8, 2, True)}
    assert args.family == ["fallback", "sm80"] and args.backward and not args.check
    assert not bench.parse_args(["--no-backward"]).backward


@pytest.mark.parametrize("text", ["32x8", "32:7", "0:0", "8:0", "a:b", "16:16:16", ""])
def test_bad_heads_kv_is_a_clear_error(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="H"):
        bench.parse_heads_kv(text)
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(["--heads-kv", "16:16", text])
    assert exc.value.code == 2 and "--heads-kv" in capsys.readouterr().err


def test_heads_kv_parses() -> None:
    assert bench.parse_heads_kv("32:8") == (32, 8)
    assert bench.parse_args(["--heads-kv", "4:4", "12:3"]).heads_kv == [(4, 4), (12, 3)]


def test_check_tolerance() -> None:
    scales = {"out": 1.0, "dq": 1.0, "dk": 1.0, "dv": 1.0}
    ok = {"out": 1e-2, "dq": 3e-2, "dk": None, "dv": None}
    assert not bench.is_mismatch(ok, scales, "bfloat16")
    assert bench.is_mismatch(ok, scales, "float16")  # fp16 is held tighter
    assert bench.is_mismatch({**ok, "dv": 0.5}, scales, "bfloat16")
    assert bench.is_mismatch({**ok, "out": float("nan")}, scales, "bfloat16")


def test_memory_guard() -> None:
    s = shape(batch=4, heads=32, kv_heads=8, head_dim=256, seq_len=16384)
    fwd, bwd, checked = (bench.estimate_bytes(s, b, c) for b, c in ((False, False), (True, False), (True, True)))
    q_bytes = 4 * 32 * 16384 * 256 * 2
    assert q_bytes * 2 < fwd < bwd < checked  # at least q and the output
    assert bench.memory_skip_reason(100, 1000) is None
    reason = bench.memory_skip_reason(800, 1000)
    assert reason is not None and "GiB" in reason


class FailingExt:
    """A torch_ext stand-in whose attention raises `error`."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def attention(self, *args: Any, **kwargs: Any) -> Any:
        raise self.error


def cpu_run(ext: Any, **kw: Any) -> Any:
    return bench.Run(ext, device="cpu", timer=wall_ms, min_run_time=0.0, **kw)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_measuring_plumbing_on_cpu(kv_heads: int) -> None:
    import torch_ext

    s = shape(heads=4, kv_heads=kv_heads, seq_len=64, causal=True)
    points: List[dict] = bench.measure_shape(s, ["auto", "fallback"], cpu_run(torch_ext, check=True), 50.0, None)
    assert [p["family"] for p in points] == ["auto", "fallback"]
    assert os.environ[bench.FAMILY_ENV] == "fallback"  # set before each family
    for p in points:
        assert p["errors"] == [] and p["skipped"] is None and p["mismatch"] is False
        assert all(p[k]["ours_ms"] > 0 for k in bench.KINDS)
        # On the CPU only SDPA's flash backend exists: the others are refused, recorded as null.
        assert p["sdpa_backend"] == "flash" and p["sdpa_ms_by_backend"]["cudnn"] == {"fwd": None, "fwd_bwd": None}
        assert all(p[k]["ratio"] is not None for k in bench.KINDS)
        assert set(p["max_abs_err"]) == {"out", "dq", "dk", "dv"} and max(p["max_abs_err"].values()) < 0.1
    text = bench.markdown({"device": "cpu", "driver": "-", "torch": "-", "cuda": "-", "commit": "abc", "dirty": False,
                           "sources_sha256": "0123456789abcdef", "date": "today", "command": "cmd",
                           "matmul_peak_tflops": {"bfloat16": 50.0}, "points": points}, True)  # fmt: skip
    assert text.count("| bfloat16 |") == 3 * len(points) and "checked" in text and "Failures" not in text
    assert "sources 0123456789ab" in text  # the kernels measured, named by the hash of their sources


def test_launch_orders_are_variants_of_each_family() -> None:
    """--launch-order times each family under each ENTROPY_ATTN_CUDA_LAUNCH_ORDER, set before the
    call and recorded; the table names a non-default order; bad values are refused."""
    import torch_ext

    seen: List[str] = []

    class Recording:  # the CPU op, noting the launch order each call ran under
        def attention(self, *a: Any, **kw: Any) -> Any:
            seen.append(os.environ[bench.LAUNCH_ORDER_ENV])
            return torch_ext.attention(*a, **kw)

    s = shape(heads=4, kv_heads=2, seq_len=64, causal=True)
    points = bench.measure_shape(s, ["auto", "sm80"], cpu_run(Recording()), None, None, ["auto", "heads"])
    assert [(p["family"], p["launch_order"]) for p in points] == [
        ("auto", "auto"), ("auto", "heads"), ("sm80", "auto"), ("sm80", "heads")]
    assert "auto" in seen and "heads" in seen
    text = bench.markdown({"device": "cpu", "driver": "-", "torch": "-", "cuda": "-", "commit": "abc", "dirty": False,
                           "date": "today", "command": "cmd", "matmul_peak_tflops": {"bfloat16": 50.0},
                           "points": points}, True)  # fmt: skip
    assert "| sm80, order heads |" in text and "| sm80 |" in text
    skipped = bench.measure_shape(s, ["auto"], cpu_run(Recording()), None, free=1, launch_orders=["auto", "3"])
    assert [(p["launch_order"], p["skipped"] is not None) for p in skipped] == [("auto", True), ("3", True)]
    assert bench.parse_args(["--launch-order", "auto", "heads", "4"]).launch_order == ["auto", "heads", "4"]
    for bad in ("0", "lpt", "-1"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--launch-order", bad])


def test_persistent_settings_are_variants_of_each_family(monkeypatch: pytest.MonkeyPatch) -> None:
    """--persistent times each family under each ENTROPY_ATTN_CUDA_PERSISTENT, set before the call
    (unset for "default") and recorded; the table names a setting; bad values are refused."""
    import torch_ext

    seen: List[Optional[str]] = []

    class Recording:  # the CPU op, noting the setting each call ran under
        def attention(self, *a: Any, **kw: Any) -> Any:
            seen.append(os.environ.get(bench.PERSISTENT_ENV))
            return torch_ext.attention(*a, **kw)

    monkeypatch.setenv(bench.PERSISTENT_ENV, "7")  # (replaced, then unset for "default")
    s = shape(heads=4, kv_heads=2, seq_len=64)
    points = bench.measure_shape(s, ["sm90"], cpu_run(Recording()), None, None, persistents=["default", "on"])
    assert [(p["family"], p["persistent"]) for p in points] == [("sm90", "default"), ("sm90", "on")]
    assert None in seen and "on" in seen and "7" not in seen
    text = bench.markdown({"device": "cpu", "driver": "-", "torch": "-", "cuda": "-", "commit": "abc", "dirty": False,
                           "date": "today", "command": "cmd", "matmul_peak_tflops": {"bfloat16": 50.0},
                           "points": points}, True)  # fmt: skip
    assert "| sm90, persistent on |" in text and "| sm90 |" in text
    assert bench.parse_args(["--persistent", "off", "on", "132"]).persistent == ["off", "on", "132"]
    assert bench.parse_args([]).persistent == ["default"]
    for bad in ("0", "all", "-1"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--persistent", bad])


def test_dropout_runs_in_both_and_refuses_check(capsys: pytest.CaptureFixture[str]) -> None:
    """--dropout-p reaches ours and SDPA (the point and the report say so); --check with it, whose
    masks differ, and a p outside [0, 1) are argument errors."""
    import torch_ext

    args = bench.parse_args(["--quick", "--dropout-p", "0.1"])
    assert {s.dropout_p for s in bench.expand_grid(args)} == {0.1}
    calls: List[float] = []

    class Recording:
        def attention(self, *a: Any, **kw: Any) -> Any:
            calls.append(kw["dropout_p"])
            return torch_ext.attention(*a, **kw)

    s = shape(seq_len=32, causal=True, dropout_p=0.1)
    (p,) = bench.measure_shape(s, ["auto"], cpu_run(Recording()), None, None)
    assert calls and set(calls) == {0.1} and p["dropout_p"] == 0.1 and p["errors"] == []
    text = bench.markdown({"device": "cpu", "driver": "-", "torch": "-", "cuda": "-", "commit": "abc", "dirty": False,
                           "date": "today", "command": "cmd", "matmul_peak_tflops": {}, "dropout_p": 0.1,
                           "points": [p]}, True)  # fmt: skip
    assert "dropout p = 0.1" in text
    for bad in (["--check", "--dropout-p", "0.1"], ["--dropout-p", "1.0"], ["--dropout-p", "-0.5"]):
        with pytest.raises(SystemExit) as exc:
            bench.parse_args(bad)
        assert exc.value.code == 2 and "--dropout-p" in capsys.readouterr().err


def test_projection_layout_calls_both_as_a_model_layer() -> None:
    """--layout projection gives ours and SDPA (B, L, H * D) projections, split into heads inside
    the timed call (so fwd_bwd's gradients go back through the split), and times the merge of their
    outputs into (B, L, H * Dv) with them (the point and the table say so); ours' output then merges
    without a copy, and the check still compares the two."""
    import torch_ext

    args = bench.parse_args(["--quick", "--layout", "bhld", "projection"])
    assert [s.layout for s in bench.expand_grid(args)][:2] == ["bhld", "projection"]
    seen: List[Any] = []

    class Recording:  # the CPU op, noting its query's strides and its output
        def attention(self, *a: Any, **kw: Any) -> Any:
            res = torch_ext.attention(*a, **kw)
            out = res[0] if isinstance(res, tuple) else res
            seen.append((a[0].transpose(1, 2).is_contiguous(), bench.merged_heads(out)._base is not None))
            return res

    s = shape(seq_len=32, causal=True, layout="projection")
    x = bench.make_inputs(s, "cpu")
    assert x.q.shape == (2, 32, 64) and x.q.is_contiguous() and x.q.requires_grad and x.dout.shape == (2, 32, 64)
    assert bench.split_heads(x.q, 16).shape == (2, 4, 32, 16)
    (p,) = bench.measure_shape(s, ["auto"], cpu_run(Recording(), check=True), None, None)
    assert p["layout"] == "projection" and p["errors"] == [] and p["mismatch"] is False
    assert seen and all(split and view for split, view in seen)
    text = bench.markdown({"device": "cpu", "driver": "-", "torch": "-", "cuda": "-", "commit": "abc", "dirty": False,
                           "date": "today", "command": "cmd", "matmul_peak_tflops": {}, "points": [p]}, True)  # fmt: skip
    assert "| auto, projection layout |" in text
    with pytest.raises(SystemExit):
        bench.parse_args(["--layout", "blhd"])


def test_padding_mask_hides_each_rows_padding_and_the_future() -> None:
    """padding_mask: batch element b sees its first L - b L // (2B) keys, with causality only those
    up to the query too; the additive mask hides exactly what the bool one does."""
    s = shape(batch=2, seq_len=8, causal=True, mask="bool")
    allowed = bench.padding_mask(s, "cpu")
    assert allowed.shape == (2, 1, 8, 8) and allowed.dtype == torch.bool
    lengths = [8, 6]
    for b, n in enumerate(lengths):
        for i in range(8):
            assert allowed[b, 0, i].tolist() == [j < n and j <= i for j in range(8)]
    additive = bench.padding_mask(bench.Shape(**{**s.__dict__, "mask": "additive"}), "cpu")
    assert additive.dtype == torch.bfloat16 and torch.equal(additive == 0, allowed)
    assert torch.isinf(additive[~allowed]).all() and (additive[~allowed] < 0).all()
    assert bench.padding_mask(shape(mask="none"), "cpu") is None
    full = bench.padding_mask(shape(batch=2, seq_len=8, causal=False, mask="bool"), "cpu")
    assert full[1, 0, 0].tolist() == [j < 6 for j in range(8)]  # no causal part without causality


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_masks_reach_both_calls_and_the_check(kind: str) -> None:
    """--mask: ours and SDPA get the same mask with is_causal off, the check compares them under it
    (and finds ours wrong where it drops the mask), and the point and the table name the mask."""
    import torch_ext

    args = bench.parse_args(["--quick", "--mask", "none", kind])
    assert [s.mask for s in bench.expand_grid(args)][:2] == ["none", kind]
    seen: List[Any] = []

    class Recording:
        def __init__(self, drop_mask: bool = False) -> None:
            self.drop_mask = drop_mask

        def attention(self, *a: Any, **kw: Any) -> Any:
            seen.append((kw.get("attn_mask") is not None, kw["is_causal"]))
            if self.drop_mask:
                kw = {**kw, "attn_mask": None}
            return torch_ext.attention(*a, **kw)

    s = shape(seq_len=48, causal=True, mask=kind)
    (p,) = bench.measure_shape(s, ["auto"], cpu_run(Recording(), check=True), None, None)
    assert p["mask"] == kind and p["errors"] == [] and p["mismatch"] is False
    assert seen and set(seen) == {(True, False)}
    text = bench.markdown({"device": "cpu", "driver": "-", "torch": "-", "cuda": "-", "commit": "abc", "dirty": False,
                           "date": "today", "command": "cmd", "matmul_peak_tflops": {}, "points": [p]}, True)  # fmt: skip
    assert f"| auto, {kind} mask |" in text
    (bad,) = bench.measure_shape(s, ["auto"], cpu_run(Recording(drop_mask=True), check=True), None, None)
    assert bad["mismatch"] is True
    assert bench.estimate_bytes(s, True, False) > bench.estimate_bytes(shape(seq_len=48, causal=True), True, False)


def test_failures_and_out_of_memory_do_not_stop_the_run() -> None:
    s = shape(seq_len=32)
    failed = bench.measure_shape(s, ["auto"], cpu_run(FailingExt(RuntimeError("no kernel\nmore"))), None, None)
    assert failed[0]["fwd"]["ours_ms"] is None and failed[0]["fwd"]["sdpa_ms"] is not None
    assert len(failed[0]["errors"]) == 3 and "no kernel" in failed[0]["errors"][0]
    oom = bench.measure_shape(s, ["auto", "sm80"], cpu_run(FailingExt(torch.cuda.OutOfMemoryError("oom"))), None, None)
    assert [p["skipped"] for p in oom] == ["out of memory"] * 2
    guarded = bench.measure_shape(s, ["auto"], cpu_run(FailingExt(AssertionError("not reached"))), None, free=1)
    assert guarded[0]["skipped"] and "GiB" in guarded[0]["skipped"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: the script would run")
def test_main_without_gpu_exits_0_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    outs = ["--out-md", str(tmp_path / "b.md"), "--out-json", str(tmp_path / "b.json")]
    assert bench.main(["--quick", *outs]) == 0
    assert "no CUDA device" in capsys.readouterr().out
    assert bench.main(["--quick", "--require-gpu", *outs]) == 1
    assert list(tmp_path.iterdir()) == []
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", *outs], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "no CUDA device" in proc.stdout, proc.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []
