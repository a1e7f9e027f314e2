// Linear layers on bfloat16 weights with float32 activations (CPU), for decode batches:
// y[M, N] = bf16(x)[M, K] @ w[N, K]^T (+ bias), w kept in bfloat16 as the checkpoint stores it
// (half of float32's bytes: a batch-1 decode step reads every weight once, so half the time).
//
// The activations are rounded to bfloat16 (nearest even) once, so that 32 products are one
// AVX512-BF16 dot-product instruction (vdpbf16ps: pairs of bf16 products summed into float32
// lanes) against the weight's bytes as loaded; the products of two bf16 values are exact in
// float32, only the order of the sums differs from a float32 GEMM on the same rounded inputs
// (what oneDNN's bf16 GEMM computes for larger M: workers/quantization/matmul.py). Without
// AVX512-BF16 the same rounded products are summed one at a time (correct, slow).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define BF16_DOT 1
#endif

namespace {

constexpr int64_t kGroupM = 8;     // activation rows one pass over a weight row takes
constexpr int64_t kPfAhead = 4096;  // weight bytes prefetched ahead (as quant_linear.cpp)

inline uint16_t to_bf16(float f) {  // round to nearest even (finite inputs), as torch does
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7F800000u) == 0x7F800000u) return static_cast<uint16_t>(u >> 16);  // inf / nan
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// The activations rounded to bf16 once a call.
std::vector<uint16_t> rounded(const float* x, int64_t n) {
  std::vector<uint16_t> xb(n);
  for (int64_t i = 0; i < n; ++i) xb[i] = to_bf16(x[i]);
  return xb;
}

inline float from_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

#ifdef BF16_DOT
// Rows [n0, n1) against activation rows [m0, m0 + MG) of xb (bf16, [M, K], K a multiple of 32).
template <int MG>
void rows_dot(const uint16_t* xb, const uint16_t* w, int64_t K, const float* bias, float* y,
              int64_t N, int64_t m0, int64_t n0, int64_t n1) {
  constexpr int A = MG == 1 ? 4 : 2;  // independent sums per row: one chain waits on latency
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* row = w + n * K;
    __m512 acc[MG][A];
#pragma GCC unroll 16
    for (int m = 0; m < MG; ++m) {
#pragma GCC unroll 4
      for (int a = 0; a < A; ++a) acc[m][a] = _mm512_setzero_ps();
    }
    // A chunks of 32 a pass, each into its own sums (a compile-time index: the sums stay in
    // registers), then the chunks left over.
    auto chunk = [&](int64_t k, int a) {
      _mm_prefetch(reinterpret_cast<const char*>(row + k) + kPfAhead, _MM_HINT_T0);
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(row + k);
#pragma GCC unroll 16
      for (int m = 0; m < MG; ++m) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + (m0 + m) * K + k);
        acc[m][a] = _mm512_dpbf16_ps(acc[m][a], wv, xv);
      }
    };
    int64_t k = 0;
    for (; k + 32 * A <= K; k += 32 * A) {
#pragma GCC unroll 4
      for (int a = 0; a < A; ++a) chunk(k + 32 * a, a);
    }
    for (; k < K; k += 32) chunk(k, 0);
#pragma GCC unroll 16
    for (int m = 0; m < MG; ++m) {
      __m512 t = acc[m][0];
#pragma GCC unroll 4
      for (int a = 1; a < A; ++a) t = _mm512_add_ps(t, acc[m][a]);
      y[(m0 + m) * N + n] = _mm512_reduce_add_ps(t) + (bias != nullptr ? bias[n] : 0.f);
    }
  }
}

// 4 to 8 activation rows: weight rows in pairs, so that each activation load feeds two
// dot-product instructions (one a row). Loading the activations once per weight row made 8 rows
// load-bound: 8 rows took 1.6x the time of 1, ~125 GFLOPS.
template <int MG>
void rows_dot_pairs(const uint16_t* xb, const uint16_t* w, int64_t K, const float* bias,
                    float* y, int64_t N, int64_t m0, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) {
    const uint16_t* r0 = w + n * K;
    const uint16_t* r1 = r0 + K;
    __m512 acc[MG][2];
#pragma GCC unroll 16
    for (int m = 0; m < MG; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(r0 + k) + kPfAhead, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(r1 + k) + kPfAhead, _MM_HINT_T0);
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(r0 + k);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(r1 + k);
#pragma GCC unroll 16
      for (int m = 0; m < MG; ++m) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + (m0 + m) * K + k);
        acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, xv);
        acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, xv);
      }
    }
#pragma GCC unroll 16
    for (int m = 0; m < MG; ++m) {
      y[(m0 + m) * N + n] = _mm512_reduce_add_ps(acc[m][0]) + (bias != nullptr ? bias[n] : 0.f);
      y[(m0 + m) * N + n + 1] =
          _mm512_reduce_add_ps(acc[m][1]) + (bias != nullptr ? bias[n + 1] : 0.f);
    }
  }
  if (n < n1) rows_dot<MG>(xb, w, K, bias, y, N, m0, n, n1);
}
#endif

