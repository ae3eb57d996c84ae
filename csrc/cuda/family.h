// The selection point of the CUDA attention kernels: which family runs a call, and its launch.
//
// Families live side by side in their own folders (fallback/, sm80/), each instantiated as
// csrc/cuda/kernels.toml lists. A call goes to the tensor-core family when the GPU, dtype, head
// dim, layout and flags are ones it has an instantiation for, else to the fallback. The
// environment variable ENTROPY_ATTN_CUDA_FAMILY (read at each call) forces the choice for tests and
// benchmarks:
//   "auto" (or unset)  the default choice;
//   "fallback"         the fallback for every call;
//   "sm80"             the tensor-core family wherever it applies (the fallback elsewhere).
// The tensor-core family has not yet passed the CUDA tests on a GPU, so "auto" keeps it off
// (kTensorCoreFamilyByDefault) until it has.
#pragma once

#include <cuda_runtime_api.h>

#include <optional>
#include <string>

#include "attention_host.h"

namespace entropy_attn::cuda {

// Whether "auto" picks the tensor-core family where it applies. Off until the family has passed
// the CUDA tests on a GPU.
constexpr bool kTensorCoreFamilyByDefault = false;

// The family's name in ENTROPY_ATTN_CUDA_FAMILY.
const char* family_name(Family f);

// The family ENTROPY_ATTN_CUDA_FAMILY asks for: kFallback, kSm80, or none for "auto" / unset.
// Raises ValueError for another value.
std::optional<Family> requested_family();

// The family that runs the forward of `call` (its tensors already on the current device), and why
// the tensor-core family does not, when it does not (empty when it does).
struct Selection {
  Family family = Family::kFallback;
  std::string reason;  // why not the tensor-core family
};
Selection select_forward(const ForwardCall& call);
Selection select_backward(const BackwardCall& call);

// Dynamic shared memory per block the chosen fallback kernel needs (0 for the tensor-core family,
// which checks its own).
size_t forward_smem_bytes(const ForwardCall& call, Family f);
size_t backward_smem_bytes(const BackwardCall& call, Family f);

// Launch the forward / backward of `call` with family `f` on `stream`.
cudaError_t launch_forward(const ForwardCall& call, Family f, cudaStream_t stream);
cudaError_t launch_backward(const BackwardCall& call, Family f, cudaStream_t stream);

}  // namespace entropy_attn::cuda
