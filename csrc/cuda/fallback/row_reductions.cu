// Launches of the row-reduction kernels (row_reduction_kernels.cuh), for every input type.
#include "launch.h"
#include "row_reduction_kernels.cuh"

namespace entropy_attn::cuda::fallback {
namespace {

template <typename Kernel>
cudaError_t launch_rows(Kernel kernel, const RowReductionParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  kernel<<<static_cast<unsigned>(row_reduction_blocks(p)), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

template <typename T>
cudaError_t launch_row_entropy(const RowReductionParams& p, cudaStream_t stream) {
  return launch_rows(row_entropy_kernel<T>, p, stream);
}

template <typename T>
cudaError_t launch_row_sparsity(const RowReductionParams& p, cudaStream_t stream) {
  return launch_rows(row_sparsity_kernel<T>, p, stream);
}

#define EA_INSTANTIATE(T)                                                              \
  template cudaError_t launch_row_entropy<T>(const RowReductionParams&, cudaStream_t); \
  template cudaError_t launch_row_sparsity<T>(const RowReductionParams&, cudaStream_t);
EA_INSTANTIATE(float)
EA_INSTANTIATE(double)
EA_INSTANTIATE(__half)
EA_INSTANTIATE(__nv_bfloat16)
#undef EA_INSTANTIATE

}  // namespace entropy_attn::cuda::fallback
