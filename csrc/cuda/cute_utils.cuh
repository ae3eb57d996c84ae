// Pieces the tensor-core families (sm80, sm90) share: the CUTLASS element type of a torch-facing
// CUDA type, exp2 by one MUFU.EX2, a row's max over a thread's columns, the reductions over the
// four lanes that hold an accumulator row,
// the dropout decisions of an accumulator tile, and the fp32 -> 16-bit conversion of a register
// fragment.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

#include <cmath>
#include <cstdint>
#include <cute/tensor.hpp>
#include <limits>

#include "../dropout.h"

namespace entropy_attn::cuda {

// CuTe's MMA and copy atoms are written for cutlass::bfloat16_t and cutlass::half_t: the same bits.
template <typename T>
struct CuteElement;
template <>
struct CuteElement<__nv_bfloat16> {
  using type = cutlass::bfloat16_t;
};
template <>
struct CuteElement<__half> {
  using type = cutlass::half_t;
};

constexpr float kLog2e = 1.4426950408889634f;

// 2^x by one MUFU.EX2. x <= 0 here (a logit minus the row max or the lse), so flushing results
// below 2^-126 to zero loses nothing (such a weight contributes nothing in float32); 2^-inf = 0 and
// 2^NaN = NaN, which the masking and NaN rules rely on.
CUTE_DEVICE float exp2_approx(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return std::exp2(x);
#endif
}

// tanh(u ln(2) / 2) = 1 - 2 / (2^u + 1), for logit softcapping (c tanh(x) with u = 2 x log2(e)),
// by one MUFU.EX2 and one MUFU.RCP. Its absolute error is about 1e-7 (the relative error is large
// only where tanh is near 0), so a capped logit is off by about c 1e-7; tanh.approx's relative
// error of 2^-11 would move a logit near the cap by c / 2^11, and tanhf's longer sequence costs
// registers the D = 128 kernels do not have. u = +-inf gives +-1, NaN gives NaN.
CUTE_DEVICE float tanh_of_exp2(float u) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(exp2_approx(u) + 1.f));
  return fmaf(-2.f, r, 1.f);
#else
  return 1.f - 2.f / (std::exp2(u) + 1.f);
#endif
}

// The lanes 4g..4g+3 of a warp hold the same accumulator rows (mma.sync m16n8 and wgmma alike).
CUTE_DEVICE float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

// A row's running max over a thread's columns, kept as four independent maxima (column c goes to
// the c % 4-th) and combined at the end: kCols / 4 + 2 dependent FMNMX before the row's quad
// shuffles and first exponential instead of a chain of kCols, which left the issue slots of the
// softmax's first phase idle (FlashAttention's CuTe kernels reduce so too). fmaxf is exact and
// ignores a NaN operand in any order, so the value is the serial fold's.
struct RowMax4 {
  static constexpr float kNone = -std::numeric_limits<float>::infinity();
  float m[4] = {kNone, kNone, kNone, kNone};
  // (c a compile-time column of an unrolled loop: m[c % 4] stays in registers.)
  CUTE_DEVICE void add(int c, float y) { m[c % 4] = fmaxf(m[c % 4], y); }
  CUTE_DEVICE float value() const { return fmaxf(fmaxf(m[0], m[1]), fmaxf(m[2], m[3])); }
};

// An int the compiler cannot see through. Indices that pass through it are computed where they
// are used: otherwise loop-invariant code motion and strength reduction turn every row of a tile
// load into its own 64-bit pointer held across the key loop (the sm80 forward: 16 registers for K
// and V), and common-subexpression elimination keeps prologue values alive until the epilogue.
CUTE_DEVICE int opaque(int x) {
  asm volatile("" : "+r"(x));
  return x;
}

