#include "attention_inputs.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/where.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>

namespace entropy_attn {
namespace {

void check_qkv_tensor(const at::Tensor& x, const char* name, const char* layout) {
  // (torch.ops passes None for a Tensor argument as an undefined tensor, whose sizes read [0].)
  TORCH_CHECK_TYPE(x.defined(), name, " must be a tensor, got None");
  TORCH_CHECK_VALUE(x.dim() == 4, name, " must be a 4-D tensor ", layout, ", got ", x.dim(),
                    "-D of shape ", x.sizes());
  TORCH_CHECK_TYPE(is_supported_dtype(x.scalar_type()), name,
                   " must be float32, float64, bfloat16 or float16, got ", x.scalar_type());
}

// True when `sizes` broadcasts to `target` (numpy rules, sizes right-aligned).
bool broadcasts_to(c10::SymIntArrayRef sizes, c10::SymIntArrayRef target) {
  if (sizes.size() > target.size()) return false;
  const size_t off = target.size() - sizes.size();
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] != 1 && sizes[i] != target[off + i]) return false;
  }
  return true;
}

}  // namespace

AttentionShape concrete(const SymAttentionShape& s) {
  return {s.batch.expect_int(),     s.heads.expect_int(),  s.kv_heads.expect_int(),
          s.q_len.expect_int(),     s.kv_len.expect_int(), s.head_dim.expect_int(),
          s.v_head_dim.expect_int()};
}

SymAttentionShape symbolic(const AttentionShape& s) {
  return {s.batch, s.heads, s.kv_heads, s.q_len, s.kv_len, s.head_dim, s.v_head_dim};
}

ScaleMode parse_scale_mode(std::string_view scale_mode) {
  if (scale_mode == "fixed") return ScaleMode::kFixed;
  if (scale_mode == "logn") return ScaleMode::kLogN;
  if (scale_mode == "logn_sharpen") return ScaleMode::kLogNSharpen;
  TORCH_CHECK_VALUE(false, "scale_mode must be one of 'fixed', 'logn', 'logn_sharpen', got '",
                    std::string(scale_mode), "'");
}

SparsityKind parse_sparsity_kind(std::string_view kind) {
  if (kind == "exp") return SparsityKind::kExp;
  if (kind == "relu2") return SparsityKind::kRelu2;
  if (kind == "identity") return SparsityKind::kIdentity;
  TORCH_CHECK_VALUE(false, "kind must be one of 'exp', 'relu2', 'identity', got '",
                    std::string(kind), "'");
}

at::ScalarType accumulate_type(at::ScalarType input) {
  return input == at::kDouble ? at::kDouble : at::kFloat;
}

