// Forward kernel of the Hopper family (sm_90a, bf16/fp16): FlashAttention-3's building blocks (TMA,
// mbarriers, wgmma, warp specialization), written with CuTe, plus the per-row statistics of
// docs/math.md section 2 through online_stats.h.
//
// One thread block of three warpgroups owns a tile of kBlockM = 128 query rows of one (batch,
// head):
//   warpgroup 0, the producer: gives its registers back (setmaxnreg.dec to 24) and one thread
//     issues the TMA loads: the Q tile once, then K and V of every key block into a kStages-deep
//     ring of swizzled shared-memory buffers, each load completing on the stage's "full"
//     mbarrier (cutlass::PipelineTmaAsync: the bytes are counted by the barrier's transaction
//     count), each buffer reused once the consumers have arrived on its "empty" mbarrier;
//   warpgroups 1 and 2, the consumers, cooperative: they split the tile's rows (64 each, the M of
//     one wgmma) and raise their register budget to 240 (setmaxnreg.inc). Per key block:
//       S = Q K^T          wgmma with both operands in shared memory (SS), fp32 accumulators;
//       online softmax     the logits y = lambda_i log2(e) S (+ log2(e) mask) in log2 units,
//                          their row max (four partial maxima per thread, then over the 4 lanes
//                          that share a row: 2 shuffles), the row state moved to the new max by
//                          online_stats.h (rescale_by, with O's factor),
//                          then e = 2^(y - m) (one MUFU.EX2) and l, t, u accumulated
//                          (accumulate). Where no key is hidden, lambda_i folds into the
//                          exponent: the max of the raw scores, and y - m as one FFMA per score;
//       O = alpha O + P V  P converted to T in registers and fed to wgmma as the A operand (RS),
//                          V^T read from shared memory; O's rescale skipped by a warp whose rows
//                          kept their max.
// The two consumer warpgroups run the same key block on the same buffers: both must release a
// stage before the producer refills it, so the loads of block n - kStages overlap the whole of
// block n's compute. Within a warpgroup the blocks are software-pipelined as FlashAttention-3's
// intra-warpgroup overlap: S of block n is issued, then P V of the block before (O first moved
// by that block's alpha), and the softmax of block n runs while that P V is in the tensor cores.
// Across the warpgroups, two named "scheduler" barriers hand the tensor cores from one to the
// other (FlashAttention-3's ping-pong), so that one's softmax overlaps the other's products.
//
// The grid is 1-D: a block per tile, or (params.h: persistent_blocks) a persistent grid of a block
// per SM whose blocks walk several tiles (launch_order.h: persistent_tile), as FlashAttention-3's
// tile scheduler does: the producer's pipeline stages run on from one tile into the next, and it
// loads the next tile's Q as soon as the consumers have waited for the tile's last S (a second
// mbarrier, barrier_q_empty), so that the loads of the next tile overlap the tile's last softmax,
// P V and epilogue.
//
// Key blocks are visited from the last to the first, as in the sm80 family: the blocks that need
// the causal / sequence-end predicate (the last partial block and the blocks crossing the
// diagonal) come first, the loop over the others carries none. Keys past the last row's causal
// limit are never loaded (causal block skipping). The instantiations compiled with causality
// (kCausal) take any banded KeyPattern (kernel_args.h): causality, a sliding window, either
// alignment, packed documents. A row sees [lo_i, hi_i); the tile loads only the blocks of [lo of
// its first row, hi of its last), and the blocks a window's lower edge crosses are predicated too
// (they come last). A tile whose rows see no key (bottom-right alignment with more queries than
// keys) loads none and writes the empty rows' zeros. Packed documents are the (1, H, T, D) call
// whose rows' ranges lie inside their documents: a tile across a document boundary loads the keys
// of both and predicates every block.
//
// The kCausal instantiations are the general ones: they also take the calls with softcap, sinks or
// dropout whatever their pattern (one that restricts no key is a pattern too), and masked full
// attention (kernels.toml lists no plain masked instantiation: their compile time), so that the
// others, the plain full attention, carry none of that code. Attention sinks set each row's
// initial state (online_stats.h: initial_state); logit softcapping replaces a block's scores by
// those whose scaled logits are the capped ones before its softmax; dropout zeroes the dropped
// weights of P after the statistics took them (cute_utils.cuh: for_each_dropout_decision, one
// Philox call per 8 weights) and scales O by 1 / (1 - p') at the end (uniform branches: the
// softmax itself, and so the kernels without them, stay as they were).
//
// Edge tiles: the TMA boxes of rows >= q_len and keys >= kv_len lie outside the tensors' bounds
// and arrive as zeros (finite scores, zero V rows); such keys are masked by the predicate and
// such rows are never written.
//
// Masks: n_i is counted before the key loop (lambda_i depends on it). Per key block each consumer
// warpgroup copies the mask entries of its 64 rows into a shared tile with 4-byte cp.async (as the
// sm80 family does), issued before S = Q K^T so that they land while the wgmma runs; the scores
// then read shared memory. Reading the mask per score from global memory instead made ptxas hoist
// the loads across the row and spill.
//
// The statistics: every consumer thread holds two rows (g and g + 8 of its warp's 16) and the
// columns 2 (lane % 4) + {0, 1} + 8k of each. m is the row's max, the same in the row's 4 lanes;
// l, t and u are the thread's partial sums over its own columns, each kept as a RowStats moved by
// online_stats.h's rescale (the sums are linear in their terms, so partial sums rescaled with the
// row's max are exact), and the 4 lanes of a row are added once at the end before finalize and
// derive. Without kStats, t and u are dead and the compiler drops them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

// The masked D = 128 kernels take 112-key blocks (kBlockN below): S is then one 64x112x16 wgmma
// per k-step, one of CuTe's "extended" shapes, which its selector offers only with this macro;
// without it S took seven 64x16 wgmmas per k-step (each reading its Q slice again). The macro
// only adds shapes: no other selection of the family changes.
#ifndef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#endif

// cute/tensor.hpp first: the sm90 atom headers rely on what it declares.
#include <cute/tensor.hpp>

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>
#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "../../kernel_args.h"
#include "../../online_stats.h"
#include "../cute_utils.cuh"
#include "../key_ranges.cuh"
#include "../launch_order.h"
#include "../mask_words.cuh"
#include "../params.h"
#include "../row_statistics.cuh"
#include "launch.h"
#include "ops.cuh"
#include "wgmma_utils.cuh"

