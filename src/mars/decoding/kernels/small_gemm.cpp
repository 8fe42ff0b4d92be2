// y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) for small M, fp32, AVX2 + FMA (AVX-512 where the build targets it).
//
// Decoding reads every weight once per step for a handful of columns (M = batch x new columns, 1-64),
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

#include <algorithm>
#include <cstring>
#include <vector>

#include "simd.h"
#include "small_gemm.h"

using namespace mars_simd;  // NOLINT: the vector helpers

// The tuning macros have no defaults here: mars.decoding.kernels.TUNING gives all of them, per ISA and CPU vendor,
// as -D flags (and says why each value), so one table decides every build.  None of them changes an output bit.
//   MARS_R x MARS_MB  rows x columns per tile from 3 columns on (MARS_R3 rows at exactly 3 columns where > 0, else
//                     the MARS_R x MARS_MB path), MARS_R2 rows at 2 columns, MARS_R1 rows at 1.  More rows per tile
//                     means more weight rows streaming at once; the accumulators (R x MB) + MB column vectors + 1
//                     weight vector must fit the vector registers (16 ymm with AVX2, 32 zmm with AVX-512).
//   MARS_PF           software prefetch distance in tiles (0 = off): the rows of the tile MARS_PF tiles ahead are
//                     fetched while this one computes, so that memory and arithmetic overlap once M makes a tile
//                     compute-bound.
//   MARS_W_IN_REGISTER, MARS_PF_SPREAD, MARS_LORA_PF  0 or 1: see where each is used below.
#if !defined(MARS_R) || !defined(MARS_MB) || !defined(MARS_R1) || !defined(MARS_R2) || !defined(MARS_R3) || \
    !defined(MARS_PF) || !defined(MARS_W_IN_REGISTER) || !defined(MARS_PF_SPREAD) || !defined(MARS_LORA_PF)
#error "build through mars.decoding.kernels: the tuning macros come from its TUNING table"
#endif

