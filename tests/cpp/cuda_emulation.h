// CPU emulation of the CUDA execution model, enough to run the project's kernels
// (csrc/cuda/*_kernel.cuh) on the host in a g++ (C++20) translation unit: include this header
// BEFORE the kernel headers, then run a kernel with
//   emulate_launch(attention_fwd_kernel<float, 64>, blocks, FwdLayout<float, 64>::kBytes, params);
//
// The model:
//   * a block is kThreads = 128 std::threads (threadIdx, blockIdx are thread_local); the blocks of
//     a launch run one after another on the same 128 threads;
//   * __syncthreads() is a barrier of the block's threads, __syncwarp() one of the warp's 32;
//   * __shfl_xor_sync exchanges values through a per-warp slot array at a warp barrier;
//   * dynamic shared memory is entropy_attn::cuda::fallback::smem (the kernels' `extern __shared__ smem[]`
//     binds to it), filled with 0xff bytes (NaN for every floating type) before each block, so that
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
//     barrier, e.g. an endless loop) aborts the process.
// Threads that `return` early leave the block's and their warp's barriers (the barriers then wait
// for the remaining threads only); a warp operation or __syncthreads() after that is reported.
#pragma once

#if defined(__CUDACC__) || defined(__CUDA_ARCH__)
#error "cuda_emulation.h is for the host compiler only"
#endif

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <sys/mman.h>
#include <unistd.h>
#include <vector_types.h>

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

constexpr int kBlockThreads = 128;  // every kernel of the project runs 128 threads a block
constexpr int kWarpSize = 32;
constexpr int kBlockWarps = kBlockThreads / kWarpSize;
constexpr unsigned kFullMask = 0xffffffffu;
// Dynamic shared memory available to a launch (more than any GPU's 227 KB per block).
constexpr size_t kSmemCapacity = 256 * 1024;
constexpr int kWatchdogSeconds = 60;

// Counts barrier completions and finished blocks, for the watchdog.
inline std::atomic<uint64_t> g_progress{0};

// Errors found by the checks during a launch (reported by emulate_launch).
inline std::mutex g_error_mutex;
inline std::vector<std::string> g_errors;
inline void report_error(std::string msg) {
  std::lock_guard<std::mutex> lk(g_error_mutex);
  if (g_errors.size() < 20) g_errors.push_back(std::move(msg));
}

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
// bookkeeping under the domain's mutex, the waiting on an atomic generation counter (futex, no
// mutex convoy on wake-up).
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
  }
  // Returns the number of participants when the barrier completed (fewer than at reset when
  // threads left it).
  int arrive_and_wait() {
    std::unique_lock<std::mutex> lk(d_.m);
    if (d_.deadlocked.load()) throw DeadlockAbort{};
    const uint32_t g = gen_.load(std::memory_order_relaxed);
    if (++arrived_ == expected_) {
      complete(arrived_ - 1);
      return expected_;
    }
    ++d_.blocked;
    d_.check_deadlock();
    lk.unlock();
    while (gen_.load(std::memory_order_acquire) == g) gen_.wait(g, std::memory_order_acquire);
    if (d_.deadlocked.load(std::memory_order_acquire)) throw DeadlockAbort{};
    // Stable until this thread arrives again: the next completion needs it.
    return completed_with_.load(std::memory_order_relaxed);
  }
  // A thread leaves the barrier for good (under the domain's mutex).
  void drop_locked() {
    --expected_;
    if (arrived_ > 0 && arrived_ == expected_) complete(arrived_);
  }
  // Under the domain's mutex.
  int participants_locked() const { return expected_; }
  std::string state_locked() const {
    return name_ + ": " + std::to_string(arrived_) + " of " + std::to_string(expected_) +
           " arrived";
  }
  // Wakes the waiting threads without completing (deadlock).
  void wake_all() {
    gen_.fetch_add(1, std::memory_order_release);
    gen_.notify_all();
  }

 private:
  void complete(int waiters) {  // under the domain's mutex
    d_.blocked -= waiters;
    arrived_ = 0;
    completed_with_.store(expected_, std::memory_order_relaxed);
    gen_.fetch_add(1, std::memory_order_release);
    gen_.notify_all();
    g_progress.fetch_add(1, std::memory_order_relaxed);
  }
  SyncDomain& d_;
  std::string name_;
  int expected_ = 0, arrived_ = 0;  // under the domain's mutex
  std::atomic<uint32_t> gen_{0};
  std::atomic<int> completed_with_{0};
};

