// Host entry points of the tensor-core family (sm_80 and newer, bf16/fp16, FlashAttention-2
// structure, written with CuTe). Declared here without CuTe so that host code includes them; each
// instantiation is defined in a generated translation unit under instantiations/. kMask is the
// mask kind (MaskKind) as a compile-time flag.
#pragma once

#include <cuda_runtime_api.h>

#include "../params.h"

namespace entropy_attn::cuda::sm80 {

// Forward: out and lse always, row_scale, length_factor and n_keys always; with kStats also
// entropy, sum_p2, max_weight and the derived statistics.
template <typename T, int kHeadDim, bool kCausal, MaskKind kMask, bool kStats>
cudaError_t launch_forward(const FwdParams<float>& p, cudaStream_t stream);

// Backward: the delta preprocess, the main kernel over key blocks, the dq postprocess. dq_accum
// must be zero-filled (B, H, Lq, D) float32.
template <typename T, int kHeadDim, bool kCausal, MaskKind kMask>
cudaError_t launch_backward(const BwdParams<float>& p, cudaStream_t stream);

}  // namespace entropy_attn::cuda::sm80
