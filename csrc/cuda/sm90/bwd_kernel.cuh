// Backward main kernel of the Hopper family (sm_90a, bf16/fp16): FlashAttention-3's backward
// structure (TMA, mbarriers, wgmma, warp specialization), written with CuTe, with the per-row scale
// lambda_i and the entropy and sum p^2 gradient terms of docs/math.md section 3. The per-element
// math is online_stats.h's (logit_grad), the functions the CPU kernel and the other CUDA families
// call. The delta preprocess and the dq / d lambda postprocess are the sm80 family's kernels (CUDA
// cores; bwd_launch.cuh launches them around this one).
//
// One thread block of three warpgroups owns a block of kBlockN = 128 keys (64 at D = 256) of one
// (kv head, batch) and walks the query blocks (kBlockM = 64 rows) of every query head of its GQA
// group, so that dK and dV, summed over the group, stay in registers:
//   warpgroup 0, the producer: gives its registers back (setmaxnreg.dec to 24); one thread loads
//     K and V once (TMA, one mbarrier) and then Q and dO of every query block into a 2-stage ring
//     (cutlass::PipelineTmaAsync, one pipeline each);
//   warpgroups 1 and 2, the consumers (240 registers): warpgroup w accumulates dK and dV of keys
//     [64 w, 64 w + 64) of the block (at D = 256 of every key of the block, columns
//     [128 w, 128 w + 128): BwdTraits::kDkvSplitsD), and computes S and dP for half of each slice
//     of the block's keys (BwdTraits::slices: one slice, so its own 64 keys, at D = 64 and in a
//     D = 128 loss of the output alone without a mask; else at D = 128 keys [32 w, 32 w + 32) of
//     each 64-key slice; at D = 256 keys [32 w, 32 w + 32) of the block). Per query block:
//       the five per-row values (lse, lambda, delta, the statistic gradients) into shared
//                                    memory by cp.async, issued while the block before finishes
//                                    (the masked kernels: at the block's start, with an L1
//                                    prefetch of the block's mask lines), waited for
//                                    once S and dP of the first slice are issued;
//       S = Q K^T, dP = dO V^T       wgmma SS (queries x keys), per slice both issued, then
//                                    waited in turn; each thread holds two query rows;
//       s = lambda_i x (+ mask), p = 2^(s log2 e - lse_i log2 e)   per element, P to shared
//                                    memory (T); once P of the warpgroup's keys is there (a
//                                    barrier of the two warpgroups),
//       dV += P^T dO                 wgmma SS, P^T and dO^T read MN-major, in flight during
//                                    a dS step (FlashAttention-3 issues it before its dS
//                                    stores; here before the dS step itself): with one slice
//                                    that slice's; with two slice 0's for warpgroup 0 (its
//                                    keys are that slice) and slice 1's for warpgroup 1 (the
//                                    masked kernels: both slice 1's);
//       dS = logit_grad(p, dP, s, delta_i, g_i)   (online_stats.h), 0 where p = 0 (a select
//                                    that blocks off every edge skip: kEveryKey); with an
//                                    additive mask whose gradient is asked for (no statistics'
//                                    gradients: kLogitGrads), added into it by atomics;
//       lambda_i dS, and dS unless g_scaled (below), to shared memory (T), then, after a
//       barrier of the two warpgroups (lambda_i dS alone: scaled_logit_grad, in one FFMA and
//       an FMUL per entry),
//       G = dS K                     wgmma SS (queries x D, the warpgroups splitting D), added to
//                                    dq_accum with 8-byte fp32 atomics, or (a bulk_dq_accum
//                                    layout, launch.h) stored to a shared fp32 tile that warp 1
//                                    of the producer warpgroup adds into dq_accum with one bulk
//                                    reduction (cp.reduce.async.bulk), FlashAttention-3's way:
//                                    a 32 KB copy in place of 4096 atomics per block and step;
//       dK += (lambda dS)^T Q        wgmma SS, in flight into the next block, which waits for
//                                    it once its own S and dP are issued (the masked kernels:
//                                    at the block's end).
//     lambda goes into dK's operand. Where d lambda is asked for (d_row_scale), not into the dS of
//     G: the postprocess forms dq = lambda G and d lambda = q . G from the unscaled G (docs/math.md
//     section 3). Else (g_scaled, the common call: a scale policy, no scale tensor that needs a
//     gradient; the kernels without a mask: kScalesG) G's operand
//     is lambda dS too, so that G is dq itself and the warps store one dS tile instead of two (a
//     conversion and a 4-byte store less per two elements).
//     (FlashAttention-3 at D = 128 keeps P^T and dS^T in registers as the A operands of dV and dK;
//     with five per-row values instead of two, the transposed layout's 16 query columns per thread
//     cost registers that dK and dV need, so P and dS go through shared memory.)
// dK and dV (zero for a key block no query row sees) are written from the registers, summed over
// the GQA group, in T, contiguous (B, Hkv, Lk, D).
//
// Edge tiles: TMA zero-fills the rows of Q and dO past q_len and of K and V past kv_len; such
// elements are masked (p = 0, so dS = 0) and such rows never written. A tile that needs no
// per-element predicate (no mask, not crossing the causal diagonal, a window's edge or a document
// boundary, no partial block) skips it. The instantiations compiled with causality are the general
// ones (launch.h): any KeyPattern (key_ranges.cuh: a sliding window, either alignment, packed
// documents, or none), softcap, sinks and dropout; a key block walks only the query blocks from
// the first row whose range ends past it to the last whose range starts before its end. Sinks need
// nothing here (lse and the statistics read include the sink; its gradient is the host's). Logit
// softcapping replaces S by the scores whose scaled logits are the capped ones before the
// per-element step (a uniform branch), and its derivative multiplies dS. Dropout regenerates the
// forward's decisions per slice (cute_utils.cuh: for_each_dropout_decision, one Philox call
// per 8 weights): the P of dV is the dropped one, p z / (1 - p'), and dP is multiplied by
// z / (1 - p') before dS (docs/math.md section 6).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

// cute/tensor.hpp first: the sm90 atom headers rely on what it declares.
#include <cute/tensor.hpp>

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_conversion.h>
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
#include "../logit_grads.cuh"
#include "../mask_words.cuh"
#include "../params.h"
#include "../sm80/bwd_kernel.cuh"  // its preprocess (preprocess_kernel below)
#include "launch.h"
#include "ops.cuh"
#include "wgmma_utils.cuh"

namespace entropy_attn::cuda::sm90 {
namespace bwd_impl {

using namespace cute;

// Tile traits. 64 query rows by 128 keys (FlashAttention-3's backward tile at D = 128), by 64 keys
// at D = 256 (FlashAttention-3's there too). Registers per consumer thread: dK and dV D / 2 each at
// D = 64 and 128 (64 + 64 at D = 128), where each warpgroup owns 64 keys of them; at D = 256 each
// owns half of D of the 64 keys (kDkvSplitsD), 64 + 64 again; S and dP 32 each (16 in two slices,
// and at D = 256), G D / 4.
// Shared memory: K, V (kBlockN x D), Q and dO (64 x D, two stages each), P, dS, lambda dS (64 x
// kBlockN; one buffer each: the statistics barrier of a query block, before its P and dS stores,
// comes after every product of the one before), the row statistics (two buffers: a block's copies
// start before that barrier): 178 KB at D = 128, 114 KB at D = 64, 219 KB at D = 256; with bulk
// reductions also G's fp32 tile (64 x (D + 8)): 212 KB and 132 KB (at D = 256 its 66 KB would
// make 285 KB, more than a block may have: G goes by atomics there, kBulkDqFits).
template <typename T, int kHeadDim_, typename Ops_ = Sm90Ops>
struct BwdTraits {
  using Ops = Ops_;  // the instructions (ops.cuh)
  using Element = typename ::entropy_attn::cuda::CuteElement<T>::type;
  static constexpr int kHeadDim = kHeadDim_;
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256,
                "head dims of the Hopper family");
  static constexpr int kBlockM = 64;                          // query rows per block
  static constexpr int kBlockN = kHeadDim == 256 ? 64 : 128;  // keys per thread block
  // At D = 256 the warpgroups split dK and dV along D rather than the keys: 64 keys each would
  // take 128 + 128 accumulator registers of their 240. Each warpgroup's dV and dK then read P and
  // dS of both (kOwnP is off), and its wgmma are m64n128 (2 KB of the A operand and 4 KB of the B
  // per 128K multiply-adds, within the SM's 128 bytes per cycle).
  static constexpr bool kDkvSplitsD = kHeadDim == 256;
  static constexpr bool kBulkDqFits = bulk_dq_fits(kHeadDim);  // (launch.h)
  static constexpr int kStages = 2;
  static constexpr int kConsumerThreads = 256;
  static constexpr int kThreads = 128 + kConsumerThreads;
  static constexpr int kDqThreads = kConsumerThreads + 32;  // the consumers and the dq writer
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;

