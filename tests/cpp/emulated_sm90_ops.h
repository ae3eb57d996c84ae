// Emulated sm_90a instructions for the CPU emulation of the Hopper family (cuda_emulation.h): TMA
// tile loads, mbarriers with transaction counts, the TMA pipeline built on them, named barriers and
// wgmma, as the operations the sm90 kernels take through their `Ops` parameter (sm90/ops.cuh:
// Sm90Ops). CuTe's own host code builds the kernels' TMA copies and wgmma descriptors, so the
// kernels partition and address shared memory exactly as on a GPU; only the instructions run here:
//   * a TMA load copies its box (coordinates outside the tensor read as zeros) in the tensor map's
//     swizzle and completes its bytes on its mbarrier, as late as it may: when a thread first waits
//     for the barrier's phase, so that a thread that reads the stage without that wait reads what
//     was there before (a stale stage, or the 0xff NaN bytes of unwritten shared memory). The map
//     is the one CuTe encodes for the driver (cuTensorMapEncodeTiled): its arguments are recorded
//     in the map's 128 bytes;
//   * an mbarrier counts arrivals and transaction bytes and flips its phase when both are done,
//     as the PTX ISA describes; waiting threads take part in the emulation's deadlock check;
//   * wgmma is warpgroup-wide: the 128 threads meet (a register A operand is gathered then), each
//     computes its own accumulators from the operands' shared-memory descriptors, decoded by the
//     PTX ISA's canonical layouts and swizzles, and they meet again once every read is done. The
//     accumulators reach the thread's registers only when its wgmma_wait retires their batch
//     (committed batches retiring in order); until then the registers hold NaN, so an
//     accumulator read before its wait shows up in the results. The operands' shared memory counts
//     as read until that wait: the hazard checks below report a TMA load into it, a write to it,
//     or the release of its pipeline stage before then, and a load into a stage that consumers
//     have not released;
//   * named barriers (bar.sync / bar.arrive with a thread count) as the hardware counts them;
//   * bulk reductions into global memory, checked for writes to their shared memory before the
//     issuing thread's wait (below);
//   * the async proxy's view of generic stores: a wgmma or bulk reduction that reads a store not
//     fenced (fence.proxy.async) before the synchronization that publishes it is reported;
//   * cp.async, whose destination holds NaN bytes until the issuing thread's wait
//     (emulated_cp_async.h).
// The shared-memory hazard check of the sm80 emulation does not apply: these kernels order their
// accesses by mbarriers, not __syncthreads. Include before any CuTe header (sm90_emulation.h).
#pragma once

#include "cuda_emulation.h"  // (before CUTLASS: the CUDA built-ins)
#include "emulated_cp_async.h"

namespace cuda_emu {
// The dynamic shared memory of the running launch: shared-memory addresses (what the kernels'
// descriptors hold) are offsets from it.
inline unsigned char* g_sm90_smem = nullptr;
}  // namespace cuda_emu

// CuTe turns shared-memory pointers into 32-bit shared addresses (wgmma descriptors) through this
// intrinsic; the host has none, so the emulation provides it: the offset in the launch's array.
// (Before any CuTe header: CuTe decides how to form the addresses when it is first included.)
inline size_t __cvta_generic_to_shared(const void* p) {
  return static_cast<size_t>(static_cast<const unsigned char*>(p) - cuda_emu::g_sm90_smem);
}
#define CUTE_CVTA_GENERIC_TO_SHARED_ACTIVATED 1

#include <cuda.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

// The tensor map CuTe's make_tma_copy encodes, recorded by the host encoder below.
namespace cuda_emu::sm90 {
struct TensorMap {
  const unsigned char* address;
  uint64_t dims[5];
  uint64_t strides[5];  // bytes; strides[0] is the element size
  uint32_t box[5];
  uint32_t rank;
  uint32_t element_bytes;
  uint32_t swizzle_bytes;  // 0 (none), 32, 64 or 128
};
static_assert(sizeof(TensorMap) <= sizeof(CUtensorMap));
}  // namespace cuda_emu::sm90

inline CUresult cuda_emu_tensor_map_encode_tiled(
    CUtensorMap* map, CUtensorMapDataType type, cuuint32_t rank, void* address,
    const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box,
    const cuuint32_t* element_strides, CUtensorMapInterleave interleave, CUtensorMapSwizzle swizzle,
    CUtensorMapL2promotion, CUtensorMapFloatOOBfill) {
  cuda_emu::sm90::TensorMap m{};
  m.address = static_cast<const unsigned char*>(address);
  m.rank = rank;
  switch (type) {
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT16:
    case CU_TENSOR_MAP_DATA_TYPE_BFLOAT16:
    case CU_TENSOR_MAP_DATA_TYPE_UINT16:
      m.element_bytes = 2;
      break;
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT32:
      m.element_bytes = 4;
      break;
    default:
      return CUDA_ERROR_NOT_SUPPORTED;
  }
  if (rank < 1 || rank > 5 || interleave != CU_TENSOR_MAP_INTERLEAVE_NONE)
    return CUDA_ERROR_INVALID_VALUE;
  m.swizzle_bytes = swizzle == CU_TENSOR_MAP_SWIZZLE_128B  ? 128
                    : swizzle == CU_TENSOR_MAP_SWIZZLE_64B ? 64
                    : swizzle == CU_TENSOR_MAP_SWIZZLE_32B ? 32
                                                           : 0;
  for (uint32_t d = 0; d < 5; ++d) {
    m.dims[d] = d < rank ? dims[d] : 1;
    m.strides[d] = d == 0 ? m.element_bytes : d < rank ? strides[d - 1] : 0;
    m.box[d] = d < rank ? box[d] : 1;
    if (d < rank && element_strides[d] != 1) return CUDA_ERROR_NOT_SUPPORTED;
  }
  // The hardware's rule: a swizzled box's inner extent fits in the swizzle span.
  if (m.swizzle_bytes != 0 && m.box[0] * m.element_bytes > m.swizzle_bytes)
    return CUDA_ERROR_INVALID_VALUE;
  std::memset(map, 0, sizeof(*map));
  std::memcpy(map, &m, sizeof(m));
  return CUDA_SUCCESS;
}

