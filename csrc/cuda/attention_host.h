// The device-independent host half of the CUDA attention ops: argument checks, the tensors the
// kernels read and write, their kernel parameters, and the ATen epilogue of the backward. Plain
// ATen (it allocates on the inputs' device), so the CUDA ops (attention_cuda.cpp) and the CPU
// emulation test of the kernels (tests/cpp/test_cuda_emulation.cpp) share it.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "../attention_call.h"
#include "params.h"

namespace entropy_attn::cuda {

// The kernel families (csrc/cuda/family.h chooses one per call).
enum class Family { kFallback, kSm80, kSm90 };

// The limits of the CUDA kernels beyond the op's own checks (head dims, grid size).
void check_cuda_limits(const AttentionShape& s, at::ScalarType dtype);

// The CUDA view of a checked call: query, key and value in the input dtype with a unit last
// stride (the key stands in for the value in attention_sparsity).
struct LogitsInputs {
  AttentionCall call;
  at::Tensor q, k, v;

  LogitsInputs(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
               const AttentionCall& call);  // also checks the CUDA limits
  template <typename acc_t>
  void fill(AttentionArgs<acc_t>& a, ScalePolicy<acc_t>& scale) const;
};

struct ForwardCall : LogitsInputs {
  AttentionOutputs outputs;  // allocated, written by the kernel

  ForwardCall(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
              const AttentionCall& call);
  template <typename acc_t>
  FwdParams<acc_t> params() const;
};

struct BackwardCall {
  AttentionBackwardCall call;
  at::Tensor q, k, v, out, dout;  // input dtype, unit last stride
  // As given: each gradient comes out in its input's layout.
  at::Tensor given_query, given_key, given_value;
  // Kernel outputs, allocated by allocate() for the family that runs: D~ and G = sum_j dS_ij k_j
  // (accumulate type) for both; the fallback's dK, dV per query head (accumulate type), or the
  // tensor-core family's dq, dk, dv (input type, dk and dv per key/value head, each in its input's
  // layout: attention_call.h, empty_in_layout_of) and d lambda (where the call asks for it).
  Family family = Family::kFallback;
  at::Tensor delta, g, dk, dv, dq, dlam;
  DqAccumLayout dq_layout;  // g's (params.h), which the tensor-core families read
  // A deterministic backward's turn counters (params.h): the Hopper family's, and the fallback's
  // (a plain call's, or a tensor-core call's for its guard); else undefined.
  at::Tensor dq_turns, tile_turns;

  BackwardCall(const at::Tensor& grad_output, const at::Tensor& query, const at::Tensor& key,
               const at::Tensor& value, const at::Tensor& output,
               const AttentionBackwardCall& call);
  void allocate(Family f);
  template <typename acc_t>
  BwdParams<acc_t> params() const;
  // (grad_query, grad_key, grad_value, grad_row_scale) from the kernel outputs.
  AttentionGrads finish() const;
};

struct SparsityCall : LogitsInputs {
  SparsityKind kind = SparsityKind::kExp;
  at::Tensor out;  // (B, H, Lq) in the accumulate type, written by the kernel

  SparsityCall(const at::Tensor& query, const at::Tensor& key, SparsityKind kind,
               const AttentionCall& call);
  template <typename acc_t>
  SparsityParams<acc_t> params() const;
};

// A broadcast additive mask's gradient under deterministic algorithms (attention_cuda.cpp): the
// kernels add the logits that share a mask entry by atomics in an unspecified order
// (logit_grads.cuh), so such a call gets its gradient at the call's full (B, H, Lq, Lk) shape, each
// entry from one logit, and sums it over the mask's broadcast dims in a fixed order.
// use_full_mask_grad: replaces call.grad_logits by a zero-filled accumulator of that shape and
// returns the mask-shaped one it replaced; undefined, the call unchanged, where the call asks for
// no mask gradient or its mask does not broadcast. sum_full_mask_grad: writes call.grad_logits
// summed over those dims (at::sum_to_size) into that mask-shaped accumulator.
at::Tensor use_full_mask_grad(AttentionBackwardCall& call);
void sum_full_mask_grad(const AttentionBackwardCall& call, const at::Tensor& mask_grad);

// The rows of `x` along `dim`, contiguous, with the allocated output, for the row reductions.
struct RowReductionCall {
  at::Tensor rows, out;
  RowReductionParams params() const;
};
RowReductionCall prepare_row_reduction(const at::Tensor& x, int64_t dim, const char* name);

}  // namespace entropy_attn::cuda
