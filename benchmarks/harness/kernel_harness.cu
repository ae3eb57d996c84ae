// The kernel harness: the CUDA kernels of every family checked and timed in one command, without
// torch or Python, whatever the GPU machine has installed. Built here (scripts/kernel_harness.sh
// build: this file linked with the kernel objects of the extension's build and the static CUDA
// runtime), carried to the GPU machine as one file, run there:
//
//   build/kernel_harness [--quick] [--checks-only] [--families sm80,sm90,fallback] [--json F]
//                        [--commit C] [--sm90-atomic-dq]
//
// 1. Checks: small calls (partial tiles, GQA, causal, "logn" row scales, bool and additive masks,
//    D = 64 and 128, and 256 in a table of its own, bf16 and fp16) through each family the device
//    runs: the forward with and without statistics and the backward against the float64 reference
//    of kernel_harness.h, with the test suite's tolerances (with the statistics' upstream gradients
//    too, as an entropy regularizer sends them); deterministic backwards (dq without atomics in any
//    order: a second run's bits compared with the first's); and calls of 2048 rows and keys (bf16,
//    with those gradients) against the fallback family's results. (The pytest suite,
//    tests/test_cuda.py, is the full judge: windows, documents, softcap, sinks, dropout, other mask
//    layouts.)
// 2. Timings: the GPU benchmark's grid (bf16, B = 4, H:Hkv 16:16 and 32:8, D 64 and 128, L 1024,
//    4096 and 16384, causal or not; --quick: L 1024 and 4096) for the tensor-core families (the
//    fallback with --families ...,fallback): medians of CUDA-event times of the forward without
//    and with statistics and of the forward with statistics + backward (without d lambda, as
//    autograd asks for it with a scale policy; dq's accumulator zeroed in the timed span, as the
//    op does), the backward of a loss of the output alone and of one with the statistics' upstream
//    gradients too (an entropy regularizer's), and their TFLOP/s. No SDPA here: ratios against it
//    come from benchmarks/gpu_vs_sdpa.py.
//
// Markdown tables on stdout (progress on stderr), and --json F writes them as JSON. Exit code 0
// when every check passed, 1 when one failed, 2 without a CUDA device of compute capability 8.0 or
// newer or on a usage error, 3 on a CUDA error (named on stderr). Calls are launched as the op
// launches them by default (csrc/cuda/family.cpp): split-KV's parts for the sm80 forward, the
// launch order's sections, the Hopper backward's dq added by bulk reductions in the calls without
// a mask (csrc/cuda/family.h: kHopperBulkDqByDefault), the backward left out where the op would not
// run it on the device; --sm90-atomic-dq has the Hopper backward add dq by atomics in every call,
// as the masked calls do, to time the two against each other.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "cuda/device_limits.h"
#include "cuda/fallback/instantiations/dispatch.h"
#include "cuda/fallback/launch.h"
#include "cuda/launch_order_rule.h"
#include "cuda/sm80/instantiations/dispatch.h"
#include "cuda/sm80/launch.h"
#include "cuda/sm90/instantiations/dispatch.h"
#include "cuda/sm90/launch.h"
#include "cuda/split_kv.h"
#include "kernel_harness.h"

namespace {

using namespace entropy_attn;
using namespace entropy_attn::cuda;
using namespace entropy_attn::harness;

using FwdFn = cudaError_t (*)(const FwdParams<float>&, cudaStream_t);
using BwdFn = cudaError_t (*)(const BwdParams<float>&, cudaStream_t);

enum class Family { kFallback, kSm80, kSm90 };
const char* family_name(Family f) {
  return f == Family::kFallback ? "fallback" : f == Family::kSm80 ? "sm80" : "sm90";
}

#define EA_CHECK_CUDA(expr)                                              \
  do {                                                                   \
    const cudaError_t err_ = (expr);                                     \
    if (err_ != cudaSuccess) {                                           \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, \
                   cudaGetErrorString(err_));                            \
      std::exit(3);                                                      \
    }                                                                    \
  } while (0)

// The launchers of a family for a call with mask kind `mask`: the instantiation lists of
// csrc/cuda/kernels.toml (the generated dispatch tables, which csrc/cuda/family.cpp reads too).
template <typename T>
FwdFn forward_of(Family f, int d, bool causal, bool stats, MaskKind mask) {
#define EA_FALLBACK(U, D)                                                         \
  if constexpr (std::is_same_v<T, U>) {                                           \
    if (f == Family::kFallback && d == D) return &fallback::launch_forward<T, D>; \
  }
#define EA_TENSOR_CORE(FAMILY, NS, U, D, C, M, S)                          \
  if constexpr (std::is_same_v<T, U>) {                                    \
    if (f == FAMILY && d == D && causal == C && M == mask && stats == S) { \
      return &NS::launch_forward<T, D, C, M, S>;                           \
    }                                                                      \
  }
#define EA_SM80(U, D, C, M, S) EA_TENSOR_CORE(Family::kSm80, sm80, U, D, C, M, S)
#define EA_SM90(U, D, C, M, S) EA_TENSOR_CORE(Family::kSm90, sm90, U, D, C, M, S)
  EA_FALLBACK_FORWARD_KERNELS(EA_FALLBACK)
  EA_SM80_FORWARD_KERNELS(EA_SM80)
  EA_SM90_FORWARD_KERNELS(EA_SM90)
#undef EA_SM90
#undef EA_SM80
#undef EA_TENSOR_CORE
#undef EA_FALLBACK
  return nullptr;
}

