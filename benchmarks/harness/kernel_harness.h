// The torch-free core of the kernel harness (kernel_harness.cu): deterministic inputs, an
// independent float64 reference written plainly (the n x n formula, docs/math.md sections 1-3),
// the kernel parameters of a call filled from raw buffers (as csrc/cuda/attention_host.cpp fills
// them from tensors), and the comparisons. Host C++ only, no ATen and no CUDA runtime, so that the
// same code drives the real kernels on a GPU and the fallback family's kernels under the CPU
// emulation (tests/cpp/test_cuda_emulation.cpp: KernelHarness), which checks it on any machine.
//
// The calls it covers: bf16 or fp16, head_dim == v_head_dim, full or top-left causal attention,
// GQA, the default scale 1 / sqrt(D) or "logn" (a per-row lambda_i), a bool or additive mask shared
// by the heads, with and without statistics, the output in (B, H, Lq, D) or (B, Lq, H, D) memory;
// the backward with the output's gradient and the statistics' upstream gradients.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda/params.h"
#include "cuda/sm90/launch.h"

namespace entropy_attn::harness {

using cuda::AttentionArgs;
using cuda::BwdParams;
using cuda::DqAccumLayout;
using cuda::FwdParams;
using cuda::packed_dq_accum;

// The mask of a masked call, the same for every head (the kernels read it as (B, H, Lq, Lk) with a
// head stride of 0): key j hidden from row i unless j = 0 or (i + 2 j) mod 3 != 0 (so no row is
// empty); the additive mask adds (i + j) mod 5 / 4 - 1/2 to the allowed logits, -inf elsewhere.
inline bool mask_allows(int64_t i, int64_t j) { return j == 0 || (i + 2 * j) % 3 != 0; }
inline float mask_bias(int64_t i, int64_t j) {
  return mask_allows(i, j) ? 0.25f * static_cast<float>((i + j) % 5) - 0.5f : -INFINITY;
}
// The byte of an allowed key in a bool mask: any of 1 ... 255, as a uint8 tensor viewed as bool
// may hold (kernel_args.h: bool_bytes), half of them even, so that a kernel reading the byte as a
// C++ bool (its lowest bit, or its value as a count) fails.
inline uint8_t mask_true_byte(int64_t i, int64_t j) {
  return static_cast<uint8_t>(1 + (7 * i + 13 * j) % 255);
}

// A call: (B, H, L, D) queries, (B, Hkv, Lk, D) keys and values.
struct Shape {
  int64_t batch = 1, heads = 1, kv_heads = 1, q_len = 1, kv_len = 1, head_dim = 64;
  bool causal = false;
  bool logn = false;  // lambda_i = log_b(n_i) / sqrt(D) (b = kLogBase) instead of 1 / sqrt(D)
  // The backward with upstream gradients of lse, entropy and sum p^2 too (what an entropy
  // regularizer sends), not only the output's.
  bool stat_grads = false;
  MaskKind mask = MaskKind::kNone;  // a bool or additive mask (mask_allows, mask_bias)
  // The output and the gradients in (B, L, heads, D) memory, as the op allocates them for inputs
  // split from projections (attention_call.h: empty_in_layout_of), rather than in (B, heads, L, D).
  bool heads_inside_rows = false;
  // With an additive mask: the backward also writes the mask's gradient (Buffers::d_mask), the
  // logits' gradient summed over the heads the mask is shared by.
  bool mask_grad = false;
  // The additive mask's storage: float32 (kAcc), or the inputs' own 16-bit type (kBFloat16 with
  // bf16 inputs, kFloat16 with fp16 ones), as a model's bias in bf16 or fp16 reaches the kernels
  // (attention_inputs.h: keeps_mask_dtype). mask_bias's values are exact in either.
  MaskElem mask_elem = MaskElem::kAcc;
  // The mask (B, 1, 1, Lk) instead: one entry per key, shared by the rows (its row stride 0), as a
  // learned bias per key; its gradient sums the rows' dS (logit_grads.cuh: the warp's sums).
  bool mask_per_key = false;
  // The backward under deterministic algorithms (params.h: deterministic; the sm80 family's dq
  // kernel, the Hopper family's bulk reductions in the key blocks' order through dq_turns).
  bool deterministic = false;

