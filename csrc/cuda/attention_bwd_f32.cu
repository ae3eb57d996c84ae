// The CUDA attention backward for float inputs: one translation unit per input type keeps each
// compile short and lets a build compile them in parallel.
#include "attention_bwd_launch.cuh"

namespace entropy_attn::cuda {
template size_t attention_backward_smem_bytes<float>(int64_t);
template cudaError_t launch_attention_backward<float>(const BwdParams<AccType<float>>&, cudaStream_t);
}  // namespace entropy_attn::cuda
