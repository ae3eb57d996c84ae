// The selection point of the CUDA attention kernels: which family runs a call, and its launch.
//
// Families live side by side in their own folders (fallback/, sm80/, sm90/), each instantiated as
// csrc/cuda/kernels.toml lists. A call goes to the most specialized family that has an
// instantiation for its GPU, dtype, head dim, layout and flags: the Hopper family (a compute
// capability 9.0 GPU), then the tensor-core family (sm_80 and newer), then the fallback, which
// covers every call. The environment variable ENTROPY_ATTN_CUDA_FAMILY (read at each call)
// forces the choice for tests and benchmarks:
//   "auto" (or unset)  the default choice;
//   "fallback"         the fallback for every call;
//   "sm80"             the tensor-core family wherever it applies (the fallback elsewhere);
//   "sm90"             the Hopper family wherever it applies, else as "sm80".
// "auto" picks both specialized families where they apply (kTensorCoreFamilyByDefault,
// kHopperFamilyByDefault): the CUDA tests pass with each forced on an H100 (results/gpu/tests.md).
// A capability written without a GPU stays off by default, its kernels compiled on request
// (untested_kernels.h), until the CUDA tests pass on one; turning it on by default means compiling
// its kernels by default as well.
#pragma once

#include <cuda_runtime_api.h>

#include <optional>
#include <string>

#include "attention_host.h"

