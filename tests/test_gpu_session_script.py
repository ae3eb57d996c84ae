"""scripts/gpu_session.sh, the checks that fit one command on a GPU lent for minutes: without a GPU
it stops at once, with exit code 2 and a message, before it installs or writes anything; with a
bundle of other sources it stops before installing; run through (stand-ins for everything it
calls), every file it leaves in OUT comes back from the device tool."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _has_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None and subprocess.run(
        ["nvidia-smi", "-L"], capture_output=True).returncode == 0


@pytest.mark.skipif(_has_gpu(), reason="a GPU is here: the script would run its checks")
def test_stops_without_a_gpu(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_session.sh")], cwd=ROOT,
                          env={**os.environ, "OUT": str(out)}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "gpu_session: no GPU here" in done.stderr
    assert not any(out.iterdir()), "it wrote results without a GPU"


def test_refuses_a_bundle_of_other_sources(tmp_path: Path) -> None:
    """With a GPU (a stand-in nvidia-smi) but a .device/ made from other sources, it stops before
    installing: the library would be built on the GPU machine, at the lease's expense."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "gpu_session.sh", tmp_path / "scripts")
    (tmp_path / "scripts" / "sources_hash.sh").write_text("echo these-sources\n")
    (tmp_path / "scripts" / "device_bundle.sh").write_text("echo installed > installed.txt\n")
    (tmp_path / ".device").mkdir()
    (tmp_path / ".device" / "sources.sha256").write_text("other-sources\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA H200, 580.159.04, 143771 MiB, 345 MHz'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", str(tmp_path / "scripts" / "gpu_session.sh")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "made from other sources" in done.stderr and not (tmp_path / "installed.txt").exists()


def test_refuses_a_harness_of_another_source(tmp_path: Path) -> None:
    """A .device/ whose library matches these sources but whose harness was built from another
    harness source (scripts/sources_hash.sh --harness) is refused too: its timings would leave out
    what the harness's change added."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "gpu_session.sh", tmp_path / "scripts")
    (tmp_path / "scripts" / "sources_hash.sh").write_text(
        '[[ ${1:-} == --harness ]] && echo this-harness || echo these-sources\n')
    (tmp_path / "scripts" / "device_bundle.sh").write_text("echo installed > installed.txt\n")
    (tmp_path / ".device").mkdir()
    (tmp_path / ".device" / "sources.sha256").write_text("these-sources\n")
    (tmp_path / ".device" / "harness.sha256").write_text("another-harness\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA H200, 580.159.04, 143771 MiB, 345 MHz'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    # (DEADLINE=1: past the install, every step is skipped.)
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "DEADLINE": "1"}

    def run() -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(tmp_path / "scripts" / "gpu_session.sh")], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60)

    done = run()
    assert done.returncode == 2 and "another harness source" in done.stderr, done.stdout + done.stderr
    assert not (tmp_path / "installed.txt").exists()
    # With the harness's hash matching, it goes on to install.
    (tmp_path / ".device" / "harness.sha256").write_text("this-harness\n")
    run()
    assert (tmp_path / "installed.txt").exists()


#: A stand-in kernel harness: its checks pass, and its timings (--json) hold one point.
FAKE_HARNESS = """#!/bin/bash
json=""; commit=""; prev=""
for a in "$@"; do [[ $prev == --json ]] && json=$a; [[ $prev == --commit ]] && commit=$a; prev=$a; done
[[ -n $json ]] && echo '{"device": "stub", "commit": "'$commit'", "checks": [], "points": [{"family": "sm90",
  "dtype": "bf16", "batch": 4, "heads": 16, "kv_heads": 16, "head_dim": 128, "seq_len": 4096,
  "causal": false, "fwd_ms": 1.0, "fwd_stats_ms": 1.1, "fwd_bwd_ms": 4.0}]}' > "$json"
