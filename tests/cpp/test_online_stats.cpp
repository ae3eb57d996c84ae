// The online statistics of csrc/online_stats.h, which every kernel shares: one pass over a row's
// logits (rescale + accumulate, in natural and log2 units) against the plain formulas, and the
// state of a row split into key sets and merged (merge: the split-KV forward's combine) against
// one pass over all its keys, with empty splits, an attention sink in one split, and -inf logits;
// and the pass as the Hopper forward makes it (rescale_by with its own factor, the sums of a block
// in partial sums).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "online_stats.h"

namespace {

using entropy_attn::Log2;
using entropy_attn::NaturalLog;
using entropy_attn::RowResult;
using entropy_attn::RowStats;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kLog2e = 1.4426950408889634;

// One pass over logits s (natural units), as a kernel walks a row: the state in Unit, whose
// logits are s * kUnitScale (log2 units: s log2(e)). -inf logits are hidden keys.
template <typename Unit>
RowStats<double> one_pass(const std::vector<double>& s, RowStats<double> st) {
  const double unit = std::is_same_v<Unit, Log2> ? kLog2e : 1.0;
  for (double x : s) {
    const double y = x * unit;
    if (y == -kInf) continue;
    entropy_attn::rescale<double, Unit>(st, std::max(st.m, y));
    const double d = y - st.m;
    entropy_attn::accumulate(st.l, st.t, st.u, d, Unit::exp(d));
  }
  return st;
}

// The plain formulas over the weights p_j = e^{s_j} / sum e^{s} (with the sink's e^{sink}).
RowResult<double> plain(const std::vector<double>& s, bool has_sink, double sink) {
  std::vector<double> all;
  for (double x : s) {
    if (x != -kInf) all.push_back(x);
  }
  if (has_sink) all.push_back(sink);
  if (all.empty()) return {0, 0, 0, 0, 0};
  const double m = *std::max_element(all.begin(), all.end());
  double l = 0;
  for (double x : all) l += std::exp(x - m);
  const double lse = m + std::log(l);
  double h = 0, p2 = 0, pmax = 0;
  for (double x : all) {
    const double p = std::exp(x - lse);
    h -= p * (x - lse);
    p2 += p * p;
    pmax = std::max(pmax, p);
  }
  return {1 / l, lse, h, p2, pmax};
}

void expect_result(const RowResult<double>& got, const RowResult<double>& want, const char* what) {
  EXPECT_NEAR(got.lse, want.lse, 1e-12 * (1 + std::abs(want.lse))) << what;
  EXPECT_NEAR(got.entropy, want.entropy, 1e-11) << what;
  EXPECT_NEAR(got.sum_p2, want.sum_p2, 1e-12) << what;
  EXPECT_NEAR(got.max_weight, want.max_weight, 1e-12) << what;
}

template <typename Unit>
void check_merged_splits(std::mt19937& g) {
  std::normal_distribution<double> normal(0.0, 3.0);
  for (int it = 0; it < 500; ++it) {
    const int n = static_cast<int>(g() % 200);
    std::vector<double> s(n);
    for (double& x : s) x = (g() % 7 == 0) ? -kInf : normal(g);
    const bool has_sink = g() % 3 == 0;
    const double sink = normal(g);
    const double unit = std::is_same_v<Unit, Log2> ? kLog2e : 1.0;
    const RowStats<double> init = entropy_attn::initial_state<double>(has_sink, sink * unit);
    const RowResult<double> want = plain(s, has_sink, sink);
    expect_result(entropy_attn::finalize<double, Unit>(one_pass<Unit>(s, init)), want, "one pass");
    // Contiguous splits (some empty), the sink in the first one only, merged in order.
    const int splits = 1 + static_cast<int>(g() % 8);
    const int per = (n + splits - 1) / std::max(splits, 1);
    RowStats<double> merged;
    for (int k = 0; k < splits; ++k) {
      const int lo = std::min(n, k * per), hi = std::min(n, (k + 1) * per);
      const std::vector<double> part(s.begin() + lo, s.begin() + hi);
      const RowStats<double> start = k == 0 ? init : RowStats<double>{};
      merged = entropy_attn::merge<double, Unit>(merged, one_pass<Unit>(part, start));
    }
    expect_result(entropy_attn::finalize<double, Unit>(merged), want, "merged splits");
  }
}

// A row as csrc/cuda/sm90/fwd_kernel.cuh walks it: blocks of keys, each moving the state to the
// block's max by rescale_by with the factor formed by the caller (2^(m - m_new), O's factor), then
// adding the block's terms with l and u split into even and odd columns, the odd ones added at the
// end of the block. Against the plain formulas.
RowStats<double> blocked_pass(const std::vector<double>& s, RowStats<double> st, size_t block) {
  for (size_t b0 = 0; b0 < s.size(); b0 += block) {
    const size_t b1 = std::min(s.size(), b0 + block);
    double mx = -kInf;
    for (size_t j = b0; j < b1; ++j) mx = std::max(mx, s[j] * kLog2e);
    const double m_new = std::max(st.m, mx);
    const double m_use = m_new == -kInf ? 0.0 : m_new;
    entropy_attn::rescale_by(st, m_new, std::exp2(st.m - m_use));
    double l_odd = 0, u_odd = 0;
    for (size_t j = b0; j < b1; ++j) {
      const double x = s[j] * kLog2e - m_use;
      if (x == -kInf) continue;  // a hidden key adds nothing
      double& l = (j - b0) % 2 == 0 ? st.l : l_odd;
      double& u = (j - b0) % 2 == 0 ? st.u : u_odd;
      entropy_attn::accumulate(l, st.t, u, x, std::exp2(x));
    }
    st.l += l_odd;
    st.u += u_odd;
  }
  return st;
}

TEST(OnlineStats, BlockedPassWithCallersFactorEqualsPlainFormulas) {
  std::mt19937 g(13);
  std::normal_distribution<double> normal(0.0, 4.0);
  for (int it = 0; it < 500; ++it) {
    const int n = static_cast<int>(g() % 300);
    std::vector<double> s(n);
    // Later blocks with larger logits make the state move; some keys hidden.
    for (int j = 0; j < n; ++j) s[j] = (g() % 9 == 0) ? -kInf : normal(g) + 0.05 * j;
    const bool has_sink = g() % 3 == 0;
    const double sink = normal(g);
    const RowStats<double> init = entropy_attn::initial_state<double>(has_sink, sink * kLog2e);
    const size_t block = 1 + g() % 64;
    expect_result(entropy_attn::finalize<double, Log2>(blocked_pass(s, init, block)),
                  plain(s, has_sink, sink), "blocked pass");
  }
}

// rescale_by does not read the factor while the state is empty (the kernel's factor is 0 or
// 2^(-inf - m) there): only m moves.
TEST(OnlineStats, RescaleByLeavesAnEmptyStateEmpty) {
  RowStats<double> st;
  entropy_attn::rescale_by(st, 2.0, std::nan(""));
  EXPECT_EQ(st.m, 2.0);
  EXPECT_EQ(st.l, 0.0);
  EXPECT_EQ(st.t, 0.0);
  EXPECT_EQ(st.u, 0.0);
}

TEST(OnlineStats, MergedSplitsEqualOnePassNaturalUnits) {
  std::mt19937 g(11);
  check_merged_splits<NaturalLog>(g);
}

TEST(OnlineStats, MergedSplitsEqualOnePassLog2Units) {
  std::mt19937 g(12);
  check_merged_splits<Log2>(g);
}

TEST(OnlineStats, MergeOfEmptyStatesIsEmpty) {
  const RowStats<double> empty;
  const RowStats<double> m = entropy_attn::merge<double, Log2>(empty, empty);
  EXPECT_EQ(m.l, 0.0);
  const RowResult<double> r = entropy_attn::finalize<double, Log2>(m);
  EXPECT_EQ(r.lse, 0.0);
  EXPECT_EQ(r.entropy, 0.0);
  EXPECT_EQ(r.inv_l, 0.0);
}

TEST(OnlineStats, MergePropagatesNaN) {
  RowStats<double> a, b;
  a.m = std::nan(""), a.l = 1;
  b.m = 0, b.l = 1;
  EXPECT_TRUE(std::isnan(entropy_attn::merge<double, Log2>(a, b).l));
  EXPECT_TRUE(std::isnan(entropy_attn::merge<double, Log2>(b, a).l));
}

// A NaN sink is a NaN entry of the row's softmax: a row that sees no key, whose state stays the
// sink's lone entry (m = NaN, l = 1), finishes NaN, as rows that see keys do.
TEST(OnlineStats, NaNSinkRowWithoutKeysIsNaN) {
  const RowStats<double> alone = entropy_attn::initial_state<double>(true, std::nan(""));
  const RowResult<double> r = entropy_attn::finalize<double, NaturalLog>(alone);
  for (double x : {r.inv_l, r.lse, r.entropy, r.sum_p2, r.max_weight}) EXPECT_TRUE(std::isnan(x));
  const RowResult<double> seen =
      entropy_attn::finalize<double, Log2>(one_pass<Log2>({0.5, -1.0}, alone));
  EXPECT_TRUE(std::isnan(seen.lse) && std::isnan(seen.entropy));
}

// The backward of one row (logit_grad with row_delta's D~) is the derivative of
//   f(s) = sum_j p_j w_j + gL lse + gH H + gU sum_j p_j^2
// (w_j: the upstream gradient of p_j, dP), against central differences, for references r = 0 and
// r = lse; and the form without statistic gradients equals the general one with g = 0, bit for bit.
TEST(OnlineStats, LogitGradIsTheRowsDerivative) {
  const std::vector<double> s0 = {0.3, -1.2, 2.0, 0.7, -0.4}, w = {0.5, -2.0, 1.5, 0.25, -0.75};
  const entropy_attn::RowGrads<double> g{0.6, -0.9, 1.7};
  const auto f = [&](const std::vector<double>& s) {
    const double m = *std::max_element(s.begin(), s.end());
    double l = 0;
    for (double x : s) l += std::exp(x - m);
    const double lse = m + std::log(l);
    double pw = 0, h = 0, p2 = 0;
    for (size_t j = 0; j < s.size(); ++j) {
      const double p = std::exp(s[j] - lse);
      pw += p * w[j], h -= p * (s[j] - lse), p2 += p * p;
    }
    return pw + g.g_lse * lse + g.g_entropy * h + g.g_sum_p2 * p2;
  };
  const RowResult<double> r = entropy_attn::finalize<double, NaturalLog>(
      one_pass<NaturalLog>(s0, entropy_attn::initial_state<double>(false, 0.0)));
  double pw = 0;
  for (size_t j = 0; j < s0.size(); ++j) pw += std::exp(s0[j] - r.lse) * w[j];
  for (const double ref : {0.0, r.lse}) {
    const double delta = entropy_attn::row_delta(pw, g, r.lse, r.entropy, r.sum_p2, ref);
    for (size_t j = 0; j < s0.size(); ++j) {
      std::vector<double> up = s0, down = s0;
      up[j] += 1e-6, down[j] -= 1e-6;
      const double want = (f(up) - f(down)) / 2e-6;
      const double p = std::exp(s0[j] - r.lse);
      EXPECT_NEAR(entropy_attn::logit_grad(p, w[j], s0[j] - ref, delta, g), want, 1e-8)
          << "key " << j << ", reference " << ref;
    }
  }
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> u(-4.f, 4.f);
  for (int k = 0; k < 1000; ++k) {
    const float p = std::abs(u(gen)) / 4.f, dp = u(gen), x = u(gen), delta = u(gen);
    const float general =
        entropy_attn::logit_grad(p, dp, x, delta, entropy_attn::RowGrads<float>{});
    EXPECT_EQ(entropy_attn::logit_grad(p, dp, delta), general);
  }
}

// The tensor-core kernels' lambda dS, p (lambda dp - lambda delta), is lambda times logit_grad's dS
// to within float32 rounding of the terms it cancels: |lambda| (|dp| + |delta|) p eps a few times.
// (A mutation that drops lambda from dp, or the sign of lambda delta, is far outside it.)
TEST(OnlineStats, ScaledLogitGradIsLambdaTimesLogitGrad) {
  std::mt19937 gen(11);
  std::uniform_real_distribution<float> u(-4.f, 4.f);
  for (int k = 0; k < 1000; ++k) {
    const float p = std::abs(u(gen)) / 4.f, dp = u(gen), delta = u(gen), lam = u(gen) / 2.f;
    const double want = static_cast<double>(lam) * p * (static_cast<double>(dp) - delta);
    const double tol = 4 * std::numeric_limits<float>::epsilon() * std::abs(lam) * p *
                       (std::abs(dp) + std::abs(delta));
    EXPECT_NEAR(entropy_attn::scaled_logit_grad(p, dp, lam, lam * delta), want, tol)
        << "p " << p << ", dp " << dp << ", delta " << delta << ", lambda " << lam;
  }
}

}  // namespace
