// CUDA backward kernels of the fused attention (FlashAttention-2 form with a per-row scale,
// docs/math.md section 3; the per-element math is online_stats.h's, shared with the CPU kernel).
//
// A preprocess kernel computes D~_i = row_delta(dO_i . O_i, ..., ref = lse_i) per query row. The
// main kernel runs one thread block per (batch, query head, tile of kBN keys): it keeps K, V and
// the dK, dV accumulators of its tile in shared memory and streams the query tiles that can see it
// (KeyPattern: causality, windows, documents), recomputing p = e^{s - lse} from the saved lse
// (which holds the sink, if any):
//   dV += (P o Z)^T dO,  dP = (dO V^T) o Z,  dS = logit_grad(p, dP, s - lse, D~) o cap',
//   dK += (lambda dS)^T Q,  G += dS K (fp32/fp64 atomics into a global accumulator, in the key
//   tiles' order under deterministic algorithms: turns.cuh; the host, or a guard's postprocess,
//   forms dq = lambda G and, where asked for, d lambda = q . G),
// with Z the dropout factors (1 without dropout) and cap' the softcap's derivative at the scaled
// score (1 without softcap), as the CPU kernel.
#pragma once

#include "../../online_stats.h"
#include "../params.h"
#include "block_gemm.cuh"
#include "device_utils.cuh"
#include "nonfinite_rows.cuh"
#include "turns.cuh"

