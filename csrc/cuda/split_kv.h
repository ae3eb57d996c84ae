// How many parts split-KV cuts each query tile's keys into (sm80/split_kv.cuh): host code, no
// CUDA, so that tests/cpp/test_split_kv.cpp checks it on any machine.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace entropy_attn::cuda {

// The most parts a tile's keys are cut into (each part is one thread block and one float32 copy
// of the tile's output in the workspace).
constexpr int kMaxSplits = 128;

// FlashAttention-2's rule (num_splits_heuristic): a call whose tiles (query tiles x heads x batch)
// fill 80% of a wave (`sms`: the blocks the GPU runs at once, two per SM for the sm80 forward) is
// not split; otherwise the smallest split count whose wave efficiency (tiles x splits / sms over
// its ceiling) is within 85% of the best, among the counts that change
// the blocks per part (cutting 10 blocks in 4 or in 5 gives parts of 3 and 2: 5 is eligible; 6
// gives 2 again: not).
inline int split_kv_count(int64_t tiles, int64_t key_blocks, int sms) {
  if (tiles <= 0 || sms <= 0 || static_cast<double>(tiles) >= 0.8 * sms || key_blocks < 2) return 1;
  const int max_splits =
      static_cast<int>(std::min<int64_t>({kMaxSplits, static_cast<int64_t>(sms), key_blocks}));
  auto blocks_per_part = [&](int s) { return (key_blocks + s - 1) / s; };
  auto eligible = [&](int s) { return s == 1 || blocks_per_part(s) != blocks_per_part(s - 1); };
  auto efficiency = [&](int s) {
    const double waves = static_cast<double>(tiles) * s / sms;
    return waves / std::ceil(waves);
  };
  double best = 0;
  for (int s = 1; s <= max_splits; ++s) {
    if (eligible(s)) best = std::max(best, efficiency(s));
  }
  for (int s = 1; s <= max_splits; ++s) {
    if (eligible(s) && efficiency(s) >= 0.85 * best) return s;
  }
  return 1;
}

}  // namespace entropy_attn::cuda
