"""What the benchmark scripts share: torch's deterministic algorithms for a block, the median time
of a call with torch's threads, calls timed interleaved over rounds, the fastest of a few calls,
the name of the device it ran on, the command line of a script that prints one table over its
points, and the short commit and the Markdown and JSON files of a script that writes
results/<name>/<device>.{md,json}."""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Sequence, Tuple, TypeVar

import torch
import torch.utils.benchmark as tb


@contextlib.contextmanager
def deterministic_algorithms(on: bool) -> Iterator[None]:
    """torch.use_deterministic_algorithms(on) for the block, the previous setting and its warn_only
    restored after."""
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(on)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)


def median_ms(fn: Callable[[], object], min_run_time: float) -> float:
    """Median wall time of fn() in ms, after one warm-up call, with the threads torch uses
    (torch.utils.benchmark's Timer would otherwise run on one thread; it synchronizes CUDA)."""
    fn()
    timer = tb.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e3


def interleaved(fns: Dict[str, Callable[[], object]], repeats: int, min_run_time: float,
                ratios: Sequence[Tuple[str, str]] = ()) -> Dict[str, float]:
    """``median_ms`` of each call in each of ``repeats`` rounds, the calls taking turns within a
    round (so that the machine's drifts reach all of them): the median of each call's times, and
    for each pair (a, b) of ``ratios`` the median of the per-round ratios a / b under "a/b"."""
    rounds = [{name: median_ms(fn, min_run_time) for name, fn in fns.items()} for _ in range(repeats)]
    result = {name: statistics.median(r[name] for r in rounds) for name in fns}
    for a, b in ratios:
        result[f"{a}/{b}"] = statistics.median(r[a] / r[b] for r in rounds)
    return result


def fastest_ms(fn: Callable[[], object], reps: int) -> float:
    """The fastest of `reps` calls of fn() in ms, after one warm-up call (for scripts that time each
    setting in fresh processes, where the machine's noise only ever adds time)."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else the machine type."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def device_name(device: str) -> str:
    """The GPU's name, or the CPU's with the threads torch uses."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name()
    return f"{cpu_name()} ({torch.get_num_threads()} threads)"


Point = TypeVar("Point")


def positive_int(text: str) -> int:
    """argparse type: an int >= 1 (counts of repeats, threads, lengths: 0 left the scripts dividing
    by it, or taking the median of nothing, with a traceback)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def available_device(text: str) -> str:
    """argparse type: a device this machine has ('cuda' without a GPU is an argument error, not a
    RuntimeError from the first tensor made there)."""
    try:
        device = torch.device(text)
    except RuntimeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError("CUDA is not available on this machine")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"this machine has {torch.cuda.device_count()} CUDA device(s), no {text}")
    return text


def points_main(description: str, table: Callable[[List[Point], int, float], str], points: Sequence[Point],
                quick: Sequence[Point], argv: List[str] | None = None) -> None:
    """Parses ``--quick`` (the quick points, one round, short timings), ``--repeats`` (interleaved
    rounds per point) and ``--min-run-time`` (seconds per timing), then prints the CPU, torch's
    version and ``table(points, repeats, min_run_time)``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="small points, seconds")
    parser.add_argument("--repeats", type=positive_int, default=5, help="interleaved rounds per point")
    parser.add_argument("--min-run-time", type=float, default=0.3, help="seconds per timing")
    args = parser.parse_args(argv)
    print(f"{device_name('cpu')}, torch {torch.__version__}\n")
    print(table(list(quick if args.quick else points), 1 if args.quick else args.repeats,
                0.05 if args.quick else args.min_run_time))


def short_commit(root: Path) -> str:
    """The checkout's commit, abbreviated ('' outside a git checkout)."""
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=root).stdout.strip()


def write_result(out: Path, device: str, result: Dict[str, object], text: str) -> None:
    """result as out/<cuda|cpu>.json, the table text as out/<cuda|cpu>.md, and the text printed."""
    out.mkdir(parents=True, exist_ok=True)
    tag = "cuda" if device == "cuda" else "cpu"
    (out / f"{tag}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{tag}.md").write_text(text)
    print(text)
