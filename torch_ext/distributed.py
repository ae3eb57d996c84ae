"""Context-parallel attention with exact statistics over a ``torch.distributed`` process group.

The sequence is split across the ranks of a group: each rank holds the query, key and value rows
of its part, and the key/value blocks travel around the ring of ranks (``batch_isend_irecv``, the
next block in flight while the current one is computed), so that every rank attends its queries to
the whole sequence. Partial results merge exactly through the log-sum-exp, the statistics with
them (:mod:`torch_ext.merge`, docs/math.md section 7), and the log-n scale uses each row's global
n_i, so outputs, statistics and gradients equal the single-device op's to rounding. The backward
passes the dK/dV accumulators around the ring with their blocks.

Causal attention is load balanced as ring-attention implementations do it: the sequence is cut into
2P chunks and rank r holds chunks r and 2P - 1 - r, so every rank has the same causal work.
:func:`shard_sequence` cuts a full tensor that way; :func:`unshard_sequence` puts the parts back.

    torch_ext.distributed.context_parallel_attention(q_local, k_local, v_local, is_causal=True,
                                                     scale="logn", return_stats=True)

Works with any backend that has point-to-point operations (gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

import contextlib
import math
import numbers
import struct
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from torch_ext import monitor as _monitor
from torch_ext.attention import AttentionStats, _flag, _policy_args
from torch_ext.merge import RowState, derived_stats, merge_row_states

__all__ = ["context_parallel_attention", "global_positions", "shard_sequence", "unshard_sequence"]

_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)  # as codes in the same-call check


def _world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, size) of the calling process in ``group``."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch_ext.distributed needs an initialized torch.distributed process group")
    return dist.get_rank(group), dist.get_world_size(group)


def _chunks(rank: int, world: int, load_balance: bool) -> list[int]:
    """The sequence chunks a rank holds, in order: (rank, 2P - 1 - rank) of 2P, or (rank,) of P."""
    return [rank, 2 * world - 1 - rank] if load_balance else [rank]


def shard_sequence(x: torch.Tensor, group: dist.ProcessGroup | None = None, *, dim: int = 2,
                   load_balance: bool = True) -> torch.Tensor:
    """This rank's part of a full ``x`` along ``dim`` (the sequence): chunks r and 2P - 1 - r of 2P
    equal chunks, concatenated (``load_balance=False``: chunk r of P)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    rank, world = _world(group)
    parts = 2 * world if load_balance else world
    if x.shape[dim] % parts != 0:
        raise ValueError(f"the sequence length {x.shape[dim]} must be a multiple of {parts} (the chunks of "
                         f"{world} ranks{' with load balancing' if load_balance else ''})")
    chunks = x.chunk(parts, dim)
    return torch.cat([chunks[c] for c in _chunks(rank, world, load_balance)], dim).contiguous()


def unshard_sequence(x: torch.Tensor, group: dist.ProcessGroup | None = None, *, dim: int = 2,
                     load_balance: bool = True) -> torch.Tensor:
    """The full tensor from every rank's part (all_gather; the inverse of :func:`shard_sequence`)."""
    rank, world = _world(group)
    per_rank = len(_chunks(0, world, load_balance))
    if x.shape[dim] % per_rank != 0:  # (as global_positions: the rows are two chunks)
        raise ValueError(f"with load_balance the local length must be even (two chunks), got {x.shape[dim]}")
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    ordered: list[torch.Tensor | None] = [None] * (per_rank * world)
    for r, part in enumerate(parts):
        for piece, c in zip(part.chunk(per_rank, dim), _chunks(r, world, load_balance)):
            ordered[c] = piece
    return torch.cat(ordered, dim)


