// Whether this build compiled the kernels of tensor-core capabilities that are off by default
// until tested on a GPU (family.h). "auto" never selects such a capability, so a default build (a
// user's `pip install`, CI) leaves its kernels out and saves their compile time;
// ENTROPY_ATTN_UNTESTED_KERNELS=1 at build time (setup.py, CMakeLists.txt) compiles them, as
// scripts/device_bundle.sh does for a GPU session, which tests them by forcing a family
// (ENTROPY_ATTN_CUDA_FAMILY). The CPU emulation tests (tests/cpp) always compile them.
//
// Which instantiations: kernels.toml's `on_request` entries (generated dispatch lists wrap them in
// EA_UNTESTED), and launch-time variants guarded by kUntestedKernels. None at present: head dim
// 256, the sm80 backward's compact tiles and the Hopper backward's bulk dq reductions, written
// this way, left these lists when they passed the CUDA tests on an H200 (results/gpu/tests.md).
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
