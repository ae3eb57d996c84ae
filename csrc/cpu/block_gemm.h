// Matrix products on blocks of row-major buffers for the CPU kernels: C = [C +] A B, every operand
// row-major with a unit column stride (the kernels keep transposed copies of K, V and small blocks
// rather than asking for transposed operands). float goes through ATen's exported brgemm (oneDNN's
// JIT micro-kernel, with runtime ISA dispatch: measured 2.3x faster than MKL's sgemm on the blocks
// of attention on an AVX-512 AMD CPU, where MKL stays on its AVX2 path) where oneDNN can use
// AVX-512, and through ATen's mm (MKL) elsewhere, where brgemm's AVX2 kernel was the slower one
// (block_gemm.cpp); double through ATen's mm.
// The kernels parallelize over their own tasks, so each task runs its products inside a
// SerialBlasScope.
#pragma once

#include <cstdint>

namespace entropy_attn::cpu {

// C (M x N, row stride ldc) = [C +] A (M x K, row stride lda) . B (K x N, row stride ldb).
template <typename T>
void block_gemm(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb,
                T* C, int64_t ldc, bool accumulate);

// dst (cols x rows, row stride ld_dst) = src^T, src being (rows x cols, row stride ld_src).
template <typename T>
void transpose_block(int64_t rows, int64_t cols, const T* src, int64_t ld_src, T* dst,
                     int64_t ld_dst);

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