#ifdef BF16_DOT
// ---- The strips copy: the weight repacked once (at load) for decode batches of 4 rows up ----
// [N / 16][K / 2][16][2]: per strip of 16 output rows, each pair of elements of the 16 rows in
// one 64-byte line, so one vdpbf16ps is 16 outputs x 2 products for an activation row (its two
// bf16 broadcast). The row-major kernel above loads a 64-byte chunk of activations per row per
// weight row pair (8 rows: L2-bound at ~125 GFLOPS); here 4 bytes a row feed two strips.
constexpr int64_t kStrip = 16;
constexpr int64_t kStripsAhead = 8192;  // bytes of a strip pair prefetched ahead of the one read
constexpr int kStripRows = 8;           // activation rows a pass over a strip pair takes

// Activation rows [m0, m0 + MR) of xb against strips 2 t, 2 t + 1: y[m, 32 t ...).
template <int MR>
void strip_rows(const uint16_t* xb, const uint16_t* pair, int64_t K, const float* bias, float* y,
                int64_t N, int64_t m0, int64_t n0) {
  const uint16_t* s[2] = {pair, pair + K * kStrip};
  __m512 acc[MR][2];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    if (k % 32 == 0) {  // a line ahead per 64 bytes read, in each strip
      _mm_prefetch(reinterpret_cast<const char*>(s[0] + k * kStrip) + kStripsAhead, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(s[1] + k * kStrip) + kStripsAhead, _MM_HINT_T0);
    }
    const __m512bh w0 = (__m512bh)_mm512_load_si512(s[0] + k * kStrip);
    const __m512bh w1 = (__m512bh)_mm512_load_si512(s[1] + k * kStrip);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512bh xv =
          (__m512bh)_mm512_broadcastd_epi32(_mm_loadu_si32(xb + (m0 + r) * K + k));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xv);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xv);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    for (int h = 0; h < 2; ++h) {
      __m512 v = acc[r][h];
      if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n0 + 16 * h));
      _mm512_storeu_ps(y + (m0 + r) * N + n0 + 16 * h, v);
    }
  }
}
#endif

void rows_scalar(const uint16_t* xb, const uint16_t* w, int64_t K, const float* bias, float* y,
                 int64_t N, int64_t m0, int64_t mg, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t m = m0; m < m0 + mg; ++m) {
      float total = 0.f;
      for (int64_t k = 0; k < K; ++k) total += from_bf16(xb[m * K + k]) * from_bf16(w[n * K + k]);
      y[m * N + n] = total + (bias != nullptr ? bias[n] : 0.f);
    }
  }
}

// One call's checked inputs: x as float32 rows, the output y [..., N], the bias (or null), and
// x rounded to bf16 (empty when there is nothing to compute).
struct Call {
  at::Tensor y, b;
  const float* bias = nullptr;
  std::vector<uint16_t> xb;
  int64_t M = 0;
};

Call prepare(const char* name, const at::Tensor& x, int64_t N,
             const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, name,
              ": x must be a float32 CPU tensor");
  Call c;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N, name,
                ": bias must be float32 [N]");
    c.b = bias->contiguous();
    c.bias = c.b.data_ptr<float>();
  }
  const at::Tensor xc = x.contiguous();
  auto shape = x.sizes().vec();
  shape.back() = N;
  c.y = at::empty(shape, x.options());
  const int64_t K = x.size(-1);
  c.M = K == 0 ? 0 : xc.numel() / K;
  if (c.M > 0 && N > 0) c.xb = rounded(xc.data_ptr<float>(), c.M * K);
  return c;
}

at::Tensor bf16_linear_small_m(const at::Tensor& x, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kBFloat16 &&
                  weight.dim() == 2 && weight.is_contiguous(),
              "bf16_linear: weight must be a contiguous bfloat16 [N, K] CPU tensor");
  const int64_t K = x.size(-1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "bf16_linear: x has ", K, " columns, the weight ",
              weight.size(1));
  Call c = prepare("bf16_linear", x, N, bias);
  const int64_t M = c.M;
  at::Tensor y = c.y;
  if (c.xb.empty()) return y;
  const std::vector<uint16_t>& xb = c.xb;
  const float* bp = c.bias;
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t r0 = n0; r0 < n1; r0 += 16) {  // 16 weight rows stay in cache for all groups
      const int64_t r1 = std::min(n1, r0 + 16);
      for (int64_t m0 = 0; m0 < M; m0 += kGroupM) {
        const int64_t mg = std::min(kGroupM, M - m0);
#ifdef BF16_DOT
        if (K % 32 == 0) {
          switch (mg) {
            case 1: rows_dot<1>(xb.data(), wp, K, bp, yp, N, m0, r0, r1); break;
            case 2: rows_dot<2>(xb.data(), wp, K, bp, yp, N, m0, r0, r1); break;
            case 3: rows_dot<3>(xb.data(), wp, K, bp, yp, N, m0, r0, r1); break;
            case 4: rows_dot_pairs<4>(xb.data(), wp, K, bp, yp, N, m0, r0, r1); break;
            case 5: rows_dot_pairs<5>(xb.data(), wp, K, bp, yp, N, m0, r0, r1); break;
            case 6: rows_dot_pairs<6>(xb.data(), wp, K, bp, yp, N, m0, r0, r1); break;
            case 7: rows_dot_pairs<7>(xb.data(), wp, K, bp, yp, N, m0, r0, r1); break;
            default: rows_dot_pairs<8>(xb.data(), wp, K, bp, yp, N, m0, r0, r1); break;
          }
          continue;
        }
#endif
        rows_scalar(xb.data(), wp, K, bp, yp, N, m0, mg, r0, r1);
      }
    }
  });
  return y;
}

