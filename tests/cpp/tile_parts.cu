// Host-only check (built by nvcc, run on the CPU; tests/test_tile_parts.py) that the sm80
// backward's products run in parts read the right shared-memory elements: dP = dO V^T in column
// parts of the keys (kDpParts, D = 128) and G = dS K in column parts of the head dim (kDqParts,
// D = 256). A part's operand is a local_tile of a swizzled shared-memory layout (V, or the
// transposed view K^T of K's bytes); for every thread of the product, every element its copy
// partition of the part reads must sit at the offset of the element (part origin + the coordinate
// the same partition of a standalone part-sized tile gives), under the full tile's layout. And the
// G part's accumulator coordinates (the dq atomics' targets) must be the part's columns. Prints one
// line per check and exits 1 on the first mismatch.
#include <cstdio>

#include "cuda/sm80/bwd_kernel.cuh"

namespace {

using namespace cute;
namespace bwd = entropy_attn::cuda::sm80::bwd;

int failures = 0;

// Every thread's partition (by `thr_of(tid)`, a copy or mma thread slice) of part `part` of the
// tile `layout` (a counting tensor: its elements are the shared-memory offsets) against the
// offsets of the coordinates that the same partition of a part-sized identity tensor gives, moved
// by the part's origin.
template <typename Layout, typename PartShape, typename ThrOf>
void check_part(const char* name, int threads, Layout const& layout, PartShape const& part_shape,
                int part, int along, ThrOf const& thr_of) {
  Tensor offsets = make_tensor(counting_iterator<int>(0), layout);
  Tensor coords = make_identity_tensor(part_shape);
  bool ok = true;
  for (int tid = 0; tid < threads && ok; ++tid) {
    auto thr = thr_of(tid);
    Tensor got = thr.partition_S(along == 0 ? local_tile(offsets, part_shape, make_coord(part, 0))
                                            : local_tile(offsets, part_shape, make_coord(0, part)));
    Tensor where = thr.partition_S(coords);
    for (int e = 0; e < size(got) && ok; ++e) {
      const int r = get<0>(where(e)) + (along == 0 ? part * size<0>(part_shape) : 0);
      const int c = get<1>(where(e)) + (along == 1 ? part * size<1>(part_shape) : 0);
      if (got(e) != layout(r, c)) {
        std::printf("%s: part %d, thread %d, element %d reads offset %d, not (%d, %d) at %d\n",
                    name, part, tid, e, static_cast<int>(got(e)), r, c,
                    static_cast<int>(layout(r, c)));
        ok = false;
      }
    }
  }
  std::printf("%-52s part %d %s\n", name, part, ok ? "ok" : "MISMATCH");
  failures += !ok;
}

// The backward of head dim kD: dP's parts of V (keys) and G's parts of K^T (the head dim), as
// main_block partitions them, and G's accumulator coordinates.
template <typename T, int kD>
void sm80_backward_parts() {
  using Kt = bwd::BwdTraits<T, kD>;
  constexpr int kM = Kt::kBlockM, kN = Kt::kBlockN;
  char name[64];
  using PartKV = Shape<Int<kN / Kt::kDpParts>, Int<kD>>;
  for (int part = 0; part < Kt::kDpParts; ++part) {
    std::snprintf(name, sizeof(name), "sm80 backward D=%d dP: V keys", kD);
    check_part(name, Kt::kNThreads, typename Kt::SmemLayoutKV{}, PartKV{}, part, 0, [](int tid) {
      auto mma = typename Kt::TiledMmaSdP{};
      return make_tiled_copy_B(typename Kt::SmemCopyAtom{}, mma).get_thread_slice(tid);
    });
  }
  using PartKt = Shape<Int<kD / Kt::kDqParts>, Int<kN>>;
  using PartDq = Shape<Int<kM>, Int<kD / Kt::kDqParts>>;
  for (int part = 0; part < Kt::kDqParts; ++part) {
    std::snprintf(name, sizeof(name), "sm80 backward D=%d G: K^T head dim", kD);
    check_part(name, Kt::kNThreads, typename Kt::SmemLayoutKt{}, PartKt{}, part, 0, [](int tid) {
      auto mma = typename Kt::TiledMmadQ{};
      return make_tiled_copy_B(typename Kt::SmemCopyAtomT{}, mma).get_thread_slice(tid);
    });
    // The accumulator coordinates of the part: its rows, and columns [part * P, (part + 1) * P).
    bool ok = true;
    for (int tid = 0; tid < Kt::kNThreads && ok; ++tid) {
      auto thr = typename Kt::TiledMmadQ{}.get_thread_slice(tid);
      Tensor whole = thr.partition_C(make_identity_tensor(PartDq{}));
      Tensor got = thr.partition_C(local_tile(make_identity_tensor(Shape<Int<kM>, Int<kD>>{}),
                                              PartDq{}, make_coord(0, part)));
      for (int e = 0; e < size(got) && ok; ++e) {
        ok = get<0>(got(e)) == get<0>(whole(e)) &&
             get<1>(got(e)) == get<1>(whole(e)) + part * (kD / Kt::kDqParts);
      }
    }
    std::snprintf(name, sizeof(name), "sm80 backward D=%d G: dq columns", kD);
    std::printf("%-52s part %d %s\n", name, part, ok ? "ok" : "MISMATCH");
    failures += !ok;
  }
}

}  // namespace

int main() {
  sm80_backward_parts<__nv_bfloat16, 64>();
  sm80_backward_parts<__half, 128>();
  sm80_backward_parts<__nv_bfloat16, 256>();
  if (failures) std::printf("%d check(s) failed\n", failures);
  return failures ? 1 : 0;
}
