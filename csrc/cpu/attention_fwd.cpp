// CPU forward of the fused attention with per-row statistics (FlashAttention-2 structure):
// tasks are (batch, head, query block); each streams key/value blocks of kKvBlock keys, keeping the
// online statistics of online_stats.h per row. No L_q x L_k buffer is ever formed.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
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

// A 16-bit (B, heads, L, dim) operand as given: its data, type and strides (unit last stride).
struct Raw16 {
  const void* data = nullptr;
  at::ScalarType dtype = at::kBFloat16;
  int64_t sb = 0, sh = 0, sl = 0;
  static Raw16 of(const at::Tensor& t) {
    return {t.const_data_ptr(), t.scalar_type(), t.stride(0), t.stride(1), t.stride(2)};
  }
};

// Rows j0 .. j0 + n of (b, h) of a 16-bit operand in acc_t: dst[j * ld + d], or transposed,
// dst[d * ld + j].
template <typename acc_t>
void load_rows(const Raw16& x, int64_t b, int64_t h, int64_t j0, int64_t n, int64_t dim, acc_t* dst,
               int64_t ld, bool transposed) {
  AT_DISPATCH_REDUCED_FLOATING_TYPES(x.dtype, "entropy_attn_load_rows", [&] {
    const scalar_t* src = static_cast<const scalar_t*>(x.data) + b * x.sb + h * x.sh + j0 * x.sl;
    if (transposed) return transpose_block(n, dim, src, x.sl, dst, ld);
    for (int64_t j = 0; j < n; ++j) {
      const scalar_t* row = src + j * x.sl;
      for (int64_t d = 0; d < dim; ++d) dst[j * ld + d] = static_cast<acc_t>(row[d]);
    }
  });
}

template <typename acc_t>
struct FwdArgs {
  AttentionShape shape;
  // kt: K transposed, (B, Hkv, D, Lk); or, where key_blocks_transposed (transposes_key_blocks),
  // k: K as given.
  Strided4<acc_t> q, kt, k, v;
  bool key_blocks_transposed;
  // Where key_blocks_transposed and the inputs are 16-bit: K and V as given (k and v unused), each
  // block converted as it streams, since a conversion of the whole cache is as costly as the copy
  // it replaces (bfloat16 decoding took 3.8x SDPA's time with it).
  Raw16 k16, v16;
  NonFiniteRows v_nonfinite;  // the value rows holding a NaN or an infinity
  MaskArg<acc_t> mask;
  ScalePolicy<acc_t> scale;
  KeyPattern pattern;
  Softcap<acc_t> softcap;
  const acc_t* sinks;  // (H,), or null
  Dropout<acc_t> dropout;
  // Outputs, contiguous: out (B, H, Lq, Dv); the rest (B, H, Lq).
  acc_t *out, *lse, *entropy, *sum_p2, *max_weight, *row_scale, *length_factor;
  int64_t* n_keys;
  // The statistics (null without return_stats): entropy, sum_p2, max_weight above and these.
  acc_t *normalized_entropy, *sparsity, *effective_keys;
  bool with_stats;
};

// A thread's buffers: scores of one block (rows x key_block_capacity), the output accumulator
// (rows x Dv), the per-row state, scratch for a value block with non-finite rows, and (allocated
// at first use) where transposes_key_blocks a key block transposed (D x key_block_capacity), or
// for few rows of 16-bit keys converted as stored (key_block_capacity x D).
template <typename acc_t>
struct FwdBuffers {
  std::vector<acc_t> s, o, scratch, kt, v;  // v: a value block converted from 16 bits
  std::vector<uint8_t> v_flags;             // its non-finite rows
  std::vector<RowSetup<acc_t>> setup;
  std::vector<RowStats<acc_t>> stats;
  FwdBuffers(int64_t rows, const AttentionShape& sh)
      : s(rows * key_block_capacity(sh)), o(rows * sh.v_head_dim), setup(rows), stats(rows) {}
};

