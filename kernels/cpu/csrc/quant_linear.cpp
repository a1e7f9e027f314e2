// Linear layers on quantized weights (CPU): y[M, N] = x[M, K] @ dequant(w)[N, K]^T (+ bias).
//
// Three weight layouts (workers/quantization/weight.py), told apart by the weight's dtype:
//   int8 [N, K]            w = q * scale                 (per channel, or groups of 16 / 32)
//   float8_e4m3fn [N, K]   w = fp8(q) * scale            (groups along K, e.g. DeepSeek's 128)
//   uint8 [N, K / 2]       w = q4 * scale + min          (groups of 32: byte j holds element j in
//                                                          its low nibble, j + 16 in its high one)
// scales (and mins) are [N, K / group], float32 or float16 (GGUF's own, read as they are).
//
// quant_linear_small_m is for decode batches (M of 1..4), where a linear is bound by reading its
// weight: the quantized bytes (a quarter or an eighth of float32's) stream once for all M rows.
// int8 and 4-bit weights meet activations quantized to int8 per block of 32 (scale max|x| / 127,
// as llama.cpp's Q8 activations): one u8 x s8 multiply-add instruction takes 32 products, where
// decoding to floats took four conversions and four FMAs and made the kernel compute-bound.
// fp8 weights are decoded to floats in registers and meet x as it is. The 4-bit min term is
// min * sum(x over the group). Threads take contiguous slices of output
// rows, with software prefetch as in linear.cpp.
//
// quant_linear_int_gemm (int8 in groups of a multiple of 32, 4-bit) is the integer GEMM for
// larger M, below; quant_linear picks between it and the small-M kernel by M.
//
// quant_linear_dequant is for larger M (prefill chunks, big decode batches): each thread
// dequantizes a tile of weight rows into a float32 buffer that stays in cache and multiplies it
// with a GEMM, so the float32 weight never exists whole.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "act_quant.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

enum class Kind { kInt8, kFp8, kQ4 };

#if defined(__AVX2__) && defined(__FMA__)
constexpr int kV = 8;  // floats per vector
using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vset1(float s) { return _mm256_set1_ps(s); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline __m128i load16(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}
inline Vec i8x8(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)); }
inline Vec u8x8(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)); }
// e4m3fn (bias 7, no infinities) to float32: a normal number's exponent is rebiased by adding
// 120; a subnormal (exponent 0) is its mantissa times 2^-9.
inline Vec fp8x8(__m128i b) {
  const __m256i v = _mm256_cvtepu8_epi32(b);
  const __m256i e = _mm256_and_si256(v, _mm256_set1_epi32(0x7F));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x80)), 24);
  const __m256i normal =
      _mm256_add_epi32(_mm256_slli_epi32(e, 20), _mm256_set1_epi32(120 << 23));
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(e), _mm256_set1_ps(1.0f / 512));
  const __m256 is_sub = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), e));
  const __m256 mag = _mm256_blendv_ps(_mm256_castsi256_ps(normal), sub, is_sub);
  return _mm256_or_ps(mag, _mm256_castsi256_ps(sign));
}
// 16 bytes -> 16 int8 / fp8 weights (2 vectors) or 32 4-bit ones (4 vectors).
template <Kind KD>
inline void decode(const uint8_t* p, Vec* out) {
  const __m128i b = load16(p);
  if constexpr (KD == Kind::kInt8) {
    out[0] = i8x8(b);
    out[1] = i8x8(_mm_srli_si128(b, 8));
  } else if constexpr (KD == Kind::kFp8) {
    out[0] = fp8x8(b);
    out[1] = fp8x8(_mm_srli_si128(b, 8));
  } else {
    const __m128i nib = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(b, nib), hi = _mm_and_si128(_mm_srli_epi16(b, 4), nib);
    out[0] = u8x8(lo);
    out[1] = u8x8(_mm_srli_si128(lo, 8));
    out[2] = u8x8(hi);
    out[3] = u8x8(_mm_srli_si128(hi, 8));
  }
}
#else
constexpr int kV = 8;  // portable: 8 lanes the auto-vectorizer can map to SSE
struct Vec {
  float v[kV];
};
inline Vec vzero() { return Vec{}; }
inline Vec vload(const float* p) {
  Vec r;
  for (int i = 0; i < kV; ++i) r.v[i] = p[i];
  return r;
}
inline void vstore(float* p, Vec v) {
  for (int i = 0; i < kV; ++i) p[i] = v.v[i];
}
inline Vec vset1(float s) {
  Vec r;
  for (int i = 0; i < kV; ++i) r.v[i] = s;
  return r;
}
inline Vec vfma(Vec a, Vec b, Vec c) {
  for (int i = 0; i < kV; ++i) c.v[i] += a.v[i] * b.v[i];
  return c;
}
inline float vsum(Vec v) {
  float s = 0.f;
  for (int i = 0; i < kV; ++i) s += v.v[i];
  return s;
}
inline float fp8_value(uint8_t b) {
  const int e = (b >> 3) & 0xF, m = b & 7;
  const float mag = e == 0 ? m * (1.0f / 512) : std::ldexp(1.0f + m / 8.0f, e - 7);
  return (b & 0x80) ? -mag : mag;
}
template <Kind KD>
inline void decode(const uint8_t* p, Vec* out) {
  for (int i = 0; i < 16; ++i) {
    if constexpr (KD == Kind::kInt8) {
      out[i / kV].v[i % kV] = static_cast<float>(static_cast<int8_t>(p[i]));
    } else if constexpr (KD == Kind::kFp8) {
      out[i / kV].v[i % kV] = fp8_value(p[i]);
    } else {
      out[i / kV].v[i % kV] = static_cast<float>(p[i] & 0xF);
      out[(i + 16) / kV].v[i % kV] = static_cast<float>(p[i] >> 4);
    }
  }
}
#endif

// Weights decoded per 16 bytes: 16 int8 / fp8 elements or 32 4-bit ones.
template <Kind KD>
constexpr int kStep = KD == Kind::kQ4 ? 32 : 16;
template <Kind KD>
constexpr int kNV = kStep<KD> / kV;
template <Kind KD>
constexpr int64_t row_bytes(int64_t K) {
  return KD == Kind::kQ4 ? K / 2 : K;
}

// Weight bytes are prefetched this far ahead of where a row is read (rows are contiguous, so
// that is a later row): 4 KiB measured fastest for a decode token of the default model's Q4_1
// weights (~9.0 ms, against ~12 ms one group of rows ahead). A prefetch past the end never faults.
constexpr int64_t kPfAhead = 4096;

inline void prefetch(const uint8_t* p) {
#if defined(__GNUC__)
  __builtin_prefetch(p, 0, 2);  // into L2, as linear.cpp
#else
  (void)p;
#endif
}

struct Weights {
  const uint8_t* q;   // [N, row_bytes]
  const void* scale;  // [N, G], float32 or float16 (`half`)
  const void* min;    // [N, G] (4-bit, the scales' dtype) or null
  bool half;
  int64_t K, G, g;  // features, groups per row, group size
};

// Scale or min i (row-major [N, G]) as a float.
inline float scalar(const Weights& w, const void* p, int64_t i) {
  return w.half ? static_cast<float>(static_cast<const c10::Half*>(p)[i])
                : static_cast<const float*>(p)[i];
}