  int64_t q_elems() const { return batch * heads * q_len * head_dim; }
  int64_t kv_elems() const { return batch * kv_heads * kv_len * head_dim; }
  int64_t rows() const { return batch * heads * q_len; }
  int64_t group() const { return heads / kv_heads; }
  // The keys [0, limit(i)) row i may see before the mask (top-left causality, as SDPA's
  // is_causal); keys(i), its n_i, also counts the mask.
  int64_t limit(int64_t i) const { return causal ? std::min(i + 1, kv_len) : kv_len; }
  bool allows(int64_t i, int64_t j) const {
    return mask == MaskKind::kNone || mask_allows(mask_row(i), j);
  }
  // The mask's row of query row i, its rows, and its stride along them.
  int64_t mask_row(int64_t i) const { return mask_per_key ? 0 : i; }
  int64_t mask_rows() const { return mask_per_key ? 1 : q_len; }
  int64_t mask_row_stride() const { return mask_per_key ? 0 : kv_len; }
  int64_t keys(int64_t i) const {
    int64_t n = 0;
    for (int64_t j = 0; j < limit(i); ++j) n += allows(i, j);
    return n;
  }
  // Forward FLOPs as the GPU benchmark counts them: 4 B H Lq Lk D, halved when causal.
  double forward_flops() const {
    return 4.0 * batch * heads * q_len * kv_len * head_dim * (causal ? 0.5 : 1.0);
  }
};

constexpr double kLogBase = 256.0;

// lambda_i of row i: the scale policy's constant times its length factor (scale_policy.h).
inline double row_lambda(const Shape& s, int64_t i) {
  const double c = 1.0 / std::sqrt(static_cast<double>(s.head_dim));
  return s.logn ? c * std::log(static_cast<double>(s.keys(i))) / std::log(kLogBase) : c;
}

template <typename T>
inline double to_double(T x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return static_cast<double>(__bfloat162float(x));
  } else {
    return static_cast<double>(__half2float(x));
  }
}
template <typename T>
inline T from_float(float x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(x);
  } else {
    return __float2half_rn(x);
  }
}

// Inputs in T, and their values in float64 (the reference reads the rounded values).
template <typename T>
struct Inputs {
  std::vector<T> q, k, v, dout;
  std::vector<double> qd, kd, vd, doutd;
  // The mask (B, 1, Lq, Lk) or (B, 1, 1, Lk): bool as bytes, or additive in float32 or
  // (Shape::mask_elem) in T; empty without one.
  std::vector<uint8_t> mask_bool;
  std::vector<float> mask_add;
  std::vector<T> mask_add_t;
  // The statistics' upstream gradients (B, H, Lq) in float32, empty without stat_grads.
  std::vector<float> g_lse, g_entropy, g_sum_p2;
};

