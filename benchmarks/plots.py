"""Plots of the CPU benchmark suite's results (suite.py calls write_plots; this also redraws them
from a saved JSON file):

    python3 benchmarks/plots.py benchmarks/results/cpu.json

  * <prefix>_time.png: time vs L per method, log-log, one panel per dtype x causal;
  * <prefix>_ratio.png: ours / SDPA flash (on q·f) vs L, forward and forward+backward, per dtype;
  * <prefix>_memory.png: peak memory vs L per method, log-log, with L and L² guides.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on benchmark machines
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
from matplotlib.ticker import FuncFormatter, NullLocator  # noqa: E402

FAMILY_COLORS = {
    "ours": "tab:red",
    "flash": "tab:blue",
    "math": "tab:green",
    "flex": "tab:purple",
    "eager": "tab:orange",
}
# (method key, legend label, family, backward) of the lines in the time plot
TIME_LINES = [
    ("ours_stats/logn", "ours fwd+stats", "ours", False),
    ("ours_bwd/logn", "ours fwd+bwd", "ours", True),
    ("flash_fwd/logn", "SDPA flash q·f", "flash", False),
    ("flash_bwd/logn", "SDPA flash q·f fwd+bwd", "flash", True),
    ("flash_fwd/none", "SDPA flash, scale None", "flash", False),
    ("math_fwd/logn", "SDPA math q·f", "math", False),
    ("math_bwd/logn", "SDPA math q·f fwd+bwd", "math", True),
    ("flex_fwd/logn", "FlexAttention", "flex", False),
    ("eager_fwd/logn", "eager monitoring", "eager", False),
    ("eager_bwd/logn", "eager monitoring fwd+bwd", "eager", True),
]
MEMORY_LABELS = {
    "ours_stats/logn": ("ours fwd+stats", "ours", "-"),
    "ours_bwd/logn": ("ours fwd+bwd", "ours", "--"),
    "flash_fwd/logn": ("SDPA flash q·f", "flash", "-"),
    "math_fwd/logn": ("SDPA math q·f", "math", "-"),
    "flex_fwd/logn": ("FlexAttention", "flex", "-"),
    "eager_fwd/logn": ("eager monitoring", "eager", "-"),
}


def median_ms(record: dict, key: str) -> float | None:
    """A method's median in ms at a grid point, None if it was not timed."""
    st = record["methods"].get(key)
    return st["median_s"] * 1e3 if st and st["status"] == "ok" else None


def shape_of(point: dict) -> tuple[int, int, int, int]:
    """(D, B, H, Hkv) of a grid point."""
    return point["head_dim"], point["batch"], point["heads"], point["kv_heads"]


def time_group(records: list[dict]) -> tuple[int, int, int, int]:
    """The (D, B, H, Hkv) the time plot shows: D=64, B·H=16 without GQA if the grid has it, else the
    most frequent one."""
    counts = Counter(shape_of(r["point"]) for r in records)
    preferred = [s for s in counts if s[0] == 64 and s[1] * s[2] == 16 and s[2] == s[3]]
    return preferred[0] if preferred else counts.most_common(1)[0][0]