// n scales or mins from element i on as float32: the weight's own when they are float32, else
// converted into buf (float16 scales are GGUF's own, exact, and half the bytes to stream).
inline const float* floats_at(const Weights& w, const void* p, int64_t i, int64_t n,
                              float* buf) {
  if (!w.half) return static_cast<const float*>(p) + i;
  const auto* h = static_cast<const c10::Half*>(p) + i;
  int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  for (; j + 8 <= n; j += 8) {
    _mm256_storeu_ps(buf + j, _mm256_cvtph_ps(load16(reinterpret_cast<const uint8_t*>(h + j))));
  }
#endif
  for (; j < n; ++j) buf[j] = static_cast<float>(h[j]);
  return buf;
}

// ---- fp8 weights against float activations ----

// y[m, r] = dot(x[m], dequant(w row r)) (+ bias[r]) for m < MG, r < R, rows n0.. of w: each
// group's partial dot product scaled once.
template <int MG, int R>
inline void fp8_rows_dot(const float* __restrict x, const Weights& w, int64_t n0,
                         const float* bias, float* __restrict y, int64_t ldy) {
  constexpr Kind KD = Kind::kFp8;
  const int64_t K = w.K, G = w.G, g = w.g;
  Vec total[MG][R];
#pragma GCC unroll 16
  for (int m = 0; m < MG; ++m) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) total[m][r] = vzero();
  }
  for (int64_t gi = 0; gi < G; ++gi) {
    Vec part[MG][R];
#pragma GCC unroll 16
    for (int m = 0; m < MG; ++m) {
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) part[m][r] = vzero();
    }
    for (int64_t k = gi * g; k < (gi + 1) * g; k += kStep<KD>) {
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const uint8_t* wr = w.q + (n0 + r) * K + k;
        if ((k & 63) == 0) prefetch(wr + kPfAhead);  // once a cache line
        Vec wv[kNV<KD>];
        decode<KD>(wr, wv);
#pragma GCC unroll 16
        for (int m = 0; m < MG; ++m) {
#pragma GCC unroll 16
          for (int v = 0; v < kNV<KD>; ++v) {
            part[m][r] = vfma(vload(x + m * K + k + v * kV), wv[v], part[m][r]);
          }
        }
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const Vec s = vset1(scalar(w, w.scale, (n0 + r) * G + gi));
#pragma GCC unroll 16
      for (int m = 0; m < MG; ++m) total[m][r] = vfma(part[m][r], s, total[m][r]);
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MG; ++m) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      y[m * ldy + r] = vsum(total[m][r]) + (bias != nullptr ? bias[n0 + r] : 0.f);
    }
  }
}

// Output rows [n0, n1): groups of R weight rows against every input row (groups of up to 4
// input rows: the later groups find the weight in cache), then single leftover rows.
template <int R>
void fp8_slice(const float* x, const Weights& w, const float* bias, float* y, int64_t M,
               int64_t N, int64_t n0, int64_t n1) {
  auto all_m = [&](auto rows, int64_t n) {
    constexpr int RR = decltype(rows)::value;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) fp8_rows_dot<4, RR>(x + m * w.K, w, n, bias, y + m * N + n, N);
    const float* xm = x + m * w.K;
    switch (M - m) {
      case 1: fp8_rows_dot<1, RR>(xm, w, n, bias, y + m * N + n, N); break;
      case 2: fp8_rows_dot<2, RR>(xm, w, n, bias, y + m * N + n, N); break;
      case 3: fp8_rows_dot<3, RR>(xm, w, n, bias, y + m * N + n, N); break;
      default: break;
    }
  };
  int64_t n = n0;
  for (; n + R <= n1; n += R) all_m(std::integral_constant<int, R>{}, n);
  for (; n < n1; ++n) all_m(std::integral_constant<int, 1>{}, n);
}

void run_fp8_small_m(const float* x, const Weights& w, const float* bias, float* y, int64_t M,
                     int64_t N) {
  // Registers: M x R partial and total accumulators, so fewer weight rows at a time as M grows.
  const int R = M == 1 ? 4 : (M == 2 ? 2 : 1);
  const int64_t groups = (N + R - 1) / R;
  const int64_t grain = std::max<int64_t>(1, (int64_t{16} << 10) / std::max<int64_t>(1, R * w.K));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    const int64_t n0 = g0 * R, n1 = std::min(g1 * R, N);
    if (R == 4) {
      fp8_slice<4>(x, w, bias, y, M, N, n0, n1);
    } else if (R == 2) {
      fp8_slice<2>(x, w, bias, y, M, N, n0, n1);
    } else {
      fp8_slice<1>(x, w, bias, y, M, N, n0, n1);
    }
  });
}

// ---- int8 / 4-bit weights against int8 activations ----


// The activations' int8 blocks of 32 (QuantX, quantize_x): act_quant.h.

// How a weight row's scales meet its blocks of 32: one scale a block (4-bit, Q8_0), one a
// group of several blocks (int8 per channel: one a row), or two a block (Q6_K's groups of 16).
enum class Scales { kPerBlock, kPerGroup, kPer16 };

