// Backward of the tensor-core family (sm_80 and newer, bf16/fp16): FlashAttention-2's backward,
// written with CuTe, with the per-row scale lambda_i and the entropy and sum p^2 gradient terms of
// docs/math.md section 3. The per-element math is online_stats.h's (row_delta, logit_grad), the
// same functions the CPU kernel and the fallback CUDA kernel call.
//
// Kernels, in launch order (bwd_launch.cuh):
//   preprocess:  delta_i = row_delta(dO_i . O_i, g_i, lse_i, H_i, sum_p2_i), a few threads a row.
//   dq:          only when deterministic: one CTA per query block recomputes P and dS over the
//                key blocks and writes G = dS K without atomics (the main kernel then skips G).
//   main:        one CTA per (key block, kv head, batch). K and V stay in shared memory, dK and
//                dV in registers, while the CTA walks the query blocks of every query head of
//                its GQA group: S = Q K^T, P = exp(S - lse), dP = dO V^T, dS = logit_grad(...),
//                dV += P^T dO, dK += dS^T (lambda Q), G += dS K (fp32 atomics into dq_accum);
//                with an additive mask whose gradient is asked for, dS into it (add_logit_grads).
//   postprocess: dq_i = lambda_i G_i (to T) and d lambda_i = q_i . G_i where asked for.
//
// The instantiations compiled with causality (kCausal) are the general ones: they take any
// KeyPattern (key_ranges.cuh: causality, a sliding window, either alignment, packed documents,
// or none) and the calls with softcap, sinks or dropout; the others only plain full attention. A
// key block walks only the query blocks whose rows see it, a query block of the dq kernel only the
// key blocks its rows see, and a tile checks each element against its row's range unless every row
// sees every key of it. Sinks need nothing here (lse and the statistics read include the sink;
// its gradient is the host's). Logit softcapping replaces S by the scores whose scaled logits are
// the capped ones before the per-element step (a uniform branch) and its derivative multiplies dS;
// such a call keeps the logits (the kGrads path), and never comes with an additive mask (the
// selection point routes it). Dropout regenerates the forward's decisions per tile (one Philox
// call per 4 weights: dropout_keep_bits): the P of dV is the dropped one, p z / (1 - p'), and dP
// is multiplied by z / (1 - p') before dS (docs/math.md section 6).
#pragma once

#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>
#include <cute/tensor.hpp>

#include <cstdint>
#include <limits>
#include <type_traits>

#include "../../online_stats.h"
#include "../cute_utils.cuh"
#include "../key_ranges.cuh"
#include "../launch_order.h"
#include "../logit_grads.cuh"
#include "../mask_words.cuh"
#include "../params.h"
#include "launch.h"
#include "ops.cuh"

namespace entropy_attn::cuda::sm80::bwd {

using namespace cute;

// Tiles: 64 query rows x 128 keys, 8 warps, at D = 64 and 128. This is FlashAttention-2's sm80
// tile at D = 128; at D = 64 FlashAttention-2 prefers 128 x 128, which here needs more than 255
// registers per thread once lambda, the mask and the entropy terms are added (ptxas spills).
// Registers per thread: dK and dV (128 keys x D, fp32) D / 2 together, S and dP 32 each. A key
// block of 128 rather than 64 halves the dQ atomics and the Q/dO reloads. Shared memory: Q,
// lambda Q, dO double-buffered (64 x D each), K, V (128 x D), P, dS (64 x 128) and the row
// statistics: 161 KB at D = 128 (an A100 allows 163 KB), 97 KB at D = 64.
// kCompact (D = 128 only): the tiles for GPUs that allow a block 99 KB (sm_86/sm_89/sm_120), as
// FlashAttention-2 takes them there: 64 x 64 and one dO buffer, 97 KB. dK and dV then hold 32
// registers each, S and dP 16, so dP runs whole; the dK/dV product has 2 warps along the keys.
// The next dO lands after dV += P^T dO has read the present one (a barrier), overlapping G and dK
// only. launch_backward picks these tiles where the others do not fit (launch.h:
// backward_compact).
// D = 256 takes 64 x 64 tiles (FlashAttention-2's there too): dK and dV 128 registers, S and dP
// 16 each, G 64; 209 KB of shared memory, which an H100 has and an A100 has not (launch.h).
template <typename T, int kHeadDim_, bool kCompact_ = false, typename Ops_ = Sm80Ops>
struct BwdTraits {
  using Input = T;  // __nv_bfloat16 or __half (a 16-bit additive mask's type too)
  using Element = typename ::entropy_attn::cuda::CuteElement<T>::type;
  using Ops = Ops_;
  using CpAsync4 = typename Ops::CpAsync4;
  static constexpr int kHeadDim = kHeadDim_;
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256,
                "the tensor-core family compiles D = 64, 128, 256");
  static constexpr bool kCompact = kCompact_;
  static_assert(!kCompact || kHeadDim == 128, "the compact tiles are D = 128's");
  static constexpr int kBlockM = 64;
  static constexpr int kBlockN = backward_block_n(kHeadDim, kCompact);
  static constexpr int kDoBuffers = backward_do_buffers(kCompact);
  static constexpr int kNWarps = 8;
  static constexpr int kNThreads = 32 * kNWarps;

  // Warps along M of each product (the rest along N): S and dP 2 (32 rows x kBlockN / 4 keys per
  // warp), dK and dV 4 (32 keys x D / 2 per warp; compact: 2, 32 keys x D / 4), dQ 2 (32 rows x
  // D / 4 per warp).
  static constexpr int kWarpsMSdP = kBlockM / 32;
  static constexpr int kWarpsNdKV = kCompact ? 2 : 4;
  static constexpr int kWarpsMdQ = kBlockM / 32;

  using MmaAtom = MMA_Atom<typename Ops::template Mma<Element>>;
  template <int kWarpsM>
  using TiledMmaOf = TiledMMA<MmaAtom, Layout<Shape<Int<kWarpsM>, Int<kNWarps / kWarpsM>, _1>>,
                              Tile<Int<16 * kWarpsM>, Int<16 * (kNWarps / kWarpsM)>, _16>>;
  using TiledMmaSdP = TiledMmaOf<kWarpsMSdP>;  // S = Q K^T, dP = dO V^T: (rows, keys)
  using TiledMmadKV = TiledMmaOf<kWarpsNdKV>;  // dV = P^T dO, dK = dS^T (lambda Q): (keys, D)
  using TiledMmadQ = TiledMmaOf<kWarpsMdQ>;    // G = dS K: (rows, D)
  // dP = dO V^T is the register peak (dK, dV, S and dP all live). At D = 128 it runs in two
  // halves of 64 keys so that only half of dP is live, which keeps every variant within 255
  // registers without spills (ptxas; the whole product spilled), for 11% more ldmatrix (dO is
  // read twice). D = 64 has registers to spare.
  static constexpr int kDpParts = kBlockN == 128 && kHeadDim == 128 ? 2 : 1;  // (64 keys: 16 each)
  // G = dS K of the main kernel, the peak at D = 256 (dK, dV and G: 192 registers; the whole
  // product spilled), runs in two halves of 128 columns there.
  static constexpr int kDqParts = kHeadDim == 256 ? 2 : 1;

