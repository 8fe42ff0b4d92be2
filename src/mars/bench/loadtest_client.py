"""The load test's client and servers: a server subprocess per policy (``mars-serve`` on a free loopback port),
open-loop Poisson arrivals, streaming chat requests recorded per request (:class:`Result`), the server's own
statistics sampled during a level, and a burst past the queue limit.  Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

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


def schedule(rate: float, duration: float, seed: int) -> list[float]:
    """Poisson arrival times in [0, duration) (seeded per rate: every policy sees the same arrivals)."""
    rng = random.Random(f"{seed}-{rate}")
    t, out = 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        out.append(t)


# the server as the ``mars-serve`` console script runs it, in this interpreter: a checkout and an installed wheel alike
SERVE = [sys.executable, "-m", "mars.cli.serve"]


class ServerProcess:
    """``mars-serve`` with ``overrides`` on a free loopback port, its output in ``log_dir/server.log``."""

    def __init__(self, overrides: list[str], log_dir: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        log_dir = log_dir.resolve()
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log = open(log_dir / "server.log", "w")
        cmd = [*SERVE, "host=127.0.0.1", f"port={self.port}", f"hydra.run.dir={log_dir}", "log_level=warning"]
        self.proc = subprocess.Popen([*cmd, *overrides], stdout=self.log, stderr=subprocess.STDOUT)
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


@contextlib.contextmanager
def servers_stopped_on_exit(servers: dict[str, ServerProcess], say=lambda msg: None):
    """Stop every server when the block ends, however it ends: a SIGTERM (``kill``, a job scheduler) exits
    through here as it does for Ctrl-C, so no ``mars-serve`` outlives the load test that started it."""

    def exit_on_sigterm(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, exit_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        for name, server in servers.items():
            say(f"{name}: server stopped (exit {server.stop()})")


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
