"""Compares two runs of the kernel harness made in one GPU lease: the kernels of a baseline commit
(the last ones timed on a GPU; scripts/device_bundle.sh packs their harness) against the current
ones, point by point.

A GPU is lent for minutes, a different machine each time: the figures of an earlier lease differ
from today's by a few percent of clocks and neighbours, as much as the changes to be judged. Two
harnesses run back to back on the same GPU do not (scripts/gpu_session.sh runs both).

    python3 scripts/harness_ab.py --baseline B.json [B2.json ...] --current C.json [C2.json ...]
                                  [--steps S.json ...] [--out-md F]

prints (or writes) a Markdown table: per timed point, the milliseconds of the forward without and
with statistics, of the backward alone (forward + statistics + backward less the forward with
statistics) and of the three together, and of the backward of a loss with the statistics'
upstream gradients (an entropy regularizer's), each as baseline → current and their ratio (below 1: the
current kernels take less time), then the geometric mean of each ratio and the checks that failed
in any run. With several runs of a side, each point takes that side's least time over its runs
(what the clocks and neighbours of a lease add to a kernel's time is never negative: two runs of
the same kernels in one lease differed by up to 11% at a point).

    ... --steps S1.json [S1b.json] S2.json ...

also times the commits between the two (scripts/device_bundle.sh: STEPS), oldest first, their runs
told apart by the commit each JSON names: the report then adds what each step bought, baseline →
S1 → S2 → ... → current, each step's geometric mean ratio to the commit before it per column, then
each column's milliseconds per point along the chain (each commit by its least times over as many
runs as the commit with the fewest has, its first ones). Several changes untimed since the
baseline are then judged each by its own step, not by their product alone.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

Key = Tuple[Any, ...]
#: What makes two timed points the same call.
KEY_FIELDS = ("family", "dtype", "batch", "heads", "kv_heads", "head_dim", "seq_len", "causal")
#: The timings of a point, as the harness's JSON names them.
FIELDS = ("fwd_ms", "fwd_stats_ms", "fwd_bwd_ms", "fwd_bwd_reg_ms")


def backward_ms(point: Dict[str, Any], total: str) -> Optional[float]:
    """A backward's milliseconds: timing `total` (forward + statistics + backward) less the forward
    with statistics; None where either is missing or was not timed (the harness writes 0 then)."""
    whole, forward = point.get(total), point.get("fwd_stats_ms")
    if whole is None or forward is None or whole <= 0 or forward <= 0:
        return None
    return whole - forward


#: The columns: a name, how to read its milliseconds from a point, and the timings it comes from.
COLUMNS = (
    ("fwd", lambda p: p.get("fwd_ms"), ("fwd_ms",)),
    ("fwd+stats", lambda p: p.get("fwd_stats_ms"), ("fwd_stats_ms",)),
    ("bwd", lambda p: backward_ms(p, "fwd_bwd_ms"), ("fwd_stats_ms", "fwd_bwd_ms")),
    ("fwd+stats+bwd", lambda p: p.get("fwd_bwd_ms"), ("fwd_bwd_ms",)),
    # The backward of an entropy regularizer's loss (the statistics' upstream gradients too); a
    # harness built before this column has none ("—").
    ("bwd reg", lambda p: backward_ms(p, "fwd_bwd_reg_ms"), ("fwd_stats_ms", "fwd_bwd_reg_ms")),
)  # fmt: skip
#: Where a side's runs of a timing differ by more than this factor (largest / least), its cells are
#: marked: two runs of the same kernels in one lease mostly agreed within 3.5%.
NOISY = 1.035


def key_of(point: Dict[str, Any]) -> Key:
    """The call a timed point measured."""
    return tuple(point.get(f) for f in KEY_FIELDS)


def ratio(base: Optional[float], current: Optional[float]) -> Optional[float]:
    """current / base, or None where either is missing or the base is not positive."""
    if base is None or current is None or base <= 0:
        return None
    return current / base


def geometric_mean(values: Sequence[float]) -> Optional[float]:
    """The geometric mean of positive values; None for none."""
    good = [v for v in values if v > 0]
    return math.exp(sum(math.log(v) for v in good) / len(good)) if good else None


def failed_checks(run: Dict[str, Any]) -> List[str]:
    """The checks of a run that failed, as 'family dtype call: what'."""
    return [f"{c.get('family')} {c.get('dtype')} {c.get('call')}: {c.get('what')}"
            for c in run.get("checks", []) if not c.get("ok", False)]


def fmt_ms(x: Optional[float]) -> str:
    return "—" if x is None else f"{x:.4g}"


def fmt_ratio(x: Optional[float]) -> str:
    return "—" if x is None else f"{x:.3f}"


def point_cells(p: Dict[str, Any]) -> str:
    """The cells that name a timed point's call, the row's start in both reports' tables."""
    causal = "yes" if p.get("causal") else "no"
    return (f"| {p.get('family')} | {p.get('dtype')} | {p.get('batch')} | {p.get('heads')}:{p.get('kv_heads')} | "
            f"{p.get('head_dim')} | {p.get('seq_len')} | {causal} | ")


