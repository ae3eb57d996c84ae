// Forward kernel of the tensor-core family (sm_80 and newer, bf16/fp16): FlashAttention-2's
// structure, written with CuTe, plus the per-row statistics of docs/math.md section 2.
//
// One thread block of 4 warps owns a tile of kBlockM = 128 query rows of one (batch, head); each
// warp owns two 16-row slices (rows 16w..16w+15 and 64+16w..64+16w+15: the TiledMMA below; the
// masked kernels at D = 128 use 64-row tiles, one slice per warp). Per key block of kBlockN keys:
//   S = Q K^T           mma.sync m16n8k16, Q and K read from swizzled shared memory by ldmatrix,
//                       fp32 accumulators in registers;
//   y = lambda_i log2(e) S (+ log2(e) mask)    the logits in log2 units, one FMUL per score;
//   online softmax      row max over the 4 lanes that share a row (2 shuffles), the running sums
//                       rescaled by alpha = 2^(m_old - m_new) (online_stats.h: rescale), then
//                       e = 2^(y - m) (one MUFU.EX2) and l, t, u accumulated per thread;
//   O = alpha O + P V   P converted to T in registers and fed to the mma as the A operand, V read
//                       by transposed ldmatrix.
// K and V tiles arrive by 16-byte cp.async in two buffers, as in FlashAttention-2: V of block n is
// loaded while S = Q K^T of block n runs, K of the next block while the softmax and P V of block n
// run. Key blocks are visited from the last to the first, so that the blocks that need the
// causal / sequence-end predicate (the last partial block and the blocks crossing the diagonal)
// come first and the loop over the others carries no predicate.
//
// The instantiations compiled with causality (kCausal) take any KeyPattern that restricts a row's
// keys (key_ranges.cuh: causality, a sliding window, either alignment, packed documents): a row
// sees [lo_i, hi_i), the tile loads only the key blocks of [lo of its first row, hi of its last),
// and the blocks a window's lower edge or a document boundary crosses are predicated too (they
// come last). They are the general instantiations: they also take the calls with softcap, sinks or
// dropout whatever their pattern, so that the others, the plain full attention, carry none of that
// code.
// Attention sinks set each row's initial state (online_stats.h: initial_state); logit
// softcapping replaces a block's scores by those whose scaled logits are the capped ones before
// its softmax; dropout zeroes the dropped weights of P after the statistics took them, those of
// each k-step of P V just before it (cute_utils.cuh: dropout_decisions_of_columns, one Philox call
// per 8 weights), and scales O by 1 / (1 - p') at the end (uniform branches, so the kernels
// without them stay as they were).
//
// The statistics: l, t, u are sums over keys, linear in their terms, so every thread keeps partial
// sums over its own columns and the 4 lanes of a row are added once at the end; the row's state
// is then finished by online_stats.h (finalize<float, Log2>, derive). Without kStats nothing of t
// and u exists in the kernel.
//
// Registers are the binding constraint: the output accumulator alone is 128 fp32 registers per
// thread at D = 128 (a 128 x 128 tile over 128 threads), and ptxas hoists every ldmatrix of a
// product as far as registers allow. Hence the tiles below, the per-row scales and the mask tile in
// shared memory, the opaque() row indices and the recomputed epilogue indices: each removes
// values that would otherwise live across the key loop and spill.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <limits>
#include <type_traits>

#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>
#include <cute/tensor.hpp>

#include "../../kernel_args.h"
#include "../../online_stats.h"
#include "../cute_utils.cuh"
#include "../key_ranges.cuh"
#include "../launch_order.h"
#include "../mask_words.cuh"
#include "../params.h"
#include "../row_statistics.cuh"
#include "ops.cuh"

namespace entropy_attn::cuda::sm80 {
namespace fwd_impl {

using namespace cute;

// Tile traits. 128 query rows over 4 warps, so that every K and V fragment read from shared
// memory feeds two m16 mma (shared-memory bandwidth; FlashAttention-2 measured 8 warps slower).
// Keys per block: 32 at D = 128 and 64 at D = 64, the "or" tiles of FlashAttention-2 (its sm86
// choice at D = 128). Its A100/H100 tiles (128 x 64 at D = 128, 128 x 128 at D = 64) need 192
// accumulator registers per thread (O and S) and spill with nvcc 13, as FlashAttention-2's own
// kernels do; the statistics need registers on top. Shared memory: Q 32 KB + K 8 KB + V 8 KB at
// D = 128, 16 + 8 + 8 KB at D = 64, plus the row scales and, with a mask, its tile; the 255
// registers per thread allow 2 blocks (8 warps) per SM.
//
// D = 256 (Gemma's head dim) takes 64 x 32 tiles, one 16-row slice per warp: the output
// accumulator is then 128 registers per thread again (64 x 256 over 128 threads), S 16, and shared
// memory Q 32 KB + K 16 KB + V 16 KB, within two blocks per SM on an A100. (FlashAttention-2's
// 128 x 64 tile over 8 warps holds the same per thread but one block per SM, 128 KB.)
// Ops: the instructions (ops.cuh).
template <typename T, int kHeadDim_, MaskKind kMask, bool kStats, typename Ops_ = Sm80Ops>
struct FwdTraits {
  using Input = T;  // __nv_bfloat16 or __half (a 16-bit additive mask's type too)
  using Element = typename ::entropy_attn::cuda::CuteElement<T>::type;
  using Ops = Ops_;
  static constexpr int kHeadDim = kHeadDim_;
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256,
                "head dims of the tensor-core family");
  // A masked kernel at D = 128 needs registers for the mask on top (and is bound by the mask's
  // memory traffic anyway): 64 x 64 tiles there, one 16-row slice per warp.
  static constexpr bool kSmallTile = kHeadDim == 128 && kMask != MaskKind::kNone;
  static constexpr int kBlockM = kSmallTile || kHeadDim == 256 ? 64 : 128;
  static constexpr int kBlockN = kHeadDim == 64 || kSmallTile ? 64 : 32;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  // Two blocks (8 warps) per SM: the register budget stays 255 per thread. Without a minimum,
  // ptxas may cap registers to reach three blocks of the small masked tiles and spill.
  static constexpr int kMinBlocksPerSm = 2;

