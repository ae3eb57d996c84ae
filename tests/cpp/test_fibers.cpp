// The fibers of the CUDA emulation (fibers.h), on their own: each fiber keeps its copy of a
// fiber_local variable across waits, a wait ends when its counter moves, every fiber finishes, and
// a fiber starts with the launching thread's floating-point control (flush-to-zero here), and the
// scheduler's three orders resume the fibers as they say.
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

// Four fibers note their number and meet (the last to arrive goes on) twice, then note it again:
// the order of the notes is the scheduler's.
std::vector<int> notes_in(cuda_emu::fibers::Order order) {
  cuda_emu::fibers::set_order(order);
  std::vector<int> notes;
  std::atomic<uint32_t> gen{0};
  int arrived = 0;
  cuda_emu::fibers::run(4, [&](int i) {
    for (uint32_t meet = 0; meet < 2; ++meet) {
      notes.push_back(i);
      if (++arrived == 4) {
        arrived = 0;
        gen.fetch_add(1);
      } else {
        cuda_emu::fibers::wait_while(gen, meet);
      }
    }
    notes.push_back(i);
  });
  cuda_emu::fibers::set_order(cuda_emu::fibers::Order::kRoundRobin);
  return notes;
}

TEST(Fibers, ResumeInTheOrderAsked) {
  using cuda_emu::fibers::Order;
  // Round-robin: the last to arrive goes on, then the others in turn after it.
  EXPECT_EQ(notes_in(Order::kRoundRobin), (std::vector<int>{0, 1, 2, 3, 3, 0, 1, 2, 2, 3, 0, 1}));
  EXPECT_EQ(notes_in(Order::kLowestFirst), (std::vector<int>{0, 1, 2, 3, 3, 0, 1, 2, 2, 0, 1, 3}));
  EXPECT_EQ(notes_in(Order::kHighestFirst), (std::vector<int>{3, 2, 1, 0, 0, 3, 2, 1, 1, 3, 2, 0}));
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