namespace entropy_attn::cuda {

// Whether "auto" picks the tensor-core family where it applies (sm_80 and newer).
constexpr bool kTensorCoreFamilyByDefault = true;
// Whether "auto" picks the Hopper family on compute capability 9.0.
constexpr bool kHopperFamilyByDefault = true;
// Whether "auto" gives the tensor-core family the calls with a sliding window, bottom-right
// alignment, packed documents (its causal kernels read the KeyPattern), logit softcapping,
// attention sinks or dropout, forward and backward. On since those kernels passed the CUDA tests on
// an H200 (tests/test_cuda.py: test_tensor_core_bands_match_reference and
// test_tensor_core_features_match_reference, family sm80; results/gpu/tests.md).
constexpr bool kTensorCoreFeaturesByDefault = true;
// The same for the Hopper family on compute capability 9.0 (the same tests, family sm90).
constexpr bool kHopperFeaturesByDefault = true;
// Whether "auto" has the Hopper backward add dq's partial sums G by bulk reductions of whole
// query-block tiles from shared memory (cp.reduce.async.bulk, FlashAttention-3's way) instead of
// 8-byte atomics from the registers, for the calls without a mask at head dims 64 and 128 (the
// tile does not fit at 256: sm90/bwd_kernel.cuh; its
// dq_accum is then padded: sm90/launch.h, bulk_dq_accum). On since it passed the CUDA tests on an
// H200 (every CUDA test with the family forced, and the kernel harness's checks) and took 1-12%
// less time than the atomics in the forward + backward of the harness's grid there, 7-12% at
// D = 128 (results/gpu/tests.md).
constexpr bool kHopperBulkDqByDefault = true;
bool hopper_bulk_dq(const AttentionBackwardCall& call);

// Whether "auto" gives the Hopper family the backward under
// torch.use_deterministic_algorithms(True) (its dq summed by bulk reductions in the key blocks'
// order, FlashAttention-3's way: sm90/bwd_kernel.cuh, dq_turns; the atomics of the masked kernels
// and of head dim 256 take the same turns). Off until it passes the CUDA tests on a GPU: it passes
// the CPU emulation (tests/cpp/test_sm90_emulation*.cpp: DeterministicDq); meanwhile the sm80
// family's deterministic dq kernel runs such calls on compute capability 9.0.
constexpr bool kHopperDeterministicByDefault = false;

// Whether "auto" gives the Hopper family the backward of a call that asks for its additive mask's
// gradient (a learned bias: T5's position bias) without the statistics' gradients
// (sm90/bwd_kernel.cuh: kLogitGrads). Off until it passes the CUDA tests on a GPU: it passes the
// CPU emulation (tests/cpp/test_sm90_emulation.cpp: AdditiveMaskGradient); meanwhile the sm80
// family's backward runs such calls on compute capability 9.0 too.
constexpr bool kHopperMaskGradByDefault = false;

// Whether "auto" gives the tensor-core family (sm80) the calls at head dim 256, forward and
// backward (the backward where the GPU offers its 209 KB of shared memory per block: an H100, not
// an A100). On since they passed the CUDA tests on an H200 (tests/test_cuda.py:
// test_head_dim_256_matches_reference), where they took 1/23-1/25 of the fallback's forward time
// and 1/14 of its forward + backward (results/gpu/head_dims.md).
constexpr bool kTensorCoreHeadDim256ByDefault = true;

// Whether "auto" gives the Hopper family the forward at head dim 256 on compute capability 9.0
// (sm90/fwd_kernel.cuh: 64-key blocks, 48 with a mask). Off until it passes the CUDA tests on a
// GPU, its kernels compiled on request (kernels.toml); it passes the CPU emulation
// (tests/cpp/test_sm90_emulation.cpp: EmulatedSm90Forward.HeadDim256 and HeadDim256Masked).
constexpr bool kHopperHeadDim256ByDefault = false;
// The same for the backward at head dim 256, any mask kind (sm90/bwd_kernel.cuh: 64-key blocks,
// the warpgroups splitting dK and dV along D, G by atomics), which passes the CPU emulation
// (EmulatedSm90Backward.HeadDim256 and HeadDim256Masked); meanwhile the sm80 family's backward runs
// those calls.
constexpr bool kHopperBackwardHeadDim256ByDefault = false;

// Whether "auto" gives the tensor-core family the backward at head dim 128 on GPUs that offer a
// block less shared memory than its full tiles need (161 KB: sm_86, sm_89 and sm_120 offer 99 KB,
// as ENTROPY_ATTN_CUDA_SMEM_PER_BLOCK=101376 makes any GPU do), where its launcher takes the
// compact tiles (64 x 64, one dO buffer: 97 KB; sm80/launch.h: backward_compact). On since they
// passed the CUDA tests on an H200 with its shared memory per block capped at 99 KB
// (tests/test_cuda.py: test_compact_backward_matches_reference; the kernel harness's checks); not
// timed on such a GPU yet.
constexpr bool kTensorCoreCompactBackwardByDefault = true;

// Whether "auto" runs the calls whose head dims the tensor-core families do not compile (80, 96,
// head_dim != v_head_dim, ...) in them with the inputs zero-padded to the next compiled head dim
// (csrc/head_dim_padding.h), forward and backward. On since they passed the CUDA tests on an H200
// (tests/test_cuda.py: test_padded_head_dims_match_reference), where head dim 96 in the sm80
// family took 1/17-1/21 of the fallback's forward time and 1/11-1/12 of its forward + backward
// (results/gpu/head_dims.md; the Hopper family, which runs it there, was not timed).
constexpr bool kTensorCorePaddedHeadDimsByDefault = true;

// The head dim (64, 128 or 256) at which the tensor-core families would run a call of this shape
// and dtype with zero-padded inputs, or 0: padding is off, the dtype is not bfloat16 or float16, or
// the head dims need none or exceed 256. The selection point then decides on the padded call.
int64_t tensor_core_padded_head_dim(const AttentionShape& shape, at::ScalarType dtype);

// Whether "auto" splits the keys of a forward whose query tiles are too few to fill the GPU
// (decoding: a few query rows against a long cache) into parts run by separate thread blocks and
// combined (split-KV, the sm80 family: sm80/split_kv.cuh; such calls leave sm90 for it). On since
// it passed the CUDA tests on an H200 (tests/test_cuda.py: test_split_kv_matches_reference).
// ENTROPY_ATTN_SPLIT_KV (read at each call) overrides it: "auto" (FlashAttention-2's rule,
// split_kv.h), "off", or a count of parts from 1 to 128 (forced, for tests and benchmarks).
constexpr bool kSplitKvByDefault = true;

// The number of parts the sm80 forward cuts each query tile's keys into for `call` (1: not split).
// Raises ValueError for a bad ENTROPY_ATTN_SPLIT_KV.
int forward_splits(const ForwardCall& call);

// The tensor-core kernels' launch order (launch_order.h) for a call: the number of sections of the
// grid's (head, batch) entries within which every entry's heaviest tile starts before any entry's
// second; 0 keeps the grid's own order (each head's tiles in a row). "auto" orders causal calls so
// (one document per batch entry, keys bounded on the right: the tiles' work grows with the query
// tile and shrinks with the key block), in sections whose reused operands fit in 5/8 of L2 and
// whose tiles fill the GPU (`blocks_per_sm` of the kernel run on each SM; `splits`: the sm80
// forward's split-KV parts, 1 otherwise); the other calls' tiles are alike, and keep the grid's
// order. With split-KV the grid's x is split-major, so the order walks each part's tiles, heaviest
// first, before the next part's. Computed, not yet timed on a GPU
// (results/gpu/launch_order_model.md: the model it follows).
// ENTROPY_ATTN_CUDA_LAUNCH_ORDER (read at each call) overrides it: "auto", "heads" (the grid's
// order) or a number of sections of at least 1 for every call the general (causal) instantiations
// without a mask run (forced, for tests and benchmarks; the other kernels keep the grid's order:
// launch_order.h, this_block_tile).
// Raises ValueError for another value.
int launch_order_sections(const AttentionShape& shape, const KeyPattern& pattern,
                          int64_t element_size, bool backward, int blocks_per_sm, int splits);

// Whether the Hopper forward runs on a persistent grid when ENTROPY_ATTN_CUDA_PERSISTENT is unset:
// one thread block per SM, each walking several tiles, whose producer loads the next tile's
// operands while the consumers finish the tile before (sm90/fwd_kernel.cuh), instead of one block
// per tile. Off until it is timed on a GPU: it passes the CPU emulation of the family
// (tests/cpp/test_sm90_emulation.cpp: PersistentGrid).
constexpr bool kHopperPersistentByDefault = false;

// The blocks of the Hopper forward's grid (params.h: persistent_blocks): 0, one per tile; else
// the persistent grid's, the GPU's SM count. ENTROPY_ATTN_CUDA_PERSISTENT (read at each call)
// overrides the default: "on", "off", or a number of blocks of at least 1 (forced, for tests and
// benchmarks). Raises ValueError for another value.
int hopper_persistent_blocks();

// The family's name in ENTROPY_ATTN_CUDA_FAMILY.
const char* family_name(Family f);

// The family ENTROPY_ATTN_CUDA_FAMILY asks for: kFallback, kSm80, kSm90, or none for "auto" /
// unset. Raises ValueError for another value.
std::optional<Family> requested_family();

// The family that runs the forward of `call` (its tensors already on the current device), and why
// a more specialized family that was wanted does not (empty when none was passed over).
struct Selection {
  Family family = Family::kFallback;
  std::string reason;  // e.g. "sm90: dtype is not bfloat16 or float16"
};
Selection select_forward(const ForwardCall& call);
Selection select_backward(const BackwardCall& call);

// The current device's compute capability (major * 10 + minor), and the dynamic shared memory one
// of its blocks may have (opted in; under ENTROPY_ATTN_CUDA_SMEM_PER_BLOCK: device_limits.h).
int device_sm();
int device_smem_optin();

// Dynamic shared memory per block of the fallback kernel for a call (the tensor-core families check
// their own). Every call needs the fallback's: after a tensor-core kernel it runs as the guard
// against hidden non-finite inputs (launch_forward, launch_backward).
size_t forward_smem_bytes(const ForwardCall& call);
size_t backward_smem_bytes(const BackwardCall& call);

// Launch the forward / backward of `call` with family `f` on `stream`. A tensor-core forward is
// followed by the fallback forward as its guard: it recomputes the call where a row came out
// non-finite, which a hidden key's NaN value causes in block products (docs/math.md section 8);
// a tensor-core backward likewise by the fallback backward.
cudaError_t launch_forward(const ForwardCall& call, Family f, cudaStream_t stream);
cudaError_t launch_backward(const BackwardCall& call, Family f, cudaStream_t stream);

}  // namespace entropy_attn::cuda
