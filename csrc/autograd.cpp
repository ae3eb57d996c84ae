// Autograd for every op, registered in C++ (Autograd key) so that LibTorch callers get gradients
// as Python callers do. Backward passes call registered ops or ATen ops only, so they also trace
// under torch.compile.
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/isneginf.h>
#include <ATen/ops/log.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/promote_types.h>
#include <ATen/ops/rsqrt.h>
#include <ATen/ops/sign.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include "attention_call.h"

namespace entropy_attn {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::optional<at::Tensor> defined_or_null(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// The forward's options that the backward needs, kept in the context's saved_data.
void save_options(AutogradContext* ctx, const AttentionOptions& o) {
  ctx->saved_data["return_stats"] = o.return_stats;
  ctx->saved_data["is_causal"] = o.causal;
  ctx->saved_data["window_left"] = o.window_left;
  ctx->saved_data["window_right"] = o.window_right;
  ctx->saved_data["bottom_right"] = o.bottom_right;
  ctx->saved_data["softcap"] = o.softcap;
  ctx->saved_data["dropout_p"] = o.dropout_p;
  ctx->saved_data["dropout_seed"] = o.dropout_seed;
}

AttentionOptions saved_options(AutogradContext* ctx) {
  AttentionOptions o;
  o.return_stats = ctx->saved_data["return_stats"].toBool();
  o.causal = ctx->saved_data["is_causal"].toBool();
  o.window_left = ctx->saved_data["window_left"].toInt();
  o.window_right = ctx->saved_data["window_right"].toInt();
  o.bottom_right = ctx->saved_data["bottom_right"].toBool();
  o.softcap = ctx->saved_data["softcap"].toDouble();
  o.dropout_p = ctx->saved_data["dropout_p"].toDouble();
  o.dropout_seed = ctx->saved_data["dropout_seed"].toSymInt();
  return o;
}

class AttentionFunction : public torch::autograd::Function<AttentionFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& query, const at::Tensor& key,
                               const at::Tensor& value, const OptTensor& attn_mask,
                               const OptTensor& scale, const OptTensor& sinks,
                               const OptTensor& cu_seq_q, const OptTensor& cu_seq_k,
                               const AttentionOptions& options) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, lse, entropy, sum_p2, max_weight, n_keys, row_scale, length_factor,
          normalized_entropy, sparsity, effective_keys] =
        call_attention(query, key, value, attn_mask, scale, sinks,
                       {cu_seq_q, cu_seq_k, std::nullopt}, options);
    ctx->set_materialize_grads(false);
    ctx->mark_non_differentiable({max_weight, n_keys, row_scale, length_factor});
    // Without statistics, entropy and sum_p2 are saved as zeros of their full shape (a broadcast
    // scalar, no memory), not as the empty outputs: the saved tensors' shapes then do not depend on
    // return_stats, so that activation checkpointing may re-run a forward that returned them
    // (a step the monitor recorded) without them, or the other way round.
    const at::Tensor no_stat = at::zeros({}, lse.options()).expand_symint(lse.sym_sizes());
    ctx->save_for_backward({query, key, value, attn_mask.value_or(at::Tensor()), out, lse,
                            options.return_stats ? entropy : no_stat,
                            options.return_stats ? sum_p2 : no_stat, row_scale, length_factor,
                            scale.value_or(at::Tensor()),
                            n_keys, sinks.value_or(at::Tensor()), cu_seq_q.value_or(at::Tensor()),
                            cu_seq_k.value_or(at::Tensor())});
    save_options(ctx, options);
    return {out,           lse,           entropy,           sum_p2,     max_weight,    n_keys,
            row_scale,     length_factor, normalized_entropy, sparsity, effective_keys};
  }

  // The upstream gradients of entropy and sum_p2 with those of the statistics derived from them
  // chained in (docs/math.md section 3): normalized entropy H / ln n adds g / ln n to g_H;
  // effective keys 1 / U adds -g / U^2 and sparsity (n U)^(-1/2) adds -g S / (2 U) to g_U. Rows
  // with n < 2 (normalized entropy) or n = 0 (the others) have constant statistics: no gradient.
  // n is the size of the distribution's support: n_keys, plus one with a sink.
  static std::pair<at::Tensor, at::Tensor> statistic_grads(const variable_list& grads,
                                                           const at::Tensor& sum_p2,
                                                           const at::Tensor& n_keys) {
    at::Tensor g_entropy = grads[2], g_sum_p2 = grads[3];
    const at::Tensor &g_norm = grads[8], &g_sparsity = grads[9], &g_eff = grads[10];
    if (g_norm.defined()) {
      const at::Tensor log_n = at::log(n_keys.clamp_min(2).to(sum_p2.scalar_type()));
      const at::Tensor term = at::where(n_keys >= 2, g_norm / log_n, at::zeros_like(g_norm));
      g_entropy = g_entropy.defined() ? g_entropy + term : term;
    }
    if (g_sparsity.defined() || g_eff.defined()) {
      const at::Tensor nonempty = n_keys > 0;
      const at::Tensor u = at::where(nonempty, sum_p2, at::ones_like(sum_p2));
      at::Tensor term = at::zeros_like(sum_p2);
      if (g_eff.defined()) term = term - g_eff / (u * u);
      if (g_sparsity.defined()) {
        const at::Tensor s = at::rsqrt(n_keys.clamp_min(1).to(u.scalar_type()) * u);
        term = term - 0.5 * g_sparsity * s / u;
      }
      term = at::where(nonempty, term, at::zeros_like(term));
      g_sum_p2 = g_sum_p2.defined() ? g_sum_p2 + term : term;
    }
    return {g_entropy, g_sum_p2};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &query = saved[0], &key = saved[1], &value = saved[2];
    const at::Tensor &out = saved[4], &row_scale = saved[8], &length_factor = saved[9],
                     &scale = saved[10], &sinks = saved[12];
    const AttentionOptions options = saved_options(ctx);
    const at::Tensor grad_out = grads[0].defined() ? grads[0] : at::zeros_like(out);
    at::Tensor g_entropy, g_sum_p2;  // a forward without statistics returned them empty
    if (options.return_stats) {
      // (a sink of -inf is no entry: online_stats.h, is_sink_entry)
      const at::Tensor support =
          sinks.defined() ? saved[11] + at::isneginf(sinks).logical_not().view({1, -1, 1})
                          : saved[11];
      std::tie(g_entropy, g_sum_p2) = statistic_grads(grads, saved[7], support);
    }
    // needs_input_grad counts the tensor inputs given: the mask follows q, k and v, the scale
    // follows the mask. A bool mask has no gradient.
    const bool grad_mask =
        saved[3].defined() && saved[3].is_floating_point() && ctx->needs_input_grad(3);
    auto [dq, dk, dv, dlam, dsinks, dmask] = call_attention_backward(
        grad_out, defined_or_null(grads[1]), defined_or_null(g_entropy), defined_or_null(g_sum_p2),
        query, key, value, defined_or_null(saved[3]), out, saved[5], saved[6], saved[7], row_scale,
        defined_or_null(sinks),
        {defined_or_null(saved[13]), defined_or_null(saved[14]), std::nullopt}, options, grad_mask);

    at::Tensor dscale;
    const int64_t scale_input = saved[3].defined() ? 4 : 3;
    if (scale.defined() && ctx->needs_input_grad(scale_input)) {
      // lambda_i = c_i * g(n_i) / temperature, so dc_i = dlambda_i * g(n_i) / temperature, summed
      // over the dims along which c was broadcast.
      dscale = (dlam * length_factor).sum_to_size_symint(scale.sym_sizes()).to(scale.scalar_type());
    }
    at::Tensor dsink;
    if (sinks.defined() && ctx->needs_input_grad(scale_input + (scale.defined() ? 1 : 0))) {
      dsink = dsinks.to(sinks.scalar_type());
    }
    const at::Tensor none;  // cu_seq_q, cu_seq_k and the options have no gradient
    return {dq, dk, dv, grad_mask ? dmask : none, dscale, dsink, none, none, none};
  }
};

