// CUDA forward kernel of the fused attention with per-row statistics (FlashAttention-2 structure).
//
// One thread block per (batch, head, tile of kBM query rows). The block keeps its query tile, the
// running output O (fp32/fp64) and the per-row state of online_stats.h in shared memory, and
// streams key/value tiles of kBN keys through shared memory: S = Q K^T, the row pass (logits,
// running max, p = e^{s - m}, l/t/u sums: the same functions the CPU kernel uses), then O = alpha O
// + P V. No L_q x L_k buffer exists; lse is written for the backward. Only the keys some row of the
// tile may see are streamed (KeyPattern: causality, windows, documents).
#pragma once

#include "../../online_stats.h"
#include "../params.h"
#include "../row_statistics.cuh"
#include "block_gemm.cuh"
#include "device_utils.cuh"
#include "nonfinite_rows.cuh"

namespace entropy_attn::cuda::fallback {

// Tile sizes per input type and head-dim bucket, chosen so that the shared memory of a block stays
// within 99 KB (every GPU since sm_80 but the A100/H100 class) where the head dim allows.
template <typename T, int kD>
struct FwdTiles {
  static constexpr bool k16 = kIs16Bit<T>, k64 = std::is_same_v<T, double>;
  static constexpr int kBM = k16   ? (kD <= 128 ? 64 : 32)
                             : k64 ? (kD <= 64 ? 32 : 16)
                                   : (kD <= 64    ? 64
                                      : kD <= 128 ? 32
                                                  : 16);
  static constexpr int kBN = k16 ? (kD <= 64 ? 64 : 32) : kBM;
};

// Shared memory of a block that owns a query tile: Q, K (and V) tiles, scores S, weights P, the
// output accumulator O (without values, for attention_sparsity: no V, O, and P overwrites S), the
// per-row arrays of TileRows and alpha, and the WMMA scratch.
template <typename T, int kD, bool kValues>
struct QueryTileLayout : FwdTiles<T, kD> {
  using Acc = AccType<T>;
  // P's type in P V: the input type on tensor cores, else the accumulate type, then P overwrites S.
  using OpT = std::conditional_t<kIs16Bit<T> && kValues, T, Acc>;
  static constexpr bool kPInPlace = std::is_same_v<OpT, Acc>;
  using FwdTiles<T, kD>::kBM;
  using FwdTiles<T, kD>::kBN;
  static constexpr int kLdT = padded_ld<T>(kD);     // Q, K, V tiles
  static constexpr int kLdS = padded_ld<Acc>(kBN);  // scores
  static constexpr int kLdP = padded_ld<OpT>(kBN);  // weights
  static constexpr int kLdO = padded_ld<Acc>(kD);   // output accumulator
  static constexpr size_t kQ = 0;
  static constexpr size_t kK = kQ + align128(sizeof(T) * kBM * kLdT);
  static constexpr size_t kV = kK + align128(sizeof(T) * kBN * kLdT);
  static constexpr size_t kS = kV + (kValues ? align128(sizeof(T) * kBN * kLdT) : 0);
  static constexpr size_t kP = kS + (kPInPlace ? 0 : align128(sizeof(Acc) * kBM * kLdS));
  static constexpr size_t kO = kP + align128(sizeof(OpT) * kBM * kLdP);
  static constexpr size_t kStats = kO + (kValues ? align128(sizeof(Acc) * kBM * kLdO) : 0);
  static constexpr size_t kLam = kStats + align128(sizeof(RowStats<Acc>) * kBM);
  static constexpr size_t kAlpha = kLam + align128(sizeof(Acc) * kBM);
  static constexpr size_t kFactor = kAlpha + align128(sizeof(Acc) * kBM);
  static constexpr size_t kLo = kFactor + align128(sizeof(Acc) * kBM);
  static constexpr size_t kHi = kLo + align128(sizeof(int64_t) * kBM);
  static constexpr size_t kN = kHi + align128(sizeof(int64_t) * kBM);
  // Flags of the non-finite value rows (nonfinite_rows.cuh), two sets for alternate key tiles.
  static constexpr size_t kFlags = kN + align128(sizeof(int64_t) * kBM);
  static constexpr size_t kScratch = kFlags + align128(2 * (kBN + 1));
  static constexpr size_t kBytes = kScratch + (kIs16Bit<T> ? sizeof(float) * kWarps * 256 : 0);
  static_assert(kBytes <= 166912, "over an A100's 163 KB of shared memory per block");
  // The tiles: one per (batch, head, query tile), and the forward's grid (a block per tile, or as
  // a guard the capped grid of nonfinite_rows.cuh: tile_grid).
  __host__ __device__ static int64_t blocks(const AttentionArgs<Acc>& p) {
    return (p.q_len + kBM - 1) / kBM * p.batch * p.heads;
  }
  static int64_t grid(const AttentionArgs<Acc>& p) {
    return tile_grid(blocks(p), p.nonfinite != nullptr);
  }
};

template <typename T, int kD>
using FwdLayout = QueryTileLayout<T, kD, true>;

// Per-row state of a query tile in shared memory, set up before the key loop.
template <typename Acc>
struct TileRows {
  RowStats<Acc>* stats;  // the online state of online_stats.h
  Acc* lam;              // lambda_i
  Acc* factor;           // g(n_i) / temperature
  int64_t *lo, *hi;      // the keys [lo, hi) the row may see (KeyPattern)
  int64_t* n;            // n_i
};

// The TileRows of a kernel's shared-memory layout L (with kStats, kLam, kFactor, kLo, kHi, kN).
template <typename L>
__device__ __forceinline__ TileRows<typename L::Acc> tile_rows(unsigned char* smem) {
  using Acc = typename L::Acc;
  return {
      reinterpret_cast<RowStats<Acc>*>(smem + L::kStats), reinterpret_cast<Acc*>(smem + L::kLam),
      reinterpret_cast<Acc*>(smem + L::kFactor),          reinterpret_cast<int64_t*>(smem + L::kLo),
      reinterpret_cast<int64_t*>(smem + L::kHi),          reinterpret_cast<int64_t*>(smem + L::kN)};
}

// Row setup of the tile, one warp per row: the row's keys [lo, hi), n_i (a warp-wide count of the
// mask's allowed keys among them), g(n_i) / temperature, lambda_i (scale_policy.h via ScalePolicy)
// and the state before the first key (online_stats.h: initial_state, with the head's sink).
template <typename T, typename Acc>
__device__ void setup_rows(const AttentionArgs<Acc>& a, const ScalePolicy<Acc>& scale, int64_t b,
                           int64_t h, int64_t i0, int rows, int tile_height,
                           const TileRows<Acc>& t) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const MaskArg<Acc> mask = mask_for<T>(a.mask);
  for (int r = warp; r < tile_height; r += kWarps) {
    const int64_t i = i0 + r;
    // Padding rows see no key.
    const KeyRange keys = r < rows ? a.pattern.keys(i, a.q_len, a.kv_len) : KeyRange{};
    int64_t n = keys.hi - keys.lo;
    if (mask.kind != MaskKind::kNone && r < rows) {
      const int64_t off = mask.row_offset(b, h, i);
      n = 0;
      for (int64_t j = keys.lo + lane; j < keys.hi; j += 32) n += mask.counts(off, j);
      n = warp_sum(n);
    }
    const Acc factor = scale.factor(n);
    const Acc lam = r < rows ? scale.lambda(b, h, i, factor) : Acc(0);
    if (lane == 0) {
      t.stats[r] = initial_state(a.sinks != nullptr, a.sinks != nullptr ? a.sinks[h] : Acc(0));
      t.lam[r] = lam, t.factor[r] = factor, t.lo[r] = keys.lo, t.hi[r] = keys.hi, t.n[r] = n;
    }
  }
}

