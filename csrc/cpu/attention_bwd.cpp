// CPU backward of the fused attention (FlashAttention-2 form with a per-row scale, docs/math.md
// section 3). Tasks are (batch, key/value head, head part, key chunk), which never write the same
// memory (backward_tasks.h: parts and chunks only when there are fewer (batch, key/value head)
// pairs than threads, e.g. MQA with one sequence; their partial dK / dV and dQ are summed
// afterwards). p is recomputed from lse. The additive mask's gradient has the mask's sizes: along
// a dim the mask broadcasts over (batch or heads) one task walks every index, and the keys or the
// heads are not split when it broadcasts over them, so that each of its entries is summed by one
// task, in a fixed order.
// Every product is row-major without transposes (block_gemm): K and V are also read transposed,
// and dK, dV are accumulated transposed, (D, Lk), from the transposed query-block operands. No
// input is copied whole: a task converts its keys' K^T, V^T and K once into its thread's buffers
// (in float, or in bfloat16 pairs with K in float only where a key is not finite) and keeps their
// dK^T, dV^T there (BwdUnit), and each query block converts its rows of Q, O and dO (with head
// parts, whose tasks would each convert the same keys, they share whole copies).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <type_traits>
#include <vector>

#include "../attention_call.h"
#include "attention_cpu.h"
#include "backward_tasks.h"
#include "bf16_products.h"
#include "block_gemm.h"
#include "hidden_nonfinite.h"
#include "row_kernels.h"

