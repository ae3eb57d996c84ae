// GoogleTest suite of the entropy_attn operators through LibTorch: the ops are called through the
// dispatcher (typed handles, as any LibTorch user would) and through the C++ API in
// csrc/entropy_attn.h, and compared with an independent float64 reference written with ATen ops
// over the full (B, H, Lq, Lk) score matrix. Gradients are compared with autograd through that
// reference.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <functional>
#include <initializer_list>
#include <limits>
#include <optional>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include "entropy_attn.h"

namespace {

using entropy_attn::AttentionResult;
using OptTensor = std::optional<at::Tensor>;
constexpr double kInf = std::numeric_limits<double>::infinity();

// ------------------------------------------------------------------------------------------------
// Calling the ops
// ------------------------------------------------------------------------------------------------

struct Args {
  OptTensor attn_mask;
  OptTensor scale;
  bool is_causal = false;
  std::optional<double> scale_factor;
  std::string scale_mode = "fixed";
  double temperature = 1.0;
  double log_base = 512.0;
  bool enable_gqa = false;
};

// The schema returns (output, lse, entropy, sum_p2, max_weight, n_keys, row_scale, length_factor,
// normalized_entropy, sparsity, effective_keys).
using AttentionTuple =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
               at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// entropy_attn::attention through a typed dispatcher handle.
AttentionResult call_dispatcher(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const Args& a) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("entropy_attn::attention", "")
          .typed<AttentionTuple(
              const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&,
              const OptTensor&, bool, std::optional<double>, c10::string_view, double, double, bool,
              bool, c10::IntArrayRef, c10::string_view, double, const OptTensor&, double, int64_t,
              const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&)>();
  const std::array<int64_t, 2> no_window{-1, -1};
  auto [out, lse, ent, p2, pmax, n, lam, g, norm_ent, sparsity, eff] = op.call(
      q, k, v, a.attn_mask, a.scale, a.is_causal, a.scale_factor, a.scale_mode, a.temperature,
      a.log_base, a.enable_gqa, /*return_stats=*/true, no_window, "top_left", /*softcap=*/0.0,
      std::nullopt, /*dropout_p=*/0.0, 0, std::nullopt, std::nullopt, std::nullopt, std::nullopt);
  return {out, lse, ent, p2, pmax, n, lam, g, norm_ent, sparsity, eff};
}

// The C++ API of csrc/entropy_attn.h.
AttentionResult call_api(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const Args& a) {
  return entropy_attn::attention(q, k, v, a.attn_mask, a.scale, a.is_causal, a.scale_factor,
                                 a.scale_mode, a.temperature, a.log_base, a.enable_gqa);
}

at::Tensor call_reduction_dispatcher(const char* name, const at::Tensor& x, int64_t dim) {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow(name, "")
      .typed<at::Tensor(const at::Tensor&, int64_t)>()
      .call(x, dim);
}

// ------------------------------------------------------------------------------------------------
// Reference: masked softmax over the full score matrix, float64, plain ATen ops (differentiable).
// ------------------------------------------------------------------------------------------------

AttentionResult reference(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                          const Args& a) {
  const auto f64 = at::kDouble;
  at::Tensor q = query.to(f64), k = key.to(f64), v = value.to(f64);
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Lk = k.size(2);
  if (H != Hkv) {  // query head h uses kv head h / (H / Hkv)
    k = k.repeat_interleave(H / Hkv, /*dim=*/1);
    v = v.repeat_interleave(H / Hkv, /*dim=*/1);
  }
  const auto bool_opts = at::TensorOptions().dtype(at::kBool);
  at::Tensor allowed = at::ones({B, H, Lq, Lk}, bool_opts);
  at::Tensor additive = at::zeros({B, H, Lq, Lk}, f64);
  if (a.attn_mask) {
    const at::Tensor m = a.attn_mask->expand({B, H, Lq, Lk});
    if (m.scalar_type() == at::kBool) {
      allowed = allowed & m;
    } else {
      const at::Tensor md = m.to(f64);
      allowed = allowed & (md != -kInf);
      additive = at::where(allowed, md, at::zeros_like(md));
    }
  }
  if (a.is_causal) allowed = allowed & at::ones({Lq, Lk}, bool_opts).tril();  // top-left
  const at::Tensor n = allowed.sum(-1);                                       // int64

  at::Tensor c =
      a.scale ? a.scale->to(f64).expand({B, H, Lq})
              : at::full({B, H, Lq}, a.scale_factor.value_or(1.0 / std::sqrt(double(D))), f64);
  at::Tensor g = at::ones({B, H, Lq}, f64);
  if (a.scale_mode != "fixed") {
    const at::Tensor has = n > 0;
    at::Tensor logb =
        at::log(at::where(has, n.to(f64), at::ones_like(n, f64))) / std::log(a.log_base);
    if (a.scale_mode == "logn_sharpen") logb = at::clamp_min(logb, 1.0);
    g = at::where(has, logb, at::zeros_like(logb));  // an empty row is scaled by 0
  }
  const at::Tensor lambda = c * g / a.temperature;

  at::Tensor s = lambda.unsqueeze(-1) * at::matmul(q, k.transpose(-2, -1)) + additive;
  s = s.masked_fill(allowed.logical_not(), -kInf);
  at::Tensor m = std::get<0>(s.max(-1, /*keepdim=*/true)).detach();  // softmax is shift invariant
  m = at::where(at::isinf(m), at::zeros_like(m), m);                 // empty rows: -inf -> 0
  const at::Tensor e = at::exp(s - m);
  const at::Tensor l = e.sum(-1, /*keepdim=*/true);
  const at::Tensor l_safe = at::where(l > 0, l, at::ones_like(l));
  const at::Tensor p = e / l_safe;
  const at::Tensor has = n > 0;

  AttentionResult r;
  r.output = at::matmul(p, v);
  r.lse = at::where(has, (m + at::log(l_safe)).squeeze(-1), at::zeros({B, H, Lq}, f64));
  r.entropy = -(p * at::log(at::where(p > 0, p, at::ones_like(p)))).sum(-1);  // 0 ln 0 = 0
  r.sum_p2 = (p * p).sum(-1);
  r.max_weight = Lk > 0 ? std::get<0>(p.max(-1)) : at::zeros({B, H, Lq}, f64);
  r.n_keys = n;
  r.row_scale = lambda;
  r.length_factor = g / a.temperature;
  // The derived statistics from their definitions: H / ln n (n >= 2), the l1/l2 ratio
  // sum_j p / sqrt(n sum_j p^2) and 1 / sum_j p^2, each 0 for an empty row.
  const at::Tensor nf = n.to(f64);
  const at::Tensor zero = at::zeros({B, H, Lq}, f64);
  r.normalized_entropy =
      at::where(n >= 2, r.entropy / at::log(at::where(n >= 2, nf, at::full_like(nf, 2.0))), zero);
  const at::Tensor safe_p2 = at::where(has, r.sum_p2, at::ones_like(r.sum_p2));
  r.sparsity =
      at::where(has, p.sum(-1) / at::sqrt(at::where(has, nf, at::ones_like(nf)) * safe_p2), zero);
  r.effective_keys = at::where(has, 1.0 / safe_p2, zero);
  return r;
}

// ------------------------------------------------------------------------------------------------
// Comparisons
// ------------------------------------------------------------------------------------------------

struct Tol {
  double atol, rtol;
};

Tol output_tol(at::ScalarType t) {
  switch (t) {
    case at::kDouble:
      return {1e-10, 1e-10};
    case at::kFloat:
      return {5e-5, 5e-5};
    case at::kBFloat16:
      return {2e-2, 2e-2};
    default:
      return {3e-3, 3e-3};  // float16
  }
}
Tol stat_tol(at::ScalarType t) { return output_tol(t); }

