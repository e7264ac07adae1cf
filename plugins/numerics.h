// Exact float conversions of the reference codecs (tqexport.kvquant.float_bytes): fp16, bf16 and
// fp8 bit patterns with round-to-nearest-even, saturating where the reference saturates.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace tqx {

inline uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

inline float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// fp32 -> fp16 bits, round to nearest even, overflow to inf, NaN to a quiet NaN.
inline uint16_t half_bits(float x) {
  const uint32_t f = bits_of(x);
  const uint16_t sign = static_cast<uint16_t>((f >> 16) & 0x8000u);
  const uint32_t a = f & 0x7fffffffu;
  if (a >= 0x7f800000u) return sign | (a > 0x7f800000u ? 0x7e00u : 0x7c00u);
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // rounds to inf (>= 65520)
  if (a < 0x38800000u) {                        // below 2^-14: a subnormal (exact scaling)
    const float scaled = std::fabs(x) * 16777216.0f;
    return sign | static_cast<uint16_t>(std::nearbyint(scaled));
  }
  uint32_t h = (((a >> 23) - 112u) << 10) | ((a & 0x7fffffu) >> 13);
  const uint32_t rest = a & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return sign | static_cast<uint16_t>(h);
}

inline float half_value(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    const float v = static_cast<float>(mant) * 5.9604644775390625e-08f;  // 2^-24
    return (h & 0x8000u) ? -v : v;
  }
  if (exp == 31) return float_of(sign | 0x7f800000u | (mant << 13));
  return float_of(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline uint16_t bf16_bits(float x) {
  uint32_t u = bits_of(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float bf16_value(uint16_t b) { return float_of(static_cast<uint32_t>(b) << 16); }

// Saturating round-to-nearest-even fp8 (bias, mantissa bits, largest finite value), as
// bits.fp8_encode: the sign of -0.0 is kept; NaN becomes max-magnitude NaN pattern of e4m3fn.
inline uint8_t fp8_bits(float x, int bias, int mantissa, float max_value) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  if (std::isnan(x)) return sign | 0x7f;
  float a = std::fabs(x);
  if (a > max_value) a = max_value;
  const float min_normal = std::ldexp(1.0f, 1 - bias);
  const int steps = 1 << mantissa;
  if (a < min_normal) {
    const float q = std::nearbyint(a / std::ldexp(1.0f, 1 - bias - mantissa));
    return sign | static_cast<uint8_t>(q);
  }
  int e;
  std::frexp(a, &e);  // a = f * 2^e, f in [0.5, 1)
  e -= 1;
  float q = std::nearbyint((std::ldexp(a, -e) - 1.0f) * static_cast<float>(steps));
  if (q >= static_cast<float>(steps)) {
    q = 0.0f;
    e += 1;
  }
  return sign | static_cast<uint8_t>(((e + bias) << mantissa) + static_cast<int>(q));
}

}  // namespace tqx
