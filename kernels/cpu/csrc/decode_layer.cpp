// One Llama-family decoder layer for a decode step (CPU, float32), in one native call.
//
// At batch 1 a layer's kernels take ~0.6 ms but the Python around them (module calls, views,
// checks, one dispatch per op) took another ~0.11 ms: ~3 ms a token. This op runs the same
// sequence of the project's native ops (called through the dispatcher, so each keeps its own
// checks and threading) with no Python in between:
//   h = rmsnorm(x [+ residual]); q|k|v = h W_qkv^T (+ b); rotary + K/V store;
//   o = paged decode attention; h = rmsnorm(o W_o^T + residual); out = down(silu(gate) * up)
// The residual stream is updated in place (at layer 0 it is x itself); returns the layer's
// output. Only for rows that are all decodes (one token each). Linears take the plain weight
// through the small-M kernel for up to 4 rows and the oneDNN-packed one above, as
// workers/layers/linear.py does; a quantized weight (it comes with scales) goes to the
// quantized small-M kernel (quant_linear.cpp) up to 4 rows, and above that (int8 and 4-bit)
// to the integer GEMM there. GGUF K-quant and bf16 weights come as parts (a Q4_K_M file's q, k
// and v differ in type): each part's own kernel (kquant_linear.cpp, bf16_linear.cpp), side by
// side.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <string>
#include <vector>

namespace {

using OptTensor = std::optional<at::Tensor>;

template <typename Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

constexpr int64_t kSmallM = 4;  // workers/layers/linear.py SMALL_M

// y = x W^T (+ b): the small-M kernel on the plain weight, or oneDNN on the packed one. A
// linear may keep only one copy: an empty plain weight means packed only, no packed one means
// the small-M kernel at every row count. With scales, the weight is quantized, and `packed`
// is the integer GEMM's pre-packed tiles (quant_linear_pack), if kept.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const OptTensor& packed,
                  const OptTensor& bias, const OptTensor& scales, const OptTensor& mins) {
  static const auto small_m =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&)>(
          "deepinfer_cpu::linear_small_m");
  static const auto quant =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&,
                    const OptTensor&, const OptTensor&)>("deepinfer_cpu::quant_linear");
  if (scales.has_value()) {  // the GEMM above 4 rows: int8 / 4-bit weights only (it checks)
    return quant.call(x, weight, *scales, mins, bias, packed);
  }
  static const auto onednn =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  const bool has_plain = weight.numel() > 0;
  TORCH_CHECK(has_plain || packed.has_value(), "a linear needs a plain or a packed weight");
  if (!packed.has_value() || (has_plain && x.size(0) <= kSmallM)) {
    return small_m.call(x, weight, bias);
  }
  torch::jit::Stack stack{x, *packed, bias, std::string("none"),
                          c10::List<std::optional<at::Scalar>>(), std::string("")};
  onednn.callBoxed(&stack);
  return stack[0].toTensor();
}

// The kernels' own row limits for K-quant and bf16 weights (kernels/cpu/kquant_linear.py,
// bf16_linear.py SMALL_M; kquant_linear.py LANES_MIN_ROWS).
constexpr int64_t kPartsSmallM = 16;
constexpr int64_t kLanesMinRows = 4;
constexpr int64_t kBf16Part = 0;  // a part's kind: 0 a bf16 weight, else its ggml type

// A linear's weights as K-quant / bf16 parts, each the rows of the output it owns.
struct Parts {
  std::vector<at::Tensor> weights;
  std::vector<int64_t> kinds;
  // a part's second copy (a K-quant's lanes, a bf16 weight's strips), or an empty tensor
  std::vector<at::Tensor> lanes;
  bool bf16_tiles = false;  // K-quant above kPartsSmallM rows without the int8 GEMM: bf16 tiles
};

// Whether kquant_linear takes every row count (kquant_linear.cpp, built with AVX512-VNNI).
bool kquant_int8_gemm() {
  static const bool int8 = op<bool()>("deepinfer_cpu::kquant_int8_gemm").call();
  return int8;
}

