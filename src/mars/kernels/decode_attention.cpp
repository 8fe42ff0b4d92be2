// Attention for a decode step: a few query columns per row against a KV cache, fp32 (AVX2 + FMA, AVX-512 where
// the build targets it).
//
// A decode step's attention is tiny (SmolLM2-135M at 150 cached tokens: 9 heads x 150 keys x 64 dims per
// query), and SDPA's CPU flash kernel, built for blocks of queries, spends most of its time around it: 20 us a
// layer for one query column, 41-50 us for 2-4 (measured on a Zen 4 EPYC, 2 threads), i.e. 0.6-0.9 ms of every
// 30-layer step with drafts or masks, the largest part of what extra columns cost once the matmuls stream each
// weight once (benchmarks/decode_step_cpu/column_cost_profile/).  Here each (row, head, query) is one task: its
// scores as FMA chains over the head dimension against each visible key, the softmax with a vectorized exp, and
// the weighted sum of the values in key order.
//
// Column invariance: a task's operations depend only on its own query, mask row and the cached keys and
// values -- not on how many other columns or rows ride along, nor on how tasks are split over threads -- so a
// column's output is the same alone (an AR step) or beside drafts and masks (a verify step), as the small-M GEMM
// is.  It is not SDPA's rounding: the fast path uses this kernel in every forward it serves (the lean loops and
// the model's own forward, mars.decoding.attention), so they agree bit for bit with each other.
#include "decode_attention.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "simd.h"
#include "small_gemm.h"

using namespace mars_simd;  // NOLINT: the vector helpers

namespace {

constexpr int64_t kMaxHeadDim = 256;
// Below this, exp is 0 (and at -inf: masked positions contribute exactly nothing).
constexpr float kExpFloor = -87.0f;

// exp(x) for x <= 0 (a score minus its row's maximum): Cephes' expf, x = n ln2 + r with |r| <= ln2 / 2, a
// degree-5 polynomial in r, scaled by 2^n; 0 below kExpFloor.
inline Vec vexp_nonpositive(Vec x) {
  const Vec xc = vmax(x, vset1(kExpFloor));
  const Vec n = vround(vmul(xc, vset1(1.44269504088896341f)));
  Vec r = vfma(n, vset1(-0.693359375f), xc);  // ln2 in two parts: the first exact in float
  r = vfma(n, vset1(2.12194440e-4f), r);
  Vec p = vset1(1.9875691500e-4f);
  p = vfma(p, r, vset1(1.3981999507e-3f));
  p = vfma(p, r, vset1(8.3334519073e-3f));
  p = vfma(p, r, vset1(4.1665795894e-2f));
  p = vfma(p, r, vset1(1.6666665459e-1f));
  p = vfma(p, r, vset1(5.0000001201e-1f));
  p = vfma(p, vmul(r, r), vadd(r, vset1(1.0f)));
  return vkeep_at_least(x, vmul(p, vpow2i(n)), kExpFloor);
}

// One task: out[0:D] = softmax(scale * q . k_j + mask_j over visible j) . v_j.  `scores` holds L + kLanes floats.
// The head dimension in whole vectors, then a scalar FMA tail (head dimensions below one vector: all tail).
void attend(const float* q, const float* k, int64_t k_pos_stride, const float* v, int64_t v_pos_stride,
            const float* mask_add, const bool* mask_keep, int64_t mask_pos_stride, int64_t L, int64_t D, float scale,
            float* scores, float* out) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t nvec = D / kLanes, whole = nvec * kLanes;
  Vec qv[kMaxHeadDim / kLanes];
  for (int64_t d = 0; d < nvec; ++d) qv[d] = vload(q + d * kLanes);
  float best = kNegInf;
  for (int64_t j = 0; j < L; ++j) {
    float s = kNegInf;
    if (mask_keep == nullptr || mask_keep[j * mask_pos_stride]) {
      const float* kj = k + j * k_pos_stride;
      float dot = 0.0f;
      if (nvec > 0) {
        Vec acc = vmul(qv[0], vload(kj));
        for (int64_t d = 1; d < nvec; ++d) acc = vfma(qv[d], vload(kj + d * kLanes), acc);
        dot = vsum(acc);
      }
      for (int64_t d = whole; d < D; ++d) dot = std::fma(q[d], kj[d], dot);
      s = dot * scale;
      if (mask_add != nullptr) s += mask_add[j * mask_pos_stride];
    }
    scores[j] = s;
    best = std::max(best, s);
  }
  if (best == kNegInf) {  // nothing visible: zeros (the row is padding; nobody reads it)
    std::fill(out, out + D, 0.0f);
    return;
  }
  std::fill(scores + L, scores + L + kLanes, kNegInf);  // the last vector's tail: exp gives 0
  const Vec top = vset1(best);
  Vec total = vzero();
  for (int64_t j = 0; j < L; j += kLanes) {
    const Vec e = vexp_nonpositive(vsub(vload(scores + j), top));
    vstore(scores + j, e);
    total = vadd(total, e);
  }
  Vec acc[kMaxHeadDim / kLanes];
  float tail[kLanes] = {};
  for (int64_t d = 0; d < nvec; ++d) acc[d] = vzero();
  for (int64_t j = 0; j < L; ++j) {
    const float p = scores[j];
    if (p == 0.0f) continue;  // masked: adds nothing
    const Vec pv = vset1(p);
    const float* vj = v + j * v_pos_stride;
    for (int64_t d = 0; d < nvec; ++d) acc[d] = vfma(pv, vload(vj + d * kLanes), acc[d]);
    for (int64_t d = whole; d < D; ++d) tail[d - whole] = std::fma(p, vj[d], tail[d - whole]);
  }
  const float inv = 1.0f / vsum(total);
  for (int64_t d = 0; d < nvec; ++d) vstore(out + d * kLanes, vmul(acc[d], vset1(inv)));
  for (int64_t d = whole; d < D; ++d) out[d] = tail[d - whole] * inv;
}

}  // namespace

