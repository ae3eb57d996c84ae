#include "attention_host.h"

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <vector>

#include "../reduction_dim.h"
#include "family.h"
#include "sm90/launch.h"

namespace entropy_attn::cuda {
namespace {

View4 view_of(const at::Tensor& t) {
  return {t.const_data_ptr(), t.stride(0), t.stride(1), t.stride(2)};
}
OutView4 out_view_of(const at::Tensor& t) {
  return {t.data_ptr(), t.stride(0), t.stride(1), t.stride(2)};
}

// The pattern's pointers (documents, sinks) are those of the call's tensors, on the device.
template <typename acc_t>
void fill_attention_args(AttentionArgs<acc_t>& a, const AttentionShape& sh, const at::Tensor& q,
                         const at::Tensor& k, const at::Tensor& v,
                         const std::optional<at::Tensor>& mask, const CallPattern& call) {
  a.q = view_of(q), a.k = view_of(k), a.v = view_of(v);
  a.batch = sh.batch, a.heads = sh.heads, a.kv_heads = sh.kv_heads;
  a.q_len = sh.q_len, a.kv_len = sh.kv_len, a.head_dim = sh.head_dim, a.v_head_dim = sh.v_head_dim;
  a.mask = make_mask_arg<acc_t>(mask);
  a.pattern = call.key_pattern();
  a.softcap = call.options.logit_softcap<acc_t>();
  a.sinks = call.sink_data<acc_t>();
  a.dropout = call.dropout<acc_t>();
}

template <typename acc_t>
const acc_t* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<acc_t>() : nullptr;
}

}  // namespace

void check_cuda_limits(const AttentionShape& s, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(s.head_dim <= kMaxHeadDim && s.v_head_dim <= kMaxHeadDim,
                    "head_dim and v_head_dim must be at most ", kMaxHeadDim,
                    " on CUDA, got head_dim=", s.head_dim, " and v_head_dim=", s.v_head_dim);
  TORCH_CHECK_VALUE(dtype != at::kDouble ||
                        (s.head_dim <= kMaxHeadDimFloat64 && s.v_head_dim <= kMaxHeadDimFloat64),
                    "float64 attention on CUDA supports head_dim and v_head_dim up to ",
                    kMaxHeadDimFloat64, ", got head_dim=", s.head_dim,
                    " and v_head_dim=", s.v_head_dim, ": use float32, or run float64 on the CPU");
  // The kernels index their grids (batch x heads x tiles of at least 16 rows) in 32 bits.
  const int64_t blocks = s.batch * s.heads * ((std::max(s.q_len, s.kv_len) + 15) / 16);
  TORCH_CHECK_VALUE(blocks < std::numeric_limits<int32_t>::max(),
                    "batch * heads * ceil(max(q_len, kv_len) / 16) = ", blocks,
                    " exceeds the CUDA kernels' grid limit of 2^31 - 1 thread blocks: split the "
                    "batch");
  // The per-row kernels (the backward's preprocess, split-KV's combine) give each query row a
  // warp, four to a block.
  const int64_t row_blocks = (s.batch * s.heads * s.q_len + 3) / 4;
  TORCH_CHECK_VALUE(row_blocks < std::numeric_limits<int32_t>::max(),
                    "batch * heads * ceil(q_len / 4) = ", row_blocks,
                    " exceeds the CUDA kernels' grid limit of 2^31 - 1 thread blocks: split the "
                    "batch");
}

LogitsInputs::LogitsInputs(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                           const AttentionCall& c)
    : call(c) {
  check_cuda_limits(call.shape, call.dtype);
  q = with_unit_last_stride(query, call.dtype);
  k = with_unit_last_stride(key, call.dtype);
  v = with_unit_last_stride(value, call.dtype);
}

template <typename acc_t>
void LogitsInputs::fill(AttentionArgs<acc_t>& a, ScalePolicy<acc_t>& scale) const {
  fill_attention_args(a, call.shape, q, k, v, call.mask, call);
  scale = call.scale_policy<acc_t>();
}

ForwardCall::ForwardCall(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                         const AttentionCall& c)
    : LogitsInputs(query, key, value, c), outputs(c.allocate_outputs(query)) {}

