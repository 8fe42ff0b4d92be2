"""torch.profiler of 1- and 3-column decode steps (StepBench: the engine forward, fast path, C++ layer loop) with
their median step times (30 interleaved rounds)."""

import statistics
import sys
import time

from mars.threads import configure_threads

configure_threads(2)

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from mars.evaluation.step_cost import StepBench  # noqa: E402
from mars.models import load_model  # noqa: E402


def main(model_name: str) -> None:
    model = load_model(model_name, dtype=torch.float32).model.eval()
    with torch.inference_mode():
        benches = {c: StepBench(model, 1, c, 150, True) for c in (1, 3)}
        for bench in benches.values():
            for _ in range(5):
                bench()
        times = {c: [] for c in benches}
        for _ in range(30):
            for c, bench in benches.items():
                start = time.perf_counter()
                bench()
                times[c].append(time.perf_counter() - start)
        for c, ts in times.items():
            print(c, "cols median ms", 1e3 * statistics.median(ts))
        for c, bench in benches.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(20):
                    bench()
            print(f"===== {c} columns")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


if __name__ == "__main__":
    main(sys.argv[1])
