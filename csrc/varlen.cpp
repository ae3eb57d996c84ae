// varlen_attention: attention over packed sequences in the layout of
// torch.nn.attention.varlen.varlen_attn, as a composite of `attention` with packed documents.
//
// The packed (T, H, D) tensors are the dense op's (1, H, T, D) views (a transpose, no copy), and
// cu_seq_q / cu_seq_k tell the kernels where each document's rows and keys are (KeyPattern), so
// one set of kernels, one autograd function and one Meta kernel serve both layouts. Registered as
// CompositeImplicitAutograd: it differentiates and traces through `attention`. A paged KV cache
// (block_table) becomes packed documents first (paged_kv.h). num_splits = 1 runs each sequence as
// a call of its own (batch invariance: sequence_by_sequence).
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

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
// Only offsets that partition the `tokens` rows are measured: others (not starting at 0,
// decreasing, not ending at the token count) are reported as such by the documents' own check
// (attention_inputs.h: check_documents), not as a sequence longer than the max.
void check_max_len(const at::Tensor& cu, const c10::SymInt& max, const c10::SymInt& tokens,
                   const char* cu_name, const char* max_name) {
  TORCH_CHECK_VALUE(max >= 0, max_name, " must be >= 0, got ", max);
  // No values to read under fake tensors (torch.compile, opcheck) or on the Meta device; else
  // max is a plain int.
  if (!values_readable(cu)) return;
  const int64_t max_len = max.expect_int();
  if (cu.scalar_type() != at::kInt || cu.dim() != 1 || cu.numel() < 2) return;
  const at::Tensor c = cu.to(at::kCPU).contiguous();  // a strided view's values are not at p + d
  const int32_t* p = c.const_data_ptr<int32_t>();
  const int64_t n = c.numel() - 1;
  const std::optional<int64_t> total = tokens.maybe_as_int();
  if (p[0] != 0 || (total.has_value() && p[n] != *total)) return;
  for (int64_t d = 0; d < n; ++d) {
    if (p[d + 1] < p[d]) return;
  }
  for (int64_t d = 0; d < n; ++d) {
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

// The dense shape of a packed call (batch 1), for the checks of its documents: its keys are
// key's tokens, or with key_rows the rows it names.
SymAttentionShape packed_shape(const at::Tensor& query, const at::Tensor& key,
                               const at::Tensor& value,
                               const std::optional<at::Tensor>& key_rows = std::nullopt) {
  return {1,
          query.sym_size(1),
          key.sym_size(1),
          query.sym_size(0),
          key_rows.has_value() ? key_rows->sym_size(0) : key.sym_size(0),
          query.sym_size(2),
          value.sym_size(2)};
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

// The packed call once its keys are packed documents (key's tokens, or with key_rows the tokens
// it names) and its options are checked: the kernels on the dense views, with GQA decoding's query
// heads as rows (query_head_rows).
AttentionOutputs run_packed(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const at::Tensor& cu_seq_q, const std::optional<at::Tensor>& cu_seq_k,
                            const c10::SymInt& max_q, std::optional<at::Tensor> rows_scale,
                            const std::optional<at::Tensor>& seqused_k,
                            const std::optional<at::Tensor>& sinks, AttentionOptions options,
                            const std::optional<at::Tensor>& key_rows = std::nullopt) {
  const c10::SymInt group =
      query_head_rows(query, key, cu_seq_q, options, max_q, sinks.has_value());
  at::Tensor rows_query = query, rows_cu_q = cu_seq_q;
  if (group != 1) {
    // (checked in the call's own shape first: the errors name the offsets as given)
    check_documents(cu_seq_q, cu_seq_k, seqused_k, packed_shape(query, key, value, key_rows),
                    query);
    rows_query = heads_to_rows(query, group);
    if (rows_scale.has_value()) rows_scale = heads_to_rows(*rows_scale, group);
    rows_cu_q = cu_seq_q.mul(c10::Scalar(group));
    // (every row sees all of its sequence's keys)
    options.causal = false, options.window_left = options.window_right = -1;
  }
  std::optional<at::Tensor> dense_scale;
  if (rows_scale.has_value()) dense_scale = rows_scale->transpose(0, 1).unsqueeze(0);
  auto outputs =
      call_attention(dense_view(rows_query), dense_view(key), dense_view(value), std::nullopt,
                     dense_scale, sinks, {rows_cu_q, cu_seq_k, seqused_k, key_rows}, options);
  std::apply([&](auto&... t) { ((t = packed(t)), ...); }, outputs);
  if (group != 1) std::apply([&](auto&... t) { ((t = rows_to_heads(t, group)), ...); }, outputs);
  return outputs;
}

// A sequence's rows or keys [begin, end) of a packed tensor, contiguous at an address aligned as
// a fresh tensor's: the kernels' choices may depend on their operands' strides and alignment
// (bfloat16 products on the CPU need even row strides; the CUDA tensor-core families 16-byte
// rows), which must not vary with where the sequence is packed. A slice of a contiguous packed
// tensor at an aligned address is used in place.
at::Tensor sequence_slice(const at::Tensor& x, int64_t begin, int64_t end) {
  const at::Tensor s = x.slice(0, begin, end);
  constexpr uintptr_t kAlignment = 64;  // (a cache line; CUDA's allocator aligns to 512 bytes)
  const bool aligned = reinterpret_cast<uintptr_t>(s.const_data_ptr()) % kAlignment == 0;
  return (aligned && s.is_contiguous()) || s.numel() == 0 ? s
                                                          : s.clone(at::MemoryFormat::Contiguous);
}

// Output i of each sequence's call, concatenated along the tokens (an empty statistic of a call
// without return_stats stays empty).
template <size_t I>
at::Tensor concatenated(const std::vector<AttentionOutputs>& parts) {
  std::vector<at::Tensor> pieces;
  pieces.reserve(parts.size());
  for (const AttentionOutputs& p : parts) pieces.push_back(std::get<I>(p));
  return pieces.front().dim() < 2 ? pieces.front() : at::cat(pieces, 0);
}

template <size_t... I>
AttentionOutputs concatenated(const std::vector<AttentionOutputs>& parts,
                              std::index_sequence<I...>) {
  return {concatenated<I>(parts)...};
}

// num_splits = 1 (varlen_attn's batch invariance): each sequence runs as a call of its own, so
// that its result depends on its own tokens and the options only, bitwise, whatever else is
// packed with it. In one call the kernels' choices follow the whole call (the CPU kernels' key
// source and product, key blocks and query tiles; CUDA's split-KV count and family, and its guard,
// which recomputes the whole call when a value comes out non-finite). One call per sequence, and
// the offsets read on the host (as check_documents does).
AttentionOutputs sequence_by_sequence(const at::Tensor& query, const at::Tensor& key,
                                      const at::Tensor& value, const at::Tensor& cu_seq_q,
                                      const at::Tensor& cu_seq_k,
                                      const std::optional<at::Tensor>& rows_scale,
                                      const std::optional<at::Tensor>& seqused_k,
                                      const std::optional<at::Tensor>& sinks,
                                      const AttentionOptions& options) {
  const at::Tensor cq = cu_seq_q.to(at::kCPU).contiguous(), ck = cu_seq_k.to(at::kCPU).contiguous();
  const int32_t *q = cq.const_data_ptr<int32_t>(), *k = ck.const_data_ptr<int32_t>();
  const int64_t sequences = cq.numel() - 1;
  // Each sequence's own offsets, [0, rows] and [0, keys], moved to the device in one copy.
  at::Tensor bounds = at::zeros({sequences, 2, 2}, cu_seq_q.options().device(at::kCPU));
  int32_t* b = bounds.mutable_data_ptr<int32_t>();
  for (int64_t d = 0; d < sequences; ++d) {
    b[4 * d + 1] = q[d + 1] - q[d];
    b[4 * d + 3] = k[d + 1] - k[d];
  }
  bounds = bounds.to(cu_seq_q.device());
  std::vector<AttentionOutputs> parts;
  parts.reserve(sequences);
  for (int64_t d = 0; d < sequences; ++d) {
    std::optional<at::Tensor> scale_d, used_d;
    if (rows_scale.has_value()) scale_d = sequence_slice(*rows_scale, q[d], q[d + 1]);
    if (seqused_k.has_value()) used_d = seqused_k->slice(0, d, d + 1);
    parts.push_back(run_packed(sequence_slice(query, q[d], q[d + 1]),
                               sequence_slice(key, k[d], k[d + 1]),
                               sequence_slice(value, k[d], k[d + 1]), bounds[d][0], bounds[d][1],
                               q[d + 1] - q[d], scale_d, used_d, sinks, options));
  }
  return concatenated(parts, std::make_index_sequence<std::tuple_size_v<AttentionOutputs>>{});
}

// (Not named varlen_attention: the C++ API's entropy_attn::varlen_attention, entropy_attn.h, is in
// the same translation unit when the build compiles this directory's files as one.)
AttentionOutputs packed_attention(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const at::Tensor& cu_seq_q, const std::optional<at::Tensor>& cu_seq_k, c10::SymInt max_q,
    c10::SymInt max_k, const std::optional<at::Tensor>& scale,
    const std::optional<at::Tensor>& seqused_k, bool is_causal, std::optional<double> scale_factor,
    c10::string_view scale_mode, double temperature, double log_base, bool enable_gqa,
    bool return_stats, c10::IntArrayRef window_size, double softcap,
    const std::optional<at::Tensor>& sinks, double dropout_p, c10::SymInt dropout_seed,
    const std::optional<at::Tensor>& block_table, std::optional<int64_t> num_splits) {
  check_packed(query, "query", "(total_q, heads, head_dim)");
  check_max_len(cu_seq_q, max_q, query.sym_size(0), "cu_seq_q", "max_q");
  // The keys as packed documents: as given, or from the pages of a paged KV cache (gathered, or
  // left there and named by key_rows; gathered for num_splits=1, whose calls take slices).
  at::Tensor packed_key = key, packed_value = value;
  std::optional<at::Tensor> packed_cu_k = cu_seq_k, key_rows;
  if (block_table.has_value()) {
    PagedKeys paged = gather_pages(query, key, value, cu_seq_q, cu_seq_k, *block_table, seqused_k,
                                   max_k, /*in_place=*/!num_splits.has_value());
    packed_key = std::move(paged.key), packed_value = std::move(paged.value);
    packed_cu_k = std::move(paged.cu_seq_k), key_rows = std::move(paged.key_rows);
  } else {
    TORCH_CHECK_TYPE(cu_seq_k.has_value(),
                     "cu_seq_k must be an int32 tensor, got None (None only with block_table, "
                     "a paged KV cache)");
    check_packed(key, "key", "(total_k, kv_heads, head_dim)");
    check_packed(value, "value", "(total_k, kv_heads, v_head_dim)");
    check_max_len(*cu_seq_k, max_k, key.sym_size(0), "cu_seq_k", "max_k");
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
  if (num_splits.has_value()) {
    TORCH_CHECK_VALUE(*num_splits == 1,
                      "num_splits must be None (the kernels choose how to split a row's keys) or 1 "
                      "(batch-invariant output: each sequence computed alone), got ",
                      *num_splits);
    TORCH_CHECK_VALUE(dropout_p == 0, "num_splits=1 does not take dropout (dropout_p = ", dropout_p,
                      "): sequences computed alone would draw the same dropout mask wherever "
                      "their shapes agree");
    TORCH_CHECK_NOT_IMPLEMENTED(
        values_readable(cu_seq_q) && values_readable(*packed_cu_k),
        "num_splits=1 reads cu_seq_q and cu_seq_k on the host to run each sequence alone, so it "
        "cannot run while torch.compile traces or on the Meta device: call varlen_attention "
        "outside the compiled region (torch.compiler.disable)");
    check_documents(cu_seq_q, packed_cu_k, seqused_k, packed_shape(query, packed_key, packed_value),
                    query);
    if (cu_seq_q.numel() > 1) {
      return sequence_by_sequence(query, packed_key, packed_value, cu_seq_q, *packed_cu_k,
                                  rows_scale, seqused_k, sinks, options);
    }
  }
  return run_packed(query, packed_key, packed_value, cu_seq_q, packed_cu_k, max_q, rows_scale,
                    seqused_k, sinks, options, key_rows);
}

}  // namespace

TORCH_LIBRARY_IMPL(entropy_attn, CompositeImplicitAutograd, m) {
  m.impl("varlen_attention", &packed_attention);
}

}  // namespace entropy_attn
