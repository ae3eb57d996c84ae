// Host entry point of the Hopper family (sm_90a only, bf16/fp16, head dims 64 and 128;
// FlashAttention-3's structure: TMA, mbarriers, wgmma, warp specialization; written with CuTe).
// Declared here without CuTe so that host code includes it; each instantiation is defined in a
// generated translation unit under instantiations/, compiled for -gencode
// arch=compute_90a,code=sm_90a alone. kMask is the mask kind (MaskKind) as a compile-time flag.
//
// Status: written and compiled, never run on a GPU. Every instantiation compiles cleanly (warnings
// as errors, ptxas included) for sm_90a with HGMMA, UTMALDG and mbarrier (SYNCS) instructions,
// setmaxnreg and no local memory. It implements what the sm80 forward does: bf16 and fp16,
// head_dim == v_head_dim == kHeadDim, top-left causality, no / bool / additive masks, with or
// without statistics, GQA, any sequence lengths. Windows, packed documents, softcap, sinks and
// dropout are not covered (the selection point, csrc/cuda/family.cpp, routes such calls to the
// other families), nor is the backward. ENTROPY_ATTN_CUDA_FAMILY=sm90 selects it; "auto" does not
// until it has passed the CUDA tests on an H100 (family.h: kHopperFamilyByDefault).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../params.h"

namespace entropy_attn::cuda::sm90 {

// Whether TMA can describe a (B, heads, L, D) view: a 16-byte aligned base and outer strides that
// are positive multiples of 16 bytes (8 elements) where the dimension has more than one entry.
// The selection point (csrc/cuda/family.cpp) and launch_forward both ask.
inline bool tma_compatible(const View4& v, int64_t len, int64_t heads, int64_t batch) {
  const auto ok = [](int64_t stride, int64_t extent) {
    return extent == 1 || (stride > 0 && stride % 8 == 0);
  };
  return reinterpret_cast<uintptr_t>(v.data) % 16 == 0 && ok(v.sl, len) && ok(v.sh, heads) &&
         ok(v.sb, batch);
}

// Forward: out and lse always, row_scale, length_factor and n_keys always; with kStats also
// entropy, sum_p2, max_weight and the derived statistics. Returns cudaErrorNotSupported, having
// launched nothing, for a call the kernel does not cover: a device other than compute capability
// 9.0, head dims other than kHeadDim, a feature of the list above, or inputs that TMA cannot
// describe (bases not 16-byte aligned, row / head / batch strides not multiples of 16 bytes).
template <typename T, int kHeadDim, bool kCausal, MaskKind kMask, bool kStats>
cudaError_t launch_forward(const FwdParams<float>& p, cudaStream_t stream);

}  // namespace entropy_attn::cuda::sm90
