// CPU forward of the fused attention with per-row statistics (FlashAttention-2 structure):
// tasks are (batch, head, query block); each streams key/value blocks of kKvBlock keys, keeping the
// online statistics of online_stats.h per row. No L_q x L_k buffer is ever formed.
// The products read K transposed (and 16-bit K and V converted to float, or packed in bfloat16
// pairs): each thread converts the keys of the (batch, key/value head) its tasks read into its own
// buffers, once for the run of tasks it is handed (KeySource::kThread), so that no input is copied
// whole; where there are fewer (batch, key/value head) pairs than threads, whose buffers would hold
// more than one copy, they are converted whole before the tasks (kWhole); and decoding-like calls
// whose keys are read by one task each convert block by block (kPerBlock).
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <memory>
#include <type_traits>
#include <vector>

#include "../attention_call.h"
#include "attention_cpu.h"
#include "bf16_products.h"
#include "block_gemm.h"
#include "hidden_nonfinite.h"
#include "row_kernels.h"
#include "thread_keys.h"

namespace entropy_attn::cpu {
namespace {

// Whether the forward transposes each key block as it streams it rather than all of K up front:
// when each key/value head's keys are read by one task, a transposed copy of the whole cache is a
// pass into fresh memory that no other task reuses. So with no GQA group, and one query block per
// head (KV-cache decoding, where GQA packs a group's heads into one block: 4.8x SDPA's time for one
// token against 2048 cached keys, 32 heads, 17 of its 23 ms in the copy), or packed documents
// short enough to be mostly one tile each, a tile reading its own document's keys (256 causal
// documents of 16-64 tokens: the copy took a fifth of the call).
inline bool transposes_key_blocks(const AttentionShape& sh, const KeyPattern& pattern) {
  if (sh.group() != 1) return false;
  return sh.q_len <= q_block_size(sh.q_len, false) ||
         sh.q_len <= q_block_size(sh.q_len, true) * pattern.documents;
}

// Up to this many query rows (one decoding token per head, or the heads of a GQA group packed as
// rows), a transposing forward computes its scores as dot products with the key rows as stored
// (key_row_scores) rather than a block product against a transposed copy of the block: the copy
// cost more than the product (one token, 32 heads, 2048 keys, float32: 6.35 ms -> 2.3 ms; at 16
// rows the block product was faster, 7.8 ms against 9-11 for the dot products).
constexpr int64_t kKeyRowScoreRows = 8;

// Where the forward's tasks find K^T and V (and with bfloat16 products, K^T and V in pairs).
enum class KeySource {
  kWhole,     // converted whole before the tasks (FwdArgs: kt, v, pairs)
  kThread,    // converted by each thread into its buffers (ThreadKeys), from FwdArgs::key, value
  kPerBlock,  // converted a key block at a time (transposes_key_blocks)
};

// Where the forward multiplies bfloat16 operands as they are (bf16_products.h): Q as given
// (FwdArgs), K^T and V in pairs: whole (KeySource::kWhole), or packed by the tasks from
// FwdArgs::key, value.
struct PairOperands {
  bool on = false;
  PairedOperand kt, v;  // whole
};

template <typename acc_t>
struct FwdArgs {
  AttentionShape shape;
  // Q as given, read a query block at a time (converted to acc_t without bfloat16 products).
  RawOperand q;
  KeySource keys;
  // 16-bit inputs on float products: K and V converted to acc_t (whole, or by the tasks).
  bool widen;
  // K and V as given (a unit last stride) where the tasks convert them: K with kThread, and with
  // kPerBlock for 16-bit inputs; V where it is 16-bit and not converted whole; both with bfloat16
  // products. (Decoding converts its blocks as they stream: a conversion of the whole cache costs
  // as much as the copy the per-block path avoids; bfloat16 decoding took 3.8x SDPA's time.)
  RawOperand key, value;
  // The call's key_rows, or null (key j is row j): with it the tasks read key j from row
  // key_rows[j] of `key` and `value`, a paged KV cache's pool, where it lies (KeySource kPerBlock
  // or kThread): a few rows' products of float inputs through row pointers, the rest converting
  // the rows (`widen` also for float inputs).
  const int64_t* key_rows;
  // kt: K^T (B, Hkv, D, Lk) in acc_t (kWhole); k: K as given (kPerBlock, float inputs).
  Strided4<acc_t> kt, k;
  // V in acc_t: as given for float inputs, converted whole for 16-bit ones with kWhole.
  Strided4<acc_t> v;
  PairOperands pairs;
  // The rows of `v`, or of pairs.v, holding a NaN or an infinity; v's are left to the tasks, a
  // block at a time, with scan_v_per_block.
  NonFiniteRows v_nonfinite;
  bool scan_v_per_block;
  MaskArg<acc_t> mask;
  ScalePolicy<acc_t> scale;
  KeyPattern pattern;
  Softcap<acc_t> softcap;
  const acc_t* sinks;  // (H,), or null
  Dropout<acc_t> dropout;
  // Outputs: out (B, H, Lq, Dv), in the input type and the query's layout
  // (allocate_attention_outputs), each row accumulated in acc_t and rounded once; the rest
  // (B, H, Lq), contiguous.
  RawOperand out;
  acc_t *lse, *entropy, *sum_p2, *max_weight, *row_scale, *length_factor;
  int64_t* n_keys;
  // The statistics (null without return_stats): entropy, sum_p2, max_weight above and these.
  acc_t *normalized_entropy, *sparsity, *effective_keys;
  bool with_stats;
};

// The keys of one (batch, key/value head) converted by a thread (KeySource::kThread; which keys:
// `held`, thread_keys.h), key j at column j of K^T and row j of V: K^T (D x Lk) and, for 16-bit
// inputs, V (Lk x Dv) in acc_t with the flags of its non-finite rows; or K^T and V in bfloat16
// pairs (held from an even key to an even one, or Lk) with V's flags. The buffers are sized for
// all Lk keys, left uninitialized but for the zeros after K^T's pairs.
template <typename acc_t>
struct ThreadKeys {
  ConvertedKeys held;
  std::unique_ptr<acc_t[]> kt, v;
  std::unique_ptr<c10::BFloat16[]> kt16, v16;
  std::unique_ptr<uint8_t[]> v_flags;
  int64_t ld_kt16 = 0, ld_v16 = 0;
};

// One (batch, key/value head)'s keys as a task reads them: key j at column j of K^T (kt, or kt16
// in pairs) and row j of V (v or v16), with the flags of V's non-finite rows (null: none).
template <typename acc_t>
struct TaskKeys {
  const acc_t *kt = nullptr, *v = nullptr;
  int64_t ld_kt = 0, ld_v = 0;
  const c10::BFloat16 *kt16 = nullptr, *v16 = nullptr;
  int64_t ld_kt16 = 0, ld_v16 = 0;
  const uint8_t* v_flags = nullptr;
  // v is FwdArgs::v, whose rows no one has flagged (FwdArgs::scan_v_per_block): each block's are,
  // just before its product.
  bool scan_v = false;
};

// A thread's buffers: scores of one block (rows x key_block_capacity), the output accumulator
// (rows x Dv), the per-row state, scratch for a value block with non-finite rows, its keys
// (ThreadKeys), and (allocated at first use) where transposes_key_blocks a key block transposed
// (D x key_block_capacity), or for few rows of 16-bit keys converted as stored
// (key_block_capacity x D).
template <typename acc_t>
struct FwdBuffers {
  std::vector<acc_t> s, o, scratch, kt, v;         // v: a value block converted from 16 bits
  std::vector<acc_t> q;                            // the block's query rows (rows x D), in acc_t
  std::vector<const acc_t*> key_ptrs, value_ptrs;  // a block's rows in a pool (key_rows)
  std::vector<uint8_t> v_flags;                    // its non-finite rows
  // With bfloat16 products: P in pairs' order (rows x an even number of keys), and where
  // transposes_key_blocks the block's K^T and V in pairs.
  std::vector<c10::BFloat16> p16, kt16, v16;
  std::vector<RowSetup<acc_t>> setup;
  std::vector<RowStats<acc_t>> stats;
  ThreadKeys<acc_t> keys;
  int64_t rows;  // the most rows a task has
  FwdBuffers(int64_t rows, const AttentionShape& sh)
      : s(rows * key_block_capacity(sh)),
        o(rows * sh.v_head_dim),
        setup(rows),
        stats(rows),
        rows(rows) {}
};

// The scores of key block [j0, j0 + n) by a bfloat16 product (PairOperands): S = Q K^T into buf.s
// (rows x n), K^T's block taken from the packed operand (whole, or the thread's), or packed here.
template <typename acc_t>
void pair_scores(const FwdArgs<acc_t>& a, FwdBuffers<acc_t>& buf, const TaskKeys<acc_t>& keys,
                 int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t j0, int64_t n) {
  if constexpr (std::is_same_v<acc_t, float>) {
    const AttentionShape& sh = a.shape;
    const int64_t kvh = h / sh.group(), D = sh.head_dim;
    const auto* q = a.q.template row<c10::BFloat16>(b, h, i0);
    const c10::BFloat16* kt = nullptr;
    int64_t ldb = 0;
    if (a.keys == KeySource::kPerBlock) {
      const auto* k = a.key.template row<c10::BFloat16>(b, kvh, j0);
      ldb = pair_row_length(n);
      pack_transposed_pairs(n, D, k, a.key.sl, buf.kt16.data(), ldb);
      kt = buf.kt16.data();
    } else {
      kt = keys.kt16 + 2 * j0, ldb = keys.ld_kt16;  // key j0's first pair
    }
    bf16_gemm(rows, n, D, q, a.q.sl, kt, ldb, buf.s.data(), n, false);
  } else {
    TORCH_INTERNAL_ASSERT(false, "bfloat16 products accumulate in float");
  }
}

// O += P V for key block [j0, j0 + n) by a bfloat16 product, P (buf.s) rounded to bfloat16 in
// pairs' order and V's block taken from the packed operand (whole, or the thread's), or packed
// here. A block whose values hold a NaN or an infinity goes through the float product that adds
// them to the rows that see them only (hidden_nonfinite.h), its values widened.
template <typename acc_t, typename Sees>
void pair_values(const FwdArgs<acc_t>& a, FwdBuffers<acc_t>& buf, const TaskKeys<acc_t>& keys,
                 int64_t b, int64_t h, int64_t rows, int64_t j0, int64_t n, const Sees& sees) {
  if constexpr (std::is_same_v<acc_t, float>) {
    const AttentionShape& sh = a.shape;
    const int64_t kvh = h / sh.group(), Dv = sh.v_head_dim;
    const int64_t n2 = n + n % 2;  // keys in whole pairs
    const c10::BFloat16* v = nullptr;
    const int64_t ldb = pair_row_length(Dv);
    const uint8_t* flags = nullptr;
    int64_t checked = n;  // the keys whose values the product reads with a weight
    if (a.keys == KeySource::kPerBlock) {
      const auto* rows16 = a.value.template row<c10::BFloat16>(b, kvh, j0);
      pack_row_pairs(n, Dv, rows16, a.value.sl, buf.v16.data(), ldb, buf.v_flags.data());
      v = buf.v16.data(), flags = buf.v_flags.data();
    } else {
      // The operand pairs key j0 + n with an odd block's last key: its weight is 0, but 0 * inf
      // is not.
      v = keys.v16 + j0 * keys.ld_v16;
      flags = keys.v_flags ? keys.v_flags + j0 : nullptr;
      checked = std::min(n2, sh.kv_len - j0);
    }
    if (any_flagged(flags, checked)) {
      load_rows(a.value, b, kvh, j0, n, Dv, buf.v.data(), Dv, /*transposed=*/false, a.key_rows);
      product_seen_rows_of_b<float>(rows, Dv, n, buf.s.data(), n, buf.v.data(), Dv, buf.o.data(),
                                    Dv, true, flags, buf.scratch, sees);
      return;
    }
    round_rows_to_pairs(rows, n, buf.s.data(), n, buf.p16.data());
    bf16_gemm(rows, Dv, n2, buf.p16.data(), n2, v, ldb, buf.o.data(), Dv, true);
  } else {
    TORCH_INTERNAL_ASSERT(false, "bfloat16 products accumulate in float");
  }
}

// Keys [from, to) of the thread's (batch, key/value head) converted into its buffers
// (ThreadKeys; with pairs from even, to even or Lk).
template <typename acc_t>
void convert_keys(const FwdArgs<acc_t>& a, ThreadKeys<acc_t>& t, int64_t b, int64_t kvh,
                  int64_t from, int64_t to) {
  const int64_t D = a.shape.head_dim, Dv = a.shape.v_head_dim, n = to - from;
  if (a.pairs.on) {
    transpose_pairs(n, D, a.key.template row<c10::BFloat16>(b, kvh, from), a.key.sl,
                    t.kt16.get() + 2 * from, t.ld_kt16);
    pack_row_pairs(n, Dv, a.value.template row<c10::BFloat16>(b, kvh, from), a.value.sl,
                   t.v16.get() + from * t.ld_v16, t.ld_v16, t.v_flags.get() + from);
    return;
  }
  load_rows(a.key, b, kvh, from, n, D, t.kt.get() + from, a.shape.kv_len,
            /*transposed=*/true, a.key_rows);
  if (a.widen) {
    acc_t* v = t.v.get() + from * Dv;
    load_rows(a.value, b, kvh, from, n, Dv, v, Dv, /*transposed=*/false, a.key_rows);
    for (int64_t j = 0; j < n; ++j) t.v_flags[from + j] = has_nonfinite(v + j * Dv, Dv);
  }
}

// The keys of (b, kvh) for a task that reads keys [lo, hi) of them (lo even with pairs): from the
// whole operands, or converted into the thread's buffers as far as they are not there yet.
template <typename acc_t>
TaskKeys<acc_t> task_keys(const FwdArgs<acc_t>& a, ThreadKeys<acc_t>& t, int64_t b, int64_t kvh,
                          int64_t lo, int64_t hi) {
  const AttentionShape& sh = a.shape;
  const int64_t D = sh.head_dim, Dv = sh.v_head_dim, Lk = sh.kv_len;
  TaskKeys<acc_t> k;
  const bool pairs = a.pairs.on;
  if (a.keys == KeySource::kPerBlock) {  // (only float values are read as given)
    if (!pairs && !a.widen) {
      k.v = a.v.at(b, kvh), k.ld_v = a.v.sl, k.v_flags = a.v_nonfinite.at(b, kvh);
      k.scan_v = a.scan_v_per_block;
    }
    return k;
  }
  if (a.keys == KeySource::kWhole) {
    if (pairs) {
      k.kt16 = a.pairs.kt.at(b, kvh), k.ld_kt16 = a.pairs.kt.ld;
      k.v16 = a.pairs.v.at(b, kvh), k.ld_v16 = a.pairs.v.ld;
    } else {
      k.kt = a.kt.at(b, kvh), k.ld_kt = a.kt.sl, k.v = a.v.at(b, kvh), k.ld_v = a.v.sl;
      k.scan_v = a.scan_v_per_block;
    }
    k.v_flags = a.v_nonfinite.at(b, kvh);
    return k;
  }
  if (!t.kt && !t.kt16) {  // (the thread's first task: every unit reuses them)
    const int64_t L2 = Lk + Lk % 2;
    if (pairs) {
      t.ld_kt16 = pair_row_length(Lk), t.ld_v16 = pair_row_length(Dv);
      t.kt16 = uninitialized<c10::BFloat16>(D * t.ld_kt16 + kPairSlack);
      t.v16 = uninitialized<c10::BFloat16>(L2 * t.ld_v16 + kPairSlack);
      t.v_flags = uninitialized<uint8_t>(L2);
      // (K^T's columns after the last key, which no conversion writes, and the slack: zeros;
      // pack_row_pairs writes V's padding with its rows)
      c10::BFloat16* kt16 = t.kt16.get();
      for (int64_t d = 0; d < D; d += 2) {
        std::fill(kt16 + d * t.ld_kt16 + 2 * Lk, kt16 + (d + 2) * t.ld_kt16, c10::BFloat16(0.f));
      }
      std::fill_n(kt16 + D * t.ld_kt16, kPairSlack, c10::BFloat16(0.f));
      std::fill_n(t.v16.get() + L2 * t.ld_v16, kPairSlack, c10::BFloat16(0.f));
    } else {
      t.kt = uninitialized<acc_t>(D * Lk);
      if (a.widen) {
        t.v = uninitialized<acc_t>(Lk * Dv);
        t.v_flags = uninitialized<uint8_t>(Lk);
      }
    }
  }
  t.held.cover(b, kvh, lo, pairs ? std::min(Lk, hi + hi % 2) : hi,
               [&](int64_t from, int64_t to) { convert_keys(a, t, b, kvh, from, to); });
  if (pairs) {
    k.kt16 = t.kt16.get(), k.ld_kt16 = t.ld_kt16, k.v16 = t.v16.get(), k.ld_v16 = t.ld_v16;
    k.v_flags = t.v_flags.get();
  } else {
    k.kt = t.kt.get(), k.ld_kt = Lk;
    if (a.widen) {
      k.v = t.v.get(), k.ld_v = Dv, k.v_flags = t.v_flags.get();
    } else {
      k.v = a.v.at(b, kvh), k.ld_v = a.v.sl, k.v_flags = a.v_nonfinite.at(b, kvh);
      k.scan_v = a.scan_v_per_block;
    }
  }
  return k;
}

template <typename acc_t>
void forward_task(const FwdArgs<acc_t>& a, FwdBuffers<acc_t>& buf, int64_t b, int64_t h, int64_t i0,
                  int64_t rows) {
  const AttentionShape& sh = a.shape;
  const int64_t kvh = h / sh.group();
  const int64_t D = sh.head_dim, Dv = sh.v_head_dim;
  const bool pairs = a.pairs.on;
  if (!pairs && buf.q.empty()) buf.q.resize(buf.rows * D);
  if (!pairs) load_rows(a.q, b, h, i0, rows, D, buf.q.data(), D, /*transposed=*/false);
  const acc_t* q = pairs ? nullptr : buf.q.data();
  const bool per_block = a.keys == KeySource::kPerBlock;
  // (16-bit blocks converted as they stream, or float keys read as given)
  const bool convert = per_block && a.widen;
  // Keys and values of acc_t in a pool (key_rows), which a few rows' products read where they lie.
  constexpr at::ScalarType kAcc = c10::CppTypeToScalarType<acc_t>::value;
  // (key and value share a dtype: prepare_attention checks it)
  const bool in_pool =
      per_block && a.key_rows != nullptr && a.key.dtype == kAcc && rows <= kKeyRowScoreRows;
  if (in_pool && buf.key_ptrs.empty()) {
    buf.key_ptrs.resize(key_block_capacity(sh)), buf.value_ptrs.resize(key_block_capacity(sh));
  }
  const acc_t* k = per_block && !pairs && !convert ? a.k.at(b, kvh) : nullptr;
  // (kt only where a block is transposed or converted: float rows read as stored need none)
  if (per_block && !pairs && (convert || rows > kKeyRowScoreRows) && buf.kt.empty()) {
    buf.kt.resize(D * key_block_capacity(sh));
  }
  if ((convert || pairs) && buf.v.empty()) buf.v.resize(key_block_capacity(sh) * Dv);
  if (buf.v_flags.empty()) buf.v_flags.resize(key_block_capacity(sh) + 1);
  if (pairs && buf.p16.empty()) {
    // (a block of an odd number of keys takes one more, a zero, in its pairs)
    buf.p16.resize(buf.rows * (key_block_capacity(sh) + 1));
    if (per_block) {
      buf.kt16.resize(D * pair_row_length(key_block_capacity(sh)));
      buf.v16.resize((key_block_capacity(sh) + 1) * pair_row_length(Dv));
    }
  }
  const int64_t row0 = (b * sh.heads + h) * sh.q_len + i0;  // index into the (B, H, Lq) outputs
  std::vector<acc_t>&s_buf = buf.s, &o_buf = buf.o;
  std::vector<RowStats<acc_t>>& stats = buf.stats;

  for (int64_t r = 0; r < rows; ++r) {
    const RowSetup<acc_t>& row = buf.setup[r] =
        RowSetup<acc_t>(a.mask, a.scale, a.pattern, sh, b, h, i0 + r);
    a.n_keys[row0 + r] = row.n;
    a.row_scale[row0 + r] = row.lam;
    a.length_factor[row0 + r] = row.factor;
    stats[r] = initial_state(a.sinks != nullptr, a.sinks ? a.sinks[h] : acc_t(0));
  }
  std::fill(o_buf.begin(), o_buf.begin() + rows * Dv, acc_t(0));

  // Only the keys some row of the block may see (causality, windows, documents).
  const KeyRange tile = tile_keys(a.pattern, sh, i0, rows);
  // With bfloat16 products the blocks start at even keys, where V's pairs start (a key before the
  // tile's first is one no row sees: weight 0).
  const int64_t first = pairs ? tile.lo - tile.lo % 2 : tile.lo;
  const TaskKeys<acc_t> keys = task_keys(a, buf.keys, b, kvh, first, tile.hi);
  for (int64_t j0 = first; j0 < tile.hi; j0 += kKvBlock) {
    const int64_t n = std::min(kKvBlock, tile.hi - j0);
    if (pairs) {
      pair_scores(a, buf, keys, b, h, i0, rows, j0, n);
    } else if (in_pool) {
      for (int64_t j = 0; j < n; ++j) {
        buf.key_ptrs[j] = a.key.template row<acc_t>(b, kvh, a.key_rows[j0 + j]);
        buf.value_ptrs[j] = a.value.template row<acc_t>(b, kvh, a.key_rows[j0 + j]);
      }
      key_row_scores(rows, n, D, q, D, buf.key_ptrs.data(), s_buf.data(), n);
    } else if (per_block && rows <= kKeyRowScoreRows) {
      // (16-bit keys converted as stored, unit column stride: D apart)
      if (convert) {
        load_rows(a.key, b, kvh, j0, n, D, buf.kt.data(), D, /*transposed=*/false, a.key_rows);
      }
      const acc_t* k_rows = convert ? buf.kt.data() : k + j0 * a.k.sl;
      key_row_scores(rows, n, D, q, D, k_rows, convert ? D : a.k.sl, s_buf.data(), n);
    } else if (per_block) {
      if (convert) {
        load_rows(a.key, b, kvh, j0, n, D, buf.kt.data(), n, /*transposed=*/true, a.key_rows);
      } else {
        transpose_block(n, D, k + j0 * a.k.sl, a.k.sl, buf.kt.data(), n);
      }
      block_gemm<acc_t>(rows, n, D, q, D, buf.kt.data(), n, s_buf.data(), n, false);
    } else {
      block_gemm<acc_t>(rows, n, D, q, D, keys.kt + j0, keys.ld_kt, s_buf.data(), n, false);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const RowSetup<acc_t>& row = buf.setup[r];
      acc_t* p = s_buf.data() + r * n;
      const acc_t alpha = softmax_row(
          p, n, j0, {row.keys, row.lam, a.softcap, MaskRow<acc_t>(a.mask, b, h, i0 + r)}, stats[r],
          a.with_stats);
      // The statistics saw the weights; P V sees them dropped out.
      if (a.dropout.on()) {
        for_each_dropout_factor(a.dropout, b * sh.heads + h, i0 + r, j0, n,
                                [p](int64_t j, acc_t f) { p[j] *= f; });
      }
      if (alpha != acc_t(1)) {
        acc_t* o = o_buf.data() + r * Dv;
#pragma omp simd
        for (int64_t d = 0; d < Dv; ++d) o[d] *= alpha;
      }
    }
    const auto sees = [&](int64_t r, int64_t j) {
      return row_sees(a.mask, a.pattern, sh, b, h, i0 + r, j0 + j);
    };
    if (pairs) {
      pair_values(a, buf, keys, b, h, rows, j0, n, sees);
      continue;
    }
    if (in_pool) {
      weighted_value_rows(rows, n, Dv, s_buf.data(), n, buf.value_ptrs.data(), o_buf.data(), Dv);
      // A weight of 0 (underflow, dropout) on a key the row sees still takes a non-finite value
      // to the row (0 * inf = NaN), as the block products do.
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t j = 0; j < n; ++j) {
          const acc_t* v = buf.value_ptrs[j];
          if (s_buf[r * n + j] != acc_t(0) || !sees(r, j) || !has_nonfinite(v, Dv)) continue;
          acc_t* o = o_buf.data() + r * Dv;
          for (int64_t d = 0; d < Dv; ++d) o[d] += acc_t(0) * v[d];
        }
      }
      continue;
    }
    // O += P V, a non-finite value reaching only the rows that see its key.
    const acc_t* v_block = convert ? buf.v.data() : keys.v + j0 * keys.ld_v;
    const int64_t ld_v = convert ? Dv : keys.ld_v;
    const uint8_t* block_flags = keys.v_flags ? keys.v_flags + j0 : nullptr;
    if (convert) {
      load_rows(a.value, b, kvh, j0, n, Dv, buf.v.data(), Dv, /*transposed=*/false, a.key_rows);
    }
    if (convert || keys.scan_v) {
      // (flagged here, where the product reads the block next from cache)
      flag_nonfinite_rows(v_block, ld_v, n, Dv, buf.v_flags.data(), 1);
      block_flags = any_flagged(buf.v_flags.data(), n) ? buf.v_flags.data() : nullptr;
    }
    product_seen_rows_of_b<acc_t>(rows, Dv, n, s_buf.data(), n, v_block, ld_v, o_buf.data(), Dv,
                                  true, block_flags, buf.scratch, sees);
  }
  if (pairs) release_bf16_products();

