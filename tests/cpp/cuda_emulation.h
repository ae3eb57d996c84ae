// CPU emulation of the CUDA execution model, enough to run the project's kernels
// (csrc/cuda/*_kernel.cuh) on the host in a g++ (C++20) translation unit: include this header
// BEFORE the kernel headers, then run a kernel with
//   emulate_launch(attention_fwd_kernel<float, 64>, blocks, FwdLayout<float, 64>::kBytes, params);
//
// The model:
//   * a block is blockDim.x threads, 128 by default, up to 384, each a fiber of the launching
//     thread (fibers.h: they switch only where a CUDA thread can wait; threadIdx, blockIdx and the
//     other per-thread variables are swapped in with the fiber); the blocks of a launch (a 1-D
//     count or a 3-D grid, x fastest) run one after another on the same fibers;
//   * __syncthreads() is a barrier of the block's threads, __syncwarp() one of the warp's 32;
//   * __shfl_xor_sync exchanges values through a per-warp slot array at a warp barrier, and so do
//     the emulated warp-wide instructions of other headers (warp_gather: emulated_sm80_ops.h);
//   * dynamic shared memory is entropy_attn::cuda::fallback::smem (the kernels' `extern __shared__
//   smem[]`
//     binds to it) or the array a launch names (another family's), filled with 0xff bytes (NaN
//     for every floating type) before each block, so that
//     reading shared memory nobody wrote shows up as NaN; the pages past the launch's smem_bytes
//     are made inaccessible during the launch (an overrun far enough to leave the last page
//     crashes instead of reading garbage);
//   * atomicAdd is std::atomic_ref.
//
// Checks (each a CudaEmulationError thrown by emulate_launch, or an abort with a message where the
// emulated threads cannot go on):
//   * every warp-level operation must be reached by all 32 lanes of the warp together, at the same
//     operation (same kind, same lane mask, same position in the lane's sequence of warp
//     operations), with the full member mask and no lane of the warp exited: otherwise the kernel
//     has a real GPU bug (undefined results of __shfl_*_sync, or a hang);
//   * __syncthreads() must be reached by every thread of the block at the same position in its
//     sequence of block barriers, and not after some threads of the block returned;
//   * a block deadlocks when every thread still running waits at a barrier that cannot complete
//     (e.g. a warp operation that some lanes skip, a __syncthreads() some threads skip): the
//     waiting threads are unwound (an exception through the kernel's frames) and the launch
//     reports the barriers' state;
//   * a launch in which no barrier completes for kWatchdogSeconds (a thread that never reaches a
//     barrier, e.g. an endless loop) aborts the process;
//   * the headers of emulated asynchronous operations (emulated_cp_async.h, emulated_sm90_ops.h)
//     check, as each thread finishes a block, that it waited for every operation it issued
//     (block_end_checks), and as it synchronizes, what it must do before (thread_sync_checks).
// Threads that `return` early leave the block's and their warp's barriers (the barriers then wait
// for the remaining threads only); a warp operation or __syncthreads() after that is reported.
#pragma once

#if defined(__CUDACC__) || defined(__CUDA_ARCH__)
#error "cuda_emulation.h is for the host compiler only"
#endif

// Tells the project's headers that the device code they guard by __CUDACC__ is wanted on the host
// (launch_order.h: this_block_tile).
#define ENTROPY_ATTN_CUDA_EMULATION 1

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <sys/mman.h>
#include <unistd.h>
#include <vector_types.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "fibers.h"

// ---------------------------------------------------------------------------------------------
// Execution-space qualifiers. For a non-nvcc compiler crt/host_defines.h (pulled in by cuda_fp16.h)
// already defines __host__, __device__, __global__, __shared__ (to nothing, via __location__ ->
// __annotate__), __forceinline__ (inline + always_inline) and __align__(n) (aligned attribute), but
// not __launch_bounds__. Define whatever is missing.
// ---------------------------------------------------------------------------------------------
#ifndef __host__
#define __host__
#endif
#ifndef __device__
#define __device__
#endif
#ifndef __global__
#define __global__
#endif
#ifndef __shared__
#define __shared__
#endif
#ifndef __forceinline__
#define __forceinline__ inline __attribute__((always_inline))
#endif
#ifndef __align__
#define __align__(n) __attribute__((aligned(n)))
#endif
#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif

// ---------------------------------------------------------------------------------------------
// nvcuda::wmma: mma.h declares it only for nvcc (__CUDACC__), but block_gemm.cuh's gemm_wmma names
// it in a template that a host compiler still parses. The host never instantiates it (block_gemm
// takes the CUDA-core path without __CUDA_ARCH__): declarations that abort if ever called.
// ---------------------------------------------------------------------------------------------
#include <mma.h>  // declares nothing without __CUDACC__
namespace nvcuda::wmma {
struct row_major;
struct col_major;
struct matrix_a;
struct matrix_b;
struct accumulator;
enum layout_t { mem_row_major, mem_col_major };
template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
  T x[1];
};
[[noreturn]] inline void wmma_not_emulated() {
  std::fprintf(stderr, "cuda_emulation: nvcuda::wmma is not emulated\n");
  std::abort();
}
template <typename Frag, typename V>
void fill_fragment(Frag&, const V&) {
  wmma_not_emulated();
}
template <typename Frag, typename P>
void load_matrix_sync(Frag&, const P*, unsigned) {
  wmma_not_emulated();
}
template <typename C, typename A, typename B>
void mma_sync(C&, const A&, const B&, const C&) {
  wmma_not_emulated();
}
template <typename P, typename Frag>
void store_matrix_sync(P*, const Frag&, unsigned, layout_t) {
  wmma_not_emulated();
}
}  // namespace nvcuda::wmma