#if defined(__AVX2__) && defined(__FMA__)
// Integer dot products of one block of 32 weights with 32 activations, as 8 int32 partial sums
// (lanes 0-3: elements 0-15, lanes 4-7: elements 16-31) converted to floats. u8 x s8 pairs sum
// to at most 2 * 128 * 127 (int8) or 2 * 15 * 127 (4-bit): no 16-bit saturation.
inline __m256i load32(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
inline __m256 block_dot(__m256i w_u8, __m256i x_s8) {
  const __m256i p16 = _mm256_maddubs_epi16(w_u8, x_s8);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}
// 16 bytes of 4-bit weights -> their 32 values as bytes, in element order: the bytes loaded
// into both halves, the high half shifted down a nibble, masked (two ALU operations).
inline __m256i q4_bytes(const uint8_t* p) {
  const __m256i both = _mm256_broadcastsi128_si256(load16(p));
  const __m256i shifted = _mm256_srlv_epi32(both, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
  return _mm256_and_si256(shifted, _mm256_set1_epi8(0x0F));
}

// sum(a[i] * b[i]) for i < n, vectorized (the 4-bit min terms: mins x block sums).
inline float dot(const float* a, const float* b, int64_t n) {
  Vec acc = vzero();
  int64_t i = 0;
  for (; i + kV <= n; i += kV) acc = vfma(vload(a + i), vload(b + i), acc);
  float s = vsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y[m, r] for m < MG, r < R: weight rows n.. against MG rows of quantized activations. A
// block's weight and activation scales are multiplied first (for a chunk of blocks at once),
// so each block costs one FMA; a row's blocks go U at a time into U independent sums (one
// chain of FMAs is latency-bound at 4-bit's 16 bytes a block).
template <Kind KD, int MG, int R, int U, Scales SL>
inline void int_rows_dot(const int8_t* __restrict xq, const float* xd, const float* xs,
                         int64_t B, const Weights& w, int64_t n, const float* bias,
                         float* __restrict y, int64_t ldy) {
  constexpr int64_t kPfMask = KD == Kind::kQ4 ? 3 : 1;  // one prefetch per 64-byte line
  constexpr int64_t kChunk = 64;                        // blocks whose scales are combined
  constexpr int kPer = SL == Scales::kPer16 ? 2 : 1;    // scales a block
  const int64_t K = w.K, G = w.G, rb = row_bytes<KD>(K);
  Vec total[MG][R][U];
  float min_terms[MG][R] = {};  // 4-bit: sum over blocks of min x block sum
#pragma GCC unroll 16
  for (int m = 0; m < MG; ++m) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 16
      for (int u = 0; u < U; ++u) total[m][r][u] = vzero();
    }
  }
  float sbuf[kPer * kChunk], ds[R][MG][kPer * kChunk];  // ds: the chunk's combined scales
  // Rows in one chunk (B <= kChunk, per-block scales): the R rows' scales and mins are
  // contiguous, converted in one go (no per-row tails).
  const bool whole = SL == Scales::kPerBlock && B <= kChunk && R > 1;
  float rsbuf[R > 1 ? R * kChunk : 1], rmbuf[R > 1 && KD == Kind::kQ4 ? R * kChunk : 1];
  const float* rsc = whole ? floats_at(w, w.scale, n * G, R * G, rsbuf) : nullptr;
  const float* rmn = whole && KD == Kind::kQ4 ? floats_at(w, w.min, n * G, R * G, rmbuf) : nullptr;
  // UC blocks side by side from block b (b0: the chunk's first).
  auto blocks = [&](auto uc, int64_t b, int64_t b0) {
    constexpr int UC = decltype(uc)::value;
#pragma GCC unroll 16
    for (int u = 0; u < UC; ++u) {
      __m256i xv[MG];
#pragma GCC unroll 16
      for (int m = 0; m < MG; ++m) xv[m] = load32(xq + m * K + (b + u) * kBlock);
      const int64_t i = kPer * (b + u - b0);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = w.q + (n + r) * rb + row_bytes<KD>((b + u) * kBlock);
        if (((b + u) & kPfMask) == 0) prefetch(p + kPfAhead);
        __m256i wv, wabs;
        if constexpr (KD == Kind::kQ4) {
          wv = q4_bytes(p);
        } else {  // the sign trick: |w| as the unsigned operand, x takes w's sign
          wv = load32(p);
          wabs = _mm256_abs_epi8(wv);
        }
#pragma GCC unroll 16
        for (int m = 0; m < MG; ++m) {
          const Vec d = KD == Kind::kQ4 ? block_dot(wv, xv[m])
                                        : block_dot(wabs, _mm256_sign_epi8(xv[m], wv));
          const Vec s = SL == Scales::kPer16
                            ? _mm256_set_m128(_mm_broadcast_ss(&ds[r][m][i + 1]),
                                              _mm_broadcast_ss(&ds[r][m][i]))
                            : _mm256_broadcast_ss(&ds[r][m][i]);
          total[m][r][u] = vfma(d, s, total[m][r][u]);
        }
      }
    }
  };
  for (int64_t b0 = 0; b0 < B; b0 += kChunk) {
    const int64_t nb = std::min(kChunk, B - b0);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      if constexpr (SL == Scales::kPerGroup) {  // each group's scale read once
        const int64_t per_group = w.g / kBlock;
        for (int64_t i = 0; i < nb;) {
          const int64_t gi = (b0 + i) / per_group, e = std::min(nb, (gi + 1) * per_group - b0);
          const float sg = scalar(w, w.scale, (n + r) * G + gi);
          for (; i < e; ++i) {
#pragma GCC unroll 16
            for (int m = 0; m < MG; ++m) ds[r][m][i] = sg * xd[m * B + b0 + i];
          }
        }
      } else {
        const float* sc = whole ? rsc + r * G
                                : floats_at(w, w.scale, (n + r) * G + kPer * b0, kPer * nb, sbuf);
#pragma GCC unroll 16
        for (int m = 0; m < MG; ++m) {
          int64_t i = 0;
          if constexpr (kPer == 1) {
            for (; i + kV <= nb; i += kV) {
              vstore(&ds[r][m][i], _mm256_mul_ps(vload(sc + i), vload(xd + m * B + b0 + i)));
            }
          }
          for (; i < kPer * nb; ++i) ds[r][m][i] = sc[i] * xd[m * B + b0 + i / kPer];
        }
      }
      if constexpr (KD == Kind::kQ4) {  // a 4-bit group is one block: block sums line up
        const float* mn = whole ? rmn + r * G : floats_at(w, w.min, (n + r) * G + b0, nb, sbuf);
#pragma GCC unroll 16
        for (int m = 0; m < MG; ++m) min_terms[m][r] += dot(mn, xs + m * B + b0, nb);
      }
    }
    int64_t b = b0;
    for (; b + U <= b0 + nb; b += U) blocks(std::integral_constant<int, U>{}, b, b0);
    for (; b < b0 + nb; ++b) blocks(std::integral_constant<int, 1>{}, b, b0);
  }
#pragma GCC unroll 16
  for (int m = 0; m < MG; ++m) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 16
      for (int u = 1; u < U; ++u) total[m][r][0] = _mm256_add_ps(total[m][r][0], total[m][r][u]);
    }
    if constexpr (R == 4) {  // the 4 rows' horizontal sums at once
      const __m256 h01 = _mm256_hadd_ps(total[m][0][0], total[m][1][0]);
      const __m256 h23 = _mm256_hadd_ps(total[m][2][0], total[m][3][0]);
      const __m256 h = _mm256_hadd_ps(h01, h23);
      __m128 sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
      sums = _mm_add_ps(sums, _mm_loadu_ps(min_terms[m]));
      if (bias != nullptr) sums = _mm_add_ps(sums, _mm_loadu_ps(bias + n));
      _mm_storeu_ps(y + m * ldy, sums);
    } else {
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        y[m * ldy + r] = vsum(total[m][r][0]) + min_terms[m][r] +
                         (bias != nullptr ? bias[n + r] : 0.f);
      }
    }
  }
}

#else
template <Kind KD, int MG, int R, int U, Scales SL>
inline void int_rows_dot(const int8_t* xq, const float* xd, const float* xs, int64_t B,
                         const Weights& w, int64_t n, const float* bias, float* y,
                         int64_t ldy) {
  const int64_t K = w.K, G = w.G, g = w.g;
  for (int64_t row = n; row < n + R; ++row) {
    const uint8_t* wr = w.q + row * row_bytes<KD>(K);
    for (int m = 0; m < MG; ++m) {
      float total = 0.f;
      for (int64_t b = 0; b < B; ++b) {
        int32_t sums[2] = {0, 0};  // elements 0-15, 16-31 of the block
        for (int64_t k = 0; k < kBlock; ++k) {
          const int64_t e = b * kBlock + k;
          const uint8_t byte = wr[b * 16 + (k & 15)];  // 4-bit: element k's byte
          const int32_t q = KD != Kind::kQ4 ? static_cast<int8_t>(wr[e])
                                             : (k < 16 ? byte & 0xF : byte >> 4);
          sums[k / 16] += q * xq[m * K + e];
        }
        const float d = xd[m * B + b];
        for (int h = 0; h < 2; ++h) {
          const int64_t gi = (b * kBlock + h * 16) / g;
          total += sums[h] * scalar(w, w.scale, row * G + gi) * d;
        }
        if constexpr (KD == Kind::kQ4) total += scalar(w, w.min, row * G + b) * xs[m * B + b];
      }
      y[m * ldy + row - n] = total + (bias != nullptr ? bias[row] : 0.f);
    }
  }
}
#endif