// CuTe's TMA code as nvcc 12+ sees it (the descriptor is encoded only there), calling the encoder
// above instead of the driver's: the version macros hold while CuTe's headers are first included
// (copy_atom.hpp includes the TMA traits); elsewhere they ask for __CUDA_ARCH__ too, which the
// host never has.
#define CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL 1
#define cuTensorMapEncodeTiled cuda_emu_tensor_map_encode_tiled
#define __CUDACC_VER_MAJOR__ 13
#define __CUDACC_VER_MINOR__ 0
// clang-format off
#include "emulated_sm80_ops.h"  // the host stubs CUTLASS needs, cp.async, CuTe (first)
#include <cutlass/cuda_host_adapter.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
// clang-format on
#undef __CUDACC_VER_MAJOR__
#undef __CUDACC_VER_MINOR__
#undef cuTensorMapEncodeTiled

#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/pipeline/sm90_pipeline.hpp>

namespace cuda_emu::sm90 {

// ---------------------------------------------------------------------------------------------
// The async proxy. wgmma and the bulk copies read shared memory through the async proxy, which
// sees a thread's generic stores (st.shared) only once that thread has executed fence.proxy.async,
// and the fence must come before the synchronization that orders the stores before the read (PTX
// ISA, "Memory consistency model: proxies"). The emulated async reads see every store at once, so
// a missing or late fence would change no result; the stores of what the async proxy reads go
// through Ops::store_shared instead, which records their 4-byte words, and:
//   * a word stored and not yet fenced counts as unfenced (per thread: t_unfenced; per word: how
//     many threads), until the thread's fence_view_async_shared;
//   * a thread that synchronizes (cuda_emulation.h: thread_sync_checks) with unfenced words
//     leaves them stale: published to the other threads but not to the async proxy, until a store
//     that is fenced in time or a TMA load writes them again;
//   * a wgmma operand or a bulk reduction that reads an unfenced or stale word is reported.
// (cp.async's landings, generic writes too, are not recorded: the kernels read those with generic
// loads only.) The words carry the block (g_block_serial) their state belongs to.
// ---------------------------------------------------------------------------------------------
struct ProxyWord {
  std::atomic<uint64_t> unfenced{0};  // serial << 16 | the number of threads
  std::atomic<uint64_t> stale{0};     // the serial of the block in which it went stale, or 0
};
inline ProxyWord g_proxy_words[kSmemCapacity / 4];
// (Per emulated thread, as the t_ variables below: fibers.h.)
inline std::vector<uint32_t> t_unfenced;  // words, in block t_unfenced_serial
inline uint64_t t_unfenced_serial = 0;
inline const bool t_unfenced_fiber_local =
    fibers::fiber_local(t_unfenced) && fibers::fiber_local(t_unfenced_serial);

inline uint64_t block_serial() { return g_block_serial.load(std::memory_order_relaxed); }

// The calling thread's unfenced words, of the running block.
inline std::vector<uint32_t>& unfenced_words() {
  if (t_unfenced_serial != block_serial()) t_unfenced.clear(), t_unfenced_serial = block_serial();
  return t_unfenced;
}

inline void count_unfenced(uint32_t w, int delta) {
  const uint64_t serial = block_serial();
  std::atomic<uint64_t>& a = g_proxy_words[w].unfenced;
  uint64_t old = a.load(std::memory_order_relaxed), next;
  do {
    const uint64_t count = old >> 16 == serial ? old & 0xffffu : 0;
    next = serial << 16 | (count + delta);
  } while (!a.compare_exchange_weak(old, next, std::memory_order_relaxed));
}

// A generic store of `bytes` at p (Ops::store_shared).
inline void generic_store(const void* p, size_t bytes) {
  const auto* at = static_cast<const unsigned char*>(p);
  if (at < g_sm90_smem || at + bytes > g_sm90_smem + kSmemCapacity) {
    report_error("Ops::store_shared outside the launch's shared memory");
    return;
  }
  const size_t off = static_cast<size_t>(at - g_sm90_smem);
  std::vector<uint32_t>& mine = unfenced_words();
  for (size_t w = off / 4; w <= (off + bytes - 1) / 4; ++w) {
    if (std::find(mine.begin(), mine.end(), w) != mine.end()) continue;
    mine.push_back(static_cast<uint32_t>(w));
    count_unfenced(static_cast<uint32_t>(w), 1);
  }
}

// fence.proxy.async.shared::cta by the calling thread: its stores are the async proxy's too.
inline void fence_proxy_async() {
  for (const uint32_t w : unfenced_words()) {
    count_unfenced(w, -1);
    g_proxy_words[w].stale.store(0, std::memory_order_relaxed);
  }
  t_unfenced.clear();
}

// The calling thread synchronizes: its unfenced words go stale.
inline void proxy_sync() {
  for (const uint32_t w : unfenced_words()) {
    count_unfenced(w, -1);
    g_proxy_words[w].stale.store(block_serial(), std::memory_order_relaxed);
  }
  t_unfenced.clear();
}
inline const bool g_proxy_sync_checked = on_thread_sync(&proxy_sync);

// An async-proxy read (`what`) of the shared bytes [offset, offset + bytes): reported where one
// of its words is unfenced or stale. Returns whether it was.
inline bool async_read_unfenced(uint32_t offset, uint32_t bytes, const char* what) {
  const uint64_t serial = block_serial();
  for (uint32_t w = offset / 4; w <= (offset + bytes - 1) / 4; ++w) {
    const ProxyWord& word = g_proxy_words[w];
    const uint64_t u = word.unfenced.load(std::memory_order_relaxed);
    const bool unfenced = u >> 16 == serial && (u & 0xffffu) != 0;
    if (unfenced || word.stale.load(std::memory_order_relaxed) == serial) {
      report_error(std::string(what) + " reads shared byte " + std::to_string(4 * w) +
                   ", stored by the generic proxy " +
                   (unfenced
                        ? "and not yet fenced (fence.proxy.async: Ops::fence_view_async_shared)"
                        : "without a fence.proxy.async before the synchronization that "
                          "publishes it"));
      return true;
    }
  }
  return false;
}

// An async-proxy write (a TMA load) of the word holding shared byte `offset`.
inline void async_write(uint32_t offset) {
  g_proxy_words[offset / 4].stale.store(0, std::memory_order_relaxed);
}

// ---------------------------------------------------------------------------------------------
// TMA boxes.
// ---------------------------------------------------------------------------------------------
// The byte address `a` (an offset in shared memory) under a swizzle of `bytes` (32, 64, 128): its
// 16-byte chunk index XORed with the 128-byte line's index (mod the span's chunks), as TMA and
// wgmma's canonical layouts both apply it.
inline uint32_t swizzle(uint32_t a, uint32_t bytes) {
  const uint32_t mask = bytes == 128 ? 7u : bytes == 64 ? 3u : bytes == 32 ? 1u : 0u;
  return a ^ (((a >> 7) & mask) << 4);
}

// The granule of the hazard checks below.
constexpr uint32_t kChunkBytes = 16;

// One TMA tile load: the box of `map` at `crd` into shared memory at `dst` (an offset).
struct TmaBox {
  TensorMap map;
  int32_t crd[5];
  uint32_t dst;

