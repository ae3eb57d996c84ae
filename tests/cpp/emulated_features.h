// The features the tensor-core families' general (causal) instantiations take, run on the CPU
// (sm80_emulation.h, sm90_emulation.h): windows, bottom-right alignment, softcap, sinks and
// dropout, forward and backward, through the op's own call preparation (prepare_attention;
// cuda/attention_host.h: the parameters the op gives the kernels) against the CPU op of the same
// call (the same Philox stream for dropout); and packed documents (varlen), which the CPU op takes
// in another layout, against the emulated fallback kernels on the same parameters (which
// test_cuda_emulation.cpp checks against its float64 reference). A family is a type with
//   static constexpr ec::Family kFamily;
//   template <typename T, int kD, MaskKind kMask = MaskKind::kNone>
//   static void forward(const ec::FwdParams<float>&);   // the general instantiations, no mask
//   template <typename T, int kD, MaskKind kMask = MaskKind::kNone>
//   static void backward(const ec::BwdParams<float>&);  // (an additive one for run_mask_grad)
// Include after the family's emulation header.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include "attention_call.h"
#include "cuda/attention_host.h"
#include "emulated_launches.h"
#include "entropy_attn.h"
#include "kernel_harness.h"

namespace emulated_features {

namespace ec = entropy_attn::cuda;
namespace eh = entropy_attn::harness;
using entropy_attn::MaskKind;

struct Feature {
  bool causal = true;
  std::array<int64_t, 2> window{-1, -1};
  const char* alignment = "top_left";
  double softcap = 0;
  bool sinks = false;
  double dropout_p = 0;
  int64_t q_len = 150, kv_len = 150;
  // q, k, v and dout as views of (B, L, H, D) (projections split into heads), which the op's
  // output and gradients follow (attention_call.h: empty_in_layout_of).
  bool heads_inside_rows = false;
  // The backward with the entropy's gradient (the kernels' steps that keep the logits), or of the
  // output alone (the others: a call that caps or drops takes the first kind anyway).
  bool entropy_grad = true;
};

// (B, H, L, D) random values, as a view of (B, L, H, D) memory or contiguous.
at::Tensor random_bhld(int64_t b, int64_t h, int64_t l, int64_t d, const at::TensorOptions& opt,
                       bool heads_inside_rows) {
  return heads_inside_rows ? at::randn({b, l, h, d}, opt).transpose(1, 2)
                           : at::randn({b, h, l, d}, opt);
}

// Whether an output (B, H, L, D) lies in (B, L, H, D) memory.
bool heads_inside_rows(const at::Tensor& out) {
  return out.transpose(1, 2).is_contiguous() && !out.is_contiguous();
}

// ||a - e|| / ||e|| in float64.
double rel_norm(const at::Tensor& a, const at::Tensor& e) {
  const at::Tensor d = a.to(at::kDouble) - e.to(at::kDouble);
  return (d.norm() / e.to(at::kDouble).norm().clamp_min(1e-30)).item<double>();
}

template <typename Family, typename T, int kD>
void run_feature(const Feature& f) {
  const at::ScalarType dtype = std::is_same_v<T, __half> ? at::kHalf : at::kBFloat16;
  at::manual_seed(21);
  const auto opt = at::TensorOptions().dtype(dtype);
  const at::Tensor q = random_bhld(1, 4, f.q_len, kD, opt, f.heads_inside_rows),
                   k = random_bhld(1, 2, f.kv_len, kD, opt, f.heads_inside_rows),
                   v = random_bhld(1, 2, f.kv_len, kD, opt, f.heads_inside_rows),
                   dout = random_bhld(1, 4, f.q_len, kD, opt, f.heads_inside_rows);
  const std::optional<at::Tensor> g_entropy =
      f.entropy_grad ? std::optional<at::Tensor>(at::randn({1, 4, f.q_len})) : std::nullopt;
  const std::optional<at::Tensor> sinks =
      f.sinks ? std::optional<at::Tensor>(at::randn({4}, opt)) : std::nullopt;
  const int64_t seed = 0x5eed;
  const entropy_attn::AttentionOptions o = entropy_attn::AttentionOptions::from_schema(
      f.causal, std::nullopt, "logn", 1.0, 64.0, /*enable_gqa=*/true, /*return_stats=*/true,
      f.window, f.alignment, f.softcap, f.dropout_p, seed);

  const entropy_attn::AttentionCall call =
      entropy_attn::prepare_attention(q, k, v, std::nullopt, std::nullopt, sinks, {}, o);
  const ec::ForwardCall fwd(q, k, v, call);
  Family::template forward<T, kD>(fwd.params<float>());
  const at::Tensor &out = std::get<0>(fwd.outputs), &lse = std::get<1>(fwd.outputs);
  const at::Tensor &entropy = std::get<2>(fwd.outputs), &sum_p2 = std::get<3>(fwd.outputs);
  const at::Tensor &n_keys = std::get<5>(fwd.outputs), &row_scale = std::get<6>(fwd.outputs);

  const entropy_attn::AttentionResult r = entropy_attn::attention(
      q, k, v, std::nullopt, std::nullopt, f.causal, std::nullopt, "logn", 1.0, 64.0, true, true,
      f.window, f.alignment, f.softcap, sinks, f.dropout_p, seed);
  const eh::Tolerance tol = eh::tolerance<T>();
  EXPECT_LT(rel_norm(out, r.output), tol.grad) << "output";
  EXPECT_LT(rel_norm(lse, r.lse), tol.rtol) << "lse";
  EXPECT_LT(rel_norm(entropy, r.entropy), tol.rtol) << "entropy";
  EXPECT_LT(rel_norm(sum_p2, r.sum_p2), tol.rtol) << "sum_p2";
  EXPECT_TRUE(at::equal(n_keys, r.n_keys)) << "n_keys";
  EXPECT_EQ(heads_inside_rows(out), f.heads_inside_rows) << "the output's layout";

  const entropy_attn::AttentionBackwardCall bcall = entropy_attn::prepare_attention_backward(
      dout, std::nullopt, g_entropy, std::nullopt, q, k, v, std::nullopt, out, lse, entropy, sum_p2,
      row_scale, sinks, {}, o, /*grad_mask=*/false, /*grad_scale=*/true);
  ec::BackwardCall bwd(dout, q, k, v, out, bcall);
  bwd.allocate(Family::kFamily);
  Family::template backward<T, kD>(bwd.params<float>());
  const entropy_attn::AttentionGrads got = bwd.finish();
  const entropy_attn::AttentionBackwardOutputs want = entropy_attn::call_attention_backward(
      dout, std::nullopt, g_entropy, std::nullopt, q, k, v, std::nullopt, r.output, r.lse,
      r.entropy, r.sum_p2, r.row_scale, sinks, {}, o);
  EXPECT_LT(rel_norm(std::get<0>(got), std::get<0>(want)), tol.grad) << "grad_query";
  EXPECT_LT(rel_norm(std::get<1>(got), std::get<1>(want)), tol.grad) << "grad_key";
  EXPECT_LT(rel_norm(std::get<2>(got), std::get<2>(want)), tol.grad) << "grad_value";
  EXPECT_LT(rel_norm(std::get<3>(got), std::get<3>(want)), tol.grad) << "grad_row_scale";
  EXPECT_EQ(heads_inside_rows(std::get<0>(got)), f.heads_inside_rows) << "grad_query's layout";
  EXPECT_EQ(heads_inside_rows(std::get<1>(got)), f.heads_inside_rows) << "grad_key's layout";
  EXPECT_EQ(heads_inside_rows(std::get<2>(got)), f.heads_inside_rows) << "grad_value's layout";
}

// Packed documents: q (1, H, cu_q.back(), D) and k, v (1, Hkv, cu_k.back(), D), views of (T, H, D)
// as the varlen op passes them (so are the gradients), cut into documents by cu_q and cu_k
// (causality and windows bottom-right aligned within each: key_ranges.cuh), one call's parameters
// launched through the family and the fallback.
template <typename Family, typename T, int kD>
void run_documents(const std::vector<int32_t>& cu_q, const std::vector<int32_t>& cu_k, bool causal,
                   std::array<int64_t, 2> window, bool entropy_grad = true) {
  const at::ScalarType dtype = std::is_same_v<T, __half> ? at::kHalf : at::kBFloat16;
  at::manual_seed(22);
  const auto opt = at::TensorOptions().dtype(dtype);
  const int64_t lq = cu_q.back(), lk = cu_k.back();
  const at::Tensor q = random_bhld(1, 4, lq, kD, opt, true),
                   k = random_bhld(1, 2, lk, kD, opt, true),
                   v = random_bhld(1, 2, lk, kD, opt, true),
                   dout = random_bhld(1, 4, lq, kD, opt, true);
  const std::optional<at::Tensor> g_entropy =
      entropy_grad ? std::optional<at::Tensor>(at::randn({1, 4, lq})) : std::nullopt;
  const auto int32 = [](const std::vector<int32_t>& x) {
    return at::tensor(at::ArrayRef<int32_t>(x), at::TensorOptions().dtype(at::kInt));
  };
  const entropy_attn::DocumentArgs docs{int32(cu_q), int32(cu_k), std::nullopt, std::nullopt};
  const entropy_attn::AttentionOptions o = entropy_attn::AttentionOptions::from_schema(
      causal, std::nullopt, "logn", 1.0, 64.0, /*enable_gqa=*/true, /*return_stats=*/true, window,
      "bottom_right", 0.0, 0.0, 0);
  const entropy_attn::AttentionCall call =
      entropy_attn::prepare_attention(q, k, v, std::nullopt, std::nullopt, std::nullopt, docs, o);
  const ec::ForwardCall tc(q, k, v, call), fb(q, k, v, call);
  Family::template forward<T, kD>(tc.params<float>());
  emulated::launch_forward<T>(fb.params<float>());
  const eh::Tolerance tol = eh::tolerance<T>();
  const char* names[] = {"output", "lse", "entropy", "sum_p2"};
  EXPECT_LT(rel_norm(std::get<0>(tc.outputs), std::get<0>(fb.outputs)), tol.grad) << names[0];
  EXPECT_LT(rel_norm(std::get<1>(tc.outputs), std::get<1>(fb.outputs)), tol.rtol) << names[1];
  EXPECT_LT(rel_norm(std::get<2>(tc.outputs), std::get<2>(fb.outputs)), tol.rtol) << names[2];
  EXPECT_LT(rel_norm(std::get<3>(tc.outputs), std::get<3>(fb.outputs)), tol.rtol) << names[3];
  EXPECT_TRUE(at::equal(std::get<5>(tc.outputs), std::get<5>(fb.outputs))) << "n_keys";
  EXPECT_TRUE(heads_inside_rows(std::get<0>(tc.outputs))) << "the output's layout";

  const auto& f = fb.outputs;  // (both backwards from the fallback's forward)
  const entropy_attn::AttentionBackwardCall bcall = entropy_attn::prepare_attention_backward(
      dout, std::nullopt, g_entropy, std::nullopt, q, k, v, std::nullopt, std::get<0>(f),
      std::get<1>(f), std::get<2>(f), std::get<3>(f), std::get<6>(f), std::nullopt, docs, o,
      /*grad_mask=*/false, /*grad_scale=*/true);
  ec::BackwardCall tb(dout, q, k, v, std::get<0>(f), bcall),
      bb(dout, q, k, v, std::get<0>(f), bcall);
  tb.allocate(Family::kFamily);
  bb.allocate(ec::Family::kFallback);
  Family::template backward<T, kD>(tb.params<float>());
  emulated::launch_backward<T>(bb.params<float>());
  const entropy_attn::AttentionGrads got = tb.finish(), want = bb.finish();
  EXPECT_LT(rel_norm(std::get<0>(got), std::get<0>(want)), tol.grad) << "grad_query";
  EXPECT_LT(rel_norm(std::get<1>(got), std::get<1>(want)), tol.grad) << "grad_key";
  EXPECT_LT(rel_norm(std::get<2>(got), std::get<2>(want)), tol.grad) << "grad_value";
  EXPECT_LT(rel_norm(std::get<3>(got), std::get<3>(want)), tol.grad) << "grad_row_scale";
  const char* layouts[] = {"grad_query's layout", "grad_key's layout", "grad_value's layout"};
  EXPECT_TRUE(heads_inside_rows(std::get<0>(got))) << layouts[0];
  EXPECT_TRUE(heads_inside_rows(std::get<1>(got))) << layouts[1];
  EXPECT_TRUE(heads_inside_rows(std::get<2>(got))) << layouts[2];
  EXPECT_TRUE(heads_inside_rows(std::get<0>(want))) << layouts[0] << " (fallback)";
  EXPECT_TRUE(heads_inside_rows(std::get<1>(want))) << layouts[1] << " (fallback)";
  EXPECT_TRUE(heads_inside_rows(std::get<2>(want))) << layouts[2] << " (fallback)";
}

// The additive mask's gradient through the op's own call preparation (grad_mask: an accumulator
// with the mask's sizes, seen as (B, H, Lq, Lk) with stride 0 along the dims it broadcasts along)
// and the family's masked backward, against the CPU op's backward of the same call: 2 batches,
// 4 query heads over 2 key/value heads, logn row scales, the gradients of lse and (entropy_grad)
// the entropy, `hidden` of the entries -inf. The mask in the inputs' dtype, as a model's learned
// bias is; with keep_dtype the kernels read it so, as the op's call preparation keeps it on a GPU
// (attention_inputs.h: keeps_mask_dtype; on the CPU it becomes float32), and the forward is
// emulated too. transposed: the mask (4-D) a transposed view at an odd storage offset, a slice of
// (B, H, Lk, Lq + 1) storage from element 1 of each row (strides ..., 1, Lq + 1: odd).
// full_grad: the gradient as deterministic algorithms take it (attention_host.h:
// use_full_mask_grad): a broadcast mask's written at the call's full shape and summed after.
template <typename Family, typename T, int kD>
void run_mask_grad(const std::vector<int64_t>& mask_sizes, bool causal, double dropout_p = 0,
                   double hidden = 0.2, bool keep_dtype = false, int64_t lk = 130,
                   bool transposed = false, bool entropy_grad = true, bool full_grad = false) {
  const at::ScalarType dtype = std::is_same_v<T, __half> ? at::kHalf : at::kBFloat16;
  at::manual_seed(23);
  const auto opt = at::TensorOptions().dtype(dtype);
  const int64_t lq = 100;
  const at::Tensor q = at::randn({2, 4, lq, kD}, opt), k = at::randn({2, 2, lk, kD}, opt),
                   v = at::randn({2, 2, lk, kD}, opt), dout = at::randn({2, 4, lq, kD}, opt);
  at::Tensor mask =
      (at::randn(mask_sizes) * 0.5).masked_fill(at::rand(mask_sizes) < hidden, -INFINITY).to(dtype);
  if (transposed) {
    const at::Tensor store =
        at::zeros({mask.size(0), mask.size(1), mask.size(3), mask.size(2) + 1}, mask.options());
    store.narrow(3, 1, mask.size(2)).copy_(mask.transpose(2, 3));
    mask = store.narrow(3, 1, mask.size(2)).transpose(2, 3);
    ASSERT_EQ(mask.storage_offset() % 2, 1);
    ASSERT_EQ(mask.stride(3) % 2, 1);
  }
  const std::optional<at::Tensor> g_lse(at::randn({2, 4, lq}));
  const std::optional<at::Tensor> g_entropy =
      entropy_grad ? std::optional<at::Tensor>(at::randn({2, 4, lq})) : std::nullopt;
  const int64_t seed = 0x5eed;
  const std::array<int64_t, 2> window{-1, -1};
  const entropy_attn::AttentionOptions o = entropy_attn::AttentionOptions::from_schema(
      causal, std::nullopt, "logn", 1.0, 64.0, /*enable_gqa=*/true, /*return_stats=*/true, window,
      "top_left", 0.0, dropout_p, seed);
  const entropy_attn::AttentionResult r =
      entropy_attn::attention(q, k, v, mask, std::nullopt, causal, std::nullopt, "logn", 1.0, 64.0,
                              true, true, window, "top_left", 0.0, std::nullopt, dropout_p, seed);

  const double tol = eh::tolerance<T>().grad;
  if (keep_dtype) {
    entropy_attn::AttentionCall call =
        entropy_attn::prepare_attention(q, k, v, mask, std::nullopt, std::nullopt, {}, o);
    call.mask = entropy_attn::expand_mask(mask, call.shape, call.acc, /*keep_dtype=*/true);
    const ec::ForwardCall fwd(q, k, v, call);
    Family::template forward<T, kD, MaskKind::kAdditive>(fwd.params<float>());
    EXPECT_LT(rel_norm(std::get<0>(fwd.outputs), r.output), tol) << "output";
    EXPECT_LT(rel_norm(std::get<1>(fwd.outputs), r.lse), eh::tolerance<T>().rtol) << "lse";
    EXPECT_LT(rel_norm(std::get<2>(fwd.outputs), r.entropy), eh::tolerance<T>().rtol) << "entropy";
    EXPECT_TRUE(at::equal(std::get<5>(fwd.outputs), r.n_keys)) << "n_keys";
  }
  entropy_attn::AttentionBackwardCall bcall = entropy_attn::prepare_attention_backward(
      dout, g_lse, g_entropy, std::nullopt, q, k, v, mask, r.output, r.lse, r.entropy, r.sum_p2,
      r.row_scale, std::nullopt, {}, o, /*grad_mask=*/true, /*grad_scale=*/true);
  if (keep_dtype) {
    ASSERT_EQ(bcall.mask->scalar_type(), at::kFloat) << "a CPU call converts the mask";
    bcall.mask = entropy_attn::expand_mask(mask, bcall.shape, bcall.acc, /*keep_dtype=*/true);
  }
  ec::BackwardCall bwd(dout, q, k, v, r.output, bcall);
  at::Tensor summed_into;  // full_grad: bcall's accumulator, which the full one is summed into
  if (full_grad) {
    summed_into = ec::use_full_mask_grad(bwd.call);
    ASSERT_EQ(summed_into.defined(), mask.numel() != 2 * 4 * lq * lk) << "a broadcast mask's only";
    ASSERT_EQ(bwd.call.grad_logits.sizes(), at::IntArrayRef({2, 4, lq, lk}));
  }
  bwd.allocate(Family::kFamily);
  Family::template backward<T, kD, MaskKind::kAdditive>(bwd.params<float>());
  const entropy_attn::AttentionGrads got = bwd.finish();
  if (summed_into.defined()) ec::sum_full_mask_grad(bwd.call, summed_into);
  const at::Tensor dmask = entropy_attn::mask_grad(mask, bcall, q);
  const entropy_attn::AttentionBackwardOutputs want = entropy_attn::call_attention_backward(
      dout, g_lse, g_entropy, std::nullopt, q, k, v, mask, r.output, r.lse, r.entropy, r.sum_p2,
      r.row_scale, std::nullopt, {}, o, /*grad_mask=*/true);
  EXPECT_LT(rel_norm(std::get<0>(got), std::get<0>(want)), tol) << "grad_query";
  EXPECT_LT(rel_norm(std::get<1>(got), std::get<1>(want)), tol) << "grad_key";
  EXPECT_LT(rel_norm(std::get<2>(got), std::get<2>(want)), tol) << "grad_value";
  EXPECT_LT(rel_norm(std::get<3>(got), std::get<3>(want)), tol) << "grad_row_scale";
  const at::Tensor& want_dmask = std::get<5>(want);
  ASSERT_EQ(dmask.sizes(), mask.sizes());
  EXPECT_EQ(dmask.scalar_type(), dtype);
  EXPECT_GT(want_dmask.abs().max().item<double>(), 1e-3) << "the case gives the mask a gradient";
  EXPECT_LT(rel_norm(dmask, want_dmask), tol) << "grad_attn_mask";
  EXPECT_TRUE(at::equal(dmask.masked_select(at::isneginf(mask)),
                        at::zeros({at::isneginf(mask).sum().item<int64_t>()}, dmask.options())))
      << "a hidden key's entry has no gradient";
}

}  // namespace emulated_features
