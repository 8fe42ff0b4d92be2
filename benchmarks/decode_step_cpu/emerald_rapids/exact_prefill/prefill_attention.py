"""A prefill's attention through mars::decode_attention against SDPA's CPU flash kernel (SmolLM2-135M's 9 query and
3 KV heads of 64, causal additive mask, one layer, 2 threads): microseconds per call (median of 30), the largest
difference between the two, and whether each gives the first L-2 queries the same bits alone as beside 2 more
(lossless verify prefills the prompt with two masks after it, AR the prompt alone).

    python benchmarks/decode_step_cpu/emerald_rapids/exact_prefill/prefill_attention.py
"""

import statistics
import time

import torch
import torch.nn.functional as F

from mars.kernels import decode_attention_op
from mars.threads import configure_threads

configure_threads("auto")
op = decode_attention_op()
torch.manual_seed(0)
H, KV, D = 9, 3, 64


def kernel(q, k, v, mask, n):
    return op(q[:, :, :n], k[:, :, :n], v[:, :, :n], mask[..., :n, :n], 0.125)


def sdpa(q, k, v, mask, n):
    q, k, v, mask = q[:, :, :n], k[:, :, :n], v[:, :, :n], mask[..., :n, :n]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True)


print("| queries | kernel us | SDPA us | max difference | kernel: same bits with 2 more | SDPA: same bits |")
print("|---|---|---|---|---|---|")
for L in (24, 40, 64, 100, 150, 207, 400, 800):
    inputs = (torch.randn(1, H, L, D), torch.randn(1, KV, L, D), torch.randn(1, KV, L, D))
    inputs += (torch.full((L, L), float("-inf")).triu(1)[None, None],)
    diff = (kernel(*inputs, L) - sdpa(*inputs, L)).abs().max().item()
    same = [torch.equal(f(*inputs, L - 2), f(*inputs, L)[:, :, : L - 2]) for f in (kernel, sdpa)]
    times = {kernel: [], sdpa: []}
    for _ in range(30):
        for f, spent in times.items():
            t = time.perf_counter()
            f(*inputs, L)
            spent.append(time.perf_counter() - t)
    k_us, s_us = (statistics.median(spent) * 1e6 for spent in times.values())
    print(f"| {L} | {k_us:.0f} | {s_us:.0f} | {diff:.1e} | {same[0]} | {same[1]} |", flush=True)
