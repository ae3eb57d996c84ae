"""AttentionEntropyMonitor: its numbers against statistics of the materialized probabilities, its
schedule, writers, layer names, torch.distributed reduction and torch.compile behaviour."""

from __future__ import annotations

import csv
import json
import math
import os
import sys
import warnings
from typing import Any, Dict, List

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

import torch_ext
from conftest import DEVICES
from torch_ext.monitor import CSVWriter, JSONLWriter

E = 24


class Block(torch.nn.Module):
    def __init__(self, heads: int, scale: Any = None) -> None:
        super().__init__()
        self.attn = torch_ext.nn.MultiheadAttention(E, heads, batch_first=True, scale=scale, train_length=4)
        self.mlp = torch.nn.Linear(E, E)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x, x, x, key_padding_mask=pad, is_causal=True, need_weights=False)[0]
        return x + torch.tanh(self.mlp(x))


class Net(torch.nn.Module):
    """Two causal self-attention layers with 4 and 2 heads."""

    def __init__(self, scale: Any = None) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Block(4, scale), Block(2, scale)])

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, pad)
        return x


def batch(B: int = 3, L: int = 9, seed: int = 0, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, L, E, generator=g, dtype=dtype)
    pad = torch.zeros(B, L, dtype=torch.bool)
    pad[1, 6:] = True  # right padding: rows 6.. of sequence 1 see keys 0..5 only
    pad[2, :2] = True  # left padding: rows 0, 1 of sequence 2 see no key
    return x, pad


def materialized_stats(model: Net, x: torch.Tensor, pad: torch.Tensor) -> Dict[str, Dict[str, torch.Tensor]]:
    """Per layer, per-row statistics (B, H, L) from the materialized float64 probabilities."""
    out: Dict[str, Dict[str, torch.Tensor]] = {}
    B, L, _ = x.shape
    for i, layer in enumerate(model.layers):
        a = layer.attn
        H, d = a.num_heads, a.head_dim
        w, b = a.in_proj_weight, a.in_proj_bias
        q, k = (torch.nn.functional.linear(x, w[j * E : (j + 1) * E], b[j * E : (j + 1) * E]) for j in range(2))
        q, k = (t.view(B, L, H, d).transpose(1, 2) for t in (q, k))
        allowed = torch.ones(L, L, dtype=torch.bool).tril() & ~pad.view(B, 1, 1, L)
        n = allowed.sum(-1).double()  # (B, 1, L)
        lam = 1 / math.sqrt(d)
        if a.policy.scale == "logn":  # log_b(n_i) / sqrt(d), b = train_length = 4
            lam = (n.clamp_min(1).log() / math.log(4) / math.sqrt(d)).unsqueeze(-1)
        logits = (lam * q @ k.transpose(-1, -2)).masked_fill(~allowed, -math.inf)
        p = torch.where(allowed, logits.softmax(-1).nan_to_num(0), 0)
        ent = -(torch.where(p > 0, p * p.log(), 0)).sum(-1)
        p2 = (p * p).sum(-1)
        n = n.expand_as(ent)
        out[f"layers.{i}.attn"] = {
            "n": n,
            "entropy": ent,
            "normalized_entropy": torch.where(n >= 2, ent / n.clamp_min(2).log(), 0),
            "effective_keys": 1 / p2,
            "sparsity": 1 / (n * p2).sqrt(),
            "max_weight": p.amax(-1),
        }
        x = layer(x, pad)
    return out


def check_records(records: List[Dict[str, Any]], ref: Dict[str, Dict[str, torch.Tensor]]) -> None:
    assert sorted({r["layer"] for r in records}) == sorted(ref)
    for r in records:
        s, h = ref[r["layer"]], r["head"]
        valid, valid2 = s["n"][:, h] >= 1, s["n"][:, h] >= 2
        assert r["rows"] == valid.sum().item()
        for name, sel in (("entropy", valid), ("normalized_entropy", valid2)):
            vals = s[name][:, h][sel]
            assert r[f"{name}_mean"] == pytest.approx(vals.mean().item(), rel=1e-9, abs=1e-12)
            assert r[f"{name}_min"] == pytest.approx(vals.min().item(), rel=1e-9, abs=1e-12)
            assert r[f"{name}_max"] == pytest.approx(vals.max().item(), rel=1e-9, abs=1e-12)
        for name in ("effective_keys", "sparsity", "max_weight"):
            assert r[f"{name}_mean"] == pytest.approx(s[name][:, h][valid].mean().item(), rel=1e-9)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale", [None, "logn"])
