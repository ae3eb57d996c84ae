// CPU backward of the fused attention (FlashAttention-2 form with a per-row scale, docs/math.md
// section 3). Tasks are (batch, key/value head, key chunk): a task owns dK and dV of its head's
// chunk of keys and a partial dQ (and dlambda) of the query heads that share it, in its chunk's own
// buffer, so tasks never write the same memory; the partials are summed afterwards. Keys are split
// into chunks only when there are fewer (batch, key/value head) pairs than threads (e.g. MQA with
// one sequence), else each task takes all keys and there is nothing to sum. p is recomputed from
// lse. The additive mask's gradient has the mask's sizes: along a dim the mask broadcasts over
// (batch or key/value heads) one task walks every index, and keys are not chunked when it
// broadcasts over them, so that each of its entries is summed by one task, in a fixed order.
// Every product is row-major without transposes (block_gemm): K and V are also read transposed,
// and dK, dV are accumulated transposed, (D, Lk), from the transposed query-block operands.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "../attention_call.h"
#include "attention_cpu.h"
#include "block_gemm.h"
#include "hidden_nonfinite.h"
#include "row_kernels.h"

namespace entropy_attn::cpu {
namespace {

template <typename acc_t>
struct BwdArgs {
  AttentionShape shape;
  Strided4<acc_t> q, k, out, dout;
  Strided4<acc_t> dq;                // (chunks * B, H, Lq, D): chunk c's partial at batch c * B + b
  Strided4<acc_t> kt, vt, dkt, dvt;  // transposed: (B, Hkv, D or Dv, Lk)
  NonFiniteRows k_nonfinite;         // the key rows holding a NaN or an infinity
  MaskArg<acc_t> mask;
  KeyPattern pattern;
  Softcap<acc_t> softcap;
  Dropout<acc_t> dropout;
  // (B, H, Lq), contiguous; the upstream statistic gradients may be null (zero).
  const acc_t *lse, *entropy, *sum_p2, *row_scale, *g_lse, *g_entropy, *g_sum_p2;
  acc_t* d_row_scale;  // (chunks, B, H, Lq), partials as dq
  LogitGradArg<acc_t> d_logits;  // dS before the cap, summed into the mask's entries, or null
  int64_t chunk_keys;  // keys per chunk, a multiple of kKvBlock
};

template <typename acc_t>
struct BwdBuffers {
  std::vector<acc_t> s, p, dp;    // logits, weights, dP then dS (rows x block)
  std::vector<acc_t> dcap;        // the softcap's derivative (rows x block), when on
  std::vector<acc_t> keep, pd;    // dropout factors and the weights dropped out, when on
  std::vector<acc_t> g;           // G = sum_j dS_ij k_j (rows x D)
  std::vector<acc_t> qs_t, do_t;  // (lambda_i q_i)^T (D x rows) and dO^T (Dv x rows)
  std::vector<acc_t> delta;       // D~_i per row
  // Rows of lambda Q and dO holding a NaN or an infinity, and scratch for the products that keep
  // them (and non-finite keys) out of what cannot see them (hidden_nonfinite.h).
  std::vector<uint8_t> qs_flags, do_flags;
  std::vector<acc_t> scratch;
  std::vector<RowGrads<acc_t>> grads;
  BwdBuffers(int64_t rows, const AttentionShape& sh)
      : s(rows * key_block_capacity(sh)),
        p(rows * key_block_capacity(sh)),
        dp(rows * key_block_capacity(sh)),
        dcap(rows * key_block_capacity(sh)),
        keep(rows * key_block_capacity(sh)),
        pd(rows * key_block_capacity(sh)),
        g(rows * sh.head_dim),
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

// One query block of one query head against the keys it may see in key chunk `chunk`.
template <typename acc_t>
void backward_q_block(const BwdArgs<acc_t>& a, int64_t b, int64_t h, int64_t i0, int64_t rows,
                      int64_t chunk, BwdBuffers<acc_t>& buf) {
  const AttentionShape& sh = a.shape;
  const int64_t kvh = h / sh.group();
  const int64_t D = sh.head_dim, Dv = sh.v_head_dim;
  const int64_t row0 = (b * sh.heads + h) * sh.q_len + i0;
  const acc_t* q = a.q.at(b, h, i0);
  const acc_t* dout = a.dout.at(b, h, i0);
  const acc_t* k = a.k.at(b, kvh);
  const uint8_t* k_flags = a.k_nonfinite.at(b, kvh);
  const acc_t *kt = a.kt.at(b, kvh), *vt = a.vt.at(b, kvh);
  acc_t *dkt = a.dkt.at(b, kvh), *dvt = a.dvt.at(b, kvh);

  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = row0 + r;
    RowGrads<acc_t>& g = buf.grads[r];
    g.g_lse = a.g_lse ? a.g_lse[row] : 0;
    g.g_entropy = a.g_entropy ? a.g_entropy[row] : 0;
    g.g_sum_p2 = a.g_sum_p2 ? a.g_sum_p2[row] : 0;
    // (lse is the reference: weights_row leaves x = s - lse for dlogits_row)
    buf.delta[r] = row_delta(dot(dout + r * a.dout.sl, a.out.at(b, h, i0 + r), Dv), g, a.lse[row],
                             a.entropy[row], a.sum_p2[row], a.lse[row]);
  }
  std::fill(buf.g.begin(), buf.g.begin() + rows * D, acc_t(0));
  for (int64_t r = 0; r < rows; ++r) {
    const acc_t lam = a.row_scale[row0 + r];
    const acc_t* qr = q + r * a.q.sl;
    for (int64_t d = 0; d < D; ++d) buf.qs_t[d * rows + r] = lam * qr[d];
    buf.qs_flags[r] = has_nonfinite(buf.qs_t.data() + r, D, rows);  // column r of (lambda Q)^T
    buf.do_flags[r] = has_nonfinite(dout + r * a.dout.sl, Dv);
  }
  transpose_block(rows, Dv, dout, a.dout.sl, buf.do_t.data(), rows);

