// Cooperative fibers for the CPU emulation of CUDA thread blocks (cuda_emulation.h): the emulated
// threads of a launch run as fibers on the thread that launches it, and switch only where a CUDA
// thread can wait (a barrier, a warp-wide instruction, an mbarrier). One std::thread per emulated
// thread, as the emulation first had, spent most of its time in the kernel: every warp operation
// woke 32 threads through futexes on two cores (test_sm90_emulation: 109 s user and 61 s system
// time for 90 s of wall time, 32 million involuntary context switches); a fiber switch is a few
// register moves.
//
//   cuda_emu::fibers::run(n, body);            // body(i) for i in [0, n), each on its own fiber,
//                                              // until all return
//   cuda_emu::fibers::wait_while(gen, value);  // in a fiber: yield until `gen` differs from value
//
// The scheduler resumes the fibers round-robin, skipping those whose wait still holds (or, as a
// test asks with set_order, always the lowest- or highest-numbered fiber that can go on: a block
// whose threads miss a barrier may compute right in one order and not in another); when no
// fiber can go on it aborts with a message (the emulation's own deadlock check, in
// cuda_emulation.h, sees a block's deadlocks first and unwinds its threads). Variables that a CUDA
// thread would have one of (threadIdx, a thread's pending asynchronous copies) are ordinary globals
// registered with fiber_local: the scheduler swaps the running fiber's copies in and out, and gives
// every fiber a value-initialized copy at the start of a run. (It swaps contents, not objects: a
// reference to such a variable taken before a wait refers to whichever fiber's copy is swapped in
// after it. Take it again after a wait.)
//
// AddressSanitizer is told of every switch (its fiber annotations), so that it tracks the fiber's
// stack and not the launching thread's.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

// The stack switch: x86-64 assembly, or ucontext elsewhere (CUDA_EMU_FIBERS_UCONTEXT takes
// ucontext on x86-64 too, to test that path).
#if defined(__x86_64__) && !defined(CUDA_EMU_FIBERS_UCONTEXT)
#define CUDA_EMU_FIBERS_X86_64 1
#else
#include <ucontext.h>
#endif

// AddressSanitizer's interface (sanitizer/common_interface_defs.h), declared weak: null unless the
// executable runs under its runtime, whatever the flags of the unit that includes this header (the
// emulation's units differ, cuda_emulation.cmake, and must agree on this header's inline
// functions).
extern "C" {
void __sanitizer_start_switch_fiber(void** fake_stack_save, const void* bottom, size_t size)
    __attribute__((weak));
void __sanitizer_finish_switch_fiber(void* fake_stack_save, const void** bottom_old,
                                     size_t* size_old) __attribute__((weak));
void __asan_unpoison_memory_region(void const volatile* addr, size_t size) __attribute__((weak));
}

// The emulator's own code, where the units of the shared-memory hazard check are compiled with
// ThreadSanitizer's instrumentation as hooks (cuda_emulation.cmake: _ea_plain_access_hooks): left
// uninstrumented, its loads and stores being its bookkeeping (an emulated instruction reports the
// shared memory it touches itself). The hook calls of the emulated mma.sync alone took a third of
// test_sm80_emulation_features' time (perf). (g++ inlines no function across a difference of this
// attribute, so what such a function calls stays a call, instrumented where it has no attribute:
// the attribute goes where the loads and stores are.)
#define CUDA_EMU_NO_HOOKS __attribute__((no_sanitize("thread")))

namespace cuda_emu::fibers {

// ---------------------------------------------------------------------------------------------
// Per-fiber variables.
// ---------------------------------------------------------------------------------------------
class Locals {
 public:
  template <typename T>
  bool add(T& var) {
    vars_.push_back(std::make_unique<Var<T>>(var));
    return true;
  }
  // Every fiber of a run of n starts with value-initialized copies.
  void reset(int n) {
    for (auto& v : vars_) v->reset(n);
  }
  // Exchanges the globals with fiber i's copies (in before resuming it, out after).
  void swap(int i) {
    for (auto& v : vars_) v->swap(i);
  }

