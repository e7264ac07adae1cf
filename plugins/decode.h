// Decode of every cache format (inline: the attention loop reads each slot through these).
// Included only by the attention kernel, which is compiled once per instruction set: its
// functions live in that set's namespace (TQX_ISA), so no two kernels share a symbol and a
// linker can never hand one set's code to another (an AVX-512 helper on the baseline path).
#pragma once

#ifndef TQX_ISA
#error "decode.h belongs to the per-ISA attention kernel: define TQX_ISA before including it"
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "formats.h"
#include "simd.h"

namespace tqx {
namespace TQX_ISA {
namespace detail {

inline void unpack_lookup(const uint8_t* in, int n, int bits, const float* table, float* out) {
  if (bits == 4) {
    for (int i = 0; i < n / 2; ++i) {
      const uint8_t b = in[i];
      out[2 * i] = table[b & 15];
      out[2 * i + 1] = table[b >> 4];
    }
  } else if (bits == 2) {
    for (int i = 0; i < n / 4; ++i) {
      const uint8_t b = in[i];
      out[4 * i] = table[b & 3];
      out[4 * i + 1] = table[(b >> 2) & 3];
      out[4 * i + 2] = table[(b >> 4) & 3];
      out[4 * i + 3] = table[b >> 6];
    }
  } else {  // 3 bits
    for (int g = 0; g < n / 8; ++g) {
      const uint32_t w = in[3 * g] | (in[3 * g + 1] << 8) | (in[3 * g + 2] << 16);
      for (int j = 0; j < 8; ++j) out[8 * g + j] = table[(w >> (3 * j)) & 7];
    }
  }
}

// 4-bit codes -> table values in parts order: out[i] = table[low nibble of in[i]],
// out[n/2 + i] = table[high nibble] (a vector of codes per table lookup)
inline void unpack4_parts(const uint8_t* in, int n, const float* table, float* out) {
  const int half = n / 2;
  const simd::Table16 t = simd::load_table16(table);
  int i = 0;
  for (; i + simd::kLanes <= half; i += simd::kLanes) {
    const simd::Ints x = simd::widen_bytes(in + i);
    simd::store(out + i, simd::lookup(t, simd::low_nibbles(x)));
    simd::store(out + half + i, simd::lookup(t, simd::high_nibbles(x)));
  }
  for (; i < half; ++i) {
    out[i] = table[in[i] & 15];
    out[half + i] = table[in[i] >> 4];
  }
}

// e4m3 byte -> value without a table lookup (the loops over a slot vectorize); NaN at 0x7f/0xff
inline float e4m3_value(uint8_t b) {
  constexpr int kMant = gen::kE4M3Mantissa, kBias = gen::kE4M3Bias;
  const uint32_t e = (b >> kMant) & ((1u << (7 - kMant)) - 1), m = b & ((1u << kMant) - 1);
  const float normal = float_of(((e + 127 - kBias) << 23) | (m << (23 - kMant)));
  const float sub = static_cast<float>(m) * (1.0f / (1 << (kBias + kMant - 1)));
  float v = e ? normal : sub;
  v = (b & 0x7f) == 0x7f ? std::numeric_limits<float>::quiet_NaN() : v;
  return float_of(bits_of(v) | (static_cast<uint32_t>(b & 0x80) << 24));
}

// d e4m3 bytes -> values x scale, a vector of bytes at a time
inline void e4m3_decode(const uint8_t* in, int d, float scale, float* out) {
  static_assert(gen::kE4M3Mantissa == 3 && gen::kE4M3Bias == 7, "simd::e4m3_floats' layout");
  int i = 0;
  for (; i + simd::kLanes <= d; i += simd::kLanes)
    simd::store(out + i, simd::mul(simd::e4m3_floats(in + i), simd::broadcast(scale)));
  for (; i < d; ++i) out[i] = e4m3_value(in[i]) * scale;
}

// a little-endian fp16 field
inline float get_half(const uint8_t* p) {
  return simd::half_to_float(static_cast<uint16_t>(p[0] | (p[1] << 8)));
}

inline float nvfp4_value(int code) {
  const float m = gen::kE2M1[code & 7];
  return code >= 8 ? -m : m;
}

// nvfp4 codes (1 sign bit, e2m1) -> values, both signs in one table (built once)
inline const float* nvfp4_table() {
  static const struct Table {
    float v[16];
    Table() {
      for (int c = 0; c < 16; ++c) v[c] = nvfp4_value(c);
    }
  } table;
  return table.v;
}

inline void nvfp4_decode(const uint8_t* in, int d, float global_scale, float* out) {
  static_assert(gen::kNvfp4Block % simd::kLanes == 0, "whole vectors of codes per block");
  const simd::Table16 table = simd::load_table16(nvfp4_table());
  for (int b = 0; b < d / gen::kNvfp4Block; ++b) {
    const simd::Floats s = simd::broadcast(gen::kE4M3[in[d / 2 + b]] * global_scale);
    const uint8_t* codes = in + b * gen::kNvfp4Block / 2;
    float* o = out + b * gen::kNvfp4Block;
    for (int i = 0; i < gen::kNvfp4Block; i += simd::kLanes)
      simd::store(o + i, simd::mul(simd::lookup(table, simd::packed_codes4(codes, i)), s));
  }
}

}  // namespace detail

using detail::e4m3_decode;
using detail::e4m3_value;
using detail::get_half;
using detail::nvfp4_decode;
using detail::unpack4_parts;
using detail::unpack_lookup;

// Whether a key's scale needs its decoded vector's norm (TurboQuant norm correction): the
// attention loop then divides by it once per tile of keys (decode_key leaves it out).
inline bool tile_norm_correction(const Format& f) {
  return f.mode == Mode::TURBOQUANT && f.preset->key_bits != 8 && f.preset->norm_correction;
}

// Decoders are templates on the mode: a kernel instantiates one per format, so the per-slot
// code has no dispatch. decode_key returns the key's scale (without the norm correction of
// tile_norm_correction formats: the caller applies it).
template <Mode M>
inline float decode_key(const Format& f, const CacheView& c, int64_t th, float* out) {
  const int d = f.head_size;
  switch (M) {
    case Mode::NONE:
      if (f.storage == Elem::float32) {
        std::memcpy(out, c.data[0] + th * d * 4, d * 4);
      } else {
        for (int i = 0; i < d; ++i) out[i] = load_elem(c.data[0] + th * d * 2, f.storage, i);
      }
      return 1.0f;
    case Mode::FP8_PER_TENSOR: {
      const uint8_t* b = c.data[0] + th * d;
      if (f.fp8 != &gen::kE4M3Format) {
        for (int i = 0; i < d; ++i) out[i] = f.k_table[b[i]];
      } else {
        e4m3_decode(b, d, f.k_scale, out);
      }
      return 1.0f;
    }
    case Mode::INT8_PER_TOKEN_HEAD: {
      const int8_t* b = reinterpret_cast<const int8_t*>(c.data[0]) + th * d;
      for (int i = 0; i < d; ++i) out[i] = b[i];
      return reinterpret_cast<const float*>(c.data[2])[th];
    }
    case Mode::FP8_PER_TOKEN_HEAD: {
      const uint8_t* b = c.data[0] + th * d;
      e4m3_decode(b, d, 1.0f, out);
      return reinterpret_cast<const float*>(c.data[2])[th];
    }
    case Mode::INT4_PER_TOKEN_HEAD: {
      const uint8_t* b = c.data[0] + th * (d / 2);
      const float zp = c.data[4][th];
      const float s = reinterpret_cast<const float*>(c.data[2])[th];
      for (int i = 0; i < d / 2; ++i) {
        out[2 * i] = (static_cast<float>(b[i] & 15) - zp) * s;
        out[2 * i + 1] = (static_cast<float>(b[i] >> 4) - zp) * s;
      }
      return 1.0f;
    }
    case Mode::NVFP4:
      nvfp4_decode(c.data[0] + th * (d / 2 + d / gen::kNvfp4Block), d, f.k_scale, out);
      return 1.0f;
    case Mode::TURBOQUANT: {
      const auto& lay = *f.layout;
      const uint8_t* slot = c.data[0] + th * lay.slot_size_aligned;
      if (f.preset->key_bits == 8) {
        e4m3_decode(slot, d, 1.0f, out);
        return 1.0f;
      }
      if (f.key_parts())
        unpack4_parts(slot, d, f.key_book->centroids, out);
      else
        unpack_lookup(slot, d, f.preset->key_bits, f.key_book->centroids, out);
      return get_half(slot + lay.key_norm_offset);
    }
  }
  return 1.0f;
}

// Whether a value decodes as codes * scale + offset with one scale and offset per (token, head):
// the attention loop then weighs the codes (decode_value_codes) and adds the offsets once per
// row, instead of a pass over every decoded value.
template <Mode M>
inline bool value_codes_affine(const Format& f) {
  return (M == Mode::TURBOQUANT && !f.preset->value_mse && f.layout->value_groups == 1) ||
         M == Mode::INT4_PER_TOKEN_HEAD;  // int8: its decode is one multiply, nothing gained
}

// A value_codes_affine format's value: out = its codes (in the order decode_value writes),
// with its scale and offset.
template <Mode M>
inline void decode_value_codes(const Format& f, const CacheView& c, int64_t th, float* out,
                               float& scale, float& offset) {
  const int d = f.head_size;
  switch (M) {
    case Mode::TURBOQUANT: {
      static const float kIdentity[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
      const auto& lay = *f.layout;
      const uint8_t* slot = c.data[0] + th * lay.slot_size_aligned;
      const uint8_t* codes = slot + lay.value_offset;
      if (f.value_parts())
        unpack4_parts(codes, d, kIdentity, out);
      else
        unpack_lookup(codes, d, f.preset->value_bits, kIdentity, out);
      scale = get_half(slot + lay.value_params_offset);
      offset = get_half(slot + lay.value_params_offset + 2);
      return;
    }
    case Mode::INT4_PER_TOKEN_HEAD: {
      const uint8_t* b = c.data[1] + th * (d / 2);
      for (int i = 0; i < d / 2; ++i) {
        out[2 * i] = static_cast<float>(b[i] & 15);
        out[2 * i + 1] = static_cast<float>(b[i] >> 4);
      }
      scale = reinterpret_cast<const float*>(c.data[3])[th];
      offset = -static_cast<float>(c.data[5][th]) * scale;
      return;
    }
    default:
      scale = 1.0f;
      offset = 0.0f;
      return;
  }
}

template <Mode M>
inline void decode_value(const Format& f, const CacheView& c, int64_t th, float* out) {
  const int d = f.head_size;
  switch (M) {
    case Mode::NONE:
      if (f.storage == Elem::float32) {
        std::memcpy(out, c.data[1] + th * d * 4, d * 4);
      } else {
        for (int i = 0; i < d; ++i) out[i] = load_elem(c.data[1] + th * d * 2, f.storage, i);
      }
      return;
    case Mode::FP8_PER_TENSOR: {
      const uint8_t* b = c.data[1] + th * d;
      if (f.fp8 != &gen::kE4M3Format) {
        for (int i = 0; i < d; ++i) out[i] = f.v_table[b[i]];
      } else {
        e4m3_decode(b, d, f.v_scale, out);
      }
      return;
    }
    case Mode::INT8_PER_TOKEN_HEAD: {
      const int8_t* b = reinterpret_cast<const int8_t*>(c.data[1]) + th * d;
      const float s = reinterpret_cast<const float*>(c.data[3])[th];
      for (int i = 0; i < d; ++i) out[i] = b[i] * s;
      return;
    }
    case Mode::FP8_PER_TOKEN_HEAD: {
      const uint8_t* b = c.data[1] + th * d;
      const float s = reinterpret_cast<const float*>(c.data[3])[th];
      e4m3_decode(b, d, s, out);
      return;
    }
    case Mode::INT4_PER_TOKEN_HEAD: {
      const uint8_t* b = c.data[1] + th * (d / 2);
      const float zp = c.data[5][th];
      const float s = reinterpret_cast<const float*>(c.data[3])[th];
      for (int i = 0; i < d / 2; ++i) {
        out[2 * i] = (static_cast<float>(b[i] & 15) - zp) * s;
        out[2 * i + 1] = (static_cast<float>(b[i] >> 4) - zp) * s;
      }
      return;
    }
    case Mode::NVFP4:
      nvfp4_decode(c.data[1] + th * (d / 2 + d / gen::kNvfp4Block), d, f.v_scale, out);
      return;
    case Mode::TURBOQUANT: {
      const auto& lay = *f.layout;
      const auto& p = *f.preset;
      const uint8_t* slot = c.data[0] + th * lay.slot_size_aligned;
      const uint8_t* codes = slot + lay.value_offset;
      if (p.value_mse) {
        unpack_lookup(codes, d, p.value_bits, f.value_book->centroids, out);
        float scale = get_half(slot + lay.value_norm_offset);
        if (p.norm_correction) {
          float sumsq = 0.0f;
          for (int i = 0; i < d; ++i) sumsq += out[i] * out[i];
          scale = scale / std::sqrt(sumsq + gen::kNcEps);
        }
        for (int i = 0; i < d; ++i) out[i] *= scale;
        return;
      }
      static const float kIdentity[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
      if (f.value_parts())
        unpack4_parts(codes, d, kIdentity, out);
      else
        unpack_lookup(codes, d, p.value_bits, kIdentity, out);
      const int n = d / lay.value_groups;
      for (int g = 0; g < lay.value_groups; ++g) {
        const uint8_t* params = slot + lay.value_params_offset + 4 * g;
        const float s = get_half(params), z = get_half(params + 2);
        for (int i = g * n; i < (g + 1) * n; ++i) out[i] = out[i] * s + z;
      }
      return;
    }
  }
}

}  // namespace TQX_ISA
}  // namespace tqx
