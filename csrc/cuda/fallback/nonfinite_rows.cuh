// Keeping non-finite operand rows out of the rows (or keys) that cannot see them, for the
// shared-memory tiles of the fallback kernels (docs/math.md section 8; the CPU kernels do the same
// in csrc/cpu/hidden_nonfinite.h). A tile product mixes every row of one operand into every row of
// the result, relying on zero weights for hidden keys, and 0 * NaN = NaN: the kernels zero the
// tile rows that hold a NaN or an infinity before such a product and add those rows back, one by
// one, only where they are seen.
#pragma once

#include <cstdint>

#include "../../kernel_args.h"
#include "../params.h"
#include "device_utils.cuh"

namespace entropy_attn::cuda::fallback {

// Flags (flags[r] = 1) the rows r < rows of a kRows x kCols tile (leading dimension ld; columns
// [0, cols) used) that hold a non-finite value, and replaces them by zeros. Called by the whole
// block; the tile's loads need no barrier before it, and it ends with one. Every thread runs the
// same fixed loops, with no early exit: a barrier that ptxas cannot prove every thread reaches
// makes it form calls, and the values live across those calls are spilled.
template <int kRows, int kCols, typename T>
__device__ __forceinline__ void zero_nonfinite_rows(T* tile, int ld, int rows, int cols,
                                                    uint8_t* flags) {
  using Acc = AccType<T>;
  static_assert(kRows * kCols % kThreads == 0, "the same number of entries for every thread");
  for (int r = threadIdx.x; r < kRows; r += kThreads) flags[r] = 0;
  __syncthreads();
#pragma unroll 1  // (unrolled, its hoisted addresses would be spilled in the larger kernels)
  for (int it = 0; it < kRows * kCols / kThreads; ++it) {
    const int e = threadIdx.x + it * kThreads, r = e / kCols, c = e % kCols;
    const Acc x = to_acc(tile[r * ld + c]);
    if (r < rows && c < cols && !(x - x == Acc(0))) flags[r] = 1;  // x - x: NaN for NaN, +-inf
  }
  __syncthreads();
#pragma unroll 1
  for (int it = 0; it < kRows * kCols / kThreads; ++it) {
    const int e = threadIdx.x + it * kThreads, r = e / kCols, c = e % kCols;
    if (flags[r]) tile[r * ld + c] = from_acc<T>(Acc(0));
  }
  __syncthreads();
}

// Whether some of flags[0, n) is set (shared memory, read by every thread).
__device__ __forceinline__ bool any_flag(const uint8_t* flags, int n) {
  bool any = false;
  for (int r = 0; r < n; ++r) any |= flags[r] != 0;
  return any;
}

// Row `row` of head h of batch b of an operand, in global memory as given. The rare paths form such
// addresses where they use them: a pointer kept from a tile's load would hold registers across the
// loops for a path that seldom runs.
template <typename T>
__device__ __forceinline__ const T* rows_as_given(const View4& t, int64_t b, int64_t h,
                                                  int64_t row) {
  return static_cast<const T*>(t.data) + b * t.sb + h * t.sh + row * t.sl;
}

// The key/value head of query head h (GQA); 32-bit division, as in block_index: a 64-bit one is a
// called subroutine.
template <typename Acc>
__device__ __forceinline__ int64_t kv_head_of(int64_t h, const AttentionArgs<Acc>& a) {
  return static_cast<unsigned>(h) /
         (static_cast<unsigned>(a.heads) / static_cast<unsigned>(a.kv_heads));
}

// Whether query row i of (b, h), whose key range is [lo, hi), sees key j (range and mask: the n_i
// keys).
template <typename Acc>
__device__ __forceinline__ bool row_sees(const MaskArg<Acc>& mask, int64_t b, int64_t h, int64_t i,
                                         int64_t lo, int64_t hi, int64_t j) {
  return j >= lo && j < hi && mask.counts(mask.row_offset(b, h, i), j);
}

}  // namespace entropy_attn::cuda::fallback
