#include "entropy_attn.h"

#include "attention_call.h"

namespace entropy_attn {
namespace {

// An undefined tensor as the only tensor of a call leaves the dispatcher no device to dispatch on
// ("tensor does not have a device", naming nothing): named here, in the ops' words for None.
void check_defined(const at::Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(t.defined(), name, " must be a tensor, got None");
}

}  // namespace

AttentionResult attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                          const std::optional<at::Tensor>& attn_mask,
                          const std::optional<at::Tensor>& scale, bool is_causal,
                          std::optional<double> scale_factor, std::string_view scale_mode,
                          double temperature, double log_base, bool enable_gqa, bool return_stats,
                          std::array<int64_t, 2> window_size, std::string_view causal_alignment,
                          double softcap, const std::optional<at::Tensor>& sinks, double dropout_p,
                          int64_t dropout_seed) {
  check_defined(query, "query");
  check_defined(key, "key");
  check_defined(value, "value");
  const AttentionOptions options = AttentionOptions::from_schema(
      is_causal, scale_factor, c10::string_view(scale_mode.data(), scale_mode.size()), temperature,
      log_base, enable_gqa, return_stats, window_size,
      c10::string_view(causal_alignment.data(), causal_alignment.size()), softcap, dropout_p,
      dropout_seed);
  auto [out, lse, ent, p2, pmax, n, lam, factor, norm_ent, sparsity, eff] =
      call_attention(query, key, value, attn_mask, scale, sinks, {}, options);
  return {out, lse, ent, p2, pmax, n, lam, factor, norm_ent, sparsity, eff};
}

AttentionResult varlen_attention(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const at::Tensor& cu_seq_q, const std::optional<at::Tensor>& cu_seq_k, int64_t max_q,
    int64_t max_k, const std::optional<at::Tensor>& scale,
    const std::optional<at::Tensor>& seqused_k, bool is_causal, std::optional<double> scale_factor,
    std::string_view scale_mode, double temperature, double log_base, bool enable_gqa,
    bool return_stats, std::array<int64_t, 2> window_size, double softcap,
    const std::optional<at::Tensor>& sinks, double dropout_p, int64_t dropout_seed,
    const std::optional<at::Tensor>& block_table, std::optional<int64_t> num_splits) {
  check_defined(query, "query");
  check_defined(key, "key");
  check_defined(value, "value");
  check_defined(cu_seq_q, "cu_seq_q");
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("entropy_attn::varlen_attention", "")
          .typed<AttentionOutputs(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&, const OptTensor&, c10::SymInt, c10::SymInt,
                                  const OptTensor&, const OptTensor&, bool, std::optional<double>,
                                  c10::string_view, double, double, bool, bool, c10::IntArrayRef,
                                  double, const OptTensor&, double, c10::SymInt, const OptTensor&,
                                  std::optional<int64_t>)>();
  auto [out, lse, ent, p2, pmax, n, lam, factor, norm_ent, sparsity, eff] =
      op.call(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, seqused_k, is_causal,
              scale_factor, c10::string_view(scale_mode.data(), scale_mode.size()), temperature,
              log_base, enable_gqa, return_stats, window_size, softcap, sinks, dropout_p,
              dropout_seed, block_table, num_splits);
  return {out, lse, ent, p2, pmax, n, lam, factor, norm_ent, sparsity, eff};
}

at::Tensor attention_sparsity(const at::Tensor& query, const at::Tensor& key,
                              const std::optional<at::Tensor>& attn_mask,
                              const std::optional<at::Tensor>& scale, std::string_view kind,
                              bool is_causal, std::optional<double> scale_factor,
                              std::string_view scale_mode, double temperature, double log_base,
                              bool enable_gqa, std::array<int64_t, 2> window_size,
                              std::string_view causal_alignment, double softcap) {
  check_defined(query, "query");
  check_defined(key, "key");
  return attention_sparsity_op().call(
      query, key, attn_mask, scale, c10::string_view(kind.data(), kind.size()), is_causal,
      scale_factor, c10::string_view(scale_mode.data(), scale_mode.size()), temperature, log_base,
      enable_gqa, window_size, c10::string_view(causal_alignment.data(), causal_alignment.size()),
      softcap);
}

at::Tensor entropy(const at::Tensor& p, int64_t dim) {
  check_defined(p, "p");
  static const auto op = row_reduction_op("entropy_attn::entropy");
  return op.call(p, dim);
}

at::Tensor sparsity(const at::Tensor& a, int64_t dim) {
  check_defined(a, "a");
  static const auto op = row_reduction_op("entropy_attn::sparsity");
  return op.call(a, dim);
}

at::Tensor length_factor(const at::Tensor& n_keys, std::string_view scale_mode, double temperature,
                         double log_base, at::ScalarType dtype) {
  check_defined(n_keys, "n_keys");
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("entropy_attn::length_factor", "")
          .typed<at::Tensor(const at::Tensor&, c10::string_view, double, double, at::ScalarType)>();
  return op.call(n_keys, c10::string_view(scale_mode.data(), scale_mode.size()), temperature,
                 log_base, dtype);
}

}  // namespace entropy_attn
