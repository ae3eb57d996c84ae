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
template <typename DS, typename Coord>
CUTE_DEVICE void add_logit_grads(const LogitGradArg<float>& g, int b, int h, int i0, int j0,
                                 int q_len, int kv_len, DS const& ds, Coord const& coord) {
  using cute::get;
  using cute::size;
  float* tile = g.at(b, h, i0, j0);
  CUTE_UNROLL
  for (int mi = 0; mi < size<0>(ds); ++mi) {
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