namespace cuda_emu {

constexpr int kBlockThreads = 128;     // the fallback's kernels: 128 threads a block
constexpr int kMaxBlockThreads = 384;  // the sm90 kernels' three warpgroups
constexpr int kWarpSize = 32;
constexpr int kMaxBlockWarps = kMaxBlockThreads / kWarpSize;
constexpr int kMaxBlockWarpgroups = kMaxBlockThreads / 128;
constexpr int kNamedBarriers = 16;  // bar.sync ids
// The bytes a lane publishes to one warp operation (an emulated mma.sync's A and B fragments).
constexpr int kSlotBytes = 32;
constexpr unsigned kFullMask = 0xffffffffu;
// Dynamic shared memory available to a launch (more than any GPU's 227 KB per block).
constexpr size_t kSmemCapacity = 256 * 1024;
constexpr int kWatchdogSeconds = 60;

// Counts barrier completions and finished blocks, for the watchdog.
inline std::atomic<uint64_t> g_progress{0};

// Counts the blocks set up (prepare_block), so that per-thread state of emulated asynchronous
// operations can tell a new block from the one it was left by.
inline std::atomic<uint64_t> g_block_serial{0};

// Taken by every launch (emulate_launch).
inline std::mutex g_launch_mutex;

// Errors found by the checks during a launch (reported by emulate_launch).
inline std::mutex g_error_mutex;
inline std::vector<std::string> g_errors;
inline void report_error(std::string msg) {
  std::lock_guard<std::mutex> lk(g_error_mutex);
  if (g_errors.size() < 20) g_errors.push_back(std::move(msg));
}

// A list of checks the emulated threads run at some point of their work, to which the headers of
// emulated operations add theirs at static initialization (each list a function's static, so that
// it exists whatever the order in which those headers' variables are initialized).
class ThreadChecks {
 public:
  bool add(void (*check)()) {
    checks_.push_back(check);
    return true;
  }
  void run() const {
    for (void (*check)() : checks_) check();
  }

 private:
  std::vector<void (*)()> checks_;
};

// Checks that each thread runs when it has finished a block (not when unwound from a deadlock):
// the emulated asynchronous operations report there what the thread left without a wait, and
// drop it, so that the next block starts clean and the last block of a launch is checked too. A
// header adds its check with `inline const bool registered = cuda_emu::on_block_end(&check);`.
inline ThreadChecks& block_end_checks() {
  static ThreadChecks checks;
  return checks;
}
inline bool on_block_end(void (*check)()) { return block_end_checks().add(check); }

// Checks that each thread runs as it reaches a synchronization that orders its memory accesses
// before other threads' (__syncthreads, __syncwarp here; the named barriers and mbarrier arrivals
// of emulated_sm90_ops.h), before it arrives: what it must have done before publishing its
// writes (emulated_sm90_ops.h: the async proxy's fence). Added with on_thread_sync, as above.
inline ThreadChecks& thread_sync_checks() {
  static ThreadChecks checks;
  return checks;
}
inline bool on_thread_sync(void (*check)()) { return thread_sync_checks().add(check); }
inline void thread_synchronizes() { thread_sync_checks().run(); }

// Thrown inside the emulated threads of a block that deadlocked, to unwind them.
struct DeadlockAbort {};

class Barrier;

// The barriers of one block (its __syncthreads barrier and its warps' barriers) share a mutex and
// know how many of the block's threads are still running and how many wait: when every running
// thread waits and no barrier can complete, the block has deadlocked (some thread waits at a
// barrier that the others never reach, e.g. a warp operation skipped by some lanes). Then every
// waiting thread throws DeadlockAbort and the launch reports the deadlock.
struct SyncDomain {
  std::mutex m;
  int live = 0, blocked = 0;  // under m
  std::atomic<bool> deadlocked{false};
  std::vector<Barrier*> barriers;
  std::string deadlock_state;  // under m

  void reset(int threads) {
    live = threads, blocked = 0;
    deadlocked.store(false);
    deadlock_state.clear();
  }
  inline void check_deadlock();  // under m
};

// A barrier whose participant count can shrink (drop_locked, for exited threads): the
// bookkeeping under the domain's mutex (never held across a wait), the waiting on a generation
// counter (the fiber yields until it changes).
class Barrier {
 public:
  Barrier(SyncDomain& d, std::string name) : d_(d), name_(std::move(name)) {
    d_.barriers.push_back(this);
  }
  Barrier(const Barrier&) = delete;
  Barrier& operator=(const Barrier&) = delete;

