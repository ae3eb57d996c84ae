// Pieces shared by the CPU kernels: the kernel arguments, the block sizes and task loop, and how
// one row of raw scores q_i.k_j becomes scaled, masked logits.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>

#include "../attention_inputs.h"
#include "block_gemm.h"

// The hot row loops are compiled once per ISA (AVX-512, AVX2, baseline) and picked at load time
// by GCC's function multiversioning, so one binary vectorizes fully on any x86-64 CPU.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define EA_CPU_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define EA_CPU_CLONES
#endif
#define EA_ALWAYS_INLINE inline __attribute__((always_inline))

namespace entropy_attn::cpu {

// A (B, heads, L, dim) tensor with a unit last stride, as a pointer and its three outer strides.
template <typename T>
struct Strided4 {
  T* data = nullptr;
  int64_t sb = 0, sh = 0, sl = 0;

  static Strided4 of(const at::Tensor& t) {
    return {const_cast<T*>(t.const_data_ptr<T>()), t.stride(0), t.stride(1), t.stride(2)};
  }
  T* at(int64_t b, int64_t h, int64_t l = 0) const { return data + b * sb + h * sh + l * sl; }
};

// x (B, heads, L, dim) as a contiguous (B, heads, dim, L) tensor in `dtype`, in one copy: the
// row-major right operand of the products with x^T (Q K^T, dO V^T), which block_gemm takes as is.
// (Tensor::to with a memory format would alias: a transposed view "suggests" the contiguous
// format.)
inline at::Tensor transposed_copy(const at::Tensor& x, at::ScalarType dtype) {
  const at::Tensor xt = x.transpose(2, 3);
  return at::empty(xt.sizes(), x.options().dtype(dtype)).copy_(xt);
}

// One row of the mask, positioned at key 0.
template <typename acc_t>
struct MaskRow {
  MaskKind kind;
  const bool* b;
  const acc_t* a;
  int64_t sj;

  MaskRow(const MaskArg<acc_t>& m, int64_t b_idx, int64_t h, int64_t i)
      : kind(m.kind), b(nullptr), a(nullptr), sj(m.sj) {
    const int64_t off = m.row_offset(b_idx, h, i);
    if (kind == MaskKind::kBool) b = m.bool_data() + off;
    if (kind == MaskKind::kAdditive) a = m.additive_data() + off;
  }
};

// Block sizes, tuned by measurement (2 threads, L = 2048, D = 64 and 128, a sweep of 64..512 query
// rows x 256..1024 keys): taller query blocks amortize the key/value traffic once there are enough
// rows, except under causality, where the diagonal block's masked half is wasted work and 64 rows
// were 5-15% faster than 256; 512 keys keep a block of scores in L2 (256..1024 within noise).
inline int64_t q_block_size(int64_t q_len, bool causal) {
  if (q_len < 192) return 32;
  return (q_len >= 768 && !causal) ? 256 : 64;
}
constexpr int64_t kKvBlock = 512;

// Runs body(state, b, h, i0, rows) for every (batch, head, query block of rows i0 .. i0 + rows), in
// parallel over these tasks. Each thread builds its buffers once, as State(q_block_size, shape),
// and runs its products with a single-threaded BLAS.
template <typename State, typename Body>
void parallel_query_blocks(const AttentionShape& sh, bool causal, const Body& body) {
  const int64_t qb = q_block_size(sh.q_len, causal);
  const int64_t blocks = (sh.q_len + qb - 1) / qb;
  at::parallel_for(0, sh.batch * sh.heads * blocks, 1, [&](int64_t begin, int64_t end) {
    SerialBlasScope serial_blas;
    State state(qb, sh);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i0 = (task % blocks) * qb, bh = task / blocks;
      body(state, bh / sh.heads, bh % sh.heads, i0, std::min(qb, sh.q_len - i0));
    }
  });
}

// Number of keys in [0, limit) that the mask allows: the row's n_i.
template <typename acc_t>
int64_t count_allowed(const MaskArg<acc_t>& m, int64_t b, int64_t h, int64_t i, int64_t limit) {
  if (m.kind == MaskKind::kNone) return limit;
  const int64_t off = m.row_offset(b, h, i);
  int64_t n = 0;
  for (int64_t j = 0; j < limit; ++j) n += m.counts(off, j);
  return n;
}

// What a kernel needs to know of query row i before streaming keys: the causal key limit, n_i,
// g(n_i) / temperature and lambda_i.
template <typename acc_t>
struct RowSetup {
  int64_t limit = 0, n = 0;
  acc_t factor = 0, lam = 0;

  RowSetup() = default;
  RowSetup(const MaskArg<acc_t>& mask, const ScalePolicy<acc_t>& scale, bool causal, int64_t kv_len,
           int64_t b, int64_t h, int64_t i)
      : limit(key_limit(i, kv_len, causal)),
        n(count_allowed(mask, b, h, i, limit)),
        factor(scale.factor(n)),
        lam(scale.lambda(b, h, i, factor)) {}
};

// Turns raw scores r[0, n) of keys j0 .. j0 + n into logits s = lam * r + mask in place; keys
// at or beyond `limit` or masked out become -inf. Returns the block's max logit (-inf if none).
template <typename acc_t>
EA_ALWAYS_INLINE acc_t scaled_logits(acc_t* r, int64_t n, int64_t j0, int64_t limit, acc_t lam,
                                     const MaskRow<acc_t>& m) {
  constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
  const int64_t end = std::clamp<int64_t>(limit - j0, 0, n);
  // One pass per mask kind forms the logits and their max together (the row stays in L1).
  acc_t mx = kNegInf;
  if (m.kind == MaskKind::kNone) {
#pragma omp simd reduction(max : mx)
    for (int64_t j = 0; j < end; ++j) {
      const acc_t x = lam * r[j];
      r[j] = x;
      mx = x > mx ? x : mx;
    }
  } else if (m.kind == MaskKind::kBool) {
    const bool* mb = m.b + j0 * m.sj;
#pragma omp simd reduction(max : mx)
    for (int64_t j = 0; j < end; ++j) {
      const acc_t x = mb[j * m.sj] ? lam * r[j] : kNegInf;
      r[j] = x;
      mx = x > mx ? x : mx;
    }
  } else {
    const acc_t* ma = m.a + j0 * m.sj;
#pragma omp simd reduction(max : mx)
    for (int64_t j = 0; j < end; ++j) {
      const acc_t x = lam * r[j] + ma[j * m.sj];
      r[j] = x;
      mx = x > mx ? x : mx;
    }
  }
  std::fill(r + end, r + n, kNegInf);
  // The max skips NaN; a NaN then reaches the outputs through e^{s - m}, except in a row of only
  // NaN and -inf, caught here so that NaN inputs give NaN outputs, as in SDPA.
  if (mx == kNegInf) {
    for (int64_t j = 0; j < end; ++j) {
      if (r[j] != r[j]) return r[j];
    }
  }
  return mx;
}

}  // namespace entropy_attn::cpu