namespace {

// Adapted (LoRA) columns one fused_linear call takes: the decode fast path sends at most 1024 rows
// (mars.decoding.fastpath.MAX_KERNEL_ROWS).
constexpr int64_t kMaxColumns = 1024;

// R weight rows x MB columns; R * MB accumulators + MB column vectors + 1 weight vector: at most 17 ymm values
// with AVX2 (16 registers; gcc keeps the 3 x 4 inner loop spill-free by folding one load into the FMA), 29 zmm.
// MARS_W_IN_REGISTER=1: a tile of several columns loads each weight vector once into a register.  Left to itself
// gcc folds the load into each column's FMA, so a tile of R rows and 3 columns issues 3R weight loads per step of
// k instead of R and waits on the load ports.  Only tiles whose accumulators, columns and weight vector fit the
// registers are pinned (AVX2's 3 x 4 tile relies on the fold to stay spill-free).
// T: the weights' element, float or a bf16's bits (uint16_t: LoRA factors whose values are bf16 numbers stream in
// half the bytes; widened exactly to fp32 on load, so the arithmetic and its result are the same).
// kSpread: this tile prefetches only rows [pf_lo, pf_hi) of the tile ahead (rows_all_columns: the column blocks
// of a wide step share them out).
template <int R, int MB, typename T = float, bool kSpread = false>
inline void tile(const T* __restrict w, int64_t ldw, const float* __restrict x, int64_t ldx,
                 float* __restrict y, int64_t ldy, int64_t K, const float* __restrict bias, int pf_lo = 0,
                 int pf_hi = R) {
  Vec acc[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = vzero();
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    // one prefetch per 64-byte line of each row (without kSpread the bounds are constants: the loop unrolls)
    if (MARS_PF > 0 && (k & (64 / int64_t(sizeof(T)) - 1)) == 0)
      for (int r = kSpread ? pf_lo : 0; r < (kSpread ? pf_hi : R); ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w + (r + MARS_PF * R) * ldw + k), _MM_HINT_T0);
    Vec xv[MB];
    for (int m = 0; m < MB; ++m) xv[m] = vload(x + m * ldx + k);
    for (int r = 0; r < R; ++r) {
      Vec wv = vload(w + r * ldw + k);
      // the empty asm keeps wv in a register (MARS_W_IN_REGISTER); the FMAs and their order are unchanged
      if constexpr (MB > 1 && MARS_W_IN_REGISTER && R * MB + MB + 1 <= kVectorRegisters) asm("" : "+v"(wv));
      for (int m = 0; m < MB; ++m) acc[r][m] = vfma(wv, xv[m], acc[r][m]);
    }
  }
  // The R x MB horizontal sums, kLanes at a time through vsum_each: vsum's additions in vsum's order, so the same
  // bits, with half the shuffles (all on one port): 48 instead of 96 for a 3-column tile's 24 sums.  Below 4 sums,
  // vsums take fewer.
  constexpr int kSums = R * MB;
  static_assert(kSums <= 2 * kLanes, "a tile's sums take at most two vsum_each");
  alignas(64) float sums[2 * kLanes];
  if constexpr (kSums >= 4) {
    Vec flat[kSums];  // column by column
#pragma GCC unroll 32
    for (int i = 0; i < kSums; ++i) flat[i] = acc[i % R][i / R];
    vstore(sums, vsum_each<(kSums < kLanes ? kSums : kLanes)>(flat));
    if constexpr (kSums > kLanes) vstore(sums + kLanes, vsum_each<kSums - kLanes>(flat + kLanes));
  } else {
    for (int i = 0; i < kSums; ++i) sums[i] = vsum(acc[i % R][i / R]);
  }
  for (int m = 0; m < MB; ++m) {
    for (int r = 0; r < R; ++r) {
      float s = sums[m * R + r];
      for (int64_t t = k; t < K; ++t) s = std::fma(to_float(w[r * ldw + t]), x[m * ldx + t], s);
      if (bias) s += bias[r];
      y[m * ldy + r] = s;
    }
  }
}

// All M columns against R rows, columns in blocks of up to MB.
template <int R, int MB, typename T = float, bool kSpread = false>
inline void blocks_of_columns(const T* w, int64_t ldw, const float* x, int64_t ldx, float* y, int64_t ldy,
                              int64_t M, int64_t K, const float* bias, int64_t ahead = R) {
  const int64_t blocks = (M + MB - 1) / MB;
  // block b prefetches its share of the first `ahead` rows of the next tile (kSpread)
  auto lo = [&](int64_t b) { return static_cast<int>(b * ahead / blocks); };
  int64_t m = 0, b = 0;
  for (; m + MB <= M; m += MB, ++b)
    tile<R, MB, T, kSpread>(w, ldw, x + m * ldx, ldx, y + m * ldy, ldy, K, bias, lo(b), lo(b + 1));
  const int64_t rest = M - m;
  const float* xr = x + m * ldx;
  float* yr = y + m * ldy;
  if constexpr (MB > 1) {
    if (rest == 1) tile<R, 1, T, kSpread>(w, ldw, xr, ldx, yr, ldy, K, bias, lo(b), lo(b + 1));
  }
  if constexpr (MB > 2) {
    if (rest == 2) tile<R, 2, T, kSpread>(w, ldw, xr, ldx, yr, ldy, K, bias, lo(b), lo(b + 1));
  }
  if constexpr (MB > 3) {
    if (rest == 3) tile<R, 3, T, kSpread>(w, ldw, xr, ldx, yr, ldy, K, bias, lo(b), lo(b + 1));
  }
}

