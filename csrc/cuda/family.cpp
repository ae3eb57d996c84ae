#include "family.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <type_traits>

#include "../head_dim_padding.h"
#include "device_limits.h"
#include "fallback/instantiations/dispatch.h"
#include "fallback/launch.h"
#include "launch_order_rule.h"
#include "sm80/instantiations/dispatch.h"
#include "sm80/launch.h"
#include "sm90/instantiations/dispatch.h"
#include "sm90/launch.h"
#include "split_kv.h"

namespace entropy_attn::cuda {
namespace {

template <typename T>
bool is_dtype(at::ScalarType t) {
  if constexpr (std::is_same_v<T, float>) return t == at::kFloat;
  if constexpr (std::is_same_v<T, double>) return t == at::kDouble;
  if constexpr (std::is_same_v<T, __half>) return t == at::kHalf;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return t == at::kBFloat16;
  return false;
}

MaskKind mask_kind(const std::optional<at::Tensor>& mask) {
  if (!mask.has_value()) return MaskKind::kNone;
  return mask->scalar_type() == at::kBool ? MaskKind::kBool : MaskKind::kAdditive;
}

// The fallback's head-dim bucket of a call: the kernels pad max(head_dim, v_head_dim) up to it.
int fallback_bucket(const AttentionShape& s) {
  return head_dim_bucket(std::max(s.head_dim, s.v_head_dim));
}

// The number an environment variable's value spells with at most `max_digits` decimal digits, or 0
// when it spells none (the callers name the variable in their error).
int env_count(std::string_view v, size_t max_digits) {
  const bool digits =
      !v.empty() && v.size() <= max_digits &&
      std::all_of(v.begin(), v.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
  return digits ? std::atoi(std::string(v).c_str()) : 0;
}

}  // namespace

int device_sm() {
  const c10::DeviceIndex device = c10::cuda::current_device();
  int major = 0, minor = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  return major * 10 + minor;
}

int device_smem_optin() {
  const char* env = std::getenv("ENTROPY_ATTN_CUDA_SMEM_PER_BLOCK");
  // Digits only (smem_cap_from_env's strtol would also take " +4096", and a number past long's
  // range as no cap at all), checked here: every forward and backward asks before its launch
  // (attention_cuda.cpp: check_shared_memory).
  TORCH_CHECK_VALUE(
      env == nullptr || *env == '\0' || env_count(env, 9) > 0,
      "ENTROPY_ATTN_CUDA_SMEM_PER_BLOCK must be a positive number of bytes (at most 9 "
      "digits), got '",
      env, "'");
  cudaError_t err = cudaSuccess;
  const int bytes = smem_per_block(err);
  C10_CUDA_CHECK(err);
  return bytes;
}

namespace {

int device_sm_count() {
  int sms = 0;
  C10_CUDA_CHECK(
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, c10::cuda::current_device()));
  return sms;
}

// 16-byte vector loads (cp.async) need every row of q, k, v (and of out and dout) to start on a
// 16-byte boundary: aligned data and strides that are multiples of 8 elements.
bool rows_16b_aligned(const at::Tensor& t) {
  if (reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 != 0) return false;
  for (int d = 0; d < 3; ++d) {
    if (t.size(d) > 1 && t.stride(d) % 8 != 0) return false;
  }
  return true;
}

// The features of a call a tensor-core family lacks (empty when it has them all). Without
// `extended` its kernels know only top-left causality (the compile-time flag), no windows,
// documents, softcap, sinks or dropout; with it (family.h: kTensorCoreFeaturesByDefault,
// kHopperFeaturesByDefault) also any window, alignment and packed documents (the causal
// instantiations read the KeyPattern), softcap, sinks and dropout.
std::string pattern_obstacle(const CallPattern& c, bool extended) {
  const AttentionOptions& o = c.options;
  const KeyPattern p = o.key_pattern();
  if (!extended) {
    if (c.cu_q.defined()) return "packed documents (cu_seqlens)";
    // A right bound other than is_causal's (window_size = (-1, 0) without is_causal included: the
    // kernels' causal flag follows is_causal).
    if (p.left >= 0 || (p.right >= 0 && !o.causal)) return "a sliding window";
    if (o.bottom_right && p.banded()) return "bottom-right causal alignment";
    if (o.softcap > 0) return "logit softcapping";
    if (c.sinks.defined()) return "attention sinks";
    if (o.dropout_p > 0) return "dropout";
  }
  return {};
}

// Whether a capability of the tensor-core families that is `by_default` on or off (family.h) is
// on: always when a tensor-core family is forced (ENTROPY_ATTN_CUDA_FAMILY=sm80 or sm90), never
// when the fallback is.
bool tensor_core_capability(bool by_default) {
  const std::optional<Family> requested = requested_family();
  return requested.has_value() ? *requested != Family::kFallback : by_default;
}

// Why the tensor-core family cannot run a call with these inputs (empty when it can). `has` tells
// whether an instantiation exists for the call's dtype, head dim and flags.
std::string tensor_core_obstacle(const AttentionShape& s, at::ScalarType dtype,
                                 const CallPattern& call,
                                 std::initializer_list<const at::Tensor*> rows, bool has,
                                 bool extended = false) {
  if (dtype != at::kBFloat16 && dtype != at::kHalf) return "dtype is not bfloat16 or float16";
  if (std::string features = pattern_obstacle(call, extended); !features.empty()) return features;
  if (s.q_len == 0 || s.kv_len == 0) return "an empty sequence";
  if (s.head_dim != s.v_head_dim) return "head_dim != v_head_dim";
  if (!has) {
    return "no instantiation for this head_dim and flags in this build (csrc/cuda/kernels.toml)";
  }
  if (s.head_dim == 256 && !tensor_core_capability(kTensorCoreHeadDim256ByDefault)) {
    return "head_dim 256, off by default (kTensorCoreHeadDim256ByDefault)";
  }
  if (device_sm() < 80) return "the GPU is older than sm_80";
  for (const at::Tensor* t : rows) {
    if (!rows_16b_aligned(*t)) return "a tensor's rows are not 16-byte aligned";
  }
  if (s.heads > 65535 || s.batch > 65535) return "more than 65535 heads or batches";
  // The kernels keep lengths and key indices in 32 bits (their offsets are 64-bit), and step them
  // past the length by up to a block (a lane's j += 32, j0 + kBlockN, L + kBlockM - 1): lengths
  // stay kLengthMargin under 2^31 so that no step overflows. An expanded (stride 0) key/value of
  // 2^31 rows costs no memory, so the length itself is checked.
  constexpr int64_t kLengthMargin = 1024;
  if (s.q_len > INT32_MAX - kLengthMargin || s.kv_len > INT32_MAX - kLengthMargin) {
    return "a sequence of 2^31 - 1024 rows or more";
  }
  return {};
}

// The launch function of the tensor-core instantiation for a call, or null.
using Sm80Forward = cudaError_t (*)(const FwdParams<float>&, cudaStream_t);
using Sm80Backward = cudaError_t (*)(const BwdParams<float>&, cudaStream_t);

// (The parameters go unused while kernels.toml lists no instantiation of the family.)
Sm80Forward sm80_forward([[maybe_unused]] at::ScalarType dtype, [[maybe_unused]] int64_t d,
                         [[maybe_unused]] bool causal, [[maybe_unused]] MaskKind mask,
                         [[maybe_unused]] bool stats) {
#define EA_MATCH(T, D, C, M, S)                                                 \
  if (is_dtype<T>(dtype) && d == D && causal == C && mask == M && stats == S) { \
    return &sm80::launch_forward<T, D, C, M, S>;                                \
  }
#ifndef ENTROPY_ATTN_NO_SM80  // a CMake build without the family's device code
  EA_SM80_FORWARD_KERNELS(EA_MATCH)
#endif
#undef EA_MATCH
  // A call whose plain full-attention instantiation kernels.toml does not list (exclude: masked
  // calls, head dim 256) runs in the general one, which takes every pattern.
  return causal ? nullptr : sm80_forward(dtype, d, true, mask, stats);
}

Sm80Backward sm80_backward([[maybe_unused]] at::ScalarType dtype, [[maybe_unused]] int64_t d,
                           [[maybe_unused]] bool causal, [[maybe_unused]] MaskKind mask) {
#define EA_MATCH(T, D, C, M)                                      \
  if (is_dtype<T>(dtype) && d == D && causal == C && mask == M) { \
    return &sm80::launch_backward<T, D, C, M>;                    \
  }
#ifndef ENTROPY_ATTN_NO_SM80
  EA_SM80_BACKWARD_KERNELS(EA_MATCH)
#endif
#undef EA_MATCH
  return causal ? nullptr : sm80_backward(dtype, d, true, mask);  // (as sm80_forward)
}

using Sm90Forward = cudaError_t (*)(const FwdParams<float>&, cudaStream_t);

Sm90Forward sm90_forward([[maybe_unused]] at::ScalarType dtype, [[maybe_unused]] int64_t d,
                         [[maybe_unused]] bool causal, [[maybe_unused]] MaskKind mask,
                         [[maybe_unused]] bool stats) {
#define EA_MATCH(T, D, C, M, S)                                                 \
  if (is_dtype<T>(dtype) && d == D && causal == C && mask == M && stats == S) { \
    return &sm90::launch_forward<T, D, C, M, S>;                                \
  }
#ifndef ENTROPY_ATTN_NO_SM90  // a CMake build without the family's device code
  EA_SM90_FORWARD_KERNELS(EA_MATCH)
#endif
#undef EA_MATCH
  return causal ? nullptr : sm90_forward(dtype, d, true, mask, stats);  // (as sm80_forward)
}

using Sm90Backward = cudaError_t (*)(const BwdParams<float>&, cudaStream_t);

Sm90Backward sm90_backward([[maybe_unused]] at::ScalarType dtype, [[maybe_unused]] int64_t d,
                           [[maybe_unused]] bool causal, [[maybe_unused]] MaskKind mask) {
#define EA_MATCH(T, D, C, M)                                      \
  if (is_dtype<T>(dtype) && d == D && causal == C && mask == M) { \
    return &sm90::launch_backward<T, D, C, M>;                    \
  }
#ifndef ENTROPY_ATTN_NO_SM90
  EA_SM90_BACKWARD_KERNELS(EA_MATCH)
#endif
#undef EA_MATCH
  return causal ? nullptr : sm90_backward(dtype, d, true, mask);  // (as sm80_forward)
}

// The tensor-core families' causal instantiations are the general ones: they take every pattern
// (causality, windows, either alignment, packed documents: key_ranges.cuh), softcap, sinks and
// dropout, and the others plain full attention alone (sm90/launch.h: needs_general). So
// the call, not is_causal alone, picks them.
bool needs_general(const CallPattern& c) {
  return c.options.key_pattern().banded() || c.cu_q.defined() || c.options.softcap > 0 ||
         c.sinks.defined() || c.options.dropout_p > 0;
}

// Whether the tensor-core family takes windows, bottom-right alignment, packed documents, softcap,
// sinks and dropout: by default once they have passed the GPU tests (family.h:
// kTensorCoreFeaturesByDefault), or when a tensor-core family is forced.
bool tensor_core_features() { return tensor_core_capability(kTensorCoreFeaturesByDefault); }

// The backward of a softcapped call forms the cap's derivative from the capped logit, which an
// additive mask would shift (sm80/bwd_kernel.cuh, sm90/bwd_kernel.cuh): such calls are not the
// tensor-core families'.
std::string softcap_backward_obstacle(const BackwardCall& c) {
  if (c.call.options.softcap > 0 && mask_kind(c.call.mask) == MaskKind::kAdditive) {
    return "logit softcapping with an additive mask in the backward";
  }
  return {};
}

Sm90Backward sm90_backward_of(const BackwardCall& c) {
  return sm90_backward(c.call.dtype, c.call.shape.head_dim, needs_general(c.call),
                       mask_kind(c.call.mask));
}

Sm90Forward sm90_forward_of(const ForwardCall& c) {
  return sm90_forward(c.call.dtype, c.call.shape.head_dim, needs_general(c.call),
                      mask_kind(c.call.mask), c.call.options.return_stats);
}

// Whether TMA can describe a (B, heads, L, D) tensor (sm90/launch.h).
bool tma_ok(const at::Tensor& t) {
  return sm90::tma_compatible(View4{t.const_data_ptr(), t.stride(0), t.stride(1), t.stride(2)},
                              t.size(2), t.size(1), t.size(0));
}

// Why the Hopper family cannot run a call (empty when it can): what the tensor-core family needs
// (its pattern check covers what sm90::covers asks of the pattern), a compute capability 9.0 GPU
// (sm_90a code runs nowhere else), and tensors TMA can describe (q, k, v; dout in the backward).
std::string hopper_obstacle(const AttentionShape& s, at::ScalarType dtype, const CallPattern& call,
                            std::initializer_list<const at::Tensor*> tensors, bool has,
                            bool extended = false) {
  std::string obstacle = tensor_core_obstacle(s, dtype, call, tensors, has, extended);
  if (!obstacle.empty()) return obstacle;
  if (device_sm() != 90) return "the GPU is not compute capability 9.0 (sm_90a)";
  for (const at::Tensor* t : tensors) {
    if (!tma_ok(*t)) return "a tensor's strides are not positive multiples of 16 bytes (TMA)";
  }
  return {};
}

// Whether a capability of the Hopper family that is `by_default` on or off (family.h) is on:
// always when the family is forced, never when another is.
bool hopper_capability(bool by_default) {
  const std::optional<Family> requested = requested_family();
  return requested.has_value() ? *requested == Family::kSm90 : by_default;
}

// Whether the Hopper family takes windows, bottom-right alignment, packed documents, softcap,
// sinks and dropout: by default once they have passed the GPU tests (family.h:
// kHopperFeaturesByDefault), or when the family is forced.
bool hopper_features() { return hopper_capability(kHopperFeaturesByDefault); }

std::string hopper_forward_obstacle(const ForwardCall& c) {
  std::string obstacle = hopper_obstacle(c.call.shape, c.call.dtype, c.call, {&c.q, &c.k, &c.v},
                                         sm90_forward_of(c) != nullptr, hopper_features());
  if (obstacle.empty() && c.call.shape.head_dim == 256 &&
      !hopper_capability(kHopperHeadDim256ByDefault)) {
    return "head_dim 256, off by default (kHopperHeadDim256ByDefault)";
  }
  return obstacle;
}

// The Hopper backward writes the logits' gradient (the additive mask's, params.h: d_logits) only
// in its step without the statistics' gradients (sm90/bwd_kernel.cuh: kLogitGrads); the sm80
// family's and the fallback's write it beside them too.
// Off by default until it has run on a GPU (family.h: kHopperMaskGradByDefault).
std::string hopper_mask_grad_obstacle(const BackwardCall& c) {
  if (!c.call.grad_logits.defined()) return {};
  if (c.call.g_entropy.defined() || c.call.g_sum_p2.defined()) {
    return "the additive mask's gradient (grad_mask) with the statistics' gradients";
  }
  if (!hopper_capability(kHopperMaskGradByDefault)) {
    return "the additive mask's gradient (grad_mask), off by default (kHopperMaskGradByDefault)";
  }
  return {};
}

// Under deterministic algorithms the Hopper backward adds dq's partial sums in the key blocks'
// order (sm90/bwd_kernel.cuh: dq_turns), by bulk reductions or, in the masked kernels and at head
// dim 256, by atomics taking turns (a mask's gradient comes at the call's full shape then:
// attention_cuda.cpp). Off by default until it has run on a GPU (family.h:
// kHopperDeterministicByDefault); the sm80 family's deterministic dq kernel takes such calls
// meanwhile.
std::string hopper_deterministic_obstacle() {
  if (at::globalContext().deterministicAlgorithms() &&
      !hopper_capability(kHopperDeterministicByDefault)) {
    return "deterministic algorithms (dq in the key blocks' order, off by default: "
           "kHopperDeterministicByDefault)";
  }
  return {};
}

// The Hopper backward also needs dq in an order it can keep (deterministic algorithms: above), no
// mask gradient beside the statistics' gradients (the sm80 family's backward takes those calls),
// and no softcap or dropout with a mask (sm90/launch.h: backward_covers); at head dim 256 it is off
// by default (family.h: kHopperBackwardHeadDim256ByDefault).
std::string hopper_backward_obstacle(const BackwardCall& c) {
  if (std::string why = hopper_mask_grad_obstacle(c); !why.empty()) return why;
  if (std::string why = hopper_deterministic_obstacle(); !why.empty()) return why;
  // (Any mask: this covers softcap_backward_obstacle's additive one too.)
  if (c.call.options.softcap > 0 && c.call.mask.has_value()) {
    return "logit softcapping with a mask in the backward (sm90/launch.h)";
  }
  if (c.call.options.dropout_p > 0 && c.call.mask.has_value()) {
    return "dropout with a mask in the backward (sm90/launch.h)";
  }
  std::string obstacle =
      hopper_obstacle(c.call.shape, c.call.dtype, c.call, {&c.q, &c.k, &c.v, &c.out, &c.dout},
                      sm90_backward_of(c) != nullptr, hopper_features());
  if (obstacle.empty() && c.call.shape.head_dim == 256 &&
      !hopper_capability(kHopperBackwardHeadDim256ByDefault)) {
    return "head_dim 256 in the backward, off by default (kHopperBackwardHeadDim256ByDefault)";
  }
  return obstacle;
}

// The tensor-core backward also needs its shared memory, which at D = 128 is more than some GPUs
// of sm_80 and newer offer a block (sm80/launch.h): there its launcher takes the compact tiles,
// which need less, when they are on (family.h: kTensorCoreCompactBackwardByDefault).
std::string tensor_core_backward_obstacle(const BackwardCall& c) {
  const AttentionShape& s = c.call.shape;
  const bool has = sm80_backward(c.call.dtype, s.head_dim, needs_general(c.call),
                                 mask_kind(c.call.mask)) != nullptr;
  std::string why = tensor_core_obstacle(
      s, c.call.dtype, c.call, {&c.q, &c.k, &c.v, &c.out, &c.dout}, has, tensor_core_features());
  if (why.empty()) why = softcap_backward_obstacle(c);
  if (!why.empty()) return why;
  const int d = static_cast<int>(s.head_dim);
  const int smem = device_smem_optin();
  const bool compact = sm80::backward_compact(d, smem);
  if (compact && !tensor_core_capability(kTensorCoreCompactBackwardByDefault)) {
    return "the backward's compact tiles (the GPU offers a block less shared memory than the full "
           "ones need), off by default (kTensorCoreCompactBackwardByDefault)";
  }
  const bool deterministic = at::globalContext().deterministicAlgorithms();
  const int need = std::max(sm80::backward_main_smem_bytes(d, compact),
                            deterministic ? sm80::backward_dq_smem_bytes(d, compact) : 0);
  if (need > smem) {
    return "the GPU offers a block less shared memory than the backward needs (" +
           std::to_string(need) + " bytes)";
  }
  return {};
}

// The family for a call: the most specialized one that is wanted (requested, or on by default)
// and has no obstacle. The obstacles are callables, asked only when their family is wanted.
template <typename Hopper, typename TensorCore>
Selection choose(const Hopper& hopper, const TensorCore& tensor_core) {
  const std::optional<Family> requested = requested_family();
  const bool want_sm90 =
      requested.has_value() ? *requested == Family::kSm90 : kHopperFamilyByDefault;
  const bool want_sm80 = requested.has_value()
                             ? *requested == Family::kSm80 || *requested == Family::kSm90
                             : kTensorCoreFamilyByDefault;
  std::string reason;
  if (want_sm90) {
    const std::string obstacle = hopper();
    if (obstacle.empty()) return {Family::kSm90, {}};
    reason = "sm90: " + obstacle;
  }
  if (!want_sm80) {
    return {Family::kFallback,
            requested.has_value() ? "ENTROPY_ATTN_CUDA_FAMILY=fallback" : "off by default"};
  }
  const std::string obstacle = tensor_core();
  if (obstacle.empty()) return {Family::kSm80, reason};
  return {Family::kFallback, (reason.empty() ? "" : reason + "; ") + "sm80: " + obstacle};
}

}  // namespace

const char* family_name(Family f) {
  switch (f) {
    case Family::kSm80:
      return "sm80";
    case Family::kSm90:
      return "sm90";
    default:
      return "fallback";
  }
}

std::optional<Family> requested_family() {
  const char* env = std::getenv("ENTROPY_ATTN_CUDA_FAMILY");
  const std::string_view v = env ? env : "";
  if (v.empty() || v == "auto") return std::nullopt;
  if (v == "fallback") return Family::kFallback;
  if (v == "sm80") return Family::kSm80;
  if (v == "sm90") return Family::kSm90;
  TORCH_CHECK_VALUE(false,
                    "ENTROPY_ATTN_CUDA_FAMILY must be 'auto', 'fallback', 'sm80' or 'sm90', got '",
                    std::string(v), "'");
}

int64_t tensor_core_padded_head_dim(const AttentionShape& shape, at::ScalarType dtype) {
  const bool on = tensor_core_capability(kTensorCorePaddedHeadDimsByDefault);
  if (!on || (dtype != at::kBFloat16 && dtype != at::kHalf)) return 0;
  return padded_head_dim(shape, {64, 128, 256});
}

int forward_splits(const ForwardCall& c) {
  const char* env = std::getenv("ENTROPY_ATTN_SPLIT_KV");
  const std::string_view v = env ? env : "";
  const AttentionShape& s = c.call.shape;
  if (v.empty() ? !kSplitKvByDefault : v == "off") return 1;
  if (v.empty() || v == "auto") {
    // (The forward's query tiles hold 128 rows, 64 in masked calls at D = 128, and its key blocks
    // 32 or 64 keys: the rule needs only their order of magnitude.) Two of its blocks fit on an SM
    // (128 threads, at most 255 registers each), so a wave is twice the SMs, as FlashAttention-2
    // counts too. On an H200 (B = 1, 32 heads, 65536 keys; results/gpu/decode.md) one block per
    // SM chose 4 parts (0.75 ms), two choose 7 (0.536 ms); 8 or 16 parts took 0.473 ms.
    const int64_t tiles = s.batch * s.heads * ((s.q_len + 127) / 128);
    return split_kv_count(tiles, (s.kv_len + 63) / 64, 2 * device_sm_count());
  }
  const int n = env_count(v, 3);
  TORCH_CHECK_VALUE(n >= 1 && n <= kMaxSplits,
                    "ENTROPY_ATTN_SPLIT_KV must be 'auto', 'off' or a count from 1 to ", kMaxSplits,
                    ", got '", std::string(v), "'");
  // The split grid's x is the query tiles (of at least 64 rows) times the parts: at most 2^31 - 1.
  const int64_t tiles = std::max<int64_t>((s.q_len + 63) / 64, 1);
  return static_cast<int>(std::min<int64_t>(n, INT32_MAX / tiles));
}

int hopper_persistent_blocks() {
  const char* env = std::getenv("ENTROPY_ATTN_CUDA_PERSISTENT");
  const std::string_view v = env ? env : "";
  if (v.empty() ? !kHopperPersistentByDefault : v == "off") return 0;
  if (v.empty() || v == "on") return device_sm_count();
  const int n = env_count(v, 9);
  TORCH_CHECK_VALUE(n >= 1,
                    "ENTROPY_ATTN_CUDA_PERSISTENT must be 'on', 'off' or a number of blocks of at "
                    "least 1, got '",
                    std::string(v), "'");
  return n;
}

int launch_order_sections(const AttentionShape& s, const KeyPattern& pattern, int64_t element_size,
                          bool backward, int blocks_per_sm, int splits) {
  const char* env = std::getenv("ENTROPY_ATTN_CUDA_LAUNCH_ORDER");
  const std::string_view v = env ? env : "";
  LaunchOrderSetting setting;
  if (v == "heads") {
    setting.kind = LaunchOrderSetting::Kind::kGridOrder;
  } else if (!v.empty() && v != "auto") {
    setting.kind = LaunchOrderSetting::Kind::kSections;
    setting.sections = env_count(v, 9);
    TORCH_CHECK_VALUE(setting.sections >= 1,
                      "ENTROPY_ATTN_CUDA_LAUNCH_ORDER must be 'auto', 'heads' or a number of "
                      "sections of at least 1, got '",
                      std::string(v), "'");
  }
  int l2 = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, c10::cuda::current_device()));
  const LaunchDevice device{l2, static_cast<int64_t>(blocks_per_sm) * device_sm_count()};
  return launch_order_rule(s, pattern, element_size, backward, splits, setting, device);
}

