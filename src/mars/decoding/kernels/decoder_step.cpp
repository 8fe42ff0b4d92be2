// A whole decoder pass of a Llama-family model (Llama, Qwen2, Mistral) for one decode step, in C++.
//
// At batch 1 on a 2-core CPU, a decode step of a small model spends a large part of its time in the
// interpreter: 30 layers of about 40 tensor ops each, a few microseconds of Python apiece.  This is
// mars.decoding.lean's LeanDecoder loop written against ATen: the same ops, in the same order, with
// the same arguments, so its output is bit-identical to the Python loop's (tested), with the
// projections through fused_linear (small_gemm.cpp) and the attention through decode_attention
// (decode_attention.cpp) called directly, and the rotary embedding's six elementwise ops and RMSNorm's after its
// mean as loops that round each element as those ops do (rope, rms_norm).
//
// It covers every step on the per-row cache: one row whose new columns are one run of cache positions from
// `start` (a slice copy), or several rows written at their own positions (the cache's scatter); up to 64
// computed columns besides the masks (16 with AVX2: mars.decoding.fastpath.beyond_kernel) through fused_linear,
// the padding columns of a ragged batch left out of the matmuls as the
// Python loop's `only_columns` does (`rows`: the flattened columns computed), wider steps (prefills, big
// batches) through at::linear as the Python loop does.  The Python caller (mars.decoding.lean) checks that
// and otherwise runs its own loop.
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "decode_attention.h"
#include "small_gemm.h"

namespace {

using OptionalList = c10::List<c10::optional<at::Tensor>>;

// The projections of one input (q/k/v, o, gate/up, down): weights, biases, and a gated LoRA's factors.
struct Group {
  std::vector<at::Tensor> weights;
  OptionalList biases, lora_b_packed;  // the up factors packed (the down ones, as streamed, are in `fused`)
  std::vector<at::Tensor> lora_a_wide;  // the down factors in float32 (undefined where absent), for dense steps
  std::vector<double> scalings;  // empty with the factors when the group has no adapter
  bool adapted = false;
  // The same, as fused_linear_prepared reads them: checked and resolved to pointers once, at construction, so
  // that a step's 120 passes do not re-read every tensor's metadata, which each pass's weight stream has pushed
  // out of the caches.
  std::vector<FusedWeight> fused;
  std::vector<at::Tensor> fused_keep;
};

// The step's own handle on a parameter's memory (a new tensor on the same storage): a parameter given new storage
// later (`param.data = ...`) leaves the step computing with the memory it was built on, kept alive, in every
// path alike; updated in place (copy_, load_state_dict), the step sees the new values.
at::Tensor held(const at::Tensor& t) { return t.defined() ? t.detach() : t; }
c10::optional<at::Tensor> held(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? c10::optional<at::Tensor>(held(*t)) : t;
}

struct DecoderStep : torch::CustomClassHolder {
  // One entry per layer: norms, their epsilons, attention scale, and 4 groups.
  std::vector<at::Tensor> norm_in, norm_post;
  std::vector<double> eps_in, eps_post, scales;
  std::vector<Group> groups;  // 4 per layer
  at::Tensor final_norm;
  double final_eps;
  int64_t head_dim;

