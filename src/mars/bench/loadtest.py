"""Bounded load test of ``serve.py`` over loopback: throughput, latency and time to first token against
offered load for several threshold policies (fixed 1.0 or 0.9, adaptive, and ``verify``: every request asks for
lossless verified decoding), the quality cost of lowering the threshold, and a burst past the queue limit.

    mars-bench loadtest --out results/serving_load              # the published run
    mars-bench loadtest --rates 0.1,0.3 --duration 20 --policies tau1.0,adaptive --out /tmp/lt

For each policy a fresh server subprocess (``python serve.py ... host=127.0.0.1``) is started on a free
port.  Each load level offers an open-loop Poisson stream of streaming chat requests at a fixed rate for
a fixed duration (the same arrival times and prompts for every policy: prompts from
``data/prompts/heldout.jsonl``, in file order, short enough to keep prefill cheap); a level ends when
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
and ``config.json`` (arguments, machine, git commit).
"""

from __future__ import annotations

import asyncio
import csv
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
POLICIES = {
    "tau1.0": ["tau_policy=fixed", "threshold=1.0"],
    "tau0.9": ["tau_policy=fixed", "threshold=0.9"],
    "adaptive": ["tau_policy=adaptive"],
    "verify": ["tau_policy=fixed", "threshold=1.0"],  # every request asks for lossless verified decoding
}
REQUEST_FIELDS = {"verify": {"verify": True}}  # per-policy request body fields, beside the server's settings


@dataclass
class Result:
    policy: str
    rate: float
    k: int  # request number in its level
    prompt: int  # prompt index
    offset: float  # scheduled arrival, seconds after the level started
    start: float = 0.0
    end: float = 0.0
    ttft: float | None = None
    status: int = 0  # HTTP status; 0 = no answer (timeout / cut at the level's limit)
    completion_tokens: int = 0
    forwards: int = 0
    served_threshold: float | None = None
    served_verify: bool | None = None  # whether the server decoded the request with verification
    finish_reason: str | None = None
    error: str | None = None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)

    @property
    def latency(self) -> float:
        return self.end - self.start


# ------------------------------------------------------------------------------------------------ prompts
def load_prompts(path: Path, max_prompt_tokens: int, limit: int) -> list[str]:
    """The first ``limit`` prompts of the JSONL file ``path`` of at most ``max_prompt_tokens`` tokens with the chat
    template; a file that cannot be read, a row without a ``prompt`` string, or no prompt that short is refused
    naming the flag (before any server starts)."""
    from mars.models import embedded_tokenizer

    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise SystemExit(f"--prompts {path}: {getattr(err, 'strerror', None) or err}") from None
    tok = embedded_tokenizer()
    out, shortest = [], None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            prompt = json.loads(line).get("prompt")
        except (json.JSONDecodeError, AttributeError):
            prompt = None
        if not isinstance(prompt, str) or not prompt.strip():
            raise SystemExit(f"--prompts {path}, line {number}: every row needs a non-empty 'prompt' string")
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


def schedule(rate: float, duration: float, seed: int) -> list[float]:
    """Poisson arrival times in [0, duration) (seeded per rate: every policy sees the same arrivals)."""
    rng = random.Random(f"{seed}-{rate}")
    t, out = 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        out.append(t)


# ------------------------------------------------------------------------------------------------ server
class ServerProcess:
    def __init__(self, overrides: list[str], log_dir: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log = open(log_dir / "server.log", "w")
        cmd = [
            sys.executable,
            "serve.py",
            "host=127.0.0.1",
            f"port={self.port}",
            f"hydra.run.dir={log_dir}",
            "log_level=warning",
            *overrides,
        ]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 300) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}); see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError("the server did not become ready")

    def rss_mb(self) -> float:
        import psutil

        return psutil.Process(self.proc.pid).memory_info().rss / 2**20

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


