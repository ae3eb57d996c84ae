// Argument checks of the row-reduction ops (entropy, sparsity), shared by every kernel.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace entropy_attn {

// Validates `x` (named `name` in errors) and returns `dim` wrapped into [0, x.dim()).
inline int64_t checked_reduction_dim(const at::Tensor& x, int64_t dim, const char* name) {
  const auto t = x.scalar_type();
  TORCH_CHECK_TYPE(t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf,
                   name, " must be float32, float64, bfloat16 or float16, got ", t);
  TORCH_CHECK_VALUE(x.dim() >= 1, name, " must have at least one dimension");
  TORCH_CHECK_VALUE(dim >= -x.dim() && dim < x.dim(), "dim must be in [", -x.dim(), ", ",
                    x.dim() - 1, "] for ", name, " of shape ", x.sym_sizes(), ", got ", dim);
  return dim < 0 ? dim + x.dim() : dim;
}

}  // namespace entropy_attn
