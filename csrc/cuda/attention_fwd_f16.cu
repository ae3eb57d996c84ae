// The CUDA attention forward for __half inputs: one translation unit per input type keeps each
// compile short and lets a build compile them in parallel.
#include "attention_fwd_launch.cuh"

namespace entropy_attn::cuda {
template size_t attention_forward_smem_bytes<__half>(int64_t);
template cudaError_t launch_attention_forward<__half>(const FwdParams<AccType<__half>>&, cudaStream_t);
}  // namespace entropy_attn::cuda
