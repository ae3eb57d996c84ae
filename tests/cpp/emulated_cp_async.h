// cp.async for the CPU emulation (cuda_emulation.h), per thread, as both tensor-core families use
// it (their Ops: sm80/ops.cuh, sm90/ops.cuh). A copy reads its source at issue but writes its
// destination only when the issuing thread's wait retires the copy's group:
//   * cp_async_commit is cp.async.commit_group: it closes a group of the thread's copies;
//   * cp_async_wait_group(N) is cp.async.wait_group N: every committed group but the newest N
//     lands (copies not yet committed do not);
//   * cp_async_wait_all is cp.async.wait_all: commit, then wait for every group.
// Until it lands the destination holds NaN bytes (0xff), so that a read before the issuing
// thread's wait, by itself or by a thread that did not synchronize with it after that wait, shows
// up in the results. Each copy reports its write to the shared-memory hazard check (smem_access)
// twice, at issue and when it lands, so that another warp's access in the same barrier interval as
// either is a hazard. A thread that finishes a block with copies it did not wait for is reported.
// Include after cuda_emulation.h.
#pragma once

#include <cstring>
#include <string>
#include <vector>

#include "async_groups.h"
#include "cuda_emulation.h"

namespace cuda_emu {

struct PendingCopy {
  unsigned char* dst;
  int bytes;  // 4, 8 or 16
  unsigned char value[16];
};
inline AsyncGroups<PendingCopy> t_copies;  // per emulated thread (fibers.h)
inline const bool t_copies_fiber_local = fibers::fiber_local(t_copies);

// A cp.async of `bytes` bytes from src (global memory) to dst (shared memory).
inline void cp_async_issue(void* dst, const void* src, int bytes) {
  if (bytes != 4 && bytes != 8 && bytes != 16) {
    report_error("cp.async of " + std::to_string(bytes) + " bytes (4, 8 or 16 are valid)");
    return;
  }
  smem_access(dst, bytes, true, "cp.async (issue)");
  PendingCopy c{static_cast<unsigned char*>(dst), bytes, {}};
  std::memcpy(c.value, src, bytes);
  std::memset(dst, 0xff, bytes);
  t_copies.issue(c);
}

inline void cp_async_commit() { t_copies.commit(); }

inline void cp_async_wait_group(int pending) {
  t_copies.wait(pending, [](const PendingCopy& c) {
    smem_access(c.dst, c.bytes, true, "cp.async (landing)");
    std::memcpy(c.dst, c.value, c.bytes);
  });
}

inline void cp_async_wait_all() {
  cp_async_commit();
  cp_async_wait_group(0);
}

// At the end of each block (cuda_emulation.h: on_block_end).
inline void cp_async_block_end() {
  if (const size_t left = t_copies.outstanding(); left != 0) {
    report_error("thread " + std::to_string(threadIdx.x) + " of block (" +
                 std::to_string(blockIdx.x) + ", " + std::to_string(blockIdx.y) + ", " +
                 std::to_string(blockIdx.z) + ") left it with " + std::to_string(left) +
                 " cp.async copies it did not wait for");
  }
  t_copies.clear();
}
inline const bool g_cp_async_checked = on_block_end(&cp_async_block_end);

}  // namespace cuda_emu
