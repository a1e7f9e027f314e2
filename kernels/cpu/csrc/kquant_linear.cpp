// Linear layers on GGUF K-quant weights kept as the file stores them (CPU):
// y[M, N] = x[M, K] @ dequant(w)[N, K]^T (+ bias); w is uint8 [N, K / 256 * block bytes], each
// row whole super-blocks of 256 elements in one of llama.cpp's layouts (ggml type ids):
//   Q4_K (12), 144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit scales / mins per 32, 128 bytes
//              of nibbles (per 64 elements 32 bytes: low nibbles 0..31, high ones 32..63);
//              w = d * sc * q - dmin * m
//   Q5_K (13), 176 bytes: as Q4_K plus 32 bytes of fifth bits (bit 2j: element 64j + l's, bit
//              2j + 1: element 64j + 32 + l's, byte l)
//   Q6_K (14), 210 bytes: 128 bytes of low nibbles, 64 of high crumbs, 16 int8 scales per 16,
//              fp16 d; w = d * sc * (q - 32)
// Read as they are, a Q4_K_M file's weights stream 4.5 bits an element (4.5 / 6.56 bits Q4_K /
// Q6_K), where widening the super-block scales to a float per group (their d * sc is not
// exact in float16) read 6 / 10.
//
// kquant_linear (decode, M up to 16): activations quantized to int8 per 256 (act_quant.h; one
// scale a super-block, as llama.cpp's Q8_K), so that a super-block's 64-element chunks are one
// u8 x s8 multiply-add instruction each (AVX512-VNNI), scaled by the weight's 6-bit / int8
// scales in integers and converted once a super-block; the weight row is unpacked once for all
// M rows. Without AVX512-VNNI the same sums are formed one element at a time (correct, slow).
// kquant_dequant_linear (prefill chunks, larger batches): tiles of rows dequantized to float32
// (or bf16) and multiplied with a GEMM, as quant_linear_dequant does.
// kquant_dequantize: the float32 rows (embedding lookups).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "act_quant.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KQ_VNNI 1
#endif

namespace {

constexpr int64_t kSuper = 256;  // elements per super-block
constexpr int64_t kGroupM = 4;   // activation rows one pass over a weight row takes
constexpr int64_t kStreamRows = 16;  // more rows go through the integer GEMM (lanes_gemm)
// Weight bytes are prefetched this far ahead of the row being read (as quant_linear.cpp).
constexpr int64_t kPfAhead = 4096;

enum class KType : int64_t { kQ4K = 12, kQ5K = 13, kQ6K = 14 };

int64_t block_bytes(KType t) {
  switch (t) {
    case KType::kQ4K: return 144;
    case KType::kQ5K: return 176;
    case KType::kQ6K: return 210;
  }
  return 0;
}

KType ktype(int64_t id) {
  TORCH_CHECK(id == 12 || id == 13 || id == 14,
              "kquant_linear: ggml type ", id, " is not Q4_K (12), Q5_K (13) or Q6_K (14)");
  return static_cast<KType>(id);
}

inline float fp16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// 12 bytes -> 8 six-bit scales and 8 mins (llama.cpp's get_scale_min_k4, four at a time):
// bytes 0-3 hold scales 0-3 and bytes 4-7 mins 0-3 in their low 6 bits; bytes 8-11 the low 4
// bits of scales / mins 4-7, whose top 2 bits are the top bits of bytes 0-3 / 4-7.
inline void scale_min_k4(const uint8_t* p, uint8_t* sc, uint8_t* mn) {
  uint32_t u[3];
  std::memcpy(u, p, 12);
  const uint32_t s_lo = u[0] & 0x3F3F3F3Fu, m_lo = u[1] & 0x3F3F3F3Fu;
  const uint32_t s_hi = (u[2] & 0x0F0F0F0Fu) | ((u[0] >> 2) & 0x30303030u);
  const uint32_t m_hi = ((u[2] >> 4) & 0x0F0F0F0Fu) | ((u[1] >> 2) & 0x30303030u);
  std::memcpy(sc, &s_lo, 4);
  std::memcpy(sc + 4, &s_hi, 4);
  std::memcpy(mn, &m_lo, 4);
  std::memcpy(mn + 4, &m_hi, 4);
}

// One super-block as integers and per-16 factors: w[e] = scale[e / 16] * q[e] - min[e / 16].
// (Q6_K: q - 32 as q, no min; Q4_K / Q5_K: q >= 0, the min per 32 given to both its 16s.)
struct Unpacked {
  int8_t q[kSuper];
  float scale[16];
  float min[16];
};

inline void unpack(KType t, const uint8_t* b, Unpacked* u) {
  if (t == KType::kQ6K) {
    const float d = fp16_at(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int g = 0; g < 16; ++g) {
      u->scale[g] = d * static_cast<float>(sc[g]);
      u->min[g] = 0.f;
    }
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = b + 64 * h;
      const uint8_t* qh = b + 128 + 32 * h;
      int8_t* q = u->q + 128 * h;
      for (int l = 0; l < 32; ++l) {
        q[l] = static_cast<int8_t>(((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32);
        q[l + 32] = static_cast<int8_t>(((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
        q[l + 64] = static_cast<int8_t>(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
        q[l + 96] = static_cast<int8_t>(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
      }
    }
    return;
  }
  const float d = fp16_at(b), dmin = fp16_at(b + 2);
  uint8_t sc[8], mn[8];
  scale_min_k4(b + 4, sc, mn);
  for (int j = 0; j < 8; ++j) {
    u->scale[2 * j] = u->scale[2 * j + 1] = d * static_cast<float>(sc[j]);
    u->min[2 * j] = u->min[2 * j + 1] = dmin * static_cast<float>(mn[j]);
  }
  const bool five = t == KType::kQ5K;
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + (five ? 48 : 16);
  for (int j = 0; j < 4; ++j) {
    for (int l = 0; l < 32; ++l) {
      const uint8_t byte = qs[32 * j + l];
      int lo = byte & 0xF, hi = byte >> 4;
      if (five) {
        lo += ((qh[l] >> (2 * j)) & 1) << 4;
        hi += ((qh[l] >> (2 * j + 1)) & 1) << 4;
      }
      u->q[64 * j + l] = static_cast<int8_t>(lo);
      u->q[64 * j + 32 + l] = static_cast<int8_t>(hi);
    }
  }
}

#ifdef KQ_VNNI
template <KType T>
void dequant_row_vec(const uint8_t* row, int64_t K, float* out);
#endif

void dequant_row(KType t, const uint8_t* row, int64_t K, float* out) {
#ifdef KQ_VNNI
  switch (t) {
    case KType::kQ4K: return dequant_row_vec<KType::kQ4K>(row, K, out);
    case KType::kQ5K: return dequant_row_vec<KType::kQ5K>(row, K, out);
    case KType::kQ6K: return dequant_row_vec<KType::kQ6K>(row, K, out);
  }
#endif
  const int64_t bb = block_bytes(t);
  Unpacked u;
  for (int64_t s = 0; s < K / kSuper; ++s) {
    unpack(t, row + s * bb, &u);
    float* o = out + s * kSuper;
    for (int e = 0; e < kSuper; ++e) {
      o[e] = u.scale[e / 16] * static_cast<float>(u.q[e]) - u.min[e / 16];
    }
  }
}

// Output rows [n0, n1) of y for activation rows [m0, m0 + MG), MG <= kGroupM, one element at a
// time: the sums the vector kernel forms (integer per 16 elements, then scaled).
void rows_scalar(KType t, const QuantX& a, const uint8_t* w, int64_t K, const float* bias,
                 float* y, int64_t N, int64_t m0, int64_t MG, int64_t n0, int64_t n1) {
  const int64_t bb = block_bytes(t), B = K / kBlock;
  Unpacked u;
  std::vector<float> acc(MG);
  for (int64_t n = n0; n < n1; ++n) {
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t s = 0; s < K / kSuper; ++s) {
      unpack(t, w + (n * (K / kSuper) + s) * bb, &u);
      for (int64_t m = 0; m < MG; ++m) {
        const int8_t* xq = a.q.data() + (m0 + m) * K + s * kSuper;
        const float xd = a.scale[(m0 + m) * (K / kSuper) + s];
        const float* xs = a.sum.data() + (m0 + m) * B + s * (kSuper / kBlock);
        float total = 0.f;
        for (int g = 0; g < 16; ++g) {
          int32_t isum = 0;
          for (int e = 16 * g; e < 16 * g + 16; ++e) isum += u.q[e] * xq[e];
          total += u.scale[g] * xd * static_cast<float>(isum);
        }
        if (t != KType::kQ6K) {
          for (int j = 0; j < 8; ++j) total -= u.min[2 * j] * xs[j];
        }
        acc[m] += total;
      }
    }
    for (int64_t m = 0; m < MG; ++m) {
      y[(m0 + m) * N + n] = acc[m] + (bias != nullptr ? bias[n] : 0.f);
    }
  }
}

#ifdef KQ_VNNI
inline __m512i broadcast32(const uint8_t* p) {
  return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// A super-block's weights as 4 vectors of 64 unsigned bytes in element order (Q6_K: q + 32).
template <KType T>
inline void weight_bytes(const uint8_t* b, __m512i* wv) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  if constexpr (T == KType::kQ6K) {
    const __m512i m2 = _mm512_set1_epi8(0x03);
    const __m512i lo_shift = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
    const __m512i hi_shift = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
    for (int h = 0; h < 2; ++h) {
      const __m512i ql = _mm512_loadu_si512(b + 64 * h);
      const __m512i qh = broadcast32(b + 128 + 32 * h);
      const __m512i h0 = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, lo_shift), m2), 4);
      const __m512i h1 = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, hi_shift), m2), 4);
      wv[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, m4), h0);
      wv[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4), h1);
    }
  } else {
    const __m512i nib_shift = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(4), 1);
    const uint8_t* qs = b + (T == KType::kQ5K ? 48 : 16);
    __m512i hbits;
    if constexpr (T == KType::kQ5K) {
      // Chunk j's fifth bits: bit 2j (low half) and 2j + 1 (high half), shifted down 2 a chunk.
      hbits = _mm512_srlv_epi16(broadcast32(b + 16),
                                _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(1), 1));
    }
    for (int j = 0; j < 4; ++j) {
      __m512i v = _mm512_and_si512(_mm512_srlv_epi16(broadcast32(qs + 32 * j), nib_shift), m4);
      if constexpr (T == KType::kQ5K) {  // bit 2j (low half) / 2j + 1 (high half) -> 16
        const __m512i five = _mm512_and_si512(hbits, _mm512_set1_epi8(0x01));
        v = _mm512_or_si512(v, _mm512_slli_epi16(five, 4));
        hbits = _mm512_srli_epi16(hbits, 2);
      }
      wv[j] = v;
    }
  }
}

