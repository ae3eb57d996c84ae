"""Model families through the transformers backend (torch_ext.hf) with the features they need:
Llama with packed batches (position_ids that restart, and transformers' cu_seq_lens kwargs),
Mistral (sliding window), Gemma 2 (softcap + window), gpt-oss (sinks + window), BERT (dropout).
Tiny random-weight models built from configs (no downloads), CPU, float32; outputs and every
parameter gradient against transformers' own "sdpa" or "eager" backend, with the standard scale.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import pytest
import torch

transformers = pytest.importorskip("transformers")

import torch_ext  # noqa: E402
import torch_ext.hf as hf  # noqa: E402
from transformers import (  # noqa: E402
    AutoModel,
    AutoModelForCausalLM,
    BertConfig,
    Gemma2Config,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
)

PLAIN = "torch_ext_models_plain"
LOGN = "torch_ext_models_logn"
VOCAB = 100
RTOL = 2e-5


@pytest.fixture(scope="module", autouse=True)
def _backends() -> None:
    hf.register(PLAIN)
    hf.register(LOGN, scale="logn", train_length=4)


COMMON: Dict[str, Any] = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, vocab_size=VOCAB,
    max_position_embeddings=64, initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)


def build(config: Any, attn: str = "sdpa") -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32).eval()


def ids_and_mask(batch: int, length: int, padded: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    if padded:
        mask[0, :3] = 0
        ids[0, :3] = 0
    return ids, mask


def run(model: torch.nn.Module, attn: str, **inputs: Any) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Logits under ``attn`` (0 at padding) and every parameter's gradient of a fixed random
    projection of them. Padding positions are left out: a query row with no key to attend to is
    0 for the op and "sdpa", the mean of the values for "eager"; nothing reads it."""
    model.set_attn_implementation(attn)
    model.zero_grad(set_to_none=True)
    y = model(**inputs).logits
    keep = inputs.get("attention_mask")
    keep = torch.ones(y.shape[:2]) if keep is None else keep.to(y.dtype)
    y = y * keep.unsqueeze(-1)
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(2))
    (y * w).sum().backward()
    return y.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_close_grads(grads: Dict[str, torch.Tensor], ref_grads: Dict[str, torch.Tensor], rtol: float = RTOL) -> None:
    """Relative norm error per parameter. A gradient that is 0 in exact arithmetic (a key bias: the
    softmax is shift-invariant) is rounding noise in both: its error is measured against 1% of the
    norm of the whole gradient instead."""
    assert grads.keys() == ref_grads.keys() and len(grads) > 0
    total = torch.cat([g.flatten() for g in ref_grads.values()]).norm().item()
    for name, g in ref_grads.items():
        err = (grads[name] - g).norm().item()
        assert err <= rtol * max(g.norm().item(), 1e-2 * total), f"{name}: |error| {err:.3g}, |grad| {g.norm():.3g}"


def assert_same(model: torch.nn.Module, ref_attn: str, attn: str, **inputs: Any) -> None:
    """Logits and all parameter gradients under ``attn`` equal those under ``ref_attn``."""
    ref, ref_grads = run(model, ref_attn, **inputs)
    out, grads = run(model, attn, **inputs)
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=RTOL * ref.abs().max().item())
    assert_close_grads(grads, ref_grads)


# --- Mistral: sliding window ----------------------------------------------------------------
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
def test_mistral_sliding_window_matches_sdpa(padded: bool) -> None:
    """A window of 4 over 14 tokens: the backend passes the window to the op (which skips blocks)
    on top of transformers' mask; outputs and gradients equal "sdpa"."""
    cfg = MistralConfig(intermediate_size=128, sliding_window=4, **COMMON)
    model = build(cfg)
    ids, mask = ids_and_mask(2, 14, padded)
    assert_same(model, "sdpa", PLAIN, input_ids=ids, attention_mask=mask)


