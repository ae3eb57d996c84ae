// Host entry points of the CUDA kernels, explicitly instantiated per input type in the .cu files
// (attention_fwd_<type>.cu, attention_bwd_<type>.cu, attention_sparsity.cu,
// row_reductions.cu). T is float, double,
// __half or __nv_bfloat16. Each launches on `stream` and returns the launch's error code.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "params.h"

namespace entropy_attn::cuda {

// Dynamic shared memory one thread block of the kernel for max(head_dim, v_head_dim) = d needs.
template <typename T>
size_t attention_forward_smem_bytes(int64_t d);
template <typename T>
size_t attention_backward_smem_bytes(int64_t d);

template <typename T>
cudaError_t launch_attention_forward(const FwdParams<AccType<T>>& p, cudaStream_t stream);
// The preprocess (delta) and the main backward kernel; dq_accum must be zero-filled.
template <typename T>
cudaError_t launch_attention_backward(const BwdParams<AccType<T>>& p, cudaStream_t stream);

template <typename T>
size_t attention_sparsity_smem_bytes(int64_t d);
template <typename T>
cudaError_t launch_attention_sparsity(const SparsityParams<AccType<T>>& p, cudaStream_t stream);

template <typename T>
cudaError_t launch_row_entropy(const RowReductionParams& p, cudaStream_t stream);
template <typename T>
cudaError_t launch_row_sparsity(const RowReductionParams& p, cudaStream_t stream);

}  // namespace entropy_attn::cuda
