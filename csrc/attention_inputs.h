// Validation and normalization of the attention op's arguments: the one place that decides what the
// op accepts, shared by the CPU, CUDA and Meta kernels so that every device raises the same errors.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>

#include <cmath>
#include <optional>
#include <string_view>

#include "attention_options.h"
#include "kernel_args.h"

namespace entropy_attn {

// Sizes of one call: query (B, H, Lq, D), key (B, Hkv, Lk, D), value (B, Hkv, Lk, Dv). The checks
// and the Meta kernels take them symbolic (SymInt), as torch.compile traces with dynamic shapes:
// a check then becomes a guard on the symbols instead of fixing each size to a constant, and one
// graph serves every length. The device kernels take the concrete sizes.
template <typename Size>
struct BasicAttentionShape {
  Size batch, heads, kv_heads, q_len, kv_len, head_dim, v_head_dim;
  // Query heads per key/value head; 1 for a call without heads (H = Hkv = 0: nothing to compute).
  Size group() const { return kv_heads == 0 ? Size(1) : heads / kv_heads; }
};
using AttentionShape = BasicAttentionShape<int64_t>;
using SymAttentionShape = BasicAttentionShape<c10::SymInt>;

// The sizes of a call on real tensors (whose sizes are concrete), and back.
AttentionShape concrete(const SymAttentionShape& s);
SymAttentionShape symbolic(const AttentionShape& s);

// The scale tensor in messages: the Python API passes it as `scale`, or as `scale_factor` under a
// length policy.
inline constexpr const char* kScaleTensorName =
    "scale tensor (scale, or scale_factor with a length policy)";

// Raises ValueError/TypeError naming the argument for anything the op does not accept.
SymAttentionShape check_attention_inputs(const at::Tensor& query, const at::Tensor& key,
                                         const at::Tensor& value,
                                         const std::optional<at::Tensor>& attn_mask,
                                         const std::optional<at::Tensor>& scale,
                                         const AttentionOptions& options);

// The checks of attention_backward beyond those of the forward: the shapes of output, grad_output,
// the saved row statistics and the optional upstream statistic gradients (undefined = absent).
SymAttentionShape check_attention_backward_inputs(
    const at::Tensor& grad_output, const std::optional<at::Tensor>& grad_lse,
    const std::optional<at::Tensor>& grad_entropy, const std::optional<at::Tensor>& grad_sum_p2,
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask, const at::Tensor& output, const at::Tensor& lse,
    const at::Tensor& entropy, const at::Tensor& sum_p2, const at::Tensor& row_scale,
    const AttentionOptions& options);

// attention_backward's grad_mask asks for the gradient of an additive (floating-point) attn_mask:
// without one (none, or a bool mask) it is a ValueError.
void check_grad_mask(const std::optional<at::Tensor>& attn_mask, bool grad_mask);

// sinks: (H,) float on query's device, or absent.
void check_sinks(const std::optional<at::Tensor>& sinks, const SymAttentionShape& s,
                 const at::Tensor& query);

// Whether a tensor's values can be read: not on the Meta device, not a fake tensor (torch.compile,
// opcheck), whose checks of values are left to the call on real tensors.
bool values_readable(const at::Tensor& t);

// Cumulative offsets (cu_seq_q, cu_seq_k): an int32 1-D tensor of N + 1 entries on query's device
// (TypeError / ValueError naming `name`). Their values are check_documents'.
void check_offsets(const at::Tensor& t, const char* name, const at::Tensor& query);

// seqused_k: int32 (sequences,) on query's device.
void check_seqused_k(const at::Tensor& seqused_k, const c10::SymInt& sequences,
                     const at::Tensor& query);

// The packed documents of a call (attention_call.h: DocumentArgs): false when absent (a dense
// call); else checks them (int32 1-D offsets of N + 1 entries on query's device, a batch of 1;
// and, unless on the Meta device, their values: cu[0] = 0, non-decreasing, the last
// equal to the query / key tokens, 0 <= seqused_k <= each sequence's keys) and returns true.
// `keys` names the key count in the errors (key_rows' length where it is given).
bool check_documents(const std::optional<at::Tensor>& cu_seq_q,
                     const std::optional<at::Tensor>& cu_seq_k,
                     const std::optional<at::Tensor>& seqused_k, const SymAttentionShape& s,
                     const at::Tensor& query, const char* keys = "key tokens");

// key_rows (attention_call.h: DocumentArgs): int64 (keys,) on query's device, with packed
// documents, and (unless on the Meta device or fake) each a row of key's dim 2; errors name it.
// The call's key count, kv_len, is then key_rows' length, not key's dim 2.
void check_key_rows(const at::Tensor& key_rows, const at::Tensor& key, bool has_documents,
                    const at::Tensor& query);

// The window, softcap and dropout options (ValueError naming the argument).
void check_pattern_options(const AttentionOptions& options);

ScaleMode parse_scale_mode(std::string_view scale_mode);

SparsityKind parse_sparsity_kind(std::string_view kind);

// The dtype of statistics and accumulators: float64 for float64 inputs, float32 otherwise.
at::ScalarType accumulate_type(at::ScalarType input);

// Whether an additive mask keeps its own dtype for the kernels: a bf16 or fp16 mask of the inputs'
// dtype on CUDA, whose kernels read 16-bit entries (kernel_args.h: MaskElem). Elsewhere a mask
// becomes the accumulate type: the CPU kernels read only that, and a 16-bit mask of the other
// 16-bit type, or a float32 one with 16-bit inputs, holds values the inputs' type does not.
bool keeps_mask_dtype(const at::Tensor& attn_mask, at::ScalarType input);
// Its device-independent part: the inputs' 16-bit dtype (at any address: expand_mask copies one
// that is not 2-byte aligned, element_aligned).
bool mask_entries_read_as_is(const at::Tensor& attn_mask, at::ScalarType input);

// `x` in `acc` where a finite float64 entry beyond float32's range becomes +-FLT_MAX rather than
// the +-inf of a plain cast: an additive mask's offset or a sink stays finite, and so counted
// (a -inf entry hides a key, a -inf sink is no sink).
at::Tensor finite_to(const at::Tensor& x, at::ScalarType acc);

// Returns the mask expanded (as a view where possible) to (B, H, Lq, Lk): bool, in `acc`, or with
// keep_dtype (keeps_mask_dtype: on CUDA) in its own 16-bit dtype, without the float32 copy of every
// entry a conversion would make; element_aligned and word_readable.
at::Tensor expand_mask(const at::Tensor& attn_mask, const AttentionShape& s, at::ScalarType acc,
                       bool keep_dtype);

// Returns the per-row scale factor c expanded to (B, H, Lq) in `acc`, element_aligned.
at::Tensor expand_scale(const at::Tensor& scale, const AttentionShape& s, at::ScalarType acc);

// The floating types the op takes for its tensors (inputs, additive masks, scale tensors, sinks).
inline bool is_supported_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf;
}

