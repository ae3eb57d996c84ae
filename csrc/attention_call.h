// One call of the attention ops, checked and normalized once for every device.
//
// The dispatcher hands each device's kernel the schema's arguments (ops.cpp). Right after it, the
// adaptors below fold the scalar options into one AttentionOptions and build the call: the checks
// of attention_inputs.h, the mask and scale tensor expanded to their kernel views, and the outputs
// allocated on the inputs' device. The CPU, CUDA and Meta kernels all start from the same
// AttentionCall, so they accept the same inputs, raise the same errors and return the same shapes,
// and a new option touches the schema, AttentionOptions and the kernels that use it.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <optional>
#include <string_view>
#include <tuple>
#include <utility>

#include "attention_inputs.h"
#include "dropout.h"
#include "op_handles.h"

namespace entropy_attn {

// The packed documents of a call as the schema passes them: all absent for a dense call. key_rows
// (the forward's only): packed key j is row key_rows[j] of key's and value's dim 2.
struct DocumentArgs {
  std::optional<at::Tensor> cu_seq_q, cu_seq_k, seqused_k, key_rows;
};

// What the forward and the backward share of a call: the options, the packed documents (varlen)
// and the sinks, and their kernel views.
struct CallPattern {
  AttentionOptions options;
  // Packed documents (int32, contiguous): cu_seq_q, cu_seq_k and seqused_k of a varlen call, the
  // query and key tokens seen as one batch entry; undefined for a dense call.
  at::Tensor cu_q, cu_k, seqused_k;
  // The forward's key_rows (int64, contiguous), or undefined: packed key j is row key_rows[j] of
  // key's and value's dim 2 (a paged KV cache's pool of tokens). Kernels that do not read rows
  // through it get the rows gathered (attention_kernel).
  at::Tensor key_rows;
  at::Tensor sinks;  // (H,) in the accumulate type, contiguous, or undefined

  KeyPattern key_pattern() const;
  // Keeps the documents (checked: attention_inputs.h, check_documents), contiguous.
  void set_documents(const DocumentArgs& docs);
  template <typename acc_t>
  const acc_t* sink_data() const {
    return sinks.defined() ? sinks.const_data_ptr<acc_t>() : nullptr;
  }
  template <typename acc_t>
  Dropout<acc_t> dropout() const {
    return Dropout<acc_t>::make(options.dropout_p, options.dropout_seed.expect_int());
  }
};

// The checked call of `attention` (or `attention_sparsity`, whose value is its key).
struct AttentionCall : CallPattern {
  AttentionShape shape;
  at::ScalarType dtype;  // of query, key and value
  at::ScalarType acc;    // accumulate type: float64 for float64 inputs, else float32
  // Expanded to (B, H, Lq, Lk): bool, or additive in `acc` or (CUDA, attention_inputs.h:
  // keeps_mask_dtype) in the inputs' 16-bit dtype.
  std::optional<at::Tensor> mask;
  at::Tensor scale;  // the scale tensor c expanded to (B, H, Lq) in `acc`, or undefined

