"""Regression tests of the transformers backend (torch_ext.hf) and of the monitor on it, one per
bug found in review: each fails on the code before its fix.

1. A causal sliding layer's window intersected with a mask that opens later keys (Gemma 3 image
   blocks).
2. A bidirectional sliding window W mapped to (W, W) instead of transformers' (W - 1, W - 1).
3. A one-row batch whose position_ids restart read as packed documents although the mask
   attends across them (a 2-D mask with a hole in generate(), an all-ones mask, a KV cache).
4. torch.compile(fullgraph=True) of a batch of one (data-dependent ops on position_ids; dynamo's
   warning of the lru_cache that chose the masks).
5. The monitor with gradient checkpointing (CheckpointError; rows counted twice).
6. The monitor's per-position curves under a KV cache (rows pooled at their row index).
7. The monitor counting right-padding rows.
8. The packed-mask check (exact, in slices, once per forward).
9. DeepSeek-V3.2's indexer selection (``indices``) ignored: every row attended to all its keys.
10. Gemma 4's sliced query rows (KV-shared layers, ``logits_to_keep``) aligned top-left.
11. A bidirectional window under torch.compile taken as W - 1 where the model's mask has W.
12. ``block_indices`` (block-sparse indexer) silently ignored.
13. Generation under inference mode.
14. The monitor's rows in cross-attention.
15. Models that refuse "sdpa" given sdpa's masks (None where causal: a decoder run without
    causality; bool masks added to scores), and per-query sinks refused by the op's message.
16. A model with attention classes of its own switched to the backend: its layers kept their
    attention with no word of it.

Tiny random-weight models built from configs (no downloads), CPU, float64 where the comparison
is tight, float32 elsewhere.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

import torch_ext  # noqa: E402
import torch_ext.hf as hf  # noqa: E402
from transformers import (  # noqa: E402
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    BartConfig,
    BertConfig,
    DynamicCache,
    Gemma3TextConfig,
    LlamaConfig,
    ModernBertConfig,
    Qwen3Config,
    T5Config,
)
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402

PLAIN = "torch_ext_regressions_plain"
VOCAB = 100
RTOL = 2e-5
TIGHT = 1e-9  # float64 comparisons

COMMON: Dict[str, Any] = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, vocab_size=VOCAB,
    max_position_embeddings=64, initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
LENGTHS = [5, 7, 3, 6]  # packed documents (longer than the windows below, so that the window matters)


@pytest.fixture(scope="module", autouse=True)
def _backends() -> None:
    hf.register(PLAIN)


def build(config: Any, attn: str = "sdpa", dtype: torch.dtype = torch.float64, cls: Any = AutoModelForCausalLM) -> Any:
    """A model from ``config`` with fixed weights (seed 0), in eval mode."""
    torch.manual_seed(0)
    return cls.from_config(config, attn_implementation=attn, dtype=dtype).eval()


def llama(attn: str = "sdpa", dtype: torch.dtype = torch.float64) -> Any:
    return build(LlamaConfig(intermediate_size=128, **COMMON), attn, dtype)


def token_ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    """Random token ids avoiding the special ids 0-2."""
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def packed_documents() -> Tuple[List[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """The documents alone, their packed row, its restarting position_ids and cu_seq_lens."""
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(3, VOCAB, (1, n), generator=g) for n in LENGTHS]
    pos = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)
    cu = torch.tensor([0] + list(torch.tensor(LENGTHS).cumsum(0)), dtype=torch.int32)
    return docs, torch.cat(docs, dim=1), pos, cu


def output_of(out: Any) -> torch.Tensor:
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def grads_of(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_close_grads(grads: Dict[str, torch.Tensor], ref_grads: Dict[str, torch.Tensor], rtol: float) -> None:
    """Relative norm error per parameter, against 1% of the whole gradient's norm for gradients
    that are 0 in exact arithmetic (rounding noise in both)."""
    assert grads.keys() == ref_grads.keys() and len(grads) > 0
    total = torch.cat([g.flatten() for g in ref_grads.values()]).norm().item()
    for name, g in ref_grads.items():
        err = (grads[name] - g).norm().item()
        assert err <= rtol * max(g.norm().item(), 1e-2 * total), f"{name}: |error| {err:.3g}, |grad| {g.norm():.3g}"


# --- 1. a causal window and a mask that opens later keys ---------------------------------------
def test_causal_window_keeps_later_keys_the_mask_allows() -> None:
    """Gemma 3's sliding layers are causal, but their mask opens the keys of an image block to each
    of its tokens, later ones included. The layer's sliding_window must not clip those (the op's
    window had a right bound of 0 on top of the mask): the function equals transformers'
    sdpa_attention_forward, which follows the mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    fn = transformers.AttentionInterface()[PLAIN]
    layer = torch.nn.Module()
    layer.is_causal = True
    length, window = 8, 4
    q, k, v = (torch.randn(1, 2, length, 16, dtype=torch.float64) for _ in range(3))
    i = torch.arange(length)
    mask = (i[None] <= i[:, None]) & (i[None] > i[:, None] - window)
    mask[2:5, 2:5] = True  # image tokens 2..4 see each other, inside the window
    mask = mask[None, None]
    ref, _ = sdpa_attention_forward(layer, q, k, v, mask, scaling=0.25, sliding_window=window)
    out, _ = fn(layer, q, k, v, mask, scaling=0.25, sliding_window=window)
    torch.testing.assert_close(out, ref, rtol=TIGHT, atol=TIGHT)


