"""Context-parallel attention (torch_ext.distributed) over 1, 2 and 4 gloo processes on the CPU against
the single-process op on the full tensors: outputs, statistics and gradients (an entropy and sum p^2
term in the loss), causal (load balanced) and not, log-n scale from the global n_i, GQA; the same
over NCCL with CUDA tensors where two GPUs are present; and a call whose ranks disagree fails on
every rank instead of hanging."""

from __future__ import annotations

import datetime
import functools
import os
import queue as queue_module
import socket
import time
import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torch_ext
from torch_ext import distributed as cp

TIMEOUT = datetime.timedelta(seconds=60)


def free_port() -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world: int, fn: Any, *args: Any, backend: str = "gloo") -> list[Any]:
    """Runs fn(rank, world, *args) in `world` processes of a `backend` process group (nccl: rank r
    on cuda:r); returns each rank's result, or raises with the ranks' tracebacks."""
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, queue, fn, args, backend)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + 300
    while len(results) < world:
        try:
            rank, ok, value = queue.get(timeout=2)
            results[rank] = (ok, value)
        except queue_module.Empty:
            # A rank that died without reporting (a crash in a collective) fails the run now.
            dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"ranks {dead or 'all'} died or timed out without a result") from None
    for p in procs:
        p.join(timeout=60)
    errors = [f"rank {r}:\n{v}" for r, (ok, v) in sorted(results.items()) if not ok]
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r][1] for r in range(world)]


def _worker(rank: int, world: int, port: int, queue: Any, fn: Any, args: tuple, backend: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=TIMEOUT)
        queue.put((rank, True, _by_value(fn(rank, world, *args))))
    except BaseException:  # noqa: BLE001 (reported to the parent)
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _by_value(x: Any) -> Any:
    """Tensors as numpy arrays, which a queue pickles by value (a tensor travels as shared memory
    whose sender must outlive the receiver's read)."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    if isinstance(x, dict):
        return {k: _by_value(v) for k, v in x.items()}
    return x


CASES = {
    "causal_logn_gqa": dict(is_causal=True, scale="logn", train_length=16, heads=(4, 2), strided=True),
    "full_fixed": dict(is_causal=False, scale=None, heads=(2, 2)),
    "causal_contiguous": dict(is_causal=True, scale="logn_sharpen", train_length=8, heads=(2, 1), load_balance=False),
    # A tensor scale c is divided by the temperature as in the single-device op (it was not).
    "causal_tensor_scale_temperature": dict(is_causal=True, scale=torch.tensor([[0.5], [0.25]], dtype=torch.float64),
                                            temperature=0.5, heads=(2, 2)),
    "full_logn_tensor_factor_temperature": dict(is_causal=False, scale="logn", train_length=16, temperature=2.0,
                                                scale_factor=torch.tensor([[0.3], [0.6]], dtype=torch.float64),
                                                heads=(2, 1)),
}


def _full_inputs(case: dict, world: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The full q, k, v, upstream gradients (the same on every rank: a fixed seed)."""
    g = torch.Generator().manual_seed(7)
    h, hkv = case["heads"]
    length = 8 * world
    q = torch.randn(2, h, length, 16, generator=g, dtype=dtype)
    k = torch.randn(2, hkv, length, 16, generator=g, dtype=dtype)
    v = torch.randn(2, hkv, length, 16, generator=g, dtype=dtype)
    go = torch.randn(2, h, length, 16, generator=g, dtype=dtype)
    g_ent = torch.randn(2, h, length, generator=g, dtype=dtype)
    g_p2 = torch.randn(2, h, length, generator=g, dtype=dtype)
    return q, k, v, go, g_ent, g_p2


def _options(case: dict) -> dict:
    opts = {k: v for k, v in case.items() if k not in ("heads", "load_balance", "strided")}
    opts["enable_gqa"] = case["heads"][0] != case["heads"][1]
    return opts


def _loss(out: torch.Tensor, stats: Any, go: torch.Tensor, g_ent: torch.Tensor, g_p2: torch.Tensor) -> torch.Tensor:
    return (out * go).sum() + (stats.entropy * g_ent).sum() + (stats.effective_keys * g_p2).sum()


