// The features the sm80 family's general (causal) instantiations take, run on the CPU as
// test_sm80_emulation.cpp runs the family (sm80_emulation.h): windows, bottom-right alignment,
// softcap, sinks and dropout, forward and backward, through the op's own call preparation
// (prepare_attention; cuda/attention_host.h: the parameters the op gives the kernels) against the
// CPU op of the same call (the same Philox stream for dropout); and packed documents (varlen),
// which the CPU op takes in another layout, against the emulated fallback kernels on the same
// parameters (which test_cuda_emulation.cpp checks against its float64 reference). A unit of its
// own: the two compile side by side.
#include "sm80_emulation.h"

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <optional>
#include <vector>

#include "attention_call.h"
#include "cuda/attention_host.h"
#include "entropy_attn.h"

namespace {

using namespace sm80_emulation;

struct Feature {
  bool causal = true;
  std::array<int64_t, 2> window{-1, -1};
  const char* alignment = "top_left";
  double softcap = 0;
  bool sinks = false;
  double dropout_p = 0;
  int64_t q_len = 150, kv_len = 150;
};

// ||a - e|| / ||e|| in float64.
double rel_norm(const at::Tensor& a, const at::Tensor& e) {
  const at::Tensor d = a.to(at::kDouble) - e.to(at::kDouble);
  return (d.norm() / e.to(at::kDouble).norm().clamp_min(1e-30)).item<double>();
}

template <typename T, int kD, bool kCompact>
void run_feature(const Feature& f) {
  const at::ScalarType dtype = std::is_same_v<T, __half> ? at::kHalf : at::kBFloat16;
  at::manual_seed(21);
  const auto opt = at::TensorOptions().dtype(dtype);
  const at::Tensor q = at::randn({1, 4, f.q_len, kD}, opt),
                   k = at::randn({1, 2, f.kv_len, kD}, opt),
                   v = at::randn({1, 2, f.kv_len, kD}, opt),
                   dout = at::randn({1, 4, f.q_len, kD}, opt);
  const at::Tensor g_entropy = at::randn({1, 4, f.q_len});
  const std::optional<at::Tensor> sinks =
      f.sinks ? std::optional<at::Tensor>(at::randn({4}, opt)) : std::nullopt;
  const int64_t seed = 0x5eed;
  const entropy_attn::AttentionOptions o = entropy_attn::AttentionOptions::from_schema(
      f.causal, std::nullopt, "logn", 1.0, 64.0, /*enable_gqa=*/true, /*return_stats=*/true,
      f.window, f.alignment, f.softcap, f.dropout_p, seed);

  const entropy_attn::AttentionCall call =
      entropy_attn::prepare_attention(q, k, v, std::nullopt, std::nullopt, sinks, {}, o);
  const ec::ForwardCall fwd(q, k, v, call);
  launch_forward<T, kD, true, MaskKind::kNone, true>(fwd.params<float>());
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

  const entropy_attn::AttentionBackwardCall bcall = entropy_attn::prepare_attention_backward(
      dout, std::nullopt, g_entropy, std::nullopt, q, k, v, std::nullopt, out, lse, entropy, sum_p2,
      row_scale, sinks, {}, o, /*grad_mask=*/false);
  ec::BackwardCall bwd(dout, q, k, v, out, bcall);
  bwd.allocate(ec::Family::kSm80);
  launch_backward<T, kD, kCompact, true, MaskKind::kNone>(bwd.params<float>());
  const entropy_attn::AttentionGrads got = bwd.finish();
  const entropy_attn::AttentionBackwardOutputs want = entropy_attn::call_attention_backward(
      dout, std::nullopt, g_entropy, std::nullopt, q, k, v, std::nullopt, r.output, r.lse,
      r.entropy, r.sum_p2, r.row_scale, sinks, {}, o);
  EXPECT_LT(rel_norm(std::get<0>(got), std::get<0>(want)), tol.grad) << "grad_query";
  EXPECT_LT(rel_norm(std::get<1>(got), std::get<1>(want)), tol.grad) << "grad_key";
  EXPECT_LT(rel_norm(std::get<2>(got), std::get<2>(want)), tol.grad) << "grad_value";
  EXPECT_LT(rel_norm(std::get<3>(got), std::get<3>(want)), tol.grad) << "grad_row_scale";
}

TEST(EmulatedSm80Features, WindowsAndAlignment) {
  Feature f;
  f.window = {40, 0};
  run_feature<__nv_bfloat16, 64, false>(f);
  f = Feature{};
  f.alignment = "bottom_right", f.q_len = 70, f.kv_len = 200;
  run_feature<__nv_bfloat16, 64, false>(f);
  f = Feature{};
  f.causal = false, f.window = {30, 50};  // a two-sided band
  run_feature<__nv_bfloat16, 128, true>(f);
}

TEST(EmulatedSm80Features, SoftcapSinksDropout) {
  Feature f;
  f.softcap = 2.0, f.sinks = true, f.window = {63, 0};
  run_feature<__nv_bfloat16, 64, false>(f);
  f = Feature{};
  f.dropout_p = 0.2;
  run_feature<__nv_bfloat16, 64, false>(f);
  f.dropout_p = 0.1, f.sinks = true;
  run_feature<__nv_bfloat16, 128, true>(f);
}

// Packed documents: q (1, H, cu_q.back(), D) and k, v (1, Hkv, cu_k.back(), D) cut into documents
// by cu_q and cu_k (causality and windows bottom-right aligned within each: key_ranges.cuh), one
// call's parameters launched through both families.
template <typename T, int kD, bool kCompact>
void run_documents(const std::vector<int32_t>& cu_q, const std::vector<int32_t>& cu_k, bool causal,
                   std::array<int64_t, 2> window) {
  const at::ScalarType dtype = std::is_same_v<T, __half> ? at::kHalf : at::kBFloat16;
  at::manual_seed(22);
  const auto opt = at::TensorOptions().dtype(dtype);
  const int64_t lq = cu_q.back(), lk = cu_k.back();
  const at::Tensor q = at::randn({1, 4, lq, kD}, opt), k = at::randn({1, 2, lk, kD}, opt),
                   v = at::randn({1, 2, lk, kD}, opt), dout = at::randn({1, 4, lq, kD}, opt);
  const at::Tensor g_entropy = at::randn({1, 4, lq});
  const auto int32 = [](const std::vector<int32_t>& x) {
    return at::tensor(at::ArrayRef<int32_t>(x), at::TensorOptions().dtype(at::kInt));
  };
  const entropy_attn::DocumentArgs docs{int32(cu_q), int32(cu_k), std::nullopt};
  const entropy_attn::AttentionOptions o = entropy_attn::AttentionOptions::from_schema(
      causal, std::nullopt, "logn", 1.0, 64.0, /*enable_gqa=*/true, /*return_stats=*/true, window,
      "bottom_right", 0.0, 0.0, 0);
  const entropy_attn::AttentionCall call =
      entropy_attn::prepare_attention(q, k, v, std::nullopt, std::nullopt, std::nullopt, docs, o);
  const ec::ForwardCall tc(q, k, v, call), fb(q, k, v, call);
  launch_forward<T, kD, true, MaskKind::kNone, true>(tc.params<float>());
  emulated::launch_forward<T>(fb.params<float>());
  const eh::Tolerance tol = eh::tolerance<T>();
  const char* names[] = {"output", "lse", "entropy", "sum_p2"};
  EXPECT_LT(rel_norm(std::get<0>(tc.outputs), std::get<0>(fb.outputs)), tol.grad) << names[0];
  EXPECT_LT(rel_norm(std::get<1>(tc.outputs), std::get<1>(fb.outputs)), tol.rtol) << names[1];
  EXPECT_LT(rel_norm(std::get<2>(tc.outputs), std::get<2>(fb.outputs)), tol.rtol) << names[2];
  EXPECT_LT(rel_norm(std::get<3>(tc.outputs), std::get<3>(fb.outputs)), tol.rtol) << names[3];
  EXPECT_TRUE(at::equal(std::get<5>(tc.outputs), std::get<5>(fb.outputs))) << "n_keys";

  const auto& f = fb.outputs;  // (both backwards from the fallback's forward)
  const entropy_attn::AttentionBackwardCall bcall = entropy_attn::prepare_attention_backward(
      dout, std::nullopt, g_entropy, std::nullopt, q, k, v, std::nullopt, std::get<0>(f),
      std::get<1>(f), std::get<2>(f), std::get<3>(f), std::get<6>(f), std::nullopt, docs, o,
      /*grad_mask=*/false);
  ec::BackwardCall tb(dout, q, k, v, std::get<0>(f), bcall),
      bb(dout, q, k, v, std::get<0>(f), bcall);
  tb.allocate(ec::Family::kSm80);
  bb.allocate(ec::Family::kFallback);
  launch_backward<T, kD, kCompact, true, MaskKind::kNone>(tb.params<float>());
  emulated::launch_backward<T>(bb.params<float>());
  const entropy_attn::AttentionGrads got = tb.finish(), want = bb.finish();
  EXPECT_LT(rel_norm(std::get<0>(got), std::get<0>(want)), tol.grad) << "grad_query";
  EXPECT_LT(rel_norm(std::get<1>(got), std::get<1>(want)), tol.grad) << "grad_key";
  EXPECT_LT(rel_norm(std::get<2>(got), std::get<2>(want)), tol.grad) << "grad_value";
  EXPECT_LT(rel_norm(std::get<3>(got), std::get<3>(want)), tol.grad) << "grad_row_scale";
}

TEST(EmulatedSm80Features, PackedDocuments) {
  // Documents that straddle query tiles and key blocks, one of a single token, one with fewer
  // queries than keys (a cache), causal and with a window.
  run_documents<__nv_bfloat16, 64, false>({0, 1, 130, 190, 200}, {0, 1, 130, 250, 300}, true,
                                          {-1, 0});
  run_documents<__nv_bfloat16, 128, true>({0, 70, 71, 150}, {0, 90, 91, 171}, true, {30, 0});
}

}  // namespace