template <typename acc_t>
void forward_task(const FwdArgs<acc_t>& a, FwdBuffers<acc_t>& buf, int64_t b, int64_t h, int64_t i0,
                  int64_t rows) {
  const AttentionShape& sh = a.shape;
  const int64_t kvh = h / sh.group();
  const int64_t D = sh.head_dim, Dv = sh.v_head_dim;
  const acc_t* q = a.q.at(b, h, i0);
  const bool per_block = a.key_blocks_transposed;
  const acc_t* kt = per_block ? nullptr : a.kt.at(b, kvh);
  const bool convert = a.k16.data != nullptr;
  const acc_t* k = per_block && !convert ? a.k.at(b, kvh) : nullptr;
  const acc_t* v = convert ? nullptr : a.v.at(b, kvh);
  const uint8_t* v_flags = a.v_nonfinite.at(b, kvh);
  // (kt only where a block is transposed or converted: float rows read as stored need none)
  if (per_block && (convert || rows > kKeyRowScoreRows) && buf.kt.empty()) {
    buf.kt.resize(D * key_block_capacity(sh));
  }
  if (convert && buf.v.empty()) {
    buf.v.resize(key_block_capacity(sh) * Dv), buf.v_flags.resize(key_block_capacity(sh));
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
  for (int64_t j0 = tile.lo; j0 < tile.hi; j0 += kKvBlock) {
    const int64_t n = std::min(kKvBlock, tile.hi - j0);
    if (per_block && rows <= kKeyRowScoreRows) {
      // (16-bit keys converted as stored, unit column stride: D apart)
      if (convert) load_rows(a.k16, b, kvh, j0, n, D, buf.kt.data(), D, /*transposed=*/false);
      const acc_t* k_rows = convert ? buf.kt.data() : k + j0 * a.k.sl;
      key_row_scores(rows, n, D, q, a.q.sl, k_rows, convert ? D : a.k.sl, s_buf.data(), n);
    } else if (per_block) {
      if (convert) {
        load_rows(a.k16, b, kvh, j0, n, D, buf.kt.data(), n, /*transposed=*/true);
      } else {
        transpose_block(n, D, k + j0 * a.k.sl, a.k.sl, buf.kt.data(), n);
      }
      block_gemm<acc_t>(rows, n, D, q, a.q.sl, buf.kt.data(), n, s_buf.data(), n, false);
    } else {
      block_gemm<acc_t>(rows, n, D, q, a.q.sl, kt + j0, a.kt.sl, s_buf.data(), n, false);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const RowSetup<acc_t>& row = buf.setup[r];
      acc_t* p = s_buf.data() + r * n;
      const acc_t alpha =
          softmax_row(p, n, j0, {row.keys, row.lam, a.softcap, MaskRow<acc_t>(a.mask, b, h, i0 + r)},
                      stats[r], a.with_stats);
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
    // O += P V, a non-finite value reaching only the rows that see its key.
    const acc_t* v_block = convert ? buf.v.data() : v + j0 * a.v.sl;
    const int64_t ld_v = convert ? Dv : a.v.sl;
    const uint8_t* block_flags = v_flags ? v_flags + j0 : nullptr;
    if (convert) {
      load_rows(a.v16, b, kvh, j0, n, Dv, buf.v.data(), Dv, /*transposed=*/false);
      for (int64_t j = 0; j < n; ++j) buf.v_flags[j] = has_nonfinite(buf.v.data() + j * Dv, Dv);
      block_flags = any_flagged(buf.v_flags.data(), n) ? buf.v_flags.data() : nullptr;
    }
    product_seen_rows_of_b<acc_t>(rows, Dv, n, s_buf.data(), n, v_block, ld_v, o_buf.data(), Dv,
                                  true, block_flags, buf.scratch, [&](int64_t r, int64_t j) {
                                    return row_sees(a.mask, a.pattern, sh, b, h, i0 + r, j0 + j);
                                  });
  }

  for (int64_t r = 0; r < rows; ++r) {
    const RowResult<acc_t> res = finalize(stats[r]);
    const acc_t* o = o_buf.data() + r * Dv;
    acc_t* out = a.out + (row0 + r) * Dv;
#pragma omp simd
    for (int64_t d = 0; d < Dv; ++d) out[d] = o[d] * res.inv_l;
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
}

AttentionOutputs attention_cpu(const at::Tensor& query, const at::Tensor& key,
                               const at::Tensor& value, const AttentionCall& call) {
  const AttentionShape& sh = call.shape;
  const at::ScalarType acc = call.acc;
  const at::Tensor q = gemm_operand(query, acc);
  const bool per_block = transposes_key_blocks(sh, call.key_pattern());
  const bool convert = per_block && call.dtype != acc;  // 16-bit K and V converted per block
  const at::Tensor k = convert     ? with_unit_last_stride(key, call.dtype)
                       : per_block ? gemm_operand(key, acc)
                                   : transposed_copy(key, acc);
  const at::Tensor v =
      convert ? with_unit_last_stride(value, call.dtype) : gemm_operand(value, acc);
  AttentionOutputs outputs = call.allocate_outputs(query);
  auto& [out_t, lse, entropy, sum_p2, max_weight, n_keys, row_scale, length_factor,
         normalized_entropy, sparsity, effective_keys] = outputs;
  // The kernel accumulates the output in `acc`; 16-bit inputs round once at the end.
  at::Tensor out = out_t.scalar_type() == acc ? out_t : at::empty_like(out_t, out_t.options().dtype(acc));

  AT_DISPATCH_FLOATING_TYPES(acc, "entropy_attn_forward_cpu", [&] {
    FwdArgs<scalar_t> a{};
    a.shape = sh;
    a.q = Strided4<scalar_t>::of(q);
    a.key_blocks_transposed = per_block;
    if (convert) {  // (the value blocks' non-finite rows are found as they load)
      a.k16 = Raw16::of(k);
      a.v16 = Raw16::of(v);
    } else {
      (per_block ? a.k : a.kt) = Strided4<scalar_t>::of(k);
      a.v = Strided4<scalar_t>::of(v);
      a.v_nonfinite = NonFiniteRows::of(a.v, sh.batch, sh.kv_heads, sh.kv_len, sh.v_head_dim);
    }
    a.mask = call.mask_arg<scalar_t>();
    a.scale = call.scale_policy<scalar_t>();
    a.pattern = call.key_pattern();
    a.softcap = call.options.logit_softcap<scalar_t>();
    a.sinks = call.sink_data<scalar_t>();
    a.dropout = call.dropout<scalar_t>();
    a.out = out.data_ptr<scalar_t>(), a.lse = lse.data_ptr<scalar_t>();
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
        });
  });
  if (!out.is_same(out_t)) out_t.copy_(out);
  return outputs;
}

}  // namespace

TORCH_LIBRARY_IMPL(entropy_attn, CPU, m) {
  m.impl("attention", &attention_kernel<attention_cpu>);
}

}  // namespace entropy_attn::cpu
