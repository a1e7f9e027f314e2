// Grouped LoRA products for multi-adapter batches (CPU), in place on the base linear's output:
//   t = A_s x_i (float32, [P * R]),  y_i[off_p : off_p + SIZE_p] += B_s,p t[p * R : (p + 1) * R]
// for every row i whose adapter slot s = slots[i] is not -1 (kernels/cpu/lora.py has the
// contract and the torch reference).
//
// One row at a time, rows split over threads (each writes only its own y row). A row's work is
// two small matrix-vector products against its slot's weights (they stay in L2 for the next row
// of the same slot). Both are `matvec`: kW weight rows at a time, each into its own vector
// accumulator, and the kW lane sums taken together by a transpose tree (pair_sum) rather than
// one horizontal add per row, which cost most of the time when rows are as short as a rank (the
// expand's rows: 16 floats). Ranks below kW are packed several rows to a vector. Written with
// GCC vector extensions, so one source serves AVX-512 (kW = 16) and narrower ISAs (kW = 8: AVX2,
// or split by the compiler), intrinsics only for the half-type conversions. Half types are
// widened to float32 as they are loaded, every sum is float32, and y gets one rounding to its
// type per element.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
#define LORA_W 16
#else
#define LORA_W 8
#endif
constexpr int kW = LORA_W;  // lanes of a float vector
typedef float vfloat __attribute__((vector_size(kW * 4)));
typedef uint32_t vbits32 __attribute__((vector_size(kW * 4)));
typedef uint16_t vbits16 __attribute__((vector_size(kW * 2)));

inline float to_f32(float v) { return v; }
inline float to_f32(c10::BFloat16 v) {  // the upper half of a float32
  return std::bit_cast<float>(static_cast<uint32_t>(v.x) << 16);
}
inline float to_f32(c10::Half v) { return static_cast<float>(v); }

template <typename V>
inline V load_bits(const void* p) {  // unaligned
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// kW elements from p as float32 lanes, and y's kW elements at p written back as `v`.
inline vfloat load(const float* p) { return load_bits<vfloat>(p); }
inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }
// Half types widen and narrow through intrinsics where there are some: gcc splits its generic
// vector conversions into 256-bit halves (-march=native prefers 256-bit vectors), at three
// times the cost of the loads they feed.
inline vfloat load(const c10::BFloat16* p) {  // bfloat16: the upper half of a float32
#if LORA_W == 16
  return (vfloat)_mm512_slli_epi32(_mm512_cvtepu16_epi32(load_bits<__m256i>(p)), 16);
#elif defined(__AVX2__)
  return (vfloat)_mm256_slli_epi32(_mm256_cvtepu16_epi32(load_bits<__m128i>(p)), 16);
#else
  return (vfloat)(__builtin_convertvector(load_bits<vbits16>(p), vbits32) << 16);
#endif
}
inline void store(c10::BFloat16* p, vfloat v) {  // rounded to nearest even, NaN kept, as c10
  const vbits32 u = (vbits32)v;
  const vbits32 nan = (vbits32)(v != v);
  const vbits32 r = (((u + 0x7fffu + ((u >> 16) & 1u)) >> 16) & ~nan) | (0x7fc0u & nan);
#if LORA_W == 16
  const __m256i h = _mm512_cvtepi32_epi16((__m512i)r);
#else
  const vbits16 h = __builtin_convertvector(r, vbits16);
#endif
  std::memcpy(p, &h, sizeof h);
}
#if LORA_W == 16
inline vfloat load(const c10::Half* p) { return (vfloat)_mm512_cvtph_ps(load_bits<__m256i>(p)); }
inline void store(c10::Half* p, vfloat v) {
  const __m256i h = _mm512_cvtps_ph((__m512)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  std::memcpy(p, &h, sizeof h);
}
#elif defined(__F16C__)
inline vfloat load(const c10::Half* p) { return (vfloat)_mm256_cvtph_ps(load_bits<__m128i>(p)); }
inline void store(c10::Half* p, vfloat v) {
  const __m128i h = _mm256_cvtps_ph((__m256)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  std::memcpy(p, &h, sizeof h);
}
#else
inline vfloat load(const c10::Half* p) {
  vfloat v;
  for (int i = 0; i < kW; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}
inline void store(c10::Half* p, vfloat v) {
  for (int i = 0; i < kW; ++i) p[i] = static_cast<c10::Half>(v[i]);
}
#endif

// [sums of lane pairs of a | of b]: one level of the transpose tree.
inline vfloat pair_sum(vfloat a, vfloat b) {
#if LORA_W == 16
  return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28,
                                 30) +
         __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29,
                                 31);
#else
  return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}

// From C = 2^L vectors, L levels of pair_sum: lane i is the sum of lane group i % (kW / C)
// (C lanes wide) of vector i / (kW / C): with C = kW, lane i is the sum of acc[i].
template <int C>
inline vfloat tree(vfloat* acc) {
#pragma GCC unroll 16
  for (int m = C; m > 1; m /= 2) {
#pragma GCC unroll 16
    for (int i = 0; i < m / 2; ++i) acc[i] = pair_sum(acc[2 * i], acc[2 * i + 1]);
  }
  return acc[0];
}

// out[j] = dot(w[j], v), one row at a time: what the blocked paths leave over.
template <typename T>
void matvec_rows(const T* __restrict w, const float* __restrict v, float* __restrict out,
                 int64_t rows, int64_t n) {
  for (int64_t j = 0; j < rows; ++j) {
    const T* wj = w + j * n;
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t k = 0; k < n; ++k) s += to_f32(wj[k]) * v[k];
    out[j] = s;
  }
}

