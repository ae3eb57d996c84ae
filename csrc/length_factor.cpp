// length_factor (ops.cpp): the scale policies' g(n) / temperature for given key counts, evaluated
// by the ScalePolicy the attention kernels of the same accumulate type evaluate, so that a caller
// splitting a row's keys gets the whole row's factor from the one definition. CPU loop over the
// counts (a row count's worth of work), moved to the counts' device; a Meta tensor gets a Meta
// result of the same shape.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <string_view>

#include "attention_inputs.h"
#include "kernel_args.h"

namespace entropy_attn {
namespace {

template <typename acc_t>
void fill(const at::Tensor& n, at::Tensor& out, ScaleMode mode, double temperature,
          double log_base) {
  // The policy the kernels of this accumulate type evaluate, bit for bit.
  const ScalePolicy<acc_t> policy =
      make_scale_policy<acc_t>(at::Tensor(), std::nullopt, 1, mode, log_base, temperature);
  const int64_t* src = n.const_data_ptr<int64_t>();
  acc_t* dst = out.data_ptr<acc_t>();
  for (int64_t i = 0; i < n.numel(); ++i) dst[i] = policy.factor(src[i]);
}

at::Tensor length_factor_op(const at::Tensor& n_keys, c10::string_view scale_mode,
                            double temperature, double log_base, at::ScalarType dtype) {
  const ScaleMode mode = parse_scale_mode(std::string_view(scale_mode.data(), scale_mode.size()));
  TORCH_CHECK_TYPE(!at::isFloatingType(n_keys.scalar_type()) && !n_keys.is_complex() &&
                       n_keys.scalar_type() != at::kBool,
                   "n_keys must be an integer tensor, got ", n_keys.scalar_type());
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kDouble,
                   "dtype must be torch.float32 or torch.float64, got ", dtype);
  // (as attention's check: a finite inverse, in float32 for a float32 result)
  TORCH_CHECK_VALUE(std::isfinite(temperature) && temperature > 0 && std::isfinite(1 / temperature),
                    "temperature must be a finite number > 0 with a finite inverse, got ",
                    temperature);
  TORCH_CHECK_VALUE(dtype != at::kFloat || 1 / temperature <= std::numeric_limits<float>::max(),
                    "temperature must be at least 1 / FLT_MAX for a float32 length factor, got ",
                    temperature);
  TORCH_CHECK_VALUE(std::isfinite(log_base) && log_base > 1,
                    "log_base must be a finite number > 1, got ", log_base);
  const auto opts = n_keys.options().dtype(dtype);
  // (sym_sizes: a traced size stays symbolic; sizes() fixed it, one graph per sequence length)
  if (n_keys.is_meta()) return at::empty_symint(n_keys.sym_sizes(), opts);
  const at::Tensor n = n_keys.to(at::kCPU, at::kLong).contiguous();
  at::Tensor out = at::empty(n.sizes(), n.options().dtype(dtype));
  if (dtype == at::kDouble) {
    fill<double>(n, out, mode, temperature, log_base);
  } else {
    fill<float>(n, out, mode, temperature, log_base);
  }
  return out.to(opts);
}

}  // namespace

TORCH_LIBRARY_IMPL(entropy_attn, CompositeExplicitAutograd, m) {
  m.impl("length_factor", &length_factor_op);
}

}  // namespace entropy_attn