def test_numbers_match_materialized_probabilities(scale: Any, device: str) -> None:
    torch.manual_seed(0)
    model = Net(scale).double()
    x, pad = batch()
    monitor = torch_ext.AttentionEntropyMonitor(model.to(device), positions=True)
    with monitor:
        model(x.to(device), pad.to(device))
    ref = materialized_stats(model.cpu(), x, pad)
    check_records(monitor.latest, ref)
    assert {r["head"] for r in monitor.latest if r["layer"] == "layers.1.attn"} == {0, 1}
    # per-position profile: mean over the batch rows with n >= 2
    s = ref["layers.0.attn"]
    n2 = s["n"] >= 2
    expected = torch.where(n2, s["normalized_entropy"], 0).sum(0) / n2.sum(0).clamp_min(1)
    torch.testing.assert_close(monitor.latest_positions["layers.0.attn"], expected)


def test_pools_calls_of_one_step() -> None:
    """Two micro-batches in one step pool into the statistics of their concatenation."""
    torch.manual_seed(0)
    model = Net().double()
    x, pad = batch(B=4)
    monitor = torch_ext.AttentionEntropyMonitor(model)
    with monitor.step(0):
        model(x[:2], pad[:2])
        model(x[2:], pad[2:])
    check_records(monitor.latest, materialized_stats(model, x, pad))


@pytest.mark.parametrize("first", ["inference_mode", "no_grad", "enable_grad"])
def test_pools_calls_under_other_grad_modes(first: str) -> None:
    """A step whose first call runs under torch.inference_mode (an evaluation or sampling pass)
    and a later one with autograd pools as any two calls: the first call's accumulators are
    inference tensors, which the second updated in place (RuntimeError)."""
    torch.manual_seed(0)
    model = Net().double()
    x, pad = batch(B=4)
    monitor = torch_ext.AttentionEntropyMonitor(model)
    with monitor.step(0):
        with getattr(torch, first)():
            model(x[:2], pad[:2])
        model(x[2:], pad[2:])
    check_records(monitor.latest, materialized_stats(model, x, pad))


def test_calls_under_vmap_are_left_out_with_a_warning() -> None:
    """Calls under torch.func.vmap (per-sample gradients) are not recorded, with one warning: their
    statistics are the transform's batched tensors, which the end of the step read after the
    transform had ended (an internal assert). The model's outputs are those without the monitor,
    and the step's other calls are recorded."""
    torch.manual_seed(0)
    model = Net().double()
    x, pad = batch(B=4)
    sample = lambda xi, pi: model(xi[None], pi[None])  # noqa: E731
    expected = torch.func.vmap(sample)(x, pad)
    monitor = torch_ext.AttentionEntropyMonitor(model)
    with warnings.catch_warnings(record=True) as caught, monitor.step(0):
        warnings.simplefilter("always")
        out = torch.func.vmap(sample)(x, pad)
        torch.func.vmap(sample)(x, pad)
        model(x, pad)
    ours = [w for w in caught if "does not record attention calls under torch.func.vmap" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]  # once per monitor
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    check_records(monitor.latest, materialized_stats(model, x, pad))