// MARS_PF_SPREAD=1: with several column blocks per tile (a prefill, a wide batch), each block prefetches a share
// of the next tile's rows instead of the first one all of them.  All at once, the prefetches wait for line fill
// buffers while the arithmetic of the other blocks has no memory traffic to hide, so a wide pass costs its
// arithmetic plus the weight stream instead of the larger of the two.
template <int R, int MB, typename T = float>
inline void rows_all_columns(const T* w, int64_t ldw, const float* x, int64_t ldx, float* y, int64_t ldy,
                             int64_t M, int64_t K, const float* bias) {
  if (MARS_PF_SPREAD && M > MB)
    blocks_of_columns<R, MB, T, true>(w, ldw, x, ldx, y, ldy, M, K, bias);
  else
    blocks_of_columns<R, MB, T, false>(w, ldw, x, ldx, y, ldy, M, K, bias);
}

// The low-rank product of a LoRA's up factor B [N, r], low[c][t] = sum_j B[t][j] a[c][j], for rows t in [t0, t1)
// and the columns c < C.  Each element is one FMA chain over j ascending from zero, vectorised across rows (lanes
// are rows), so no horizontal sums: with r = 16-64 a dot product per element would spend most of its time in
// them.  B is read packed in panels of kPanel rows, [ceil(N / kPanel), r, kPanel] zero-padded (pack_lowrank), so
// each panel is one contiguous stream.  Part-panels take single vectors, then a scalar tail that runs the same chain (a
// vector FMA lane and std::fma round alike).  kAdd: y[c][t] = y[c][t] + low * scaling (peft's order, the product
// rounded on its own); else y[c][t] = low.
constexpr int64_t kPanelVecs = 4;
constexpr int64_t kPanel = kPanelVecs * kLanes;
// Columns per register block: C x kPanelVecs accumulators + kPanelVecs factor vectors + 1 broadcast must fit the
// registers (32 zmm: 4 x 4 + 5; 16 ymm: 2 x 4 + 5).
#ifdef __AVX512F__
constexpr int kLowrankColumns = 4;
#else
constexpr int kLowrankColumns = 2;
#endif

template <int C, int V, bool kAdd, typename T>
inline void lowrank_block(const T* __restrict panel, const float* __restrict a, int64_t r, float* const* y,
                          int64_t t, float scaling) {
  Vec acc[C][V];
  for (int c = 0; c < C; ++c)
    for (int v = 0; v < V; ++v) acc[c][v] = vzero();
  for (int64_t j = 0; j < r; ++j) {
    Vec b[V];
    for (int v = 0; v < V; ++v) b[v] = vload(panel + j * kPanel + v * kLanes);
    for (int c = 0; c < C; ++c) {
      const Vec av = vset1(a[c * r + j]);
      for (int v = 0; v < V; ++v) acc[c][v] = vfma(b[v], av, acc[c][v]);
    }
  }
  const Vec sv = vset1(scaling);
  for (int c = 0; c < C; ++c)
    for (int v = 0; v < V; ++v) {
      float* p = y[c] + t + v * kLanes;
      vstore(p, kAdd ? vadd(vload(p), vmul(acc[c][v], sv)) : acc[c][v]);
    }
}

template <int V, bool kAdd, typename T>
inline void lowrank_columns(const T* panel, const float* a, int64_t r, float* const* y, int64_t C, int64_t t,
                            float scaling) {
  int64_t c = 0;
  for (; c + kLowrankColumns <= C; c += kLowrankColumns)
    lowrank_block<kLowrankColumns, V, kAdd, T>(panel, a + c * r, r, y + c, t, scaling);
  switch (C - c) {
    case 3: lowrank_block<3, V, kAdd, T>(panel, a + c * r, r, y + c, t, scaling); break;
    case 2: lowrank_block<2, V, kAdd, T>(panel, a + c * r, r, y + c, t, scaling); break;
    case 1: lowrank_block<1, V, kAdd, T>(panel, a + c * r, r, y + c, t, scaling); break;
    default: break;
  }
}

