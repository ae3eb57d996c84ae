// The order in which the tensor-core kernels' thread blocks take their tiles. Host and device code
// without CUDA headers, so that tests/cpp/test_launch_order.cpp checks it on any machine.
//
// A GPU starts a grid's blocks in the order of their linear index (x fastest) as SMs free up. In
// a causal call the tiles differ in work: a forward's query tile m walks about m + 1 key blocks,
// a backward's key block n is seen by the query blocks from n on. The kernels already start the
// heavy tiles of each head first (the forward reverses x, the backward's key block 0 is its
// heaviest), but with x fastest the grid is a row of such runs, one per head: a heavy tile of the
// last heads starts near the end of the grid and runs alone while the SMs empty (a model of the
// benchmark's causal calls puts the grid's time at up to 1.27x a perfect balance for the forward
// and 1.59x for the backward at L = 1024, 1.07x and 1.14x at L = 4096:
// results/gpu/launch_order_model.md). FlashAttention-3's tile scheduler starts the longest tiles
// first across heads instead, in sections of heads whose reused operands fit in L2 (its
// "L2 swizzle"), so that the blocks that run together still share what they read. This does the
// same by renaming blocks: within a section of consecutive (head, batch) entries of the grid (y
// fastest, then z), the block index walks the entries fastest and x slowest, so that every head's
// heaviest tile starts before any head's second. One entry per section is the grid's own order.
#pragma once

#include <algorithm>
#include <cstdint>

#include "../kernel_args.h"   // MaskKind
#include "../online_stats.h"  // EA_HOST_DEVICE

namespace entropy_attn::cuda {

// Grid coordinates (x: tile, y: head, z: batch entry) that a block takes instead of its own.
struct GridTile {
  int x = 0, y = 0, z = 0;
};

// The coordinates of the block with linear index `block` (x + X (y + Y z)) of an X x Y x Z grid
// ordered in `sections` sections of consecutive (y, z) entries, as wide as each other as the
// entries allow (the first E mod sections hold one entry more): a bijection of the grid onto
// itself. sections < 1, or at least the Y Z entries, is the grid's own order. 32-bit arithmetic
// (a 64-bit division is a call, which gives the kernels a stack frame): the grid holds fewer than
// 2^32 blocks (launch_order_rule.h checks).
EA_HOST_DEVICE GridTile launch_tile(uint32_t block, uint32_t x_dim, uint32_t y_dim, uint32_t z_dim,
                                    int sections) {
  const uint32_t entries = y_dim * z_dim;
  const uint32_t count = sections < 1 ? entries : static_cast<uint32_t>(sections);
  const uint32_t k = count > entries ? entries : count;
  const uint32_t base = entries / k, wide = entries % k;  // `wide` sections of base + 1 entries
  const uint32_t wide_blocks = wide * (base + 1) * x_dim;
  uint32_t width, first;
  if (block < wide_blocks) {
    width = base + 1;
    first = block / (width * x_dim) * width;
  } else {
    width = base;
    first = wide * (base + 1) + (block - wide_blocks) / (width * x_dim) * width;
  }
  const uint32_t in_section = block - first * x_dim;
  const uint32_t entry = first + in_section % width;
  return {static_cast<int>(in_section / width), static_cast<int>(entry % y_dim),
          static_cast<int>(entry / y_dim)};
}

// The tile of linear index `index` (x + X (y + Y z)) of an instantiation's X x Y x Z grid of tiles,
// for a kernel whose blocks walk several tiles (a persistent grid): launch_tile's order in the
// instantiations that take it (this_block_tile, below), the grid's own in the others.
template <bool kCausal, MaskKind kMask>
EA_HOST_DEVICE GridTile tile_at(uint32_t index, uint32_t x_dim, uint32_t y_dim, uint32_t z_dim,
                                int sections) {
  constexpr bool kOrdered = kCausal && kMask == MaskKind::kNone;
  if (kOrdered && sections >= 1) return launch_tile(index, x_dim, y_dim, z_dim, sections);
  const uint32_t entry = index / x_dim;
  return {static_cast<int>(index - entry * x_dim), static_cast<int>(entry % y_dim),
          static_cast<int>(entry / y_dim)};
}

// The linear index of the tile that block `block` of a persistent grid of `blocks` blocks takes in
// its round `round` (0, 1, ...; the block stops at the first index past the grid's tiles). Each
// round deals the next `blocks` tiles in launch order, one per block, in alternate directions: in
// launch order the tiles of a causal call come heaviest first, and with one direction the block
// that took round 0's heaviest tile would take every round's, so that the blocks' sums of work
// drifted apart by about a tile per round; a block that goes first in one round goes last in the
// next, and their sums stay within about a tile of each other (tests/cpp/test_launch_order.cpp).
// With one block per tile (blocks = tiles) each block takes tile `block` in round 0 and stops.
// Indices stay below 2^32 for fewer than 2^31 tiles with one block per tile (a block stops after
// round 0) or at most 2^30 blocks (sm90/fwd_kernel.cuh: grid): a block's next index is below its
// index plus two rounds' worth of blocks.
EA_HOST_DEVICE uint32_t persistent_tile(uint32_t round, uint32_t block, uint32_t blocks) {
  return round * blocks + (round % 2 == 0 ? block : blocks - 1 - block);
}
// The round of a tile index (each round's indices are [round blocks, (round + 1) blocks)), and the
// index the same block takes next: a kernel carries the index alone from tile to tile (one register
// across the key loop instead of the round and the index).
EA_HOST_DEVICE uint32_t persistent_round(uint32_t index, uint32_t blocks) { return index / blocks; }
EA_HOST_DEVICE uint32_t next_persistent_tile(uint32_t index, uint32_t block, uint32_t blocks) {
  return persistent_tile(persistent_round(index, blocks) + 1, block, blocks);
}

#if defined(__CUDACC__) || defined(ENTROPY_ATTN_CUDA_EMULATION)
// This block's coordinates in an instantiation (causality, mask kind) of a tensor-core kernel: the
// launch order's in the general (causal) instantiations without a mask, whose tiles differ in
// work; blockIdx itself in the others, where the order would cost registers, which coordinates
// read from blockIdx do not hold (they are read again where needed): the plain full-attention
// kernels gain nothing from it, and the masked ones have none to spare (with it the sm90 masked
// forward at D = 128 took a stack frame).
template <bool kCausal, MaskKind kMask>
__device__ __forceinline__ GridTile this_block_tile(int sections) {
  constexpr bool kOrdered = kCausal && kMask == MaskKind::kNone;
  if (!kOrdered || sections < 1) {
    return {static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y),
            static_cast<int>(blockIdx.z)};
  }
  return launch_tile(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z), gridDim.x,
                     gridDim.y, gridDim.z, sections);
}
#endif