Selection select_forward(const ForwardCall& c) {
  const AttentionShape& s = c.call.shape;
  auto sm80_obstacle = [&] {
    const bool has = sm80_forward(c.call.dtype, s.head_dim, needs_general(c.call),
                                  mask_kind(c.call.mask), c.call.options.return_stats) != nullptr;
    return tensor_core_obstacle(s, c.call.dtype, c.call, {&c.q, &c.k, &c.v}, has,
                                tensor_core_features());
  };
  Selection chosen = choose([&] { return hopper_forward_obstacle(c); }, sm80_obstacle);
  // Split-KV is the sm80 family's: a call it would split goes there from sm90 (decoding: a few
  // query tiles, which the Hopper kernel would run on a few SMs).
  if (chosen.family == Family::kSm90 && forward_splits(c) > 1 && sm80_obstacle().empty()) {
    return {Family::kSm80, "sm90: split-KV (ENTROPY_ATTN_SPLIT_KV) runs on sm80"};
  }
  return chosen;
}

bool hopper_bulk_dq(const AttentionBackwardCall& call) {
  // (The masked kernels add G by atomics only, as every kernel does at head dim 256, where G's tile
  // does not fit: sm90/launch.h, backward_covers.)
  return !call.mask.has_value() && sm90::bulk_dq_fits(call.shape.head_dim) &&
         hopper_capability(kHopperBulkDqByDefault);
}

