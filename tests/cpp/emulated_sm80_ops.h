// Emulated sm_80 instructions for the CPU emulation of the tensor-core family (cuda_emulation.h):
// mma.sync m16n8k16 with fp32 accumulators, ldmatrix x4 (plain and .trans) and cp.async, as the
// operations the sm80 kernels take through their `Ops` parameter (sm80/ops.cuh: Sm80Ops).
// Each is a CuTe operation whose traits are the real instruction's (the same thread/value
// layouts), so the kernels partition, copy and multiply exactly as on a GPU; only the instruction
// itself runs here:
//   * mma.sync and ldmatrix are warp-wide: each lane publishes its operands (fragments, or the
//     address of its 16-byte row) through cuda_emu::warp_gather, then computes its own part of the
//     result from the PTX ISA's fragment layouts (CuTe's ALayout, BLayout, CLayout; the ldmatrix
//     formulas below);
//   * cp.async writes its destination only at the issuing thread's wait (emulated_cp_async.h):
//     until then it holds NaN bytes, so a read before that wait shows up in the results;
//   * both report their shared-memory accesses (cuda_emulation.h: smem_access), so that a buffer
//     overwritten by cp.async while another warp's ldmatrix still reads it, or read before another
//     warp's copy into it is past a barrier, fails the launch as a hazard (what racecheck reports
//     on a GPU).
// Include after cuda_emulation.h and before the kernel headers.
#pragma once

// clang-format off
#include "cuda_emulation.h"  // (before CUTLASS: the CUDA built-ins)
#include "emulated_cp_async.h"
// clang-format on

#include <cuda_fp16.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

// Device intrinsics that CUTLASS's numeric_conversion.h names outside templates: a host compiler
// needs their declarations. __byte_perm is emulated (a conversion the kernels use calls it); the
// others abort if ever called.
[[noreturn]] inline void sm80_intrinsic_not_emulated(const char* name) {
  std::fprintf(stderr, "cuda_emulation: %s is not emulated\n", name);
  std::abort();
}
inline int __dp4a(int, int, int) { sm80_intrinsic_not_emulated("__dp4a"); }
inline unsigned __dp4a(unsigned, unsigned, unsigned) { sm80_intrinsic_not_emulated("__dp4a"); }
// Byte n of the result is byte (s >> 4n) & 7 of the 8 bytes y:x (PTX prmt, default mode).
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const uint64_t bytes = static_cast<uint64_t>(y) << 32 | x;
  unsigned r = 0;
  for (int n = 0; n < 4; ++n)
    r |= static_cast<unsigned>(bytes >> (8 * ((s >> (4 * n)) & 7)) & 0xffu) << (8 * n);
  return r;
}
inline __half2 __hfma2(__half2, __half2, __half2) { sm80_intrinsic_not_emulated("__hfma2"); }

#include <cutlass/numeric_types.h>
#include <cute/tensor.hpp>

namespace cuda_emu::sm80 {

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}: D = A B + C, fp32 products summed in k order.
template <typename Element, typename Real>
struct Mma16x8x16 {
  using DRegisters = float[4];
  using ARegisters = uint32_t[4];
  using BRegisters = uint32_t[2];
  using CRegisters = float[4];

  CUDA_EMU_NO_HOOKS static void fma(float& d0, float& d1, float& d2, float& d3, uint32_t const& a0,
                                    uint32_t const& a1, uint32_t const& a2, uint32_t const& a3,
                                    uint32_t const& b0, uint32_t const& b1, float const& c0,
                                    float const& c1, float const& c2, float const& c3) {
    const Operands mine{{a0, a1, a2, a3}, {b0, b1}};
    const unsigned char* all = warp_gather(WarpOp::kMma, &mine, sizeof(mine));
    // This lane's four results, each a row of A times a column of B read straight from the lanes
    // that hold them (a lane decoding the whole warp's fragments took a quarter of the sm80
    // emulation tests' time).
    const Fragments& f = fragments();
    const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
    const float c[4] = {c0, c1, c2, c3};
    float* d[4] = {&d0, &d1, &d2, &d3};
    for (int v = 0; v < 4; ++v) {
      const typename Fragments::Where* a = f.a[f.c_m[lane][v]];
      const typename Fragments::Where* b = f.b[f.c_n[lane][v]];
      float acc = c[v];
      for (int k = 0; k < 16; ++k) acc += element(all, a[k]) * element(all, b[k]);
      *d[v] = acc;
    }
  }