  // The keys of this chunk that some row of the block may see.
  const KeyRange tile = tile_keys(a.pattern, sh, i0, rows);
  const int64_t kv_begin = std::max(chunk * a.chunk_keys, tile.lo);
  const int64_t kv_end = std::min(tile.hi, (chunk + 1) * a.chunk_keys);
  const bool dropout = a.dropout.on(), softcap = a.softcap.on();
  for (int64_t j0 = kv_begin; j0 < kv_end; j0 += kKvBlock) {
    const int64_t n = std::min(kKvBlock, kv_end - j0);
    block_gemm<acc_t>(rows, n, D, q, a.q.sl, kt + j0, a.kt.sl, buf.s.data(), n, false);
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
    product_seen_cols_of_bt<acc_t>(Dv, n, rows, buf.do_t.data(), rows,
                                   (dropout ? buf.pd : buf.p).data(), n, dvt + j0, a.dvt.sl,
                                   buf.do_flags.data(), buf.scratch, sees);
    block_gemm<acc_t>(rows, n, Dv, dout, a.dout.sl, vt + j0, a.vt.sl, buf.dp.data(), n, false);
    for (int64_t r = 0; r < rows; ++r) {
      acc_t* dp = buf.dp.data() + r * n;
      const acc_t* p = buf.p.data() + r * n;
      if (dropout) {  // dP of the weights before dropout: dO . v_j times the dropout factor
        const acc_t* keep = buf.keep.data() + r * n;
        for (int64_t j = 0; j < n; ++j) dp[j] *= keep[j];
      }
      dlogits_row(dp, buf.s.data() + r * n, p, n, buf.delta[r], buf.grads[r]);
      if (a.d_logits.data) {  // each of its entries belongs to one task (backward_kernel)
        acc_t* dl = a.d_logits.at(b, h, i0 + r, j0);
        for (int64_t j = 0; j < n; ++j) dl[j * a.d_logits.sj] += dp[j];
      }
      if (softcap) {  // through the cap, to the scaled score lambda q.k
        const acc_t* dc = buf.dcap.data() + r * n;
        for (int64_t j = 0; j < n; ++j) dp[j] *= dc[j];
      }
    }
    // G += dS K (unscaled); dK^T += (lambda Q)^T dS
    product_seen_rows_of_b<acc_t>(rows, D, n, buf.dp.data(), n, k + j0 * a.k.sl, a.k.sl,
                                  buf.g.data(), D, true, k_flags ? k_flags + j0 : nullptr,
                                  buf.scratch, sees);
    product_seen_cols_of_bt<acc_t>(D, n, rows, buf.qs_t.data(), rows, buf.dp.data(), n, dkt + j0,
                                   a.dkt.sl, buf.qs_flags.data(), buf.scratch, sees);
  }