Selection select_backward(const BackwardCall& c) {
  return choose([&] { return hopper_backward_obstacle(c); },
                [&] { return tensor_core_backward_obstacle(c); });
}

size_t forward_smem_bytes(const ForwardCall& c) {
  const int d = fallback_bucket(c.call.shape);
#define EA_MATCH(T, D) \
  if (is_dtype<T>(c.call.dtype) && d == D) return fallback::forward_smem_bytes<T, D>();
  EA_FALLBACK_FORWARD_KERNELS(EA_MATCH)
#undef EA_MATCH
  return 0;
}

size_t backward_smem_bytes(const BackwardCall& c) {
  const int d = fallback_bucket(c.call.shape);
#define EA_MATCH(T, D) \
  if (is_dtype<T>(c.call.dtype) && d == D) return fallback::backward_smem_bytes<T, D>();
  EA_FALLBACK_BACKWARD_KERNELS(EA_MATCH)
#undef EA_MATCH
  return 0;
}

namespace {

// The fallback forward of a call with parameters p (a plain call, or the guard of a tensor-core
// forward when p.nonfinite is set).
template <typename Acc>
cudaError_t launch_fallback_forward(const ForwardCall& c, const FwdParams<Acc>& p,
                                    cudaStream_t stream) {
  const int d = fallback_bucket(c.call.shape);
#define EA_MATCH(T, D)                                  \
  if constexpr (std::is_same_v<AccType<T>, Acc>) {      \
    if (is_dtype<T>(c.call.dtype) && d == D) {          \
      return fallback::launch_forward<T, D>(p, stream); \
    }                                                   \
  }
  EA_FALLBACK_FORWARD_KERNELS(EA_MATCH)
#undef EA_MATCH
  return cudaErrorInvalidValue;  // the host checks reject what no instantiation covers
}

// The fallback backward of a call with parameters p (a plain call, or the guard of a tensor-core
// backward when p.nonfinite is set).
template <typename Acc>
cudaError_t launch_fallback_backward(const BackwardCall& c, const BwdParams<Acc>& p,
                                     cudaStream_t stream) {
  const int d = fallback_bucket(c.call.shape);
#define EA_MATCH(T, D)                                   \
  if constexpr (std::is_same_v<AccType<T>, Acc>) {       \
    if (is_dtype<T>(c.call.dtype) && d == D) {           \
      return fallback::launch_backward<T, D>(p, stream); \
    }                                                    \
  }
  EA_FALLBACK_BACKWARD_KERNELS(EA_MATCH)
#undef EA_MATCH
  return cudaErrorInvalidValue;  // the host checks reject what no instantiation covers
}

// A tensor-core launch followed by its guard: the tensor-core kernels flag a call in which a
// value they wrote came out non-finite, and the fallback recomputes such a call by the hidden-keys
// rule (params.h: nonfinite); otherwise its blocks return at once. The flag is freed when this
// returns: the caching allocator reuses it only in this stream's order, after both launches.
template <typename Params, typename Call>
cudaError_t launch_guarded(cudaError_t (*launch)(const Params&, cudaStream_t), Params p,
                           const Call& c, cudaStream_t stream,
                           cudaError_t (*fallback)(const Call&, const Params&, cudaStream_t)) {
  if (launch == nullptr) return cudaErrorInvalidValue;
  const at::Tensor nonfinite = at::zeros({1}, c.q.options().dtype(at::kInt));
  p.nonfinite = nonfinite.data_ptr<int>();
  const cudaError_t err = launch(p, stream);
  return err != cudaSuccess ? err : fallback(c, p, stream);
}

}  // namespace

