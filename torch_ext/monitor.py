"""``AttentionEntropyMonitor``: per-layer, per-head attention statistics during training, from the
fused op's per-row outputs (no L x L matrix), recorded every N steps.

The wrappers (``torch_ext.nn.MultiheadAttention``, ``torch_ext.replace_sdpa``, the ``torch_ext.hf``
backend) call :func:`torch_ext.policy.attend`, which asks :func:`is_recording` and, on a recording
step, passes the statistics to :func:`record`. On a recording step the per-head sums, minima and
maxima stay on the device; they are copied to the host once, when the step ends (after an
all-reduce under ``torch.distributed``), and handed to the writers. Other steps cost one check.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import numbers
import os
import sys
import threading
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch

from torch_ext import _functorch
from torch_ext.attention import AttentionStats

__all__ = ["AttentionEntropyMonitor", "CSVWriter", "CallbackWriter", "JSONLWriter", "TensorBoardWriter", "record"]

#: The per-head fields of a record, in order (besides ``step``, ``layer``, ``head`` and ``rows``).
METRICS = (
    "entropy_mean",
    "entropy_min",
    "entropy_max",
    "normalized_entropy_mean",
    "normalized_entropy_min",
    "normalized_entropy_max",
    "effective_keys_mean",
    "sparsity_mean",
    "max_weight_mean",
)
# Sums over rows (means = sum / count): entropy, effective keys, sparsity and max weight over rows
# with n_i >= 1; normalized entropy over rows whose distribution has at least two entries, n_i >= 2
# or, under a sink (one that is not -inf), n_i >= 1 (it is 0 by definition below: H / ln 1).
_SUMS = ("entropy", "effective_keys", "sparsity", "max_weight", "normalized_entropy")
# The columns of the per-step table (one row per layer and head): sums, row counts, minima, maxima.
_COLUMNS = _SUMS + ("rows", "rows_n2", "entropy_min", "normalized_entropy_min", "entropy_max", "normalized_entropy_max")

Record = Dict[str, Any]
"""One (step, layer, head): ``step``, ``layer``, ``head``, ``rows`` (rows with n_i >= 1) and
:data:`METRICS` (floats; NaN where no row qualified)."""


@dataclass
class _LayerAccumulator:
    """Per-head partial reductions of one layer over the calls of one step, on the device."""

    sums: torch.Tensor  # (H, len(_SUMS)) float64
    counts: torch.Tensor  # (H, 2) float64: rows with n >= 1, rows of at least two entries
    mins: torch.Tensor  # (H, 2): entropy, normalized entropy
    maxs: torch.Tensor  # (H, 2)
    position_sum: Optional[torch.Tensor] = None  # (H, Lq): normalized entropy summed over batch
    position_count: Optional[torch.Tensor] = None  # (H, Lq): rows of at least two entries

    def add(self, other: "_LayerAccumulator") -> None:
        if self.sums.shape != other.sums.shape:
            raise RuntimeError(
                f"a layer was called with {other.sums.shape[0]} and {self.sums.shape[0]} heads in one step"
            )
        # Out of place: a call under torch.inference_mode leaves inference tensors, which a later
        # call of the step (the training forward) may not update in place.
        self.sums = self.sums + other.sums
        self.counts = self.counts + other.counts
        self.mins = torch.minimum(self.mins, other.mins)
        self.maxs = torch.maximum(self.maxs, other.maxs)
        if self.position_sum is not None and other.position_sum is not None:
            self.position_sum, other_sum = _pad_to_same(self.position_sum, other.position_sum)
            self.position_count, other_count = _pad_to_same(self.position_count, other.position_count)
            self.position_sum = self.position_sum + other_sum
            self.position_count = self.position_count + other_count


def _pad_to_same(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-pads the last dim of the shorter of two (H, L) tensors."""
    n = max(a.shape[-1], b.shape[-1])
    return (torch.nn.functional.pad(a, (0, n - a.shape[-1])), torch.nn.functional.pad(b, (0, n - b.shape[-1])))