// Whether x's last dimension is contiguous (the kernels' rows).
inline bool has_unit_last_stride(const at::Tensor& x) {
  return x.size(-1) <= 1 || x.stride(-1) == 1;
}

// `x` itself, or, where its entries are at an address that is not a multiple of their size (memory
// from from_blob, DLPack or __cuda_array_interface__; torch's own allocations always are aligned),
// a copy in fresh memory that keeps x's broadcast (stride 0) dimensions as views, so that a
// (1, 1, L, L) mask expanded to (B, H, L, L) is not materialized whole. Every tensor whose entries
// a kernel reads passes through it: the kernels read an entry at its natural alignment, which on
// CUDA faults at a misaligned address (the x86 CPU path would not need it).
at::Tensor element_aligned(const at::Tensor& x);

// Whether the aligned 4-byte words that hold x's entries lie within x's storage: always for entries
// of 4 or 8 bytes; for 1- or 2-byte entries, unless the last ends less than a word before the
// storage does (a bool mask whose size in bytes is not a multiple of 4) or the first starts
// less than a word after it at an address that is not a multiple of 4 (from_blob memory).
bool words_within_storage(const at::Tensor& x);

// `x` itself, or, where its entries' words reach outside its storage (words_within_storage), a
// copy in storage of whole words with x's broadcast dimensions kept as views (as element_aligned).
// The tensor-core forwards copy a bool or 16-bit mask entry's whole aligned word (mask_words.cuh):
// a byte past an allocation never faults (it is in the same page), but it is a read outside the
// tensor, which compute-sanitizer's memcheck reports on memory from cudaMalloc of exact size.
at::Tensor word_readable(const at::Tensor& x);