  // Writes the box (coordinates outside the tensor read as zeros) in the map's swizzle; returns
  // its bytes.
  uint32_t land() const {
    const TensorMap& m = map;
    const uint32_t total = m.box[0] * m.box[1] * m.box[2] * m.box[3] * m.box[4];
    for (uint32_t linear = 0; linear < total; ++linear) {
      uint32_t rest = linear;
      bool inside = true;
      int64_t off = 0;
      for (uint32_t d = 0; d < 5; ++d) {
        const int64_t g = static_cast<int64_t>(d < m.rank ? crd[d] : 0) + rest % m.box[d];
        rest /= m.box[d];
        inside = inside && g >= 0 && g < static_cast<int64_t>(m.dims[d]);
        off += g * static_cast<int64_t>(m.strides[d]);
      }
      const uint32_t at = swizzle(dst + linear * m.element_bytes, m.swizzle_bytes);
      unsigned char* to = g_sm90_smem + at;
      async_write(at);
      if (inside) {
        std::memcpy(to, m.address + off, m.element_bytes);
      } else {
        std::memset(to, 0, m.element_bytes);
      }
    }
    return total * m.element_bytes;
  }
  // The 16-byte chunks of shared memory the box writes (a swizzle permutes whole chunks).
  std::vector<uint32_t> chunks() const {
    const TensorMap& m = map;
    const uint32_t bytes = m.box[0] * m.box[1] * m.box[2] * m.box[3] * m.box[4] * m.element_bytes;
    std::vector<uint32_t> out;
    for (uint32_t a = dst; a < dst + bytes; a += kChunkBytes)
      out.push_back(swizzle(a, m.swizzle_bytes) / kChunkBytes);
    return out;
  }
};

// ---------------------------------------------------------------------------------------------
// Shared-memory hazards of the asynchronous operations. On a GPU a wgmma may read its
// shared-memory operands at any time until the wait that retires it, and a TMA load may write its
// box at any time until its mbarrier's phase completes; nothing orders either against other
// accesses. The emulation does each at one instant (a wgmma's reads at issue, a load's writes at
// the first wait for its phase), so a missing wait or release would not change its results; these
// checks report it instead, on 16-byte chunks of shared memory:
//   * a wgmma's operand chunks are in flight from its issue to the first wait in its warpgroup that
//     retires it. A TMA load issued into an in-flight chunk is reported, and so is a write to one
//     (found at that wait: the chunks no longer hold what the wgmma read);
//   * a consumer thread of a TMA pipeline holds a stage from its consumer_wait to its
//     consumer_release. A load issued into a held stage (a producer that did not wait for the
//     stage's release) is reported, and so is a release while a wgmma of the releasing thread that
//     reads the stage's chunks has not been waited for.
// ---------------------------------------------------------------------------------------------
struct OperandRead {
  std::vector<uint32_t> chunks;      // sorted, distinct
  std::vector<unsigned char> bytes;  // what the wgmma read: kChunkBytes per chunk
  std::atomic<bool> retired{false};
};

// The in-flight operand reads of the running block, counted per chunk. Under g_block.domain.m.
struct InFlightReads {
  std::vector<uint16_t> count = std::vector<uint16_t>(kSmemCapacity / kChunkBytes);
  uint64_t block = 0;  // the block (g_block_serial) they were counted in
  std::vector<uint16_t>& of_this_block() {
    const uint64_t serial = g_block_serial.load(std::memory_order_relaxed);
    if (block != serial) {
      std::fill(count.begin(), count.end(), uint16_t{0});
      block = serial;
    }
    return count;
  }
};
inline InFlightReads g_in_flight;

// The calling thread's wgmma reads not yet retired by its waits, with the batch of each.
inline std::vector<std::pair<uint64_t, std::shared_ptr<OperandRead>>> t_reads;
inline const bool t_reads_fiber_local = fibers::fiber_local(t_reads);

// A wgmma's operands, read now from `chunks`: what they hold, counted in flight.
inline std::shared_ptr<OperandRead> operand_read(std::vector<uint32_t> chunks) {
  auto r = std::make_shared<OperandRead>();
  std::sort(chunks.begin(), chunks.end());
  chunks.erase(std::unique(chunks.begin(), chunks.end()), chunks.end());
  for (const uint32_t c : chunks) {
    if (async_read_unfenced(c * kChunkBytes, kChunkBytes, "a wgmma operand")) break;
  }
  r->bytes.resize(chunks.size() * kChunkBytes);
  for (size_t i = 0; i < chunks.size(); ++i)
    std::memcpy(&r->bytes[i * kChunkBytes], g_sm90_smem + chunks[i] * kChunkBytes, kChunkBytes);
  r->chunks = std::move(chunks);
  std::lock_guard<std::mutex> lk(g_block.domain.m);
  std::vector<uint16_t>& count = g_in_flight.of_this_block();
  for (uint32_t c : r->chunks) ++count[c];
  return r;
}

// The first wait that retires the read: its chunks must still hold what it read.
inline void retire_read(OperandRead& r) {
  if (r.retired.exchange(true)) return;
  for (size_t i = 0; i < r.chunks.size(); ++i) {
    if (std::memcmp(&r.bytes[i * kChunkBytes], g_sm90_smem + r.chunks[i] * kChunkBytes,
                    kChunkBytes) != 0) {
      report_error("wgmma operand at shared byte " + std::to_string(r.chunks[i] * kChunkBytes) +
                   " written before the wait that retires the wgmma");
      break;
    }
  }
  std::lock_guard<std::mutex> lk(g_block.domain.m);
  std::vector<uint16_t>& count = g_in_flight.of_this_block();
  for (uint32_t c : r.chunks) --count[c];
}

// ---------------------------------------------------------------------------------------------
// mbarriers. The state of the block's barriers (their addresses in shared memory) lives here, under
// the block's synchronization mutex; a waiting thread counts as blocked for the deadlock check.
// ---------------------------------------------------------------------------------------------
struct Mbarrier {
  int expected = 0, pending = 0;
  int64_t tx = 0;  // transaction bytes still to come
  uint32_t phase = 0;
  std::vector<TmaBox> loads;  // issued, not landed
  // As the "full" barrier of a TMA pipeline's stage: the consumer threads that hold the stage
  // (past their consumer_wait, before their consumer_release), and the shared-memory chunks its
  // loads write (the stage's region, in 16-byte chunks: above).
  int holders = 0;
  std::vector<bool> region;
};

struct MbarrierTable {
  std::map<const void*, Mbarrier> bars;            // under g_block.domain.m
  int waiting = 0;                                 // threads blocked in wait(), under the mutex
  Barrier wake{g_block.domain, "mbarrier waits"};  // its generation wakes them (and a deadlock)

