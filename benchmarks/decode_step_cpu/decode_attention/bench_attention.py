"""One layer's attention of a decode step, SDPA (CPU flash kernel, grouped heads in place) against
mars::decode_attention, on SmolLM2-135M's shapes (9 query heads over 3 KV heads, head dim 64), KV cache slices
of a longer buffer as the engine hands them, a causal additive mask; microseconds per call (median of 5 runs
of 400 calls), max |difference| and whether each column equals its computation alone (column invariance).

    GOMP_SPINCOUNT=3000 python benchmarks/decode_step_cpu/decode_attention/bench_attention.py --threads 2
"""

import argparse
import functools
import statistics
import time

import torch
import torch.nn.functional as F

from mars.kernels import decode_attention_op


def per_call_us(fn, calls=400, runs=5):
    for _ in range(20):
        fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
    return 1e6 * statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lengths", default="150,500")
    parser.add_argument("--columns", default="1,2,3,4,8")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    op = decode_attention_op()
    print(f"threads {args.threads}; us per layer call (median)\n")
    print("| cached tokens | columns | SDPA | mars::decode_attention | ratio | max abs diff | column-invariant |")
    print("|---|---|---|---|---|---|---|")
    for length in map(int, args.lengths.split(",")):
        for columns in map(int, args.columns.split(",")):
            q = torch.randn(1, 9, columns, 64)
            k, v = (torch.randn(1, 3, 2048, 64)[:, :, :length] for _ in range(2))
            positions = length - columns + torch.arange(columns)
            visible = torch.arange(length).view(1, -1) <= positions.view(-1, 1)
            mask = torch.zeros(1, 1, columns, length).masked_fill(~visible.view(1, 1, columns, length), float("-inf"))
            sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True)
            ours = op(q, k, v, mask, 0.125)
            invariant = all(
                torch.equal(op(q[:, :, i : i + 1], k, v, mask[:, :, i : i + 1], 0.125), ours[:, :, i : i + 1])
                for i in range(columns)
            )
            t_sdpa = per_call_us(
                functools.partial(F.scaled_dot_product_attention, q, k, v, mask, scale=0.125, enable_gqa=True)
            )
            t_ours = per_call_us(functools.partial(op, q, k, v, mask, 0.125))
            diff = (ours - sdpa).abs().max().item()
            print(
                f"| {length} | {columns} | {t_sdpa:.1f} | {t_ours:.1f} | {t_ours / t_sdpa:.2f} | {diff:.1e} | "
                f"{'yes' if invariant else 'NO'} |"
            )


if __name__ == "__main__":
    main()
