"""Bounded load test of ``mars-serve`` over loopback: throughput, latency and time to first token against
offered load for several threshold policies (fixed 1.0 or 0.9, adaptive, and ``verify``: every request asks for
lossless verified decoding), the quality cost of lowering the threshold, and a burst past the queue limit.

    mars-bench loadtest --out results/serving_load              # the published run
    mars-bench loadtest --rates 0.1,0.3 --duration 20 --policies tau1.0,adaptive --out /tmp/lt

For each policy a fresh server subprocess (``mars-serve ... host=127.0.0.1``, run as ``python -m mars.cli.serve``
in this interpreter: a checkout and an installed wheel alike) is started on a free port.  Each load level offers an open-loop Poisson stream of streaming chat requests at a fixed rate for
a fixed duration (the same arrival times and prompts for every policy: prompts from
``data/prompts/heldout.jsonl`` where the package keeps its data (:mod:`mars.paths`), or ``--prompts``, read by
:mod:`mars.prompt_files`, in file order, short enough to keep prefill cheap); a level ends when
every request is answered or at a hard time limit (leftovers are cancelled and counted).  Everything is
bounded: request counts, durations, per-request timeouts, the burst size; every flag is checked against its range
before any server starts (:func:`check_args`), each refusal naming the flag.

Measured per (policy, offered rate): completed requests/s and generated tokens/s (over the span from the
first arrival to the last completion, so a backlog's drain is included), p50/p95 latency and TTFT (seen
by the client), rejected (429/503) and failed requests, the mean served threshold and tokens per forward,
and the agreement of each output with the threshold 1.0 output of the same prompt (identical outputs;
shared token prefix), since threshold 1.0 outputs do not depend on the load.  The burst sends 4x the queue limit at
once and checks that every request gets 200 or 429/503, the server stays up and its memory stays bounded.

Writes ``levels.csv``, ``requests.csv``, ``outputs.jsonl``, ``burst.json``, ``table.md``, ``serving_load.png``
and ``config.json`` (arguments, machine) (:mod:`mars.bench.loadtest_report`); the servers and the client are
:mod:`mars.bench.loadtest_client`'s.
"""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

from mars.bench import cli_options
from mars.bench.loadtest_client import (
    Result,
    ServerProcess,
    burst,
    run_level,
    schedule,
    servers_stopped_on_exit,
    wait_idle,
)
from mars.bench.loadtest_report import fmt, pct, reference_outputs, summarise, write_outputs
from mars.paths import data_dir

POLICIES = {
    "tau1.0": ["tau_policy=fixed", "threshold=1.0"],
    "tau0.9": ["tau_policy=fixed", "threshold=0.9"],
    "adaptive": ["tau_policy=adaptive"],
    "verify": ["tau_policy=fixed", "threshold=1.0"],  # every request asks for lossless verified decoding
}


def load_prompts(path: Path, max_prompt_tokens: int, limit: int) -> list[str]:
    """The first ``limit`` prompts of the prompt file ``path`` of at most ``max_prompt_tokens`` tokens with the chat
    template; a file that cannot be read, a bad line (:mod:`mars.prompt_files`), or no prompt that short is refused
    naming the flag (before any server starts)."""
    from mars.models import embedded_tokenizer

    rows = cli_options.prompt_rows(path, "--prompts")
    tok = embedded_tokenizer()
    out, shortest = [], None
    for prompt in (row.prompt for row in rows):
        text = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        length = len(tok(text, add_special_tokens=False)["input_ids"])
        shortest = length if shortest is None else min(shortest, length)
        if length <= max_prompt_tokens:
            out.append(prompt)
        if len(out) == limit:
            break
    if not out:
        found = f"the shortest is {shortest} tokens with the chat template" if shortest else "it holds no prompt"
        raise SystemExit(
            f"--max-prompt-tokens {max_prompt_tokens}: no prompt of --prompts {path} is that short ({found}); "
            + (f"use --max-prompt-tokens {shortest} or more" if shortest else "give a file with prompts")
        )
    return out


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    check_args(args)
    return args