namespace entropy_attn::cpu {
namespace {

// Where the backward's products run in bfloat16 (bf16_products.h; docs/math.md section 9): Q and
// dO as given, and K^T and V^T for the scores and dP and K as rows for G = dS K in pairs (BwdUnit).
// The products that sum over query rows (dV^T += dO^T P, dK^T += Q^T (lambda dS)) take Q^T and
// dO^T of each query block, and P and lambda dS in pairs along their rows. P and dS are rounded to
// bfloat16 for them, as FlashAttention does; blocks where a non-finite operand row must be kept
// from the rows (keys) that do not see it take the float products.
// The key and value operands converted once for all tasks, where there are head parts: the parts
// of a key/value head would each convert its keys again, and a thread each hold them (MQA on many
// threads). K^T and V^T (B, Hkv, D or Dv, Lk) and K in acc_t, or K^T, V^T and K packed whole in
// pairs (with K in acc_t as well where one of its rows is not finite).
struct WholeOperands {
  at::Tensor kt, vt, k;
  PairedOperand kt16, vt16, k16;
};

template <typename acc_t>
struct BwdArgs {
  AttentionShape shape;
  bool pairs;  // bfloat16 products
  // Q, O, dO, K and V as given (a unit last stride, any input type): Q, O and dO read a query
  // block at a time, K and V a task's keys at a time (BwdUnit), converted to acc_t or packed in
  // pairs; no widened copy of a whole 16-bit input.
  RawOperand q, out, dout, key, value;
  // Where the tasks share whole operands instead (WholeOperands), or null.
  const WholeOperands* whole;
  // dQ: with one key chunk the result, in the query's type and layout; with more, the chunks'
  // partials (chunks * B, H, Lq, D) in acc_t, chunk c's at batch c * B + b.
  RawOperand dq;
  // dK and dV: with one head part, each task accumulates its (batch, key/value head, key chunk)
  // transposed in its thread's buffers and writes it into these results (the inputs' types and
  // layouts) when that head's query heads are done; with more, dkt and dvt hold the parts'
  // partials, (parts * B, Hkv, D or Dv, Lk) in acc_t, part p's at batch p * B + b.
  RawOperand dk, dv;
  Strided4<acc_t> dkt, dvt;
  NonFiniteRows k_nonfinite;  // the key rows holding a NaN or an infinity
  MaskArg<acc_t> mask;
  KeyPattern pattern;
  Softcap<acc_t> softcap;
  Dropout<acc_t> dropout;
  // (B, H, Lq), contiguous; the upstream statistic gradients may be null (zero).
  const acc_t *lse, *entropy, *sum_p2, *row_scale, *g_lse, *g_entropy, *g_sum_p2;
  acc_t* d_row_scale;  // (chunks, B, H, Lq), partials as dq; null: not asked for
  // dS before the cap, summed into the mask's entries (attention_call.h: grad_logits), or null;
  // d_logits_wide instead of it where float32 sums go into a float64 accumulator (wide_mask_sums).
  LogitGradArg<acc_t> d_logits;
  LogitGradArg<double> d_logits_wide;
};

// A row's dS (n keys from j0) added into the mask entries of its logits. Where the row's keys share
// one entry (a mask broadcast along keys), their sum is formed first, in float64, and added once.
template <typename T, typename acc_t>
void add_logit_grads(const LogitGradArg<T>& g, int64_t b, int64_t h, int64_t i, int64_t j0,
                     const acc_t* ds, int64_t n) {
  T* dl = g.at(b, h, i, j0);
  if (g.sj == 0) {
    double sum = 0;
    for (int64_t j = 0; j < n; ++j) sum += ds[j];
    *dl += static_cast<T>(sum);
    return;
  }
  for (int64_t j = 0; j < n; ++j) dl[j * g.sj] += ds[j];
}

// The keys [first, first + keys) of one (batch, key/value head) that a task works on, with their
// operands and where its query blocks add their dK^T and dV^T: key j at column (or row) j - first
// of each. The operands are in the thread's buffers (prepare_unit), converted once for all the
// task's query blocks, or in WholeOperands.
template <typename acc_t>
struct BwdUnit {
  int64_t b = 0, kvh = 0, first = 0, keys = 0;
  const acc_t *kt = nullptr, *vt = nullptr;  // K^T, V^T (D or Dv x keys): float products
  const acc_t* k = nullptr;                  // K (keys x D): float products (with pairs: or null)
  int64_t ld_kt = 0, ld_vt = 0, ld_k = 0;
  const c10::BFloat16 *kt16 = nullptr, *vt16 = nullptr, *k16 = nullptr;  // in pairs
  int64_t ld_kt16 = 0, ld_vt16 = 0, ld_k16 = 0;
  acc_t *dkt = nullptr, *dvt = nullptr;  // D or Dv x keys
  int64_t ld_dkt = 0, ld_dvt = 0;
};

template <typename acc_t>
struct BwdBuffers {
  std::vector<acc_t> s, p, dp;    // logits, weights, dP then dS (rows x block)
  std::vector<acc_t> dcap;        // the softcap's derivative (rows x block), when on
  std::vector<acc_t> keep, pd;    // dropout factors and the weights dropped out, when on
  std::vector<acc_t> g;           // G = sum_j dS_ij k_j (rows x D), then dQ
  std::vector<acc_t> q, o, dout;  // the block's rows of Q (rows x D), O and dO (rows x Dv)
  std::vector<acc_t> qs_t, do_t;  // (lambda_i q_i)^T (D x rows) and dO^T (Dv x rows)
  std::vector<acc_t> delta;       // D~_i per row
  // Rows of lambda Q and dO holding a NaN or an infinity, and scratch for the products that keep
  // them (and non-finite keys) out of what cannot see them (hidden_nonfinite.h).
  std::vector<uint8_t> qs_flags, do_flags;
  std::vector<acc_t> scratch;
  std::vector<RowGrads<acc_t>> grads;
  // A task's keys (BwdUnit): K^T, V^T, K and dK^T, dV^T in acc_t, K^T, V^T and K in pairs (and
  // the flags pack_row_pairs leaves, unused: BwdArgs::k_nonfinite has them).
  std::vector<acc_t> unit_kt, unit_vt, unit_k, unit_dkt, unit_dvt;
  std::vector<c10::BFloat16> unit_kt16, unit_vt16, unit_k16;
  std::vector<uint8_t> unit_flags;
  // With bfloat16 products: Q^T and dO^T (D or Dv x rows rounded up to even), a block of P or
  // lambda dS in pairs along its rows, and dS in bfloat16 (rows x keys rounded up to even).
  std::vector<c10::BFloat16> q_t16, do_t16, pairs16, ds16;
  BwdBuffers(int64_t rows, const AttentionShape& sh)
      : s(rows * key_block_capacity(sh)),
        p(rows * key_block_capacity(sh)),
        dp(rows * key_block_capacity(sh)),
        dcap(rows * key_block_capacity(sh)),
        keep(rows * key_block_capacity(sh)),
        pd(rows * key_block_capacity(sh)),
        g(rows * sh.head_dim),
        q(rows * sh.head_dim),
        o(rows * sh.v_head_dim),
        dout(rows * sh.v_head_dim),
        qs_t(rows * sh.head_dim),
        do_t(rows * sh.v_head_dim),
        delta(rows),
        qs_flags(rows),
        do_flags(rows),
        grads(rows) {}
};

template <typename acc_t>
acc_t dot(const acc_t* x, const acc_t* y, int64_t n) {
  acc_t r = 0;
#pragma omp simd reduction(+ : r)
  for (int64_t d = 0; d < n; ++d) r += x[d] * y[d];
  return r;
}

// Q^T and dO^T of the query block in bfloat16 for the products summed over its rows, a zero
// column after an odd number of rows (so that they pair with the zero row of pack_float_row_pairs).
template <typename acc_t>
void prepare_pair_rows(const BwdArgs<acc_t>& a, BwdBuffers<acc_t>& buf, int64_t b, int64_t h,
                       int64_t i0, int64_t rows) {
  const int64_t D = a.shape.head_dim, Dv = a.shape.v_head_dim, rows2 = rows + rows % 2;
  const int64_t cap = buf.delta.size() + buf.delta.size() % 2;
  if (buf.q_t16.empty()) {
    const int64_t keys = pair_row_length(key_block_capacity(a.shape) + 1);
    buf.q_t16.resize(D * cap), buf.do_t16.resize(Dv * cap);
    buf.pairs16.resize(cap * keys), buf.ds16.resize(buf.delta.size() * keys);
  }
  for (auto [x, dst, dim] :
       {std::tuple{a.q, buf.q_t16.data(), D}, std::tuple{a.dout, buf.do_t16.data(), Dv}}) {
    transpose_block(rows, dim, x.template row<c10::BFloat16>(b, h, i0), x.sl, dst, rows2);
    if (rows2 > rows) {
      for (int64_t d = 0; d < dim; ++d) dst[d * rows2 + rows] = c10::BFloat16(0.f);
    }
  }
}

// C (rows x n, row stride n) = X (rows of (b, h) from i0, as given) . B (dim x n, transposed in
// pairs from its first key: K^T or V^T of a unit's block): the scores, or dP.
template <typename acc_t>
void pair_product(int64_t b, int64_t h, int64_t i0, const RawOperand& x, const c10::BFloat16* bt,
                  int64_t ldb, int64_t rows, int64_t n, int64_t dim, acc_t* c) {
  if constexpr (std::is_same_v<acc_t, float>) {
    bf16_gemm(rows, n, dim, x.row<c10::BFloat16>(b, h, i0), x.sl, bt, ldb, c, n, false);
  } else {
    TORCH_INTERNAL_ASSERT(false, "bfloat16 products accumulate in float");
  }
}

// C^T (dim x n, row stride ldc) += X^T (dim x rows, in buf) . W (rows x n, row stride n), W's row r
// times scale[r] (null: 1), rounded to bfloat16 in pairs along its rows: dV^T += dO^T P and
// dK^T += Q^T (lambda dS).
template <typename acc_t>
void pair_rows_product(BwdBuffers<acc_t>& buf, const c10::BFloat16* xt, int64_t dim, const acc_t* w,
                       const acc_t* scale, int64_t rows, int64_t n, acc_t* c, int64_t ldc) {
  if constexpr (std::is_same_v<acc_t, float>) {
    const int64_t rows2 = rows + rows % 2, ldb = pair_row_length(n);
    pack_float_row_pairs(rows, n, w, n, scale, buf.pairs16.data(), ldb);
    bf16_gemm(dim, n, rows2, xt, rows2, buf.pairs16.data(), ldb, c, ldc, true);
  } else {
    TORCH_INTERNAL_ASSERT(false, "bfloat16 products accumulate in float");
  }
}

// G (rows x D) += dS (in buf.dp, rounded to bfloat16) . K's n keys from k16 (as rows in pairs from
// an even key; an odd n is paired with a zero weight).
template <typename acc_t>
void pair_keys_product(BwdBuffers<acc_t>& buf, const c10::BFloat16* k16, int64_t ldk, int64_t D,
                       int64_t rows, int64_t n) {
  if constexpr (std::is_same_v<acc_t, float>) {
    const int64_t n2 = n + n % 2;
    round_rows_to_pairs(rows, n, buf.dp.data(), n, buf.ds16.data());
    bf16_gemm(rows, D, n2, buf.ds16.data(), n2, k16, ldk, buf.g.data(), D, true);
  } else {
    TORCH_INTERNAL_ASSERT(false, "bfloat16 products accumulate in float");
  }
}

template <typename T>
void grow(std::vector<T>& v, int64_t n) {
  if (v.size() < static_cast<size_t>(n)) v.resize(n);
}

// The unit of keys [first, first + keys) of (b, kvh) for head part `part`: its operands converted
// into the thread's buffers, or in the whole operands; its dK^T and dV^T zeroed in the thread's
// buffers (one head part), or the part's partials.
template <typename acc_t>
BwdUnit<acc_t> prepare_unit(const BwdArgs<acc_t>& a, BwdBuffers<acc_t>& buf, int64_t b, int64_t kvh,
                            int64_t first, int64_t keys, int64_t part) {
  const int64_t D = a.shape.head_dim, Dv = a.shape.v_head_dim;
  BwdUnit<acc_t> u;
  u.b = b, u.kvh = kvh, u.first = first, u.keys = keys;
  const uint8_t* flags = a.k_nonfinite.at(b, kvh);
  // (K in acc_t with bfloat16 products only for the float products of non-finite keys)
  const bool k_float = !a.pairs || any_flagged(flags ? flags + first : nullptr, keys);
  if (const WholeOperands* w = a.whole) {
    if (a.pairs) {
      u.kt16 = w->kt16.at(b, kvh) + 2 * first, u.ld_kt16 = w->kt16.ld;
      u.vt16 = w->vt16.at(b, kvh) + 2 * first, u.ld_vt16 = w->vt16.ld;
      u.k16 = w->k16.at(b, kvh) + first * w->k16.ld, u.ld_k16 = w->k16.ld;
    } else {
      const auto kt = Strided4<acc_t>::of(w->kt), vt = Strided4<acc_t>::of(w->vt);
      u.kt = kt.at(b, kvh) + first, u.ld_kt = kt.sl;
      u.vt = vt.at(b, kvh) + first, u.ld_vt = vt.sl;
    }
    if (k_float) {
      const auto k = Strided4<acc_t>::of(w->k);
      u.k = k.at(b, kvh, first), u.ld_k = k.sl;
    }
    u.dkt = a.dkt.at(part * a.shape.batch + b, kvh) + first, u.ld_dkt = a.dkt.sl;
    u.dvt = a.dvt.at(part * a.shape.batch + b, kvh) + first, u.ld_dvt = a.dvt.sl;
    return u;
  }
  if (a.pairs) {
    const int64_t keys2 = keys + keys % 2;
    u.ld_kt16 = u.ld_vt16 = pair_row_length(keys), u.ld_k16 = pair_row_length(D);
    grow(buf.unit_kt16, D * u.ld_kt16 + kPairSlack);
    grow(buf.unit_vt16, Dv * u.ld_vt16 + kPairSlack);
    grow(buf.unit_k16, keys2 * u.ld_k16), grow(buf.unit_flags, keys2);
    const auto* k_rows = a.key.template row<c10::BFloat16>(b, kvh, first);
    const auto* v_rows = a.value.template row<c10::BFloat16>(b, kvh, first);
    pack_transposed_pairs(keys, D, k_rows, a.key.sl, buf.unit_kt16.data(), u.ld_kt16);
    pack_transposed_pairs(keys, Dv, v_rows, a.value.sl, buf.unit_vt16.data(), u.ld_vt16);
    pack_row_pairs(keys, D, k_rows, a.key.sl, buf.unit_k16.data(), u.ld_k16, buf.unit_flags.data());
    u.kt16 = buf.unit_kt16.data(), u.vt16 = buf.unit_vt16.data(), u.k16 = buf.unit_k16.data();
  } else {
    grow(buf.unit_kt, D * keys), grow(buf.unit_vt, Dv * keys);
    load_rows(a.key, b, kvh, first, keys, D, buf.unit_kt.data(), keys, /*transposed=*/true);
    load_rows(a.value, b, kvh, first, keys, Dv, buf.unit_vt.data(), keys, /*transposed=*/true);
    u.kt = buf.unit_kt.data(), u.vt = buf.unit_vt.data(), u.ld_kt = u.ld_vt = keys;
  }
  if (k_float) {
    grow(buf.unit_k, keys * D);
    load_rows(a.key, b, kvh, first, keys, D, buf.unit_k.data(), D, /*transposed=*/false);
    u.k = buf.unit_k.data(), u.ld_k = D;
  }
  grow(buf.unit_dkt, D * keys), grow(buf.unit_dvt, Dv * keys);
  std::fill(buf.unit_dkt.begin(), buf.unit_dkt.begin() + D * keys, acc_t(0));
  std::fill(buf.unit_dvt.begin(), buf.unit_dvt.begin() + Dv * keys, acc_t(0));
  u.dkt = buf.unit_dkt.data(), u.dvt = buf.unit_dvt.data(), u.ld_dkt = u.ld_dvt = keys;
  return u;
}

// One query block of query head h (of the unit's key/value head) against the keys of the unit it
// may see, adding its dK^T and dV^T into the unit's.
template <typename acc_t>
void backward_q_block(const BwdArgs<acc_t>& a, const BwdUnit<acc_t>& u, int64_t h, int64_t i0,
                      int64_t rows, int64_t chunk, BwdBuffers<acc_t>& buf) {
  const AttentionShape& sh = a.shape;
  const int64_t b = u.b, kvh = u.kvh;
  const int64_t D = sh.head_dim, Dv = sh.v_head_dim;
  const int64_t row0 = (b * sh.heads + h) * sh.q_len + i0;
  load_rows(a.q, b, h, i0, rows, D, buf.q.data(), D, /*transposed=*/false);
  load_rows(a.dout, b, h, i0, rows, Dv, buf.dout.data(), Dv, /*transposed=*/false);
  load_rows(a.out, b, h, i0, rows, Dv, buf.o.data(), Dv, /*transposed=*/false);
  const acc_t *q = buf.q.data(), *dout = buf.dout.data();
  const uint8_t* k_flags = a.k_nonfinite.at(b, kvh);

  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = row0 + r;
    RowGrads<acc_t>& g = buf.grads[r];
    g.g_lse = a.g_lse ? a.g_lse[row] : 0;
    g.g_entropy = a.g_entropy ? a.g_entropy[row] : 0;
    g.g_sum_p2 = a.g_sum_p2 ? a.g_sum_p2[row] : 0;
    // (lse is the reference: weights_row leaves x = s - lse for dlogits_row)
    buf.delta[r] = row_delta(dot(dout + r * Dv, buf.o.data() + r * Dv, Dv), g, a.lse[row],
                             a.entropy[row], a.sum_p2[row], a.lse[row]);
  }
  std::fill(buf.g.begin(), buf.g.begin() + rows * D, acc_t(0));
  for (int64_t r = 0; r < rows; ++r) {
    const acc_t lam = a.row_scale[row0 + r];
    const acc_t* qr = q + r * D;
    for (int64_t d = 0; d < D; ++d) buf.qs_t[d * rows + r] = lam * qr[d];
    buf.qs_flags[r] = has_nonfinite(buf.qs_t.data() + r, D, rows);  // column r of (lambda Q)^T
    buf.do_flags[r] = has_nonfinite(dout + r * Dv, Dv);
  }
  const bool pairs = a.pairs;
  // (dO^T in float: the float products', which bfloat16 products take only for a non-finite row)
  if (!pairs || any_flagged(buf.do_flags.data(), rows)) {
    transpose_block(rows, Dv, dout, Dv, buf.do_t.data(), rows);
  }
  if (pairs) prepare_pair_rows(a, buf, b, h, i0, rows);

