"""Context-parallel training on the CPU: a small causal language model whose sequences are sharded
over P processes (torch.distributed with gloo), attention through
:func:`torch_ext.distributed.context_parallel_attention`, entropy logged by the unchanged
:class:`torch_ext.AttentionEntropyMonitor`, against the same model trained in one process with
:func:`torch_ext.policy.attend`.

The task is recall: position 0 holds one of 8 "key" tokens (a vocabulary of their own), the rest
random ordinary tokens, and every position must predict the key, which only attention back to
position 0 (on the first rank's chunk of every sequence) can provide. Every
process builds the same batches (one seed) and keeps its chunks of the sequence (load balanced:
chunks r and 2P - 1 - r of 2P), computes the loss over its positions, and the parameter gradients
are summed over the processes. The model has no position embeddings (causal attention alone), so
every layer but attention is per token and needs no communication.

    python3 examples/context_parallel.py                        # P = 1, 2, 4; 60 steps
    python3 examples/context_parallel.py --procs 1 2 --steps 10 --seq 128

Writes results/distributed/training.md, training.json and training.png (the loss of every step for
every P, the largest difference from one process, seconds per step, and the monitored entropy).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

import torch_ext
from torch_ext import distributed as cp
from torch_ext.monitor import CallbackWriter
from torch_ext.policy import AttentionPolicy, attend

ROOT = Path(__file__).resolve().parent.parent


class Attention(nn.Module):
    """Causal self-attention with the log-n scale: context parallel when a process group is up."""

    def __init__(self, d: int, heads: int, train_length: int) -> None:
        super().__init__()
        self.heads, self.train_length = heads, train_length
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if dist.is_initialized():
            y = cp.context_parallel_attention(q, k, v, is_causal=True, scale="logn", train_length=self.train_length,
                                              module=self)
        else:
            y = attend(q, k, v, policy=AttentionPolicy("logn", train_length=self.train_length), is_causal=True,
                       module=self)
        return self.out(y.transpose(1, 2).reshape(b, n, d))


class Block(nn.Module):
    """Pre-norm attention and MLP."""

    def __init__(self, d: int, heads: int, train_length: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads, train_length)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """Embedding, blocks, head; no position embeddings."""

    def __init__(self, vocab: int, d: int, heads: int, layers: int, train_length: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads, train_length) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


KEYS = 8  # the key tokens are ids vocab .. vocab + KEYS - 1


def batch(step: int, args: argparse.Namespace) -> torch.Tensor:
    """(B, L) tokens: a key token, then random ordinary ones (one seed per step: every process
    agrees)."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    tokens[:, 0] = args.vocab + torch.randint(0, KEYS, (args.batch,), generator=g)
    return tokens


def train(rank: int, world: int, args: argparse.Namespace) -> Dict[str, Any]:
    """Trains for args.steps; this process holds its chunks of every sequence when world > 1."""
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    model = TinyLM(args.vocab + KEYS, args.d_model, args.heads, args.layers, args.seq).to(dtype)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    entropy: List[Dict[str, Any]] = []
    writer = CallbackWriter(lambda step, records: entropy.extend(
        {"step": step, "layer": r["layer"], "head": r["head"], "normalized_entropy": r["normalized_entropy_mean"]}
        for r in records))
    monitor = torch_ext.AttentionEntropyMonitor(model, every=args.monitor_every, writers=[writer])
    losses, seconds = [], []
    for step in range(args.steps):
        start = time.perf_counter()
        inputs = batch(step, args)
        targets = inputs[:, :1].expand(-1, args.seq)  # every position recalls the key
        if world > 1:
            inputs, targets = (cp.shard_sequence(t, dim=1) for t in (inputs, targets))
        with monitor.step(step):
            logits = model(inputs)
        loss = F.cross_entropy(logits.transpose(1, 2), targets, reduction="sum") / (args.batch * args.seq)
        opt.zero_grad()
        loss.backward()
        if world > 1:  # each process holds the gradient of its positions' loss: sum them
            for p in model.parameters():
                dist.all_reduce(p.grad)
            loss_value = loss.detach().clone()
            dist.all_reduce(loss_value)
        else:
            loss_value = loss.detach()
        opt.step()
        losses.append(float(loss_value))
        seconds.append(time.perf_counter() - start)
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"  P={world} step {step:3d} loss {losses[-1]:.6f} ({seconds[-1] * 1e3:.0f} ms)", flush=True)
    return {"losses": losses, "seconds": seconds, "entropy": entropy}


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        result = train(rank, world, args)
        if rank == 0:
            Path(out).write_text(json.dumps(result))
        # Every rank past its last collective before any tears its connections down: gloo aborted
        # a process (std::terminate, about 1 run in 12 here) whose peer destroyed the group first.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(world: int, args: argparse.Namespace) -> Dict[str, Any]:
    """Trains with `world` processes (1: no process group, the single-device op)."""
    if world == 1:
        torch.set_num_threads(args.threads)
        return train(0, 1, args)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # (rank 0's result through a file of its own: not in the repository, and not shared by two runs)
    with tempfile.TemporaryDirectory() as scratch:
        out = str(Path(scratch) / f"context_parallel_{world}.json")
        mp.spawn(_worker, args=(world, port, args, out), nprocs=world, join=True)
        return json.loads(Path(out).read_text())