  using MmaAtom = MMA_Atom<typename Ops::template Mma<Element>>;
  // Warps stacked along M; the 16-wide N tile makes one ldmatrix.x4 feed two n8 atoms.
  using TiledMma =
      TiledMMA<MmaAtom, Layout<Shape<Int<kWarps>, _1, _1>>, Tile<Int<16 * kWarps>, _16, _16>>;

  // Shared memory: rows of 64 elements (128 bytes) with the 16-byte chunks XOR-swizzled by the
  // row index (Swizzle<3, 3, 3>), so that both the 16-byte cp.async writes of 8 consecutive rows
  // and the ldmatrix reads of 8 rows hit 8 different bank groups.
  using SmemLayoutAtom =
      decltype(composition(Swizzle<3, 3, 3>{}, Layout<Shape<_8, _64>, Stride<_64, _1>>{}));
  using SmemLayoutQ =
      decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutKV =
      decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // V seen as (D, keys): the B operand of O = P V, read with transposed ldmatrix.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, GenRowMajor{})));
  using SmemLayoutVtNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutVt{}));

  using SmemCopyAtom = Copy_Atom<typename Ops::LdsmN, Element>;
  using SmemCopyAtomTransposed = Copy_Atom<typename Ops::LdsmT, Element>;
  using SmemCopyAtomO = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<128>, Element>;

  // Global <-> shared: 8 threads per 64-element row segment, 16 bytes (8 elements) each, so a warp
  // moves four whole 128-byte lines. The host guarantees 16-byte aligned bases and row strides
  // that are multiples of 8 elements.
  using GmemLayoutAtom = Layout<Shape<Int<kThreads / 8>, _8>, Stride<_8, _1>>;
  using GmemTiledCopyQKV = decltype(make_tiled_copy(Copy_Atom<typename Ops::CpAsync16, Element>{},
                                                    GmemLayoutAtom{}, Layout<Shape<_1, _8>>{}));
  using GmemTiledCopyO =
      decltype(make_tiled_copy(Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<128>, Element>{},
                               GmemLayoutAtom{}, Layout<Shape<_1, _8>>{}));

  // The mask tile of a key block, one 32-bit word per score (the float of a float32 additive mask,
  // or the aligned word that holds a bool or a 16-bit entry), rows padded by 8 words: the reads of
  // the accumulator layout (8 rows x 4 lanes x 2 adjacent columns per warp, LDS.64) then hit every
  // bank once per half warp.
  static constexpr int kMaskLd = kBlockN + 8;

  // Shared memory, in bytes.
  static constexpr int kSmemQ = kBlockM * kHeadDim;  // elements
  static constexpr int kSmemKV = kBlockN * kHeadDim;
  static constexpr int kOffRowScale = (kSmemQ + 2 * kSmemKV) * static_cast<int>(sizeof(Element));
  static constexpr int kOffMask = kOffRowScale + kBlockM * 4;
  static constexpr int kOffStats =
      kOffMask + (kMask == MaskKind::kNone ? 0 : kBlockM * kMaskLd * 4);
  // With kStats: each thread's partial t and u of its rows (kStatRows), kept here rather than in
  // 8 registers; read and written once per key block, conflict-free (word = slot * 128 + tid).
  static constexpr int kStatRows = 2 * kBlockM / (16 * kWarps);
  static constexpr int kSmemBytes = kOffStats + (kStats ? kStatRows * 2 * kThreads * 4 : 0);
  // Two blocks per SM on an A100 (164 KB): 81 KB each at most.
  static_assert(kSmemBytes <= 81 * 1024);
};

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// An accumulator fragment (MMA = (2 cols, 2 rows), MMA_M, MMA_N) viewed as (rows, cols): rows
// ((2, MMA_M)) are the thread's accumulator rows, cols ((2, MMA_N)) its columns of each row.
template <typename Layout>
CUTE_HOST_DEVICE constexpr auto acc_rowcol(Layout const& acc) {
  static_assert(decltype(size<0>(acc))::value == 4 && decltype(rank(acc))::value == 3);
  auto l = logical_divide(acc, Shape<_2>{});  // ((2, 2), MMA_M, MMA_N)
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)), make_layout(get<0, 0>(l), get<2>(l)));
}

// An accumulator fragment of S (MMA = 4, MMA_M, MMA_N) as the A operand of P V: the C fragments of
// two adjacent n8 tiles of m16n8k16 hold exactly the A fragment of one k16 step, so P never leaves
// the registers. Result: ((4, 2), MMA_M, MMA_N / 2).
template <typename Layout>
CUTE_HOST_DEVICE constexpr auto acc_as_a(Layout const& acc) {
  static_assert(decltype(size<0>(acc))::value == 4 && decltype(rank(acc))::value == 3);
  auto l = logical_divide(acc, Shape<Underscore, Underscore, _2>{});  // (4, MMA_M, (2, MMA_N/2))
  return make_layout(make_layout(get<0>(l), get<2, 0>(l)), get<1>(l), get<2, 1>(l));
}