  Mbarrier& at(const void* p) {
    auto it = bars.find(p);
    if (it == bars.end()) {
      report_error("mbarrier at shared byte " +
                   std::to_string(static_cast<const unsigned char*>(p) - g_sm90_smem) +
                   " used before its init");
      return bars[p];
    }
    return it->second;
  }
  // Completes the phase when every arrival and byte is in; wakes the waiters. Under the mutex.
  void settle(Mbarrier& b) {
    if (b.pending > 0 || b.tx > 0) return;
    if (b.tx < 0) report_error("mbarrier: more transaction bytes completed than expected");
    b.phase ^= 1u;
    b.pending = b.expected;
    b.tx = 0;
    g_progress.fetch_add(1, std::memory_order_relaxed);
    wake_waiters();
  }
  // Every waiting thread looks again (a phase completed, or a load it may land was issued). Under
  // the mutex.
  void wake_waiters() {
    g_block.domain.blocked -= waiting;
    waiting = 0;
    wake.wake_all();
  }
};
inline MbarrierTable g_mbarriers;

// ClusterTransactionBarrier's interface (a block of one CTA).
struct TxBarrier {
  static void init(const uint64_t* p, uint32_t count) {
    std::lock_guard<std::mutex> lk(g_block.domain.m);
    Mbarrier& b = g_mbarriers.bars[p];
    b = Mbarrier{};
    b.expected = b.pending = static_cast<int>(count);
  }
  // Waits until the phase of parity `phase` has completed (mbarrier.try_wait.parity).
  static void wait(const uint64_t* p, uint32_t phase) {
    std::unique_lock<std::mutex> lk(g_block.domain.m);
    for (;;) {
      if (g_block.domain.deadlocked.load()) throw DeadlockAbort{};
      Mbarrier& b = g_mbarriers.at(p);
      if (b.phase != (phase & 1u)) return;
      if (!b.loads.empty()) {  // the loads land when first waited for
        for (const TmaBox& box : b.loads) b.tx -= box.land();
        b.loads.clear();
        g_mbarriers.settle(b);
        continue;
      }
      ++g_block.domain.blocked;
      ++g_mbarriers.waiting;
      g_block.domain.check_deadlock();
      const uint32_t g = g_mbarriers.wake.generation();
      lk.unlock();
      g_mbarriers.wake.wait_past(g);
      lk.lock();
    }
  }
  static void arrive(const uint64_t* p) { arrive_and_expect_tx(p, 0); }
  static void arrive_and_expect_tx(const uint64_t* p, uint32_t bytes) {
    thread_synchronizes();
    std::lock_guard<std::mutex> lk(g_block.domain.m);
    Mbarrier& b = g_mbarriers.at(p);
    b.tx += bytes;
    if (b.pending <= 0) report_error("mbarrier: more arrivals than its count");
    --b.pending;
    g_mbarriers.settle(b);
  }
  // A TMA load that completes its bytes on the barrier: it lands when a thread first waits for the
  // phase (so that a thread that reads the stage without waiting reads what was there before).
  // Reported: a load into a stage that consumers hold, or into chunks a wgmma reads (above).
  static void issue(const uint64_t* p, const TmaBox& box) {
    std::lock_guard<std::mutex> lk(g_block.domain.m);
    Mbarrier& b = g_mbarriers.at(p);
    if (b.holders > 0) {
      report_error("TMA load into the stage of the mbarrier at shared byte " + byte_of(p) +
                   " while " + std::to_string(b.holders) +
                   " consumer thread(s) hold it (its release was not waited for)");
    }
    const std::vector<uint16_t>& in_flight = g_in_flight.of_this_block();
    if (b.region.empty()) b.region.resize(in_flight.size());
    for (const uint32_t c : box.chunks()) {
      if (in_flight[c] > 0) {
        report_error("TMA load into shared byte " + std::to_string(c * kChunkBytes) +
                     ", which a wgmma not yet waited for reads");
        break;
      }
    }
    for (const uint32_t c : box.chunks()) b.region[c] = true;
    b.loads.push_back(box);
    g_mbarriers.wake_waiters();
  }
  // The calling consumer thread takes (+1) or gives back (-1) the stage whose "full" barrier is at
  // `p`. Giving it back, none of its wgmma reads that are not yet waited for may touch the
  // stage's region.
  static void hold(const uint64_t* p, int delta) {
    std::lock_guard<std::mutex> lk(g_block.domain.m);
    Mbarrier& b = g_mbarriers.at(p);
    b.holders += delta;
    if (b.holders < 0) report_error("consumer_release of a stage not waited for");
    if (delta > 0 || b.region.empty()) return;
    for (const auto& [batch, read] : t_reads) {
      for (const uint32_t c : read->chunks) {
        if (b.region[c]) {
          report_error("consumer thread " + std::to_string(threadIdx.x) +
                       " releases the stage of the mbarrier at shared byte " + byte_of(p) +
                       " while its wgmma reading shared byte " + std::to_string(c * kChunkBytes) +
                       " has not been waited for");
          return;
        }
      }
    }
  }

 private:
  static std::string byte_of(const uint64_t* p) {
    return std::to_string(reinterpret_cast<const unsigned char*>(p) - g_sm90_smem);
  }
};

// cutlass::PipelineTmaAsync for a cluster of one block: "full" barriers (the producer's arrival
// with the stage's bytes, completed by the TMA loads) and "empty" ones (one arrival per consumer
// thread, as CUTLASS counts them for a single block).
template <int kStages>
class PipelineTmaAsync {
 public:
  static constexpr uint32_t Stages = kStages;
  using PipelineState = cutlass::PipelineState<kStages>;
  struct SharedStorage {
    uint64_t full_barrier_[kStages];
    uint64_t empty_barrier_[kStages];
  };
  enum class ThreadCategory { NonParticipant, Producer, Consumer, ProducerConsumer };
  struct Params {
    uint32_t transaction_bytes = 0;
    ThreadCategory role = ThreadCategory::NonParticipant;
    uint32_t is_leader = 0;
    uint32_t num_consumers = 0;
  };

