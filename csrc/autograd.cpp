// Autograd for every op, registered in C++ (Autograd key) so that LibTorch callers get gradients
// as Python callers do. Backward passes are registered ops (attention_grad.h), made of registered
// ops and ATen ops only, so they also trace under torch.compile.
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include <array>
#include <initializer_list>
#include <string>

#include "attention_call.h"
#include "attention_grad.h"

namespace entropy_attn {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

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

// Compiled autograd traces the backward (the functions below are traceable) with the saved ints
// and floats lifted to its graph's inputs, symbolic where it made them so: they are read through
// SymInt/SymFloat and guarded to the values of the call (a new value compiles once more), the
// dropout seed excepted, which stays symbolic so that every step's mask shares one graph.
int64_t saved_int(AutogradContext* ctx, const std::string& name) {
  return ctx->saved_data[name].toSymInt().guard_int(__FILE__, __LINE__);
}
double saved_double(AutogradContext* ctx, const std::string& name) {
  return ctx->saved_data[name].toSymFloat().guard_float(__FILE__, __LINE__);
}

AttentionOptions saved_options(AutogradContext* ctx) {
  AttentionOptions o;
  o.return_stats = ctx->saved_data["return_stats"].toBool();
  o.causal = ctx->saved_data["is_causal"].toBool();
  o.window_left = saved_int(ctx, "window_left");
  o.window_right = saved_int(ctx, "window_right");
  o.bottom_right = ctx->saved_data["bottom_right"].toBool();
  o.softcap = saved_double(ctx, "softcap");
  o.dropout_p = saved_double(ctx, "dropout_p");
  o.dropout_seed = ctx->saved_data["dropout_seed"].toSymInt();
  return o;
}

// The outputs that are not differentiable: max_weight, n_keys, row_scale and length_factor.
using NonDifferentiable = std::array<at::Tensor, 4>;

// The function's outputs are the differentiable ones (output, lse, entropy, sum_p2 and the derived
// statistics); the others leave the forward through `plain`, made with autograd off, so they do
// not require grad. Marked non-differentiable as outputs, they stopped compiled autograd, which
// asserts that a C++ function marked none (CppNode::compiled_args).
class AttentionFunction : public torch::autograd::Function<AttentionFunction> {
 public:
  // Compiled autograd puts the backward in its graph (its ops have fake kernels) instead of
  // calling it eagerly between two graphs.
  static constexpr bool is_traceable = true;
  static variable_list forward(AutogradContext* ctx, const at::Tensor& query, const at::Tensor& key,
                               const at::Tensor& value, const OptTensor& attn_mask,
                               const OptTensor& scale, const OptTensor& sinks,
                               const OptTensor& cu_seq_q, const OptTensor& cu_seq_k,
                               const AttentionOptions& options, NonDifferentiable* plain) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, lse, entropy, sum_p2, max_weight, n_keys, row_scale, length_factor,
          normalized_entropy, sparsity, effective_keys] =
        call_attention(query, key, value, attn_mask, scale, sinks,
                       {cu_seq_q, cu_seq_k, std::nullopt, std::nullopt}, options);
    ctx->set_materialize_grads(false);
    *plain = {max_weight, n_keys, row_scale, length_factor};
    // Without statistics, entropy and sum_p2 are saved as zeros of their full shape (a broadcast
    // scalar, no memory), not as the empty outputs: the saved tensors' shapes then do not depend on
    // return_stats, so that activation checkpointing may re-run a forward that returned them
    // (a step the monitor recorded) without them, or the other way round.
    const at::Tensor no_stat = options.return_stats
                                   ? at::Tensor()
                                   : at::zeros({}, lse.options()).expand_symint(lse.sym_sizes());
    ctx->save_for_backward({query, key, value, attn_mask.value_or(at::Tensor()), out, lse,
                            options.return_stats ? entropy : no_stat,
                            options.return_stats ? sum_p2 : no_stat, row_scale, length_factor,
                            scale.value_or(at::Tensor()), n_keys, sinks.value_or(at::Tensor()),
                            cu_seq_q.value_or(at::Tensor()), cu_seq_k.value_or(at::Tensor())});
    save_options(ctx, options);
    return {out, lse, entropy, sum_p2, normalized_entropy, sparsity, effective_keys};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const AttentionOptions o = saved_options(ctx);
    // needs_input_grad counts the tensor inputs given: the mask follows q, k and v, the scale
    // follows the mask, the sinks follow the scale.
    const at::Tensor &mask = saved[3], &scale = saved[10], &sinks = saved[12];
    const int64_t scale_input = mask.defined() ? 4 : 3;
    const std::array<bool, 3> output_mask = {
        mask.defined() && ctx->needs_input_grad(3),
        scale.defined() && ctx->needs_input_grad(scale_input),
        sinks.defined() && ctx->needs_input_grad(scale_input + (scale.defined() ? 1 : 0))};
    auto [dq, dk, dv, dmask, dscale, dsink] = attention_grad(
        defined_or_null(grads[0]), defined_or_null(grads[1]), defined_or_null(grads[2]),
        defined_or_null(grads[3]), defined_or_null(grads[4]), defined_or_null(grads[5]),
        defined_or_null(grads[6]), saved[0], saved[1], saved[2], defined_or_null(mask),
        defined_or_null(scale), defined_or_null(sinks), saved[4], saved[5], saved[6], saved[7],
        saved[11], saved[8], saved[9], o.causal, o.return_stats, o.window_size(),
        o.causal_alignment_name(), o.softcap, o.dropout_p, o.dropout_seed,
        defined_or_null(saved[13]), defined_or_null(saved[14]), output_mask);
    const at::Tensor none;  // cu_seq_q, cu_seq_k, the options and `plain` have no gradient
    return {dq, dk, dv, dmask, dscale, dsink, none, none, none, none};
  }
};