  // S = Q K^T and dP = dO V^T: (queries, keys) over slices(narrow) slices of the key block, one
  // after the other, each warpgroup taking half of a slice's keys.
  //   One slice (D = 64, and D = 128 where the registers allow): a warpgroup's 64 keys as one
  //     m64n64 product each (S and dP 32 registers each), FlashAttention-3's backward tile. At
  //     N = 32 each wgmma's shared-memory operands (64 x 16 of A, N x 16 of B: 3 KB for 32K
  //     multiply-adds) take 24 cycles of the SM's 128 bytes per cycle against 16 of tensor-core
  //     work, about 2/3 of the pipe's rate; at N = 64 the two balance (4 KB, 32 cycles each).
  //   Two slices of 64 keys, 32 per warpgroup (D = 128, `narrow`: the steps that keep the
  //     logits s for the statistics' gradients, softcap or dropout, and every step of the masked
  //     kernels), so that S and dP hold 16 registers each beside dK and dV's 64 + 64: whole
  //     slices spilled 88-112 bytes there (the kGrads step of full attention) and 20 bytes (the
  //     step of the causal bool-masked kernel without kGrads). (The kGrads step's p, which the
  //     source forms again for dS, ptxas holds from the P step beside s; made to form it again,
  //     whole slices fit, but a second exponential per score made them slower in the model:
  //     docs/cuda.md, 2026-12-06.)
  static constexpr int slices(bool narrow) { return kHeadDim == 128 && narrow ? 2 : 1; }
  template <int kSlices>
  using TiledMmaSdP = decltype(make_tiled_mma(
      typename Ops::template Gmma<
          decltype(GMMA::ss_op_selector<
                   Element, Element, float,
                   Shape<Int<kBlockM>, Int<kBlockN / kSlices / 2>, Int<kHeadDim>>>())>{},
      Layout<Shape<_1, _2, _1>>{}));
  // dV += P^T dO and dK += (lambda dS)^T Q: (keys, D), the warpgroups along the keys; every
  // operand read MN-major (the transposed views of tiles stored K-major).
  //   (kDkvSplitsD: the warpgroups along D.)
  using TiledMmadKV = decltype(make_tiled_mma(
      typename Ops::template Gmma<
          decltype(GMMA::ss_op_selector<
                   Element, Element, float,
                   Shape<Int<kDkvSplitsD ? kBlockN : kBlockN / 2>,
                         Int<kDkvSplitsD ? kHeadDim / 2 : kHeadDim>, Int<kBlockM>>,
                   GMMA::Major::MN, GMMA::Major::MN>())>{},
      Layout<Shape<Int<kDkvSplitsD ? 1 : 2>, Int<kDkvSplitsD ? 2 : 1>, _1>>{}));
  // G = dS K: (queries, D), the warpgroups along D; dS K-major, K^T MN-major.
  using TiledMmaG = decltype(make_tiled_mma(
      typename Ops::template Gmma<
          decltype(GMMA::ss_op_selector<Element, Element, float,
                                        Shape<Int<kBlockM>, Int<kHeadDim / 2>, Int<kBlockN>>,
                                        GMMA::Major::K, GMMA::Major::MN>())>{},
      Layout<Shape<_1, _2, _1>>{}));

  // 128-byte swizzled tiles, K-major as TMA (Q, dO two stages; K, V) or the accumulator stores
  // (P, dS, lambda dS: (queries, keys), a thread's adjacent columns adjacent keys) write them; the
  // transposed views Q^T, dO^T, K^T, P^T and dS^T are the same bytes read MN-major.
  using SmemLayoutQ = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                             Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kStages>>{},
                                 Stride<Int<kBlockM>, _1, Int<kBlockM * kHeadDim>>{})));
  using SmemLayoutK = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                             Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutKt =
      decltype(composition(SmemLayoutK{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{},
                                                      Stride<Int<kBlockN>, _1>{})));
  using SmemLayoutPdS = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                               Shape<Int<kBlockM>, Int<kBlockN>>{}));
  using SmemLayoutPdSt =
      decltype(composition(SmemLayoutPdS{}, make_layout(Shape<Int<kBlockN>, Int<kBlockM>>{},
                                                        Stride<Int<kBlockM>, _1>{})));

  using TmaQ = decltype(make_tma_copy(
      typename Ops::TmaLoad{},
      make_tensor(make_gmem_ptr(static_cast<const Element*>(nullptr)), ShapeQKV{}, StrideQK{}),
      take<0, 2>(SmemLayoutQ{})));
  using TmaK = decltype(make_tma_copy(
      typename Ops::TmaLoad{},
      make_tensor(make_gmem_ptr(static_cast<const Element*>(nullptr)), ShapeQKV{}, StrideQK{}),
      SmemLayoutK{}));

  static constexpr uint32_t kTmaBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kTmaBytesK = kBlockN * kHeadDim * sizeof(Element);

  using Pipeline = typename Ops::template Pipeline<kStages>;
  using PipelineState = cutlass::PipelineState<kStages>;

  // The per-row values of a query block: lse, lambda, delta, g_entropy, g_sum_p2.
  static constexpr int kStatLse = 0, kStatLambda = 1, kStatDelta = 2, kStatGH = 3, kStatGU = 4;
  static constexpr int kRowStats = 5;

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>> k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>> v;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> dout;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutPdS>> p;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutPdS>> ds;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutPdS>> ds_scaled;
    alignas(16) float rows[2][kRowStats][kBlockM];
    typename Pipeline::SharedStorage pipeline_q, pipeline_do;
    alignas(8) uint64_t barrier_kv;
    // The first query block the thread block walks (main_kernel): the consumers read it where they
    // form a block's rows instead of holding it across the loop (a register they lack at D = 128,
    // causal: ptxas spilled it to local memory).
    int m_begin;
    // A deterministic backward's (params.h: dq_turns): what the key block adds to the turn counters
    // it has waited for, the distance to the next key block with a walk (key_ranges.cuh:
    // walking_block_from), formed once by thread 0 for the dq writer or the turn keeper.
    int turn_step;
    // G of a query block, laid out as a block of bulk_dq_accum (launch.h); last, so that a launch
    // that adds G by atomics leaves it out (smem_bytes below). One row where it does not fit.
    alignas(128) float dq[kBulkDqFits ? kBlockM : 1][kHeadDim + kBulkDqPad];
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static constexpr int kSmemBytesWithoutDq = offsetof(SharedStorage, dq);
  static_assert(kBlockM == kBulkDqRows, "bulk_dq_accum's rows are whole query blocks");
  static_assert(kSmemBytes <= 227 * 1024);
};

// The kernel's arguments: the call's parameters, the TMA descriptors built on the host, and the
// sources of the per-row values indexed by their kStat* numbers (null for an absent gradient), so
// that a thread finds the one it copies by one indexed load of the parameters instead of a chain
// of comparisons.
template <typename Kt>
struct KernelArgs {
  BwdParams<float> p;
  typename Kt::TmaQ tma_q, tma_do;
  typename Kt::TmaK tma_k, tma_v;
  const float* row_stats[Kt::kRowStats];
};

// The main kernel's arguments for a call: its parameters and the TMA descriptors of q, dout, k and
// v (launch_backward, bwd_launch.cuh, and the CPU emulation, tests/cpp/sm90_emulation.h).
template <typename Kt>
KernelArgs<Kt> make_kernel_args(const BwdParams<float>& p) {
  using Element = typename Kt::Element;
  constexpr int kD = Kt::kHeadDim;
  using TmaLoad = typename Kt::Ops::TmaLoad;
  const auto q_box = take<0, 2>(typename Kt::SmemLayoutQ{});
  const typename Kt::SmemLayoutK kv_box{};
  const auto tma = [&](const View4& t, int64_t len, int64_t heads, const auto& box) {
    return make_tma_copy(TmaLoad{}, tma_tensor<Element, kD>(t, len, heads, p.batch), box);
  };
  static_assert(Kt::kStatLse == 0 && Kt::kStatLambda == 1 && Kt::kStatDelta == 2 &&
                Kt::kStatGH == 3 && Kt::kStatGU == 4 && Kt::kRowStats == 5);
  return KernelArgs<Kt>{p,
                        tma(p.q, p.q_len, p.heads, q_box),
                        tma(p.dout, p.q_len, p.heads, q_box),
                        tma(p.k, p.kv_len, p.kv_heads, kv_box),
                        tma(p.v, p.kv_len, p.kv_heads, kv_box),
                        {p.lse, p.row_scale, p.delta, p.g_entropy, p.g_sum_p2}};
}

// The main kernel's dynamic shared memory for a call: without G's tile where G is added by atomics
// (the layout the kernels had before the bulk reductions, and its L1 carve-out).
template <typename Kt>
int smem_bytes(const BwdParams<float>& p) {
  return p.dq_layout.bulk ? Kt::kSmemBytes : Kt::kSmemBytesWithoutDq;
}

// The main kernel's grid: (key blocks, kv heads, batch).
template <typename Kt>
dim3 grid(const BwdParams<float>& p) {
  return dim3(static_cast<unsigned>((p.kv_len + Kt::kBlockN - 1) / Kt::kBlockN),
              static_cast<unsigned>(p.kv_heads), static_cast<unsigned>(p.batch));
}

