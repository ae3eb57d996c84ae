// Attention dropout from a counter-based generator (Philox4x32-10, Salmon et al., SC 2011), as
// scaled_dot_product_attention and FlashAttention do: the keep/drop decision of weight (b, h, i, j)
// is a pure function of the call's seed and of those indices, so the backward regenerates the
// forward's mask without storing it, and the CPU and CUDA kernels (which both include this header)
// drop the same weights. tests/reference.py reimplements the generator independently.
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

// The dropout of one call. Weight (head row bh = b * H + h, query i, key j) is kept when the draw
// number j % 4 of counter (j / 4, i, bh, 0) under key (seed low, seed high) is >= threshold =
// round(p * 2^32); kept weights are multiplied by 1 / (1 - p). Packed (varlen) calls use b = 0 and
// the packed indices of the row and key.
template <typename acc_t>
struct Dropout {
  uint32_t threshold = 0;  // 0: no dropout
  uint32_t key0 = 0, key1 = 0;
  acc_t keep_scale = 1;  // 1 / (1 - p)

  EA_HOST_DEVICE bool on() const { return threshold != 0; }
  // The draws of keys 4 * (j / 4) .. 4 * (j / 4) + 3 of row (bh, i).
  EA_HOST_DEVICE PhiloxDraws draws(int64_t bh, int64_t i, int64_t j) const {
    return philox4x32_10(static_cast<uint32_t>(j >> 2), static_cast<uint32_t>(i),
                         static_cast<uint32_t>(bh), 0u, key0, key1);
  }
  // The factor of weight (bh, i, j): 1 / (1 - p) if kept, else 0.
  EA_HOST_DEVICE acc_t factor(int64_t bh, int64_t i, int64_t j) const {
    return draws(bh, i, j).x[j & 3] >= threshold ? keep_scale : acc_t(0);
  }

  static Dropout make(double p, int64_t seed) {
    Dropout d;
    if (!(p > 0)) return d;
    const double t = p * 4294967296.0;
    d.threshold = t >= 4294967295.0 ? 4294967295u : static_cast<uint32_t>(t + 0.5);
    if (d.threshold == 0) d.threshold = 1;  // p > 0 drops something, however rarely
    const uint64_t s = static_cast<uint64_t>(seed);
    d.key0 = static_cast<uint32_t>(s), d.key1 = static_cast<uint32_t>(s >> 32);
    d.keep_scale = static_cast<acc_t>(1.0 / (1.0 - p));
    return d;
  }
};

}  // namespace entropy_attn