// One row as float32, 16 elements at a time from the unpacked bytes: w = s * q - m with the
// product rounded before the difference, as gguf's dequantizers round (Q6_K: q + 32 as q and
// m = 32 s, exact).
template <KType T>
void dequant_row_vec(const uint8_t* row, int64_t K, float* out) {
  const int64_t bb = block_bytes(T);
  for (int64_t s = 0; s < K / kSuper; ++s) {
    const uint8_t* b = row + s * bb;
    __m512i wv[4];
    weight_bytes<T>(b, wv);
    float scale[16], min[16];
    if constexpr (T == KType::kQ6K) {
      const float d = fp16_at(b + 208);
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      for (int g = 0; g < 16; ++g) {
        scale[g] = d * static_cast<float>(sc[g]);
        min[g] = 32.f * scale[g];
      }
    } else {
      const float d = fp16_at(b), dmin = fp16_at(b + 2);
      uint8_t sc[8], mn[8];
      scale_min_k4(b + 4, sc, mn);
      for (int j = 0; j < 8; ++j) {
        scale[2 * j] = scale[2 * j + 1] = d * static_cast<float>(sc[j]);
        min[2 * j] = min[2 * j + 1] = dmin * static_cast<float>(mn[j]);
      }
    }
    for (int c = 0; c < 4; ++c) {
      alignas(64) uint8_t bytes[64];
      _mm512_store_si512(bytes, wv[c]);
      for (int i = 0; i < 4; ++i) {
        const int g = 4 * c + i;
        const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
            _mm_load_si128(reinterpret_cast<const __m128i*>(bytes + 16 * i))));
        const __m512 prod = _mm512_mul_round_ps(_mm512_set1_ps(scale[g]), q,
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm512_storeu_ps(out + s * kSuper + 16 * g,
                         _mm512_sub_round_ps(prod, _mm512_set1_ps(min[g]),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      }
    }
  }
}

// Rows [n0, n1) against activation rows [m0, m0 + MG), quantized per 256 (one scale a
// super-block, as llama.cpp's Q8_K): per super-block the weight is unpacked once, then each
// activation row takes, per 64 elements, one u8 x s8 multiply-add (VPDPBUSD: sums of 4 products,
// each within +-2^15) and one int16 multiply-add by the per-32 / per-16 scales (VPDPWSSD: a
// sum's low half times the scale, its sign half times 0), all in integers; the super-block's
// total is converted and scaled once. (Activations per 32 cost a conversion, a lane permute and
// an FMA per 32 elements an activation row: the kernel was compute-bound at ~19 cycles a Q4_K
// super-block, ~3x slower at 8 rows than at 1.)
template <KType T, int MG>
void rows_vnni(const QuantX& a, const int32_t* corr, const uint8_t* w, int64_t K,
               const float* bias, float* y, int64_t N, int64_t m0, int64_t n0, int64_t n1) {
  const int64_t bb = block_bytes(T), S = K / kSuper, B = K / kBlock;
  // Lane i of a 64-element product covers elements 4i..4i+3: per-32 scales (Q4_K, Q5_K) go to
  // lanes 0-7 and 8-15 of chunk j from scales 2j, 2j + 1; per-16 ones (Q6_K) to lanes of 4 from
  // scales 4j..4j + 3.
  __m512i idx[4];
  for (int j = 0; j < 4; ++j) {
    idx[j] = T == KType::kQ6K
                 ? _mm512_setr_epi32(4 * j, 4 * j, 4 * j, 4 * j, 4 * j + 1, 4 * j + 1, 4 * j + 1,
                                     4 * j + 1, 4 * j + 2, 4 * j + 2, 4 * j + 2, 4 * j + 2,
                                     4 * j + 3, 4 * j + 3, 4 * j + 3, 4 * j + 3)
                 : _mm512_setr_epi32(2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j,
                                     2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1,
                                     2 * j + 1, 2 * j + 1, 2 * j + 1);
  }
  const __m512i low16 = _mm512_set1_epi32(0xFFFF);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * S * bb;
    __m512 tot[MG];
    __m256 mins[MG];
#pragma GCC unroll 16
    for (int m = 0; m < MG; ++m) {
      tot[m] = _mm512_setzero_ps();
      mins[m] = _mm256_setzero_ps();
    }
    for (int64_t s = 0; s < S; ++s) {
      const uint8_t* b = row + s * bb;
      for (int64_t off = 0; off < bb; off += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(b + kPfAhead + off), _MM_HINT_T0);
      }
      __m512i wv[4], scv[4];
      weight_bytes<T>(b, wv);
      float d;
      __m256 mnf = _mm256_setzero_ps();
      if constexpr (T == KType::kQ6K) {
        // int8 scales as int16 with a zero high half (a negative one's sign bits would meet the
        // sums' sign halves in VPDPWSSD)
        const __m512i sc = _mm512_and_si512(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192))),
            low16);
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) scv[j] = _mm512_permutexvar_epi32(idx[j], sc);
        d = fp16_at(b + 208);
      } else {
        uint8_t sc[8], mn[8];
        scale_min_k4(b + 4, sc, mn);
        const __m512i sc32 = _mm512_castsi256_si512(
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc))));
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) scv[j] = _mm512_permutexvar_epi32(idx[j], sc32);
        d = fp16_at(b);
        mnf = _mm256_mul_ps(
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                reinterpret_cast<const __m128i*>(mn)))), _mm256_set1_ps(fp16_at(b + 2)));
      }