// Values of a 32-bit linear congruential sequence, uniform in [-range, range): the same on every
// machine. Queries and keys in [-2, 2), so that the logits (about 1.3 standard deviations at the
// default scale) make weights far from uniform; values and the output's gradient in [-1, 1).
// (with_doubles = false: the 16-bit values alone, for calls no reference reads.)
template <typename T>
Inputs<T> make_inputs(const Shape& s, uint32_t seed, bool with_doubles = true) {
  uint32_t state = seed * 2654435761u + 12345u;
  const auto fill = [&state, with_doubles](int64_t n, float range, std::vector<T>& out,
                                           std::vector<double>& outd) {
    out.resize(n), outd.resize(with_doubles ? n : 0);
    for (int64_t e = 0; e < n; ++e) {
      state = state * 1664525u + 1013904223u;
      out[e] = from_float<T>(range * (static_cast<float>(state >> 8) / 8388608.0f - 1.0f));
      if (with_doubles) outd[e] = to_double(out[e]);
    }
  };
  Inputs<T> in;
  if (s.mask == MaskKind::kAdditive && s.mask_elem != MaskElem::kAcc &&
      (s.mask_elem == MaskElem::kBFloat16) != std::is_same_v<T, __nv_bfloat16>) {
    std::fprintf(stderr, "kernel_harness: a 16-bit additive mask must be of the inputs' type\n");
    std::abort();
  }
  fill(s.q_elems(), 2.f, in.q, in.qd);
  fill(s.kv_elems(), 2.f, in.k, in.kd);
  fill(s.kv_elems(), 1.f, in.v, in.vd);
  fill(s.q_elems(), 1.f, in.dout, in.doutd);
  for (int64_t b = 0; b < s.batch && s.mask != MaskKind::kNone; ++b) {
    for (int64_t i = 0; i < s.mask_rows(); ++i) {
      for (int64_t j = 0; j < s.kv_len; ++j) {
        if (s.mask == MaskKind::kBool) {
          in.mask_bool.push_back(mask_allows(i, j) ? mask_true_byte(i, j) : 0);
        } else if (s.mask_elem == MaskElem::kAcc) {
          in.mask_add.push_back(mask_bias(i, j));
        } else {
          in.mask_add_t.push_back(from_float<T>(mask_bias(i, j)));
        }
      }
    }
  }
  if (s.stat_grads) {
    for (std::vector<float>* g : {&in.g_lse, &in.g_entropy, &in.g_sum_p2}) {
      std::vector<T> x;
      std::vector<double> xd;
      fill(s.rows(), 1.f, x, xd);
      for (const T& e : x) g->push_back(static_cast<float>(to_double(e)));
    }
  }
  return in;
}

// The forward's results, per row (B, H, Lq) and the output (B, H, Lq, D).
struct Forward {
  std::vector<double> out, lse, entropy, sum_p2;
};

// The weights p_ij of row (b, h, i) over keys [0, limit(i)) (0 where the mask hides a key), its
// logits s_ij = lambda_i q_i.k_j (+ the additive mask) and its lse (float64, the n x n formula).
inline std::vector<double> row_weights(const Shape& s, const double* q, const double* k, int64_t i,
                                       double& lse, std::vector<double>* logits = nullptr) {
  const int64_t n = s.limit(i), d = s.head_dim;
  const double lam = row_lambda(s, i);
  std::vector<double> w(n);
  double m = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    double x = 0;
    for (int64_t c = 0; c < d; ++c) x += q[c] * k[j * d + c];
    w[j] = !s.allows(i, j)                 ? -INFINITY
           : s.mask == MaskKind::kAdditive ? lam * x + mask_bias(s.mask_row(i), j)
                                           : lam * x;
    m = std::max(m, w[j]);
  }
  if (logits != nullptr) *logits = w;
  double l = 0;
  for (double& x : w) l += (x = std::exp(x - m));  // (e^-inf = 0)
  for (double& x : w) x /= l;
  lse = m + std::log(l);
  return w;
}

template <typename T>
Forward reference_forward(const Shape& s, const Inputs<T>& in) {
  const int64_t d = s.head_dim;
  Forward f;
  f.out.assign(s.q_elems(), 0.0);
  f.lse.assign(s.rows(), 0.0), f.entropy.assign(s.rows(), 0.0), f.sum_p2.assign(s.rows(), 0.0);
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.heads; ++h) {
      const int64_t kvh = h / s.group();
      const double* k = &in.kd[((b * s.kv_heads + kvh) * s.kv_len) * d];
      const double* v = &in.vd[((b * s.kv_heads + kvh) * s.kv_len) * d];
      for (int64_t i = 0; i < s.q_len; ++i) {
        const int64_t row = (b * s.heads + h) * s.q_len + i;
        double lse = 0;
        const std::vector<double> w = row_weights(s, &in.qd[row * d], k, i, lse);
        double ent = 0, p2 = 0;
        for (size_t j = 0; j < w.size(); ++j) {
          if (w[j] > 0) ent -= w[j] * std::log(w[j]);
          p2 += w[j] * w[j];
          for (int64_t c = 0; c < d; ++c) f.out[row * d + c] += w[j] * v[j * d + c];
        }
        f.lse[row] = lse, f.entropy[row] = ent, f.sum_p2[row] = p2;
      }
    }
  }
  return f;
}