  void reset(int participants) {  // no thread may be waiting
    expected_ = participants;
    arrived_ = 0;
    waiting_ = 0;
  }
  // Returns the number of participants when the barrier completed (fewer than at reset when
  // threads left it).
  int arrive_and_wait() {
    std::unique_lock<std::mutex> lk(d_.m);
    if (d_.deadlocked.load()) throw DeadlockAbort{};
    const uint32_t g = gen_.load(std::memory_order_relaxed);
    if (++arrived_ == expected_) {
      complete();
      return expected_;
    }
    ++waiting_;
    ++d_.blocked;
    d_.check_deadlock();
    lk.unlock();
    fibers::wait_while(gen_, g);
    if (d_.deadlocked.load(std::memory_order_acquire)) throw DeadlockAbort{};
    // Stable until this thread arrives again: the next completion needs it.
    return completed_with_.load(std::memory_order_relaxed);
  }
  // A named barrier (bar.sync / bar.arrive id, count): `count` threads complete it, the first
  // arrival of a round setting the count; with `wait` false the thread goes on (bar.arrive).
  // Thread `thread` arriving twice in one round is reported: the hardware would count it twice
  // (completing the round without a thread it should wait for), and the project's kernels never
  // mean that (a bar.arrive repeated without the bar.sync it pairs with, e.g. a consumer that
  // skips its wait for a free buffer, shows up so).
  void arrive_counted(int count, bool wait, int thread) {
    std::unique_lock<std::mutex> lk(d_.m);
    if (d_.deadlocked.load()) throw DeadlockAbort{};
    if (arrived_ == 0) {
      expected_ = count;
      in_round_.assign(kMaxBlockThreads, false);
    } else if (count != expected_) {
      report_error(name_ + ": arrivals with thread counts " + std::to_string(expected_) + " and " +
                   std::to_string(count));
    }
    if (in_round_.at(static_cast<size_t>(thread))) {
      report_error(name_ + ": thread " + std::to_string(thread) +
                   " arrives twice before the barrier completes");
    }
    in_round_[static_cast<size_t>(thread)] = true;
    const uint32_t g = gen_.load(std::memory_order_relaxed);
    if (++arrived_ >= expected_) {
      complete();
      return;
    }
    if (!wait) return;
    ++waiting_;
    ++d_.blocked;
    d_.check_deadlock();
    lk.unlock();
    wait_past(g);
    if (d_.deadlocked.load(std::memory_order_acquire)) throw DeadlockAbort{};
  }
  // The completions so far, and a wait for the next (wake_all also ends it).
  uint32_t generation() const { return gen_.load(std::memory_order_acquire); }
  void wait_past(uint32_t g) { fibers::wait_while(gen_, g); }
  // A thread leaves the barrier for good (under the domain's mutex).
  void drop_locked() {
    --expected_;
    if (arrived_ > 0 && arrived_ == expected_) complete();
  }
  // Under the domain's mutex.
  int participants_locked() const { return expected_; }
  std::string state_locked() const {
    return name_ + ": " + std::to_string(arrived_) + " of " + std::to_string(expected_) +
           " arrived";
  }
  // Wakes the waiting threads without completing (deadlock).
  void wake_all() { gen_.fetch_add(1, std::memory_order_release); }

