// Split-KV (flash-decoding) for the tensor-core forward: when a call has too few query tiles to
// fill the GPU (decoding: a few query rows against a long cache), forward_kernel runs each tile's
// key blocks as p.num_splits contiguous parts, one thread block each, which write their rows'
// unnormalized output and online state (m in log2 units, l, t, u: online_stats.h) in float32. The
// combine kernel here merges the parts of each row (online_stats.h: merge, the same update the
// kernels use between key blocks), finishes the row (finalize, derive) and writes the outputs the
// unsplit epilogue would: O = sum_s 2^(m_s - m) O_s / l in the input type, lse and the statistics.
// It also raises the guard's flag (params.h: nonfinite) for a row that came out non-finite, or that
// has keys to see and no weight (finite additive mask values below -FLT_MAX / log2(e)), so that
// the fallback recomputes the call, as after an unsplit forward.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "../../online_stats.h"
#include "../cute_utils.cuh"
#include "../params.h"
#include "../row_statistics.cuh"

namespace entropy_attn::cuda::sm80 {
namespace fwd_impl {

constexpr int kCombineWarps = 4;  // rows per block of the combine kernel: one warp each

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}

// One warp per row of the call (B * H * Lq rows): the lanes merge the splits' states (lane k takes
// splits k, k + 32, ...; then a butterfly over the lanes, after which every lane holds the row's
// state: merge is symmetric), each lane then forms kHeadDim / 32 adjacent output columns.
template <typename T, int kHeadDim, bool kStats>
__global__ void __launch_bounds__(kCombineWarps * 32)
    split_combine_kernel(const __grid_constant__ FwdParams<float> p) {
  static_assert(kHeadDim % 64 == 0, "two or more columns per lane, in float2 steps");
  constexpr int kCols = kHeadDim / 32;
  const int lane = threadIdx.x % 32;
  const int64_t rows = p.batch * p.heads * p.q_len;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kCombineWarps + threadIdx.x / 32;
  if (row >= rows) return;  // (whole warps)
  const int splits = p.num_splits;
  auto state_of = [&](int s) {
    const float4 v = *reinterpret_cast<const float4*>(p.state_partial + (s * rows + row) * 4);
    return RowStats<float>{v.x, v.y, v.z, v.w};
  };

  RowStats<float> st;
  for (int s = lane; s < splits; s += 32) st = merge<float, Log2>(st, state_of(s));
  CUTE_UNROLL
  for (int o = 16; o > 0; o >>= 1) {
    const RowStats<float> other{
        __shfl_xor_sync(0xffffffffu, st.m, o), __shfl_xor_sync(0xffffffffu, st.l, o),
        __shfl_xor_sync(0xffffffffu, st.t, o), __shfl_xor_sync(0xffffffffu, st.u, o)};
    st = merge<float, Log2>(st, other);
  }
  const RowResult<float> res = finalize<float, Log2>(st);

  // O: each split's part moved to the row's max (an empty part, l = 0, weighs nothing), over l.
  float o[kCols] = {};
  for (int s = 0; s < splits; ++s) {
    const RowStats<float> part = state_of(s);
    const float w = part.l == 0.f ? 0.f : exp2f(part.m - st.m) * res.inv_l;
    const float* o_part = p.o_partial + (s * rows + row) * kHeadDim + lane * kCols;
    CUTE_UNROLL
    for (int c = 0; c < kCols; c += 2) {
      const float2 v = *reinterpret_cast<const float2*>(o_part + c);
      o[c] += w * v.x;
      o[c + 1] += w * v.y;
    }
  }
  bool nonfinite = !is_finite(res.lse) || (kStats && !is_finite(res.entropy)) ||
                   (st.l == 0.f && p.n_keys[row] > 0);
  const int64_t i = row % p.q_len, bh = row / p.q_len;
  T* out = static_cast<T*>(p.out.data) + p.out.offset(bh / p.heads, bh % p.heads, i) + lane * kCols;
  CUTE_UNROLL
  for (int c = 0; c < kCols; ++c) {
    nonfinite |= !is_finite(o[c]);
    out[c] = from_float<T>(o[c]);
  }
  if (__any_sync(0xffffffffu, nonfinite) && lane == 0 && p.nonfinite != nullptr) *p.nonfinite = 1;
  if (lane != 0) return;
  p.lse[row] = res.lse;
  if constexpr (kStats) {
    store_row_statistics(p, row, res, p.n_keys[row], has_sink_entry(p.sinks, bh % p.heads));
  }
}

}  // namespace fwd_impl
}  // namespace entropy_attn::cuda::sm80
