// Host side of the tensor-core forward: the definition of launch_forward (launch.h), explicitly
// instantiated by the generated translation units under instantiations/.
#pragma once

#include <cuda_runtime_api.h>

#include "../params.h"
#include "fwd_kernel.cuh"
#include "launch.h"
#include "split_kv.cuh"

namespace entropy_attn::cuda::sm80 {

// One block per (query tile, head, batch): a 3-D grid, so that no index is a product that could
// overflow 32 bits (the host keeps heads and batch within the grid's 65535 limit); with split-KV
// (p.num_splits > 1, which only the general, kCausal, instantiations take) one per (split, query
// tile, head, batch), followed by the combine kernel (split_kv.cuh). The host has checked the
// family's preconditions: head_dim == v_head_dim == kHeadDim, 16-byte aligned bases, row/head/batch
// strides that are multiples of 8 elements (the output's too: the host allocates it, with strides
// that are multiples of Dv), contiguous row statistics, and allocated the split workspace.
template <typename T, int kHeadDim, bool kCausal, MaskKind kMask, bool kStats>
cudaError_t launch_forward(const FwdParams<float>& p, cudaStream_t stream) {
  using Traits = fwd_impl::FwdTraits<T, kHeadDim, kMask, kStats>;
  const auto kernel = &fwd_impl::forward_kernel<Traits, kCausal, kMask, kStats>;
  constexpr int kSmem = Traits::kSmemBytes;
  if constexpr (kSmem > 48 * 1024) {
    // Above 48 KB a kernel must opt in to dynamic shared memory.
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (err != cudaSuccess) return err;
  }
  const int64_t tiles = (p.q_len + Traits::kBlockM - 1) / Traits::kBlockM;
  const int splits = kCausal ? p.num_splits : 1;  // (split-KV: the general instantiations)
  const dim3 grid(static_cast<unsigned>(tiles * splits), static_cast<unsigned>(p.heads),
                  static_cast<unsigned>(p.batch));
  kernel<<<grid, Traits::kThreads, kSmem, stream>>>(p);
  if constexpr (kCausal) {  // (so that the full-attention units do not instantiate the combine)
    if (splits > 1) {
      const cudaError_t err = cudaGetLastError();
      if (err != cudaSuccess) return err;
      const int64_t rows = p.batch * p.heads * p.q_len;
      constexpr int kWarps = fwd_impl::kCombineWarps;
      fwd_impl::split_combine_kernel<T, kHeadDim, kStats>
          <<<static_cast<unsigned>((rows + kWarps - 1) / kWarps), kWarps * 32, 0, stream>>>(p);
    }
  }
  return cudaGetLastError();
}

}  // namespace entropy_attn::cuda::sm80
