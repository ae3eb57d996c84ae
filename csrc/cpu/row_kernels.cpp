#include "row_kernels.h"

#include <algorithm>
#include <limits>

#include "../reduction_math.h"
#include "vec_exp.h"

namespace entropy_attn::cpu {
namespace {

// One row of a key block: raw scores -> logits (scale, mask, causality), a rescale of the running
// state to the new max, then p = e^{s - m} in place, accumulating l, t, u (docs/math.md section 2).
// Returns the factor e^{m_old - m_new} by which the row's output accumulator must be multiplied.
// Without statistics only l is accumulated (t and u stay 0): a call that does not ask for them
// pays nothing for them.
template <typename acc_t>
EA_ALWAYS_INLINE acc_t softmax_row_impl(acc_t* s, int64_t n, int64_t j0, const LogitRow<acc_t>& row,
                                        RowStats<acc_t>& st, bool with_stats) {
  const acc_t block_max = scaled_logits(s, n, j0, row);
  acc_t alpha = 1;
  if (!(block_max <= st.m)) alpha = rescale(st, block_max);  // a larger max, or NaN
  if (st.m == -std::numeric_limits<acc_t>::infinity()) {
    std::fill(s, s + n, acc_t(0));  // nothing allowed so far: no weight, and no -inf - -inf
    return alpha;
  }
  const acc_t m = st.m;
  acc_t l = 0, t = 0, u = 0;
  if (with_stats) {
#pragma omp simd reduction(+ : l, t, u)
    for (int64_t j = 0; j < n; ++j) {
      const acc_t x = s[j] - m;
      const acc_t xc = clamp_exp_arg(x);
      const acc_t e = exp_nonpositive(x, xc);
      s[j] = e;
      accumulate(l, t, u, xc, e);
    }
  } else {
#pragma omp simd reduction(+ : l)
    for (int64_t j = 0; j < n; ++j) {
      const acc_t x = s[j] - m;
      const acc_t e = exp_nonpositive(x, clamp_exp_arg(x));
      s[j] = e;
      l += e;
    }
  }
  st.l += l;
  st.t += t;
  st.u += u;
  return alpha;
}

// Recomputes one row of weights p = e^{s - lse} (0 where masked, whatever lse is) from raw scores,
// which become the scaled logits relative to lse, x = s - lse (the reference of the backward's
// delta, online_stats.h: row_delta); with softcap on, dcap gets the cap's derivative at each scaled
// score.
template <typename acc_t>
EA_ALWAYS_INLINE void weights_row_impl(acc_t* s, acc_t* p, acc_t* dcap, int64_t n, int64_t j0,
                                       const LogitRow<acc_t>& row, acc_t lse) {
  if (row.softcap.on()) {
    for (int64_t j = 0; j < n; ++j)
      dcap[j] = row.softcap.derivative(row.softcap.apply(row.lam * s[j]));
  }
  scaled_logits(s, n, j0, row);
  constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    // A hidden key's weight is 0 even in a row whose lse is NaN (a row that sees a NaN): the
    // products over the block (dV, dK) then keep the row's NaN to the keys it sees.
    const acc_t x = s[j] - lse;
    p[j] = s[j] == kNegInf ? acc_t(0) : exp_nonpositive(x, clamp_exp_arg(x));
    s[j] = x;
  }
}

// dP -> dS in place for one row (online_stats.h: logit_grad), from x = s - lse.
template <typename acc_t>
EA_ALWAYS_INLINE void dlogits_row_impl(acc_t* ds, const acc_t* x, const acc_t* p, int64_t n,
                                       acc_t delta, const RowGrads<acc_t>& g) {
  // (a copy of g: read through the reference, which a store to ds might alias, GCC 12 left this
  // loop scalar in every ISA clone)
  const RowGrads<acc_t> grads = g;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    // p = 0 (masked, or underflow) contributes nothing; this also avoids 0 * -inf. (Formed for
    // every key and then selected: with the loads of ds and x under the condition, the baseline
    // clone, which has no masked loads, stayed scalar.)
    const acc_t dsj = logit_grad(p[j], ds[j], x[j], delta, grads);
    ds[j] = p[j] == acc_t(0) ? acc_t(0) : dsj;
  }
}