  // The keys of the unit that some row of the block may see.
  const KeyRange tile = tile_keys(a.pattern, sh, i0, rows);
  const int64_t kv_begin = std::max(u.first, tile.lo);
  const int64_t kv_end = std::min(tile.hi, u.first + u.keys);
  const bool dropout = a.dropout.on(), softcap = a.softcap.on();
  // With bfloat16 products the blocks start at even keys, where K's pairs start (a key before the
  // tile's first is one no row sees, in the same unit: units start at multiples of kKvBlock).
  const int64_t first = pairs ? kv_begin - kv_begin % 2 : kv_begin;
  for (int64_t j0 = first; j0 < kv_end; j0 += kKvBlock) {
    const int64_t n = std::min(kKvBlock, kv_end - j0), ju = j0 - u.first;  // ju: in the unit
    if (pairs) {
      pair_product(b, h, i0, a.q, u.kt16 + 2 * ju, u.ld_kt16, rows, n, D, buf.s.data());
    } else {
      block_gemm<acc_t>(rows, n, D, q, D, u.kt + ju, u.ld_kt, buf.s.data(), n, false);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = i0 + r;
      const LogitRow<acc_t> row{a.pattern.keys(i, sh.q_len, sh.kv_len), a.row_scale[row0 + r],
                                a.softcap, MaskRow<acc_t>(a.mask, b, h, i)};
      weights_row(buf.s.data() + r * n, buf.p.data() + r * n, buf.dcap.data() + r * n, n, j0, row,
                  a.lse[row0 + r]);
      if (dropout) {
        acc_t *keep = buf.keep.data() + r * n, *pd = buf.pd.data() + r * n;
        const acc_t* p = buf.p.data() + r * n;
        for_each_dropout_factor(a.dropout, b * sh.heads + h, i, j0, n, [&](int64_t j, acc_t f) {
          keep[j] = f;
          pd[j] = p[j] * f;
        });
      }
    }
    // A non-finite row of dO, lambda Q or K reaches only the keys (rows) that see it.
    const auto sees = [&](int64_t r, int64_t j) {
      return row_sees(a.mask, a.pattern, sh, b, h, i0 + r, j0 + j);
    };
    // dV^T += dO^T P (P dropped out, as the forward's P V saw it); dP = dO V^T
    const acc_t* weights = (dropout ? buf.pd : buf.p).data();
    if (pairs && !any_flagged(buf.do_flags.data(), rows)) {
      pair_rows_product(buf, buf.do_t16.data(), Dv, weights, static_cast<const acc_t*>(nullptr),
                        rows, n, u.dvt + ju, u.ld_dvt);
    } else {
      product_seen_cols_of_bt<acc_t>(Dv, n, rows, buf.do_t.data(), rows, weights, n, u.dvt + ju,
                                     u.ld_dvt, buf.do_flags.data(), buf.scratch, sees);
    }
    if (pairs) {
      pair_product(b, h, i0, a.dout, u.vt16 + 2 * ju, u.ld_vt16, rows, n, Dv, buf.dp.data());
    } else {
      block_gemm<acc_t>(rows, n, Dv, dout, Dv, u.vt + ju, u.ld_vt, buf.dp.data(), n, false);
    }
    for (int64_t r = 0; r < rows; ++r) {
      acc_t* dp = buf.dp.data() + r * n;
      const acc_t* p = buf.p.data() + r * n;
      if (dropout) {  // dP of the weights before dropout: dO . v_j times the dropout factor
        const acc_t* keep = buf.keep.data() + r * n;
        for (int64_t j = 0; j < n; ++j) dp[j] *= keep[j];
      }
      dlogits_row(dp, buf.s.data() + r * n, p, n, buf.delta[r], buf.grads[r]);
      // (each mask entry belongs to one task: backward_kernel)
      if (a.d_logits.data) add_logit_grads(a.d_logits, b, h, i0 + r, j0, dp, n);
      if (a.d_logits_wide.data) add_logit_grads(a.d_logits_wide, b, h, i0 + r, j0, dp, n);
      if (softcap) {  // through the cap, to the scaled score lambda q.k
        // A key the row does not see (p = 0: its dS is 0) keeps dS = 0 whatever its derivative:
        // a NaN key's is NaN (docs/math.md section 8), as in the CUDA fallback.
        const acc_t* dc = buf.dcap.data() + r * n;
        for (int64_t j = 0; j < n; ++j) dp[j] = p[j] == acc_t(0) ? dp[j] : dp[j] * dc[j];
      }
    }
    // G += dS K (unscaled); dK^T += (lambda Q)^T dS. (K's pairs join key j0 + n to an odd
    // block's last: its dS is 0, but 0 * inf is not.)
    const int64_t paired = std::min(n + n % 2, sh.kv_len - j0);
    if (pairs && !any_flagged(k_flags ? k_flags + j0 : nullptr, paired)) {
      pair_keys_product(buf, u.k16 + ju * u.ld_k16, u.ld_k16, D, rows, n);
    } else {
      product_seen_rows_of_b<acc_t>(rows, D, n, buf.dp.data(), n, u.k + ju * u.ld_k, u.ld_k,
                                    buf.g.data(), D, true, k_flags ? k_flags + j0 : nullptr,
                                    buf.scratch, sees);
    }
    if (pairs && !any_flagged(buf.qs_flags.data(), rows)) {
      pair_rows_product(buf, buf.q_t16.data(), D, buf.dp.data(), a.row_scale + row0, rows, n,
                        u.dkt + ju, u.ld_dkt);
    } else {
      product_seen_cols_of_bt<acc_t>(D, n, rows, buf.qs_t.data(), rows, buf.dp.data(), n,
                                     u.dkt + ju, u.ld_dkt, buf.qs_flags.data(), buf.scratch, sees);
    }
  }
  if (pairs) release_bf16_products();

