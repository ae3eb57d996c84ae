#include "bf16_products.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <exception>
#include <vector>

#include "block_gemm.h"

namespace entropy_attn::cpu {
namespace {

// Two adjacent bfloat16 entries, moved as one 32-bit unit (2-byte aligned: inputs may start at any
// element).
struct Pair {
  uint16_t lo, hi;
};
static_assert(sizeof(Pair) == 4);

// Whether oneDNN generates the bfloat16 kernels here and they read B as packed below: products of
// small integers (exact in float whatever the order of the sums) with tails in every dimension,
// B's rows padded, a row stride of A longer than K, and C accumulated, checked entry by entry,
// once. Where oneDNN has no bfloat16 kernel (AVX-512 without BF16 or AMX, or oneDNN capped below
// them) ATen's brgemm lets oneDNN's "could not generate a kernel" (a dnnl::error) through: that
// is an answer, not an error.
bool probe_bf16_kernels() {
  for (const auto& [M, N, K] : {std::array<int64_t, 3>{5, 37, 66}, {64, 100, 128}}) {
    const int64_t lda = K + 6, ldb = pair_row_length(N);
    std::vector<c10::BFloat16> a(M * lda), rows(N * K), b(K * ldb);
    std::vector<float> c(M * N), expected(M * N, 0.f);
    for (int64_t i = 0; i < M * lda; ++i) a[i] = static_cast<float>(i % 5) - 2.f;
    for (int64_t i = 0; i < N * K; ++i) rows[i] = static_cast<float>(i % 7) - 3.f;
    for (int64_t i = 0; i < M; ++i) {
      for (int64_t j = 0; j < N; ++j) {
        for (int64_t k = 0; k < K; ++k) {
          expected[i * N + j] += static_cast<float>(a[i * lda + k]) * rows[j * K + k];
        }
        expected[i * N + j] *= 2.f;  // two products, the second accumulated
      }
    }
    pack_transposed_pairs(N, K, rows.data(), K, b.data(), ldb);
    try {
      bf16_gemm(M, N, K, a.data(), lda, b.data(), ldb, c.data(), N, false);
      bf16_gemm(M, N, K, a.data(), lda, b.data(), ldb, c.data(), N, true);
      release_bf16_products();
    } catch (const std::exception&) {  // ATen's c10::Error, or oneDNN's dnnl::error
      return false;
    }
    if (c != expected) return false;
  }
  return true;
}

}  // namespace

bool bf16_products_available() {
  // (mkldnn is checked per call: torch.backends.mkldnn.enabled may change, and brgemm's bfloat16
  // path raises while it is off)
  if (!brgemm_takes_16_bit() || !at::globalContext().userEnabledMkldnn()) return false;
  static const bool kernels = probe_bf16_kernels();
  return kernels;
}

void bf16_gemm(int64_t M, int64_t N, int64_t K, const c10::BFloat16* A, int64_t lda,
               const c10::BFloat16* B, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    if (!accumulate) {
      for (int64_t i = 0; i < M; ++i) std::fill(C + i * ldc, C + i * ldc + N, 0.f);
    }
    return;
  }
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, accumulate, A, B, C, /*is_vnni=*/true);
}

void release_bf16_products() { at::native::cpublas::brgemm_release(true); }

void transpose_pairs(int64_t n, int64_t dim, const c10::BFloat16* rows, int64_t ld,
                     c10::BFloat16* dst, int64_t ldb) {
  // Row j's pair p (entries 2p, 2p + 1) goes to B's pair row p, column j.
  transpose_block(n, dim / 2, reinterpret_cast<const Pair*>(rows), ld / 2,
                  reinterpret_cast<Pair*>(dst), ldb);
}

void pack_transposed_pairs(int64_t n, int64_t dim, const c10::BFloat16* rows, int64_t ld,
                           c10::BFloat16* dst, int64_t ldb) {
  transpose_pairs(n, dim, rows, ld, dst, ldb);
  Pair* out = reinterpret_cast<Pair*>(dst);
  if (ldb > n) {
    for (int64_t p = 0; p < dim / 2; ++p) std::fill(out + p * ldb + n, out + (p + 1) * ldb, Pair{});
  }
}

