// The CUDA attention forward for __nv_bfloat16 inputs: one translation unit per input type keeps each
// compile short and lets a build compile them in parallel.
#include "attention_fwd_launch.cuh"

namespace entropy_attn::cuda {
template size_t attention_forward_smem_bytes<__nv_bfloat16>(int64_t);
template cudaError_t launch_attention_forward<__nv_bfloat16>(const FwdParams<AccType<__nv_bfloat16>>&, cudaStream_t);
}  // namespace entropy_attn::cuda