@pytest.mark.parametrize("block", ["later_keys", "earlier_keys", "none"])
def test_window_bounds_follow_the_mask(block: str) -> None:
    """Whichever side of the window the mask opens (an image block longer than the window opens
    keys left of it), the function follows the mask as sdpa_attention_forward does, and a mask
    inside the band keeps the window (the op then skips the blocks outside it)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    fn = transformers.AttentionInterface()[PLAIN]
    layer = torch.nn.Module()
    layer.is_causal = True
    length, window = 10, 3
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, length, 16, dtype=torch.float64, generator=g) for _ in range(3))
    i = torch.arange(length)
    mask = (i[None] <= i[:, None]) & (i[None] > i[:, None] - window)
    if block == "later_keys":
        mask[3:5, 3:5] = True
    elif block == "earlier_keys":
        mask[2:8, 2:8] = True  # 6 image tokens, longer than the window
    mask = mask[None, None]
    ref, _ = sdpa_attention_forward(layer, q, k, v, mask, scaling=0.25, sliding_window=window)
    out, _ = fn(layer, q, k, v, mask, scaling=0.25, sliding_window=window)
    torch.testing.assert_close(out, ref, rtol=TIGHT, atol=TIGHT)
    kept = torch_ext.hf._window_inside_mask((window - 1, 0), mask, True)
    assert kept == {"later_keys": (2, -1), "earlier_keys": (-1, -1), "none": (2, 0)}[block]


# --- 2. a bidirectional sliding window ---------------------------------------------------------
def modernbert() -> Any:
    """ModernBERT with local_attention 4: its local layers get sliding_window 3 (local // 2 + 1)
    and transformers' mask lets them see keys at distance <= 2."""
    cfg = ModernBertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=64, local_attention=4, global_attn_every_n_layers=2, initializer_range=0.2,
        pad_token_id=0, embedding_dropout=0.0, mlp_dropout=0.0, attention_dropout=0.0,
    )
    return build(cfg, cls=AutoModel)


def gemma3_bidirectional() -> Any:
    """Gemma 3 with use_bidirectional_attention (embedding models), sliding window 3 on layer 0."""
    cfg = Gemma3TextConfig(
        intermediate_size=128, head_dim=16, sliding_window=3, query_pre_attn_scalar=20,
        use_bidirectional_attention=True, layer_types=["sliding_attention", "full_attention"], **COMMON,
    )
    return build(cfg)


@pytest.mark.parametrize("family", ["modernbert", "gemma3_bidirectional"])
def test_bidirectional_window_packed_matches_documents_alone(family: str) -> None:
    """A packed row (transformers' cu_seq_lens kwargs, the varlen path, where the window alone
    bounds the keys) gives each document the output it gets alone (through transformers' mask):
    a bidirectional sliding_window W is W - 1 keys on each side, not W."""
    model = modernbert() if family == "modernbert" else gemma3_bidirectional()
    model.set_attn_implementation(PLAIN)
    docs, ids, pos, cu = packed_documents()
    packed_kwargs = dict(
        position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(LENGTHS), max_length_k=max(LENGTHS),
    )
    with torch.no_grad():
        packed = output_of(model(input_ids=ids, use_cache=False, **packed_kwargs))
        alone = torch.cat([output_of(model(input_ids=d, use_cache=False)) for d in docs], dim=1)
    torch.testing.assert_close(packed, alone, rtol=TIGHT, atol=TIGHT * alone.abs().max().item())