  for (int64_t r = 0; r < rows; ++r) {
    const acc_t* g = buf.g.data() + r * D;
    const acc_t lam = a.row_scale[row0 + r];
    a.d_row_scale[chunk * sh.batch * sh.heads * sh.q_len + row0 + r] = dot(q + r * a.q.sl, g, D);
    acc_t* dq = a.dq.at(chunk * sh.batch + b, h, i0 + r);
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) dq[d] = lam * g[d];
  }
}

// Which of a task's indices (batch, key/value head) it walks itself instead of owning one: those
// along which the mask's gradient is shared (size 1), so that no two tasks add into the same
// entry; and whether the keys may be split into chunks (not when that gradient is shared along
// the keys). Without a mask gradient a task owns one of each.
struct TaskSplit {
  bool all_batches = false, all_kv_heads = false, whole_keys = false;

  static TaskSplit of(const AttentionBackwardCall& call) {
    const at::Tensor& g = call.grad_logits;  // (B or 1, H or 1, Lq or 1, Lk or 1)
    const AttentionShape& sh = call.shape;
    if (!g.defined()) return {};
    return {g.size(0) == 1 && sh.batch > 1, g.size(1) == 1 && sh.kv_heads > 1, g.size(3) == 1};
  }
  int64_t batches(const AttentionShape& sh) const { return all_batches ? 1 : sh.batch; }
  int64_t kv_heads(const AttentionShape& sh) const { return all_kv_heads ? 1 : sh.kv_heads; }
};

// Keys per task: all of them, unless there are fewer (batch, key/value head) pairs than threads;
// then as many chunks of whole key blocks as it takes to give every thread a task.
inline int64_t backward_chunk_keys(const AttentionShape& sh, const TaskSplit& split) {
  const int64_t pairs = split.batches(sh) * split.kv_heads(sh), threads = at::get_num_threads();
  const int64_t kv_blocks = std::max<int64_t>(1, (sh.kv_len + kKvBlock - 1) / kKvBlock);
  if (pairs == 0 || pairs >= threads || kv_blocks == 1 || split.whole_keys) {
    return kv_blocks * kKvBlock;
  }
  const int64_t chunks = std::min(kv_blocks, (threads + pairs - 1) / pairs);
  return (kv_blocks + chunks - 1) / chunks * kKvBlock;
}

template <typename acc_t>
void backward_kernel(const BwdArgs<acc_t>& a, int64_t chunks, const TaskSplit& split) {
  const AttentionShape& sh = a.shape;
  const int64_t qb = q_block_size(sh.q_len, a.pattern.banded());
  const int64_t nb = split.batches(sh), nkv = split.kv_heads(sh);
  at::parallel_for(0, nb * nkv * chunks, 1, [&](int64_t begin, int64_t end) {
    SerialBlasScope serial_blas;
    BwdBuffers<acc_t> buf(std::min(qb, sh.q_len), sh);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t chunk = task % chunks, tkv = task / chunks % nkv, tb = task / chunks / nkv;
      // The task's batch and the query heads of its key/value head, or every one it walks.
      const int64_t b_end = split.all_batches ? sh.batch : tb + 1;
      const int64_t h_end = (split.all_kv_heads ? sh.kv_heads : tkv + 1) * sh.group();
      for (int64_t b = tb; b < b_end; ++b) {
        for (int64_t h = tkv * sh.group(); h < h_end; ++h) {
          for (int64_t i0 = 0; i0 < sh.q_len; i0 += qb) {
            backward_q_block(a, b, h, i0, std::min(qb, sh.q_len - i0), chunk, buf);
          }
        }
      }
    }
  });
}

