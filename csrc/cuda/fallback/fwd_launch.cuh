// Launch of the fallback forward (fwd_kernel.cuh) for one input type and head-dim bucket: the
// shared memory attribute and the grid. Included by the generated translation units of
// instantiations/.
#pragma once

#include "fwd_kernel.cuh"
#include "launch.h"

namespace entropy_attn::cuda::fallback {

template <typename T, int kD>
size_t forward_smem_bytes() {
  return FwdLayout<T, kD>::kBytes;
}

template <typename T, int kD>
cudaError_t launch_forward(const FwdParams<AccType<T>>& p, cudaStream_t stream) {
  using L = FwdLayout<T, kD>;
  const auto kernel = attention_fwd_kernel<T, kD>;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kBytes);
  if (err != cudaSuccess) return err;
  kernel<<<static_cast<unsigned>(L::grid(p)), kThreads, L::kBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace entropy_attn::cuda::fallback
