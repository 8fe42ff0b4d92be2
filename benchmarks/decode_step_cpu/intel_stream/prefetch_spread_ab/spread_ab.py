"""mars::small_linear built with MARS_PF_SPREAD=0 and =1 (this machine's other flags as mars.kernels sets them),
cold (60 distinct [N, K] weights in turn, 4 KB pages) and hot (one of them again and again), the builds alternating,
7 rounds, medians, ms per call; outputs checked equal:

    python benchmarks/decode_step_cpu/intel_stream/prefetch_spread_ab/spread_ab.py    # K=1536 N=576 COLS=46 also
"""

from mars.threads import apply_process_defaults

apply_process_defaults()

import hashlib  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch.utils import cpp_extension  # noqa: E402

from mars.kernels import cflags  # noqa: E402
from mars.threads import configure_threads  # noqa: E402

SRC = Path(__file__).resolve().parents[4] / "src" / "mars" / "kernels" / "small_gemm.cpp"


def build(name: str, extra: list[str]):
    flags = [*cflags(), *extra, f"-DMARS_NAMESPACE=ab_{name}", "-Wno-builtin-macro-redefined"]
    key = hashlib.sha1((SRC.read_text() + " ".join(flags)).encode()).hexdigest()[:8]
    directory = Path(tempfile.gettempdir()) / f"mars_spread_{name}_{key}"
    directory.mkdir(exist_ok=True)
    cpp_extension.load(
        name=f"ab_{name}",
        sources=[str(SRC)],
        extra_cflags=flags,
        build_directory=str(directory),
        is_python_module=False,
    )
    return getattr(torch.ops, f"ab_{name}").small_linear.default


def seconds_per_call(op, x, weights) -> float:
    start = time.perf_counter()
    for w in weights:
        op(x, w, None)
    return (time.perf_counter() - start) / len(weights)


def main() -> None:
    configure_threads("auto")
    ops = {"base": build("base", ["-DMARS_PF_SPREAD=0"]), "spread": build("spread", ["-DMARS_PF_SPREAD=1"])}
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
