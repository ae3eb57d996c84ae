"""FSDP2 (torch.distributed.fsdp.fully_shard) with the op inside a model: a 2-process run (gloo,
CPU, parameters sharded, each process half of the batch) gives the single-process outputs and
gradients, eager and under torch.compile."""

from __future__ import annotations

import pytest
import torch
from test_distributed import run_ranks

import torch_ext


class Net(torch.nn.Module):
    """torch_ext's MultiheadAttention (causal, log-n scale) and a feed-forward layer."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = torch_ext.nn.MultiheadAttention(32, 4, batch_first=True, scale="logn", train_length=8)
        self.ff = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
        y, _ = self.attn(x, x, x, attn_mask=causal, need_weights=False, is_causal=True)
        return self.ff(torch.nn.functional.gelu(y))


def _batch() -> torch.Tensor:
    return torch.randn(4, 12, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def _single() -> tuple[torch.Tensor, dict]:
    torch.manual_seed(0)
    model = Net().double()
    out = model(_batch())
    out.square().mean().backward()
    return out.detach(), {n: p.grad for n, p in model.named_parameters()}


def _fsdp_rank(rank: int, world: int, compiled: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Net().double()
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model.attn, mesh=mesh)
    fully_shard(model, mesh=mesh)
    run = torch.compile(model) if compiled else model
    rows = _batch().chunk(world)[rank]
    out = run(rows)
    # Each rank's loss is the mean over its rows; FSDP averages the gradients over the ranks.
    out.square().mean().backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return {"out": out.detach(), "grads": grads}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fsdp2_matches_single_process(compiled: bool) -> None:
    """Two FSDP2 ranks: outputs (each rank's half of the batch) and the full gradients of every
    parameter equal one process's on the whole batch (float64)."""
    out, grads = _single()
    results = run_ranks(2, _fsdp_rank, compiled)
    got_out = torch.cat([torch.from_numpy(r["out"]) for r in results])
    torch.testing.assert_close(got_out, out, rtol=1e-10, atol=1e-12)
    for r in results:
        for name, g in grads.items():
            torch.testing.assert_close(torch.from_numpy(r["grads"][name]), g, rtol=1e-9, atol=1e-12, msg=name)