def test_sliding_window_reaches_the_op() -> None:
    """The layer's sliding_window becomes the op's window_size (n_i = min(i + 1, W))."""
    cfg = MistralConfig(intermediate_size=128, sliding_window=4, **COMMON)
    model = build(cfg, PLAIN)
    ids, _ = ids_and_mask(1, 10, False)
    with torch_ext.AttentionEntropyMonitor(model, positions=True) as monitor:
        model(ids)
    rows = {r["layer"]: r for r in monitor.latest if r["head"] == 0}
    assert len(rows) == 2
    for r in rows.values():  # normalized entropy uses ln n_i: a wrong n_i would leave [0, 1]
        assert 0 <= r["normalized_entropy_max"] <= 1
    fn = transformers.AttentionInterface()[PLAIN]
    q = torch.randn(1, 4, 10, 16)
    layer = torch.nn.Module()
    layer.is_causal = True
    out, _ = fn(layer, q, q, q, None, sliding_window=4)
    want = torch_ext.attention(q, q, q, attn_mask=torch.ones(10, 10, dtype=torch.bool).tril().triu(-3))
    torch.testing.assert_close(out.transpose(1, 2), want)
    torch.testing.assert_close(fn(layer, q, q, q, None, sliding_window=4.0)[0], out)  # (an integral float)
    for bad in ("4", 2.5, True):
        with pytest.raises(TypeError, match="sliding_window must be an int or None"):
            fn(layer, q, q, q, None, sliding_window=bad)


# --- Gemma 2: softcap and sliding window -----------------------------------------------------
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
def test_gemma2_softcap_and_window_match_eager(padded: bool) -> None:
    """Gemma 2 (logit softcap 5, a small value so that it bends the logits, sliding window 4 on
    alternate layers) equals its "eager" backend ("sdpa" has no softcap)."""
    cfg = Gemma2Config(
        intermediate_size=128, head_dim=16, sliding_window=4, attn_logit_softcapping=5.0, final_logit_softcapping=None,
        **COMMON,
    )
    model = build(cfg, "eager")
    ids, mask = ids_and_mask(2, 12, padded)
    assert_same(model, "eager", PLAIN, input_ids=ids, attention_mask=mask)


# --- gpt-oss: sinks and sliding window --------------------------------------------------------
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
def test_gpt_oss_sinks_and_window_match_eager(padded: bool) -> None:
    """gpt-oss (a learnable sink per head, sliding window 4 on alternate layers, MoE) equals its
    "eager" backend, including the sinks' gradients."""
    cfg = GptOssConfig(
        intermediate_size=64, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], **COMMON,
    )
    model = build(cfg, "eager")
    with torch.no_grad():  # sinks start at 0 in a fresh model; make them matter
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 1.0)
    ids, mask = ids_and_mask(2, 12, padded)
    assert_same(model, "eager", PLAIN, input_ids=ids, attention_mask=mask)
    _, grads = run(model, PLAIN, input_ids=ids, attention_mask=mask)
    assert grads["model.layers.0.self_attn.sinks"].abs().sum() > 0


# --- Llama: packed batches ---------------------------------------------------------------------
LENGTHS = [5, 7, 3]


def packed_inputs() -> Tuple[torch.Tensor, torch.Tensor, List[torch.Tensor]]:
    """Three documents as one row with restarting position_ids, and the documents alone."""
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(3, VOCAB, (1, n), generator=g) for n in LENGTHS]
    ids = torch.cat(docs, dim=1)
    pos = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)
    return ids, pos, docs


@pytest.mark.parametrize("attn", [PLAIN, LOGN])
@pytest.mark.parametrize("how", ["position_ids", "cu_seq_lens"])
def test_llama_packed_batch_matches_unpacked_rows(attn: str, how: str) -> None:
    """A packed row gives each document the logits and gradients it gets alone, under the standard
    scale and under "logn" (n_i restarts with each document, so the scale is per document)."""
    model = build(LlamaConfig(intermediate_size=128, **COMMON))
    ids, pos, docs = packed_inputs()
    # (no cache: with one transformers attends across the documents, as "sdpa" then does)
    kwargs: Dict[str, Any] = {"position_ids": pos, "use_cache": False}
    if how == "cu_seq_lens":
        cu = torch.tensor([0] + list(torch.tensor(LENGTHS).cumsum(0)), dtype=torch.int32)
        kwargs = {**kwargs, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(LENGTHS), "max_length_k": max(LENGTHS)}
    model.set_attn_implementation(attn)
    model.zero_grad(set_to_none=True)
    packed = model(input_ids=ids, **kwargs).logits
    w = torch.randn(packed.shape, generator=torch.Generator().manual_seed(4))
    (packed * w).sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model.zero_grad(set_to_none=True)
    alone, start = [], 0
    for d in docs:
        y = model(input_ids=d).logits
        (y * w[:, start : start + d.shape[1]]).sum().backward()
        alone.append(y.detach())
        start += d.shape[1]
    torch.testing.assert_close(packed.detach(), torch.cat(alone, dim=1), rtol=RTOL, atol=RTOL)
    assert_close_grads(packed_grads, {n: p.grad for n, p in model.named_parameters() if p.grad is not None})


