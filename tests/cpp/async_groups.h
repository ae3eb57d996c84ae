// A thread's asynchronous operations in commit groups, as PTX counts them for cp.async
// (cp.async.commit_group / wait_group) and for the bulk copies (cp.async.bulk.commit_group /
// wait_group.read): the emulations of both (emulated_cp_async.h, emulated_sm90_ops.h) keep their
// records of issued operations in one of these, per thread.
#pragma once

#include <cstddef>
#include <deque>
#include <memory>
#include <utility>
#include <vector>

namespace cuda_emu {

template <typename Op>
class AsyncGroups {
 public:
  // An operation issued: in the open group until the next commit.
  void issue(Op op) { s_->open.push_back(std::move(op)); }
  // commit_group: the open operations become the newest group (an empty one when none are open).
  void commit() {
    s_->committed.push_back(std::move(s_->open));
    s_->open.clear();
  }
  // wait_group N: every committed group but the newest `pending` completes, oldest first, each of
  // its operations through `complete`; the open operations do not.
  template <typename F>
  void wait(int pending, F&& complete) {
    while (static_cast<int>(s_->committed.size()) > pending) {
      for (Op& op : s_->committed.front()) complete(op);
      s_->committed.pop_front();
    }
  }
  // The operations not completed, committed or not.
  size_t outstanding() const {
    size_t n = s_->open.size();
    for (const std::vector<Op>& g : s_->committed) n += g.size();
    return n;
  }
  void clear() {
    s_->open.clear();
    s_->committed.clear();
  }
  // The fiber scheduler swaps a thread's groups in and out at every switch (fibers.h): the state
  // lives behind a pointer, so that a swap exchanges one word and allocates nothing. (Swapping the
  // containers themselves took some 60 loads and stores, each a call of the hazard check's hook in
  // the units compiled with it, cuda_emulation.cmake: a sixth of test_sm80_emulation's time.)
  friend void swap(AsyncGroups& a, AsyncGroups& b) noexcept { a.s_.swap(b.s_); }

 private:
  struct State {
    std::vector<Op> open;
    std::deque<std::vector<Op>> committed;  // oldest first
  };
  std::unique_ptr<State> s_ = std::make_unique<State>();
};

}  // namespace cuda_emu
