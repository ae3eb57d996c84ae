// The CUDA kernels (csrc/cuda/*_kernel.cuh) run on the CPU through an emulation of the CUDA
// execution model (cuda_emulation.h: 128 threads per block, fibers of one host thread, barriers
// for __syncthreads and __syncwarp, shuffles through per-warp slots, std::atomic_ref atomics), so
// that their index arithmetic, masking, tiling, synchronization and statistics are tested on
// machines without a GPU.
// The host halves (attention_host.h: prepare_forward / prepare_backward / prepare_row_reduction)
// allocate on the CPU here; the results are compared with an independent float64 reference written
// with plain ATen ops over the full (B, H, Lq, Lk) matrix, its gradients by autograd. Calls with
// dropout are also compared with the CPU op (csrc/cpu), which draws the same Philox stream.
//
// On the host (no __CUDA_ARCH__) block_gemm.cuh takes its CUDA-core path for every type: everything
// but the WMMA tensor-core path of the 16-bit types is exercised.

// clang-format off
#include "cuda_emulation.h"  // first: the CUDA built-ins the kernel headers use
// clang-format on

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "attention_call.h"
#include "cuda/attention_host.h"
#include "cuda/fallback/bwd_kernel.cuh"
#include "cuda/fallback/fwd_kernel.cuh"
#include "cuda/fallback/row_reduction_kernels.cuh"
#include "cuda/fallback/sparsity_kernel.cuh"
#include "emulated_launches.h"
#include "entropy_attn.h"
#include "kernel_harness.h"

