// The device-independent host half of the CUDA attention ops: argument checks, the tensors the
// kernels read and write, their kernel parameters, and the ATen epilogue of the backward. Plain ATen
// (it allocates on the inputs' device), so the CUDA ops (attention_cuda.cpp) and the CPU emulation
// test of the kernels (tests/cpp/test_cuda_emulation.cpp) share it.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "../attention_inputs.h"
#include "../op_handles.h"
#include "params.h"

namespace entropy_attn::cuda {

// The limits of the CUDA kernels beyond the op's own checks (head dims, grid size).
void check_cuda_limits(const AttentionShape& s, at::ScalarType dtype);

// What the forward and attention_sparsity share: the logits s = lambda q.k + mask of a call.
struct LogitsCall {
  AttentionShape shape;
  bool causal = false;
  at::Tensor q, k, v;              // input dtype, unit last stride (v: the key for sparsity)
  std::optional<at::Tensor> mask;  // expanded to (B, H, Lq, Lk), bool or the accumulate type
  at::Tensor c;                    // expanded scale tensor, or undefined
  std::optional<double> scale_factor;
  ScaleMode mode = ScaleMode::kFixed;
  double log_base = 0, temperature = 1;

  // Checks the arguments (the op's checks and the CUDA limits) and fills every field.
  LogitsCall(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
             const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& scale,
             bool is_causal, std::optional<double> scale_factor, std::string_view scale_mode,
             double temperature, double log_base, bool enable_gqa);
  template <typename acc_t>
  void fill(AttentionArgs<acc_t>& a, ScalePolicy<acc_t>& scale) const;
};

struct ForwardCall : LogitsCall {
  using LogitsCall::LogitsCall;
  AttentionOutputs outputs;  // allocated, written by the kernel

  template <typename acc_t>
  FwdParams<acc_t> params() const;
};

ForwardCall prepare_forward(const at::Tensor& query, const at::Tensor& key,
                            const at::Tensor& value, const std::optional<at::Tensor>& attn_mask,
                            const std::optional<at::Tensor>& scale, bool is_causal,
                            std::optional<double> scale_factor, std::string_view scale_mode,
                            double temperature, double log_base, bool enable_gqa);

struct BackwardCall {
  AttentionShape shape;
  bool causal = false;
  at::ScalarType key_dtype, value_dtype, row_scale_dtype;
  at::Tensor q, k, v, out, dout;   // input dtype, unit last stride
  std::optional<at::Tensor> mask;  // as in LogitsCall
  at::Tensor lse, entropy, sum_p2, row_scale, g_lse, g_entropy, g_sum_p2;  // accumulate type
  at::Tensor delta, g, dk, dv;  // kernel outputs: D~, G = sum_j dS_ij k_j, per-query-head dK, dV

  template <typename acc_t>
  BwdParams<acc_t> params() const;
  // (grad_query, grad_key, grad_value, grad_row_scale) from the kernel outputs.
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> finish() const;
};

BackwardCall prepare_backward(
    const at::Tensor& grad_output, const std::optional<at::Tensor>& grad_lse,
    const std::optional<at::Tensor>& grad_entropy, const std::optional<at::Tensor>& grad_sum_p2,
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask, const at::Tensor& output, const at::Tensor& lse,
    const at::Tensor& entropy, const at::Tensor& sum_p2, const at::Tensor& row_scale,
    bool is_causal);

struct SparsityCall : LogitsCall {
  using LogitsCall::LogitsCall;
  SparsityKind kind = SparsityKind::kExp;
  at::Tensor out;  // (B, H, Lq) in the accumulate type, written by the kernel

  template <typename acc_t>
  SparsityParams<acc_t> params() const;
};

SparsityCall prepare_attention_sparsity(const at::Tensor& query, const at::Tensor& key,
                                        const std::optional<at::Tensor>& attn_mask,
                                        const std::optional<at::Tensor>& scale,
                                        std::string_view kind, bool is_causal,
                                        std::optional<double> scale_factor,
                                        std::string_view scale_mode, double temperature,
                                        double log_base, bool enable_gqa);

// The rows of `x` along `dim`, contiguous, with the allocated output, for the row reductions.
struct RowReductionCall {
  at::Tensor rows, out;
  RowReductionParams params() const;
};
RowReductionCall prepare_row_reduction(const at::Tensor& x, int64_t dim, const char* name);

}  // namespace entropy_attn::cuda
