// The entries of a mask as the kernels read them (kernel_args.h: MaskArg): a 16-bit additive mask
// (MaskElem), which the CUDA kernels read in the inputs' own type instead of a float32 copy, must
// give every entry the value of that copy. Checked here on the host, where the fallback's and the
// CPU emulation's reads run the same functions: every bf16 and fp16 bit pattern against c10's
// conversion, and n_i's count and the logits of a mask in each storage type against the float32
// one. And the call preparation's rules (attention_inputs.h: keeps_mask_dtype, expand_mask), with
// its aligned copy of any tensor the kernels read at a misaligned address (element_aligned) and of
// a mask whose entries' 4-byte words reach outside its storage (word_readable).
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

#include "attention_inputs.h"
#include "kernel_args.h"

namespace {

using entropy_attn::MaskArg;
using entropy_attn::MaskElem;
using entropy_attn::MaskKind;

// Equal as values, NaN equal to NaN (and -0 distinct from +0: the bits must carry the sign).
void expect_same_float(float got, float want, uint32_t bits) {
  if (std::isnan(want)) {
    EXPECT_TRUE(std::isnan(got)) << "bits " << bits;
    return;
  }
  EXPECT_EQ(got, want) << "bits " << bits;
  EXPECT_EQ(std::signbit(got), std::signbit(want)) << "bits " << bits;
}

TEST(MaskEntries, EveryBFloat16AndHalfConvertsExactly) {
  for (uint32_t bits = 0; bits <= 0xffffu; ++bits) {
    const auto h = static_cast<uint16_t>(bits);
    expect_same_float(entropy_attn::bfloat16_bits_to_float(h),
                      static_cast<float>(c10::BFloat16(h, c10::BFloat16::from_bits())), bits);
    expect_same_float(entropy_attn::half_bits_to_float(h),
                      static_cast<float>(c10::Half(h, c10::Half::from_bits())), bits);
  }
}

// A (1, 1, 1, n) additive mask of every kind of value (-inf, finfo.min, subnormals, zeros of
// either sign, +inf, NaN) in `dtype`, viewed as MaskArg<float>, against its float32 copy.
void check_mask_in(at::ScalarType dtype, MaskElem elem) {
  const float inf = std::numeric_limits<float>::infinity();
  const at::Tensor values = at::tensor({-inf, -3.0e38f, -65504.f, -1.5f, -0.f, 0.f, 6.0e-8f,
                                        1.0e-40f, 0.25f, 7.f, inf, std::nanf("")});
  const at::Tensor narrow = values.to(dtype), wide = narrow.to(at::kFloat);
  MaskArg<float> m16, m32;
  m16.kind = m32.kind = MaskKind::kAdditive;
  m16.elem = elem;
  m16.data = narrow.const_data_ptr(), m32.data = wide.const_data_ptr();
  m16.sj = m32.sj = 1;
  for (int64_t j = 0; j < values.numel(); ++j) {
    const float want = wide[j].item<float>();
    expect_same_float(m16.additive(j), want, static_cast<uint32_t>(j));
    EXPECT_EQ(m16.counts(0, j), m32.counts(0, j)) << "entry " << j;
    expect_same_float(m16.logit(0, j, 0.5f), m32.logit(0, j, 0.5f), static_cast<uint32_t>(j));
  }
  // A NaN score hidden by -inf stays hidden: -inf, not NaN.
  EXPECT_EQ(m16.logit(0, 0, std::nanf("")), -inf);
  EXPECT_FALSE(m16.counts(0, 0)) << "-inf does not count toward n_i";
}

TEST(MaskEntries, SixteenBitMasksReadAsTheirFloat32Copy) {
  check_mask_in(at::kBFloat16, MaskElem::kBFloat16);
  check_mask_in(at::kHalf, MaskElem::kFloat16);
}

// `values` (contiguous) copied to `dst` and seen there through from_blob, as memory another library
// hands over: at whatever alignment `dst` has.
at::Tensor copied_to(uint8_t* dst, const at::Tensor& values) {
  std::memcpy(dst, values.const_data_ptr(), values.nbytes());
  return at::from_blob(dst, values.sizes(), values.options());
}

TEST(MaskEntries, KeptInTheInputsDtypeOnCudaAlone) {
  const at::Tensor bf16 = at::zeros({2, 3}, at::kBFloat16);
  // On the CPU (whose kernels read float32 alone) and for other dtypes a mask is converted.
  EXPECT_FALSE(entropy_attn::keeps_mask_dtype(bf16, at::kBFloat16));
  EXPECT_FALSE(entropy_attn::keeps_mask_dtype(at::zeros({2, 3}, at::kFloat), at::kFloat));
  // The entries' part of the rule: the inputs' dtype, 16 bits.
  EXPECT_TRUE(entropy_attn::mask_entries_read_as_is(bf16, at::kBFloat16));
  EXPECT_FALSE(entropy_attn::mask_entries_read_as_is(bf16, at::kHalf));
  EXPECT_FALSE(entropy_attn::mask_entries_read_as_is(bf16.to(at::kFloat), at::kFloat));
  entropy_attn::AttentionShape s{};
  s.batch = 1, s.heads = 2, s.q_len = 2, s.kv_len = 3;
  // At an odd address (from_blob) too: kept, it is read through an aligned copy in its own dtype
  // (element_aligned), not a float32 conversion.
  alignas(4) uint8_t raw[16] = {};
  const at::Tensor values = at::arange(6, at::TensorOptions().dtype(at::kFloat)).view({2, 3});
  const at::Tensor odd = copied_to(raw + 1, values.to(at::kBFloat16));
  EXPECT_TRUE(entropy_attn::mask_entries_read_as_is(odd, at::kBFloat16));
  const at::Tensor odd_kept = entropy_attn::expand_mask(odd, s, at::kFloat, true);
  EXPECT_EQ(odd_kept.scalar_type(), at::kBFloat16);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(odd_kept.const_data_ptr()) % 2, 0u);
  EXPECT_TRUE(at::equal(odd_kept.to(at::kFloat), values.expand({1, 2, 2, 3})));
  EXPECT_EQ(entropy_attn::expand_mask(bf16, s, at::kFloat, false).scalar_type(), at::kFloat);
  // Kept: the same storage, expanded as a view.
  const at::Tensor kept = entropy_attn::expand_mask(bf16, s, at::kFloat, true);
  EXPECT_EQ(kept.scalar_type(), at::kBFloat16);
  EXPECT_EQ(kept.const_data_ptr(), bf16.const_data_ptr());
  EXPECT_EQ(entropy_attn::make_mask_arg<float>(kept).elem, MaskElem::kBFloat16);
  EXPECT_EQ(entropy_attn::make_mask_arg<float>(kept.to(at::kHalf)).elem, MaskElem::kFloat16);
  EXPECT_EQ(entropy_attn::make_mask_arg<float>(kept.to(at::kFloat)).elem, MaskElem::kAcc);
  // The CPU kernels refuse a 16-bit one (an internal error, never a silent misread).
  EXPECT_THROW(entropy_attn::make_cpu_mask_arg<float>(kept), c10::Error);
  if (at::hasCUDA()) {
    EXPECT_TRUE(entropy_attn::keeps_mask_dtype(bf16.cuda(), at::kBFloat16));
    EXPECT_FALSE(entropy_attn::keeps_mask_dtype(bf16.cuda(), at::kHalf));
    EXPECT_FALSE(entropy_attn::keeps_mask_dtype(bf16.cuda().to(at::kFloat), at::kBFloat16));
  }
}