namespace {

namespace ec = entropy_attn::cuda;
namespace ef = entropy_attn::cuda::fallback;
using entropy_attn::AttentionOutputs;

using emulated::backward_tile_rows;
using emulated::launch_backward;
using emulated::launch_forward;
using emulated::launch_sparsity;

// ---------------------------------------------------------------------------------------------
// Comparison helpers
// ---------------------------------------------------------------------------------------------

// |actual - expected| <= tol * max(1, max |expected|) elementwise, NaN where and only where the
// reference has NaN.
void expect_close(const at::Tensor& actual, const at::Tensor& expected, double tol,
                  const std::string& what) {
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  const at::Tensor a = actual.to(at::kDouble), b = expected.to(at::kDouble);
  const at::Tensor nan_a = a.isnan(), nan_b = b.isnan();
  EXPECT_TRUE(at::equal(nan_a, nan_b))
      << what << ": NaN pattern differs (" << nan_a.sum().item<int64_t>()
      << " NaN in the kernel's, " << nan_b.sum().item<int64_t>() << " in the reference's)";
  if (a.numel() == 0) return;
  const at::Tensor ok = nan_a.logical_not().logical_and(nan_b.logical_not());
  // Equal entries differ by 0, infinities included (inf - inf would be NaN); an infinity against a
  // finite value differs by inf.
  const at::Tensor diff = at::where(ok.logical_and(a != b), (a - b).abs(), at::zeros_like(a));
  // The scale of the tolerance from the finite entries: an infinity would make any error pass.
  const at::Tensor finite_b = at::where(b.isfinite(), b.abs(), at::zeros_like(b));
  const double scale = std::max(1.0, finite_b.max().item<double>());
  const double err = diff.max().item<double>();
  if (!(err <= tol * scale)) {
    const int64_t flat = diff.flatten().argmax().item<int64_t>();
    ADD_FAILURE() << what << ": max |kernel - reference| = " << err << " > " << tol * scale
                  << " at flat index " << flat << " of shape " << a.sizes() << " (kernel "
                  << a.flatten()[flat].item<double>() << ", reference "
                  << b.flatten()[flat].item<double>() << ")";
  }
}

struct Tolerances {
  double out, stats, grad;
};
Tolerances tolerances(at::ScalarType t) {
  switch (t) {
    case at::kDouble:
      return {1e-11, 1e-11, 1e-9};
    case at::kFloat:
      return {2e-5, 2e-5, 1e-4};
    // 16-bit: P is rounded to the input type before P V (and P, dS before the backward products),
    // the output and the gradients are stored in it; the statistics are float32.
    case at::kHalf:
      return {5e-3, 1e-4, 2e-2};
    default:
      return {3e-2, 1e-4, 6e-2};  // bfloat16
  }
}

// ---------------------------------------------------------------------------------------------
// The float64 reference, over the full (B, H, Lq, Lk) matrix.
// ---------------------------------------------------------------------------------------------

enum class MaskType { kNone, kBool, kBoolQK, kBoolKeys, kAdditive, kAdditiveQK, kAdditiveKeys };

struct Case {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  int64_t B = 1, H = 1, Hkv = 1, Lq = 17, Lk = 17, D = 8, Dv = -1;  // Dv = -1: D
  bool causal = false;
  MaskType mask = MaskType::kNone;
  bool masked_rows = false;      // some rows (or a batch for kBoolKeys/kAdditiveKeys) fully masked
  bool mask_transposed = false;  // the mask as a transposed view (strides of Lq and Lk swapped)
  // A 16-bit additive mask read by the kernels in its dtype, as the call preparation keeps it on a
  // GPU (attention_inputs.h: keeps_mask_dtype; a CPU call, as here, converts it to float32).
  bool mask_keeps_dtype = false;
  bool scale_tensor = false;  // a (B, H, 1) scale tensor
  std::optional<double> scale_factor;
  const char* mode = "fixed";
  double log_base = 16, temperature = 1;
  bool noncontig = false;  // q, k, v as transpose(1, 2) views of (B, L, H, D) tensors
  bool nan_row = false;    // NaN in one query row
  // NaN in a key, a value, a query and a dO row, each hidden from some rows (causal cases): the
  // kernels must match the CPU op, which keeps each to the rows and keys that see it.
  bool hidden_nonfinite = false;
  bool stat_grads = true;                       // upstream gradients of lse, entropy and sum_p2
  int64_t window_left = -1, window_right = -1;  // window_size
  bool bottom_right = false;                    // causal_alignment
  double softcap = 0;
  bool sinks = false;  // a (H,) sink logit per head
  double dropout_p = 0;
  int64_t dropout_seed = 0x5eed0f1u;
  // Packed documents (B = 1, Lq and Lk the totals): the cumulative query and key lengths, and the
  // keys each document uses (empty: all of its cu_k range).
  std::vector<int32_t> cu_q, cu_k, seqused_k;
  // The backward's device: the shared memory per block it grants (bwd_launch.cuh chooses the
  // tiles by it), by default one that takes every kernel.
  int smem_optin = 232448;
  int64_t dv() const { return Dv < 0 ? D : Dv; }
};

std::ostream& operator<<(std::ostream& os, const Case& c) { return os << c.name; }

std::array<int64_t, 2> window(const Case& c) { return {c.window_left, c.window_right}; }
const char* alignment(const Case& c) { return c.bottom_right ? "bottom_right" : "top_left"; }

entropy_attn::AttentionOptions options(const Case& c) {
  return entropy_attn::AttentionOptions::from_schema(
      c.causal, c.scale_factor, c.mode, c.temperature, c.log_base, c.H != c.Hkv,
      /*return_stats=*/true, window(c), alignment(c), c.softcap, c.dropout_p, c.dropout_seed);
}

struct Inputs {
  at::Tensor q, k, v;              // the kernel's inputs (dtype, possibly non-contiguous)
  std::optional<at::Tensor> mask;  // as passed to the op (unexpanded)
  std::optional<at::Tensor> scale;
  std::optional<at::Tensor> sinks;   // (H,) in the input dtype
  at::Tensor cu_q, cu_k, seqused_k;  // int32, defined for packed documents
  at::Tensor dout, g_lse, g_entropy, g_sum_p2;
};

at::Tensor int32_tensor(const std::vector<int32_t>& v) {
  return at::tensor(at::ArrayRef<int32_t>(v), at::TensorOptions().dtype(at::kInt));
}

Inputs make_inputs(const Case& c) {
  at::manual_seed(1234);
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  const at::ScalarType acc = c.dtype == at::kDouble ? at::kDouble : at::kFloat;
  Inputs in;
  auto qkv = [&](int64_t heads, int64_t len, int64_t d) {
    if (c.noncontig) return at::randn({c.B, len, heads, d}, f64).to(c.dtype).transpose(1, 2);
    return at::randn({c.B, heads, len, d}, f64).to(c.dtype);
  };
  in.q = qkv(c.H, c.Lq, c.D);
  in.k = qkv(c.Hkv, c.Lk, c.D);
  in.v = qkv(c.Hkv, c.Lk, c.dv());
  if (c.nan_row && c.Lq > 2) {
    in.q.select(0, 0).select(0, 0).select(0, 2).fill_(std::numeric_limits<double>::quiet_NaN());
  }
  const double nan = std::numeric_limits<double>::quiet_NaN();
  if (c.hidden_nonfinite) {
    in.k.select(0, 0).select(0, 0).select(0, c.Lk - 1).fill_(nan);
    // An infinite key entry seen by many rows: its logit is +inf (a NaN row) or -inf (weight 0,
    // but dQ still forms dS * k = 0 * inf there, as the CPU op does) by the sign of q.
    in.k.select(0, 0)
        .select(0, 0)
        .select(0, c.Lk / 2)
        .select(0, 0)
        .fill_(std::numeric_limits<double>::infinity());
    in.v.select(0, 0).select(0, 0).select(0, c.Lk - 2).select(0, 1).fill_(nan);
    in.q.select(0, 0).select(0, 0).select(0, 0).select(0, 2).fill_(nan);
    // An infinite query entry: keys of logit -inf get dS = 0 from it, and dK still forms 0 * inf.
    in.q.select(0, 0)
        .select(0, 0)
        .select(0, c.Lq / 2)
        .select(0, 1)
        .fill_(std::numeric_limits<double>::infinity());
  }
  std::vector<int64_t> mshape;
  switch (c.mask) {
    case MaskType::kBool:
    case MaskType::kAdditive:
      mshape = {c.B, c.H, c.Lq, c.Lk};
      break;
    case MaskType::kBoolQK:
    case MaskType::kAdditiveQK:
      mshape = {c.Lq, c.Lk};
      break;
    case MaskType::kBoolKeys:
    case MaskType::kAdditiveKeys:
      mshape = {c.B, 1, 1, c.Lk};
      break;
    case MaskType::kNone:
      break;
  }
  if (c.mask != MaskType::kNone) {
    at::Tensor allow = at::rand(mshape, f64) > 0.3;
    if (c.masked_rows) {
      if (c.mask == MaskType::kBoolKeys || c.mask == MaskType::kAdditiveKeys) {
        allow.select(0, c.B - 1).fill_(false);  // the last batch sees no key at all
      } else if (c.Lq > 1) {
        allow.select(-2, 1).fill_(false);
        allow.select(-2, c.Lq - 1).fill_(false);
      }
    }
    const bool additive = c.mask == MaskType::kAdditive || c.mask == MaskType::kAdditiveQK ||
                          c.mask == MaskType::kAdditiveKeys;
    if (additive) {
      const at::Tensor values = at::randn(mshape, f64) * 0.5;
      in.mask =
          at::where(allow, values, at::full_like(values, -std::numeric_limits<double>::infinity()))
              .to(c.dtype);
    } else {
      // True as any nonzero byte, as a uint8 tensor viewed as bool may hold (kernel_args.h:
      // bool_bytes): half of them even, whose lowest bit a C++ bool read may take.
      const at::Tensor bytes = at::randint(1, 256, mshape, at::TensorOptions().dtype(at::kByte));
      in.mask = at::where(allow, bytes, at::zeros_like(bytes)).view(at::kBool);
    }
    if (c.mask_transposed) in.mask = in.mask->transpose(-1, -2).contiguous().transpose(-1, -2);
  }
  if (c.scale_tensor) in.scale = (at::rand({c.B, c.H, 1}, f64) * 0.4 + 0.1).to(c.dtype);
  if (c.sinks) in.sinks = (at::randn({c.H}, f64) + 1.0).to(c.dtype);
  if (!c.cu_q.empty()) {
    in.cu_q = int32_tensor(c.cu_q), in.cu_k = int32_tensor(c.cu_k);
    if (!c.seqused_k.empty()) in.seqused_k = int32_tensor(c.seqused_k);
  }
  in.dout = at::randn({c.B, c.H, c.Lq, c.dv()}, f64).to(c.dtype);
  if (c.hidden_nonfinite) {
    in.dout.select(0, 0).select(0, 0).select(0, 1).select(0, 0).fill_(nan);
    // An infinite dO entry: its row's dP = dO V^T is +-inf or NaN key by key, and so is dS.
    in.dout.select(0, 0).select(0, 0).select(0, 5).select(0, 1).fill_(
        std::numeric_limits<double>::infinity());
  }
  in.g_lse = at::randn({c.B, c.H, c.Lq}, f64).to(acc);
  in.g_entropy = at::randn({c.B, c.H, c.Lq}, f64).to(acc);
  in.g_sum_p2 = at::randn({c.B, c.H, c.Lq}, f64).to(acc);
  return in;
}

// Which keys (Lk) each query row (Lq) of one document sees: those within the window around the
// row's diagonal, key i (top-left) or i + Lk - Lq (bottom-right); is_causal bounds it at the
// diagonal.
at::Tensor window_allowed(const Case& c, int64_t lq, int64_t lk) {
  const at::Tensor i = at::arange(lq).unsqueeze(1), j = at::arange(lk).unsqueeze(0);
  const at::Tensor diag = c.bottom_right ? i + (lk - lq) : i;
  at::Tensor allowed = at::ones({lq, lk}, at::TensorOptions().dtype(at::kBool));
  const int64_t right = c.causal ? 0 : c.window_right;
  if (c.window_left >= 0) allowed = allowed.logical_and(j >= diag - c.window_left);
  if (right >= 0) allowed = allowed.logical_and(j <= diag + right);
  return allowed;
}

// The same for the whole call: block diagonal for packed documents (the window within each).
at::Tensor pattern_allowed(const Case& c) {
  if (c.cu_q.empty()) return window_allowed(c, c.Lq, c.Lk);
  at::Tensor allowed = at::zeros({c.Lq, c.Lk}, at::TensorOptions().dtype(at::kBool));
  for (size_t d = 0; d + 1 < c.cu_q.size(); ++d) {
    const int64_t q0 = c.cu_q[d], q1 = c.cu_q[d + 1], k0 = c.cu_k[d];
    const int64_t lk = c.seqused_k.empty() ? c.cu_k[d + 1] - k0 : c.seqused_k[d];
    allowed.slice(0, q0, q1).slice(1, k0, k0 + lk).copy_(window_allowed(c, q1 - q0, lk));
  }
  return allowed;
}

// The logits of the reference: s_ij = cap(lambda_i q_i.k_j) + additive mask where key j is allowed
// (by the key pattern and the mask), -inf elsewhere, cap(x) = softcap tanh(x / softcap) (or x);
// n_i = allowed keys; lambda_i = c * g(n_i) / temperature, a leaf of the graph (for d lambda).
struct RefLogits {
  at::Tensor q, k, v;  // float64 leaves
  at::Tensor mask;     // the additive mask as passed, a float64 leaf (undefined: none, or bool)
  at::Tensor allowed, n, any, factor, lam, s;
};

bool additive_mask(const Inputs& in) {
  return in.mask.has_value() && in.mask->scalar_type() != at::kBool;
}

RefLogits reference_logits(const Case& c, const Inputs& in, bool grads) {
  const double inf = std::numeric_limits<double>::infinity();
  RefLogits L;
  L.q = in.q.to(at::kDouble).detach().requires_grad_(grads);
  L.k = in.k.to(at::kDouble).detach().requires_grad_(grads);
  L.v = in.v.to(at::kDouble).detach().requires_grad_(grads);
  const int64_t group = c.H / c.Hkv;
  const at::Tensor kx = L.k.repeat_interleave(group, 1);
  const auto f64 = at::TensorOptions().dtype(at::kDouble);

  // Which keys each row may see, and the additive term.
  L.allowed = pattern_allowed(c).expand({c.B, c.H, c.Lq, c.Lk});
  at::Tensor add = at::zeros({c.B, c.H, c.Lq, c.Lk}, f64);
  if (in.mask.has_value()) {
    const at::Tensor m = in.mask->expand({c.B, c.H, c.Lq, c.Lk});
    if (m.scalar_type() == at::kBool) {
      L.allowed = L.allowed.logical_and(m.view(at::kByte).ne(0));  // (bytes other than 0 / 1)
    } else {
      L.mask = in.mask->to(at::kDouble).detach().requires_grad_(grads);
      const at::Tensor md = L.mask.expand({c.B, c.H, c.Lq, c.Lk});
      L.allowed = L.allowed.logical_and(md != -inf);
      add = at::where(L.allowed, md, at::zeros_like(md));
    }
  }
  L.n = L.allowed.sum(-1);  // int64 (B, H, Lq)
  const at::Tensor nd = L.n.to(at::kDouble);
  L.any = L.n > 0;

  // lambda_i = c * g(n_i) / temperature.
  at::Tensor g;
  const std::string mode = c.mode;
  if (mode == "fixed") {
    g = at::ones_like(nd);
  } else {
    const at::Tensor lg = at::where(L.any, nd, at::ones_like(nd)).log() / std::log(c.log_base);
    g = mode == "logn" ? lg : lg.clamp_min(1.0);
    g = at::where(L.any, g, at::zeros_like(g));
  }
  L.factor = g / c.temperature;
  at::Tensor cc;
  if (in.scale.has_value()) {
    cc = in.scale->to(at::kDouble).expand({c.B, c.H, c.Lq});
  } else {
    cc = at::full({c.B, c.H, c.Lq}, c.scale_factor.value_or(1.0 / std::sqrt(double(c.D))), f64);
  }
  L.lam = (cc * L.factor).detach().requires_grad_(grads);
  const at::Tensor r = at::matmul(L.q, kx.transpose(-1, -2));
  at::Tensor x = L.lam.unsqueeze(-1) * r;
  if (c.softcap > 0) x = c.softcap * at::tanh(x / c.softcap);
  const at::Tensor s = x + add;
  L.s = at::where(L.allowed, s, at::full_like(s, -inf));
  return L;
}

struct Reference {
  at::Tensor out, lse, entropy, sum_p2, max_weight, n_keys, row_scale, length_factor;
  at::Tensor normalized_entropy, sparsity, effective_keys;
  // Defined when gradients were asked for (dsinks: sinks; dmask: an additive mask, its shape).
  at::Tensor dq, dk, dv, dlam, dsinks, dmask;
};

// The dropout factors (B, H, Lq, Lk) of the weights that multiply V: 0 or 1 / (1 - p) as
// csrc/dropout.h defines them (head row b * H + h, query row, key), ones without dropout.
at::Tensor reference_keep(const Case& c) {
  at::Tensor keep = at::ones({c.B, c.H, c.Lq, c.Lk}, at::TensorOptions().dtype(at::kDouble));
  if (!(c.dropout_p > 0)) return keep;
  const auto d = entropy_attn::Dropout<double>::make(c.dropout_p, c.dropout_seed);
  auto k = keep.accessor<double, 4>();
  for (int64_t b = 0; b < c.B; ++b) {
    for (int64_t h = 0; h < c.H; ++h) {
      for (int64_t i = 0; i < c.Lq; ++i) {
        for (int64_t j = 0; j < c.Lk; ++j) k[b][h][i][j] = d.factor(b * c.H + h, i, j);
      }
    }
  }
  return keep;
}

Reference reference(const Case& c, const Inputs& in, bool grads) {
  const RefLogits L = reference_logits(c, in, grads);
  const at::Tensor vx = L.v.repeat_interleave(c.H / c.Hkv, 1);
  // A sink is one more softmax entry per row (the head's logit, no value): the distribution, lse
  // and every statistic are over the keys and the sink, and n counts it in the derived ones.
  at::Tensor sink, s_all = L.s, any = L.any, n_all = L.n;
  if (in.sinks.has_value()) {
    sink = in.sinks->to(at::kDouble).detach().requires_grad_(grads);
    s_all = at::cat({L.s, sink.view({1, c.H, 1, 1}).expand({c.B, c.H, c.Lq, 1})}, -1);
    any = at::ones_like(L.any), n_all = L.n + 1;
  }
  const at::Tensor nd = n_all.to(at::kDouble);
  // Rows without any allowed entry: finite placeholder logits, their weights zeroed below.
  const at::Tensor s_filled = at::where(any.unsqueeze(-1), s_all, at::zeros_like(s_all));
  const at::Tensor p_all = at::softmax(s_filled, -1) * any.unsqueeze(-1).to(at::kDouble);
  const at::Tensor p = p_all.narrow(-1, 0, c.Lk);

  Reference ref;
  ref.out = at::matmul(p * reference_keep(c), vx);  // dropout: P V only, not the statistics
  ref.lse = at::where(any, at::logsumexp(s_filled, {-1}), at::zeros_like(nd));
  ref.entropy = -(p_all * at::where(p_all > 0, p_all, at::ones_like(p_all)).log()).sum(-1);
  ref.sum_p2 = (p_all * p_all).sum(-1);
  ref.max_weight = p_all.size(-1) > 0 ? std::get<0>(p_all.max(-1)) : at::zeros_like(nd);
  ref.n_keys = L.n;
  ref.row_scale = L.lam.detach();
  ref.length_factor = L.factor;
  // The derived statistics from their definitions (0 for empty rows; H / ln n for n >= 2).
  const at::Tensor z = at::zeros_like(nd);
  ref.normalized_entropy = at::where(
      n_all >= 2, ref.entropy / at::where(n_all >= 2, nd, at::full_like(nd, 2.0)).log(), z);
  const at::Tensor p2 = at::where(any, ref.sum_p2, at::ones_like(nd));
  ref.sparsity =
      at::where(any, p_all.sum(-1) / (at::where(any, nd, at::ones_like(nd)) * p2).sqrt(), z);
  ref.effective_keys = at::where(any, 1.0 / p2, z);

  if (grads) {
    at::Tensor loss = (ref.out * in.dout.to(at::kDouble)).sum();
    if (c.stat_grads) {
      loss = loss + (ref.lse * in.g_lse.to(at::kDouble)).sum() +
             (ref.entropy * in.g_entropy.to(at::kDouble)).sum() +
             (ref.sum_p2 * in.g_sum_p2.to(at::kDouble)).sum();
    }
    std::vector<at::Tensor> leaves{L.q, L.k, L.v, L.lam};
    if (sink.defined()) leaves.push_back(sink);
    if (L.mask.defined()) leaves.push_back(L.mask);
    const auto gr = torch::autograd::grad({loss}, leaves, /*grad_outputs=*/{},
                                          /*retain_graph=*/false, /*create_graph=*/false,
                                          /*allow_unused=*/true);
    auto or_zeros = [](const at::Tensor& g, const at::Tensor& like) {
      return g.defined() ? g : at::zeros_like(like);
    };
    ref.dq = or_zeros(gr[0], L.q), ref.dk = or_zeros(gr[1], L.k), ref.dv = or_zeros(gr[2], L.v);
    ref.dlam = or_zeros(gr[3], L.lam);
    if (sink.defined()) ref.dsinks = or_zeros(gr[4], sink);
    if (L.mask.defined()) ref.dmask = or_zeros(gr.back(), L.mask);
  }
  for (at::Tensor* t : {&ref.out, &ref.lse, &ref.entropy, &ref.sum_p2, &ref.max_weight}) {
    *t = t->detach();
  }
  return ref;
}

// attention_sparsity: S_i = sum_j |a_ij| / sqrt(n_i sum_j a_ij^2) with a = softmax (exp),
// relu(s)^2 (relu2) or s (identity) over the allowed keys (0 elsewhere); 0 for an all-zero row;
// NaN for a row with a NaN logit (README: NaN in the inputs propagates to the rows that see it).
at::Tensor reference_sparsity(const Case& c, const Inputs& in, const std::string& kind) {
  const RefLogits L = reference_logits(c, in, false);
  const at::Tensor zero = at::zeros_like(L.s);
  at::Tensor a;
  if (kind == "exp") {
    const at::Tensor s_filled = at::where(L.any.unsqueeze(-1), L.s, zero);
    a = at::softmax(s_filled, -1) * L.any.unsqueeze(-1).to(at::kDouble);
  } else if (kind == "relu2") {
    a = at::where(L.allowed, L.s.clamp_min(0).pow(2), zero);
  } else {
    a = at::where(L.allowed, L.s, zero);
  }
  const at::Tensor l1 = a.abs().sum(-1), l2 = (a * a).sum(-1);
  const at::Tensor denom = (L.n.to(at::kDouble) * l2).sqrt();
  const at::Tensor defined = (denom > 0).logical_or(l1.isnan()).logical_or(l2.isnan());
  return at::where(defined, l1 / denom, at::zeros_like(l1)).detach();
}

// ---------------------------------------------------------------------------------------------
// One case: the emulated forward and backward against the reference.
// ---------------------------------------------------------------------------------------------

// Packed documents: the checked call of a varlen caller (the kernels read them through
// CallPattern::key_pattern()).
// The packed documents of a case as the op takes them (checked by prepare_attention).
entropy_attn::DocumentArgs documents(const Inputs& in) {
  auto opt = [](const at::Tensor& t) {
    return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
  };
  return {opt(in.cu_q), opt(in.cu_k), opt(in.seqused_k), std::nullopt};
}

std::optional<at::Tensor> stat_grad(const Case& c, const at::Tensor& g) {
  return c.stat_grads ? std::optional<at::Tensor>(g) : std::nullopt;
}

// The CPU op of the same call through the dispatcher (csrc/cpu, the same Philox stream for the
// dropout): its forward, and its backward from its own forward (with the additive mask's gradient
// when the kernels' is given), against the emulated kernels'.
void expect_matches_cpu_op(const Case& c, const Inputs& in, const AttentionOutputs& fwd,
                           const entropy_attn::AttentionGrads& grads,
                           const at::Tensor& dmask_kernel, const Tolerances& tol) {
  SCOPED_TRACE("the CPU op");
  const entropy_attn::AttentionResult r = entropy_attn::attention(
      in.q, in.k, in.v, in.mask, in.scale, c.causal, c.scale_factor, c.mode, c.temperature,
      c.log_base, c.H != c.Hkv, /*return_stats=*/true, window(c), alignment(c), c.softcap, in.sinks,
      c.dropout_p, c.dropout_seed);
  expect_close(std::get<0>(fwd), r.output, tol.out, "output");
  expect_close(std::get<1>(fwd), r.lse, tol.stats, "lse");
  expect_close(std::get<2>(fwd), r.entropy, tol.stats, "entropy");
  const auto [dq, dk, dv, dlam, dsinks, dmask] = entropy_attn::call_attention_backward(
      in.dout, stat_grad(c, in.g_lse), stat_grad(c, in.g_entropy), stat_grad(c, in.g_sum_p2), in.q,
      in.k, in.v, in.mask, r.output, r.lse, r.entropy, r.sum_p2, r.row_scale, in.sinks, {},
      options(c), /*grad_mask=*/dmask_kernel.defined());
  expect_close(std::get<0>(grads), dq, tol.grad, "grad_query");
  expect_close(std::get<1>(grads), dk, tol.grad, "grad_key");
  expect_close(std::get<2>(grads), dv, tol.grad, "grad_value");
  expect_close(std::get<3>(grads), dlam, tol.grad, "grad_row_scale");
  if (dmask_kernel.defined()) expect_close(dmask_kernel, dmask, tol.grad, "grad_attn_mask");
}

// The checked, normalized call of a case's inputs, as the op prepares it.
entropy_attn::AttentionCall prepared_call(const Case& c, const Inputs& in) {
  return entropy_attn::prepare_attention(in.q, in.k, in.v, in.mask, in.scale, in.sinks,
                                         documents(in), options(c));
}

// The case's 16-bit additive mask expanded in its own dtype (Case::mask_keeps_dtype).
at::Tensor kept_mask(const Inputs& in, const entropy_attn::AttentionShape& shape,
                     at::ScalarType acc) {
  const at::Tensor m = entropy_attn::expand_mask(*in.mask, shape, acc, /*keep_dtype=*/true);
  EXPECT_EQ(m.scalar_type(), in.mask->scalar_type());
  return m;
}

template <typename T>
void run_case_typed(const Case& c, bool backward) {
  using Acc = ec::AccType<T>;
  const Inputs in = make_inputs(c);
  const Tolerances tol = tolerances(c.dtype);

  entropy_attn::AttentionCall call = prepared_call(c, in);
  if (c.mask_keeps_dtype) call.mask = kept_mask(in, call.shape, call.acc);
  const ec::ForwardCall fwd(in.q, in.k, in.v, call);
  launch_forward<T>(fwd.params<Acc>());
  if (::testing::Test::HasFatalFailure()) return;
  const auto& [out, lse, entropy, sum_p2, max_weight, n_keys, row_scale, length_factor,
               normalized_entropy, sparsity, effective_keys] = fwd.outputs;

  // With hidden non-finite inputs the plain n x n reference is NaN everywhere: the CPU op is the
  // reference then (below).
  const Reference ref = reference(c, in, backward && !c.hidden_nonfinite);
  const at::ScalarType acc = c.dtype == at::kDouble ? at::kDouble : at::kFloat;
  EXPECT_EQ(out.scalar_type(), c.dtype);
  EXPECT_EQ(lse.scalar_type(), acc);
  if (!c.hidden_nonfinite) {
    expect_close(out, ref.out, tol.out, "output");
    expect_close(lse, ref.lse, tol.stats, "lse");
    expect_close(entropy, ref.entropy, tol.stats, "entropy");
    expect_close(sum_p2, ref.sum_p2, tol.stats, "sum_p2");
    expect_close(max_weight, ref.max_weight, tol.stats, "max_weight");
    EXPECT_TRUE(at::equal(n_keys, ref.n_keys)) << "n_keys:\n"
                                               << n_keys << "\nreference:\n"
                                               << ref.n_keys;
    expect_close(row_scale, ref.row_scale, tol.stats, "row_scale");
    expect_close(length_factor, ref.length_factor, tol.stats, "length_factor");
    expect_close(normalized_entropy, ref.normalized_entropy, tol.stats, "normalized_entropy");
    expect_close(sparsity, ref.sparsity, tol.stats, "sparsity");
    expect_close(effective_keys / ref.effective_keys.clamp_min(1),
                 ref.effective_keys / ref.effective_keys.clamp_min(1), tol.stats, "effective_keys");
  }
  if (c.nan_row && c.Lq > 2) {
    // NaN in query row 2 of (b, h) = (0, 0): that row's output and statistics are NaN, no other.
    EXPECT_TRUE(out[0][0][2].isnan().all().item<bool>());
    EXPECT_TRUE(lse[0][0][2].isnan().item<bool>());
    EXPECT_EQ(out.isnan().sum().item<int64_t>(), c.dv()) << "NaN beyond the NaN row";
    EXPECT_EQ(entropy.isnan().sum().item<int64_t>(), 1);
  }
  if (!backward) return;

  entropy_attn::AttentionBackwardCall bcall = entropy_attn::prepare_attention_backward(
      in.dout, stat_grad(c, in.g_lse), stat_grad(c, in.g_entropy), stat_grad(c, in.g_sum_p2), in.q,
      in.k, in.v, in.mask, out, lse, entropy, sum_p2, row_scale, in.sinks, documents(in),
      options(c), /*grad_mask=*/additive_mask(in), /*grad_scale=*/true);
  if (c.mask_keeps_dtype) bcall.mask = kept_mask(in, bcall.shape, bcall.acc);
  ec::BackwardCall bwd(in.dout, in.q, in.k, in.v, out, bcall);
  bwd.allocate(ec::Family::kFallback);
  launch_backward<T>(bwd.params<Acc>(), c.smem_optin);
  if (::testing::Test::HasFatalFailure()) return;
  const entropy_attn::AttentionGrads grads = bwd.finish();
  const auto& [dq, dk, dv, dlam] = grads;
  // The additive mask's gradient: the logits' gradient the kernel wrote, summed to its shape.
  const at::Tensor dmask =
      additive_mask(in) ? entropy_attn::mask_grad(in.mask, bwd.call, in.q) : at::Tensor();
  EXPECT_EQ(dq.scalar_type(), c.dtype);
  if (c.hidden_nonfinite) {
    expect_matches_cpu_op(c, in, fwd.outputs, grads, dmask, tol);
    return;
  }
  expect_close(dq, ref.dq, tol.grad, "grad_query");
  expect_close(dk, ref.dk, tol.grad, "grad_key");
  expect_close(dv, ref.dv, tol.grad, "grad_value");
  expect_close(dlam, ref.dlam, tol.grad, "grad_row_scale");
  if (dmask.defined()) {
    EXPECT_EQ(dmask.scalar_type(), in.mask->scalar_type());
    expect_close(dmask, ref.dmask, tol.grad, "grad_attn_mask");
  }
  // The sinks' gradient comes from the backward's row quantities in ATen (sink_grad), outside the
  // kernels: checked here with the emulated forward's output.
  if (c.sinks) {
    expect_close(entropy_attn::sink_grad(in.dout, out, bwd.call), ref.dsinks, tol.grad,
                 "grad_sinks");
  }
  // The op has no packed documents: the CPU op's check is for dense calls.
  if (c.dropout_p > 0 && c.cu_q.empty()) {
    expect_matches_cpu_op(c, in, fwd.outputs, grads, dmask, tol);
  }
  if (c.nan_row && c.Lq > 2) {
    // dq of every other row stays finite (dk, dv of the keys the NaN row sees are NaN).
    EXPECT_EQ(dq.isnan().sum().item<int64_t>(), c.D) << "NaN beyond the NaN row of grad_query";
  }
}

// Calls f with a value of the kernels' input type for `dtype` (its type is what f reads).
template <typename F>
void with_input_type(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat:
      return f(float{});
    case at::kDouble:
      return f(double{});
    case at::kHalf:
      return f(__half{});
    case at::kBFloat16:
      return f(__nv_bfloat16{});
    default:
      FAIL() << "dtype";
  }
}

