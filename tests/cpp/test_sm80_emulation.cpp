// The sm80 (tensor-core) family run on the CPU: its kernels (csrc/cuda/sm80/fwd_kernel.cuh,
// split_kv.cuh, bwd_kernel.cuh) compiled by the host compiler with emulated sm_80 instructions
// (emulated_sm80_ops.h) on emulated thread blocks (cuda_emulation.h), with the launchers' grids
// and shared memory (sm80_emulation.h). What this checks on any machine: the kernels' indexing,
// tiling, masking, statistics and gradients, the barriers between cp.async and ldmatrix (the
// emulation reports shared-memory hazards) and the cp.async waits (a copy's destination holds NaN
// until its wait); not the hardware's timing or its own instructions.
// Against the kernel harness's float64 reference (benchmarks/harness/kernel_harness.h):
//   forward:  D = 64 and 128 (and the masked 64 x 64 tiles), with and without statistics, plain
//             full attention and the general (causal) instantiations, split-KV with its combine;
//             D = 256 (64 x 32 tiles, the general instantiations alone) with each mask kind;
//   backward: the full tiles and the compact ones (64 x 64, one dO buffer: GPUs with 99 KB of
//             shared memory per block), with and without masks, the atomic and the deterministic
//             dq; D = 256 (64 x 64 tiles, G = dS K in two column halves); the additive mask's
//             gradient. Its statistics come from the emulated fallback forward.
// The features of the general instantiations: test_sm80_emulation_features.cpp. Last, a test that
// the cp.async checks catch the mistakes they are for.
#include <cstring>
#include <string>
#include <vector>

#include "sm80_emulation.h"

