// Host entry point of the Hopper family (sm_90a only, bf16/fp16, head dims 64 and 128, and 256
// compiled on request and off by default: family.h, kHopperHeadDim256ByDefault,
// kHopperBackwardHeadDim256ByDefault;
// FlashAttention-3's structure: TMA, mbarriers, wgmma, warp specialization; written with CuTe).
// Declared here without CuTe so that host code includes it; each instantiation is defined in a
// generated translation unit under instantiations/, compiled for -gencode
// arch=compute_90a,code=sm_90a alone. kMask is the mask kind (MaskKind) as a compile-time flag.
//
// Status: passes the CUDA tests on an H100 (ENTROPY_ATTN_CUDA_FAMILY=sm90), and "auto" selects it
// on compute capability 9.0 (family.h: kHopperFamilyByDefault). Its kernels also run on the CPU
// with emulated sm_90a instructions (tests/cpp/test_sm90_emulation*.cpp; sm90/ops.cuh). Every
// instantiation compiles cleanly (warnings as errors, ptxas included) for sm_90a with HGMMA,
// UTMALDG and mbarrier (SYNCS) instructions, setmaxnreg and no local memory. The forward implements
// what the sm80 forward does: bf16 and fp16, head_dim == v_head_dim == kHeadDim, top-left
// causality, no / bool / additive masks, with or without statistics, GQA, any sequence lengths; the
// backward the same calls with the entropy and sum p^2 gradients, dq by fp32 atomics: pairs from
// the registers, or, with a bulk_dq_accum layout, whole tiles by bulk reductions from shared memory
// (FlashAttention-3's way; the calls without a mask at head dims 64 and 128, since it passed the
// CUDA tests on an H200: family.h, kHopperBulkDqByDefault), under deterministic algorithms in the
// key blocks' order (bwd_kernel.cuh: dq_turns; off by default, family.h:
// kHopperDeterministicByDefault). Both directions also take sliding windows, bottom-right alignment
// and packed documents (their causal instantiations read the call's KeyPattern), logit softcapping
// and dropout (the backward of either not with a mask) and attention sinks, which "auto" gives them
// since they passed the CUDA tests on an H200 (family.h: kHopperFeaturesByDefault).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../params.h"

namespace entropy_attn::cuda::sm90 {

// Whether TMA can describe a (B, heads, L, D) view: a 16-byte aligned base and outer strides that
// are positive multiples of 16 bytes (8 elements) where the dimension has more than one entry.
// The selection point (csrc/cuda/family.cpp) and the launches both ask.
inline bool tma_compatible(const View4& v, int64_t len, int64_t heads, int64_t batch) {
  const auto ok = [](int64_t stride, int64_t extent) {
    return extent == 1 || (stride > 0 && stride % 8 == 0);
  };
  return reinterpret_cast<uintptr_t>(v.data) % 16 == 0 && ok(v.sl, len) && ok(v.sh, heads) &&
         ok(v.sb, batch);
}

// The view's strides with those of single-entry dimensions replaced by the packed ones: they
// never move a coordinate, but TMA checks every stride's alignment.
inline View4 tma_strides(View4 v, int64_t len, int64_t heads, int64_t head_dim) {
  if (len == 1) v.sl = head_dim;
  if (heads == 1) v.sh = len * v.sl;
  return v;
}

// cudaSuccess on a compute capability 9.0 device (the one that runs sm_90a code),
// cudaErrorNotSupported on another, or the error of asking.
inline cudaError_t device_is_sm90() {
  int device = 0, major = 0, minor = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  }
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  }
  if (err != cudaSuccess) return err;
  return major == 9 && minor == 0 ? cudaSuccess : cudaErrorNotSupported;
}

// Whether a call needs the general instantiations (those compiled with causality): a pattern that
// restricts a row's keys (causality, windows, either alignment, packed documents:
// key_ranges.cuh), softcap, sinks or dropout; the others run plain full attention only, with none
// of that code. The selection point (csrc/cuda/family.cpp) picks by the same rule; which calls get
// here at all is its choice too (family.h, kHopperFeaturesByDefault).
inline bool needs_general(const AttentionArgs<float>& p) {
  return p.pattern.banded() || p.pattern.cu_q != nullptr || p.softcap.on() || p.sinks != nullptr ||
         p.dropout.on();
}

// The Hopper backward's dq_accum for bulk reductions (params.h: DqAccumLayout): rows rounded up to
// whole query blocks of kBulkDqRows, each padded by kBulkDqPad floats. A block's G tile sits in
// shared memory in that layout, so that one cp.reduce.async.bulk adds the whole tile (contiguous
// in both) into dq_accum; the pad of 8 floats (32 bytes) puts the 8-byte stores of a warp's
// accumulator pairs, 4 rows by 4 pairs per half warp, in distinct banks (bwd_kernel.cuh).
constexpr int64_t kBulkDqRows = 64;  // the backward's query block (bwd_kernel.cuh: kBlockM)
constexpr int64_t kBulkDqPad = 8;
inline DqAccumLayout bulk_dq_accum(int64_t q_len, int64_t head_dim) {
  return {(q_len + kBulkDqRows - 1) / kBulkDqRows * kBulkDqRows, head_dim + kBulkDqPad, true};
}
// Whether that tile fits in shared memory beside the backward's operand tiles: not at head dim 256
// (bwd_kernel.cuh, BwdTraits), whose backward adds G by atomics.
constexpr bool bulk_dq_fits(int64_t head_dim) { return head_dim <= 128; }

