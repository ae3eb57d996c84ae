// Per-element terms of the row-reduction ops (entropy, sparsity), shared by the CPU and CUDA
// kernels so that both devices reduce with the same formulas. No ATen dependency.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "online_stats.h"  // EA_HOST_DEVICE

namespace entropy_attn {

// -p ln p, with 0 ln 0 = 0.
template <typename acc_t>
EA_HOST_DEVICE acc_t entropy_term(acc_t p) {
  return p == acc_t(0) ? acc_t(0) : -p * std::log(p);
}

// mean|a| / sqrt(mean a^2) = l1 / sqrt(n * l2) from l1 = sum |a| and l2 = sum a^2 over n entries;
// an all-zero slice has no direction: 0. At most 1 (Cauchy-Schwarz), the value of a uniform slice,
// which rounding could otherwise cross (online_stats.h: at_most).
template <typename acc_t>
EA_HOST_DEVICE acc_t sparsity_value(acc_t l1, acc_t l2, int64_t n) {
  return l2 == acc_t(0) ? acc_t(0) : at_most(l1 / std::sqrt(static_cast<acc_t>(n) * l2), acc_t(1));
}

// The sparsity's sums are taken over |a_j| / d with d the slice's largest |a| (S is scale-free),
// so that they neither underflow (a slice of 1e-25 in float32) nor overflow (1e20): this is d,
// or 1 for an all-zero slice (S = 0) and one whose maximum is NaN (the sums carry the NaN).
template <typename acc_t>
EA_HOST_DEVICE acc_t sparsity_divisor(acc_t abs_max) {
  return abs_max > acc_t(0) ? abs_max : acc_t(1);
}

// attention_sparsity of non-softmax attention a = b^p: the base b = relu(s) with p = 2 ("relu2") or
// b = s with p = 1 ("identity"); masked (-inf) logits give 0, NaN stays NaN.
template <typename acc_t>
EA_HOST_DEVICE acc_t power_base(bool relu2, acc_t s) {
  if (relu2) return s < acc_t(0) ? acc_t(0) : s;
  return s == -std::numeric_limits<acc_t>::infinity() ? acc_t(0) : s;
}

// a = b^p is homogeneous and S = l1 / sqrt(n l2) is scale-free, so the power sums l1 = sum |a|
// (st.l) and l2 = sum a^2 (st.u) are kept relative to the running max |b| (st.m, starting at
// -inf), as the softmax keeps its sums relative to its max: no overflow or underflow. Moves the
// state to a block's max |b| when that is larger.
template <typename acc_t>
EA_HOST_DEVICE void rescale_power_sums(RowStats<acc_t>& st, acc_t block_bmax, bool relu2) {
  if (!(block_bmax > st.m)) return;
  const acc_t rho = st.m > acc_t(0) ? st.m / block_bmax : acc_t(0);
  const acc_t rho_p = relu2 ? rho * rho : rho;
  st.l *= rho_p;
  st.u *= rho_p * rho_p;
  st.m = block_bmax;
}

// The factors that take a base b of the running max m = max |b| (> 0) to b / m as (b * up) * inv:
// 1 / m overflows for a subnormal m (1 / 2e-39 in float32: infinite sums, a NaN S where the math
// has a value), so such an m and its bases are first scaled up by 1 / epsilon, a power of two
// (exact), which makes the smallest subnormal the smallest normal number.
template <typename acc_t>
struct PowerScale {
  acc_t up, inv;
};

template <typename acc_t>
EA_HOST_DEVICE PowerScale<acc_t> power_scale(acc_t m) {
  const acc_t up = m < std::numeric_limits<acc_t>::min()
                       ? acc_t(1) / std::numeric_limits<acc_t>::epsilon()
                       : acc_t(1);
  return {up, acc_t(1) / (m * up)};
}

// S_i = l1 / sqrt(n_i l2) of attention_sparsity, at most 1 as sparsity_value; an empty or all-zero
// row has no direction: 0, as the attention op's statistics (NaN propagates).
template <typename acc_t>
EA_HOST_DEVICE acc_t attention_sparsity_value(acc_t l1, acc_t l2, int64_t n) {
  const acc_t denom = std::sqrt(static_cast<acc_t>(n) * l2);
  return denom > acc_t(0) || l2 != l2 || l1 != l1 ? at_most(l1 / denom, acc_t(1)) : acc_t(0);
}

}  // namespace entropy_attn