void run_case(const Case& c, bool backward = true) {
  with_input_type(c.dtype, [&](auto t) { run_case_typed<decltype(t)>(c, backward); });
}

// ---------------------------------------------------------------------------------------------
// The cases
// ---------------------------------------------------------------------------------------------

Case mk(std::string name, at::ScalarType dtype, int64_t lq, int64_t lk, int64_t d,
        int64_t dv = -1) {
  Case c;
  c.name = std::move(name), c.dtype = dtype, c.Lq = lq, c.Lk = lk, c.D = d, c.Dv = dv;
  return c;
}

std::vector<Case> attention_cases() {
  using at::kBFloat16;
  using at::kDouble;
  using at::kFloat;
  using at::kHalf;
  std::vector<Case> v;
  Case c;
  // Head-dim buckets (64, 128, 256) and Dv != D; lengths that are not multiples of the tiles.
  v.push_back(mk("f32_d8", kFloat, 17, 17, 8));
  v.push_back(mk("f32_d40_dv24_65x97", kFloat, 65, 97, 40, 24));
  v.push_back(mk("f32_d64_dv100_63x65", kFloat, 63, 65, 64, 100));  // bucket 128 from Dv
  v.push_back(mk("f32_d100_33x130", kFloat, 33, 130, 100));
  v.push_back(mk("f32_d200_dv256_17x33", kFloat, 17, 33, 200, 256));
  v.push_back(mk("f32_d256_1x17", kFloat, 1, 17, 256));
  v.push_back(mk("f32_lq1_lk130", kFloat, 1, 130, 8));
  v.push_back(mk("f32_lk0", kFloat, 17, 0, 8));
  v.push_back(mk("f32_lq0", kFloat, 0, 17, 8));
  c = mk("f32_lk0_logn_mask", kFloat, 5, 0, 8), c.mode = "logn", c.mask = MaskType::kBool;
  v.push_back(c);
  // Causal, Lq < Lk and Lq > Lk.
  c = mk("f32_causal_17x65", kFloat, 17, 65, 8), c.causal = true, v.push_back(c);
  c = mk("f32_causal_97x17", kFloat, 97, 17, 8), c.causal = true, v.push_back(c);
  c = mk("f32_causal_130x130_d100", kFloat, 130, 130, 100), c.causal = true, v.push_back(c);
  // Masks: bool and additive, full and broadcast, with fully masked rows.
  c = mk("f32_bool_mask_masked_rows", kFloat, 33, 65, 8), c.mask = MaskType::kBool;
  c.masked_rows = true, c.B = 2, v.push_back(c);
  c = mk("f32_bool_mask_qk_causal", kFloat, 65, 33, 8), c.mask = MaskType::kBoolQK;
  c.causal = true, c.masked_rows = true, c.H = 2, c.Hkv = 2, v.push_back(c);
  c = mk("f32_bool_mask_keys", kFloat, 17, 65, 8), c.mask = MaskType::kBoolKeys, c.B = 2;
  c.masked_rows = true, v.push_back(c);
  c = mk("f32_additive_mask_masked_rows", kFloat, 33, 65, 8), c.mask = MaskType::kAdditive;
  c.masked_rows = true, v.push_back(c);
  c = mk("f32_additive_mask_qk_logn", kFloat, 17, 97, 40), c.mask = MaskType::kAdditiveQK;
  c.mode = "logn", c.causal = true, v.push_back(c);
  c = mk("f32_additive_mask_keys", kFloat, 17, 33, 8), c.mask = MaskType::kAdditiveKeys;
  c.B = 2, c.masked_rows = true, v.push_back(c);
  c = mk("f32_bool_mask_transposed_logn", kFloat, 65, 97, 8), c.mask = MaskType::kBool;
  c.mask_transposed = true, c.mode = "logn", c.B = 2, c.H = 2, c.Hkv = 2, v.push_back(c);
  c = mk("f32_additive_mask_qk_transposed", kFloat, 33, 17, 8), c.mask = MaskType::kAdditiveQK;
  c.mask_transposed = true, c.masked_rows = true, v.push_back(c);
  // GQA, scale tensor, scale modes, temperature, scale factor.
  c = mk("f32_gqa", kFloat, 17, 33, 8), c.H = 4, c.Hkv = 2, c.causal = true, v.push_back(c);
  c = mk("f32_scale_tensor_logn", kFloat, 33, 65, 8), c.B = 2, c.H = 2, c.Hkv = 2;
  c.scale_tensor = true, c.mode = "logn", c.causal = true, v.push_back(c);
  c = mk("f32_logn_sharpen_temperature", kFloat, 65, 33, 8), c.mode = "logn_sharpen";
  c.causal = true, c.temperature = 0.7, c.log_base = 8, v.push_back(c);
  c = mk("f32_scale_factor_temperature", kFloat, 17, 65, 8), c.scale_factor = 0.3;
  c.temperature = 1.7, v.push_back(c);
  c = mk("f32_no_stat_grads", kFloat, 17, 17, 8), c.stat_grads = false, v.push_back(c);
  // Non-contiguous inputs (transpose views), NaN in one query row.
  c = mk("f32_noncontig_gqa", kFloat, 17, 33, 40, 8), c.noncontig = true, c.H = 2, c.Hkv = 1;
  v.push_back(c);
  c = mk("f32_nan_row", kFloat, 17, 33, 8), c.nan_row = true, c.H = 2, c.Hkv = 2, v.push_back(c);
  // Several key and query tiles; causal, then a bool mask and a window on top.
  c = mk("f32_hidden_nonfinite", kFloat, 70, 70, 8), c.causal = true, c.hidden_nonfinite = true;
  c.H = 2, c.Hkv = 2, v.push_back(c);
  c.name = "f64_hidden_nonfinite_mask", c.dtype = kDouble, c.mask = MaskType::kBool, v.push_back(c);
  c = mk("bf16_hidden_nonfinite_window", kBFloat16, 70, 70, 64), c.causal = true;
  c.hidden_nonfinite = true, c.window_left = 20, v.push_back(c);
  // float64 (buckets 64 and 128).
  c = mk("f64_d64_causal_mask", kDouble, 33, 17, 64), c.causal = true;
  c.mask = MaskType::kAdditiveQK, v.push_back(c);
  c = mk("f64_d100_dv128_17x33", kDouble, 17, 33, 100, 128), c.mode = "logn", v.push_back(c);
  c = mk("f64_gqa_bool_mask", kDouble, 17, 17, 8), c.H = 2, c.Hkv = 1;
  c.mask = MaskType::kBool, c.masked_rows = true, v.push_back(c);
  c = mk("f64_causal_130x65_logn_sharpen", kDouble, 130, 65, 8), c.causal = true;
  c.mode = "logn_sharpen", c.scale_tensor = true, c.B = 2, v.push_back(c);
  // 16-bit inputs (float32 statistics), every bucket.
  c = mk("f16_d64_causal_mask", kHalf, 65, 33, 64), c.causal = true, c.mask = MaskType::kBool;
  v.push_back(c);
  c = mk("f16_d128_17x65", kHalf, 17, 65, 128), c.mode = "logn_sharpen", v.push_back(c);
  c = mk("f16_d40_130x130_causal_additive", kHalf, 130, 130, 40), c.causal = true;
  c.mask = MaskType::kAdditiveKeys, c.B = 2, c.H = 2, c.Hkv = 1, v.push_back(c);
  c = mk("f16_d256_dv40_17x33", kHalf, 17, 33, 256, 40), v.push_back(c);
  c = mk("bf16_d64_additive_gqa", kBFloat16, 33, 65, 64), c.mask = MaskType::kAdditive;
  c.masked_rows = true, c.H = 2, c.Hkv = 1, v.push_back(c);
  // The same masks read as 16-bit entries by the kernels (MaskElem), -inf, masked rows, a
  // transposed view (a key stride of Lq) and one shared by a batch's rows included.
  c = mk("bf16_d64_additive_in_bf16", kBFloat16, 33, 65, 64), c.mask = MaskType::kAdditive;
  c.masked_rows = true, c.H = 2, c.Hkv = 1, c.mask_keeps_dtype = true, v.push_back(c);
  c = mk("f16_d128_additive_qk_transposed_in_f16", kHalf, 33, 17, 128), c.causal = true;
  c.mask = MaskType::kAdditiveQK, c.mask_transposed = true, c.mode = "logn";
  c.mask_keeps_dtype = true, v.push_back(c);
  c = mk("f16_d40_additive_keys_in_f16", kHalf, 31, 47, 40), c.mask = MaskType::kAdditiveKeys;
  c.masked_rows = true, c.B = 2, c.mask_keeps_dtype = true, v.push_back(c);
  c = mk("bf16_d128_causal_noncontig", kBFloat16, 33, 17, 100), c.causal = true;
  c.noncontig = true, v.push_back(c);
  c = mk("bf16_d256_scale_tensor", kBFloat16, 17, 33, 256), c.scale_tensor = true;
  v.push_back(c);
  // Sliding windows, both alignments, Lq != Lk; lengths over several tiles, so that the forward
  // skips key tiles and the backward query tiles; rows whose window is empty (bottom-right, Lq >
  // Lk).
  c = mk("f32_window_tl_65x97", kFloat, 65, 97, 8), c.window_left = 7, c.window_right = 5;
  c.H = 2, c.Hkv = 1, v.push_back(c);
  c = mk("f32_window_br_97x65_logn", kFloat, 97, 65, 8), c.window_left = 9, c.window_right = 3;
  c.bottom_right = true, c.mode = "logn", v.push_back(c);
  c = mk("f32_window_left_br_33x130_mask", kFloat, 33, 130, 8), c.window_left = 20;
  c.bottom_right = true, c.mask = MaskType::kBool, c.masked_rows = true, v.push_back(c);
  c = mk("f32_window_right_tl_65x33_additive", kFloat, 65, 33, 8), c.window_right = 3;
  c.mask = MaskType::kAdditiveQK, v.push_back(c);
  c = mk("f32_window_130x130_d100", kFloat, 130, 130, 100), c.window_left = 16;
  c.window_right = 16, v.push_back(c);
  c = mk("f32_window_causal_130x130_d100", kFloat, 130, 130, 100), c.window_left = 40;
  c.causal = true, c.mode = "logn_sharpen", v.push_back(c);
  // Bottom-right causality: Lq < Lk (rows see the cache), Lq > Lk (the first rows see nothing).
  c = mk("f32_causal_br_17x65", kFloat, 17, 65, 8), c.causal = true, c.bottom_right = true;
  v.push_back(c);
  c = mk("f32_causal_br_97x17", kFloat, 97, 17, 8), c.causal = true, c.bottom_right = true;
  c.mode = "logn", v.push_back(c);
  c = mk("f64_causal_br_33x50_d64", kDouble, 33, 50, 64), c.causal = true;
  c.bottom_right = true, c.mask = MaskType::kAdditive, v.push_back(c);
  // Softcapping (scale_factor 1.5: logits well into tanh's bend).
  c = mk("f32_softcap_additive_logn", kFloat, 33, 65, 8), c.softcap = 2, c.scale_factor = 1.5;
  c.mask = MaskType::kAdditive, c.mode = "logn", v.push_back(c);
  c = mk("f64_softcap_causal_gqa", kDouble, 33, 33, 8), c.softcap = 1.5, c.scale_factor = 2;
  c.causal = true, c.H = 2, c.Hkv = 1, v.push_back(c);
  // Sinks: every statistic over the keys and the sink, rows without keys included.
  c = mk("f32_sinks_masked_rows", kFloat, 33, 65, 8), c.sinks = true, c.B = 2, c.H = 2;
  c.Hkv = 2, c.mask = MaskType::kBool, c.masked_rows = true, v.push_back(c);
  c = mk("f32_sinks_window_br_softcap_gqa", kFloat, 65, 97, 40), c.sinks = true;
  c.window_left = 5, c.window_right = 5, c.bottom_right = true, c.softcap = 3, c.H = 4;
  c.Hkv = 2, c.mode = "logn", v.push_back(c);
  c = mk("f64_sinks_causal_br_softcap_d64", kDouble, 33, 50, 64), c.sinks = true;
  c.causal = true, c.bottom_right = true, c.softcap = 4, c.scale_tensor = true, v.push_back(c);
  c = mk("f16_window_softcap_sinks_d64", kHalf, 65, 65, 64), c.window_left = 10;
  c.window_right = 2, c.softcap = 2, c.sinks = true, v.push_back(c);
  c = mk("bf16_d128_causal_br_sinks", kBFloat16, 33, 65, 128), c.causal = true;
  c.bottom_right = true, c.sinks = true, v.push_back(c);
  // Dropout (also against the CPU op, which draws the same Philox stream).
  c = mk("f32_dropout", kFloat, 33, 65, 8), c.dropout_p = 0.3, v.push_back(c);
  c = mk("f32_dropout_window_sinks_gqa", kFloat, 65, 97, 40), c.dropout_p = 0.2;
  c.window_left = 12, c.window_right = 4, c.sinks = true, c.H = 4, c.Hkv = 2, c.B = 2;
  c.mask = MaskType::kAdditiveKeys, v.push_back(c);
  c = mk("f64_dropout_causal_softcap", kDouble, 33, 33, 64), c.dropout_p = 0.5, c.causal = true;
  c.softcap = 3, v.push_back(c);
  c = mk("f16_dropout_d64", kHalf, 33, 65, 64), c.dropout_p = 0.1, c.dropout_seed = -7;
  v.push_back(c);
  c = mk("bf16_dropout_causal_br_d128", kBFloat16, 33, 65, 128), c.dropout_p = 0.25;
  c.causal = true, c.bottom_right = true, v.push_back(c);
  // Packed documents (varlen): one batch entry of several documents, the window and alignment
  // within each; a document without query rows, and keys past a document's seqused_k.
  c = mk("f32_docs_causal_br", kFloat, 64, 90, 8), c.cu_q = {0, 17, 30, 64};
  c.cu_k = {0, 33, 40, 90}, c.causal = true, c.bottom_right = true, c.H = 2, c.Hkv = 2;
  c.mode = "logn", v.push_back(c);
  c = mk("f32_docs_window_seqused_softcap", kFloat, 97, 130, 8), c.cu_q = {0, 40, 41, 97};
  c.cu_k = {0, 50, 60, 130}, c.seqused_k = {45, 0, 60}, c.window_left = 8, c.window_right = 8;
  c.softcap = 2, c.scale_factor = 1.5, c.mask = MaskType::kBoolQK, v.push_back(c);
  c = mk("f32_docs_dropout_sinks", kFloat, 60, 85, 40), c.cu_q = {0, 20, 20, 60};
  c.cu_k = {0, 35, 50, 85}, c.causal = true, c.dropout_p = 0.25, c.sinks = true, c.H = 2;
  c.Hkv = 1, v.push_back(c);
  // A GPU of 99 KB per block (sm_86/89/120): the 16-bit backward at head dims 129-256 in the
  // compact kernel's tiles of 16 rows, over several query and key tiles.
  c = mk("bf16_d256_99KB_causal_window_sinks", kBFloat16, 70, 70, 256), c.causal = true;
  c.window_left = 40, c.sinks = true, c.H = 2, c.Hkv = 1, c.smem_optin = 101376, v.push_back(c);
  c = mk("f16_d200_dv160_99KB_mask_logn_softcap", kHalf, 33, 50, 200, 160);
  c.mask = MaskType::kAdditive, c.masked_rows = true, c.mode = "logn", c.softcap = 2;
  c.smem_optin = 101376, v.push_back(c);
  c = mk("bf16_d256_99KB_dropout_docs", kBFloat16, 60, 85, 256), c.cu_q = {0, 20, 20, 60};
  c.cu_k = {0, 35, 50, 85}, c.causal = true, c.dropout_p = 0.25, c.smem_optin = 101376;
  v.push_back(c);
  return v;
}

