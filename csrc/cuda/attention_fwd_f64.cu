// The CUDA attention forward for double inputs: one translation unit per input type keeps each
// compile short and lets a build compile them in parallel.
#include "attention_fwd_launch.cuh"

namespace entropy_attn::cuda {
template size_t attention_forward_smem_bytes<double>(int64_t);
template cudaError_t launch_attention_forward<double>(const FwdParams<AccType<double>>&, cudaStream_t);
}  // namespace entropy_attn::cuda