def build_parser():
    p = cli_options.parser("mars-bench loadtest", __doc__)
    # passed to mars-serve as Hydra overrides
    cli_options.add_model(
        p,
        default="smollm2-135m",
        model_help="conf/model/ name (model=...)",
        checkpoint_help="a train.py checkpoint folder (checkpoint=...)",
    )
    p.add_argument("--policies", default="tau1.0,tau0.9,adaptive", help=f"comma list of {list(POLICIES)}")
    p.add_argument("--rates", default="0.1,0.2,0.3,0.45,0.6", help="offered requests/s, increasing")
    p.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per level")
    p.add_argument("--level-limit", type=float, default=120.0, help="a level is cut this many seconds after it started")
    p.add_argument("--timeout", type=float, default=110.0, help="per-request client timeout (s)")
    p.add_argument("--max-tokens", type=int, default=32, help="new tokens per request at most")
    p.add_argument("--max-prompt-tokens", type=int, default=96, help="longer prompts are skipped")
    add_server_arguments(p)
    p.add_argument("--burst-max-tokens", type=int, default=16, help="new tokens per request of the burst")
    p.add_argument("--no-burst", action="store_true")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    p.add_argument(
        "--prompts",
        default=str(data_dir() / "prompts" / "heldout.jsonl"),
        help="JSONL, a 'prompt' string or 'messages' per row",
    )
    cli_options.add_out(p, "results/serving_load")
    return p


def add_server_arguments(p) -> None:
    """The servers' settings (Hydra overrides of every policy's mars-serve)."""
    p.add_argument("--max-batch", type=int, default=8, help="the server's max_batch")
    p.add_argument("--max-queue", type=int, default=16, help="the server's max_queue")
    p.add_argument(
        "--threshold-min",
        "--tau-min",
        dest="threshold_min",
        type=float,
        default=0.9,
        help="the adaptive policy's lower bound (the server's tau_min)",
    )
    p.add_argument("--adaptive-signal", default="queue", choices=["queue", "latency"])
    p.add_argument(
        "--target-queue",
        type=float,
        default=None,
        help="adaptive.target_queue (default: half of max_batch: relax once the batch is half full "
        "and requests keep coming)",
    )
    p.add_argument("--threads", type=int, default=1, help="server torch threads")
    p.add_argument(
        "--max-step-columns",
        default=None,
        help="the servers' decoding.max_step_columns: cap on the columns of a batched step (masks dropped first); "
        "an integer, null (no cap) or auto (serve.yaml's default: 8 on a CPU, no cap on a GPU)",
    )
    cli_options.add_dtype(p)


# Bounds of a run that ends: a level offers at most MAX_LEVEL_REQUESTS requests (the client's connection pool)
# over at most MAX_SECONDS, at most MAX_RATE requests per second
MAX_RATE = 100.0
MAX_SECONDS = 3600.0
MAX_LEVEL_REQUESTS = 2000
MAX_QUEUE = 1000  # the burst sends 4x max_queue requests at once