template <typename acc_t>
EA_ALWAYS_INLINE void power_sums_row_impl(SparsityKind kind, acc_t* s, int64_t n, int64_t j0,
                                          const LogitRow<acc_t>& row, RowStats<acc_t>& st) {
  const acc_t smax = scaled_logits(s, n, j0, row);
  if (smax != smax) st.l = smax;  // a row of only NaN and masked keys: NaN, as softmax gives
  const bool relu2 = kind == SparsityKind::kRelu2;
  acc_t bmax = 0;
#pragma omp simd reduction(max : bmax)
  for (int64_t j = 0; j < n; ++j) {
    const acc_t b = power_base(relu2, s[j]);
    const acc_t ab = b < acc_t(0) ? -b : b;
    bmax = ab > bmax ? ab : bmax;
  }
  rescale_power_sums(st, bmax, relu2);
  if (!(st.m > acc_t(0))) return;  // every weight so far is 0
  const PowerScale<acc_t> ps = power_scale(st.m);
  acc_t a1 = 0, a2 = 0;
#pragma omp simd reduction(+ : a1, a2)
  for (int64_t j = 0; j < n; ++j) {
    const acc_t x = power_base(relu2, s[j]) * ps.up * ps.inv;
    const acc_t a = relu2 ? x * x : x;
    a1 += a < acc_t(0) ? -a : a;
    a2 += a * a;
  }
  st.l += a1;
  st.u += a2;
}

// key_row (j) is key j's row.
template <typename acc_t, typename KeyRow>
EA_ALWAYS_INLINE void key_row_scores_impl(int64_t rows, int64_t n, int64_t dim, const acc_t* q,
                                          int64_t ldq, const KeyRow& key_row, acc_t* s,
                                          int64_t lds) {
  // Key-major, so that each key row is read from memory once and stays in L1 for every query row.
  for (int64_t j = 0; j < n; ++j) {
    const acc_t* kj = key_row(j);
    if (j + kPrefetchRows < n) prefetch_row(key_row(j + kPrefetchRows), dim);
    for (int64_t r = 0; r < rows; ++r) {
      const acc_t* qr = q + r * ldq;
      acc_t dot = 0;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < dim; ++d) dot += qr[d] * kj[d];
      s[r * lds + j] = dot;
    }
  }
}

template <typename acc_t>
EA_ALWAYS_INLINE void weighted_value_rows_impl(int64_t rows, int64_t n, int64_t dim, const acc_t* p,
                                               int64_t ldp, const acc_t* const* v_rows, acc_t* o,
                                               int64_t ldo) {
  // Key-major, as key_row_scores: each value row is read from memory once. Keys go in groups of
  // kGroup, each output row loaded and stored once per group (key by key, the loads and stores of
  // every row's output bound the loop: one thread decoding 8 sequences of 4096-8192 float32 keys
  // took 100 ms against 78); a group with a weight of 0 goes key by key.
  constexpr int64_t kGroup = 8;
  for (int64_t j0 = 0; j0 < n; j0 += kGroup) {
    const int64_t m = std::min(kGroup, n - j0);
    for (int64_t j = j0 + kPrefetchRows; j < std::min(n, j0 + kPrefetchRows + m); ++j) {
      prefetch_row(v_rows[j], dim);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const acc_t* w = p + r * ldp + j0;
      acc_t* orow = o + r * ldo;
      if (m == kGroup && std::find(w, w + kGroup, acc_t(0)) == w + kGroup) {
        const acc_t *v0 = v_rows[j0], *v1 = v_rows[j0 + 1], *v2 = v_rows[j0 + 2],
                    *v3 = v_rows[j0 + 3], *v4 = v_rows[j0 + 4], *v5 = v_rows[j0 + 5],
                    *v6 = v_rows[j0 + 6], *v7 = v_rows[j0 + 7];
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) {
          orow[d] += ((w[0] * v0[d] + w[1] * v1[d]) + (w[2] * v2[d] + w[3] * v3[d])) +
                     ((w[4] * v4[d] + w[5] * v5[d]) + (w[6] * v6[d] + w[7] * v7[d]));
        }
        continue;
      }
      for (int64_t j = 0; j < m; ++j) {
        if (w[j] == acc_t(0)) continue;
        const acc_t* vj = v_rows[j0 + j];
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) orow[d] += w[j] * vj[d];
      }
    }
  }
}

}  // namespace

EA_CPU_CLONES void weighted_value_rows(int64_t rows, int64_t n, int64_t dim, const float* p,
                                       int64_t ldp, const float* const* v_rows, float* o,
                                       int64_t ldo) {
  weighted_value_rows_impl(rows, n, dim, p, ldp, v_rows, o, ldo);
}
void weighted_value_rows(int64_t rows, int64_t n, int64_t dim, const double* p, int64_t ldp,
                         const double* const* v_rows, double* o, int64_t ldo) {
  weighted_value_rows_impl(rows, n, dim, p, ldp, v_rows, o, ldo);
}

