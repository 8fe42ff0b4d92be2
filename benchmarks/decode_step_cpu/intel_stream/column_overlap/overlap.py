"""Does a step's extra-column arithmetic overlap its weight stream?  The kernel (`small_linear`) runs one
SmolLM2-135M step's projections at 1-4 columns twice: cold (30 layers of random weights, 425 MB, read from
memory) and hot (one 1024 x 576 weight that stays in the two cores' L2, called until it has done the same
multiply-adds).  If the arithmetic overlapped the stream, cold would stay near its 1-column time while hot
grows. If it does not, cold grows by what hot grows.  Rounds interleaved, medians:

    python benchmarks/decode_step_cpu/intel_stream/column_overlap/overlap.py
"""

from mars.threads import apply_process_defaults

apply_process_defaults()

import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from mars.kernels import small_linear_op  # noqa: E402
from mars.threads import configure_threads  # noqa: E402

COLUMNS = (1, 2, 3, 4)
SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]


def main(rounds: int = 9) -> None:
    configure_threads("auto")
    op = small_linear_op()
    torch.manual_seed(0)
    cold = [torch.randn(n, k) for _ in range(30) for n, k in SHAPES]
    hot = torch.randn(1024, 576)
    calls = sum(w.numel() for w in cold) // hot.numel()
    inputs = {m: (torch.randn(m, 576), torch.randn(m, 1536)) for m in COLUMNS}

    def run_cold(m):
        x, wide = inputs[m]
        for w in cold:
            op(wide if w.shape[1] == 1536 else x, w, None)

    def run_hot(m):
        for _ in range(calls):
            op(inputs[m][0], hot, None)

    times: dict = {}
    with torch.inference_mode():
        for _ in range(2):
            for m in COLUMNS:
                run_cold(m)
                run_hot(m)
        for _ in range(rounds):
            for m in COLUMNS:
                for name, run in (("cold", run_cold), ("hot", run_hot)):
                    start = time.perf_counter()
                    run(m)
                    times.setdefault((name, m), []).append(time.perf_counter() - start)
    ms = {key: statistics.median(v) * 1e3 for key, v in times.items()}
    print(f"{torch.get_num_threads()} threads, {sum(w.numel() for w in cold) * 4 / 1e6:.0f} MB cold, {calls} hot calls")
    print("| weights | " + " | ".join(f"{m} col" for m in COLUMNS) + " |")
    print("|---|" + "---|" * len(COLUMNS))
    for name in ("cold", "hot"):
        print(f"| {name} | " + " | ".join(f"{ms[name, m]:.2f}" for m in COLUMNS) + " |")
    print("| cold - hot | " + " | ".join(f"{ms['cold', m] - ms['hot', m]:.2f}" for m in COLUMNS) + " |")


if __name__ == "__main__":
    main()
