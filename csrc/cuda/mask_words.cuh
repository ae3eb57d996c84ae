// The mask tile of the tensor-core forwards (sm80, sm90): one 32-bit word per score in shared
// memory, copied with 4-byte cp.async (asynchronous, so the loads hold no registers while the
// scores are computed). A float32 additive mask's word is its float. A bool mask's entry is one
// byte and a 16-bit additive mask's (kernel_args.h: MaskElem) two, and cp.async moves 4, 8 or 16
// bytes: the aligned word that holds the entry is copied, and the reader picks the entry out with
// __byte_perm. Such a word may hold bytes beyond the mask's entries, never beyond its storage:
// the call preparation copies a mask whose words would reach past it (attention_inputs.h:
// word_readable).
#pragma once

#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "../kernel_args.h"

namespace entropy_attn::cuda {

// The global word a tile loader copies for the mask entry at element offset `off`.
template <MaskKind kMask>
__device__ __forceinline__ const uint32_t* mask_word(const MaskArg<float>& mask, int64_t off) {
  if constexpr (kMask == MaskKind::kBool) {
    return reinterpret_cast<const uint32_t*>(reinterpret_cast<uintptr_t>(mask.bool_bytes() + off) &
                                             ~uintptr_t{3});
  } else {
    if (mask.elem != MaskElem::kAcc) {
      return reinterpret_cast<const uint32_t*>(
          reinterpret_cast<uintptr_t>(mask.additive_bits() + off) & ~uintptr_t{3});
    }
    return reinterpret_cast<const uint32_t*>(mask.additive_data() + off);
  }
}

// The low 2 bits of the address of mask entry (b, h, i, j) of `bytes` bytes each (computed in 32
// bits; nothing above them matters).
__device__ __forceinline__ uint32_t mask_entry_low_bits(const MaskArg<float>& mask, int b, int h,
                                                        int i, int j, uint32_t bytes) {
  const uint32_t addr = static_cast<uint32_t>(reinterpret_cast<uintptr_t>(mask.data)) +
                        bytes * (static_cast<uint32_t>(b) * static_cast<uint32_t>(mask.sb) +
                                 static_cast<uint32_t>(h) * static_cast<uint32_t>(mask.sh) +
                                 static_cast<uint32_t>(i) * static_cast<uint32_t>(mask.si) +
                                 static_cast<uint32_t>(j) * static_cast<uint32_t>(mask.sj));
  return addr & 3u;
}

// The __byte_perm selector of bool mask entry (b, h, i, j) within its word; selector nibbles 1-3 =
// 4 pick zero bytes of __byte_perm's second operand. A thread's columns of a tile are col(c % 2) +
// 8 (c / 2) with the tile's first key a multiple of 8, so the selectors of its first two columns
// serve all of them (for a 16-bit mask too: 8 keys are 16 bytes).
__device__ __forceinline__ uint32_t bool_mask_selector(const MaskArg<float>& mask, int b, int h,
                                                       int i, int j) {
  return 0x4440u | mask_entry_low_bits(mask, b, h, i, j, 1);
}

// Whether a bool mask entry, given its word in the tile and its selector, allows the key.
__device__ __forceinline__ bool bool_mask_allows(uint32_t word, uint32_t selector) {
  return __byte_perm(word, 0u, selector) != 0u;
}

// The __byte_perm selector that makes the float32 bits of additive mask entry (b, h, i, j) out of
// its word, for inputs of type T: the word as it is (0x3210) for a float32 mask; for a bf16 mask,
// the entry's two bytes (at byte a = 0 or 2 of the word) into the high half, the rest zeros, which
// is the float of equal value; for an fp16 one, into the low half (additive_mask_value converts).
template <typename T>
__device__ __forceinline__ uint32_t additive_mask_selector(const MaskArg<float>& mask, int b, int h,
                                                           int i, int j) {
  if (mask.elem == MaskElem::kAcc) return 0x3210u;
  const uint32_t a = mask_entry_low_bits(mask, b, h, i, j, 2);
  if constexpr (std::is_same_v<T, __half>) return 0x4400u | (a + 1) << 4 | a;
  return (a + 1) << 12 | a << 8 | 0x44u;
}

// An additive mask entry's float value from its word and selector (additive_mask_selector). A
// 16-bit mask is of the inputs' type T (attention_inputs.h: keeps_mask_dtype): for bf16 the
// selection is the value (one PRMT per score), an fp16 entry is converted (exactly).
template <typename T>
__device__ __forceinline__ float additive_mask_value(const MaskArg<float>& mask, uint32_t word,
                                                     uint32_t selector) {
  const uint32_t bits = __byte_perm(word, 0u, selector);
  if constexpr (std::is_same_v<T, __half>) {
    if (mask.elem != MaskElem::kAcc) {
      return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
    }
  }
  return __uint_as_float(bits);
}

// An additive mask's entry at element offset `off` from `data` (its entries of type `elem`) in
// global memory (the backward kernels), for inputs of type T: one 16-bit load for a 16-bit mask,
// converted (a bf16 shifted into a float's high half), else one float load.
template <typename T>
__device__ __forceinline__ float load_additive_mask(const void* data, MaskElem elem, int64_t off) {
  if (elem == MaskElem::kAcc) return static_cast<const float*>(data)[off];
  const unsigned short bits = static_cast<const unsigned short*>(data)[off];
  if constexpr (std::is_same_v<T, __half>) return __half2float(__ushort_as_half(bits));
  return __uint_as_float(static_cast<uint32_t>(bits) << 16);
}

// The backward kernels read their mask entries from global memory, one per score, right after the
// product that forms the scores and ahead of the exponentials that need them: this prefetches the
// L1 lines of a kTileRows x kTileCols tile's entries (rows [0, rows), keys [0, cols); entry (0, 0)
// at element offset `off`) before that product, so that those loads find them in L1 instead of
// waiting for L2. Per row, where the keys are contiguous, the entry that starts each 128 bytes (a
// bool mask's key 0, 128, ...; an additive one's, key 0, 32, ..., which for a 16-bit mask visits
// each line twice), and the row's last
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