 private:
  struct Slot {
    virtual ~Slot() = default;
    virtual void reset(int n) = 0;
    virtual void swap(int i) = 0;
  };
  template <typename T>
  struct Var final : Slot {
    explicit Var(T& v) : var(v) {}
    void reset(int n) override {
      saved.clear();
      saved.resize(static_cast<size_t>(n));
      saved_data = saved.data();
    }
    CUDA_EMU_NO_HOOKS void swap(int i) override {
      T& mine = saved_data[i];
      if constexpr (std::is_trivially_copyable_v<T>) {
        // By bytes: std::swap would be a call, instrumented (above).
        unsigned char bytes[sizeof(T)];
        std::memcpy(bytes, &var, sizeof(T));
        std::memcpy(static_cast<void*>(&var), &mine, sizeof(T));
        std::memcpy(static_cast<void*>(&mine), bytes, sizeof(T));
      } else {
        using std::swap;
        swap(var, mine);
      }
    }
    T& var;
    std::vector<T> saved;
    T* saved_data = nullptr;  // saved.data(), read by swap without a call
  };
  std::vector<std::unique_ptr<Slot>> vars_;
};

inline Locals& locals() {
  static Locals l;  // a function's static: exists whatever the order of the headers' variables
  return l;
}

// Makes a global per fiber: `inline const bool registered = cuda_emu::fibers::fiber_local(var);`.
template <typename T>
bool fiber_local(T& var) {
  return locals().add(var);
}

// ---------------------------------------------------------------------------------------------
// Stacks and the switch.
// ---------------------------------------------------------------------------------------------
// As a std::thread's default stack: the host compilation of the kernels keeps their register tiles
// on it. Reserved, not committed (MAP_NORESERVE), with an inaccessible guard region below, so that
// an overflow faults (64 KB: a frame larger than a page could step over a single one).
constexpr size_t kStackBytes = size_t{8} << 20;
constexpr size_t kGuardBytes = size_t{64} << 10;
// The top of a stack that a new run unpoisons (Scheduler::start).
constexpr size_t kTopUnpoisoned = size_t{64} << 10;

struct Stack {
  unsigned char* base = nullptr;  // the guard region; the usable stack is above it

  Stack() {
    void* p = mmap(nullptr, kGuardBytes + kStackBytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
    if (p == MAP_FAILED || mprotect(p, kGuardBytes, PROT_NONE) != 0) {
      std::fprintf(stderr, "cuda_emulation: cannot map a fiber stack of %zu bytes\n", kStackBytes);
      std::abort();
    }
    base = static_cast<unsigned char*>(p);
  }
  ~Stack() { munmap(base, kGuardBytes + kStackBytes); }
  Stack(const Stack&) = delete;
  Stack& operator=(const Stack&) = delete;

  unsigned char* bottom() const { return base + kGuardBytes; }  // lowest usable address
  unsigned char* top() const { return base + kGuardBytes + kStackBytes; }
};

#if defined(CUDA_EMU_FIBERS_X86_64)
// Pushes the callee-saved registers and the floating-point control words (SysV x86-64 ABI) on the
// current stack, stores the stack pointer to *from, switches to `to` and pops what was pushed
// there.
[[gnu::naked, gnu::noinline]] inline void switch_stack(void** /*from: rdi*/, void* /*to: rsi*/) {
  asm("pushq %rbp\n\t"
      "pushq %rbx\n\t"
      "pushq %r12\n\t"
      "pushq %r13\n\t"
      "pushq %r14\n\t"
      "pushq %r15\n\t"
      "subq $8, %rsp\n\t"
      "stmxcsr (%rsp)\n\t"
      "fnstcw 4(%rsp)\n\t"
      "movq %rsp, (%rdi)\n\t"
      "movq %rsi, %rsp\n\t"
      "ldmxcsr (%rsp)\n\t"
      "fldcw 4(%rsp)\n\t"
      "addq $8, %rsp\n\t"
      "popq %r15\n\t"
      "popq %r14\n\t"
      "popq %r13\n\t"
      "popq %r12\n\t"
      "popq %rbx\n\t"
      "popq %rbp\n\t"
      "ret\n\t");
}
struct Context {
  void* sp = nullptr;
};
#else
struct Context {
  ucontext_t uc;
};
#endif

// ---------------------------------------------------------------------------------------------
// The scheduler.
// ---------------------------------------------------------------------------------------------
// Which fiber that can go on runs next: after the one that ran last, in turn (the default); or the
// lowest-numbered, or the highest-numbered, so that one warp or warpgroup runs as far as it can
// before the others start, as a GPU may schedule it.
enum class Order { kRoundRobin, kLowestFirst, kHighestFirst };

class Scheduler {
 public:
  void set_order(Order order) { order_ = order; }

