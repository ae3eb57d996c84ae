// The CPU backward's task plan (csrc/cpu/backward_tasks.h): calls with a task per thread are not
// split; MQA and GQA split their query heads or their keys, whichever the model finds faster
// (causality puts most of the work in the first key chunks); the partials stay within their
// budget whatever the thread count (key chunks alone kept a dQ per thread); every head and key is
// in a non-empty part and chunk; and no plan is modelled slower than key chunks alone, the plan
// before head parts, where that fits the budget.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/backward_tasks.h"

namespace {

using entropy_attn::KeyPattern;
using entropy_attn::KeyRange;
using entropy_attn::cpu::BackwardSizes;
using entropy_attn::cpu::BackwardTasks;
using entropy_attn::cpu::block_work;
using entropy_attn::cpu::kPartialsBudgetBytes;

constexpr int64_t kBlock = 512;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A call of B = 1, Lk = len keys, D = Dv = 64 in float, full or causal (top-left, Lq = Lk), with
// Lq = rows (len where 0).
struct Call {
  int64_t kv_heads, group, len, threads;
  bool causal = false;
  int64_t rows = 0;

  int64_t q_len() const { return rows > 0 ? rows : len; }
  BackwardSizes sizes() const {
    return {kv_heads * group * q_len() * 64, kv_heads * len * 128, 4, 3 * 64 + 2 * 64};
  }
  // Per key block [a, b), the (row, key) pairs of one head: row i sees all keys, or [0, i + 1):
  // then rows a .. b - 1 see 1 .. b - a of the block's keys and the len - b rows after it all.
  std::vector<int64_t> work() const {
    std::vector<int64_t> w;
    for (int64_t a = 0; a < len; a += kBlock) {
      const int64_t n = std::min(len, a + kBlock) - a;
      w.push_back(causal ? n * (n + 1) / 2 + (len - a - n) * n : q_len() * n);
    }
    return w;
  }
  std::vector<int64_t> prefix() const {
    std::vector<int64_t> p{0};
    for (const int64_t x : work()) p.push_back(p.back() + x);
    return p;
  }
  BackwardTasks plan(bool whole_heads = false, bool whole_keys = false) const {
    return BackwardTasks::plan(kv_heads, group, len, work(), kBlock, threads, whole_heads,
                               whole_keys, sizes());
  }
};

// The per-block work of a pattern counted key by key.
std::vector<int64_t> counted_work(const KeyPattern& p, int64_t q_len, int64_t kv_len) {
  std::vector<int64_t> w(ceil_div(kv_len, kBlock), 0);
  for (int64_t i = 0; i < q_len; ++i) {
    const KeyRange r = p.keys(i, q_len, kv_len);
    for (int64_t j = r.lo; j < r.hi; ++j) ++w[j / kBlock];
  }
  return w;
}

TEST(BackwardTasks, BlockWorkCountsEveryRowsKeys) {
  // Windows, causality, both alignments, Lq above and below Lk, lengths around a block.
  for (const int64_t left : {-1, 0, 3, 700}) {
    for (const int64_t right : {-1, 0, 5}) {
      for (const bool bottom_right : {false, true}) {
        for (const int64_t q_len : {1, 511, 513, 1300}) {
          for (const int64_t kv_len : {0, 1, 512, 513, 1300}) {
            KeyPattern p;
            p.left = left, p.right = right, p.bottom_right = bottom_right;
            EXPECT_EQ(block_work(p, q_len, kv_len, kBlock), counted_work(p, q_len, kv_len))
                << left << " " << right << " " << bottom_right << " " << q_len << " " << kv_len;
          }
        }
      }
    }
  }
  // Packed documents (one empty), with a causal window and with the keys each document uses.
  const int32_t cu_q[] = {0, 300, 300, 1100, 1500}, cu_k[] = {0, 600, 700, 1300, 2000};
  const int32_t used[] = {600, 0, 550, 9};
  for (const bool with_used : {false, true}) {
    KeyPattern p;
    p.left = 200, p.right = 0, p.bottom_right = true;
    p.cu_q = cu_q, p.cu_k = cu_k, p.documents = 4;
    p.seqused_k = with_used ? used : nullptr;
    EXPECT_EQ(block_work(p, 1500, 2000, kBlock), counted_work(p, 1500, 2000)) << with_used;
  }
}

TEST(BackwardTasks, EnoughPairsAreNotSplit) {
  const BackwardTasks t = Call{16, 4, 8192, 16}.plan();
  EXPECT_EQ(t.parts, 1);
  EXPECT_EQ(t.chunks, 1);
  EXPECT_EQ(t.heads_per_part, 4);
  EXPECT_EQ(t.chunk_keys, 8192);
}

TEST(BackwardTasks, HeadsOrKeysWhicheverIsFaster) {
  // 8 query heads on one key/value head, 8 threads: a part per head (smaller partials than 8
  // key chunks), with or without causality.
  for (const bool causal : {false, true}) {
    const BackwardTasks t = Call{1, 8, 4096, 8, causal}.plan();
    EXPECT_EQ(t.heads_per_part, 1);
    EXPECT_EQ(t.parts, 8);
    EXPECT_EQ(t.chunks, 1);
  }
  // 3 heads on 8 threads: 8 key chunks of 3 heads, not 3 parts, of which 5 threads get none.
  const BackwardTasks v = Call{1, 3, 4096, 8}.plan();
  EXPECT_EQ(v.parts, 1);
  EXPECT_EQ(v.chunks, 8);
  // Causal, 8 heads of 16k on 3 threads: 3 parts; 3 key chunks would leave 5/9 of the work to the
  // first one (the previous model's choice).
  const BackwardTasks c = Call{1, 8, 16384, 3, true}.plan();
  EXPECT_EQ(c.parts, 3);
  EXPECT_EQ(c.chunks, 1);
}

TEST(BackwardTasks, PartialsCostTheirTraffic) {
  // One query row against 4096 keys, 8 heads on 32 threads: 8 key chunks of 2 parts of 4 heads.
  // Each task's products are small, so more parts (4, were their zeroing and summing free) would
  // cost more in partial dK / dV than they save.
  const BackwardTasks t = Call{1, 8, 4096, 32, false, /*rows=*/1}.plan();
  EXPECT_EQ(t.chunks, 8);
  EXPECT_EQ(t.parts, 2);
}

TEST(BackwardTasks, PartialsStayWithinTheBudget) {
  // 32 heads of 64k rows on 32 threads: 544 MiB of gradients, the budget; no key chunk fits (each
  // a 512 MiB dQ), 32 parts' dK / dV do not either (32 x 32 MiB): 16 parts, 512 MiB.
  const Call mqa{1, 32, 65536, 32};
  const BackwardTasks t = mqa.plan();
  EXPECT_EQ(t.chunks, 1);
  EXPECT_EQ(t.parts, 16);
  const BackwardSizes s = mqa.sizes();
  EXPECT_LE(t.partial_elems(s) * s.acc_bytes, (s.dq_elems + s.dkv_elems) * s.acc_bytes);
}

TEST(BackwardTasks, EveryShapeIsCoveredWithinBudgetAndNoSlowerThanKeyChunks) {
  for (const int64_t threads : {2, 3, 8, 24, 64}) {
    for (const int64_t kv_heads : {1, 2, 8}) {
      for (const int64_t group : {1, 3, 4, 7, 32}) {
        for (const int64_t len : {100, 1000, 4096, 20000}) {
          for (const bool causal : {false, true}) {
            const Call c{kv_heads, group, len, threads, causal};
            const BackwardTasks t = c.plan();
            const BackwardSizes s = c.sizes();
            SCOPED_TRACE(::testing::Message()
                         << threads << " threads, " << kv_heads << " kv heads, " << group
                         << " group, L " << len << ", causal " << causal);
            const int64_t budget =
                std::max(kPartialsBudgetBytes, (s.dq_elems + s.dkv_elems) * s.acc_bytes);
            EXPECT_LE(t.partial_elems(s) * s.acc_bytes, budget);
            // Every head and key in a part and chunk, none empty.
            EXPECT_GE(t.parts * t.heads_per_part, group);
            EXPECT_LT((t.parts - 1) * t.heads_per_part, group);
            EXPECT_GE(t.chunks * t.chunk_keys, len);
            EXPECT_LT((t.chunks - 1) * t.chunk_keys, len);
            EXPECT_EQ(t.chunk_keys % kBlock, 0);
            // Key chunks alone: one per thread short of a task each, capped by the blocks.
            const int64_t blocks = ceil_div(len, kBlock);
            BackwardTasks old;
            old.heads_per_part = group;
            const int64_t wanted =
                kv_heads >= threads ? 1 : std::min(blocks, ceil_div(threads, kv_heads));
            old.chunk_keys = ceil_div(blocks, wanted) * kBlock;
            old.chunks = ceil_div(len, old.chunk_keys);
            if (old.partial_elems(s) * s.acc_bytes <= budget) {
              const std::vector<int64_t> p = c.prefix();
              EXPECT_LE(t.modelled_time(kv_heads, threads, p, kBlock, s),
                        old.modelled_time(kv_heads, threads, p, kBlock, s));
            }
          }
        }
      }
    }
  }
}

TEST(BackwardTasks, SharedMaskGradientKeepsItsDimWhole) {
  // A mask gradient shared along the heads: no head parts (two tasks would add into one entry);
  // along the keys: no chunks.
  const BackwardTasks heads = Call{1, 8, 4096, 8}.plan(/*whole_heads=*/true, false);
  EXPECT_EQ(heads.parts, 1);
  EXPECT_EQ(heads.heads_per_part, 8);
  EXPECT_EQ(heads.chunks, 8);
  const BackwardTasks keys = Call{1, 8, 4096, 32}.plan(false, /*whole_keys=*/true);
  EXPECT_EQ(keys.parts, 8);
  EXPECT_EQ(keys.chunks, 1);
  EXPECT_EQ(keys.chunk_keys, 4096);
}

}  // namespace
