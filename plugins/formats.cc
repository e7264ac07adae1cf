// Encode and decode of every cache format, byte for byte as tqexport.kvquant.codecs.
#include "formats.h"

#include <algorithm>
#include <cmath>

namespace tqx {
namespace {

const gen::Codebook* find_book(int head_size, int bits) {
  for (const auto& b : gen::kCodebooks)
    if (b.head_size == head_size && b.bits == bits) return &b;
  return nullptr;
}

// tqexport.kvquant.packing for every code width: code i in bits [bits * i, bits * (i + 1)) of
// a little-endian bit stream (the header's generator checks packing.py lays codes out so)
void pack(const uint8_t* codes, int n, int bits, uint8_t* out) {
  std::memset(out, 0, (n * bits + 7) / 8);
  for (int i = 0; i < n; ++i) {
    const int at = i * bits;
    for (uint32_t word = static_cast<uint32_t>(codes[i]) << (at % 8), b = at / 8; word;
         word >>= 8, ++b)
      out[b] |= static_cast<uint8_t>(word & 0xff);
  }
}

uint16_t field_half(float x) {  // tq.fp16_field: NaN stored as the canonical quiet NaN
  return std::isnan(x) ? gen::kFp16Nan : half_bits(x);
}

void put_half(uint8_t* p, uint16_t h) {
  p[0] = h & 0xff;
  p[1] = h >> 8;
}

uint8_t e4m3(float x) { return fp8_bits(x, gen::kE4M3Bias, gen::kE4M3Mantissa, gen::kE4M3Max); }

// MSE vector: rotated unit vector's centroid codes [D] and its norm
float mse_codes(const float* x, int d, const gen::Codebook* book, float* y, uint8_t* codes) {
  float sum = 0.0f;
  for (int i = 0; i < d; ++i) sum += x[i] * x[i];
  const float norm = std::sqrt(sum);
  const float denom = norm + gen::kNormEps;
  for (int i = 0; i < d; ++i) y[i] = x[i] / denom;
  hadamard(y, d);
  const int n_thresh = (1 << book->bits) - 1;
  for (int i = 0; i < d; ++i) {
    int idx = 0;
    for (int t = 0; t < n_thresh; ++t) idx += y[i] >= book->thresholds[t];
    codes[i] = static_cast<uint8_t>(idx);
  }
  return norm;
}

int e2m1(float x) {
  const float a = std::min(std::fabs(x), 6.0f);
  int mag;
  if (a < 2.0f) mag = static_cast<int>(std::nearbyint(a * 2.0f));
  else if (a < 4.0f) mag = static_cast<int>(std::nearbyint(a)) + 2;
  else mag = static_cast<int>(std::nearbyint(a / 2.0f)) + 4;
  return (x < 0 && mag > 0) ? mag + 8 : mag;
}

void nvfp4_encode(const float* x, int d, float global_scale, uint8_t* out, uint8_t* codes) {
  const int blocks = d / gen::kNvfp4Block;
  for (int b = 0; b < blocks; ++b) {
    const float* xb = x + b * gen::kNvfp4Block;
    float amax = 0.0f;
    for (int i = 0; i < gen::kNvfp4Block; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const uint8_t sb = e4m3(amax / 6.0f / global_scale);
    const float eff = gen::kE4M3[sb] * global_scale;
    const float safe = eff > 0 ? eff : 1.0f;
    for (int i = 0; i < gen::kNvfp4Block; ++i) {
      const float q = std::clamp(xb[i] / safe, -6.0f, 6.0f);
      codes[b * gen::kNvfp4Block + i] = eff > 0 ? static_cast<uint8_t>(e2m1(q)) : 0;
    }
    out[d / 2 + b] = sb;
  }
  pack(codes, d, 4, out);
}

// tq.quantize_values over one group: codes, scale, zero (= min), with vLLM's NaN rules
void uniform_values(const float* v, int n, int bits, uint8_t* codes, float& scale, float& lo) {
  const float levels = static_cast<float>((1 << bits) - 1);
  float mn = INFINITY, mx = -INFINITY;
  bool any = false;
  for (int i = 0; i < n; ++i) {
    if (std::isnan(v[i])) continue;
    any = true;
    mn = std::min(mn, v[i]);
    mx = std::max(mx, v[i]);
  }
  lo = any ? mn : NAN;
  const float hi = any ? mx : NAN;
  scale = (hi - lo) / levels;
  if (!(scale > gen::kValueMinScale)) scale = gen::kValueMinScale;
  for (int i = 0; i < n; ++i) {
    float c = std::floor((v[i] - lo) / scale + 0.5f);
    if (std::isnan(c)) c = 0.0f;
    codes[i] = static_cast<uint8_t>(std::clamp(c, 0.0f, levels));
  }
}

}  // namespace

std::string resolve_format(Format& f, const std::string& name, Elem model, int d, float k_scale,
                           float v_scale) {
  const gen::DtypeEntry* entry = nullptr;
  for (const auto& e : gen::kDtypes)
    if (name == e.name) entry = &e;
  if (!entry) return "unknown kv_cache_dtype '" + name + "'";
  if (d < 8 || d > gen::kMaxHeadSize || d % 8)
    return "head_size " + std::to_string(d) + " has no native kernel (multiples of 8 only)";
  f.mode = entry->mode;
  f.head_size = d;
  f.k_scale = k_scale;
  f.v_scale = v_scale;
  const int size_index = d / 8 - 1;  // in [0, kNativeHeadSizes): d checked above
  f.tensors.clear();
  for (int i = entry->first; i < entry->first + entry->count; ++i) {
    const gen::TensorEntry& t = gen::kTensors[i];
    const int width = t.width[size_index];
    if (width == 0)
      return name + " has no native kernel for head_size " + std::to_string(d);
    f.tensors.push_back({t.role, t.model_elem ? model : t.elem, width, t.scalar});
  }
  switch (f.mode) {
    case Mode::NONE:
      f.storage = f.tensors[0].elem;
      break;
    case Mode::FP8_PER_TENSOR:
      if (!entry->fp8) return name + " has no fp8 format";
      f.fp8 = entry->fp8;
      for (int b = 0; b < 256; ++b) {
        f.k_table[b] = f.fp8->table[b] * k_scale;
        f.v_table[b] = f.fp8->table[b] * v_scale;
      }
      break;
    case Mode::TURBOQUANT: {
      for (const auto& p : gen::kPresets)
        if (name == p.name) f.preset = &p;
      for (const auto& l : gen::kLayouts)
        if (name == l.preset && l.head_size == d) f.layout = &l;
      if (!f.preset || !f.layout)
        return name + " has no slot layout for head_size " + std::to_string(d);
      if (f.preset->key_bits != 8 && !(f.key_book = find_book(d, f.preset->key_bits)))
        return name + " has no key codebook for head_size " + std::to_string(d);
      if (f.preset->value_mse && !(f.value_book = find_book(d, f.preset->value_bits)))
        return name + " has no value codebook for head_size " + std::to_string(d);
      break;
    }
    default:
      break;
  }
  return "";
}

void encode(const Format& f, const float* k, const float* v, uint8_t* const* t, int64_t th,
            float* scratch) {
  const int d = f.head_size;
  uint8_t codes[gen::kMaxHeadSize];
  switch (f.mode) {
    case Mode::NONE: {
      const int es = elem_size(f.storage);
      for (int i = 0; i < d; ++i) {
        store_elem(t[0] + th * d * es, f.storage, i, k[i]);
        store_elem(t[1] + th * d * es, f.storage, i, v[i]);
      }
      break;
    }
    case Mode::FP8_PER_TENSOR: {
      const gen::Fp8& fp8 = *f.fp8;
      for (int i = 0; i < d; ++i) {
        t[0][th * d + i] = fp8_bits(k[i] / f.k_scale, fp8.bias, fp8.mantissa, fp8.max);
        t[1][th * d + i] = fp8_bits(v[i] / f.v_scale, fp8.bias, fp8.mantissa, fp8.max);
      }
      break;
    }
    case Mode::INT8_PER_TOKEN_HEAD:
    case Mode::FP8_PER_TOKEN_HEAD: {
      const bool int8 = f.mode == Mode::INT8_PER_TOKEN_HEAD;
      const float qmax = int8 ? gen::kInt8Qmax : gen::kE4M3Max;
      for (int which = 0; which < 2; ++which) {
        const float* x = which ? v : k;
        float amax = 0.0f;
        for (int i = 0; i < d; ++i) amax = std::max(amax, std::fabs(x[i]));
        const float scale = std::max(amax / qmax, gen::kPerTokenHeadMinScale);
        uint8_t* out = t[which] + th * d;
        for (int i = 0; i < d; ++i) {
          const float y = x[i] / scale;
          if (int8) {
            const float q = std::clamp(std::nearbyint(y), -128.0f, 127.0f);
            out[i] = static_cast<uint8_t>(static_cast<int8_t>(q));
          } else {
            out[i] = e4m3(y);
          }
        }
        reinterpret_cast<float*>(t[2 + which])[th] = scale;
      }
      break;
    }
    case Mode::INT4_PER_TOKEN_HEAD: {
      const float levels = static_cast<float>(gen::kInt4Levels);
      for (int which = 0; which < 2; ++which) {
        const float* x = which ? v : k;
        float lo = x[0], hi = x[0];
        for (int i = 1; i < d; ++i) {
          lo = std::min(lo, x[i]);
          hi = std::max(hi, x[i]);
        }
        const float scale = std::max((hi - lo) / levels, gen::kPerTokenHeadMinScale);
        const float zp = std::clamp(std::nearbyint(-lo / scale), 0.0f, levels);
        for (int i = 0; i < d; ++i)
          codes[i] = static_cast<uint8_t>(std::clamp(std::nearbyint(x[i] / scale + zp), 0.0f,
                                                     levels));
        pack(codes, d, 4, t[which] + th * (d / 2));
        reinterpret_cast<float*>(t[2 + which])[th] = scale;
        t[4 + which][th] = static_cast<uint8_t>(zp);
      }
      break;
    }
    case Mode::NVFP4: {
      const int w = d / 2 + d / gen::kNvfp4Block;
      nvfp4_encode(k, d, f.k_scale, t[0] + th * w, codes);
      nvfp4_encode(v, d, f.v_scale, t[1] + th * w, codes);
      break;
    }
    case Mode::TURBOQUANT: {
      const auto& lay = *f.layout;
      const auto& p = *f.preset;
      uint8_t* slot = t[0] + th * lay.slot_size_aligned;
      if (p.key_bits == 8) {
        for (int i = 0; i < d; ++i) slot[i] = std::isnan(k[i]) ? gen::kE4M3Nan : e4m3(k[i]);
      } else {
        const float norm = mse_codes(k, d, f.key_book, scratch, codes);
        pack(codes, d, p.key_bits, slot);
        put_half(slot + lay.key_norm_offset, field_half(norm));
      }
      uint8_t* vcodes = slot + lay.value_offset;
      if (p.value_mse) {
        const float norm = mse_codes(v, d, f.value_book, scratch, codes);
        pack(codes, d, p.value_bits, vcodes);
        put_half(slot + lay.value_norm_offset, field_half(norm));
      } else {
        const int n = d / lay.value_groups;
        for (int g = 0; g < lay.value_groups; ++g) {
          float scale, lo;
          uniform_values(v + g * n, n, p.value_bits, codes + g * n, scale, lo);
          uint8_t* params = slot + lay.value_params_offset + 4 * g;
          put_half(params, field_half(scale));
          put_half(params + 2, field_half(lo));
        }
        pack(codes, d, p.value_bits, vcodes);
      }
      break;
    }
  }
}

}  // namespace tqx
