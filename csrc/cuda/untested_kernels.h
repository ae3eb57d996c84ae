// The mechanism for kernels of tensor-core capabilities written without a GPU: kernels.toml's
// `on_request` entries (generated dispatch lists wrap them in EA_UNTESTED) and launch-time variants
// guarded by kUntestedKernels are compiled only with ENTROPY_ATTN_UNTESTED_KERNELS=1 at build time
// (setup.py, CMakeLists.txt), as scripts/device_bundle.sh builds for a GPU session, which tests
// them by forcing a family (ENTROPY_ATTN_CUDA_FAMILY); "auto" never selects them (family.h), so a
// default build (a user's `pip install`, CI) saves their compile time. The CPU emulation tests
// (tests/cpp) always compile them. On request at present: the Hopper forward and backward at head
// dim 256 (family.h: kHopperHeadDim256ByDefault, kHopperBackwardHeadDim256ByDefault). Head dim 256
// in the sm80 family, the sm80 backward's compact tiles and the Hopper backward's bulk dq
// reductions, written this way, left these lists when they passed the CUDA tests on an H200
// (results/gpu/tests.md).
#pragma once

namespace entropy_attn::cuda {

#ifdef ENTROPY_ATTN_UNTESTED_KERNELS
constexpr bool kUntestedKernels = true;
#define EA_UNTESTED(...) __VA_ARGS__
#else
constexpr bool kUntestedKernels = false;
#define EA_UNTESTED(...)
#endif

}  // namespace entropy_attn::cuda
