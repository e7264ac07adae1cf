// Vector primitives of the attention kernel: one set of names over the instruction set the
// kernel is compiled for (AVX-512: 16 float lanes, AVX2 + FMA + F16C: 8, baseline x86-64: one
// lane, plain floats and ints the compiler vectorizes as far as SSE2 goes). The algorithm code
// is written once against these names; every ISA conditional of the kernel is here.
// Included only by the per-ISA kernel, so these functions live in its namespace (TQX_ISA).
//
//   kLanes, Floats, Ints         lanes of a vector; kLanes floats; kLanes int32s
//   zero, broadcast, load, store, mul, fmadd (a * b + c), max (a > b ? a : b, per lane)
//   load_first, store_first      lanes [0, n) only (n <= kLanes); loaded: the others 0
//   max_lane                     the largest lane of a vector
//   sum_lanes                    of kLanes vectors v: lane j = the sum of v[j]'s lanes
//   widen_bytes                  kLanes bytes, one per lane
//   low_nibbles, high_nibbles    of widened bytes; to_floats: int32 lanes to float
//   packed_codes4(codes, i)      4-bit codes i .. i + kLanes - 1 of a packed run (code 2k: the
//                                low nibble of byte k)
//   Table16, load_table16, lookup  16 floats, looked up by 4-bit index per lane
//   half_to_float                fp16 bits to float, exact (F16C quiets a signalling NaN)
//   e4m3_floats(p)               kLanes fp8 e4m3 bytes to floats, exact (NaN at 0x7f / 0xff)
#pragma once

#ifndef TQX_ISA
#error "simd.h belongs to the per-ISA attention kernel: define TQX_ISA before including it"
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "numerics.h"

namespace tqx {
namespace TQX_ISA {
namespace simd {

#if defined(__AVX2__)
inline float max_lane(__m256 m) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}
#endif

#if defined(__AVX512F__)
constexpr int kLanes = 16;
using Floats = __m512;
using Ints = __m512i;  // int32 lanes

inline __mmask16 first_lanes(int n) { return static_cast<__mmask16>((1u << n) - 1); }

inline Floats zero() { return _mm512_setzero_ps(); }
inline Floats broadcast(float x) { return _mm512_set1_ps(x); }
inline Floats load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, Floats v) { _mm512_storeu_ps(p, v); }
inline Floats load_first(const float* p, int n) { return _mm512_maskz_loadu_ps(first_lanes(n), p); }
inline void store_first(float* p, Floats v, int n) { _mm512_mask_storeu_ps(p, first_lanes(n), v); }
inline Floats mul(Floats a, Floats b) { return _mm512_mul_ps(a, b); }
inline Floats fmadd(Floats a, Floats b, Floats c) { return _mm512_fmadd_ps(a, b, c); }
inline Floats max(Floats a, Floats b) { return _mm512_max_ps(a, b); }
inline float max_lane(Floats v) {
  return max_lane(_mm256_max_ps(_mm512_castps512_ps256(v),
                                _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
}

inline Ints widen_bytes(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline Ints low_nibbles(Ints bytes) { return _mm512_and_si512(bytes, _mm512_set1_epi32(15)); }
inline Ints high_nibbles(Ints bytes) { return _mm512_srli_epi32(bytes, 4); }
inline Floats to_floats(Ints x) { return _mm512_cvtepi32_ps(x); }
inline Ints packed_codes4(const uint8_t* codes, int i) {
  const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i / 2));
  const Ints bytes = _mm512_cvtepu8_epi32(eight);
  const Ints pairs = _mm512_permutexvar_epi32(
      _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0), bytes);
  return _mm512_and_si512(
      _mm512_srlv_epi32(pairs, _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0)),
      _mm512_set1_epi32(15));
}

// one permute
struct Table16 {
  __m512 t;
};
inline Table16 load_table16(const float* table) { return {_mm512_loadu_ps(table)}; }
inline Floats lookup(const Table16& table, Ints index) {
  return _mm512_permutexvar_ps(index, table.t);
}

