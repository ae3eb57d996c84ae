// The block walks of the tensor-core kernels (csrc/cuda/key_ranges.cuh), checked on the host
// against every row's key range: the key blocks a forward tile loads and which of them it may
// process without the per-element check, the query blocks a backward key block walks, and the
// backward tiles it treats as fully visible. A key a row sees that no walk reaches is a wrong
// result; a block treated as fully visible that is not lets a hidden key in. These functions are
// the kernels' own (the sm80 and sm90 families call them), so this pins the part of those kernels
// that decides which keys each row attends to, on every pattern (causality, sliding windows,
// bottom-right alignment, packed documents with seqused_k) and tile shape, without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cuda/key_ranges.cuh"

namespace {

using entropy_attn::KeyPattern;
using entropy_attn::KeyRange;
using entropy_attn::cuda::BlockRange;
using entropy_attn::cuda::first_walker;
using entropy_attn::cuda::query_blocks;
using entropy_attn::cuda::row_keys;
using entropy_attn::cuda::tile_key_blocks;
using entropy_attn::cuda::tile_needs_predicate;
using entropy_attn::cuda::TileBlocks;
using entropy_attn::cuda::walking_block_from;

// One call: its pattern's scalars and the document offsets the pattern points into.
struct Call {
  KeyPattern base;  // without the offsets' pointers (pattern() sets them)
  int q_len = 0, kv_len = 0;
  bool banded = false;  // the kernels' kCausal (general) instantiation serves it
  std::vector<int32_t> cu_q, cu_k, seqused_k;

