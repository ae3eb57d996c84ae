// The Hopper (sm90) family run on the CPU: its kernels (csrc/cuda/sm90/fwd_kernel.cuh,
// bwd_kernel.cuh) compiled by the host compiler with emulated sm_90a instructions
// (emulated_sm90_ops.h: TMA, mbarriers, the TMA pipeline, named barriers, wgmma) on emulated thread
// blocks of three warpgroups (cuda_emulation.h), with the launchers' arguments and grids
// (sm90_emulation.h). What this checks on any machine: the kernels' TMA boxes and wgmma
// descriptors, their pipelines' phases, the producer / consumer hand-offs and the ping-pong of the
// consumer warpgroups, indexing, masking, statistics and gradients; not the hardware's timing.
// Against the kernel harness's float64 reference (benchmarks/harness/kernel_harness.h).
#include "sm90_emulation.h"

namespace {

using namespace sm90_emulation;

// Shape{batch, heads, kv_heads, q_len, kv_len, head_dim, causal, logn, stat_grads, mask}.

TEST(EmulatedSm90Forward, FullAttention) {
  // GQA, a partial query tile and key block, Lq != Lk with logn row scales; with and without
  // statistics (the plain instantiations: the scale folded into the exponent).
  run_forward<__nv_bfloat16, 64, false, MaskKind::kNone, true>(
      eh::Shape{1, 2, 1, 150, 200, 64, false, true});
  run_forward<__half, 128, false, MaskKind::kNone, false>(
      eh::Shape{2, 2, 2, 70, 300, 128, false, false});
}

TEST(EmulatedSm90Forward, Causal) {
  // The general instantiations: the predicated blocks on the diagonal, causal block skipping, two
  // query tiles of different lengths.
  run_forward<__half, 64, true, MaskKind::kNone, true>(
      eh::Shape{1, 2, 1, 200, 200, 64, true, true});
  run_forward<__nv_bfloat16, 128, true, MaskKind::kNone, true>(
      eh::Shape{1, 2, 2, 130, 260, 128, true, false});
}

TEST(EmulatedSm90Forward, Masked) {
  // The masked instantiations: the mask tile by cp.async, n_i counted over the allowed keys; at
  // D = 128 112-key blocks (S as one m64n112 wgmma).
  run_forward<__nv_bfloat16, 128, true, MaskKind::kBool, true>(
      eh::Shape{1, 2, 1, 90, 250, 128, false, true, false, MaskKind::kBool});
  run_forward<__half, 64, true, MaskKind::kAdditive, true>(
      eh::Shape{1, 2, 2, 140, 140, 64, true, true, false, MaskKind::kAdditive});
}

TEST(EmulatedSm90Backward, D64) {
  // One 64 x 64 slice per warpgroup (BwdTraits::kSlices = 1), GQA, causal, the statistics'
  // gradients; and full attention with logn over two key blocks.
  run_backward<__nv_bfloat16, 64, true, MaskKind::kNone>(
      eh::Shape{1, 4, 2, 100, 150, 64, true, false, true});
  run_backward<__half, 64, false, MaskKind::kNone>(
      eh::Shape{1, 2, 2, 70, 200, 64, false, true, true});
}

TEST(EmulatedSm90Backward, D128) {
  // Two slices of 64 keys.
  run_backward<__half, 128, false, MaskKind::kNone>(
      eh::Shape{1, 2, 1, 90, 140, 128, false, true, true});
  run_backward<__nv_bfloat16, 128, true, MaskKind::kNone>(
      eh::Shape{1, 2, 2, 130, 130, 128, true, false, false});
}

TEST(EmulatedSm90Backward, BulkDq) {
  // dq's partial sums through the shared tile and the dq writer's bulk reductions (bwd_kernel.cuh:
  // write_dq): a partial last query block (its zero rows added into the padding), GQA (the
  // group's query heads walked by one key block), causal and full, both head dims.
  run_backward<__nv_bfloat16, 64, true, MaskKind::kNone>(
      eh::Shape{1, 4, 2, 100, 150, 64, true, false, true}, true);
  run_backward<__half, 128, false, MaskKind::kNone>(
      eh::Shape{2, 2, 1, 90, 140, 128, false, true, true}, true);
  run_backward<__nv_bfloat16, 128, true, MaskKind::kNone>(
      eh::Shape{1, 2, 2, 130, 130, 128, true, false, false}, true);
}

TEST(EmulatedSm90Backward, BulkDqRefusedWithAMask) {
  // The masked kernels add G by atomics only: their launcher refuses a bulk layout.
  const eh::Shape s{1, 2, 1, 70, 150, 128, false, false, false, MaskKind::kBool};
  eh::HostCall<__nv_bfloat16> c(s, 11);
  ec::BwdParams<float> p = eh::backward_params(s, c.b, true);
  EXPECT_TRUE(ec::sm90::backward_covers(p, 128, true));
  p.dq_layout = ec::sm90::bulk_dq_accum(s.q_len, 128);
  EXPECT_FALSE(ec::sm90::backward_covers(p, 128, true));
  p.mask.kind = MaskKind::kNone;
  p.mask.data = nullptr;
  EXPECT_TRUE(ec::sm90::backward_covers(p, 128, true));
  p.dq_layout.ld = 128;  // a layout the kernels do not write
  EXPECT_FALSE(ec::sm90::backward_covers(p, 128, true));
}

TEST(EmulatedSm90Backward, Masked) {
  run_backward<__nv_bfloat16, 128, true, MaskKind::kBool>(
      eh::Shape{1, 2, 1, 70, 150, 128, false, false, true, MaskKind::kBool});
  run_backward<__half, 64, true, MaskKind::kAdditive>(
      eh::Shape{1, 2, 2, 80, 80, 64, true, true, true, MaskKind::kAdditive});
}

}  // namespace
