// The features the Hopper family's general (causal) instantiations take (emulated_features.h),
// run on the CPU as test_sm90_emulation.cpp runs the family (sm90_emulation.h): windows,
// bottom-right alignment, softcap, sinks, dropout and packed documents, forward and backward. A
// file of its own, compiled with test_sm90_emulation.cpp as one unit (cuda_emulation.cmake: they
// launch the same kernels) and run as a CTest test of its own.
#include "sm90_emulation.h"

#include <cstdlib>
#include <optional>
#include <string>

#include "cuda/family.h"
#include "emulated_features.h"

namespace {

using namespace sm90_emulation;
using emulated_features::Feature;
using emulated_features::run_documents;
using emulated_features::run_feature;
using emulated_features::run_mask_grad;

// The Hopper family's general forward and backward (without a mask, which takes any feature; with
// an additive one for run_mask_grad).
struct Sm90 {
  static constexpr ec::Family kFamily = ec::Family::kSm90;
  template <typename T, int kD, MaskKind kMask = MaskKind::kNone>
  static void forward(const ec::FwdParams<float>& p) {
    launch_forward<T, kD, true, kMask, true>(p);
  }
  template <typename T, int kD, MaskKind kMask = MaskKind::kNone>
  static void backward(const ec::BwdParams<float>& p) {
    launch_backward<T, kD, true, kMask>(p);
  }
};

// The same on a persistent grid of 3 blocks (params.h: persistent_blocks), its tiles in launch
// order over 2 sections: blocks that walk several tiles, one of them with no key to see.
struct Sm90Persistent : Sm90 {
  template <typename T, int kD>
  static void forward(ec::FwdParams<float> p) {
    p.persistent_blocks = 3;
    p.launch_sections = 2;
    launch_forward<T, kD, true, MaskKind::kNone, true>(p);
  }
};

TEST(EmulatedSm90Features, WindowsAndAlignment) {
  Feature f;
  f.window = {40, 0}, f.heads_inside_rows = true;  // (and the output and gradients with it)
  run_feature<Sm90, __nv_bfloat16, 64>(f);
  f = Feature{};
  f.alignment = "bottom_right", f.q_len = 70, f.kv_len = 200;
  run_feature<Sm90, __half, 128>(f);
  f = Feature{};
  f.causal = false, f.window = {30, 50};  // a two-sided band
  run_feature<Sm90, __nv_bfloat16, 128>(f);
}

// A loss of the output alone: the backward's steps without the logits, which choose once per
// slice between the loop that checks each score against its row's keys and the one that does not
// (sm90/bwd_kernel.cuh: kSplitChecks), for blocks on a window's edges and inside it, and for a
// causal call aligned bottom-right (its diagonal off the blocks' corners).
TEST(EmulatedSm90Features, WindowsWithoutEntropyGradient) {
  Feature f;
  f.entropy_grad = false, f.window = {250, 0}, f.q_len = f.kv_len = 500;
  run_feature<Sm90, __nv_bfloat16, 128>(f);
  f.causal = false, f.window = {150, 80};
  run_feature<Sm90, __half, 64>(f);
  f = Feature{};
  f.entropy_grad = false, f.alignment = "bottom_right", f.q_len = 130, f.kv_len = 330;
  run_feature<Sm90, __nv_bfloat16, 64>(f);
}

TEST(EmulatedSm90Features, SoftcapSinksDropout) {
  Feature f;
  f.softcap = 2.0, f.sinks = true, f.window = {63, 0};
  run_feature<Sm90, __nv_bfloat16, 64>(f);
  f = Feature{};
  f.dropout_p = 0.2;
  run_feature<Sm90, __nv_bfloat16, 128>(f);
  f.dropout_p = 0.1, f.sinks = true;
  run_feature<Sm90, __half, 64>(f);
}

// Head dim 256 (64-key blocks in both directions; the forward's query tiles of 128 rows, the
// backward's query blocks of 64: windows and documents whose edges fall inside them) with each
// feature: a window aligned bottom-right, softcap, sinks and dropout, packed documents.
TEST(EmulatedSm90Features, HeadDim256) {
  Feature f;
  f.window = {90, 0}, f.alignment = "bottom_right", f.q_len = 130, f.kv_len = 260;
  f.heads_inside_rows = true;
  run_feature<Sm90, __nv_bfloat16, 256>(f);
  f = Feature{};
  f.softcap = 2.0, f.sinks = true, f.dropout_p = 0.2;
  run_feature<Sm90, __nv_bfloat16, 256>(f);
  run_documents<Sm90, __nv_bfloat16, 256>({0, 70, 71, 150}, {0, 90, 91, 171}, true, {30, 0});
}

TEST(EmulatedSm90Features, PersistentGrid) {
  // Bottom-right alignment with more queries than keys: the first tile's rows see no key (it
  // loads none, and hands Q back at once); sinks and dropout, whose decisions follow the tile.
  Feature f;
  f.alignment = "bottom_right", f.q_len = 300, f.kv_len = 90, f.sinks = true, f.dropout_p = 0.1;
  run_feature<Sm90Persistent, __nv_bfloat16, 64>(f);
  f = Feature{};
  f.window = {70, 0}, f.softcap = 3.0;
  run_feature<Sm90Persistent, __half, 128>(f);
}

TEST(EmulatedSm90Features, PackedDocuments) {
  // Documents that straddle query tiles and key blocks, one of a single token, one with fewer
  // queries than keys (a cache), causal and with a window.
  run_documents<Sm90, __nv_bfloat16, 64>({0, 1, 130, 190, 200}, {0, 1, 130, 250, 300}, true,
                                         {-1, 0});
  run_documents<Sm90, __nv_bfloat16, 128>({0, 70, 71, 150}, {0, 90, 91, 171}, true, {30, 0});
  // Without the entropy's gradient (documents long enough for blocks inside one).
  run_documents<Sm90, __nv_bfloat16, 128>({0, 200, 210, 260}, {0, 200, 210, 260}, true, {-1, 0},
                                          /*entropy_grad=*/false);
}

// The additive mask's gradient (sm90/bwd_kernel.cuh: kLogitGrads) through the op's own call
// preparation, against the CPU op (emulated_features.h: run_mask_grad), for a loss of the output
// and lse (the Hopper backward writes it without the statistics' gradients; dropout with a mask
// goes to the sm80 family): the mask shapes of real models, per head (T5's relative positions,
// causal), shared by the batch and heads, per key, per row (none hidden), the call's full shape;
// and read in the inputs' 16-bit type (an odd key count, the forward emulated too), one a
// transposed view at an odd storage offset.
TEST(EmulatedSm90Features, AdditiveMaskGradient) {
  constexpr bool kNoEntropyGrad = false;
  run_mask_grad<Sm90, __nv_bfloat16, 128>({1, 4, 100, 130}, true, 0, 0.2, false, 130, false,
                                          kNoEntropyGrad);
  run_mask_grad<Sm90, __nv_bfloat16, 128>({100, 130}, false, 0, 0.2, false, 130, false,
                                          kNoEntropyGrad);
  run_mask_grad<Sm90, __half, 64>({2, 1, 1, 130}, false, 0, 0.2, false, 130, false, kNoEntropyGrad);
  run_mask_grad<Sm90, __half, 64>({2, 4, 100, 1}, true, 0, /*hidden=*/0, false, 130, false,
                                  kNoEntropyGrad);
  run_mask_grad<Sm90, __half, 64>({2, 4, 100, 130}, false, 0, 0.2, false, 130, false,
                                  kNoEntropyGrad);
  run_mask_grad<Sm90, __nv_bfloat16, 64>({1, 4, 100, 131}, true, 0, 0.2, true, 131, false,
                                         kNoEntropyGrad);
  run_mask_grad<Sm90, __half, 128>({1, 4, 100, 131}, true, 0, 0.2, true, 131, /*transposed=*/true,
                                   kNoEntropyGrad);
  // Per key (the warp's sums, logit_grads.cuh) at D = 128, causal, and per head and key.
  run_mask_grad<Sm90, __nv_bfloat16, 128>({2, 1, 1, 130}, true, 0, 0.2, false, 130, false,
                                          kNoEntropyGrad);
  run_mask_grad<Sm90, __half, 128>({1, 4, 1, 130}, false, 0, 0.2, false, 130, false,
                                   kNoEntropyGrad);
}

// dq by bulk reductions (sm90/bwd_kernel.cuh: write_dq), which the op's backward takes in the calls
// without a mask (csrc/cuda/family.h: kHopperBulkDqByDefault): BackwardCall::allocate then lays
// dq_accum out for them (sm90/launch.h: bulk_dq_accum), for a window, dropout with sinks, and
// packed documents (each document's last query block partial, added into the padding).
TEST(EmulatedSm90Features, BulkDq) {
  struct DefaultChoice {  // ("auto", whatever ENTROPY_ATTN_CUDA_FAMILY the environment sets)
    std::optional<std::string> saved;
    DefaultChoice() {
      if (const char* v = std::getenv("ENTROPY_ATTN_CUDA_FAMILY")) saved = v;
      unsetenv("ENTROPY_ATTN_CUDA_FAMILY");
    }
    ~DefaultChoice() {
      if (saved) setenv("ENTROPY_ATTN_CUDA_FAMILY", saved->c_str(), 1);
    }
  } default_choice;
  ASSERT_TRUE(ec::hopper_bulk_dq(entropy_attn::AttentionBackwardCall{}));  // (no mask)
  Feature f;
  f.window = {40, 0};
  run_feature<Sm90, __nv_bfloat16, 64>(f);
  f = Feature{};
  f.dropout_p = 0.1, f.sinks = true;
  run_feature<Sm90, __half, 128>(f);
  run_documents<Sm90, __nv_bfloat16, 128>({0, 70, 71, 150}, {0, 90, 91, 171}, true, {-1, 0});
}

// Deterministic dq through the op's call preparation: under deterministic algorithms
// BackwardCall::allocate gives the Hopper backward its turn counters (params.h: dq_turns), which
// its preprocess starts at each query block's first walker, and key block n adds into query block
// m when m's counter reads n, each raising it to the next key block with a walk
// (bwd_kernel.cuh: write_dq; key_ranges.cuh: first_walker, walking_block_from): bottom-right
// causality with fewer queries than keys and with more (the first query blocks see no key), full
// attention with dropout and sinks, a causal window over four key blocks (query blocks whose
// walkers start past key block 0), a two-sided band, a window aligned bottom-right, and packed
// documents with key blocks that walk nothing between two that walk the same query block: the keys
// of a document without queries, and keys no row of a window sees (a document with more keys than
// queries), and a masked call, whose atomics take the same turns.
TEST(EmulatedSm90Features, DeterministicDq) {
  struct Deterministic {
    bool saved = at::globalContext().deterministicAlgorithms();
    Deterministic() { at::globalContext().setDeterministicAlgorithms(true, false); }
    ~Deterministic() { at::globalContext().setDeterministicAlgorithms(saved, false); }
  } deterministic;
  Feature f;
  f.alignment = "bottom_right", f.q_len = 130, f.kv_len = 330;
  run_feature<Sm90, __nv_bfloat16, 64>(f);
  f = Feature{};
  f.alignment = "bottom_right", f.q_len = 300, f.kv_len = 190, f.entropy_grad = false;
  run_feature<Sm90, __half, 128>(f);
  f = Feature{};
  f.causal = false, f.dropout_p = 0.1, f.sinks = true;
  run_feature<Sm90, __nv_bfloat16, 128>(f);
  f = Feature{};
  f.window = {150, 0}, f.q_len = f.kv_len = 500;
  run_feature<Sm90, __nv_bfloat16, 64>(f);
  f = Feature{};
  f.causal = false, f.window = {130, 70}, f.q_len = f.kv_len = 400, f.entropy_grad = false;
  run_feature<Sm90, __half, 128>(f);
  f = Feature{};
  f.window = {100, 0}, f.alignment = "bottom_right", f.q_len = 200, f.kv_len = 450;
  run_feature<Sm90, __nv_bfloat16, 128>(f);
  // Query block 1 (rows 64-127) holds rows of documents 0 and 2: key block 0 walks it, key block 1
  // (keys 128-255, of document 1, which has no query) walks nothing, key blocks 2 and 3 walk it.
  run_documents<Sm90, __nv_bfloat16, 64>({0, 100, 100, 200}, {0, 40, 300, 420}, true, {-1, 0});
  // Document 1's 50 rows see its last 80 of 400 keys (a window of 30 aligned bottom-right): key
  // blocks 1 and 2 walk nothing between key block 0 and key block 3, both of which walk query
  // block 1.
  run_documents<Sm90, __half, 128>({0, 70, 120}, {0, 100, 500}, true, {30, 0},
                                   /*entropy_grad=*/false);

  // A masked call's atomics in turns (bwd_kernel.cuh: keep_turns): an additive mask of the call's
  // full shape with its gradient (each entry from one logit, so deterministic too), causal; and
  // broadcast ones (per head, per key), whose gradient deterministic algorithms write at the full
  // shape and sum after (attention_host.h: use_full_mask_grad).
  run_mask_grad<Sm90, __nv_bfloat16, 128>({2, 4, 100, 130}, true, 0, 0.2, false, 130, false,
                                          /*entropy_grad=*/false);
  run_mask_grad<Sm90, __half, 64>({1, 4, 100, 130}, true, 0, 0.2, false, 130, false,
                                  /*entropy_grad=*/false, /*full_grad=*/true);
  run_mask_grad<Sm90, __nv_bfloat16, 128>({2, 1, 1, 130}, false, 0, 0.2, false, 130, false,
                                          /*entropy_grad=*/false, /*full_grad=*/true);
}

}  // namespace