# ------------------------------------------------------------------------------------------------ client
async def one_request(client, model: str, prompt: str, max_tokens: int, r: Result, timeout: float) -> Result:
    """One streaming chat request of ``r.policy`` (with that policy's request fields), recorded into ``r``."""
    import openai

    r.start = time.monotonic()
    try:
        async with asyncio.timeout(timeout):
            stream = await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=max_tokens,
                stream=True,
                extra_body={"return_token_ids": True, **REQUEST_FIELDS.get(r.policy, {})},
            )
            async for ch in stream:
                mars = ch.model_extra.get("mars") or {}
                if r.ttft is None and mars.get("tokens"):
                    r.ttft = time.monotonic() - r.start
                r.token_ids += mars.get("token_ids") or []
                if ch.choices:
                    r.text += ch.choices[0].delta.content or ""
                    if ch.choices[0].finish_reason:
                        r.finish_reason = ch.choices[0].finish_reason
                        r.completion_tokens = mars.get("completion_tokens", len(r.token_ids))
                        r.forwards = mars.get("forwards", 0)
                        r.served_threshold = mars.get("threshold")
                        r.served_verify = mars.get("verify")
        r.status = 200
    except openai.APIStatusError as err:
        r.status, r.error = err.status_code, str(err)[:200]
    except TimeoutError:
        r.status, r.error = 0, "timeout"
    except asyncio.CancelledError:
        r.status, r.error = 0, "cut at the level's time limit"
        r.end = time.monotonic()
        raise
    except Exception as err:  # connection errors and the like
        r.status, r.error = -1, f"{type(err).__name__}: {err}"[:200]
    r.end = time.monotonic()
    return r


async def sample_stats(url: str, out: list, t0: float, stop: asyncio.Event) -> None:
    import httpx

    async with httpx.AsyncClient(timeout=2) as h:
        while not stop.is_set():
            try:
                s = (await h.get(url + "/stats")).json()
                out.append(
                    {
                        "t": time.monotonic() - t0,
                        "tau": s["tau"],
                        "queued": s["queued"],
                        "running": s["running"],
                        "tokens_per_second": s["tokens_per_second"],
                    }
                )
            except Exception:
                pass
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except TimeoutError:
                pass


async def run_level(
    url: str,
    model: str,
    policy: str,
    rate: float,
    arrivals: list[float],
    prompts: list[str],
    first_prompt: int,
    max_tokens: int,
    limit_s: float,
    timeout_s: float,
) -> tuple[list[Result], list]:
    import httpx
    import openai

    client = openai.AsyncOpenAI(
        base_url=url + "/v1",
        api_key="unused",
        max_retries=0,
        timeout=timeout_s,
        http_client=openai.DefaultAsyncHttpxClient(
            limits=httpx.Limits(max_connections=2000, max_keepalive_connections=200)
        ),
    )
    results = [Result(policy, rate, k, (first_prompt + k) % len(prompts), off) for k, off in enumerate(arrivals)]
    trace: list = []
    stop = asyncio.Event()
    t0 = time.monotonic()
    sampler = asyncio.create_task(sample_stats(url, trace, t0, stop))
    tasks = []
    for r in results:
        await asyncio.sleep(max(0.0, t0 + r.offset - time.monotonic()))
        tasks.append(asyncio.create_task(one_request(client, model, prompts[r.prompt], max_tokens, r, timeout_s)))
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=max(0.1, t0 + limit_s - time.monotonic()))
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    stop.set()
    await sampler
    await client.close()
    return results, trace


async def wait_idle(url: str, timeout: float = 120) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=2) as h:
        while time.monotonic() < deadline:
            s = (await h.get(url + "/stats")).json()
            if s["queued"] == 0 and s["running"] == 0:
                return
            await asyncio.sleep(0.25)


