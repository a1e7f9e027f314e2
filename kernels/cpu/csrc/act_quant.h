// Activations quantized to int8 per block of 32 (scale max |x| / 127, round half to even, as
// llama.cpp's Q8 activations), shared by the quantized-weight kernels (quant_linear.cpp,
// kquant_linear.cpp): both must round a row the same way.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;  // activation block (and the 4-bit group)

// x ~ q * scale per block (32 elements, or 256 for the K-quant kernel: llama.cpp's Q8_K);
// sum: per 32 elements, scale * sum(q) (4-bit mins: as llama.cpp's Q8_1, so the product is
// exactly that of the quantized x).
struct QuantX {
  std::vector<int8_t> q;     // [M, K]
  std::vector<float> scale;  // [M, K / block]
  std::vector<float> sum;    // [M, K / 32]
  std::vector<int32_t> isum;  // [M, K / 32] sum(q) itself (the integer GEMMs' offsets)
};

// max |x| over 32 elements.
#if defined(__AVX2__) && defined(__FMA__)
inline float amax_32(const float* x) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * i)));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// q = round(x * inv) over 32 elements, rounded to nearest even (as torch.round in the
// reference); returns sum(q).
inline int32_t quantize_32(const float* x, float inv, int8_t* q) {
  __m256i qi[4];
  for (int i = 0; i < 4; ++i) {
    qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), _mm256_set1_ps(inv)));
  }
  // int32 -> int8 in element order (the packs interleave 128-bit lanes; the permute undoes it)
  const __m256i p16a = _mm256_packs_epi32(qi[0], qi[1]), p16b = _mm256_packs_epi32(qi[2], qi[3]);
  const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]),
                                       _mm256_add_epi32(qi[2], qi[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  return _mm_cvtsi128_si32(s4);
}
#else
inline float amax_32(const float* x) {
  float amax = 0.f;
  for (int64_t k = 0; k < kBlock; ++k) amax = std::max(amax, std::fabs(x[k]));
  return amax;
}

inline int32_t quantize_32(const float* x, float inv, int8_t* q) {
  int32_t sum = 0;
  for (int64_t k = 0; k < kBlock; ++k) {
    q[k] = static_cast<int8_t>(std::nearbyint(x[k] * inv));
    sum += q[k];
  }
  return sum;
}
#endif

// Scale max |x| / 127 per `block` elements (a multiple of 32 dividing K).
QuantX quantize_x(const float* x, int64_t M, int64_t K, int64_t block = kBlock) {
  const int64_t B = K / block, S = block / kBlock;
  QuantX out{std::vector<int8_t>(M * K), std::vector<float>(M * B),
             std::vector<float>(M * K / kBlock), std::vector<int32_t>(M * K / kBlock)};
  for (int64_t i = 0; i < M * B; ++i) {
    const float* xb = x + i * block;
    float amax = 0.f;
    for (int64_t s = 0; s < S; ++s) amax = std::max(amax, amax_32(xb + s * kBlock));
    const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    out.scale[i] = d;
    for (int64_t s = 0; s < S; ++s) {
      const int32_t sum = quantize_32(xb + s * kBlock, inv, out.q.data() + i * block + s * kBlock);
      out.sum[i * S + s] = d * static_cast<float>(sum);
      out.isum[i * S + s] = sum;
    }
  }
  return out;
}

}  // namespace
