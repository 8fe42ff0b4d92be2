// y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) for small M, fp32, AVX2 + FMA (AVX-512 where the build targets it).
//
// Decoding reads every weight once per step for a handful of columns (M = batch x new columns, 1-16),
// so the step is bound by the weight stream from memory, not by arithmetic.  A BLAS tuned for large M
// packs and tiles for compute and turns compute-bound early at small M on this kind of CPU; this kernel
// instead streams R weight rows at a time (row-major, as nn.Linear stores them: nothing is copied or
// repacked, tied weights stay tied) and computes all M columns from them while they sit in L1.
//
// Batch invariance: the output element (m, n) is always the same sequence of operations -- an 8-lane (16 with
// AVX-512) FMA chain over k ascending from zero, one fixed horizontal sum, a scalar FMA tail, then + bias -- no
// matter M, how the columns are blocked, how rows are blocked, or how many threads share the rows.  So
// a row's output does not change with how many other columns ride along in the step.
//
// Work is split over N with at::parallel_for, i.e. torch's own OpenMP pool and thread setting.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstring>
#include <vector>

#include "small_gemm.h"

// Rows x columns per tile from 3 columns on, and rows per tile at one and at two columns.  More rows per tile
// means more weight rows streaming at once; the accumulators (R x MB) + MB column vectors + 1 weight vector must
// fit the vector registers (16 ymm with AVX2, 32 zmm with AVX-512).  Measured on the step's real shapes with
// cold weights (benchmarks/decode_step_cpu/avx512/): AVX-512 6 x 4 and 8 x 2 beat 3 x 4 and 4 x 2 by 11% and
// 15% at 4 and 2 columns on a Zen 4 EPYC; AVX2 code there gained 11% at 2 columns from 6 x 2 over 4 x 2.  On
// the AVX2-only Zen 3 EPYC, 3 x 4 beat 4 x 2, 4 x 3 and 2 x 4 by 15-60% at M = 4-8 (hot weights, one thread).
#ifdef __AVX512F__
#define MARS_DEFAULT_R 6
#define MARS_DEFAULT_R2 8
#else
#define MARS_DEFAULT_R 3
#define MARS_DEFAULT_R2 6
#endif
#ifndef MARS_R
#define MARS_R MARS_DEFAULT_R
#endif
#ifndef MARS_MB
#define MARS_MB 4
#endif
#ifndef MARS_R1
#define MARS_R1 8
#endif
#ifndef MARS_R2
#define MARS_R2 MARS_DEFAULT_R2
#endif
// Software prefetch distance in tiles (0 = off): the rows of the tile MARS_PF tiles ahead are fetched
// while this one computes, so that memory and arithmetic overlap once M makes a tile compute-bound.
#ifndef MARS_PF
#define MARS_PF 2
#endif

namespace {

// Adapted (LoRA) columns one fused_linear call takes: the decode fast path sends at most 16 rows.
constexpr int64_t kMaxColumns = 16;

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// The vector the FMA chains run on: 16 lanes where the build targets AVX-512 (mars.kernels adds -mavx512f on
// CPUs that have it), else 8.  Within one build every output element is still one fixed sequence of operations.
#ifdef __AVX512F__
using Vec = __m512;
constexpr int64_t kLanes = 16;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
// Fixed order: the two 256-bit halves added, then hsum8.
inline float vsum(Vec v) {
  const __m256 lo = _mm512_castps512_ps256(v);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return hsum8(_mm256_add_ps(lo, hi));
}
#else
using Vec = __m256;
constexpr int64_t kLanes = 8;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(Vec v) { return hsum8(v); }
#endif

// R weight rows x MB columns; R * MB accumulators + MB column vectors + 1 weight vector: at most 17 ymm values
// with AVX2 (16 registers; gcc keeps the 3 x 4 inner loop spill-free by folding one load into the FMA), 29 zmm.
template <int R, int MB>
inline void tile(const float* __restrict w, int64_t ldw, const float* __restrict x, int64_t ldx,
                 float* __restrict y, int64_t ldy, int64_t K, const float* __restrict bias) {
  Vec acc[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = vzero();
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    if (MARS_PF > 0 && (k & 15) == 0)  // one prefetch per 64-byte line of each row
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + (r + MARS_PF * R) * ldw + k), _MM_HINT_T0);
    Vec xv[MB];
    for (int m = 0; m < MB; ++m) xv[m] = vload(x + m * ldx + k);
    for (int r = 0; r < R; ++r) {
      const Vec wv = vload(w + r * ldw + k);
      for (int m = 0; m < MB; ++m) acc[r][m] = vfma(wv, xv[m], acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int m = 0; m < MB; ++m) {
      float s = vsum(acc[r][m]);
      for (int64_t t = k; t < K; ++t) s = std::fma(w[r * ldw + t], x[m * ldx + t], s);
      if (bias) s += bias[r];
      y[m * ldy + r] = s;
    }
  }
}