  template <typename ClusterShape>
  PipelineTmaAsync(SharedStorage& storage, Params params, ClusterShape)
      : full_(storage.full_barrier_), empty_(storage.empty_barrier_), params_(params) {
    if (threadIdx.x / kWarpSize == 0 && threadIdx.x % kWarpSize == 0) {
      for (int s = 0; s < kStages; ++s) {
        TxBarrier::init(&full_[s], 1);
        TxBarrier::init(&empty_[s], params.num_consumers);
      }
    }
  }
  void producer_acquire(PipelineState state) {
    TxBarrier::wait(&empty_[state.index()], state.phase());
    if (params_.is_leader)
      TxBarrier::arrive_and_expect_tx(&full_[state.index()], params_.transaction_bytes);
  }
  uint64_t* producer_get_barrier(PipelineState state) { return &full_[state.index()]; }
  void producer_tail(PipelineState state) {
    for (int s = 0; s < kStages; ++s, ++state)
      TxBarrier::wait(&empty_[state.index()], state.phase());
  }
  void consumer_wait(PipelineState state) {
    TxBarrier::wait(&full_[state.index()], state.phase());
    TxBarrier::hold(&full_[state.index()], 1);
  }
  void consumer_release(PipelineState state) {
    TxBarrier::hold(&full_[state.index()], -1);
    TxBarrier::arrive(&empty_[state.index()]);
  }

 private:
  uint64_t* full_;
  uint64_t* empty_;
  Params params_;
};

// ---------------------------------------------------------------------------------------------
// Named barriers: bar.sync / bar.arrive id, count (the block's named barriers: cuda_emulation.h).
// ---------------------------------------------------------------------------------------------
struct NamedBarrier {
  // CUTLASS reserves the first ids; the kernels' ids come after them, as on a GPU.
  static constexpr uint32_t kReserved =
      static_cast<uint32_t>(cutlass::arch::ReservedNamedBarriers::FirstUserBarrier);
  static void sync(uint32_t threads, uint32_t id) {
    thread_synchronizes();
    g_block.named_barrier[checked(id)].arrive_counted(static_cast<int>(threads), true,
                                                      static_cast<int>(threadIdx.x));
  }
  static void arrive(uint32_t threads, uint32_t id) {
    thread_synchronizes();
    g_block.named_barrier[checked(id)].arrive_counted(static_cast<int>(threads), false,
                                                      static_cast<int>(threadIdx.x));
  }

