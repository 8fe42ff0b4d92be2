"""The engine loop: one thread owns the model and the :class:`~mars.decoding.engine.DecodeEngine` and runs
continuous batching; HTTP handlers only submit jobs and read their events.

Each iteration: take cancellations and admit waiting jobs into free rows (at the threshold the
policy gives them *now*, not when they arrived, and running rows follow later changes of it), run one engine
step (one batched forward), turn each
row's accepted tokens into a text delta and hand it to the job's sink (the handler's asyncio queue),
update the policy and the metrics.  Bounded memory: at most ``max_batch`` rows and ``max_queue``
waiting jobs beyond the free rows; :meth:`EngineLoop.submit` refuses more (the route answers 429).

Failure isolation: work that belongs to one job runs inside a try block per job, and a failure there
fails that job only (its row is cancelled and leaves at the next step).  That includes everything a row
needs that can fail on its own before it joins the batch: its request (threshold, budget, stop strings)
and its sampler, whose seed ``torch.Generator`` may refuse (the engine would build it inside the
batched admission, where one bad seed would fail every row); then detokenizing and delivering to its client.
Where a failure happens inside the engine, it is narrowed down to the job it belongs to: an admission into
an empty engine that fails is retried one job at a time on a new engine (only the job that fails again
fails); a job joining running rows takes its first step apart from them, and the engine fails that one alone
(:meth:`~mars.decoding.engine.DecodeEngine.step`); a step that fails before a job decoded any token sends
that job back to the head of the queue, to be admitted on its own.  Only the rows that had decoded tokens
when a batched forward failed are lost with it (500): their state went with the step.  The engine is then
rebuilt empty and the loop goes on with the queue.  Cancellation (a client that disconnected) marks the row;
the engine retires it at its next step.

Shutdown (:meth:`EngineLoop.drain`): new jobs are refused at once (503), running and waiting ones get the
grace period, then what is left is cancelled with 503 and the thread ends.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from mars.decoding.engine import DecodeEngine
from mars.decoding.stats import ACCEPTANCE_KEYS, acceptance_figures

from .metrics import ServerMetrics
from .policy import LoadSample, ThresholdPolicy
from .textstream import TextStream

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """No room for more waiting jobs (HTTP 429)."""


class Unavailable(RuntimeError):
    """The loop is shutting down or has stopped (HTTP 503)."""


@dataclass
class JobEvent:
    """What a job's client receives: a text delta with the tokens of one forward, or the end."""

    job: Job
    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # the ids this row accepted in this forward
    forward: int = 0  # this request's own forward count (1-based)
    done: bool = False
    finish_reason: str | None = None  # eos | stop | length | cancelled | error
    final_text: str | None = None
    error: str | None = None
    status: int = 200  # HTTP status that an error maps to

    @property
    def tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class Job:
    """One prompt to decode for one client (a multi-prompt request has one job per prompt)."""

    prompt_ids: list[int]
    max_new_tokens: int
    threshold: float | None = None  # requested; None = the server's current one
    stop: list[str] | None = None
    temperature: float = 0.0
    seed: int | None = None
    verify: bool = False
    options: dict = field(default_factory=dict)  # other per-request DecodingSettings fields (lookup_ngram, ...)
    index: int = 0  # choice index in the response
    streaming: bool = True  # per-forward events (False: only the final one)
    sink: Callable[[JobEvent], None] | None = None  # called on the loop thread; must not block
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # filled by the loop
    created: float = field(default_factory=time.monotonic)
    admitted: float | None = None
    first_token: float | None = None
    finished: float | None = None
    served_threshold: float | None = None
    forwards: int = 0
    completion_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)  # final generated ids (set when it finishes)
    acceptance: dict = field(default_factory=dict)  # verify: vLLM's acceptance figures (set when it finishes)
    failed: bool = False
    stream: TextStream | None = None
    alone: bool = False  # a step failed before this job decoded anything: it is admitted on its own next time

    @property
    def tokens_per_forward(self) -> float:
        return self.completion_tokens / self.forwards if self.forwards else 0.0

    def stats(self) -> dict:
        end = self.finished if self.finished is not None else time.monotonic()
        return {
            "threshold": self.served_threshold,
            "verify": self.verify,
            "forwards": self.forwards,
            "completion_tokens": self.completion_tokens,
            "tokens_per_forward": round(self.tokens_per_forward, 4),
            "queue_seconds": None if self.admitted is None else round(self.admitted - self.created, 4),
            "ttft_seconds": None if self.first_token is None else round(self.first_token - self.created, 4),
            "latency_seconds": round(end - self.created, 4),
            **({key: self.acceptance.get(key) for key in ACCEPTANCE_KEYS} if self.verify else {}),
        }


