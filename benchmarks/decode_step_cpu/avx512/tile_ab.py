"""A/B of small_gemm.cpp builds on the 135M step's fused_linear groups (cold weights), interleaved.

    GOMP_SPINCOUNT=3000 REPS=11 python benchmarks/decode_step_cpu/avx512/tile_ab.py [variant,variant,...]

Each variant is the kernel source built with its own flags under its own op namespace (in $TMPDIR), so all of
them load into one process; the variants' tables in tile_ab.md were taken with the VARIANTS of their round.
"""

import hashlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

SRC = str(Path(__file__).resolve().parents[3] / "src" / "mars" / "kernels" / "small_gemm.cpp")
BASE = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-DNDEBUG", "-ffp-contract=off"]
VARIANTS = {
    "avx2_3x4": BASE,
    "avx2_3x4_r2_6": BASE + ["-DMARS_R2=6"],
    "avx512_6x4_r2_8": BASE + ["-mavx512f", "-DMARS_R=6", "-DMARS_R2=8"],
    "avx512_5x4_r2_8": BASE + ["-mavx512f", "-DMARS_R=5", "-DMARS_R2=8"],
    "avx512_6x4_r2_8_pf3": BASE + ["-mavx512f", "-DMARS_R=6", "-DMARS_R2=8", "-DMARS_PF=3"],
    "avx512_6x4_r2_8_dup": BASE + ["-mavx512f", "-DMARS_R=6", "-DMARS_R2=8", "-DDUP"],
}
sel = sys.argv[1].split(",") if len(sys.argv) > 1 else list(VARIANTS)
ops = {}
for name in sel:
    flags = VARIANTS[name] + [f"-DMARS_NAMESPACE=ab_{name}"]
    key = hashlib.sha1((Path(SRC).read_text() + " ".join(flags)).encode()).hexdigest()[:8]
    d = os.path.join(tempfile.gettempdir(), f"mars_tile_ab_{name}_{key}")
    os.makedirs(d, exist_ok=True)
    cpp_extension.load(
        name=f"ab_{name}", sources=[SRC], extra_cflags=flags, build_directory=d, is_python_module=False, verbose=False
    )
    ops[name] = getattr(torch.ops, f"ab_{name}").fused_linear.default
torch.set_num_threads(int(os.environ.get("T", "2")))
g = torch.Generator().manual_seed(0)
H, FF, KV, L, V, r = 576, 1536, 192, 30, 49152, 32


def W(n, k):
    return torch.randn(n, k, generator=g) * 0.02


layers = [
    dict(q=W(H, H), k=W(KV, H), v=W(KV, H), o=W(H, H), gate=W(FF, H), up=W(FF, H), down=W(H, FF)) for _ in range(L)
]
lora = [{n: (W(r, w.shape[1]), W(w.shape[0], r)) for n, w in lay.items()} for lay in layers]
head = W(V, H)


def step(op, M, adapter):
    x, xi = torch.randn(M, H), torch.randn(M, FF)
    cols = torch.arange(1, M) if adapter and M > 1 else None

    def group(names, inp, li):
        ws = [layers[li][n] for n in names]
        if cols is None:
            return op(inp, ws, [None] * len(ws), [], [], [], None)
        return op(
            inp,
            ws,
            [None] * len(ws),
            [lora[li][n][0] for n in names],
            [lora[li][n][1] for n in names],
            [2.0] * len(ws),
            cols,
        )

    def run():
        for li in range(L):
            group(["q", "k", "v"], x, li)
            group(["o"], x, li)
            group(["gate", "up"], x, li)
            group(["down"], xi, li)
        op(x, [head], [None], [], [], [], None)

    return run


# correctness: variants agree closely with F.linear
x = torch.randn(5, H)
for name, op in ops.items():
    y = op(x, [layers[0]["gate"]], [None], [], [], [], None)[0]
    print(name, "max err vs F.linear", (y - x @ layers[0]["gate"].T).abs().max().item())
configs = [(M, a) for M in (1, 2, 4, 7) for a in ((False, True) if M > 1 else (False,))]
runs = {(n, M, a): step(op, M, a) for n, op in ops.items() for (M, a) in configs}
times = {k: [] for k in runs}
for f in runs.values():
    f()
R = int(os.environ.get("REPS", "9"))
for _ in range(R):
    for k, f in runs.items():
        t = time.perf_counter()
        f()
        times[k].append((time.perf_counter() - t) * 1e3)
print("| variant | " + " | ".join(f"M={M}{' +lora' if a else ''}" for M, a in configs) + " |")
for n in ops:
    base = statistics.median(times[(n, 1, False)])
    print(f"| {n} | " + " | ".join(f"{statistics.median(times[(n, M, a)]):.1f}" for M, a in configs) + " |")
