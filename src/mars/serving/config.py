"""``conf/serve.yaml`` -> a checked :class:`ServeConfig`, before any model loads (:mod:`~mars.serving.server`
builds the server from it).

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

from mars.config_schema import DtypeName, OpenSection, about, validated
from mars.decoding.settings import DecodingSettings, decoding_block_size, is_exact_threshold, tree_shape
from mars.metadata import mars_trained, read_checkpoint
from mars.paths import bundled_path

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

    host: Annotated[
        str,
        Field(min_length=1, description="a host name or address"),
        about("address to listen on (127.0.0.1: this machine only)"),
    ]
    port: Annotated[int, Field(ge=0, le=65535), about("port to listen on")]
    api_key: Annotated[
        str | None,
        AfterValidator(lambda k: k if k is None else _non_blank(k)),
        Field(repr=False),
        about("the key every /v1 route requires (Authorization: Bearer <key>); null: MARS_API_KEY, else no key"),
    ]
    allowed_hosts: Annotated[
        list[HostName] | None,
        Field(description="host names ('*' for any, '*.example.org' for subdomains)"),
        about("Host names answered besides IP addresses, localhost and host (a DNS-rebinding guard); '*': any"),
    ]
    model: Annotated[dict[str, Any], about("the base model (conf/model/): hub id or local folder, mask token")]
    checkpoint: Annotated[
        str | None,
        about(
            "a train.py export or gated adapter folder (its block size and mask token); default: the model's "
            "trained reference checkpoint; null: the model as it is (no MARS training)"
        ),
    ]
    checkpoint_meta: dict[str, Any] | None = None  # derived: the checkpoint's mars_config.json
    # checked by DecodingSettings (``settings``)
    decoding: Annotated[dict[str, Any], about("how to decode (conf/decoding/): decoder, block size, metric, cache")]
    tau_policy: Annotated[
        Literal[POLICIES], about("fixed (serve threshold) | adaptive (tau_max when idle, down to tau_min under load)")
    ]
    # the bounds (tau_min, tau_max) and the adaptive settings: checked by the policy
    threshold: Annotated[float, about("the fixed policy's tau (1.0: exactly greedy AR); requests may bring their own")]
    tau_min: Annotated[float, about("requests' own thresholds are clamped to [tau_min, tau_max]")]
    tau_max: Annotated[float, about("the strictest threshold served (the adaptive policy's when idle)")]
    adaptive: Annotated[dict[str, Any], about("the adaptive policy: signal (queue | latency), targets, rates")]
    max_batch: Annotated[int, Field(ge=1), about("rows decoded together (continuous batching)")]
    max_queue: Annotated[int, Field(ge=0), about("requests waiting beyond the free rows; more get 429")]
    max_tokens: Annotated[
        Annotated[int, Field(ge=1, description="null: decoding.max_new_tokens")] | None,
        about("default completion budget; null: decoding.max_new_tokens"),
    ]
    max_model_len: Annotated[
        Annotated[int, Field(ge=2)] | None, about("cap on prompt + completion tokens; null: the model's context")
    ]
    served_model_name: Annotated[str | None, about("the model name clients use; null: the run name or model.id")]
    dtype: Annotated[DtypeName, about("auto (bfloat16 on GPUs, float32 on CPUs) | float32 | bfloat16")]
    device: Annotated[str, about("auto (cuda if available) | cpu | cuda | cuda:1 ...")]
    threads: Annotated[Annotated[int, Field(ge=1)] | None, about("torch CPU threads; null: torch's default")]
    shutdown_grace_s: Annotated[
        float, Field(ge=0), about("on SIGTERM/Ctrl-C: seconds in-flight requests get before a 503")
    ]
    warmup: Annotated[bool, about("one tiny request before serving (one-off costs out of the first request)")]
    log_level: Annotated[str, about("debug | info | warning | error")]
    metrics_window_s: Annotated[float, Field(gt=0), about("window of the live tokens/s and tokens/forward figures")]
    max_body_bytes: Annotated[int, Field(ge=1024), about("larger request bodies get 413 before they are read")]
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
            from mars.calibration import check_stored_records

            self.checkpoint_meta = read_checkpoint(self.checkpoint)
            check_stored_records(self.checkpoint, self.checkpoint_meta)  # a bad record fails now, not at warm-up
        self._settings = serving_settings(self.decoding, self.checkpoint_meta, self.device)
        policy = self.threshold_policy()  # checks the bounds, the threshold and the adaptive settings
        self._warn_if_untrained(policy)
        if self.max_tokens is None:
            self.max_tokens = self._settings.max_new_tokens
        if not self.served_model_name:
            self.served_model_name = _default_name(self.model, self.checkpoint)
        return self

    def threshold_policy(self):
        """A new threshold policy of this config (fixed or adaptive, for the decoding metric); needs no model."""
        return build_policy(
            self.tau_policy,
            threshold=self.threshold,
            tau_min=self.tau_min,
            tau_max=self.tau_max,
            metric=self._settings.metric,
            adaptive=self.adaptive,
        )

    def _loosest(self, policy) -> tuple[str, float]:
        """The config key and value of the loosest threshold the server itself serves (requests may bring
        their own, inside the bounds): the fixed threshold, or the adaptive policy's relaxed bound."""
        if self.tau_policy == "fixed":
            return "threshold", policy.threshold
        return ("tau_max" if policy.metric == "entropy" else "tau_min"), policy.relaxed

    def _warn_if_untrained(self, policy) -> None:
        """Below the exact threshold a MARS row accepts its masks' predictions unverified, and only MARS
        training makes those right: an untrained model then answers garbage faster, so say so before loading."""
        key, value = self._loosest(policy)
        if self._settings.decoder != "mars" or policy.is_exact(value) or mars_trained(self.checkpoint_meta):
            return
        ref = float(policy.reference)
        log.warning(  # a log line, as vLLM warns at startup: it lands in the run folder's log with the rest
            "serving %s with tau_policy=%s %s=%s: without MARS training its masks' predictions are mostly wrong, and "
            "a threshold short of the exact %s accepts them unverified (verify requests stay exact); serve a MARS "
            "checkpoint (checkpoint=<train.py run>/hf; the default is the model's reference_checkpoint) or set %s=%s",
            self.model_description(),
            self.tau_policy,
            key,
            float(value),
            ref,
            key,
            ref,
        )

    def model_description(self) -> str:
        """What the server serves: the checkpoint or base model and whether its masks had MARS training."""
        if not self.checkpoint:
            return f"the base model {self.model.get('name_or_path')} (no MARS training)"
        meta = self.checkpoint_meta or {}
        trained = "MARS-trained" if mars_trained(meta) else f"no MARS training: objective {meta.get('objective')}"
        return f"checkpoint {self.checkpoint} ({trained})"

    def describe(self) -> str:
        """One line with what is served and how: model or checkpoint, threshold policy, decoder."""
        s = self._settings
        if self.tau_policy == "fixed":
            policy = f"tau_policy=fixed threshold={float(self.threshold)}"
        else:
            strict, relaxed = (self.tau_min, self.tau_max) if s.metric == "entropy" else (self.tau_max, self.tau_min)
            signal = self.adaptive.get("signal", "queue")
            policy = f"tau_policy=adaptive tau {float(strict)} idle -> {float(relaxed)} under load ({signal})"
        exact = (
            " (exact: greedy AR)" if self.tau_policy == "fixed" and is_exact_threshold(self.threshold, s.metric) else ""
        )
        return (
            f"serving {self.model_description()} as {self.served_model_name!r}: {policy}{exact}, metric={s.metric}, "
            f"decoder={s.decoder} block_size={s.block_size}, verify per request"
        )

    @classmethod
    def from_cfg(cls, cfg: DictConfig | dict) -> ServeConfig:
        """The composed ``serve.yaml``, resolved and checked before any model loads."""
        data = dict(_plain(cfg))
        data.pop("hydra", None)
        data["checkpoint"] = bundled_path(data.get("checkpoint"))
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
    check_verify_requests(settings)
    return settings