AttentionOutputs attention_autograd(EA_ATTENTION_PARAMS) {
  if (seqused_k.has_value()) {
    // Inference only, as in varlen_attn: the keys past seqused_k would need a gradient of 0 that
    // nothing computes.
    const bool needs_grad =
        at::GradMode::is_enabled() &&
        (query.requires_grad() || key.requires_grad() || value.requires_grad() ||
         (attn_mask.has_value() && attn_mask->requires_grad()) ||
         (scale.has_value() && scale->requires_grad()) || (sinks.has_value() && sinks->requires_grad()));
    TORCH_CHECK_VALUE(!needs_grad,
                      "seqused_k is inference-only (no backward, as in varlen_attn): call it under "
                      "torch.no_grad() or with inputs that do not require grad");
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_attention(query, key, value, attn_mask, scale, sinks,
                          {cu_seq_q, cu_seq_k, seqused_k}, EA_ATTENTION_OPTIONS);
  }
  const variable_list r = AttentionFunction::apply(query, key, value, attn_mask, scale, sinks,
                                                   cu_seq_q, cu_seq_k, EA_ATTENTION_OPTIONS);
  return {r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9], r[10]};
}

// A row reduction whose backward is d result / d x = grad * local_grad(x), in ATen ops.
template <typename Derived>
class RowReductionFunction : public torch::autograd::Function<Derived> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, int64_t dim) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto op = row_reduction_op(Derived::kOpName);
    at::Tensor y = op.call(x, dim);
    ctx->save_for_backward({x});
    ctx->saved_data["dim"] = dim < 0 ? dim + x.dim() : dim;
    return {y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor x = ctx->get_saved_variables()[0];
    const int64_t dim = ctx->saved_data["dim"].toInt();
    const at::Tensor xa = x.to(at::promote_types(x.scalar_type(), at::kFloat));
    const at::Tensor g = grads[0].unsqueeze(dim).to(xa.scalar_type());
    return {(g * Derived::local_grad(xa, dim)).to(x.scalar_type()), at::Tensor()};
  }
};