at::Tensor parts_linear(const at::Tensor& x, const Parts& parts, const OptTensor& bias) {
  const bool small = x.size(0) <= kPartsSmallM;
  std::vector<at::Tensor> outs;
  for (size_t i = 0; i < parts.weights.size(); ++i) {
    const at::Tensor& w = parts.weights[i];
    const int64_t kind = parts.kinds[i];
    if (kind == kBf16Part) {
      static const auto bf16_small_m =
          op<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&)>(
              "deepinfer_cpu::bf16_linear_small_m");
      static const auto bf16_strips =
          op<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&)>(
              "deepinfer_cpu::bf16_strips_linear");
      if (small && parts.lanes[i].numel() > 0) {  // the strips copy takes every decode batch
        outs.push_back(bf16_strips.call(x, parts.lanes[i], std::nullopt));
      } else {
        outs.push_back(small ? bf16_small_m.call(x, w, std::nullopt)
                             : at::linear(x.to(at::kBFloat16), w).to(at::kFloat));
      }
    } else if (parts.lanes[i].numel() > 0 && x.size(0) >= kLanesMinRows) {
      static const auto kquant_lanes =
          op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const OptTensor&)>(
              "deepinfer_cpu::kquant_lanes_linear");
      outs.push_back(kquant_lanes.call(x, parts.lanes[i], kind, std::nullopt));
    } else if (small || kquant_int8_gemm()) {
      static const auto kquant =
          op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const OptTensor&)>(
              "deepinfer_cpu::kquant_linear");
      outs.push_back(kquant.call(x, w, kind, std::nullopt));
    } else {
      static const auto kquant_tiles =
          op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const OptTensor&, bool)>(
              "deepinfer_cpu::kquant_dequant_linear");
      outs.push_back(kquant_tiles.call(x, w, kind, std::nullopt, parts.bf16_tiles));
    }
  }
  at::Tensor y = outs.size() == 1 ? outs[0] : at::cat(outs, 1);
  return bias.has_value() ? y.add_(*bias) : y;
}

// One layer's weights and shapes, as DecodeStack keeps them (given once at load).
struct LayerWeights {
  at::Tensor input_norm, post_norm;
  double eps;
  at::Tensor qkv_weight;
  OptTensor qkv_bias;
  at::Tensor o_weight, gate_up_weight, down_weight;
  OptTensor qkv_packed, o_packed, gate_up_packed, down_packed;
  int64_t num_heads, num_kv_heads;
  double scale;
  int64_t kv_group;
  c10::List<OptTensor> scales, mins;
  std::array<Parts, 4> parts;  // K-quant / bf16 linears (empty: the weight above)
};