// kW rows of n < kW (kW % n == 0): n vectors each holding kW / n rows, against v tiled.
template <typename T, int N>
inline void packed_block(const T* w, vfloat tv, float* out) {
  vfloat acc[N];
#pragma GCC unroll 16
  for (int q = 0; q < N; ++q) acc[q] = load(w + q * kW) * tv;
  store(out, tree<N>(acc));
}

// out[j] = dot(w[j], v) for j < rows: w rows n long and contiguous, v float32 (n long).
template <typename T>
void matvec(const T* __restrict w, const float* __restrict v, float* __restrict out,
            int64_t rows, int64_t n) {
  int64_t j = 0;
  if (n >= kW) {
    const int64_t full = n - n % kW;
    for (; j + kW <= rows; j += kW) {
      vfloat acc[kW] = {};
      for (int64_t k = 0; k < full; k += kW) {
        const vfloat vk = load(v + k);
#pragma GCC unroll 16
        for (int r = 0; r < kW; ++r) acc[r] += load(w + (j + r) * n + k) * vk;
      }
      vfloat sums = tree<kW>(acc);
      for (int r = 0; r < kW && full < n; ++r) {  // the last n % kW columns
        for (int64_t k = full; k < n; ++k) sums[r] += to_f32(w[(j + r) * n + k]) * v[k];
      }
      store(out + j, sums);
    }
  } else if (n > 0 && kW % n == 0) {
    float tiled[kW];
    for (int l = 0; l < kW; ++l) tiled[l] = v[l % n];
    const vfloat tv = load(tiled);
    for (; j + kW <= rows; j += kW) {
      const T* wj = w + j * n;
      switch (n) {
        case 1: packed_block<T, 1>(wj, tv, out + j); break;
        case 2: packed_block<T, 2>(wj, tv, out + j); break;
        case 4: packed_block<T, 4>(wj, tv, out + j); break;
        case 8: packed_block<T, 8>(wj, tv, out + j); break;
        default: break;  // n < kW divides kW: one of the above
      }
    }
  }
  matvec_rows(w + j * n, v, out + j, rows - j, n);
}

// y[o] += d[o] for o < n, one rounding to y's type.
template <typename T>
void add_to(T* __restrict y, const float* __restrict d, int64_t n) {
  int64_t o = 0;
  for (; o + kW <= n; o += kW) store(y + o, load(y + o) + load(d + o));
  for (; o < n; ++o) y[o] = static_cast<T>(to_f32(y[o]) + d[o]);
}

struct Shape {
  int64_t parts, rank, in, out;  // P, R, IN, OUT
  std::vector<int64_t> offsets, sizes;
};