// Named barriers (ids after CUTLASS's reserved ones). Of the two consumer warpgroups (256
// threads): the row statistics of a query block staged (and the previous block's products done),
// P of both warpgroups in shared memory (two slices, and one at D = 256; with one at D = 64 and
// 128, each warpgroup's own: kOwnP below), and dS of both. Of the consumers and the dq writer (warp
// 1 of the producer warpgroup; bulk reductions only): G's shared tile free (the writer's last bulk
// reduction has read it) and full (both warpgroups' G stored).
constexpr int kStatsBarrier = 0;
constexpr int kPBarrier = 1;
constexpr int kdSBarrier = 2;
constexpr int kdQEmptyBarrier = 3;
constexpr int kdQFullBarrier = 4;
// A deterministic backward's turns in the kernels that add G by atomics (kBulkDq false, which never
// use the dq tile's barriers: their ids there, with the same count), of the consumers and the turn
// keeper (warp 1 of the producer warpgroup: keep_turns): the turn has come, and the consumers'
// atomics are done.
constexpr int kTurnComeBarrier = kdQEmptyBarrier;
constexpr int kTurnDoneBarrier = kdQFullBarrier;
// kEarlyFirst (D = 128): P of slice 0 (the first warpgroup's keys) in shared memory; the second
// warpgroup arrives, the first waits. An id of its own, not kPBarrier's: the second may reach
// kPBarrier (slice 1) before the first has waited here, and would count for the first.
constexpr int kP0Barrier = 5;
// kOwnP (one slice, D = 64 or 128): P of a warpgroup's own keys in shared memory, a barrier of its
// 128 threads
// alone, one id per warpgroup (not kPBarrier, which the other step of the same kernel counts to
// 256 where it runs kEarlyFirst: an id is never used with two counts, which PTX leaves undefined;
// the step is chosen once per thread block today). The last id CUTLASS leaves (8 of 16 reserved).
constexpr int kOwnP0Barrier = 7;
constexpr int kOwnP1Barrier = 6;

// Whether a kernel sums G from lambda dS where no d lambda is asked for (params.h: g_scaled): not
// the masked kernels, at their register limit (the choice spilled 56 bytes at D = 128, causal).
// (Full attention at D = 64 gains from it only together with the warpgroup's slice and kOwnChecks:
// alone it cost 35 instructions per query block, with them it saves 56 and 6% of the modelled
// cycles; results/sass/softmax_schedule.md.)
template <MaskKind kMask>
constexpr bool kScalesG = kMask == MaskKind::kNone;

// The parameters of a launch's main kernel and postprocess: g_scaled where the kernel takes it and
// no d lambda is asked for.
template <MaskKind kMask>
BwdParams<float> launch_params(BwdParams<float> p) {
  p.g_scaled = kScalesG<kMask> && p.d_row_scale == nullptr;
  return p;
}