  // Shared memory in 8 x 64 atoms (128-byte rows) with the 3-bit XOR swizzle of the 16-byte
  // chunks: ldmatrix of 8 rows, plain or transposed, and the 16-byte cp.async stores then touch
  // all 32 banks once (no conflicts).
  using SmemAtom =
      decltype(composition(Swizzle<3, 3, 3>{}, Layout<Shape<_8, _64>, Stride<_64, _1>>{}));
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutPdS = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kBlockN>>{}));
  // Transposed views of the same bytes, the operands that ldmatrix .trans reads.
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockM>>{}, GenRowMajor{})));
  using SmemLayoutKt = decltype(composition(
      SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, GenRowMajor{})));
  using SmemLayoutPdSt = decltype(composition(
      SmemLayoutPdS{}, make_layout(Shape<Int<kBlockN>, Int<kBlockM>>{}, GenRowMajor{})));

  using SmemCopyAtom = Copy_Atom<typename Ops::LdsmN, Element>;
  using SmemCopyAtomT = Copy_Atom<typename Ops::LdsmT, Element>;

  // Global <-> shared: 8 threads per 64-column chunk of a row, 16 bytes (8 elements) each.
  using GmemThreads = Layout<Shape<Int<kNThreads / 8>, _8>, Stride<_8, _1>>;
  using GmemTiledCopy = decltype(make_tiled_copy(Copy_Atom<typename Ops::CpAsync16, Element>{},
                                                 GmemThreads{}, Layout<Shape<_1, _8>>{}));
  using VecTiledCopy =
      decltype(make_tiled_copy(Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<128>, Element>{},
                               GmemThreads{}, Layout<Shape<_1, _8>>{}));

  // Per-row values staged in shared memory for one query block.
  static constexpr int kStatLse = 0, kStatLambda = 1, kStatDelta = 2, kStatGH = 3, kStatGU = 4;
  static constexpr int kStats = 5;

  static constexpr int kBytesQ = kBlockM * kHeadDim * 2;
  static constexpr int kBytesKV = kBlockN * kHeadDim * 2;
  static constexpr int kBytesPdS = kBlockM * kBlockN * 2;
  static constexpr int kBytesRows = kStats * kBlockM * 4;
  // Main kernel.
  static constexpr int kMainQ = 0, kMainQl = kMainQ + kBytesQ, kMaindO = kMainQl + kBytesQ;
  static constexpr int kMainK = kMaindO + kDoBuffers * kBytesQ, kMainV = kMainK + kBytesKV;
  static constexpr int kMainP = kMainV + kBytesKV, kMaindS = kMainP + kBytesPdS;
  static constexpr int kMainRows = kMaindS + kBytesPdS;
  static constexpr int kMainBytes = kMainRows + kBytesRows;
  // Deterministic dq kernel.
  static constexpr int kDqQ = 0, kDqdO = kDqQ + kBytesQ, kDqK = kDqdO + kBytesQ;
  static constexpr int kDqV = kDqK + kBytesKV, kDqdS = kDqV + kBytesKV;
  static constexpr int kDqRows = kDqdS + kBytesPdS;
  static constexpr int kDqBytes = kDqRows + kBytesRows;
  static_assert(kMainBytes <= (kHeadDim <= 128 ? 166912 : 232448),
                "over the shared memory per block of an A100 (163 KB; D <= 128) or H100 (227 KB)");
  static_assert(!kCompact || (kMainBytes <= 101376 && kDqBytes <= 101376),
                "the compact tiles are for GPUs with 99 KB of shared memory per block");
  static_assert(kHeadDim % 64 == 0 && kBlockM % 32 == 0 && kBlockN % 64 == 0);

  // Preprocess: 16-byte loads, kHeadDim / 8 threads per row. Postprocess: 4 floats per thread and
  // step, kHeadDim / 4 threads per row up to a warp (the row's dot product is a warp shuffle sum),
  // which then takes kPostSteps steps.
  static constexpr int kPreThreadsPerRow = kHeadDim / 8;
  static constexpr int kPreRows = kNThreads / kPreThreadsPerRow;
  static constexpr int kPostThreadsPerRow = kHeadDim / 4 < 32 ? kHeadDim / 4 : 32;
  static constexpr int kPostSteps = kHeadDim / (4 * kPostThreadsPerRow);
  static constexpr int kPostRows = kNThreads / kPostThreadsPerRow;
  static_assert(kPreThreadsPerRow <= 32, "a row's preprocess threads are lanes of one warp");
};

// Adds a pair of adjacent floats to global memory, two scalar reductions (as FlashAttention-2's
// dq). sm_90 has one vector reduction for the pair (atomicAdd on float2), but using it would make
// the backward's device code differ at sm_90, which costs a second PTX per unit (cicc ran 71-74 s
// of a unit's 170 per architecture, nvcc --time, 2026-12-01); on sm_90 this family's backward runs
// only the calls the Hopper family does not take (csrc/cuda/family.cpp), so the shared PTX is
// chosen.
CUTE_DEVICE void atomic_add_pair(float* dst, float a, float b) {
  atomicAdd(dst, a);
  atomicAdd(dst + 1, b);
}

// (MMA=4, MMA_M, MMA_N) accumulator layout -> ((2, MMA_M), (2, MMA_N)): rows and columns. The 4
// values of an m16n8 accumulator are (row g, cols 2t, 2t+1) and (row g + 8, the same cols).
template <typename Layout>
CUTE_HOST_DEVICE auto rowcol(Layout l) {
  static_assert(decltype(size<0>(l))::value == 4 && decltype(rank(l))::value == 3);
  auto d = logical_divide(l, Shape<_2>{});  // ((2, 2), MMA_M, MMA_N)
  return make_layout(make_layout(get<0, 1>(d), get<1>(d)), make_layout(get<0, 0>(d), get<2>(d)));
}

// acc += A B from shared memory, with the k-slice k+1 loaded (ldmatrix) while slice k multiplies.
template <typename Acc, typename RA, typename RB, typename SA, typename SB, typename Mma,
          typename CopyA, typename ThrCopyA, typename CopyB, typename ThrCopyB>
CUTE_DEVICE void gemm_smem(Acc& acc, RA& rA, RB& rB, SA const& sA, SB const& sB, Mma const& mma,
                           CopyA const& copy_a, ThrCopyA const& thr_a, CopyB const& copy_b,
                           ThrCopyB const& thr_b) {
  Tensor rA_view = thr_a.retile_D(rA);
  Tensor rB_view = thr_b.retile_D(rB);
  CUTE_STATIC_ASSERT_V(size<1>(sA) == size<1>(rA_view));
  CUTE_STATIC_ASSERT_V(size<1>(sB) == size<1>(rB_view));
  cute::copy(copy_a, sA(_, _, _0{}), rA_view(_, _, _0{}));
  cute::copy(copy_b, sB(_, _, _0{}), rB_view(_, _, _0{}));
  CUTE_UNROLL
  for (int k = 0; k < size<2>(rA); ++k) {
    if (k + 1 < size<2>(rA)) {
      cute::copy(copy_a, sA(_, _, k + 1), rA_view(_, _, k + 1));
      cute::copy(copy_b, sB(_, _, k + 1), rB_view(_, _, k + 1));
    }
    cute::gemm(mma, rA(_, _, k), rB(_, _, k), acc);
  }
}

// Copies the rows [0, rows) of a tile partitioned by a GmemTiledCopy (cp.async) and zero-fills the
// others, which then add nothing to any product.
template <typename TiledCopy, typename Src, typename Dst, typename Coord>
CUTE_DEVICE void copy_rows(TiledCopy const& tc, Src const& src, Dst&& dst, Coord const& coord,
                           int rows) {
  CUTE_UNROLL
  for (int m = 0; m < size<1>(src); ++m) {
    if (get<0>(coord(0, m, 0)) < rows) {
      cute::copy(tc, src(_, m, _), dst(_, m, _));
    } else {
      cute::clear(dst(_, m, _));
    }
  }
}

// Stages the per-row values of a query block (rows [0, rows) of the head from (B, H, Lq) index
// row0) into shared memory with 4-byte cp.async; padding rows and null gradients read as 0.
template <typename Kt>
CUTE_DEVICE void load_row_stats(const BwdParams<float>& p, float* srow, int64_t row0, int rows) {
  for (int e = threadIdx.x; e < Kt::kStats * Kt::kBlockM; e += Kt::kNThreads) {
    const int stat = e / Kt::kBlockM, r = e % Kt::kBlockM;
    const float* src = stat == Kt::kStatLse      ? p.lse
                       : stat == Kt::kStatLambda ? p.row_scale
                       : stat == Kt::kStatDelta  ? p.delta
                       : stat == Kt::kStatGH     ? p.g_entropy
                                                 : p.g_sum_p2;
    if (r < rows && src != nullptr) {
      Kt::CpAsync4::copy(*reinterpret_cast<const uint32_t*>(src + row0 + r),
                         *reinterpret_cast<uint32_t*>(srow + e));
    } else {
      srow[e] = 0.f;
    }
  }
}

// Where one (query block, key block) tile sits and what masks it.
struct TileSpot {
  int i0, j0;  // first query row and key of the tile
  int q_len, kv_len;
  KeyPattern pattern;  // the keys each row sees (kCausal instantiations)
  bool edge;  // some element needs a per-element check (a row's range, mask, or a partial block)
  const void* mask;    // mask element (b, h, i0, j0), or null without a mask
  MaskElem mask_elem;  // an additive mask's entry type
  int64_t msi, msj;    // mask strides of a row and a key (0 for broadcast)
};

template <bool kCausal, MaskKind kMask, typename Kt>
CUTE_DEVICE TileSpot tile_spot(const BwdParams<float>& p, int b, int h, int i0, int j0) {
  const int q_len = static_cast<int>(p.q_len), kv_len = static_cast<int>(p.kv_len);
  TileSpot t;
  t.i0 = i0;
  t.j0 = j0;
  t.q_len = q_len;
  t.kv_len = kv_len;
  t.pattern = p.pattern;
  // Partial blocks (keys >= Lk and padding rows >= Lq must get p = 0), keys outside a row's range
  // (key_ranges.cuh) and masks need the per-element check.
  t.edge = kMask != MaskKind::kNone || tile_needs_predicate<kCausal>(p.pattern, i0, j0, Kt::kBlockM,
                                                                     Kt::kBlockN, q_len, kv_len);
  t.mask = nullptr;
  t.mask_elem = p.mask.elem;
  t.msi = p.mask.si;
  t.msj = p.mask.sj;
  if constexpr (kMask != MaskKind::kNone) {
    const int64_t off = p.mask.row_offset(b, h, i0) + j0 * p.mask.sj;
    t.mask = kMask == MaskKind::kBool ? static_cast<const void*>(p.mask.bool_bytes() + off)
             : p.mask.elem != MaskElem::kAcc
                 ? static_cast<const void*>(p.mask.additive_bits() + off)
                 : static_cast<const void*>(p.mask.additive_data() + off);
  }
  return t;
}