// Which backward tiles exist for GPUs of 99 KB per block: the compact kernel where the usual tiles
// do not fit and tiles of 16 do (16-bit at 256), none where even those do not (float32 at 256,
// float64 at 128: those calls raise on such a GPU), and the usual tiles elsewhere.
TEST(EmulatedAttention, CompactBackwardOnlyWhereTheTilesDoNotFit) {
  static_assert(ef::kHasCompactBackward<__half, 256> &&
                ef::kHasCompactBackward<__nv_bfloat16, 256>);
  static_assert(!ef::kHasCompactBackward<__half, 128> && !ef::kHasCompactBackward<float, 256> &&
                !ef::kHasCompactBackward<double, 128>);
  static_assert(ef::BwdLayout<__half, 128>::kBytes <= ef::kSmallSharedMemory);
  static_assert(ef::BwdLayout<float, 256>::kBytes > ef::kSmallSharedMemory &&
                ef::BwdLayout<double, 128>::kBytes > ef::kSmallSharedMemory);
  static_assert(ef::CompactBwdLayout<__nv_bfloat16, 256>::kBM == 16);
}

// The fallback forward as the guard of a tensor-core forward (params.h: nonfinite): where the
// tensor-core kernel left the flag at 0 its blocks return before writing anything; where it set
// it, the call is recomputed, bitwise as a plain fallback call, hidden non-finite inputs kept to
// the rows that see them (checked against the CPU op).
TEST(EmulatedGuard, ForwardRecomputesOnlyFlaggedCalls) {
  Case c = mk("bf16_guard_hidden_nonfinite", at::kBFloat16, 70, 70, 64);
  c.causal = true, c.hidden_nonfinite = true, c.H = 2, c.Hkv = 1, c.mask = MaskType::kAdditive;
  const Inputs in = make_inputs(c);
  const entropy_attn::AttentionCall call = prepared_call(c, in);
  const ec::ForwardCall plain(in.q, in.k, in.v, call);
  launch_forward<__nv_bfloat16>(plain.params<float>());

  const ec::ForwardCall guarded(in.q, in.k, in.v, call);
  const auto& [out, lse, entropy, sum_p2, max_weight, n_keys, row_scale, length_factor,
               normalized_entropy, sparsity, effective_keys] = guarded.outputs;
  for (const at::Tensor& t : {out, lse, entropy, effective_keys}) t.fill_(7);
  int flag = 0;
  ec::FwdParams<float> p = guarded.params<float>();
  p.nonfinite = &flag;
  launch_forward<__nv_bfloat16>(p);
  for (const at::Tensor& t : {out, lse, entropy, effective_keys}) {
    EXPECT_TRUE(at::equal(t, at::full_like(t, 7))) << "a block ran with the flag at 0";
  }
  flag = 1;
  launch_forward<__nv_bfloat16>(p);
  const auto& plain_out = plain.outputs;
  EXPECT_TRUE(at::allclose(out, std::get<0>(plain_out), 0, 0, /*equal_nan=*/true));
  EXPECT_TRUE(at::allclose(lse, std::get<1>(plain_out), 0, 0, /*equal_nan=*/true));
  EXPECT_TRUE(at::allclose(entropy, std::get<2>(plain_out), 0, 0, /*equal_nan=*/true));
  const entropy_attn::AttentionResult r = entropy_attn::attention(
      in.q, in.k, in.v, in.mask, in.scale, c.causal, c.scale_factor, c.mode, c.temperature,
      c.log_base, /*enable_gqa=*/true, /*return_stats=*/true, window(c), alignment(c), c.softcap,
      in.sinks, c.dropout_p, c.dropout_seed);
  const Tolerances tol = tolerances(c.dtype);
  expect_close(out, r.output, tol.out, "output");
  expect_close(lse, r.lse, tol.stats, "lse");
  expect_close(entropy, r.entropy, tol.stats, "entropy");
}

