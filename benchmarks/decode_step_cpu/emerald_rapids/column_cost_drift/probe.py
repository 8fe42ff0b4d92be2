"""Does the extra columns' cost follow the core's clock?  In one process, for a while: the clock (a chain of
dependent multiplies, `chain.c`, 3 cycles each; a chain of adds runs faster than one a cycle on this core, so it
cannot time the clock), then one decode step of 1 column, of [token, 2 drafts] and of [token, 2 masks] (the adapter
live), on a 120-token cache of the AMX reference; medians per 20-second window and the correlations over all steps:

    python benchmarks/decode_step_cpu/emerald_rapids/column_cost_drift/probe.py \
        benchmarks/reproduce_smollm2-135m-amx/adapter_rank8 160 > column_cost_drift/probe.txt
"""

import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mars.threads import apply_process_defaults

apply_process_defaults()

import numpy as np  # noqa: E402
import torch  # noqa: E402

from mars.evaluation.step_cost import StepBench  # noqa: E402
from mars.models import load_model  # noqa: E402
from mars.threads import configure_threads  # noqa: E402

WINDOW = 20  # seconds


def clock_probe():
    """GHz from the best of 3 timed chains of 1M dependent multiplies."""
    out = Path(tempfile.mkdtemp()) / "libchain.so"
    subprocess.run(
        ["gcc", "-O2", "-shared", "-fPIC", str(Path(__file__).with_name("chain.c")), "-o", str(out)], check=True
    )
    lib = ctypes.CDLL(str(out))
    lib.chain.argtypes, lib.chain.restype = [ctypes.c_uint64], ctypes.c_uint64

    def ghz(n: int = 1_000_000) -> float:
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            lib.chain(n)
            best = min(best, time.perf_counter() - start)
        return 3 * n / best / 1e9

    return ghz


def main(checkpoint: str, seconds: float) -> None:
    configure_threads("auto")
    ghz = clock_probe()
    model = load_model(checkpoint, dtype=torch.float32).model.eval()
    with torch.inference_mode():
        steps = {
            "1 col": StepBench(model, 1, 1, 120, True),
            "[token, 2 drafts]": StepBench(model, 1, 3, 120, True),
            "[token, 2 masks]": StepBench(model, 1, 3, 120, True),  # StepBench feeds masks after the token
        }
        steps["[token, 2 drafts]"].ids[:, 1:] = torch.tensor([[1000, 2000]])
        for step in steps.values():
            for _ in range(3):
                step()
        rows, start = [], time.perf_counter()
        while time.perf_counter() - start < seconds:
            row = [time.perf_counter() - start, ghz()]
            for step in steps.values():
                t = time.perf_counter()
                step()
                row.append((time.perf_counter() - t) * 1e3)
            rows.append(row)
    names = list(steps)
    print(f"| from s | steps | GHz | {' | '.join(f'{n} ms' for n in names)} |")
    print("|---" * (3 + len(names)) + "|")
    for w in range(int(seconds // WINDOW)):
        window = [r for r in rows if w * WINDOW <= r[0] < (w + 1) * WINDOW]
        med = [statistics.median(r[i] for r in window) for i in range(1, 2 + len(names))]
        cells = [f"{med[1]:.2f}"] + [f"{m:.2f} (+{(m / med[1] - 1) * 100:.1f}%)" for m in med[2:]]
        print(f"| {w * WINDOW} | {len(window)} | {med[0]:.2f} | {' | '.join(cells)} |")
    a = np.array(rows)
    print(
        f"\ncorrelation over {len(a)} steps: clock vs [token, 2 drafts] / 1 col {np.corrcoef(a[:, 1], a[:, 3] / a[:, 2])[0, 1]:.2f}; "
        f"clock vs 1 col {np.corrcoef(a[:, 1], a[:, 2])[0, 1]:.2f}"
    )


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
