// Attention dropout from a counter-based generator (Philox4x32-10, Salmon et al., SC 2011), as
// scaled_dot_product_attention and FlashAttention do: the keep/drop decision of weight (b, h, i, j)
// is a pure function of the call's seed and of those indices, so the backward regenerates the
// forward's mask without storing it, and every kernel (CPU, the CUDA fallback, the tensor-core
// families; all include this header) drops the same weights. tests/reference.py reimplements the
// generator independently; docs/math.md section 6 states the scheme.
//
// One Philox call (128 bits) decides 8 weights with a 16-bit draw each: rows i and i + 8 (i mod 16
// < 8) times keys j, j + 1, j + 8, j + 9 (j mod 16 in {0, 2, 4, 6}). That group is what one thread
// holds of an mma.sync m16n8k16 / wgmma accumulator (rows g and g + 8, columns 2q, 2q + 1 of two
// adjacent n8 tiles), whatever the tile sizes (multiples of 16), so a tensor-core kernel spends one
// call per 8 of its weights (the sm80 backward, whose tiles give a thread n8 tiles 32 keys apart,
// one per 4).
#pragma once

#include <cstdint>

#include "online_stats.h"  // EA_HOST_DEVICE

namespace entropy_attn {

// Ten Philox4x32 rounds of counter c under key k: four independent 32-bit draws.
struct PhiloxDraws {
  uint32_t x[4];
};

EA_HOST_DEVICE PhiloxDraws philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                         uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kM0) * c0;
    const uint64_t p1 = static_cast<uint64_t>(kM1) * c2;
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += kW0;
    k1 += kW1;
  }
  return {{c0, c1, c2, c3}};
}

// The dropout of one call. Weight (head row bh = b * H + h, query i, key j) belongs to the group
// whose Philox counter is (4 (j / 16) + (j / 2) mod 4, 8 (i / 16) + i mod 8, bh, 0) under key
// (seed low, seed high); its slot in the group is s = 4 ((i / 8) mod 2) + 2 ((j / 8) mod 2) + j mod
// 2, its draw the 16-bit half s mod 2 (low, high) of word s / 2. It is kept when the draw is >=
// threshold = round(p 2^16) (at least 1, at most 2^16 - 1), and kept weights are multiplied by
// 1 / (1 - threshold / 2^16), the inverse of the keep probability actually used, so that the
// expectation of every output is exactly the output without dropout. Packed (varlen) calls use
// b = 0 and the packed indices of the row and key.
template <typename acc_t>
struct Dropout {
  uint32_t threshold = 0;  // 0: no dropout
  uint32_t key0 = 0, key1 = 0;
  acc_t keep_scale = 1;  // 1 / (1 - threshold / 2^16)

  EA_HOST_DEVICE bool on() const { return threshold != 0; }

  // The draws of the group that holds weight (bh, i, j). (Rows and keys are below 2^31: their
  // low words give the counter, in 32-bit arithmetic, which the kernels' registers can afford.)
  EA_HOST_DEVICE PhiloxDraws group_draws(int64_t bh, int64_t i, int64_t j) const {
    const uint32_t i32 = static_cast<uint32_t>(i), j32 = static_cast<uint32_t>(j);
    return philox4x32_10(((j32 >> 4) << 2) | ((j32 >> 1) & 3u), ((i32 >> 4) << 3) | (i32 & 7u),
                         static_cast<uint32_t>(bh), 0u, key0, key1);
  }
  // The slot of weight (i, j) in its group.
  EA_HOST_DEVICE static int slot(int64_t i, int64_t j) {
    const uint32_t i32 = static_cast<uint32_t>(i), j32 = static_cast<uint32_t>(j);
    return static_cast<int>(((i32 >> 3) & 1u) << 2 | ((j32 >> 3) & 1u) << 1 | (j32 & 1u));
  }
  // Whether the weight of slot s is kept. The draw is compared in the high half of a word (the
  // low half shifted up), so the test is one unsigned comparison: with s known at compile time,
  // a shift (even s) and a compare.
  EA_HOST_DEVICE bool kept(const PhiloxDraws& d, int s) const {
    const uint32_t w =
        (s >> 1) < 2 ? ((s >> 1) == 0 ? d.x[0] : d.x[1]) : ((s >> 1) == 2 ? d.x[2] : d.x[3]);
    return ((s & 1) ? w : w << 16) >= threshold << 16;
  }
  // The factor of weight (bh, i, j): 1 / (1 - p) if kept, else 0.
  EA_HOST_DEVICE acc_t factor(int64_t bh, int64_t i, int64_t j) const {
    return kept(group_draws(bh, i, j), slot(i, j)) ? keep_scale : acc_t(0);
  }

  static Dropout make(double p, int64_t seed) {
    Dropout d;
    if (!(p > 0)) return d;
    const double t = p * 65536.0;
    d.threshold = t >= 65535.0 ? 65535u : static_cast<uint32_t>(t + 0.5);
    if (d.threshold == 0) d.threshold = 1;  // p > 0 drops something, however rarely
    const uint64_t s = static_cast<uint64_t>(seed);
    d.key0 = static_cast<uint32_t>(s), d.key1 = static_cast<uint32_t>(s >> 32);
    d.keep_scale = static_cast<acc_t>(65536.0 / (65536.0 - d.threshold));
    return d;
  }
};

}  // namespace entropy_attn