template <bool kAdd, typename T>
void lowrank_rows(const T* packed, const float* a, int64_t r, float* const* y, int64_t C, int64_t t0, int64_t t1,
                  float scaling) {
  int64_t t = t0;
  while (t < t1) {
    const int64_t p = t / kPanel, stop = std::min(t1, (p + 1) * kPanel);
    const T* panel = packed + p * r * kPanel;
    if (t == p * kPanel && stop - t == kPanel) {
      lowrank_columns<kPanelVecs, kAdd, T>(panel, a, r, y, C, t, scaling);
      t = stop;
      continue;
    }
    for (; t + kLanes <= stop; t += kLanes)
      lowrank_columns<1, kAdd, T>(panel + (t - p * kPanel), a, r, y, C, t, scaling);
    for (; t < stop; ++t)
      for (int64_t c = 0; c < C; ++c) {
        float s = 0.0f;
        for (int64_t j = 0; j < r; ++j) s = std::fma(to_float(panel[j * kPanel + (t - p * kPanel)]), a[c * r + j], s);
        if (kAdd) {
          const float low_rank = s * scaling;
          y[c][t] = y[c][t] + low_rank;
        } else {
          y[c][t] = s;
        }
      }
  }
}

// One weight of a pass (small_linear: the only one; fused_linear: one of its group): the weight as the kernel reads
// it (FusedWeight, small_gemm.h), its output, and where its rows start in the pass's block numbering (set by
// run_blocks).
struct Segment : FusedWeight {
  float* y = nullptr;
  int64_t first_block = 0;
};

// a [ncols, r] = the r rows of a LoRA down factor A [r, K] times the adapted columns xm [ncols, K], R rows at a time.
// A tile prefetches only the factor's own rows ahead of it: a rank-8 factor is one tile, and the tile ahead of it,
// which a weight's tile would prefetch, is whatever memory follows the factor (kilobytes of useless traffic per
// segment, for every adapted segment of a step).
template <int R, int MB, typename T>
void down_products(const T* A, int64_t r, int64_t K, const float* xm, int64_t ncols, float* a) {
  auto rows_ahead = [&](int64_t t, int64_t rows) { return std::clamp<int64_t>(r - t - MARS_PF * rows, 0, rows); };
  int64_t t = 0;
  for (; t + R <= r; t += R)
    blocks_of_columns<R, MB, T, true>(A + t * K, K, xm, K, a + t, r, ncols, K, nullptr, rows_ahead(t, R));
  for (; t < r; ++t)
    blocks_of_columns<1, MB, T, true>(A + t * K, K, xm, K, a + t, r, ncols, K, nullptr, rows_ahead(t, 1));
}

// One parallel pass over a group's weight rows (R per block); then, where the group has a gated LoRA, each
// thread adds the low-rank terms to the rows it computed.  The down products a = A x (r rows of A at the adapted
// columns: a few KB) are computed by each thread for the segments it touches, after its weight rows, so no
// thread waits for another (computed once as blocks of the pass, they would make every other thread wait for the
// one computing them).  Every element keeps its operation sequence, so the result does not depend on which thread
// computes what.
// MARS_LORA_PF=1: before a thread's low-rank work on a segment, the factor bytes it reads (prefetch_factors) are
// fetched in one burst, so that their misses overlap instead of following the down products' loop.
// The factor bytes a thread reads for segment g's rows [t0, t1): A whole, and B's panels of those rows.
inline void prefetch_factors(const Segment& g, int64_t K, int64_t t0, int64_t t1) {
  const char* a = static_cast<const char*>(g.lora_down);
  const int64_t a_bytes = g.r * K * (g.down_bf16 ? 2 : 4);
  for (int64_t off = 0; off < a_bytes; off += 64) _mm_prefetch(a + off, _MM_HINT_T0);
  const int64_t esize = g.up_bf16 ? 2 : 4, panel_bytes = g.r * kPanel * esize;
  const char* b = static_cast<const char*>(g.lora_up) + (t0 / kPanel) * panel_bytes;
  const int64_t b_bytes = ((t1 + kPanel - 1) / kPanel - t0 / kPanel) * panel_bytes;
  for (int64_t off = 0; off < b_bytes; off += 64) _mm_prefetch(b + off, _MM_HINT_T0);
}