def global_positions(local_len: int, group: dist.ProcessGroup | None = None, *,
                     load_balance: bool = True, device: torch.device | str = "cpu") -> torch.Tensor:
    """The global sequence positions (int64) of this rank's ``local_len`` rows."""
    if isinstance(local_len, bool) or not isinstance(local_len, (numbers.Integral, torch.SymInt)):
        raise TypeError(f"local_len must be an int, got {type(local_len).__name__}")
    if local_len < 0:
        raise ValueError(f"local_len must be >= 0, got {local_len}")
    rank, world = _world(group)
    chunks = _chunks(rank, world, load_balance)
    if local_len % len(chunks) != 0:
        raise ValueError(f"with load_balance the local length must be even (two chunks), got {local_len}")
    size = local_len // len(chunks)
    return torch.cat([torch.arange(c * size, (c + 1) * size, device=device) for c in chunks])


def _from_bits(bits: int) -> float:
    """The inverse of :func:`_float_bits`."""
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def _collective_device(query: Any, group: dist.ProcessGroup | None) -> torch.device:
    """Where this rank's check tensors live: query's device, or for a call without a tensor query
    the device the group's backend communicates on (for a query on another device too)."""
    if isinstance(query, torch.Tensor) and query.device.type in _DEVICE_CODES:
        return query.device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _float_bits(x: float) -> int:
    """The bits of float64 ``x`` as an int64, for comparing floats exactly across ranks."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _check_same_call(error: BaseException | None, signature: Sequence[int], group: dist.ProcessGroup | None,
                     world: int, device: torch.device) -> None:
    """Every rank reaches this (collective) before any transfer. It raises on every rank when a
    rank's call is invalid (that rank its own ``error``, the others a ValueError naming it) or when
    the ranks' calls differ (``signature``: shapes, dtypes, device, flags, the scale policy), instead
    of letting the other ranks hang in the ring's transfers or compute rows of another attention."""
    mine = torch.tensor([int(error is not None), *signature], dtype=torch.int64, device=device)
    # (a rank whose call is too malformed to sign sends a flagged zero signature of the same size)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    failed = [r for r, e in enumerate(every) if e[0] != 0]
    if error is not None:
        raise error
    if failed:
        raise ValueError(f"context_parallel_attention: the call of rank(s) {failed} is invalid (see the error there); "
                         "every rank stops")
    rows = [e[1:].tolist() for e in every]
    differ = [i for i in range(len(_SIGNATURE)) if any(row[i] != rows[0][i] for row in rows)]
    if differ:
        def show(i: int, v: int) -> object:
            name = _SIGNATURE[i]
            if name in _NAMED_CODES:
                return _NAMED_CODES[name][v] if v != -1 else "other"
            if name in _BOOL_FIELDS:
                return bool(v)
            if v == -1 and (name in _FLOAT_FIELDS or name.startswith("scale tensor")):
                return "none"
            return _from_bits(v) if name in _FLOAT_FIELDS else v

        table = "; ".join(f"{_SIGNATURE[i]}: " + ", ".join(f"rank {r}: {show(i, row[i])}" for r, row in enumerate(rows))
                          for i in differ)
        raise ValueError(f"context_parallel_attention: the ranks' calls differ ({table}); every rank must pass the "
                         "same shapes, dtypes and options")


def _exchange(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None, rank: int,
              world: int) -> tuple[list[torch.Tensor], list[Any]]:
    """Starts sending ``tensors`` to the next rank and receiving the previous rank's into new
    buffers; returns (buffers, requests)."""
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    g_nxt = dist.get_global_rank(group, nxt) if group is not None else nxt
    g_prv = dist.get_global_rank(group, prv) if group is not None else prv
    recv = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]  # contiguous
    ops = [dist.P2POp(dist.isend, t.contiguous(), g_nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, b, g_prv, group) for b in recv]
    return recv, dist.batch_isend_irecv(ops)


@contextlib.contextmanager
def _completing(pending: tuple[list[torch.Tensor], list[Any]] | None) -> Iterator[None]:
    """Waits for the transfers of ``pending`` (from :func:`_exchange`) after the block, also when
    it raises: requests left posted would pair with the next call's transfers."""
    try:
        yield
    finally:
        for req in pending[1] if pending is not None else ():
            req.wait()


