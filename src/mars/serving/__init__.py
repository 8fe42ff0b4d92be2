"""Serving MARS: an OpenAI-compatible HTTP server with continuous batching, per-request thresholds and a
load-adaptive threshold (``python serve.py``; see docs/serving.md).

Modules, one job each: :mod:`~mars.serving.config` (serve.yaml -> checked config),
:mod:`~mars.serving.app` (FastAPI routes), :mod:`~mars.serving.scheduler` (the engine loop thread),
:mod:`~mars.serving.policy` (fixed / adaptive threshold), :mod:`~mars.serving.metrics` (Prometheus),
:mod:`~mars.serving.schemas` (request bodies, errors), :mod:`~mars.serving.textstream` (streamed text),
:mod:`~mars.serving.ui` (the page at ``/``), :mod:`~mars.serving.server` (checked config -> state: the model
loaded, the engine loop; uvicorn).

Importing this package is cheap; the pieces load on first use.
"""

_LAZY = {
    "ServeConfig": ".config",
    "build_state": ".server",
    "create_app": ".app",
    "ServingState": ".app",
    "EngineLoop": ".scheduler",
    "Job": ".scheduler",
    "AdaptiveThreshold": ".policy",
    "FixedThreshold": ".policy",
    "LoadSample": ".policy",
    "build_policy": ".policy",
    "BackgroundServer": ".server",
    "run": ".server",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'mars.serving' has no attribute {name!r}")


__all__ = list(_LAZY)