async def burst(server: ServerProcess, model: str, n: int, max_tokens: int, timeout_s: float) -> dict:
    import httpx

    rss = [server.rss_mb()]
    done = asyncio.Event()

    async def watch():
        while not done.is_set():
            rss.append(server.rss_mb())
            await asyncio.sleep(0.1)

    watcher = asyncio.create_task(watch())
    t0 = time.monotonic()
    async with httpx.AsyncClient(
        base_url=server.url, timeout=timeout_s, limits=httpx.Limits(max_connections=n + 10)
    ) as h:

        async def post(i):
            try:
                r = await h.post(
                    "/v1/chat/completions",
                    json={
                        "model": model,
                        "max_tokens": max_tokens,
                        "messages": [{"role": "user", "content": f"Say something about the number {i}."}],
                    },
                )
                return r.status_code
            except Exception as err:
                return f"{type(err).__name__}"

        codes = await asyncio.gather(*[post(i) for i in range(n)])
        seconds = time.monotonic() - t0
        healthy = (await h.get("/health")).status_code == 200
    done.set()
    await watcher
    counts: dict[str, int] = {}
    for c in codes:
        counts[str(c)] = counts.get(str(c), 0) + 1
    return {
        "requests": n,
        "codes": counts,
        "seconds": round(seconds, 2),
        "healthy_after": healthy,
        "all_answered_200_429_503": all(c in (200, 429, 503) for c in codes),
        "rss_mb_before": round(rss[0], 1),
        "rss_mb_peak": round(max(rss), 1),
        "rss_mb_after": round(server.rss_mb(), 1),
    }


# ------------------------------------------------------------------------------------------------ analysis
def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q / 100 * len(v)) - 1))]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def summarise(results: list[Result], reference: dict[int, list[int]]) -> dict:
    ok = [r for r in results if r.status == 200]
    rejected = sum(r.status in (429, 503) for r in results)
    failed = sum(r.status not in (200, 429, 503) for r in results)
    span = (max(r.end for r in ok) - min(r.start for r in results)) if ok else float("nan")
    tokens = sum(r.completion_tokens for r in ok)
    forwards = sum(r.forwards for r in ok)
    compared = [r for r in ok if r.prompt in reference]
    exact = [r.token_ids == reference[r.prompt] for r in compared]
    prefix = [common_prefix(r.token_ids, reference[r.prompt]) / max(1, len(reference[r.prompt])) for r in compared]
    thresholds = [r.served_threshold for r in ok if r.served_threshold is not None]
    return {
        "requests": len(results),
        "completed": len(ok),
        "rejected": rejected,
        "failed": failed,
        "achieved_rps": len(ok) / span if ok else 0.0,
        "tokens_per_s": tokens / span if ok else 0.0,
        "latency_p50": pct([r.latency for r in ok], 50),
        "latency_p95": pct([r.latency for r in ok], 95),
        "ttft_p50": pct([r.ttft for r in ok if r.ttft is not None], 50),
        "ttft_p95": pct([r.ttft for r in ok if r.ttft is not None], 95),
        "mean_tau": sum(thresholds) / len(thresholds) if thresholds else None,
        "tokens_per_forward": tokens / forwards if forwards else None,
        "mean_completion_tokens": tokens / len(ok) if ok else None,
        "agreement_exact": sum(exact) / len(exact) if exact else None,
        "agreement_prefix": sum(prefix) / len(prefix) if prefix else None,
    }


def fmt(x, d=2) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{d}f}"


