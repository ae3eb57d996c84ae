// launch_backward of the Hopper family (declared in launch.h): the sm80 family's delta
// preprocess, the Hopper main kernel over key blocks (bwd_kernel.cuh), the sm80 family's dq /
// d lambda postprocess, all on one stream. A generated translation unit under instantiations/
// includes this file and instantiates one (T, head dim, causal, mask kind).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../params.h"
#include "../sm80/bwd_launch.cuh"  // its pre- and postprocess kernels and row_grid
#include "bwd_kernel.cuh"
#include "launch.h"

namespace entropy_attn::cuda::sm90 {

template <typename T, int kHeadDim, bool kCausal, MaskKind kMask>
cudaError_t launch_backward(const BwdParams<float>& p, cudaStream_t stream) {
  using Kt = bwd_impl::BwdTraits<T, kHeadDim>;
  using Kt80 = sm80::bwd::BwdTraits<T, kHeadDim>;  // the pre- and postprocess
  using Element = typename Kt::Element;
  using namespace cute;

  cudaError_t err = device_is_sm90();
  if (err != cudaSuccess) return err;
  if (!backward_covers(p, kHeadDim, kCausal)) return cudaErrorNotSupported;
  if (p.batch <= 0 || p.heads <= 0 || p.q_len <= 0 || p.kv_len <= 0) return cudaSuccess;

  const dim3 block80(Kt80::kNThreads);
  sm80::bwd::preprocess_kernel<Kt80>
      <<<sm80::bwd::row_grid(p.q_len, Kt80::kPreRows, p.heads, p.batch), block80, 0, stream>>>(p);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;

  const View4 q = tma_strides(p.q, p.q_len, p.heads, kHeadDim);
  const View4 dout = tma_strides(p.dout, p.q_len, p.heads, kHeadDim);
  const View4 k = tma_strides(p.k, p.kv_len, p.kv_heads, kHeadDim);
  const View4 v = tma_strides(p.v, p.kv_len, p.kv_heads, kHeadDim);
  // (rows, D, heads, batch) with the D stride 1; the batch stride of a single-entry batch is
  // never used either: the head stride times the heads.
  const auto tensor = [&](const View4& t, int64_t len, int64_t heads) {
    return make_tensor(make_gmem_ptr(static_cast<const Element*>(t.data)),
                       ShapeQKV(static_cast<int32_t>(len), kHeadDim, static_cast<int32_t>(heads),
                                static_cast<int32_t>(p.batch)),
                       StrideQK(t.sl, _1{}, t.sh, p.batch == 1 ? heads * t.sh : t.sb));
  };
  const auto q_box = take<0, 2>(typename Kt::SmemLayoutQ{});
  const typename Kt::SmemLayoutK kv_box{};
  bwd_impl::KernelArgs<Kt> args{
      p, make_tma_copy(SM90_TMA_LOAD{}, tensor(q, p.q_len, p.heads), q_box),
      make_tma_copy(SM90_TMA_LOAD{}, tensor(dout, p.q_len, p.heads), q_box),
      make_tma_copy(SM90_TMA_LOAD{}, tensor(k, p.kv_len, p.kv_heads), kv_box),
      make_tma_copy(SM90_TMA_LOAD{}, tensor(v, p.kv_len, p.kv_heads), kv_box)};

  const auto kernel = &bwd_impl::main_kernel<T, Kt, kCausal, kMask>;
  constexpr int kSmem = Kt::kSmemBytes;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>((p.kv_len + Kt::kBlockN - 1) / Kt::kBlockN),
                  static_cast<unsigned>(p.kv_heads), static_cast<unsigned>(p.batch));
  kernel<<<grid, Kt::kThreads, kSmem, stream>>>(args);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;

  sm80::bwd::postprocess_kernel<Kt80>
      <<<sm80::bwd::row_grid(p.q_len, Kt80::kPostRows, p.heads, p.batch), block80, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace entropy_attn::cuda::sm90