#pragma GCC unroll 16
      for (int m = 0; m < MG; ++m) {
        const int64_t xm = (m0 + m) * K + s * kSuper;
        __m512i acc = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          // Q6_K: the sums start at -32 x their activations' sum (stored q is q + 32)
          const __m512i init = T == KType::kQ6K ? _mm512_loadu_si512(corr + (xm + 64 * j) / 4)
                                                : _mm512_setzero_si512();
          const __m512i p = _mm512_dpbusd_epi32(init, wv[j],
                                                _mm512_loadu_si512(a.q.data() + xm + 64 * j));
          acc = _mm512_dpwssd_epi32(acc, p, scv[j]);
        }
        const float dx = a.scale[(m0 + m) * S + s];
        tot[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(d * dx), tot[m]);
        if constexpr (T != KType::kQ6K) {
          mins[m] = _mm256_fmadd_ps(mnf, _mm256_loadu_ps(a.sum.data() + (m0 + m) * B + s * 8),
                                    mins[m]);
        }
      }
    }
#pragma GCC unroll 16
    for (int m = 0; m < MG; ++m) {
      __m128 h = _mm_add_ps(_mm256_castps256_ps128(mins[m]), _mm256_extractf128_ps(mins[m], 1));
      h = _mm_add_ps(h, _mm_movehl_ps(h, h));
      h = _mm_add_ss(h, _mm_movehdup_ps(h));
      y[(m0 + m) * N + n] = _mm512_reduce_add_ps(tot[m]) - _mm_cvtss_f32(h) +
                            (bias != nullptr ? bias[n] : 0.f);
    }
  }
}

// The rows of one activation group of mg <= 4 rows, by the kernel instantiated for mg.
template <KType T>
void group_vnni(const QuantX& a, const int32_t* corr, const uint8_t* w, int64_t K,
                const float* bias, float* y, int64_t N, int64_t m0, int64_t mg, int64_t n0,
                int64_t n1) {
  switch (mg) {
    case 1: rows_vnni<T, 1>(a, corr, w, K, bias, y, N, m0, n0, n1); break;
    case 2: rows_vnni<T, 2>(a, corr, w, K, bias, y, N, m0, n0, n1); break;
    case 3: rows_vnni<T, 3>(a, corr, w, K, bias, y, N, m0, n0, n1); break;
    default: rows_vnni<T, 4>(a, corr, w, K, bias, y, N, m0, n0, n1); break;
  }
}
#endif

constexpr int64_t kCols = 32;  // output rows a tile holds (vectors of 16 lanes)

