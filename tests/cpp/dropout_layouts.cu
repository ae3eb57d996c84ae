// Host-only check (built by nvcc, run on the CPU; tests/test_dropout_layouts.py) that the
// tensor-core kernels drop the weights the op's generator drops (csrc/dropout.h). The kernels draw
// one Philox call per group of weights that a thread holds of an accumulator tile, relying on the
// mma.sync and wgmma accumulator layouts (cute_utils.cuh: for_each_dropout_decision). Here, for
// every thread of each tile that draws dropout (the sm80 forward's tiles, the sm80 backward's S
// tile and its dP column parts, the sm90 forward's and backward's S tiles), the decisions made
// that way are compared with Dropout::factor(bh, i, j) of each element's (row, column), and every
// element of the thread must be decided exactly once. Prints one line per tile and exits 1 on the
// first mismatch.
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda/sm80/bwd_kernel.cuh"
#include "cuda/sm80/fwd_kernel.cuh"
#include "cuda/sm90/bwd_kernel.cuh"
#include "cuda/sm90/fwd_kernel.cuh"

namespace {

using namespace cute;
using entropy_attn::Dropout;
namespace ec = entropy_attn::cuda;

int failures = 0;

// The calls each tile is checked under: (p, seed, bh, first row, first key).
struct Case {
  double p;
  int64_t seed;
  int64_t bh;
  int i0, j0;
};
const Case kCases[] = {{0.3, 7, 0, 0, 0},
                       {0.5, (int64_t{5} << 40) + 3, 77, 384, 1792},
                       {0.02, -9, 1 << 20, 128 * 1000, 112 * 45}};

// Checks one thread's (row, col) view `coord` of a tile whose first row and key are i0, j0.
template <bool kAdjacentN, typename Coord>
bool check_thread(const char* tile, int tid, Coord const& coord, const Case& c) {
  const Dropout<float> d = Dropout<float>::make(c.p, c.seed);
  constexpr int kRows = decltype(size<0>(coord))::value, kCols = decltype(size<1>(coord))::value;
  std::vector<int> seen(kRows * kCols, 0);
  bool ok = true;
  ec::for_each_dropout_decision<kAdjacentN>(
      d, c.bh, c.i0, c.j0, coord, [&](int r, int col, bool kept) {
        ++seen[r * kCols + col];
        const int i = c.i0 + get<0>(coord(r, col)), j = c.j0 + get<1>(coord(r, col));
        if (kept != (d.factor(c.bh, i, j) != 0.f)) {
          if (ok)
            std::printf("%s: thread %d, (%d, %d) = weight (%d, %d): wrong decision\n", tile, tid, r,
                        col, i, j);
          ok = false;
        }
      });
  for (int e = 0; e < kRows * kCols; ++e) {
    if (seen[e] != 1) {
      std::printf("%s: thread %d, element %d decided %d times\n", tile, tid, e, seen[e]);
      ok = false;
      break;
    }
  }
  return ok;
}

template <bool kAdjacentN, typename RowCol, typename ThreadView>
void check_tile(const char* tile, int threads, ThreadView const& view, RowCol const& rowcol) {
  bool ok = true;
  for (const Case& c : kCases) {
    for (int tid = 0; tid < threads && ok; ++tid) {
      Tensor t = view(tid);
      ok = check_thread<kAdjacentN>(tile, tid, make_tensor(t.data(), rowcol(t.layout())), c);
    }
  }
  std::printf("%-48s %s\n", tile, ok ? "ok" : "MISMATCH");
  failures += !ok;
}

template <typename T, int kD, entropy_attn::MaskKind kMask>
void sm80_forward(const char* name) {
  using Kt = ec::sm80::fwd_impl::FwdTraits<T, kD, kMask, true>;
  auto view = [](int tid) {
    return typename Kt::TiledMma{}.get_thread_slice(tid).partition_C(
        make_identity_tensor(Shape<Int<Kt::kBlockM>, Int<Kt::kBlockN>>{}));
  };
  check_tile<true>(name, Kt::kThreads, view,
                   [](auto l) { return ec::sm80::fwd_impl::acc_rowcol(l); });
}

// The sm80 backward: its S tile (dropout_keep_bits) and the renumbered bits of each dP part.
template <typename T, int kD, bool kCompact = false>
void sm80_backward(const char* name) {
  using Kt = ec::sm80::bwd::BwdTraits<T, kD, kCompact>;
  using PartS = Shape<Int<Kt::kBlockM>, Int<Kt::kBlockN / Kt::kDpParts>>;
  auto cS = make_identity_tensor(Shape<Int<Kt::kBlockM>, Int<Kt::kBlockN>>{});
  auto rc = [](auto l) { return ec::sm80::bwd::rowcol(l); };
  auto view = [&](int tid) {
    return typename Kt::TiledMmaSdP{}.get_thread_slice(tid).partition_C(cS);
  };
  check_tile<false>(name, Kt::kNThreads, view, rc);
  bool ok = true;
  for (const Case& c : kCases) {
    const Dropout<float> d = Dropout<float>::make(c.p, c.seed);
    for (int tid = 0; tid < Kt::kNThreads && ok; ++tid) {
      auto thr = typename Kt::TiledMmaSdP{}.get_thread_slice(tid);
      Tensor tc = thr.partition_C(cS);
      Tensor coord = make_tensor(tc.data(), rc(tc.layout()));
      const uint32_t keep = ec::dropout_keep_bits<false>(d, c.bh, c.i0, c.j0, coord);
      constexpr int kRows = decltype(size<0>(coord))::value;
      constexpr int kCols = decltype(size<1>(coord))::value;
      for_each(make_int_sequence<Kt::kDpParts>{}, [&](auto part) {
        Tensor tp = thr.partition_C(local_tile(cS, PartS{}, make_coord(_0{}, part)));
        Tensor cp = make_tensor(tp.data(), rc(tp.layout()));
        constexpr int kPartCols = decltype(size<1>(cp))::value;
        const uint32_t bits = ec::sm80::bwd::part_keep_bits<kCols, kPartCols, kRows>(keep, part);
        for (int r = 0; r < kRows; ++r) {
          for (int col = 0; col < kPartCols; ++col) {
            const int i = c.i0 + get<0>(cp(r, col)), j = c.j0 + get<1>(cp(r, col));
            const bool kept = (bits >> (r * kPartCols + col)) & 1u;
            if (ok && kept != (d.factor(c.bh, i, j) != 0.f)) {
              std::printf("%s: thread %d, dP part %d (%d, %d): wrong bit\n", name, tid,
                          static_cast<int>(part), r, col);
              ok = false;
            }
          }
        }
      });
    }
  }
  std::printf("%-48s %s\n", (std::string(name) + " (dP parts)").c_str(), ok ? "ok" : "MISMATCH");
  failures += !ok;
}

template <typename T, int kD, entropy_attn::MaskKind kMask>
void sm90_forward(const char* name) {
  using Kt = ec::sm90::fwd_impl::FwdTraits<T, kD, kMask>;
  auto view = [](int tid) {
    return typename Kt::TiledMmaS{}.get_thread_slice(tid).partition_C(
        make_identity_tensor(Shape<Int<Kt::kBlockM>, Int<Kt::kBlockN>>{}));
  };
  check_tile<true>(name, Kt::kConsumerThreads, view,
                   [](auto l) { return ec::sm90::acc_rowcol(l); });
}

template <typename T, int kD>
void sm90_backward(const char* name) {
  using Kt = ec::sm90::bwd_impl::BwdTraits<T, kD>;
  // Dropout runs in the steps that keep s: their slices (BwdTraits::slices(true)).
  constexpr int kSlices = Kt::slices(true);
  auto view = [](int tid) {
    return typename Kt::template TiledMmaSdP<kSlices>{}.get_thread_slice(tid).partition_C(
        make_identity_tensor(Shape<Int<Kt::kBlockM>, Int<Kt::kBlockN / kSlices>>{}));
  };
  check_tile<true>(name, Kt::kConsumerThreads, view,
                   [](auto l) { return ec::sm90::acc_rowcol(l); });
}

}  // namespace

