// Decode attention straight over a paged KV cache (CPU, float32 arithmetic): no gather, no mask.
// The cache holds float32, float16 or bfloat16 (--kv-cache-dtype; kv_types.h): a half cache
// is read as floats in registers, half the bytes a step.
//
// q [B, H, D]; k_cache, v_cache [num_blocks, block_size, KVH, D]; block_tables [B, MB]
// (int32/int64, entry i holds positions [i * block_size, (i + 1) * block_size)); row b attends
// to the keys at absolute positions [key_lo[b], key_hi[b]). H = KVH * G (GQA).
// A task is a run of consecutive blocks of one row (a whole row unless rows are few and long):
// its query heads walk the blocks once, with an online softmax (running max and sum, rescaled
// float32 accumulator), each chunk of blocks after a touch pass has pulled its K/V rows in; the
// partial states of a split row are combined at the end. Loops are written for the
// auto-vectorizer (-O3 -march=native); only the dot products (and a half cache's value rows)
// use AVX2 intrinsics, with a portable fallback.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kv_types.h"
#include "vec_math.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kLanes = 8;  // partial sums per dot product in the portable path
// Blocks per task when > 0 (--deterministic, set by paged_attention_fixed_split): a row is cut
// into runs at fixed block offsets from its first key, whatever the batch, so its softmax
// partial states, and the order they combine in, depend only on the row itself.
std::atomic<int64_t> g_fixed_part{0};
// K+V bytes a task touches ahead of computing on them: well inside a core's L2.
constexpr int64_t kTouchBytes = 128 * 1024;

using deepinfer::exp_nonpos;
using deepinfer::to_float;

// s[j] = dot(q, k_j) for the n rows k_j = kb + j * ks. Partial sums run in kLanes lanes.
template <int64_t kD, typename T>
inline void block_scores(const float* __restrict q, const T* __restrict kb, int64_t ks,
                         int64_t n, int64_t dim, float* __restrict s) {
  const int64_t D = kD > 0 ? kD : dim;
  int64_t j = 0;
#if defined(DEEPINFER_KV_VECTOR)
  if (D % 8 == 0) {  // 8 keys at a time: 8 independent FMA chains, one transposing reduction
    for (; j + 8 <= n; j += 8) {
      __m256 acc[8];
      for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int t = 0; t < 8; ++t) {
          acc[t] = _mm256_fmadd_ps(qv, deepinfer::load8(kb + (j + t) * ks + d), acc[t]);
        }
      }
      const __m256 h01 = _mm256_hadd_ps(acc[0], acc[1]), h23 = _mm256_hadd_ps(acc[2], acc[3]);
      const __m256 h45 = _mm256_hadd_ps(acc[4], acc[5]), h67 = _mm256_hadd_ps(acc[6], acc[7]);
      const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
      _mm256_storeu_ps(s + j, _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20),
                                            _mm256_permute2f128_ps(h0123, h4567, 0x31)));
    }
  }
#endif
  for (; j < n; ++j) {  // leftover keys (and the portable path): lane-wise partial sums
    const T* kr = kb + j * ks;
    float lane[kLanes] = {};
    const int64_t d_vec = D / kLanes * kLanes;
    for (int64_t c = 0; c < d_vec; c += kLanes) {
#pragma omp simd
      for (int64_t l = 0; l < kLanes; ++l) lane[l] += q[c + l] * to_float(kr[c + l]);
    }
    float tail = 0.f;
    for (int64_t d = d_vec; d < D; ++d) tail += q[d] * to_float(kr[d]);
    float h4[4];  // halving: vector adds
    for (int l = 0; l < 4; ++l) h4[l] = lane[l] + lane[l + 4];
    s[j] = (h4[0] + h4[2]) + (h4[1] + h4[3]) + tail;
  }
}

// acc = acc * corr + sum_j p[j] * v_j (rows vb + j * vs1); returns sum_j p[j]. With kD known
// the accumulator lives in registers for the whole block.
template <int64_t kD, typename T>
inline float accumulate_v(float* __restrict acc, float corr, const float* __restrict p,
                          const T* __restrict vb, int64_t n, int64_t vs1, int64_t dim) {
#if defined(DEEPINFER_KV_VECTOR)
  if constexpr (!std::is_same_v<T, float> && kD > 0 && kD % 8 == 0) {  // half: convert in
    __m256 a[kD / 8];                                                   // registers
    const __m256 c = _mm256_set1_ps(corr);
    for (int64_t i = 0; i < kD / 8; ++i) a[i] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * i), c);
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      const __m256 pj = _mm256_set1_ps(p[j]);
      const T* vr = vb + j * vs1;
      sum += p[j];
      for (int64_t i = 0; i < kD / 8; ++i) {
        a[i] = _mm256_fmadd_ps(pj, deepinfer::load8(vr + 8 * i), a[i]);
      }
    }
    for (int64_t i = 0; i < kD / 8; ++i) _mm256_storeu_ps(acc + 8 * i, a[i]);
    return sum;
  }