// A bf16 call's emulated forward, its backward by a plain fallback call, and by the fallback as the
// guard of a tensor-core backward (the family's outputs, filled with 7 beforehand; G with 5, as a
// tensor-core backward leaves it): first with the flag at 0, which must write nothing, then at 1
// (the main kernel on at most max_blocks blocks where that is positive); d lambda where grad_scale
// asks for it; with grad_mask, the additive mask's gradient (its accumulator filled with 5 too, as
// the sm80 backward leaves it).
struct GuardRun {
  AttentionOutputs fwd;
  entropy_attn::AttentionGrads plain, guarded;
  int64_t guard_row_blocks;               // the grid of the guard's preprocess and postprocess
  ec::BwdParams<float> guard_params;      // (its pointers dangle: for the grids only)
  at::Tensor plain_dmask, guarded_dmask;  // with grad_mask
  // Under deterministic algorithms, the fallback's turn counters after each backward (params.h:
  // tile_turns); else undefined.
  at::Tensor plain_turns, guarded_turns;
};

GuardRun run_backward_guard(const Case& c, const Inputs& in, int64_t max_blocks = 0,
                            bool grad_scale = true, bool grad_mask = false) {
  const entropy_attn::AttentionCall call = prepared_call(c, in);
  const ec::ForwardCall fwd(in.q, in.k, in.v, call);
  launch_forward<__nv_bfloat16>(fwd.params<float>());
  const auto& [out, lse, entropy, sum_p2, max_weight, n_keys, row_scale, length_factor,
               normalized_entropy, sparsity, effective_keys] = fwd.outputs;
  // (A call each: a call holds the mask's gradient accumulator.)
  const auto backward_call = [&] {
    return entropy_attn::prepare_attention_backward(
        in.dout, in.g_lse, in.g_entropy, in.g_sum_p2, in.q, in.k, in.v, in.mask, out, lse, entropy,
        sum_p2, row_scale, in.sinks, documents(in), options(c), grad_mask, grad_scale);
  };

  ec::BackwardCall plain(in.dout, in.q, in.k, in.v, out, backward_call());
  plain.allocate(ec::Family::kFallback);
  launch_backward<__nv_bfloat16>(plain.params<float>());

  ec::BackwardCall guarded(in.dout, in.q, in.k, in.v, out, backward_call());
  guarded.allocate(ec::Family::kSm80);
  EXPECT_EQ(guarded.dk.size(1), c.Hkv);  // the family's outputs: per key/value head
  EXPECT_EQ(guarded.dlam.defined(), grad_scale);
  for (at::Tensor t : {guarded.dq, guarded.dk, guarded.dv, guarded.dlam}) {
    if (t.defined()) t.fill_(7);
  }
  guarded.g.fill_(5);
  const at::Tensor& d_logits = guarded.call.grad_logits;
  EXPECT_EQ(d_logits.defined(), grad_mask);
  if (grad_mask) d_logits.fill_(5);
  int flag = 0;
  ec::BwdParams<float> p = guarded.params<float>();
  p.nonfinite = &flag;
  launch_backward<__nv_bfloat16>(p);
  for (const at::Tensor& t :
       {guarded.dq, guarded.dk, guarded.dv, guarded.dlam, d_logits, guarded.tile_turns}) {
    if (t.defined()) {
      const int fill = t.is_same(d_logits) ? 5 : t.is_same(guarded.tile_turns) ? 0 : 7;
      EXPECT_TRUE(at::equal(t, at::full_like(t, fill))) << "a block ran with the flag at 0";
    }
  }
  flag = 1;
  launch_backward<__nv_bfloat16>(p, emulated::kEveryKernelFits, max_blocks);
  GuardRun run{fwd.outputs, plain.finish(), guarded.finish(), ef::preprocess_blocks(p), p};
  run.plain_turns = plain.tile_turns, run.guarded_turns = guarded.tile_turns;
  if (grad_mask) {
    run.plain_dmask = entropy_attn::mask_grad(in.mask, plain.call, in.q);
    run.guarded_dmask = entropy_attn::mask_grad(in.mask, guarded.call, in.q);
  }
  return run;
}

void expect_grads_close(const entropy_attn::AttentionGrads& got,
                        const entropy_attn::AttentionGrads& want, double tol, const char* what) {
  const auto& [dq, dk, dv, dlam] = got;
  const auto& [wdq, wdk, wdv, wdlam] = want;
  expect_close(dq, wdq, tol, std::string("grad_query vs ") + what);
  expect_close(dk, wdk, tol, std::string("grad_key vs ") + what);
  expect_close(dv, wdv, tol, std::string("grad_value vs ") + what);
  if (wdlam.defined()) {
    expect_close(dlam, wdlam, tol, std::string("grad_row_scale vs ") + what);
  } else {
    EXPECT_FALSE(dlam.defined()) << "grad_row_scale not asked for, vs " << what;
  }
}

// With the flag set the guard writes dk, dv summed over a GQA group by one block and dq, d lambda
// by its postprocess, from a G it zero-fills itself: equal to a plain fallback call's gradients
// and to the CPU op's, hidden non-finite inputs kept to what sees them. The inputs are views of
// (B, L, H, D) memory, as projections split into heads give, so the guard writes the gradients in
// that layout (attention_call.h: empty_in_layout_of).
TEST(EmulatedGuard, BackwardRecomputesOnlyFlaggedCalls) {
  Case c = mk("bf16_guard_bwd_hidden_nonfinite", at::kBFloat16, 70, 70, 64);
  c.causal = true, c.hidden_nonfinite = true, c.H = 4, c.Hkv = 2, c.mask = MaskType::kBool;
  Inputs in = make_inputs(c);
  // An infinite dO entry in the second query head of the second group (make_inputs puts its
  // entries in head 0, whose NaN rows cover every key of group 0): the grouped blocks must add it
  // back from head 3's rows, making column 2 of dV infinite exactly for the keys row 30 sees.
  in.dout.select(0, 0).select(0, 3).select(0, 30).select(0, 2).fill_(
      std::numeric_limits<double>::infinity());
  for (at::Tensor* t : {&in.q, &in.k, &in.v, &in.dout}) {
    *t = t->transpose(1, 2).contiguous().transpose(1, 2);
  }
  const GuardRun run = run_backward_guard(c, in);
  const Tolerances tol = tolerances(c.dtype);
  expect_grads_close(run.guarded, run.plain, tol.grad, "plain fallback");
  for (const at::Tensor& g : {std::get<0>(run.guarded), std::get<1>(run.guarded),
                              std::get<2>(run.guarded), std::get<0>(run.plain)}) {
    EXPECT_TRUE(g.transpose(1, 2).is_contiguous() && !g.is_contiguous()) << "a gradient's layout";
  }
  expect_matches_cpu_op(c, in, run.fwd, run.guarded, at::Tensor(), tol);
  EXPECT_GT(std::get<2>(run.guarded).select(1, 1).select(-1, 2).isinf().sum().item<int64_t>(), 0)
      << "no infinite dV entry from head 3's dO";
}