 private:
  static uint32_t checked(uint32_t id) {
    if (id + kReserved >= kNamedBarriers)
      report_error("named barrier id " + std::to_string(id) + " past the hardware's 16");
    return (id + kReserved) % kNamedBarriers;
  }
};

// ---------------------------------------------------------------------------------------------
// TMA loads.
// ---------------------------------------------------------------------------------------------
struct TmaLoadOp {
  template <typename... Coords>
  static void copy(void const* desc, uint64_t* mbar, uint64_t /*cache_hint*/, void* smem,
                   Coords const&... coords) {
    static_assert(sizeof...(Coords) >= 1 && sizeof...(Coords) <= 5);
    TmaBox box{};
    std::memcpy(&box.map, desc, sizeof(box.map));
    const int32_t crd[sizeof...(Coords)] = {static_cast<int32_t>(coords)...};
    for (size_t d = 0; d < sizeof...(Coords); ++d) box.crd[d] = crd[d];
    if (sizeof...(Coords) != box.map.rank)
      report_error("TMA load: coordinates and map rank differ");
    box.dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    if (box.map.swizzle_bytes != 0 && box.dst % (8 * box.map.swizzle_bytes) != 0)
      report_error(
          "TMA load: a swizzled box's shared-memory address is not aligned to its pattern");
    TxBarrier::issue(mbar, box);
  }
};

// The operation the kernels name in make_tma_copy: CuTe builds SM90_TMA_LOAD's traits (the same
// descriptor and partitioning), and `with` gives the emulated executable copy.
struct TmaLoad : cute::SM90_TMA_LOAD {};

// ---------------------------------------------------------------------------------------------
// wgmma.
// ---------------------------------------------------------------------------------------------
template <typename Real>
struct Gmma : Real {};

// A wgmma operand's element (r, k) in shared memory from its descriptor (PTX ISA, "Matrix
// Descriptor Format"; CuTe's make_gmma_desc writes it): r is the M or N index, k the K index, of
// 16-bit elements. The canonical layouts, in 16-byte units (T = 8 elements):
//   K-major,  swizzled:  ((8, m), 2) : ((W, SBO), 1)        interleaved: ((8, m), 2) : ((1, SBO),
//   LBO) MN-major, swizzled:  ((W, m), (8, k)) : ((1, LBO), (W, SBO))
//             interleaved: ((1, m), (8, k)) : ((-, SBO), (1, LBO))
// with W the swizzle span in 16-byte chunks, then the swizzle of the byte address.
inline uint32_t operand_address(uint64_t desc, bool k_major, int r, int k) {
  const uint32_t start = static_cast<uint32_t>(desc & 0x3fffu) << 4;
  const uint32_t lbo = static_cast<uint32_t>((desc >> 16) & 0x3fffu);
  const uint32_t sbo = static_cast<uint32_t>((desc >> 32) & 0x3fffu);
  const uint32_t type = static_cast<uint32_t>(desc >> 62);  // 0 none, 1 128B, 2 64B, 3 32B
  const uint32_t span = type == 1 ? 128 : type == 2 ? 64 : type == 3 ? 32 : 0;
  const uint32_t w = span / 16;
  uint32_t chunk;  // in 16-byte units
  uint32_t within;
  if (k_major) {
    const uint32_t c = static_cast<uint32_t>(k) / 8;
    within = static_cast<uint32_t>(k % 8) * 2;
    chunk = span != 0 ? (r % 8) * w + (r / 8) * sbo + c : (r % 8) + (r / 8) * sbo + c * lbo;
  } else {
    const uint32_t c = static_cast<uint32_t>(r) / 8;
    within = static_cast<uint32_t>(r % 8) * 2;
    chunk = span != 0 ? (c % w) + (c / w) * lbo + (k % 8) * w + (k / 8) * sbo
                      : c * sbo + (k % 8) + (k / 8) * lbo;
  }
  return swizzle(start + chunk * 16 + within, span);
}

template <typename Frg>
struct OperandMajor;
template <cute::GMMA::Major kMajor>
struct OperandMajor<cute::GMMA::smem_desc<kMajor>> {
  static constexpr bool kK = kMajor == cute::GMMA::Major::K;
};

// The warpgroups' slots for a register A operand (8 16-bit values per thread), double-buffered as
// the warps' slots are, and for the shared-memory chunks of a wgmma's operands (one: a warpgroup's
// next wgmma starts after every thread has taken it).
struct WarpgroupSlots {
  alignas(16) unsigned char slot[2][128][16];
  uint64_t seq[2][128];
  std::shared_ptr<OperandRead> read;
};
inline WarpgroupSlots g_warpgroup_slots[kMaxBlockWarpgroups];

// The 128 threads of the calling thread's warpgroup at the same wgmma (reported otherwise).
inline int warpgroup_meet(const void* value, int bytes) {
  const int t = static_cast<int>(threadIdx.x), wg = t / 128;
  WarpgroupSlots& s = g_warpgroup_slots[wg];
  const uint64_t seq = t_group_seq++;
  const int buf = static_cast<int>(seq & 1);
  s.seq[buf][t % 128] = seq;
  if (bytes > 0) std::memcpy(s.slot[buf][t % 128], value, static_cast<size_t>(bytes));
  const int participants = g_block.warpgroup_barrier[wg].arrive_and_wait();
  if (participants != 128) {
    report_error("wgmma by thread " + std::to_string(t) + " while " +
                 std::to_string(128 - participants) + " thread(s) of its warpgroup have returned");
  }
  for (int u = 0; u < 128; ++u) {
    if (s.seq[buf][u] != seq) {
      report_error("divergent wgmma in warpgroup " + std::to_string(wg) + ": thread " +
                   std::to_string(t) + " at #" + std::to_string(seq) + ", thread " +
                   std::to_string(wg * 128 + u) + " at #" + std::to_string(s.seq[buf][u]));
      break;
    }
  }
  return buf;
}

// ---------------------------------------------------------------------------------------------
// Bulk reductions (cp.reduce.async.bulk .add.f32) and their groups, per thread. A reduction reads
// its shared memory at issue and adds it into global memory then (the blocks run one after
// another, so no other block adds at the same time); the thread's wait_group.read checks that the
// memory still holds what was read: a GPU may read it as late as that wait, so a write before it
// (a missing barrier between the consumers and the writer) would race with the reduction.
// ---------------------------------------------------------------------------------------------
struct BulkReduction {
  const float* src;
  std::vector<float> read;
};
inline AsyncGroups<BulkReduction> t_bulk;
inline const bool t_bulk_fiber_local = fibers::fiber_local(t_bulk);

inline void bulk_reduce_add(float* gmem, const float* smem, uint32_t bytes) {
  if (bytes % 16 != 0 || reinterpret_cast<uintptr_t>(gmem) % 16 != 0 ||
      __cvta_generic_to_shared(smem) % 16 != 0) {
    report_error("bulk reduction: size or addresses not multiples of 16 bytes");
    return;
  }
  async_read_unfenced(static_cast<uint32_t>(__cvta_generic_to_shared(smem)), bytes,
                      "a bulk reduction");
  const size_t n = bytes / sizeof(float);
  BulkReduction r{smem, std::vector<float>(smem, smem + n)};
  for (size_t e = 0; e < n; ++e) gmem[e] += r.read[e];
  t_bulk.issue(std::move(r));
}

inline void bulk_commit() { t_bulk.commit(); }

// The reductions a thread waited for with wait_group.read alone: read, their writes to global
// memory perhaps not yet done (the emulation adds at issue; a GPU may later).
inline size_t t_bulk_unwritten = 0;
inline const bool t_bulk_unwritten_fiber_local = fibers::fiber_local(t_bulk_unwritten);

inline void bulk_check_read(const BulkReduction& r) {
  if (std::memcmp(r.src, r.read.data(), r.read.size() * sizeof(float)) != 0) {
    report_error("bulk reduction: its shared memory at byte " +
                 std::to_string(__cvta_generic_to_shared(r.src)) +
                 " was written before the issuing thread's wait_group.read");
  }
}

inline void bulk_wait_read(int pending) {
  t_bulk.wait(pending, [](const BulkReduction& r) {
    bulk_check_read(r);
    ++t_bulk_unwritten;
  });
}

// cp.async.bulk.wait_group 0: every reduction of the thread complete, writes included.
inline void bulk_wait_all() {
  t_bulk.wait(0, bulk_check_read);
  t_bulk_unwritten = 0;
}

// The deterministic backward's turn counters (ops.cuh: wait_turn, pass_turn): cuda_emulation.h's
// check_turn.
inline void wait_turn(const int* turn, int value) { check_turn(turn, value); }
// Handing the turn on before the thread's reductions have written their sums would let the next
// block add before them.
inline void pass_turn(int* turn, int by) {
  if (t_bulk.outstanding() != 0 || t_bulk_unwritten != 0) {
    report_error(
        "turn: passed on before the thread's bulk reductions completed "
        "(cp.async.bulk.wait_group 0)");
  }
  if (by < 1) report_error("turn: handed on by " + std::to_string(by) + ", not a later block");
  *turn += by;
}

// ---------------------------------------------------------------------------------------------
// wgmma's asynchronous completion, per thread: an issued wgmma's results wait in t_pending (the
// latest value for each accumulator register, and the batch that writes it) while the register
// holds NaN; wgmma_commit closes the open batch, and wgmma_wait<N> writes the values of every
// committed batch but the newest N. A wgmma chained on a pending accumulator (the K steps of one
// batch, ScaleOut::One) takes the pending value as its input.
// ---------------------------------------------------------------------------------------------
struct PendingAccumulator {
  float value;
  uint64_t batch;
};
inline std::unordered_map<float*, PendingAccumulator> t_pending;
inline uint64_t t_open_batch = 0;          // the batch being issued
inline std::vector<uint64_t> t_committed;  // committed, not retired, oldest first
inline const bool t_wgmma_fiber_local = fibers::fiber_local(t_pending) &&
                                        fibers::fiber_local(t_open_batch) &&
                                        fibers::fiber_local(t_committed);

// At the end of each block (cuda_emulation.h: on_block_end): reports the wgmma batches and bulk
// reductions the thread left without a wait, and drops them.
inline void async_block_end() {
  if (!t_pending.empty() || !t_committed.empty() || t_bulk.outstanding() != 0) {
    report_error("thread " + std::to_string(threadIdx.x) +
                 " left a block with wgmma or bulk operations it did not wait for");
  }
  t_pending.clear(), t_committed.clear(), t_bulk.clear();
  t_bulk_unwritten = 0;
  t_reads.clear();
  t_open_batch = 0;
}
inline const bool g_async_checked = on_block_end(&async_block_end);

// The input of a wgmma for accumulator register `reg`: its pending value, or the register.
inline float accumulator_input(float* reg) {
  const auto it = t_pending.find(reg);
  return it != t_pending.end() ? it->second.value : *reg;
}

inline void issue_accumulator(float* reg, float value) {
  t_pending[reg] = {value, t_open_batch};
  *reg = std::numeric_limits<float>::quiet_NaN();
}

inline void wgmma_commit() { t_committed.push_back(t_open_batch++); }

inline void wgmma_wait(int pending) {
  if (static_cast<int>(t_committed.size()) <= pending) return;
  const uint64_t retired = t_committed[t_committed.size() - 1 - pending];
  t_committed.erase(t_committed.begin(), t_committed.end() - pending);
  for (auto it = t_pending.begin(); it != t_pending.end();) {
    if (it->second.batch <= retired) {
      *it->first = it->second.value;
      it = t_pending.erase(it);
    } else {
      ++it;
    }
  }
  for (auto it = t_reads.begin(); it != t_reads.end();) {
    if (it->first <= retired) {
      retire_read(*it->second);
      it = t_reads.erase(it);
    } else {
      ++it;
    }
  }
}

// The calling thread's wgmma of the open batch reads `read`.
inline void note_read(std::shared_ptr<OperandRead> read) {
  t_reads.emplace_back(t_open_batch, std::move(read));
}

// The operations of sm90/ops.cuh's Sm90Ops, emulated.
struct Ops {
  using TmaLoad = sm90::TmaLoad;
  template <typename Op>
  using Gmma = sm90::Gmma<Op>;
  template <int kStages>
  using Pipeline = PipelineTmaAsync<kStages>;
  using TxBarrier = sm90::TxBarrier;
  using NamedBarrier = sm90::NamedBarrier;
  struct CpAsync4 {
    static void copy(uint32_t const& src, uint32_t& dst) { cp_async_issue(&dst, &src, 4); }
  };
  // 4-byte cp.async that writes zeros where `read` is false.
  struct CpAsync4Zfill {
    static void copy(float const& src, float& dst, bool read) {
      const float value = read ? src : 0.f;
      cp_async_issue(&dst, &value, 4);
    }
  };
  static void cp_async_fence() { cp_async_commit(); }
  static void cp_async_wait_all() { cuda_emu::cp_async_wait_all(); }
  static int warp_group_idx() { return static_cast<int>(threadIdx.x) / 128; }
  static void prefetch_tma_descriptor(const cute::TmaDescriptor*) {}
  // A hint on the GPU; here a read of the byte, so that an address outside every allocation shows
  // (AddressSanitizer in the C++ suite; one past a buffer of the emulation's arena does not).
  static void prefetch_l1(const void* p) {
    [[maybe_unused]] const unsigned char byte = *static_cast<const volatile unsigned char*>(p);
  }
  static void wgmma_fence() {}
  static void wgmma_commit() { sm90::wgmma_commit(); }
  template <int kPending>
  static void wgmma_wait() {
    sm90::wgmma_wait(kPending);
  }
  template <typename V>
  static void store_shared(V* p, const V& v) {
    *p = v;
    generic_store(p, sizeof(V));
  }
  static void fence_view_async_shared() { fence_proxy_async(); }
  static void bulk_reduce_add(float* gmem, const float* smem, uint32_t bytes) {
    sm90::bulk_reduce_add(gmem, smem, bytes);
  }
  static void bulk_commit() { sm90::bulk_commit(); }
  template <int kPending>
  static void bulk_wait_read() {
    sm90::bulk_wait_read(kPending);
  }
  static void bulk_wait_all() { sm90::bulk_wait_all(); }
  static void wait_turn(const int* turn, int value) { sm90::wait_turn(turn, value); }
  static void pass_turn(int* turn, int by) { sm90::pass_turn(turn, by); }
};

}  // namespace cuda_emu::sm90

