// Keys converted by the thread that reads them, shared by the CPU forward (attention_fwd.cpp) and
// the sparsity op (attention_sparsity.cpp): instead of a converted copy of the whole of K (K^T in
// the accumulation type, for the block products), each thread converts the keys of the (batch,
// key/value head) its tasks read into buffers of its own, as far as its query tiles reach.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <memory>

#include "../attention_inputs.h"

namespace entropy_attn::cpu {

// Whether the threads convert their own keys: where there are at least as many (batch, key/value
// head) pairs as threads, so that the threads' buffers (one pair's keys each) hold no more than
// one copy of the whole. With fewer (MQA on many threads) several threads would convert the same
// keys, and one whole copy made before the tasks takes less memory and time.
inline bool threads_convert_keys(const AttentionShape& sh) {
  return sh.batch * sh.kv_heads >= at::get_num_threads();
}

// n values of T left uninitialized (std::make_unique would zero them; make_unique_for_overwrite
// is C++20, and the extension also builds as C++17 against older torch releases). Buffers sized
// for all Lk keys are left so: a window reads a few of a long cache's keys, and only those are
// written and their pages touched.
template <typename T>
std::unique_ptr<T[]> uninitialized(int64_t n) {
  return std::unique_ptr<T[]>(new T[n]);
}

// Which keys of which (batch, key/value head) a thread's buffers hold: one range [lo, hi).
// at::parallel_for hands each thread a contiguous run of tasks, ordered by (batch, head, query
// tile), so a thread meets each (batch, key/value head) once and converts its keys once, widening
// the range as its tiles reach further keys (down too: a run may start inside a head, on a tile
// whose keys begin above those of the next head's first tile).
struct ConvertedKeys {
  int64_t b = -1, kvh = -1, lo = 0, hi = 0;

  // Makes keys [from, to) of (b, kvh) held, calling convert(first, end) for each run of them not
  // held yet (a new (batch, key/value head) starts an empty range at `from`).
  template <typename Convert>
  void cover(int64_t b_, int64_t kvh_, int64_t from, int64_t to, const Convert& convert) {
    if (b_ != b || kvh_ != kvh) b = b_, kvh = kvh_, lo = hi = from;
    if (to <= from) return;
    // (one range: a task reaching below it or beyond converts the keys in between too)
    if (from < lo) convert(from, lo), lo = from;
    if (to > hi) convert(hi, to), hi = to;
  }
};

}  // namespace entropy_attn::cpu