// ---- The lanes layout: K-quant weights repacked once (at load) for kquant_lanes_linear ----
// Per strip of 16 output rows and super-block, one record: the codes as nibbles, 64 bytes per
// two groups of 4 elements (byte 4c + i: element 4(2j) + i of the strip's row c in the low
// nibble, element 4(2j + 1) + i in the high one), so a load, a shift and two ANDs give the
// u8 lanes the integer GEMM multiplies, without fill_tile's transposes; Q5_K's fifth bits (Q6_K's
// fifth and sixth) as 64-bit masks per group of 4 (bit 4c + i); the scales as bytes
// [sub-block][16], the mins as int16 pairs [4][16] (two 32-blocks a multiply-add), d (and dmin)
// as fp16 [16]. About the file's own size (Q4_K 2,496 bytes a record against 16 x 144), read
// once per group of up to 8 activation rows.
template <KType T>
struct Lanes;
template <>
struct Lanes<KType::kQ4K> {
  static constexpr int64_t kPlanes = 0, kScales = 2048, kMins = 2176, kD = 2432, kDmin = 2464,
                           kRecord = 2496;
};
template <>
struct Lanes<KType::kQ5K> {
  static constexpr int64_t kPlanes = 2048, kScales = 2560, kMins = 2688, kD = 2944,
                           kDmin = 2976, kRecord = 3008;
};
template <>
struct Lanes<KType::kQ6K> {
  static constexpr int64_t kPlanes = 2048, kScales = 3072, kMins = 0, kD = 3328, kDmin = 0,
                           kRecord = 3392;  // 3,360 rounded up to 64
};
constexpr int64_t kStrip = 16;

int64_t lanes_record(KType t) {
  switch (t) {
    case KType::kQ4K: return Lanes<KType::kQ4K>::kRecord;
    case KType::kQ5K: return Lanes<KType::kQ5K>::kRecord;
    case KType::kQ6K: return Lanes<KType::kQ6K>::kRecord;
  }
  return 0;
}

#ifdef KQ_VNNI
// The integer GEMM (prefill, larger batches, and with the lanes copy from 4 rows): activations
// int8 per 256 as in the decode kernel; the weight's codes as u8 lanes, each 32-bit lane one
// output row's 4 consecutive codes, so one VPDPBUSD is 16 outputs x 4 products for an
// activation row (its 4 bytes broadcast): 64 products an instruction, where a bf16 GEMM makes
// 32. Per 32 (Q4_K / Q5_K) or 16 (Q6_K) elements the integer sums are scaled by the 6-bit /
// int8 scales in integers; once a super-block the total is converted and scaled by d x the
// activation's scale, and the Q4_K / Q5_K mins meet the activations' integer sums per 32 in one
// int16 multiply-add per two of them. The lanes come from the weight's lanes copy (repacked at
// load, kquant_pack_lanes), or are packed per call, two strips at a time.

constexpr int64_t kLanesAhead = 8192;  // bytes of a strip prefetched ahead of the one read

template <KType T>
constexpr int sub_blocks() { return T == KType::kQ6K ? 16 : 8; }

// One super-block of kCols output rows' codes as u8 lanes: [64 lane groups][kCols][4].
template <KType T>
struct TileBlock {
  alignas(64) uint8_t q[64 * kCols * 4];
};

// r[i] (16 lanes of 32 bits each) -> r[k] = lane k of every r[i]: interleaving 32-bit, then
// 64-bit lanes within 128-bit quarters, then the quarters.
inline void transpose16(__m512i* r) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // b[4i + k]: rows 4i..4i + 3 of lane 4q + k, quarter q
    b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512i even01 = _mm512_shuffle_i32x4(b[k], b[4 + k], 0x88);
    const __m512i odd01 = _mm512_shuffle_i32x4(b[k], b[4 + k], 0xDD);
    const __m512i even23 = _mm512_shuffle_i32x4(b[8 + k], b[12 + k], 0x88);
    const __m512i odd23 = _mm512_shuffle_i32x4(b[8 + k], b[12 + k], 0xDD);
    r[k] = _mm512_shuffle_i32x4(even01, even23, 0x88);
    r[8 + k] = _mm512_shuffle_i32x4(even01, even23, 0xDD);
    r[4 + k] = _mm512_shuffle_i32x4(odd01, odd23, 0x88);
    r[12 + k] = _mm512_shuffle_i32x4(odd01, odd23, 0xDD);
  }
}

// Output rows [n0, n0 + cols) (cols <= kCols; the rest zero) into S tile blocks, 16 rows at a
// time: their unpacked codes transposed in registers, 16 x 16 lanes at once.
template <KType T>
void fill_tile(const uint8_t* w, int64_t S, int64_t n0, int64_t cols, TileBlock<T>* tile) {
  const int64_t bb = block_bytes(T);
  std::memset(static_cast<void*>(tile), 0, sizeof(TileBlock<T>) * S);
  alignas(64) uint32_t codes[16][64];
  for (int64_t c0 = 0; c0 < cols; c0 += 16) {
    const int64_t rows = std::min<int64_t>(16, cols - c0);
    for (int64_t s = 0; s < S; ++s) {
      TileBlock<T>& t = tile[s];
      for (int64_t c = 0; c < 16; ++c) {
        if (c >= rows) {
          std::memset(codes[c], 0, sizeof(codes[c]));
          continue;
        }
        const uint8_t* b = w + ((n0 + c0 + c) * S + s) * bb;
        __m512i wv[4];
        weight_bytes<T>(b, wv);
        for (int j = 0; j < 4; ++j) _mm512_store_si512(codes[c] + 16 * j, wv[j]);
      }
      auto* q32 = reinterpret_cast<uint32_t*>(t.q);
      for (int j = 0; j < 4; ++j) {
        __m512i r[16];
        for (int c = 0; c < 16; ++c) r[c] = _mm512_load_si512(codes[c] + 16 * j);
        transpose16(r);
        for (int g = 0; g < 16; ++g) _mm512_store_si512(q32 + (16 * j + g) * kCols + c0, r[g]);
      }
    }
  }
}

// Q6_K's codes are stored + 32: -32 x the activations' sum per 16 [M][K / 16] starts its sums.
std::vector<int32_t> q6_offsets(const QuantX& a, int64_t M, int64_t K) {
  std::vector<int32_t> sums(M * K / 16);
  for (int64_t i = 0; i < M * K / 16; ++i) {
    int32_t s = 0;
    for (int64_t e = 0; e < 16; ++e) s += a.q[i * 16 + e];
    sums[i] = -32 * s;
  }
  return sums;
}