// How one row's raw scores r = q.k become logits (the CPU kernels' LogitRow): x = lambda r,
// capped when softcap is on, plus the mask; keys outside [lo, hi) are -inf.
template <typename Acc>
struct RowLogits {
  MaskArg<Acc> mask;
  int64_t mask_off, lo, hi;
  Acc lam;
  Softcap<Acc> softcap;

  __device__ __forceinline__ Acc operator()(int64_t j, Acc r) const {
    if (j < lo || j >= hi) return neg_inf<Acc>();
    return mask.logit(mask_off, j, softcap.apply(lam * r));
  }
};

// The dropout factors of one query row (row i of head row bh = b * H + h): 1 when dropout is off.
// Each key draws its own Philox block (four keys share one): the fallback recomputes rather than
// exchanges them between lanes.
template <typename Acc>
struct RowDropout {
  Dropout<Acc> dropout;
  int64_t bh, i;

  __device__ __forceinline__ Acc factor(int64_t j) const {
    return dropout_factor(dropout, bh, i, j);
  }
};

// The row pass over one key tile, one warp per row: raw scores in s[0, kBN) become logits
// (RowLogits), the running state moves to the new max (online_stats.h: rescale), and
// p = e^{s - m} goes to pw with l, t, u accumulated; then pw is dropped out (the statistics
// describe the attention distribution, P V sees it dropped out). alpha = e^{m_old - m_new} rescales
// the row's output in the P V epilogue. pw may alias s when OpT is Acc.
template <int kBN, typename Acc, typename OpT>
__device__ __forceinline__ void softmax_row(const RowLogits<Acc>& logits,
                                            const RowDropout<Acc>& drop, int64_t j0, Acc* s,
                                            OpT* pw, RowStats<Acc>& state, Acc& alpha_out) {
  const int lane = threadIdx.x % 32;
  Acc mx = neg_inf<Acc>();
  for (int c = lane; c < kBN; c += 32) {
    const Acc x = logits(j0 + c, s[c]);
    s[c] = x;
    mx = nan_max(mx, x);
  }
  mx = warp_max(mx);
  RowStats<Acc> st = state;  // every lane holds the same state and computes the same update
  Acc alpha = 1;
  if (!(mx <= st.m)) alpha = rescale(st, mx);  // a larger max, or NaN
  // While no key of the row has been allowed (m = -inf) every weight is 0, and s - m would be
  // -inf - -inf = NaN.
  const bool any_allowed = st.m != neg_inf<Acc>();
  Acc l = 0, t = 0, u = 0;
  for (int c = lane; c < kBN; c += 32) {
    const Acc x = s[c] - st.m;  // -inf for masked keys
    Acc e = 0;
    if (any_allowed && x != neg_inf<Acc>()) {
      e = std::exp(x);
      accumulate(l, t, u, x, e);
    }
    pw[c] = from_acc<OpT>(e);
  }
  // Dropout in a pass of its own: the Philox rounds beside the exponentials spill registers at some
  // tile sizes. P in Acc holds e exactly; a 16-bit P forms e again from the logit, which s still
  // holds, so that the dropped weight is rounded once.
  if (drop.dropout.on() && any_allowed) {
    for (int c = lane; c < kBN; c += 32) {
      if constexpr (std::is_same_v<OpT, Acc>) {
        pw[c] *= drop.factor(j0 + c);
      } else {
        const Acc x = s[c] - st.m;
        if (x != neg_inf<Acc>()) pw[c] = from_acc<OpT>(std::exp(x) * drop.factor(j0 + c));
      }
    }
  }
  l = warp_sum(l), t = warp_sum(t), u = warp_sum(u);
  st.l += l, st.t += t, st.u += u;
  __syncwarp();
  if (lane == 0) state = st, alpha_out = alpha;
}