  // weights: 7 per layer (q, k, v, o, gate, up, down); biases, lora_a, lora_b_packed: 7 per layer (None where
  // absent; lora lists empty for a model without an adapter; the down factors as fused_linear streams them,
  // float32 or bfloat16; the up factors packed by mars::pack_lowrank); scalings: 7 per layer (0 where not
  // adapted); norms: 2 per layer then the final one, with their epsilons.
  DecoderStep(std::vector<at::Tensor> norms, std::vector<double> eps, std::vector<double> attn_scales,
              std::vector<at::Tensor> weights, OptionalList biases, OptionalList lora_a, OptionalList lora_b_packed,
              std::vector<double> scalings, int64_t head_dim_)
      : head_dim(head_dim_) {
    const size_t layers = attn_scales.size();
    TORCH_CHECK(norms.size() == 2 * layers + 1 && eps.size() == norms.size(), "mars::DecoderStep: ", layers,
                " layers need ", 2 * layers + 1, " norms and epsilons");
    TORCH_CHECK(weights.size() == 7 * layers && biases.size() == weights.size(), "mars::DecoderStep: 7 weights and ",
                "biases per layer");
    const bool lora = lora_a.size() > 0;
    TORCH_CHECK(!lora || (lora_a.size() == weights.size() && lora_b_packed.size() == weights.size() &&
                          scalings.size() == weights.size()),
                "mars::DecoderStep: lora_a, lora_b_packed and scalings need 7 entries per layer");
    // q/k/v, o, gate/up, down: the groups LeanDecoder runs as one kernel pass each
    const int sizes[4] = {3, 1, 2, 1};
    for (size_t l = 0; l < layers; ++l) {
      norm_in.push_back(held(norms[2 * l]));
      norm_post.push_back(held(norms[2 * l + 1]));
      eps_in.push_back(eps[2 * l]);
      eps_post.push_back(eps[2 * l + 1]);
      scales.push_back(attn_scales[l]);
      size_t i = 7 * l;
      for (int size : sizes) {
        Group g;
        OptionalList streamed;  // the down factors as fused_linear streams them (read into `fused` below)
        for (int j = 0; j < size; ++j, ++i) {
          g.weights.push_back(held(weights[i]));
          g.biases.push_back(held(biases.get(i)));
          if (lora) {
            const c10::optional<at::Tensor> a = held(lora_a.get(i));
            g.adapted = g.adapted || (a.has_value() && a->defined());
            streamed.push_back(a);
            // a down factor streamed as bf16 widens exactly: the fp32 factor's values
            g.lora_a_wide.push_back(a.has_value() && a->defined() ? a->to(at::kFloat) : at::Tensor());
            g.lora_b_packed.push_back(held(lora_b_packed.get(i)));
            g.scalings.push_back(scalings[i]);
          }
        }
        if (!g.adapted) {  // as LeanDecoder's _Group: no LoRA entries for a group without an adapter
          streamed = OptionalList();
          g.lora_a_wide.clear();
          g.lora_b_packed = OptionalList();
          g.scalings.clear();
        }
        g.fused = prepare_fused(g.weights, g.biases, streamed, g.lora_b_packed, g.scalings, g.fused_keep);
        groups.push_back(std::move(g));
      }
    }
    final_norm = held(norms.back());
    final_eps = eps.back();
  }

  // LlamaRMSNorm.forward, op for op.  In fp32 the sum of the squares stays ATen's (its summation order), and the
  // rest -- rsqrt(variance + eps), the product by it, the product by the weight -- is one loop rounding each
  // element as those ops do (a correctly rounded square root, then division; -ffp-contract=off), bit-identical.
  static at::Tensor rms_norm(const at::Tensor& weight, double eps, const at::Tensor& x) {
    const auto dtype = x.scalar_type();
    if (dtype != at::kFloat || weight.scalar_type() != at::kFloat || !x.is_contiguous() || !weight.is_contiguous() ||
        weight.dim() != 1 || weight.size(0) != x.size(-1)) {
      at::Tensor h = x.to(at::kFloat);
      const at::Tensor variance = h.pow(2).mean({-1}, /*keepdim=*/true);
      h = h * at::rsqrt(variance + eps);
      return weight * h.to(dtype);
    }
    // pow(2) is x * x and mean is sum then div_ by the count (ATen's CPU mean_out), so the squares are made here
    // and only the sum is ATen's: the same bits without two of its ops per norm
    at::Tensor out = at::empty_like(x);
    const int64_t width = x.size(-1), rows = x.numel() / std::max<int64_t>(width, 1);
    const float* xp = x.data_ptr<float>();
    float* op = out.data_ptr<float>();
    for (int64_t i = 0; i < rows * width; ++i) op[i] = xp[i] * xp[i];
    const at::Tensor sums = at::sum(out, {-1}, /*keepdim=*/true).contiguous();
    const float* wp = weight.data_ptr<float>();
    const float* sp = sums.data_ptr<float>();
    const float feps = static_cast<float>(eps), count = static_cast<float>(width);
    for (int64_t r = 0; r < rows; ++r) {
      const float scale = 1.0f / std::sqrt(sp[r] / count + feps);
      const float* xr = xp + r * width;
      float* o = op + r * width;
      for (int64_t i = 0; i < width; ++i) o[i] = wp[i] * (xr[i] * scale);
    }
    return out;
  }

