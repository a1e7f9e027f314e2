// Fused float32 element-wise ops for a decoder layer on CPU.
//
// In eager torch each of these is several ops (a Python dispatch and a full pass over memory
// each): a decode step at batch 1 spent as long in them as in its weights. One pass each here:
// - add_rms_norm: residual += x (when given), then RMSNorm of the sum, in one row pass.
// - rope_store_kv: rotary embedding ("rotate half", HF layout) applied in place to q and k,
//   and this step's k, v written to their paged-cache slots (slot -1: not written), as the
//   cache's type (float32, or float16 / bfloat16 under --kv-cache-dtype: kv_types.h).
// - silu_and_mul: silu(gate) * up for [gate | up] rows.
// Rows are split over threads (at::parallel_for) once there are enough of them.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <optional>

#include "kv_types.h"
#include "vec_math.h"

namespace {

using deepinfer::exp_nonpos;

void check_float_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name,
              " must be a float32 CPU tensor");
}

// Rows per parallel task: about 16 KiB of floats, so tiny batches stay on one thread.
int64_t grain(int64_t row_floats) {
  return std::max<int64_t>(1, 4096 / std::max<int64_t>(row_floats, 1));
}

at::Tensor add_rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                        const at::Tensor& weight, double eps) {
  check_float_cpu(x, "x");
  check_float_cpu(weight, "weight");
  TORCH_CHECK(x.dim() >= 1 && x.is_contiguous(), "x must be contiguous");
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n && weight.is_contiguous(),
              "weight must be [", n, "]");
  float* res = nullptr;
  if (residual.has_value()) {
    check_float_cpu(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous(),
                "residual must be contiguous and shaped like x");
    res = residual->data_ptr<float>();
  }
  auto out = at::empty(x.sizes(), x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, grain(n), [=](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* src = xp + r * n;
      if (res != nullptr) {  // residual += x; normalize the sum
        float* rr = res + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) rr[i] += src[i];
        src = rr;
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < n; ++i) ss += src[i] * src[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + e);
      float* o = op + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) o[i] = wp[i] * (src[i] * inv);
    }
  });
  return out;
}

void check_heads(const at::Tensor& t, const char* name, int64_t tokens, int64_t dim) {
  check_float_cpu(t, name);
  TORCH_CHECK(t.dim() == 3 && t.size(0) == tokens && t.size(2) == dim, name,
              " must be [tokens, heads, head_dim]");
  TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == dim, name,
              " must have contiguous heads (rows may be strided)");
}

