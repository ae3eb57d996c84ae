// Meta kernels: output shapes and dtypes only, with the same argument checks as the real kernels,
// for FakeTensor, torch.compile and torch.library.opcheck.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "attention_call.h"
#include "reduction_dim.h"

namespace entropy_attn {
namespace {

// The forward's checks (check_attention_call) and outputs on symbolic sizes, so that
// torch.compile traces one graph for every length instead of fixing each size to a constant.
AttentionOutputs attention_meta(EA_ATTENTION_PARAMS) {
  const AttentionOptions options = EA_ATTENTION_OPTIONS;
  const SymAttentionShape s =
      check_attention_call(query, key, value, attn_mask, scale, sinks,
                           {cu_seq_q, cu_seq_k, seqused_k, key_rows}, options);
  return allocate_attention_outputs(s, query, accumulate_type(query.scalar_type()), return_stats);
}

at::Tensor attention_sparsity_meta(const at::Tensor& query, const at::Tensor& key,
                                   const OptTensor& attn_mask, const OptTensor& scale,
                                   c10::string_view kind, bool is_causal,
                                   std::optional<double> scale_factor, c10::string_view scale_mode,
                                   double temperature, double log_base, bool enable_gqa,
                                   c10::IntArrayRef window_size, c10::string_view causal_alignment,
                                   double softcap) {
  const AttentionOptions options = AttentionOptions::from_schema(
      is_causal, scale_factor, scale_mode, temperature, log_base, enable_gqa,
      /*return_stats=*/true, window_size, causal_alignment, softcap, 0.0, 0);
  const SymAttentionShape s =
      check_attention_call(query, key, key, attn_mask, scale, std::nullopt, {}, options);
  parse_sparsity_kind(std::string_view(kind.data(), kind.size()));  // (its ValueError)
  return at::empty_symint({s.batch, s.heads, s.q_len},
                          query.options().dtype(accumulate_type(query.scalar_type())));
}

// The gradients have the shapes of the inputs they belong to. No shape checks here, unlike the
// forward's Meta kernel: the backward runs under dynamic shapes (symbolic sizes) when torch.compile
// traces it, and its inputs come from a forward that was checked. The devices are checked: one
// Meta tensor among CPU or CUDA ones dispatches here, and would get uninitialized gradients.
AttentionBackwardOutputs attention_backward_meta(
    const at::Tensor& grad_output, const std::optional<at::Tensor>& grad_lse,
    const std::optional<at::Tensor>& grad_entropy, const std::optional<at::Tensor>& grad_sum_p2,
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask, const at::Tensor& output, const at::Tensor& lse,
    const at::Tensor& entropy, const at::Tensor& sum_p2, const at::Tensor& row_scale,
    bool /*is_causal*/, c10::IntArrayRef /*window_size*/, c10::string_view /*causal_alignment*/,
    double /*softcap*/, const std::optional<at::Tensor>& sinks, double /*dropout_p*/,
    c10::SymInt /*dropout_seed*/, const std::optional<at::Tensor>& cu_seq_q,
    const std::optional<at::Tensor>& cu_seq_k, const std::optional<at::Tensor>& seqused_k,
    bool grad_mask, bool grad_scale) {
  const std::pair<const char*, std::optional<at::Tensor>> tensors[] = {
      {"grad_output", grad_output},
      {"grad_lse", grad_lse},
      {"grad_entropy", grad_entropy},
      {"grad_sum_p2", grad_sum_p2},
      {"key", key},
      {"value", value},
      {"attn_mask", attn_mask},
      {"output", output},
      {"lse", lse},
      {"entropy", entropy},
      {"sum_p2", sum_p2},
      {"row_scale", row_scale},
      {"sinks", sinks},
      {"cu_seq_q", cu_seq_q},
      {"cu_seq_k", cu_seq_k},
      {"seqused_k", seqused_k}};
  for (const auto& [name, t] : tensors) {
    TORCH_CHECK_VALUE(!t.has_value() || t->device() == query.device(), name,
                      " must be on query's device (", query.device(), "), got ", t->device());
  }
  const at::ScalarType acc = accumulate_type(query.scalar_type());
  check_grad_mask(attn_mask, grad_mask);
  return {empty_in_layout_of(query, query.sym_sizes(), query.options()),
          empty_in_layout_of(key, key.sym_sizes(), key.options()),
          empty_in_layout_of(value, value.sym_sizes(), value.options()),
          grad_scale ? at::empty_like(row_scale, at::MemoryFormat::Contiguous)
                     : at::empty({0}, row_scale.options()),
          sinks.has_value() ? at::empty_symint(sinks->sym_sizes(), sinks->options().dtype(acc))
                            : at::empty({0}, query.options().dtype(acc)),
          grad_mask ? at::empty_like(*attn_mask, at::MemoryFormat::Contiguous)
                    : at::empty({0}, query.options().dtype(acc))};
}

at::Tensor row_reduction_meta(const at::Tensor& x, int64_t dim, const char* name) {
  const int64_t d = checked_reduction_dim(x, dim, name);
  std::vector<c10::SymInt> sizes = x.sym_sizes().vec();  // symbolic: one graph for every size
  sizes.erase(sizes.begin() + d);
  return at::empty_symint(sizes, x.options());
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