SymAttentionShape check_attention_inputs(const at::Tensor& query, const at::Tensor& key,
                                         const at::Tensor& value,
                                         const std::optional<at::Tensor>& attn_mask,
                                         const std::optional<at::Tensor>& scale,
                                         const AttentionOptions& options) {
  check_qkv_tensor(query, "query", "(batch, heads, q_len, head_dim)");
  check_qkv_tensor(key, "key", "(batch, kv_heads, kv_len, head_dim)");
  check_qkv_tensor(value, "value", "(batch, kv_heads, kv_len, v_head_dim)");
  // attention_sparsity has no value (its key stands in for it): its messages name two tensors.
  if (value.is_same(key)) {
    TORCH_CHECK_TYPE(key.scalar_type() == query.scalar_type(),
                     "query and key must have the same dtype, got ", query.scalar_type(), " and ",
                     key.scalar_type());
    TORCH_CHECK_VALUE(key.device() == query.device(),
                      "query and key must be on the same device, got ", query.device(), " and ",
                      key.device());
  }
  TORCH_CHECK_TYPE(
      key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type(),
      "query, key and value must have the same dtype, got ", query.scalar_type(), ", ",
      key.scalar_type(), " and ", value.scalar_type());
  TORCH_CHECK_VALUE(key.device() == query.device() && value.device() == query.device(),
                    "query, key and value must be on the same device, got ", query.device(), ", ",
                    key.device(), " and ", value.device());

  // (Comparisons of SymInts guard on the symbols: they hold for every size the graph serves.)
  const SymAttentionShape s{query.sym_size(0), query.sym_size(1), key.sym_size(1),
                            query.sym_size(2), key.sym_size(2),   query.sym_size(3),
                            value.sym_size(3)};
  TORCH_CHECK_VALUE(key.sym_size(0) == s.batch && value.sym_size(0) == s.batch,
                    "query, key and value must have the same batch size, got ", s.batch, ", ",
                    key.sym_size(0), " and ", value.sym_size(0));
  TORCH_CHECK_VALUE(value.sym_size(1) == s.kv_heads,
                    "key and value must have the same number of heads, got ", s.kv_heads, " and ",
                    value.sym_size(1));
  TORCH_CHECK_VALUE(value.sym_size(2) == s.kv_len,
                    "key and value must have the same sequence length, got ", s.kv_len, " and ",
                    value.sym_size(2));
  TORCH_CHECK_VALUE(key.sym_size(3) == s.head_dim,
                    "query and key must have the same head_dim, got ", s.head_dim, " and ",
                    key.sym_size(3));
  TORCH_CHECK_VALUE(s.head_dim > 0, "query's head_dim must be positive, got 0");
  if (s.heads != s.kv_heads) {
    TORCH_CHECK_VALUE(s.kv_heads > 0 && s.heads % s.kv_heads == 0, "the number of query heads (",
                      s.heads, ") must be a multiple of the number of key/value heads (",
                      s.kv_heads,
                      ") for grouped-query attention (enable_gqa); heads are not broadcast: expand "
                      "a tensor of one head to the others' heads");
    TORCH_CHECK_VALUE(options.enable_gqa, "query has ", s.heads, " heads but key/value have ",
                      s.kv_heads, ": pass enable_gqa=True for grouped-query attention");
  }

  if (attn_mask.has_value()) {
    const at::Tensor& m = *attn_mask;
    TORCH_CHECK_TYPE(m.scalar_type() == at::kBool || is_supported_dtype(m.scalar_type()),
                     "attn_mask must be bool (True = attend) or a float additive mask, got ",
                     m.scalar_type());
    TORCH_CHECK_VALUE(m.device() == query.device(), "attn_mask must be on query's device (",
                      query.device(), "), got ", m.device());
    TORCH_CHECK_VALUE(broadcasts_to(m.sym_sizes(), {s.batch, s.heads, s.q_len, s.kv_len}),
                      "attn_mask of shape ", m.sym_sizes(),
                      " does not broadcast to (batch, heads, q_len, kv_len) = (", s.batch, ", ",
                      s.heads, ", ", s.q_len, ", ", s.kv_len, ")");
  }
  if (scale.has_value()) {
    const at::Tensor& c = *scale;
    TORCH_CHECK_TYPE(is_supported_dtype(c.scalar_type()), kScaleTensorName,
                     " must be float32, float64, bfloat16 or float16, got ", c.scalar_type());
    TORCH_CHECK_VALUE(c.device() == query.device(), kScaleTensorName,
                      " must be on query's device (", query.device(), "), got ", c.device());
    TORCH_CHECK_VALUE(broadcasts_to(c.sym_sizes(), {s.batch, s.heads, s.q_len}), kScaleTensorName,
                      " of shape ", c.sym_sizes(),
                      " does not broadcast to (batch, heads, q_len) = (", s.batch, ", ", s.heads,
                      ", ", s.q_len, ")");
    TORCH_CHECK_VALUE(!options.scale_factor.has_value(),
                      "pass either a scale tensor or scale_factor, not both");
  }
  if (options.scale_factor.has_value()) {
    TORCH_CHECK_VALUE(std::isfinite(*options.scale_factor), "scale must be finite, got ",
                      *options.scale_factor);
  }
  // (1 / temperature finite too: a subnormal temperature would make every scale infinite)
  TORCH_CHECK_VALUE(std::isfinite(options.temperature) && options.temperature > 0 &&
                        std::isfinite(1 / options.temperature),
                    "temperature must be a finite number > 0 with a finite inverse, got ",
                    options.temperature);
  if (query.scalar_type() != at::kDouble) {
    // The kernels of float32 and 16-bit inputs form lambda_i = c g(n_i) / tau in float32 from c
    // and 1 / tau: a finite double there may overflow it (every logit infinite, the output NaN).
    constexpr double kMax = std::numeric_limits<float>::max();
    // Without scale_factor c = 1/sqrt(head_dim) <= 1 (head_dim >= 1, checked above), so 1 bounds
    // it without reading the size, which a trace would then specialize to (one graph per D).
    const double c = options.scale_factor.value_or(1.0);
    TORCH_CHECK_VALUE(1 / options.temperature <= kMax,
                      "temperature must be at least 1 / FLT_MAX for ", query.scalar_type(),
                      " inputs (their kernels compute in float32), got ", options.temperature);
    TORCH_CHECK_VALUE(std::abs(c) <= kMax && std::abs(c / options.temperature) <= kMax,
                      "scale / temperature = ", c, " / ", options.temperature,
                      " overflows float32, in which the kernels of ", query.scalar_type(),
                      " inputs compute lambda_i");
    // They also form 1 / softcap there: above 2^126 it is subnormal (0 where the GPU flushes
    // subnormals), and above FLT_MAX the cap itself overflows (NaN or 0 logits).
    constexpr double kMaxSoftcap = 1 / static_cast<double>(std::numeric_limits<float>::min());
    // (NaN passes here: check_pattern_options names it)
    TORCH_CHECK_VALUE(!(options.softcap > kMaxSoftcap), "softcap must be at most 2^126 (1 / the ",
                      "smallest normal float32) for ", query.scalar_type(),
                      " inputs (their kernels compute in float32), got ", options.softcap,
                      "; pass softcap=None for no cap");
  }
  if (options.scale_mode != ScaleMode::kFixed) {
    TORCH_CHECK_VALUE(std::isfinite(options.log_base) && options.log_base > 1,
                      "log_base (train_length) must be a finite number > 1, got ",
                      options.log_base);
  }
  check_pattern_options(options);
  return s;
}

