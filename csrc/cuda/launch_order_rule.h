// The host's choice of a call's launch order (launch_order.h), apart from the environment variable
// and the device queries (family.cpp: launch_order_sections), so that
// tests/cpp/test_launch_order.cpp checks it on any machine.
#pragma once

#include <algorithm>
#include <cstdint>

#include "../kernel_args.h"
#include "launch_order.h"

namespace entropy_attn::cuda {

// What ENTROPY_ATTN_CUDA_LAUNCH_ORDER asks for: the rule ("auto"), the grid's own order ("heads"),
// or a number of sections (at least 1).
struct LaunchOrderSetting {
  enum class Kind { kAuto, kGridOrder, kSections };
  Kind kind = Kind::kAuto;
  int sections = 0;
};

// The device's L2 in bytes and the blocks of the kernel that it runs at once.
struct LaunchDevice {
  int64_t l2_bytes = 0, resident_blocks = 0;
};

// The number of sections of a call's grid (0: the grid's own order): (y, z) entries are query heads
// x batch for the forward, KV heads x batch for the backward; x is tiles (128 query rows or keys:
// the rule needs only their order of magnitude) times the forward's split-KV parts (`splits`, 1
// for the backward). The rule orders causal calls and windows (keys bounded on the right: the
// tiles' work grows with the query tile and shrinks with the key block), one document per batch
// entry, in sections whose reused operands fit in L2 (launch_sections): every query tile of a head
// reads its K and V, which the query heads of a GQA group share; every key block of a KV head
// reads Q and dO of its group's query heads and their five row values, and adds into their
// float32 dq accumulator. A forced number of sections applies to any call. Grids of 2^32 blocks
// or more keep their order (every family's tiles hold 64 rows or more, which bounds the blocks).
template <typename Shape>
int launch_order_rule(const Shape& s, const KeyPattern& pattern, int64_t element_size,
                      bool backward, int splits, LaunchOrderSetting setting,
                      const LaunchDevice& device) {
  const int64_t entries = backward ? s.batch * s.kv_heads : s.batch * s.heads;
  const int64_t len = backward ? s.kv_len : s.q_len;
  if (setting.kind == LaunchOrderSetting::Kind::kGridOrder ||
      !launch_tile_fits(entries, (len + 63) / 64 * splits)) {
    return 0;
  }
  if (setting.kind == LaunchOrderSetting::Kind::kSections) return std::max(setting.sections, 0);
  if (pattern.right < 0 || pattern.cu_q != nullptr) return 0;
  const int64_t group = s.heads / s.kv_heads;
  const int64_t bytes =
      backward
          ? group * s.q_len * ((s.head_dim + s.v_head_dim) * element_size + (s.head_dim + 5) * 4)
          : std::max<int64_t>(1, s.kv_len * (s.head_dim + s.v_head_dim) * element_size / group);
  return launch_sections(entries, (len + 127) / 128 * splits, bytes, device.l2_bytes,
                         device.resident_blocks);
}

}  // namespace entropy_attn::cuda
