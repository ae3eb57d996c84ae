// Launch of the fallback backward (bwd_kernel.cuh) for one input type and head-dim bucket: the
// preprocess, then the main kernel, and as the guard of a tensor-core backward the postprocess.
// Included by the generated translation units of instantiations/.
#pragma once

#include "../device_limits.h"
#include "bwd_kernel.cuh"
#include "launch.h"

namespace entropy_attn::cuda::fallback {

// The main kernel's dynamic shared memory, with the tiles the current device takes (a plain call:
// use_compact_backward). As the guard of a tensor-core backward it runs the usual tiles, which a
// device that takes the tensor-core backward has room for (sm80's at D = 256 needs 214 KB).
template <typename T, int kD>
size_t backward_smem_bytes() {
  if constexpr (kHasCompactBackward<T, kD>) {
    cudaError_t err = cudaSuccess;
    const int optin = smem_per_block(err);
    if (err == cudaSuccess && static_cast<size_t>(optin) < BwdLayout<T, kD>::kBytes) {
      return CompactBwdLayout<T, kD>::kBytes;
    }
  }
  return BwdLayout<T, kD>::kBytes;
}

// The main kernel with the tiles of layout L.
template <typename L, typename Kernel, typename Params>
cudaError_t launch_main(Kernel kernel, const Params& p, cudaStream_t stream) {
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kBytes);
  if (err != cudaSuccess || L::blocks(p) == 0) return err;
  kernel<<<static_cast<unsigned>(L::grid(p)), kThreads, L::kBytes, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, int kD>
cudaError_t launch_backward(const BwdParams<AccType<T>>& p, cudaStream_t stream) {
  if (preprocess_blocks(p) > 0) {
    attention_bwd_preprocess_kernel<T>
        <<<static_cast<unsigned>(preprocess_blocks(p)), kThreads, 0, stream>>>(p);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  if constexpr (kHasCompactBackward<T, kD>) {
    cudaError_t err = cudaSuccess;
    const int optin = smem_per_block(err);
    if (err != cudaSuccess) return err;
    if (use_compact_backward<T, kD>(p, optin)) {
      return launch_main<CompactBwdLayout<T, kD>>(attention_bwd_compact_kernel<T, kD>, p, stream);
    }
  }
  using L = BwdLayout<T, kD>;
  // The grouped kernel (the tensor-core families' guard) exists for their 16-bit inputs only.
  auto kernel = attention_bwd_kernel<T, kD, false>;
  if constexpr (kIs16Bit<T>) {
    if (grouped(p)) kernel = attention_bwd_kernel<T, kD, true>;
  } else {
    if (grouped(p)) return cudaErrorInvalidValue;
  }
  const cudaError_t err = launch_main<L>(kernel, p, stream);
  if (err != cudaSuccess || !grouped(p) || preprocess_blocks(p) == 0) return err;
  attention_bwd_postprocess_kernel<T>
      <<<static_cast<unsigned>(preprocess_blocks(p)), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace entropy_attn::cuda::fallback