echo "3 checks, 0 failed"
"""


def _stand_ins(tmp_path: Path) -> dict[str, str]:
    """A tree in tmp_path with the script, stand-ins for the GPU, the bundle, Python, the
    harnesses (the baseline, steps 7ae3efb and 73fc850) and compute-sanitizer; the environment
    that runs it there (DEADLINE 120)."""
    (tmp_path / "scripts").mkdir()
    for name in ("gpu_session.sh", "harness_ab.py"):
        shutil.copy(ROOT / "scripts" / name, tmp_path / "scripts")
    (tmp_path / "scripts" / "sources_hash.sh").write_text("echo these-sources\n")
    (tmp_path / "scripts" / "device_bundle.sh").write_text("echo installed\n")
    (tmp_path / ".device").mkdir()
    (tmp_path / ".device" / "sources.sha256").write_text("these-sources\n")
    (tmp_path / ".device" / "harness.sha256").write_text("these-sources\n")
    (tmp_path / ".device" / "baseline").write_text("d499297\n")
    (tmp_path / ".device" / "steps").write_text("7ae3efb 73fc850\n")
    bin_dir, build = tmp_path / "bin", tmp_path / "build"
    bin_dir.mkdir()
    build.mkdir()
    stubs = {
        bin_dir / "nvidia-smi": "#!/bin/sh\necho 'NVIDIA H200, 580.159.04, 143771 MiB, 345 MHz'\n",
        build / "kernel_harness": FAKE_HARNESS,
        build / "kernel_harness_baseline": FAKE_HARNESS,
        build / "kernel_harness_7ae3efb": FAKE_HARNESS,
        build / "kernel_harness_73fc850": FAKE_HARNESS,
        bin_dir / "fake-sanitizer": '#!/bin/bash\necho "$@" >> sanitizer_calls.txt\n'
                                    '[[ $* != *memcheck* || $PYTORCH_NO_CUDA_MEMORY_CACHING == 1 ]] || exit 3\n',
        # Python: pytest passes, harness_ab.py runs, the benchmarks write their --out-md/--out-json.
        bin_dir / "fake-python": f"""#!/bin/bash
