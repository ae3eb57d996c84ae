// Host side of the Hopper forward: the definition of launch_forward (launch.h), explicitly
// instantiated by the generated translation units under instantiations/.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../params.h"
#include "fwd_kernel.cuh"
#include "launch.h"

namespace entropy_attn::cuda::sm90 {

// One block of three warpgroups per (query tile, head, batch): a 3-D grid, so that no index is a
// product that could overflow 32 bits.
template <typename T, int kHeadDim, bool kCausal, MaskKind kMask, bool kStats>
cudaError_t launch_forward(const FwdParams<float>& p, cudaStream_t stream) {
  using Kt = fwd_impl::FwdTraits<T, kHeadDim, kMask>;
  using Element = typename Kt::Element;
  using namespace cute;

  cudaError_t err = device_is_sm90();
  if (err != cudaSuccess) return err;
  if (!covers(p, kHeadDim, kCausal)) return cudaErrorNotSupported;
  const View4 q = tma_strides(p.q, p.q_len, p.heads, kHeadDim);
  const View4 k = tma_strides(p.k, p.kv_len, p.kv_heads, kHeadDim);
  const View4 v = tma_strides(p.v, p.kv_len, p.kv_heads, kHeadDim);
  const auto shape = [&](int64_t len, int64_t heads) {
    return ShapeQKV(static_cast<int32_t>(len), kHeadDim, static_cast<int32_t>(heads),
                    static_cast<int32_t>(p.batch));
  };
  const auto gmem = [](const View4& t) {
    return make_gmem_ptr(static_cast<const Element*>(t.data));
  };
  // Batch strides of single-entry batches are never used either: the head stride times the heads.
  const auto batch_stride = [&](const View4& t, int64_t heads) {
    return p.batch == 1 ? heads * t.sh : t.sb;
  };

  fwd_impl::KernelArgs<Kt> args{
      p,
      make_tma_copy(SM90_TMA_LOAD{},
                    make_tensor(gmem(q), shape(p.q_len, p.heads),
                                StrideQK(q.sl, _1{}, q.sh, batch_stride(q, p.heads))),
                    typename Kt::SmemLayoutQ{}),
      make_tma_copy(SM90_TMA_LOAD{},
                    make_tensor(gmem(k), shape(p.kv_len, p.kv_heads),
                                StrideQK(k.sl, _1{}, k.sh, batch_stride(k, p.kv_heads))),
                    take<0, 2>(typename Kt::SmemLayoutK{})),
      make_tma_copy(SM90_TMA_LOAD{},
                    make_tensor(gmem(v), shape(p.kv_len, p.kv_heads),
                                StrideQK(v.sl, _1{}, v.sh, batch_stride(v, p.kv_heads))),
                    take<0, 2>(typename Kt::SmemLayoutK{}))};

  const auto kernel = &fwd_impl::forward_kernel<T, Kt, kCausal, kMask, kStats>;
  constexpr int kSmem = Kt::kSmemBytes;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>((p.q_len + Kt::kBlockM - 1) / Kt::kBlockM),
                  static_cast<unsigned>(p.heads), static_cast<unsigned>(p.batch));
  kernel<<<grid, Kt::kThreads, kSmem, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace entropy_attn::cuda::sm90
