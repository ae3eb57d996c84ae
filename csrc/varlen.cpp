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
  std::optional<at::Tensor> dense_scale;
  if (scale.has_value()) {
    const at::Tensor& c = *scale;
    const c10::SymInt &total = query.sym_size(0), &heads = query.sym_size(1);
    TORCH_CHECK_VALUE(c.dim() <= 2 &&
                          (c.dim() < 2 || c.sym_size(0) == 1 || c.sym_size(0) == total) &&
                          (c.dim() < 1 || c.sym_size(-1) == 1 || c.sym_size(-1) == heads),
                      kScaleTensorName, " of shape ", c.sym_sizes(),
                      " does not broadcast to (total_q, heads) = (", total, ", ", heads, ")");
    dense_scale = c.expand_symint({total, heads}).transpose(0, 1).unsqueeze(0);
  }
  const AttentionOptions options = AttentionOptions::from_schema(
      is_causal, scale_factor, scale_mode, temperature, log_base, enable_gqa, return_stats,
      window_size, "bottom_right", softcap, dropout_p, dropout_seed);
  auto [out, lse, ent, p2, pmax, n, lam, factor, norm_ent, sparsity, eff] =
      call_attention(dense_view(query), dense_view(packed_key), dense_view(packed_value),
                     std::nullopt, dense_scale, sinks, {cu_seq_q, packed_cu_k, seqused_k}, options);
  return {packed(out), packed(lse),    packed(ent),      packed(p2),       packed(pmax), packed(n),
          packed(lam), packed(factor), packed(norm_ent), packed(sparsity), packed(eff)};
}

}  // namespace

TORCH_LIBRARY_IMPL(entropy_attn, CompositeImplicitAutograd, m) {
  m.impl("varlen_attention", &packed_attention);
}

}  // namespace entropy_attn