 private:
  void complete() {  // under the domain's mutex
    d_.blocked -= waiting_;
    waiting_ = 0;
    arrived_ = 0;
    completed_with_.store(expected_, std::memory_order_relaxed);
    gen_.fetch_add(1, std::memory_order_release);
    g_progress.fetch_add(1, std::memory_order_relaxed);
  }
  SyncDomain& d_;
  std::string name_;
  int expected_ = 0, arrived_ = 0, waiting_ = 0;  // under the domain's mutex
  std::vector<bool> in_round_;                    // arrive_counted's arrivals this round
  std::atomic<uint32_t> gen_{0};
  std::atomic<int> completed_with_{0};
};

inline void SyncDomain::check_deadlock() {
  if (live == 0 || blocked < live || deadlocked.load()) return;
  for (const Barrier* b : barriers)
    deadlock_state += (deadlock_state.empty() ? "" : "; ") + b->state_locked();
  deadlocked.store(true, std::memory_order_release);
  for (Barrier* b : barriers) b->wake_all();
}

// One warp-level operation of one lane, compared across the lanes after the warp barrier.
enum class WarpOp : int { kSyncWarp = 1, kShflXor = 2, kMma = 3, kLdmatrix = 4, kVote = 5 };
struct WarpOpRecord {
  uint64_t seq = 0;  // position in the lane's sequence of warp operations (since block start)
  WarpOp op{};
  unsigned member_mask = 0;
  int lane_mask = 0;
  int size = 0;  // bytes of the shuffled value
};

struct WarpState {
  // Double-buffered by seq parity: operation seq + 2 reuses the buffer of seq only after every
  // lane passed the barrier of seq + 1, i.e. finished reading the buffer of seq.
  WarpOpRecord record[2][kWarpSize];
  alignas(16) unsigned char slot[2][kWarpSize][kSlotBytes];
};

struct BlockState {
  SyncDomain domain;
  Barrier barrier{domain, "__syncthreads barrier"};
  Barrier warp_barrier[kMaxBlockWarps] = {
      {domain, "warp 0 barrier"}, {domain, "warp 1 barrier"},  {domain, "warp 2 barrier"},
      {domain, "warp 3 barrier"}, {domain, "warp 4 barrier"},  {domain, "warp 5 barrier"},
      {domain, "warp 6 barrier"}, {domain, "warp 7 barrier"},  {domain, "warp 8 barrier"},
      {domain, "warp 9 barrier"}, {domain, "warp 10 barrier"}, {domain, "warp 11 barrier"}};
  // The warpgroups' meeting points of warpgroup-wide instructions (emulated_sm90_ops.h: wgmma).
  Barrier warpgroup_barrier[kMaxBlockWarpgroups] = {{domain, "warpgroup 0 barrier"},
                                                    {domain, "warpgroup 1 barrier"},
                                                    {domain, "warpgroup 2 barrier"}};
  Barrier named_barrier[kNamedBarriers] = {
      {domain, "named barrier 0"},  {domain, "named barrier 1"},  {domain, "named barrier 2"},
      {domain, "named barrier 3"},  {domain, "named barrier 4"},  {domain, "named barrier 5"},
      {domain, "named barrier 6"},  {domain, "named barrier 7"},  {domain, "named barrier 8"},
      {domain, "named barrier 9"},  {domain, "named barrier 10"}, {domain, "named barrier 11"},
      {domain, "named barrier 12"}, {domain, "named barrier 13"}, {domain, "named barrier 14"},
      {domain, "named barrier 15"}};
  uint64_t sync_seq[2][kMaxBlockThreads] = {};
  WarpState warps[kMaxBlockWarps];
  int threads = kBlockThreads;  // of the running launch

  void reset(int block_threads) {
    std::lock_guard<std::mutex> lk(domain.m);
    threads = block_threads;
    domain.reset(block_threads);
    barrier.reset(block_threads);
    // (The warps past the block's keep no participants: they are never waited on.)
    for (int w = 0; w < kMaxBlockWarps; ++w)
      warp_barrier[w].reset(w * kWarpSize < threads ? kWarpSize : 0);
    for (int g = 0; g < kMaxBlockWarpgroups; ++g)
      warpgroup_barrier[g].reset(g * 128 < threads ? std::min(128, threads - g * 128) : 0);
    for (Barrier& b : named_barrier) b.reset(0);
  }
  // Thread t returned from the kernel: it leaves its block's and its warp's barriers.
  void thread_exit(int t) {
    std::lock_guard<std::mutex> lk(domain.m);
    --domain.live;
    barrier.drop_locked();
    warp_barrier[t / kWarpSize].drop_locked();
    warpgroup_barrier[t / 128].drop_locked();
    domain.check_deadlock();
  }
  int warp_participants(int warp) {
    std::lock_guard<std::mutex> lk(domain.m);
    return warp_barrier[warp].participants_locked();
  }
};

inline BlockState g_block;  // the running block (blocks run one after another)

// Per emulated thread (fibers.h: fiber_local).
inline uint64_t t_warp_seq = 0;   // warp operations done in this block
inline uint64_t t_block_seq = 0;  // __syncthreads done in this block
inline uint64_t t_group_seq = 0;  // warpgroup operations done in this block
inline const bool t_seq_fiber_local = fibers::fiber_local(t_warp_seq) &&
                                      fibers::fiber_local(t_block_seq) &&
                                      fibers::fiber_local(t_group_seq);

// Shared-memory hazards between the warps of a block, as compute-sanitizer's racecheck finds them:
// two warps touch the same byte between the same two __syncthreads (the same epoch: the number of
// barriers each has passed), at least one of them writing. Bytes, as racecheck tracks them: warps
// may write neighbouring bytes of one word (the fallback's flags of non-finite rows). The accesses
// seen are those emulated instructions report (emulated_sm80_ops.h: cp.async writes, at issue and
// at landing, and ldmatrix reads) and, in the units built with plain_smem_access.cpp's hooks, every
// plain load and store. Reset for every block.
struct SmemShadow {
  struct Byte {
    uint64_t write_epoch = 0, read_epoch = 0;  // epoch + 1 of the last write and reads; 0: none
    int writer = -1;                           // warp of the last write
    uint32_t readers = 0;                      // warps that read in read_epoch
  };
  std::mutex m;
  const unsigned char* base = nullptr;
  std::vector<Byte> bytes;  // one per byte of the launch's dynamic shared memory
  // [lo, hi): the addresses tracked, read without the mutex by plain_smem_access.cpp's hooks.
  std::atomic<uintptr_t> lo{0}, hi{0};

