// How the CPU backward divides its work into tasks that never write the same memory, so that it
// needs no atomics or locks. A task is a (batch, key/value head) pair, or, when there are fewer
// pairs than threads, a part of one: some of the query heads that share the key/value head (a
// head part), and some of its keys (a key chunk). A task owns the dQ rows of its query heads
// within its chunk and the dK / dV rows of its keys within its part, so head parts need partial
// dK / dV and key chunks partial dQ (and dlambda), summed after the kernel.
//
// The partials are what a thread count can make large: with key chunks alone, MQA on 32 threads
// kept 32 dQ (512 MiB for H = 4, L = 16384, D = 64 in float). So all partials together stay within
// a budget that does not grow with the thread count: 256 MiB, or as much as the gradients
// themselves where those are larger. Within it the plan takes the split of the least modelled
// time: the slowest thread's products (at::parallel_for gives each thread a run of
// ceil(tasks / threads) consecutive tasks, costed at the heaviest chunk's work, as under
// causality the first chunks hold most of it) plus the partials' memory traffic shared by all
// threads; among equals, the smaller partials, then the fewer chunks.
//
// Besides the partials, each running task holds its keys' operands and dK / dV in its thread's
// buffers where there is one head part (attention_bwd.cpp: BwdUnit), (3 D + 2 Dv) floats per key
// of its chunk: the running tasks' keys are distinct, so together they hold no more than whole
// copies would.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../kernel_args.h"

namespace entropy_attn::cpu {

// Bytes all partials may take where the gradients themselves take less.
constexpr int64_t kPartialsBudgetBytes = int64_t{256} << 20;
// Multiply-adds a product kernel does in the time it zeroes (dK / dV) or writes (dQ) and then sums
// one partial element: an estimate (a few GEMM FMA lanes per cycle and core against about one
// float of memory traffic), not fitted.
constexpr int64_t kPartialElementCost = 16;

// The sizes the plan weighs, for one call: one dQ and one dK and dV together (elements), the
// accumulation type's size, and the multiply-adds per (row, key) of the products (3 D + 2 Dv).
struct BackwardSizes {
  int64_t dq_elems = 0, dkv_elems = 0, acc_bytes = 4, fma_per_row_key = 1;
};

// Per key block of kv_block keys, the (row, key) pairs of one query head that the key pattern lets
// the products see: each row's key range (the mask's holes are not looked at), whole blocks by a
// difference array, so that it takes one pass over the rows.
inline std::vector<int64_t> block_work(const KeyPattern& pattern, int64_t q_len, int64_t kv_len,
                                       int64_t kv_block) {
  const int64_t blocks = (kv_len + kv_block - 1) / kv_block;
  std::vector<int64_t> work(blocks, 0), whole(blocks + 1, 0);
  for (int64_t i = 0; i < q_len; ++i) {
    const KeyRange r = pattern.keys(i, q_len, kv_len);
    if (r.hi <= r.lo) continue;
    const int64_t first = r.lo / kv_block, last = (r.hi - 1) / kv_block;
    if (first == last) {
      work[first] += r.hi - r.lo;
      continue;
    }
    work[first] += (first + 1) * kv_block - r.lo;
    work[last] += r.hi - last * kv_block;
    ++whole[first + 1];
    --whole[last];
  }
  int64_t covering = 0;
  for (int64_t kb = 0; kb < blocks; ++kb) {
    covering += whole[kb];
    work[kb] += covering * kv_block;
  }
  return work;
}

struct BackwardTasks {
  int64_t heads_per_part = 1;  // query heads of one key/value head in one task
  int64_t parts = 1;           // head parts per key/value head (each with a partial dK / dV)
  int64_t chunk_keys = 0;      // keys per chunk, a multiple of the key block
  int64_t chunks = 1;          // key chunks (each with a partial dQ and dlambda)

  // The elements of the partials: `parts` dK / dV and `chunks` dQ, where there is more than one.
  int64_t partial_elems(const BackwardSizes& s) const {
    return (parts > 1 ? parts * s.dkv_elems : 0) + (chunks > 1 ? chunks * s.dq_elems : 0);
  }

