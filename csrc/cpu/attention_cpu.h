// Pieces shared by the CPU kernels: the kernel arguments, the block sizes and task loop, and how
// one row of raw scores q_i.k_j becomes scaled, masked logits.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "../attention_inputs.h"
#include "../dropout.h"
#include "block_gemm.h"

// The hot row loops are compiled once per ISA (AVX-512, AVX2, baseline) and picked at load time
// by GCC's function multiversioning, so one binary vectorizes fully on any x86-64 CPU.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define EA_CPU_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define EA_CPU_CLONES
#endif
#define EA_ALWAYS_INLINE inline __attribute__((always_inline))

namespace entropy_attn::cpu {

// A (B, heads, L, dim) tensor with a unit last stride, as a pointer and its three outer strides.
template <typename T>
struct Strided4 {
  T* data = nullptr;
  int64_t sb = 0, sh = 0, sl = 0;

  static Strided4 of(const at::Tensor& t) {
    return {const_cast<T*>(t.const_data_ptr<T>()), t.stride(0), t.stride(1), t.stride(2)};
  }
  T* at(int64_t b, int64_t h, int64_t l = 0) const { return data + b * sb + h * sh + l * sl; }
};

// x (B, heads, L, dim) in `dtype` as the row-major operand of block_gemm: a unit last stride, and
// compact rows when its rows span 2^31 elements or more (a sequence stride of 2^27 over a few
// dozen rows suffices): the oneDNN micro-kernel behind ATen's brgemm computes offsets within an
// operand in 32 bits and fails (std::bad_alloc) for such a leading dimension.
inline at::Tensor gemm_operand(const at::Tensor& x, at::ScalarType dtype) {
  at::Tensor y = with_unit_last_stride(x, dtype);
  const int64_t span = (y.size(2) - 1) * y.stride(2) + y.size(3);
  return span > std::numeric_limits<int32_t>::max() ? y.contiguous() : y;
}

// A (B, heads, L, dim) operand as given, in any of the four input types (float, double, bfloat16,
// half): its data, type and strides (unit last stride). The kernels read 16-bit operands through
// it without a widened copy of the whole tensor, and write outputs in their own types (the
// forward's output, the backward's gradients).
struct RawOperand {
  void* data = nullptr;
  at::ScalarType dtype = at::kBFloat16;
  int64_t sb = 0, sh = 0, sl = 0;
  // An input, read only.
  static RawOperand of(const at::Tensor& t) {
    return {const_cast<void*>(t.const_data_ptr()), t.scalar_type(), t.stride(0), t.stride(1),
            t.stride(2)};
  }
  // An output, written (mutable_data_ptr: a tensor whose storage is shared copy-on-write gets its
  // own first).
  static RawOperand output(const at::Tensor& t) {
    return {t.mutable_data_ptr(), t.scalar_type(), t.stride(0), t.stride(1), t.stride(2)};
  }
  // Row l of (b, h), read as T (the operand's own type).
  template <typename T>
  T* row(int64_t b, int64_t h, int64_t l) const {
    return static_cast<T*>(data) + b * sb + h * sh + l * sl;
  }
};

// Rows read through a row map are prefetched this many rows ahead: a pool's tokens lie a whole
// token (all heads) apart, often 4 KiB or more, where the hardware prefetchers do not follow.
// (Decoding over 8 sequences of 4096-8192 float32 keys, 32 : 8 heads, D = 128, 2 threads, the
// keys mapped in place: 114 ms without, 88 at 8 rows ahead, 66 at 16, 73 at 24 and 32.)
constexpr int64_t kPrefetchRows = 16;

template <typename T>
EA_ALWAYS_INLINE void prefetch_row(const T* row, int64_t dim) {
#if defined(__GNUC__)
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t byte = 0; byte < dim * static_cast<int64_t>(sizeof(T)); byte += 64) {
    __builtin_prefetch(p + byte);
  }
#endif
}

