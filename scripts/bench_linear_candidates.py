#!/usr/bin/env python
"""Small-M fp32 GEMM candidates on the stack of a decoder's real linear shapes (cold weights).

The stack is what one decode step multiplies: per layer q, k, v, o, gate, up, down (SmolLM2-135M:
576x576, 192x576 twice, 576x576, 1536x576 twice, 576x1536; 30 layers) plus the LM head (49152x576), each
layer with its own weights so that nothing stays in cache between passes, as in a real step.  Every
candidate runs the whole stack at M = 1, 2, 4, 7, 8 columns; the figure is the median of ``--repeats``
passes, candidates interleaved in one process so that their ratios hold even on a busy machine.

    OMP_WAIT_POLICY=PASSIVE python scripts/bench_linear_candidates.py --threads 1 2 > out.md

Candidates: ``eager`` (F.linear: MKL sgemm), ``mkl_packed`` (torch.ops.mkl._mkl_linear with weights
prepacked by _mkl_reorder_linear_weight for that M), ``onednn_packed`` (torch.ops.mkldnn._linear_pointwise
with weights reordered by _reorder_linear_weight), ``small_gemm`` (mars.kernels: streams each weight row
once for all M columns), ``inductor`` (torch.compile max-autotune with the CPP GEMM template and
freezing; compiles for minutes per M, so only with ``--inductor``).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES_135M = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]


def make_stack(layers: int, head: int, hidden: int = 576) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, k, generator=g) * 0.02 for _ in range(layers) for n, k in SHAPES_135M]
    if head:
        ws.append(torch.randn(head, hidden, generator=g) * 0.02)
    return ws


def inputs_for(ws, m):
    return {k: torch.randn(m, k) for k in {w.shape[1] for w in ws}}


def runner_eager(ws, m):
    xs = inputs_for(ws, m)
    return lambda: [F.linear(xs[w.shape[1]], w) for w in ws]


def runner_small_gemm(ws, m):
    from mars.kernels import small_linear_op

    op = small_linear_op()
    xs = inputs_for(ws, m)
    return lambda: [op(xs[w.shape[1]], w, None) for w in ws]


def runner_mkl_packed(ws, m):
    xs = inputs_for(ws, m)
    packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, m) for w in ws]
    op = torch.ops.mkl._mkl_linear
    return lambda: [op(xs[w.shape[1]], p, w, None, m) for w, p in zip(ws, packed)]


def runner_onednn_packed(ws, m):
    xs = inputs_for(ws, m)
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, m) for w in ws]
    op = torch.ops.mkldnn._linear_pointwise
    return lambda: [op(xs[w.shape[1]], p, None, "none", [], "") for w, p in zip(ws, packed)]


def runner_inductor(ws, m):
    import torch._inductor.config as cfg

    cfg.max_autotune = True
    cfg.max_autotune_gemm_backends = "CPP,ATEN"
    cfg.freezing = True

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ws = torch.nn.ParameterList([torch.nn.Parameter(w, requires_grad=False) for w in ws])

        def forward(self, xs: dict[int, torch.Tensor]):
            return [F.linear(xs[w.shape[1]], w) for w in self.ws]

    mod = torch.compile(Stack().eval())
    xs = inputs_for(ws, m)
    with torch.no_grad():
        mod(xs)
    return lambda: mod(xs)


RUNNERS = {
    "eager": runner_eager,
    "mkl_packed": runner_mkl_packed,
    "onednn_packed": runner_onednn_packed,
    "small_gemm": runner_small_gemm,
    "inductor": runner_inductor,
}


def weights_bytes(ws) -> int:
    return sum(w.numel() * w.element_size() for w in ws)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--columns", type=int, nargs="+", default=[1, 2, 4, 7, 8])
    p.add_argument("--candidates", nargs="+", default=["eager", "mkl_packed", "onednn_packed", "small_gemm"])
    p.add_argument("--inductor", action="store_true", help="add the inductor candidate (minutes of compile per M)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--head", type=int, default=49152)
    args = p.parse_args()
    names = list(args.candidates) + (["inductor"] if args.inductor and "inductor" not in args.candidates else [])
    ws = make_stack(args.layers, args.head)
    nbytes = weights_bytes(ws)
    flops_per_col = 2 * sum(w.numel() for w in ws)
    print(f"# small-M GEMM candidates: stack of {len(ws)} linear layers, {nbytes / 1e6:.0f} MB fp32 weights\n")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, ")
    print(f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}; median of {args.repeats} passes, ms\n")
    print(
        "| threads | candidate | " + " | ".join(f"M={m}" for m in args.columns) + " | M=4/M=1 | M=8/M=1 | GB/s at M=1 |"
    )
    print("|---|---|" + "---|" * (len(args.columns) + 3))
    with torch.inference_mode():
        for threads in args.threads:
            torch.set_num_threads(threads)
            results = {name: {} for name in names}
            for m in args.columns:
                fns = {name: RUNNERS[name](ws, m) for name in names}
                for fn in fns.values():
                    fn()  # warm-up
                times = {name: [] for name in names}
                for _ in range(args.repeats):
                    for name, fn in fns.items():
                        start = time.perf_counter()
                        fn()
                        times[name].append(time.perf_counter() - start)
                for name in names:
                    results[name][m] = statistics.median(times[name]) * 1e3
                del fns
            for name in names:
                r = results[name]
                cells = " | ".join(f"{r[m]:.1f}" for m in args.columns)
                ratio4 = f"{r[4] / r[1]:.2f}" if 4 in r and 1 in r else "-"
                ratio8 = f"{r[8] / r[1]:.2f}" if 8 in r and 1 in r else "-"
                gbs = f"{nbytes / r[1] / 1e6:.1f}" if 1 in r else "-"
                print(f"| {threads} | {name} | {cells} | {ratio4} | {ratio8} | {gbs} |", flush=True)
    print(f"\nGFLOP per column: {flops_per_col / 1e9:.3f}")


if __name__ == "__main__":
    main()
