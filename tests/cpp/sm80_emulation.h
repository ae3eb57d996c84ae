// The sm80 family's kernels on the CPU (test_sm80_emulation.cpp, test_sm80_emulation_features.cpp):
// their emulated launches, with the launchers' grids and shared memory (csrc/cuda/sm80/
// fwd_launch.cuh, bwd_launch.cuh), and the checks of a call against the kernel harness's float64
// reference (benchmarks/harness/kernel_harness.h).
#pragma once

// clang-format off
#include "cuda_emulation.h"  // first: the CUDA built-ins the kernel headers use
#include "emulated_sm80_ops.h"
// clang-format on

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "cuda/sm80/bwd_kernel.cuh"
#include "cuda/sm80/fwd_kernel.cuh"
#include "cuda/sm80/launch.h"
#include "cuda/sm80/split_kv.cuh"
#include "emulated_launches.h"
#include "kernel_harness.h"

namespace sm80_emulation {

namespace ec = entropy_attn::cuda;
namespace eh = entropy_attn::harness;
namespace sb = entropy_attn::cuda::sm80::bwd;
namespace sf = entropy_attn::cuda::sm80::fwd_impl;
using entropy_attn::MaskElem;
using entropy_attn::MaskKind;

template <typename T, int kD, bool kCompact>
using EmulatedTraits = sb::BwdTraits<T, kD, kCompact, cuda_emu::sm80::Ops>;

inline dim3 row_grid(int64_t len, int rows_per_block, int64_t heads, int64_t batch) {
  return dim3(static_cast<unsigned>((len + rows_per_block - 1) / rows_per_block),
              static_cast<unsigned>(heads), static_cast<unsigned>(batch));
}

// The kernels of sm80/bwd_launch.cuh's launch_tiles, in its order, grids and shared memory.
template <typename T, int kD, bool kCompact, bool kCausal, MaskKind kMask>
void launch_backward(const ec::BwdParams<float>& p) {
  using Kt = EmulatedTraits<T, kD, kCompact>;
  using Rows = EmulatedTraits<T, kD, false>;
  EmulatedLaunch l;
  l.threads = Kt::kNThreads;
  l.smem = reinterpret_cast<unsigned char*>(sb::smem);
  l.grid = row_grid(p.q_len, Rows::kPreRows, p.heads, p.batch);
  emulate_launch(sb::preprocess_kernel<Rows>, l, p);
  if (p.deterministic) {
    l.grid = row_grid(p.q_len, Kt::kBlockM, p.heads, p.batch);
    l.smem_bytes = Kt::kDqBytes;
    emulate_launch(sb::dq_kernel<Kt, kCausal, kMask>, l, p);
  }
  l.grid = row_grid(p.kv_len, Kt::kBlockN, p.kv_heads, p.batch);
  l.smem_bytes = Kt::kMainBytes;
  emulate_launch(sb::main_kernel<Kt, kCausal, kMask>, l, p);
  l.grid = row_grid(p.q_len, Rows::kPostRows, p.heads, p.batch);
  l.smem_bytes = 0;
  emulate_launch(sb::postprocess_kernel<Rows>, l, p);
}

// The kernels of sm80/fwd_launch.cuh's launch_forward: the forward over (query tiles x split-KV
// parts, heads, batch), then the combine where the keys were split.
template <typename T, int kD, bool kCausal, MaskKind kMask, bool kStats>
void launch_forward(const ec::FwdParams<float>& p) {
  using Kt = sf::FwdTraits<T, kD, kMask, kStats, cuda_emu::sm80::Ops>;
  const int64_t tiles = (p.q_len + Kt::kBlockM - 1) / Kt::kBlockM;
  const int splits = kCausal ? p.num_splits : 1;
  EmulatedLaunch l;
  l.threads = Kt::kThreads;
  l.smem = reinterpret_cast<unsigned char*>(sf::ea_sm80_fwd_smem);
  l.smem_bytes = Kt::kSmemBytes;
  l.grid = dim3(static_cast<unsigned>(tiles * splits), static_cast<unsigned>(p.heads),
                static_cast<unsigned>(p.batch));
  emulate_launch(sf::forward_kernel<Kt, kCausal, kMask, kStats>, l, p);
  if (splits > 1) {
    const int64_t rows = p.batch * p.heads * p.q_len;
    l.threads = sf::kCombineWarps * 32;
    l.smem_bytes = 0;
    l.grid = dim3(static_cast<unsigned>((rows + sf::kCombineWarps - 1) / sf::kCombineWarps));
    emulate_launch(sf::split_combine_kernel<T, kD, kStats>, l, p);
  }
}

inline void expect_ok(const eh::Check& c) {
  EXPECT_TRUE(c.ok()) << c.what << ": " << c.error << " > " << c.tol;
}

// A call's forward outputs against the reference: out and lse, and with kStats the entropy and
// sum p^2.
template <typename T, bool kStats>
void expect_forward(const eh::Shape& s, const eh::HostCall<T>& c) {
  const eh::Forward ref = eh::reference_forward(s, c.in);
  const eh::Tolerance tol = eh::tolerance<T>();
  expect_ok(eh::elementwise("out", eh::output_in_head_order(s, c.widen(c.b.out, s.q_elems())),
                            ref.out, tol));
  expect_ok(eh::elementwise("lse", c.rows(c.b.lse), ref.lse, tol));
  if constexpr (kStats) {
    expect_ok(eh::elementwise("entropy", c.rows(c.b.entropy), ref.entropy, tol));
    expect_ok(eh::elementwise("sum_p2", c.rows(c.b.sum_p2), ref.sum_p2, tol));
  }
}

// The backward's parameters of a call, its statistics from the emulated fallback forward.
template <typename T>
ec::BwdParams<float> backward_inputs(const eh::Shape& s, eh::HostCall<T>& c) {
  emulated::launch_forward<T>(eh::forward_params(s, c.b, true));
  std::memset(c.b.dq_accum, 0, eh::dq_accum_elems(s) * sizeof(float));
  return eh::backward_params(s, c.b, true);
}

// A call's gradients against the reference (the additive mask's too, with s.mask_grad); d lambda
// (unless the call did not ask for it: dlam false) within `dlam_tol` where given (a call whose d
// lambda cancels more than ordinary logits make it), else the gradients' tolerance.
template <typename T>
void expect_backward(const eh::Shape& s, const eh::HostCall<T>& c, double dlam_tol = 0,
                     bool dlam = true) {
  const eh::Backward gref = eh::reference_backward(s, c.in, eh::reference_forward(s, c.in));
  const double tol = eh::tolerance<T>().grad;
  expect_ok(
      eh::relative("dq", eh::output_in_head_order(s, c.widen(c.b.dq, s.q_elems())), gref.dq, tol));
  expect_ok(
      eh::relative("dk", eh::kv_in_head_order(s, c.widen(c.b.dk, s.kv_elems())), gref.dk, tol));
  expect_ok(
      eh::relative("dv", eh::kv_in_head_order(s, c.widen(c.b.dv, s.kv_elems())), gref.dv, tol));
  if (s.mask_grad) {
    const std::vector<float> d_mask(c.b.d_mask, c.b.d_mask + s.batch * s.mask_rows() * s.kv_len);
    expect_ok(eh::relative("d mask", d_mask, gref.dmask, tol));
  }
  if (!dlam) return;
  expect_ok(
      eh::relative("d lambda", c.rows(c.b.d_row_scale), gref.dlam, dlam_tol > 0 ? dlam_tol : tol));
}

// One forward (the instantiation a call of this shape selects: the general one for causal, masked
// or split calls) in `splits` split-KV parts, against the reference: out and lse, and with kStats
// the entropy and sum p^2.
template <typename T, int kD, bool kCausal, MaskKind kMask, bool kStats>
void run_forward(const eh::Shape& s, int splits = 1) {
  ASSERT_EQ(s.head_dim, kD);
  ASSERT_EQ(s.mask, kMask);
  ASSERT_TRUE(kCausal || (!s.causal && s.mask == MaskKind::kNone && splits == 1));
  eh::HostCall<T> c(s, 11);
  ec::FwdParams<float> p = eh::forward_params(s, c.b, kStats);
  std::vector<float> o_partial, state_partial;
  if (splits > 1) {
    o_partial.assign(static_cast<size_t>(splits * s.rows() * kD), NAN);
    state_partial.assign(static_cast<size_t>(splits * s.rows() * 4), NAN);
    p.num_splits = splits, p.o_partial = o_partial.data(), p.state_partial = state_partial.data();
  }
  launch_forward<T, kD, kCausal, kMask, kStats>(p);
  expect_forward<T, kStats>(s, c);
}

// One backward: the fallback forward's statistics, the sm80 backward (the full or the compact
// tiles; the instantiation a call of this shape selects), and its gradients against the reference.
// Without dlam the call asks for no d lambda (d_row_scale null: the postprocess forms dq alone).
template <typename T, int kD, bool kCompact, bool kCausal, MaskKind kMask>
void run_case(const eh::Shape& s, bool deterministic = false, bool dlam = true) {
  ASSERT_EQ(s.head_dim, kD);
  ASSERT_EQ(s.mask, kMask);
  ASSERT_TRUE(kCausal || (!s.causal && s.mask == MaskKind::kNone));
  eh::HostCall<T> c(s, 11);
  ec::BwdParams<float> p = backward_inputs(s, c);
  p.deterministic = deterministic;
  if (!dlam) p.d_row_scale = nullptr;
  launch_backward<T, kD, kCompact, kCausal, kMask>(p);
  expect_backward(s, c, 0, dlam);
}

}  // namespace sm80_emulation
