"""The FastAPI application: OpenAI-compatible routes, health, metrics, live stats and the UI page.

A POST is checked in the order of its cost: Host and API key (:mod:`~mars.serving.guard`), the media type
(``application/json`` only: 415), the body's size (``max_body_bytes``: 413 from the declared length before
reading, or as soon as the read passes it), then, in a worker thread so that the event loop keeps
answering (``/health`` included) however large the prompt, the JSON, every field (strict types), the
number of prompts, the context length and the tokenization (a prompt's ids and budget pass ``generate``'s own
checks, :mod:`mars.decoding.prompt_check`, refused with the same words).  Then handlers hand
:class:`~mars.serving.scheduler.Job` objects to the engine loop thread and await their events on an
asyncio queue (the loop posts them with ``call_soon_threadsafe``).  Streaming responses are server-sent
events (sse-starlette); each event carries the text of one forward's accepted tokens for one choice, with
``mars.tokens`` (how many) and ``mars.forward`` (which forward of that request), which is what the UI
shades.  A client that goes away (stream closed, or a non-streaming client disconnecting) has its jobs
cancelled: a waiting job is dropped, a running row leaves the batch at the next step.  A job that fails
(or is cancelled by a shutdown) ends a non-streaming request with its OpenAI-shaped error and a stream
with an error event followed by ``[DONE]`` (as vLLM ends its streams).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus), ``GET /stats`` (JSON for the UI), ``GET /`` (the UI).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import ValidationError
from sse_starlette import EventSourceResponse
from starlette.requests import ClientDisconnect

from mars.decoding.prompt_check import PromptTooLong, check_budget, check_prompt
from mars.decoding.settings import DecodingSettings, tree_shape

from .guard import HostRule, RequestGuard
from .metrics import CONTENT_TYPE_LATEST
from .scheduler import EngineLoop, Job, JobEvent, QueueFull, Unavailable
from .schemas import (
    DEFAULT_MAX_BODY_BYTES,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    _Common,
    decoding_overrides,
    from_validation_error,
)
from .ui import PAGE

log = logging.getLogger(__name__)

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
DISCONNECT_POLL_S = 0.2  # a non-streaming client that left is noticed within this (its row then frees)
PREPARE_THREADS = 4  # requests parsed and tokenized at once, off the event loop
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/stats", "/")


@dataclass
class ServingState:
    """Everything the routes need: the engine loop, the tokenizer and the limits."""

    loop: EngineLoop
    tokenizer: Any
    model_name: str
    settings: DecodingSettings
    context_length: int
    vocab_size: int
    default_max_tokens: int
    shutdown_grace_s: float = 10.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    host: str = "127.0.0.1"
    allowed_hosts: list[str] | None = None
    api_key: str | None = field(default=None, repr=False)
    info: dict = field(default_factory=dict)
    created: int = field(default_factory=lambda: int(time.time()))
    max_token_chars: int | None = None  # see longest_token_chars: None when no bound holds
    in_flight: int = 0  # HTTP requests being answered (the drain on shutdown waits for them)
    body_reads: set[anyio.CancelScope] = field(default_factory=set, repr=False)  # bodies still arriving
    _prepare_limiter: anyio.CapacityLimiter | None = field(default=None, repr=False)

    @property
    def max_prompts(self) -> int:
        """Prompts one request may carry: all of its jobs must fit in the rows and the queue at once."""
        return self.loop.max_batch + self.loop.max_queue

    @property
    def prepare_limiter(self) -> anyio.CapacityLimiter:
        if self._prepare_limiter is None:  # made on the event loop, on first use
            self._prepare_limiter = anyio.CapacityLimiter(PREPARE_THREADS)
        return self._prepare_limiter

    def cut_body_reads(self) -> int:
        """At shutdown: the requests still receiving their bodies get 503 now (their jobs could not be
        accepted anyway), so a slow or stalled upload cannot hold the exit; how many there were.  Runs on the
        event loop, as the reads do."""
        reads = list(self.body_reads)
        for scope in reads:
            scope.cancel()
        return len(reads)

    @property
    def metrics(self):
        return self.loop.metrics

    @property
    def policy(self):
        return self.loop.policy


class CountRequests:
    """Counts answered requests by route and status, and the requests being answered (plain ASGI: it leaves
    disconnect detection and streaming alone, which ``BaseHTTPMiddleware`` would wrap)."""

    def __init__(self, app, state: ServingState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")

        async def counted_send(message):
            if message["type"] == "http.response.start":
                self.state.metrics.requests.labels(path if path in ROUTES else "other", str(message["status"])).inc()
            await send(message)

        self.state.in_flight += 1
        try:
            await self.app(scope, receive, counted_send)
        finally:
            self.state.in_flight -= 1


def create_app(state: ServingState) -> FastAPI:
    app = FastAPI(title="MARS server", version="1", lifespan=_lifespan(state), docs_url="/docs", redoc_url=None)
    app.state.serving = state

    app.add_middleware(RequestGuard, hosts=HostRule(state.host, state.allowed_hosts), api_key=state.api_key)
    app.add_middleware(CountRequests, state=state)  # outermost: counts the guard's refusals too
    _add_error_handlers(app)
    _add_status_routes(app, state)
    _add_generation_routes(app, state)
    return app


def _lifespan(state: ServingState):
    """Starts the engine loop with the app; at shutdown lets it finish what is left within the grace period."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not state.loop.alive:
            state.loop.start()
        yield
        # uvicorn has already waited (up to its graceful timeout) for open requests; whatever is left
        # in the loop gets the rest of the grace period, then is cancelled
        await asyncio.to_thread(state.loop.stop, state.shutdown_grace_s)

    return lifespan


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as an OpenAI-style JSON body: ours with their status, anything else as a 500."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError):
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers or None)

    @app.exception_handler(ClientDisconnect)
    async def client_left(request: Request, err: ClientDisconnect):
        # the client's choice, not a server fault: one line, as for a client that leaves mid-generation
        peer = f"{request.client.host}:{request.client.port}" if request.client else "a client"
        log.info("client %s went away while sending its request body to %s; dropped", peer, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(APIError(500, f"internal error: {type(err).__name__}").body(), status_code=500)


def _add_status_routes(app: FastAPI, state: ServingState) -> None:
    """The page, health, Prometheus metrics, live statistics and the model list."""

    @app.get("/", response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        return HTMLResponse(PAGE)

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = state.loop.accepting
        snap = state.loop.snapshot()
        body = {
            "status": "ok" if ok else ("draining" if state.loop.alive else "stopped"),
            "model": state.model_name,
            **{k: snap[k] for k in ("queued", "running", "tau")},
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        snap = state.loop.snapshot()
        state.metrics.refresh(queued=snap["queued"], running=snap["running"], threshold=state.policy.threshold)
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/stats")
    async def stats() -> JSONResponse:
        snap = state.loop.snapshot()
        return JSONResponse({"model": state.model_name, **state.info, **snap, "api_key_required": bool(state.api_key)})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [_model_card(state)]})

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> JSONResponse:
        if model != state.model_name:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {state.model_name!r}",
                "model",
                "model_not_found",
            )
        return JSONResponse(_model_card(state))