# --- 3. restarting position_ids without a packed mask ------------------------------------------
def test_generate_with_a_masked_prompt_token_matches_sdpa() -> None:
    """generate() on one prompt whose 2-D attention_mask masks a token inside it: generate derives
    position_ids = cumsum(mask) - 1, which repeat a position there. That is not a packed row (the
    mask attends across the "documents"): tokens and first-step scores equal "sdpa"'s."""
    cfg = Qwen3Config(intermediate_size=128, head_dim=16, **COMMON)
    model = build(cfg)
    ids = token_ids(1, 10)
    mask = torch.ones_like(ids)
    mask[0, 3] = 0
    kw: Dict[str, Any] = dict(
        attention_mask=mask, do_sample=False, max_new_tokens=6, pad_token_id=0, eos_token_id=None,
        output_scores=True, return_dict_in_generate=True,
    )
    ref = model.generate(ids, **kw)
    model.set_attn_implementation(PLAIN)
    out = model.generate(ids, **kw)
    assert out.sequences.tolist() == ref.sequences.tolist()
    torch.testing.assert_close(out.scores[0], ref.scores[0], rtol=1e-7, atol=1e-7)


@pytest.mark.parametrize("route", ["all_ones_mask", "default_cache"])
def test_restarting_positions_without_packed_mask_match_sdpa(route: str) -> None:
    """A row with restarting position_ids but a user's all-ones 2-D mask, or a KV cache (the model's
    default use_cache=True): transformers builds no block-diagonal mask then and "sdpa" attends
    causally across the "documents"; the backend must too, not run them as packed documents."""
    model = llama()
    _, ids, pos, _ = packed_documents()
    kw: Dict[str, Any] = dict(position_ids=pos)
    if route == "all_ones_mask":
        kw.update(attention_mask=torch.ones_like(ids), use_cache=False)
    results = {}
    for attn in ("sdpa", PLAIN):
        model.set_attn_implementation(attn)
        with torch.no_grad():
            results[attn] = model(input_ids=ids, **kw).logits
    ref = results["sdpa"]
    torch.testing.assert_close(results[PLAIN], ref, rtol=TIGHT, atol=TIGHT * ref.abs().max().item())


# --- 4. torch.compile of a batch of one --------------------------------------------------------
def test_compile_fullgraph_batch_of_one() -> None:
    """torch.compile(fullgraph=True) of a one-row forward and backward: the packed-row check reads
    position_ids values (data-dependent) and must not run while dynamo traces. Compiled logits and
    gradients equal the eager ones."""
    model = llama(PLAIN, torch.float32)
    ids = token_ids(1, 12)
    w = torch.randn(1, 12, VOCAB, generator=torch.Generator().manual_seed(2))

    model.zero_grad(set_to_none=True)
    ref = model(input_ids=ids, use_cache=False).logits
    (ref * w).sum().backward()
    ref_grads = grads_of(model)

    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = compiled(input_ids=ids, use_cache=False).logits
        (out * w).sum().backward()
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(out.detach(), ref.detach(), rtol=RTOL, atol=RTOL * ref.abs().max().item())
    assert_close_grads(grads_of(model), ref_grads, RTOL)
    # The backend's mask choice is a constant to dynamo, not a traced lru_cache (a warning on
    # every compile of a model that uses the backend).
    ours = [str(c.message) for c in caught if "torch_ext" in c.filename or "torch_ext" in str(c.message)]
    assert not ours, ours