// The consumer warpgroups: everything but the loads. kBulkDq: G goes to the shared tile for the dq
// writer's bulk reductions (a bulk_dq_accum layout), else to dq_accum by atomics.
template <typename T, typename Kt, bool kCausal, MaskKind kMask, bool kBulkDq>
__device__ __forceinline__ void consume(const KernelArgs<Kt>& args, typename Kt::SharedStorage& ss,
                                        typename Kt::Pipeline& pipeline_q,
                                        typename Kt::Pipeline& pipeline_do, const GridTile tile,
                                        int m_count, int iters) {
  using Element = typename Kt::Element;
  using Ops = typename Kt::Ops;
  constexpr int kBlockM = Kt::kBlockM, kBlockN = Kt::kBlockN, kD = Kt::kHeadDim;
  const BwdParams<float>& p = args.p;
  const int kvh = tile.y, b = tile.z;
  const int j0 = tile.x * kBlockN;
  const int q_len = static_cast<int>(p.q_len), kv_len = static_cast<int>(p.kv_len);
  const int heads = static_cast<int>(p.heads);
  const int group = heads / static_cast<int>(p.kv_heads);
  const int ctid = threadIdx.x - 128;  // thread index among the consumers, [0, 256)
  const bool grads = p.g_entropy != nullptr || p.g_sum_p2 != nullptr;
  // (kScalesG here too, so that the other kernels compile no copy of the dS loop without dS.)
  const bool g_scaled = kScalesG<kMask> && p.g_scaled;

  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Kt::SmemLayoutK{});
  Tensor sKt = make_tensor(make_smem_ptr(ss.k.data()), typename Kt::SmemLayoutKt{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Kt::SmemLayoutK{});
  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Kt::SmemLayoutQ{});
  Tensor sQt = make_tensor(make_smem_ptr(ss.q.data()), typename Kt::SmemLayoutQt{});
  Tensor sdO = make_tensor(make_smem_ptr(ss.dout.data()), typename Kt::SmemLayoutQ{});
  Tensor sdOt = make_tensor(make_smem_ptr(ss.dout.data()), typename Kt::SmemLayoutQt{});
  Tensor sP = make_tensor(make_smem_ptr(ss.p.data()), typename Kt::SmemLayoutPdS{});
  Tensor sPt = make_tensor(make_smem_ptr(ss.p.data()), typename Kt::SmemLayoutPdSt{});
  Tensor sdS = make_tensor(make_smem_ptr(ss.ds.data()), typename Kt::SmemLayoutPdS{});
  Tensor sdSl = make_tensor(make_smem_ptr(ss.ds_scaled.data()), typename Kt::SmemLayoutPdS{});
  Tensor sdSlt = make_tensor(make_smem_ptr(ss.ds_scaled.data()), typename Kt::SmemLayoutPdSt{});

  typename Kt::TiledMmadKV mma_dkv;
  typename Kt::TiledMmaG mma_g;
  // The operands' shared-memory descriptors depend on the thread's warpgroup alone: sliced by its
  // first thread, an index the compiler knows to be warp-uniform (Ops::warp_group_idx, a shuffle),
  // they are formed in uniform registers, where each wgmma reads them. Sliced by ctid, ptxas formed
  // them in vector registers and moved them over (R2UR, 53-64 per query block) before every wgmma
  // (FlashAttention-3 slices its products by the warpgroup too).
  const int wg_tid = (Ops::warp_group_idx() - 1) * 128;
  auto thr_dkv = mma_dkv.get_thread_slice(wg_tid);
  auto thr_g = mma_g.get_thread_slice(wg_tid);
  Tensor tdVrPt = thr_dkv.partition_fragment_A(sPt);     // (MMA, MMA_keys, MMA_queries)
  Tensor tdVrdOt = thr_dkv.partition_fragment_B(sdOt);   // (MMA, MMA_D, MMA_queries, stages)
  Tensor tdKrdSt = thr_dkv.partition_fragment_A(sdSlt);  // (MMA, MMA_keys, MMA_queries)
  Tensor tdKrQt = thr_dkv.partition_fragment_B(sQt);     // (MMA, MMA_D, MMA_queries, stages)
  // G's dS: lambda dS where d lambda is not asked for (g_scaled: G is then dq itself, and dS is not
  // stored), else dS.
  Tensor tGrdS = thr_g.partition_fragment_A(g_scaled ? sdSl : sdS);  // (MMA, MMA_queries, keys)
  Tensor tGrKt = thr_g.partition_fragment_B(sKt);                    // (MMA, MMA_D, MMA_keys)
  // This thread's elements of P, dS and lambda dS in shared memory (the S accumulator's places).
  Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kD>>{});
  Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kD>>{});
  clear(acc_dk);
  clear(acc_dv);

  // The mask with its kind fixed at compile time, so that MaskArg's accessors drop the other
  // kinds' branches.
  MaskArg<float> mask = p.mask;
  mask.kind = kMask;

  if (iters > 0) Ops::TxBarrier::wait(&ss.barrier_kv, 0);
  typename Kt::PipelineState read_state;
  // kAcrossBlocks: a block's dK is waited for in the next block, once its S and dP are issued, so
  // that the tensor cores go from one block's dK to the next block's S without waiting for the
  // warps in between (release_state: the stage that dK reads, its Q, released then, and after the
  // last block below); and the next block's row statistics are copied while that dK runs
  // (copy_row_stats). Not in the masked kernels, which are at their register limit (either spilled
  // 8-16 bytes at D = 128, causal): they copy a block's row statistics at its start and wait for
  // its dK at its end.
  constexpr bool kAcrossBlocks = kMask == MaskKind::kNone;
  typename Kt::PipelineState release_state;
  const bool first = ctid < 128;

  // Logit softcapping (docs/math.md section 6): S of a slice becomes the scores whose scaled logits
  // are the capped ones (cute_utils.cuh: softcap_row, as the forward); the cap's derivative
  // 1 - (s / c)^2 is formed from s in the dS loop, which is why a softcapped call takes the kGrads
  // step (s kept) and never comes with an additive mask (s = c tanh + m). Nor with a bool mask:
  // the masked kernels have no registers for it (ptxas spills); covers() routes both.
  // (The general instantiations, without a mask: launch.h.)
  const bool capped = kCausal && kMask == MaskKind::kNone && p.softcap.on();

  // Dropout goes through the kGrads step, as softcapping does (a third and fourth variant of the
  // step would not be inlined: ptxas gives it a stack frame), and, as softcapping, in the general
  // instantiations without a mask only: the masked ones spill with it at D = 128 (covers()
  // routes such calls).
  constexpr bool kDropout = kCausal && kMask == MaskKind::kNone;
  const bool dropping = kDropout && p.dropout.on();
  constexpr bool kSoftcap = kCausal && kMask == MaskKind::kNone;  // the kernels that may cap

  // The row statistics of query block t into shared memory, buffer t & 1 (padding rows and absent
  // gradients read as 0), by 4-byte cp.async (zero-filled where no value is read) in one commit
  // group: thread ctid copies entries ctid and ctid + 256 of the 5 x 64. Block t + 1's are issued
  // in block t while its dK is in the tensor cores (after the barrier at which every consumer has
  // read buffer (t + 1) & 1 for the last time, in block t - 1), off the path from one block's
  // products to the next's; no register holds the values in between (the masked kernels: at the
  // block's start, kAcrossBlocks).
  const auto copy_row_stats = [&](const int t) {
    const int h = kvh * group + t / m_count;
    const int i0 = (ss.m_begin + t % m_count) * kBlockM;
    const int64_t row0 = (static_cast<int64_t>(b) * heads + h) * q_len + i0;
    float (*srow)[kBlockM] = ss.rows[t & 1];
    constexpr int kEntries = Kt::kRowStats * kBlockM;
    static_assert(Kt::kConsumerThreads <= kEntries && kEntries <= 2 * Kt::kConsumerThreads);
    CUTE_UNROLL
    for (int k = 0; k < 2; ++k) {
      int e = ctid + k * Kt::kConsumerThreads;
      // Formed here, not hoisted out of the loop over the blocks: in the causal kernels at
      // D = 128 the hoisted entries and addresses spilled to local memory.
      asm volatile("" : "+r"(e));
      if (k == 0 || e < kEntries) {
        const int stat = e / kBlockM, r = e % kBlockM;
        const float* src = args.row_stats[stat];
        const bool read = i0 + r < q_len && src != nullptr;
        // (p.lse, never null, stands in for the address of an entry not read.)
        Ops::CpAsync4Zfill::copy(*(read ? src + row0 + r : p.lse), srow[stat][r], read);
      }
    }
    Ops::cp_async_fence();
  };

  // The masked kernels read a mask entry per score in their P steps, loads that ptxas issues after
  // the wait for S: the lines of query block t are prefetched into L1 at the block's start, the
  // time of S's product ahead of them (mask_words.cuh: prefetch_mask_tile). Tried and left out
  // (docs/cuda.md): prefetching block t + 1 during block t (ptxas spilled 4-16 bytes at D = 128
  // wherever it went after the dS barrier), and a mask tile in shared memory as the forwards' (a
  // 32-bit word per score by cp.async: 32 KB written and 32 KB read per query block on the shared
  // memory that the products' operands keep busy; scripts/pingpong_model.py: 5,656 -> 6,029 cycles
  // per block, bool mask, D = 128).
  const auto prefetch_mask = [&](const int t) {
    int mtid = ctid;
    asm volatile("" : "+r"(mtid));  // formed here, not held across the blocks
    const int h = kvh * group + t / m_count;
    const int i0 = (ss.m_begin + t % m_count) * kBlockM;
    prefetch_mask_tile<kMask, Ops, kBlockM, kBlockN, Kt::kConsumerThreads>(
        mask, mask.row_offset(b, h, i0) + j0 * mask.sj, q_len - i0, kv_len - j0, mtid);
  };

  // One query block. kGrads: the entropy / sum p^2 gradients are asked for, softcapping or
  // dropout, so S keeps the logits s (logit_grad and the cap's derivative need them) and p is
  // formed again for dS.
  auto step = [&](const int t, auto grads_tag) {
    constexpr bool kGrads = decltype(grads_tag)::value;
    // S and dP by slices of the key block (BwdTraits::slices): two at D = 128 where s is kept or a
    // mask is read, else one.
    constexpr int kSlices = Kt::slices(kGrads || kMask != MaskKind::kNone);
    constexpr int kSliceN = kBlockN / kSlices;
    using TiledMmaSdP = typename Kt::template TiledMmaSdP<kSlices>;
    // kEarlyFirst: with two slices the keys of the first warpgroup's dV (the first 64) are slice 0,
    // so it issues its dV after slice 0's P step, into the window where the tensor cores otherwise
    // wait for slice 0's dS step; the second issues its own after slice 1's, as both do with one
    // slice. (Its dK early too, behind S and dP of slice 1 or after slice 1's P step: ptxas
    // spilled 56-1,296 and 64-72 bytes. The masked kernels issue both dV after slice 1: 64 bytes
    // of local memory otherwise.)
    constexpr bool kEarlyFirst = kSlices == 2 && kAcrossBlocks;
    const int h = kvh * group + t / m_count;
    const int i0 = (ss.m_begin + t % m_count) * kBlockM;
    // Without a predicate only where every row of the block sees every key of it (key_ranges.cuh)
    // and no mask applies.
    const bool edge =
        kMask != MaskKind::kNone ||
        tile_needs_predicate<kCausal>(p.pattern, i0, j0, kBlockM, kBlockN, q_len, kv_len);
    // The block's row statistics (copy_row_stats, issued during the block before, or here),
    // waited for and published below once S and dP of the first slice are in the tensor cores.
    if constexpr (kMask != MaskKind::kNone) prefetch_mask(t);
    if (!kAcrossBlocks) copy_row_stats(t);
    float (*srow)[kBlockM] = ss.rows[t & 1];

    // The thread's two rows: the keys [klo, khi) each may see (none for a padding row); lambda and
    // lse log2(e) once the row statistics are staged (below).
    int otid = ctid;
    asm volatile("" : "+r"(otid));  // coordinates and addresses formed here, not held across blocks
    TiledMmaSdP mma_sdp;
    auto thr_sdp = mma_sdp.get_thread_slice(ctid);  // the accumulators' places
    // The operands' descriptors (above). At D = 256 (16 k-steps of S and of dP per block: 96
    // descriptors over both stages) they are formed again in each block from an index the compiler
    // cannot hoist: held across the loop, the plain kernels spilled 328 bytes of them to local
    // memory and moved them to uniform registers before each wgmma (325 R2UR in a kernel; 10 with
    // the index opaque).
    auto wg_sdp = mma_sdp.get_thread_slice(kD == 256 ? opaque(wg_tid) : wg_tid);
    Tensor tSrQ = wg_sdp.partition_fragment_A(sQ);  // (MMA, MMA_queries, MMA_D, stages)
    // K and V by slices of the key block: (kSliceN, D, kSlices).
    const auto slice_tile = Shape<Int<kSliceN>, Int<kD>>{};
    Tensor tSrK = wg_sdp.partition_fragment_B(local_tile(sK, slice_tile, make_coord(_, _0{})));
    Tensor tdPrdO = wg_sdp.partition_fragment_A(sdO);  // (MMA, MMA_queries, MMA_D, stages)
    Tensor tdPrV = wg_sdp.partition_fragment_B(local_tile(sV, slice_tile, make_coord(_, _0{})));
    // (query, key) in the slice of every S accumulator, as (thread rows, columns).
    using RowCol = decltype(acc_rowcol(
        thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kSliceN>>{})).layout()));
    constexpr int kRows = decltype(size<0>(RowCol{}))::value;
    constexpr int kCols = decltype(size<1>(RowCol{}))::value;
    static_assert(kRows == 2 && kCols % 2 == 0);
    auto othr = mma_sdp.get_thread_slice(otid);
    Tensor cS0 = othr.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kSliceN>>{}));
    Tensor cS_rc = make_tensor(cS0.data(), acc_rowcol(cS0.layout()));  // (query, key in slice)
    Tensor cG = mma_g.get_thread_slice(otid).partition_C(
        make_identity_tensor(Shape<Int<kBlockM>, Int<kD>>{}));
    Tensor cG_rc = make_tensor(cG.data(), acc_rowcol(cG.layout()));
    // Without kGrads s serves only p (the additive mask adds to s, not to its exponent).
    constexpr bool kFoldScale = !kGrads && kMask != MaskKind::kAdditive;
    float lam[kRows], lam2[kRows], bias2[kRows];
    // The general kernels' steps without kGrads form them only for a block on an edge, the only
    // one that reads them (kSplitChecks below); full attention's are two selects. The kGrads
    // steps form them for every block, as they did before kOwnChecks gave their check a pass of
    // its own (which reads them only on an edge); forming them under the flag there is untried.
    int klo[kRows] = {}, khi[kRows] = {};
    if (!kCausal || kGrads || edge) {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const KeyRange keys = row_keys<kCausal>(p.pattern, i0 + get<0>(cS_rc(r, 0)), q_len, kv_len);
        klo[r] = static_cast<int>(keys.lo), khi[r] = static_cast<int>(keys.hi);
      }
    }
    // Dropout (kGrads): the decisions of each slice's weights (the forward's), bit r * kCols + c;
    // all kept without dropout, whose keep_scale is 1. Drawn here, before the products of the
    // slices hold their accumulators (drawn next to them, the masked kernels spill at D = 128).
    [[maybe_unused]] uint32_t keep_slice[kSlices];
    CUTE_UNROLL
    for (int slice = 0; slice < kSlices; ++slice) keep_slice[slice] = ~0u;
    if (kGrads && dropping) {
      CUTE_UNROLL
      for (int slice = 0; slice < kSlices; ++slice) {
        keep_slice[slice] = dropout_keep_bits<true>(p.dropout, static_cast<int64_t>(b) * heads + h,
                                                    i0, j0 + slice * kSliceN, cS_rc);
      }
    }
    pipeline_q.consumer_wait(read_state);
    pipeline_do.consumer_wait(read_state);
    cutlass::NumericArrayConverter<Element, float, 2> to_pair;

    // One slice of the key block: keys [kSliceN slice, kSliceN (slice + 1)).
    CUTE_UNROLL
    for (int slice = 0; slice < kSlices; ++slice) {
      const auto slice_of = [&](auto& tile) {
        return as_position_independent_swizzle_tensor(
            local_tile(tile, Shape<Int<kBlockM>, Int<kSliceN>>{}, make_coord(_0{}, slice)));
      };
      Tensor tPsP = thr_sdp.partition_C(slice_of(sP));
      Tensor tdSsdS = thr_sdp.partition_C(slice_of(sdS));
      Tensor tdSsdSl = thr_sdp.partition_C(slice_of(sdSl));
      const int jh = j0 + slice * kSliceN;

      // S = Q K^T and dP = dO V^T of the slice, both in flight.
      Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kSliceN>>{});
      Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kSliceN>>{});
      wg_gemm_issue<Ops, true>(mma_sdp, tSrQ(_, _, _, read_state.index()), tSrK(_, _, _, slice),
                               acc_s);
      wg_gemm_issue<Ops, true>(mma_sdp, tdPrdO(_, _, _, read_state.index()), tdPrV(_, _, _, slice),
                               acc_dp);
      if (slice == 0) {
        if constexpr (kAcrossBlocks) {
          // The last block's dK retired (batches retire in order, and S and dP are the two after
          // it), its stage back to the producer.
          Ops::template wgmma_wait<2>();
          warpgroup_fence_operand(acc_dk);
          if (t > 0) {
            pipeline_q.consumer_release(release_state);
            pipeline_do.consumer_release(release_state);
          }
        }
        // Every consumer's copies of this block's row statistics landed and are published; the
        // barrier also orders this block's stores of P and dS after every product of the last one
        // and frees buffer (t + 1) & 1 for the next block's copies (issued below).
        Ops::cp_async_wait_all();
        Ops::NamedBarrier::sync(Kt::kConsumerThreads, kStatsBarrier);
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          const int q = get<0>(cS_rc(r, 0));
          lam[r] = srow[Kt::kStatLambda][q];
          lam2[r] = lam[r] * kLog2e;
          bias2[r] = -srow[Kt::kStatLse][q] * kLog2e;
        }
      }
      Ops::template wgmma_wait<1>();  // S (dP behind it)
      warpgroup_fence_operand(acc_s);
      if (kGrads && capped) {
        Tensor x_rc = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          const SoftcapRow cr = softcap_row(lam[r], 1.f, p.softcap.cap, p.softcap.inv_cap);
          CUTE_UNROLL
          for (int c = 0; c < kCols; ++c) x_rc(r, c) = cr.out * tanh_of_exp2(x_rc(r, c) * cr.in);
        }
      }

      [[maybe_unused]] const uint32_t keep = keep_slice[slice];

      // s = lambda_i x (+ mask), -inf where not allowed; p = 2^(s log2 e - lse_i log2 e), stored
      // to shared memory in T for dV (after dropout: p z / (1 - p')). A fully masked row (lse = 0,
      // every s = -inf) gets p = 0.
      Tensor s_rc = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));
      Tensor tPsP_rc = make_tensor(tPsP.data(), acc_rowcol(tPsP.layout()));
      // Where each score is checked against its row's keys (kChecked, applied where `edge`: a
      // block on the diagonal, a window's edge, a document's boundary or a partial block). Under
      // the runtime flag inside the loop over the scores, ptxas if-converted the check, and every
      // block of the general kernels (causal, windows, documents) paid two compares and a select
      // per score (cuobjdump, bf16, D = 128, causal: 1,918 instructions in the loop of a loss of
      // the output alone, where full attention's had 1,297). kOwnChecks: the check is a branch
      // of its own. Without kGrads the step chooses between two loops once per slice; with kGrads
      // (two loops there spilled 432-440 bytes at D = 128, causal) it forms s in place, checks it
      // in a pass under the flag, then forms p. The masked kernels, whose blocks all check, keep
      // the check in the loop.
      constexpr bool kOwnChecks = kMask == MaskKind::kNone;
      constexpr bool kSplitChecks = kOwnChecks && !kGrads;
      // kScaled: S holds s already (checked where needed).
      const auto scores_to_probs = [&](auto edge_tag, auto scaled_tag) {
        constexpr bool kChecked = decltype(edge_tag)::value;
        constexpr bool kScaled = decltype(scaled_tag)::value;
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          const int i = i0 + get<0>(cS_rc(r, 0));
          [[maybe_unused]] const int64_t mask_row =
              kMask != MaskKind::kNone ? mask.row_offset(b, h, i) : 0;
          CUTE_UNROLL
          for (int c = 0; c < kCols; c += 2) {
            float pr[2];
            CUTE_UNROLL
            for (int e = 0; e < 2; ++e) {
              const int j = jh + get<1>(cS_rc(r, c + e));
              const float x = s_rc(r, c + e);
              // Where s itself is not needed again (kFoldScale), s log2 e - lse_i log2 e in one
              // FFMA for an FMUL and an FFMA.
              float s = kScaled ? x : kFoldScale ? fmaf(x, lam2[r], bias2[r]) : lam[r] * x;
              if (kChecked && edge) {
                bool allowed = j >= klo[r] && j < khi[r];
                if constexpr (kMask != MaskKind::kNone) {
                  if (allowed) {  // the mask is read only inside [0, Lq) x [0, Lk)
                    const int64_t off = mask_row + j * mask.sj;
                    if constexpr (kMask == MaskKind::kBool) {
                      allowed = mask.bool_bytes()[off] != 0;
                    } else {
                      // -inf hides the key whatever its score (NaN + -inf would be NaN).
                      const float m = load_additive_mask<T>(mask.data, mask.elem, off);
                      s = m == kNegInf ? m : fmaf(lam[r], x, m);
                    }
                  }
                }
                s = allowed ? s : kNegInf;
              }
              pr[e] = exp2_approx(kFoldScale ? s : fmaf(s, kLog2e, bias2[r]));  // 2^-inf = 0
              s_rc(r, c + e) = kGrads ? s : pr[e];
              if constexpr (kGrads && kDropout) {
                pr[e] = (keep >> (r * kCols + c + e)) & 1u ? pr[e] * p.dropout.keep_scale : 0.f;
              }
            }
            // Columns c and c + 1 are adjacent keys: one 4-byte store.
            const cutlass::Array<Element, 2> pair = to_pair(cutlass::Array<float, 2>{pr[0], pr[1]});
            Ops::store_shared(
                reinterpret_cast<cutlass::Array<Element, 2>*>(raw_pointer_cast(&tPsP_rc(r, c))),
                pair);
          }
        }
      };
      if constexpr (kOwnChecks && kGrads) {
        // s in place, then the check as a pass of its own under the flag, before the exponentials.
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          CUTE_UNROLL
          for (int c = 0; c < kCols; ++c) s_rc(r, c) = lam[r] * s_rc(r, c);
        }
        if (edge) {
          CUTE_UNROLL
          for (int r = 0; r < kRows; ++r) {
            CUTE_UNROLL
            for (int c = 0; c < kCols; ++c) {
              const int j = jh + get<1>(cS_rc(r, c));
              s_rc(r, c) = j >= klo[r] && j < khi[r] ? s_rc(r, c) : kNegInf;
            }
          }
        }
        scores_to_probs(std::false_type{}, std::true_type{});
      } else if (!kSplitChecks || edge) {
        scores_to_probs(std::true_type{}, std::false_type{});
      } else {
        scores_to_probs(std::false_type{}, std::false_type{});
      }

      // dV += P^T dO as soon as P of the warpgroup's keys is in shared memory: the tensor cores
      // run it beside a dS step instead of after it. With two slices each warpgroup's keys hold P
      // of both warpgroups (both compute S of every slice), so the stores go to the async proxy
      // and a barrier of the two before the issue. kEarlyFirst: the first warpgroup's keys are
      // slice 0, so its dV runs beside slice 0's dS step (the other arrives without waiting), and
      // the second's beside slice 1's. kOwnP: with one slice the S of each warpgroup covers its
      // own keys (TiledMmaSdP splits the slice's keys between the warpgroups as TiledMmadKV splits
      // the block's), so its dV reads its own stores alone, and the barrier is the warpgroup's
      // own: neither waits for the other's P step (FlashAttention-3 syncs both there). Not at
      // D = 256, where TiledMmadKV splits D (kDkvSplitsD): each dV reads every key's P.
      constexpr bool kOwnP = kSlices == 1 && !Kt::kDkvSplitsD;
      if (kEarlyFirst && slice == 0) {
        Ops::fence_view_async_shared();
        if (first) {
          Ops::NamedBarrier::sync(Kt::kConsumerThreads, kP0Barrier);
          wg_gemm_issue<Ops, false>(mma_dkv, tdVrPt, tdVrdOt(_, _, _, read_state.index()), acc_dv);
          Ops::template wgmma_wait<1>();  // dP (batches retire in order; dV stays in flight)
        } else {
          Ops::NamedBarrier::arrive(Kt::kConsumerThreads, kP0Barrier);
          Ops::template wgmma_wait<0>();
        }
      } else if (slice == kSlices - 1) {
        Ops::fence_view_async_shared();
        if (kEarlyFirst && first) {
          Ops::NamedBarrier::arrive(Kt::kConsumerThreads, kPBarrier);
          Ops::template wgmma_wait<0>();  // dP
        } else {
          if constexpr (kOwnP) {
            Ops::NamedBarrier::sync(Kt::kConsumerThreads / 2,
                                    first ? kOwnP0Barrier : kOwnP1Barrier);
          } else {
            Ops::NamedBarrier::sync(Kt::kConsumerThreads, kPBarrier);
          }
          wg_gemm_issue<Ops, false>(mma_dkv, tdVrPt, tdVrdOt(_, _, _, read_state.index()), acc_dv);
          Ops::template wgmma_wait<1>();  // dP (dV stays in flight)
        }
      } else {
        Ops::template wgmma_wait<0>();
      }

      // dS = logit_grad(p, dP, s, delta_i, g_i), 0 where p = 0 (masked or underflowed: no
      // 0 * inf from s = -inf, nor from dP = inf at a key the row does not see); lambda_i dS to
      // shared memory, and with kBoth dS too (G's operand where d lambda is asked for). Two copies
      // of the loop under a uniform branch: predicated stores would still issue the dS conversions
      // and stores that g_scaled drops. Without kBoth or kGrads, lambda_i dS is formed as
      // p (lambda_i dP - lambda_i delta_i) (scaled_logit_grad): an FFMA and an FMUL per entry for
      // an FADD and two FMULs.
      //
      // kEveryKey: a block off every edge (no mask, every row sees every key of it) without
      // kGrads, where no weight is masked: p = 0 only where it underflowed, at a key the row sees,
      // and there dP = inf (an infinite value) leaves the row's output no finite value either, so
      // the loop drops the select (a compare and an FSEL per entry) that keeps dS = 0 where p = 0.
      // (Where the checks have a branch of their own: kSplitChecks.)
      //
      // kLogitGrads: the additive mask's gradient (params.h: d_logits; dS is the gradient of the
      // logit s = lambda_i x + mask_ij, hence of its mask entry). The dS step leaves each fp32 dS
      // in the S register that held its p, which nothing reads again, and the slice's dS are added
      // into the mask's entries by atomics after the step (logit_grads.cuh, the sm80 family's
      // helper). Not with kGrads, whose step keeps s in those registers and the statistics'
      // gradients beside them: there the atomics spilled 20 bytes at D = 128 (in the loop or
      // after it), so a call that asks for both goes to the sm80 family (launch.h:
      // backward_covers).
      constexpr bool kLogitGrads = kMask == MaskKind::kAdditive && !kGrads;
      // (The loop leaves dS itself there only where it stores dS for G: in the scaled form, which
      // g_scaled takes, its ds is lambda_i dS.)
      static_assert(!kLogitGrads || !kScalesG<kMask>, "kLogitGrads adds the loop's ds as dS");
      warpgroup_fence_operand(acc_dp);
      Tensor dp_rc = make_tensor(acc_dp.data(), acc_rowcol(acc_dp.layout()));
      Tensor tdSsdS_rc = make_tensor(tdSsdS.data(), acc_rowcol(tdSsdS.layout()));
      Tensor tdSsdSl_rc = make_tensor(tdSsdSl.data(), acc_rowcol(tdSsdSl.layout()));
      const auto ds_step = [&](auto both_tag, auto every_key_tag) {
        constexpr bool kBoth = decltype(both_tag)::value;
        constexpr bool kEveryKey = decltype(every_key_tag)::value;
        constexpr bool kScaledForm = !kBoth && !kGrads;
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          const int q = get<0>(cS_rc(r, 0));
          const float delta = srow[Kt::kStatDelta][q];
          // Where s took lambda_i folded into one FFMA (kFoldScale), lambda_i is read again here
          // rather than held across the products.
          const float lam_ds = kFoldScale ? srow[Kt::kStatLambda][q] : lam[r];
          [[maybe_unused]] const float lam_delta = lam_ds * delta;
          RowGrads<float> g;  // g_lse enters through delta only
          if constexpr (kGrads) {
            g.g_entropy = srow[Kt::kStatGH][q];
            g.g_sum_p2 = srow[Kt::kStatGU][q];
          }
          CUTE_UNROLL
          for (int c = 0; c < kCols; c += 2) {
            float ds[2];
            CUTE_UNROLL
            for (int e = 0; e < 2; ++e) {
              float pr, s = 0.f, cap_grad = 1.f;
              if constexpr (kGrads) {
                s = s_rc(r, c + e);
                pr = exp2_approx(fmaf(s, kLog2e, bias2[r]));
                // Only the kernels that may cap form the cap's derivative: elsewhere it is 1, and
                // s * 0 is no constant to the compiler (two instructions per element, 12-18% of the
                // dS step's modelled cycles: results/sass/softmax_schedule.md).
                if constexpr (kSoftcap) {
                  // 1 / c, or 0 (a derivative of 1); NaN where s = -inf: unused, p = 0 there.
                  const float th = s * (capped ? p.softcap.inv_cap : 0.f);
                  cap_grad = 1.f - th * th;
                }
              } else {
                pr = s_rc(r, c + e);
              }
              // dP of the weight before dropout: that of the dropped weight times z / (1 - p').
              float dp = dp_rc(r, c + e);
              if constexpr (kGrads && kDropout) {
                dp = (keep >> (r * kCols + c + e)) & 1u ? dp * p.dropout.keep_scale : 0.f;
              }
              // ds: lambda_i dS in the scaled form, else dS.
              const float d = kScaledForm ? scaled_logit_grad(pr, dp, lam_ds, lam_delta)
                              : kGrads    ? logit_grad(pr, dp, s, delta, g) * cap_grad
                                          : logit_grad(pr, dp, delta);  // (an FFMA less per entry)
              ds[e] = kEveryKey || pr != 0.f ? d : 0.f;
              if constexpr (kLogitGrads) s_rc(r, c + e) = ds[e];  // p's place: read above
            }
            if constexpr (kBoth) {
              Ops::store_shared(
                  reinterpret_cast<cutlass::Array<Element, 2>*>(raw_pointer_cast(&tdSsdS_rc(r, c))),
                  to_pair(cutlass::Array<float, 2>{ds[0], ds[1]}));
            }
            const cutlass::Array<float, 2> lam_pair =
                kScaledForm ? cutlass::Array<float, 2>{ds[0], ds[1]}
                            : cutlass::Array<float, 2>{lam_ds * ds[0], lam_ds * ds[1]};
            Ops::store_shared(
                reinterpret_cast<cutlass::Array<Element, 2>*>(raw_pointer_cast(&tdSsdSl_rc(r, c))),
                to_pair(lam_pair));
          }
        }
      };
      const auto ds_steps = [&](auto both_tag) {
        if constexpr (kSplitChecks) {
          if (!edge) return ds_step(both_tag, std::true_type{});
        }
        ds_step(both_tag, std::false_type{});
      };
      if (g_scaled) {
        ds_steps(std::false_type{});
      } else {
        ds_steps(std::true_type{});
      }
      if constexpr (kLogitGrads) {
        if (p.d_logits.data != nullptr) {
          add_logit_grads(p.d_logits, b, h, i0, jh, q_len, kv_len, s_rc, cS_rc);
        }
      }
    }
    // The generic-proxy stores made visible to wgmma (async proxy), then to both warpgroups.
    Ops::fence_view_async_shared();
    Ops::NamedBarrier::sync(Kt::kConsumerThreads, kdSBarrier);

    // G = dS K, dK += (lambda dS)^T Q (dV is in flight).
    Tensor acc_g = partition_fragment_C(mma_g, Shape<Int<kBlockM>, Int<kD>>{});
    wg_gemm_issue<Ops, true>(mma_g, tGrdS, tGrKt, acc_g);
    wg_gemm_issue<Ops, false>(mma_dkv, tdKrdSt, tdKrQt(_, _, _, read_state.index()), acc_dk);
    Ops::template wgmma_wait<1>();  // dV and G (batches complete in order)
    warpgroup_fence_operand(acc_g);

    // G into dq_accum, fp32, pairs of adjacent columns (columns c and c + 1 of the fragment: the
    // first mode of the column layout).
    Tensor g_rc = make_tensor(acc_g.data(), acc_rowcol(acc_g.layout()));
    // (The bulk kernels keep the atomics as a runtime alternative, which their launches never take:
    // with the shared tile's stores as the only path, ptxas spills 372 bytes in the general kernel
    // at D = 128, and with both none. The tile's stores are compiled in the bulk kernels alone:
    // elsewhere G's tile has one row, kBulkDqFits.)
    if (kBulkDq && p.dq_layout.bulk) {
      if constexpr (kBulkDq) {
        // Into the shared tile once the writer has read the last one out, whole (the rows past
        // q_len hold zeros: no key is allowed there, so dS = 0), for write_dq's bulk reduction.
        Ops::NamedBarrier::sync(Kt::kDqThreads, kdQEmptyBarrier);
        CUTE_UNROLL
        for (int r = 0; r < decltype(size<0>(g_rc))::value; ++r) {
          float* row = ss.dq[get<0>(cG_rc(r, 0))];
          CUTE_UNROLL
          for (int c = 0; c < decltype(size<1>(g_rc))::value; c += 2) {
            Ops::store_shared(reinterpret_cast<float2*>(row + get<1>(cG_rc(r, c))),
                              make_float2(g_rc(r, c), g_rc(r, c + 1)));
          }
        }
        Ops::fence_view_async_shared();  // the stores, before the bulk reduction reads them
        Ops::NamedBarrier::arrive(Kt::kDqThreads, kdQFullBarrier);
      }
    } else {
      // Into dq_accum (packed), one 8-byte atomic per pair. Deterministic (the kernels without
      // bulk reductions: p.dq_turns), in the turns that keep_turns waits for and hands on: the
      // consumers wait for it at kTurnComeBarrier and arrive at kTurnDoneBarrier after their
      // atomics. (Formed and handed on here, the turn spilled the masked kernels at D = 128.)
      const bool turns = !kBulkDq && p.dq_turns != nullptr;
      if (turns) Ops::NamedBarrier::sync(Kt::kDqThreads, kTurnComeBarrier);
      const int64_t row0 = (static_cast<int64_t>(b) * heads + h) * q_len + i0;
      float* dq_accum = p.dq_accum + row0 * kD;
      CUTE_UNROLL
      for (int r = 0; r < decltype(size<0>(g_rc))::value; ++r) {
        const int q = get<0>(cG_rc(r, 0));
        if (i0 + q >= q_len) continue;
        CUTE_UNROLL
        for (int c = 0; c < decltype(size<1>(g_rc))::value; c += 2) {
          atomicAdd(reinterpret_cast<float2*>(dq_accum + q * kD + get<1>(cG_rc(r, c))),
                    make_float2(g_rc(r, c), g_rc(r, c + 1)));
        }
      }
      if (turns) Ops::NamedBarrier::arrive(Kt::kDqThreads, kTurnDoneBarrier);
    }

    // The next block's row statistics, while dK runs (S, dP and G are dead here).
    if (kAcrossBlocks && t + 1 < iters) copy_row_stats(t + 1);
    warpgroup_fence_operand(acc_dv);
    if constexpr (kAcrossBlocks) {
      release_state = read_state;  // dK stays in flight into the next block
    } else {
      Ops::template wgmma_wait<0>();  // dK
      warpgroup_fence_operand(acc_dk);
      pipeline_q.consumer_release(read_state);
      pipeline_do.consumer_release(read_state);
    }
    ++read_state;
  };

  if (kAcrossBlocks && iters > 0) copy_row_stats(0);
  // Uniform branch: keep s for the entropy term or the cap's derivative; dropout.
  if (grads || capped || dropping) {
#pragma unroll 1
    for (int t = 0; t < iters; ++t) step(t, std::true_type{});
  } else {
#pragma unroll 1
    for (int t = 0; t < iters; ++t) step(t, std::false_type{});
  }
  if constexpr (kAcrossBlocks) {  // the last block's dK
    Ops::template wgmma_wait<0>();
    warpgroup_fence_operand(acc_dk);
    if (iters > 0) {
      pipeline_q.consumer_release(release_state);
      pipeline_do.consumer_release(release_state);
    }
  }

  // Epilogue: dK and dV, rows j0 + r < Lk, as 4-byte pairs of adjacent columns from the
  // registers, into (B, Hkv, Lk, D) in the host's strides (each in its input's layout).
  // (The thread's own slice: thr_dkv is its warpgroup's first thread's.)
  Tensor cKV = mma_dkv.get_thread_slice(ctid).partition_C(
      make_identity_tensor(Shape<Int<kBlockN>, Int<kD>>{}));
  Tensor cKV_rc = make_tensor(cKV.data(), acc_rowcol(cKV.layout()));
  Tensor dk_rc = make_tensor(acc_dk.data(), acc_rowcol(acc_dk.layout()));
  Tensor dv_rc = make_tensor(acc_dv.data(), acc_rowcol(acc_dv.layout()));
  T* const dk_out = static_cast<T*>(p.dk_out.data) + p.dk_out.offset(b, kvh, j0);
  T* const dv_out = static_cast<T*>(p.dv_out.data) + p.dv_out.offset(b, kvh, j0);
  // Whether a key row came out non-finite: the block products form 0 * NaN for a hidden row's
  // NaN, so the fallback recomputes such calls by the hidden-keys rule (params.h: nonfinite).
  bool nonfinite = false;
  CUTE_UNROLL
  for (int r = 0; r < decltype(size<0>(dk_rc))::value; ++r) {
    const int j = get<0>(cKV_rc(r, 0));
    if (j0 + j >= kv_len) continue;
    CUTE_UNROLL
    for (int c = 0; c < decltype(size<1>(dk_rc))::value; c += 2) {
      const int col = get<1>(cKV_rc(r, c));
      nonfinite |= !is_finite(dk_rc(r, c)) || !is_finite(dk_rc(r, c + 1)) ||
                   !is_finite(dv_rc(r, c)) || !is_finite(dv_rc(r, c + 1));
      *reinterpret_cast<uint32_t*>(dk_out + j * p.dk_out.sl + col) =
          pack2<T>(dk_rc(r, c), dk_rc(r, c + 1));
      *reinterpret_cast<uint32_t*>(dv_out + j * p.dv_out.sl + col) =
          pack2<T>(dv_rc(r, c), dv_rc(r, c + 1));
    }
  }
  if (nonfinite && p.nonfinite != nullptr) *p.nonfinite = 1;  // (all store the same value)
}