def _add_generation_routes(app: FastAPI, state: ServingState) -> None:
    """The OpenAI-compatible completion endpoints (the body is parsed off the event loop)."""

    @app.post("/v1/completions")
    async def completions(request: Request):
        raw = await _read_body(request, state)
        body, jobs = await _off_loop(state, _prepare_completion, state, raw)
        return await _serve(state, request, jobs, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        raw = await _read_body(request, state)
        body, jobs = await _off_loop(state, _prepare_chat, state, raw)
        return await _serve(state, request, jobs, body, chat=True)


# ---------------------------------------------------------------------------------------------- reading
async def _read_body(request: Request, state: ServingState) -> bytes:
    """The body of a JSON POST, at most ``max_body_bytes``: 415 for another media type, 413 past the limit
    (from the declared length before anything is read, else as soon as the read passes it), 503 while the
    server shuts down (before reading, or as soon as the drain starts: see :meth:`ServingState.cut_body_reads`)."""
    limit = state.max_body_bytes
    declared_type = request.headers.get("content-type")
    media = (declared_type or "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise APIError(
            415,
            f"the request body must be JSON sent as 'Content-Type: application/json', got {declared_type!r}",
            None,
            "unsupported_media_type",
        )
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    if not state.loop.accepting:
        raise _shutting_down()
    chunks, size = [], 0
    with anyio.CancelScope() as reading:
        state.body_reads.add(reading)
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _too_large(None, limit)
                chunks.append(chunk)
        finally:
            state.body_reads.discard(reading)
    if reading.cancelled_caught:
        raise _shutting_down()
    return b"".join(chunks)


def _shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", None, "unavailable")


def _too_large(size: int | None, limit: int) -> APIError:
    got = f"{size} bytes" if size is not None else "more"
    return APIError(
        413,
        f"the request body has {got}, over this server's limit of {limit} bytes (max_body_bytes)",
        None,
        "request_too_large",
    )


async def _off_loop(state: ServingState, fn, *args):
    """Run a request's parsing and tokenization in a worker thread: a large prompt takes seconds to
    tokenize, and the event loop must keep answering meanwhile (the tokenizer releases the GIL)."""
    return await anyio.to_thread.run_sync(fn, *args, limiter=state.prepare_limiter)


# ---------------------------------------------------------------------------------------------- parsing
def _prepare_completion(state: ServingState, raw: bytes) -> tuple[CompletionRequest, list[Job]]:
    """Everything from the raw body to the jobs, cheapest checks first (runs in a worker thread)."""
    body = _parse(state, raw, CompletionRequest)
    prompts = body.prompts()
    if len(prompts) > state.max_prompts:
        raise APIError(
            400,
            f"prompt holds {len(prompts)} prompts, more than this server can ever take in one request: at most "
            f"{state.max_prompts} (max_batch={state.loop.max_batch} rows + max_queue={state.loop.max_queue} "
            "waiting); send them in several requests",
            "prompt",
            "too_many_prompts",
        )
    knobs = _knobs(state, body)
    labels = [f"prompt {i}" for i in range(len(prompts))]  # as generate names them
    ids = [
        _encode_text(state, p, label, "prompt") if isinstance(p, str) else _check_ids(state, p, label, "prompt")
        for label, p in zip(labels, prompts)
    ]
    return body, _jobs(state, body, knobs, ids, labels, body.max_tokens, "max_tokens")


def _prepare_chat(state: ServingState, raw: bytes) -> tuple[ChatCompletionRequest, list[Job]]:
    body = _parse(state, raw, ChatCompletionRequest)
    knobs = _knobs(state, body)
    try:
        text = state.tokenizer.apply_chat_template(body.chat(), add_generation_prompt=True, tokenize=False)
    except Exception as err:
        raise APIError(400, f"the chat template refused these messages: {err}", "messages") from None
    ids = [_encode_text(state, text, "messages", "messages", add_special_tokens=False)]
    return body, _jobs(state, body, knobs, ids, ["messages"], body.budget, body.budget_field)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def _parse(state: ServingState, raw: bytes, schema: type[_Common]) -> _Common:
    try:
        data = json.loads(raw, parse_constant=_no_constant)  # NaN and Infinity are not JSON
    except (ValueError, UnicodeDecodeError) as err:
        raise APIError(400, f"malformed JSON body: {err}", "body") from None
    except RecursionError:
        raise APIError(400, "malformed JSON body: nested too deeply", "body") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", "body")
    try:
        body = schema.model_validate(data)
    except ValidationError as err:
        raise from_validation_error(err) from None
    body.unsupported()
    if body.model is not None and body.model != state.model_name:
        raise APIError(
            400, f"unknown model {body.model!r}; this server serves {state.model_name!r}", "model", "model_not_found"
        )
    return body


def longest_token_chars(tokenizer) -> int | None:
    """The most characters one token can cover, when the tokenizer guarantees a bound: a fast tokenizer
    without a normalizer (byte-level BPE as in SmolLM2, GPT-2, Llama 3) splits the text itself into
    tokens, each spanning at most its own string's length (bytes for byte-level, which are at least the
    characters).  A normalizer (NFC, stripping, ...) could shrink the text first: then None (no bound)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    return max(map(len, vocab), default=0) or None


def _encode_text(state: ServingState, text: str, label: str, param: str, **kw) -> list[int]:
    """Tokenize, unless the text's length alone shows it cannot fit: then refuse without the work (seconds
    for a megabyte)."""
    if state.max_token_chars and -(-len(text) // state.max_token_chars) >= state.context_length:
        raise APIError(
            400,
            f"{label} has {len(text)} characters, so at least {-(-len(text) // state.max_token_chars)} tokens "
            f"(a token spans at most {state.max_token_chars} characters), more than the model's context of "
            f"{state.context_length} tokens",
            param,
            "context_length_exceeded",
        )
    return _check_ids(state, state.tokenizer(text, **kw)["input_ids"], label, param)


def _check_ids(state: ServingState, ids: list[int], label: str, param: str) -> list[int]:
    with _refused_as_400(param):
        check_prompt(ids, vocab=state.vocab_size, context=state.context_length, label=label)
    return [int(t) for t in ids]


@contextmanager
def _refused_as_400(param: str):
    """A prompt check's ValueError as this request's 400 on ``param``, in the check's own words."""
    try:
        yield
    except PromptTooLong as err:
        raise APIError(400, str(err), param, "context_length_exceeded") from None
    except ValueError as err:
        raise APIError(400, str(err), param) from None


