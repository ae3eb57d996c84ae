"""Concurrency: 8 Python threads calling the op at once give the serial results (CPU; CUDA on a
stream per thread); the op works inside DataLoader worker processes (fork and spawn) and with
torch.set_num_threads(1); a CUDA backward under torch.use_deterministic_algorithms(True) is bitwise
reproducible for every kernel family."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.utils.data as tud

import torch_ext
from conftest import HAS_CUDA, NO_CUDA_REASON

THREADS = 8


def _inputs(i: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """Call i's q, k, v, and output gradient (each call different)."""
    g = torch.Generator().manual_seed(i)
    shapes = [(2, 4, 96, 32), (2, 2, 80, 32), (2, 2, 80, 32), (2, 4, 96, 32)]
    return tuple(torch.randn(s, generator=g).to(device=device, dtype=dtype) for s in shapes)


def _call(i: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Forward with statistics and backward (an entropy term in the loss) of call i."""
    q, k, v, go = _inputs(i, device)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, st = torch_ext.attention(q, k, v, is_causal=i % 2 == 0, scale="logn", train_length=32, enable_gqa=True,
                                  return_stats=True)
    ((out * go).sum() + st.entropy.sum()).backward()
    return {"out": out.detach(), "entropy": st.entropy, "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _run_threads(fn: Any) -> list[Any]:
    """fn(i) for i < THREADS, all started together; re-raises a thread's exception."""
    results: list[Any] = [None] * THREADS
    errors: list[BaseException] = []
    barrier = threading.Barrier(THREADS)

    def run(i: int) -> None:
        try:
            barrier.wait()
            results[i] = fn(i)
        except BaseException as e:  # noqa: BLE001 (re-raised below)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    if errors:
        raise errors[0]
    assert all(not t.is_alive() for t in threads), "a thread did not finish"
    return results


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    for name in a:
        assert torch.equal(a[name], b[name]), f"{what}: {name} differs"


def test_concurrent_threads_equal_serial_cpu() -> None:
    """8 threads calling forward and backward at once give bitwise the serial results."""
    serial = [_call(i) for i in range(THREADS)]
    for i, got in enumerate(_run_threads(_call)):
        _assert_equal(got, serial[i], f"thread {i}")


@pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA_REASON)
def test_concurrent_threads_equal_serial_cuda_streams() -> None:
    """On CUDA, 8 threads each on its own stream give the serial results (to the kernels'
    run-to-run tolerance: dq accumulates with atomics)."""
    serial = [_call(i, "cuda") for i in range(THREADS)]
    torch.cuda.synchronize()

    def on_stream(i: int) -> dict[str, torch.Tensor]:
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            r = _call(i, "cuda")
        stream.synchronize()
        return r

    for i, got in enumerate(_run_threads(on_stream)):
        for name, want in serial[i].items():
            torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-5, msg=f"thread {i}, {name}")


def test_single_thread_equals_default_threads() -> None:
    """torch.set_num_threads(1) gives the multi-threaded results (to float rounding of the
    different work split)."""
    default = _call(3)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = _call(3)
    finally:
        torch.set_num_threads(before)
    for name in default:
        torch.testing.assert_close(single[name], default[name], rtol=1e-5, atol=1e-6, msg=name)


class _Rows(tud.Dataset):
    """Each item is an attention output computed in the worker."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        q, k, v, _ = _inputs(i)
        return torch_ext.attention(q, k, v, is_causal=True, enable_gqa=True)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers(context: str) -> None:
    """The op runs in DataLoader worker processes, forked after the parent ran its OpenMP kernels or
    spawned, and gives the parent's results."""
    expected = [_Rows()[i] for i in range(4)]  # the parent runs the op (and OpenMP) first
    loader = tud.DataLoader(_Rows(), batch_size=2, num_workers=2, multiprocessing_context=context, timeout=120)
    got = torch.cat(list(loader))
    assert torch.equal(got, torch.stack(expected))


@pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA_REASON)
@pytest.mark.parametrize("family", ["fallback", "sm80", pytest.param("sm90", marks=pytest.mark.hopper_turns)])
def test_deterministic_cuda_backward(monkeypatch: pytest.MonkeyPatch, family: str) -> None:
    """Under torch.use_deterministic_algorithms(True) a CUDA backward is bitwise reproducible in
    every family: sm80's dq kernel, the Hopper family's dq in turns when forced, the fallback's G
    added in the key tiles' turns (fallback/turns.cuh)."""
    monkeypatch.setenv("ENTROPY_ATTN_CUDA_FAMILY", family)
    g = torch.Generator().manual_seed(5)
    base = [torch.randn(2, h, 96, 64, generator=g).to("cuda", torch.bfloat16) for h in (4, 2, 2, 4)]
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = []
        for _ in range(2):
            q, k, v = (t.clone().requires_grad_() for t in base[:3])
            out, st = torch_ext.attention(q, k, v, is_causal=True, enable_gqa=True, return_stats=True)
            loss = (out.float() * base[3].float()).sum() + st.entropy.sum()
            loss.backward()
            runs.append({"dq": q.grad, "dk": k.grad, "dv": v.grad})
    finally:
        torch.use_deterministic_algorithms(before)
    _assert_equal(runs[0], runs[1], "deterministic backward")