at::Tensor run_layer(const at::Tensor& x, const at::Tensor& residual, const LayerWeights& l,
                     const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
                     const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& slots, const at::Tensor& block_tables,
                     const at::Tensor& key_lo, const at::Tensor& key_hi, bool first_layer) {
  static const auto norm =
      op<at::Tensor(const at::Tensor&, const OptTensor&, const at::Tensor&, double)>(
          "deepinfer_cpu::add_rms_norm");
  static const auto rope =
      op<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
              const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&,
              const OptTensor&)>("deepinfer_cpu::rope_store_kv");
  static const auto attention =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                    const at::Tensor&, const at::Tensor&, double)>(
          "deepinfer_cpu::paged_decode_attention");
  static const auto silu_and_mul =
      op<at::Tensor(const at::Tensor&)>("deepinfer_cpu::silu_and_mul");

  const int64_t T = x.size(0), D = k_cache.size(3);
  TORCH_CHECK(x.dim() == 2 && residual.sizes() == x.sizes(),
              "x and residual must be [tokens, hidden]");
  // Layer 0: the residual stream starts as x itself (the caller passes x as `residual`).
  const at::Tensor h = first_layer ? norm.call(x, std::nullopt, l.input_norm, l.eps)
                                   : norm.call(x, residual, l.input_norm, l.eps);
  TORCH_CHECK(l.scales.size() == 4 && l.mins.size() == 4, "one scale and min entry per linear");
  // a linear given as parts (K-quant, bf16) or one weight
  const auto project = [&](int i, const at::Tensor& in, const at::Tensor& w,
                           const OptTensor& packed, const OptTensor& bias) {
    return l.parts[i].weights.empty()
               ? linear(in, w, packed, bias, l.scales.get(i), l.mins.get(i))
               : parts_linear(in, l.parts[i], bias);
  };
  const at::Tensor qkv = project(0, h, l.qkv_weight, l.qkv_packed, l.qkv_bias);
  const int64_t q_size = l.num_heads * D, kv_size = l.num_kv_heads * D;
  const at::Tensor q = qkv.narrow(1, 0, q_size).view({T, l.num_heads, D});
  const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, l.num_kv_heads, D});
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, l.num_kv_heads, D});
  rope.call(q, k, v, cos, sin, positions, k_cache, v_cache, slots);
  const at::Tensor o =
      attention.call(q, k_cache, v_cache, block_tables, key_lo, key_hi, l.scale);
  const at::Tensor attn_out =
      project(1, o.view({T, q_size}), l.o_weight, l.o_packed, std::nullopt);
  const at::Tensor h2 = norm.call(attn_out, residual, l.post_norm, l.eps);
  const at::Tensor act =
      silu_and_mul.call(project(2, h2, l.gate_up_weight, l.gate_up_packed, std::nullopt));
  return project(3, act, l.down_weight, l.down_packed, std::nullopt);
}

// One layer as an op, its weights passed in (DecodeStack keeps them instead).
at::Tensor decode_layer(const at::Tensor& x, const at::Tensor& residual,
                        const at::Tensor& input_norm, const at::Tensor& post_norm, double eps,
                        const at::Tensor& qkv_weight, const OptTensor& qkv_bias,
                        const at::Tensor& o_weight, const at::Tensor& gate_up_weight,
                        const at::Tensor& down_weight, const OptTensor& qkv_packed,
                        const OptTensor& o_packed, const OptTensor& gate_up_packed,
                        const OptTensor& down_packed, const at::Tensor& cos,
                        const at::Tensor& sin, const at::Tensor& positions,
                        const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& slots, const at::Tensor& block_tables,
                        const at::Tensor& key_lo, const at::Tensor& key_hi, int64_t num_heads,
                        int64_t num_kv_heads, double scale, bool first_layer,
                        const c10::List<OptTensor>& scales, const c10::List<OptTensor>& mins) {
  const LayerWeights l{input_norm, post_norm, eps, qkv_weight, qkv_bias, o_weight,
                       gate_up_weight, down_weight, qkv_packed, o_packed, gate_up_packed,
                       down_packed, num_heads, num_kv_heads, scale, 0, scales, mins, {}};
  return run_layer(x, residual, l, cos, sin, positions, k_cache, v_cache, slots, block_tables,
                   key_lo, key_hi, first_layer);
}