// Output rows [n0, n1) against every input row: R weight rows at a time against MG input rows
// at a time, then single leftover rows.
template <Kind KD, int MG, int R, int U, Scales SL>
void int_slice(const QuantX& xq, const Weights& w, const float* bias, float* y, int64_t M,
               int64_t N, int64_t n0, int64_t n1) {
  const int64_t K = w.K, B = K / kBlock;
  auto rows = [&](auto rr, int64_t n) {
    constexpr int RR = decltype(rr)::value;
    int64_t m = 0;
    auto call = [&](auto mg) {
      constexpr int G = decltype(mg)::value;
      int_rows_dot<KD, G, RR, U, SL>(xq.q.data() + m * K, xq.scale.data() + m * B,
                                     xq.sum.data() + m * B, B, w, n, bias, y + m * N + n, N);
    };
    for (; m + MG <= M; m += MG) call(std::integral_constant<int, MG>{});
    for (; m < M; ++m) call(std::integral_constant<int, 1>{});
  };
  int64_t n = n0;
  for (; n + R <= n1; n += R) rows(std::integral_constant<int, R>{}, n);
  for (; n < n1; ++n) rows(std::integral_constant<int, 1>{}, n);
}

template <Kind KD, int MG, int R, int U, Scales SL>
void run_int(const QuantX& xq, const Weights& w, const float* bias, float* y, int64_t M,
             int64_t N) {
  const int64_t groups = (N + R - 1) / R;
  const int64_t grain =
      std::max<int64_t>(1, (int64_t{16} << 10) / std::max<int64_t>(1, R * row_bytes<KD>(w.K)));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    int_slice<KD, MG, R, U, SL>(xq, w, bias, y, M, N, g0 * R, std::min(g1 * R, N));
  });
}

template <Kind KD>
void run_int_small_m(const float* x, const Weights& w, const float* bias, float* y, int64_t M,
                     int64_t N) {
  const QuantX xq = quantize_x(x, M, w.K);
  // Measured per layout (scripts/bench_small_m.py): int8 streams best one row at a time with 4
  // blocks side by side (4 rows side by side: ~30 % slower at one input row; the hardware
  // prefetcher follows one ascending stream better than four interleaved ones), 2 rows at a
  // time for 2-4 input rows; 4-bit rows (288 bytes here) are short enough that the per-row
  // work dominates: 4 rows at a time, for any M.
  auto run = [&](auto sl) {
    constexpr Scales SL = decltype(sl)::value;
    if constexpr (KD == Kind::kQ4) {
      if (M == 1) {
        run_int<KD, 1, 4, 1, SL>(xq, w, bias, y, M, N);
      } else {
        run_int<KD, 2, 4, 1, SL>(xq, w, bias, y, M, N);
      }
    } else if (M == 1) {
      run_int<KD, 1, 1, 4, SL>(xq, w, bias, y, M, N);
    } else {
      run_int<KD, 2, 2, 1, SL>(xq, w, bias, y, M, N);
    }
  };
  if constexpr (KD == Kind::kQ4) {  // groups of 32: a scale a block
    run(std::integral_constant<Scales, Scales::kPerBlock>{});
  } else if (w.g == kBlock) {
    run(std::integral_constant<Scales, Scales::kPerBlock>{});
  } else if (w.g == 16) {
    run(std::integral_constant<Scales, Scales::kPer16>{});
  } else {
    run(std::integral_constant<Scales, Scales::kPerGroup>{});
  }
}

// ---- int8 and 4-bit weights against int8 activations, any M: a register-blocked GEMM ----
//
// The small-M kernel's numerics (activations int8 per block of 32, the block's integer dot
// product scaled by activation and weight scale), arranged for many rows: a tile of 16 weight
// rows is repacked so that one 32-byte vector holds 4 consecutive k of 8 output columns; a
// broadcast quad of one activation row meets it in one u8 x s8 multiply-add, whose pairs a
// second multiply-add folds into 8 int32 sums, one per column (4-bit: once a block, after its 8
// quads summed in 16 bits; see gemm_rows). No horizontal sums; per block
// of 32, one conversion and one FMA per 8 columns. Int8 weights in groups of a multiple of 32
// (per channel, GGUF Q8_0) and 4-bit ones (unpacked to bytes 0..15 per tile; the min term is
// min x the activation block's sum, one more FMA a block); without AVX2 the small-M kernel
// computes the same for any M. With AVX512-VNNI, gemm_rows_vnni takes the same tiles a quad at
// a time as one 64-byte vector (1B Q8_0 linears: 8 rows 113 -> 52 ms, 256 rows 228 -> 555
// GOPS), and quant_linear sends int8 weights with kept tiles there from 3 rows.
constexpr int64_t kTileN = 16;   // output columns per tile (two vectors)
#if defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kChunkM = 256;  // activation rows per pass over the tiles (they stay in L2)

// `rows` int8 rows of K (rows <= 16, `ld` apart): quad p of column c at packed[p * 16 + c];
// missing columns are zeros.
void pack_tile(const int8_t* src, int64_t ld, int64_t K, int64_t rows, int32_t* packed) {
  const int64_t P = K / 4;
  int64_t whole = 0;  // quads moved by 8 x 8 transposes (8 columns x 8 quads at a time)
  if (rows == kTileN) {
    for (; whole + 8 <= P; whole += 8) {
      for (int64_t c0 = 0; c0 < kTileN; c0 += 8) {
        __m256i r[8];
        for (int i = 0; i < 8; ++i) r[i] = load32(src + (c0 + i) * ld + 4 * whole);
        // 32-bit 8 x 8 transpose: r[i] lane j (quad whole + j of column c0 + i) -> t[j] lane i
        const __m256i a0 = _mm256_unpacklo_epi32(r[0], r[1]), a1 = _mm256_unpackhi_epi32(r[0], r[1]);
        const __m256i a2 = _mm256_unpacklo_epi32(r[2], r[3]), a3 = _mm256_unpackhi_epi32(r[2], r[3]);
        const __m256i a4 = _mm256_unpacklo_epi32(r[4], r[5]), a5 = _mm256_unpackhi_epi32(r[4], r[5]);
        const __m256i a6 = _mm256_unpacklo_epi32(r[6], r[7]), a7 = _mm256_unpackhi_epi32(r[6], r[7]);
        const __m256i b0 = _mm256_unpacklo_epi64(a0, a2), b1 = _mm256_unpackhi_epi64(a0, a2);
        const __m256i b2 = _mm256_unpacklo_epi64(a1, a3), b3 = _mm256_unpackhi_epi64(a1, a3);
        const __m256i b4 = _mm256_unpacklo_epi64(a4, a6), b5 = _mm256_unpackhi_epi64(a4, a6);
        const __m256i b6 = _mm256_unpacklo_epi64(a5, a7), b7 = _mm256_unpackhi_epi64(a5, a7);
        const __m256i t[8] = {
            _mm256_permute2x128_si256(b0, b4, 0x20), _mm256_permute2x128_si256(b1, b5, 0x20),
            _mm256_permute2x128_si256(b2, b6, 0x20), _mm256_permute2x128_si256(b3, b7, 0x20),
            _mm256_permute2x128_si256(b0, b4, 0x31), _mm256_permute2x128_si256(b1, b5, 0x31),
            _mm256_permute2x128_si256(b2, b6, 0x31), _mm256_permute2x128_si256(b3, b7, 0x31)};
        for (int j = 0; j < 8; ++j) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(packed + (whole + j) * kTileN + c0), t[j]);
        }
      }
    }
  }
  for (int64_t c = 0; c < kTileN; ++c) {
    for (int64_t p = c < rows ? whole : 0; p < P; ++p) {
      if (c < rows) {
        std::memcpy(packed + p * kTileN + c, src + c * ld + 4 * p, 4);
      } else {
        packed[p * kTileN + c] = 0;
      }
    }
  }
}

