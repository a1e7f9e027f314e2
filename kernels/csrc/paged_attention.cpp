// Decode attention straight over a paged KV cache (CPU, float32): no gather, no mask.
//
// q [B, H, D]; k_cache, v_cache [num_blocks, block_size, KVH, D]; block_tables [B, MB]
// (int32/int64, entry i holds positions [i * block_size, (i + 1) * block_size)); row b attends
// to the keys at absolute positions [key_lo[b], key_hi[b]). H = KVH * G (GQA).
// One task per (row, kv head): its G query heads walk the visible blocks once, with a per-block
// online softmax (running max and sum, rescaled float32 accumulator).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

template <typename index_t>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& tables, const at::Tensor& key_lo, const at::Tensor& key_hi,
            float scale, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t NB = k_cache.size(0), BS = k_cache.size(1), KVH = k_cache.size(2);
  const int64_t G = H / KVH, MB = tables.size(1);
  const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1), ks2 = k_cache.stride(2);
  const int64_t vs0 = v_cache.stride(0), vs1 = v_cache.stride(1), vs2 = v_cache.stride(2);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const index_t* tp = tables.data_ptr<index_t>();
  const int32_t* lo = key_lo.data_ptr<int32_t>();
  const int32_t* hi = key_hi.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  std::atomic<int64_t> bad_block{-1};

  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(G * D), acc(G * D), scores(G * BS), run_max(G), run_sum(G);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KVH, kh = task % KVH;
      const int64_t first = lo[b], last = hi[b];
      float* o = op + (b * H + kh * G) * D;
      if (first >= last) {
        std::fill(o, o + G * D, 0.f);
        continue;
      }
      const float* qb = qp + (b * H + kh * G) * D;
      for (int64_t i = 0; i < G * D; ++i) qs[i] = qb[i] * scale;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(run_max.begin(), run_max.end(), -std::numeric_limits<float>::infinity());
      std::fill(run_sum.begin(), run_sum.end(), 0.f);
      bool ok = true;
      for (int64_t blk = first / BS; blk * BS < last; ++blk) {
        const int64_t id = static_cast<int64_t>(tp[b * MB + blk]);
        if (id < 0 || id >= NB) {
          bad_block.store(b);
          ok = false;
          break;
        }
        const int64_t j0 = std::max<int64_t>(first - blk * BS, 0);
        const int64_t j1 = std::min<int64_t>(last - blk * BS, BS);
        const float* kb = kp + id * ks0 + kh * ks2;
        const float* vb = vp + id * vs0 + kh * vs2;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qs.data() + g * D;
          float* s = scores.data() + g * BS;
          float mx = run_max[g];
          for (int64_t j = j0; j < j1; ++j) {
            const float* kr = kb + j * ks1;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qg[d] * kr[d];
            s[j] = dot;
            mx = std::max(mx, dot);
          }
          const float corr = std::exp(run_max[g] - mx);  // 0 on the first block
          run_max[g] = mx;
          float sum = 0.f;
          for (int64_t j = j0; j < j1; ++j) {
            s[j] = std::exp(s[j] - mx);
            sum += s[j];
          }
          run_sum[g] = run_sum[g] * corr + sum;
          float* a = acc.data() + g * D;
          if (corr != 1.f) {
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] *= corr;
          }
          for (int64_t j = j0; j < j1; ++j) {
            const float p = s[j];
            const float* vr = vb + j * vs1;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += p * vr[d];
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const float inv = ok ? 1.f / run_sum[g] : 0.f;
        for (int64_t d = 0; d < D; ++d) o[g * D + d] = acc[g * D + d] * inv;
      }
    }
  });
  const int64_t bad = bad_block.load();
  TORCH_CHECK(bad < 0, "paged_decode_attention: row ", bad,
              " has a block id outside [0, num_blocks) in its visible range");
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& key_lo, const at::Tensor& key_hi,
                                  double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4,
              "expected q [B, H, D] and caches [num_blocks, block_size, kv_heads, D]");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache shapes differ");
  for (const auto* t : {&q, &k_cache, &v_cache}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat,
                "expected float32 CPU tensors");
  }
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "the caches' last dim must be contiguous");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D, "head_dim of q and the caches differ");
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "num heads must be a multiple of kv heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B, "block_tables must be [B, MB]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt || block_tables.scalar_type() == at::kLong,
              "block_tables must be int32 or int64");
  TORCH_CHECK(key_lo.numel() == B && key_hi.numel() == B, "key_lo and key_hi must be [B]");
  const auto q_c = q.contiguous();
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
  auto out = at::empty({B, H, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out;
  const float s = static_cast<float>(scale);
  if (tables.scalar_type() == at::kInt) {
    decode<int32_t>(q_c, k_cache, v_cache, tables, lo, hi, s, out);
  } else {
    decode<int64_t>(q_c, k_cache, v_cache, tables, lo, hi, s, out);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention over a paged float32 KV cache (CPU)");
}