// The turn counter of query block m_block of (batch b, query head h) in a deterministic backward
// (params.h: dq_turns; launch.h: turn_blocks, whose blocks are kBlockM rows: static_assert above).
__device__ __forceinline__ int* turn_counter(const BwdParams<float>& p, int64_t b, int64_t h,
                                             int m_block) {
  return p.dq_turns + (b * p.heads + h) * turn_blocks(p.dq_layout.rows) + m_block;
}

// The dq writer (warp 1 of the producer warpgroup, bulk_dq_accum layouts): per query block, once
// both consumer warpgroups have stored G in the shared tile, one lane adds the whole tile into the
// block's rows of dq_accum (a bulk reduction: the tile and those rows have the same layout) and
// waits until it has been read before the consumers may store the next.
// Deterministic (p.dq_turns): key block n adds into query block m once the key blocks before it
// that walk m have, when m's counter reads n. The counter starts at m's first walker (set by the
// preprocess: preprocess_kernel below), and each key block that has added into m raises it to the
// next key block with a walk (key_ranges.cuh: walking_block_from), which is m's next walker if m
// has one (the key blocks with a walk that walk m follow one another); a key block hands the turn
// on once its reduction has completed, so that dq_accum sums the key blocks in their order on every
// run. Within a (kv head, batch), key blocks start in the order of n (launch_order.h), so the ones
// waited for have started.
template <typename Kt>
__device__ __forceinline__ void write_dq(const BwdParams<float>& p, typename Kt::SharedStorage& ss,
                                         const GridTile tile, int m_begin, int m_count, int iters) {
  using Ops = typename Kt::Ops;
  constexpr int kBlockM = Kt::kBlockM;
  const int lane = threadIdx.x % 32;
  const int group = static_cast<int>(p.heads / p.kv_heads);
  // The pad columns go into dq_accum's pad with every reduction: zeros, not whatever was there.
  for (int e = lane; e < kBlockM * kBulkDqPad; e += 32) {
    Ops::store_shared(&ss.dq[e / kBulkDqPad][Kt::kHeadDim + e % kBulkDqPad], 0.f);
  }
  Ops::fence_view_async_shared();
  __syncwarp();
#pragma unroll 1
  for (int t = 0; t < iters; ++t) {
    Ops::NamedBarrier::arrive(Kt::kDqThreads, kdQEmptyBarrier);  // the tile is free
    Ops::NamedBarrier::sync(Kt::kDqThreads, kdQFullBarrier);     // ... and now full
    if (lane == 0) {
      const int h = tile.y * group + t / m_count, m_block = m_begin + t % m_count;
      const int64_t bh = static_cast<int64_t>(tile.z) * p.heads + h;
      float* dst = p.dq_accum + p.dq_layout.offset(bh, static_cast<int64_t>(m_block) * kBlockM);
      int* turn = p.dq_turns == nullptr ? nullptr : turn_counter(p, tile.z, h, m_block);
      if (turn != nullptr) Ops::wait_turn(turn, tile.x);
      Ops::bulk_reduce_add(dst, &ss.dq[0][0], sizeof(ss.dq));
      Ops::bulk_commit();
      if (turn != nullptr) {
        Ops::bulk_wait_all();
        Ops::pass_turn(turn, ss.turn_step);
      } else {
        Ops::template bulk_wait_read<0>();
      }
    }
    __syncwarp();
  }
}

