"""Running the app: ``serve.py``'s body (:func:`run`) and :class:`BackgroundServer` (uvicorn in a thread on
a free loopback port, for tests, notebooks and the load test's in-process mode).

Shutdown (Ctrl-C / SIGTERM, or ``BackgroundServer.stop``): uvicorn stops accepting connections and waits
up to ``shutdown_grace_s`` for open requests (streams included) to finish; then the app's lifespan stops
the engine loop, which cancels whatever is still running (those clients get 503) and ends its thread.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time

import uvicorn

from .app import ServingState, create_app

log = logging.getLogger(__name__)


def uvicorn_config(app, *, host: str, port: int, grace_s: float, log_level: str = "info") -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=grace_s,
        lifespan="on",
        access_log=False,
    )


def run(cfg) -> None:
    """``python serve.py ...``: check the config, load the model, serve until interrupted."""
    from .config import ServeConfig, build_state

    sc = ServeConfig.from_cfg(cfg)
    log.info("loading %s", sc.checkpoint or sc.model.get("name_or_path"))
    state = build_state(sc)
    app = create_app(state)
    log.info(
        "serving %s on http://%s:%d (tau_policy=%s, max_batch=%d, max_queue=%d) %s",
        state.model_name,
        sc.host,
        sc.port,
        sc.tau_policy,
        sc.max_batch,
        sc.max_queue,
        state.info,
    )
    server = uvicorn.Server(
        uvicorn_config(app, host=sc.host, port=sc.port, grace_s=sc.shutdown_grace_s, log_level=sc.log_level)
    )
    # uvicorn shuts down gracefully on SIGINT/SIGTERM and then re-raises the signal; both end here
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
        self.server = uvicorn.Server(
            uvicorn_config(
                self.app, host=self.host, port=self.port, grace_s=state.shutdown_grace_s, log_level=log_level
            )
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
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