cudaError_t launch_forward(const ForwardCall& c, Family f, cudaStream_t stream) {
  const AttentionShape& s = c.call.shape;
  if (c.call.dtype == at::kDouble) return launch_fallback_forward(c, c.params<double>(), stream);
  FwdParams<float> p = c.params<float>();
  if (f == Family::kFallback) return launch_fallback_forward(c, p, stream);
  // Split-KV (sm80) runs in the general instantiations, so that the plain full-attention kernels
  // carry none of it.
  if (f == Family::kSm80) p.num_splits = forward_splits(c);
  // (Two blocks of the sm80 forward fit on an SM, one of the others.)
  p.launch_sections = launch_order_sections(s, p.pattern, c.q.element_size(), false,
                                            f == Family::kSm80 ? 2 : 1, p.num_splits);
  if (f == Family::kSm90) p.persistent_blocks = hopper_persistent_blocks();
  const auto launch =
      f == Family::kSm90
          ? sm90_forward_of(c)
          : sm80_forward(c.call.dtype, s.head_dim, needs_general(c.call) || p.num_splits > 1,
                         mask_kind(c.call.mask), c.call.options.return_stats);
  // Split-KV's float32 workspace (params.h), freed when this returns: the caching allocator reuses
  // it only in this stream's order, after the kernels.
  at::Tensor o_partial, state_partial;
  if (p.num_splits > 1) {
    const at::TensorOptions f32 = c.q.options().dtype(at::kFloat);
    const int64_t rows = s.batch * s.heads * s.q_len;
    o_partial = at::empty({p.num_splits, rows, s.v_head_dim}, f32);
    state_partial = at::empty({p.num_splits, rows, 4}, f32);
    p.o_partial = o_partial.data_ptr<float>();
    p.state_partial = state_partial.data_ptr<float>();
  }
  return launch_guarded(launch, p, c, stream, &launch_fallback_forward<float>);
}

cudaError_t launch_backward(const BackwardCall& c, Family f, cudaStream_t stream) {
  const AttentionShape& s = c.call.shape;
  if (c.call.dtype == at::kDouble) return launch_fallback_backward(c, c.params<double>(), stream);
  BwdParams<float> p = c.params<float>();
  if (f == Family::kFallback) return launch_fallback_backward(c, p, stream);
  p.launch_sections = launch_order_sections(s, p.pattern, c.q.element_size(), true, 1, 1);
  const auto launch =
      f == Family::kSm90
          ? sm90_backward_of(c)
          : sm80_backward(c.call.dtype, s.head_dim, needs_general(c.call), mask_kind(c.call.mask));
  // (The guard recomputes the gradients by blocks of a whole GQA group, in the family's outputs.)
  return launch_guarded(launch, p, c, stream, &launch_fallback_backward<float>);
}

}  // namespace entropy_attn::cuda
