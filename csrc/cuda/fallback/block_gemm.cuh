// Block-wide products of shared-memory tiles, C = A B (M x N, inner dimension K), computed by all
// kThreads threads of a block. Results are handed to epilogue(m, n, value), called exactly once per
// element of C: the callers store, accumulate, rescale-and-add or atomically add through it.
//   A(m, k) = a[m * lda + k] (row-major) or a[k * lda + m] (kAColMajor: a stored transposed),
//   B(k, n) = b[k * ldb + n] (row-major) or b[n * ldb + k] (kBColMajor).
// 16-bit inputs use tensor cores (WMMA 16x16x16, fp32 accumulation) on sm_80 and newer; float,
// double (and 16-bit on older GPUs) use CUDA cores with register micro-tiles.
#pragma once

#include <mma.h>

#include <type_traits>

#include "device_utils.cuh"

namespace entropy_attn::cuda::fallback {

// CUDA-core product: the 16 x 8 threads of the block each own an RM x RN micro-tile of every
// (up to) 64 x 64 chunk of C, rows ty + 16 i and columns tx + 8 j, so that each loaded value is
// used RM or RN times from registers.
template <int M, int N, int K, typename Acc, typename TA, typename TB, typename Epilogue>
__device__ __forceinline__ void gemm_simt(const TA* a, int a_rs, int a_cs, const TB* b, int b_rs,
                                          int b_cs, Epilogue&& epilogue) {
  constexpr int CM = M < 64 ? M : 64, CN = N < 64 ? N : 64;
  static_assert(kThreads == 128, "the micro-tile layout assumes 16 x 8 threads");
  static_assert(M % CM == 0 && N % CN == 0 && CM % 16 == 0 && CN % 8 == 0, "tile shape");
  constexpr int RM = CM / 16, RN = CN / 8;
  const int ty = threadIdx.x / 8, tx = threadIdx.x % 8;
  for (int mc = 0; mc < M; mc += CM) {
    for (int nc = 0; nc < N; nc += CN) {
      Acc acc[RM][RN];
#pragma unroll
      for (int i = 0; i < RM; ++i) {
#pragma unroll
        for (int j = 0; j < RN; ++j) acc[i][j] = Acc(0);
      }
#pragma unroll 4
      for (int k = 0; k < K; ++k) {
        Acc av[RM], bv[RN];
#pragma unroll
        for (int i = 0; i < RM; ++i) av[i] = to_acc(a[(mc + ty + 16 * i) * a_rs + k * a_cs]);
#pragma unroll
        for (int j = 0; j < RN; ++j) bv[j] = to_acc(b[k * b_rs + (nc + tx + 8 * j) * b_cs]);
#pragma unroll
        for (int i = 0; i < RM; ++i) {
#pragma unroll
          for (int j = 0; j < RN; ++j) acc[i][j] += av[i] * bv[j];
        }
      }
#pragma unroll
      for (int i = 0; i < RM; ++i) {
#pragma unroll
        for (int j = 0; j < RN; ++j) epilogue(mc + ty + 16 * i, nc + tx + 8 * j, acc[i][j]);
      }
    }
  }
}

// Tensor-core product: each warp takes 16 x 16 tiles of C in turn, accumulates them in a WMMA
// fragment, stores the fragment to its own 16 x 16 float scratch (the fragment's element layout is
// opaque) and applies the epilogue from there.
template <int M, int N, int K, bool kAColMajor, bool kBColMajor, typename T, typename Epilogue>
__device__ __forceinline__ void gemm_wmma(const T* a, int lda, const T* b, int ldb, float* scratch,
                                          Epilogue&& epilogue) {
  namespace wmma = nvcuda::wmma;
  static_assert(M % 16 == 0 && N % 16 == 0 && K % 16 == 0, "WMMA tiles are 16 x 16 x 16");
  using LayoutA = std::conditional_t<kAColMajor, wmma::col_major, wmma::row_major>;
  using LayoutB = std::conditional_t<kBColMajor, wmma::col_major, wmma::row_major>;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* tile = scratch + warp * 256;
  // A trip count the same for every warp and known to ptxas: lanes it cannot prove converged would
  // make each __syncwarp and shuffle a call, and values live across calls are spilled.
  constexpr int kTiles = (M / 16) * (N / 16);
  static_assert(kTiles % kWarps == 0 || kTiles < kWarps,
                "every warp takes the same number of output tiles");
  if constexpr (kTiles < kWarps) {
    // (the 16 x 16 products of the compact backward's tiles: the warps past them sit out; the
    // caller synchronizes the block after the call)
    if (warp >= kTiles) return;
  }
  for (int tw = 0; tw < (kTiles + kWarps - 1) / kWarps; ++tw) {
    const int t = warp + tw * kWarps;
    const int m0 = (t / (N / 16)) * 16, n0 = (t % (N / 16)) * 16;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
    wmma::fill_fragment(c, 0.0f);
#pragma unroll 2
    for (int k0 = 0; k0 < K; k0 += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, LayoutA> fa;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, LayoutB> fb;
      wmma::load_matrix_sync(fa, kAColMajor ? a + k0 * lda + m0 : a + m0 * lda + k0, lda);
      wmma::load_matrix_sync(fb, kBColMajor ? b + n0 * ldb + k0 : b + k0 * ldb + n0, ldb);
      wmma::mma_sync(c, fa, fb, c);
    }
    wmma::store_matrix_sync(tile, c, 16, wmma::mem_row_major);
    __syncwarp();
    for (int e = lane; e < 256; e += 32) epilogue(m0 + e / 16, n0 + e % 16, tile[e]);
    __syncwarp();
  }
}

// C = A B with tensor cores where they apply. `scratch` (kWarps x 256 floats of shared memory) is
// used by the tensor-core path only. The caller synchronizes the block around the call.
template <int M, int N, int K, bool kAColMajor, bool kBColMajor, typename Acc, typename T,
          typename Epilogue>
__device__ __forceinline__ void block_gemm(const T* a, int lda, const T* b, int ldb, float* scratch,
                                           Epilogue&& epilogue) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr bool kTensorCores = kIs16Bit<T>;
#else
  constexpr bool kTensorCores = false;  // host pass, or GPUs without bf16 WMMA
#endif
  if constexpr (kTensorCores) {
    gemm_wmma<M, N, K, kAColMajor, kBColMajor>(a, lda, b, ldb, scratch, epilogue);
  } else {
    (void)scratch;
    gemm_simt<M, N, K, Acc>(a, kAColMajor ? 1 : lda, kAColMajor ? lda : 1, b, kBColMajor ? 1 : ldb,
                            kBColMajor ? ldb : 1, epilogue);
  }
}

// Raw scores S = Q K^T of a query tile (rows of sQ) and a key tile (rows of sK), both with leading
// dimension ld, into sS (leading dimension lds).
template <int kBM, int kBN, int kD, typename Acc, typename T>
__device__ __forceinline__ void scores(const T* sQ, const T* sK, int ld, Acc* sS, int lds,
                                       float* scratch) {
  block_gemm<kBM, kBN, kD, false, true, Acc>(sQ, ld, sK, ld, scratch,
                                             [=](int m, int n, Acc x) { sS[m * lds + n] = x; });
}

}  // namespace entropy_attn::cuda::fallback
