"""mars::small_linear built with MARS_PF_SPREAD=0 and =1 (this machine's other flags as mars.kernels sets them),
cold (60 distinct [N, K] weights in turn, 4 KB pages) and hot (one of them again and again), the builds alternating,
7 rounds, medians, ms per call; outputs checked equal:

    python benchmarks/decode_step_cpu/intel_stream/prefetch_spread_ab/spread_ab.py    # K=1536 N=576 COLS=46 also
"""

from mars.threads import apply_process_defaults

apply_process_defaults()

import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from mars.threads import configure_threads  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bf16_factors"))
from step_groups import build_small_gemm  # noqa: E402


def seconds_per_call(op, x, weights) -> float:
    start = time.perf_counter()
    for w in weights:
        op(x, w, None)
    return (time.perf_counter() - start) / len(weights)


def main() -> None:
    configure_threads("auto")
    builds = {"base": ["-DMARS_PF_SPREAD=0"], "spread": ["-DMARS_PF_SPREAD=1"]}
    ops = {name: build_small_gemm(name, extra).small_linear.default for name, extra in builds.items()}
    k, n = int(os.environ.get("K", 576)), int(os.environ.get("N", 1536))
    weights = [torch.randn(n, k) for _ in range(60)]
    print(f"K={k} N={n}, ms per call (median of 7 rounds)\n")
    print("| columns | cold, base | cold, spread | hot, base | hot, spread |\n|---|---|---|---|---|")
    for m in [int(c) for c in os.environ.get("COLS", "1,3,8,16,32,46,64").split(",")]:
        x = torch.randn(m, k)
        assert torch.equal(ops["base"](x, weights[0], None), ops["spread"](x, weights[0], None))
        cold, hot = {name: [] for name in ops}, {name: [] for name in ops}
        for _ in range(7):
            for name, op in ops.items():
                cold[name].append(seconds_per_call(op, x, weights))
                hot[name].append(seconds_per_call(op, x, [weights[0]] * len(weights)))
        figures = [statistics.median(d[name]) * 1e3 for d in (cold, hot) for name in ops]
        print(f"| {m} | " + " | ".join(f"{f:.3f}" for f in figures) + " |", flush=True)


if __name__ == "__main__":
    main()
