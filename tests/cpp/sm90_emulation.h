// The Hopper family's kernels on the CPU (test_sm90_emulation.cpp): their emulated launches, with
// the launchers' arguments, grids and shared memory (csrc/cuda/sm90/fwd_launch.cuh,
// bwd_launch.cuh), and the checks of a call against the kernel harness's float64 reference
// (benchmarks/harness/kernel_harness.h).
#pragma once

// clang-format off
#include "cuda_emulation.h"  // first: the CUDA built-ins the kernel headers use
#include "emulated_sm90_ops.h"  // before any CuTe header (shared addresses)
// clang-format on

#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "cuda/sm80/bwd_kernel.cuh"
#include "cuda/sm90/bwd_kernel.cuh"
#include "cuda/sm90/fwd_kernel.cuh"
#include "cuda/sm90/launch.h"
#include "kernel_harness.h"
#include "sm80_emulation.h"

namespace sm90_emulation {

namespace ec = entropy_attn::cuda;
namespace eh = entropy_attn::harness;
namespace s9f = entropy_attn::cuda::sm90::fwd_impl;
namespace s9b = entropy_attn::cuda::sm90::bwd_impl;
using entropy_attn::MaskElem;
using entropy_attn::MaskKind;

// An emulated launch of a Hopper kernel: 384 threads, the kernel's shared memory (whose offsets
// are the shared addresses of its descriptors).
inline EmulatedLaunch hopper_launch(dim3 grid, int threads, size_t smem_bytes, char* smem) {
  EmulatedLaunch l;
  l.grid = grid;
  l.threads = threads;
  l.smem_bytes = smem_bytes;
  l.smem = reinterpret_cast<unsigned char*>(smem);
  cuda_emu::g_sm90_smem = l.smem;
  return l;
}

// sm90/fwd_launch.cuh's launch_forward.
template <typename T, int kD, bool kCausal, MaskKind kMask, bool kStats>
void launch_forward(const ec::FwdParams<float>& p) {
  using Kt = s9f::FwdTraits<T, kD, kMask, cuda_emu::sm90::Ops>;
  ASSERT_TRUE(ec::sm90::covers(p, kD, kCausal));
  const s9f::KernelArgs<Kt> args = s9f::make_kernel_args<Kt>(p);
  const EmulatedLaunch l =
      hopper_launch(s9f::grid<Kt>(p), Kt::kThreads, Kt::kSmemBytes, s9f::ea_sm90_fwd_smem);
  emulate_launch(s9f::forward_kernel<T, Kt, kCausal, kMask, kStats>, l, args);
}

// sm90/bwd_launch.cuh's launch_backward: the preprocess (the sm80 family's delta, and the turn
// counters), the Hopper main kernel, the sm80 family's dq / d lambda postprocess.
template <typename T, int kD, bool kCausal, MaskKind kMask>
void launch_backward(const ec::BwdParams<float>& given) {
  const ec::BwdParams<float> p = s9b::launch_params<kMask>(given);
  using Kt = s9b::BwdTraits<T, kD, cuda_emu::sm90::Ops>;
  using Rows = sm80_emulation::EmulatedTraits<T, kD, false>;
  namespace sb = entropy_attn::cuda::sm80::bwd;
  ASSERT_TRUE(ec::sm90::backward_covers(p, kD, kCausal));
  EmulatedLaunch l;
  l.threads = Rows::kNThreads;
  l.smem = reinterpret_cast<unsigned char*>(sb::smem);
  l.grid = sm80_emulation::row_grid(p.q_len, Rows::kPreRows, p.heads, p.batch);
  emulate_launch(s9b::preprocess_kernel<Kt, Rows>, l, p);
  const s9b::KernelArgs<Kt> args = s9b::make_kernel_args<Kt>(p);
  emulate_launch(
      s9b::kernel_for<T, Kt, kCausal, kMask>(p),
      hopper_launch(s9b::grid<Kt>(p), Kt::kThreads, s9b::smem_bytes<Kt>(p), s9b::ea_sm90_bwd_smem),
      args);
  l.grid = sm80_emulation::row_grid(p.q_len, Rows::kPostRows, p.heads, p.batch);
  emulate_launch(sb::postprocess_kernel<Rows>, l, p);
}

// One forward against the reference (sm80_emulation.h: expect_forward), on a grid of one block per
// tile, or a persistent grid of `persistent_blocks` blocks (params.h), with the tiles in launch
// order over `sections` sections (launch_order.h).
template <typename T, int kD, bool kCausal, MaskKind kMask, bool kStats>
void run_forward(const eh::Shape& s, int persistent_blocks = 0, int sections = 0) {
  ASSERT_EQ(s.head_dim, kD);
  ASSERT_EQ(s.mask, kMask);
  ASSERT_TRUE(kCausal || (!s.causal && s.mask == MaskKind::kNone));
  eh::HostCall<T> c(s, 11);
  ec::FwdParams<float> p = eh::forward_params(s, c.b, kStats);
  p.persistent_blocks = persistent_blocks;
  p.launch_sections = sections;
  launch_forward<T, kD, kCausal, kMask, kStats>(p);
  sm80_emulation::expect_forward<T, kStats>(s, c);
}

// One backward: the fallback forward's statistics, the Hopper backward (with bulk_dq, dq's partial
// sums added by bulk reductions: sm90/launch.h, bulk_dq_accum; without dlam, no d lambda asked for:
// G summed from lambda dS, params.h: g_scaled; deterministic, those reductions in the key blocks'
// order: params.h, dq_turns), and its gradients against the reference (the additive mask's too,
// with s.mask_grad). Deterministic (with bulk_dq or by atomics, the masked kernels' way), the turn
// counters start as -1 (the preprocess must start them)
// and each must end at the key block with a walk after the last key block that walks its query
// block (key_ranges.cuh: query_blocks, walking_block_from), or where it started if none does.
template <typename T, int kD, bool kCausal, MaskKind kMask>
void run_backward(const eh::Shape& s, bool bulk_dq = false, bool dlam = true,
                  bool deterministic = false) {
  ASSERT_EQ(s.head_dim, kD);
  ASSERT_EQ(s.mask, kMask);
  ASSERT_TRUE(kCausal || (!s.causal && s.mask == MaskKind::kNone));
  ASSERT_FALSE(s.mask_grad && s.stat_grads)
      << "a mask's gradient beside the statistics' gradients runs in the sm80 family (launch.h)";
  eh::HostCall<T> c(s, 11);
  ec::BwdParams<float> p = sm80_emulation::backward_inputs(s, c);
  if (bulk_dq) p.dq_layout = ec::sm90::bulk_dq_accum(s.q_len, kD);
  if (!dlam) p.d_row_scale = nullptr;
  using Kt = s9b::BwdTraits<T, kD>;
  const int m_blocks = static_cast<int>((p.dq_layout.rows + Kt::kBlockM - 1) / Kt::kBlockM);
  std::vector<int> turns;
  if (deterministic) {
    turns.assign(static_cast<size_t>(s.batch * s.heads * m_blocks), -1);
    p.deterministic = true;
    p.dq_turns = turns.data();
  }
  launch_backward<T, kD, kCausal, kMask>(p);
  sm80_emulation::expect_backward(s, c, 0, dlam);
  if (!deterministic) return;
  const int q_len = static_cast<int>(s.q_len), kv_len = static_cast<int>(s.kv_len);
  std::vector<int> last(static_cast<size_t>(m_blocks), -1);  // each query block's last walker
  int walking = 0;
  for (int n = 0; n * Kt::kBlockN < kv_len; ++n) {
    const int j0 = n * Kt::kBlockN;
    const ec::BlockRange r = ec::query_blocks<kCausal>(
        p.pattern, q_len, kv_len, j0, std::min(j0 + Kt::kBlockN, kv_len), Kt::kBlockM);
    walking += r.end > r.begin;
    for (int m = r.begin; m < r.end; ++m) last[static_cast<size_t>(m)] = n;
  }
  EXPECT_GT(walking, 0);
  for (int64_t bh = 0; bh < s.batch * s.heads; ++bh) {
    for (int m = 0; m < m_blocks; ++m) {
      const int n = last[static_cast<size_t>(m)];
      const int end =
          n < 0 ? ec::first_walker<kCausal>(p.pattern, m, q_len, kv_len, Kt::kBlockM, Kt::kBlockN)
                : ec::walking_block_from<kCausal>(p.pattern, n + 1, q_len, kv_len, Kt::kBlockN);
      EXPECT_EQ(turns[static_cast<size_t>(bh * m_blocks + m)], end)
          << "the turn counter of (batch x head " << bh << ", query block " << m << ")";
    }
  }
}

}  // namespace sm90_emulation