// All M columns against R rows, columns in blocks of up to MB.
template <int R, int MB>
inline void rows_all_columns(const float* w, int64_t ldw, const float* x, int64_t ldx, float* y, int64_t ldy,
                             int64_t M, int64_t K, const float* bias) {
  int64_t m = 0;
  for (; m + MB <= M; m += MB) tile<R, MB>(w, ldw, x + m * ldx, ldx, y + m * ldy, ldy, K, bias);
  const int64_t rest = M - m;
  const float* xr = x + m * ldx;
  float* yr = y + m * ldy;
  if constexpr (MB > 1) {
    if (rest == 1) tile<R, 1>(w, ldw, xr, ldx, yr, ldy, K, bias);
  }
  if constexpr (MB > 2) {
    if (rest == 2) tile<R, 2>(w, ldw, xr, ldx, yr, ldy, K, bias);
  }
  if constexpr (MB > 3) {
    if (rest == 3) tile<R, 3>(w, ldw, xr, ldx, yr, ldy, K, bias);
  }
}

// One weight of a pass (small_linear: the only one; fused_linear: one of its group): its output, where its
// rows start in the pass's block numbering (set by run_all), and its LoRA term (a = A x at the adapted
// columns, computed before the parallel pass; null when none).
struct Segment {
  const float* w;
  const float* bias;
  float* y;
  int64_t n;
  int64_t first_block;
  const float* lora_b;  // [n, r]
  const float* lora_a;  // [columns, r]
  int64_t r;
  float scaling;
};

template <int R, int MB>
void run_segments(const std::vector<Segment>& segs, const float* x, int64_t M, int64_t K, const int64_t* cols,
                  int64_t ncols, int64_t total_blocks, int64_t grain) {
  at::parallel_for(0, total_blocks, grain, [&](int64_t begin, int64_t end) {
    size_t s = 0;
    for (int64_t blk = begin; blk < end; ++blk) {
      while (blk >= segs[s].first_block + (segs[s].n + R - 1) / R) ++s;
      const Segment& g = segs[s];
      const int64_t n = (blk - g.first_block) * R;
      const int64_t stop = std::min<int64_t>(n + R, g.n);
      if (stop - n == R) {
        rows_all_columns<R, MB>(g.w + n * K, K, x, K, g.y + n, g.n, M, K, g.bias ? g.bias + n : nullptr);
      } else {
        for (int64_t t = n; t < stop; ++t)
          rows_all_columns<1, MB>(g.w + t * K, K, x, K, g.y + t, g.n, M, K, g.bias ? g.bias + t : nullptr);
      }
      if (g.lora_a == nullptr) continue;
      // The low-rank term of these rows at every adapted column, B[rows] a^T, as one small tile product
      // (the same per-element sequence as small_linear(a, B), so bit for bit what peft computes), then
      // peft's order: base + (B (A x * gate)) * scaling, each product rounded on its own (no contraction).
      float low[R * kMaxColumns];
      if (stop - n == R) {
        rows_all_columns<R, MB>(g.lora_b + n * g.r, g.r, g.lora_a, g.r, low, R, ncols, g.r, nullptr);
      } else {
        for (int64_t t = n; t < stop; ++t)
          rows_all_columns<1, MB>(g.lora_b + t * g.r, g.r, g.lora_a, g.r, low + (t - n), R, ncols, g.r, nullptr);
      }
      for (int64_t c = 0; c < ncols; ++c) {
        float* yc = g.y + cols[c] * g.n;
        for (int64_t t = n; t < stop; ++t) {
          const float low_rank = low[c * R + (t - n)] * g.scaling;
          yc[t] = yc[t] + low_rank;
        }
      }
    }
  });
}

