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
constexpr int64_t kStreamRows = 16;  // more rows go through tiles (kquant_int8_gemm)
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
#pragma GCC unroll 8
        for (int j = 0; j < 4; ++j) scv[j] = _mm512_permutexvar_epi32(idx[j], sc);
        d = fp16_at(b + 208);
      } else {
        uint8_t sc[8], mn[8];
        scale_min_k4(b + 4, sc, mn);
        const __m512i sc32 = _mm512_castsi256_si512(
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc))));
#pragma GCC unroll 8
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
#pragma GCC unroll 8
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

#ifdef KQ_VNNI
// kquant_int8_gemm (prefill, larger batches): activations int8 per 256 as in the decode kernel,
// weights unpacked once per call into u8 tiles of kCols output rows in which each 32-bit lane is
// one output row's 4 consecutive elements, so one VPDPBUSD is 16 outputs x 4 products for an
// activation row (its 4 bytes broadcast): 64 products an instruction, where a bf16 GEMM makes 32.
// Per 32 (Q4_K / Q5_K) or 16 (Q6_K) elements the integer sums are scaled by the 6-bit / int8
// scales in integers; once a super-block the total is converted and scaled by d x the
// activation's scale; the Q4_K / Q5_K mins meet the activations' integer sums per 32 in one
// int16 multiply-add per two of them.
constexpr int64_t kCols = 32;  // output rows a tile holds (vectors of 16 lanes)
constexpr int kGemmRows = 6;   // activation rows one pass over a tile takes

template <KType T>
constexpr int sub_blocks() { return T == KType::kQ6K ? 16 : 8; }

// One tile's super-block: the codes [64 lane groups][kCols][4], int32 scales [sub][kCols], the
// d [kCols].
template <KType T>
struct TileBlock {
  alignas(64) uint8_t q[64 * kCols * 4];
  alignas(64) int32_t scale[sub_blocks<T>() * kCols];
  alignas(64) float d[kCols];
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
        const int64_t col = c0 + c;
        if constexpr (T == KType::kQ6K) {
          for (int j = 0; j < 16; ++j) t.scale[j * kCols + col] = static_cast<int8_t>(b[192 + j]);
          t.d[col] = fp16_at(b + 208);
        } else {
          uint8_t sc[8], mn[8];
          scale_min_k4(b + 4, sc, mn);
          for (int j = 0; j < 8; ++j) t.scale[j * kCols + col] = sc[j];
          t.d[col] = fp16_at(b);
        }
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

// The Q4_K / Q5_K mins' share, minus the sum over 32-blocks of dmin * m times the activations'
// sum (QuantX::sum), as one float GEMM over K / 32 (a 32nd of the products) written into y,
// which the tiles then add to.
void write_mins(const QuantX& a, KType t, const uint8_t* w, int64_t M, int64_t N, int64_t K,
                float* y) {
  const int64_t S = K / kSuper, bb = block_bytes(t);
  at::Tensor mins = at::empty({N, K / kBlock}, at::TensorOptions().dtype(at::kFloat));
  float* mp = mins.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t s = 0; s < S; ++s) {
        const uint8_t* b = w + (n * S + s) * bb;
        uint8_t sc[8], mn[8];
        scale_min_k4(b + 4, sc, mn);
        const float dmin = -fp16_at(b + 2);
        for (int j = 0; j < 8; ++j) mp[(n * S + s) * 8 + j] = dmin * static_cast<float>(mn[j]);
      }
    }
  });
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  const at::Tensor sums = at::from_blob(const_cast<float*>(a.sum.data()), {M, K / kBlock}, f32);
  at::Tensor out = at::from_blob(y, {M, N}, f32);
  at::mm_out(out, sums, mins.t());
}

// Activation rows [m0, m0 + MR) against one tile: y[m, n0 + c] for c < cols (Q4_K / Q5_K:
// added to the mins' share there). Per sub-block the integer sums (part) are scaled into the
// super-block's (tot); the float totals wait in memory (once a super-block), which keeps part
// and tot in registers.
template <KType T, int MR>
void tile_rows(const QuantX& a, const int32_t* sums, const TileBlock<T>* tile, int64_t S,
               int64_t K, int64_t m0, float* y, int64_t N, int64_t n0, int64_t cols,
               const float* bias) {
  constexpr int SB = sub_blocks<T>(), G = 64 / SB;  // lane groups a sub-block
  constexpr int NC = kCols / 16;                    // vectors of output rows
  alignas(64) float out[MR][kCols] = {};
  const int8_t* xq[MR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) xq[r] = a.q.data() + (m0 + r) * K;
  for (int64_t s = 0; s < S; ++s) {
    const TileBlock<T>& t = tile[s];
    __m512i tot[MR][NC];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) tot[r][c] = _mm512_setzero_si512();
    }
