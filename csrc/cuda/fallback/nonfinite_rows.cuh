// Keeping non-finite operand rows out of the rows (or keys) that cannot see them, for the
// shared-memory tiles of the fallback kernels (docs/math.md section 8; the CPU kernels do the same
// in csrc/cpu/hidden_nonfinite.h). A tile product mixes every row of one operand into every row of
// the result, relying on zero weights for hidden keys, and 0 * NaN = NaN: the kernels zero the
// tile rows that hold a NaN or an infinity before such a product and add those rows back, one by
// one, only where they are seen. The rare paths run rolled loops of fixed trip counts: ptxas forms
// calls for loops it cannot prove uniform around the kernels' barriers, and spills around them.
#pragma once

#include <cstdint>

#include "../../kernel_args.h"
#include "../params.h"
#include "device_utils.cuh"

namespace entropy_attn::cuda::fallback {

// Whether a kernel launched as the guard of a tensor-core kernel (params.h: nonfinite) has nothing
// to do: that kernel wrote no non-finite value. Its blocks then return at once.
template <typename acc_t>
__device__ __forceinline__ bool guard_idle(const AttentionArgs<acc_t>& a) {
  return a.nonfinite != nullptr && *a.nonfinite == 0;
}

// The grid of a fallback kernel whose blocks can stride over its work: `blocks`, or as a guard at
// most `cap`. An idle guard's blocks only read the flag and return, but a full grid of them is
// launched wave after wave on every call: 5.5 us after the forward of an H200 at B = 4, H = 16,
// L = 4096, D = 128 (4,096 blocks, two per SM; results/gpu/profile_h200.md).
inline int64_t guard_grid(int64_t blocks, bool guard, int64_t cap) {
  return guard && blocks > cap ? cap : blocks;
}
// The cap of the kernels with a block per tile (the forward; the backward's main kernel, whose
// tiles are key tiles): two waves on an H100 or H200. (The per-row kernels': kGuardRowBlocks.)
constexpr int64_t kGuardTileBlocks = 512;
inline int64_t tile_grid(int64_t tiles, bool guard) {
  return guard_grid(tiles, guard, kGuardTileBlocks);
}

// A tile's flags: kRows + 1 bytes in shared memory, flags[r] = 1 for a row holding a NaN or an
// infinity and flags[kRows] = 1 when some row does; load_tile sets them as it copies the tile.
// None of these functions synchronizes: the kernels place them between the barriers they already
// have (a barrier under a data-dependent branch would make ptxas form calls, and the values live
// across the calls would be spilled; a barrier per tile for a rare event would slow every call).
template <int kRows>
__device__ __forceinline__ void clear_flags(uint8_t* flags) {
  for (int r = threadIdx.x; r <= kRows; r += kThreads) flags[r] = 0;
}

template <int kRows>
__device__ __forceinline__ bool any_flagged(const uint8_t* flags) {
  return flags[kRows] != 0;
}

// Replaces the flagged rows of a kRows x kCols tile (leading dimension ld) by zeros.
template <int kRows, int kCols, typename T>
__device__ __forceinline__ void zero_flagged_rows(T* tile, int ld, const uint8_t* flags) {
  static_assert(kRows * kCols % kThreads == 0, "the same number of entries for every thread");
#pragma unroll 1  // (a rare path: rolled, it takes no registers from the rest)
  for (int it = 0; it < kRows * kCols / kThreads; ++it) {
    const int e = threadIdx.x + it * kThreads, r = e / kCols, c = e % kCols;
    if (flags[r]) tile[r * ld + c] = from_acc<T>(AccType<T>(0));
  }
}

// Row `row` of head h of batch b of an operand, in global memory as given. The rare paths form such
// addresses where they use them: a pointer kept from a tile's load would hold registers across the
// loops for a path that seldom runs.
template <typename T>
__device__ __forceinline__ const T* rows_as_given(const View4& t, int64_t b, int64_t h,
                                                  int64_t row) {
  return static_cast<const T*>(t.data) + b * t.sb + h * t.sh + row * t.sl;
}

// Whether query row i of (b, h) sees key j: in its key range (causality, window, document) and
// allowed by the mask, one of its n_i keys. Formed from the arguments, not from a tile's bounds in
// shared memory, so that an add-back may run while the next tile's bounds are written.
template <typename Acc>
__device__ __forceinline__ bool row_sees(const AttentionArgs<Acc>& a, int64_t b, int64_t h,
                                         int64_t i, int64_t j) {
  const KeyRange keys = a.pattern.keys(i, a.q_len, a.kv_len);
  return j >= keys.lo && j < keys.hi && a.mask.counts(a.mask.row_offset(b, h, i), j);
}

// The key-side add-back of the backward: acc[c][d] += w[r][c] x_r[d] (dK from lambda dS and Q, dV
// from P and dO) for each flagged row r < rows of the query tile at i0 and each key c < cols of the
// key tile at j0 that the row sees, x_r row i0 + r of the query-side operand `given` of (b, h) as
// given in global memory, d < dim. Every thread owns entries (c, d) of acc.
template <int kBM, int kBN, int kD, typename T, typename Acc, typename W>
__device__ __forceinline__ void add_back_query_rows(Acc* acc, int lda, const W* w, int ldw,
                                                    const uint8_t* flags, const View4& given,
                                                    const AttentionArgs<Acc>& a, int64_t b,
                                                    int64_t h, int64_t i0, int64_t j0, int rows,
                                                    int cols, int64_t dim) {
#pragma unroll 1
  for (int it = 0; it < kBN * kD / kThreads; ++it) {
    const int e = threadIdx.x + it * kThreads, c = e / kD, d = e % kD;
#pragma unroll 1
    for (int r = 0; r < kBM; ++r) {
      if (r < rows && c < cols && d < dim && flags[r] && row_sees(a, b, h, i0 + r, j0 + c)) {
        const T* x = rows_as_given<T>(given, b, h, i0 + r);
        acc[c * lda + d] += to_acc(w[r * ldw + c]) * to_acc(x[d]);
      }
    }
  }
}

}  // namespace entropy_attn::cuda::fallback
