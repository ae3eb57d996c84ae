// Emulated launches of the fallback family's kernels (emulated_launches_impl.h), declared apart
// from their definitions: cuda_emulation.cmake compiles the definitions once per input type, in
// translation units of their own, so that the four sets of kernels (the heaviest code of the C++
// suite, and slower still under the sanitizers) compile in parallel rather than in one unit.
#pragma once

#include <cstdint>

#include "cuda/params.h"

namespace emulated {

// The grids of the launchers (fwd_launch.cuh, bwd_launch.cuh), or at most max_blocks blocks where
// that is positive: the kernels' blocks then stride over the tiles, as a guard's do past
// kGuardTileBlocks (a test of the striding on calls of a few tiles).
template <typename T>
void launch_forward(const entropy_attn::cuda::FwdParams<entropy_attn::cuda::AccType<T>>& p,
                    int64_t max_blocks = 0);
// With the preprocess and, as after a tensor-core backward, the postprocess kernel; the main
// kernel with the tiles bwd_launch.cuh chooses on a device granting smem_optin bytes per block (by
// default one that takes every kernel).
constexpr int kEveryKernelFits = 232448;  // bytes of shared memory per block
template <typename T>
void launch_backward(const entropy_attn::cuda::BwdParams<entropy_attn::cuda::AccType<T>>& p,
                     int smem_optin = kEveryKernelFits, int64_t max_blocks = 0);
// The rows of the backward's query and key tiles (kBM = kBN) that launch_backward takes for p on a
// device granting smem_optin bytes per block (a deterministic backward's turns are per query tile).
template <typename T>
int backward_tile_rows(const entropy_attn::cuda::BwdParams<entropy_attn::cuda::AccType<T>>& p,
                       int smem_optin = kEveryKernelFits);
template <typename T>
void launch_sparsity(const entropy_attn::cuda::SparsityParams<entropy_attn::cuda::AccType<T>>& p);

}  // namespace emulated
