// Host entry points of the fallback family: the generic CUDA kernels for every dtype and any GPU
// since sm_80, with causality and the mask kind as runtime arguments. T is float, double, __half or
// __nv_bfloat16; kD the head-dim bucket (64, 128, 256; padded, 128 at most for double). The
// attention forward and backward are instantiated per (T, kD) as csrc/cuda/kernels.toml lists them,
// in the generated translation units of instantiations/; attention_sparsity and the row reductions
// in sparsity.cu and row_reductions.cu. Each launches on `stream` and returns the launch's error
// code.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "../params.h"

namespace entropy_attn::cuda::fallback {

// Dynamic shared memory of one thread block of the kernel.
template <typename T, int kD>
size_t forward_smem_bytes();
template <typename T, int kD>
size_t backward_smem_bytes();

template <typename T, int kD>
cudaError_t launch_forward(const FwdParams<AccType<T>>& p, cudaStream_t stream);
// The preprocess (delta) and the main backward kernel; dq_accum must be zero-filled. With
// p.nonfinite set, the guard of a tensor-core backward (params.h): it then writes that family's
// outputs (dq_out, dk_out, dv_out, d_row_scale), zero-filling dq_accum itself, or nothing.
template <typename T, int kD>
cudaError_t launch_backward(const BwdParams<AccType<T>>& p, cudaStream_t stream);

template <typename T>
size_t attention_sparsity_smem_bytes(int64_t d);
template <typename T>
cudaError_t launch_attention_sparsity(const SparsityParams<AccType<T>>& p, cudaStream_t stream);

template <typename T>
cudaError_t launch_row_entropy(const RowReductionParams& p, cudaStream_t stream);
template <typename T>
cudaError_t launch_row_sparsity(const RowReductionParams& p, cudaStream_t stream);

}  // namespace entropy_attn::cuda::fallback
