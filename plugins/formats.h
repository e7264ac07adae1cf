// One layer's cache format, resolved from a node's attributes against the generated tables:
// which tensors the cache holds, how a (token, head) is encoded into them and read back.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "numerics.h"
#include "tqx_generated.h"

namespace tqx {

using gen::Elem;
using gen::Mode;

inline int elem_size(Elem e) { return gen::kElemSize[static_cast<int>(e)]; }

inline float load_elem(const void* p, Elem e, int64_t i) {
  switch (e) {
    case Elem::float32: return static_cast<const float*>(p)[i];
    case Elem::float16: return half_value(static_cast<const uint16_t*>(p)[i]);
    case Elem::bfloat16: return bf16_value(static_cast<const uint16_t*>(p)[i]);
    default: return static_cast<const uint8_t*>(p)[i];
  }
}

inline void store_elem(void* p, Elem e, int64_t i, float x) {
  switch (e) {
    case Elem::float32: static_cast<float*>(p)[i] = x; break;
    case Elem::float16: static_cast<uint16_t*>(p)[i] = half_bits(x); break;
    case Elem::bfloat16: static_cast<uint16_t*>(p)[i] = bf16_bits(x); break;
    default: static_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(x); break;
  }
}

// One cache tensor: element type and values per (token, head) (1 for per-token-head scalars).
struct TensorFmt {
  const char* role;
  Elem elem;
  int width;
  bool scalar = false;  // one value per (token, head): shape [blocks, block_size, kv_heads]
};

// A cache's tensors for one step: base pointers and each tensor's values per (token, head).
struct CacheView {
  const uint8_t* data[gen::kMaxCacheTensors] = {};
  int width[gen::kMaxCacheTensors] = {};
  int elem[gen::kMaxCacheTensors] = {};  // bytes per value
};

struct Format {
  Mode mode = Mode::NONE;
  int head_size = 0;
  Elem storage = Elem::float32;  // unquantized caches
  float k_scale = 1.0f, v_scale = 1.0f;
  const gen::Fp8* fp8 = &gen::kE4M3Format;  // fp8 per tensor's format
  float k_table[256], v_table[256];  // fp8 per tensor: decode with the scale applied
  // TurboQuant
  const gen::PresetEntry* preset = nullptr;
  const gen::LayoutEntry* layout = nullptr;
  const gen::Codebook* key_book = nullptr;
  const gen::Codebook* value_book = nullptr;
  std::vector<TensorFmt> tensors;

  bool key_rotated() const { return preset && preset->key_bits != 8; }
  bool value_rotated() const { return preset && preset->value_mse; }
  // 4-bit codes decode in "parts" order (the low nibbles' elements 0, 2, 4, ..., then the high
  // nibbles' 1, 3, 5, ...): queries are permuted to match and value sums permuted back once
  bool key_parts() const { return preset && preset->key_bits == 4; }
  bool value_parts() const {
    return preset && !preset->value_mse && preset->value_bits == 4 && layout->value_groups == 1;
  }
};

// fp32 Walsh-Hadamard transform scaled to the orthonormal Sylvester matrix: x <- x @ H / sqrt(D)
// (H symmetric, so also H @ x). D is a power of two.
inline void hadamard(float* x, int d) {
  for (int h = 1; h < d; h <<= 1) {
    for (int i = 0; i < d; i += h << 1) {
      for (int j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    }
  }
  const float s = 1.0f / std::sqrt(static_cast<float>(d));
  for (int i = 0; i < d; ++i) x[i] *= s;
}

// x [D] in natural order -> parts order (see Format::key_parts), and back.
inline void to_parts(const float* x, float* out, int d) {
  for (int i = 0; i < d / 2; ++i) {
    out[i] = x[2 * i];
    out[d / 2 + i] = x[2 * i + 1];
  }
}

inline void from_parts(const float* x, float* out, int d) {
  for (int i = 0; i < d / 2; ++i) {
    out[2 * i] = x[i];
    out[2 * i + 1] = x[d / 2 + i];
  }
}

// A node's cache format from the generated tables; empty string on success, else what is wrong.
std::string resolve_format(Format& f, const std::string& kv_cache_dtype, Elem model,
                           int head_size, float k_scale, float v_scale);

// Encode one (token, head): k, v [D] fp32 into the cache tensors at flat index `th`
// ((block * block_size + offset) * kv_heads + head).
void encode(const Format& f, const float* k, const float* v, uint8_t* const* tensors, int64_t th,
            float* scratch);

// decode_key / decode_value: decode.h

}  // namespace tqx
