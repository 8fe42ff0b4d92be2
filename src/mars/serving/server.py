"""The server from a checked :class:`~mars.serving.config.ServeConfig`: its wiring (:func:`build_state`: the
model loaded, the engine loop, the routes' state), ``serve.py``'s body (:func:`run`) and :class:`BackgroundServer`
(uvicorn in a thread on a free loopback port, for tests, notebooks and the load test's in-process mode).

Shutdown (Ctrl-C / SIGTERM, or ``BackgroundServer.stop``) drains first (:class:`DrainingServer`): the socket
stays open, ``/health`` answers 503 ``draining`` (a load balancer's cue to send elsewhere) and new requests
get 503 with ``Retry-After`` (as do requests still sending their bodies: a stalled upload cannot hold the
exit), while in-flight requests (streams included) get ``shutdown_grace_s`` to finish; then the engine
loop cancels what is left (a non-streaming request gets a JSON 503, a stream an error event and
``[DONE]``).  Once no request is open (or a few seconds past the grace), uvicorn closes
the socket and the process exits 0.  A second signal stops waiting: what is left is cancelled at once.
Plain uvicorn would instead close the socket at the first signal (new requests: connection refused) and
cut whatever outlived its timeout (a plain-text 500, a stream without its end).
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time

import uvicorn

from .app import ServingState, create_app, longest_token_chars
from .config import ServeConfig
from .metrics import ServerMetrics
from .scheduler import EngineLoop

log = logging.getLogger(__name__)


def build_state(sc: ServeConfig, loaded=None) -> ServingState:
    """Load the model (unless ``loaded`` is given: a :class:`~mars.models.LoadedModel`) and build the engine
    loop and the routes' state."""
    import torch

    from mars.decoding.engine import DecodeEngine
    from mars.decoding.forward import ModelRunner
    from mars.decoding.loading import load_for_decoding
    from mars.decoding.stopping import eos_token_ids

    if sc.threads:
        torch.set_num_threads(sc.threads)
    if loaded is None:
        loaded = load_for_decoding(
            sc.model, checkpoint=sc.checkpoint, checkpoint_meta=sc.checkpoint_meta, dtype=sc.dtype, device=sc.device
        )
    model, tokenizer = loaded.model.eval(), loaded.tokenizer
    runner = ModelRunner(model)
    context = runner.context_length or 2048
    if sc.max_model_len is not None:
        context = min(context, sc.max_model_len)
    eos = eos_token_ids(model, tokenizer)
    mask_id = loaded.mask.id
    settings = sc.settings

    def make_engine() -> DecodeEngine:
        return DecodeEngine(ModelRunner(model), settings, mask_id, eos, tokenizer)

    if sc.warmup:  # the first forward pays one-off costs; keep them out of the first request's latency
        _warm_up(make_engine(), tokenizer)
    metrics = ServerMetrics(sc.metrics_window_s)
    loop = EngineLoop(
        make_engine, sc.threshold_policy(), metrics, tokenizer, eos, max_batch=sc.max_batch, max_queue=sc.max_queue
    )
    return ServingState(
        loop=loop,
        tokenizer=tokenizer,
        model_name=sc.served_model_name,
        settings=settings,
        context_length=context,
        vocab_size=runner.vocab_size,
        default_max_tokens=sc.max_tokens,
        shutdown_grace_s=sc.shutdown_grace_s,
        max_body_bytes=sc.max_body_bytes,
        host=sc.host,
        allowed_hosts=sc.allowed_hosts,
        api_key=sc.api_key,
        max_token_chars=longest_token_chars(tokenizer),
        info=_server_info(settings, runner, context, mask_id),
    )


def _warm_up(engine, tokenizer) -> None:
    """Decodes two tokens of a throwaway request on its own engine, and of a verified one where the decoder
    verifies (``tree=auto`` times this device's steps once per model, out of the first verified request's way)."""
    ids = tokenizer("Hello")["input_ids"]
    requests = [engine.make_request(ids, max_new_tokens=2)]
    if engine.settings.decoder == "mars" and engine.max_drafts > 0:
        requests.append(engine.make_request(ids, max_new_tokens=2, verify=True, threshold=1.0))
    engine.admit(requests)
    while engine.live:
        engine.step()


