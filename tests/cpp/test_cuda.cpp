// GoogleTest cases of the CUDA kernels through LibTorch: the CUDA results must agree with the CPU
// kernels (which tests/cpp/test_attention.cpp checks against a float64 reference) for the forward
// outputs, the gradients and the row reductions. Every case skips, visibly, without a CUDA device
// or in a build without the CUDA kernels.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>
#include <torch/cuda.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "entropy_attn.h"

namespace {

#define SKIP_WITHOUT_CUDA()                                             \
  do {                                                                  \
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device"; \
    if (!c10::Dispatcher::singleton()                                   \
             .findSchemaOrThrow("entropy_attn::attention", "")          \
             .hasKernelForDispatchKey(c10::DispatchKey::CUDA)) {        \
      GTEST_SKIP() << "built without the CUDA kernels";                 \
    }                                                                   \
  } while (0)

void expect_close(const at::Tensor& cuda, const at::Tensor& cpu, double tol,
                  const std::string& what) {
  const at::Tensor a = cuda.to(at::kCPU, at::kDouble), b = cpu.to(at::kDouble);
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  const double err = (a - b).abs().max().item<double>();
  const double scale = std::max(1.0, b.abs().max().item<double>());
  EXPECT_LE(err, tol * scale) << what << ": max |cuda - cpu| = " << err;
}

struct Case {
  at::ScalarType dtype;
  int64_t lq, lk, d, dv;
  bool causal;
  bool mask;
  int64_t heads, kv_heads;
  const char* scale_mode;
};

class CudaMatchesCpu : public ::testing::TestWithParam<Case> {};

TEST_P(CudaMatchesCpu, ForwardAndBackward) {
  SKIP_WITHOUT_CUDA();
  const Case c = GetParam();
  at::manual_seed(0);
  const auto opts = at::TensorOptions().dtype(c.dtype);
  const at::Tensor q = at::randn({2, c.heads, c.lq, c.d}, opts);
  const at::Tensor k = at::randn({2, c.kv_heads, c.lk, c.d}, opts);
  const at::Tensor v = at::randn({2, c.kv_heads, c.lk, c.dv}, opts);
  std::optional<at::Tensor> mask;
  if (c.mask) mask = at::rand({1, c.heads, c.lq, c.lk}) > 0.3;
  const bool gqa = c.heads != c.kv_heads;
  const double tol = c.dtype == at::kDouble ? 1e-10 : c.dtype == at::kFloat ? 1e-4 : 3e-2;

  auto run = [&](const at::Device& dev) {
    std::vector<at::Tensor> leaves;
    for (const at::Tensor& t : {q, k, v}) leaves.push_back(t.to(dev).requires_grad_(true));
    std::optional<at::Tensor> m;
    if (mask) m = mask->to(dev);
    auto r = entropy_attn::attention(leaves[0], leaves[1], leaves[2], m, std::nullopt, c.causal,
                                     std::nullopt, c.scale_mode, 1.0, 64.0, gqa);
    // Gradients through the output and the differentiable statistics.
    (r.output.to(at::kFloat).square().sum() + r.entropy.sum() + 0.5 * r.lse.sum() + r.sum_p2.sum())
        .backward();
    std::vector<at::Tensor> all{r.output,     r.lse,    r.entropy,   r.sum_p2,
                                r.max_weight, r.n_keys, r.row_scale, r.length_factor};
    for (const at::Tensor& t : leaves) all.push_back(t.grad());
    return all;
  };
  const std::vector<at::Tensor> gpu = run(at::Device(at::kCUDA)), cpu = run(at::Device(at::kCPU));
  const char* names[] = {"output",    "lse",           "entropy", "sum_p2", "max_weight", "n_keys",
                         "row_scale", "length_factor", "grad_q",  "grad_k", "grad_v"};
  for (size_t i = 0; i < gpu.size(); ++i) expect_close(gpu[i], cpu[i], tol, names[i]);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaMatchesCpu,
    ::testing::Values(Case{at::kFloat, 37, 70, 64, 64, false, false, 4, 4, "fixed"},
                      Case{at::kFloat, 130, 97, 40, 24, true, true, 4, 2, "logn"},
                      Case{at::kDouble, 65, 65, 128, 128, true, false, 2, 2, "logn_sharpen"},
                      Case{at::kHalf, 200, 300, 64, 64, false, true, 8, 2, "fixed"},
                      Case{at::kBFloat16, 129, 129, 128, 96, true, false, 4, 4, "logn"},
                      Case{at::kHalf, 33, 50, 256, 256, false, false, 2, 2, "fixed"},
                      Case{at::kFloat, 1, 1, 8, 8, true, false, 1, 1, "fixed"},
                      Case{at::kFloat, 20, 0, 16, 16, false, false, 2, 2, "logn"}));

TEST(CudaReductions, MatchCpu) {
  SKIP_WITHOUT_CUDA();
  at::manual_seed(0);
  for (at::ScalarType dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
    const at::Tensor p = at::softmax(at::randn({3, 5, 77}), -1).to(dtype);
    const at::Tensor a = at::randn({4, 130, 6}).to(dtype);
    const double tol = dtype == at::kFloat || dtype == at::kDouble ? 1e-5 : 1e-2;
    expect_close(entropy_attn::entropy(p.cuda(), -1), entropy_attn::entropy(p, -1), tol, "entropy");
    expect_close(entropy_attn::sparsity(a.cuda(), 1), entropy_attn::sparsity(a, 1), tol,
                 "sparsity");
  }
}

TEST(CudaErrors, HeadDimLimits) {
  SKIP_WITHOUT_CUDA();
  const at::Tensor big = at::randn({1, 1, 4, 320}, at::TensorOptions().device(at::kCUDA));
  EXPECT_THROW(entropy_attn::attention(big, big, big), c10::ValueError);
  const at::Tensor f64 =
      at::randn({1, 1, 4, 192}, at::TensorOptions().device(at::kCUDA).dtype(at::kDouble));
  EXPECT_THROW(entropy_attn::attention(f64, f64, f64), c10::ValueError);
}

}  // namespace
