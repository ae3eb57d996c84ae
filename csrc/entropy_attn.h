// C++ API of the entropy_attn operators for LibTorch users. Each function calls the registered op
// through the dispatcher, so it runs on any registered device and records autograd.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string_view>

namespace entropy_attn {

struct AttentionResult {
  at::Tensor output;         // (B, H, Lq, Dv), query's dtype
  at::Tensor lse;            // (B, H, Lq) log-sum-exp of the scaled logits
  at::Tensor entropy;        // (B, H, Lq) Shannon entropy of each row of weights
  at::Tensor sum_p2;         // (B, H, Lq) sum of squared weights (1 / effective keys)
  at::Tensor max_weight;     // (B, H, Lq) largest weight
  at::Tensor n_keys;         // (B, H, Lq) int64, keys each row may attend to
  at::Tensor row_scale;      // (B, H, Lq) the logit scale lambda_i used
  at::Tensor length_factor;  // (B, H, Lq) g(n_i) / temperature: row_scale = c_i * length_factor
  at::Tensor normalized_entropy;  // (B, H, Lq) entropy / ln n_i (0 where n_i < 2)
  at::Tensor sparsity;            // (B, H, Lq) l1/l2 sparsity 1 / sqrt(n_i sum_p2)
  at::Tensor effective_keys;      // (B, H, Lq) 1 / sum_p2
  // With return_stats = false: entropy, sum_p2, max_weight and the three above are empty.
};

// See the schema in ops.cpp and the README for the semantics of each argument.
AttentionResult attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                          const std::optional<at::Tensor>& attn_mask = std::nullopt,
                          const std::optional<at::Tensor>& scale = std::nullopt,
                          bool is_causal = false, std::optional<double> scale_factor = std::nullopt,
                          std::string_view scale_mode = "fixed", double temperature = 1.0,
                          double log_base = 512.0, bool enable_gqa = false,
                          bool return_stats = true, std::array<int64_t, 2> window_size = {-1, -1},
                          std::string_view causal_alignment = "top_left", double softcap = 0.0,
                          const std::optional<at::Tensor>& sinks = std::nullopt,
                          double dropout_p = 0.0, int64_t dropout_seed = 0);

// Attention over packed sequences (the layout of torch.nn.attention.varlen.varlen_attn): query
// (T, H, D), key and value (Tk, Hkv, D / Dv), int32 cumulative offsets cu_seq_q / cu_seq_k;
// causality and windows bottom-right aligned within each sequence; n_i per sequence; scale
// broadcastable to (T, H); seqused_k (int32, one per sequence) uses only the first keys of each
// sequence's slot (inference only). The arguments of `attention` otherwise, in the schema's order.
// With block_table (int32 (N, pages per sequence)), key and value are a paged KV cache, pools of
// pages (num_pages, page_size, Hkv, D / Dv): sequence d's keys are the first seqused_k[d]
// (required) tokens of its pages in the table's order; cu_seq_k may then be std::nullopt.
// num_splits = 1 runs each sequence alone: its results do not depend on what else is packed.
// The result's tensors are (T, H, Dv) and (T, H).
AttentionResult varlen_attention(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const at::Tensor& cu_seq_q, const std::optional<at::Tensor>& cu_seq_k, int64_t max_q,
    int64_t max_k, const std::optional<at::Tensor>& scale = std::nullopt,
    const std::optional<at::Tensor>& seqused_k = std::nullopt, bool is_causal = false,
    std::optional<double> scale_factor = std::nullopt, std::string_view scale_mode = "fixed",
    double temperature = 1.0, double log_base = 512.0, bool enable_gqa = false,
    bool return_stats = true, std::array<int64_t, 2> window_size = {-1, -1}, double softcap = 0.0,
    const std::optional<at::Tensor>& sinks = std::nullopt, double dropout_p = 0.0,
    int64_t dropout_seed = 0, const std::optional<at::Tensor>& block_table = std::nullopt,
    std::optional<int64_t> num_splits = std::nullopt);

// Per-row l1/l2 sparsity of attention a = f(s), kind "exp" (softmax), "relu2" or "identity", with
// the logits of `attention`; (B, H, Lq), not differentiable.
at::Tensor attention_sparsity(const at::Tensor& query, const at::Tensor& key,
                              const std::optional<at::Tensor>& attn_mask = std::nullopt,
                              const std::optional<at::Tensor>& scale = std::nullopt,
                              std::string_view kind = "exp", bool is_causal = false,
                              std::optional<double> scale_factor = std::nullopt,
                              std::string_view scale_mode = "fixed", double temperature = 1.0,
                              double log_base = 512.0, bool enable_gqa = false,
                              std::array<int64_t, 2> window_size = {-1, -1},
                              std::string_view causal_alignment = "top_left", double softcap = 0.0);

// -sum p ln p along dim (0 ln 0 = 0).
at::Tensor entropy(const at::Tensor& p, int64_t dim = -1);

// mean|a| / sqrt(mean a^2) along dim; 0 for an all-zero slice.
at::Tensor sparsity(const at::Tensor& a, int64_t dim = -1);

// g(n) / temperature of a scale policy for integer key counts n, in dtype (float or double): the
// kernels' own value, for shards of a row's keys that need the whole row's lambda_i = c g(n_i) /
// temperature.
at::Tensor length_factor(const at::Tensor& n_keys, std::string_view scale_mode = "logn",
                         double temperature = 1.0, double log_base = 512.0,
                         at::ScalarType dtype = at::kFloat);

}  // namespace entropy_attn