#pragma GCC unroll 1
    for (int sb = 0; sb < SB; ++sb) {
      const int32_t* q32 = reinterpret_cast<const int32_t*>(t.q) + sb * G * kCols;
      __m512i part[MR][NC];
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m512i init = T == KType::kQ6K
                                 ? _mm512_set1_epi32(sums[((m0 + r) * S + s) * 16 + sb])
                                 : _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int c = 0; c < NC; ++c) part[r][c] = init;
      }
      const int64_t k0 = s * kSuper + sb * G * 4;
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) {
        __m512i wv[NC];
#pragma GCC unroll 8
        for (int c = 0; c < NC; ++c) wv[c] = _mm512_load_si512(q32 + g * kCols + 16 * c);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          int32_t x4;
          std::memcpy(&x4, xq[r] + k0 + 4 * g, 4);
          const __m512i xv = _mm512_set1_epi32(x4);
#pragma GCC unroll 8
          for (int c = 0; c < NC; ++c) part[r][c] = _mm512_dpbusd_epi32(part[r][c], wv[c], xv);
        }
      }
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) {
        const __m512i sc = _mm512_load_si512(t.scale + sb * kCols + 16 * c);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          tot[r][c] = _mm512_add_epi32(tot[r][c], _mm512_mullo_epi32(part[r][c], sc));
        }
      }
    }
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) {
      const __m512 d = _mm512_load_ps(t.d + 16 * c);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m512 dx = _mm512_set1_ps(a.scale[(m0 + r) * S + s]);
        _mm512_store_ps(out[r] + 16 * c,
                        _mm512_fmadd_ps(_mm512_cvtepi32_ps(tot[r][c]), _mm512_mul_ps(d, dx),
                                        _mm512_load_ps(out[r] + 16 * c)));
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int64_t c0 = 0; c0 < cols; c0 += 16) {
      const __mmask16 keep = cols - c0 >= 16 ? 0xFFFF : (__mmask16{1} << (cols - c0)) - 1;
      float* yp = y + (m0 + r) * N + n0 + c0;
      __m512 v = _mm512_load_ps(out[r] + c0);
      if constexpr (T != KType::kQ6K) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(keep, yp));
      if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(keep, bias + n0 + c0));
      _mm512_mask_storeu_ps(yp, keep, v);
    }
  }
}

template <KType T>
void int8_gemm(const QuantX& a, const uint8_t* w, int64_t M, int64_t N, int64_t K,
               const float* bias, float* y) {
  const int64_t S = K / kSuper, tiles = (N + kCols - 1) / kCols;
  const std::vector<int32_t> sums = T == KType::kQ6K ? q6_offsets(a, M, K) : std::vector<int32_t>();
  if constexpr (T != KType::kQ6K) write_mins(a, T, w, M, N, K, y);  // the tiles add to it
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    thread_local std::vector<TileBlock<T>> tile;
    if (static_cast<int64_t>(tile.size()) < S) tile.resize(S);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kCols, cols = std::min(kCols, N - n0);
      fill_tile<T>(w, S, n0, cols, tile.data());
      int64_t m0 = 0;
      for (; m0 + kGemmRows <= M; m0 += kGemmRows) {
        tile_rows<T, kGemmRows>(a, sums.data(), tile.data(), S, K, m0, y, N, n0, cols, bias);
      }
      switch (M - m0) {
        case 1: tile_rows<T, 1>(a, sums.data(), tile.data(), S, K, m0, y, N, n0, cols, bias); break;
        case 2: tile_rows<T, 2>(a, sums.data(), tile.data(), S, K, m0, y, N, n0, cols, bias); break;
        case 3: tile_rows<T, 3>(a, sums.data(), tile.data(), S, K, m0, y, N, n0, cols, bias); break;
        case 4: tile_rows<T, 4>(a, sums.data(), tile.data(), S, K, m0, y, N, n0, cols, bias); break;
        case 5: tile_rows<T, 5>(a, sums.data(), tile.data(), S, K, m0, y, N, n0, cols, bias); break;
        default: break;
      }
    }
  });
}
#endif

struct Prepared {
  at::Tensor x, y, bias;
  const uint8_t* w;
  KType t;
  int64_t M, N, K;
};

Prepared prepare(const at::Tensor& x, const at::Tensor& blocks, int64_t type,
                 const std::optional<at::Tensor>& bias) {
  const KType t = ktype(type);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat,
              "kquant_linear: x must be a float32 CPU tensor");
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte &&
                  blocks.dim() == 2 && blocks.is_contiguous(),
              "kquant_linear: blocks must be a contiguous uint8 [N, bytes] CPU tensor");
  const int64_t K = x.size(-1), N = blocks.size(0);
  TORCH_CHECK(K % kSuper == 0 && blocks.size(1) == K / kSuper * block_bytes(t),
              "kquant_linear: ", blocks.size(1), " bytes a row do not hold ", K,
              " elements in super-blocks of 256");
  Prepared p;
  p.x = x.contiguous();
  p.t = t;
  p.K = K;
  p.N = N;
  p.M = K == 0 ? 0 : p.x.numel() / K;
  p.w = blocks.data_ptr<uint8_t>();
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N,
                "kquant_linear: bias must be float32 [N]");
    p.bias = bias->contiguous();
  }
  auto shape = x.sizes().vec();
  shape.back() = N;
  p.y = at::empty(shape, x.options());
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
      case KType::kQ4K: int8_gemm<KType::kQ4K>(a, p.w, p.M, p.N, p.K, bp, yp); break;
      case KType::kQ5K: int8_gemm<KType::kQ5K>(a, p.w, p.M, p.N, p.K, bp, yp); break;
      case KType::kQ6K: int8_gemm<KType::kQ6K>(a, p.w, p.M, p.N, p.K, bp, yp); break;
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

// Whether kquant_linear takes any row count through int8 tiles (built with AVX512-VNNI).
bool kquant_int8_tiles() {
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepinfer_cpu, m) {
  m.def("kquant_linear(Tensor x, Tensor blocks, int type, Tensor? bias=None) -> Tensor");
  m.def("kquant_dequant_linear(Tensor x, Tensor blocks, int type, Tensor? bias=None, "
        "bool bf16=False) -> Tensor");
  m.def("kquant_dequantize(Tensor blocks, int type, int K) -> Tensor");
  m.def("kquant_int8_tiles() -> bool", &kquant_int8_tiles);
}

TORCH_LIBRARY_IMPL(deepinfer_cpu, CPU, m) {
  m.impl("kquant_linear", &kquant_linear);
  m.impl("kquant_dequant_linear", &kquant_dequant_linear);
  m.impl("kquant_dequantize", &kquant_dequantize);
}