// The additive mask's gradient, which the sm80 backward adds into before its guard runs: the guard
// zeroes it (its preprocess) and adds its own, equal to a plain fallback call's and the CPU op's (a
// (Lq, Lk) mask shared by the batch and the heads, a NaN key it hides).
TEST(EmulatedGuard, BackwardRecomputesTheMaskGradient) {
  Case c = mk("bf16_guard_bwd_mask_grad", at::kBFloat16, 70, 90, 64);
  c.causal = true, c.hidden_nonfinite = true, c.H = 4, c.Hkv = 2, c.mask = MaskType::kAdditiveQK;
  const Inputs in = make_inputs(c);
  ASSERT_TRUE(additive_mask(in));
  const GuardRun run = run_backward_guard(c, in, 0, true, /*grad_mask=*/true);
  const Tolerances tol = tolerances(c.dtype);
  expect_grads_close(run.guarded, run.plain, tol.grad, "plain fallback");
  expect_close(run.guarded_dmask, run.plain_dmask, tol.grad, "grad_attn_mask vs plain fallback");
  expect_matches_cpu_op(c, in, run.fwd, run.guarded, run.guarded_dmask, tol);
}

// The guard's per-row kernels (preprocess, postprocess) take a capped grid whose warps stride over
// the rows (fallback::kGuardRowBlocks): with more rows than the grid has warps, every row's dq and
// d lambda still equal a plain fallback call's.
TEST(EmulatedGuard, BackwardRowsBeyondTheCappedGrid) {
  Case c = mk("bf16_guard_bwd_many_rows", at::kBFloat16, 4100, 8, 64);
  c.H = 2, c.Hkv = 1;
  ASSERT_GT(c.B * c.H * c.Lq, ef::kGuardRowBlocks * ef::kWarps);
  const GuardRun run = run_backward_guard(c, make_inputs(c));
  ASSERT_EQ(run.guard_row_blocks, ef::kGuardRowBlocks);
  expect_grads_close(run.guarded, run.plain, tolerances(c.dtype).grad, "plain fallback");
}

// Without d lambda asked for (grad_scale=False: a null d_row_scale) the guard's postprocess writes
// dq alone, equal to a plain fallback call's, which forms it on the host.
TEST(EmulatedGuard, BackwardWithoutDLambda) {
  Case c = mk("bf16_guard_bwd_without_dlambda", at::kBFloat16, 70, 90, 64);
  c.causal = true, c.H = 4, c.Hkv = 2;
  const GuardRun run = run_backward_guard(c, make_inputs(c), 0, /*grad_scale=*/false);
  expect_grads_close(run.guarded, run.plain, tolerances(c.dtype).grad, "plain fallback");
}

// The grids of the fallback's tile kernels (nonfinite_rows.cuh: tile_grid): a block per tile in a
// plain call, at most kGuardTileBlocks as a guard (the forward's with the flag's pointer set, the
// backward's main kernel grouped over a GQA group: per key/value head).
TEST(EmulatedGuard, TileKernelGrids) {
  int flag = 0;
  ec::FwdParams<float> f;
  f.batch = 2, f.heads = 3, f.kv_heads = 1, f.q_len = 64 * 100;
  using F = ef::FwdLayout<__nv_bfloat16, 64>;
  EXPECT_EQ(F::grid(f), 600);
  f.nonfinite = &flag;
  EXPECT_EQ(F::blocks(f), 600);
  EXPECT_EQ(F::grid(f), ef::kGuardTileBlocks);
  f.q_len = 64 * 80;
  EXPECT_EQ(F::grid(f), 480);  // fewer tiles than the cap: one block each
  ec::BwdParams<float> b;
  b.batch = 1, b.heads = 4, b.kv_heads = 2, b.kv_len = 32 * 300;
  using B = ef::BwdLayout<__nv_bfloat16, 64>;
  EXPECT_EQ(B::grid(b), 1200);
  b.dk_out.data = &flag, b.nonfinite = &flag;
  EXPECT_EQ(B::blocks(b), 600);
  EXPECT_EQ(B::grid(b), ef::kGuardTileBlocks);
}

// Where the guard's grid has fewer blocks than there are tiles, they stride over the tiles: a
// flagged call is recomputed as a plain fallback call, bitwise in the forward (16 query tiles on 3
// blocks: GQA, causal), to the gradients' tolerance in the backward (14 key tiles of key/value
// heads on 3 blocks, each summing its GQA group).
TEST(EmulatedGuard, ForwardBlocksStrideOverTheTiles) {
  Case c = mk("bf16_guard_fwd_strided", at::kBFloat16, 200, 90, 64);
  c.B = 2, c.H = 2, c.Hkv = 1, c.causal = true;
  const Inputs in = make_inputs(c);
  const entropy_attn::AttentionCall call = prepared_call(c, in);
  const ec::ForwardCall plain(in.q, in.k, in.v, call);
  launch_forward<__nv_bfloat16>(plain.params<float>());
  const ec::ForwardCall guarded(in.q, in.k, in.v, call);
  int flag = 1;
  ec::FwdParams<float> p = guarded.params<float>();
  p.nonfinite = &flag;
  ASSERT_EQ((ef::FwdLayout<__nv_bfloat16, 64>::blocks(p)), 16);
  launch_forward<__nv_bfloat16>(p, /*max_blocks=*/3);
  const auto& [out, lse, entropy, sum_p2, max_weight, n_keys, row_scale, length_factor,
               normalized_entropy, sparsity, effective_keys] = guarded.outputs;
  const auto& want = plain.outputs;
  EXPECT_TRUE(at::equal(out, std::get<0>(want))) << "output";
  EXPECT_TRUE(at::equal(lse, std::get<1>(want))) << "lse";
  EXPECT_TRUE(at::equal(entropy, std::get<2>(want))) << "entropy";
  EXPECT_TRUE(at::equal(n_keys, std::get<5>(want))) << "n_keys";
}

TEST(EmulatedGuard, BackwardBlocksStrideOverTheTiles) {
  Case c = mk("bf16_guard_bwd_strided", at::kBFloat16, 40, 200, 64);
  c.H = 4, c.Hkv = 2, c.causal = true, c.bottom_right = true;
  const GuardRun run = run_backward_guard(c, make_inputs(c), /*max_blocks=*/3);
  ASSERT_EQ((ef::BwdLayout<__nv_bfloat16, 64>::blocks(run.guard_params)), 14);
  expect_grads_close(run.guarded, run.plain, tolerances(c.dtype).grad, "plain fallback");
}

// ---------------------------------------------------------------------------------------------
// The deterministic backward (fallback/turns.cuh): under deterministic algorithms the key tiles add
// into each query tile's G in their order, and a broadcast mask's gradient is written at the call's
// full shape (attention_cuda.cpp: run_backward, mirrored below).
// ---------------------------------------------------------------------------------------------

// torch.use_deterministic_algorithms(on) for a scope, the setting restored after.
class DeterministicAlgorithms {
 public:
  explicit DeterministicAlgorithms(bool on) {
    at::globalContext().setDeterministicAlgorithms(on, false);
  }
  ~DeterministicAlgorithms() { at::globalContext().setDeterministicAlgorithms(saved_, warn_only_); }
  DeterministicAlgorithms(const DeterministicAlgorithms&) = delete;
  DeterministicAlgorithms& operator=(const DeterministicAlgorithms&) = delete;

 private:
  bool saved_ = at::globalContext().deterministicAlgorithms();
  bool warn_only_ = at::globalContext().deterministicAlgorithmsWarnOnly();
};

// The key tiles of `tile` keys whose walk (bwd_kernel.cuh: from the first query tile whose last
// row's keys end past the key tile's start, until one whose first row's keys start at its end or
// later) takes the query tile of `tile` rows from row i0: the count its turn counter must end at.
template <typename Acc>
int64_t walkers(const ec::BwdParams<Acc>& p, int64_t i0, int64_t tile) {
  const int64_t last = std::min(i0 + tile, p.q_len) - 1;
  const int64_t lo = p.pattern.keys(i0, p.q_len, p.kv_len).lo;
  const int64_t hi = p.pattern.keys(last, p.q_len, p.kv_len).hi;
  int64_t n = 0;
  for (int64_t j0 = 0; j0 < p.kv_len; j0 += tile) {
    if (hi > j0 && lo < std::min(j0 + tile, p.kv_len)) ++n;
  }
  return n;
}

struct BackwardRun {
  entropy_attn::AttentionGrads grads;
  at::Tensor dmask;  // the additive mask's gradient, where it has one
  at::Tensor turns;  // the turn counters after the backward (deterministic only)
  std::vector<int64_t> expected_turns;
};

// A case's emulated forward, then its backward with deterministic algorithms off and on.
template <typename T>
std::array<BackwardRun, 2> run_deterministic_typed(const Case& c) {
  using Acc = ec::AccType<T>;
  const Inputs in = make_inputs(c);
  entropy_attn::AttentionCall call = prepared_call(c, in);
  if (c.mask_keeps_dtype) call.mask = kept_mask(in, call.shape, call.acc);
  const ec::ForwardCall fwd(in.q, in.k, in.v, call);
  launch_forward<T>(fwd.params<Acc>());
  const auto& [out, lse, entropy, sum_p2, max_weight, n_keys, row_scale, length_factor,
               normalized_entropy, sparsity, effective_keys] = fwd.outputs;
  std::array<BackwardRun, 2> runs;
  for (const bool deterministic : {false, true}) {
    const DeterministicAlgorithms scope(deterministic);
    entropy_attn::AttentionBackwardCall bcall = entropy_attn::prepare_attention_backward(
        in.dout, stat_grad(c, in.g_lse), stat_grad(c, in.g_entropy), stat_grad(c, in.g_sum_p2),
        in.q, in.k, in.v, in.mask, out, lse, entropy, sum_p2, row_scale, in.sinks, documents(in),
        options(c), /*grad_mask=*/additive_mask(in), /*grad_scale=*/true);
    if (c.mask_keeps_dtype) bcall.mask = kept_mask(in, bcall.shape, bcall.acc);
    ec::BackwardCall bwd(in.dout, in.q, in.k, in.v, out, bcall);
    const at::Tensor mask_shaped = deterministic ? ec::use_full_mask_grad(bwd.call) : at::Tensor();
    bwd.allocate(ec::Family::kFallback);
    const ec::BwdParams<Acc> p = bwd.params<Acc>();
    EXPECT_EQ(p.tile_turns != nullptr, deterministic) << "the turn counters";
    launch_backward<T>(p, c.smem_optin);
    if (mask_shaped.defined()) ec::sum_full_mask_grad(bwd.call, mask_shaped);
    BackwardRun& run = runs[deterministic];
    run.grads = bwd.finish();
    if (additive_mask(in)) run.dmask = entropy_attn::mask_grad(in.mask, bcall, in.q);
    if (!deterministic) continue;
    run.turns = bwd.tile_turns.flatten();
    const int64_t tile = backward_tile_rows<T>(p, c.smem_optin);
    run.expected_turns.assign(static_cast<size_t>(run.turns.numel()), 0);
    for (int64_t bh = 0; bh < p.batch * p.heads; ++bh) {
      for (int64_t i0 = 0; i0 < p.q_len; i0 += tile) {
        run.expected_turns[static_cast<size_t>(bh * p.q_len + i0)] = walkers(p, i0, tile);
      }
    }
  }
  return runs;
}

// The same bits (NaN included) in two tensors of one dtype.
bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() || !b.defined()) return a.defined() == b.defined();
  if (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type()) return false;
  const at::Tensor x = a.contiguous(), y = b.contiguous();
  return std::memcmp(x.const_data_ptr(), y.const_data_ptr(), x.nbytes()) == 0;
}

