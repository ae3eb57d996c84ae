// Launch of the fallback backward (bwd_kernel.cuh) for one input type and head-dim bucket: the
// preprocess, then the main kernel, and as the guard of a tensor-core backward the postprocess.
// Included by the generated translation units of instantiations/.
#pragma once

#include "bwd_kernel.cuh"
#include "launch.h"

namespace entropy_attn::cuda::fallback {

template <typename T, int kD>
size_t backward_smem_bytes() {
  return BwdLayout<T, kD>::kBytes;
}

template <typename T, int kD>
cudaError_t launch_backward(const BwdParams<AccType<T>>& p, cudaStream_t stream) {
  if (preprocess_blocks(p) > 0) {
    attention_bwd_preprocess_kernel<T>
        <<<static_cast<unsigned>(preprocess_blocks(p)), kThreads, 0, stream>>>(p);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  using L = BwdLayout<T, kD>;
  // The grouped kernel (the tensor-core families' guard) exists for their 16-bit inputs only.
  auto kernel = attention_bwd_kernel<T, kD, false>;
  if constexpr (kIs16Bit<T>) {
    if (grouped(p)) kernel = attention_bwd_kernel<T, kD, true>;
  } else {
    if (grouped(p)) return cudaErrorInvalidValue;
  }
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kBytes);
  if (err != cudaSuccess) return err;
  if (L::blocks(p) == 0) return cudaSuccess;
  kernel<<<static_cast<unsigned>(L::blocks(p)), kThreads, L::kBytes, stream>>>(p);
  err = cudaGetLastError();
  if (err != cudaSuccess || !grouped(p) || preprocess_blocks(p) == 0) return err;
  attention_bwd_postprocess_kernel<T>
      <<<static_cast<unsigned>(preprocess_blocks(p)), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace entropy_attn::cuda::fallback