// The turn keeper of a deterministic backward whose consumers add G by atomics (warp 1 of the
// producer warpgroup, which the dq writer is in the kernels with bulk reductions): per query block,
// lane 0 waits until the block's counter reads this key block (as write_dq), lets the consumers
// add, and once they all have, hands the turn on (the barrier, then one thread's release, orders
// every consumer's atomics before it, as CUTLASS's GenericBarrier does).
template <typename Kt>
__device__ __forceinline__ void keep_turns(const BwdParams<float>& p,
                                           typename Kt::SharedStorage& ss, const GridTile tile,
                                           int m_begin, int m_count, int iters) {
  using Ops = typename Kt::Ops;
  const int lane = threadIdx.x % 32;
  const int group = static_cast<int>(p.heads / p.kv_heads);
#pragma unroll 1
  for (int t = 0; t < iters; ++t) {
    const int h = tile.y * group + t / m_count, m_block = m_begin + t % m_count;
    int* turn = turn_counter(p, tile.z, h, m_block);
    if (lane == 0) Ops::wait_turn(turn, tile.x);
    __syncwarp();
    Ops::NamedBarrier::arrive(Kt::kDqThreads, kTurnComeBarrier);
    Ops::NamedBarrier::sync(Kt::kDqThreads, kTurnDoneBarrier);
    if (lane == 0) Ops::pass_turn(turn, ss.turn_step);
    __syncwarp();
  }
}