// Under deterministic algorithms every key tile takes its turn (the emulation reports a block that
// waits for a count the tiles before it did not leave: on a GPU a hang, or a sum out of order), the
// counters end at the number of key tiles that walk each query tile, and the gradients are those of
// the default backward, bit for bit (the emulation runs the blocks in launch order, so their
// atomics come in the turns' order there too: that the turns fix the order on a GPU, where blocks
// run side by side, is test_cuda.py's test_fallback_deterministic_backward); the mask's gradient,
// summed from the full shape, to rounding.
void run_deterministic(const Case& c) {
  std::array<BackwardRun, 2> runs;
  with_input_type(c.dtype, [&](auto t) { runs = run_deterministic_typed<decltype(t)>(c); });
  if (::testing::Test::HasFatalFailure()) return;
  const auto& [plain, det] = runs;
  const std::vector<int> turns(det.turns.const_data_ptr<int>(),
                               det.turns.const_data_ptr<int>() + det.turns.numel());
  ASSERT_EQ(turns.size(), det.expected_turns.size());
  for (size_t i = 0; i < turns.size(); ++i) {
    ASSERT_EQ(turns[i], det.expected_turns[i]) << "the turn counter of row " << i;
  }
  const char* names[] = {"grad_query", "grad_key", "grad_value", "grad_row_scale"};
  const auto& [dq, dk, dv, dlam] = det.grads;
  const auto& [pdq, pdk, pdv, pdlam] = plain.grads;
  const at::Tensor got[] = {dq, dk, dv, dlam}, want[] = {pdq, pdk, pdv, pdlam};
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(same_bits(got[i], want[i])) << names[i];
  if (plain.dmask.defined()) {
    ASSERT_TRUE(det.dmask.defined());
    expect_close(det.dmask, plain.dmask, tolerances(c.dtype).grad, "grad_attn_mask");
  }
}

// Cases over several key tiles, with each feature that moves a walk's bounds or adds into G outside
// the products: causality either way, windows, rows that see no key, packed documents (key tiles
// of a document without queries between two that walk one query tile), GQA, sinks, dropout,
// softcap, broadcast additive masks with their gradient, hidden non-finite keys (whose terms the
// key tile adds back into G), float64, 16-bit inputs and the compact tiles.
const std::set<std::string>& deterministic_case_names() {
  static const std::set<std::string> names = {"f32_lq1_lk130",
                                              "f32_causal_br_97x17",
                                              "f32_causal_130x130_d100",
                                              "f32_window_causal_130x130_d100",
                                              "f32_window_br_97x65_logn",
                                              "f32_window_right_tl_65x33_additive",
                                              "f32_additive_mask_keys",
                                              "f32_additive_mask_masked_rows",
                                              "f32_additive_mask_qk_logn",
                                              "f32_gqa",
                                              "f32_hidden_nonfinite",
                                              "f32_sinks_window_br_softcap_gqa",
                                              "f32_dropout_window_sinks_gqa",
                                              "f32_docs_causal_br",
                                              "f32_docs_window_seqused_softcap",
                                              "f32_docs_dropout_sinks",
                                              "f64_causal_130x65_logn_sharpen",
                                              "f64_softcap_causal_gqa",
                                              "f16_d40_130x130_causal_additive",
                                              "bf16_d256_99KB_causal_window_sinks",
                                              "bf16_d256_99KB_dropout_docs"};
  return names;
}

std::vector<Case> deterministic_cases() {
  std::vector<Case> v;
  for (const Case& c : attention_cases()) {
    if (deterministic_case_names().count(c.name) != 0) v.push_back(c);
  }
  return v;
}

TEST(EmulatedDeterministicCases, EveryNamedCaseExists) {
  EXPECT_EQ(deterministic_cases().size(), deterministic_case_names().size());
}

class EmulatedDeterministicBackward : public ::testing::TestWithParam<Case> {};

