// The CUDA attention backward for __half inputs: one translation unit per input type keeps each
// compile short and lets a build compile them in parallel.
#include "attention_bwd_launch.cuh"

namespace entropy_attn::cuda {
template size_t attention_backward_smem_bytes<__half>(int64_t);
template cudaError_t launch_attention_backward<__half>(const BwdParams<AccType<__half>>&, cudaStream_t);
}  // namespace entropy_attn::cuda
