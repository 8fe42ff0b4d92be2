"""SDPA alone for 1-8 query rows over 150 cached keys (SmolLM2-135M shapes: 9 query heads, 3 KV heads, dim 64): the
CPU flash kernel with an additive or boolean mask, the math kernel, repeated KV, and the heads of a KV head folded
into one query (microseconds per call, median of 5 x 400)."""

import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

KEYS, HEADS, KV_HEADS, DIM, SCALE = 150, 9, 3, 64, 0.125


def bench(fn, n: int = 400) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - start) / n)
    return 1e6 * statistics.median(times)


def variants(rows: int) -> dict:
    q, k, v = torch.randn(1, HEADS, rows, DIM), torch.randn(1, KV_HEADS, KEYS, DIM), torch.randn(1, KV_HEADS, KEYS, DIM)
    pos = KEYS - rows + torch.arange(rows)
    allowed = (torch.arange(KEYS).view(1, -1) <= pos.view(-1, 1)).view(1, 1, rows, KEYS)
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    group = HEADS // KV_HEADS
    k_rep, v_rep = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    folded_q = q.reshape(1, KV_HEADS, group * rows, DIM)  # the heads of a KV head as rows of one query
    folded_mask = additive.repeat(1, 1, group, 1)

    def sdpa(query, key, value, mask, gqa=True):
        return lambda: F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=SCALE, enable_gqa=gqa)

    out = {
        "flash add": bench(sdpa(q, k, v, additive)),
        "flash bool": bench(sdpa(q, k, v, allowed)),
        "flash add, repeated kv": bench(sdpa(q, k_rep, v_rep, additive, False)),
        "flash add, heads folded": bench(sdpa(folded_q, k, v, folded_mask, False)),
    }
    with sdpa_kernel(SDPBackend.MATH):
        out["math add"] = bench(sdpa(q, k, v, additive))
    return out


if __name__ == "__main__":
    torch.set_num_threads(2)
    for rows in (1, 2, 3, 4, 8):
        print(rows, {name: round(us, 1) for name, us in variants(rows).items()}, flush=True)