// Whether a call records anything for autograd: a differentiable input that requires grad under
// grad mode, or one carrying a forward-mode tangent (which the autograd function refuses with
// torch's "jvp is not implemented" error, rather than return outputs without tangents).
struct Records {
  bool grad = false, tangent = false;
  bool any() const { return grad || tangent; }
};
Records records_autograd(std::initializer_list<const at::Tensor*> inputs) {
  const bool grad_mode = at::GradMode::is_enabled();
  Records r;
  for (const at::Tensor* t : inputs) {
    if (!t->defined()) continue;
    r.grad = r.grad || (grad_mode && t->requires_grad());
    r.tangent = r.tangent || t->_fw_grad(/*level=*/0).defined();
  }
  return r;
}

AttentionOutputs attention_autograd(EA_ATTENTION_PARAMS) {
  const at::Tensor none;
  const Records records = records_autograd({&query, &key, &value, attn_mask ? &*attn_mask : &none,
                                            scale ? &*scale : &none, sinks ? &*sinks : &none});
  if (!records.any() || seqused_k.has_value() || key_rows.has_value()) {
    // Inference only, as in varlen_attn: the keys past seqused_k would need a gradient of 0 that
    // nothing computes, and the rows of key_rows gradients scattered into a pool.
    const char* name = seqused_k.has_value() ? "seqused_k" : "key_rows";
    TORCH_CHECK_VALUE(!records.grad, name,
                      " is inference-only (no backward, as in varlen_attn): call it under "
                      "torch.no_grad() or with inputs that do not require grad");
    TORCH_CHECK_VALUE(!records.tangent, name,
                      " is inference-only: it has no forward-mode derivative either (an "
                      "input carries a forward-mode AD tangent)");
    // Nothing to record: the autograd function's node, saved tensors and options would cost more
    // than a short call's kernel (a decoding step).
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_attention(query, key, value, attn_mask, scale, sinks,
                          {cu_seq_q, cu_seq_k, seqused_k, key_rows}, EA_ATTENTION_OPTIONS);
  }
  NonDifferentiable plain;
  const variable_list r = AttentionFunction::apply(
      query, key, value, attn_mask, scale, sinks, cu_seq_q, cu_seq_k, EA_ATTENTION_OPTIONS, &plain);
  return {r[0], r[1], r[2], r[3], plain[0], plain[1], plain[2], plain[3], r[4], r[5], r[6]};
}

// A row reduction with its backward op (attention_grad.h).
template <at::Tensor (*Backward)(const at::Tensor&, const at::Tensor&, int64_t)>
class RowReductionFunction : public torch::autograd::Function<RowReductionFunction<Backward>> {
 public:
  static constexpr bool is_traceable = true;  // as AttentionFunction's
  static variable_list forward(
      AutogradContext* ctx, const at::Tensor& x, int64_t dim,
      const c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, int64_t)>& op) {
    at::AutoDispatchBelowADInplaceOrView guard;
    at::Tensor y = op.call(x, dim);
    ctx->save_for_backward({x});
    ctx->saved_data["dim"] = dim;
    return {y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {Backward(grads[0], ctx->get_saved_variables()[0], saved_int(ctx, "dim")), at::Tensor(),
            at::Tensor()};
  }
};

at::Tensor entropy_autograd(const at::Tensor& p, int64_t dim) {
  static const auto op = row_reduction_op("entropy_attn::entropy");
  return RowReductionFunction<entropy_backward>::apply(p, dim, op)[0];
}
at::Tensor sparsity_autograd(const at::Tensor& a, int64_t dim) {
  static const auto op = row_reduction_op("entropy_attn::sparsity");
  return RowReductionFunction<sparsity_backward>::apply(a, dim, op)[0];
}

// A metric that is not differentiable, as torch's argmax: the op below autograd, whose outputs do
// not require grad (torch.library.opcheck's advice for such ops). A training step that logs it on
// activations then compiles; with the not-implemented fallback AOTAutograd traced its backward
// and failed even when no loss used it.
void non_differentiable(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  at::AutoDispatchBelowADInplaceOrView guard;
  op.callBoxed(stack);
}

}  // namespace

TORCH_LIBRARY_IMPL(entropy_attn, Autograd, m) {
  m.impl("attention", &attention_autograd);
  m.impl("entropy", &entropy_autograd);
  m.impl("sparsity", &sparsity_autograd);
  // No double backward: a backward that reaches attention_backward raises "the derivative ... is
  // not implemented" instead of torch's default for unregistered ops, a warning and silently zero
  // or missing gradients.
  m.impl("attention_backward", torch::autograd::autogradNotImplementedFallback());
  m.impl("attention_sparsity", torch::CppFunction::makeFromBoxedFunction<&non_differentiable>());
}

}  // namespace entropy_attn
