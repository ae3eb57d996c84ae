"""The transformers backend (torch_ext.hf): parity with attn_implementation="sdpa" (outputs and
gradients, decoder with GQA and encoder, padded and not), KV-cache generation, the "logn" policy
against an independent reference, the monitor's layer names and the errors.

Tiny random-weight models built from configs (no downloads), CPU, float32.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Tuple

import pytest
import torch

transformers = pytest.importorskip("transformers")

import torch_ext  # noqa: E402
import torch_ext.hf as hf  # noqa: E402
from transformers import AutoModel, AutoModelForCausalLM, BertConfig, LlamaConfig  # noqa: E402

PLAIN = "torch_ext_test_plain"
LOGN = "torch_ext_test_logn"
TRAIN_LENGTH = 4  # small, so that log_b(n_i) is far from 1 at the test lengths (a wrong n_i shows)
VOCAB, B, L = 100, 2, 12
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module", autouse=True)
def _backends() -> None:
    assert hf.register(PLAIN) == PLAIN
    assert hf.register(LOGN, scale="logn", train_length=TRAIN_LENGTH) == LOGN


def llama_config(**over: Any) -> LlamaConfig:
    """A tiny Llama with GQA (4 query heads, 2 kv heads). initializer_range 0.2 makes the
    attention far from uniform, so that the scale matters."""
    kw: Dict[str, Any] = dict(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        vocab_size=VOCAB, max_position_embeddings=64, initializer_range=0.2, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    )
    kw.update(over)
    return LlamaConfig(**kw)


def llama(attn: str = "sdpa", **over: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(llama_config(**over), attn_implementation=attn, dtype=torch.float32).eval()


def batch(padded: bool, length: int = L) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token ids (avoiding the special ids 0-2) and a 2-D attention mask, left-padded if asked."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (B, length), generator=g)
    mask = torch.ones(B, length, dtype=torch.long)
    if padded:
        mask[0, :4] = 0
        ids[0, :4] = 0
    return ids, mask


def logits_and_grads(model: torch.nn.Module, attn: str, **inputs: Any) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Output (logits or last hidden state) under ``attn`` and the parameter gradients of a fixed
    random projection of it."""
    model.set_attn_implementation(attn)
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    y = out.logits if hasattr(out, "logits") else out.last_hidden_state
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(2))
    (y * w).sum().backward()
    return y.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(model: torch.nn.Module, attn: str, **inputs: Any) -> None:
    ref, ref_grads = logits_and_grads(model, "sdpa", **inputs)
    out, grads = logits_and_grads(model, attn, **inputs)
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=RTOL * ref.abs().max().item())
    assert grads.keys() == ref_grads.keys() and len(grads) > 0
    # Relative norm error per parameter. A gradient that is 0 in exact arithmetic (a key bias: the
    # softmax is shift-invariant) is rounding noise in both: its error is measured against 1% of
    # the norm of the whole gradient instead.
    total = torch.cat([g.flatten() for g in ref_grads.values()]).norm().item()
    for name, g in ref_grads.items():
        err = (grads[name] - g).norm().item()
        assert err <= RTOL * max(g.norm().item(), 1e-2 * total), f"{name}: |error| {err:.3g}, |grad| {g.norm():.3g}"


def attention_layers(model: torch.nn.Module) -> List[str]:
    """Module paths of the attention modules (those transformers calls the backend from)."""
    return [n for n, m in model.named_modules() if hasattr(m, "scaling") and hasattr(m, "layer_idx")]


# --- 1. decoder with GQA ------------------------------------------------------------------------
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
def test_decoder_matches_sdpa(padded: bool) -> None:
    model = llama(PLAIN)
    assert model.config._attn_implementation == PLAIN  # from_config(attn_implementation=name) selects it
    ids, mask = batch(padded)
    assert_same(model, PLAIN, input_ids=ids, attention_mask=mask)


