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
  template <typename T, int kD>
  static void forward(const ec::FwdParams<float>& p) {
    launch_forward<T, kD, true, MaskKind::kNone, true>(p);
  }
  template <typename T, int kD>
  static void backward(const ec::BwdParams<float>& p) {
    launch_backward<T, kD, kCompact, true, MaskKind::kNone>(p);
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

// The additive mask's gradient through the op's own call preparation (grad_mask: an accumulator
// with the mask's sizes, seen as (B, H, Lq, Lk) with stride 0 along the dims it broadcasts along)
// and the family's masked backward, against the CPU op's backward of the same call: 2 batches,
// 4 query heads over 2 key/value heads, logn row scales, the gradients of lse and the entropy,
// `hidden` of the entries -inf. The mask in the inputs' dtype, as a model's learned bias is; with
// keep_dtype the kernels read it so, as the op's call preparation keeps it on a GPU
// (attention_inputs.h: keeps_mask_dtype; on the CPU it becomes float32), and the forward is
// emulated too. transposed: the mask (4-D) a transposed view at an odd storage offset, a slice of
// (B, H, Lk, Lq + 1) storage from element 1 of each row (strides ..., 1, Lq + 1: odd).
template <typename T, int kD>
void run_mask_grad(const std::vector<int64_t>& mask_sizes, bool causal, double dropout_p = 0,
                   double hidden = 0.2, bool keep_dtype = false, int64_t lk = 130,
                   bool transposed = false) {
  const at::ScalarType dtype = std::is_same_v<T, __half> ? at::kHalf : at::kBFloat16;
  at::manual_seed(23);
  const auto opt = at::TensorOptions().dtype(dtype);
  const int64_t lq = 100;
  const at::Tensor q = at::randn({2, 4, lq, kD}, opt), k = at::randn({2, 2, lk, kD}, opt),
                   v = at::randn({2, 2, lk, kD}, opt), dout = at::randn({2, 4, lq, kD}, opt);
  at::Tensor mask =
      (at::randn(mask_sizes) * 0.5).masked_fill(at::rand(mask_sizes) < hidden, -INFINITY).to(dtype);
  if (transposed) {
    const at::Tensor store =
        at::zeros({mask.size(0), mask.size(1), mask.size(3), mask.size(2) + 1}, mask.options());
    store.narrow(3, 1, mask.size(2)).copy_(mask.transpose(2, 3));
    mask = store.narrow(3, 1, mask.size(2)).transpose(2, 3);
    ASSERT_EQ(mask.storage_offset() % 2, 1);
    ASSERT_EQ(mask.stride(3) % 2, 1);
  }
  const std::optional<at::Tensor> g_lse(at::randn({2, 4, lq})), g_entropy(at::randn({2, 4, lq}));
  const int64_t seed = 0x5eed;
  const std::array<int64_t, 2> window{-1, -1};
  const entropy_attn::AttentionOptions o = entropy_attn::AttentionOptions::from_schema(
      causal, std::nullopt, "logn", 1.0, 64.0, /*enable_gqa=*/true, /*return_stats=*/true, window,
      "top_left", 0.0, dropout_p, seed);
  const entropy_attn::AttentionResult r =
      entropy_attn::attention(q, k, v, mask, std::nullopt, causal, std::nullopt, "logn", 1.0, 64.0,
                              true, true, window, "top_left", 0.0, std::nullopt, dropout_p, seed);

  const double tol = eh::tolerance<T>().grad;
  using emulated_features::rel_norm;
  if (keep_dtype) {
    entropy_attn::AttentionCall call =
        entropy_attn::prepare_attention(q, k, v, mask, std::nullopt, std::nullopt, {}, o);
    call.mask = entropy_attn::expand_mask(mask, call.shape, call.acc, /*keep_dtype=*/true);
    const ec::ForwardCall fwd(q, k, v, call);
    launch_forward<T, kD, true, MaskKind::kAdditive, true>(fwd.params<float>());
    EXPECT_LT(rel_norm(std::get<0>(fwd.outputs), r.output), tol) << "output";
    EXPECT_LT(rel_norm(std::get<1>(fwd.outputs), r.lse), eh::tolerance<T>().rtol) << "lse";
    EXPECT_LT(rel_norm(std::get<2>(fwd.outputs), r.entropy), eh::tolerance<T>().rtol) << "entropy";
    EXPECT_TRUE(at::equal(std::get<5>(fwd.outputs), r.n_keys)) << "n_keys";
  }
  entropy_attn::AttentionBackwardCall bcall = entropy_attn::prepare_attention_backward(
      dout, g_lse, g_entropy, std::nullopt, q, k, v, mask, r.output, r.lse, r.entropy, r.sum_p2,
      r.row_scale, std::nullopt, {}, o, /*grad_mask=*/true, /*grad_scale=*/true);
  if (keep_dtype) {
    ASSERT_EQ(bcall.mask->scalar_type(), at::kFloat) << "a CPU call converts the mask";
    bcall.mask = entropy_attn::expand_mask(mask, bcall.shape, bcall.acc, /*keep_dtype=*/true);
  }
  ec::BackwardCall bwd(dout, q, k, v, r.output, bcall);
  bwd.allocate(ec::Family::kSm80);
  launch_backward<T, kD, false, true, MaskKind::kAdditive>(bwd.params<float>());
  const entropy_attn::AttentionGrads got = bwd.finish();
  const at::Tensor dmask = entropy_attn::mask_grad(mask, bwd.call, q);
  const entropy_attn::AttentionBackwardOutputs want = entropy_attn::call_attention_backward(
      dout, g_lse, g_entropy, std::nullopt, q, k, v, mask, r.output, r.lse, r.entropy, r.sum_p2,
      r.row_scale, std::nullopt, {}, o, /*grad_mask=*/true);
  EXPECT_LT(rel_norm(std::get<0>(got), std::get<0>(want)), tol) << "grad_query";
  EXPECT_LT(rel_norm(std::get<1>(got), std::get<1>(want)), tol) << "grad_key";
  EXPECT_LT(rel_norm(std::get<2>(got), std::get<2>(want)), tol) << "grad_value";
  EXPECT_LT(rel_norm(std::get<3>(got), std::get<3>(want)), tol) << "grad_row_scale";
  const at::Tensor& want_dmask = std::get<5>(want);
  ASSERT_EQ(dmask.sizes(), mask.sizes());
  EXPECT_EQ(dmask.scalar_type(), dtype);
  EXPECT_GT(want_dmask.abs().max().item<double>(), 1e-3) << "the case gives the mask a gradient";
  EXPECT_LT(rel_norm(dmask, want_dmask), tol) << "grad_attn_mask";
  EXPECT_TRUE(at::equal(dmask.masked_select(at::isneginf(mask)),
                        at::zeros({at::isneginf(mask).sum().item<int64_t>()}, dmask.options())))
      << "a hidden key's entry has no gradient";
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
