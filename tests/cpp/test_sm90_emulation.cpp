// The Hopper (sm90) family run on the CPU: its kernels (csrc/cuda/sm90/fwd_kernel.cuh,
// bwd_kernel.cuh) compiled by the host compiler with emulated sm_90a instructions
// (emulated_sm90_ops.h: TMA, mbarriers, the TMA pipeline, named barriers, wgmma) on emulated thread
// blocks of three warpgroups (cuda_emulation.h), with the launchers' arguments and grids
// (sm90_emulation.h). What this checks on any machine: the kernels' TMA boxes and wgmma
// descriptors, their pipelines' phases, the producer / consumer hand-offs and the ping-pong of the
// consumer warpgroups, the shared-memory hazards of their asynchronous operations and the async
// proxy's fences (reported by the emulation, whose own checks are tested last), indexing, masking,
// statistics and gradients; not the hardware's timing.
// Against the kernel harness's float64 reference (benchmarks/harness/kernel_harness.h).
#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "sm90_emulation.h"

namespace {

using namespace sm90_emulation;

// Shape{batch, heads, kv_heads, q_len, kv_len, head_dim, causal, logn, stat_grads, mask,
// heads_inside_rows}.

// Runs `body` with the emulated threads resumed lowest-numbered first, then highest-numbered first
// (fibers.h: Order), so that each consumer warpgroup in turn runs as far as it can before the
// other; the round-robin order again afterwards, whatever fails.
template <typename Body>
void with_either_warpgroup_ahead(Body body) {
  using cuda_emu::fibers::Order;
  struct Restore {
    ~Restore() { cuda_emu::fibers::set_order(Order::kRoundRobin); }
  } restore;
  for (const Order order : {Order::kLowestFirst, Order::kHighestFirst}) {
    SCOPED_TRACE(order == Order::kLowestFirst ? "lowest first" : "highest first");
    cuda_emu::fibers::set_order(order);
    body();
  }
}

TEST(EmulatedSm90Forward, FullAttention) {
  // GQA, a partial query tile and key block, Lq != Lk with logn row scales; with and without
  // statistics (the plain instantiations: the scale folded into the exponent), the latter's output
  // in (B, Lq, H, D) memory.
  run_forward<__nv_bfloat16, 64, false, MaskKind::kNone, true>(
      eh::Shape{1, 2, 1, 150, 200, 64, false, true});
  run_forward<__half, 128, false, MaskKind::kNone, false>(
      eh::Shape{2, 2, 2, 70, 300, 128, false, false, false, MaskKind::kNone, true});
}

TEST(EmulatedSm90Forward, Causal) {
  // The general instantiations: the predicated blocks on the diagonal, causal block skipping, two
  // query tiles of different lengths (the second with its output in (B, Lq, H, D) memory).
  run_forward<__half, 64, true, MaskKind::kNone, true>(
      eh::Shape{1, 2, 1, 200, 200, 64, true, true});
  run_forward<__nv_bfloat16, 128, true, MaskKind::kNone, true>(
      eh::Shape{1, 2, 2, 130, 260, 128, true, false, false, MaskKind::kNone, true});
}

// With either consumer warpgroup ahead (EmulatedSm90Backward.EitherWarpgroupAhead, below).
TEST(EmulatedSm90Forward, EitherWarpgroupAhead) {
  with_either_warpgroup_ahead([] {
    run_forward<__nv_bfloat16, 128, true, MaskKind::kNone, true>(
        eh::Shape{1, 2, 2, 130, 260, 128, true, false, false});
    run_forward<__half, 64, false, MaskKind::kNone, false>(
        eh::Shape{1, 2, 1, 150, 200, 64, false, true});
  });
}

// Persistent grids (params.h: persistent_blocks): blocks that walk several tiles, so that the
// consumers hand Q back for the next tile's load (barrier_q_empty), the pipelines' stages and
// phases and the scheduler barriers' hand-offs carry over from tile to tile, and each tile's rows
// start from a fresh state. Tiles dealt in alternate directions (launch_order.h:
// persistent_tile), in launch order over sections where the instantiation takes it.
TEST(EmulatedSm90Forward, PersistentGrid) {
  // 8 tiles on 3 blocks (3, 3 and 2 each); 6 on one block, the output in (B, Lq, H, D) memory.
  run_forward<__nv_bfloat16, 64, false, MaskKind::kNone, true>(
      eh::Shape{2, 2, 1, 150, 200, 64, false, true}, 3);
  run_forward<__half, 128, false, MaskKind::kNone, false>(
      eh::Shape{1, 2, 2, 300, 130, 128, false, false, false, MaskKind::kNone, true}, 1);
  // Causal tiles of different lengths in launch order (2 sections), 9 tiles on 2 blocks; a masked
  // instantiation, 4 tiles on 3 blocks.
  run_forward<__nv_bfloat16, 128, true, MaskKind::kNone, true>(
      eh::Shape{1, 3, 1, 300, 300, 128, true, true}, 2, 2);
  run_forward<__half, 64, true, MaskKind::kBool, true>(
      eh::Shape{1, 2, 1, 200, 150, 64, true, true, false, MaskKind::kBool}, 3);
  // Either consumer warpgroup ahead, across the tiles of one block.
  with_either_warpgroup_ahead([] {
    run_forward<__nv_bfloat16, 64, true, MaskKind::kNone, true>(
        eh::Shape{1, 2, 1, 200, 200, 64, true, false}, 1);
  });
}

// The persistent grid's size (sm90/fwd_kernel.cuh: grid): the blocks asked for, at most one per
// tile, and at most 2^30, so that no block's next tile index (launch_order.h:
// next_persistent_tile) passes 2^32, here with 2,113,929,216 tiles and INT32_MAX blocks asked for.
TEST(EmulatedSm90Forward, PersistentGridSize) {
  using Kt = s9f::FwdTraits<__nv_bfloat16, 64, MaskKind::kNone, cuda_emu::sm90::Ops>;
  ec::FwdParams<float> p;
  p.batch = 63, p.heads = 1 << 12, p.q_len = int64_t{Kt::kBlockM} << 13;
  const int64_t tiles = s9f::tile_count<Kt>(p);
  ASSERT_GT(tiles, int64_t{1} << 30);
  EXPECT_EQ(s9f::grid<Kt>(p).x, tiles);  // a block per tile
  p.persistent_blocks = 132;
  EXPECT_EQ(s9f::grid<Kt>(p).x, 132u);
  p.persistent_blocks = std::numeric_limits<int>::max();
  EXPECT_EQ(s9f::grid<Kt>(p).x, 1u << 30);
  const uint32_t last = (1u << 30) - 1;  // the last block's next index from round 1, in range
  EXPECT_GT(ec::next_persistent_tile(ec::persistent_tile(1, last, 1u << 30), last, 1u << 30),
            ec::persistent_tile(1, last, 1u << 30));
  p.q_len = Kt::kBlockM, p.heads = 2, p.batch = 1;
  EXPECT_EQ(s9f::grid<Kt>(p).x, 2u);  // never more blocks than tiles
}

TEST(EmulatedSm90Forward, Masked) {
  // The masked instantiations: the mask tile by cp.async, n_i counted over the allowed keys; at
  // D = 128 112-key blocks (S as one m64n112 wgmma).
  run_forward<__nv_bfloat16, 128, true, MaskKind::kBool, true>(
      eh::Shape{1, 2, 1, 90, 250, 128, false, true, false, MaskKind::kBool});
  run_forward<__half, 64, true, MaskKind::kAdditive, true>(
      eh::Shape{1, 2, 2, 140, 140, 64, true, true, false, MaskKind::kAdditive});
}

TEST(EmulatedSm90Forward, AdditiveMaskInTheInputsType) {
  // A bf16 or fp16 bias read as it is (kernel_args.h: MaskElem), its entries picked out of the
  // tile's words (mask_words.cuh): an odd key count puts every other row at a word's second half.
  eh::Shape s{1, 2, 1, 90, 251, 128, false, true, false, MaskKind::kAdditive};
  s.mask_elem = MaskElem::kBFloat16;
  run_forward<__nv_bfloat16, 128, true, MaskKind::kAdditive, true>(s);
  s = eh::Shape{1, 2, 2, 140, 141, 64, true, true, false, MaskKind::kAdditive};
  s.mask_elem = MaskElem::kFloat16;
  run_forward<__half, 64, true, MaskKind::kAdditive, false>(s);
}

// Head dim 256 (sm90/fwd_kernel.cuh, FwdTraits: 64-key blocks, 192 KB of operand tiles; compiled
// on request, kernels.toml): full attention with GQA, logn scales, a partial last key block and
// query tile; causal with Lq != Lk and the output in (B, Lq, H, D) memory; without the statistics;
// a persistent grid whose blocks walk several tiles; either consumer warpgroup ahead.
TEST(EmulatedSm90Forward, HeadDim256) {
  run_forward<__nv_bfloat16, 256, false, MaskKind::kNone, true>(
      eh::Shape{1, 2, 1, 150, 200, 256, false, true});
  run_forward<__nv_bfloat16, 256, true, MaskKind::kNone, true>(
      eh::Shape{1, 2, 2, 130, 250, 256, true, false, false, MaskKind::kNone, true});
  run_forward<__half, 256, true, MaskKind::kNone, false>(
      eh::Shape{1, 2, 1, 200, 170, 256, true, true});
  run_forward<__nv_bfloat16, 256, false, MaskKind::kNone, true>(
      eh::Shape{2, 2, 1, 150, 90, 256, false, false}, 3);
  with_either_warpgroup_ahead([] {
    run_forward<__nv_bfloat16, 256, true, MaskKind::kNone, true>(
        eh::Shape{1, 2, 1, 200, 200, 256, true, true});
  });
}

// Head dim 256's masked forwards (48-key blocks and a 48-column mask tile: FwdTraits): a bool mask
// over six key blocks (the last partial) with full attention and logn scales; a bf16 additive mask
// read as it is with an odd key count, causal and GQA, without the statistics; an fp32 additive
// one with either consumer warpgroup ahead.
TEST(EmulatedSm90Forward, HeadDim256Masked) {
  run_forward<__nv_bfloat16, 256, true, MaskKind::kBool, true>(
      eh::Shape{1, 2, 1, 150, 260, 256, false, true, false, MaskKind::kBool});
  eh::Shape s{1, 4, 2, 140, 141, 256, true, false, false, MaskKind::kAdditive};
  s.mask_elem = MaskElem::kBFloat16;
  run_forward<__nv_bfloat16, 256, true, MaskKind::kAdditive, false>(s);
  with_either_warpgroup_ahead([] {
    run_forward<__half, 256, true, MaskKind::kAdditive, true>(
        eh::Shape{1, 2, 2, 130, 100, 256, true, true, false, MaskKind::kAdditive});
  });
}

TEST(EmulatedSm90Backward, D64) {
  // One 64 x 64 slice per warpgroup (BwdTraits::slices), GQA, causal, the statistics'
  // gradients, the gradients in (B, L, H, D) memory; and full attention with logn over two key
  // blocks.
  run_backward<__nv_bfloat16, 64, true, MaskKind::kNone>(
      eh::Shape{1, 4, 2, 100, 150, 64, true, false, true, MaskKind::kNone, true});
  run_backward<__half, 64, false, MaskKind::kNone>(
      eh::Shape{1, 2, 2, 70, 200, 64, false, true, true});
}

TEST(EmulatedSm90Backward, D128) {
  // Two slices of 64 keys (the statistics' gradients), and one 64 x 64 slice per warpgroup (a
  // loss of the output alone).
  run_backward<__half, 128, false, MaskKind::kNone>(
      eh::Shape{1, 2, 1, 90, 140, 128, false, true, true});
  run_backward<__nv_bfloat16, 128, true, MaskKind::kNone>(
      eh::Shape{1, 2, 2, 130, 130, 128, true, false, false});
}

// Head dim 256 (bwd_kernel.cuh, BwdTraits: 64-key blocks, the warpgroups splitting dK and dV along
// D, so that each reads P and dS of both; G by atomics, its shared tile not fitting): causal with
// GQA, the statistics' gradients and the gradients in (B, L, H, D) memory; full attention with logn
// over three key blocks (the last partial) without d lambda; deterministic dq (the atomics in
// turns); either consumer warpgroup ahead.
TEST(EmulatedSm90Backward, HeadDim256) {
  run_backward<__nv_bfloat16, 256, true, MaskKind::kNone>(
      eh::Shape{1, 4, 2, 100, 150, 256, true, false, true, MaskKind::kNone, true});
  run_backward<__half, 256, false, MaskKind::kNone>(
      eh::Shape{2, 2, 1, 90, 150, 256, false, true, false}, false, false);
  run_backward<__nv_bfloat16, 256, true, MaskKind::kNone>(
      eh::Shape{1, 2, 2, 130, 200, 256, true, true, true}, false, true, true);
  with_either_warpgroup_ahead([] {
    run_backward<__nv_bfloat16, 256, false, MaskKind::kNone>(
        eh::Shape{1, 2, 1, 70, 130, 256, false, true, true});
  });
}

TEST(EmulatedSm90Backward, BulkDq) {
  // dq's partial sums through the shared tile and the dq writer's bulk reductions (bwd_kernel.cuh:
  // write_dq): a partial last query block (its zero rows added into the padding), GQA (the
  // group's query heads walked by one key block), causal and full, both head dims; gradients in
  // (B, L, H, D) memory (the second).
  run_backward<__nv_bfloat16, 64, true, MaskKind::kNone>(
      eh::Shape{1, 4, 2, 100, 150, 64, true, false, true}, true);
  run_backward<__half, 128, false, MaskKind::kNone>(
      eh::Shape{2, 2, 1, 90, 140, 128, false, true, true, MaskKind::kNone, true}, true);
  run_backward<__nv_bfloat16, 128, true, MaskKind::kNone>(
      eh::Shape{1, 2, 2, 130, 130, 128, true, false, false}, true);
}

// Deterministic dq (bwd_kernel.cuh: write_dq; params.h: dq_turns): each key block adds its G into
// a query block when the counter of that block, started by the preprocess, says the key blocks
// before it have (the emulated wait reports a count that is not the awaited one, which a GPU would
// wait on for ever), and hands the turn on only after its reduction has completed. Causal over 4
// key blocks (the last partial) with GQA and the statistics' gradients, full attention over 3 with
// no d lambda in two batch entries, and top-left causality with more keys than queries (key blocks
// 1-3 walk no query block).
TEST(EmulatedSm90Backward, DeterministicDq) {
  run_backward<__nv_bfloat16, 64, true, MaskKind::kNone>(
      eh::Shape{1, 4, 2, 300, 400, 64, true, false, true}, true, true, true);
  run_backward<__half, 128, false, MaskKind::kNone>(
      eh::Shape{2, 2, 1, 150, 300, 128, false, true, false}, true, false, true);
  run_backward<__nv_bfloat16, 128, true, MaskKind::kNone>(
      eh::Shape{1, 2, 2, 100, 400, 128, true, true, true}, true, true, true);
}

// The masked kernels' atomics in the same turns (bwd_kernel.cuh: keep_turns, warp 1 of the producer
// warpgroup, waits for each turn and hands it on once the consumers have added): a bool mask,
// causal with GQA and the statistics' gradients over 3 key blocks (the last partial, a query count
// no multiple of 64), an additive one with its gradient over 4 in two batch entries, and the
// kernel without a mask that adds by atomics (bulk reductions off).
TEST(EmulatedSm90Backward, DeterministicDqByAtomics) {
  run_backward<__nv_bfloat16, 128, true, MaskKind::kBool>(
      eh::Shape{1, 4, 2, 290, 300, 128, true, true, true, MaskKind::kBool}, false, true, true);
  eh::Shape additive{2, 2, 1, 150, 400, 64, false, true, false, MaskKind::kAdditive};
  additive.mask_grad = true;
  run_backward<__half, 64, true, MaskKind::kAdditive>(additive, false, true, true);
  run_backward<__nv_bfloat16, 64, true, MaskKind::kNone>(
      eh::Shape{1, 2, 2, 200, 300, 64, true, false, false}, false, false, true);
}

// The consumer warpgroups meet wherever one reads what the other stored (the backward's P before
// dV, dS before G and dK; the forward's turns at the tensor cores). Run with one warpgroup going as
// far as it can before the other, each way round: a missing barrier lets a wgmma read the other's
// tile before its stores (the emulated wgmma reads its operands at issue, and its wait finds them
// changed) in one order or the other, which the round-robin order of the other tests may hide.
TEST(EmulatedSm90Backward, EitherWarpgroupAhead) {
  with_either_warpgroup_ahead([] {
    run_backward<__nv_bfloat16, 128, true, MaskKind::kNone>(
        eh::Shape{1, 2, 2, 130, 130, 128, true, false, false}, true);
    run_backward<__half, 64, false, MaskKind::kNone>(
        eh::Shape{1, 2, 2, 70, 200, 64, false, true, true});
  });
}

// A loss of the output alone (no statistic gradients): the step that folds lambda_i log2 e into
// the exponent (kFoldScale) and forms dS by logit_grad(p, dp, delta). Row scales that differ from
// row to row (logn with causality), both head dims (at D = 128 one 64 x 64 slice per warpgroup
// without a mask, and lambda_i read again for lambda dS; two slices with the bool mask), full
// attention at D = 128 (whose partial blocks take the loop with the check, kSplitChecks, and the
// others the one without), a bool mask (the fold with the mask's predicate) and an additive one
// (no fold).
TEST(EmulatedSm90Backward, WithoutStatisticGradients) {
  run_backward<__nv_bfloat16, 64, true, MaskKind::kNone>(
      eh::Shape{1, 4, 2, 100, 150, 64, true, true, false});
  run_backward<__half, 128, false, MaskKind::kNone>(
      eh::Shape{1, 2, 1, 90, 140, 128, false, true, false});
  run_backward<__half, 128, true, MaskKind::kNone>(
      eh::Shape{1, 2, 1, 130, 130, 128, true, true, false}, true);
  run_backward<__nv_bfloat16, 128, true, MaskKind::kBool>(
      eh::Shape{1, 2, 1, 70, 150, 128, false, true, false, MaskKind::kBool});
  run_backward<__half, 64, true, MaskKind::kAdditive>(
      eh::Shape{1, 2, 2, 80, 80, 64, true, true, false, MaskKind::kAdditive});
}

// No d lambda asked for (params.h: g_scaled): the warps store lambda dS alone, which G reads
// too, and the postprocess takes G for dq. The plain loop of each head dim (at D = 128 one slice,
// with either consumer warpgroup ahead), the statistics' gradients (two slices at D = 128), causal
// with bulk reductions, and a bool mask (the masked kernel's two slices and stores).
TEST(EmulatedSm90Backward, WithoutDLambda) {
  with_either_warpgroup_ahead([] {
    run_backward<__nv_bfloat16, 128, false, MaskKind::kNone>(
        eh::Shape{1, 2, 1, 90, 140, 128, false, true, false}, false, false);
  });
  run_backward<__half, 64, false, MaskKind::kNone>(
      eh::Shape{1, 2, 2, 70, 200, 64, false, true, false}, false, false);
  run_backward<__half, 128, true, MaskKind::kNone>(
      eh::Shape{1, 2, 2, 130, 130, 128, true, true, true}, true, false);
  run_backward<__nv_bfloat16, 64, true, MaskKind::kNone>(
      eh::Shape{1, 4, 2, 100, 150, 64, true, false, true, MaskKind::kNone, true}, true, false);
  run_backward<__nv_bfloat16, 128, true, MaskKind::kBool>(
      eh::Shape{1, 2, 1, 70, 150, 128, false, true, false, MaskKind::kBool}, false, false);
}

// Causal blocks off the diagonal, where every row sees every key of the tile: the dS loop
// without the select that keeps dS = 0 where p = 0 (kEveryKey), which the causal shapes above
// (130 rows and fewer) never reach. 320 rows give query blocks 2-4 of key block 0 and block 4 of
// key block 1, with d lambda (dS and lambda dS stored) and without (lambda dS alone, in
// scaled_logit_grad's form); logn's row scales differ from row to row.
TEST(EmulatedSm90Backward, CausalBlocksOffTheDiagonal) {
  for (const bool dlam : {true, false}) {
    run_backward<__nv_bfloat16, 128, true, MaskKind::kNone>(
        eh::Shape{1, 2, 1, 320, 320, 128, true, true, false}, true, dlam);
    run_backward<__half, 64, true, MaskKind::kNone>(
        eh::Shape{1, 2, 2, 320, 320, 64, true, true, false}, false, dlam);
  }
}

// An infinite value at keys that no row sees (top-left causality with 150 keys for 100 rows:
// keys 100-149 are nobody's, and key block 0 meets them in two blocks on an edge) stays out of
// every gradient without the guard: the select of the dS loop on an edge keeps dS = 0 where
// dP = inf, so that dK of those keys stays 0 and nothing flags the call (params.h: nonfinite).
// The loop without it (kEveryKey) taken there would form 0 * inf. With d lambda and without.
TEST(EmulatedSm90Backward, InfiniteValuesNoRowSees) {
  for (const bool dlam : {true, false}) {
    const eh::Shape s{1, 2, 1, 100, 150, 128, true, true, false};
    eh::HostCall<__nv_bfloat16> c(s, 11);
    // (The reference keeps the finite values: no row weighs these keys.)
    for (const int64_t j : {101, 127}) {
      for (int64_t d = 0; d < s.head_dim; ++d) {
        c.in.v[j * s.head_dim + d] =
            eh::from_float<__nv_bfloat16>(d % 2 ? std::numeric_limits<float>::infinity()
                                                : -std::numeric_limits<float>::infinity());
      }
    }
    eh::fill_inputs(s, c.b, c.in, [](void* to, const auto& from) {
      std::memcpy(to, from.data(), from.size() * sizeof(from[0]));
    });
    ec::BwdParams<float> p = sm80_emulation::backward_inputs(s, c);
    int flag = 0;
    p.nonfinite = &flag;
    if (!dlam) p.d_row_scale = nullptr;
    launch_backward<__nv_bfloat16, 128, true, MaskKind::kNone>(p);
    EXPECT_EQ(flag, 0) << "dlam " << dlam;
    sm80_emulation::expect_backward(s, c, 0, dlam);
  }
}

// Full attention's partial blocks with every logit far below zero: lambda s near -113 (q_i.k_j
// near -1,280 at D = 128), so that lse_i is near -108. The keys past kv_len, which TMA
// fills with zeros, score 0 there and would weigh exp(-lse_i), an infinity in float32, whose
// product with their zero rows of K is NaN in dq. Only the per-score check of a block on an edge
// hides them (kSplitChecks' loop with it): with random logits those weights stay finite and their
// products zero, so that the other tests pass without the check.
template <typename T, int kD>
void run_full_attention_edges_with_logits_far_below_zero() {
  const eh::Shape s{1, 2, 1, 90, 140, kD, false, false, false};
  eh::HostCall<T> c(s, 11);
  // q_i = a sigma and k_j = -5 sigma + k_j / 2 for one sign pattern sigma over the head dim, with
  // a = 2 sqrt(128 / D), so that lambda q_i.k_j = -5 a sqrt(D) is the same at either head dim.
  const float a = 2.f * std::sqrt(128.f / kD);
  const auto sigma = [](int64_t e) { return e % kD % 3 == 0 ? -1.f : 1.f; };
  for (size_t e = 0; e < c.in.q.size(); ++e) {
    c.in.q[e] = eh::from_float<T>(a * sigma(static_cast<int64_t>(e)));
    c.in.qd[e] = eh::to_double(c.in.q[e]);
  }
  for (size_t e = 0; e < c.in.k.size(); ++e) {
    const double k = -5.0 * sigma(static_cast<int64_t>(e)) + 0.5 * eh::to_double(c.in.k[e]);
    c.in.k[e] = eh::from_float<T>(static_cast<float>(k));
    c.in.kd[e] = eh::to_double(c.in.k[e]);
  }
  eh::fill_inputs(s, c.b, c.in, [](void* to, const auto& from) {
    std::memcpy(to, from.data(), from.size() * sizeof(from[0]));
  });
  launch_backward<T, kD, false, MaskKind::kNone>(sm80_emulation::backward_inputs(s, c));
  // d lambda_i sums dS_ij s_ij over scores all near -1,280 whose spread is about 13, where
  // sum_j dS_ij is 0: the 16-bit operands' rounding comes back amplified (2% here, where the
  // tolerance of ordinary logits is 0.6%). Checked finite and within 10%; the rest as usual.
  sm80_emulation::expect_backward(s, c, 0.1);
}

// Both head dims: full attention at D = 64 checks its partial blocks in a loop of its own too.
TEST(EmulatedSm90Backward, FullAttentionEdgesWithLogitsFarBelowZero) {
  run_full_attention_edges_with_logits_far_below_zero<__half, 128>();
  run_full_attention_edges_with_logits_far_below_zero<__half, 64>();
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

// Head dim 256's masked backward (the mask read from global memory, as at 64 and 128): a bool mask
// with causality, GQA and the statistics' gradients over three key blocks; a 16-bit additive mask
// with its gradient and logn scales, gradients in (B, L, H, D) memory, in the turn keeper's turns;
// either consumer warpgroup ahead.
TEST(EmulatedSm90Backward, HeadDim256Masked) {
  run_backward<__nv_bfloat16, 256, true, MaskKind::kBool>(
      eh::Shape{1, 4, 2, 90, 150, 256, true, false, true, MaskKind::kBool});
  eh::Shape s{1, 2, 1, 70, 131, 256, false, true, false, MaskKind::kAdditive, true, true};
  s.mask_elem = MaskElem::kBFloat16;
  run_backward<__nv_bfloat16, 256, true, MaskKind::kAdditive>(s, false, true, true);
  with_either_warpgroup_ahead([] {
    run_backward<__half, 256, true, MaskKind::kAdditive>(
        eh::Shape{1, 2, 2, 80, 100, 256, true, true, true, MaskKind::kAdditive});
  });
}

TEST(EmulatedSm90Backward, AdditiveMaskInTheInputsType) {
  // The mask's 16-bit entries from global memory (odd key counts: rows at either half of a word).
  eh::Shape s{1, 2, 2, 80, 81, 64, true, true, true, MaskKind::kAdditive};
  s.mask_elem = MaskElem::kFloat16;
  run_backward<__half, 64, true, MaskKind::kAdditive>(s);
  s = eh::Shape{1, 2, 1, 70, 151, 128, false, true, true, MaskKind::kAdditive};
  s.mask_elem = MaskElem::kBFloat16;
  run_backward<__nv_bfloat16, 128, true, MaskKind::kAdditive>(s);
}

TEST(EmulatedSm90Backward, AdditiveMaskGradient) {
  // The mask's gradient (bwd_kernel.cuh: kLogitGrads) of a loss of the output alone, summed over
  // the heads the (B, 1, Lq, Lk) mask is shared by (the query heads of a CTA's GQA group, and the
  // other CTAs'): causal with logn row scales over two batches (D = 64, one slice), partial key
  // blocks with gradients in (B, L, H, D) memory (D = 128, two slices), either consumer warpgroup
  // ahead, without d lambda, and a 16-bit mask (odd key counts: entries at either half of a word).
  run_backward<__half, 64, true, MaskKind::kAdditive>(
      eh::Shape{2, 4, 2, 70, 150, 64, true, true, false, MaskKind::kAdditive, false, true});
  with_either_warpgroup_ahead([] {
    run_backward<__nv_bfloat16, 128, true, MaskKind::kAdditive>(
        eh::Shape{1, 4, 2, 90, 200, 128, false, false, false, MaskKind::kAdditive, true, true});
  });
  run_backward<__half, 128, true, MaskKind::kAdditive>(
      eh::Shape{1, 2, 1, 130, 80, 128, true, true, false, MaskKind::kAdditive, false, true}, false,
      false);
  eh::Shape s{1, 4, 2, 70, 101, 128, true, true, false, MaskKind::kAdditive, false, true};
  s.mask_elem = MaskElem::kBFloat16;
  run_backward<__nv_bfloat16, 128, true, MaskKind::kAdditive>(s);
  s = eh::Shape{2, 2, 2, 90, 77, 64, false, false, false, MaskKind::kAdditive, true, true};
  s.mask_elem = MaskElem::kFloat16;
  run_backward<__half, 64, true, MaskKind::kAdditive>(s);
  // A mask per key, (B, 1, 1, Lk) (its row stride 0: the warp's sums of logit_grads.cuh).
  s = eh::Shape{2, 4, 2, 90, 200, 128, true, false, false, MaskKind::kAdditive, false, true};
  s.mask_per_key = true;
  run_backward<__nv_bfloat16, 128, true, MaskKind::kAdditive>(s);
  s = eh::Shape{1, 4, 2, 100, 70, 64, false, true, false, MaskKind::kAdditive, false, true};
  s.mask_per_key = true;
  run_backward<__half, 64, true, MaskKind::kAdditive>(s);
}

TEST(EmulatedSm90Backward, MaskGradientRefusedWithTheStatisticsGradients) {
  // The step that keeps the logits has no registers for the mask's gradient (kLogitGrads): the
  // launcher refuses a call that asks for both, which the selection point gives the sm80 family.
  const eh::Shape s{1, 2, 1, 70, 150, 128, false, false, true, MaskKind::kAdditive, false, true};
  eh::HostCall<__nv_bfloat16> c(s, 11);
  ec::BwdParams<float> p = eh::backward_params(s, c.b, true);
  EXPECT_FALSE(ec::sm90::backward_covers(p, 128, true));
  const float* const g_entropy = p.g_entropy;
  p.g_entropy = nullptr;  // the gradient of sum p^2 alone
  EXPECT_FALSE(ec::sm90::backward_covers(p, 128, true));
  p.g_entropy = g_entropy, p.g_sum_p2 = nullptr;  // the entropy's alone
  EXPECT_FALSE(ec::sm90::backward_covers(p, 128, true));
  p.g_entropy = nullptr;
  EXPECT_TRUE(ec::sm90::backward_covers(p, 128, true));
  p.mask.kind = MaskKind::kBool;  // the gradient of an additive mask alone
  EXPECT_FALSE(ec::sm90::backward_covers(p, 128, true));
}

// ---------------------------------------------------------------------------------------------
// The emulation's checks of asynchronous hazards (emulated_sm90_ops.h), on a small kernel: thread 0
// loads 64-element rows by TMA into the two stages of a pipeline; the 128 threads of warpgroup 1
// take each stage, read it as a wgmma reads its operands, wait for the read and release the stage.
// Each other mode makes one mistake a GPU would race on.
// ---------------------------------------------------------------------------------------------

enum class Hazard {
  kNone,
  kReleaseBeforeWait,  // a consumer releases the stage before the wait of the wgmma reading it
  kWriteBeforeWait,    // a thread writes an operand before the wgmma's wait
  kLoadIntoHeldStage,  // a TMA load into a stage that consumers have not released
  kLoadIntoOperand,    // a TMA load (on a barrier of its own) into a wgmma's operand in flight
};

struct HazardParams {
  const uint16_t* src;  // kHazardIters rows of 64 16-bit values
  Hazard mode;
};

constexpr int kHazardIters = 4;
constexpr uint32_t kRowBytes = 64 * 2;
constexpr uint32_t kStage0 = 1024;  // the stages' shared bytes: kStage0 + stage * kRowBytes
using HazardPipeline = cuda_emu::sm90::PipelineTmaAsync<2>;

__global__ void hazard_kernel(const HazardParams p) {
  namespace s9 = cuda_emu::sm90;
  using cuda_emu::g_sm90_smem;
  auto& storage = *reinterpret_cast<HazardPipeline::SharedStorage*>(g_sm90_smem);
  uint64_t* const other_barrier = reinterpret_cast<uint64_t*>(g_sm90_smem + 512);
  HazardPipeline::Params params;
  params.transaction_bytes = kRowBytes;
  params.is_leader = threadIdx.x == 0;
  params.num_consumers = 128;
  HazardPipeline pipeline(storage, params, cute::Shape<cute::_1, cute::_1, cute::_1>{});
  if (threadIdx.x == 0) s9::TxBarrier::init(other_barrier, 1);
  __syncthreads();
  // A row's load into shared byte `dst`.
  const auto row = [&](int it, uint32_t dst) {
    s9::TmaBox box{};
    box.map.address = reinterpret_cast<const unsigned char*>(p.src);
    box.map.dims[0] = 64 * kHazardIters;
    box.map.strides[0] = 2;
    box.map.box[0] = 64;
    box.map.rank = 1;
    box.map.element_bytes = 2;
    for (int d = 1; d < 5; ++d) box.map.dims[d] = box.map.box[d] = 1;
    box.crd[0] = 64 * it;
    box.dst = dst;
    return box;
  };
  const bool meet = p.mode == Hazard::kLoadIntoHeldStage || p.mode == Hazard::kLoadIntoOperand;
  if (threadIdx.x < 128) {
    // Warp 0: thread 0 produces; the warp meets the consumers where a mode loads during their
    // reads (all of them: a consumer that had not yet waited for the stage's first phase would wait
    // for the wrong one after the early load of kLoadIntoHeldStage, and hang).
    if (threadIdx.x >= 32) return;
    auto state = cutlass::make_producer_start_state<HazardPipeline>();
    for (int it = 0; it < kHazardIters; ++it, ++state) {
      if (p.mode == Hazard::kLoadIntoHeldStage && it == 2) continue;  // issued at iteration 0
      if (threadIdx.x == 0) {
        pipeline.producer_acquire(state);
        s9::TxBarrier::issue(pipeline.producer_get_barrier(state),
                             row(it, kStage0 + state.index() * kRowBytes));
      }
      if (meet && it == 0) {
        s9::NamedBarrier::sync(160, 0);  // the consumers hold stage 0 and read it
        if (threadIdx.x == 0 && p.mode == Hazard::kLoadIntoHeldStage) {
          // Iteration 2's load into stage 0 now, without waiting for the stage's release.
          s9::TxBarrier::arrive_and_expect_tx(&storage.full_barrier_[0], kRowBytes);
          s9::TxBarrier::issue(&storage.full_barrier_[0], row(2, kStage0));
        } else if (threadIdx.x == 0) {
          s9::TxBarrier::issue(other_barrier, row(1, kStage0));
        }
        s9::NamedBarrier::sync(160, 0);
      }
    }
    if (threadIdx.x == 0) pipeline.producer_tail(state);
    return;
  }
  HazardPipeline::PipelineState state;
  for (int it = 0; it < kHazardIters; ++it, ++state) {
    pipeline.consumer_wait(state);
    const uint32_t first = (kStage0 + state.index() * kRowBytes) / s9::kChunkBytes;
    std::vector<uint32_t> chunks;
    for (uint32_t c = first; c < first + kRowBytes / s9::kChunkBytes; ++c) chunks.push_back(c);
    s9::note_read(s9::operand_read(chunks));
    s9::wgmma_commit();
    if (meet && it == 0) {
      s9::NamedBarrier::sync(160, 0);
      s9::NamedBarrier::sync(160, 0);
    }
    if (p.mode == Hazard::kWriteBeforeWait && it == 1 && threadIdx.x == 200)
      g_sm90_smem[kStage0 + kRowBytes + 3] ^= 1;
    if (p.mode == Hazard::kReleaseBeforeWait && it == 2) pipeline.consumer_release(state);
    s9::wgmma_wait(0);
    if (!(p.mode == Hazard::kReleaseBeforeWait && it == 2)) pipeline.consumer_release(state);
  }
}

// The report of the errors a launch found ("" when none).
template <typename Kernel, typename Params>
std::string launch_report(Kernel kernel, const EmulatedLaunch& l, const Params& p) {
  try {
    emulate_launch(kernel, l, p);
  } catch (const cuda_emu::CudaEmulationError& e) {
    return e.what();
  }
  return "";
}

std::string hazard_report(Hazard mode) {
  std::vector<uint16_t> src(64 * kHazardIters);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint16_t>(i);
  return launch_report(hazard_kernel,
                       hopper_launch(dim3(2), 256, kStage0 + 2 * kRowBytes, s9f::ea_sm90_fwd_smem),
                       HazardParams{src.data(), mode});
}

TEST(EmulatedSm90Checks, ReportAsynchronousHazards) {
  EXPECT_EQ(hazard_report(Hazard::kNone), "");
  const std::pair<Hazard, const char*> cases[] = {
      {Hazard::kReleaseBeforeWait,
       "releases the stage of the mbarrier at shared byte 0 while its wgmma reading shared byte "
       "1024 has not been waited for"},
      {Hazard::kWriteBeforeWait, "wgmma operand at shared byte 1152 written before the wait"},
      {Hazard::kLoadIntoHeldStage,
       "TMA load into the stage of the mbarrier at shared byte 0 while"},
      {Hazard::kLoadIntoOperand,
       "TMA load into shared byte 1024, which a wgmma not yet waited for reads"},
  };
  for (const auto& [mode, message] : cases) {
    const std::string report = hazard_report(mode);
    EXPECT_NE(report.find(message), std::string::npos) << report;
  }
}

// ---------------------------------------------------------------------------------------------
// The emulation's check of the async proxy's fence (emulated_sm90_ops.h), on a small kernel: the
// 128 threads of warpgroup 0 store a 512-byte tile (4 bytes each, Ops::store_shared), fence and
// meet warpgroup 1 at a named barrier; thread 128 then reads the tile as a wgmma operand and adds
// it into global memory by a bulk reduction. Each other mode makes one mistake after which a GPU
// may read what the tile held before the stores.
// ---------------------------------------------------------------------------------------------

enum class Fence {
  kBeforeBarrier,
  kNone,             // no fence.proxy.async
  kAfterBarrier,     // the fence after the barrier that publishes the stores
  kNoneSyncthreads,  // no fence, and __syncthreads as the barrier (cuda_emulation.h's hook)
  kReaderStores,     // thread 128 stores a word of the tile and reads it without a fence
};

struct FenceParams {
  float* sum;  // 128 floats, the bulk reduction's destination
  Fence mode;
};

constexpr uint32_t kFenceTile = 1024;  // the tile's shared byte

__global__ void fence_kernel(const FenceParams p) {
  namespace s9 = cuda_emu::sm90;
  using Ops = s9::Ops;
  float* const tile = reinterpret_cast<float*>(cuda_emu::g_sm90_smem + kFenceTile);
  const int t = static_cast<int>(threadIdx.x);
  const auto publish = [&] {
    if (p.mode == Fence::kNoneSyncthreads) {
      __syncthreads();
    } else {
      Ops::NamedBarrier::sync(256, 0);
    }
  };
  if (t < 128) {
    Ops::store_shared(&tile[t], static_cast<float>(t));
    if (p.mode == Fence::kBeforeBarrier || p.mode == Fence::kReaderStores) {
      Ops::fence_view_async_shared();
    }
    publish();
    if (p.mode == Fence::kAfterBarrier) Ops::fence_view_async_shared();
    return;
  }
  publish();
  if (t != 128) return;
  if (p.mode == Fence::kReaderStores) Ops::store_shared(&tile[5], 5.f);
  std::vector<uint32_t> chunks;
  for (uint32_t c = 0; c < 512 / s9::kChunkBytes; ++c) chunks.push_back(kFenceTile / 16 + c);
  s9::note_read(s9::operand_read(chunks));
  Ops::wgmma_commit();
  Ops::wgmma_wait<0>();
  Ops::bulk_reduce_add(p.sum, tile, 512);
  Ops::bulk_commit();
  Ops::bulk_wait_read<0>();
}

// `sum` gets the tile.
std::string fence_report(Fence mode, std::vector<float>& sum) {
  sum.assign(128, 0.f);
  return launch_report(fence_kernel,
                       hopper_launch(dim3(1), 256, kFenceTile + 512, s9f::ea_sm90_fwd_smem),
                       FenceParams{sum.data(), mode});
}

TEST(EmulatedSm90Checks, ReportGenericStoresTheAsyncProxyReadsUnfenced) {
  std::vector<float> sum;
  ASSERT_EQ(fence_report(Fence::kBeforeBarrier, sum), "");
  for (int i = 0; i < 128; ++i) ASSERT_EQ(sum[i], static_cast<float>(i));
  const std::string unpublished =
      "reads shared byte 1024, stored by the generic proxy without a fence.proxy.async before the "
      "synchronization that publishes it";
  for (const Fence mode : {Fence::kNone, Fence::kAfterBarrier, Fence::kNoneSyncthreads}) {
    const std::string report = fence_report(mode, sum);
    EXPECT_NE(report.find("a wgmma operand " + unpublished), std::string::npos) << report;
    EXPECT_NE(report.find("a bulk reduction " + unpublished), std::string::npos) << report;
  }
  const std::string report = fence_report(Fence::kReaderStores, sum);
  EXPECT_NE(report.find("a wgmma operand reads shared byte 1044, stored by the generic proxy and "
                        "not yet fenced"),
            std::string::npos)
      << report;
  EXPECT_EQ(report.find("byte 1024"), std::string::npos) << report;
}

// The forward's row max (cute_utils.cuh: RowMax4, four partial maxima) is the serial fold's value,
// NaN and infinite scores included (fmaxf ignores a NaN operand in any order).
TEST(RowMax4, EqualsTheSerialFold) {
  std::mt19937 g(5);
  std::normal_distribution<float> normal(0.f, 10.f);
  const float specials[] = {std::nanf(""), INFINITY, -INFINITY};
  for (int it = 0; it < 2000; ++it) {
    float x[32];
    for (float& v : x) v = g() % 6 == 0 ? specials[g() % 3] : normal(g);
    entropy_attn::cuda::RowMax4 four;
    float serial = -INFINITY;
    for (int c = 0; c < 32; ++c) {
      four.add(c, x[c]);
      serial = std::fmax(serial, x[c]);
    }
    const float got = four.value();
    EXPECT_TRUE(got == serial || (std::isnan(got) && std::isnan(serial))) << got << " " << serial;
  }
}

}  // namespace
