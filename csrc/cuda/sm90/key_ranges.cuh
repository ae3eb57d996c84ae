// The keys each query row of a Hopper kernel may see, and the rows that see a block of keys:
// shared by the forward (a query tile's key blocks) and the backward (a key block's query blocks).
#pragma once

#include "../../kernel_args.h"

namespace entropy_attn::cuda::sm90 {

// The keys [lo, hi) query row i may see. kBanded (the instantiations compiled with causality on):
// those of the call's KeyPattern (kernel_args.h), which for plain causality are
// [0, min(i + 1, Lk)) and otherwise add a sliding window or bottom-right alignment; else every
// key. A row past q_len sees none. Both bounds never decrease as i grows.
template <bool kBanded>
__device__ __forceinline__ KeyRange row_keys(const KeyPattern& pattern, int i, int q_len,
                                             int kv_len) {
  if (i >= q_len) return {0, 0};
  if constexpr (kBanded) return pattern.local(i, q_len, kv_len);
  return {0, kv_len};
}

// The first row i in [0, q_len) for which pred(i) holds, or q_len; pred must be false, then true,
// as i grows (as "hi_i > j" and "lo_i >= j" are).
template <typename Pred>
__device__ __forceinline__ int first_row(int q_len, const Pred& pred) {
  int lo = 0, hi = q_len;
  while (lo < hi) {
    const int mid = lo + (hi - lo) / 2;
    if (pred(mid)) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

}  // namespace entropy_attn::cuda::sm90