// The emulated operations have the real ones' traits.
namespace cute {
template <typename Real>
struct MMA_Traits<cuda_emu::sm90::Gmma<Real>> : MMA_Traits<Real> {};

// The executable emulated load: what SM90_TMA_LOAD's `with` gives, calling the emulated copy.
template <class NumBits>
struct Copy_Traits<cuda_emu::sm90::TmaLoadOp, NumBits>
    : TMA_LOAD_Unpack<cuda_emu::sm90::TmaLoadOp, NumBits> {
  using ThrID = Layout<_1>;
  using SrcLayout = Layout<Shape<_1, NumBits>>;
  using DstLayout = Layout<Shape<_1, NumBits>>;
  using RefLayout = SrcLayout;
  tuple<TmaDescriptor const*, uint64_t*, uint64_t> const opargs_;
  Copy_Traits(TmaDescriptor const* desc, uint64_t* mbar, uint64_t cache)
      : opargs_(desc, mbar, cache) {}
};

// The non-executable load as SM90_TMA_LOAD's, whose `with` gives the emulated executable one.
template <class NumBits, class Aux>
struct Copy_Traits<cuda_emu::sm90::TmaLoad, NumBits, Aux>
    : Copy_Traits<SM90_TMA_LOAD, NumBits, Aux> {
  using Base = Copy_Traits<SM90_TMA_LOAD, NumBits, Aux>;
  Copy_Traits(TmaDescriptor const& desc, Aux const& aux) : Base{desc, aux} {}
  Copy_Traits<cuda_emu::sm90::TmaLoadOp, NumBits> with(
      uint64_t& mbar, uint16_t const& = 0,
      TMA::CacheHintSm90 const& hint = TMA::CacheHintSm90::EVICT_NORMAL) const {
    return {&this->tma_desc_, &mbar, static_cast<uint64_t>(hint)};
  }
};

// One emulated wgmma (m64nNk16): D (+)= A B over the atom's K of 16, fp32 products added in k
// order. A from shared memory (its descriptor) or from the warpgroup's registers (gathered), B
// from shared memory.
template <class Real, class TD, class DLayout, class TA, class ALayout, class TB, class BLayout,
          class TC, class CLayout>
void mma_unpack(MMA_Traits<cuda_emu::sm90::Gmma<Real>> const& traits, Tensor<TD, DLayout>& D,
                Tensor<TA, ALayout> const& A, Tensor<TB, BLayout> const& B,
                Tensor<TC, CLayout> const&) {
  using namespace cuda_emu;
  using Traits = MMA_Traits<Real>;
  using Element = typename Traits::ValTypeA;
  static_assert(sizeof(Element) == 2, "the emulated wgmma takes 16-bit operands");
  constexpr int kM = size<0>(typename Traits::Shape_MNK{});
  constexpr int kN = size<1>(typename Traits::Shape_MNK{});
  constexpr bool kSsA = std::is_same_v<std::remove_cv_t<typename TA::value_type>, GmmaDescriptor>;
  static_assert(kM == 64 && size<2>(typename Traits::Shape_MNK{}) == 16);

  const int tid = static_cast<int>(threadIdx.x) % 128;
  // The register A operand of every thread, gathered (RS); with SS the meeting only orders.
  uint32_t a_regs[4] = {0, 0, 0, 0};
  if constexpr (!kSsA) {
    static_assert(decltype(size(A))::value == 8);
    for (int v = 0; v < 8; ++v) {
      const Element e = A(v);
      uint16_t bits;
      std::memcpy(&bits, &e, 2);
      a_regs[v / 2] |= static_cast<uint32_t>(bits) << (16 * (v % 2));
    }
  }
  const int buf = sm90::warpgroup_meet(a_regs, kSsA ? 0 : 16);
  // The rows of A this thread's results need (two of the 64), each decoded once: every one of the
  // 128 threads decoding all of A was most of the emulated wgmma's time.
  float a[64][16];
  bool have_row[64] = {};
  const auto a_row = [&](int m) -> const float* {
    if (!have_row[m]) {
      have_row[m] = true;
      if constexpr (kSsA) {
        const uint64_t desc = static_cast<uint64_t>(*A.data());
        constexpr bool kK = sm90::OperandMajor<typename Traits::FrgTypeA>::kK;
        for (int k = 0; k < 16; ++k) {
          Element e;
          std::memcpy(&e, g_sm90_smem + sm90::operand_address(desc, kK, m, k), 2);
          a[m][k] = static_cast<float>(e);
        }
      } else {
        // Which thread holds A(m, k), and as which of its values: ALayout inverted, once. Value v
        // of a thread is the 16-bit half v % 2 (low first) of its register v / 2.
        struct Holder {
          uint8_t thread, value;
        };
        static const auto holders = [] {
          std::array<std::array<Holder, 16>, 64> h{};
          for (int t = 0; t < 128; ++t)
            for (int v = 0; v < 8; ++v) {
              const int mk = typename Traits::ALayout{}(t, v);  // (m, k), m fastest
              h[mk % 64][mk / 64] = {static_cast<uint8_t>(t), static_cast<uint8_t>(v)};
            }
          return h;
        }();
        const auto& slots = sm90::g_warpgroup_slots[threadIdx.x / 128].slot[buf];
        for (int k = 0; k < 16; ++k) {
          const Holder w = holders[m][k];
          uint32_t reg;
          std::memcpy(&reg, slots[w.thread] + 4 * (w.value / 2), 4);
          const uint16_t bits = static_cast<uint16_t>(w.value % 2 ? reg >> 16 : reg & 0xffffu);
          a[m][k] = static_cast<float>(Element::bitcast(bits));
        }
      }
    }
    return a[m];
  };
  const uint64_t bdesc = static_cast<uint64_t>(*B.data());
  constexpr bool kKB = sm90::OperandMajor<typename Traits::FrgTypeB>::kK;
  // The operands' chunks, in flight until the wait (one thread records them for the warpgroup).
  if (tid == 0) {
    std::vector<uint32_t> chunks;
    for (int k = 0; k < 16; ++k) {
      if constexpr (kSsA) {
        const uint64_t desc = static_cast<uint64_t>(*A.data());
        constexpr bool kK = sm90::OperandMajor<typename Traits::FrgTypeA>::kK;
        for (int m = 0; m < 64; ++m)
          chunks.push_back(sm90::operand_address(desc, kK, m, k) / sm90::kChunkBytes);
      }
      for (int n = 0; n < kN; ++n)
        chunks.push_back(sm90::operand_address(bdesc, kKB, n, k) / sm90::kChunkBytes);
    }
    sm90::g_warpgroup_slots[threadIdx.x / 128].read = sm90::operand_read(std::move(chunks));
  }
  const bool zero = traits.accumulate_ == GMMA::ScaleOut::Zero;
  static_assert(decltype(size(D))::value == kN / 2);
  for (int v = 0; v < kN / 2; ++v) {
    const int mn = typename Traits::CLayout{}(tid, v);  // (m, n), m fastest
    const int m = mn % 64, n = mn / 64;
    const float* a_m = a_row(m);
    float acc = zero ? 0.f : sm90::accumulator_input(&D(v));
    for (int k = 0; k < 16; ++k) {
      Element e;
      std::memcpy(&e, g_sm90_smem + sm90::operand_address(bdesc, kKB, n, k), 2);
      acc += a_m[k] * static_cast<float>(e);
    }
    sm90::issue_accumulator(&D(v), acc);  // NaN until the wait retires the batch
  }
  // Every thread's reads of shared memory are done before any passes; the chunks stay in flight.
  sm90::warpgroup_meet(nullptr, 0);
  sm90::note_read(sm90::g_warpgroup_slots[threadIdx.x / 128].read);
}
}  // namespace cute

// The dynamic shared memory of the sm90 kernels (their `extern __shared__` arrays are declared in
// these namespaces).
namespace entropy_attn::cuda::sm90::fwd_impl {
alignas(4096) inline char ea_sm90_fwd_smem[cuda_emu::kSmemCapacity];
}  // namespace entropy_attn::cuda::sm90::fwd_impl
namespace entropy_attn::cuda::sm90::bwd_impl {
alignas(4096) inline char ea_sm90_bwd_smem[cuda_emu::kSmemCapacity];
}  // namespace entropy_attn::cuda::sm90::bwd_impl
