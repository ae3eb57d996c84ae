// The CUDA ops: attention_host.h prepares the tensors and kernel parameters; this file checks the
// device's shared memory, guards the device and launches on its current stream. Registered for the
// CUDA dispatch key.
#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>

#include "../head_dim_padding.h"
#include "attention_host.h"
#include "fallback/launch.h"
#include "family.h"

namespace entropy_attn::cuda {
namespace {

// A value that carries a type (std::type_identity is C++20; torch 2.11 builds extensions as C++17).
template <typename T>
struct TypeTag {
  using type = T;
};

// Calls f(TypeTag<T>{}) with T the CUDA type of `dtype`.
template <typename F>
void dispatch_cuda_type(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat:
      return f(TypeTag<float>{});
    case at::kDouble:
      return f(TypeTag<double>{});
    case at::kHalf:
      return f(TypeTag<__half>{});
    case at::kBFloat16:
      return f(TypeTag<__nv_bfloat16>{});
    default:
      TORCH_CHECK_TYPE(false, "unsupported dtype ", dtype);
  }
}

// Raises unless the current device is one the attention kernels are written for: compute
// capability 8.0 or newer. (The default build embeds no machine code for older GPUs, and their
// shared memory per block, 64 KB on a T4, holds none of the fallback's forward tiles. The row
// reductions and attention_sparsity, which a build for them could run there, do not ask.)
void check_device() {
  const int sm = device_sm();
  TORCH_CHECK(sm >= 80,
              "entropy_attn's CUDA attention kernels need a GPU of compute capability 8.0 or "
              "newer (Ampere and later), but CUDA device ",
              static_cast<int>(c10::cuda::current_device()), " is ", sm / 10, ".", sm % 10,
              ": run the op on CPU tensors");
}

// Raises unless the current device grants `bytes` of shared memory to one block (an A100 or H100
// does for every kernel; GPUs with 99 KB per block lack it for the float32 and float64 backward at
// head dims above 128 and 64).
void check_shared_memory(size_t bytes, const char* kernel, const AttentionShape& s,
                         at::ScalarType dtype) {
  const int optin = device_smem_optin();
  TORCH_CHECK(bytes <= static_cast<size_t>(optin), "the ", kernel, " kernel for head_dim ",
              std::max(s.head_dim, s.v_head_dim), " in ", dtype, " needs ", bytes,
              " bytes of shared memory per block, but CUDA device ",
              static_cast<int>(c10::cuda::current_device()), " allows ", optin,
              ": use a smaller head_dim, a 16-bit dtype, or CPU tensors");
}

AttentionOutputs attention_cuda(const at::Tensor& query, const at::Tensor& key,
                                const at::Tensor& value, const AttentionCall& checked) {
  const ForwardCall call(query, key, value, checked);
  const AttentionShape& sh = call.call.shape;
  if (sh.batch * sh.heads * sh.q_len == 0) return call.outputs;
  const c10::cuda::CUDAGuard guard(query.device());
  check_device();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const Family family = select_forward(call).family;
  // Head dims the tensor-core families do not compile: the same call on zero-padded inputs
  // (head_dim_padding.h) when that one goes to a tensor-core family.
  if (const int64_t dim = tensor_core_padded_head_dim(sh, call.call.dtype);
      family == Family::kFallback && dim > 0) {
    const ForwardCall padded(pad_head_dim(call.q, dim), pad_head_dim(call.k, dim),
                             pad_head_dim(call.v, dim), with_head_dim(checked, dim));
    const Family padded_family = select_forward(padded).family;
    if (padded_family != Family::kFallback) {
      check_shared_memory(forward_smem_bytes(padded), "attention forward", sh, call.call.dtype);
      C10_CUDA_CHECK(launch_forward(padded, padded_family, stream));
      return unpad_outputs(padded.outputs, std::get<0>(call.outputs));
    }
  }
  check_shared_memory(forward_smem_bytes(call), "attention forward", sh, call.call.dtype);
  C10_CUDA_CHECK(launch_forward(call, family, stream));
  return call.outputs;
}

// Allocates a call's outputs for `family` and launches its backward. Under deterministic
// algorithms every family writes a broadcast mask's gradient at the call's full shape, summed in a
// fixed order after (attention_host.h: use_full_mask_grad): B * H * Lq * Lk more elements of the
// accumulate type, as SDPA's memory-efficient backward allocates for an attention bias's gradient;
// and adds dq without atomics, or by atomics in a fixed order (the Hopper family's and the
// fallback's turns: params.h, dq_turns and tile_turns). `shape`: the call's as the user gave it,
// which an error names (a padded call's head dim is not theirs).
void run_backward(BackwardCall& call, Family family, const AttentionShape& shape) {
  const at::Tensor mask_shaped =
      at::globalContext().deterministicAlgorithms() ? use_full_mask_grad(call.call) : at::Tensor();
  call.allocate(family);
  check_shared_memory(backward_smem_bytes(call), "attention backward", shape, call.call.dtype);
  C10_CUDA_CHECK(launch_backward(call, family, c10::cuda::getCurrentCUDAStream()));
  if (mask_shaped.defined()) sum_full_mask_grad(call.call, mask_shaped);
}

AttentionGrads attention_backward_cuda(const at::Tensor& grad_output, const at::Tensor& query,
                                       const at::Tensor& key, const at::Tensor& value,
                                       const at::Tensor& output,
                                       const AttentionBackwardCall& checked) {
  BackwardCall call(grad_output, query, key, value, output, checked);
  const AttentionShape& sh = call.call.shape;
  const c10::cuda::CUDAGuard guard(query.device());
  check_device();
  const bool empty = sh.batch * sh.heads * sh.q_len == 0 && sh.batch * sh.kv_heads * sh.kv_len == 0;
  const Family family = empty ? Family::kFallback : select_backward(call).family;
  // Head dims the tensor-core families do not compile, as in the forward (attention_cuda).
  if (const int64_t dim = tensor_core_padded_head_dim(sh, call.call.dtype);
      family == Family::kFallback && !empty && dim > 0) {
    BackwardCall padded(pad_head_dim(call.dout, dim), pad_head_dim(call.q, dim),
                        pad_head_dim(call.k, dim), pad_head_dim(call.v, dim),
                        pad_head_dim(call.out, dim), with_head_dim(checked, dim));
    const Family padded_family = select_backward(padded).family;
    if (padded_family != Family::kFallback) {
      run_backward(padded, padded_family, sh);
      return unpad_grads(padded.finish(), query, key, value);
    }
  }
  if (empty) {
    call.allocate(family);
  } else {
    run_backward(call, family, sh);
  }
  return call.finish();
}

at::Tensor attention_sparsity_cuda(const at::Tensor& query, const at::Tensor& key,
                                   SparsityKind kind, const AttentionCall& checked) {
  const SparsityCall call(query, key, kind, checked);
  if (call.out.numel() == 0) return call.out;
  const c10::cuda::CUDAGuard guard(query.device());
  dispatch_cuda_type(query.scalar_type(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    check_shared_memory(fallback::attention_sparsity_smem_bytes<T>(call.call.shape.head_dim),
                        "attention_sparsity", call.call.shape, call.call.dtype);
    C10_CUDA_CHECK(fallback::launch_attention_sparsity<T>(call.params<AccType<T>>(),
                                                          c10::cuda::getCurrentCUDAStream()));
  });
  return call.out;
}

// entropy / sparsity: rows along `dim`, made contiguous, one warp each.
template <typename Launch>
at::Tensor reduce_rows_cuda(const at::Tensor& x, int64_t dim, const char* name, Launch launch) {
  const RowReductionCall call = prepare_row_reduction(x, dim, name);
  if (call.out.numel() == 0) return call.out;
  const c10::cuda::CUDAGuard guard(x.device());
  dispatch_cuda_type(x.scalar_type(), [&](auto tag) {
    C10_CUDA_CHECK(launch(tag, call.params(), c10::cuda::getCurrentCUDAStream()));
  });
  return call.out;
}

at::Tensor entropy_cuda(const at::Tensor& p, int64_t dim) {
  return reduce_rows_cuda(p, dim, "p", [](auto tag, const RowReductionParams& rp, cudaStream_t s) {
    return fallback::launch_row_entropy<typename decltype(tag)::type>(rp, s);
  });
}

at::Tensor sparsity_cuda(const at::Tensor& a, int64_t dim) {
  return reduce_rows_cuda(a, dim, "a", [](auto tag, const RowReductionParams& rp, cudaStream_t s) {
    return fallback::launch_row_sparsity<typename decltype(tag)::type>(rp, s);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(entropy_attn, CUDA, m) {
  m.impl("attention", &attention_kernel<attention_cuda>);
  m.impl("attention_backward", &attention_backward_kernel<attention_backward_cuda>);
  m.impl("attention_sparsity", &attention_sparsity_kernel<attention_sparsity_cuda>);
  m.impl("entropy", &entropy_cuda);
  m.impl("sparsity", &sparsity_cuda);
}

}  // namespace entropy_attn::cuda
