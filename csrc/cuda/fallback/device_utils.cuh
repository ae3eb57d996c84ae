// Small device helpers of the CUDA kernels: type conversions, NaN-propagating max, warp reductions
// and tile loads. Every kernel runs kThreads threads (kWarps warps) per block.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <limits>
#include <type_traits>

#include "../../dropout.h"
#include "../../kernel_args.h"

namespace entropy_attn::cuda::fallback {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;

template <typename T>
constexpr bool kIs16Bit = std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>;

// The mask as the kernels of inputs of type T read it. A 16-bit additive mask reaches only those of
// 16-bit inputs (attention_inputs.h: keeps_mask_dtype): for float and double the copy says so at
// compile time, and MaskArg's choice of the storage type (kernel_args.h: MaskArg::additive) folds
// away where the copy is read (a hint on the parameter itself, __builtin_unreachable, did not
// reach those reads: the float32 backward kept 167 registers for 144).
template <typename T, typename Acc>
__device__ __forceinline__ MaskArg<Acc> mask_for(const MaskArg<Acc>& mask) {
  MaskArg<Acc> m = mask;
  if constexpr (!kIs16Bit<T>) m.elem = MaskElem::kAcc;
  return m;
}

// Input values to the accumulate type (explicit intrinsics: torch builds with the implicit half
// conversions disabled).
__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ float to_acc(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }

// Accumulate-type values to T, rounding to nearest.
template <typename T>
__device__ __forceinline__ T from_acc(float x) {
  if constexpr (std::is_same_v<T, __half>) {
    return __float2half_rn(x);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(x);
  } else {
    return static_cast<T>(x);
  }
}
template <typename T>
__device__ __forceinline__ T from_acc(double x) {
  static_assert(std::is_same_v<T, double>, "double accumulators only store double");
  return x;
}

template <typename acc_t>
__device__ __forceinline__ acc_t neg_inf() {
  return -std::numeric_limits<acc_t>::infinity();
}

// max that propagates NaN (fmax drops it): a NaN logit must make the row NaN, as on the CPU.
template <typename acc_t>
__device__ __forceinline__ acc_t nan_max(acc_t a, acc_t b) {
  return (a > b || a != a) ? a : b;
}

template <typename V>
__device__ __forceinline__ V warp_sum(V v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename acc_t>
__device__ __forceinline__ acc_t warp_max(acc_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The dropout factor of weight (bh, i, j) (Dropout::factor), 1 without dropout. (Dropout::kept
// picks the draw's word by selects: indexing the draws by a runtime slot would put them in local
// memory.)
template <typename Acc>
__device__ __forceinline__ Acc dropout_factor(const Dropout<Acc>& d, int64_t bh, int64_t i,
                                              int64_t j) {
  if (!d.on()) return Acc(1);
  const PhiloxDraws r = d.group_draws(bh, i, j);
  return d.kept(r, Dropout<Acc>::slot(i, j)) ? d.keep_scale : Acc(0);
}

// Copies rows [0, rows) x columns [0, cols) of a row-major source (row stride src_ld, unit column
// stride) into a kRows x kCols shared-memory tile with leading dimension ld, zero-filling the rest:
// padded rows and columns then add nothing to any product. Each thread keeps its columns for every
// row it copies (a 2-D walk, not a flat index split by / and %): one row pointer per step is all it
// carries, where the flat form made ptxas hoist a 64-bit offset per unrolled step out of the key
// loop. With `nonfinite` (kRows + 1 flags, cleared beforehand) it also flags the rows holding a NaN
// or an infinity, nonfinite[kRows] when some row does (nonfinite_rows.cuh): a test in registers
// as the tile passes, where a scan of the tile afterwards cost a pass over shared memory.
template <int kRows, int kCols, typename T>
__device__ __forceinline__ void load_tile(T* dst, int ld, const T* src, int64_t src_ld, int rows,
                                          int64_t cols, uint8_t* nonfinite = nullptr) {
  using Acc = decltype(to_acc(T{}));
  constexpr int kRowThreads = kCols < kThreads ? kCols : kThreads;  // threads across one row
  static_assert(kThreads % kRowThreads == 0 && kCols % kRowThreads == 0, "whole rows per step");
  constexpr int kRowStep = kThreads / kRowThreads;
  const int c0 = threadIdx.x % kRowThreads;
  for (int r = threadIdx.x / kRowThreads; r < kRows; r += kRowStep) {
    const T* row = src + r * src_ld;
#pragma unroll
    for (int c = c0; c < kCols; c += kRowThreads) {
      const T x = (r < rows && c < cols) ? row[c] : from_acc<T>(0.0f);
      dst[r * ld + c] = x;
      if (nonfinite != nullptr) {
        const Acc a = to_acc(x);
        if (!(a - a == Acc(0))) nonfinite[r] = nonfinite[kRows] = 1;  // a - a: NaN for NaN, +-inf
      }
    }
  }
}

// The (batch, head, tile) of work item `index` of batch x heads x tiles, tiles fastest (a block's
// own, blockIdx.x, in a grid of a block per item); also the key/value head of the query head
// (GQA). 32-bit division: the host keeps the items below 2^31, and 64-bit division would be a
// called subroutine (register spills around the call).
struct BlockIndex {
  int64_t bh, b, h, kvh, tile;  // bh = b * heads + h
};
__device__ __forceinline__ BlockIndex block_index(unsigned index, int64_t tiles, int64_t heads,
                                                  int64_t kv_heads) {
  const unsigned t = static_cast<unsigned>(tiles), nh = static_cast<unsigned>(heads);
  const unsigned bh = index / t, h = bh % nh;
  return {bh, bh / nh, h, h / (nh / static_cast<unsigned>(kv_heads)), index % t};
}

// Shared-memory layout helpers: 16 bytes of padding per row (WMMA needs leading dimensions that are
// multiples of 16 bytes; the padding also spreads rows over banks), sections aligned to 128 bytes.
template <typename T>
constexpr int padded_ld(int n) {
  return n + 16 / static_cast<int>(sizeof(T));
}
constexpr size_t align128(size_t bytes) { return (bytes + 127) / 128 * 128; }

// The blocks an SM holds when each takes `bytes` of dynamic shared memory, on the GPU we build for
// with the most of it (an H100: 228 KB per SM, 1 KB of it reserved per block). The attention
// kernels give it to __launch_bounds__ as their minimum blocks per SM: ptxas then keeps registers
// from lowering the occupancy shared memory allows, and without a minimum it picks a register
// budget of its own and spills.
constexpr int blocks_by_shared_memory(size_t bytes) {
  const size_t n = 233472 / (bytes + 1024);
  const size_t most = 2048 / kThreads;  // an SM's threads
  return n < 1 ? 1 : static_cast<int>(n < most ? n : most);
}

}  // namespace entropy_attn::cuda::fallback
