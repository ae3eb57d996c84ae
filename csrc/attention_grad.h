// The gradients of `attention`'s inputs from the upstream gradients of its outputs: what its
// autograd function's backward returns. One function, registered as the op `attention_grad`, so
// that the C++ autograd function (autograd.cpp: Python and LibTorch) and the Python autograd
// function that torch.func transforms need (torch_ext/_functorch.py) run the same code.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <tuple>

#include "op_handles.h"

namespace entropy_attn {

// An optional tensor from a possibly undefined one (autograd passes absent gradients undefined).
inline OptTensor defined_or_null(const at::Tensor& t) {
  return t.defined() ? OptTensor(t) : std::nullopt;
}

// (grad_query, grad_key, grad_value, grad_attn_mask, grad_scale, grad_sinks); the last three are
// undefined where output_mask (mask, scale, sinks) does not ask for them or the input is absent.
using AttentionInputGrads =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The arguments of the schema's `attention_grad` (ops.cpp): the upstream gradients of output, lse,
// entropy, sum_p2, normalized_entropy, sparsity and effective_keys (absent: 0), the forward's
// tensor inputs and the outputs it saved, and its key pattern, softcap and dropout.
AttentionInputGrads attention_grad(
    const OptTensor& grad_output, const OptTensor& grad_lse, const OptTensor& grad_entropy,
    const OptTensor& grad_sum_p2, const OptTensor& grad_normalized_entropy,
    const OptTensor& grad_sparsity, const OptTensor& grad_effective_keys, const at::Tensor& query,
    const at::Tensor& key, const at::Tensor& value, const OptTensor& attn_mask,
    const OptTensor& scale, const OptTensor& sinks, const at::Tensor& output, const at::Tensor& lse,
    const at::Tensor& entropy, const at::Tensor& sum_p2, const at::Tensor& n_keys,
    const at::Tensor& row_scale, const at::Tensor& length_factor, bool is_causal, bool return_stats,
    c10::IntArrayRef window_size, c10::string_view causal_alignment, double softcap,
    double dropout_p, c10::SymInt dropout_seed, const OptTensor& cu_seq_q,
    const OptTensor& cu_seq_k, std::array<bool, 3> output_mask);

// The backward of the row reductions `entropy` and `sparsity` (ops `entropy_backward`,
// `sparsity_backward`): grad (the input's shape without `dim`) times d result / d x.
at::Tensor entropy_backward(const at::Tensor& grad, const at::Tensor& p, int64_t dim);
at::Tensor sparsity_backward(const at::Tensor& grad, const at::Tensor& a, int64_t dim);

}  // namespace entropy_attn