#endif
  constexpr int64_t kBuf = kD > 0 ? kD : 1;
  float local[kBuf];
  float* a = kD > 0 ? local : acc;
  const int64_t D = kD > 0 ? kD : dim;
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) a[d] = acc[d] * corr;
  float sum = 0.f;  // its add chain hides under the row FMAs
  for (int64_t j = 0; j < n; ++j) {
    const float pj = p[j];
    const T* vr = vb + j * vs1;
    sum += pj;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) a[d] += pj * to_float(vr[d]);
  }
  if (kD > 0) std::copy(a, a + D, acc);
  return sum;
}

// max(s[0..n)) and s[j] = exp(s[j] - mx) (<= 1): by hand in 8 lanes (the compiler leaves
// these scalar: a block's scalar exps took about a third of a batch-1 decode's attention).
inline float max_of(const float* s, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if (n >= 8) {
    __m256 m = _mm256_loadu_ps(s);
    for (j = 8; j + 8 <= n; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + j));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    mx = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  }
#endif
  for (; j < n; ++j) mx = std::max(mx, s[j]);
  return mx;
}

inline void exp_shifted(float* s, int64_t n, float mx) {
  int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 m = _mm256_set1_ps(mx);
  for (; j + 8 <= n; j += 8) {
    _mm256_storeu_ps(s + j, deepinfer::exp_nonpos8(_mm256_sub_ps(_mm256_loadu_ps(s + j), m)));
  }
#endif
  for (; j < n; ++j) s[j] = exp_nonpos(s[j] - mx);
}

// Reads one element per cache line of `rows` rows of K and of V (`dim` elements each, strides
// ks, vs) and returns their sum: independent loads over two streams at once, which the core
// keeps many of in flight.
template <typename T>
inline float touch_rows(const T* k, const T* v, int64_t rows, int64_t ks, int64_t vs,
                        int64_t dim) {
  constexpr int64_t kLine = 64 / sizeof(T);
  float sum = 0.f;
  for (int64_t j = 0; j < rows; ++j) {
    for (int64_t off = 0; off < dim; off += kLine) {
      sum += to_float(k[j * ks + off]) + to_float(v[j * vs + off]);
    }
  }
  return sum;
}

