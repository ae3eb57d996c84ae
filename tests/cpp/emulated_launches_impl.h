// The definitions of emulated_launches.h, for one input type: cuda_emulation.cmake writes one
// translation unit per type that defines EA_EMULATED_T and includes this file.
// clang-format off
#include "cuda_emulation.h"  // first: the CUDA built-ins the kernel headers use
// clang-format on

#include <gtest/gtest.h>

#include <algorithm>
#include <type_traits>

#include "cuda/fallback/bwd_kernel.cuh"
#include "cuda/fallback/fwd_kernel.cuh"
#include "cuda/fallback/instantiations/dispatch.h"
#include "cuda/fallback/sparsity_kernel.cuh"
#include "emulated_launches.h"

#ifndef EA_EMULATED_T
#error "define EA_EMULATED_T, the input type whose launches this unit instantiates"
#endif

namespace emulated {

namespace ec = entropy_attn::cuda;
namespace ef = entropy_attn::cuda::fallback;

// ---------------------------------------------------------------------------------------------
// Emulated launches of the fallback family's kernels, with the grids and shared memory of its
// launchers (fallback/fwd_launch.cuh, bwd_launch.cuh, sparsity.cu, row_reductions.cu), for the
// instantiations csrc/cuda/kernels.toml lists (the same dispatch table as the selection point).
// ---------------------------------------------------------------------------------------------

namespace {
int head_dim_bucket_of(int64_t d, int64_t dv) { return ec::head_dim_bucket(std::max(d, dv)); }
// A launcher's grid, or max_blocks blocks where that is positive and fewer.
int64_t capped(int64_t grid, int64_t max_blocks) {
  return max_blocks > 0 && max_blocks < grid ? max_blocks : grid;
}
}  // namespace

template <typename T, int kD>
void launch_forward_d(const ec::FwdParams<ec::AccType<T>>& p, int64_t max_blocks) {
  using L = ef::FwdLayout<T, kD>;
  emulate_launch(ef::attention_fwd_kernel<T, kD>, capped(L::grid(p), max_blocks), L::kBytes, p);
}

template <typename T>
void launch_forward(const ec::FwdParams<ec::AccType<T>>& p, int64_t max_blocks) {
  const int d = head_dim_bucket_of(p.head_dim, p.v_head_dim);
#define EA_MATCH(U, D)                                        \
  if constexpr (std::is_same_v<T, U>) {                       \
    if (d == D) return launch_forward_d<T, D>(p, max_blocks); \
  }
  EA_FALLBACK_FORWARD_KERNELS(EA_MATCH)
#undef EA_MATCH
  FAIL() << "no instantiation for head dims " << p.head_dim << ", " << p.v_head_dim;
}

template <typename T, int kD>
void launch_backward_d(const ec::BwdParams<ec::AccType<T>>& p, int smem_optin, int64_t max_blocks) {
  if (ef::use_compact_backward<T, kD>(p, smem_optin)) {
    using C = ef::CompactBwdLayout<T, kD>;
    return emulate_launch(ef::attention_bwd_compact_kernel<T, kD>, C::blocks(p), C::kBytes, p);
  }
  using L = ef::BwdLayout<T, kD>;
  ASSERT_LE(L::kBytes, static_cast<size_t>(smem_optin)) << "no backward kernel fits";
  if constexpr (ef::kIs16Bit<T>) {
    if (ef::grouped(p)) {
      return emulate_launch(ef::attention_bwd_kernel<T, kD, true>, capped(L::grid(p), max_blocks),
                            L::kBytes, p);
    }
  }
  emulate_launch(ef::attention_bwd_kernel<T, kD, false>, L::grid(p), L::kBytes, p);
}

template <typename T>
void launch_backward(const ec::BwdParams<ec::AccType<T>>& p, int smem_optin, int64_t max_blocks) {
  emulate_launch(ef::attention_bwd_preprocess_kernel<T>, ef::preprocess_blocks(p), 0, p);
  const int d = head_dim_bucket_of(p.head_dim, p.v_head_dim);
  bool launched = false;
#define EA_MATCH(U, D)                                    \
  if constexpr (std::is_same_v<T, U>) {                   \
    if (d == D && !launched) {                            \
      launch_backward_d<T, D>(p, smem_optin, max_blocks); \
      launched = true;                                    \
    }                                                     \
  }
  EA_FALLBACK_BACKWARD_KERNELS(EA_MATCH)
#undef EA_MATCH
  ASSERT_TRUE(launched) << "no instantiation for head dims " << p.head_dim << ", " << p.v_head_dim;
  // As the guard of a tensor-core backward: dq and d lambda from G (fallback/bwd_launch.cuh).
  if (ef::grouped(p)) {
    emulate_launch(ef::attention_bwd_postprocess_kernel<T>, ef::preprocess_blocks(p), 0, p);
  }
}

template <typename T>
int backward_tile_rows(const ec::BwdParams<ec::AccType<T>>& p, int smem_optin) {
  const int d = head_dim_bucket_of(p.head_dim, p.v_head_dim);
  int rows = 0;
#define EA_MATCH(U, D)                                                                       \
  if constexpr (std::is_same_v<T, U>) {                                                      \
    if (d == D) {                                                                            \
      rows = ef::use_compact_backward<T, D>(p, smem_optin) ? ef::CompactBwdLayout<T, D>::kBM \
                                                           : ef::BwdLayout<T, D>::kBM;       \
    }                                                                                        \
  }
  EA_FALLBACK_BACKWARD_KERNELS(EA_MATCH)
#undef EA_MATCH
  return rows;
}

template <typename T, int kD>
void launch_sparsity_d(const ec::SparsityParams<ec::AccType<T>>& p) {
  using L = ef::SparsityLayout<T, kD>;
  emulate_launch(ef::attention_sparsity_kernel<T, kD>, L::blocks(p), L::kBytes, p);
}

template <typename T>
void launch_sparsity(const ec::SparsityParams<ec::AccType<T>>& p) {
  switch (ec::head_dim_bucket(p.head_dim)) {  // as attention_sparsity.cu: values play no part
    case 64:
      return launch_sparsity_d<T, 64>(p);
    case 128:
      return launch_sparsity_d<T, 128>(p);
    case 256:
      if constexpr (!std::is_same_v<T, double>) return launch_sparsity_d<T, 256>(p);
      [[fallthrough]];
    default:
      FAIL() << "no head-dim bucket for " << p.head_dim;
  }
}

template void launch_forward<EA_EMULATED_T>(const ec::FwdParams<ec::AccType<EA_EMULATED_T>>&,
                                            int64_t);
template void launch_backward<EA_EMULATED_T>(const ec::BwdParams<ec::AccType<EA_EMULATED_T>>&, int,
                                             int64_t);
template int backward_tile_rows<EA_EMULATED_T>(const ec::BwdParams<ec::AccType<EA_EMULATED_T>>&,
                                               int);
template void launch_sparsity<EA_EMULATED_T>(const ec::SparsityParams<ec::AccType<EA_EMULATED_T>>&);

}  // namespace emulated
