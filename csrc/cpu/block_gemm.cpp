#include "block_gemm.h"

#include <ATen/ATen.h>

// MKL's thread-local thread count, exported by libtorch_cpu when it is built with MKL; weak so that
// the library still loads against a torch built with another BLAS.
extern "C" int MKL_Set_Num_Threads_Local(int) __attribute__((weak));

namespace entropy_attn::cpu {

SerialBlasScope::SerialBlasScope() {
  if (MKL_Set_Num_Threads_Local) previous_ = MKL_Set_Num_Threads_Local(1);
}

SerialBlasScope::~SerialBlasScope() {
  // 0 restores "follow the global setting", the state before the scope.
  if (MKL_Set_Num_Threads_Local) MKL_Set_Num_Threads_Local(previous_);
}

namespace {

template <typename T>
at::Tensor view(const T* data, int64_t rows, int64_t cols, int64_t ld) {
  return at::from_blob(const_cast<T*>(data), {rows, cols}, {ld, 1},
                       at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value));
}

}  // namespace

template <typename T>
void block_gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const T* A,
                int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc, bool accumulate) {
  if (M == 0 || N == 0) return;
  at::Tensor c = view(C, M, N, ldc);
  if (K == 0) {
    if (!accumulate) c.zero_();
    return;
  }
  const at::Tensor a = trans_a ? view(A, K, M, lda).t() : view(A, M, K, lda);
  const at::Tensor b = trans_b ? view(B, N, K, ldb).t() : view(B, K, N, ldb);
  if (accumulate) {
    at::addmm_out(c, c, a, b);
  } else {
    at::mm_out(c, a, b);
  }
}

template void block_gemm<float>(bool, bool, int64_t, int64_t, int64_t, const float*, int64_t,
                                const float*, int64_t, float*, int64_t, bool);
template void block_gemm<double>(bool, bool, int64_t, int64_t, int64_t, const double*, int64_t,
                                 const double*, int64_t, double*, int64_t, bool);

}  // namespace entropy_attn::cpu
