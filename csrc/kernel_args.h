// Kernel-side arguments shared by the CPU and CUDA kernels: the mask as strided storage, the scale
// policy of a call, and which keys a query row may see. Plain structs without ATen, so that CUDA
// device code includes them as they are; attention_inputs.h builds them from tensors.
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>

#include "scale_policy.h"

namespace entropy_attn {

enum class MaskKind : int8_t { kNone, kBool, kAdditive };

// The attention function f of attention_sparsity: a = exp(s), relu(s)^2 or s.
enum class SparsityKind : int8_t { kExp, kRelu2, kIdentity };

// The storage type of an additive mask's entries: the accumulate type, or the 16-bit type of the
// inputs, which the CUDA kernels read as it is (attention_inputs.h: expand_mask keeps a bf16 or
// fp16 mask of the inputs' dtype on CUDA, so that a call does not copy a (B, H, Lq, Lk) bias into
// float32, twice its size; the CPU kernels always get the accumulate type).
enum class MaskElem : int8_t { kAcc, kBFloat16, kFloat16 };

// The float value of a bfloat16 (the high half of a float32) and of an IEEE half given as bits:
// exact, as every value of either type is a float32 (the CUDA kernels convert with their own
// instructions: mask_words.cuh).
EA_HOST_DEVICE float bfloat16_bits_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
EA_HOST_DEVICE float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float32
    const float f = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -f : f;
  }
  // Infinities and NaNs keep an all-ones exponent; normal numbers rebias it from 15 to 127.
  const uint32_t bits = sign | (exponent == 0x1fu ? 0xffu : exponent + 112u) << 23 | mantissa << 13;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// A (B, H, Lq, Lk) mask as strided storage (broadcast dims have stride 0): bool (true = attend) or
// additive, in the accumulate type or (elem) the inputs' 16-bit type.
template <typename acc_t>
struct MaskArg {
  MaskKind kind = MaskKind::kNone;
  MaskElem elem = MaskElem::kAcc;
  const void* data = nullptr;
  int64_t sb = 0, sh = 0, si = 0, sj = 0;

  EA_HOST_DEVICE int64_t row_offset(int64_t b, int64_t h, int64_t i) const {
    return b * sb + h * sh + i * si;
  }
  // A bool mask's bytes. torch's bool tensors hold 0 or 1, but a uint8 tensor viewed as bool may
  // hold any nonzero byte for True (as torch's own ops read it): the kernels compare a byte with 0
  // and never load it as a C++ bool, which the compiler may take for its lowest bit or add as is.
  EA_HOST_DEVICE const uint8_t* bool_bytes() const { return static_cast<const uint8_t*>(data); }
  // An additive mask's entries in the accumulate type (elem == kAcc).
  EA_HOST_DEVICE const acc_t* additive_data() const { return static_cast<const acc_t*>(data); }
  // The bits of a 16-bit additive mask (elem != kAcc).
  EA_HOST_DEVICE const uint16_t* additive_bits() const {
    return static_cast<const uint16_t*>(data);
  }
  // The additive mask's entry at element offset `off`, whatever its storage type.
  EA_HOST_DEVICE acc_t additive(int64_t off) const {
    if (elem == MaskElem::kBFloat16) return bfloat16_bits_to_float(additive_bits()[off]);
    if (elem == MaskElem::kFloat16) return half_bits_to_float(additive_bits()[off]);
    return additive_data()[off];
  }

  // Whether key j (at offset row_off + j * sj) counts toward the row's n_i: allowed by a bool mask,
  // or an additive value other than -inf.
  EA_HOST_DEVICE bool counts(int64_t row_off, int64_t j) const {
    if (kind == MaskKind::kBool) return bool_bytes()[row_off + j * sj] != 0;
    if (kind == MaskKind::kAdditive) {
      const int64_t off = row_off + j * sj;
      // A 16-bit entry is compared as bits with its type's -inf (0xff80 in bf16, 0xfc00 in fp16).
      if (elem != MaskElem::kAcc) {
        return additive_bits()[off] != (elem == MaskElem::kBFloat16 ? 0xff80u : 0xfc00u);
      }
      return additive_data()[off] != -std::numeric_limits<acc_t>::infinity();
    }
    return true;
  }

  // The logit of a scaled (and capped) score x = cap(lam * q.k) for key j: x plus the additive
  // mask, or -inf where a bool mask forbids the key or the additive mask is -inf (whatever x is:
  // a NaN key hidden by -inf must not give NaN + -inf = NaN).
  EA_HOST_DEVICE acc_t logit(int64_t row_off, int64_t j, acc_t x) const {
    constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
    if (kind == MaskKind::kBool) return bool_bytes()[row_off + j * sj] != 0 ? x : kNegInf;
    if (kind == MaskKind::kAdditive) {
      const acc_t m = additive(row_off + j * sj);
      return m == kNegInf ? kNegInf : x + m;
    }
    return x;
  }
};

