// The features the sm80 family's general (causal) instantiations take (emulated_features.h), and
// the additive mask's gradient of its masked backward, run on the CPU as test_sm80_emulation.cpp
// runs the family (sm80_emulation.h). A file of its own,
// compiled with that one as one unit (cuda_emulation.cmake: they launch the same kernels) and run
// as a CTest test of its own.
#include "sm80_emulation.h"

#include "emulated_features.h"

namespace {

using namespace sm80_emulation;
using emulated_features::Feature;

// The sm80 family's general forward and its backward in the full or the compact tiles.
template <bool kCompact>
struct Sm80 {
  static constexpr ec::Family kFamily = ec::Family::kSm80;
  template <typename T, int kD, MaskKind kMask = MaskKind::kNone>
  static void forward(const ec::FwdParams<float>& p) {
    launch_forward<T, kD, true, kMask, true>(p);
  }
  template <typename T, int kD, MaskKind kMask = MaskKind::kNone>
  static void backward(const ec::BwdParams<float>& p) {
    launch_backward<T, kD, kCompact, true, kMask>(p);
  }
};

template <typename T, int kD, bool kCompact>
void run_feature(const Feature& f) {
  emulated_features::run_feature<Sm80<kCompact>, T, kD>(f);
}
template <typename T, int kD, bool kCompact>
void run_documents(const std::vector<int32_t>& cu_q, const std::vector<int32_t>& cu_k, bool causal,
                   std::array<int64_t, 2> window) {
  emulated_features::run_documents<Sm80<kCompact>, T, kD>(cu_q, cu_k, causal, window);
}

template <typename T, int kD>
void run_mask_grad(const std::vector<int64_t>& mask_sizes, bool causal, double dropout_p = 0,
                   double hidden = 0.2, bool keep_dtype = false, int64_t lk = 130,
                   bool transposed = false, bool entropy_grad = true, bool full_grad = false) {
  emulated_features::run_mask_grad<Sm80<false>, T, kD>(
      mask_sizes, causal, dropout_p, hidden, keep_dtype, lk, transposed, entropy_grad, full_grad);
}

TEST(EmulatedSm80Features, AdditiveMaskGradient) {
  // The mask shapes of real models: per head (T5's relative positions, causal), shared by the
  // batch and heads, per key (padding with a learned offset), per row (whose gradient is lse's
  // alone, a row's softmax not moving with it; none hidden: a hidden row has no lse to
  // differentiate), and the call's full shape; and one with dropout.
  run_mask_grad<__nv_bfloat16, 128>({1, 4, 100, 130}, true);
  run_mask_grad<__nv_bfloat16, 128>({100, 130}, false);
  run_mask_grad<__half, 64>({2, 1, 1, 130}, false);
  run_mask_grad<__half, 64>({2, 4, 100, 1}, true, 0, /*hidden=*/0);
  run_mask_grad<__half, 64>({2, 4, 100, 130}, false);
  run_mask_grad<__nv_bfloat16, 128>({2, 1, 100, 130}, true, 0.2);
  // Per key (the warp's sums, logit_grads.cuh) at D = 128 (the 64 x 128 tiles), causal, per head
  // and key, with dropout, and keys past the last block's end.
  run_mask_grad<__nv_bfloat16, 128>({2, 1, 1, 130}, true);
  run_mask_grad<__half, 128>({1, 4, 1, 130}, false, 0.2);
  run_mask_grad<__nv_bfloat16, 64>({2, 4, 1, 130}, true);
  // Per key without the entropy's gradient (the kernel's step that keeps no logits), and one
  // offset per batch and head (row and key strides 0: the warp's sums, all to one entry).
  run_mask_grad<__nv_bfloat16, 128>({2, 1, 1, 130}, false, 0, 0.2, false, 130, false, false);
  run_mask_grad<__half, 64>({2, 4, 1, 1}, true, 0, /*hidden=*/0);
}

TEST(EmulatedSm80Features, AdditiveMaskGradientAtTheFullShape) {
  // Under deterministic algorithms (attention_host.h: use_full_mask_grad) a broadcast mask's
  // gradient is written at the call's (B, H, Lq, Lk) shape, each entry from one logit, and summed
  // over the broadcast dims after: per head, causal; shared by the batch and heads; per key
  // (where the default sums a warp's rows first); per row; with the entropy's gradient or not, a
  // mask in the inputs' type; a mask of the full shape keeps its own accumulator.
  constexpr bool kFull = true;
  run_mask_grad<__nv_bfloat16, 128>({1, 4, 100, 130}, true, 0, 0.2, false, 130, false, true, kFull);
  run_mask_grad<__half, 64>({100, 130}, false, 0, 0.2, false, 130, false, false, kFull);
  run_mask_grad<__nv_bfloat16, 64>({2, 1, 1, 130}, true, 0, 0.2, false, 130, false, true, kFull);
  run_mask_grad<__half, 128>({2, 4, 100, 1}, true, 0, /*hidden=*/0, false, 130, false, true, kFull);
  run_mask_grad<__nv_bfloat16, 64>({1, 4, 100, 131}, true, 0, 0.2, true, 131, false, true, kFull);
  run_mask_grad<__half, 64>({2, 4, 100, 130}, false, 0, 0.2, false, 130, false, true, kFull);
}

TEST(EmulatedSm80Features, AdditiveMaskInTheInputsType) {
  // The same masks read by the kernels in the inputs' 16-bit type (forward and backward): the
  // strides of each layout (0 where the mask broadcasts), odd key counts putting entries at
  // either half of their 4-byte words, dropout; and transposed views.
  run_mask_grad<__nv_bfloat16, 128>({1, 4, 100, 131}, true, 0, 0.2, true, 131);
  run_mask_grad<__half, 64>({2, 1, 1, 131}, false, 0, 0.2, true, 131);
  run_mask_grad<__half, 128>({2, 4, 100, 1}, true, 0, /*hidden=*/0, true, 131);
  run_mask_grad<__nv_bfloat16, 64>({2, 4, 100, 131}, false, 0.2, 0.2, true, 131);
  // A transposed view: a key stride of 101 (odd), each row's entries at both halves of words.
  run_mask_grad<__half, 128>({1, 4, 100, 131}, true, 0, 0.2, true, 131, /*transposed=*/true);
  run_mask_grad<__nv_bfloat16, 64>({2, 4, 100, 131}, false, 0, 0.2, true, 131, true);
}

TEST(EmulatedSm80Features, WindowsAndAlignment) {
  Feature f;
  f.window = {40, 0}, f.heads_inside_rows = true;  // (and the output and gradients with it)
  run_feature<__nv_bfloat16, 64, false>(f);
  f = Feature{};
  f.alignment = "bottom_right", f.q_len = 70, f.kv_len = 200;
  run_feature<__nv_bfloat16, 64, false>(f);
  f = Feature{};
  f.causal = false, f.window = {30, 50};  // a two-sided band
  run_feature<__nv_bfloat16, 128, true>(f);
}

TEST(EmulatedSm80Features, SoftcapSinksDropout) {
  Feature f;
  f.softcap = 2.0, f.sinks = true, f.window = {63, 0};
  run_feature<__nv_bfloat16, 64, false>(f);
  f = Feature{};
  f.dropout_p = 0.2;
  run_feature<__nv_bfloat16, 64, false>(f);
  f.dropout_p = 0.1, f.sinks = true;
  run_feature<__nv_bfloat16, 128, true>(f);
}

TEST(EmulatedSm80Features, PackedDocuments) {
  // Documents that straddle query tiles and key blocks, one of a single token, one with fewer
  // queries than keys (a cache), causal and with a window.
  run_documents<__nv_bfloat16, 64, false>({0, 1, 130, 190, 200}, {0, 1, 130, 250, 300}, true,
                                          {-1, 0});
  run_documents<__nv_bfloat16, 128, true>({0, 70, 71, 150}, {0, 90, 91, 171}, true, {30, 0});
}

TEST(EmulatedSm80Features, HeadDim256) {
  // Gemma 2's pattern (softcap over a sliding window), sinks with dropout, and packed documents,
  // at head dim 256.
  Feature f;
  f.softcap = 50.0, f.window = {63, 0}, f.q_len = 130, f.kv_len = 130;
  run_feature<__nv_bfloat16, 256, false>(f);
  f = Feature{};
  f.dropout_p = 0.1, f.sinks = true, f.q_len = 80, f.kv_len = 100, f.alignment = "bottom_right";
  run_feature<__half, 256, false>(f);
  run_documents<__nv_bfloat16, 256, false>({0, 1, 70, 100}, {0, 1, 90, 130}, true, {40, 0});
}

}  // namespace