  // Runs body(i) for i in [0, n) on n fibers of this thread until every one returns. One run at a
  // time (the emulation's launches take a mutex: cuda_emulation.h, g_launch_mutex); a run from a
  // fiber aborts.
  void run(int n, const std::function<void(int)>& body) {
    if (body_ != nullptr) {
      std::fprintf(stderr, "cuda_emulation: a launch while another one runs\n");
      std::abort();
    }
    while (static_cast<int>(stacks_.size()) < n) stacks_.push_back(std::make_unique<Stack>());
    fibers_.assign(static_cast<size_t>(n), Fiber{});
    body_ = &body;
    locals().reset(n);
    for (int i = 0; i < n; ++i) start(i);
    int last = n - 1, alive = n;
    while (alive > 0) {
      int next = -1;
      for (int k = 1; k <= n; ++k) {
        const int i = order_ == Order::kRoundRobin    ? (last + k) % n
                      : order_ == Order::kLowestFirst ? k - 1
                                                      : n - k;
        const Fiber& f = fibers_[static_cast<size_t>(i)];
        if (!f.done && (f.waits_on == nullptr ||
                        f.waits_on->load(std::memory_order_relaxed) != f.wait_value)) {
          next = i;
          break;
        }
      }
      if (next < 0) {
        std::fprintf(stderr,
                     "cuda_emulation: %d emulated thread(s) wait and none can go on (a wait the "
                     "deadlock check does not see)\n",
                     alive);
        std::abort();
      }
      last = next;
      resume(next);
      if (fibers_[static_cast<size_t>(next)].done) --alive;
    }
    body_ = nullptr;
  }

  // In a fiber: yields to the scheduler until `gen` no longer holds `value`.
  void wait_while(const std::atomic<uint32_t>& gen, uint32_t value) {
    if (current_ < 0) {
      std::fprintf(stderr, "cuda_emulation: a barrier wait outside an emulated thread\n");
      std::abort();
    }
    while (gen.load(std::memory_order_acquire) == value) {
      Fiber& f = fibers_[static_cast<size_t>(current_)];
      f.waits_on = &gen;
      f.wait_value = value;
      yield();
      f.waits_on = nullptr;
    }
  }

 private:
  struct Fiber {
    Context ctx;
    bool done = false;
    const std::atomic<uint32_t>* waits_on = nullptr;
    uint32_t wait_value = 0;
  };