# --- 5. the monitor with gradient checkpointing ------------------------------------------------
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("backward", ["outside_step", "inside_step"])
def test_monitor_with_gradient_checkpointing(backward: str) -> None:
    """Activation checkpointing (transformers' default, non-reentrant) re-runs each layer's forward
    in backward. With the monitor, the re-run must call the op as the recorded forward did (else
    torch.utils.checkpoint raises CheckpointError: backward after the step, as the README shows),
    and must not record its rows a second time (backward inside the step). Gradients equal those
    of the model without checkpointing; each head counts the real (unpadded) tokens once."""
    ids = token_ids(3, 12)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    ids[0, :3] = 0

    reference = llama(PLAIN).train()
    reference(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()

    model = llama(PLAIN).train()
    model.gradient_checkpointing_enable()
    monitor = torch_ext.AttentionEntropyMonitor(model, every=1)
    with monitor.step(0):
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        if backward == "inside_step":
            loss.backward()
    if backward == "outside_step":
        loss.backward()

    assert_close_grads(grads_of(model), grads_of(reference), 1e-10)
    assert len(monitor.latest) == 2 * 4  # layers x heads
    assert [r["rows"] for r in monitor.latest] == [int(mask.sum())] * len(monitor.latest)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_checkpointing_after_a_monitored_pass() -> None:
    """A monitored pass leaves nothing behind: a later checkpointed training step without the
    monitor re-runs its forward without statistics, as that forward ran (a flag kept from the
    monitored pass made the re-run compute them: CheckpointError, metadata differs)."""
    ids = token_ids(2, 12)
    reference = llama(PLAIN).train()
    reference(input_ids=ids, labels=ids).loss.backward()
    model = llama(PLAIN)
    model.eval()
    with torch_ext.AttentionEntropyMonitor(model), torch.no_grad():
        model(input_ids=ids)
    model.train()
    model.gradient_checkpointing_enable()
    model(input_ids=ids, labels=ids).loss.backward()
    assert_close_grads(grads_of(model), grads_of(reference), 1e-10)


# --- 6. the monitor's per-position curves under a KV cache -------------------------------------
@pytest.mark.parametrize("how", ["generate", "prefill_and_decode"])
def test_monitor_positions_with_kv_cache(how: str) -> None:
    """With positions=True, rows computed against a KV cache (generate's decoding steps, a chunked
    prefill) pool at their token position (from position_ids), not at their row index: the curve
    and row counts equal those of one forward over the same tokens."""
    model = llama(PLAIN)
    ids = token_ids(1, 8)
    with torch.no_grad():
        seq = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
    tokens = seq[:, :-1]  # what generate() fed the model: 8 prompt tokens, then 3 generated ones
    with torch_ext.AttentionEntropyMonitor(model, positions=True) as full, torch.no_grad():
        model(tokens)
    with torch_ext.AttentionEntropyMonitor(model, positions=True) as cached, torch.no_grad():
        if how == "generate":
            model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
        else:
            cache = DynamicCache(config=model.config)
            for a, b in [(0, 4), (4, 8), (8, 9), (9, 11)]:  # two prefill chunks, then single tokens
                model(tokens[:, a:b], past_key_values=cache, use_cache=True)
    assert sorted(cached.latest_positions) == sorted(full.latest_positions) and len(full.latest_positions) == 2
    for layer, curve in full.latest_positions.items():
        assert curve.shape == (4, tokens.shape[1])
        torch.testing.assert_close(cached.latest_positions[layer], curve, rtol=1e-9, atol=1e-9)
    full_records = {(r["layer"], r["head"]): r for r in full.latest}
    for r in cached.latest:
        f = full_records[(r["layer"], r["head"])]
        assert r["rows"] == f["rows"] == tokens.shape[1]
        assert r["entropy_mean"] == pytest.approx(f["entropy_mean"], rel=1e-9)


# --- 7. the monitor and right padding ----------------------------------------------------------
def test_monitor_excludes_right_padding_rows() -> None:
    """A right-padded encoder batch (BERT): a padding token's row still sees the real keys
    (n_i >= 1), but it is no token of the data; the monitor counts only rows whose own key is
    unmasked. rows and entropy means equal those over the real tokens of the eager attention
    weights."""
    cfg = BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, initializer_range=0.2,
    )
    model = build(cfg, "eager", cls=AutoModel)
    ids = token_ids(2, 12)
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0  # row 0: 6 real tokens, 6 padding
    ids[0, 6:] = 0
    with torch.no_grad():
        weights = model(ids, attention_mask=mask, output_attentions=True).attentions  # per layer (B, H, L, L)
    model.set_attn_implementation(PLAIN)
    with torch_ext.AttentionEntropyMonitor(model) as monitor, torch.no_grad():
        model(ids, attention_mask=mask)
    layers = sorted({r["layer"] for r in monitor.latest})
    assert len(layers) == 2 and len(monitor.latest) == 2 * 4
    real = mask.bool()
    for r in monitor.latest:
        p = weights[layers.index(r["layer"])][:, r["head"]]  # (B, L, L)
        entropy = -(p * p.clamp_min(1e-300).log()).sum(-1)  # (B, L)
        assert r["rows"] == int(real.sum())
        assert r["entropy_mean"] == pytest.approx(entropy[real].mean().item(), rel=1e-9)


# --- 8. the packed-mask check: exact, without an L x L temporary, once per forward -------------
def brute_force_packed_mask(lengths: List[int], causal: bool, window: Tuple[int, int]) -> torch.Tensor:
    """The (L, L) pattern of documents of ``lengths``, written plainly: key j is visible to row i
    iff both lie in one document, j <= i when causal, and i - left <= j <= i + right (-1: no bound)."""
    doc = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])
    total = len(doc)
    allowed = torch.zeros(total, total, dtype=torch.bool)
    left, right = window
    for i in range(total):
        for j in range(total):
            ok = bool(doc[i] == doc[j]) and (not causal or j <= i)
            ok = ok and (left < 0 or j >= i - left) and (right < 0 or j <= i + right)
            allowed[i, j] = ok
    return allowed


