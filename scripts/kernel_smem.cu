// Prints the dynamic shared memory per block of every attention kernel instantiation, as
// "<demangled kernel name> <bytes>" lines, for scripts/ptxas_report.py (ptxas only reports static
// shared memory). Host-only: compiled by nvcc and run on the CPU, no GPU needed.
#include <cstdio>

#include "cuda/fallback/bwd_kernel.cuh"
#include "cuda/fallback/fwd_kernel.cuh"
#include "cuda/fallback/sparsity_kernel.cuh"

namespace ea = entropy_attn::cuda::fallback;

template <typename T>
const char* type_name() {
  if constexpr (std::is_same_v<T, float>) return "float";
  if constexpr (std::is_same_v<T, double>) return "double";
  if constexpr (std::is_same_v<T, __half>) return "__half";
  return "__nv_bfloat16";
}

template <typename T, int kD>
void print_kernels() {
  const char* t = type_name<T>();
  std::printf("entropy_attn::cuda::fallback::attention_fwd_kernel<%s, %d> %zu\n", t, kD,
              ea::FwdLayout<T, kD>::kBytes);
  std::printf("entropy_attn::cuda::fallback::attention_bwd_kernel<%s, %d, false> %zu\n", t, kD,
              ea::BwdLayout<T, kD>::kBytes);
  if constexpr (ea::kIs16Bit<T>) {  // the tensor-core families' guard
    std::printf("entropy_attn::cuda::fallback::attention_bwd_kernel<%s, %d, true> %zu\n", t, kD,
                ea::BwdLayout<T, kD>::kBytes);
  }
  if constexpr (ea::kHasCompactBackward<T, kD>) {  // for GPUs of 99 KB per block
    std::printf("entropy_attn::cuda::fallback::attention_bwd_compact_kernel<%s, %d> %zu\n", t, kD,
                ea::CompactBwdLayout<T, kD>::kBytes);
  }
  std::printf("entropy_attn::cuda::fallback::attention_sparsity_kernel<%s, %d> %zu\n", t, kD,
              ea::SparsityLayout<T, kD>::kBytes);
}

template <typename T>
void print_type(bool with_256) {
  print_kernels<T, 64>();
  print_kernels<T, 128>();
  if constexpr (!std::is_same_v<T, double>) {
    if (with_256) print_kernels<T, 256>();
  }
}

int main() {
  print_type<float>(true);
  print_type<double>(false);  // float64 stops at head dim 128 on CUDA (params.h)
  print_type<__half>(true);
  print_type<__nv_bfloat16>(true);
  return 0;
}