  // dlambda_i = q_i . G_i (where asked for), then dQ = lambda G in place of G.
  for (int64_t r = 0; r < rows; ++r) {
    acc_t* g = buf.g.data() + r * D;
    const acc_t lam = a.row_scale[row0 + r];
    if (a.d_row_scale != nullptr) {
      a.d_row_scale[chunk * sh.batch * sh.heads * sh.q_len + row0 + r] = dot(q + r * D, g, D);
    }
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) g[d] *= lam;
  }
  store_rows(buf.g.data(), D, a.dq, chunk * sh.batch + b, h, i0, rows, D);
}

// Which of a task's indices (batch, key/value head) it walks itself instead of owning one: those
// along which the mask's gradient is shared (size 1), so that no two tasks add into the same
// entry; and whether the query heads of a key/value head and the keys may be split (not when that
// gradient is shared along them). Without a mask gradient a task owns one of each.
struct TaskSplit {
  bool all_batches = false, all_kv_heads = false, whole_heads = false, whole_keys = false;

  static TaskSplit of(const AttentionBackwardCall& call) {
    const at::Tensor& g = call.grad_logits;  // (B or 1, H or 1, Lq or 1, Lk or 1)
    const AttentionShape& sh = call.shape;
    if (!g.defined()) return {};
    return {g.size(0) == 1 && sh.batch > 1, g.size(1) == 1 && sh.kv_heads > 1, g.size(1) == 1,
            g.size(3) == 1};
  }
  int64_t batches(const AttentionShape& sh) const { return all_batches ? 1 : sh.batch; }
  int64_t kv_heads(const AttentionShape& sh) const { return all_kv_heads ? 1 : sh.kv_heads; }
};

