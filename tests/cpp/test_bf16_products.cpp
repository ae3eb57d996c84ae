// The CPU kernels' bfloat16 products (csrc/cpu/bf16_products.h): each packing checked entry by
// entry against the layout brgemm reads (B's (k, n) at (k / 2) * 2 ldb + 2 n + k % 2, zeros in the
// padding), the non-finite flags, and the products themselves against a plain triple loop on
// small integers (exact in float whatever the order of the sums), where the CPU has the kernel.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu/bf16_products.h"

namespace {

using c10::BFloat16;
using entropy_attn::cpu::bf16_gemm;
using entropy_attn::cpu::bf16_products_available;
using entropy_attn::cpu::pack_float_row_pairs;
using entropy_attn::cpu::pack_row_pairs;
using entropy_attn::cpu::pack_transposed_pairs;
using entropy_attn::cpu::pair_row_length;
using entropy_attn::cpu::release_bf16_products;

// B's entry (k, n) in pairs along k, row length ldb.
float paired(const std::vector<BFloat16>& b, int64_t ldb, int64_t k, int64_t n) {
  return b[(k / 2) * 2 * ldb + 2 * n + k % 2];
}

// n rows of `dim` small integers, row stride ld (the entries past dim are never read: NaN).
std::vector<BFloat16> rows_of(int64_t n, int64_t dim, int64_t ld) {
  std::vector<BFloat16> x(n * ld, std::numeric_limits<float>::quiet_NaN());
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t d = 0; d < dim; ++d) x[j * ld + d] = static_cast<float>((3 * j + d) % 7) - 3.f;
  }
  return x;
}

TEST(Bf16Products, TransposedPairsHoldKeysTransposed) {
  for (const int64_t n : {1, 16, 37}) {
    const int64_t dim = 10, ld = 14, ldb = pair_row_length(n);
    const std::vector<BFloat16> k = rows_of(n, dim, ld);
    std::vector<BFloat16> b(dim * ldb, 99.f);
    pack_transposed_pairs(n, dim, k.data(), ld, b.data(), ldb);
    for (int64_t d = 0; d < dim; ++d) {
      for (int64_t j = 0; j < ldb; ++j) {
        EXPECT_EQ(paired(b, ldb, d, j), j < n ? static_cast<float>(k[j * ld + d]) : 0.f)
            << "n " << n << " d " << d << " j " << j;
      }
    }
  }
}

TEST(Bf16Products, RowPairsInterleaveRowsAndFlagNonFiniteOnes) {
  for (const int64_t n : {1, 6, 7}) {
    const int64_t dim = 5, ld = 9, ldb = pair_row_length(dim);
    std::vector<BFloat16> v = rows_of(n, dim, ld);
    v[(n - 1) * ld + 2] = std::numeric_limits<float>::infinity();
    if (n > 1) v[0 * ld + 4] = std::numeric_limits<float>::quiet_NaN();
    std::vector<BFloat16> b((n + n % 2) * ldb, 99.f);
    std::vector<uint8_t> flags(n, 7);
    pack_row_pairs(n, dim, v.data(), ld, b.data(), ldb, flags.data());
    for (int64_t j = 0; j < n + n % 2; ++j) {
      for (int64_t d = 0; d < ldb; ++d) {
        const float want = j < n && d < dim ? static_cast<float>(v[j * ld + d]) : 0.f;
        const float got = paired(b, ldb, j, d);
        EXPECT_TRUE(got == want || (std::isnan(got) && std::isnan(want)))
            << "n " << n << " j " << j << " d " << d;
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      EXPECT_EQ(flags[j], j == n - 1 || (n > 1 && j == 0) ? 1 : 0) << "n " << n << " j " << j;
    }
  }
}

TEST(Bf16Products, FloatRowPairsScaleAndRoundEachRow) {
  for (const int64_t rows : {1, 4, 5}) {
    const int64_t n = 19, ld = 23, ldb = pair_row_length(n);
    std::vector<float> w(rows * ld), scale(rows);
    for (int64_t r = 0; r < rows; ++r) {
      scale[r] = 0.5f + r;
      for (int64_t j = 0; j < n; ++j) w[r * ld + j] = 1.f / (1 + r + j);
    }
    std::vector<BFloat16> b((rows + rows % 2) * ldb, 99.f);
    pack_float_row_pairs(rows, n, w.data(), ld, scale.data(), b.data(), ldb);
    for (int64_t r = 0; r < rows + rows % 2; ++r) {
      for (int64_t j = 0; j < ldb; ++j) {
        const float want =
            r < rows && j < n ? static_cast<float>(BFloat16(scale[r] * w[r * ld + j])) : 0.f;
        EXPECT_EQ(paired(b, ldb, r, j), want) << "rows " << rows << " r " << r << " j " << j;
      }
    }
  }
}

// C = A B^T's transpose packed (the scores' product), then C += the same (an accumulated product),
// for shapes with tails in every dimension.
TEST(Bf16Products, ProductsEqualThePlainSums) {
  if (!bf16_products_available()) {
    GTEST_SKIP() << "no oneDNN bfloat16 kernel on this CPU (AVX512-BF16 or AMX)";
  }
  for (const auto& [M, N, K] :
       {std::array<int64_t, 3>{1, 1, 2}, {3, 17, 10}, {64, 512, 128}, {33, 129, 66}}) {
    const int64_t lda = K + 2, ldb = pair_row_length(N);
    const std::vector<BFloat16> a = rows_of(M, K, lda), keys = rows_of(N, K, K);
    std::vector<BFloat16> b(K * ldb);
    pack_transposed_pairs(N, K, keys.data(), K, b.data(), ldb);
    std::vector<float> c(M * N, 5.f);
    bf16_gemm(M, N, K, a.data(), lda, b.data(), ldb, c.data(), N, false);
    bf16_gemm(M, N, K, a.data(), lda, b.data(), ldb, c.data(), N, true);
    release_bf16_products();
    for (int64_t i = 0; i < M; ++i) {
      for (int64_t j = 0; j < N; ++j) {
        float want = 0.f;
        for (int64_t k = 0; k < K; ++k)
          want += static_cast<float>(a[i * lda + k]) * keys[j * K + k];
        ASSERT_EQ(c[i * N + j], 2.f * want) << M << "x" << N << "x" << K << " at " << i << "," << j;
      }
    }
  }
}

}  // namespace
