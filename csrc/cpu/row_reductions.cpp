// CPU kernels of the row-reduction ops on a given attention matrix: entropy (of normalized
// weights) and the l1/l2 sparsity of seed 003. Rows are reduced with terms in the accumulate type
// (float for 16-bit inputs) summed in double, in parallel over rows.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "../reduction_dim.h"
#include "../reduction_math.h"

namespace entropy_attn::cpu {
namespace {

// Applies `reduce(row_ptr, n)` to every slice of `x` along `dim`.
template <typename Reduce>
at::Tensor reduce_rows(const at::Tensor& x, int64_t dim, const char* name, Reduce reduce) {
  const int64_t d = checked_reduction_dim(x, dim, name);
  const at::Tensor rows = x.movedim(d, -1).contiguous();
  const int64_t n = x.size(d);
  std::vector<int64_t> out_sizes = x.sizes().vec();
  out_sizes.erase(out_sizes.begin() + d);
  at::Tensor out = at::empty(out_sizes, x.options());
  const int64_t count = out.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(),
                                  "entropy_attn_row_reduction_cpu", [&] {
                                    const scalar_t* in = rows.const_data_ptr<scalar_t>();
                                    scalar_t* o = out.data_ptr<scalar_t>();
                                    at::parallel_for(0, count, 64, [&](int64_t begin, int64_t end) {
                                      for (int64_t r = begin; r < end; ++r)
                                        o[r] = static_cast<scalar_t>(reduce(in + r * n, n));
                                    });
                                  });
  return out;
}

// The terms are evaluated in the input's accumulate type and summed in double: a running float32
// sum of 2^20 terms drifts by 0.6% (a uniform row's entropy came out above ln n).
at::Tensor entropy_cpu(const at::Tensor& p, int64_t dim) {
  return reduce_rows(p, dim, "p", [](const auto* x, int64_t n) {
    using acc_t = at::opmath_type<std::remove_cv_t<std::remove_pointer_t<decltype(x)>>>;
    double h = 0;
    for (int64_t j = 0; j < n; ++j) h += entropy_term(static_cast<acc_t>(x[j]));
    return h;
  });
}

at::Tensor sparsity_cpu(const at::Tensor& a, int64_t dim) {
  return reduce_rows(a, dim, "a", [](const auto* x, int64_t n) {
    using acc_t = at::opmath_type<std::remove_cv_t<std::remove_pointer_t<decltype(x)>>>;
    acc_t abs_max = 0;
    for (int64_t j = 0; j < n; ++j) abs_max = std::max(abs_max, std::abs(static_cast<acc_t>(x[j])));
    const acc_t d = sparsity_divisor(abs_max);
    double l1 = 0, l2 = 0;
    for (int64_t j = 0; j < n; ++j) {
      const double v = std::abs(static_cast<acc_t>(x[j])) / d;
      l1 += v;
      l2 += v * v;
    }
    return sparsity_value(l1, l2, n);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(entropy_attn, CPU, m) {
  m.impl("entropy", &entropy_cpu);
  m.impl("sparsity", &sparsity_cpu);
}

}  // namespace entropy_attn::cpu