# --- 2. encoder ---------------------------------------------------------------------------------
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "right_padded"])
def test_bert_encoder_matches_sdpa(padded: bool) -> None:
    cfg = BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, initializer_range=0.2,
    )
    torch.manual_seed(0)
    model = AutoModel.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).eval()
    ids, mask = batch(False)
    if padded:
        mask[1, -5:] = 0
    assert_same(model, PLAIN, input_ids=ids, attention_mask=mask)


# --- 3. KV-cache generation ---------------------------------------------------------------------
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate(cache: str, padded: bool) -> None:
    """Greedy generation gives the tokens of "sdpa"; under "logn", the logits of every cached
    decoding step (Lq = 1) equal those of a forward on the whole sequence without cache."""
    model = llama()
    prompt = 8
    ids, mask = batch(padded, length=prompt)
    kw: Dict[str, Any] = dict(
        attention_mask=mask, do_sample=False, max_new_tokens=8, pad_token_id=0, cache_implementation=cache
    )
    ref = model.generate(ids, **kw)
    model.set_attn_implementation(PLAIN)
    assert torch.equal(model.generate(ids, **kw), ref)

    model.set_attn_implementation(LOGN)
    gen = model.generate(ids, **kw, output_logits=True, return_dict_in_generate=True)
    seq = gen.sequences
    full_mask = torch.cat([mask, torch.ones(B, seq.shape[1] - prompt, dtype=mask.dtype)], dim=1)
    positions = (full_mask.cumsum(-1) - 1).clamp_min(0)  # as generate() derives them from the mask
    with torch.no_grad():
        full = model(seq, attention_mask=full_mask, position_ids=positions, use_cache=False).logits
    torch.testing.assert_close(torch.stack(gen.logits, dim=1), full[:, prompt - 1 : -1], rtol=RTOL, atol=1e-5)


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
def test_logn_cached_decoding_matches_full_recompute(padded: bool) -> None:
    """Prefill, a 3-token chunk (Lq=3 with a cache) and Lq=1 steps give the logits of one forward
    on the whole sequence: n_i of a cached row is the number of cached keys + the causal new ones."""
    model = llama(LOGN)
    ids, mask = batch(padded, length=L)
    full = model(ids, attention_mask=mask).logits
    split = [0, 6, 9, 10, 11, 12]  # prefill 6, chunk 3, then 3 single tokens
    cache, steps = None, []
    with torch.no_grad():
        for a, b in zip(split, split[1:]):
            out = model(ids[:, a:b], attention_mask=mask[:, :b], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits)
    cached = torch.cat(steps, dim=1)
    keep = mask.bool()  # logits of padding positions are not meaningful
    torch.testing.assert_close(cached[keep], full.detach()[keep], rtol=RTOL, atol=1e-5)