template <typename T>
BwdFn backward_of(Family f, int d, bool causal, MaskKind mask) {
#define EA_FALLBACK(U, D)                                                          \
  if constexpr (std::is_same_v<T, U>) {                                            \
    if (f == Family::kFallback && d == D) return &fallback::launch_backward<T, D>; \
  }
#define EA_TENSOR_CORE(FAMILY, NS, U, D, C, M)               \
  if constexpr (std::is_same_v<T, U>) {                      \
    if (f == FAMILY && d == D && causal == C && M == mask) { \
      return &NS::launch_backward<T, D, C, M>;               \
    }                                                        \
  }
#define EA_SM80(U, D, C, M) EA_TENSOR_CORE(Family::kSm80, sm80, U, D, C, M)
#define EA_SM90(U, D, C, M) EA_TENSOR_CORE(Family::kSm90, sm90, U, D, C, M)
  EA_FALLBACK_BACKWARD_KERNELS(EA_FALLBACK)
  EA_SM80_BACKWARD_KERNELS(EA_SM80)
  EA_SM90_BACKWARD_KERNELS(EA_SM90)
#undef EA_SM90
#undef EA_SM80
#undef EA_TENSOR_CORE
#undef EA_FALLBACK
  return nullptr;
}

// A call's buffers in device memory (kernel_harness.h: buffer_sizes), freed with it.
struct DeviceCall {
  Shape s;
  Buffers b;
  std::vector<BufferSize> sizes;
  std::vector<void*> scratch;  // split-KV's workspace
  DeviceCall(const Shape& shape, int64_t elem, bool per_head_grads)
      : s(shape), sizes(buffer_sizes(s, b, elem, per_head_grads)) {
    for (const BufferSize& z : sizes) {
      EA_CHECK_CUDA(cudaMalloc(z.slot, std::max<int64_t>(z.bytes, 16)));
    }
  }
  ~DeviceCall() {
    for (const BufferSize& z : sizes) cudaFree(*z.slot);
    for (void* x : scratch) cudaFree(x);
  }
  float* workspace(int64_t floats) {
    void* x = nullptr;
    EA_CHECK_CUDA(cudaMalloc(&x, std::max<int64_t>(floats, 4) * sizeof(float)));
    scratch.push_back(x);
    return static_cast<float*>(x);
  }
  // `count` int32 in device memory, every byte 0xff (-1: no key block's turn, so that counters the
  // preprocess failed to start would leave the deterministic backward waiting, not adding out of
  // order).
  int* ints(int64_t count) {
    void* x = nullptr;
    EA_CHECK_CUDA(cudaMalloc(&x, std::max<int64_t>(count, 1) * sizeof(int32_t)));
    EA_CHECK_CUDA(cudaMemset(x, 0xff, std::max<int64_t>(count, 1) * sizeof(int32_t)));
    scratch.push_back(x);
    return static_cast<int*>(x);
  }
  DeviceCall(const DeviceCall&) = delete;
  DeviceCall& operator=(const DeviceCall&) = delete;
  int64_t bytes_of(void* p) const {
    for (const BufferSize& z : sizes) {
      if (*z.slot == p) return z.bytes;
    }
    return 0;
  }
  template <typename X>
  void upload(void* to, const std::vector<X>& from) {
    EA_CHECK_CUDA(cudaMemcpy(to, from.data(), from.size() * sizeof(X), cudaMemcpyHostToDevice));
  }
  template <typename X>
  std::vector<X> download(const void* from) const {
    std::vector<X> out(bytes_of(const_cast<void*>(from)) / sizeof(X));
    EA_CHECK_CUDA(cudaMemcpy(out.data(), from, out.size() * sizeof(X), cudaMemcpyDeviceToHost));
    return out;
  }
};

