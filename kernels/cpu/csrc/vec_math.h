// Small math helpers shared by the native CPU ops.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>

namespace deepinfer {

// exp(x) for x <= 0 (Cephes expf: 2^n * poly(r), ~1 ulp); vectorizes inside omp simd loops.
#pragma omp declare simd notinbranch
inline float exp_nonpos(float x) {
  x = std::max(x, -87.0f);
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return p * std::bit_cast<float>(bits);
}

}  // namespace deepinfer