// A floating-point mask whose entries are not at a multiple of their size (from_blob or DLPack
// memory) reaches the kernels as an aligned copy with the same values; a broadcast dimension stays
// a view (a (1, 1, Lq, Lk) mask is not materialized per head); an aligned one is not copied.
TEST(MaskEntries, MisalignedEntriesAreCopiedToAlignedMemory) {
  entropy_attn::AttentionShape s{};
  s.batch = 2, s.heads = 3, s.q_len = 2, s.kv_len = 3;
  for (const at::ScalarType dtype : {at::kFloat, at::kDouble}) {
    const int64_t size = c10::elementSize(dtype);
    alignas(16) uint8_t raw[16 * 8 + 16] = {};
    for (const int64_t shift : {int64_t{0}, size / 2}) {
      // (1, Lq, Lk) entries, expanded over the heads by the caller as a stride-0 view.
      const at::Tensor values = at::arange(6, at::TensorOptions().dtype(dtype)).view({1, 2, 3});
      const at::Tensor given = copied_to(raw + shift, values).expand({3, 2, 3});
      const at::Tensor m = entropy_attn::expand_mask(given, s, dtype, false);
      EXPECT_EQ(reinterpret_cast<uintptr_t>(m.const_data_ptr()) % size, 0u)
          << c10::toString(dtype) << " at offset " << shift;
      EXPECT_EQ(m.const_data_ptr() == given.const_data_ptr(), shift == 0)
          << "copied only where misaligned (" << c10::toString(dtype) << ")";
      EXPECT_EQ(m.stride(1), 0) << "the heads stay a broadcast view";
      EXPECT_TRUE(at::equal(m, values.expand({2, 3, 2, 3})));
    }
  }
}