def _cp_rank(rank: int, world: int, case: dict, dtype: torch.dtype, device: str = "cpu") -> dict:
    """One rank: shard, run context-parallel forward and backward, gather everything back. On
    device "cuda" rank r works on cuda:r."""
    lb = case.get("load_balance", True)
    on = torch.device("cuda", rank) if device == "cuda" else torch.device(device)
    q, k, v, go, g_ent, g_p2 = (t.to(on) for t in _full_inputs(case, world, dtype))
    shard = lambda t: cp.shard_sequence(t, load_balance=lb)  # noqa: E731
    ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))
    if case.get("strided"):  # the (B, L, H, D) layout models produce, seen as (B, H, L, D)
        ql, kl, vl = (t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in (ql, kl, vl))
    out, stats = cp.context_parallel_attention(ql, kl, vl, return_stats=True, load_balance=lb, **_options(case))
    _loss(out, stats, shard(go), shard(g_ent), shard(g_p2)).backward()
    full = lambda t: cp.unshard_sequence(t.detach(), load_balance=lb)  # noqa: E731
    result = {"output": full(out), "dq": full(ql.grad), "dk": full(kl.grad), "dv": full(vl.grad)}
    for name in ("lse", "entropy", "normalized_entropy", "sparsity", "effective_keys", "max_weight", "n_keys", "scale"):
        result[name] = full(getattr(stats, name))
    return result


