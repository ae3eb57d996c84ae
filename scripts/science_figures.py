#!/usr/bin/env python3
"""Regenerates the science figures and the claims table (the seed documents' results, reproduced
with the project's own ops).

    python3 scripts/science_figures.py [--out results/science] [--seed 0]

Writes, under ``--out``:

- ``entropy_vs_n.png``     mean entropy H and H / ln n against n, standard vs log-n scale, for
                           diffuse (logit std ~1) and concentrated (logit std ~3) random attention;
- ``sparsity.png``         S against beta/gamma (and against gamma) for exp, relu^2 and identity
                           attention: closed forms (torch_ext.theory) and points from
                           torch_ext.attention_sparsity on Gaussian keys;
- ``noise_robustness.png`` output error under iid logit noise against n;
- ``entropy_floor.png``    the floor of H - ln n against the temperature tau: closed form and the
                           op's entropy on the extremal configuration;
- ``claims.md``            a Markdown table: each seed claim and the number measured here.

Everything runs on the CPU in seconds on 2 cores (4-8 s here); seeded, so the numbers are reproducible
(tests/test_science_figures.py holds the committed table to them).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # this checkout's torch_ext, whatever else is installed

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

import torch_ext  # noqa: E402
from torch_ext import theory  # noqa: E402

D = 64
LQ = 16
TRAIN_LENGTH = 512


def _slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys against xs."""
    x = torch.tensor(xs, dtype=torch.float64)
    y = torch.tensor(ys, dtype=torch.float64)
    xc = x - x.mean()
    return float((xc * (y - y.mean())).sum() / (xc * xc).sum())


# --------------------------------------------------------------------------------------------
# (i) entropy against n
# --------------------------------------------------------------------------------------------


def entropy_experiment(seed: int, tick: Callable[[], None]) -> dict:
    """Mean H and H / ln n over 4 x 8 x 16 query rows, q ~ N(0, q_std^2 I), k ~ N(0, I), D = 64."""
    ns = [2**i for i in range(4, 16)]  # 16 ... 32768
    res: dict = {"ns": ns}
    for q_std in (1.0, 3.0):
        g = torch.Generator().manual_seed(seed)
        q = q_std * torch.randn(4, 8, LQ, D, generator=g)
        k = torch.randn(4, 8, max(ns), D, generator=g)
        v = torch.zeros(4, 8, max(ns), 1)
        for name, scale in (("standard", None), ("logn", "logn")):
            h, hn, hmin, hmax = [], [], [], []
            for n in ns:
                _, st = torch_ext.attention(q, k[:, :, :n], v[:, :, :n], scale=scale, train_length=TRAIN_LENGTH,
                                            return_stats=True)
                h.append(float(st.entropy.mean()))
                hn.append(float(st.normalized_entropy.mean()))
                hmin.append(float(st.normalized_entropy.min()))
                hmax.append(float(st.normalized_entropy.max()))
            res[(q_std, name)] = {"H": h, "Hn": hn, "Hn_min": min(hmin), "Hn_max": max(hmax)}
            tick()
    return res