// The other tensors the kernels read (query, key and value through with_unit_last_stride, a scale
// tensor through expand_scale, sinks, statistics and cu_seqlens through element_aligned) follow the
// mask's rule: copied, with the same values, exactly where their entries are misaligned, a
// broadcast dimension kept as a view.
TEST(ElementAligned, MisalignedTensorsAreCopiedToAlignedMemory) {
  entropy_attn::AttentionShape s{};
  s.batch = 2, s.heads = 3, s.q_len = 4;
  for (const at::ScalarType dtype : {at::kBFloat16, at::kHalf, at::kFloat, at::kInt}) {
    const int64_t size = c10::elementSize(dtype);
    alignas(16) uint8_t raw[16 * 8 + 16] = {};
    for (const int64_t shift : {int64_t{0}, size / 2}) {
      const at::Tensor values = at::arange(12, at::TensorOptions().dtype(dtype)).view({1, 3, 4});
      const at::Tensor given = copied_to(raw + shift, values).expand({2, 3, 4});
      const auto context = [&] {
        return std::string(c10::toString(dtype)) + " at offset " + std::to_string(shift);
      };
      const auto expect_aligned_copy = [&](const at::Tensor& t, const char* what) {
        EXPECT_EQ(reinterpret_cast<uintptr_t>(t.const_data_ptr()) % t.element_size(), 0u)
            << what << ", " << context();
        EXPECT_EQ(t.const_data_ptr() == given.const_data_ptr(), shift == 0)
            << what << " copied only where misaligned, " << context();
        EXPECT_EQ(t.stride(0), 0) << what << ": the batch stays a broadcast view, " << context();
        EXPECT_TRUE(at::equal(t, values.expand({2, 3, 4}))) << what << ", " << context();
      };
      expect_aligned_copy(entropy_attn::element_aligned(given), "element_aligned");
      if (dtype != at::kInt) {
        expect_aligned_copy(entropy_attn::with_unit_last_stride(given, dtype),
                            "with_unit_last_stride");
      }
      if (dtype == at::kFloat) {
        expect_aligned_copy(entropy_attn::expand_scale(given, s, dtype), "expand_scale");
      }
    }
  }
}

