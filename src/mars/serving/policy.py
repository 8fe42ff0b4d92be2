"""The server's threshold policy: fixed, or load-adaptive between configured bounds.

MARS trades quality for tokens per forward through one number per request, so a server can buy
throughput under load without swapping models: lower the threshold when requests pile up, raise it again when
they drain.  The policy here is a small controller with no knowledge of the model:

* The **load signal** is a ratio to a target, ``x = load / target``: with ``signal="queue"`` the
  number of requests in the system (waiting + running) over ``target_queue``; with
  ``signal="latency"`` the larger of the recent finished-request latency (an average) and the age of
  the oldest request still in the system, over ``target_latency_s``.  An empty system has ``x = 0``.
* ``x`` is smoothed with an exponential moving average of time constant ``smoothing_s`` (updates
  arrive at irregular times, so the weight depends on the time since the last update).
* A **relax level** ``r`` in [0, 1] integrates the smoothed signal with a dead band: above ``high`` it
  grows at ``relax_rate`` per second, below ``low`` it shrinks at ``recover_rate`` per second, in
  between it holds.  The band is the hysteresis: a load that sits near the target does not make the
  threshold flap, and a short spike is damped by the average before it moves it.
* ``threshold = strict + r * (relaxed - strict)``: the strict end is the bound that is closer to exact greedy
  decoding (the bound ``tau_max`` for probability/margin, ``tau_min`` for entropy, where a *higher*
  number relaxes), the relaxed end the other bound.

A request's own threshold is honoured inside the server's bounds (clamped to them); a request with
verification (``verify``) and no threshold of its own is served at the reference threshold, where it is
lossless, and the load never moves it (with a threshold it asks for verified drafts plus the masks that meet it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mars.decoding.settings import is_exact_threshold, reference_threshold, validate_threshold

POLICIES = ("fixed", "adaptive")
SIGNALS = ("queue", "latency")


@dataclass(frozen=True)
class LoadSample:
    """What the engine loop sees at one moment (``now`` in seconds on a monotonic clock)."""

    now: float
    waiting: int  # queued, not admitted yet
    running: int  # rows in the running batch
    recent_latency_s: float | None = None  # average latency of recently finished requests
    oldest_age_s: float | None = None  # age of the oldest request in the system


@dataclass(frozen=True)
class AdaptiveSettings:
    signal: str = "queue"
    target_queue: float = 4.0
    target_latency_s: float = 10.0
    high: float = 1.0
    low: float = 0.5
    relax_rate: float = 0.5
    recover_rate: float = 0.1
    smoothing_s: float = 2.0

    def __post_init__(self) -> None:
        if self.signal not in SIGNALS:
            raise ValueError(f"adaptive.signal must be one of {list(SIGNALS)}, got {self.signal!r}")
        for name in ("target_queue", "target_latency_s", "high", "relax_rate", "recover_rate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"adaptive.{name} must be a number > 0, got {value!r}")
        if isinstance(self.low, bool) or not isinstance(self.low, (int, float)) or not 0 <= self.low < self.high:
            raise ValueError(f"adaptive.low must be a number in [0, adaptive.high={self.high}), got {self.low!r}")
        if isinstance(self.smoothing_s, bool) or not isinstance(self.smoothing_s, (int, float)) or self.smoothing_s < 0:
            raise ValueError(f"adaptive.smoothing_s must be a number >= 0, got {self.smoothing_s!r}")


class ThresholdPolicy:
    """Base: bounds, clamping of requested thresholds, and the current threshold."""

    name = "base"

    def __init__(self, threshold_min: float, threshold_max: float, metric: str = "probability"):
        lo = validate_threshold(threshold_min, metric)
        hi = validate_threshold(threshold_max, metric)
        if lo > hi:  # the bounds' config keys are tau_min and tau_max
            raise ValueError(f"tau_min={threshold_min} is above tau_max={threshold_max}")
        self.metric = metric
        self.threshold_min, self.threshold_max = lo, hi
        # the end closer to exact greedy decoding, and the other one
        self.strict, self.relaxed = (lo, hi) if metric == "entropy" else (hi, lo)
        self.threshold = self.strict

    @property
    def reference(self) -> float:
        return reference_threshold(self.metric)

    def clamp(self, threshold: float) -> float:
        return min(max(float(threshold), self.threshold_min), self.threshold_max)

    def for_request(self, requested: float | None, verify: bool = False) -> float:
        """The threshold a request is served at: its own (inside the bounds) or the current one; a verifying
        request without one is served lossless (the reference), whatever the load."""
        if requested is None:
            return self.reference if verify else self.threshold
        return self.clamp(requested)

    def is_exact(self, threshold: float) -> bool:
        return is_exact_threshold(threshold, self.metric)

    def update(self, sample: LoadSample) -> float:  # pragma: no cover - overridden
        raise NotImplementedError

    def describe(self) -> dict:
        # the /stats keys (read by the page and the load test) keep the config's names
        return {
            "policy": self.name,
            "tau": self.threshold,
            "tau_min": self.threshold_min,
            "tau_max": self.threshold_max,
        }


class FixedThreshold(ThresholdPolicy):
    """One threshold for every request that does not bring its own."""

    name = "fixed"

    def __init__(self, threshold: float, threshold_min: float, threshold_max: float, metric: str = "probability"):
        super().__init__(threshold_min, threshold_max, metric)
        value = validate_threshold(threshold, metric)
        if not threshold_min <= value <= threshold_max:
            raise ValueError(f"threshold={threshold} lies outside [tau_min={threshold_min}, tau_max={threshold_max}]")
        self.threshold = value

    def update(self, sample: LoadSample) -> float:
        return self.threshold


class AdaptiveThreshold(ThresholdPolicy):
    """Load-adaptive threshold; see the module docstring for the control law."""

    name = "adaptive"

    def __init__(
        self,
        threshold_min: float,
        threshold_max: float,
        settings: AdaptiveSettings | None = None,
        metric: str = "probability",
    ):
        super().__init__(threshold_min, threshold_max, metric)
        self.settings = settings or AdaptiveSettings()
        self.level = 0.0  # 0 = strict end, 1 = relaxed end
        self.smoothed = 0.0
        self.raw = 0.0
        self._last: float | None = None

    def load_ratio(self, s: LoadSample) -> float:
        """The unsmoothed load signal: 1.0 means "at the target"."""
        if s.waiting + s.running == 0:
            return 0.0
        cfg = self.settings
        if cfg.signal == "queue":
            return (s.waiting + s.running) / cfg.target_queue
        seen = max(s.recent_latency_s or 0.0, s.oldest_age_s or 0.0)
        return seen / cfg.target_latency_s

    def update(self, sample: LoadSample) -> float:
        cfg = self.settings
        self.raw = self.load_ratio(sample)
        if self._last is None:
            dt = 0.0
            self.smoothed = self.raw
        else:
            dt = max(0.0, sample.now - self._last)
            weight = 1.0 if cfg.smoothing_s == 0 else 1.0 - math.exp(-dt / cfg.smoothing_s)
            self.smoothed += weight * (self.raw - self.smoothed)
        self._last = sample.now
        if self.smoothed > cfg.high:
            self.level = min(1.0, self.level + cfg.relax_rate * dt)
        elif self.smoothed < cfg.low:
            self.level = max(0.0, self.level - cfg.recover_rate * dt)
        self.threshold = self.strict + self.level * (self.relaxed - self.strict)
        return self.threshold

    def describe(self) -> dict:
        return {**super().describe(), "level": self.level, "load": self.smoothed, "signal": self.settings.signal}


def build_policy(
    name: str,
    *,
    threshold: float,
    tau_min: float,
    tau_max: float,
    metric: str = "probability",
    adaptive: dict | None = None,
) -> ThresholdPolicy:
    """``fixed`` (serves ``threshold``) or ``adaptive`` (moves between the bounds with the load); the
    bounds keep their config keys' names (``tau_min``, ``tau_max``)."""
    if name == "fixed":
        return FixedThreshold(threshold, tau_min, tau_max, metric)
    if name == "adaptive":
        values = dict(adaptive or {})
        unknown = sorted(set(values) - set(AdaptiveSettings.__dataclass_fields__))
        if unknown:
            raise ValueError(
                f"unknown adaptive setting(s) {unknown}; allowed: {sorted(AdaptiveSettings.__dataclass_fields__)}"
            )
        return AdaptiveThreshold(tau_min, tau_max, AdaptiveSettings(**values), metric)
    raise ValueError(f"tau_policy must be one of {list(POLICIES)}, got {name!r}")
