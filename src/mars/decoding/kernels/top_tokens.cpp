// A greedy step's choice at each prediction column in one pass over its logits: the never-emitted tokens set to
// -inf in place, the first maximum (torch.max(dim=-1)'s index: the first of tied maxima, the first NaN where
// there is one) and, at the columns from `top_from` on, the top token's softmax probability 1 / sum(exp(x - max))
// (what the draft threshold reads).
//
// Why: a decode step streams every weight of the model through the caches, so the engine's Python and ATen
// code after the forward starts from memory: one tiny ATen op costs tens of microseconds there instead of a few
// warm. The same choice through ATen (the suppression's indexing, max, and the probability's subtraction, exp, sum
// and reciprocal) pays that six times; one op pays it once.
//
// The indices are torch's. The probability's exp is the attention kernel's (Cephes' polynomial) and its sum runs
// over the vector lanes, so it can differ from torch's in the last bits; it only decides whether a draft is
// proposed, never which token is emitted. Each column's result depends on that column alone.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "simd.h"

using namespace mars_simd;  // NOLINT: the vector helpers

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// The index of the first maximum of x[0:n] (the first NaN where there is one) and that value.
std::pair<int64_t, float> first_maximum(const float* x, int64_t n) {
  Vec top = vset1(kNegInf);
  bool nan = false;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Vec v = vload(x + i);
    nan = nan || vany_nan(v);
    top = vmax(top, v);
  }
  float m = vmax_lanes(top);
  for (int64_t j = i; j < n; ++j) {
    nan = nan || std::isnan(x[j]);
    m = x[j] > m ? x[j] : m;
  }
  if (nan) {
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(x[j])) return {j, kNaN};
  }
  for (i = 0; i + kLanes <= n; i += kLanes) {
    const int lane = vfirst_equal(vload(x + i), m);
    if (lane >= 0) return {i + lane, m};
  }
  for (int64_t j = i; j < n; ++j)
    if (x[j] == m) return {j, m};
  return {0, m};  // n == 0 cannot reach here (checked); all -inf: found above
}

// 1 / sum(exp(x - m)) over x[0:n], m its maximum (NaN where m is NaN or -inf, as torch's arithmetic gives).
float top_probability(const float* x, int64_t n, float m) {
  if (std::isnan(m) || m == kNegInf) return kNaN;
  const Vec mv = vset1(m);
  Vec sum = vzero();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) sum = vadd(sum, vexp_nonpositive(vsub(vload(x + i), mv)));
  if (i < n) {  // the tail through the same vector exp, padded with -inf (exp gives exactly 0)
    alignas(64) float tail[kLanes];
    for (int64_t j = 0; j < kLanes; ++j) tail[j] = i + j < n ? x[i + j] : kNegInf;
    sum = vadd(sum, vexp_nonpositive(vsub(vload(tail), mv)));
  }
  return 1.0f / vsum(sum);
}

}  // namespace

// logits [..., columns, vocab] float32 on the CPU, the vocabulary contiguous; suppress: token ids set to -inf
// first (in place); top_from: the first column whose top probability is computed (NaN before it).
// Returns (indices int64 [..., columns], top probabilities float32 [..., columns]).
std::tuple<at::Tensor, at::Tensor> top_tokens(at::Tensor logits, at::IntArrayRef suppress, int64_t top_from) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat,
              "mars::top_tokens: float32 CPU logits only");
  TORCH_CHECK(logits.dim() >= 2 && logits.size(-1) > 0, "mars::top_tokens: logits [..., columns, vocab]");
  TORCH_CHECK(logits.is_contiguous(), "mars::top_tokens: contiguous logits only (written in place)");
  const int64_t vocab = logits.size(-1), columns = logits.size(-2), count = logits.numel() / vocab;
  for (int64_t id : suppress) TORCH_CHECK(id >= 0 && id < vocab, "mars::top_tokens: token id ", id, " out of range");
  const auto shape = logits.sizes().slice(0, logits.dim() - 1);
  at::Tensor indices = at::empty(shape, logits.options().dtype(at::kLong));
  at::Tensor top = at::full(shape, kNaN, logits.options());
  float* x = logits.data_ptr<float>();
  int64_t* ip = indices.data_ptr<int64_t>();
  float* tp = top.data_ptr<float>();
  const std::vector<int64_t> ids(suppress.begin(), suppress.end());
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t d = begin; d < end; ++d) {
      float* row = x + d * vocab;
      for (int64_t id : ids) row[id] = kNegInf;
      const auto [index, m] = first_maximum(row, vocab);
      ip[d] = index;
      if (d % columns >= top_from) tp[d] = top_probability(row, vocab, m);
    }
  });
  return {indices, top};
}

TORCH_LIBRARY_FRAGMENT(mars, m) {
  m.def("top_tokens(Tensor(a!) logits, int[] suppress, int top_from) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(mars, CPU, m) { m.impl("top_tokens", &top_tokens); }
