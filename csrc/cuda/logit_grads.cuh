// The additive mask's gradient in the tensor-core backwards (sm80, sm90; params.h: d_logits).
#pragma once

#include <cute/tensor.hpp>

#include "../kernel_args.h"

namespace entropy_attn::cuda {

// A tile's dS_ij (a rowcol view of fp32 values, before their rounding to T for the products; the
// logit s = lambda_i x + mask_ij, so dS is the mask entry's gradient too) added into the mask entry
// of each logit. coord gives each value's (row, key) in the tile whose first row is i0 and first
// key j0. Logits share an entry where the mask broadcasts (the query heads of the GQA group a CTA
// walks, the other heads' and batches' CTAs, a row's keys or a key's rows): fp32 atomics onto the
// zero-filled accumulator, as the fallback adds them. Nothing is added for keys >= Lk or rows >=
// Lq, nor for dS = 0 (a hidden or underflowed weight), which adds nothing.
//
// A per-key mask ((B, 1, 1, Lk): a learned bias per key, its stride along rows 0) would send every
// value of a key in the tile to one address, which the L2 serializes: there each thread first sums
// its rows' values of a key into its first row's, then the lanes that hold the same keys add
// theirs by shuffles, and lanes 0-3 add each key's sum for the warp. The lanes: the accumulator
// layout of mma.sync m16n8 and of wgmma, the same within a warp, gives lane l rows l / 4 (+ 8,
// + 16 ...) and keys 2 (l % 4) (+ 1, + 8 ...), so lanes l ^ 4, l ^ 8 and l ^ 16 hold l's keys.
// Rows >= Lq and keys >= Lk add nothing to the sums: the masked kernels' logits there are -inf and
// their dS 0, as wherever p = 0. The sums take the places of the values they add (ds's registers,
// which nothing reads after this call): at 255 registers, the sm80 D = 128 kernel spilled 4-12
// bytes (ptxas, sm_80 or sm_90) with any sum held in a register of its own, the Hopper kernels
// have room. A per-row mask (stride 0 along keys) keeps one atomic per value: its gradient is 0
// for a loss of the output alone (a row's softmax does not move with an offset).
template <typename DS, typename Coord>
CUTE_DEVICE void add_logit_grads(const LogitGradArg<float>& g, int b, int h, int i0, int j0,
                                 int q_len, int kv_len, DS&& ds, Coord const& coord) {
  using cute::get;
  using cute::size;
  float* tile = g.at(b, h, i0, j0);
  const bool rows_shared = g.si == 0;  // uniform: the call's stride
  if (rows_shared) {
    CUTE_UNROLL
    for (int mi = 1; mi < size<0>(ds); ++mi) {
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(ds); ++ni) ds(0, ni) += ds(mi, ni);
    }
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(ds); ++ni) {
      ds(0, ni) += __shfl_xor_sync(0xffffffffu, ds(0, ni), 4);
      ds(0, ni) += __shfl_xor_sync(0xffffffffu, ds(0, ni), 8);
      ds(0, ni) += __shfl_xor_sync(0xffffffffu, ds(0, ni), 16);
    }
  }
  const bool lead = threadIdx.x % 32 < 4;
  CUTE_UNROLL
  for (int mi = 0; mi < size<0>(ds); ++mi) {
    if (rows_shared && (mi > 0 || !lead)) break;  // the warp's sums: lanes 0-3's first row
    const int r = get<0>(coord(mi, 0));
    if (i0 + r >= q_len) continue;
    float* row = tile + r * g.si;
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(ds); ++ni) {
      const int c = get<1>(coord(mi, ni));
      if (j0 + c < kv_len && ds(mi, ni) != 0.f) atomicAdd(row + c * g.sj, ds(mi, ni));
    }
  }
}

}  // namespace entropy_attn::cuda