// The gradient of the logits, dS_ij before the softcap, which is the additive mask's gradient: an
// accumulator with the mask's own sizes, seen as (B, H, Lq, Lk) with stride 0 along the dims the
// mask broadcasts along, so that the logits sharing a mask entry add into one element and no
// (B, H, Lq, Lk) buffer is needed. Null when the call does not ask for it (grad_mask).
template <typename acc_t>
struct LogitGradArg {
  acc_t* data = nullptr;
  int64_t sb = 0, sh = 0, si = 0, sj = 0;

  EA_HOST_DEVICE acc_t* at(int64_t b, int64_t h, int64_t i, int64_t j) const {
    return data + b * sb + h * sh + i * si + j * sj;
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
// scaled_dot_product_attention's is_causal). The tensor-core family, whose causal flag is a
// compile-time top-left pattern, uses it; everything else asks a KeyPattern.
EA_HOST_DEVICE int64_t key_limit(int64_t i, int64_t kv_len, bool causal) {
  return causal ? (i + 1 < kv_len ? i + 1 : kv_len) : kv_len;
}

// The keys [lo, hi) a query row may see before the mask is applied.
struct KeyRange {
  int64_t lo = 0, hi = 0;
};

// Which keys each query row may see: causality and a sliding window around the row's diagonal,
// and, for packed (varlen) calls, the boundaries of the documents. One definition for every
// kernel, so that n_i, the skipped key blocks and the masked entries agree on every device.
//
// Row i's diagonal is key i (top-left alignment, scaled_dot_product_attention's is_causal) or key
// i + Lk - Lq (bottom-right: the last query row sees the last key, as a decoding cache, chunked
// prefill, FlashAttention and varlen_attn align). The row sees keys diag - left .. diag + right,
// clipped to [0, Lk); a bound of -1 is unbounded, and causality is right = 0.
struct KeyPattern {
  int64_t left = -1, right = -1;
  bool bottom_right = false;
  // Packed documents: document d owns query rows [cu_q[d], cu_q[d + 1]) and keys
  // [cu_k[d], cu_k[d] + len_k), len_k = seqused_k[d] when given, else cu_k[d + 1] - cu_k[d]; the
  // window applies within each document. Null cu_q: one document of Lq rows and Lk keys.
  const int32_t* cu_q = nullptr;
  const int32_t* cu_k = nullptr;
  const int32_t* seqused_k = nullptr;
  int64_t documents = 0;

  // True when some row may see fewer than all keys of its document (before the mask).
  EA_HOST_DEVICE bool banded() const { return left >= 0 || right >= 0; }

  // The range of row i of a document of q_len rows and kv_len keys, in the document's key indices.
  EA_HOST_DEVICE KeyRange local(int64_t i, int64_t q_len, int64_t kv_len) const {
    const int64_t diag = bottom_right ? i + kv_len - q_len : i;
    int64_t lo = left >= 0 ? diag - left : 0;
    int64_t hi = right >= 0 ? diag + right + 1 : kv_len;
    lo = lo < 0 ? 0 : lo;
    hi = hi > kv_len ? kv_len : hi;
    // An empty range sits at a position that keeps lo and hi non-decreasing in i, so that the
    // range of a tile of rows is [lo of its first row, hi of its last).
    if (hi < lo) hi = lo = (lo > kv_len ? kv_len : lo);
    return {lo, hi};
  }

  // The range of row i of a call with q_len rows and kv_len keys per batch entry (for packed
  // calls: the total query and key tokens), in the call's key indices. lo and hi never decrease
  // as i grows.
  EA_HOST_DEVICE KeyRange keys(int64_t i, int64_t q_len, int64_t kv_len) const {
    if (cu_q == nullptr) return local(i, q_len, kv_len);
    int64_t d = 0, end = documents;  // the last document with cu_q[d] <= i: the one holding row i
    while (end - d > 1) {
      const int64_t mid = (d + end) / 2;
      if (cu_q[mid] <= i) {
        d = mid;
      } else {
        end = mid;
      }
    }
    const int64_t k0 = cu_k[d];
    const int64_t len_k = seqused_k != nullptr ? seqused_k[d] : cu_k[d + 1] - k0;
    const KeyRange r = local(i - cu_q[d], cu_q[d + 1] - cu_q[d], len_k);
    return {k0 + r.lo, k0 + r.hi};
  }
};

// Logit softcapping (Gemma 2): s <- cap * tanh(s / cap), applied to the scaled score before the
// additive mask; cap = 0 leaves logits as they are.
template <typename acc_t>
struct Softcap {
  acc_t cap = 0, inv_cap = 0;

  EA_HOST_DEVICE bool on() const { return cap > acc_t(0); }
  EA_HOST_DEVICE acc_t apply(acc_t x) const { return on() ? cap * std::tanh(x * inv_cap) : x; }
  // d apply / dx from the capped value y = apply(x): 1 - (y / cap)^2.
  EA_HOST_DEVICE acc_t derivative(acc_t y) const {
    if (!on()) return acc_t(1);
    const acc_t t = y * inv_cap;
    return acc_t(1) - t * t;
  }
};

}  // namespace entropy_attn