  // The kernel views of the mask (for the CPU kernels, which read additive masks in acc_t alone)
  // and the scale policy.
  template <typename acc_t>
  MaskArg<acc_t> mask_arg() const {
    return make_cpu_mask_arg<acc_t>(mask);
  }
  template <typename acc_t>
  ScalePolicy<acc_t> scale_policy() const {
    return make_scale_policy<acc_t>(scale, options.scale_factor, shape.head_dim, options.scale_mode,
                                    options.log_base, options.temperature);
  }
  // The op's outputs for this call (allocate_attention_outputs).
  AttentionOutputs allocate_outputs(const at::Tensor& query) const;
};

// Every check of a call of `attention` (attention_inputs.h: inputs, sinks, documents), on the
// symbolic sizes the Meta kernel sees under torch.compile; prepare_attention starts with it.
SymAttentionShape check_attention_call(const at::Tensor& query, const at::Tensor& key,
                                       const at::Tensor& value,
                                       const std::optional<at::Tensor>& attn_mask,
                                       const std::optional<at::Tensor>& scale,
                                       const std::optional<at::Tensor>& sinks,
                                       const DocumentArgs& docs, const AttentionOptions& options);

// An uninitialized (B, H, L, D) tensor of `sizes` in the layout of the (B, H, L', D') `input`, as
// SDPA's fused backends lay out their output and gradients: the transpose of a contiguous
// (B, L, H, D) when `input` holds its heads inside its rows (stride(1) < stride(2), more than one
// of each: a model's query, key or value split from a projection), so that merging the heads back
// is a view rather than a copy; else contiguous. The output follows the query, each gradient its
// input. The decision reads the symbolic sizes and strides, so the Meta kernels and the device
// kernels allocate the same strides, also for lengths unbacked under torch.compile (up to the
// strides of dimensions of size 0 or 1).
at::Tensor empty_in_layout_of(const at::Tensor& input, c10::SymIntArrayRef sizes,
                              const at::TensorOptions& options);

// `grad`, a (B, H, L, D) gradient of `input` computed in any layout, converted to `dtype` in
// input's layout (empty_in_layout_of), dense: one pass, or none where it already is.
at::Tensor in_layout_of(const at::Tensor& input, const at::Tensor& grad, at::ScalarType dtype);

// The outputs of `attention` for sizes `s`, allocated (uninitialized) on `query`'s device: output
// (B, H, Lq, Dv) in the input dtype, in the query's layout (empty_in_layout_of), the row
// statistics (B, H, Lq) in `acc` (the statistics empty without return_stats: never written), n_keys
// in int64.
AttentionOutputs allocate_attention_outputs(const SymAttentionShape& s, const at::Tensor& query,
                                            at::ScalarType acc, bool return_stats);

AttentionCall prepare_attention(const at::Tensor& query, const at::Tensor& key,
                                const at::Tensor& value, const std::optional<at::Tensor>& attn_mask,
                                const std::optional<at::Tensor>& scale,
                                const std::optional<at::Tensor>& sinks, const DocumentArgs& docs,
                                const AttentionOptions& options);

// Decoding with grouped-query attention packs the query heads of a group as the rows of one head
// (FlashAttention-2's seqlenq_ngroups_swapped). A call with one query row, H query heads on
// Hkv < H key/value heads, whose row sees every key (no causality or window, or bottom-right
// alignment with no left bound: the one row is the last), no packed documents, sinks or dropout,
// is the same call with Hkv heads of G = H / Hkv rows each, since the row's keys, n_i and so its
// scale do not depend on the row's position; its query is a (B, Hkv, G, D) view of the same
// memory and its mask and scale views split the head dim likewise. The kernels then read each
// key/value head once per group instead of once per query head, and fill G rows of a query tile
// instead of one (docs/math.md section 7). Rewrites `call` and `query` and returns true when that
// applies; the outputs, allocated for the packed shape, are the unpacked ones' memory
// (unpack_query_heads).
bool pack_query_heads(AttentionCall& call, at::Tensor& query);
// The outputs of a packed call viewed in the call's own shape (B, H, 1, ...).
AttentionOutputs unpack_query_heads(AttentionOutputs outputs, const AttentionShape& shape);

// The checked call of `attention_backward`: the row statistics and the upstream statistic
// gradients in the accumulate type, contiguous (undefined when absent), the mask expanded.
struct AttentionBackwardCall : CallPattern {
  AttentionShape shape;
  at::ScalarType dtype, acc;
  std::optional<at::Tensor> mask;  // as AttentionCall's
  at::Tensor lse, entropy, sum_p2, row_scale, g_lse, g_entropy, g_sum_p2;
  // With grad_mask: the additive mask's gradient, the sum of dS_ij before the softcap over the
  // logits that share each mask entry, in `acc`, zero-filled, with the mask's sizes (left-padded to
  // 4 dims), so that a mask broadcast along the batch or the heads needs no (B, H, Lq, Lk) buffer;
  // the kernels add the entries of the keys each row sees, through logit_grad_arg(). Undefined
  // otherwise.
  at::Tensor grad_logits;
  // grad_scale: d lambda (grad_row_scale) is asked for; else the kernels skip it and return it
  // empty.
  bool grad_row_scale = true;

