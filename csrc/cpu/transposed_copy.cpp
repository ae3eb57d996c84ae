// transposed_copy (attention_cpu.h): each (batch, head) matrix transposed by transpose_block's
// 16 x 16 tiles, converted to the result's type on the way, in parallel over (batch, head). ATen's
// copy of a transposed view walks the source with a stride per element instead, which took a fifth
// of a short-sequence training step (B = 256, H = 8, L = 32: K and V in, dK and dV out).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "attention_cpu.h"
#include "block_gemm.h"

namespace entropy_attn::cpu {
namespace {

template <typename Src>
void transpose_heads(const at::Tensor& x, at::Tensor& y) {
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, y.scalar_type(), "entropy_attn_transposed_copy_to", [&] {
        const int64_t heads = x.size(1), rows = x.size(2), cols = x.size(3);
        const Src* src = x.const_data_ptr<Src>();
        scalar_t* dst = y.mutable_data_ptr<scalar_t>();
        at::parallel_for(0, x.size(0) * heads, 1, [&](int64_t begin, int64_t end) {
          for (int64_t bh = begin; bh < end; ++bh) {
            const int64_t b = bh / heads, h = bh % heads;
            transpose_block(rows, cols, src + b * x.stride(0) + h * x.stride(1), x.stride(2),
                            dst + b * y.stride(0) + h * y.stride(1), y.stride(2));
          }
        });
      });
}

}  // namespace

at::Tensor transposed_copy(const at::Tensor& x, at::ScalarType dtype) {
  return transposed_copy_into(
      x, at::empty({x.size(0), x.size(1), x.size(3), x.size(2)}, x.options().dtype(dtype)));
}

at::Tensor transposed_copy_into(const at::Tensor& x, at::Tensor y) {
  if ((x.size(3) > 1 && x.stride(3) != 1) || (y.size(3) > 1 && y.stride(3) != 1)) {
    // Rows not contiguous: ATen's strided copy. (Tensor::to with a memory format would alias: a
    // transposed view "suggests" the contiguous format.)
    return y.copy_(x.transpose(2, 3));
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(),
                                  "entropy_attn_transposed_copy",
                                  [&] { transpose_heads<scalar_t>(x, y); });
  return y;
}

at::Tensor transposed_operand(const at::Tensor& x, at::ScalarType dtype) {
  // (the operand's leading dimension, x's stride along dim, may not be less than its rows' L)
  if (x.scalar_type() == dtype && x.size(2) > 1 && x.stride(2) == 1 && x.stride(3) >= x.size(2)) {
    return gemm_operand(x.transpose(2, 3), dtype);
  }
  return transposed_copy(x, dtype);
}

}  // namespace entropy_attn::cpu
