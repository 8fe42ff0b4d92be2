// Attention for a decode step (a few query columns per row against a KV cache) and for a prefill of up to
// kDecodeAttentionMaxQueries columns, fp32 (AVX2 + FMA, AVX-512 where the build targets it).
//
// A decode step's attention is tiny (SmolLM2-135M at 150 cached tokens: 9 heads x 150 keys x 64 dims per
// query), and SDPA's CPU flash kernel, built for blocks of queries, spends most of its time around it: once the
// matmuls stream each weight once, that overhead is the largest part of what a step's extra columns (drafts,
// masks) cost.  Here each query (row, head, column) is its scores as FMA chains over the head dimension against
// each visible key, the softmax with a vectorized exp, and the weighted sum of the values in key order; one task
// runs the query heads of one KV head together, at up to kColumnsPerTask query columns, so that each key and value
// is read once for all of them (attend_block).
//
// Column invariance: a query's operations depend only on itself, its mask row and the cached keys and
// values -- not on how many other columns, heads or rows ride along, nor on how tasks are split over threads -- so a
// column's output is the same alone (an AR step) or beside drafts and masks (a verify step), and a prompt's columns
// the same in AR's prefill as in verify's (the prompt and its first masks), as the small-M GEMM's are.  It is not
// SDPA's rounding: the fast path uses this kernel in every forward it serves (the lean loops and
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

// The end of the keys any of N queries sees, `hidden(n, j)` telling a hidden key (all L without a mask): the keys
// after it are never visited.  A hidden key (false, or -inf added) scores -inf without its dot product and adds
// exactly nothing after it, so a prefill's causal mask skips half of them, with the same bits as visiting them
// (their exp is 0, and x + 0 is x).
template <class Hidden>
int64_t visible_end(int64_t N, int64_t L, bool masked, Hidden hidden) {
  if (!masked) return L;
  int64_t seen = 0;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = L - 1; j >= seen; --j)
      if (!hidden(n, j)) {
        seen = j + 1;
        break;
      }
  return seen;
}

// One query's scores sn[0, seen), whose largest is `best` (not -inf), made exp(s - best) in place, a vector of
// keys at a time (the tail of the last one set to -inf first: exp gives 0); returns 1 / their sum, the factor of
// its output.
inline float exp_scores(float* sn, int64_t seen, float best) {
  std::fill(sn + seen, sn + seen + kLanes, -std::numeric_limits<float>::infinity());
  const Vec top = vset1(best);
  Vec total = vzero();
  for (int64_t j = 0; j < seen; j += kLanes) {
    const Vec e = vexp_nonpositive(vsub(vload(sn + j), top));
    vstore(sn + j, e);
    total = vadd(total, e);
  }
  return 1.0f / vsum(total);
}
// For each of N queries n (heads of one KV head, one query column), out_n[0:D] = softmax(scale * q_n . k_j + mask_nj
// over visible j) . v_j, at a head dimension that is not 4 or 8 whole vectors (attend_block takes those).  The queries
// share each key and value vector as it is loaded, and their independent FMA chains fill each other's latency; each
// query's operations are the same as alone (and as with any other N): its scores as FMA chains over the head
// dimension, its softmax, its weighted sum of the values in key order.  `scores` holds N x (L + kLanes) floats.  The
// head dimension in whole vectors, then a scalar FMA tail (head dimensions below one vector: all tail).
template <int N>
void attend(const float* const* q, const float* k, int64_t k_pos_stride, const float* v, int64_t v_pos_stride,
            const float* const* mask_add, const bool* const* mask_keep, int64_t mask_pos_stride, int64_t L, int64_t D,
            float scale, float* scores, float* const* out) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t nvec = D / kLanes, whole = nvec * kLanes, stride = L + kLanes;
  Vec qv[N][kMaxHeadDim / kLanes];
  for (int n = 0; n < N; ++n)
    for (int64_t d = 0; d < nvec; ++d) qv[n][d] = vload(q[n] + d * kLanes);
  auto hidden = [&](int64_t n, int64_t j) {
    return mask_keep != nullptr ? !mask_keep[n][j * mask_pos_stride]
                                : mask_add != nullptr && mask_add[n][j * mask_pos_stride] == kNegInf;
  };
  const int64_t seen = visible_end(N, L, mask_keep != nullptr || mask_add != nullptr, hidden);
  float best[N];
  for (int n = 0; n < N; ++n) best[n] = kNegInf;
  for (int64_t j = 0; j < seen; ++j) {
    const float* kj = k + j * k_pos_stride;
#pragma GCC unroll 4
    for (int n = 0; n < N; ++n) {
      float s = kNegInf;
      if (!hidden(n, j)) {
        float dot = 0.0f;
        if (nvec > 0) {
          Vec acc = vmul(qv[n][0], vload(kj));
          for (int64_t d = 1; d < nvec; ++d) acc = vfma(qv[n][d], vload(kj + d * kLanes), acc);
          dot = vsum(acc);
        }
        for (int64_t d = whole; d < D; ++d) dot = std::fma(q[n][d], kj[d], dot);
        s = dot * scale;
        if (mask_add != nullptr) s += mask_add[n][j * mask_pos_stride];
      }
      scores[n * stride + j] = s;
      best[n] = std::max(best[n], s);
    }
  }
  float inv[N];  // nothing visible (best -inf): zeros (the row is padding; nobody reads it)
  for (int n = 0; n < N; ++n) inv[n] = best[n] == kNegInf ? 0.0f : exp_scores(scores + n * stride, seen, best[n]);
  Vec acc[N][kMaxHeadDim / kLanes];
  float tail[N][kLanes] = {};
  for (int n = 0; n < N; ++n)
    for (int64_t d = 0; d < nvec; ++d) acc[n][d] = vzero();
  for (int64_t j = 0; j < seen; ++j) {
    const float* vj = v + j * v_pos_stride;
#pragma GCC unroll 4
    for (int n = 0; n < N; ++n) {
      const float p = scores[n * stride + j];
      if (p != 0.0f && best[n] != kNegInf) {  // masked: adds nothing
        const Vec pv = vset1(p);
        for (int64_t d = 0; d < nvec; ++d) acc[n][d] = vfma(pv, vload(vj + d * kLanes), acc[n][d]);
        for (int64_t d = whole; d < D; ++d) tail[n][d - whole] = std::fma(p, vj[d], tail[n][d - whole]);
      }
    }
  }
  for (int n = 0; n < N; ++n) {
    if (best[n] == kNegInf) {
      std::fill(out[n], out[n] + D, 0.0f);
      continue;
    }
    for (int64_t d = 0; d < nvec; ++d) vstore(out[n] + d * kLanes, vmul(acc[n][d], vset1(inv[n])));
    for (int64_t d = whole; d < D; ++d) out[n][d] = tail[n][d - whole] * inv[n];
  }
}