inline void SyncDomain::check_deadlock() {
  if (live == 0 || blocked < live || deadlocked.load()) return;
  for (const Barrier* b : barriers) deadlock_state += (deadlock_state.empty() ? "" : "; ") + b->state_locked();
  deadlocked.store(true, std::memory_order_release);
  for (Barrier* b : barriers) b->wake_all();
}

// One warp-level operation of one lane, compared across the lanes after the warp barrier.
enum class WarpOp : int { kSyncWarp = 1, kShflXor = 2 };
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
  alignas(8) unsigned char slot[2][kWarpSize][8];
};

struct BlockState {
  SyncDomain domain;
  Barrier barrier{domain, "__syncthreads barrier"};
  Barrier warp_barrier[kBlockWarps] = {{domain, "warp 0 barrier"}, {domain, "warp 1 barrier"},
                                       {domain, "warp 2 barrier"}, {domain, "warp 3 barrier"}};
  uint64_t sync_seq[2][kBlockThreads] = {};
  WarpState warps[kBlockWarps];

  void reset() {
    std::lock_guard<std::mutex> lk(domain.m);
    domain.reset(kBlockThreads);
    barrier.reset(kBlockThreads);
    for (auto& b : warp_barrier) b.reset(kWarpSize);
  }
  // Thread t returned from the kernel: it leaves its block's and its warp's barriers.
  void thread_exit(int t) {
    std::lock_guard<std::mutex> lk(domain.m);
    --domain.live;
    barrier.drop_locked();
    warp_barrier[t / kWarpSize].drop_locked();
    domain.check_deadlock();
  }
  int warp_participants(int warp) {
    std::lock_guard<std::mutex> lk(domain.m);
    return warp_barrier[warp].participants_locked();
  }
};

inline BlockState g_block;  // the running block (blocks run one after another)

// Per emulated thread.
inline thread_local uint64_t t_warp_seq = 0;   // warp operations done in this block
inline thread_local uint64_t t_block_seq = 0;  // __syncthreads done in this block

}  // namespace cuda_emu

// ---------------------------------------------------------------------------------------------
// Built-in variables and device functions (global namespace, as in CUDA).
// ---------------------------------------------------------------------------------------------
inline thread_local uint3 threadIdx{0, 0, 0};
inline thread_local uint3 blockIdx{0, 0, 0};
inline thread_local dim3 blockDim{cuda_emu::kBlockThreads, 1, 1};
inline thread_local dim3 gridDim{1, 1, 1};

inline void __syncthreads() {
  using namespace cuda_emu;
  BlockState& b = g_block;
  const int t = static_cast<int>(threadIdx.x);
  const uint64_t seq = t_block_seq++;
  const int buf = static_cast<int>(seq & 1);
  b.sync_seq[buf][t] = seq;
  const int participants = b.barrier.arrive_and_wait();
  // Every thread checks (thread 0 may be among those that returned).
  if (participants != kBlockThreads) {
    report_error("__syncthreads() in block " + std::to_string(blockIdx.x) + " after " +
                 std::to_string(kBlockThreads - participants) +
                 " thread(s) of the block returned (undefined behavior on a GPU)");
    return;
  }
  for (int u = 0; u < kBlockThreads; ++u) {
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
  const char* what = op == WarpOp::kSyncWarp ? "__syncwarp" : "__shfl_xor_sync";
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

}  // namespace cuda_emu

inline void __syncwarp(unsigned mask = cuda_emu::kFullMask) {
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
  const int buf = warp_exchange(WarpOp::kShflXor, mask, lane_mask, &value,
                                static_cast<int>(sizeof(V)));
  V out;
  std::memcpy(&out, g_block.warps[t / kWarpSize].slot[buf][lane ^ lane_mask], sizeof(V));
  return out;
}

inline float atomicAdd(float* address, float value) {
  return std::atomic_ref<float>(*address).fetch_add(value, std::memory_order_relaxed);
}
inline double atomicAdd(double* address, double value) {
  return std::atomic_ref<double>(*address).fetch_add(value, std::memory_order_relaxed);
}

// The dynamic shared memory the kernels' `extern __shared__ __align__(128) unsigned char smem[]`
// (a block-scope declaration in namespace entropy_attn::cuda::fallback) refers to. Page-aligned, a whole
// number of pages, so that the part past a launch's smem_bytes can be protected.
namespace entropy_attn::cuda::fallback {
alignas(4096) inline unsigned char smem[cuda_emu::kSmemCapacity];
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

// Protects the pages of the shared-memory array past `bytes` (rounded up to a page) while alive.
class SmemGuard {
 public:
  explicit SmemGuard(size_t bytes) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    begin_ = (bytes + page - 1) / page * page;
    if (begin_ < kSmemCapacity &&
        mprotect(entropy_attn::cuda::fallback::smem + begin_, kSmemCapacity - begin_, PROT_NONE) != 0) {
      begin_ = kSmemCapacity;  // best effort
    }
  }
  ~SmemGuard() {
    if (begin_ < kSmemCapacity) {
      mprotect(entropy_attn::cuda::fallback::smem + begin_, kSmemCapacity - begin_, PROT_READ | PROT_WRITE);
    }
  }
  SmemGuard(const SmemGuard&) = delete;
  SmemGuard& operator=(const SmemGuard&) = delete;

 private:
  size_t begin_ = kSmemCapacity;
};

inline void prepare_block(size_t smem_bytes) {
  g_block.reset();
  std::memset(entropy_attn::cuda::fallback::smem, 0xff, smem_bytes);  // NaN in every floating type
}

}  // namespace cuda_emu