// Grid: (key blocks, kv heads, batch); 384 threads (three warpgroups), one block per SM. kBulkDq
// (kernel_for below): dq by bulk reductions, the dq writer in warp 1 of the producer warpgroup.
template <typename T, typename Kt, bool kCausal, MaskKind kMask, bool kBulkDq>
__global__ void __launch_bounds__(Kt::kThreads, 1)
    main_kernel([[maybe_unused]] const __grid_constant__ KernelArgs<Kt> args) {
  // wgmma and setmaxnreg exist only in the architecture-specific sm_90a target (see the forward).
#if (defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)) || \
    defined(ENTROPY_ATTN_CUDA_EMULATION)
  static_assert(!kBulkDq || Kt::kBulkDqFits, "G's shared tile does not fit at this head dim");
  using Ops = typename Kt::Ops;
  constexpr int kBlockM = Kt::kBlockM, kBlockN = Kt::kBlockN, kD = Kt::kHeadDim;
  extern __shared__ __align__(1024) char ea_sm90_bwd_smem[];
  auto& ss = *reinterpret_cast<typename Kt::SharedStorage*>(ea_sm90_bwd_smem);
  const BwdParams<float>& p = args.p;
  // Key block 0 is the heaviest of a causal call (every row sees it): blocks are dispatched in
  // order, and launch_order.h puts every head's first x before any head's second.
  const GridTile tile = this_block_tile<kCausal, kMask>(p.launch_sections);
  const int n_block = tile.x, kvh = tile.y, b = tile.z;
  const int q_len = static_cast<int>(p.q_len);
  const int group = static_cast<int>(p.heads / p.kv_heads);
  // The query blocks whose rows may see a key of this block (top-left causality: rows from j0 on).
  const int kv_len = static_cast<int>(p.kv_len), j0 = n_block * kBlockN;
  const BlockRange mb =
      query_blocks<kCausal>(p.pattern, q_len, kv_len, j0, min(j0 + kBlockN, kv_len), kBlockM);
  const int m_begin = mb.begin, m_count = max(mb.end - mb.begin, 0);
  const int iters = group * m_count;  // (query head, query block) pairs, head-major

  const int warp_group = Ops::warp_group_idx();
  using Pipeline = typename Kt::Pipeline;
  const auto pipe_params =
      tma_pipeline_params<Pipeline>(warp_group, Kt::kTmaBytesQ, Kt::kConsumerThreads);
  Pipeline pipeline_q(ss.pipeline_q, pipe_params, Shape<_1, _1, _1>{});
  Pipeline pipeline_do(ss.pipeline_do, pipe_params, Shape<_1, _1, _1>{});
  if (threadIdx.x == 0) {
    Ops::TxBarrier::init(&ss.barrier_kv, 1);
    ss.m_begin = m_begin;
    ss.turn_step =
        p.dq_turns == nullptr || iters == 0
            ? 1
            : walking_block_from<kCausal>(p.pattern, n_block + 1, q_len, kv_len, kBlockN) - n_block;
  }
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  if (warp_group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Kt::kProducerRegs>();
    if constexpr (kBulkDq) {
      if (threadIdx.x / 32 == 1 && p.dq_layout.bulk) {
        write_dq<Kt>(p, ss, tile, m_begin, m_count, iters);
        return;
      }
    }
    if (!kBulkDq && threadIdx.x / 32 == 1 && p.dq_turns != nullptr) {
      keep_turns<Kt>(p, ss, tile, m_begin, m_count, iters);
      return;
    }
    if (threadIdx.x != 0) return;
    Ops::prefetch_tma_descriptor(args.tma_q.get_tma_descriptor());
    Ops::prefetch_tma_descriptor(args.tma_do.get_tma_descriptor());
    Ops::prefetch_tma_descriptor(args.tma_k.get_tma_descriptor());
    Ops::prefetch_tma_descriptor(args.tma_v.get_tma_descriptor());
    const int heads = static_cast<int>(p.heads);
    const int kv_heads = static_cast<int>(p.kv_heads), batch = static_cast<int>(p.batch);
    Tensor mQ = args.tma_q.get_tma_tensor(make_shape(q_len, kD, heads, batch));
    Tensor mdO = args.tma_do.get_tma_tensor(make_shape(q_len, kD, heads, batch));
    Tensor mK = args.tma_k.get_tma_tensor(make_shape(kv_len, kD, kv_heads, batch));
    Tensor mV = args.tma_v.get_tma_tensor(make_shape(kv_len, kD, kv_heads, batch));
    Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Kt::SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(ss.dout.data()), typename Kt::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Kt::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Kt::SmemLayoutK{});
    if (iters > 0) {
      const auto kv_tile = Shape<Int<kBlockN>, Int<kD>>{};
      Tensor gK = local_tile(mK(_, _, kvh, b), kv_tile, make_coord(n_block, 0));
      Tensor gV = local_tile(mV(_, _, kvh, b), kv_tile, make_coord(n_block, 0));
      auto [tKgK, tKsK] = tma_partition(args.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK),
                                        group_modes<0, 2>(gK));
      auto [tVgV, tVsV] = tma_partition(args.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV),
                                        group_modes<0, 2>(gV));
      Ops::TxBarrier::arrive_and_expect_tx(&ss.barrier_kv, 2 * Kt::kTmaBytesK);
      copy(args.tma_k.with(ss.barrier_kv), tKgK, tKsK);
      copy(args.tma_v.with(ss.barrier_kv), tVgV, tVsV);
    }
    auto write_state = cutlass::make_producer_start_state<Pipeline>();
