// The tensor-core kernels' launch order (csrc/cuda/launch_order.h), on the host: the renaming of a
// grid's blocks is a bijection that keeps the grid's own order with one entry per section, starts
// every entry's tile of rank r before any entry's tile of rank r + 1 within a section, and keeps
// the sections in order; the number of sections follows the L2 budget and the GPU's size. A
// persistent grid's blocks take every tile once, their sums of work even (persistent_tile), and
// tile_at follows each instantiation's order.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

#include "cuda/launch_order.h"
#include "cuda/launch_order_rule.h"

namespace {

using entropy_attn::KeyPattern;
using entropy_attn::cuda::GridTile;
using entropy_attn::cuda::launch_order_rule;
using entropy_attn::cuda::launch_sections;
using entropy_attn::cuda::launch_tile;
using entropy_attn::cuda::launch_tile_fits;
using entropy_attn::cuda::LaunchDevice;
using entropy_attn::cuda::LaunchOrderSetting;
using entropy_attn::cuda::persistent_tile;
using entropy_attn::cuda::tile_at;

// The tiles of an X x Y x Z grid in launch order.
std::vector<GridTile> order(int x_dim, int y_dim, int z_dim, int sections) {
  std::vector<GridTile> tiles;
  const uint32_t blocks = static_cast<uint32_t>(x_dim) * y_dim * z_dim;
  for (uint32_t l = 0; l < blocks; ++l)
    tiles.push_back(launch_tile(l, x_dim, y_dim, z_dim, sections));
  return tiles;
}

TEST(LaunchOrder, IsABijectionOfTheGrid) {
  for (int x_dim : {1, 2, 7, 32}) {
    for (int y_dim : {1, 3, 16}) {
      for (int z_dim : {1, 2, 5}) {
        for (int sections : {-3, 0, 1, 2, 3, 4, 7, 16, 48, 1000}) {
          std::set<std::tuple<int, int, int>> seen;
          for (const GridTile& t : order(x_dim, y_dim, z_dim, sections)) {
            ASSERT_GE(t.x, 0);
            ASSERT_LT(t.x, x_dim);
            ASSERT_GE(t.y, 0);
            ASSERT_LT(t.y, y_dim);
            ASSERT_GE(t.z, 0);
            ASSERT_LT(t.z, z_dim);
            seen.insert({t.x, t.y, t.z});
          }
          EXPECT_EQ(seen.size(), static_cast<size_t>(x_dim) * y_dim * z_dim)
              << x_dim << " x " << y_dim << " x " << z_dim << ", sections " << sections;
        }
      }
    }
  }
}

TEST(LaunchOrder, OneEntryPerSectionIsTheGridsOwnOrder) {
  const int x_dim = 5, y_dim = 3, z_dim = 2;
  for (int sections : {0, -1, y_dim * z_dim, 100}) {
    const std::vector<GridTile> tiles = order(x_dim, y_dim, z_dim, sections);
    for (size_t l = 0; l < tiles.size(); ++l) {
      EXPECT_EQ(tiles[l].x, static_cast<int>(l % x_dim)) << sections;
      EXPECT_EQ(tiles[l].y, static_cast<int>(l / x_dim % y_dim)) << sections;
      EXPECT_EQ(tiles[l].z, static_cast<int>(l / x_dim / y_dim)) << sections;
    }
  }
}

TEST(LaunchOrder, SectionsWalkTheEntriesFastestAndTheirTilesInOrder) {
  // 4 tiles, 3 heads x 3 batch entries = 9 (head, batch) entries in 4 sections: {0, 1, 2}, {3, 4},
  // {5, 6}, {7, 8} (the first 9 mod 4 one entry wider). Within a section the entries cycle
  // fastest, x grows by one per cycle.
  const int x_dim = 4, y_dim = 3, z_dim = 3;
  const std::vector<GridTile> tiles = order(x_dim, y_dim, z_dim, 4);
  size_t l = 0;
  for (const auto& [first, width] :
       std::vector<std::pair<int, int>>{{0, 3}, {3, 2}, {5, 2}, {7, 2}}) {
    for (int x = 0; x < x_dim; ++x) {
      for (int e = first; e < first + width; ++e, ++l) {
        ASSERT_LT(l, tiles.size());
        EXPECT_EQ(tiles[l].x, x) << "block " << l;
        EXPECT_EQ(tiles[l].y + y_dim * tiles[l].z, e) << "block " << l;
      }
    }
  }
  EXPECT_EQ(l, tiles.size());
}

TEST(LaunchOrder, OneSectionStartsEveryFirstTileFirst) {
  // Rank is non-decreasing along the launch order when one section holds the grid.
  const std::vector<GridTile> tiles = order(8, 16, 4, 1);
  for (size_t l = 1; l < tiles.size(); ++l) EXPECT_LE(tiles[l - 1].x, tiles[l].x) << l;
  EXPECT_EQ(tiles[63].x, 0);
  EXPECT_EQ(tiles[64].x, 1);
}

TEST(LaunchOrder, GridsJustUnder2To32Blocks) {
  // 65535 tiles x 65535 heads x 1 batch entry: 2^32 - 2^17 + 1 blocks.
  const uint32_t x_dim = 65535, y_dim = 65535, z_dim = 1;
  const uint32_t last = x_dim * y_dim * z_dim - 1;
  for (int sections : {1, 7, 4096}) {
    const GridTile t = launch_tile(last, x_dim, y_dim, z_dim, sections);
    // The last block of the last section: its last entry at the last tile.
    EXPECT_EQ(t.x, static_cast<int>(x_dim - 1)) << sections;
    EXPECT_EQ(t.y, static_cast<int>(y_dim - 1)) << sections;
    EXPECT_EQ(t.z, 0) << sections;
    const GridTile first = launch_tile(0, x_dim, y_dim, z_dim, sections);
    EXPECT_EQ(first.x, 0);
    EXPECT_EQ(first.y, 0);
  }
  EXPECT_TRUE(launch_tile_fits(65535, 65535));
  EXPECT_FALSE(launch_tile_fits(65536, 65536));
  EXPECT_FALSE(launch_tile_fits(int64_t{65535} * 65535, int64_t{1} << 31));
  EXPECT_FALSE(launch_tile_fits(0, 8));
  // launch_sections keeps such grids in their own order.
  EXPECT_EQ(launch_sections(int64_t{1} << 17, int64_t{1} << 16, 1, 50 << 20, 132), 0);
}

// The tiles block `block` of a persistent grid of `blocks` blocks takes, round by round.
std::vector<uint32_t> block_tiles(uint32_t block, uint32_t blocks, uint32_t tiles) {
  std::vector<uint32_t> taken;
  for (uint32_t round = 0;; ++round) {
    const uint32_t t = persistent_tile(round, block, blocks);
    if (t >= tiles) break;
    taken.push_back(t);
  }
  return taken;
}

TEST(PersistentTiles, EveryTileOnceWhateverTheBlocks) {
  for (uint32_t tiles : {1u, 5u, 8u, 133u, 2048u}) {
    for (uint32_t blocks : {1u, 2u, 3u, 7u, 132u, 1000u}) {
      if (blocks > tiles) continue;  // (the launcher's grid: at most one block per tile)
      std::vector<int> count(tiles, 0);
      for (uint32_t c = 0; c < blocks; ++c) {
        for (uint32_t t : block_tiles(c, blocks, tiles)) ++count[t];
      }
      for (uint32_t t = 0; t < tiles; ++t) {
        ASSERT_EQ(count[t], 1) << "tile " << t << " of " << tiles << ", " << blocks << " blocks";
      }
    }
  }
  // One block per tile: block c takes tile c alone, as a grid of one block per tile.
  for (uint32_t c = 0; c < 9; ++c) EXPECT_EQ(block_tiles(c, 9, 9), std::vector<uint32_t>{c});
}

TEST(PersistentTiles, EvenOutTilesInDecreasingWork) {
  // A causal forward's tiles in launch order (one section): every entry's tile of rank x before
  // any entry's of rank x + 1, that tile walking X - x key blocks. The blocks' sums of key blocks
  // stay within a quarter of the heaviest tile of each other (dealt in one direction, the first
  // block takes each round's heaviest: 32, 8, 125, 32 and 14 blocks above the last here).
  struct Grid {
    uint32_t x_dim, entries, blocks;
  };
  for (const Grid g : {Grid{32, 64, 132}, Grid{8, 64, 132}, Grid{128, 64, 132}, Grid{32, 16, 132},
                       Grid{16, 2, 7}}) {
    const uint32_t tiles = g.x_dim * g.entries;
    uint32_t lo = UINT32_MAX, hi = 0;
    for (uint32_t c = 0; c < g.blocks; ++c) {
      uint32_t work = 0;
      for (uint32_t t : block_tiles(c, g.blocks, tiles)) {
        work += g.x_dim - launch_tile(t, g.x_dim, g.entries, 1, 1).x;
      }
      lo = std::min(lo, work), hi = std::max(hi, work);
    }
    EXPECT_LE(hi - lo, g.x_dim / 4 + 2)
        << g.x_dim << " tiles x " << g.entries << " entries on " << g.blocks << " blocks";
  }
}

TEST(PersistentTiles, TileAtFollowsTheInstantiationsOrder) {
  // The causal instantiations without a mask take the launch order; the others, and any with no
  // sections, the grid's own (x fastest).
  using entropy_attn::MaskKind;
  const uint32_t x_dim = 5, y_dim = 3, z_dim = 2;
  for (uint32_t t = 0; t < x_dim * y_dim * z_dim; ++t) {
    const GridTile ordered = tile_at<true, MaskKind::kNone>(t, x_dim, y_dim, z_dim, 2);
    const GridTile want = launch_tile(t, x_dim, y_dim, z_dim, 2);
    EXPECT_EQ(std::make_tuple(ordered.x, ordered.y, ordered.z),
              std::make_tuple(want.x, want.y, want.z));
    const GridTile own = launch_tile(t, x_dim, y_dim, z_dim, 0);
    for (const GridTile g : {tile_at<false, MaskKind::kNone>(t, x_dim, y_dim, z_dim, 2),
                             tile_at<true, MaskKind::kBool>(t, x_dim, y_dim, z_dim, 2),
                             tile_at<true, MaskKind::kNone>(t, x_dim, y_dim, z_dim, 0)}) {
      EXPECT_EQ(std::make_tuple(g.x, g.y, g.z),
                std::make_tuple(static_cast<int>(t % x_dim), static_cast<int>(t / x_dim % y_dim),
                                static_cast<int>(t / (x_dim * y_dim))));
      EXPECT_EQ(std::make_tuple(g.x, g.y, g.z), std::make_tuple(own.x, own.y, own.z));
    }
  }
}

TEST(LaunchSections, FollowTheL2Budget) {
  constexpr int64_t kMB = 1 << 20;
  const int64_t l2 = 50 * kMB;  // an H100's: 31.25 MB for the reused operands
  // 64 heads of 2 MB (K and V of 4096 keys, D = 128, bf16) and 32 tiles each: 15 heads fit, 5
  // sections of 13 or 12.
  EXPECT_EQ(launch_sections(64, 32, 2 * kMB, l2, 132), 5);
  // Heads of 256 KB: the whole grid fits, one section.
  EXPECT_EQ(launch_sections(64, 8, kMB / 4, l2, 132), 1);
  // A head larger than the budget: sections of one and a half waves' entries (198 blocks: 7
  // entries of 32 tiles, so 9 sections of 7 or 8), or the grid's own order where that is one
  // entry.
  EXPECT_EQ(launch_sections(64, 32, 64 * kMB, l2, 132), 9);
  EXPECT_EQ(launch_sections(64, 256, 64 * kMB, l2, 132), 0);
  // Nothing to order, or nothing known.
  EXPECT_EQ(launch_sections(1, 32, kMB, l2, 132), 0);
  EXPECT_EQ(launch_sections(64, 32, 0, l2, 132), 0);
  EXPECT_EQ(launch_sections(64, 32, kMB, 0, 132), 0);
  EXPECT_EQ(launch_sections(64, 0, kMB, l2, 132), 0);
}

TEST(LaunchSections, HoldAWaveAndAHalf) {
  constexpr int64_t kMB = 1 << 20;
  // 32 KV heads of 8 key blocks whose data does not fit twice in L2: a section needs the 25
  // entries whose 200 blocks make one and a half waves of 132 SMs, so one section, not 32.
  EXPECT_EQ(launch_sections(32, 8, 20 * kMB, 50 * kMB, 132), 1);
  // The benchmark's GQA backward (B = 4, 8 KV heads, L = 4096: 32 entries of 32 key blocks, 17 MB
  // each): 4 sections of 8 entries (256 blocks), where sections of a wave (5 entries, then 4)
  // left its grid at 1.099x a perfect balance in the model (results/gpu/launch_order_model.md).
  EXPECT_EQ(launch_sections(32, 32, 17 * kMB, 50 * kMB, 132), 4);
  // Whatever the budget, every section (as wide as each other as the entries allow) holds at
  // least one and a half waves of blocks, unless one section holds the whole grid.
  for (int64_t bytes = kMB / 8; bytes <= 256 * kMB; bytes *= 2) {
    for (int64_t x_dim : {1, 3, 8, 32, 100, 128, 500}) {
      const int k = launch_sections(256, x_dim, bytes, 50 * kMB, 264);
      ASSERT_GE(k, 0);
      ASSERT_LT(k, 256);
      if (k > 1) {
        EXPECT_GE(256 / k * x_dim * 2, 3 * 264) << bytes << " " << x_dim;
      }
    }
  }
}

// A call's sizes, as AttentionShape holds them.
struct Shape {
  int64_t batch, heads, kv_heads, q_len, kv_len, head_dim, v_head_dim;
};

KeyPattern causal() {
  KeyPattern p;
  p.right = 0;
  return p;
}

// An H100's (or H200's) L2 and SMs, one block of the Hopper kernels each.
constexpr LaunchDevice kHopper{50 << 20, 132};

TEST(LaunchOrderRule, MatchesTheModelsTable) {
  // Rows of results/gpu/launch_order_model.md (B = 4, bf16; forward and backward sections), which
  // benchmarks/launch_order_model.py computes with its own copy of the rule.
  struct Row {
    int64_t heads, kv_heads, head_dim, len;
    int fwd, bwd;
  };
  for (const Row& r : {Row{16, 16, 64, 1024, 1, 2}, Row{16, 16, 64, 4096, 3, 5},
                       Row{16, 16, 128, 4096, 5, 9}, Row{32, 8, 128, 4096, 3, 4},
                       Row{16, 16, 128, 16384, 22, 32}, Row{32, 8, 128, 16384, 9, 16}}) {
    const Shape s{4, r.heads, r.kv_heads, r.len, r.len, r.head_dim, r.head_dim};
    EXPECT_EQ(launch_order_rule(s, causal(), 2, false, 1, {}, kHopper), r.fwd)
        << r.heads << " " << r.len;
    EXPECT_EQ(launch_order_rule(s, causal(), 2, true, 1, {}, kHopper), r.bwd)
        << r.heads << " " << r.len;
  }
}

TEST(LaunchOrderRule, OrdersOnlyCallsWhoseTilesDifferInWork) {
  const Shape s{4, 16, 16, 4096, 4096, 128, 128};
  KeyPattern full;
  EXPECT_EQ(launch_order_rule(s, full, 2, false, 1, {}, kHopper), 0);
  KeyPattern left_only;  // rows see [i - 100, Lk): no right bound
  left_only.left = 100;
  EXPECT_EQ(launch_order_rule(s, left_only, 2, true, 1, {}, kHopper), 0);
  KeyPattern window = causal();
  window.left = 1000;
  EXPECT_EQ(launch_order_rule(s, window, 2, false, 1, {}, kHopper),
            launch_order_rule(s, causal(), 2, false, 1, {}, kHopper));
  KeyPattern packed = causal();
  const int32_t cu[2] = {0, 4096};
  packed.cu_q = packed.cu_k = cu;
  EXPECT_EQ(launch_order_rule(s, packed, 2, false, 1, {}, kHopper), 0);
}

TEST(LaunchOrderRule, SettingsAndLargeGrids) {
  const Shape s{4, 16, 16, 4096, 4096, 128, 128};
  LaunchOrderSetting heads;
  heads.kind = LaunchOrderSetting::Kind::kGridOrder;
  EXPECT_EQ(launch_order_rule(s, causal(), 2, false, 1, heads, kHopper), 0);
  LaunchOrderSetting three;
  three.kind = LaunchOrderSetting::Kind::kSections;
  three.sections = 3;
  EXPECT_EQ(launch_order_rule(s, KeyPattern{}, 2, false, 1, three, kHopper), 3);  // any call
  // 65535 heads x 65535 batch entries of 4096 rows: 2^32 blocks and more keep the grid's order,
  // forced or not; split-KV's parts count.
  const Shape huge{65535, 65535, 65535, 4096, 4096, 64, 64};
  EXPECT_EQ(launch_order_rule(huge, causal(), 2, false, 1, three, kHopper), 0);
  EXPECT_EQ(launch_order_rule(huge, causal(), 2, false, 1, {}, kHopper), 0);
  const Shape decode{4096, 256, 256, 1, 65536, 128, 128};  // 2^20 entries, one tile
  EXPECT_EQ(launch_order_rule(decode, causal(), 2, false, 1, three, kHopper), 3);
  EXPECT_EQ(launch_order_rule(decode, causal(), 2, false, 8192, three, kHopper), 0);
  // An sm80 forward (two blocks per SM on an A100: 108 SMs, 40 MB) splits its sections by its own
  // wave: more tiles per wave, fewer sections.
  const LaunchDevice a100{40 << 20, 2 * 108};
  EXPECT_GE(launch_order_rule(s, causal(), 2, false, 1, {}, a100), 1);
}

}  // namespace