void check_pattern_options(const AttentionOptions& o) {
  TORCH_CHECK_VALUE(o.window_left >= -1 && o.window_right >= -1,
                    "window_size must be (left, right) with each >= 0, or -1 for unbounded, got (",
                    o.window_left, ", ", o.window_right, ")");
  TORCH_CHECK_VALUE(!(o.causal && o.window_right > 0), "is_causal=True means window_size[1] = 0, ",
                    "got window_size = (", o.window_left, ", ", o.window_right, ")");
  // Every kernel computes in at least float32: a cap below its smallest normal number would round
  // to 0 (no cap) there, or make 1 / cap infinite, while float64 kernels applied it.
  constexpr double kMinSoftcap = std::numeric_limits<float>::min();
  TORCH_CHECK_VALUE(std::isfinite(o.softcap) && (o.softcap == 0 || o.softcap >= kMinSoftcap),
                    "softcap must be 0 (none) or a finite number >= ", kMinSoftcap,
                    " (the smallest normal float32), got ", o.softcap);
  TORCH_CHECK_VALUE(o.dropout_p >= 0 && o.dropout_p < 1, "dropout_p must be in [0, 1), got ",
                    o.dropout_p);
}

bool values_readable(const at::Tensor& t) {
  return !t.is_meta() && !t.key_set().has(c10::DispatchKey::Python);
}

void check_offsets(const at::Tensor& t, const char* name, const at::Tensor& query) {
  TORCH_CHECK_TYPE(t.defined(), name, " must be an int32 tensor, got None");
  TORCH_CHECK_TYPE(t.scalar_type() == at::kInt, name, " must be int32, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 1 && t.sym_size(0) >= 1, name,
                    " must be 1-D (number of sequences + 1), got shape ", t.sym_sizes());
  TORCH_CHECK_VALUE(t.device() == query.device(), name, " must be on query's device (",
                    query.device(), "), got ", t.device());
}

void check_key_rows(const at::Tensor& key_rows, const at::Tensor& key, bool has_documents,
                    const at::Tensor& query) {
  TORCH_CHECK_TYPE(key_rows.defined(), "key_rows must be an int64 tensor or None");
  TORCH_CHECK_TYPE(key_rows.scalar_type() == at::kLong, "key_rows must be int64, got ",
                   key_rows.scalar_type());
  TORCH_CHECK_VALUE(key_rows.dim() == 1,
                    "key_rows must be 1-D (one row per packed key), got shape ",
                    key_rows.sym_sizes());
  TORCH_CHECK_VALUE(key_rows.device() == query.device(), "key_rows must be on query's device (",
                    query.device(), "), got ", key_rows.device());
  TORCH_CHECK_VALUE(has_documents,
                    "key_rows needs packed documents (cu_seq_q and cu_seq_k): it maps their keys");
  if (query.is_meta() || !values_readable(key_rows)) return;
  // The rows decide which memory the kernels read: checked on the host (a device sync on CUDA).
  const at::Tensor r = key_rows.to(at::kCPU).contiguous();
  const int64_t* p = r.const_data_ptr<int64_t>();
  const int64_t rows = key.size(2);
  for (int64_t j = 0; j < r.numel(); ++j) {
    TORCH_CHECK_VALUE(p[j] >= 0 && p[j] < rows, "key_rows[", j, "] = ", p[j],
                      " is not a row of key (its dim 2 has ", rows, ")");
  }
}

