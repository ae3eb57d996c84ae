// launch_backward of the Hopper family (declared in launch.h): the sm80 family's delta
// preprocess (with a deterministic call's turn counters: bwd_kernel.cuh), the Hopper main kernel
// over key blocks (bwd_kernel.cuh), the sm80 family's dq / d lambda postprocess, all on one stream.
// A generated translation unit under instantiations/ includes this file and instantiates one (T,
// head dim, causal, mask kind).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../params.h"
#include "../sm80/bwd_launch.cuh"  // its pre- and postprocess kernels and row_grid
#include "bwd_kernel.cuh"
#include "launch.h"

namespace entropy_attn::cuda::sm90 {

template <typename T, int kHeadDim, bool kCausal, MaskKind kMask>
cudaError_t launch_backward(const BwdParams<float>& given, cudaStream_t stream) {
  using Kt = bwd_impl::BwdTraits<T, kHeadDim>;
  using Kt80 = sm80::bwd::BwdTraits<T, kHeadDim>;  // the pre- and postprocess

  // Without d lambda the kernels without a mask sum G = lambda dS K, which is dq (params.h:
  // g_scaled; bwd_kernel.cuh: kScalesG).
  const BwdParams<float> p = bwd_impl::launch_params<kMask>(given);

  cudaError_t err = device_is_sm90();
  if (err != cudaSuccess) return err;
  if (!backward_covers(p, kHeadDim, kCausal)) return cudaErrorNotSupported;
  if (p.batch <= 0 || p.heads <= 0 || p.q_len <= 0 || p.kv_len <= 0) return cudaSuccess;

  const dim3 block80(Kt80::kNThreads);
  bwd_impl::preprocess_kernel<Kt, Kt80>
      <<<sm80::bwd::row_grid(p.q_len, Kt80::kPreRows, p.heads, p.batch), block80, 0, stream>>>(p);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;

  const bwd_impl::KernelArgs<Kt> args = bwd_impl::make_kernel_args<Kt>(p);
  const auto kernel = bwd_impl::kernel_for<T, Kt, kCausal, kMask>(p);
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Kt::kSmemBytes);
  if (err != cudaSuccess) return err;
  kernel<<<bwd_impl::grid<Kt>(p), Kt::kThreads, bwd_impl::smem_bytes<Kt>(p), stream>>>(args);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;

  sm80::bwd::postprocess_kernel<Kt80>
      <<<sm80::bwd::row_grid(p.q_len, Kt80::kPostRows, p.heads, p.batch), block80, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace entropy_attn::cuda::sm90