int main() {
  using entropy_attn::MaskKind;
  sm80_forward<__nv_bfloat16, 64, MaskKind::kNone>("sm80 forward D=64 (128 x 64)");
  sm80_forward<__nv_bfloat16, 128, MaskKind::kNone>("sm80 forward D=128 (128 x 32)");
  sm80_forward<__half, 128, MaskKind::kBool>("sm80 forward D=128 masked (64 x 64)");
  sm80_backward<__nv_bfloat16, 64>("sm80 backward D=64 (64 x 128)");
  sm80_backward<__half, 128>("sm80 backward D=128 (64 x 128)");
  sm80_backward<__nv_bfloat16, 128, true>("sm80 backward D=128 compact (64 x 64)");
  sm80_forward<__nv_bfloat16, 256, MaskKind::kAdditive>("sm80 forward D=256 (64 x 32)");
  sm80_backward<__nv_bfloat16, 256>("sm80 backward D=256 (64 x 64)");
  sm90_forward<__nv_bfloat16, 64, MaskKind::kNone>("sm90 forward D=64 (128 x 128)");
  sm90_forward<__nv_bfloat16, 128, MaskKind::kAdditive>("sm90 forward D=128 masked (128 x 112)");
  sm90_backward<__half, 128>("sm90 backward D=128 (64 x 64 slices)");
  sm90_backward<__nv_bfloat16, 64>("sm90 backward D=64 (64 x 128, one slice)");
  if (failures) std::printf("%d tile(s) with wrong dropout decisions\n", failures);
  return failures ? 1 : 0;
}