# --- 4. the "logn" policy -----------------------------------------------------------------------
def _reference_layer(
    attn: torch.nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask2d: torch.Tensor
) -> torch.Tensor:
    """One Llama attention layer with logn scaling, in float64 with plain torch: softmax of
    log_b(n_i)/sqrt(D) q.k over the causal, unpadded keys; rows with no key give 0."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    Bn, Ln, _ = hidden.shape
    D, H, Hkv = attn.head_dim, attn.config.num_attention_heads, attn.config.num_key_value_heads
    q = attn.q_proj(hidden).view(Bn, Ln, H, D).transpose(1, 2)
    k = attn.k_proj(hidden).view(Bn, Ln, Hkv, D).transpose(1, 2)
    v = attn.v_proj(hidden).view(Bn, Ln, Hkv, D).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    q, k, v = q.double(), k.repeat_interleave(H // Hkv, 1).double(), v.repeat_interleave(H // Hkv, 1).double()
    allowed = torch.ones(Ln, Ln, dtype=torch.bool).tril() & mask2d.bool()[:, None, None, :]  # (B, 1, L, L)
    n = allowed.sum(-1, keepdim=True).double()  # (B, 1, L, 1)
    lam = torch.log(n.clamp_min(1)) / math.log(TRAIN_LENGTH) / math.sqrt(D)
    logits = (lam * (q @ k.transpose(-1, -2))).masked_fill(~allowed, float("-inf"))
    p = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    out = (p @ v).transpose(1, 2).reshape(Bn, Ln, H * D)
    return attn.o_proj(out.float())


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
def test_logn_matches_reference_and_changes_output(padded: bool) -> None:
    model = llama(LOGN)
    layer = model.model.layers[0].self_attn
    seen: Dict[str, Any] = {}

    def hook(module: torch.nn.Module, args: Tuple, kwargs: Dict[str, Any], output: Any) -> None:
        seen["hidden"], seen["pe"], seen["out"] = kwargs["hidden_states"], kwargs["position_embeddings"], output[0]

    handle = layer.register_forward_hook(hook, with_kwargs=True)
    ids, mask = batch(padded)
    try:
        with torch.no_grad():
            logn_logits = model(ids, attention_mask=mask).logits
            ref = _reference_layer(layer, seen["hidden"], *seen["pe"], mask)
            torch.testing.assert_close(seen["out"], ref, rtol=1e-4, atol=1e-5)
            model.set_attn_implementation(PLAIN)
            plain_logits = model(ids, attention_mask=mask).logits
    finally:
        handle.remove()
    keep = mask.bool()
    assert (logn_logits[keep] - plain_logits[keep]).abs().max() > 1e-2


def test_reregistering_replaces_the_policy() -> None:
    name = "torch_ext_test_swap"
    model = llama(hf.register(name))
    ids, mask = batch(True)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
        hf.register(name, scale="logn", train_length=TRAIN_LENGTH)
        swapped = model(ids, attention_mask=mask).logits
        model.set_attn_implementation(LOGN)
        logn = model(ids, attention_mask=mask).logits
    assert not torch.allclose(swapped, ref)
    torch.testing.assert_close(swapped, logn, rtol=0, atol=0)


class _Attn(torch.nn.Module):
    """Stands in for a model's attention module: the attributes the backends read."""

    def __init__(self, is_causal: bool, groups: int) -> None:
        super().__init__()
        self.is_causal, self.num_key_value_groups, self.layer_idx = is_causal, groups, 0


@pytest.mark.parametrize(
    "case",
    ["causal", "bidirectional", "decode", "decode_masked", "static_prefill", "bool_mask", "float_mask", "mha"],
)
def test_function_matches_sdpa_attention_forward(case: str) -> None:
    """The attention function against transformers' own sdpa_attention_forward on the call shapes
    models make (GQA unless "mha"), with a non-default ``scaling``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    Lq, Lk, Hkv = {"decode": (1, 7), "decode_masked": (1, 7), "static_prefill": (5, 9)}.get(case, (6, 6)) + (
        4 if case == "mha" else 2,
    )
    module = _Attn(is_causal=case != "bidirectional", groups=4 // Hkv)
    q, k, v = torch.randn(2, 4, Lq, 8), torch.randn(2, Hkv, Lk, 8), torch.randn(2, Hkv, Lk, 8)
    mask = None
    if case in ("decode_masked", "bool_mask", "float_mask"):
        mask = (torch.ones(Lq, Lk, dtype=torch.bool).tril(Lk - Lq) & (torch.arange(Lk) >= 2)).expand(2, 1, Lq, Lk)
        if case == "float_mask":
            mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    ref, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
    out, weights = transformers.AttentionInterface()[PLAIN](module, q, k, v, mask, scaling=0.3)
    assert weights is None and out.shape == ref.shape == (2, Lq, 4, 8) and out.is_contiguous()
    if case == "float_mask":  # rows with no key: "sdpa" averages all values (finfo.min everywhere), we give 0
        out, ref = out[:, 2:], ref[:, 2:]
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)


def test_projection_split_heads_merge_without_a_copy() -> None:
    """Queries, keys and values split from projections, as transformers' layers pass them (a
    transposed (B, L, H, D) view, through the rotary embedding): the op's output follows that layout,
    so the backend's (B, L, H, Dv) result is the op's output itself, not a copy; the values are
    those of transformers' own sdpa_attention_forward."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    module = _Attn(is_causal=True, groups=2)
    B, L, D = 2, 6, 8
    q, k, v = (torch.randn(B, L, h * D).view(B, L, h, D).transpose(1, 2) for h in (4, 2, 2))
    cos, sin = torch.randn(B, L, D), torch.randn(B, L, D)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    out, _ = transformers.AttentionInterface()[PLAIN](module, q, k, v, None, scaling=0.3)
    assert out.shape == (B, L, 4, D) and out.is_contiguous()
    assert out._base is not None, "the backend copied the output to merge the heads"
    ref, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.3)
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)