// The lines of a tile's mask entries into L1 before S's product, whose scores then read them there
// (mask_words.cuh: prefetch_mask_tile); the main and the dq kernel's, t from tile_spot.
template <MaskKind kMask, typename Kt>
CUTE_DEVICE void prefetch_tile_mask(const BwdParams<float>& p, const TileSpot& t, int b, int h,
                                    int tid) {
  if constexpr (kMask != MaskKind::kNone) {
    prefetch_mask_tile<kMask, typename Kt::Ops, Kt::kBlockM, Kt::kBlockN, Kt::kNThreads>(
        p.mask, p.mask.row_offset(b, h, t.i0) + t.j0 * p.mask.sj, t.q_len - t.i0, t.kv_len - t.j0,
        tid);
  }
}

// Turns raw scores x = q_i . k_j (accumulator layout, viewed by rowcol) into
//   s_ij = lambda_i x (+ additive mask), -inf where masked (causal limit, bool mask, j >= Lk, or a
//          padding row i >= Lq), and p_ij = e^{s_ij - lse_i} = 2^{s log2(e) - lse log2(e)}.
// kKeepLogits: acc keeps s (the entropy gradient needs it); otherwise acc becomes p. kStoreProbs:
// p goes to probs (shared memory, the accumulator's partition of sP) as T for the dV product,
// each pair of adjacent columns as one 32-bit store as soon as it is formed: no copy of P waits
// in registers next to S, dK and dV. A fully masked row (lse = 0, every s = -inf) gets p = 0.
// kDrop: the stored p are the weights after dropout, p z / (1 - p') with z bit r * kCols + c of
// `keep` (dropout_keep_bits); acc keeps the weights before dropout.
template <bool kKeepLogits, bool kStoreProbs, bool kDrop, bool kCausal, MaskKind kMask, typename Kt,
          typename Acc, typename Probs, typename Coord>
CUTE_DEVICE void scores_to_probs(Acc& acc, Probs& probs, Coord const& coord, const float* srow,
                                 const TileSpot& t, [[maybe_unused]] uint32_t keep,
                                 [[maybe_unused]] float keep_scale) {
  using Element = typename Kt::Element;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  constexpr int kRows = decltype(size<0>(acc))::value, kCols = decltype(size<1>(acc))::value;
  static_assert(kCols % 2 == 0 && kRows % 2 == 0);
  // Stores s or p of the adjacent columns (ni, ni + 1) and, converted as a pair, p in probs.
  auto put = [&](int mi, int ni, float s0, float s1, float p0, float p1) {
    acc(mi, ni) = kKeepLogits ? s0 : p0;
    acc(mi, ni + 1) = kKeepLogits ? s1 : p1;
    if constexpr (kDrop) {
      p0 = (keep >> (mi * kCols + ni)) & 1u ? p0 * keep_scale : 0.f;
      p1 = (keep >> (mi * kCols + ni + 1)) & 1u ? p1 * keep_scale : 0.f;
    }
    if constexpr (kStoreProbs) {  // (ni, ni + 1) are adjacent and 4-byte aligned in sP
      cutlass::NumericArrayConverter<Element, float, 2> to_pair;
      *reinterpret_cast<cutlass::Array<Element, 2>*>(raw_pointer_cast(&probs(mi, ni))) =
          to_pair(cutlass::Array<float, 2>{p0, p1});
    }
  };
  if (!t.edge) {  // every key allowed, no mask (kMask == kNone)
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) {
      const int r = get<0>(coord(mi, 0));
      const float lam = srow[Kt::kStatLambda * Kt::kBlockM + r];
      const float bias2 = -srow[Kt::kStatLse * Kt::kBlockM + r] * kLog2e;
      const float scale2 = lam * kLog2e;
      CUTE_UNROLL
      for (int ni = 0; ni < kCols; ni += 2) {
        float s0 = 0.f, s1 = 0.f, p0, p1;
        if constexpr (kKeepLogits) {
          s0 = lam * acc(mi, ni);
          s1 = lam * acc(mi, ni + 1);
          p0 = exp2_approx(fmaf(s0, kLog2e, bias2));
          p1 = exp2_approx(fmaf(s1, kLog2e, bias2));
        } else {
          p0 = exp2_approx(fmaf(acc(mi, ni), scale2, bias2));
          p1 = exp2_approx(fmaf(acc(mi, ni + 1), scale2, bias2));
        }
        put(mi, ni, s0, s1, p0, p1);
      }
    }
    return;
  }
  CUTE_UNROLL
  for (int mi = 0; mi < kRows; ++mi) {
    const int r = get<0>(coord(mi, 0));
    const float lam = srow[Kt::kStatLambda * Kt::kBlockM + r];
    const float bias2 = -srow[Kt::kStatLse * Kt::kBlockM + r] * kLog2e;
    const int i = t.i0 + r;
    // Keys [j0 + lo, j0 + hi) are allowed by the row's range and Lk; none for a padding row.
    const KeyRange keys = row_keys<kCausal>(t.pattern, i, t.q_len, t.kv_len);
    const int lo = static_cast<int>(keys.lo) - t.j0, hi = static_cast<int>(keys.hi) - t.j0;
    // The mask row from the thread's first column: the others are at compile-time distances.
    const int c0 = get<1>(coord(mi, 0));
    const int64_t mrow = r * t.msi + c0 * t.msj;
    auto logit = [&](int ni) {
      const int c = get<1>(coord(mi, ni));
      float s = kNegInf;
      if (c >= lo && c < hi) {  // the mask is read only inside [0, Lq) x [0, Lk)
        const float x = acc(mi, ni);
        const int64_t off = mrow + (c - c0) * t.msj;
        if constexpr (kMask == MaskKind::kBool) {
          if (static_cast<const uint8_t*>(t.mask)[off] != 0) s = lam * x;
        } else if constexpr (kMask == MaskKind::kAdditive) {
          // -inf hides the key whatever its score (a NaN key must not give NaN + -inf = NaN).
          const float m = load_additive_mask<typename Kt::Input>(t.mask, t.mask_elem, off);
          if (m != kNegInf) s = fmaf(lam, x, m);
        } else {
          s = lam * x;
        }
      }
      return s;
    };
    CUTE_UNROLL
    for (int ni = 0; ni < kCols; ni += 2) {
      const float s0 = logit(ni), s1 = logit(ni + 1);
      put(mi, ni, s0, s1, exp2_approx(fmaf(s0, kLog2e, bias2)),
          exp2_approx(fmaf(s1, kLog2e, bias2)));  // 2^-inf = 0
    }
  }
}

// dP (accumulator layout, rowcol view) -> dS = logit_grad(p, dP, s, delta, g) (online_stats.h,
// docs/math.md section 3), 0 where p = 0 (masked or underflowed: no 0 * inf from s = -inf).
// kGrads: acc_s holds the logits s and p is recomputed exactly as scores_to_probs formed it;
// otherwise acc_s holds p and the entropy / sum p^2 terms are absent (g = 0). cap_k: 1 / c of a
// softcapped call (kGrads), whose dS the cap's derivative 1 - (s / c)^2 multiplies, else 0.
// kDrop: dP is that of the weights after dropout; the weights before it have dP z / (1 - p'), z
// bit r * kCols + c of `keep` (docs/math.md section 6).
template <bool kGrads, bool kDrop, typename Kt, typename AccS, typename AccDP, typename Coord>
CUTE_DEVICE void probs_to_dlogits(AccS const& acc_s, AccDP& acc_dp, Coord const& coord,
                                  const float* srow, [[maybe_unused]] float cap_k,
                                  [[maybe_unused]] uint32_t keep,
                                  [[maybe_unused]] float keep_scale) {
  constexpr int kCols = decltype(size<1>(acc_dp))::value;
  CUTE_UNROLL
  for (int mi = 0; mi < size<0>(acc_dp); ++mi) {
    const int r = get<0>(coord(mi, 0));
    const float delta = srow[Kt::kStatDelta * Kt::kBlockM + r];
    RowGrads<float> g;  // g_lse enters through delta only
    float bias2 = 0.f;
    if constexpr (kGrads) {
      g.g_entropy = srow[Kt::kStatGH * Kt::kBlockM + r];
      g.g_sum_p2 = srow[Kt::kStatGU * Kt::kBlockM + r];
      bias2 = -srow[Kt::kStatLse * Kt::kBlockM + r] * kLog2e;
    }
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(acc_dp); ++ni) {
      float pr, s = 0.f, cap_grad = 1.f;
      if constexpr (kGrads) {
        s = acc_s(mi, ni);
        pr = exp2_approx(fmaf(s, kLog2e, bias2));
        const float th = s * cap_k;  // (NaN where s = -inf: unused, p = 0 there)
        cap_grad = 1.f - th * th;
      } else {
        pr = acc_s(mi, ni);
      }
      float dp = acc_dp(mi, ni);
      if constexpr (kDrop) dp = (keep >> (mi * kCols + ni)) & 1u ? dp * keep_scale : 0.f;
      const float ds = kGrads ? logit_grad(pr, dp, s, delta, g) * cap_grad
                              : logit_grad(pr, dp, delta);  // (an FFMA less per entry)
      acc_dp(mi, ni) = pr != 0.f ? ds : 0.f;
    }
  }
}

