// Online softmax with per-row statistics (docs/math.md section 2).
//
// This header is the single place where the streaming update of one attention row lives: the
// CPU kernel uses it today and the CUDA kernel includes the same functions, so the math that the
// CPU tests check is the math every device runs. It has no dependency on ATen.
#pragma once

#include <cmath>
#include <limits>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define EA_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define EA_HOST_DEVICE inline
#endif

namespace entropy_attn {

// Running state of one row, every exponent taken relative to the running max m:
//   l = sum_j e^{s_j - m},  t = sum_j e^{s_j - m} (s_j - m),  u = sum_j e^{2 (s_j - m)}.
// Keeping t relative to m (t <= 0) avoids the cancellation of sum_j e^{s_j - m} s_j.
template <typename acc_t>
struct RowStats {
  acc_t m = -std::numeric_limits<acc_t>::infinity();
  acc_t l = 0;
  acc_t t = 0;
  acc_t u = 0;
};

// Statistics of one finished row. A row that saw no allowed key (fully masked) finishes as all
// zeros, the convention of scaled_dot_product_attention.
template <typename acc_t>
struct RowResult {
  acc_t inv_l;       // 1 / l: multiplies the accumulated output; 0 for an empty row
  acc_t lse;         // m + ln l
  acc_t entropy;     // ln l - t / l, clamped at 0 against rounding
  acc_t sum_p2;      // u / l^2
  acc_t max_weight;  // 1 / l = e^{m - lse}
};

// The unit in which a kernel measures logits. Kernels that exponentiate with exp2 (one MUFU.EX2 on
// a GPU) keep m and t in log2 units, y = s * log2(e): e^{s - m} = 2^{y - m2}, so l and u are the
// same numbers, and t2 = t / ln 2 and delta2 = delta / ln 2 obey the same linear update. kLn
// converts a log-unit value back to natural units in finalize().
struct NaturalLog {
  static constexpr double kLn = 1.0;
  template <typename acc_t>
  static EA_HOST_DEVICE acc_t exp(acc_t x) {
    return std::exp(x);
  }
};
struct Log2 {
  static constexpr double kLn = 0.69314718055994530942;  // ln 2
  template <typename acc_t>
  static EA_HOST_DEVICE acc_t exp(acc_t x) {
    return std::exp2(x);
  }
};

// Whether a sink logit is an entry of its rows' softmax (docs/math.md section 6). A sink of -inf
// carries no weight and is no sink: the row starts empty and the derived statistics count the n_i
// keys alone, as without one (this also keeps the first rescale from forming -inf - -inf). A NaN
// sink is an entry (m = NaN), so that the row's denominator, hence its output and statistics,
// are NaN, as the math has them.
template <typename acc_t>
EA_HOST_DEVICE bool is_sink_entry(acc_t sink) {
  return !(sink == -std::numeric_limits<acc_t>::infinity());
}

// Whether head h's rows have a sink entry (sinks: (H,) or null); the derived statistics then count
// n_i + 1 outcomes.
template <typename acc_t>
EA_HOST_DEVICE bool has_sink_entry(const acc_t* sinks, int64_t h) {
  return sinks != nullptr && is_sink_entry(sinks[h]);
}

// The state of a row before its first key. With an attention sink (gpt-oss) the softmax
// denominator holds one more entry, a per-head logit with no value: the row starts as if it had
// seen that entry, m = sink (in the kernel's Unit), l = 1 (e^0), t = 0 (its x = s - m is 0),
// u = 1, so that lse, the weights and every statistic describe the distribution over the keys and
// the sink (docs/math.md section 6), and the output, which the sink does not feed, is divided by
// the whole denominator.
template <typename acc_t>
EA_HOST_DEVICE RowStats<acc_t> initial_state(bool has_sink, acc_t sink) {
  RowStats<acc_t> st;
  if (has_sink && is_sink_entry(sink)) {
    st.m = sink, st.l = acc_t(1), st.u = acc_t(1);
  }
  return st;
}

// Moves the running state to a new, larger-or-equal max m_new and returns the factor e^{m - m_new}
// by which anything accumulated with weights e^{s - m} (the output row) must be multiplied.
// With an empty state (l = 0, m = -inf) the factor is 0 and nothing is formed from -inf * 0.
//
// rescale_by is the same update with the factor alpha = Unit::exp(m - m_new) formed by the caller:
// a kernel that needs the factor for its output row anyway forms it once, by its own exponential,
// and the row's sums and its output are then moved by the same number. alpha is not read while
// the state is empty.
template <typename acc_t>
EA_HOST_DEVICE void rescale_by(RowStats<acc_t>& st, acc_t m_new, acc_t alpha) {
  if (st.l != acc_t(0)) {
    const acc_t delta = st.m - m_new;  // <= 0
    st.t = alpha * (st.t + delta * st.l);
    st.l = alpha * st.l;
    st.u = alpha * alpha * st.u;
  }
  st.m = m_new;
}
template <typename acc_t, typename Unit = NaturalLog>
EA_HOST_DEVICE acc_t rescale(RowStats<acc_t>& st, acc_t m_new) {
  if (st.l == acc_t(0)) {
    st.m = m_new;
    return acc_t(0);
  }
  const acc_t alpha = Unit::exp(st.m - m_new);
  rescale_by(st, m_new, alpha);
  return alpha;
}

// The state of a row over the union of two disjoint sets of keys, from the states of each (both
// in the same Unit): both moved to the larger max, then added (l, t and u are sums over keys). The
// split-KV forward combines its splits' states so; an empty state (l = 0) adds nothing.
template <typename acc_t, typename Unit = NaturalLog>
EA_HOST_DEVICE RowStats<acc_t> merge(RowStats<acc_t> a, RowStats<acc_t> b) {
  const acc_t m = a.m > b.m ? a.m : b.m;
  rescale<acc_t, Unit>(a, m);
  rescale<acc_t, Unit>(b, m);
  return {m, a.l + b.l, a.t + b.t, a.u + b.u};
}

// Adds one allowed entry with x = s - m (the current max) and e = exp(x), computed by the caller
// so that each device can use its own vectorized exponential in the hot loop.
template <typename acc_t>
EA_HOST_DEVICE void accumulate(acc_t& l, acc_t& t, acc_t& u, acc_t x, acc_t e) {
  l += e;
  t += e * x;
  u += e * e;
}

// The statistics of a finished row, in natural units whatever the Unit of m and t.
template <typename acc_t, typename Unit = NaturalLog>
EA_HOST_DEVICE RowResult<acc_t> finalize(const RowStats<acc_t>& st) {
  // A NaN max is a NaN sink (NaN logits make l NaN too): a NaN entry of the row's denominator, so
  // the row is NaN even when it saw no key and its state is still the sink's lone entry (l = 1),
  // whether the row had no key to see or skipped every key (docs/math.md section 6).
  if (st.m != st.m) return {st.m, st.m, st.m, st.m, st.m};
  if (!(st.l > acc_t(0))) {
    // Fully masked row, or NaN inputs: NaN must propagate, an empty row gives zeros.
    const acc_t z = st.l == acc_t(0) ? acc_t(0) : st.l;
    return {z, z, z, z, z};
  }
  constexpr acc_t ln_unit = static_cast<acc_t>(Unit::kLn);
  const acc_t inv_l = acc_t(1) / st.l;
  const acc_t log_l = std::log(st.l);
  acc_t h = log_l - ln_unit * st.t * inv_l;
  h = h < acc_t(0) ? acc_t(0) : h;
  return {inv_l, ln_unit * st.m + log_l, h, st.u * inv_l * inv_l, inv_l};
}

// The statistics that follow from a row's entropy, sum of squared weights and n_i (docs/math.md
// section 2), written by the kernels' epilogues: normalized entropy H / ln n (0 for n < 2),
// l1/l2 sparsity 1 / sqrt(n sum_p2) and effective keys 1 / sum_p2 (both 0 for an empty row), with
// the entropy itself, bounded as below.
template <typename acc_t>
struct DerivedStats {
  acc_t entropy, normalized_entropy, sparsity, effective_keys;
};

// min(x, hi) that keeps a NaN x (std::fmin would return hi for it).
template <typename acc_t>
EA_HOST_DEVICE acc_t at_most(acc_t x, acc_t hi) {
  return x > hi ? hi : x;
}

// Entropy, normalized entropy, sparsity and effective keys are bounded by their value on a uniform
// row (ln n, 1, 1 and n), which is also where rounding lands them: ln l - t / l of n equal weights
// can come out a few ulps above ln n, and sum_p2 = u / l^2 one ulp under 1 / n, which gave
// effective keys above n. They are clamped at those bounds; their gradients (attention_grad.cpp,
// the backward's delta) are the unclamped formulas', as the clamp only removes rounding.
template <typename acc_t>
EA_HOST_DEVICE DerivedStats<acc_t> derive(acc_t entropy, acc_t sum_p2, int64_t n) {
  if (n <= 0) return {entropy, acc_t(0), acc_t(0), acc_t(0)};
  const acc_t nn = static_cast<acc_t>(n);
  const acc_t log_n = std::log(nn);
  const acc_t h = at_most(entropy, log_n);
  const acc_t ne = n >= 2 ? at_most(h / log_n, acc_t(1)) : acc_t(0);
  return {h, ne, at_most(acc_t(1) / std::sqrt(nn * sum_p2), acc_t(1)),
          at_most(acc_t(1) / sum_p2, nn)};
}

// Backward of one row (docs/math.md section 3). With upstream gradients gL, gH, gU of lse, entropy
// and sum_p2 beside dO, the gradient w.r.t. the scaled logit keeps the FlashAttention-2 form
//   dS_ij = p_ij (dP~_ij - D~_i),  dP~_ij = dP_ij - gH x_ij + 2 gU p_ij,
//   D~_i = dO_i . O_i - gL - gH (lse_i - r_i - H_i) + 2 gU sum_p2_i,
// with x_ij = s_ij - r_i for a per-row reference r_i that cancels between the two (d lse/ds = p,
// dH/ds = -p (s - lse + H), d(sum p^2)/ds = 2 p (p - sum p^2)). The reference decides the rounding:
// r_i = lse_i forms s - lse before g_H multiplies it, an error of eps |s - lse|, where r_i = 0
// rounds g_H s and g_H lse apart and leaves eps |s| after they cancel (float32 entropy gradients
// at logits of standard deviation 9: median error 5.3x a plain float32 softmax's with r_i = 0,
// 2.1x with r_i = lse_i; docs/math.md). The float32 and float64 kernels (CPU, CUDA fallback) take
// r_i = lse_i; the tensor-core families keep r_i = 0 (x = s, no extra subtraction in their inner
// loop): their gradients are rounded to 16 bits, far coarser than that error.
template <typename acc_t>
struct RowGrads {
  acc_t g_lse = 0;
  acc_t g_entropy = 0;
  acc_t g_sum_p2 = 0;
};

template <typename acc_t>
EA_HOST_DEVICE acc_t row_delta(acc_t do_dot_o, const RowGrads<acc_t>& g, acc_t lse, acc_t entropy,
                               acc_t sum_p2, acc_t ref = acc_t(0)) {
  return do_dot_o - g.g_lse - g.g_entropy * ((lse - ref) - entropy) +
         acc_t(2) * g.g_sum_p2 * sum_p2;
}

// dS of one entry without gradients of the entropy or sum p^2 (gH = gU = 0): what a loss of the
// output and lse alone needs. Its own function, not the general one with g = 0: 0 * p is no
// constant to the compiler (p may be inf or NaN), so that would spend an FFMA per entry on it.
template <typename acc_t>
EA_HOST_DEVICE acc_t logit_grad(acc_t p, acc_t dp, acc_t delta) {
  return p * (dp - delta);
}

// lambda_i dS of one entry without gradients of the entropy or sum p^2, from lambda_i and
// lambda_i delta_i of its row: lambda p (dp - delta) as p (lambda dp - lambda delta), an FFMA and
// an FMUL per entry for an FADD and two FMULs. It is the operand of dK = (lambda dS)^T Q, and of dq
// itself where d lambda is not asked for (docs/math.md section 3); lambda delta is formed once per
// row.
template <typename acc_t>
EA_HOST_DEVICE acc_t scaled_logit_grad(acc_t p, acc_t dp, acc_t lam, acc_t lam_delta) {
  using std::fma;
  return p * fma(lam, dp, -lam_delta);
}

// dS of one entry, x = s - r with the r of the row's delta.
template <typename acc_t>
EA_HOST_DEVICE acc_t logit_grad(acc_t p, acc_t dp, acc_t x, acc_t delta, const RowGrads<acc_t>& g) {
  return logit_grad(p, dp - g.g_entropy * x + acc_t(2) * g.g_sum_p2 * p, delta);
}

}  // namespace entropy_attn
