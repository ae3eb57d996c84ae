// Per-row loops of the CPU kernels (one row of a key block), compiled once per ISA: AVX-512, AVX2
// and baseline x86-64 clones, picked at load time by GCC's function multiversioning, so one binary
// vectorizes fully on any x86-64 CPU. The math comes from online_stats.h.
#pragma once

#include <cstdint>
#include <type_traits>

#include "../online_stats.h"
#include "attention_cpu.h"

namespace entropy_attn::cpu {

// Forward: raw scores s[0, n) of keys j0.. -> logits (LogitRow), the running state moved to the
// new max, then p = e^{s - m} in place with l (and, with_stats, t and u) accumulated. Returns the
// factor e^{m_old - m_new} for the row's output accumulator.
float softmax_row(float* s, int64_t n, int64_t j0, const LogitRow<float>& row, RowStats<float>& st,
                  bool with_stats);
double softmax_row(double* s, int64_t n, int64_t j0, const LogitRow<double>& row,
                   RowStats<double>& st, bool with_stats);

// Scores of a few query rows against a block of keys read as they are stored (row-major, unit
// column stride): s[r * lds + j] = q_r . k_j for r < rows, j < n. For decoding, where a block
// product with so few rows costs less than the transposed copy of the block it would need. Each
// key row is prefetched kPrefetchRows keys ahead: a decoding cache's rows of one head lie a whole
// token apart (packed sequences: 4 KiB for 8 heads of 128 float32), where the hardware prefetchers
// do not follow (decoding over 8 packed sequences of 4096-8192 keys: 78 ms -> 49).
void key_row_scores(int64_t rows, int64_t n, int64_t dim, const float* q, int64_t ldq,
                    const float* k, int64_t ldk, float* s, int64_t lds);
void key_row_scores(int64_t rows, int64_t n, int64_t dim, const double* q, int64_t ldq,
                    const double* k, int64_t ldk, double* s, int64_t lds);
// The same with key j at k_rows[j] (a pool's rows named by key_rows, read where they lie).
// Followed by weighted_value_rows for the values.
void key_row_scores(int64_t rows, int64_t n, int64_t dim, const float* q, int64_t ldq,
                    const float* const* k_rows, float* s, int64_t lds);
void key_row_scores(int64_t rows, int64_t n, int64_t dim, const double* q, int64_t ldq,
                    const double* const* k_rows, double* s, int64_t lds);

// o[r * ldo + d] += sum_j p[r * ldp + j] v_rows[j][d] for r < rows, d < dim, over the terms whose
// weight is not 0: a few query rows' P V with the value rows where they lie (a pool's, named by
// key_rows), each prefetched kPrefetchRows ahead. A weight of 0 adds nothing, so a non-finite
// value with a weight of 0 adds no NaN: the caller adds those where the row sees the key.
void weighted_value_rows(int64_t rows, int64_t n, int64_t dim, const float* p, int64_t ldp,
                         const float* const* v_rows, float* o, int64_t ldo);
void weighted_value_rows(int64_t rows, int64_t n, int64_t dim, const double* p, int64_t ldp,
                         const double* const* v_rows, double* o, int64_t ldo);

// Whether x[0], x[stride], ..., x[(n - 1) stride] holds a NaN or an infinity: x - x is 0 for
// finite x and NaN otherwise, and the sum of those vectorizes where a branch per element would not.
// (16-bit inputs are widened to float, exactly.)
template <typename T>
EA_ALWAYS_INLINE bool has_nonfinite(const T* x, int64_t n, int64_t stride = 1) {
  using A = std::conditional_t<std::is_floating_point_v<T>, T, float>;
  A acc = 0;
#pragma omp simd reduction(+ : acc)
  for (int64_t d = 0; d < n; ++d) {
    const A v = static_cast<A>(x[d * stride]);
    acc += v - v;
  }
  return acc != acc;
}

// flags[r * flag_stride] = whether row r < n of x (row stride ld, dim values) holds a NaN or an
// infinity (hidden_nonfinite.h: NonFiniteRows; the forward's blocks of float values). Compiled for
// the baseline ISA alone, with a horizontal reduction per row, the scan of a float32 decoding
// step's values took 27% of its samples.
void flag_nonfinite_rows(const float* x, int64_t ld, int64_t n, int64_t dim, uint8_t* flags,
                         int64_t flag_stride);
void flag_nonfinite_rows(const double* x, int64_t ld, int64_t n, int64_t dim, uint8_t* flags,
                         int64_t flag_stride);

// Backward: raw scores -> logits relative to lse in s (x = s - lse, -inf where masked), and
// p = e^{s - lse} (0 where masked). With softcap on, dcap[j] receives the derivative of the cap at
// the key's scaled score (else dcap is unused).
void weights_row(float* s, float* p, float* dcap, int64_t n, int64_t j0, const LogitRow<float>& row,
                 float lse);
void weights_row(double* s, double* p, double* dcap, int64_t n, int64_t j0,
                 const LogitRow<double>& row, double lse);

// Backward: dP -> dS in place (online_stats.h: logit_grad), from x = s - lse of weights_row and
// the delta of row_delta with reference lse.
void dlogits_row(float* ds, const float* x, const float* p, int64_t n, float delta,
                 const RowGrads<float>& g);
void dlogits_row(double* ds, const double* x, const double* p, int64_t n, double delta,
                 const RowGrads<double>& g);

// Non-softmax attention a = f(s), f = relu^2 or identity: raw scores -> logits, then the sums
// over the allowed keys of |a| (st.l) and a^2 (st.u), relative to the running max |relu(s)| or
// |s| (st.m; starts at -inf), which S = l1 / sqrt(n l2) does not depend on.
void power_sums_row(SparsityKind kind, float* s, int64_t n, int64_t j0, const LogitRow<float>& row,
                    RowStats<float>& st);
void power_sums_row(SparsityKind kind, double* s, int64_t n, int64_t j0,
                    const LogitRow<double>& row, RowStats<double>& st);

}  // namespace entropy_attn::cpu
