// The mask tile of the tensor-core forwards (sm80, sm90): one 32-bit word per score in shared
// memory, copied with 4-byte cp.async (asynchronous, so the loads hold no registers while the
// scores are computed). An additive mask's word is its float. A bool mask's entry is one byte, and
// cp.async moves 4, 8 or 16 bytes: the aligned word that holds the byte is copied, and the reader
// picks the byte out with __byte_perm. Such a word stays within the mask's allocation as long as
// its start is 4-byte aligned and its size a multiple of 4 bytes (cudaMalloc aligns to 256 bytes,
// PyTorch's caching allocator rounds sizes up to 512 bytes).
#pragma once

#include <cstdint>

#include "../kernel_args.h"

namespace entropy_attn::cuda {

// The global word a tile loader copies for the mask entry at element offset `off`.
template <MaskKind kMask>
__device__ __forceinline__ const uint32_t* mask_word(const MaskArg<float>& mask, int64_t off) {
  if constexpr (kMask == MaskKind::kBool) {
    return reinterpret_cast<const uint32_t*>(reinterpret_cast<uintptr_t>(mask.bool_bytes() + off) &
                                             ~uintptr_t{3});
  } else {
    return reinterpret_cast<const uint32_t*>(mask.additive_data() + off);
  }
}

// The __byte_perm selector of bool mask entry (b, h, i, j) within its word: the low 2 bits of the
// entry's address (computed in 32 bits; nothing above them matters); selector nibbles 1-3 = 4
// pick zero bytes of __byte_perm's second operand. A thread's columns of a tile are col(c % 2) +
// 8 (c / 2) with the tile's first key a multiple of 8, so the selectors of its first two columns
// serve all of them.
__device__ __forceinline__ uint32_t bool_mask_selector(const MaskArg<float>& mask, int b, int h,
                                                       int i, int j) {
  const uint32_t addr = static_cast<uint32_t>(reinterpret_cast<uintptr_t>(mask.data)) +
                        static_cast<uint32_t>(b) * static_cast<uint32_t>(mask.sb) +
                        static_cast<uint32_t>(h) * static_cast<uint32_t>(mask.sh) +
                        static_cast<uint32_t>(i) * static_cast<uint32_t>(mask.si) +
                        static_cast<uint32_t>(j) * static_cast<uint32_t>(mask.sj);
  return 0x4440u | (addr & 3u);
}

// Whether a bool mask entry, given its word in the tile and its selector, allows the key.
__device__ __forceinline__ bool bool_mask_allows(uint32_t word, uint32_t selector) {
  return __byte_perm(word, 0u, selector) != 0u;
}

// The backward kernels read their mask entries from global memory, one per score, right after the
// product that forms the scores and ahead of the exponentials that need them: this prefetches the
// L1 lines of a kTileRows x kTileCols tile's entries (rows [0, rows), keys [0, cols); entry (0, 0)
// at element offset `off`) before that product, so that those loads find them in L1 instead of
// waiting for L2. Per row, where the keys are contiguous, the entry that starts each 128 bytes (a
// bool mask's key 0, 128, ...; an additive one's, float32, key 0, 32, ...), and the row's last
// where one prefetch per thread leaves room for it: the lines the row's entries span wherever it
// starts (without the last, all but the last of a row that does not start on a line). One prefetch
// per thread (more spilled in the masked kernels at D = 128); a mask of other strides is covered in
// part. A hint that nothing waits for (Ops::prefetch_l1: prefetch.global.L1).
template <MaskKind kMask, typename Ops, int kTileRows, int kTileCols, int kThreads>
__device__ __forceinline__ void prefetch_mask_tile(const MaskArg<float>& mask, int64_t off,
                                                   int rows, int cols, int tid) {
  constexpr int kPartKeys = kMask == MaskKind::kBool ? 128 : 32;
  constexpr int kParts = (kTileCols + kPartKeys - 1) / kPartKeys;
  constexpr bool kWithLast = kTileRows * (kParts + 1) <= kThreads;
  constexpr int kPoints = kParts + (kWithLast ? 1 : 0);  // per row
  static_assert(kTileRows * kPoints <= kThreads, "one prefetch per thread");
  const int r = tid / kPoints, point = tid % kPoints;
  const int last = (cols < kTileCols ? cols : kTileCols) - 1;
  const int c = kWithLast && point == kPoints - 1 ? last : point * kPartKeys;
  // (Only entries of the tile: an address past the mask's allocation may be in no mapped page.)
  if (r < rows && r < kTileRows && c <= last) {
    Ops::prefetch_l1(mask_word<kMask>(mask, off + r * mask.si + c * mask.sj));
  }
}

}  // namespace entropy_attn::cuda