@pytest.mark.parametrize("seed", range(6))
def test_packed_mask_check_against_brute_force(seed: int) -> None:
    """_is_packed_mask (row intervals compared in slices) accepts exactly the packed pattern, as bool
    and as transformers' additive finfo.min mask, and refuses it with any one entry flipped."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 7, (int(torch.randint(2, 5, (1,), generator=g)),), generator=g).tolist()
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)))
    total = int(cu[-1])
    for causal in (True, False):
        for window in ((-1, -1), (2, 0), (1, 1), (0, 3)):
            want = brute_force_packed_mask(lengths, causal, window)
            additive = torch.zeros(total, total, dtype=torch.float32).masked_fill(~want, torch.finfo(torch.float32).min)
            for mask in (want, additive):
                assert hf._is_packed_mask(mask[None, None], cu, causal, window), (lengths, causal, window)
            i, j = (int(x) for x in torch.randint(0, total, (2,), generator=g))
            flipped = want.clone()
            flipped[i, j] = ~flipped[i, j]
            assert not hf._is_packed_mask(flipped[None, None], cu, causal, window), (lengths, causal, window, i, j)


def test_packed_row_checked_once_per_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layers of one forward share the mask and position_ids: the packed-row check (which
    reads their values, a device sync) runs once per forward, not once per layer, and a new
    forward (new tensors) checks again."""
    model = llama(PLAIN)
    _, ids, pos, _ = packed_documents()
    calls: List[int] = []
    check = hf._is_packed_mask
    monkeypatch.setattr(hf, "_is_packed_mask", lambda *a: calls.append(1) or check(*a))
    with torch.no_grad():
        model(input_ids=ids, position_ids=pos, use_cache=False)
        assert len(calls) == 1  # two layers
        model(input_ids=ids, position_ids=pos.clone(), use_cache=False)
    assert len(calls) == 2


# --- 9. DeepSeek-V3.2's sparse attention: the indexer's keys -----------------------------------
def test_deepseek_v32_indexer_selection_matches_sdpa() -> None:
    """DeepSeek-V3.2 passes the indexer's top-k keys as ``indices`` to every backend but "eager"
    and "sdpa" (for which it folds them into the mask): with index_topk smaller than the sequence
    the logits equal "sdpa"'s (they differed by up to 5.8 when the selection was ignored)."""
    cfg = transformers.AutoConfig.for_model(
        "deepseek_v32", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=8, head_dim=4, first_k_dense_replace=1, index_topk=4, index_head_dim=8,
        index_n_heads=2, initializer_range=0.25, max_position_embeddings=64, pad_token_id=0,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float64,
                                             experts_implementation="eager").eval()
    ids = token_ids(2, 12)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    results = {}
    for attn in ("sdpa", PLAIN):
        model.set_attn_implementation(attn)
        with torch.no_grad():
            results[attn] = model(input_ids=ids, attention_mask=mask).logits
    ref = results["sdpa"]
    real = mask.bool()
    torch.testing.assert_close(results[PLAIN][real], ref[real], rtol=TIGHT, atol=TIGHT * ref.abs().max().item())


# --- 10. Gemma 4: query rows sliced from a forward without a causal mask ------------------------
def gemma4() -> Any:
    cfg = transformers.Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, global_head_dim=8, vocab_size_per_layer_input=VOCAB,
        hidden_size_per_layer_input=8, sliding_window=5, num_kv_shared_layers=2,
        layer_types=["sliding_attention", "full_attention"] * 2, initializer_range=0.25, max_position_embeddings=64,
        pad_token_id=0, eos_token_id=None, bos_token_id=2,
    )
    return build(cfg)


def test_gemma4_kv_shared_layers_with_logits_to_keep_match_sdpa() -> None:
    """Gemma 4 keeps only the last logits_to_keep query rows in its KV-shared layers, for any
    backend but "sdpa", also where transformers skipped the causal mask: those rows are the last of
    the forward (bottom-right), not the first (they were aligned top-left: logits off by ~2), also
    before an empty static cache (generate's first step: its empty slots were attended)."""
    model = gemma4()
    ids = token_ids(1, 12)
    with torch.no_grad():
        full = model(input_ids=ids).logits  # "sdpa", every row
        model.set_attn_implementation(PLAIN)
        for keep in (1, 3):
            got = model(input_ids=ids, logits_to_keep=keep).logits
            torch.testing.assert_close(got, full[:, -keep:], rtol=TIGHT, atol=TIGHT * full.abs().max().item())
        kw: Dict[str, Any] = dict(max_new_tokens=3, do_sample=False, cache_implementation="static", pad_token_id=0,
                                  output_logits=True, return_dict_in_generate=True)
        out = model.generate(input_ids=ids, **kw)
        model.set_attn_implementation("sdpa")
        ref = model.generate(input_ids=ids, **kw)
    assert out.sequences.tolist() == ref.sequences.tolist()
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9 * b.abs().max().item())