def write_outputs(
    out: Path,
    rows: list[dict],
    results: list[Result],
    traces: dict,
    bursts: dict,
    args,
    machine: dict,
    consistency: dict,
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "levels.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    write_requests(out, results)
    (out / "burst.json").write_text(json.dumps(bursts, indent=2) + "\n")
    (out / "traces.json").write_text(json.dumps(traces) + "\n")
    (out / "config.json").write_text(
        json.dumps({"args": vars(args), "machine": machine, "tau1_consistency": consistency}, indent=2) + "\n"
    )
    (out / "table.md").write_text(table_md(rows, bursts, args, machine, consistency))
    plot(out / "serving_load.png", rows, traces)


# requests.csv columns (file keys kept as published: served_tau is the served threshold)
REQUEST_COLUMNS = (
    "policy",
    "offered_rps",
    "k",
    "prompt",
    "offset_s",
    "status",
    "latency_s",
    "ttft_s",
    "completion_tokens",
    "forwards",
    "served_tau",
    "finish_reason",
    "error",
)


def write_requests(out: Path, results: list[Result]) -> None:
    """``requests.csv`` (every request) and ``outputs.jsonl`` (the answered ones' tokens and text)."""
    with open(out / "requests.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(REQUEST_COLUMNS)
        for r in results:
            w.writerow(
                [
                    r.policy,
                    r.rate,
                    r.k,
                    r.prompt,
                    f"{r.offset:.3f}",
                    r.status,
                    f"{r.latency:.3f}",
                    fmt(r.ttft, 3),
                    r.completion_tokens,
                    r.forwards,
                    r.served_threshold,
                    r.finish_reason,
                    r.error,
                ]
            )
    with open(out / "outputs.jsonl", "w") as f:
        for r in results:
            if r.status == 200:
                row = {"policy": r.policy, "offered_rps": r.rate, "prompt": r.prompt, "served_tau": r.served_threshold}
                f.write(json.dumps({**row, "token_ids": r.token_ids, "text": r.text}) + "\n")


def saturation_check(rows: list[dict], duration: float | None = None) -> str:
    """The first level at which tau=1.0 completes less than 0.9x what arrived (the requests a level's Poisson
    stream actually sent over ``duration``, not its nominal rate: 35 arrivals in 30 s at a nominal 1.5 req/s
    is 1.17), and how the other policies did at that level."""
    base = [r for r in rows if r["policy"] == "tau1.0"]
    if not base:
        return ""

    def arrived(r: dict) -> float:
        return r["requests"] / duration if duration and r.get("requests") else r["offered_rps"]

    sat = next((r for r in base if r["achieved_rps"] < 0.9 * arrived(r)), None)
    if sat is None:
        return f"tau=1.0 kept up with every level (up to an offered {base[-1]['offered_rps']:g} req/s)."
    lines = [
        f"tau=1.0 saturates at an offered {sat['offered_rps']:g} req/s ({arrived(sat):.2f} arrived per second; "
        f"it completes {sat['achieved_rps']:.3f} req/s)."
    ]
    for name in ("adaptive", "tau0.9", "verify"):
        other = next((r for r in rows if r["policy"] == name and r["offered_rps"] == sat["offered_rps"]), None)
        if other and sat["achieved_rps"]:
            lines.append(
                f"At that load {name} completes {other['achieved_rps'] / sat['achieved_rps']:.2f}x the requests/s "
                f"({other['tokens_per_s'] / max(sat['tokens_per_s'], 1e-9):.2f}x the tokens/s) at p95 latency "
                f"{fmt(other['latency_p95'], 1)} s vs {fmt(sat['latency_p95'], 1)} s; its outputs are identical to "
                f"tau=1.0's for {fmt(100 * other['agreement_exact'] if other['agreement_exact'] is not None else None, 0)}% "
                f"of the requests (mean shared prefix {fmt(100 * other['agreement_prefix'] if other['agreement_prefix'] is not None else None, 0)}%)."
            )
    return " ".join(lines)


def table_cells(r: dict) -> list[str]:
    """One level's row of ``table.md``."""
    return [
        r["policy"],
        f"{r['offered_rps']:g}",
        str(r["requests"]),
        str(r["completed"]),
        str(r["rejected"]),
        str(r["failed"]),
        fmt(r["achieved_rps"], 3),
        fmt(r["tokens_per_s"], 1),
        fmt(r["latency_p50"], 1),
        fmt(r["latency_p95"], 1),
        fmt(r["ttft_p50"], 2),
        fmt(r["ttft_p95"], 2),
        fmt(r["mean_tau"], 3),
        fmt(r["tokens_per_forward"], 2),
        fmt(r["mean_completion_tokens"], 1),
        fmt(None if r["agreement_exact"] is None else 100 * r["agreement_exact"], 0) + "%",
        fmt(None if r["agreement_prefix"] is None else 100 * r["agreement_prefix"], 0) + "%",
    ]


def table_md(rows: list[dict], bursts: dict, args, machine: dict, consistency: dict) -> str:
    head = (
        "| policy | offered req/s | requests | done | 429/503 | failed | req/s | tokens/s | p50 latency s | "
        "p95 latency s | p50 TTFT s | p95 TTFT s | mean tau | tok/fwd | tokens/req | identical to tau=1.0 | "
        "shared prefix |"
    )
    lines = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    lines += ["| " + " | ".join(table_cells(r)) + " |" for r in rows]
    b = bursts
    text = [
        f"# Serving load test ({args.model}{', checkpoint ' + args.checkpoint if args.checkpoint else ''})",
        "",
        f"Machine: {machine.get('cpu')} ({machine.get('cpu_capability')}, native bf16: {machine.get('cpu_native_bf16')}), "
        f"{os.cpu_count()} cores shared with other jobs; server dtype {args.dtype}, {args.threads} torch thread(s), "
        f"max_batch={args.max_batch}, max_queue={args.max_queue}, block size 4, cache=cursor, max_step_columns="
        f"{args.max_step_columns or 'auto'}.",
        f"Each level: Poisson arrivals for {args.duration:g} s (same arrivals and prompts for every policy), streaming "
        f"chat requests of at most {args.max_tokens} new tokens, greedy, prompts from data/prompts/heldout.jsonl of at "
        f"most {args.max_prompt_tokens} tokens; a level is cut {args.level_limit:g} s after it started. req/s and "
        "tokens/s are completed work over the span from the first arrival to the last completion. "
        f"Adaptive: tau between {args.threshold_min} and 1.0, {args.adaptive_signal} signal, target_queue "
        f"{args.target_queue or max(1, args.max_batch // 2)} (other adaptive settings: conf/serve.yaml defaults). "
        "Verify: threshold 1.0, every request with `verify: true` (lossless: its outputs must equal tau=1.0's).",
        "",
        *lines,
        "",
        saturation_check(rows, args.duration),
        "",
        f"tau=1.0 outputs identical across load levels: {consistency.get('identical')}/{consistency.get('prompts')} "
        "prompts served more than once.",
        "",
        burst_line(b, args.max_queue),
        "",
    ]
    return "\n".join(text)


def burst_line(b: dict, max_queue: int) -> str:
    if not b:
        return "Burst: not run (--no-burst, or no tau1.0 server)."
    return (
        f"Burst: {b.get('requests')} simultaneous requests (4x max_queue={max_queue}) at tau=1.0: answers "
        f"{b.get('codes')}, all 200/429/503: {b.get('all_answered_200_429_503')}, healthy after: "
        f"{b.get('healthy_after')}, server RSS {b.get('rss_mb_before')} MB before, {b.get('rss_mb_peak')} MB peak, "
        f"{b.get('rss_mb_after')} MB after ({b.get('seconds')} s)."
    )


def plot(path: Path, rows: list[dict], traces: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    colors = {"tau1.0": "#1f5f99", "tau0.9": "#d9822b", "adaptive": "#2e8b57", "verify": "#8e44ad"}
    panels = [
        ("achieved_rps", None, "completed requests / s"),
        ("tokens_per_s", None, "generated tokens / s"),
        ("latency_p50", "latency_p95", "latency s (p50 solid, p95 dashed)"),
        ("ttft_p50", "ttft_p95", "time to first token s (p50 solid, p95 dashed)"),
        ("agreement_exact", None, "outputs identical to tau=1.0"),
    ]
    for ax, (key, key2, title) in zip(axes.flat, panels):
        for p in policies:
            pts = [r for r in rows if r["policy"] == p]
            x = [r["offered_rps"] for r in pts]
            c = colors.get(p)
            ax.plot(x, [r[key] if r[key] is not None else float("nan") for r in pts], "o-", color=c, label=p)
            if key2:
                ax.plot(x, [r[key2] if r[key2] is not None else float("nan") for r in pts], "s--", color=c)
        if key == "achieved_rps":
            lim = max(r["offered_rps"] for r in rows)
            ax.plot([0, lim], [0, lim], ":", color="grey", label="offered")
        ax.set_title(title)
        ax.set_xlabel("offered requests / s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes.flat[5]
    for key, trace in traces.items():
        if key.startswith("adaptive") and trace:
            ax.plot([t["t"] for t in trace], [t["tau"] for t in trace], label=key.replace("adaptive@", "offered "))
    ax.set_title("adaptive: server tau during each level")
    ax.set_xlabel("seconds into the level")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------ main
def parse_args(argv=None):
    from mars.bench import cli_options

    p = cli_options.parser("mars-bench loadtest", __doc__)
    # passed to serve.py as Hydra overrides
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
    p.add_argument("--burst-max-tokens", type=int, default=16, help="new tokens per request of the burst")
    p.add_argument("--no-burst", action="store_true")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    p.add_argument("--prompts", default=str(REPO / "data" / "prompts" / "heldout.jsonl"), help="JSONL, 'prompt' field")
    cli_options.add_out(p, str(REPO / "results" / "serving_load"))
    args = p.parse_args(argv)
    check_args(args)
    return args


# Bounds of a run that ends: a level offers at most MAX_LEVEL_REQUESTS requests (the client's connection pool)
# over at most MAX_SECONDS, at most MAX_RATE requests per second
MAX_RATE = 100.0
MAX_SECONDS = 3600.0
MAX_LEVEL_REQUESTS = 2000
MAX_QUEUE = 1000  # the burst sends 4x max_queue requests at once


def check_args(args) -> None:
    """Every flag in its range, before any server starts: each refusal names the flag, the value and the range
    (a negative, zero, NaN or infinite rate or duration would leave a level's schedule without end)."""
    from mars.bench import cli_options

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
    """``--max-step-columns`` as serve.py takes it: an integer >= 1, null or auto (None: serve.yaml's default)."""
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
    servers = {p: ServerProcess(common + POLICIES[p], out / "server_logs" / p) for p in args.policies}
    try:
        levels, traces, bursts = run_levels(servers, args, prompts, say)
    finally:
        for p, server in servers.items():
            say(f"{p}: server stopped (exit {server.stop()})")
    results = [r for _, _, res in levels for r in res]  # in the order they ran
    levels.sort(key=lambda x: (args.policies.index(x[0]), x[1]))
    reference, consistency = reference_outputs(results)
    rows = [{"policy": policy, "offered_rps": rate, **summarise(res, reference)} for policy, rate, res in levels]
    write_outputs(out, rows, results, traces, bursts, args, describe() | {"server_threads": args.threads}, consistency)
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


def reference_outputs(results: list[Result]) -> tuple[dict[int, list[int]], dict]:
    """Threshold 1.0 outputs are the reference (they do not depend on the load); whether they agree across
    the levels where a prompt was served more than once."""
    reference: dict[int, list[int]] = {}
    seen: dict[int, set] = {}
    served: dict[int, int] = {}
    for r in results:
        if r.policy == "tau1.0" and r.status == 200:
            reference.setdefault(r.prompt, r.token_ids)
            seen.setdefault(r.prompt, set()).add(tuple(r.token_ids))
            served[r.prompt] = served.get(r.prompt, 0) + 1
    multi = [p for p in seen if served[p] > 1]
    return reference, {"prompts": len(multi), "identical": sum(len(seen[p]) == 1 for p in multi)}


def _served_name(url: str) -> str:
    import httpx

    return httpx.get(url + "/v1/models").json()["data"][0]["id"]


if __name__ == "__main__":
    main()
