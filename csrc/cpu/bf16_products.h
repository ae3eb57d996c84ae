// bfloat16 block products for the CPU kernels: C (float) = [C +] A B with A bfloat16 row-major and
// B bfloat16 in pairs along the inner dimension (oneDNN's VNNI layout: B's element (k, n) at
// (k / 2) * 2 ldb + 2 n + k % 2), through ATen's brgemm. On CPUs with AVX512-BF16 or AMX, oneDNN's
// bfloat16 micro-kernel multiplies the pairs directly (VDPBF16PS, or the AMX tiles) with float
// accumulation: 1.8-2x the float kernel's speed on the attention block shapes (AVX512-BF16), where
// the float path first widens K and V to float32. Products of two bfloat16 inputs are exact in
// float32, so Q K^T and dO V^T give the float path's sums up to their order; P V, P^T dO, dS K and
// Q^T (lambda dS) take P or dS rounded to bfloat16, as FlashAttention and SDPA's CPU kernel with
// AMX do (docs/math.md section 9).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <vector>

namespace entropy_attn::cpu {

// Whether the bfloat16 products can run here: brgemm is the CPU's product path (block_gemm.cpp:
// use_brgemm), oneDNN is enabled (torch.backends.mkldnn), and oneDNN generates a bfloat16 kernel
// for this CPU (AVX512-BF16 or AMX; on AVX-512 without them it has none, and ATen's brgemm
// raises). ENTROPY_ATTN_CPU_GEMM=brgemm_float keeps 16-bit inputs on the float products.
bool bf16_products_available();

// C (M x N, row stride ldc) = [C +] A (M x K, row stride lda) . B (K x N in pairs, row length
// ldb = pair_row_length(N) or more); K even.
void bf16_gemm(int64_t M, int64_t N, int64_t K, const c10::BFloat16* A, int64_t lda,
               const c10::BFloat16* B, int64_t ldb, float* C, int64_t ldc, bool accumulate);

// Hands back what the products hold on this thread (AMX's tile configuration): at the end of a
// task that ran them.
void release_bf16_products();

// B's row length for N columns: a multiple of 16, the width of an AMX tile (ATen's flash kernel
// packs B in blocks of 64 columns for AMX), padded with zeros.
inline int64_t pair_row_length(int64_t n) { return (n + 15) / 16 * 16; }

// Zeros kept after the last row of every buffer of pairs that a product reads as B: a product from
// a column not a multiple of 16 then stays inside the buffer whatever the width the JIT kernel
// reads its last columns in.
constexpr int64_t kPairSlack = 32;

// The transpose of n rows of `dim` (even) entries, row stride ld (even), in pairs: dst holds
// B = rows^T (dim x n, row length ldb >= n, zeros after column n), B's (d, j) being row j's entry
// d (the keys of a block as the right operand of Q K^T). Pairs of adjacent entries move together,
// so this is a transpose of 32-bit units.
void pack_transposed_pairs(int64_t n, int64_t dim, const c10::BFloat16* rows, int64_t ld,
                           c10::BFloat16* dst, int64_t ldb);
// The same without the zeros: only B's columns 0 .. n are written (keys added to an operand
// packed in parts, whose padding is already in place).
void transpose_pairs(int64_t n, int64_t dim, const c10::BFloat16* rows, int64_t ld,
                     c10::BFloat16* dst, int64_t ldb);

// n rows of `dim` entries, row stride ld, in pairs: dst holds B = rows (n x dim, row length
// ldb >= dim, zeros after column dim), rows 2p and 2p + 1 interleaved, and a zero row after an odd
// n (the values of a block as the right operand of P V). flags[j] is set where row j holds a NaN or
// an infinity.
void pack_row_pairs(int64_t n, int64_t dim, const c10::BFloat16* rows, int64_t ld,
                    c10::BFloat16* dst, int64_t ldb, uint8_t* flags);

// Whether x (B, heads, L, dim), moved in pairs along dim, fits them: an even dim, and rows an even
// number of entries apart where they are contiguous (else they are copied contiguous first).
inline bool rows_pair_up(const at::Tensor& x) {
  return x.size(3) % 2 == 0 && (x.stride(3) != 1 || x.stride(2) % 2 == 0);
}

// A float block (rows x n, row stride ld) rounded to bfloat16 as the left operand of a product
// summed over its n columns: dst (rows x n2, n2 = n rounded up to even) with a zero column after an
// odd n (P for P V, dS for dS K).
void round_rows_to_pairs(int64_t rows, int64_t n, const float* src, int64_t ld, c10::BFloat16* dst);

// A float block (rows x n, row stride ld), each row r times scale[r] (null: 1), rounded to
// bfloat16 in pairs along its rows: dst holds B (rows x n, row length ldb >= n, zeros after column
// n), rows 2p and 2p + 1 interleaved, and a zero row after an odd number of rows (P or lambda dS as
// the right operand of the backward's products summed over query rows, dV^T += dO^T P and
// dK^T += Q^T (lambda dS)).
void pack_float_row_pairs(int64_t rows, int64_t n, const float* src, int64_t ld, const float* scale,
                          c10::BFloat16* dst, int64_t ldb);

// A (B, heads, L, dim) bfloat16 operand (unit last stride) packed whole, each (batch, head) in
// pairs, as the right operand of block products: transposed, B = x^T (dim x L, pairs along dim, row
// length pair_row_length(L); dim and x's row stride even), or as rows, B = x (L x dim, pairs along
// L, row length pair_row_length(dim)), with the flags of the rows holding a NaN or an infinity
// (L rounded up to even per (batch, head); the last of an odd L is a zero row). In parallel over
// (batch, head).
struct PairedOperand {
  at::Tensor data;  // owns the memory (and kPairSlack zeros after it)
  int64_t ld = 0, size = 0, heads = 0;
  std::vector<uint8_t> flags;  // as rows only
  // The first pair of (b, h), and of its key j0 (even where as rows).
  const c10::BFloat16* at(int64_t b, int64_t h) const {
    return data.const_data_ptr<c10::BFloat16>() + (b * heads + h) * size;
  }
};
PairedOperand pack_whole_pairs(const at::Tensor& x, bool transposed);

}  // namespace entropy_attn::cpu