// The tile's weight scales per block and column, wsb[b * 16 + c], and (4-bit) its mins, wmb;
// missing columns are zeros.
template <Kind KD>
void tile_scales(const Weights& w, int64_t n0, int64_t rows, float* wsb, float* wmb) {
  const int64_t B = w.K / kBlock, per_group = w.g / kBlock;
  for (int64_t c = 0; c < kTileN; ++c) {
    for (int64_t b = 0; b < B; ++b) {
      const int64_t i = (n0 + c) * w.G + b / per_group;
      wsb[b * kTileN + c] = c < rows ? scalar(w, w.scale, i) : 0.f;
      if constexpr (KD == Kind::kQ4) wmb[b * kTileN + c] = c < rows ? scalar(w, w.min, i) : 0.f;
    }
  }
}

// 4-bit rows [n0, n0 + rows) as int8 values 0..15, in element order, into out[rows, K].
void unpack_q4_rows(const Weights& w, int64_t n0, int64_t rows, int8_t* out) {
  const int64_t K = w.K;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* src = w.q + (n0 + r) * (K / 2);
    for (int64_t k = 0; k < K; k += kBlock) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * K + k), q4_bytes(src + k / 2));
    }
  }
}

// y[m, c] for MR activation rows against one packed tile (cols <= 16 columns written).
// int8: |w| x (x with w's sign) in a u8 x s8 multiply-add (pairs of at most 2 * 128 * 127), a
// widening multiply-add a quad. 4-bit: the weights are bytes 0..15, taken as they are, and a
// block's 8 quads sum in 16 bits (16 * 15 * 127) before one widening step: half the operations
// a product (the CPU's vector integer pipes are the bound).
template <Kind KD, int MR>
inline void gemm_rows(const int8_t* __restrict xq, const float* __restrict xd,
                      const float* __restrict xs, int64_t K, int64_t B,
                      const int32_t* __restrict packed, const float* __restrict wsb,
                      const float* __restrict wmb, const float* bias, float* __restrict y,
                      int64_t ldy, int64_t cols) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 accf[MR][2];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) accf[m][0] = accf[m][1] = _mm256_setzero_ps();
  auto quad = [&](int m, int64_t p) {
    int32_t q;
    std::memcpy(&q, xq + m * K + 4 * p, 4);
    return _mm256_set1_epi32(q);
  };
  for (int64_t b = 0; b < B; ++b) {
    __m256i acc[MR][2];  // 4-bit: 16-bit sums until the block's end
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int64_t q = 0; q < 8; ++q) {
      const int64_t p = b * 8 + q;
      const __m256i w0 = load32(packed + p * kTileN), w1 = load32(packed + p * kTileN + 8);
      __m256i a0 = w0, a1 = w1;  // int8: |w| (the sign goes to the activations)
      if constexpr (KD == Kind::kInt8) a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const __m256i xv = quad(m, p);
        if constexpr (KD == Kind::kQ4) {
          acc[m][0] = _mm256_add_epi16(acc[m][0], _mm256_maddubs_epi16(w0, xv));
          acc[m][1] = _mm256_add_epi16(acc[m][1], _mm256_maddubs_epi16(w1, xv));
        } else {
          acc[m][0] = _mm256_add_epi32(acc[m][0], _mm256_madd_epi16(
              _mm256_maddubs_epi16(a0, _mm256_sign_epi8(xv, w0)), ones));
          acc[m][1] = _mm256_add_epi32(acc[m][1], _mm256_madd_epi16(
              _mm256_maddubs_epi16(a1, _mm256_sign_epi8(xv, w1)), ones));
        }
      }
    }
    if constexpr (KD == Kind::kQ4) {
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        acc[m][0] = _mm256_madd_epi16(acc[m][0], ones);
        acc[m][1] = _mm256_madd_epi16(acc[m][1], ones);
      }
    }
    const __m256 s0 = _mm256_loadu_ps(wsb + b * kTileN), s1 = _mm256_loadu_ps(wsb + b * kTileN + 8);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m256 d = _mm256_broadcast_ss(xd + m * B + b);
      accf[m][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][0]), _mm256_mul_ps(s0, d), accf[m][0]);
      accf[m][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][1]), _mm256_mul_ps(s1, d), accf[m][1]);
      if (wmb != nullptr) {  // 4-bit: min x the activation block's sum
        const __m256 sum = _mm256_broadcast_ss(xs + m * B + b);
        accf[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(wmb + b * kTileN), sum, accf[m][0]);
        accf[m][1] = _mm256_fmadd_ps(_mm256_loadu_ps(wmb + b * kTileN + 8), sum, accf[m][1]);
      }
    }
  }
  if (cols == kTileN) {  // a whole tile: two vector stores a row
    const __m256 b0 = bias != nullptr ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
    const __m256 b1 = bias != nullptr ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      _mm256_storeu_ps(y + m * ldy, _mm256_add_ps(accf[m][0], b0));
      _mm256_storeu_ps(y + m * ldy + 8, _mm256_add_ps(accf[m][1], b1));
    }
    return;
  }
  for (int m = 0; m < MR; ++m) {
    alignas(32) float out[kTileN];
    _mm256_store_ps(out, accf[m][0]);
    _mm256_store_ps(out + 8, accf[m][1]);
    for (int64_t c = 0; c < cols; ++c) y[m * ldy + c] = out[c] + (bias != nullptr ? bias[c] : 0.f);
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define QL_VNNI 1
// The same sums with AVX512-VNNI, NT tiles side by side: a tile's quad p is one 64-byte vector
// (16 columns x 4 k), one VPDPBUSD takes it against an activation row's quad broadcast: 64
// products an instruction, where the AVX2 form above takes 32 in three. The weight is the
// unsigned operand: 4-bit codes as they are; int8 ones + 128 (the sign bit flipped as loaded),
// the block's sum starting at -128 x the activation block's integer sum (xisum) to cancel it.
// Per block, one conversion and one FMA per row and tile, as above.
template <Kind KD, int MR, int NT>
inline void gemm_rows_vnni(const int8_t* __restrict xq, const float* __restrict xd,
                           const float* __restrict xs, const int32_t* __restrict xisum,
                           int64_t K, int64_t B, const int32_t* const* packed,
                           const float* bias, float* __restrict y, int64_t ldy, int64_t cols) {
  const int64_t scales_at = K / 4 * kTileN;  // a tile's float scales (then 4-bit mins) follow
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 accf[MR][NT];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 2
    for (int h = 0; h < NT; ++h) accf[m][h] = _mm512_setzero_ps();
  }
  for (int64_t b = 0; b < B; ++b) {
    __m512i acc[MR][NT];
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m512i init =
          KD == Kind::kInt8 ? _mm512_set1_epi32(-128 * xisum[m * B + b]) : _mm512_setzero_si512();
#pragma GCC unroll 2
      for (int h = 0; h < NT; ++h) acc[m][h] = init;
    }
#pragma GCC unroll 8
    for (int64_t q = 0; q < 8; ++q) {
      const int64_t p = b * 8 + q;
      __m512i w[NT];
#pragma GCC unroll 2
      for (int h = 0; h < NT; ++h) {
        w[h] = _mm512_loadu_si512(packed[h] + p * kTileN);
        if constexpr (KD == Kind::kInt8) w[h] = _mm512_xor_si512(w[h], flip);
      }
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const __m512i xv = _mm512_broadcastd_epi32(_mm_loadu_si32(xq + m * K + 4 * p));
#pragma GCC unroll 2
        for (int h = 0; h < NT; ++h) acc[m][h] = _mm512_dpbusd_epi32(acc[m][h], w[h], xv);
      }
    }
