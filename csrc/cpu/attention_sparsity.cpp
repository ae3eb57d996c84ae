// CPU kernel of the fused l1/l2 sparsity of general attention a_ij = f(s_ij) (seed 003):
// S_i = sum_j |a_ij| / sqrt(n_i sum_j a_ij^2) for f = exp (softmax), relu^2 or identity, with the
// logits, masks, causality and scale policies of the attention op. Same blocking as the attention
// forward: (batch, head, query block) tasks stream key blocks; no L_q x L_k buffer.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <vector>

#include "../attention_call.h"
#include "../reduction_math.h"
#include "attention_cpu.h"
#include "block_gemm.h"
#include "row_kernels.h"

namespace entropy_attn::cpu {
namespace {

template <typename acc_t>
struct SparsityArgs {
  AttentionShape shape;
  Strided4<acc_t> q, kt;  // kt: K transposed, (B, Hkv, D, Lk)
  MaskArg<acc_t> mask;
  ScalePolicy<acc_t> scale;
  KeyPattern pattern;
  Softcap<acc_t> softcap;
  SparsityKind kind;
  acc_t* out;  // (B, H, Lq), contiguous
};

// A thread's buffers: scores of one block (rows x key_block_capacity) and the per-row state.
template <typename acc_t>
struct SparsityBuffers {
  std::vector<acc_t> s;
  std::vector<RowSetup<acc_t>> setup;
  std::vector<RowStats<acc_t>> stats;  // l1 in l, l2 in u, relative to a running max in m
  SparsityBuffers(int64_t rows, const AttentionShape& sh)
      : s(rows * key_block_capacity(sh)), setup(rows), stats(rows) {}
};

template <typename acc_t>
void sparsity_task(const SparsityArgs<acc_t>& a, SparsityBuffers<acc_t>& buf, int64_t b, int64_t h,
                   int64_t i0, int64_t rows) {
  const AttentionShape& sh = a.shape;
  const int64_t kvh = h / sh.group();
  const acc_t* q = a.q.at(b, h, i0);
  const acc_t* kt = a.kt.at(b, kvh);
  std::vector<acc_t>& s_buf = buf.s;
  std::vector<RowSetup<acc_t>>& setup = buf.setup;
  std::vector<RowStats<acc_t>>& stats = buf.stats;
  for (int64_t r = 0; r < rows; ++r) {
    setup[r] = RowSetup<acc_t>(a.mask, a.scale, a.pattern, sh, b, h, i0 + r);
    stats[r] = RowStats<acc_t>{};
  }
  const KeyRange tile = tile_keys(a.pattern, sh, i0, rows);
  for (int64_t j0 = tile.lo; j0 < tile.hi; j0 += kKvBlock) {
    const int64_t n = std::min(kKvBlock, tile.hi - j0);
    block_gemm<acc_t>(rows, n, sh.head_dim, q, a.q.sl, kt + j0, a.kt.sl, s_buf.data(), n, false);
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

at::Tensor attention_sparsity_cpu(const at::Tensor& query, const at::Tensor& key,
                                  SparsityKind kind, const AttentionCall& call) {
  const AttentionShape& sh = call.shape;
  const at::ScalarType acc = call.acc;
  const at::Tensor q = gemm_operand(query, acc), kt = transposed_copy(key, acc);
  at::Tensor out = at::empty({sh.batch, sh.heads, sh.q_len}, query.options().dtype(acc));

  AT_DISPATCH_FLOATING_TYPES(acc, "entropy_attn_attention_sparsity_cpu", [&] {
    SparsityArgs<scalar_t> a{};
    a.shape = sh;
    a.q = Strided4<scalar_t>::of(q), a.kt = Strided4<scalar_t>::of(kt);
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
