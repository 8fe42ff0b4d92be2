"""The attention kernel with a step's query columns in one task per KV head (each key and value read once for all of
them) and the horizontal sums of a block of keys done together (`vsum_each`), against the kernel at a given git
revision (a task per query column, one sum per key), built beside it under the namespace ab_old: whether every output
is the same bits (decode steps and a prefill; additive, boolean and no mask; head dimensions 64, 128 and 40; 1-8
queries), then microseconds per call at SmolLM2-135M's shapes (9 query and 3 KV heads of 64, causal mask), median of
alternating calls: 1 and 3 query columns at 150, 500 and 1500 cached keys, and prefills of 207 and 800 tokens:

    python benchmarks/decode_step_cpu/emerald_rapids/attention_sums/sums_ab.py [revision, default HEAD]
"""

import statistics
import sys
import time

from mars.threads import apply_process_defaults

apply_process_defaults()

import torch  # noqa: E402

import mars.kernels as kernels  # noqa: E402
from mars.threads import configure_threads  # noqa: E402


def old_op(rev: str):
    kernels.load_revision(rev)
    return torch.ops.ab_old.decode_attention.default


def inputs(heads, kv, dim, queries, length, mask, g):
    q = torch.randn(1, heads, queries, dim, generator=g)
    k, v = (torch.randn(1, kv, length, dim, generator=g) for _ in range(2))
    visible = torch.arange(length).view(1, -1) <= (length - queries + torch.arange(queries)).view(-1, 1)
    visible = visible.view(1, 1, queries, length)
    if mask == "bool":
        return q, k, v, visible
    if mask == "additive":
        return q, k, v, torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
    return q[:, :, :1].contiguous(), k, v, None  # one query needs no mask


def main(rev: str = "HEAD") -> None:
    configure_threads("auto")
    new = kernels.decode_attention_op()
    old = old_op(rev)
    g = torch.Generator().manual_seed(0)
    cases = same = 0
    for heads, kv, dim in ((9, 3, 64), (4, 2, 128), (4, 4, 40)):
        for queries in (1, 2, 3, 8):
            for length in (7, 16, 33, 150, 1029):
                for mask in ("additive", "bool", "none"):
                    if length < queries:
                        continue
                    args = inputs(heads, kv, dim, queries, length, mask, g)
                    cases += 1
                    same += torch.equal(new(*args, 0.125), old(*args, 0.125))
    prefill = inputs(9, 3, 64, 207, 207, "additive", g)
    cases += 1
    same += torch.equal(new(*prefill, 0.125), old(*prefill, 0.125))
    print(f"same bits as {rev}: {same} of {cases} cases (decode steps, a 207-token prefill)\n")
    print(f"| cached keys | queries | {rev} (us) | now (us) | ratio |")
    print("|---|---|---|---|---|")
    for length, queries in ((150, 1), (150, 3), (500, 1), (500, 3), (1500, 1), (1500, 3), (0, 207), (0, 800)):
        args = inputs(9, 3, 64, queries, length + queries, "bool", g)
        times = {old: [], new: []}
        calls = 400 if length else 30
        for _ in range(calls // 8):
            for op in times:
                op(*args, 0.125)
        for _ in range(calls):
            for op in times:
                t = time.perf_counter()
                op(*args, 0.125)
                times[op].append(time.perf_counter() - t)
        before, after = (statistics.median(times[op]) * 1e6 for op in (old, new))
        print(f"| {length} | {queries} | {before:.1f} | {after:.1f} | {after / before:.2f} |", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