def test_zero_softcap_is_no_softcap() -> None:
    """softcap=0.0 means no capping in transformers' flash-attention path, and "sdpa" ignores the
    argument: the backend attends uncapped (the op itself refuses a cap of 0)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = _Attn(is_causal=True, groups=2)
    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    ref, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.3)
    out, _ = transformers.AttentionInterface()[PLAIN](module, q, k, v, None, scaling=0.3, softcap=0.0)
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)


def test_float_mask_counts_only_attendable_keys() -> None:
    """An additive mask filled with finfo.min (as models building their own masks use) gives the
    output of the equivalent bool mask, n_i included; batch 1 queries broadcast as in SDPA."""
    fn = transformers.AttentionInterface()[LOGN]
    module = torch.nn.Module()
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    allowed = torch.ones(5, 5, dtype=torch.bool).tril().expand(2, 1, 5, 5).clone()
    allowed[0, ..., :2] = False  # left padding of 2: rows 0-1 of batch 0 have no key
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    out_bool, none = fn(module, q, k, v, allowed, scaling=0.3)
    out_float, _ = fn(module, q, k, v, additive, scaling=0.3)
    assert none is None and out_bool.shape == (2, 5, 4, 8) and out_bool.is_contiguous()
    torch.testing.assert_close(out_float, out_bool, rtol=RTOL, atol=ATOL)
    expected = torch_ext.attention(q, k, v, allowed, scale="logn", scale_factor=0.3, train_length=TRAIN_LENGTH,
                                   enable_gqa=True)
    torch.testing.assert_close(out_bool, expected.transpose(1, 2), rtol=0, atol=0)
    out_b1, _ = fn(module, q[:1], k, v, None, scaling=0.3, is_causal=False)
    expected = torch_ext.attention(q[:1].expand(2, -1, -1, -1), k, v, scale="logn", scale_factor=0.3,
                                   train_length=TRAIN_LENGTH, enable_gqa=True)
    torch.testing.assert_close(out_b1, expected.transpose(1, 2), rtol=0, atol=0)


# --- 5. the monitor -----------------------------------------------------------------------------
def test_monitor_names_layers_by_module_path() -> None:
    model = llama(LOGN)
    layers = attention_layers(model)
    assert layers == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    ids, mask = batch(True)
    monitor = torch_ext.AttentionEntropyMonitor(model)
    with monitor, torch.no_grad():
        model(ids, attention_mask=mask)
    records = monitor.latest
    assert sorted({r["layer"] for r in records}) == layers
    assert len(records) == len(layers) * model.config.num_attention_heads
    # rows with n_i >= 1: the unpadded query positions (left-padded rows see no key)
    assert all(r["rows"] == int(mask.sum()) for r in records)
    assert all(0.0 <= r["normalized_entropy_mean"] <= 1.0 for r in records)


# --- 6. errors ----------------------------------------------------------------------------------
def test_dropout_runs_in_training_only() -> None:
    """A model with attention dropout: in training the op drops weights (outputs differ from eval
    and between steps), in eval mode it matches "sdpa"."""
    model = llama(PLAIN, attention_dropout=0.3).train()
    ids, mask = batch(False)
    a, b = model(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits
    model.eval()
    c = model(ids, attention_mask=mask).logits
    assert not torch.allclose(a, b) and not torch.allclose(a, c)
    assert_same(model, PLAIN, input_ids=ids, attention_mask=mask)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {
                "position_bias": torch.zeros(1, 4, 5, 5),
                "cu_seq_lens_q": torch.tensor([0, 2, 5], dtype=torch.int32),
                "cu_seq_lens_k": torch.tensor([0, 2, 5], dtype=torch.int32),
            },
            "position_bias with a packed batch",
        ),
        ({"cache": "paged"}, "PagedAttentionCache"),
    ],
    ids=["position_bias_packed", "paged_cache"],
)
def test_unsupported_arguments_raise(kwargs: Dict[str, Any], match: str) -> None:
    if kwargs.get("cache") == "paged":
        from transformers.generation.continuous_batching.cache import PagedAttentionCache

        kwargs = {"cache": object.__new__(PagedAttentionCache)}
    fn = transformers.AttentionInterface()[PLAIN]
    q = torch.randn(1, 4, 5, 8)
    with pytest.raises(NotImplementedError, match=match):
        fn(torch.nn.Module(), q, q, q, None, **kwargs)
    fn(torch.nn.Module(), q, q, q, None, softcap=None, position_bias=None, s_aux=None, cache=None)  # None is fine


def test_output_attentions_warns() -> None:
    fn = transformers.AttentionInterface()[PLAIN]
    q = torch.randn(1, 4, 5, 8)
    with pytest.warns(UserWarning, match="output_attentions"):
        _, weights = fn(torch.nn.Module(), q, q, q, None, output_attentions=True)
    assert weights is None


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"scale": "bad"}, ValueError, "scale"),
        ({"scale": "logn", "train_length": 1}, ValueError, "train_length"),
        ({"temperature": 0.0}, ValueError, "temperature"),
        ({"name": "sdpa"}, ValueError, "name"),
        ({"name": "kernels-community/flash-attn"}, ValueError, "name"),
        ({"name": ""}, TypeError, "name"),
    ],
)
def test_bad_registration_raises(kwargs: Dict[str, Any], error: type, match: str) -> None:
    name = kwargs.pop("name", "torch_ext_test_bad")
    with pytest.raises(error, match=match):
        hf.register(name, **kwargs)
    assert "torch_ext_test_bad" not in transformers.AttentionInterface()


# --- replace_sdpa around transformers' own "sdpa" backend ---------------------------------------
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
def test_replace_sdpa_routes_transformers_sdpa_backend(padded: bool) -> None:
    """transformers' "sdpa" backend inside torch_ext.replace_sdpa runs on the op: with scale None
    it gives sdpa's logits, with "logn" those of our registered "logn" backend (two paths, one
    result), including cached decoding (Lq = 1, where "sdpa" packs the GQA group into the query)."""
    model = llama("sdpa")
    ids, mask = batch(padded)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
        with torch_ext.replace_sdpa():
            routed = model(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(routed, ref, rtol=RTOL, atol=RTOL * ref.abs().max().item())
        with torch_ext.replace_sdpa(scale="logn", train_length=TRAIN_LENGTH):
            routed_logn = model(input_ids=ids, attention_mask=mask).logits
            routed_gen = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4,
                                        output_logits=True, return_dict_in_generate=True)
        model.set_attn_implementation(LOGN)
        ours = model(input_ids=ids, attention_mask=mask).logits
        ours_gen = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4,
                                  output_logits=True, return_dict_in_generate=True)
    valid = mask.bool()  # left-padded query rows see no key: "sdpa" and the op differ there by design
    torch.testing.assert_close(routed_logn[valid], ours[valid], rtol=RTOL, atol=RTOL * ours.abs().max().item())
    assert not torch.allclose(routed_logn[valid], ref[valid], atol=1e-2)
    assert torch.equal(routed_gen.sequences, ours_gen.sequences)
    for a, b in zip(routed_gen.logits, ours_gen.logits):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=RTOL * b.abs().max().item())


def test_monitor_sees_query_heads_through_replace_sdpa_decoding() -> None:
    """transformers' "sdpa" packs a GQA group's query heads into rows when it decodes one token
    with a mask ((B, H, 1, E) as (B, Hkv, G, E)); under replace_sdpa a recording monitor still sees
    the model's 4 query heads (it saw 2 heads of 2 rows, and raised "a layer was called with 2 and
    4 heads in one step" in a step that also ran the prefill), with the statistics the hf backend
    records for the same decoding step."""
    model = llama("sdpa")
    ids, mask = batch(True)

    def records(run: Any) -> List[Dict[str, Any]]:
        monitor = torch_ext.AttentionEntropyMonitor(model, every=1, keep_history=True)
        with torch.no_grad():
            cache = model(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values
            step_ids, step_mask = ids[:, -1:], torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype)], 1)
            with monitor.step(0):
                run(lambda: model(input_ids=step_ids, attention_mask=step_mask, past_key_values=cache))
            with monitor.step(1):  # prefill and decoding in one step
                run(lambda: model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=2))
        return monitor.history

    def routed(call: Any) -> None:
        with torch_ext.replace_sdpa():
            call()

    got = records(routed)
    model.set_attn_implementation(PLAIN)
    want = records(lambda call: call())
    decode_got = [r for r in got if r["step"] == 0]
    decode_want = [r for r in want if r["step"] == 0]
    assert sorted({r["head"] for r in decode_got}) == [0, 1, 2, 3]
    assert [(r["layer"], r["head"]) for r in decode_got] == [(r["layer"], r["head"]) for r in decode_want]
    for a, b in zip(decode_got, decode_want):
        assert a["entropy_mean"] == pytest.approx(b["entropy_mean"], rel=1e-5)
    assert {r["head"] for r in got if r["step"] == 1} == {0, 1, 2, 3}


@pytest.mark.parametrize(
    "kv_heads,groups,mask,bias,query_batch",
    [(2, 2, "per_head", False, 2), (2, 2, "shared", False, 2), (1, 4, "per_head", False, 2),
     (1, 4, "shared", True, 2), (2, 2, "shared", True, 2), (2, 2, "per_head", False, 1), (2, 2, None, False, 2)],
)
def test_packed_decoding_step_unpacks_every_mask_and_batch(
    kv_heads: int, groups: int, mask: Any, bias: bool, query_batch: int
) -> None:
    """transformers' sdpa_attention_forward on a packed decoding step, called directly under
    replace_sdpa and a recording monitor: per-head masks and position biases (packed with the heads,
    also with one key/value head, where the packed mask's heads dim is 1), shared masks, and a query
    of batch 1 against keys of batch 2 (SDPA broadcasts it) give sdpa's output, and the monitor
    records the H query heads. (The first unpacking raised on the per-head mask with one key/value
    head and on the broadcast batch.)"""
    import types

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(3)
    heads, b, length, e = kv_heads * groups, 2, 5, 8
    module = types.SimpleNamespace(num_key_value_groups=groups, is_causal=True, layer_idx=0)
    q = torch.randn(query_batch, heads, 1, e, generator=g)
    k, v = (torch.randn(b, kv_heads, length, e, generator=g) for _ in range(2))
    m = {"per_head": torch.randn(b, heads, 1, length, generator=g), "shared": torch.zeros(b, 1, 1, length),
         None: None}[mask]
    position_bias = torch.randn(1, heads, 1, length, generator=g) if bias else None
    want, _ = sdpa_attention_forward(module, q, k, v, m, position_bias=position_bias)
    monitor = torch_ext.AttentionEntropyMonitor()
    with torch_ext.replace_sdpa(), monitor:
        got, _ = sdpa_attention_forward(module, q, k, v, m, position_bias=position_bias)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert sorted({r["head"] for r in monitor.latest}) == list(range(heads))
