"""What extra columns cost the kernel on this host, part by part: one decode step's 120 projection calls (30 layers
of SmolLM2-135M's shapes: q/k/v, o, gate/up, down, random weights) and its LM head (49152 x 576) through
`mars::small_linear`, at 1-4 columns, with cold weights (each round streams all of them once before its first call),
medians of 15 interleaved rounds; then the LM head with only its first V rows at every column and the rest at the
first column alone (what scoring mask columns over a smaller draft vocabulary would cost; same bits at the first
column, checked):

    python benchmarks/decode_step_cpu/emerald_rapids/extra_columns.py
"""

from mars.threads import apply_process_defaults

apply_process_defaults()

import collections  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from mars.kernels import small_linear_op  # noqa: E402
from mars.threads import configure_threads  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
VOCAB, HIDDEN, LAYERS, ROUNDS = 49152, 576, 30, 15


def main() -> None:
    configure_threads("auto")
    op = small_linear_op()
    torch.manual_seed(0)
    layers = [{k: torch.randn(*s) * 0.02 for k, s in SHAPES.items()} for _ in range(LAYERS)]
    head = torch.randn(VOCAB, HIDDEN) * 0.02
    x = {k: torch.randn(4, s[1]) for k, s in SHAPES.items()}
    h = torch.randn(4, HIDDEN)
    splits = (8192, 16384)
    for v in splits:  # the first column's logits do not depend on how the rows are split
        assert torch.equal(
            op(h[:3], head, None)[:1], torch.cat([op(h[:3], head[:v], None)[:1], op(h[:1], head[v:], None)], 1)
        )
    times = collections.defaultdict(list)
    for _ in range(ROUNDS):
        for m in (1, 2, 3, 4):
            per = collections.defaultdict(float)
            for layer in layers:  # the projections, cold: the head's 113 MB ran last
                for name, w in layer.items():
                    start = time.perf_counter()
                    op(x[name][:m], w, None)
                    per[name] += time.perf_counter() - start
            for name, seconds in per.items():
                times[f"projections {name}", m].append(seconds)
            times["projections", m].append(sum(per.values()))
            start = time.perf_counter()  # the head, cold: the projections' 425 MB ran last
            op(h[:m], head, None)
            times["LM head", m].append(time.perf_counter() - start)
        for v in splits:
            for layer in layers:  # cold again
                for name, w in layer.items():
                    op(x[name][:1], w, None)
            start = time.perf_counter()
            op(h[:3], head[:v], None), op(h[:1], head[v:], None)
            times[f"LM head, 3 columns over its first {v} rows, 1 over the rest", 3].append(time.perf_counter() - start)
    print("| part | columns | ms | over 1 column (ms) |\n|---|---|---|---|")
    for (part, m), v in sorted(times.items()):
        base = times.get((part, 1)) or times["LM head", 1]
        print(
            f"| {part} | {m} | {statistics.median(v) * 1e3:.2f} | {(statistics.median(v) - statistics.median(base)) * 1e3:+.2f} |"
        )


if __name__ == "__main__":
    main()
