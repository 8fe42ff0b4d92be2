"""One SmolLM2-135M decode step's projections through ``fused_linear`` (q/k/v, o, gate/up, down per layer, 30
layers with their own random weights, so nothing stays cached), with a rank-r gated LoRA at the step's masks
(all columns but the first), and builds of the kernel with other flags, for the A/B scripts of this directory
and of ../intel_stream/."""

import hashlib
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

SMALL_GEMM = Path(__file__).resolve().parents[3] / "src" / "mars" / "kernels" / "small_gemm.cpp"

H, FF, KV, LAYERS = 576, 1536, 192, 30
GROUPS = (("q", "k", "v"), ("o",), ("gate", "up"), ("down",))


def make_layers(rank: int, seed: int = 0):
    """Weights per layer and LoRA factors (A [r, K], B [N, r]) whose values are bf16 numbers, as an adapter
    saved in bf16 and loaded into an fp32 model."""
    g = torch.Generator().manual_seed(seed)

    def w(n, k):
        return torch.randn(n, k, generator=g) * 0.02

    layers = [
        dict(q=w(H, H), k=w(KV, H), v=w(KV, H), o=w(H, H), gate=w(FF, H), up=w(FF, H), down=w(H, FF))
        for _ in range(LAYERS)
    ]
    lora = [
        {n: (w(rank, m.shape[1]).bfloat16(), w(m.shape[0], rank).bfloat16()) for n, m in lay.items()} for lay in layers
    ]
    return layers, lora


def run_step(fused, layers, factors, columns: int, adapter: bool, seed: int = 1):
    """One step's projections; ``factors[layer][name] = (A, B packed)``.  Returns the outputs."""
    g = torch.Generator().manual_seed(seed)
    x, xi = torch.randn(columns, H, generator=g), torch.randn(columns, FF, generator=g)
    cols = torch.arange(1, columns) if adapter and columns > 1 else None
    out = []
    for layer, f in zip(layers, factors):
        for names in GROUPS:
            ws = [layer[n] for n in names]
            inp = xi if names == ("down",) else x
            if cols is None:
                out += fused(inp, ws, [None] * len(ws), [], [], [], None)
            else:
                out += fused(
                    inp, ws, [None] * len(ws), [f[n][0] for n in names], [f[n][1] for n in names], [2.0] * len(ws), cols
                )
    return out


def time_interleaved(runs: dict, repeats: int) -> dict:
    """Median ms of each callable, all of them run once per round, ``repeats`` rounds."""
    times = {k: [] for k in runs}
    for f in runs.values():
        f()
    for _ in range(repeats):
        for k, f in runs.items():
            t = time.perf_counter()
            f()
            times[k].append((time.perf_counter() - t) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def threads() -> None:
    torch.set_num_threads(int(os.environ.get("T", "2")))


def build_small_gemm(name: str, extra: list[str]):
    """small_gemm.cpp built with this machine's flags (mars.kernels.cflags) then ``extra`` (later flags win), under
    its own op namespace ``ab_<name>``, so several builds load side by side; its ``torch.ops`` namespace.  Builds
    are kept in the temporary directory by source and flags."""
    from mars.kernels import cflags

    flags = [*cflags(), *extra, f"-DMARS_NAMESPACE=ab_{name}", "-Wno-builtin-macro-redefined"]
    key = hashlib.sha1((SMALL_GEMM.read_text() + " ".join(flags)).encode()).hexdigest()[:8]
    directory = Path(tempfile.gettempdir()) / f"mars_ab_{name}_{key}"
    directory.mkdir(exist_ok=True)
    cpp_extension.load(
        name=f"ab_{name}",
        sources=[str(SMALL_GEMM)],
        extra_cflags=flags,
        build_directory=str(directory),
        is_python_module=False,
        verbose=False,
    )
    return getattr(torch.ops, f"ab_{name}")