def _reduce_call(
    stats: AttentionStats,
    positions: bool,
    row_positions: Optional[torch.Tensor] = None,
    rows: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
) -> _LayerAccumulator:
    """Per-head reductions of one call's (B, H, Lq) statistics over batch and rows.

    ``row_positions`` (Lq,) or (B, Lq): the position of each row for the per-position curve, when
    it is not the row index (a packed call: the row's position inside its own document; a call
    with a KV cache: the token's position). ``rows`` (B, Lq) bool: the rows to count (False:
    padding tokens), beside the rule that a row must see a key. ``sinks`` (H,): the call's sink
    logits; a head whose sink is not -inf (no sink) has n_i + 1 entries per row, so its
    rows with n_i = 1 have a normalized entropy, H_i / ln 2."""
    n = stats.n_keys
    valid = n >= 1
    if rows is not None:
        valid = valid & rows.to(valid.device).unsqueeze(1)
    entries = n
    if sinks is not None:
        entries = n + (~torch.isneginf(sinks.detach())).to(device=n.device, dtype=n.dtype).view(1, -1, 1)
    valid2 = valid & (entries >= 2)
    f64 = torch.float64

    def masked_sum(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return torch.where(m, x.to(f64), 0).sum(dim=(0, 2))

    def masked_extreme(x: torch.Tensor, m: torch.Tensor, fill: float, op: Callable) -> torch.Tensor:
        per_head = torch.where(m, x.to(f64), fill).transpose(0, 1).flatten(1)
        if per_head.shape[1] == 0:  # an empty call (no batch or no rows): no row qualifies
            return per_head.new_full((per_head.shape[0],), fill)
        return op(per_head, dim=1)

    sums = torch.stack(
        [
            masked_sum(stats.entropy, valid),
            masked_sum(stats.effective_keys, valid),
            masked_sum(stats.sparsity, valid),
            masked_sum(stats.max_weight, valid),
            masked_sum(stats.normalized_entropy, valid2),
        ],
        dim=1,
    )
    counts = torch.stack([valid.sum(dim=(0, 2)), valid2.sum(dim=(0, 2))], dim=1).to(f64)
    inf = math.inf
    mins = torch.stack(
        [masked_extreme(stats.entropy, valid, inf, torch.amin), masked_extreme(stats.normalized_entropy, valid2, inf, torch.amin)],
        dim=1,
    )
    maxs = torch.stack(
        [masked_extreme(stats.entropy, valid, -inf, torch.amax), masked_extreme(stats.normalized_entropy, valid2, -inf, torch.amax)],
        dim=1,
    )
    acc = _LayerAccumulator(sums.detach(), counts, mins.detach(), maxs.detach())
    if positions:
        acc.position_sum = torch.where(valid2, stats.normalized_entropy.to(f64), 0).sum(0).detach()
        acc.position_count = valid2.sum(0).to(f64)
        if row_positions is not None:  # rows at the same position pool together
            # (B, H, Lq) -> (H, B * Lq), each row with its position
            values = torch.where(valid2, stats.normalized_entropy.to(f64), 0).transpose(0, 1).flatten(1)
            counts = valid2.transpose(0, 1).flatten(1).to(f64)
            index = row_positions.long().to(values.device).expand(n.shape[0], n.shape[2]).flatten()
            index = index.clamp(min=0).expand_as(values)  # (padding rows may carry -1: not counted)
            length = int(index.max()) + 1 if index.numel() else 0
            heads = values.shape[0]
            acc.position_sum = values.new_zeros(heads, length).scatter_add_(1, index, values).detach()
            acc.position_count = counts.new_zeros(heads, length).scatter_add_(1, index, counts)
    return acc


def _record(step: int, layer: str, head: int, row: List[float]) -> Record:
    """A :data:`Record` from one row of the per-step table (columns :data:`_COLUMNS`)."""
    v = dict(zip(_COLUMNS, row))
    counts = {name: v["rows_n2"] if name == "normalized_entropy" else v["rows"] for name in _SUMS}
    out: Record = {"step": step, "layer": layer, "head": head, "rows": int(v["rows"])}
    for m in METRICS:
        name, stat = m.rsplit("_", 1)
        c = counts[name]
        out[m] = math.nan if c == 0 else (v[name] / c if stat == "mean" else v[m])
    return out


class _Writer:
    """What a writer implements: ``write(step, records)`` once per recorded step; ``close()``."""

    def write(self, step: int, records: List[Record]) -> None:  # pragma: no cover - interface
        """Receives the records of one recorded step: one per (layer, head)."""
        raise NotImplementedError

    def close(self) -> None:
        """Flushes and releases what the writer holds (called by the monitor's ``close``)."""


class CallbackWriter(_Writer):
    """Calls ``fn(step, records)``."""

    def __init__(self, fn: Callable[[int, List[Record]], None]) -> None:
        self.fn = fn

    def write(self, step: int, records: List[Record]) -> None:
        """Calls ``fn(step, records)``."""
        self.fn(step, records)


class TensorBoardWriter(_Writer):
    """Scalars to a ``torch.utils.tensorboard.SummaryWriter``: ``{prefix}/{layer}/{metric}`` (the
    mean over heads) and, with ``per_head``, ``{prefix}/{layer}/head_{h}/{metric}``."""

    def __init__(self, summary_writer: Any, prefix: str = "attention", per_head: bool = True,
                 metrics: Sequence[str] = METRICS) -> None:
        self.summary_writer, self.prefix, self.per_head, self.metrics = summary_writer, prefix, per_head, metrics

    def write(self, step: int, records: List[Record]) -> None:
        """Adds the step's scalars (NaN metrics, of rows that had none, are left out)."""
        by_layer: Dict[str, List[Record]] = {}
        for r in records:
            by_layer.setdefault(r["layer"], []).append(r)
        for layer, rs in by_layer.items():
            for m in self.metrics:
                values = [r[m] for r in rs if not math.isnan(r[m])]
                if values:
                    self.summary_writer.add_scalar(f"{self.prefix}/{layer}/{m}", sum(values) / len(values), step)
                if self.per_head:
                    for r in rs:
                        if not math.isnan(r[m]):
                            self.summary_writer.add_scalar(f"{self.prefix}/{layer}/head_{r['head']}/{m}", r[m], step)

    def close(self) -> None:
        """Flushes the SummaryWriter (which stays open: it is the caller's)."""
        self.summary_writer.flush()


class CSVWriter(_Writer):
    """One row per (step, layer, head) in a CSV file (header written once; appends)."""

    FIELDS = ("step", "layer", "head", "rows") + METRICS

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        new = not os.path.exists(self.path) or os.path.getsize(self.path) == 0
        self._file = open(self.path, "a", newline="")
        self._csv = csv.DictWriter(self._file, fieldnames=self.FIELDS)
        if new:
            self._csv.writeheader()

    def write(self, step: int, records: List[Record]) -> None:
        """Appends one row per record and flushes."""
        self._csv.writerows(records)
        self._file.flush()

    def close(self) -> None:
        """Closes the file."""
        self._file.close()


class JSONLWriter(_Writer):
    """One JSON object per (step, layer, head) per line (NaN written as null; appends)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self._file = open(os.fspath(path), "a")

    def write(self, step: int, records: List[Record]) -> None:
        """Appends one line per record and flushes."""
        for r in records:
            clean = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()}
            self._file.write(json.dumps(clean) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Closes the file."""
        self._file.close()


def _as_writer(w: Any) -> _Writer:
    if isinstance(w, _Writer):
        return w
    if hasattr(w, "add_scalar"):  # a SummaryWriter
        return TensorBoardWriter(w)
    if callable(w):
        return CallbackWriter(w)
    raise TypeError(
        "writers must be torch_ext.monitor writers (TensorBoardWriter, CSVWriter, JSONLWriter, "
        f"CallbackWriter), a SummaryWriter or a callable(step, records), got {type(w).__name__}"
    )


_state = threading.local()  # .monitor: the monitor recording on this thread, if any


def _active() -> Optional["AttentionEntropyMonitor"]:
    return getattr(_state, "monitor", None)


def _ensure_idle() -> None:
    """Raises if a monitor records on this thread already (monitors do not nest)."""
    if _active() is not None:
        raise RuntimeError("an AttentionEntropyMonitor is already recording on this thread")


def _user_stacklevel() -> int:
    """The ``stacklevel`` of the first caller outside this module and contextlib, for a warning
    raised where a step ends (through one or two context managers, by how it was entered)."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename in (__file__, contextlib.__file__):
        frame, level = frame.f_back, level + 1
    return level


def is_recording() -> bool:
    """Whether an :class:`AttentionEntropyMonitor` is recording on this thread (always False
    while torch.compile traces: a compiled graph does not report to the monitor, and during
    backward: a checkpointed forward's re-run does not report twice). The op saves the same
    tensors with and without statistics, so such a re-run may differ from its forward here."""
    # (Cheapest first: every attention call of a model asks. The compile check comes first, so that
    # a traced graph never reads the thread's monitor.)
    if torch.compiler.is_compiling() or _active() is None:
        return False
    return not _in_backward()


def step_token() -> Optional[object]:
    """An object that identifies the step the monitor of this thread is recording (None when none
    records): what a wrapper keeps from one call for a later call of the same step."""
    m = _active()
    return m._layers if m is not None and is_recording() else None


def _in_backward() -> bool:
    """Whether this call runs inside the autograd engine: activation checkpointing re-running a
    forward in backward, whose rows the forward recorded (or chose not to) already."""
    return torch._C._current_graph_task_id() != -1


def record(
    stats: AttentionStats,
    module: Optional[torch.nn.Module] = None,
    positions: Optional[torch.Tensor] = None,
    rows: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
) -> None:
    """Adds one attention call's statistics to the recording monitor (no-op when none records).

    ``module`` names the layer (its path in the monitor's model); without it, the innermost module
    of the model that is running, else the call's order in the step. ``positions`` (Lq,) or
    (B, Lq): each row's position for the per-position curves when it is not the row index (packed
    documents, KV caches). ``rows`` (B, Lq) bool: which rows count (False: padding tokens).
    ``sinks`` (H,): the call's sink logits, if it had any (a row that sees one key and a sink
    that is not -inf has a normalized entropy: it counts in that metric's mean, minimum and maximum).
    """
    m = _active()
    if m is None or not is_recording():
        return
    if _functorch.vmap_active():
        if not m._warned_vmap:
            m._warned_vmap = True
            warnings.warn(
                "AttentionEntropyMonitor does not record attention calls under torch.func.vmap (their "
                "statistics are batched tensors of the transform, gone when it ends): the monitor leaves "
                "them out; record a step that runs the model without vmap",
                stacklevel=3,
            )
        return
    m._add(stats, module, positions, rows, sinks)


def _running_module(names: Dict[int, str]) -> Optional[str]:
    """The path of the innermost module of the model running on this thread: from the caller up,
    the first frame whose first argument (``self`` of a method, ``module`` of a function such as
    transformers' ``eager_attention_forward``) is one of the model's modules (``names``: id ->
    path). A frame walk, on recorded calls only, rather than global forward hooks: those changed
    what torch.compile guards on at every recorded step (a recompilation each time) and saw every
    thread's modules."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_argcount:
            name = names.get(id(frame.f_locals.get(code.co_varnames[0])))
            if name is not None:
                return name
        frame = frame.f_back
    return None


class AttentionEntropyMonitor:
    """Records attention statistics per layer and head every ``every`` steps.

    Args:
        model: the model whose attention layers are monitored; layers are named by their module
            path in it (e.g. ``"model.layers.3.self_attn"``), and calls of one layer within a step
            (micro-batches) pool into one record per head. Without it, a module that reports
            itself (``torch_ext.nn.MultiheadAttention``, the hf backend) is named by its class and
            order of appearance (``"MultiheadAttention.0"``), other calls by their order in the
            step (``"attention.0"``, ``"attention.1"``, ...).
        every: record on steps ``s`` with ``s % every == 0``.
        writers: where records go, each step that records: ``TensorBoardWriter`` (or a
            ``SummaryWriter`` itself), ``CSVWriter``, ``JSONLWriter``, ``CallbackWriter`` (or any
            callable ``fn(step, records)``).
        reduce: under an initialized ``torch.distributed`` with several ranks, reduce the
            statistics over ``process_group`` (sums and row counts summed, minima and maxima
            taken), so that every rank holds the global numbers. Every rank must then record the
            same layers on the same steps (as with DDP).
        rank_zero_only: with several ranks, only rank 0 calls the writers.
        positions: also keep, per layer, the normalized entropy per query position (mean over
            batch and calls, shape (H, Lq)), in :attr:`latest_positions`.
        keep_history: append each step's records to :attr:`history`.

    Usage::

        monitor = torch_ext.AttentionEntropyMonitor(model, every=100, writers=[SummaryWriter()])
        for step, batch in enumerate(loader):
            with monitor.step(step):      # records on steps 0, 100, 200, ...
                loss = model(batch)
            loss.backward(); opt.step()

    ``with monitor:`` records every call until it exits (e.g. one evaluation pass) as one step.
    Only attention run through ``torch_ext`` wrappers is seen: ``torch_ext.nn.MultiheadAttention``,
    ``torch_ext.replace_sdpa``, the ``torch_ext.hf`` backend, or :func:`torch_ext.policy.attend`.
    The first recorded step that no call reports to warns (the model's attention bypasses
    torch_ext). Calls under ``torch.func.vmap`` are not recorded (a warning says so, once); ``torch.func.grad``
    alone records as eager calls do. Under ``torch.compile`` the compiled graph does not report
    (the op compiles with ``fullgraph=True`` and the monitor records nothing from it): monitor
    eagerly on the steps that record, or read ``return_stats=True`` outputs from the compiled
    model.
    """

    def __init__(
        self,
        model: Optional[torch.nn.Module] = None,
        *,
        every: int = 100,
        writers: Sequence[Any] = (),
        reduce: bool = True,
        process_group: Any = None,
        rank_zero_only: bool = True,
        positions: bool = False,
        keep_history: bool = False,
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, numbers.Integral):  # (numpy's too, as step's)
            raise TypeError(f"every must be an int, got {type(every).__name__}")
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every!r}")
        every = int(every)
        # (checked here: a wrong model or writers failed only at the first recorded call)
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
        if not isinstance(writers, Iterable) or isinstance(writers, (str, bytes)):
            raise TypeError(f"writers must be a sequence of writers (a list of one for one), got {type(writers).__name__}")
        self.model = model
        self.every = every
        self.writers = [_as_writer(w) for w in writers]
        self.reduce, self.process_group, self.rank_zero_only = reduce, process_group, rank_zero_only
        self.positions = positions
        self.keep_history = keep_history
        self.history: List[Record] = []
        #: the records of the last recorded step (after the reduction over ranks).
        self.latest: List[Record] = []
        #: layer -> (H, Lq) mean normalized entropy per query position (with ``positions=True``).
        self.latest_positions: Dict[str, torch.Tensor] = {}
        self._layers: Dict[str, _LayerAccumulator] = {}
        self._names: Optional[Dict[int, str]] = None
        self._unnamed: Dict[int, str] = {}
        self._anonymous_calls = 0
        self._warned_vmap = False
        self._warned_empty = False
        self._busy = threading.Lock()  # held while a step records (by one thread at a time)
        self._step_counter = 0
        self._cm: Optional[contextlib.AbstractContextManager] = None

    # --- activation ---------------------------------------------------------------------------
    def should_record(self, step: int) -> bool:
        """Whether ``step`` is one the monitor records."""
        return step % self.every == 0

    @contextlib.contextmanager
    def step(self, step: Optional[int] = None) -> Iterator[bool]:
        """Context for one training step; records if ``step % every == 0``. Yields whether it
        records. Without ``step``, counts the steps itself (0, 1, 2, ...)."""
        if step is not None:  # (an int, numpy's included: a float or str step failed later or counted wrong)
            if isinstance(step, bool) or not isinstance(step, numbers.Integral):
                raise TypeError(f"step must be an int or None, got {type(step).__name__}")
            step = int(step)
        if step is None:
            step = self._step_counter
        self._step_counter = step + 1
        if not self.should_record(step):
            yield False
            return
        with self._recording(step):
            yield True

    def __enter__(self) -> "AttentionEntropyMonitor":
        """Records every call until ``__exit__`` as one step (the monitor's next step number),
        whatever ``every`` says."""
        _ensure_idle()  # before replacing self._cm, which an outer `with self` still needs
        step = self._step_counter
        self._step_counter += 1
        cm = self._recording(step)
        cm.__enter__()  # (raises while another thread records: self._cm is that thread's)
        self._cm = cm
        return self

    def __exit__(self, *exc: Any) -> None:
        cm, self._cm = self._cm, None
        if cm is None:
            raise RuntimeError("AttentionEntropyMonitor.__exit__ without __enter__: use `with monitor:`")
        cm.__exit__(*exc)

    @contextlib.contextmanager
    def _recording(self, step: int) -> Iterator[None]:
        _ensure_idle()
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(
                "this AttentionEntropyMonitor is recording a step on another thread: give each thread its own "
                "monitor (one step's statistics cannot mix two threads' calls)"
            )
        try:
            # The module names are read anew each recorded step: layers replaced or added since the
            # last one get their own paths.
            self._layers, self._anonymous_calls, self._names = {}, 0, None
            _state.monitor = self
            try:
                yield
            finally:
                _state.monitor = None
            self._flush(step)
        finally:
            self._busy.release()

    def _module_names(self) -> Dict[int, str]:
        if self._names is None:
            assert self.model is not None
            self._names = {id(m): name or type(m).__name__ for name, m in self.model.named_modules()}
        return self._names

    # --- recording ----------------------------------------------------------------------------
    def _layer_name(self, module: Optional[torch.nn.Module]) -> str:
        if self.model is not None:
            names = self._module_names()
            name = names.get(id(module)) if module is not None else None
            if name is None:
                name = _running_module(names)
            if name is not None:
                return name
        if module is not None:  # no model: name modules by class and first appearance
            return self._unnamed.setdefault(id(module), f"{type(module).__name__}.{len(self._unnamed)}")
        self._anonymous_calls += 1  # no module: by call order within the step
        return f"attention.{self._anonymous_calls - 1}"

    def _add(
        self,
        stats: AttentionStats,
        module: Optional[torch.nn.Module],
        positions: Optional[torch.Tensor] = None,
        rows: Optional[torch.Tensor] = None,
        sinks: Optional[torch.Tensor] = None,
    ) -> None:
        name = self._layer_name(module)
        with torch.no_grad():  # the reductions must not join the model's autograd graph
            acc = _reduce_call(stats, self.positions, positions, rows, sinks)
        if name in self._layers:
            self._layers[name].add(acc)
        else:
            self._layers[name] = acc

    # --- end of a recorded step ---------------------------------------------------------------
    def _flush(self, step: int) -> None:
        names = sorted(self._layers)
        accs = [self._layers[n] for n in names]
        self._layers = {}
        if not accs and not self._warned_empty:
            # A step with no call is almost always a model whose attention bypasses torch_ext; its
            # empty records alone would not say why.
            self._warned_empty = True
            warnings.warn(
                f"AttentionEntropyMonitor recorded step {step}, but no attention call reported to it: only "
                "attention run eagerly through torch_ext (torch_ext.nn.MultiheadAttention, replace_sdpa, the "
                "torch_ext.hf backend, torch_ext.policy.attend) is seen, not a torch.compile'd graph; a "
                "transformers model that picks its attention class from a table of its own (Falcon, GPT-J, "
                "GPT-Neo, Bark, GIT, SAM's vision encoder, ...) keeps that attention after "
                "set_attn_implementation(name)",
                stacklevel=_user_stacklevel(),
            )
        multi_rank = self.reduce and _world_size(self.process_group) > 1
        if multi_rank:
            self._reduce_over_ranks(names, accs)
        rows: List[List[float]] = []
        if accs:  # one host copy for the whole step
            rows = torch.cat([torch.cat([a.sums, a.counts, a.mins, a.maxs], 1) for a in accs]).cpu().tolist()
        heads = [(name, h) for name, a in zip(names, accs) for h in range(a.sums.shape[0])]
        records = [_record(step, name, h, row) for (name, h), row in zip(heads, rows)]
        self.latest = records
        self.latest_positions = {
            name: (a.position_sum / a.position_count.clamp_min(1)).cpu()
            for name, a in zip(names, accs)
            if a.position_sum is not None
        }
        if self.keep_history:
            self.history.extend(records)
        if not (multi_rank and self.rank_zero_only and _rank(self.process_group) != 0):
            for w in self.writers:
                w.write(step, records)

    def _reduce_over_ranks(self, names: List[str], accs: List[_LayerAccumulator]) -> None:
        """All-reduces the accumulators in place (sums and counts summed, min and max taken)."""
        import torch.distributed as dist

        group = self.process_group
        signature = [(n, a.sums.shape[0]) for n, a in zip(names, accs)]
        gathered: List[Any] = [None] * _world_size(group)
        dist.all_gather_object(gathered, signature, group=group)
        if any(g != signature for g in gathered):
            raise RuntimeError(
                "AttentionEntropyMonitor: ranks recorded different layers in one step "
                f"(this rank: {signature}); every rank must run the same attention layers"
            )
        if not accs:
            return
        sums = torch.cat([torch.cat([a.sums, a.counts], 1) for a in accs])
        mins = torch.cat([a.mins for a in accs])
        maxs = torch.cat([a.maxs for a in accs])
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(mins, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(maxs, op=dist.ReduceOp.MAX, group=group)
        row = 0
        for a in accs:
            h = a.sums.shape[0]
            a.sums, a.counts = sums[row : row + h, : len(_SUMS)], sums[row : row + h, len(_SUMS) :]
            a.mins, a.maxs = mins[row : row + h], maxs[row : row + h]
            row += h
            if a.position_sum is not None:
                # Ranks may have seen different positions (context parallelism shards the
                # sequence): pad every rank's curves to the longest before summing.
                length = torch.tensor([a.position_sum.shape[-1]], device=a.position_sum.device)
                dist.all_reduce(length, op=dist.ReduceOp.MAX, group=group)
                pad = int(length.item()) - a.position_sum.shape[-1]
                a.position_sum = torch.nn.functional.pad(a.position_sum, (0, pad))
                a.position_count = torch.nn.functional.pad(a.position_count, (0, pad))
                dist.all_reduce(a.position_sum, group=group)
                dist.all_reduce(a.position_count, group=group)

    def close(self) -> None:
        """Closes the writers."""
        for w in self.writers:
            w.close()


def _world_size(group: Any) -> int:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _rank(group: Any) -> int:
    import torch.distributed as dist

    return dist.get_rank(group)

