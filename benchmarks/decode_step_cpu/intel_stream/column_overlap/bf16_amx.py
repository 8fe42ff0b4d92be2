"""What this host's AMX would make of a step's extra columns, in bf16: one SmolLM2-135M step's projections and
LM head (30 layers of random weights + a 49152 x 576 head) through oneDNN's linear with weights prepacked for
the step's column count (`torch.ops.mkldnn._reorder_linear_weight`, as inductor's weight-prepack pass does), in
bf16 (AMX tiles) and, beside it, the same shapes in fp32 through `F.linear` (MKL) and through mars's kernel.
Also checks that oneDNN's bf16 output for a column is the same bits alone and beside others (batch invariance,
which lossless verify needs).  Median ms of 7 rounds, 2 threads:

    python benchmarks/decode_step_cpu/intel_stream/column_overlap/bf16_amx.py
"""

from mars.threads import apply_process_defaults

apply_process_defaults()

import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from mars.kernels import small_linear_op  # noqa: E402
from mars.threads import configure_threads  # noqa: E402

SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)] * 30
SHAPES.append((49152, 576))
COLUMNS = (1, 2, 3, 4, 8)


def linear_bf16(x, packed):
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def batch_invariant(weights, packed) -> bool:
    """Each column's bf16 output alone (prepacked for 1) equals it beside 2 and 7 others (prepacked for 3 / 8)."""
    for w, by_m in zip(weights[:7] + weights[-1:], packed[1][:7] + packed[1][-1:]):
        x = torch.randn(8, w.shape[1]).to(torch.bfloat16)
        alone = [linear_bf16(x[i : i + 1], by_m) for i in range(8)]
        for m, p in (
            (3, torch.ops.mkldnn._reorder_linear_weight(w, 3)),
            (8, torch.ops.mkldnn._reorder_linear_weight(w, 8)),
        ):
            y = linear_bf16(x[:m], p)
            if not all(torch.equal(y[i : i + 1], alone[i]) for i in range(m)):
                return False
    return True


def main(rounds: int = 7) -> None:
    configure_threads("auto")
    torch.manual_seed(0)
    fp32 = [torch.randn(n, k) for n, k in SHAPES]
    bf16 = [w.to(torch.bfloat16) for w in fp32]
    packed = {m: [torch.ops.mkldnn._reorder_linear_weight(w, m) for w in bf16] for m in COLUMNS}
    kernel = small_linear_op()
    inputs = {m: {k: torch.randn(m, k) for k in (576, 1536)} for m in COLUMNS}
    runs = {
        "bf16, oneDNN prepacked (AMX)": lambda m: [
            linear_bf16(inputs[m][w.shape[1]].bfloat16(), p) for w, p in zip(bf16, packed[m])
        ],
        "bf16, F.linear": lambda m: [F.linear(inputs[m][w.shape[1]].bfloat16(), w) for w in bf16],
        "fp32, F.linear (MKL)": lambda m: [F.linear(inputs[m][w.shape[1]], w) for w in fp32],
        "fp32, mars small_linear": lambda m: [kernel(inputs[m][w.shape[1]], w, None) for w in fp32],
    }
    times: dict = {}
    with torch.inference_mode():
        invariant = batch_invariant(bf16, packed)
        for _ in range(2):
            for run in runs.values():
                for m in COLUMNS:
                    run(m)
        for _ in range(rounds):
            for name, run in runs.items():
                for m in COLUMNS:
                    start = time.perf_counter()
                    run(m)
                    times.setdefault((name, m), []).append(time.perf_counter() - start)
    print(f"{torch.get_num_threads()} threads, {len(SHAPES)} weights, bf16 batch-invariant: {invariant}")
    print("| path | " + " | ".join(f"{m} col" for m in COLUMNS) + f" | {COLUMNS[2]} col / 1 col |")
    print("|---|" + "---|" * (len(COLUMNS) + 1))
    for name in runs:
        ms = [statistics.median(times[name, m]) * 1e3 for m in COLUMNS]
        print(f"| {name} | " + " | ".join(f"{v:.2f}" for v in ms) + f" | {ms[2] / ms[0]:.3f} |")


if __name__ == "__main__":
    main()