// kD > 0: head_dim known at compile time (fully unrolled); 0: runtime `dim`. T: the cache's
// element type.
template <int64_t kD, typename index_t, typename T>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& tables, const at::Tensor& key_lo, const at::Tensor& key_hi,
            float scale, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), dim = q.size(2);
  const int64_t D = kD > 0 ? kD : dim;
  const int64_t NB = k_cache.size(0), BS = k_cache.size(1), KVH = k_cache.size(2);
  const int64_t G = H / KVH, MB = tables.size(1);
  const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1), ks2 = k_cache.stride(2);
  const int64_t vs0 = v_cache.stride(0), vs1 = v_cache.stride(1), vs2 = v_cache.stride(2);
  const float* qp = q.data_ptr<float>();
  const int64_t qs0 = q.stride(0);  // rows may be strided views (of a fused qkv output)
  const T* kp = static_cast<const T*>(k_cache.data_ptr());
  const T* vp = static_cast<const T*>(v_cache.data_ptr());
  const index_t* tp = tables.data_ptr<index_t>();
  const int32_t* lo = key_lo.data_ptr<int32_t>();
  const int32_t* hi = key_hi.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  std::atomic<int64_t> bad_row{-1};
  std::atomic<int64_t> touch_sink{0};

  // A task is a run of up to `part` consecutive blocks of one row, all heads (each cache row
  // read once, contiguously). Long rows split into several tasks (flash-decoding) so that a
  // few long rows still keep every thread busy; their partial softmax states are combined below.
  const auto row_blocks = [=](int64_t b) -> int64_t {
    return lo[b] < hi[b] ? (hi[b] + BS - 1) / BS - lo[b] / BS : 0;
  };
  int64_t total_blocks = 0;
  for (int64_t b = 0; b < B; ++b) total_blocks += row_blocks(b);
  const int64_t want_tasks = 4 * at::get_num_threads();
  const int64_t fixed_part = g_fixed_part.load(std::memory_order_relaxed);
  const int64_t part = fixed_part > 0
                           ? fixed_part
                           : std::clamp<int64_t>((total_blocks + want_tasks - 1) / want_tasks, 4,
                                                 64);
  const auto row_parts = [=](int64_t b) -> int64_t {
    return std::max<int64_t>(1, (row_blocks(b) + part - 1) / part);
  };
  int64_t block_tasks = 0;
  for (int64_t b = 0; b < B; ++b) block_tasks += row_parts(b);
  // Few tasks (batch 1 at short contexts): each KV head's query heads become tasks of their
  // own, so both threads get even shares (3 tasks of 4 blocks split 2:1 otherwise).
  const int64_t splits = block_tasks < want_tasks ? KVH : 1;
  std::vector<int64_t> task_start(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) task_start[b + 1] = task_start[b] + splits * row_parts(b);
  const int64_t num_tasks = task_start[B];
  const int64_t split_heads = H / splits;  // query heads per task
  // Per task and head: running max, sum and the unnormalized output.
  std::vector<float> part_max(num_tasks * H), part_sum(num_tasks * H), part_acc(num_tasks * H * D);
  const int64_t* starts = task_start.data();
  float* pm = part_max.data();
  float* ps = part_sum.data();
  float* pa = part_acc.data();
  const int64_t width = (KVH - 1) * std::min(ks2, vs2) + D;  // one cache row, all heads
  const int64_t chunk =
      std::max<int64_t>(1, kTouchBytes / (2 * BS * width * static_cast<int64_t>(sizeof(T))));

  // Captured by value: locals the compiler knows no store can change.
  at::parallel_for(0, num_tasks, 1, [=, &bad_row, &touch_sink](int64_t begin, int64_t end) {
    std::vector<float> qs(H * D), scores(BS);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = std::upper_bound(starts, starts + B + 1, task) - starts - 1;
      const int64_t parts_b = (starts[b + 1] - starts[b]) / splits;
      const int64_t h0 = (task - starts[b]) / parts_b * split_heads, h1 = h0 + split_heads;
      const int64_t blk0 = lo[b] / BS + (task - starts[b]) % parts_b * part;
      const int64_t first = std::max<int64_t>(lo[b], blk0 * BS);
      const int64_t last = std::min<int64_t>(hi[b], (blk0 + part) * BS);
      float* acc = pa + task * H * D;
      float* run_max = pm + task * H;
      float* run_sum = ps + task * H;
      std::fill(acc, acc + H * D, 0.f);
      std::fill(run_max, run_max + H, -std::numeric_limits<float>::infinity());
      std::fill(run_sum, run_sum + H, 0.f);
      if (first >= last) continue;  // an empty row: zeros
      const float* qb = qp + b * qs0;
      for (int64_t i = h0 * D; i < h1 * D; ++i) qs[i] = qb[i] * scale;
      // Touch passes: before computing on a chunk of blocks, plain loads (one per cache line,
      // K and V interleaved) pull it into L2 with many reads in flight. Software prefetches
      // gained nothing here; this takes a batch-64 decode layer from ~1.15 to ~0.75 ms. Chunks
      // stay well inside L2, so long rows are not touched out again before they are used.
      float touched = 0.f;
      for (int64_t blk = first / BS; blk * BS < last; ++blk) {
        const int64_t id = static_cast<int64_t>(tp[b * MB + blk]);
        if (id < 0 || id >= NB) {
          bad_row.store(b);
          std::fill(run_sum, run_sum + H, 0.f);
          break;
        }
        if ((blk - first / BS) % chunk == 0) {
          for (int64_t t = blk; t < blk + chunk && t * BS < last; ++t) {
            const int64_t tid = static_cast<int64_t>(tp[b * MB + t]);
            if (tid < 0 || tid >= NB) continue;  // reported when reached
            const int64_t off = splits > 1 ? h0 / G * ks2 : 0, voff = splits > 1 ? h0 / G * vs2 : 0;
            touched += touch_rows(kp + tid * ks0 + off, vp + tid * vs0 + voff,
                                  std::min<int64_t>(last - t * BS, BS), ks1, vs1,
                                  splits > 1 ? D : width);
          }
        }
        const int64_t j0 = std::max<int64_t>(first - blk * BS, 0);
        const int64_t n = std::min<int64_t>(last - blk * BS, BS) - j0;
        for (int64_t h = h0; h < h1; ++h) {
          const int64_t kh = h / G;
          const T* kb = kp + id * ks0 + kh * ks2 + j0 * ks1;
          const T* vb = vp + id * vs0 + kh * vs2 + j0 * vs1;
          float* s = scores.data();
          block_scores<kD>(qs.data() + h * D, kb, ks1, n, D, s);
          const float mx = std::max(run_max[h], max_of(s, n));
          const float corr = std::exp(run_max[h] - mx);  // 0 on the first block
          run_max[h] = mx;
          exp_shifted(s, n, mx);
          const float sum = accumulate_v<kD>(acc + h * D, corr, s, vb, n, vs1, D);
          run_sum[h] = run_sum[h] * corr + sum;
        }
      }
      if (touched == std::numeric_limits<float>::infinity()) touch_sink.fetch_add(1);
    }
  });
  const int64_t bad = bad_row.load();
  TORCH_CHECK(bad < 0, "paged_decode_attention: row ", bad,
              " has a block id outside [0, num_blocks) in its visible range");
  // Combine each row's partial states: out = sum_p e^(m_p - M) acc_p / sum_p e^(m_p - M) s_p.
  at::parallel_for(0, B * H, 64, [=](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      float* o = op + bh * D;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t t = starts[b]; t < starts[b + 1]; ++t) m = std::max(m, pm[t * H + h]);
      std::fill(o, o + D, 0.f);
      float total = 0.f;
      for (int64_t t = starts[b]; t < starts[b + 1]; ++t) {
        if (ps[t * H + h] == 0.f) continue;  // an empty part
        const float w = std::exp(pm[t * H + h] - m);
        total += w * ps[t * H + h];
        const float* a = pa + (t * H + h) * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
      }
      const float inv = total > 0.f ? 1.f / total : 0.f;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  });
}