// Runs kernel<<<blocks, 128, smem_bytes>>>(p) on the host: the blocks one after another, each on
// 128 threads. Throws cuda_emu::CudaEmulationError for a launch a GPU would reject or for what the
// checks above found.
template <typename Kernel, typename Params>
void emulate_launch(Kernel kernel, int64_t blocks, size_t smem_bytes, const Params& p) {
  using namespace cuda_emu;
  if (smem_bytes > kSmemCapacity) {
    throw CudaEmulationError("emulate_launch: " + std::to_string(smem_bytes) +
                             " bytes of dynamic shared memory, more than the emulation's " +
                             std::to_string(kSmemCapacity));
  }
  if (blocks < 0 || blocks > 0x7fffffff) {
    throw CudaEmulationError("emulate_launch: invalid grid of " + std::to_string(blocks) +
                             " blocks");
  }
  {
    std::lock_guard<std::mutex> lk(g_error_mutex);
    g_errors.clear();
  }
  if (blocks == 0) return;  // a GPU rejects an empty grid: the launchers skip it

  static std::mutex launch_mutex;  // one launch at a time (one shared-memory array)
  std::lock_guard<std::mutex> launch_lock(launch_mutex);
  SmemGuard guard(smem_bytes);
  Watchdog watchdog;
  SyncDomain launch_domain;  // the launch's 128 threads between blocks (never deadlocks)
  launch_domain.reset(kBlockThreads);
  Barrier between_blocks(launch_domain, "between blocks");
  between_blocks.reset(kBlockThreads);
  prepare_block(smem_bytes);
  std::atomic<bool> aborted{false};

  std::vector<std::thread> threads;
  threads.reserve(kBlockThreads);
  for (int t = 0; t < kBlockThreads; ++t) {
    threads.emplace_back([&, t] {
      threadIdx = uint3{static_cast<unsigned>(t), 0, 0};
      blockDim = dim3(kBlockThreads, 1, 1);
      gridDim = dim3(static_cast<unsigned>(blocks), 1, 1);
      for (int64_t b = 0; b < blocks; ++b) {
        blockIdx = uint3{static_cast<unsigned>(b), 0, 0};
        t_warp_seq = 0;
        t_block_seq = 0;
        try {
          kernel(p);
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
                         "reach (" + g_block.domain.deadlock_state + ")");
            aborted.store(true);
          }
          Watchdog::current_block.store(b + 1);
          g_progress.fetch_add(1, std::memory_order_relaxed);
          if (b + 1 < blocks && !aborted.load()) prepare_block(smem_bytes);
        }
        between_blocks.arrive_and_wait();  // block b + 1 is set up
        if (aborted.load()) break;
      }
    });
  }
  for (auto& th : threads) th.join();

  std::lock_guard<std::mutex> lk(g_error_mutex);
  if (!g_errors.empty()) {
    std::string msg = "emulate_launch: " + std::to_string(g_errors.size()) + " error(s):";
    for (const auto& e : g_errors) msg += "\n  " + e;
    g_errors.clear();
    throw CudaEmulationError(msg);
  }
}