def test_every_n_steps_and_writers(tmp_path: Any) -> None:
    torch.manual_seed(0)
    model = Net()
    x, pad = batch(dtype=torch.float32)
    calls: List[tuple[int, int]] = []
    from torch.utils.tensorboard import SummaryWriter

    tb = SummaryWriter(str(tmp_path / "tb"))
    monitor = torch_ext.AttentionEntropyMonitor(
        model,
        every=3,
        writers=[
            lambda step, records: calls.append((step, len(records))),
            CSVWriter(tmp_path / "stats.csv"),
            JSONLWriter(tmp_path / "stats.jsonl"),
            tb,
        ],
        keep_history=True,
    )
    recorded = []
    for step in range(7):
        with monitor.step(step) as rec:
            recorded.append(rec)
            assert torch_ext.monitor.is_recording() == rec
            model(x, pad)
    monitor.close()
    assert recorded == [True, False, False, True, False, False, True]
    assert calls == [(0, 6), (3, 6), (6, 6)]  # 4 + 2 heads
    assert len(monitor.history) == 18
    rows = list(csv.DictReader(open(tmp_path / "stats.csv")))
    assert len(rows) == 18 and rows[0]["layer"] == "layers.0.attn" and rows[-1]["step"] == "6"
    assert float(rows[0]["entropy_mean"]) == pytest.approx(monitor.history[0]["entropy_mean"])
    lines = [json.loads(line) for line in open(tmp_path / "stats.jsonl")]
    assert len(lines) == 18 and lines[5] == {**monitor.history[5]}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert "attention/layers.0.attn/normalized_entropy_mean" in tags
    assert "attention/layers.1.attn/head_1/entropy_max" in tags
    assert [e.step for e in acc.Scalars("attention/layers.0.attn/entropy_mean")] == [0, 3, 6]


def test_names_without_model_and_auto_steps() -> None:
    model = Net()
    x, pad = batch(dtype=torch.float32)
    monitor = torch_ext.AttentionEntropyMonitor(every=2)
    steps = []
    for _ in range(3):
        with monitor.step() as rec:
            steps.append(rec)
            model(x, pad)
    assert steps == [True, False, True]
    # modules that report themselves, named by class and first appearance; 4 then 2 heads
    heads = {r["layer"]: r["head"] + 1 for r in monitor.latest}
    assert heads == {"MultiheadAttention.0": 4, "MultiheadAttention.1": 2}
    # calls without a module: by order within the step
    q = torch.randn(1, 2, 5, 8)
    with monitor:
        for _ in range(2):
            torch_ext.policy.attend(q, q, q, policy=torch_ext.AttentionPolicy())
    assert sorted({r["layer"] for r in monitor.latest}) == ["attention.0", "attention.1"]


@pytest.mark.parametrize("varlen", [False, True])
def test_sink_rows_of_one_key_have_a_normalized_entropy(varlen: bool) -> None:
    """With a finite sink a row that sees one key is a distribution of two entries (the key and the
    sink), normalized entropy H / ln 2: it counts in that metric's mean, minimum and maximum (they
    had left it out, as without a sink, where it is 0 by definition). A -inf sink is no sink: its
    head keeps the rule n_i >= 2. Dense and packed calls (one document per batch row)."""
    torch.manual_seed(0)
    B, H, L, D = 2, 2, 5, 8
    q, k, v = (torch.randn(B, H, L, D, dtype=torch.float64) for _ in range(3))
    sinks = torch.tensor([0.5, -math.inf], dtype=torch.float64)
    policy = torch_ext.policy.AttentionPolicy()
    _, stats = torch_ext.attention(q, k, v, is_causal=True, sinks=sinks, return_stats=True)
    monitor = torch_ext.AttentionEntropyMonitor()
    with monitor:
        if varlen:
            cu = torch.arange(0, B * L + 1, L, dtype=torch.int32)
            packed = [x.transpose(1, 2).reshape(B * L, H, D) for x in (q, k, v)]
            torch_ext.policy.attend_varlen(*packed, cu, cu, L, L, policy=policy, is_causal=True, sinks=sinks)
        else:
            torch_ext.policy.attend(q, k, v, policy=policy, is_causal=True, sinks=sinks)
    assert len(monitor.latest) == H
    for r in monitor.latest:
        h = r["head"]
        ne, n = stats.normalized_entropy[:, h], stats.n_keys[:, h]
        rows = ne[n >= (1 if h == 0 else 2)]
        assert r["rows"] == B * L
        assert r["normalized_entropy_mean"] == pytest.approx(rows.mean().item(), rel=1e-12)
        assert r["normalized_entropy_min"] == pytest.approx(rows.min().item(), rel=1e-12)
        assert r["normalized_entropy_max"] == pytest.approx(rows.max().item(), rel=1e-12)