// Checks shape, finiteness and |actual - expected| <= atol + rtol |expected| elementwise.
::testing::AssertionResult all_close(const at::Tensor& actual, const at::Tensor& expected,
                                     Tol tol) {
  if (!actual.defined()) return ::testing::AssertionFailure() << "undefined tensor";
  if (actual.sizes() != expected.sizes()) {
    return ::testing::AssertionFailure()
           << "shape " << actual.sizes() << " != expected " << expected.sizes();
  }
  const at::Tensor x = actual.detach().to(at::kDouble), y = expected.detach().to(at::kDouble);
  if (!at::isfinite(x).all().item<bool>()) {
    return ::testing::AssertionFailure() << "non-finite values: " << x;
  }
  if (x.numel() == 0) return ::testing::AssertionSuccess();
  const at::Tensor diff = (x - y).abs();
  const at::Tensor bad = diff > tol.atol + tol.rtol * y.abs();
  if (bad.any().item<bool>()) {
    const int64_t i = bad.flatten().nonzero()[0].item<int64_t>();
    return ::testing::AssertionFailure()
           << bad.sum().item<int64_t>() << " of " << x.numel() << " elements differ, max |diff| "
           << diff.max().item<double>() << " (atol " << tol.atol << ", rtol " << tol.rtol
           << "); first at flat index " << i << ": " << x.flatten()[i].item<double>()
           << " vs expected " << y.flatten()[i].item<double>();
  }
  return ::testing::AssertionSuccess();
}

void expect_matches_reference(const AttentionResult& r, const AttentionResult& ref,
                              at::ScalarType dtype, const std::string& where) {
  SCOPED_TRACE(where);
  const at::ScalarType stat_dtype = dtype == at::kDouble ? at::kDouble : at::kFloat;
  EXPECT_EQ(r.output.scalar_type(), dtype);
  for (const at::Tensor* t :
       {&r.lse, &r.entropy, &r.sum_p2, &r.max_weight, &r.row_scale, &r.length_factor}) {
    EXPECT_EQ(t->scalar_type(), stat_dtype);
  }
  EXPECT_EQ(r.n_keys.scalar_type(), at::kLong);
  EXPECT_TRUE(all_close(r.output, ref.output, output_tol(dtype))) << "output";
  EXPECT_TRUE(all_close(r.lse, ref.lse, stat_tol(dtype))) << "lse";
  EXPECT_TRUE(all_close(r.entropy, ref.entropy, stat_tol(dtype))) << "entropy";
  EXPECT_TRUE(all_close(r.sum_p2, ref.sum_p2, stat_tol(dtype))) << "sum_p2";
  EXPECT_TRUE(all_close(r.max_weight, ref.max_weight, stat_tol(dtype))) << "max_weight";
  EXPECT_TRUE(all_close(r.row_scale, ref.row_scale, stat_tol(dtype))) << "row_scale";
  EXPECT_TRUE(all_close(r.length_factor, ref.length_factor, stat_tol(dtype))) << "length_factor";
  EXPECT_TRUE(all_close(r.normalized_entropy, ref.normalized_entropy, stat_tol(dtype)))
      << "normalized_entropy";
  EXPECT_TRUE(all_close(r.sparsity, ref.sparsity, stat_tol(dtype))) << "sparsity";
  // 1 / sum p^2 is up to n: compare relative to it.
  EXPECT_TRUE(all_close(r.effective_keys / ref.effective_keys.clamp_min(1),
                        ref.effective_keys / ref.effective_keys.clamp_min(1), stat_tol(dtype)))
      << "effective_keys";
  ASSERT_EQ(r.n_keys.sizes(), ref.n_keys.sizes());
  EXPECT_TRUE(at::equal(r.n_keys, ref.n_keys)) << "n_keys " << r.n_keys << " vs " << ref.n_keys;
}

// ------------------------------------------------------------------------------------------------
// Test cases
// ------------------------------------------------------------------------------------------------

enum class Mask { kNone, kBool4d, kBool2d, kFloat, kBoolHeadBroadcast };
enum class Scale { kDefault, kFactor, kTensor, kTensorBroadcast };

struct Case {
  std::string name;
  int64_t B = 2, H = 4, Hkv = 4, Lq = 5, Lk = 7, D = 8, Dv = 8;
  bool causal = false;
  Mask mask = Mask::kNone;
  Scale scale = Scale::kDefault;
  std::string scale_mode = "fixed";
  double temperature = 1.0;
  double log_base = 512.0;
  double factor = 0.3;  // scale_factor for Scale::kFactor
};

std::vector<Case> forward_cases() {
  std::vector<Case> cs;
  auto add = [&](const std::string& name, auto&& edit) {
    Case c;
    c.name = name;
    edit(c);
    cs.push_back(c);
  };
  add("plain", [](Case&) {});
  add("causal_square", [](Case& c) {
    c.Lq = c.Lk = 9;
    c.causal = true;
  });
  add("causal_more_queries", [](Case& c) {
    c.Lq = 9;
    c.Lk = 6;
    c.causal = true;
  });
  add("causal_more_keys", [](Case& c) {
    c.Lq = 4;
    c.Lk = 10;
    c.causal = true;
  });
  add("bool_mask_4d", [](Case& c) { c.mask = Mask::kBool4d; });
  add("bool_mask_2d", [](Case& c) { c.mask = Mask::kBool2d; });
  add("float_mask", [](Case& c) { c.mask = Mask::kFloat; });
  add("causal_and_mask", [](Case& c) {
    c.Lq = c.Lk = 8;
    c.causal = true;
    c.mask = Mask::kBool4d;
  });
  add("gqa_causal", [](Case& c) {
    c.H = 6;
    c.Hkv = 2;
    c.Lq = 7;
    c.Lk = 7;
    c.causal = true;
    c.mask = Mask::kBoolHeadBroadcast;
  });
  add("logn", [](Case& c) {
    c.Lq = c.Lk = 12;
    c.causal = true;
    c.scale_mode = "logn";
    c.log_base = 4;
  });
  add("logn_sharpen", [](Case& c) {
    c.Lq = c.Lk = 12;
    c.causal = true;
    c.scale_mode = "logn_sharpen";
    c.log_base = 3;
  });
  add("scale_factor_temperature", [](Case& c) {
    c.scale = Scale::kFactor;
    c.temperature = 0.7;
  });
  add("scale_tensor_logn", [](Case& c) {
    c.Lq = c.Lk = 10;
    c.causal = true;
    c.scale = Scale::kTensor;
    c.scale_mode = "logn";
    c.log_base = 5;
  });
  add("scale_tensor_broadcast", [](Case& c) {
    c.scale = Scale::kTensorBroadcast;
    c.temperature = 2;
  });
  add("value_dim_differs", [](Case& c) {
    c.D = 12;
    c.Dv = 5;
  });
  add("single_key", [](Case& c) { c.Lk = 1; });
  add("huge_logits", [](Case& c) {  // |logits| in the hundreds: needs the running max
    c.Lq = c.Lk = 9;
    c.causal = true;
    c.mask = Mask::kFloat;
    c.scale = Scale::kFactor;
    c.factor = 40.0;
  });
  add("mqa_scale_tensor_sharpen", [](Case& c) {
    c.H = 4;
    c.Hkv = 1;
    c.mask = Mask::kFloat;
    c.scale = Scale::kTensor;
    c.scale_mode = "logn_sharpen";
    c.log_base = 3;
  });
  add("long_kv", [](Case& c) {
    c.B = 1;
    c.H = 2;
    c.Hkv = 2;
    c.Lq = 33;
    c.Lk = 1100;
    c.D = 16;
    c.Dv = 16;
  });
  add("long_causal", [](Case& c) {
    c.B = 1;
    c.H = 2;
    c.Hkv = 1;
    c.Lq = c.Lk = 600;
    c.D = 16;
    c.Dv = 16;
    c.causal = true;
    c.scale_mode = "logn";
  });
  return cs;
}

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.name << " (B=" << c.B << " H=" << c.H << " Hkv=" << c.Hkv << " Lq=" << c.Lq
      << " Lk=" << c.Lk << " D=" << c.D << " Dv=" << c.Dv << " causal=" << c.causal
      << " mask=" << static_cast<int>(c.mask) << " scale=" << static_cast<int>(c.scale)
      << " mode=" << c.scale_mode << " T=" << c.temperature << " base=" << c.log_base
      << " factor=" << c.factor << ")";
}