class EngineLoop:
    def __init__(
        self,
        make_engine: Callable[[], DecodeEngine],
        policy: ThresholdPolicy,
        metrics: ServerMetrics,
        tokenizer,
        eos_ids: Sequence[int],
        *,
        max_batch: int = 8,
        max_queue: int = 64,
        idle_wait_s: float = 0.05,
    ):
        if max_batch < 1 or max_queue < 0:
            raise ValueError(f"max_batch must be >= 1 and max_queue >= 0, got {max_batch} and {max_queue}")
        self._make_engine = make_engine
        self.engine = make_engine()
        self.policy, self.metrics = policy, metrics
        self.tokenizer, self.eos_ids = tokenizer, list(eos_ids)
        self.max_batch, self.max_queue = int(max_batch), int(max_queue)
        self.idle_wait_s = idle_wait_s
        self.pending: collections.deque[Job] = collections.deque()
        self.live: dict[str, Job] = {}
        self._cancels: set[str] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._accepting = True
        self._deadline: float | None = None  # set by stop(): finish by then, cancel after
        self._thread: threading.Thread | None = None
        self._recent_latency: float | None = None
        self.steps = 0
        self.engine_failures = 0
        self.finished_total = 0

    # ------------------------------------------------------------------ life cycle
    def start(self) -> EngineLoop:
        self._thread = threading.Thread(target=self._run, name="mars-engine-loop", daemon=True)
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def accepting(self) -> bool:
        return self._accepting and self.alive

    def drain(self, grace_s: float = 10.0) -> None:
        """Refuse new jobs from now on, let running and waiting ones finish for up to ``grace_s`` seconds,
        then cancel what is left (its clients get 503); the thread ends as soon as nothing is left.
        Returns at once; a second call can only bring the deadline closer."""
        with self._lock:
            self._accepting = False
            deadline = time.monotonic() + max(0.0, grace_s)
            self._deadline = deadline if self._deadline is None else min(self._deadline, deadline)
        self._wake.set()

    def stop(self, grace_s: float = 10.0) -> None:
        """:meth:`drain`, then wait for the thread to end."""
        self.drain(grace_s)
        if self._thread is not None:
            self._thread.join()

    # ------------------------------------------------------------------ called from HTTP handlers
    def submit(self, jobs: Sequence[Job]) -> None:
        """Queue jobs (all or none); :class:`QueueFull` when the queue has no room for them."""
        with self._lock:
            if not self.accepting:
                raise Unavailable("the server is shutting down")
            room = self.max_queue + max(0, self.max_batch - len(self.live))
            if len(self.pending) + len(jobs) > room:
                raise QueueFull(f"the request queue is full ({len(self.pending)} waiting, limit {self.max_queue})")
            self.pending.extend(jobs)
        self._wake.set()

    def cancel(self, job_id: str) -> None:
        """The client is gone: drop a waiting job now, or free its row at the next step."""
        with self._lock:
            for job in self.pending:
                if job.id == job_id:
                    self.pending.remove(job)
                    job.failed = True
                    self.metrics.finished.labels("cancelled").inc()
                    return
            if job_id in self.live:
                self._cancels.add(job_id)
        self._wake.set()

    def snapshot(self) -> dict:
        with self._lock:
            queued, running = len(self.pending), len(self.live)
        tps, tpf = self.metrics.recent.rates()
        return {
            "queued": queued,
            "running": running,
            "max_batch": self.max_batch,
            "max_queue": self.max_queue,
            "tokens_per_second": round(tps, 3),
            "tokens_per_forward": round(tpf, 4),
            "steps": self.steps,
            "finished": self.finished_total,
            "engine_failures": self.engine_failures,
            "accepting": self.accepting,
            **self.policy.describe(),
        }

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        while True:
            try:
                if not self._iteration():
                    break
            except Exception:  # never let the loop die: fail what is running, start over
                log.exception("engine loop iteration failed; failing the running requests and rebuilding the engine")
                self._fail_running(500, "internal error in the engine loop")
        self.metrics.refresh(queued=0, running=0, threshold=self.policy.threshold)

    def _iteration(self) -> bool:
        with self._lock:
            cancels, self._cancels = self._cancels, set()
            free = self.max_batch - self.engine.live
            if self.pending and self.pending[0].alone and not self.engine.live:
                free = min(free, 1)  # retried after a failed step: alone, so that a second failure is its own
            admit = [self.pending.popleft() for _ in range(min(max(free, 0), len(self.pending)))]
            waiting = len(self.pending)
            deadline = self._deadline
        now = time.monotonic()
        if deadline is not None and (now >= deadline or (not admit and not waiting and not self.live)):
            self._shutdown(admit)
            return False
        for job_id in cancels:
            self.engine.cancel(job_id)
        in_system = list(self.live.values()) + admit
        oldest = min((j.created for j in in_system), default=None)
        threshold = self.policy.update(
            LoadSample(
                now,
                waiting=waiting + len(admit),
                running=len(self.live),
                recent_latency_s=self._recent_latency,
                oldest_age_s=None if oldest is None else now - oldest,
            )
        )
        self._retune(threshold)
        self._admit(admit, now)
        self.metrics.refresh(queued=waiting, running=self.engine.live, threshold=threshold, now=now)
        if not self.engine.live:
            self._wake.wait(self.idle_wait_s)
            self._wake.clear()
            return True
        self._step()
        return True

    def _retune(self, threshold: float) -> None:
        """A new server threshold reaches the running rows that follow it (no threshold of their own, not verified)
        from their next step, so a load spike speeds up the requests already decoding, not only new ones."""
        for job in self.live.values():
            if job.threshold is not None or job.verify or job.failed:
                continue
            served = self.policy.for_request(None, False)
            if served != job.served_threshold and self.engine.set_threshold(job.id, served):
                job.served_threshold = served

    def _admit(self, jobs: list[Job], now: float) -> None:
        requests = []
        for job in jobs:
            try:
                job.served_threshold = self.policy.for_request(job.threshold, job.verify)
                req = self.engine.make_request(
                    job.prompt_ids,
                    threshold=job.served_threshold,
                    max_new_tokens=job.max_new_tokens,
                    stop=job.stop or None,
                    temperature=job.temperature,
                    seed=job.seed,
                    verify=job.verify,
                    id=job.id,
                    **job.options,
                )
                _check_sampler(req.seed, req.temperature)
                job.stream = TextStream(self.tokenizer, self.eos_ids, req.stops, job.max_new_tokens)
            except Exception as err:  # this job only
                log.exception("request %s could not be admitted", job.id)
                self._fail(job, 400 if isinstance(err, ValueError) else 500, f"could not start decoding: {err}")
                continue
            job.admitted = now
            self.metrics.queue_wait.observe(now - job.created)
            requests.append(req)
            self.live[job.id] = job
        if requests:
            self._admit_requests(requests)

    def _admit_requests(self, requests: list) -> None:
        """``engine.admit``; where it fails on an empty engine (nobody else's rows in it), the requests are
        admitted one at a time on a new engine and only those that fail on their own fail."""
        empty = not self.engine.live
        try:
            self.engine.admit(requests)
            return
        except Exception:
            if not empty:
                log.exception("engine.admit failed beside running rows")
                self._fail_running(500, "the engine failed to admit requests")
                return
            log.exception("admitting %d request(s) failed; admitting them one at a time", len(requests))
        self.engine = self._make_engine()
        admitted: list = []
        for req in requests:
            try:
                self.engine.admit([req])
                admitted.append(req)
            except Exception as err:  # this request's own: the ones before it are admitted again, without it
                log.exception("request %s could not be admitted", req.id)
                self._fail(self.live.pop(req.id), 500, f"could not start decoding: {type(err).__name__}: {err}")
                self.engine = self._make_engine()
                if admitted:
                    try:
                        self.engine.admit(admitted)
                    except Exception:
                        log.exception("engine.admit failed")
                        self._fail_running(500, "the engine failed to admit requests")
                        return

    def _step(self) -> None:
        rows = self.engine.live
        t0 = time.perf_counter()
        try:
            events = self.engine.step()
        except Exception as err:
            log.exception("engine step failed with %d rows", rows)
            self._step_failed(f"the decoding step failed: {type(err).__name__}: {err}")
            return
        seconds = time.perf_counter() - t0
        self.steps += 1
        now = time.monotonic()
        tokens = forwarded = 0
        for ev in events:
            job = self.live.get(ev.request.id)
            cancelled = ev.finished is not None and ev.finished.reason == "cancelled"
            if not cancelled:
                forwarded += 1
                tokens += len(ev.tokens)
            if job is None:
                continue
            if job.failed:
                if ev.finished is not None:
                    self.live.pop(job.id, None)
                continue
            try:
                self._deliver(job, ev, now)
            except Exception as err:  # this job only
                log.exception("delivering to request %s failed", job.id)
                self._fail(job, 500, f"{type(err).__name__}: {err}")
                if ev.finished is None:
                    self.engine.cancel(job.id)  # its row leaves at the next step
                else:
                    self.live.pop(job.id, None)
        self.metrics.observe_step(seconds, tokens, forwarded, now)

    def _deliver(self, job: Job, ev, now: float) -> None:
        """One engine event of ``job``'s row: its new tokens (streamed when it streams), or its end."""
        f = ev.finished
        if f is not None:  # the drafts a row verified count whatever ended it
            job.acceptance = acceptance_figures(f.draft_proposed, f.draft_accepted, f.draft_steps)
            self.metrics.observe_drafts(f.draft_proposed, f.draft_accepted, f.draft_steps)
        if f is not None and f.reason == "cancelled":
            self._cancelled(job, now)
            return
        job.forwards += 1
        if ev.tokens and job.first_token is None:
            job.first_token = now
            self.metrics.ttft.observe(now - job.created)
        delta = job.stream.push(ev.tokens)
        if f is None:
            job.completion_tokens += len(ev.tokens)
            if job.streaming and (delta or ev.tokens):
                self._send(job, JobEvent(job, text=delta, token_ids=list(ev.tokens), forward=job.forwards))
            return
        self._finished(job, ev, delta, now)

    def _cancelled(self, job: Job, now: float) -> None:
        """``job``'s row left the batch cancelled: it fails with status 499."""
        self.live.pop(job.id, None)
        job.failed, job.finished = True, now
        self.metrics.finished.labels("cancelled").inc()
        self._send(job, JobEvent(job, done=True, finish_reason="cancelled", error="cancelled", status=499))

    def _finished(self, job: Job, ev, delta: str, now: float) -> None:
        """``job``'s row ended (``ev.finished``): the job takes the row's record and its last event is sent, the
        rest of the text with the finish reason, or an error (status 500) when the row itself failed."""
        f = ev.finished
        self.live.pop(job.id, None)
        job.finished = now
        job.completion_tokens = len(f.token_ids)
        job.token_ids = list(f.token_ids)
        job.forwards = f.forwards
        self.finished_total += 1
        self.metrics.finished.labels(f.reason).inc()
        if f.reason == "error":  # this row's own failure (its stop strings, its first step): the others go on
            job.failed = True
            message = getattr(ev, "error", None) or "checking stop strings failed"
            self._send(job, JobEvent(job, done=True, finish_reason="error", error=message, status=500))
            return
        rest, final = job.stream.finish(f.token_ids)
        latency = now - job.created
        self.metrics.latency.observe(latency)
        if job.forwards:
            self.metrics.request_tpf.observe(job.tokens_per_forward)
        self._recent_latency = latency if self._recent_latency is None else 0.8 * self._recent_latency + 0.2 * latency
        self._send(
            job,
            JobEvent(
                job,
                text=delta + rest,
                token_ids=list(ev.tokens),
                forward=job.forwards,
                done=True,
                finish_reason=f.reason,
                final_text=final,
            ),
        )

    # ------------------------------------------------------------------ failures and shutdown
    def _send(self, job: Job, event: JobEvent) -> None:
        if job.sink is not None:
            job.sink(event)

    def _fail(self, job: Job, status: int, message: str) -> None:
        job.failed = True
        job.finished = time.monotonic()
        self.metrics.finished.labels("error" if status != 503 else "cancelled").inc()
        try:
            self._send(job, JobEvent(job, done=True, finish_reason="error", error=message, status=status))
        except Exception:
            log.exception("could not tell request %s that it failed", job.id)

    def _step_failed(self, message: str) -> None:
        """A batched step failed: the jobs that had decoded tokens fail with it (their rows' state went with the
        step); those that had not (admitted for this step) go back to the head of the queue, each to be admitted
        on its own, so that a failure of theirs fails them alone."""
        fresh = [j for j in self.live.values() if not j.failed and j.forwards == 0]
        for job in fresh:
            del self.live[job.id]
            job.alone, job.admitted, job.stream = True, None, None
        if len(fresh) == 1 and not self.live:  # it was alone already: the failure is its own
            job = fresh.pop()
            self.live[job.id] = job
        self._fail_running(500, message)
        with self._lock:
            self.pending.extendleft(reversed(fresh))

    def _fail_running(self, status: int, message: str) -> None:
        self.engine_failures += 1
        jobs = [j for j in self.live.values() if not j.failed]
        self.live.clear()
        self.engine = self._make_engine()  # before anyone hears of the failure
        for job in jobs:
            self._fail(job, status, message)

    def _shutdown(self, admit: list[Job]) -> None:
        with self._lock:
            left = admit + list(self.pending)
            self.pending.clear()
        for job in left + [j for j in self.live.values() if not j.failed]:
            self._fail(job, 503, "the server shut down before this request finished")
        self.live.clear()


def _check_sampler(seed: int | None, temperature: float) -> None:
    """Seed a sampler as the engine will for this row (``torch.Generator.manual_seed``), so that a seed it
    refuses fails this job alone, here, and not the batched admission of every row."""
    if temperature > 0 and seed is not None:
        try:
            torch.Generator().manual_seed(seed)
        except (RuntimeError, ValueError, TypeError, OverflowError) as err:
            raise ValueError(f"seed {seed!r} cannot seed the sampler ({err})") from None