// The tasks of a call (backward_tasks.h), for gradients in the accumulation type.
BackwardTasks plan_tasks(const AttentionShape& sh, const KeyPattern& pattern,
                         const TaskSplit& split, int64_t acc_bytes) {
  const int64_t pairs = split.batches(sh) * split.kv_heads(sh), threads = at::get_num_threads();
  BackwardSizes sizes;
  sizes.dq_elems = sh.batch * sh.heads * sh.q_len * sh.head_dim;
  sizes.dkv_elems = sh.batch * sh.kv_heads * sh.kv_len * (sh.head_dim + sh.v_head_dim);
  sizes.acc_bytes = acc_bytes;
  // (a task that walks every batch or key/value head does their work in turn)
  const int64_t walked =
      (split.all_batches ? sh.batch : 1) * (split.all_kv_heads ? sh.kv_heads : 1);
  sizes.fma_per_row_key = (3 * sh.head_dim + 2 * sh.v_head_dim) * walked;
  // (the pattern's work only where the plan may split: one pass over the rows)
  const std::vector<int64_t> work =
      pairs < threads ? block_work(pattern, sh.q_len, sh.kv_len, kKvBlock) : std::vector<int64_t>{};
  return BackwardTasks::plan(pairs, sh.group(), sh.kv_len, work, kKvBlock, threads,
                             split.whole_heads, split.whole_keys, sizes);
}