namespace entropy_attn::cuda::sm90 {
namespace fwd_impl {

using namespace cute;

// What the producer needs of a tile: its query tile, head, batch entry and key blocks. It does not
// compute them: its 24 registers spilled on the launch order's divisions and the key ranges'
// 64-bit arithmetic. Thread 0 computes the block's first tile before the warpgroups part, and the
// consumers each next one, all handed to the producer through shared memory (m_block < 0: none
// left).
struct ProducerTile {
  int m_block = -1, h = 0, b = 0, n_begin = 0, n_end = 0;
};

// Tile traits. 128 query rows (64 per consumer warpgroup, the M of one wgmma) by 128 keys: S is
// 64 fp32 registers per consumer thread, the P of the block before (in flight in P V) 32 and O
// D / 2 (64 at D = 128), inside the 240 that setmaxnreg gives the consumers. Two stages: Q 32 KB +
// 2 x (K 32 KB + V 32 KB) = 160 KB at D = 128 (80 KB at D = 64), plus a masked kernel's mask tile,
// within an H100's 227 KB per block.
//
// At D = 256 the key blocks hold 64 keys: O takes 128 registers, S 32 and P 16. With 80
// (FlashAttention-3's choice for full attention there) the kernels with statistics spilled 44-48
// bytes (ptxas, nvcc 13.0); 64 is its choice for local attention. Q 64 KB + 2 x (K 32 KB + V 32 KB)
// = 192 KB of shared memory leaves no room for a third stage, nor for a 64-key mask tile (34 KB)
// beside the row arrays: the masked kernels take 48 keys a block (the next multiple of P V's 16
// below 64), K and V 24 KB a stage and the mask tile 26 KB, 187 KB in all (S 24 registers, P 12;
// ptxas: no local memory).
template <typename T, int kHeadDim_, MaskKind kMask, typename Ops_ = Sm90Ops>
struct FwdTraits {
  using Ops = Ops_;  // the instructions (ops.cuh)
  using Element = typename ::entropy_attn::cuda::CuteElement<T>::type;
  static constexpr int kHeadDim = kHeadDim_;
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256,
                "head dims of the Hopper family");
  static constexpr int kBlockM = 128;
  // Masked kernels at D = 128 take 112 keys a block: the mask words and their addresses need the
  // registers that 16 keys of S (8 per thread) and of P (4) free; at 128 they spill. At D = 256,
  // 64 keys a block, 48 with a mask (shared memory: above).
  static constexpr int kBlockN = kHeadDim == 256
                                     ? (kMask != MaskKind::kNone ? 48 : 64)
                                     : (kHeadDim == 128 && kMask != MaskKind::kNone ? 112 : 128);
  static constexpr int kStages = 2;
  static constexpr int kConsumerThreads = 256;  // two warpgroups
  static constexpr int kThreads = 128 + kConsumerThreads;
  // setmaxnreg budgets: 24 x 128 + 240 x 256 = 64512 of the SM's 65536 registers, one block per
  // SM (FlashAttention-3's split for two consumer warpgroups).
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;

  // S = Q K^T: 64 x kBlockN x kHeadDim per warpgroup, both operands K-major in shared memory.
  using TiledMmaS = decltype(make_tiled_mma(
      typename Ops::template Gmma<
          decltype(GMMA::ss_op_selector<Element, Element, float,
                                        Shape<_64, Int<kBlockN>, Int<kHeadDim>>>())>{},
      Layout<Shape<_2, _1, _1>>{}));
  // O += P V: 64 x kHeadDim x kBlockN per warpgroup, P (K-major) from registers, V^T MN-major.
  using TiledMmaO = decltype(make_tiled_mma(
      typename Ops::template Gmma<
          decltype(GMMA::rs_op_selector<Element, Element, float,
                                        Shape<_64, Int<kHeadDim>, Int<kBlockN>>, GMMA::Major::K,
                                        GMMA::Major::MN>())>{},
      Layout<Shape<_2, _1, _1>>{}));

  // 128-byte swizzled tiles (rows of 64 elements), K-major (D contiguous) as TMA writes them; V^T,
  // the B operand of O = P V, is the V tile read MN-major (the same bytes, transposed view). (A
  // V^T tile stored D-major would take one TMA box per 8 keys at D = 128; this takes two.)
  using SmemLayoutQ = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                             Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutK = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                             Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutVt = decltype(composition(
      SmemLayoutK{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{},
                                 Stride<Int<kBlockN>, _1, Int<kBlockN * kHeadDim>>{})));

  using TmaQ = decltype(make_tma_copy(
      typename Ops::TmaLoad{},
      make_tensor(make_gmem_ptr(static_cast<const Element*>(nullptr)), ShapeQKV{}, StrideQK{}),
      SmemLayoutQ{}));
  using TmaK = decltype(make_tma_copy(
      typename Ops::TmaLoad{},
      make_tensor(make_gmem_ptr(static_cast<const Element*>(nullptr)), ShapeQKV{}, StrideQK{}),
      take<0, 2>(SmemLayoutK{})));

  // Bytes each TMA box delivers (out-of-bounds parts included: they count as zeros).
  static constexpr uint32_t kTmaBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kTmaBytesKV = kBlockN * kHeadDim * sizeof(Element);

  using Pipeline = typename Ops::template Pipeline<kStages>;
  using PipelineState = cutlass::PipelineState<kStages>;

  // The mask tile of a key block, one 32-bit word per score (the float of a float32 additive mask,
  // or the aligned word that holds a bool mask's byte or a 16-bit entry). Rows padded by 4 words,
  // so that the 8 rows a warp's lanes read at once start in different banks: 66 KB at D = 64, 58 KB
  // at D = 128, 26 KB at D = 256.
  static constexpr bool kHasMask = kMask != MaskKind::kNone;
  static constexpr int kMaskLd = kBlockN + 4;
  static constexpr int kMaskWords = kHasMask ? kBlockM * kMaskLd : 1;

  // The 128-byte swizzle repeats every 1024 bytes: each tile starts on a 1024-byte boundary.
  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>> k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>> v;
    alignas(16) uint32_t mask[kMaskWords];
    // The keys [lo, hi) of each tile row (kCausal): read by the predicated softmax, so that the
    // key loop carries no search over packed documents.
    int row_lo[kBlockM], row_hi[kBlockM];
    // n_i of each tile row, read by the epilogue: kept here rather than in two registers of every
    // consumer thread across the key loop.
    int row_n[kBlockM];
    typename Pipeline::SharedStorage pipeline_k, pipeline_v;
    // Q's tile landed (the producer's TMA, counted in bytes), and the consumers done reading it
    // (every consumer thread arrives), so that a block that walks several tiles loads the next
    // tile's Q while its consumers finish the tile before.
    alignas(8) uint64_t barrier_q;
    alignas(8) uint64_t barrier_q_empty;
    // The block's tiles for the producer (ProducerTile above): the tile of round r in slot r % 2,
    // the first written by thread 0 before the warpgroups part, each next one by a consumer thread
    // in round r - 1 before it arrives on barrier_q_empty, and read by the producer once it has
    // waited there. (The thread writes once it has waited for round r - 1's Q, which the producer
    // loaded after reading round r - 1's tile: one slot would do, but with one ptxas spilled the
    // masked kernels at D = 128, 32 to 48 bytes.)
    ProducerTile next_tile[2];
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= 227 * 1024);
};

