// The sm_90a instructions and synchronization objects the Hopper family is built from. The kernels
// name them only through their traits' `Ops` parameter, so that a test on a machine without a GPU
// may substitute emulated ones with the same interfaces (tests/cpp/emulated_sm90_ops.h), as the
// sm80 family does with sm80/ops.cuh.
#pragma once

#include <cstdint>

// cute/tensor.hpp first: the sm90 atom headers rely on what it declares.
#include <cute/tensor.hpp>

#include <cutlass/arch/barrier.h>
#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <cutlass/pipeline/sm90_pipeline.hpp>

namespace entropy_attn::cuda::sm90 {

struct Sm90Ops {
  using TmaLoad = cute::SM90_TMA_LOAD;  // the copy operation make_tma_copy builds TMA loads from
  // The wgmma operation GMMA::ss_op_selector / rs_op_selector picked.
  template <typename Op>
  using Gmma = Op;
  template <int kStages>
  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using TxBarrier = cutlass::arch::ClusterTransactionBarrier;  // an mbarrier with a byte count
  using NamedBarrier = cutlass::arch::NamedBarrier;
  using CpAsync4 = cute::SM80_CP_ASYNC_CACHEALWAYS<uint32_t>;          // 4-byte cp.async
  using CpAsync4Zfill = cute::SM80_CP_ASYNC_CACHEALWAYS_ZFILL<float>;  // ... zero-filled
  // The thread's cp.async copies: cp.async.commit_group, and cp.async.wait_all (which commits the
  // copies not yet committed, then waits for every group).
  static __device__ __forceinline__ void cp_async_fence() { cute::cp_async_fence(); }
  static __device__ __forceinline__ void cp_async_wait_all() { cute::cp_async_wait<0>(); }

  // The thread's warpgroup, known warp-uniform to the compiler.
  static __device__ __forceinline__ int warp_group_idx() {
    return cutlass::canonical_warp_group_idx();
  }
  static __device__ __forceinline__ void prefetch_tma_descriptor(const cute::TmaDescriptor* d) {
    cute::prefetch_tma_descriptor(d);
  }
  // prefetch.global.L1: the line that holds *p into the SM's L1, a hint that nothing waits for
  // (the generic address of global memory, as CuTe's prefetch.global.L2 and __ldg pass theirs).
  // p must point into an allocation (the emulation reads *p).
  static __device__ __forceinline__ void prefetch_l1(const void* p) {
    asm volatile("prefetch.global.L1 [%0];\n" ::"l"(p));
  }
  // wgmma.fence, wgmma.commit_group and wgmma.wait_group.
  static __device__ __forceinline__ void wgmma_fence() { cute::warpgroup_arrive(); }
  static __device__ __forceinline__ void wgmma_commit() { cute::warpgroup_commit_batch(); }
  template <int kPending>
  static __device__ __forceinline__ void wgmma_wait() {
    cute::warpgroup_wait<kPending>();
  }

  // A store to shared memory of what the async proxy will read (a wgmma operand, a bulk copy's
  // source): a plain store, named so that the emulation can check its fence (below).
  template <typename V>
  static __device__ __forceinline__ void store_shared(V* p, V v) {
    *p = v;
  }
  // Orders a thread's shared-memory stores before the async proxy's reads of them (TMA, bulk
  // copies, wgmma): fence.proxy.async.shared::cta. It must come before the synchronization that
  // orders the stores before those reads.
  static __device__ __forceinline__ void fence_view_async_shared() {
    cutlass::arch::fence_view_async_shared();
  }
  // cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32: adds `bytes` (a multiple of 16) of
  // floats from shared memory into global memory (both 16-byte aligned), asynchronously, in the
  // thread's current bulk group; bulk_commit closes the group, and bulk_wait_read<N> waits until
  // every group but the newest N has read its shared memory (cp.async.bulk.wait_group.read): only
  // then may that memory be written again.
  static __device__ __forceinline__ void bulk_reduce_add(float* gmem, const float* smem,
                                                         uint32_t bytes) {
    asm volatile(
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(gmem),
        "r"(static_cast<uint32_t>(__cvta_generic_to_shared(smem))), "r"(bytes)
        : "memory");
  }
  static __device__ __forceinline__ void bulk_commit() { cute::tma_store_arrive(); }
  template <int kPending>
  static __device__ __forceinline__ void bulk_wait_read() {
    cute::tma_store_wait<kPending>();
  }
  // cp.async.bulk.wait_group 0: every bulk group of the thread complete, its writes to global
  // memory included (wait_group.read above waits for the reads of shared memory alone).
  static __device__ __forceinline__ void bulk_wait_all() {
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
  }

  // A turn counter in global memory that orders the thread blocks adding into the same place
  // (the deterministic backward's dq: params.h, dq_turns). wait_turn spins until *turn == value
  // (ld.acquire.gpu), then orders the async proxy's later operations (a bulk reduction) after it;
  // pass_turn, after bulk_wait_all, orders the thread's completed bulk writes before the addition
  // of `by` (red.release.gpu) that hands the turn on to the block that waits for *turn + by. As
  // CUTLASS's GenericBarrier and FlashAttention-3's deterministic backward do: the thread blocks
  // waited for start before the waiting one (a grid starts its blocks in order), so the spin ends.
  static __device__ __forceinline__ void wait_turn(const int* turn, int value) {
    int v;
    do {
      asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(turn) : "memory");
    } while (v != value);
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
  }
  static __device__ __forceinline__ void pass_turn(int* turn, int by) {
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(turn), "r"(by) : "memory");
  }
};

}  // namespace entropy_attn::cuda::sm90