  void reset(const unsigned char* smem, size_t size) {
    std::lock_guard<std::mutex> lk(m);
    base = smem;
    bytes.assign(size, Byte{});
    lo.store(reinterpret_cast<uintptr_t>(smem), std::memory_order_relaxed);
    hi.store(reinterpret_cast<uintptr_t>(smem) + size, std::memory_order_relaxed);
  }
};
inline SmemShadow g_smem_shadow;

}  // namespace cuda_emu

// ---------------------------------------------------------------------------------------------
// Built-in variables and device functions (global namespace, as in CUDA).
// ---------------------------------------------------------------------------------------------
// Per emulated thread (fibers.h: fiber_local; set by emulate_launch).
inline uint3 threadIdx{0, 0, 0};
inline uint3 blockIdx{0, 0, 0};
inline dim3 blockDim{cuda_emu::kBlockThreads, 1, 1};
inline dim3 gridDim{1, 1, 1};
inline const bool cuda_builtins_fiber_local =
    cuda_emu::fibers::fiber_local(threadIdx) && cuda_emu::fibers::fiber_local(blockIdx) &&
    cuda_emu::fibers::fiber_local(blockDim) && cuda_emu::fibers::fiber_local(gridDim);

inline void __syncthreads() {
  using namespace cuda_emu;
  thread_synchronizes();
  BlockState& b = g_block;
  const int t = static_cast<int>(threadIdx.x);
  const uint64_t seq = t_block_seq++;
  const int buf = static_cast<int>(seq & 1);
  b.sync_seq[buf][t] = seq;
  const int participants = b.barrier.arrive_and_wait();
  // Every thread checks (thread 0 may be among those that returned).
  if (participants != b.threads) {
    report_error("__syncthreads() in block " + std::to_string(blockIdx.x) + " after " +
                 std::to_string(b.threads - participants) +
                 " thread(s) of the block returned (undefined behavior on a GPU)");
    return;
  }
  for (int u = 0; u < b.threads; ++u) {
    if (b.sync_seq[buf][u] != seq) {
      report_error("divergent __syncthreads() in block " + std::to_string(blockIdx.x) +
                   ": thread 0 at its barrier #" + std::to_string(seq) + ", thread " +
                   std::to_string(u) + " at #" + std::to_string(b.sync_seq[buf][u]));
      break;
    }
  }
}

namespace cuda_emu {

// The common part of the warp operations: records the lane's operation, publishes `bytes` bytes
// of its value, waits for the warp and checks that all 32 lanes are at the same operation.
// Returns the buffer index that holds the lanes' values.
inline int warp_exchange(WarpOp op, unsigned member_mask, int lane_mask, const void* value,
                         int bytes) {
  const int t = static_cast<int>(threadIdx.x), lane = t % kWarpSize;
  WarpState& w = g_block.warps[t / kWarpSize];
  Barrier& bar = g_block.warp_barrier[t / kWarpSize];
  const uint64_t seq = t_warp_seq++;
  const int buf = static_cast<int>(seq & 1);
  const WarpOpRecord mine{seq, op, member_mask, lane_mask, bytes};
  const char* what = op == WarpOp::kSyncWarp  ? "__syncwarp"
                     : op == WarpOp::kShflXor ? "__shfl_xor_sync"
                     : op == WarpOp::kMma     ? "mma.sync"
                     : op == WarpOp::kVote    ? "__any_sync"
                                              : "ldmatrix";
  if (member_mask != kFullMask) {
    report_error(std::string(what) + " with member mask " + std::to_string(member_mask) +
                 " (the emulation and the kernels use full warps only), thread " +
                 std::to_string(t) + " of block " + std::to_string(blockIdx.x));
  }
  w.record[buf][lane] = mine;
  if (bytes > 0) std::memcpy(w.slot[buf][lane], value, static_cast<size_t>(bytes));
  const int participants = bar.arrive_and_wait();
  if (participants != kWarpSize) {
    report_error(std::string(what) + " by thread " + std::to_string(t) + " of block " +
                 std::to_string(blockIdx.x) + " while " + std::to_string(kWarpSize - participants) +
                 " lane(s) of its warp have returned (undefined result on a GPU)");
    return buf;
  }
  for (int l = 0; l < kWarpSize; ++l) {
    const WarpOpRecord& r = w.record[buf][l];
    if (r.seq != mine.seq || r.op != mine.op || r.member_mask != mine.member_mask ||
        r.lane_mask != mine.lane_mask || r.size != mine.size) {
      report_error("divergent warp operation in block " + std::to_string(blockIdx.x) + ", warp " +
                   std::to_string(t / kWarpSize) + ": lane " + std::to_string(lane) + " at " +
                   what + " #" + std::to_string(seq) + " (lane mask " + std::to_string(lane_mask) +
                   "), lane " + std::to_string(l) + " at operation #" + std::to_string(r.seq) +
                   " kind " + std::to_string(static_cast<int>(r.op)) + " (lane mask " +
                   std::to_string(r.lane_mask) + ")");
      break;
    }
  }
  return buf;
}

// A warp-wide instruction's exchange: every lane publishes `bytes` (at most kSlotBytes) and gets
// the 32 lanes' values, lane l's at [l * kSlotBytes]. They stay valid until the lane's next warp
// operation but one (the slots are double-buffered), so read them before the next.
inline const unsigned char* warp_gather(WarpOp op, const void* value, int bytes) {
  const int t = static_cast<int>(threadIdx.x);
  const int buf = warp_exchange(op, kFullMask, 0, value, bytes);
  return &g_block.warps[t / kWarpSize].slot[buf][0][0];
}

}  // namespace cuda_emu