#pragma GCC unroll 2
    for (int h = 0; h < NT; ++h) {
      const float* wsb = reinterpret_cast<const float*>(packed[h] + scales_at);
      const __m512 s = _mm512_loadu_ps(wsb + b * kTileN);
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const __m512 d = _mm512_set1_ps(xd[m * B + b]);
        accf[m][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][h]), _mm512_mul_ps(s, d),
                                     accf[m][h]);
        if constexpr (KD == Kind::kQ4) {  // min x the activation block's sum
          const __m512 mn = _mm512_loadu_ps(wsb + (B + b) * kTileN);
          accf[m][h] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xs[m * B + b]), accf[m][h]);
        }
      }
    }
  }
#pragma GCC unroll 2
  for (int h = 0; h < NT; ++h) {
    const int64_t c0 = h * kTileN, n = std::min<int64_t>(kTileN, cols - c0);
    if (n <= 0) break;
    const __mmask16 keep = n == kTileN ? 0xFFFF : (__mmask16{1} << n) - 1;
    const __m512 bv = bias != nullptr ? _mm512_maskz_loadu_ps(keep, bias + c0)
                                      : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      _mm512_mask_storeu_ps(y + m * ldy + c0, keep, _mm512_add_ps(accf[m][h], bv));
    }
  }
}

constexpr int64_t kVnniRows = 6;  // activation rows a pass over a tile pair takes

#endif

// int32s one tile takes pre-packed: its quads, then its scales (and 4-bit: mins) per block and
// column, as floats.
template <Kind KD>
constexpr int64_t tile_ints(int64_t K) {
  return K / 4 * kTileN + (KD == Kind::kQ4 ? 2 : 1) * (K / kBlock) * kTileN;
}

// Tile t of the weight as the GEMM reads it, into out[tile_ints]: what a call makes per tile
// when the weight was not pre-packed (quant_linear_pack).
template <Kind KD>
void make_tile(const Weights& w, int64_t N, int64_t t, int8_t* unpacked, int32_t* out) {
  const int64_t K = w.K, B = K / kBlock, n0 = t * kTileN, cols = std::min(kTileN, N - n0);
  if constexpr (KD == Kind::kQ4) {
    unpack_q4_rows(w, n0, cols, unpacked);
    pack_tile(unpacked, K, K, cols, out);
  } else {
    pack_tile(reinterpret_cast<const int8_t*>(w.q) + n0 * K, K, K, cols, out);
  }
  float* wsb = reinterpret_cast<float*>(out + K / 4 * kTileN);
  tile_scales<KD>(w, n0, cols, wsb, KD == Kind::kQ4 ? wsb + B * kTileN : nullptr);
}

// `tiles`: the weight pre-packed ([tiles, tile_ints] int32), or null (each call packs).
template <Kind KD>
void run_int_gemm(const float* x, const Weights& w, const float* bias, float* y, int64_t M,
                  int64_t N, const int32_t* tiles) {
  const int64_t K = w.K, B = K / kBlock, num_tiles = (N + kTileN - 1) / kTileN;
  for (int64_t m0 = 0; m0 < M; m0 += kChunkM) {
    const int64_t mc = std::min(kChunkM, M - m0);
    const QuantX xq = quantize_x(x + m0 * K, mc, K);
#ifdef QL_VNNI
    // Rows in even groups of at most kVnniRows, each reading a pair of tiles.
    const int64_t groups = (mc + kVnniRows - 1) / kVnniRows, per = (mc + groups - 1) / groups;
    at::parallel_for(0, (num_tiles + 1) / 2, 1, [&](int64_t t0, int64_t t1) {
      std::vector<int32_t> buf(tiles != nullptr ? 0 : 2 * tile_ints<KD>(K));
      std::vector<int8_t> unpacked(KD == Kind::kQ4 && tiles == nullptr ? kTileN * K : 0);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t n0 = 2 * t * kTileN, cols = std::min(2 * kTileN, N - n0);
        const int nt = cols > kTileN ? 2 : 1;
        const int32_t* packed[2] = {nullptr, nullptr};
        for (int h = 0; h < nt; ++h) {
          packed[h] = tiles + (2 * t + h) * tile_ints<KD>(K);
          if (tiles == nullptr) {
            make_tile<KD>(w, N, 2 * t + h, unpacked.data(), buf.data() + h * tile_ints<KD>(K));
            packed[h] = buf.data() + h * tile_ints<KD>(K);
          }
        }
        const float* bt = bias != nullptr ? bias + n0 : nullptr;
        for (int64_t m = 0; m < mc; m += per) {
          auto rows = [&](auto mr, auto ntc) {
            gemm_rows_vnni<KD, decltype(mr)::value, decltype(ntc)::value>(
                xq.q.data() + m * K, xq.scale.data() + m * B, xq.sum.data() + m * B,
                xq.isum.data() + m * B, K, B, packed, bt,
                y + (m0 + m) * N + n0, N, cols);
          };
          auto tiles_of = [&](auto mr) {
            if (nt == 2) {
              rows(mr, std::integral_constant<int, 2>{});
            } else {
              rows(mr, std::integral_constant<int, 1>{});
            }
          };
          switch (std::min(per, mc - m)) {
            case 1: tiles_of(std::integral_constant<int, 1>{}); break;
            case 2: tiles_of(std::integral_constant<int, 2>{}); break;
            case 3: tiles_of(std::integral_constant<int, 3>{}); break;
            case 4: tiles_of(std::integral_constant<int, 4>{}); break;
            case 5: tiles_of(std::integral_constant<int, 5>{}); break;
            default: tiles_of(std::integral_constant<int, kVnniRows>{});
          }
        }
      }
    });
#else
    at::parallel_for(0, num_tiles, 1, [&](int64_t t0, int64_t t1) {
      std::vector<int32_t> buf(tiles != nullptr ? 0 : tile_ints<KD>(K));
      std::vector<int8_t> unpacked(KD == Kind::kQ4 && tiles == nullptr ? kTileN * K : 0);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t n0 = t * kTileN, cols = std::min(kTileN, N - n0);
        const int32_t* packed = tiles + t * tile_ints<KD>(K);
        if (tiles == nullptr) {
          make_tile<KD>(w, N, t, unpacked.data(), buf.data());
          packed = buf.data();
        }
        const float* wsb = reinterpret_cast<const float*>(packed + K / 4 * kTileN);
        const float* bt = bias != nullptr ? bias + n0 : nullptr;
        int64_t m = 0;
        auto rows = [&](auto mr) {
          constexpr int MR = decltype(mr)::value;
          gemm_rows<KD, MR>(xq.q.data() + m * K, xq.scale.data() + m * B,
                            xq.sum.data() + m * B, K, B, packed, wsb,
                            KD == Kind::kQ4 ? wsb + B * kTileN : nullptr, bt,
                            y + (m0 + m) * N + n0, N, cols);
          m += MR;
        };
        // Rows at a time, as measured fastest (4-bit: 5 rows 119 GMAC/s a core, 4 rows 82, 2
        // rows 92; int8: 4-8 rows within 5 %).
        if constexpr (KD == Kind::kQ4) {
          while (m + 5 <= mc) rows(std::integral_constant<int, 5>{});
          while (m + 2 <= mc) rows(std::integral_constant<int, 2>{});
        } else {
          while (m + 4 <= mc) rows(std::integral_constant<int, 4>{});
        }
        while (m < mc) rows(std::integral_constant<int, 1>{});
      }
    });