def markdown(args: argparse.Namespace, results: Dict[int, Dict[str, Any]]) -> str:
    """The report: agreement of the loss curves, time per step, the monitored entropy."""
    base = results[min(results)]["losses"]
    lines = [
        "# Context-parallel training on the CPU",
        "",
        f"`python3 examples/context_parallel.py --procs {' '.join(map(str, sorted(results)))} --steps {args.steps} "
        f"--seq {args.seq} --dtype {args.dtype}`: a {args.layers}-layer, {args.heads}-head, d={args.d_model} causal "
        f"LM without position embeddings, log-n scale, key recall, batch {args.batch} x {args.seq} tokens, Adam "
        f"lr {args.lr}; torch {torch.__version__}, gloo, {args.threads} thread(s) per process on this machine "
        f"({os.cpu_count()} cores). P = 1 is the single-device op in one process; P > 1 shards every sequence "
        "over P processes (context_parallel_attention, load balanced).",
        "",
        "| P | first loss | last loss | max abs difference from P = 1 over all steps | median s / step |",
        "|---|---|---|---|---|",
    ]
    for world, r in sorted(results.items()):
        diff = max(abs(a - b) for a, b in zip(r["losses"], base))
        med = sorted(r["seconds"][1:] or r["seconds"])[len(r["seconds"][1:] or r["seconds"]) // 2]
        lines.append(f"| {world} | {r['losses'][0]:.6f} | {r['losses'][-1]:.6f} | {diff:.2e} | {med:.3f} |")
    lines += ["", "Mean normalized entropy per layer (over heads and rows), as the monitor logged it:", "",
              "| P | step | " + " | ".join(f"layer {i}" for i in range(args.layers)) + " |",
              "|---|---|" + "---|" * args.layers]
    for world, r in sorted(results.items()):
        by_step: Dict[int, Dict[str, List[float]]] = {}
        for e in r["entropy"]:
            by_step.setdefault(e["step"], {}).setdefault(e["layer"], []).append(e["normalized_entropy"])
        for step, layers in sorted(by_step.items()):
            cells = [f"{sum(v) / len(v):.4f}" for _, v in sorted(layers.items())]
            lines.append(f"| {world} | {step} | " + " | ".join(cells) + " |")
    lines += ["", "The processes share two cores here, so P > 1 is slower per step; the point is the agreement "
              "(the loss curves coincide to float rounding) and that the monitor needs no change."]
    return "\n".join(lines) + "\n"


def plot(results: Dict[int, Dict[str, Any]], path: Path) -> None:
    """The loss curves of every P on one axis (they should lie on top of each other)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the report's table has the numbers
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for (world, r), style in zip(sorted(results.items()), ("-", "--", ":", "-.")):
        label = "1 process (single-device op)" if world == 1 else f"{world} processes (context parallel)"
        ax.plot(r["losses"], style, label=label, linewidth=1.5)
    ax.set(xlabel="step", ylabel="training loss", title="Loss curves, sequence sharded over P processes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4], help="process counts to train with")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence (a multiple of 2 * max(procs))")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=16)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--monitor-every", type=int, default=10)
    p.add_argument("--out", type=Path, default=ROOT / "results" / "distributed")
    args = p.parse_args(argv)
    for name in ("steps", "seq", "batch", "vocab", "d_model", "heads", "layers", "threads", "monitor_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if min(args.procs) < 1:
        p.error("--procs must be >= 1")
    if args.d_model % args.heads:
        p.error(f"--d-model ({args.d_model}) must be a multiple of --heads ({args.heads})")
    if any(args.seq % (2 * w) for w in args.procs):
        p.error(f"--seq {args.seq} must be a multiple of 2 * P for every P in {args.procs}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> Dict[int, Dict[str, Any]]:
    args = parse_args(argv)
    results = {}
    for world in args.procs:
        print(f"training with P = {world}", flush=True)
        results[world] = run(world, args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "training.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                       "results": results}, indent=1))
    report = markdown(args, results)
    (args.out / "training.md").write_text(report)
    plot(results, args.out / "training.png")
    print(report)
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
