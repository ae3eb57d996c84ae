// Exponential for the CPU hot loops, written so that GCC vectorizes the loops that inline it
// (branch-free selects, no libm call, no rounding intrinsic). float uses the Cephes expf
// polynomial (about 2 ulp); double keeps std::exp, since it serves the float64 reference path.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace entropy_attn::cpu {

template <typename T>
struct ExpLimits;
template <>
struct ExpLimits<float> {
  static constexpr float kLo = -87.33654f;  // below it e^x is subnormal: taken as 0
};
template <>
struct ExpLimits<double> {
  static constexpr double kLo = -708.3;
};

// x clamped below at kLo (NaN stays NaN): multiplying a weight of 0 by it gives 0, not 0 * -inf.
template <typename T>
inline T clamp_exp_arg(T x) {
  return x < ExpLimits<T>::kLo ? ExpLimits<T>::kLo : x;
}

// std::bit_cast without C++20 (torch 2.11 builds extensions as C++17); GCC folds the memcpy.
template <typename To, typename From>
inline To bit_cast(From from) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast between types of different sizes");
  To to;
  std::memcpy(&to, &from, sizeof(To));
  return to;
}

// e^x for kLo <= x <= 0 (callers pass clamped s - max or s - lse); NaN propagates.
inline float exp_clamped(float x) {
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to the nearest integer
  const float t = x * 1.44269504088896341f + kMagic;
  const float n = t - kMagic;
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // 2^n: n sits in the low mantissa bits of t; move it into the exponent field.
  const uint32_t bits = (bit_cast<uint32_t>(t) - 0x4B400000u + 127u) << 23;
  return p * bit_cast<float>(bits);
}

inline double exp_clamped(double x) { return std::exp(x); }

// e^x with x <= 0, exactly 0 below kLo (and for -inf); `xc` is clamp_exp_arg(x).
template <typename T>
inline T exp_nonpositive(T x, T xc) {
  const T e = exp_clamped(xc);
  return x < ExpLimits<T>::kLo ? T(0) : e;
}

}  // namespace entropy_attn::cpu
