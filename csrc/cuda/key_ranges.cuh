// The keys each query row of a tensor-core kernel (the sm80 and sm90 families) may see, and the
// blocks that follow from them: a query tile's key blocks and which of them need a per-element
// check (the forwards), a key block's query blocks and whether a tile needs that check (the
// backwards). Host-callable: tests/cpp/test_key_ranges.cpp checks them against every row's range.
#pragma once

#include "../kernel_args.h"

namespace entropy_attn::cuda {

// The keys [lo, hi) query row i may see. kBanded (the instantiations compiled with causality on):
// those of the call's KeyPattern (kernel_args.h), which for plain causality are
// [0, min(i + 1, Lk)) and otherwise add a sliding window, bottom-right alignment or the bounds of
// packed documents (then q_len and kv_len are the packed totals, and a row's range lies inside its
// document's keys); else every key. A row past q_len sees none. Both bounds never decrease as i
// grows, across documents too (document d's keys come before document d + 1's).
template <bool kBanded>
EA_HOST_DEVICE KeyRange row_keys(const KeyPattern& pattern, int i, int q_len, int kv_len) {
  if (i >= q_len) return {0, 0};
  if constexpr (kBanded) return pattern.keys(i, q_len, kv_len);
  return {0, kv_len};
}

// The first row i in [0, q_len) for which pred(i) holds, or q_len; pred must be false, then true,
// as i grows (as "hi_i > j" and "lo_i >= j" are).
template <typename Pred>
EA_HOST_DEVICE int first_row(int q_len, const Pred& pred) {
  int lo = 0, hi = q_len;
  while (lo < hi) {
    const int mid = lo + (hi - lo) / 2;
    if (pred(mid)) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

// The query blocks [begin, end) of block_m rows whose rows may see a key of [j0, j1): from the
// block of the first row whose hi passes j0 to that of the last row whose lo is below j1 (both
// bounds never decrease as i grows); every block without kBanded. The backwards' key blocks walk
// these.
struct BlockRange {
  int begin, end;
};
template <bool kBanded>
EA_HOST_DEVICE BlockRange query_blocks(const KeyPattern& pattern, int q_len, int kv_len, int j0,
                                       int j1, int block_m) {
  if constexpr (!kBanded) return {0, (q_len + block_m - 1) / block_m};
  const int first =
      first_row(q_len, [&](int i) { return row_keys<true>(pattern, i, q_len, kv_len).hi > j0; });
  const int end =
      first_row(q_len, [&](int i) { return row_keys<true>(pattern, i, q_len, kv_len).lo >= j1; });
  const int begin = first / block_m;
  return {begin, end > first ? (end + block_m - 1) / block_m : begin};
}

// The first row whose keys reach past key j (hi > j), or q_len: as query_blocks finds its first.
// (A function of its own: written inline in walking_block_from, its lambda capturing a local of
// that template, the search crashed nvcc 13.0's front end: "assertion failed ... in
// i_copy_expr_tree".)
EA_HOST_DEVICE int first_row_past(const KeyPattern& pattern, int j, int q_len, int kv_len) {
  return first_row(q_len, [&](int i) { return row_keys<true>(pattern, i, q_len, kv_len).hi > j; });
}

// The first key block of block_n keys from n on whose walk (query_blocks above) holds a query
// block, or the number of key blocks when none does. Key block k walks nothing exactly where no row
// has a hi past its first key j0, or the first row f that has starts at or past its end j1 (lo_f
// >= j1: then the first row with lo >= j1 is f or one before it); the blocks after k and before the
// one holding lo_f walk nothing either (their first such row is f or a later one, whose lo is past
// them), so the search goes on from there. Without kBanded every block walks every query block.
// (Empty walks come with packed documents: keys a document leaves unused, seqused_k, or that no row
// of a window or of top-left causality with more keys than queries sees.)
template <bool kBanded>
EA_HOST_DEVICE int walking_block_from(const KeyPattern& pattern, int n, int q_len, int kv_len,
                                      int block_n) {
  const int blocks = (kv_len + block_n - 1) / block_n;
  if constexpr (kBanded) {
    for (; n < blocks; ++n) {
      const int f = first_row_past(pattern, n * block_n, q_len, kv_len);
      if (f == q_len) return blocks;  // no row sees a key from the block's first on
      const int lo = static_cast<int>(row_keys<true>(pattern, f, q_len, kv_len).lo);
      if (lo < (n + 1) * block_n && lo < kv_len) return n;
      if (lo / block_n > n + 1) n = lo / block_n - 1;  // (and ++n)
    }
  }
  return n < blocks ? n : blocks;
}

// The first key block of block_n keys that walks query block m (query_blocks above, a block of
// block_m rows). A key block ends past m (its walk's end, the block of the first row whose lo
// reaches the key block's end) exactly where lo of m's first row is below its last key: from the
// block holding that lo on. Both ends of the walks never move back as the key block grows, except
// that an empty walk has none, so the key blocks that walk m are the ones from the first with a
// walk from that block on (walking_block_from), while they begin at or before m, less those that
// walk nothing. The deterministic Hopper backward counts its turns with these (sm90/bwd_kernel.cuh:
// write_dq; tests/cpp/test_key_ranges.cpp: DeterministicTurnsFollowTheKeyBlocks).
template <bool kBanded>
EA_HOST_DEVICE int first_walker(const KeyPattern& pattern, int m, int q_len, int kv_len,
                                int block_m, int block_n) {
  const int lo = static_cast<int>(row_keys<kBanded>(pattern, m * block_m, q_len, kv_len).lo);
  return walking_block_from<kBanded>(pattern, lo / block_n, q_len, kv_len, block_n);
}

// The key blocks of block_n keys a query tile of `rows` rows from m0 (rows >= 1) walks: [n_begin,
// n_end) holds every key some row of the tile may see, [lo of its first row, hi of its last) as
// the rows' bounds never decrease. Blocks below n_lo_pred hold a key below the last row's lo (the
// largest), blocks from n_hi_pred on one at or past the first row's hi (the smallest; the
// sequence's end included): those need the per-element check of the rows' ranges, the others
// none. An empty walk (n_end <= n_begin: no row of the tile sees a key) loads nothing. key_end is
// the last row's hi: no row sees a key from there on.
struct TileBlocks {
  int n_begin, n_end, n_lo_pred, n_hi_pred, key_end;
  EA_HOST_DEVICE bool predicated(int n) const { return n >= n_hi_pred || n < n_lo_pred; }
};
template <bool kBanded>
EA_HOST_DEVICE TileBlocks tile_key_blocks(const KeyPattern& pattern, int m0, int rows, int q_len,
                                          int kv_len, int block_n) {
  const KeyRange first = row_keys<kBanded>(pattern, m0, q_len, kv_len);
  const KeyRange last = row_keys<kBanded>(pattern, m0 + rows - 1, q_len, kv_len);
  const int n_begin = static_cast<int>(first.lo) / block_n;
  // (Every range lies in [first.lo, last.hi): none holds a key when that is empty.)
  return {n_begin,
          last.hi > first.lo ? static_cast<int>((last.hi + block_n - 1) / block_n) : n_begin,
          static_cast<int>((last.lo + block_n - 1) / block_n), static_cast<int>(first.hi) / block_n,
          static_cast<int>(last.hi)};
}

// Whether the tile of query rows [i0, i0 + block_m) and keys [j0, j0 + block_n) needs the
// per-element check (the backwards, before a mask is considered): unless every row of it exists
// and sees every key of it, which with kBanded holds iff the last row's lo (the largest) is at
// most j0 and the first row's hi (the smallest) reaches the tile's end.
template <bool kBanded>
EA_HOST_DEVICE bool tile_needs_predicate(const KeyPattern& pattern, int i0, int j0, int block_m,
                                         int block_n, int q_len, int kv_len) {
  if (j0 + block_n > kv_len || i0 + block_m > q_len) return true;
  if constexpr (!kBanded) return false;
  return row_keys<true>(pattern, i0 + block_m - 1, q_len, kv_len).lo > j0 ||
         row_keys<true>(pattern, i0, q_len, kv_len).hi < j0 + block_n;
}

}  // namespace entropy_attn::cuda
