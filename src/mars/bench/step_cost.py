"""What one decode step costs, beside what this machine can do: the step-cost table.

    mars-bench step-cost --columns 1,2,4,7,8 --batch-sizes 1,8 --out results/step_cost_cpu

A decode step runs the model on ``columns`` new positions per row (1 for AR; the last real token plus
masks, drafts or Jacobi guesses for MARS) over a KV cache of ``--context`` tokens, through the engine's
own forward (:class:`mars.decoding.forward.ModelRunner` with the per-row cache; logits at every new
column).  For each batch size and column count it prints the median ms per step, the ratio to the
1-column step of the same batch and path, the achieved weight-read bandwidth (parameter bytes / step
time: each weight is read once per step) and the achieved GFLOP/s (2 x parameters x columns x batch:
the matmuls; attention adds little at these lengths), beside this machine's measured bounds: the read
bandwidth of a tensor as large as the weights and the peak fp32 GEMM rate, with the same threads.

Paths: ``fast`` (the decode fast path, :mod:`mars.decoding.fastpath`, with the lean forward's C++ layer loop),
``python-loop`` (the same with the lean forward's Python loop: what the C++ loop saves) and ``eager``
(``F.linear``), timed interleaved in one process so that their ratios hold on a shared machine.  Writes ``step_cost.md``,
``step_cost.csv`` and ``config.json`` under ``--out``.
"""

from __future__ import annotations

import csv
import json
import platform
import statistics
import sys
import time
from pathlib import Path

from mars.bench import cli_options
from mars.hardware import apply_process_defaults, describe_wait_policy

apply_process_defaults()  # the OpenMP wait before torch loads libgomp

import torch  # noqa: E402

from mars.decoding import huge_pages  # noqa: E402

PATHS = ("fast", "python-loop", "eager")