// Whether a grid of `entries` (head, batch) entries of `x_dim` tiles has fewer than 2^32 blocks, as
// launch_tile's 32-bit indices need.
inline bool launch_tile_fits(int64_t entries, int64_t x_dim) {
  return entries >= 1 && x_dim >= 1 && entries < (int64_t{1} << 32) / x_dim;
}

// The number of sections of a grid's `entries` (head, batch) entries of `x_dim` tiles each (0: the
// grid's own order, also for grids of 2^32 blocks or more). A section's entries' operands, which
// every tile of the entry reads, should fit in the part of L2 given to them, 5/8 (FlashAttention-3
// gives K and V 32 MB of an H100's 50): `bytes` is an entry's share (a forward's query head: its K
// and V over the query heads of its GQA group, which read the same; a backward's KV head: the Q, dO
// and dq accumulator of its group). But every section, once the widths are evened out, holds at
// least one and a half waves of the `resident_blocks` the GPU runs at once, even where L2 holds
// less. A section's heavy tiles start in its first wave and its light ones fill the SMs around
// them while they run; the last section's heavy tiles start only after every earlier tile has, and
// with less than half a wave of light tiles behind them the SMs wait at the end of the grid. A
// replay of the blocks onto the SMs (benchmarks/launch_order_model.py --sweep, 240 causal calls on
// GPUs running 108 to 264 blocks at once) puts the worst grid at 1.03-1.15x a perfect balance with
// this width, where sections of about a wave gave 1.18-1.40x, and no grid there ends later with
// it (docs/cuda.md).
inline int launch_sections(int64_t entries, int64_t x_dim, int64_t bytes, int64_t l2_bytes,
                           int64_t resident_blocks) {
  if (entries <= 1 || x_dim < 1 || bytes <= 0 || l2_bytes <= 0) return 0;
  if (!launch_tile_fits(entries, x_dim)) return 0;
  const int64_t fit = std::max<int64_t>(1, l2_bytes / 8 * 5 / bytes);
  const int64_t resident = std::max<int64_t>(resident_blocks, 1);
  const int64_t min_width = std::max<int64_t>(1, (3 * resident + 2 * x_dim - 1) / (2 * x_dim));
  // At most entries / min_width sections keeps every evened width at min_width or more.
  const int64_t sections =
      std::max<int64_t>(1, std::min((entries + fit - 1) / fit, entries / min_width));
  return sections >= entries ? 0 : static_cast<int>(std::min<int64_t>(sections, INT32_MAX));
}

}  // namespace entropy_attn::cuda