// Logit softcapping (docs/math.md section 6): raw scores x (accumulator layout, rowcol view) become
// the scores whose scaled logits lambda_i x' are the capped ones (cute_utils.cuh: softcap_row, as
// the forward).
template <typename Kt, typename Acc, typename Coord>
CUTE_DEVICE void cap_scores(Acc& acc, Coord const& coord, const float* srow,
                            const Softcap<float>& cap) {
  CUTE_UNROLL
  for (int mi = 0; mi < size<0>(acc); ++mi) {
    const float lam = srow[Kt::kStatLambda * Kt::kBlockM + get<0>(coord(mi, 0))];
    const SoftcapRow cr = softcap_row(lam, 1.f, cap.cap, cap.inv_cap);
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(acc); ++ni) {
      acc(mi, ni) = cr.out * tanh_of_exp2(acc(mi, ni) * cr.in);
    }
  }
}

// The bits of `keep` (dropout_keep_bits over kCols columns) of column part `part` (kPartCols
// columns), renumbered r * kPartCols + c as that part's rowcol view counts its elements.
template <int kCols, int kPartCols, int kRows>
CUTE_HOST_DEVICE uint32_t part_keep_bits(uint32_t keep, int part) {
  uint32_t bits = 0;
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    bits |= ((keep >> (r * kCols + part * kPartCols)) & ((1u << kPartCols) - 1u))
            << (r * kPartCols);
  }
  return bits;
}