  // grad_logits, or `into` (a tensor of its sizes, as a wider accumulator), seen as (B, H, Lq,
  // Lk): stride 0 along the dims the mask broadcasts along.
  template <typename acc_t>
  LogitGradArg<acc_t> logit_grad_arg(const at::Tensor& into = {}) const {
    LogitGradArg<acc_t> g;
    const at::Tensor& sums = into.defined() ? into : grad_logits;
    if (!sums.defined()) return g;
    const at::Tensor t = sums.expand({shape.batch, shape.heads, shape.q_len, shape.kv_len});
    g.data = sums.data_ptr<acc_t>();
    g.sb = t.stride(0), g.sh = t.stride(1), g.si = t.stride(2), g.sj = t.stride(3);
    return g;
  }
};

AttentionBackwardCall prepare_attention_backward(
    const at::Tensor& grad_output, const std::optional<at::Tensor>& grad_lse,
    const std::optional<at::Tensor>& grad_entropy, const std::optional<at::Tensor>& grad_sum_p2,
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask, const at::Tensor& output, const at::Tensor& lse,
    const at::Tensor& entropy, const at::Tensor& sum_p2, const at::Tensor& row_scale,
    const std::optional<at::Tensor>& sinks, const DocumentArgs& docs,
    const AttentionOptions& options, bool grad_mask, bool grad_scale);

// The gradient of the additive mask `attn_mask` from the call's grad_logits, with its shape and
// dtype; empty without grad_mask.
at::Tensor mask_grad(const std::optional<at::Tensor>& attn_mask, const AttentionBackwardCall& call,
                     const at::Tensor& query);

// The gradient of row_scale: the implementation's d lambda in row_scale's dtype, or empty (that
// dtype, its device) where the call does not ask for it (grad_scale).
at::Tensor row_scale_grad(at::Tensor dlam, const at::Tensor& row_scale,
                          const AttentionBackwardCall& call);

// The gradient of the sinks (H,) from the backward's row quantities (docs/math.md section 6):
// the sink is one more softmax entry whose value is 0, so its logit gradient follows the same
// FlashAttention-2 form as the keys', dS = p_sink (dP~_sink - D~_i) with dP_sink = 0; undefined
// without sinks.
at::Tensor sink_grad(const at::Tensor& grad_output, const at::Tensor& output,
                     const AttentionBackwardCall& call);

// The dispatcher-facing kernel of `attention_backward` for a device implementation
//   std::tuple<...> impl(const at::Tensor& grad_output, const at::Tensor& query,
//                        const at::Tensor& key, const at::Tensor& value, const at::Tensor& output,
//                        const AttentionBackwardCall& call);
// returning (grad_query, grad_key, grad_value, d lambda in the accumulate type, undefined where
// call.grad_row_scale is false) and writing call.grad_logits when it is defined; the adaptor adds
// grad_sinks and grad_attn_mask, and forms grad_row_scale (row_scale_grad).
using AttentionGrads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
template <AttentionGrads (*Impl)(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, const at::Tensor&,
                                 const AttentionBackwardCall&)>
AttentionBackwardOutputs attention_backward_kernel(
    const at::Tensor& grad_output, const std::optional<at::Tensor>& grad_lse,
    const std::optional<at::Tensor>& grad_entropy, const std::optional<at::Tensor>& grad_sum_p2,
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask, const at::Tensor& output, const at::Tensor& lse,
    const at::Tensor& entropy, const at::Tensor& sum_p2, const at::Tensor& row_scale,
    bool is_causal, c10::IntArrayRef window_size, c10::string_view causal_alignment, double softcap,
    const std::optional<at::Tensor>& sinks, double dropout_p, c10::SymInt dropout_seed,
    const std::optional<at::Tensor>& cu_seq_q, const std::optional<at::Tensor>& cu_seq_k,
    const std::optional<at::Tensor>& seqused_k, bool grad_mask, bool grad_scale) {
  AttentionOptions options = AttentionOptions::from_schema(
      is_causal, std::nullopt, "fixed", 1.0, 512.0, /*enable_gqa=*/true, /*return_stats=*/true,
      window_size, causal_alignment, softcap, dropout_p, dropout_seed);
  const AttentionBackwardCall call = prepare_attention_backward(
      grad_output, grad_lse, grad_entropy, grad_sum_p2, query, key, value, attn_mask, output, lse,
      entropy, sum_p2, row_scale, sinks, {cu_seq_q, cu_seq_k, seqused_k, std::nullopt}, options,
      grad_mask, grad_scale);
  auto [dq, dk, dv, dlam] = Impl(grad_output, query, key, value, output, call);
  return {dq,
          dk,
          dv,
          row_scale_grad(std::move(dlam), row_scale, call),
          sink_grad(grad_output, output, call),
          mask_grad(attn_mask, call, query)};
}

// The parameters of `attention` with the schema's names (ops.cpp), for the kernels that take them
// all (attention_kernel below, the autograd and Meta kernels), and the scalar ones among them
// folded into AttentionOptions.
#define EA_ATTENTION_PARAMS                                                                        \
  const at::Tensor &query, const at::Tensor &key, const at::Tensor &value,                         \
      const OptTensor &attn_mask, const OptTensor &scale, bool is_causal,                          \
      std::optional<double> scale_factor, c10::string_view scale_mode, double temperature,         \
      double log_base, bool enable_gqa, bool return_stats, c10::IntArrayRef window_size,           \
      c10::string_view causal_alignment, double softcap, const OptTensor &sinks, double dropout_p, \
      c10::SymInt dropout_seed, const OptTensor &cu_seq_q, const OptTensor &cu_seq_k,              \
      const OptTensor &seqused_k, const OptTensor &key_rows
#define EA_ATTENTION_OPTIONS                                                                      \
  AttentionOptions::from_schema(is_causal, scale_factor, scale_mode, temperature, log_base,       \
                                enable_gqa, return_stats, window_size, causal_alignment, softcap, \
                                dropout_p, dropout_seed)

// Rows `rows` (int64) of x's dim 2, (B, heads, rows, dim): one copy of each row's (heads, dim)
// block where x's heads sit inside its rows (a pool of tokens (T, heads, dim) seen as (1, heads, T,
// dim)).
at::Tensor gather_key_rows(const at::Tensor& x, const at::Tensor& rows);

// The dispatcher-facing kernel of `attention` for a device implementation
//   AttentionOutputs impl(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
//                         const AttentionCall& call);
// registered as m.impl("attention", &attention_kernel<impl>). An implementation that reads the
// keys through call.key_rows itself says so (kReadsKeyRows); the others get them gathered.
template <AttentionOutputs (*Impl)(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const AttentionCall&),
          bool kReadsKeyRows = false>
AttentionOutputs attention_kernel(EA_ATTENTION_PARAMS) {
  const AttentionOptions options = EA_ATTENTION_OPTIONS;
  AttentionCall call = prepare_attention(query, key, value, attn_mask, scale, sinks,
                                         {cu_seq_q, cu_seq_k, seqused_k, key_rows}, options);
  if (!kReadsKeyRows && call.key_rows.defined()) {
    const at::Tensor rows = std::move(call.key_rows);
    call.key_rows = at::Tensor();
    return Impl(query, gather_key_rows(key, rows), gather_key_rows(value, rows), call);
  }
  const AttentionShape shape = call.shape;
  at::Tensor q = query;
  if (!pack_query_heads(call, q)) return Impl(query, key, value, call);
  return unpack_query_heads(Impl(q, key, value, call), shape);
}

// The same for `attention_sparsity` (no value: the key stands in for it), with the kind of f.
template <at::Tensor (*Impl)(const at::Tensor&, const at::Tensor&, SparsityKind,
                             const AttentionCall&)>
at::Tensor attention_sparsity_kernel(const at::Tensor& query, const at::Tensor& key,
                                     const std::optional<at::Tensor>& attn_mask,
                                     const std::optional<at::Tensor>& scale, c10::string_view kind,
                                     bool is_causal, std::optional<double> scale_factor,
                                     c10::string_view scale_mode, double temperature,
                                     double log_base, bool enable_gqa, c10::IntArrayRef window_size,
                                     c10::string_view causal_alignment, double softcap) {
  const AttentionOptions options = AttentionOptions::from_schema(
      is_causal, scale_factor, scale_mode, temperature, log_base, enable_gqa,
      /*return_stats=*/true, window_size, causal_alignment, softcap, 0.0, 0);
  const AttentionCall call =
      prepare_attention(query, key, key, attn_mask, scale, std::nullopt, {}, options);
  return Impl(query, key, parse_sparsity_kind(kind), call);
}

// Calls `attention` through the dispatcher with `options` (autograd and the C++ API).
inline AttentionOutputs call_attention(const at::Tensor& query, const at::Tensor& key,
                                       const at::Tensor& value, const OptTensor& attn_mask,
                                       const OptTensor& scale, const OptTensor& sinks,
                                       const DocumentArgs& docs, const AttentionOptions& o) {
  const std::array<int64_t, 2> window = o.window_size();
  return attention_op().call(query, key, value, attn_mask, scale, o.causal, o.scale_factor,
                             o.scale_mode_name(), o.temperature, o.log_base, o.enable_gqa,
                             o.return_stats, window, o.causal_alignment_name(), o.softcap, sinks,
                             o.dropout_p, o.dropout_seed, docs.cu_seq_q, docs.cu_seq_k,
                             docs.seqused_k, docs.key_rows);
}

// Calls `attention_backward` through the dispatcher with the options of the forward (and the
// mask's gradient with grad_mask, d lambda with grad_scale).
inline AttentionBackwardOutputs call_attention_backward(
    const at::Tensor& grad_output, const OptTensor& grad_lse, const OptTensor& grad_entropy,
    const OptTensor& grad_sum_p2, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const OptTensor& attn_mask, const at::Tensor& output,
    const at::Tensor& lse, const at::Tensor& entropy, const at::Tensor& sum_p2,
    const at::Tensor& row_scale, const OptTensor& sinks, const DocumentArgs& docs,
    const AttentionOptions& o, bool grad_mask = false, bool grad_scale = true) {
  const std::array<int64_t, 2> window = o.window_size();
  return attention_backward_op().call(grad_output, grad_lse, grad_entropy, grad_sum_p2, query, key,
                                      value, attn_mask, output, lse, entropy, sum_p2, row_scale,
                                      o.causal, window, o.causal_alignment_name(), o.softcap, sinks,
                                      o.dropout_p, o.dropout_seed, docs.cu_seq_q, docs.cu_seq_k,
                                      docs.seqused_k, grad_mask, grad_scale);
}

}  // namespace entropy_attn