// x^T (dim x n, row stride ld) into keys j0 .. j0 + n of (b, h) of y, in y's type.
template <typename acc_t>
void store_transposed(const acc_t* x, int64_t ld, int64_t dim, int64_t n, const RawOperand& y,
                      int64_t b, int64_t h, int64_t j0) {
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, y.dtype, "entropy_attn_store_key_grads",
      [&] { transpose_block(dim, n, x, ld, y.row<scalar_t>(b, h, j0), y.sl); });
}

template <typename acc_t>
void backward_kernel(const BwdArgs<acc_t>& a, const BackwardTasks& t, const TaskSplit& split) {
  const AttentionShape& sh = a.shape;
  const int64_t qb = q_block_size(sh.q_len, a.pattern.banded());
  const int64_t nb = split.batches(sh), nkv = split.kv_heads(sh);
  const int64_t D = sh.head_dim, Dv = sh.v_head_dim;
  at::parallel_for(0, nb * nkv * t.parts * t.chunks, 1, [&](int64_t begin, int64_t end) {
    SerialBlasScope serial_blas;
    BwdBuffers<acc_t> buf(std::min(qb, sh.q_len), sh);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t chunk = task % t.chunks, part = task / t.chunks % t.parts;
      const int64_t tkv = task / t.chunks / t.parts % nkv, tb = task / t.chunks / t.parts / nkv;
      // The task's batch and the query heads of its key/value head's part, or every one it walks.
      const int64_t b_end = split.all_batches ? sh.batch : tb + 1;
      const int64_t h_begin = tkv * sh.group() + part * t.heads_per_part;
      const int64_t h_end = split.all_kv_heads
                                ? sh.heads
                                : std::min(h_begin + t.heads_per_part, (tkv + 1) * sh.group());
      // The chunk's keys, [first, first + keys).
      const int64_t first = std::min(sh.kv_len, chunk * t.chunk_keys);
      const int64_t keys = std::min(sh.kv_len - first, t.chunk_keys);
      for (int64_t b = tb; b < b_end; ++b) {
        BwdUnit<acc_t> unit;
        for (int64_t h = h_begin; h < h_end; ++h) {
          const int64_t kvh = h / sh.group();
          // (a unit per key/value head: the first of the task's query heads of each)
          if (h == h_begin || h % sh.group() == 0) {
            unit = prepare_unit(a, buf, b, kvh, first, keys, part);
          }
          for (int64_t i0 = 0; i0 < sh.q_len; i0 += qb) {
            backward_q_block(a, unit, h, i0, std::min(qb, sh.q_len - i0), chunk, buf);
          }
          // (the thread's dK^T and dV^T after the last)
          if (!a.whole && (h + 1 == h_end || (h + 1) % sh.group() == 0)) {
            store_transposed(unit.dkt, keys, D, keys, a.dk, b, kvh, first);
            store_transposed(unit.dvt, keys, Dv, keys, a.dv, b, kvh, first);
          }
        }
      }
    }
  });
}

