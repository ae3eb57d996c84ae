// Launch of the CUDA attention forward (attention_fwd_kernel.cuh): the head-dim bucket, the shared
// memory attribute, the grid. Included by the per-type translation units attention_fwd_<type>.cu.
#pragma once

#include "attention_fwd_kernel.cuh"
#include "launch.h"

namespace entropy_attn::cuda {

template <typename T, int kD>
cudaError_t launch_attention_forward_d(const FwdParams<AccType<T>>& p, cudaStream_t stream) {
  using L = FwdLayout<T, kD>;
  const auto kernel = attention_fwd_kernel<T, kD>;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kBytes);
  if (err != cudaSuccess) return err;
  kernel<<<static_cast<unsigned>(L::blocks(p)), kThreads, L::kBytes, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
size_t attention_forward_smem_bytes(int64_t d) {
  switch (head_dim_bucket(d)) {
    case 64: return FwdLayout<T, 64>::kBytes;
    case 128: return FwdLayout<T, 128>::kBytes;
    default:
      if constexpr (std::is_same_v<T, double>) {
        return 0;  // unsupported: the host rejects float64 beyond kMaxHeadDimFloat64
      } else {
        return FwdLayout<T, 256>::kBytes;
      }
  }
}

template <typename T>
cudaError_t launch_attention_forward(const FwdParams<AccType<T>>& p, cudaStream_t stream) {
  const int64_t d = p.head_dim > p.v_head_dim ? p.head_dim : p.v_head_dim;
  switch (head_dim_bucket(d)) {
    case 64: return launch_attention_forward_d<T, 64>(p, stream);
    case 128: return launch_attention_forward_d<T, 128>(p, stream);
    default:
      if constexpr (std::is_same_v<T, double>) {
        return cudaErrorInvalidValue;  // the host rejects float64 beyond kMaxHeadDimFloat64
      } else {
        return launch_attention_forward_d<T, 256>(p, stream);
      }
  }
}

}  // namespace entropy_attn::cuda