// `x` in dtype `dtype` with a contiguous last dimension, element_aligned (a no-op for conforming
// inputs).
at::Tensor with_unit_last_stride(const at::Tensor& x, at::ScalarType dtype);

// The kernel view of a mask from expand_mask (or none).
template <typename acc_t>
MaskArg<acc_t> make_mask_arg(const std::optional<at::Tensor>& expanded) {
  MaskArg<acc_t> m;
  if (!expanded.has_value()) return m;
  const at::Tensor& t = *expanded;
  m.kind = t.scalar_type() == at::kBool ? MaskKind::kBool : MaskKind::kAdditive;
  m.elem = t.scalar_type() == at::kBFloat16 ? MaskElem::kBFloat16
           : t.scalar_type() == at::kHalf   ? MaskElem::kFloat16
                                            : MaskElem::kAcc;
  TORCH_INTERNAL_ASSERT(m.kind == MaskKind::kBool || m.elem != MaskElem::kAcc ||
                            t.scalar_type() == c10::CppTypeToScalarType<acc_t>::value,
                        "an additive mask in ", t.scalar_type(), " for kernels of ",
                        c10::CppTypeToScalarType<acc_t>::value);
  m.data = t.const_data_ptr();
  m.sb = t.stride(0), m.sh = t.stride(1), m.si = t.stride(2), m.sj = t.stride(3);
  return m;
}

// The same for the CPU kernels, which read additive masks in acc_t alone (keeps_mask_dtype
// keeps 16-bit ones on CUDA only).
template <typename acc_t>
MaskArg<acc_t> make_cpu_mask_arg(const std::optional<at::Tensor>& expanded) {
  const MaskArg<acc_t> m = make_mask_arg<acc_t>(expanded);
  TORCH_INTERNAL_ASSERT(m.elem == MaskElem::kAcc, "a 16-bit additive mask for the CPU kernels");
  return m;
}

// The base scale c of lambda_i = c g(n_i) / tau without a scale tensor: scale_factor, else
// 1/sqrt(head_dim) (docs/math.md section 1).
inline double base_scale(std::optional<double> scale_factor, int64_t head_dim) {
  return scale_factor.value_or(1.0 / std::sqrt(static_cast<double>(head_dim)));
}

// The kernel view of the scale arguments: `c` is the expand_scale tensor in acc_t, or undefined:
// then base_scale(scale_factor, head_dim).
template <typename acc_t>
ScalePolicy<acc_t> make_scale_policy(const at::Tensor& c, std::optional<double> scale_factor,
                                     int64_t head_dim, ScaleMode mode, double log_base,
                                     double temperature) {
  ScalePolicy<acc_t> p;
  if (c.defined()) {
    p.data = c.const_data_ptr<acc_t>();
    p.sb = c.stride(0), p.sh = c.stride(1), p.si = c.stride(2);
  } else {
    p.constant = static_cast<acc_t>(base_scale(scale_factor, head_dim));
  }
  p.mode = mode;
  p.inv_log_base = mode == ScaleMode::kFixed ? 0 : static_cast<acc_t>(1.0 / std::log(log_base));
  p.inv_temperature = static_cast<acc_t>(1.0 / temperature);
  return p;
}

}  // namespace entropy_attn
