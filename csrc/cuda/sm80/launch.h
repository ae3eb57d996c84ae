// Host entry points of the tensor-core family (sm_80 and newer, bf16/fp16, FlashAttention-2
// structure, written with CuTe). Declared here without CuTe so that host code includes them; each
// instantiation is defined in a generated translation unit under instantiations/. kMask is the
// mask kind (MaskKind) as a compile-time flag. kCausal instantiations take any KeyPattern that
// restricts a row's keys (causality, windows, either alignment, packed documents) and take softcap,
// sinks and dropout (runtime features), except softcap with an additive mask in the backward (the
// selection point, csrc/cuda/family.cpp, decides which calls come here: family.h).
#pragma once

#include <cuda_runtime_api.h>

#include "../params.h"

namespace entropy_attn::cuda::sm80 {

// Forward: out and lse always, row_scale, length_factor and n_keys always; with kStats also
// entropy, sum_p2, max_weight and the derived statistics.
template <typename T, int kHeadDim, bool kCausal, MaskKind kMask, bool kStats>
cudaError_t launch_forward(const FwdParams<float>& p, cudaStream_t stream);

// The keys per block of the backward (its traits, bwd_kernel.cuh, read this): 128, and 64 at
// D = 256, where dK and dV of 128 keys would need 256 registers per thread, and in the compact
// tiles (D = 128 on GPUs with 99 KB of shared memory per block), which also keep one dO buffer
// rather than two.
constexpr int backward_block_n(int head_dim, bool compact = false) {
  return head_dim == 256 || compact ? 64 : 128;
}
constexpr int backward_do_buffers(bool compact) { return compact ? 1 : 2; }

// Dynamic shared memory per block of the backward's main kernel and of its deterministic dq kernel
// (bwd_launch.cuh asserts these against the kernels' traits): 64-row query tiles (Q, lambda Q and
// the dO buffers in the main kernel; Q and dO in the dq kernel), key tiles of K and V, the tiles
// of P and dS (dS alone in the dq kernel) and five per-row values. At D = 128 both exceed the 99 KB
// per block of sm_86/89/120 GPUs (the compact tiles take 97 KB and 75 KB), and at D = 256 the main
// kernel's 209 KB an A100's 163 KB (an H100 offers 227 KB): the selection point passes over the
// family where none fits.
constexpr int backward_main_smem_bytes(int head_dim, bool compact = false) {
  const int n = backward_block_n(head_dim, compact);
  return ((2 + backward_do_buffers(compact)) * 64 + 2 * n) * head_dim * 2 + 2 * 64 * n * 2 +
         5 * 64 * 4;
}
constexpr int backward_dq_smem_bytes(int head_dim, bool compact = false) {
  const int n = backward_block_n(head_dim, compact);
  return (2 * 64 + 2 * n) * head_dim * 2 + 64 * n * 2 + 5 * 64 * 4;
}

// Whether launch_backward runs the compact tiles at head_dim on a device that grants a block
// smem_per_block bytes (device_limits.h): at D = 128 where the others do not fit, as
// FlashAttention-2 chooses its D = 128 backward tiles.
constexpr bool backward_compact(int head_dim, int smem_per_block) {
  return head_dim == 128 && backward_main_smem_bytes(head_dim) > smem_per_block;
}

// Backward: the delta preprocess, the main kernel over key blocks, the dq postprocess. dq_accum
// must be zero-filled (B, H, Lq, D) float32, packed (params.h: packed_dq_accum); another
// dq_layout returns cudaErrorNotSupported, having launched nothing.
template <typename T, int kHeadDim, bool kCausal, MaskKind kMask>
cudaError_t launch_backward(const BwdParams<float>& p, cudaStream_t stream);

}  // namespace entropy_attn::cuda::sm80