namespace cuda_emu {

// An emulated instruction's access of `bytes` bytes at p by the calling thread's warp; addresses
// outside the launch's dynamic shared memory are not tracked. Reports the first hazard per access.
inline void smem_access(const void* p, size_t bytes, bool write, const char* what) {
  SmemShadow& sh = g_smem_shadow;
  const auto* at = static_cast<const unsigned char*>(p);
  std::lock_guard<std::mutex> lk(sh.m);
  if (sh.base == nullptr || at < sh.base || at + bytes > sh.base + sh.bytes.size()) return;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const uint64_t epoch = t_block_seq + 1;
  const size_t first = static_cast<size_t>(at - sh.base);
  const size_t last = first + bytes - 1;
  bool reported = false;
  auto hazard = [&](const char* kind, int other, size_t byte) {
    if (reported) return;
    reported = true;
    report_error(std::string("shared-memory ") + kind + " hazard in block (" +
                 std::to_string(blockIdx.x) + ", " + std::to_string(blockIdx.y) + ", " +
                 std::to_string(blockIdx.z) + "): " + what + " by warp " + std::to_string(warp) +
                 " at byte " + std::to_string(byte) + ", which warp " + std::to_string(other) +
                 " accessed after the same __syncthreads (#" + std::to_string(epoch - 1) + ")");
  };
  for (size_t at_byte = first; at_byte <= last; ++at_byte) {
    SmemShadow::Byte& state = sh.bytes[at_byte];
    if (state.write_epoch == epoch && state.writer != warp) {
      hazard(write ? "write-after-write" : "read-after-write", state.writer, at_byte);
    }
    if (write) {
      const uint32_t others = state.read_epoch == epoch ? state.readers & ~(1u << warp) : 0u;
      if (others != 0) hazard("write-after-read", __builtin_ctz(others), at_byte);
      state.write_epoch = epoch;
      state.writer = warp;
    } else {
      if (state.read_epoch != epoch) state.read_epoch = epoch, state.readers = 0;
      state.readers |= 1u << warp;
    }
  }
}

}  // namespace cuda_emu

inline void __syncwarp(unsigned mask = cuda_emu::kFullMask) {
  cuda_emu::thread_synchronizes();
  cuda_emu::warp_exchange(cuda_emu::WarpOp::kSyncWarp, mask, 0, nullptr, 0);
  // The next operation writes the other buffer; one barrier per operation suffices.
}

template <typename V>
inline V __shfl_xor_sync(unsigned mask, V value, int lane_mask, int width = cuda_emu::kWarpSize) {
  static_assert(std::is_arithmetic_v<V> && sizeof(V) <= 8,
                "the emulated __shfl_xor_sync takes int, long, long long, float, double");
  using namespace cuda_emu;
  if (width != kWarpSize || lane_mask < 0 || lane_mask >= kWarpSize) {
    report_error("__shfl_xor_sync with width " + std::to_string(width) + " and lane mask " +
                 std::to_string(lane_mask) + " is not emulated");
    lane_mask &= kWarpSize - 1;
  }
  const int t = static_cast<int>(threadIdx.x), lane = t % kWarpSize;
  const int buf =
      warp_exchange(WarpOp::kShflXor, mask, lane_mask, &value, static_cast<int>(sizeof(V)));
  V out;
  std::memcpy(&out, g_block.warps[t / kWarpSize].slot[buf][lane ^ lane_mask], sizeof(V));
  return out;
}

inline int __any_sync(unsigned mask, int predicate) {
  using namespace cuda_emu;
  const int t = static_cast<int>(threadIdx.x);
  const int mine = predicate != 0;
  const int buf = warp_exchange(WarpOp::kVote, mask, 0, &mine, static_cast<int>(sizeof(mine)));
  int any = 0;
  for (int l = 0; l < kWarpSize; ++l) {
    int v;
    std::memcpy(&v, g_block.warps[t / kWarpSize].slot[buf][l], sizeof(v));
    any |= v;
  }
  return any;
}

// Bit casts (the device's are intrinsics).
inline float __uint_as_float(unsigned x) {
  float f;
  std::memcpy(&f, &x, sizeof(f));
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned x;
  std::memcpy(&x, &f, sizeof(x));
  return x;
}

