"""Prometheus metrics of one server (its own registry, so several servers can live in one process) and
the short moving window behind the live figures (tokens/s, tokens per forward) of ``/stats`` and the UI.

Names (all prefixed ``mars_``):

=================================================  =========  ======================================================
``requests_total{endpoint,code}``                  counter    HTTP requests answered, by route and status code
``requests_finished_total{reason}``                counter    decoded requests by finish reason (eos, stop, length,
                                                              cancelled, error)
``queue_depth``                                    gauge      requests waiting for a row
``running_batch_size``                             gauge      rows in the running batch
``tau``                                            gauge      the server's current threshold (named by its symbol)
``tokens_per_second``                              gauge      generated tokens per second over the last ``window_s``
``tokens_per_forward``                             gauge      generated tokens per row-forward over the last
                                                              ``window_s`` (the per-request tokens-per-forward
                                                              figure, pooled)
``generated_tokens_total``                         counter    generated tokens (``rate()`` gives tokens/s)
``forwards_total``                                 counter    engine forward passes
``time_to_first_token_seconds``                    histogram  arrival to the first accepted token
``request_latency_seconds``                        histogram  arrival to the last token
``queue_wait_seconds``                             histogram  arrival to admission into the batch
``step_seconds``                                   histogram  one engine step (one batched forward)
``request_tokens_per_forward``                     histogram  each finished request's tokens / forwards
``spec_decode_num_drafts_total``                   counter    verify: steps that verified at least one draft
``spec_decode_num_draft_tokens_total``             counter    verify: draft tokens proposed
``spec_decode_num_accepted_tokens_total``          counter    verify: draft tokens accepted
``spec_decode_num_accepted_tokens_per_pos_total``  counter    the same per draft depth, label ``position`` (0: the
                                                              first draft)
=================================================  =========  ======================================================

The ``spec_decode`` counters are vLLM's (``vllm:spec_decode_*``) and are added from each finished request's
draft counts (cancelled requests included), so ``1 + rate(accepted) / rate(drafts)`` is vLLM's mean acceptance
length and ``rate(accepted) / rate(draft tokens)`` its draft acceptance rate (docs/decoding.md, "Acceptance
figures").
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Sequence

from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401  (re-exported for the route)
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4)
TPF_BUCKETS = (1.0, 1.1, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0)


class RecentRates:
    """Tokens, row-forwards and wall time over a sliding window (thread-safe)."""

    def __init__(self, window_s: float = 10.0):
        self.window_s = window_s
        self._events: collections.deque[tuple[float, int, int]] = collections.deque()
        self._lock = threading.Lock()

    def add(self, tokens: int, row_forwards: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._events.append((now, tokens, row_forwards))
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()

    def rates(self, now: float | None = None) -> tuple[float, float]:
        """(tokens per second, tokens per row-forward) over the window; zeros when idle."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._trim(now)
            tokens = sum(e[1] for e in self._events)
            forwards = sum(e[2] for e in self._events)
        return tokens / self.window_s, (tokens / forwards if forwards else 0.0)


class ServerMetrics:
    def __init__(self, window_s: float = 10.0):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("mars_requests", "HTTP requests answered", ["endpoint", "code"], registry=r)
        self.finished = Counter("mars_requests_finished", "Decoded requests by finish reason", ["reason"], registry=r)
        self.queue_depth = Gauge("mars_queue_depth", "Requests waiting for a row", registry=r)
        self.running = Gauge("mars_running_batch_size", "Rows in the running batch", registry=r)
        self.threshold = Gauge("mars_tau", "The server's current threshold", registry=r)
        self.tokens_per_second = Gauge(
            "mars_tokens_per_second", "Generated tokens per second (recent window)", registry=r
        )
        self.tokens_per_forward = Gauge(
            "mars_tokens_per_forward", "Generated tokens per row-forward (recent window)", registry=r
        )
        self.generated_tokens = Counter("mars_generated_tokens", "Generated tokens", registry=r)
        self.forwards = Counter("mars_forwards", "Engine forward passes", registry=r)
        self.ttft = Histogram(
            "mars_time_to_first_token_seconds", "Arrival to first accepted token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.latency = Histogram(
            "mars_request_latency_seconds", "Arrival to last token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.queue_wait = Histogram(
            "mars_queue_wait_seconds", "Arrival to admission", buckets=LATENCY_BUCKETS, registry=r
        )
        self.step_seconds = Histogram("mars_step_seconds", "One engine step", buckets=STEP_BUCKETS, registry=r)
        self.request_tpf = Histogram(
            "mars_request_tokens_per_forward", "Finished requests' tokens per forward", buckets=TPF_BUCKETS, registry=r
        )
        self.spec_drafts = Counter("mars_spec_decode_num_drafts", "Steps that verified at least one draft", registry=r)
        self.spec_draft_tokens = Counter("mars_spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r)
        self.spec_accepted_tokens = Counter("mars_spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.spec_accepted_per_pos = Counter(
            "mars_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted by draft depth",
            ["position"],
            registry=r,
        )
        self.recent = RecentRates(window_s)

    def observe_drafts(self, proposed: Sequence[int], accepted: Sequence[int], draft_steps: int) -> None:
        """One finished request's draft counts (``Finished.draft_proposed``, ``draft_accepted``, ``draft_steps``)."""
        if not draft_steps:
            return
        self.spec_drafts.inc(draft_steps)
        self.spec_draft_tokens.inc(sum(proposed))
        self.spec_accepted_tokens.inc(sum(accepted))
        for position, count in enumerate(accepted):
            self.spec_accepted_per_pos.labels(str(position)).inc(count)

    def observe_step(self, seconds: float, tokens: int, rows: int, now: float | None = None) -> None:
        self.step_seconds.observe(seconds)
        self.forwards.inc()
        self.generated_tokens.inc(tokens)
        self.recent.add(tokens, rows, now)

    def refresh(self, *, queued: int, running: int, threshold: float, now: float | None = None) -> None:
        self.queue_depth.set(queued)
        self.running.set(running)
        self.threshold.set(threshold)
        tps, tpf = self.recent.rates(now)
        self.tokens_per_second.set(tps)
        self.tokens_per_forward.set(tpf)

    def render(self) -> bytes:
        return generate_latest(self.registry)