def _knobs(state: ServingState, body: _Common) -> tuple[float | None, float, dict]:
    """The request's DecodingSettings overrides under the server's decoding rules, checked before any
    tokenization by one DecodingSettings (the threshold for the metric, what ``verify`` allows, each
    per-request field's range): its threshold, its temperature and the other per-request fields."""
    s = state.settings
    overrides = decoding_overrides(body)
    overrides.pop("seed", None)  # range-checked by the schema; the sampler's generator takes any such seed
    if overrides.get("verify"):
        overrides.setdefault("threshold", s.reference)
    if "tree" in overrides:
        request_tree(s, overrides)
    try:
        checked = s.replace(**overrides)
    except ValueError as err:
        raise APIError(400, str(err), _param(str(err), overrides)) from None
    threshold = checked.threshold if body.threshold is not None else None  # None: the server's policy decides
    options = {k: getattr(checked, k) for k in overrides if k not in ("threshold", "verify", "temperature")}
    return threshold, checked.temperature, options


def request_tree(settings: DecodingSettings, overrides: dict) -> None:
    """A request's ``tree``: ``chain`` (its verified drafts in a row), or the server's own tree (``auto`` or the
    server's shape: the override is dropped); the engine drafts one tree for its batch, so another shape is a 400."""
    tree = overrides["tree"]
    try:
        shape = tree_shape(tree)
    except ValueError as err:
        raise APIError(400, str(err), "tree") from None
    if tree == "chain":
        return
    if tree == "auto" or tree == settings.tree or (shape is not None and shape == tree_shape(settings.tree)):
        del overrides["tree"]
        return
    raise APIError(
        400,
        f"tree={tree!r}: this server drafts tree={settings.tree!r} (its decoding.tree) for every verify request; "
        "a request may ask for 'chain' or the server's own ('auto')",
        "tree",
    )