// The forward of query tile `index` (batch x heads x query tiles, tiles fastest) by one block.
template <typename T, int kD>
__device__ __forceinline__ void forward_query_tile(const FwdParams<AccType<T>>& p, unsigned index) {
  using L = FwdLayout<T, kD>;
  using Acc = typename L::Acc;
  using OpT = typename L::OpT;
  constexpr int kBM = L::kBM, kBN = L::kBN;
  extern __shared__ __align__(128) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem + L::kQ);
  T* sK = reinterpret_cast<T*>(smem + L::kK);
  T* sV = reinterpret_cast<T*>(smem + L::kV);
  Acc* sS = reinterpret_cast<Acc*>(smem + L::kS);
  OpT* sP = reinterpret_cast<OpT*>(smem + L::kP);
  Acc* sO = reinterpret_cast<Acc*>(smem + L::kO);
  const TileRows<Acc> tr = tile_rows<L>(smem);
  Acc* sAlpha = reinterpret_cast<Acc*>(smem + L::kAlpha);
  uint8_t* const sVFlags = smem + L::kFlags;
  float* scratch = reinterpret_cast<float*>(smem + L::kScratch);

  const BlockIndex blk = block_index(index, (p.q_len + kBM - 1) / kBM, p.heads, p.kv_heads);
  const int64_t b = blk.b, h = blk.h, kvh = blk.kvh, i0 = blk.tile * kBM;
  const int rows = static_cast<int>(p.q_len - i0 < kBM ? p.q_len - i0 : kBM);
  const T* q = static_cast<const T*>(p.q.data) + b * p.q.sb + h * p.q.sh + i0 * p.q.sl;
  const T* k = static_cast<const T*>(p.k.data) + b * p.k.sb + kvh * p.k.sh;
  const T* v = static_cast<const T*>(p.v.data) + b * p.v.sb + kvh * p.v.sh;

  load_tile<kBM, kD>(sQ, L::kLdT, q, p.q.sl, rows, p.head_dim);
  for (int e = threadIdx.x; e < kBM * kD; e += kThreads) sO[(e / kD) * L::kLdO + e % kD] = Acc(0);
  setup_rows<T>(p, p.scale, b, h, i0, rows, kBM, tr);
  const MaskArg<Acc> mask = mask_for<T>(p.mask);
  clear_flags<2 * kBN + 1>(sVFlags);
  __syncthreads();

  // The keys some row of the tile may see: [lo of its first row, hi of its last) (KeyPattern's
  // bounds never decrease with the row), so windows and documents skip whole key tiles.
  const int64_t kv_begin = tr.lo[0], kv_end = tr.hi[rows - 1];
  const int warp = threadIdx.x / 32;
  for (int64_t j0 = kv_begin; j0 < kv_end; j0 += kBN) {
    const int cols = static_cast<int>(kv_end - j0 < kBN ? kv_end - j0 : kBN);
    load_tile<kBN, kD>(sK, L::kLdT, k + j0 * p.k.sl, p.k.sl, cols, p.head_dim);
    // Non-finite value rows leave P V: flagged as they load, zeroed, and added back below to the
    // rows that see them. The flags of alternate tiles alternate, so that clearing the next tile's
    // set needs no barrier of its own: its last reader, the previous tile's add-back, is ordered
    // before the barrier below, and its next writer, the next tile's load, after this tile's.
    const int parity = static_cast<int>(((j0 - kv_begin) / kBN) & 1);
    uint8_t* const sVBad = sVFlags + parity * (kBN + 1);
    load_tile<kBN, kD>(sV, L::kLdT, v + j0 * p.v.sl, p.v.sl, cols, p.v_head_dim, sVBad);
    __syncthreads();
    clear_flags<kBN>(sVFlags + (1 - parity) * (kBN + 1));
    if (any_flagged<kBN>(sVBad)) zero_flagged_rows<kBN, kD>(sV, L::kLdT, sVBad);
    scores<kBM, kBN, kD, Acc>(sQ, sK, L::kLdT, sS, L::kLdS, scratch);
    __syncthreads();
    // Every warp takes the same number of rows, padding rows included (they see no key: P = 0),
    // so that no branch separates a warp's lanes around the softmax's shuffles.
    for (int slice = 0; slice < kBM / kWarps; ++slice) {
      const int r = warp + slice * kWarps;
      const RowLogits<Acc> logits{
          mask, mask.row_offset(b, h, i0 + r), tr.lo[r], tr.hi[r], tr.lam[r], p.softcap};
      softmax_row<kBN>(logits, RowDropout<Acc>{p.dropout, blk.bh, i0 + r}, j0, sS + r * L::kLdS,
                       sP + r * L::kLdP, tr.stats[r], sAlpha[r]);
    }
    __syncthreads();
    block_gemm<kBM, kD, kBN, false, false, Acc>(sP, L::kLdP, sV, L::kLdT, scratch,
                                                [=](int m, int n, Acc x) {
                                                  Acc& o = sO[m * L::kLdO + n];
                                                  o = o * sAlpha[m] + x;
                                                });
    __syncthreads();
    // The zeroed value rows, added to the output rows that see them. No barrier follows: the next
    // tile writes sO, sP and this tile's flags only after its own barriers, and this reads V from
    // global memory, not the next tile's sV.
    if (any_flagged<kBN>(sVBad)) {
      const T* v_given = rows_as_given<T>(p.v, b, kvh, j0);
#pragma unroll 1
      for (int it = 0; it < kBM * kD / kThreads; ++it) {
        const int e = threadIdx.x + it * kThreads, r = e / kD, d = e % kD;
#pragma unroll 1
        for (int c = 0; c < kBN; ++c) {
          if (r < rows && c < cols && d < p.v_head_dim && sVBad[c] &&
              row_sees(p, b, h, i0 + r, j0 + c)) {
            sO[r * L::kLdO + d] += to_acc(sP[r * L::kLdP + c]) * to_acc(v_given[c * p.v.sl + d]);
          }
        }
      }
    }
  }
  __syncthreads();  // the last tile's add-back before the rows are finished

  // Finish each row: O / l and the statistics (online_stats.h: finalize).
  const int lane = threadIdx.x % 32;
  for (int r = warp; r < rows; r += kWarps) {
    const RowResult<Acc> res = finalize(tr.stats[r]);
    const int64_t row = blk.bh * p.q_len + i0 + r;
    T* out = static_cast<T*>(p.out.data) + p.out.offset(b, h, i0 + r);
    for (int64_t d = lane; d < p.v_head_dim; d += 32) {
      out[d] = from_acc<T>(sO[r * L::kLdO + d] * res.inv_l);
    }
    if (lane == 0) {
      p.n_keys[row] = tr.n[r];
      p.row_scale[row] = tr.lam[r];
      p.length_factor[row] = tr.factor[r];
      p.lse[row] = res.lse;
      if (p.entropy != nullptr) {  // a call with statistics
        store_row_statistics(p, row, res, tr.n[r], has_sink_entry(p.sinks, h));
      }
    }
  }
}

// A block per query tile; as the guard of a tensor-core forward, fewer blocks that stride over the
// tiles (nonfinite_rows.cuh: tile_grid), and none past the flag where it is 0.
template <typename T, int kD>
__global__ void __launch_bounds__(kThreads, blocks_by_shared_memory(FwdLayout<T, kD>::kBytes))
    attention_fwd_kernel(const FwdParams<AccType<T>> p) {
  if (guard_idle(p)) return;  // the guard of a tensor-core forward with finite results
  const int64_t tiles = FwdLayout<T, kD>::blocks(p);
#pragma unroll 1
  for (int64_t index = blockIdx.x; index < tiles; index += gridDim.x) {
    forward_query_tile<T, kD>(p, static_cast<unsigned>(index));
    __syncthreads();  // the tile's last reads of shared memory before the next tile's writes
  }
}

}  // namespace entropy_attn::cuda::fallback
