// y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) for small M, fp32, AVX2 + FMA.
//
// Decoding reads every weight once per step for a handful of columns (M = batch x new columns, 1-16),
// so the step is bound by the weight stream from memory, not by arithmetic.  A BLAS tuned for large M
// packs and tiles for compute and turns compute-bound early at small M on this kind of CPU; this kernel
// instead streams R weight rows at a time (row-major, as nn.Linear stores them: nothing is copied or
// repacked, tied weights stay tied) and computes all M columns from them while they sit in L1.
//
// Batch invariance: the output element (m, n) is always the same sequence of operations -- an 8-lane
// FMA chain over k ascending from zero, one fixed horizontal sum, a scalar FMA tail, then + bias -- no
// matter M, how the columns are blocked, how rows are blocked, or how many threads share the rows.  So
// a row's output does not change with how many other columns ride along in the step.
//
// Work is split over N with at::parallel_for, i.e. torch's own OpenMP pool and thread setting.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

// Rows x columns per tile from 3 columns on: 3 x 4 (12 accumulators, 4 column vectors, 1 weight vector)
// beat 4 x 2, 4 x 3 and 2 x 4 by 15-60% at M = 4-8 on the 2-vCPU EPYC (hot weights, one thread,
// interleaved); one column uses 8 rows, two columns 4 x 2.
#ifndef MARS_R
#define MARS_R 3
#endif
#ifndef MARS_MB
#define MARS_MB 4
#endif
// Software prefetch distance in tiles (0 = off): the rows of the tile MARS_PF tiles ahead are fetched
// while this one computes, so that memory and arithmetic overlap once M makes a tile compute-bound.
#ifndef MARS_PF
#define MARS_PF 2
#endif

namespace {

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// R weight rows x MB columns; R * MB accumulators + MB column vectors + 1 weight vector <= 17 ymm values
// (16 registers; gcc keeps the 3 x 4 inner loop spill-free by folding one load into the FMA).
template <int R, int MB>
inline void tile(const float* __restrict w, int64_t ldw, const float* __restrict x, int64_t ldx,
                 float* __restrict y, int64_t ldy, int64_t K, const float* __restrict bias) {
  __m256 acc[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    if (MARS_PF > 0 && (k & 15) == 0)
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + (r + MARS_PF * R) * ldw + k), _MM_HINT_T0);
    __m256 xv[MB];
    for (int m = 0; m < MB; ++m) xv[m] = _mm256_loadu_ps(x + m * ldx + k);
    for (int r = 0; r < R; ++r) {
      const __m256 wv = _mm256_loadu_ps(w + r * ldw + k);
      for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_fmadd_ps(wv, xv[m], acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int m = 0; m < MB; ++m) {
      float s = hsum8(acc[r][m]);
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

template <int R, int MB>
void run(const float* w, const float* x, float* y, const float* bias, int64_t M, int64_t N, int64_t K,
         int64_t grain) {
  at::parallel_for(0, (N + R - 1) / R, grain, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n = blk * R;
      const float* b = bias ? bias + n : nullptr;
      if (n + R <= N) {
        rows_all_columns<R, MB>(w + n * K, K, x, K, y + n, N, M, K, b);
      } else {
        for (int64_t t = n; t < N; ++t)
          rows_all_columns<1, MB>(w + t * K, K, x, K, y + t, N, M, K, bias ? bias + t : nullptr);
      }
    }
  });
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
  const float* w = wc.data_ptr<float>();
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Rows per task: about 64 KB of weights, so a thread gets a long sequential stream per task.
  const int64_t grain = std::max<int64_t>(1, (16384 / std::max<int64_t>(K, 1)) / 4);
  if (M == 1) {
    run<8, 1>(w, xp, yp, bp, M, N, K, grain / 2 + 1);
  } else if (M == 2) {
    run<4, 2>(w, xp, yp, bp, M, N, K, grain);
  } else {
    run<MARS_R, MARS_MB>(w, xp, yp, bp, M, N, K, grain);
  }
  return y;
}

#ifndef MARS_NAMESPACE
#define MARS_NAMESPACE mars
#endif

TORCH_LIBRARY(MARS_NAMESPACE, m) { m.def("small_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor"); }

TORCH_LIBRARY_IMPL(MARS_NAMESPACE, CPU, m) { m.impl("small_linear", &small_linear); }
