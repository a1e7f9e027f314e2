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

at::Tensor bf16_linear_small_m(const at::Tensor& x, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat,
              "bf16_linear: x must be a float32 CPU tensor");
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kBFloat16 &&
                  weight.dim() == 2 && weight.is_contiguous(),
              "bf16_linear: weight must be a contiguous bfloat16 [N, K] CPU tensor");
  const int64_t K = x.size(-1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "bf16_linear: x has ", K, " columns, the weight ",
              weight.size(1));
  const float* bp = nullptr;
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N,
                "bf16_linear: bias must be float32 [N]");
    b = bias->contiguous();
    bp = b.data_ptr<float>();
  }
  const at::Tensor xc = x.contiguous();
  auto shape = x.sizes().vec();
  shape.back() = N;
  at::Tensor y = at::empty(shape, x.options());
  const int64_t M = K == 0 ? 0 : xc.numel() / K;
  if (M == 0 || N == 0) return y;
  std::vector<uint16_t> xb(M * K);
  const float* xp = xc.data_ptr<float>();
  for (int64_t i = 0; i < M * K; ++i) xb[i] = to_bf16(xp[i]);
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepinfer_cpu, m) {
  m.def("bf16_linear_small_m(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepinfer_cpu, CPU, m) {
  m.impl("bf16_linear_small_m", &bf16_linear_small_m);
}