  KeyPattern pattern() const {
    KeyPattern p = base;
    if (!cu_q.empty()) {
      p.cu_q = cu_q.data();
      p.cu_k = cu_k.data();
      p.documents = static_cast<int64_t>(cu_q.size()) - 1;
    }
    if (!seqused_k.empty()) p.seqused_k = seqused_k.data();
    return p;
  }
  std::string describe() const {
    std::ostringstream s;
    s << "Lq=" << q_len << " Lk=" << kv_len << " window=(" << base.left << ", " << base.right
      << ") bottom_right=" << base.bottom_right << " documents=" << cu_q.size()
      << " seqused_k=" << !seqused_k.empty() << " banded=" << banded;
    return s.str();
  }
};

// Random calls: every pattern the general instantiations take, and full attention.
Call random_call(std::mt19937& g) {
  auto below = [&](int n) { return static_cast<int>(g() % static_cast<uint32_t>(n)); };
  Call c;
  c.base.left = below(3) == 0 ? below(300) : -1;
  c.base.right = below(2) == 0 ? 0 : (below(3) == 0 ? below(300) : -1);
  c.base.bottom_right = below(2) == 0;
  c.q_len = 1 + below(700);
  c.kv_len = 1 + below(700);
  if (below(3) == 0) {  // packed documents, some of them empty on either side
    const int n = 1 + below(6);
    c.cu_q = {0};
    c.cu_k = {0};
    for (int d = 0; d < n; ++d) {
      c.cu_q.push_back(c.cu_q.back() + below(200));
      c.cu_k.push_back(c.cu_k.back() + below(200));
    }
    if (c.cu_q.back() == 0 || c.cu_k.back() == 0) return random_call(g);  // no tokens: no call
    c.q_len = c.cu_q.back();
    c.kv_len = c.cu_k.back();
    if (below(2) == 0) {
      for (int d = 0; d < n; ++d) c.seqused_k.push_back(below(c.cu_k[d + 1] - c.cu_k[d] + 1));
    }
  }
  c.banded = c.base.banded() || !c.cu_q.empty() || below(4) == 0;
  if (!c.banded) c.base = KeyPattern{};  // the full instantiations: every row sees every key
  return c;
}

KeyRange keys_of(const Call& c, int i) {
  return c.banded ? row_keys<true>(c.pattern(), i, c.q_len, c.kv_len)
                  : row_keys<false>(c.pattern(), i, c.q_len, c.kv_len);
}

// Whether row i, whose keys are r = keys_of(c, i), sees key j. (The range is computed once per
// row by the callers: per key, it took most of this test's time under the sanitizers.)
bool sees(const Call& c, int i, const KeyRange& r, int j) {
  return i < c.q_len && j >= r.lo && j < r.hi;
}

// The walks under test, with an optional deliberate error so that the checks can be seen to fail.
enum class Fault { kNone, kForwardUnpredicated, kForwardShort, kBackwardEdge, kBackwardShort };

TileBlocks forward_walk(const Call& c, int m0, int rows, int block_n, Fault fault) {
  const KeyPattern p = c.pattern();
  TileBlocks tb = c.banded ? tile_key_blocks<true>(p, m0, rows, c.q_len, c.kv_len, block_n)
                           : tile_key_blocks<false>(p, m0, rows, c.q_len, c.kv_len, block_n);
  if (fault == Fault::kForwardUnpredicated) ++tb.n_hi_pred;
  if (fault == Fault::kForwardShort) tb.n_end = std::max(tb.n_begin, tb.n_end - 1);
  return tb;
}

BlockRange backward_walk(const Call& c, int j0, int j1, int block_m, Fault fault) {
  const KeyPattern p = c.pattern();
  BlockRange br = c.banded ? query_blocks<true>(p, c.q_len, c.kv_len, j0, j1, block_m)
                           : query_blocks<false>(p, c.q_len, c.kv_len, j0, j1, block_m);
  if (fault == Fault::kBackwardShort) br.end = std::max(br.begin, br.end - 1);
  return br;
}

bool backward_edge(const Call& c, int i0, int j0, int block_m, int block_n, Fault fault) {
  if (fault == Fault::kBackwardEdge && j0 + block_n <= c.kv_len && i0 + block_m <= c.q_len) {
    return false;
  }
  const KeyPattern p = c.pattern();
  return c.banded ? tile_needs_predicate<true>(p, i0, j0, block_m, block_n, c.q_len, c.kv_len)
                  : tile_needs_predicate<false>(p, i0, j0, block_m, block_n, c.q_len, c.kv_len);
}

// The first violation of a walk on call c with tiles of block_m rows and block_n keys, or "".
std::string violation(const Call& c, int block_m, int block_n, Fault fault) {
  std::ostringstream why;
  // Every row's range: inside the call's keys, both bounds non-decreasing in i (the walks
  // rely on it), empty past the last row.
  KeyRange prev{0, 0};
  for (int i = 0; i <= c.q_len; ++i) {
    const KeyRange r = keys_of(c, i);
    if (i == c.q_len) {
      if (r.hi > r.lo) why << "row " << i << " past the call sees keys";
      break;
    }
    if (r.lo < 0 || r.hi > c.kv_len || r.lo > r.hi || r.lo < prev.lo || r.hi < prev.hi) {
      why << "row " << i << " has range [" << r.lo << ", " << r.hi << ") after [" << prev.lo << ", "
          << prev.hi << ")";
      break;
    }
    prev = r;
  }
  if (!why.str().empty()) return why.str();

  // Forward: each tile's walk reaches every key its rows see, below key_end; a block walked
  // without the predicate is seen whole by every row of the tile.
  for (int m0 = 0; m0 < c.q_len; m0 += block_m) {
    const int rows = std::min(block_m, c.q_len - m0);
    const TileBlocks tb = forward_walk(c, m0, rows, block_n, fault);
    for (int i = m0; i < m0 + rows; ++i) {
      const KeyRange r = keys_of(c, i);
      for (int64_t j = r.lo; j < r.hi; ++j) {
        const int n = static_cast<int>(j / block_n);
        if (n < tb.n_begin || n >= tb.n_end || j >= tb.key_end) {
          why << "forward tile " << m0 << ": row " << i << " sees key " << j << " outside blocks ["
              << tb.n_begin << ", " << tb.n_end << ") / key_end " << tb.key_end;
          return why.str();
        }
      }
    }
    for (int n = tb.n_begin; n < tb.n_end; ++n) {
      if (tb.predicated(n)) continue;
      for (int i = m0; i < m0 + rows; ++i) {
        const KeyRange r = keys_of(c, i);
        for (int j = n * block_n; j < (n + 1) * block_n; ++j) {
          if (!sees(c, i, r, j)) {
            why << "forward tile " << m0 << ": block " << n << " unpredicated but row " << i
                << " does not see key " << j;
            return why.str();
          }
        }
      }
    }
  }

  // Backward: each key block's walk reaches every query block with a row that sees one of its
  // keys; a tile it treats without the per-element check has every row seeing every key.
  for (int j0 = 0; j0 < c.kv_len; j0 += block_n) {
    const int j1 = std::min(j0 + block_n, c.kv_len);
    const BlockRange br = backward_walk(c, j0, j1, block_m, fault);
    for (int i = 0; i < c.q_len; ++i) {
      const KeyRange r = keys_of(c, i);
      const bool seen = r.lo < r.hi && r.lo < j1 && r.hi > j0;
      const int m = i / block_m;
      if (seen && (m < br.begin || m >= br.end)) {
        why << "backward key block " << j0 << ": row " << i << " sees it, query blocks ["
            << br.begin << ", " << br.end << ")";
        return why.str();
      }
    }
    for (int m = br.begin; m < br.end; ++m) {
      const int i0 = m * block_m;
      if (backward_edge(c, i0, j0, block_m, block_n, fault)) continue;
      for (int i = i0; i < i0 + block_m; ++i) {
        const KeyRange r = keys_of(c, i);
        for (int j = j0; j < j0 + block_n; ++j) {
          if (!sees(c, i, r, j)) {
            why << "backward tile (" << i0 << ", " << j0 << ") without the check but row " << i
                << " does not see key " << j;
            return why.str();
          }
        }
      }
    }
  }
  return "";
}

// The tile shapes of the families: sm80 forward 128x64, 128x32, 64x64; sm90 forward 128x128 and
// 128x112; backward 64x128 (both families); and small ones that make every edge frequent.
const int kTiles[][2] = {{128, 64},  {128, 32}, {64, 64}, {128, 128},
                         {128, 112}, {64, 128}, {16, 16}};

TEST(KeyRanges, WalksCoverEveryVisibleKeyAndSkipTheCheckOnlyWhereAllAreSeen) {
  std::mt19937 g(20261125);
  int documents = 0, windows = 0, bottom_right = 0;
  for (int it = 0; it < 1500; ++it) {
    const Call c = random_call(g);
    documents += !c.cu_q.empty();
    windows += c.base.left >= 0 || c.base.right > 0;
    bottom_right += c.base.bottom_right;
    for (const auto& tile : kTiles) {
      const std::string v = violation(c, tile[0], tile[1], Fault::kNone);
      ASSERT_EQ(v, "") << c.describe() << ", tile " << tile[0] << "x" << tile[1];
    }
  }
  // The random calls covered each kind of pattern.
  EXPECT_GT(documents, 150);
  EXPECT_GT(windows, 150);
  EXPECT_GT(bottom_right, 150);
}

TEST(KeyRanges, PlainCausalWalksMatchTheDiagonal) {
  // Top-left causality (the default causal call): row i sees [0, min(i + 1, Lk)), so a forward
  // tile walks blocks [0, ceil(min(m0 + rows, Lk) / N)) and needs the check from block
  // min(m0 + 1, Lk) / N on (the walk of the kernels that passed the GPU tests before patterns).
  KeyPattern causal;
  causal.right = 0;
  for (int q_len : {1, 63, 64, 65, 200, 513}) {
    for (int kv_len : {1, 64, 127, 128, 300, 700}) {
      for (int m0 = 0; m0 < q_len; m0 += 128) {
        const int rows = std::min(128, q_len - m0);
        const TileBlocks tb = tile_key_blocks<true>(causal, m0, rows, q_len, kv_len, 64);
        EXPECT_EQ(tb.n_begin, 0);
        EXPECT_EQ(tb.n_end, (std::min(m0 + rows, kv_len) + 63) / 64);
        EXPECT_EQ(tb.n_lo_pred, 0);
        EXPECT_EQ(tb.n_hi_pred, std::min(m0 + 1, kv_len) / 64);
      }
    }
  }
}

// The first key block from n on with a walk, by trying each in turn (walking_block_from jumps).
int walking_block_by_search(const Call& c, int n, int block_m, int block_n) {
  for (; n * block_n < c.kv_len; ++n) {
    const int j0 = n * block_n;
    const BlockRange br =
        backward_walk(c, j0, std::min(j0 + block_n, c.kv_len), block_m, Fault::kNone);
    if (br.end > br.begin) return n;
  }
  return n;
}

int walking_block(const Call& c, int n, int block_n) {
  const KeyPattern p = c.pattern();
  return c.banded ? walking_block_from<true>(p, n, c.q_len, c.kv_len, block_n)
                  : walking_block_from<false>(p, n, c.q_len, c.kv_len, block_n);
}

// The deterministic Hopper backward's turns (sm90/bwd_kernel.cuh: write_dq): the key blocks of
// block_n keys walking their query blocks one after another in the order of n (as the GPU starts
// them), each must find the counter of every query block m it walks at its own index, the counter
// starting at first_walker(m) and each key block n raising it to the next key block with a walk, or
// the GPU would spin for ever. `skew` adds to the awaited count (a wrong rule); `step_one` raises
// the counter by one instead (the rule before packed documents: a key block without a walk between
// two that walk m would never hand the turn on). `jumps` counts the turns handed over key blocks
// without a walk.
std::string turns_violation(const Call& c, int block_m, int block_n, int skew = 0,
                            bool step_one = false, int* jumps = nullptr) {
  const KeyPattern p = c.pattern();
  std::vector<int> count(static_cast<size_t>((c.q_len + block_m - 1) / block_m));
  for (size_t m = 0; m < count.size(); ++m) {
    const int mi = static_cast<int>(m);
    count[m] = c.banded ? first_walker<true>(p, mi, c.q_len, c.kv_len, block_m, block_n)
                        : first_walker<false>(p, mi, c.q_len, c.kv_len, block_m, block_n);
  }
  for (int j0 = 0; j0 < c.kv_len; j0 += block_n) {
    const int n = j0 / block_n;
    const BlockRange br =
        backward_walk(c, j0, std::min(j0 + block_n, c.kv_len), block_m, Fault::kNone);
    const int next = step_one ? n + 1 : walking_block(c, n + 1, block_n);
    for (int m = br.begin; m < br.end; ++m) {
      if (count[static_cast<size_t>(m)] != n + skew) {
        std::ostringstream why;
        why << "key block " << n << " waits at query block " << m << " for count " << n + skew
            << ", the key blocks before it left " << count[static_cast<size_t>(m)];
        return why.str();
      }
      count[static_cast<size_t>(m)] = next;
      if (jumps != nullptr) *jumps += next > n + 1 && next * block_n < c.kv_len;
    }
  }
  return "";
}

TEST(KeyRanges, WalkingBlockFromJumpsOnlyOverBlocksWithoutAWalk) {
  // walking_block_from against trying every key block in turn, from every key block, on every
  // pattern; some calls have key blocks without a walk between ones with (packed documents).
  std::mt19937 g(20261208);
  int gaps = 0;
  for (int it = 0; it < 2000; ++it) {
    const Call c = random_call(g);
    for (const auto& tile : {std::pair<int, int>{64, 128}, {16, 16}}) {
      const int blocks = (c.kv_len + tile.second - 1) / tile.second;
      for (int n = 0; n <= blocks; ++n) {
        const int want = walking_block_by_search(c, n, tile.first, tile.second);
        ASSERT_EQ(walking_block(c, n, tile.second), want)
            << c.describe() << ", from key block " << n << ", blocks " << tile.first << "x"
            << tile.second;
        gaps += want > n && want < blocks;  // key block n walks nothing, a later one does
      }
    }
  }
  EXPECT_GT(gaps, 50);
}

TEST(KeyRanges, DeterministicTurnsFollowTheKeyBlocks) {
  // Every call (full, causal either way, windows on either side, packed documents with seqused_k),
  // at the backward's 64 x 128 blocks and at small ones. Turns handed over key blocks without a
  // walk happen (with documents), where raising the counter by one breaks the rule; and a rule one
  // off is caught.
  std::mt19937 g(20261207);
  int windows = 0, documents = 0, jumps = 0, broken_by_step_one = 0, caught_skew = 0;
  for (int it = 0; it < 3000; ++it) {
    const Call c = random_call(g);
    for (const auto& tile : {std::pair<int, int>{64, 128}, {16, 16}}) {
      ASSERT_EQ(turns_violation(c, tile.first, tile.second, 0, false, &jumps), "")
          << c.describe() << ", blocks " << tile.first << "x" << tile.second;
      windows += c.base.left >= 0;
      documents += !c.cu_q.empty();
      broken_by_step_one += !turns_violation(c, tile.first, tile.second, 0, true).empty();
      caught_skew += !turns_violation(c, tile.first, tile.second, 1).empty();
    }
  }
  EXPECT_GT(windows, 300);
  EXPECT_GT(documents, 300);
  EXPECT_GT(jumps, 100);
  EXPECT_GT(broken_by_step_one, 0);
  EXPECT_GT(caught_skew, 1000);
}

TEST(KeyRanges, EachCheckFailsOnAWrongWalk) {
  // The checks above can fail: a walk that skips the predicate one block early, stops one block
  // short, or treats a partial-visibility backward tile as full is caught on some call.
  for (Fault fault : {Fault::kForwardUnpredicated, Fault::kForwardShort, Fault::kBackwardEdge,
                      Fault::kBackwardShort}) {
    std::mt19937 g(7);
    bool caught = false;
    for (int it = 0; it < 500 && !caught; ++it) {
      const Call c = random_call(g);
      caught = !violation(c, 64, 64, fault).empty();
    }
    EXPECT_TRUE(caught) << "fault " << static_cast<int>(fault) << " was not detected";
  }
}

}  // namespace