// Rows j0 .. j0 + n of (b, h) of x converted to acc_t: dst[j * ld + d], or transposed,
// dst[d * ld + j]. With `row_map` (the call's key_rows), row j is x's row row_map[j] (a paged KV
// cache's pool of tokens, read where it lies).
template <typename acc_t>
void load_rows(const RawOperand& x, int64_t b, int64_t h, int64_t j0, int64_t n, int64_t dim,
               acc_t* dst, int64_t ld, bool transposed, const int64_t* row_map = nullptr) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.dtype, "entropy_attn_load_rows", [&] {
    if (row_map != nullptr && transposed) {
      // A tile of rows at a time, so that each column's writes fill whole cache lines of dst.
      constexpr int64_t kTile = 16;
      const scalar_t* rows[kTile];
      for (int64_t t0 = 0; t0 < n; t0 += kTile) {
        const int64_t m = std::min(kTile, n - t0);
        for (int64_t t = 0; t < m; ++t) rows[t] = x.row<scalar_t>(b, h, row_map[j0 + t0 + t]);
        for (int64_t t = t0 + kTile; t < std::min(n, t0 + 2 * kTile); ++t) {
          prefetch_row(x.row<scalar_t>(b, h, row_map[j0 + t]), dim);
        }
        for (int64_t d = 0; d < dim; ++d) {
          acc_t* col = dst + d * ld + t0;
          for (int64_t t = 0; t < m; ++t) col[t] = static_cast<acc_t>(rows[t][d]);
        }
      }
      return;
    }
    if (row_map == nullptr && transposed) {
      return transpose_block(n, dim, x.row<scalar_t>(b, h, j0), x.sl, dst, ld);
    }
    for (int64_t j = 0; j < n; ++j) {
      const scalar_t* row = x.row<scalar_t>(b, h, row_map ? row_map[j0 + j] : j0 + j);
      if (row_map != nullptr && j + kPrefetchRows < n) {
        prefetch_row(x.row<scalar_t>(b, h, row_map[j0 + j + kPrefetchRows]), dim);
      }
      for (int64_t d = 0; d < dim; ++d) dst[j * ld + d] = static_cast<acc_t>(row[d]);
    }
  });
}

// Rows i0 .. i0 + n of (b, h) of y = src (n x dim, row stride ld) converted to y's type.
template <typename acc_t>
void store_rows(const acc_t* src, int64_t ld, const RawOperand& y, int64_t b, int64_t h, int64_t i0,
                int64_t n, int64_t dim) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.dtype, "entropy_attn_store_rows",
                                  [&] {
                                    for (int64_t i = 0; i < n; ++i) {
                                      scalar_t* row = y.row<scalar_t>(b, h, i0 + i);
                                      for (int64_t d = 0; d < dim; ++d)
                                        row[d] = static_cast<scalar_t>(src[i * ld + d]);
                                    }
                                  });
}

// x (B, heads, L, dim) as a contiguous (B, heads, dim, L) tensor in `dtype`, in one copy: the
// row-major right operand of the products with x^T (Q K^T, dO V^T), which block_gemm takes as is,
// and the backward's dK^T, dV^T back in their layout. (transposed_copy.cpp)
at::Tensor transposed_copy(const at::Tensor& x, at::ScalarType dtype);
// The same into y, (B, heads, dim, L) in any strides (a gradient in its input's layout); returns y.
at::Tensor transposed_copy_into(const at::Tensor& x, at::Tensor y);
// x^T (B, heads, dim, L) in `dtype` as a row-major operand: x itself, read in place, where it is
// stored transposed in that type (a unit stride along L, rows of dim apart by at least L), else
// transposed_copy. (transposed_copy.cpp)
at::Tensor transposed_operand(const at::Tensor& x, at::ScalarType dtype);

