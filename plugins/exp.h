// e^x for x <= 0: the attention kernel's softmax and SiluAndMul's sigmoid.
// Internal linkage and always inlined: each instruction-set kernel and each target clone of
// the op library compiles its own copy with its own flags (no symbol two of them share), and a
// target clone, which inlines no other function, still vectorizes the loop around it.
#pragma once

#include <cstdint>
#include <cstring>

namespace tqx {
namespace {

// Within 2 ulp (Cody-Waite reduction, degree-6 polynomial), without branches; x below -87
// (or NaN) gives 0.
__attribute__((always_inline)) inline float exp_neg(float x) {
  x = x > -87.0f ? x : -87.0f;
  const float n = __builtin_nearbyintf(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  uint32_t bits;  // p * 2^n: n added to the exponent field (unsigned: wraps, never UB)
  std::memcpy(&bits, &p, 4);
  bits += static_cast<uint32_t>(static_cast<int32_t>(n)) << 23;
  std::memcpy(&p, &bits, 4);
  return x <= -87.0f ? 0.0f : p;
}

}  // namespace
}  // namespace tqx
