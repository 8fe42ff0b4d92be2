"""``conf/serve.yaml`` -> a checked :class:`ServeConfig` (before any model loads) -> a :class:`ServingState`.

Everything that can be wrong with the configuration fails here with a message naming the key: the
threshold policy (tau_policy) and its bounds, the decoding settings (the server needs the step-wise engine: decoder
``mars`` or ``jacobi``, cache ``cursor`` or ``none``; ``block`` cannot take requests mid-run), the
limits, the host and port, the allowed Host names and the API key (``api_key``, else the
``MARS_API_KEY`` environment variable, which keeps the key out of the run folder's saved config).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import warnings
from typing import Annotated, Any, Literal

from omegaconf import DictConfig, OmegaConf
from pydantic import AfterValidator, Field, PrivateAttr, model_validator

from mars.config_schema import DtypeName, OpenSection, validated
from mars.decoding.settings import DecodingSettings
from mars.metadata import decoding_block_size, read_checkpoint

from .policy import POLICIES, build_policy

log = logging.getLogger(__name__)

API_KEY_ENV = "MARS_API_KEY"


def _plain(value: Any) -> Any:
    if isinstance(value, DictConfig) or OmegaConf.is_config(value):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _non_blank(text: str) -> str:
    if not text.strip():
        raise ValueError("must be a non-empty string")
    return text


HostName = Annotated[str, AfterValidator(_non_blank)]


class ServeConfig(OpenSection):
    """``serve.yaml`` checked: every key with its type and range (values: the YAML file), then the checks
    across keys and the derived settings (:meth:`_derive`): the decoding settings, the checkpoint's metadata,
    the API key from the environment, the default completion budget and served name."""

    host: Annotated[str, Field(min_length=1, description="a host name or address")]
    port: Annotated[int, Field(ge=0, le=65535)]
    api_key: Annotated[str | None, AfterValidator(lambda k: k if k is None else _non_blank(k)), Field(repr=False)]
    allowed_hosts: Annotated[
        list[HostName] | None, Field(description="host names ('*' for any, '*.example.org' for subdomains)")
    ]
    model: dict[str, Any]
    checkpoint: str | None
    checkpoint_meta: dict[str, Any] | None = None  # derived: the checkpoint's mars_config.json
    decoding: dict[str, Any]  # checked by DecodingSettings (``settings``)
    tau_policy: Literal[POLICIES]
    threshold: float  # the bounds (tau_min, tau_max) and the adaptive settings: checked by the policy
    tau_min: float
    tau_max: float
    adaptive: dict[str, Any]
    max_batch: Annotated[int, Field(ge=1)]
    max_queue: Annotated[int, Field(ge=0)]
    max_tokens: Annotated[int, Field(ge=1, description="null: decoding.max_new_tokens")] | None
    max_model_len: Annotated[int, Field(ge=2)] | None
    served_model_name: str | None
    dtype: DtypeName
    device: str
    threads: Annotated[int, Field(ge=1)] | None
    shutdown_grace_s: Annotated[float, Field(ge=0)]
    warmup: bool
    log_level: str
    metrics_window_s: Annotated[float, Field(gt=0)]
    max_body_bytes: Annotated[int, Field(ge=1024)]
    _settings: DecodingSettings | None = PrivateAttr(default=None)

    @property
    def settings(self) -> DecodingSettings:
        """The decoding settings every request starts from (``decoding`` with the checkpoint's block size)."""
        return self._settings

    @model_validator(mode="after")
    def _derive(self) -> ServeConfig:
        if self.api_key is None and os.environ.get(API_KEY_ENV):
            self.api_key = _non_blank_env(os.environ[API_KEY_ENV])
        if self.host != "localhost" and not _is_loopback(self.host) and self.api_key is None:
            warnings.warn(
                f"host={self.host} exposes the server beyond this machine without an API key (set {API_KEY_ENV} "
                "or api_key)",
                RuntimeWarning,
                stacklevel=2,
            )
        if self.checkpoint:
            self.checkpoint_meta = read_checkpoint(self.checkpoint)
        self._settings = serving_settings(self.decoding, self.checkpoint_meta, self.device)
        # checks the bounds, the threshold and the adaptive settings without a model
        build_policy(
            self.tau_policy,
            threshold=self.threshold,
            tau_min=self.tau_min,
            tau_max=self.tau_max,
            metric=self._settings.metric,
            adaptive=self.adaptive,
        )
        if self.max_tokens is None:
            self.max_tokens = self._settings.max_new_tokens
        if not self.served_model_name:
            self.served_model_name = _default_name(self.model, self.checkpoint)
        return self

    @classmethod
    def from_cfg(cls, cfg: DictConfig | dict) -> ServeConfig:
        """The composed ``serve.yaml``, resolved and checked before any model loads."""
        data = dict(_plain(cfg))
        data.pop("hydra", None)
        return validated(cls, data)


def _non_blank_env(key: str) -> str:
    if not key.strip():
        raise ValueError(f"{API_KEY_ENV} must be a non-empty string when set")
    return key


# The column cap of a CPU server's batched steps (decoding.max_step_columns=auto): on a CPU a step of a few
# columns in all costs little more than a 1-column step (the weights are read once either way), but past that
# its cost grows with the columns, so a full batch's mask columns would slow every row; under this cap the
# mask policies keep tau 1.0's requests/s under load (measured: see docs/serving.md).
CPU_STEP_COLUMNS = 8


def step_columns(value: Any, device: str) -> int | None:
    """``decoding.max_step_columns`` as the server runs it: ``auto`` is :data:`CPU_STEP_COLUMNS` on a CPU and
    no cap on a GPU (a step there stays memory-bound up to hundreds of columns)."""
    if value != "auto":
        return value
    from mars.hardware import resolve_device

    return CPU_STEP_COLUMNS if resolve_device(device).startswith("cpu") else None


def serving_settings(decoding: dict[str, Any], meta: dict[str, Any] | None, device: str = "auto") -> DecodingSettings:
    """The server's decoding settings: the step-wise engine (decoder mars or jacobi; cache cursor or none,
    since ``block`` cannot take requests into a running batch); verification is per request."""
    values = {k: v for k, v in decoding.items() if k != "threshold"}  # the threshold is the policy's
    values["block_size"] = decoding_block_size(values.get("block_size"), meta)
    values["max_step_columns"] = step_columns(values.get("max_step_columns"), device)
    try:
        settings = DecodingSettings.from_mapping(values)
    except ValueError as err:
        raise ValueError(f"decoding: {err}") from None
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
    return settings


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _default_name(model: dict, checkpoint: str | None) -> str:
    """The checkpoint's run name, else the model config's id (as evaluation labels them)."""
    from mars.metadata import model_label

    return model_label({"checkpoint": checkpoint, "model": model})


def build_state(sc: ServeConfig, loaded=None):
    """Load the model (unless ``loaded`` is given) and build the engine loop and the routes' state."""
    import torch

    from mars.decoding.engine import DecodeEngine
    from mars.decoding.forward import ModelRunner
    from mars.decoding.stopping import eos_token_ids

    from .app import ServingState, longest_token_chars
    from .metrics import ServerMetrics
    from .scheduler import EngineLoop

    if sc.threads:
        torch.set_num_threads(sc.threads)
    if loaded is None:
        loaded = _load_served_model(sc)
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
    info = _server_info(settings, runner, context, mask_id)
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


def _load_served_model(sc: ServeConfig):
    """The checkpoint (or configured base model) on the configured device and dtype, with the mask token
    the checkpoint was trained with."""
    from mars.decoding.fastpath import decode_dtype_name
    from mars.hardware import resolve_device
    from mars.models import load_model

    device = resolve_device(sc.device)
    name = str(sc.checkpoint or sc.model["name_or_path"])
    mask_token = (sc.checkpoint_meta or {}).get("mask_token") or sc.model.get("mask_token")
    return load_model(
        name,
        tiny=sc.model.get("tiny") if not sc.checkpoint else None,
        mask_token=mask_token,
        allow_new_row=bool(sc.model.get("allow_new_embedding_row", False)),
        dtype=decode_dtype_name(sc.dtype, device),
        attn_implementation=sc.model.get("attn_implementation") or "sdpa",
        device=device,
    )


def _warm_up(engine, tokenizer) -> None:
    """Decodes two tokens of a throwaway request on its own engine."""
    engine.admit([engine.make_request(tokenizer("Hello")["input_ids"], max_new_tokens=2)])
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