def _pairs(q_chunks: list[int], kv_chunks: list[int], causal: bool) -> list[tuple[int, int, bool]]:
    """(local query chunk, block key chunk, diagonal) for the chunk pairs with allowed keys: all of
    them without causality; with it, key chunks before the query chunk whole and the same chunk
    causally (chunks after the query chunk are skipped)."""
    pairs = []
    for qi, qc in enumerate(q_chunks):
        for ki, kc in enumerate(kv_chunks):
            if not causal or kc < qc:
                pairs.append((qi, ki, False))
            elif kc == qc:
                pairs.append((qi, ki, True))
    return pairs


class _RingAttention(torch.autograd.Function):
    """Ring attention over the group: forward merges the blocks' row states; backward recomputes
    each block with the merged statistics (the whole row's p_ij) and passes dK/dV around."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lam: torch.Tensor,
                causal: bool, group: dist.ProcessGroup | None, load_balance: bool) -> tuple[torch.Tensor, ...]:
        rank, world = _world(group)
        per = len(_chunks(0, world, load_balance))
        q_chunks = _chunks(rank, world, load_balance)
        q_parts, lam_parts = q.chunk(per, 2), lam.chunk(per, 2)
        running: list[RowState | None] = [None] * per
        k_cur, v_cur = k, v
        for step in range(world):
            src = (rank - step) % world
            pending = _exchange([k_cur, v_cur], group, rank, world) if step < world - 1 else None
            k_parts, v_parts = k_cur.chunk(per, 2), v_cur.chunk(per, 2)
            with _completing(pending):
                for qi, ki, diag in _pairs(q_chunks, _chunks(src, world, load_balance), causal):
                    res = torch.ops.entropy_attn.attention(
                        q_parts[qi], k_parts[ki], v_parts[ki], None, lam_parts[qi], is_causal=diag,
                        enable_gqa=q.shape[1] != k.shape[1], return_stats=True)
                    # The output in the accumulate type while blocks merge: rounded to q's dtype once.
                    state = RowState(res[0].to(res[1].dtype), res[1], res[2], res[3], res[4], res[5])
                    running[qi] = state if running[qi] is None else merge_row_states([running[qi], state])
            if pending is not None:
                k_cur, v_cur = pending[0]
        merged = [s if s is not None else _empty_state(qp, v) for s, qp in zip(running, q_parts)]
        out, lse, ent, sum_p2, max_w, n = (torch.cat(field, 2) for field in zip(*merged))
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, lam, out, lse, ent, sum_p2)
        ctx.causal, ctx.group, ctx.load_balance = causal, group, load_balance
        ctx.mark_non_differentiable(max_w, n)
        return out, lse, ent, sum_p2, max_w, n

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        # Without a graph of its own, also under create_graph=True (the accumulators are views
        # updated in place, which autograd would refuse there): the first-order gradients are those
        # of the single call, which has no second order either. There they carry a node that
        # raises if differentiated, as the single call's do, rather than entering a second
        # derivative as constants.
        with torch.no_grad():
            result = _RingAttention._gradients(ctx, *grads)
        if not torch.is_grad_enabled():
            return result
        inputs = [t for t in ctx.saved_tensors[:4] if t.requires_grad]
        return tuple(g if g is None else _FirstOrderOnly.apply(g, *inputs) for g in result)

    @staticmethod
    def _gradients(ctx: Any, g_out: torch.Tensor | None, g_lse: torch.Tensor | None, g_ent: torch.Tensor | None,
                   g_sum_p2: torch.Tensor | None, *_: Any) -> tuple[Any, ...]:
        q, k, v, lam, out, lse, ent, sum_p2 = ctx.saved_tensors
        group, load_balance = ctx.group, ctx.load_balance
        rank, world = _world(group)
        per = len(_chunks(0, world, load_balance))
        q_chunks = _chunks(rank, world, load_balance)
        g_out = torch.zeros_like(out) if g_out is None else g_out.contiguous()
        rows = [t.chunk(per, 2) for t in (q, lam, out, lse, ent, sum_p2, g_out)]
        grads = [None if g is None else g.chunk(per, 2) for g in (g_lse, g_ent, g_sum_p2)]
        acc = _acc_dtype(q)
        # d lambda only where lambda needs a gradient (a scale tensor that does): the kernels skip it
        # otherwise.
        grad_scale = ctx.needs_input_grad[3]
        dq = [torch.zeros(p.shape, dtype=acc, device=q.device) for p in rows[0]]
        dlam = [torch.zeros(p.shape, dtype=lse.dtype, device=q.device) for p in rows[1]] if grad_scale else []
        k_cur, v_cur = k, v
        dk_cur = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv_cur = torch.zeros(v.shape, dtype=acc, device=v.device)
        for step in range(world):
            src = (rank - step) % world
            pending = _exchange([k_cur, v_cur], group, rank, world) if step < world - 1 else None
            k_parts, v_parts = k_cur.chunk(per, 2), v_cur.chunk(per, 2)
            dk_parts, dv_parts = dk_cur.chunk(per, 2), dv_cur.chunk(per, 2)
            with _completing(pending):
                for qi, ki, diag in _pairs(q_chunks, _chunks(src, world, load_balance), ctx.causal):
                    qp, lp, op, lsep, entp, p2p, gop = (r[qi] for r in rows)
                    g = [None if gr is None else gr[qi].contiguous() for gr in grads]
                    dqp, dkp, dvp, dlp, _, _ = torch.ops.entropy_attn.attention_backward(
                        gop, g[0], g[1], g[2], qp, k_parts[ki], v_parts[ki], None, op, lsep, entp, p2p, lp, diag,
                        grad_scale=grad_scale)
                    dq[qi] += dqp
                    if grad_scale:
                        dlam[qi] += dlp
                    dk_parts[ki].add_(dkp)  # views of dk_cur, dv_cur
                    dv_parts[ki].add_(dvp)
            if pending is not None:
                k_cur, v_cur = pending[0]
            # The block's accumulators follow it to the next rank; after the last step they reach
            # the block's owner (a ring of one holds its own).
            if world > 1:
                (dk_cur, dv_cur), requests = _exchange([dk_cur, dv_cur], group, rank, world)
                for req in requests:
                    req.wait()
        return (torch.cat(dq, 2).to(q.dtype), dk_cur.to(k.dtype), dv_cur.to(v.dtype),
                torch.cat(dlam, 2).to(lam.dtype) if grad_scale else None, None, None, None)


class _FirstOrderOnly(torch.autograd.Function):
    """A gradient of the ring under create_graph=True, given a node (its inputs: the ring's inputs
    that require grad) whose backward raises: a second derivative through the ring fails, as the
    single call's does, instead of taking the gradient for a constant."""

    @staticmethod
    def forward(ctx: Any, grad: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        return grad.clone()

    @staticmethod
    def backward(ctx: Any, *_: Any) -> Any:
        raise RuntimeError("context_parallel_attention has no second derivative (create_graph=True gives the "
                           "first-order gradients; as the single call, whose attention_backward has none)")


def _empty_state(q: torch.Tensor, v: torch.Tensor) -> RowState:
    """The row state of rows that saw no key (causal chunks before every key: never on a ring
    whose ranks hold their own diagonal chunk, kept for completeness)."""
    acc = _acc_dtype(q)
    rows = torch.zeros(q.shape[:3], dtype=acc, device=q.device)
    out = torch.zeros(*q.shape[:3], v.shape[3], dtype=acc, device=q.device)
    return RowState(out, rows, rows, rows, rows, torch.zeros(q.shape[:3], dtype=torch.int64, device=q.device))


def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    is_causal: bool = False,
    scale: float | str | torch.Tensor | None = None,
    temperature: float = 1.0,
    enable_gqa: bool = False,
    train_length: float = 512,
    scale_factor: float | torch.Tensor | None = None,
    return_stats: bool = False,
    load_balance: bool = True,
    module: torch.nn.Module | None = None,
    **unsupported: Any,
) -> torch.Tensor | tuple[torch.Tensor, AttentionStats]:
    """:func:`torch_ext.attention` over a sequence sharded across the ranks of ``group``.

    Args:
        query, key, value: this rank's rows, (B, H, L/P, D), (B, Hkv, L/P, D), (B, Hkv, L/P, Dv),
            as :func:`shard_sequence` cuts the full tensors (query and key sharded alike: self
            attention over one sequence). Every rank must pass the same shapes, dtypes and
            options; if they differ, every rank raises a ValueError naming the difference, and a
            call that is invalid on one rank raises on every rank (there its own error), before
            any transfer.
        is_causal: causal masking over the global positions (load balanced: see the module).
        scale: as :func:`torch_ext.attention`: ``None`` (1/sqrt(D)), a float, ``"logn"`` /
            ``"logn_sharpen"`` (from each row's global n_i), or a tensor broadcastable to
            (B, H, L/P) giving the base scale c_i of this rank's rows (lambda_i = c_i /
            temperature; differentiable).
        temperature, train_length, scale_factor, enable_gqa: as :func:`torch_ext.attention`
            (checked by the same code).
        return_stats: also return the rows' :class:`AttentionStats`, merged exactly.
        load_balance: the sharding of :func:`shard_sequence` (``False``: contiguous parts).
        module: names the layer for an :class:`~torch_ext.AttentionEntropyMonitor` that is
            recording (as :func:`torch_ext.policy.attend`); the rows are reported with their global
            positions, and the monitor's end-of-step all-reduce merges the ranks.
        unsupported: :func:`torch_ext.attention`'s other arguments (masks, windows, softcap, sinks,
            dropout) are not supported: any keyword argument here raises a TypeError, on every rank
            (a rank that alone passed one would otherwise leave the others waiting).

    The backward is collective too: every rank must differentiate the call when one does (the
    ranks check that their inputs agree on requiring grad; a rank whose loss does not use the
    output leaves the others waiting in the backward's transfers until the group's timeout, as
    DDP's all-reduce would).

    Returns:
        This rank's output rows (B, H, L/P, Dv), or ``(output, stats)``; equal to the rows of the
        single-device call on the full tensors to rounding, gradients included.
    """
    rank, world = _world(group)
    error: BaseException | None = None
    signature = [0] * _SIGNATURE_LEN
    try:
        if unsupported:
            raise TypeError(f"context_parallel_attention got unsupported keyword arguments {sorted(unsupported)}: it "
                            "takes no masks, windows, softcap, sinks or dropout")
        is_causal, load_balance = _flag(is_causal, "is_causal"), _flag(load_balance, "load_balance")
        signature = _local_call(query, key, value, scale, temperature, train_length, scale_factor, is_causal,
                                enable_gqa, load_balance)
        device = query.device.type
        if torch.is_autocast_enabled(device):
            # As the single call under torch.autocast (csrc/autocast.cpp): query, key and value that
            # autocast may cast (floating point, not float64) run in the region's dtype, and so
            # does the output (cast before the checks below, which then see the dtypes the blocks
            # run in, as the single call's do).
            dtype = torch.get_autocast_dtype(device)
            query, key, value = (t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t
                                 for t in (query, key, value))
        # The op's own checks of this rank's block (dtypes, head dims, GQA, and the scale policy: a
        # scale tensor's shape, a float scale or temperature beyond float32's range), on the Meta
        # device and before the row scale (whose 1 / sqrt(D) needs a head dim): no rank starts a
        # transfer for a call the op would refuse.
        scale_tensor, policy = _policy_args(scale, temperature, train_length, scale_factor)
        if scale_tensor is not None and scale_tensor.device != query.device:
            raise ValueError(f"the {_SCALE_TENSOR} must be on query's device ({query.device}), got "
                             f"{scale_tensor.device}")
        meta = [t.to("meta") for t in (query, key, value)]
        torch.ops.entropy_attn.attention(*meta, None, None if scale_tensor is None else scale_tensor.to("meta"),
                                         is_causal=is_causal, enable_gqa=query.shape[1] != key.shape[1],
                                         return_stats=True, **policy)
        lam = _row_scale(query, scale_tensor, policy, is_causal, group, load_balance, total=query.shape[2] * world)
    except Exception as exc:  # noqa: BLE001 (any error of one rank's call must reach every rank)
        error = exc
    _check_same_call(error, signature, group, world, _collective_device(query, group))

    with torch.autocast(query.device.type, enabled=False):  # (cast above: the blocks need no cast)
        out, lse, ent, sum_p2, max_w, n = _RingAttention.apply(query, key, value, lam, bool(is_causal), group,
                                                               load_balance)
    recording = _monitor.is_recording()
    if not (return_stats or recording):
        return out
    # (for the monitor alone, outside autograd: a checkpointed re-run, which does not record,
    # must save what this forward saved)
    with torch.set_grad_enabled(torch.is_grad_enabled() and return_stats):
        normalized, sparsity, effective = derived_stats(ent, sum_p2, n)
    stats = AttentionStats(lse=lse, entropy=ent, normalized_entropy=normalized, sparsity=sparsity,
                           effective_keys=effective, max_weight=max_w, n_keys=n, scale=lam.detach())
    if recording:  # the monitor's end-of-step all-reduce sums the ranks' rows
        positions = global_positions(query.shape[2], group, load_balance=load_balance, device=query.device)
        _monitor.record(stats, module, positions)
    return (out, stats) if return_stats else out