// The kernel's arguments: the call's parameters and the TMA descriptors built from them on the
// host (make_tma_copy), passed as one __grid_constant__ struct (TMA reads descriptors in place).
template <typename Kt>
struct KernelArgs {
  FwdParams<float> p;
  typename Kt::TmaQ tma_q;
  typename Kt::TmaK tma_k;
  typename Kt::TmaK tma_v;  // V as K: (keys, D, heads, batch)
};

// The kernel's arguments for a call: its parameters and the TMA descriptors of q, k and v
// (launch_forward, fwd_launch.cuh, and the CPU emulation, tests/cpp/sm90_emulation.h).
template <typename Kt>
KernelArgs<Kt> make_kernel_args(const FwdParams<float>& p) {
  using Element = typename Kt::Element;
  constexpr int kD = Kt::kHeadDim;
  using TmaLoad = typename Kt::Ops::TmaLoad;
  const auto kv_box = take<0, 2>(typename Kt::SmemLayoutK{});
  return KernelArgs<Kt>{
      p,
      make_tma_copy(TmaLoad{}, tma_tensor<Element, kD>(p.q, p.q_len, p.heads, p.batch),
                    typename Kt::SmemLayoutQ{}),
      make_tma_copy(TmaLoad{}, tma_tensor<Element, kD>(p.k, p.kv_len, p.kv_heads, p.batch), kv_box),
      make_tma_copy(TmaLoad{}, tma_tensor<Element, kD>(p.v, p.kv_len, p.kv_heads, p.batch),
                    kv_box)};
}

// The call's tiles: (query tiles, heads, batch), x fastest in their linear index.
template <typename Kt>
EA_HOST_DEVICE int64_t query_tiles(const FwdParams<float>& p) {
  return (p.q_len + Kt::kBlockM - 1) / Kt::kBlockM;
}
template <typename Kt>
EA_HOST_DEVICE int64_t tile_count(const FwdParams<float>& p) {
  return query_tiles<Kt>(p) * p.heads * p.batch;
}

// A 1-D grid: one block per tile, or, with p.persistent_blocks >= 1 (params.h), that many blocks
// at most, each walking its tiles in rounds (launch_order.h: persistent_tile). Fewer than 2^31
// tiles (launch_forward checks; a call with more would need 2^38 query rows); a persistent grid of
// at most 2^30 blocks, so that no block's next tile index wraps past 2^32.
template <typename Kt>
dim3 grid(const FwdParams<float>& p) {
  const int64_t tiles = tile_count<Kt>(p);
  const int64_t blocks = p.persistent_blocks >= 1
                             ? std::min({tiles, int64_t{p.persistent_blocks}, int64_t{1} << 30})
                             : tiles;
  return dim3(static_cast<unsigned>(blocks));
}

// One tile of a block: its grid coordinates (x: query tile in launch order, y: head, z: batch
// entry), its first query row and its key blocks (key_ranges.cuh), the same in every thread.
struct ForwardTile {
  GridTile at;
  int m_block, m0;
  TileBlocks tb;
};
template <typename Kt, bool kCausal, MaskKind kMask>
__device__ __forceinline__ ForwardTile forward_tile(const FwdParams<float>& p, uint32_t index) {
  const int q_len = static_cast<int>(p.q_len), kv_len = static_cast<int>(p.kv_len);
  const uint32_t x_dim = static_cast<uint32_t>(query_tiles<Kt>(p));
  const GridTile at = tile_at<kCausal, kMask>(index, x_dim, static_cast<uint32_t>(p.heads),
                                              static_cast<uint32_t>(p.batch), p.launch_sections);
  // Causal tiles further down do more work: start them first (the launch order puts every head's
  // first x before any head's second), so that the short ones fill the tail. (Windows make the
  // tiles alike: no harm.)
  const int m_block = kCausal ? static_cast<int>(x_dim) - 1 - at.x : at.x;
  const int m0 = m_block * Kt::kBlockM;
  const int rows = min(Kt::kBlockM, q_len - m0);
  return {at, m_block, m0,
          tile_key_blocks<kCausal>(p.pattern, m0, rows, q_len, kv_len, Kt::kBlockN)};
}

// Keeps the compiler from moving plain loads and stores of shared memory across it. CUTLASS's
// mbarrier arrivals and waits are asm without a "memory" clobber: the hardware orders the next
// tile's slot (SharedStorage::next_tile) by the arrival and the wait on barrier_q_empty, but the
// compiler could still sink the consumer's stores below the arrival or hoist the producer's loads
// above the wait.
EA_HOST_DEVICE void compiler_fence() { asm volatile("" ::: "memory"); }

__device__ __forceinline__ ProducerTile producer_tile(const ForwardTile& ft) {
  return {ft.m_block, ft.at.y, ft.at.z, ft.tb.n_begin, ft.tb.n_end};
}

// Copies the mask words (mask_words.cuh) of one consumer warpgroup's 64 tile rows (from `row0`;
// those below `rows`) and keys [j0, j0 + cols) into the shared mask tile, one 4-byte cp.async per
// score, issued before S = Q K^T. A thread owns one key column (consecutive threads, consecutive
// keys: coalesced for a key-contiguous mask). Entries not loaded (padding rows, keys >= cols) hold
// stale values that no allowed score reads.
template <typename Kt, MaskKind kMask>
__device__ __forceinline__ void load_mask_rows(uint32_t* s_mask, const MaskArg<float>& mask, int b,
                                               int h, int i0, int row0, int rows, int j0,
                                               int cols) {
  const int col = threadIdx.x % 128;
  if (col >= cols) return;
  int64_t off = mask.row_offset(b, h, i0 + row0) + (j0 + col) * mask.sj;
  uint32_t* dst = s_mask + row0 * Kt::kMaskLd + col;
#pragma unroll 8
  for (int r = row0; r < row0 + 64; ++r, off += mask.si, dst += Kt::kMaskLd) {
    if (r < rows) Kt::Ops::CpAsync4::copy(*mask_word<kMask>(mask, off), *dst);
  }
}

// Named barriers of the consumer warpgroups (ids after CUTLASS's reserved ones): each warpgroup's
// own around its mask tile (128 threads), and the two scheduler barriers (256 threads) that hand
// the tensor cores from one consumer warpgroup to the other, as FlashAttention-3's ping-pong:
// warpgroup w waits on barrier kSchedulerBarrier + w before issuing its products and, once they
// are issued, arrives on the other's. Warpgroup 1 arrives on warpgroup 0's at the start, so that
// 0 goes first.
constexpr int kMaskBarrier = 0;       // + warpgroup
constexpr int kSchedulerBarrier = 2;  // + warpgroup
template <typename Ops>
__device__ __forceinline__ void scheduler_sync(int wg) {
  Ops::NamedBarrier::sync(256, kSchedulerBarrier + wg);
}
template <typename Ops>
__device__ __forceinline__ void scheduler_arrive(int wg) {
  Ops::NamedBarrier::arrive(256, kSchedulerBarrier + (1 - wg));
}

