#include "head_dim_padding.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>

#include <algorithm>

namespace entropy_attn {

int64_t padded_head_dim(const AttentionShape& shape, std::initializer_list<int64_t> dims) {
  const int64_t need = std::max(shape.head_dim, shape.v_head_dim);
  for (const int64_t dim : dims) {
    if (dim >= need) {
      return dim == shape.head_dim && dim == shape.v_head_dim ? 0 : dim;
    }
  }
  return 0;
}

at::Tensor pad_head_dim(const at::Tensor& t, int64_t dim) {
  if (t.size(-1) == dim) return t;  // (the other of q·k and v needed the padding)
  return at::constant_pad_nd(t, {0, dim - t.size(-1)}, 0);
}

AttentionCall with_head_dim(AttentionCall call, int64_t dim) {
  AttentionOptions& o = call.options;
  o.scale_factor = base_scale(o.scale_factor, call.shape.head_dim);
  call.shape.head_dim = call.shape.v_head_dim = dim;
  return call;
}

AttentionBackwardCall with_head_dim(AttentionBackwardCall call, int64_t dim) {
  call.shape.head_dim = call.shape.v_head_dim = dim;
  return call;
}

AttentionOutputs unpad_outputs(AttentionOutputs padded, const at::Tensor& output) {
  at::Tensor& out = std::get<0>(padded);
  output.copy_(out.narrow(-1, 0, output.size(-1)));
  out = output;
  return padded;
}

AttentionGrads unpad_grads(const AttentionGrads& padded, const at::Tensor& query,
                           const at::Tensor& key, const at::Tensor& value) {
  const auto& [dq, dk, dv, dlam] = padded;
  return {in_layout_of(query, dq.narrow(-1, 0, query.size(-1)), query.scalar_type()),
          in_layout_of(key, dk.narrow(-1, 0, key.size(-1)), key.scalar_type()),
          in_layout_of(value, dv.narrow(-1, 0, value.size(-1)), value.scalar_type()), dlam};
}

}  // namespace entropy_attn