// The gradients of sum(out * dout) (with stat_grads, plus sum(g_lse lse + g_entropy H +
// g_sum_p2 sum p^2)): dq (B, H, Lq, D), dk and dv (B, Hkv, Lk, D) summed over each GQA group, and
// d lambda (B, H, Lq), the gradient of each row's scale. The logit's gradient term by term, each
// statistic's own derivative (docs/math.md section 3; not the collected form the kernels use):
// dS_ij = p_ij (dP_ij - delta_i) + g_lse p_ij - g_H p_ij (s_ij - lse_i + H_i)
// + 2 g_U p_ij (p_ij - U_i), dP_ij = dO_i . v_j, delta_i = dO_i . O_i; with the raw score
// x_ij = q_i . k_j (s_ij = lambda_i x_ij, plus an additive mask): dq_i = lambda_i sum_j dS_ij k_j,
// dk_j = sum_i lambda_i dS_ij q_i, dv_j = sum_i p_ij dO_i, d lambda_i = sum_j dS_ij x_ij; with
// mask_grad, the additive mask's gradient (B, 1, Lq, Lk): dmask_ij = sum_h dS_ij (the logit adds
// the mask entry as it is); per key (B, 1, 1, Lk), dmask_j = sum_h sum_i dS_ij.
struct Backward {
  std::vector<double> dq, dk, dv, dlam, dmask;
};

template <typename T>
Backward reference_backward(const Shape& s, const Inputs<T>& in, const Forward& f) {
  const int64_t d = s.head_dim;
  Backward g;
  g.dq.assign(s.q_elems(), 0.0), g.dk.assign(s.kv_elems(), 0.0), g.dv.assign(s.kv_elems(), 0.0);
  g.dlam.assign(s.rows(), 0.0);
  if (s.mask_grad) g.dmask.assign(s.batch * s.mask_rows() * s.kv_len, 0.0);
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.heads; ++h) {
      const int64_t kv0 = ((b * s.kv_heads + h / s.group()) * s.kv_len) * d;
      const double *k = &in.kd[kv0], *v = &in.vd[kv0];
      for (int64_t i = 0; i < s.q_len; ++i) {
        const int64_t row = (b * s.heads + h) * s.q_len + i;
        const double *q = &in.qd[row * d], *dout = &in.doutd[row * d], *out = &f.out[row * d];
        double lse = 0;
        std::vector<double> logit;
        const std::vector<double> w = row_weights(s, q, k, i, lse, &logit);
        const double lam = row_lambda(s, i);
        double delta = 0;
        for (int64_t c = 0; c < d; ++c) delta += dout[c] * out[c];
        const double gl = s.stat_grads ? in.g_lse[row] : 0.0;
        const double gh = s.stat_grads ? in.g_entropy[row] : 0.0;
        const double gu = s.stat_grads ? in.g_sum_p2[row] : 0.0;
        for (size_t j = 0; j < w.size(); ++j) {
          double dp = 0, x = 0;
          for (int64_t c = 0; c < d; ++c) dp += dout[c] * v[j * d + c], x += q[c] * k[j * d + c];
          if (w[j] == 0) continue;  // a hidden key (or an underflow): no term
          const double ds = w[j] * (dp - delta) + gl * w[j] -
                            gh * w[j] * (logit[j] - lse + f.entropy[row]) +
                            2 * gu * w[j] * (w[j] - f.sum_p2[row]);
          g.dlam[row] += ds * x;
          if (s.mask_grad) {
            g.dmask[(b * s.mask_rows() + s.mask_row(i)) * s.kv_len + static_cast<int64_t>(j)] += ds;
          }
          for (int64_t c = 0; c < d; ++c) {
            g.dq[row * d + c] += lam * ds * k[j * d + c];
            g.dk[kv0 + j * d + c] += lam * ds * q[c];
            g.dv[kv0 + j * d + c] += w[j] * dout[c];
          }
        }
      }
    }
  }
  return g;
}

