#include "attention_call.h"

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/isinf.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>

#include <utility>
#include <vector>

namespace entropy_attn {

AttentionOptions AttentionOptions::from_schema(bool is_causal, std::optional<double> scale_factor,
                                               c10::string_view scale_mode, double temperature,
                                               double log_base, bool enable_gqa, bool return_stats,
                                               c10::IntArrayRef window_size,
                                               c10::string_view causal_alignment, double softcap,
                                               double dropout_p, c10::SymInt dropout_seed) {
  AttentionOptions o;
  TORCH_CHECK_VALUE(window_size.size() == 2, "window_size must be (left, right), got ",
                    window_size);
  // A bound of 2^62 or more covers every key of any tensor and would overflow the range
  // arithmetic (kernel_args.h: KeyPattern::local, diag + right + 1): it is the unbounded -1.
  constexpr int64_t kUnbounded = int64_t{1} << 62;
  o.window_left = window_size[0] >= kUnbounded ? -1 : window_size[0];
  o.window_right = window_size[1] >= kUnbounded ? -1 : window_size[1];
  const std::string_view align(causal_alignment.data(), causal_alignment.size());
  TORCH_CHECK_VALUE(align == "top_left" || align == "bottom_right",
                    "causal_alignment must be 'top_left' or 'bottom_right', got '",
                    std::string(align), "'");
  o.bottom_right = align == "bottom_right";
  o.softcap = softcap;
  o.dropout_p = dropout_p;
  o.dropout_seed = std::move(dropout_seed);
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
    case ScaleMode::kLogN:
      return "logn";
    case ScaleMode::kLogNSharpen:
      return "logn_sharpen";
    case ScaleMode::kFixed:
      break;
  }
  return "fixed";
}

c10::string_view AttentionOptions::causal_alignment_name() const {
  return bottom_right ? "bottom_right" : "top_left";
}

void CallPattern::set_documents(const DocumentArgs& docs) {
  if (!docs.cu_seq_q.has_value()) return;
  auto read_by_kernels = [](const at::Tensor& t) { return element_aligned(t.contiguous()); };
  cu_q = read_by_kernels(*docs.cu_seq_q), cu_k = read_by_kernels(*docs.cu_seq_k);
  if (docs.seqused_k.has_value()) seqused_k = read_by_kernels(*docs.seqused_k);
  if (docs.key_rows.has_value()) key_rows = read_by_kernels(*docs.key_rows);
}

KeyPattern CallPattern::key_pattern() const {
  KeyPattern p = options.key_pattern();
  if (cu_q.defined()) {
    p.cu_q = cu_q.const_data_ptr<int32_t>(), p.cu_k = cu_k.const_data_ptr<int32_t>();
    p.seqused_k = seqused_k.defined() ? seqused_k.const_data_ptr<int32_t>() : nullptr;
    p.documents = cu_q.numel() - 1;
  }
  return p;
}

SymAttentionShape check_attention_call(const at::Tensor& query, const at::Tensor& key,
                                       const at::Tensor& value,
                                       const std::optional<at::Tensor>& attn_mask,
                                       const std::optional<at::Tensor>& scale,
                                       const std::optional<at::Tensor>& sinks,
                                       const DocumentArgs& docs, const AttentionOptions& options) {
  // (before the mask's shape is checked against key's rows rather than key_rows')
  TORCH_CHECK_VALUE(!docs.key_rows.has_value() || !attn_mask.has_value(),
                    "key_rows does not take attn_mask");
  SymAttentionShape s = check_attention_inputs(query, key, value, attn_mask, scale, options);
  check_sinks(sinks, s, query);
  if (docs.key_rows.has_value()) {
    check_key_rows(*docs.key_rows, key, docs.cu_seq_q.has_value(), query);
    s.kv_len = docs.key_rows->sym_size(0);
  }
  check_documents(docs.cu_seq_q, docs.cu_seq_k, docs.seqused_k, s, query,
                  docs.key_rows.has_value() ? "keys key_rows names" : "key tokens");
  return s;
}