template <int R, int MB, bool kLora>
void run_segments(const std::vector<Segment>& segs, const float* x, int64_t M, int64_t K, const float* xm,
                  const int64_t* cols, int64_t ncols, int64_t blocks, int64_t grain) {
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    // the rows [t0, t1) of segment g this thread computes (t0 >= t1: none)
    auto rows_of = [&](const Segment& g) {
      const int64_t lo = std::max(begin, g.first_block), hi = std::min(end, g.first_block + (g.n + R - 1) / R);
      return std::make_pair((lo - g.first_block) * R, std::min<int64_t>((hi - g.first_block) * R, g.n));
    };
    size_t s = 0;  // the segment of the current block
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
    }
    if (!kLora || ncols == 0) return;
    thread_local std::vector<float> a;  // one segment's down products [ncols, r] (kept: no allocation per pass)
    float* cols_y[kMaxColumns];
    for (const Segment& g : segs) {
      const auto [t0, t1] = rows_of(g);
      if (g.lora_down == nullptr || t0 >= t1) continue;
      if (MARS_LORA_PF) prefetch_factors(g, K, t0, t1);
      a.resize(static_cast<size_t>(ncols * g.r));
      if (g.down_bf16)
        down_products<R, MB>(static_cast<const uint16_t*>(g.lora_down), g.r, K, xm, ncols, a.data());
      else
        down_products<R, MB>(static_cast<const float*>(g.lora_down), g.r, K, xm, ncols, a.data());
      for (int64_t c = 0; c < ncols; ++c) cols_y[c] = g.y + cols[c] * g.n;
      if (g.up_bf16)
        lowrank_rows<true>(static_cast<const uint16_t*>(g.lora_up), a.data(), g.r, cols_y, ncols, t0, t1, g.scaling);
      else
        lowrank_rows<true>(static_cast<const float*>(g.lora_up), a.data(), g.r, cols_y, ncols, t0, t1, g.scaling);
    }
  });
}

// Rows per weight block by the number of columns (1 column: MARS_R1 rows; 2: MARS_R2 x 2; 3: MARS_R3 x 3 where set;
// more: MARS_R x MARS_MB), the blocks numbered across the segments, and one parallel pass over them.
template <int R, int MB>
void run_blocks(std::vector<Segment>& segs, const float* x, int64_t M, int64_t K, const float* xm,
                const int64_t* cols, int64_t ncols, int64_t grain) {
  int64_t blocks = 0;
  bool lora = false;
  for (Segment& g : segs) {
    g.first_block = blocks;
    blocks += (g.n + R - 1) / R;
    lora = lora || g.lora_down != nullptr;
  }
  if (lora && ncols > 0)
    run_segments<R, MB, true>(segs, x, M, K, xm, cols, ncols, blocks, grain);
  else  // no adapter in this pass: the plain loop
    run_segments<R, MB, false>(segs, x, M, K, xm, cols, 0, blocks, grain);
}

