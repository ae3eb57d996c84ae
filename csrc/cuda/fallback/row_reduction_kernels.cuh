// CUDA kernels of the row-reduction ops on a given attention matrix: entropy of normalized weights
// and the l1/l2 sparsity of seed 003, one warp per contiguous row, with the per-element formulas
// the CPU kernels use (reduction_math.h): terms in the accumulate type (float for 16-bit inputs)
// summed in double, as on the CPU. A lane's float running sum of a row of 2^20 entries (2^15 terms)
// drifted: a uniform row's entropy came out 0.03% above its maximum ln n.
#pragma once

#include "../../reduction_math.h"
#include "../params.h"
#include "device_utils.cuh"

namespace entropy_attn::cuda::fallback {

// The grid: one warp per row.
inline int64_t row_reduction_blocks(const RowReductionParams& p) {
  return (p.rows + kWarps - 1) / kWarps;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) row_entropy_kernel(const RowReductionParams p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (row >= p.rows) return;
  const T* x = static_cast<const T*>(p.in) + row * p.n;
  double h = 0;
  for (int64_t j = threadIdx.x % 32; j < p.n; j += 32) h += entropy_term(to_acc(x[j]));
  h = warp_sum(h);
  if (threadIdx.x % 32 == 0) static_cast<T*>(p.out)[row] = from_acc<T>(static_cast<AccType<T>>(h));
}

template <typename T>
__global__ void __launch_bounds__(kThreads) row_sparsity_kernel(const RowReductionParams p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (row >= p.rows) return;
  const T* x = static_cast<const T*>(p.in) + row * p.n;
  using Acc = AccType<T>;
  auto abs_at = [&](int64_t j) {
    const Acc v = to_acc(x[j]);
    return v < 0 ? -v : v;
  };
  Acc abs_max = 0;
  for (int64_t j = threadIdx.x % 32; j < p.n; j += 32) abs_max = nan_max(abs_max, abs_at(j));
  const Acc d = sparsity_divisor(warp_max(abs_max));
  double l1 = 0, l2 = 0;
  for (int64_t j = threadIdx.x % 32; j < p.n; j += 32) {
    const double v = abs_at(j) / d;
    l1 += v;
    l2 += v * v;
  }
  l1 = warp_sum(l1), l2 = warp_sum(l2);
  if (threadIdx.x % 32 == 0)
    static_cast<T*>(p.out)[row] = from_acc<T>(static_cast<Acc>(sparsity_value(l1, l2, p.n)));
}

}  // namespace entropy_attn::cuda::fallback