def _check_against_single_process(results: list[dict], c: dict, dtype: torch.dtype) -> None:
    """Each rank's gathered outputs, statistics and gradients against the single-process op on the
    CPU over the full tensors (float64: to 1e-10)."""
    q, k, v, go, g_ent, g_p2 = _full_inputs(c, len(results), dtype)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, stats = torch_ext.attention(q, k, v, return_stats=True, **_options(c))
    _loss(out, stats, go, g_ent, g_p2).backward()
    expected = {"output": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    expected.update({name: getattr(stats, name) for name in results[0] if name not in expected})
    for rank, got in enumerate(results):
        for name, want in expected.items():
            torch.testing.assert_close(torch.from_numpy(got[name]), want.detach(), rtol=1e-9, atol=1e-10,
                                       msg=lambda m, n=name, r=rank: f"rank {r}, {n}: {m}")


def _cp_cases_rank(rank: int, world: int, dtype: torch.dtype) -> dict[str, dict | str]:
    """One rank of every case of CASES in turn: case -> _cp_rank's result, or the traceback of the
    error it raised. A rank whose case failed runs no further case (the ranks' collectives would
    be out of step: the next case of one rank would meet the failed case of another)."""
    results: dict[str, dict | str] = {}
    failed = None
    for name in sorted(CASES):
        if failed is not None:
            results[name] = f"not run: case {failed} failed on this rank before it"
            continue
        try:
            results[name] = _cp_rank(rank, world, CASES[name], dtype)
        except Exception:  # noqa: BLE001 (that case's test reports it)
            results[name] = traceback.format_exc()
            failed = name
    return results


@functools.cache
def _cp_results(world: int) -> dict[str, list[dict | str] | str]:
    """Case -> each rank's result, from one process group of `world` ranks for all the cases: the
    ranks' start (each a Python that imports torch, ~3 CPU-seconds) costs more than a case, and
    a process group per case and world size made 35 of them instead of 7. A group that fails as
    a whole (a rank that dies, the time limit) is each case's error, not started again per case."""
    try:
        ranks = run_ranks(world, _cp_cases_rank, torch.float64)
    except RuntimeError as e:
        return {name: f"the process group of {world} ranks failed: {e}" for name in CASES}
    return {name: [rank[name] for rank in ranks] for name in CASES}


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_context_parallel_matches_single_process(world: int, case: str) -> None:
    """Every rank's rows, gathered, equal the single-process op's: output, the statistics, and the
    gradients of q, k, v under a loss with entropy and effective-keys terms (float64: to 1e-10)."""
    results = _cp_results(world)[case]
    if isinstance(results, str):
        raise RuntimeError(results)
    errors = [f"rank {rank}:\n{result}" for rank, result in enumerate(results) if isinstance(result, str)]
    if errors:
        raise RuntimeError("\n".join(errors))
    _check_against_single_process(results, CASES[case], torch.float64)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one CUDA device per rank: needs 2 CUDA devices")
@pytest.mark.parametrize("case", sorted(CASES))
def test_context_parallel_nccl_matches_single_device(case: str) -> None:
    """The ring over NCCL with CUDA tensors (2 ranks, one GPU each) equals the single-device op on
    the CPU, outputs, statistics and gradients (float64: to 1e-10). NCCL refuses two ranks on one
    GPU ("Duplicate GPU detected"), so this needs a machine with two."""
    c = CASES[case]
    dtype = torch.float64
    results = run_ranks(2, _cp_rank, c, dtype, "cuda", backend="nccl")
    _check_against_single_process(results, c, dtype)


def _mismatched_rank(rank: int, world: int) -> str:
    """Rank 1 passes a different local length: every rank must raise, none may hang."""
    length = 8 if rank != 1 else 12
    q = torch.randn(1, 2, length, 16)
    try:
        cp.context_parallel_attention(q, q, q, is_causal=True)
    except ValueError as e:
        return str(e)
    return "no error"


def test_mismatched_ranks_fail_on_every_rank() -> None:
    """Ranks whose calls differ all get a ValueError naming the difference, with no hang."""
    messages = run_ranks(2, _mismatched_rank)
    assert all("ranks' calls differ" in m for m in messages), messages


def _bad_calls_rank(rank: int, world: int) -> list[str]:
    """One process group through calls that are invalid on one rank, differ between ranks, or are
    invalid on every rank, then a valid one: "<error type>: <message>" per call."""
    q = torch.randn(1, 2, 4, 8)
    short = q[:, :, :2]
    narrow = torch.randn(1, 2, 4, 4)
    calls = [
        lambda: cp.context_parallel_attention(q, short if rank == 1 else q, short if rank == 1 else q),
        lambda: cp.context_parallel_attention(q, narrow if rank == 1 else q, q),  # key head dim (the op's check)
        lambda: cp.context_parallel_attention(q, q, q, temperature=3.0 if rank == 1 else 1.0),
        lambda: cp.context_parallel_attention(q, q, q, scale="logn", train_length=64 if rank == 1 else 32),
        lambda: cp.context_parallel_attention(q, q.double(), q.double()),  # invalid on every rank
        lambda: cp.context_parallel_attention(q, q, q, is_causal="False"),
        # an option of torch_ext.attention it lacks, on one rank (the others hung)
        lambda: cp.context_parallel_attention(q, q, q, **({"window_size": (2, 0)} if rank == 1 else {})),
        # inputs that require grad on one rank only: the others would wait in its backward
        lambda: cp.context_parallel_attention(q.clone().requires_grad_(rank == 0), q, q),
        lambda: cp.context_parallel_attention(q, q, q, enable_gqa="yes"),
        lambda: cp.context_parallel_attention(q, q, q, scale=torch.ones(2, 1, dtype=torch.int64)),
        # differences printed by name (they were the codes sent)
        lambda: cp.context_parallel_attention(*((q.double(),) * 3 if rank == 1 else (q, q, q))),
        lambda: cp.context_parallel_attention(q, q, q, scale="logn" if rank == 1 else None),
        lambda: cp.context_parallel_attention(q, q, q, is_causal=True),
        lambda: cp.context_parallel_attention(None if rank == 1 else q, q, q),  # (TypeError, as the op's)
        # head dim 0 on one rank: its row scale divided by zero before the check (the others hung)
        lambda: cp.context_parallel_attention(*((q[..., :0],) * 3 if rank == 1 else (q, q, q))),
        # the Meta device on one rank: its check's gather failed there (the others hung)
        lambda: cp.context_parallel_attention(*((q.to("meta"),) * 3 if rank == 1 else (q, q, q))),
        # the single call's checks of the scale policy (they gave NaN rows, or ATen's broadcast error)
        lambda: cp.context_parallel_attention(q, q, q, scale=1e39),
        lambda: cp.context_parallel_attention(q, q, q, scale="logn", scale_factor=1e30, temperature=1e-10),
        lambda: cp.context_parallel_attention(q, q, q, scale=torch.ones(3)),
        lambda: cp.context_parallel_attention(q, q, q, scale=torch.ones(1, device="meta")),
        # "none" for an absent float or scale tensor (printed as -1)
        lambda: cp.context_parallel_attention(q, q, q, scale=0.5 if rank == 1 else None),
    ]
    results = []
    for call in calls:
        try:
            out = call()
            results.append(f"ok: finite {bool(out.isfinite().all())}")
        except (TypeError, ValueError) as e:
            results.append(f"{type(e).__name__}: {e}")
    return results


def test_bad_calls_raise_on_every_rank_and_keep_the_group() -> None:
    """A call invalid on one rank raises there (its own error) and on the others (naming the rank)
    before any transfer: the others hung in the check, or, for key and value shapes it did not
    compare, crashed in gloo or returned rows computed from uninitialized buffers. Calls whose scale
    options differ raise naming the option (each rank computed its rows of another attention). A
    call invalid everywhere raises everywhere and leaves no transfer posted, so the group's next
    call works (it deadlocked)."""
    ranks = run_ranks(2, _bad_calls_rank)
    for rank, results in enumerate(ranks):
        invalid_elsewhere = "ValueError: context_parallel_attention: the call of rank(s) [1] is invalid"
        assert results[0].startswith("ValueError: query, key and value must hold the same rows" if rank == 1
                                     else invalid_elsewhere), results[0]
        assert results[1].startswith("ValueError: query and key must have the same head_dim" if rank == 1
                                     else invalid_elsewhere), results[1]
        assert "calls differ (temperature: rank 0: 1.0, rank 1: 3.0)" in results[2], results[2]
        assert "calls differ (train_length: rank 0: 32.0, rank 1: 64.0)" in results[3], results[3]
        assert results[4].startswith("TypeError: query, key and value must have the same dtype"), results[4]
        assert results[5] == "TypeError: is_causal must be a bool, got str", results[5]
        assert results[6].startswith("TypeError: context_parallel_attention got unsupported keyword arguments "
                                     "['window_size']" if rank == 1 else invalid_elsewhere), results[6]
        assert "calls differ (requires grad: rank 0: True, rank 1: False)" in results[7], results[7]
        assert results[8] == "TypeError: enable_gqa must be a bool, got str", results[8]
        assert results[9] == ("TypeError: the scale tensor (scale, or scale_factor with a length policy) must be "
                              "floating point, got torch.int64"), results[9]
        assert ("calls differ (query dtype: rank 0: torch.float32, rank 1: torch.float64; key dtype: rank 0: "
                "torch.float32, rank 1: torch.float64; value dtype: rank 0: torch.float32, rank 1: torch.float64)"
                in results[10]), results[10]
        assert "calls differ (scale mode: rank 0: fixed, rank 1: logn)" in results[11], results[11]
        assert results[12] == "ok: finite True", results[12]
        assert results[13].startswith("TypeError: query must be a torch.Tensor, got NoneType" if rank == 1
                                      else invalid_elsewhere), results[13]
        assert results[14].startswith("ValueError: query's head_dim must be positive, got 0" if rank == 1
                                      else invalid_elsewhere), results[14]
        assert results[15].startswith("ValueError: query must be on a CPU or CUDA device, got meta" if rank == 1
                                      else invalid_elsewhere), results[15]
        assert results[16].startswith("ValueError: scale / temperature = 1e+39 / 1 overflows float32"), results[16]
        assert results[17].startswith("ValueError: scale / temperature = 1e+30 / 1e-10 overflows float32"), results[17]
        assert results[18].startswith("ValueError: scale tensor (scale, or scale_factor with a length policy) of "
                                      "shape [3] does not broadcast to (batch, heads, q_len) = (1, 2, 4)"), results[18]
        assert results[19] == ("ValueError: the scale tensor (scale, or scale_factor with a length policy) must be "
                               "on query's device (cpu), got meta"), results[19]
        assert "calls differ (float scale or scale_factor: rank 0: none, rank 1: 0.5)" in results[20], results[20]


def _create_graph_rank(rank: int, world: int) -> tuple[list[float], str]:
    """First-order gradients with create_graph=True (a gradient penalty's first step), against the
    same call's without it; and what differentiating them (the penalty's second step) raises."""
    torch.manual_seed(5)
    q, k, v = (torch.randn(1, 2, 4, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    grads = []
    for create_graph in (False, True):
        out = cp.context_parallel_attention(q, k, v, is_causal=True)
        grads.append(torch.autograd.grad(out.square().sum(), (q, k, v), create_graph=create_graph))
    penalty = sum(g.square().sum() for g in grads[1]) + q.square().sum()
    try:
        penalty.backward()
        second = "no error"
    except RuntimeError as e:
        second = str(e)
    return [float((a - b).abs().max()) for a, b in zip(*grads)], second


def test_helpers_name_bad_arguments() -> None:
    """shard_sequence and global_positions check their arguments before the process group (an
    AttributeError, torch.arange's "upper bound and lower bound inconsistent", a float tensor of
    positions); length_factor names its scale (the op's message named scale_mode)."""
    with pytest.raises(TypeError, match="^x must be a torch.Tensor, got list$"):
        cp.shard_sequence([1, 2])
    with pytest.raises(TypeError, match="^local_len must be an int, got float$"):
        cp.global_positions(4.0)
    with pytest.raises(ValueError, match="^local_len must be >= 0, got -2$"):
        cp.global_positions(-2)
    with pytest.raises(ValueError, match="^scale must be 'fixed', 'logn' or 'logn_sharpen', got 'log'$"):
        torch_ext.length_factor(torch.arange(4), "log")


def test_create_graph_gives_first_order_gradients() -> None:
    """The ring's backward under create_graph=True gives the gradients without it (it failed on
    its accumulators, in-place views that autograd refuses in grad mode); differentiating them
    raises, as the single call's do (they entered the second derivative as constants: a gradient
    penalty silently lost the attention's part)."""
    for diffs, second in run_ranks(2, _create_graph_rank):
        assert diffs == [0.0, 0.0, 0.0], diffs
        assert second.startswith("context_parallel_attention has no second derivative"), second


def _autocast_rank(rank: int, world: int) -> tuple[str, str, float, str]:
    """Under torch.autocast: the output's dtype, the float32 leaf's gradient dtype, the largest
    difference from the single call's bfloat16 output, and unshard_sequence of an odd length."""
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 2, 8, 8) for _ in range(3))
    ql = cp.shard_sequence(q).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = cp.context_parallel_attention(ql, cp.shard_sequence(k), cp.shard_sequence(v), is_causal=True)
        single = torch_ext.attention(q, k, v, is_causal=True)
        # inputs of mixed dtypes, which autocast casts alike (the checks saw them before the cast)
        mixed = cp.context_parallel_attention(cp.shard_sequence(q).half(), cp.shard_sequence(k),
                                              cp.shard_sequence(v), is_causal=True)
    assert mixed.dtype == torch.bfloat16
    out.float().sum().backward()
    diff = float((cp.unshard_sequence(out.float()) - single.float()).abs().max())
    try:
        cp.unshard_sequence(torch.zeros(1, 1, 3, 4))
        odd = "no error"
    except ValueError as e:
        odd = str(e)
    return str(out.dtype), str(ql.grad.dtype), diff, odd


def test_autocast_runs_in_the_region_dtype() -> None:
    """Under torch.autocast the ring runs and returns the region's dtype, as the single call (it
    returned float32 from bfloat16 blocks); the float32 inputs get float32 gradients. unshard_sequence
    refuses an odd local length under load balancing (it interleaved the halves wrongly), as
    shard_sequence and global_positions do."""
    for dtype, grad_dtype, diff, odd in run_ranks(2, _autocast_rank):
        assert (dtype, grad_dtype) == ("torch.bfloat16", "torch.float32")
        assert diff <= 2e-2, diff  # bfloat16 rounding of the merged blocks against the single call's
        assert odd == "with load_balance the local length must be even (two chunks), got 3", odd


def test_shard_and_unshard_are_inverse_and_balance_causal_work() -> None:
    """shard_sequence / unshard_sequence round-trip, and with load balancing every rank's rows sum
    the same causal key counts."""
    results = run_ranks(2, _shard_rank)
    assert all(r["roundtrip"] for r in results)
    assert len({r["causal_keys"] for r in results}) == 1


def _shard_rank(rank: int, world: int) -> dict:
    x = torch.arange(2 * 3 * 16, dtype=torch.float64).view(1, 2, 16, 3)
    local = cp.shard_sequence(x, dim=2)
    positions = cp.global_positions(local.shape[2])
    return {"roundtrip": bool(torch.equal(cp.unshard_sequence(local, dim=2), x)),
            "causal_keys": int((positions + 1).sum())}


class _CPAttention(torch.nn.Module):
    """A layer calling context-parallel attention (world > 1) or the op (one process)."""

    def __init__(self, parallel: bool) -> None:
        super().__init__()
        self.parallel = parallel

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kw = dict(is_causal=True, scale="logn", train_length=16)
        if self.parallel:
            return cp.context_parallel_attention(q, k, v, module=self, **kw)
        return torch_ext.policy.attend(q, k, v, policy=torch_ext.AttentionPolicy("logn", train_length=16),
                                       is_causal=True, module=self)


def _monitor_records(parallel: bool, world: int) -> list:
    """The monitor's records of one step of the layer on the full (or this rank's) sequence."""
    q, k, v, *_ = _full_inputs(CASES["full_fixed"], world, torch.float64)
    layer = _CPAttention(parallel)
    if parallel:
        q, k, v = (cp.shard_sequence(t) for t in (q, k, v))
    monitor = torch_ext.AttentionEntropyMonitor(layer, every=1, positions=True)
    with monitor.step(0):
        layer(q, k, v)
    return monitor.latest


def _monitor_rank(rank: int, world: int) -> list:
    return _monitor_records(True, world)


def test_monitor_under_context_parallelism() -> None:
    """The monitor, unchanged, reports the whole sequence's per-head statistics on every rank of a
    context-parallel run: the records equal a single process's."""
    world = 2
    expected = _monitor_records(False, world)
    for records in run_ranks(world, _monitor_rank):
        assert len(records) == len(expected)
        for got, want in zip(records, expected):
            assert got.keys() == want.keys()
            for key, value in want.items():
                if isinstance(value, float):
                    assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12, nan_ok=True), key
                else:
                    assert got[key] == value, key
