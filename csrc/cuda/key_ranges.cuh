// The keys each query row of a tensor-core kernel (the sm80 and sm90 families) may see, and the
// rows that see a block of keys: shared by the forwards (a query tile's key blocks) and the
// backwards (a key block's query blocks).
#pragma once

#include "../kernel_args.h"

namespace entropy_attn::cuda {

// The keys [lo, hi) query row i may see. kBanded (the instantiations compiled with causality on):
// those of the call's KeyPattern (kernel_args.h), which for plain causality are
// [0, min(i + 1, Lk)) and otherwise add a sliding window, bottom-right alignment or the bounds of
// packed documents (then q_len and kv_len are the packed totals, and a row's range lies inside its
// document's keys); else every key. A row past q_len sees none. Both bounds never decrease as i
// grows, across documents too (document d's keys come before document d + 1's).
template <bool kBanded>
__device__ __forceinline__ KeyRange row_keys(const KeyPattern& pattern, int i, int q_len,
                                             int kv_len) {
  if (i >= q_len) return {0, 0};
  if constexpr (kBanded) return pattern.keys(i, q_len, kv_len);
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

// The query blocks [begin, end) of block_m rows whose rows may see a key of [j0, j1): from the
// block of the first row whose hi passes j0 to that of the last row whose lo is below j1 (both
// bounds never decrease as i grows); every block without kBanded. The backwards' key blocks walk
// these.
struct BlockRange {
  int begin, end;
};
template <bool kBanded>
__device__ __forceinline__ BlockRange query_blocks(const KeyPattern& pattern, int q_len, int kv_len,
                                                   int j0, int j1, int block_m) {
  if constexpr (!kBanded) return {0, (q_len + block_m - 1) / block_m};
  const int first =
      first_row(q_len, [&](int i) { return row_keys<true>(pattern, i, q_len, kv_len).hi > j0; });
  const int end =
      first_row(q_len, [&](int i) { return row_keys<true>(pattern, i, q_len, kv_len).lo >= j1; });
  const int begin = first / block_m;
  return {begin, end > first ? (end + block_m - 1) / block_m : begin};
}

}  // namespace entropy_attn::cuda