AttentionGrads attention_backward_cpu(const at::Tensor& grad_output, const at::Tensor& query,
                                     const at::Tensor& key, const at::Tensor& value,
                                     const at::Tensor& output, const AttentionBackwardCall& call) {
  const AttentionShape& sh = call.shape;
  const at::ScalarType acc = call.acc;
  const at::Tensor q = gemm_operand(query, acc), k = gemm_operand(key, acc);
  const at::Tensor kt = transposed_copy(key, acc), vt = transposed_copy(value, acc);
  const at::Tensor out = gemm_operand(output, acc);
  const at::Tensor dout = gemm_operand(grad_output, acc);

  const auto opts = query.options().dtype(acc);
  const TaskSplit split = TaskSplit::of(call);
  const int64_t chunk_keys = backward_chunk_keys(sh, split);
  const int64_t chunks = std::max<int64_t>(1, (sh.kv_len + chunk_keys - 1) / chunk_keys);
  at::Tensor dq = at::empty({chunks * sh.batch, sh.heads, sh.q_len, sh.head_dim}, opts);
  at::Tensor dkt = at::zeros({sh.batch, sh.kv_heads, sh.head_dim, sh.kv_len}, opts);
  at::Tensor dvt = at::zeros({sh.batch, sh.kv_heads, sh.v_head_dim, sh.kv_len}, opts);
  at::Tensor dlam = at::empty({chunks, sh.batch, sh.heads, sh.q_len}, opts);

  AT_DISPATCH_FLOATING_TYPES(acc, "entropy_attn_backward_cpu", [&] {
    auto opt_ptr = [](const at::Tensor& t) {
      return t.defined() ? t.const_data_ptr<scalar_t>() : nullptr;
    };
    BwdArgs<scalar_t> a{};
    a.shape = sh;
    a.q = Strided4<scalar_t>::of(q), a.k = Strided4<scalar_t>::of(k);
    a.k_nonfinite = NonFiniteRows::of(a.k, sh.batch, sh.kv_heads, sh.kv_len, sh.head_dim);
    a.out = Strided4<scalar_t>::of(out), a.dout = Strided4<scalar_t>::of(dout);
    a.dq = Strided4<scalar_t>::of(dq);
    a.kt = Strided4<scalar_t>::of(kt), a.vt = Strided4<scalar_t>::of(vt);
    a.dkt = Strided4<scalar_t>::of(dkt), a.dvt = Strided4<scalar_t>::of(dvt);
    a.mask = make_mask_arg<scalar_t>(call.mask);
    a.pattern = call.key_pattern();
    a.softcap = call.options.logit_softcap<scalar_t>();
    a.dropout = call.dropout<scalar_t>();
    a.lse = call.lse.const_data_ptr<scalar_t>();
    a.entropy = call.entropy.const_data_ptr<scalar_t>();
    a.sum_p2 = call.sum_p2.const_data_ptr<scalar_t>();
    a.row_scale = call.row_scale.const_data_ptr<scalar_t>();
    a.g_lse = opt_ptr(call.g_lse), a.g_entropy = opt_ptr(call.g_entropy);
    a.g_sum_p2 = opt_ptr(call.g_sum_p2);
    a.d_row_scale = dlam.data_ptr<scalar_t>();
    a.d_logits = call.logit_grad_arg<scalar_t>();
    a.chunk_keys = chunk_keys;
    backward_kernel(a, chunks, split);
  });
  if (chunks > 1) {  // the key chunks' partial dQ and dlambda
    dq = dq.view({chunks, sh.batch, sh.heads, sh.q_len, sh.head_dim}).sum(0);
    dlam = dlam.sum(0);
  } else {
    dlam = dlam.squeeze(0);
  }
  return {dq.to(query.scalar_type()), transposed_copy(dkt, key.scalar_type()),
          transposed_copy(dvt, value.scalar_type()), dlam.to(call.row_scale_dtype)};
}

}  // namespace

TORCH_LIBRARY_IMPL(entropy_attn, CPU, m) {
  m.impl("attention_backward", &attention_backward_kernel<attention_backward_cpu>);
}

}  // namespace entropy_attn::cpu
