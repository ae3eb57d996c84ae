// Head dims rounded up by zero padding (csrc/head_dim_padding.h), on the CPU: the op on inputs
// padded to a larger head dim, with the call's base scale fixed (with_head_dim), gives every
// output and gradient of the op on the original inputs once the padded columns are cut off
// (unpad_outputs, unpad_grads). This is the identity the CUDA host relies on to run head dims the
// tensor-core families do not compile (csrc/cuda/attention_cuda.cpp).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>

#include "attention_call.h"
#include "head_dim_padding.h"

namespace {

using entropy_attn::AttentionCall;
using entropy_attn::AttentionOptions;
using entropy_attn::AttentionShape;
using entropy_attn::ScaleMode;

AttentionShape shape_of(int64_t d, int64_t dv) {
  AttentionShape s{};
  s.batch = 1, s.heads = 1, s.kv_heads = 1, s.q_len = 1, s.kv_len = 1, s.head_dim = d,
  s.v_head_dim = dv;
  return s;
}

TEST(HeadDimPadding, PaddedHeadDimIsTheNextCompiledOne) {
  using entropy_attn::padded_head_dim;
  EXPECT_EQ(padded_head_dim(shape_of(80, 80), {64, 128, 256}), 128);
  EXPECT_EQ(padded_head_dim(shape_of(96, 96), {64, 128, 256}), 128);
  EXPECT_EQ(padded_head_dim(shape_of(32, 32), {64, 128, 256}), 64);
  EXPECT_EQ(padded_head_dim(shape_of(64, 128), {64, 128, 256}), 128);
  EXPECT_EQ(padded_head_dim(shape_of(192, 128), {64, 128, 256}), 256);
  EXPECT_EQ(padded_head_dim(shape_of(64, 64), {64, 128, 256}), 0);  // compiled: nothing to pad
  EXPECT_EQ(padded_head_dim(shape_of(256, 256), {64, 128, 256}), 0);
  EXPECT_EQ(padded_head_dim(shape_of(300, 300), {64, 128, 256}), 0);  // beyond every one
}

struct Case {
  std::string name;
  int64_t d, dv;
  AttentionOptions options;
  bool mask = false;
};

std::string case_name(const testing::TestParamInfo<Case>& info) { return info.param.name; }

std::vector<Case> cases() {
  AttentionOptions plain;
  AttentionOptions logn_causal;
  logn_causal.causal = true;
  logn_causal.scale_mode = ScaleMode::kLogN;
  logn_causal.log_base = 64.0;
  AttentionOptions explicit_scale_window;
  explicit_scale_window.scale_factor = 0.3;
  explicit_scale_window.window_left = 5, explicit_scale_window.window_right = 2;
  explicit_scale_window.softcap = 4.0;
  AttentionOptions gqa;
  gqa.enable_gqa = true;
  gqa.temperature = 0.7;
  return {{"d80", 80, 80, plain},
          {"d96_logn_causal", 96, 96, logn_causal},
          {"d40_dv72_scale_window_softcap", 40, 72, explicit_scale_window},
          {"d192_dv128_gqa_mask", 192, 128, gqa, true}};
}

class HeadDimPaddingIdentity : public testing::TestWithParam<Case> {};

TEST_P(HeadDimPaddingIdentity, OutputsAndGradientsMatchTheUnpaddedCall) {
  const Case& c = GetParam();
  at::manual_seed(3);
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  const int64_t heads = c.options.enable_gqa ? 4 : 2, kv_heads = 2, lq = 13, lk = 17;
  const at::Tensor q = at::randn({2, heads, lq, c.d}, f64);
  const at::Tensor k = at::randn({2, kv_heads, lk, c.d}, f64);
  const at::Tensor v = at::randn({2, kv_heads, lk, c.dv}, f64);
  std::optional<at::Tensor> mask;
  if (c.mask) mask = at::rand({lq, lk}, f64) < 0.8;
  const AttentionCall call =
      entropy_attn::prepare_attention(q, k, v, mask, std::nullopt, std::nullopt, {}, c.options);
  const int64_t dim = entropy_attn::padded_head_dim(call.shape, {64, 128, 256});
  ASSERT_GT(dim, 0);
  const AttentionCall padded_call = entropy_attn::with_head_dim(call, dim);
  EXPECT_EQ(padded_call.shape.head_dim, dim);
  EXPECT_EQ(padded_call.shape.v_head_dim, dim);
  ASSERT_TRUE(padded_call.options.scale_factor.has_value());  // the call's own, fixed

  const at::Tensor qp = entropy_attn::pad_head_dim(q, dim), kp = entropy_attn::pad_head_dim(k, dim),
                   vp = entropy_attn::pad_head_dim(v, dim);
  ASSERT_EQ(qp.size(-1), dim);
  EXPECT_TRUE(at::equal(qp.narrow(-1, 0, c.d), q));
  EXPECT_EQ(qp.narrow(-1, c.d, dim - c.d).abs().max().item<double>(), 0.0);

  const auto want =
      entropy_attn::call_attention(q, k, v, mask, std::nullopt, std::nullopt, {}, c.options);
  const auto got = entropy_attn::unpad_outputs(
      entropy_attn::call_attention(qp, kp, vp, mask, std::nullopt, std::nullopt, {},
                                   padded_call.options),
      at::empty_like(std::get<0>(want)));
  const char* names[] = {"output",       "lse",      "entropy",       "sum_p2",
                         "max_weight",   "n_keys",   "row_scale",     "length_factor",
                         "norm_entropy", "sparsity", "effective_keys"};
  auto check = [&](const at::Tensor& a, const at::Tensor& b, const char* name) {
    ASSERT_EQ(a.sizes(), b.sizes()) << name;
    // In the layout of the unpadded call's (its input's): not a strided view of the padded buffer,
    // which the Meta kernel's strides and Inductor's checks would not match.
    EXPECT_EQ(a.strides(), b.strides()) << name;
    EXPECT_TRUE(at::allclose(a, b, 1e-12, 1e-12))
        << name << ": max difference " << (a - b).abs().max().item<double>();
  };
  check(std::get<0>(got), std::get<0>(want), names[0]);
  check(std::get<1>(got), std::get<1>(want), names[1]);
  check(std::get<2>(got), std::get<2>(want), names[2]);
  check(std::get<3>(got), std::get<3>(want), names[3]);
  check(std::get<4>(got), std::get<4>(want), names[4]);
  check(std::get<5>(got), std::get<5>(want), names[5]);
  check(std::get<6>(got), std::get<6>(want), names[6]);
  check(std::get<7>(got), std::get<7>(want), names[7]);
  check(std::get<8>(got), std::get<8>(want), names[8]);
  check(std::get<9>(got), std::get<9>(want), names[9]);
  check(std::get<10>(got), std::get<10>(want), names[10]);

  // The backward on padded inputs (the padded forward's output, dO padded with zeros) against the
  // unpadded one, with upstream gradients of the entropy and sum p^2 too.
  const at::Tensor dout = at::randn_like(std::get<0>(want));
  const at::Tensor g_ent = at::randn_like(std::get<2>(want)),
                   g_p2 = at::randn_like(std::get<3>(want));
  const auto& [out, lse, ent, p2, pmax, n, lam, lf, ne, sp, ek] = want;
  const auto grads =
      entropy_attn::call_attention_backward(dout, std::nullopt, g_ent, g_p2, q, k, v, mask, out,
                                            lse, ent, p2, lam, std::nullopt, {}, c.options);
  const auto padded_grads = entropy_attn::call_attention_backward(
      entropy_attn::pad_head_dim(dout, dim), std::nullopt, g_ent, g_p2, qp, kp, vp, mask,
      entropy_attn::pad_head_dim(out, dim), lse, ent, p2, lam, std::nullopt, {},
      padded_call.options);
  const auto& [pdq, pdk, pdv, pdlam, pdsinks, pdmask] = padded_grads;
  const auto cut = entropy_attn::unpad_grads({pdq, pdk, pdv, pdlam}, q, k, v);
  check(std::get<0>(cut), std::get<0>(grads), "grad_query");
  check(std::get<1>(cut), std::get<1>(grads), "grad_key");
  check(std::get<2>(cut), std::get<2>(grads), "grad_value");
  check(std::get<3>(cut), std::get<3>(grads), "grad_row_scale");
  // What was cut off is zero: nothing of the padding leaks into the call's gradients.
  EXPECT_EQ(pdq.narrow(-1, c.d, dim - c.d).abs().max().item<double>(), 0.0);
  EXPECT_EQ(pdv.narrow(-1, c.dv, dim - c.dv).abs().max().item<double>(), 0.0);
}

INSTANTIATE_TEST_SUITE_P(Cases, HeadDimPaddingIdentity, testing::ValuesIn(cases()), case_name);

}  // namespace