// dH/dp_j = -(ln p_j + 1) on the support; 0 where p_j = 0 (those keys carry no weight).
struct EntropyFunction : RowReductionFunction<EntropyFunction> {
  static constexpr const char* kOpName = "entropy_attn::entropy";
  static at::Tensor local_grad(const at::Tensor& p, int64_t /*dim*/) {
    return at::where(p > 0, -(at::log(p) + 1), at::zeros_like(p));
  }
};

// S = A / sqrt(n Q) with A = sum |a|, Q = sum a^2: dS/da_j = sign(a_j) r - A r a_j / Q,
// r = 1 / sqrt(n Q); 0 for an all-zero slice. S is scale-free, so this is evaluated at a / d, d the
// slice's largest |a| (no underflow or overflow in A and Q: reduction_math.h, sparsity_divisor),
// and divided by d.
struct SparsityFunction : RowReductionFunction<SparsityFunction> {
  static constexpr const char* kOpName = "entropy_attn::sparsity";
  static at::Tensor local_grad(const at::Tensor& x, int64_t dim) {
    const at::Tensor abs_max = x.abs().amax(dim, /*keepdim=*/true);
    const at::Tensor nonzero = abs_max > 0;
    const at::Tensor d = at::where(nonzero, abs_max, at::ones_like(abs_max));
    const at::Tensor a = x / d;
    const at::Tensor l1 = a.abs().sum(dim, /*keepdim=*/true);
    const at::Tensor q = at::where(nonzero, (a * a).sum(dim, /*keepdim=*/true), at::ones_like(d));
    const at::Tensor r = at::where(nonzero, at::rsqrt(q * a.size(dim)), at::zeros_like(q));
    return (at::sign(a) * r - (l1 * r / q) * a) / d;
  }
};

at::Tensor entropy_autograd(const at::Tensor& p, int64_t dim) {
  return EntropyFunction::apply(p, dim)[0];
}
at::Tensor sparsity_autograd(const at::Tensor& a, int64_t dim) {
  return SparsityFunction::apply(a, dim)[0];
}

}  // namespace

TORCH_LIBRARY_IMPL(entropy_attn, Autograd, m) {
  m.impl("attention", &attention_autograd);
  m.impl("entropy", &entropy_autograd);
  m.impl("sparsity", &sparsity_autograd);
  // Not differentiable (attention_backward: no double backward; attention_sparsity: documented as
  // such): a backward that reaches them raises "the derivative ... is not implemented" instead of
  // torch's default for unregistered ops, a warning and silently zero or missing gradients.
  m.impl("attention_backward", torch::autograd::autogradNotImplementedFallback());
  m.impl("attention_sparsity", torch::autograd::autogradNotImplementedFallback());
}

}  // namespace entropy_attn
