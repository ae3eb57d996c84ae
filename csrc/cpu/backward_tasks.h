// How the CPU backward divides its work into tasks that never write the same memory, so that it
// needs no atomics or locks. A task is a (batch, key/value head) pair, or, when there are fewer
// pairs than threads, a part of one: some of the query heads that share the key/value head (a
// head part), and some of its keys (a key chunk). A task owns the dQ rows of its query heads
// within its chunk and the dK / dV rows of its keys within its part, so head parts need partial
// dK / dV and key chunks partial dQ (and dlambda), summed after the kernel.
//
// The partials are what a thread count can make large: with key chunks alone, MQA on 32 threads
// kept 32 dQ (B H Lq D floats each; 512 MiB for H = 4, L = 16384, D = 64). A head part's partial
// dK and dV are B Hkv Lk D floats each, 1 / group of a dQ each when Lk = Lq and Dv = D. The plan
// takes the split with the shortest slowest thread (at::parallel_for gives each thread a run of
// ceil(tasks / threads) consecutive tasks; a task's work counted in query heads x key blocks),
// the one with the smaller partials among equals, within a budget for all partials together: past
// it a backward keeps fewer threads busy rather than grow its memory with the thread count.
#pragma once

#include <algorithm>
#include <cstdint>

namespace entropy_attn::cpu {

// Bytes the partial dQ of key chunks and the partial dK / dV of head parts may take together.
constexpr int64_t kPartialsBudgetBytes = int64_t{256} << 20;

struct BackwardTasks {
  int64_t heads_per_part = 1;  // query heads of one key/value head in one task
  int64_t parts = 1;           // head parts per key/value head (each with a partial dK / dV)
  int64_t chunk_keys = 0;      // keys per chunk, a multiple of the key block
  int64_t chunks = 1;          // key chunks (each with a partial dQ and dlambda)

  // The bytes of the partials: `parts` dK / dV and `chunks` dQ, where there is more than one.
  int64_t partial_bytes(int64_t dq_bytes, int64_t dkv_bytes) const {
    return (parts > 1 ? parts * dkv_bytes : 0) + (chunks > 1 ? chunks * dq_bytes : 0);
  }

  // pairs: the (batch, key/value head) pairs that tasks own (fewer when the mask's gradient is
  // shared along an index: one task walks it); group: query heads per key/value head;
  // whole_heads / whole_keys: the mask's gradient is shared along the query heads / the keys, so
  // they may not be split; dq_bytes and dkv_bytes: one dQ, and one dK and dV together, in the
  // accumulation type.
  static BackwardTasks plan(int64_t pairs, int64_t group, int64_t kv_len, int64_t kv_block,
                            int64_t threads, bool whole_heads, bool whole_keys, int64_t dq_bytes,
                            int64_t dkv_bytes) {
    const int64_t kv_blocks = std::max<int64_t>(1, (kv_len + kv_block - 1) / kv_block);
    group = std::max<int64_t>(1, group);
    BackwardTasks best;
    best.heads_per_part = group;
    best.chunk_keys = kv_blocks * kv_block;
    if (pairs <= 0 || pairs >= threads) return best;
    const auto ceil_div = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
    // The slowest thread's work, in query heads x key blocks.
    const auto slowest = [&](int64_t parts, int64_t heads, int64_t chunks, int64_t blocks) {
      return ceil_div(pairs * parts * chunks, threads) * heads * blocks;
    };
    int64_t best_work = slowest(1, group, 1, kv_blocks), best_bytes = 0;
    const int64_t max_parts = whole_heads ? 1 : std::min(group, threads);
    const int64_t max_chunks = whole_keys ? 1 : std::min(kv_blocks, threads);
    for (int64_t parts = 1; parts <= max_parts; ++parts) {
      const int64_t heads = ceil_div(group, parts);
      if (ceil_div(group, heads) != parts) continue;  // (the split of fewer parts)
      for (int64_t chunks = 1; chunks <= max_chunks; ++chunks) {
        const int64_t blocks = ceil_div(kv_blocks, chunks);
        if (ceil_div(kv_blocks, blocks) != chunks) continue;
        BackwardTasks t;
        t.heads_per_part = heads, t.parts = parts, t.chunk_keys = blocks * kv_block;
        t.chunks = chunks;
        const int64_t bytes = t.partial_bytes(dq_bytes, dkv_bytes);
        const int64_t work = slowest(parts, heads, chunks, blocks);
        if (bytes <= kPartialsBudgetBytes &&
            (work < best_work || (work == best_work && bytes < best_bytes))) {
          best = t, best_work = work, best_bytes = bytes;
        }
      }
    }
    return best;
  }
};

}  // namespace entropy_attn::cpu
