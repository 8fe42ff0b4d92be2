"""Would a weight layout the hardware prefetcher can follow let a step's extra columns hide behind the weight
stream?  A stripped copy of the kernel's tile (R weight rows x M columns, one FMA chain per output element, the
Intel build's prefetch one tile ahead) runs one SmolLM2-135M step's projections (30 layers of random weights,
425 MB, cold) over the weights as nn.Linear stores them (row-major: R interleaved row streams per tile) and over
the same weights packed tile by tile ([K / 16][R][16]: one sequential stream, prefetched 0 / 1 / 4 KB ahead).
Both give the same bits (checked).  The kernel itself (`small_linear`, called per weight from Python) runs
beside them.  Median ms of 7 interleaved rounds, 2 threads:

    python benchmarks/decode_step_cpu/intel_stream/column_overlap/layout_ab.py
"""

from mars.threads import apply_process_defaults

apply_process_defaults()

import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch.utils.cpp_extension import load_inline  # noqa: E402

import mars.kernels  # noqa: E402
from mars.kernels import small_linear_op  # noqa: E402
from mars.threads import configure_threads  # noqa: E402

SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include "simd.h"
using namespace mars_simd;

// rows n .. n + R of a row-major weight, prefetched one tile ahead (the Intel build's MARS_PF=1)
template <int R, int M>
inline void tile_rows(const float* w, int64_t K, const float* x, float* y, int64_t N) {
  Vec acc[R][M];
  for (int r = 0; r < R; ++r) for (int m = 0; m < M; ++m) acc[r][m] = vzero();
  for (int64_t k = 0; k < K; k += kLanes) {
    for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + (r + R) * K + k), _MM_HINT_T0);
    Vec xv[M];
    for (int m = 0; m < M; ++m) xv[m] = vload(x + m * K + k);
    for (int r = 0; r < R; ++r) {
      const Vec wv = vload(w + r * K + k);
      for (int m = 0; m < M; ++m) acc[r][m] = vfma(wv, xv[m], acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r) for (int m = 0; m < M; ++m) y[m * N + r] = vsum(acc[r][m]);
}

// the same tile from a packed weight: [K / kLanes][R][kLanes], read in order
template <int R, int M>
inline void tile_packed(const float* w, int64_t K, const float* x, float* y, int64_t N, int64_t ahead) {
  Vec acc[R][M];
  for (int r = 0; r < R; ++r) for (int m = 0; m < M; ++m) acc[r][m] = vzero();
  for (int64_t k = 0; k < K; k += kLanes) {
    const float* p = w + k * R;
    if (ahead > 0)
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(p + r * kLanes + ahead), _MM_HINT_T0);
    Vec xv[M];
    for (int m = 0; m < M; ++m) xv[m] = vload(x + m * K + k);
    for (int r = 0; r < R; ++r) {
      const Vec wv = vload(p + r * kLanes);
      for (int m = 0; m < M; ++m) acc[r][m] = vfma(wv, xv[m], acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r) for (int m = 0; m < M; ++m) y[m * N + r] = vsum(acc[r][m]);
}

template <int R, int M>
void pass(const float* w, int64_t N, int64_t K, const float* x, float* y, bool packed, int64_t ahead) {
  at::parallel_for(0, N / R, std::max<int64_t>(1, (16384 / K) / 4), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      if (packed) tile_packed<R, M>(w + b * R * K, K, x, y + b * R, N, ahead);
      else tile_rows<R, M>(w + b * R * K, K, x, y + b * R, N);
    }
  });
}

// every weight of `weights` ([N, K] each; packed ones keep that shape) against the first M rows of x576 / x1536
void run(std::vector<at::Tensor> weights, at::Tensor x576, at::Tensor x1536, at::Tensor y, int64_t M, int64_t R,
         bool packed, int64_t ahead) {
  for (const at::Tensor& w : weights) {
    const int64_t N = w.size(0), K = w.size(1);
    const float* x = (K == 1536 ? x1536 : x576).data_ptr<float>();
    const float* wp = w.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    if (R == 4 && M == 1) pass<4, 1>(wp, N, K, x, yp, packed, ahead);
    else if (M == 1) pass<8, 1>(wp, N, K, x, yp, packed, ahead);
    else if (M == 2) pass<8, 2>(wp, N, K, x, yp, packed, ahead);
    else pass<8, 3>(wp, N, K, x, yp, packed, ahead);
  }
}
"""

SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
FLAGS = ["-O3", "-mavx2", "-mfma", "-mavx512f", "-fopenmp", "-DNDEBUG", "-ffp-contract=off"]


def pack(w: torch.Tensor, rows: int = 8) -> torch.Tensor:
    n, k = w.shape
    return w.view(n // rows, rows, k // 16, 16).transpose(1, 2).contiguous().view(n, k)


def main(rounds: int = 7) -> None:
    configure_threads("auto")
    ext = load_inline(
        "mars_layout_ab",
        cpp_sources=SOURCE,
        functions=["run"],
        extra_cflags=FLAGS,
        extra_include_paths=[str(Path(mars.kernels.__file__).parent)],
    )
    op = small_linear_op()
    torch.manual_seed(0)
    rows = [torch.randn(n, k) for _ in range(30) for n, k in SHAPES]
    packed = [pack(w) for w in rows]
    x576, x1536, y = torch.randn(3, 576), torch.randn(3, 1536), torch.empty(3 * 1536)
    inputs = {m: (torch.randn(m, 576), torch.randn(m, 1536)) for m in (1, 2, 3)}
    check = torch.empty(3 * 1536)
    ext.run(rows[:1], x576, x1536, y, 3, 8, False, 0)
    ext.run(packed[:1], x576, x1536, check, 3, 8, True, 0)
    assert torch.equal(y[: 3 * 576], check[: 3 * 576]), "the packed layout changed the bits"

    def kernel(m):
        a, b = inputs[m]
        for w in rows:
            op(b if w.shape[1] == 1536 else a, w, None)

    variants = {}
    for m in (1, 2, 3):
        variants[f"small_linear per weight, {m} col"] = lambda m=m: kernel(m)
        variants[f"row-major, 8 rows, {m} col"] = lambda m=m: ext.run(rows, x576, x1536, y, m, 8, False, 0)
        if m == 1:
            variants["row-major, 4 rows, 1 col"] = lambda: ext.run(rows, x576, x1536, y, 1, 4, False, 0)
        for ahead in (0, 1024, 4096):
            variants[f"packed, 8 rows, {m} col, prefetch {ahead // 256} KB"] = lambda m=m, a=ahead: ext.run(
                packed, x576, x1536, y, m, 8, True, a
            )
    times: dict = {}
    with torch.inference_mode():
        for _ in range(2):
            for run in variants.values():
                run()
        for _ in range(rounds):
            for name, run in variants.items():
                start = time.perf_counter()
                run()
                times.setdefault(name, []).append(time.perf_counter() - start)
    mb = sum(w.numel() for w in rows) * 4 / 1e6
    print(f"{torch.get_num_threads()} threads, {mb:.0f} MB, median of {rounds}")
    print("| variant | ms | GB/s |")
    print("|---|---|---|")
    for name, v in times.items():
        ms = statistics.median(v) * 1e3
        print(f"| {name} | {ms:.2f} | {mb / ms:.1f} |")


if __name__ == "__main__":
    main()
