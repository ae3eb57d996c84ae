// Validation and normalization of the attention op's arguments: the one place that decides what the
// op accepts, shared by the CPU, CUDA and Meta kernels so that every device raises the same errors.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string_view>

#include "scale_policy.h"

namespace entropy_attn {

// Sizes of one call: query (B, H, Lq, D), key (B, Hkv, Lk, D), value (B, Hkv, Lk, Dv).
struct AttentionShape {
  int64_t batch, heads, kv_heads, q_len, kv_len, head_dim, v_head_dim;
  int64_t group() const { return heads / kv_heads; }  // query heads per key/value head
};

// Raises ValueError/TypeError naming the argument for anything the op does not accept.
AttentionShape check_attention_inputs(const at::Tensor& query, const at::Tensor& key,
                                      const at::Tensor& value,
                                      const std::optional<at::Tensor>& attn_mask,
                                      const std::optional<at::Tensor>& scale,
                                      std::optional<double> scale_factor,
                                      std::string_view scale_mode, double temperature,
                                      double log_base, bool enable_gqa);

ScaleMode parse_scale_mode(std::string_view scale_mode);

// The attention function f of attention_sparsity: a = exp(s), relu(s)^2 or s.
enum class SparsityKind { kExp, kRelu2, kIdentity };
SparsityKind parse_sparsity_kind(std::string_view kind);

// The dtype of statistics and accumulators: float64 for float64 inputs, float32 otherwise.
at::ScalarType accumulate_type(at::ScalarType input);

// Returns the mask expanded (as a view where possible) to (B, H, Lq, Lk), bool or in `acc`.
at::Tensor expand_mask(const at::Tensor& attn_mask, const AttentionShape& s, at::ScalarType acc);

// Returns the per-row scale factor c expanded to (B, H, Lq) in `acc`.
at::Tensor expand_scale(const at::Tensor& scale, const AttentionShape& s, at::ScalarType acc);

// `x` in dtype `dtype` with a contiguous last dimension (a no-op for conforming inputs).
at::Tensor with_unit_last_stride(const at::Tensor& x, at::ScalarType dtype);

}  // namespace entropy_attn