def least_times(runs: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """One run of several of the same kernels: each point's least time over the runs for each
    timing (a timing missing in every run stays missing) and, in "spread", the largest over the
    least; every run's checks."""
    merged = dict(runs[0])
    times: Dict[Key, Dict[str, List[float]]] = {}
    points: Dict[Key, Dict[str, Any]] = {}
    for run in runs:
        for p in run.get("points", []):
            points.setdefault(key_of(p), dict(p))
            for field in FIELDS:
                if p.get(field) is not None:
                    times.setdefault(key_of(p), {}).setdefault(field, []).append(p[field])
    for k, p in points.items():
        seen = times.get(k, {})
        for field in FIELDS:
            p[field] = min(seen[field]) if field in seen else None
        p["spread"] = {f: max(t) / min(t) for f, t in seen.items() if min(t) > 0}
    merged["points"] = list(points.values())
    merged["checks"] = [c for run in runs for c in run.get("checks", [])]
    merged["runs"] = len(runs)
    return merged


def compare(base: Dict[str, Any], current: Dict[str, Any]) -> str:
    """The Markdown report of two harness runs (their JSON, as `kernel_harness --json` writes it,
    or least_times of several)."""
    base_points = {key_of(p): p for p in base.get("points", [])}
    current_points = {key_of(p): p for p in current.get("points", [])}
    keys = list(base_points) + [k for k in current_points if k not in base_points]
    lines = [
        f"# Kernel harness: {current.get('commit', '?')} against {base.get('commit', '?')}, "
        f"{current.get('device', '?')}",
        "",
        f"In one lease: baseline on {base.get('device', '?')} (commit {base.get('commit', '?')}, "
        f"{base.get('runs', 1)} run(s)), current on {current.get('device', '?')} (commit "
        f"{current.get('commit', '?')}, {current.get('runs', 1)} run(s)). Milliseconds (medians of CUDA "
        "events; the least over a side's runs), baseline → current, and current / baseline (below 1: "
        "less time now). bwd = fwd+stats+bwd − fwd+stats, of a loss of the output alone; bwd reg: the same "
        "with the statistics' upstream gradients too (an entropy regularizer's loss).",
        "",
        "| family | dtype | B | H:Hkv | D | L | causal | " + " | ".join(c[0] for c in COLUMNS) + " |",
        "|" + "---|" * (7 + len(COLUMNS)),
    ]
    ratios: Dict[str, List[float]] = {c[0]: [] for c in COLUMNS}
    for k in keys:
        b, c = base_points.get(k), current_points.get(k)
        p = c or b
        cells = []
        for name, read, fields in COLUMNS:
            bm, cm = (read(b) if b else None), (read(c) if c else None)
            r = ratio(bm, cm)
            if r is not None:
                ratios[name].append(r)
            noisy = any(q.get("spread", {}).get(f, 1.0) > NOISY for q in (b, c) if q for f in fields)
            cells.append(f"{fmt_ms(bm)} → {fmt_ms(cm)} ({fmt_ratio(r)}){' ~' if noisy else ''}")
        lines.append(point_cells(p) + " | ".join(cells) + " |")
    lines += ["", "Geometric mean of current / baseline over the points both timed: "
              + ", ".join(f"{c[0]} {fmt_ratio(geometric_mean(ratios[c[0]]))}" for c in COLUMNS) + ".",
              "", f"~: a side's runs of that timing differed by more than {(NOISY - 1) * 100:.1f}% at that point "
              "(only with several runs of a side)."]
    for label, run in (("baseline", base), ("current", current)):
        failed = failed_checks(run)
        lines.append("")
        if failed:
            lines.append(f"Checks failed in the {label} run ({len(failed)} of {len(run.get('checks', []))}):")
            lines += [f"- {f}" for f in failed[:20]]
        else:
            lines.append(f"Checks of the {label} run: {len(run.get('checks', []))}, none failed.")
    return "\n".join(lines) + "\n"


def chain_of(base_runs: Sequence[Dict[str, Any]], step_runs: Sequence[Dict[str, Any]],
             current_runs: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The chain of steps(): the baseline, the steps' commits in the order each first appears among
    step_runs (told apart by the commit each run names), the current kernels; each commit's least
    times over as many of its runs as the commit with the fewest has (its first ones): a least time
    over two runs against one run is biased low (two runs of the same kernels, 1.04 and 1.00 ms,
    would make the step after a single run look 4% faster)."""
    by_commit: Dict[str, List[Dict[str, Any]]] = {}
    for run in step_runs:
        by_commit.setdefault(str(run.get("commit", "?")), []).append(run)
    groups = [list(base_runs), *by_commit.values(), list(current_runs)]
    runs = min(len(group) for group in groups)
    return [least_times(group[:runs]) for group in groups]


def steps(chain: Sequence[Dict[str, Any]]) -> str:
    """The Markdown section of what each step of a chain of runs bought (baseline first, current
    last): per step and column the geometric mean of its ratio to the commit before it over the
    points both timed, then per column each point's milliseconds along the chain and each step's
    ratio to the one before."""
    names = [str(run.get("commit", "?")) for run in chain]
    points = [{key_of(p): p for p in run.get("points", [])} for run in chain]
    keys: List[Key] = []
    for by_key in points:
        keys += [k for k in by_key if k not in keys]
    lines = [
        "## What each step bought",
        "",
        f"The same points timed with the kernels of each commit, in this lease: {' → '.join(names)}. "
        "Each ratio is a commit's time over that of the commit before it (below 1: the step took time off); "
        "at a point, the steps' ratios multiply to the current kernels' time over the baseline's (from the "
        "same number of runs of each commit, so it may differ a little from the table above). Geometric "
        "means over the points both commits timed:",
        "",
        "| step | " + " | ".join(c[0] for c in COLUMNS) + " | checks failed |",
        "|" + "---|" * (2 + len(COLUMNS)),
    ]
    for i in range(1, len(chain)):
        before, after = points[i - 1], points[i]
        both = [k for k in keys if k in before and k in after]
        means = []
        for _, read, _ in COLUMNS:
            rs = [ratio(read(before[k]), read(after[k])) for k in both]
            means.append(fmt_ratio(geometric_mean([r for r in rs if r is not None])))
        lines.append(f"| {names[i - 1]} → {names[i]} | " + " | ".join(means)
                     + f" | {len(failed_checks(chain[i]))} |")
    for name, read, _ in COLUMNS:
        lines += ["", f"### {name} (ms; in brackets, the ratio to the commit before)", "",
                  "| family | dtype | B | H:Hkv | D | L | causal | " + " | ".join(names) + " |",
                  "|" + "---|" * (7 + len(names))]
        for k in keys:
            ms = [read(by_key[k]) if k in by_key else None for by_key in points]
            cells = [fmt_ms(ms[0])] + [f"{fmt_ms(ms[j])} ({fmt_ratio(ratio(ms[j - 1], ms[j]))})"
                                       for j in range(1, len(ms))]
            p = next(by_key[k] for by_key in points if k in by_key)
            lines.append(point_cells(p) + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, nargs="+", required=True,
                        help="the baseline harness's --json, one file per run")
    parser.add_argument("--current", type=Path, nargs="+", required=True,
                        help="the current harness's --json, one file per run")
    parser.add_argument("--steps", type=Path, nargs="*", default=[],
                        help="the harness's --json of the commits between, oldest first (a commit's "
                        "runs told apart by its name)")
    parser.add_argument("--out-md", type=Path, help="write the report here (default: stdout)")
    args = parser.parse_args(argv)
    try:
        base_runs = [json.loads(f.read_text()) for f in args.baseline]
        current_runs = [json.loads(f.read_text()) for f in args.current]
        step_runs = [json.loads(f.read_text()) for f in args.steps]
    except (OSError, json.JSONDecodeError) as e:
        print(f"harness_ab: {e}", file=sys.stderr)
        return 1
    text = compare(least_times(base_runs), least_times(current_runs))
    if step_runs:
        text += "\n" + steps(chain_of(base_runs, step_runs, current_runs))
    if args.out_md:
        args.out_md.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
