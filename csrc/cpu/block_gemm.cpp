#include "block_gemm.h"

#include <ATen/ATen.h>
#include <ATen/native/CPUBlas.h>

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

// K = 0: the product is empty, so C keeps its value or becomes 0. Returns true if nothing is left.
template <typename T>
bool trivial_product(int64_t M, int64_t N, int64_t K, T* C, int64_t ldc, bool accumulate) {
  if (M == 0 || N == 0) return true;
  if (K != 0) return false;
  if (!accumulate) {
    for (int64_t i = 0; i < M; ++i) std::fill(C + i * ldc, C + i * ldc + N, T(0));
  }
  return true;
}

}  // namespace

template <>
void block_gemm<float>(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
                       int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  if (trivial_product(M, N, K, C, ldc, accumulate)) return;
  // is_vnni = false: plain row-major B. Where oneDNN has no micro-kernel for this CPU, ATen falls
  // back to its BLAS gemm itself.
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, accumulate, A, B, C, /*is_vnni=*/false);
}

template <>
void block_gemm<double>(int64_t M, int64_t N, int64_t K, const double* A, int64_t lda,
                        const double* B, int64_t ldb, double* C, int64_t ldc, bool accumulate) {
  if (trivial_product(M, N, K, C, ldc, accumulate)) return;
  auto view = [](const double* data, int64_t rows, int64_t cols, int64_t ld) {
    return at::from_blob(const_cast<double*>(data), {rows, cols}, {ld, 1},
                         at::TensorOptions().dtype(at::kDouble));
  };
  at::Tensor c = view(C, M, N, ldc);
  const at::Tensor a = view(A, M, K, lda), b = view(B, K, N, ldb);
  if (accumulate) {
    at::addmm_out(c, c, a, b);
  } else {
    at::mm_out(c, a, b);
  }
}

template <typename T>
void transpose_block(int64_t rows, int64_t cols, const T* src, int64_t ld_src, T* dst,
                     int64_t ld_dst) {
  // Tiles of 16 x 16 keep both the reads and the writes within a few cache lines.
  constexpr int64_t kTile = 16;
  for (int64_t i0 = 0; i0 < rows; i0 += kTile) {
    const int64_t i1 = std::min(rows, i0 + kTile);
    for (int64_t j0 = 0; j0 < cols; j0 += kTile) {
      const int64_t j1 = std::min(cols, j0 + kTile);
      for (int64_t j = j0; j < j1; ++j) {
        for (int64_t i = i0; i < i1; ++i) dst[j * ld_dst + i] = src[i * ld_src + j];
      }
    }
  }
}

template void transpose_block<float>(int64_t, int64_t, const float*, int64_t, float*, int64_t);
template void transpose_block<double>(int64_t, int64_t, const double*, int64_t, double*, int64_t);

}  // namespace entropy_attn::cpu
