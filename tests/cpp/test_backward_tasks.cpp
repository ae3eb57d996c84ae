// The CPU backward's task plan (csrc/cpu/backward_tasks.h): calls with a task per thread are not
// split; MQA and GQA split their query heads before their keys; the partials stay within their
// budget whatever the thread count (key chunks alone kept a dQ per thread); every head and key is
// in a non-empty part and chunk; and the slowest thread never has more work than under key chunks
// alone (the plan before head parts) where those fit the budget.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>

#include "cpu/backward_tasks.h"

namespace {

using entropy_attn::cpu::BackwardTasks;
using entropy_attn::cpu::kPartialsBudgetBytes;

constexpr int64_t kBlock = 512;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The plan of a call with B = 1, D = Dv = 64 in float: one dQ and one dK / dV together.
struct Call {
  int64_t kv_heads, group, len, threads;
  int64_t dq_bytes() const { return kv_heads * group * len * 64 * 4; }
  int64_t dkv_bytes() const { return kv_heads * len * 128 * 4; }
  BackwardTasks plan(bool whole_heads = false, bool whole_keys = false) const {
    return BackwardTasks::plan(kv_heads, group, len, kBlock, threads, whole_heads, whole_keys,
                               dq_bytes(), dkv_bytes());
  }
  // The slowest thread's work (query heads x key blocks) of a plan.
  int64_t slowest(int64_t parts, int64_t heads, int64_t chunks, int64_t blocks) const {
    return ceil_div(kv_heads * parts * chunks, threads) * heads * blocks;
  }
};

TEST(BackwardTasks, EnoughPairsAreNotSplit) {
  const BackwardTasks t = Call{16, 4, 8192, 16}.plan();
  EXPECT_EQ(t.parts, 1);
  EXPECT_EQ(t.chunks, 1);
  EXPECT_EQ(t.heads_per_part, 4);
  EXPECT_EQ(t.chunk_keys, 8192);
}

TEST(BackwardTasks, MultiQuerySplitsHeadsBeforeKeys) {
  // One sequence of 8 query heads on one key/value head, 8 threads: a part per head, no chunk.
  const BackwardTasks t = Call{1, 8, 4096, 8}.plan();
  EXPECT_EQ(t.heads_per_part, 1);
  EXPECT_EQ(t.parts, 8);
  EXPECT_EQ(t.chunks, 1);
  // 2 threads: 2 parts of 4 heads, as fast as 2 key chunks and with smaller partials.
  const BackwardTasks u = Call{1, 8, 4096, 2}.plan();
  EXPECT_EQ(u.parts, 2);
  EXPECT_EQ(u.chunks, 1);
  // 3 heads on 8 threads: 8 key chunks of 3 heads (3 units of work each, the least there is),
  // not 3 parts x 3 chunks, of which 9 tasks leave 3 threads idle and one with 2 tasks.
  const BackwardTasks v = Call{1, 3, 4096, 8}.plan();
  EXPECT_EQ(v.parts, 1);
  EXPECT_EQ(v.chunks, 8);
}

TEST(BackwardTasks, PartialsStayWithinTheBudget) {
  // 32 heads of 64k rows (512 MiB of dQ) on 32 threads: no key chunk fits, and 32 parts' dK / dV
  // (32 x 32 MiB) do not either: 8 parts, 256 MiB.
  const Call mqa{1, 32, 65536, 32};
  const BackwardTasks t = mqa.plan();
  EXPECT_EQ(t.chunks, 1);
  EXPECT_EQ(t.parts, 8);
  EXPECT_LE(t.partial_bytes(mqa.dq_bytes(), mqa.dkv_bytes()), kPartialsBudgetBytes);
}

TEST(BackwardTasks, EveryShapeIsCoveredWithinBudgetAndNoSlowerThanKeyChunks) {
  for (const int64_t threads : {2, 3, 8, 24, 64}) {
    for (const int64_t kv_heads : {1, 2, 8}) {
      for (const int64_t group : {1, 3, 4, 7, 32}) {
        for (const int64_t len : {100, 1000, 4096, 20000, 262144}) {
          const Call c{kv_heads, group, len, threads};
          const BackwardTasks t = c.plan();
          SCOPED_TRACE(::testing::Message() << threads << " threads, " << kv_heads << " kv heads, "
                                            << group << " group, L " << len);
          EXPECT_LE(t.partial_bytes(c.dq_bytes(), c.dkv_bytes()), kPartialsBudgetBytes);
          // Every head and key in a part and chunk, none empty.
          EXPECT_GE(t.parts * t.heads_per_part, group);
          EXPECT_LT((t.parts - 1) * t.heads_per_part, group);
          EXPECT_GE(t.chunks * t.chunk_keys, len);
          EXPECT_LT((t.chunks - 1) * t.chunk_keys, std::max<int64_t>(len, 1));
          EXPECT_EQ(t.chunk_keys % kBlock, 0);
          // Key chunks alone (one per thread short of a task each, capped by the blocks).
          const int64_t blocks = ceil_div(len, kBlock);
          const int64_t old_chunks =
              kv_heads >= threads ? 1 : std::min(blocks, ceil_div(threads, kv_heads));
          const int64_t old_blocks = ceil_div(blocks, old_chunks);
          const int64_t new_work =
              c.slowest(t.parts, t.heads_per_part, t.chunks, t.chunk_keys / kBlock);
          if (old_chunks == 1 || old_chunks * c.dq_bytes() <= kPartialsBudgetBytes) {
            EXPECT_LE(new_work, c.slowest(1, group, ceil_div(blocks, old_blocks), old_blocks));
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