  for (int64_t r = 0; r < rows; ++r) {
    const RowResult<acc_t> res = finalize(stats[r]);
    acc_t* o = o_buf.data() + r * Dv;
#pragma omp simd
    for (int64_t d = 0; d < Dv; ++d) o[d] *= res.inv_l;
    a.lse[row0 + r] = res.lse;
    if (!a.with_stats) continue;
    // With a sink the distribution has one more entry than the n_i keys.
    const DerivedStats<acc_t> d =
        derive(res.entropy, res.sum_p2, buf.setup[r].n + (has_sink_entry(a.sinks, h) ? 1 : 0));
    a.entropy[row0 + r] = d.entropy;
    a.sum_p2[row0 + r] = res.sum_p2;
    a.max_weight[row0 + r] = res.max_weight;
    a.normalized_entropy[row0 + r] = d.normalized_entropy;
    a.sparsity[row0 + r] = d.sparsity;
    a.effective_keys[row0 + r] = d.effective_keys;
  }
  store_rows(o_buf.data(), Dv, a.out, b, h, i0, rows, Dv);
}

// Whether the call's products run in bfloat16 (bf16_products.h): bfloat16 inputs where the CPU has
// the kernel, and K (moved in pairs along the head dim) fits them. Elsewhere 16-bit inputs are
// widened to float32.
bool uses_bf16_products(const AttentionCall& call, const at::Tensor& key) {
  return call.dtype == at::kBFloat16 && rows_pair_up(key) && bf16_products_available();
}