void run_all(std::vector<Segment>& segs, const float* x, int64_t M, int64_t K, const float* xm, const int64_t* cols,
             int64_t ncols) {
  // Rows per task: about 64 KB of weights, so a thread gets a long sequential stream per task.
  const int64_t grain = std::max<int64_t>(1, (16384 / std::max<int64_t>(K, 1)) / 4);
  if (M == 1) {
    run_blocks<MARS_R1, 1>(segs, x, M, K, xm, cols, ncols, grain / 2 + 1);
  } else if (M == 2) {
    run_blocks<MARS_R2, 2>(segs, x, M, K, xm, cols, ncols, grain);
#if MARS_R3 > 0
  } else if (M == 3) {
    run_blocks<MARS_R3, 3>(segs, x, M, K, xm, cols, ncols, grain);
#endif
  } else {
    run_blocks<MARS_R, MARS_MB>(segs, x, M, K, xm, cols, ncols, grain);
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
  std::vector<Segment> one(1);
  one[0].w = wc.data_ptr<float>();
  one[0].bias = bp;
  one[0].n = N;
  one[0].k = K;
  one[0].y = y.data_ptr<float>();
  run_all(one, xc.data_ptr<float>(), M, K, nullptr, nullptr, 0);
  return y;
}

namespace {

// LoRA factors stream as float32 or as bfloat16 (widened exactly on load: see tile)
bool is_factor_dtype(const at::Tensor& t) { return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16; }

// Whether `packed` is an up factor with N rows and rank r as pack_lowrank lays it out.
bool packed_fits(const at::Tensor& packed, int64_t N, int64_t r) {
  return packed.dim() == 3 && packed.size(0) == (N + kPanel - 1) / kPanel && packed.size(1) == r &&
         packed.size(2) == kPanel;
}

at::Tensor pack_up(const at::Tensor& weight) {
  const int64_t N = weight.size(0), r = weight.size(1), panels = (N + kPanel - 1) / kPanel;
  at::Tensor padded = at::zeros({panels * kPanel, r}, weight.options());
  padded.slice(0, 0, N).copy_(weight);
  return padded.view({panels, kPanel, r}).transpose(1, 2).contiguous();
}

}  // namespace

// A LoRA up factor B [N, r] in the layout fused_linear reads it: panels of kPanel rows, [ceil(N / kPanel), r,
// kPanel], zero-padded, in the factor's dtype (float32, or bfloat16 for a factor whose values are bf16 numbers).
// kPanel depends on the build (4 vectors), so callers take this op's output as is.
at::Tensor pack_lowrank(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && is_factor_dtype(weight) && weight.dim() == 2,
              "mars::pack_lowrank: a float32 or bfloat16 CPU matrix only, got ", weight.sizes(), " ",
              weight.scalar_type());
  return pack_up(weight);
}

// A LoRA's up product, x [..., r] @ weight[N, r]^T -> [..., N], in the order fused_linear adds it at adapted
// columns (lowrank_rows: one FMA chain over r per element, across rows), so that a model's own forward, with its
// LoRA up factors through this op, and the fused decode pass give the same bits.  `weight` is the factor [N, r]
// (packed per call) or already packed by pack_lowrank, with its row count N as `rows`.
at::Tensor lowrank_linear(const at::Tensor& x, const at::Tensor& weight, c10::optional<int64_t> rows) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && x.scalar_type() == at::kFloat &&
                  is_factor_dtype(weight),
              "mars::lowrank_linear: a float32 CPU input and a float32 or bfloat16 factor only");
  const bool is_packed = weight.dim() == 3;
  TORCH_CHECK(is_packed ? rows.has_value() && packed_fits(weight, *rows, x.size(-1))
                        : weight.dim() == 2 && x.size(-1) == weight.size(1),
              "mars::lowrank_linear: shapes ", x.sizes(), " and ", weight.sizes(), " do not match",
              is_packed ? " (a packed factor needs its row count)" : "");
  const int64_t r = weight.size(1), N = is_packed ? *rows : weight.size(0);
  const at::Tensor xc = x.reshape({-1, r}).contiguous();
  const at::Tensor packed = is_packed ? weight.contiguous() : pack_up(weight);
  const int64_t M = xc.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  at::Tensor y = at::empty(out_shape, x.options());
  if (M == 0) return y;
  const float* ap = xc.data_ptr<float>();
  const bool bf16 = packed.scalar_type() == at::kBFloat16;
  const void* bp = packed.data_ptr();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (N + kPanel - 1) / kPanel, 4, [&](int64_t begin, int64_t end) {
    for (int64_t m = 0; m < M; m += kMaxColumns) {
      const int64_t C = std::min<int64_t>(kMaxColumns, M - m);
      float* rows[kMaxColumns];
      for (int64_t c = 0; c < C; ++c) rows[c] = yp + (m + c) * N;
      const int64_t t0 = begin * kPanel, t1 = std::min<int64_t>(end * kPanel, N);
      if (bf16)
        lowrank_rows<false>(static_cast<const uint16_t*>(bp), ap + m * r, r, rows, C, t0, t1, 1.0f);
      else
        lowrank_rows<false>(static_cast<const float*>(bp), ap + m * r, r, rows, C, t0, t1, 1.0f);
    }
  });
  return y;
}

