// Meta kernels: output shapes and dtypes only, with the same argument checks as the real kernels,
// for FakeTensor, torch.compile and torch.library.opcheck.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "attention_inputs.h"
#include "op_handles.h"
#include "reduction_dim.h"

namespace entropy_attn {
namespace {

AttentionOutputs attention_meta(const at::Tensor& query, const at::Tensor& key,
                                const at::Tensor& value, const std::optional<at::Tensor>& attn_mask,
                                const std::optional<at::Tensor>& scale, bool /*is_causal*/,
                                std::optional<double> scale_factor, c10::string_view scale_mode,
                                double temperature, double log_base, bool enable_gqa) {
  const AttentionShape s = check_attention_inputs(query, key, value, attn_mask, scale, scale_factor,
                                                  scale_mode, temperature, log_base, enable_gqa);
  const auto stat = query.options().dtype(accumulate_type(query.scalar_type()));
  auto row = [&] { return at::empty({s.batch, s.heads, s.q_len}, stat); };
  return {at::empty({s.batch, s.heads, s.q_len, s.v_head_dim}, query.options()),
          row(),
          row(),
          row(),
          row(),
          at::empty({s.batch, s.heads, s.q_len}, query.options().dtype(at::kLong)),
          row(),
          row()};
}

at::Tensor attention_sparsity_meta(const at::Tensor& query, const at::Tensor& key,
                                   const std::optional<at::Tensor>& attn_mask,
                                   const std::optional<at::Tensor>& scale, c10::string_view kind,
                                   bool /*is_causal*/, std::optional<double> scale_factor,
                                   c10::string_view scale_mode, double temperature, double log_base,
                                   bool enable_gqa) {
  const AttentionShape s = check_attention_inputs(query, key, key, attn_mask, scale, scale_factor,
                                                  scale_mode, temperature, log_base, enable_gqa);
  parse_sparsity_kind(kind);
  return at::empty({s.batch, s.heads, s.q_len},
                   query.options().dtype(accumulate_type(query.scalar_type())));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_meta(
    const at::Tensor& /*grad_output*/, const std::optional<at::Tensor>& /*grad_lse*/,
    const std::optional<at::Tensor>& /*grad_entropy*/,
    const std::optional<at::Tensor>& /*grad_sum_p2*/, const at::Tensor& query,
    const at::Tensor& key, const at::Tensor& value, const std::optional<at::Tensor>& /*attn_mask*/,
    const at::Tensor& /*output*/, const at::Tensor& /*lse*/, const at::Tensor& /*entropy*/,
    const at::Tensor& /*sum_p2*/, const at::Tensor& row_scale, bool /*is_causal*/) {
  return {at::empty_like(query, at::MemoryFormat::Contiguous),
          at::empty_like(key, at::MemoryFormat::Contiguous),
          at::empty_like(value, at::MemoryFormat::Contiguous),
          at::empty_like(row_scale, at::MemoryFormat::Contiguous)};
}

at::Tensor row_reduction_meta(const at::Tensor& x, int64_t dim, const char* name) {
  const int64_t d = checked_reduction_dim(x, dim, name);
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.erase(sizes.begin() + d);
  return at::empty(sizes, x.options());
}

at::Tensor entropy_meta(const at::Tensor& p, int64_t dim) {
  return row_reduction_meta(p, dim, "p");
}
at::Tensor sparsity_meta(const at::Tensor& a, int64_t dim) {
  return row_reduction_meta(a, dim, "a");
}

}  // namespace

TORCH_LIBRARY_IMPL(entropy_attn, Meta, m) {
  m.impl("attention", &attention_meta);
  m.impl("attention_backward", &attention_backward_meta);
  m.impl("attention_sparsity", &attention_sparsity_meta);
  m.impl("entropy", &entropy_meta);
  m.impl("sparsity", &sparsity_meta);
}

}  // namespace entropy_attn
