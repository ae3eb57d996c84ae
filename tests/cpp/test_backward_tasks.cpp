// The CPU backward's task plan (csrc/cpu/backward_tasks.h): calls with a task per thread are not
// split; MQA and GQA split their query heads before their keys; the partial dQ of key chunks stay
// within their budget whatever the thread count (they grew with it: 32 threads kept 32 dQ).
#include <gtest/gtest.h>

#include <cstdint>

#include "cpu/backward_tasks.h"

namespace {

using entropy_attn::cpu::BackwardTasks;
using entropy_attn::cpu::kKeyChunkBudgetBytes;

constexpr int64_t kBlock = 512;
constexpr int64_t MiB = int64_t{1} << 20;

// dQ bytes of B = 1, H heads, L rows, D = 128 in float.
int64_t dq_bytes(int64_t heads, int64_t len) { return heads * len * 128 * 4; }

TEST(BackwardTasks, EnoughPairsAreNotSplit) {
  const BackwardTasks t =
      BackwardTasks::plan(16, 4, 8192, kBlock, 16, false, false, dq_bytes(64, 8192));
  EXPECT_EQ(t.parts, 1);
  EXPECT_EQ(t.chunks, 1);
  EXPECT_EQ(t.heads_per_part, 4);
  EXPECT_EQ(t.chunk_keys, 8192);
}

TEST(BackwardTasks, MultiQuerySplitsHeadsNotKeys) {
  // One sequence, 32 query heads on one key/value head, 32 threads: a part per head, no chunk.
  const BackwardTasks t =
      BackwardTasks::plan(1, 32, 16384, kBlock, 32, false, false, dq_bytes(32, 16384));
  EXPECT_EQ(t.heads_per_part, 1);
  EXPECT_EQ(t.parts, 32);
  EXPECT_EQ(t.chunks, 1);
  // 8 heads on 32 threads: 8 parts, then 4 key chunks of a 32 MiB dQ (96 MiB more).
  const BackwardTasks u =
      BackwardTasks::plan(1, 8, 8192, kBlock, 32, false, false, dq_bytes(8, 8192));
  EXPECT_EQ(u.parts, 8);
  EXPECT_EQ(u.chunks, 4);
  EXPECT_EQ(u.chunk_keys, 2048);
  // Uneven: 6 heads on 4 threads, 2 heads per part, 3 parts.
  const BackwardTasks v = BackwardTasks::plan(1, 6, 600, kBlock, 4, false, false, dq_bytes(6, 600));
  EXPECT_EQ(v.heads_per_part, 2);
  EXPECT_EQ(v.parts, 3);
  EXPECT_EQ(v.chunks, 2);  // 3 tasks < 4 threads, 2 key blocks
}

TEST(BackwardTasks, KeyChunksStayWithinTheirBudget) {
  for (const int64_t threads : {2, 8, 32, 64, 256}) {
    for (const int64_t len : {1000, 4096, 16384, 65536, 262144}) {
      for (const int64_t heads : {1, 8, 32}) {
        const int64_t dq = dq_bytes(heads, len);
        const BackwardTasks t =
            BackwardTasks::plan(1, heads, len, kBlock, threads, false, false, dq);
        EXPECT_LE((t.chunks - 1) * dq, kKeyChunkBudgetBytes)
            << threads << " threads, L " << len << ", " << heads << " heads";
        EXPECT_LE(t.parts, heads);
        EXPECT_LE(t.parts, threads);
        EXPECT_GE(t.chunks * t.chunk_keys, len);  // every key in a chunk
        EXPECT_EQ(t.chunk_keys % kBlock, 0);
        EXPECT_GE(t.parts * t.heads_per_part, heads);  // every head in a part
      }
    }
  }
  // One head of 64k rows (32 MiB dQ) on 64 threads: 9 chunks, not 64 (2 GiB of partials).
  const BackwardTasks t =
      BackwardTasks::plan(1, 1, 65536, kBlock, 64, false, false, dq_bytes(1, 65536));
  EXPECT_EQ(t.chunks, 9);
  EXPECT_LT(t.chunks * dq_bytes(1, 65536), 300 * MiB);
}

TEST(BackwardTasks, SharedMaskGradientKeepsItsDimWhole) {
  // A mask gradient shared along the heads: no head parts (two tasks would add into one entry);
  // along the keys: no chunks.
  const BackwardTasks heads =
      BackwardTasks::plan(1, 8, 4096, kBlock, 8, true, false, dq_bytes(8, 4096));
  EXPECT_EQ(heads.parts, 1);
  EXPECT_EQ(heads.heads_per_part, 8);
  EXPECT_EQ(heads.chunks, 8);
  const BackwardTasks keys =
      BackwardTasks::plan(1, 8, 4096, kBlock, 32, false, true, dq_bytes(8, 4096));
  EXPECT_EQ(keys.parts, 8);
  EXPECT_EQ(keys.chunks, 1);
  EXPECT_EQ(keys.chunk_keys, 4096);
}

}  // namespace