namespace entropy_attn::cuda::fallback {

// Whether the kernels run as the guard of a tensor-core backward (params.h: nonfinite): they then
// write that family's outputs, dk and dv of each key/value head summed over its GQA group by the
// block of a key tile (no per-query-head buffer), dq and d lambda (where asked for) by the
// postprocess.
template <typename acc_t>
__host__ __device__ __forceinline__ bool grouped(const BwdParams<acc_t>& p) {
  return p.dk_out.data != nullptr;
}

// The query and key tiles' rows (kBM = kBN) per input type and head-dim bucket.
template <typename T, int kD>
constexpr int backward_tile() {
  return kIs16Bit<T> ? 32 : (std::is_same_v<T, float> && kD <= 64 ? 32 : 16);
}

template <typename T, int kD, int kTile = backward_tile<T, kD>()>
struct BwdLayout {
  using Acc = AccType<T>;
  using OpT = std::conditional_t<kIs16Bit<T>, T, Acc>;  // P and dS as product operands
  static constexpr int kBM = kTile;
  static constexpr int kBN = kBM;
  static constexpr int kLdT = padded_ld<T>(kD);     // K, V, Q, dO tiles
  static constexpr int kLdS = padded_ld<Acc>(kBN);  // logits, dP
  static constexpr int kLdP = padded_ld<OpT>(kBN);  // P, dS, lambda dS
  static constexpr int kLdA = padded_ld<Acc>(kD);   // dK, dV accumulators
  static constexpr size_t kTileT = align128(sizeof(T) * kBM * kLdT);
  static constexpr size_t kTileS = align128(sizeof(Acc) * kBM * kLdS);
  static constexpr size_t kTileP = align128(sizeof(OpT) * kBM * kLdP);
  static constexpr size_t kTileA = align128(sizeof(Acc) * kBN * kLdA);
  static constexpr size_t kRow = align128(sizeof(Acc) * kBM);
  static constexpr size_t kK = 0, kV = kK + kTileT, kQ = kV + kTileT, kDO = kQ + kTileT;
  static constexpr size_t kS = kDO + kTileT, kDP = kS + kTileS;
  static constexpr size_t kP = kDP + kTileS, kDS = kP + kTileP, kDSL = kDS + kTileP;
  static constexpr size_t kDK = kDSL + kTileP, kDV = kDK + kTileA;
  // Per-row lse, lambda, D~, upstream entropy and sum_p2 gradients; then the rows' key ranges.
  static constexpr size_t kRows = kDV + kTileA;
  static constexpr size_t kLo = kRows + 5 * kRow;
  static constexpr size_t kHi = kLo + align128(sizeof(int64_t) * kBM);
  // Flags of the non-finite rows (nonfinite_rows.cuh) of the key tile, of the query tiles (two
  // sets, for alternate tiles) and of the dO tiles.
  static constexpr size_t kFlags = kHi + align128(sizeof(int64_t) * kBM);
  static constexpr int kFlagBytes = (kBN + 1) + 3 * (kBM + 1);
  static constexpr size_t kScratch = kFlags + align128(kFlagBytes);
  static constexpr size_t kBytes = kScratch + (kIs16Bit<T> ? sizeof(float) * kWarps * 256 : 0);
  static_assert(kBytes <= 166912, "over an A100's 163 KB of shared memory per block");
  // The tiles: one per (batch, query head, key tile); as the guard of a tensor-core backward
  // (grouped(p)), one per (batch, key/value head, key tile). And the main kernel's grid: a block
  // per tile, or as a guard the capped grid of nonfinite_rows.cuh (tile_grid), but for a guard
  // that takes turns (deterministic algorithms: params.h, tile_turns), whose blocks, striding over
  // the tiles, could wait for a tile that a block waiting itself holds (turns.cuh).
  __host__ __device__ static int64_t blocks(const BwdParams<Acc>& p) {
    return (p.kv_len + kBN - 1) / kBN * p.batch * (grouped(p) ? p.kv_heads : p.heads);
  }
  static int64_t grid(const BwdParams<Acc>& p) {
    return tile_grid(blocks(p), grouped(p) && p.tile_turns == nullptr);
  }
};

// The shared memory per block of the GPUs with the least of it among those the kernels run on:
// compute capability 8.6, 8.9 and 12.x (RTX 30-50 series, A10, A40, L4, L40).
constexpr size_t kSmallSharedMemory = 101376;
// On those, the 16-bit backward at head dims 129-256 takes tiles of 16 rows (77 KB where its tiles
// of 32 take 156 KB), as a kernel of its own (attention_bwd_compact_kernel) so that the other GPUs
// keep the larger tiles. (float32 at 256 and float64 at 128 need more than 99 KB even at 16.)
template <typename T, int kD>
using CompactBwdLayout = BwdLayout<T, kD, 16>;
template <typename T, int kD>
constexpr bool kHasCompactBackward =
    BwdLayout<T, kD>::kBytes > kSmallSharedMemory&& CompactBwdLayout<T, kD>::kBytes <=
    kSmallSharedMemory;

// Whether a backward runs in the compact kernel on a device granting `smem_optin` bytes per block:
// where the usual tiles do not fit and the compact ones exist. (Not as the guard of a tensor-core
// backward, whose kernels need more than the usual tiles.)
template <typename T, int kD>
bool use_compact_backward(const BwdParams<AccType<T>>& p, int smem_optin) {
  return kHasCompactBackward<T, kD> && !grouped(p) &&
         static_cast<size_t>(smem_optin) < BwdLayout<T, kD>::kBytes;
}

// The grid of the per-row kernels (preprocess, postprocess): one warp per query row; as a guard at
// most kGuardRowBlocks blocks, whose warps stride over the rows, since an idle guard's blocks only
// return and a full grid of them costs its launch on every call.
constexpr int64_t kGuardRowBlocks = 2048;
template <typename acc_t>
int64_t preprocess_blocks(const BwdParams<acc_t>& p) {
  const int64_t blocks = (p.batch * p.heads * p.q_len + kWarps - 1) / kWarps;
  return guard_grid(blocks, grouped(p), kGuardRowBlocks);
}

// D~_i (online_stats.h: row_delta) of one row, by one warp.
template <typename T>
__device__ __forceinline__ void preprocess_row(const BwdParams<AccType<T>>& p, int64_t row,
                                               int lane) {
  using Acc = AccType<T>;
  const int64_t i = row % p.q_len, bh = row / p.q_len, b = bh / p.heads, h = bh % p.heads;
  // As a guard, G starts again from zero (the tensor-core kernels accumulated it), and so does the
  // additive mask's gradient (the tensor-core family's main kernel added into it: each row zeroes
  // its entries, an entry that rows share once by each, all before the main kernel adds).
  if (grouped(p)) {
    for (int64_t d = lane; d < p.head_dim; d += 32) p.dq_accum[row * p.head_dim + d] = Acc(0);
    if (p.d_logits.data != nullptr) {
      for (int64_t j = lane; j < p.kv_len; j += 32) *p.d_logits.at(b, h, i, j) = Acc(0);
    }
  }
  const T* o = static_cast<const T*>(p.out.data) + b * p.out.sb + h * p.out.sh + i * p.out.sl;
  const T* d_o = static_cast<const T*>(p.dout.data) + b * p.dout.sb + h * p.dout.sh + i * p.dout.sl;
  Acc dot = 0;
  for (int64_t d = lane; d < p.v_head_dim; d += 32) dot += to_acc(d_o[d]) * to_acc(o[d]);
  dot = warp_sum(dot);
  if (lane == 0) {
    RowGrads<Acc> g;
    g.g_lse = p.g_lse ? p.g_lse[row] : Acc(0);
    g.g_entropy = p.g_entropy ? p.g_entropy[row] : Acc(0);
    g.g_sum_p2 = p.g_sum_p2 ? p.g_sum_p2[row] : Acc(0);
    p.delta[row] = row_delta(dot, g, p.lse[row], p.entropy[row], p.sum_p2[row], p.lse[row]);
  }
}

// The preprocess: D~_i of every row, one warp per row.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    attention_bwd_preprocess_kernel(const BwdParams<AccType<T>> p) {
  if (guard_idle(p)) return;
  const int lane = threadIdx.x % 32;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
       row < p.batch * p.heads * p.q_len; row += static_cast<int64_t>(gridDim.x) * kWarps) {
    preprocess_row<T>(p, row, lane);
  }
}