// A model's decode layers, called in one go: torch.classes.deepinfer_cpu.DecodeStack. The
// layers' weights are handed over once (add_layer, at load), so a step passes only its own
// tensors: from Python, parsing one decode_layer call's 29 arguments cost about as much as the
// layer's norms, rotary and attention together at batch 1.
class DecodeStack : public torch::CustomClassHolder {
 public:
  void add_layer(const at::Tensor& input_norm, const at::Tensor& post_norm, double eps,
                 const at::Tensor& qkv_weight, const OptTensor& qkv_bias,
                 const at::Tensor& o_weight, const at::Tensor& gate_up_weight,
                 const at::Tensor& down_weight, const OptTensor& qkv_packed,
                 const OptTensor& o_packed, const OptTensor& gate_up_packed,
                 const OptTensor& down_packed, int64_t num_heads, int64_t num_kv_heads,
                 double scale, int64_t kv_group, const c10::List<OptTensor>& scales,
                 const c10::List<OptTensor>& mins, const std::vector<at::Tensor>& parts,
                 const std::vector<int64_t>& part_kinds, const std::vector<int64_t>& part_of,
                 const std::vector<at::Tensor>& part_lanes, bool bf16_tiles) {
    TORCH_CHECK(kv_group >= 0, "kv_group must be >= 0");
    TORCH_CHECK(part_kinds.size() == parts.size() && part_of.size() == parts.size() &&
                    part_lanes.size() == parts.size(),
                "one kind, one linear (0-3) and one lanes copy (or an empty tensor) per part");
    std::array<Parts, 4> by_linear;
    for (size_t i = 0; i < parts.size(); ++i) {
      TORCH_CHECK(part_of[i] >= 0 && part_of[i] < 4, "a part's linear must be 0-3");
      Parts& p = by_linear[part_of[i]];
      p.weights.push_back(parts[i]);
      p.kinds.push_back(part_kinds[i]);
      p.lanes.push_back(part_lanes[i]);
      p.bf16_tiles = bf16_tiles;
    }
    layers_.push_back(LayerWeights{input_norm, post_norm, eps, qkv_weight, qkv_bias, o_weight,
                                   gate_up_weight, down_weight, qkv_packed, o_packed,
                                   gate_up_packed, down_packed, num_heads, num_kv_heads, scale,
                                   kv_group, scales, mins, by_linear});
  }

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

  // Every layer over [T, hidden] decode rows x: returns the last layer's output; x, the
  // residual stream, is updated in place (as decode_layer's `residual`). Caches per layer; the
  // slots, block tables and key ranges per KV group.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                     const at::Tensor& positions, const std::vector<at::Tensor>& k_caches,
                     const std::vector<at::Tensor>& v_caches,
                     const std::vector<at::Tensor>& slots,
                     const std::vector<at::Tensor>& block_tables,
                     const std::vector<at::Tensor>& key_lo,
                     const std::vector<at::Tensor>& key_hi) const {
    const size_t n = layers_.size();
    TORCH_CHECK(n > 0, "DecodeStack has no layers");
    TORCH_CHECK(k_caches.size() == n && v_caches.size() == n, "one K and V cache per layer");
    const size_t groups = slots.size();
    TORCH_CHECK(block_tables.size() == groups && key_lo.size() == groups &&
                    key_hi.size() == groups,
                "slots, block tables and key ranges: one of each per KV group");
    at::Tensor out = x;
    for (size_t i = 0; i < n; ++i) {
      const LayerWeights& l = layers_[i];
      const auto g = static_cast<size_t>(l.kv_group);
      TORCH_CHECK(g < groups, "layer ", i, " reads KV group ", g, " of ", groups);
      out = run_layer(out, x, l, cos, sin, positions, k_caches[i], v_caches[i], slots[g],
                      block_tables[g], key_lo[g], key_hi[g], i == 0);
    }
    return out;
  }

 private:
  std::vector<LayerWeights> layers_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepinfer_cpu, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("size", &DecodeStack::size)
      .def("forward", &DecodeStack::forward);
  m.def("decode_layer(Tensor x, Tensor(a!) residual, Tensor input_norm, Tensor post_norm, "
        "float eps, Tensor qkv_weight, Tensor? qkv_bias, Tensor o_weight, Tensor gate_up_weight, "
        "Tensor down_weight, Tensor? qkv_packed, Tensor? o_packed, Tensor? gate_up_packed, "
        "Tensor? down_packed, Tensor cos, Tensor sin, Tensor positions, Tensor(b!) k_cache, "
        "Tensor(c!) v_cache, Tensor slots, Tensor block_tables, Tensor key_lo, Tensor key_hi, "
        "int num_heads, int num_kv_heads, float scale, bool first_layer, Tensor?[] scales, "
        "Tensor?[] mins) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepinfer_cpu, CPU, m) { m.impl("decode_layer", &decode_layer); }
// The oneDNN-packed weights are MkldnnCPU tensors: the call dispatches on that key then.
TORCH_LIBRARY_IMPL(deepinfer_cpu, MkldnnCPU, m) { m.impl("decode_layer", &decode_layer); }