  // The modelled time of this plan in multiply-adds (a double: the product of counts may pass
  // 2^63): the slowest thread's run of ceil(tasks / threads) tasks, each costed at the heaviest
  // chunk, plus the partials' traffic shared by the threads. work_prefix: the prefix sums of the
  // per-block work (below), one more entry than key blocks.
  double modelled_time(int64_t pairs, int64_t threads, const std::vector<int64_t>& work_prefix,
                       int64_t kv_block, const BackwardSizes& sizes) const {
    const int64_t kv_blocks = static_cast<int64_t>(work_prefix.size()) - 1;
    int64_t heaviest = 0;
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t lo = std::min(kv_blocks, c * chunk_keys / kv_block);
      const int64_t hi = std::min(kv_blocks, (c + 1) * chunk_keys / kv_block);
      heaviest = std::max(heaviest, work_prefix[hi] - work_prefix[lo]);
    }
    const double run = static_cast<double>((pairs * parts * chunks + threads - 1) / threads);
    return run * static_cast<double>(heads_per_part) * static_cast<double>(heaviest) *
               static_cast<double>(sizes.fma_per_row_key) +
           static_cast<double>(partial_elems(sizes)) * kPartialElementCost /
               static_cast<double>(threads);
  }

  // pairs: the (batch, key/value head) pairs that tasks own (fewer when the mask's gradient is
  // shared along an index: one task walks it); group: query heads per key/value head;
  // block_work: per key block of kv_block keys, the (row, key) pairs of one query head that the
  // key pattern lets the products see, read only where there are fewer pairs than threads (it may
  // be left empty elsewhere); whole_heads / whole_keys: the mask's gradient is shared along the
  // query heads / the keys, so they may not be split.
  static BackwardTasks plan(int64_t pairs, int64_t group, int64_t kv_len,
                            const std::vector<int64_t>& block_work, int64_t kv_block,
                            int64_t threads, bool whole_heads, bool whole_keys,
                            const BackwardSizes& sizes) {
    const int64_t kv_blocks = std::max<int64_t>(1, (kv_len + kv_block - 1) / kv_block);
    group = std::max<int64_t>(1, group);
    BackwardTasks best;
    best.heads_per_part = group;
    best.chunk_keys = kv_blocks * kv_block;
    if (pairs <= 0 || pairs >= threads || static_cast<int64_t>(block_work.size()) != kv_blocks) {
      return best;
    }
    const auto ceil_div = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
    std::vector<int64_t> prefix(kv_blocks + 1, 0);
    for (int64_t kb = 0; kb < kv_blocks; ++kb) prefix[kb + 1] = prefix[kb] + block_work[kb];
    const int64_t budget =
        std::max(kPartialsBudgetBytes, (sizes.dq_elems + sizes.dkv_elems) * sizes.acc_bytes);
    double best_time = best.modelled_time(pairs, threads, prefix, kv_block, sizes);
    int64_t best_elems = 0;
    const int64_t max_parts = whole_heads ? 1 : std::min(group, threads);
    const int64_t max_chunks = whole_keys ? 1 : std::min(kv_blocks, threads);
    for (int64_t chunks = 1; chunks <= max_chunks; ++chunks) {
      const int64_t blocks = ceil_div(kv_blocks, chunks);
      if (ceil_div(kv_blocks, blocks) != chunks) continue;  // (the split of fewer chunks)
      for (int64_t parts = 1; parts <= max_parts; ++parts) {
        const int64_t heads = ceil_div(group, parts);
        if (ceil_div(group, heads) != parts) continue;
        BackwardTasks t;
        t.heads_per_part = heads, t.parts = parts, t.chunk_keys = blocks * kv_block;
        t.chunks = chunks;
        const int64_t elems = t.partial_elems(sizes);
        if (elems * sizes.acc_bytes > budget) continue;
        const double time = t.modelled_time(pairs, threads, prefix, kv_block, sizes);
        // (chunks grow in the outer loop: among equals the first found has the fewest)
        if (time < best_time || (time == best_time && elems < best_elems)) {
          best = t, best_time = time, best_elems = elems;
        }
      }
    }
    return best;
  }
};

}  // namespace entropy_attn::cpu