at::Tensor gather_key_rows(const at::Tensor& x, const at::Tensor& rows) {
  // (B, heads, T, dim) -> (T, B, heads, dim): a view, whose dim 0 index_select copies block-wise
  // where the tokens hold their heads (a pool of pages)
  return x.permute({2, 0, 1, 3}).index_select(0, rows).permute({1, 2, 0, 3});
}

AttentionCall prepare_attention(const at::Tensor& query, const at::Tensor& key,
                                const at::Tensor& value, const std::optional<at::Tensor>& attn_mask,
                                const std::optional<at::Tensor>& scale,
                                const std::optional<at::Tensor>& sinks, const DocumentArgs& docs,
                                const AttentionOptions& options) {
  AttentionCall c;
  c.shape =
      concrete(check_attention_call(query, key, value, attn_mask, scale, sinks, docs, options));
  c.options = options;
  c.set_documents(docs);
  c.dtype = query.scalar_type();
  c.acc = accumulate_type(c.dtype);
  if (attn_mask.has_value()) {
    c.mask = expand_mask(*attn_mask, c.shape, c.acc, keeps_mask_dtype(*attn_mask, c.dtype));
  }
  if (scale.has_value()) c.scale = expand_scale(*scale, c.shape, c.acc);
  if (sinks.has_value()) c.sinks = element_aligned(finite_to(*sinks, c.acc).contiguous());
  return c;
}

bool pack_query_heads(AttentionCall& c, at::Tensor& query) {
  const AttentionShape s = c.shape;
  AttentionOptions& o = c.options;
  const bool unbounded = !o.causal && o.window_left < 0 && o.window_right < 0;
  const bool sees_all = unbounded || (o.bottom_right && o.window_left < 0);
  if (s.q_len != 1 || s.heads == s.kv_heads || !sees_all || c.cu_q.defined() || c.sinks.defined() ||
      o.dropout_p > 0) {
    return false;
  }
  const int64_t g = s.group();
  // Splitting the head dim and dropping the one-row dim are views whatever the strides.
  query = query.reshape({s.batch, s.kv_heads, g, s.head_dim});
  if (c.mask.has_value()) c.mask = c.mask->reshape({s.batch, s.kv_heads, g, s.kv_len});
  if (c.scale.defined()) c.scale = c.scale.reshape({s.batch, s.kv_heads, g});
  c.shape.heads = s.kv_heads, c.shape.q_len = g;
  o.causal = false, o.window_left = o.window_right = -1, o.bottom_right = false;
  return true;
}

AttentionOutputs unpack_query_heads(AttentionOutputs outputs, const AttentionShape& s) {
  auto unpack = [&](at::Tensor& t) {
    if (t.dim() == 4) {
      t = t.view({s.batch, s.heads, 1, s.v_head_dim});
    } else if (t.dim() == 3) {  // (a statistic not asked for is empty, (0,), and stays)
      t = t.view({s.batch, s.heads, 1});
    }
  };
  std::apply([&](auto&... t) { (unpack(t), ...); }, outputs);
  return outputs;
}

namespace {

// Whether a (B, H, L, D) input holds its heads inside its rows (stride(1) < stride(2), more than
// one of each): a transposed (B, L, H, D), as models split a projection into heads.
//
// Sizes unbacked under torch.compile (a length from data: unpadding by a boolean mask) are taken
// to be above 1. Where one is 0 or 1 at run time, the two layouts differ only in the stride of
// that dimension (or the tensor is empty), which no index uses and Inductor's stride checks skip;
// deciding "no" instead would give the Meta kernel contiguous strides for a call that returns
// transposed ones. An undecidable stride comparison counts as "no": right for an unbacked length,
// wrong for an unbacked head count (transposed at run time; not a case models produce). The
// comparisons are SymBools: `SymInt > int` would guard, and fail on an unbacked size.
bool heads_inside_rows(const at::Tensor& input) {
  const c10::SymIntArrayRef size = input.sym_sizes(), stride = input.sym_strides();
  return TORCH_GUARD_OR_TRUE(size[1].sym_gt(1)) && TORCH_GUARD_OR_TRUE(size[2].sym_gt(1)) &&
         TORCH_GUARD_OR_FALSE(stride[1].sym_lt(stride[2]));
}

}  // namespace

