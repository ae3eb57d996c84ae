// Launch of the CUDA attention backward (attention_bwd_kernel.cuh): the preprocess, then the main
// kernel for the head-dim bucket. Included by the per-type translation units attention_bwd_<type>.cu.
#pragma once

#include "attention_bwd_kernel.cuh"
#include "launch.h"

namespace entropy_attn::cuda {

template <typename T, int kD>
cudaError_t launch_attention_backward_d(const BwdParams<AccType<T>>& p, cudaStream_t stream) {
  using L = BwdLayout<T, kD>;
  const auto kernel = attention_bwd_kernel<T, kD>;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kBytes);
  if (err != cudaSuccess) return err;
  if (L::blocks(p) == 0) return cudaSuccess;
  kernel<<<static_cast<unsigned>(L::blocks(p)), kThreads, L::kBytes, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
size_t attention_backward_smem_bytes(int64_t d) {
  switch (head_dim_bucket(d)) {
    case 64: return BwdLayout<T, 64>::kBytes;
    case 128: return BwdLayout<T, 128>::kBytes;
    default:
      if constexpr (std::is_same_v<T, double>) {
        return 0;  // unsupported: the host rejects float64 beyond kMaxHeadDimFloat64
      } else {
        return BwdLayout<T, 256>::kBytes;
      }
  }
}

template <typename T>
cudaError_t launch_attention_backward(const BwdParams<AccType<T>>& p, cudaStream_t stream) {
  if (preprocess_blocks(p) > 0) {
    attention_bwd_preprocess_kernel<T>
        <<<static_cast<unsigned>(preprocess_blocks(p)), kThreads, 0, stream>>>(p);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  const int64_t d = p.head_dim > p.v_head_dim ? p.head_dim : p.v_head_dim;
  switch (head_dim_bucket(d)) {
    case 64: return launch_attention_backward_d<T, 64>(p, stream);
    case 128: return launch_attention_backward_d<T, 128>(p, stream);
    default:
      if constexpr (std::is_same_v<T, double>) {
        return cudaErrorInvalidValue;  // the host rejects float64 beyond kMaxHeadDimFloat64
      } else {
        return launch_attention_backward_d<T, 256>(p, stream);
      }
  }
}

}  // namespace entropy_attn::cuda