def test_empty_calls_record_no_rows() -> None:
    """A batch of 0 or 0 query rows in a recorded step (the module runs them without a monitor):
    no row counts, and the step's other calls keep their statistics (the per-head minimum over no
    rows raised IndexError)."""
    torch.manual_seed(0)
    mha = torch_ext.nn.MultiheadAttention(16, 4, batch_first=True).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    monitor = torch_ext.AttentionEntropyMonitor(mha)
    with monitor:
        mha(x, x, x, need_weights=False)
    alone = monitor.latest
    with monitor:
        for empty in (x[:0], x[:, :0]):
            mha(empty, empty, empty, need_weights=False)
        mha(x, x, x, need_weights=False)
    assert monitor.latest == [{**r, "step": 1} for r in alone]
    with monitor:
        mha(x[:0], x[:0], x[:0], need_weights=False)
    assert [r["rows"] for r in monitor.latest] == [0] * 4
    assert all(math.isnan(r["entropy_mean"]) for r in monitor.latest)


@pytest.mark.parametrize("enter", ["step", "with"])
def test_a_step_no_call_reports_to_warns_once(enter: str) -> None:
    """A recorded step that no call reports to (a model whose attention bypasses torch_ext, e.g. a
    transformers model with attention classes of its own) warns once per monitor, at the caller's
    line, whether the step was entered by ``monitor.step()`` or ``with monitor``; a step with calls
    does not warn."""
    torch.manual_seed(0)
    other = torch.nn.Linear(E, E).double()
    model = Net().double()
    x, pad = batch()
    for net, run, expected in ((other, lambda: other(x), 1), (model, lambda: model(x, pad), 0)):
        monitor = torch_ext.AttentionEntropyMonitor(net, every=1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for s in range(3):
                with monitor.step(s) if enter == "step" else monitor:
                    run()
        ours = [w for w in caught if "no attention call reported to it" in str(w.message)]
        assert len(ours) == expected, [str(w.message) for w in caught]
        assert all(w.filename == __file__ for w in ours), [w.filename for w in ours]
        assert (monitor.latest == []) == (expected == 1)


@pytest.mark.filterwarnings("ignore:AttentionEntropyMonitor recorded step")  # (steps with no call)
def test_errors() -> None:
    with pytest.raises(ValueError, match="every"):
        torch_ext.AttentionEntropyMonitor(every=0)
    with pytest.raises(TypeError, match="^every must be an int, got float"):
        torch_ext.AttentionEntropyMonitor(every=2.0)
    assert torch_ext.AttentionEntropyMonitor(every=np.int64(2)).every == 2  # (numpy's, as step's)
    with pytest.raises(RuntimeError, match="without __enter__"):  # (an AttributeError on None before)
        torch_ext.AttentionEntropyMonitor().__exit__(None, None, None)
    with pytest.raises(TypeError, match="writers"):
        torch_ext.AttentionEntropyMonitor(writers=[42])
    # Checked when the monitor is made (they failed at the first recorded call, naming nothing).
    with pytest.raises(TypeError, match="^model must be a torch.nn.Module or None, got str$"):
        torch_ext.AttentionEntropyMonitor("abc")
    with pytest.raises(TypeError, match="^writers must be a sequence of writers"):
        torch_ext.AttentionEntropyMonitor(writers=5)
    for step in ("a", 2.5, True):
        with pytest.raises(TypeError, match="^step must be an int or None"):
            with torch_ext.AttentionEntropyMonitor().step(step):
                pass
    m1, m2 = torch_ext.AttentionEntropyMonitor(), torch_ext.AttentionEntropyMonitor()
    with m1:
        with pytest.raises(RuntimeError, match="already recording"):
            with m2:
                pass
    assert not torch_ext.monitor.is_recording()
    # The same monitor nested in itself: the same error, and the outer step still ends cleanly.
    with m1:
        with pytest.raises(RuntimeError, match="already recording"):
            with m1:
                pass
        assert torch_ext.monitor.is_recording()
    assert not torch_ext.monitor.is_recording()


@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")
def test_torch_compile_fullgraph() -> None:
    """The op compiles with fullgraph=True (inductor) and matches eager, forward and backward; the
    compiled graph does not report to the monitor (documented), eager calls do."""
    torch.manual_seed(0)
    model = Net("logn")
    x, pad = batch(dtype=torch.float32)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    monitor = torch_ext.AttentionEntropyMonitor(model)
    with pytest.warns(UserWarning, match="not a torch.compile'd graph"), monitor:
        out_c = compiled(x, pad)
    assert monitor.latest == []
    with monitor:
        out_e = model(x, pad)
    assert len(monitor.latest) == 6
    torch.testing.assert_close(out_c, out_e, atol=1e-5, rtol=1e-5)
    g_c = torch.autograd.grad(out_c.square().sum(), list(model.parameters()))
    g_e = torch.autograd.grad(out_e.square().sum(), list(model.parameters()))
    for a, b in zip(g_c, g_e):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.filterwarnings("ignore:AttentionEntropyMonitor recorded step")  # (steps with no call)
def test_compiled_model_does_not_recompile_for_recording_steps() -> None:
    """A compiled model stepped under monitor.step compiles once: the monitor registers no global
    module hooks (it registered some on every recorded step, which changed Dynamo's guards: a
    recompilation per recorded step, 11 graphs in 20 steps, until Dynamo's limit)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = Net("logn").float()
    compiled = torch.compile(model, backend="eager")
    monitor = torch_ext.AttentionEntropyMonitor(model, every=2)
    x, pad = batch(dtype=torch.float32)
    for step in range(6):
        with monitor.step(step):
            compiled(x, pad).sum().backward()
    assert counters["stats"]["unique_graphs"] == 1


def test_names_follow_replaced_and_added_layers() -> None:
    """Layers replaced or added after the monitor's first recorded step are named by their own
    module paths (the names were read once: a replaced layer took the root's name, and layers of
    other head counts pooled into one record raised)."""
    model = Net().double()
    x, pad = batch()
    monitor = torch_ext.AttentionEntropyMonitor(model, every=1)
    with monitor.step(0):
        model(x, pad)
    model.layers[1] = Block(2, "logn").double()
    model.layers.append(Block(3).double())
    with monitor.step(1):
        model(x, pad)
    assert sorted({r["layer"] for r in monitor.latest}) == ["layers.0.attn", "layers.1.attn", "layers.2.attn"]
    assert max(r["head"] for r in monitor.latest if r["layer"] == "layers.2.attn") == 2


def test_threads() -> None:
    """A monitor records its own thread's calls only (another thread running a part of the same
    model under replace_sdpa is not named in its records), and one monitor recording on two threads
    at once raises instead of mixing their calls."""
    import threading

    class SDPALayer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(E, 3 * E)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.proj(x).unflatten(-1, (3, 4, E // 4)).permute(2, 0, 3, 1, 4)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    class Two(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc, self.dec = SDPALayer(), SDPALayer()

    model = Two()
    x = torch.randn(2, 16, E)
    monitor = torch_ext.AttentionEntropyMonitor(model, every=1)
    stop, errors, seen = threading.Event(), [], set()

    def other() -> None:
        try:
            with torch.no_grad(), torch_ext.replace_sdpa():
                while not stop.is_set():
                    model.dec(x)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    thread = threading.Thread(target=other)
    thread.start()
    try:
        for step in range(30):
            with monitor.step(step), torch_ext.replace_sdpa():
                model.enc(x)
            seen |= {r["layer"] for r in monitor.latest}
    finally:
        stop.set()
        thread.join()
    assert not errors and seen == {"enc"}

    entered, release = threading.Event(), threading.Event()

    def hold(enter: Any) -> None:
        with enter():
            entered.set()
            release.wait(30)
            with torch_ext.replace_sdpa():
                model.enc(x)

    # monitor.step(s) and `with monitor` (whose context another thread's entry replaced).
    for enter in (lambda: monitor.step(200), lambda: monitor):
        entered.clear(), release.clear()
        holder = threading.Thread(target=hold, args=(enter,))
        holder.start()
        try:
            assert entered.wait(30)
            with pytest.raises(RuntimeError, match="recording a step on another thread"):
                with enter():
                    pass
        finally:
            release.set()
            holder.join()
        assert {r["layer"] for r in monitor.latest} == {"enc"}  # the holder's step, whole


# --- torch.distributed ------------------------------------------------------------------------
def _ddp_worker(rank: int, world: int, init_file: str, out_file: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = Net().double()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    x, pad = batch(B=4)
    x, pad = x[2 * rank : 2 * rank + 2], pad[2 * rank : 2 * rank + 2]
    monitor = torch_ext.AttentionEntropyMonitor(ddp.module, every=1)
    with monitor.step(0):
        loss = ddp(x, pad).square().mean()
    loss.backward()
    if rank == 0:
        grads = {n: p.grad.tolist() for n, p in model.named_parameters()}
        with open(out_file, "w") as f:
            json.dump({"records": monitor.latest, "grads": grads}, f)
    del ddp
    dist.barrier()
    dist.destroy_process_group()
    # Leave without interpreter finalization: a gloo worker thread that still holds a tensor then
    # asks for the GIL, Python ends that thread by unwinding it through a noexcept frame, and the
    # rank aborts ("terminate called without an active exception", 1 CI run in ~20; see
    # pytorch/pytorch#179291). Everything this rank reports is in out_file, closed above.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def test_ddp_two_processes_gloo(tmp_path: Any) -> None:
    """A 2-process DDP run: the monitor reduces over ranks to the statistics of the whole batch,
    and the gradients equal a single-process run's."""
    out_file = str(tmp_path / "rank0.json")
    mp.spawn(_ddp_worker, args=(2, str(tmp_path / "init"), out_file), nprocs=2, join=True)
    got = json.load(open(out_file))
    torch.manual_seed(0)
    model = Net().double()
    x, pad = batch(B=4)
    model(x, pad).square().mean().backward()
    check_records(got["records"], materialized_stats(model, x, pad))
    for n, p in model.named_parameters():
        torch.testing.assert_close(torch.tensor(got["grads"][n], dtype=torch.float64), p.grad, atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("order", ["recorded_first", "recorded_last", "backward_inside"])
def test_checkpointed_forwards_with_and_without_recording(order: str) -> None:
    """Non-reentrant activation checkpointing re-runs forwards in backward, where the monitor does
    not record. Forwards recorded and not recorded before one backward, in either order or with
    the backward inside the recording step, must all re-run (the op saves the same tensors with
    and without statistics: a shape mismatch was a CheckpointError), give the gradients of the
    plain call, and count each recorded row once."""
    from torch.utils.checkpoint import checkpoint

    from torch_ext.policy import AttentionPolicy, attend

    policy = AttentionPolicy("logn", 1.0, 4)

    def f(q: torch.Tensor) -> torch.Tensor:
        return attend(q, q, q, None, policy=policy, is_causal=True)

    g = torch.Generator().manual_seed(0)
    q1, q2 = (torch.randn(1, 2, 8, 16, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(2))
    monitor = torch_ext.AttentionEntropyMonitor(every=1)
    if order == "recorded_first":
        with monitor.step(0):
            y1 = checkpoint(f, q1, use_reentrant=False)
        y2 = checkpoint(f, q2, use_reentrant=False)
        (y1.sum() + y2.sum()).backward()
    elif order == "recorded_last":
        y2 = checkpoint(f, q2, use_reentrant=False)
        with monitor.step(0):
            y1 = checkpoint(f, q1, use_reentrant=False)
        (y1.sum() + y2.sum()).backward()
    else:
        y2 = checkpoint(f, q2, use_reentrant=False)
        with monitor.step(0):
            y1 = checkpoint(f, q1, use_reentrant=False)
            (y1.sum() + y2.sum()).backward()
    for q in (q1, q2):
        p = q.detach().clone().requires_grad_()
        f(p).sum().backward()
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0)
    assert [r["rows"] for r in monitor.latest] == [8, 8]  # one call of 8 rows, per head