struct Inputs {
  at::Tensor q, k, v;
  Args args;
};

// Random inputs of `dtype` for a case; q, k, v are drawn in float64 and rounded to dtype so that
// the reference sees exactly the kernel's inputs.
Inputs make_inputs(const Case& c, at::ScalarType dtype, uint64_t seed = 0) {
  at::manual_seed(seed + std::hash<std::string>{}(c.name) % 1000);
  const auto f64 = at::kDouble;
  Inputs in;
  in.q = at::randn({c.B, c.H, c.Lq, c.D}, f64).to(dtype);
  in.k = at::randn({c.B, c.Hkv, c.Lk, c.D}, f64).to(dtype);
  in.v = at::randn({c.B, c.Hkv, c.Lk, c.Dv}, f64).to(dtype);
  Args& a = in.args;
  a.is_causal = c.causal;
  a.scale_mode = c.scale_mode;
  a.temperature = c.temperature;
  a.log_base = c.log_base;
  a.enable_gqa = c.H != c.Hkv;
  switch (c.mask) {
    case Mask::kNone:
      break;
    case Mask::kBool4d:
      a.attn_mask = at::rand({c.B, c.H, c.Lq, c.Lk}, f64) > 0.3;
      break;
    case Mask::kBool2d:
      a.attn_mask = at::rand({c.Lq, c.Lk}, f64) > 0.3;
      break;
    case Mask::kBoolHeadBroadcast:
      a.attn_mask = at::rand({c.B, 1, c.Lq, c.Lk}, f64) > 0.25;
      break;
    case Mask::kFloat: {
      at::Tensor m = at::randn({c.B, 1, c.Lq, c.Lk}, f64);
      m = m.masked_fill(at::rand({c.B, 1, c.Lq, c.Lk}, f64) < 0.3, -kInf);
      a.attn_mask = m.to(dtype);
      break;
    }
  }
  switch (c.scale) {
    case Scale::kDefault:
      break;
    case Scale::kFactor:
      a.scale_factor = c.factor;
      break;
    case Scale::kTensor:
      a.scale = (at::rand({c.B, c.H, c.Lq}, f64) + 0.2).to(dtype);
      break;
    case Scale::kTensorBroadcast:
      a.scale = (at::rand({c.H, 1}, f64) + 0.2).to(dtype);
      break;
  }
  return in;
}

std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kDouble:
      return "float64";
    case at::kFloat:
      return "float32";
    case at::kBFloat16:
      return "bfloat16";
    default:
      return "float16";
  }
}

// ---- forward: every case x every dtype, through the dispatcher and through the C++ API ---------

class AttentionForward : public ::testing::TestWithParam<std::tuple<Case, at::ScalarType>> {};

TEST_P(AttentionForward, MatchesReference) {
  const auto& [c, dtype] = GetParam();
  const Inputs in = make_inputs(c, dtype);
  const AttentionResult ref = reference(in.q, in.k, in.v, in.args);
  const AttentionResult via_dispatcher = call_dispatcher(in.q, in.k, in.v, in.args);
  const AttentionResult via_api = call_api(in.q, in.k, in.v, in.args);
  expect_matches_reference(via_dispatcher, ref, dtype, "dispatcher");
  expect_matches_reference(via_api, ref, dtype, "C++ API");
  EXPECT_EQ(via_dispatcher.output.sizes(), (std::vector<int64_t>{c.B, c.H, c.Lq, c.Dv}));
  // Without statistics: the same output, lse and lambda; the statistics empty.
  const Args& a = in.args;
  const AttentionResult lean =
      entropy_attn::attention(in.q, in.k, in.v, a.attn_mask, a.scale, a.is_causal, a.scale_factor,
                              a.scale_mode, a.temperature, a.log_base, a.enable_gqa,
                              /*return_stats=*/false);
  EXPECT_TRUE(all_close(lean.output, ref.output, output_tol(dtype))) << "output without stats";
  EXPECT_TRUE(all_close(lean.lse, ref.lse, stat_tol(dtype))) << "lse without stats";
  EXPECT_TRUE(all_close(lean.row_scale, ref.row_scale, stat_tol(dtype)));
  for (const at::Tensor* t : {&lean.entropy, &lean.sum_p2, &lean.max_weight,
                              &lean.normalized_entropy, &lean.sparsity, &lean.effective_keys}) {
    EXPECT_EQ(t->numel(), 0);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, AttentionForward,
    ::testing::Combine(::testing::ValuesIn(forward_cases()),
                       ::testing::Values(at::kDouble, at::kFloat, at::kBFloat16, at::kHalf)),
    [](const ::testing::TestParamInfo<std::tuple<Case, at::ScalarType>>& info) {
      return std::get<0>(info.param).name + "_" + dtype_name(std::get<1>(info.param));
    });

// ---- backward: gradients w.r.t. q, k, v and the scale tensor vs autograd through the reference --

enum class Cotangents { kAll, kOutputOnly, kEntropyOnly, kLseAndSumP2 };

std::string cotangent_name(Cotangents w) {
  switch (w) {
    case Cotangents::kAll:
      return "all";
    case Cotangents::kOutputOnly:
      return "output_only";
    case Cotangents::kEntropyOnly:
      return "entropy_only";
    default:
      return "lse_and_sum_p2";
  }
}

std::vector<Case> backward_cases() {
  std::vector<Case> cs;
  for (const Case& c : forward_cases()) {
    if (c.name == "long_kv") continue;  // long_causal covers several key blocks
    cs.push_back(c);
  }
  Case fully_masked;
  fully_masked.name = "scale_tensor_sharpen_masked";
  fully_masked.Lq = fully_masked.Lk = 9;
  fully_masked.causal = true;
  fully_masked.mask = Mask::kBool4d;
  fully_masked.scale = Scale::kTensor;
  fully_masked.scale_mode = "logn_sharpen";
  fully_masked.log_base = 2;
  cs.push_back(fully_masked);
  return cs;
}

// Gradients of sum_t <cotangent_t, result_t> over the selected differentiable results.
std::vector<at::Tensor> gradients(const AttentionResult& r, const std::vector<at::Tensor>& cot,
                                  Cotangents which, const std::vector<at::Tensor>& inputs) {
  std::vector<at::Tensor> outs, grads;
  const at::Tensor* results[] = {&r.output, &r.lse, &r.entropy, &r.sum_p2};
  const bool use[4][4] = {{true, true, true, true},
                          {true, false, false, false},
                          {false, false, true, false},
                          {false, true, false, true}};
  for (int i = 0; i < 4; ++i) {
    if (use[static_cast<int>(which)][i]) {
      outs.push_back(*results[i]);
      grads.push_back(cot[i].to(results[i]->scalar_type()));
    }
  }
  return torch::autograd::grad(outs, inputs, grads, /*retain_graph=*/false,
                               /*create_graph=*/false, /*allow_unused=*/true);
}

class AttentionBackward : public ::testing::TestWithParam<std::tuple<Case, Cotangents>> {};

TEST_P(AttentionBackward, MatchesReferenceGradients) {
  const auto& [c, which] = GetParam();
  Inputs in = make_inputs(c, at::kDouble, /*seed=*/7);
  auto leaf = [](const at::Tensor& t) { return t.detach().clone().requires_grad_(true); };

  // Random cotangents for output, lse, entropy, sum_p2.
  const std::vector<at::Tensor> cot = {
      at::randn({c.B, c.H, c.Lq, c.Dv}, at::kDouble), at::randn({c.B, c.H, c.Lq}, at::kDouble),
      at::randn({c.B, c.H, c.Lq}, at::kDouble), at::randn({c.B, c.H, c.Lq}, at::kDouble)};

  auto run = [&](bool use_reference) {
    std::vector<at::Tensor> inputs = {leaf(in.q), leaf(in.k), leaf(in.v)};
    Args a = in.args;
    if (a.scale) {
      a.scale = leaf(*a.scale);
      inputs.push_back(*a.scale);
    }
    const AttentionResult r = use_reference ? reference(inputs[0], inputs[1], inputs[2], a)
                                            : call_dispatcher(inputs[0], inputs[1], inputs[2], a);
    if (!use_reference) {
      EXPECT_TRUE(r.output.requires_grad());
      EXPECT_TRUE(r.entropy.requires_grad());
      EXPECT_FALSE(r.max_weight.requires_grad());
      EXPECT_FALSE(r.n_keys.requires_grad());
      EXPECT_FALSE(r.row_scale.requires_grad());
      EXPECT_FALSE(r.length_factor.requires_grad());
    }
    return gradients(r, cot, which, inputs);
  };
  const std::vector<at::Tensor> got = run(false), want = run(true);
  ASSERT_EQ(got.size(), want.size());
  const char* names[] = {"grad query", "grad key", "grad value", "grad scale"};
  for (size_t i = 0; i < got.size(); ++i) {
    const at::Tensor w = want[i].defined() ? want[i] : at::zeros_like(got[i]);
    const at::Tensor g = got[i].defined() ? got[i] : at::zeros_like(w);
    EXPECT_TRUE(all_close(g, w, {1e-8, 1e-7})) << names[i];
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, AttentionBackward,
    ::testing::Combine(::testing::ValuesIn(backward_cases()),
                       ::testing::Values(Cotangents::kAll, Cotangents::kOutputOnly,
                                         Cotangents::kEntropyOnly, Cotangents::kLseAndSumP2)),
    [](const ::testing::TestParamInfo<std::tuple<Case, Cotangents>>& info) {
      return std::get<0>(info.param).name + "_" + cotangent_name(std::get<1>(info.param));
    });

TEST(AttentionBackwardFloat32, MatchesFloat64Reference) {
  Case c;
  c.name = "f32";
  c.Lq = c.Lk = 40;
  c.causal = true;
  c.mask = Mask::kBool4d;
  c.scale = Scale::kTensor;
  c.scale_mode = "logn";
  c.log_base = 16;
  const Inputs in = make_inputs(c, at::kFloat, 3);
  const std::vector<at::Tensor> cot = {
      at::randn({c.B, c.H, c.Lq, c.Dv}, at::kDouble), at::randn({c.B, c.H, c.Lq}, at::kDouble),
      at::randn({c.B, c.H, c.Lq}, at::kDouble), at::randn({c.B, c.H, c.Lq}, at::kDouble)};
  auto run = [&](bool use_reference) {
    std::vector<at::Tensor> inputs;
    for (const at::Tensor& t : {in.q, in.k, in.v, *in.args.scale}) {
      inputs.push_back(t.detach().clone().requires_grad_(true));
    }
    Args a = in.args;
    a.scale = inputs[3];
    const AttentionResult r = use_reference ? reference(inputs[0], inputs[1], inputs[2], a)
                                            : call_api(inputs[0], inputs[1], inputs[2], a);
    return gradients(r, cot, Cotangents::kAll, inputs);
  };
  const auto got = run(false), want = run(true);
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].scalar_type(), at::kFloat) << i;
    EXPECT_TRUE(all_close(got[i], want[i], {2e-4, 2e-4})) << "input " << i;
  }
}