[[ $1 == -m ]] && {{ echo "3 passed in 0.1s"; exit 0; }}
[[ $1 == scripts/harness_ab.py ]] && exec "{sys.executable}" "$@"
prev=""
for a in "$@"; do [[ $prev == --out-md || $prev == --out-json || $prev == --out ]] && echo stub > "$a"; prev=$a; done
exit 0
""",
    }
    for path, text in stubs.items():
        path.write_text(text)
        path.chmod(0o755)
    return {**os.environ, "OUT": str(tmp_path / "out"), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "PYTHON": str(bin_dir / "fake-python"), "SANITIZER": str(bin_dir / "fake-sanitizer"), "NCU": "fake-ncu",
            "COMMIT": "abc", "SHARDS": "1", "DEADLINE": "120"}


def test_every_result_comes_back(tmp_path: Path) -> None:
    """Run through with stand-ins, the script leaves in OUT at most the 8 files the device tool
    brings back (names of letters, digits, '.', '_' and '-'), the harnesses' comparison among them
    (with the steps between the baseline and the current kernels), and the JSON of the other steps
    in the packed logs (the profile's among them); it runs the persistent grid's racecheck."""
    env = _stand_ins(tmp_path)
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(tmp_path / "scripts" / "gpu_session.sh")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "cut by the deadline" not in done.stdout
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8, f"{len(files)} files in OUT, the device tool brings back 8: {files}"
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", f) for f in files) and all((out / f).is_file() for f in files)
    assert {"benchmark.md", "benchmark.json", "harness.md", "harness_ab.md", "logs.tar.xz"} <= set(files)
    assert "(1.000)" in (out / "harness_ab.md").read_text()
    with tarfile.open(out / "logs.tar.xz") as logs:
        names = {Path(n).name for n in logs.getnames()}
    assert {"harness.json", "harness_baseline.json", "persistent.json", "decode.json", "launch_order.json",
            "harness_2.json", "harness_baseline_2.json", "harness_7ae3efb.json", "harness_73fc850.json",
            "profile.md", "profile_stats.md", "harness_ab_steps.md", "masks.json", "masks.md",
            "head_dim_256.md", "head_dim_256.json", "learned_bias", "learned_bias_sm90", "deterministic", "deterministic_fallback",
            "call_overhead.md"} <= names
    with tarfile.open(out / "logs.tar.xz") as logs:
        member = next(m for m in logs.getmembers() if m.name.endswith("harness_ab_steps.md"))
        first = logs.extractfile(member).read().decode()
    assert "| d499297 → 7ae3efb | 1.000 |" in first and "1 run(s)" in first  # before the second runs
    assert "2 run(s)" in (out / "harness_ab.md").read_text()  # compared again over both runs
    # With the steps between (device_bundle.sh: STEPS), in their order, in both comparisons.
    assert "| d499297 → 7ae3efb | 1.000 |" in (out / "harness_ab.md").read_text()
    assert "| 73fc850 → abc | 1.000 |" in (out / "harness_ab.md").read_text()
    # What decides which kernels to keep (the harnesses), then the record against SDPA, before the
    # tests with a family forced; the steps' harnesses after those.
    notes = [line for line in done.stdout.splitlines() if line.startswith(":::")]
    order = ["pytest auto", "pytest hopper deterministic", "harness timings (sm90)", "benchmark against SDPA", "pytest sm90", "pytest sm80",
             "harness timings of step 7ae3efb", "profile of the statistics", "second harness timings",
             "masks", "head dim 256", "learned bias", "deterministic backward", "call overhead", "profile (Nsight Compute)"]
    at = [next(i for i, line in enumerate(notes) if line.startswith(f"::: {name}")) for name in order]
    assert at == sorted(at), notes
    # The persistent grid's pass of the sanitizer grid, under racecheck.
    assert "--tool racecheck" in (tmp_path / "sanitizer_calls.txt").read_text()
    calls = (tmp_path / "sanitizer_calls.txt").read_text().splitlines()
    assert calls[0].endswith("scripts/cuda_sanitizer_grid.py --passes sm90-persistent"), calls
    # And, as time allows, over the Hopper family's forward and backward.
    assert calls[1].endswith("scripts/cuda_sanitizer_grid.py --passes sm90"), calls
    # And over its backward under deterministic algorithms.
    assert calls[2].endswith("scripts/cuda_sanitizer_grid.py --passes sm90-deterministic"), calls
    # And memcheck over the masks that end within a word of their storage's end, each tensor its own
    # allocation.
    assert calls[3].startswith("--tool memcheck"), calls
    assert calls[3].endswith("--passes sm80 sm90 --head-dims 64 128 --variants bool_mask_tight additive_mask_tight"), calls


#: A stand-in timeout: the step harness of 7ae3efb runs out of its time, everything else runs.
FAKE_TIMEOUT = """#!/bin/bash
[[ $1 == -k ]] && shift 2
shift
[[ $1 == */kernel_harness_7ae3efb ]] && exit 124
exec "$@"
"""


@pytest.mark.parametrize("deadline, code", [(30, 0), (1000, 1)])
def test_a_step_as_time_allows_cut_by_the_deadline(tmp_path: Path, deadline: int, code: int) -> None:
    """A step as time allows (a step's harness) that times out when the deadline capped its time
    is listed as cut, and the run passes (DEADLINE 30, under that step's 60 s); the same time-out
    within its own bound, the deadline far, is a hang: the run fails."""
    env = _stand_ins(tmp_path)
    (tmp_path / "bin" / "timeout").write_text(FAKE_TIMEOUT)
    (tmp_path / "bin" / "timeout").chmod(0o755)
    env["DEADLINE"] = str(deadline)
    done = subprocess.run(["bash", str(tmp_path / "scripts" / "gpu_session.sh")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == code, done.stdout + done.stderr
    if code == 0:
        assert "harness timings (harness_7ae3efb): cut by the deadline" in done.stdout
        assert "::: cut by the deadline: harness timings (harness_7ae3efb);" in done.stdout
    else:
        assert "harness timings (harness_7ae3efb): exit 124" in done.stdout
    # The steps before the ones as time allows passed either way.
    assert "harness timings (harness): exit 0" in done.stdout and "benchmark: exit 0" in done.stdout