def _param(message: str, overrides: dict) -> str | None:
    """The request field a settings error is about: the first one it names (the threshold when verify's)."""
    named = [k for k in overrides if k in message]
    return named[0] if named else next(iter(overrides), None)


def _jobs(
    state: ServingState,
    body: _Common,
    knobs: tuple[float | None, float, dict],
    ids: list[list[int]],
    labels: list[str],
    budget: int | None,
    budget_field: str,
) -> list[Job]:
    threshold, temperature, options = knobs
    jobs = []
    for i, (prompt, label) in enumerate(zip(ids, labels)):
        if budget is None:
            n = min(state.default_max_tokens, state.context_length - len(prompt))
        else:
            with _refused_as_400(budget_field):
                check_budget(len(prompt), budget, state.context_length, label=label, budget=budget_field)
            n = budget
        jobs.append(
            Job(
                prompt_ids=prompt,
                max_new_tokens=n,
                threshold=threshold,
                stop=body.stop,
                temperature=temperature,
                seed=body.seed,
                verify=bool(body.verify),
                options=options,
                index=i,
            )
        )
    return jobs


# ---------------------------------------------------------------------------------------------- serving
async def _serve(state: ServingState, request: Request, jobs: list[Job], body: _Common, chat: bool):
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[JobEvent] = asyncio.Queue()

    def sink(event: JobEvent) -> None:  # runs on the engine thread
        loop.call_soon_threadsafe(queue.put_nowait, event)

    for job in jobs:
        job.sink = sink
        job.streaming = body.stream
    try:
        state.loop.submit(jobs)
    except QueueFull as err:
        raise APIError(429, f"{err}; retry later", None, "queue_full") from None
    except Unavailable as err:
        raise APIError(503, str(err), None, "unavailable") from None
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _stream(state, jobs, queue, rid, chat, include_usage, body.return_token_ids)
        # a shutdown ends streams through the engine loop (error event + [DONE]), not by cutting them
        return EventSourceResponse(events, ping=15)
    done: dict[int, JobEvent] = {}
    try:
        while len(done) < len(jobs):
            try:
                event = await asyncio.wait_for(queue.get(), timeout=DISCONNECT_POLL_S)
            except TimeoutError:  # nothing yet: is the client still there?
                if await request.is_disconnected():
                    log.info("client of %s went away; cancelling", rid)
                    return Response(status_code=499)
                continue
            if event.error is not None:
                raise _job_error(event)
            if event.done:
                done[event.job.index] = event
    finally:
        for job in jobs:
            if job.index not in done:
                state.loop.cancel(job.id)
    return JSONResponse(_response(state, jobs, done, rid, chat, body.return_token_ids))


