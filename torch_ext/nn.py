"""``torch_ext.nn.MultiheadAttention``: ``torch.nn.MultiheadAttention`` on the fused op, with a scale
policy, a temperature and an optional learnable per-head scale."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from torch_ext.attention import _check_tensors, _flag, length_factor
from torch_ext.nested import is_jagged
from torch_ext.policy import AttentionPolicy, attend, hide_masked

__all__ = ["MultiheadAttention"]


def _keep_off_fast_path(module: torch.nn.Module, args: Any) -> None:
    """A no-op forward pre-hook. ``nn.TransformerEncoderLayer`` skips its fused inference fast path
    (which reads ``self_attn``'s weights and never calls its forward) when a submodule has hooks."""


class MultiheadAttention(torch.nn.MultiheadAttention):
    """Drop-in for :class:`torch.nn.MultiheadAttention` computed by the fused op.

    Same constructor arguments, parameters and ``state_dict`` keys (``in_proj_weight``,
    ``in_proj_bias``, ``out_proj.*``, ``q/k/v_proj_weight`` when ``kdim``/``vdim`` differ,
    ``bias_k``/``bias_v``), same forward signature and mask conventions (bool masks: ``True`` =
    not allowed; float masks are added), so existing weights load and calls are unchanged. It is
    an instance of ``torch.nn.MultiheadAttention``.

    Keyword-only additions:
        scale: the scale policy of :func:`torch_ext.attention`: ``None`` (1/sqrt(head_dim), as
            torch), a float, ``"logn"`` (log_b(n_i)/sqrt(head_dim), b = ``train_length``) or
            ``"logn_sharpen"``. n_i counts the keys row i may attend to under the masks.
        temperature: divides the scale.
        train_length: the log base b of the "logn" policies.
        learnable_scale: adds a parameter ``head_scale`` of shape (num_heads,), initialized to 1,
            that multiplies each head's scale: with ``scale="logn"`` this is the SSMax form
            s_h log_b(n_i)/sqrt(head_dim). A state_dict without ``head_scale`` (e.g. from
            ``torch.nn.MultiheadAttention``) still loads strictly, keeping the initial value.

    Attention dropout (``dropout``, in training mode) runs inside the fused op (a Philox mask that
    the backward regenerates); the statistics, and the weights ``need_weights=True`` returns, are
    those before dropout (torch returns them after). ``need_weights=True`` (torch's default) materializes the (L, S) weights, as torch does: pass
    ``need_weights=False`` (as ``nn.TransformerEncoderLayer`` does) to keep memory linear in L.
    A row with no allowed key attends to nothing: its attention output is 0, so the module returns
    ``out_proj``'s bias there (torch gives the same on its SDPA path with ``need_weights=False``
    and gradients enabled, and NaN with ``need_weights=True`` or on its fused inference path).
    Jagged nested tensors (``layout=torch.jagged``, (B, j, E) with ``batch_first=True`` and
    ``need_weights=False``) run without padding, each sequence attending to its own keys, where
    torch's module takes none; nested tensors of the strided layout are not supported (build
    ``nn.TransformerEncoder`` with ``enable_nested_tensor=False``: in eval mode with a padding mask
    its default would pass them).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: Optional[int] = None,
        vdim: Optional[int] = None,
        batch_first: bool = False,
        device: Any = None,
        dtype: Optional[torch.dtype] = None,
        *,
        scale: float | str | None = None,
        temperature: float = 1.0,
        train_length: float = 512,
        learnable_scale: bool = False,
    ) -> None:
        super().__init__(
            embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim, batch_first, device, dtype
        )
        self.policy = AttentionPolicy(scale, temperature, train_length)
        self.head_scale: Optional[torch.nn.Parameter] = None
        if learnable_scale:
            self.head_scale = torch.nn.Parameter(torch.ones(num_heads, device=device, dtype=dtype))
        self.register_forward_pre_hook(_keep_off_fast_path)

    def __prepare_scriptable__(self) -> "MultiheadAttention":
        """``torch.jit.script`` (deprecated in torch) calls this on every submodule before compiling:
        the forward runs Python wrappers that TorchScript cannot compile, so say so here rather than
        fail deep inside them. ``torch.jit.trace``, ``torch.compile`` and ``torch.export`` work."""
        raise RuntimeError(
            "torch_ext.nn.MultiheadAttention cannot be compiled by torch.jit.script; use torch.jit.trace, "
            "torch.compile or torch.export (the ops themselves, torch.ops.entropy_attn.*, are scriptable)"
        )

    def extra_repr(self) -> str:
        p = self.policy
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, batch_first={self.batch_first}, "
            f"scale={p.scale!r}, temperature={p.temperature}, train_length={p.train_length}, "
            f"learnable_scale={self.head_scale is not None}"
        )

    def _reset_parameters(self) -> None:
        """torch's initialization, and ``head_scale`` at 1 (``to_empty()`` after meta-device
        construction leaves it uninitialized, as every parameter)."""
        super()._reset_parameters()
        if getattr(self, "head_scale", None) is not None:  # (torch's __init__ calls this before it exists)
            with torch.no_grad():
                self.head_scale.fill_(1.0)

    def _load_from_state_dict(
        self, state_dict: dict, prefix: str, local_metadata: dict, strict: bool, missing_keys: list,
        unexpected_keys: list, error_msgs: list,
    ) -> None:
        key = prefix + "head_scale"
        absent = self.head_scale is not None and key not in state_dict
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        if absent and key in missing_keys:  # a torch.nn.MultiheadAttention state_dict: keep the init
            missing_keys.remove(key)
            # Built on the meta device and loaded with assign=True: there is no init to keep, so the
            # init value (1), where the projections just loaded are (the submodules load after this).
            loaded = [p for name, p in self._parameters.items() if name != "head_scale" and p is not None]
            if self.head_scale.is_meta and loaded and not loaded[0].is_meta:
                w = loaded[0]
                self.head_scale = torch.nn.Parameter(torch.ones(self.num_heads, device=w.device, dtype=w.dtype))

    def forward(  # type: ignore[override]
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Optional[Tensor] = None,
        need_weights: bool = True,
        attn_mask: Optional[Tensor] = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Optional[Tensor]]:
        """As :meth:`torch.nn.MultiheadAttention.forward`. ``is_causal=True`` applies causality
        (top-left aligned) on top of ``attn_mask``: torch's module reads it as a hint that
        ``attn_mask`` is the causal mask, and where it is the two agree; a mask that also carries a
        bias or padding keeps them, as torch's ``need_weights=True`` path keeps them. Unlike torch's
        module, ``is_causal`` needs no ``attn_mask``."""
        _check_tensors(attn_mask=(attn_mask, True), key_padding_mask=(key_padding_mask, True))
        dropout_p = float(self.dropout) if self.training else 0.0
        if not 0.0 <= dropout_p <= 1.0:  # (as F.dropout, in training only; not the op's "dropout_p")
            raise ValueError(f"dropout must be in [0, 1], got {self.dropout}")
        # dropout = 1 drops every weight, as in torch's module: the op's output times 0 (the op
        # itself takes p < 1, scaling the kept weights by 1 / (1 - p); the statistics and the
        # weights returned are those before dropout, as for any p).
        drop_all = dropout_p == 1.0
        dropout_p = 0.0 if drop_all else dropout_p
        is_causal = _flag(is_causal, "is_causal")  # (not truthiness: is_causal="False" is no False)
        if any(is_jagged(x) for x in (query, key, value)):
            return self._forward_jagged(query, key, value, key_padding_mask, need_weights, attn_mask, is_causal,
                                        dropout_p, drop_all)
        if query.is_nested or key.is_nested or value.is_nested:
            raise ValueError(
                "torch_ext.nn.MultiheadAttention does not take nested tensors of the strided layout: build "
                "nn.TransformerEncoder with enable_nested_tensor=False (or pass jagged ones, layout=torch.jagged)"
            )
        batched = query.dim() == 3
        if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(
                "query, key and value must all be 3-D (batched) or 2-D (unbatched), got "
                f"{query.dim()}-D, {key.dim()}-D and {value.dim()}-D"
            )
        if not batched:
            if key_padding_mask is not None and key_padding_mask.dim() != 1:
                raise ValueError(
                    "key_padding_mask of unbatched inputs must be 1-D (S,), got shape "
                    f"{tuple(key_padding_mask.shape)}"
                )
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        # now (B, L, E), (B, S, kdim), (B, S, vdim)
        B, L, E = query.shape
        S, H = key.shape[1], self.num_heads
        self._check_embedding_dims(query, key, value)
        # (As torch's module: no broadcasting of a batch of 1, which attend() would do for SDPA.)
        if key.shape[0] != B or value.shape[0] != B:
            raise ValueError(
                f"query, key and value must have the same batch size, got {B}, {key.shape[0]} and {value.shape[0]}"
            )
        if value.shape[1] != S:
            raise ValueError(f"key and value must have the same sequence length, got {S} and {value.shape[1]}")

        q, k, v = self._project(query, key, value)
        if self.bias_k is not None and self.bias_v is not None:
            k = torch.cat([k, self.bias_k.expand(B, 1, E)], dim=1)
            v = torch.cat([v, self.bias_v.expand(B, 1, E)], dim=1)
        q, k, v = (t.unflatten(-1, (H, self.head_dim)).transpose(1, 2) for t in (q, k, v))
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(B, H, 1, self.head_dim)], dim=2)
            v = torch.cat([v, v.new_zeros(B, H, 1, self.head_dim)], dim=2)
        extra = k.shape[2] - S  # appended keys, visible to every row

        # The appended keys fall outside a top-left causal band over the longer key list: there
        # causality is a mask over the S keys, which leaves them visible to every row.
        causal = torch.ones(L, S, dtype=torch.bool, device=query.device).triu(1) if is_causal and extra else None
        is_causal = is_causal and causal is None
        mask = self._merged_mask(attn_mask, key_padding_mask, B, L, S, extra, q.dtype, causal)

        multiplier = None if self.head_scale is None else self.head_scale.view(H, 1)
        if need_weights:
            out, weights = self._attention_with_weights(q, k, v, mask, is_causal, multiplier, dropout_p)
            weights = weights.mean(dim=1) if average_attn_weights else weights
        else:
            out = attend(
                q, k, v, mask, policy=self.policy, is_causal=is_causal, multiplier=multiplier, module=self,
                dropout_p=dropout_p,
            )
            weights = None
        if drop_all:
            out = out * 0.0
        # (a view: the output follows q's layout, split from the projection above)
        out = self.out_proj(out.transpose(1, 2).flatten(2))  # (B, L, E)
        if not batched:
            return out.squeeze(0), None if weights is None else weights.squeeze(0)
        if not self.batch_first:
            out = out.transpose(0, 1)
        return out, weights

    def _check_embedding_dims(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        """A ValueError unless the last dims of (B, L, E) query, key and value are embed_dim, kdim
        and vdim."""
        if query.shape[-1] != self.embed_dim:
            raise ValueError(f"query's embedding dim must be embed_dim={self.embed_dim}, got {query.shape[-1]}")
        if key.shape[-1] != self.kdim or value.shape[-1] != self.vdim:
            raise ValueError(
                f"key's and value's embedding dims must be kdim={self.kdim} and vdim={self.vdim}, got "
                f"{key.shape[-1]} and {value.shape[-1]}"
            )

    def _forward_jagged(
        self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor], need_weights: bool,
        attn_mask: Optional[Tensor], is_causal: bool, dropout_p: float, drop_all: bool,
    ) -> tuple[Tensor, None]:
        """Jagged nested (B, j, E) query, key and value (``batch_first``): sequences of different
        lengths without padding, each attending to its own keys, through the op's jagged path
        (torch_ext/nested.py). What ragged rows cannot have raises, naming it: masks (there is no
        padding to mask), ``need_weights=True`` (the weights of ragged rows have no tensor shape),
        and the keys ``add_bias_kv`` and ``add_zero_attn`` append."""
        named = {"query": query, "key": key, "value": value}
        for name, x in named.items():
            if not is_jagged(x):
                raise ValueError(
                    f"{name} is not a jagged nested tensor while another of query, key and value is: pass all "
                    "three as nested tensors of layout torch.jagged, or none"
                )
            if x.dim() != 3 or x._ragged_idx != 1:
                raise ValueError(
                    f"{name} must be a jagged (B, j, E) tensor, ragged in dim 1, got {x.dim()} dims ragged in dim "
                    f"{x._ragged_idx}"
                )
            if x.lengths() is not None:  # (torch's linear layers refuse them)
                raise ValueError(
                    f"{name} is a jagged tensor with holes (torch.nested.narrow), which the projections do not take: "
                    f"pass {name}.contiguous()"
                )
        refused = (
            ("batch_first=False", not self.batch_first),
            ("attn_mask", attn_mask is not None),
            ("key_padding_mask", key_padding_mask is not None),
            ("need_weights=True (pass need_weights=False)", need_weights),
            ("add_bias_kv", self.bias_k is not None),
            ("add_zero_attn", self.add_zero_attn),
        )
        for what, given in refused:
            if given:
                raise ValueError(f"torch_ext.nn.MultiheadAttention with jagged nested tensors does not take {what}")
        self._check_embedding_dims(query, key, value)
        q, k, v = self._project(query, key, value)
        q, k, v = (t.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2) for t in (q, k, v))
        multiplier = None if self.head_scale is None else self.head_scale.view(self.num_heads, 1)
        out = attend(
            q, k, v, policy=self.policy, is_causal=is_causal, multiplier=multiplier, module=self, dropout_p=dropout_p
        )
        if drop_all:
            out = out * 0.0
        return self.out_proj(out.transpose(1, 2).flatten(2)), None

    def _project(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        E = self.embed_dim
        b = self.in_proj_bias
        bq, bk, bv = (None, None, None) if b is None else (b[:E], b[E : 2 * E], b[2 * E :])
        if self._qkv_same_embed_dim:
            w = self.in_proj_weight
            wq, wk, wv = w[:E], w[E : 2 * E], w[2 * E :]
        else:
            wq, wk, wv = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        return F.linear(query, wq, bq), F.linear(key, wk, bk), F.linear(value, wv, bv)

    def _merged_mask(
        self, attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor], B: int, L: int, S: int,
        extra: int, dtype: torch.dtype, causal: Optional[Tensor] = None,
    ) -> Optional[Tensor]:
        """attn_mask, key_padding_mask and ``causal`` (an (L, S) bool mask in torch's convention,
        True = masked) in the op's convention (bool True = attend, or additive), broadcastable to
        (B, H, L, S + extra); the ``extra`` appended keys are allowed."""
        masks = []
        for name, m in (("attn_mask", attn_mask), ("key_padding_mask", key_padding_mask)):
            if m is not None and not (m.dtype == torch.bool or m.is_floating_point()):
                # (as torch.nn.MultiheadAttention: an integer mask is neither convention)
                raise TypeError(f"{name} must be a bool or floating-point tensor, got {m.dtype}")
        if attn_mask is not None:
            if attn_mask.dim() == 2:
                if attn_mask.shape != (L, S):
                    raise ValueError(f"2-D attn_mask must have shape {(L, S)}, got {tuple(attn_mask.shape)}")
            elif attn_mask.dim() == 3:
                if attn_mask.shape != (B * self.num_heads, L, S):
                    raise ValueError(
                        f"3-D attn_mask must have shape {(B * self.num_heads, L, S)}, got {tuple(attn_mask.shape)}"
                    )
                attn_mask = attn_mask.view(B, self.num_heads, L, S)
            else:
                raise ValueError(f"attn_mask must be 2-D or 3-D, got {attn_mask.dim()}-D")
            masks.append(attn_mask)
        if key_padding_mask is not None:
            if key_padding_mask.shape != (B, S):
                raise ValueError(f"key_padding_mask must have shape {(B, S)}, got {tuple(key_padding_mask.shape)}")
            masks.append(key_padding_mask.view(B, 1, 1, S))
        if causal is not None:
            masks.append(causal)
        if not masks:
            return None
        if all(m.dtype == torch.bool for m in masks):
            allowed = ~masks[0]
            for m in masks[1:]:
                allowed = allowed & ~m
            return F.pad(allowed, (0, extra), value=True)
        additive = None
        for m in masks:
            term = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(m, float("-inf")) if m.dtype == torch.bool else m.to(dtype)
            additive = term if additive is None else additive + term
        return F.pad(additive, (0, extra), value=0.0)

    def _attention_with_weights(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Optional[Tensor],
        is_causal: bool,
        multiplier: Optional[Tensor],
        dropout_p: float = 0.0,
    ) -> tuple[Tensor, Tensor]:
        """The output, from the op, and the (B, H, L, S) weights before dropout, materialized with
        the op's own per-row scale (``need_weights=True``)."""
        out, stats = attend(
            q, k, v, mask, policy=self.policy, is_causal=is_causal, multiplier=multiplier, module=self,
            return_stats=True, dropout_p=dropout_p,
        )
        lam = stats.scale  # lambda_i, not differentiable: route the learnable multiplier's gradient
        if multiplier is not None:
            # lambda_i = m * (base * g(n_i) / tau): rebuilt from the row's n_i, so that the weights'
            # gradient reaches m also where m = 0 (lambda / m loses it there)
            policy = self.policy
            base = policy.attention_kwargs(q.shape[-1])["scale_factor" if policy.uses_length else "scale"]
            unit = base * length_factor(
                stats.n_keys, policy.scale if policy.uses_length else "fixed", temperature=policy.temperature,
                train_length=policy.train_length, dtype=lam.dtype,
            )
            lam = unit * multiplier.to(lam.dtype)
        # In the accumulation type, as the op forms them: in float16 the unscaled q . k overflows
        # (65504) where lambda_i q . k is still moderate, and such a row's weights came out 0.
        acc = torch.promote_types(q.dtype, torch.float32)
        logits = lam.unsqueeze(-1).to(acc) * (q.to(acc) @ k.to(acc).transpose(-1, -2))
        L, S = logits.shape[-2:]
        if is_causal:
            logits = logits.masked_fill(torch.ones(L, S, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        if mask is not None:
            # The op's reading of the mask (attend): float entries at or below finfo.min / 2 hide
            # their key, so a row they hide entirely has the output's 0 weights, not the uniform
            # ones that adding finfo.min would give.
            mask = hide_masked(mask)
            logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask
        # Rows without a visible key get weights 0 and no gradient: their logits are replaced
        # before the softmax (whose NaN, zeroed after it, still reached the gradient as NaN).
        empty = ~(logits > float("-inf")).any(dim=-1, keepdim=True)
        weights = torch.softmax(logits.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
        return out, weights.to(q.dtype)