// The strips copy of a bf16 [N, K] weight (N a multiple of 32, K even): same shape and dtype,
// each strip of 16 rows as [K / 2][16][2] (bf16_strips_linear reads it).
at::Tensor bf16_pack_strips(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kBFloat16 &&
                  weight.dim() == 2 && weight.size(0) % 32 == 0 && weight.size(1) % 2 == 0,
              "bf16_pack_strips: the weight must be bfloat16 [N, K], N a multiple of 32, K even");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), P = w.size(1) / 2;  // pairs a row
  at::Tensor out = at::empty(w.sizes(), w.options());
  const auto* src = reinterpret_cast<const uint32_t*>(w.data_ptr<at::BFloat16>());
  auto* dst = reinterpret_cast<uint32_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, N / 16, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      for (int64_t c = 0; c < 16; ++c) {
        const uint32_t* row = src + (p * 16 + c) * P;
        for (int64_t k2 = 0; k2 < P; ++k2) dst[(p * P + k2) * 16 + c] = row[k2];
      }
    }
  });
  return out;
}

// y = bf16(x) strips^T (+ bias), any row count (rows in even groups of up to 8): the products
// bf16_linear_small_m forms, summed in another order.
at::Tensor bf16_strips_linear(const at::Tensor& x, const at::Tensor& strips,
                              const std::optional<at::Tensor>& bias) {
  const int64_t K = x.size(-1), N = strips.size(0);
  TORCH_CHECK(strips.scalar_type() == at::kBFloat16 && strips.dim() == 2 &&
                  strips.is_contiguous() && strips.size(1) == K && N % 32 == 0 && K % 2 == 0,
              "bf16_strips_linear: the strips do not hold ", K, "-element rows");
  Call c = prepare("bf16_strips_linear", x, N, bias);
  if (c.xb.empty()) return c.y;
#ifdef BF16_DOT
  const int64_t M = c.M;
  const std::vector<uint16_t>& xb = c.xb;
  const auto* sp = reinterpret_cast<const uint16_t*>(strips.data_ptr<at::BFloat16>());
  const float* bp = c.bias;
  float* yp = c.y.data_ptr<float>();
  const int64_t groups = (M + kStripRows - 1) / kStripRows, per = (M + groups - 1) / groups;
  at::parallel_for(0, N / 32, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint16_t* pair = sp + 2 * t * K * kStrip;
      for (int64_t m0 = 0; m0 < M; m0 += per) {
        switch (std::min(per, M - m0)) {
          case 1: strip_rows<1>(xb.data(), pair, K, bp, yp, N, m0, 32 * t); break;
          case 2: strip_rows<2>(xb.data(), pair, K, bp, yp, N, m0, 32 * t); break;
          case 3: strip_rows<3>(xb.data(), pair, K, bp, yp, N, m0, 32 * t); break;
          case 4: strip_rows<4>(xb.data(), pair, K, bp, yp, N, m0, 32 * t); break;
          case 5: strip_rows<5>(xb.data(), pair, K, bp, yp, N, m0, 32 * t); break;
          case 6: strip_rows<6>(xb.data(), pair, K, bp, yp, N, m0, 32 * t); break;
          case 7: strip_rows<7>(xb.data(), pair, K, bp, yp, N, m0, 32 * t); break;
          default: strip_rows<8>(xb.data(), pair, K, bp, yp, N, m0, 32 * t); break;
        }
      }
    }
  });
  return c.y;
#else
  TORCH_CHECK(false, "bf16_strips_linear: built without AVX512-BF16");
#endif
}

// Whether bf16_strips_linear runs here (built with AVX512-BF16).
bool bf16_strips() {
#ifdef BF16_DOT
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepinfer_cpu, m) {
  m.def("bf16_linear_small_m(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("bf16_pack_strips(Tensor weight) -> Tensor");
  m.def("bf16_strips_linear(Tensor x, Tensor strips, Tensor? bias=None) -> Tensor");
  m.def("bf16_strips() -> bool", &bf16_strips);
}

TORCH_LIBRARY_IMPL(deepinfer_cpu, CPU, m) {
  m.impl("bf16_linear_small_m", &bf16_linear_small_m);
  m.impl("bf16_pack_strips", &bf16_pack_strips);
  m.impl("bf16_strips_linear", &bf16_strips_linear);
}