#pragma unroll 1
    for (int t = 0; t < iters; ++t) {
      const int h = kvh * group + t / m_count, m_block = m_begin + t % m_count;
      const auto q_tile = Shape<Int<kBlockM>, Int<kD>>{};
      Tensor gQ = local_tile(mQ(_, _, h, b), q_tile, make_coord(m_block, 0));
      Tensor gdO = local_tile(mdO(_, _, h, b), q_tile, make_coord(m_block, 0));
      auto [tQgQ, tQsQ] = tma_partition(args.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ),
                                        group_modes<0, 2>(gQ));
      auto [tdOgdO, tdOsdO] = tma_partition(args.tma_do, Int<0>{}, Layout<_1>{},
                                            group_modes<0, 2>(sdO), group_modes<0, 2>(gdO));
      pipeline_q.producer_acquire(write_state);
      copy(args.tma_q.with(*pipeline_q.producer_get_barrier(write_state)), tQgQ,
           tQsQ(_, write_state.index()));
      pipeline_do.producer_acquire(write_state);
      copy(args.tma_do.with(*pipeline_do.producer_get_barrier(write_state)), tdOgdO,
           tdOsdO(_, write_state.index()));
      ++write_state;
    }
    // Stay until the consumers have released every stage: the block's barriers must outlive
    // every arrival on them.
    pipeline_q.producer_tail(write_state);
    pipeline_do.producer_tail(write_state);
  } else {
    cutlass::arch::warpgroup_reg_alloc<Kt::kConsumerRegs>();
    consume<T, Kt, kCausal, kMask, kBulkDq>(args, ss, pipeline_q, pipeline_do, tile, m_count,
                                            iters);
  }
#endif
}

// The preprocess: the sm80 family's (delta, sm80/bwd_kernel.cuh), and for a deterministic backward
// each query block's turn counter (params.h: dq_turns) at the block's first walker
// (key_ranges.cuh: first_walker), written by the thread of the block's first row. On the device,
// where packed documents' offsets are, and with no copy from the host (a CUDA graph may replay it).
// (The pattern of full attention, which the main kernels without kCausal take, gives what
// first_walker<false> would: key block 0.)
template <typename Kt, typename Kt80>
__global__ void __launch_bounds__(Kt80::kNThreads) preprocess_kernel(const BwdParams<float> p) {
  sm80::bwd::preprocess_block<Kt80>(p);
  if (p.dq_turns == nullptr || threadIdx.x >= Kt80::kPreRows) return;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * Kt80::kPreRows + threadIdx.x;
  if (i >= p.q_len || i % Kt::kBlockM != 0) return;
  const int m = static_cast<int>(i / Kt::kBlockM);
  *turn_counter(p, blockIdx.z, blockIdx.y, m) =
      first_walker<true>(p.pattern, m, static_cast<int>(p.q_len), static_cast<int>(p.kv_len),
                         Kt::kBlockM, Kt::kBlockN);
}

// The main kernel for a call: with bulk reductions where dq_accum is laid out for them, a kernel of
// their own, so that the atomics' kernels stay as they were. Only the calls without a mask at head
// dims 64 and 128 have them: the masked kernels spilled at D = 128 with the tile's stores beside
// their mask reads, and at D = 256 the tile does not fit (launch.h: backward_covers routes such
// calls).
template <typename T, typename Kt, bool kCausal, MaskKind kMask>
auto kernel_for(const BwdParams<float>& p) {
  if constexpr (kMask == MaskKind::kNone && Kt::kBulkDqFits) {
    if (p.dq_layout.bulk) return &main_kernel<T, Kt, kCausal, kMask, true>;
  }
  return &main_kernel<T, Kt, kCausal, kMask, false>;
}

}  // namespace bwd_impl
}  // namespace entropy_attn::cuda::sm90