// Whether the backward's products run in bfloat16 (BwdPairs): bfloat16 inputs (and upstream
// gradient) where the CPU has the kernel, and K and V (moved in pairs along their head dims) fit
// them.
bool backward_uses_bf16_products(const at::Tensor& grad_output, const at::Tensor& query,
                                 const at::Tensor& key, const at::Tensor& value) {
  return query.scalar_type() == at::kBFloat16 && grad_output.scalar_type() == at::kBFloat16 &&
         rows_pair_up(key) && rows_pair_up(value) && bf16_products_available();
}

// output or grad_output as the tasks read it (a unit last stride): as given in an input type, or
// converted to acc from any other floating type the op accepts for them.
at::Tensor as_read(const at::Tensor& t, at::ScalarType acc) {
  const at::ScalarType dt = t.scalar_type();
  const bool input_type =
      dt == at::kFloat || dt == at::kDouble || dt == at::kBFloat16 || dt == at::kHalf;
  return gemm_operand(t, input_type ? dt : acc);
}

// A float64 accumulator of the mask's gradient for a float32 call whose mask entries each sum
// kWideMaskSum logits or more (a mask broadcast along the batch, heads, rows or keys: a learned
// bias per head sums B Lq Lk of them), else undefined. A float32 running sum of that many terms,
// which nearly cancel (a row's dS sums to 0 for a loss of the output alone), drifts by far more
// than torch's float32 sum of the full (B, H, Lq, Lk) gradient (pairwise): 1.3e-4 against 3.5e-6
// for a scalar bias at B = 2, H = 4, L = 1024 (tests/test_mask_grad.py:
// test_shared_float32_mask_grad_sums_in_float64). A full-shape mask's entries take one logit each,
// and float64 calls sum in float64 already. The threshold leaves a bias shared by the batch alone
// ((1, H, Lq, Lk), a few dozen terms per entry, accurate enough in float32) without a float64 copy
// of its (H, Lq, Lk) gradient.
constexpr int64_t kWideMaskSum = 1024;

at::Tensor wide_mask_sums(const AttentionBackwardCall& call) {
  const at::Tensor& g = call.grad_logits;
  const AttentionShape& sh = call.shape;
  if (!g.defined() || call.acc != at::kFloat || g.numel() == 0) return {};
  const int64_t logits = sh.batch * sh.heads * sh.q_len * sh.kv_len;
  return logits / g.numel() >= kWideMaskSum ? at::zeros(g.sizes(), g.options().dtype(at::kDouble))
                                            : at::Tensor();
}

