// Host side of the Hopper forward: the definition of launch_forward (launch.h), explicitly
// instantiated by the generated translation units under instantiations/.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../params.h"
#include "fwd_kernel.cuh"
#include "launch.h"

namespace entropy_attn::cuda::sm90 {
namespace fwd_impl {

// The view's strides with those of single-entry dimensions replaced by the packed ones: they
// never move a coordinate, but TMA checks every stride's alignment.
inline View4 tma_strides(View4 v, int64_t len, int64_t heads, int64_t head_dim) {
  if (len == 1) v.sl = head_dim;
  if (heads == 1) v.sh = len * v.sl;
  return v;
}

}  // namespace fwd_impl

// One block of three warpgroups per (query tile, head, batch): a 3-D grid, so that no index is a
// product that could overflow 32 bits.
template <typename T, int kHeadDim, bool kCausal, MaskKind kMask, bool kStats>
cudaError_t launch_forward(const FwdParams<float>& p, cudaStream_t stream) {
  using Kt = fwd_impl::FwdTraits<T, kHeadDim, kMask>;
  using Element = typename Kt::Element;
  using namespace cute;

  int device = 0, major = 0, minor = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (err != cudaSuccess) return err;
  // The sm_90a code runs on compute capability 9.0 alone.
  if (major != 9 || minor != 0) return cudaErrorNotSupported;
  if (p.head_dim != kHeadDim || p.v_head_dim != kHeadDim || p.kv_len < 1 ||
      p.heads % p.kv_heads != 0 || p.pattern.left >= 0 || p.pattern.right != (kCausal ? 0 : -1) ||
      (p.pattern.bottom_right && p.pattern.banded()) || p.pattern.cu_q != nullptr ||
      p.softcap.on() || p.sinks != nullptr || p.dropout.on()) {
    return cudaErrorNotSupported;
  }
  if (!tma_compatible(p.q, p.q_len, p.heads, p.batch) ||
      !tma_compatible(p.k, p.kv_len, p.kv_heads, p.batch) ||
      !tma_compatible(p.v, p.kv_len, p.kv_heads, p.batch)) {
    return cudaErrorNotSupported;
  }
  const View4 q = fwd_impl::tma_strides(p.q, p.q_len, p.heads, kHeadDim);
  const View4 k = fwd_impl::tma_strides(p.k, p.kv_len, p.kv_heads, kHeadDim);
  const View4 v = fwd_impl::tma_strides(p.v, p.kv_len, p.kv_heads, kHeadDim);
  const auto shape = [&](int64_t len, int64_t heads) {
    return fwd_impl::ShapeQKV(static_cast<int32_t>(len), kHeadDim, static_cast<int32_t>(heads),
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
                                fwd_impl::StrideQK(q.sl, _1{}, q.sh, batch_stride(q, p.heads))),
                    typename Kt::SmemLayoutQ{}),
      make_tma_copy(SM90_TMA_LOAD{},
                    make_tensor(gmem(k), shape(p.kv_len, p.kv_heads),
                                fwd_impl::StrideQK(k.sl, _1{}, k.sh, batch_stride(k, p.kv_heads))),
                    take<0, 2>(typename Kt::SmemLayoutK{})),
      make_tma_copy(SM90_TMA_LOAD{},
                    make_tensor(gmem(v),
                                fwd_impl::ShapeQKV(kHeadDim, static_cast<int32_t>(p.kv_len),
                                                   static_cast<int32_t>(p.kv_heads),
                                                   static_cast<int32_t>(p.batch)),
                                fwd_impl::StrideVt(_1{}, v.sl, v.sh, batch_stride(v, p.kv_heads))),
                    take<0, 2>(typename Kt::SmemLayoutVt{}))};

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