 private:
  struct Operands {
    uint32_t a[4], b[2];
  };
  static_assert(sizeof(Operands) <= kSlotBytes);

  // The PTX ISA's fragment layouts (CuTe's ALayout, BLayout, CLayout), inverted once: which lane
  // holds A(m, k) and B(n, k), and where in its Operands; and the (m, n) of each lane's
  // accumulator values. Value v of a lane's A or B fragment is the 16-bit half v % 2 (low first)
  // of register v / 2.
  struct Fragments {
    struct Where {
      uint8_t lane, offset, high;  // offset: the register's byte offset in Operands
    };
    Where a[16][16];  // [m][k]
    Where b[8][16];   // [n][k]
    uint8_t c_m[kWarpSize][4], c_n[kWarpSize][4];
  };
  CUDA_EMU_NO_HOOKS static const Fragments& fragments() {
    using Traits = cute::MMA_Traits<Real>;
    static const Fragments table = [] {
      Fragments t{};
      for (int lane = 0; lane < kWarpSize; ++lane) {
        const auto l = static_cast<uint8_t>(lane);
        for (int v = 0; v < 8; ++v) {
          const int mk = typename Traits::ALayout{}(lane, v);  // (m, k), m fastest
          t.a[mk % 16][mk / 16] = {l, static_cast<uint8_t>(offsetof(Operands, a) + 4 * (v / 2)),
                                   static_cast<uint8_t>(v % 2)};
        }
        for (int v = 0; v < 4; ++v) {
          const int nk = typename Traits::BLayout{}(lane, v);  // (n, k), n fastest
          t.b[nk % 8][nk / 8] = {l, static_cast<uint8_t>(offsetof(Operands, b) + 4 * (v / 2)),
                                 static_cast<uint8_t>(v % 2)};
        }
        for (int v = 0; v < 4; ++v) {
          const int mn = typename Traits::CLayout{}(lane, v);  // (m, n), m fastest
          t.c_m[lane][v] = static_cast<uint8_t>(mn % 16);
          t.c_n[lane][v] = static_cast<uint8_t>(mn / 16);
        }
      }
      return t;
    }();
    return table;
  }

