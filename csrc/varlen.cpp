// varlen_attention: attention over packed sequences in the layout of
// torch.nn.attention.varlen.varlen_attn, as a composite of `attention` with packed documents.
//
// The packed (T, H, D) tensors are the dense op's (1, H, T, D) views (a transpose, no copy), and
// cu_seq_q / cu_seq_k tell the kernels where each document's rows and keys are (KeyPattern), so
// one set of kernels, one autograd function and one Meta kernel serve both layouts. Registered as
// CompositeImplicitAutograd: it differentiates and traces through `attention`. A paged KV cache
// (block_table) becomes packed documents first (paged_kv.h).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <tuple>

#include "attention_call.h"
#include "attention_inputs.h"
#include "paged_kv.h"

namespace entropy_attn {
namespace {

void check_packed(const at::Tensor& x, const char* name, const char* layout) {
  TORCH_CHECK_TYPE(x.defined(), name, " must be a tensor, got None");  // (None from torch.ops)
  TORCH_CHECK_VALUE(x.dim() == 3, name, " must be a 3-D packed tensor ", layout, ", got ", x.dim(),
                    "-D of shape ", x.sizes());
}

// max_q and max_k must cover every sequence (varlen_attn's contract; our kernels do not need
// them, but a caller whose max is too small has wrong offsets or a wrong max, and should hear so).
void check_max_len(const at::Tensor& cu, const c10::SymInt& max, const char* cu_name,
                   const char* max_name) {
  TORCH_CHECK_VALUE(max >= 0, max_name, " must be >= 0, got ", max);
  // No values to read under fake tensors (torch.compile, opcheck) or on the Meta device; else
  // max is a plain int.
  if (!values_readable(cu)) return;
  const int64_t max_len = max.expect_int();
  if (cu.scalar_type() != at::kInt || cu.dim() != 1 || cu.numel() < 2) return;
  const at::Tensor c = cu.to(at::kCPU).contiguous();  // a strided view's values are not at p + d
  const int32_t* p = c.const_data_ptr<int32_t>();
  for (int64_t d = 0; d + 1 < c.numel(); ++d) {
    // (in int64: the difference of two int32 offsets may not fit int32; bad offsets are
    // reported by the documents' own check)
    const int64_t length = static_cast<int64_t>(p[d + 1]) - p[d];
    TORCH_CHECK_VALUE(length <= max_len, max_name, " = ", max_len, " is smaller than sequence ", d,
                      " of ", cu_name, ", of length ", length);
  }
}

// (T, H, ...) -> (1, H, T, ...), a view.
at::Tensor dense_view(const at::Tensor& x) { return x.transpose(0, 1).unsqueeze(0); }

// (1, H, T, ...) -> (T, H, ...), contiguous; empty statistics (return_stats=False) stay empty.
at::Tensor packed(const at::Tensor& x) {
  if (x.dim() < 3) return x;
  return x.squeeze(0).transpose(0, 1).contiguous();
}

// Decoding with grouped-query attention over packed sequences, as pack_query_heads does for a
// dense call (attention_call.h): where every row sees all of its sequence's keys and nothing is
// per query head (no sinks, no dropout), the G = H / Hkv query heads of a group become G rows of
// their key/value head, so that the kernels read each key/value head's keys once per group
// instead of once per query head, and a tile holds G rows of a sequence instead of one. Row
// t G + g of key/value head k is query head k G + g of token t, so that sequence d's rows are
// [G cu_seq_q[d], G cu_seq_q[d + 1]). Every row sees its sequence's keys without causality or a
// window, and with bottom-right alignment and no left bound where each sequence has one query
// row (its last: decoding), which needs max_q <= 1 checked against the offsets (check_max_len),
// so not while torch.compile traces. Returns G, or 1 (not packed).
c10::SymInt query_head_rows(const at::Tensor& query, const at::Tensor& key,
                            const at::Tensor& cu_seq_q, const AttentionOptions& o,
                            const c10::SymInt& max_q, bool has_sinks) {
  const c10::SymInt &heads = query.sym_size(1), &kv_heads = key.sym_size(1);
  // (the sizes and max_q are compared last: each comparison is a guard while torch.compile traces)
  if (!o.enable_gqa || has_sinks || o.dropout_p > 0 || o.window_left != -1) return 1;
  const bool unbounded = !o.causal && o.window_right == -1;
  if (!unbounded && !(values_readable(cu_seq_q) && max_q <= 1)) return 1;
  if (heads == 0 || kv_heads == 0 || heads == kv_heads || heads % kv_heads != 0) return 1;
  const c10::SymInt group = heads / kv_heads;
  // (the rows' offsets are int32)
  if (query.sym_size(0) * group > std::numeric_limits<int32_t>::max()) return 1;
  return group;
}

// (T, H, ...) -> (T G, H / G, ...): row t G + g of head k is head k G + g of token t (a copy).
at::Tensor heads_to_rows(const at::Tensor& x, const c10::SymInt& group) {
  const c10::SymInt kv_heads = x.sym_size(1) / group;
  return x.unflatten_symint(1, {kv_heads, group}).transpose(1, 2).flatten(0, 1);
}

// The inverse, (T G, Hkv, ...) -> (T, Hkv G, ...); an empty statistic (return_stats=False) stays.
at::Tensor rows_to_heads(const at::Tensor& x, const c10::SymInt& group) {
  if (x.dim() < 2) return x;
  return x.unflatten_symint(0, {x.sym_size(0) / group, group}).transpose(1, 2).flatten(1, 2);
}

// (Not named varlen_attention: the C++ API's entropy_attn::varlen_attention, entropy_attn.h, is in
// the same translation unit when the build compiles this directory's files as one.)
AttentionOutputs packed_attention(const at::Tensor& query, const at::Tensor& key,
                                  const at::Tensor& value, const at::Tensor& cu_seq_q,
                                  const std::optional<at::Tensor>& cu_seq_k, c10::SymInt max_q,
                                  c10::SymInt max_k, const std::optional<at::Tensor>& scale,
                                  const std::optional<at::Tensor>& seqused_k, bool is_causal,
                                  std::optional<double> scale_factor, c10::string_view scale_mode,
                                  double temperature, double log_base, bool enable_gqa,
                                  bool return_stats, c10::IntArrayRef window_size, double softcap,
                                  const std::optional<at::Tensor>& sinks, double dropout_p,
                                  c10::SymInt dropout_seed,
                                  const std::optional<at::Tensor>& block_table) {
  check_packed(query, "query", "(total_q, heads, head_dim)");
  check_max_len(cu_seq_q, max_q, "cu_seq_q", "max_q");
  // The keys as packed documents: as given, or gathered from the pages of a paged KV cache.
  at::Tensor packed_key = key, packed_value = value;
  std::optional<at::Tensor> packed_cu_k = cu_seq_k;
  if (block_table.has_value()) {
    PagedKeys paged =
        gather_pages(query, key, value, cu_seq_q, cu_seq_k, *block_table, seqused_k, max_k);
    packed_key = std::move(paged.key), packed_value = std::move(paged.value);
    packed_cu_k = std::move(paged.cu_seq_k);
  } else {
    TORCH_CHECK_TYPE(cu_seq_k.has_value(),
                     "cu_seq_k must be an int32 tensor, got None (None only with block_table, "
                     "a paged KV cache)");
    check_packed(key, "key", "(total_k, kv_heads, head_dim)");
    check_packed(value, "value", "(total_k, kv_heads, v_head_dim)");
    check_max_len(*cu_seq_k, max_k, "cu_seq_k", "max_k");
  }
  std::optional<at::Tensor> rows_scale;  // the scale tensor as (T, H)
  if (scale.has_value()) {
    const at::Tensor& c = *scale;
    const c10::SymInt &total = query.sym_size(0), &heads = query.sym_size(1);
    TORCH_CHECK_VALUE(c.dim() <= 2 &&
                          (c.dim() < 2 || c.sym_size(0) == 1 || c.sym_size(0) == total) &&
                          (c.dim() < 1 || c.sym_size(-1) == 1 || c.sym_size(-1) == heads),
                      kScaleTensorName, " of shape ", c.sym_sizes(),
                      " does not broadcast to (total_q, heads) = (", total, ", ", heads, ")");
    rows_scale = c.expand_symint({total, heads});
  }
  AttentionOptions options = AttentionOptions::from_schema(
      is_causal, scale_factor, scale_mode, temperature, log_base, enable_gqa, return_stats,
      window_size, "bottom_right", softcap, dropout_p, dropout_seed);
  check_pattern_options(options);  // (before packing rewrites the window)
  const c10::SymInt group =
      query_head_rows(query, packed_key, cu_seq_q, options, max_q, sinks.has_value());
  at::Tensor rows_query = query, rows_cu_q = cu_seq_q;
  if (group != 1) {
    // (checked in the call's own shape first: the errors name the offsets as given)
    const SymAttentionShape shape{1,
                                  query.sym_size(1),
                                  packed_key.sym_size(1),
                                  query.sym_size(0),
                                  packed_key.sym_size(0),
                                  query.sym_size(2),
                                  packed_value.sym_size(2)};
    check_documents(cu_seq_q, packed_cu_k, seqused_k, shape, query);
    rows_query = heads_to_rows(query, group);
    if (rows_scale.has_value()) rows_scale = heads_to_rows(*rows_scale, group);
    rows_cu_q = cu_seq_q.mul(c10::Scalar(group));
    // (every row sees all of its sequence's keys)
    options.causal = false, options.window_left = options.window_right = -1;
  }
  std::optional<at::Tensor> dense_scale;
  if (rows_scale.has_value()) dense_scale = rows_scale->transpose(0, 1).unsqueeze(0);
  auto outputs = call_attention(dense_view(rows_query), dense_view(packed_key),
                                dense_view(packed_value), std::nullopt, dense_scale, sinks,
                                {rows_cu_q, packed_cu_k, seqused_k}, options);
  std::apply([&](auto&... t) { ((t = packed(t)), ...); }, outputs);
  if (group != 1) std::apply([&](auto&... t) { ((t = rows_to_heads(t, group)), ...); }, outputs);
  return outputs;
}

}  // namespace

TORCH_LIBRARY_IMPL(entropy_attn, CompositeImplicitAutograd, m) {
  m.impl("varlen_attention", &packed_attention);
}

}  // namespace entropy_attn