# What _local_call returns, by name (the dtypes, the device type and the scale mode as indices of
# the tuples of _NAMED_CODES, flags as 0 / 1, floats by their bits; -1 none).
_SIGNATURE = (
    *(f"{t}.shape[{d}]" for t in ("query", "key", "value") for d in range(4)),
    "query dtype", "key dtype", "value dtype", "device", "is_causal", "load_balance",
    "scale mode", "temperature", "train_length", "float scale or scale_factor",
    *(f"scale tensor shape[{d}]" for d in range(3)),
    "requires grad",
)
_FLOAT_FIELDS = ("temperature", "train_length", "float scale or scale_factor")
_BOOL_FIELDS = ("is_causal", "load_balance", "requires grad")
_SCALE_TENSOR = "scale tensor (scale, or scale_factor with a length policy)"  # (as the op's messages)
_DEVICE_CODES = ("cpu", "cuda")
_SCALE_MODE_CODES = ("fixed", "logn", "logn_sharpen")
# The fields sent as an index of a tuple, printed by name where the ranks differ.
_NAMED_CODES: dict[str, tuple[object, ...]] = {
    "query dtype": _DTYPES, "key dtype": _DTYPES, "value dtype": _DTYPES,
    "device": _DEVICE_CODES, "scale mode": _SCALE_MODE_CODES,
}
_SIGNATURE_LEN = len(_SIGNATURE)


