// Head dims rounded up to a kernel's: zero columns appended to the query, key and value.
//
// A kernel family compiled for a few head dims (the CUDA tensor-core families: 64, 128, 256, with
// head_dim == v_head_dim) serves the calls with other head dims (Phi-2's 80, Phi-3's 96,
// head_dim != v_head_dim) as the same call on zero-padded tensors: q_i . k_j is unchanged by zero
// columns appended to both, the output's columns beyond v_head_dim come out as sums of zeros and
// are cut off, and the only place the head dim enters the math, the default base scale
// 1 / sqrt(head_dim), is fixed from the call's own head dim first (docs/math.md section 7). The
// gradients' padded columns are likewise cut off. Device-independent ATen code: the CUDA host
// (csrc/cuda/attention_cuda.cpp) pads, and tests/cpp checks the identity on the CPU.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <initializer_list>

#include "attention_call.h"

namespace entropy_attn {

// The smallest of `dims` (ascending) that holds both of the call's head dims, or 0 when none does
// or the call's head dims are already that one (nothing to pad).
int64_t padded_head_dim(const AttentionShape& shape, std::initializer_list<int64_t> dims);

// `t` (..., d) with zero columns appended up to (..., dim) (a new contiguous tensor), or `t`
// itself when d = dim.
at::Tensor pad_head_dim(const at::Tensor& t, int64_t dim);

// The call at head_dim = v_head_dim = dim, its base scale fixed to the one of its own head dim
// (an explicit scale factor, else 1 / sqrt(head_dim)).
AttentionCall with_head_dim(AttentionCall call, int64_t dim);
// The backward call at head_dim = v_head_dim = dim (its logits come from the forward's row_scale:
// no scale to fix).
AttentionBackwardCall with_head_dim(AttentionBackwardCall call, int64_t dim);

// The outputs of a padded call with its output's first v_head_dim columns copied into `output`
// (allocated for the call's own shape), which replaces it; the row statistics are the padded
// call's.
AttentionOutputs unpad_outputs(AttentionOutputs padded, const at::Tensor& output);

// The gradients of a padded backward cut to the head dims of the call's query, key and value, each
// in its input's dtype and layout (attention_call.h: in_layout_of): (grad_query[..., :head_dim],
// grad_key[..., :head_dim], grad_value[..., :v_head_dim], grad_row_scale).
AttentionGrads unpad_grads(const AttentionGrads& padded, const at::Tensor& query,
                           const at::Tensor& key, const at::Tensor& value);

}  // namespace entropy_attn