def _job_error(event: JobEvent) -> APIError:
    status = event.status if event.status != 499 else 500
    code = {400: "invalid_request", 503: "unavailable"}.get(status, "internal_error")
    return APIError(status, event.error or "failed", None, code)


def _finish(event: JobEvent) -> str:
    return FINISH_REASONS.get(event.finish_reason or "", event.finish_reason or "stop")


def _usage(jobs: list[Job]) -> dict:
    prompt = sum(len(j.prompt_ids) for j in jobs)
    completion = sum(j.completion_tokens for j in jobs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _mars(state: ServingState, jobs: list[Job]) -> dict:
    forwards = sum(j.forwards for j in jobs)
    tokens = sum(j.completion_tokens for j in jobs)
    out = (
        jobs[0].stats()
        if len(jobs) == 1
        else {
            "threshold": [j.served_threshold for j in jobs],
            "forwards": forwards,
            "completion_tokens": tokens,
            "tokens_per_forward": round(tokens / forwards, 4) if forwards else 0.0,
            "choices": [j.stats() for j in jobs],
        }
    )
    out.update(server_tau=round(state.policy.threshold, 4), tau_policy=state.policy.name)
    return out


def _response(
    state: ServingState, jobs: list[Job], done: dict[int, JobEvent], rid: str, chat: bool, token_ids: bool
) -> dict:
    choices = []
    for job in jobs:
        ev = done[job.index]
        if chat:
            choices.append(
                {
                    "index": job.index,
                    "message": {"role": "assistant", "content": ev.final_text},
                    "finish_reason": _finish(ev),
                    "logprobs": None,
                }
            )
        else:
            choices.append({"index": job.index, "text": ev.final_text, "finish_reason": _finish(ev), "logprobs": None})
        if token_ids:
            choices[-1]["token_ids"] = job.token_ids
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": state.model_name,
        "choices": choices,
        "usage": _usage(jobs),
        "mars": _mars(state, jobs),
    }


