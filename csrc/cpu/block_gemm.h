// Matrix products on blocks of row-major buffers for the CPU kernels: C = beta * C + op(A) op(B),
// with op(X) = X or X^T, routed through ATen's mm (MKL or OpenBLAS, with their runtime ISA
// dispatch). The kernels parallelize over their own tasks, so each task runs its products inside
// a SerialBlasScope.
#pragma once

#include <cstdint>

namespace entropy_attn::cpu {

// A is (M x K) when !trans_a, else stored (K x M); B is (K x N) when !trans_b, else stored (N x K).
// lda/ldb/ldc are row strides in elements; the last dimension of every buffer is contiguous.
template <typename T>
void block_gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const T* A,
                int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc, bool accumulate);

// Makes the BLAS single-threaded on this thread for the scope's lifetime. PyTorch turns MKL's
// dynamic threading off, so without it MKL opens a nested OpenMP team inside every task (seen in
// perf as gblock_by_k_omp spinning in libgomp: a 20x slowdown on 2 cores). A no-op for builds
// without MKL, whose BLAS does not nest inside an OpenMP region.
class SerialBlasScope {
 public:
  SerialBlasScope();
  ~SerialBlasScope();
  SerialBlasScope(const SerialBlasScope&) = delete;
  SerialBlasScope& operator=(const SerialBlasScope&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace entropy_attn::cpu