def plot_entropy(res: dict, path: Path) -> None:
    ns = res["ns"]
    ln_n = [math.log(n) for n in ns]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    styles = {
        (1.0, "standard"): ("tab:blue", "-", "o"),
        (1.0, "logn"): ("tab:blue", "--", "s"),
        (3.0, "standard"): ("tab:red", "-", "o"),
        (3.0, "logn"): ("tab:red", "--", "s"),
    }
    labels = {1.0: "diffuse (logit std 1)", 3.0: "concentrated (logit std 3)"}
    for key, (color, ls, mk) in styles.items():
        q_std, name = key
        lab = f"{'1/√d' if name == 'standard' else 'log-n'} scale, {labels[q_std]}"
        axes[0].plot(ns, res[key]["H"], ls=ls, marker=mk, color=color, ms=4, label=lab)
        axes[1].plot(ns, res[key]["Hn"], ls=ls, marker=mk, color=color, ms=4, label=lab)
    axes[0].plot(ns, ln_n, color="gray", lw=1, label="ln n (maximum)")
    pred_std = [x - 0.5 for x in ln_n]
    pred_logn = [x - 0.5 * (x / math.log(TRAIN_LENGTH)) ** 2 for x in ln_n]
    axes[0].plot(ns, pred_std, ":", color="black", lw=1, label="Gaussian logits: ln n − σ²/2")
    axes[0].plot(ns, pred_logn, ":", color="black", lw=1)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.axvline(TRAIN_LENGTH, color="gray", lw=0.6, ls=":")
        ax.set_xlabel("n (keys per query)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("mean entropy H (nats)")
    axes[0].set_title("Entropy vs n (random q, k; d = 64; train length 512)")
    axes[1].set_ylabel("mean H / ln n")
    axes[1].set_ylim(0, 1.02)
    axes[1].set_title("Normalized entropy vs n")
    axes[0].legend(fontsize=7.5, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# (ii) sparsity
# --------------------------------------------------------------------------------------------


def _gaussian_sparsity(kind: str, betas: list[float], gammas: list[float], seed: int, n: int = 1 << 16,
                       repeats: int = 8) -> tuple[list[float], list[float]]:
    """Mean and standard error over ``repeats`` key sets of the op's S, one row per (beta, gamma);
    keys N(mu, I) with beta = q.mu, gamma = |q|."""
    g = torch.Generator().manual_seed(seed)
    b = torch.tensor(betas, dtype=torch.float64)
    gm = torch.tensor(gammas, dtype=torch.float64)
    m = 4.0 * float((b.abs() / gm).max().clamp(min=1.0))
    q = torch.zeros(len(betas), 4, dtype=torch.float64)
    q[:, 1] = b / m
    q[:, 0] = torch.sqrt(gm**2 - q[:, 1] ** 2)
    mu = torch.tensor([0.0, m, 0.0, 0.0], dtype=torch.float64)
    k = (mu + torch.randn(repeats, 1, n, 4, generator=g, dtype=torch.float64)).float()
    s = torch_ext.attention_sparsity(q.float().expand(repeats, 1, -1, -1), k, kind=kind, scale=1.0)[:, 0].double()
    return s.mean(0).tolist(), (s.std(0) / math.sqrt(repeats)).tolist()


def sparsity_experiment(seed: int, tick: Callable[[], None]) -> dict:
    a_pts = [x / 2 for x in range(-6, 7)]  # beta/gamma = -3 ... 3, gamma = 1
    g_pts = [0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0]  # beta = 0
    res: dict = {"a_pts": a_pts, "g_pts": g_pts}
    for i, kind in enumerate(("exp", "relu2", "identity")):
        res[(kind, "a")] = _gaussian_sparsity(kind, a_pts, [1.0] * len(a_pts), seed + 10 * i)
        tick()
        res[(kind, "g")] = _gaussian_sparsity(kind, [0.0] * len(g_pts), g_pts, seed + 10 * i + 5)
        tick()
    # softmax at large gamma converges slowly in n (the mass of E a^2 sits in the far tail of the
    # lognormal): the same points with 16x more keys
    res[("exp", "g", "big")] = _gaussian_sparsity("exp", [0.0] * len(g_pts), g_pts, seed + 7, n=1 << 20, repeats=4)
    tick()
    # non-negative linear attention and the decaying RNN, for the claims table
    g = torch.Generator().manual_seed(seed + 99)
    A = torch.eye(5, 6, dtype=torch.float64) + 0.1 * torch.rand(5, 6, generator=g, dtype=torch.float64)
    qn = torch.rand(3, 5, generator=g, dtype=torch.float64)
    qn[0] = torch.tensor([1.0, 0, 0, 0, 0])
    e = torch.empty(8, 1, 1 << 16, 6, dtype=torch.float64).exponential_(1.0, generator=g)
    kn = e @ A.T
    s = torch_ext.attention_sparsity(qn.expand(8, 1, -1, -1), kn, kind="identity", scale=1.0)[:, 0]
    res["nonneg"] = (s.mean(0).tolist(), theory.sparsity_nonneg_linear(qn @ A.sum(1), ((qn @ A) ** 2).sum(-1)).tolist())
    decay = []
    for lam in (0.5, 0.9, 0.99):
        for n in (100, 10_000):
            a = lam ** torch.arange(n - 1, -1, -1, dtype=torch.float64)
            decay.append((lam, n, float(torch_ext.sparsity(a)), float(theory.sparsity_decay(lam, n))))
    res["decay"] = decay
    tick()
    return res


def plot_sparsity(res: dict, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    a = torch.linspace(-3.2, 3.2, 401, dtype=torch.float64)
    gg = torch.linspace(0.0, 3.2, 401, dtype=torch.float64)
    curves_a = {
        "exp": theory.sparsity_exp(torch.ones_like(a)),
        "relu2": theory.sparsity_relu2(a),
        "identity": theory.sparsity_identity(a, 1.0),
    }
    curves_g = {
        "exp": theory.sparsity_exp(gg),
        "relu2": theory.sparsity_relu2(torch.zeros_like(gg)),
        "identity": theory.sparsity_identity(torch.zeros_like(gg), gg.clamp(min=1e-9)),
    }
    colors = {"exp": "tab:red", "relu2": "tab:green", "identity": "tab:blue"}
    names = {"exp": "exp (softmax)", "relu2": "relu² (GAU)", "identity": "identity (linear)"}
    for kind in ("exp", "relu2", "identity"):
        c = colors[kind]
        axes[0].plot(a, curves_a[kind], color=c, label=f"{names[kind]}: closed form")
        m, se = res[(kind, "a")]
        axes[0].errorbar(res["a_pts"], m, yerr=[2 * x for x in se], fmt="o", color=c, ms=4, capsize=2,
                         label=f"{names[kind]}: op, n = 65536")
        axes[1].plot(gg, curves_g[kind], color=c, label=f"{names[kind]}: closed form")
        m, se = res[(kind, "g")]
        axes[1].errorbar(res["g_pts"], m, yerr=[2 * x for x in se], fmt="o", color=c, ms=4, capsize=2,
                         label=f"{names[kind]}: op, n = 65536")
    m, se = res[("exp", "g", "big")]
    axes[1].errorbar(res["g_pts"], m, yerr=[2 * x for x in se], fmt="D", color="darkred", mfc="none", ms=5,
                     capsize=2, label="exp (softmax): op, n = 2^20")
    axes[1].text(1.3, 0.84, "exp, γ ≳ 1.5: the n → ∞ value needs n ≫ exp(γ²)\n(E a² sits in rare keys), so "
                 "finite-n S lies above", fontsize=7.5, color="darkred", va="bottom")
    axes[1].legend(fontsize=7, loc="center right", bbox_to_anchor=(1.0, 0.58))
    axes[0].set_xlabel("β / γ   (γ = 1)")  # exp: S depends on γ only
    axes[0].set_title("Sparsity S vs β/γ  (keys ~ N(μ, I), β = q·μ, γ = |q|)")
    axes[1].set_xlabel("γ = σ‖q‖   (β = 0)")
    axes[1].set_title("Sparsity S vs γ (β = 0): only softmax goes to 0")
    for ax in axes:
        ax.set_ylabel("S = E|a| / sqrt(E a²)")
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7.5, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# (iii) noise robustness
# --------------------------------------------------------------------------------------------


def noise_experiment(seed: int, tick: Callable[[], None]) -> dict:
    """Output error under iid N(0, sigma_eps^2) logit noise (an additive float attn_mask), per n,
    averaged over 4 x 4 x 16 rows; q, k, v ~ N(0, I), D = Dv = 64, standard scale."""
    ns = [2**i for i in range(5, 14)]  # 32 ... 8192
    res: dict = {"ns": ns}
    for q_std in (1.0, 3.0):
        g = torch.Generator().manual_seed(seed)
        q = q_std * torch.randn(4, 4, LQ, D, generator=g)
        k = torch.randn(4, 4, max(ns), D, generator=g)
        v = torch.randn(4, 4, max(ns), D, generator=g)
        noise = torch.randn(4, 4, LQ, max(ns), generator=g)
        for sigma in ((0.5, 1.0, 2.0) if q_std == 1.0 else (1.0,)):
            rms, rel_shift, rel_zero, pred = [], [], [], []
            for n in ns:
                kn, vn, en = k[:, :, :n], v[:, :, :n], sigma * noise[..., :n]
                o, st = torch_ext.attention(q, kn, vn, return_stats=True)
                err = (torch_ext.attention(q, kn, vn, en) - o).norm(dim=-1)
                rms_v = vn.pow(2).sum(-1).mean(-1, keepdim=True).sqrt()
                rms.append(float((err / rms_v).mean()))
                rel_zero.append(float((err / o.norm(dim=-1)).mean()))
                o1 = torch_ext.attention(q, kn, vn + 1.0)
                e1 = (torch_ext.attention(q, kn, vn + 1.0, en) - o1).norm(dim=-1)
                rel_shift.append(float((e1 / o1.norm(dim=-1)).mean()))
                pred.append(float(torch.sqrt(math.expm1(sigma**2) / st.effective_keys).mean()))
            res[(q_std, sigma)] = {"rms": rms, "rel_shift": rel_shift, "rel_zero": rel_zero, "pred": pred}
            tick()
    return res


def plot_noise(res: dict, path: Path) -> None:
    ns = res["ns"]
    fig, ax = plt.subplots(figsize=(11, 5))
    colors = {0.5: "tab:green", 1.0: "tab:blue", 2.0: "tab:purple"}
    for sigma, c in colors.items():
        r = res[(1.0, sigma)]
        ax.plot(ns, r["rms"], "o-", color=c, ms=4, label=f"σ_ε = {sigma}: ‖õ − o‖ / rms‖v‖")
        ax.plot(ns, r["pred"], "--", color=c, lw=1, label=f"σ_ε = {sigma}: sqrt((e^σ² − 1) / n_eff)")
    r = res[(1.0, 1.0)]
    ax.plot(ns, r["rel_shift"], "x", color="tab:blue", ms=6, label="σ_ε = 1: ‖õ − o‖/‖o‖, values v + 1")
    ax.plot(ns, r["rel_zero"], "^:", color="gray", ms=4, label="σ_ε = 1: ‖õ − o‖/‖o‖, zero-mean values")
    r3 = res[(3.0, 1.0)]
    ax.plot(ns, r3["rms"], "s-", color="tab:red", ms=4, label="σ_ε = 1, concentrated (logit std 3)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("n (keys per query)")
    ax.set_ylabel("output error (mean over rows)")
    ax.set_title("Softmax attention under iid logit noise (d = 64)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# (iv) entropy floor
# --------------------------------------------------------------------------------------------


def floor_experiment(seed: int, tick: Callable[[], None]) -> dict:
    taus = torch.logspace(math.log10(0.05), 1, 300, dtype=torch.float64)
    floor = theory.entropy_floor(taus)
    tau_pts = [0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0]
    n = 8192
    op_gap = []
    for tau in tau_pts:
        _, rho = theory.entropy_floor_solution(tau)
        n_plus = max(1, round(float(rho) * n))
        q = torch.zeros(1, 1, 1, 2, dtype=torch.float64)
        q[..., 0] = 1.0
        k = torch.zeros(1, 1, n, 2, dtype=torch.float64)
        k[..., 0] = -1.0
        k[..., :n_plus, 0] = 1.0
        _, st = torch_ext.attention(q, k, torch.zeros(1, 1, n, 1, dtype=torch.float64), scale=1.0,
                                    temperature=tau, return_stats=True)
        op_gap.append(float(st.entropy) - math.log(n))
    tick()
    # random configurations: unit vectors in 3-D, n = 2048
    g = torch.Generator().manual_seed(seed)
    rand_tau, rand_min = [], []
    for tau in (0.2, 0.5, 1.0, 2.0):
        qr = torch.nn.functional.normalize(torch.randn(32, 1, 8, 3, generator=g, dtype=torch.float64), dim=-1)
        kr = torch.nn.functional.normalize(torch.randn(32, 1, 2048, 3, generator=g, dtype=torch.float64), dim=-1)
        _, st = torch_ext.attention(qr, kr, torch.zeros(32, 1, 2048, 1, dtype=torch.float64), scale=1.0,
                                    temperature=tau, return_stats=True)
        rand_tau.append(tau)
        rand_min.append(float((st.entropy - math.log(2048)).min()))
    tick()
    return {"taus": taus.tolist(), "floor": floor.tolist(), "tau_pts": tau_pts, "op_gap": op_gap, "n": n,
            "rand_tau": rand_tau, "rand_min": rand_min}


def plot_floor(res: dict, path: Path) -> None:
    """The largest entropy deficit ln n - H reachable at temperature tau (= -floor), log-log."""
    fig, ax = plt.subplots(figsize=(8, 5))
    taus = res["taus"]
    ax.plot(taus, [-f for f in res["floor"]], color="black",
            label="closed form: −floor = max over configurations of ln n − H (n → ∞)")
    small = [t for t in taus if t <= 1.0]
    ax.plot(small, [2 / t - 1 - math.log(2 / t) for t in small], ":", color="gray",
            label="small-τ asymptote 2/τ − 1 − ln(2/τ)")
    ax.axhline(math.log(res["n"]), color="tab:red", lw=0.8, ls="--",
               label=f"ln n at n = {res['n']} (H ≥ 0 caps the deficit at finite n)")
    ax.plot(res["tau_pts"], [-g for g in res["op_gap"]], "o", color="tab:red", ms=5,
            label=f"op: ln n − H on keys at ±q (mass ρ* at +q), n = {res['n']}")
    ax.plot(res["rand_tau"], [-m for m in res["rand_min"]], "^", color="tab:blue", ms=6,
            label="op: max over random 3-D unit keys, n = 2048")
    f1 = float(theory.entropy_floor(1.0))
    ax.annotate(f"τ = 1: ln n − H ≤ {-f1:.4f}", xy=(1.0, -f1), xytext=(1.4, 2.0), arrowprops={"arrowstyle": "->"})
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylim(1e-3, 60)
    ax.set_xlabel("temperature τ  (logits cos θ / τ)")
    ax.set_ylabel("entropy deficit ln n − H (nats)")
    ax.set_title("How far below ln n softmax(cos θ / τ) can go")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7.5, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# mean field (claims table only)
# --------------------------------------------------------------------------------------------


def mean_field_experiment(seed: int, tick: Callable[[], None]) -> dict:
    """Mean H and mean-field ln n - lam (s_max - s_mean) for random attention at a few n."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    q = torch.randn(2, 4, LQ, D, generator=g)
    k = torch.randn(2, 4, 4096, D, generator=g)
    for q_std in (1.0, 3.0):
        for n in (64, 512, 4096):
            _, st = torch_ext.attention(q_std * q, k[:, :, :n], torch.zeros(2, 4, n, 1), scale="logn",
                                        return_stats=True)
            mf = theory.mean_field_entropy_from_scores(q_std * q @ k[:, :, :n].transpose(-1, -2), st.scale)
            out[(q_std, n)] = (float(st.entropy.mean()), float(mf.mean()), bool((st.entropy >= mf - 1e-4).all()))
    tick()
    return out


# --------------------------------------------------------------------------------------------
# claims table
# --------------------------------------------------------------------------------------------


def write_claims(path: Path, ent: dict, sp: dict, noise: dict, fl: dict, mf: dict, seconds: float) -> None:
    ns = ent["ns"]
    ln_n = [math.log(n) for n in ns]
    sel = [i for i, n in enumerate(ns) if 64 <= n <= 16384]

    def band(key: tuple) -> tuple[float, float, float, float]:
        h = [ent[key]["H"][i] for i in sel]
        return min(h), max(h), max(h) - min(h), _slope([ln_n[i] for i in sel], h)

    d_std, d_log = band((1.0, "standard")), band((1.0, "logn"))
    c_std, c_log = band((3.0, "standard")), band((3.0, "logn"))
    hn_min = min(ent[key]["Hn_min"] for key in ent if key != "ns")
    hn_max = max(ent[key]["Hn_max"] for key in ent if key != "ns")

    nn = noise["ns"]
    r = noise[(1.0, 1.0)]
    i64, i4096 = nn.index(64), nn.index(4096)
    slope_noise = _slope([math.log(n) for n in nn[i64:i4096 + 1]], [math.log(x) for x in r["rms"][i64:i4096 + 1]])
    r3 = noise[(3.0, 1.0)]

    exp_m, _ = sp[("exp", "g")]
    exp_dev = max(abs(m - math.exp(-g * g / 2)) for m, g in zip(exp_m, sp["g_pts"]) if g <= 1.0)
    exp_big, _ = sp[("exp", "g", "big")]
    exp_far = "; ".join(
        f"γ = {g}: {exp_m[sp['g_pts'].index(g)]:.3f} (n = 2^16), {exp_big[sp['g_pts'].index(g)]:.3f} (n = 2^20) "
        f"vs {math.exp(-g * g / 2):.3f}"
        for g in (1.5, 2.0, 3.0)
    )
    id_m, _ = sp[("identity", "a")]
    id_b0 = id_m[sp["a_pts"].index(0.0)]
    id_min = min(id_m)
    r2_m, _ = sp[("relu2", "a")]
    r2_0 = r2_m[sp["a_pts"].index(0.0)]
    r2_m3 = r2_m[sp["a_pts"].index(-3.0)]
    nonneg_mc, nonneg_th = sp["nonneg"]
    nonneg_dev = max(abs(a - b) for a, b in zip(nonneg_mc, nonneg_th))
    decay_dev = max(abs(x[2] - x[3]) for x in sp["decay"])
    decay_09 = [x for x in sp["decay"] if x[0] == 0.9]

    f1 = float(theory.entropy_floor(1.0))
    op1 = fl["op_gap"][fl["tau_pts"].index(1.0)]
    floors = {t: float(theory.entropy_floor(t)) for t in (2.0, 0.5, 0.2, 0.1)}
    rand_ok = all(m >= float(theory.entropy_floor(t)) - 1e-12 for t, m in zip(fl["rand_tau"], fl["rand_min"]))
    rand1 = fl["rand_min"][fl["rand_tau"].index(1.0)]

    mf_rows = ", ".join(f"n = {n}: H {mf[(1.0, n)][0]:.2f} vs {mf[(1.0, n)][1]:.2f}" for n in (64, 512, 4096))
    mf_ok = all(v[2] for v in mf.values())

    rows = [
        ("Noise robustness: õ ≈ o under iid logit noise, and the error shrinks as n grows",
         "000/001",
         "q,k,v ~ N(0, I), d = 64, ε ~ N(0, 1) as an additive float mask, 256 rows",
         f"‖õ−o‖/rms‖v‖: {r['rms'][i64]:.3f} (n = 64) → {r['rms'][i4096]:.4f} (n = 4096), log-log slope "
         f"{slope_noise:.2f}; matches sqrt((e−1)/n_eff) to {r['rms'][i4096] / r['pred'][i4096]:.2f}× at n = 4096. "
         f"Values v + 1: ‖õ−o‖/‖o‖ {r['rel_shift'][i64]:.3f} → {r['rel_shift'][i4096]:.4f}. "
         f"Zero-mean values: ‖õ−o‖/‖o‖ {r['rel_zero'][i64]:.2f} → {r['rel_zero'][i4096]:.2f} (does not shrink). "
         f"Concentrated attention (logit std 3): {r3['rms'][i64]:.3f} → {r3['rms'][i4096]:.3f}.",
         "holds in units of the values (∝ 1/sqrt(n_eff)); not relative to o when o → 0"),
        ("Entropy range H ∈ [0, ln n]", "000",
         "all rows of the entropy experiment",
         f"H / ln n per row in [{hn_min:.3f}, {hn_max:.3f}]", "holds"),
        ("Floor: H ≥ ln n − 0.4745 at τ = 1 (two-point distribution at cos = ±1)", "000",
         "closed form (minimum over the mass ρ), op on keys at ±q with n = 8192",
         f"closed form {f1:.6f} (ρ* = {float(theory.entropy_floor_solution(1.0)[1]):.4f}); op {op1:.6f}; "
         f"random 3-D unit keys: min H − ln n = {rand1:.3f} (≥ floor: {rand_ok})",
         "holds (−0.4745 to 4 digits)"),
        ("Lowering τ lowers the floor towards 0 entropy", "000",
         "closed form",
         "floor(τ): " + ", ".join(f"{t:g}: {v:.3f}" for t, v in floors.items())
         + "; ≈ −(2/τ − 1 − ln(2/τ)) for small τ",
         "holds"),
        ("Entropy invariance: with λ ∝ ln n the entropy stays flat, with 1/√d it grows like ln n "
         "(diffuse attention)", "002",
         "q, k ~ N(0, I), d = 64, n = 64 … 16384, 512 rows, train length 512",
         f"1/√d: H {d_std[0]:.2f} → {d_std[1]:.2f}, slope {d_std[3]:.3f} per ln n; "
         f"log-n: H {d_log[0]:.2f} → {d_log[1]:.2f}, slope {d_log[3]:.3f}, band {d_log[2]:.2f}",
         "NOT flat: log-n only slows the growth (H ≈ ln n − (ln n / ln 512)²/2)"),
        ("Entropy invariance (concentrated attention)", "002",
         "q ~ N(0, 9 I), k ~ N(0, I) (logit std 3), otherwise as above",
         f"1/√d: H {c_std[0]:.2f} → {c_std[1]:.2f}, slope {c_std[3]:.3f}; "
         f"log-n: band [{c_log[0]:.2f}, {c_log[1]:.2f}] (width {c_log[2]:.2f}), slope {c_log[3]:.3f}",
         "holds"),
        ("Mean field: H ≈ ln n − λ(s_max − s̄)", "002",
         "log-n scale, q, k ~ N(0, I), 128 rows",
         f"{mf_rows}; lower bound in every row: {mf_ok}",
         "a (loose) lower bound, not an estimate"),
        ("Softmax sparsity S = exp(−γ²/2), → 0 as γ grows", "003",
         "keys ~ N(μ, I), n = 65536, 8 repeats",
         f"max |op − closed form| = {exp_dev:.4f} for γ ≤ 1; {exp_far}",
         "holds for γ ≤ 1; for larger γ the finite-n S sits above exp(−γ²/2) and approaches it slowly "
         "as n grows (the n → ∞ limit needs n ≫ exp(γ²))"),
        ("Linear attention S ≥ 0.798 (β = 0), even in β", "003",
         "same keys, γ = 1",
         f"op S at β = 0: {id_b0:.4f} (closed form {math.sqrt(2 / math.pi):.4f}); min over β/γ ∈ [−3, 3]: {id_min:.4f}",
         "holds"),
        ("relu² attention: S(0) = 1/√6 ≈ 0.408, → 0 only as β/γ → −∞", "003",
         "same keys, γ = 1",
         f"op S(0) = {r2_0:.4f}; S(−3) = {r2_m3:.4f} (closed form {float(theory.sparsity_relu2(-3.0)):.4f})",
         "holds"),
        ("Non-negative linear attention S = q'·μ' / sqrt((q'·μ')² + q'ᵀΣ'q')", "003",
         "k' = A e, e ~ Exponential(1), n = 65536, 8 repeats",
         f"max |op − closed form| = {nonneg_dev:.4f} over {len(nonneg_mc)} queries", "holds"),
        ("Decaying RNN: S = [(1−λⁿ)/(1−λ)] / sqrt(n(1−λ²ⁿ)/(1−λ²)) → 0", "003",
         "torch_ext.sparsity on the explicit weights",
         f"max |op − closed form| = {decay_dev:.1e}; λ = 0.9: S = {decay_09[0][2]:.4f} (n = 100), "
         f"{decay_09[1][2]:.4f} (n = 10000)", "holds"),
    ]
    lines = [
        "# Seed claims, measured",
        "",
        f"Generated by `python3 scripts/science_figures.py` in {seconds:.0f} s "
        f"(torch {torch.__version__}, {torch.get_num_threads()} threads). Seeded; every number below comes "
        "from the project's ops (`torch_ext.attention`, `torch_ext.attention_sparsity`, `torch_ext.sparsity`) "
        "and the closed forms in `torch_ext/theory.py`.",
        "",
        "| claim | seed | setting | measured | verdict |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")
    lines.append("")
    path.write_text("\n".join(lines), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "science",
                        help="output folder (default: results/science in the repository)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    start = time.time()
    steps = 4 + 8 + 4 + 2 + 1 + 5  # experiment ticks + plots/table
    with tqdm(total=steps, desc="science", unit="step") as bar:
        def tick() -> None:
            bar.update(1)

        bar.set_postfix_str("entropy vs n")
        ent = entropy_experiment(args.seed, tick)
        bar.set_postfix_str("sparsity")
        sp = sparsity_experiment(args.seed, tick)
        bar.set_postfix_str("noise")
        noise = noise_experiment(args.seed, tick)
        bar.set_postfix_str("entropy floor")
        fl = floor_experiment(args.seed, tick)
        bar.set_postfix_str("mean field")
        mf = mean_field_experiment(args.seed, tick)
        bar.set_postfix_str("figures")
        plot_entropy(ent, args.out / "entropy_vs_n.png")
        tick()
        plot_sparsity(sp, args.out / "sparsity.png")
        tick()
        plot_noise(noise, args.out / "noise_robustness.png")
        tick()
        plot_floor(fl, args.out / "entropy_floor.png")
        tick()
        write_claims(args.out / "claims.md", ent, sp, noise, fl, mf, time.time() - start)
        tick()
    print(f"wrote {args.out} in {time.time() - start:.1f} s")


if __name__ == "__main__":
    main()