// One row of the mask, positioned at key 0.
template <typename acc_t>
struct MaskRow {
  MaskKind kind;
  const uint8_t* b;  // a bool mask's bytes (kernel_args.h: bool_bytes)
  const acc_t* a;
  int64_t sj;

  MaskRow(const MaskArg<acc_t>& m, int64_t b_idx, int64_t h, int64_t i)
      : kind(m.kind), b(nullptr), a(nullptr), sj(m.sj) {
    const int64_t off = m.row_offset(b_idx, h, i);
    if (kind == MaskKind::kBool) b = m.bool_bytes() + off;
    if (kind == MaskKind::kAdditive) a = m.additive_data() + off;
  }
};

// Block sizes, tuned by measurement (2 threads, L = 2048, D = 64 and 128, a sweep of 64..512 query
// rows x 256..1024 keys): taller query blocks amortize the key/value traffic once there are enough
// rows, except under causality (or any band of keys), where the diagonal block's masked part is
// wasted work and 64 rows were 5-15% faster than 256; 512 keys keep a block of scores in L2
// (256..1024 within noise).
inline int64_t q_block_size(int64_t q_len, bool banded) {
  if (q_len < 192) return 32;
  return (q_len >= 768 && !banded) ? 256 : 64;
}
constexpr int64_t kKvBlock = 512;

// The keys of the largest block a call streams, which its buffers are sized for: kKvBlock, or the
// call's key count when smaller. (A decoding step against a short cache would otherwise allocate
// and zero buffers for 512 keys per thread on every call, more than its whole computation.)
inline int64_t key_block_capacity(const AttentionShape& sh) {
  return std::clamp<int64_t>(sh.kv_len, 1, kKvBlock);
}

// Runs body(state, b, h, i0, rows) for every (batch, head, query tile of rows i0 .. i0 + rows), in
// parallel over these tasks. The tiles are blocks of q_block_size rows, cut at the boundaries of
// packed documents (cu_q, `documents` of them), where there are some: a tile spanning documents
// streams the union of their keys for each of its rows. Each thread builds its buffers once, as
// State(rows, shape) for the tallest tile, and runs its products with a single-threaded BLAS.
// The tasks run in (batch, head, tile) order, so that a thread's run of tasks shares a head's keys
// (which it may hold converted: thread_keys.h); with heads_inner in (batch, tile, head) order, so
// that consecutive tasks read the same document's keys (for tasks that read their keys in place,
// from packed documents whose heads are interleaved in memory: heads outer, each task's keys lie
// on pages and in DRAM rows that no recent task touched, and a packed decoding call took twice the
// time of a dense batch of the same keys).
template <typename State, typename Body>
void parallel_query_blocks(const AttentionShape& sh, bool banded, const int32_t* cu_q,
                           int64_t documents, const Body& body, bool heads_inner = false) {
  const int64_t qb = q_block_size(sh.q_len, banded);
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (first row, rows)
  auto add_tiles = [&](int64_t begin, int64_t end) {
    for (int64_t i0 = begin; i0 < end; i0 += qb) tiles.emplace_back(i0, std::min(qb, end - i0));
  };
  if (cu_q == nullptr) {
    add_tiles(0, sh.q_len);
  } else {
    for (int64_t d = 0; d < documents; ++d) add_tiles(cu_q[d], cu_q[d + 1]);
  }
  const int64_t n = static_cast<int64_t>(tiles.size());
  at::parallel_for(0, sh.batch * sh.heads * n, 1, [&](int64_t begin, int64_t end) {
    SerialBlasScope serial_blas;
    State state(std::min(qb, sh.q_len), sh);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t tile = heads_inner ? task / sh.heads % n : task % n;
      const int64_t h = heads_inner ? task % sh.heads : task / n % sh.heads;
      const auto [i0, rows] = tiles[tile];
      body(state, task / (n * sh.heads), h, i0, rows);
    }
  });
}

