// The split-KV count (csrc/cuda/split_kv.h: FlashAttention-2's rule), on the host: calls that fill
// the GPU are not split; decoding calls are, into a count that fills it without parts that add no
// blocks; the count stays within its bounds for any call.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>

#include "cuda/split_kv.h"

namespace {

using entropy_attn::cuda::kMaxSplits;
using entropy_attn::cuda::split_kv_count;

TEST(SplitKv, CallsThatFillTheGpuAreNotSplit) {
  EXPECT_EQ(split_kv_count(132, 1000, 132), 1);
  EXPECT_EQ(split_kv_count(106, 1000, 132), 1);  // 80% of the SMs
  EXPECT_EQ(split_kv_count(4096, 1000, 132), 1);
  EXPECT_EQ(split_kv_count(8, 1, 132), 1);  // one key block: nothing to split
  EXPECT_EQ(split_kv_count(0, 100, 132), 1);
}

TEST(SplitKv, DecodingIsSplitToFillTheGpu) {
  // One query tile per (batch, head): 32 heads on an H100's 132 SMs, an 8k-token cache in 64-key
  // blocks. 4 parts make 128 blocks, 97% of one wave.
  EXPECT_EQ(split_kv_count(32, 128, 132), 4);
  // 8 (batch, head) pairs on an A100's 108 SMs: 12 parts, 96 blocks (89%: the first count within
  // 85% of the best, 27 parts' two full waves).
  EXPECT_EQ(split_kv_count(8, 512, 108), 12);
}

TEST(SplitKv, CountIsBoundedEfficientAndEligible) {
  std::mt19937 g(3);
  for (int it = 0; it < 20000; ++it) {
    const int sms = 1 + static_cast<int>(g() % 200);
    const int64_t tiles = 1 + static_cast<int64_t>(g() % 300);
    const int64_t blocks = 1 + static_cast<int64_t>(g() % 5000);
    const int s = split_kv_count(tiles, blocks, sms);
    ASSERT_GE(s, 1);
    ASSERT_LE(s, std::max<int64_t>(1, std::min<int64_t>({kMaxSplits, sms, blocks})));
    if (static_cast<double>(tiles) >= 0.8 * sms) {
      ASSERT_EQ(s, 1);
    }
    if (s > 1) {
      // A part more than s - 1 parts would leave: its blocks per part differ.
      ASSERT_NE((blocks + s - 1) / s, (blocks + s - 2) / (s - 1));
      // No fewer parts reach 85% of the best wave efficiency among the eligible counts.
      auto eff = [&](int n) {
        const double waves = static_cast<double>(tiles) * n / sms;
        return waves / std::ceil(waves);
      };
      EXPECT_GE(eff(s), 0.85 * eff(1) - 1e-12);
    }
  }
}

}  // namespace