def check_args(args) -> None:
    """Every flag in its range, before any server starts: each refusal names the flag, the value and the range
    (a negative, zero, NaN or infinite rate or duration would leave a level's schedule without end)."""
    args.policies = cli_options.comma_list(args.policies, "--policies", allowed=POLICIES)
    repeated = sorted({p for p in args.policies if args.policies.count(p) > 1})
    if repeated:
        raise SystemExit(f"--policies names {repeated} more than once; list each policy once")
    args.rates = cli_options.comma_list(args.rates, "--rates", float)
    for rate in args.rates:
        if not (math.isfinite(rate) and 0 < rate <= MAX_RATE):
            raise SystemExit(f"--rates: {rate!r} is not an offered load; each rate must be in (0, {MAX_RATE:g}] req/s")
    if any(b <= a for a, b in zip(args.rates, args.rates[1:])):
        raise SystemExit(f"--rates must increase from level to level (each once), got {args.rates}")
    _in_range("--duration", args.duration, 0, MAX_SECONDS, "seconds of arrivals per level")
    busiest = max(args.rates) * args.duration
    if busiest > MAX_LEVEL_REQUESTS:
        raise SystemExit(
            f"--rates {max(args.rates):g} x --duration {args.duration:g} offers about {busiest:.0f} requests in one "
            f"level, more than the {MAX_LEVEL_REQUESTS} a level may send; lower the rate or the duration"
        )
    _in_range("--level-limit", args.level_limit, 0, 2 * MAX_SECONDS, "seconds after a level started")
    if args.level_limit < args.duration:
        raise SystemExit(
            f"--level-limit {args.level_limit:g} is shorter than --duration {args.duration:g}: a level would be cut "
            "while its arrivals are still being sent; use a level limit >= the duration"
        )
    _in_range("--timeout", args.timeout, 0, 2 * MAX_SECONDS, "seconds per request")
    check_server_args(args)


def check_server_args(args) -> None:
    """The servers' and the burst's sizes, the adaptive policy's bounds and the column cap."""
    for flag, value, low in (
        ("--max-tokens", args.max_tokens, 1),
        ("--burst-max-tokens", args.burst_max_tokens, 1),
        ("--max-prompt-tokens", args.max_prompt_tokens, 1),
        ("--max-batch", args.max_batch, 1),
        ("--threads", args.threads, 1),
        ("--max-queue", args.max_queue, 0),
    ):
        if value < low:
            raise SystemExit(f"{flag} must be >= {low}, got {value}")
    if args.max_queue > MAX_QUEUE:
        raise SystemExit(
            f"--max-queue must be <= {MAX_QUEUE} (the burst sends 4x as many requests), got {args.max_queue}"
        )
    if args.max_queue == 0 and not args.no_burst:
        raise SystemExit("--max-queue 0 leaves the burst (4 x max_queue requests) empty: pass --no-burst as well")
    if not (math.isfinite(args.threshold_min) and 0 < args.threshold_min <= 1):
        raise SystemExit(f"--threshold-min must be in (0, 1], got {args.threshold_min!r}")
    if args.threshold_min > 0.9 and "tau0.9" in args.policies:
        raise SystemExit(
            "--threshold-min must be <= 0.9 for the tau0.9 policy (the server's bounds hold its threshold)"
        )
    if args.target_queue is not None and not (math.isfinite(args.target_queue) and args.target_queue > 0):
        raise SystemExit(f"--target-queue must be a positive number of requests, got {args.target_queue!r}")
    args.max_step_columns = _step_columns(args.max_step_columns)


def _in_range(flag: str, value: float, low: float, high: float, unit: str) -> None:
    """``value`` in (low, high], finite."""
    if not (math.isfinite(value) and low < value <= high):
        raise SystemExit(f"{flag} must be in ({low:g}, {high:g}] {unit}, got {value!r}")


def _step_columns(value: str | None) -> str | None:
    """``--max-step-columns`` as mars-serve takes it: an integer >= 1, null or auto (None: serve.yaml's default)."""
    if value is None:
        return None
    if value.strip().lower() in ("null", "none", "auto"):
        return "auto" if value.strip().lower() == "auto" else "null"
    try:
        columns = int(value)
    except ValueError:
        columns = 0
    if columns < 1:
        raise SystemExit(f"--max-step-columns takes an integer >= 1, null or auto, got {value!r}")
    return str(columns)