template <typename T>
void run(T* y, const T* x, const int32_t* slots, const T* a, const std::vector<const T*>& bs,
         const Shape& sh, int64_t n_rows) {
  const int64_t pr = sh.parts * sh.rank;
  int64_t out_total = 0;
  for (int64_t size : sh.sizes) out_total += size;
  // Rows per task: ~64K multiply-adds, so a batch of tiny rows stays on one thread.
  const int64_t work = pr * sh.in + out_total * sh.rank;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, work));
  at::parallel_for(0, n_rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(std::is_same_v<T, float> ? 0 : sh.in), t(pr), d;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = slots[i];
      if (s < 0) continue;
      const float* xv;
      if constexpr (std::is_same_v<T, float>) {
        xv = x + i * sh.in;
      } else {  // widened once per row, read by all P * R rows of A
        const T* xi = x + i * sh.in;
#pragma omp simd
        for (int64_t k = 0; k < sh.in; ++k) xf[k] = to_f32(xi[k]);
        xv = xf.data();
      }
      matvec(a + s * pr * sh.in, xv, t.data(), pr, sh.in);
      T* yi = y + i * sh.out;
      for (int64_t p = 0; p < sh.parts; ++p) {
        const int64_t size = sh.sizes[p];
        d.resize(size);
        matvec(bs[p] + s * size * sh.rank, t.data() + p * sh.rank, d.data(), size, sh.rank);
        add_to(yi + sh.offsets[p], d.data(), size);
      }
    }
  });
}

void lora_delta_(const at::Tensor& y, const at::Tensor& x, const at::Tensor& slots,
                 const at::Tensor& a, at::TensorList bs, at::IntArrayRef offsets) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "lora_delta_: float32, bfloat16 or float16 only, not ", dtype);
  TORCH_CHECK(x.device().is_cpu() && y.device().is_cpu() && a.device().is_cpu() &&
                  slots.device().is_cpu(),
              "lora_delta_: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "lora_delta_: x must be contiguous [N, IN]");
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && y.size(0) == x.size(0) &&
                  y.scalar_type() == dtype,
              "lora_delta_: y must be contiguous [N, OUT] of x's dtype");
  TORCH_CHECK(slots.scalar_type() == at::kInt && slots.dim() == 1 && slots.is_contiguous() &&
                  slots.size(0) == x.size(0),
              "lora_delta_: slots must be int32 [N]");
  const int64_t parts = static_cast<int64_t>(bs.size());
  TORCH_CHECK(parts >= 1 && static_cast<int64_t>(offsets.size()) == parts,
              "lora_delta_: one offset per part (and at least one part)");
  TORCH_CHECK(a.dim() == 3 && a.is_contiguous() && a.scalar_type() == dtype &&
                  a.size(2) == x.size(1) && a.size(1) % parts == 0,
              "lora_delta_: a must be contiguous [S, P * R, IN] of x's dtype");
  Shape sh{parts, a.size(1) / parts, x.size(1), y.size(1), {}, {}};
  const int64_t n_slots = a.size(0);
  for (int64_t p = 0; p < parts; ++p) {
    const at::Tensor& b = bs[p];
    TORCH_CHECK(b.device().is_cpu() && b.dim() == 3 && b.is_contiguous() &&
                    b.scalar_type() == dtype && b.size(0) == n_slots && b.size(2) == sh.rank,
                "lora_delta_: bs[", p, "] must be contiguous [S, SIZE, R] of x's dtype");
    TORCH_CHECK(offsets[p] >= 0 && offsets[p] + b.size(1) <= sh.out, "lora_delta_: part ", p,
                " does not fit in y's ", sh.out, " columns");
    sh.offsets.push_back(offsets[p]);
    sh.sizes.push_back(b.size(1));
  }
  const int64_t n_rows = x.size(0);
  const int32_t* sl = slots.data_ptr<int32_t>();
  for (int64_t i = 0; i < n_rows; ++i) {  // checked here: a parallel region must not throw
    TORCH_CHECK(sl[i] >= -1 && sl[i] < n_slots, "lora_delta_: slot ", sl[i], " of row ", i,
                " outside [-1, ", n_slots, ")");
  }
  if (n_rows == 0) return;
  auto go = [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    std::vector<const T*> b_ptrs;
    for (const at::Tensor& b : bs) b_ptrs.push_back(static_cast<const T*>(b.data_ptr()));
    run<T>(static_cast<T*>(y.data_ptr()), static_cast<const T*>(x.data_ptr()), sl,
           static_cast<const T*>(a.data_ptr()), b_ptrs, sh, n_rows);
  };
  if (dtype == at::kFloat) {
    go(static_cast<float*>(nullptr));
  } else if (dtype == at::kBFloat16) {
    go(static_cast<c10::BFloat16*>(nullptr));
  } else {
    go(static_cast<c10::Half*>(nullptr));
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepinfer_cpu, m) {
  m.def("lora_delta_(Tensor(a!) y, Tensor x, Tensor slots, Tensor a, Tensor[] bs, "
        "int[] offsets) -> ()");
}

TORCH_LIBRARY_IMPL(deepinfer_cpu, CPU, m) { m.impl("lora_delta_", &lora_delta_); }