# --- 11. a bidirectional window under torch.compile ---------------------------------------------
def test_bidirectional_window_under_compile_follows_the_mask() -> None:
    """T5Gemma's encoder passes sliding_window W with a mask allowing |i - j| <= W (ModernBERT's
    W means < W): under torch.compile, where the mask's values cannot be read, a bidirectional
    window is left to the mask (its left bound W - 1 dropped each row's key at distance W)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask, sliding_window_bidirectional_mask_function

    fn = transformers.AttentionInterface()[PLAIN]
    window, length = 4, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, length, 8, dtype=torch.float64, generator=g) for _ in range(3))
    mask = sdpa_mask(batch_size=1, q_length=length, kv_length=length, allow_is_causal_skip=False,
                     mask_function=sliding_window_bidirectional_mask_function(window))
    layer = torch.nn.Module()
    layer.is_causal = False

    def ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return fn(layer, q, k, v, mask, scaling=0.3, sliding_window=window)[0]

    ref, _ = sdpa_attention_forward(layer, q, k, v, mask, scaling=0.3, sliding_window=window)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(ours, backend="eager", fullgraph=True)(q, k, v, mask)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(ours(q, k, v, mask), ref, rtol=TIGHT, atol=TIGHT)
    torch.testing.assert_close(compiled, ref, rtol=TIGHT, atol=TIGHT)


# --- 12. block-sparse indexers raise -----------------------------------------------------------
def test_block_indices_raise() -> None:
    """block_indices (MiniMax-M3's block-sparse indexer) is not applied by the backend: it raises,
    naming it, instead of attending densely."""
    fn = transformers.AttentionInterface()[PLAIN]
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(NotImplementedError, match="block_indices"):
        fn(torch.nn.Module(), q, q, q, None, block_indices=torch.zeros(1, 4, 1, dtype=torch.long))


# --- 13. inference mode ------------------------------------------------------------------------
def test_generate_under_inference_mode() -> None:
    """Under torch.inference_mode the backend's value checks (cached by tensor version) meet
    inference tensors, which have no version counter: generation with a sliding-window layer (whose
    window check reads the mask) and a packed one-row forward (whose check reads position_ids) give
    the same as under torch.no_grad, where they raised."""
    model = build(Qwen3Config(intermediate_size=128, sliding_window=4, use_sliding_window=True,
                              max_window_layers=1, **COMMON), PLAIN, torch.float64)
    ids = token_ids(2, 8)
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=3, do_sample=False)
    with torch.inference_mode():
        got = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert torch.equal(got, ref)
    _, packed, pos, _ = packed_documents()
    llama_model = llama(PLAIN, torch.float64)
    with torch.no_grad():
        ref_logits = llama_model(input_ids=packed, position_ids=pos, use_cache=False).logits
    with torch.inference_mode():
        logits = llama_model(input_ids=packed, position_ids=pos, use_cache=False).logits
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)


# --- 14. the monitor's rows in cross-attention ---------------------------------------------------
def test_monitor_cross_attention_rows_with_equal_lengths() -> None:
    """In cross-attention key i is the encoder's token i: with as many decoder as encoder tokens the
    mask is square, and reading its diagonal as each row's own key dropped the decoder rows facing
    encoder padding from the monitor. Every decoder row counts, whatever the decoder's length."""
    config = BartConfig(d_model=32, encoder_attention_heads=2, decoder_attention_heads=2, encoder_layers=1,
                        decoder_layers=1, encoder_ffn_dim=32, decoder_ffn_dim=32, vocab_size=VOCAB,
                        max_position_embeddings=32)
    model = build(config, PLAIN, torch.float64, cls=AutoModelForSeq2SeqLM)
    src = token_ids(2, 8)
    src_mask = torch.ones(2, 8, dtype=torch.long)
    src_mask[0, 5:] = 0  # encoder padding
    for length in (7, 8, 9):
        with torch_ext.AttentionEntropyMonitor(model) as monitor, torch.no_grad():
            model(input_ids=src, attention_mask=src_mask, decoder_input_ids=token_ids(2, length, seed=length))
        rows = {r["rows"] for r in monitor.latest if r["layer"].endswith("encoder_attn")}
        assert rows == {2 * length}, (length, rows)


def test_monitor_cross_attention_excludes_decoder_padding_rows() -> None:
    """Cross-attention's mask is the encoder's: it does not say which decoder tokens are padding,
    so the decoder rows of right-padded targets counted there (10 of 7 real tokens) while the same
    layer's self-attention left them out. Each decoder layer's cross-attention takes the rows of
    its self-attention (BART and T5, whose layers' paths differ in their last two parts); the
    encoder's own rows (as many tokens here) do not leak into it."""
    bart = BartConfig(d_model=32, encoder_attention_heads=2, decoder_attention_heads=2, encoder_layers=1,
                      decoder_layers=2, encoder_ffn_dim=32, decoder_ffn_dim=32, vocab_size=VOCAB,
                      max_position_embeddings=32)
    t5 = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=2, num_heads=2,
                  dropout_rate=0.0, decoder_start_token_id=0)
    for config, cross in ((bart, "encoder_attn"), (t5, "EncDecAttention")):
        model = build(config, PLAIN, torch.float64, cls=AutoModelForSeq2SeqLM)
        src, tgt = token_ids(2, 5), token_ids(2, 5, seed=2)
        src_mask, tgt_mask = torch.ones(2, 5, dtype=torch.long), torch.ones(2, 5, dtype=torch.long)
        src_mask[1, 4:] = 0  # the encoder: 9 real tokens
        tgt_mask[0, 2:] = 0  # the decoder: 7 real tokens
        with torch_ext.AttentionEntropyMonitor(model) as monitor, torch.no_grad():
            model(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask)
        rows = {r["layer"]: r["rows"] for r in monitor.latest}
        crossed = [n for n in rows if n.endswith(cross)]
        assert len(crossed) == 2, rows
        assert all(rows[n] == 7 for n in crossed), rows
        assert {rows[n] for n in rows if n.startswith(("encoder", "model.encoder"))} == {9}, rows