// The operands of bfloat16 products besides Q (read as given): where the tasks do not pack them
// (KeySource::kWhole), K^T and V packed whole, with the flags of V's non-finite rows.
PairOperands pair_operands(const at::Tensor& k, const at::Tensor& v, KeySource keys,
                           NonFiniteRows& v_nonfinite) {
  PairOperands po;
  po.on = true;
  if (keys != KeySource::kWhole) return po;
  po.kt = pack_whole_pairs(k, /*transposed=*/true);
  po.v = pack_whole_pairs(v, /*transposed=*/false);
  v_nonfinite = NonFiniteRows::from(std::move(po.v.flags), v.size(1), v.size(2) + v.size(2) % 2);
  return po;
}

AttentionOutputs attention_cpu(const at::Tensor& query, const at::Tensor& key,
                               const at::Tensor& value, const AttentionCall& call) {
  const AttentionShape& sh = call.shape;
  const at::ScalarType acc = call.acc;
  // key_rows (a paged KV cache's pool): the tasks read the rows through it, in float products (K
  // and V widened, or for float inputs read in place by a few rows' products and else copied, a
  // block or a thread's keys at a time: the copies stay in cache where a gathered copy of the keys
  // would be fresh memory).
  const bool mapped = call.key_rows.defined();
  const bool pairs = !mapped && uses_bf16_products(call, key);
  const bool widen = (call.dtype != acc && !pairs) || mapped;
  // Each thread converts its keys where the threads together hold no more than whole copies, and
  // the tasks can read K (and 16-bit V, which they convert too) as given: rows with a unit last
  // stride, or bfloat16 products, which take them so in any case (from other strides K^T is one
  // whole copy, or none where K is stored transposed, and copying them to rows first would add
  // another).
  const bool rows_as_given =
      pairs || (has_unit_last_stride(key) && (!widen || has_unit_last_stride(value)));
  const KeySource keys = transposes_key_blocks(sh, call.key_pattern()) ? KeySource::kPerBlock
                         : threads_convert_keys(sh) && rows_as_given   ? KeySource::kThread
                                                                       : KeySource::kWhole;
  // (Mapped tasks multiply in float: where the packed keys would take bfloat16 products, a
  // prefill reading each key from many rows, 2 x 512 rows against 2 x 4096 keys, took 389 ms
  // mapped against 242 gathered, 221 on the keys packed; decoding, whose tasks convert blocks as
  // they stream, is mapped.)
  if (mapped &&
      (keys == KeySource::kWhole || !has_unit_last_stride(key) || !has_unit_last_stride(value) ||
       (keys != KeySource::kPerBlock && uses_bf16_products(call, key)))) {
    // The keys converted whole, bfloat16 products, or rows that are not rows in memory: the rows
    // gathered first.
    AttentionCall gathered = call;
    gathered.key_rows = at::Tensor();
    return attention_cpu(query, gather_key_rows(key, call.key_rows),
                         gather_key_rows(value, call.key_rows), gathered);
  }
  const at::Tensor q = gemm_operand(query, call.dtype);
  // K as given where the tasks convert it (or pack it in pairs), else K^T converted whole (read in
  // place where K is stored transposed in acc_t), or float K read per block as a row-major operand.
  // 16-bit V as given where the tasks convert it, else V in acc_t, as given for float inputs (a
  // row-major operand).
  const bool raw_key =
      keys == KeySource::kThread || pairs || (keys == KeySource::kPerBlock && widen);
  const bool raw_value = pairs || (widen && keys != KeySource::kWhole);
  const at::Tensor k = raw_key                        ? with_unit_last_stride(key, call.dtype)
                       : keys == KeySource::kPerBlock ? gemm_operand(key, acc)
                                                      : transposed_operand(key, acc);
  const at::Tensor v =
      raw_value ? with_unit_last_stride(value, call.dtype) : gemm_operand(value, acc);
  AttentionOutputs outputs = call.allocate_outputs(query);
  auto& [out_t, lse, entropy, sum_p2, max_weight, n_keys, row_scale, length_factor,
         normalized_entropy, sparsity, effective_keys] = outputs;

  AT_DISPATCH_FLOATING_TYPES(acc, "entropy_attn_forward_cpu", [&] {
    FwdArgs<scalar_t> a{};
    a.shape = sh;
    a.q = RawOperand::of(q);
    a.keys = keys;
    a.widen = widen;
    a.key_rows = mapped ? call.key_rows.const_data_ptr<int64_t>() : nullptr;
    if (raw_key) {
      a.key = RawOperand::of(k);
    } else {
      (keys == KeySource::kPerBlock ? a.k : a.kt) = Strided4<scalar_t>::of(k);
    }
    if (raw_value) {  // (the non-finite rows are found as the tasks convert them, or pack whole)
      a.value = RawOperand::of(v);
    } else {
      a.v = Strided4<scalar_t>::of(v);
      // Where one task reads each (batch, key/value head)'s values (one query tile, no GQA group:
      // a decoding step), it flags their rows a block at a time just before the block's product,
      // which then reads them from cache (TaskKeys::scan_v): a scan of the whole tensor first made
      // a float32 decoding step read its values twice (27% of its samples). Where several tasks
      // read them, each block would be scanned once per task: they are flagged once here.
      a.scan_v_per_block = sh.group() == 1 && call.key_pattern().cu_q == nullptr &&
                           sh.q_len <= q_block_size(sh.q_len, /*banded=*/true);
      if (!a.scan_v_per_block) {
        a.v_nonfinite = NonFiniteRows::of(a.v, sh.batch, sh.kv_heads, sh.kv_len, sh.v_head_dim);
      }
    }
    if (pairs) a.pairs = pair_operands(k, v, keys, a.v_nonfinite);
    a.mask = call.mask_arg<scalar_t>();
    a.scale = call.scale_policy<scalar_t>();
    a.pattern = call.key_pattern();
    a.softcap = call.options.logit_softcap<scalar_t>();
    a.sinks = call.sink_data<scalar_t>();
    a.dropout = call.dropout<scalar_t>();
    a.out = RawOperand::output(out_t), a.lse = lse.data_ptr<scalar_t>();
    a.entropy = entropy.data_ptr<scalar_t>(), a.sum_p2 = sum_p2.data_ptr<scalar_t>();
    a.max_weight = max_weight.data_ptr<scalar_t>(), a.row_scale = row_scale.data_ptr<scalar_t>();
    a.length_factor = length_factor.data_ptr<scalar_t>();
    a.n_keys = n_keys.data_ptr<int64_t>();
    a.normalized_entropy = normalized_entropy.data_ptr<scalar_t>();
    a.sparsity = sparsity.data_ptr<scalar_t>();
    a.effective_keys = effective_keys.data_ptr<scalar_t>();
    a.with_stats = call.options.return_stats;
    // Query blocks are sized as for a band of keys when the rows' key ranges are narrower than the
    // call's: a band, or packed documents shorter on average than a tall block (whose tiles, cut
    // at the documents' boundaries, would mostly be short ones).
    const bool narrow =
        a.pattern.banded() || sh.q_len < q_block_size(sh.q_len, false) * a.pattern.documents;
    parallel_query_blocks<FwdBuffers<scalar_t>>(
        sh, narrow, a.pattern.cu_q, a.pattern.documents,
        [&](FwdBuffers<scalar_t>& buf, int64_t b, int64_t h, int64_t i0, int64_t rows) {
          forward_task(a, buf, b, h, i0, rows);
        },
        /*heads_inner=*/keys == KeySource::kPerBlock && a.pattern.cu_q != nullptr);
  });
  return outputs;
}

}  // namespace

TORCH_LIBRARY_IMPL(entropy_attn, CPU, m) {
  m.impl("attention", &attention_kernel<attention_cpu, /*kReadsKeyRows=*/true>);
}

}  // namespace entropy_attn::cpu