def measure_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """GB/s reading a fresh fp32 tensor of ``nbytes`` (a sum: one read, no write), median of ``repeats``; in
    2 MB pages where decoding puts the weights there (mars.decoding.huge_pages)."""
    x = torch.ones(max(nbytes // 4, 1 << 20))
    if huge_pages.wanted():
        huge_pages.place_tensors([x])
    x.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    return x.numel() * 4 / statistics.median(times) / 1e9


def measure_peak_gflops(n: int = 1024, repeats: int = 5) -> float:
    """GFLOP/s of a square fp32 GEMM that fits in cache (the compute bound a step can approach)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(2):
        a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times) / 1e9


class StepBench:
    """One decode step of ``columns`` per row for ``batch`` rows over a prefilled cache of ``context``."""

    def __init__(self, model, batch: int, columns: int, context: int, fast: bool, native: bool = True):
        from mars.decoding.attention import mars_attention
        from mars.decoding.forward import ModelRunner
        from mars.decoding.kv import RaggedKVCache

        self.mars_attention = mars_attention
        self.runner = ModelRunner(model, fast=fast)
        self.cache = RaggedKVCache(self.runner.num_layers, capacity=context + columns + 8)
        g = torch.Generator().manual_seed(0)
        vocab = self.runner.vocab_size
        prompt = torch.randint(0, vocab, (batch, context), generator=g)
        pos = torch.arange(context).expand(batch, -1)
        self._step(prompt, pos, context)  # prefill: the cache holds `context` tokens per row
        lean = self.runner._lean_forward() if fast else None
        if lean is not None and not native:
            lean._native = False  # the lean forward's Python loop instead of its C++ one
        self.ids = torch.randint(0, vocab, (batch, columns), generator=g)
        gate = getattr(model, "mars_gate", None)
        if gate is not None:  # a MARS step behind a mask adapter: the last token, then masks (the adapter acts)
            self.ids[:, 1:] = gate.mask_token_id
        self.pos = (context + torch.arange(columns)).expand(batch, -1).contiguous()
        self.kv_len = context + columns

    def _step(self, ids, pos, kv_len):
        self.cache.prepare_step(pos, kv_len)
        attn = (torch.arange(kv_len).view(1, 1, -1) <= pos.unsqueeze(2)).unsqueeze(1)
        cols = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
        with self.mars_attention(self.runner.model):
            return self.runner.logits_at(ids, pos, attn, cols, self.cache)

    def __call__(self):
        # the same write positions every time: the step overwrites its own columns, the cache stays put
        return self._step(self.ids, self.pos, self.kv_len)


def run(args) -> list[dict]:
    from mars.models import load_model

    model = load_model(args.model, dtype=torch.float32).model.eval()
    params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    tied = getattr(model.config, "tie_word_embeddings", False)
    if tied:  # the head reads the (shared) embedding matrix once per step
        params += model.get_output_embeddings().weight.numel()
    weight_bytes = params * 4
    rows = []
    with torch.inference_mode():
        bounds = {}
        for t in args.threads:
            torch.set_num_threads(t)
            bounds[t] = dict(bandwidth=measure_bandwidth(weight_bytes), peak=measure_peak_gflops())
            print(
                f"machine, {t} threads: read bandwidth {bounds[t]['bandwidth']:.1f} GB/s, "
                f"fp32 GEMM peak {bounds[t]['peak']:.0f} GFLOP/s",
                flush=True,
            )
        for batch in args.batch_sizes:
            times = time_steps(model, args, batch)
            rows += summarise(times, args, batch, bounds, params, weight_bytes)
    return rows, dict(weight_bytes=weight_bytes, params=params, bounds_by_threads=bounds)


def time_steps(model, args, batch: int) -> dict[tuple[int, str, int], list[float]]:
    """Seconds per step for each (threads, path, columns), every one once per round: drift hits all alike."""
    times: dict[tuple[int, str, int], list[float]] = {}
    keys = [(t, p, c) for t in args.threads for p in args.paths for c in args.columns]
    benches = {
        (p, c): StepBench(model, batch, c, args.context, p != "eager", native=p != "python-loop")
        for p in args.paths
        for c in args.columns
    }
    for t in args.threads:
        torch.set_num_threads(t)
        for bench in benches.values():
            for _ in range(args.warmup):
                bench()
    for _ in range(args.repeats):
        for t, p, c in keys:
            torch.set_num_threads(t)
            start = time.perf_counter()
            benches[(p, c)]()
            times.setdefault((t, p, c), []).append(time.perf_counter() - start)
    return times


def summarise(times: dict, args, batch: int, bounds: dict, params: int, weight_bytes: int) -> list[dict]:
    """One row per (threads, path, columns): median ms, ratio to the first column count, GB/s, GFLOP/s."""
    rows = []
    for t in args.threads:
        for path in args.paths:
            base = statistics.median(times[(t, path, args.columns[0])])
            for c in args.columns:
                sample = times[(t, path, c)]
                ms = statistics.median(sample)
                rows.append(
                    dict(
                        threads=t,
                        path=path,
                        batch=batch,
                        columns=c,
                        ms=ms * 1e3,
                        ms_min=min(sample) * 1e3,
                        ratio=ms / base,
                        gb_s=weight_bytes / ms / 1e9,
                        gflop_s=2 * params * c * batch / ms / 1e9,
                        bandwidth_gb_s=bounds[t]["bandwidth"],
                        peak_gflop_s=bounds[t]["peak"],
                    )
                )
                print(
                    f"batch {batch} threads {t} {path:5s} {c} columns: {ms * 1e3:.1f} ms ({ms / base:.2f}x), "
                    f"{weight_bytes / ms / 1e9:.1f} GB/s, {2 * params * c * batch / ms / 1e9:.1f} GFLOP/s",
                    flush=True,
                )
    return rows


def write(rows: list[dict], bounds: dict, config: dict, out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "step_cost.csv").open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (out / "config.json").write_text(json.dumps({**config, **bounds}, indent=2, default=str) + "\n")
    bound_lines = [
        f"- {t} thread{'s' if t > 1 else ''}: read bandwidth **{b['bandwidth']:.1f} GB/s** (the weights, "
        f"{bounds['weight_bytes'] / 1e6:.0f} MB, take **{bounds['weight_bytes'] / b['bandwidth'] / 1e6:.1f} ms** to "
        f"read at that rate: the floor of a step), fp32 GEMM peak **{b['peak']:.0f} GFLOP/s**"
        for t, b in bounds["bounds_by_threads"].items()
    ]
    lines = [
        "# Decode step cost\n",
        f"model `{config['model']}`, fp32, OpenMP wait {config['omp_wait_policy']}, weights in 2 MB pages "
        f"{config.get('huge_pages', '(not recorded)')}, KV cache of "
        f"{config['context']} tokens per row, median of {config['repeats']} steps, every configuration once per "
        f"round ({config['cpu']}, {config['cpus']} CPUs, torch {config['torch']}).  `fast`: the decode fast path "
        "(mars::fused_linear for up to 16 columns in all, the projections of one input in one pass; the layer loop "
        "in C++); `python-loop`: the same with the layer loop in Python; `eager`: F.linear (MKL).  On a checkpoint "
        "with a mask adapter the columns after the first are mask tokens (a MARS step), "
        "so the adapter acts and its weights count in the bytes read.\n",
        "Bounds measured in the same process just before the steps (a sum over a tensor as large as the weights; "
        "a 1024^3 GEMM); on a shared machine they move with the load as the steps do:\n",
        *bound_lines,
        "",
        "GB/s = weight bytes / step time (each weight is read once per step); GFLOP/s = 2 x parameters x columns x "
        "batch / step time (the matmuls; attention is small at this context).\n",
        "| threads | path | batch | columns | ms/step | x 1 column | GB/s | GFLOP/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['threads']} | {r['path']} | {r['batch']} | {r['columns']} | {r['ms']:.1f} | {r['ratio']:.2f} | "
            f"{r['gb_s']:.1f} | {r['gflop_s']:.1f} |"
        )
    text = "\n".join(lines) + "\n"
    (out / "step_cost.md").write_text(text)
    return text


def build_parser():
    p = cli_options.parser("mars-bench step-cost", __doc__)
    cli_options.add_model(p, checkpoint=False)
    p.add_argument("--columns", default="1,2,4,7,8", help="new columns per row (comma-separated; first is the base)")
    p.add_argument("--batch-sizes", default="1,8", help="comma-separated")
    p.add_argument("--context", type=int, default=100, help="tokens already in each row's KV cache")
    p.add_argument("--paths", default="fast,eager", help=f"comma-separated, from {list(PATHS)}")
    cli_options.add_timing(p, repeats=15, warmup=3)
    p.add_argument(
        "--threads", default="auto", help="torch threads, comma-separated to compare (auto: mars.hardware' choice)"
    )
    cli_options.add_out(p, "outputs/step_cost")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.columns = cli_options.positive_ints(args.columns, "--columns")
    args.batch_sizes = cli_options.positive_ints(args.batch_sizes, "--batch-sizes")
    args.paths = cli_options.comma_list(args.paths, "--paths", allowed=PATHS)
    if args.repeats < 1 or args.context < 1:
        raise SystemExit(f"--repeats and --context must be >= 1, got {args.repeats} and {args.context}")
    from mars.hardware import available_cpus, resolve_threads

    try:
        args.threads = [resolve_threads(t.strip()) for t in str(args.threads).split(",") if t.strip()]
    except ValueError as err:
        raise SystemExit(f"--threads: {err}") from err
    rows, bounds = run(args)
    config = dict(
        model=args.model,
        threads=args.threads,
        cpus=available_cpus(),
        omp_wait_policy=describe_wait_policy(),
        huge_pages=huge_pages.describe(),
        context=args.context,
        repeats=args.repeats,
        cpu=platform.processor() or platform.machine(),
        torch=torch.__version__,
        started=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )
    print(write(rows, bounds, config, Path(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