# --- 15. models that refuse "sdpa" --------------------------------------------------------------
def _eager_only_models() -> List[Tuple[str, Any, Any, Dict[str, torch.Tensor], bool]]:
    """Tiny models whose classes set _supports_sdpa = False, as (name, config, class, inputs,
    whether the model is built with "eager" and switched: GIT builds only with "eager"):
    TrOCR, BLIP's text decoder (a sub-config, blip_text_model, that no auto mapping names) and GIT
    (their own attention code, which adds the mask to the scores), PEGASUS-X (whose decoder layers
    keep is_causal = False and take causality from the mask) and Splinter (an encoder whose
    attention modules have no is_causal)."""
    ids = token_ids(2, 10)
    trocr = transformers.TrOCRConfig(
        vocab_size=VOCAB, d_model=32, decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=64,
        max_position_embeddings=64, pad_token_id=0)
    blip_text = transformers.BlipTextConfig(
        vocab_size=VOCAB, hidden_size=32, encoder_hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, pad_token_id=0)
    pegasus = transformers.PegasusXConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        pad_token_id=0, decoder_start_token_id=1)
    splinter = transformers.SplinterConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, pad_token_id=0, question_token_id=VOCAB - 1)
    git = transformers.GitConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                           image_size=32, patch_size=16))
    return [
        ("trocr", trocr, transformers.TrOCRForCausalLM, dict(input_ids=ids), False),
        ("blip_text", blip_text, transformers.BlipTextLMHeadModel, dict(input_ids=ids), False),
        ("git", git, transformers.GitForCausalLM, dict(input_ids=ids), True),
        ("pegasus_x", pegasus, transformers.PegasusXForConditionalGeneration,
         dict(input_ids=ids, decoder_input_ids=token_ids(2, 7, seed=2)), False),
        ("splinter", splinter, transformers.SplinterModel, dict(input_ids=ids), False),
    ]


