#include "entropy_attn.h"

#include <ATen/core/dispatch/Dispatcher.h>

namespace entropy_attn {

AttentionResult attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                          const std::optional<at::Tensor>& attn_mask,
                          const std::optional<at::Tensor>& scale, bool is_causal,
                          std::optional<double> scale_factor, std::string_view scale_mode,
                          double temperature, double log_base, bool enable_gqa) {
  using Opt = std::optional<at::Tensor>;
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("entropy_attn::attention", "")
                       .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                                         at::Tensor, at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, const at::Tensor&, const Opt&,
                           const Opt&, bool, std::optional<double>, c10::string_view, double,
                           double, bool)>();
  auto [out, lse, ent, p2, pmax, n, lam] =
      op.call(query, key, value, attn_mask, scale, is_causal, scale_factor,
              c10::string_view(scale_mode.data(), scale_mode.size()), temperature, log_base,
              enable_gqa);
  return {out, lse, ent, p2, pmax, n, lam};
}

namespace {
at::Tensor call_reduction(const char* name, const at::Tensor& x, int64_t dim) {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow(name, "")
      .typed<at::Tensor(const at::Tensor&, int64_t)>()
      .call(x, dim);
}
}  // namespace

at::Tensor entropy(const at::Tensor& p, int64_t dim) {
  return call_reduction("entropy_attn::entropy", p, dim);
}

at::Tensor sparsity(const at::Tensor& a, int64_t dim) {
  return call_reduction("entropy_attn::sparsity", a, dim);
}

}  // namespace entropy_attn