// Strips [2 t, 2 t + 1] of the weight, from the u8 lanes of fill_tile's tile (its 32
// output rows are the two strips) and the blocks' own scale bytes.
template <KType T>
void pack_pair(const uint8_t* w, int64_t S, int64_t n0, int64_t cols, const TileBlock<T>* tile,
               uint8_t* out) {
  using L = Lanes<T>;
  const int64_t bb = block_bytes(T);
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int h = 0; h < 2; ++h) {
    for (int64_t s = 0; s < S; ++s) {
      uint8_t* rec = out + (h * S + s) * L::kRecord;
      std::memset(rec, 0, L::kRecord);
      const uint8_t* q = tile[s].q;  // [64 groups][32 rows][4]
      for (int j = 0; j < 32; ++j) {
        const __m512i lo = _mm512_load_si512(q + (2 * j) * kCols * 4 + h * 64);
        const __m512i hi = _mm512_load_si512(q + (2 * j + 1) * kCols * 4 + h * 64);
        _mm512_storeu_si512(rec + 64 * j,
                            _mm512_or_si512(_mm512_and_si512(lo, low),
                                            _mm512_slli_epi16(_mm512_and_si512(hi, low), 4)));
      }
      if constexpr (T != KType::kQ4K) {
        for (int g = 0; g < 64; ++g) {
          const __m512i v = _mm512_load_si512(q + g * kCols * 4 + h * 64);
          const uint64_t b4 = _mm512_test_epi8_mask(v, _mm512_set1_epi8(0x10));
          std::memcpy(rec + L::kPlanes + 8 * g, &b4, 8);
          if constexpr (T == KType::kQ6K) {
            const uint64_t b5 = _mm512_test_epi8_mask(v, _mm512_set1_epi8(0x20));
            std::memcpy(rec + L::kPlanes + 512 + 8 * g, &b5, 8);
          }
        }
      }
      for (int c = 0; c < std::min<int64_t>(kStrip, cols - h * kStrip); ++c) {
        const uint8_t* b = w + ((n0 + h * kStrip + c) * S + s) * bb;
        if constexpr (T == KType::kQ6K) {
          for (int j = 0; j < 16; ++j) rec[L::kScales + j * kStrip + c] = b[192 + j];
          std::memcpy(rec + L::kD + 2 * c, b + 208, 2);
        } else {
          uint8_t sc[8], mn[8];
          scale_min_k4(b + 4, sc, mn);
          for (int j = 0; j < 8; ++j) rec[L::kScales + j * kStrip + c] = sc[j];
          for (int j = 0; j < 4; ++j) {  // int16 pairs: blocks 2j (low half), 2j + 1
            rec[L::kMins + (j * kStrip + c) * 4] = mn[2 * j];
            rec[L::kMins + (j * kStrip + c) * 4 + 2] = mn[2 * j + 1];
          }
          std::memcpy(rec + L::kD + 2 * c, b, 2);
          std::memcpy(rec + L::kDmin + 2 * c, b + 2, 2);
        }
      }
    }
  }
}

template <KType T>
void pack_lanes(const uint8_t* w, int64_t N, int64_t K, uint8_t* out) {
  const int64_t S = K / kSuper;
  at::parallel_for(0, N / kCols, 1, [&](int64_t t0, int64_t t1) {
    std::vector<TileBlock<T>> tile(S);
    for (int64_t t = t0; t < t1; ++t) {
      fill_tile<T>(w, S, t * kCols, kCols, tile.data());
      pack_pair<T>(w, S, t * kCols, kCols, tile.data(), out + 2 * t * S * Lanes<T>::kRecord);
    }
  });
}

// One group of 4 elements' codes for a strip, as u8 lanes: the nibbles, plus the fifth (and
// sixth) bits where the type has them.
template <KType T>
inline __m512i lane_codes(__m512i nibbles, const uint8_t* rec, int g) {
  if constexpr (T != KType::kQ4K) {
    __mmask64 b4;
    std::memcpy(&b4, rec + Lanes<T>::kPlanes + 8 * g, 8);
    nibbles = _mm512_mask_add_epi8(nibbles, b4, nibbles, _mm512_set1_epi8(0x10));
    if constexpr (T == KType::kQ6K) {
      __mmask64 b5;
      std::memcpy(&b5, rec + Lanes<T>::kPlanes + 512 + 8 * g, 8);
      nibbles = _mm512_mask_add_epi8(nibbles, b5, nibbles, _mm512_set1_epi8(0x20));
    }
  }
  return nibbles;
}

// 4 bytes at p in every 32-bit lane, loaded as such (not through a general register).
inline __m512i broadcast4(const int8_t* p) {
  return _mm512_broadcastd_epi32(_mm_loadu_si32(p));
}

// The activations' integer sums per 32 as int16 pairs [M][K / 64] (blocks 2j, 2j + 1): what
// the Q4_K / Q5_K mins multiply.
std::vector<int32_t> sum_pairs(const QuantX& a, int64_t M, int64_t K) {
  std::vector<int32_t> pairs(M * K / 64);
  for (int64_t i = 0; i < M * K / 64; ++i) {
    pairs[i] = (a.isum[2 * i] & 0xFFFF) | (a.isum[2 * i + 1] << 16);
  }
  return pairs;
}

// Activation rows [m0, m0 + MR) against NC consecutive strips' records: y[m, n0 .. n0 + 16 NC).
// The codes are unpacked from the records as they are read, once for all MR rows.
template <KType T, int MR, int NC>
void lanes_rows(const QuantX& a, const int32_t* sums, const uint8_t* strip, int64_t S,
                int64_t K, int64_t m0, float* y, int64_t N, int64_t n0, int64_t cols,
                const float* bias) {
  using L = Lanes<T>;
  constexpr int SB = sub_blocks<T>(), G = 64 / SB;
  const __m512i low = _mm512_set1_epi8(0x0F);
  alignas(64) float out[MR][16 * NC] = {};
  const int8_t* xq[MR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) xq[r] = a.q.data() + (m0 + r) * K;
  for (int64_t s = 0; s < S; ++s) {
    const uint8_t* rec[NC];
#pragma GCC unroll 2
    for (int h = 0; h < NC; ++h) {
      rec[h] = strip + (h * S + s) * L::kRecord;
    }
    __m512i tot[MR][NC];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 2
      for (int h = 0; h < NC; ++h) tot[r][h] = _mm512_setzero_si512();
    }
#pragma GCC unroll 1
    for (int sb = 0; sb < SB; ++sb) {
      __m512i part[MR][NC];
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m512i init = T == KType::kQ6K
                                 ? _mm512_set1_epi32(sums[((m0 + r) * S + s) * 16 + sb])
                                 : _mm512_setzero_si512();
#pragma GCC unroll 2
        for (int h = 0; h < NC; ++h) part[r][h] = init;
      }
#pragma GCC unroll 8
      for (int jj = 0; jj < G / 2; ++jj) {
        const int j = sb * (G / 2) + jj;  // groups 2j, 2j + 1
        __m512i wlo[NC], whi[NC];
#pragma GCC unroll 2
        for (int h = 0; h < NC; ++h) {
          // a record's lines fetched ahead one or two at a time, as they are read
          _mm_prefetch(reinterpret_cast<const char*>(rec[h] + kLanesAhead + 64 * j), _MM_HINT_T0);
          if (64 * (j + 32) < L::kRecord) {
            _mm_prefetch(reinterpret_cast<const char*>(rec[h] + kLanesAhead + 64 * (j + 32)),
                         _MM_HINT_T0);
          }
          const __m512i v = _mm512_load_si512(rec[h] + 64 * j);
          wlo[h] = lane_codes<T>(_mm512_and_si512(v, low), rec[h], 2 * j);
          whi[h] = lane_codes<T>(_mm512_and_si512(_mm512_srli_epi16(v, 4), low), rec[h],
                                 2 * j + 1);
        }
        const int64_t k0 = s * kSuper + 8 * j;
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          const __m512i xa = broadcast4(xq[r] + k0), xb = broadcast4(xq[r] + k0 + 4);
#pragma GCC unroll 2
          for (int h = 0; h < NC; ++h) {
            part[r][h] = _mm512_dpbusd_epi32(part[r][h], wlo[h], xa);
            part[r][h] = _mm512_dpbusd_epi32(part[r][h], whi[h], xb);
          }
        }
      }