// The tensor-core forwards copy the aligned 4-byte word that holds a bool or 16-bit mask entry
// (mask_words.cuh): a mask whose words would reach outside its storage (its bytes not a multiple of
// 4, or its first entry less than a word into storage that starts off a word) reaches them as a
// copy with the same entries in storage of whole words; any other mask is not copied.
TEST(MaskEntries, WordsOutsideTheStorageAreCopied) {
  const auto bools = [](int64_t n) {
    return at::arange(n, at::TensorOptions().dtype(at::kLong)).remainder(3).ne(0);
  };
  const auto expect_word_readable = [](const at::Tensor& given, bool copied, const char* what) {
    EXPECT_EQ(entropy_attn::words_within_storage(given), !copied) << what;
    const at::Tensor got = entropy_attn::word_readable(given);
    EXPECT_EQ(got.const_data_ptr() != given.const_data_ptr(), copied) << what;
    EXPECT_TRUE(entropy_attn::words_within_storage(got)) << what;
    EXPECT_EQ(got.strides(), copied ? got.contiguous().strides() : given.strides()) << what;
    EXPECT_TRUE(at::equal(got, given)) << what;
  };
  expect_word_readable(bools(8), false, "8 bools");
  expect_word_readable(bools(5), true, "5 bools: the second word's last 3 bytes are outside");
  expect_word_readable(bools(8).narrow(0, 1, 7), false, "7 bools after 1 in a storage of 8");
  expect_word_readable(bools(8).narrow(0, 1, 5), false, "5 bools in the middle of 8");
  expect_word_readable(bools(4).view({1, 4}).expand({3, 4}), false, "4 bools, broadcast");
  const at::Tensor bf16 = at::arange(3, at::TensorOptions().dtype(at::kFloat)).to(at::kBFloat16);
  expect_word_readable(bf16, true, "3 bf16 entries: 6 bytes");
  expect_word_readable(bf16.narrow(0, 0, 2), false, "2 of 3 bf16 entries");
  expect_word_readable(at::zeros({3}, at::kFloat), false, "float32 entries are words");
  // From_blob memory that starts off a word: the first entry's word starts before it.
  alignas(4) uint8_t raw[16] = {};
  expect_word_readable(copied_to(raw + 1, bools(4)), true, "4 bools at an odd address");
  expect_word_readable(copied_to(raw + 2, bf16.narrow(0, 0, 2)), true, "2 bf16 at 2 past a word");
  // (The same that end on a word: their first word alone starts outside.)
  expect_word_readable(copied_to(raw + 1, bools(3)), true, "3 bools at an odd address");
  expect_word_readable(copied_to(raw + 2, bf16.narrow(0, 0, 1)), true, "1 bf16 at 2 past a word");
  // A broadcast dimension stays a view of the copy.
  const at::Tensor broadcast = entropy_attn::word_readable(bools(5).view({1, 5}).expand({3, 5}));
  EXPECT_EQ(broadcast.stride(0), 0);
  EXPECT_TRUE(at::equal(broadcast, bools(5).expand({3, 5})));
  // expand_mask applies it on CUDA alone, to a bool mask and to a 16-bit one kept in its dtype: the
  // CPU kernels read entries, not words.
  entropy_attn::AttentionShape s{};
  s.batch = 2, s.heads = 3, s.q_len = 1, s.kv_len = 5;
  const at::Tensor cpu_mask = bools(5);
  EXPECT_EQ(entropy_attn::expand_mask(cpu_mask, s, at::kFloat, false).const_data_ptr(),
            cpu_mask.const_data_ptr());
  if (at::hasCUDA()) {
    const at::Tensor mask = entropy_attn::expand_mask(bools(5).cuda(), s, at::kFloat, false);
    EXPECT_TRUE(entropy_attn::words_within_storage(mask));
    EXPECT_TRUE(at::equal(mask.cpu(), bools(5).expand({2, 3, 1, 5})));
    s.kv_len = 3;
    const at::Tensor kept = entropy_attn::expand_mask(bf16.cuda(), s, at::kFloat, true);
    EXPECT_EQ(kept.scalar_type(), at::kBFloat16);
    EXPECT_TRUE(entropy_attn::words_within_storage(kept));
  }
}

}  // namespace
