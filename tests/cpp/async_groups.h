// A thread's asynchronous operations in commit groups, as PTX counts them for cp.async
// (cp.async.commit_group / wait_group) and for the bulk copies (cp.async.bulk.commit_group /
// wait_group.read): the emulations of both (emulated_cp_async.h, emulated_sm90_ops.h) keep their
// records of issued operations in one of these, per thread.
#pragma once

#include <cstddef>
#include <deque>
#include <utility>
#include <vector>

namespace cuda_emu {

template <typename Op>
class AsyncGroups {
 public:
  // An operation issued: in the open group until the next commit.
  void issue(Op op) { open_.push_back(std::move(op)); }
  // commit_group: the open operations become the newest group (an empty one when none are open).
  void commit() {
    committed_.push_back(std::move(open_));
    open_.clear();
  }
  // wait_group N: every committed group but the newest `pending` completes, oldest first, each of
  // its operations through `complete`; the open operations do not.
  template <typename F>
  void wait(int pending, F&& complete) {
    while (static_cast<int>(committed_.size()) > pending) {
      for (Op& op : committed_.front()) complete(op);
      committed_.pop_front();
    }
  }
  // The operations not completed, committed or not.
  size_t outstanding() const {
    size_t n = open_.size();
    for (const std::vector<Op>& g : committed_) n += g.size();
    return n;
  }
  void clear() {
    open_.clear();
    committed_.clear();
  }
  // Without allocating (std::swap would move through a temporary, and moving a std::deque
  // allocates): the fiber scheduler swaps a thread's groups in and out at every switch (fibers.h).
  friend void swap(AsyncGroups& a, AsyncGroups& b) noexcept {
    a.open_.swap(b.open_);
    a.committed_.swap(b.committed_);
  }

 private:
  std::vector<Op> open_;
  std::deque<std::vector<Op>> committed_;  // oldest first
};

}  // namespace cuda_emu