// ---------------------------------------------------------------------------------------------
// Preprocess: delta_i (docs/math.md section 3), kPreThreadsPerRow threads per row, 16-byte loads.
// Grid (ceil(Lq / kPreRows), H, B).
template <typename Kt>
CUTE_DEVICE void preprocess_block(const BwdParams<float>& p) {
  using Element = typename Kt::Element;
  constexpr int kTpr = Kt::kPreThreadsPerRow;
  const int h = blockIdx.y, b = blockIdx.z;
  const int i = static_cast<int>(blockIdx.x) * Kt::kPreRows + static_cast<int>(threadIdx.x) / kTpr;
  const int lane = static_cast<int>(threadIdx.x) % kTpr;
  const bool valid = i < p.q_len;
  float dot = 0.f;
  if (valid) {
    const Element* o = static_cast<const Element*>(p.out.data) + b * p.out.sb + h * p.out.sh +
                       i * p.out.sl + lane * 8;
    const Element* d_o = static_cast<const Element*>(p.dout.data) + b * p.dout.sb + h * p.dout.sh +
                         i * p.dout.sl + lane * 8;
    Tensor ro = make_tensor<Element>(Shape<_8>{});
    Tensor rdo = make_tensor<Element>(Shape<_8>{});
    cute::copy(AutoVectorizingCopyWithAssumedAlignment<128>{},
               make_tensor(make_gmem_ptr(o), Shape<_8>{}), ro);
    cute::copy(AutoVectorizingCopyWithAssumedAlignment<128>{},
               make_tensor(make_gmem_ptr(d_o), Shape<_8>{}), rdo);
    CUTE_UNROLL
    for (int e = 0; e < 8; ++e) dot += static_cast<float>(ro(e)) * static_cast<float>(rdo(e));
  }
  CUTE_UNROLL
  for (int o = kTpr / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
  if (valid && lane == 0) {
    const int64_t row = (static_cast<int64_t>(b) * p.heads + h) * p.q_len + i;
    RowGrads<float> g;
    g.g_lse = p.g_lse ? p.g_lse[row] : 0.f;
    g.g_entropy = p.g_entropy ? p.g_entropy[row] : 0.f;
    g.g_sum_p2 = p.g_sum_p2 ? p.g_sum_p2[row] : 0.f;
    const float entropy = p.entropy ? p.entropy[row] : 0.f;
    const float sum_p2 = p.sum_p2 ? p.sum_p2[row] : 0.f;
    p.delta[row] = row_delta(dot, g, p.lse[row], entropy, sum_p2);
  }
}

// ---------------------------------------------------------------------------------------------
// Main kernel: one CTA per (key block, kv head, batch), grid (ceil(Lk / kBlockN), Hkv, B).
template <typename Kt, bool kCausal, MaskKind kMask>
CUTE_DEVICE void main_block(const BwdParams<float>& p, char* smem) {
  using Element = typename Kt::Element;
  constexpr int kBlockM = Kt::kBlockM, kBlockN = Kt::kBlockN, kD = Kt::kHeadDim;
  const int tid = threadIdx.x;
  // Key block 0 is the heaviest of a causal call (every row sees it): blocks are dispatched in
  // order, and launch_order.h puts every head's first x before any head's second.
  const GridTile at = this_block_tile<kCausal, kMask>(p.launch_sections);
  const int n_block = at.x, kvh = at.y, b = at.z;
  const int q_len = static_cast<int>(p.q_len), kv_len = static_cast<int>(p.kv_len);
  const int heads = static_cast<int>(p.heads), group = heads / static_cast<int>(p.kv_heads);
  const int j0 = n_block * kBlockN;
  const int kv_rows = cute::min(kBlockN, kv_len - j0);
  // The query blocks whose rows may see a key of this block (top-left causality: rows from j0 on).
  const BlockRange mb =
      query_blocks<kCausal>(p.pattern, q_len, kv_len, j0, cute::min(j0 + kBlockN, kv_len), kBlockM);
  const int m_begin = mb.begin, m_count = cute::max(mb.end - mb.begin, 0);
  const int iters = group * m_count;  // (query head, query block) pairs, head-major
  // Softcapping keeps the logits too (the cap's derivative is formed from them).
  const bool capped = kCausal && p.softcap.on();  // (the general instantiations)
  const float cap_k = capped ? p.softcap.inv_cap : 0.f;
  const bool grads = p.g_entropy != nullptr || p.g_sum_p2 != nullptr || capped;
  const bool dropping = kCausal && p.dropout.on();  // (the general instantiations)
  const float keep_scale = p.dropout.keep_scale;
  const bool atomic_dq = !p.deterministic;

  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem + Kt::kMainQ)),
                          typename Kt::SmemLayoutQ{});
  Tensor sQl = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem + Kt::kMainQl)),
                           typename Kt::SmemLayoutQ{});
  Tensor sQlt = make_tensor(sQl.data(), typename Kt::SmemLayoutQt{});
  // dO in two buffers: dO of t + 1 lands while t's products read dO of t. Buffer 1 is buffer 0's
  // tensors moved by a whole tile (a multiple of the swizzle period: the same layout). The compact
  // tiles have one.
  constexpr int kTileQ = kBlockM * kD;
  Tensor sdO = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem + Kt::kMaindO)),
                           typename Kt::SmemLayoutQ{});
  Tensor sdOt = make_tensor(sdO.data(), typename Kt::SmemLayoutQt{});
  auto in_do_buffer = [&](auto const& tensor, int t) {
    return make_tensor(tensor.data() + (Kt::kDoBuffers == 2 ? t & 1 : 0) * kTileQ, tensor.layout());
  };
  Tensor sK = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem + Kt::kMainK)),
                          typename Kt::SmemLayoutKV{});
  Tensor sKt = make_tensor(sK.data(), typename Kt::SmemLayoutKt{});
  Tensor sV = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem + Kt::kMainV)),
                          typename Kt::SmemLayoutKV{});
  Tensor sP = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem + Kt::kMainP)),
                          typename Kt::SmemLayoutPdS{});
  Tensor sPt = make_tensor(sP.data(), typename Kt::SmemLayoutPdSt{});
  Tensor sdS = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem + Kt::kMaindS)),
                           typename Kt::SmemLayoutPdS{});
  Tensor sdSt = make_tensor(sdS.data(), typename Kt::SmemLayoutPdSt{});
  float* srow = reinterpret_cast<float*>(smem + Kt::kMainRows);

  // Global -> shared copies.
  typename Kt::GmemTiledCopy gmem_copy;
  auto gthr = gmem_copy.get_thread_slice(tid);
  Tensor tQcQ = gthr.partition_D(make_identity_tensor(Shape<Int<kBlockM>, Int<kD>>{}));
  Tensor tKcK = gthr.partition_D(make_identity_tensor(Shape<Int<kBlockN>, Int<kD>>{}));
  Tensor tQsQ = gthr.partition_D(sQ);
  Tensor tQsQl = gthr.partition_D(sQl);
  Tensor tdOsdO = gthr.partition_D(sdO);

  const int64_t kv_off = static_cast<int64_t>(b) * p.k.sb + static_cast<int64_t>(kvh) * p.k.sh;
  const int64_t v_off = static_cast<int64_t>(b) * p.v.sb + static_cast<int64_t>(kvh) * p.v.sh;
  Tensor gK =
      make_tensor(make_gmem_ptr(static_cast<const Element*>(p.k.data) + kv_off + j0 * p.k.sl),
                  Shape<Int<kBlockN>, Int<kD>>{}, make_stride(p.k.sl, _1{}));
  Tensor gV =
      make_tensor(make_gmem_ptr(static_cast<const Element*>(p.v.data) + v_off + j0 * p.v.sl),
                  Shape<Int<kBlockN>, Int<kD>>{}, make_stride(p.v.sl, _1{}));

  // Query head and first row of iteration t (head-major over the GQA group).
  auto head_of = [&](int t) { return kvh * group + t / m_count; };
  auto row_of = [&](int t) { return (m_begin + t % m_count) * kBlockM; };
  auto load_q = [&](int t) {
    const int h = head_of(t), i0 = row_of(t);
    Tensor gQ = make_tensor(make_gmem_ptr(static_cast<const Element*>(p.q.data) + b * p.q.sb +
                                          h * p.q.sh + i0 * p.q.sl),
                            Shape<Int<kBlockM>, Int<kD>>{}, make_stride(p.q.sl, _1{}));
    copy_rows(gmem_copy, gthr.partition_S(gQ), tQsQ, tQcQ, q_len - i0);
    load_row_stats<Kt>(p, srow, (static_cast<int64_t>(b) * heads + h) * q_len + i0, q_len - i0);
  };
  auto load_do = [&](int t) {
    const int h = head_of(t), i0 = row_of(t);
    Tensor gdO = make_tensor(make_gmem_ptr(static_cast<const Element*>(p.dout.data) +
                                           b * p.dout.sb + h * p.dout.sh + i0 * p.dout.sl),
                             Shape<Int<kBlockM>, Int<kD>>{}, make_stride(p.dout.sl, _1{}));
    copy_rows(gmem_copy, gthr.partition_S(gdO), in_do_buffer(tdOsdO, t), tQcQ, q_len - i0);
  };

  // Products. S and dP: (rows, keys); dV and dK: (keys, D) from transposed P, dS, dO, lambda Q;
  // G: (rows, D) from dS and transposed K.
  typename Kt::TiledMmaSdP mma_sdp;
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  Tensor tSrQ = thr_sdp.partition_fragment_A(sQ);
  Tensor tSrK = thr_sdp.partition_fragment_B(sK);
  Tensor tdPrdO = thr_sdp.partition_fragment_A(sdO);
  auto copy_a_sdp = make_tiled_copy_A(typename Kt::SmemCopyAtom{}, mma_sdp);
  auto thr_a_sdp = copy_a_sdp.get_thread_slice(tid);
  auto copy_b_sdp = make_tiled_copy_B(typename Kt::SmemCopyAtom{}, mma_sdp);
  auto thr_b_sdp = copy_b_sdp.get_thread_slice(tid);
  Tensor tSsQ = thr_a_sdp.partition_S(sQ);
  Tensor tdPsdO = thr_a_sdp.partition_S(sdO);
  Tensor tSsK = thr_b_sdp.partition_S(sK);
  Tensor tPsP = thr_sdp.partition_C(sP);
  Tensor sP_rc = make_tensor(tPsP.data(), rowcol(tPsP.layout()));
  Tensor cS = make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{});
  Tensor tScS = thr_sdp.partition_C(cS);
  Tensor coord_s = make_tensor(tScS.data(), rowcol(tScS.layout()));
  // dP and dS by column parts of kBlockN / kDpParts keys.
  using PartS = Shape<Int<kBlockM>, Int<kBlockN / Kt::kDpParts>>;
  using PartKV = Shape<Int<kBlockN / Kt::kDpParts>, Int<kD>>;
  Tensor tdPrVp = thr_sdp.partition_fragment_B(local_tile(sV, PartKV{}, make_coord(_0{}, _0{})));

  typename Kt::TiledMmadKV mma_dkv;
  auto thr_dkv = mma_dkv.get_thread_slice(tid);
  // Register operands shared by dV and dK: P^T or dS^T (keys, rows); dO^T or (lambda Q)^T (D,
  // rows).
  Tensor tdKVrA = thr_dkv.partition_fragment_A(
      make_tensor(sPt.data(), get_nonswizzle_portion(typename Kt::SmemLayoutPdSt{})));
  Tensor tdKVrB = thr_dkv.partition_fragment_B(
      make_tensor(sdOt.data(), get_nonswizzle_portion(typename Kt::SmemLayoutQt{})));
  auto copy_a_dkv = make_tiled_copy_A(typename Kt::SmemCopyAtomT{}, mma_dkv);
  auto thr_a_dkv = copy_a_dkv.get_thread_slice(tid);
  auto copy_b_dkv = make_tiled_copy_B(typename Kt::SmemCopyAtomT{}, mma_dkv);
  auto thr_b_dkv = copy_b_dkv.get_thread_slice(tid);
  Tensor tdVsPt = thr_a_dkv.partition_S(sPt);
  Tensor tdKsdSt = thr_a_dkv.partition_S(sdSt);
  Tensor tdVsdOt = thr_b_dkv.partition_S(sdOt);
  Tensor tdKsQlt = thr_b_dkv.partition_S(sQlt);
  Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kD>>{});
  Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kD>>{});

  // G = dS K by column parts of kD / kDqParts (the D columns of G: K^T's rows).
  using PartDq = Shape<Int<kBlockM>, Int<kD / Kt::kDqParts>>;
  using PartKt = Shape<Int<kD / Kt::kDqParts>, Int<kBlockN>>;
  typename Kt::TiledMmadQ mma_dq;
  auto thr_dq = mma_dq.get_thread_slice(tid);
  Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);
  Tensor tdQrKt = thr_dq.partition_fragment_B(
      local_tile(make_tensor(sKt.data(), get_nonswizzle_portion(typename Kt::SmemLayoutKt{})),
                 PartKt{}, make_coord(_0{}, _0{})));
  auto copy_a_dq = make_tiled_copy_A(typename Kt::SmemCopyAtom{}, mma_dq);
  auto thr_a_dq = copy_a_dq.get_thread_slice(tid);
  auto copy_b_dq = make_tiled_copy_B(typename Kt::SmemCopyAtomT{}, mma_dq);
  auto thr_b_dq = copy_b_dq.get_thread_slice(tid);
  Tensor tdQsdS = thr_a_dq.partition_S(sdS);
  Tensor cdQ = make_identity_tensor(Shape<Int<kBlockM>, Int<kD>>{});

  clear(acc_dk);
  clear(acc_dv);

  // Prologue: K, V, and the first Q, row statistics and dO.
  if (iters > 0) {
    copy_rows(gmem_copy, gthr.partition_S(gK), gthr.partition_D(sK), tKcK, kv_rows);
    copy_rows(gmem_copy, gthr.partition_S(gV), gthr.partition_D(sV), tKcK, kv_rows);
    load_q(0);
    load_do(0);
    Kt::Ops::cp_async_fence();
  }

  CUTE_NO_UNROLL
  for (int t = 0; t < iters; ++t) {
    const int h = head_of(t), i0 = row_of(t);
    const TileSpot spot = tile_spot<kCausal, kMask, Kt>(p, b, h, i0, j0);
    Kt::Ops::cp_async_wait_all();
    __syncthreads();  // Q, dO and the row statistics of t have landed; t - 1 read all it needed
    prefetch_tile_mask<kMask, Kt>(p, spot, b, h, tid);
    Tensor tdPsdO_t = in_do_buffer(tdPsdO, t);
    Tensor tdVsdOt_t = in_do_buffer(tdVsdOt, t);

    // lambda Q for dK += dS^T (lambda Q) (docs/math.md section 3: dK_j = sum_i lambda_i dS_ij q_i;
    // lambda must not go into dS, whose unscaled G gives d lambda even where lambda = 0). Each
    // thread scales the chunks it copied; they are read after the next barrier.
    CUTE_UNROLL
    for (int m = 0; m < size<1>(tQsQ); ++m) {
      const float lam = srow[Kt::kStatLambda * kBlockM + get<0>(tQcQ(0, m, 0))];
      CUTE_UNROLL
      for (int k = 0; k < size<2>(tQsQ); ++k) {
        Tensor frag = make_fragment_like(tQsQ(_, m, k));
        cute::copy(tQsQ(_, m, k), frag);
        CUTE_UNROLL
        for (int e = 0; e < size(frag); ++e) {
          frag(e) = static_cast<Element>(static_cast<float>(frag(e)) * lam);
        }
        cute::copy(frag, tQsQl(_, m, k));
      }
    }

    // The tile's dropout decisions, drawn before S holds registers (next to it, the masked
    // kernels spill at D = 128).
    uint32_t keep = 0;
    if (dropping) {
      keep =
          dropout_keep_bits<false>(p.dropout, static_cast<int64_t>(b) * heads + h, i0, j0, coord_s);
    }

    // S = Q K^T, then s and p in registers; P to shared memory as T for dV += P^T dO.
    Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
    clear(acc_s);
    gemm_smem(acc_s, tSrQ, tSrK, tSsQ, tSsK, mma_sdp, copy_a_sdp, thr_a_sdp, copy_b_sdp, thr_b_sdp);
    Tensor s_rc = make_tensor(acc_s.data(), rowcol(acc_s.layout()));
    if (capped) cap_scores<Kt>(s_rc, coord_s, srow, p.softcap);
    // Uniform branches: keep s for the entropy term or the cap's derivative; dropout.
    auto to_probs = [&](auto keep_logits, auto drop) {
      scores_to_probs<decltype(keep_logits)::value, true, decltype(drop)::value, kCausal, kMask,
                      Kt>(s_rc, sP_rc, coord_s, srow, spot, keep, keep_scale);
    };
    if (grads) {
      dropping ? to_probs(std::true_type{}, std::true_type{})
               : to_probs(std::true_type{}, std::false_type{});
    } else {
      dropping ? to_probs(std::false_type{}, std::true_type{})
               : to_probs(std::false_type{}, std::false_type{});
    }

    // dP = dO V^T, then dS = logit_grad(...) to shared memory as T, in kDpParts column parts.
    for_each(make_int_sequence<Kt::kDpParts>{}, [&](auto part) {
      Tensor tdPsVp = thr_b_sdp.partition_S(local_tile(sV, PartKV{}, make_coord(part, _0{})));
      Tensor acc_dp = partition_fragment_C(mma_sdp, PartS{});
      clear(acc_dp);
      gemm_smem(acc_dp, tdPrdO, tdPrVp, tdPsdO_t, tdPsVp, mma_sdp, copy_a_sdp, thr_a_sdp,
                copy_b_sdp, thr_b_sdp);
      // acc_s is compact (4, MMA_M, MMA_N) and a part's columns are whole MMA_N slices: its s or
      // p are the registers [part * size(acc_dp), (part + 1) * size(acc_dp)) of acc_s.
      Tensor s_rc_p = make_tensor(acc_s.data() + part * size(acc_dp), rowcol(acc_dp.layout()));
      Tensor dp_rc = make_tensor(acc_dp.data(), rowcol(acc_dp.layout()));
      Tensor tc = thr_sdp.partition_C(local_tile(cS, PartS{}, make_coord(_0{}, part)));
      Tensor coord_p = make_tensor(tc.data(), rowcol(tc.layout()));
      constexpr int kRowsS = decltype(size<0>(s_rc))::value;
      constexpr int kColsS = decltype(size<1>(s_rc))::value;
      const uint32_t keep_p =
          part_keep_bits<kColsS, kColsS / Kt::kDpParts, kRowsS>(keep, decltype(part)::value);
      auto to_dlogits = [&](auto with_grads, auto drop) {
        constexpr bool kGrads = decltype(with_grads)::value;
        probs_to_dlogits<kGrads, decltype(drop)::value, Kt>(
            s_rc_p, dp_rc, coord_p, srow, kGrads ? cap_k : 0.f, keep_p, keep_scale);
      };
      if (grads) {
        dropping ? to_dlogits(std::true_type{}, std::true_type{})
                 : to_dlogits(std::true_type{}, std::false_type{});
      } else {
        dropping ? to_dlogits(std::false_type{}, std::true_type{})
                 : to_dlogits(std::false_type{}, std::false_type{});
      }
      // With the mask's gradient: the part's fp32 dS in its S registers, which nothing reads
      // again, for add_logit_grads after the last part (inside a part at D = 128, with dP's half
      // and the next part's S live, the atomics' addresses spilled).
      if constexpr (kMask == MaskKind::kAdditive) {
        if (p.d_logits.data != nullptr) {
          cute::copy(acc_dp, make_tensor(acc_s.data() + part * size(acc_dp), acc_dp.layout()));
        }
      }
      cute::copy(convert_fragment<Element>(acc_dp),
                 thr_sdp.partition_C(local_tile(sdS, PartS{}, make_coord(_0{}, part))));
    });
    if constexpr (kMask == MaskKind::kAdditive) {
      if (p.d_logits.data != nullptr) {
        add_logit_grads(p.d_logits, b, h, i0, j0, q_len, kv_len, s_rc, coord_s);
      }
    }
    __syncthreads();  // P, dS, lambda Q visible; Q and the row statistics of t no longer read

    if (t + 1 < iters) {  // overlaps the three products below; dO of t - 1 was read before the
      load_q(t + 1);      // barrier at the top of t
      if constexpr (Kt::kDoBuffers == 2) load_do(t + 1);
      Kt::Ops::cp_async_fence();
    }

    // dV += P^T dO
    gemm_smem(acc_dv, tdKVrA, tdKVrB, tdVsPt, tdVsdOt_t, mma_dkv, copy_a_dkv, thr_a_dkv, copy_b_dkv,
              thr_b_dkv);
    if constexpr (Kt::kDoBuffers == 1) {
      if (t + 1 < iters) {  // (uniform) dV was the last reader of dO of t
        __syncthreads();
        load_do(t + 1);
        Kt::Ops::cp_async_fence();
      }
    }

    // G += dS K, accumulated over the key blocks by fp32 atomics (deterministic: the dq kernel).
    if (atomic_dq) {
      float* dq_accum = p.dq_accum + ((static_cast<int64_t>(b) * heads + h) * q_len + i0) * kD;
      for_each(make_int_sequence<Kt::kDqParts>{}, [&](auto part) {
        Tensor tdQsKt = thr_b_dq.partition_S(local_tile(sKt, PartKt{}, make_coord(part, _0{})));
        Tensor tdQcdQ = thr_dq.partition_C(local_tile(cdQ, PartDq{}, make_coord(_0{}, part)));
        Tensor acc_dq = partition_fragment_C(mma_dq, PartDq{});
        clear(acc_dq);
        gemm_smem(acc_dq, tdQrdS, tdQrKt, tdQsdS, tdQsKt, mma_dq, copy_a_dq, thr_a_dq, copy_b_dq,
                  thr_b_dq);
        CUTE_UNROLL
        for (int mi = 0; mi < size<1>(acc_dq); ++mi) {
          CUTE_UNROLL
          for (int ni = 0; ni < size<2>(acc_dq); ++ni) {
            CUTE_UNROLL
            for (int v = 0; v < 4; v += 2) {  // (v, v + 1): adjacent columns of one row
              const int r = get<0>(tdQcdQ(v, mi, ni)), c = get<1>(tdQcdQ(v, mi, ni));
              if (i0 + r < q_len) {
                atomic_add_pair(dq_accum + r * kD + c, acc_dq(v, mi, ni), acc_dq(v + 1, mi, ni));
              }
            }
          }
        }
      });
    }

    // dK += dS^T (lambda Q)
    gemm_smem(acc_dk, tdKVrA, tdKVrB, tdKsdSt, tdKsQlt, mma_dkv, copy_a_dkv, thr_a_dkv, copy_b_dkv,
              thr_b_dkv);
  }

  // Epilogue: dK and dV (zero for a key block no query row sees) through shared memory (over K
  // and V, which the last products may still read: barrier) to 16-byte stores of rows < Lk.
  Kt::Ops::cp_async_wait_all();
  __syncthreads();
  cute::copy(convert_fragment<Element>(acc_dk), thr_dkv.partition_C(sK));
  cute::copy(convert_fragment<Element>(acc_dv), thr_dkv.partition_C(sV));
  __syncthreads();
  typename Kt::VecTiledCopy vec_copy;
  auto vthr = vec_copy.get_thread_slice(tid);
  // (dk and dv in the host's strides: each in its input's layout, rows 16-byte aligned.)
  Tensor gdK =
      make_tensor(make_gmem_ptr(static_cast<Element*>(p.dk_out.data) + p.dk_out.offset(b, kvh, j0)),
                  Shape<Int<kBlockN>, Int<kD>>{}, make_stride(p.dk_out.sl, _1{}));
  Tensor gdV =
      make_tensor(make_gmem_ptr(static_cast<Element*>(p.dv_out.data) + p.dv_out.offset(b, kvh, j0)),
                  Shape<Int<kBlockN>, Int<kD>>{}, make_stride(p.dv_out.sl, _1{}));
  Tensor tdKsdK = vthr.partition_S(sK);
  Tensor tdVsdV = vthr.partition_S(sV);
  Tensor tdKgdK = vthr.partition_D(gdK);
  Tensor tdVgdV = vthr.partition_D(gdV);
  Tensor tdKVc = vthr.partition_D(make_identity_tensor(Shape<Int<kBlockN>, Int<kD>>{}));
  Tensor rdK = make_fragment_like(tdKsdK);
  Tensor rdV = make_fragment_like(tdVsdV);
  cute::copy(vec_copy, tdKsdK, rdK);
  cute::copy(vec_copy, tdVsdV, rdV);
  // Whether a key row came out non-finite: the block products form 0 * NaN for a hidden row's
  // NaN, so the fallback recomputes such calls by the hidden-keys rule (params.h: nonfinite).
  bool nonfinite = false;
  CUTE_UNROLL
  for (int m = 0; m < size<1>(rdK); ++m) {
    if (get<0>(tdKVc(0, m, 0)) < kv_rows) {
      CUTE_UNROLL
      for (int e = 0; e < size(rdK(_, m, _)); ++e) {
        nonfinite |= !is_finite(static_cast<float>(rdK(_, m, _)(e))) ||
                     !is_finite(static_cast<float>(rdV(_, m, _)(e)));
      }
      cute::copy(vec_copy, rdK(_, m, _), tdKgdK(_, m, _));
      cute::copy(vec_copy, rdV(_, m, _), tdVgdV(_, m, _));
    }
  }
  if (nonfinite && p.nonfinite != nullptr) *p.nonfinite = 1;  // (all store the same value)
}

