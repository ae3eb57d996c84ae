// Whether this build compiled the kernels of the tensor-core capabilities that are off by default
// until tested on a GPU (family.h: head dim 256, the sm80 backward's compact tiles, the Hopper
// backward's bulk dq reductions). "auto" never selects them, so a default build (a user's
// `pip install`, CI) leaves them out and saves their compile time: about 430 of the 2,000
// compiler-seconds of the CUDA build. ENTROPY_ATTN_UNTESTED_KERNELS=1 at build time (setup.py,
// CMakeLists.txt) compiles them, as scripts/device_bundle.sh does for a GPU session, which tests
// them by forcing a family (ENTROPY_ATTN_CUDA_FAMILY); a build without them runs such calls as
// "auto" does (head dim 256 and the compact tiles' calls in the fallback, dq by atomics). The CPU
// emulation tests (tests/cpp) always compile them.
//
// Which instantiations: kernels.toml's `on_request` entries (generated dispatch lists wrap them in
// EA_UNTESTED), and the launch-time variants guarded by kUntestedKernels (sm80/bwd_launch.cuh,
// sm90/bwd_kernel.cuh). When a capability is turned on by default, its kernels leave these lists.
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