#pragma GCC unroll 2
      for (int h = 0; h < NC; ++h) {
        const __m128i sc8 =
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec[h] + L::kScales + sb * kStrip));
        const __m512i sc =
            T == KType::kQ6K ? _mm512_cvtepi8_epi32(sc8) : _mm512_cvtepu8_epi32(sc8);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          tot[r][h] = _mm512_add_epi32(tot[r][h], _mm512_mullo_epi32(part[r][h], sc));
        }
      }
    }
#pragma GCC unroll 2
    for (int h = 0; h < NC; ++h) {
      const __m512 d =
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec[h] + L::kD)));
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m512 dx = _mm512_set1_ps(a.scale[(m0 + r) * S + s]);
        _mm512_store_ps(out[r] + 16 * h,
                        _mm512_fmadd_ps(_mm512_cvtepi32_ps(tot[r][h]), _mm512_mul_ps(d, dx),
                                        _mm512_load_ps(out[r] + 16 * h)));
      }
      if constexpr (T != KType::kQ6K) {  // - dmin x sum over 32-blocks of m x the block's sum
        const __m512 dmin = _mm512_cvtph_ps(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec[h] + L::kDmin)));
        __m512i mins[MR];
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) mins[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          const __m512i m = _mm512_load_si512(rec[h] + L::kMins + 64 * j);
#pragma GCC unroll 8
          for (int r = 0; r < MR; ++r) {
            mins[r] = _mm512_dpwssd_epi32(mins[r], m,
                                          _mm512_set1_epi32(sums[((m0 + r) * S + s) * 4 + j]));
          }
        }
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          const __m512 dx = _mm512_set1_ps(a.scale[(m0 + r) * S + s]);
          _mm512_store_ps(out[r] + 16 * h,
                          _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins[r]), _mm512_mul_ps(dmin, dx),
                                           _mm512_load_ps(out[r] + 16 * h)));
        }
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int64_t c0 = 0; c0 < std::min<int64_t>(cols, 16 * NC); c0 += 16) {
      const __mmask16 keep = cols - c0 >= 16 ? 0xFFFF : (__mmask16{1} << (cols - c0)) - 1;
      __m512 v = _mm512_load_ps(out[r] + c0);
      if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(keep, bias + n0 + c0));
      _mm512_mask_storeu_ps(y + (m0 + r) * N + n0 + c0, keep, v);
    }
  }
}

constexpr int kLaneRows = 8;  // activation rows a pass over a strip takes

// y for all M rows from the lanes copy, or (lanes == nullptr) from the blocks w, packed two
// strips at a time into a buffer per thread (N then need not be a multiple of 32).
template <KType T>
void lanes_gemm(const QuantX& a, const uint8_t* lanes, const uint8_t* w, int64_t M, int64_t N,
                int64_t K, const float* bias, float* y) {
  const int64_t S = K / kSuper, R = Lanes<T>::kRecord;
  const std::vector<int32_t> sums = T == KType::kQ6K ? q6_offsets(a, M, K) : sum_pairs(a, M, K);
  // Rows in even groups of at most kLaneRows (12 rows: 6 + 6), each reading the strip pair.
  const int64_t groups = (M + kLaneRows - 1) / kLaneRows, per = (M + groups - 1) / groups;
  at::parallel_for(0, (N + kCols - 1) / kCols, 1, [&](int64_t t0, int64_t t1) {
    std::vector<TileBlock<T>> tile(lanes == nullptr ? S : 0);
    std::vector<uint8_t> packed(lanes == nullptr ? 2 * S * R + 64 : 0);
    uint8_t* own = packed.data() + (-reinterpret_cast<uintptr_t>(packed.data()) & 63);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kCols, cols = std::min(kCols, N - n0);
      const uint8_t* pair = lanes + 2 * t * S * R;
      if (lanes == nullptr) {
        fill_tile<T>(w, S, n0, cols, tile.data());
        pack_pair<T>(w, S, n0, cols, tile.data(), own);
        pair = own;
      }
      for (int64_t m0 = 0; m0 < M; m0 += per) {
        switch (std::min(per, M - m0)) {
#define KQ_LANES(R) \
  case R: lanes_rows<T, R, 2>(a, sums.data(), pair, S, K, m0, y, N, n0, cols, bias); break;
          KQ_LANES(1) KQ_LANES(2) KQ_LANES(3) KQ_LANES(4) KQ_LANES(5) KQ_LANES(6) KQ_LANES(7)
          default: lanes_rows<T, 8, 2>(a, sums.data(), pair, S, K, m0, y, N, n0, cols, bias);
#undef KQ_LANES
        }
      }
    }
  });
}
#endif

struct Prepared {
  at::Tensor x, y, bias;
  const uint8_t* w = nullptr;
  KType t = KType::kQ4K;
  int64_t M = 0, N = 0, K = 0;
};

// The checks and output every op here shares: x float32 [..., K] on the CPU, the bias float32
// [N] if given, y [..., N] (M rows of K; w and t are the caller's).
Prepared prepare_call(const char* name, const at::Tensor& x, int64_t N,
                      const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, name,
              ": x must be a float32 CPU tensor");
  Prepared p;
  p.x = x.contiguous();
  p.K = x.size(-1);
  p.N = N;
  p.M = p.K == 0 ? 0 : p.x.numel() / p.K;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N, name,
                ": bias must be float32 [N]");
    p.bias = bias->contiguous();
  }
  auto shape = x.sizes().vec();
  shape.back() = N;
  p.y = at::empty(shape, x.options());
  return p;
}