// ---------------------------------------------------------------------------------------------
// Deterministic G: one CTA per (query block, query head, batch), grid (ceil(Lq / kBlockM), H, B),
// looping over the key blocks the rows see, in a fixed order and without atomics: G goes to
// dq_accum with plain stores. Per key block: dP = dO V^T (V landed first), S = Q K^T, dS, G += dS
// K.
template <typename Kt, bool kCausal, MaskKind kMask>
CUTE_DEVICE void dq_block(const BwdParams<float>& p, char* smem) {
  using Element = typename Kt::Element;
  constexpr int kBlockM = Kt::kBlockM, kBlockN = Kt::kBlockN, kD = Kt::kHeadDim;
  const int tid = threadIdx.x;
  // Causal query blocks further down walk more key blocks: start them first (blocks are
  // dispatched in order), as the forward does, so that the short ones fill the tail of the wave.
  const int m_block = kCausal ? static_cast<int>(gridDim.x - 1 - blockIdx.x) : blockIdx.x;
  const int h = blockIdx.y, b = blockIdx.z;
  const int q_len = static_cast<int>(p.q_len), kv_len = static_cast<int>(p.kv_len);
  const int heads = static_cast<int>(p.heads);
  const int kvh = h / (heads / static_cast<int>(p.kv_heads));
  const int i0 = m_block * kBlockM;
  const int q_rows = cute::min(kBlockM, q_len - i0);
  // The key blocks the rows see (key_ranges.cuh).
  const TileBlocks tb = tile_key_blocks<kCausal>(p.pattern, i0, q_rows, q_len, kv_len, kBlockN);
  const int n_begin = tb.n_begin, n_end = tb.n_end;
  // Softcapping keeps the logits too (the cap's derivative is formed from them).
  const bool capped = kCausal && p.softcap.on();  // (the general instantiations)
  const float cap_k = capped ? p.softcap.inv_cap : 0.f;
  const bool grads = p.g_entropy != nullptr || p.g_sum_p2 != nullptr || capped;
  const bool dropping = kCausal && p.dropout.on();  // (the general instantiations)
  const float keep_scale = p.dropout.keep_scale;

  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem + Kt::kDqQ)),
                          typename Kt::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem + Kt::kDqdO)),
                           typename Kt::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem + Kt::kDqK)),
                          typename Kt::SmemLayoutKV{});
  Tensor sKt = make_tensor(sK.data(), typename Kt::SmemLayoutKt{});
  Tensor sV = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem + Kt::kDqV)),
                          typename Kt::SmemLayoutKV{});
  Tensor sdS = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem + Kt::kDqdS)),
                           typename Kt::SmemLayoutPdS{});
  float* srow = reinterpret_cast<float*>(smem + Kt::kDqRows);

  typename Kt::GmemTiledCopy gmem_copy;
  auto gthr = gmem_copy.get_thread_slice(tid);
  Tensor tQcQ = gthr.partition_D(make_identity_tensor(Shape<Int<kBlockM>, Int<kD>>{}));
  Tensor tKcK = gthr.partition_D(make_identity_tensor(Shape<Int<kBlockN>, Int<kD>>{}));
  Tensor tKsK = gthr.partition_D(sK);
  Tensor tVsV = gthr.partition_D(sV);
  const int64_t k_off = static_cast<int64_t>(b) * p.k.sb + static_cast<int64_t>(kvh) * p.k.sh;
  const int64_t v_off = static_cast<int64_t>(b) * p.v.sb + static_cast<int64_t>(kvh) * p.v.sh;
  auto load_k = [&](int n) {
    Tensor gK = make_tensor(
        make_gmem_ptr(static_cast<const Element*>(p.k.data) + k_off + n * kBlockN * p.k.sl),
        Shape<Int<kBlockN>, Int<kD>>{}, make_stride(p.k.sl, _1{}));
    copy_rows(gmem_copy, gthr.partition_S(gK), tKsK, tKcK, kv_len - n * kBlockN);
  };
  auto load_v = [&](int n) {
    Tensor gV = make_tensor(
        make_gmem_ptr(static_cast<const Element*>(p.v.data) + v_off + n * kBlockN * p.v.sl),
        Shape<Int<kBlockN>, Int<kD>>{}, make_stride(p.v.sl, _1{}));
    copy_rows(gmem_copy, gthr.partition_S(gV), tVsV, tKcK, kv_len - n * kBlockN);
  };

  typename Kt::TiledMmaSdP mma_sdp;
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  Tensor tSrQ = thr_sdp.partition_fragment_A(sQ);
  Tensor tSrK = thr_sdp.partition_fragment_B(sK);
  Tensor tdPrdO = thr_sdp.partition_fragment_A(sdO);
  Tensor tdPrV = thr_sdp.partition_fragment_B(sV);
  auto copy_a_sdp = make_tiled_copy_A(typename Kt::SmemCopyAtom{}, mma_sdp);
  auto thr_a_sdp = copy_a_sdp.get_thread_slice(tid);
  auto copy_b_sdp = make_tiled_copy_B(typename Kt::SmemCopyAtom{}, mma_sdp);
  auto thr_b_sdp = copy_b_sdp.get_thread_slice(tid);
  Tensor tSsQ = thr_a_sdp.partition_S(sQ);
  Tensor tdPsdO = thr_a_sdp.partition_S(sdO);
  Tensor tSsK = thr_b_sdp.partition_S(sK);
  Tensor tdPsV = thr_b_sdp.partition_S(sV);
  Tensor tdSsdS = thr_sdp.partition_C(sdS);
  Tensor tScS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor coord_s = make_tensor(tScS.data(), rowcol(tScS.layout()));

  typename Kt::TiledMmadQ mma_dq;
  auto thr_dq = mma_dq.get_thread_slice(tid);
  Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);
  Tensor tdQrKt = thr_dq.partition_fragment_B(
      make_tensor(sKt.data(), get_nonswizzle_portion(typename Kt::SmemLayoutKt{})));
  auto copy_a_dq = make_tiled_copy_A(typename Kt::SmemCopyAtom{}, mma_dq);
  auto thr_a_dq = copy_a_dq.get_thread_slice(tid);
  auto copy_b_dq = make_tiled_copy_B(typename Kt::SmemCopyAtomT{}, mma_dq);
  auto thr_b_dq = copy_b_dq.get_thread_slice(tid);
  Tensor tdQsdS = thr_a_dq.partition_S(sdS);
  Tensor tdQsKt = thr_b_dq.partition_S(sKt);
  Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kD>>{});
  clear(acc_dq);

  // Prologue: Q, dO, row statistics and V of block 0 (group 1), K of block 0 (group 2).
  const int64_t bh = static_cast<int64_t>(b) * heads + h;
  const int64_t row0 = bh * q_len + i0;
  Tensor gQ = make_tensor(
      make_gmem_ptr(static_cast<const Element*>(p.q.data) + b * p.q.sb + h * p.q.sh + i0 * p.q.sl),
      Shape<Int<kBlockM>, Int<kD>>{}, make_stride(p.q.sl, _1{}));
  Tensor gdO = make_tensor(make_gmem_ptr(static_cast<const Element*>(p.dout.data) + b * p.dout.sb +
                                         h * p.dout.sh + i0 * p.dout.sl),
                           Shape<Int<kBlockM>, Int<kD>>{}, make_stride(p.dout.sl, _1{}));
  copy_rows(gmem_copy, gthr.partition_S(gQ), gthr.partition_D(sQ), tQcQ, q_rows);
  copy_rows(gmem_copy, gthr.partition_S(gdO), gthr.partition_D(sdO), tQcQ, q_rows);
  load_row_stats<Kt>(p, srow, row0, q_rows);
  if (n_end > n_begin) load_v(n_begin);
  Kt::Ops::cp_async_fence();
  if (n_end > n_begin) load_k(n_begin);
  Kt::Ops::cp_async_fence();

  CUTE_NO_UNROLL
  for (int n = n_begin; n < n_end; ++n) {
    const int j0 = n * kBlockN;
    const TileSpot spot = tile_spot<kCausal, kMask, Kt>(p, b, h, i0, j0);
    prefetch_tile_mask<kMask, Kt>(p, spot, b, h, tid);
    // The tile's dropout decisions, drawn before dP and S hold registers (as the main kernel).
    uint32_t keep = 0;
    if (dropping) keep = dropout_keep_bits<false>(p.dropout, bh, i0, j0, coord_s);
    // All but the newest group (K of n): V of n, and Q, dO at n = 0.
    Kt::Ops::template cp_async_wait<1>();
    __syncthreads();
    Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
    clear(acc_dp);
    gemm_smem(acc_dp, tdPrdO, tdPrV, tdPsdO, tdPsV, mma_sdp, copy_a_sdp, thr_a_sdp, copy_b_sdp,
              thr_b_sdp);
    Kt::Ops::cp_async_wait_all();
    __syncthreads();  // K of n landed; every warp is done with V of n
    if (n + 1 < n_end) load_v(n + 1);
    Kt::Ops::cp_async_fence();  // possibly empty: keeps the group count of the waits above

    Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
    clear(acc_s);
    gemm_smem(acc_s, tSrQ, tSrK, tSsQ, tSsK, mma_sdp, copy_a_sdp, thr_a_sdp, copy_b_sdp, thr_b_sdp);
    Tensor s_rc = make_tensor(acc_s.data(), rowcol(acc_s.layout()));
    Tensor dp_rc = make_tensor(acc_dp.data(), rowcol(acc_dp.layout()));
    if (capped) cap_scores<Kt>(s_rc, coord_s, srow, p.softcap);
    // P is not needed in shared memory here: dropout enters through dP alone.
    auto to_dlogits = [&](auto with_grads, auto drop) {
      constexpr bool kGrads = decltype(with_grads)::value;
      scores_to_probs<kGrads, false, false, kCausal, kMask, Kt>(s_rc, s_rc, coord_s, srow, spot, 0u,
                                                                0.f);
      probs_to_dlogits<kGrads, decltype(drop)::value, Kt>(s_rc, dp_rc, coord_s, srow,
                                                          kGrads ? cap_k : 0.f, keep, keep_scale);
    };
    if (grads) {
      dropping ? to_dlogits(std::true_type{}, std::true_type{})
               : to_dlogits(std::true_type{}, std::false_type{});
    } else {
      dropping ? to_dlogits(std::false_type{}, std::true_type{})
               : to_dlogits(std::false_type{}, std::false_type{});
    }
    cute::copy(convert_fragment<Element>(acc_dp), tdSsdS);
    __syncthreads();  // dS visible

    gemm_smem(acc_dq, tdQrdS, tdQrKt, tdQsdS, tdQsKt, mma_dq, copy_a_dq, thr_a_dq, copy_b_dq,
              thr_b_dq);
    __syncthreads();  // every warp is done with K of n and with dS
    if (n + 1 < n_end) load_k(n + 1);
    Kt::Ops::cp_async_fence();
  }

  // (A block whose rows see no key ran no iteration: its copies end here.)
  Kt::Ops::cp_async_wait_all();

  // G of the rows < Lq, plain stores (this CTA owns them).
  Tensor tdQcdQ = thr_dq.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kD>>{}));
  float* dq_accum = p.dq_accum + row0 * kD;
  CUTE_UNROLL
  for (int mi = 0; mi < size<1>(acc_dq); ++mi) {
    CUTE_UNROLL
    for (int ni = 0; ni < size<2>(acc_dq); ++ni) {
      CUTE_UNROLL
      for (int v = 0; v < 4; v += 2) {
        const int r = get<0>(tdQcdQ(v, mi, ni)), c = get<1>(tdQcdQ(v, mi, ni));
        if (r < q_rows) {
          *reinterpret_cast<float2*>(dq_accum + r * kD + c) =
              make_float2(acc_dq(v, mi, ni), acc_dq(v + 1, mi, ni));
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Postprocess: dq_i = lambda_i G_i (T) and, where asked for (d_row_scale), d lambda_i = q_i . G_i
// (docs/math.md section 3: s_ij = lambda_i q_i . k_j), 4 elements per thread; G in dq_accum as
// p.dq_layout says (the Hopper family's main kernel runs between this family's pre- and
// postprocess; with g_scaled its G is lambda_i G_i, dq itself). Grid (ceil(Lq / kPostRows), H, B).
template <typename Kt>
CUTE_DEVICE void postprocess_block(const BwdParams<float>& p) {
  using Element = typename Kt::Element;
  constexpr int kTpr = Kt::kPostThreadsPerRow;
  const int h = blockIdx.y, b = blockIdx.z;
  const int i = static_cast<int>(blockIdx.x) * Kt::kPostRows + static_cast<int>(threadIdx.x) / kTpr;
  const int lane = static_cast<int>(threadIdx.x) % kTpr;
  const bool valid = i < p.q_len;
  const int64_t row = (static_cast<int64_t>(b) * p.heads + h) * p.q_len + i;
  // G's row in dq_accum: packed from the sm80 kernels, padded from the Hopper bulk reductions
  // (params.h: DqAccumLayout; its rows are multiples of 4 floats, so float4 loads stay aligned).
  const int64_t g_row = p.dq_layout.offset(static_cast<int64_t>(b) * p.heads + h, i);
  const bool want_dot = p.d_row_scale != nullptr;
  float dot = 0.f;
  if (valid) {
    const float lam = p.g_scaled ? 1.f : p.row_scale[row];
    // A non-finite dq row (a hidden key's NaN in dS K gives one): the fallback recomputes the call
    // (params.h: nonfinite).
    bool nonfinite = false;
    CUTE_UNROLL
    for (int step = 0; step < Kt::kPostSteps; ++step) {
      const int col = (step * kTpr + lane) * 4;
      const float4 g = *reinterpret_cast<const float4*>(p.dq_accum + g_row + col);
      if (want_dot) {  // (q is read only for d lambda)
        const Element* q =
            static_cast<const Element*>(p.q.data) + b * p.q.sb + h * p.q.sh + i * p.q.sl + col;
        Tensor rq = make_tensor<Element>(Shape<_4>{});
        cute::copy(AutoVectorizingCopyWithAssumedAlignment<64>{},
                   make_tensor(make_gmem_ptr(q), Shape<_4>{}), rq);
        dot += static_cast<float>(rq(0)) * g.x + static_cast<float>(rq(1)) * g.y +
               static_cast<float>(rq(2)) * g.z + static_cast<float>(rq(3)) * g.w;
      }
      Tensor rdq = make_tensor<Element>(Shape<_4>{});
      rdq(0) = static_cast<Element>(lam * g.x);
      rdq(1) = static_cast<Element>(lam * g.y);
      rdq(2) = static_cast<Element>(lam * g.z);
      rdq(3) = static_cast<Element>(lam * g.w);
      cute::copy(AutoVectorizingCopyWithAssumedAlignment<64>{}, rdq,
                 make_tensor(make_gmem_ptr(static_cast<Element*>(p.dq_out.data) +
                                           p.dq_out.offset(b, h, i) + col),
                             Shape<_4>{}));
      CUTE_UNROLL
      for (int e = 0; e < 4; ++e) nonfinite |= !is_finite(static_cast<float>(rdq(e)));
    }
    if (nonfinite && p.nonfinite != nullptr) *p.nonfinite = 1;
  }
  if (!want_dot) return;
  CUTE_UNROLL
  for (int o = kTpr / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
  if (valid && lane == 0) {
    p.d_row_scale[row] = dot;
    if (!is_finite(dot) && p.nonfinite != nullptr) *p.nonfinite = 1;
  }
}

// ---------------------------------------------------------------------------------------------
// Kernels. The main and dq kernels run one 256-thread CTA per SM (shared memory), so
// __launch_bounds__(256, 1) lets ptxas use up to 255 registers per thread.
template <typename Kt>
__global__ void __launch_bounds__(Kt::kNThreads) preprocess_kernel(const BwdParams<float> p) {
  preprocess_block<Kt>(p);
}

template <typename Kt, bool kCausal, MaskKind kMask>
__global__ void __launch_bounds__(Kt::kNThreads, 1) main_kernel(const BwdParams<float> p) {
  extern __shared__ __align__(128) char smem[];
  main_block<Kt, kCausal, kMask>(p, smem);
}

template <typename Kt, bool kCausal, MaskKind kMask>
__global__ void __launch_bounds__(Kt::kNThreads, 1) dq_kernel(const BwdParams<float> p) {
  extern __shared__ __align__(128) char smem[];
  dq_block<Kt, kCausal, kMask>(p, smem);
}

template <typename Kt>
__global__ void __launch_bounds__(Kt::kNThreads) postprocess_kernel(const BwdParams<float> p) {
  postprocess_block<Kt>(p);
}

}  // namespace entropy_attn::cuda::sm80::bwd