// The median of `reps` CUDA-event times of fn (after `warmup` calls), in milliseconds.
double median_ms(const std::function<void()>& fn, int warmup, int reps) {
  for (int r = 0; r < warmup; ++r) fn();
  cudaEvent_t start, stop;
  EA_CHECK_CUDA(cudaEventCreate(&start));
  EA_CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<double> ms;
  for (int r = 0; r < reps; ++r) {
    EA_CHECK_CUDA(cudaEventRecord(start));
    fn();
    EA_CHECK_CUDA(cudaEventRecord(stop));
    EA_CHECK_CUDA(cudaEventSynchronize(stop));
    float t = 0;
    EA_CHECK_CUDA(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

std::string describe(const Shape& s) {
  char buf[160];
  const char* mask = s.mask == MaskKind::kBool            ? " bool mask"
                     : s.mask != MaskKind::kAdditive      ? ""
                     : s.mask_per_key                     ? " additive mask per key"
                     : s.mask_elem == MaskElem::kBFloat16 ? " additive mask (bf16)"
                     : s.mask_elem == MaskElem::kFloat16  ? " additive mask (fp16)"
                                                          : " additive mask";
  std::snprintf(buf, sizeof(buf), "B=%lld H=%lld:%lld Lq=%lld Lk=%lld D=%lld%s%s%s%s%s%s",
                static_cast<long long>(s.batch), static_cast<long long>(s.heads),
                static_cast<long long>(s.kv_heads), static_cast<long long>(s.q_len),
                static_cast<long long>(s.kv_len), static_cast<long long>(s.head_dim),
                s.causal ? " causal" : "", s.logn ? " logn" : "",
                s.stat_grads ? " +statistic gradients" : "", mask,
                s.mask_grad ? " +its gradient" : "", s.deterministic ? " deterministic" : "");
  return buf;
}

struct CheckRow {
  std::string family, dtype, shape;
  Check check;
};
struct TimeRow {
  std::string family, dtype;
  Shape s;
  // fwd_bwd: a loss of the output alone; fwd_bwd_reg: with the upstream gradients of lse, the
  // entropy and sum p^2 too (an entropy regularizer's loss: the backward's step that keeps s).
  double fwd = 0, fwd_stats = 0, fwd_bwd = 0, fwd_bwd_reg = 0;
};

// Whether a launch ran: false for cudaErrorNotSupported (the family does not cover the call, as
// the selection point would route it elsewhere); any other error stops the harness.
bool launched(cudaError_t err) {
  if (err == cudaErrorNotSupported) return false;
  EA_CHECK_CUDA(err);
  return true;
}

// What the op's launches read of the device (csrc/cuda/family.cpp, device_limits.h), and whether
// the Hopper backward adds dq by bulk reductions where the call has no mask, as the op does
// (family.h: kHopperBulkDqByDefault), or by atomics (--sm90-atomic-dq).
struct Device {
  int sms = 0, l2_bytes = 0, smem_optin = 0;
  bool sm90_bulk_dq = true;
};

// A call's sizes as csrc/cuda/launch_order_rule.h reads them.
struct RuleShape {
  int64_t batch, heads, kv_heads, q_len, kv_len, head_dim, v_head_dim;
};

// How the op launches a call through family f (csrc/cuda/family.cpp: launch_forward,
// launch_backward, with the default settings): the launchers (the general instantiation where
// split-KV cuts the keys), split-KV's parts for the sm80 forward (split_kv.h's rule, two blocks per
// SM), the launch order's sections (launch_order_rule.h), and why the op would not run the
// family's backward on this device (its shared memory: tensor_core_backward_obstacle). The Hopper
// family's mask gradient without the statistics' gradients runs as with the family forced
// (family.h: kHopperMaskGradByDefault is off).
struct OpLaunch {
  FwdFn fwd_stats = nullptr, fwd_plain = nullptr;
  BwdFn bwd = nullptr;
  int splits = 1, fwd_sections = 0, bwd_sections = 0;
  bool bulk_dq = false;  // the sm90 backward's bulk reductions (calls without a mask)
  std::string bwd_skip;

  template <typename T>
  static OpLaunch of(Family f, const Shape& s, const Device& dev) {
    OpLaunch l;
    const int d = static_cast<int>(s.head_dim);
    if (f == Family::kSm80) {
      l.splits = split_kv_count(s.batch * s.heads * ((s.q_len + 127) / 128), (s.kv_len + 63) / 64,
                                2 * dev.sms);
    }
    // (Masked calls run in the general instantiations, as family.cpp routes them; so does full
    // attention in a direction that has them alone, the sm80 family's at head dim 256.)
    const bool masked = s.mask != MaskKind::kNone;
    const bool general =
        s.causal || l.splits > 1 || masked || forward_of<T>(f, d, false, true, s.mask) == nullptr;
    l.fwd_stats = forward_of<T>(f, d, general, true, s.mask);
    l.fwd_plain = f == Family::kFallback ? nullptr : forward_of<T>(f, d, general, false, s.mask);
    const bool general_bwd = s.causal || masked || backward_of<T>(f, d, false, s.mask) == nullptr;
    l.bwd = backward_of<T>(f, d, general_bwd, s.mask);
    l.bulk_dq = f == Family::kSm90 && dev.sm90_bulk_dq && !masked && sm90::bulk_dq_fits(d);
    // (The launcher takes the compact tiles where the full ones do not fit: launch.h.)
    const bool compact = sm80::backward_compact(d, dev.smem_optin);
    const int need = sm80::backward_main_smem_bytes(d, compact);
    if (f == Family::kSm80 && need > dev.smem_optin) {
      l.bwd_skip = "backward: not run (needs " + std::to_string(need) +
                   " bytes of shared memory per block; the op runs the fallback here)";
    }
    if (f == Family::kSm90 && s.deterministic && !l.bulk_dq) {
      l.bwd_skip =
          "backward: not run (deterministic with dq by atomics: the op runs it in the sm80 family)";
    }
    if (f == Family::kSm90 && s.mask_grad && s.stat_grads) {
      l.bwd_skip =
          "backward: not run (the op runs a mask's gradient beside the statistics' gradients in "
          "the sm80 family)";
    }
    if (f != Family::kFallback) {
      const RuleShape r{s.batch, s.heads, s.kv_heads, s.q_len, s.kv_len, s.head_dim, s.head_dim};
      KeyPattern pattern;
      pattern.right = s.causal ? 0 : -1;
      const int64_t per_sm = f == Family::kSm80 ? 2 : 1;
      l.fwd_sections = launch_order_rule(r, pattern, sizeof(T), false, l.splits, {},
                                         LaunchDevice{dev.l2_bytes, per_sm * dev.sms});
      l.bwd_sections = launch_order_rule(r, pattern, sizeof(T), true, 1, {},
                                         LaunchDevice{dev.l2_bytes, int64_t{dev.sms}});
    }
    return l;
  }

  // The forward's parameters with the op's split-KV parts (and their workspace) and sections.
  FwdParams<float> forward(DeviceCall& c, bool stats) const {
    FwdParams<float> p = forward_params(c.s, c.b, stats);
    p.launch_sections = fwd_sections;
    if (splits > 1) {
      p.num_splits = splits;
      p.o_partial = c.workspace(int64_t{splits} * c.s.rows() * c.s.head_dim);
      p.state_partial = c.workspace(int64_t{splits} * c.s.rows() * 4);
    }
    return p;
  }
  BwdParams<float> backward(DeviceCall& c, bool tensor_core) const {
    BwdParams<float> p = backward_params(c.s, c.b, tensor_core);
    p.launch_sections = bwd_sections;
    if (bulk_dq) p.dq_layout = sm90::bulk_dq_accum(c.s.q_len, c.s.head_dim);
    p.deterministic = c.s.deterministic;
    if (bulk_dq &&
        c.s.deterministic) {  // (the counters as the op allocates them: attention_host.cpp)
      p.dq_turns = c.ints(c.s.batch * c.s.heads * (p.dq_layout.rows / sm90::kBulkDqRows));
    }
    return p;
  }
};

// What a family computed for a call, in float64 in the reference's layouts: the forward without
// statistics (out and lse; tensor-core families only), with them, and the backward. `missing`
// names the first launch the family refused (cudaErrorNotSupported: a failure, the checked calls
// are all ones the families cover) and `skipped` a backward the op would not run on this device;
// what follows either is not run.
struct Results {
  std::string missing, skipped;
  bool has_plain = false;
  Forward plain, stats;
  Backward grads;
  // Deterministic calls of the tensor-core families: whether a second backward gave the same bits
  // of dq, dk and dv.
  std::optional<bool> repeated_bits;
};

template <typename T>
Results run_family(Family f, const Shape& s, const Inputs<T>& in, const Device& dev) {
  const OpLaunch l = OpLaunch::of<T>(f, s, dev);
  Results r;
  if (l.fwd_stats == nullptr || l.bwd == nullptr) {
    r.missing = "no instantiation";
    return r;
  }
  const bool tensor_core = f != Family::kFallback;
  DeviceCall c(s, sizeof(T), !tensor_core);
  fill_inputs(s, c.b, in, [&](void* to, const auto& from) { c.upload(to, from); });
  const auto rows = [&](const float* p) {
    const std::vector<float> x = c.download<float>(p);
    return std::vector<double>(x.begin(), x.end());
  };
  // Without statistics first, so that the backward reads the forward with them.
  if (l.fwd_plain != nullptr) {
    if (!launched(l.fwd_plain(l.forward(c, false), nullptr))) {
      r.missing = "forward";
      return r;
    }
    EA_CHECK_CUDA(cudaDeviceSynchronize());
    r.has_plain = true;
    r.plain.out = output_in_head_order(s, widen(c.download<T>(c.b.out))),
    r.plain.lse = rows(c.b.lse);
  }
  if (!launched(l.fwd_stats(l.forward(c, true), nullptr))) {
    r.missing = "forward+stats";
    return r;
  }
  EA_CHECK_CUDA(cudaDeviceSynchronize());
  r.stats.out = output_in_head_order(s, widen(c.download<T>(c.b.out))), r.stats.lse = rows(c.b.lse);
  r.stats.entropy = rows(c.b.entropy), r.stats.sum_p2 = rows(c.b.sum_p2);
  if (!l.bwd_skip.empty()) {
    r.skipped = l.bwd_skip;
    return r;
  }

  // The gradients' bits: dq, dk and dv of a tensor-core family.
  const auto grad_bits = [&] {
    return std::array<std::vector<T>, 3>{c.download<T>(c.b.dq), c.download<T>(c.b.dk),
                                         c.download<T>(c.b.dv)};
  };
  std::array<std::vector<T>, 3> first_bits;
  for (int run = 0; run < (tensor_core && s.deterministic ? 2 : 1); ++run) {
    EA_CHECK_CUDA(cudaMemset(c.b.dq_accum, 0, c.bytes_of(c.b.dq_accum)));
    if (s.mask_grad) EA_CHECK_CUDA(cudaMemset(c.b.d_mask, 0, c.bytes_of(c.b.d_mask)));
    if (!launched(l.bwd(l.backward(c, tensor_core), nullptr))) {
      r.missing = "backward";
      return r;
    }
    EA_CHECK_CUDA(cudaDeviceSynchronize());
    if (run == 0 && tensor_core && s.deterministic) first_bits = grad_bits();
    if (run == 1) {
      const std::array<std::vector<T>, 3> again = grad_bits();
      bool same = true;
      for (size_t g = 0; g < again.size(); ++g) {
        same = same &&
               std::memcmp(again[g].data(), first_bits[g].data(), again[g].size() * sizeof(T)) == 0;
      }
      r.repeated_bits = same;
    }
  }
  if (tensor_core) {
    r.grads = {output_in_head_order(s, widen(c.download<T>(c.b.dq))),
               kv_in_head_order(s, widen(c.download<T>(c.b.dk))),
               kv_in_head_order(s, widen(c.download<T>(c.b.dv))),
               rows(c.b.d_row_scale),
               {}};
  } else {
    r.grads = finish_fallback(s, widen(in.q), c.download<float>(c.b.dq_accum),
                              c.download<float>(c.b.row_scale), c.download<float>(c.b.dk_heads),
                              c.download<float>(c.b.dv_heads));
  }
  if (s.mask_grad) r.grads.dmask = rows(c.b.d_mask);
  return r;
}

// A family's results against expected ones (the float64 reference, or the fallback's results on
// calls too long for the reference on the CPU: then with twice the tolerances, both sides
// carrying 16-bit rounding, as tests/test_cuda.py compares with the CPU op), appended to rows.
void add_checks(Family f, const char* dtype, const Shape& s, const Results& got,
                const Forward& want, const Backward& want_grads, Tolerance tol,
                std::vector<CheckRow>& rows) {
  const auto add = [&](Check ch) { rows.push_back({family_name(f), dtype, describe(s), ch}); };
  if (got.has_plain) {
    add(elementwise("forward: out", got.plain.out, want.out, tol));
    add(elementwise("forward: lse", got.plain.lse, want.lse, tol));
  }
  if (!got.missing.empty()) {
    add({got.missing + ": refused (cudaErrorNotSupported)", INFINITY, 1.0});
    if (got.missing != "backward") return;
  }
  add(elementwise("forward+stats: out", got.stats.out, want.out, tol));
  add(elementwise("forward+stats: lse", got.stats.lse, want.lse, tol));
  add(elementwise("forward+stats: entropy", got.stats.entropy, want.entropy, tol));
  add(elementwise("forward+stats: sum_p2", got.stats.sum_p2, want.sum_p2, tol));
  if (!got.skipped.empty()) add({got.skipped, 0.0, 1.0});
  if (!got.missing.empty() || !got.skipped.empty()) return;
  add(relative("backward: dq", got.grads.dq, want_grads.dq, tol.grad));
  add(relative("backward: dk", got.grads.dk, want_grads.dk, tol.grad));
  add(relative("backward: dv", got.grads.dv, want_grads.dv, tol.grad));
  add(relative("backward: d lambda", got.grads.dlam, want_grads.dlam, tol.grad));
  if (s.mask_grad) add(relative("backward: d mask", got.grads.dmask, want_grads.dmask, tol.grad));
  if (got.repeated_bits) {
    add({"backward: dq, dk, dv of a second run bitwise equal", *got.repeated_bits ? 0.0 : INFINITY,
         1.0});
  }
}

// The checks of one call of type T through each family: against the float64 reference, or, with
// against_fallback, against the fallback family's results.
template <typename T>
void check_call(const std::vector<Family>& families, const Device& dev, const char* dtype,
                const Shape& s, bool against_fallback, std::vector<CheckRow>& rows) {
  const Inputs<T> in = make_inputs<T>(s, 7);
  Forward want;
  Backward want_grads;
  Tolerance tol = tolerance<T>();
  if (against_fallback) {
    Results ref = run_family(Family::kFallback, s, in, dev);
    if (!ref.missing.empty()) {
      rows.push_back({"fallback",
                      dtype,
                      describe(s),
                      {"the fallback: " + ref.missing + " refused", INFINITY, 1.0}});
      return;
    }
    want = std::move(ref.stats), want_grads = std::move(ref.grads);
    tol = {2 * tol.atol, 2 * tol.rtol, 2 * tol.grad};
  } else {
    want = reference_forward(s, in), want_grads = reference_backward(s, in, want);
  }
  for (Family f : families) {
    if (against_fallback && f == Family::kFallback) continue;
    add_checks(f, dtype, s, run_family(f, s, in, dev), want, want_grads, tol, rows);
  }
}

// The timings of one call through one family (bf16).
TimeRow time_call(Family f, const Shape& s, const Device& dev, int reps) {
  using T = __nv_bfloat16;
  TimeRow row{family_name(f), "bf16", s};
  // (Not deterministic calls: the parameters below serve many launches, turn counters one.)
  if (s.deterministic) return row;
  const OpLaunch l = OpLaunch::of<T>(f, s, dev);
  if (l.fwd_stats == nullptr || l.bwd == nullptr) return row;
  const bool tensor_core = f != Family::kFallback;
  // The call's buffers hold the statistics' upstream gradients too, for the regularized backward.
  Shape sr = s;
  sr.stat_grads = true;
  DeviceCall c(sr, sizeof(T), !tensor_core);
  const Inputs<T> in = make_inputs<T>(sr, 11, false);
  fill_inputs(sr, c.b, in, [&](void* to, const auto& from) { c.upload(to, from); });
  const FwdParams<float> pf = l.forward(c, false), ps = l.forward(c, true);
  // Timed as autograd calls it with a scale policy (no scale tensor): no d lambda (grad_scale).
  BwdParams<float> pr = l.backward(c, tensor_core);
  pr.d_row_scale = nullptr;
  // The backward of a loss of the output alone: no upstream gradient of the statistics.
  BwdParams<float> pb = pr;
  pb.g_lse = pb.g_entropy = pb.g_sum_p2 = nullptr;
  // (Only the layout's bytes, as the op allocates and zeroes them: the buffer fits either layout.)
  const int64_t g_bytes = dq_accum_elems(s, pb.dq_layout) * 4;
  if (!launched(l.fwd_stats(ps, nullptr))) return row;
  const int warmup = 2;
  if (l.fwd_plain != nullptr) {
    row.fwd = median_ms([&] { EA_CHECK_CUDA(l.fwd_plain(pf, nullptr)); }, warmup, reps);
  }
  row.fwd_stats = median_ms([&] { EA_CHECK_CUDA(l.fwd_stats(ps, nullptr)); }, warmup, reps);
  // The forward with statistics and the backward of `bwd`'s loss.
  const auto fwd_bwd_ms = [&](const BwdParams<float>& bwd) {
    return median_ms(
        [&] {
          EA_CHECK_CUDA(l.fwd_stats(ps, nullptr));
          EA_CHECK_CUDA(cudaMemsetAsync(c.b.dq_accum, 0, g_bytes));
          EA_CHECK_CUDA(l.bwd(bwd, nullptr));
        },
        warmup, reps);
  };
  if (l.bwd_skip.empty()) row.fwd_bwd = fwd_bwd_ms(pb), row.fwd_bwd_reg = fwd_bwd_ms(pr);
  return row;
}

// JSON text: a string with its quotes and escapes; a number, or null where it is not finite (a
// NaN error, the infinite one of a refused launch).
std::string json_string(const std::string& x) {
  std::string out = "\"";
  for (const char ch : x) {
    if (ch == '"' || ch == '\\') {
      out += '\\', out += ch;
    } else if (static_cast<unsigned char>(ch) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", ch);
      out += buf;
    } else {
      out += ch;
    }
  }
  return out + "\"";
}
std::string json_number(double x) {
  if (!std::isfinite(x)) return "null";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.6g", x);
  return buf;
}

double tflops(double flops, double ms) { return ms > 0 ? flops / (ms * 1e-3) / 1e12 : 0; }

struct Options {
  bool quick = false, checks_only = false, sm90_atomic_dq = false;
  std::vector<Family> families;
  std::string json, commit;
};

int usage(const char* why) {
  std::fprintf(stderr,
               "kernel_harness: %s\nusage: kernel_harness [--quick] [--checks-only] "
               "[--families sm80,sm90,fallback] [--sm90-atomic-dq] [--json FILE] [--commit C]\n",
               why);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  bool families_given = false;
  for (int a = 1; a < argc; ++a) {
    const std::string arg = argv[a];
    const bool has_value = a + 1 < argc;
    if (arg == "--quick") {
      o.quick = true;
    } else if (arg == "--checks-only") {
      o.checks_only = true;
    } else if (arg == "--sm90-atomic-dq") {
      o.sm90_atomic_dq = true;
    } else if (arg == "--json" && has_value) {
      o.json = argv[++a];
    } else if (arg == "--commit" && has_value) {
      o.commit = argv[++a];
    } else if (arg == "--families" && has_value) {
      families_given = true;
      std::string list = argv[++a];
      for (size_t at = 0; at <= list.size();) {
        const size_t end = std::min(list.find(',', at), list.size());
        const std::string name = list.substr(at, end - at);
        if (name == "fallback") {
          o.families.push_back(Family::kFallback);
        } else if (name == "sm80") {
          o.families.push_back(Family::kSm80);
        } else if (name == "sm90") {
          o.families.push_back(Family::kSm90);
        } else {
          return usage(("unknown family '" + name + "'").c_str());
        }
        at = end + 1;
      }
    } else if (arg == "--help" || arg == "-h") {
      usage("the CUDA kernels checked and timed without torch");
      return 0;
    } else if (arg == "--json" || arg == "--commit" || arg == "--families") {
      return usage((arg + " needs a value").c_str());
    } else {
      return usage(("unknown argument '" + arg + "'").c_str());
    }
  }

  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "kernel_harness: no CUDA device (cudaGetDeviceCount: %d device(s))\n",
                 devices);
    return 2;
  }
  cudaDeviceProp prop{};
  EA_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  const int cc = prop.major * 10 + prop.minor;
  if (cc < 80) {
    std::fprintf(stderr,
                 "kernel_harness: compute capability %d.%d: the kernels need 8.0 or newer\n",
                 prop.major, prop.minor);
    return 2;
  }
  Device dev;
  dev.sms = prop.multiProcessorCount, dev.l2_bytes = prop.l2CacheSize;
  dev.sm90_bulk_dq = !o.sm90_atomic_dq;
  {  // (as the op and the launchers read it: under ENTROPY_ATTN_CUDA_SMEM_PER_BLOCK)
    cudaError_t err = cudaSuccess;
    dev.smem_optin = smem_per_block(err);
    EA_CHECK_CUDA(err);
  }
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  if (!families_given) o.families = {Family::kSm80, Family::kSm90};
  // A family runs where its kernels exist: sm80 from compute capability 8.0, sm90 on 9.0 alone.
  std::vector<Family> families;
  for (Family f : o.families) {
    if ((f == Family::kSm80 && cc < 80) || (f == Family::kSm90 && cc != 90)) continue;
    families.push_back(f);
  }
  std::printf("# Kernel harness: %s (sm_%d, %d SMs), driver %d, runtime %d%s%s\n\n", prop.name, cc,
              prop.multiProcessorCount, driver, runtime, o.commit.empty() ? "" : ", commit ",
              o.commit.c_str());
  if (sm80::backward_compact(128, dev.smem_optin)) {
    std::printf(
        "%d bytes of shared memory per block: the sm80 backward at D = 128 runs its compact "
        "tiles (64 x 64, one dO buffer).\n\n",
        dev.smem_optin);
  }
  if (cc == 90) {
    std::printf("The sm90 backward adds dq %s.\n\n",
                dev.sm90_bulk_dq ? "by bulk reductions where the call has no mask (as the op does)"
                                 : "by atomics in every call (--sm90-atomic-dq)");
  }

  // 1. Checks, every family the device runs (the fallback included: it anchors the others).
  std::vector<CheckRow> checks;
  std::vector<Family> checked = families;
  if (std::find(checked.begin(), checked.end(), Family::kFallback) == checked.end()) {
    checked.insert(checked.begin(), Family::kFallback);
  }
  for (int d : {64, 128}) {
    for (bool causal : {false, true}) {
      // Against the float64 reference: GQA with partial tiles; Lq != Lk with logn row scales; the
      // statistics' gradients; bool and additive masks (the masked instantiations), the additive
      // one's gradient with the statistics' gradients and without (the Hopper backward writes it
      // in the latter alone), in float32 and in the inputs' type.
      for (const Shape& s :
           {Shape{2, 4, 2, 200, 200, d, causal, false}, Shape{1, 2, 2, 130, 300, d, causal, true},
            Shape{2, 4, 2, 200, 200, d, causal, false, true},
            Shape{2, 4, 2, 200, 200, d, causal, false, true, MaskKind::kBool},
            Shape{1, 2, 2, 130, 300, d, causal, true, true, MaskKind::kAdditive},
            Shape{2, 4, 2, 200, 200, d, causal, false, true, MaskKind::kAdditive, false, true},
            Shape{2, 4, 2, 200, 200, d, causal, false, false, MaskKind::kAdditive, false, true},
            Shape{2, 4, 2, 200, 200, d, causal, false, false, MaskKind::kNone, true}}) {
        check_call<__nv_bfloat16>(checked, dev, "bf16", s, false, checks);
        check_call<__half>(checked, dev, "fp16", s, false, checks);
      }
      // An additive mask in the inputs' own type (a model's bf16 or fp16 bias), with its gradient.
      for (const bool stat_grads : {true, false}) {
        Shape s16{1, 2, 2, 130, 300, d, causal, true, stat_grads, MaskKind::kAdditive, false, true};
        s16.mask_elem = MaskElem::kBFloat16;
        check_call<__nv_bfloat16>(checked, dev, "bf16", s16, false, checks);
        s16.mask_elem = MaskElem::kFloat16;
        check_call<__half>(checked, dev, "fp16", s16, false, checks);
      }
      // A learned bias per key, (B, 1, 1, Lk) (the backwards sum a warp's rows of each key before
      // its atomics: logit_grads.cuh), with the statistics' gradients and without.
      for (const bool stat_grads : {true, false}) {
        Shape key{2, 4, 2, 200, 200, d, causal, false, stat_grads, MaskKind::kAdditive};
        key.mask_grad = key.mask_per_key = true;
        check_call<__nv_bfloat16>(checked, dev, "bf16", key, false, checks);
        check_call<__half>(checked, dev, "fp16", key, false, checks);
      }
      // Against the fallback: many key and query blocks per row, as the timed calls have.
      check_call<__nv_bfloat16>(checked, dev, "bf16",
                                Shape{1, 4, 2, 2048, 2048, d, causal, false, true}, true, checks);
      std::fprintf(stderr, "checked D=%d%s: %zu checks so far\n", d, causal ? " causal" : "",
                   checks.size());
    }
  }
  int failed = 0;
  // The rows [from, end) as a table under `title`, their failures counted; flushed, so that a run
  // cut short keeps what it printed.
  const auto print_checks = [&](const char* title, size_t from) {
    std::printf(
        "## %s\n\n| family | dtype | call | what | error / tol | |\n|---|---|---|---|---|---|\n",
        title);
    for (size_t i = from; i < checks.size(); ++i) {
      const CheckRow& r = checks[i];
      failed += !r.check.ok();
      std::printf("| %s | %s | %s | %s | %.3g / %.3g | %s |\n", r.family.c_str(), r.dtype.c_str(),
                  r.shape.c_str(), r.check.what.c_str(), r.check.error, r.check.tol,
                  r.check.ok() ? "ok" : "**FAILED**");
    }
    std::printf("\n");
    std::fflush(stdout);
  };
  print_checks("Checks against the float64 reference", 0);
  // Head dim 256 (Gemma's), in the families that compile the call's kernels there (the Hopper
  // family's only in a build with the kernels compiled on request: untested_kernels.h; the device
  // bundle's): GQA with partial blocks and the statistics' gradients, Lq != Lk with logn row
  // scales, a bool mask, an additive one. A table of its own, after the one above: kernels that
  // have not run on a GPU yet may fault or hang, which must not take the other results with them.
  const size_t head_dim_256_from = checks.size();
  for (bool causal : {false, true}) {
    for (const Shape& s :
         {Shape{2, 4, 2, 200, 150, 256, causal, false, true},
          Shape{1, 2, 2, 130, 300, 256, causal, true},
          Shape{2, 4, 2, 200, 150, 256, causal, false, true, MaskKind::kBool},
          Shape{1, 2, 2, 130, 300, 256, causal, true, false, MaskKind::kAdditive}}) {
      std::vector<Family> at_256;
      for (Family f : checked) {
        if (forward_of<__nv_bfloat16>(f, 256, true, true, s.mask) != nullptr) at_256.push_back(f);
      }
      check_call<__nv_bfloat16>(at_256, dev, "bf16", s, false, checks);
      check_call<__half>(at_256, dev, "fp16", s, false, checks);
    }
  }
  print_checks("Head dim 256 (against the float64 reference)", head_dim_256_from);
  // Deterministic backwards (the sm80 family's dq kernel, the Hopper family's dq in turns), last
  // and in a table of their own (a turn never reached would spin until the caller's bound: the
  // table above is out by then): six key blocks adding into each query block's dq, GQA, the
  // statistics' gradients; twice, bits compared.
  const size_t deterministic_from = checks.size();
  for (int d : {64, 128}) {
    for (bool causal : {false, true}) {
      Shape det{1, 4, 2, 700, 700, d, causal, false, true};
      det.deterministic = true;
      check_call<__nv_bfloat16>(checked, dev, "bf16", det, false, checks);
    }
  }
  print_checks("Deterministic backwards (against the float64 reference, and a second run's bits)",
               deterministic_from);
  std::printf("\n%zu checks, %d failed\n\n", checks.size(), failed);

  // 2. Timings.
  std::vector<TimeRow> times;
  if (!o.checks_only) {
    const std::vector<int64_t> lens =
        o.quick ? std::vector<int64_t>{1024, 4096} : std::vector<int64_t>{1024, 4096, 16384};
    for (Family f : families) {
      for (auto [h, hkv] : {std::pair<int64_t, int64_t>{16, 16}, {32, 8}}) {
        for (int64_t d : {64, 128}) {
          for (int64_t l : lens) {
            for (bool causal : {false, true}) {
              const Shape s{4, h, hkv, l, l, d, causal, false};
              times.push_back(time_call(f, s, dev, l >= 16384 ? 5 : 20));
              // Progress on stderr (the tables go to stdout).
              std::fprintf(stderr, "timed %zu/%zu: %s %s\n", times.size(),
                           families.size() * 2 * 2 * lens.size() * 2, family_name(f),
                           describe(s).c_str());
            }
          }
        }
      }
    }
    std::printf(
        "## Times (bf16, medians of CUDA events)\n\n| family | B | H:Hkv | D | L | causal | fwd ms "
        "| fwd+stats ms | fwd+stats+bwd ms | the same, regularized ms | fwd TFLOP/s | fwd+stats "
        "TFLOP/s | fwd+bwd TFLOP/s | regularized TFLOP/s |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (const TimeRow& t : times) {
      const double flops = t.s.forward_flops();
      std::printf(
          "| %s | %lld | %lld:%lld | %lld | %lld | %s | %.4g | %.4g | %.4g | %.4g | %.1f | %.1f "
          "| %.1f | %.1f |\n",
          t.family.c_str(), static_cast<long long>(t.s.batch), static_cast<long long>(t.s.heads),
          static_cast<long long>(t.s.kv_heads), static_cast<long long>(t.s.head_dim),
          static_cast<long long>(t.s.q_len), t.s.causal ? "yes" : "no", t.fwd, t.fwd_stats,
          t.fwd_bwd, t.fwd_bwd_reg, tflops(flops, t.fwd), tflops(flops, t.fwd_stats),
          tflops(3.5 * flops, t.fwd_bwd), tflops(3.5 * flops, t.fwd_bwd_reg));
    }
  }

  if (!o.json.empty()) {
    FILE* out = std::fopen(o.json.c_str(), "w");
    if (out == nullptr) return usage(("cannot write " + o.json).c_str());
    std::fprintf(out,
                 "{\"device\": %s, \"compute_capability\": %d, \"driver\": %d, "
                 "\"runtime\": %d, \"commit\": %s, \"sm90_dq\": %s,\n \"checks\": [",
                 json_string(prop.name).c_str(), cc, driver, runtime, json_string(o.commit).c_str(),
                 dev.sm90_bulk_dq ? "\"bulk\"" : "\"atomic\"");
    for (size_t i = 0; i < checks.size(); ++i) {
      const CheckRow& r = checks[i];
      std::fprintf(out,
                   "%s\n  {\"family\": %s, \"dtype\": %s, \"call\": %s, \"what\": %s, "
                   "\"error\": %s, \"tol\": %s, \"ok\": %s}",
                   i ? "," : "", json_string(r.family).c_str(), json_string(r.dtype).c_str(),
                   json_string(r.shape).c_str(), json_string(r.check.what).c_str(),
                   json_number(r.check.error).c_str(), json_number(r.check.tol).c_str(),
                   r.check.ok() ? "true" : "false");
    }
    std::fprintf(out, "],\n \"points\": [");
    for (size_t i = 0; i < times.size(); ++i) {
      const TimeRow& t = times[i];
      std::fprintf(out,
                   "%s\n  {\"family\": %s, \"dtype\": %s, \"batch\": %lld, "
                   "\"heads\": %lld, \"kv_heads\": %lld, \"head_dim\": %lld, "
                   "\"seq_len\": %lld, \"causal\": %s, \"fwd_ms\": %s, "
                   "\"fwd_stats_ms\": %s, \"fwd_bwd_ms\": %s, \"fwd_bwd_reg_ms\": %s}",
                   i ? "," : "", json_string(t.family).c_str(), json_string(t.dtype).c_str(),
                   static_cast<long long>(t.s.batch), static_cast<long long>(t.s.heads),
                   static_cast<long long>(t.s.kv_heads), static_cast<long long>(t.s.head_dim),
                   static_cast<long long>(t.s.q_len), t.s.causal ? "true" : "false",
                   json_number(t.fwd).c_str(), json_number(t.fwd_stats).c_str(),
                   json_number(t.fwd_bwd).c_str(), json_number(t.fwd_bwd_reg).c_str());
    }
    std::fprintf(out, "]}\n");
    std::fclose(out);
  }
  return failed ? 1 : 0;
}
