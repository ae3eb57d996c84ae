// The plain shared-memory loads and stores of the emulated kernels, for the hazard check of
// cuda_emulation.h (smem_access), which otherwise sees only what emulated instructions report
// (cp.async, ldmatrix). A GPU's racecheck sees every access; so must the emulation, or a kernel
// that writes its output tile into shared memory another warp is still reading (a missing
// __syncthreads) passes whenever the threads happen to run in a harmless order.
//
// How: the units that hold the sm80 kernels are compiled with -fsanitize=thread
// (cuda_emulation.cmake: _ea_plain_access_hooks, which says why not the fallback's), which makes
// g++ call __tsan_read4(p), __tsan_write16(p), ... before every load and store, and
// __tsan_atomic32_fetch_add(...) in place of every atomic operation. ThreadSanitizer's runtime is
// not linked: this unit, compiled without the instrumentation, defines those entry points instead.
// A load or store inside the running launch's dynamic shared memory goes to smem_access (its warp
// and barrier interval); every other address returns at once. The atomic operations are done here.
//
// ThreadSanitizer itself would not do: the emulation's barriers share one mutex per block, so its
// happens-before relation orders nearly every pair of accesses, and a missing __syncthreads went
// unreported in a trial (the results were wrong, the race detector silent).
#include <cstddef>
#include <cstdint>

#include "cuda_emulation.h"

namespace {

void plain_access(const void* p, size_t bytes, bool write) {
  const auto at = reinterpret_cast<uintptr_t>(p);
  const cuda_emu::SmemShadow& sh = cuda_emu::g_smem_shadow;
  // (The bounds change only between blocks, while the block's threads wait at a barrier.)
  if (at < sh.lo.load(std::memory_order_relaxed) || at >= sh.hi.load(std::memory_order_relaxed))
    return;
  cuda_emu::smem_access(p, bytes, write, write ? "a plain store" : "a plain load");
}

// The atomic entry points take the C ABI of compiler-rt's tsan_interface_atomic.h, the memory
// order an int; they ignore it and do every operation sequentially consistent.
constexpr int kSeqCst = __ATOMIC_SEQ_CST;

}  // namespace

extern "C" {

void __tsan_init() {}
void __tsan_func_entry(void*) {}
void __tsan_func_exit() {}
void __tsan_vptr_update(void**, void*) {}
void __tsan_vptr_read(void**) {}
void __tsan_read_range(void* p, unsigned long bytes) { plain_access(p, bytes, false); }
void __tsan_write_range(void* p, unsigned long bytes) { plain_access(p, bytes, true); }

#define EA_PLAIN_ACCESS(N)                                                       \
  void __tsan_read##N(void* p) { plain_access(p, N, false); }                    \
  void __tsan_write##N(void* p) { plain_access(p, N, true); }                    \
  void __tsan_unaligned_read##N(void* p) { plain_access(p, N, false); }          \
  void __tsan_unaligned_write##N(void* p) { plain_access(p, N, true); }          \
  void __tsan_volatile_read##N(void* p) { plain_access(p, N, false); }           \
  void __tsan_volatile_write##N(void* p) { plain_access(p, N, true); }           \
  void __tsan_unaligned_volatile_read##N(void* p) { plain_access(p, N, false); } \
  void __tsan_unaligned_volatile_write##N(void* p) { plain_access(p, N, true); }
EA_PLAIN_ACCESS(1)
EA_PLAIN_ACCESS(2)
EA_PLAIN_ACCESS(4)
EA_PLAIN_ACCESS(8)
EA_PLAIN_ACCESS(16)
#undef EA_PLAIN_ACCESS

// Atomic operations on shared memory are not hazards (they are ordered by the hardware); the
// kernels' atomics are on global memory (atomicAdd is std::atomic_ref: cuda_emulation.h).
#define EA_ATOMIC(N, T)                                                                       \
  T __tsan_atomic##N##_load(const volatile T* a, int) { return __atomic_load_n(a, kSeqCst); } \
  void __tsan_atomic##N##_store(volatile T* a, T v, int) { __atomic_store_n(a, v, kSeqCst); } \
  T __tsan_atomic##N##_exchange(volatile T* a, T v, int) {                                    \
    return __atomic_exchange_n(a, v, kSeqCst);                                                \
  }                                                                                           \
  T __tsan_atomic##N##_fetch_add(volatile T* a, T v, int) {                                   \
    return __atomic_fetch_add(a, v, kSeqCst);                                                 \
  }                                                                                           \
  T __tsan_atomic##N##_fetch_sub(volatile T* a, T v, int) {                                   \
    return __atomic_fetch_sub(a, v, kSeqCst);                                                 \
  }                                                                                           \
  T __tsan_atomic##N##_fetch_and(volatile T* a, T v, int) {                                   \
    return __atomic_fetch_and(a, v, kSeqCst);                                                 \
  }                                                                                           \
  T __tsan_atomic##N##_fetch_or(volatile T* a, T v, int) {                                    \
    return __atomic_fetch_or(a, v, kSeqCst);                                                  \
  }                                                                                           \
  T __tsan_atomic##N##_fetch_xor(volatile T* a, T v, int) {                                   \
    return __atomic_fetch_xor(a, v, kSeqCst);                                                 \
  }                                                                                           \
  T __tsan_atomic##N##_fetch_nand(volatile T* a, T v, int) {                                  \
    return __atomic_fetch_nand(a, v, kSeqCst);                                                \
  }                                                                                           \
  int __tsan_atomic##N##_compare_exchange_strong(volatile T* a, T* expected, T v, int, int) { \
    return __atomic_compare_exchange_n(a, expected, v, false, kSeqCst, kSeqCst);              \
  }                                                                                           \
  int __tsan_atomic##N##_compare_exchange_weak(volatile T* a, T* expected, T v, int, int) {   \
    return __atomic_compare_exchange_n(a, expected, v, true, kSeqCst, kSeqCst);               \
  }                                                                                           \
  T __tsan_atomic##N##_compare_exchange_val(volatile T* a, T expected, T v, int, int) {       \
    __atomic_compare_exchange_n(a, &expected, v, false, kSeqCst, kSeqCst);                    \
    return expected;                                                                          \
  }
EA_ATOMIC(8, char)
EA_ATOMIC(16, short)
EA_ATOMIC(32, int)
EA_ATOMIC(64, long)
#undef EA_ATOMIC

void __tsan_atomic_thread_fence(int) { __atomic_thread_fence(kSeqCst); }
void __tsan_atomic_signal_fence(int) { __atomic_signal_fence(kSeqCst); }

}  // extern "C"