// Rows per weight block by the number of columns (1 column: MARS_R1 rows; 2: MARS_R2 x 2; more: MARS_R x MARS_MB),
// the blocks numbered across the segments, and one parallel pass over them all.
void run_all(std::vector<Segment>& segs, const float* x, int64_t M, int64_t K, const int64_t* cols, int64_t ncols) {
  const int R = M == 1 ? MARS_R1 : (M == 2 ? MARS_R2 : MARS_R);
  int64_t blocks = 0;
  for (Segment& g : segs) {
    g.first_block = blocks;
    blocks += (g.n + R - 1) / R;
  }
  // Rows per task: about 64 KB of weights, so a thread gets a long sequential stream per task.
  const int64_t grain = std::max<int64_t>(1, (16384 / std::max<int64_t>(K, 1)) / 4);
  if (M == 1) {
    run_segments<MARS_R1, 1>(segs, x, M, K, cols, ncols, blocks, grain / 2 + 1);
  } else if (M == 2) {
    run_segments<MARS_R2, 2>(segs, x, M, K, cols, ncols, blocks, grain);
  } else {
    run_segments<MARS_R, MARS_MB>(segs, x, M, K, cols, ncols, blocks, grain);
  }
}

}  // namespace

// x [..., K] (any leading shape), weight [N, K], optional bias [N] -> [..., N].
at::Tensor small_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "mars::small_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "mars::small_linear: float32 only");
  TORCH_CHECK(weight.dim() == 2 && x.size(-1) == weight.size(1), "mars::small_linear: shapes ", x.sizes(),
              " and ", weight.sizes(), " do not match");
  const int64_t K = weight.size(1), N = weight.size(0);
  const at::Tensor xc = x.reshape({-1, K}).contiguous();
  const at::Tensor wc = weight.contiguous();
  const int64_t M = xc.size(0);
  const float* bp = nullptr;
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N, "mars::small_linear: bad bias");
    bc = bias->contiguous();
    bp = bc.data_ptr<float>();
  }
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  at::Tensor y = at::empty(out_shape, x.options());
  if (M == 0) return y;
  std::vector<Segment> one{{wc.data_ptr<float>(), bp, y.data_ptr<float>(), N, 0, nullptr, nullptr, 0, 0.0f}};
  run_all(one, xc.data_ptr<float>(), M, K, nullptr, 0);
  return y;
}

namespace {

// a[c, :] = A x[cols[c], :] for the adapted columns, serially (r x K is a few KB to a few hundred KB).
void lora_down(const float* A, int64_t r, const float* xm, int64_t mc, int64_t K, float* a) {
  int64_t n = 0;
  if (mc == 1) {
    for (; n + 8 <= r; n += 8) rows_all_columns<8, 1>(A + n * K, K, xm, K, a + n, r, mc, K, nullptr);
  } else if (mc == 2) {
    for (; n + 4 <= r; n += 4) rows_all_columns<4, 2>(A + n * K, K, xm, K, a + n, r, mc, K, nullptr);
  } else {
    for (; n + MARS_R <= r; n += MARS_R)
      rows_all_columns<MARS_R, MARS_MB>(A + n * K, K, xm, K, a + n, r, mc, K, nullptr);
  }
  for (; n < r; ++n) rows_all_columns<1, MARS_MB>(A + n * K, K, xm, K, a + n, r, mc, K, nullptr);
}

}  // namespace

