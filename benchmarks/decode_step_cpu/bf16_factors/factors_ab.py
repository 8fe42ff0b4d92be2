"""LoRA factors streamed as fp32 vs as bf16 (the same values), same build, interleaved:

GOMP_SPINCOUNT=3000 REPS=31 RANK=32 python benchmarks/decode_step_cpu/bf16_factors/factors_ab.py
"""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from step_groups import make_layers, run_step, threads, time_interleaved  # noqa: E402

from mars.kernels import fused_linear_op, pack_lowrank_op  # noqa: E402

threads()
fused, pack = fused_linear_op(), pack_lowrank_op()
layers, lora = make_layers(int(os.environ.get("RANK", "32")))
factors = {
    dt: [{n: (a.to(dt), pack(b.to(dt))) for n, (a, b) in lay.items()} for lay in lora]
    for dt in (torch.float32, torch.bfloat16)
}
a, b = (run_step(fused, layers, factors[dt], 3, True) for dt in factors)
assert all(torch.equal(p, q) for p, q in zip(a, b)), "bf16 factors changed a result"
runs = {("none", 1): lambda: run_step(fused, layers, factors[torch.float32], 1, False)}
for m in (2, 3, 4):
    runs[("none", m)] = lambda m=m: run_step(fused, layers, factors[torch.float32], m, False)
    for dt in factors:
        runs[(str(dt).split(".")[1], m)] = lambda m=m, dt=dt: run_step(fused, layers, factors[dt], m, True)
ms = time_interleaved(runs, int(os.environ.get("REPS", "31")))
print("| columns | no adapter | fp32 factors | bf16 factors | adapter cost fp32 | adapter cost bf16 |")
print("|---|---|---|---|---|---|")
print(f"| 1 | {ms['none', 1]:.2f} | | | | |")
for m in (2, 3, 4):
    n, f, h = ms["none", m], ms["float32", m], ms["bfloat16", m]
    print(f"| {m} | {n:.2f} | {f:.2f} | {h:.2f} | {f - n:.2f} | {h - n:.2f} |")