  // (x * cos) + (rotate_half(x) * sin), rotate_half(x) = cat(-x[half:], x[:half]): the Python loop's ops, in
  // one pass instead of six ATen calls (each a dispatch and a pass over memory).  Each element is the same
  // two products, rounded apart (-ffp-contract=off), then their sum, so the result is bit-identical.  x: [batch,
  // heads, columns, dim], cos/sin: [batch, 1, columns, dim], fp32 with a contiguous last dimension.
  static at::Tensor rope(const at::Tensor& x, const at::Tensor& cos_in, const at::Tensor& sin_in) {
    const int64_t B = x.size(0), H = x.size(1), C = x.size(2), D = x.size(3), half = D / 2;
    const at::Tensor cos = cos_in.expand({B, 1, C, D}), sin = sin_in.expand({B, 1, C, D});  // as broadcasting
    if (x.scalar_type() != at::kFloat || cos.scalar_type() != at::kFloat || sin.scalar_type() != at::kFloat ||
        x.stride(3) != 1 || cos.stride(3) != 1 || sin.stride(3) != 1 || D % 2 != 0) {
      const at::Tensor rotated = at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
      return (x * cos) + (rotated * sin);
    }
    at::Tensor out = at::empty({B, H, C, D}, x.options());
    const float* xp = x.data_ptr<float>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    float* op = out.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t c = 0; c < C; ++c) {
          const float* xr = xp + b * x.stride(0) + h * x.stride(1) + c * x.stride(2);
          const float* cr = cp + b * cos.stride(0) + c * cos.stride(2);
          const float* sr = sp + b * sin.stride(0) + c * sin.stride(2);
          float* o = op + ((b * H + h) * C + c) * D;
          for (int64_t d = 0; d < half; ++d) o[d] = xr[d] * cr[d] + (-xr[d + half]) * sr[d];
          for (int64_t d = half; d < D; ++d) o[d] = xr[d] * cr[d] + xr[d - half] * sr[d];
        }
    return out;
  }

  // As mars.decoding.lean's _project_group: through fused_linear (with `rows`, only those flattened columns are
  // computed and the others are zeros: index_select, then index_copy_ into zeros, the ops of
  // mars.decoding.fastpath.fused_linears), or, for a step wider than the kernel takes (`dense`), each
  // projection by at::linear (MKL) and a gated LoRA's B(A h) * scaling added at the mask columns alone, its
  // factors through the kernel, the ops of _project.
  std::vector<at::Tensor> project(const at::Tensor& h, const Group& g, const c10::optional<at::Tensor>& mask_rows,
                                  const c10::optional<at::Tensor>& rows, bool dense) const {
    if (dense) {
      std::vector<at::Tensor> out;
      const bool lora = g.adapted && mask_rows.has_value();
      const at::Tensor at_rows = lora ? mask_rows->contiguous() : at::Tensor();
      const at::Tensor at_masks = lora ? h.reshape({-1, h.size(-1)}).index_select(0, at_rows) : at::Tensor();
      for (size_t i = 0; i < g.weights.size(); ++i) {
        at::Tensor y = at::linear(h, g.weights[i], g.biases.get(i)).contiguous();
        const at::Tensor A = at_masks.defined() ? g.lora_a_wide[i] : at::Tensor();
        if (A.defined()) {
          const int64_t N = y.size(-1);
          const at::Tensor B = g.lora_b_packed.get(i).value();
          const at::Tensor delta = lowrank_linear(small_linear(at_masks, A, c10::nullopt), B, N).contiguous();
          // y + delta * scaling at the mask rows (rounded apart: -ffp-contract=off), as peft's sum; y is ours
          const float scaling = static_cast<float>(g.scalings[i]);
          const int64_t* rp = at_rows.data_ptr<int64_t>();
          for (int64_t j = 0; j < at_rows.numel(); ++j) {
            float* yr = y.data_ptr<float>() + rp[j] * N;
            const float* dr = delta.data_ptr<float>() + j * N;
            for (int64_t n = 0; n < N; ++n) yr[n] = yr[n] + dr[n] * scaling;
          }
        }
        out.push_back(y);
      }
      return out;
    }
    const bool lora = g.adapted && mask_rows.has_value();
    const int64_t k = h.size(-1);
    const at::Tensor flat = h.reshape({-1, k});
    std::vector<at::Tensor> out = fused_linear_prepared(rows.has_value() ? flat.index_select(0, *rows) : flat,
                                                        g.fused, lora ? mask_rows : c10::nullopt);
    for (at::Tensor& y : out) {
      if (rows.has_value()) y = y.new_zeros({flat.size(0), y.size(-1)}).index_copy_(0, *rows, y);
      y = y.view({h.size(0), h.size(1), y.size(-1)});
    }
    return out;
  }

