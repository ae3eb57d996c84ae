// Pieces the Hopper kernels (forward and backward) share: the global tensors as TMA sees them,
// views of wgmma accumulator fragments, the issue of a warpgroup-wide wgmma batch, and the 16-bit
// pair stores of the epilogues.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <limits>
#include <type_traits>

// cute/tensor.hpp first: the sm90 atom headers rely on what it declares.
#include <cute/tensor.hpp>

#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "../params.h"
#include "launch.h"

namespace entropy_attn::cuda::sm90 {

using namespace cute;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The global tensors as the TMA descriptors see them: Q, K, V (and dO) as (rows, D, heads, batch)
// with a unit D stride.
using ShapeQKV = Shape<int32_t, int32_t, int32_t, int32_t>;
using StrideQK = Stride<int64_t, _1, int64_t, int64_t>;

// The (len, heads, batch) view `t` of kHeadDim-wide rows as such a tensor, for make_tma_copy: its
// strides as tma_strides (launch.h) leaves them, and the batch stride of a single-entry batch,
// never used either but checked by the encoder, the head stride times the heads.
template <typename Element, int kHeadDim>
auto tma_tensor(const View4& t, int64_t len, int64_t heads, int64_t batch) {
  const View4 v = tma_strides(t, len, heads, kHeadDim);
  return make_tensor(make_gmem_ptr(static_cast<const Element*>(v.data)),
                     ShapeQKV(static_cast<int32_t>(len), kHeadDim, static_cast<int32_t>(heads),
                              static_cast<int32_t>(batch)),
                     StrideQK(v.sl, _1{}, v.sh, batch == 1 ? heads * v.sh : v.sb));
}

// A wgmma accumulator fragment ((2 cols, 2 rows, N / 8), MMA_M, MMA_N) viewed as (rows, cols):
// rows ((2, MMA_M)) are the thread's rows, cols ((2, N / 8, MMA_N)) its columns of each row.
template <typename Layout>
CUTE_HOST_DEVICE constexpr auto acc_rowcol(Layout const& acc) {
  static_assert(decltype(rank<0>(acc))::value == 3 && decltype(rank(acc))::value == 3);
  return make_layout(make_layout(get<0, 1>(acc), get<1>(acc)),
                     make_layout(get<0, 0>(acc), get<0, 2>(acc), get<2>(acc)));
}

// An accumulator fragment of S as the register A operand of O += P V: the C fragment of a 64 x N
// wgmma holds, for each 16 columns, exactly the 8 values per thread that the A fragment of one
// k16 step wants (2 cols x 2 rows x 2 column octets), so P never leaves the registers.
template <typename Layout>
CUTE_HOST_DEVICE constexpr auto acc_as_a(Layout const& acc) {
  static_assert(decltype(rank<0>(acc))::value == 3 && decltype(rank(acc))::value == 3);
  auto l = logical_divide(get<0, 2>(acc), Tile<_2>{});  // (2, N / 16)
  return make_layout(make_layout(get<0, 0>(acc), get<0, 1>(acc), get<0, 0>(l)), get<1>(acc),
                     coalesce(make_layout(get<2>(acc), get<0, 1>(l))));
}

// acc (+)= A B over the whole K extent as one warpgroup-wide batch of wgmma (Ops: ops.cuh),
// committed and not waited for (Ops::wgmma_wait<k> does, batches completing in order). The fences
// keep the compiler from moving accesses of the accumulator (and of a register A operand) across
// the issue; the caller fences them again after the wait.
template <typename Ops, bool kZeroInit, typename TiledMma, typename FragA, typename FragB,
          typename Acc>
__device__ __forceinline__ void wg_gemm_issue(TiledMma& tiled_mma, FragA const& a, FragB const& b,
                                              Acc& acc) {
  constexpr bool kRs = !std::is_base_of_v<GMMA::DescriptorIterator, typename TiledMma::FrgTypeA>;
  if constexpr (kRs) warpgroup_fence_operand(const_cast<FragA&>(a));
  warpgroup_fence_operand(acc);
  Ops::wgmma_fence();
  if constexpr (kZeroInit) tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    cute::gemm(tiled_mma, a(_, _, k), b(_, _, k), acc);
    tiled_mma.accumulate_ = GMMA::ScaleOut::One;
  }
  Ops::wgmma_commit();
  warpgroup_fence_operand(acc);
}

// Two fp32 values as the 32-bit pair of T (cvt.rn), for the output stores.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// The parameters of a TMA pipeline (cutlass::PipelineTmaAsync) in a block of one producer
// warpgroup (0, whose thread 0 issues the loads of `bytes` each) and `consumers` consumer threads.
template <typename Pipeline>
__device__ __forceinline__ typename Pipeline::Params tma_pipeline_params(int warp_group,
                                                                         uint32_t bytes,
                                                                         int consumers) {
  typename Pipeline::Params params;
  params.transaction_bytes = bytes;
  params.role =
      warp_group == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  params.is_leader = threadIdx.x == 0;  // the thread that issues the loads
  params.num_consumers = consumers;
  return params;
}

}  // namespace entropy_attn::cuda::sm90
