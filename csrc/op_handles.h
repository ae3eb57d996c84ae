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

inline const c10::TypedOperatorHandle<AttentionOutputs(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&,
    bool, std::optional<double>, c10::string_view, double, double, bool, bool)>&
attention_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("entropy_attn::attention", "")
          .typed<AttentionOutputs(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const OptTensor&, const OptTensor&, bool, std::optional<double>,
                                  c10::string_view, double, double, bool, bool)>();
  return op;
}

inline const c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const OptTensor&, const OptTensor&, const OptTensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const OptTensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const at::Tensor&, bool)>&
attention_backward_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("entropy_attn::attention_backward", "")
          .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
              const at::Tensor&, const OptTensor&, const OptTensor&, const OptTensor&,
              const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&,
              const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
              const at::Tensor&, bool)>();
  return op;
}

inline const c10::TypedOperatorHandle<at::Tensor(
    const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&, c10::string_view,
    bool, std::optional<double>, c10::string_view, double, double, bool)>&
attention_sparsity_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("entropy_attn::attention_sparsity", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&,
                            const OptTensor&, c10::string_view, bool, std::optional<double>,
                            c10::string_view, double, double, bool)>();
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