// The consumer warpgroups on the tile of index `index` (launch_order.h: persistent_tile):
// everything but the loads. read_state is the stage of the tile's first key block, left at the
// next tile's.
template <typename T, typename Kt, bool kCausal, MaskKind kMask, bool kStats>
__device__ __forceinline__ void consume(const KernelArgs<Kt>& args, typename Kt::SharedStorage& ss,
                                        typename Kt::Pipeline& pipeline_k,
                                        typename Kt::Pipeline& pipeline_v,
                                        typename Kt::PipelineState& read_state, uint32_t index) {
  using Element = typename Kt::Element;
  using Ops = typename Kt::Ops;
  constexpr int kBlockM = Kt::kBlockM, kBlockN = Kt::kBlockN, kHeadDim = Kt::kHeadDim;
  constexpr bool kHasMask = kMask != MaskKind::kNone;
  const FwdParams<float>& p = args.p;
  const ForwardTile ft = forward_tile<Kt, kCausal, kMask>(p, index);
  const int h = ft.at.y, b = ft.at.z, m0 = ft.m0;
  const TileBlocks& tb = ft.tb;
  const int q_len = static_cast<int>(p.q_len), kv_len = static_cast<int>(p.kv_len);
  const int heads = static_cast<int>(p.heads);
  const int ctid = threadIdx.x - 128;  // thread index among the consumers, [0, 256)
  // The tile before's epilogue read its rows' ss.row_n in this warp's other lanes: done before
  // this tile's rows are written.
  __syncwarp();

  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Kt::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Kt::SmemLayoutK{});
  Tensor sVt = make_tensor(make_smem_ptr(ss.v.data()), typename Kt::SmemLayoutVt{});

  typename Kt::TiledMmaS mma_s;
  typename Kt::TiledMmaO mma_o;
  auto thr_s = mma_s.get_thread_slice(ctid);
  auto thr_o = mma_o.get_thread_slice(ctid);
  // The operands' descriptors by the warpgroup's first thread, a warp-uniform index
  // (Ops::warp_group_idx), so that ptxas forms them in uniform registers (the backward's
  // consume() says more).
  const int wg_tid = (Ops::warp_group_idx() - 1) * 128;
  auto wg_s = mma_s.get_thread_slice(wg_tid);
  Tensor tSrQ = wg_s.partition_fragment_A(sQ);  // wgmma descriptors (MMA, MMA_M, MMA_K)
  Tensor tSrK = wg_s.partition_fragment_B(sK);  // (MMA, MMA_N, MMA_K, stages)
  Tensor tOrV =
      mma_o.get_thread_slice(wg_tid).partition_fragment_B(sVt);  // (MMA, MMA_D, MMA_Keys, stages)
  Tensor acc_o = partition_fragment_C(mma_o, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  Tensor o_rc = make_tensor(acc_o.data(), acc_rowcol(acc_o.layout()));

  // (row, col) in the tile of every score accumulator, viewed as (thread rows, columns).
  Tensor cS = thr_s.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor cS_rc = make_tensor(cS.data(), acc_rowcol(cS.layout()));
  constexpr int kRows = decltype(size<0>(cS_rc))::value;
  constexpr int kCols = decltype(size<1>(cS_rc))::value;
  static_assert(kRows == 2, "a thread holds rows g and g + 8 of its warp's 16");
  const int lane = ctid % 32;

  // The mask with its kind fixed at compile time, so that MaskArg's accessors drop the other
  // kinds' branches.
  MaskArg<float> mask = p.mask;
  mask.kind = kMask;

  // n_i: with a mask, the count of the row's allowed keys in its range, needed before any score
  // (lambda_i depends on it), as the sm80 family counts it. Each warp counts its 16 rows one at a
  // time, the lanes striding the keys (coalesced for a key-contiguous mask), then a warp sum; the
  // lanes that hold the row keep it. Without a mask n_i is the range's length.
  int n_row[kRows];
  constexpr bool kBandedOrMasked = kCausal || kHasMask;  // else n_i = kv_len for every row
  const int warp_row0 = get<0>(cS_rc(0, 0)) - lane / 4;  // the warp's first tile row
  if constexpr (kHasMask) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) n_row[r] = 0;
    for (int rr = 0; rr < 16; ++rr) {
      const int i = m0 + warp_row0 + rr;
      const KeyRange keys = row_keys<kCausal>(p.pattern, i, q_len, kv_len);
      const int64_t off = mask.row_offset(b, h, i);
      int count = 0;
      for (int j = static_cast<int>(keys.lo) + lane; j < keys.hi; j += 32)
        count += mask.counts(off, j);
      CUTE_UNROLL
      for (int o = 16; o > 0; o >>= 1) count += __shfl_xor_sync(0xffffffffu, count, o);
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        if (get<0>(cS_rc(r, 0)) == warp_row0 + rr) n_row[r] = count;
      }
    }
  } else {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const KeyRange keys = row_keys<kCausal>(p.pattern, m0 + get<0>(cS_rc(r, 0)), q_len, kv_len);
      n_row[r] = static_cast<int>(keys.hi - keys.lo);
    }
  }

  // The rows' key ranges for the predicated softmax (kCausal; the others' are [0, kv_len)), by
  // lane 0 of each quad for the quad.
  if constexpr (kCausal) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int t = get<0>(cS_rc(r, 0));
      if (lane % 4 == 0) {
        const KeyRange keys = row_keys<true>(p.pattern, m0 + t, q_len, kv_len);
        ss.row_lo[t] = static_cast<int>(keys.lo), ss.row_hi[t] = static_cast<int>(keys.hi);
      }
    }
    __syncwarp();
  }

  // Row setup (docs/math.md section 1): g(n_i) / temperature and lambda_i, written once per row by
  // lane 0 of its quad. Padding rows (i >= q_len) get lambda 0 and are never written.
  float scale2[kRows];  // lambda_i log2(e)
  bool negative_scale = false;
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const int i = m0 + get<0>(cS_rc(r, 0));
    const bool valid = i < q_len;
    const float factor = p.scale.factor(n_row[r]);
    const float lam = valid ? p.scale.lambda(b, h, i, factor) : 0.f;
    scale2[r] = lam * kLog2e;
    negative_scale |= !(scale2[r] >= 0.f);
    if (valid && lane % 4 == 0) {
      const int64_t row = (static_cast<int64_t>(b) * heads + h) * q_len + i;
      p.row_scale[row] = lam;
      p.length_factor[row] = factor;
      p.n_keys[row] = n_row[r];
    }
    if (kBandedOrMasked && lane % 4 == 0) ss.row_n[get<0>(cS_rc(r, 0))] = n_row[r];
  }

  // Whether the warp's softmax cannot fold the scale (see softmax below): the same in its lanes.
  // (The masked kernels fold nothing: no vote.)
  negative_scale = !kHasMask && __any_sync(0xffffffffu, negative_scale);

  // The thread's partial state of its rows: m is the row's max (log2 units, the same in the row's
  // 4 lanes), l, t, u the sums over the thread's columns. With an attention sink every row starts
  // as if it had seen the sink's entry (online_stats.h: initial_state): m = the sink in all 4
  // lanes, its e^0 = 1 in l and u of one lane only, so that the quad sums count it once.
  RowStats<float> st[kRows];
  if (kCausal && p.sinks != nullptr) {  // (the general instantiations: see below)
    // (A finite sink stays finite in log2 units: |sink| log2(e) may pass FLT_MAX.)
    const float sink = p.sinks[h];
    constexpr float kMax = std::numeric_limits<float>::max();
    // (Infinite and NaN sinks stay so: initial_state treats them as the fallback does.)
    const float sink2 = is_finite(sink) ? fminf(fmaxf(sink * kLog2e, -kMax), kMax) : sink;
    const RowStats<float> init = initial_state(true, sink2);
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      st[r] = init;
      if (lane % 4 != 0) st[r].l = st[r].u = 0.f;
    }
  }
  clear(acc_o);
  Ops::TxBarrier::wait(&ss.barrier_q, persistent_round(index, gridDim.x) % 2);

  // The consumer warpgroup (0 or 1) and its first tile row: the tiled wgmma gives warpgroup w the
  // rows [64 w, 64 w + 64). Its threads sync on their own named barrier around the mask tile.
  [[maybe_unused]] const int wg = ctid / 128;
  [[maybe_unused]] const int rows = min(kBlockM, q_len - m0);
  [[maybe_unused]] uint32_t* s_mask = ss.mask;
  const bool any_block = tb.n_end > tb.n_begin;  // the same in every thread of the block
  // Every wgmma that reads Q has completed: the producer may load the next tile's.
  auto release_q = [&] {
    compiler_fence();  // thread 128's write of the producer's next tile comes first
    Ops::TxBarrier::arrive(&ss.barrier_q_empty);
  };
  // The producer's next tile (the kernel's walk over tiles), written by thread 128 into the slot
  // that its arrival on barrier_q_empty (release_q) publishes, after the wait for this tile's Q
  // (SharedStorage::next_tile). Called once the warpgroup's first S is issued, so that its few
  // hundred instructions (the launch order's divisions, the key ranges' 64-bit arithmetic) run
  // beside that product: before the tile's first issue they delayed every tile.
  auto publish_next_tile = [&] {
    if (ctid == 0) {
      const uint32_t next = next_persistent_tile(index, blockIdx.x, gridDim.x);
      const ProducerTile pt = next < static_cast<uint32_t>(tile_count<Kt>(p))
                                  ? producer_tile(forward_tile<Kt, kCausal, kMask>(p, next))
                                  : ProducerTile{};
      ss.next_tile[(persistent_round(index, gridDim.x) + 1) % 2] = pt;
    }
    // The warp whole again for the wgmma wait that follows (.sync.aligned: all its threads at
    // once), rather than as ptxas happens to reconverge it.
    __syncwarp();
  };
  if (!any_block) {
    publish_next_tile();
    release_q();
  }

  // S = Q K^T of key block n into acc_s, issued and not waited for: the mask tile's copies first
  // (they land while the wgmma runs), then the warpgroup's turn at the tensor cores (ping-pong).
  auto issue_s = [&](const int n, auto& acc_s) {
    if constexpr (kHasMask) {
      // Every thread of the warpgroup is done with the previous block's mask tile.
      Ops::NamedBarrier::sync(128, kMaskBarrier + wg);
      load_mask_rows<Kt, kMask>(s_mask, mask, b, h, m0, 64 * wg, rows, n * kBlockN,
                                min(kBlockN, kv_len - n * kBlockN));
      Ops::cp_async_fence();
    }
    pipeline_k.consumer_wait(read_state);
    scheduler_sync<Ops>(wg);
    wg_gemm_issue<Ops, true>(mma_s, tSrQ, tSrK(_, _, _, read_state.index()), acc_s);
  };
  // O += P V for the key block whose V is in stage v_state, issued and not waited for.
  auto issue_pv = [&](auto& rP, const typename Kt::PipelineState& v_state) {
    Tensor tOrP = make_tensor(rP.data(), acc_as_a(rP.layout()));
    pipeline_v.consumer_wait(v_state);
    wg_gemm_issue<Ops, false>(mma_o, tOrP, tOrV(_, _, _, v_state.index()), acc_o);
  };
  // Once S of block n has landed: its K stage back to the producer (and Q, after the last block),
  // the mask tile visible.
  auto s_landed = [&](const int n, auto& acc_s) {
    warpgroup_fence_operand(acc_s);
    pipeline_k.consumer_release(read_state);
    if (n == tb.n_begin) release_q();
    if constexpr (kHasMask) {
      Ops::cp_async_wait_all();
      Ops::NamedBarrier::sync(128, kMaskBarrier + wg);  // the warpgroup's rows visible
    }
  };

  // The online softmax of key block n on its scores: the row max of the logits y = lambda_i
  // log2(e) s (log2 units, -inf where the key is not allowed), the row state moved to it, P =
  // 2^(y - m) in place and the sums. O is not touched (a P V may be in flight): the factor
  // 2^(m_old - m_new) that O owes is left in alpha. kPredicated: apply the row's range
  // lo_i <= j < hi_i (causality, window, alignment, documents, sequence end).
  //
  // Where no key is hidden (no predicate, no mask) and lambda_i >= 0, the scale is folded into the
  // exponent as FlashAttention-3 does: the max is taken over the raw scores and scaled once, and
  // x = y - m is one FFMA, fma(s, lambda_i log2(e), -m), instead of an FMUL forming y and an FADD.
  // The max is the same number: rounding is monotonic, so fl(lambda max_j s_j) = max_j fl(lambda
  // s_j) for lambda >= 0 (NaN and infinite scores go the same way: fmaxf drops a NaN product, and
  // the row comes out NaN through e). A warp with a row of negative (or NaN) lambda, whose max is
  // lambda times the smallest score, takes the predicated path in every block (its range check
  // holds for every key of an interior block): such scales (a learned per-row scale tensor) are
  // rare, and the branch stays warp-uniform for the quad shuffles. (A wrong max would cost no
  // accuracy until 2^(y - m) overflows, but the statistic u = sum e^2 does that first, past 64
  // log2 units, and the guard below does not watch it.) The masked kernels fold nothing.
  float alpha[kRows];
  const bool capped = kCausal && p.softcap.on();  // the same in every block of a call
  auto softmax = [&](const int n, auto& acc_s, auto predicated) {
    constexpr bool kPredicated = decltype(predicated)::value;
    constexpr bool kFolded = !kPredicated && !kHasMask;  // the scale folded into the exponent
    const int j0 = n * kBlockN;
    Tensor s_rc = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));
    float m_use[kRows];
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float mx;
      RowMax4 row_max;
      if constexpr (kFolded) {
        CUTE_UNROLL
        for (int c = 0; c < kCols; ++c) row_max.add(c, s_rc(r, c));
        mx = quad_max(row_max.value()) * scale2[r];
      } else {
        const int row_in_tile = get<0>(cS_rc(r, 0));
        const int i = m0 + row_in_tile;
        const bool row_valid = i < q_len;
        int lo = 0, hi = 0;
        if constexpr (kPredicated && kCausal) {
          lo = ss.row_lo[row_in_tile], hi = ss.row_hi[row_in_tile];
        } else if constexpr (kPredicated) {
          hi = row_valid ? kv_len : 0;  // row_keys<false>
        }
        // The byte selectors of the thread's first two columns serve all its columns
        // (mask_words.cuh).
        [[maybe_unused]] uint32_t selector[2] = {0u, 0u};
        if constexpr (kHasMask) {
          CUTE_UNROLL
          for (int c = 0; c < 2; ++c) {
            const int j = j0 + get<1>(cS_rc(r, c));
            selector[c] = kMask == MaskKind::kBool ? bool_mask_selector(mask, b, h, i, j)
                                                   : additive_mask_selector<T>(mask, b, h, i, j);
          }
        }
        CUTE_UNROLL
        for (int c = 0; c < kCols; ++c) {
          const int col = get<1>(cS_rc(r, c));
          const int j = j0 + col;
          // Rows >= q_len have no mask entries: their (stale) words are never used.
          bool allowed = (!kPredicated || (j >= lo && j < hi)) && (!kHasMask || row_valid);
          [[maybe_unused]] const uint32_t word =
              kHasMask ? s_mask[row_in_tile * Kt::kMaskLd + col] : 0u;
          if constexpr (kMask == MaskKind::kBool) {
            allowed = allowed && bool_mask_allows(word, selector[c % 2]);
          }
          float y;
          if constexpr (kMask == MaskKind::kAdditive) {
            // -inf hides the key whatever its score: a NaN key must not give NaN + -inf = NaN.
            const float m = additive_mask_value<T>(mask, word, selector[c % 2]);
            allowed = allowed && m != kNegInf;
            y = fmaf(s_rc(r, c), scale2[r], m * kLog2e);
          } else {
            y = s_rc(r, c) * scale2[r];
          }
          y = allowed ? y : kNegInf;
          s_rc(r, c) = y;
          // fmaxf drops NaN; a NaN logit still makes the row NaN through e = 2^NaN in l and P V.
          row_max.add(c, y);
        }
        mx = quad_max(row_max.value());
      }
      const float m_new = fmaxf(st[r].m, mx);
      // While the row has seen no allowed key (m = -inf) every weight is 0: exponentiate against 0
      // instead of forming -inf - (-inf).
      m_use[r] = m_new == kNegInf ? 0.f : m_new;
      // O's factor is the row's 2^(m_old - m_new) (0 while the row was empty), whatever this
      // thread's partial l; rescale_by() moves the thread's partial sums by the same factor (it
      // reads it only where the partial l is not 0, and then m_use = m_new): one exponential per
      // row, and O and the sums moved alike. (So a warp with an empty row, padding rows of the last
      // tile in a predicated block, never skips O's rescale: a select here to make that factor 1
      // costs the other warps more, 8-13 instructions per block.)
      alpha[r] = exp2_approx(st[r].m - m_use[r]);
      rescale_by(st[r], m_new, alpha[r]);
    }
    // l and u take a row's even and odd columns in two partial sums, the odd ones added at the end
    // of the block (the sums are linear in their terms). With one chain each, ptxas left their 128
    // FADD and FFMA to a tail after the block's last exponential, while the warp waited on the SFU
    // between exponentials (one MUFU.EX2 per 8 cycles of a warp); with two it interleaves them
    // (results/sass/softmax_schedule.md). t stays one chain: a second one spills at D = 128.
    float l_odd[kRows] = {}, u_odd[kRows] = {};
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c) {
        const float x = kFolded ? fmaf(s_rc(r, c), scale2[r], -m_use[r]) : s_rc(r, c) - m_use[r];
        const float e = exp2_approx(x);
        s_rc(r, c) = e;
        // A hidden key has e = 0 and x = -inf: clamp x so that it adds 0, not 0 * -inf = NaN.
        // Where no key is hidden (kFolded) x is finite for finite scores, and the guard below
        // recomputes a row whose entropy a non-finite score made NaN: no clamp (one instruction
        // of the three the statistics add per score).
        float& l = c % 2 == 0 ? st[r].l : l_odd[r];
        float& u = c % 2 == 0 ? st[r].u : u_odd[r];
        accumulate(l, st[r].t, u, kFolded ? x : clamp_finite(x), e);
      }
      st[r].l += l_odd[r];
      st[r].u += u_odd[r];
    }
  };
  // Logit softcapping (docs/math.md section 6): the scores x of a block become the x' whose scaled
  // logits are the capped ones, before the additive mask (cute_utils.cuh: softcap_row).
  auto cap_scores = [&](auto& acc_s) {
    Tensor s_rc = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const SoftcapRow cr = softcap_row(scale2[r], kLog2e, p.softcap.cap, p.softcap.inv_cap);
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c) s_rc(r, c) = cr.out * tanh_of_exp2(s_rc(r, c) * cr.in);
    }
  };
  auto softmax_of = [&](const int n, auto& acc_s) {
    if (capped) cap_scores(acc_s);
    if (tb.predicated(n) || negative_scale) {
      softmax(n, acc_s, std::true_type{});
    } else {
      softmax(n, acc_s, std::false_type{});
    }
  };
  // Dropout (docs/math.md section 6): the dropped weights of block n's P (16-bit, in registers)
  // become 0; the kept ones' 1 / (1 - p') multiplies O once, in the epilogue.
  auto drop_weights = [&](const int n, auto& rP) {
    if (!(kCausal && p.dropout.on())) return;
    Tensor p_rc = make_tensor(rP.data(), acc_rowcol(rP.layout()));
    for_each_dropout_decision<true>(p.dropout, static_cast<int64_t>(b) * heads + h, m0, n * kBlockN,
                                    cS_rc, [&](int r, int c, bool kept) {
                                      if (!kept) p_rc(r, c) = Element(0);
                                    });
  };
  // O *= alpha, skipped (warp-uniformly) where no row of the warp has a new max (alpha = 1 in
  // every lane: the product is O itself), as in the sm80 family: D / 2 FMUL per thread. (The P V
  // that last read O has completed: O is in registers.)
  auto rescale_o = [&] {
    if (!__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) return;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int d = 0; d < size<1>(o_rc); ++d) o_rc(r, d) *= alpha[r];
    }
  };

  // The key blocks from the last to the first, software-pipelined as FlashAttention-3's
  // intra-warpgroup overlap: S of block n is issued, then P V of the block before it, and the
  // softmax of block n runs while that P V is in the tensor cores. Across the two consumer
  // warpgroups the scheduler barriers alternate the issues, so that one's softmax overlaps the
  // other's products.
  Tensor acc_s = partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
  if (any_block) {
    int n = tb.n_end - 1;
    issue_s(n, acc_s);
    scheduler_arrive<Ops>(wg);
    publish_next_tile();
    Ops::template wgmma_wait<0>();
    s_landed(n, acc_s);
    softmax_of(n, acc_s);  // O is still 0: its factor is moot
    Tensor rP = convert_fragment<Element>(acc_s);
    drop_weights(n, rP);
    typename Kt::PipelineState v_state = read_state;
    ++read_state;
    for (--n; n >= tb.n_begin; --n) {
      issue_s(n, acc_s);
      rescale_o();
      issue_pv(rP, v_state);
      scheduler_arrive<Ops>(wg);
      Ops::template wgmma_wait<1>();  // S of block n (wgmma batches complete in order)
      s_landed(n, acc_s);
      softmax_of(n, acc_s);
      Ops::template wgmma_wait<0>();  // P V of the block before
      warpgroup_fence_operand(acc_o);
      warpgroup_fence_operand(rP);
      pipeline_v.consumer_release(v_state);
      rP = convert_fragment<Element>(acc_s);
      drop_weights(n, rP);
      v_state = read_state;
      ++read_state;
    }
    rescale_o();
    issue_pv(rP, v_state);
    Ops::template wgmma_wait<0>();
    warpgroup_fence_operand(acc_o);
    pipeline_v.consumer_release(v_state);
  }

  // Epilogue: add the 4 lanes' partial sums, finish each row (online_stats.h), O / l, and write O
  // as 4-byte pairs of adjacent columns straight from the registers.
  Tensor cO = thr_o.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor cO_rc = make_tensor(cO.data(), acc_rowcol(cO.layout()));
  // From opaque copies of the tile's indices (cute_utils.cuh): the row setup forms
  // (b H + h) Lq too, and at D = 256 ptxas kept that product and the output's offset across the key
  // loop, spilling them.
  const int b_e = opaque(b), h_e = opaque(h), m0_e = opaque(m0);
  const int64_t row0 = (static_cast<int64_t>(b_e) * heads + h_e) * q_len + m0_e;
  T* const out = static_cast<T*>(p.out.data) + p.out.offset(b_e, h_e, m0_e);
  // Whether a row of the call holds a non-finite value: P V forms 0 * NaN for a hidden key's NaN
  // value, so the fallback recomputes such calls by the hidden-keys rule (params.h: nonfinite).
  bool nonfinite = false;
  __syncwarp();  // ss.row_n of the warp's rows, written by the lanes that hold them
  // The kept weights' dropout factor, applied to O here rather than to each weight.
  const float o_scale = kCausal && p.dropout.on() ? p.dropout.keep_scale : 1.f;
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    RowStats<float> row = st[r];
    row.l = quad_sum(row.l);
    if constexpr (kStats) {
      row.t = quad_sum(row.t);
      row.u = quad_sum(row.u);
    }
    const RowResult<float> res = finalize<float, Log2>(row);
    const float o_row_scale = res.inv_l * o_scale;
    const int i = get<0>(cO_rc(r, 0));  // in the tile
    if (m0_e + i >= q_len) continue;
    const int n_i = kBandedOrMasked ? ss.row_n[i] : kv_len;
    static_assert(decltype(size<1>(o_rc))::value % 2 == 0);
    nonfinite |= !is_finite(res.lse);
    // (Finite inputs give a finite entropy: see the unclamped accumulate above.)
    if constexpr (kStats) nonfinite |= !is_finite(res.entropy);
    if constexpr (kMask == MaskKind::kAdditive) {
      // A row with keys to see whose every weight vanished: its finite mask values lie below
      // -FLT_MAX / log2(e) (finfo.min) and became -inf in log2 units. Such keys are not hidden
      // (docs/math.md section 8); the fallback's natural units keep them, so it recomputes.
      nonfinite |= row.l == 0.f && n_i > 0;
    }
    CUTE_UNROLL
    for (int d = 0; d < size<1>(o_rc); d += 2) {
      // Columns d and d + 1 of the fragment are adjacent (the first mode of the column layout).
      const int col = get<1>(cO_rc(r, d));
      const float o0 = o_rc(r, d) * o_row_scale, o1 = o_rc(r, d + 1) * o_row_scale;
      nonfinite |= !is_finite(o0) || !is_finite(o1);
      *reinterpret_cast<uint32_t*>(out + i * p.out.sl + col) = pack2<T>(o0, o1);
    }
    if (lane % 4 == 0) {
      const int64_t row_idx = row0 + i;
      p.lse[row_idx] = res.lse;
      if constexpr (kStats) {
        store_row_statistics(p, row_idx, res, n_i, kCausal && has_sink_entry(p.sinks, h));
      }
    }
  }
  if (nonfinite && p.nonfinite != nullptr) *p.nonfinite = 1;  // (all store the same value)
}