// A (B, heads, len, D) output's view over `data`: in (B, len, heads, D) memory when
// s.heads_inside_rows, else in (B, heads, len, D).
template <typename Pointer>
cuda::BasicView4<Pointer> bhld_view(const Shape& s, int64_t heads, int64_t len, Pointer data) {
  const int64_t d = s.head_dim;
  if (s.heads_inside_rows) return {data, len * heads * d, d, heads * d};
  return {data, heads * len * d, len * d, d};
}
// The views of the output and dq (B, H, Lq, D), and of dk and dv (B, Hkv, Lk, D).
template <typename Pointer>
cuda::BasicView4<Pointer> output_view(const Shape& s, Pointer data) {
  return bhld_view(s, s.heads, s.q_len, data);
}
template <typename Pointer>
cuda::BasicView4<Pointer> kv_view(const Shape& s, Pointer data) {
  return bhld_view(s, s.kv_heads, s.kv_len, data);
}

// An output as stored (bhld_view), in (B, heads, len, D) order, as the reference gives it.
inline std::vector<double> in_head_order(const Shape& s, int64_t heads, int64_t len,
                                         const std::vector<double>& stored) {
  const auto view = bhld_view(s, heads, len, static_cast<const void*>(nullptr));
  std::vector<double> out(stored.size());
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t i = 0; i < len; ++i) {
        const int64_t row = (b * heads + h) * len + i;
        for (int64_t c = 0; c < s.head_dim; ++c) {
          out[row * s.head_dim + c] = stored[view.offset(b, h, i) + c];
        }
      }
    }
  }
  return out;
}
inline std::vector<double> output_in_head_order(const Shape& s, const std::vector<double>& stored) {
  return in_head_order(s, s.heads, s.q_len, stored);
}
inline std::vector<double> kv_in_head_order(const Shape& s, const std::vector<double>& stored) {
  return in_head_order(s, s.kv_heads, s.kv_len, stored);
}

// The addresses of a call's buffers: device memory on a GPU, host memory under the emulation.
// Inputs and 16-bit outputs in T; row values, dq's accumulator and the fallback's per-query-head
// dK and dV in float32.
struct Buffers {
  void *q = nullptr, *k = nullptr, *v = nullptr, *dout = nullptr, *out = nullptr;
  void* mask = nullptr;     // (B, 1, Shape::mask_rows(), Lk): bool, float32 or mask_elem's T
  float* d_mask = nullptr;  // with mask_grad: the mask's gradient, its shape (zero-filled)
  float *lse = nullptr, *entropy = nullptr, *sum_p2 = nullptr, *max_weight = nullptr;
  float *row_scale = nullptr, *length_factor = nullptr;
  float *normalized_entropy = nullptr, *sparsity = nullptr, *effective_keys = nullptr;
  int64_t* n_keys = nullptr;
  float *delta = nullptr, *dq_accum = nullptr, *d_row_scale = nullptr;
  float *g_lse = nullptr, *g_entropy = nullptr, *g_sum_p2 = nullptr;  // with stat_grads
  float *dk_heads = nullptr, *dv_heads = nullptr;    // the fallback's (B, H, Lk, D)
  void *dq = nullptr, *dk = nullptr, *dv = nullptr;  // the tensor-core families' (T)
};

// The floats of dq's accumulator in layout `l` (params.h: DqAccumLayout).
inline int64_t dq_accum_elems(const Shape& s, const DqAccumLayout& l) {
  return s.batch * s.heads * l.rows * l.ld;
}

// The floats of a buffer that holds dq's accumulator in either layout: packed, or laid out for the
// Hopper backward's bulk reductions (sm90/launch.h: bulk_dq_accum).
inline int64_t dq_accum_elems(const Shape& s) {
  return std::max(dq_accum_elems(s, packed_dq_accum(s.q_len, s.head_dim)),
                  dq_accum_elems(s, cuda::sm90::bulk_dq_accum(s.q_len, s.head_dim)));
}