void check_seqused_k(const at::Tensor& seqused_k, const c10::SymInt& sequences,
                     const at::Tensor& query) {
  TORCH_CHECK_TYPE(seqused_k.defined(), "seqused_k must be an int32 tensor or None");
  TORCH_CHECK_TYPE(seqused_k.scalar_type() == at::kInt, "seqused_k must be int32, got ",
                   seqused_k.scalar_type());
  TORCH_CHECK_VALUE(seqused_k.dim() == 1 && seqused_k.sym_size(0) == sequences,
                    "seqused_k must have shape (number of sequences,) = (", sequences, ",), got ",
                    seqused_k.sym_sizes());
  TORCH_CHECK_VALUE(seqused_k.device() == query.device(), "seqused_k must be on query's device");
}

bool check_documents(const std::optional<at::Tensor>& cu_seq_q,
                     const std::optional<at::Tensor>& cu_seq_k,
                     const std::optional<at::Tensor>& seqused_k, const SymAttentionShape& s,
                     const at::Tensor& query, const char* keys) {
  if (!cu_seq_q.has_value() && !cu_seq_k.has_value()) {
    TORCH_CHECK_VALUE(!seqused_k.has_value(), "seqused_k needs cu_seq_q and cu_seq_k");
    return false;
  }
  TORCH_CHECK_VALUE(cu_seq_q.has_value() && cu_seq_k.has_value(),
                    "pass both cu_seq_q and cu_seq_k, or neither");
  check_offsets(*cu_seq_q, "cu_seq_q", query);
  check_offsets(*cu_seq_k, "cu_seq_k", query);
  // The number of sequences, symbolic while torch.compile traces (one graph for every count).
  const c10::SymInt sym_n = cu_seq_q->sym_size(0) - 1;
  TORCH_CHECK_VALUE(cu_seq_k->sym_size(0) == sym_n + 1,
                    "cu_seq_q and cu_seq_k must have the same length, got ", sym_n + 1, " and ",
                    cu_seq_k->sym_size(0));
  if (seqused_k.has_value()) check_seqused_k(*seqused_k, sym_n, query);
  TORCH_CHECK_VALUE(s.batch == 1, "packed documents (cu_seq_q) need a batch of 1, got ", s.batch);
  // No values to check on the Meta device or under fake tensors (torch.compile, opcheck).
  if (query.is_meta() || !values_readable(*cu_seq_q)) return true;
  const int64_t n = sym_n.expect_int();
  // The values decide which memory the kernels read: checked on the host (a device sync on CUDA).
  // (contiguous: a strided view's values are not at data + d, and the kernels read contiguous
  // copies of these very values, attention_call.cpp: set_documents)
  const at::Tensor cq = cu_seq_q->to(at::kCPU).contiguous(),
                   ck = cu_seq_k->to(at::kCPU).contiguous();
  const int32_t *q = cq.const_data_ptr<int32_t>(), *k = ck.const_data_ptr<int32_t>();
  TORCH_CHECK_VALUE(q[0] == 0, "cu_seq_q must start at 0, got ", q[0]);
  TORCH_CHECK_VALUE(k[0] == 0, "cu_seq_k must start at 0, got ", k[0]);
  for (int64_t d = 0; d < n; ++d) {
    TORCH_CHECK_VALUE(q[d + 1] >= q[d], "cu_seq_q must be non-decreasing, but cu_seq_q[", d + 1,
                      "] = ", q[d + 1], " < cu_seq_q[", d, "] = ", q[d]);
    TORCH_CHECK_VALUE(k[d + 1] >= k[d], "cu_seq_k must be non-decreasing, but cu_seq_k[", d + 1,
                      "] = ", k[d + 1], " < cu_seq_k[", d, "] = ", k[d]);
  }
  TORCH_CHECK_VALUE(q[n] == s.q_len, "cu_seq_q[-1] must equal the number of query tokens (",
                    s.q_len, "), got ", q[n]);
  TORCH_CHECK_VALUE(k[n] == s.kv_len, "cu_seq_k[-1] must equal the number of ", keys, " (",
                    s.kv_len, "), got ", k[n]);
  if (seqused_k.has_value()) {
    const at::Tensor su = seqused_k->to(at::kCPU).contiguous();
    const int32_t* u = su.const_data_ptr<int32_t>();
    for (int64_t d = 0; d < n; ++d) {
      TORCH_CHECK_VALUE(u[d] >= 0 && u[d] <= k[d + 1] - k[d], "seqused_k[", d, "] = ", u[d],
                        " must be in [0, ", k[d + 1] - k[d], "] (that sequence's keys)");
    }
  }
  return true;
}