def _server_info(settings, runner, context: int, mask_id: int) -> dict:
    """What the server reports about its decoder and model (``/v1/models`` and the UI)."""
    return {
        "decoder": settings.decoder,
        "block_size": settings.block_size,
        "metric": settings.metric,
        "cache": settings.cache,
        "max_step_columns": settings.max_step_columns,
        "max_model_len": context,
        "dtype": str(next(runner.model.parameters()).dtype),
        "device": str(runner.device),
        "mask_token_id": mask_id,
    }


# after the drain: how long the responses to cancelled requests (503s, the streams' last events) may take
CLOSE_MARGIN_S = 5.0


def uvicorn_config(app, *, host: str, port: int, log_level: str = "info") -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=CLOSE_MARGIN_S,  # the drain has already waited for the requests
        lifespan="on",
        access_log=False,
    )


class DrainingServer(uvicorn.Server):
    """uvicorn that drains before it closes its socket (see the module docstring).

    The signal handler only counts the request to exit (a handler must not take the engine loop's lock,
    which the interrupted thread may hold); the drain runs on the event loop, in ``on_tick`` (every 0.1 s).
    """

    def __init__(self, config: uvicorn.Config, state: ServingState):
        super().__init__(config)
        self.state = state
        self.exit_requests = 0
        self._handled = 0
        self.drain_deadline: float | None = None

    def handle_exit(self, sig: int, frame) -> None:
        # not uvicorn's handler (nor sse-starlette's patch of it, which would cut every stream at once):
        # keep the signal for uvicorn to re-raise after the shutdown, as it does, and start the drain
        self._captured_signals.append(sig)
        self.request_exit()

    def request_exit(self) -> None:
        self.exit_requests += 1

    async def on_tick(self, counter: int) -> bool:
        if self.exit_requests > self._handled:
            first = self._handled == 0
            self._handled = self.exit_requests
            grace = self.state.shutdown_grace_s if first else 0.0
            now = time.monotonic()
            self.drain_deadline = now + grace if first else min(self.drain_deadline, now)
            cut = self.state.cut_body_reads()
            log.info(
                "draining: new requests%s get 503, %d open request(s) get %.1f s to finish",
                f" and the {cut} still sending their bodies" if cut else "",
                max(self.state.in_flight - cut, 0),
                grace,
            )
            self.state.loop.drain(grace)
        if self.drain_deadline is not None and not self.should_exit:
            late = time.monotonic() > self.drain_deadline + CLOSE_MARGIN_S
            if self.state.in_flight <= 0 or late:
                if late:
                    log.warning("%d request(s) still open past the grace period; closing", self.state.in_flight)
                self.should_exit = True
        return await super().on_tick(counter)


def run(cfg) -> None:
    """``python serve.py ...``: check the config (``cfg``: the composed serve.yaml, or a checked
    :class:`~mars.serving.config.ServeConfig`), load the model, serve until interrupted."""
    sc = cfg if isinstance(cfg, ServeConfig) else ServeConfig.from_cfg(cfg)
    log.info("%s; loading the model", sc.describe())  # what is served, before the minutes a large model may take
    state = build_state(sc)
    app = create_app(state)
    info = state.info
    log.info(
        "listening on http://%s:%d (max_batch=%d, max_queue=%d, %s %s, context %d)",
        sc.host,
        sc.port,
        sc.max_batch,
        sc.max_queue,
        info.get("device"),
        info.get("dtype"),
        state.context_length,
    )
    server = DrainingServer(uvicorn_config(app, host=sc.host, port=sc.port, log_level=sc.log_level), state)
    # the server drains on SIGINT/SIGTERM and then re-raises the signal (as uvicorn does); both end here
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    log.info("server stopped")


class BackgroundServer:
    """Serve ``state`` on ``127.0.0.1`` (a free port unless given) from a daemon thread."""

    def __init__(self, state: ServingState, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.state = state
        self.app = create_app(state)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        self.server = DrainingServer(
            uvicorn_config(self.app, host=self.host, port=self.port, log_level=log_level), state
        )
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True, name="mars-uvicorn"
        )
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Shut down as on SIGTERM (drain, then close) and wait for the thread."""
        self.server.request_exit()
        if self.thread is not None:
            self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