// Several linears of one input in one pass: outputs[i] = x @ weights[i]^T + biases[i], and where
// lora_a[i] is given, + (lora_b[i] @ (lora_a[i] @ x^T)) * scalings[i] at the rows `columns` of x only
// (a gated LoRA acting at mask columns).  One parallel region for the whole group instead of one per
// matmul: at batch 1 a decode step is hundreds of small matmuls, and each region costs a thread wake-up.
// Every output element is the same sequence of operations as small_linear (and, for the LoRA term, as
// small_linear of the low-rank factors followed by peft's scaling and sum), so results are bit-identical.
std::vector<at::Tensor> fused_linear(const at::Tensor& x, at::TensorList weights,
                                     const c10::List<c10::optional<at::Tensor>>& biases,
                                     const c10::List<c10::optional<at::Tensor>>& lora_a,
                                     const c10::List<c10::optional<at::Tensor>>& lora_b, at::ArrayRef<double> scalings,
                                     const c10::optional<at::Tensor>& columns) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, "mars::fused_linear: float32 CPU input only");
  const size_t count = weights.size();
  TORCH_CHECK(count > 0 && biases.size() == count, "mars::fused_linear: one bias entry per weight");
  const bool has_lora = lora_a.size() > 0;
  TORCH_CHECK(!has_lora || (lora_a.size() == count && lora_b.size() == count && scalings.size() == count),
              "mars::fused_linear: lora_a, lora_b and scalings need one entry per weight");
  const int64_t K = x.size(-1);
  const at::Tensor xc = x.reshape({-1, K}).contiguous();
  const int64_t M = xc.size(0);
  at::Tensor cols;
  int64_t ncols = 0;
  if (has_lora && columns.has_value() && columns->defined()) {
    cols = columns->to(at::kLong).contiguous();
    ncols = cols.numel();
    TORCH_CHECK(ncols <= kMaxColumns, "mars::fused_linear: at most ", kMaxColumns, " adapted columns, got ", ncols);
  }
  // The adapted columns' inputs: read in place when consecutive (the masks after a row's real tokens, the
  // usual case), else copied together; no index_select (~15 us a call, 4 calls a layer).
  const float* xm = nullptr;
  std::vector<float> gathered;
  if (ncols > 0) {
    const int64_t* cp = cols.data_ptr<int64_t>();
    bool consecutive = true;
    for (int64_t c = 0; c < ncols; ++c) {
      TORCH_CHECK(cp[c] >= 0 && cp[c] < M, "mars::fused_linear: column ", cp[c], " outside the ", M, " input rows");
      consecutive = consecutive && cp[c] == cp[0] + c;
    }
    const float* xp = xc.data_ptr<float>();
    if (consecutive) {
      xm = xp + cp[0] * K;
    } else {
      gathered.resize(static_cast<size_t>(ncols * K));
      for (int64_t c = 0; c < ncols; ++c) std::memcpy(gathered.data() + c * K, xp + cp[c] * K, K * sizeof(float));
      xm = gathered.data();
    }
  }
  std::vector<at::Tensor> outputs, keep;
  std::vector<Segment> segs;
  for (size_t i = 0; i < count; ++i) {
    const at::Tensor& w = weights[i];
    TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 2 && w.size(1) == K,
                "mars::fused_linear: weight ", i, " must be float32 [N, ", K, "], got ", w.sizes());
    const at::Tensor wc = w.contiguous();
    keep.push_back(wc);
    const int64_t N = wc.size(0);
    Segment g{wc.data_ptr<float>(), nullptr, nullptr, N, 0, nullptr, nullptr, 0, 0.0f};
    const c10::optional<at::Tensor> bias = biases.get(i);
    if (bias.has_value() && bias->defined()) {
      TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N, "mars::fused_linear: bad bias ", i);
      keep.push_back(bias->contiguous());
      g.bias = keep.back().data_ptr<float>();
    }
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = N;
    outputs.push_back(at::empty(shape, x.options()));
    g.y = outputs.back().data_ptr<float>();
    if (ncols > 0) {
      const c10::optional<at::Tensor> A = lora_a.get(i), B = lora_b.get(i);
      if (A.has_value() && A->defined()) {
        TORCH_CHECK(B.has_value() && B->defined(), "mars::fused_linear: lora_a ", i, " without lora_b");
        const at::Tensor Ac = A->contiguous(), Bc = B->contiguous();
        const int64_t r = Ac.size(0);
        TORCH_CHECK(Ac.scalar_type() == at::kFloat && Ac.dim() == 2 && Ac.size(1) == K && Bc.scalar_type() == at::kFloat &&
                        Bc.dim() == 2 && Bc.size(0) == N && Bc.size(1) == r,
                    "mars::fused_linear: LoRA factors ", i, " ", Ac.sizes(), " and ", Bc.sizes(), " do not fit");
        at::Tensor a = at::empty({ncols, r}, x.options());
        lora_down(Ac.data_ptr<float>(), r, xm, ncols, K, a.data_ptr<float>());
        keep.push_back(Bc);
        keep.push_back(a);
        g.lora_b = Bc.data_ptr<float>();
        g.lora_a = a.data_ptr<float>();
        g.r = r;
        g.scaling = static_cast<float>(scalings[i]);
      }
    }
    segs.push_back(g);
  }
  if (M == 0) return outputs;
  run_all(segs, xc.data_ptr<float>(), M, K, ncols > 0 ? cols.data_ptr<int64_t>() : nullptr, ncols);
  return outputs;
}

TORCH_LIBRARY(MARS_NAMESPACE, m) {
  m.def("small_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def(
      "fused_linear(Tensor x, Tensor[] weights, Tensor?[] biases, Tensor?[] lora_a, Tensor?[] lora_b, float[] scalings, "
      "Tensor? columns) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(MARS_NAMESPACE, CPU, m) {
  m.impl("small_linear", &small_linear);
  m.impl("fused_linear", &fused_linear);
}
