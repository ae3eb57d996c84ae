// The turns of a deterministic fallback backward (params.h: tile_turns; bwd_kernel.cuh), a plain
// call's or the guard's of a tensor-core backward. The key tiles that add into one query tile's G
// do so one after another, in the order of their index: each waits until the tile's counter holds
// the number of key tiles before it that add there, adds, then raises the counter by one. The
// sum's order is then the key tiles' whatever the schedule.
//
// A waiting block spins on blocks of lower index (the key tiles before it, of the same batch and
// query head), which a grid starts before it: the spin ends, as in CUTLASS's GenericBarrier and
// FlashAttention's deterministic backward, which rely on the same order. So a guard that takes
// turns has a block per tile (bwd_kernel.cuh: BwdLayout::grid), not the capped grid whose blocks
// stride over the tiles. Written with the fences of every architecture the fallback builds for (not
// sm_70's acquire/release loads).
#pragma once

namespace entropy_attn::cuda::fallback {

#ifndef ENTROPY_ATTN_CUDA_EMULATION  // (the emulation's own check them: tests/cpp/cuda_emulation.h)
// Spins until *turn == value; the fence orders the thread's later accesses after the read that
// ended the spin (the caller's barrier then orders its block's).
__device__ __forceinline__ void wait_turn(const int* turn, int value) {
  while (*static_cast<const volatile int*>(turn) != value) {
  }
  __threadfence();
}

// Hands the turn on, after a barrier that follows the block's additions: the fence makes them
// visible before the counter's new value.
__device__ __forceinline__ void pass_turn(int* turn) {
  __threadfence();
  atomicAdd(turn, 1);
}
#endif

}  // namespace entropy_attn::cuda::fallback
