// The paged KV cache's element types (--kv-cache-dtype): float32, float16 or bfloat16. Keys
// and values are computed in float32; a half cache stores them rounded to nearest even (as
// torch's .to() does) and the attention reads them back as float32.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace deepinfer {

inline float to_float(float x) { return x; }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// dst[0..n) = src[0..n) as T.
template <typename T>
inline void store_row(const float* src, T* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__F16C__)
  if constexpr (std::is_same_v<T, c10::Half>) {
    for (; i + 8 <= n; i += 8) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                       _mm256_cvtps_ph(_mm256_loadu_ps(src + i),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define DEEPINFER_KV_VECTOR 1  // load8 below (every AVX2 CPU has F16C)
// 8 elements from p as float32 lanes.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const c10::BFloat16* p) {  // bfloat16: the upper half of a float32
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

// Calls f with a null pointer of the cache's element type (float, c10::Half or c10::BFloat16).
template <typename F>
inline void dispatch_kv_type(const at::Tensor& cache, const char* op, F&& f) {
  switch (cache.scalar_type()) {
    case at::kFloat:
      f(static_cast<float*>(nullptr));
      break;
    case at::kHalf:
      f(static_cast<c10::Half*>(nullptr));
      break;
    case at::kBFloat16:
      f(static_cast<c10::BFloat16*>(nullptr));
      break;
    default:
      TORCH_CHECK(false, op, ": the KV cache must be float32, float16 or bfloat16, not ",
                  cache.scalar_type());
  }
}

inline bool is_kv_type(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf ||
         t.scalar_type() == at::kBFloat16;
}

}  // namespace deepinfer