void rope_store_kv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
                   const std::optional<at::Tensor>& k_cache,
                   const std::optional<at::Tensor>& v_cache,
                   const std::optional<at::Tensor>& slots) {
  const int64_t T = q.size(0), D = q.size(2), H = q.size(1), KVH = k.size(1);
  check_heads(q, "q", T, D);
  check_heads(k, "k", T, D);
  check_heads(v, "v", T, D);
  TORCH_CHECK(v.size(1) == KVH, "k and v must have the same number of heads");
  TORCH_CHECK(D % 2 == 0, "head_dim must be even");
  check_float_cpu(cos, "cos");
  check_float_cpu(sin, "sin");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == D && cos.is_contiguous() &&
                  sin.sizes() == cos.sizes() && sin.is_contiguous(),
              "cos and sin must be contiguous [max_positions, head_dim]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == T &&
                  positions.is_contiguous(),
              "positions must be int64 [tokens]");
  const bool store = k_cache.has_value();
  TORCH_CHECK(store == v_cache.has_value() && store == slots.has_value(),
              "k_cache, v_cache and slots go together");
  int64_t num_slots = 0;
  if (store) {
    for (const auto* c : {&*k_cache, &*v_cache}) {
      TORCH_CHECK(c->device().is_cpu() && deepinfer::is_kv_type(*c),
                  "caches must be float32, float16 or bfloat16 CPU tensors");
      TORCH_CHECK(c->dim() == 4 && c->size(2) == KVH && c->size(3) == D && c->is_contiguous(),
                  "caches must be contiguous [num_blocks, block_size, kv_heads, head_dim]");
    }
    TORCH_CHECK(k_cache->sizes() == v_cache->sizes() &&
                    k_cache->scalar_type() == v_cache->scalar_type(),
                "k_cache and v_cache shapes or dtypes differ");
    TORCH_CHECK(slots->scalar_type() == at::kLong && slots->numel() == T && slots->is_contiguous(),
                "slots must be int64 [tokens]");
    num_slots = k_cache->size(0) * k_cache->size(1);
  }
  const int64_t P = cos.size(0), half = D / 2;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* sl = store ? slots->data_ptr<int64_t>() : nullptr;
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < P, "position ", pos[t], " outside the rotary table (",
                P, ")");
    TORCH_CHECK(!store || (sl[t] >= -1 && sl[t] < num_slots), "slot ", sl[t],
                " outside the cache");
  }
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  void* kc = store ? k_cache->data_ptr() : nullptr;
  void* vc = store ? v_cache->data_ptr() : nullptr;
  const int64_t qs = q.stride(0), kst = k.stride(0), vst = v.stride(0);
  // Cache rows as the cache's element type (rounded to nearest even into a half cache).
  auto store_kv = [=](int64_t t) {
    deepinfer::dispatch_kv_type(*k_cache, "rope_store_kv", [&](auto* type) {
      using T = std::remove_pointer_t<decltype(type)>;
      deepinfer::store_row(kp + t * kst, static_cast<T*>(kc) + sl[t] * KVH * D, KVH * D);
      deepinfer::store_row(vp + t * vst, static_cast<T*>(vc) + sl[t] * KVH * D, KVH * D);
    });
  };
  at::parallel_for(0, T, grain((H + 2 * KVH) * D), [=](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + pos[t] * D;
      const float* s = sp + pos[t] * D;
      // x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]
      const auto rotate = [=](float* x, int64_t heads) {
        for (int64_t h = 0; h < heads; ++h) {
          float* x1 = x + h * D;
          float* x2 = x1 + half;
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) {
            const float a = x1[i], b = x2[i];
            x1[i] = a * c[i] - b * s[i];
            x2[i] = b * c[i + half] + a * s[i + half];
          }
        }
      };
      rotate(qp + t * qs, H);
      rotate(kp + t * kst, KVH);
      if (store && sl[t] >= 0) store_kv(t);
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_float_cpu(x, "x");
  TORCH_CHECK(x.dim() >= 1 && x.is_contiguous() && x.size(-1) % 2 == 0,
              "x must be contiguous [..., 2 * n]");
  const int64_t n = x.size(-1) / 2, rows = n ? x.numel() / (2 * n) : 0;
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  auto out = at::empty(sizes, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, grain(2 * n), [=](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = xp + r * 2 * n;
      const float* u = g + n;
      float* o = op + r * n;
      int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
      // The scalar loop below does not vectorize (its select): 8 lanes by hand, same math.
      const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
      for (; i + 8 <= n; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 e = deepinfer::exp_nonpos8(_mm256_or_ps(gv, sign));  // exp(-|g|)
        const __m256 num = _mm256_blendv_ps(one, e, gv);  // g < 0 (sign bit set): e
        const __m256 sig = _mm256_div_ps(num, _mm256_add_ps(one, e));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + i)));
      }
#endif
      for (; i < n; ++i) {
        // sigmoid from exp(-|g|) <= 1: no overflow for either sign
        const float e = exp_nonpos(-std::fabs(g[i]));
        const float sig = g[i] >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
        o[i] = g[i] * sig * u[i];
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepinfer_cpu, m) {
  m.def("add_rms_norm(Tensor x, Tensor(a!)? residual, Tensor weight, float eps) -> Tensor");
  m.def("rope_store_kv(Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor cos, Tensor sin, "
        "Tensor positions, Tensor(c!)? k_cache, Tensor(d!)? v_cache, Tensor? slots) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepinfer_cpu, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_store_kv", &rope_store_kv);
  m.impl("silu_and_mul", &silu_and_mul);
}
