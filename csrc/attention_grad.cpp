// The input gradients of `attention`, `entropy` and `sparsity` from their outputs'
// (attention_grad.h), in registered ops and ATen ops only: registered CompositeImplicitAutograd,
// they trace under torch.compile and run under torch.func transforms.
#include "attention_grad.h"

#include <ATen/ExpandUtils.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/isneginf.h>
#include <ATen/ops/log.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/promote_types.h>
#include <ATen/ops/rsqrt.h>
#include <ATen/ops/sign.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros_like.h>
#include <torch/library.h>

#include <utility>
#include <vector>

#include "attention_call.h"
#include "reduction_dim.h"

namespace entropy_attn {
namespace {

// The upstream gradients of entropy and sum_p2 with those of the statistics derived from them
// chained in (docs/math.md section 3): normalized entropy H / ln n adds g / ln n to g_H;
// effective keys 1 / U adds -g / U^2 and sparsity (n U)^(-1/2) adds -g S / (2 U) to g_U. Rows
// with n < 2 (normalized entropy) or n = 0 (the others) have constant statistics: no gradient.
// n is the size of the distribution's support: n_keys, plus one with a sink.
std::pair<at::Tensor, at::Tensor> statistic_grads(const OptTensor& grad_entropy,
                                                  const OptTensor& grad_sum_p2,
                                                  const OptTensor& g_norm,
                                                  const OptTensor& g_sparsity,
                                                  const OptTensor& g_eff, const at::Tensor& sum_p2,
                                                  const at::Tensor& n_keys) {
  at::Tensor g_entropy = grad_entropy.value_or(at::Tensor());
  at::Tensor g_sum_p2 = grad_sum_p2.value_or(at::Tensor());
  if (g_norm.has_value()) {
    const at::Tensor log_n = at::log(n_keys.clamp_min(2).to(sum_p2.scalar_type()));
    const at::Tensor term = at::where(n_keys >= 2, *g_norm / log_n, at::zeros_like(*g_norm));
    g_entropy = g_entropy.defined() ? g_entropy + term : term;
  }
  if (g_sparsity.has_value() || g_eff.has_value()) {
    const at::Tensor nonempty = n_keys > 0;
    const at::Tensor u = at::where(nonempty, sum_p2, at::ones_like(sum_p2));
    at::Tensor term = at::zeros_like(sum_p2);
    if (g_eff.has_value()) term = term - *g_eff / (u * u);
    if (g_sparsity.has_value()) {
      const at::Tensor s = at::rsqrt(n_keys.clamp_min(1).to(u.scalar_type()) * u);
      term = term - 0.5 * *g_sparsity * s / u;
    }
    term = at::where(nonempty, term, at::zeros_like(term));
    g_sum_p2 = g_sum_p2.defined() ? g_sum_p2 + term : term;
  }
  return {g_entropy, g_sum_p2};
}

// The row tensors attention_grad takes beyond attention_backward's (which checks the rest): n_keys
// (integer), length_factor and, with statistics, entropy and sum_p2 (which the statistics'
// gradients read) and the derived statistics' gradients, all of lse's shape and device (without
// statistics those outputs were empty, and traced backwards pass empty gradients for them: not
// used, not checked).
void check_saved_rows(const at::Tensor& lse, const at::Tensor& n_keys,
                      const at::Tensor& length_factor, bool return_stats, const at::Tensor& entropy,
                      const at::Tensor& sum_p2, const OptTensor& g_norm,
                      const OptTensor& g_sparsity, const OptTensor& g_eff) {
  auto check = [&](const char* name, const at::Tensor& t, bool floating) {
    TORCH_CHECK_VALUE(t.sym_sizes() == lse.sym_sizes(), name, " must have lse's shape ",
                      lse.sym_sizes(), ", got ", t.sym_sizes());
    TORCH_CHECK_VALUE(t.device() == lse.device(), name, " must be on lse's device (", lse.device(),
                      "), got ", t.device());
    TORCH_CHECK_TYPE(
        floating ? t.is_floating_point()
                 : at::isIntegralType(t.scalar_type(), /*includeBool=*/false),
        name,
        floating ? " must be a floating-point tensor, got " : " must be an integer tensor, got ",
        t.scalar_type());
  };
  check("n_keys", n_keys, /*floating=*/false);
  check("length_factor", length_factor, /*floating=*/true);
  if (!return_stats) return;
  check("entropy", entropy, /*floating=*/true);
  check("sum_p2", sum_p2, /*floating=*/true);
  const std::pair<const char*, const OptTensor*> grads[] = {{"grad_normalized_entropy", &g_norm},
                                                            {"grad_sparsity", &g_sparsity},
                                                            {"grad_effective_keys", &g_eff}};
  for (const auto& [name, g] : grads) {
    if (g->has_value()) check(name, **g, /*floating=*/true);
  }
}

// d result / d x of a row reduction along `dim`, evaluated in float32 at least, times grad.
template <at::Tensor (*LocalGrad)(const at::Tensor&, int64_t)>
at::Tensor row_reduction_backward(const at::Tensor& grad, const at::Tensor& x, int64_t dim,
                                  const char* name) {
  const int64_t d = checked_reduction_dim(x, dim, name);
  std::vector<c10::SymInt> rows = x.sym_sizes().vec();
  rows.erase(rows.begin() + d);
  TORCH_CHECK_VALUE(grad.sym_sizes() == c10::SymIntArrayRef(rows), "grad must have shape ",
                    c10::SymIntArrayRef(rows), " (", name, "'s without dim ", d, "), got ",
                    grad.sym_sizes());
  TORCH_CHECK_VALUE(grad.device() == x.device(), "grad must be on ", name, "'s device (",
                    x.device(), "), got ", grad.device());
  TORCH_CHECK_TYPE(grad.is_floating_point(), "grad must be a floating-point tensor, got ",
                   grad.scalar_type());
  // An empty slice has a constant result (0): no gradient, and no reduction over it below.
  if (x.sym_size(d) == 0) return at::zeros_like(x);
  const at::Tensor xa = x.to(at::promote_types(x.scalar_type(), at::kFloat));
  const at::Tensor g = grad.unsqueeze(d).to(xa.scalar_type());
  return (g * LocalGrad(xa, d)).to(x.scalar_type());
}

// dH/dp_j = -(ln p_j + 1) on the support; 0 where p_j = 0 (those keys carry no weight).
at::Tensor entropy_local_grad(const at::Tensor& p, int64_t /*dim*/) {
  return at::where(p > 0, -(at::log(p) + 1), at::zeros_like(p));
}

// S = A / sqrt(n Q) with A = sum |a|, Q = sum a^2: dS/da_j = sign(a_j) r - A r a_j / Q,
// r = 1 / sqrt(n Q); 0 for an all-zero slice. S is scale-free, so this is evaluated at a / d, d the
// slice's largest |a| (no underflow or overflow in A and Q: reduction_math.h, sparsity_divisor),
// and divided by d.
at::Tensor sparsity_local_grad(const at::Tensor& x, int64_t dim) {
  const at::Tensor abs_max = x.abs().amax(dim, /*keepdim=*/true);
  const at::Tensor nonzero = abs_max > 0;
  const at::Tensor d = at::where(nonzero, abs_max, at::ones_like(abs_max));
  const at::Tensor a = x / d;
  const at::Tensor l1 = a.abs().sum(dim, /*keepdim=*/true);
  const at::Tensor q = at::where(nonzero, (a * a).sum(dim, /*keepdim=*/true), at::ones_like(d));
  const at::Tensor r =
      at::where(nonzero, at::rsqrt(q * c10::Scalar(a.sym_size(dim))), at::zeros_like(q));
  return (at::sign(a) * r - (l1 * r / q) * a) / d;
}

}  // namespace

AttentionInputGrads attention_grad(
    const OptTensor& grad_output, const OptTensor& grad_lse, const OptTensor& grad_entropy,
    const OptTensor& grad_sum_p2, const OptTensor& grad_normalized_entropy,
    const OptTensor& grad_sparsity, const OptTensor& grad_effective_keys, const at::Tensor& query,
    const at::Tensor& key, const at::Tensor& value, const OptTensor& attn_mask,
    const OptTensor& scale, const OptTensor& sinks, const at::Tensor& output, const at::Tensor& lse,
    const at::Tensor& entropy, const at::Tensor& sum_p2, const at::Tensor& n_keys,
    const at::Tensor& row_scale, const at::Tensor& length_factor, bool is_causal, bool return_stats,
    c10::IntArrayRef window_size, c10::string_view causal_alignment, double softcap,
    double dropout_p, c10::SymInt dropout_seed, const OptTensor& cu_seq_q,
    const OptTensor& cu_seq_k, std::array<bool, 3> output_mask) {
  check_saved_rows(lse, n_keys, length_factor, return_stats, entropy, sum_p2,
                   grad_normalized_entropy, grad_sparsity, grad_effective_keys);
  if (scale.has_value()) {
    // (the forward's check: an integer or bool scale would get a truncated gradient)
    TORCH_CHECK_TYPE(is_supported_dtype(scale->scalar_type()), kScaleTensorName,
                     " must be float32, float64, bfloat16 or float16, got ", scale->scalar_type());
    TORCH_CHECK_VALUE(at::is_expandable_to(scale->sym_sizes(), lse.sym_sizes()),
                      "scale tensor of shape ", scale->sym_sizes(), " does not broadcast to lse's ",
                      lse.sym_sizes());
    TORCH_CHECK_VALUE(scale->device() == lse.device(), "scale must be on lse's device (",
                      lse.device(), "), got ", scale->device());
  }
  // (before the view below; attention_backward checks the rest of the sinks)
  TORCH_CHECK_VALUE(
      !sinks.has_value() ||
          (sinks->dim() == 1 && lse.dim() == 3 && sinks->sym_size(0) == lse.sym_size(1)),
      "sinks must have shape (heads,), one per head of lse (of shape ", lse.sym_sizes(), "), got ",
      sinks.has_value() ? sinks->sym_sizes() : c10::SymIntArrayRef{});
  TORCH_CHECK_VALUE(!sinks.has_value() || sinks->device() == lse.device(),
                    "sinks must be on lse's device (", lse.device(), "), got ",
                    sinks.has_value() ? sinks->device() : lse.device());
  const AttentionOptions options = AttentionOptions::from_schema(
      is_causal, std::nullopt, "fixed", 1.0, 512.0, /*enable_gqa=*/true, return_stats, window_size,
      causal_alignment, softcap, dropout_p, std::move(dropout_seed));
  const at::Tensor g_out = grad_output.has_value() ? *grad_output : at::zeros_like(output);
  at::Tensor g_entropy, g_sum_p2;  // a forward without statistics returned them empty
  if (return_stats) {
    // (a sink of -inf is no entry: online_stats.h, is_sink_entry)
    const at::Tensor support =
        sinks.has_value() ? n_keys + at::isneginf(*sinks).logical_not().view({1, -1, 1}) : n_keys;
    std::tie(g_entropy, g_sum_p2) =
        statistic_grads(grad_entropy, grad_sum_p2, grad_normalized_entropy, grad_sparsity,
                        grad_effective_keys, sum_p2, support);
  }
  // A bool mask has no gradient.
  const bool grad_mask = output_mask[0] && attn_mask.has_value() && attn_mask->is_floating_point();
  // d lambda only for a scale tensor that needs a gradient (the common call, a scale policy, has
  // none, and its kernels skip d lambda's work).
  const bool grad_scale = scale.has_value() && output_mask[1];
  auto [dq, dk, dv, dlam, dsinks, dmask] = call_attention_backward(
      g_out, grad_lse, defined_or_null(g_entropy), defined_or_null(g_sum_p2), query, key, value,
      attn_mask, output, lse, entropy, sum_p2, row_scale, sinks,
      {cu_seq_q, cu_seq_k, std::nullopt, std::nullopt}, options, grad_mask, grad_scale);
  at::Tensor dscale, dsink;
  if (grad_scale) {
    // lambda_i = c_i * g(n_i) / temperature, so dc_i = dlambda_i * g(n_i) / temperature, summed
    // over the dims along which c was broadcast.
    dscale = (dlam * length_factor).sum_to_size_symint(scale->sym_sizes()).to(scale->scalar_type());
  }
  if (sinks.has_value() && output_mask[2]) dsink = dsinks.to(sinks->scalar_type());
  return {dq, dk, dv, grad_mask ? dmask : at::Tensor(), dscale, dsink};
}

at::Tensor entropy_backward(const at::Tensor& grad, const at::Tensor& p, int64_t dim) {
  return row_reduction_backward<entropy_local_grad>(grad, p, dim, "p");
}

at::Tensor sparsity_backward(const at::Tensor& grad, const at::Tensor& a, int64_t dim) {
  return row_reduction_backward<sparsity_local_grad>(grad, a, dim, "a");
}

TORCH_LIBRARY_IMPL(entropy_attn, CompositeImplicitAutograd, m) {
  m.impl("attention_grad", &attention_grad);
  m.impl("entropy_backward", &entropy_backward);
  m.impl("sparsity_backward", &sparsity_backward);
}

}  // namespace entropy_attn