namespace {

using namespace sm80_emulation;

// Shape{batch, heads, kv_heads, q_len, kv_len, head_dim, causal, logn, stat_grads, mask,
// heads_inside_rows}.

TEST(EmulatedSm80Forward, FullAttention) {
  // GQA, partial query tiles and key blocks, Lq != Lk with logn row scales; with and without
  // statistics (lse only); an output in (B, Lq, H, D) memory.
  run_forward<__nv_bfloat16, 64, false, MaskKind::kNone, true>(
      eh::Shape{1, 4, 2, 150, 200, 64, false, true});
  run_forward<__half, 128, false, MaskKind::kNone, true>(
      eh::Shape{2, 2, 1, 130, 90, 128, false, false, false, MaskKind::kNone, true});
  run_forward<__half, 128, false, MaskKind::kNone, false>(
      eh::Shape{1, 2, 2, 70, 100, 128, false, true});
}

TEST(EmulatedSm80Forward, CausalAndMasked) {
  run_forward<__half, 64, true, MaskKind::kNone, true>(
      eh::Shape{1, 2, 1, 200, 200, 64, true, true});
  run_forward<__nv_bfloat16, 128, true, MaskKind::kNone, false>(
      eh::Shape{1, 2, 2, 140, 170, 128, true, false});
  // The masked tiles (64 x 64 at D = 128).
  run_forward<__nv_bfloat16, 128, true, MaskKind::kBool, true>(
      eh::Shape{1, 2, 1, 90, 110, 128, false, false, false, MaskKind::kBool});
  run_forward<__half, 64, true, MaskKind::kAdditive, true>(
      eh::Shape{1, 2, 2, 100, 100, 64, true, true, false, MaskKind::kAdditive});
}

TEST(EmulatedSm80Forward, AdditiveMaskInTheInputsType) {
  // A bf16 or fp16 bias read as it is (kernel_args.h: MaskElem): an odd key count puts every
  // other row's entries at the second half of their 4-byte words (mask_words.cuh's selectors),
  // in the 64 x 64 tiles of a masked D = 128 kernel and the 128 x 64 ones at D = 64.
  eh::Shape s{1, 2, 2, 90, 101, 128, true, true, false, MaskKind::kAdditive};
  s.mask_elem = MaskElem::kBFloat16;
  run_forward<__nv_bfloat16, 128, true, MaskKind::kAdditive, true>(s);
  s = eh::Shape{2, 2, 1, 140, 133, 64, false, false, false, MaskKind::kAdditive};
  s.mask_elem = MaskElem::kFloat16;
  run_forward<__half, 64, true, MaskKind::kAdditive, false>(s);
  s = eh::Shape{1, 2, 2, 70, 99, 256, true, false, false, MaskKind::kAdditive};
  s.mask_elem = MaskElem::kBFloat16;
  run_forward<__nv_bfloat16, 256, true, MaskKind::kAdditive, true>(s);
}

TEST(EmulatedSm80Forward, SplitKv) {
  // A few query rows against many keys in 3 parts (one of them over a partial block), combined
  // (the second into an output in (B, Lq, H, D) memory).
  run_forward<__nv_bfloat16, 128, true, MaskKind::kNone, true>(
      eh::Shape{1, 4, 2, 5, 300, 128, false, true}, 3);
  run_forward<__half, 64, true, MaskKind::kNone, false>(
      eh::Shape{2, 2, 2, 3, 260, 64, false, false, false, MaskKind::kNone, true}, 2);
}

TEST(EmulatedSm80Forward, HeadDim256) {
  // Gemma's head dim, which has the general (causal) instantiations alone, in 64 x 32 tiles: causal
  // GQA with logn row scales, plain full attention without statistics (an output in (B, Lq, H, D)
  // memory), both mask kinds, and split-KV decoding rows.
  run_forward<__nv_bfloat16, 256, true, MaskKind::kNone, true>(
      eh::Shape{1, 4, 2, 100, 100, 256, true, true});
  run_forward<__half, 256, true, MaskKind::kNone, false>(
      eh::Shape{1, 2, 2, 70, 90, 256, false, false, false, MaskKind::kNone, true});
  run_forward<__half, 256, true, MaskKind::kBool, true>(
      eh::Shape{1, 2, 1, 50, 70, 256, false, true, false, MaskKind::kBool});
  run_forward<__nv_bfloat16, 256, true, MaskKind::kAdditive, true>(
      eh::Shape{1, 2, 2, 60, 60, 256, true, false, false, MaskKind::kAdditive});
  run_forward<__nv_bfloat16, 256, true, MaskKind::kNone, true>(
      eh::Shape{1, 2, 1, 3, 150, 256, false, true}, 3);
}

TEST(EmulatedSm80Backward, FullTilesD64) {
  // GQA with partial blocks, causal (the general instantiation), the statistics' gradients.
  run_case<__nv_bfloat16, 64, false, true, MaskKind::kNone>(
      eh::Shape{1, 4, 2, 70, 90, 64, true, false, true});
}

TEST(EmulatedSm80Backward, FullTilesD128) {
  // Plain full attention, Lq != Lk with logn row scales over two key blocks; dq, dk and dv in
  // (B, L, H, D) memory.
  run_case<__half, 128, false, false, MaskKind::kNone>(
      eh::Shape{1, 2, 2, 40, 150, 128, false, true, true, MaskKind::kNone, true});
}

TEST(EmulatedSm80Backward, FullTilesD256) {
  // 64 x 64 tiles, G = dS K in two halves of 128 columns and the postprocess in two steps a row:
  // GQA causal with the statistics' gradients over three key blocks, a plain call with its
  // gradients in (B, L, H, D) memory, both mask kinds, and the deterministic dq.
  run_case<__nv_bfloat16, 256, false, true, MaskKind::kNone>(
      eh::Shape{1, 4, 2, 90, 150, 256, true, true, true});
  run_case<__half, 256, false, true, MaskKind::kNone>(
      eh::Shape{1, 2, 2, 70, 70, 256, false, false, true, MaskKind::kNone, true});
  run_case<__half, 256, false, true, MaskKind::kBool>(
      eh::Shape{1, 2, 1, 60, 80, 256, false, true, true, MaskKind::kBool});
  run_case<__nv_bfloat16, 256, false, true, MaskKind::kAdditive>(
      eh::Shape{1, 2, 2, 50, 50, 256, true, false, true, MaskKind::kAdditive});
  run_case<__half, 256, false, true, MaskKind::kNone>(
      eh::Shape{1, 2, 1, 80, 100, 256, true, true, true}, true);
}

TEST(EmulatedSm80Backward, CompactTilesD128) {
  // The same call over three 64-key blocks, and a GQA causal one whose key blocks walk two query
  // heads' blocks each (the single dO buffer reloaded at every step), its gradients in
  // (B, L, H, D) memory.
  run_case<__half, 128, true, false, MaskKind::kNone>(
      eh::Shape{1, 2, 2, 40, 150, 128, false, true, true});
  run_case<__nv_bfloat16, 128, true, true, MaskKind::kNone>(
      eh::Shape{1, 4, 2, 130, 100, 128, true, false, true, MaskKind::kNone, true});
}

TEST(EmulatedSm80Backward, CompactTilesMasked) {
  run_case<__nv_bfloat16, 128, true, true, MaskKind::kBool>(
      eh::Shape{1, 2, 1, 70, 80, 128, false, false, true, MaskKind::kBool});
  run_case<__half, 128, true, true, MaskKind::kAdditive>(
      eh::Shape{1, 2, 2, 60, 60, 128, true, true, true, MaskKind::kAdditive});
}

TEST(EmulatedSm80Backward, DeterministicDq) {
  // (The first with its gradients in (B, L, H, D) memory.)
  run_case<__half, 128, true, true, MaskKind::kNone>(
      eh::Shape{1, 2, 1, 100, 130, 128, true, true, true, MaskKind::kNone, true}, true);
  run_case<__nv_bfloat16, 64, false, false, MaskKind::kNone>(
      eh::Shape{1, 2, 2, 70, 140, 64, false, false, false}, true);
}

TEST(EmulatedSm80Backward, WithoutDLambda) {
  // No d lambda asked for: the postprocess forms dq = lambda G alone (no q read, no d lambda).
  run_case<__nv_bfloat16, 128, false, true, MaskKind::kNone>(
      eh::Shape{1, 4, 2, 70, 90, 128, true, true, true}, false, false);
}

TEST(EmulatedSm80Backward, AdditiveMaskGradient) {
  // The mask's gradient (add_logit_grads) summed over the heads the (B, 1, Lq, Lk) mask is shared
  // by, from the 4 query heads of 2 CTAs' GQA groups: causal with logn row scales and the
  // statistics' gradients (D = 64, two batches); partial key blocks and gradients in (B, L, H, D)
  // memory (D = 128); the compact tiles; D = 256; and the deterministic dq (the main kernel
  // still writes it).
  run_case<__half, 64, false, true, MaskKind::kAdditive>(
      eh::Shape{2, 4, 2, 70, 150, 64, true, true, true, MaskKind::kAdditive, false, true});
  run_case<__nv_bfloat16, 128, false, true, MaskKind::kAdditive>(
      eh::Shape{1, 4, 2, 90, 200, 128, false, false, true, MaskKind::kAdditive, true, true});
  run_case<__half, 128, true, true, MaskKind::kAdditive>(
      eh::Shape{1, 2, 1, 70, 80, 128, true, true, false, MaskKind::kAdditive, false, true});
  run_case<__nv_bfloat16, 256, false, true, MaskKind::kAdditive>(
      eh::Shape{1, 2, 2, 50, 70, 256, false, false, true, MaskKind::kAdditive, false, true});
  run_case<__half, 64, false, true, MaskKind::kAdditive>(
      eh::Shape{1, 4, 2, 100, 70, 64, false, true, true, MaskKind::kAdditive, false, true}, true);
  // A mask per key, (B, 1, 1, Lk) (its row stride 0: the warp's sums of logit_grads.cuh), causal
  // with the statistics' gradients at D = 128 and in the compact tiles, and full at D = 64.
  eh::Shape key{2, 4, 2, 90, 200, 128, true, false, true, MaskKind::kAdditive, false, true};
  key.mask_per_key = true;
  run_case<__nv_bfloat16, 128, false, true, MaskKind::kAdditive>(key);
  run_case<__half, 128, true, true, MaskKind::kAdditive>(key);
  key = eh::Shape{1, 4, 2, 100, 70, 64, false, true, false, MaskKind::kAdditive, false, true};
  key.mask_per_key = true;
  run_case<__half, 64, false, true, MaskKind::kAdditive>(key);
}

TEST(EmulatedSm80Backward, AdditiveMaskInTheInputsType) {
  // The mask read from global memory as 16-bit entries (an odd key count: rows at both halves of
  // a word), with its gradient: full tiles, the compact ones, and the deterministic dq kernel.
  eh::Shape s{1, 4, 2, 70, 101, 128, true, true, true, MaskKind::kAdditive, false, true};
  s.mask_elem = MaskElem::kFloat16;
  run_case<__half, 128, false, true, MaskKind::kAdditive>(s);
  s.mask_elem = MaskElem::kBFloat16;
  run_case<__nv_bfloat16, 128, true, true, MaskKind::kAdditive>(s);
  s = eh::Shape{2, 2, 2, 90, 77, 64, false, false, true, MaskKind::kAdditive, true, true};
  s.mask_elem = MaskElem::kBFloat16;
  run_case<__nv_bfloat16, 64, false, true, MaskKind::kAdditive>(s, true);
}

TEST(EmulatedSm80Backward, CompactOnlyWhereTheFullTilesDoNotFit) {
  EXPECT_FALSE(ec::sm80::backward_compact(128, 232448));  // H100
  EXPECT_FALSE(ec::sm80::backward_compact(128, 166912));  // A100
  EXPECT_TRUE(ec::sm80::backward_compact(128, 101376));   // sm_86/89/120
  EXPECT_FALSE(ec::sm80::backward_compact(64, 101376));   // D = 64's full tiles fit there
  EXPECT_LE(ec::sm80::backward_main_smem_bytes(128, true), 101376);
  EXPECT_LE(ec::sm80::backward_main_smem_bytes(64), 101376);
  EXPECT_GT(ec::sm80::backward_main_smem_bytes(128), 101376);
}

// ---------------------------------------------------------------------------------------------
// The emulation's checks of cp.async (emulated_cp_async.h), on a small kernel: each of 128 threads
// copies a 16-byte row into shared memory by cp.async, and after a barrier reads the row of the
// thread one warp further on (as ldmatrix would: a read the hazard check sees). Each mode but
// kNone makes one mistake that a GPU would race on or hang with.
// ---------------------------------------------------------------------------------------------

enum class CpAsyncMistake {
  kNone,
  kReadBeforeWait,    // the rows are read after the barrier but before the wait
  kWaitAfterBarrier,  // the wait is after the barrier: other warps read while the rows land
  kNotCommitted,      // no commit before wait_group 0, which then waits for nothing
  kNoWait,            // the block ends with its copies in flight
};

struct CpAsyncParams {
  const uint32_t* src;  // 128 rows of 4 words
  uint32_t* dst;        // 128 rows of 4 words: the rows each thread read
  CpAsyncMistake mode;
};

__global__ void cp_async_kernel(const CpAsyncParams p) {
  using Ops = cuda_emu::sm80::Ops;
  auto* rows = reinterpret_cast<cute::uint128_t*>(sf::ea_sm80_fwd_smem);
  const int t = static_cast<int>(threadIdx.x);
  Ops::CpAsync16::copy(reinterpret_cast<const cute::uint128_t*>(p.src)[t], rows[t]);
  if (p.mode != CpAsyncMistake::kNotCommitted) Ops::cp_async_fence();
  const bool wait_first =
      p.mode == CpAsyncMistake::kNone || p.mode == CpAsyncMistake::kNotCommitted;
  if (wait_first) Ops::cp_async_wait<0>();
  __syncthreads();
  const int other = (t + 32) % 128;
  cuda_emu::smem_access(&rows[other], 16, false, "the test's read");
  std::memcpy(p.dst + 4 * t, &rows[other], 16);
  if (p.mode == CpAsyncMistake::kReadBeforeWait || p.mode == CpAsyncMistake::kWaitAfterBarrier)
    Ops::cp_async_wait<0>();
}

struct CpAsyncOutcome {
  std::string report;  // "" when the launch found no error
  bool rows_read;      // every thread read the row its neighbour copied
};

CpAsyncOutcome run_cp_async(CpAsyncMistake mode) {
  std::vector<uint32_t> src(4 * 128), dst(4 * 128, 0);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint32_t>(i);
  EmulatedLaunch l;
  l.grid = dim3(2);
  l.smem = reinterpret_cast<unsigned char*>(sf::ea_sm80_fwd_smem);
  l.smem_bytes = 128 * 16;
  CpAsyncOutcome out{"", true};
  try {
    emulate_launch(cp_async_kernel, l, CpAsyncParams{src.data(), dst.data(), mode});
  } catch (const cuda_emu::CudaEmulationError& e) {
    out.report = e.what();
  }
  for (int t = 0; t < 128; ++t) {
    out.rows_read &= std::memcmp(&dst[4 * t], &src[4 * ((t + 32) % 128)], 16) == 0;
  }
  return out;
}

TEST(EmulatedSm80Checks, ReportCpAsyncMistakes) {
  const CpAsyncOutcome ok = run_cp_async(CpAsyncMistake::kNone);
  EXPECT_EQ(ok.report, "");
  EXPECT_TRUE(ok.rows_read);
  // Read before the wait: every row still holds its NaN bytes.
  const CpAsyncOutcome early = run_cp_async(CpAsyncMistake::kReadBeforeWait);
  EXPECT_FALSE(early.rows_read);
  // Whichever comes first, another warp's read and the landing share a barrier interval.
  const CpAsyncOutcome late = run_cp_async(CpAsyncMistake::kWaitAfterBarrier);
  EXPECT_NE(late.report.find("hazard"), std::string::npos) << late.report;
  const CpAsyncOutcome uncommitted = run_cp_async(CpAsyncMistake::kNotCommitted);
  EXPECT_FALSE(uncommitted.rows_read);
  EXPECT_NE(uncommitted.report.find("left it with 1 cp.async copies it did not wait for"),
            std::string::npos)
      << uncommitted.report;
  const CpAsyncOutcome unwaited = run_cp_async(CpAsyncMistake::kNoWait);
  EXPECT_NE(unwaited.report.find("did not wait for"), std::string::npos) << unwaited.report;
}

// ---------------------------------------------------------------------------------------------
// The hazard check sees plain loads and stores too (plain_smem_access.cpp: this unit is built with
// its hooks): each of 128 threads stores a word into shared memory and reads the word of the
// thread one warp further on, with or without the barrier between.
// ---------------------------------------------------------------------------------------------

struct PlainSmemParams {
  float* out;  // 128 words: what each thread read
  bool barrier;
};

__global__ void plain_smem_kernel(const PlainSmemParams p) {
  auto* words = reinterpret_cast<float*>(sf::ea_sm80_fwd_smem);
  const int t = static_cast<int>(threadIdx.x);
  words[t] = static_cast<float>(t);
  if (p.barrier) __syncthreads();
  p.out[t] = words[(t + 32) % 128];
}

std::string run_plain_smem(bool barrier) {
  std::vector<float> out(128, -1.f);
  EmulatedLaunch l;
  l.grid = dim3(2);
  l.smem = reinterpret_cast<unsigned char*>(sf::ea_sm80_fwd_smem);
  l.smem_bytes = 128 * sizeof(float);
  try {
    emulate_launch(plain_smem_kernel, l, PlainSmemParams{out.data(), barrier});
  } catch (const cuda_emu::CudaEmulationError& e) {
    return e.what();
  }
  for (int t = 0; t < 128; ++t) EXPECT_EQ(out[t], static_cast<float>((t + 32) % 128));
  return "";
}

TEST(EmulatedSm80Checks, ReportPlainSharedMemoryHazards) {
  EXPECT_EQ(run_plain_smem(true), "");
  // Whichever warp runs first, a store and another warp's load share a barrier interval.
  const std::string report = run_plain_smem(false);
  EXPECT_NE(report.find("hazard"), std::string::npos) << report;
  EXPECT_NE(report.find("a plain"), std::string::npos) << report;
}

}  // namespace