def _local_call(query: Any, key: Any, value: Any, scale: object, temperature: object, train_length: object,
                scale_factor: object, is_causal: bool, enable_gqa: bool, load_balance: bool) -> list[int]:
    """The checks of this rank's call that need no other rank (TypeError / ValueError naming the
    argument), and its signature for :func:`_check_same_call`: the shapes, dtypes and device of
    query, key and value, the flags, and the scale policy (floats by their bits)."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (batch, heads, local length, dim), got {t.dim()}-D")
    if query.shape[2] != key.shape[2] or key.shape[2] != value.shape[2]:
        raise ValueError("query, key and value must hold the same rows of one sequence (self attention), got "
                         f"local lengths {query.shape[2]}, {key.shape[2]} and {value.shape[2]}")
    enable_gqa = _flag(enable_gqa, "enable_gqa")  # (where the heads match too, as the single call)
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(f"query has {query.shape[1]} heads and key {key.shape[1]}: pass enable_gqa=True")
    if query.device.type not in _DEVICE_CODES:  # (the ring's transfers and the check's gather need one)
        raise ValueError(f"query must be on a CPU or CUDA device, got {query.device}")
    if load_balance and query.shape[2] % 2 != 0:
        raise ValueError(f"with load_balance the local length must be even (two chunks), got {query.shape[2]}")
    scale_tensor, policy = _policy_args(scale, temperature, train_length, scale_factor)
    codes = [_DTYPES.index(t.dtype) if t.dtype in _DTYPES else -1 for t in (query, key, value)]
    device = query.device.type
    codes.append(_DEVICE_CODES.index(device))
    factor = policy["scale_factor"]
    policy_codes = [
        _SCALE_MODE_CODES.index(policy["scale_mode"]),
        _float_bits(policy["temperature"]),
        _float_bits(policy["log_base"]),
        -1 if factor is None else _float_bits(factor),  # a float scale or scale_factor
    ]
    if scale_tensor is not None and not scale_tensor.is_floating_point():
        raise TypeError(f"the {_SCALE_TENSOR} must be floating point, got {scale_tensor.dtype}")
    # (A rank whose inputs need no gradient runs no backward: the others would wait for it there.)
    differentiable = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (query, key, value, scale_tensor))
    return [*query.shape, *key.shape, *value.shape, *codes, int(is_causal), int(load_balance), *policy_codes,
            *_row_tensor_shape(scale_tensor, query), int(differentiable)]


def _row_tensor_shape(t: torch.Tensor | None, query: torch.Tensor) -> list[int]:
    """The shape of the scale tensor (``scale``, or ``scale_factor`` of the log-n policies)
    left-padded to (B, H, L/P), [-1, -1, -1] for none: the ranks' shapes must agree (its values are
    each rank's own rows)."""
    if t is None:
        return [-1, -1, -1]
    if t.dim() > 3:
        raise ValueError(f"the {_SCALE_TENSOR} of shape {tuple(t.shape)} does not broadcast to (B, H, L/P) = "
                         f"{tuple(query.shape[:3])}")
    return [1] * (3 - t.dim()) + list(t.shape)