def check_verify_requests(settings: DecodingSettings) -> None:
    """What a verify request will decode with, checked before the model loads: the server's settings with
    ``verify`` (the decoding settings' own rules for it), and a tree shape that its rows' draft slots can hold
    (``draft_length``, the window's masks)."""
    if settings.decoder != "mars":
        return  # verify requests are refused per request (they draft with the MARS masks)
    try:
        verified = settings.replace(verify=True, threshold=settings.reference)
    except ValueError as err:
        raise ValueError(f"decoding: verify requests could not run: {err}") from None
    shape = tree_shape(verified.tree)
    window = verified.effective_window
    if shape is None or not isinstance(window, int):
        return
    slots = min(verified.effective_draft_length, window - 1)  # a verifying row's drafts, as the engine counts them
    if len(shape) > slots:
        raise ValueError(
            f"decoding.tree={verified.tree!r} is {len(shape)} deep, but a verifying row drafts at most {slots} "
            f"(decoding.draft_length={verified.draft_length}, window {window}): use a tree of at most {slots} "
            f"depth(s), tree=chain, or a larger draft_length"
        )


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _default_name(model: dict, checkpoint: str | None) -> str:
    """The checkpoint's run name, else the model config's id (as evaluation labels them)."""
    from mars.metadata import model_label

    return model_label({"checkpoint": checkpoint, "model": model})
