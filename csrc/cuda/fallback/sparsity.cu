// Launch of the CUDA attention_sparsity kernel (attention_sparsity_kernel.cuh), for every input
// type: the kernel is the forward's without values, small enough for one translation unit.
#include "launch.h"
#include "sparsity_kernel.cuh"

namespace entropy_attn::cuda::fallback {
namespace {

template <typename T, int kD>
cudaError_t launch_d(const SparsityParams<AccType<T>>& p, cudaStream_t stream) {
  using L = SparsityLayout<T, kD>;
  const auto kernel = attention_sparsity_kernel<T, kD>;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kBytes);
  if (err != cudaSuccess) return err;
  kernel<<<static_cast<unsigned>(L::blocks(p)), kThreads, L::kBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

template <typename T>
size_t attention_sparsity_smem_bytes(int64_t d) {
  switch (head_dim_bucket(d)) {
    case 64:
      return SparsityLayout<T, 64>::kBytes;
    case 128:
      return SparsityLayout<T, 128>::kBytes;
    default:
      if constexpr (std::is_same_v<T, double>) {
        return 0;  // unsupported: the host rejects float64 beyond kMaxHeadDimFloat64
      } else {
        return SparsityLayout<T, 256>::kBytes;
      }
  }
}

template <typename T>
cudaError_t launch_attention_sparsity(const SparsityParams<AccType<T>>& p, cudaStream_t stream) {
  switch (head_dim_bucket(p.head_dim)) {
    case 64:
      return launch_d<T, 64>(p, stream);
    case 128:
      return launch_d<T, 128>(p, stream);
    default:
      if constexpr (std::is_same_v<T, double>) {
        return cudaErrorInvalidValue;  // the host rejects float64 beyond kMaxHeadDimFloat64
      } else {
        return launch_d<T, 256>(p, stream);
      }
  }
}

#define EA_INSTANTIATE(T)                                                              \
  template size_t attention_sparsity_smem_bytes<T>(int64_t);                           \
  template cudaError_t launch_attention_sparsity<T>(const SparsityParams<AccType<T>>&, \
                                                    cudaStream_t);
EA_INSTANTIATE(float)
EA_INSTANTIATE(double)
EA_INSTANTIATE(__half)
EA_INSTANTIATE(__nv_bfloat16)
#undef EA_INSTANTIATE

}  // namespace entropy_attn::cuda::fallback