// Heads sharing a KV head taken together in groups of at most this many (at a head dimension of 64, their query
// vectors take 4 x 4 zmm in the scores' loop, then their accumulators 4 x 4 in the values' loop).
constexpr int64_t kHeadsPerTask = 4;

using Attend = void (*)(const float* const*, const float*, int64_t, const float*, int64_t, const float* const*,
                        const bool* const*, int64_t, int64_t, int64_t, float, float*, float* const*);

// attend for n queries (at most kHeadsPerTask)
Attend pick(int64_t n) {
  switch (n) {
    case 4: return &attend<4>;
    case 3: return &attend<3>;
    case 2: return &attend<2>;
    default: return &attend<1>;
  }
}

// Query columns one task takes together (with their heads of one KV head) at a head dimension of 4 or 8 vectors.
constexpr int64_t kColumnsPerTask = 8;
// Keys per block of attend_block's values loop (their 64-dim values: 4 KB, read from L1 by every query).
constexpr int64_t kValueBlock = 16;

// attend for any number N of query vectors of one KV head (the heads of up to kColumnsPerTask query columns) at a
// head dimension of NV whole vectors, each key and value read from memory once for all of them: kLanes keys at a
// time (then kValueBlock), every query in turn, so that the block is in L1 for all but the first (a task per query
// column would read the cache again for each).  Each query's operations are attend's, in its order: its scores (a
// key's FMA chain over the head dimension, the horizontal sums of a block of keys done together, vsum_each, with
// vsum's additions), its softmax, its weighted sum of the values in key order (the accumulators kept in `acc`
// between blocks), so a query gets the same bits alone, beside others, or through attend.  `scores`: N x
// (L + kLanes) floats, `acc`: N x D, `top`: N x kLanes.  The mask's rows are contiguous along the keys, or there is
// none.
template <int NV>
void attend_block(int64_t N, const float* const* q, const float* k, int64_t k_pos_stride, const float* v,
                  int64_t v_pos_stride, const float* const* mask_add, const bool* const* mask_keep, int64_t L,
                  float scale, float* scores, float* acc, float* top, float* best, float* const* out) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  constexpr int64_t D = NV * kLanes;
  const int64_t stride = L + kLanes;
  auto hidden = [&](int64_t n, int64_t j) {
    return mask_keep != nullptr ? !mask_keep[n][j] : mask_add != nullptr && mask_add[n][j] == kNegInf;
  };
  const int64_t seen = visible_end(N, L, mask_keep != nullptr || mask_add != nullptr, hidden);
  const int64_t blocked = seen / kLanes * kLanes;  // keys scored kLanes at a time; the rest one by one
  const Vec vscale = vset1(scale);
  for (int64_t n = 0; n < N; ++n) vstore(top + n * kLanes, vset1(kNegInf));
  for (int64_t j = 0; j < blocked; j += kLanes) {
    for (int64_t n = 0; n < N; ++n) {
      Vec qn[NV];
      for (int d = 0; d < NV; ++d) qn[d] = vload(q[n] + d * kLanes);
      Vec dots[kLanes];
      for (int t = 0; t < kLanes; ++t) {
        const float* kj = k + (j + t) * k_pos_stride;
        Vec a = vmul(qn[0], vload(kj));
        for (int d = 1; d < NV; ++d) a = vfma(qn[d], vload(kj + d * kLanes), a);
        dots[t] = a;
      }
      Vec s = vmul(vsum_each(dots), vscale);  // a hidden key: -inf, whatever its product (as attend)
      if (mask_add != nullptr) {
        const Vec add = vload(mask_add[n] + j);
        s = vhide_neg_inf(vadd(s, add), add);
      } else if (mask_keep != nullptr) {
        s = vhide_bools(s, mask_keep[n] + j);
      }
      vstore(scores + n * stride + j, s);
      vstore(top + n * kLanes, vmax(s, vload(top + n * kLanes)));  // a NaN score keeps the top, as std::max below
    }
  }
  for (int64_t n = 0; n < N; ++n) {
    best[n] = blocked > 0 ? vmax_lanes(vload(top + n * kLanes)) : kNegInf;
    for (int64_t j = blocked; j < seen; ++j) {
      float s = kNegInf;
      if (!hidden(n, j)) {
        const float* kj = k + j * k_pos_stride;
        Vec a = vmul(vload(q[n]), vload(kj));
        for (int d = 1; d < NV; ++d) a = vfma(vload(q[n] + d * kLanes), vload(kj + d * kLanes), a);
        s = vsum(a) * scale;
        if (mask_add != nullptr) s += mask_add[n][j];
      }
      scores[n * stride + j] = s;
      best[n] = std::max(best[n], s);
    }
  }
  for (int64_t n = 0; n < N; ++n) {  // the output's factor in top's first lane (its lanes are free again)
    top[n * kLanes] = best[n] == kNegInf ? 0.0f : exp_scores(scores + n * stride, seen, best[n]);
    for (int d = 0; d < NV; ++d) vstore(acc + n * D + d * kLanes, vzero());
  }
  for (int64_t j0 = 0; j0 < seen; j0 += kValueBlock) {
    const int64_t j1 = std::min(seen, j0 + kValueBlock);
    for (int64_t n = 0; n < N; ++n) {
      if (best[n] == kNegInf) continue;
      const float* sn = scores + n * stride;
      Vec a[NV];
      for (int d = 0; d < NV; ++d) a[d] = vload(acc + n * D + d * kLanes);
      for (int64_t j = j0; j < j1; ++j) {
        const float p = sn[j];
        if (p != 0.0f) {  // masked: adds nothing
          const Vec pv = vset1(p);
          const float* vj = v + j * v_pos_stride;
          for (int d = 0; d < NV; ++d) a[d] = vfma(pv, vload(vj + d * kLanes), a[d]);
        }
      }
      for (int d = 0; d < NV; ++d) vstore(acc + n * D + d * kLanes, a[d]);
    }
  }
  for (int64_t n = 0; n < N; ++n) {
    if (best[n] == kNegInf) {
      std::fill(out[n], out[n] + D, 0.0f);
      continue;
    }
    const Vec inv = vset1(top[n * kLanes]);
    for (int d = 0; d < NV; ++d) vstore(out[n] + d * kLanes, vmul(vload(acc + n * D + d * kLanes), inv));
  }
}