template <typename acc_t>
FwdParams<acc_t> ForwardCall::params() const {
  FwdParams<acc_t> p;
  fill(p, p.scale);
  const auto& [out, lse, entropy, sum_p2, max_weight, n_keys, row_scale, length_factor,
               normalized_entropy, sparsity, effective_keys] = outputs;
  p.out = out_view_of(out);
  p.lse = lse.data_ptr<acc_t>();
  p.row_scale = row_scale.data_ptr<acc_t>(), p.length_factor = length_factor.data_ptr<acc_t>();
  p.n_keys = n_keys.data_ptr<int64_t>();
  if (call.options.return_stats) {  // else the statistic pointers stay null
    p.entropy = entropy.data_ptr<acc_t>(), p.sum_p2 = sum_p2.data_ptr<acc_t>();
    p.max_weight = max_weight.data_ptr<acc_t>();
    p.normalized_entropy = normalized_entropy.data_ptr<acc_t>();
    p.sparsity = sparsity.data_ptr<acc_t>();
    p.effective_keys = effective_keys.data_ptr<acc_t>();
  }
  return p;
}
template FwdParams<float> ForwardCall::params<float>() const;
template FwdParams<double> ForwardCall::params<double>() const;

BackwardCall::BackwardCall(const at::Tensor& grad_output, const at::Tensor& query,
                           const at::Tensor& key, const at::Tensor& value, const at::Tensor& output,
                           const AttentionBackwardCall& c)
    : call(c), given_query(query), given_key(key), given_value(value) {
  const AttentionShape& sh = call.shape;
  check_cuda_limits(sh, call.dtype);
  q = with_unit_last_stride(query, call.dtype);
  k = with_unit_last_stride(key, call.dtype);
  v = with_unit_last_stride(value, call.dtype);
  out = with_unit_last_stride(output, call.dtype);
  dout = with_unit_last_stride(grad_output, call.dtype);
}

void BackwardCall::allocate(Family f) {
  const AttentionShape& sh = call.shape;
  family = f;
  const auto opts = q.options().dtype(call.acc);
  delta = at::empty({sh.batch, sh.heads, sh.q_len}, opts);
  // G packed, or in whole padded query blocks for the Hopper backward's bulk reductions.
  dq_layout = f == Family::kSm90 && hopper_bulk_dq(call)
                  ? sm90::bulk_dq_accum(sh.q_len, sh.head_dim)
                  : packed_dq_accum(sh.q_len, sh.head_dim);
  g = at::zeros({sh.batch, sh.heads, dq_layout.rows, dq_layout.ld}, opts);
  // The Hopper and the fallback backwards under deterministic algorithms add G in turns
  // (params.h): the Hopper family's counter per (batch, head, query block), which its preprocess
  // starts (dq_turns: sm90/bwd_kernel.cuh); the fallback's per query row, zero-filled, for its
  // tiles of any size (tile_turns: fallback/turns.cuh), which a tensor-core call's guard takes too.
  if (at::globalContext().deterministicAlgorithms()) {
    const auto opts_int = q.options().dtype(at::kInt);
    if (f == Family::kSm90) {
      dq_turns = at::empty({sh.batch, sh.heads, sm90::turn_blocks(dq_layout.rows)}, opts_int);
    }
    tile_turns = at::zeros({sh.batch, sh.heads, sh.q_len}, opts_int);
  }
  // Every key row of dk and dv is written by the kernels, including keys no query sees (zeros).
  if (f == Family::kFallback) {
    dk = at::empty({sh.batch, sh.heads, sh.kv_len, sh.head_dim}, opts);
    dv = at::empty({sh.batch, sh.heads, sh.kv_len, sh.v_head_dim}, opts);
  } else {
    // (Their rows stay 16-byte aligned: strides are multiples of the head dim, a compiled bucket.)
    dq = empty_in_layout_of(given_query, {sh.batch, sh.heads, sh.q_len, sh.head_dim}, q.options());
    dk =
        empty_in_layout_of(given_key, {sh.batch, sh.kv_heads, sh.kv_len, sh.head_dim}, q.options());
    dv = empty_in_layout_of(given_value, {sh.batch, sh.kv_heads, sh.kv_len, sh.v_head_dim},
                            q.options());
    if (call.grad_row_scale) dlam = at::empty({sh.batch, sh.heads, sh.q_len}, opts);
  }
}