void pack_row_pairs(int64_t n, int64_t dim, const c10::BFloat16* rows, int64_t ld,
                    c10::BFloat16* dst, int64_t ldb, uint8_t* flags) {
  const uint16_t* src = reinterpret_cast<const uint16_t*>(rows);
  uint16_t* out = reinterpret_cast<uint16_t*>(dst);
  // A bfloat16 is NaN or infinite where its exponent bits are all ones.
  const auto nonfinite = [](uint16_t x) { return static_cast<uint16_t>((x & 0x7f80u) == 0x7f80u); };
  for (int64_t j = 0; j < n; j += 2) {
    const bool pair = j + 1 < n;  // else the last row of an odd n, paired with zeros
    const uint16_t* r0 = src + j * ld;
    const uint16_t* r1 = pair ? r0 + ld : r0;
    uint16_t* o = out + j * ldb;
    uint16_t any0 = 0, any1 = 0;
    if (pair) {
      for (int64_t d = 0; d < dim; ++d) {
        o[2 * d] = r0[d], o[2 * d + 1] = r1[d];
        any0 |= nonfinite(r0[d]), any1 |= nonfinite(r1[d]);
      }
      flags[j + 1] = any1 != 0;
    } else {
      for (int64_t d = 0; d < dim; ++d) {
        o[2 * d] = r0[d], o[2 * d + 1] = 0;
        any0 |= nonfinite(r0[d]);
      }
    }
    flags[j] = any0 != 0;
    std::fill(o + 2 * dim, o + 2 * ldb, uint16_t{0});
  }
}

void round_rows_to_pairs(int64_t rows, int64_t n, const float* src, int64_t ld,
                         c10::BFloat16* dst) {
  const int64_t n2 = n + n % 2;
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = src + r * ld;
    c10::BFloat16* o = dst + r * n2;
    for (int64_t j = 0; j < n; ++j) o[j] = c10::BFloat16(x[j]);
    if (n2 > n) o[n] = c10::BFloat16(0.f);
  }
}

void pack_float_row_pairs(int64_t rows, int64_t n, const float* src, int64_t ld, const float* scale,
                          c10::BFloat16* dst, int64_t ldb) {
  for (int64_t r = 0; r < rows; r += 2) {
    const float* x0 = src + r * ld;
    const float s0 = scale ? scale[r] : 1.f;
    c10::BFloat16* o = dst + r * ldb;
    if (r + 1 < rows) {
      const float* x1 = x0 + ld;
      const float s1 = scale ? scale[r + 1] : 1.f;
      for (int64_t j = 0; j < n; ++j) {
        o[2 * j] = c10::BFloat16(s0 * x0[j]), o[2 * j + 1] = c10::BFloat16(s1 * x1[j]);
      }
    } else {  // the last row of an odd number, paired with zeros
      for (int64_t j = 0; j < n; ++j) o[2 * j] = c10::BFloat16(s0 * x0[j]), o[2 * j + 1] = 0.f;
    }
    std::fill(o + 2 * n, o + 2 * ldb, c10::BFloat16(0.f));
  }
}

PairedOperand pack_whole_pairs(const at::Tensor& x, bool transposed) {
  const int64_t B = x.size(0), H = x.size(1), L = x.size(2), dim = x.size(3), L2 = L + L % 2;
  PairedOperand po;
  po.heads = H;
  po.ld = pair_row_length(transposed ? L : dim);
  po.size = transposed ? dim * po.ld : L2 * po.ld;
  po.data = at::empty({B * H * po.size + kPairSlack}, x.options());
  if (!transposed) po.flags.assign(B * H * L2, 0);
  const auto* src = x.const_data_ptr<c10::BFloat16>();
  auto* dst = po.data.mutable_data_ptr<c10::BFloat16>();
  std::fill(dst + B * H * po.size, dst + B * H * po.size + kPairSlack, c10::BFloat16(0.f));
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const c10::BFloat16* rows = src + bh / H * x.stride(0) + bh % H * x.stride(1);
      if (transposed) {
        pack_transposed_pairs(L, dim, rows, x.stride(2), dst + bh * po.size, po.ld);
      } else {
        pack_row_pairs(L, dim, rows, x.stride(2), dst + bh * po.size, po.ld,
                       po.flags.data() + bh * L2);
      }
    }
  });
  return po;
}

}  // namespace entropy_attn::cpu
