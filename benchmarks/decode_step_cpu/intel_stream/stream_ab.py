"""Builds of small_gemm.cpp with extra -D flags (on top of this machine's own flags, later flags win) timed on one
SmolLM2-135M step's projections (30 layers of q/k/v, o, gate/up, down with their own random weights, cold), every
build once per round, interleaved; outputs checked equal across builds:

    VARIANTS='{"amd":["-DMARS_PF=2","-DMARS_R1=8"],"intel":["-DMARS_PF=1","-DMARS_R1=4"]}' \
        GOMP_SPINCOUNT=30000 REPS=41 python benchmarks/decode_step_cpu/intel_stream/stream_ab.py

COLS (default 1,2,3,4), ADAPTER=1 (a rank-8 gated LoRA at every column but the first), MKL=1 (F.linear beside them),
HUGE=1 (the weights and factors in 2 MB pages, as mars.decoding.huge_pages places a model's).
"""

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bf16_factors"))
from step_groups import build_small_gemm, make_layers, run_step, threads, time_interleaved  # noqa: E402

VARIANTS = json.loads(os.environ["VARIANTS"])
COLS = [int(c) for c in os.environ.get("COLS", "1,2,3,4").split(",")]
ADAPTER = os.environ.get("ADAPTER", "0") == "1"
threads()
ops = {name: build_small_gemm(name, extra) for name, extra in VARIANTS.items()}
layers, lora = make_layers(8)
if os.environ.get("HUGE") == "1":
    from mars.decoding.huge_pages import place_tensors

    place_tensors([t for lay in layers for t in lay.values()] + [t for lay in lora for ab in lay.values() for t in ab])
factors = {
    name: [{n: (a, op.pack_lowrank.default(b)) for n, (a, b) in lay.items()} for lay in lora]
    for name, op in ops.items()
}
outs = [run_step(op.fused_linear.default, layers, factors[name], 3, True) for name, op in ops.items()]
assert all(all(torch.equal(p, q) for p, q in zip(outs[0], o)) for o in outs[1:]), "the builds disagree"
runs = {
    (name, m): (lambda op=op, name=name, m=m: run_step(op.fused_linear.default, layers, factors[name], m, ADAPTER))
    for m in COLS
    for name, op in ops.items()
}


def mkl(m):
    x, xi = torch.randn(m, 576), torch.randn(m, 1536)
    for layer in layers:
        for n, w in layer.items():
            torch.nn.functional.linear(xi if n == "down" else x, w)


names = list(ops)
if os.environ.get("MKL") == "1":
    names.append("mkl")
    runs.update({("mkl", m): (lambda m=m: mkl(m)) for m in COLS})
ms = time_interleaved(runs, int(os.environ.get("REPS", "21")))
print(f"threads {torch.get_num_threads()}, adapter {ADAPTER}, median ms of {os.environ.get('REPS', '21')} rounds")
print("| build | " + " | ".join(f"{m} col" for m in COLS) + " |")
print("|---|" + "---|" * len(COLS))
for name in names:
    print(f"| {name} | " + " | ".join(f"{ms[name, m]:.2f}" for m in COLS) + " |")