template <typename acc_t>
BwdParams<acc_t> BackwardCall::params() const {
  BwdParams<acc_t> p;
  fill_attention_args(p, call.shape, q, k, v, call.mask, call);
  p.out = view_of(out), p.dout = view_of(dout);
  p.lse = call.lse.const_data_ptr<acc_t>(), p.entropy = call.entropy.const_data_ptr<acc_t>();
  p.sum_p2 = call.sum_p2.const_data_ptr<acc_t>();
  p.row_scale = call.row_scale.const_data_ptr<acc_t>();
  p.g_lse = ptr_or_null<acc_t>(call.g_lse), p.g_entropy = ptr_or_null<acc_t>(call.g_entropy);
  p.g_sum_p2 = ptr_or_null<acc_t>(call.g_sum_p2);
  p.delta = delta.data_ptr<acc_t>();
  p.dq_accum = g.data_ptr<acc_t>();
  p.dq_layout = dq_layout;
  p.d_logits = call.logit_grad_arg<acc_t>();
  p.dq_turns = dq_turns.defined() ? dq_turns.data_ptr<int>() : nullptr;
  p.tile_turns = tile_turns.defined() ? tile_turns.data_ptr<int>() : nullptr;
  if (family == Family::kFallback) {
    p.dk = dk.data_ptr<acc_t>(), p.dv = dv.data_ptr<acc_t>();
  } else {
    p.dq_out = out_view_of(dq), p.dk_out = out_view_of(dk), p.dv_out = out_view_of(dv);
    p.d_row_scale = dlam.defined() ? dlam.data_ptr<acc_t>() : nullptr;
    p.deterministic = at::globalContext().deterministicAlgorithms();
  }
  return p;
}
template BwdParams<float> BackwardCall::params<float>() const;
template BwdParams<double> BackwardCall::params<double>() const;

AttentionGrads BackwardCall::finish() const {
  // (d lambda in the accumulate type, undefined where the call does not ask for it:
  // attention_backward_kernel)
  if (family != Family::kFallback) return {dq, dk, dv, dlam};
  const AttentionShape& sh = call.shape;
  // G = sum_j dS_ij k_j: dq_i = lambda_i G_i and d lambda_i = q_i . G_i (s_ij = lambda_i q_i.k_j).
  // dq is formed in the input type and the query's layout in the same pass.
  at::Tensor grad_q = empty_in_layout_of(given_query, g.sym_sizes(), g.options().dtype(call.dtype));
  at::mul_out(grad_q, g, call.row_scale.unsqueeze(-1));
  const at::Tensor dlam = call.grad_row_scale ? (q.to(g.scalar_type()) * g).sum(-1) : at::Tensor();
  at::Tensor dk_sum = dk, dv_sum = dv;
  if (sh.heads != sh.kv_heads) {  // GQA: sum the per-query-head dK, dV over each group
    dk_sum = dk.view({sh.batch, sh.kv_heads, sh.group(), sh.kv_len, sh.head_dim}).sum(2);
    dv_sum = dv.view({sh.batch, sh.kv_heads, sh.group(), sh.kv_len, sh.v_head_dim}).sum(2);
  }
  return {grad_q, in_layout_of(given_key, dk_sum, call.dtype),
          in_layout_of(given_value, dv_sum, call.dtype), dlam};
}

at::Tensor use_full_mask_grad(AttentionBackwardCall& call) {
  const AttentionShape& s = call.shape;
  const std::array<int64_t, 4> full{s.batch, s.heads, s.q_len, s.kv_len};
  at::Tensor mask_grad = call.grad_logits;
  if (!mask_grad.defined() || mask_grad.sizes() == at::IntArrayRef(full)) return {};
  call.grad_logits = at::zeros(full, mask_grad.options());
  return mask_grad;
}

void sum_full_mask_grad(const AttentionBackwardCall& call, const at::Tensor& mask_grad) {
  mask_grad.copy_(call.grad_logits.sum_to_size(mask_grad.sizes()));
}

SparsityCall::SparsityCall(const at::Tensor& query, const at::Tensor& key, SparsityKind kind_,
                           const AttentionCall& c)
    : LogitsInputs(query, key, key, c),
      kind(kind_),
      out(at::empty({c.shape.batch, c.shape.heads, c.shape.q_len}, query.options().dtype(c.acc))) {}

template <typename acc_t>
SparsityParams<acc_t> SparsityCall::params() const {
  SparsityParams<acc_t> p;
  fill(p, p.scale);
  p.kind = kind;
  p.out = out.data_ptr<acc_t>();
  return p;
}
template SparsityParams<float> SparsityCall::params<float>() const;
template SparsityParams<double> SparsityCall::params<double>() const;

RowReductionCall prepare_row_reduction(const at::Tensor& x, int64_t dim, const char* name) {
  const int64_t d = checked_reduction_dim(x, dim, name);
  RowReductionCall c;
  c.rows = element_aligned(x.movedim(d, -1).contiguous());
  std::vector<int64_t> out_sizes = x.sizes().vec();
  out_sizes.erase(out_sizes.begin() + d);
  c.out = at::empty(out_sizes, x.options());
  TORCH_CHECK_VALUE(c.out.numel() / 4 < std::numeric_limits<int32_t>::max(), name, " has ",
                    c.out.numel(), " rows, more than the CUDA kernel's grid allows");
  return c;
}

RowReductionParams RowReductionCall::params() const {
  return {rows.const_data_ptr(), out.data_ptr(), out.numel(), rows.size(-1)};
}

}  // namespace entropy_attn::cuda
