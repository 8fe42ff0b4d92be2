"""``conf/serve.yaml`` -> a checked :class:`ServeConfig` (before any model loads) -> a :class:`ServingState`.

Everything that can be wrong with the configuration fails here with a message naming the key: the
tau policy and its bounds, the decoding settings (the server needs the step-wise engine: decoder
``mars`` or ``jacobi``, cache ``cursor`` or ``none``; ``block`` cannot take requests mid-run), the
limits, the host and port, the allowed Host names and the API key (``api_key``, else the
``MARS_API_KEY`` environment variable, which keeps the key out of the run folder's saved config).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from mars.decoding.settings import DecodingSettings

from .policy import POLICIES, build_policy
from .schemas import DEFAULT_MAX_BODY_BYTES

log = logging.getLogger(__name__)

API_KEY_ENV = "MARS_API_KEY"


def _plain(value: Any) -> Any:
    if isinstance(value, DictConfig) or OmegaConf.is_config(value):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _int(cfg: dict, key: str, lo: int, hi: int | None = None, allow_none: bool = False) -> int | None:
    value = cfg.get(key)
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        span = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{key} must be an integer {span}{' or null' if allow_none else ''}, got {value!r}")
    return value


@dataclass
class ServeConfig:
    host: str
    port: int
    model: dict
    checkpoint: str | None
    checkpoint_meta: dict | None
    settings: DecodingSettings
    tau_policy: str
    threshold: float
    tau_min: float
    tau_max: float
    adaptive: dict
    max_batch: int
    max_queue: int
    max_tokens: int
    max_model_len: int | None
    served_model_name: str
    dtype: str = "auto"
    device: str = "auto"
    threads: int | None = None
    shutdown_grace_s: float = 10.0
    warmup: bool = True
    log_level: str = "info"
    metrics_window_s: float = 10.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    allowed_hosts: list[str] | None = None
    api_key: str | None = field(default=None, repr=False)
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_cfg(cls, cfg: DictConfig | dict) -> ServeConfig:
        c = _plain(cfg)
        host = c.get("host", "127.0.0.1")
        if not isinstance(host, str) or not host:
            raise ValueError(f"host must be a host name or address, got {host!r}")
        port = _int(c, "port", 0, 65535)
        api_key = c.get("api_key")
        if api_key is None:
            api_key = os.environ.get(API_KEY_ENV) or None
        if api_key is not None and (not isinstance(api_key, str) or not api_key.strip()):
            raise ValueError(f"api_key must be a non-empty string or null, got a {type(api_key).__name__}")
        if host not in ("localhost",) and not _is_loopback(host) and api_key is None:
            warnings.warn(
                f"host={host} exposes the server beyond this machine without an API key (set {API_KEY_ENV} or api_key)",
                RuntimeWarning,
                stacklevel=2,
            )
        allowed_hosts = c.get("allowed_hosts")
        if allowed_hosts is not None and (
            not isinstance(allowed_hosts, list) or not all(isinstance(h, str) and h.strip() for h in allowed_hosts)
        ):
            raise ValueError(
                f"allowed_hosts must be a list of host names ('*' for any, '*.example.org' for subdomains) "
                f"or null, got {allowed_hosts!r}"
            )
        checkpoint = c.get("checkpoint")
        meta = None
        decoding = dict(c.get("decoding") or {})
        if checkpoint:
            from mars.evaluation.config import checkpoint_metadata

            meta = checkpoint_metadata(checkpoint)
        if decoding.get("block_size") is None:
            decoding["block_size"] = int(meta["block_size"]) if meta and meta.get("block_size") else 4
        decoding.pop("threshold", None)
        settings = DecodingSettings.from_mapping(decoding)
        if settings.decoder not in ("mars", "jacobi"):
            raise ValueError(
                f"decoding.decoder={settings.decoder!r} cannot serve: the server runs the step-wise "
                "engine (mars or jacobi); plain AR is decoding=mars with threshold=1.0"
            )
        if settings.cache == "block":
            raise ValueError(
                "decoding.cache='block' synchronises rows on block boundaries and cannot take requests "
                "into a running batch; use cache=cursor (continuous batching) or none"
            )
        if settings.verify:
            raise ValueError("decoding.verify is per request on the server (the 'verify' body field)")
        policy = str(c.get("tau_policy", "fixed"))
        if policy not in POLICIES:
            raise ValueError(f"tau_policy must be one of {list(POLICIES)}, got {policy!r}")
        threshold, tau_min, tau_max = c.get("threshold", 1.0), c.get("tau_min"), c.get("tau_max")
        adaptive = dict(c.get("adaptive") or {})
        # checks bounds, threshold and the adaptive settings without a model
        build_policy(
            policy, threshold=threshold, tau_min=tau_min, tau_max=tau_max, metric=settings.metric, adaptive=adaptive
        )
        max_tokens = c.get("max_tokens")
        if max_tokens is None:
            max_tokens = settings.max_new_tokens
        model = dict(c.get("model") or {})
        name = c.get("served_model_name") or _default_name(model, checkpoint)
        grace = c.get("shutdown_grace_s", 10.0)
        if isinstance(grace, bool) or not isinstance(grace, (int, float)) or grace < 0:
            raise ValueError(f"shutdown_grace_s must be a number >= 0, got {grace!r}")
        return cls(
            host=host,
            port=port,
            model=model,
            checkpoint=checkpoint,
            checkpoint_meta=meta,
            settings=settings,
            tau_policy=policy,
            threshold=float(threshold),
            tau_min=float(tau_min),
            tau_max=float(tau_max),
            adaptive=adaptive,
            max_batch=_int(c, "max_batch", 1),
            max_queue=_int(c, "max_queue", 0),
            max_tokens=_int({"max_tokens": max_tokens}, "max_tokens", 1),
            max_model_len=_int(c, "max_model_len", 2, allow_none=True),
            served_model_name=str(name),
            dtype=str(c.get("dtype", "auto")),
            device=str(c.get("device", "auto")),
            threads=_int(c, "threads", 1, allow_none=True),
            shutdown_grace_s=float(grace),
            warmup=bool(c.get("warmup", True)),
            log_level=str(c.get("log_level", "info")),
            metrics_window_s=float(c.get("metrics_window_s", 10.0)),
            max_body_bytes=_int(
                {"max_body_bytes": c.get("max_body_bytes", DEFAULT_MAX_BODY_BYTES)}, "max_body_bytes", 1024
            ),
            allowed_hosts=allowed_hosts,
            api_key=api_key,
        )


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _default_name(model: dict, checkpoint: str | None) -> str:
    """The checkpoint's run name, else the model config's id (as evaluation labels them)."""
    from mars.labels import model_label

    return model_label({"checkpoint": checkpoint, "model": model})


def build_state(sc: ServeConfig, loaded=None):
    """Load the model (unless ``loaded`` is given) and build the engine loop and the routes' state."""
    import torch

    from mars.decoding.engine import DecodeEngine
    from mars.decoding.forward import ModelRunner
    from mars.decoding.stopping import eos_token_ids
    from mars.hardware import resolve_device, resolve_dtype_name

    from .app import ServingState, longest_token_chars
    from .metrics import ServerMetrics
    from .scheduler import EngineLoop

    if sc.threads:
        torch.set_num_threads(sc.threads)
    if loaded is None:
        from mars.models import load_model

        device = resolve_device(sc.device)
        name = str(sc.checkpoint or sc.model["name_or_path"])
        mask_token = (sc.checkpoint_meta or {}).get("mask_token") or sc.model.get("mask_token")
        loaded = load_model(
            name,
            tiny=sc.model.get("tiny") if not sc.checkpoint else None,
            mask_token=mask_token,
            allow_new_row=bool(sc.model.get("allow_new_embedding_row", False)),
            dtype=resolve_dtype_name(sc.dtype, device),
            attn_implementation=sc.model.get("attn_implementation") or "sdpa",
            device=device,
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
        engine = make_engine()
        engine.admit([engine.make_request(tokenizer("Hello")["input_ids"], max_new_tokens=2)])
        while engine.live:
            engine.step()
    policy = build_policy(
        sc.tau_policy,
        threshold=sc.threshold,
        tau_min=sc.tau_min,
        tau_max=sc.tau_max,
        metric=settings.metric,
        adaptive=sc.adaptive,
    )
    metrics = ServerMetrics(sc.metrics_window_s)
    loop = EngineLoop(make_engine, policy, metrics, tokenizer, eos, max_batch=sc.max_batch, max_queue=sc.max_queue)
    info = {
        "decoder": settings.decoder,
        "block_size": settings.block_size,
        "metric": settings.metric,
        "cache": settings.cache,
        "max_model_len": context,
        "dtype": str(next(model.parameters()).dtype),
        "device": str(runner.device),
        "mask_token_id": mask_id,
    }
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
        info=info,
    )
