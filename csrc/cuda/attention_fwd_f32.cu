// The CUDA attention forward for float inputs: one translation unit per input type keeps each
// compile short and lets a build compile them in parallel.
#include "attention_fwd_launch.cuh"

namespace entropy_attn::cuda {
template size_t attention_forward_smem_bytes<float>(int64_t);
template cudaError_t launch_attention_forward<float>(const FwdParams<AccType<float>>&, cudaStream_t);
}  // namespace entropy_attn::cuda