// Loads the rows [row0, row0 + rows) of a row-major global tile (row stride ld elements, unit
// column stride) into the thread's part `dst` of a shared tile (partitioned by GmemTiledCopyQKV;
// `coord` holds each vector's (row, col) in the tile), 16 bytes per cp.async (CpAsync16:
// ops.cuh). Rows >= rows are zero-filled with ordinary stores: zero K rows give finite scores
// (masked anyway), zero V rows keep 0 * garbage = NaN out of P V.
template <typename CpAsync16, typename Element, typename Dst, typename Coord>
__device__ __forceinline__ void load_rows(Dst dst, Coord const& coord, const Element* gmem,
                                          int64_t ld, int row0, int rows) {
  const int row_base = opaque(row0);
  CUTE_UNROLL
  for (int m = 0; m < size<1>(dst); ++m) {
    const int row = get<0>(coord(0, m, 0));
    if (row < rows) {
      const Element* src = gmem + static_cast<int64_t>(row_base + row) * ld;
      CUTE_UNROLL
      for (int k = 0; k < size<2>(dst); ++k) {
        CpAsync16::copy(*reinterpret_cast<const cute::uint128_t*>(src + get<1>(coord(0, m, k))),
                        *reinterpret_cast<cute::uint128_t*>(raw_pointer_cast(dst(_, m, k).data())));
      }
    } else {
      clear(dst(_, m, _));
    }
  }
}

// Loads the mask words (mask_words.cuh) of tile rows [0, rows) and keys [j0, j0 + cols) into the
// shared mask tile (kBlockM x kMaskLd words), issued with V so that they overlap S = Q K^T. A
// thread owns one key column (consecutive threads, consecutive keys: coalesced for a
// key-contiguous mask) and every (kThreads / kBlockN)-th row. Entries not loaded (padding rows,
// keys >= cols) hold stale values that no allowed score reads.
template <typename Kt, MaskKind kMask>
__device__ __forceinline__ void load_mask_tile(uint32_t* s_mask, const MaskArg<float>& mask, int b,
                                               int h, int m0, int rows, int j0, int cols) {
  constexpr int kBlockM = Kt::kBlockM, kBlockN = Kt::kBlockN;
  constexpr int kRowStep = Kt::kThreads / kBlockN;
  static_assert(Kt::kThreads % kBlockN == 0 && kBlockM % kRowStep == 0);
  const int col = threadIdx.x % kBlockN, row_first = threadIdx.x / kBlockN;
  if (col >= cols) return;
  int64_t off = mask.row_offset(b, h, m0 + row_first) + (j0 + col) * mask.sj;
  const int64_t step = kRowStep * mask.si;
  uint32_t* dst = s_mask + row_first * Kt::kMaskLd + col;
#pragma unroll 8
  for (int r = row_first; r < kBlockM; r += kRowStep, off += step, dst += kRowStep * Kt::kMaskLd) {
    if (r < rows) Kt::Ops::CpAsync4::copy(*mask_word<kMask>(mask, off), *dst);
  }
}

// acc += A B with both operands in shared memory (a_view / b_view: the register fragments retiled
// for the copy atoms). Each k-step loads its A fragment, then B one ldmatrix.x4 (two n8 tiles) at
// a time before the mma that use it; ptxas hoists the loads as far as registers allow.
template <typename Acc, typename FragA, typename FragB, typename ViewA, typename ViewB,
          typename SmemA, typename SmemB, typename TiledMma, typename CopyA, typename CopyB>
__device__ __forceinline__ void gemm_ss(Acc& acc, FragA& a, FragB& b, ViewA& a_view, ViewB& b_view,
                                        SmemA const& s_a, SmemB const& s_b,
                                        TiledMma const& tiled_mma, CopyA const& copy_a,
                                        CopyB const& copy_b) {
  static_assert(decltype(size<1>(b))::value == 2 * decltype(size<1>(b_view))::value);
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    copy(copy_a, s_a(_, _, k), a_view(_, _, k));
    CUTE_UNROLL
    for (int g = 0; g < size<1>(b_view); ++g) {
      copy(copy_b, s_b(_, g, k), b_view(_, g, k));
      CUTE_UNROLL
      for (int m = 0; m < size<1>(a); ++m) {
        CUTE_UNROLL
        for (int n = 2 * g; n < 2 * g + 2; ++n) {
          cute::gemm(tiled_mma, a(_, m, k), b(_, n, k), acc(_, m, n));
        }
      }
    }
  }
}

// acc += A B with A in registers (P) and B in shared memory (V), B loaded as in gemm_ss. Each
// k-step first calls before_k(k), which may still change A's k-slice (dropout).
template <typename Acc, typename FragA, typename FragB, typename ViewB, typename SmemB,
          typename TiledMma, typename CopyB, typename BeforeK>
__device__ __forceinline__ void gemm_rs(Acc& acc, FragA const& a, FragB& b, ViewB& b_view,
                                        SmemB const& s_b, TiledMma const& tiled_mma,
                                        CopyB const& copy_b, BeforeK const& before_k) {
  static_assert(decltype(size<1>(b))::value == 2 * decltype(size<1>(b_view))::value);
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    before_k(k);
    CUTE_UNROLL
    for (int g = 0; g < size<1>(b_view); ++g) {
      copy(copy_b, s_b(_, g, k), b_view(_, g, k));
      CUTE_UNROLL
      for (int m = 0; m < size<1>(a); ++m) {
        CUTE_UNROLL
        for (int n = 2 * g; n < 2 * g + 2; ++n) {
          cute::gemm(tiled_mma, a(_, m, k), b(_, n, k), acc(_, m, n));
        }
      }
    }
  }
}

