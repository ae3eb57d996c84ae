// The operator schemas: defined here once, for Python (torch.ops.entropy_attn.*) and LibTorch.
// Kernels register per dispatch key in their own files (cpu/, meta.cpp, autograd.cpp).
#include <torch/library.h>

TORCH_LIBRARY(entropy_attn, m) {
  // Fused attention with per-row statistics. lambda_i = c_i * g(n_i) / temperature, where c is
  // `scale` (broadcast to (B, H, Lq)), else `scale_factor`, else 1/sqrt(D), and g is the
  // scale_mode's length factor ("fixed": 1, "logn": log_b n_i, "logn_sharpen": max(1, log_b n_i),
  // b = log_base). Returns output (B, H, Lq, Dv) and, per row (B, H, Lq): lse, entropy, sum of
  // squared weights, max weight, n_keys (int64), the lambda used, g(n_i) / temperature (so that
  // row_scale = c * length_factor: the gradient w.r.t. a scale tensor needs it), and the
  // statistics derived from them in the kernels' epilogue: normalized entropy, l1/l2 sparsity,
  // effective keys (docs/math.md section 2). With return_stats=False the kernels skip the
  // statistics: entropy, sum_p2, max_weight and the derived ones are empty (0 elements).
  // Key patterns, softcapping, sinks and dropout (docs/math.md section 6): row i sees the keys
  // of its window (left, right) around its diagonal (key i, or i + Lk - Lq with causal_alignment
  // "bottom_right"; -1 = unbounded; is_causal sets right = 0), and n_i counts those the mask
  // allows; softcap > 0 caps scaled scores to softcap * tanh(x / softcap) before the mask; sinks
  // (H,) add one logit per head, with no value, to each row's softmax (the statistics then describe
  // the distribution over the keys and the sink); dropout_p drops weights of the output's P V
  // (not those of the statistics) by the Philox stream keyed by dropout_seed (dropout.h).
  // Packed documents: with cu_seq_q and cu_seq_k (int32 cumulative offsets, as varlen_attn) the
  // batch is 1 and document d owns query rows cu_seq_q[d] .. cu_seq_q[d + 1] and keys cu_seq_k[d]
  // .. (+ seqused_k[d] when given, else to cu_seq_k[d + 1]); rows see only their document's keys,
  // the window and causality apply within it, and n_i counts them. varlen_attention is the
  // packed-layout front end. key_rows (int64, one per packed key, with packed documents) reads
  // packed key j from row key_rows[j] of key's and value's dim 2 instead of row j: a paged KV
  // cache's pool of tokens, read where it lies (csrc/paged_kv.h); inference only, no attn_mask.
  m.def(
      "attention(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None, "
      "Tensor? scale=None, *, bool is_causal=False, float? scale_factor=None, "
      "str scale_mode=\"fixed\", float temperature=1.0, float log_base=512.0, "
      "bool enable_gqa=False, bool return_stats=True, int[2] window_size=[-1, -1], "
      "str causal_alignment=\"top_left\", float softcap=0.0, Tensor? sinks=None, "
      "float dropout_p=0.0, SymInt dropout_seed=0, Tensor? cu_seq_q=None, Tensor? cu_seq_k=None, "
      "Tensor? seqused_k=None, Tensor? key_rows=None) -> (Tensor output, Tensor lse, "
      "Tensor entropy, Tensor sum_p2, Tensor max_weight, Tensor n_keys, Tensor row_scale, "
      "Tensor length_factor, Tensor normalized_entropy, Tensor sparsity, Tensor effective_keys)");
  // Gradients of `attention` w.r.t. query, key, value, lambda, the sinks and (with grad_mask) the
  // additive attn_mask, given the upstream gradients of output and (optionally) of lse, entropy and
  // sum_p2 (docs/math.md sections 3 and 6), with the forward's key pattern, softcap, sinks and
  // dropout. entropy and sum_p2 may be empty (a forward without statistics) when their gradients
  // are absent. grad_sinks is empty without sinks; grad_attn_mask is empty without grad_mask, else
  // the gradient of each logit (dS before the softcap) summed to attn_mask's shape, in its dtype;
  // grad_row_scale is empty with grad_scale=False (a call whose scale is no tensor that needs a
  // gradient, which spares the kernels d lambda's work: most Hopper kernels then form dq = lambda
  // dS K directly and store one dS tile instead of two).
  m.def(
      "attention_backward(Tensor grad_output, Tensor? grad_lse, Tensor? grad_entropy, "
      "Tensor? grad_sum_p2, Tensor query, Tensor key, Tensor value, Tensor? attn_mask, "
      "Tensor output, Tensor lse, Tensor entropy, Tensor sum_p2, Tensor row_scale, "
      "bool is_causal, *, int[2] window_size=[-1, -1], str causal_alignment=\"top_left\", "
      "float softcap=0.0, Tensor? sinks=None, float dropout_p=0.0, SymInt dropout_seed=0, "
      "Tensor? cu_seq_q=None, Tensor? cu_seq_k=None, Tensor? seqused_k=None, "
      "bool grad_mask=False, bool grad_scale=True) -> (Tensor grad_query, Tensor grad_key, "
      "Tensor grad_value, Tensor grad_row_scale, Tensor grad_sinks, Tensor grad_attn_mask)");
  // The gradients of `attention`'s inputs (query, key, value, and where output_mask asks: the
  // additive attn_mask, the scale tensor, the sinks; else undefined) from the upstream gradients
  // of its outputs (absent: 0; the derived statistics' chained into entropy's and sum_p2's) and
  // what the forward saved: the backward of its autograd function, in `attention_backward` and
  // ATen ops, for autograd functions in C++ and Python (torch.func) alike.
  m.def(
      "attention_grad(Tensor? grad_output, Tensor? grad_lse, Tensor? grad_entropy, "
      "Tensor? grad_sum_p2, Tensor? grad_normalized_entropy, Tensor? grad_sparsity, "
      "Tensor? grad_effective_keys, Tensor query, Tensor key, Tensor value, Tensor? attn_mask, "
      "Tensor? scale, Tensor? sinks, Tensor output, Tensor lse, Tensor entropy, Tensor sum_p2, "
      "Tensor n_keys, Tensor row_scale, Tensor length_factor, bool is_causal, bool return_stats, "
      "*, int[2] window_size=[-1, -1], str causal_alignment=\"top_left\", float softcap=0.0, "
      "float dropout_p=0.0, SymInt dropout_seed=0, Tensor? cu_seq_q=None, Tensor? cu_seq_k=None, "
      "bool[3] output_mask=[False, False, False]) -> (Tensor grad_query, Tensor grad_key, "
      "Tensor grad_value, Tensor grad_attn_mask, Tensor grad_scale, Tensor grad_sinks)");
  // Attention over packed sequences with the layout of torch.nn.attention.varlen.varlen_attn:
  // query (T, H, D), key and value (Tk, Hkv, D / Dv), int32 cumulative offsets cu_seq_q and
  // cu_seq_k of N + 1 entries, max_q and max_k the longest sequences; causality and windows align
  // bottom-right within each sequence. The outputs of `attention`, as (T, H, Dv) and (T, H). The
  // scale tensor broadcasts to (T, H). A composite of `attention` with its packed documents, so
  // it runs, differentiates and traces wherever `attention` does (not with seqused_k, which is
  // inference-only, as in varlen_attn). With block_table (int32 (N, pages per sequence)) key and
  // value are a paged KV cache, pools of pages (num_pages, page_size, Hkv, D / Dv): sequence d's
  // keys are the first seqused_k[d] (required) tokens of pages block_table[d, 0], [d, 1], ...,
  // and cu_seq_k may be None (given, its lengths must hold seqused_k) (csrc/paged_kv.h).
  // num_splits: None (the kernels choose) or 1, varlen_attn's batch invariance: each sequence runs
  // as a call of its own, so that its results do not depend on what else is packed (bitwise).
  m.def(
      "varlen_attention(Tensor query, Tensor key, Tensor value, Tensor cu_seq_q, Tensor? cu_seq_k, "
      "SymInt max_q, SymInt max_k, Tensor? scale=None, *, Tensor? seqused_k=None, "
      "bool is_causal=False, float? scale_factor=None, str scale_mode=\"fixed\", "
      "float temperature=1.0, float log_base=512.0, bool enable_gqa=False, "
      "bool return_stats=True, int[2] window_size=[-1, -1], float softcap=0.0, "
      "Tensor? sinks=None, float dropout_p=0.0, SymInt dropout_seed=0, "
      "Tensor? block_table=None, int? num_splits=None) -> (Tensor output, "
      "Tensor lse, Tensor entropy, Tensor sum_p2, Tensor max_weight, Tensor n_keys, "
      "Tensor row_scale, Tensor length_factor, Tensor normalized_entropy, Tensor sparsity, "
      "Tensor effective_keys)");
  // varlen_attention's paged KV cache as packed documents (csrc/paged_kv.h): checks the pages,
  // block_table, seqused_k, max_k and cu_seq_k (each error naming its argument), and returns key
  // and value gathered into slots of ceil(max_k / page_size) pages per sequence, with their int32
  // offsets (cu_seq_k). An op of its own, so that the checks run on the values at run time where
  // torch.compile traces the varlen composite. Not differentiable (inference only).
  m.def(
      "_gather_pages(Tensor query, Tensor key, Tensor value, Tensor cu_seq_q, Tensor? cu_seq_k, "
      "Tensor block_table, Tensor? seqused_k, SymInt max_k) -> (Tensor key, Tensor value, "
      "Tensor cu_seq_k)");
  // Per-row l1/l2 sparsity S_i = sum_j |a_ij| / sqrt(n_i sum_j a_ij^2) of general attention
  // a_ij = f(s_ij), f = exp ("exp", softmax), relu^2 ("relu2") or identity ("identity"), with the
  // logits s_ij, masks, key patterns, softcap and scale arguments of `attention` (seed 003). (B, H,
  // Lq); not differentiable.
  m.def(
      "attention_sparsity(Tensor query, Tensor key, Tensor? attn_mask=None, Tensor? scale=None, "
      "*, str kind=\"exp\", bool is_causal=False, float? scale_factor=None, "
      "str scale_mode=\"fixed\", float temperature=1.0, float log_base=512.0, "
      "bool enable_gqa=False, int[2] window_size=[-1, -1], str causal_alignment=\"top_left\", "
      "float softcap=0.0) -> Tensor");
  // The length factor g(n) / temperature of a scale policy for given key counts n (any integer
  // tensor; result on n's device in `dtype`, float32 or float64, the accumulate type of the
  // attention it serves): the `length_factor` output of `attention` for rows with those n_i, so
  // that lambda = c * length_factor. For a caller that splits a row's keys (context parallelism,
  // split-KV), whose shards must use the whole row's n_i.
  m.def(
      "length_factor(Tensor n_keys, str scale_mode=\"fixed\", float temperature=1.0, "
      "float log_base=512.0, ScalarType dtype=float) -> Tensor");
  // Shannon entropy -sum p ln p of normalized weights along `dim` (0 ln 0 = 0).
  m.def("entropy(Tensor p, int dim=-1) -> Tensor");
  // l1/l2 sparsity mean|a| / sqrt(mean a^2) along `dim` (seed 003); 0 for an all-zero slice.
  m.def("sparsity(Tensor a, int dim=-1) -> Tensor");
  // Their backward: grad (the input's shape without dim) times d result / d input.
  m.def("entropy_backward(Tensor grad, Tensor p, int dim) -> Tensor");
  m.def("sparsity_backward(Tensor grad, Tensor a, int dim) -> Tensor");
}