def test_llama_packed_matches_sdpa_packed() -> None:
    """With the standard scale, the packed row equals transformers' "sdpa" on the same packed row
    (which builds a block-diagonal mask from the position_ids when there is no cache)."""
    model = build(LlamaConfig(intermediate_size=128, **COMMON))
    ids, pos, _ = packed_inputs()
    assert_same(model, "sdpa", PLAIN, input_ids=ids, position_ids=pos, use_cache=False)


def test_monitor_per_document_positions() -> None:
    """On a packed row the monitor's per-position curve is indexed by position within each
    document (length max(LENGTHS), not the packed length), and every row is counted."""
    model = build(LlamaConfig(intermediate_size=128, **COMMON), PLAIN)
    ids, pos, docs = packed_inputs()
    with torch_ext.AttentionEntropyMonitor(model, positions=True) as packed_monitor:
        model(input_ids=ids, position_ids=pos, use_cache=False)
    with torch_ext.AttentionEntropyMonitor(model, positions=True) as alone_monitor:
        for d in docs:
            model(input_ids=d)
    for layer, curve in packed_monitor.latest_positions.items():
        assert curve.shape == (4, max(LENGTHS))
        torch.testing.assert_close(curve, alone_monitor.latest_positions[layer], rtol=1e-5, atol=1e-6)
    packed_rows = {(r["layer"], r["head"]): r for r in packed_monitor.latest}
    for r in alone_monitor.latest:
        p = packed_rows[(r["layer"], r["head"])]
        assert p["rows"] == r["rows"] == sum(LENGTHS)
        assert p["entropy_mean"] == pytest.approx(r["entropy_mean"], rel=1e-5)


# --- BERT: attention dropout --------------------------------------------------------------------
def bert(dropout: float) -> torch.nn.Module:
    cfg = BertConfig(
        hidden_size=64, num_attention_heads=4, num_hidden_layers=1, intermediate_size=128, vocab_size=VOCAB,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=dropout,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    return AutoModel.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)


def test_bert_dropout_eval_matches_sdpa() -> None:
    """In eval mode a BERT with attention dropout equals "sdpa" (no dropout), outputs and grads."""
    model = bert(0.2).eval()
    ids, mask = ids_and_mask(2, 12, True)
    results = {}
    for attn in ("sdpa", PLAIN):
        model.set_attn_implementation(attn)
        model.zero_grad(set_to_none=True)
        y = model(input_ids=ids, attention_mask=mask).last_hidden_state * mask.unsqueeze(-1)
        (y * torch.randn(y.shape, generator=torch.Generator().manual_seed(2))).sum().backward()
        results[attn] = (y.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    ref, ref_grads = results["sdpa"]
    out, grads = results[PLAIN]
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=RTOL * ref.abs().max().item())
    assert_close_grads(grads, ref_grads)


def test_bert_dropout_train_matches_sdpa_statistically() -> None:
    """In training, the self-attention output of one layer under the op's dropout has, over many
    draws, the mean of the no-dropout output and the spread of "sdpa"'s dropout (same p)."""
    model = bert(0.2).train()
    ids, mask = ids_and_mask(2, 12, False)
    attn = model.encoder.layer[0].attention.self
    captured: List[torch.Tensor] = []
    hook = attn.register_forward_hook(lambda m, a, out: captured.append(out[0].detach()))
    draws = 300
    samples = {}
    for impl in ("sdpa", PLAIN):
        model.set_attn_implementation(impl)
        captured.clear()
        with torch.no_grad():
            for _ in range(draws):
                model(input_ids=ids, attention_mask=mask)
        samples[impl] = torch.stack(captured)
    model.eval()
    captured.clear()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    clean = captured[0]
    hook.remove()
    ours, theirs = samples[PLAIN], samples["sdpa"]
    assert not torch.allclose(ours[0], ours[1])  # dropout is on
    stderr = ours.std(0) / draws**0.5
    assert ((ours.mean(0) - clean).abs() < 5 * stderr + 1e-6).float().mean() > 0.99
    ratio = ours.std(0).mean() / theirs.std(0).mean()
    assert 0.9 < ratio < 1.1, f"spread ratio {ratio:.3f}"