// The producer's loads of one tile (the consumers are done with the tile before's Q): Q, then K and
// V of every key block into the stages from write_state on.
template <typename Kt>
__device__ __forceinline__ void produce(const KernelArgs<Kt>& args, typename Kt::SharedStorage& ss,
                                        typename Kt::Pipeline& pipeline_k,
                                        typename Kt::Pipeline& pipeline_v,
                                        typename Kt::PipelineState& write_state,
                                        const ProducerTile& pt) {
  using Ops = typename Kt::Ops;
  constexpr int kBlockM = Kt::kBlockM, kBlockN = Kt::kBlockN, kHeadDim = Kt::kHeadDim;
  const FwdParams<float>& p = args.p;
  const int h = pt.h, b = pt.b;
  const int kv_head = h / static_cast<int>(p.heads / p.kv_heads);  // GQA
  const int q_len = static_cast<int>(p.q_len), kv_len = static_cast<int>(p.kv_len);
  const int heads = static_cast<int>(p.heads), kv_heads = static_cast<int>(p.kv_heads);
  const int batch = static_cast<int>(p.batch);
  // The global tensors as coordinates for TMA, the tiles of this block.
  Tensor mQ = args.tma_q.get_tma_tensor(make_shape(q_len, kHeadDim, heads, batch));
  Tensor mK = args.tma_k.get_tma_tensor(make_shape(kv_len, kHeadDim, kv_heads, batch));
  Tensor mV = args.tma_v.get_tma_tensor(make_shape(kv_len, kHeadDim, kv_heads, batch));
  Tensor gQ = local_tile(mQ(_, _, h, b), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                         make_coord(pt.m_block, 0));  // (M, D)
  Tensor gK = local_tile(mK(_, _, kv_head, b), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                         make_coord(_, 0));  // (N, D, blocks)
  Tensor gV = local_tile(mV(_, _, kv_head, b), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                         make_coord(_, 0));  // (N, D, blocks)
  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Kt::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Kt::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Kt::SmemLayoutK{});
  auto [tQgQ, tQsQ] = tma_partition(args.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ),
                                    group_modes<0, 2>(gQ));
  auto [tKgK, tKsK] = tma_partition(args.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK),
                                    group_modes<0, 2>(gK));
  auto [tVgV, tVsV] = tma_partition(args.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV),
                                    group_modes<0, 2>(gV));

  Ops::TxBarrier::arrive_and_expect_tx(&ss.barrier_q, Kt::kTmaBytesQ);
  copy(args.tma_q.with(ss.barrier_q), tQgQ, tQsQ);
  // Not unrolled: each iteration is a few instructions, and the producer has 24 registers.