void check_sinks(const std::optional<at::Tensor>& sinks, const SymAttentionShape& s,
                 const at::Tensor& query) {
  if (!sinks.has_value()) return;
  const at::Tensor& t = *sinks;
  TORCH_CHECK_TYPE(is_supported_dtype(t.scalar_type()),
                   "sinks must be float32, float64, bfloat16 or float16, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 1 && t.sym_size(0) == s.heads, "sinks must have shape (heads,) = (",
                    s.heads, ",), got ", t.sym_sizes());
  TORCH_CHECK_VALUE(t.device() == query.device(), "sinks must be on query's device (",
                    query.device(), "), got ", t.device());
}

SymAttentionShape check_attention_backward_inputs(
    const at::Tensor& grad_output, const std::optional<at::Tensor>& grad_lse,
    const std::optional<at::Tensor>& grad_entropy, const std::optional<at::Tensor>& grad_sum_p2,
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask, const at::Tensor& output, const at::Tensor& lse,
    const at::Tensor& entropy, const at::Tensor& sum_p2, const at::Tensor& row_scale,
    const AttentionOptions& options) {
  AttentionOptions gqa = options;  // the backward accepts any group
  gqa.enable_gqa = true;
  const SymAttentionShape sh =
      check_attention_inputs(query, key, value, attn_mask, std::nullopt, gqa);
  const std::vector<c10::SymInt> out_sizes{sh.batch, sh.heads, sh.q_len, sh.v_head_dim};
  TORCH_CHECK_VALUE(grad_output.sym_sizes() == c10::SymIntArrayRef(out_sizes) &&
                        output.sym_sizes() == c10::SymIntArrayRef(out_sizes),
                    "grad_output and output must have shape ", c10::SymIntArrayRef(out_sizes),
                    ", got ", grad_output.sym_sizes(), " and ", output.sym_sizes());
  TORCH_CHECK_VALUE(grad_output.device() == query.device() && output.device() == query.device(),
                    "grad_output and output must be on query's device (", query.device(), ")");
  TORCH_CHECK_TYPE(grad_output.is_floating_point() && output.is_floating_point(),
                   "grad_output and output must be floating-point tensors, got ",
                   grad_output.scalar_type(), " and ", output.scalar_type());
  const std::vector<c10::SymInt> row_sizes{sh.batch, sh.heads, sh.q_len};
  auto check_row_stat = [&](const at::Tensor& t, const char* name) {
    // (an integer row_scale would make an integer, truncated grad_row_scale)
    TORCH_CHECK_TYPE(t.is_floating_point(), name, " must be a floating-point tensor, got ",
                     t.scalar_type());
    TORCH_CHECK_VALUE(t.sym_sizes() == c10::SymIntArrayRef(row_sizes), name, " must have shape ",
                      c10::SymIntArrayRef(row_sizes), ", got ", t.sym_sizes());
    TORCH_CHECK_VALUE(t.device() == query.device(), name, " must be on query's device (",
                      query.device(), "), got ", t.device());
  };
  check_row_stat(lse, "lse");
  // Empty entropy / sum_p2 come from a forward without statistics: allowed without their gradient.
  if (entropy.numel() > 0 || grad_entropy.has_value()) check_row_stat(entropy, "entropy");
  if (sum_p2.numel() > 0 || grad_sum_p2.has_value()) check_row_stat(sum_p2, "sum_p2");
  check_row_stat(row_scale, "row_scale");
  if (grad_lse.has_value()) check_row_stat(*grad_lse, "grad_lse");
  if (grad_entropy.has_value()) check_row_stat(*grad_entropy, "grad_entropy");
  if (grad_sum_p2.has_value()) check_row_stat(*grad_sum_p2, "grad_sum_p2");
  return sh;
}

void check_grad_mask(const std::optional<at::Tensor>& attn_mask, bool grad_mask) {
  TORCH_CHECK_VALUE(!grad_mask || (attn_mask.has_value() && attn_mask->is_floating_point()),
                    "grad_mask=True needs an additive (floating-point) attn_mask, got ",
                    attn_mask.has_value() ? "a bool mask" : "none");
}

bool mask_entries_read_as_is(const at::Tensor& attn_mask, at::ScalarType input) {
  return attn_mask.scalar_type() == input && (input == at::kBFloat16 || input == at::kHalf);
}

bool keeps_mask_dtype(const at::Tensor& attn_mask, at::ScalarType input) {
  return attn_mask.is_cuda() && mask_entries_read_as_is(attn_mask, input);
}

namespace {

// A copy of x's entries in fresh memory, contiguous, a whole number of 4-byte words long (up to 3
// entries of padding after them), expanded back to x's sizes: its broadcast (stride 0) dimensions
// stay views, so that a (1, 1, L, L) mask expanded to (B, H, L, L) is not materialized whole.
at::Tensor compact_copy(const at::Tensor& x) {
  at::Tensor base = x;
  for (int64_t d = 0; d < x.dim(); ++d) {
    if (x.stride(d) == 0 && x.size(d) > 1) base = base.narrow(d, 0, 1);
  }
  const int64_t n = base.numel();
  at::Tensor copy = at::empty({(n + 3) / 4 * 4}, base.options()).narrow(0, 0, n).view(base.sizes());
  return copy.copy_(base).expand(x.sizes());
}

}  // namespace

at::Tensor element_aligned(const at::Tensor& x) {
  if (reinterpret_cast<uintptr_t>(x.const_data_ptr()) % x.element_size() == 0) return x;
  return compact_copy(x);
}

bool words_within_storage(const at::Tensor& x) {
  if (x.numel() == 0 || x.element_size() % 4 == 0) return true;
  // The byte after x's last entry (strides are not negative in torch).
  int64_t last = 0;
  for (int64_t d = 0; d < x.dim(); ++d) last += (x.size(d) - 1) * x.stride(d);
  const auto first = reinterpret_cast<uintptr_t>(x.const_data_ptr());
  const uintptr_t end = first + static_cast<uintptr_t>((last + 1) * x.element_size());
  const auto storage_begin = reinterpret_cast<uintptr_t>(x.storage().data());
  const uintptr_t storage_end = storage_begin + x.storage().nbytes();
  constexpr uintptr_t kWord = 4;
  return (first & ~(kWord - 1)) >= storage_begin &&
         ((end + kWord - 1) & ~(kWord - 1)) <= storage_end;
}

at::Tensor word_readable(const at::Tensor& x) {
  return words_within_storage(x) ? x : compact_copy(x);
}

at::Tensor finite_to(const at::Tensor& x, at::ScalarType acc) {
  if (x.scalar_type() == at::kDouble && acc == at::kFloat) {
    // A finite float64 value beyond float32's range is an offset, not a mask or a missing sink
    // (docs/math.md sections 6 and 8): it becomes +-FLT_MAX, not the +-inf a plain cast would
    // make of it.
    constexpr double kMax = std::numeric_limits<float>::max();
    return at::where(at::isfinite(x), x.clamp(-kMax, kMax), x).to(acc);
  }
  return x.to(acc);
}

at::Tensor expand_mask(const at::Tensor& attn_mask, const AttentionShape& s, at::ScalarType acc,
                       bool keep_dtype) {
  at::Tensor m = attn_mask;
  TORCH_INTERNAL_ASSERT(!keep_dtype || m.scalar_type() == at::kBFloat16 ||
                        m.scalar_type() == at::kHalf);
  if (m.scalar_type() != at::kBool && !keep_dtype) m = finite_to(m, acc);
  m = element_aligned(m);
  // (On CUDA a float32 entry is read by a 4-byte load or cp.async, and a bool or a 16-bit one kept
  // in its dtype picked out of its aligned 4-byte word by its address's low bits: mask_words.cuh.
  // The CPU kernels read entries alone.)
  if (m.is_cuda()) m = word_readable(m);
  return m.expand({s.batch, s.heads, s.q_len, s.kv_len});
}

at::Tensor expand_scale(const at::Tensor& scale, const AttentionShape& s, at::ScalarType acc) {
  return element_aligned(scale.to(acc)).expand({s.batch, s.heads, s.q_len});
}

at::Tensor with_unit_last_stride(const at::Tensor& x, at::ScalarType dtype) {
  at::Tensor y = element_aligned(x.to(dtype));
  return has_unit_last_stride(y) ? y : y.contiguous();
}

}  // namespace entropy_attn