at::Tensor empty_in_layout_of(const at::Tensor& input, c10::SymIntArrayRef sizes,
                              const at::TensorOptions& options) {
  if (!heads_inside_rows(input)) return at::empty_symint(sizes, options);
  return at::empty_symint({sizes[0], sizes[2], sizes[1], sizes[3]}, options).transpose(1, 2);
}

at::Tensor in_layout_of(const at::Tensor& input, const at::Tensor& grad, at::ScalarType dtype) {
  if (!heads_inside_rows(input)) {
    // (Not to(dtype, ..., MemoryFormat::Contiguous): where the dtype already matches it returns a
    // strided grad as it is, a view of the padded buffer of head_dim_padding.cpp's unpad_grads.)
    if (grad.scalar_type() == dtype) return grad.contiguous();
    return at::empty_symint(grad.sym_sizes(), grad.options().dtype(dtype)).copy_(grad);
  }
  // (An empty tensor counts as contiguous in any strides: it is allocated anew, as the Meta
  // kernel's.)
  if (grad.scalar_type() == dtype && grad.numel() > 0 && grad.transpose(1, 2).is_contiguous()) {
    return grad;
  }
  return empty_in_layout_of(input, grad.sym_sizes(), grad.options().dtype(dtype)).copy_(grad);
}

AttentionOutputs allocate_attention_outputs(const SymAttentionShape& s, const at::Tensor& query,
                                            at::ScalarType acc, bool return_stats) {
  const auto stat = query.options().dtype(acc);
  auto row = [&] { return at::empty_symint({s.batch, s.heads, s.q_len}, stat); };
  auto stat_row = [&] { return return_stats ? row() : at::empty({0}, stat); };
  return {empty_in_layout_of(query, {s.batch, s.heads, s.q_len, s.v_head_dim}, query.options()),
          row(),
          stat_row(),
          stat_row(),
          stat_row(),
          at::empty_symint({s.batch, s.heads, s.q_len}, query.options().dtype(at::kLong)),
          row(),
          row(),
          stat_row(),
          stat_row(),
          stat_row()};
}

AttentionOutputs AttentionCall::allocate_outputs(const at::Tensor& query) const {
  return allocate_attention_outputs(symbolic(shape), query, acc, options.return_stats);
}

AttentionBackwardCall prepare_attention_backward(
    const at::Tensor& grad_output, const std::optional<at::Tensor>& grad_lse,
    const std::optional<at::Tensor>& grad_entropy, const std::optional<at::Tensor>& grad_sum_p2,
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask, const at::Tensor& output, const at::Tensor& lse,
    const at::Tensor& entropy, const at::Tensor& sum_p2, const at::Tensor& row_scale,
    const std::optional<at::Tensor>& sinks, const DocumentArgs& docs,
    const AttentionOptions& options, bool grad_mask, bool grad_scale) {
  AttentionBackwardCall c;
  const SymAttentionShape s = check_attention_backward_inputs(
      grad_output, grad_lse, grad_entropy, grad_sum_p2, query, key, value, attn_mask, output, lse,
      entropy, sum_p2, row_scale, options);
  check_sinks(sinks, s, query);
  check_documents(docs.cu_seq_q, docs.cu_seq_k, docs.seqused_k, s, query);
  check_grad_mask(attn_mask, grad_mask);
  c.shape = concrete(s);
  c.options = options;
  c.set_documents(docs);
  c.dtype = query.scalar_type();
  c.acc = accumulate_type(c.dtype);
  c.grad_row_scale = grad_scale;
  if (attn_mask.has_value()) {
    c.mask = expand_mask(*attn_mask, c.shape, c.acc, keeps_mask_dtype(*attn_mask, c.dtype));
  }
  auto row_stat = [&](const at::Tensor& t) { return element_aligned(t.to(c.acc).contiguous()); };
  auto opt_row_stat = [&](const std::optional<at::Tensor>& t) {
    return t.has_value() ? row_stat(*t) : at::Tensor();
  };
  // A forward without statistics left entropy and sum_p2 empty: they enter the backward only
  // multiplied by their (then absent) gradients, so zeros stand in.
  auto stat_or_zeros = [&](const at::Tensor& t) {
    return t.numel() == 0 && c.shape.batch * c.shape.heads * c.shape.q_len > 0
               ? at::zeros({c.shape.batch, c.shape.heads, c.shape.q_len},
                           lse.options().dtype(c.acc))
               : row_stat(t);
  };
  c.lse = row_stat(lse), c.entropy = stat_or_zeros(entropy), c.sum_p2 = stat_or_zeros(sum_p2);
  c.row_scale = row_stat(row_scale);
  c.g_lse = opt_row_stat(grad_lse), c.g_entropy = opt_row_stat(grad_entropy);
  c.g_sum_p2 = opt_row_stat(grad_sum_p2);
  if (sinks.has_value()) c.sinks = element_aligned(finite_to(*sinks, c.acc).contiguous());
  if (grad_mask) {
    // The mask's sizes, left-padded with ones to (B, H, Lq, Lk)'s rank.
    std::vector<int64_t> sizes(4 - attn_mask->dim(), 1);
    for (int64_t d : attn_mask->sizes()) sizes.push_back(d);
    c.grad_logits = at::zeros(sizes, query.options().dtype(c.acc));
  }
  return c;
}

