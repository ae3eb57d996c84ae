// Kernel-side arguments shared by the CPU and CUDA kernels: the mask as strided storage, the scale
// policy of a call, and which keys a query row may see. Plain structs without ATen, so that CUDA
// device code includes them as they are; attention_inputs.h builds them from tensors.
#pragma once

#include <cstdint>
#include <limits>

#include "scale_policy.h"

namespace entropy_attn {

enum class MaskKind : int8_t { kNone, kBool, kAdditive };

// The attention function f of attention_sparsity: a = exp(s), relu(s)^2 or s.
enum class SparsityKind : int8_t { kExp, kRelu2, kIdentity };

// A (B, H, Lq, Lk) mask as strided storage (broadcast dims have stride 0): bool (true = attend) or
// additive in the accumulate type.
template <typename acc_t>
struct MaskArg {
  MaskKind kind = MaskKind::kNone;
  const void* data = nullptr;
  int64_t sb = 0, sh = 0, si = 0, sj = 0;

  EA_HOST_DEVICE int64_t row_offset(int64_t b, int64_t h, int64_t i) const {
    return b * sb + h * sh + i * si;
  }
  EA_HOST_DEVICE const bool* bool_data() const { return static_cast<const bool*>(data); }
  EA_HOST_DEVICE const acc_t* additive_data() const { return static_cast<const acc_t*>(data); }

  // Whether key j (at offset row_off + j * sj) counts toward the row's n_i: allowed by a bool mask,
  // or an additive value other than -inf.
  EA_HOST_DEVICE bool counts(int64_t row_off, int64_t j) const {
    if (kind == MaskKind::kBool) return bool_data()[row_off + j * sj];
    if (kind == MaskKind::kAdditive) {
      return additive_data()[row_off + j * sj] != -std::numeric_limits<acc_t>::infinity();
    }
    return true;
  }

  // The logit of raw score r = q.k for key j: lam * r, plus the additive mask, or -inf where a
  // bool mask forbids the key.
  EA_HOST_DEVICE acc_t logit(int64_t row_off, int64_t j, acc_t lam, acc_t r) const {
    if (kind == MaskKind::kBool) {
      return bool_data()[row_off + j * sj] ? lam * r : -std::numeric_limits<acc_t>::infinity();
    }
    if (kind == MaskKind::kAdditive) return lam * r + additive_data()[row_off + j * sj];
    return lam * r;
  }
};

// The scale policy of a call: lambda_i = c_i * g(n_i) / temperature (scale_policy.h), with c a
// strided (B, H, Lq) tensor or one constant.
template <typename acc_t>
struct ScalePolicy {
  const acc_t* data = nullptr;
  int64_t sb = 0, sh = 0, si = 0;
  acc_t constant = 1;
  ScaleMode mode = ScaleMode::kFixed;
  acc_t inv_log_base = 0, inv_temperature = 1;

  EA_HOST_DEVICE acc_t c(int64_t b, int64_t h, int64_t i) const {
    return data ? data[b * sb + h * sh + i * si] : constant;
  }
  // g(n) / temperature: the row's length_factor output.
  EA_HOST_DEVICE acc_t factor(int64_t n) const {
    return length_factor(mode, n, inv_log_base) * inv_temperature;
  }
  // lambda_i of row (b, h, i), given factor(n_i).
  EA_HOST_DEVICE acc_t lambda(int64_t b, int64_t h, int64_t i, acc_t factor_n) const {
    return c(b, h, i) * factor_n;
  }
};

// Keys [0, key_limit) are allowed by causality for query row i (top-left alignment, as
// scaled_dot_product_attention's is_causal).
EA_HOST_DEVICE int64_t key_limit(int64_t i, int64_t kv_len, bool causal) {
  return causal ? (i + 1 < kv_len ? i + 1 : kv_len) : kv_len;
}

}  // namespace entropy_attn
