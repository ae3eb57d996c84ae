#include "block_gemm.h"

#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>

#include <cstdlib>
#include <string>

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

// ENTROPY_ATTN_CPU_GEMM, read once: "brgemm", "blas" or "brgemm_float" (brgemm, with 16-bit inputs
// widened to float32 for it rather than multiplied as bfloat16: bf16_products.h), or unset.
const std::string& forced_gemm() {
  static const std::string forced = [] {
    const char* f = std::getenv("ENTROPY_ATTN_CPU_GEMM");
    const std::string s = f ? f : "";
    TORCH_CHECK_VALUE(s.empty() || s == "brgemm" || s == "blas" || s == "brgemm_float",
                      "ENTROPY_ATTN_CPU_GEMM must be brgemm, brgemm_float or blas, got '", s, "'");
    return s;
  }();
  return forced;
}

}  // namespace

// brgemm's AVX-512 micro-kernel is what makes the CPU kernels fast (benchmarks/results/cpu_isa.md:
// the headline point 173 ms against SDPA's 348); without AVX-512 (oneDNN capped at AVX2) it took
// 384 ms where MKL's sgemm took 353. So: brgemm where oneDNN can use AVX-512, MKL elsewhere on x86;
// ENTROPY_ATTN_CPU_GEMM forces one.
bool use_brgemm() {
  static const bool brgemm = [] {
    if (!forced_gemm().empty()) return forced_gemm() != "blas";
#if defined(__x86_64__) && defined(__GNUC__)
    // oneDNN's own cap on its instruction set: AVX512_CORE..., AMX... and ALL/DEFAULT keep AVX-512.
    if (const char* cap = std::getenv("ONEDNN_MAX_CPU_ISA")) {
      const std::string c = cap;
      if (c.rfind("AVX512", 0) != 0 && c.rfind("AVX10", 0) != 0 && c.rfind("AMX", 0) != 0 &&
          c != "ALL" && c != "DEFAULT") {
        return false;
      }
    }
    return __builtin_cpu_supports("avx512f") != 0;
#else
    return true;  // elsewhere oneDNN chooses, and falls back to the BLAS itself
#endif
  }();
  return brgemm;
}

bool brgemm_takes_16_bit() { return use_brgemm() && forced_gemm() != "brgemm_float"; }

namespace {

// C (M x N, row stride ldc) [+]= A B through ATen's mm on strided views of the buffers.
template <typename T>
void mm_product(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb,
                T* C, int64_t ldc, bool accumulate) {
  auto view = [](const T* data, int64_t rows, int64_t cols, int64_t ld) {
    return at::from_blob(const_cast<T*>(data), {rows, cols}, {ld, 1},
                         at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value));
  };
  at::Tensor c = view(C, M, N, ldc);
  const at::Tensor a = view(A, M, K, lda), b = view(B, K, N, ldb);
  if (accumulate) {
    at::addmm_out(c, c, a, b);
  } else {
    at::mm_out(c, a, b);
  }
}

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
  if (!use_brgemm()) return mm_product(M, N, K, A, lda, B, ldb, C, ldc, accumulate);
  // is_vnni = false: plain row-major B. Where oneDNN has no micro-kernel for this CPU, ATen falls
  // back to its BLAS gemm itself.
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, accumulate, A, B, C, /*is_vnni=*/false);
}

template <>
void block_gemm<double>(int64_t M, int64_t N, int64_t K, const double* A, int64_t lda,
                        const double* B, int64_t ldb, double* C, int64_t ldc, bool accumulate) {
  if (trivial_product(M, N, K, C, ldc, accumulate)) return;
  mm_product(M, N, K, A, lda, B, ldb, C, ldc, accumulate);
}

}  // namespace entropy_attn::cpu