  // x: the embedded input [batch, columns, hidden] (a gated adapter's mask delta added); cos, sin: [batch, 1,
  // columns, head_dim]; keys/values: each layer's cache buffers [batch, kv_heads, capacity, head_dim]; the new
  // columns are written at `positions` [batch, columns] (scattered, as RaggedKVLayer.update) or, when it is
  // None (one row), at start .. start + columns - 1 (a copy); attention reads the first kv_length positions;
  // mask_rows: the mask columns a gated adapter acts at, among the computed ones (None: no adapter in this
  // step); rows: the flattened columns computed (None: all); dense: the step is wider than fused_linear takes
  // (see project); attention_width: the step's queries per row against the attention kernel's width (None: its
  // columns; see decode_attention.h).  Returns the final normed hidden states [batch, columns, hidden].
  at::Tensor step(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, const c10::optional<at::Tensor>& mask,
                  const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values, int64_t start,
                  int64_t kv_length, const c10::optional<at::Tensor>& mask_rows,
                  const c10::optional<at::Tensor>& positions, const c10::optional<at::Tensor>& rows, bool dense,
                  c10::optional<int64_t> attention_width) const {
    const size_t layers = scales.size();
    TORCH_CHECK(keys.size() == layers && values.size() == layers, "mars::DecoderStep: one cache buffer per layer");
    TORCH_CHECK(x.dim() == 3 && (positions.has_value() || x.size(0) == 1), "mars::DecoderStep: ", x.sizes(),
                " needs the write positions of its rows");
    TORCH_CHECK(!positions.has_value() || (positions->size(0) == x.size(0) && positions->size(1) == x.size(1)),
                "mars::DecoderStep: write positions ", positions.has_value() ? positions->sizes() : at::IntArrayRef(),
                " for an input of ", x.sizes());
    const int64_t batch = x.size(0), columns = x.size(1);
    at::Tensor index;  // the scatter's index, as RaggedKVLayer.update builds it
    if (positions.has_value()) {
      const int64_t kv_heads = keys[0].size(1), dim = keys[0].size(3);
      index = positions->view({batch, 1, columns, 1}).expand({batch, kv_heads, columns, dim});
    }
    const std::vector<int64_t> shape{batch, columns, -1, head_dim};
    for (size_t l = 0; l < layers; ++l) {
      const Group* g = &groups[4 * l];
      at::Tensor h = rms_norm(norm_in[l], eps_in[l], x);
      std::vector<at::Tensor> qkv = project(h, g[0], mask_rows, rows, dense);
      at::Tensor q = qkv[0].view(shape).transpose(1, 2);
      at::Tensor k = qkv[1].view(shape).transpose(1, 2);
      at::Tensor v = qkv[2].view(shape).transpose(1, 2);
      q = rope(q, cos, sin);
      k = rope(k, cos, sin);
      if (positions.has_value()) {
        keys[l].scatter_(2, index, k);
        values[l].scatter_(2, index, v);
      } else {
        keys[l].slice(2, start, start + columns).copy_(k);
        values[l].slice(2, start, start + columns).copy_(v);
      }
      k = keys[l].slice(2, 0, kv_length);
      v = values[l].slice(2, 0, kv_length);
      at::Tensor a = decode_attention(q, k, v, mask, scales[l], attention_width);  // SDPA beyond its kernel
      a = a.transpose(1, 2).contiguous().reshape({batch, columns, -1}).contiguous();
      x = x + project(a, g[1], mask_rows, rows, dense)[0];
      h = rms_norm(norm_post[l], eps_post[l], x);
      std::vector<at::Tensor> gate_up = project(h, g[2], mask_rows, rows, dense);
      x = x + project(at::silu(gate_up[0]) * gate_up[1], g[3], mask_rows, rows, dense)[0];
    }
    return rms_norm(final_norm, final_eps, x);
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(mars, m) {
  m.class_<DecoderStep>("DecoderStep")
      .def(torch::init<std::vector<at::Tensor>, std::vector<double>, std::vector<double>, std::vector<at::Tensor>,
                       OptionalList, OptionalList, OptionalList, std::vector<double>, int64_t>())
      .def("step", &DecoderStep::step);
}