template <typename V>
CUTE_DEVICE V quad_sum(V x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Neither NaN nor infinite (a NaN fails the comparison).
CUTE_DEVICE bool is_finite(float x) { return fabsf(x) <= 3.402823466e38f; }

// x, with -inf raised to -FLT_MAX: a hidden key's x = -inf (e = 0) then adds 0 * x = 0 to the
// statistics' t instead of NaN.
CUTE_DEVICE float clamp_finite(float x) { return fmaxf(x, -3.402823466e38f); }

// Logit softcapping on the raw scores x of a row whose logit is a x (a = lambda_i, or lambda_i
// log2(e) in log2 units: `unit` = 1 or log2(e)): per row, `in` and `out` such that the score
// x' = out tanh_of_exp2(in x) has the logit a x' = unit c tanh(lambda_i x / c), the capped one
// (docs/math.md section 6), so that the kernels' logit code (a x, plus the mask) stays as it is.
// |x'| <= |x|. out is 0 where a = 0, whose logit is 0 either way, and where unit c / a overflows
// (|a| below c / FLT_MAX: the capped logit, about a x, is 0 to float precision).
struct SoftcapRow {
  float in, out;
};
CUTE_DEVICE SoftcapRow softcap_row(float a, float unit, float cap, float inv_cap) {
  const float out = a != 0.f ? unit * cap / a : 0.f;
  return {a * (2.f * kLog2e / unit) * inv_cap, is_finite(out) ? out : 0.f};
}

// Calls keep(r, c, kept) with the dropout decision (dropout.h) of the elements (r, c) in columns
// [c0, c0 + 4) (kAdjacentN) or [c0, c0 + 2) of every row of a thread's accumulator tile viewed by
// rows and columns: rows ((2, M)) = rows g and g + 8 of each m16 slice, columns ((2, N)) = columns
// 2q and 2q + 1 of each n8 slice (the mma.sync m16n8k16 and wgmma accumulator layouts; the
// families' acc_rowcol / rowcol views). `coord` (the same view of the tile's identity tensor) gives
// an element's row and column in the tile, whose first row i0 and first key j0 are multiples of 16.
// Such a thread holds, per m16 slice and n8 slice, four weights of one Philox group: one call
// serves them, and with kAdjacentN (slice n + 1 holds slice n's columns + 8, for even n: the
// forward tiles and the Hopper backward's) one call serves two n8 slices, all eight weights of its
// group. Without it, the group's words for a slice (its columns mod 16 below 8 or not) are chosen
// at run time: they depend on the warp's place in the tile. c0 (a multiple of the width) must be
// known at compile time (an unrolled loop's index), as the fragment indices keep() forms from it.
// (Host-callable: tests/cpp/dropout_layouts.cu checks the decisions against Dropout::factor on
// every tile that draws them.)
template <bool kAdjacentN, typename Coord, typename Fn>
CUTE_HOST_DEVICE void dropout_decisions_of_columns(const Dropout<float>& d, int64_t bh, int i0,
                                                   int j0, Coord const& coord, int c0, Fn&& keep) {
  constexpr int kRows = decltype(cute::size<0>(coord))::value;
  constexpr int kStep = kAdjacentN ? 4 : 2;  // columns per Philox call
  static_assert(kRows % 2 == 0);
  const uint32_t threshold = d.threshold << 16;
  CUTE_UNROLL
  for (int r = 0; r < kRows; r += 2) {
    const int i = i0 + cute::get<0>(coord(r, c0)), j = j0 + cute::get<1>(coord(r, c0));
    const PhiloxDraws x = d.group_draws(bh, i, j);
    // The columns j mod 16 >= 8 take the group's words 1 and 3; with kAdjacentN a call's first
    // slice holds those below 8 in every tile that uses it.
    const bool upper = !kAdjacentN && ((j >> 3) & 1);
    CUTE_UNROLL
    for (int n = 0; n < kStep / 2; ++n) {
      const bool half = upper != (n == 1);
      const uint32_t w0 = half ? x.x[1] : x.x[0], w8 = half ? x.x[3] : x.x[2];  // rows g, g + 8
      CUTE_UNROLL
      for (int e = 0; e < 2; ++e) {  // the low half of a word decides the even column
        keep(r, c0 + 2 * n + e, (e ? w0 : w0 << 16) >= threshold);
        keep(r + 1, c0 + 2 * n + e, (e ? w8 : w8 << 16) >= threshold);
      }
    }
  }
}

// dropout_decisions_of_columns over every column of the tile.
template <bool kAdjacentN, typename Coord, typename Fn>
CUTE_HOST_DEVICE void for_each_dropout_decision(const Dropout<float>& d, int64_t bh, int i0, int j0,
                                                Coord const& coord, Fn&& keep) {
  constexpr int kCols = decltype(cute::size<1>(coord))::value;
  constexpr int kStep = kAdjacentN ? 4 : 2;
  static_assert(kCols % kStep == 0);
  CUTE_UNROLL
  for (int c = 0; c < kCols; c += kStep) {
    dropout_decisions_of_columns<kAdjacentN>(d, bh, i0, j0, coord, c, keep);
  }
}

// The decisions of for_each_dropout_decision packed into one word: bit r * kCols + c is element
// (r, c)'s. Backward kernels draw them before S holds registers (next to it, their masked
// instantiations spill at D = 128) and apply them to P and dP later.
template <bool kAdjacentN, typename Coord>
CUTE_HOST_DEVICE uint32_t dropout_keep_bits(const Dropout<float>& d, int64_t bh, int i0, int j0,
                                            Coord const& coord) {
  constexpr int kCols = decltype(cute::size<1>(coord))::value;
  static_assert(decltype(cute::size(coord))::value <= 32);
  uint32_t bits = 0;
  for_each_dropout_decision<kAdjacentN>(d, bh, i0, j0, coord, [&](int r, int c, bool kept) {
    bits |= static_cast<uint32_t>(kept) << (r * kCols + c);
  });
  return bits;
}

// fp32 fragment -> To fragment of the same layout, rounding to nearest (cvt.rn.bf16x2/f16x2.f32).
// Fragments are compact register arrays, so the element order of both is the storage order.
template <typename To, typename Engine, typename Layout>
CUTE_HOST_DEVICE auto convert_fragment(cute::Tensor<Engine, Layout> const& src) {
  using From = typename Engine::value_type;
  constexpr int kN = decltype(cute::size(src))::value;
  cute::Tensor dst = cute::make_tensor<To>(src.layout());
  cutlass::NumericArrayConverter<To, From, kN> convert;
  *reinterpret_cast<cutlass::Array<To, kN>*>(cute::raw_pointer_cast(dst.data())) = convert(
      *reinterpret_cast<cutlass::Array<From, kN> const*>(cute::raw_pointer_cast(src.data())));
  return dst;
}

}  // namespace entropy_attn::cuda