// a transposing tree: about 3 shuffles and adds per vector
inline Floats sum_lanes(const Floats* v) {
  __m512 s1[8], s2[4];
  for (int k = 0; k < 8; ++k)
    s1[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                          _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k) {
    const __m512d a = _mm512_castps_pd(s1[2 * k]), b = _mm512_castps_pd(s1[2 * k + 1]);
    s2[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                          _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 s3a = _mm512_add_ps(_mm512_shuffle_f32x4(s2[0], s2[1], 0x88),
                                   _mm512_shuffle_f32x4(s2[0], s2[1], 0xDD));
  const __m512 s3b = _mm512_add_ps(_mm512_shuffle_f32x4(s2[2], s2[3], 0x88),
                                   _mm512_shuffle_f32x4(s2[2], s2[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s3a, s3b, 0x88), _mm512_shuffle_f32x4(s3a, s3b, 0xDD));
}

#elif defined(__AVX2__)
constexpr int kLanes = 8;
using Floats = __m256;
using Ints = __m256i;

inline __m256i first_lanes(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline Floats zero() { return _mm256_setzero_ps(); }
inline Floats broadcast(float x) { return _mm256_set1_ps(x); }
inline Floats load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, Floats v) { _mm256_storeu_ps(p, v); }
inline Floats load_first(const float* p, int n) { return _mm256_maskload_ps(p, first_lanes(n)); }
inline void store_first(float* p, Floats v, int n) {
  float lanes[kLanes];
  _mm256_storeu_ps(lanes, v);
  std::copy_n(lanes, n, p);
}
inline Floats mul(Floats a, Floats b) { return _mm256_mul_ps(a, b); }
inline Floats fmadd(Floats a, Floats b, Floats c) { return _mm256_fmadd_ps(a, b, c); }
inline Floats max(Floats a, Floats b) { return _mm256_max_ps(a, b); }

inline Ints widen_bytes(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline Ints low_nibbles(Ints bytes) { return _mm256_and_si256(bytes, _mm256_set1_epi32(15)); }
inline Ints high_nibbles(Ints bytes) { return _mm256_srli_epi32(bytes, 4); }
inline Floats to_floats(Ints x) { return _mm256_cvtepi32_ps(x); }
inline Ints packed_codes4(const uint8_t* codes, int i) {
  int32_t four;
  std::memcpy(&four, codes + i / 2, 4);
  const Ints pairs = _mm256_permutevar8x32_epi32(_mm256_cvtepu8_epi32(_mm_cvtsi32_si128(four)),
                                                 _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
  return _mm256_and_si256(_mm256_srlv_epi32(pairs, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4)),
                          _mm256_set1_epi32(15));
}

// a permute in each half; bit 3 of the index picks the half (blendv reads the sign bit)
struct Table16 {
  __m256 low, high;
};
inline Table16 load_table16(const float* table) {
  return {_mm256_loadu_ps(table), _mm256_loadu_ps(table + 8)};
}
inline Floats lookup(const Table16& table, Ints index) {
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(table.low, index),
                          _mm256_permutevar8x32_ps(table.high, index),
                          _mm256_castsi256_ps(_mm256_slli_epi32(index, 28)));
}

inline Floats sum_lanes(const Floats* v) {
  __m256 s1[4], s2[2];
  for (int k = 0; k < 4; ++k)
    s1[k] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                          _mm256_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 2; ++k) {
    const __m256d a = _mm256_castps_pd(s1[2 * k]), b = _mm256_castps_pd(s1[2 * k + 1]);
    s2[k] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)),
                          _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(s2[0], s2[1], 0x20),
                       _mm256_permute2f128_ps(s2[0], s2[1], 0x31));
}

#else
constexpr int kLanes = 1;
using Floats = float;
using Ints = int32_t;

inline Floats zero() { return 0.0f; }
inline Floats broadcast(float x) { return x; }
inline Floats load(const float* p) { return *p; }
inline void store(float* p, Floats v) { *p = v; }
inline Floats load_first(const float* p, int n) { return n > 0 ? *p : 0.0f; }
inline void store_first(float* p, Floats v, int n) {
  if (n > 0) *p = v;
}
inline Floats mul(Floats a, Floats b) { return a * b; }
inline Floats fmadd(Floats a, Floats b, Floats c) { return a * b + c; }
inline Floats max(Floats a, Floats b) { return a > b ? a : b; }
inline float max_lane(Floats v) { return v; }

inline Ints widen_bytes(const uint8_t* p) { return *p; }
inline Ints low_nibbles(Ints bytes) { return bytes & 15; }
inline Ints high_nibbles(Ints bytes) { return bytes >> 4; }
inline Floats to_floats(Ints x) { return static_cast<float>(x); }
inline Ints packed_codes4(const uint8_t* codes, int i) {
  return (codes[i / 2] >> (i % 2 * 4)) & 15;
}

struct Table16 {
  const float* t;
};
inline Table16 load_table16(const float* table) { return {table}; }
inline Floats lookup(const Table16& table, Ints index) { return table.t[index]; }

inline Floats sum_lanes(const Floats* v) { return v[0]; }
#endif

inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return half_value(h);
#endif
}

// An e4m3 byte s.eeee.mmm is the fp16 s.0eeee.mmm0000000 times 2^8 (the exponent biases differ
// by 8; e4m3 subnormals become fp16 subnormals), so one fp16 conversion decodes it; only
// |byte| 0x7f, NaN in e4m3, needs a fix-up.
#if defined(__AVX512F__)
inline Floats e4m3_floats(const uint8_t* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i mag = _mm256_and_si256(b, _mm256_set1_epi16(0x7f));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(mag, 7),
                                    _mm256_slli_epi16(_mm256_xor_si256(b, mag), 8));
  const __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
  const __mmask16 nan = _mm256_cmpeq_epi16_mask(mag, _mm256_set1_epi16(0x7f));
  if (!nan) return v;
  const __m512 signed_nan = _mm512_or_ps(_mm512_and_ps(v, _mm512_set1_ps(-0.0f)),
                                         _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
  return _mm512_mask_blend_ps(nan, v, signed_nan);
}
#elif defined(__AVX2__)
inline Floats e4m3_floats(const uint8_t* p) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i mag = _mm_and_si128(b, _mm_set1_epi16(0x7f));
  const __m128i h = _mm_or_si128(_mm_slli_epi16(mag, 7), _mm_slli_epi16(_mm_xor_si128(b, mag), 8));
  const __m256 v = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
  const __m128i nan = _mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7f));
  if (_mm_testz_si128(nan, nan)) return v;
  const __m256 signed_nan = _mm256_or_ps(_mm256_and_ps(v, _mm256_set1_ps(-0.0f)),
                                         _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()));
  return _mm256_blendv_ps(v, signed_nan, _mm256_castsi256_ps(_mm256_cvtepi16_epi32(nan)));
}
#else
inline Floats e4m3_floats(const uint8_t* p) {
  const uint16_t h = static_cast<uint16_t>(((p[0] & 0x7f) << 7) | ((p[0] & 0x80) << 8));
  const float v = half_to_float(h) * 256.0f;
  if ((p[0] & 0x7f) != 0x7f) return v;
  return float_of(bits_of(std::numeric_limits<float>::quiet_NaN()) | (bits_of(v) & 0x80000000u));
}
#endif

}  // namespace simd
}  // namespace TQX_ISA
}  // namespace tqx