// The first query tile of kBM rows whose last row's keys end past key j0 (the number of tiles when
// none does): a binary search over the tiles, whose rows' bounds never decrease.
template <int kBM, typename Acc>
__device__ __forceinline__ int64_t first_query_tile(const AttentionArgs<Acc>& a, int64_t j0) {
  int64_t lo = 0, hi = (a.q_len + kBM - 1) / kBM;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    const int64_t last = (mid + 1) * kBM - 1 < a.q_len ? (mid + 1) * kBM - 1 : a.q_len - 1;
    if (a.pattern.keys(last, a.q_len, a.kv_len).hi > j0) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

// The main kernel's work for key tile `index` (L::blocks), by one block, with the tiles of
// layout L. kGrouped: the guard of a tensor-core backward (grouped(p)), instantiated for 16-bit
// inputs only; a compile-time flag, so that the plain kernel keeps its registers.
template <typename T, int kD, bool kGrouped, typename L>
__device__ __forceinline__ void backward_key_tile(const BwdParams<AccType<T>>& p, unsigned index) {
  using Acc = typename L::Acc;
  using OpT = typename L::OpT;
  constexpr int kBM = L::kBM, kBN = L::kBN;
  extern __shared__ __align__(128) unsigned char smem[];
  T* sK = reinterpret_cast<T*>(smem + L::kK);
  T* sV = reinterpret_cast<T*>(smem + L::kV);
  T* sQ = reinterpret_cast<T*>(smem + L::kQ);
  T* sdO = reinterpret_cast<T*>(smem + L::kDO);
  Acc* sS = reinterpret_cast<Acc*>(smem + L::kS);
  Acc* sdP = reinterpret_cast<Acc*>(smem + L::kDP);
  OpT* sP = reinterpret_cast<OpT*>(smem + L::kP);
  OpT* sdS = reinterpret_cast<OpT*>(smem + L::kDS);
  OpT* sdSl = reinterpret_cast<OpT*>(smem + L::kDSL);
  Acc* sdK = reinterpret_cast<Acc*>(smem + L::kDK);
  Acc* sdV = reinterpret_cast<Acc*>(smem + L::kDV);
  Acc* sLse = reinterpret_cast<Acc*>(smem + L::kRows);
  Acc* sLam = reinterpret_cast<Acc*>(smem + L::kRows + L::kRow);
  Acc* sDelta = reinterpret_cast<Acc*>(smem + L::kRows + 2 * L::kRow);
  Acc* sGH = reinterpret_cast<Acc*>(smem + L::kRows + 3 * L::kRow);
  Acc* sGU = reinterpret_cast<Acc*>(smem + L::kRows + 4 * L::kRow);
  int64_t* sLo = reinterpret_cast<int64_t*>(smem + L::kLo);
  int64_t* sHi = reinterpret_cast<int64_t*>(smem + L::kHi);
  uint8_t* const sKBad = smem + L::kFlags;
  uint8_t* const sQFlags = sKBad + kBN + 1;
  uint8_t* const sdOBad = sQFlags + 2 * (kBM + 1);
  float* scratch = reinterpret_cast<float*>(smem + L::kScratch);
  const MaskArg<Acc> mask = mask_for<T>(p.mask);

  // A block takes the key tile of one query head, or as a guard those of a whole GQA group.
  const BlockIndex blk =
      block_index(index, (p.kv_len + kBN - 1) / kBN, kGrouped ? p.kv_heads : p.heads, p.kv_heads);
  const int64_t b = blk.b, kvh = blk.kvh, j0 = blk.tile * kBN;
  const int64_t h_begin = kGrouped ? kvh * (p.heads / p.kv_heads) : blk.h;
  const int64_t h_end = kGrouped ? h_begin + p.heads / p.kv_heads : h_begin + 1;
  const int cols = static_cast<int>(p.kv_len - j0 < kBN ? p.kv_len - j0 : kBN);
  const int64_t D = p.head_dim, Dv = p.v_head_dim;

  // Non-finite key rows leave S = Q K^T and G += dS K: flagged as they load and zeroed; their
  // scores are formed apart and their dq terms added back to the rows that see them (below).
  clear_flags<L::kFlagBytes - 1>(sKBad);
  __syncthreads();
  load_tile<kBN, kD>(sK, L::kLdT,
                     static_cast<const T*>(p.k.data) + b * p.k.sb + kvh * p.k.sh + j0 * p.k.sl,
                     p.k.sl, cols, D, sKBad);
  load_tile<kBN, kD>(sV, L::kLdT,
                     static_cast<const T*>(p.v.data) + b * p.v.sb + kvh * p.v.sh + j0 * p.v.sl,
                     p.v.sl, cols, Dv);
  for (int it = 0; it < kBN * kD / kThreads; ++it) {
    const int e = threadIdx.x + it * kThreads;
    sdK[(e / kD) * L::kLdA + e % kD] = Acc(0);
    sdV[(e / kD) * L::kLdA + e % kD] = Acc(0);
  }
  __syncthreads();
  if (any_flagged<kBN>(sKBad)) zero_flagged_rows<kBN, kD>(sK, L::kLdT, sKBad);

  // The query tiles that see some key of [j0, j0 + cols): from the first whose last row's hi
  // passes j0 until one whose first row's lo reaches j0 + cols (KeyPattern's bounds never
  // decrease with the row, so the tiles in between are exactly those); per query head.
  int64_t tiles_done = 0;  // over the heads: it alternates the query flag sets
  for (int64_t h = h_begin; h < h_end; ++h) {
    const int64_t bh = b * p.heads + h;
    const int64_t row0 = bh * p.q_len;  // first (B, H, Lq) row of this head
    for (int64_t i0 = first_query_tile<kBM>(p, j0) * kBM; i0 < p.q_len; i0 += kBM, ++tiles_done) {
      if (p.pattern.keys(i0, p.q_len, p.kv_len).lo >= j0 + cols) break;
      const int rows = static_cast<int>(p.q_len - i0 < kBM ? p.q_len - i0 : kBM);
      const T* q = static_cast<const T*>(p.q.data) + b * p.q.sb + h * p.q.sh + i0 * p.q.sl;
      const T* d_o =
          static_cast<const T*>(p.dout.data) + b * p.dout.sb + h * p.dout.sh + i0 * p.dout.sl;
      // Non-finite query and dO rows, flagged as they load, leave the products once their scores
      // and dP are formed; their terms are added back below to the keys (and dP entries) they see.
      // The query flags alternate between two sets: the add-back that reads them ends the
      // iteration, so clearing the next tile's set needs no barrier of its own.
      const int parity = static_cast<int>(tiles_done & 1);
      uint8_t* const sQBad = sQFlags + parity * (kBM + 1);
      load_tile<kBM, kD>(sQ, L::kLdT, q, p.q.sl, rows, D, sQBad);
      load_tile<kBM, kD>(sdO, L::kLdT, d_o, p.dout.sl, rows, Dv, sdOBad);
      for (int r = threadIdx.x; r < kBM; r += kThreads) {
        const int64_t row = row0 + i0 + r;
        const bool valid = r < rows;  // padding rows see no key, so p = dS = 0 there
        const KeyRange keys = valid ? p.pattern.keys(i0 + r, p.q_len, p.kv_len) : KeyRange{};
        sLo[r] = keys.lo, sHi[r] = keys.hi;
        sLse[r] = valid ? p.lse[row] : Acc(0);
        sLam[r] = valid ? p.row_scale[row] : Acc(0);
        sDelta[r] = valid ? p.delta[row] : Acc(0);
        sGH[r] = valid && p.g_entropy ? p.g_entropy[row] : Acc(0);
        sGU[r] = valid && p.g_sum_p2 ? p.g_sum_p2[row] : Acc(0);
      }
      __syncthreads();

      clear_flags<kBM>(sQFlags + (1 - parity) * (kBM + 1));
      // dO is zeroed before dP = dO V^T: a flagged row's dP is formed again below.
      if (any_flagged<kBM>(sdOBad)) zero_flagged_rows<kBM, kD>(sdO, L::kLdT, sdOBad);
      scores<kBM, kBN, kD, Acc>(sQ, sK, L::kLdT, sS, L::kLdS, scratch);
      __syncthreads();
      if (any_flagged<kBN>(sKBad)) {  // the scores of the zeroed key rows, from the keys as given
        const T* k_given = rows_as_given<T>(p.k, b, kvh, j0);
#pragma unroll 1
        for (int it = 0; it < kBM * kBN / kThreads; ++it) {
          const int e = threadIdx.x + it * kThreads, r = e / kBN, c = e % kBN;
          if (sKBad[c]) {
            Acc x = 0;
#pragma unroll 1
            for (int d = 0; d < kD; ++d) {
              if (d < D) x += to_acc(sQ[r * L::kLdT + d]) * to_acc(k_given[c * p.k.sl + d]);
            }
            sS[r * L::kLdS + c] = x;
          }
        }
      }
      // (No barrier: the loop below reads each score in the thread that formed it above.)
      // The scaled, capped scores y = cap(lambda q.k) (-inf outside the row's keys), kept for the
      // softcap's derivative, and P o Z for dV, p = e^{s - lse} (0 where masked) with s the logit.
      for (int it = 0; it < kBM * kBN / kThreads; ++it) {
        const int e = threadIdx.x + it * kThreads;
        const int r = e / kBN, c = e % kBN;
        const int64_t j = j0 + c;
        Acc y = neg_inf<Acc>(), pw = 0;
        if (j >= sLo[r] && j < sHi[r]) {
          y = p.softcap.apply(sLam[r] * sS[r * L::kLdS + c]);
          const Acc s = mask.logit(mask.row_offset(b, h, i0 + r), j, y);
          if (s != neg_inf<Acc>()) {
            pw = std::exp(s - sLse[r]) * dropout_factor(p.dropout, bh, i0 + r, j);
          }
        }
        sS[r * L::kLdS + c] = y;
        sP[r * L::kLdP + c] = from_acc<OpT>(pw);
      }
      __syncthreads();
      // The scores are formed: non-finite query rows leave dK += (lambda dS)^T Q from here on.
      if (any_flagged<kBM>(sQBad)) zero_flagged_rows<kBM, kD>(sQ, L::kLdT, sQBad);
      // dV += P^T dO ; dP = dO V^T, both without the non-finite dO rows, which are added back: to
      // dV for the keys they see, and as their own rows of dP (a non-finite dO entry stays in its
      // row).
      block_gemm<kBN, kD, kBM, true, false, Acc>(
          sP, L::kLdP, sdO, L::kLdT, scratch,
          [=](int m, int n, Acc x) { sdV[m * L::kLdA + n] += x; });
      block_gemm<kBM, kBN, kD, false, true, Acc>(
          sdO, L::kLdT, sV, L::kLdT, scratch,
          [=](int m, int n, Acc x) { sdP[m * L::kLdS + n] = x; });
      __syncthreads();
      if (any_flagged<kBM>(sdOBad)) {
        add_back_query_rows<kBM, kBN, kD, T>(sdV, L::kLdA, sP, L::kLdP, sdOBad, p.dout, p, b, h, i0,
                                             j0, rows, cols, Dv);
#pragma unroll 1
        for (int it = 0; it < kBM * kBN / kThreads; ++it) {
          const int e = threadIdx.x + it * kThreads, r = e / kBN, c = e % kBN;
          if (sdOBad[r]) {
            const T* d_o_given = rows_as_given<T>(p.dout, b, h, i0 + r);
            Acc x = 0;
#pragma unroll 1
            for (int d = 0; d < kD; ++d) {
              if (d < Dv) x += to_acc(d_o_given[d]) * to_acc(sV[c * L::kLdT + d]);
            }
            sdP[r * L::kLdS + c] = x;
          }
        }
      }
      // (No barrier: the loop below reads each dP entry in the thread that formed it above, and sdV
      // is next written after the barriers of the next tile.)
      for (int it = 0; it < kBM * kBN / kThreads; ++it) {
        const int e = threadIdx.x + it * kThreads;
        const int r = e / kBN, c = e % kBN;
        const int64_t j = j0 + c;
        const Acc y = sS[r * L::kLdS + c];
        Acc ds = 0;
        if (y != neg_inf<Acc>()) {  // within the row's keys: the logit again, from y and the mask
          const Acc s = mask.logit(mask.row_offset(b, h, i0 + r), j, y);
          const Acc x = s - sLse[r];  // the logit relative to lse, the delta's reference
          const Acc pw = s != neg_inf<Acc>() ? std::exp(x) : Acc(0);
          RowGrads<Acc> g;
          g.g_entropy = sGH[r];
          g.g_sum_p2 = sGU[r];
          // p = 0 (masked, or underflow) contributes nothing, as on the CPU. dP of the weight
          // before dropout is dO . v_j times its factor; dS then goes through the cap to lambda
          // q.k.
          if (pw != Acc(0)) {
            const Acc dp = sdP[r * L::kLdS + c] * dropout_factor(p.dropout, bh, i0 + r, j);
            ds = logit_grad(pw, dp, x, sDelta[r], g);
            // Logits that share a mask entry (a mask broadcast along the batch, the heads, the
            // rows or the keys) add into one element, from any block.
            if (p.d_logits.data) atomicAdd(p.d_logits.at(b, h, i0 + r, j), ds);
            ds *= p.softcap.derivative(y);
          }
        }
        sdS[r * L::kLdP + c] = from_acc<OpT>(ds);
        // (A hidden key's 0 stays 0 even where lambda is not finite.)
        sdSl[r * L::kLdP + c] = from_acc<OpT>(ds == Acc(0) ? ds : ds * sLam[r]);
      }
      __syncthreads();
      clear_flags<kBM>(sdOBad);  // read last above, set again by the next tile's load
      // dK += (lambda dS)^T Q ; G += dS K
      block_gemm<kBN, kD, kBM, true, false, Acc>(
          sdSl, L::kLdP, sQ, L::kLdT, scratch,
          [=](int m, int n, Acc x) { sdK[m * L::kLdA + n] += x; });
      // A deterministic backward adds into G in the key tiles' order (turns.cuh): this tile's turn
      // at the query tile comes after the key tiles from the first that walks it (the walk above
      // takes exactly the key tiles from the one that holds the first row's lo until the last row's
      // hi), uniform over the block. (A guard's blocks walk the heads of their group in one order.)
      int* const turn = p.tile_turns == nullptr ? nullptr : p.tile_turns + row0 + i0;
      if (turn != nullptr) {
        const int64_t first_walker = p.pattern.keys(i0, p.q_len, p.kv_len).lo / kBN;
        if (threadIdx.x == 0) wait_turn(turn, static_cast<int>(blk.tile - first_walker));
        __syncthreads();
      }
      Acc* const dq = p.dq_accum + (row0 + i0) * D;
      const int dq_cols = static_cast<int>(D);
      block_gemm<kBM, kD, kBN, false, false, Acc>(sdS, L::kLdP, sK, L::kLdT, scratch,
                                                  [=](int m, int n, Acc x) {
                                                    if (m < rows && n < dq_cols)
                                                      atomicAdd(dq + m * dq_cols + n, x);
                                                  });
      __syncthreads();
      if (any_flagged<kBM>(sQBad)) {
        add_back_query_rows<kBM, kBN, kD, T>(sdK, L::kLdA, sdSl, L::kLdP, sQBad, p.q, p, b, h, i0,
                                             j0, rows, cols, D);
      }
      if (any_flagged<kBN>(sKBad)) {
        const T* k_given = rows_as_given<T>(p.k, b, kvh, j0);
#pragma unroll 1
        for (int it = 0; it < kBM * kD / kThreads; ++it) {
          const int e = threadIdx.x + it * kThreads, r = e / kD, d = e % kD;
          Acc add = 0;
          bool seen = false;
#pragma unroll 1
          for (int c = 0; c < kBN; ++c) {
            if (r < rows && c < cols && d < D && sKBad[c] && row_sees(p, b, h, i0 + r, j0 + c)) {
              add += to_acc(sdS[r * L::kLdP + c]) * to_acc(k_given[c * p.k.sl + d]);
              seen = true;
            }
          }
          if (seen) atomicAdd(dq + r * dq_cols + d, add);
        }
      }
      if (turn != nullptr) {  // every addition of the block made, the turn passes on
        __syncthreads();
        if (threadIdx.x == 0) pass_turn(turn);
      }
      // (No barrier: what the add-backs above read, the next tile writes only after its barriers;
      // they read the row bounds from the arguments, not from sLo / sHi.)
    }
  }
  __syncthreads();  // the last tile's add-backs before dK and dV are written

  // dK, dV of this query head (the host sums them over the heads of a GQA group), or as a guard
  // of this key/value head, in the input type and the outputs' strides.
  for (int it = 0; it < kBN * kD / kThreads; ++it) {
    const int e = threadIdx.x + it * kThreads;
    const int c = e / kD, d = e % kD;
    if (c >= cols) continue;
    if constexpr (kGrouped) {  // (blk.h is the key/value head: the grid has Hkv heads)
      if (d < D) {
        static_cast<T*>(p.dk_out.data)[p.dk_out.offset(b, kvh, j0 + c) + d] =
            from_acc<T>(sdK[c * L::kLdA + d]);
      }
      if (d < Dv) {
        static_cast<T*>(p.dv_out.data)[p.dv_out.offset(b, kvh, j0 + c) + d] =
            from_acc<T>(sdV[c * L::kLdA + d]);
      }
    } else {
      const int64_t key_row = blk.bh * p.kv_len + j0 + c;
      if (d < D) p.dk[key_row * D + d] = sdK[c * L::kLdA + d];
      if (d < Dv) p.dv[key_row * Dv + d] = sdV[c * L::kLdA + d];
    }
  }
}

// A block per key tile; the guard (kGrouped), fewer blocks that stride over the tiles
// (nonfinite_rows.cuh: tile_grid), and none past the flag where it is 0.
template <typename T, int kD, bool kGrouped>
__global__ void __launch_bounds__(kThreads, blocks_by_shared_memory(BwdLayout<T, kD>::kBytes))
    attention_bwd_kernel(const BwdParams<AccType<T>> p) {
  if constexpr (kGrouped) {
    if (guard_idle(p)) return;
    const int64_t tiles = BwdLayout<T, kD>::blocks(p);
#pragma unroll 1
    for (int64_t index = blockIdx.x; index < tiles; index += gridDim.x) {
      backward_key_tile<T, kD, true, BwdLayout<T, kD>>(p, static_cast<unsigned>(index));
      __syncthreads();  // the tile's last reads of shared memory before the next tile's writes
    }
  } else {
    backward_key_tile<T, kD, false, BwdLayout<T, kD>>(p, blockIdx.x);
  }
}

// The same with the compact tiles (kHasCompactBackward), for GPUs of 99 KB per block.
template <typename T, int kD>
__global__ void __launch_bounds__(kThreads,
                                  blocks_by_shared_memory(CompactBwdLayout<T, kD>::kBytes))
    attention_bwd_compact_kernel(const BwdParams<AccType<T>> p) {
  backward_key_tile<T, kD, false, CompactBwdLayout<T, kD>>(p, blockIdx.x);
}

// The guard's last kernel: dq = lambda G in the input type and d lambda = q . G where asked for
// (the tensor-core family's outputs, which a plain fallback call forms on the host), one warp per
// query row (preprocess_blocks: the grid).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    attention_bwd_postprocess_kernel(const BwdParams<AccType<T>> p) {
  using Acc = AccType<T>;
  if (guard_idle(p)) return;
  const int lane = threadIdx.x % 32;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
       row < p.batch * p.heads * p.q_len; row += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t i = row % p.q_len, bh = row / p.q_len, b = bh / p.heads, h = bh % p.heads;
    const T* q = static_cast<const T*>(p.q.data) + p.q.offset(b, h, i);
    T* dq = static_cast<T*>(p.dq_out.data) + p.dq_out.offset(b, h, i);
    const Acc* g = p.dq_accum + row * p.head_dim;
    const Acc lam = p.row_scale[row];
    const bool want_dot = p.d_row_scale != nullptr;
    Acc dot = 0;
    for (int64_t d = lane; d < p.head_dim; d += 32) {
      if (want_dot) dot += to_acc(q[d]) * g[d];
      dq[d] = from_acc<T>(lam * g[d]);
    }
    if (!want_dot) continue;
    dot = warp_sum(dot);
    if (lane == 0) p.d_row_scale[row] = dot;
  }
}

}  // namespace entropy_attn::cuda::fallback