inline float atomicAdd(float* address, float value) {
  return std::atomic_ref<float>(*address).fetch_add(value, std::memory_order_relaxed);
}
inline double atomicAdd(double* address, double value) {
  return std::atomic_ref<double>(*address).fetch_add(value, std::memory_order_relaxed);
}
// sm_90's vector atomic: each component added atomically (not the pair as one).
inline float2 atomicAdd(float2* address, float2 value) {
  return float2{atomicAdd(&address->x, value.x), atomicAdd(&address->y, value.y)};
}

// The dynamic shared memory the kernels' `extern __shared__ __align__(128) unsigned char smem[]`
// (a block-scope declaration in namespace entropy_attn::cuda::fallback) refers to. Page-aligned, a
// whole number of pages, so that the part past a launch's smem_bytes can be protected.
namespace entropy_attn::cuda::fallback {
alignas(4096) inline unsigned char smem[cuda_emu::kSmemCapacity];
}  // namespace entropy_attn::cuda::fallback

namespace cuda_emu {
// A deterministic backward's wait for its turn (fallback/turns.cuh, sm90/ops.cuh: wait_turn). The
// blocks run one after another in launch order, so a count that is not the awaited one when a
// block waits never becomes it: a GPU would spin for ever, or (had a later block already passed)
// add out of order.
inline void check_turn(const int* turn, int value) {
  if (*turn != value) {
    report_error("turn: block (" + std::to_string(blockIdx.x) + ", " + std::to_string(blockIdx.y) +
                 ", " + std::to_string(blockIdx.z) + ") waits for count " + std::to_string(value) +
                 ", the blocks before it left " + std::to_string(*turn));
  }
}
}  // namespace cuda_emu

// The fallback's turns (turns.cuh), with nothing in flight to wait for.
namespace entropy_attn::cuda::fallback {
inline void wait_turn(const int* turn, int value) { cuda_emu::check_turn(turn, value); }
inline void pass_turn(int* turn) { ++*turn; }
}  // namespace entropy_attn::cuda::fallback