def _acc_dtype(query: torch.Tensor) -> torch.dtype:
    """The row scale's dtype, the op's accumulate type: float64 for float64 queries, else float32."""
    return torch.float64 if query.dtype == torch.float64 else torch.float32


def _row_scale(query: torch.Tensor, scale_tensor: torch.Tensor | None, policy: dict, causal: bool,
               group: dist.ProcessGroup | None, load_balance: bool, total: int) -> torch.Tensor:
    """lambda_i of this rank's rows, (B, H, L/P) in the accumulate type: c g(n_i) / temperature
    with the global n_i (the op's definition, ops.cpp; g from torch_ext.length_factor), from the
    scale arguments as the single-device call's own ``_policy_args`` checked and mapped them."""
    acc = _acc_dtype(query)
    if scale_tensor is not None:
        c = scale_tensor.to(acc)
    elif policy["scale_factor"] is not None:
        c = policy["scale_factor"]
    else:
        c = 1 / math.sqrt(query.shape[3])
    shape = query.shape[:3]
    positions = global_positions(shape[2], group, load_balance=load_balance, device=query.device)
    n = positions + 1 if causal else torch.full_like(positions, total)
    factor = torch.ops.entropy_attn.length_factor(n, policy["scale_mode"], policy["temperature"],
                                                  policy["log_base"], dtype=acc)
    return torch.broadcast_to(c * factor, shape)
