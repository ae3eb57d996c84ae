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

#include <algorithm>
#include <cstdint>

namespace entropy_attn::cpu {

// C (M x N, row stride ldc) = [C +] A (M x K, row stride lda) . B (K x N, row stride ldb).
template <typename T>
void block_gemm(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb,
                T* C, int64_t ldc, bool accumulate);
// Its two definitions (block_gemm.cpp), explicit specializations: declared before any use, as the
// language asks (the kernels that call them come before block_gemm.cpp in their directory's
// translation unit).
template <>
void block_gemm<float>(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
                       int64_t ldb, float* C, int64_t ldc, bool accumulate);
template <>
void block_gemm<double>(int64_t M, int64_t N, int64_t K, const double* A, int64_t lda,
                        const double* B, int64_t ldb, double* C, int64_t ldc, bool accumulate);

// dst (cols x rows, row stride ld_dst) = src^T, src being (rows x cols, row stride ld_src),
// converted to Dst (a 16-bit key block is widened to float32 as it is transposed). Tiles of
// 16 x 16 keep both the reads and the writes within a few cache lines: element by element, each
// source row would write to `cols` lines.
template <typename Src, typename Dst>
void transpose_block(int64_t rows, int64_t cols, const Src* src, int64_t ld_src, Dst* dst,
                     int64_t ld_dst) {
  constexpr int64_t kTile = 16;
  for (int64_t i0 = 0; i0 < rows; i0 += kTile) {
    const int64_t i1 = std::min(rows, i0 + kTile);
    for (int64_t j0 = 0; j0 < cols; j0 += kTile) {
      const int64_t j1 = std::min(cols, j0 + kTile);
      for (int64_t j = j0; j < j1; ++j) {
        for (int64_t i = i0; i < i1; ++i)
          dst[j * ld_dst + i] = static_cast<Dst>(src[i * ld_src + j]);
      }
    }
  }
}

// Whether the float products go through oneDNN's brgemm (else ATen's mm, i.e. MKL's sgemm).
bool use_brgemm();

// Whether brgemm may also take 16-bit operands as they are (bf16_products.h): not where
// ENTROPY_ATTN_CPU_GEMM=brgemm_float (or blas) says otherwise.
bool brgemm_takes_16_bit();

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
