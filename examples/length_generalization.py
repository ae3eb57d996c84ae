"""Length generalization of softmax attention under three scale policies, on associative recall.

Why log-n scaling exists
------------------------
A softmax attention row that must pick one key out of n sees the other n - 1 as distractors. With
a logit margin Δ between the right key and the rest, the weight on the right key is about
1 / (1 + (n - 1) e^{-Δ}): it falls as n grows, so a model trained at one length meets a diluted,
higher-entropy attention at longer lengths. The entropy-invariant ("log-n") scale multiplies the
logits of row i by log_b(n_i) (b = the training length, so it equals the standard 1/sqrt(d) there),
which grows the margin with ln n_i and is meant to keep the entropy, and the retrieval, as they
were at the training length (docs/math.md section 1).

The task: multi-query associative recall (MQAR, Zoology, arXiv 2312.04927)
--------------------------------------------------------------------------
A sequence holds N key-value pairs followed by Q queries::

    k_1 v_1 k_2 v_2 ... k_N v_N  q_1 q_2 ... q_Q        (each q_t is one of the k_j)

and at each query position the target is the value bound to that key. Keys are drawn without
replacement from a vocabulary of ``--keys`` tokens, so every key is bound once and a query has one
right answer (with replacement the target would be "the most recent binding", which a model without
positions cannot find without counting); the key vocabulary must hold at least N x the largest
evaluation factor keys. Values are drawn uniformly with replacement from ``--values`` tokens, and
the Q queries are distinct keys of the sequence. The model is trained at one length T = 2N + Q and
evaluated at f·T for f = 1, 2, 4, 8, 16 with N and Q both scaled by f: the layout (pairs, then
queries) and the fraction of queries are the same at every length, and the only thing that changes
is how many keys each query row attends over.

Design choices (to isolate the entropy dilution)
------------------------------------------------
* No positional encoding (NoPE): no unseen position embedding or rotary angle at longer lengths.
* Token shift (as RWKV): the input at position i is E_cur[x_i] + E_prev[x_{i-1}]. The value token
  v_j then carries its own key k_j, and one attention layer retrieves directly: the query q_t
  matches the position whose *previous* token is q_t and reads that position's value. The binding
  needs no position information and no two-layer induction head.
* Loss and accuracy on the query positions only.
* Same initialization, same training batches and same evaluation sequences for every policy (a
  paired comparison); the learnable policy's extra parameters are created after the shared weights
  so they do not shift their random stream.

Two attention settings (``--settings``, both by default):

* ``dot``: plain dot-product attention, logits q·k/sqrt(d): the margin is unbounded, and training
  can grow it past what the longest evaluation needs (ln 16 ≈ 2.8 nats more than at T).
* ``qknorm``: q and k RMS-normalized per head without a gain (as QK-norm, minus the learnable
  scale), so the logit is sqrt(d_head)·cos θ ∈ [-sqrt(d_head), sqrt(d_head)]: the margin is bounded
  by the architecture, as in seed 000's cos θ / τ logits, and only the scale policy can sharpen it.

Three scale policies, through :func:`torch_ext.policy.attend`:

* ``standard``: ``AttentionPolicy(scale=None)``: λ = 1/sqrt(d_head);
* ``logn``: ``AttentionPolicy(scale="logn", train_length=T)``: λ_i = log_T(n_i)/sqrt(d_head);
* ``learnable``: as ``logn`` times a learnable per-head multiplier s_h (shape (H, 1), initialized
  to 1, not weight-decayed): λ_{h,i} = s_h log_T(n_i)/sqrt(d_head), the Scalable-Softmax form.

Training logs the attention entropy per layer and head every ``--monitor-every`` steps
(:class:`torch_ext.AttentionEntropyMonitor`, ``train_entropy_<setting>_<policy>.jsonl``) and
evaluates every length on a few sequences every ``--track-every`` steps. The final evaluation runs
the monitor with ``positions=True`` to get the mean normalized entropy H_i / ln n_i per query
position at each length.

Outputs (in ``--out``, default ``results/length_generalization``): ``results.md`` (the tables, the
run time and the exact command), ``results.json`` (everything, including the per-position entropy
curves, the training losses and the tracked evaluations), ``accuracy.png`` (query accuracy against
length), ``entropy.png`` (normalized entropy against query position in the retrieval layer, one
curve per evaluation length) and ``training.png`` (accuracy and entropy at 1x and 16x during
training).

What it shows (the checked-in run, ``results/length_generalization/results.md``): with unbounded
dot-product logits, training grows the retrieval margin far past ln 16, and all three policies stay
at 100% query accuracy up to 16x; the dilution shows only in the entropy of the retrieval layer
(it rises with n under the standard scale and stays flat under log-n) and in a loss that is small
at every length, and a short-lived accuracy gap near the start of learning. With QK-norm the
margin cannot grow; the standard scale drops at 8x and 16x while log-n and the learnable scale
stay at 100%.

Run (from the repository root, with the package built)::

    python examples/length_generalization.py            # full run, about 7 minutes on 2 cores
    python examples/length_generalization.py --quick    # about 1 minute
    python examples/length_generalization.py --help

The default uses 2 threads; on a machine whose cores are busy with other work, ``--threads 1`` can
be several times faster (OpenMP threads wait for each other). The thread count may change the
floating-point results in the last bits; a given command with a given seed reproduces its table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_ext
from torch_ext.monitor import JSONLWriter
from torch_ext.policy import AttentionPolicy, attend

POLICIES = ("standard", "logn", "learnable")
SETTINGS = ("dot", "qknorm")
SETTING_TITLES = {
    "dot": "dot-product attention (unbounded logits)",
    "qknorm": "QK-norm attention (logits bounded by sqrt(d_head))",
}
DEFAULT_OUT = os.path.join("results", "length_generalization")


# ------------------------------------------------------------------------------------------------
# configuration
# ------------------------------------------------------------------------------------------------
@dataclass
class Config:
    """Everything that determines a run (written to results.json)."""

    seed: int = 0
    pairs: int = 16
    """key-value pairs N at the training length."""
    queries: int = 16
    """queries Q at the training length (T = 2N + Q)."""
    keys: int = 512
    """key vocabulary (>= pairs x the largest evaluation factor)."""
    values: int = 64
    """value vocabulary (chance accuracy = 1 / values)."""
    d_model: int = 64
    heads: int = 4
    layers: int = 2
    steps: int = 2000
    batch: int = 64
    lr: float = 1e-3
    warmup: int = 100
    weight_decay: float = 0.1
    factors: Tuple[int, ...] = (1, 2, 4, 8, 16)
    eval_seqs: int = 256
    eval_batch: int = 32
    monitor_every: int = 50
    track_every: int = 100
    """evaluate every length on ``track_seqs`` sequences every this many steps (0: never)."""
    track_seqs: int = 64
    settings: Tuple[str, ...] = SETTINGS
    policies: Tuple[str, ...] = POLICIES
    threads: int = 2
    progress: bool = True
    out: str = DEFAULT_OUT

    @property
    def train_length(self) -> int:
        """T = 2N + Q, the training sequence length (and the log base of the logn policies)."""
        return 2 * self.pairs + self.queries

    def check(self) -> None:
        """Raises ValueError on an inconsistent configuration."""
        if self.queries > self.pairs:
            raise ValueError(f"queries ({self.queries}) must be <= pairs ({self.pairs}): queries are distinct keys")
        if self.keys < self.pairs * max(self.factors):
            raise ValueError(
                f"keys ({self.keys}) must be >= pairs x max factor ({self.pairs * max(self.factors)}): "
                "keys are drawn without replacement"
            )
        counts = ("steps", "batch", "pairs", "queries", "keys", "values", "d_model", "heads", "layers", "eval_seqs",
                  "eval_batch", "monitor_every", "threads") + (("track_seqs",) if self.track_every else ())
        for name in counts:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup", "track_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.factors or min(self.factors) < 1:
            raise ValueError(f"factors must be ints >= 1, got {self.factors}")
        if self.d_model % self.heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of heads ({self.heads})")
        for name, given, allowed in (("policies", self.policies, POLICIES), ("settings", self.settings, SETTINGS)):
            unknown = set(given) - set(allowed)
            if unknown or not given:
                raise ValueError(f"{name} must be a non-empty subset of {allowed}, got {given}")


class _DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each argument's default, except None: those arguments' help names the default they
    take (which --quick changes), and argparse added a second one, "(default: None)"."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


QUICK = dict(steps=400, batch=32, lr=2e-3, eval_seqs=64, eval_batch=64, track_every=100, track_seqs=32)
"""--quick overrides (unless given explicitly on the command line)."""


# ------------------------------------------------------------------------------------------------
# data
# ------------------------------------------------------------------------------------------------
def make_batch(
    batch: int, pairs: int, queries: int, keys: int, values: int, generator: torch.Generator
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One MQAR batch.

    Returns ``tokens`` (batch, 2·pairs + queries), int64, and ``targets`` (batch, queries): the
    index (0..values-1) of the value expected at each of the last ``queries`` positions. Token ids:
    keys 0..keys-1, values keys..keys+values-1.
    """
    key_ids = torch.rand(batch, keys, generator=generator).argsort(dim=1)[:, :pairs]
    value_idx = torch.randint(values, (batch, pairs), generator=generator)
    which = torch.rand(batch, pairs, generator=generator).argsort(dim=1)[:, :queries]
    context = torch.stack([key_ids, keys + value_idx], dim=2).reshape(batch, 2 * pairs)
    query_ids = key_ids.gather(1, which)
    targets = value_idx.gather(1, which)
    return torch.cat([context, query_ids], dim=1), targets


