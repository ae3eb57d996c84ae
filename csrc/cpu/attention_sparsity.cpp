// CPU kernel of the fused l1/l2 sparsity of general attention a_ij = f(s_ij) (seed 003):
// S_i = sum_j |a_ij| / sqrt(n_i sum_j a_ij^2) for f = exp (softmax), relu^2 or identity, with the
// logits, masks, causality and scale policies of the attention op. Same blocking as the attention
// forward: (batch, head, query block) tasks stream key blocks; no L_q x L_k buffer. As there, no
// input is copied whole where there are as many (batch, key/value head) pairs as threads: each task
// converts its query rows, and each thread the keys it reads (thread_keys.h).
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <memory>
#include <vector>

#include "../attention_call.h"
#include "../reduction_math.h"
#include "attention_cpu.h"
#include "block_gemm.h"
#include "row_kernels.h"
#include "thread_keys.h"

namespace entropy_attn::cpu {
namespace {

template <typename acc_t>
struct SparsityArgs {
  AttentionShape shape;
  RawOperand q;  // as given, read a query block at a time
  // K^T (B, Hkv, D, Lk) in acc_t, whole; or K as given (unit last stride), whose keys the threads
  // convert (threads_convert_keys).
  bool threads_convert;
  Strided4<acc_t> kt;
  RawOperand key;
  MaskArg<acc_t> mask;
  ScalePolicy<acc_t> scale;
  KeyPattern pattern;
  Softcap<acc_t> softcap;
  SparsityKind kind;
  acc_t* out;  // (B, H, Lq), contiguous
};

// A thread's buffers: the block's query rows (rows x D), its scores of one block (rows x
// key_block_capacity), the per-row state and, where the threads convert their keys, K^T of the
// (batch, key/value head) it reads (D x Lk, allocated at first use, filled as far as `held`).
template <typename acc_t>
struct SparsityBuffers {
  std::vector<acc_t> q, s;
  std::vector<RowSetup<acc_t>> setup;
  std::vector<RowStats<acc_t>> stats;  // l1 in l, l2 in u, relative to a running max in m
  std::unique_ptr<acc_t[]> kt;
  ConvertedKeys held;
  SparsityBuffers(int64_t rows, const AttentionShape& sh)
      : q(rows * sh.head_dim), s(rows * key_block_capacity(sh)), setup(rows), stats(rows) {}
};

// K^T of (b, kvh) for a task reading keys [lo, hi): the whole operand's, or the thread's, with
// the keys it lacks converted first. Returns the matrix and its leading dimension.
template <typename acc_t>
std::pair<const acc_t*, int64_t> task_kt(const SparsityArgs<acc_t>& a, SparsityBuffers<acc_t>& buf,
                                         int64_t b, int64_t kvh, int64_t lo, int64_t hi) {
  if (!a.threads_convert) return {a.kt.at(b, kvh), a.kt.sl};
  const int64_t D = a.shape.head_dim, Lk = a.shape.kv_len;
  if (!buf.kt) buf.kt = uninitialized<acc_t>(D * Lk);
  buf.held.cover(b, kvh, lo, hi, [&](int64_t from, int64_t to) {
    load_rows(a.key, b, kvh, from, to - from, D, buf.kt.get() + from, Lk, /*transposed=*/true);
  });
  return {buf.kt.get(), Lk};
}

template <typename acc_t>
void sparsity_task(const SparsityArgs<acc_t>& a, SparsityBuffers<acc_t>& buf, int64_t b, int64_t h,
                   int64_t i0, int64_t rows) {
  const AttentionShape& sh = a.shape;
  const int64_t kvh = h / sh.group(), D = sh.head_dim;
  load_rows(a.q, b, h, i0, rows, D, buf.q.data(), D, /*transposed=*/false);
  std::vector<acc_t>& s_buf = buf.s;
  std::vector<RowSetup<acc_t>>& setup = buf.setup;
  std::vector<RowStats<acc_t>>& stats = buf.stats;
  for (int64_t r = 0; r < rows; ++r) {
    setup[r] = RowSetup<acc_t>(a.mask, a.scale, a.pattern, sh, b, h, i0 + r);
    stats[r] = RowStats<acc_t>{};
  }
  const KeyRange tile = tile_keys(a.pattern, sh, i0, rows);
  const auto [kt, ld_kt] = task_kt(a, buf, b, kvh, tile.lo, tile.hi);
  for (int64_t j0 = tile.lo; j0 < tile.hi; j0 += kKvBlock) {
    const int64_t n = std::min(kKvBlock, tile.hi - j0);
    block_gemm<acc_t>(rows, n, D, buf.q.data(), D, kt + j0, ld_kt, s_buf.data(), n, false);
    for (int64_t r = 0; r < rows; ++r) {
      acc_t* s = s_buf.data() + r * n;
      const LogitRow<acc_t> row{setup[r].keys, setup[r].lam, a.softcap,
                                MaskRow<acc_t>(a.mask, b, h, i0 + r)};
      if (a.kind == SparsityKind::kExp) {
        softmax_row(s, n, j0, row, stats[r], /*with_stats=*/true);
      } else {
        power_sums_row(a.kind, s, n, j0, row, stats[r]);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    a.out[(b * sh.heads + h) * sh.q_len + i0 + r] =
        attention_sparsity_value(stats[r].l, stats[r].u, setup[r].n);
  }
}

at::Tensor attention_sparsity_cpu(const at::Tensor& query, const at::Tensor& key, SparsityKind kind,
                                  const AttentionCall& call) {
  const AttentionShape& sh = call.shape;
  const at::ScalarType acc = call.acc;
  const bool convert = threads_convert_keys(sh) && has_unit_last_stride(key);
  // (Q's rows are only read by load_rows: any row stride)
  const at::Tensor q = with_unit_last_stride(query, call.dtype);
  const at::Tensor k =
      convert ? with_unit_last_stride(key, call.dtype) : transposed_operand(key, acc);
  at::Tensor out = at::empty({sh.batch, sh.heads, sh.q_len}, query.options().dtype(acc));

  AT_DISPATCH_FLOATING_TYPES(acc, "entropy_attn_attention_sparsity_cpu", [&] {
    SparsityArgs<scalar_t> a{};
    a.shape = sh;
    a.q = RawOperand::of(q);
    a.threads_convert = convert;
    if (convert) {
      a.key = RawOperand::of(k);
    } else {
      a.kt = Strided4<scalar_t>::of(k);
    }
    a.mask = call.mask_arg<scalar_t>();
    a.scale = call.scale_policy<scalar_t>();
    a.pattern = call.key_pattern();
    a.softcap = call.options.logit_softcap<scalar_t>();
    a.kind = kind;
    a.out = out.data_ptr<scalar_t>();
    parallel_query_blocks<SparsityBuffers<scalar_t>>(
        sh, a.pattern.banded(), a.pattern.cu_q, a.pattern.documents,
        [&](SparsityBuffers<scalar_t>& buf, int64_t b, int64_t h, int64_t i0, int64_t rows) {
          sparsity_task(a, buf, b, h, i0, rows);
        });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(entropy_attn, CPU, m) {
  m.impl("attention_sparsity", &attention_sparsity_kernel<attention_sparsity_cpu>);
}

}  // namespace entropy_attn::cpu
