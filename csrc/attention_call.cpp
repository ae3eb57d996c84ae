#include "attention_call.h"

#include <ATen/ATen.h>

namespace entropy_attn {

AttentionOptions AttentionOptions::from_schema(bool is_causal, std::optional<double> scale_factor,
                                               c10::string_view scale_mode, double temperature,
                                               double log_base, bool enable_gqa,
                                               bool return_stats) {
  AttentionOptions o;
  o.causal = is_causal;
  o.scale_factor = scale_factor;
  o.scale_mode = parse_scale_mode(std::string_view(scale_mode.data(), scale_mode.size()));
  o.temperature = temperature;
  o.log_base = log_base;
  o.enable_gqa = enable_gqa;
  o.return_stats = return_stats;
  return o;
}

c10::string_view AttentionOptions::scale_mode_name() const {
  switch (scale_mode) {
    case ScaleMode::kLogN: return "logn";
    case ScaleMode::kLogNSharpen: return "logn_sharpen";
    case ScaleMode::kFixed: break;
  }
  return "fixed";
}

AttentionCall prepare_attention(const at::Tensor& query, const at::Tensor& key,
                                const at::Tensor& value, const std::optional<at::Tensor>& attn_mask,
                                const std::optional<at::Tensor>& scale,
                                const AttentionOptions& options) {
  AttentionCall c;
  c.shape = check_attention_inputs(query, key, value, attn_mask, scale, options);
  c.options = options;
  c.dtype = query.scalar_type();
  c.acc = accumulate_type(c.dtype);
  if (attn_mask.has_value()) c.mask = expand_mask(*attn_mask, c.shape, c.acc);
  if (scale.has_value()) c.scale = expand_scale(*scale, c.shape, c.acc);
  return c;
}

AttentionOutputs AttentionCall::allocate_outputs(const at::Tensor& query) const {
  const AttentionShape& s = shape;
  const auto stat = query.options().dtype(acc);
  auto row = [&] { return at::empty({s.batch, s.heads, s.q_len}, stat); };
  // A statistic the call did not ask for: empty, and never written.
  auto stat_row = [&] { return options.return_stats ? row() : at::empty({0}, stat); };
  return {at::empty({s.batch, s.heads, s.q_len, s.v_head_dim}, query.options()),
          row(),
          stat_row(),
          stat_row(),
          stat_row(),
          at::empty({s.batch, s.heads, s.q_len}, query.options().dtype(at::kLong)),
          row(),
          row(),
          stat_row(),
          stat_row(),
          stat_row()};
}

AttentionBackwardCall prepare_attention_backward(
    const at::Tensor& grad_output, const std::optional<at::Tensor>& grad_lse,
    const std::optional<at::Tensor>& grad_entropy, const std::optional<at::Tensor>& grad_sum_p2,
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask, const at::Tensor& output, const at::Tensor& lse,
    const at::Tensor& entropy, const at::Tensor& sum_p2, const at::Tensor& row_scale,
    bool is_causal) {
  AttentionBackwardCall c;
  c.shape = check_attention_backward_inputs(grad_output, grad_lse, grad_entropy, grad_sum_p2, query,
                                            key, value, attn_mask, output, lse, entropy, sum_p2,
                                            row_scale);
  c.causal = is_causal;
  c.dtype = query.scalar_type();
  c.acc = accumulate_type(c.dtype);
  c.row_scale_dtype = row_scale.scalar_type();
  if (attn_mask.has_value()) c.mask = expand_mask(*attn_mask, c.shape, c.acc);
  auto row_stat = [&](const at::Tensor& t) { return t.to(c.acc).contiguous(); };
  auto opt_row_stat = [&](const std::optional<at::Tensor>& t) {
    return t.has_value() ? row_stat(*t) : at::Tensor();
  };
  // A forward without statistics left entropy and sum_p2 empty: they enter the backward only
  // multiplied by their (then absent) gradients, so zeros stand in.
  auto stat_or_zeros = [&](const at::Tensor& t) {
    return t.numel() == 0 && c.shape.batch * c.shape.heads * c.shape.q_len > 0
               ? at::zeros({c.shape.batch, c.shape.heads, c.shape.q_len}, lse.options().dtype(c.acc))
               : row_stat(t);
  };
  c.lse = row_stat(lse), c.entropy = stat_or_zeros(entropy), c.sum_p2 = stat_or_zeros(sum_p2);
  c.row_scale = row_stat(row_scale);
  c.g_lse = opt_row_stat(grad_lse), c.g_entropy = opt_row_stat(grad_entropy);
  c.g_sum_p2 = opt_row_stat(grad_sum_p2);
  return c;
}

}  // namespace entropy_attn