// A mask row's loops take the key stride sj as a template constant where it is 1 (kUnit), the
// common layout: GCC versions a loop over j * sj for sj == 1 by itself and left that copy scalar
// ("control flow in loop"), 2-2.7x the time of the whole masked forward on a 512-key block.

// The keys of [lo, hi) that a bool (mb) or additive (ma) mask row lets through.
template <bool kUnit, typename acc_t>
EA_ALWAYS_INLINE int64_t count_mask_row(const uint8_t* mb, const acc_t* ma, int64_t sj, int64_t lo,
                                        int64_t hi) {
  constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
  int64_t n = 0;
  if (mb != nullptr) {
#pragma omp simd reduction(+ : n)
    for (int64_t j = lo; j < hi; ++j) n += mb[kUnit ? j : j * sj] != 0;
  } else {
#pragma omp simd reduction(+ : n)
    for (int64_t j = lo; j < hi; ++j) n += ma[kUnit ? j : j * sj] != kNegInf;
  }
  return n;
}

// n_i before the scale: the keys of the row's range that its mask lets through (MaskArg::counts).
template <typename acc_t>
int64_t count_allowed(const MaskArg<acc_t>& m, int64_t b, int64_t h, int64_t i, KeyRange range) {
  if (m.kind == MaskKind::kNone) return range.hi - range.lo;
  const int64_t off = m.row_offset(b, h, i);
  const uint8_t* mb = m.kind == MaskKind::kBool ? m.bool_bytes() + off : nullptr;
  const acc_t* ma = m.kind == MaskKind::kBool ? nullptr : m.additive_data() + off;
  return m.sj == 1 ? count_mask_row<true>(mb, ma, 1, range.lo, range.hi)
                   : count_mask_row<false>(mb, ma, m.sj, range.lo, range.hi);
}

// The key range [lo, hi) of a tile of query rows i0 .. i0 + rows: the union of the rows' ranges
// (KeyPattern's ranges never decrease with i).
inline KeyRange tile_keys(const KeyPattern& pattern, const AttentionShape& sh, int64_t i0,
                          int64_t rows) {
  return {pattern.keys(i0, sh.q_len, sh.kv_len).lo,
          pattern.keys(i0 + rows - 1, sh.q_len, sh.kv_len).hi};
}

// What a kernel needs to know of query row i before streaming keys: its key range, n_i,
// g(n_i) / temperature and lambda_i.
template <typename acc_t>
struct RowSetup {
  KeyRange keys;
  int64_t n = 0;
  acc_t factor = 0, lam = 0;

  RowSetup() = default;
  RowSetup(const MaskArg<acc_t>& mask, const ScalePolicy<acc_t>& scale, const KeyPattern& pattern,
           const AttentionShape& sh, int64_t b, int64_t h, int64_t i)
      : keys(pattern.keys(i, sh.q_len, sh.kv_len)),
        n(count_allowed(mask, b, h, i, keys)),
        factor(scale.factor(n)),
        lam(scale.lambda(b, h, i, factor)) {}
};

// How a row's raw scores r = q.k become logits: x = lam * r, capped when softcap is on, plus the
// mask; keys outside the row's range are -inf.
template <typename acc_t>
struct LogitRow {
  KeyRange keys;
  acc_t lam;
  Softcap<acc_t> softcap;
  MaskRow<acc_t> mask;
};

// Logits x = lam r + mask in place for keys [begin, end) of a bool (mb) or additive (ma) mask row
// (count_mask_row: kUnit), and their max.
template <bool kUnit, typename acc_t>
EA_ALWAYS_INLINE acc_t masked_logits(acc_t* r, int64_t begin, int64_t end, acc_t lam,
                                     const uint8_t* mb, const acc_t* ma, int64_t sj) {
  constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
  acc_t mx = kNegInf;
  if (mb != nullptr) {
#pragma omp simd reduction(max : mx)
    for (int64_t j = begin; j < end; ++j) {
      const acc_t x = mb[kUnit ? j : j * sj] != 0 ? lam * r[j] : kNegInf;
      r[j] = x;
      mx = x > mx ? x : mx;
    }
  } else {
#pragma omp simd reduction(max : mx)
    for (int64_t j = begin; j < end; ++j) {
      const acc_t mj = ma[kUnit ? j : j * sj];
      const acc_t x = mj == kNegInf ? kNegInf : lam * r[j] + mj;  // NaN + -inf stays hidden
      r[j] = x;
      mx = x > mx ? x : mx;
    }
  }
  return mx;
}