def test_models_refusing_sdpa_get_eager_masks() -> None:
    """A model that refuses "sdpa" builds its masks with the backend's mask function too; given
    sdpa_mask's (None for an unpadded causal batch, bool otherwise) TrOCR, BLIP's text decoder and
    GIT added bool masks to their scores or ran without causality, PEGASUS-X's decoder ran without
    causality and Splinter's encoder ran causally (errors of 1e-2 relative, no exception). With
    eager's masks every output equals "eager"'s (to 1e-6: some eager attention code takes its
    softmax in float32). Each model is built for its implementation (TrOCR cannot switch later),
    or built with "eager" and switched (GIT cannot be built with another)."""
    for name, config, cls, inputs, switch in _eager_only_models():
        outputs = []
        for attn in ("eager", PLAIN):
            torch.manual_seed(0)
            model = cls._from_config(copy.deepcopy(config), attn_implementation="eager" if switch else attn,
                                     dtype=torch.float64).eval()
            if switch:
                model.set_attn_implementation(attn)
            with torch.no_grad():
                outputs.append(output_of(model(**inputs)))
        torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-6, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")
    # Models that support "sdpa", or flash attention through the interface (Gemma 2 and gpt-oss
    # refuse "sdpa" for softcap and sinks only), keep its masks: None where causality alone
    # applies, no L x L mask. DeepSeek-V4 (no flash attention) joins additive biases to its mask.
    fn = AttentionMaskInterface()[PLAIN]
    for config in (llama().config, transformers.Gemma2Config(), transformers.GptOssConfig()):
        assert fn(batch_size=1, q_length=4, kv_length=4, config=config) is None, type(config).__name__
    transformers.DeepseekV4Model  # (loads the model class the mask function looks for)
    mask = fn(batch_size=1, q_length=4, kv_length=4, config=transformers.DeepseekV4Config())
    assert mask is not None and mask.dtype == torch.float32 and mask.shape == (1, 1, 4, 4)


def test_eager_only_model_without_a_mask_attends_every_key() -> None:
    """BridgeTower refuses "sdpa"; its cross-modal image layers are built with is_causal=True but
    called without a mask ("the image stream is never padded"), and its eager attention, which
    takes causality from the mask alone, lets every image token see every other. The backend made
    those calls causal (image features off by 0.47 of 3.6): its outputs must equal "eager"'s."""
    config = transformers.BridgeTowerConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_hidden_layers=1,
                         intermediate_size=64, pad_token_id=0),
        vision_config=dict(hidden_size=64, num_hidden_layers=1, image_size=32, patch_size=8),
        hidden_size=32, num_attention_heads=4, num_hidden_layers=1,
    )
    g = torch.Generator().manual_seed(1)
    inputs = dict(input_ids=token_ids(2, 7), pixel_values=torch.randn(2, 3, 32, 32, generator=g, dtype=torch.float64))
    outputs = []
    for attn in ("eager", PLAIN):
        torch.manual_seed(0)
        model = transformers.BridgeTowerModel._from_config(copy.deepcopy(config), attn_implementation=attn,
                                                           dtype=torch.float64).eval()
        with torch.no_grad():
            outputs.append(model(**inputs))
    for name in ("text_features", "image_features", "pooler_output"):
        torch.testing.assert_close(outputs[1][name], outputs[0][name], rtol=1e-9, atol=1e-9, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("heads", [(4, 2, 4), (4, 4, 2)])
def test_key_and_value_head_counts_of_their_own(heads: tuple) -> None:
    """A layer whose value projection ignores num_key_value_heads (Nemotron 3's audio encoders,
    configured with fewer KV heads) hands key and value with different head counts; "sdpa" takes
    them (SDPA's enable_gqa repeats each on its own) and so does the backend, also when only the
    value has fewer heads than the query."""
    hq, hk, hv = heads
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, 6, 8, generator=g, dtype=torch.float64) for h in (hq, hk, hv))
    module = torch.nn.Module()
    module.is_causal = True
    out = transformers.AttentionInterface()[PLAIN](module, q, k, v, None, scaling=0.3)[0]
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


def test_per_query_sinks_raise() -> None:
    """A sink computed per query (shape (B, H, Lq, 1), not one logit per head) is refused by the
    backend with a message naming the model-level fix, not the op's shape error."""
    fn = transformers.AttentionInterface()[PLAIN]
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(NotImplementedError, match="one sink logit per head.*eager"):
        fn(torch.nn.Module(), q, q, q, None, s_aux=torch.zeros(1, 2, 4, 1))


# --- 16. models with attention classes of their own ---------------------------------------------
def test_models_with_their_own_attention_classes_warn_through_the_monitor() -> None:
    """Falcon picks its attention class from a table of its own ("eager", "sdpa", flash): built
    with the backend's name it raises transformers' KeyError, and switched to it with
    set_attn_implementation it keeps its own attention, silently before the monitor warned on a
    step that no call reports to (README, torch_ext/hf.py)."""
    config = transformers.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                       new_decoder_architecture=False)
    with pytest.raises(KeyError, match=PLAIN):
        build(config, PLAIN)
    model = build(config, "sdpa")
    ids = token_ids(2, 6)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        model.set_attn_implementation(PLAIN)
        with pytest.warns(UserWarning, match="attention class from a table of its own"):
            with torch_ext.AttentionEntropyMonitor(model) as monitor:
                out = model(input_ids=ids).logits
    assert monitor.latest == []
    torch.testing.assert_close(out, expected, rtol=0, atol=0)  # its own "sdpa" attention
