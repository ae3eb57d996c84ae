// The fibers of the CUDA emulation (fibers.h), on their own: each fiber keeps its copy of a
// fiber_local variable across waits, a wait ends when its counter moves, every fiber finishes, and
// a fiber starts with the launching thread's floating-point control (flush-to-zero here).
#include "fibers.h"

#include <gtest/gtest.h>
#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include <atomic>
#include <vector>

namespace {

int g_value = -1;
const bool g_value_is_fiber_local = cuda_emu::fibers::fiber_local(g_value);
std::atomic<uint32_t> g_round{0};

TEST(Fibers, EachFiberKeepsItsVariablesAcrossWaits) {
  ASSERT_TRUE(g_value_is_fiber_local);
  constexpr int kFibers = 96, kRounds = 5;
  std::vector<int> seen(kFibers, 0);
  int arrived = 0;
  cuda_emu::fibers::run(kFibers, [&](int i) {
    EXPECT_EQ(g_value, 0);  // value-initialized for every fiber of a run
    g_value = 1000 + i;
    for (int r = 0; r < kRounds; ++r) {
      const uint32_t round = g_round.load();
      if (++arrived == kFibers) {  // the last one to arrive releases the others
        arrived = 0;
        g_round.fetch_add(1);
      } else {
        cuda_emu::fibers::wait_while(g_round, round);
      }
      seen[static_cast<size_t>(i)] += g_value == 1000 + i;
    }
  });
  for (int i = 0; i < kFibers; ++i)
    EXPECT_EQ(seen[static_cast<size_t>(i)], kRounds) << "fiber " << i;
  EXPECT_EQ(g_value, -1);  // the launching thread's own copy
}

#if defined(__x86_64__)
TEST(Fibers, StartWithTheLaunchingThreadsFloatingPointControl) {
  const unsigned saved = _mm_getcsr();
  _mm_setcsr(saved | _MM_FLUSH_ZERO_ON);
  std::vector<unsigned> csr(4);
  cuda_emu::fibers::run(4, [&](int i) { csr[static_cast<size_t>(i)] = _mm_getcsr(); });
  _mm_setcsr(saved);
  for (unsigned c : csr) EXPECT_EQ(c & _MM_FLUSH_ZERO_MASK, unsigned{_MM_FLUSH_ZERO_ON});
}
#endif

}  // namespace
