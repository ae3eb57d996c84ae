// The sm_80 instructions the tensor-core family's tiles are built from, as CuTe operations. The
// kernels name them only through their traits' `Ops` parameter, so that a test on a machine
// without a GPU may substitute emulated operations with the same thread/value layouts
// (tests/cpp/emulated_sm80_ops.h).
#pragma once

#include <cutlass/numeric_types.h>

#include <cstdint>
#include <cute/tensor.hpp>
#include <type_traits>

namespace entropy_attn::cuda::sm80 {

struct Sm80Ops {
  template <typename Element>
  using Mma =
      std::conditional_t<std::is_same_v<Element, cutlass::bfloat16_t>,
                         cute::SM80_16x8x16_F32BF16BF16F32_TN, cute::SM80_16x8x16_F32F16F16F32_TN>;
  using LdsmN = cute::SM75_U32x4_LDSM_N;                               // ldmatrix x4
  using LdsmT = cute::SM75_U16x8_LDSM_T;                               // ldmatrix x4 .trans
  using CpAsync16 = cute::SM80_CP_ASYNC_CACHEGLOBAL<cute::uint128_t>;  // 16-byte cp.async, L2 only
  using CpAsync4 = cute::SM80_CP_ASYNC_CACHEALWAYS<uint32_t>;  // 4-byte cp.async (rows, mask words)

  // The thread's cp.async copies. cp.async.commit_group closes a group of them;
  // cp.async.wait_group N waits until at most the newest N committed groups are in flight (copies
  // not yet committed are not waited for); cp.async.wait_all commits those, then waits for all.
  static __device__ __forceinline__ void cp_async_fence() { cute::cp_async_fence(); }
  template <int kPending>
  static __device__ __forceinline__ void cp_async_wait() {
#if defined(CUTE_ARCH_CP_ASYNC_SM80_ENABLED)
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
#endif
  }
  static __device__ __forceinline__ void cp_async_wait_all() { cute::cp_async_wait<0>(); }
  // prefetch.global.L1: the line that holds *p into the SM's L1, a hint that nothing waits for
  // (the generic address of global memory, as CuTe's prefetch.global.L2 and __ldg pass theirs).
  // p must point into an allocation (the emulation reads *p).
  static __device__ __forceinline__ void prefetch_l1(const void* p) {
    asm volatile("prefetch.global.L1 [%0];\n" ::"l"(p));
  }
};

}  // namespace entropy_attn::cuda::sm80