// What each buffer holds, in bytes, for inputs of `elem` bytes: one list, so that the allocation
// on either side walks it.
struct BufferSize {
  void** slot;
  int64_t bytes;
};
// per_head_grads: the fallback's per-query-head dK and dV (the tensor-core families write dk and
// dv summed over the group, and leave them empty).
inline std::vector<BufferSize> buffer_sizes(const Shape& s, Buffers& b, int64_t elem,
                                            bool per_head_grads = true) {
  const int64_t rows = s.rows() * 4, q = s.q_elems(), kv = s.kv_elems();
  const int64_t dq_accum = dq_accum_elems(s) * 4;
  const int64_t kv_heads = per_head_grads ? s.batch * s.heads * s.kv_len * s.head_dim * 4 : 0;
  const auto slot = [](auto*& p) { return reinterpret_cast<void**>(&p); };
  const int64_t mask = s.batch * s.mask_rows() * s.kv_len *
                       (s.mask == MaskKind::kBool       ? 1
                        : s.mask == MaskKind::kAdditive ? (s.mask_elem == MaskElem::kAcc ? 4 : 2)
                                                        : 0);
  const int64_t d_mask = s.mask_grad ? s.batch * s.mask_rows() * s.kv_len * 4 : 0;
  return {{slot(b.mask), mask},
          {slot(b.q), q * elem},
          {slot(b.k), kv * elem},
          {slot(b.v), kv * elem},
          {slot(b.dout), q * elem},
          {slot(b.out), q * elem},
          {slot(b.lse), rows},
          {slot(b.entropy), rows},
          {slot(b.sum_p2), rows},
          {slot(b.max_weight), rows},
          {slot(b.row_scale), rows},
          {slot(b.length_factor), rows},
          {slot(b.normalized_entropy), rows},
          {slot(b.sparsity), rows},
          {slot(b.effective_keys), rows},
          {slot(b.n_keys), rows * 2},
          {slot(b.delta), rows},
          {slot(b.g_lse), rows},
          {slot(b.g_entropy), rows},
          {slot(b.g_sum_p2), rows},
          {slot(b.dq_accum), dq_accum},
          {slot(b.d_row_scale), rows},
          {slot(b.dk_heads), kv_heads},
          {slot(b.dv_heads), kv_heads},
          {slot(b.dq), q * elem},
          {slot(b.dk), kv * elem},
          {slot(b.dv), kv * elem},
          {slot(b.d_mask), d_mask}};
}

// A call's inputs into its buffers b, each vector through copy(to, vector): cudaMemcpy on a GPU,
// memcpy in host memory (the emulation tests).
template <typename T, typename Copy>
void fill_inputs(const Shape& s, const Buffers& b, const Inputs<T>& in, Copy&& copy) {
  copy(b.q, in.q), copy(b.k, in.k), copy(b.v, in.v), copy(b.dout, in.dout);
  if (s.mask == MaskKind::kBool) copy(b.mask, in.mask_bool);
  if (s.mask == MaskKind::kAdditive) {
    if (s.mask_elem == MaskElem::kAcc) {
      copy(b.mask, in.mask_add);
    } else {
      copy(b.mask, in.mask_add_t);
    }
  }
  if (s.stat_grads)
    copy(b.g_lse, in.g_lse), copy(b.g_entropy, in.g_entropy), copy(b.g_sum_p2, in.g_sum_p2);
}

