// CUDA kernel of the fused l1/l2 sparsity of general attention a_ij = f(s_ij) (seed 003):
// S_i = sum_j |a_ij| / sqrt(n_i sum_j a_ij^2), f = exp (softmax), relu^2 or identity, with the
// logits, masks, key patterns (causality, windows, alignment), softcap and scale policies of the
// attention op (no sinks or dropout: attention_sparsity has neither). The forward's structure
// without values: one block per (batch, head, query tile) streams key tiles through shared memory;
// the row sums come from online_stats.h (exp) and reduction_math.h (powers), as on the CPU.
#pragma once

#include "../../reduction_math.h"
#include "fwd_kernel.cuh"

namespace entropy_attn::cuda::fallback {

template <typename T, int kD>
using SparsityLayout = QueryTileLayout<T, kD, false>;

// One row of a key tile for a = relu(s)^2 or s, one warp per row: raw scores become logits, and
// the power sums l1 (st.l) and l2 (st.u) grow, relative to the running max |b| (st.m).
template <int kBN, typename Acc>
__device__ __forceinline__ void power_sums_row(bool relu2, const RowLogits<Acc>& logits, int64_t j0,
                                               Acc* s, RowStats<Acc>& state) {
  const int lane = threadIdx.x % 32;
  Acc mx = neg_inf<Acc>(), bmax = 0;
  for (int c = lane; c < kBN; c += 32) {
    const Acc x = logits(j0 + c, s[c]);
    s[c] = x;
    mx = nan_max(mx, x);
    const Acc b = power_base(relu2, x);
    const Acc ab = b < Acc(0) ? -b : b;
    bmax = ab > bmax ? ab : bmax;
  }
  mx = warp_max(mx);
  bmax = warp_max(bmax);
  RowStats<Acc> st = state;
  if (mx != mx) st.l = mx;  // a NaN logit makes the row NaN, as softmax does
  rescale_power_sums(st, bmax, relu2);
  if (st.m > Acc(0)) {  // else every weight so far is 0
    const PowerScale<Acc> ps = power_scale(st.m);
    Acc a1 = 0, a2 = 0;
    for (int c = lane; c < kBN; c += 32) {
      const Acc x = power_base(relu2, s[c]) * ps.up * ps.inv;
      const Acc a = relu2 ? x * x : x;
      a1 += a < Acc(0) ? -a : a;
      a2 += a * a;
    }
    st.l += warp_sum(a1);
    st.u += warp_sum(a2);
  }
  __syncwarp();
  if (lane == 0) state = st;
}

// At least one block per SM: without that bound ptxas held the bf16, D = 64 instance for sm_80 to
// 40 registers and spilled the tile loads' addresses once the key loop began at a row's lo.
template <typename T, int kD>
__global__ void __launch_bounds__(kThreads, 1)
    attention_sparsity_kernel(const SparsityParams<AccType<T>> p) {
  using L = SparsityLayout<T, kD>;
  using Acc = typename L::Acc;
  constexpr int kBM = L::kBM, kBN = L::kBN;
  extern __shared__ __align__(128) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem + L::kQ);
  T* sK = reinterpret_cast<T*>(smem + L::kK);
  Acc* sS = reinterpret_cast<Acc*>(smem + L::kS);  // scores, then weights in place
  const TileRows<Acc> tr = tile_rows<L>(smem);
  Acc* sAlpha = reinterpret_cast<Acc*>(smem + L::kAlpha);  // unused e^{m_old - m_new}
  float* scratch = reinterpret_cast<float*>(smem + L::kScratch);

  const BlockIndex blk = block_index(blockIdx.x, (p.q_len + kBM - 1) / kBM, p.heads, p.kv_heads);
  const int64_t b = blk.b, h = blk.h, kvh = blk.kvh, i0 = blk.tile * kBM;
  const int rows = static_cast<int>(p.q_len - i0 < kBM ? p.q_len - i0 : kBM);
  const T* q = static_cast<const T*>(p.q.data) + b * p.q.sb + h * p.q.sh + i0 * p.q.sl;
  const T* k = static_cast<const T*>(p.k.data) + b * p.k.sb + kvh * p.k.sh;
  load_tile<kBM, kD>(sQ, L::kLdT, q, p.q.sl, rows, p.head_dim);
  setup_rows<T>(p, p.scale, b, h, i0, rows, kBM, tr);
  const MaskArg<Acc> mask = mask_for<T>(p.mask);
  __syncthreads();

  // The keys some row of the tile may see, as in the forward.
  const int64_t kv_begin = tr.lo[0], kv_end = tr.hi[rows - 1];
  const int warp = threadIdx.x / 32;
  for (int64_t j0 = kv_begin; j0 < kv_end; j0 += kBN) {
    const int cols = static_cast<int>(kv_end - j0 < kBN ? kv_end - j0 : kBN);
    load_tile<kBN, kD>(sK, L::kLdT, k + j0 * p.k.sl, p.k.sl, cols, p.head_dim);
    __syncthreads();
    scores<kBM, kBN, kD, Acc>(sQ, sK, L::kLdT, sS, L::kLdS, scratch);
    __syncthreads();
    for (int r = warp; r < rows; r += kWarps) {
      Acc* s = sS + r * L::kLdS;
      const RowLogits<Acc> logits{
          mask, mask.row_offset(b, h, i0 + r), tr.lo[r], tr.hi[r], tr.lam[r], p.softcap};
      if (p.kind == SparsityKind::kExp) {  // l1 = sum p = l and l2 = sum p^2 = u, relative to m
        softmax_row<kBN>(logits, RowDropout<Acc>{}, j0, s, s, tr.stats[r], sAlpha[r]);
      } else {
        power_sums_row<kBN>(p.kind == SparsityKind::kRelu2, logits, j0, s, tr.stats[r]);
      }
    }
    __syncthreads();
  }

  for (int r = threadIdx.x; r < rows; r += kThreads) {
    p.out[blk.bh * p.q_len + i0 + r] =
        attention_sparsity_value(tr.stats[r].l, tr.stats[r].u, tr.n[r]);
  }
}

}  // namespace entropy_attn::cuda::fallback