using AttendBlock = void (*)(int64_t, const float* const*, const float*, int64_t, const float*, int64_t,
                             const float* const*, const bool* const*, int64_t, float, float*, float*, float*, float*,
                             float* const*);

// attend_block for this head dimension, or null (attend then)
AttendBlock pick_block(int64_t D) {
  if (D == 4 * kLanes) return &attend_block<4>;
  if (D == 8 * kLanes) return &attend_block<8>;
  return nullptr;
}

}  // namespace

bool decode_attention_takes(const at::Tensor& query, const at::Tensor& key, const c10::optional<at::Tensor>& mask,
                            c10::optional<int64_t> width) {
  if (query.dim() != 4 || key.dim() != 4 || query.scalar_type() != at::kFloat || key.scalar_type() != at::kFloat ||
      !query.device().is_cpu())
    return false;
  const int64_t heads = query.size(1), queries = query.size(2), dim = query.size(3);
  if (width.value_or(queries) > kDecodeAttentionMaxQueries || dim == 0 || dim > kMaxHeadDim || key.size(3) != dim ||
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
  // Tasks: (row, KV head, a group of at most kHeadsPerTask of the KV head's query heads, a group of query columns:
  // up to kColumnsPerTask where attend_block takes the head dimension, else one).  Threads only pay for long
  // caches: a query at 150 keys takes about a microsecond, a wake-up about as much.
  const AttendBlock block = (msl == 1 || !m.defined()) ? pick_block(D) : nullptr;
  const int64_t columns = block != nullptr ? kColumnsPerTask : 1, chunks = (Q + columns - 1) / columns;
  const int64_t kv_heads = H / group, parts = (group + kHeadsPerTask - 1) / kHeadsPerTask;
  const int64_t tasks = B * kv_heads * parts * chunks;
  const int64_t per_task = std::min<int64_t>(group, kHeadsPerTask) * std::min(columns, Q);
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, L * D * per_task));
  constexpr int64_t kMaxVectors = kHeadsPerTask * kColumnsPerTask;
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    const int64_t most = block != nullptr ? kMaxVectors : kHeadsPerTask;
    std::vector<float> scores(most * (L + kLanes));
    std::vector<float> scratch(block != nullptr ? most * (D + kLanes + 1) : 0);  // attend_block's acc, top, best
    const float* qs[kMaxVectors];
    const float* adds[kMaxVectors];
    const bool* keeps[kMaxVectors];
    float* outs[kMaxVectors];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t chunk = t % chunks, part = (t / chunks) % parts, kvh = (t / (chunks * parts)) % kv_heads;
      const int64_t b = t / (chunks * parts * kv_heads);
      const int64_t h0 = kvh * group + part * kHeadsPerTask, n = std::min(kHeadsPerTask, (kvh + 1) * group - h0);
      const int64_t i0 = chunk * columns, i1 = std::min(Q, i0 + columns);
      int64_t N = 0;
      for (int64_t i = i0; i < i1; ++i)
        for (int64_t j = 0; j < n; ++j, ++N) {
          const int64_t h = h0 + j, moff = b * msb + h * msh + i * msq;
          qs[N] = qp + ((b * H + h) * Q + i) * D;
          adds[N] = mask_add ? mask_add + moff : nullptr;
          keeps[N] = mask_keep ? mask_keep + moff : nullptr;
          outs[N] = op + ((b * Q + i) * H + h) * D;
        }
      const float* kb = kp + b * key.stride(0) + kvh * key.stride(1);
      const float* vb = vp + b * value.stride(0) + kvh * value.stride(1);
      const float* const* add = mask_add ? adds : nullptr;
      const bool* const* keep_rows = mask_keep ? keeps : nullptr;
      if (block != nullptr) {
        float* acc = scratch.data();
        block(N, qs, kb, key.stride(2), vb, value.stride(2), add, keep_rows, L, fscale, scores.data(), acc,
              acc + most * D, acc + most * (D + kLanes), outs);
      } else {
        pick(N)(qs, kb, key.stride(2), vb, value.stride(2), add, keep_rows, msl, L, D, fscale, scores.data(), outs);
      }
    }
  });
  return out.transpose(1, 2);
}

}  // namespace

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const c10::optional<at::Tensor>& mask, double scale, c10::optional<int64_t> width) {
  if (decode_attention_takes(query, key, mask, width)) return decode_attention_kernel(query, key, value, mask, scale);
  return at::scaled_dot_product_attention(query, key, value, mask, 0.0, false, scale, query.size(1) != key.size(1));
}

TORCH_LIBRARY_FRAGMENT(mars, m) {
  m.def(
      "decode_attention(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale, int? width=None) -> "
      "Tensor");
}

TORCH_LIBRARY_IMPL(mars, CPU, m) { m.impl("decode_attention", &decode_attention); }