bool decode_attention_takes(const at::Tensor& query, const at::Tensor& key, const c10::optional<at::Tensor>& mask) {
  if (query.dim() != 4 || key.dim() != 4 || query.scalar_type() != at::kFloat || key.scalar_type() != at::kFloat ||
      !query.device().is_cpu())
    return false;
  const int64_t heads = query.size(1), queries = query.size(2), dim = query.size(3);
  if (queries > kDecodeAttentionMaxQueries || dim == 0 || dim > kMaxHeadDim || key.size(3) != dim ||
      key.size(1) == 0 || heads % key.size(1) != 0 || key.stride(3) != 1)
    return false;
  if (!mask.has_value() || !mask->defined()) return queries == 1;  // several queries need their causal mask
  const at::Tensor& m = *mask;
  return m.dim() == 4 && (m.scalar_type() == at::kFloat || m.scalar_type() == at::kBool) && m.size(2) == queries &&
         m.size(3) == key.size(2);
}

namespace {

at::Tensor decode_attention_kernel(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                   const c10::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(value.sizes() == key.sizes() && value.scalar_type() == at::kFloat && value.stride(3) == 1,
              "mars::decode_attention: value ", value.sizes(), " for key ", key.sizes());
  const int64_t B = query.size(0), H = query.size(1), Q = query.size(2), D = query.size(3);
  const int64_t L = key.size(2), group = H / key.size(1);
  TORCH_CHECK(key.size(0) == B, "mars::decode_attention: ", B, " query rows, ", key.size(0), " cache rows");
  const at::Tensor q = query.contiguous();
  at::Tensor m;
  if (mask.has_value() && mask->defined()) m = mask->expand({B, H, Q, L});  // broadcast by stride 0
  const bool keep = m.defined() && m.scalar_type() == at::kBool;
  at::Tensor out = at::empty({B, Q, H, D}, q.options());  // [B, H, Q, D] as a transposed view: no copy after
  const float* qp = q.data_ptr<float>();
  const float* kp = key.data_ptr<float>();
  const float* vp = value.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // the mask's strides (zero where it broadcasts, and all zero without a mask: never read then)
  const int64_t msb = m.defined() ? m.stride(0) : 0, msh = m.defined() ? m.stride(1) : 0;
  const int64_t msq = m.defined() ? m.stride(2) : 0, msl = m.defined() ? m.stride(3) : 0;
  const float* mask_add = m.defined() && !keep ? m.data_ptr<float>() : nullptr;
  const bool* mask_keep = keep ? m.data_ptr<bool>() : nullptr;
  const float fscale = static_cast<float>(scale);
  // Threads only pay for long caches: a task at 150 keys takes about a microsecond, a wake-up about as much.
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, L * D));
  at::parallel_for(0, B * H * Q, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(L + kLanes);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / (H * Q), h = (t / Q) % H, i = t % Q, kvh = h / group;
      const int64_t moff = b * msb + h * msh + i * msq;
      attend(qp + ((b * H + h) * Q + i) * D, kp + b * key.stride(0) + kvh * key.stride(1), key.stride(2),
             vp + b * value.stride(0) + kvh * value.stride(1), value.stride(2), mask_add ? mask_add + moff : nullptr,
             mask_keep ? mask_keep + moff : nullptr, msl, L, D, fscale, scores.data(), op + ((b * Q + i) * H + h) * D);
    }
  });
  return out.transpose(1, 2);
}

}  // namespace

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const c10::optional<at::Tensor>& mask, double scale) {
  if (decode_attention_takes(query, key, mask)) return decode_attention_kernel(query, key, value, mask, scale);
  return at::scaled_dot_product_attention(query, key, value, mask, 0.0, false, scale, query.size(1) != key.size(1));
}

TORCH_LIBRARY_FRAGMENT(MARS_NAMESPACE, m) {
  m.def("decode_attention(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(MARS_NAMESPACE, CPU, m) { m.impl("decode_attention", &decode_attention); }
