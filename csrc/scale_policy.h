// Scale policies (docs/math.md section 1): the one place where the per-row logit scale lambda_i is
// derived from the number of keys n_i that row i may attend to. Shared by every device.
#pragma once

#include <cmath>
#include <cstdint>

#include "online_stats.h"  // EA_HOST_DEVICE

namespace entropy_attn {

enum class ScaleMode : int8_t {
  kFixed = 0,        // lambda = c / tau
  kLogN = 1,         // lambda = c * log_b(n) / tau          (entropy-invariant, practical form)
  kLogNSharpen = 2,  // lambda = c * max(1, log_b(n)) / tau  (Qwen use_logn_attn: only sharpen)
};

// Length factor g(n) of a policy; log_base b > 1 is the training length at which "logn" equals the
// standard scale. n = 0 (an empty row) gives 0: nothing is scaled.
template <typename acc_t>
EA_HOST_DEVICE acc_t length_factor(ScaleMode mode, int64_t n, acc_t inv_log_base) {
  if (mode == ScaleMode::kFixed) return acc_t(1);
  if (n <= 0) return acc_t(0);
  const acc_t g = std::log(static_cast<acc_t>(n)) * inv_log_base;
  if (mode == ScaleMode::kLogNSharpen) return g < acc_t(1) ? acc_t(1) : g;
  return g;
}

}  // namespace entropy_attn