// Several linears of one input in one pass: outputs[i] = x @ weights[i]^T + biases[i], and where
// lora_a[i] is given, + (lora_b[i]^T @ (lora_a[i] @ x^T)) * scalings[i] at the rows `columns` of x only
// (a gated LoRA acting at mask columns; lora_b[i] is the up factor B packed by pack_lowrank, once, by
// the caller).  One parallel region for the whole group instead of one per matmul: at batch 1 a decode
// step is hundreds of small matmuls, and each region costs a thread wake-up.  Every output element is the
// same sequence of operations as small_linear (and, for the LoRA term, as small_linear of the down factor,
// lowrank_linear of the up factor, then peft's scaling and sum), so results are bit-identical.  The factors may be
// bfloat16 where their values are bf16 numbers (half the bytes to stream; the same products, since a bf16 widens
// to fp32 exactly).
std::vector<at::Tensor> fused_linear(const at::Tensor& x, at::TensorList weights,
                                     const c10::List<c10::optional<at::Tensor>>& biases,
                                     const c10::List<c10::optional<at::Tensor>>& lora_a,
                                     const c10::List<c10::optional<at::Tensor>>& lora_b, at::ArrayRef<double> scalings,
                                     const c10::optional<at::Tensor>& columns) {
  // the factors are read (and checked) only where the adapter acts: at given columns
  const bool adapted = columns.has_value() && columns->defined() && columns->numel() > 0;
  static const c10::List<c10::optional<at::Tensor>> none;
  std::vector<at::Tensor> keep;
  const std::vector<FusedWeight> prepared =
      prepare_fused(weights, biases, adapted ? lora_a : none, adapted ? lora_b : none,
                    adapted ? scalings : at::ArrayRef<double>(), keep);
  return fused_linear_prepared(x, prepared, columns);
}

std::vector<FusedWeight> prepare_fused(at::TensorList weights, const c10::List<c10::optional<at::Tensor>>& biases,
                                       const c10::List<c10::optional<at::Tensor>>& lora_a,
                                       const c10::List<c10::optional<at::Tensor>>& lora_b,
                                       at::ArrayRef<double> scalings, std::vector<at::Tensor>& keep) {
  const size_t count = weights.size();
  TORCH_CHECK(count > 0 && biases.size() == count, "mars::fused_linear: one bias entry per weight");
  const bool has_lora = lora_a.size() > 0;
  TORCH_CHECK(!has_lora || (lora_a.size() == count && lora_b.size() == count && scalings.size() == count),
              "mars::fused_linear: lora_a, lora_b and scalings need one entry per weight");
  const int64_t K = weights[0].dim() == 2 ? weights[0].size(1) : -1;
  std::vector<FusedWeight> prepared(count);
  for (size_t i = 0; i < count; ++i) {
    const at::Tensor& w = weights[i];
    TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 2 && w.size(1) == K,
                "mars::fused_linear: weight ", i, " must be float32 [N, ", K, "], got ", w.sizes());
    keep.push_back(w.contiguous());
    FusedWeight& g = prepared[i];
    g.w = keep.back().data_ptr<float>();
    g.n = w.size(0);
    g.k = K;
    const c10::optional<at::Tensor> bias = biases.get(i);
    if (bias.has_value() && bias->defined()) {
      TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kFloat && bias->numel() == g.n,
                  "mars::fused_linear: bad bias ", i);
      keep.push_back(bias->contiguous());
      g.bias = keep.back().data_ptr<float>();
    }
    const c10::optional<at::Tensor> A = has_lora ? lora_a.get(i) : c10::nullopt;
    if (A.has_value() && A->defined()) {
      const c10::optional<at::Tensor> B = lora_b.get(i);
      TORCH_CHECK(B.has_value() && B->defined(), "mars::fused_linear: lora_a ", i, " without lora_b");
      const at::Tensor Ac = A->contiguous(), Bc = B->contiguous();
      const int64_t r = Ac.size(0);
      TORCH_CHECK(Ac.device().is_cpu() && Bc.device().is_cpu() && is_factor_dtype(Ac) && Ac.dim() == 2 &&
                      Ac.size(1) == K && is_factor_dtype(Bc) && packed_fits(Bc, g.n, r),
                  "mars::fused_linear: LoRA factors ", i, " ", Ac.sizes(), " and ", Bc.sizes(),
                  " (packed by pack_lowrank) do not fit");
      keep.push_back(Ac);
      keep.push_back(Bc);
      g.lora_down = Ac.data_ptr();
      g.lora_up = Bc.data_ptr();
      g.down_bf16 = Ac.scalar_type() == at::kBFloat16;
      g.up_bf16 = Bc.scalar_type() == at::kBFloat16;
      g.r = r;
      g.scaling = static_cast<float>(scalings[i]);
    }
  }
  return prepared;
}