  CUDA_EMU_NO_HOOKS static float element(const unsigned char* all, typename Fragments::Where w) {
    uint32_t reg;
    std::memcpy(&reg, all + w.lane * kSlotBytes + w.offset, sizeof(reg));
    const uint16_t bits = static_cast<uint16_t>(w.high ? reg >> 16 : reg & 0xffffu);
    return static_cast<float>(Element::bitcast(bits));
  }
};

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lane l supplies row l % 8 of matrix l / 8 (16
// bytes); register r of lane l receives matrix r's elements (row l / 4, columns 2 (l % 4), +1), or
// with .trans (rows 2 (l % 4), +1, column l / 4).
template <bool kTrans>
struct Ldmatrix4 {
  using SRegisters = cute::uint128_t[1];
  using DRegisters = uint32_t[4];

  static void copy(cute::uint128_t const& row, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                   uint32_t& r3) {
    const unsigned char* mine = reinterpret_cast<const unsigned char*>(&row);
    smem_access(mine, 16, false, kTrans ? "ldmatrix.trans" : "ldmatrix");
    const unsigned char* all = warp_gather(WarpOp::kLdmatrix, &mine, sizeof(mine));
    const unsigned char* rows[32];
    for (int l = 0; l < kWarpSize; ++l)
      std::memcpy(&rows[l], all + l * kSlotBytes, sizeof(rows[l]));
    const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
    uint32_t* out[4] = {&r0, &r1, &r2, &r3};
    for (int m = 0; m < 4; ++m) {
      uint16_t lo, hi;
      if (kTrans) {  // rows 2 (l % 4) and 2 (l % 4) + 1 of matrix m, column l / 4
        std::memcpy(&lo, rows[8 * m + 2 * (lane % 4)] + 2 * (lane / 4), 2);
        std::memcpy(&hi, rows[8 * m + 2 * (lane % 4) + 1] + 2 * (lane / 4), 2);
      } else {  // row l / 4 of matrix m, columns 2 (l % 4) and 2 (l % 4) + 1
        std::memcpy(&lo, rows[8 * m + lane / 4] + 4 * (lane % 4), 2);
        std::memcpy(&hi, rows[8 * m + lane / 4] + 4 * (lane % 4) + 2, 2);
      }
      *out[m] = static_cast<uint32_t>(lo) | static_cast<uint32_t>(hi) << 16;
    }
  }
};

// cp.async of S-sized elements (emulated_cp_async.h).
template <typename S>
struct CpAsync {
  using SRegisters = S[1];
  using DRegisters = S[1];
  static void copy(S const& src, S& dst) { cp_async_issue(&dst, &src, sizeof(S)); }
};

// The operations of sm80/ops.cuh's Sm80Ops, emulated.
struct Ops {
  template <typename Element>
  using Mma =
      std::conditional_t<std::is_same_v<Element, cutlass::bfloat16_t>,
                         Mma16x8x16<cutlass::bfloat16_t, cute::SM80_16x8x16_F32BF16BF16F32_TN>,
                         Mma16x8x16<cutlass::half_t, cute::SM80_16x8x16_F32F16F16F32_TN>>;
  using LdsmN = Ldmatrix4<false>;
  using LdsmT = Ldmatrix4<true>;
  using CpAsync16 = CpAsync<cute::uint128_t>;
  using CpAsync4 = CpAsync<uint32_t>;
  static void cp_async_fence() { cp_async_commit(); }
  template <int kPending>
  static void cp_async_wait() {
    cp_async_wait_group(kPending);
  }
  static void cp_async_wait_all() { cuda_emu::cp_async_wait_all(); }
  // A hint on the GPU; here a read of the byte, so that an address outside every allocation shows
  // (AddressSanitizer in the C++ suite; one past a buffer of the emulation's arena does not).
  static void prefetch_l1(const void* p) {
    [[maybe_unused]] const unsigned char byte = *static_cast<const volatile unsigned char*>(p);
  }
};

}  // namespace cuda_emu::sm80

// The emulated operations have the real instructions' traits (layouts).
namespace cute {
template <typename Element, typename Real>
struct MMA_Traits<cuda_emu::sm80::Mma16x8x16<Element, Real>> : MMA_Traits<Real> {};
template <>
struct Copy_Traits<cuda_emu::sm80::Ldmatrix4<false>> : Copy_Traits<SM75_U32x4_LDSM_N> {};
template <>
struct Copy_Traits<cuda_emu::sm80::Ldmatrix4<true>> : Copy_Traits<SM75_U16x8_LDSM_T> {};
template <typename S>
struct Copy_Traits<cuda_emu::sm80::CpAsync<S>> : Copy_Traits<SM80_CP_ASYNC_CACHEGLOBAL<S, S>> {};
}  // namespace cute

// The dynamic shared memory of the sm80 kernels (their `extern __shared__` arrays are declared in
// these namespaces).
namespace entropy_attn::cuda::sm80::bwd {
alignas(4096) inline char smem[cuda_emu::kSmemCapacity];
}  // namespace entropy_attn::cuda::sm80::bwd
namespace entropy_attn::cuda::sm80::fwd_impl {
alignas(4096) inline char ea_sm80_fwd_smem[cuda_emu::kSmemCapacity];
}  // namespace entropy_attn::cuda::sm80::fwd_impl