// Grid: (query tiles, heads, batch). p is __grid_constant__: the kernel reads it in place (the
// member functions of MaskArg and ScalePolicy take its address) instead of copying it to local
// memory.
template <typename Kt, bool kCausal, MaskKind kMask, bool kStats>
__global__ void __launch_bounds__(Kt::kThreads, Kt::kMinBlocksPerSm)
    forward_kernel(const __grid_constant__ FwdParams<float> p) {
  using Element = typename Kt::Element;
  constexpr int kBlockM = Kt::kBlockM, kBlockN = Kt::kBlockN, kHeadDim = Kt::kHeadDim;
  constexpr int kBlockThreads = Kt::kThreads;
  constexpr bool kHasMask = kMask != MaskKind::kNone;
  using CpAsync16 = typename Kt::Ops::CpAsync16;
  extern __shared__ __align__(128) char ea_sm80_fwd_smem[];

  const int tid = threadIdx.x;
  // With split-KV (p.num_splits > 1; the general instantiations only, which the host picks for a
  // split call: family.cpp) the grid's x holds the query tiles of every split, split-major.
  // The block's grid coordinates in the launch order of launch_order.h.
  const GridTile at = this_block_tile<kCausal, kMask>(p.launch_sections);
  const int tiles = static_cast<int>(gridDim.x) / (kCausal ? p.num_splits : 1);
  const int split = kCausal ? at.x / tiles : 0;
  const int tile = kCausal ? at.x % tiles : at.x;
  // Causal tiles further down do more work: start them first (blocks are dispatched in order, and
  // the launch order puts every head's first x before any head's second), so that the short ones
  // fill the tail of the wave.
  const int m_block = kCausal ? tiles - 1 - tile : tile;
  const int h = at.y, b = at.z;
  // Sequence lengths fit in int (a 2^31-key head would hold 256 GB of K at D = 64).
  const int q_len = static_cast<int>(p.q_len), kv_len = static_cast<int>(p.kv_len);
  const int heads = static_cast<int>(p.heads);
  const int kv_head = h / (heads / static_cast<int>(p.kv_heads));  // GQA
  const int m0 = m_block * kBlockM;
  const int rows = min(kBlockM, q_len - m0);  // valid query rows of this tile
  // The key blocks the tile walks and those that need the predicate (key_ranges.cuh); with
  // split-KV, this split's contiguous part of them. A tile whose rows see no key here
  // (tb.n_end <= tb.n_begin) loads nothing and writes empty rows (an empty state).
  TileBlocks tb = tile_key_blocks<kCausal>(p.pattern, m0, rows, q_len, kv_len, kBlockN);
  if (kCausal && p.num_splits > 1) {
    const int per = (max(tb.n_end - tb.n_begin, 0) + p.num_splits - 1) / p.num_splits;
    tb.n_begin += split * per;
    tb.n_end = min(tb.n_end, tb.n_begin + per);
  }
  const int kv_end = tb.key_end;

  // Global tiles; offsets in 64 bits (b * sb can exceed 2^31 elements).
  const Element* q_ptr = static_cast<const Element*>(p.q.data) + b * p.q.sb + h * p.q.sh +
                         static_cast<int64_t>(m0) * p.q.sl;
  // The (b, kv_head) slices of K and V; inside the key loop recomputed per tile from an opaque
  // kv_head rather than held as two 64-bit pointers.
  auto kv_slice = [&](const View4& t, int kvh) {
    return static_cast<const Element*>(t.data) + b * t.sb + kvh * t.sh;
  };

  Element* smem = reinterpret_cast<Element*>(ea_sm80_fwd_smem);
  Tensor sQ = make_tensor(make_smem_ptr(smem), typename Kt::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(smem + Kt::kSmemQ), typename Kt::SmemLayoutKV{});
  Tensor sV =
      make_tensor(make_smem_ptr(smem + Kt::kSmemQ + Kt::kSmemKV), typename Kt::SmemLayoutKV{});
  Tensor sVt = make_tensor(sV.data(), typename Kt::SmemLayoutVt{});
  Tensor sVtNoSwizzle = make_tensor(sV.data().get(), typename Kt::SmemLayoutVtNoSwizzle{});
  // lambda_i log2(e) per tile row, and the mask tile.
  float* s_row_scale = reinterpret_cast<float*>(ea_sm80_fwd_smem + Kt::kOffRowScale);
  uint32_t* s_mask = reinterpret_cast<uint32_t*>(ea_sm80_fwd_smem + Kt::kOffMask);
  // This thread's partial t (slot 2r) and u (slot 2r + 1) of its rows r (kStats).
  float* s_tu = reinterpret_cast<float*>(ea_sm80_fwd_smem + Kt::kOffStats) + tid;

  // The thread's 16-byte vectors of the Q, K and V tiles (GmemTiledCopyQKV's partition) and their
  // (row, col) in the tile.
  auto gmem_thr_copy = typename Kt::GmemTiledCopyQKV{}.get_thread_slice(tid);
  Tensor tQsQ = gmem_thr_copy.partition_D(sQ);
  Tensor tKsK = gmem_thr_copy.partition_D(sK);
  Tensor tVsV = gmem_thr_copy.partition_D(sV);
  Tensor tQcQ =
      gmem_thr_copy.partition_D(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tKVcKV =
      gmem_thr_copy.partition_D(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));

  // Prologue: Q and the last K block in flight while the rows are set up. Q's padding rows are
  // zero (finite scores in rows that are never written).
  load_rows<CpAsync16>(tQsQ, tQcQ, q_ptr, p.q.sl, 0, rows);
  if (tb.n_end > tb.n_begin) {
    load_rows<CpAsync16>(tKsK, tKVcKV, kv_slice(p.k, kv_head), p.k.sl, (tb.n_end - 1) * kBlockN,
                         kv_end - (tb.n_end - 1) * kBlockN);
  }
  Kt::Ops::cp_async_fence();

  typename Kt::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tid);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);             // (MMA, MMA_M, MMA_K)
  Tensor tSrK = thr_mma.partition_fragment_B(sK);             // (MMA, MMA_N, MMA_K)
  Tensor tOrVt = thr_mma.partition_fragment_B(sVtNoSwizzle);  // (MMA, MMA_D, MMA_Keys)
  Tensor acc_o = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kHeadDim>>{});

  auto smem_tiled_copy_q = make_tiled_copy_A(typename Kt::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_copy_q = smem_tiled_copy_q.get_thread_slice(tid);
  Tensor tSsQ = smem_thr_copy_q.partition_S(sQ);
  Tensor tSrQ_view = smem_thr_copy_q.retile_D(tSrQ);
  auto smem_tiled_copy_k = make_tiled_copy_B(typename Kt::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_copy_k = smem_tiled_copy_k.get_thread_slice(tid);
  Tensor tSsK = smem_thr_copy_k.partition_S(sK);
  Tensor tSrK_view = smem_thr_copy_k.retile_D(tSrK);
  auto smem_tiled_copy_v = make_tiled_copy_B(typename Kt::SmemCopyAtomTransposed{}, tiled_mma);
  auto smem_thr_copy_v = smem_tiled_copy_v.get_thread_slice(tid);
  Tensor tOsVt = smem_thr_copy_v.partition_S(sVt);
  Tensor tOrVt_view = smem_thr_copy_v.retile_D(tOrVt);

  // (row, col) in the tile of every score accumulator, viewed as (thread rows, columns).
  Tensor tScS = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
  // The thread's rows: 16w + g + {0, 8, 64, 72} (g = lane / 4; {0, 8} in 64-row tiles).
  constexpr int kRows = decltype(size<0>(tScS_rc))::value;
  static_assert(kRows == Kt::kStatRows);
  constexpr int kCols = decltype(size<1>(tScS_rc))::value;
  const int quad_lane = tid % 4;

  // The mask with its kind fixed at compile time, so that MaskArg's accessors drop the other
  // kinds' branches.
  MaskArg<float> mask = p.mask;
  mask.kind = kMask;

  // With a mask, n_i is the count of the row's allowed keys in its range, needed before any score
  // (lambda_i depends on it). Each warp counts its own rows, the 8 rows of one thread-row
  // index at a time: the lanes stride the keys (coalesced for a key-contiguous mask) with 8 loads
  // in flight per step, then one warp sum per row. The counts go through the (still unused) mask
  // tile's shared memory to the lanes that own the rows.
  [[maybe_unused]] int* s_count = reinterpret_cast<int*>(s_mask);
  if constexpr (kHasMask) {
    const int lane = tid % 32, quad = lane / 4;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int base = get<0>(tScS_rc(r, 0)) - quad;  // tile row of quad 0's row r
      int lo[8], hi[8], count[8];
      int64_t off[8];
      int lo_min = kv_len, hi_max = 0;
      CUTE_UNROLL
      for (int g = 0; g < 8; ++g) {
        const int i = m0 + base + g;
        const KeyRange keys = row_keys<kCausal>(p.pattern, i, q_len, kv_len);
        lo[g] = static_cast<int>(keys.lo), hi[g] = static_cast<int>(keys.hi);
        off[g] = mask.row_offset(b, h, i);
        count[g] = 0;
        lo_min = min(lo_min, lo[g]);
        hi_max = max(hi_max, hi[g]);
      }
#pragma unroll 2
      for (int j = lo_min + lane; j < hi_max; j += 32) {
        CUTE_UNROLL
        for (int g = 0; g < 8; ++g) {
          count[g] += j >= lo[g] && j < hi[g] && mask.counts(off[g], j);
        }
      }
      CUTE_UNROLL
      for (int g = 0; g < 8; ++g) {
        CUTE_UNROLL
        for (int o = 16; o > 0; o >>= 1) count[g] += __shfl_xor_sync(0xffffffffu, count[g], o);
        if (lane == 0) s_count[base + g] = count[g];
      }
    }
    __syncwarp();
  }

  // Row setup (docs/math.md section 1): n_i, g(n_i) / temperature and lambda_i. Padding rows
  // (i >= q_len) get lambda 0 and are never written.
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const int i = m0 + get<0>(tScS_rc(r, 0));
    const bool valid = i < q_len;
    int n = 0;
    if (valid) {
      const KeyRange keys = row_keys<kCausal>(p.pattern, i, q_len, kv_len);
      n = kHasMask ? s_count[i - m0] : static_cast<int>(keys.hi - keys.lo);
    }
    const float factor = p.scale.factor(n);
    const float lam = valid ? p.scale.lambda(b, h, i, factor) : 0.f;
    if (quad_lane == 0) {
      s_row_scale[i - m0] = lam * kLog2e;
      if (valid && split == 0) {
        const int64_t row = (static_cast<int64_t>(b) * heads + h) * q_len + i;
        p.row_scale[row] = lam;
        p.length_factor[row] = factor;
        p.n_keys[row] = n;
      }
    }
  }

  // Online state per thread row: m (the row max in log2 units, equal over the row's 4 lanes) and
  // this thread's partial l, t, u (docs/math.md section 2); t and u in s_tu. With an attention
  // sink every row starts as if it had seen the sink's entry (online_stats.h: initial_state): m =
  // the sink in all 4 lanes, its e^0 = 1 in l and u of one lane only, so that the quad sums count
  // it once. (A finite sink stays finite in log2 units: |sink| log2(e) may pass FLT_MAX.)
  RowStats<float> init;
  // (With split-KV the first split alone holds the sink.)
  if (kCausal && p.sinks != nullptr && split == 0) {  // (the general instantiations: see below)
    constexpr float kMax = std::numeric_limits<float>::max();
    const float sink = p.sinks[h];
    // (Infinite and NaN sinks stay so: initial_state treats them as the fallback does.)
    init = initial_state(true, is_finite(sink) ? fminf(fmaxf(sink * kLog2e, -kMax), kMax) : sink);
    if (quad_lane != 0) init.l = init.u = 0.f;
  }
  float row_m[kRows], row_l[kRows];
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    row_m[r] = init.m, row_l[r] = init.l;
    if constexpr (kStats) {
      s_tu[2 * r * kBlockThreads] = init.t;
      s_tu[(2 * r + 1) * kBlockThreads] = init.u;
    }
  }

  Tensor o_rc = make_tensor(acc_o.data(), acc_rowcol(acc_o.layout()));

  const bool capped = kCausal && p.softcap.on();  // the same in every block of a call

  // One key block. kPredicated: apply the row's range lo_i <= j < hi_i (causality, window,
  // alignment, documents, sequence end). Always inlined: called twice, the general kernels' block
  // with a mask, statistics and dropout is big enough that the compiler would make it a function,
  // whose calls hold the accumulators on the stack.
  auto key_block = [&](const int n, auto predicated) __attribute__((always_inline)) {
    constexpr bool kPredicated = decltype(predicated)::value;
    const int j0 = n * kBlockN;
    // Row indices and mask offsets from an opaque m0 and b: recomputed here, not carried from
    // the row setup.
    const int m0_k = opaque(m0), b_k = opaque(b);
    Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
    clear(acc_s);
    Kt::Ops::template cp_async_wait<0>();  // K of block n (and Q)
    __syncthreads();  // ... visible to all; every warp done with block n + 1 (sV, mask free)
    load_rows<CpAsync16>(tVsV, tKVcKV, kv_slice(p.v, opaque(kv_head)), p.v.sl, j0, kv_end - j0);
    if constexpr (kHasMask) {
      load_mask_tile<Kt, kMask>(s_mask, mask, b_k, h, m0_k, rows, j0, min(kBlockN, kv_end - j0));
    }
    Kt::Ops::cp_async_fence();
    gemm_ss(acc_s, tSrQ, tSrK, tSrQ_view, tSrK_view, tSsQ, tSsK, tiled_mma, smem_tiled_copy_q,
            smem_tiled_copy_k);
    Kt::Ops::template cp_async_wait<0>();  // V (and the mask tile) of block n
    __syncthreads();  // ... visible to all; every warp done with Q K^T of block n (sK free)
    if (n > tb.n_begin) {
      // Prefetch the next K block behind the softmax and P V of this one.
      load_rows<CpAsync16>(tKsK, tKVcKV, kv_slice(p.k, opaque(kv_head)), p.k.sl, j0 - kBlockN,
                           kv_end - (j0 - kBlockN));
      Kt::Ops::cp_async_fence();
    }

    // Logit softcapping (docs/math.md section 6): the scores x become the x' whose scaled logit is
    // the capped one, before the additive mask (cute_utils.cuh: softcap_row).
    Tensor s_rc = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));
    if (capped) {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const SoftcapRow cr = softcap_row(s_row_scale[get<0>(tScS_rc(r, 0))], kLog2e, p.softcap.cap,
                                          p.softcap.inv_cap);
        CUTE_UNROLL
        for (int c = 0; c < kCols; ++c) s_rc(r, c) = cr.out * tanh_of_exp2(s_rc(r, c) * cr.in);
      }
    }

    // Logits in log2 units, -inf where the key is not allowed; the row max after scaling (lambda
    // may be 0 or negative); alpha = 2^(m_old - m_new).
    float m_use[kRows], alpha[kRows], delta[kRows];
    [[maybe_unused]] bool had_sum[kRows];  // this thread's partial l != 0 before the block
    bool rescale_o = false;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int row_in_tile = get<0>(tScS_rc(r, 0));
      const int i = m0_k + row_in_tile;
      const float scale2 = s_row_scale[row_in_tile];
      KeyRange keys{0, 0};
      if constexpr (kPredicated) keys = row_keys<kCausal>(p.pattern, i, q_len, kv_len);
      const int lo = static_cast<int>(keys.lo), hi = static_cast<int>(keys.hi);
      // The byte selectors of the thread's first two columns serve all its columns
      // (mask_words.cuh).
      [[maybe_unused]] uint32_t selector[2] = {0u, 0u};
      if constexpr (kHasMask) {
        CUTE_UNROLL
        for (int c = 0; c < 2; ++c) {
          const int j = j0 + get<1>(tScS_rc(r, c));
          selector[c] = kMask == MaskKind::kBool
                            ? bool_mask_selector(mask, b_k, h, i, j)
                            : additive_mask_selector<typename Kt::Input>(mask, b_k, h, i, j);
        }
      }
      float mx = kNegInf;
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c) {
        const int col = get<1>(tScS_rc(r, c));
        const int j = j0 + col;
        bool allowed = !kPredicated || (j >= lo && j < hi);
        [[maybe_unused]] const uint32_t word =
            kHasMask ? s_mask[row_in_tile * Kt::kMaskLd + col] : 0u;
        if constexpr (kMask == MaskKind::kBool) {
          allowed = allowed && bool_mask_allows(word, selector[c % 2]);
        }
        float y;
        if constexpr (kMask == MaskKind::kAdditive) {
          // -inf hides the key whatever its score: a NaN key must not give NaN + -inf = NaN.
          const float m = additive_mask_value<typename Kt::Input>(mask, word, selector[c % 2]);
          allowed = allowed && m != kNegInf;
          y = fmaf(s_rc(r, c), scale2, m * kLog2e);
        } else {
          y = s_rc(r, c) * scale2;
        }
        y = allowed ? y : kNegInf;
        s_rc(r, c) = y;
        // fmaxf drops NaN; a NaN logit still makes the row NaN through e = 2^NaN in l and in P V.
        mx = fmaxf(mx, y);
      }
      const float m_new = fmaxf(row_m[r], quad_max(mx));
      // While the row has seen no allowed key (m = -inf) every weight is 0: exponentiate against 0
      // instead of forming -inf - (-inf).
      m_use[r] = m_new == kNegInf ? 0.f : m_new;
      delta[r] = row_m[r] - m_use[r];  // <= 0; -inf while the row was empty
      alpha[r] = exp2_approx(delta[r]);
      rescale_o |= alpha[r] != 1.f;
      if constexpr (kStats) had_sum[r] = row_l[r] != 0.f;
      row_l[r] *= alpha[r];
      row_m[r] = m_new;
    }
    // O *= alpha, skipped (warp-uniformly) once no row of the warp has a new max: 128 FMUL per
    // thread at D = 128 against 32 scores.
    if (__any_sync(0xffffffffu, rescale_o)) {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        CUTE_UNROLL
        for (int d = 0; d < size<1>(o_rc); ++d) o_rc(r, d) *= alpha[r];
      }
    }
    // P = 2^(y - m) and the sums.
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      [[maybe_unused]] float t = 0.f, u = 0.f;
      if constexpr (kStats) {
        // online_stats.h rescale on this thread's partial sums, in log2 units (delta2 = delta /
        // ln 2 obeys the same update): t <- alpha (t + delta l) = alpha t + delta l_new with l
        // already rescaled. A partial l that was 0 has t = u = 0 and keeps them (no -inf * 0).
        t = s_tu[2 * r * kBlockThreads], u = s_tu[(2 * r + 1) * kBlockThreads];
        if (had_sum[r]) {
          t = alpha[r] * t + delta[r] * row_l[r];
          u = alpha[r] * alpha[r] * u;
        }
      }
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c) {
        const float x = s_rc(r, c) - m_use[r];
        const float e = exp2_approx(x);
        s_rc(r, c) = e;
        if constexpr (kStats) {
          // A masked key has e = 0 and x = -inf: clamp x so that it adds 0, not 0 * -inf = NaN.
          // Where no key is hidden (no predicate, no mask) x is finite for finite scores, and the
          // epilogue's guard recomputes a row whose entropy a non-finite score made NaN: no clamp
          // (one instruction of the three the statistics add per score).
          accumulate(row_l[r], t, u, kPredicated || kHasMask ? clamp_finite(x) : x, e);
        } else {
          row_l[r] += e;
        }
      }
      if constexpr (kStats) {
        s_tu[2 * r * kBlockThreads] = t;
        s_tu[(2 * r + 1) * kBlockThreads] = u;
      }
    }

    Tensor rP = convert_fragment<Element>(acc_s);
    Tensor tOrP = make_tensor(rP.data(), acc_as_a(rP.layout()));
    if (kCausal && p.dropout.on()) {  // (read in place: no register held across the loop)
      // Dropout (docs/math.md section 6) zeroes the dropped weights of P V (their 16-bit halves:
      // a select each), those of each k-step's 16 keys just before its products (one Philox call
      // per row pair: drawn beside the tensor cores' work, and only one group's draws live); the
      // kept ones' 1 / (1 - p') multiplies O once, in the epilogue. l, t and u are left as they
      // are: the statistics describe the weights before dropout.
      Tensor p_rc = make_tensor(rP.data(), acc_rowcol(rP.layout()));
      // (b H + h < 2^32: the grid's limits.)
      const uint32_t bh = static_cast<uint32_t>(b_k) * static_cast<uint32_t>(heads) + h;
      gemm_rs(acc_o, tOrP, tOrVt, tOrVt_view, tOsVt, tiled_mma, smem_tiled_copy_v, [&](int k) {
        // k-step k multiplies the columns [4k, 4k + 4) of p_rc (acc_as_a).
        dropout_decisions_of_columns<true>(p.dropout, bh, m0_k, j0, tScS_rc, 4 * k,
                                           [&](int r, int c, bool kept) {
                                             if (!kept) p_rc(r, c) = Element(0);
                                           });
      });
    } else {
      gemm_rs(acc_o, tOrP, tOrVt, tOrVt_view, tOsVt, tiled_mma, smem_tiled_copy_v, [](int) {});
    }
  };

  clear(acc_o);  // here, not earlier: 128 live zeros around the row setup would spill
  if constexpr (kCausal) {
    // One loop choosing the variant per block: two loops plus the predicated blocks below a
    // window's lower edge in a third spill.
    for (int n = tb.n_end - 1; n >= tb.n_begin; --n) {
      if (tb.predicated(n)) {
        key_block(n, std::true_type{});
      } else {
        key_block(n, std::false_type{});
      }
    }
  } else {
    // Every row sees every key: only the last, partial block needs the predicate. (Two loops: the
    // one above spills here.) The blocks go through a lambda the compiler inlines or not as it
    // judges: forced inlining spills some of these kernels.
    auto plain_block = [&](const int n, auto predicated) { key_block(n, predicated); };
    int n = tb.n_end - 1;
    for (; n >= tb.n_hi_pred; --n) plain_block(n, std::true_type{});
    for (; n >= 0; --n) plain_block(n, std::false_type{});
  }

  // Epilogue. Its indices are recomputed from opaque copies of the thread and tile indices (and
  // n_i is re-read from the output this thread wrote): values carried from the prologue across the
  // loop (such as the output's offset, which ptxas otherwise hoists there) would hold registers
  // that the loop does not have.
  const int tid_e = opaque(tid);
  Tensor tOcO = tiled_mma.get_thread_slice(tid_e).partition_C(
      make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tOcO_rc = make_tensor(tOcO.data(), acc_rowcol(tOcO.layout()));
  const int b_e = opaque(b), h_e = opaque(h), m0_e = opaque(m0);
  const int64_t row0 = (static_cast<int64_t>(b_e) * heads + h_e) * q_len + m0_e;
  // Whether a row of the call holds a non-finite value: P V forms 0 * NaN for a hidden key's NaN
  // value, so the fallback recomputes such calls by the hidden-keys rule (params.h: nonfinite).
  bool nonfinite = false;
  // The kept weights' dropout factor, applied to O here rather than to each weight.
  const float o_scale = kCausal && p.dropout.on() ? p.dropout.keep_scale : 1.f;
  if (kCausal && p.num_splits > 1) {
    // Split-KV: the rows' state over this split's keys and their unnormalized output, in float32,
    // for split_kv.cuh's combine kernel (which also raises the guard's flag).
    static_assert(decltype(size<1>(o_rc))::value % 2 == 0);
    const int split_e = this_block_tile<kCausal, kMask>(p.launch_sections).x /
                        (static_cast<int>(gridDim.x) / p.num_splits);
    const int64_t base = split_e * p.batch * p.heads * p.q_len + row0;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const float l = quad_sum(row_l[r]);
      float t = 0.f, u = 0.f;
      if constexpr (kStats) {
        t = quad_sum(s_tu[2 * r * kBlockThreads]);
        u = quad_sum(s_tu[(2 * r + 1) * kBlockThreads]);
      }
      const int i = get<0>(tOcO_rc(r, 0));  // in the tile
      if (m0 + i >= q_len) continue;
      float* o_row = p.o_partial + (base + i) * kHeadDim;
      CUTE_UNROLL
      for (int d = 0; d < size<1>(o_rc); d += 2) {
        // Columns d and d + 1 of the fragment are adjacent (the first mode of the column layout).
        *reinterpret_cast<float2*>(o_row + get<1>(tOcO_rc(r, d))) =
            make_float2(o_rc(r, d) * o_scale, o_rc(r, d + 1) * o_scale);
      }
      if (tid_e % 4 == 0) {
        *reinterpret_cast<float4*>(p.state_partial + (base + i) * 4) =
            make_float4(row_m[r], l, t, u);
      }
    }
    // A part whose rows see no key ran no block: Q's copy may be in flight.
    Kt::Ops::template cp_async_wait<0>();
    return;
  }
  // Add the 4 lanes' partial sums, finish each row (online_stats.h), O / l.
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    RowStats<float> st;
    st.m = row_m[r];
    st.l = quad_sum(row_l[r]);
    if constexpr (kStats) {
      st.t = quad_sum(s_tu[2 * r * kBlockThreads]);
      st.u = quad_sum(s_tu[(2 * r + 1) * kBlockThreads]);
    }
    const RowResult<float> res = finalize<float, Log2>(st);
    const int i = get<0>(tOcO_rc(r, 0));  // in the tile
    // (Finite inputs give a finite entropy: see the unclamped accumulate in key_block.)
    bool row_nonfinite = !is_finite(res.lse) || (kStats && !is_finite(res.entropy));
    const float o_row_scale = res.inv_l * o_scale;
    CUTE_UNROLL
    for (int d = 0; d < size<1>(o_rc); ++d) {
      o_rc(r, d) *= o_row_scale;
      row_nonfinite |= !is_finite(o_rc(r, d));
    }
    nonfinite |= row_nonfinite && m0 + i < q_len;
    if (m0 + i < q_len && tid_e % 4 == 0) {
      const int64_t row = row0 + i;
      if constexpr (kMask == MaskKind::kAdditive) {
        // A row with keys to see whose every weight vanished: its finite mask values lie below
        // -FLT_MAX / log2(e) (finfo.min) and became -inf in log2 units. Such keys are not hidden
        // (docs/math.md section 8); the fallback's natural units keep them, so it recomputes.
        nonfinite |= st.l == 0.f && p.n_keys[row] > 0;
      }
      p.lse[row] = res.lse;
      if constexpr (kStats) {
        store_row_statistics(p, row, res, p.n_keys[row], kCausal && has_sink_entry(p.sinks, h));
      }
    }
  }
  if (nonfinite && p.nonfinite != nullptr) *p.nonfinite = 1;  // (all store the same value)

  // O through shared memory (sQ's space: every warp has passed the last Q K^T, behind the barrier
  // before the last P V) so that the global writes are whole 16-byte row segments. A tile whose
  // rows see no key ran no block: its Q copy may still be landing in that space.
  if (tb.n_end <= tb.n_begin) {
    Kt::Ops::template cp_async_wait<0>();
    __syncthreads();
  }
  Tensor rO = convert_fragment<Element>(acc_o);
  Tensor sO = make_tensor(sQ.data(), typename Kt::SmemLayoutQ{});
  auto smem_tiled_copy_o = make_tiled_copy_C(typename Kt::SmemCopyAtomO{}, tiled_mma);
  auto smem_thr_copy_o = smem_tiled_copy_o.get_thread_slice(tid_e);
  copy(smem_tiled_copy_o, smem_thr_copy_o.retile_S(rO), smem_thr_copy_o.partition_D(sO));
  __syncthreads();

  Element* out_ptr = static_cast<Element*>(p.out.data) + p.out.offset(b_e, h_e, m0_e);
  Tensor gO = make_tensor(make_gmem_ptr(out_ptr), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                          make_stride(p.out.sl, _1{}));
  typename Kt::GmemTiledCopyO gmem_tiled_copy_o;
  auto gmem_thr_copy_o = gmem_tiled_copy_o.get_thread_slice(tid_e);
  Tensor tOsO = gmem_thr_copy_o.partition_S(sO);
  Tensor tOgO = gmem_thr_copy_o.partition_D(gO);
  Tensor tOcOg =
      gmem_thr_copy_o.partition_D(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tOrO = make_tensor<Element>(shape(tOgO));
  copy(gmem_tiled_copy_o, tOsO, tOrO);
  CUTE_UNROLL
  for (int m = 0; m < size<1>(tOrO); ++m) {
    if (get<0>(tOcOg(0, m, 0)) < rows) {
      CUTE_UNROLL
      for (int k = 0; k < size<2>(tOrO); ++k) copy(gmem_tiled_copy_o, tOrO(_, m, k), tOgO(_, m, k));
    }
  }
}

}  // namespace fwd_impl
}  // namespace entropy_attn::cuda::sm80