#endif
  }
}
#else
template <Kind KD>
constexpr int64_t tile_ints(int64_t) {
  return 0;  // nothing is pre-packed: the small-M kernel takes every M
}

template <Kind KD>
void make_tile(const Weights&, int64_t, int64_t, int8_t*, int32_t*) {}

template <Kind KD>
void run_int_gemm(const float* x, const Weights& w, const float* bias, float* y, int64_t M,
                  int64_t N, const int32_t*) {
  run_int_small_m<KD>(x, w, bias, y, M, N);
}
#endif

// One weight row, dequantized into out[K].
template <Kind KD>
void dequant_row(const Weights& w, int64_t n, float* out) {
  const int64_t rb = row_bytes<KD>(w.K);
  for (int64_t gi = 0; gi < w.G; ++gi) {
    const Vec s = vset1(scalar(w, w.scale, n * w.G + gi));
    const Vec mn = vset1(KD == Kind::kQ4 ? scalar(w, w.min, n * w.G + gi) : 0.f);
    for (int64_t k = gi * w.g; k < (gi + 1) * w.g; k += kStep<KD>) {
      Vec wv[kNV<KD>];
      decode<KD>(w.q + n * rb + row_bytes<KD>(k), wv);
      for (int v = 0; v < kNV<KD>; ++v) vstore(out + k + v * kV, vfma(wv[v], s, mn));
    }
  }
}

template <Kind KD>
void run_dequant(const at::Tensor& x, const Weights& w, const float* bias, float* y, int64_t M,
                 int64_t N) {
  const int64_t K = w.K;
  // Rows per tile: ~384 KiB of float32 weight (this CPU's L2 is 512 KiB), a multiple of 8. At
  // 64 rows the default model's linears took 194 ms with 128 KiB tiles, 168 ms with these,
  // against 162 ms for float32 through oneDNN (interleaved in one process).
  const int64_t tile = std::max<int64_t>(8, ((int64_t{96} << 10) / K) / 8 * 8);
  const int64_t tiles = (N + tile - 1) / tile;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> buf(tile * K);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * tile, rows = std::min(tile, N - n0);
      for (int64_t r = 0; r < rows; ++r) dequant_row<KD>(w, n0 + r, buf.data() + r * K);
      const at::Tensor wt = at::from_blob(buf.data(), {rows, K}, x.options());
      const at::Tensor part = at::mm(x, wt.t());  // [M, rows], one thread (nested region)
      const float* pp = part.data_ptr<float>();
      for (int64_t m = 0; m < M; ++m) {
        float* yr = y + m * N + n0;
        const float* src = pp + m * rows;
        for (int64_t r = 0; r < rows; ++r) yr[r] = src[r] + (bias != nullptr ? bias[n0 + r] : 0.f);
      }
    }
  });
}

Kind kind_of(const at::Tensor& q) {
  switch (q.scalar_type()) {
    case at::kChar: return Kind::kInt8;
    case at::ScalarType::Float8_e4m3fn: return Kind::kFp8;
    case at::kByte: return Kind::kQ4;
    default: TORCH_CHECK(false, "quant_linear: no quantized layout stores weights as ",
                         q.scalar_type());
  }
  return Kind::kInt8;
}

struct Prepared {
  at::Tensor x, y, bias, scale, min;
  Weights w;
  Kind kind;
  int64_t M, N;
};

Prepared prepare(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                 const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias) {
  Prepared p;
  TORCH_CHECK(x.device().is_cpu() && qweight.device().is_cpu(), "quant_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1, "quant_linear: x must be float32");
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous(),
              "quant_linear: qweight must be contiguous [N, bytes]");
  p.kind = kind_of(qweight);
  const int64_t K = x.size(-1), N = qweight.size(0);
  // int8 and 4-bit meet x in blocks of 32; an int8 group is 16 or a multiple of 32 elements.
  const int step = p.kind == Kind::kFp8 ? 16 : 32;
  TORCH_CHECK(qweight.size(1) == (p.kind == Kind::kQ4 ? K / 2 : K) && K % step == 0,
              "quant_linear: x has ", K, " features, qweight is ", qweight.sizes());
  // float16 scales stay float16 (the kernels read them as such); anything else is float32.
  const bool half = scales.scalar_type() == at::kHalf;
  p.scale = scales.contiguous().to(half ? at::kHalf : at::kFloat);
  const int64_t groups = p.scale.dim() == 2 ? p.scale.size(1) : 0;
  const int64_t g = groups > 0 && K % groups == 0 ? K / groups : 0;
  TORCH_CHECK(p.scale.size(0) == N && g > 0 &&
                  (g % step == 0 || (p.kind == Kind::kInt8 && g == 16)),
              "quant_linear: scales ", scales.sizes(), " do not split ", K, " features into ",
              "groups of a multiple of ", step);
  if (p.kind == Kind::kQ4) {
    TORCH_CHECK(mins.has_value() && mins->defined() && mins->sizes() == scales.sizes(),
                "quant_linear: 4-bit weights need mins shaped like their scales");
    p.min = mins->contiguous().to(p.scale.scalar_type());
  }
  if (bias.has_value() && bias->defined()) {
    p.bias = bias->contiguous();
    TORCH_CHECK(p.bias.scalar_type() == at::kFloat && p.bias.numel() == N,
                "quant_linear: bias must be float32 [N]");
  }
  p.x = x.contiguous();
  std::vector<int64_t> out_sizes(x.sizes().begin(), x.sizes().end());
  out_sizes.back() = N;
  p.y = at::empty(out_sizes, x.options());
  p.M = K == 0 ? 0 : p.x.numel() / K;
  p.N = N;
  p.w = Weights{reinterpret_cast<const uint8_t*>(qweight.data_ptr()), p.scale.data_ptr(),
                p.min.defined() ? p.min.data_ptr() : nullptr, half, K, p.scale.size(1),
                K / p.scale.size(1)};
  return p;
}

at::Tensor quant_linear_small_m(const at::Tensor& x, const at::Tensor& qweight,
                                const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                                const std::optional<at::Tensor>& bias) {
  Prepared p = prepare(x, qweight, scales, mins, bias);
  if (p.M == 0 || p.N == 0) return p.y;
  const float* xp = p.x.data_ptr<float>();
  const float* bp = p.bias.defined() ? p.bias.data_ptr<float>() : nullptr;
  float* yp = p.y.data_ptr<float>();
  switch (p.kind) {
    case Kind::kInt8: run_int_small_m<Kind::kInt8>(xp, p.w, bp, yp, p.M, p.N); break;
    case Kind::kFp8: run_fp8_small_m(xp, p.w, bp, yp, p.M, p.N); break;
    case Kind::kQ4: run_int_small_m<Kind::kQ4>(xp, p.w, bp, yp, p.M, p.N); break;
  }
  return p.y;
}