def server_overrides(args) -> list[str]:
    """The Hydra overrides every policy's server shares."""
    common = [
        f"model={args.model}",
        f"max_batch={args.max_batch}",
        f"max_queue={args.max_queue}",
        f"max_tokens={args.max_tokens}",
        f"threads={args.threads}",
        f"dtype={args.dtype}",
        f"tau_min={args.threshold_min}",
        f"adaptive.signal={args.adaptive_signal}",
        f"adaptive.target_queue={args.target_queue or max(1, args.max_batch // 2)}",
    ]
    if args.max_step_columns is not None:
        common.append(f"decoding.max_step_columns={args.max_step_columns}")
    return common + ([f"checkpoint={args.checkpoint}"] if args.checkpoint else [])


def main(argv=None) -> None:
    args = parse_args(argv)
    from mars.hardware import describe

    out = Path(args.out)
    prompts = load_prompts(Path(args.prompts), args.max_prompt_tokens, limit=400)
    started = time.monotonic()

    def say(msg: str) -> None:
        print(f"[{time.monotonic() - started:6.0f}s] {msg}", flush=True)

    # All servers run side by side (an idle one costs next to nothing) and the levels interleave the
    # policies, rate by rate, in rotating order: on a machine shared with other jobs, every policy then
    # meets the same background load.
    common = server_overrides(args)
    servers: dict[str, ServerProcess] = {}
    with servers_stopped_on_exit(servers, say):  # filled inside: a failed start stops the ones before it
        for p in args.policies:
            servers[p] = ServerProcess(common + POLICIES[p], out / "server_logs" / p)
        levels, traces, bursts = run_levels(servers, args, prompts, say)
    results = [r for _, _, res in levels for r in res]  # in the order they ran
    levels.sort(key=lambda x: (args.policies.index(x[0]), x[1]))
    reference, consistency = reference_outputs(results)
    rows = [{"policy": policy, "offered_rps": rate, **summarise(res, reference)} for policy, rate, res in levels]
    machine = describe() | {"server_threads": args.threads}
    write_outputs(out, rows, results, traces, bursts, vars(args), machine, consistency)
    print((out / "table.md").read_text())
    say(f"wrote {out}")


def run_levels(servers: dict, args, prompts: list[str], say) -> tuple[list, dict, dict]:
    """Every (rate, policy) level, policies in rotating order per rate; then the burst (at threshold 1.0)."""
    traces: dict[str, list] = {}
    levels: list[tuple[str, float, list[Result]]] = []
    names = {}
    for p, server in servers.items():
        server.wait_ready()
        names[p] = _served_name(server.url)
        say(f"{p}: serving {names[p]} at {server.url}")
    policies = args.policies
    for i, rate in enumerate(args.rates):
        arrivals = schedule(rate, args.duration, args.seed)
        for policy in policies[i % len(policies) :] + policies[: i % len(policies)]:
            server = servers[policy]
            # every level starts at the first prompt: threshold 1.0 outputs of one prompt at different loads
            # must be identical, and every policy is compared with them
            level = run_level(
                server.url,
                names[policy],
                policy,
                rate,
                arrivals,
                prompts,
                0,
                args.max_tokens,
                args.level_limit,
                args.timeout,
            )
            res, trace = asyncio.run(level)
            asyncio.run(wait_idle(server.url))
            traces[f"{policy}@{rate:g}"] = trace
            levels.append((policy, rate, res))
            ok = [r for r in res if r.status == 200]
            say(f"{policy} @ {rate:g} req/s: {len(ok)}/{len(res)} ok, p95 {fmt(pct([r.latency for r in ok], 95), 1)} s")
    bursts = {}
    if "tau1.0" in servers and not args.no_burst:
        tokens = args.burst_max_tokens
        bursts = asyncio.run(burst(servers["tau1.0"], names["tau1.0"], 4 * args.max_queue, tokens, args.timeout))
        say(f"burst: {bursts}")
    return levels, traces, bursts


def _served_name(url: str) -> str:
    import httpx

    return httpx.get(url + "/v1/models").json()["data"][0]["id"]


if __name__ == "__main__":
    main()
