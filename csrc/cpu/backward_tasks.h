// How the CPU backward divides its work into tasks that never write the same memory, so that it
// needs no atomics or locks. A task is a (batch, key/value head) pair, or, when there are fewer
// pairs than threads, a part of one: some of the query heads that share the key/value head (a
// head part), and some of its keys (a key chunk). A task owns the dQ rows of its query heads
// within its chunk and the dK / dV rows of its keys within its part, so head parts need partial
// dK / dV and key chunks partial dQ (and dlambda), summed after the kernel.
//
// The partials are what a thread count can make large: every key chunk holds a whole dQ, B H Lq D
// in float (for MQA with 32 threads that was 32 dQ, 600 MiB at L = 16384 where SDPA needs 60). So
// head parts come first (a dK / dV partial is B Hkv Lk (D + Dv): 1 / group of a dQ for Dv = D),
// and key chunks only within a fixed budget: past it a backward keeps fewer threads busy rather
// than grow its memory with the thread count.
#pragma once

#include <algorithm>
#include <cstdint>

namespace entropy_attn::cpu {

// Bytes all key chunks' partial dQ may take together beyond one dQ.
constexpr int64_t kKeyChunkBudgetBytes = int64_t{256} << 20;

struct BackwardTasks {
  int64_t heads_per_part = 1;  // query heads of one key/value head in one task
  int64_t parts = 1;           // head parts per key/value head (each with a partial dK / dV)
  int64_t chunk_keys = 0;      // keys per chunk, a multiple of the key block
  int64_t chunks = 1;          // key chunks (each with a partial dQ and dlambda)

  // pairs: the (batch, key/value head) pairs that tasks own (fewer when the mask's gradient is
  // shared along an index: one task walks it); group: query heads per key/value head;
  // whole_heads / whole_keys: the mask's gradient is shared along the query heads / the keys, so
  // they may not be split; dq_bytes: the size of one dQ in the accumulation type.
  static BackwardTasks plan(int64_t pairs, int64_t group, int64_t kv_len, int64_t kv_block,
                            int64_t threads, bool whole_heads, bool whole_keys, int64_t dq_bytes) {
    const int64_t kv_blocks = std::max<int64_t>(1, (kv_len + kv_block - 1) / kv_block);
    BackwardTasks t;
    t.heads_per_part = std::max<int64_t>(1, group);
    t.chunk_keys = kv_blocks * kv_block;
    if (pairs == 0 || pairs >= threads) return t;
    if (!whole_heads && group > 1) {
      const int64_t want = std::min(group, (threads + pairs - 1) / pairs);
      t.heads_per_part = (group + want - 1) / want;
      t.parts = (group + t.heads_per_part - 1) / t.heads_per_part;
    }
    const int64_t tasks = pairs * t.parts;
    if (whole_keys || kv_blocks == 1 || tasks >= threads) return t;
    const int64_t affordable = 1 + kKeyChunkBudgetBytes / std::max<int64_t>(1, dq_bytes);
    const int64_t chunks = std::min({kv_blocks, (threads + tasks - 1) / tasks, affordable});
    t.chunk_keys = (kv_blocks + chunks - 1) / chunks * kv_block;
    t.chunks = (kv_blocks * kv_block + t.chunk_keys - 1) / t.chunk_keys;
    return t;
  }
};

}  // namespace entropy_attn::cpu