# ------------------------------------------------------------------------------------------------
# model
# ------------------------------------------------------------------------------------------------
def make_policy(policy_name: str, train_length: int) -> AttentionPolicy:
    """The :class:`AttentionPolicy` of ``policy_name`` (``learnable`` adds its multiplier in the model)."""
    if policy_name == "standard":
        return AttentionPolicy(scale=None)
    return AttentionPolicy(scale="logn", train_length=train_length)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through :func:`torch_ext.policy.attend` (no positions).

    With ``qk_norm``, q and k are RMS-normalized per head (no gain), so |q| = |k| = sqrt(d_head)
    and the standard logit q·k/sqrt(d_head) = sqrt(d_head)·cos θ is bounded.
    """

    def __init__(self, d_model: int, heads: int, policy: AttentionPolicy, qk_norm: bool = False) -> None:
        super().__init__()
        self.heads, self.policy, self.qk_norm = heads, policy, qk_norm
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.multiplier: Optional[nn.Parameter] = None

    def add_learnable_scale(self) -> None:
        """Adds the per-head multiplier s_h (shape (H, 1), initialized to 1)."""
        self.multiplier = nn.Parameter(torch.ones(self.heads, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, length, d = x.shape
        q, k, v = self.qkv(x).view(b, length, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if self.qk_norm:
            q, k = F.rms_norm(q, (q.shape[-1],)), F.rms_norm(k, (k.shape[-1],))
        y = attend(q, k, v, policy=self.policy, is_causal=True, multiplier=self.multiplier, module=self)
        return self.out(y.transpose(1, 2).reshape(b, length, d))


class Block(nn.Module):
    """Pre-norm transformer block: attention + GELU MLP."""

    def __init__(self, d_model: int, heads: int, policy: AttentionPolicy, qk_norm: bool = False) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads, policy, qk_norm)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class RecallModel(nn.Module):
    """NoPE causal transformer with a token shift: input_i = E_cur[x_i] + E_prev[x_{i-1}]."""

    def __init__(self, cfg: Config, policy_name: str, setting: str = "dot") -> None:
        super().__init__()
        vocab = cfg.keys + cfg.values + 1  # + the "previous token" of position 0
        self.bos = vocab - 1
        policy = make_policy(policy_name, cfg.train_length)
        self.emb_cur = nn.Embedding(vocab, cfg.d_model)
        self.emb_prev = nn.Embedding(vocab, cfg.d_model)
        qk_norm = setting == "qknorm"
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.heads, policy, qk_norm) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.values)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        if policy_name == "learnable":  # after the shared init: same random stream for all policies
            for block in self.blocks:
                block.attn.add_learnable_scale()

    def forward(self, tokens: torch.Tensor, n_out: int) -> torch.Tensor:
        """Value logits (B, n_out, values) at the last ``n_out`` positions."""
        prev = F.pad(tokens[:, :-1], (1, 0), value=self.bos)
        x = self.emb_cur(tokens) + self.emb_prev(prev)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, -n_out:]))

    def multipliers(self) -> Optional[List[List[float]]]:
        """The learnable per-head multipliers s_h per layer, or None."""
        if self.blocks[0].attn.multiplier is None:
            return None
        return [[round(v, 3) for v in b.attn.multiplier.detach().flatten().tolist()] for b in self.blocks]


# ------------------------------------------------------------------------------------------------
# training and evaluation
# ------------------------------------------------------------------------------------------------
def _optimizer(model: nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """AdamW; weight decay on the Linear weight matrices only (not embeddings, norms, biases or
    the learnable multipliers)."""
    decay = [p for n, p in model.named_parameters() if p.ndim == 2 and not n.startswith("emb") and "multiplier" not in n]
    ids = {id(p) for p in decay}
    rest = [p for p in model.parameters() if id(p) not in ids]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.98))


def _lr_lambda(cfg: Config) -> Callable[[int], float]:
    """Linear warmup, then cosine decay to 10% of the peak."""

    def f(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

    return f


def train(model: RecallModel, cfg: Config, tag: str, out: str) -> Dict[str, Any]:
    """Trains at the training length.

    Logs attention entropy every ``cfg.monitor_every`` steps to ``train_entropy_<tag>.jsonl`` and
    evaluates every length on ``cfg.track_seqs`` sequences every ``cfg.track_every`` steps (and
    after the last); the tracking time is not counted in ``train_seconds``.
    """
    from tqdm.auto import tqdm

    opt = _optimizer(model, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(cfg))
    gen = torch.Generator().manual_seed(cfg.seed)
    log_path = os.path.join(out, f"train_entropy_{tag}.jsonl")
    if os.path.exists(log_path):
        os.remove(log_path)
    monitor = torch_ext.AttentionEntropyMonitor(model, every=cfg.monitor_every, writers=[JSONLWriter(log_path)])
    losses: List[float] = []
    accs: List[float] = []
    track: List[Dict[str, Any]] = []
    track_seconds = 0.0
    model.train()
    t0 = time.perf_counter()
    bar = tqdm(range(cfg.steps), desc=f"train {tag}", disable=not cfg.progress, leave=False)
    for step in bar:
        tokens, targets = make_batch(cfg.batch, cfg.pairs, cfg.queries, cfg.keys, cfg.values, gen)
        with monitor.step(step):
            logits = model(tokens, cfg.queries)
        loss = F.cross_entropy(logits.reshape(-1, cfg.values), targets.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        accs.append((logits.argmax(-1) == targets).float().mean().item())
        if step % 25 == 0:
            bar.set_postfix(loss=f"{losses[-1]:.3f}", acc=f"{sum(accs[-25:]) / len(accs[-25:]):.3f}")
        done = step + 1
        if cfg.track_every > 0 and (done % cfg.track_every == 0 or done == cfg.steps):
            t1 = time.perf_counter()
            evals = [evaluate(model, cfg, f, tag, cfg.track_seqs, progress=False) for f in cfg.factors]
            for e in evals:
                for layer in e["entropy"].values():
                    del layer["per_head_position"]  # keeps results.json small
            track.append({"step": done, "eval": evals})
            model.train()
            track_seconds += time.perf_counter() - t1
    monitor.close()
    return {
        "train_seconds": time.perf_counter() - t0 - track_seconds,
        "track_seconds": track_seconds,
        "losses": losses,
        "accuracies": accs,
        "track": track,
    }


@torch.no_grad()
def evaluate(model: RecallModel, cfg: Config, factor: int, tag: str, seqs: int, progress: bool = True) -> Dict[str, Any]:
    """Query accuracy, loss and per-position normalized entropy at length ``factor`` x T on
    ``seqs`` sequences.

    The sequences depend on (seed, factor) only: every policy, setting and tracking point sees the
    same ones (a tracking point sees the first ``track_seqs`` of them).
    """
    from tqdm.auto import tqdm

    pairs, queries = cfg.pairs * factor, cfg.queries * factor
    gen = torch.Generator().manual_seed(cfg.seed + 10_000 + factor)
    monitor = torch_ext.AttentionEntropyMonitor(model, positions=True)
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    t0 = time.perf_counter()
    batches = math.ceil(seqs / cfg.eval_batch)
    bar = tqdm(range(batches), desc=f"eval {tag} x{factor}", disable=not (cfg.progress and progress), leave=False)
    with monitor:
        for i in bar:
            n = min(cfg.eval_batch, seqs - i * cfg.eval_batch)
            tokens, targets = make_batch(n, pairs, queries, cfg.keys, cfg.values, gen)
            logits = model(tokens, queries)
            loss_sum += F.cross_entropy(logits.reshape(-1, cfg.values), targets.reshape(-1), reduction="sum").item()
            correct += (logits.argmax(-1) == targets).sum().item()
            total += targets.numel()
    length = 2 * pairs + queries
    query_rows = slice(2 * pairs, length)
    layers = {}
    for name, per_pos in monitor.latest_positions.items():  # (H, L): mean H_i / ln n_i per position
        layers[name] = {
            "per_head_position": per_pos.tolist(),
            "query_mean": per_pos[:, query_rows].mean().item(),
            "query_mean_per_head": per_pos[:, query_rows].mean(dim=1).tolist(),
        }
    return {
        "factor": factor,
        "length": length,
        "accuracy": correct / total,
        "loss": loss_sum / total,
        "eval_seconds": time.perf_counter() - t0,
        "entropy": layers,
    }


def retrieval_layer(run: Dict[str, Any]) -> str:
    """The layer whose query rows have the lowest normalized entropy at the training length (the
    one that does the lookup)."""
    ent = run["eval"][0]["entropy"]
    return min(ent, key=lambda name: ent[name]["query_mean"])


# ------------------------------------------------------------------------------------------------
# reporting
# ------------------------------------------------------------------------------------------------
def _fmt_loss(x: float) -> str:
    return f"{x:.3f}" if x >= 0.01 else f"{x:.1e}"


def _markdown(cfg: Config, results: Dict[str, Any]) -> str:
    """The results tables, the run time and the command, as Markdown."""
    pols = list(cfg.policies)
    T = cfg.train_length
    lines = [
        "# Length generalization on multi-query associative recall",
        "",
        f"Trained at T = {T} tokens ({cfg.pairs} key-value pairs + {cfg.queries} queries), evaluated at f·T "
        f"(f·{cfg.pairs} pairs, f·{cfg.queries} queries) on {cfg.eval_seqs} sequences per length; {cfg.keys} keys, "
        f"{cfg.values} values (chance accuracy {1 / cfg.values:.3f}). Model: {cfg.layers} layers, d_model "
        f"{cfg.d_model}, {cfg.heads} heads (d_head {cfg.d_model // cfg.heads}), no positional encoding, token "
        f"shift; {cfg.steps} AdamW steps of batch {cfg.batch}, peak lr {cfg.lr:g}, seed {cfg.seed}. Policies: "
        f"standard = 1/sqrt(d_head); logn = log_{T}(n_i)/sqrt(d_head); learnable = s_h·log_{T}(n_i)/sqrt(d_head) "
        "with a learned per-head s_h.",
    ]
    for setting in cfg.settings:
        runs = results["settings"][setting]["policies"]
        lines += [
            "",
            f"## {SETTING_TITLES[setting]}",
            "",
            "Query accuracy and loss (nats per query) per evaluation length:",
            "",
            "| length | × | " + " | ".join(f"{p} acc" for p in pols) + " | " + " | ".join(f"{p} loss" for p in pols) + " |",
            "|---:|---:|" + "---:|" * (2 * len(pols)),
        ]
        for i, f in enumerate(cfg.factors):
            acc = [f"{runs[p]['eval'][i]['accuracy']:.3f}" for p in pols]
            loss = [_fmt_loss(runs[p]["eval"][i]["loss"]) for p in pols]
            lines.append(f"| {f * T} | {f} | " + " | ".join(acc + loss) + " |")
        layer_names = {p: retrieval_layer(runs[p]) for p in pols}
        lines += [
            "",
            "Mean normalized entropy H_i / ln n_i over the query rows of the retrieval layer (mean over heads; "
            + ", ".join(f"{p}: `{layer_names[p]}`" for p in pols)
            + "):",
            "",
            "| length | × | " + " | ".join(pols) + " |",
            "|---:|---:|" + "---:|" * len(pols),
        ]
        for i, f in enumerate(cfg.factors):
            cells = [f"{runs[p]['eval'][i]['entropy'][layer_names[p]]['query_mean']:.3f}" for p in pols]
            lines.append(f"| {f * T} | {f} | " + " | ".join(cells) + " |")
        track_steps = [t["step"] for t in runs[pols[0]]["train"]["track"]]
        if track_steps:
            lo, hi = 0, len(cfg.factors) - 1
            lines += [
                "",
                f"During training ({cfg.track_seqs} sequences per point): query accuracy at {cfg.factors[lo]}x / "
                f"{cfg.factors[hi]}x the training length:",
                "",
                "| step | " + " | ".join(pols) + " |",
                "|---:|" + "---:|" * len(pols),
            ]
            for j, step in enumerate(track_steps):
                cells = []
                for p in pols:
                    ev = runs[p]["train"]["track"][j]["eval"]
                    cells.append(f"{ev[lo]['accuracy']:.3f} / {ev[hi]['accuracy']:.3f}")
                lines.append(f"| {step} | " + " | ".join(cells) + " |")
        lines += [
            "",
            "| policy | train loss (mean of last 50 steps) | train time (s) | eval time (s) | learned s_h per layer |",
            "|---|---:|---:|---:|---|",
        ]
        for p in pols:
            r = runs[p]
            tail = r["train"]["losses"][-50:]
            mult = r["multipliers"]
            lines.append(
                f"| {p} | {_fmt_loss(sum(tail) / len(tail))} | {r['train']['train_seconds']:.1f} | "
                f"{sum(e['eval_seconds'] for e in r['eval']):.1f} | {mult if mult is not None else '-'} |"
            )
    lines += [
        "",
        f"Total wall time: {results['wall_seconds']:.1f} s ({results['threads']} threads, torch {torch.__version__}).",
        "",
        "Command:",
        "",
        "```bash",
        results["command"],
        "```",
        "",
    ]
    return "\n".join(lines)


_COLORS = {"standard": "tab:blue", "logn": "tab:orange", "learnable": "tab:green"}


def _plots(cfg: Config, results: Dict[str, Any], out: str) -> None:
    """accuracy.png, entropy.png and training.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    T = cfg.train_length
    lengths = [f * T for f in cfg.factors]
    settings = list(cfg.settings)

    # accuracy vs length
    fig, axes = plt.subplots(1, len(settings), figsize=(5.2 * len(settings), 4), squeeze=False)
    for ax, setting in zip(axes[0], settings):
        runs = results["settings"][setting]["policies"]
        for p in cfg.policies:
            ax.plot(lengths, [e["accuracy"] for e in runs[p]["eval"]], "o-", color=_COLORS[p], label=p)
        ax.axhline(1 / cfg.values, color="gray", ls=":", lw=1, label="chance")
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.set_xlabel(f"evaluation length (trained at {T})")
        ax.set_ylabel("query accuracy")
        ax.set_ylim(0, 1.03)
        ax.set_title(SETTING_TITLES[setting], fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "accuracy.png"), dpi=120)
    plt.close(fig)

    # normalized entropy vs position, retrieval layer
    cmap = plt.get_cmap("viridis")
    fig, axes = plt.subplots(
        len(settings), len(cfg.policies), figsize=(4.2 * len(cfg.policies), 3.3 * len(settings)),
        squeeze=False, sharex=True, sharey=True,
    )
    for row, setting in enumerate(settings):
        runs = results["settings"][setting]["policies"]
        for col, p in enumerate(cfg.policies):
            ax, layer = axes[row][col], retrieval_layer(runs[p])
            for i, e in enumerate(runs[p]["eval"]):
                color = cmap(i / max(1, len(cfg.factors) - 1))
                curve = torch.tensor(e["entropy"][layer]["per_head_position"]).mean(0)  # (L,)
                context = 2 * cfg.pairs * e["factor"]
                # context rows, averaged over each (key, value) pair (they alternate), from n = 3, 4
                pair_mean = curve[2:context].view(-1, 2).mean(1)
                ax.plot(torch.arange(4, context + 1, 2), pair_mean, color=color, lw=0.8, alpha=0.45)
                pos = torch.arange(context + 1, curve.numel() + 1)  # 1-based: n_i = i
                ax.plot(pos, curve[context:], color=color, lw=1.8, label=f"{e['length']} (×{e['factor']})")
            ax.set_xscale("log", base=2)
            ax.set_ylim(0, 1.02)
            ax.set_title(f"{setting} / {p}: {layer}", fontsize=9)
            ax.grid(alpha=0.3)
            if row == len(settings) - 1:
                ax.set_xlabel("position i = number of keys n_i")
            if col == 0:
                ax.set_ylabel("H_i / ln n_i (mean over heads)")
    axes[0][0].legend(fontsize=7, title="eval length", title_fontsize=7)
    fig.suptitle(
        "Normalized attention entropy per position in the retrieval layer (final evaluation): "
        "thick = query rows, thin = context rows (mean of each key-value pair)", fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(os.path.join(out, "entropy.png"), dpi=110)
    plt.close(fig)

    # along training
    if not results["settings"][settings[0]]["policies"][cfg.policies[0]]["train"]["track"]:
        return
    lo, hi = 0, len(cfg.factors) - 1
    fig, axes = plt.subplots(2, len(settings), figsize=(5.2 * len(settings), 6.5), squeeze=False, sharex=True)
    for col, setting in enumerate(settings):
        runs = results["settings"][setting]["policies"]
        for p in cfg.policies:
            track = runs[p]["train"]["track"]
            steps = [t["step"] for t in track]
            layer = retrieval_layer(runs[p])
            for idx, style in ((lo, "--"), (hi, "-")):
                label = f"{p} ×{cfg.factors[idx]}"
                axes[0][col].plot(steps, [t["eval"][idx]["accuracy"] for t in track], style, color=_COLORS[p], label=label)
                axes[1][col].plot(
                    steps, [t["eval"][idx]["entropy"][layer]["query_mean"] for t in track], style, color=_COLORS[p], label=label
                )
        axes[0][col].set_title(SETTING_TITLES[setting], fontsize=10)
        axes[0][col].set_ylabel("query accuracy")
        axes[0][col].set_ylim(0, 1.03)
        axes[1][col].set_ylabel("H / ln n, query rows, retrieval layer")
        axes[1][col].set_ylim(0, 1.02)
        axes[1][col].set_xlabel("training step")
        for ax in axes[:, col]:
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, ncol=2)
    fig.suptitle(f"During training: dashed ×{cfg.factors[lo]} (T = {T}), solid ×{cfg.factors[hi]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "training.png"), dpi=110)
    plt.close(fig)


def compact(obj: Any, digits: int = 5) -> Any:
    """``obj`` with every float rounded to ``digits`` significant digits (for results.json)."""
    if isinstance(obj, float):
        return float(f"{obj:.{digits}g}") if math.isfinite(obj) else obj
    if isinstance(obj, dict):
        return {k: compact(v, digits) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [compact(v, digits) for v in obj]
    return obj


# ------------------------------------------------------------------------------------------------
# entry point
# ------------------------------------------------------------------------------------------------
def parse_args(argv: Optional[Sequence[str]]) -> Config:
    """Command line -> :class:`Config` (``--quick`` changes the defaults in :data:`QUICK`; options
    given explicitly win)."""
    d = Config()
    p = argparse.ArgumentParser(
        description="MQAR length generalization under standard / log-n / learnable attention scales.",
        formatter_class=_DefaultsHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help=f"short run (about 1 minute): {QUICK}")
    p.add_argument("--out", default=None, help=f"output directory (default {DEFAULT_OUT}, with --quick {DEFAULT_OUT}/quick)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--steps", type=int, default=None, help=f"training steps per run (default {d.steps})")
    p.add_argument("--batch", type=int, default=None, help=f"training batch (default {d.batch})")
    p.add_argument("--lr", type=float, default=None, help=f"peak learning rate (default {d.lr})")
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--pairs", type=int, default=d.pairs, help="key-value pairs at the training length")
    p.add_argument("--queries", type=int, default=d.queries, help="queries at the training length")
    p.add_argument("--keys", type=int, default=d.keys, help="key vocabulary size")
    p.add_argument("--values", type=int, default=d.values, help="value vocabulary size")
    p.add_argument("--d-model", type=int, default=d.d_model)
    p.add_argument("--heads", type=int, default=d.heads)
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--factors", type=int, nargs="+", default=list(d.factors), help="evaluation length multipliers")
    p.add_argument("--eval-seqs", type=int, default=None, help=f"sequences per evaluation length (default {d.eval_seqs})")
    p.add_argument("--eval-batch", type=int, default=None, help=f"evaluation batch (default {d.eval_batch})")
    p.add_argument("--monitor-every", type=int, default=d.monitor_every, help="entropy logging period in training")
    p.add_argument("--track-every", type=int, default=None,
                   help=f"evaluate all lengths every this many steps in training, 0: never (default {d.track_every})")
    p.add_argument("--track-seqs", type=int, default=None, help=f"sequences per length when tracking (default {d.track_seqs})")
    p.add_argument("--settings", nargs="+", default=list(d.settings), choices=SETTINGS)
    p.add_argument("--policies", nargs="+", default=list(d.policies), choices=POLICIES)
    p.add_argument("--threads", type=int, default=d.threads, help="torch.set_num_threads")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    a = p.parse_args(argv)
    quick: Dict[str, Any] = QUICK if a.quick else {}

    def pick(name: str) -> Any:
        given = getattr(a, name)
        return given if given is not None else quick.get(name, getattr(d, name))

    cfg = Config(
        seed=a.seed, pairs=a.pairs, queries=a.queries, keys=a.keys, values=a.values, d_model=a.d_model,
        heads=a.heads, layers=a.layers, steps=pick("steps"), batch=pick("batch"), lr=pick("lr"), warmup=a.warmup,
        weight_decay=a.weight_decay, factors=tuple(a.factors), eval_seqs=pick("eval_seqs"),
        eval_batch=pick("eval_batch"), monitor_every=a.monitor_every, track_every=pick("track_every"),
        track_seqs=pick("track_seqs"), settings=tuple(a.settings), policies=tuple(a.policies),
        threads=a.threads, progress=not a.no_progress,
        out=a.out if a.out is not None else (os.path.join(DEFAULT_OUT, "quick") if a.quick else DEFAULT_OUT),
    )
    try:
        cfg.check()
    except ValueError as e:
        p.error(str(e).replace("_", "-"))
    return cfg


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Runs the experiment; writes the outputs to ``--out`` and returns the results dict:
    ``results["settings"][setting]["policies"][policy]["eval"][i]`` is the evaluation at
    ``config["factors"][i]`` (``accuracy``, ``loss``, ``entropy`` per layer)."""
    argv = [str(x) for x in (sys.argv[1:] if argv is None else argv)]
    cfg = parse_args(argv)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        return _run(cfg, argv)
    finally:
        torch.set_num_threads(threads_before)  # main() may be called from tests: leave torch as it was


def _run(cfg: Config, argv: List[str]) -> Dict[str, Any]:
    """The body of :func:`main` (``cfg`` parsed from ``argv``, threads set)."""
    out = cfg.out
    os.makedirs(out, exist_ok=True)
    command = "python examples/length_generalization.py" + "".join(" " + shlex.quote(x) for x in argv)
    t0 = time.perf_counter()
    results: Dict[str, Any] = {
        "config": {**asdict(cfg), "train_length": cfg.train_length},
        "command": command,
        "threads": torch.get_num_threads(),
        "settings": {},
    }
    for setting in cfg.settings:
        runs: Dict[str, Any] = {}
        for name in cfg.policies:
            tag = f"{setting}_{name}"
            torch.manual_seed(cfg.seed)
            model = RecallModel(cfg, name, setting)
            run: Dict[str, Any] = {"train": train(model, cfg, tag, out)}
            run["multipliers"] = model.multipliers()
            run["eval"] = [evaluate(model, cfg, f, tag, cfg.eval_seqs) for f in cfg.factors]
            run["retrieval_layer"] = retrieval_layer(run)
            runs[name] = run
            accs = ", ".join(f"x{e['factor']}: {e['accuracy']:.3f}" for e in run["eval"])
            print(f"[{tag}] train {run['train']['train_seconds']:.1f}s; query accuracy {accs}", flush=True)
        results["settings"][setting] = {"policies": runs}
    results["wall_seconds"] = time.perf_counter() - t0
    table = _markdown(cfg, results)
    print(table)
    with open(os.path.join(out, "results.md"), "w") as fh:
        fh.write(table)
    with open(os.path.join(out, "results.json"), "w") as fh:
        json.dump(compact(results), fh)
    _plots(cfg, results, out)
    return results


if __name__ == "__main__":
    main()