AttentionGrads attention_backward_cpu(const at::Tensor& grad_output, const at::Tensor& query,
                                      const at::Tensor& key, const at::Tensor& value,
                                      const at::Tensor& output, const AttentionBackwardCall& call) {
  const AttentionShape& sh = call.shape;
  const at::ScalarType acc = call.acc;
  const bool pairs = backward_uses_bf16_products(grad_output, query, key, value);
  // The inputs as given (a unit last stride), converted by the tasks (BwdArgs).
  const at::Tensor q = gemm_operand(query, query.scalar_type());
  const at::Tensor out = as_read(output, acc), dout = as_read(grad_output, acc);
  const at::Tensor k = with_unit_last_stride(key, key.scalar_type());
  const at::Tensor v = with_unit_last_stride(value, value.scalar_type());
  NonFiniteRows k_nonfinite;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, k.scalar_type(), "entropy_attn_keys", [&] {
        k_nonfinite = NonFiniteRows::of(Strided4<scalar_t>::of(k), sh.batch, sh.kv_heads, sh.kv_len,
                                        sh.head_dim);
      });

  const auto opts = query.options().dtype(acc);
  const TaskSplit split = TaskSplit::of(call);
  const BackwardTasks tasks = plan_tasks(sh, call.key_pattern(), split, at::elementSize(acc));
  const int64_t chunks = tasks.chunks, parts = tasks.parts;
  // With head parts the tasks share whole operands and add into the parts' partial dK^T, dV^T
  // (BwdArgs, WholeOperands).
  WholeOperands whole;
  at::Tensor dkt, dvt;
  if (parts > 1) {
    if (pairs) {
      whole.kt16 = pack_whole_pairs(k, /*transposed=*/true);
      whole.vt16 = pack_whole_pairs(v, /*transposed=*/true);
      whole.k16 = pack_whole_pairs(k, /*transposed=*/false);
    } else {
      whole.kt = transposed_copy(k, acc), whole.vt = transposed_copy(v, acc);
    }
    if (!pairs || k_nonfinite.any()) whole.k = gemm_operand(k, acc);
    dkt = at::zeros({parts * sh.batch, sh.kv_heads, sh.head_dim, sh.kv_len}, opts);
    dvt = at::zeros({parts * sh.batch, sh.kv_heads, sh.v_head_dim, sh.kv_len}, opts);
  }
  // dQ written by the kernel in the query's type and layout where there is one key chunk, else the
  // chunks' partials; dK and dV by the tasks where there is one head part.
  at::Tensor dq = chunks == 1
                      ? empty_in_layout_of(query, query.sym_sizes(), query.options())
                      : at::empty({chunks * sh.batch, sh.heads, sh.q_len, sh.head_dim}, opts);
  at::Tensor dk = empty_in_layout_of(key, key.sym_sizes(), key.options());
  at::Tensor dv = empty_in_layout_of(value, value.sym_sizes(), value.options());
  at::Tensor dlam =
      call.grad_row_scale ? at::empty({chunks, sh.batch, sh.heads, sh.q_len}, opts) : at::Tensor();

  const at::Tensor wide = wide_mask_sums(call);
  AT_DISPATCH_FLOATING_TYPES(acc, "entropy_attn_backward_cpu", [&] {
    auto opt_ptr = [](const at::Tensor& t) {
      return t.defined() ? t.const_data_ptr<scalar_t>() : nullptr;
    };
    auto opt_strided = [](const at::Tensor& t) {
      return t.defined() ? Strided4<scalar_t>::of(t) : Strided4<scalar_t>{};
    };
    BwdArgs<scalar_t> a{};
    a.shape = sh;
    a.pairs = pairs;
    a.q = RawOperand::of(q), a.out = RawOperand::of(out), a.dout = RawOperand::of(dout);
    a.key = RawOperand::of(k), a.value = RawOperand::of(v);
    a.whole = parts > 1 ? &whole : nullptr;
    a.k_nonfinite = std::move(k_nonfinite);
    a.dq = RawOperand::output(dq);
    a.dk = RawOperand::output(dk), a.dv = RawOperand::output(dv);
    a.dkt = opt_strided(dkt), a.dvt = opt_strided(dvt);
    a.mask = make_cpu_mask_arg<scalar_t>(call.mask);
    a.pattern = call.key_pattern();
    a.softcap = call.options.logit_softcap<scalar_t>();
    a.dropout = call.dropout<scalar_t>();
    a.lse = call.lse.const_data_ptr<scalar_t>();
    a.entropy = call.entropy.const_data_ptr<scalar_t>();
    a.sum_p2 = call.sum_p2.const_data_ptr<scalar_t>();
    a.row_scale = call.row_scale.const_data_ptr<scalar_t>();
    a.g_lse = opt_ptr(call.g_lse), a.g_entropy = opt_ptr(call.g_entropy);
    a.g_sum_p2 = opt_ptr(call.g_sum_p2);
    a.d_row_scale = dlam.defined() ? dlam.data_ptr<scalar_t>() : nullptr;
    if (wide.defined()) {
      a.d_logits_wide = call.logit_grad_arg<double>(wide);
    } else {
      a.d_logits = call.logit_grad_arg<scalar_t>();
    }
    backward_kernel(a, tasks, split);
  });
  if (wide.defined()) call.grad_logits.copy_(wide);
  if (chunks > 1) {  // the key chunks' partial dQ and dlambda
    dq = in_layout_of(query, dq.view({chunks, sh.batch, sh.heads, sh.q_len, sh.head_dim}).sum(0),
                      query.scalar_type());
    if (dlam.defined()) dlam = dlam.sum(0);
  } else if (dlam.defined()) {
    dlam = dlam.squeeze(0);
  }
  if (parts > 1) {  // the head parts' partial dK and dV, summed into the first (no new buffer)
    const at::Tensor dk_parts = dkt.view({parts, sh.batch, sh.kv_heads, sh.head_dim, sh.kv_len});
    const at::Tensor dv_parts = dvt.view({parts, sh.batch, sh.kv_heads, sh.v_head_dim, sh.kv_len});
    dkt = dk_parts[0];
    dvt = dv_parts[0];
    for (int64_t p = 1; p < parts; ++p) {
      dkt.add_(dk_parts[p]);
      dvt.add_(dv_parts[p]);
    }
    transposed_copy_into(dkt, dk);
    transposed_copy_into(dvt, dv);
  }
  return {dq, dk, dv, dlam};
}

}  // namespace

TORCH_LIBRARY_IMPL(entropy_attn, CPU, m) {
  m.impl("attention_backward", &attention_backward_kernel<attention_backward_cpu>);
}

}  // namespace entropy_attn::cpu