namespace cuda_emu {

class CudaEmulationError : public std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Aborts the process when no barrier completes for kWatchdogSeconds (a hang the deadlock check
// cannot see, e.g. an endless loop in a kernel).
class Watchdog {
 public:
  Watchdog() : thread_([this] { run(); }) {}
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lk(m_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  void run() {
    std::unique_lock<std::mutex> lk(m_);
    uint64_t last = g_progress.load();
    auto since = std::chrono::steady_clock::now();
    while (!done_) {
      cv_.wait_for(lk, std::chrono::milliseconds(200));
      const uint64_t now = g_progress.load();
      if (now != last) {
        last = now;
        since = std::chrono::steady_clock::now();
      } else if (std::chrono::steady_clock::now() - since >
                 std::chrono::seconds(kWatchdogSeconds)) {
        std::fprintf(stderr,
                     "cuda_emulation: no barrier completed for %d s in block %lld: a thread that "
                     "never reaches a barrier (an endless loop?)\n",
                     kWatchdogSeconds, static_cast<long long>(current_block.load()));
        std::abort();
      }
    }
  }

 public:
  inline static std::atomic<int64_t> current_block{0};

 private:
  std::mutex m_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

// Protects the pages of a shared-memory array (kSmemCapacity bytes, page-aligned) past `bytes`
// (rounded up to a page) while alive.
class SmemGuard {
 public:
  SmemGuard(unsigned char* smem, size_t bytes) : smem_(smem) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    begin_ = (bytes + page - 1) / page * page;
    if (begin_ < kSmemCapacity &&
        mprotect(smem_ + begin_, kSmemCapacity - begin_, PROT_NONE) != 0) {
      begin_ = kSmemCapacity;  // best effort
    }
  }
  ~SmemGuard() {
    if (begin_ < kSmemCapacity) {
      mprotect(smem_ + begin_, kSmemCapacity - begin_, PROT_READ | PROT_WRITE);
    }
  }
  SmemGuard(const SmemGuard&) = delete;
  SmemGuard& operator=(const SmemGuard&) = delete;

 private:
  unsigned char* smem_;
  size_t begin_ = kSmemCapacity;
};

inline void prepare_block(int threads, unsigned char* smem, size_t smem_bytes) {
  g_block_serial.fetch_add(1, std::memory_order_relaxed);  // (the threads meet before reading it)
  g_block.reset(threads);
  g_smem_shadow.reset(smem, smem_bytes);
  std::memset(smem, 0xff, smem_bytes);  // NaN in every floating type
}

}  // namespace cuda_emu

// The shape of an emulated launch: kernel<<<grid, threads, smem_bytes>>> with the dynamic shared
// memory in `smem` (an array of cuda_emu::kSmemCapacity bytes, page-aligned: the one the kernel's
// `extern __shared__` declaration names).
struct EmulatedLaunch {
  dim3 grid;
  int threads = cuda_emu::kBlockThreads;
  size_t smem_bytes = 0;
  unsigned char* smem = entropy_attn::cuda::fallback::smem;
};

// Runs the launch on the host: the blocks one after another (x fastest, then y, then z), each on
// `threads` threads. Throws cuda_emu::CudaEmulationError for a launch a GPU would reject or for
// what the checks above found.
template <typename Kernel, typename Params>
void emulate_launch(Kernel kernel, const EmulatedLaunch& l, const Params& p) {
  using namespace cuda_emu;
  const size_t smem_bytes = l.smem_bytes;
  const int threads_per_block = l.threads;
  if (smem_bytes > kSmemCapacity) {
    throw CudaEmulationError("emulate_launch: " + std::to_string(smem_bytes) +
                             " bytes of dynamic shared memory, more than the emulation's " +
                             std::to_string(kSmemCapacity));
  }
  if (threads_per_block <= 0 || threads_per_block > kMaxBlockThreads ||
      threads_per_block % kWarpSize != 0) {
    throw CudaEmulationError("emulate_launch: blocks of " + std::to_string(threads_per_block) +
                             " threads (the emulation runs whole warps, up to " +
                             std::to_string(kMaxBlockThreads) + ")");
  }
  if (l.grid.y < 1 || l.grid.y > 65535 || l.grid.z < 1 || l.grid.z > 65535) {
    throw CudaEmulationError("emulate_launch: invalid grid y " + std::to_string(l.grid.y) + ", z " +
                             std::to_string(l.grid.z));
  }
  const int64_t blocks = static_cast<int64_t>(l.grid.x) * l.grid.y * l.grid.z;
  if (l.grid.x > 0x7fffffffu) {
    throw CudaEmulationError("emulate_launch: invalid grid of " + std::to_string(l.grid.x) +
                             " blocks along x");
  }
  {
    std::lock_guard<std::mutex> lk(g_error_mutex);
    g_errors.clear();
  }
  if (blocks == 0) return;  // a GPU rejects an empty grid: the launchers skip it

  // One launch at a time, whatever its kernel: one shared-memory array, one block state, one
  // fiber scheduler.
  std::lock_guard<std::mutex> launch_lock(g_launch_mutex);
  SmemGuard guard(l.smem, smem_bytes);
  Watchdog watchdog;
  SyncDomain launch_domain;  // the launch's threads between blocks (never deadlocks)
  launch_domain.reset(threads_per_block);
  Barrier between_blocks(launch_domain, "between blocks");
  between_blocks.reset(threads_per_block);
  prepare_block(threads_per_block, l.smem, smem_bytes);
  std::atomic<bool> aborted{false};

  fibers::run(threads_per_block, [&](int t) {
    threadIdx = uint3{static_cast<unsigned>(t), 0, 0};
    blockDim = dim3(threads_per_block, 1, 1);
    gridDim = l.grid;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t xy = static_cast<int64_t>(l.grid.x) * l.grid.y;
      blockIdx =
          uint3{static_cast<unsigned>(b % l.grid.x), static_cast<unsigned>(b / l.grid.x % l.grid.y),
                static_cast<unsigned>(b / xy)};
      t_warp_seq = 0;
      t_block_seq = 0;
      t_group_seq = 0;
      try {
        kernel(p);
        block_end_checks().run();
        // Leave the block's barriers: the threads still running may synchronize without us.
        g_block.thread_exit(t);
      } catch (const DeadlockAbort&) {
        aborted.store(true);  // unwound from a barrier of a deadlocked block
      }
      between_blocks.arrive_and_wait();  // every thread finished block b
      if (t == 0) {
        if (g_block.domain.deadlocked.load()) {
          std::lock_guard<std::mutex> lk(g_block.domain.m);
          report_error("deadlock in block " + std::to_string(b) +
                       ": every running thread waits at a barrier that the others do not "
                       "reach (" +
                       g_block.domain.deadlock_state + ")");
          aborted.store(true);
        }
        Watchdog::current_block.store(b + 1);
        g_progress.fetch_add(1, std::memory_order_relaxed);
        if (b + 1 < blocks && !aborted.load()) prepare_block(threads_per_block, l.smem, smem_bytes);
      }
      between_blocks.arrive_and_wait();  // block b + 1 is set up
      if (aborted.load()) break;
    }
  });

  std::lock_guard<std::mutex> lk(g_error_mutex);
  if (!g_errors.empty()) {
    std::string msg = "emulate_launch: " + std::to_string(g_errors.size()) + " error(s):";
    for (const auto& e : g_errors) msg += "\n  " + e;
    g_errors.clear();
    throw CudaEmulationError(msg);
  }
}

// Runs kernel<<<blocks, 128, smem_bytes>>>(p) (the fallback's launches: a 1-D grid, its shared
// memory array).
template <typename Kernel, typename Params>
void emulate_launch(Kernel kernel, int64_t blocks, size_t smem_bytes, const Params& p) {
  if (blocks < 0 || blocks > 0x7fffffff) {
    throw cuda_emu::CudaEmulationError("emulate_launch: invalid grid of " + std::to_string(blocks) +
                                       " blocks");
  }
  EmulatedLaunch l;
  l.grid = dim3(static_cast<unsigned>(blocks), 1, 1);
  l.smem_bytes = smem_bytes;
  emulate_launch(kernel, l, p);
}