// ---- fully masked rows: output 0, statistics 0, gradients 0, no NaN ---------------------------

void expect_all_finite(const std::vector<at::Tensor>& ts, const std::string& what) {
  for (size_t i = 0; i < ts.size(); ++i) {
    if (!ts[i].defined()) continue;
    EXPECT_TRUE(at::isfinite(ts[i].to(at::kDouble)).all().item<bool>()) << what << " #" << i;
  }
}

class FullyMaskedRows : public ::testing::TestWithParam<at::ScalarType> {};

TEST_P(FullyMaskedRows, GiveZerosAndNoNaN) {
  const at::ScalarType dtype = GetParam();
  at::manual_seed(11);
  const int64_t B = 2, H = 3, Lq = 6, Lk = 5, D = 4;
  const at::Tensor q0 = at::randn({B, H, Lq, D}, at::kDouble).to(dtype);
  const at::Tensor k0 = at::randn({B, H, Lk, D}, at::kDouble).to(dtype);
  const at::Tensor v0 = at::randn({B, H, Lk, D}, at::kDouble).to(dtype);
  // Bool mask with rows 1 and 4 of every head fully masked, and (b=1, h=2) entirely masked.
  at::Tensor bmask = at::rand({B, H, Lq, Lk}, at::kDouble) > 0.2;
  bmask.index_put_({at::indexing::Slice(), at::indexing::Slice(), 1}, false);
  bmask.index_put_({at::indexing::Slice(), at::indexing::Slice(), 4}, false);
  bmask.index_put_({1, 2}, false);
  const at::Tensor empty_rows = bmask.logical_not().all(-1);  // (B, H, Lq)
  // The same as an additive float mask.
  const at::Tensor fmask =
      at::where(bmask, at::scalar_tensor(0.0, at::kDouble), at::scalar_tensor(-kInf, at::kDouble))
          .to(dtype);

  for (const at::Tensor& mask : {bmask, fmask}) {
    for (const char* mode : {"fixed", "logn", "logn_sharpen"}) {
      SCOPED_TRACE(std::string(mode) + (mask.scalar_type() == at::kBool ? " bool" : " float"));
      Args a;
      a.attn_mask = mask;
      a.scale_mode = mode;
      a.log_base = 3;
      const at::Tensor q = q0.detach().clone().requires_grad_(true);
      const at::Tensor k = k0.detach().clone().requires_grad_(true);
      const at::Tensor v = v0.detach().clone().requires_grad_(true);
      const AttentionResult r = call_dispatcher(q, k, v, a);
      expect_all_finite(
          {r.output, r.lse, r.entropy, r.sum_p2, r.max_weight, r.row_scale, r.length_factor},
          "forward");
      const at::Tensor out_rows = r.output.abs().amax(-1).to(at::kDouble);
      EXPECT_EQ(out_rows.masked_select(empty_rows).abs().max().item<double>(), 0.0);
      for (const at::Tensor& s : {r.lse, r.entropy, r.sum_p2, r.max_weight}) {
        EXPECT_EQ(s.masked_select(empty_rows).abs().max().item<double>(), 0.0);
      }
      EXPECT_EQ(r.n_keys.masked_select(empty_rows).abs().max().item<int64_t>(), 0);
      // The other rows still match the reference.
      const AttentionResult ref = reference(q0, k0, v0, a);
      EXPECT_TRUE(all_close(r.output, ref.output, output_tol(dtype)));
      EXPECT_TRUE(all_close(r.entropy, ref.entropy, stat_tol(dtype)));
      EXPECT_TRUE(all_close(r.lse, ref.lse, stat_tol(dtype)));

      const at::Tensor loss =
          (r.output.to(at::kDouble) * 1.5).sum() + r.lse.sum() + r.entropy.sum() + r.sum_p2.sum();
      const auto g = torch::autograd::grad({loss}, {q, k, v});
      expect_all_finite(g, "gradient");
      const at::Tensor gq_rows = g[0].abs().amax(-1).to(at::kDouble);
      EXPECT_EQ(gq_rows.masked_select(empty_rows).max().item<double>(), 0.0);
      // (b=1, h=2) attends to nothing: its keys and values get no gradient.
      EXPECT_EQ(g[1].index({1, 2}).abs().max().item<double>(), 0.0);
      EXPECT_EQ(g[2].index({1, 2}).abs().max().item<double>(), 0.0);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, FullyMaskedRows,
                         ::testing::Values(at::kDouble, at::kFloat, at::kBFloat16, at::kHalf),
                         [](const ::testing::TestParamInfo<at::ScalarType>& info) {
                           return dtype_name(info.param);
                         });

TEST(AttentionEdgeCases, NoKeys) {
  const at::Tensor q = at::randn({2, 2, 3, 4}, at::kDouble).requires_grad_(true);
  const at::Tensor k = at::randn({2, 2, 0, 4}, at::kDouble).requires_grad_(true);
  const at::Tensor v = at::randn({2, 2, 0, 5}, at::kDouble).requires_grad_(true);
  for (const bool causal : {false, true}) {
    Args a;
    a.is_causal = causal;
    const AttentionResult r = call_api(q, k, v, a);
    ASSERT_EQ(r.output.sizes(), (std::vector<int64_t>{2, 2, 3, 5}));
    EXPECT_TRUE(at::equal(r.output, at::zeros({2, 2, 3, 5}, at::kDouble)));
    for (const at::Tensor& s : {r.lse, r.entropy, r.sum_p2, r.max_weight}) {
      EXPECT_TRUE(at::equal(s, at::zeros({2, 2, 3}, at::kDouble))) << s;
    }
    EXPECT_TRUE(at::equal(r.n_keys, at::zeros({2, 2, 3}, at::kLong)));
    const auto g = torch::autograd::grad({r.output.sum() + r.lse.sum() + r.entropy.sum()}, {q}, {},
                                         false, false, /*allow_unused=*/true);
    if (g[0].defined()) EXPECT_TRUE(at::equal(g[0], at::zeros_like(q)));
  }
}

TEST(AttentionEdgeCases, NonContiguousInputs) {
  // (B, L, H, D) tensors viewed as (B, H, L, D), as models usually pass them.
  at::manual_seed(5);
  const at::Tensor q = at::randn({2, 9, 4, 8}, at::kFloat).transpose(1, 2);
  const at::Tensor k = at::randn({2, 11, 2, 8}, at::kFloat).transpose(1, 2);
  const at::Tensor v = at::randn({2, 11, 2, 6}, at::kFloat).transpose(1, 2);
  const at::Tensor mask = (at::rand({9, 11}) > 0.2).t().contiguous().t();  // non-contiguous mask
  Args a;
  a.attn_mask = mask;
  a.enable_gqa = true;
  a.is_causal = true;
  a.scale_mode = "logn";
  expect_matches_reference(call_dispatcher(q, k, v, a), reference(q, k, v, a), at::kFloat,
                           "non-contiguous");
}

TEST(AttentionEdgeCases, MatchesScaledDotProductAttention) {
  // An independent second reference for the plain path: ATen's own SDPA (math or flash on CPU).
  at::manual_seed(9);
  const at::Tensor q = at::randn({2, 4, 13, 16}, at::kDouble);
  const at::Tensor k = at::randn({2, 4, 17, 16}, at::kDouble);
  const at::Tensor v = at::randn({2, 4, 17, 16}, at::kDouble);
  const at::Tensor mask = at::rand({2, 1, 13, 17}, at::kDouble) > 0.3;
  const at::Tensor sdpa = at::scaled_dot_product_attention(q, k, v, mask);
  Args a;
  a.attn_mask = mask;
  const AttentionResult r = call_api(q, k, v, a);
  // SDPA's convention for fully masked rows differs between versions: compare the other rows.
  const at::Tensor ok = mask.expand({2, 4, 13, 17}).any(-1, /*keepdim=*/true);
  EXPECT_TRUE(all_close(r.output * ok, sdpa.nan_to_num() * ok, {1e-10, 1e-10}));
}

TEST(AttentionBackward, LearnedBiasGradientMatchesScaledDotProductAttention) {
  // A LibTorch user's learned additive bias (T5-style, one per head, broadcast over the batch):
  // the C++ autograd gives it the gradient ATen's SDPA gives, with q, k and v's.
  at::manual_seed(13);
  auto leaf = [](at::IntArrayRef shape, double scale) {
    return (at::randn(shape, at::kDouble) * scale).requires_grad_();
  };
  const at::Tensor q = leaf({2, 3, 9, 8}, 1.0), k = leaf({2, 3, 11, 8}, 1.0);
  const at::Tensor v = leaf({2, 3, 11, 8}, 1.0), bias = leaf({1, 3, 9, 11}, 0.5);
  const at::Tensor w = at::randn({2, 3, 9, 8}, at::kDouble);
  const std::vector<at::Tensor> inputs{q, k, v, bias};
  const auto ours =
      torch::autograd::grad({(entropy_attn::attention(q, k, v, bias).output * w).sum()}, inputs);
  const auto sdpa =
      torch::autograd::grad({(at::scaled_dot_product_attention(q, k, v, bias) * w).sum()}, inputs);
  const char* names[] = {"query", "key", "value", "attn_mask"};
  for (size_t i = 0; i < inputs.size(); ++i) {
    ASSERT_TRUE(ours[i].defined()) << names[i];
    EXPECT_EQ(ours[i].sizes(), inputs[i].sizes()) << names[i];
    EXPECT_TRUE(all_close(ours[i], sdpa[i], {1e-10, 1e-10})) << names[i];
  }
}

TEST(AttentionPatterns, WindowEqualsItsMask) {
  // A bottom-right causal window through the C++ API equals the same pattern as a bool mask.
  at::manual_seed(11);
  const at::Tensor q = at::randn({1, 2, 7, 8}, at::kDouble);
  const at::Tensor k = at::randn({1, 2, 12, 8}, at::kDouble);
  const at::Tensor v = at::randn({1, 2, 12, 8}, at::kDouble);
  const at::Tensor i = at::arange(7).view({7, 1}) + 5, j = at::arange(12).view({1, 12});
  const at::Tensor mask = (j <= i) & (j >= i - 3);
  const AttentionResult w =
      entropy_attn::attention(q, k, v, std::nullopt, std::nullopt, /*is_causal=*/true, std::nullopt,
                              "logn", 1.0, 4.0, false, true, {3, -1}, "bottom_right");
  const AttentionResult m =
      entropy_attn::attention(q, k, v, mask, std::nullopt, false, std::nullopt, "logn", 1.0, 4.0);
  EXPECT_TRUE(at::equal(w.n_keys, m.n_keys));
  EXPECT_TRUE(all_close(w.output, m.output, {1e-12, 1e-12}));
  EXPECT_TRUE(all_close(w.entropy, m.entropy, {1e-12, 1e-12}));
}

TEST(AttentionPatterns, VarlenEqualsEachDocumentAlone) {
  // Two packed documents (T = 4 + 6) through the C++ API, against each run alone.
  at::manual_seed(12);
  const at::Tensor q = at::randn({10, 2, 8}, at::kDouble), k = at::randn({10, 2, 8}, at::kDouble);
  const at::Tensor v = at::randn({10, 2, 8}, at::kDouble);
  const at::Tensor cu = at::tensor({0, 4, 10}, at::kInt);
  const AttentionResult r =
      entropy_attn::varlen_attention(q, k, v, cu, cu, 6, 6, std::nullopt, std::nullopt,
                                     /*is_causal=*/true, std::nullopt, "logn", 1.0, 3.0);
  const int64_t bounds[3] = {0, 4, 10};
  for (int d = 0; d < 2; ++d) {
    auto doc = [&](const at::Tensor& x) {
      return x.slice(0, bounds[d], bounds[d + 1]).transpose(0, 1).unsqueeze(0);
    };
    const AttentionResult alone = entropy_attn::attention(
        doc(q), doc(k), doc(v), std::nullopt, std::nullopt, true, std::nullopt, "logn", 1.0, 3.0);
    EXPECT_TRUE(all_close(doc(r.output), alone.output, {1e-12, 1e-12})) << "document " << d;
    EXPECT_TRUE(
        at::equal(r.n_keys.slice(0, bounds[d], bounds[d + 1]).t().unsqueeze(0), alone.n_keys));
  }
}

TEST(AttentionPatterns, VarlenNumSplitsOneGivesEachSequenceItsBitsAlone) {
  // num_splits = 1 through the C++ API: a decoding row packed after a long causal document has the
  // bits of its call alone; other counts raise.
  at::manual_seed(13);
  const at::Tensor q = at::randn({601, 2, 16}), k = at::randn({1400, 2, 16});
  const at::Tensor v = at::randn({1400, 2, 16});
  const at::Tensor cu_q = at::tensor({0, 600, 601}, at::kInt),
                   cu_k = at::tensor({0, 700, 1400}, at::kInt);
  auto call = [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const at::Tensor& cu_q, const at::Tensor& cu_k, int64_t max_q, int64_t max_k,
                 std::optional<int64_t> splits) {
    return entropy_attn::varlen_attention(
        q, k, v, cu_q, cu_k, max_q, max_k, std::nullopt, std::nullopt,
        /*is_causal=*/true, std::nullopt, "fixed", 1.0, 512.0, false, true, {-1, -1}, 0.0,
        std::nullopt, 0.0, 0, std::nullopt, splits);
  };
  const AttentionResult packed = call(q, k, v, cu_q, cu_k, 600, 700, 1);
  const AttentionResult alone =
      call(q.slice(0, 600), k.slice(0, 700), v.slice(0, 700), at::tensor({0, 1}, at::kInt),
           at::tensor({0, 700}, at::kInt), 1, 700, 1);
  EXPECT_TRUE(at::equal(packed.output.slice(0, 600), alone.output));
  EXPECT_TRUE(at::equal(packed.entropy.slice(0, 600), alone.entropy));
  EXPECT_THROW(call(q, k, v, cu_q, cu_k, 600, 700, 2), c10::ValueError);
}

TEST(AttentionPatterns, VarlenTakesEveryOptionOfTheSchema) {
  // The C++ varlen_attention passes the schema's scale tensor, scale_factor, temperature,
  // seqused_k and dropout through (it once fixed them): each document against its dense call.
  at::manual_seed(13);
  const at::Tensor q = at::randn({9, 2, 8}, at::kDouble), k = at::randn({12, 2, 8}, at::kDouble);
  const at::Tensor v = at::randn({12, 2, 8}, at::kDouble);
  const at::Tensor cu_q = at::tensor({0, 4, 9}, at::kInt), cu_k = at::tensor({0, 5, 12}, at::kInt);
  const at::Tensor used = at::tensor({3, 7}, at::kInt);          // the first keys of each slot
  const at::Tensor scale = at::rand({9, 2}, at::kDouble) + 0.5;  // per (row, head)
  const AttentionResult r = entropy_attn::varlen_attention(
      q, k, v, cu_q, cu_k, 5, 7, scale, used, /*is_causal=*/true, std::nullopt, "logn", 2.0, 3.0);
  const int64_t rows[3] = {0, 4, 9}, keys[3] = {0, 5, 12}, n_used[2] = {3, 7};
  for (int d = 0; d < 2; ++d) {
    auto doc = [](const at::Tensor& x, int64_t a, int64_t b) {
      return x.slice(0, a, b).transpose(0, 1).unsqueeze(0);
    };
    const at::Tensor kd = doc(k, keys[d], keys[d] + n_used[d]);
    const at::Tensor vd = doc(v, keys[d], keys[d] + n_used[d]);
    const AttentionResult alone = entropy_attn::attention(
        doc(q, rows[d], rows[d + 1]), kd, vd, std::nullopt, doc(scale, rows[d], rows[d + 1]), true,
        std::nullopt, "logn", 2.0, 3.0, false, true, {-1, -1}, "bottom_right");
    EXPECT_TRUE(all_close(doc(r.output, rows[d], rows[d + 1]), alone.output, {1e-12, 1e-12}))
        << "document " << d;
    EXPECT_TRUE(all_close(doc(r.row_scale, rows[d], rows[d + 1]), alone.row_scale, {1e-15, 1e-15}));
  }
  // scale_factor with a log-n policy is the base scale: a float c equals the tensor c.
  const AttentionResult f = entropy_attn::varlen_attention(q, k, v, cu_q, cu_k, 5, 7, std::nullopt,
                                                           std::nullopt, false, 0.25, "logn");
  const AttentionResult t =
      entropy_attn::varlen_attention(q, k, v, cu_q, cu_k, 5, 7, at::full({1}, 0.25, at::kDouble),
                                     std::nullopt, false, std::nullopt, "logn");
  EXPECT_TRUE(all_close(f.output, t.output, {1e-15, 1e-15}));
  // Dropout: reproducible under its seed, changes the output, not the statistics.
  auto dropped = [&](int64_t seed) {
    return entropy_attn::varlen_attention(q, k, v, cu_q, cu_k, 5, 7, std::nullopt, std::nullopt,
                                          false, std::nullopt, "fixed", 1.0, 512.0, false, true,
                                          {-1, -1}, 0.0, std::nullopt, 0.5, seed);
  };
  const AttentionResult d1 = dropped(7), d2 = dropped(7);
  const AttentionResult plain = entropy_attn::varlen_attention(q, k, v, cu_q, cu_k, 5, 7);
  EXPECT_TRUE(at::equal(d1.output, d2.output));
  EXPECT_FALSE(at::equal(d1.output, dropped(8).output));  // the seed reaches the op
  EXPECT_FALSE(all_close(d1.output, plain.output, {1e-6, 1e-6}));
  EXPECT_TRUE(all_close(d1.entropy, plain.entropy, {1e-15, 1e-15}));
}

TEST(AttentionPatterns, VarlenReadsAPagedCache) {
  // A paged KV cache through the C++ API (block_table, cu_seq_k absent): pages of 4 tokens in a
  // shuffled pool, sequence 0 using 6 keys of pages 3 and 0, sequence 1 using 3 keys of page 2
  // (its second column, -1, is never read), against the same keys packed. (The CPU kernels read
  // them in the pool, through key_rows.)
  at::manual_seed(14);
  const at::Tensor q = at::randn({3, 2, 8}, at::kDouble);
  const at::Tensor k_pool = at::randn({4, 4, 2, 8}, at::kDouble);
  const at::Tensor v_pool = at::randn({4, 4, 2, 8}, at::kDouble);
  const at::Tensor table = at::tensor({3, 0, 2, -1}, at::kInt).reshape({2, 2});
  const at::Tensor used = at::tensor({6, 3}, at::kInt), cu_q = at::tensor({0, 2, 3}, at::kInt);
  auto packed = [](const at::Tensor& pool) {
    return at::cat({pool[3], pool[0].slice(0, 0, 2), pool[2].slice(0, 0, 3)});
  };
  const AttentionResult want = entropy_attn::varlen_attention(
      q, packed(k_pool), packed(v_pool), cu_q, at::tensor({0, 6, 9}, at::kInt), 2, 6, std::nullopt,
      std::nullopt, /*is_causal=*/true, std::nullopt, "logn", 1.0, 3.0);
  const AttentionResult got = entropy_attn::varlen_attention(
      q, k_pool, v_pool, cu_q, std::nullopt, 2, 6, std::nullopt, used, /*is_causal=*/true,
      std::nullopt, "logn", 1.0, 3.0, false, true, {-1, -1}, 0.0, std::nullopt, 0.0, 0, table);
  EXPECT_TRUE(all_close(got.output, want.output, {1e-12, 1e-12}));
  EXPECT_TRUE(all_close(got.entropy, want.entropy, {1e-12, 1e-12}));
  EXPECT_TRUE(at::equal(got.n_keys, want.n_keys));
}

// ---- Meta kernels ------------------------------------------------------------------------------

TEST(AttentionMeta, ShapesAndDtypes) {
  const auto meta = at::TensorOptions().device(at::kMeta);
  const at::Tensor q = at::empty({2, 6, 5, 8}, meta.dtype(at::kBFloat16));
  const at::Tensor k = at::empty({2, 3, 7, 8}, meta.dtype(at::kBFloat16));
  const at::Tensor v = at::empty({2, 3, 7, 4}, meta.dtype(at::kBFloat16));
  Args a;
  a.enable_gqa = true;
  a.attn_mask = at::empty({5, 7}, meta.dtype(at::kBool));
  const AttentionResult r = call_dispatcher(q, k, v, a);
  EXPECT_TRUE(r.output.is_meta());
  EXPECT_EQ(r.output.sizes(), (std::vector<int64_t>{2, 6, 5, 4}));
  EXPECT_EQ(r.output.scalar_type(), at::kBFloat16);
  for (const at::Tensor& s :
       {r.lse, r.entropy, r.sum_p2, r.max_weight, r.row_scale, r.length_factor}) {
    EXPECT_EQ(s.sizes(), (std::vector<int64_t>{2, 6, 5}));
    EXPECT_EQ(s.scalar_type(), at::kFloat);
  }
  EXPECT_EQ(r.n_keys.scalar_type(), at::kLong);
  // The Meta kernel checks its arguments as the CPU kernel does.
  Args bad = a;
  bad.enable_gqa = false;
  EXPECT_THROW(call_dispatcher(q, k, v, bad), c10::Error);
  const at::Tensor e = call_reduction_dispatcher("entropy_attn::entropy",
                                                 at::empty({3, 4, 5}, meta.dtype(at::kFloat)), 1);
  EXPECT_EQ(e.sizes(), (std::vector<int64_t>{3, 5}));
}

// ---- entropy / sparsity ops --------------------------------------------------------------------

at::Tensor ref_entropy(const at::Tensor& p, int64_t dim) {
  const at::Tensor pd = p.to(at::kDouble);
  return -(pd * at::log(at::where(pd > 0, pd, at::ones_like(pd)))).sum(dim);
}

at::Tensor ref_sparsity(const at::Tensor& a, int64_t dim) {
  const at::Tensor ad = a.to(at::kDouble);
  const at::Tensor l1 = ad.abs().mean(dim);
  const at::Tensor rms = (ad * ad).mean(dim).sqrt();
  return at::where(rms > 0, l1 / at::where(rms > 0, rms, at::ones_like(rms)), at::zeros_like(rms));
}

TEST(EntropyOp, MatchesReferenceAlongEachDim) {
  at::manual_seed(21);
  for (const at::ScalarType dtype : {at::kDouble, at::kFloat}) {
    for (const int64_t dim : {-1, 0, 1, 2}) {
      SCOPED_TRACE("dim " + std::to_string(dim) + " " + dtype_name(dtype));
      at::Tensor p = at::softmax(at::randn({3, 4, 10}, at::kDouble) * 2, dim);
      // Exact zeros, but never a whole slice (its largest entry stays).
      const at::Tensor is_max = p == std::get<0>(p.max(dim, /*keepdim=*/true));
      p = p.masked_fill((at::rand({3, 4, 10}, at::kDouble) < 0.3) & is_max.logical_not(), 0.0);
      p = (p / p.sum(dim, /*keepdim=*/true)).to(dtype);
      const at::Tensor want = ref_entropy(p, dim);
      const Tol tol = dtype == at::kDouble ? Tol{1e-12, 1e-12} : Tol{1e-5, 1e-5};
      EXPECT_TRUE(all_close(entropy_attn::entropy(p, dim), want, tol)) << "C++ API";
      EXPECT_TRUE(all_close(call_reduction_dispatcher("entropy_attn::entropy", p, dim), want, tol))
          << "dispatcher";
    }
  }
  // One-hot rows have entropy 0; uniform rows ln n.
  const at::Tensor onehot = at::eye(6, at::kDouble);
  EXPECT_TRUE(all_close(entropy_attn::entropy(onehot), at::zeros({6}, at::kDouble), {0, 0}));
  const at::Tensor uniform = at::full({2, 8}, 1.0 / 8, at::kDouble);
  EXPECT_TRUE(all_close(entropy_attn::entropy(uniform), at::full({2}, std::log(8.0), at::kDouble),
                        {1e-12, 1e-12}));
}

TEST(EntropyOp, Gradient) {
  at::manual_seed(22);
  const at::Tensor p0 = at::softmax(at::randn({4, 7}, at::kDouble), -1);
  const at::Tensor w = at::randn({4}, at::kDouble);
  const at::Tensor p1 = p0.clone().requires_grad_(true), p2 = p0.clone().requires_grad_(true);
  const auto got = torch::autograd::grad({(entropy_attn::entropy(p1) * w).sum()}, {p1});
  const auto want = torch::autograd::grad({(ref_entropy(p2, -1) * w).sum()}, {p2});
  EXPECT_TRUE(all_close(got[0], want[0], {1e-10, 1e-10}));
}

TEST(SparsityOp, MatchesReferenceAlongEachDim) {
  at::manual_seed(23);
  for (const at::ScalarType dtype : {at::kDouble, at::kFloat}) {
    for (const int64_t dim : {-1, 0, 1}) {
      SCOPED_TRACE("dim " + std::to_string(dim) + " " + dtype_name(dtype));
      at::Tensor a = at::randn({5, 16}, at::kDouble);
      a.index_put_({2}, 0.0);                         // an all-zero row
      a.index_put_({at::indexing::Slice(), 3}, 0.0);  // an all-zero column
      a = a.to(dtype);
      const at::Tensor want = ref_sparsity(a, dim);
      const Tol tol = dtype == at::kDouble ? Tol{1e-12, 1e-12} : Tol{1e-5, 1e-5};
      EXPECT_TRUE(all_close(entropy_attn::sparsity(a, dim), want, tol)) << "C++ API";
      EXPECT_TRUE(all_close(call_reduction_dispatcher("entropy_attn::sparsity", a, dim), want, tol))
          << "dispatcher";
    }
  }
  // One nonzero entry: 1/sqrt(n) ... and a constant row: 1.
  at::Tensor onehot = at::zeros({1, 9}, at::kDouble);
  onehot.index_put_({0, 4}, -3.0);
  EXPECT_TRUE(all_close(entropy_attn::sparsity(onehot), at::full({1}, 1.0 / 3.0, at::kDouble),
                        {1e-12, 1e-12}));
  EXPECT_TRUE(all_close(entropy_attn::sparsity(at::full({1, 9}, 2.5, at::kDouble)),
                        at::ones({1}, at::kDouble), {1e-12, 1e-12}));
}

// attention_sparsity against the full matrix a = f(lambda q k^T) under a causal bool mask.
TEST(AttentionSparsityOp, MatchesFullMatrix) {
  at::manual_seed(25);
  const at::Tensor q = at::randn({2, 2, 9, 4}, at::kDouble);
  const at::Tensor k = at::randn({2, 2, 700, 4}, at::kDouble);
  const at::Tensor mask = at::rand({9, 700}, at::kDouble) > 0.3;
  const at::Tensor allowed = mask.logical_and(at::ones({9, 700}, at::kBool).tril());
  const at::Tensor s = at::matmul(q, k.transpose(-1, -2)) * 0.5;  // 1/sqrt(4)
  const at::Tensor n = allowed.sum(-1).to(at::kDouble);
  for (const char* kind : {"exp", "relu2", "identity"}) {
    SCOPED_TRACE(kind);
    at::Tensor a;
    if (std::string(kind) == "exp") {
      a = at::exp(s - std::get<0>(s.masked_fill(allowed.logical_not(), -1e300).max(-1, true)));
    } else if (std::string(kind) == "relu2") {
      a = at::relu(s).pow(2);
    } else {
      a = s;
    }
    a = at::where(allowed, a, at::zeros_like(a));
    const at::Tensor want = a.abs().sum(-1) / at::sqrt(n * (a * a).sum(-1));
    const at::Tensor got =
        entropy_attn::attention_sparsity(q, k, mask, std::nullopt, kind, /*is_causal=*/true);
    EXPECT_TRUE(all_close(got, want, {1e-10, 1e-10}));
  }
  EXPECT_THROW(entropy_attn::attention_sparsity(q, k, std::nullopt, std::nullopt, "cube"),
               c10::ValueError);
}

TEST(SparsityOp, Gradient) {
  at::manual_seed(24);
  const at::Tensor a0 = at::randn({4, 7}, at::kDouble);
  const at::Tensor w = at::randn({4}, at::kDouble);
  const at::Tensor a1 = a0.clone().requires_grad_(true), a2 = a0.clone().requires_grad_(true);
  const auto got = torch::autograd::grad({(entropy_attn::sparsity(a1) * w).sum()}, {a1});
  const auto want = torch::autograd::grad({(ref_sparsity(a2, -1) * w).sum()}, {a2});
  EXPECT_TRUE(all_close(got[0], want[0], {1e-10, 1e-10}));
  // All-zero input: value 0 and a finite gradient.
  const at::Tensor z = at::zeros({2, 5}, at::kDouble).requires_grad_(true);
  const at::Tensor s = entropy_attn::sparsity(z);
  EXPECT_TRUE(at::equal(s.detach(), at::zeros({2}, at::kDouble)));
  expect_all_finite(torch::autograd::grad({s.sum()}, {z}), "sparsity gradient at 0");
}

// ---- bad inputs --------------------------------------------------------------------------------

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char ch) { return std::tolower(ch); });
  return s;
}

