// Host side of the Hopper forward: the definition of launch_forward (launch.h), explicitly
// instantiated by the generated translation units under instantiations/.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../params.h"
#include "fwd_kernel.cuh"
#include "launch.h"

namespace entropy_attn::cuda::sm90 {

template <typename T, int kHeadDim, bool kCausal, MaskKind kMask, bool kStats>
cudaError_t launch_forward(const FwdParams<float>& p, cudaStream_t stream) {
  using Kt = fwd_impl::FwdTraits<T, kHeadDim, kMask>;
  cudaError_t err = device_is_sm90();
  if (err != cudaSuccess) return err;
  if (!covers(p, kHeadDim, kCausal)) return cudaErrorNotSupported;
  // (A 1-D grid's limit; 2^31 tiles would be 2^38 query rows.)
  if (fwd_impl::tile_count<Kt>(p) >= (int64_t{1} << 31)) return cudaErrorInvalidValue;
  const fwd_impl::KernelArgs<Kt> args = fwd_impl::make_kernel_args<Kt>(p);
  const auto kernel = &fwd_impl::forward_kernel<T, Kt, kCausal, kMask, kStats>;
  constexpr int kSmem = Kt::kSmemBytes;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return err;
  kernel<<<fwd_impl::grid<Kt>(p), Kt::kThreads, kSmem, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace entropy_attn::cuda::sm90