#pragma unroll 1
  for (int n = pt.n_end - 1; n >= pt.n_begin; --n) {
    pipeline_k.producer_acquire(write_state);
    copy(args.tma_k.with(*pipeline_k.producer_get_barrier(write_state)), tKgK(_, n),
         tKsK(_, write_state.index()));
    pipeline_v.producer_acquire(write_state);
    copy(args.tma_v.with(*pipeline_v.producer_get_barrier(write_state)), tVgV(_, n),
         tVsV(_, write_state.index()));
    ++write_state;
  }
}

// A 1-D grid of 384 threads (three warpgroups) per block, one block per SM: each block walks the
// tiles launch_order.h's persistent_tile deals it (one, where the grid has a block per tile). In a
// persistent grid the producer loads the next tile's K and V, and its Q once the consumers have
// issued and waited for the tile's last S, while the consumers finish the tile (its last softmax,
// P V and the epilogue), which a block per tile leaves to a new block's start: its barriers'
// setup, its first loads' latency and a first softmax that no product overlaps.
template <typename T, typename Kt, bool kCausal, MaskKind kMask, bool kStats>
__global__ void __launch_bounds__(Kt::kThreads, 1)
    forward_kernel([[maybe_unused]] const __grid_constant__ KernelArgs<Kt> args) {
  // wgmma and setmaxnreg exist only in the architecture-specific sm_90a target; the build compiles
  // this family for that target alone (scripts/kernel_list.py: gencode), and the guard keeps any
  // other device pass from seeing them.
#if (defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)) || \
    defined(ENTROPY_ATTN_CUDA_EMULATION)
  using Ops = typename Kt::Ops;
  extern __shared__ __align__(1024) char ea_sm90_fwd_smem[];
  auto& ss = *reinterpret_cast<typename Kt::SharedStorage*>(ea_sm90_fwd_smem);
  const FwdParams<float>& p = args.p;

  const int warp_group = Ops::warp_group_idx();
  using Pipeline = typename Kt::Pipeline;
  const auto pipe_params =
      tma_pipeline_params<Pipeline>(warp_group, Kt::kTmaBytesKV, Kt::kConsumerThreads);
  // Warp 0 initializes the barriers of both pipelines and Q's; the barrier below publishes them.
  Pipeline pipeline_k(ss.pipeline_k, pipe_params, Shape<_1, _1, _1>{});
  Pipeline pipeline_v(ss.pipeline_v, pipe_params, Shape<_1, _1, _1>{});
  if (threadIdx.x == 0) {
    Ops::TxBarrier::init(&ss.barrier_q, 1);
    Ops::TxBarrier::init(&ss.barrier_q_empty, Kt::kConsumerThreads);
    // The first tile, in round 0's slot (the launcher's grid has at most a block per tile: every
    // block has one). Through shared memory rather than registers kept across the producer's
    // setmaxnreg.dec: at D = 256 its 24 registers spilled one of them.
    ss.next_tile[0] = producer_tile(forward_tile<Kt, kCausal, kMask>(p, blockIdx.x));
  }
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  if (warp_group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Kt::kProducerRegs>();
    if (threadIdx.x != 0) return;
    Ops::prefetch_tma_descriptor(args.tma_q.get_tma_descriptor());
    Ops::prefetch_tma_descriptor(args.tma_k.get_tma_descriptor());
    Ops::prefetch_tma_descriptor(args.tma_v.get_tma_descriptor());
    auto write_state = cutlass::make_producer_start_state<Pipeline>();
#pragma unroll 1
    for (uint32_t round = 0;; ++round) {
      if (round > 0) {
        // The consumers are done with Q, and have written the next tile.
        Ops::TxBarrier::wait(&ss.barrier_q_empty, (round - 1) % 2);
        compiler_fence();
      }
      const ProducerTile tile = ss.next_tile[round % 2];
      if (tile.m_block < 0) break;
      produce<Kt>(args, ss, pipeline_k, pipeline_v, write_state, tile);
    }
    // Stay until the consumers have released every stage: the block's barriers must outlive
    // every arrival on them.
    pipeline_k.producer_tail(write_state);
    pipeline_v.producer_tail(write_state);
  } else {
    cutlass::arch::warpgroup_reg_alloc<Kt::kConsumerRegs>();
    typename Kt::PipelineState read_state;
    // Warpgroup 0 issues first: warpgroup 1 hands it the tensor cores once for all tiles (each
    // tile's last hand-off to warpgroup 0 is the next tile's first; a block without a key block
    // ends with this arrival pending, as any block ends with its last).
    if (threadIdx.x / 128 == 2) scheduler_arrive<Ops>(1);
    // Only the tile index lives across a tile's key loop (its round follows from it), and the
    // tile count is read again from the parameters: values kept over the loop spilled.
#pragma unroll 1
    for (uint32_t index = blockIdx.x; index < static_cast<uint32_t>(tile_count<Kt>(p));
         index = next_persistent_tile(index, blockIdx.x, gridDim.x)) {
      consume<T, Kt, kCausal, kMask, kStats>(args, ss, pipeline_k, pipeline_v, read_state, index);
    }
  }
#endif
}

}  // namespace fwd_impl
}  // namespace entropy_attn::cuda::sm90
