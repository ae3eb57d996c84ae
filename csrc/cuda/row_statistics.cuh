// The per-row statistics a CUDA forward writes, in one place for all of them (the fallback, the
// sm80 and sm90 families, the split-KV combine): the three accumulated ones and the three that
// follow from them and n (online_stats.h: derive; docs/math.md section 2).
#pragma once

#include <cstdint>

#include "../online_stats.h"
#include "params.h"

namespace entropy_attn::cuda {

// Writes row `row`'s statistics from its finished state. n_keys is the number of keys the row
// sees (n_i); with a sink entry (online_stats.h: has_sink_entry) the distribution has one more
// entry, which the derived statistics count (the sink is not a key: n_i itself is unchanged).
template <typename acc_t>
__device__ __forceinline__ void store_row_statistics(const FwdParams<acc_t>& p, int64_t row,
                                                     const RowResult<acc_t>& res, int64_t n_keys,
                                                     bool with_sink) {
  const DerivedStats<acc_t> d = derive(res.entropy, res.sum_p2, n_keys + (with_sink ? 1 : 0));
  p.entropy[row] = d.entropy;
  p.sum_p2[row] = res.sum_p2;
  p.max_weight[row] = res.max_weight;
  p.normalized_entropy[row] = d.normalized_entropy;
  p.sparsity[row] = d.sparsity;
  p.effective_keys[row] = d.effective_keys;
}

}  // namespace entropy_attn::cuda
