// Serving from C++ what was compiled in Python: LibTorch loads the AOTInductor package that
// tests/cpp/make_aoti_package.py writes (a model calling the op with its statistics, exported with
// dynamic query and key lengths) and runs it at lengths other than the traced ones. The package
// calls the op by name through the dispatcher, so this process needs only the C++ library linked;
// its outputs are compared with the op called through the C++ API.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "entropy_attn.h"

namespace {

// CTest sets it to the fixture's output (tests/cpp/CMakeLists.txt).
std::string package_path() {
  const char* path = std::getenv("ENTROPY_ATTN_AOTI_PACKAGE");
  return path == nullptr ? std::string() : std::string(path);
}

TEST(AotInductorPackage, MatchesTheOpAtNewLengths) {
  const std::string path = package_path();
  if (path.empty() || !std::ifstream(path).good()) {
    GTEST_SKIP() << "no AOTInductor package (ENTROPY_ATTN_AOTI_PACKAGE='" << path
                 << "'): CTest's make_aoti_package writes it where torch_ext is importable";
  }
  torch::inductor::AOTIModelPackageLoader loader(path);
  at::manual_seed(3);
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  for (const auto& [lq, lk] : std::vector<std::pair<int64_t, int64_t>>{{9, 12}, {5, 40}, {33, 7}}) {
    SCOPED_TRACE("Lq " + std::to_string(lq) + ", Lk " + std::to_string(lk));
    const at::Tensor q = at::randn({2, 4, lq, 16}, f64), k = at::randn({2, 2, lk, 16}, f64),
                     v = at::randn({2, 2, lk, 16}, f64);
    const std::vector<at::Tensor> got = loader.run({q, k, v});
    // Statistics in make_aoti_package.py: causal, "logn" with train_length 16, GQA.
    const entropy_attn::AttentionResult want = entropy_attn::attention(
        q, k, v, std::nullopt, std::nullopt, /*is_causal=*/true, std::nullopt, "logn",
        /*temperature=*/1.0, /*log_base=*/16.0, /*enable_gqa=*/true, /*return_stats=*/true);
    ASSERT_EQ(got.size(), 4u);
    EXPECT_TRUE(at::allclose(got[0], want.output, 1e-12, 1e-12));
    EXPECT_TRUE(at::allclose(got[1], want.lse, 1e-12, 1e-12));
    EXPECT_TRUE(at::allclose(got[2], want.entropy, 1e-12, 1e-12));
    EXPECT_TRUE(at::equal(got[3], want.n_keys));
    EXPECT_EQ(got[0].sizes(), want.output.sizes());
  }
}

}  // namespace
