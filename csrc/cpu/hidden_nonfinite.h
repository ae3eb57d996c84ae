// Keeping non-finite inputs out of the rows that cannot see them (docs/math.md section 8).
//
// A block product such as O += P V mixes every key of the block into every row: a key that row i
// cannot see has p_ij = 0, but 0 * NaN = NaN and 0 * inf = NaN, so one NaN value of a masked or
// causally hidden key would poison every row. The products below leave the operand rows that hold
// a non-finite value out of the block product and add them back, one by one, only where the key
// is seen. Operands are finite in practice, so the scan that finds such rows is the whole cost;
// the slow path runs only for blocks that hold one.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "attention_cpu.h"
#include "block_gemm.h"
#include "row_kernels.h"

namespace entropy_attn::cpu {

// Whether query row i of (b, h) sees key j: inside the row's key range (causality, window,
// document) and allowed by the mask. These are the n_i keys the scale counts.
template <typename acc_t>
bool row_sees(const MaskArg<acc_t>& mask, const KeyPattern& pattern, const AttentionShape& sh,
              int64_t b, int64_t h, int64_t i, int64_t j) {
  const KeyRange r = pattern.keys(i, sh.q_len, sh.kv_len);
  return j >= r.lo && j < r.hi && mask.counts(mask.row_offset(b, h, i), j);
}

// flags[r * flag_stride] for rows r < n of x (row stride ld): whether each holds a non-finite
// value (float32 through the ISA clones of row_kernels.cpp).
template <typename T>
void flag_rows(const T* x, int64_t ld, int64_t n, int64_t dim, uint8_t* flags,
               int64_t flag_stride) {
  if constexpr (std::is_floating_point_v<T>) {
    flag_nonfinite_rows(x, ld, n, dim, flags, flag_stride);
  } else {
    for (int64_t r = 0; r < n; ++r) flags[r * flag_stride] = has_nonfinite(x + r * ld, dim);
  }
}

// One flag per (batch, head, position) row of a (B, heads, L, dim) operand: whether it holds a
// non-finite value. Empty when all rows are finite.
class NonFiniteRows {
 public:
  template <typename T>
  static NonFiniteRows of(const Strided4<T>& x, int64_t batch, int64_t heads, int64_t len,
                          int64_t dim) {
    NonFiniteRows r;
    r.heads_ = heads, r.len_ = len;
    std::vector<uint8_t> flags(batch * heads * len, 0);
    // One pass over the rows in storage order: positions outer where heads are interleaved
    // within each position ((B, L, heads, dim) storage: packed documents, varlen's layout; with
    // one head, equal strides), heads outer otherwise. Head by head over interleaved heads, the
    // scan passed over the whole tensor once per head, a few rows per page each time (a packed
    // decoding call spent twice the time a dense batch of the same keys does).
    const bool positions_outer = x.sh <= x.sl;
    // (runs of rows one stride apart: a position's heads, or a head's positions)
    const int64_t run = positions_outer ? heads : len;
    const int64_t runs = batch * (positions_outer ? len : heads);
    at::parallel_for(
        0, runs, std::max<int64_t>(1, 256 / std::max<int64_t>(run, 1)),
        [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) {
            if (positions_outer) {
              const int64_t b = i / len, l = i % len;
              flag_rows(x.at(b, 0, l), x.sh, heads, dim, flags.data() + b * heads * len + l, len);
            } else {
              flag_rows(x.at(i / heads, i % heads, 0), x.sl, len, dim, flags.data() + i * len, 1);
            }
          }
        });
    if (std::find(flags.begin(), flags.end(), uint8_t{1}) != flags.end())
      r.flags_ = std::move(flags);
    return r;
  }

  // From flags already found, `len` per (batch, head).
  static NonFiniteRows from(std::vector<uint8_t> flags, int64_t heads, int64_t len) {
    NonFiniteRows r;
    r.heads_ = heads, r.len_ = len;
    if (std::find(flags.begin(), flags.end(), uint8_t{1}) != flags.end())
      r.flags_ = std::move(flags);
    return r;
  }

  // Whether some row of the operand is flagged.
  bool any() const { return !flags_.empty(); }

  // The flags of (b, h)'s rows, or null when no row of the operand is flagged.
  const uint8_t* at(int64_t b, int64_t h) const {
    return flags_.empty() ? nullptr : flags_.data() + (b * heads_ + h) * len_;
  }

 private:
  std::vector<uint8_t> flags_;
  int64_t heads_ = 0, len_ = 0;
};

// Whether some flag of flags[0, n) is set (null: none).
inline bool any_flagged(const uint8_t* flags, int64_t n) {
  return flags != nullptr && std::find(flags, flags + n, uint8_t{1}) != flags + n;
}

// C (M x N) [+]= A (M x K) . B (K x N), where row k of B is flagged in `flags` (null: none) when
// it is non-finite: such rows are replaced by zeros in the block product (in `scratch`), then
// C[m, :] += A[m, k] B[k, :] for each row m that sees key k (sees(m, k)).
template <typename T, typename Sees>
void product_seen_rows_of_b(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B,
                            int64_t ldb, T* C, int64_t ldc, bool accumulate, const uint8_t* flags,
                            std::vector<T>& scratch, const Sees& sees) {
  if (!any_flagged(flags, K)) {
    block_gemm<T>(M, N, K, A, lda, B, ldb, C, ldc, accumulate);
    return;
  }
  scratch.resize(K * N);
  for (int64_t k = 0; k < K; ++k) {
    T* dst = scratch.data() + k * N;
    if (flags[k]) {
      std::fill(dst, dst + N, T(0));
    } else {
      std::copy(B + k * ldb, B + k * ldb + N, dst);
    }
  }
  block_gemm<T>(M, N, K, A, lda, scratch.data(), N, C, ldc, accumulate);
  for (int64_t k = 0; k < K; ++k) {
    if (!flags[k]) continue;
    for (int64_t m = 0; m < M; ++m) {
      if (!sees(m, k)) continue;
      const T a = A[m * lda + k];
      for (int64_t n = 0; n < N; ++n) C[m * ldc + n] += a * B[k * ldb + n];
    }
  }
}

// C (N x K) += Bt (N x M) . A (M x K), where column m of Bt (row m of the operand B) is flagged in
// `flags` when it is non-finite: such columns are replaced by zeros in the block product, then
// C[:, k] += Bt[:, m] A[m, k] for each key k that row m sees (sees(m, k)).
template <typename T, typename Sees>
void product_seen_cols_of_bt(int64_t N, int64_t K, int64_t M, const T* Bt, int64_t ldbt, const T* A,
                             int64_t lda, T* C, int64_t ldc, const uint8_t* flags,
                             std::vector<T>& scratch, const Sees& sees) {
  if (!any_flagged(flags, M)) {
    block_gemm<T>(N, K, M, Bt, ldbt, A, lda, C, ldc, true);
    return;
  }
  scratch.resize(N * M);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t m = 0; m < M; ++m) scratch[n * M + m] = flags[m] ? T(0) : Bt[n * ldbt + m];
  }
  block_gemm<T>(N, K, M, scratch.data(), M, A, lda, C, ldc, true);
  for (int64_t m = 0; m < M; ++m) {
    if (!flags[m]) continue;
    for (int64_t k = 0; k < K; ++k) {
      if (!sees(m, k)) continue;
      const T a = A[m * lda + k];
      for (int64_t n = 0; n < N; ++n) C[n * ldc + k] += Bt[n * ldbt + m] * a;
    }
  }
}

}  // namespace entropy_attn::cpu