async def _stream(
    state: ServingState,
    jobs: list[Job],
    queue: asyncio.Queue,
    rid: str,
    chat: bool,
    include_usage: bool,
    token_ids: bool,
):
    chunks = _Chunks(rid, chat, state.model_name)
    finished: set[int] = set()
    try:
        if chat:
            for job in jobs:
                yield _sse(chunks.choice(job.index, "", None, {"tokens": 0, "forward": 0}, first=True))
        while len(finished) < len(jobs):
            event: JobEvent = await queue.get()
            if event.error is not None:  # the stream ends with the error, then [DONE] (as vLLM's do)
                yield _sse(_job_error(event).body())
                yield {"data": "[DONE]"}
                return
            mars = _event_mars(state, event, token_ids)
            if event.done:
                finished.add(event.job.index)
            yield _sse(chunks.choice(event.job.index, event.text, _finish(event) if event.done else None, mars))
        if include_usage:
            yield _sse(chunks.usage(_usage(jobs), _mars(state, jobs)))
        yield {"data": "[DONE]"}
    finally:  # normal end, error, or the client went away (the task is cancelled)
        for job in jobs:
            if job.index not in finished:
                state.loop.cancel(job.id)


def _sse(payload: dict) -> dict:
    """One server-sent event carrying ``payload`` as JSON."""
    return {"data": json.dumps(payload)}


class _Chunks:
    """The streamed chunks of one response: same id, object kind, creation time and model on every one."""

    def __init__(self, rid: str, chat: bool, model_name: str):
        self.rid, self.chat, self.model_name = rid, chat, model_name
        self.kind = "chat.completion.chunk" if chat else "text_completion"
        self.created = int(time.time())

    def _chunk(self, choices: list[dict], **extra) -> dict:
        return {
            "id": self.rid,
            "object": self.kind,
            "created": self.created,
            "model": self.model_name,
            "choices": choices,
            **extra,
        }

    def choice(self, index: int, text: str | None, reason: str | None, mars: dict, first: bool = False) -> dict:
        """A text delta of one choice (the chat role on its first chunk), with its decoding figures."""
        if self.chat:
            delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": None}
        else:
            choice = {"index": index, "text": text or "", "finish_reason": reason, "logprobs": None}
        return self._chunk([choice], mars=mars)

    def usage(self, usage: dict, mars: dict) -> dict:
        """The closing chunk with the token usage (``stream_options.include_usage``): no choices."""
        return self._chunk([], usage=usage, mars=mars)


def _event_mars(state: ServingState, event: JobEvent, token_ids: bool) -> dict:
    """The ``mars`` figures of one streamed event: tokens and forward so far and the threshold served; the
    last event of a choice adds the job's statistics and the server's current threshold."""
    job = event.job
    mars = {"tokens": event.tokens, "forward": event.forward, "threshold": job.served_threshold}
    if token_ids:
        mars["token_ids"] = event.token_ids
    if event.done:
        mars.update(
            job.stats(), tokens=event.tokens, forward=event.forward, server_tau=round(state.policy.threshold, 4)
        )
        if token_ids:
            mars["token_ids"] = event.token_ids
    return mars


def _model_card(state: ServingState) -> dict:
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "mars",
        "max_model_len": state.context_length,
        "mars": {
            **state.info,
            "tau_policy": state.policy.name,
            "tau_min": state.policy.threshold_min,
            "tau_max": state.policy.threshold_max,
        },
    }