std::vector<at::Tensor> fused_linear_prepared(const at::Tensor& x, const std::vector<FusedWeight>& weights,
                                              const c10::optional<at::Tensor>& columns) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, "mars::fused_linear: float32 CPU input only");
  TORCH_CHECK(!weights.empty(), "mars::fused_linear: no weights");
  const int64_t K = x.size(-1);
  TORCH_CHECK(weights[0].k == K, "mars::fused_linear: an input of width ", K, " for weights [N, ", weights[0].k, "]");
  const at::Tensor xc = x.reshape({-1, K}).contiguous();
  const int64_t M = xc.size(0);
  const bool has_lora =
      std::any_of(weights.begin(), weights.end(), [](const FusedWeight& w) { return w.lora_down != nullptr; });
  at::Tensor cols;
  int64_t ncols = 0;
  if (has_lora && columns.has_value() && columns->defined()) {
    // the decode step's mask rows are int64 already: no dispatch (a step makes 120 of these calls)
    cols = columns->scalar_type() == at::kLong && columns->is_contiguous() ? *columns
                                                                           : columns->to(at::kLong).contiguous();
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
  std::vector<at::Tensor> outputs;
  outputs.reserve(weights.size());
  std::vector<Segment> segs(weights.size());
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  for (size_t i = 0; i < weights.size(); ++i) {
    static_cast<FusedWeight&>(segs[i]) = weights[i];
    shape.back() = weights[i].n;
    outputs.push_back(at::empty(shape, x.options()));
    segs[i].y = outputs.back().data_ptr<float>();
  }
  if (M == 0) return outputs;
  run_all(segs, xc.data_ptr<float>(), M, K, xm, ncols > 0 ? cols.data_ptr<int64_t>() : nullptr, ncols);
  return outputs;
}

TORCH_LIBRARY(mars, m) {
  m.def("small_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("lowrank_linear(Tensor x, Tensor weight, int? rows=None) -> Tensor");
  m.def("pack_lowrank(Tensor weight) -> Tensor");
  m.def(
      "fused_linear(Tensor x, Tensor[] weights, Tensor?[] biases, Tensor?[] lora_a, Tensor?[] lora_b, float[] scalings, "
      "Tensor? columns) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(mars, CPU, m) {
  m.impl("small_linear", &small_linear);
  m.impl("lowrank_linear", &lowrank_linear);
  m.impl("pack_lowrank", &pack_lowrank);
  m.impl("fused_linear", &fused_linear);
}