TEST_P(EmulatedDeterministicBackward, KeyTilesAddInTurns) { run_deterministic(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Cases, EmulatedDeterministicBackward,
                         ::testing::ValuesIn(deterministic_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return info.param.name;
                         });

// The guard of a tensor-core backward under deterministic algorithms: BackwardCall::allocate gives
// the tensor-core call the fallback's counters too (params.h: tile_turns), the guard's main kernel
// then takes a block per tile (not the capped grid, whose blocks stride over the tiles and could
// wait for a tile that a waiting block holds), an idle guard leaves the counters at 0
// (run_backward_guard), and a flagged one takes the turns a plain fallback call takes (its blocks
// walk the heads of their GQA group in one order): the same final counts, the same gradients to
// rounding, hidden non-finite inputs kept to what sees them. A wrong turn is reported by the
// emulation (a hang on a GPU).
TEST(EmulatedGuard, DeterministicBackwardTakesTurns) {
  const DeterministicAlgorithms deterministic(true);
  Case c = mk("bf16_guard_bwd_deterministic", at::kBFloat16, 70, 70, 64);
  c.causal = true, c.hidden_nonfinite = true, c.window_left = 20, c.H = 4, c.Hkv = 2;
  c.mask = MaskType::kAdditiveQK;
  const GuardRun run = run_backward_guard(c, make_inputs(c), 0, true, /*grad_mask=*/true);
  using L = ef::BwdLayout<__nv_bfloat16, 64>;
  EXPECT_EQ(L::grid(run.guard_params), L::blocks(run.guard_params)) << "a capped grid";
  ASSERT_TRUE(run.plain_turns.defined() && run.guarded_turns.defined());
  EXPECT_GT(run.plain_turns.sum().item<int64_t>(), 0) << "no turn taken";
  EXPECT_TRUE(at::equal(run.guarded_turns, run.plain_turns)) << "the guard's turns";
  const Tolerances tol = tolerances(c.dtype);
  expect_grads_close(run.guarded, run.plain, tol.grad, "plain fallback");
  expect_close(run.guarded_dmask, run.plain_dmask, tol.grad, "grad_attn_mask vs plain fallback");
}

class EmulatedAttention : public ::testing::TestWithParam<Case> {};

TEST_P(EmulatedAttention, ForwardAndBackwardMatchFloat64Reference) { run_case(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Cases, EmulatedAttention, ::testing::ValuesIn(attention_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return info.param.name;
                         });

// ---------------------------------------------------------------------------------------------
// attention_sparsity (the forward's structure without values)
// ---------------------------------------------------------------------------------------------

template <typename T>
void run_sparsity_typed(const Case& c, const std::string& kind) {
  const Inputs in = make_inputs(c);
  entropy_attn::AttentionCall prepared = entropy_attn::prepare_attention(
      in.q, in.k, in.k, in.mask, in.scale, std::nullopt, documents(in), options(c));
  if (c.mask_keeps_dtype) prepared.mask = kept_mask(in, prepared.shape, prepared.acc);
  const ec::SparsityCall call(in.q, in.k, entropy_attn::parse_sparsity_kind(kind), prepared);
  launch_sparsity<T>(call.params<ec::AccType<T>>());
  if (::testing::Test::HasFatalFailure()) return;
  const double tol = c.dtype == at::kDouble ? 1e-11 : 2e-5;  // float32 accumulation from here on
  expect_close(call.out, reference_sparsity(c, in, kind), tol, "attention_sparsity " + kind);
}

void run_sparsity(const Case& c) {
  for (const std::string kind : {"exp", "relu2", "identity"}) {
    SCOPED_TRACE(kind);
    switch (c.dtype) {
      case at::kFloat:
        run_sparsity_typed<float>(c, kind);
        break;
      case at::kDouble:
        run_sparsity_typed<double>(c, kind);
        break;
      case at::kHalf:
        run_sparsity_typed<__half>(c, kind);
        break;
      case at::kBFloat16:
        run_sparsity_typed<__nv_bfloat16>(c, kind);
        break;
      default:
        FAIL() << "dtype";
    }
  }
}

std::vector<Case> sparsity_cases() {
  std::vector<Case> v;
  Case c = mk("f32_d8_65x97", at::kFloat, 65, 97, 8);
  v.push_back(c);
  c = mk("f32_d100_causal_bool_mask", at::kFloat, 33, 65, 100), c.causal = true;
  c.mask = MaskType::kBool, c.masked_rows = true, c.mode = "logn", v.push_back(c);
  c = mk("f32_gqa_additive_keys", at::kFloat, 17, 33, 8), c.H = 4, c.Hkv = 2;
  c.mask = MaskType::kAdditiveKeys, c.masked_rows = true, c.scale_tensor = true, v.push_back(c);
  c = mk("f32_lk0", at::kFloat, 5, 0, 8), v.push_back(c);
  c = mk("f32_nan_row", at::kFloat, 17, 33, 8), c.nan_row = true, v.push_back(c);
  c = mk("f64_d64_causal_97x17", at::kDouble, 97, 17, 64), c.causal = true;
  c.temperature = 0.5, v.push_back(c);
  c = mk("f16_d256_noncontig", at::kHalf, 17, 33, 256), c.noncontig = true, v.push_back(c);
  c = mk("bf16_d128_causal", at::kBFloat16, 33, 33, 128), c.causal = true, v.push_back(c);
  // A 16-bit additive mask read as it is (MaskElem), per key with masked rows and transposed.
  c = mk("bf16_gqa_additive_keys_in_bf16", at::kBFloat16, 17, 33, 64), c.H = 4, c.Hkv = 2;
  c.mask = MaskType::kAdditiveKeys, c.masked_rows = true, c.mask_keeps_dtype = true;
  v.push_back(c);
  c = mk("f16_additive_qk_transposed_in_f16", at::kHalf, 33, 17, 64), c.causal = true;
  c.mask = MaskType::kAdditiveQK, c.mask_transposed = true, c.mask_keeps_dtype = true;
  v.push_back(c);
  // Windows, alignments, softcap.
  c = mk("f32_window_br_softcap_logn", at::kFloat, 65, 97, 8), c.window_left = 6;
  c.window_right = 2, c.bottom_right = true, c.softcap = 2, c.scale_factor = 1.5;
  c.mode = "logn", v.push_back(c);
  c = mk("f32_causal_br_97x33_mask", at::kFloat, 97, 33, 8), c.causal = true;
  c.bottom_right = true, c.mask = MaskType::kBool, c.masked_rows = true, v.push_back(c);
  c = mk("f64_window_tl_softcap", at::kDouble, 33, 65, 64), c.window_left = 10;
  c.window_right = 0, c.softcap = 1, v.push_back(c);
  c = mk("bf16_d128_window_tl", at::kBFloat16, 65, 33, 128), c.window_left = 10, v.push_back(c);
  return v;
}

class EmulatedAttentionSparsity : public ::testing::TestWithParam<Case> {};

TEST_P(EmulatedAttentionSparsity, MatchesFloat64Reference) { run_sparsity(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Cases, EmulatedAttentionSparsity, ::testing::ValuesIn(sparsity_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return info.param.name;
                         });

// ---------------------------------------------------------------------------------------------
// Row reductions
// ---------------------------------------------------------------------------------------------

template <typename T>
void run_row_reductions(at::ScalarType dtype) {
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  const double tol = dtype == at::kDouble ? 1e-12 : dtype == at::kFloat ? 1e-5 : 1e-2;
  for (const int64_t dim : {-1, 1}) {
    at::manual_seed(7);
    // Normalized rows along `dim` (with exact zeros), 3 x 37 x 5, and an all-zero row.
    at::Tensor x = at::softmax(at::randn({3, 37, 5}, f64) * 2, dim);
    x = at::where(at::rand({3, 37, 5}, f64) < 0.2, at::zeros_like(x), x);
    x.select(0, 1).select(dim == 1 ? 1 : 0, 2).zero_();
    const at::Tensor xt = x.to(dtype);
    const at::Tensor xd = xt.to(at::kDouble);
    const at::Tensor h_ref = -(xd * at::where(xd > 0, xd, at::ones_like(xd)).log()).sum(dim);
    const at::Tensor l1 = xd.abs().sum(dim), l2 = (xd * xd).sum(dim);
    const double n = static_cast<double>(xd.size(dim));
    const at::Tensor s_ref = at::where(l2 > 0, l1 / (n * l2).sqrt(), at::zeros_like(l1));

    const ec::RowReductionCall he = ec::prepare_row_reduction(xt, dim, "entropy");
    emulate_launch(ef::row_entropy_kernel<T>, ef::row_reduction_blocks(he.params()), 0,
                   he.params());
    EXPECT_EQ(he.out.scalar_type(), dtype);
    expect_close(he.out, h_ref, tol, "row entropy, dim " + std::to_string(dim));

    const ec::RowReductionCall hs = ec::prepare_row_reduction(xt, dim, "sparsity");
    emulate_launch(ef::row_sparsity_kernel<T>, ef::row_reduction_blocks(hs.params()), 0,
                   hs.params());
    expect_close(hs.out, s_ref, tol, "row sparsity, dim " + std::to_string(dim));
  }
  // Rows of length 0: entropy 0, sparsity 0.
  const at::Tensor empty = at::zeros({3, 0}, f64).to(dtype);
  const ec::RowReductionCall e = ec::prepare_row_reduction(empty, -1, "entropy");
  emulate_launch(ef::row_entropy_kernel<T>, ef::row_reduction_blocks(e.params()), 0, e.params());
  expect_close(e.out, at::zeros({3}, f64), 0, "row entropy of empty rows");
  const ec::RowReductionCall s = ec::prepare_row_reduction(empty, -1, "sparsity");
  emulate_launch(ef::row_sparsity_kernel<T>, ef::row_reduction_blocks(s.params()), 0, s.params());
  expect_close(s.out, at::zeros({3}, f64), 0, "row sparsity of empty rows");
}

// Rows of 2^20 float32 entries: each lane adds 2^15 terms, whose float32 running sums drifted (a
// uniform row's entropy came out 0.6% above its maximum ln n on the CPU before it summed in
// double); the kernels sum in double, as the CPU's do.
TEST(EmulatedRowReductions, LongFloat32RowsSumInDouble) {
  const int64_t n = int64_t{1} << 20;
  const at::Tensor uniform = at::full({1, n}, 1.0 / static_cast<double>(n), at::kFloat);
  const ec::RowReductionCall h = ec::prepare_row_reduction(uniform, -1, "entropy");
  emulate_launch(ef::row_entropy_kernel<float>, ef::row_reduction_blocks(h.params()), 0,
                 h.params());
  expect_close(h.out, at::full({1}, std::log(static_cast<double>(n)), at::kDouble), 1e-6,
               "entropy of a uniform row of 2^20");

  at::manual_seed(0);
  const at::Tensor a = at::rand({1, n}, at::kFloat);
  const at::Tensor ad = a.to(at::kDouble);
  const at::Tensor exact = ad.sum(-1) / (static_cast<double>(n) * ad.square().sum(-1)).sqrt();
  const ec::RowReductionCall s = ec::prepare_row_reduction(a, -1, "sparsity");
  emulate_launch(ef::row_sparsity_kernel<float>, ef::row_reduction_blocks(s.params()), 0,
                 s.params());
  expect_close(s.out, exact, 1e-6, "sparsity of a random row of 2^20");
}

TEST(EmulatedRowReductions, Float32) { run_row_reductions<float>(at::kFloat); }
TEST(EmulatedRowReductions, Float64) { run_row_reductions<double>(at::kDouble); }
TEST(EmulatedRowReductions, Float16) { run_row_reductions<__half>(at::kHalf); }
TEST(EmulatedRowReductions, BFloat16) { run_row_reductions<__nv_bfloat16>(at::kBFloat16); }

// ---------------------------------------------------------------------------------------------
// The emulation itself: shuffles, barriers, atomics and the checks that report GPU bugs.
// ---------------------------------------------------------------------------------------------

struct SelfTestParams {
  int64_t* out = nullptr;
  double* sum = nullptr;
  int mode = 0;
};

__global__ void self_test_kernel(const SelfTestParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t gid = static_cast<int64_t>(blockIdx.x) * 128 + threadIdx.x;
  if (p.mode == 0) {
    // xor shuffles of every width, a block-wide exchange through shared memory, atomics.
    int64_t x = gid;
    for (int o = 1; o < 32; o <<= 1) x += 1000 * __shfl_xor_sync(0xffffffffu, lane, o);
    int* s = reinterpret_cast<int*>(entropy_attn::cuda::fallback::smem);
    s[threadIdx.x] = static_cast<int>(gid);
    __syncthreads();
    p.out[gid] = x + 1000000 * static_cast<int64_t>(s[127 - threadIdx.x]);
    atomicAdd(p.sum, 0.5);
  } else if (p.mode == 1) {
    // Divergent shuffles: half a warp exchanges with lane ^ 1, the other half with lane ^ 2.
    p.out[gid] = __shfl_xor_sync(0xffffffffu, lane, lane < 16 ? 1 : 2);
  } else if (p.mode == 2) {
    // A shuffle after half of the warp returned.
    if (lane >= 16) return;
    p.out[gid] = __shfl_xor_sync(0xffffffffu, lane, 1);
  } else if (p.mode == 3) {
    // A deadlock: half of each warp waits at a shuffle, the other half at __syncthreads().
    if (lane < 16) p.out[gid] = __shfl_xor_sync(0xffffffffu, lane, 1);
    __syncthreads();
  }
}

TEST(CudaEmulation, ShufflesBarriersAtomics) {
  std::vector<int64_t> out(3 * 128, -1);
  double sum = 0;
  emulate_launch(self_test_kernel, 3, 128 * sizeof(int), SelfTestParams{out.data(), &sum, 0});
  for (int64_t gid = 0; gid < 3 * 128; ++gid) {
    const int lane = static_cast<int>(gid % 32), t = static_cast<int>(gid % 128);
    int64_t x = gid;
    for (int o = 1; o < 32; o <<= 1) x += 1000 * (lane ^ o);
    x += 1000000 * (gid - t + 127 - t);
    EXPECT_EQ(out[gid], x) << "thread " << gid;
  }
  EXPECT_EQ(sum, 0.5 * 3 * 128);
}

TEST(CudaEmulation, ReportsDivergenceAndDeadlocks) {
  std::vector<int64_t> out(128);
  double sum = 0;
  EXPECT_THROW(emulate_launch(self_test_kernel, 1, 0, SelfTestParams{out.data(), &sum, 1}),
               cuda_emu::CudaEmulationError);
  EXPECT_THROW(emulate_launch(self_test_kernel, 1, 0, SelfTestParams{out.data(), &sum, 2}),
               cuda_emu::CudaEmulationError);
  try {
    emulate_launch(self_test_kernel, 2, 0, SelfTestParams{out.data(), &sum, 3});
    ADD_FAILURE() << "no deadlock reported";
  } catch (const cuda_emu::CudaEmulationError& e) {
    EXPECT_NE(std::string(e.what()).find("deadlock in block 0"), std::string::npos) << e.what();
  }
  // The emulation is usable after a deadlock.
  emulate_launch(self_test_kernel, 1, 128 * sizeof(int), SelfTestParams{out.data(), &sum, 0});
  EXPECT_THROW(emulate_launch(self_test_kernel, 1, cuda_emu::kSmemCapacity + 1,
                              SelfTestParams{out.data(), &sum, 0}),
               cuda_emu::CudaEmulationError);
}

// ---------------------------------------------------------------------------------------------
// The kernel harness's core (benchmarks/harness/kernel_harness.h), which checks the kernels on a
// GPU without torch: its parameters, filled from raw buffers, drive the fallback kernels to its
// own float64 reference within its tolerances, forward (with statistics) and backward. A wrong
// stride, pattern or scale policy there, or a wrong reference, fails here on any machine.
// ---------------------------------------------------------------------------------------------

template <typename T>
void run_harness_case(const entropy_attn::harness::Shape& s) {
  namespace eh = entropy_attn::harness;
  eh::HostCall<T> c(s, 3);
  const eh::Forward ref = eh::reference_forward(s, c.in);
  const eh::Tolerance tol = eh::tolerance<T>();
  const auto expect_ok = [](const eh::Check& k) {
    EXPECT_TRUE(k.ok()) << k.what << ": " << k.error << " > " << k.tol;
  };

  launch_forward<T>(eh::forward_params(s, c.b, true));
  expect_ok(eh::elementwise("out", eh::output_in_head_order(s, c.widen(c.b.out, s.q_elems())),
                            ref.out, tol));
  expect_ok(eh::elementwise("lse", c.rows(c.b.lse), ref.lse, tol));
  expect_ok(eh::elementwise("entropy", c.rows(c.b.entropy), ref.entropy, tol));
  expect_ok(eh::elementwise("sum_p2", c.rows(c.b.sum_p2), ref.sum_p2, tol));

  std::memset(c.b.dq_accum, 0, s.q_elems() * sizeof(float));
  launch_backward<T>(eh::backward_params(s, c.b, false));
  const int64_t heads_kv = s.batch * s.heads * s.kv_len * s.head_dim;
  const eh::Backward got = eh::finish_fallback(
      s, c.in.qd, std::vector<float>(c.b.dq_accum, c.b.dq_accum + s.q_elems()),
      c.rows(c.b.row_scale), std::vector<float>(c.b.dk_heads, c.b.dk_heads + heads_kv),
      std::vector<float>(c.b.dv_heads, c.b.dv_heads + heads_kv));
  const eh::Backward gref = eh::reference_backward(s, c.in, ref);
  expect_ok(eh::relative("dq", got.dq, gref.dq, tol.grad));
  expect_ok(eh::relative("dk", got.dk, gref.dk, tol.grad));
  expect_ok(eh::relative("dv", got.dv, gref.dv, tol.grad));
  expect_ok(eh::relative("d lambda", got.dlam, gref.dlam, tol.grad));
}

TEST(KernelHarness, FallbackMatchesTheHarnessReference) {
  // GQA with partial tiles, causal; Lq != Lk with "logn" row scales and the statistics'
  // gradients (the reference's term-by-term derivative against the kernels' collected form); both
  // 16-bit types. The first writes its output in (B, Lq, H, D) memory.
  namespace eh = entropy_attn::harness;
  const eh::Shape gqa{1, 4, 2, 70, 70, 64, true, false, false, entropy_attn::MaskKind::kNone, true};
  const eh::Shape logn{1, 2, 2, 40, 90, 128, false, true, true};
  run_harness_case<__nv_bfloat16>(gqa);
  run_harness_case<__half>(logn);
  // Masks, the same for every head: bool with the statistics' gradients; additive (the logits
  // shifted, which the entropy's gradient sees) with causality and logn over the masked n_i.
  run_harness_case<__nv_bfloat16>(
      eh::Shape{1, 2, 1, 50, 70, 64, false, false, true, entropy_attn::MaskKind::kBool});
  run_harness_case<__half>(
      eh::Shape{1, 2, 2, 60, 60, 128, true, true, true, entropy_attn::MaskKind::kAdditive});
}

TEST(KernelHarness, ChecksFailOnWrongResults) {
  namespace eh = entropy_attn::harness;
  const eh::Tolerance tol = eh::tolerance<__half>();
  const std::vector<double> e{1.0, -2.0, 0.5};
  EXPECT_TRUE(eh::elementwise("same", std::vector<double>{1.0, -2.0, 0.5}, e, tol).ok());
  EXPECT_FALSE(eh::elementwise("off", std::vector<double>{1.0, -2.1, 0.5}, e, tol).ok());
  EXPECT_FALSE(eh::elementwise("nan", std::vector<double>{1.0, NAN, 0.5}, e, tol).ok());
  EXPECT_FALSE(eh::elementwise("short", std::vector<double>{1.0}, e, tol).ok());
  EXPECT_FALSE(eh::relative("off", std::vector<double>{1.0, -2.0, 0.6}, e, tol.grad).ok());
  // The reference itself: one key gives weight 1 (entropy 0, sum p^2 1) and out = v.
  const eh::Shape one{1, 1, 1, 3, 3, 64, true, false};
  const eh::Inputs<__half> in = eh::make_inputs<__half>(one, 5);
  const eh::Forward f = eh::reference_forward(one, in);
  EXPECT_NEAR(f.entropy[0], 0.0, 1e-15);
  EXPECT_NEAR(f.sum_p2[0], 1.0, 1e-15);
  for (int c = 0; c < 64; ++c) EXPECT_NEAR(f.out[c], in.vd[c], 1e-15);
}

}  // namespace