// Turns raw scores r[0, n) of keys j0 .. j0 + n into logits in place (LogitRow). Returns the
// block's max logit (-inf if none).
template <typename acc_t>
EA_ALWAYS_INLINE acc_t scaled_logits(acc_t* r, int64_t n, int64_t j0, const LogitRow<acc_t>& row) {
  constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
  const int64_t begin = std::clamp<int64_t>(row.keys.lo - j0, 0, n);
  const int64_t end = std::clamp<int64_t>(row.keys.hi - j0, begin, n);
  acc_t lam = row.lam;
  if (row.softcap.on()) {  // capped scores first; the mask pass below then takes them as they are
    const Softcap<acc_t> cap = row.softcap;
    for (int64_t j = begin; j < end; ++j) r[j] = cap.apply(lam * r[j]);
    lam = 1;
  }
  const MaskRow<acc_t>& m = row.mask;
  // One pass per mask kind forms the logits and their max together (the row stays in L1).
  acc_t mx = kNegInf;
  if (m.kind == MaskKind::kNone) {
#pragma omp simd reduction(max : mx)
    for (int64_t j = begin; j < end; ++j) {
      const acc_t x = lam * r[j];
      r[j] = x;
      mx = x > mx ? x : mx;
    }
  } else {
    // (the block's first key; only the mask kind's pointer is set)
    const uint8_t* mb = m.kind == MaskKind::kBool ? m.b + j0 * m.sj : nullptr;
    const acc_t* ma = m.kind == MaskKind::kBool ? nullptr : m.a + j0 * m.sj;
    mx = m.sj == 1 ? masked_logits<true>(r, begin, end, lam, mb, ma, 1)
                   : masked_logits<false>(r, begin, end, lam, mb, ma, m.sj);
  }
  std::fill(r, r + begin, kNegInf);
  std::fill(r + end, r + n, kNegInf);
  // The max skips NaN; a NaN then reaches the outputs through e^{s - m}, except in a row of only
  // NaN and -inf, caught here so that NaN inputs give NaN outputs, as in SDPA.
  if (mx == kNegInf) {
    for (int64_t j = begin; j < end; ++j) {
      if (r[j] != r[j]) return r[j];
    }
  }
  return mx;
}

// Calls fn(j, factor) with the dropout factor (0 or 1 / (1 - p')) of each key j0 + j, j < n, of
// row (bh, i): the four Philox groups of each 16-key chunk (dropout.h) serve its 16 keys.
template <typename acc_t, typename Fn>
void for_each_dropout_factor(const Dropout<acc_t>& d, int64_t bh, int64_t i, int64_t j0, int64_t n,
                             const Fn& fn) {
  const int64_t end = j0 + n;
  for (int64_t chunk = j0 & ~int64_t{15}; chunk < end; chunk += 16) {
    PhiloxDraws draws[4];
    for (int q = 0; q < 4; ++q) draws[q] = d.group_draws(bh, i, chunk + 2 * q);
    for (int64_t key = std::max(chunk, j0); key < std::min(chunk + 16, end); ++key) {
      const bool keep = d.kept(draws[(key >> 1) & 3], Dropout<acc_t>::slot(i, key));
      fn(key - j0, keep ? d.keep_scale : acc_t(0));
    }
  }
}

}  // namespace entropy_attn::cpu