template <typename index_t, typename T>
void dispatch(int64_t dim, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& tables, const at::Tensor& lo, const at::Tensor& hi, float scale,
              at::Tensor& out) {
  if (dim == 64) {
    decode<64, index_t, T>(q, k, v, tables, lo, hi, scale, out);
  } else if (dim == 128) {
    decode<128, index_t, T>(q, k, v, tables, lo, hi, scale, out);
  } else {
    decode<0, index_t, T>(q, k, v, tables, lo, hi, scale, out);
  }
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& key_lo, const at::Tensor& key_hi,
                                  double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4,
              "expected q [B, H, D] and caches [num_blocks, block_size, kv_heads, D]");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "k_cache and v_cache shapes or dtypes differ");
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat,
              "expected a float32 CPU q");
  TORCH_CHECK(k_cache.device().is_cpu() && deepinfer::is_kv_type(k_cache),
              "expected float32, float16 or bfloat16 CPU caches");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "the caches' last dim must be contiguous");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D, "head_dim of q and the caches differ");
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "num heads must be a multiple of kv heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B, "block_tables must be [B, MB]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt || block_tables.scalar_type() == at::kLong,
              "block_tables must be int32 or int64");
  TORCH_CHECK(key_lo.numel() == B && key_hi.numel() == B, "key_lo and key_hi must be [B]");
  // Heads must be contiguous within a row; the rows themselves may be strided.
  const auto q_c = q.stride(2) == 1 && q.stride(1) == D ? q : q.contiguous();
  const auto tables = block_tables.contiguous();
  const auto lo = key_lo.to(at::kInt).contiguous();
  const auto hi = key_hi.to(at::kInt).contiguous();
  const int64_t max_key = block_tables.size(1) * k_cache.size(1);
  const int32_t* lp = lo.data_ptr<int32_t>();
  const int32_t* hp = hi.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 0 && hp[b] <= max_key, "row ", b, ": key range [", lp[b], ", ", hp[b],
                ") outside its block table (", max_key, " positions)");
  }
  auto out = at::empty({B, H, D}, q.options());
  if (out.numel() == 0) return out;
  const float s = static_cast<float>(scale);
  deepinfer::dispatch_kv_type(k_cache, "paged_decode_attention", [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    if (tables.scalar_type() == at::kInt) {
      dispatch<int32_t, T>(D, q_c, k_cache, v_cache, tables, lo, hi, s, out);
    } else {
      dispatch<int64_t, T>(D, q_c, k_cache, v_cache, tables, lo, hi, s, out);
    }
  });
  return out;
}

// blocks > 0: every row is split into runs of exactly this many blocks (batch-invariant);
// 0: the split follows the batch's size (the default, fastest).
void paged_attention_fixed_split(int64_t blocks) {
  TORCH_CHECK(blocks >= 0, "paged_attention_fixed_split: blocks must be >= 0");
  g_fixed_part.store(blocks, std::memory_order_relaxed);
}

TORCH_LIBRARY_FRAGMENT(deepinfer_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor key_lo, Tensor key_hi, float scale) -> Tensor");
  m.def("paged_attention_fixed_split(int blocks) -> ()", &paged_attention_fixed_split);
}

TORCH_LIBRARY_IMPL(deepinfer_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