// Expects fn to throw a c10::ValueError or c10::TypeError (Python ValueError / TypeError) whose
// message names one of `names`.
void expect_bad_argument(const std::string& what, const std::function<void()>& fn,
                         std::initializer_list<const char*> names) {
  SCOPED_TRACE(what);
  try {
    fn();
    ADD_FAILURE() << what << ": no exception";
  } catch (const c10::Error& e) {
    const bool typed = dynamic_cast<const c10::ValueError*>(&e) != nullptr ||
                       dynamic_cast<const c10::TypeError*>(&e) != nullptr;
    EXPECT_TRUE(typed) << what
                       << ": expected ValueError or TypeError, got: " << e.what_without_backtrace();
    const std::string msg = lower(e.what_without_backtrace());
    bool named = false;
    for (const char* n : names) named = named || msg.find(lower(n)) != std::string::npos;
    EXPECT_TRUE(named) << what << ": message does not name the argument: " << msg;
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << ": not a c10::Error: " << e.what();
  }
}

TEST(AttentionErrors, BadInputsThrow) {
  const auto f32 = at::kFloat;
  const at::Tensor q = at::randn({2, 4, 5, 8}, f32);
  const at::Tensor k = at::randn({2, 4, 7, 8}, f32);
  const at::Tensor v = at::randn({2, 4, 7, 8}, f32);
  const at::Tensor k2 = at::randn({2, 2, 7, 8}, f32), v2 = at::randn({2, 2, 7, 8}, f32);
  auto attn = [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, Args a = {}) {
    return [=] { call_dispatcher(q, k, v, a); };
  };
  auto with = [](auto edit) {
    Args a;
    edit(a);
    return a;
  };

  expect_bad_argument("query rank 3", attn(q[0], k, v), {"query"});
  expect_bad_argument("key rank 5", attn(q, k.unsqueeze(0), v), {"key"});
  expect_bad_argument("value rank 3", attn(q, k, v[0]), {"value"});
  expect_bad_argument("batch mismatch", attn(q, at::randn({3, 4, 7, 8}), at::randn({3, 4, 7, 8})),
                      {"batch", "key"});
  expect_bad_argument("head_dim mismatch", attn(q, at::randn({2, 4, 7, 6}), v),
                      {"head_dim", "key"});
  expect_bad_argument("key/value length mismatch", attn(q, k, at::randn({2, 4, 6, 8})), {"value"});
  expect_bad_argument("H not a multiple of Hkv",
                      attn(at::randn({2, 6, 5, 8}), at::randn({2, 4, 7, 8}),
                           at::randn({2, 4, 7, 8}), with([](Args& a) { a.enable_gqa = true; })),
                      {"heads", "enable_gqa", "key"});
  expect_bad_argument("GQA without enable_gqa", attn(q, k2, v2), {"enable_gqa"});
  expect_bad_argument("mixed dtypes", attn(q, k.to(at::kDouble), v), {"dtype"});
  expect_bad_argument("integer query", attn(q.to(at::kLong), k.to(at::kLong), v.to(at::kLong)),
                      {"query"});
  expect_bad_argument(
      "int mask", attn(q, k, v, with([](Args& a) { a.attn_mask = at::ones({5, 7}, at::kInt); })),
      {"attn_mask"});
  expect_bad_argument(
      "mask of wrong shape",
      attn(q, k, v, with([](Args& a) { a.attn_mask = at::ones({6, 7}, at::kBool); })),
      {"attn_mask"});
  expect_bad_argument(
      "mask of rank 5",
      attn(q, k, v, with([](Args& a) { a.attn_mask = at::ones({1, 2, 4, 5, 7}, at::kBool); })),
      {"attn_mask"});
  expect_bad_argument("scale tensor of wrong shape",
                      attn(q, k, v, with([](Args& a) { a.scale = at::ones({2, 4, 6}); })),
                      {"scale"});
  expect_bad_argument("integer scale tensor",
                      attn(q, k, v, with([](Args& a) { a.scale = at::ones({4, 1}, at::kLong); })),
                      {"scale"});
  for (const double t : {0.0, -1.0, std::nan(""), kInf}) {
    expect_bad_argument("temperature " + std::to_string(t),
                        attn(q, k, v, with([t](Args& a) { a.temperature = t; })), {"temperature"});
  }
  expect_bad_argument("log_base 1", attn(q, k, v, with([](Args& a) {
                                           a.scale_mode = "logn";
                                           a.log_base = 1.0;
                                         })),
                      {"log_base", "train_length"});
  expect_bad_argument("unknown scale_mode",
                      attn(q, k, v, with([](Args& a) { a.scale_mode = "sqrt"; })), {"scale"});
  expect_bad_argument("non-finite scale_factor",
                      attn(q, k, v, with([](Args& a) { a.scale_factor = std::nan(""); })),
                      {"scale"});

  // Through the C++ API as well.
  EXPECT_THROW(entropy_attn::attention(q[0], k, v), c10::Error);
  // entropy / sparsity: dim out of range.
  EXPECT_THROW(entropy_attn::entropy(at::rand({3, 4}), 2), c10::Error);
  EXPECT_THROW(entropy_attn::sparsity(at::rand({3, 4}), -3), c10::Error);
  // An undefined tensor where it is the call's only one (or all of them): named, as None is from
  // Python (the dispatcher's "tensor does not have a device" named nothing).
  const at::Tensor none;
  expect_bad_argument("undefined p", [&] { entropy_attn::entropy(none); }, {"p must be a tensor"});
  expect_bad_argument("undefined a", [&] { entropy_attn::sparsity(none); }, {"a must be a tensor"});
  expect_bad_argument("undefined n_keys", [&] { entropy_attn::length_factor(none); }, {"n_keys"});
  expect_bad_argument("undefined query and key",
                      [&] { entropy_attn::attention_sparsity(none, none); }, {"query"});
  expect_bad_argument("undefined inputs", [&] { entropy_attn::attention(none, none, none); },
                      {"query"});
  expect_bad_argument(
      "undefined packed inputs",
      [&] { entropy_attn::varlen_attention(none, none, none, none, std::nullopt, 1, 1); },
      {"query"});
}

}  // namespace

// length_factor gives the attention op's own length_factor output for the same n_i, so that a
// shard of a row's keys can be given the whole row's lambda.
TEST(LengthFactor, EqualsTheOpsLengthFactorOutput) {
  const at::Tensor q = at::randn({1, 2, 9, 8}, at::kDouble);
  const auto full = entropy_attn::attention(q, q, q, std::nullopt, std::nullopt,
                                            /*is_causal=*/true, std::nullopt, "logn", 1.5, 4.0);
  const at::Tensor factor = entropy_attn::length_factor(full.n_keys, "logn", 1.5, 4.0, at::kDouble);
  EXPECT_TRUE(at::equal(factor, full.length_factor));
  EXPECT_THROW(entropy_attn::length_factor(full.n_keys, "log", 1.0, 4.0), c10::Error);
  EXPECT_THROW(entropy_attn::length_factor(full.lse, "logn", 1.0, 4.0), c10::Error);
}