// [tiles, ints] int32: what quant_linear_pack makes for this weight (ints 0: nothing to make).
std::vector<int64_t> packed_shape(Kind kind, int64_t N, int64_t K) {
  const int64_t ints = kind == Kind::kQ4 ? tile_ints<Kind::kQ4>(K) : tile_ints<Kind::kInt8>(K);
  return {ints == 0 ? 0 : (N + kTileN - 1) / kTileN, ints};
}

at::Tensor quant_linear_int_gemm(const at::Tensor& x, const at::Tensor& qweight,
                                 const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                                 const std::optional<at::Tensor>& bias,
                                 const std::optional<at::Tensor>& tiles) {
  Prepared p = prepare(x, qweight, scales, mins, bias);
  TORCH_CHECK(p.kind != Kind::kFp8 && p.w.g % kBlock == 0,
              "quant_linear_int_gemm: int8 or 4-bit weights in groups of a multiple of 32 only");
  const int32_t* tp = nullptr;
  if (tiles.has_value() && tiles->defined() && tiles->numel() > 0) {
    TORCH_CHECK(tiles->scalar_type() == at::kInt && tiles->is_contiguous() &&
                    tiles->sizes() == at::IntArrayRef(packed_shape(p.kind, p.N, p.w.K)),
                "quant_linear_int_gemm: tiles are not quant_linear_pack's for this weight");
    tp = tiles->data_ptr<int32_t>();
  }
  if (p.M == 0 || p.N == 0) return p.y;
  const float* xp = p.x.data_ptr<float>();
  const float* bp = p.bias.defined() ? p.bias.data_ptr<float>() : nullptr;
  if (p.kind == Kind::kQ4) {
    run_int_gemm<Kind::kQ4>(xp, p.w, bp, p.y.data_ptr<float>(), p.M, p.N, tp);
  } else {
    run_int_gemm<Kind::kInt8>(xp, p.w, bp, p.y.data_ptr<float>(), p.M, p.N, tp);
  }
  return p.y;
}

constexpr int64_t kSmallM = 4;  // workers/layers/linear.py SMALL_M: decode batches

// M rows through the kernel that takes them fastest: the small-M kernel up to kSmallM (reading
// the weight's own bytes), the integer GEMM above; with AVX512-VNNI and an int8 weight's tiles
// kept, the GEMM from kTilesMinRows (1B Q8_0 linears, 3 / 4 rows: 48 / 58 ms on the small-M
// kernel, 41 / 42 on the tiles; at 2 rows 39 / 40).
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const std::optional<at::Tensor>& mins,
                        const std::optional<at::Tensor>& bias,
                        const std::optional<at::Tensor>& tiles) {
  const int64_t K = x.dim() > 0 ? x.size(-1) : 0, M = K > 0 ? x.numel() / K : 0;
  bool gemm = M > kSmallM;
#ifdef QL_VNNI
  constexpr int64_t kTilesMinRows = 3;
  gemm = gemm || (M >= kTilesMinRows && tiles.has_value() && tiles->numel() > 0 &&
                  qweight.scalar_type() == at::kChar);
#endif
  return gemm ? quant_linear_int_gemm(x, qweight, scales, mins, bias, tiles)
              : quant_linear_small_m(x, qweight, scales, mins, bias);
}

// The weight as the integer GEMM reads it, made once (each call makes it per tile otherwise:
// ~5 % of a 64-row decode step); empty where the GEMM has no packed form (no AVX2).
at::Tensor quant_linear_pack(const at::Tensor& qweight, const at::Tensor& scales,
                             const std::optional<at::Tensor>& mins) {
  Prepared p = prepare(at::empty({0, qweight.size(1) * (kind_of(qweight) == Kind::kQ4 ? 2 : 1)},
                                 qweight.options().dtype(at::kFloat)),
                       qweight, scales, mins, std::nullopt);
  TORCH_CHECK(p.kind != Kind::kFp8 && p.w.g % kBlock == 0,
              "quant_linear_pack: int8 or 4-bit weights in groups of a multiple of 32 only");
  const auto shape = packed_shape(p.kind, p.N, p.w.K);
  at::Tensor out = at::empty(shape, qweight.options().dtype(at::kInt));
  if (out.numel() == 0) return out;
  int32_t* op = out.data_ptr<int32_t>();
  at::parallel_for(0, shape[0], 1, [&](int64_t t0, int64_t t1) {
    std::vector<int8_t> unpacked(kTileN * p.w.K);
    for (int64_t t = t0; t < t1; ++t) {
      if (p.kind == Kind::kQ4) {
        make_tile<Kind::kQ4>(p.w, p.N, t, unpacked.data(), op + t * shape[1]);
      } else {
        make_tile<Kind::kInt8>(p.w, p.N, t, unpacked.data(), op + t * shape[1]);
      }
    }
  });
  return out;
}

at::Tensor quant_linear_dequant(const at::Tensor& x, const at::Tensor& qweight,
                                const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                                const std::optional<at::Tensor>& bias) {
  Prepared p = prepare(x, qweight, scales, mins, bias);
  if (p.M == 0 || p.N == 0) return p.y;
  const at::Tensor x2 = p.x.view({p.M, p.w.K});
  const float* bp = p.bias.defined() ? p.bias.data_ptr<float>() : nullptr;
  float* yp = p.y.data_ptr<float>();
  switch (p.kind) {
    case Kind::kInt8: run_dequant<Kind::kInt8>(x2, p.w, bp, yp, p.M, p.N); break;
    case Kind::kFp8: run_dequant<Kind::kFp8>(x2, p.w, bp, yp, p.M, p.N); break;
    case Kind::kQ4: run_dequant<Kind::kQ4>(x2, p.w, bp, yp, p.M, p.N); break;
  }
  return p.y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepinfer_cpu, m) {
  m.def("quant_linear_small_m(Tensor x, Tensor qweight, Tensor scales, Tensor? mins=None, "
        "Tensor? bias=None) -> Tensor");
  m.def("quant_linear_dequant(Tensor x, Tensor qweight, Tensor scales, Tensor? mins=None, "
        "Tensor? bias=None) -> Tensor");
  m.def("quant_linear_int_gemm(Tensor x, Tensor qweight, Tensor scales, Tensor? mins=None, "
        "Tensor? bias=None, Tensor? tiles=None) -> Tensor");
  m.def("quant_linear_pack(Tensor qweight, Tensor scales, Tensor? mins=None) -> Tensor");
  m.def("quant_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins=None, "
        "Tensor? bias=None, Tensor? tiles=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepinfer_cpu, CPU, m) {
  m.impl("quant_linear_small_m", &quant_linear_small_m);
  m.impl("quant_linear_dequant", &quant_linear_dequant);
  m.impl("quant_linear_int_gemm", &quant_linear_int_gemm);
  m.impl("quant_linear_pack", &quant_linear_pack);
  m.impl("quant_linear", &quant_linear);
}
