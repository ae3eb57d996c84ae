// launch_backward of the tensor-core family (declared in launch.h): the delta preprocess, the
// deterministic dq kernel when asked for, the main kernel over key blocks, the dq / d lambda
// postprocess, all on one stream, with the tiles launch.h's backward_compact picks for the device.
// A generated translation unit under instantiations/ includes this file and instantiates one (T,
// head dim, causal, mask kind).
#pragma once

#include <cuda_runtime_api.h>

#include "../device_limits.h"
#include "../params.h"
#include "bwd_kernel.cuh"
#include "launch.h"

namespace entropy_attn::cuda::sm80 {

namespace bwd {

// Grids: x the blocks of a sequence (up to 2^31 - 1), y the heads, z the batch (up to 65535 each).
inline dim3 row_grid(int64_t q_len, int rows_per_block, int64_t heads, int64_t batch) {
  return dim3(static_cast<unsigned>((q_len + rows_per_block - 1) / rows_per_block),
              static_cast<unsigned>(heads), static_cast<unsigned>(batch));
}

template <typename Kernel>
cudaError_t set_smem(Kernel kernel, int bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

// The kernels with tiles Kt. The preprocess and the postprocess depend on the head dim alone:
// they are the full tiles' (Rows) in either case.
template <typename Kt, typename Rows, bool kCausal, MaskKind kMask>
cudaError_t launch_tiles(const BwdParams<float>& p, cudaStream_t stream) {
  static_assert(Kt::kMainBytes == backward_main_smem_bytes(Kt::kHeadDim, Kt::kCompact) &&
                    Kt::kDqBytes == backward_dq_smem_bytes(Kt::kHeadDim, Kt::kCompact),
                "launch.h's shared-memory sizes, which the selection point reads, are the traits'");
  static_assert(Rows::kNThreads == Kt::kNThreads);
  const dim3 block(Kt::kNThreads);

  preprocess_kernel<Rows>
      <<<row_grid(p.q_len, Rows::kPreRows, p.heads, p.batch), block, 0, stream>>>(p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;

  if (p.deterministic) {  // G without atomics, before the main kernel (which then skips it)
    auto kernel = &dq_kernel<Kt, kCausal, kMask>;
    err = set_smem(kernel, Kt::kDqBytes);
    if (err != cudaSuccess) return err;
    kernel<<<row_grid(p.q_len, Kt::kBlockM, p.heads, p.batch), block, Kt::kDqBytes, stream>>>(p);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }

  {
    auto kernel = &main_kernel<Kt, kCausal, kMask>;
    err = set_smem(kernel, Kt::kMainBytes);
    if (err != cudaSuccess) return err;
    kernel<<<row_grid(p.kv_len, Kt::kBlockN, p.kv_heads, p.batch), block, Kt::kMainBytes, stream>>>(
        p);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }

  postprocess_kernel<Rows>
      <<<row_grid(p.q_len, Rows::kPostRows, p.heads, p.batch), block, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace bwd

template <typename T, int kHeadDim, bool kCausal, MaskKind kMask>
cudaError_t launch_backward(const BwdParams<float>& p, cudaStream_t stream) {
  using Full = bwd::BwdTraits<T, kHeadDim>;
  // (The main and dq kernels write dq_accum packed: launch.h.)
  const DqAccumLayout packed = packed_dq_accum(p.q_len, p.head_dim);
  if (p.dq_layout.bulk || p.dq_layout.rows != packed.rows || p.dq_layout.ld != packed.ld) {
    return cudaErrorNotSupported;
  }
  if (p.batch <= 0 || p.heads <= 0 || p.q_len <= 0 || p.kv_len <= 0) return cudaSuccess;
  if constexpr (kHeadDim == 128) {
    cudaError_t err = cudaSuccess;
    const int smem = smem_per_block(err);
    if (err != cudaSuccess) return err;
    if (backward_compact(kHeadDim, smem)) {
      using Compact = bwd::BwdTraits<T, kHeadDim, true>;
      return bwd::launch_tiles<Compact, Full, kCausal, kMask>(p, stream);
    }
  }
  return bwd::launch_tiles<Full, Full, kCausal, kMask>(p, stream);
}

}  // namespace entropy_attn::cuda::sm80
