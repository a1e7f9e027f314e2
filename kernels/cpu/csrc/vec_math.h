// Small math helpers shared by the native CPU ops.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace deepinfer {

// exp(x) for x <= 0 (Cephes expf: 2^n * poly(r), ~1 ulp). Its constants, shared by the scalar
// and the 8-lane form:
constexpr float kExpMin = -87.0f;           // below: exp underflows anyway
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kRound = 12582912.0f;       // 1.5 * 2^23: adding and subtracting rounds
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;  // ln 2 = hi + lo
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// gcc vectorizes it inside simple omp simd loops only; exp_nonpos8 for the others.
#pragma omp declare simd notinbranch
inline float exp_nonpos(float x) {
  x = std::max(x, kExpMin);
  const float n = (x * kLog2e + kRound) - kRound;  // round to nearest
  float r = x - n * kLn2Hi;
  r = r - n * kLn2Lo;
  float p = kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = p * r + kExpPoly[i];
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return p * std::bit_cast<float>(bits);
}

#if defined(__AVX2__) && defined(__FMA__)
// exp_nonpos on 8 lanes at once (the same polynomial): for loops the compiler will not
// vectorize by itself.
inline __m256 exp_nonpos8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(kExpMin));
  const __m256 shift = _mm256_set1_ps(kRound);
  const __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(kLog2e), shift), shift);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

}  // namespace deepinfer
