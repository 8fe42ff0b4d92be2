"""What the engine's code costs right after a decode step has streamed the weights through the caches.

A batch-1 decode step reads every weight once (549 MB for SmolLM2-135M in fp32), more than this host's caches
hold, so the Python and ATen code that runs after the forward (choosing tokens, verifying drafts, bookkeeping)
starts from memory. Each snippet below is timed warm (right after itself) and right after a read of 549 MB (in
4 KB pages, and in 2 MB pages as the decoding weights are: TLB misses are not the cause) or of 20 MB (the caches
keep part of the working set); medians of 15, microseconds:

    python benchmarks/decode_step_cpu/intel_stream/cold_engine/cold_ops.py
"""

import statistics
import time

import numpy as np
import torch

from mars.decoding.huge_pages import place_tensors
from mars.threads import apply_process_defaults, configure_threads

apply_process_defaults()
configure_threads("auto")
torch.set_grad_enabled(False)

big_4k = torch.randn(549_000_000 // 4)
big_2m = big_4k.clone()
place_tensors([big_2m])
logits = torch.randn(1, 3, 49152)
tiny = torch.tensor([1, 2, 3])
flags = np.arange(3)


class Node:
    pass


node = Node()
node.child = Node()
node.child.value = 3

SNIPPETS = {
    "a Python call": lambda: None,
    "10 Python attribute reads": lambda: [node.child.value for _ in range(10)],
    "numpy any() on 3 values": lambda: flags.any(),
    "one tiny ATen op": lambda: torch.minimum(tiny, tiny),
    "5 tiny ATen ops": lambda: ((tiny + 1) * 2).clamp_max(3).where(tiny > 0, 0).sum(),
    "max(-1) over 3 x 49152 logits": lambda: logits.max(dim=-1),
}
BEFORE = {
    "warm": lambda: None,
    "549 MB, 4 KB pages": lambda: big_4k.sum(),
    "549 MB, 2 MB pages": lambda: big_2m.sum(),
    "20 MB": lambda: big_2m[:5_000_000].sum(),
}

print("| snippet | " + " | ".join(f"after {k}" if k != "warm" else k for k in BEFORE) + " |")
print("|---|" + "---|" * len(BEFORE))
for name, snippet in SNIPPETS.items():
    cells = []
    for before in BEFORE.values():
        times = []
        for _ in range(15):
            snippet()  # warm
            before()
            t = time.perf_counter()
            snippet()
            times.append(time.perf_counter() - t)
        cells.append(f"{statistics.median(times) * 1e6:.1f}")
    print(f"| {name} | " + " | ".join(cells) + " |")
