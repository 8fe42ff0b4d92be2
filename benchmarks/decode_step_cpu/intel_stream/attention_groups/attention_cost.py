"""A decode step's attention through the kernel (`mars::decode_attention`) at 1-3 query columns: SmolLM2-135M's
shapes (9 query heads over 3 KV heads, head dimension 64), 160 cached keys, 30 layers' caches, the step's causal
mask.  Median ms per 30 layers of 180 rounds after 20 warm-up rounds, each call made from Python (so about 5 us a
call of the figure is the call itself):

    T=2 python benchmarks/decode_step_cpu/intel_stream/attention_groups/attention_cost.py

T: threads (default: this machine's setting).  To compare two sources, copy each over
src/mars/kernels/decode_attention.cpp in turn (each source is its own cached build) and alternate.
"""

import os

from mars.threads import apply_process_defaults

apply_process_defaults()

import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from mars.kernels import decode_attention_op  # noqa: E402
from mars.threads import configure_threads  # noqa: E402

LENGTH, CAPACITY, LAYERS = 160, 256, 30


def main() -> None:
    configure_threads(os.environ.get("T", "auto"))
    op = decode_attention_op()
    torch.manual_seed(0)
    keys = [torch.randn(1, 3, CAPACITY, 64) for _ in range(LAYERS)]
    values = [torch.randn(1, 3, CAPACITY, 64) for _ in range(LAYERS)]
    ms = {}
    for columns in (1, 2, 3):
        query = torch.randn(1, 9, columns, 64)
        positions = torch.arange(LENGTH - columns, LENGTH)
        mask = torch.arange(LENGTH).view(1, 1, 1, LENGTH) <= positions.view(1, 1, columns, 1)
        times = []
        for _ in range(200):
            start = time.perf_counter()
            for k, v in zip(keys, values):
                op(query, k[:, :, :LENGTH], v[:, :, :LENGTH], mask, 0.125)
            times.append(time.perf_counter() - start)
        ms[columns] = statistics.median(times[20:]) * 1e3
    print(f"{torch.get_num_threads()} threads: " + " ".join(f"{c} col {v:.3f} ms" for c, v in ms.items()))


if __name__ == "__main__":
    main()