def log2_lengths(ax: Any, lengths: list[int]) -> None:
    """A log-2 x axis labelled with the measured lengths."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths)
    ax.set_xticklabels([str(n) for n in lengths])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("L = Lq = Lk")
    ax.grid(True, which="both", alpha=0.3)


def mantissa(y: float) -> int:
    """The leading digit of y > 0 (3 for 0.03 and 300)."""
    return round(y / 10 ** math.floor(math.log10(y)))


def plain_log_y(ax: Any) -> None:
    """A log y axis with plain numbers (0.5, 20, 300) instead of powers of ten."""
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda y, _: f"{y:g}" if mantissa(y) in (2, 5) else ""))


def plot_time(result: dict, path: Path) -> None:
    """Time vs L per method, one panel per dtype (rows) x causal (columns)."""
    records = result["points"]
    d, b, h, hkv = time_group(records)
    chosen = [r for r in records if shape_of(r["point"]) == (d, b, h, hkv)]
    dtypes = list(dict.fromkeys(r["point"]["dtype"] for r in chosen))
    causals = sorted({r["point"]["causal"] for r in chosen})
    fig, axes = plt.subplots(len(dtypes), len(causals), figsize=(max(9.0, 5.5 * len(causals)), 0.8 + 4.2 * len(dtypes)),
                             squeeze=False, sharey=True)  # fmt: skip
    for row, dtype in enumerate(dtypes):
        for col, causal in enumerate(causals):
            ax = axes[row][col]
            rows = sorted((r for r in chosen if (r["point"]["dtype"], r["point"]["causal"]) == (dtype, causal)),
                          key=lambda r: r["point"]["length"])  # fmt: skip
            for key, label, family, backward in TIME_LINES:
                pts = [(r["point"]["length"], median_ms(r, key)) for r in rows if median_ms(r, key) is not None]
                if pts:
                    style = ":" if key.endswith("/none") else ("--" if backward else "-")
                    ax.plot(*zip(*pts), style, marker="o", ms=3, color=FAMILY_COLORS[family], label=label)
            plain_log_y(ax)
            log2_lengths(ax, [r["point"]["length"] for r in rows])
            ax.set_title(f"{dtype}, {'causal' if causal else 'not causal'}")
        axes[row][0].set_ylabel("time per call (ms)")
    handles: dict[str, Any] = {}  # one legend entry per method over all panels
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=4, fontsize=8, frameon=False)
    heads = f"H={h}" + (f", Hkv={hkv}" if hkv != h else "")
    fig.suptitle(f"Time per call vs L, D={d}, B={b}, {heads}\n"
                 "scale log-n (SDPA, eager: q·f); solid forward, dashed forward+backward, dotted scale None")
    fig.tight_layout(rect=(0, 0.9 / (0.8 + 4.2 * len(dtypes)), 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_ratio(result: dict, path: Path) -> None:
    """ours / SDPA flash (both with the log-n scale) vs L, per dtype (rows) and direction (columns)."""
    records = result["points"]
    dtypes = list(dict.fromkeys(r["point"]["dtype"] for r in records))
    directions = [("forward (+stats)", "ours_stats/logn", "flash_fwd/logn", 1.15, "target: no point above"),
                  ("forward + backward", "ours_bwd/logn", "flash_bwd/logn", 1.2, "target: median below")]  # fmt: skip
    fig, axes = plt.subplots(len(dtypes), 2, figsize=(12, 4.2 * len(dtypes)), squeeze=False)
    configs = list(dict.fromkeys((shape_of(r["point"]), r["point"]["causal"]) for r in records))
    colors = plt.get_cmap("tab10")
    shape_colors = {s: colors(i % 10) for i, s in enumerate(dict.fromkeys(c[0] for c in configs))}
    for row, dtype in enumerate(dtypes):
        for col, (title, ours_key, flash_key, target, target_text) in enumerate(directions):
            ax = axes[row][col]
            for shape, causal in configs:
                rows = sorted((r for r in records if r["point"]["dtype"] == dtype and shape_of(r["point"]) == shape
                               and r["point"]["causal"] == causal), key=lambda r: r["point"]["length"])  # fmt: skip
                pts = [(r["point"]["length"], median_ms(r, ours_key) / median_ms(r, flash_key)) for r in rows
                       if median_ms(r, ours_key) is not None and median_ms(r, flash_key)]  # fmt: skip
                if pts:
                    d, b, h, hkv = shape
                    label = f"D={d} B={b} H={h}" + (f":{hkv}" if hkv != h else "") + (" causal" if causal else "")
                    style = "--" if causal else "-"
                    ax.plot(*zip(*pts), style, marker="o", ms=3, color=shape_colors[shape], label=label)
            ax.axhline(1.0, color="black", lw=0.8)
            ax.axhline(target, color="gray", lw=0.8, ls=":", label=f"{target_text} {target}x")
            log2_lengths(ax, sorted({r["point"]["length"] for r in records}))
            ax.set_ylabel("ours / SDPA flash on q·f (lower is better)")
            ax.set_title(f"{dtype}, {title}")
            ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_memory(result: dict, path: Path) -> None:
    """Peak memory vs L, log-log, with slope-1 and slope-2 guides."""
    fig, ax = plt.subplots(figsize=(7, 5))
    lengths = sorted({r["length"] for r in result["memory"]})
    for key, (label, family, style) in MEMORY_LABELS.items():
        pts = sorted((r["length"], r["peak_bytes"] / 2**20) for r in result["memory"]
                     if r["method"] == key and r["status"] == "ok" and r["peak_bytes"] > 0)  # fmt: skip
        if pts:
            slope = result["memory_slopes"].get(key)
            text = f" (slope {slope:.2f})" if slope is not None else ""
            ax.plot(*zip(*pts), style, marker="o", color=FAMILY_COLORS[family], label=label + text)
    # guides start half a decade below the smallest first point, so they do not hide the data
    firsts = [line.get_ydata()[0] for line in ax.get_lines()]
    if firsts:
        y0, x0 = min(firsts) / 3, lengths[0]
        for power, name, style in ((1, "guide ∝ L", ":"), (2, "guide ∝ L²", "-.")):
            ax.plot(lengths, [y0 * (n / x0) ** power for n in lengths], color="gray", lw=0.8, ls=style, label=name)
    plain_log_y(ax)
    log2_lengths(ax, lengths)
    ax.set_ylabel("peak RSS above the inputs (MiB)")
    ax.set_title("Peak memory (B=1, H=8, D=64, float32, not causal)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_plots(result: dict, out: Path, prefix: str) -> list[Path]:
    """Draw the plots the result has data for; returns the files written."""
    written = []
    if result["points"]:
        for name, fn in (("time", plot_time), ("ratio", plot_ratio)):
            path = out / f"{prefix}_{name}.png"
            fn(result, path)
            written.append(path)
    if any(r["status"] == "ok" for r in result["memory"]):
        path = out / f"{prefix}_memory.png"
        plot_memory(result, path)
        written.append(path)
    return written


def main() -> None:
    """Redraw the plots of a saved cpu.json next to it."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", type=Path)
    args = p.parse_args()
    result = json.loads(args.json.read_text())
    for path in write_plots(result, args.json.parent, args.json.stem):
        print(path)


if __name__ == "__main__":
    main()
