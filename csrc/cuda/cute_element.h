// The CUTLASS element type of the same bits as a torch-facing CUDA type: CuTe's MMA and copy atoms
// are written for cutlass::bfloat16_t and cutlass::half_t. Shared by the tensor-core families.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cutlass/numeric_types.h>

namespace entropy_attn::cuda {

template <typename T>
struct CuteElement;
template <>
struct CuteElement<__nv_bfloat16> {
  using type = cutlass::bfloat16_t;
};
template <>
struct CuteElement<__half> {
  using type = cutlass::half_t;
};

}  // namespace entropy_attn::cuda
