"""What a gated LoRA adds to a step's projections at a verify-shaped step: the 120 fused_linear passes of
SmolLM2-135M (q/k/v, o, gate/up, down per layer) at 3 columns, without an adapter (plain), with the adapter
acting at the last 2 columns (lora), and with the adapter's lists passed but no adapted column (the binding's
cost of the lists alone).  Median ms of 31 interleaved rounds, fp32, weights cold-ish (one pass streams them all).

    python benchmarks/decode_step_cpu/intel_stream/lora_wait_ab/lora_ab.py benchmarks/adapter_rank/ref40_rank8

A/B two kernel sources in alternating processes (each source is its own cached build): copy one source over
src/mars/kernels/small_gemm.cpp, run, copy the other, run, repeat.
"""

from mars.threads import apply_process_defaults

apply_process_defaults()

import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

import mars.kernels as K  # noqa: E402
from mars.decoding.fastpath import packed_lowrank, streamed_factor  # noqa: E402
from mars.models import load_model  # noqa: E402

torch.set_num_threads(int(os.environ.get("THREADS", "2")))
model = load_model(sys.argv[1], dtype=torch.float32).model.eval()
fused = K.fused_linear_op()
groups = []
for layer in model.model.layers:
    attn, mlp = layer.self_attn, layer.mlp
    for mods, k in (
        ((attn.q_proj, attn.k_proj, attn.v_proj), 576),
        ((attn.o_proj,), 576),
        ((mlp.gate_proj, mlp.up_proj), 576),
        ((mlp.down_proj,), 1536),
    ):
        weights = [m.get_base_layer().weight for m in mods]
        down = [streamed_factor(m.lora_A["default"].weight) for m in mods]
        up = [packed_lowrank(m.lora_B["default"].weight) for m in mods]
        groups.append((k, weights, down, up, [m.scaling["default"] for m in mods]))
M = int(sys.argv[2]) if len(sys.argv) > 2 else 3
cols = torch.arange(1, M)
xs = {576: torch.randn(M, 576), 1536: torch.randn(M, 1536)}


def plain():
    for k, w, _, _, _ in groups:
        fused(xs[k], w, [None] * len(w), [], [], [], None)


def lora():
    for k, w, a, b, s in groups:
        fused(xs[k], w, [None] * len(w), a, b, s, cols)


def lora_list_no_cols():
    for k, w, a, b, s in groups:
        fused(xs[k], w, [None] * len(w), a, b, s, None)


runs = {"plain": plain, "lora": lora, "lora_list_no_cols": lora_list_no_cols}
with torch.inference_mode():
    times = {k: [] for k in runs}
    for f in runs.values():
        f()
        f()
    for _ in range(31):
        for k, f in runs.items():
            t = time.perf_counter()
            f()
            times[k].append((time.perf_counter() - t) * 1e3)
    for k, v in times.items():
        print(k, f"{statistics.median(v):.2f} ms  (q1 {statistics.quantiles(v, n=4)[0]:.2f})")