// What the forward and the backward both read.
inline void fill_args(AttentionArgs<float>& a, const Shape& s, const Buffers& b) {
  const int64_t d = s.head_dim;
  a.q = {b.q, s.heads * s.q_len * d, s.q_len * d, d};
  a.k = {b.k, s.kv_heads * s.kv_len * d, s.kv_len * d, d};
  a.v = {b.v, s.kv_heads * s.kv_len * d, s.kv_len * d, d};
  a.batch = s.batch, a.heads = s.heads, a.kv_heads = s.kv_heads;
  a.q_len = s.q_len, a.kv_len = s.kv_len, a.head_dim = d, a.v_head_dim = d;
  a.pattern.right = s.causal ? 0 : -1;  // (attention_options.h: key_pattern)
  if (s.mask != MaskKind::kNone) {      // (B, H, Lq, Lk) with a head stride of 0
    a.mask.kind = s.mask, a.mask.data = b.mask;
    a.mask.elem = s.mask == MaskKind::kAdditive ? s.mask_elem : MaskElem::kAcc;
    a.mask.sb = s.mask_rows() * s.kv_len, a.mask.sh = 0, a.mask.si = s.mask_row_stride();
    a.mask.sj = 1;
  }
}

inline FwdParams<float> forward_params(const Shape& s, const Buffers& b, bool stats) {
  FwdParams<float> p;
  fill_args(p, s, b);
  p.scale.constant = static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.head_dim)));
  p.scale.mode = s.logn ? ScaleMode::kLogN : ScaleMode::kFixed;
  p.scale.inv_log_base = s.logn ? static_cast<float>(1.0 / std::log(kLogBase)) : 0.f;
  p.out = output_view(s, b.out), p.lse = b.lse, p.row_scale = b.row_scale,
  p.length_factor = b.length_factor;
  p.n_keys = b.n_keys;
  if (stats) {
    p.entropy = b.entropy, p.sum_p2 = b.sum_p2, p.max_weight = b.max_weight;
    p.normalized_entropy = b.normalized_entropy, p.sparsity = b.sparsity;
    p.effective_keys = b.effective_keys;
  }
  return p;
}

// The backward of a forward with statistics into b (lse, row_scale, entropy, sum_p2), for the
// fallback (G, per-query-head dK and dV in float32; finish_fallback forms the gradients) or a
// tensor-core family (dq, dk, dv in T), dq_accum packed (the Hopper backward's bulk reductions
// want another layout: sm90/launch.h, bulk_dq_accum). dq_accum (and d_mask, with mask_grad) must
// be zero-filled.
inline BwdParams<float> backward_params(const Shape& s, const Buffers& b, bool tensor_core) {
  BwdParams<float> p;
  fill_args(p, s, b);
  p.dq_layout = packed_dq_accum(s.q_len, s.head_dim);
  const int64_t d = s.head_dim;
  p.out = output_view(s, static_cast<const void*>(b.out));
  p.dout = {b.dout, s.heads * s.q_len * d, s.q_len * d, d};
  p.lse = b.lse, p.entropy = b.entropy, p.sum_p2 = b.sum_p2, p.row_scale = b.row_scale;
  p.delta = b.delta, p.dq_accum = b.dq_accum;
  if (s.stat_grads) p.g_lse = b.g_lse, p.g_entropy = b.g_entropy, p.g_sum_p2 = b.g_sum_p2;
  if (s.mask_grad) {  // (B, H, Lq, Lk) over the (B, 1, Lq or 1, Lk) entries: head stride 0
    p.d_logits.data = b.d_mask;
    p.d_logits.sb = s.mask_rows() * s.kv_len, p.d_logits.sh = 0;
    p.d_logits.si = s.mask_row_stride(), p.d_logits.sj = 1;
  }
  if (tensor_core) {
    p.dq_out = output_view(s, b.dq), p.dk_out = kv_view(s, b.dk), p.dv_out = kv_view(s, b.dv);
    p.d_row_scale = b.d_row_scale;
  } else {
    p.dk = b.dk_heads, p.dv = b.dv_heads;
  }
  return p;
}