EA_CPU_CLONES void key_row_scores(int64_t rows, int64_t n, int64_t dim, const float* q, int64_t ldq,
                                  const float* k, int64_t ldk, float* s, int64_t lds) {
  key_row_scores_impl(rows, n, dim, q, ldq, [=](int64_t j) { return k + j * ldk; }, s, lds);
}
void key_row_scores(int64_t rows, int64_t n, int64_t dim, const double* q, int64_t ldq,
                    const double* k, int64_t ldk, double* s, int64_t lds) {
  key_row_scores_impl(rows, n, dim, q, ldq, [=](int64_t j) { return k + j * ldk; }, s, lds);
}
EA_CPU_CLONES void key_row_scores(int64_t rows, int64_t n, int64_t dim, const float* q, int64_t ldq,
                                  const float* const* k_rows, float* s, int64_t lds) {
  key_row_scores_impl(rows, n, dim, q, ldq, [=](int64_t j) { return k_rows[j]; }, s, lds);
}
void key_row_scores(int64_t rows, int64_t n, int64_t dim, const double* q, int64_t ldq,
                    const double* const* k_rows, double* s, int64_t lds) {
  key_row_scores_impl(rows, n, dim, q, ldq, [=](int64_t j) { return k_rows[j]; }, s, lds);
}

EA_CPU_CLONES float softmax_row(float* s, int64_t n, int64_t j0, const LogitRow<float>& row,
                                RowStats<float>& st, bool with_stats) {
  return softmax_row_impl(s, n, j0, row, st, with_stats);
}
double softmax_row(double* s, int64_t n, int64_t j0, const LogitRow<double>& row,
                   RowStats<double>& st, bool with_stats) {
  return softmax_row_impl(s, n, j0, row, st, with_stats);
}

EA_CPU_CLONES void weights_row(float* s, float* p, float* dcap, int64_t n, int64_t j0,
                               const LogitRow<float>& row, float lse) {
  weights_row_impl(s, p, dcap, n, j0, row, lse);
}
void weights_row(double* s, double* p, double* dcap, int64_t n, int64_t j0,
                 const LogitRow<double>& row, double lse) {
  weights_row_impl(s, p, dcap, n, j0, row, lse);
}
EA_CPU_CLONES void dlogits_row(float* ds, const float* x, const float* p, int64_t n, float delta,
                               const RowGrads<float>& g) {
  dlogits_row_impl(ds, x, p, n, delta, g);
}
void dlogits_row(double* ds, const double* x, const double* p, int64_t n, double delta,
                 const RowGrads<double>& g) {
  dlogits_row_impl(ds, x, p, n, delta, g);
}

// First the rows together, in 16 lanes of x - x (0, or NaN for a non-finite x) summed across rows,
// then row by row only where a lane is NaN. Row by row from the start, each row's sum ended in a
// horizontal reduction, a chain of scalar adds that cost more than its loads: a decoding step's
// scan of a block of 512 values of 64 took longer than the block's product.
template <typename T>
EA_ALWAYS_INLINE void flag_nonfinite_rows_impl(const T* x, int64_t ld, int64_t n, int64_t dim,
                                               uint8_t* flags, int64_t flag_stride) {
  constexpr int64_t kLanes = 16;
  T lanes[kLanes] = {};
  for (int64_t r = 0; r < n; ++r) {
    const T* row = x + r * ld;
    int64_t d = 0;
    for (; d + kLanes <= dim; d += kLanes) {
#pragma omp simd
      for (int64_t l = 0; l < kLanes; ++l) lanes[l] += row[d + l] - row[d + l];
    }
    for (; d < dim; ++d) lanes[0] += row[d] - row[d];
  }
  bool any = false;
  for (int64_t l = 0; l < kLanes; ++l) any |= lanes[l] != lanes[l];
  for (int64_t r = 0; r < n; ++r) flags[r * flag_stride] = any && has_nonfinite(x + r * ld, dim);
}

EA_CPU_CLONES void flag_nonfinite_rows(const float* x, int64_t ld, int64_t n, int64_t dim,
                                       uint8_t* flags, int64_t flag_stride) {
  flag_nonfinite_rows_impl(x, ld, n, dim, flags, flag_stride);
}
void flag_nonfinite_rows(const double* x, int64_t ld, int64_t n, int64_t dim, uint8_t* flags,
                         int64_t flag_stride) {
  flag_nonfinite_rows_impl(x, ld, n, dim, flags, flag_stride);
}

EA_CPU_CLONES void power_sums_row(SparsityKind kind, float* s, int64_t n, int64_t j0,
                                  const LogitRow<float>& row, RowStats<float>& st) {
  power_sums_row_impl(kind, s, n, j0, row, st);
}
void power_sums_row(SparsityKind kind, double* s, int64_t n, int64_t j0,
                    const LogitRow<double>& row, RowStats<double>& st) {
  power_sums_row_impl(kind, s, n, j0, row, st);
}

}  // namespace entropy_attn::cpu