Prepared prepare(const at::Tensor& x, const at::Tensor& blocks, int64_t type,
                 const std::optional<at::Tensor>& bias) {
  const KType t = ktype(type);
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte &&
                  blocks.dim() == 2 && blocks.is_contiguous(),
              "kquant_linear: blocks must be a contiguous uint8 [N, bytes] CPU tensor");
  const int64_t K = x.size(-1);
  TORCH_CHECK(K % kSuper == 0 && blocks.size(1) == K / kSuper * block_bytes(t),
              "kquant_linear: ", blocks.size(1), " bytes a row do not hold ", K,
              " elements in super-blocks of 256");
  Prepared p = prepare_call("kquant_linear", x, blocks.size(0), bias);
  p.t = t;
  p.w = blocks.data_ptr<uint8_t>();
  return p;
}

at::Tensor kquant_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t type,
                         const std::optional<at::Tensor>& bias) {
  Prepared p = prepare(x, blocks, type, bias);
  if (p.M == 0 || p.N == 0) return p.y;
  const QuantX a = quantize_x(p.x.data_ptr<float>(), p.M, p.K, kSuper);
  const float* bp = p.bias.defined() ? p.bias.data_ptr<float>() : nullptr;
  float* yp = p.y.data_ptr<float>();
#ifdef KQ_VNNI
  if (p.M > kStreamRows) {
    switch (p.t) {
      case KType::kQ4K: lanes_gemm<KType::kQ4K>(a, nullptr, p.w, p.M, p.N, p.K, bp, yp); break;
      case KType::kQ5K: lanes_gemm<KType::kQ5K>(a, nullptr, p.w, p.M, p.N, p.K, bp, yp); break;
      case KType::kQ6K: lanes_gemm<KType::kQ6K>(a, nullptr, p.w, p.M, p.N, p.K, bp, yp); break;
    }
    return p.y;
  }
#endif
  std::vector<int32_t> corr;  // Q6_K: -32 x each 4 activations' sum (q - 32 as q + 32 - 32)
  if (p.t == KType::kQ6K) {
    corr.resize(p.M * p.K / 4);
    for (int64_t i = 0; i < p.M * p.K / 4; ++i) {
      const int8_t* q = a.q.data() + 4 * i;
      corr[i] = -32 * (q[0] + q[1] + q[2] + q[3]);
    }
  }
  // Threads take slices of output rows; within a slice, groups of 4 activation rows take 16
  // rows of weight at a time (the later groups find those rows in cache).
  constexpr int64_t kRowsAtOnce = 16;
  at::parallel_for(0, p.N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t r0 = n0; r0 < n1; r0 += kRowsAtOnce) {
      const int64_t r1 = std::min(n1, r0 + kRowsAtOnce);
      for (int64_t m0 = 0; m0 < p.M; m0 += kGroupM) {
        const int64_t mg = std::min(kGroupM, p.M - m0);
#ifdef KQ_VNNI
        switch (p.t) {
          case KType::kQ4K: group_vnni<KType::kQ4K>(a, nullptr, p.w, p.K, bp, yp, p.N, m0, mg, r0, r1); break;
          case KType::kQ5K: group_vnni<KType::kQ5K>(a, nullptr, p.w, p.K, bp, yp, p.N, m0, mg, r0, r1); break;
          case KType::kQ6K: group_vnni<KType::kQ6K>(a, corr.data(), p.w, p.K, bp, yp, p.N, m0, mg, r0, r1); break;
        }
#else
        rows_scalar(p.t, a, p.w, p.K, bp, yp, p.N, m0, mg, r0, r1);
#endif
      }
    }
  });
  return p.y;
}

// float32 -> bf16, rounded to nearest even (as torch's conversion), n a multiple of 32.
void to_bf16(const float* in, int64_t n, uint16_t* out) {
#if defined(__AVX512BF16__)
  for (int64_t i = 0; i < n; i += 32) {
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(in + i + 16), _mm512_loadu_ps(in + i));
    _mm512_storeu_si512(out + i, (__m512i)v);
  }
#else
  for (int64_t i = 0; i < n; ++i) out[i] = c10::BFloat16(in[i]).x;
#endif
}

at::Tensor kquant_dequant_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t type,
                                 const std::optional<at::Tensor>& bias, bool bf16) {
  Prepared p = prepare(x, blocks, type, bias);
  if (p.M == 0 || p.N == 0) return p.y;
  const int64_t K = p.K, N = p.N, M = p.M, row_bytes = K / kSuper * block_bytes(p.t);
  if (bf16) {
    // Slabs of rows dequantized to bf16 (rows in parallel) into one buffer kept between calls,
    // each multiplied by one bf16 GEMM over every thread (oneDNN; AVX512-BF16: twice float32's
    // products an instruction) on the activations rounded to bf16, the output rounded to bf16
    // too (torch's CPU mm has no bf16 -> float32 form). A slab of ~8 MiB is still in L3 when the
    // GEMM reads it: 390 GFLOPS at 256 rows against 415 for the bf16 GEMM alone, where the whole
    // weight at once (a fresh allocation each call: page faults, a trip through memory) gave
    // 268. Per-tile GEMMs, one thread each, reached ~80: oneDNN reorders each small tile.
    const int64_t slab = std::min(N, std::max<int64_t>(64, ((int64_t{4} << 20) / K) / 16 * 16));
    thread_local at::Tensor buffer;
    if (!buffer.defined() || buffer.numel() < slab * K) {
      buffer = at::empty({slab * K}, p.x.options().dtype(at::kBFloat16));
    }
    auto* wp = reinterpret_cast<uint16_t*>(buffer.data_ptr<at::BFloat16>());
    const at::Tensor xb = p.x.view({M, K}).to(at::kBFloat16);
    at::Tensor y2 = p.y.view({M, N});
    for (int64_t n0 = 0; n0 < N; n0 += slab) {
      const int64_t rows = std::min(slab, N - n0);
      at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
        std::vector<float> row(K);
        for (int64_t r = r0; r < r1; ++r) {
          dequant_row(p.t, p.w + (n0 + r) * row_bytes, K, row.data());
          to_bf16(row.data(), K, wp + r * K);
        }
      });
      const at::Tensor slab_w = buffer.narrow(0, 0, rows * K).view({rows, K});
      y2.narrow(1, n0, rows).copy_(at::mm(xb, slab_w.t()));
    }
    if (p.bias.defined()) p.y.add_(p.bias);
    return p.y;
  }
  const at::Tensor x2 = p.x.view({M, K});
  const float* bias_p = p.bias.defined() ? p.bias.data_ptr<float>() : nullptr;
  float* y = p.y.data_ptr<float>();
  // ~384 KiB of float32 weight a tile (quant_linear.cpp's run_dequant measured it).
  const int64_t tile = std::max<int64_t>(8, ((int64_t{96} << 10) / K) / 8 * 8);
  const int64_t tiles = (N + tile - 1) / tile;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> buf(tile * K);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * tile, rows = std::min(tile, N - n0);
      for (int64_t r = 0; r < rows; ++r) {
        dequant_row(p.t, p.w + (n0 + r) * row_bytes, K, buf.data() + r * K);
      }
      const at::Tensor wt = at::from_blob(buf.data(), {rows, K}, p.x.options());
      const at::Tensor part = at::mm(x2, wt.t());  // [M, rows], one thread (nested region)
      const float* pp = part.data_ptr<float>();
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t r = 0; r < rows; ++r) {
          y[m * N + n0 + r] = pp[m * rows + r] + (bias_p != nullptr ? bias_p[n0 + r] : 0.f);
        }
      }
    }
  });
  return p.y;
}

