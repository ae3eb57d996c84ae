// Typed dispatcher handles of the ops, for C++ code that calls them through the dispatcher (the
// autograd kernels and the public C++ API). The signatures mirror the schemas in ops.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <tuple>

namespace entropy_attn {

using OptTensor = std::optional<at::Tensor>;
// (output, lse, entropy, sum_p2, max_weight, n_keys, row_scale, length_factor, normalized_entropy,
// sparsity, effective_keys), as the schema orders them.
using AttentionOutputs =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
               at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// (grad_query, grad_key, grad_value, grad_row_scale, grad_sinks, grad_attn_mask).
using AttentionBackwardOutputs =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The trailing options of `attention` and `attention_backward`: window_size, causal_alignment,
// softcap, sinks, dropout_p, dropout_seed, cu_seq_q, cu_seq_k, seqused_k (and the forward's
// key_rows).
#define EA_PATTERN_ARGS                                                              \
  c10::IntArrayRef, c10::string_view, double, const OptTensor&, double, c10::SymInt, \
      const OptTensor&, const OptTensor&, const OptTensor&

using AttentionSignature = AttentionOutputs(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                            const OptTensor&, const OptTensor&, bool,
                                            std::optional<double>, c10::string_view, double, double,
                                            bool, bool, EA_PATTERN_ARGS, const OptTensor&);
using AttentionBackwardSignature = AttentionBackwardOutputs(
    const at::Tensor&, const OptTensor&, const OptTensor&, const OptTensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const OptTensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const at::Tensor&, bool, EA_PATTERN_ARGS, bool, bool);
using AttentionSparsitySignature = at::Tensor(const at::Tensor&, const at::Tensor&,
                                              const OptTensor&, const OptTensor&, c10::string_view,
                                              bool, std::optional<double>, c10::string_view, double,
                                              double, bool, c10::IntArrayRef, c10::string_view,
                                              double);
#undef EA_PATTERN_ARGS

inline const c10::TypedOperatorHandle<AttentionSignature>& attention_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("entropy_attn::attention", "")
                             .typed<AttentionSignature>();
  return op;
}

inline const c10::TypedOperatorHandle<AttentionBackwardSignature>& attention_backward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("entropy_attn::attention_backward", "")
                             .typed<AttentionBackwardSignature>();
  return op;
}

inline const c10::TypedOperatorHandle<AttentionSparsitySignature>& attention_sparsity_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("entropy_attn::attention_sparsity", "")
                             .typed<AttentionSparsitySignature>();
  return op;
}

// entropy_attn::entropy or entropy_attn::sparsity: (Tensor x, int dim) -> Tensor.
inline c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, int64_t)> row_reduction_op(
    const char* name) {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow(name, "")
      .typed<at::Tensor(const at::Tensor&, int64_t)>();
}

}  // namespace entropy_attn