// The fallback's gradients as the reference gives them: dq = lambda G, d lambda = q . G, dK and dV
// summed over each GQA group (what csrc/cuda/attention_host.cpp's finish does with tensors).
inline Backward finish_fallback(const Shape& s, const std::vector<double>& q,
                                const std::vector<float>& g, const std::vector<float>& row_scale,
                                const std::vector<float>& dk_heads,
                                const std::vector<float>& dv_heads) {
  const int64_t d = s.head_dim, per_head = s.kv_len * d;
  Backward out;
  out.dq.resize(s.q_elems());
  out.dlam.assign(s.rows(), 0.0);
  for (int64_t e = 0; e < s.q_elems(); ++e) {
    out.dq[e] = double(g[e]) * row_scale[e / d];
    out.dlam[e / d] += q[e] * double(g[e]);
  }
  out.dk.assign(s.kv_elems(), 0.0), out.dv.assign(s.kv_elems(), 0.0);
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.heads; ++h) {
      const int64_t from = (b * s.heads + h) * per_head;
      const int64_t to = (b * s.kv_heads + h / s.group()) * per_head;
      for (int64_t e = 0; e < per_head; ++e) {
        out.dk[to + e] += dk_heads[from + e], out.dv[to + e] += dv_heads[from + e];
      }
    }
  }
  return out;
}

// Tolerances per input type: the test suite's (tests/conftest.py: OUT_TOL, STAT_TOL, GRAD_TOL).
struct Tolerance {
  double atol, rtol, grad;
};
template <typename T>
constexpr Tolerance tolerance() {
  return std::is_same_v<T, __nv_bfloat16> ? Tolerance{2e-2, 2e-2, 4e-2}
                                          : Tolerance{3e-3, 3e-3, 6e-3};
}

// One comparison: the worst |a - e| / (atol + rtol |e|) elementwise (<= 1 passes; NaN fails), or
// the relative norm ||a - e|| / ||e|| against `tol`.
struct Check {
  std::string what;
  double error = 0, tol = 1;
  bool ok() const { return error <= tol; }  // (false for NaN)
};

template <typename A>
Check elementwise(const std::string& what, const std::vector<A>& a, const std::vector<double>& e,
                  const Tolerance& t) {
  Check c{what, a.size() == e.size() ? 0.0 : INFINITY, 1.0};
  for (size_t i = 0; i < std::min(a.size(), e.size()); ++i) {
    const double r = std::fabs(double(a[i]) - e[i]) / (t.atol + t.rtol * std::fabs(e[i]));
    if (std::isnan(r)) return {what, NAN, 1.0};
    c.error = std::max(c.error, r);
  }
  return c;
}

template <typename A>
Check relative(const std::string& what, const std::vector<A>& a, const std::vector<double>& e,
               double tol) {
  double num = 0, den = 0;
  for (size_t i = 0; i < std::min(a.size(), e.size()); ++i) {
    num += (double(a[i]) - e[i]) * (double(a[i]) - e[i]);
    den += e[i] * e[i];
  }
  const double err =
      a.size() == e.size() ? std::sqrt(num) / std::max(std::sqrt(den), 1e-12) : INFINITY;
  return {what, err, tol};
}

// A 16-bit buffer read back, in float64.
template <typename T>
std::vector<double> widen(const std::vector<T>& x) {
  std::vector<double> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = to_double(x[i]);
  return out;
}

// A call's buffers in host memory (buffer_sizes), filled with its inputs: the CPU emulation's
// calls.
template <typename T>
struct HostCall {
  Shape s;
  Inputs<T> in;
  Buffers b;
  std::vector<std::vector<std::byte>> storage;

  HostCall(const Shape& shape, uint32_t seed) : s(shape), in(make_inputs<T>(shape, seed)) {
    for (const BufferSize& z : buffer_sizes(s, b, sizeof(T))) {
      storage.emplace_back(static_cast<size_t>(z.bytes) + 16);
      *z.slot = storage.back().data();
    }
    fill_inputs(s, b, in, [](void* to, const auto& from) {
      std::memcpy(to, from.data(), from.size() * sizeof(from[0]));
    });
  }
  // n values of type T at data, widened; the per-row values (B, H, Lq) at p.
  std::vector<double> widen(const void* data, int64_t n) const {
    const T* x = static_cast<const T*>(data);
    return harness::widen(std::vector<T>(x, x + n));
  }
  std::vector<float> rows(const float* p) const { return std::vector<float>(p, p + s.rows()); }
};

}  // namespace entropy_attn::harness
