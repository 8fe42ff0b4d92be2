"""Three columns through the 8 x 3 tile (the AVX-512 default) vs the 6 x 4 path's 6 x 3 tile (-DMARS_R3=0): two
builds of small_gemm.cpp under their own op namespaces, loaded side by side, interleaved:

    GOMP_SPINCOUNT=3000 REPS=31 python benchmarks/decode_step_cpu/bf16_factors/tile3_ab.py
"""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from step_groups import build_small_gemm, make_layers, run_step, threads, time_interleaved  # noqa: E402

VARIANTS = {"r3_8": [], "r3_off": ["-DMARS_R3=0"]}
threads()
ops = {name: build_small_gemm(name, extra) for name, extra in VARIANTS.items()}
layers, lora = make_layers(int(os.environ.get("RANK", "32")))
factors = {
    name: [{n: (a, op.pack_lowrank.default(b)) for n, (a, b) in lay.items()} for lay in lora]
    for name, op in ops.items()
}
outs = [run_step(op.fused_linear.default, layers, factors[name], 3, True) for name, op in ops.items()]
assert all(torch.equal(p, q) for p, q in zip(*outs)), "the tiles disagree"
runs = {
    (name, m, ad): (
        lambda op=op, name=name, m=m, ad=ad: run_step(op.fused_linear.default, layers, factors[name], m, ad)
    )
    for m, ad in ((1, False), (3, False), (3, True), (4, True))
    for name, op in ops.items()
}
ms = time_interleaved(runs, int(os.environ.get("REPS", "31")))
print("| build | 1 column | 3 columns | 3 columns, adapter | 4 columns, adapter |")
print("|---|---|---|---|---|")
for name in ops:
    print(
        f"| {name} | "
        + " | ".join(f"{ms[name, m, ad]:.2f}" for m, ad in ((1, False), (3, False), (3, True), (4, True)))
        + " |"
    )