// Whether kquant_linear takes any row count through the integer GEMM (built with AVX512-VNNI).
bool kquant_int8_gemm() {
#ifdef KQ_VNNI
  return true;
#else
  return false;
#endif
}

at::Tensor kquant_dequantize(const at::Tensor& blocks, int64_t type, int64_t K) {
  const KType t = ktype(type);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && K % kSuper == 0 &&
                  blocks.size(1) == K / kSuper * block_bytes(t),
              "kquant_dequantize: blocks are not rows of ", K, " elements");
  const at::Tensor b = blocks.contiguous();
  at::Tensor out = at::empty({b.size(0), K}, b.options().dtype(at::kFloat));
  const uint8_t* bp = b.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t rb = b.size(1);
  at::parallel_for(0, b.size(0), 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) dequant_row(t, bp + r * rb, K, op + r * K);
  });
  return out;
}

// The lanes layout of [N, K] K-quant blocks (N a multiple of 32): uint8 [N, K / 256 * record
// / 16], strips of 16 rows (kquant_lanes_linear reads it; needs AVX512-VNNI).
at::Tensor kquant_pack_lanes(const at::Tensor& blocks, int64_t type, int64_t K) {
  const KType t = ktype(type);
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2 &&
                  K % kSuper == 0 && blocks.size(1) == K / kSuper * block_bytes(t),
              "kquant_pack_lanes: blocks are not rows of ", K, " elements");
  const int64_t N = blocks.size(0);
  TORCH_CHECK(N % kCols == 0, "kquant_pack_lanes: ", N, " rows are not a multiple of ", kCols);
  at::Tensor out = at::empty({N, K / kSuper * lanes_record(t) / kStrip}, blocks.options());
#ifdef KQ_VNNI
  const at::Tensor b = blocks.contiguous();
  const uint8_t* w = b.data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  switch (t) {
    case KType::kQ4K: pack_lanes<KType::kQ4K>(w, N, K, o); break;
    case KType::kQ5K: pack_lanes<KType::kQ5K>(w, N, K, o); break;
    case KType::kQ6K: pack_lanes<KType::kQ6K>(w, N, K, o); break;
  }
  return out;
#else
  TORCH_CHECK(false, "kquant_pack_lanes: built without AVX512-VNNI");
#endif
}

// y = x dequant(w)^T (+ bias) from the lanes layout, any row count: activations int8 per 256
// as kquant_linear's.
at::Tensor kquant_lanes_linear(const at::Tensor& x, const at::Tensor& lanes, int64_t type,
                               const std::optional<at::Tensor>& bias) {
  const KType t = ktype(type);
  const int64_t K = x.size(-1), N = lanes.size(0);
  TORCH_CHECK(lanes.scalar_type() == at::kByte && lanes.dim() == 2 && lanes.is_contiguous() &&
                  K % kSuper == 0 && N % kCols == 0 &&
                  lanes.size(1) == K / kSuper * lanes_record(t) / kStrip,
              "kquant_lanes_linear: the lanes do not hold ", K, "-element rows");
  Prepared p = prepare_call("kquant_lanes_linear", x, N, bias);
  if (p.M == 0 || N == 0) return p.y;
#ifdef KQ_VNNI
  const QuantX a = quantize_x(p.x.data_ptr<float>(), p.M, K, kSuper);
  const float* bp = p.bias.defined() ? p.bias.data_ptr<float>() : nullptr;
  const uint8_t* lp = lanes.data_ptr<uint8_t>();
  float* yp = p.y.data_ptr<float>();
  switch (t) {
    case KType::kQ4K: lanes_gemm<KType::kQ4K>(a, lp, nullptr, p.M, N, K, bp, yp); break;
    case KType::kQ5K: lanes_gemm<KType::kQ5K>(a, lp, nullptr, p.M, N, K, bp, yp); break;
    case KType::kQ6K: lanes_gemm<KType::kQ6K>(a, lp, nullptr, p.M, N, K, bp, yp); break;
  }
  return p.y;
#else
  TORCH_CHECK(false, "kquant_lanes_linear: built without AVX512-VNNI");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepinfer_cpu, m) {
  m.def("kquant_linear(Tensor x, Tensor blocks, int type, Tensor? bias=None) -> Tensor");
  m.def("kquant_dequant_linear(Tensor x, Tensor blocks, int type, Tensor? bias=None, "
        "bool bf16=False) -> Tensor");
  m.def("kquant_dequantize(Tensor blocks, int type, int K) -> Tensor");
  m.def("kquant_int8_gemm() -> bool", &kquant_int8_gemm);
  m.def("kquant_pack_lanes(Tensor blocks, int type, int K) -> Tensor");
  m.def("kquant_lanes_linear(Tensor x, Tensor lanes, int type, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepinfer_cpu, CPU, m) {
  m.impl("kquant_linear", &kquant_linear);
  m.impl("kquant_dequant_linear", &kquant_dequant_linear);
  m.impl("kquant_dequantize", &kquant_dequantize);
  m.impl("kquant_pack_lanes", &kquant_pack_lanes);
  m.impl("kquant_lanes_linear", &kquant_lanes_linear);
}
