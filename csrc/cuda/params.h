// Kernel parameters of the CUDA ops: plain structs (pointers, sizes, strides) filled by the host
// code (attention_cuda.cpp) and passed by value to the kernels, in the manner of flash-attention's
// Flash_fwd_params. No ATen here: the .cu files include only CUDA headers and the project's own.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "../dropout.h"
#include "../kernel_args.h"

namespace entropy_attn::cuda {

// The accumulate type of an input type: double for double, float otherwise (as on the CPU).
template <typename T>
using AccType = std::conditional_t<std::is_same_v<T, double>, double, float>;

// A (B, heads, L, dim) tensor with a unit last stride: a pointer and its three outer strides.
template <typename Pointer>
struct BasicView4 {
  Pointer data = nullptr;
  int64_t sb = 0, sh = 0, sl = 0;
  // The offset, in elements, of row l of (b, h).
  EA_HOST_DEVICE int64_t offset(int64_t b, int64_t h, int64_t l) const {
    return b * sb + h * sh + l * sl;
  }
};
using View4 = BasicView4<const void*>;  // an input
using OutView4 = BasicView4<void*>;     // an output

// What the forward and the backward both read: the inputs and the attention pattern.
template <typename acc_t>
struct AttentionArgs {
  View4 q, k, v;
  int64_t batch = 0, heads = 0, kv_heads = 0, q_len = 0, kv_len = 0, head_dim = 0, v_head_dim = 0;
  MaskArg<acc_t> mask;
  KeyPattern pattern;  // the keys each row may see: causality, window, alignment, documents
  Softcap<acc_t> softcap;
  // The forward and backward only (attention_sparsity has neither): the per-head sink logits
  // (H,), or null, and the dropout of the weights that multiply V.
  const acc_t* sinks = nullptr;
  Dropout<acc_t> dropout;
  // The tensor-core families' guard against a hidden non-finite input (docs/math.md section 8):
  // their block products multiply a weight of 0 by a masked key's or value's NaN, so their kernels
  // set *nonfinite = 1 when a row they write holds a non-finite value, and the fallback kernels,
  // launched after them with the same pointer, then recompute the call by the rule that hidden
  // keys never enter a row, and return at once where it is 0. Null: a plain fallback call.
  int* nonfinite = nullptr;
  // The tensor-core kernels' launch order (launch_order.h): their blocks take the tiles in this
  // many sections of the grid's (head, batch) entries, every entry's heaviest tile first; 0: the
  // grid's own order.
  int launch_sections = 0;
};

template <typename acc_t>
struct FwdParams : AttentionArgs<acc_t> {
  ScalePolicy<acc_t> scale;
  // Outputs: out (B, H, Lq, Dv) in the input type, strided as the host allocated it (in the query's
  // layout: attention_call.cpp, allocate_attention_outputs), rows 16-byte aligned for the
  // tensor-core families; the rest (B, H, Lq), contiguous.
  OutView4 out;
  acc_t *lse = nullptr, *entropy = nullptr, *sum_p2 = nullptr, *max_weight = nullptr;
  acc_t *row_scale = nullptr, *length_factor = nullptr;
  int64_t* n_keys = nullptr;
  // The statistics that follow from entropy, sum_p2 and n_i (online_stats.h: derive), written by
  // the epilogue. A forward without statistics (lse, row_scale, length_factor and n_keys only)
  // leaves entropy, sum_p2, max_weight and these null.
  acc_t *normalized_entropy = nullptr, *sparsity = nullptr, *effective_keys = nullptr;
  // Split-KV (the sm80 family's general instantiations; family.cpp: forward_splits): with
  // num_splits > 1 each query tile's key blocks are cut into num_splits contiguous parts, one
  // thread block each, which write their rows' unnormalized output to o_partial (num_splits, B, H,
  // Lq, Dv) and their online state (m in log2 units, l, t, u) to state_partial (num_splits, B, H,
  // Lq, 4), both float32; a combine kernel merges them (online_stats.h: merge) into the outputs
  // above.
  int num_splits = 1;
  float *o_partial = nullptr, *state_partial = nullptr;
  // The Hopper forward's grid (sm90/fwd_kernel.cuh): 0, one thread block per query tile; n >= 1, a
  // persistent grid of at most n blocks (one per SM: family.cpp, ENTROPY_ATTN_CUDA_PERSISTENT),
  // each walking several tiles.
  int persistent_blocks = 0;
};

// How the tensor-core families' dq_accum (BwdParams) is laid out: (B, H, rows, ld) float32, query
// row i of (batch b, head h) at element ((b H + h) rows + i) ld. Packed, (B, H, Lq, D), except for
// the Hopper backward's bulk reductions (sm90/launch.h: bulk_dq_accum), whose padding lets one
// copy add a whole query block's shared-memory tile into it. (The fallback reads and writes its
// own, packed, whatever this says: a guard recomputing a tensor-core call fits in either.)
struct DqAccumLayout {
  int64_t rows = 0;   // rows per (batch, head), at least Lq
  int64_t ld = 0;     // floats per row, at least D
  bool bulk = false;  // the Hopper backward adds whole blocks (bulk reductions), not pairs
  EA_HOST_DEVICE int64_t offset(int64_t batch_head, int64_t i) const {
    return (batch_head * rows + i) * ld;
  }
};

inline DqAccumLayout packed_dq_accum(int64_t q_len, int64_t head_dim) {
  return {q_len, head_dim, false};
}

template <typename acc_t>
struct BwdParams : AttentionArgs<acc_t> {
  View4 out, dout;  // the forward output and its gradient (B, H, Lq, Dv)
  // (B, H, Lq), contiguous; the upstream statistic gradients may be null (zero).
  const acc_t *lse = nullptr, *entropy = nullptr, *sum_p2 = nullptr, *row_scale = nullptr;
  const acc_t *g_lse = nullptr, *g_entropy = nullptr, *g_sum_p2 = nullptr;
  acc_t* delta = nullptr;  // D~_i, written by the preprocess kernel
  // Contiguous accumulators: G = sum_j dS_ij k_j (B, H, Lq, D) (lambda_i G_i with g_scaled), for
  // the tensor-core families as dq_layout says, zero-filled by the caller (the host, or the
  // tensor-core families' postprocess, turns it into dq = lambda G and d lambda = q . G); dK and dV
  // per query head (B, H, Lk, D) and (B, H, Lk, Dv), summed over GQA groups by the host.
  acc_t *dq_accum = nullptr, *dk = nullptr, *dv = nullptr;
  DqAccumLayout dq_layout;  // the tensor-core families' dq_accum (set by whoever allocates it)
  // The tensor-core family writes the gradients itself, in the input type and strided as the host
  // allocated them (each in its input's layout: attention_call.h, empty_in_layout_of), rows
  // 16-byte aligned: dq (B, H, Lq, D), dk and dv (B, Hkv, Lk, D) summed over each GQA group in the
  // kernel; and d lambda (B, H, Lq) in acc_t, contiguous (a postprocess kernel forms dq = lambda G,
  // d lambda = q . G from dq_accum). `deterministic` asks for a dq computed without atomics.
  // d_row_scale null: d lambda is not asked for (the call's grad_scale), so the postprocess forms
  // dq alone; and where the Hopper launcher sets g_scaled (its kernels without a mask:
  // sm90/bwd_kernel.cuh, kScalesG), the main kernel stores lambda_i dS alone
  // and sums G = lambda dS K, which is dq itself (docs/math.md section 3).
  OutView4 dq_out, dk_out, dv_out;
  acc_t* d_row_scale = nullptr;
  bool deterministic = false;
  // A deterministic Hopper backward (sm90/bwd_kernel.cuh: write_dq, and the atomics of the kernels
  // without bulk reductions): per (batch, head, query block of 64 of dq_accum's rows),
  // (B, H, sm90/launch.h: turn_blocks) int32, a turn counter that the preprocess starts at the
  // first key block that walks the query block (key_ranges.cuh: first_walker) and each key block
  // raises to the next key block with a walk once it has added its G; key block n adds when it
  // reads n, so that the sum's order is the key blocks' whatever the schedule. Null: any order
  // (faster).
  int* dq_turns = nullptr;
  // The fallback kernels' under deterministic algorithms, as a plain call or as the guard of a
  // tensor-core backward (fallback/turns.cuh): (B, H, Lq) int32, zero-filled, the counter of the
  // query tile that starts at row i at index i, which each key tile that walks the tile raises by
  // one once it has added its G. Null: any order, and the guard's capped grid.
  int* tile_turns = nullptr;
  bool g_scaled = false;
  // The additive mask's gradient (kernel_args.h), zero-filled, when the call asks for it (the
  // backward kernels add dS into it; the Hopper family's only without the statistics' gradients:
  // sm90/launch.h, backward_covers); else null.
  LogitGradArg<acc_t> d_logits;
};

// attention_sparsity: the forward's inputs (v unused) and one output per row, (B, H, Lq)
// contiguous.
template <typename acc_t>
struct SparsityParams : AttentionArgs<acc_t> {
  ScalePolicy<acc_t> scale;
  SparsityKind kind = SparsityKind::kExp;
  acc_t* out = nullptr;
};

// A row reduction (entropy or sparsity) of `rows` contiguous rows of length n.
struct RowReductionParams {
  const void* in = nullptr;
  void* out = nullptr;
  int64_t rows = 0, n = 0;
};

// Head dims are padded up to a compiled bucket; 0 = larger than any (unsupported).
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxHeadDimFloat64 = 128;  // float64 tiles of 256 exceed an A100's shared memory
inline int head_dim_bucket(int64_t d) { return d <= 64 ? 64 : d <= 128 ? 128 : d <= 256 ? 256 : 0; }

}  // namespace entropy_attn::cuda