// The deterministic backward's turn counters (params.h: dq_turns): one per (batch, head, query
// block of kBulkDqRows rows of dq_accum's layout, packed or not), the query blocks of a (batch,
// head) contiguous. The host allocates them, the preprocess starts them and the main kernels take
// turns at them (bwd_kernel.cuh: turn_counter).
EA_HOST_DEVICE int64_t turn_blocks(int64_t dq_rows) {
  return (dq_rows + kBulkDqRows - 1) / kBulkDqRows;
}

// Whether a backward's dq_accum is laid out as the Hopper kernels write it: packed for pairs of
// atomics, bulk_dq_accum for bulk reductions.
inline bool dq_layout_ok(const BwdParams<float>& p) {
  const DqAccumLayout want =
      p.dq_layout.bulk ? bulk_dq_accum(p.q_len, p.head_dim) : packed_dq_accum(p.q_len, p.head_dim);
  return p.dq_layout.rows == want.rows && p.dq_layout.ld == want.ld;
}

// Whether the kernels cover a call's pattern and layout, given the instantiation's head dim and
// causality: the call as above (a general one also plain full attention, which the selection
// point gives it where kernels.toml lists no plain instantiation), GQA groups of equal size, and
// q, k, v (and, in the backward, dout) that TMA can describe. (The backward needs nothing for a
// sink: lse and the statistics it reads include it.)
inline bool covers(const AttentionArgs<float>& p, int64_t head_dim, bool causal) {
  return p.head_dim == head_dim && p.v_head_dim == head_dim && p.kv_len >= 1 &&
         p.heads % p.kv_heads == 0 && (causal || !needs_general(p)) &&
         tma_compatible(p.q, p.q_len, p.heads, p.batch) &&
         tma_compatible(p.k, p.kv_len, p.kv_heads, p.batch) &&
         tma_compatible(p.v, p.kv_len, p.kv_heads, p.batch);
}
// The backward also needs dq_turns under deterministic algorithms (dq's partial sums, by atomics
// or by bulk reductions, which the masked kernels and head dim 256 lack, added in the key blocks'
// order: bwd_kernel.cuh), a dq_accum laid out for the way it is added, dout that TMA can describe,
// no softcap or dropout with a mask (bwd_kernel.cuh: the cap's derivative is formed from the capped
// logit, which an additive mask shifts; the masked kernels have no registers for the cap's
// derivative or for dropout), and an additive mask's gradient (d_logits) only without the
// statistics' gradients (bwd_kernel.cuh: kLogitGrads; the sm80 family's backward writes it beside
// them).
inline bool backward_covers(const BwdParams<float>& p, int64_t head_dim, bool causal) {
  const bool logit_grads_ok =
      p.d_logits.data == nullptr ||
      (p.mask.kind == MaskKind::kAdditive && p.g_entropy == nullptr && p.g_sum_p2 == nullptr);
  const bool dq_order_ok = p.dq_turns != nullptr || !p.deterministic;
  return covers(p, head_dim, causal) && dq_order_ok && dq_layout_ok(p) && logit_grads_ok &&
         !(p.dq_layout.bulk && (p.mask.kind != MaskKind::kNone || !bulk_dq_fits(head_dim))) &&
         !((p.softcap.on() || p.dropout.on()) && p.mask.kind != MaskKind::kNone) &&
         tma_compatible(p.dout, p.q_len, p.heads, p.batch);
}

// Forward: out and lse always, row_scale, length_factor and n_keys always; with kStats also
// entropy, sum_p2, max_weight and the derived statistics. Returns cudaErrorNotSupported, having
// launched nothing, on a device other than compute capability 9.0 or for a call covers() rejects.
template <typename T, int kHeadDim, bool kCausal, MaskKind kMask, bool kStats>
cudaError_t launch_forward(const FwdParams<float>& p, cudaStream_t stream);

// Backward: delta, dq_accum (G, or lambda G with g_scaled), then dq_out, dk_out, dv_out and
// d_row_scale (where not null), as the sm80 family writes them (params.h). Returns
// cudaErrorNotSupported, having launched nothing, on a device other than compute capability 9.0 or
// for a call backward_covers() rejects.
template <typename T, int kHeadDim, bool kCausal, MaskKind kMask>
cudaError_t launch_backward(const BwdParams<float>& p, cudaStream_t stream);

}  // namespace entropy_attn::cuda::sm90