  // Fiber i's stack, set up to enter trampoline() at its first resume.
  void start(int i) {
    const Stack& s = *stacks_[static_cast<size_t>(i)];
    // A previous run's fiber left its last frames (trampoline, yield, switch_to: it never returned
    // from them) at the top of the stack, with AddressSanitizer's redzones around their locals
    // still poisoned; every deeper frame returned, or was unwound by an exception, before which
    // the runtime unpoisons the stack it was told of at the switch. So the top suffices, and is
    // much cheaper than the whole stack at every launch (its shadow is an eighth of it).
    if (__asan_unpoison_memory_region != nullptr)
      __asan_unpoison_memory_region(s.top() - kTopUnpoisoned, kTopUnpoisoned);
    Fiber& f = fibers_[static_cast<size_t>(i)];
#if defined(CUDA_EMU_FIBERS_X86_64)
    // From the top: trampoline's (never used) return address at an address that is 8 mod 16, as
    // after a call; below it the address switch_stack's `ret` jumps to, six registers and the
    // control words, the launching thread's (as a new thread inherits its creator's).
    uint32_t mxcsr = 0;
    uint16_t x87_control = 0;
    asm volatile("stmxcsr %0" : "=m"(mxcsr));
    asm volatile("fnstcw %0" : "=m"(x87_control));
    auto* top = reinterpret_cast<uint64_t*>(reinterpret_cast<uintptr_t>(s.top()) & ~uintptr_t{15});
    uint64_t* sp = top - 1;
    *sp = 0;
    *--sp = reinterpret_cast<uint64_t>(&Scheduler::trampoline);
    for (int r = 0; r < 6; ++r) *--sp = 0;
    *--sp = mxcsr | (uint64_t{x87_control} << 32);
    f.ctx.sp = sp;
#else
    getcontext(&f.ctx.uc);
    f.ctx.uc.uc_stack.ss_sp = s.bottom();
    f.ctx.uc.uc_stack.ss_size = kStackBytes;
    f.ctx.uc.uc_link = nullptr;
    makecontext(&f.ctx.uc, &Scheduler::trampoline, 0);
#endif
  }

  void resume(int i) {
    const Stack& s = *stacks_[static_cast<size_t>(i)];
    locals().swap(i);
    current_ = i;
    void* fake_stack = nullptr;
    if (__sanitizer_start_switch_fiber != nullptr)
      __sanitizer_start_switch_fiber(&fake_stack, s.bottom(), kStackBytes);
    switch_to(&scheduler_, &fibers_[static_cast<size_t>(i)].ctx);
    if (__sanitizer_finish_switch_fiber != nullptr)
      __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
    current_ = -1;
    locals().swap(i);
  }

  // From the running fiber to the scheduler (for good when the fiber is done: no fake stack kept).
  void yield() {
    Fiber& f = fibers_[static_cast<size_t>(current_)];
    void* fake_stack = nullptr;
    if (__sanitizer_start_switch_fiber != nullptr)
      __sanitizer_start_switch_fiber(f.done ? nullptr : &fake_stack, scheduler_stack_bottom_,
                                     scheduler_stack_size_);
    switch_to(&f.ctx, &scheduler_);
    if (__sanitizer_finish_switch_fiber != nullptr)
      __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
  }

  static void switch_to(Context* from, Context* to) {
#if defined(CUDA_EMU_FIBERS_X86_64)
    switch_stack(&from->sp, to->sp);
#else
    swapcontext(&from->uc, &to->uc);
#endif
  }

  // A fiber's first frame: runs the body, then leaves for good. (noexcept: an exception that
  // escapes a kernel ends the process, as it ended the std::thread that ran it.)
  static void trampoline() noexcept;

  std::vector<std::unique_ptr<Stack>> stacks_;  // kept from run to run
  std::vector<Fiber> fibers_;
  Order order_ = Order::kRoundRobin;
  Context scheduler_;
  const std::function<void(int)>* body_ = nullptr;
  int current_ = -1;
  // The launching thread's stack, which AddressSanitizer reports at a fiber's first switch.
  const void* scheduler_stack_bottom_ = nullptr;
  size_t scheduler_stack_size_ = 0;

  friend Scheduler& scheduler();
};

inline Scheduler& scheduler() {
  static Scheduler s;
  return s;
}

inline void Scheduler::trampoline() noexcept {
  Scheduler& s = scheduler();
  if (__sanitizer_finish_switch_fiber != nullptr)
    __sanitizer_finish_switch_fiber(nullptr, &s.scheduler_stack_bottom_, &s.scheduler_stack_size_);
  const int i = s.current_;
  (*s.body_)(i);
  s.fibers_[static_cast<size_t>(i)].done = true;
  s.yield();
  std::abort();  // never resumed
}

inline void run(int n, const std::function<void(int)>& body) { scheduler().run(n, body); }
// The order of the runs that follow (Order::kRoundRobin until set).
inline void set_order(Order order) { scheduler().set_order(order); }
inline void wait_while(const std::atomic<uint32_t>& gen, uint32_t value) {
  scheduler().wait_while(gen, value);
}

}  // namespace cuda_emu::fibers