at::Tensor row_scale_grad(at::Tensor dlam, const at::Tensor& row_scale,
                          const AttentionBackwardCall& call) {
  return call.grad_row_scale ? dlam.to(row_scale.scalar_type())
                             : at::empty({0}, row_scale.options());
}

at::Tensor mask_grad(const std::optional<at::Tensor>& attn_mask, const AttentionBackwardCall& c,
                     const at::Tensor& query) {
  if (!c.grad_logits.defined()) return at::empty({0}, query.options().dtype(c.acc));
  // The mask adds to the logits, s_ij = cap(lambda_i q_i . k_j) + m_ij: dm_ij = dS_ij, summed by
  // the kernels over the (batch, head, row, key) entries that share a mask entry.
  return c.grad_logits.view(attn_mask->sizes()).to(attn_mask->scalar_type());
}

at::Tensor sink_grad(const at::Tensor& grad_output, const at::Tensor& output,
                     const AttentionBackwardCall& c) {
  if (!c.sinks.defined()) return at::empty({0}, output.options().dtype(c.acc));
  const at::Tensor sink = c.sinks.view({1, -1, 1});
  const at::Tensor p_sink = at::exp(sink - c.lse);  // the sink's weight per row
  // D~_i (online_stats.h: row_delta) and dP~_sink = -g_H x_sink + 2 g_U p_sink, with lse the
  // reference: x_sink = s_sink - lse, and D~ holds -g_H (0 - H).
  at::Tensor delta = (grad_output.to(c.acc) * output.to(c.acc)).sum(-1);
  at::Tensor dp = at::zeros_like(p_sink);
  if (c.g_lse.defined()) delta = delta - c.g_lse;
  if (c.g_entropy.defined()) {
    delta = delta + c.g_entropy * c.entropy;
    dp = dp - c.g_entropy * (sink - c.lse);
  }
  if (c.g_sum_p2.defined()) {
    delta = delta + 2 * c.g_sum_p2 * c.sum_p2;
    dp = dp + 2 * c.g_sum_p2 * p_sink;
  }
  // A sink without weight (-inf) gets no gradient (and no 0 * inf), nor one with all of it (+inf:
  // p_sink = 1 whatever its logit, where exp(inf - inf) is NaN); a NaN sink gets NaN.
  const at::Tensor ds =
      at::where(at::isinf(sink) | (p_sink == 0), at::zeros_like(p_sink), p_sink * (dp - delta));
  return ds.sum(at::IntArrayRef{0, 2});
}

}  // namespace entropy_attn
